"""The MetaRM sharded with FSDP2 (issue 26 item 3; docs/scale-out.md "The MetaRM's placement";
plumbing/metarm_setup.py load_metarm / save_metarm / load_saved_metarm, metarm.py fit / raw_outputs):
on 2 gloo ranks under train.parallel fsdp2 its parameters are DTensor shards, each rank trains on
its share of every batch (uneven shares here: 5 examples in batches of 3), and the update equals
the one-process update on the same examples; the D_O predictions, 4 texts on rank 0 and 1 on
rank 1 (different numbers of forwards), equal one process's; save -> load round trips on 2 ranks
and on 1, and the loaded AdamW state continues the update exactly."""
import json
import os

import pytest
import torch
import torch.distributed as dist

import metarm
from test_e2e_nlhf import pair
from test_scale import _spawn

from plumbing.metarm_setup import load_metarm, load_saved_metarm, save_metarm

KW = dict(mode="online", lam=0.5, batch_size=3, max_length=64, online_lr=1e-2, gradient_checkpointing=True)
REWARDS = [1.5, 0.0, 1.0, 0.0, 1.5, 1.0, 0.0]


def _samples(ks):
    """D_H items and their scored samples for the indices ks (the reward of each from REWARDS)."""
    return [pair(k) for k in ks], [{"valid": True, "reward": REWARDS[k], "critique": f"critique {k}"} for k in ks]


FIRST = {0: [0, 1, 2], 1: [3, 4]}       # step 1: 3 + 2 samples, batches of 3 over all 5
SECOND = {0: [5], 1: [6]}               # step 2, after the save -> load
DO = {0: [10, 11, 12, 13], 1: [14]}     # D_O: 2 forwards on rank 0, 1 on rank 1 (padded to 2)


def _do(ks):
    return [pair(k) for k in ks], [f"Response B is wrong {k}." for k in ks]


def _predict(mrm, items, critiques):
    """metarm.predict as nlhf_reward_step calls it: the MetaRM dict's numbers and its seams' outputs."""
    return metarm.predict(mrm["model"], mrm["tokenizer"], items, critiques, **metarm.settings(mrm),
                          outputs=mrm["seams"]["outputs"])[0]


def _flat(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # on every rank
    return torch.cat([v.float().flatten() for _, v in sorted(sd.items())])


def _real_bytes(mrm):
    """This rank's MetaRM weight and AdamW bytes, as the tensors are in memory (local shards)."""
    b = lambda t: (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
    state = [v for s in mrm["optimizer"].state.values() for v in s.values() if torch.is_tensor(v)]
    return {"MetaRM weights": sum(b(p) for p in mrm["model"].parameters()), "MetaRM AdamW state": sum(b(v) for v in state)}


def _worker(rank, world, port, model_path, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(rank)  # different fresh heads: rank 0's must reach every shard
    mrm = load_metarm(model_path, **KW, parallel="fsdp2", rank=rank, world=world)
    from torch.distributed.tensor import DTensor
    assert mrm["shard"] == (rank, world) and all(isinstance(p, DTensor) for p in mrm["model"].parameters())
    m1 = metarm.online_update(mrm, *_samples(FIRST[rank]), seed=5)
    pred = _predict(mrm, *_do(DO[rank]))
    flat, real = _flat(mrm["model"]), _real_bytes(mrm)
    save_metarm(mrm, os.path.join(out, "saved"), rank=rank, world=world)
    back = load_saved_metarm(os.path.join(out, "saved"), gradient_checkpointing=True, parallel="fsdp2", rank=rank,
                             world=world)
    assert back["updates"] == 1 and back["shard"] == (rank, world)
    m2 = metarm.online_update(back, *_samples(SECOND[rank]), seed=6)
    pred2 = _predict(back, *_do(DO[rank]))
    save_metarm(back, os.path.join(out, "saved2"), rank=rank, world=world)
    torch.save({"m1": m1, "m2": m2, "pred": pred, "pred2": pred2, "flat": flat, "real": real}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _all(d):
    return [k for r in sorted(d) for k in d[r]]


def _plain_flat(model):
    return torch.cat([v.float().flatten() for _, v in sorted(model.state_dict().items())])


@pytest.fixture(scope="module")
def fsdp_run(tiny_model_path, tmp_path_factory):
    """The 2-rank FSDP2 run of _worker, once for this module's tests: its folder."""
    out = tmp_path_factory.mktemp("metarm_fsdp")
    _spawn(_worker, 2, tiny_model_path, str(out))
    return out


@pytest.mark.slow
def test_fsdp2_metarm_update_predictions_and_round_trip_equal_one_process(tiny_model_path, fsdp_run):
    tmp_path = fsdp_run
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # one process: rank 0's fresh head (seed 0), the same 5 examples in rank order, the same seed
    torch.manual_seed(0)
    ref = load_metarm(tiny_model_path, **KW)
    assert ref["shard"] == (0, 1)
    m1 = metarm.online_update(ref, *_samples(_all(FIRST)), seed=5)
    assert m1["metarm/n"] == 5
    want_flat = _plain_flat(ref["model"])
    for g in got:
        assert g["m1"]["metarm/n"] == 5 and g["m1"]["metarm/updates"] == 1
        assert g["m1"]["metarm/loss"] == pytest.approx(m1["metarm/loss"], abs=1e-5)
        assert g["m1"]["metarm/agreement"] == m1["metarm/agreement"]
        assert (g["flat"] - want_flat).abs().max().item() < 1e-5
    # the test can fail: the update moved the weights well beyond the tolerance
    torch.manual_seed(0)
    assert (_plain_flat(load_metarm(tiny_model_path, **KW)["model"]) - want_flat).abs().max().item() > 1e-3
    # D_O predictions: each rank's own texts, as one process predicts them
    for r in range(2):
        want = _predict(ref, *_do(DO[r]))
        assert len(got[r]["pred"]) == len(DO[r]) and got[r]["pred"] == pytest.approx(want, abs=1e-5)
    # the 2-rank save is a plain HF folder with the full weights, and its AdamW state loads in one process
    assert set(json.load(open(tmp_path / "saved" / "metarm.json"))) >= {"mode", "updates"}
    one = load_saved_metarm(str(tmp_path / "saved"), gradient_checkpointing=True)
    assert one["updates"] == 1 and (_plain_flat(one["model"]) - want_flat).abs().max().item() < 1e-5
    for a, b in zip(ref["optimizer"].state.values(), one["optimizer"].state.values()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert (a[k] - b[k]).abs().max().item() < 1e-6
    # step 2: the reference, the 1-process reload and the 2-rank reload continue alike
    m2 = metarm.online_update(ref, *_samples(_all(SECOND)), seed=6)
    metarm.online_update(one, *_samples(_all(SECOND)), seed=6)
    assert (_plain_flat(one["model"]) - _plain_flat(ref["model"])).abs().max().item() < 1e-5
    for r, g in enumerate(got):
        assert g["m2"]["metarm/loss"] == pytest.approx(m2["metarm/loss"], abs=1e-5)
        assert g["pred2"] == pytest.approx(_predict(ref, *_do(DO[r])), abs=1e-5)
    # the 2-rank save after step 2, loaded in one process: step 2's weights (1 -> 2 -> 1 ranks)
    two = load_saved_metarm(str(tmp_path / "saved2"))
    assert two["updates"] == 2 and (_plain_flat(two["model"]) - _plain_flat(ref["model"])).abs().max().item() < 1e-5


@pytest.mark.slow
def test_plan_counts_the_metarm_as_placed(tiny_model_path, fsdp_run):
    """plumbing/plan.py's MetaRM lines follow load_metarm's placement. Before: always a 1/world
    FSDP2 shard with all metarm.batch_size rows on each rank. Now fsdp2 on 2 ranks: the bytes of the
    real local shards (the FSDP2 worker above, after its AdamW step), activations for this rank's
    ceil(3 / 2) = 2 rows; ddp on 2 ranks: a full replica, all 3 rows."""
    from plumbing import plan as PL
    from plumbing.config import load_config
    from conftest import REPO
    over = [f"model.policy={tiny_model_path}", "metarm.batch_size=3", "metarm.max_length=64",
            "metarm.gradient_checkpointing=true", "metarm.dtype=float32"]
    cfg = lambda par: load_config([os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")], over + [f"train.parallel={par}"])
    torch.manual_seed(0)
    one = load_metarm(tiny_model_path, **KW)
    metarm.online_update(one, *_samples(_all(FIRST)), seed=5)
    full = _real_bytes(one)
    n = sum(p.numel() for p in one["model"].parameters())
    assert full["MetaRM weights"] == 4 * n
    f = PL.shape_facts(PL.meta_model(PL.model_config(tiny_model_path), num_labels=1))
    arch = {k: f[k] for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")}
    for rank in (0, 1):
        real = torch.load(fsdp_run / f"rank{rank}.pt")["real"]
        items = PL.memory_plan(cfg("fsdp2"), world=2, gpu_bytes=80 * 2**30, rank=rank)["items"]
        assert {k: items[k] for k in real} == real and real["MetaRM weights"] < full["MetaRM weights"]
        assert items["MetaRM activations"] == PL.activation_bytes(tokens=2 * 64, rows=2, masked=True, dtype_bytes=4, checkpointing="full", **arch) \
            + 4 * (f["root_params"] + 2 * f["layer_params"])
    items = PL.memory_plan(cfg("ddp"), world=2, gpu_bytes=80 * 2**30)["items"]
    assert {k: items[k] for k in full} == full
    assert items["MetaRM activations"] == PL.activation_bytes(tokens=3 * 64, rows=3, masked=True, dtype_bytes=4, checkpointing="full", **arch)
