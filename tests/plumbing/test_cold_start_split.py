"""The MetaRM cold start split over the ranks (metarm.cold_start, plumbing.run.setup_metarm):
under 2 gloo ranks with a SHORT process-group timeout (train.dist_timeout_s, passed to
init_process_group) and a slow sampler, every rank samples and judges its half of D_H, so no
rank waits in a collective longer than the timeout; the MetaRM every rank ends with equals the
one-process cold start's (same examples in the same order, same seed)."""
import os
import time

import torch

from conftest import REPO, make_judge
from test_e2e_nlhf import pair
from test_train_run import _free_port

from plumbing import config
from plumbing.models import load_model
from plumbing.run import setup_metarm

CPU = torch.device("cpu")
TIMEOUT_S = 8.0   # train.dist_timeout_s of the 2-rank run
SLEEP_S = 1.5     # the sampler's seconds per D_H prompt: 8 prompts alone = 12 s > TIMEOUT_S, half = 6 s
N_ITEMS = 8
GOOD = "<critics>Response B adds 2 and 3 wrongly.</critics><choice>[[A]]</choice>"


def slow_generate(model, tok, prompts, group_size, **kw):
    """A sampler as slow as a long HF decode: SLEEP_S a prompt; every rollout a valid, right verdict."""
    time.sleep(SLEEP_S * len(prompts))
    return {"completions": [GOOD] * (len(prompts) * group_size)}


def _cfg(model_path, out_dir):
    return config.load_config([os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")], [
        f"run.out_dir={out_dir}", f"model.policy={model_path}", "train.parallel=ddp", "judge.backend=proxy",
        f"train.dist_timeout_s={TIMEOUT_S}", "metarm.rollouts_per_prompt=2", "metarm.cold_start_items=0",
        "metarm.epochs=1", "metarm.batch_size=4", "metarm.max_length=128", "metarm.mode=online"])


def _cold_start(model_path, out_dir, rank, world):
    cfg = _cfg(model_path, out_dir)
    policy, tok = load_model(model_path)
    torch.manual_seed(0)  # the MetaRM's fresh head (rank 0's is broadcast)
    mrm, source, stats = setup_metarm(cfg, None, policy, tok, dh=[pair(i) for i in range(N_ITEMS)],
                                      judge=make_judge({"backend": "proxy"}), device=CPU, rank=rank, world=world,
                                      generate=slow_generate)
    flat = torch.cat([p.detach().flatten() for p in mrm["model"].parameters()])
    return flat, stats


def _worker(rank, world, port, model_path, out_dir, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from plumbing.scale import setup_distributed
    setup_distributed("cpu", timeout_s=_cfg(model_path, out_dir)["train"]["dist_timeout_s"])
    t0 = time.perf_counter()
    flat, stats = _cold_start(model_path, out_dir, rank, world)
    torch.save({"flat": flat, "stats": stats, "seconds": time.perf_counter() - t0}, f"{result}.{rank}")
    dist.destroy_process_group()


def test_cold_start_split_over_two_ranks_within_a_short_timeout(tiny_model_path, tmp_path):
    """Before: rank 0 sampled all 8 prompts (12 s) while rank 1 sat in dist.barrier(), which
    timed out after TIMEOUT_S: rank 1 died with a gloo timeout."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    port, result = _free_port(), str(tmp_path / "r")
    procs = [ctx.Process(target=_worker, args=(r, 2, port, tiny_model_path, str(tmp_path / "run"), result))
             for r in range(2)]
    [p.start() for p in procs]
    [p.join(300) for p in procs]
    assert [p.exitcode for p in procs] == [0, 0]
    got = [torch.load(f"{result}.{r}") for r in range(2)]
    # all 8 items sampled and judged, once: 16 rollouts, each a training example
    for g in got:
        assert g["stats"]["rollouts"] == 2 * N_ITEMS and g["stats"]["examples"] == 2 * N_ITEMS
    assert torch.equal(got[0]["flat"], got[1]["flat"])
    # the saved folder is rank 0's MetaRM
    assert os.path.isfile(tmp_path / "run" / "metarm" / "metarm.json")
    # one process, the same seed: the same examples in the same order, so the same MetaRM
    flat1, stats1 = _cold_start(tiny_model_path, str(tmp_path / "one"), 0, 1)
    assert stats1["examples"] == 2 * N_ITEMS and stats1["loss_first"] == got[0]["stats"]["loss_first"]
    assert (flat1 - got[0]["flat"]).abs().max().item() < 1e-6
