"""The MetaRM cold start split over the ranks (plumbing/cold_start.py run_cold_start, through
plumbing.metarm_setup.setup_metarm): under 2 gloo ranks with a SHORT process-group timeout
(train.dist_timeout_s, passed to init_process_group) and a slow sampler, the batches are dealt
round-robin, every rank calls the sampler once a round (with no prompt when it has no batch left:
HF decode of an FSDP2 policy is a collective), the examples are exchanged through the files, so no
rank waits in a collective longer than the timeout; the MetaRM every rank ends with equals the
one-process cold start's (same examples in the same order, same seed)."""
import json
import os
import time

import torch

from conftest import REPO, make_judge
from test_e2e_nlhf import pair
from test_train_run import _free_port

from plumbing import config
from plumbing.models import load_model
from plumbing.metarm_setup import setup_metarm

CPU = torch.device("cpu")
TIMEOUT_S = 8.0   # train.dist_timeout_s of the 2-rank run
SLEEP_S = 1.5     # the sampler's seconds per D_H prompt: 9 prompts alone = 13.5 s > TIMEOUT_S, rank 0's 5 = 7.5 s
N_ITEMS = 9       # batches of 2: 5 batches, rank 0 runs 0, 2, 4 and rank 1 runs 1, 3 and one empty call
GOOD = "<critics>Response B adds 2 and 3 wrongly.</critics><choice>[[A]]</choice>"


def slow_sample(calls):
    """A sampler as slow as a long decode: SLEEP_S a prompt; every rollout a valid, right verdict."""
    def sample(prompt_ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0):
        calls.append(len(prompt_ids))
        time.sleep(SLEEP_S * len(prompt_ids))
        return {"completions": [GOOD] * (len(prompt_ids) * group_size)}
    return sample


def _cfg(model_path, out_dir):
    return config.load_config([os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")], [
        f"run.out_dir={out_dir}", f"model.policy={model_path}", "train.parallel=ddp", "judge.backend=proxy",
        f"train.dist_timeout_s={TIMEOUT_S}", "metarm.rollouts_per_prompt=2", "metarm.cold_start_items=0",
        "metarm.cold_start_batch_size=2", "metarm.epochs=1", "metarm.batch_size=4", "metarm.max_length=128",
        "metarm.mode=online"])


def _cold_start(model_path, out_dir, rank, world):
    cfg = _cfg(model_path, out_dir)
    _, tok = load_model(model_path)
    calls = []
    mrm, source, stats = setup_metarm(cfg, None, tok, sample=slow_sample(calls), dh=[pair(i) for i in range(N_ITEMS)],
                                      judge=make_judge({"backend": "proxy"}), device=CPU, rank=rank, world=world)
    flat = torch.cat([p.detach().flatten() for p in mrm["model"].parameters()])
    return flat, stats, calls


def _worker(rank, world, port, model_path, out_dir, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from plumbing.scale import setup_distributed
    setup_distributed("cpu", timeout_s=_cfg(model_path, out_dir)["train"]["dist_timeout_s"])
    t0 = time.perf_counter()
    flat, stats, calls = _cold_start(model_path, out_dir, rank, world)
    torch.save({"flat": flat, "stats": stats, "calls": calls, "seconds": time.perf_counter() - t0}, f"{result}.{rank}")
    dist.destroy_process_group()


def test_cold_start_split_over_two_ranks_within_a_short_timeout(tiny_model_path, tmp_path):
    """Before (issue 20): rank 0 sampled all prompts while rank 1 sat in dist.barrier(), which timed
    out after TIMEOUT_S. Before (issue 34): every rank's whole share in one sampler call, the
    examples met in an all_gather_object, nothing on disk."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    port, result = _free_port(), str(tmp_path / "r")
    procs = [ctx.Process(target=_worker, args=(r, 2, port, tiny_model_path, str(tmp_path / "run"), result))
             for r in range(2)]
    [p.start() for p in procs]
    [p.join(300) for p in procs]
    assert [p.exitcode for p in procs] == [0, 0]
    got = [torch.load(f"{result}.{r}") for r in range(2)]
    assert got[0]["calls"] == [2, 2, 1] and got[1]["calls"] == [2, 2, 0]  # one call a round on every rank
    # all 9 items sampled and judged, once: 18 rollouts, each a training example
    for g in got:
        assert g["stats"]["rollouts"] == 2 * N_ITEMS and g["stats"]["examples"] == 2 * N_ITEMS
    assert torch.equal(got[0]["flat"], got[1]["flat"])
    # each rank wrote its own batches to its own file
    for r, mine in [(0, [0, 2, 4]), (1, [1, 3])]:
        with open(tmp_path / "run" / "cold_start" / f"examples.rank{r}.jsonl") as f:
            assert [x["batch"] for x in map(json.loads, f) if "done" in x] == mine
    # the saved folder is rank 0's MetaRM
    assert os.path.isfile(tmp_path / "run" / "metarm" / "metarm.json")
    # one process, the same seed: the same examples in the same order, so the same MetaRM
    flat1, stats1, calls1 = _cold_start(tiny_model_path, str(tmp_path / "one"), 0, 1)
    assert calls1 == [2, 2, 2, 2, 1]
    assert stats1["examples"] == 2 * N_ITEMS and stats1["loss_first"] == got[0]["stats"]["loss_first"]
    assert (flat1 - got[0]["flat"]).abs().max().item() < 1e-6
