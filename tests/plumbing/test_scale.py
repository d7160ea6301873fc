"""Scale-out (docs/scale-out.md): FSDP2 vs one process (update, grad norm, generation), layout-agnostic
checkpoints both ways, per-rank seeds, config errors. The vLLM backend's tests are in
tests/plumbing/test_vllm.py (pure parts) and test_vllm_engine.py (the real engine). GPU tests are
marked `gpu` and skipped without CUDA."""
import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import update_policy
import fast
import rollout
from test_train import _layout_batch, _layout_cfg
from test_train_run import _free_port
import train as T

from plumbing.benchmarks import REPO
from plumbing.config import load_config
from plumbing.models import load_model
from plumbing.checkpoints import latest_checkpoint, load_trainer_state, save_checkpoint
from plumbing.scale import all_sum, full_state_items, logp_gap, unsharded, wrap_policy
from plumbing import config


CPU = torch.device("cpu")


def _spawn(fn, world, *args):
    """Run fn(rank, world, port, *args) in `world` fresh processes (gloo); assert they all exit 0."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port) + args) for r in range(world)]
    [p.start() for p in procs]
    [p.join(240) for p in procs]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _init(rank, world, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _shard(batch, rank, world):
    per = len(batch["prompt_ids"]) // world
    sl = slice(rank * per, (rank + 1) * per)
    return {k: v[sl] for k, v in batch.items()}


def _flat(model):
    """All parameters as one flat float32 vector (gathered under FSDP2)."""
    return torch.cat([t.float().flatten() for _, t in full_state_items(model)])


# --- layouts: FSDP2 2 ranks x 2 micro-batches == 1 rank x 1 == 1 rank x 4 -------------------------

def _fsdp_layout_worker(rank, world, port, model_path, out):
    _init(rank, world, port)
    results = {}
    for agg, use_fast in (("seq_sum", True), ("token_mean", True), ("seq_sum", False)):
        torch.manual_seed(0)
        policy, tok = load_model(model_path)
        before = _flat(policy)
        # seq_sum with selective activation checkpointing, token_mean without it (each group's
        # prompt runs once either way: two forwards through FSDP2 before one backward): the
        # update must not change with either; and the plain twins under FSDP2 (fast_paths false)
        model = wrap_policy(policy, "fsdp2", world, CPU, gradient_checkpointing="selective" if agg == "seq_sum" else "none")
        assert model is policy and rollout.is_fsdp(policy)
        opt = torch.optim.SGD(policy.parameters(), lr=1.0)  # update = -grad
        upd = update_policy(model, policy, opt, _shard(_layout_batch(), rank, world),
                              _layout_cfg(2, agg, fast_paths=use_fast, parallel="fsdp2"), world=world, device=CPU,
                              pad_id=tok.pad_token_id)
        results[agg if use_fast else agg + " plain"] = {"loss": all_sum(upd["loss"], world),
                                                    "grad_norm": upd["grad_norms"][0], "delta": _flat(policy) - before}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _plain_update(model_path, micro, agg, grad_clip=0.0, fast_paths=True):
    torch.manual_seed(0)
    policy, tok = load_model(model_path)
    before = _flat(policy)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    cfg = _layout_cfg(micro, agg, fast_paths=fast_paths)
    cfg["optim"]["grad_clip"] = grad_clip
    upd = update_policy(policy, policy, opt, _layout_batch(), cfg, world=1, device=CPU, pad_id=tok.pad_token_id)
    return {"loss": upd["loss"], "grad_norm": upd["grad_norms"][0], "delta": _flat(policy) - before}


def test_fsdp2_layout_gives_the_same_update_and_grad_norm(tiny_model_path, tmp_path):
    out = str(tmp_path / "fsdp.pt")
    _spawn(_fsdp_layout_worker, 2, tiny_model_path, out)
    fsdp = torch.load(out)
    for agg in ("seq_sum", "token_mean"):
        ref = _plain_update(tiny_model_path, 8, agg, fast_paths=False)   # 1 rank x 1 micro-batch, plain twins
        acc = _plain_update(tiny_model_path, 2, agg)   # 1 rank x 4 micro-batches
        assert ref["delta"].abs().max() > 1e-4 and ref["grad_norm"] > 1e-3
        runs = [("1x4", acc), ("fsdp2 2x2", fsdp[agg])] + ([("fsdp2 2x2 plain", fsdp[agg + " plain"])]
                                                          if agg + " plain" in fsdp else [])
        for name, r in runs:
            assert r["loss"] == pytest.approx(ref["loss"], abs=1e-5), name
            assert (r["delta"] - ref["delta"]).abs().max().item() < 1e-5, name
            # the norm clip_grad_norm_ returns from DTensor shards is the global one
            assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name


def test_clipping_uses_the_global_norm(tiny_model_path):
    # clipping to half the norm halves the update exactly: the scale is max_norm / global norm
    # (same micro-batching on both sides, so only the clip differs); the norm accumulated over 4
    # micro-batches is the norm of the one-batch gradient
    one = _plain_update(tiny_model_path, 8, "seq_sum")
    full = _plain_update(tiny_model_path, 2, "seq_sum")
    half = _plain_update(tiny_model_path, 2, "seq_sum", grad_clip=full["grad_norm"] / 2)
    assert full["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert half["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    assert (half["delta"] - full["delta"] / 2).abs().max().item() < 1e-6


# --- checkpoints: one process -> FSDP2 -> one process, with optimizer state ------------------------

def _adam_step(model, policy, opt, batch, world, pad_id):
    cfg = _layout_cfg(2, "seq_sum")
    update_policy(model, policy, opt, batch, cfg, world=world, device=CPU, pad_id=pad_id)


def _make_opt(policy):
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.01, fused=True)  # as train.py
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def _resume_and_step(ckpt, rank, world):
    """Load the step-1 checkpoint `ckpt` under FSDP2 on this rank and take one AdamW step on its
    shard of the layout batch; returns (model, policy, tok, opt, sched)."""
    policy, tok = load_model(ckpt)
    model = wrap_policy(policy, "fsdp2", world, CPU)
    opt, sched = _make_opt(policy)
    assert load_trainer_state(ckpt, policy, opt, sched) == 1
    _adam_step(model, policy, opt, _shard(_layout_batch(), rank, world), world, tok.pad_token_id)
    return model, policy, tok, opt, sched


def _fsdp_ckpt_worker(rank, world, port, ckpt_in, out_dir, gen_out):
    _init(rank, world, port)
    model, policy, tok, opt, sched = _resume_and_step(ckpt_in, rank, world)
    sched.step()
    save_checkpoint(out_dir, 2, policy, tok, opt, sched, keep=2, rank=rank)
    # Generation under FSDP2: ranks run different numbers of forwards (max_new_tokens 3 vs 7);
    # with per-layer all-gathers this would deadlock, unsharded() gathers once.
    prompts = [[1, 50, 60, 70], [1, 80]] if rank == 0 else [[1, 90, 91]]
    with unsharded(model):
        r = fast.generate(policy, tok, prompts, 2, 3 if rank == 0 else 7, seed=T.sampling_seed(0, 2, rank))
    from torch.distributed.tensor import DTensor
    assert all(isinstance(p, DTensor) for p in policy.parameters())  # sharded again afterwards
    gathered = [None] * world
    dist.all_gather_object(gathered, {"prompts": prompts, "ids": r["completion_ids"], "rank": rank})
    pushed = dict(full_state_items(policy))  # what a vLLM weight push would send
    if rank == 0:
        torch.save({"gen": gathered, "pushed": pushed}, gen_out)
    dist.destroy_process_group()


def test_checkpoint_round_trip_single_fsdp2_single(tiny_model_path, tmp_path):
    batch = _layout_batch()
    # reference: one process, three AdamW steps, checkpoint after the first
    policy, tok = load_model(tiny_model_path)
    opt, sched = _make_opt(policy)
    _adam_step(policy, policy, opt, batch, 1, tok.pad_token_id)
    sched.step()
    save_checkpoint(str(tmp_path / "a"), 1, policy, tok, opt, sched, keep=2)
    _adam_step(policy, policy, opt, batch, 1, tok.pad_token_id)
    sched.step()
    p2 = _flat(policy)
    _adam_step(policy, policy, opt, batch, 1, tok.pad_token_id)
    p3 = _flat(policy)

    # step 2 on 2 FSDP2 ranks from the one-process checkpoint, then an FSDP2 checkpoint
    ckpt_a = latest_checkpoint(str(tmp_path / "a"))
    gen_out = str(tmp_path / "gen.pt")
    _spawn(_fsdp_ckpt_worker, 2, ckpt_a, str(tmp_path / "b"), gen_out)
    ckpt_b = latest_checkpoint(str(tmp_path / "b"))
    assert ckpt_b.endswith("step_000002")

    # the FSDP2 checkpoint is a plain HF folder with the same weights as the reference
    resumed, _ = load_model(ckpt_b)
    assert (_flat(resumed) - p2).abs().max().item() < 1e-5
    # ... and its optimizer state resumes step 3 in one process exactly
    opt_r, sched_r = _make_opt(resumed)
    assert load_trainer_state(ckpt_b, resumed, opt_r, sched_r) == 2
    assert sched_r.last_epoch == 2
    _adam_step(resumed, resumed, opt_r, batch, 1, tok.pad_token_id)
    assert (_flat(resumed) - p3).abs().max().item() < 1e-5
    # the test can fail: without the optimizer state step 3 lands elsewhere
    fresh, _ = load_model(ckpt_b)
    opt_f, _ = _make_opt(fresh)
    _adam_step(fresh, fresh, opt_f, batch, 1, tok.pad_token_id)
    assert (_flat(fresh) - p3).abs().max().item() > 1e-4

    # generation under FSDP2 == one-process generation with the same weights and seeds
    saved = torch.load(gen_out)
    single, _ = load_model(ckpt_b)
    for part in saved["gen"]:
        r = fast.generate(single, tok, part["prompts"], 2, 3 if part["rank"] == 0 else 7,
                             seed=T.sampling_seed(0, 2, part["rank"]))
        assert torch.equal(r["completion_ids"], part["ids"])
    # the tensors a vLLM weight push sends are the full, current weights
    sd = single.state_dict()
    assert set(saved["pushed"]) == set(sd)
    assert max((saved["pushed"][k] - sd[k]).abs().max().item() for k in sd) < 1e-6


# --- per-rank seeds (docs/scale-out.md) ---------------------------------------------------------------------

def test_sampling_seeds_distinct_per_rank_and_step(tiny_model_path):
    seeds = {T.sampling_seed(3, step, rank) for step in range(2000) for rank in range(64)}
    assert len(seeds) == 2000 * 64
    assert T.sampling_seed(0, 5, 1) == 5 * 10_007 + 1  # resume: a pure function of (seed, step, rank)
    model, tok = load_model(tiny_model_path)
    prompt = [[1, 50, 60, 70]]
    a = fast.generate(model, tok, prompt, 4, 6, seed=T.sampling_seed(0, 0, 0))["completion_ids"]
    b = fast.generate(model, tok, prompt, 4, 6, seed=T.sampling_seed(0, 0, 1))["completion_ids"]
    again = fast.generate(model, tok, prompt, 4, 6, seed=T.sampling_seed(0, 0, 0))["completion_ids"]
    assert torch.equal(a, again) and not torch.equal(a, b)


# --- config errors (docs/method.md §3) ----------------------------------------------------------------------

@pytest.mark.parametrize("overrides, device, message", [
    (["train.cpu_offload=true", "train.parallel=ddp"], "cpu", "config key train.cpu_offload=true needs train.parallel=fsdp2"),
    (["train.cpu_offload=true", "train.parallel=fsdp2"], "cpu", "config key train.cpu_offload=true needs a CUDA device"),
    (["train.fsdp_reduce_every_micro_batch=true", "train.parallel=ddp"], "cpu",
     "config key train.fsdp_reduce_every_micro_batch=true needs train.parallel=fsdp2"),
    (["train.fsdp_reduce_every_micro_batch=1"], "cpu", "config key train.fsdp_reduce_every_micro_batch: expected bool, got 1"),
])
def test_scale_config_errors_are_one_line(overrides, device, message):
    with pytest.raises(SystemExit) as e:
        config.check_scale_config(load_config([], overrides), torch.device(device))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_scale_config_ok_on_cpu():
    config.check_scale_config(load_config([], ["train.parallel=fsdp2", "rollout.backend=hf"]), CPU)  # no exception


def test_logp_gap():
    trainer = [torch.tensor([-1.0, -2.0, -3.0, 9.0]), torch.tensor([-0.5, 7.0]), torch.tensor([5.0])]
    engine = torch.tensor([[-1.1, -2.0, -2.5], [-0.25, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    total, count, worst = logp_gap(trainer, engine, mask)
    assert count == 4 and total == pytest.approx(0.1 + 0.0 + 0.5 + 0.25) and worst == pytest.approx(0.5)


# --- GPU (skipped here: no CUDA) ------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_fsdp2_bf16_mixed_precision_step(tiny_model_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", 0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    policy, tok = load_model(tiny_model_path, "float32", dev)
    wrap_policy(policy, "fsdp2", 1, dev, dtype="bfloat16")
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    upd = update_policy(policy, policy, opt, _layout_batch(), _layout_cfg(2, "seq_sum"), world=1, device=dev,
                          pad_id=tok.pad_token_id)
    ref = _plain_update(tiny_model_path, 8, "seq_sum")
    assert next(policy.parameters()).dtype == torch.float32  # master weights stay float32
    assert upd["grad_norms"][0] == pytest.approx(ref["grad_norm"], rel=2e-2)  # bf16 compute


# --- end to end: the real loop under torchrun, FSDP2 vs DDP, resumed in one process ---------------

@pytest.mark.slow
def test_torchrun_fsdp2_matches_ddp_and_resumes_in_one_process(tiny_model_path, tmp_path):
    from test_e2e import check_run_dir, small_args, torchrun
    ddp, fsdp = str(tmp_path / "ddp"), str(tmp_path / "fsdp2")
    # both with activation checkpointing and through the plain twins (train.fast_paths=false):
    # AdamW turns float32-noise-sized gradient differences on near-zero gradients into lr-sized
    # steps, so two different (equally right) paths would not agree to 1e-4 after an update
    gc = ["model.gradient_checkpointing=full", "train.fast_paths=false"]
    torchrun(2, small_args(tiny_model_path, ddp, steps=2, extra=gc))
    torchrun(2, small_args(tiny_model_path, fsdp, steps=2, extra=["train.parallel=fsdp2"] + gc))
    m_d, s_d = check_run_dir(ddp, 2, n_samples=4)
    m_f, s_f = check_run_dir(fsdp, 2, n_samples=4)
    # same seeds and the same update: the same samples, rewards, losses and gradient norms
    assert [s["completion"] for s in s_d] == [s["completion"] for s in s_f]
    for a, b in zip(m_d, m_f):
        for k in ("reward/mean", "loss", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    # both checkpoints resume in ONE process (layout-agnostic) and give the same third step
    for out in (ddp, fsdp):
        torchrun(1, small_args(tiny_model_path, out, steps=3))
    m_d, _ = check_run_dir(ddp, 3, n_samples=4)
    m_f, _ = check_run_dir(fsdp, 3, n_samples=4)
    for k in ("reward/mean", "loss", "grad_norm"):
        assert m_d[2][k] == pytest.approx(m_f[2][k], rel=1e-4, abs=1e-6), k


# --- sharded checkpoints (docs/scale-out.md "Checkpoints"): saved on 2 ranks, resumed on 1 and on 4 ---

def _full_state(policy, opt):
    """(flat float32 weights, full optimizer state dict on the CPU): collectives under FSDP2;
    rank 0 gets the optimizer state (cpu_offload keeps it off the other ranks). Copies: the state
    dict's replicated tensors (AdamW's `step`) are the optimizer's own, which the next step changes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.utils._pytree import tree_map_only
    options = StateDictOptions(full_state_dict=True, cpu_offload=rollout.is_fsdp(policy))
    return _flat(policy), tree_map_only(torch.Tensor, torch.clone, get_optimizer_state_dict(policy, opt, options=options))


def _dcp_save_worker(rank, world, port, model_path, out_dir, out):
    """2 FSDP2 ranks: two AdamW steps uninterrupted (out: the weights after step 2), then from the
    start again: one step, its checkpoint (step_000001) and the full state it holds (out.saved)."""
    _init(rank, world, port)
    saved = {}
    for interrupted in (False, True):
        policy, tok = load_model(model_path)
        model = wrap_policy(policy, "fsdp2", world, CPU)
        opt, sched = _make_opt(policy)
        _adam_step(model, policy, opt, _shard(_layout_batch(), rank, world), world, tok.pad_token_id)
        sched.step()
        if interrupted:
            save_checkpoint(out_dir, 1, policy, tok, opt, sched, keep=2, rank=rank)
            saved["saved"] = _full_state(policy, opt)
        else:
            _adam_step(model, policy, opt, _shard(_layout_batch(), rank, world), world, tok.pad_token_id)
            saved["p2"] = _flat(policy)
    if rank == 0:
        torch.save(saved, out)
    dist.destroy_process_group()


def _dcp_resume_worker(rank, world, port, ckpt, out):
    """Resume step_000001 on `world` FSDP2 ranks: the state as loaded, and the weights after step 2."""
    _init(rank, world, port)
    policy, tok = load_model(ckpt)
    model = wrap_policy(policy, "fsdp2", world, CPU)
    opt, sched = _make_opt(policy)
    assert load_trainer_state(ckpt, policy, opt, sched) == 1
    loaded = _full_state(policy, opt)
    _adam_step(model, policy, opt, _shard(_layout_batch(), rank, world), world, tok.pad_token_id)
    flat = _flat(policy)
    if rank == 0:
        torch.save({"loaded": loaded, "p2": flat}, out)
    dist.destroy_process_group()


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread inside the block (as _init's ranks), the previous count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _same_state(a, b):
    """Two _full_state results hold the same bits: weights, AdamW moments and step counts."""
    (pa, oa), (pb, ob) = a, b
    assert torch.equal(pa, pb)
    assert oa["state"].keys() == ob["state"].keys()
    for name, s in oa["state"].items():
        for k, t in s.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(ob["state"][name][k])), (name, k)


def reduction_order_tolerance(p, g, abs_terms, exp_avg, exp_avg_sq, step, lr, betas, eps, n_terms):
    """Per-weight bound on |p_A - p_B| after one AdamW step from the same state, when A and B sum
    the same `n_terms` float32 gradient terms (one per micro-batch) in different orders (one
    process: ((t1 + t2) + t3) + t4; 2 FSDP2 ranks: (t1 + t2) + (t3 + t4) in the reduce-scatter;
    4 ranks: gloo's ring order). Everything else in the step is the same bits on both sides: the
    micro-batches are the same rows on the same number of CPU threads (one), each term's loss scale
    world / normaliser is a power of two, as is FSDP2's division by the world size (2, 4), so
    scaling is exact (a world of 3 would round there too).

    1. Gradient (Higham, Accuracy and Stability of Numerical Algorithms, Eq. 4.4): any order of a
       float32 sum of n terms is within gamma_{n-1} * sum_k |t_k| of the exact sum,
       gamma_k = k u / (1 - k u), u = 2^-24; two orders differ by at most
       delta = 2 gamma_{n-1} sum_k |t_k|  (a tree of depth log2(n) gives gamma_{log2 n}; we do not
       assume gloo's order). Relative to |g| this is large where the terms cancel.
    2. AdamW (decoupled weight decay is the same multiply on both sides) moves a weight by
       f(g) = (lr / bc1) m / (s + eps), m = b1 m1 + (1 - b1) g, s = sqrt((b2 v1 + (1 - b2) g^2) / bc2),
       bc_i = 1 - b_i^t, so |f(g_A) - f(g_B)| <= delta * max |f'| over [g - delta, g + delta], with
       f'(g) = (lr / bc1) [(1 - b1) / (s + eps) - m / (s + eps)^2 * ds/dg] and
       |ds/dg| = (1 - b2) |g| / (bc2 s) <= sqrt((1 - b2) / bc2)   (as s >= sqrt((1 - b2) / bc2) |g|), so
       |f'| <= (lr / bc1) [(1 - b1) / (s_min + eps) + |m|_max sqrt((1 - b2) / bc2) / (s_min + eps)^2]
       with s_min at |g| - delta. This is Adam's amplification: where v is small (s ~ eps = 1e-8) an
       absolute gradient error of ~1e-15 moves the weight by ~lr * 1e-7, and a gradient that is
       a cancellation of terms (sum |t| >> |g|) carries a large absolute error.
    3. Plus 4 float32 ulps of the weight and of the step: the AdamW arithmetic and the store (a
       fused kernel may take its vector or its scalar path on a sharded vs a full tensor).

    All tensors float32 of one shape (p: the weight after the step, g: the summed gradient,
    abs_terms: sum_k |t_k|, exp_avg / exp_avg_sq: m1 / v1 before the step, t = step after it).
    Returns a float64 tensor of that shape."""
    u = 2.0 ** -24
    gamma = (n_terms - 1) * u / (1 - (n_terms - 1) * u)
    p, g, a, m1, v1 = (x.double() for x in (p, g, abs_terms, exp_avg, exp_avg_sq))
    b1, b2 = betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    delta = 2 * gamma * a
    g_min = (g.abs() - delta).clamp(min=0)
    s_min = ((b2 * v1 + (1 - b2) * g_min ** 2) / bc2).sqrt()
    m_max = b1 * m1.abs() + (1 - b1) * (g.abs() + delta)
    slope = lr / bc1 * ((1 - b1) / (s_min + eps) + m_max * math.sqrt((1 - b2) / bc2) / (s_min + eps) ** 2)
    m = b1 * m1 + (1 - b1) * g
    step_size = lr / bc1 * m.abs() / (((b2 * v1 + (1 - b2) * g ** 2) / bc2).sqrt() + eps)
    ulp = torch.finfo(torch.float32).eps
    return delta * slope + 4 * ulp * (p.abs() + step_size)


def test_a_checkpoint_saved_on_2_ranks_resumes_exactly_on_1_and_on_4(tiny_model_path, tmp_path):
    """The AdamW state is written by every rank (torch.distributed.checkpoint: one .distcp file per
    rank, nothing gathered on rank 0) and read back resharded, bit for bit, on 1, 2 and 4 ranks.
    On 2 ranks (the world that wrote it) step 2 after the resume IS the uninterrupted run's step 2
    (torch.equal). On 1 and 4 ranks the only difference left is the order in which the four
    micro-batch gradients are summed: step 2 stays within reduction_order_tolerance of it, a bound
    derived weight by weight from the gradient terms and the AdamW state (its docstring)."""
    import json, os
    batch = _layout_batch()
    out = str(tmp_path / "two.pt")
    _spawn(_dcp_save_worker, 2, tiny_model_path, str(tmp_path / "run"), out)
    two = torch.load(out, weights_only=False)
    ckpt = latest_checkpoint(str(tmp_path / "run"))
    assert ckpt.endswith("step_000001") and not os.path.exists(ckpt + ".tmp")
    files = sorted(os.listdir(os.path.join(ckpt, "optimizer")))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files  # each rank wrote its own shard
    assert all(os.path.getsize(os.path.join(ckpt, "optimizer", f)) > 1000 for f in files[1:])
    assert "optimizer" not in torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    with open(os.path.join(ckpt, "complete.json")) as f:
        assert json.load(f)["world_size"] == 2

    # 2 ranks, the world that wrote it: resumed == uninterrupted, bit for bit
    _spawn(_dcp_resume_worker, 2, ckpt, str(tmp_path / "resumed2.pt"))
    resumed2 = torch.load(tmp_path / "resumed2.pt", weights_only=False)
    _same_state(resumed2["loaded"], two["saved"])
    assert torch.equal(resumed2["p2"], two["p2"])

    # 1 rank: the plain one-process path (no FSDP2, no process group); the state loads bit for bit
    one, tok = load_model(ckpt)
    opt1, sched1 = _make_opt(one)
    assert load_trainer_state(ckpt, one, opt1, sched1) == 1 and sched1.last_epoch == 1
    _same_state(_full_state(one, opt1), two["saved"])
    # step 2, recording sum_k |t_k| of each weight's micro-batch gradient terms and the summed gradient,
    # on one thread as the ranks: torch's CPU reductions and MKL's sgemm split their sums over threads,
    # so the thread count changes the order of the sums INSIDE each micro-batch's backward, which the
    # bound does not count (with this process's 2 threads, AMD EPYC: 4-ulp differences on weights
    # whose gradient terms do not cancel at all)
    with one_thread():
        params = list(one.parameters())
        abs_terms = [torch.zeros_like(p) for p in params]

        def record(i):
            def hook(g):  # once per backward (micro-batch) with its term; returns None: the gradient unchanged
                abs_terms[i].add_(g.abs())
            return hook
        hooks = [p.register_hook(record(i)) for i, p in enumerate(params)]
        before = [(opt1.state[p]["exp_avg"].clone(), opt1.state[p]["exp_avg_sq"].clone()) for p in params]
        grads, group = [], dict(opt1.param_groups[0])
        opt1.register_step_pre_hook(lambda o, a, k: grads.extend(p.grad.clone() for p in params))
        _adam_step(one, one, opt1, batch, 1, tok.pad_token_id)
        [h.remove() for h in hooks]
        bound = [reduction_order_tolerance(p.detach(), grads[i], abs_terms[i], *before[i], step=2, lr=group["lr"],
                                           betas=group["betas"], eps=group["eps"], n_terms=4) for i, p in enumerate(params)]
        index = {id(p): i for i, p in enumerate(params)}  # _flat's order: the state dict's (a tied weight twice)
        tol = torch.cat([bound[index[id(p)]].flatten()
                         for p in dict(one.named_parameters(remove_duplicate=False)).values()])
    assert len(tol) == len(two["p2"])
    diff1 = (_flat(one) - two["p2"]).abs().double()
    assert (diff1 <= tol).all(), (diff1 - tol).max().item()
    # 4 FSDP2 ranks, 2 rows each: the same state, then the same bound
    _spawn(_dcp_resume_worker, 4, ckpt, str(tmp_path / "four.pt"))
    four = torch.load(tmp_path / "four.pt", weights_only=False)
    _same_state(four["loaded"], two["saved"])
    diff4 = (four["p2"] - two["p2"]).abs().double()
    assert (diff4 <= tol).all(), (diff4 - tol).max().item()
    # the test can fail: without the optimizer state step 2 lands far outside the bound
    fresh, _ = load_model(ckpt)
    opt_f, _ = _make_opt(fresh)
    _adam_step(fresh, fresh, opt_f, batch, 1, tok.pad_token_id)
    assert ((_flat(fresh) - two["p2"]).abs() > tol).float().mean() > 0.5
    print(f"step 2 vs the uninterrupted 2-rank run: 1 rank {diff1.max():.3g}, 4 ranks {diff4.max():.3g}; "
          f"bound: max {tol.max():.3g}, median {tol.median():.3g}; worst use of it {(diff1 / tol).max():.3f}, "
          f"{(diff4 / tol).max():.3f}")


def test_only_checkpoints_with_their_marker_resume(tiny_model_path, tmp_path):
    """A step folder whose marker (complete.json, written last, after every rank's shards) is
    missing is never resumed from, even with trainer_state.pt and optimizer/ in it; a checkpoint
    from before sharded checkpoints (trainer_state.pt holding the full optimizer dict, no
    optimizer/) still is, and loads."""
    import os, shutil
    policy, tok = load_model(tiny_model_path)
    opt, sched = _make_opt(policy)
    _adam_step(policy, policy, opt, _layout_batch(), 1, tok.pad_token_id)
    sched.step()
    out = str(tmp_path / "run")
    save_checkpoint(out, 1, policy, tok, opt, sched, keep=3)
    save_checkpoint(out, 2, policy, tok, opt, sched, keep=3)
    os.remove(os.path.join(out, "checkpoints", "step_000002", "complete.json"))  # as if copied half
    assert latest_checkpoint(out).endswith("step_000001")
    # the old format: the full name-keyed optimizer dict inside trainer_state.pt
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    old = os.path.join(out, "checkpoints", "step_000003")
    shutil.copytree(os.path.join(out, "checkpoints", "step_000001"), old)
    shutil.rmtree(os.path.join(old, "optimizer"))
    os.remove(os.path.join(old, "complete.json"))
    full = get_optimizer_state_dict(policy, opt, options=StateDictOptions(full_state_dict=True))
    torch.save({"step": 1, "optimizer": full, "scheduler": sched.state_dict(), "scaler": None},
               os.path.join(old, "trainer_state.pt"))
    assert latest_checkpoint(out) == old
    again, _ = load_model(old)
    opt2, sched2 = _make_opt(again)
    assert load_trainer_state(old, again, opt2, sched2) == 1
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


# --- issue 26: reduce-scatter every micro-batch; the FSDP2-sharded GRPO reference -----------------

def _reduce_every_worker(rank, world, port, model_path, out):
    from conftest import frozen_logprobs
    from plumbing.scale import grad_sync, shard_frozen
    _init(rank, world, port)
    results = {}
    for every in (False, True):
        torch.manual_seed(0)
        policy, tok = load_model(model_path)
        before = _flat(policy)
        model = wrap_policy(policy, "fsdp2", world, CPU, reduce_every_micro_batch=every)
        opt = torch.optim.SGD(policy.parameters(), lr=1.0)  # update = -grad
        # 4 rows a rank in micro-batches of 2: two micro-batches, one unsynced
        upd = update_policy(model, policy, opt, _shard(_layout_batch(), rank, world), _layout_cfg(2, "seq_sum", parallel="fsdp2"),
                            world=world, device=CPU, pad_id=tok.pad_token_id)
        # after one unsynced micro-batch: the sharded .grad exists only when every micro-batch reduce-scatters
        # (otherwise FSDP2 holds the unsharded accumulator and .grad stays None until the synced one)
        opt.zero_grad(set_to_none=True)
        with grad_sync(model, world, sync=False):
            model(input_ids=torch.arange(1, 9)[None], labels=torch.arange(1, 9)[None]).loss.backward()
        grads = [p.grad is not None for p in policy.parameters()]
        results[every] = {"delta": _flat(policy) - before, "grad_norm": upd["grad_norms"][0], "has_grad": grads}
        model.set_requires_gradient_sync(True)
    # the frozen reference: its log-probs, unsharded and FSDP2-sharded, on this rank's rows
    cfg = _layout_cfg(2, "seq_sum", parallel="fsdp2")
    batch = _shard(_layout_batch(), rank, world)
    ref, tok = load_model(model_path)
    ref.eval().requires_grad_(False)
    full = frozen_logprobs(ref, batch, tok.pad_token_id, cfg, CPU)
    n_full = sum(p.numel() for p in ref.parameters())
    ref = shard_frozen(ref, world, CPU)
    local = sum(p.to_local().numel() for p in ref.parameters())
    sharded = frozen_logprobs(ref, batch, tok.pad_token_id, cfg, CPU)
    results["ref"] = {"full": full, "sharded": sharded, "local": local, "n_full": n_full,
                      "requires_grad": any(p.requires_grad for p in ref.parameters())}
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_reduce_every_micro_batch_and_sharded_reference_on_2_gloo_ranks(tiny_model_path, tmp_path):
    """Issue 26: (1) train.fsdp_reduce_every_micro_batch (plumbing/scale.py grad_sync) gives the
    accumulate-then-reduce update (2 ranks x 2 micro-batches, SGD lr 1: delta = -grad) within float32
    summation order, and keeps a sharded .grad after an unsynced micro-batch (the unsharded float32
    accumulator is what it saves); (2) the FSDP2-sharded GRPO reference (shard_frozen) holds about
    1/2 of the weights a rank and gives the unsharded model's log-probs."""
    out = str(tmp_path / "every")
    _spawn(_reduce_every_worker, 2, tiny_model_path, out)
    for rank in (0, 1):
        r = torch.load(f"{out}.{rank}")
        acc, every = r[False], r[True]
        assert acc["delta"].abs().max() > 1e-4
        assert (every["delta"] - acc["delta"]).abs().max().item() < 1e-6
        assert every["grad_norm"] == pytest.approx(acc["grad_norm"], rel=1e-5)
        assert all(every["has_grad"]) and not any(acc["has_grad"])
        ref = r["ref"]
        assert not ref["requires_grad"] and ref["local"] <= ref["n_full"] // 2 + 64 * 64  # dim-0 chunks: about half
        for a, b in zip(ref["full"], ref["sharded"]):
            assert a.abs().sum() > 0 and torch.allclose(a, b, atol=1e-6, rtol=0), (a, b)


# --- issue 34.5: the policy's FSDP2 root resharded after a no-grad forward ------------------------

def _root_reshard_worker(rank, world, port, model_path, out):
    from torch.distributed.tensor import DTensor
    from conftest import frozen_logprobs
    _init(rank, world, port)
    policy, tok = load_model(model_path)
    plain = load_model(model_path)[0].eval()
    model = wrap_policy(policy, "fsdp2", world, CPU)

    def gathered():  # parameters registered as full tensors, not as this rank's shards
        return sorted(n for n, p in policy.named_parameters() if not isinstance(p, DTensor))
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    seen = {}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    seen["no_grad"] = gathered()
    batch = _shard(_layout_batch(), rank, world)
    lp = frozen_logprobs(model, batch, tok.pad_token_id, _layout_cfg(2, "seq_sum", parallel="fsdp2"), CPU)
    seen["frozen_logprobs"] = gathered()  # the behaviour pass (train.frozen_logprobs)
    with unsharded(model):  # generation: everything stays gathered across forwards, no all-gather per step
        with torch.no_grad():
            model(input_ids=ids)
            model(input_ids=ids)
        seen["unsharded"] = gathered()
    seen["after_unsharded"] = gathered()
    loss = model(input_ids=ids, labels=ids).loss  # training: FSDP2 keeps the root gathered for backward
    seen["grad_forward"] = gathered()
    loss.backward()
    seen["backward"] = gathered()
    with torch.no_grad():
        plain_logits = plain(input_ids=ids).logits
    seen["same_logits"] = torch.equal(logits, plain_logits)
    seen["all"] = sorted(n for n, _ in policy.named_parameters())
    seen["lp"] = [x.abs().sum().item() for x in lp]
    torch.save(seen, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_root_is_resharded_after_a_no_grad_forward(tiny_model_path, tmp_path):
    """Issue 34.5: FSDP2 keeps the root's parameters (embedding, final norm, LM head: 2.03 GiB at
    7B in bf16) gathered after its forward, for the backward that follows a training forward. A
    no-grad forward (the behaviour pass, evaluators, a validation) has no backward, so they stayed
    gathered until the next training step; wrap_policy's hook reshards them. Inside unsharded() they
    stay gathered (generation's forwards do not all-gather); a training forward still keeps them
    for its backward, which reshards them."""
    out = str(tmp_path / "root")
    _spawn(_root_reshard_worker, 2, tiny_model_path, out)
    for rank in (0, 1):
        seen = torch.load(f"{out}.{rank}")
        root = ["model.embed_tokens.weight", "model.norm.weight"]  # lm_head is tied to the embedding
        assert seen["no_grad"] == [] and seen["frozen_logprobs"] == [] and all(seen["lp"])
        assert seen["unsharded"] == seen["all"] and seen["after_unsharded"] == []
        assert seen["grad_forward"] == root and seen["backward"] == []
        assert seen["same_logits"]


# --- issue 34.4: models built on the meta device, sharded, then rank 0's weights ------------------

def _record_reads(reads):
    """Every from_pretrained of a model (any Auto class ends there) appends (class, path) to `reads`."""
    from transformers import PreTrainedModel
    real = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        reads.append((cls.__name__, str(path)))
        return real(cls, path, *args, **kwargs)
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _vm(field):
    """This process's VmRSS / VmHWM (peak) in bytes, from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _full_copy(model):
    """(state dict, buffers) of `model` as full CPU tensors (a collective under FSDP2; rank 0 gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rollout.is_fsdp(model)))
    return sd, {n: b.clone() for n, b in model.named_buffers()}


def _sharded_load_worker(rank, world, port, model_path, big_path, out):
    import functools
    from plumbing.metarm_setup import load_metarm
    from plumbing.scale import shard_frozen
    from plumbing.sharded_load import load_sharded_model
    from torch.distributed.tensor import DTensor
    _init(rank, world, port)
    reads, seen = [], {}
    _record_reads(reads)
    wrap = functools.partial(wrap_policy, parallel="fsdp2", world=world, device=CPU)
    policy, tok = load_sharded_model(lambda: load_model(model_path, "float32", "cpu"), wrap, device=CPU,
                                     rank=rank, world=world)
    ref, _ = load_sharded_model(lambda: load_model(model_path, "bfloat16", "cpu"),
                                lambda m: shard_frozen(m.eval(), world, CPU), device=CPU, rank=rank, world=world)
    torch.manual_seed(0)  # the MetaRM's fresh head is random: rank 0 draws it
    mrm = load_metarm(model_path, parallel="fsdp2", rank=rank, world=world)
    seen["reads"] = list(reads)
    seen["sharded"] = all(isinstance(p, DTensor) for m in (policy, ref, mrm["model"]) for p in m.parameters())
    seen["ref_frozen"] = not any(p.requires_grad for p in ref.parameters())
    seen["local"] = sum(p.to_local().numel() for p in policy.parameters())
    seen["tok"] = (tok.pad_token_id, tok.padding_side, mrm["tokenizer"].padding_side, mrm["tokenizer"].truncation_side)
    seen["modes"] = (policy.training, ref.training, mrm["model"].training)
    copies = {"policy": _full_copy(policy), "ref": _full_copy(ref), "metarm": _full_copy(mrm["model"])}
    seen["config"] = {"policy": policy.config.to_dict(), "generation": policy.generation_config.to_dict(),
                      "metarm": mrm["model"].config.to_dict()}
    # a path rank 0 cannot read stops every rank with one line, none waits in a collective
    try:
        load_sharded_model(lambda: load_model(str(big_path) + "-missing"), wrap, device=CPU, rank=rank, world=world)
    except SystemExit as e:
        seen["bad_path"] = e.code
    # peak host memory of a load (VmHWM reset first), on a model 25x the largest of its tensors
    del policy, ref, mrm
    import gc
    gc.collect()
    dist.barrier()
    start = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: VmHWM (the peak RSS) := the current RSS
    big, _ = load_sharded_model(lambda: load_model(big_path, "float32", "cpu"), wrap, device=CPU, rank=rank, world=world)
    seen["peak"] = _vm("VmHWM") - start
    seen["big_local_bytes"] = sum(p.to_local().numel() * 4 for p in big.parameters())
    torch.save({"seen": seen, "copies": copies if rank == 0 else None}, f"{out}.{rank}")
    dist.destroy_process_group()


def _write_big_model(path, tokenizer_from):
    """A random Llama of 8 layers, hidden 512, vocabulary 1024 (27M float32 parameters, 108 MB; its
    largest tensor 3 MB) with the tiny model's tokenizer files; returns (path, its bytes)."""
    import shutil
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_from):
        if "token" in name or name == "special_tokens_map.json":
            shutil.copy(os.path.join(tokenizer_from, name), path)
    return str(path), sum(p.numel() * 4 for p in model.parameters())


def test_models_load_into_shards_from_rank_0(tiny_model_path, tmp_path):
    """Issue 34.4 (plumbing/sharded_load.py): under FSDP2 the policy (float32), the GRPO reference
    (bf16, shard_frozen) and the MetaRM (load_metarm) are built on the meta device, sharded, then
    filled from rank 0: only rank 0 reads a checkpoint, the weights, buffers and configs equal a
    one-process load exactly (the MetaRM's random head: rank 0's), and the peak host memory of a
    load on rank 1 is its shards plus one tensor in flight, well under the model, while rank 0's
    is the model."""
    big_path, big_bytes = _write_big_model(tmp_path / "big", tiny_model_path)
    out = str(tmp_path / "load")
    _spawn(_sharded_load_worker, 2, tiny_model_path, big_path, out)
    r0, r1 = (torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1))
    s0, s1 = r0["seen"], r1["seen"]
    names = ["LlamaForCausalLM", "LlamaForCausalLM", "LlamaForSequenceClassification"]
    assert [c for c, _ in s0["reads"]] == names and s1["reads"] == []  # rank 1 read no model
    for s in (s0, s1):
        assert s["sharded"] and s["ref_frozen"] and s["bad_path"] is not None
        assert s["tok"] == (2, "left", "right", "left") and s["modes"] == (False, False, False)
    assert s0["bad_path"] != 1 and "does not exist" in str(s0["bad_path"]) and s1["bad_path"] == 1
    # exactly the one-process loads
    plain, _ = load_model(tiny_model_path)
    plain_ref, _ = load_model(tiny_model_path, "bfloat16")
    torch.manual_seed(0)
    from plumbing.metarm_setup import load_metarm
    plain_mrm = load_metarm(tiny_model_path)["model"]
    for name, model in (("policy", plain), ("ref", plain_ref), ("metarm", plain_mrm)):
        sd, bufs = r0["copies"][name]
        want_sd, want_bufs = _full_copy(model)
        assert sd.keys() == want_sd.keys() and bufs.keys() == want_bufs.keys() and bufs, name
        for k in want_sd:
            assert sd[k].dtype == want_sd[k].dtype and torch.equal(sd[k], want_sd[k]), (name, k)
        for k in want_bufs:
            assert torch.equal(bufs[k], want_bufs[k]), (name, k)
    assert s0["config"]["policy"] == plain.config.to_dict()
    assert s0["config"]["generation"] == plain.generation_config.to_dict()
    assert s0["config"]["metarm"] == plain_mrm.config.to_dict()
    assert s1["config"] == s0["config"]
    # host memory: rank 1 never holds the model, rank 0 does (the measure sees a full copy)
    n_full = sum(p.numel() for p in plain.parameters())
    assert s1["local"] <= n_full // 2 + 64 * 64
    assert s1["big_local_bytes"] <= 0.55 * big_bytes
    assert s1["peak"] < 0.75 * big_bytes, (s1["peak"], big_bytes)
    assert s0["peak"] > big_bytes, (s0["peak"], big_bytes)
    print(f"peak host memory of the load over its start: rank 0 {s0['peak'] / 2**20:.0f} MiB, rank 1 "
          f"{s1['peak'] / 2**20:.0f} MiB; the model {big_bytes / 2**20:.0f} MiB, a shard {s1['big_local_bytes'] / 2**20:.0f} MiB")


def _setup_worker(rank, world, port, args, out):
    import plumbing.run as run
    from torch.distributed.tensor import DTensor
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    reads = []
    _record_reads(reads)
    state = run.setup(load_config(args[:1], args[1:]), T.fast_or_plain(True))
    sharded = all(isinstance(p, DTensor) for m in (state["policy"], state["ref_model"]) for p in m.parameters())
    torch.save({"reads": reads, "sharded": sharded, "same": state["model"] is state["policy"]}, f"{out}.{rank}")
    if state.get("lock"):
        state["lock"].close()
    dist.destroy_process_group()


def test_setup_under_fsdp2_reads_the_models_on_rank_0_only(tiny_model_path, tmp_path):
    """plumbing.run.setup under train.parallel fsdp2 (GRPO with its KL reference): rank 1 reads no
    model; the policy and the reference come out sharded (plumbing/sharded_load.py). Before: every
    rank read both in full, then sharded them."""
    from conftest import data_path
    args = [os.path.join(REPO, "configs", "cpu.yaml"), f"model.policy={tiny_model_path}",
            f"run.out_dir={tmp_path / 'run'}", f"data.train={data_path('gsm8k', 'train.jsonl')}", "train.parallel=fsdp2",
            "algo.loss=grpo", "algo.kl_coef=0.01", "rollout.prompts_per_step=2", "rollout.group_size=2"]
    out = str(tmp_path / "setup")
    _spawn(_setup_worker, 2, args, out)
    r0, r1 = (torch.load(f"{out}.{r}") for r in (0, 1))
    assert [c for c, _ in r0["reads"]] == ["LlamaForCausalLM", "LlamaForCausalLM"] and r1["reads"] == []
    assert r0["sharded"] and r1["sharded"] and r0["same"]


# --- issue 34.6: checkpoints fsync'd before their marker; one model in host RAM at a time ---------

def test_a_checkpoint_is_fsynced_before_its_marker(tiny_model_path, tmp_path, monkeypatch):
    """Every file and folder of a checkpoint (the policy's save_pretrained files, the tokenizer,
    trainer_state.pt, optimizer/, the MetaRM in metarm/) is fsync'd before complete.json exists,
    the marker itself too, and checkpoints/ after the rename: after a node crash a folder with its
    marker holds whole files. Before: save_pretrained's files were never fsync'd."""
    from plumbing.checkpoints import CHECKPOINT_MARKER
    from plumbing.metarm_setup import load_metarm, save_metarm
    policy, tok = load_model(tiny_model_path)
    opt, sched = _make_opt(policy)
    _adam_step(policy, policy, opt, _layout_batch(), 1, tok.pad_token_id)
    mrm = load_metarm(tiny_model_path)
    out = str(tmp_path / "run")
    tmp = os.path.join(out, "checkpoints", "step_000001.tmp")
    synced = []  # (path, whether the marker existed then)
    real = os.fsync

    def fsync(fd):
        real(fd)
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.path.exists(os.path.join(tmp, CHECKPOINT_MARKER))))
    monkeypatch.setattr(os, "fsync", fsync)
    save_checkpoint(out, 1, policy, tok, opt, sched, keep=2, extra=lambda d: save_metarm(mrm, os.path.join(d, "metarm")))
    final = latest_checkpoint(out)
    before = {p.replace(tmp, final, 1) for p, marked in synced if not marked}
    paths = [final] + [os.path.join(d, n) for d, dirs, files in os.walk(final) for n in dirs + files]
    paths = [p for p in paths if not p.endswith(CHECKPOINT_MARKER)]
    assert {"model.safetensors", "config.json", "trainer_state.pt", "metarm", "optimizer"} <= set(os.listdir(final))
    assert len(paths) > 10 and [p for p in paths if p not in before] == []
    assert os.path.join(tmp, CHECKPOINT_MARKER) in [p for p, _ in synced]
    assert synced[-1][0] == os.path.join(out, "checkpoints")  # the rename, last


def _save_memory_worker(rank, world, port, big_path, out):
    import gc
    from plumbing.metarm_setup import load_metarm, save_metarm
    _init(rank, world, port)
    policy, tok = load_model(big_path)
    wrap_policy(policy, "fsdp2", world, CPU)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)  # no optimizer state: the weights alone are measured
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mrm = load_metarm(big_path, parallel="fsdp2", rank=rank, world=world)
    gc.collect()
    dist.barrier()
    start = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: VmHWM (the peak RSS) := the current RSS
    save_checkpoint(out, 1, policy, tok, opt, sched, keep=2, rank=rank,
                    extra=lambda d: save_metarm(mrm, os.path.join(d, "metarm"), rank=rank, world=world))
    peak = _vm("VmHWM") - start
    sizes = [sum(p.numel() * 4 for p in m.parameters()) for m in (policy, mrm["model"])]  # this rank's shards
    torch.save({"peak": peak, "shards": sizes}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_the_checkpoint_of_two_models_holds_one_in_host_ram_at_a_time(tiny_model_path, tmp_path):
    """RM-NLHF under FSDP2: save_checkpoint gathers the policy on rank 0 (float32), writes it and
    drops it before save_metarm gathers the MetaRM: rank 0's peak host memory over the save is one
    model (108 MB here), not both (about 2 x 108 MB before)."""
    big_path, big_bytes = _write_big_model(tmp_path / "big", tiny_model_path)
    out = str(tmp_path / "run")
    _spawn(_save_memory_worker, 2, big_path, out)
    r0 = torch.load(f"{out}.0")
    assert latest_checkpoint(out).endswith("step_000001")
    resumed, _ = load_model(latest_checkpoint(out))
    assert sum(p.numel() for p in resumed.parameters()) * 4 == big_bytes
    assert 0.8 * big_bytes < r0["peak"] < 1.4 * big_bytes, (r0["peak"], big_bytes)
    print(f"rank 0's peak host memory over the save: {r0['peak'] / 2**20:.0f} MiB; one model {big_bytes / 2**20:.0f} MiB")
