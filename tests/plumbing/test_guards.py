"""plumbing/guards.py and where the run uses it: the run folder's lock (a real second process,
kill -9), resume against the run's config (a real out_dir), free space and a write that runs out
of it (a real file-size limit), Ctrl-C (a real SIGINT), non-finite gradients, steps that cannot
learn, and JSON logs that never hold NaN."""
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import REPO, data_path
from plumbing import guards
from plumbing.config import load_config


def strict_json(line):
    """json.loads that refuses NaN / Infinity (what a strict reader, e.g. jq or JavaScript, does)."""
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {line[:80]}"))


def small_args(model, out, steps=2, extra=()):
    return ["--config", os.path.join(REPO, "configs", "cpu.yaml"), f"model.policy={model}", f"run.out_dir={out}",
            f"run.total_steps={steps}", "run.save_every=1", f"data.train={data_path('gsm8k', 'train.jsonl')}",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", *extra]


# --- the lock -------------------------------------------------------------------------------------

HOLD = ("import sys, time; sys.path.insert(0, {repo!r}); from plumbing.guards import lock_out_dir; "
        "h = lock_out_dir({out!r}); print('held', flush=True); time.sleep(600)")


def test_a_second_run_stops_naming_the_holder_and_kill_9_leaves_no_stale_lock(tmp_path):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=REPO, out=out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as e:
            guards.lock_out_dir(out)
        msg = str(e.value)
        assert f"run.out_dir={out} is in use by another run (pid {p.pid} on " in msg and "\n" not in msg
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    h = guards.lock_out_dir(out)  # the kernel dropped the dead holder's lock: a resume proceeds
    assert json.loads(open(os.path.join(out, "run.lock")).read())["pid"] == os.getpid()
    h.close()


def test_two_real_runs_into_one_folder_the_second_stops(tiny_model_path, tmp_path):
    """Before: both finished and metrics.jsonl had every step twice."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(REPO, "train.py"), *small_args(tiny_model_path, out, steps=3)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "run.lock")) and time.time() < deadline:
        time.sleep(0.1)
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    first.communicate(timeout=600)
    assert first.returncode == 0
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 1 and len(lines) == 1 and "is in use by another run (pid" in lines[0], second.stderr
    steps = [json.loads(ln)["step"] for ln in open(os.path.join(out, "metrics.jsonl"))]
    assert steps == [1, 2, 3]


# --- resume ---------------------------------------------------------------------------------------

def test_resume_changes_and_which_may_change():
    base = load_config([os.path.join(REPO, "configs", "cpu.yaml")])
    new = load_config([os.path.join(REPO, "configs", "cpu.yaml")], ["optim.lr=1e-5", "run.total_steps=20"])
    assert guards.resume_changes(base, new) == {"optim.lr": (1e-6, 1e-5), "run.total_steps": (10, 20)}
    assert "run.total_steps" in guards.RESUMABLE and "optim.lr" not in guards.RESUMABLE
    assert "rollout.group_size" not in guards.RESUMABLE and "run.seed" not in guards.RESUMABLE


def test_apply_optim_settings_by_hand():
    """The restored schedule keeps its step; the config's lr applies: warmup 10, step 3 -> lr x 4/11."""
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 11 if s < 10 else 1.0)
    for _ in range(3):
        opt.step()
        sched.step()
    saved = (opt.state_dict(), sched.state_dict())
    opt2 = torch.optim.AdamW([w], lr=1e-6)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: (s + 1) / 11 if s < 10 else 1.0)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-6 * 4 / 11)  # before: the old lr stayed
    guards.apply_optim_settings(opt2, sched2, {"lr": 1e-5, "beta1": 0.8, "beta2": 0.99, "weight_decay": 0.1})
    g = opt2.param_groups[0]
    assert g["lr"] == pytest.approx(1e-5 * 4 / 11) and g["betas"] == (0.8, 0.99) and g["weight_decay"] == 0.1
    sched2.step()
    assert g["lr"] == pytest.approx(1e-5 * 5 / 11)  # the schedule goes on from the new base


@pytest.mark.slow
def test_resume_with_changed_settings_stops_or_applies_and_records(tiny_model_path, tmp_path, capsys):
    import train
    out = str(tmp_path / "run")
    train.main(small_args(tiny_model_path, out, steps=1))
    with pytest.raises(SystemExit) as e:  # before: trained on, config.yaml rewritten to claim 1e-5
        train.main(small_args(tiny_model_path, out, steps=2, extra=["optim.lr=1e-5"]))
    msg = str(e.value)
    assert "the config differs from the run's" in msg and "optim.lr (1e-06 -> 1e-05)" in msg and "\n" not in msg
    assert "run.force_resume=true" in msg and "run.out_dir" in msg
    assert yaml.safe_load(open(os.path.join(out, "config.yaml")))["optim"]["lr"] == 1e-6  # the record holds
    train.main(small_args(tiny_model_path, out, steps=2))  # run.total_steps may change: applied and recorded
    (rec,) = [strict_json(ln) for ln in open(os.path.join(out, "resumes.jsonl"))]
    assert rec["step"] == 1 and rec["changed"] == {"run.total_steps": [1, 2]} and rec["forced"] is False
    train.main(small_args(tiny_model_path, out, steps=3, extra=["optim.lr=1e-5", "run.force_resume=true"]))
    rec = [strict_json(ln) for ln in open(os.path.join(out, "resumes.jsonl"))][-1]
    assert rec["step"] == 2 and rec["changed"]["optim.lr"] == [1e-6, 1e-5] and rec["forced"] is True
    lrs = [strict_json(ln)["lr"] for ln in open(os.path.join(out, "metrics.jsonl"))]
    # cpu.yaml's warmup: lr x (s + 1) / (warmup + 1) after scheduler step s; step 3 runs at the NEW lr
    warm = load_config([os.path.join(REPO, "configs", "cpu.yaml")])["optim"]["warmup_steps"]
    assert lrs[2] == pytest.approx(1e-5 * min(1.0, 4 / (warm + 1)) if warm >= 3 else 1e-5)
    assert yaml.safe_load(open(os.path.join(out, "config.yaml")))["optim"]["lr"] == 1e-5


# --- free space and a write that runs out of it ----------------------------------------------------

def test_checkpoints_at_peak_by_hand():
    assert guards.checkpoints_at_peak(keep=2, existing=0, to_write=10) == 3  # 2 kept + 1 being written
    assert guards.checkpoints_at_peak(keep=2, existing=2, to_write=10) == 1
    assert guards.checkpoints_at_peak(keep=2, existing=0, to_write=1) == 1
    assert guards.checkpoints_at_peak(keep=0, existing=3, to_write=4) == 4  # 0 = keep every one


def test_check_free_space_is_one_line():
    guards.check_free_space("/x", need=10, detail="d", free=10)
    with pytest.raises(SystemExit) as e:
        guards.check_free_space("/x", need=3_000_000_000, detail="3 more checkpoint folder(s)", free=1_000_000_000)
    assert str(e.value) == ("run.out_dir=/x: 1.00 GB free, the checkpoints need about 3.00 GB (3 more checkpoint "
                            "folder(s)): free space, lower run.keep_checkpoints or move run.out_dir")


@pytest.mark.parametrize("preset", ["cpu.yaml", "cpu_rm_nlhf.yaml"])
def test_a_full_disk_stops_the_run_before_the_engine_and_the_metarm(preset, tiny_model_path, tmp_path,
                                                                     monkeypatch):
    """The free-space check runs once the policy has loaded, before the rollout engine starts and
    the MetaRM loads or cold-starts (minutes to hours at a preset's scale); before, it came after
    both. 1 kB free: the one-line stop, and neither was reached."""
    import train as T
    import plumbing.run

    def reached(*args, **kwargs):
        raise AssertionError("the rollout engine started before the free-space check")

    monkeypatch.setattr(plumbing.run, "rollout_backend", reached)
    monkeypatch.setattr(plumbing.run, "setup_metarm", reached)
    real = guards.shutil.disk_usage
    monkeypatch.setattr(guards.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    cfg = load_config([os.path.join(REPO, "configs", preset)],
                      [f"model.policy={tiny_model_path}", f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit, match=r"0.00 GB free, the checkpoints need about .* GB \("):
        T.train(cfg)


def test_checkpoint_bytes_against_a_real_folder(tiny_model_path, tmp_path):
    """Full fine-tuning: 4 bytes of weights + 8 of AdamW moments per parameter, +2 % +16 MiB."""
    from plumbing.models import load_model
    from plumbing.checkpoints import save_checkpoint
    policy, tok = load_model(tiny_model_path)
    n = sum(p.numel() for p in policy.parameters())
    est = guards.checkpoint_bytes(policy)
    assert est == int(12 * n * 1.02) + (16 << 20)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(str(tmp_path), 1, policy, tok, opt, sched, keep=1)
    folder = tmp_path / "checkpoints" / "step_000001"
    real = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert 12 * n < real < est  # the tensors are all there; the estimate covers the folder


FULL_DISK = """
import resource, signal, sys, torch
sys.path.insert(0, {repo!r})
from plumbing.models import load_model
from plumbing.run import save_checkpoint
policy, tok = load_model({model!r})
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
save_checkpoint({out!r}, 1, policy, tok, opt, sched, keep=2)      # fits
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)                     # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))     # as a full disk does
save_checkpoint({out!r}, 2, policy, tok, opt, sched, keep=2)
"""


def test_a_checkpoint_write_that_runs_out_of_space_is_one_line_and_leaves_no_tmp(tiny_model_path, tmp_path):
    """Before: two chained tracebacks (iostream error, unexpected pos) and a .tmp folder left."""
    out = str(tmp_path / "run")
    model_bytes = os.path.getsize(os.path.join(tiny_model_path, "model.safetensors"))
    code = FULL_DISK.format(repo=REPO, model=tiny_model_path, out=out, limit=model_bytes * 2)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("Loading weights")]
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0].startswith(f"checkpoint {out}/checkpoints/step_000002 could not be written (")
    assert "GB are free there; the partial folder was removed" in lines[0]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_000001"]  # no .tmp; step 1 intact


# --- Ctrl-C -----------------------------------------------------------------------------------------

def test_an_interrupt_inside_a_save_waits_for_its_end():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with guards.deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("saved")  # before: the interrupt landed here, mid-write
    assert done == ["saved"]


@pytest.mark.slow
def test_ctrl_c_is_one_line_exit_130_and_says_what_resumes(tiny_model_path, tmp_path):
    out = str(tmp_path / "run")
    # 200 steps, interrupted after the first checkpoint: room for a slow poll on a loaded machine (at
    # 50, a run of 19 s once finished before the signal landed)
    cmd = [sys.executable, os.path.join(REPO, "train.py"), *small_args(tiny_model_path, out, steps=200)]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    from plumbing.checkpoints import latest_checkpoint
    deadline = time.time() + 300  # any complete checkpoint (step_000001 may already be rotated out)
    while latest_checkpoint(out) is None and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("train:", "Loading weights"))]  # bars
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("[train] interrupted after step "), err[-2000:]
    assert "of 200; the same command resumes from step_" in lines[0]
    assert err.rstrip().splitlines()[-1] == lines[0]  # the last line: the bar closed before it, not after
    assert not [d for d in os.listdir(os.path.join(out, "checkpoints")) if d.endswith(".tmp")]


# --- non-finite values, steps that cannot learn, JSON --------------------------------------------------

def test_finite_or_none():
    assert guards.finite_or_none({"a": float("nan"), "b": [1.0, float("inf")], "c": "x", "d": 2}) == \
        {"a": None, "b": [1.0, None], "c": "x", "d": 2}


def test_a_nan_gradient_never_reaches_the_weights(tiny_model_path):
    """update_policy skips AdamW when the global gradient norm is not finite (before: every
    parameter became NaN and was checkpointed)."""
    import rollout
    import train as T
    from plumbing.models import load_model
    policy, tok = load_model(tiny_model_path)
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    batch = {"prompt_ids": [[1, 2], [3, 4]], "completion_ids": torch.tensor([[5, 6], [7, 8]]),
             "completion_mask": torch.ones(2, 2), "advantages": torch.tensor([float("nan"), 1.0])}
    import contextlib
    import rollout
    logprobs = functools.partial(rollout.completion_logprobs, temperature=1.0, pad_id=tok.pad_token_id)
    upd = T.update_policy(policy, policy, opt, batch, loss_fn=functools.partial(
        T.cispo_loss, eps_low=1.0, eps_high=5.0, ratio="sequence", aggregation="seq_sum"),
        aggregation="seq_sum", max_new_tokens=2, updates_per_batch=1, minibatches=1, group_size=2,
        micro_batch_size=2, grad_clip=1.0, logprobs=logprobs, clip_grad_norm=T.clip_grad_norm,
        context=contextlib.nullcontext, world=1, device=torch.device("cpu"))
    assert not math.isfinite(upd["grad_norms"][0])
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def _metrics_state(tmp_path, cfg):
    from tqdm import tqdm
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), lambda s: 1.0)
    bar = tqdm(total=200, disable=True)
    written = []
    bar.write = written.append
    return {"world": 1, "rank": 0, "scheduler": sched, "device": torch.device("cpu"), "trackers": [], "pbar": bar,
            "rewards_since_eval": [], "start_step": 0}, written


def _records(step, rewards, q):
    return [{"step": step, "rank": 0, "group": 0, "reward": r, "rlvr_reward": 0.0, "rlme_reward": r,
             "logp": {"self": {q: r}}, "extracted": None, "correct": None, "completion": "x", "truncated": False,
             "length": 3, "advantage": 0.0, "importance_weight": 1.0, "clipped": 0.0} for r in rewards]


def test_nan_steps_are_null_in_metrics_jsonl_and_three_in_a_row_stop_the_run(tmp_path):
    from plumbing.metrics import step_metrics
    from plumbing.run import emit, save_and_stop
    cfg = load_config([os.path.join(REPO, "configs", "cpu.yaml")], [f"run.out_dir={tmp_path}", "rollout.group_size=2",
                                                                    "run.save_every=0", "run.total_steps=200"])
    state, _ = _metrics_state(tmp_path, cfg)
    q = cfg["reward"]["meta_questions"][0]["question"]
    times = {"rollout": 1.0, "reward": 1.0, "update": 1.0}
    upd = {"loss": float("nan"), "grad_norms": [float("nan")], "logp_gap": None}
    for step in (1, 2):
        m = emit(state, cfg, *step_metrics(state, cfg, _records(step, [-1.0, -2.0], q), upd, reward_metrics={}, times=times))
        assert m["update/skipped_steps"] == 1 and m["grad_norm"] is None and m["loss"] is None
        assert save_and_stop(state, cfg, step, {}, m) is False
    emit(state, cfg, *step_metrics(state, cfg, _records(3, [-1.0, -2.0], q), upd, reward_metrics={}, times=times))
    with pytest.raises(SystemExit) as e:
        save_and_stop(state, cfg, 3, {}, None)
    assert str(e.value).startswith("[train] step 3: the gradient norm was non-finite (NaN/inf) in every optimizer "
                                   "step of the last 3 steps (optim.max_skipped_steps=3)")
    assert [strict_json(ln)["step"] for ln in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]  # valid JSON


def test_a_step_that_cannot_learn_says_so_once_then_at_10(tmp_path):
    from plumbing.metrics import step_metrics
    from plumbing.run import emit
    cfg = load_config([os.path.join(REPO, "configs", "cpu.yaml")], [f"run.out_dir={tmp_path}", "rollout.group_size=2",
                                                                    "rollout.temperature=0.01"])
    state, written = _metrics_state(tmp_path, cfg)
    q = cfg["reward"]["meta_questions"][0]["question"]
    upd = {"loss": 0.0, "grad_norms": [0.0], "logp_gap": None}
    times = {"rollout": 1.0, "reward": 1.0, "update": 1.0}
    emit(state, cfg, *step_metrics(state, cfg, _records(1, [-1.0, -2.0], q), upd, reward_metrics={}, times=times))
    assert written == [] and "signal" not in state["pbar"].postfix
    for step in range(2, 13):  # identical rewards in every group, steps 2..12
        emit(state, cfg, *step_metrics(state, cfg, _records(step, [-1.5, -1.5], q), upd, reward_metrics={}, times=times))
    assert "signal=none" in state["pbar"].postfix
    why = ("every group's rewards are equal, so every advantage and the update are 0 (rollout.temperature=0.01: "
           "the G completions of a prompt are likely identical)")
    assert written == [f"[train] step 2: nothing to learn from: {why}",
                       f"[train] step 11: nothing to learn from for 10 steps in a row: {why}"]


def test_no_signal_note_names_the_format_failures():
    m = {"reward/mean": -1.0, "groups/zero_variance_frac": 1.0, "nlhf/format_error_rate": 1.0}
    assert "every GRM output failed to parse: nlhf/format_error_rate 1.0" in guards.no_signal_note(m, temperature=1.0)
    assert guards.no_signal_note(dict(m, **{"groups/zero_variance_frac": 0.5}), temperature=1.0) is None


@pytest.mark.parametrize("override, message", [
    ("reward.meta_questions=[{question: 'Is the answer correct?', target: ' Yes', weight: .nan}]",
     "config key reward.meta_questions[0].weight: nan is not a finite number"),
    ("optim.lr=.inf", "config key optim.lr: inf is not a finite number"),
    ("reward.nonfinite_logp=-.inf", "config key reward.nonfinite_logp: -inf is not a finite number"),
])
def test_a_non_finite_config_value_stops_before_any_model_loads(tmp_path, override, message):
    """Before: a NaN weight trained on, wrote NaN into metrics.jsonl and a checkpoint of NaNs."""
    p = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "cpu.yaml"),
                        override, "model.policy=/no/such/model", f"run.out_dir={tmp_path}/run"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and lines == [message], p.stderr[-1500:]  # the bad model path was never reached


def test_an_unknown_key_gets_a_did_you_mean():
    with pytest.raises(SystemExit) as e:
        load_config([], ["optim.learning_rate=1e-5"])  # nothing close: the known keys only
    assert str(e.value).startswith("unknown config key optim.learning_rate (known: beta1, ")
    with pytest.raises(SystemExit) as e:
        load_config([], ["rollout.group_sise=4"])
    assert "(did you mean rollout.group_size? known: " in str(e.value)


def test_a_missing_evaluator_path_stops_before_the_policy_loads(tmp_path, tiny_model_path):
    """Before: reported only after the policy had loaded. The policy here is a real model, so
    reaching the load would take seconds and print its bar; the line comes first."""
    evs = f"reward.evaluators=[{{name: judge, kind: frozen, weight: 1.0, path: {tmp_path}/nothere}}]"
    p = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "cpu.yaml"),
                        evs, f"model.policy={tiny_model_path}", f"run.out_dir={tmp_path}/run",
                        f"data.train={data_path('gsm8k', 'train.jsonl')}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and lines == [f"config key reward.evaluators[0].path (judge): '{tmp_path}/nothere' "
                                           "does not exist"], p.stderr[-1500:]
