"""The critique judge of RM-NLHF (S(h, c), RM-NLHF Eq. 4-5): the plain callable judge(pairs) ->
list[dict] that reward.score_dh and the MetaRM cold start take.

    make_judge(cfg, ...)      from config.yaml's `judge:` section (JUDGE_KEYS): the LLM judge
                              through an OpenAI-compatible server (reward.judge_prompt, retried,
                              strictly parsed) or the offline proxy; start-up checks and a probe
                              request (probe_judge, judge_fault: the judge.* key to change)
    judge_pool(similarity, concurrency)
                              judge.concurrency calls at a time, results in order, never raises
    judge_request_names, judge_request_fields
                              the request's sampling fields (JUDGE_REQUEST_FIELDS, MAX_TOKENS_FIELDS)
    proxy_f1(human, model)    the lexical stand-in for tests and laptops (not the paper's judge)
"""
import concurrent.futures
import random
import re
import time

import reward
from reward import JUDGE_VARIANTS, parse_judge_output, parse_meta_judge_output

from plumbing.http_client import call_with_retries, failure_text, openai_client


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
