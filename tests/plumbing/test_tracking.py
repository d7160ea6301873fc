"""Experiment trackers (run.report_to, plumbing.tracking.open_trackers / track_step; docs/method.md §9): each
tracker holds what metrics.jsonl and samples.jsonl hold, read back from its own files, offline
(TensorBoard event files, trackio's local SQLite store, wandb's offline run file); a resumed run
continues the same tracker runs without duplicate steps; bad names and missing packages are
one-line errors before a model loads."""
import glob
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import pytest

from conftest import REPO, data_path
import train as T
from plumbing.config import load_config
from plumbing.tracking import markdown_table, open_trackers, samples_table, tracker_metrics

# entries that differ between a step and its exact redo after a resume (wall-clock and memory)
TIMING = ("time/", "memory/", "rollout/tokens_per_s")


# ---- the pieces, by hand ---------------------------------------------------------------------------------

def test_tracker_metrics_are_the_numeric_entries_flattened():
    line = {"step": 3, "reward/mean": -0.5, "accuracy": None, "n": 2, "flag": True, "note": "x",
            "judge": {"calls": 4, "errors": {"timeout": 1}, "model": "m"}}
    assert tracker_metrics(line) == {"reward/mean": -0.5, "n": 2, "flag": 1.0, "judge/calls": 4,
                                       "judge/errors/timeout": 1}
    assert type(tracker_metrics(line)["flag"]) is float  # a bool as the number 1.0, which every tracker plots


def test_samples_table_and_its_markdown():
    records = [{"step": 1, "completion": "a|b\nc", "reward": -0.25, "logp": {"self": {"q": -0.25}}},
               {"step": 1, "completion": "d", "reward": None, "label": ["Paris", "paris"]}]
    columns, rows = samples_table(records)
    assert columns == ["step", "completion", "reward", "logp", "label"]
    assert rows == [[1, "a|b\nc", -0.25, '{"self": {"q": -0.25}}', None],
                    [1, "d", None, None, '["Paris", "paris"]']]
    assert markdown_table(columns, rows).split("\n") == [
        "| step | completion | reward | logp | label |", "|---|---|---|---|---|",
        '| 1 | a\\|b<br>c | -0.25 | {"self": {"q": -0.25}} | None |',
        '| 1 | d | None | None | ["Paris", "paris"] |']


# ---- errors before a model loads -------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("run.report_to=[tensorbord]", "config key run.report_to: 'tensorbord' is not one of ['tensorboard', 'trackio', 'wandb']"),
    ("run.report_to=[wandb, tensorboard, wandb]", "config key run.report_to: wandb is listed twice"),
    ("run.report_to=wandb", "config key run.report_to: expected list, got 'wandb'"),
    ("run.tracking_project=mine", "config key run.tracking_project='mine': is read only by the trackio and wandb trackers"),
])
def test_bad_report_to_is_one_line(override, message):
    with pytest.raises(SystemExit) as e:
        load_config([], [override, "run.report_to=[tensorboard]"] if "project" in override else [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_missing_tracker_package_stops_at_start_up(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError, as if not installed
    with pytest.raises(SystemExit) as e:
        T.main(["run.report_to=[tensorboard, wandb]", "model.policy=/nonexistent", f"run.out_dir={tmp_path / 'out'}",
                "train.device=cpu", "train.parallel=ddp"])
    assert str(e.value) == "config key run.report_to: wandb needs the `wandb` package: pip install wandb"
    assert not os.path.exists(tmp_path / "out")


def test_wandb_online_without_an_api_key_stops_at_start_up(tmp_path):
    """No WANDB_API_KEY, no ~/.netrc, online mode: one line before any model loads (wandb.init
    raised a traceback after the models had loaded); WANDB_MODE=offline needs no key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), NETRC=str(tmp_path / "netrc"))
    code = ("import train\ntrain.main(['run.report_to=[wandb]', 'model.policy=/nonexistent', "
            f"'data.train={tmp_path / 'none.jsonl'}', 'run.out_dir={tmp_path / 'out'}', 'train.device=cpu', "
            "'train.parallel=ddp', 'rollout.backend=hf'])")  # config.yaml's vllm: its checks are not this test's
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("wandb:")]
    assert p.returncode == 1 and lines == ["config key run.report_to: wandb is online but no W&B API key is configured: "
                                           "run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to "
                                           "log locally"], p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(env, WANDB_MODE="offline"),
                       capture_output=True, text=True, timeout=300)
    assert "W&B API key" not in p.stderr and "none.jsonl does not exist" in p.stderr, p.stderr[-2000:]  # past it


def test_a_tracker_that_cannot_start_is_one_line(monkeypatch, tmp_path):
    """wandb.init raising (here wandb's own CommError, as when its server cannot be reached: it
    retried ~2 min, then a traceback): one line naming run.report_to and the way out."""
    import wandb
    from wandb.errors import CommError

    def unreachable(**kwargs):
        raise CommError("Failed to get resume status for run e3b36ff4: context deadline exceeded\nmore detail")
    monkeypatch.setattr(wandb, "init", unreachable)
    cfg = load_config([], ["run.report_to=[wandb]", f"run.out_dir={tmp_path}"])
    with pytest.raises(SystemExit) as e:
        open_trackers(cfg, start_step=0)
    assert str(e.value) == ("config key run.report_to: wandb could not start its run (CommError: Failed to get resume "
                            "status for run e3b36ff4: context deadline exceeded); WANDB_MODE=offline logs locally")


# ---- a real run, read back from each tracker's files ----------------------------------------------------

def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tensorboard_scalars(folder):
    """{tag: [(step, value)]} and {step: markdown} of the samples text, as TensorBoard reads the folder
    (purging the events a SessionLog START at purge_step orphans)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    scalars = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    text = {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors("samples/text_summary")}
    return scalars, text


def wandb_records(path):
    """The protobuf records of a wandb run file (<dir>/run-<id>.wandb): a 7-byte header, then the
    LevelDB log format (32 KiB blocks of chunks: crc32 [4], length [2], type [1] 1 full, 2 first,
    3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_history(run_dir):
    """(run id, [{key: value}] of each logged step) of one offline run folder."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run_id, rows = None, []
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return run_id, rows


def trackio_logs(tdir, project):
    """(run names, logs of the only run) of a trackio project, read by trackio's own reader in a
    fresh process (trackio fixes its folder, TRACKIO_DIR, at import)."""
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; runs = S.get_runs(sys.argv[1]); "
            "print(json.dumps([runs, S.get_logs(sys.argv[1], runs[0])]))")
    p = subprocess.run([sys.executable, "-c", code, project], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TRACKIO_DIR=tdir))
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def assert_same(logged, expected, where):
    assert set(logged) == set(expected), (where, set(logged) ^ set(expected))
    for k, v in expected.items():  # TensorBoard stores float32
        assert math.isclose(logged[k], v, rel_tol=1e-6, abs_tol=1e-6), (where, k, logged[k], v)


def run_train(args, env):
    p = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *args], capture_output=True, text=True,
                       timeout=900, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
def test_trackers_hold_metrics_jsonl_and_a_resume_continues_them(tiny_model_path, tmp_path):
    out, tdir = str(tmp_path / "run"), str(tmp_path / "trackio")
    # offline: wandb writes <out>/wandb/offline-run-*, trackio its SQLite file in TRACKIO_DIR
    env = dict(os.environ, WANDB_MODE="offline", TRACKIO_DIR=tdir, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               **{k: str(tmp_path / k.lower()) for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")})
    args = ["--config", os.path.join(REPO, "configs", "cpu.yaml"), f"model.policy={tiny_model_path}",
            f"run.out_dir={out}", "run.save_every=1", f"data.train={data_path('gsm8k', 'train.jsonl')}",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "run.report_to=[tensorboard, trackio, wandb]", "run.tracking_project=rlme-test"]
    run_train([*args, "run.total_steps=2"], env)
    first = read_jsonl(os.path.join(out, "metrics.jsonl"))
    # as if killed between logging step 2 and its checkpoint: the resume redoes step 2, then step 3
    shutil.rmtree(os.path.join(out, "checkpoints", "step_000002"))
    run_train([*args, "run.total_steps=3"], env)
    metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[0] == first[0]
    assert metrics[1]["time/step"] != first[1]["time/step"]  # step 2 was redone (and timed anew)
    expected = {m["step"]: tracker_metrics(m) for m in metrics}
    assert "reward/mean" in expected[1] and "accuracy" in expected[1] and "step" not in expected[1]
    tables = {s: samples_table([r for r in samples if r["step"] == s]) for s in (1, 2, 3)}
    rows = {s: t[1] for s, t in tables.items()}
    info = json.load(open(os.path.join(out, "tracking.json")))
    assert info["last_step"] == {"tensorboard": 3, "trackio": 3, "wandb": 3}

    # TensorBoard: every step once (the killed run's step 2 purged), with the redone values
    scalars, text = tensorboard_scalars(os.path.join(out, "tensorboard"))
    for tag, points in scalars.items():
        assert [s for s, _ in points] == sorted({s for s, _ in points}), tag  # no step twice
    for step, exp in expected.items():
        assert_same({tag: dict(points)[step] for tag, points in scalars.items() if step in dict(points)}, exp,
                    f"tensorboard step {step}")
        assert len(text[step].split("\n")) == 2 + len(rows[step])  # header, rule, one line per sample

    # trackio: one run, each step once; the redone step 2 kept as first logged (trackio cannot delete
    # a step), equal to metrics.jsonl but for the timings (resume is exact)
    runs, logs = trackio_logs(tdir, "rlme-test")
    assert runs == [f"{info['name']}-{info['id']}"]
    assert [m["step"] for m in logs] == [1, 2, 3]
    for m in logs:
        step, table = m["step"], m.pop("samples")
        assert table["_type"] == "trackio.table" and [list(r.values()) for r in table["_value"]] == rows[step]
        assert_same({k: v for k, v in m.items() if k not in ("step", "timestamp")},
                    tracker_metrics(first[1]) if step == 2 else expected[step], f"trackio step {step}")
        assert all(m[k] == pytest.approx(v, abs=1e-6) for k, v in expected[step].items() if not k.startswith(TIMING))

    # wandb: two offline run folders of the same run id; the resumed one starts at step 3
    dirs = sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*")))
    assert len(dirs) == 2
    (id1, hist1), (id2, hist2) = wandb_history(dirs[0]), wandb_history(dirs[1])
    assert id1 == id2 == info["id"]
    assert [h["_step"] for h in hist1] == [1, 2] and [h["_step"] for h in hist2] == [3]
    for d, h, exp in [(dirs[0], hist1[0], expected[1]), (dirs[0], hist1[1], tracker_metrics(first[1])),
                      (dirs[1], hist2[0], expected[3])]:
        assert h["samples/_type"] == "table-file"
        with open(os.path.join(d, "files", h["samples/path"])) as f:
            table = json.load(f)
        assert (table["columns"], table["data"]) == tables[h["_step"]]
        assert_same({k: v for k, v in h.items() if not k.startswith(("_", "samples"))}, exp, f"wandb step {h['_step']}")
