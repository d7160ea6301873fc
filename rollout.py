"""Rollout: prompts -> G sampled completions per prompt -> token ids, loss masks, per-token
log-probs.

What is computed (RLME §3; docs/method.md §4.1 says the same in prose):

* Which prompts: each step's items x ~ D, a seeded permutation per epoch that a resumed run
  replays (`step_items`), as prompt token ids built once, chat template or plain text
  (`policy_prompt_ids`, `build_prompt_ids`).
* Generation: G completions y_i ~ pi_theta(. | x) per prompt (RLME Eq. 1; the G rows of a prompt
  are the group whose mean reward RLME Eq. 5 subtracts), sampled from softmax(logits / T) with
  top-p / top-k, each cut after its first EOS (`generate`, over transformers' `model.generate`;
  its fast twin fast.generate prefills each group once).
* Log-probs: log pi(y_{i,t} | x_i, y_{i,<t}) per completion token, logits divided by the sampling
  temperature: the log pi_theta and log pi_b terms of RLME Eq. 6 and Eq. 8 (and of RM-NLHF Eq. 3's
  token ratio r_{i,t}) (`completion_logprobs`; fast.completion_logprobs runs a group's prompt once).

Everything downstream (reward.py, train.py, evaluate.py) works on the plain dict that `generate`
returns; fast.generate and the vLLM backend (plumbing/engine.py) return the same, as does every
rollout backend's `sample` callable (train.py's rollout step; the vLLM engine adds "logprobs"):

    rollout = {
        "prompt_ids":      list[list[int]]   N rows (N = P prompts x G), row i belongs to prompt
                                             i // G
        "completion_ids":  LongTensor [N, L] right-padded with pad_id after the completion
        "completion_mask": FloatTensor [N, L] 1.0 up to and including the first EOS, else 0.0
        "truncated":       BoolTensor [N]    True when no EOS came within max_new_tokens
        "completions":     list[str]         decoded completion text (special tokens dropped)
        "logprobs":        FloatTensor [N, L] (vLLM only) the engine's log-probs of the sampled
                                             tokens, 0.0 on padding; the trainer recomputes its
                                             own and logs the gap (docs/method.md §7)
    }

Run alone (JSONL in, JSONL out):

    python -m plumbing.cli rollout --model PATH --in prompts.jsonl --out rollouts.jsonl
"""
import contextlib

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# Which prompts: this step's items and their prompt token ids (RLME Eq. 1's x ~ D;
# docs/method.md §4.1)


def step_items(items, step, prompts_per_step, seed, rank, world):
    """This rank's prompts for `step`: a seeded permutation per epoch, read as one stream, so the
    order depends only on (seed, step) and a resumed run sees the same prompts."""
    out = []
    for j in range(prompts_per_step):
        pos = step * prompts_per_step + j
        epoch, k = divmod(pos, len(items))
        perm = torch.randperm(len(items),
                              generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(items[perm[k]])
    per_rank = prompts_per_step // world
    return out[rank * per_rank:(rank + 1) * per_rank]


def policy_prompt_ids(tokenizer, item, chat, template, text_only=False, answer=None):
    """Token ids of the policy prompt for one training item (data.prompt_template, chat template
    when `chat`); its text with text_only=True. The template's {question}, {context} and {answer}
    are the item's question, context and reference answer; `answer` replaces the reference (the
    validation's seeded wrong answer for NoCheat, docs/method.md §4.6). A conversational item
    (item["messages"], TRL's format) keeps its messages, the template filling its last (user)
    message; text_only gives its rendered chat prompt. SystemExit (one line naming the data row)
    for one with a plain-text prompt."""
    text = template.format(question=item["question"], context=item.get("context") or "",
                           answer=item.get("answer_text") if answer is None else answer)
    if item.get("messages"):
        if not chat:
            raise SystemExit(f"{item.get('where', 'a data row')}: the question is chat messages, "
                             f"but the policy prompt is plain text (config key "
                             f"model.chat_template); use a model with a chat template")
        text = item["messages"][:-1] + [dict(item["messages"][-1], content=text)]
        if text_only:  # the whole rendered prompt: keep_short's byte bound must cover every message
            return chat_prompt(tokenizer, text, chat, tokenize=False)
    return text if text_only else build_prompt_ids(tokenizer, text, chat)


def build_prompt_ids(tokenizer, text, chat):
    """Token ids of one prompt, built once (docs/method.md §4.1).

    With the chat template the ids come straight from `apply_chat_template(tokenize=True)`;
    rendering to a string and re-tokenising it with special tokens would add a second BOS on
    tokenizers that prepend one.

    Args:
        text: the user message or a list of chat messages (chat), or the whole plain-text prompt.
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
    twin of fast.generate): every row runs its own prompt, HF's logits warpers and multinomial draw.

    Sampling: temperature > 0 samples from softmax(logits / T) restricted by top_k, then top_p;
    temperature 0 is greedy decoding. Rows stop at the first EOS (any of eos_ids); rows that
    finished early are filled with pad_id, as in fast.generate, also when pad_id is an EOS id.

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
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
                if temperature > 0 else {"do_sample": False})
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
                                 max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=pad_id, **sampling)
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
    """log softmax(logits / T)[target] by the textbook formula (the plain twin of
    fast.token_logprobs).

    Args:
        logits: FloatTensor [..., V], any float dtype (computed in float32).
        targets: LongTensor [...], token ids in [0, V).
        temperature: float, logits are divided by it (the sampling temperature).
    Returns:
        FloatTensor [...] float32, log p(target); autograd provides the backward.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def completion_logprobs(model, prompt_ids, completion_ids, pad_id, temperature=1.0,
                        prompt_model=None, chunk_tokens=0):
    """Per-token log-probs of the completions under `model` (the plain twin of
    fast.completion_logprobs):

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
        chunk_tokens: unused (the fast twin's LM-head chunks; here all [N, L, V] logits at once).
    Returns:
        FloatTensor [N, L] float32; positions after the first EOS hold junk and must be masked.
        Gradient flows when called under grad mode.
    """
    completion_ids = completion_ids.to(next(model.parameters()).device)
    return token_logprobs(completion_logits(model, prompt_ids, completion_ids, pad_id),
                          completion_ids, temperature)


def completion_logits(model, prompt_ids, completion_ids, pad_id):
    """Logits [N, L, V] that predict the L completion tokens: one forward over [left-padded prompt |
    completion] (positions from the attention mask, so left padding does not shift them)."""
    device = next(model.parameters()).device
    n, length = completion_ids.shape
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    ids = torch.cat([p_ids.to(device), completion_ids.to(device)], dim=1)
    attn = torch.cat([p_mask.to(device),
                      torch.ones(n, length, dtype=torch.long, device=device)], dim=1)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                logits_to_keep=length + 1, use_cache=False)
    # logits at column t predict token t+1: of the last L+1 columns, all but the final one
    # predict exactly the L completion tokens.
    return out.logits[:, :-1]


# ----------------------------------------------------------------------------------------------
# Helpers: the chat prompt, mixed precision, EOS ids, model modes


def chat_prompt(tokenizer, text, chat, tokenize):
    """The user message `text` (or a list of chat messages) in the chat template, with the
    generation prompt.

    Args:
        chat: True (no options) or the options dict {"system", "kwargs"} from use_chat_template.
        tokenize: True for token ids (list[int], straight from the template, so no second BOS),
            False for the rendered string.
    """
    options = chat if isinstance(chat, dict) else {}
    messages = list(text) if isinstance(text, list) else [{"role": "user", "content": text}]
    # "" is an empty system message (it replaces a template's default one)
    if options.get("system") is not None:
        messages.insert(0, {"role": "system", "content": options["system"]})
    out = tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True,
                                        **options.get("kwargs", {}))
    if not tokenize:
        return out
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(dtype, device_type):
    """Compute in `dtype` ("float32" | "bfloat16" | "float16", or that torch.dtype) over float32
    weights: torch.autocast on `device_type` ("cpu" | "cuda"), a no-op context for float32. Mixed
    precision of every trained model (plumbing/scale.py's compute_context, metarm). ValueError:
    another dtype."""
    dtype = DTYPES.get(dtype, dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"autocast: dtype {dtype!r}, expected one of {', '.join(DTYPES)}")
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


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
    """The modules of `model` with activation checkpointing on (plumbing/scale.py's wrap_policy):
    transformers' decoder layers, and the model that holds the flag."""
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


# the command line imports this file, so it lives in plumbing/cli.py (rollout_main)
if __name__ == "__main__":
    raise SystemExit("rollout.py's command line: python -m plumbing.cli rollout --help "
                     "(from the repository root)")
