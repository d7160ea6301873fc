"""Services around the method: evaluators built from a config or a path (local models and remote
OpenAI-compatible servers, as reward.local_evaluator's dict), the critique judge (the LLM judge's
client with retries and backoff, the offline proxy judge), and the RLME reward as a TRL reward
function or a verl compute_score (trl_reward_function, verl_compute_score).
"""
import concurrent.futures
import datetime
import email.utils
import math
import os
import random
import re
import time

import torch

import fast
import reward
from reward import (DEFAULT_EVALUATOR_TEMPLATE, JUDGE_VARIANTS, build_evaluator_text, check_evaluator_template,
                    evaluator_prompt_text, local_evaluator, logp_metric_name, meta_question_dicts,
                    parse_judge_output, parse_meta_judge_output, rlme_reward)
import rollout

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


# The RLME reward outside our trainer (RLME Eq. 2-3): trl_reward_function and verl_compute_score
# close over already-loaded evaluators and return the callable each trainer expects; every score
# is reward.rlme_reward on the same (problem, completion) pairs, so a reward logged by TRL or verl
# can be recomputed with reward.py alone. Only FROZEN evaluators: a reward function gets texts,
# not the trainer's current weights, so train.py's `kind: live` (the policy scoring its own
# answers) is not possible from outside a trainer (scripts/bench_vs_trl.py shows a TRL-internal
# workaround for benchmarking only).
#
#   from plumbing import services
#   ev = services.load_evaluator("HuggingFaceTB/SmolLM2-135M-Instruct")
#   fn = services.trl_reward_function([ev], ["Is the answer correct?"], problem_key="question")
#   GRPOTrainer(model=..., reward_funcs=fn, ...)        # TRL: one call per generation batch
#   compute_score = services.verl_compute_score([ev], ["Is the answer correct?"])   # verl: per sample


def _checked_setup(evaluators, meta_questions, template, transform):
    """The factories' start-up checks (one place, so TRL and verl fail alike, before any batch is
    scored). Returns (meta-question dicts, template)."""
    if transform not in ("log", "prob"):
        raise ValueError(f"transform {transform!r}: expected log or prob")
    keys = {"name", "weight", "score"}
    if not evaluators:
        raise ValueError("evaluators: need at least one (load_evaluator builds one)")
    for i, ev in enumerate(evaluators):
        if not isinstance(ev, dict) or not keys <= set(ev):
            raise ValueError(f"evaluators[{i}]: expected a dict with keys {sorted(keys)} (load_evaluator)")
    return meta_question_dicts(meta_questions), checked_template(template)


def _message_text(content):
    """A chat message's content as text: a str as is, a list of content blocks
    ([{"type": "text", "text": ...}, ...], TRL's multimodal form) -> its text blocks joined."""
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")


def problem_text(prompt):
    """The problem the evaluator reads, from a TRL prompt (or a dataset column holding one).

    Args:
        prompt: str (standard dataset), or a list of {"role", "content"} messages
            (conversational dataset): the LAST user message is the problem (a system message or
            earlier turns are not shown to the evaluator).
    Returns:
        str.
    Raises:
        ValueError: a message list without a user message, or another type.
    """
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return _message_text(users[-1].get("content", ""))
        raise ValueError(f"conversational prompt has no user message: roles {[m.get('role') for m in prompt]}")
    raise ValueError(f"prompt: expected a str or a list of messages, got {type(prompt).__name__}")


def solution_text(completion):
    """The solution y the evaluator judges, from a TRL completion.

    Args:
        completion: str (standard dataset), or a list of {"role", "content"} messages
            (conversational): the contents of all assistant messages joined by blank lines (one
            message in single-turn generation; tool results between turns are not included).
    Returns:
        str ("" for a message list without assistant content).
    """
    if isinstance(completion, str):
        return completion
    return "\n\n".join(_message_text(m.get("content") or "") for m in completion
                       if isinstance(m, dict) and m.get("role") == "assistant")


def trl_reward_function(evaluators, meta_questions, *, template=None, transform="log", problem_key="prompt",
                        name="rlme_reward"):
    """A TRL reward function (GRPOTrainer's reward_funcs) returning the RLME reward
    r(x, y) = sum_j v_j sum_k w_k log p_{j,k}, p_{j,k} = pi_phi_j(a_k | x, y, q_k) (RLME Eq. 2-3):
    reward.rlme_reward on the batch, so the values are exactly those of rlme_reward on the same
    (problem, completion) pairs.

    The returned `fn(prompts, completions, **kwargs) -> list[float]` has TRL's custom reward
    signature (trl 1.16 GRPOTrainer._calculate_rewards): prompts / completions are str or lists
    of {"role", "content"} messages (problem_text, solution_text); dataset columns other than
    "prompt" arrive as keyword lists; TRL also passes `log_metric(name, value)`, through which the
    batch mean of every evaluator's log p per meta-question is logged as
    "rlme/<evaluator>/<question>/logp" (logp_metric_name), plus "rlme/nonfinite" (log p values
    replaced because they were NaN/inf). The rest of TRL's keywords (trainer_state, log_extra,
    completion_ids, ...) are accepted and ignored. Returns None only for a sample a remote
    evaluator failed to score after its retries (TRL then leaves it out; logged as
    "evaluator/<name>/failed"), never a made-up number.
    fn.__name__ is `name`: TRL logs the reward as "rewards/<name>/mean".

    Evaluators must be frozen models loaded beforehand (load_evaluator) or remote ones
    (remote_evaluator): a reward function sees
    texts, not the trainer's current weights, so a live evaluator (the policy itself) is not
    possible here. The samples of one prompt are adjacent in TRL's batch, so their shared
    evaluator prefix runs once (score_targets).

    Args:
        evaluators: list of evaluator dicts {"name", "weight": v_j, "score"} (load_evaluator,
            remote_evaluator; the answer stub of plain-text prompts and the scoring micro-batch
            are theirs).
        meta_questions: list of str or dicts (meta_question_dicts).
        template: evaluator prompt template; None = DEFAULT_EVALUATOR_TEMPLATE (math), or
            QA_EVALUATOR_TEMPLATE, or your own with the same placeholders.
        transform: "log" (RLME Eq. 3) | "prob" (sum of p instead).
        problem_key: "prompt" = the problem is the prompt itself (its last user message), which
            includes any instructions the prompt template adds; any other value names a dataset
            column holding the bare problem (e.g. "question").
        name: str, fn.__name__.
    Returns:
        callable fn(prompts, completions, **kwargs) -> list[float], one reward per completion.
    Raises:
        ValueError (at once): unknown transform, malformed evaluators or meta-questions.
        SystemExit (at once): a template without {problem}/{solution}/{question} in order, or
            with an unknown placeholder.
        ValueError (when called): the dataset has no column `problem_key`.
    """
    mqs, template = _checked_setup(evaluators, meta_questions, template, transform)

    def fn(prompts, completions, **kwargs):
        if problem_key == "prompt":
            problems = [problem_text(p) for p in prompts]
        elif problem_key in kwargs:
            problems = [problem_text(p) for p in kwargs[problem_key]]
        else:
            columns = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric"))
            raise ValueError(f"reward function {name!r}: problem_key {problem_key!r} is not a dataset column "
                             f"(columns passed: {columns}); use problem_key='prompt' to read the prompt")
        out = rlme_reward(evaluators, mqs, problems, [solution_text(c) for c in completions], template=template,
                          transform=transform)
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:  # TRL averages these over the logging step
            means = out["logp"].nanmean(0)  # [J, K]; NaN: a remote evaluator's failed requests
            for j, ev in enumerate(evaluators):
                for k, mq in enumerate(mqs):
                    log_metric(logp_metric_name(ev["name"], mq["question"]), means[j, k].item())
                if "failures" in ev:  # a remote evaluator
                    log_metric(f"evaluator/{ev['name']}/failed", float(out["failed"][:, j].any(1).sum()))
            log_metric("rlme/nonfinite", float(out["nonfinite"]))
        # None where a remote evaluator failed: TRL leaves such a sample out of the reward (NaN)
        return [r if ok else None for r, ok in zip(out["reward"].tolist(), out["valid"].tolist())]

    fn.__name__ = fn.__qualname__ = name
    return fn


def verl_compute_score(evaluators, meta_questions, *, template=None, transform="log", problem_key="question"):
    """A verl custom reward function returning the RLME reward of one sample (RLME Eq. 2-3):
    reward.rlme_reward on the single (problem, solution) pair.

    The returned `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float`
    has the signature of verl's documented custom reward function (custom_reward_function.path /
    .name; verl's reward managers call it with these keywords, one sample per call). So every call
    is a batch of one: no batching across samples and no shared group prefix, which makes it slow
    (about N forward passes of the evaluator per step instead of N / micro-batch); for large runs
    a batched verl reward manager calling rlme_reward is the fast route.
    The problem is read from extra_info[problem_key]: verl's own data preprocessing scripts (e.g.
    examples/data_preprocess/gsm8k.py) store the bare question as extra_info["question"].
    data_source and ground_truth are not read: the RLME reward needs no labels.
    Evaluators must be frozen models (load_evaluator) or remote ones (remote_evaluator; a failed
    request raises RuntimeError: no made-up score); a live evaluator is not possible from outside
    the trainer. The module that builds compute_score is imported by each verl reward worker, so
    every worker loads its own evaluator copy; verl's reward workers have no GPU, so a big
    evaluator belongs on a server: an entry {"base_url", "model", ...} (the keys of config.yaml's
    `kind: remote` evaluators, `path` = the served model's tokenizer) is built and probed here
    (`verl_evaluators`), and `verl_remote_score` takes such entries from verl's YAML
    (docs/scale-out.md "The verl adapter").

    Args:
        evaluators: as trl_reward_function, or remote specs (dicts with base_url and model).
        meta_questions, template, transform: as trl_reward_function.
        problem_key: the extra_info key holding the problem.
    Returns:
        callable compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float.
    Raises:
        ValueError / SystemExit (at once): as trl_reward_function.
        ValueError (when called): extra_info is not a dict holding problem_key.
    """
    evaluators = verl_evaluators(evaluators)
    mqs, template = _checked_setup(evaluators, meta_questions, template, transform)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if not isinstance(extra_info, dict) or not isinstance(extra_info.get(problem_key), str):
            found = sorted(extra_info) if isinstance(extra_info, dict) else type(extra_info).__name__
            raise ValueError(f"verl compute_score: extra_info[{problem_key!r}] must hold the problem text "
                             f"(found {found}); add it in your data preprocessing")
        out = rlme_reward(evaluators, mqs, [extra_info[problem_key]], [solution_str], template=template,
                          transform=transform)
        if not out["valid"][0]:  # verl wants a float: no number rather than a made-up one
            raise RuntimeError(f"verl compute_score: remote evaluator failed: {'; '.join(w for w in out['why'].values() if w)}")
        return float(out["reward"][0])

    return compute_score


def verl_evaluators(evaluators):
    """verl_compute_score's evaluator list: built evaluator dicts (load_evaluator, remote_evaluator)
    pass through; a spec {"base_url", "model", optional "name", "weight", "path" (the served model's
    tokenizer, for its chat template), "kind": "remote", and REMOTE_DEFAULTS' settings} becomes
    remote_evaluator(...), probed at once (a one-line SystemExit naming `verl evaluators[i]`)."""
    out = []
    for i, ev in enumerate(evaluators or []):
        if hasattr(ev, "keys") and "score" not in ev and "base_url" in ev:
            spec = {k: ev[k] for k in ev.keys() if k != "kind"}
            if ev.get("kind", "remote") != "remote" or not spec.get("model"):
                raise SystemExit(f"verl evaluators[{i}]: a spec with base_url needs model (the name the server serves) "
                                 f"and kind remote (or no kind), got {sorted(ev.keys())}")
            base_url, model = spec.pop("base_url"), spec.pop("model")
            if "path" in spec:
                spec["tokenizer"] = spec.pop("path")
            ev = remote_evaluator(base_url, model, where=f"verl evaluators[{i}] ({spec.get('name', 'remote')})", **spec)
        out.append(ev)
    return out


_VERL_SCORERS = {}  # verl_remote_score's compute_score per settings, built once per worker process


def verl_remote_score(data_source, solution_str, ground_truth, extra_info=None, *, evaluators, meta_questions,
                      template=None, transform="log", problem_key="question"):
    """verl_compute_score as ONE function verl's config can name: verl calls it per sample with its
    `custom_reward_function.reward_kwargs` (plain YAML: evaluator specs with base_url + model,
    verl_evaluators) as keywords; the first call of a worker builds (and probes) the evaluators,
    later calls reuse them. Returns the float RLME reward of the sample (RLME Eq. 2-3)."""
    plain = _plain_yaml([evaluators, meta_questions, template, transform, problem_key])
    key = repr(plain)
    if key not in _VERL_SCORERS:
        _VERL_SCORERS[key] = verl_compute_score(plain[0], plain[1], template=plain[2], transform=plain[3],
                                                problem_key=plain[4])
    return _VERL_SCORERS[key](data_source, solution_str, ground_truth, extra_info)


def _plain_yaml(x):
    """OmegaConf's DictConfig / ListConfig (what verl hands over) as plain dicts and lists."""
    if hasattr(x, "keys"):
        return {k: _plain_yaml(x[k]) for k in x.keys()}
    if isinstance(x, (list, tuple)) or type(x).__name__ == "ListConfig":
        return [_plain_yaml(v) for v in x]
    return x


# The keys of config.yaml's `judge:` section, which holds their defaults and meanings (the only copy).
JUDGE_KEYS = ("backend", "variant", "on_failure", "base_url", "model", "api_key_env", "concurrency", "timeout_s", "max_retries",
              "backoff_base_s", "backoff_max_s", "temperature", "max_tokens", "max_tokens_field")


# The judge request's sampling parameters: {judge.* key of the value: judge.* key holding the
# request field's name, or None when the field is named as the key}. Every request (and the
# start-up probe) sends {field: judge[key]} for each key whose value is not null (null leaves the
# field out: the server's default applies; the authors' release sends neither, reward_function.py
# of Character-GenRM-NLHF), and a server that refuses a field (HTTP 400/422 naming it, as OpenAI's
# reasoning models refuse temperature 0 and max_tokens) is answered with that key (judge_fault).
JUDGE_REQUEST_FIELDS = {"temperature": None, "max_tokens": "max_tokens_field"}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")  # judge.max_tokens_field: the OpenAI API's two names
PROBE_MAX_TOKENS = 8  # the probe's answer length: "OK" needs one token, a CPU server makes ~3/s


def make_judge(cfg, sleep=time.sleep, rand=random.random, probe=True, failures=None):
    """Build the critique judge S(h, c) from the `judge:` config section (start-up checks happen here).

    Args:
        cfg: config.yaml's `judge:` section, every key of JUDGE_KEYS (config.load_config fills
            them from config.yaml).
        sleep, rand: injectable for tests (backoff waits and jitter draws).
        probe: backend 'openai': send one short chat request now (probe_judge), so an unreachable
            server, a wrong model name, a refused parameter or API key stop the run before any
            model loads, not as masked samples after it. False only for tests without a server.
        failures: None or a dict that the judge fills as calls fail, {reason: the server's message
            of its first occurrence} (evaluate.py judge-check prints it).
    Returns:
        judge(pairs) -> list[dict], the plain callable reward.score_dh takes: pairs a list of
        (human critique, GRM critique, item) tuples (the item, read by judge.variant meta_judge,
        may be left out), each result {"f1", "precision", "recall", "why", "attempts"} in order,
        f1 None on a failure; judge.concurrency calls at a time (a thread pool); it never raises.
        Backend 'openai': reward.judge_prompt's request with retries and a strict parse
        (_judge_call) through an openai.OpenAI client with its own retries off (we retry
        ourselves; the API key lives only inside it); 'proxy': the lexical proxy_f1, whatever the
        variant. judge.on_failure is checked here but applied by the reward (score_dh's on_failure).
    Raises:
        SystemExit (one line): unknown or missing key, unknown backend, no model name, api_key_env names an
        environment variable that is unset (a hosted judge would fail every call otherwise), or
        the probe failed (the line names the judge.* key to change: probe_judge).
    """
    unknown, missing = set(cfg) - set(JUDGE_KEYS), set(JUDGE_KEYS) - set(cfg)
    if unknown or missing:
        raise SystemExit(f"judge: unknown key(s) {sorted(unknown)}, missing key(s) {sorted(missing)}; "
                         f"config.yaml's judge section has them all")
    j = dict(cfg)
    if j["variant"] not in JUDGE_VARIANTS:
        raise SystemExit(f"judge.variant: {j['variant']!r} unknown; allowed: {', '.join(JUDGE_VARIANTS)}")
    if j["on_failure"] not in ("mask", "zero"):
        raise SystemExit(f"judge.on_failure: {j['on_failure']!r} unknown; allowed: mask, zero")
    if j["max_tokens_field"] not in MAX_TOKENS_FIELDS:
        raise SystemExit(f"judge.max_tokens_field: {j['max_tokens_field']!r} unknown; allowed: {', '.join(MAX_TOKENS_FIELDS)}")
    if j["backend"] == "proxy":
        return judge_pool(lambda human, critique, item: dict(proxy_f1(human, critique), attempts=1), j["concurrency"])
    if j["backend"] != "openai":
        raise SystemExit(f"judge.backend: {j['backend']!r} unknown; allowed: openai, proxy")
    if not j["model"]:
        raise SystemExit("judge.model: required for backend 'openai' (the model name the server serves)")
    j["client"] = openai_client(j["base_url"], j["api_key_env"], j["timeout_s"], where="judge.api_key_env",
                                needed_for=f"the judge at {j['base_url']}")
    j["failures"] = {} if failures is None else failures
    if probe:
        probe_judge(j, sleep=sleep, rand=rand)
    return judge_pool(lambda human, critique, item: _judge_call(
        j, reward.judge_prompt(j["variant"], human, critique, item), sleep=sleep, rand=rand), j["concurrency"])


def judge_pool(similarity, concurrency):
    """The judge callable judge(pairs) -> list[dict] over a one-pair `similarity(human, critique,
    item) -> dict(f1, precision, recall, why, attempts)`, `concurrency` calls at a time; results in
    order. A similarity that raises gives that pair f1=None with the reason (belt and braces: a
    judge bug must not kill a training run)."""
    def one(pair):
        try:
            return similarity(pair[0], pair[1], pair[2] if len(pair) > 2 else None)
        except Exception as e:
            return {"precision": None, "recall": None, "f1": None, "why": f"{type(e).__name__}: {e}", "attempts": 0}

    def judge(pairs):
        if not pairs:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(concurrency))) as pool:
            return list(pool.map(one, pairs))
    return judge


def judge_request_names(judge):
    """{judge.* key: the request field it is sent as} for the sampling keys of JUDGE_REQUEST_FIELDS."""
    return {key: (judge[name_key] if name_key else key) for key, name_key in JUDGE_REQUEST_FIELDS.items()}


def judge_request_fields(judge, probe=False):
    """The sampling fields of a judge request, {field: value} (JUDGE_REQUEST_FIELDS), without the
    keys set to null; the probe asks for at most PROBE_MAX_TOKENS tokens when a token limit is
    sent at all (the same field names, so a refused one shows; a judge without a limit is probed
    without one, as it is called)."""
    out = {}
    for key, field in judge_request_names(judge).items():
        if judge[key] is not None:
            out[field] = min(judge[key], PROBE_MAX_TOKENS) if probe and key == "max_tokens" else judge[key]
    return out


def probe_judge(judge, sleep=time.sleep, rand=random.random):
    """Start-up check of the LLM judge, as probe_remote for a remote evaluator: one short chat
    request ("Reply with OK", the configured model and sampling fields, at most PROBE_MAX_TOKENS
    tokens, the configured retries and timeout); any chat completion passes (its text is not
    read: a small judge need not follow the format to be reachable).

    Args:
        judge: make_judge's dict (backend 'openai', with its client).
        sleep, rand: as call_with_retries.
    Raises:
        SystemExit, one line starting with the judge.* key to change (judge_fault): unreachable or
        timed out (judge.base_url / judge.timeout_s), model not served (judge.model), a refused
        sampling field (its key in JUDGE_REQUEST_FIELDS), a refused key (judge.api_key_env), ...
    """
    def call():
        resp = judge["client"].chat.completions.create(
            model=judge["model"], messages=[{"role": "user", "content": "Reply with the word OK."}],
            **judge_request_fields(judge, probe=True))
        if isinstance(resp, str) or not getattr(resp, "choices", None):
            return None, f"not a chat completion (HTML page or wrong URL?): {str(resp)[:60]!r}"
        return resp, ""

    errors = []
    resp, why, attempts = call_with_retries(call, judge["max_retries"], judge["backoff_base_s"],
                                            judge["backoff_max_s"], sleep=sleep, rand=rand, errors=errors)
    if resp is None:
        key, hint = judge_fault(judge, errors[-1] if errors else why)
        raise SystemExit(f"{key}: {hint} [the judge's start-up request to {judge['base_url']} (model "
                         f"{judge['model']}), {attempts} tr{'y' if attempts == 1 else 'ies'}: "
                         f"{failure_text(errors[-1] if errors else why)}]")


def failure_text(err):
    """One line for a failed request: "HTTP <status>: <the server's message>" for an HTTP error
    (the JSON error's message / detail, else the body's start), "<class>: <text>" for another
    exception (a refused connection: its cause, e.g. "ConnectError: [Errno 111] ..."), a str
    (a reason call_with_retries' `call` gave) as is. At most ~200 characters."""
    import openai
    if isinstance(err, str):
        return err
    if isinstance(err, openai.APIStatusError):
        body = err.body  # the client unwraps OpenAI's {"error": {...}}
        msg = (body.get("message") or body.get("detail") or body) if isinstance(body, dict) else body
        if not msg:
            msg = getattr(err.response, "text", "") or err.message
        return f"HTTP {err.status_code}: {' '.join(str(msg).split())[:200]}"
    cause = err.__cause__ or err
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:200]}"


def judge_fault(judge, err):
    """(judge.* key to change, what to do) for the probe's last failure `err` (an exception of the
    openai client, or the str reason of an answer that was no chat completion). The order
    matters: a refused-parameter message can mention "this model", so parameters come first."""
    import openai
    url, model = judge["base_url"], judge["model"]
    if isinstance(err, openai.APITimeoutError):
        return "judge.timeout_s", (f"no answer within {judge['timeout_s']:g} s: a slow or still-loading server "
                                   f"(raise judge.timeout_s) or the wrong host (judge.base_url)")
    if isinstance(err, openai.APIConnectionError):
        return "judge.base_url", (f"nothing answers at {url}: start the judge server, or set judge.base_url "
                                  f"to where it runs")
    if not isinstance(err, openai.APIStatusError):
        return "judge.base_url", "is judge.base_url the server's OpenAI-compatible root (usually ending in /v1)?"
    code, msg = err.status_code, failure_text(err)
    if code == 401:
        return "judge.api_key_env", ("the server refused the API key: set judge.api_key_env to the NAME of the "
                                     "environment variable holding a valid key" + (
                                         f" (now {judge['api_key_env']})" if judge["api_key_env"] else " (now unset)"))
    if code in (400, 422):
        sent = {field: key for key, field in judge_request_names(judge).items() if judge[key] is not None}
        for field, key in sent.items():  # only the fields this request carried can be the refused ones
            if getattr(err, "param", None) == field or re.search(rf"['\"`]{re.escape(field)}['\"`]", msg):
                fix = {"temperature": "judge.temperature: null (the server's default; OpenAI's reasoning models "
                                      "take only 1) or a value it accepts",
                       "max_tokens": "judge.max_tokens_field: max_completion_tokens (OpenAI's reasoning models), "
                                     "or judge.max_tokens: null (no limit sent)"}[key]
                return f"judge.{key}", (f"the server refuses the request field {field} = {judge[key]!r}: set {fix} "
                                        f"(see its message)")
    named = re.search(rf"['\"`]{re.escape(str(model))}['\"`]", msg)  # "The model `x` does not exist", "requested 'x'"
    if code in (400, 404, 422) and (getattr(err, "code", None) == "model_not_found" or named
                                    or (code == 404 and "model" in msg.lower())):
        return "judge.model", (f"the server does not serve model {model!r}: set judge.model to a name it serves "
                               f"(GET {url.rstrip('/')}/models lists them)")
    if code == 404:
        return "judge.base_url", (f"no chat completions at {url.rstrip('/')}/chat/completions: is judge.base_url the "
                                  f"server's OpenAI-compatible root (usually ending in /v1)?")
    if code == 403:
        return "judge.api_key_env", f"the key in {judge['api_key_env']} has no access (to model {model!r}?)"
    if code == 429:
        return "judge.api_key_env", ("rate-limited or out of quota at start-up: wait, use a key with quota, or raise "
                                     "judge.max_retries / judge.backoff_max_s")
    return "judge.base_url", "the server failed the request: see its log (or point judge.base_url at another)"


def openai_client(base_url, api_key_env, timeout_s, *, where, needed_for):
    """An openai.OpenAI client for an OpenAI-compatible server (the judge, a remote evaluator).

    Args:
        api_key_env: NAME of the environment variable holding the key, or None (a local server:
            it ignores the key, but the client insists on one). timeout_s: seconds per request.
        where, needed_for: for the error message.
    Returns:
        openai.OpenAI with max_retries 0: our call_with_retries does the retrying (and counts it).
    Raises:
        SystemExit (one line): api_key_env names a variable that is not set.
    """
    key = "EMPTY"
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise SystemExit(f"{where}: environment variable {api_key_env} is not set (needed for {needed_for})")
    import openai  # here, not at the top: only these servers need the package
    return openai.OpenAI(base_url=base_url, api_key=key, timeout=float(timeout_s), max_retries=0)


def backoff_delay(attempt, base, cap, u):
    """Seconds to wait before retry `attempt` (0-based): 'equal jitter' exponential backoff,
    d = min(cap, base * 2**attempt), delay = d/2 + u * d/2 with u ~ U[0, 1). Half the delay is
    guaranteed (the server gets a break), the other half spreads the clients out."""
    d = min(cap, base * 2 ** attempt)
    return d / 2 + u * d / 2


def retry_after_s(headers, now=None):
    """The wait a 429/503 answer asks for, in seconds: its retry-after-ms header (OpenAI's), else
    Retry-After as seconds or as an HTTP-date (RFC 9110 §10.2.3).

    Args: headers: the answer's headers (case-insensitive httpx headers, or a lower-case dict).
        now: epoch seconds the HTTP-date is measured from (None: time.time()).
    Returns: float >= 0, or None when there is no such header or it cannot be read.
    """
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = (headers.get(name) or "").strip()
        if not value:
            continue
        try:
            secs = float(value) * scale
        except ValueError:
            if scale != 1.0:
                continue
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:  # "-0000": UTC, no zone named
                when = when.replace(tzinfo=datetime.timezone.utc)
            secs = when.timestamp() - (time.time() if now is None else now)
        if math.isfinite(secs):
            return max(0.0, secs)
    return None


def call_with_retries(call, max_retries, backoff_base_s, backoff_max_s, sleep=time.sleep, rand=random.random,
                      errors=None):
    """One request to an OpenAI-compatible server, retried: the judge's and the remote evaluator's.

    Retried: HTTP 408/409/429/5xx, timeouts, refused connections, and answers that `call` rejects
    (it returns value None: an HTML page, an unparseable judge answer); other HTTP 4xx are not
    (they will not heal). Waits backoff_delay between tries; after a 429 or 503 that says how long
    to wait (retry_after_s) at least that long, but never over backoff_max_s (the longest wait
    between two tries: a server asking for an hour is retried sooner anyway, and the request then
    fails as any other rather than stalling a training step for that hour).

    Args:
        call: () -> (value, why); raises the openai client's errors.
        max_retries: int, retries after the first try. backoff_base_s, backoff_max_s: backoff_delay's.
        sleep, rand: injectable for tests (waits and jitter draws).
        errors: list or None: each failed try appends its exception (or `call`'s str reason), for
            callers that report the server's message (failure_text, probe_judge).
    Returns:
        (value or None, why str: the last failure's reason, attempts int). Never raises.
    """
    import openai
    why, attempt = "", 0
    for attempt in range(int(max_retries) + 1):
        retry, asked, err = True, None, None
        try:
            value, why = call()
            if value is not None:
                return value, why, attempt + 1
            err = why
        except openai.APIStatusError as e:
            why, err = f"HTTP {e.status_code}", e
            retry = e.status_code in (408, 409, 429) or e.status_code >= 500  # others will not heal
            if e.status_code in (429, 503):
                asked = retry_after_s(e.response.headers)
        except openai.APITimeoutError as e:
            why, err = "timeout", e
        except openai.APIConnectionError as e:
            why, err = f"connection error: {type(e.__cause__ or e).__name__}", e
        except Exception as e:  # anything else (bad JSON body, ...) is a failed call, not a crash
            why, err = f"{type(e).__name__}: {str(e)[:100]}", e
        if errors is not None:
            errors.append(err)
        if not retry or attempt == int(max_retries):
            break
        delay = backoff_delay(attempt, base=backoff_base_s, cap=backoff_max_s, u=rand())
        sleep(delay if asked is None else min(max(delay, asked), backoff_max_s))
    return None, why, attempt + 1


def _judge_call(judge, prompt, sleep, rand):
    """One judge request (judge_prompt's text) with retries. Returns dict(f1, precision, recall,
    why, attempts)."""
    parse = parse_meta_judge_output if judge["variant"] == "meta_judge" else parse_judge_output

    def call():
        resp = judge["client"].chat.completions.create(
            model=judge["model"], messages=[{"role": "user", "content": prompt}], **judge_request_fields(judge))
        if isinstance(resp, str) or not getattr(resp, "choices", None):
            # the client hands back the raw body when the server does not answer JSON
            return None, f"not a chat completion (HTML page or wrong URL?): {str(resp)[:60]!r}"
        parsed = parse(resp.choices[0].message.content)
        return (parsed, "") if parsed["f1"] is not None else (None, "parse failure: " + parsed["why"])

    errors = []
    parsed, why, attempts = call_with_retries(call, judge["max_retries"], judge["backoff_base_s"],
                                              judge["backoff_max_s"], sleep=sleep, rand=rand, errors=errors)
    if parsed is not None:
        return dict(parsed, attempts=attempts)
    # the short reason goes into the sample; the server's message of its first occurrence here
    judge.setdefault("failures", {}).setdefault(why, failure_text(errors[-1]) if errors else why)
    return {"precision": None, "recall": None, "f1": None, "why": why, "attempts": attempts}


# Offline PROXY of the judge (no server). It is a lexical stand-in for tests and laptops, not the
# paper's LLM judge: it cannot tell paraphrases or stances apart beyond shared content words.
_STOP = set("""a an the and or but if then than so of to in on at by for with from as is are was
were be been being it its this that these those there here which who whom what when where why how
not no yes do does did done has have had can could should would will shall may might must very
also just only more most less least such both each other into about over under again further
their they them he she his her we our you your i me my too response""".split())


def _points(text):
    """Sentence-level points of a critique as sets of content words. 'Response A' / 'Response B'
    become the tokens 'resp_a' / 'resp_b' so the response a point is about survives."""
    text = re.sub(r"\bresponse\s+([ab])\b", r"resp_\1", (text or "").lower())
    out = []
    for sent in re.split(r"(?<=[.!?;])\s+|\n+", text):
        words = {w for w in re.findall(r"[a-z0-9_]+", sent) if w not in _STOP}
        if words:
            out.append(words)
    return out


def _dice(x, y):
    return 2 * len(x & y) / (len(x) + len(y))


def proxy_f1(human, model, match=0.4, repeat=0.8):
    """PROXY critique similarity: F1 of greedily matched sentence-level points (lexical).

    Points = sentences as content-word sets (_points). Repetition check first: two candidate
    points with Dice overlap >= `repeat` -> F1 0. Then pairs (human point, model point) with
    Dice >= `match` are matched greedily by decreasing overlap, each point at most once;
    precision = M / C, recall = M / H, F1 = 2PR / (P + R) (0 when M = 0).

    Returns dict(f1, precision, recall, why); f1 None (why 'empty human critique') when the human
    critique has no content words.
    """
    hp, mp = _points(human), _points(model)
    if not hp:
        return {"f1": None, "precision": None, "recall": None, "why": "proxy: empty human critique"}
    for i in range(len(mp)):
        for j in range(i + 1, len(mp)):
            if _dice(mp[i], mp[j]) >= repeat:
                return {"f1": 0.0, "precision": 0.0, "recall": 0.0, "why": "proxy: repetition"}
    cand = sorted(((_dice(h, m), i, j) for i, h in enumerate(hp) for j, m in enumerate(mp)), reverse=True)
    used_h, used_m = set(), set()
    for sim, i, j in cand:
        if sim >= match and i not in used_h and j not in used_m:
            used_h.add(i)
            used_m.add(j)
    m = len(used_h)
    p, r = (m / len(mp) if mp else 0.0), m / len(hp)
    f1 = 2 * p * r / (p + r) if m else 0.0
    return {"f1": f1, "precision": p, "recall": r, "why": "proxy"}


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
