"""Per-GPU memory of a run, from its config alone (no weights load): the dominant terms, one table.

    python tools/memory_plan.py --config config.yaml                       # 8 GPUs of 80 GiB
    python tools/memory_plan.py --config configs/rm_nlhf.yaml --world 8 --gpu-gib 141
    python tools/memory_plan.py --config configs/gpu_check.yaml --world 1 rollout.group_size=16

The YAML is read here (config.yaml, then each --config file over it, then key=value overrides,
values typed by YAML), so the plan needs no model, no GPU and no network. A model's shape comes
from SHAPES (the hub ids the shipped presets name, from their public config.json) or from a local
folder's / the GGUF package's config.json (rollout.resolve_model_path).

What is counted, per GPU, as rank 0 holds it (B = model.dtype's bytes, 2 for bf16; GiB = 2**30;
P parameters, L layers, h hidden, a / kv heads of d_h, i the MLP width, V the vocabulary):
  policy weights    4 P            float32 master weights; / world under FSDP2
  gradients         4 P_t          float32; P_t = P, or LoRA's r (in + out) per adapted Linear
  AdamW             8 P_t          exp_avg + exp_avg_sq, float32
  grad buckets      4 P_t          DDP at world > 1 (FSDP2 reduce-scatters every micro-batch)
  gathered weights  B (root + 2 layers) under FSDP2 (one in flight, one prefetched);
                    B P            under DDP with a 16-bit dtype (autocast's weight-cast cache)
  activations       per micro-batch of m rows x T = prompt + new tokens (train.micro_batch_size),
                    what autograd saves per layer and token: two RMSNorms 2 (4 h + 4 + r h), their
                    outputs 2 B h, q and the attention output 2 B a d_h, SwiGLU's four 4 B i;
                    + K and V per row 2 B kv d_h T. Checkpointing "none": L such layers;
                    otherwise each layer's input L T m r h + one layer's set while it is replayed.
                    r = the residual stream's bytes: B under FSDP2 mixed precision, 4 under autocast
  logits chunk      c V (B + 8)    c = min(m x new tokens, 1024) positions (CHUNK):
                                   logits in B, their float32 log-softmax and, replayed in the
                                   backward (rollout.completion_logprobs), its float32 gradient
  LM-head gradient  4 V h          the [V, h] float32 weight gradient
  KV cache          rows (prompt + new) L 2 kv d_h B   HF generate; rows = rollout.micro_batch_size
                                   or the rank's prompts x group
  vLLM share        rollout.vllm_gpu_memory_utilization x GPU (its weights + KV cache), awake
  vLLM asleep       VLLM_ASLEEP in every stage: what sleep(level=1) leaves on the GPU (the
                    CUDA-graph pool, the model runner's persistent buffers); an estimate (below)
  NCCL NVLS         2 c k s h a communicator x NVLS_COMMS at world > 1 (c 16 channels on Hopper,
                    k 128 KiB chunks x s 8 steps, h = the node's GPUs); 0 with NCCL_NVLS_ENABLE=0
  frozen copies     B P each       the GRPO reference (algo.kl_coef > 0), frozen evaluators
  MetaRM (rm_nlhf)  16 P_m         weights, gradients, AdamW (/ world under FSDP2) + activations
                                   of train.micro_batch_size rows x metarm.max_length tokens (a
                                   forward of metarm.fit; every rank runs every example)
  reserve           0.5 GiB CUDA context (+ 1.5 GiB NCCL at world > 1) + 10 % of the stage's torch
                    bytes (the caching allocator's fragmentation; reported figures, not measured).
                    With vLLM, no PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against it:
                    0.19.1's sleep-mode allocator asserts at engine start (docs/scale-out.md)
  host RAM          B P per engine x min(world, 8) engines a node: sleep level 1 copies the
                    weights to pinned CPU memory (vLLM's cumem.py); per node, in no stage
Stages: setup (the engine awake from its start through the MetaRM cold start; no AdamW state
yet), rollout (also a resume: AdamW loaded beside the awake engine), reward, validation (RLME,
run.eval_every > 0: the evaluators score with the engine awake after the push), MetaRM (rm_nlhf),
update; each = resident + its own + reserve; peak = max. Sources of the vLLM and NCCL figures:
docs/scale-out.md, "Memory plan" (vLLM docs, source and issues; NCCL's src/transport/nvls.cc).

Simplified from the old plumbing/plan.py (679 lines + 478 of plan_check + 106 of plan_tables): the
exact autograd bookkeeping per tensor (q/k norms, masks, SDPA's log-sum-exp, the padded prompt
pass), the checkpoint stage, the trainer's host-RAM figures, the start-up stop, the doc-table
generator and the fake-process-group measurement are gone (setup with the cold start,
validation, vLLM's residue and host RAM, NVLS came back with issue 44); the terms above are
within a few % of those for the shipped presets, which is what a plan is for.
"""
import argparse
import json
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RESERVE_CONTEXT, RESERVE_NCCL, FRAGMENTATION = GiB // 2, 3 * GiB // 2, 0.10
PROMPT_TOKENS = {"rlme": 256, "rm_nlhf": 2048}  # assumed when rollout.max_prompt_tokens is 0
CHUNK = 1024  # positions per log-prob chunk: rollout.completion_logprobs' chunk_tokens
# What vLLM keeps on the GPU asleep: the CUDA-graph pool and persistent buffers stay (its sleep
# releases only the weights and KV cache pools, vllm-project/vllm PR #56373). No figure for our
# models is documented: an ESTIMATE from vLLM's log "Estimated CUDA graph memory: 0.52 GiB" (an
# 8B model, default capture sizes; LMCache issue #3430) and sglang's ~0.8 GB a rank (PR #32718)
VLLM_ASLEEP = GiB
# NCCL >= 2.21 NVLS buffers (src/transport/nvls.cc, ncclNvlsBufferSetup): nChannels (16 on SM90)
# x 2 x NCCL_NVLS_CHUNKSIZE (128 KiB) x NCCL_STEPS (8) x nHeads (the node's GPUs) a communicator;
# NVLS_COMMS: torch's default group and vLLM's world group (its first collective makes one)
NVLS_CHANNELS, NVLS_CHUNK, NVLS_STEPS, NVLS_COMMS, NODE_GPUS = 16, 128 * 1024, 8, 2, 8
# (layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tied, qkv bias) of the hub ids
# the presets name, from each model's config.json on the hub; the plan never goes online.
SHAPES = {
    "Qwen/Qwen3-4B": (36, 2560, 32, 8, 128, 9728, 151936, True, False),
    "Qwen/Qwen3-4B-Base": (36, 2560, 32, 8, 128, 9728, 151936, True, False),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": (28, 3584, 28, 4, 128, 18944, 152064, False, True),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": (32, 4096, 32, 8, 128, 14336, 128256, False, False),
    "meta-llama/Llama-3.2-3B": (28, 3072, 24, 8, 128, 8192, 128256, True, False),
    "meta-llama/Llama-3.2-3B-Instruct": (28, 3072, 24, 8, 128, 8192, 128256, True, False),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------------------
# The config, read here (train.py's loader checks keys; a plan only reads them)

def merge(base, layer):
    """Deep-merge dict `layer` into `base` in place (lists and scalars replace). Returns base."""
    for k, v in layer.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
    return base


def read_config(paths=(), overrides=(), root=ROOT):
    """config.yaml, then each file in `paths`, then `a.b=value` overrides (YAML-typed) -> dict.
    Raises SystemExit (one line) on a missing file, bad YAML or an override without '='."""
    cfg = {}
    schema = os.path.join(root, "config.yaml")
    for p in [schema] + [p for p in paths if os.path.abspath(p) != os.path.abspath(schema)]:
        try:
            with open(p) as f:
                merge(cfg, yaml.safe_load(f) or {})
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"memory plan: config file {p}: {str(e).splitlines()[0]}")
    for o in overrides:
        key, eq, val = o.partition("=")
        if not eq:
            raise SystemExit(f"memory plan: override {o!r}: expected key.sub=value")
        *parents, last = key.split(".")
        node = {last: yaml.safe_load(val)}
        for part in reversed(parents):
            node = {part: node}
        merge(cfg, node)
    return cfg


def get(cfg, key, default=None):
    """cfg["a"]["b"] for key "a.b"; `default` when a level is missing (keys come and go)."""
    for part in key.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return default
        cfg = cfg[part]
    return default if cfg is None else cfg


# ----------------------------------------------------------------------------------------------
# A model's shape and parameter count

def model_shape(path):
    """{layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tied, bias} of model `path`:
    SHAPES for a hub id kept there, else its config.json (a folder, or the folder
    rollout.resolve_model_path makes of a gguf: package). SystemExit (one line) when unreadable."""
    keys = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tied",
            "bias")
    if path in SHAPES:
        return dict(zip(keys, SHAPES[path]))
    folder = path
    if not os.path.isdir(folder):
        try:
            sys.path.insert(0, ROOT)
            import rollout  # tools may import the product: it converts a GGUF once, to its cache
            folder = rollout.resolve_model_path(path)
        except (ImportError, OSError, SystemExit, ValueError) as e:
            raise SystemExit(f"memory plan: model {path!r}: not in SHAPES, not readable ({e})")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"memory plan: model {path!r}: no readable config.json in {folder} ({e})")
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    return dict(zip(keys, (c["num_hidden_layers"], c["hidden_size"], heads,
                           c.get("num_key_value_heads") or heads,
                           c.get("head_dim") or c["hidden_size"] // heads, c["intermediate_size"],
                           c["vocab_size"], bool(c.get("tie_word_embeddings", False)),
                           bool(c.get("attention_bias", c.get("model_type") == "qwen2")))))


def linear_shapes(s):
    """{name: (in, out)} of one decoder layer's Linears (Llama / Qwen: GQA attention, SwiGLU)."""
    h, i = s["hidden"], s["intermediate"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return dict(zip(LINEARS, ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))))


def layer_params(s):
    """Parameters of one decoder layer: its Linears, their q/k/v biases (Qwen2), two RMSNorms."""
    lin = linear_shapes(s)
    bias = sum(lin[n][1] for n in LINEARS[:3]) if s["bias"] else 0
    return sum(a * b for a, b in lin.values()) + bias + 2 * s["hidden"]


def param_count(s):
    """P = V h (embeddings; x 2 with an untied LM head) + L layer_params + h (the final norm).
    Qwen3's per-head q/k norms (2 d_h a layer, 0.01 % of P) are left out."""
    embeddings = s["vocab"] * s["hidden"] * (1 if s["tied"] else 2)
    return embeddings + s["layers"] * layer_params(s) + s["hidden"]


def lora_params(s, r, targets):
    """LoRA's trained elements: r (in + out) per adapted Linear (A [r, in], B [out, r])."""
    names = LINEARS if targets == "all-linear" else [t for t in LINEARS if t in targets]
    lin = linear_shapes(s)
    return s["layers"] * sum(r * sum(lin[n]) for n in names)


def activation_bytes(s, *, rows, tokens, B, r, checkpointing):
    """Bytes a training forward saves for `rows` sequences of `tokens` each (see the header)."""
    h, i, a, kv, dh = s["hidden"], s["intermediate"], s["heads"], s["kv_heads"], s["head_dim"]
    per_token = 2 * (4 * h + 4 + r * h) + 2 * B * h + 2 * B * a * dh + 4 * B * i
    one_layer = rows * tokens * (per_token + 2 * B * kv * dh)
    if checkpointing in (None, False, "none"):
        return s["layers"] * one_layer
    return s["layers"] * rows * tokens * r * h + one_layer  # full (and selective, counted as full)


# ----------------------------------------------------------------------------------------------
# The plan

def memory_plan(cfg, *, world=8, gpu_bytes=80 * GiB, prompt_tokens=None):
    """The per-GPU plan of config dict `cfg` on `world` GPUs of `gpu_bytes` each.

    Returns dict: model, params, world, gpu_bytes, prompt_tokens, items {name: (bytes, note)},
    host {name: (bytes per node, note)}, stages {stage: (bytes incl. reserve, [item names])},
    peak_stage, peak_bytes, fits.
    """
    task = get(cfg, "task", "rlme")
    s = model_shape(get(cfg, "model.policy"))
    P, B = param_count(s), BYTES[get(cfg, "model.dtype", "bfloat16")]
    fsdp = get(cfg, "train.parallel", "ddp") == "fsdp2" and world > 1
    shard = world if fsdp else 1
    r = B if fsdp else 4  # FSDP2 computes in model.dtype; DDP's autocast keeps float32 residuals
    lora = get(cfg, "model.lora")
    trained = (lora_params(s, lora.get("r", 8), lora.get("target_modules", "all-linear"))
               if isinstance(lora, dict) else P)
    tp = prompt_tokens or get(cfg, "rollout.max_prompt_tokens", 0) or PROMPT_TOKENS[task]
    tn, G = get(cfg, "rollout.max_new_tokens", 1024), get(cfg, "rollout.group_size", 8)
    rows = max(1, get(cfg, "rollout.prompts_per_step", 64) * G // world)
    mb = min(get(cfg, "train.micro_batch_size", 4), rows)
    ck = get(cfg, "model.gradient_checkpointing", "none")
    items = {}

    def add(name, nbytes, note):
        items[name] = (int(nbytes), note)

    where = f"1/{world} FSDP2 shard" if fsdp else "replicated"
    add("policy weights", 4 * P / shard, f"float32 master, {where}")
    add("gradients", 4 * trained / (shard if not lora else 1),
        "float32" + (" (LoRA adapters)" if lora else ", as the weights"))
    add("AdamW state", 8 * trained / (shard if not lora else 1), "exp_avg + exp_avg_sq, float32")
    if world > 1 and not fsdp:  # FSDP2 reduce-scatters each micro-batch: only its shard stays
        add("grad buckets", 4 * trained, "DDP's gradient buckets")
    root = s["vocab"] * s["hidden"] * (1 if s["tied"] else 2)
    add("gathered weights", B * (root + 2 * layer_params(s)) if fsdp else (B * P if B != 4 else 0),
        "root + 2 layers in flight" if fsdp else "autocast's weight-cast cache")
    add("activations", activation_bytes(s, rows=mb, tokens=tp + tn, B=B, r=r, checkpointing=ck),
        f"{mb} rows x {tp + tn} tokens, checkpointing {ck}")
    c = min(mb * tn, CHUNK)
    add("logits chunk", c * s["vocab"] * (B + 8), f"{c} positions x {s['vocab']} vocab")
    add("LM-head gradient", 4 * s["vocab"] * s["hidden"], "[V, h] float32")
    kv_token = s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * B
    vllm, host = get(cfg, "rollout.backend", "vllm") == "vllm", {}
    if vllm:
        util = get(cfg, "rollout.vllm_gpu_memory_utilization", 0.3)
        add("vLLM share", util * gpu_bytes, f"{util} x GPU: its weights + KV cache")
        add("vLLM asleep", VLLM_ASLEEP, "CUDA-graph pool + buffers sleep keeps (estimate)")
        engines = min(world, NODE_GPUS)
        host["vLLM sleep backup"] = (B * P * engines, f"{engines} engines x the weights in "
                                     f"{get(cfg, 'model.dtype', 'bfloat16')}, pinned, per node")
    else:
        m = min(get(cfg, "rollout.micro_batch_size", 0) or rows, rows)
        add("KV cache", m * (tp + tn) * kv_token, f"HF generate, {m} rows x {tp + tn} tokens")
    frozen = P if get(cfg, "algo.kl_coef", 0.0) > 0 else 0
    if task == "rlme":
        for ev in get(cfg, "reward.evaluators", []) or []:
            if ev.get("kind") in ("frozen", "frozen_self"):
                frozen += param_count(model_shape(ev.get("path") or get(cfg, "model.policy")))
        sc = get(cfg, "reward.micro_batch_size", 8)
        add("scoring KV cache", sc * (tp + tn + 128) * kv_token, f"{sc} evaluator prompts, no grad")
    add("frozen copies", B * frozen / shard, "GRPO reference / frozen evaluators")
    if world > 1 and os.environ.get("NCCL_NVLS_ENABLE", "") != "0":
        heads = min(world, NODE_GPUS)
        add("NCCL NVLS", NVLS_COMMS * NVLS_CHANNELS * 2 * NVLS_CHUNK * NVLS_STEPS * heads,
            f"{NVLS_COMMS} communicators x {heads} heads (NVSwitch; NCCL_NVLS_ENABLE=0: none)")
    if task == "rm_nlhf" and get(cfg, "metarm.mode", "online") != "offline":
        ms = s  # the MetaRM's base is the policy's (model.policy)
        Pm, mw = param_count(ms), world if fsdp else 1
        add("MetaRM state", 16 * Pm / mw, "float32 weights + gradients + AdamW")
        mrows = get(cfg, "train.micro_batch_size", 4)  # a forward: metarm.fit's micro-batch
        mB = BYTES[get(cfg, "metarm.dtype", "float32")]
        length, mck = get(cfg, "metarm.max_length", 8192), get(cfg, "metarm.gradient_checkpointing")
        add("MetaRM activations", activation_bytes(ms, rows=mrows, tokens=length, B=mB, r=4,
                                                   checkpointing="full" if mck else None),
            f"{mrows} rows x {length} tokens")
    base = ["policy weights", "frozen copies", "MetaRM state", "vLLM asleep", "NCCL NVLS"]
    resident = base + ["AdamW state"]
    stage_items = {"setup": base + ["vLLM share", "MetaRM activations"],
                   "rollout": resident + ["vLLM share", "KV cache"],
                   "reward": resident + ["scoring KV cache"],
                   "validation": resident + ["vLLM share", "scoring KV cache"],
                   "MetaRM": resident + ["MetaRM activations"],
                   "update": resident + ["gradients", "grad buckets", "gathered weights",
                                         "activations", "logits chunk", "LM-head gradient"]}
    stages = {}
    for stage, names in stage_items.items():
        names = [n for n in names if n in items]
        if stage == "MetaRM" and "MetaRM activations" not in names:
            continue  # no MetaRM (RLME, or metarm.mode offline)
        if stage == "reward" and task != "rlme":
            continue  # RM-NLHF's reward is the judge's (a server) and the MetaRM's
        if stage == "validation" and not (vllm and get(cfg, "run.eval_every", 0)
                                          and "scoring KV cache" in names):
            continue  # the engine sleeps before every other scoring
        torch_bytes = sum(items[n][0] for n in names if not n.startswith(("vLLM", "NCCL")))
        reserve = RESERVE_CONTEXT + (RESERVE_NCCL if world > 1 else 0) + FRAGMENTATION * torch_bytes
        stages[stage] = (int(sum(items[n][0] for n in names) + reserve), names)
    peak = max(stages, key=lambda k: stages[k][0])
    return {"model": get(cfg, "model.policy"), "params": P, "world": world, "gpu_bytes": gpu_bytes,
            "prompt_tokens": tp, "items": items, "host": host, "stages": stages, "peak_stage": peak,
            "peak_bytes": stages[peak][0], "fits": stages[peak][0] <= gpu_bytes}


def plan_table(p):
    """The plan as text: one line per item, then per stage, then the peak."""
    lines = [f"memory plan per GPU (rank 0 of {p['world']}): {p['model']}, "
             f"{p['params'] / 1e9:.3f} B parameters, prompts of {p['prompt_tokens']} tokens",
             f"{'item':20} {'GiB':>8}  note"]
    lines += [f"{n:20} {b / GiB:8.3f}  {note}" for n, (b, note) in p["items"].items() if b]
    lines += [f"{n:20} {b / GiB:8.3f}  host RAM: {note}" for n, (b, note) in p["host"].items()]
    lines.append(f"{'stage':20} {'GiB':>8}  = resident + its own + reserve")
    for stage, (b, names) in p["stages"].items():
        own = ", ".join(n for n in names if p["items"][n][0])
        lines.append(f"{stage:20} {b / GiB:8.3f}  {own}")
    verdict = "fits" if p["fits"] else f"DOES NOT FIT ({p['peak_stage']})"
    lines.append(f"peak {p['peak_bytes'] / GiB:.2f} GiB ({p['peak_stage']}) on a "
                 f"{p['gpu_bytes'] / GiB:.0f} GiB GPU: {verdict}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--config", action="append", default=[], help="a preset over config.yaml")
    ap.add_argument("--world", type=int, default=8, help="GPUs (FSDP2 shards over them)")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt length to plan for")
    ap.add_argument("overrides", nargs="*", help="key=value, as train.py takes them")
    a = ap.parse_args(argv)
    if a.world < 1 or a.gpu_gib <= 0:
        raise SystemExit("memory plan: --world and --gpu-gib must be positive")
    p = memory_plan(read_config(a.config, a.overrides), world=a.world,
                    gpu_bytes=int(a.gpu_gib * GiB), prompt_tokens=a.prompt_tokens)
    print(plan_table(p))
    if "vLLM share" in p["items"] and "expandable_segments:True" in os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", ""):
        print("warning: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: vLLM 0.19.1's sleep "
              "mode asserts at engine start (docs/scale-out.md, Memory plan): unset it")
    return 0 if p["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
