"""Scale-out plumbing (docs/scale-out.md): process group and reductions, mixed precision, DDP and
FSDP2 wrapping, activation checkpointing, LoRA. The rollout engines (HF decode, vLLM) and their
weight pushes are in plumbing/engine.py.

train.py imports a few seams from here: all_sum / all_max / gather_records (reductions over
ranks), compute_context (the forward's dtype), grad_sync (gradient accumulation), logp_gap
(trainer vs rollout-engine log-probs).

What it holds, in file order:
    setup_distributed, all_sum, all_max, gather_records, peak_memory_mb
                                          the process group, reductions, the memory metric
    compute_context                       the forward's mixed precision
    decoder_layers, keep_matmul_outputs, wrap_policy, reshard_root_after_no_grad, shard_frozen
                                          DDP / FSDP2 wrapping and activation checkpointing
    grad_sync, unsharded, full_state_items, logp_gap
                                          accumulation, gathered weights, the rollout engine's gap
    apply_lora, check_checkpoint_kind, is_lora, base_model, BaseModelView, merged_state_items,
    save_merged                           LoRA (peft): adapters on, off, merged
    broadcast_parameters, gather_pairs, rank0_metrics, forwards_alike, split_outputs, batch_share,
    mean_over_ranks, metarm_seams         where the MetaRM's ranks meet (mrm["seams"], metarm.py)
"""
import contextlib
import datetime
import functools
import json
import os
import resource
import warnings

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import rollout



def setup_distributed(device_setting, always_group=False, cpu_collectives=False, timeout_s=1800.0):
    """Init the process group when launched by torchrun (gloo on CPU, nccl on CUDA).

    Args:
        always_group: also make a 1-process group when not launched by torchrun (FSDP2 needs a
            process group even for world size 1; an in-memory store needs no port).
        cpu_collectives: on CUDA, give CPU tensors a gloo backend next to nccl
            ("cpu:gloo,cuda:nccl"): FSDP2 CPU offload keeps gradients on the CPU, and clipping
            them all-reduces CPU tensors.
        timeout_s: seconds a collective may wait for the slowest rank before the job fails
            (train.dist_timeout_s; NCCL's watchdog default is 10 minutes, config.yaml says why
            that is too short).
    Returns (rank, world, device)."""
    use_cuda = device_setting == "cuda" or device_setting == "auto" and torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local)
    backend = ("cpu:gloo,cuda:nccl" if cpu_collectives else "nccl") if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    elif always_group and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return rank, world, torch.device("cuda", local) if use_cuda else torch.device("cpu")


def all_sum(x, world, op=dist.ReduceOp.SUM):
    """Sum (or another `op`) of a float over ranks (returns a float)."""
    if world == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return float(t.item())


def all_max(x, world):
    """Max of a float over ranks (returns a float)."""
    return all_sum(x, world, op=dist.ReduceOp.MAX)


def gather_records(records, world):
    """All ranks' per-sample dicts, in rank order, on every rank."""
    if world == 1:
        return records
    out = [None] * world
    dist.all_gather_object(out, records)
    return [r for part in out for r in part]


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


def compute_context(dtype, parallel, device):
    """Mixed precision of every forward of the trained policy: the context to run it in.

    The trained parameters and the AdamW state are always float32 (master weights): an AdamW
    step of ~1e-6 on a bf16 weight of ~0.02 (bf16 spacing there ~1e-4) rounds to nothing, so a
    bf16-stored policy does not train. Compute runs in `model.dtype`, as TRL and accelerate do:
    - FSDP2 on GPU: its MixedPrecisionPolicy gathers the parameters in `dtype` (wrap_policy),
      so nothing more is needed here;
    - everywhere else (DDP, one process, FSDP2 on the CPU): torch.autocast to `dtype`, which runs
      matrix multiplies in `dtype` and keeps reductions (softmax, norms) in float32.
    Backward runs outside the context (torch's autocast guidance); it follows the forward's dtypes.

    Args:
        dtype: "float32" | "bfloat16" | "float16" (model.dtype). parallel: "ddp" | "fsdp2".
        device: torch.device.
    Returns:
        a context manager (a no-op for float32).
    """
    if parallel == "fsdp2" and device.type == "cuda":
        return contextlib.nullcontext()
    return rollout.autocast(dtype, device.type)


def decoder_layers(policy):
    """The repeated transformer blocks of an HF causal LM (its `_no_split_modules` classes:
    LlamaDecoderLayer, Qwen3DecoderLayer, ...): the unit FSDP2 shards and gathers."""
    names = set(getattr(policy, "_no_split_modules", None) or [])
    layers = [m for m in policy.modules() if type(m).__name__ in names]
    if not layers:
        raise SystemExit(f"train.parallel=fsdp2: found no decoder layers in {type(policy).__name__}")
    return layers


MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def keep_matmul_outputs(ctx, op, *args, **kwargs):
    """Selective activation checkpointing policy (torch.utils.checkpoint): inside a checkpointed
    decoder layer, save the outputs of matrix multiplies (q/k/v/o and MLP projections), recompute
    everything else (RMSNorms, RoPE, attention, SiLU, products, residual adds) when backward
    replays the layer.

    What it buys: it keeps most of full checkpointing's memory saving for less recompute (the
    matmuls are not replayed); figures in docs/performance.md. configs/cpu.yaml keeps "none": on a
    135M model the weights and their gradients, not the activations, set the peak. It is for long
    sequences and big models, where activations dominate.
    """
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def wrap_policy(policy, parallel, world, device, dtype="float32", cpu_offload=False,
                gradient_checkpointing="none", reduce_every_micro_batch=False):
    """Wrap the policy for training (docs/scale-out.md).

    ddp: DistributedDataParallel when world > 1, else the model itself.
    fsdp2: `fully_shard` each decoder layer, then the root (embeddings, final norm, lm_head;
        tied weights stay one parameter). On GPU with dtype != float32 a MixedPrecisionPolicy
        computes in `dtype` (bf16) and reduces gradients in float32; on CPU everything stays
        float32 (gloo). cpu_offload keeps the shards, gradients and the AdamW step on the CPU.
        fully_shard changes the class of `policy` in place, so the returned model IS policy.
    gradient_checkpointing: "none", "full" (keep only each decoder layer's input, replay the
        layer in backward) or "selective" (also keep the matrix-multiply outputs, replay only the
        cheap ops: `keep_matmul_outputs`). Non-reentrant: the variant that works under FSDP2 and
        with DDP no_sync. Neither changes what is computed (tests/algorithm/test_rollout.py).
    reduce_every_micro_batch: fsdp2 only (train.fsdp_reduce_every_micro_batch): `grad_sync`
        reduce-scatters after every micro-batch, so a rank keeps only its float32 gradient shard
        (1/world) instead of FSDP2's unsharded float32 accumulator (a 7B model: 28 GiB); the
        same gradient up to float32 summation order (tests/plumbing/test_scale.py), one
        reduce-scatter per micro-batch instead of one per optimizer step. Kept on the module
        (attribute `reduce_every_micro_batch`), read by grad_sync.

    Returns:
        the module to run forward/backward on (DDP wrapper, or the policy).
    """
    if gradient_checkpointing != "none":
        kw = {"use_reentrant": False}
        if gradient_checkpointing == "selective":
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep_matmul_outputs)
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    if parallel == "ddp":
        if world == 1:
            return policy
        return torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {"mesh": init_device_mesh(device.type, (world,))}
    if device.type == "cuda" and dtype != "float32":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=rollout.DTYPES[dtype], reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(policy):
        fully_shard(layer, **kw)
    fully_shard(policy, **kw)
    policy.register_forward_hook(reshard_root_after_no_grad)  # after FSDP2's own post-forward hook
    policy.reduce_every_micro_batch = bool(reduce_every_micro_batch)
    return policy


def reshard_root_after_no_grad(root, args, output):
    """Forward hook of an FSDP2 root (wrap_policy): after a no-grad forward, free its gathered
    parameters (embedding, final norm, LM head; bf16 at 7B: 2.03 GiB a GPU, 0.72 GiB at 4B).

    fully_shard keeps the root gathered after forward, since the backward of a training forward
    needs it at once; a no-grad forward (the behaviour pass, frozen_self evaluators, validation)
    has no backward, so it stayed gathered until the next training step. Not inside `unsharded`
    (generation keeps every layer gathered on purpose: its forwards must not all-gather). The
    decoder layers already reshard after every forward. tests/plumbing/test_scale.py checks both."""
    if not torch.is_grad_enabled() and not getattr(root, "keep_gathered", False):
        root.reshard()


def shard_frozen(model, world, device):
    """FSDP2 shards of a frozen model: the GRPO reference (the initial policy of the k3 KL,
    RM-NLHF Eq. 1-3; docs/method.md §4.5) under train.parallel fsdp2, so each rank holds 1/world
    of its weights instead of a replicated copy (a 7B bf16 reference: 14.2 GiB -> 1.8 GiB a GPU
    at world 8; docs/scale-out.md "Memory plan").

    Each decoder layer and the root are `fully_shard`ed as in `wrap_policy`, with
    reshard_after_forward=True on the root too (FSDP2 keeps a root gathered for the backward that
    follows a training forward; a no-grad pass has none); no gradients, no optimizer, the
    weights stay in their own dtype (model.dtype). Each no-grad forward gathers one layer at a
    time; every rank runs the same number of forwards (train.frozen_logprobs' micro-batches).
    Returns the model (fully_shard changes its class in place); log-probs equal the unsharded
    model's (tests/plumbing/test_scale.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model.requires_grad_(False)
    mesh = init_device_mesh(device.type, (world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


@contextlib.contextmanager
def grad_sync(model, world, sync):
    """Gradient accumulation over micro-batches: communicate gradients only when `sync` (the
    last micro-batch). DDP: `no_sync()` otherwise. FSDP2: `set_requires_gradient_sync(sync)`;
    unsynced micro-batches accumulate unsharded float32 gradients, the last one reduce-scatters
    them; with the model's `reduce_every_micro_batch` (wrap_policy) every micro-batch
    reduce-scatters and adds into the sharded gradient (memory: docs/scale-out.md "Memory plan")."""
    if rollout.is_fsdp(model):
        model.set_requires_gradient_sync(sync or getattr(model, "reduce_every_micro_batch", False))
        yield
    elif world > 1 and not sync:
        with model.no_sync():
            yield
    else:
        yield


@contextlib.contextmanager
def unsharded(model):
    """Full parameters on every rank for generation (docs/scale-out.md, HF backend under FSDP2).

    HF `generate` runs a data-dependent number of forwards (it stops when every row hit EOS),
    so per-layer FSDP2 all-gathers would deadlock when ranks stop at different steps. Gather
    every layer once (`unshard()`), keep them gathered through the forwards
    (`reshard_after_forward=False`), then free them. Costs one full copy of the weights in the
    compute dtype while generating. A no-op for DDP / plain models."""
    if not rollout.is_fsdp(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    model.keep_gathered = True  # reshard_root_after_no_grad leaves the root alone
    try:
        yield
    finally:
        model.keep_gathered = False
        for m in mods:
            m.reshard()
            # back to fully_shard's behaviour: layers free their gathered weights after forward;
            # the root keeps them (FSDP2 makes the root not reshard: backward needs them at once)
            m.set_reshard_after_forward(m is not model, recurse=False)


def full_state_items(policy):
    """(name, full tensor) for every entry of the policy's state dict, one at a time, so that
    pushing weights to vLLM never holds more than one gathered tensor (docs/scale-out.md). Under FSDP2
    each `full_tensor()` is an all-gather: every rank must iterate the same way."""
    from torch.distributed.tensor import DTensor
    for name, t in policy.state_dict().items():
        if isinstance(t, DTensor):
            if t.device.type == "cpu" and torch.cuda.is_available():  # CPU offload: gather over nccl
                t = t.to("cuda")
            t = t.full_tensor()
        yield name, t


def logp_gap(trainer_rows, rollout_lp, mask):
    """|trainer - rollout engine| per-token log-prob over masked tokens (docs/scale-out.md).

    Args:
        trainer_rows: list (N) of FloatTensor [>= L_i], the trainer's behaviour log-probs.
        rollout_lp: FloatTensor [N, L], the engine's (vLLM) log-probs of the same tokens.
        mask: FloatTensor [N, L], a prefix mask per row (rollout.completion_mask).
    Returns:
        (sum of |gap|, number of tokens, max |gap|) as floats; the caller reduces over ranks.
    """
    total, count, worst = 0.0, 0, 0.0
    for i, row in enumerate(trainer_rows):
        n = int(mask[i].sum())
        if n == 0:
            continue
        d = (row[:n].float() - rollout_lp[i, :n].float()).abs()
        total += float(d.sum())
        count += n
        worst = max(worst, float(d.max()))
    return total, count, worst


def apply_lora(policy, lora, seed, ckpt=None):
    """The policy with LoRA adapters (peft) on model.lora.target_modules: each such Linear layer
    computes W x + (alpha / r) B A x, with W frozen and only A [r, in] and B [out, r] trained.

    Fresh (ckpt None): peft's init, A Kaiming-uniform drawn under `seed` (so every rank and every
    rerun starts alike), B = 0: at step 0 the policy IS the base model. From a checkpoint: the
    adapter weights saved there, after checking they were made with the same r, alpha and modules.

    Args:
        policy: the loaded HF causal LM (float32). lora: the config's model.lora dict.
    Returns:
        peft.PeftModel (the policy from here on; its .disable_adapter() gives back the base).
    Raises:
        SystemExit (one line): a target module the model does not have, or that is not a Linear
        layer; a checkpoint whose adapter does not match model.lora.
    """
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    targets = lora["target_modules"]
    if targets != "all-linear":
        names = {n: m for n, m in policy.named_modules() if n}
        tied = bool(getattr(policy.config, "tie_word_embeddings", False))
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in names.items() if isinstance(m, torch.nn.Linear)}
                        - ({"lm_head"} if tied else set()))  # the Linear layers a user may name
        for t in targets:  # peft's rule: the module's full name is t or ends with "." + t
            hits = [m for n, m in names.items() if n == t or n.endswith("." + t)]
            if not hits:
                raise SystemExit(f"config key model.lora.target_modules: no module named {t!r} in "
                                 f"{type(policy).__name__} (its Linear layers: {', '.join(linear)})")
            if not all(isinstance(m, torch.nn.Linear) for m in hits):
                kind = type(hits[0]).__name__
                a = "an" if kind[0] in "AEIOU" else "a"
                raise SystemExit(f"config key model.lora.target_modules: {t!r} is {a} {kind}, not a Linear layer "
                                 f"(LoRA here adapts Linear layers: {', '.join(linear)})")
            if tied and t.rsplit(".", 1)[-1] == "lm_head":  # its merge would untie it from the embedding
                raise SystemExit("config key model.lora.target_modules: lm_head is tied to the input embedding "
                                 "in this model; leave it out")
    cfg = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=targets,
                     task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []), \
            warnings.catch_warnings():
        # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: a FutureWarning per run
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        model = get_peft_model(policy, cfg)
    if ckpt is None:
        return model
    from safetensors.torch import load_file
    with open(os.path.join(ckpt, "adapter_config.json")) as f:
        saved = json.load(f)
    weights = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    expected = set(get_peft_model_state_dict(model))
    if (saved["r"], saved["lora_alpha"]) != (lora["r"], lora["alpha"]) or set(weights) != expected:
        raise SystemExit(f"checkpoint {ckpt}: its LoRA adapter (r {saved['r']}, alpha {saved['lora_alpha']}, modules "
                         f"{sorted(saved['target_modules']) if isinstance(saved['target_modules'], list) else saved['target_modules']}) "
                         f"is not the one model.lora describes; resume with the run's own model.lora")
    set_peft_model_state_dict(model, weights)
    return model


def check_checkpoint_kind(ckpt, lora):
    """A checkpoint and model.lora must agree: an adapter folder resumes only under LoRA, a full
    model folder only without it. SystemExit (one line), before any model loads."""
    if ckpt is None:
        return
    has_adapter = os.path.isfile(os.path.join(ckpt, "adapter_model.safetensors"))
    if lora and not has_adapter:
        raise SystemExit(f"config key model.lora is set but checkpoint {ckpt} holds a full model, no LoRA adapter; "
                         f"resume it without model.lora, or start a new run (run.out_dir)")
    if not lora and has_adapter:
        raise SystemExit(f"checkpoint {ckpt} holds a LoRA adapter: resume it with the run's model.lora "
                         f"(its config.yaml), or start a new run (run.out_dir)")


def is_lora(policy):
    """True when the policy carries peft LoRA adapters (model.lora)."""
    from peft import PeftModel
    return isinstance(policy, PeftModel)


@contextlib.contextmanager
def base_model(policy):
    """Inside the block the policy is its base model: every LoRA layer computes W x alone (peft's
    disable_adapter). The base weights never train, so this IS the initial policy, exactly."""
    with policy.disable_adapter():
        yield policy


class BaseModelView(torch.nn.Module):
    """The LoRA policy with its adapters off, as a model of its own: under LoRA the `frozen_self`
    evaluators and the GRPO reference pi_ref (both "the initial policy") are this, instead of a
    second copy of the model in memory. Each forward runs the policy inside base_model(); it
    shares (never changes) the policy's parameters. Plain twin: the separately loaded frozen copy
    (train.fast_paths false; tests/plumbing/test_lora.py compares the two)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.config = policy.config

    def forward(self, *args, **kwargs):
        with base_model(self.policy):
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self):  # the policy's LM head (fast.chunked_head swaps its forward)
        return self.policy.get_output_embeddings()


def merged_state_items(policy):
    """(name, tensor) for every weight of the policy with its LoRA adapters merged in, one at a
    time, under the plain model's names (what vLLM's load_weights and save_pretrained expect):

        W' = W + (alpha / r) B A        (peft's lora.Linear; (B A)^T for fan_in_fan_out layers)

    peft's "base_model.model." prefix and ".base_layer" are dropped, lora_A / lora_B skipped. The
    policy itself is not changed (peft's merge_and_unload merges in place; tests/plumbing/test_lora.py
    checks the two agree). Every other entry is passed through as it is.
    """
    from peft.tuners.lora import LoraLayer
    layers = {n: m for n, m in policy.named_modules() if isinstance(m, LoraLayer)}
    sd = policy.state_dict()
    for key, t in sd.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key.removeprefix("base_model.model.")
        if key.endswith(".base_layer.weight"):
            mod = key[:-len(".base_layer.weight")]
            layer = layers[mod]
            delta = sd[f"{mod}.lora_B.default.weight"].float() @ sd[f"{mod}.lora_A.default.weight"].float()
            delta = delta * layer.scaling["default"]
            t = (t.float() + (delta.T if layer.fan_in_fan_out else delta)).to(t.dtype)
        yield name.replace(".base_layer.", "."), t


def save_merged(policy, tokenizer, folder):
    """A plain save_pretrained folder of the LoRA policy with its adapters merged
    (merged_state_items): loads anywhere a full checkpoint does (evaluate.py, vLLM, HF)."""
    policy.get_base_model().save_pretrained(folder, state_dict=dict(merged_state_items(policy)))
    tokenizer.save_pretrained(folder)


# ==============================================================================================
# The MetaRM over ranks: metarm.py's seams (RM-NLHF Algorithm 1, steps 3-4 under torchrun;
# docs/scale-out.md "The MetaRM's placement"). metarm.py's loop is one process's; load_metarm
# (plumbing/metarm_setup.py) puts metarm_seams(...) at mrm["seams"], and metarm.online_update / predict /
# fit call these where the ranks must meet.


def broadcast_parameters(model, src=0):
    """Copy rank `src`'s parameters and buffers into every rank's model (in place); FSDP2 shards: nothing."""
    for t in [] if rollout.is_fsdp(model) else list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src)


def gather_pairs(items, samples, world):
    """Every rank's (item, sample) pairs, in rank order (all_gather_object): online_update trains on all of them."""
    parts = [None] * world
    dist.all_gather_object(parts, list(zip(items, samples)))
    return [p[0] for part in parts for p in part], [p[1] for part in parts for p in part]


def rank0_metrics(metrics, updates):
    """Rank 0's update metrics and update count on every rank (broadcast_object_list)."""
    box = [metrics, updates]
    dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def forwards_alike(raw_outputs):
    """raw_outputs (metarm.py's signature) for an FSDP2-sharded MetaRM, each rank on its own texts: FSDP2
    all-gathers the weights in every forward (a collective), so every rank runs as many batches as the rank
    with the most, the extra ones on a dummy text whose outputs are dropped."""
    def outputs(model, tokenizer, texts, *, batch_size, **kw):
        mine = -(-len(texts) // batch_size)
        n = torch.tensor(mine, device=next(model.parameters()).device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        out = raw_outputs(model, tokenizer, texts, batch_size=batch_size, **kw)
        for _ in range(int(n) - mine):
            raw_outputs(model, tokenizer, ["."], batch_size=batch_size, **kw)
        return out
    return outputs


def split_outputs(outputs, rank, world):
    """raw outputs for texts that every rank holds alike (metarm.update's agreement, on the gathered D_H
    samples), sharded: rank r runs texts[r::world] (`outputs`: forwards_alike), then all of them in order."""
    def run(model, tokenizer, texts, **kw):
        parts = [None] * world
        dist.all_gather_object(parts, outputs(model, tokenizer, texts[rank::world], **kw))
        return [parts[i % world][i // world] for i in range(len(texts))]
    return run


def batch_share(rank, world):
    """metarm.fit's `share` under FSDP2: rank r's part of a batch, texts[r::world] (none: one dummy text),
    and its weight len(mine) * world / len(batch), so that the ranks' gradient mean (FSDP2's reduce-scatter)
    is the whole batch's mean-loss gradient (RM-NLHF Eq. 7), as in one process."""
    def share(texts, rewards):
        mine_t, mine_r = texts[rank::world], rewards[rank::world]
        return mine_t or ["."], mine_r or [0.0], len(mine_t) * world / len(texts)
    return share


def mean_over_ranks(world):
    """metarm.fit's `mean` under FSDP2: the batch's mean loss from each rank's weighted share (batch_share)."""
    def mean(loss):
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return (loss / world).item()
    return mean


def metarm_seams(raw_outputs, rank, world, sharded):
    """mrm["seams"], what metarm.py calls where the ranks meet (None where one process needs nothing):
      gather(items, samples), sync(metrics, updates), broadcast(model)   world > 1: online_update trains every
                         rank on all ranks' D_H pairs, then takes rank 0's metrics (and, for a replica, weights)
      outputs, all_outputs   raw_outputs for this rank's texts (predict) / for texts all ranks hold (update's
                         agreement): raw_outputs itself, or under FSDP2 forwards_alike / split_outputs
      share, mean            fit's batch share and loss mean under FSDP2 (batch_share, mean_over_ranks)
    raw_outputs: metarm.raw_outputs; sharded: the MetaRM is FSDP2-sharded (load_metarm)."""
    seams = {"gather": None, "sync": None, "broadcast": None, "outputs": raw_outputs, "all_outputs": raw_outputs,
             "share": None, "mean": None}
    if world > 1:
        seams.update(gather=functools.partial(gather_pairs, world=world), sync=rank0_metrics,
                     broadcast=broadcast_parameters)
    if sharded:
        alike = forwards_alike(raw_outputs)
        seams.update(outputs=alike, all_outputs=split_outputs(alike, rank, world), share=batch_share(rank, world),
                     mean=mean_over_ranks(world))
    return seams
