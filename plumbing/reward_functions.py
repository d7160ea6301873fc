"""The RLME reward in other trainers (README, "The RLME reward in another trainer"): reward
functions that close over already-loaded evaluators (plumbing/evaluators.py) and return
reward.rlme_reward's values on the same (problem, completion) pairs.

    trl_reward_function(evaluators, meta_questions, ...)
                              TRL's GRPOTrainer reward_funcs: one call per generation batch
    verl_compute_score(evaluators, meta_questions, ...)
                              verl's compute_score: one call per sample
    verl_remote_score(...), verl_evaluators(...)
                              the same from verl's reward config (custom_reward_function), remote
                              evaluators built once per worker process
    problem_text, solution_text
                              the problem and answer the evaluator reads, from TRL's prompts and
                              completions (text or chat messages)
"""
from reward import logp_metric_name, meta_question_dicts, rlme_reward

from plumbing.evaluators import checked_template, remote_evaluator


# The RLME reward outside our trainer (RLME Eq. 2-3): trl_reward_function and verl_compute_score
# close over already-loaded evaluators and return the callable each trainer expects; every score
# is reward.rlme_reward on the same (problem, completion) pairs, so a reward logged by TRL or verl
# can be recomputed with reward.py alone. Only FROZEN evaluators: a reward function gets texts,
# not the trainer's current weights, so train.py's `kind: live` (the policy scoring its own
# answers) is not possible from outside a trainer (scripts/bench_vs_trl.py shows a TRL-internal
# workaround for benchmarking only).
#
#   from plumbing.evaluators import load_evaluator
#   from plumbing.reward_functions import trl_reward_function, verl_compute_score
#   ev = load_evaluator("HuggingFaceTB/SmolLM2-135M-Instruct")
#   fn = trl_reward_function([ev], ["Is the answer correct?"], problem_key="question")
#   GRPOTrainer(model=..., reward_funcs=fn, ...)        # TRL: one call per generation batch
#   compute_score = verl_compute_score([ev], ["Is the answer correct?"])   # verl: per sample


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
