"""A 4-rank gloo rehearsal of each RM-NLHF GPU preset through the stages a run's first steps go
through (issue 34): the MetaRM cold start (plumbing/cold_start.py: batches dealt to the ranks, one
rank with an empty sampler call under FSDP2, the exchange through the files, the MetaRM's sharded
fit), a validation (nlhf.val at run.eval_every: 2 pairs on 4 ranks, so two ranks have none and must
still join the FSDP2 gather) and a checkpoint, with each rank's resident memory checked.

The run is tests/plumbing/test_rehearsal.py's (the preset as shipped but for the model, data, sizes,
device: test_configs.swaps; train.dist_timeout_s 60: a rank left alone in a collective fails the
run in a minute; the tiny random Llama in the preset's model.dtype; verdicts forced), 2 steps, the
cold start on 3 D_H prompts in batches of 1 (3 batches over 4 ranks: rank 3 calls the sampler with
nothing), a validation at step 2, a checkpoint every step. The judge is the offline proxy: the tiny
judge server's answers never parse (test_rehearsal.py runs it), which would leave the cold start
with no example and its fit untested.

Memory (tests/plumbing/rehearsal_rss_launch.py records it in each rank), in units of the tiny
model's float32 size M (3.2M parameters, 98 % of them the tied embedding: 12.3 MiB):
  - the cold start's peak over the resident set at its start <= 16 M (COLD_START_M). It holds
    the FSDP2 policy gathered for a decode call (1 M, freed on return) and a batch's KV cache (2 rows
    x 816 tokens x 1 KiB), then the MetaRM's sharded fit: its root gathered (~1 M), its full-size
    gradient before the reduce-scatter (~1 M), AdamW moments of its shard (0.5 M), the clip and
    step temporaries (~1 M): ~5 M; the rest is first-use cost (autograd, allocator arenas, code
    imported on first use), measured 114-141 MiB in all on 2026-12-03 (9-11 M);
  - the run's peak over the resident set at the cold start's start (setup's models, tokenizer and
    data loaded: everything after is what the stages hold) <= 32 M (RUN_M): the steps add the
    policy's gradient and AdamW state (1.5 M), the reference (bf16), the checkpoint's float32 full
    state dicts of the policy and the MetaRM (2 M), the validation's gather (1 M); measured 209-296
    MiB (17-24 M) on 2026-12-03.
At this size a cold start that decoded every D_H row at once, or a second GRM kept through it, costs
a few M: the budgets guard the order of magnitude (what scales with D_H, the rows or the world), the
structural checks above guard the stage itself.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL_FIXTURE
from test_configs import read_jsonl, shipped_cfg
from test_rehearsal import complete_checkpoints, effective_run, kill_run, rehearsal_args, tail

LAUNCH = os.path.join(REPO, "tests", "plumbing", "rehearsal_rss_launch.py")
NLHF_PRESETS = ["configs/rm_nlhf.yaml", "configs/paper/rm_nlhf_qwen7b.yaml"]
WORLD, STEPS, COLD_ITEMS = 4, 2, 3
COLD_START_M, RUN_M = 16, 32  # the budgets in units of M (above)


def float32_mib(model_path):
    """M: the model's float32 size, MiB (3,219,776 parameters for conftest.make_tiny_model's: 12.3 MiB)."""
    from transformers import AutoModelForCausalLM
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters()) * 4 / 2**20


@pytest.mark.slow
@pytest.mark.parametrize("name", NLHF_PRESETS)
def test_nlhf_rehearsal_4_ranks_cold_start_validation_checkpoint_memory(name, request, tmp_path):
    cfg = shipped_cfg(name)
    model = request.getfixturevalue(TINY_MODEL_FIXTURE[cfg["model"]["dtype"]])
    out, rss = str(tmp_path / "run"), tmp_path / "rss"
    rss.mkdir()
    args = rehearsal_args(name, cfg, model, out, {"base_url": "http://127.0.0.1:9/v1", "model": "unused"}) + [
        "judge.backend=proxy", f"run.total_steps={STEPS}", f"run.eval_every={STEPS}",
        f"metarm.cold_start_items={COLD_ITEMS}", "metarm.cold_start_batch_size=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", REHEARSAL_FORCE_VERDICTS="1",
               REHEARSAL_RSS_DIR=str(rss))
    log = str(tmp_path / "run.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", LAUNCH, *args]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        p.wait(timeout=900)
    except subprocess.TimeoutExpired:
        kill_run(p)
    assert p.returncode == 0, f"exit {p.returncode}\n{tail(log)}"

    # the cold start: 3 batches of 1 prompt, batch b in rank b's file; rank 3's file holds its header only
    folder = os.path.join(out, "cold_start")
    for r in range(WORLD):
        lines = read_jsonl(os.path.join(folder, f"examples.rank{r}.jsonl"))
        assert "settings" in lines[0]
        assert [x["batch"] for x in lines if "done" in x] == ([r] if r < COLD_ITEMS else [])
    stats = json.load(open(os.path.join(out, "cold_start.json")))
    assert stats["batches"] == COLD_ITEMS and stats["rollouts"] == 2 * COLD_ITEMS, stats  # 2: the swaps' rollouts_per_prompt
    assert stats["examples"] >= COLD_ITEMS and stats["loss_first"] is not None, stats  # the forced verdicts, trained on
    # a validation at step 2, a complete checkpoint with its MetaRM
    metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
    at_start = [0] if effective_run(args)["eval_at_start"] else []  # both presets validate at step 0 too
    assert [m["step"] for m in metrics] == at_start + [1, 2]
    assert "val/pairwise_accuracy" in metrics[-1] and metrics[-1]["val/n"] > 0, metrics[-1]
    last = complete_checkpoints(out)[-1]
    assert last.endswith(f"step_{STEPS:06d}") and os.path.isdir(os.path.join(last, "metarm"))

    # memory: every rank, every stage it went through
    m_mib = float32_mib(model)
    for r in range(WORLD):
        got = json.load(open(rss / f"rank{r}.json"))
        stages = {s["stage"]: s for s in got["stages"]}  # the last of each
        assert set(stages) == {"cold_start", "validation", "checkpoint"}, got
        cold = got["stages"][0]
        assert cold["stage"] == "cold_start", got
        grown_cold, grown_run = (cold["peak_kib"] - cold["start_kib"]) / 1024, (got["peak_kib"] - cold["start_kib"]) / 1024
        print(f"rank {r}: base {got['base_kib'] / 1024:.0f} MiB, cold start from {cold['start_kib'] / 1024:.0f} "
              f"(+{grown_cold:.0f}), peak {got['peak_kib'] / 1024:.0f} (+{grown_run:.0f} over the cold start's start)")
        assert grown_cold < COLD_START_M * m_mib, (r, grown_cold, COLD_START_M * m_mib, got)
        assert grown_run < RUN_M * m_mib, (r, grown_run, RUN_M * m_mib, got)
