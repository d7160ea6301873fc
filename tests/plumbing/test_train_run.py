"""The update's plumbing: mixed precision and master weights, activation checkpointing, the compute context, the step's metrics when every reward is masked."""
import contextlib
import functools
import json
import os

import pytest
import torch

from conftest import reward_kwargs, update_kwargs, update_policy
from test_train import _layout_batch, _layout_cfg
import train as T

from plumbing.models import load_model
from plumbing.metrics import step_metrics
from plumbing.scale import compute_context, keep_matmul_outputs, all_sum
import torch.distributed as dist
import torch.multiprocessing as mp


def test_selective_checkpointing_keeps_only_matmul_outputs():
    """plumbing.scale.keep_matmul_outputs: matrix multiplies are saved, everything else is replayed."""
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        assert keep_matmul_outputs(None, op) == CheckpointPolicy.MUST_SAVE
    for op in (aten.mul.Tensor, aten.silu.default, aten.rsqrt.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert keep_matmul_outputs(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_bf16_keeps_float32_master_weights_and_moves_them(tiny_model_path):
    """model.dtype bfloat16: the policy stays float32 and computes under autocast; one AdamW step of
    lr 1e-6 moves (nearly) every weight by ~lr, as in float32 (a bf16-stored weight of ~0.02 has a
    spacing of ~1e-4: the same step would round to nothing)."""
    batch = _layout_batch()
    moved = {}
    for dtype in ("float32", "bfloat16"):
        cfg = _layout_cfg(2, "seq_sum", dtype=dtype)
        torch.manual_seed(0)
        policy, tok = load_model(tiny_model_path)
        before = torch.cat([p.detach().flatten().clone() for p in policy.parameters()])
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
        update_policy(policy, policy, opt, batch, cfg, world=1, device=torch.device("cpu"), pad_id=tok.pad_token_id)
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
        d = (torch.cat([p.detach().flatten() for p in policy.parameters()]) - before).abs()
        moved[dtype] = ((d > 0).float().mean().item(), d[d > 0].median().item())
    for dtype in moved:
        frac, med = moved[dtype]
        assert frac > 0.9 and med == pytest.approx(1e-6, rel=0.1), (dtype, moved)


def test_compute_context_autocasts_except_fsdp2_on_gpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(compute_context("float32", "ddp", cpu), contextlib.nullcontext)
    ctx = compute_context("bfloat16", "ddp", cpu)
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16
    assert isinstance(compute_context("bfloat16", "fsdp2", cpu), torch.autocast)  # FSDP2 on CPU: autocast
    assert isinstance(compute_context("bfloat16", "fsdp2", cuda), contextlib.nullcontext)  # MixedPrecisionPolicy
    with compute_context("bfloat16", "ddp", cpu):
        y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16


def test_a_fully_masked_step_logs_no_reward_mean(tmp_path):
    """Every sample masked (failed judge / remote evaluator calls): reward/mean and reward/std are
    None, not 0.0 (the best RLME reward), the progress bar says so, and the reward-hacking
    monitor's training reward leaves the step out; a step with known rewards still averages them
    (hand numbers: rewards -1 and -3, mean -2, population std 1)."""
    from plumbing.config import load_config
    from tqdm import tqdm
    cfg = load_config([os.path.join(os.path.dirname(T.__file__), "configs", "cpu.yaml")],
                      [f"run.out_dir={tmp_path}", "rollout.group_size=2"])
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), lambda s: 1.0)
    bar = tqdm(total=2, disable=True)
    written = []
    bar.write = written.append
    state = {"world": 1, "rank": 0, "scheduler": sched, "device": torch.device("cpu"), "trackers": [], "pbar": bar,
             "rewards_since_eval": []}
    q = cfg["reward"]["meta_questions"][0]["question"]

    def records(step, rewards):
        return [{"step": step, "rank": 0, "group": 0, "reward": r, "rlvr_reward": 0.0, "rlme_reward": r,
                 "logp": {"self": {q: r}}, "extracted": None, "correct": None, "completion": "x", "truncated": False,
                 "length": 3, "advantage": 0.0, "importance_weight": 1.0, "clipped": 0.0} for r in rewards]
    upd = {"loss": 0.0, "grad_norms": [0.0], "logp_gap": None}
    times = {"rollout": 1.0, "reward": 1.0, "update": 1.0}
    def log_step(records, reward_metrics):  # as train.train: the metrics of all ranks, then rank 0 writes them
        return T.emit(state, cfg, *step_metrics(state, cfg, records, upd, reward_metrics=reward_metrics, times=times))
    m1 = log_step(records(1, [-1.0, -3.0]), reward_metrics={})
    assert (m1["reward/mean"], m1["reward/std"]) == (-2.0, 1.0)
    m2 = log_step(records(2, [None, None]), reward_metrics={"reward/masked": 2})
    assert m2["reward/mean"] is None and m2["reward/std"] is None and m2["rlme_reward/mean"] is None
    assert state["rewards_since_eval"] == [-2.0]  # step 2 left out
    assert bar.postfix.startswith("reward=masked")
    assert written == ["[train] step 2: no reward known, all 2 samples masked "
                       "(failed judge / remote evaluator calls; reward/masked, samples.jsonl)"]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [ln["reward/mean"] for ln in lines] == [-2.0, None]


def _run_layout(model_path, rank, world, micro, agg, out, port=None, fast_paths=True):
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    policy, tok = load_model(model_path)
    before = [p.detach().clone() for p in policy.parameters()]
    model = torch.nn.parallel.DistributedDataParallel(policy) if world > 1 else policy
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)  # update = -grad: compares gradients exactly
    b = _layout_batch()
    per = 8 // world
    sl = slice(rank * per, (rank + 1) * per)
    mine = {"prompt_ids": b["prompt_ids"][sl], "completion_ids": b["completion_ids"][sl],
            "completion_mask": b["completion_mask"][sl], "advantages": b["advantages"][sl]}
    upd = update_policy(model, policy, opt, mine, _layout_cfg(micro, agg, fast_paths), world=world,
                          device=torch.device("cpu"), pad_id=tok.pad_token_id)
    loss = all_sum(upd["loss"], world)
    delta = torch.cat([(p.detach() - q).flatten() for p, q in zip(policy.parameters(), before)])
    if rank == 0:
        torch.save({"loss": loss, "delta": delta}, out)
    if world > 1:
        dist.destroy_process_group()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("agg", ["seq_sum", "token_mean", "seq_mean_token_mean"])
def test_layouts_give_the_same_update(tiny_model_path, tmp_path, agg):
    # reference: 1 rank x 1 micro-batch through the plain twins (one forward over prompt +
    # completion per row, log_softmax + gather, clip_grad_norm_); the others share each group's
    # prompt (fast.completion_logprobs, fast) and must give the same update
    results = {}
    for name, world, micro, use_fast in [("1x1 plain", 1, 8, False), ("1x1", 1, 8, True), ("1x4", 1, 2, True),
                                     ("2x2", 2, 2, True)]:
        out = str(tmp_path / f"{name}.pt")
        if world == 1:
            _run_layout(tiny_model_path, 0, 1, micro, agg, out, fast_paths=use_fast)
        else:
            ctx = mp.get_context("spawn")
            port = _free_port()
            procs = [ctx.Process(target=_run_layout, args=(tiny_model_path, r, world, micro, agg, out, port)) for r in range(world)]
            [p.start() for p in procs]
            [p.join(120) for p in procs]
            assert all(p.exitcode == 0 for p in procs)
        results[name] = torch.load(out)
    ref = results["1x1 plain"]
    assert ref["delta"].abs().max() > 1e-4  # the update is not trivially zero
    for name in ("1x1", "1x4", "2x2"):
        assert results[name]["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert (results[name]["delta"] - ref["delta"]).abs().max().item() < 1e-5, name


# ---- train.train binds what the tests bind ---------------------------------------------------------------------

class _FirstStep(Exception):
    """Raised by the stand-in step_prompts: carries train.train's local variables at its first step."""


def _train_bindings(monkeypatch, cfg):
    """train.train's own `reward_step`, `update` (functools.partial) and `passes` for `cfg`: train()
    runs with a stand-in setup (no model is loaded) up to its first step, where its locals are read."""
    import collections
    import sys
    import types
    state = collections.defaultdict(lambda: None, {
        "rank": 0, "world": 1, "device": torch.device("cpu"), "start_step": 0, "evaluators": ["an evaluator"],
        "tokenizer": types.SimpleNamespace(pad_token_id=7), "ref_model": "the reference", "scaler": "a scaler"})
    monkeypatch.setattr(T, "setup", lambda cfg, passes: state)

    def first_step(*args, **kwargs):
        raise _FirstStep(dict(sys._getframe(1).f_locals))
    monkeypatch.setattr(T, "step_prompts", first_step)
    with pytest.raises(_FirstStep) as e:
        T.train(cfg)
    local = e.value.args[0]
    return local["reward_step"], local["update"], local["passes"]


def _comparable(v):
    """A bound value in a form == compares: a functools.partial as (function, args, keywords), recursively."""
    if isinstance(v, functools.partial):
        return ("partial", _comparable(v.func), tuple(_comparable(a) for a in v.args),
                {k: _comparable(x) for k, x in v.keywords.items()})
    return v


@pytest.mark.parametrize("config, loss", [("cpu.yaml", "cispo_loss"), ("cpu_rm_nlhf.yaml", "grpo_loss")])
def test_train_binds_what_the_tests_bind(monkeypatch, config, loss):
    """The tests and scripts call train.update_policy / train.rlme_reward_step with arguments bound
    from a config by tests/conftest.py's update_kwargs / reward_kwargs, a copy of the block at the
    top of train.train: both configs' bindings are equal, function for function and number for
    number (the loss picked, its eps, the log-probs' temperature and pad id, the context)."""
    from plumbing.config import load_config
    cfg = load_config([os.path.join(os.path.dirname(T.__file__), "configs", config)], [])
    reward_step, update, passes = _train_bindings(monkeypatch, cfg)
    cpu = torch.device("cpu")
    context = functools.partial(compute_context, cfg["model"]["dtype"], cfg["train"]["parallel"], cpu)
    want_reward = functools.partial(T.rlme_reward_step, **reward_kwargs(cfg, evaluators=["an evaluator"],
                                                                        context=context, world=1))
    want_update = functools.partial(T.update_policy, **update_kwargs(cfg, passes, cpu, world=1, pad_id=7,
                                                                     ref_model="the reference", scaler="a scaler"))
    assert _comparable(reward_step) == _comparable(want_reward)
    assert _comparable(update) == _comparable(want_update)
    assert update.keywords["loss_fn"].func is getattr(T, loss)
