"""A 4-rank gloo rehearsal of each RM-NLHF GPU preset through the stages a run's first steps go
through (issue 34): the MetaRM cold start (plumbing/cold_start.py: batches dealt to the ranks, one
rank with an empty sampler call under FSDP2, the exchange through the files), a validation
(nlhf.val, run.eval_every) and a checkpoint, with each rank's peak resident memory checked.

The run is tests/plumbing/test_rehearsal.py's (the preset as shipped but for the model, data, sizes,
device and judge endpoint: test_configs.swaps; train.dist_timeout_s 60; the tiny random Llama; a real
local judge server; verdicts forced), 2 steps, with the cold start on 3 D_H prompts in batches of 1
(3 batches over 4 ranks: rank 3 calls the sampler with nothing) and a validation at step 2.

Memory (tests/plumbing/rehearsal_rss_launch.py writes each rank's figures): the peak resident set
over the resident set once torch, transformers and the project are imported (`base`) must stay
under PEAK_BUDGET_MB, reasoned from the tiny model (P = 3.2M parameters, 12.7 MB in float32): what
a rank can hold at once is at most ~12 float32 copies of the GRM's size (the FSDP2 policy gathered
for decoding and for the checkpoint's full state dict, its float32 gradient and AdamW moments, the
GRPO reference, the MetaRM gathered, its gradient and AdamW state: 12 x 12.7 = 152 MB), the decode's
KV cache and logits (a few MB at 4 rows x 808 tokens, KV 1 KiB a token), plus what a run loads
beside the models: the rest of transformers' and torch's modules imported lazily (the sequence
classifier, safetensors, torch.distributed.checkpoint, the openai client), the tokenizer, the
datasets (Mr-Ben, hh-rlhf, LLMBar: a few MB as Python objects), gloo's buffers; measured at
~X MB. A cold start that decoded every D_H row at once, a second GRM kept, a checkpoint that gathered
both models at once on every rank are each a few model sizes: at the tiny size they stay under the
budget, so it guards the order of magnitude (what scales with D_H or the rows), not single copies.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL_FIXTURE
from test_configs import read_jsonl, shipped_cfg
from test_rehearsal import complete_checkpoints, kill_run, rehearsal_args, tail

LAUNCH = os.path.join(REPO, "tests", "plumbing", "rehearsal_rss_launch.py")
NLHF_PRESETS = ["configs/rm_nlhf.yaml", "configs/paper/rm_nlhf_qwen7b.yaml"]
WORLD, STEPS, COLD_ITEMS = 4, 2, 3
PEAK_BUDGET_MB = 1000


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("name", NLHF_PRESETS)
def test_nlhf_rehearsal_4_ranks_cold_start_validation_checkpoint_memory(name, request, tmp_path):
    cfg = shipped_cfg(name)
    model = request.getfixturevalue(TINY_MODEL_FIXTURE[cfg["model"]["dtype"]])
    judge = request.getfixturevalue("tiny_judge_server")
    out, rss = str(tmp_path / "run"), tmp_path / "rss"
    rss.mkdir()
    args = rehearsal_args(name, cfg, model, out, judge) + [
        f"run.total_steps={STEPS}", f"run.eval_every={STEPS}", f"metarm.cold_start_items={COLD_ITEMS}",
        "metarm.cold_start_batch_size=1"]
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
    assert stats["batches"] == COLD_ITEMS and stats["rollouts"] == COLD_ITEMS * cfg["metarm"]["rollouts_per_prompt"] \
        or stats["batches"] == COLD_ITEMS, stats
    # a validation at step 2, a complete checkpoint with its MetaRM
    metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2]
    assert "val/pairwise_accuracy" in metrics[-1] and metrics[-1]["val/n"] > 0, metrics[-1]
    last = complete_checkpoints(out)[-1]
    assert last.endswith(f"step_{STEPS:06d}") and os.path.isdir(os.path.join(last, "metarm"))

    # memory: every rank, every stage it went through
    for r in range(WORLD):
        got = json.load(open(rss / f"rank{r}.json"))
        assert {s["stage"] for s in got["stages"]} == {"cold_start", "validation", "checkpoint"}, got
        grown = (got["peak_kib"] - got["base_kib"]) / 1024
        print(f"rank {r}: base {got['base_kib'] / 1024:.0f} MB, peak {got['peak_kib'] / 1024:.0f} MB "
              f"(+{grown:.0f}); stages {[(s['stage'], s['start_kib'] // 1024, s['peak_kib'] // 1024) for s in got['stages']]}")
        assert grown < PEAK_BUDGET_MB, (r, got)
