"""The memory plan (issue 26 item 4; docs/scale-out.md "Memory plan"): per GPU, the bytes of
everything a run holds, from the config alone, no weights.

    python train.py --config config.yaml --plan [--world-size 8] [--gpu-memory 80]

The model is built from its config on the meta device (real shapes, no storage); hub ids are read
from plumbing/model_configs/ (their public config.json, kept here so the plan works offline), a
local folder from its config.json, a GGUF package model from its header. `memory_plan` returns a
dict (also for scripts/gpu_check.sh, to compare with torch.cuda.max_memory_allocated);
`plan_table` prints it; `check_memory_plan` stops a GPU run that cannot fit, at start-up, before
any model loads, with one line naming the key to change.

What is counted, per GPU, as rank 0 holds it (GiB = 2**30 bytes):
  - the trained policy's float32 master weights, float32 gradients and AdamW's two float32 moments
    (+ its float32 `step` scalar per tensor): sharded along dim 0 by FSDP2 (torch.chunk: rank r
    holds rows [r c, (r + 1) c), c = ceil(d0 / world)), replicated under DDP (plumbing/scale.py
    wrap_policy; the AdamW of plumbing/run.py start_run);
  - under FSDP2 with more than one micro-batch per optimizer step, the unsharded float32 gradient
    FSDP2 accumulates over the micro-batches before the synced one reduce-scatters it
    (plumbing/scale.py grad_sync); under DDP with world > 1 its gradient buckets (another copy);
  - the compute-dtype weights in flight: FSDP2 on GPU gathers the root module (embeddings, final
    norm, lm_head) and one decoder layer plus the prefetched next one; DDP's autocast caches a
    compute-dtype copy of every weight during the forward; the HF rollout under FSDP2 unshards the
    whole model (plumbing/scale.py unsharded);
  - activations of one micro-batch (`activation_bytes`), its logits (`logits_bytes`);
  - frozen copies in model.dtype: the GRPO reference (algo.kl_coef > 0; none under LoRA with
    fast paths; FSDP2-sharded as the policy under fsdp2, plumbing/scale.py shard_frozen, its
    no-grad pass gathering a layer at a time as the policy's "gathered weights" do), reward.evaluators of kind frozen (their own model) and frozen_self (the policy's);
    live and remote evaluators hold nothing more;
  - the MetaRM (rm_nlhf): a sequence classifier on metarm.model (plumbing/run.py load_metarm):
    under train.parallel fsdp2 with world > 1 FSDP2-sharded float32 master + gradients + AdamW,
    the root and two layers gathered in metarm.dtype, each rank training on its share of a batch,
    ceil(metarm.batch_size / world) x metarm.max_length tokens (metarm.py fit); else a float32
    replica with autocast's metarm.dtype weight cache and all metarm.batch_size rows; activation
    checkpointing as metarm.gradient_checkpointing says;
  - vLLM: rollout.vllm_gpu_memory_utilization x the GPU while it samples (its weights + KV cache;
    asleep ~0); and the KV cache the rollout needs, layers x 2 x kv_heads x head_dim x dtype bytes
    x tokens (the group's prompt counted once: vLLM's prefix cache), against the share left after
    its weights. The HF backend holds that KV cache itself, for rollout.micro_batch_size rows;
  - a fixed 1 GiB for the CUDA context, NCCL buffers and allocator slack (RESERVE).
Stages: rollout, reward, update, checkpoint; each peak is the resident set plus that stage's own.
Not counted: the no-grad passes of the update (smaller than its training pass), host memory.
"""
import copy
import json
import math
import os

import torch

GiB = 2**30
RESERVE = 1 * GiB  # CUDA context + NCCL buffers + allocator slack (an estimate, not measured)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODEL_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")
# prompt tokens assumed when the config does not bound them ({data,nlhf}.max_prompt_tokens 0):
# GSM8K prompts are ~130 tokens (fast.completion_logprobs); an RM-NLHF pair prompt ~2k (our guess)
TYPICAL_PROMPT_TOKENS = {"rlme": 256, "rm_nlhf": 2048}
CHUNK_EXAMPLE = 1024  # the chunk the plan shows for chunked log-probs when train.logprob_chunk_tokens is unset


def model_config(path):
    """The transformers config of model `path` without its weights and without the network when it
    can: plumbing/model_configs/<org>--<name>.json for a hub id kept there, else a local folder's
    config.json, a GGUF package file's header (gguf:<package>/<file>), else the HF cache (never the hub).
    Raises SystemExit (one line) when none can be read."""
    from transformers import AutoConfig
    from plumbing.models import _gguf_location
    bundled = os.path.join(MODEL_CONFIGS, path.replace("/", "--") + ".json")
    try:
        if os.path.isfile(bundled):
            with open(bundled) as f:
                d = json.load(f)
            return AutoConfig.for_model(d.pop("model_type"), **d)
        loc = _gguf_location(path)
        if loc is not None:
            return AutoConfig.from_pretrained(loc[0], gguf_file=loc[1])
        if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") != 1):
            raise SystemExit(f"memory plan: model path {path!r} does not exist (a folder with config.json, "
                             f"a hub id org/name or gguf:<package>/<file>)")
        return AutoConfig.from_pretrained(path, local_files_only=True)  # the plan never goes online
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"memory plan: cannot read the config of model {path!r} ({msg}); "
                         f"a hub id must be in plumbing/model_configs/ or the HF cache")


def meta_model(config, num_labels=None):
    """The model of `config` on the meta device (shapes, no storage): a causal LM, or with
    `num_labels` the sequence classifier the MetaRM is (plumbing/run.py load_metarm)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    with torch.device("meta"):
        if num_labels is None:
            return AutoModelForCausalLM.from_config(config)
        config = copy.deepcopy(config)
        config.num_labels = num_labels
        return AutoModelForSequenceClassification.from_config(config)


def shard_numel(shape, world, rank=0):
    """Elements of one parameter on `rank` under FSDP2's dim-0 sharding (torch.chunk: chunks of
    ceil(d0 / world) rows, the last ones shorter or empty)."""
    numel = math.prod(shape)
    if not shape or world == 1:
        return numel
    c = -(-shape[0] // world)
    rows = max(0, min(shape[0], (rank + 1) * c) - rank * c)
    return rows * numel // shape[0]


def shape_facts(model):
    """Numbers of an HF model the formulas need: {params, tensors: [shape], layer_params (the
    largest decoder layer), root_params (outside the decoder layers), layers, hidden, heads,
    kv_heads, head_dim, intermediate, vocab}."""
    cfg = model.config.get_text_config()
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    in_layers = {id(p) for m in layers for p in m.parameters()}
    params = list(model.parameters())  # tied weights once
    heads = cfg.num_attention_heads
    return {"params": sum(p.numel() for p in params), "tensors": [tuple(p.shape) for p in params],
            "layer_params": max((sum(p.numel() for p in m.parameters()) for m in layers), default=0),
            "root_params": sum(p.numel() for p in params if id(p) not in in_layers),
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size}


def layer_activation_elements(*, hidden, heads, kv_heads, head_dim, intermediate):
    """Elements autograd saves per token in one decoder layer (Llama / Qwen: RMSNorm, GQA
    attention, SwiGLU MLP) without checkpointing, listed tensor by tensor in the manner of
    Korthikanti et al. 2022 (arXiv:2205.05198 §4.1, whose GPT count is 34 s b h bytes):
        2 h       input RMSNorm: its input and output (the q/k/v matmuls' shared input)
        2 (a + kv) d_h   SDPA / flash attention: q, k, v and its output (o_proj's input); no
                  s^2 score matrix (memory-efficient kernels), k/v not repeated to a heads
        2 h       post-attention RMSNorm: input and output (gate/up's shared input)
        4 i       MLP: gate output (SiLU's input), SiLU output and up output (the product's
                  inputs), the product (down_proj's input)
    RMSNorm's float32 internals, RoPE's cos/sin and dropout masks (none) are left out.
    Returns an int (elements; times the compute dtype's bytes for bytes)."""
    return 4 * hidden + 2 * (heads + kv_heads) * head_dim + 4 * intermediate


def activation_bytes(*, tokens, layers, hidden, heads, kv_heads, head_dim, intermediate, dtype_bytes,
                     checkpointing, prompt_tokens=0, prompt_rows=0):
    """Bytes of one micro-batch's saved activations in the policy update.

    Args:
        tokens: tokens run under model.gradient_checkpointing (micro-batch rows x their length).
        checkpointing: "none": every layer's layer_activation_elements per token;
            "full": each layer's input (h per token) kept, one layer's full set live while
            backward replays it (plumbing/scale.py wrap_policy);
            "selective": the layer input plus the matmul outputs kept (q, k, v [a + 2 kv] d_h,
            o_proj h, gate and up 2 i, down h: plumbing/scale.py keep_matmul_outputs), one
            layer's full set while it is replayed.
        prompt_tokens, prompt_rows: fast.completion_logprobs runs each distinct prompt of the
            micro-batch once, with grad; under checkpointing "none" its prompt_rows x
            prompt_tokens tokens at the full per-layer count (memory_plan passes them as `tokens`
            under full / selective: fast.prefill checkpoints that pass too), plus the cache
            repeated to the rows (counted by the caller).
    Returns an int (bytes).
    """
    per_layer = layer_activation_elements(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                          intermediate=intermediate)
    kept = {"none": layers * per_layer,
            "full": layers * hidden + per_layer,
            "selective": layers * (3 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * intermediate) + per_layer
            }[checkpointing]
    return (tokens * kept + prompt_rows * prompt_tokens * layers * per_layer) * dtype_bytes


def logits_bytes(*, rows, tokens, vocab, dtype_bytes, plain, chunk_tokens=0):
    """Bytes of the update's logits for one micro-batch (rollout.completion_logprobs /
    fast.completion_logprobs): only the positions that predict completion tokens.

    rows x tokens x vocab x (dtype_bytes for the LM head's output in the compute dtype + 4 for
    its float32 copy); the plain path (train.fast_paths false) also materialises the float32
    log-softmax and, in backward, its float32 gradient (+ 8); the fast path's closed-form backward
    overwrites the float32 logits in place (fast.token_logprobs). chunk_tokens > 0: a chunked
    log-prob holds only that many positions' logits at a time (train.logprob_chunk_tokens).
    Returns an int (bytes)."""
    positions = rows * tokens if chunk_tokens <= 0 else min(rows * tokens, chunk_tokens)
    return positions * vocab * (dtype_bytes + 4 + (8 if plain else 0))


def kv_bytes_per_token(facts, dtype_bytes):
    """KV cache bytes per token: layers x 2 (K and V) x kv_heads x head_dim x dtype bytes."""
    return facts["layers"] * 2 * facts["kv_heads"] * facts["head_dim"] * dtype_bytes


def distinct_prompts(rows, micro_batch, group_size):
    """The most groups (distinct prompts) any micro-batch of this rank's `rows` spans: rows of a
    group sit together, micro-batches are consecutive slices."""
    return max(((min(s + micro_batch, rows) - 1) // group_size - s // group_size + 1
                for s in range(0, rows, micro_batch)), default=0)


def lora_params(model, lora):
    """(trained LoRA elements, tensors): A [r, in] and B [out, r] per adapted Linear (plumbing/scale.py apply_lora)."""
    targets = lora["target_modules"]
    n = k = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name and (targets == "all-linear" and not name.endswith("lm_head")
                                                     or targets != "all-linear" and any(name == t or name.endswith("." + t) for t in targets)):
            n, k = n + lora["r"] * (m.in_features + m.out_features), k + 2
    return n, k


def memory_plan(cfg, *, world, gpu_bytes, rank=0, prompt_tokens=None):
    """The memory plan of `cfg` (the loaded config) on `world` GPUs of `gpu_bytes` each, as rank `rank`.

    Args:
        prompt_tokens: prompt length to plan for; default {data,nlhf}.max_prompt_tokens, or
            TYPICAL_PROMPT_TOKENS when that is 0 (unbounded).
    Returns:
        dict: world, rank, gpu_bytes, model, params, prompt_tokens (+ prompt_assumed), items
        {name: bytes}, notes {name: str}, stages {stage: {"bytes", "items": [names]}}, peak_stage,
        peak_bytes, fits, kv_cache_needed, kv_cache_room (vLLM only), logits_chunked
        (the logits at train.logprob_chunk_tokens, or CHUNK_EXAMPLE when unset), chunk_tokens.
    """
    m, t, ro, algo, task = cfg["model"], cfg["train"], cfg["rollout"], cfg["algo"], cfg["task"]
    d = BYTES[m["dtype"]]
    policy = meta_model(model_config(m["policy"]))
    f = shape_facts(policy)
    fsdp = t["parallel"] == "fsdp2"
    lora = m["lora"]
    section = "nlhf" if task == "rm_nlhf" else "data"
    assumed = prompt_tokens is None and not cfg[section]["max_prompt_tokens"]
    tp = prompt_tokens or cfg[section]["max_prompt_tokens"] or TYPICAL_PROMPT_TOKENS[task]
    tn, G, mb = ro["max_new_tokens"], ro["group_size"], t["micro_batch_size"]
    rows = ro["prompts_per_step"] * G // world
    rows_per_step = -(-rows // algo["minibatches"])
    items, notes = {}, {}

    def add(name, nbytes, note):
        items[name], notes[name] = int(nbytes), note

    # the trained policy: master weights, gradients, AdamW (exact, tests/plumbing/test_plan.py)
    shard = [shard_numel(s, world if fsdp else 1, rank if fsdp else 0) for s in f["tensors"]]
    trained, n_trained = lora_params(policy, lora) if lora else (sum(shard), len(shard))
    add("policy weights", 4 * sum(shard), f"float32 master, {'1/' + str(world) + ' FSDP2 shard' if fsdp else 'full (ddp)'}")
    add("policy gradients", 4 * trained, "float32, as the weights" + (" (LoRA adapters only)" if lora else ""))
    add("AdamW state", 8 * trained + 4 * n_trained, "exp_avg + exp_avg_sq float32 (+ step)")
    if t["cpu_offload"]:  # FSDP2's CPUOffloadPolicy: shards, gradients and the AdamW step live in host memory
        for name in ("policy weights", "policy gradients", "AdamW state"):
            add(name, 0, "in host memory (train.cpu_offload)")
    micro = -(-rows_per_step // mb)
    every = fsdp and t["fsdp_reduce_every_micro_batch"]  # reduce-scatter each micro-batch: only the shard (policy gradients)
    add("gradient accumulation", 4 * f["params"] if fsdp and micro > 1 and not every else 4 * trained if world > 1 and not fsdp else 0,
        f"FSDP2: unsharded float32 gradient over {micro} micro-batches" if fsdp else "DDP gradient buckets")
    if fsdp:
        add("gathered weights", (f["root_params"] + 2 * f["layer_params"]) * d, "root + a layer + the prefetched one, compute dtype")
    else:
        add("gathered weights", f["params"] * d if d != 4 else 0, "autocast's compute-dtype weight cache")

    # the update's micro-batch: activations and logits
    plain = not t["fast_paths"]
    shared = not plain and G > 1
    rows_p = distinct_prompts(rows_per_step, mb, G) if shared else 0
    arch = {k: f[k] for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")}
    add("activations", activation_bytes(tokens=mb * (tn if shared else tp + tn), dtype_bytes=d,
                                        checkpointing=m["gradient_checkpointing"], **arch),
        f"{mb} x {tn if shared else tp + tn} tokens, checkpointing {m['gradient_checkpointing']}")
    ck = m["gradient_checkpointing"]  # fast.prefill checkpoints the prompt pass too unless "none"
    add("prompt pass", (activation_bytes(tokens=0, dtype_bytes=d, checkpointing="none", prompt_tokens=tp - 1, prompt_rows=rows_p, **arch)
                        if ck == "none" else activation_bytes(tokens=rows_p * (tp - 1), dtype_bytes=d, checkpointing=ck, **arch))
        + (mb * tp * kv_bytes_per_token(f, d) if shared else 0),
        f"fast path: {rows_p} x {tp - 1} prompt tokens once per group, "
        f"{'not checkpointed' if ck == 'none' else 'checkpointing ' + ck}, + its KV cache x {mb} rows")
    chunk = 0 if plain else int(t.get("logprob_chunk_tokens", 0) or 0)  # a fast path (fast.head_logprobs)
    full_logits = logits_bytes(rows=mb, tokens=tn, vocab=f["vocab"], dtype_bytes=d, plain=plain)
    chunked = logits_bytes(rows=mb, tokens=tn, vocab=f["vocab"], dtype_bytes=d, plain=plain, chunk_tokens=chunk or CHUNK_EXAMPLE)
    add("logits", chunked if chunk else full_logits,
        f"chunked: {chunk} tokens (train.logprob_chunk_tokens)" if chunk else
        f"{mb} x {tn} x {f['vocab']} (compute dtype + float32{' + log-softmax + grad' if plain else ''})")

    # frozen copies
    ref = algo["loss"] == "grpo" and algo["kl_coef"] > 0 and not (lora and t["fast_paths"])
    add("GRPO reference", (sum(shard) if fsdp else f["params"]) * d if ref else 0,  # plumbing/scale.py shard_frozen
        f"frozen initial policy, model.dtype, {'1/' + str(world) + ' FSDP2 shard' if fsdp else 'replicated (ddp)'}")
    frozen, names = 0, []
    rlme = task == "rlme" and cfg["reward"]["kind"] in ("rlme", "hybrid")
    for e in cfg["reward"]["evaluators"] if rlme else []:
        if e["kind"] == "frozen":
            frozen += shape_facts(meta_model(model_config(e["path"])))["params"] * d
            names.append(e["name"])
        elif e["kind"] == "frozen_self" and not (lora and t["fast_paths"]):
            frozen += f["params"] * d
            names.append(e["name"])
    add("frozen evaluators", frozen, ", ".join(names) or "live / remote only")

    # the MetaRM (rm_nlhf): FSDP2-sharded like the policy under fsdp2 with world > 1 (plumbing/run.py
    # load_metarm), each rank training on its share of a batch (metarm.py fit); else a float32 replica
    mr = cfg["metarm"]
    if task == "rm_nlhf" and mr["mode"] != "none":
        mm = meta_model(model_config(mr["model"] or m["policy"]), num_labels=3 if mr["mode"] == "classifier" else 1)
        mf = shape_facts(mm)
        md = BYTES[mr["dtype"]]
        mw = world if fsdp and world > 1 else 1
        msh = sum(shard_numel(s, mw, rank if mw > 1 else 0) for s in mf["tensors"])
        where = f"1/{mw} FSDP2 shard" if mw > 1 else "full replica"
        trains = mr["mode"] != "offline"
        add("MetaRM weights", 4 * msh, f"float32, {where}")
        add("MetaRM AdamW state", 8 * msh + 4 * len(mf["tensors"]) if trains else 0, f"float32, {where}")
        add("MetaRM gradients", 4 * msh if trains else 0, f"float32, {where} (reward stage)")
        mrows, ck = -(-mr["batch_size"] // mw), "full" if mr["gradient_checkpointing"] else "none"
        gathered = mf["root_params"] + 2 * mf["layer_params"] if mw > 1 else mf["params"] if md != 4 else 0
        add("MetaRM activations", activation_bytes(tokens=mrows * mr["max_length"], dtype_bytes=md, checkpointing=ck,
                                                   **{k: mf[k] for k in arch}) + gathered * md,
            f"{mrows} x {mr['max_length']} tokens{' (its share of metarm.batch_size)' if mw > 1 else ''}, checkpointing {ck}, "
            f"{mr['dtype']}; + {'root + 2 layers gathered' if mw > 1 else 'autocast weight cache'}")

    # rollout: vLLM's share, or the HF loop's own KV cache and unsharded weights
    kvt = kv_bytes_per_token(f, d)
    needed = (ro["prompts_per_step"] // world * tp + rows * tn) * kvt
    room = None
    if ro["backend"] == "vllm":
        add("vLLM engine", ro["vllm_gpu_memory_utilization"] * gpu_bytes, f"{ro['vllm_gpu_memory_utilization']} x GPU: weights + KV cache")
        room = int(ro["vllm_gpu_memory_utilization"] * gpu_bytes - f["params"] * d)
    else:
        hf_rows = ro["micro_batch_size"] or rows
        add("rollout KV cache", hf_rows * (tp + tn) * kvt, f"HF decode, {hf_rows} rows x {tp + tn} tokens")
        add("unsharded weights", f["params"] * d if fsdp else 0, "the HF rollout under FSDP2, compute dtype")
    if cfg["task"] == "rlme" and rlme:
        add("scoring KV cache", cfg["reward"]["micro_batch_size"] * (tp + tn + 128) * kvt, "reward.micro_batch_size rows, evaluator prompt")
    add("reserve", RESERVE, "CUDA context, NCCL, allocator slack (estimate)")

    resident = ["policy weights", "AdamW state", "GRPO reference", "frozen evaluators", "MetaRM weights",
                "MetaRM AdamW state", "reserve"]
    stage_items = {"rollout": resident + ["vLLM engine", "rollout KV cache", "unsharded weights"],
                   "reward": resident + ["scoring KV cache", "MetaRM gradients", "MetaRM activations"]
                   + (["gathered weights"] if fsdp else []),
                   "update": resident + ["policy gradients", "gradient accumulation", "gathered weights", "activations", "prompt pass",
                              "logits"],
                   "checkpoint": resident}
    stages = {s: {"items": [n for n in names_ if n in items], "bytes": sum(items.get(n, 0) for n in names_)}
              for s, names_ in stage_items.items()}
    stages["checkpoint"]["bytes"] += 4 * max(math.prod(s) for s in f["tensors"])  # one gathered float32 tensor
    peak = max(stages, key=lambda s: stages[s]["bytes"])
    return {"world": world, "rank": rank, "gpu_bytes": int(gpu_bytes), "model": m["policy"], "params": f["params"],
            "prompt_tokens": tp, "rows_per_step": rows_per_step, "prompt_assumed": assumed, "items": items, "notes": notes, "stages": stages,
            "peak_stage": peak, "peak_bytes": stages[peak]["bytes"], "fits": stages[peak]["bytes"] <= gpu_bytes,
            "kv_cache_needed": int(needed), "kv_cache_room": room, "chunk_tokens": chunk or CHUNK_EXAMPLE,
            "logits_full": int(full_logits), "logits_chunked": int(chunked)}


def plan_table(p):
    """The plan as a readable table (rank `p["rank"]`'s view, per GPU)."""
    g = lambda b: f"{b / GiB:8.2f}"
    lines = [f"memory plan per GPU (rank {p['rank']} of {p['world']}): {p['model']}, {p['params'] / 1e9:.2f} B parameters, "
             f"prompts of {p['prompt_tokens']} tokens" + (" (assumed: set max_prompt_tokens to bound them)" if p["prompt_assumed"] else ""),
             f"{'what':24} {'GiB':>8}  {'stages':35} note"]
    for name, b in p["items"].items():
        if b:
            where = ", ".join(s for s, v in p["stages"].items() if name in v["items"]) or "-"
            lines.append(f"{name:24} {g(b)}  {where:35} {p['notes'][name]}")
    if p["logits_chunked"] != p["logits_full"] and p["items"]["logits"] == p["logits_full"]:
        lines.append(f"{'logits (chunked: ' + str(p['chunk_tokens']) + ')':24} {g(p['logits_chunked'])}  "
                     f"{'(train.logprob_chunk_tokens)':35} would save {(p['logits_full'] - p['logits_chunked']) / GiB:.2f} GiB")
    kv = f"rollout KV cache needed {p['kv_cache_needed'] / GiB:.2f} GiB"
    if p["kv_cache_room"] is not None:
        kv += f", vLLM share after its weights {p['kv_cache_room'] / GiB:.2f} GiB"
    lines.append(kv)
    lines.append("peaks: " + ", ".join(f"{s} {v['bytes'] / GiB:.1f}" for s, v in p["stages"].items())
                 + f" GiB; GPU {p['gpu_bytes'] / GiB:.1f} GiB: "
                 + ("fits" if p["fits"] else f"DOES NOT FIT ({p['peak_stage']})"))
    return "\n".join(lines)


def what_to_change(p, cfg):
    """The key to change when the plan does not fit: the biggest item of the peak stage that a key
    reduces. Returns a str."""
    keys = {"activations": "model.gradient_checkpointing=full" if cfg["model"]["gradient_checkpointing"] != "full"
            else f"train.micro_batch_size (now {cfg['train']['micro_batch_size']})",
            "prompt pass": f"train.fast_paths=false or {'nlhf' if cfg['task'] == 'rm_nlhf' else 'data'}.max_prompt_tokens",
            "logits": f"train.micro_batch_size (now {cfg['train']['micro_batch_size']})",
            "vLLM engine": f"rollout.vllm_gpu_memory_utilization (now {cfg['rollout']['vllm_gpu_memory_utilization']})",
            "rollout KV cache": f"rollout.micro_batch_size (now {cfg['rollout']['micro_batch_size']})",
            "MetaRM activations": f"metarm.batch_size (now {cfg['metarm']['batch_size']}) or metarm.max_length",
            "scoring KV cache": f"reward.micro_batch_size (now {cfg['reward']['micro_batch_size']})",
            "frozen evaluators": "reward.evaluators (a remote evaluator holds no copy)",
            "GRPO reference": "algo.kl_coef (0: no reference copy)",
            "gradient accumulation": f"train.fsdp_reduce_every_micro_batch=true or train.micro_batch_size (now {cfg['train']['micro_batch_size']}; at the rank's "
                                     f"{p['rows_per_step']} rows a step FSDP2 keeps no unsharded gradient)",
            "policy weights": "train.cpu_offload=true", "AdamW state": "train.cpu_offload=true"}
    stage = p["stages"][p["peak_stage"]]["items"]
    name = max((n for n in stage if n in keys), key=lambda n: p["items"][n])
    return f"{name} {p['items'][name] / GiB:.1f} GiB: change {keys[name]}"


def check_memory_plan(cfg, world, device, gpu_bytes=None):
    """Start-up check on a GPU (plumbing/run.py setup, before any model loads): SystemExit with
    one line naming the key to change when the plan's peak exceeds this GPU's memory (`gpu_bytes`,
    default the device's). A model whose config cannot be read here is left to the model load to
    report. No check on the CPU (the plan is for GPUs)."""
    if device.type != "cuda" and gpu_bytes is None:
        return
    gpu = gpu_bytes or torch.cuda.get_device_properties(device).total_memory
    try:
        p = memory_plan(cfg, world=world, gpu_bytes=gpu)
    except SystemExit as e:
        print(f"[train] {e} (memory plan skipped)", flush=True)
        return
    if not p["fits"]:
        raise SystemExit(f"memory plan: the {p['peak_stage']} stage needs {p['peak_bytes'] / GiB:.1f} GiB per GPU "
                         f"(world {world}), over this GPU's {gpu / GiB:.1f} GiB; biggest: {what_to_change(p, cfg)} "
                         f"(python train.py --config ... --plan prints the table)")


def add_plan_flags(ap):
    """train.py's --plan, --world-size, --gpu-memory flags; returns the parser."""
    ap.add_argument("--plan", action="store_true",
                    help="print the per-GPU memory plan (plumbing/plan.py; no weights load) and exit")
    ap.add_argument("--world-size", type=int, default=None,
                    help="GPUs the plan is for (default: $WORLD_SIZE, else 8: the presets' one 8-GPU node)")
    ap.add_argument("--gpu-memory", type=float, default=None,
                    help="GiB per GPU the plan must fit (default: this machine's GPU, else 80)")
    return ap


def print_plan(cfg, world=None, gpu_gb=None):
    """--plan: print plan_table for `world` GPUs (default $WORLD_SIZE, else 8) of `gpu_gb` GiB
    (default this GPU's, else 80). Returns the plan dict."""
    world = world or int(os.environ.get("WORLD_SIZE", 8))
    if world < 1 or (gpu_gb is not None and gpu_gb <= 0):
        raise SystemExit("--plan: --world-size and --gpu-memory must be positive")
    if gpu_gb is None:
        gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 80 * GiB
    else:
        gpu = gpu_gb * GiB
    if cfg["rollout"]["prompts_per_step"] % world:
        raise SystemExit(f"config key rollout.prompts_per_step={cfg['rollout']['prompts_per_step']}: "
                         f"not divisible by the plan's world size {world}")
    p = memory_plan(cfg, world=world, gpu_bytes=gpu)
    print(plan_table(p), flush=True)
    if not p["fits"]:
        print(f"does not fit: {what_to_change(p, cfg)}", flush=True)
    return p
