"""The rollout engines (docs/scale-out.md): the HF decode loop and vLLM, behind one `sample` callable."""
import os

import torch

import rollout

from plumbing.data import resolve_model_path
from plumbing.scale import full_state_items, is_lora, merged_state_items


def make_rollout_engine(cfg, model_path, policy, rank):
    """None for the HF backend; for vLLM (docs/scale-out.md) this rank's in-process engine as a dict
    {"llm", "asleep", "sleep_level", "tied"}, started from the same weights as the policy
    (`model_path`: the checkpoint being resumed, or model.policy)."""
    ro = cfg["rollout"]
    if ro["backend"] != "vllm":
        return None
    llm = make_vllm_engine(resolve_model_path(model_path), cfg["model"]["dtype"],
                                   gpu_memory_utilization=ro["vllm_gpu_memory_utilization"],
                                   max_model_len=ro["vllm_max_model_len"], enforce_eager=ro["vllm_enforce_eager"],
                                   # vLLM seeds numpy with it, which needs 0 <= seed < 2**32
                                   seed=(cfg["run"]["seed"] * 1_000_003 + rank) % 2**32)
    return {"llm": llm, "asleep": False, "sleep_level": ro["vllm_sleep_level"],
            "tied": bool(getattr(policy.config, "tie_word_embeddings", False)),
            "bucket_bytes": int(ro["vllm_push_bucket_mb"] * 2**20)}


def push_weights(engine, policy):
    """After the update: the new weights into the vLLM engine (gathered from FSDP2 shards one
    tensor at a time; under LoRA merged into the base weights first, merged_state_items), then its
    prefix cache reset (docs/scale-out.md). No-op for the HF backend, which samples from the policy itself."""
    if engine is not None:
        vllm_push_weights(engine, merged_state_items(policy) if is_lora(policy) else full_state_items(policy))


def vllm_request_seeds(seed, n_prompts):
    """One sampling seed per prompt, drawn from a generator seeded with `seed` (train.py's
    per-(run, step, rank) seed). vLLM seeds the G samples of a request with seed + j, so the
    per-prompt seeds must be far apart; naive seed + i would make prompt i of rank r and prompt
    i - 1 of rank r + 1 share random streams. Returns list[int] in [0, 2**31)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 2**16, (n_prompts,), generator=g).tolist()


def vllm_sampling_kwargs(group_size, max_new_tokens, temperature, top_p, top_k, seed, eos):
    """Keyword arguments of vllm.SamplingParams for one prompt's group (docs/method.md §4.1).

    logprobs=0 returns the log-prob of the sampled token only; with the engine's
    logprobs_mode="processed_logprobs" it is computed after temperature / top-p / top-k. With
    top_p 1 and top_k off (the defaults) that is the same log softmax(logits / T) the trainer
    computes; with either on it is the log-prob under the truncated, renormalised distribution
    the sampler drew from, which the trainer's full-vocabulary log softmax does not reproduce, so
    rollout/logp_gap_* grows by the truncation. The update's behaviour log-probs are the trainer's
    own recomputation on either backend; vLLM's only feed that gap metric. Token ids out, so no
    detokenising.
    """
    return {"n": group_size, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k if top_k > 0 else -1, "seed": seed, "logprobs": 0,
            "stop_token_ids": list(eos), "detokenize": False}


def vllm_token_logprobs(token_ids, logprobs):
    """Per-token log-probs of the sampled tokens from a vLLM CompletionOutput's `logprobs`
    (one mapping {token id: Logprob or float} per position). Raises ValueError when missing."""
    if logprobs is None:
        raise ValueError("vLLM output has no logprobs (SamplingParams(logprobs=0) was not set)")
    out = []
    for t, (tok, pos) in enumerate(zip(token_ids, logprobs)):
        if pos is None or tok not in pos:
            raise ValueError(f"no log-prob for sampled token {tok} at position {t}")
        v = pos[tok]
        out.append(float(getattr(v, "logprob", v)))
    return out


def vllm_outputs_to_rollout(outputs, prompt_ids, group_size, pad_id, eos, decode):
    """Map vLLM RequestOutputs (one per prompt, each with `group_size` CompletionOutputs) to the
    rollout dict at the top of this file.

    The loss mask is built from each completion's own length, cut after its first EOS, never
    from `ids != pad_id` (pad == EOS on SmolLM2/Qwen/Llama, docs/method.md §4.1). A row is truncated when
    it holds no EOS (finish_reason "length", or the context limit, or an abort).

    Args:
        outputs: list (P) of objects with `.outputs`, a list of objects with `.token_ids`,
            `.logprobs`, `.finish_reason`.
        prompt_ids: list (P) of list[int], in the order the requests were sent.
        decode: callable list[int] -> str (the tokenizer's decode, special tokens skipped).
    Returns:
        the rollout dict, with "logprobs" FloatTensor [N, L] (0.0 on padding).
    Raises:
        ValueError: a request came back with the wrong number of completions or no logprobs.
    """
    rows, ids, lps = [], [], []
    eos = set(eos)
    for p, out in zip(prompt_ids, outputs):
        if len(out.outputs) != group_size:
            raise ValueError(f"expected {group_size} completions per prompt, got {len(out.outputs)}")
        for c in out.outputs:
            rows.append(p)
            ids.append(list(c.token_ids))
            lps.append(vllm_token_logprobs(c.token_ids, c.logprobs))
    width = max(1, max(len(x) for x in ids))
    n = len(ids)
    completion_ids = torch.full((n, width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(n, width)
    mask = torch.zeros(n, width)
    truncated = torch.ones(n, dtype=torch.bool)
    for i, (x, lp) in enumerate(zip(ids, lps)):
        completion_ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        logprobs[i, :len(x)] = torch.tensor(lp)
        end = next((t + 1 for t, tok in enumerate(x) if tok in eos), None)
        mask[i, :end or len(x)] = 1.0
        truncated[i] = end is None
    completions = [decode(x[:int(m.sum())]) for x, m in zip(ids, mask)]
    return {"prompt_ids": rows, "completion_ids": completion_ids, "completion_mask": mask,
            "truncated": truncated, "completions": completions, "logprobs": logprobs}


def vllm_weight_name(name, tied):
    """The name vLLM's `load_weights` expects for one of our state-dict entries, or None to skip.

    vLLM's model classes load Hugging Face checkpoint names (they fuse q/k/v and gate/up
    themselves), so the mapping only strips wrapper prefixes (DDP `module.`, torch.compile
    `_orig_mod.`, activation-checkpoint wrappers) and skips what vLLM does not hold: a tied
    lm_head (it shares the embedding) and rotary `inv_freq` buffers (vLLM computes them)."""
    for junk in ("module.", "_orig_mod."):
        if name.startswith(junk):
            name = name[len(junk):]
    name = name.replace("._checkpoint_wrapped_module", "").replace("._fsdp_wrapped_module", "")
    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
        return None
    return name


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_vllm_engine(model_path, dtype, gpu_memory_utilization, max_model_len, enforce_eager=False, seed=0):
    """One in-process vLLM engine for this rank (docs/method.md §7).

    `distributed_executor_backend="external_launcher"` runs the engine inside this torchrun
    process (no extra workers): with tensor_parallel_size=1 every rank holds one full engine
    and samples its own prompts. Sleep mode lets training reuse the engine's GPU memory;
    `processed_logprobs` returns log-probs after temperature scaling (what the trainer
    computes). Outside torchrun the launcher variables are filled in for a 1-process world.

    Args:
        model_path: a plain HF folder (resolve_model_path converts GGUF).
        gpu_memory_utilization: share of the GPU this engine may take (weights + KV cache).
        max_model_len: prompt + completion tokens per sequence (bounds the KV cache).
    Returns:
        vllm.LLM
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from vllm import LLM
    return LLM(model=model_path, tokenizer=model_path, dtype=dtype, tensor_parallel_size=1,
               distributed_executor_backend="external_launcher", enable_sleep_mode=True,
               logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory_utilization,
               max_model_len=max_model_len, enforce_eager=enforce_eager, enable_prefix_caching=True,
               seed=seed)


@torch.no_grad()
def generate_vllm(llm, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                  top_k=0, seed=0, eos=None):
    """`generate` on a vLLM engine: token ids in, token ids and log-probs out (docs/method.md §7).

    Args:
        llm: vllm.LLM from make_vllm_engine (awake).
        prompt_ids: list[list[int]], P prompts (never re-tokenised: docs/method.md §4.1).
        seed: this rank's seed (train.sampling_seed); each prompt gets its own (vllm_request_seeds).
        eos: list[int] of ids that end a completion (rollout.eos_ids); default the tokenizer's.
    Returns:
        the rollout dict at the top of this file, with "logprobs".
    """
    from vllm import SamplingParams
    eos = eos or [tokenizer.eos_token_id]
    params = [SamplingParams(**vllm_sampling_kwargs(group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                                                    top_p=top_p, top_k=top_k, seed=s, eos=eos))
              for s in vllm_request_seeds(seed, len(prompt_ids))]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
    return vllm_outputs_to_rollout(outputs, prompt_ids, group_size=group_size, pad_id=tokenizer.pad_token_id, eos=eos,
                                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def vllm_model(llm):
    """The engine's torch module (in-process engine only, i.e. external_launcher)."""
    try:
        worker = llm.llm_engine.model_executor.driver_worker
        return getattr(worker, "worker", worker).model_runner.model
    except AttributeError:  # engine internals moved: ask the worker through the RPC path
        return llm.collective_rpc(lambda worker: worker.model_runner.model)[0]


def vllm_sleep(engine):
    """Free the engine's GPU memory for reward scoring and the update (docs/method.md §7): level 1 keeps a
    CPU copy of the weights, level 2 drops them (they are overwritten by the next push anyway).
    engine: dict {"llm", "asleep", "sleep_level", "tied"} (make_rollout_engine)."""
    if not engine["asleep"]:
        engine["llm"].sleep(level=engine["sleep_level"])
        engine["asleep"] = True


def vllm_push_weights(engine, named_tensors):
    """Load the trainer's current weights into the engine, then drop its prefix cache (docs/method.md §7).

    Empties torch's CUDA cache, then wakes the weights first and the KV cache only after the load, so the peak is weights + one
    bucket + one gathered tensor, not weights + KV cache + tensor. `named_tensors` yields (HF name,
    full tensor) one at a time (full_state_items: gathered from FSDP2 shards); each is cast to the
    engine's dtype (its parameters', e.g. bfloat16: half the bytes of our float32 masters) and
    they go to `load_weights` in buckets of up to engine["bucket_bytes"] (rollout.vllm_push_bucket_mb;
    `weight_buckets`): a few large calls instead of one per tensor, and never a second copy of the model.
    """
    llm = engine["llm"]
    if engine["asleep"]:
        if torch.cuda.is_available():
            # the trainer's cached free blocks (the reward / update peaks, docs/scale-out.md "Memory plan")
            # back to the driver, so the engine's share (rollout.vllm_gpu_memory_utilization) can be mapped again
            torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    model = vllm_model(llm)
    p = next(model.parameters())
    named = ((n, t) for n, t in ((vllm_weight_name(n, engine["tied"]), t) for n, t in named_tensors) if n is not None)
    for bucket in weight_buckets(named, dtype=p.dtype, device=p.device, bucket_bytes=engine.get("bucket_bytes", 512 << 20)):
        model.load_weights(bucket)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies above are asynchronous
    if engine["asleep"]:
        llm.wake_up(tags=["kv_cache"])
        engine["asleep"] = False
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


def weight_buckets(named_tensors, dtype, device, bucket_bytes):
    """(name, tensor) pairs cast to `dtype` on `device`, grouped into lists whose tensors hold at most
    `bucket_bytes` bytes together (a tensor larger than a bucket travels alone), in order.

    Args:
        named_tensors: iterable of (str, Tensor), consumed one at a time (full_state_items).
        dtype: the engine's parameter dtype. device: the engine's device. bucket_bytes: int > 0.
    Yields:
        list[(str, Tensor)], each a vLLM `load_weights` call (tests/plumbing/test_scale.py).
    """
    bucket, size = [], 0
    for name, t in named_tensors:
        t = t.to(device=device, dtype=dtype, non_blocking=True)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
