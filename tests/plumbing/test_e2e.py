"""End to end: train.py under torchrun as a user runs it, on a tiny model and on the real SmolLM2."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, SMOLLM2, data_path

METRIC_KEYS = {"step", "reward/mean", "reward/std", "accuracy", "rlvr_reward/mean", "advantage/abs_mean",
               "groups/zero_variance_frac", "completion/length_mean", "completion/length_max",
               "completion/truncated_frac", "is_weight/mean", "is_weight/max", "is_weight/clip_frac", "loss",
               "grad_norm", "lr", "time/rollout", "time/reward", "time/update", "rollout/tokens_per_s",
               "memory/peak_mb"}
SAMPLE_KEYS = {"step", "problem", "completion", "extracted", "label", "correct", "reward", "advantage",
               "importance_weight", "truncated", "length"}


def small_args(model, out, steps=2, extra=()):
    return ["--config", os.path.join(REPO, "configs", "cpu.yaml"), f"model.policy={model}", f"run.out_dir={out}",
            f"run.total_steps={steps}", "run.save_every=1", f"data.train={data_path('gsm8k', 'train.jsonl')}",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12", *extra]


def torchrun(nproc, args, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, "train.py"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_run_dir(out, steps, n_samples):
    metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert METRIC_KEYS <= set(m), METRIC_KEYS - set(m)
        assert all(v == v for v in m.values() if isinstance(v, float))  # no NaN
    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert len(samples) == steps * n_samples and SAMPLE_KEYS <= set(samples[0])
    assert os.path.isfile(os.path.join(out, "config.yaml"))
    ckpt = os.path.join(out, "checkpoints", f"step_{steps:06d}")
    assert os.path.isfile(os.path.join(ckpt, "config.json")) and os.path.isfile(os.path.join(ckpt, "trainer_state.pt"))
    return metrics, samples


@pytest.mark.slow
def test_torchrun_two_ranks_tiny_model(tiny_model_path, tmp_path):
    out = str(tmp_path / "run")
    torchrun(2, small_args(tiny_model_path, out, steps=2))
    metrics, samples = check_run_dir(out, 2, n_samples=4)
    assert sorted({s["rank"] for s in samples}) == [0, 1]  # both ranks' samples reach rank 0
    # RLME reward is the log-prob of "Yes": <= 0, and stored per question for recomputation
    for s in samples:
        assert s["reward"] <= 0 and s["reward"] == pytest.approx(s["logp"]["self"]["Is the answer correct?"], abs=1e-6)
    # each group's advantages are r - mean(group) (RLME Eq. 5)
    for st in (1, 2):
        for rank in (0, 1):
            grp = [s for s in samples if s["step"] == st and s["rank"] == rank]
            mean = sum(s["reward"] for s in grp) / 2
            for s in grp:
                assert s["advantage"] == pytest.approx(s["reward"] - mean, abs=1e-5)
    # ranks sample with different seeds: the same prompt would not give identical completions
    assert len({s["completion"] for s in samples}) > 1


@pytest.mark.slow
def test_rlvr_baseline_runs_drops_long_prompts_and_says_when_complete(tiny_model_path, tmp_path):
    # a GSM8K-style file with one 200,000-character question (~64k tokens, the model's context is
    # 2048): dropped at load with a count instead of a rollout that crawls
    rows = [json.loads(line) for line in open(data_path("gsm8k", "train.jsonl")).readlines()[:6]]
    rows.insert(2, {"question": "How many apples? " * 12_000, "answer": "#### 3"})
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "rlvr")
    args = small_args(tiny_model_path, out, steps=1, extra=["reward.kind=rlvr", f"data.train={data}"])
    p = torchrun(1, args)
    assert "dropped 1 items whose prompt is over 2036 tokens (data.max_prompt_tokens)" in p.stdout
    _, samples = check_run_dir(out, 1, n_samples=4)
    assert all(s["reward"] == s["rlvr_reward"] and s["reward"] in (0.0, 1.0) for s in samples)
    assert all(len(s["problem"]) < 1000 for s in samples)
    # the same command again: one line saying the run is complete, nothing redone or rewritten
    before = open(os.path.join(out, "metrics.jsonl")).read()
    p = torchrun(1, args)
    assert "is complete: its checkpoint is at step 1 and run.total_steps=1; to train further raise run.total_steps" in p.stdout
    assert "train:" not in p.stderr  # no progress bar
    assert open(os.path.join(out, "metrics.jsonl")).read() == before


def test_bad_inputs_are_one_line_before_any_model_loads(tmp_path):
    """What a user can set wrongly ends in one line naming the key, before the (slow) model load:
    the model path is deliberately one that does not exist, so reaching the model load would
    print a different message."""
    base = [sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "cpu.yaml"),
            f"data.train={data_path('gsm8k', 'train.jsonl')}", "model.policy=/no/such/model"]
    cases = {
        "config key optim.lr: must be > 0, got -1.0": ["optim.lr=-1", f"run.out_dir={tmp_path}/a"],
        "config key train.device=cuda: no CUDA device on this machine": ["train.device=cuda", f"run.out_dir={tmp_path}/b"],
        "config key run.out_dir=/proc/forbidden: cannot write there": ["run.out_dir=/proc/forbidden"],
        "config key reward.meta_questions[0].target: empty": [
            "reward.meta_questions=[{question: 'Is the answer correct?', target: ''}]", f"run.out_dir={tmp_path}/c"],
        "config key rollout.group_size: must be >= 2": ["rollout.group_size=1", f"run.out_dir={tmp_path}/d"],
        "config key algo.kl_coef=0.1: the KL term is GRPO's": ["algo.kl_coef=0.1", f"run.out_dir={tmp_path}/e"],
        "data file nothere.jsonl does not exist": ["data.train=nothere.jsonl", f"run.out_dir={tmp_path}/f/run"],
        "config key run.out_dir=": [f"run.out_dir={tmp_path}/g/run"],  # a file where the folder would go
        "train.py: unrecognized arguments: --steps 3 (--help lists the options)": ["--steps", "3"],
        f"config file {tmp_path}/list.yaml: expected a mapping (key: value lines), got a list": [
            "--config", f"{tmp_path}/list.yaml"],
        "config key model.chat_template_kwargs: expected a mapping": ["model.chat_template_kwargs=thinking"],
    }
    (tmp_path / "g").write_text("a file")
    (tmp_path / "list.yaml").write_text("- run\n- model\n")
    if torch.cuda.is_available():
        del cases["config key train.device=cuda: no CUDA device on this machine"]
    procs = {msg: subprocess.Popen(base + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for msg, extra in cases.items()}
    for msg, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode != 0 and msg in err and "Traceback" not in err, (msg, err[-1500:])
        assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["g", "list.yaml"]  # a failed start leaves no (empty) run folder behind


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(tiny_model_path, tmp_path):
    steps = 3
    ref_out, out = str(tmp_path / "ref"), str(tmp_path / "killed")
    torchrun(1, small_args(tiny_model_path, ref_out, steps))
    # same run, SIGKILLed as soon as its first checkpoint is on disk, then started again
    cmd = [sys.executable, os.path.join(REPO, "train.py"), *small_args(tiny_model_path, out, steps)]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    first = os.path.join(out, "checkpoints", "step_000001", "trainer_state.pt")
    deadline = time.time() + 300
    while not os.path.exists(first) and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = max(m["step"] for m in read_jsonl(os.path.join(out, "metrics.jsonl")))
    assert killed_at < steps, "the run finished before it could be killed"
    torchrun(1, small_args(tiny_model_path, out, steps))
    ref_m, ref_s = check_run_dir(ref_out, steps, 4)
    res_m, res_s = check_run_dir(out, steps, 4)
    for a, b in zip(ref_m, res_m):
        for k in ("reward/mean", "loss", "grad_norm", "lr", "completion/length_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    assert [s["completion"] for s in ref_s] == [s["completion"] for s in res_s]
    from safetensors.torch import load_file
    wa = load_file(os.path.join(ref_out, "checkpoints", f"step_{steps:06d}", "model.safetensors"))
    wb = load_file(os.path.join(out, "checkpoints", f"step_{steps:06d}", "model.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


def test_stop_after_says_what_the_same_command_will_do(tiny_model_path, tmp_path, capsys):
    """run.stop_after stops as if killed; the line says whether a checkpoint is there to resume from."""
    import train
    train.main(small_args(tiny_model_path, str(tmp_path / "a"), steps=2, extra=["run.save_every=5", "run.stop_after=1"]))
    assert ("[train] run.stop_after=1: stopped after step 1 (as if killed); the same command starts afresh: "
            "no checkpoint yet (run.save_every=5)") in capsys.readouterr().out
    train.main(small_args(tiny_model_path, str(tmp_path / "b"), steps=2, extra=["run.stop_after=1"]))
    ckpt = os.path.join(str(tmp_path / "b"), "checkpoints", "step_000001")
    assert f"stopped after step 1 (as if killed); the same command resumes from {ckpt}" in capsys.readouterr().out


@pytest.mark.slow
def test_real_smollm2_one_step(tmp_path):
    out = str(tmp_path / "smol")
    torchrun(1, small_args(SMOLLM2, out, steps=1, extra=["rollout.max_new_tokens=24"]), timeout=900)
    metrics, samples = check_run_dir(out, 1, n_samples=4)
    m = metrics[0]
    assert -30 < m["reward/mean"] < 0 and 0 < m["rlme/self/Is the answer correct?/p"] < 1
    assert m["grad_norm"] > 0 and m["completion/length_max"] <= 24


def test_bad_evaluator_path_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "cpu.yaml"),
                        f"run.out_dir={tmp_path}", f"data.train={data_path('gsm8k', 'train.jsonl')}",
                        "model.policy=/no/such/model"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode != 0
    assert "model path '/no/such/model' does not exist" in p.stderr and "Traceback" not in p.stderr
