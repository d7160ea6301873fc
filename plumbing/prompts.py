"""How a text becomes a model's prompt, and which prompts fit (docs/method.md §4.1).

    use_chat_template(tokenizer, setting, ...)   plain text or the chat template, with its options
                                                 (system prompt, template kwargs), each checked to
                                                 change the rendered prompt; CHAT_TEMPLATE_ARGUMENTS
    policy_chat(tokenizer, model_cfg)            use_chat_template from the config's `model:` section
    render_prompt(tokenizer, text, chat)         the prompt as a string (text-level scoring)
    parse_json_object(text, flag)                --chat-template-kwargs '{...}' as a dict
    prompt_token_limit, keep_short               the prompt-length limit; prompts over it dropped and counted
"""
import json
import os
import re

from rollout import chat_prompt


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
