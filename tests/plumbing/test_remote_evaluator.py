"""The remote evaluator (reward.evaluators[].kind: remote; docs/scale-out.md "Remote evaluators"):
log p(target | evaluator prompt) from an OpenAI-compatible /v1/completions server's echoed
prompt log-probs.

* The echo parser on hand-made answers, and the retry / batching logic against a small fake
  server written here (it only echoes canned numbers: it stands in for the transport, never for a
  model).
* Integration against a real server: llama-cpp-python's (`python -m llama_cpp.server`) serving the
  SmolLM2 GGUF that the in-process tests load, whose log p must match our in-process score of
  the same prompt within REMOTE_TOLERANCE; a short training run with a remote evaluator whose
  server is killed after step 1; a server that is not there at start-up; transformers serve,
  which ignores echo/logprobs.
llama-cpp-python is an optional install (requirements-remote.txt, built from source: 5–11 min);
the integration tests skip without it.
"""
import http.server
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from plumbing import config
import reward as R
from conftest import REPO, SMOLLM2, free_port, start_server, stop_server
import fast
from plumbing.cli import reward_main
from plumbing.models import _gguf_location
from plumbing.evaluators import echo_target_logprob, remote_evaluator, remote_request, score_remote
from plumbing.reward_functions import trl_reward_function

# |log p remote - log p in-process| allowed for the same prompt and target. The GGUF holds Q4_1
# weights: llama.cpp multiplies them in quantized form (its activations rounded to 8 bits for the
# dot products), transformers de-quantizes them to float32 first, so the two differ in rounding
# only. Measured on 2026-12-01 (SmolLM2-135M-Instruct Q4_1, chat template, one-token target
# "Yes"): at most 0.12 nats over 8 (problem, answer, question) prompts, typically 0.05-0.10.
# 0.3 leaves margin for other prompts while a wrong alignment (llama-cpp-python's echo without a
# leading BOS scores each token as its own successor: ~7 nats off) or a wrong target fails.
REMOTE_TOLERANCE = 0.3


# ---- the echo parser, on hand-made answers ---------------------------------------------------


def choice(tokens, logprobs, text=None):
    return {"text": "".join(tokens) if text is None else text, "index": 0,
            "logprobs": {"tokens": tokens, "token_logprobs": logprobs,
                         "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]}}


def test_echo_parser_sums_the_target_tokens_at_the_end():
    full = "Q?\nAnswer: Yes"
    c = choice(["Q", "?", "\n", "Answer", ":", " Yes"], [None, -1.0, -2.0, -3.0, -0.5, -0.25])
    assert echo_target_logprob(c, full, " Yes") == (-0.25, "")
    # a target of two tokens: both log-probs, -0.25 + -0.125
    c = choice(["Answer", ":", " Y", "es"], [None, -0.5, -0.25, -0.125])
    assert echo_target_logprob(c, "Answer: Yes", " Yes") == (-0.375, "")
    # a BOS the server shows ("<s>") shifts every character offset but not the tokens at the end
    c = choice(["<s>", "Answer", ":", " Yes"], [None, -1.0, -0.5, -0.25], text="Answer: Yes")
    assert echo_target_logprob(c, "Answer: Yes", " Yes") == (-0.25, "")


def test_echo_parser_drops_generated_tokens_listed_or_not():
    # vLLM with max_tokens >= 1 lists the generated token after the echo
    c = choice(["Answer", ":", " Yes", "."], [None, -0.5, -0.25, -3.0])
    assert echo_target_logprob(c, "Answer: Yes", " Yes") == (-0.25, "")
    # llama-cpp-python returns the generated text but lists only the echoed tokens
    c = choice(["Answer", ":", " Yes"], [None, -0.5, -0.25], text="Answer: Yes,")
    assert echo_target_logprob(c, "Answer: Yes", " Yes") == (-0.25, "")


@pytest.mark.parametrize("c, reason", [
    # one token ": Yes" holds the end of the prompt and the target: no number is split, it fails
    (choice(["Answer", ": Yes"], [None, -0.5]), "a token straddles the prompt and the target"),
    (choice(["Answer", ":", " Ye"], [None, -0.5, -0.2], text="Answer: Yes"), "do not spell the target"),
    ({"text": "Answer: Yes", "index": 0, "logprobs": None}, "no prompt log-probs"),
    (choice(["Answer", ":", " Yes"], [None, -0.5]), "no prompt log-probs"),  # lengths differ
    (choice(["Answer", ":", " Yes"], [None, -0.5, None]), "missing or non-finite log-prob"),
    (choice(["Answer", ":", " Yes"], [None, -0.5, float("nan")]), "missing or non-finite log-prob"),
    (choice(["Hello"], [None], text="Hello"), "does not echo the prompt"),  # echo ignored
    (choice(["Answer", ":", " Yes", ""], [None, -0.5, -0.25, -1.0]), "ends in an empty token"),
])
def test_echo_parser_fails_rather_than_guess(c, reason):
    value, why = echo_target_logprob(c, "Answer: Yes", " Yes")
    assert value is None and reason in why, why


# ---- a fake /v1/completions server: the transport only (retries, timeouts, batching) -----------


def fake_tokens(text):
    """Word-level 'tokens' that spell the text, log p of each -(its length / 10 + the text's
    length / 1000) (the first: None): " Yes" at the end of `text` scores fake_yes(text)."""
    tokens = re.findall(r"\s*\S+|\s+", text)
    return tokens, [None] + [-(len(t) / 10 + len(text) / 1000) for t in tokens[1:]]


def fake_yes(text):
    return -(0.4 + len(text) / 1000)


class FakeHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        with s.lock:
            s.requests.append(prompts)
            n = len(s.requests)
        if s.mode == "fail_first" and n <= s.fails:
            return self._send(503, {"error": "busy"})
        if s.mode == "bad_request":
            return self._send(400, {"error": "bad"})
        if s.mode == "html":
            return self._send(200, "<html>not an API</html>", ctype="text/html")
        if s.mode == "slow":
            time.sleep(2)
        if s.mode == "no_lists" and isinstance(body["prompt"], list) and len(body["prompt"]) > 1:
            return self._send(500, {"error": "one prompt per request"})
        if any("FAIL" in p for p in prompts):
            return self._send(500, {"error": "boom"})
        choices = []
        for i, p in enumerate(prompts):
            tokens, lps = fake_tokens(p)
            choices.append({"index": i, "text": p, "finish_reason": "length",
                            "logprobs": None if s.mode == "ignore_echo" else
                            {"tokens": tokens, "token_logprobs": lps, "text_offset": [0] * len(tokens),
                             "top_logprobs": None}})
        self._send(200, {"id": "x", "object": "text_completion", "created": 0, "model": body["model"],
                         "choices": choices})


@pytest.fixture
def fake_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
    server.mode, server.fails, server.requests, server.lock = "ok", 0, [], threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield server
    server.shutdown()
    server.server_close()


def fake_evaluator(server, **settings):
    settings = dict({"backoff_base_s": 0.0, "backoff_max_s": 0.0}, **settings)
    return remote_evaluator(server.base_url, "fake", name="far", probe=False, **settings)


def test_retries_then_scores_and_gives_up_with_the_reason(fake_server):
    fake_server.mode, fake_server.fails = "fail_first", 2
    ev = fake_evaluator(fake_server, max_retries=2)
    assert remote_request(ev["remote"], [("Answer: Yes", " Yes")]) == ([fake_yes("Answer: Yes")], [""])
    assert len(fake_server.requests) == 3  # two 503s, then the answer
    fake_server.requests.clear()
    ev = fake_evaluator(fake_server, max_retries=1)
    assert remote_request(ev["remote"], [("Answer: Yes", " Yes")]) == ([None], ["HTTP 503"])
    assert len(fake_server.requests) == 2


@pytest.mark.parametrize("mode, why, requests", [
    ("bad_request", "HTTP 400", 1),           # a 4xx other than 408/409/429 is not retried
    ("html", "not a completion", 3),          # an HTML page is retried
    ("slow", "timeout", 3),
    ("ignore_echo", "no prompt log-probs", 1),  # an answer without log-probs is not (same answer again)
])
def test_failures_are_none_with_a_reason(fake_server, mode, why, requests):
    fake_server.mode = mode
    ev = fake_evaluator(fake_server, max_retries=2, timeout_s=0.5)
    vals, whys = remote_request(ev["remote"], [("Answer: Yes", " Yes")])
    assert vals == [None] and why in whys[0], whys
    assert len(fake_server.requests) == requests


def test_a_failed_sample_is_masked_never_scored(fake_server):
    """rlme_reward: a request that fails gives that sample reward NaN and valid False (the
    trainer masks it); the others are scored; nothing is counted as a non-finite log p."""
    ev = fake_evaluator(fake_server, max_retries=0)
    mqs = R.meta_question_dicts(["Is it right?", "Is it short?"])
    out = R.rlme_reward([ev], mqs, ["p1", "p2 FAIL", "p3"], ["a", "b", "c"], template="{problem} {solution} {question}")
    assert out["valid"].tolist() == [True, False, True] and out["nonfinite"] == 0
    assert out["failed"][:, 0].tolist() == [[False, False], [True, True], [False, False]]
    assert math.isnan(out["reward"][1]) and out["why"]["far"] == "HTTP 500"
    # each scored sample: two questions, each target " Yes" scored fake_yes(its prompt)
    texts = [[f"p{i} {s} {q}\nAnswer: Yes" for q in ("Is it right?", "Is it short?")] for i, s in ((1, "a"), (3, "c"))]
    assert out["reward"][[0, 2]].tolist() == pytest.approx([sum(fake_yes(t) for t in ts) for ts in texts])
    # the TRL reward function returns None for it (TRL leaves the sample out), never a number
    logged = {}
    fn = trl_reward_function([ev], ["Is it right?"], template="{problem} {solution} {question}")
    assert fn(["p1", "p2 FAIL"], ["a", "b"], log_metric=logged.__setitem__) == [
        pytest.approx(fake_yes("p1 a Is it right?\nAnswer: Yes")), None]
    assert logged["evaluator/far/failed"] == 1.0


def test_the_probe_is_one_line(fake_server):
    fake_server.mode = "no_lists"  # llama-cpp-python's server takes one prompt per request
    with pytest.raises(SystemExit, match=r"^remote evaluator far: cannot score at http://127\.0\.0\.1:\d+/v1 "
                                         r"\(model fake\): HTTP 500 \(set batch_size: 1"):
        remote_evaluator(fake_server.base_url, "fake", name="far", batch_size=2, max_retries=0)
    remote_evaluator(fake_server.base_url, "fake", name="far", batch_size=1, max_retries=0)  # passes


@pytest.mark.parametrize("override, message", [
    ("reward.evaluators=[{name: r, kind: remote, model: m}]", "reward.evaluators[0].base_url: required for kind remote"),
    ("reward.evaluators=[{name: r, kind: live, base_url: 'http://x/v1'}]", "reward.evaluators[0].base_url: only for kind remote"),
    ("reward.evaluators=[{name: r, kind: remote, base_url: 'http://x/v1', model: m, concurrency: 0}]",
     "reward.evaluators[0].concurrency: must be >= 1"),
    ("reward.evaluators=[{name: r, kind: remote, base_url: 'http://x/v1', model: m, chat_template: true}]",
     "reward.evaluators[0].chat_template: true needs path"),
    ("reward.evaluators=[{name: r, kind: remote, base_url: 'http://x/v1', model: m, timeout_s: 0}]",
     "reward.evaluators[0].timeout_s: must be > 0"),
])
def test_remote_config_errors_are_one_line(override, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        config.load_config([], [override])


# ---- a real server: llama-cpp-python serving the SmolLM2 GGUF --------------------------------


def start_llama_server(log_path, timeout=120):
    """`python -m llama_cpp.server` on the SmolLM2 GGUF, a free 127.0.0.1 port, 2 threads.
    Returns (Popen, base_url)."""
    folder, filename = _gguf_location(SMOLLM2)
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", os.path.join(folder, filename),
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "2",
           "--model_alias", "smollm2", "--logits_all", "true", "--verbose", "false"]
    return start_server("llama_cpp.server", cmd, port, "/v1/models", log_path, timeout=timeout)


needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install -r requirements-remote.txt; builds from source, 5-11 min)")


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    proc, base_url = start_llama_server(str(tmp_path_factory.mktemp("llama") / "server.log"))
    yield base_url
    stop_server(proc)


# Settings for llama-cpp-python's server: one prompt per request; max_tokens 1 (0 = no limit there)
LLAMA = {"batch_size": 1, "max_tokens": 1, "backoff_base_s": 0.1, "backoff_max_s": 0.2}
# A short template for the runs (llama-cpp-python's echo costs ~50 ms a prompt token on 2 cores)
SHORT_TEMPLATE = "{problem}\nSolution: {solution}\n{extracted}{reference}\n{question} Yes or No."


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.server
def test_remote_logp_matches_in_process(llama_server, smollm2):
    """The same evaluator prompts scored by llama-cpp-python's server (Q4_1 arithmetic) and by
    SmolLM2 in-process (reward.score_targets): within REMOTE_TOLERANCE; then the concurrent
    requests equal the one-by-one plain twin on the real server."""
    model, tok = smollm2
    local = R.local_evaluator(model, tok, chat=True, name="local", weight=1.0)
    remote = remote_evaluator(llama_server, "smollm2", name="remote", tokenizer=SMOLLM2, concurrency=2, **LLAMA)
    assert remote["chat"]  # SmolLM2's chat prompt starts with <|im_start|>, its BOS: see docs/scale-out.md
    problems = ["Tom has 3 apples and buys 4 more. How many apples does he have?", "What is 12 times 5?",
                "A coffee costs $3. How much do 4 coffees cost?"]
    solutions = ["He has 3 + 4 = 7 apples. \\boxed{7}", "12 x 5 = 50\n\\boxed{50}", "4 × 3 = 12 dollars 🙂 \\boxed{12}"]
    mqs = R.meta_question_dicts(["Is the answer correct?"])
    a = R.rlme_reward([remote], mqs, problems, solutions)
    b = R.rlme_reward([local], mqs, problems, solutions)
    assert a["valid"].all(), a["why"]
    diff = (a["logp"] - b["logp"]).abs()
    print("remote", a["logp"].flatten().tolist(), "in-process", b["logp"].flatten().tolist())
    assert diff.max() <= REMOTE_TOLERANCE, diff
    short = [(R.evaluator_prompt_text(tok, f"{p}\n{s}\nIs it right?", "Yes", chat=True)[1], "Yes")
             for p, s in zip(problems, solutions)]
    fast_out, plain = fast.score_remote(remote["remote"], short), score_remote(remote["remote"], short)
    assert plain[1] == ["", "", ""] and fast_out[0] == pytest.approx(plain[0], abs=1e-4)


def tiny_gsm8k(path, n=4):
    rows = [{"question": f"Sam has {i} pens and gets {i + 2} more. How many pens?", "answer": f"#### {2 * i + 2}"}
            for i in range(1, n + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.server
def test_training_with_a_remote_evaluator_whose_server_dies(tiny_model_path, tmp_path, monkeypatch):
    """Two steps of train.py with a remote evaluator (the tiny random policy, llama-cpp-python
    serving SmolLM2): step 1 is scored by the server; then the server is killed, and step 2's
    samples are masked (reward None, advantage 0) and counted, with no crash and no made-up
    score; the run finishes and checkpoints."""
    import train
    proc, base_url = start_llama_server(str(tmp_path / "server.log"))
    try:
        out = str(tmp_path / "run")
        ev = (f"reward.evaluators=[{{name: far, kind: remote, base_url: '{base_url}', model: smollm2, path: '{SMOLLM2}', "
              f"batch_size: 1, max_tokens: 1, max_retries: 1, backoff_base_s: 0.1, backoff_max_s: 0.1, timeout_s: 30.0}}]")
        cfg = config.load_config([os.path.join(REPO, "configs", "cpu.yaml")], [
            f"model.policy={tiny_model_path}", f"run.out_dir={out}", "run.total_steps=2", "run.save_every=0",
            f"data.train={tiny_gsm8k(tmp_path / 'train.jsonl')}", "data.val=null", "run.eval_every=0",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6", ev])
        cfg["reward"]["evaluator_template"] = SHORT_TEMPLATE  # checked again by setup
        real_emit = train.emit

        def emit_then_kill(state, *args, **kwargs):
            metrics = real_emit(state, *args, **kwargs)
            stop_server(proc)  # after step 1: step 2's requests meet a dead server
            return metrics

        monkeypatch.setattr(train, "emit", emit_then_kill)
        train.train(cfg)
    finally:
        stop_server(proc)
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2]
    one, two = metrics
    assert one["evaluator/far/failed"] == 0 and one["reward/masked"] == 0
    assert -20 < one["rlme/far/Is the answer correct?/logp"] < 0
    step1 = [s for s in samples if s["step"] == 1]
    assert all(s["reward"] == s["logp"]["far"]["Is the answer correct?"] < 0 for s in step1)
    assert two["evaluator/far/failed"] == 4 and two["reward/masked"] == 4
    assert two["rlme/far/Is the answer correct?/logp"] is None and two["grad_norm"] == 0.0
    assert two["reward/mean"] is None and two["reward/std"] is None  # no known reward: no mean, never 0.0
    step2 = [s for s in samples if s["step"] == 2]
    assert all(s["reward"] is None and s["advantage"] == 0.0 and s["logp"]["far"]["Is the answer correct?"] is None
               for s in step2)
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_000002", "trainer_state.pt"))


def test_unreachable_remote_evaluator_is_one_line_before_any_model_loads(tmp_path):
    port = free_port()  # nothing listens there
    p = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "cpu.yaml"),
                        f"run.out_dir={tmp_path}/run", f"data.train={tiny_gsm8k(tmp_path / 'train.jsonl')}",
                        "data.val=null", "run.eval_every=0", "model.policy=/no/such/model", "run.total_steps=1",
                        "rollout.prompts_per_step=2",
                        f"reward.evaluators=[{{name: far, kind: remote, base_url: 'http://127.0.0.1:{port}/v1', "
                        f"model: m, max_retries: 0}}]"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert err[0] == (f"config key reward.evaluators[0] (far): cannot score at http://127.0.0.1:{port}/v1 "
                      f"(model m): connection error: ConnectError"), err


@pytest.mark.server
def test_transformers_serve_is_refused_at_start_up(tiny_judge_server):
    """transformers serve accepts /v1/completions but ignores echo and logprobs
    (transformers/cli/serving/completion.py, UNUSED_LEGACY_COMPLETION_FIELDS): the probe says so
    (with max_tokens 0 it answers HTTP 500, also one line)."""
    with pytest.raises(SystemExit, match=r"^remote evaluator tf: cannot score at .*: no prompt log-probs in the answer"):
        remote_evaluator(tiny_judge_server["base_url"], tiny_judge_server["model"], name="tf", max_retries=0,
                           max_tokens=1)


def test_bad_tokenizer_path_and_unset_key_are_one_line(monkeypatch):
    with pytest.raises(SystemExit, match=r"^remote evaluator remote: path: model path '/no/such' does not exist$"):
        remote_evaluator("http://127.0.0.1:1/v1", "m", tokenizer="/no/such", probe=False)
    monkeypatch.delenv("RLME_TEST_NO_KEY", raising=False)
    with pytest.raises(SystemExit, match=r"^remote evaluator remote: api_key_env: environment variable RLME_TEST_NO_KEY"):
        remote_evaluator("http://127.0.0.1:1/v1", "m", api_key_env="RLME_TEST_NO_KEY", probe=False)


def test_reward_cli_scores_with_a_remote_evaluator(fake_server, tmp_path, capsys):
    rows = [{"problem": "p1", "completion": "a"}, {"problem": "p2 FAIL", "completion": "b"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward_main(["--evaluator", f"remote:{fake_server.base_url}", "--remote-model", "fake", "--in", str(tmp_path / "in.jsonl"),
            "--out", str(tmp_path / "out.jsonl"), "--question", "Is it right?", "--evaluator-name", "far",
            "--remote-max-retries", "0"])
    out = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    text = R.build_evaluator_text(R.DEFAULT_EVALUATOR_TEMPLATE, "p1", "a", "Is it right?") + "\nAnswer: Yes"
    assert out[0]["reward"] == pytest.approx(fake_yes(text)) and out[0]["logp"] == {"far": {"Is it right?": out[0]["reward"]}}
    assert out[1]["reward"] is None and out[1]["logp"] == {"far": {"Is it right?": None}}
    assert "1 rows NOT scored (reward null)" in capsys.readouterr().out


# --- the verl adapter through a server (verl's reward workers have no GPU) -------------------------

def test_verl_scores_through_remote_specs(fake_server):
    """verl_compute_score and verl_remote_score (the function verl's custom_reward_function names,
    its reward_kwargs plain YAML) take evaluator SPECS {base_url, model, ...} and build the remote
    evaluator themselves. By hand with the fake server: the sample's reward is v_j * w_k * log p("Yes")
    = 0.5 * 1 * fake_yes(evaluator text); built once per worker (one probe request), then one
    request per sample; a spec without model is one line."""
    from plumbing.reward_functions import _VERL_SCORERS, verl_compute_score, verl_remote_score
    spec = {"name": "far", "kind": "remote", "base_url": fake_server.base_url, "model": "fake", "weight": 0.5,
            "backoff_base_s": 0.0, "backoff_max_s": 0.0}
    mqs = R.meta_question_dicts(["Is the answer correct?"])
    _, full = R.evaluator_prompt_text(None, R.build_evaluator_text(R.DEFAULT_EVALUATOR_TEMPLATE, "What is 2+3?", "5",
                                                                   "Is the answer correct?", ["Is the answer correct?"]),
                                      "Yes", chat=False)
    want = 0.5 * fake_yes(full)  # the text the server is sent: prompt + " Yes"
    score = verl_compute_score([spec], ["Is the answer correct?"])
    got = score("openai/gsm8k", "5", "5", {"question": "What is 2+3?"})
    assert got == pytest.approx(R.rlme_reward([fake_evaluator(fake_server, weight=0.5)], mqs, ["What is 2+3?"], ["5"])["reward"].item())
    assert got == pytest.approx(want, abs=1e-6), (got, want)
    _VERL_SCORERS.clear()
    n = len(fake_server.requests)
    kwargs = {"evaluators": [spec], "meta_questions": ["Is the answer correct?"]}  # verl's reward_kwargs
    for _ in range(3):
        assert verl_remote_score("openai/gsm8k", "5", "5", {"question": "What is 2+3?"}, **kwargs) == got
    assert len(fake_server.requests) - n == 1 + 3 and len(_VERL_SCORERS) == 1  # one probe, then one per call
    with pytest.raises(SystemExit, match=r"^verl evaluators\[0\]: a spec with base_url needs model"):
        verl_compute_score([{"base_url": fake_server.base_url}], ["Is it right?"])


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.server
def test_verl_remote_score_on_llama_cpp_server(llama_server, smollm2):
    """verl_remote_score through llama-cpp-python's server (the remote evaluator's real server)
    gives the in-process reward of the same sample within REMOTE_TOLERANCE."""
    from plumbing.reward_functions import verl_remote_score
    model, tok = smollm2
    spec = {"name": "remote", "base_url": llama_server, "model": "smollm2", "path": SMOLLM2, **LLAMA}
    problem, solution = "What is 12 times 5?", "12 x 5 = 60\n\\boxed{60}"
    got = verl_remote_score("openai/gsm8k", solution, "60", {"question": problem}, evaluators=[spec],
                            meta_questions=["Is the answer correct?"], template=SHORT_TEMPLATE)
    local = R.local_evaluator(model, tok, chat=True, name="local", weight=1.0)
    want = R.rlme_reward([local], R.meta_question_dicts(["Is the answer correct?"]), [problem], [solution],
                         template=SHORT_TEMPLATE)["reward"].item()
    assert abs(got - want) <= REMOTE_TOLERANCE, (got, want)
