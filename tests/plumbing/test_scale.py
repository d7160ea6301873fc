"""Scale-out (docs/scale-out.md): FSDP2 vs one process (update, grad norm, generation), layout-agnostic
checkpoints both ways, per-rank seeds, config errors. The vLLM backend's tests are in
tests/plumbing/test_vllm.py (pure parts) and test_vllm_engine.py (the real engine). GPU tests are
marked `gpu` and skipped without CUDA."""

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

from plumbing.data import load_model, REPO
from plumbing.run import latest_checkpoint, load_trainer_state, save_checkpoint
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
        config.check_scale_config(T.load_config([], overrides), torch.device(device))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_scale_config_ok_on_cpu():
    config.check_scale_config(T.load_config([], ["train.parallel=fsdp2", "rollout.backend=hf"]), CPU)  # no exception


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

def _dcp_save_worker(rank, world, port, model_path, out_dir):
    _init(rank, world, port)
    policy, tok = load_model(model_path)
    model = wrap_policy(policy, "fsdp2", world, CPU)
    opt, sched = _make_opt(policy)
    _adam_step(model, policy, opt, _shard(_layout_batch(), rank, world), world, tok.pad_token_id)
    sched.step()
    save_checkpoint(out_dir, 1, policy, tok, opt, sched, keep=2, rank=rank)
    dist.destroy_process_group()


def _dcp_resume_worker(rank, world, port, ckpt, out):
    _init(rank, world, port)
    model = _resume_and_step(ckpt, rank, world)[0]
    flat = _flat(model)
    if rank == 0:
        torch.save(flat, out)
    dist.destroy_process_group()


def test_a_checkpoint_saved_on_2_ranks_resumes_exactly_on_1_and_on_4(tiny_model_path, tmp_path):
    """The AdamW state is written by every rank (torch.distributed.checkpoint: one .distcp file per
    rank, nothing gathered on rank 0) and read back resharded: step 2 after the resume equals the
    uninterrupted one-process step 2 on 1 rank and on 4 FSDP2 ranks. Before: the full state, in
    trainer_state.pt, written by rank 0 alone."""
    import json, os
    batch = _layout_batch()
    policy, tok = load_model(tiny_model_path)
    opt, sched = _make_opt(policy)
    _adam_step(policy, policy, opt, batch, 1, tok.pad_token_id)
    sched.step()
    _adam_step(policy, policy, opt, batch, 1, tok.pad_token_id)
    p2 = _flat(policy)

    _spawn(_dcp_save_worker, 2, tiny_model_path, str(tmp_path / "run"))
    ckpt = latest_checkpoint(str(tmp_path / "run"))
    assert ckpt.endswith("step_000001") and not os.path.exists(ckpt + ".tmp")
    files = sorted(os.listdir(os.path.join(ckpt, "optimizer")))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files  # each rank wrote its own shard
    assert all(os.path.getsize(os.path.join(ckpt, "optimizer", f)) > 1000 for f in files[1:])
    assert "optimizer" not in torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    with open(os.path.join(ckpt, "complete.json")) as f:
        assert json.load(f)["world_size"] == 2

    # 1 rank: the plain one-process path (no FSDP2, no process group)
    one, _ = load_model(ckpt)
    opt1, sched1 = _make_opt(one)
    assert load_trainer_state(ckpt, one, opt1, sched1) == 1 and sched1.last_epoch == 1
    _adam_step(one, one, opt1, batch, 1, tok.pad_token_id)
    assert (_flat(one) - p2).abs().max().item() < 1e-5
    # 4 FSDP2 ranks, 2 rows each
    _spawn(_dcp_resume_worker, 4, ckpt, str(tmp_path / "four.pt"))
    assert (torch.load(tmp_path / "four.pt") - p2).abs().max().item() < 1e-5
    # the test can fail: without the optimizer state step 2 lands elsewhere
    fresh, _ = load_model(ckpt)
    opt_f, _ = _make_opt(fresh)
    _adam_step(fresh, fresh, opt_f, batch, 1, tok.pad_token_id)
    assert (_flat(fresh) - p2).abs().max().item() > 1e-4


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
