"""The RLME evaluators (RLME Eq. 2-3's pi_phi_j), as the dict reward.rlme_reward reads
({"name", "weight", "score"}, reward.local_evaluator's), built from a config or from a path.

    load_evaluators(cfg, policy, tokenizer, device, passes, remote=None)
                              a run's reward.evaluators: live (the policy), frozen_self, frozen,
                              remote
    load_evaluator(path, ...) one frozen evaluator from a path, without train.py or a config
    checked_template(template)
                              an evaluator template checked before any model loads
    remote_evaluators(cfg, passes), remote_evaluator(base_url, model, ...)
                              `kind: remote`: log p(target | prompt) from an OpenAI-compatible
                              /v1/completions server's echoed prompt log-probs, probed at start-up
                              (probe_remote); REMOTE_DEFAULTS its settings
    remote_request, echo_target_logprob, score_remote
                              one scoring request (retried: plumbing/http_client.py), the target's
                              log p in its answer, the plain scorer (fast.score_remote: its twin)
"""
import math
import random
import time

import torch

import fast
import reward
from reward import (DEFAULT_EVALUATOR_TEMPLATE, build_evaluator_text, check_evaluator_template,
                    evaluator_prompt_text, local_evaluator)
import rollout

from plumbing.http_client import call_with_retries, openai_client
from plumbing.models import load_model, resolve_model_path
from plumbing.prompts import use_chat_template
from plumbing.scale import BaseModelView


def remote_evaluators(cfg, passes):
    """The `kind: remote` evaluators, {index: remote_evaluator dict}, each probed with one
    scoring request (one-line SystemExit naming reward.evaluators[i] if it cannot score)."""
    out = {}
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        if ev["kind"] == "remote":
            settings = {k: ev[k] for k in REMOTE_DEFAULTS}
            out[i] = remote_evaluator(ev["base_url"], ev["model"], name=ev["name"], weight=ev["weight"],
                                        tokenizer=ev["path"], chat_template=ev["chat_template"],
                                        system_prompt=ev["system_prompt"], chat_template_kwargs=ev["chat_template_kwargs"],
                                        where=f"config key reward.evaluators[{i}] ({ev['name']})",
                                        config_key=f"reward.evaluators[{i}]", answer_stub=cfg["reward"]["answer_stub"],
                                        score_requests=passes["score_remote"], **settings)
    return out


def load_evaluators(cfg, policy, tokenizer, device, passes, remote=None):
    """The J evaluators as reward.local_evaluator dicts {name, weight, score}. `live` shares the
    policy's weights (scored without grad); `frozen_self` is a frozen copy of the initial policy
    (under LoRA with train.fast_paths: the policy with its adapters off, BaseModelView, which is
    that initial policy without a second copy; its plain twin loads the copy); `frozen` loads
    another model; `remote` ones come built from `remote` (remote_evaluators; None: built and
    probed here). live / frozen_self share the policy's chat template, so their chat_template
    "auto" is model.chat_template and they take model.chat_template_kwargs unless they set their
    own (not its system prompt: that instructs the policy)."""
    remote = remote_evaluators(cfg, passes) if remote is None else remote
    evaluators = []
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        kind = ev.get("kind", "live")
        if kind == "remote":
            evaluators.append(remote[i])
            continue
        path = ev["path"] if kind == "frozen" else cfg["model"]["policy"]
        if kind == "live":
            model, tok = policy, tokenizer
        elif kind == "frozen_self" and cfg["model"]["lora"] and cfg["train"]["fast_paths"]:
            model, tok = BaseModelView(policy), tokenizer
        else:
            try:
                model, tok = load_model(path, cfg["model"]["dtype"], device)
            except SystemExit as e:  # name the config key, not just the path
                raise SystemExit(f"config key reward.evaluators[{i}].path: {e}")
            model.eval().requires_grad_(False)
        setting, template_kwargs = ev.get("chat_template", "auto"), ev.get("chat_template_kwargs")
        if kind != "frozen":  # the policy's model and template: "auto" and None mean "as the policy"
            setting = cfg["model"]["chat_template"] if setting == "auto" else setting
            if template_kwargs is None and setting is not False:
                template_kwargs = cfg["model"]["chat_template_kwargs"]
        chat = use_chat_template(tok, setting, model_path=path, system=ev.get("system_prompt"),
                                         template_kwargs=template_kwargs, key=f"reward.evaluators[{i}]")
        evaluators.append(reward.local_evaluator(model, tok, chat=chat, name=ev.get("name", f"{kind}{i}"),
                                            weight=ev.get("weight", 1.0), answer_stub=cfg["reward"]["answer_stub"],
                                            micro_batch_size=cfg["reward"]["micro_batch_size"],
                                            score=passes["score_targets"]))
    return evaluators


def load_evaluator(path, name="evaluator", weight=1.0, chat_template="auto", dtype="float32", device="cpu",
                   system_prompt=None, chat_template_kwargs=None, answer_stub="\nAnswer:", micro_batch_size=8,
                   score=fast.score_targets):
    """A frozen evaluator j as the dict rlme_reward reads (what load_evaluators builds for
    `kind: frozen`), so no train.py or config is needed.

    Args:
        path: str, an HF folder, hub id or GGUF file (resolve_model_path).
        name: str, the evaluator's name in logp dicts and metric names.
        weight: float, v_j of RLME Eq. 3.
        chat_template: "auto" (the template if the tokenizer has one, plain text for a "-Base"
            model) | True | False: wrap the evaluator prompt in the chat template, else plain
            text + answer stub (use_chat_template).
        dtype: "float32" | "bfloat16" | "float16".
        device: str or torch.device the model is moved to.
        system_prompt: str or None, a system message before the evaluator prompt (chat only).
        chat_template_kwargs: dict or None, extra template variables, e.g. {"enable_thinking": False}.
        answer_stub, micro_batch_size, score: as local_evaluator (default fast.score_targets, the
            same numbers, faster).
    Returns:
        local_evaluator's dict {"name", "weight", "score"} over the loaded model (eval mode, no grad).
    Raises:
        ValueError: unknown dtype.
        SystemExit (one line): the path is not a causal LM, chat_template True without a template,
            or a system prompt / template kwarg that would do nothing (use_chat_template).
    """
    if dtype not in rollout.DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(rollout.DTYPES)}")
    model, tok = load_model(path, dtype=dtype, device=device)
    model.eval().requires_grad_(False)  # frozen: scored without grad, never trained
    chat = use_chat_template(tok, chat_template, model_path=path, system=system_prompt,
                                     template_kwargs=chat_template_kwargs, key=None)
    return local_evaluator(model, tok, chat=chat, name=name, weight=weight, answer_stub=answer_stub,
                           micro_batch_size=micro_batch_size, score=score)


def checked_template(template):
    """The evaluator template to use: None -> DEFAULT_EVALUATOR_TEMPLATE; any other is checked now
    (check_evaluator_template, then one trial fill) so that a bad one fails before the models load
    or the first batch, not inside it.

    Raises:
        SystemExit (one line): {problem} / {solution} / {question} missing, repeated or out of
            order, or an unknown {placeholder}.
    """
    template = template or DEFAULT_EVALUATOR_TEMPLATE
    check_evaluator_template(template)
    try:
        build_evaluator_text(template, "problem", "solution", "question")
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"evaluator template: cannot be filled ({type(e).__name__}: {e}); allowed "
                         f"placeholders: {{problem}} {{solution}} {{extracted}} {{reference}} {{question}}")
    return template


# A REMOTE evaluator (`kind: remote`): the same log p(target | prompt), scored by an
# OpenAI-compatible /v1/completions server that echoes the prompt with its log-probs (`echo: true`,
# `logprobs`, no generation): the target's log p is the sum of the echoed log-probs of the tokens
# that spell " Yes" at the end of prompt + target (echo_target_logprob). A request that fails
# after its retries gives None (NaN in the scores), never a number: the sample is masked
# (rlme_reward's "valid").
# Servers that work, and the tokenizer caveat: docs/scale-out.md, "Remote evaluators".
#
# Settings of a remote evaluator and their defaults (config.yaml's reward.evaluators comment
# documents them; config.validate_config fills them in for `kind: remote` entries).
REMOTE_DEFAULTS = {"api_key_env": None, "timeout_s": 60.0, "max_retries": 4, "backoff_base_s": 1.0,
                   "backoff_max_s": 30.0, "concurrency": 4, "batch_size": 1, "max_tokens": 0}


def remote_evaluator(base_url, model, *, name="remote", weight=1.0, tokenizer=None, chat_template="auto",
                     system_prompt=None, chat_template_kwargs=None, probe=True, where=None, config_key=None,
                     answer_stub="\nAnswer:", score_requests=None, **settings):
    """A remote evaluator j as the dict rlme_reward reads: log p(target | prompt) from an
    OpenAI-compatible /v1/completions server that returns prompt log-probs (`echo` + `logprobs`:
    vllm serve, llama-cpp-python's server; docs/scale-out.md). Usable outside train.py too:
    trl_reward_function([remote_evaluator("http://127.0.0.1:8000/v1", "M")], ...).

    Args:
        base_url: str, e.g. "http://127.0.0.1:8000/v1". model: str, the model name the server serves.
        name, weight: as load_evaluator.
        tokenizer: None (plain-text prompts: text + answer stub) or a path (HF folder, hub id,
            GGUF) whose tokenizer's chat template renders the prompt; it must be the served
            model's tokenizer.
        chat_template: "auto" (= a tokenizer with a chat template is given, unless its path
            names a "-Base" model) | True | False.
        system_prompt, chat_template_kwargs: the chat options, as load_evaluator.
        probe: score one short text now (a 1-line SystemExit if that fails: an unreachable server,
            one that ignores echo/logprobs, one that refuses batch_size prompts in one request).
        where: str naming the evaluator in error messages (default f"remote evaluator {name}").
        config_key: "reward.evaluators[i]" when built from a config (chat-option errors name its
            keys), else None (they name the command-line flags).
        answer_stub: appended to plain-text prompts (as local_evaluator).
        score_requests: fast.score_remote (default: batch_size texts per request, concurrency
            requests in flight) or its plain twin score_remote (one request per text, one after
            another); the same numbers.
        settings: REMOTE_DEFAULTS's keys: api_key_env (NAME of the variable holding the key; None =
            a local server), timeout_s per request, max_retries after the first try,
            backoff_base_s / backoff_max_s (backoff_delay), concurrency (requests in flight),
            batch_size (texts per request; 1 for llama-cpp-python, whose server takes one),
            max_tokens (sent with echo: 0 for vLLM; llama-cpp-python reads 0 as "no limit": 1).
    Returns:
        dict {"name", "weight", "score", "failures" (each text's failure reason in the last
        call, "" where scored), "remote" (settings + "client", "base_url", "model"), and for
        inspection "tokenizer", "chat"}; score returns NaN for a text whose request failed after
        its retries.
    Raises:
        SystemExit (one line): an unknown setting or bad value, an unset api_key_env variable, a
            chat template asked for without a tokenizer, a failed probe.
    """
    where = where or f"remote evaluator {name}"
    score_requests = score_requests or fast.score_remote
    unknown = set(settings) - set(REMOTE_DEFAULTS)
    if unknown:
        raise SystemExit(f"{where}: unknown setting(s) {sorted(unknown)} (known: {', '.join(REMOTE_DEFAULTS)})")
    r = dict(REMOTE_DEFAULTS, **settings, base_url=base_url, model=model)
    if not base_url or not model:
        raise SystemExit(f"{where}: needs base_url and model (the model name the server serves)")
    for key, low in (("timeout_s", 1e-9), ("max_retries", 0), ("backoff_base_s", 0), ("backoff_max_s", 0),
                     ("concurrency", 1), ("batch_size", 1), ("max_tokens", 0)):
        if not isinstance(r[key], (int, float)) or isinstance(r[key], bool) or r[key] < low:
            raise SystemExit(f"{where}: {key} must be a number >= {low:g}, got {r[key]!r}")
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer))
        except (OSError, ValueError) as e:  # no such folder, an offline hub, not a tokenizer
            raise SystemExit(f"{where}: path {tokenizer!r}: cannot load the tokenizer ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:150]})")
        except SystemExit as e:
            raise SystemExit(f"{where}: path: {e}")
    if chat_template is True and tok is None:
        raise SystemExit(f"{where}: chat_template true needs the served model's tokenizer (path) to render it")
    r["request"] = remote_request  # the HTTP call both scoring twins make (score_remote, fast.score_remote)
    r["client"] = openai_client(base_url, r["api_key_env"], r["timeout_s"], where=f"{where}: api_key_env",
                                needed_for=base_url)
    if tok is None and (system_prompt is not None or chat_template_kwargs):
        raise SystemExit(f"{where}: system_prompt / chat_template_kwargs need the served model's tokenizer "
                         f"(path) to render the chat template; without it the prompt is plain text")
    chat = False if tok is None else use_chat_template(
        tok, chat_template, model_path=tokenizer, system=system_prompt, template_kwargs=chat_template_kwargs,
        key=config_key)
    # as evaluator_prompt_and_target_ids tokenises: a rendered chat string holds its BOS already
    r["add_special_tokens"] = not chat
    if probe:
        probe_remote(r, tok, chat, where)

    def score(texts, targets, groups=None):  # groups: unused (the server shares prefixes itself, or not)
        fulls = []
        for row in texts:
            for text, target in zip(row, targets):
                prompt, full = evaluator_prompt_text(tok, text, target, chat=chat, answer_stub=answer_stub)
                fulls.append((full, full[len(prompt):]))
        vals, whys = score_requests(r, fulls)
        ev["failures"][:] = whys  # rlme_reward reports the first reason
        return torch.tensor([float("nan") if v is None else v for v in vals]).view(len(texts), len(targets))
    ev = {"name": name, "weight": float(weight), "score": score, "failures": [], "remote": r, "tokenizer": tok,
          "chat": chat}
    return ev


def probe_remote(r, tokenizer, chat, where):
    """Start-up check of a remote evaluator (`r`: its settings): score batch_size copies of one
    short text (one request, the configured retries). Raises SystemExit, one line, naming the
    evaluator, the server and the reason."""
    prompt, full = evaluator_prompt_text(tokenizer, "Is 2 + 2 = 4? Reply with Yes or No.", "Yes",
                                         chat=chat, answer_stub="\nAnswer:")
    texts = [(full, full[len(prompt):])] * r["batch_size"]
    vals, whys = remote_request(r, texts)
    if any(v is None for v in vals):
        why = next(w for w in whys if w)
        hint = " (set batch_size: 1: the server takes one prompt per request)" if r["batch_size"] > 1 else ""
        raise SystemExit(f"{where}: cannot score at {r['base_url']} (model {r['model']}): {why}{hint}")


def remote_request(r, fulls, sleep=time.sleep, rand=random.random):
    """One /v1/completions request for a list of texts, with retries (call_with_retries): echo the
    texts with their log-probs, generate nothing (max_tokens r["max_tokens"], temperature 0).

    Args:
        r: a remote evaluator's settings (remote_evaluator's ev["remote"]).
        fulls: list of (full text, suffix): the target's log p is read from the tokens spelling
            `suffix` at the end of `full` (echo_target_logprob).
    Returns:
        (list of float or None, list of str reasons: "" where scored). Never raises. A failed
        request fails all its texts; an answer that cannot be read fails only its text (not
        retried: the same request gets the same answer).
    """
    def call():
        resp = r["client"].completions.create(
            model=r["model"], prompt=[f for f, _ in fulls] if len(fulls) > 1 else fulls[0][0],
            max_tokens=r["max_tokens"], echo=True, logprobs=1, temperature=0.0,
            # a chat string holds its BOS: vLLM's switch not to add another (as our tokenizer call);
            # sent only then, as strict servers refuse unknown fields (transformers serve: HTTP 422)
            extra_body={} if r.get("add_special_tokens", True) else {"add_special_tokens": False})
        choices = None if isinstance(resp, str) else getattr(resp, "choices", None)
        if not choices or len(choices) != len(fulls):
            return None, (f"not a completion for {len(fulls)} prompt(s) (HTML page or wrong URL?): "
                          f"{str(resp)[:60]!r}")
        choices = sorted(choices, key=lambda c: c.index or 0)
        return [echo_target_logprob(c.model_dump() if hasattr(c, "model_dump") else c, full, suffix)
                for c, (full, suffix) in zip(choices, fulls)], ""

    out, why, _ = call_with_retries(call, r["max_retries"], r["backoff_base_s"], r["backoff_max_s"],
                                    sleep=sleep, rand=rand)
    if out is None:
        return [None] * len(fulls), [why] * len(fulls)
    return [o[0] for o in out], [o[1] for o in out]


def echo_target_logprob(choice, full, suffix):
    """The target's log p from one echoed completion choice: the sum of the echoed log-probs of
    the tokens whose texts spell `suffix` at the end of the echoed `full` text.

    The boundary is found from the end, by token texts, not by text_offset: llama-cpp-python's
    offsets leave out special tokens (a chat prompt's <|im_start|>) and vLLM's count a BOS, so
    offsets are not positions in our string; the tokens that end the echo are the same text on
    every server. Tokens the server generated after the echo (max_tokens >= 1: choice["text"] is
    full + what it generated) are dropped first when listed (vLLM lists them, llama-cpp-python does
    not); a prompt that itself ends in target + generated text would be misread, which our
    prompts (ending in "Answer:" or a chat header) never do.

    Args:
        choice: dict, an OpenAI completion choice {"text", "logprobs": {"tokens",
            "token_logprobs", ...}}.
        full: str, the text sent (prompt + suffix). suffix: str, the target as it follows the
            prompt (" Yes").
    Returns:
        (float, "") or (None, reason) when the answer cannot be read safely: no log-probs (the
        server ignores echo/logprobs), the echo does not start with `full`, a token straddles the
        prompt/target boundary or the target tokens do not spell `suffix` (a tokenizer differing
        from the one the prompt was built for), a missing or non-finite log-prob.
    """
    lp = choice.get("logprobs") or {}
    tokens, values = lp.get("tokens"), lp.get("token_logprobs")
    if not tokens or not isinstance(values, list) or len(values) != len(tokens):
        return None, "no prompt log-probs in the answer (does the server support echo with logprobs?)"
    text = choice.get("text")
    if not isinstance(text, str) or not text.startswith(full):
        return None, f"the answer does not echo the prompt (text starts {str(text)[:40]!r})"
    # tokens generated after the echo are listed by vLLM, not by llama-cpp-python: drop them when
    # the listed tokens end with target + generated text
    generated, end, tail = text[len(full):], len(tokens), ""
    if generated and "".join(tokens).endswith(suffix + generated):
        while end > 0 and len(tail) < len(generated):
            end -= 1
            tail = tokens[end] + tail
        if tail != generated:
            return None, f"cannot separate the generated tokens {tail!r} from the echo (generated {generated!r})"
    if end == 0 or not tokens[end - 1]:
        return None, "the echo ends in an empty token (an end-of-text token?): cannot tell where the target is"
    start, spelled = end, ""
    while start > 0 and len(spelled) < len(suffix):
        start -= 1
        spelled = tokens[start] + spelled
    if spelled != suffix:
        reason = ("a token straddles the prompt and the target" if spelled.endswith(suffix)
                  else "the last tokens do not spell the target (a different tokenizer?)")
        return None, f"{reason}: tokens {tokens[start:end]!r}, target {suffix!r}"
    vals = values[start:end]
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in vals):
        return None, f"missing or non-finite log-prob for the target tokens: {vals!r}"
    return float(sum(vals)), ""


def score_remote(r, fulls):
    """log p(target | prompt) from a remote evaluator, one request per text, one after another
    (fast.score_remote batches and overlaps the requests).

    Args:
        r: a remote evaluator's settings with its client (remote_evaluator's ev["remote"]).
        fulls: list of (full text str, suffix str): full = prompt + suffix, suffix = the target as
            the evaluator reads it (" Yes"; evaluator_prompt_text).
    Returns:
        (list of float log p or None, list of str failure reasons, "" where scored).
    """
    out = [r["request"](r, [f]) for f in fulls]
    return [o[0][0] for o in out], [o[1][0] for o in out]
