"""The memory plan (issues 26 and 34; docs/scale-out.md "Memory plan"): per GPU, the bytes of
everything a run holds in every stage it goes through, from the config alone, no weights.

    python train.py --config config.yaml --plan [--world-size 8] [--gpu-memory 80]

The model is built from its config on the meta device (real shapes, no storage); hub ids are read
from plumbing/model_configs/ (their public config.json, kept here so the plan works offline), a
local folder from its config.json, a GGUF package model from its header. `memory_plan` returns a
dict (also for scripts/gpu_check.py, to compare with torch.cuda.max_memory_allocated);
`plan_table` prints it; `check_memory_plan` stops a GPU run that cannot fit, at start-up, before
any model loads, with one line naming the key to change.

Stages, in the order a run meets them (each peak = what is resident then + that stage's own):
  setup           models built on the meta device and sharded before their weights arrive: rank 0
                  reads one model at a time into host RAM and broadcasts it a tensor at a time
                  (torch.distributed.checkpoint.state_dict's broadcast_from_rank0), so a GPU holds
                  its shards + one full float32 tensor (the bucket); a resume reads the AdamW shards
  cold start      RM-NLHF, a fresh run with metarm.cold_start: the GRM samples metarm.rollouts_per_prompt
                  rollouts for metarm.cold_start_batch_size D_H prompts per sample() call, through
                  the preset's engine (vLLM awake, or the HF loop's KV cache + unsharded weights)
  cold-start fit  the MetaRM trains on them (the engine asleep; no second copy of the GRM)
  rollout         vLLM's share, or the HF decode loop's KV cache, unsharded weights and prefill
  reward          RLME: the evaluator's scoring pass and KV cache; RM-NLHF: the judge (a server)
  MetaRM update   its gradients, activations (its share of metarm.batch_size) and gathered layers
  MetaRM predict  a no-grad pass over metarm.batch_size D_O inputs of metarm.max_length tokens
  update          the policy's gradients, activations, logits and the backward's transients
  validation      run.eval_every with a validation set: through the vLLM engine, or HF decode
                  (the engine asleep and torch's cache emptied first)
  checkpoint      one gathered float32 tensor at a time; rank 0's host RAM holds one model at a time

What is counted, per GPU, as rank 0 holds it (GiB = 2**30 bytes):
  - the trained policy's float32 master weights, float32 gradients and AdamW's two float32 moments
    (+ its float32 `step` scalar per tensor): sharded along dim 0 by FSDP2 (torch.chunk: rank r
    holds rows [r c, (r + 1) c), c = ceil(d0 / world)), replicated under DDP (plumbing/scale.py
    wrap_policy; the AdamW of plumbing/run.py start_run); AdamW's state exists from the first step
    (or a resume) on: not in the cold start, which only a fresh run makes;
  - under FSDP2 with more than one micro-batch per optimizer step, the unsharded float32 gradient
    FSDP2 accumulates over the micro-batches before the synced one reduce-scatters it
    (plumbing/scale.py grad_sync); under DDP with world > 1 its gradient buckets (another copy);
  - the compute-dtype weights in flight: FSDP2 on GPU gathers the root module (embeddings, final
    norm, lm_head) and one decoder layer plus the prefetched next one; DDP's autocast caches a
    compute-dtype copy of every weight during the forward; the HF decode loop under FSDP2
    unshards the whole model (plumbing/scale.py unsharded);
  - activations as autograd saves them (`layer_saved_bytes`, measured tensor by tensor with
    torch.autograd.graph.saved_tensors_hooks on real bf16 Qwen3, Qwen2 and Llama layers:
    tests/plumbing/test_plan_autograd.py), the logits, and the backward's transients (the
    chunked LM head's float32 [V, d] weight gradient, FSDP2's per-layer reduce-scatter buffers);
  - frozen copies in model.dtype: the GRPO reference (algo.kl_coef > 0; none under LoRA with
    fast paths; FSDP2-sharded as the policy under fsdp2, plumbing/scale.py shard_frozen),
    reward.evaluators of kind frozen (their own model) and frozen_self (the policy's);
  - the MetaRM (rm_nlhf): a sequence classifier on metarm.model (plumbing/metarm_setup.py load_metarm):
    under train.parallel fsdp2 with world > 1 FSDP2-sharded float32 master + gradients + AdamW,
    the root and two layers gathered in metarm.dtype, each rank training on its share of a batch,
    ceil(metarm.batch_size / world) x metarm.max_length tokens (metarm.py fit); else a float32
    replica with autocast's metarm.dtype weight cache and all metarm.batch_size rows;
  - vLLM: rollout.vllm_gpu_memory_utilization x the GPU while awake (its weights + KV cache;
    asleep ~0), and the KV cache the rollout needs, layers x 2 x kv_heads x head_dim x dtype bytes
    x tokens (the group's prompt counted once: vLLM's prefix cache), against the share left after
    its weights. The HF backend holds that KV cache itself (a StaticCache of the whole length),
    for rollout.micro_batch_size rows, and a no-grad prefill pass over their prompts;
  - the reserve: RESERVE_CONTEXT for the CUDA context (+ RESERVE_NCCL for one NCCL communicator
    when world > 1), outside torch's allocator, plus FRAGMENTATION x the stage's torch allocations
    (what the caching allocator reserves beyond what it hands out). See RESERVE_CONTEXT below.
Host RAM (rank 0; the other ranks hold no full model): setup and checkpoint one model at a time.
Not counted: the no-grad passes of the update (old / reference log-probs: smaller than its
training pass), vLLM's own CPU memory while asleep.

What it holds, in file order:
    model_config, meta_model, shard_numel, shape_facts, model_facts
                                the model's shapes from its config, on the meta device
    norm_bytes, layer_saved_bytes, root_saved_bytes, activation_bytes, no_grad_pass_bytes,
    head_backward_bytes, logits_bytes, kv_bytes_per_token, distinct_prompts, lora_params,
    reserve_bytes, decode_bytes
                                what autograd saves and what each pass and cache holds, in bytes
    memory_plan, plan_table, what_to_change, check_memory_plan
                                the plan, its table, the key to change, the start-up stop
    add_plan_flags, print_plan  train.py's --plan
"""
import copy
import functools
import json
import math
import os

import torch

GiB = 2**30
# The reserve (issue 34 item 3; figures from the cited reports, not measured here, no GPU has
# been lent to this project's sessions): outside torch's allocator the CUDA context (driver,
# runtime and the kernels loaded lazily, CUDA_MODULE_LOADING=LAZY: ~0.5 GiB on an H100) and,
# at world > 1, NCCL's communicator (its channel buffers: ~1.1-1.6 GB for one communicator on 8
# NVLink GPUs, NVIDIA/nccl#864 and #1685; FSDP2's all-gathers, reduce-scatters and our
# all-reduces share the default group); inside it, what the caching allocator reserves beyond what
# it hands out (blocks split by varying activation sizes: 5-15 % of reserved memory, issue 34;
# 10 % here, less with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
RESERVE_CONTEXT = GiB // 2
RESERVE_NCCL = 3 * GiB // 2
FRAGMENTATION = 0.10
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODEL_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")
# prompt tokens assumed when the config does not bound them ({data,nlhf}.max_prompt_tokens 0):
# GSM8K prompts are ~130 tokens (fast.completion_logprobs); an RM-NLHF pair prompt ~2k (our guess)
TYPICAL_PROMPT_TOKENS = {"rlme": 256, "rm_nlhf": 2048}
CHUNK_EXAMPLE = 1024  # the chunk the plan shows for chunked log-probs when train.logprob_chunk_tokens is unset
COLD_START_BATCH = 64  # metarm.cold_start_batch_size when the config has no such key (issue 34 item 1)
NOT_TORCH = ("vLLM engine",)  # items outside torch's caching allocator (no fragmentation share)


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
    `num_labels` the sequence classifier the MetaRM is (plumbing/metarm_setup.py load_metarm)."""
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
    kv_heads, head_dim, intermediate, vocab, qk_norm (Qwen3's RMSNorm of q and k per head)}."""
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
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
            "qk_norm": any(n.endswith(".q_norm") for n, _ in model.named_modules())}


@functools.lru_cache(maxsize=64)
def model_facts(path, num_labels=None):
    """shape_facts of the model at `path` (model_config, meta_model), cached per path: the plan
    of every shipped preset builds the same few models."""
    return shape_facts(meta_model(model_config(path), num_labels=num_labels))


ARCH = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "qk_norm")


def norm_bytes(width, in_bytes):
    """Bytes one RMSNorm (Llama, Qwen) saves per token over `width` channels:
        4 w        x.float(), saved by pow and mul (the input itself when it is float32)
        4          rsqrt(mean x^2 + eps) [.., 1], float32
        in_bytes w the normalised x cast back to the input's dtype, saved by `weight *`
    Its output is saved by the matmul that reads it (counted by the caller)."""
    return 4 * width + 4 + in_bytes * width


def layer_saved_bytes(*, rows, q_len, kv_len, hidden, heads, kv_heads, head_dim, intermediate, qk_norm, masked,
                      dtype_bytes, residual_bytes):
    """Bytes autograd saves in ONE decoder layer (Llama / Qwen2 / Qwen3: RMSNorm, GQA attention
    through transformers' SDPA, SwiGLU MLP) for `rows` sequences of q_len new tokens attending to
    kv_len positions (kv_len > q_len: a prompt's KV cache in front), counted as unique storages
    the way torch.autograd.graph.saved_tensors_hooks sees them (tests/plumbing/test_plan_autograd.py
    measures real bf16 layers within 1 %). Per token, with d = dtype_bytes (the compute dtype),
    r = residual_bytes (the residual stream's: d under FSDP2 mixed precision, 4 under autocast
    over float32 weights), a / kv heads of head_dim d_h, MLP width i:
        2 norm_bytes(h, r) + 2 d h    input and post-attention RMSNorm, their outputs (the
                                      q/k/v and gate/up matmuls' shared input); under autocast
                                      (r != d) each matmul saves its own cast: 5 d h
        (4 + d)(a + kv) d_h + 4 (a + kv)   Qwen3's q_norm and k_norm (norm_bytes per head);
                                      RoPE saves only its cos / sin (shared: root_saved_bytes)
        2 d a d_h + 4 a               SDPA's query and output (the same storage as o_proj's
                                      input), its float32 log-sum-exp
        4 d i                         gate output (SiLU's input), SiLU output, up output, their
                                      product (down_proj's input)
    per row: k and v over kv_len positions, 2 d d_h kv_len x kv heads, or x a heads when a
    padding mask is given (transformers repeats k/v to every head then: no GQA kernel takes a
    mask), and that mask converted to the compute dtype, d q_len kv_len (SDPA saves it).
    Returns an int (bytes)."""
    d, a, kv, dh = dtype_bytes, heads, kv_heads, head_dim
    casts = 2 if residual_bytes == d else 5  # autocast casts the norm's output for q, k, v and gate, up apart
    per_token = (2 * norm_bytes(hidden, residual_bytes) + casts * d * hidden
                 + ((4 + d) * (a + kv) * dh + 4 * (a + kv) if qk_norm else 0)
                 + 2 * d * a * dh + 4 * a + 4 * d * intermediate)
    per_row = 2 * (a if masked else kv) * dh * d * kv_len + (d * q_len * kv_len if masked else 0)
    return rows * (q_len * per_token + per_row)


def root_saved_bytes(*, tokens, hidden, head_dim, residual_bytes, dtype_bytes):
    """Bytes saved outside the decoder layers per forward, per token: the final RMSNorm and its
    output (the LM head's / score head's input), RoPE's cos and sin [tokens, d_h] (one pair shared
    by all layers, in the residual stream's dtype), the int64 input ids."""
    return tokens * (norm_bytes(hidden, residual_bytes) + dtype_bytes * hidden + 2 * residual_bytes * head_dim + 8)


def activation_bytes(*, tokens, layers, hidden, heads, kv_heads, head_dim, intermediate, dtype_bytes, checkpointing,
                     rows=1, kv_len=None, masked=False, qk_norm=False, residual_bytes=None, root=True):
    """Bytes of one forward's saved activations (a micro-batch of the update, the MetaRM's batch).

    Args:
        tokens: rows x q_len new tokens. kv_len: positions each attends to (default q_len).
        masked: a padding mask goes to SDPA (layer_saved_bytes). residual_bytes: default dtype_bytes.
        checkpointing: "none": every layer's layer_saved_bytes;
            "full": each layer's input (r h per token) kept, one layer's full set live while
            backward replays it (plumbing/scale.py wrap_policy);
            "selective": the layer input plus the matmul outputs kept (q, k, v [a + 2 kv] d_h,
            o_proj h, gate and up 2 i, down h, in the compute dtype: plumbing/scale.py
            keep_matmul_outputs), one layer's full set while it is replayed.
        root: + root_saved_bytes (the final norm, RoPE's tables).
    Returns an int (bytes).
    """
    r = dtype_bytes if residual_bytes is None else residual_bytes
    q_len = tokens // rows if rows else 0
    one = layer_saved_bytes(rows=rows, q_len=q_len, kv_len=q_len if kv_len is None else kv_len, hidden=hidden, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate, qk_norm=qk_norm,
                            masked=masked, dtype_bytes=dtype_bytes, residual_bytes=r)
    kept = {"none": None, "full": r * hidden,
            "selective": r * hidden + dtype_bytes * ((heads + 2 * kv_heads) * head_dim + 2 * hidden + 2 * intermediate)
            }[checkpointing]
    body = layers * one if kept is None else layers * tokens * kept + one
    return body + (root_saved_bytes(tokens=tokens, hidden=hidden, head_dim=head_dim, residual_bytes=r,
                                    dtype_bytes=dtype_bytes) if root else 0)


def no_grad_pass_bytes(*, rows, q_len, kv_len, hidden, heads, kv_heads, head_dim, intermediate, dtype_bytes, masked):
    """The transient peak of one no-grad forward (a decode loop's prefill, a scoring or MetaRM
    predict pass): its largest layer-internal moment, the attention or the MLP, whichever is larger:
        attention  rows q_len (2 h + 2 (a + kv) d_h) d: the residual and the layer input, q, its
                   output, the new k / v; k / v over kv_len repeated to a heads when masked; the
                   mask converted to the compute dtype (rows q_len kv_len d)
        MLP        rows q_len (2 h + 3 i) d: SiLU(gate), up and their product live at once
    + the boolean mask rows q_len kv_len (one byte each, kept through the forward) when masked.
    Returns an int (bytes)."""
    d, t = dtype_bytes, rows * q_len
    attn = (t * (2 * hidden + 2 * (heads + kv_heads) * head_dim) * d
            + (rows * kv_len * 2 * heads * head_dim * d + rows * q_len * kv_len * d if masked else 0))
    mlp = t * (2 * hidden + 3 * intermediate) * d
    return max(attn, mlp) + (rows * q_len * kv_len if masked else 0)


def head_backward_bytes(*, vocab, hidden, dtype_bytes, chunked, positions):
    """The LM head's backward transient in the update, on top of the saved activations (it runs
    first in the backward, while they are all alive). Chunked (fast.head_logprobs): the float32
    [V, d] weight gradient it accumulates, + under a 16-bit compute dtype each chunk's product in
    that dtype and its float32 copy (dw += (dz.T @ hc).float()): (4 + d + 4) V d; float32: the
    addmm_ in place, 4 V d. Unchunked: the logits' gradient in the compute dtype [positions, V]
    and autograd's [V, d] weight gradient. Returns an int (bytes)."""
    if chunked:
        return (4 + (dtype_bytes + 4 if dtype_bytes != 4 else 0)) * vocab * hidden
    return dtype_bytes * (positions * vocab + vocab * hidden)


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


def reserve_bytes(torch_bytes, world):
    """The reserve of a stage whose torch allocations total `torch_bytes`: RESERVE_CONTEXT
    (+ RESERVE_NCCL at world > 1) + FRAGMENTATION x torch_bytes (see RESERVE_CONTEXT). Returns an int."""
    return int(RESERVE_CONTEXT + (RESERVE_NCCL if world > 1 else 0) + FRAGMENTATION * torch_bytes)


def decode_bytes(f, *, rows, group_size, micro, prompt_tokens, new_tokens, d, backend, fsdp, name):
    """The items of one sampling stage on this rank: {name: (bytes, note)}. vLLM: nothing here (its
    share is the "vLLM engine" item); HF decode (fast.generate) over micro-batches of `micro` rows
    (0 = all `rows`): a StaticCache of micro x (prompt + new) tokens, the unsharded weights
    (FSDP2's `unsharded`; DDP's autocast caches a compute-dtype copy), the prefill of the
    micro-batch's distinct prompts (no_grad_pass_bytes)."""
    if backend == "vllm":
        return {}
    m = min(micro or rows, rows)
    distinct = distinct_prompts(rows, m, group_size)
    arch = {k: f[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")}
    return {f"{name} KV cache": (m * (prompt_tokens + new_tokens) * kv_bytes_per_token(f, d),
                                 f"HF decode, {m} rows x {prompt_tokens + new_tokens} tokens"),
            "unsharded weights": (f["params"] * d if fsdp or d != 4 else 0,
                                  "HF decode under FSDP2 (unsharded) / autocast's cast cache, compute dtype"),
            f"{name} prefill": (no_grad_pass_bytes(rows=distinct, q_len=prompt_tokens, kv_len=prompt_tokens, dtype_bytes=d,
                                                   masked=distinct > 1, **arch),
                                f"no-grad prefill of {distinct} distinct prompts x {prompt_tokens} tokens")}


def memory_plan(cfg, *, world, gpu_bytes, rank=0, prompt_tokens=None):
    """The memory plan of `cfg` (the loaded config) on `world` GPUs of `gpu_bytes` each, as rank `rank`.

    Args:
        prompt_tokens: prompt length to plan for; default {data,nlhf}.max_prompt_tokens, or
            TYPICAL_PROMPT_TOKENS when that is 0 (unbounded).
    Returns:
        dict: world, rank, gpu_bytes, model, params, prompt_tokens (+ prompt_assumed), items
        {name: bytes}, notes {name: str}, stages {stage: {"bytes", "items": [names], "reserve"}}
        (bytes include the reserve), peak_stage, peak_bytes, fits, host {stage: bytes of rank 0's
        host RAM}, kv_cache_needed, kv_cache_room (vLLM only), logits_chunked (the logits at
        train.logprob_chunk_tokens, or CHUNK_EXAMPLE when unset), chunk_tokens, cold_start_batch.
    """
    m, t, ro, algo, task = cfg["model"], cfg["train"], cfg["rollout"], cfg["algo"], cfg["task"]
    d = BYTES[m["dtype"]]
    f = model_facts(m["policy"])
    fsdp = t["parallel"] == "fsdp2"
    r = d if fsdp else 4  # the residual stream: FSDP2 computes in model.dtype; DDP's autocast keeps float32 activations there
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
    trained, n_trained = lora_params(meta_model(model_config(m["policy"])), lora) if lora else (sum(shard), len(shard))
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

    # the update's micro-batch, as autograd saves it (layer_saved_bytes): the fast path runs each
    # distinct prompt once (fast.completion_logprobs: prefill, checkpointed unless "none") and the
    # completions against its KV cache repeated to the rows (a padding mask: k / v on every head)
    plain = not t["fast_paths"]
    shared = not plain and G > 1
    rows_p = distinct_prompts(rows_per_step, mb, G) if shared else 0
    ck = m["gradient_checkpointing"]
    arch = {k: f[k] for k in ARCH}
    act = lambda **kw: activation_bytes(dtype_bytes=d, residual_bytes=r, **arch, **kw)
    kvt = kv_bytes_per_token(f, d)
    if shared:
        add("activations", act(tokens=mb * tn, rows=mb, kv_len=tp - 1 + tn, masked=True, checkpointing=ck),
            f"{mb} x {tn} tokens against {tp - 1 + tn} positions, checkpointing {ck}")
        add("prompt pass", act(tokens=rows_p * (tp - 1), rows=rows_p, masked=rows_p > 1, checkpointing=ck)
            + (mb + (rows_p if ck != "none" else 0)) * (tp - 1) * kvt,
            f"fast path: {rows_p} x {tp - 1} prompt tokens once per group, "
            f"{'not checkpointed' if ck == 'none' else 'checkpointing ' + ck}, + its KV cache x {mb} rows")
    else:
        add("activations", act(tokens=mb * (tp + tn), rows=mb, masked=mb > 1, checkpointing=ck),
            f"{mb} x {tp + tn} tokens, checkpointing {ck}")
        add("prompt pass", 0, "no shared prompt")
    chunk = 0 if plain else int(t.get("logprob_chunk_tokens", 0) or 0)  # a fast path (fast.head_logprobs)
    full_logits = logits_bytes(rows=mb, tokens=tn, vocab=f["vocab"], dtype_bytes=d, plain=plain)
    chunked = logits_bytes(rows=mb, tokens=tn, vocab=f["vocab"], dtype_bytes=d, plain=plain, chunk_tokens=chunk or CHUNK_EXAMPLE)
    is_chunked = bool(chunk) and mb * tn > chunk  # fast.chunked_head: a micro-batch within one chunk runs unchunked
    add("logits", chunked if is_chunked else full_logits,
        f"chunked: {chunk} tokens (train.logprob_chunk_tokens)" if is_chunked else
        f"{mb} x {tn} x {f['vocab']} (compute dtype + float32{' + log-softmax + grad' if plain else ''})")
    head = head_backward_bytes(vocab=f["vocab"], hidden=f["hidden"], dtype_bytes=d, chunked=is_chunked, positions=mb * tn)
    scatter = 2 * (d + 4) * f["layer_params"] if fsdp and world > 1 and d != 4 else 0
    add("backward transient", max(head, scatter),
        f"max of the LM head's backward {head / GiB:.2f} GiB ({'chunked: float32 [V, d] gradient + product + its copy' if is_chunked else 'logits gradient + [V, d]'}) "
        f"and 2 layers' reduce-scatter buffers {scatter / GiB:.2f} GiB")

    # frozen copies
    ref = algo["loss"] == "grpo" and algo["kl_coef"] > 0 and not (lora and t["fast_paths"])
    add("GRPO reference", (sum(shard) if fsdp else f["params"]) * d if ref else 0,  # plumbing/scale.py shard_frozen
        f"frozen initial policy, model.dtype, {'1/' + str(world) + ' FSDP2 shard' if fsdp else 'replicated (ddp)'}")
    frozen, names, evals = 0, [], []
    rlme = task == "rlme" and cfg["reward"]["kind"] in ("rlme", "hybrid")
    for e in cfg["reward"]["evaluators"] if rlme else []:
        if e["kind"] == "frozen":
            ef = model_facts(e["path"])
            frozen += ef["params"] * d
            names.append(e["name"])
            evals.append(ef)
        elif e["kind"] == "frozen_self" and not (lora and t["fast_paths"]):
            frozen += f["params"] * d
            names.append(e["name"])
    add("frozen evaluators", frozen, ", ".join(names) or "live / remote only")

    # the MetaRM (rm_nlhf): FSDP2-sharded like the policy under fsdp2 with world > 1 (plumbing/metarm_setup.py
    # load_metarm), each rank training on its share of a batch (metarm.py fit); else a float32 replica
    mr, mf = cfg["metarm"], None
    metarm = task == "rm_nlhf" and mr["mode"] != "none"
    if metarm:
        mf = model_facts(mr["model"] or m["policy"], num_labels=3 if mr["mode"] == "classifier" else 1)
        md = BYTES[mr["dtype"]]
        mw = world if fsdp and world > 1 else 1
        msh = sum(shard_numel(s, mw, rank if mw > 1 else 0) for s in mf["tensors"])
        where = f"1/{mw} FSDP2 shard" if mw > 1 else "full replica"
        trains = mr["mode"] != "offline"
        add("MetaRM weights", 4 * msh, f"float32, {where}")
        add("MetaRM AdamW state", 8 * msh + 4 * len(mf["tensors"]) if trains else 0, f"float32, {where}")
        add("MetaRM gradients", 4 * msh if trains else 0, f"float32, {where}")
        mrows, mck = -(-mr["batch_size"] // mw), "full" if mr["gradient_checkpointing"] else "none"
        mr_r = md if mw > 1 else 4  # FSDP2 gathers in metarm.dtype; a replica autocasts over float32 weights
        gathered = mf["root_params"] + 2 * mf["layer_params"] if mw > 1 else mf["params"] if md != 4 else 0
        march = {k: mf[k] for k in ARCH}
        add("MetaRM activations", activation_bytes(tokens=mrows * mr["max_length"], rows=mrows, masked=mrows > 1, checkpointing=mck,
                                                   dtype_bytes=md, residual_bytes=mr_r, **march)
            + gathered * md + (2 * (md + 4) * mf["layer_params"] if mw > 1 and md != 4 else 0),
            f"{mrows} x {mr['max_length']} tokens{' (its share of metarm.batch_size)' if mw > 1 else ''}, checkpointing {mck}, "
            f"{mr['dtype']}; + {'root + 2 layers gathered, their reduce-scatter' if mw > 1 else 'autocast weight cache'}")
        add("MetaRM predict pass", no_grad_pass_bytes(rows=mr["batch_size"], q_len=mr["max_length"], kv_len=mr["max_length"],
                                                      masked=mr["batch_size"] > 1, dtype_bytes=md,
                                                      **{k: mf[k] for k in ARCH[1:-1]}) + gathered * md,
            f"no grad, {mr['batch_size']} D_O inputs x {mr['max_length']} tokens (metarm.py raw_outputs); + gathered weights")

    # sampling: vLLM's share, or the HF loop's own KV cache, unsharded weights and prefill
    backend = ro["backend"]
    needed = (ro["prompts_per_step"] // world * tp + rows * tn) * kvt
    room = None
    if backend == "vllm":
        add("vLLM engine", ro["vllm_gpu_memory_utilization"] * gpu_bytes, f"{ro['vllm_gpu_memory_utilization']} x GPU: weights + KV cache")
        room = int(ro["vllm_gpu_memory_utilization"] * gpu_bytes - f["params"] * d)
    sample = lambda **kw: decode_bytes(f, d=d, backend=backend, fsdp=fsdp, **kw)
    own = {"rollout": sample(rows=rows, group_size=G, micro=ro["micro_batch_size"], prompt_tokens=tp, new_tokens=tn, name="rollout")}
    cold = metarm and mr["cold_start"]
    batch_cs = int(mr.get("cold_start_batch_size", COLD_START_BATCH) or COLD_START_BATCH)  # key added by issue 34 item 1
    if cold:
        n_cs = mr["rollouts_per_prompt"]
        own["cold start"] = sample(rows=batch_cs * n_cs, group_size=n_cs, micro=ro["micro_batch_size"], prompt_tokens=tp,
                                   new_tokens=mr["max_new_tokens"], name="cold-start")
    val = cfg["run"]["eval_every"] > 0 and (cfg["nlhf"]["val"] if task == "rm_nlhf" else cfg["data"]["val"])
    if val and task == "rm_nlhf":  # both A/B orders of each pair (plumbing/validation.py nlhf_validation_step)
        # nlhf.val_size 0 = the whole file, sampled in chunks of at most a rollout's rows per rank
        # (plumbing/validation.py nlhf_validation_step), so no call holds more rows than the rollout's
        vr = min(2 * -(-cfg["nlhf"]["val_size"] // world), rows) if cfg["nlhf"]["val_size"] else rows
        own["validation"] = sample(rows=vr, group_size=1, micro=ro["micro_batch_size"], prompt_tokens=tp,
                                   new_tokens=cfg["nlhf"]["val_max_new_tokens"], name="validation")
    elif val:  # greedy, one answer per problem, all at once (plumbing/validation.py validation_step)
        own["validation"] = sample(rows=-(-cfg["data"]["val_size"] // world), group_size=1, micro=0, prompt_tokens=tp,
                                   new_tokens=tn, name="validation")
    for stage_items in own.values():
        for name, (b, note) in stage_items.items():
            if b >= items.get(name, 0):
                add(name, b, note)
    for s in own:
        own[s] = list(own[s]) + (["vLLM engine"] if backend == "vllm" else [])
    if rlme:
        sc = cfg["reward"]["micro_batch_size"]
        add("scoring KV cache", sc * (tp + tn + 128) * kvt, "reward.micro_batch_size rows, evaluator prompt")
        big = max(evals + [f], key=lambda e: e["intermediate"] * e["hidden"])
        add("scoring pass", no_grad_pass_bytes(rows=sc, q_len=tp + tn + 128, kv_len=tp + tn + 128, masked=sc > 1, dtype_bytes=d,
                                               **{k: big[k] for k in ARCH[1:-1]}), "no grad, reward.micro_batch_size rows")

    # setup and checkpoint: one full float32 tensor on the GPU at a time; rank 0's host RAM one model
    models = [f] + ([mf] if mf else []) + evals
    add("setup bucket", 4 * max(math.prod(s) for e in models for s in e["tensors"]),
        "one full float32 tensor broadcast from rank 0 (the largest)")
    add("gathered tensor", 4 * max(math.prod(s) for e in models for s in e["tensors"]),
        "one full float32 tensor gathered for rank 0's save_pretrained")
    host = {"setup": 4 * max(e["params"] for e in models), "checkpoint": 4 * max(e["params"] for e in models[:2])}

    resident = ["policy weights", "AdamW state", "GRPO reference", "frozen evaluators", "MetaRM weights", "MetaRM AdamW state"]
    fresh = [n for n in resident if n not in ("AdamW state", "MetaRM AdamW state")]  # a cold start is a fresh run's
    stage_items = {"setup": resident + ["setup bucket"]}
    if cold:
        stage_items["cold start"] = fresh + own["cold start"]
        stage_items["cold-start fit"] = fresh + ["MetaRM AdamW state", "MetaRM gradients", "MetaRM activations"]
    stage_items["rollout"] = resident + own["rollout"]
    stage_items["reward"] = resident + (["scoring KV cache", "scoring pass"] + (["gathered weights"] if fsdp else []) if rlme else [])
    if metarm:
        if mr["mode"] != "offline":
            stage_items["MetaRM update"] = resident + ["MetaRM gradients", "MetaRM activations"]
        stage_items["MetaRM predict"] = resident + ["MetaRM predict pass"]
    stage_items["update"] = resident + ["policy gradients", "gradient accumulation", "gathered weights", "activations",
                                        "prompt pass", "logits", "backward transient"]
    if "validation" in own:
        stage_items["validation"] = resident + own["validation"]
    stage_items["checkpoint"] = resident + ["gathered tensor"]
    stages = {}
    for s, names_ in stage_items.items():
        names_ = [n for n in dict.fromkeys(names_) if n in items]
        torch_bytes = sum(items[n] for n in names_ if n not in NOT_TORCH)
        res = reserve_bytes(torch_bytes, world)
        stages[s] = {"items": names_, "reserve": res, "bytes": sum(items[n] for n in names_) + res}
    peak = max(stages, key=lambda s: stages[s]["bytes"])
    return {"world": world, "rank": rank, "gpu_bytes": int(gpu_bytes), "model": m["policy"], "params": f["params"],
            "prompt_tokens": tp, "rows_per_step": rows_per_step, "prompt_assumed": assumed, "items": items, "notes": notes, "stages": stages,
            "peak_stage": peak, "peak_bytes": stages[peak]["bytes"], "fits": stages[peak]["bytes"] <= gpu_bytes, "host": host,
            "kv_cache_needed": int(needed), "kv_cache_room": room, "chunk_tokens": chunk or CHUNK_EXAMPLE,
            "logits_full": int(full_logits), "logits_chunked": int(chunked), "cold_start_batch": batch_cs if cold else None}


RESIDENT = ("policy weights", "AdamW state", "GRPO reference", "frozen evaluators", "MetaRM weights", "MetaRM AdamW state")


def plan_table(p):
    """The plan as a readable table (rank `p["rank"]`'s view, per GPU): the items, then each stage's
    peak with its own items (beyond the resident ones) and its reserve."""
    g = lambda b: f"{b / GiB:8.2f}"
    lines = [f"memory plan per GPU (rank {p['rank']} of {p['world']}): {p['model']}, {p['params'] / 1e9:.2f} B parameters, "
             f"prompts of {p['prompt_tokens']} tokens" + (" (assumed: set data.max_prompt_tokens, RM-NLHF nlhf.max_prompt_tokens, to bound them)" if p["prompt_assumed"] else ""),
             f"{'what':24} {'GiB':>8}  note"]
    used = {n for v in p["stages"].values() for n in v["items"]}
    for name, b in p["items"].items():
        if b and name in used:
            lines.append(f"{name:24} {g(b)}  {'resident, ' if name in RESIDENT else ''}{p['notes'][name]}")
    if p["logits_chunked"] != p["logits_full"] and p["items"]["logits"] == p["logits_full"]:
        lines.append(f"{'logits (chunked: ' + str(p['chunk_tokens']) + ')':24} {g(p['logits_chunked'])}  "
                     f"(train.logprob_chunk_tokens) would save {(p['logits_full'] - p['logits_chunked']) / GiB:.2f} GiB")
    fixed = RESERVE_CONTEXT + (RESERVE_NCCL if p["world"] > 1 else 0)
    lines.append(f"{'stage':24} {'GiB':>8}  = resident + its own + reserve ({fixed / GiB:.1f} GiB CUDA context"
                 f"{' + NCCL' if p['world'] > 1 else ''} + {FRAGMENTATION:.0%} of the stage's torch allocations)")
    for s, v in p["stages"].items():
        extra = [f"{n} {p['items'][n] / GiB:.2f}" for n in v["items"] if n not in RESIDENT and p["items"][n]]
        lines.append(f"{s:24} {g(v['bytes'])}  {', '.join(extra) or 'resident only'}; reserve {v['reserve'] / GiB:.2f}")
    lines.append(f"host RAM of rank 0: setup {p['host']['setup'] / GiB:.1f} GiB, checkpoint {p['host']['checkpoint'] / GiB:.1f} GiB "
                 f"(one model's float32 state at a time; the other ranks hold shards only)")
    kv = f"rollout KV cache needed {p['kv_cache_needed'] / GiB:.2f} GiB"
    if p["kv_cache_room"] is not None:
        kv += f", vLLM share after its weights {p['kv_cache_room'] / GiB:.2f} GiB"
    if p["cold_start_batch"]:
        kv += f"; cold start: {p['cold_start_batch']} D_H prompts per sample() call (metarm.cold_start_batch_size)"
    lines.append(kv)
    lines.append("peaks: " + ", ".join(f"{s} {v['bytes'] / GiB:.1f}" for s, v in p["stages"].items())
                 + f" GiB; GPU {p['gpu_bytes'] / GiB:.1f} GiB: "
                 + ("fits" if p["fits"] else f"DOES NOT FIT ({p['peak_stage']})"))
    return "\n".join(lines)


def what_to_change(p, cfg):
    """The key to change when the plan does not fit: the biggest item of the peak stage that a key
    reduces. Returns a str."""
    t, ro, mr = cfg["train"], cfg["rollout"], cfg["metarm"]
    mbs = f"rollout.micro_batch_size (now {ro['micro_batch_size']})"
    keys = {"activations": "model.gradient_checkpointing=full" if cfg["model"]["gradient_checkpointing"] != "full"
            else f"train.micro_batch_size (now {t['micro_batch_size']})",
            "prompt pass": f"model.gradient_checkpointing=full or {'nlhf' if cfg['task'] == 'rm_nlhf' else 'data'}.max_prompt_tokens"
            if cfg["model"]["gradient_checkpointing"] == "none" else f"{'nlhf' if cfg['task'] == 'rm_nlhf' else 'data'}.max_prompt_tokens",
            "logits": f"train.micro_batch_size (now {t['micro_batch_size']})",
            "vLLM engine": f"rollout.vllm_gpu_memory_utilization (now {ro['vllm_gpu_memory_utilization']})",
            "rollout KV cache": mbs, "rollout prefill": mbs, "validation KV cache": mbs, "validation prefill": mbs,
            "cold-start KV cache": f"{mbs} or metarm.cold_start_batch_size (now {p['cold_start_batch']})",
            "cold-start prefill": f"{mbs} or metarm.cold_start_batch_size (now {p['cold_start_batch']})",
            "unsharded weights": "rollout.backend=vllm",
            "MetaRM activations": f"metarm.batch_size (now {mr['batch_size']}) or metarm.max_length",
            "MetaRM predict pass": f"metarm.batch_size (now {mr['batch_size']}) or metarm.max_length",
            "scoring KV cache": f"reward.micro_batch_size (now {cfg['reward']['micro_batch_size']})",
            "scoring pass": f"reward.micro_batch_size (now {cfg['reward']['micro_batch_size']})",
            "frozen evaluators": "reward.evaluators (a remote evaluator holds no copy)",
            "GRPO reference": "algo.kl_coef (0: no reference copy)",
            "gradient accumulation": f"train.fsdp_reduce_every_micro_batch=true or train.micro_batch_size (now {t['micro_batch_size']}; at the rank's "
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
                    help="GPUs the plan is for (default: $WORLD_SIZE, else 8: the presets' one 8-GPU node; "
                         "1 for a train.device: cpu preset, one process)")
    ap.add_argument("--gpu-memory", type=float, default=None,
                    help="GiB per GPU the plan must fit (default: this machine's GPU, else 80)")
    return ap


def print_plan(cfg, world=None, gpu_gb=None):
    """--plan: print plan_table for `world` GPUs (default $WORLD_SIZE, else 8; 1 for a
    train.device: cpu preset, which runs as one process) of `gpu_gb` GiB
    (default this GPU's, else 80). Returns the plan dict."""
    default = 1 if cfg["train"]["device"] == "cpu" else 8  # the CPU presets: one process (gloo)
    world = world or int(os.environ.get("WORLD_SIZE", default))
    if world < 1 or (gpu_gb is not None and gpu_gb <= 0):
        raise SystemExit("--plan: --world-size and --gpu-memory must be positive")
    if gpu_gb is None:
        gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 80 * GiB
    else:
        gpu = gpu_gb * GiB
    if cfg["rollout"]["prompts_per_step"] % world:
        raise SystemExit(f"config key rollout.prompts_per_step={cfg['rollout']['prompts_per_step']}: "
                         f"not divisible by the plan's world size {world} (--world-size N sets it; default $WORLD_SIZE, else {default})")
    p = memory_plan(cfg, world=world, gpu_bytes=gpu)
    print(plan_table(p), flush=True)
    if cfg["train"]["device"] == "cpu":  # the table speaks of GPUs: say what it means for this run
        print("train.device is cpu: the table is what one GPU would hold for this config; a CPU run "
              "holds about the update stage less its CUDA reserve, plus the libraries, in host RAM "
              "(not checked here)", flush=True)
    if not p["fits"]:
        print(f"does not fit: {what_to_change(p, cfg)}", flush=True)
    return p
