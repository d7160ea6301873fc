"""The critique judge's start-up probe (plumbing/judge.py probe_judge, called by make_judge):
one short request before any model loads, each failure one line naming the judge.* key to change;
Retry-After on 429/503 (call_with_retries); `evaluate.py judge-check` saying why calls failed.

Servers: a real `transformers serve` (reachable, wrong model, wrong path), a closed port
(unreachable), and a small real HTTP server that answers as OpenAI's API does where the tiny
local servers cannot (a reasoning model refusing temperature / max_tokens, a bad API key, a 429
with Retry-After)."""
import email.utils
import json
import os
import time

import pytest

from conftest import REPO, chat_body, free_port, make_judge, openai_error
import reward
from plumbing import http_client
from plumbing.judge import PROBE_MAX_TOKENS
from plumbing.cli import evaluate_main


@pytest.fixture
def stub(stub_server):
    """conftest's stub_server; unplanned requests get a chat completion "OK"."""
    stub_server["answer"] = lambda body, headers: (200, {}, chat_body())
    return stub_server


def reasoning_model(body, headers):
    """As OpenAI's reasoning models answer (o-series, gpt-5): temperature other than 1 and the
    max_tokens field are refused with HTTP 400 naming the parameter."""
    if body.get("temperature", 1) != 1:
        return 400, {}, openai_error(f"Unsupported value: 'temperature' does not support {body['temperature']} with "
                                     f"this model. Only the default (1) value is supported.", "temperature",
                                     "unsupported_value")
    if "max_tokens" in body:
        return 400, {}, openai_error("Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                                     "'max_completion_tokens' instead.", "max_tokens", "unsupported_parameter")
    return 200, {}, chat_body("<precision>1</precision><recall>0.5</recall><f1>0.6667</f1>")


# ---- the probe against real servers ------------------------------------------------------------

def test_unreachable_judge_stops_at_startup():
    """Nothing listens on the port: one line naming judge.base_url after the configured tries
    (before: make_judge returned and every call later failed as a masked sample)."""
    port = free_port()  # closed again: nothing listens there
    sleeps = []
    with pytest.raises(SystemExit) as e:
        make_judge({"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "max_retries": 2}, probe=True,
                   sleep=sleeps.append, rand=lambda: 0.0)
    msg = str(e.value)
    assert msg.startswith(f"judge.base_url: nothing answers at http://127.0.0.1:{port}/v1") and "\n" not in msg
    assert "3 tries" in msg and "Connection refused" in msg
    assert sleeps == [0.5, 1.0]  # the configured retries and backoff, as any judge call


def test_unreachable_judge_stops_judge_check(tmp_path):
    """`evaluate.py judge-check` against the issue's closed port: one line, not `n_failed 2`."""
    with pytest.raises(SystemExit, match=r"^judge\.base_url: nothing answers at http://127\.0\.0\.1:9/v1"):
        judge_check(tmp_path, "http://127.0.0.1:9/v1", "m")


def judge_check(tmp, base_url, model, extra=()):
    """`evaluate.py judge-check` on two annotated rows against base_url (no retries); its summary."""
    data = f"{tmp}/d.jsonl"
    with open(data, "w") as f:
        for crit, label in (("Response B is wrong.", 1), ("Response A is wrong.", 0)):
            f.write(json.dumps({"context": "What is 2+3?", "response_a": "5", "response_b": "6",
                                "human_critique": "Response B adds 2 and 3 wrongly.", "critique": crit,
                                "label": label}) + "\n")
    return evaluate_main(["judge-check", "--data", data, "--base-url", base_url, "--model", model,
                          "--max-retries", "0", "--out", f"{tmp}/out", *extra])


@pytest.mark.slow
@pytest.mark.server
def test_probe_against_transformers_serve(tiny_judge_server, tmp_path, capsys):
    """A real OpenAI-compatible server: the served model passes the probe (its answer need not be
    in the judge's format); another model name stops with judge.model, a base_url without /v1
    with judge.base_url; judge-check then prints why its calls failed, by reason."""
    url, model = tiny_judge_server["base_url"], tiny_judge_server["model"]
    failures = {}
    judge = make_judge({"base_url": url, "model": model, "max_retries": 0}, probe=True, failures=failures)
    assert callable(judge) and failures == {}
    with pytest.raises(SystemExit) as e:  # transformers serve: HTTP 400 "Server is pinned to ...; requested 'x'"
        make_judge({"base_url": url, "model": "no-such-model", "max_retries": 0}, probe=True)
    assert str(e.value).startswith("judge.model: the server does not serve model 'no-such-model'")
    assert "HTTP 400" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit, match=r"^judge\.base_url: no chat completions at .*HTTP 404"):
        make_judge({"base_url": url[:-len("/v1")], "model": model, "max_retries": 0}, probe=True)
    # judge-check: 8 tokens cannot hold the three tags -> every call a counted parse failure, said
    s = judge_check(tmp_path, url, model, extra=("--max-tokens", "8"))
    out = capsys.readouterr().out
    assert s["n_failed"] == 2 == sum(f["n"] for f in s["failures"])
    assert "failed calls by reason (after their retries):" in out
    assert all(f["why"].startswith("parse failure") and f"{f['n']} x {f['why']}" in out for f in s["failures"])


# ---- answers only a hosted API gives: a small real HTTP server that answers as it does -------------

def test_refused_parameters_name_their_key(stub):
    """A reasoning model refusing temperature 0, then max_tokens: each names its judge.* key
    (JUDGE_REQUEST_FIELDS), with the server's message; one request each (a 400 is not retried)."""
    stub["answer"] = reasoning_model
    with pytest.raises(SystemExit) as e:
        make_judge({"base_url": stub["url"], "model": "o-mini", "temperature": 0.0}, probe=True)
    msg = str(e.value)
    assert msg.startswith("judge.temperature: the server refuses the request field temperature = 0.0")
    assert "Only the default (1) value is supported" in msg and "1 try" in msg and len(stub["requests"]) == 1
    with pytest.raises(SystemExit) as e:
        make_judge({"base_url": stub["url"], "model": "o-mini", "temperature": 1.0}, probe=True)
    assert str(e.value).startswith("judge.max_tokens: the server refuses the request field max_tokens = 512")
    assert "Use 'max_completion_tokens' instead" in str(e.value)
    # the probe sends the judge's own fields, its answer length cut to PROBE_MAX_TOKENS
    assert stub["requests"][-1]["body"]["max_tokens"] == PROBE_MAX_TOKENS
    assert stub["requests"][-1]["body"]["temperature"] == 1.0


def test_refused_parameters_say_the_fix(stub):
    """The refusal lines say which value the key takes instead (null = not sent; the other field name)."""
    stub["answer"] = reasoning_model
    with pytest.raises(SystemExit) as e:
        make_judge({"base_url": stub["url"], "model": "gpt-5-mini"}, probe=True)  # config.yaml's: temperature 0
    assert str(e.value).startswith("judge.temperature: the server refuses the request field temperature = 0.0: set "
                                   "judge.temperature: null (the server's default;")
    assert "'temperature' does not support 0.0 with this model" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        make_judge({"base_url": stub["url"], "model": "gpt-5-mini", "temperature": None}, probe=True)
    assert str(e.value).startswith("judge.max_tokens: the server refuses the request field max_tokens = 512: set "
                                   "judge.max_tokens_field: max_completion_tokens (OpenAI's reasoning models), or "
                                   "judge.max_tokens: null (no limit sent)")
    assert len(stub["requests"]) == 2 and "\n" not in str(e.value)


def test_request_carries_exactly_the_configured_fields(stub):
    """Against a server refusing what OpenAI's reasoning models refuse: the paper preset's judge
    (as the authors' release: neither temperature nor a token limit) passes the probe and scores,
    its requests holding model and messages only; max_tokens_field max_completion_tokens sends the
    limit under that name (the probe's cut to PROBE_MAX_TOKENS = 8, a call's the configured 300).
    Before: every request sent temperature 0 and max_tokens, so the paper's judge could not be called."""
    from plumbing import config
    stub["answer"] = reasoning_model
    paper = config.load_config([os.path.join(REPO, "configs", "paper", "rm_nlhf_qwen7b.yaml")])["judge"]
    assert (paper["temperature"], paper["max_tokens"]) == (None, None)
    judge = make_judge(dict(paper, base_url=stub["url"], model="gpt-5-mini", max_retries=0), probe=True)
    assert judge([("Response B is wrong.", "Response B errs.")])[0]["f1"] == 0.6667
    assert [sorted(r["body"]) for r in stub["requests"]] == [["messages", "model"]] * 2
    assert stub["requests"][0]["body"]["messages"] == [{"role": "user", "content": "Reply with the word OK."}]
    stub["requests"].clear()
    judge = make_judge({"base_url": stub["url"], "model": "gpt-5-mini", "temperature": 1.0, "max_tokens": 300,
                        "max_tokens_field": "max_completion_tokens", "max_retries": 0}, probe=True)
    assert judge([("h", "c")])[0]["f1"] == 0.6667
    assert [{k: v for k, v in r["body"].items() if k != "messages"} for r in stub["requests"]] == [
        {"model": "gpt-5-mini", "temperature": 1.0, "max_completion_tokens": 8},
        {"model": "gpt-5-mini", "temperature": 1.0, "max_completion_tokens": 300}]
    # a temperature alone (no token limit): only that field besides model and messages
    stub["answer"] = lambda body, headers: (200, {}, chat_body())
    stub["requests"].clear()
    make_judge({"base_url": stub["url"], "model": "m", "temperature": 0.0, "max_tokens": None}, probe=True)
    assert stub["requests"][0]["body"] == {"model": "m", "temperature": 0.0,
                                           "messages": [{"role": "user", "content": "Reply with the word OK."}]}
    with pytest.raises(SystemExit, match=r"^judge.max_tokens_field: 'max_length' unknown; allowed: max_tokens, "
                                         r"max_completion_tokens$"):
        make_judge({"base_url": stub["url"], "model": "m", "max_tokens_field": "max_length"}, probe=True)


def test_refused_parameter_without_param_field(stub):
    """A server naming the field only in its message (transformers serve's 422 for unknown fields)."""
    stub["answer"] = lambda body, headers: (422, {}, json.dumps(
        {"detail": "Unexpected fields in the request: {'max_tokens'}"}))
    with pytest.raises(SystemExit, match=r"^judge\.max_tokens: the server refuses the request field max_tokens"):
        make_judge({"base_url": stub["url"], "model": "m"}, probe=True)


def test_bad_key_wrong_model_and_html(stub, monkeypatch):
    monkeypatch.setenv("NLHF_PROBE_KEY", "sk-wrong")

    def hosted(body, headers):
        if headers.get("Authorization") != "Bearer sk-right":
            return 401, {}, openai_error("Incorrect API key provided: sk-wrong.", code="invalid_api_key")
        if body["model"] != "gpt-judge":
            return 404, {}, openai_error(f"The model `{body['model']}` does not exist or you do not have access to it.",
                                         code="model_not_found")
        return 200, {}, chat_body()
    stub["answer"] = hosted
    settings = {"base_url": stub["url"], "model": "gpt-judge", "api_key_env": "NLHF_PROBE_KEY"}
    with pytest.raises(SystemExit) as e:
        make_judge(settings, probe=True)
    assert str(e.value).startswith("judge.api_key_env: the server refused the API key")
    assert "(now NLHF_PROBE_KEY)" in str(e.value) and "HTTP 401" in str(e.value)
    monkeypatch.setenv("NLHF_PROBE_KEY", "sk-right")
    with pytest.raises(SystemExit, match=r"^judge\.model: the server does not serve model 'gpt-jugde'"):
        make_judge(dict(settings, model="gpt-jugde"), probe=True)
    assert callable(make_judge(settings, probe=True))  # the served name passes the probe
    # a 200 that is no chat completion (a login page): judge.base_url, after the retries
    stub["answer"] = lambda body, headers: (200, {"Content-Type": "text/html"}, "<html>Sign in</html>")
    with pytest.raises(SystemExit, match=r"^judge\.base_url: is judge\.base_url .* 2 tries: not a chat completion"):
        make_judge(dict(settings, max_retries=1), probe=True, sleep=lambda s: None)


def test_probe_false_sends_nothing(stub):
    make_judge({"base_url": stub["url"], "model": "m"}, probe=False)
    assert stub["requests"] == []
    make_judge({"base_url": stub["url"], "model": "m"}, probe=True)
    assert len(stub["requests"]) == 1 and stub["requests"][0]["path"] == "/v1/chat/completions"


# ---- Retry-After ------------------------------------------------------------------------------

def planned(stub, answers):
    """Answer the requests from a list of (status, headers, text), in order."""
    plan = list(answers)
    stub["answer"] = lambda body, headers: plan.pop(0)


OK = (200, {}, chat_body("<precision>1</precision><recall>1</recall><f1>1</f1>"))
RATE = '{"error": {"message": "Rate limit reached", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}'


def test_retry_after_seconds_is_honoured(stub):
    """429 with Retry-After: 7 -> wait 7 s, not the 0.75 s backoff; one below the backoff (0.1)
    -> the backoff (1.5); one over backoff_max_s (3600) -> backoff_max_s."""
    planned(stub, [(429, {"Retry-After": "7"}, RATE), (429, {"Retry-After": "0.1"}, RATE),
                   (503, {"Retry-After": "3600"}, RATE), OK])
    sleeps = []
    judge = make_judge({"base_url": stub["url"], "model": "m", "backoff_base_s": 1.0, "backoff_max_s": 30.0},
                       sleep=sleeps.append, rand=lambda: 0.5)
    out = judge([("h", "c")])
    assert out[0]["f1"] == 1.0 and out[0]["attempts"] == 4
    assert sleeps == [7.0, 1.5, 30.0]


def test_retry_after_http_date_and_ms(stub):
    when = email.utils.formatdate(time.time() + 12, usegmt=True)
    planned(stub, [(429, {"Retry-After": when}, RATE), (429, {"retry-after-ms": "2500", "Retry-After": "9"}, RATE),
                   (429, {"Retry-After": "soon"}, RATE), OK])
    sleeps = []
    judge = make_judge({"base_url": stub["url"], "model": "m"}, sleep=sleeps.append, rand=lambda: 0.0)
    assert judge([("h", "c")])[0]["f1"] == 1.0
    assert 10.0 <= sleeps[0] <= 12.0  # the date is to the second
    assert sleeps[1:] == [2.5, 2.0]  # retry-after-ms wins (OpenAI's); unreadable -> the backoff, d/2 at u = 0


def test_retry_after_parser():
    now = 1_000_000_000.0
    assert http_client.retry_after_s({"retry-after": "3"}) == 3.0
    assert http_client.retry_after_s({"retry-after": email.utils.formatdate(now + 5, usegmt=True)}, now=now) == 5.0
    assert http_client.retry_after_s({"retry-after": email.utils.formatdate(now - 5, usegmt=True)}, now=now) == 0.0
    assert http_client.retry_after_s({"retry-after": "-4"}) == 0.0
    assert http_client.retry_after_s({"retry-after": "nan"}) is None
    assert http_client.retry_after_s({"retry-after": "Thu, 99 Foo"}) is None
    assert http_client.retry_after_s({}) is None


def test_probe_waits_out_a_rate_limit(stub):
    """The probe retries a 429 as any call does, waiting what the server asked."""
    planned(stub, [(429, {"Retry-After": "4"}, RATE), (200, {}, chat_body())])
    sleeps = []
    make_judge({"base_url": stub["url"], "model": "m"}, probe=True, sleep=sleeps.append, rand=lambda: 0.0)
    assert sleeps == [4.0]
    planned(stub, [(429, {}, RATE)] * 2)
    with pytest.raises(SystemExit, match=r"^judge\.api_key_env: rate-limited or out of quota .* HTTP 429: Rate limit"):
        make_judge({"base_url": stub["url"], "model": "m", "max_retries": 1}, probe=True, sleep=lambda s: None)


# ---- judge-check says why ----------------------------------------------------------------------

def test_judge_check_prints_failure_reasons(stub, tmp_path, capsys):
    """The probe passes (a short answer fits), the judge's real requests (max_tokens 512) are
    refused: judge-check counts them by reason and prints the server's message."""
    def small_context(body, headers):
        if body["max_tokens"] > PROBE_MAX_TOKENS:
            return 400, {}, openai_error("This model's maximum context length is 64 tokens. However, you requested "
                                         f"{body['max_tokens']} tokens in the completion.")
        return 200, {}, chat_body()
    stub["answer"] = small_context
    s = judge_check(tmp_path, stub["url"], "m")
    out = capsys.readouterr().out
    assert s["n_failed"] == 2
    assert s["failures"] == [{"why": "HTTP 400", "n": 2, "first_message":
                              "HTTP 400: This model's maximum context length is 64 tokens. However, you "
                              "requested 512 tokens in the completion."}]
    assert "failed calls by reason" in out and "2 x HTTP 400 (first: HTTP 400: This model's maximum context" in out
    saved = json.load(open(tmp_path / "out" / "judge_check.json"))
    assert saved["failures"] == s["failures"]
