"""train.py: advantages, CISPO/GRPO loss values and gradients, normalisers, layout equivalence,
config and data errors."""
import contextlib
import copy
import glob
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # spawn: a fresh interpreter per rank

import rollout
import train as T
from conftest import data_path, frozen_logprobs, update_policy
import fast
from plumbing.data import load_model, load_train_items
from plumbing.scale import all_sum, compute_context, keep_matmul_outputs, wrap_policy
from plumbing import config
from plumbing.run import step_metrics

ALGO = {"loss": "cispo", "ratio": "sequence", "eps_low": 1.0, "eps_high": 5.0, "clip_eps": 0.2,
        "kl_coef": 0.0, "aggregation": "seq_sum", "updates_per_batch": 1, "minibatches": 1,
        "advantage_std": False}


# --- advantages (RLME Eq. 5; RM-NLHF Eq. 1-2 for GRPO's / std) -----------------------------------------------------------

def test_mean_only_advantages_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, -0.7, -0.7, -0.7, -0.7])
    a = T.group_advantages(r, 4)
    assert a[:4].tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])
    assert a[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # exactly 0, no 1-ulp residue


def test_std_advantages_zero_variance_and_one_of_four():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3])
    a = T.group_advantages(r, 4, std=True)
    # mean 0.25, population std sqrt(0.1875) = 0.4330127
    s = math.sqrt(0.1875)
    assert a[:4].tolist() == pytest.approx([0.75 / (s + 1e-6)] + [-0.25 / (s + 1e-6)] * 3, abs=1e-6)
    assert a[4:].tolist() == [0.0] * 4 and not torch.isnan(a).any()


def test_advantages_skip_invalid_samples():
    r = torch.tensor([1.0, 0.0, 5.0, float("nan")])
    valid = torch.tensor([True, True, True, False])
    a = T.group_advantages(r, 4, valid=valid)
    assert a.tolist() == pytest.approx([-1.0, -2.0, 3.0, 0.0])


# --- CISPO loss (RLME Eq. 6-8, MiniMax-M1) ---------------------------------------------------------

def test_cispo_loss_value_and_gradient_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    behaviour = torch.tensor([[-1.1, -2.0, 0.0], [-1.5, -1.5, -1.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.5, -1.0])
    loss_sum, st = T.cispo_loss(logp, behaviour, adv, mask, eps_low=1.0, eps_high=5.0, aggregation="seq_sum")
    loss = loss_sum / T.loss_normaliser("seq_sum", num_seqs=2, num_tokens=5, max_new_tokens=3)
    # sample 0: log rho = 0.1 -> weight e^0.1; term -(e^0.1)(0.5)(-3.0) = 1.5 e^0.1
    # sample 1: log rho = 3.0 > log 6 -> weight clipped to 6; term -(6)(-1)(-1.5) = -9
    expected = (1.5 * math.exp(0.1) - 9.0) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    loss.backward()
    g = logp.grad
    # d/d logp_0t = -e^0.1 * 0.5 / 2 on real tokens, 0 on the masked one
    assert g[0].tolist() == pytest.approx([-math.exp(0.1) * 0.25, -math.exp(0.1) * 0.25, 0.0], abs=1e-6)
    # the clipped sample still gets gradient (PPO-clip would give 0 here): -6 * -1 / 2 = 3
    assert g[1].tolist() == pytest.approx([3.0, 3.0, 3.0], abs=1e-6)
    assert st["clipped"].tolist() == [False, True]
    assert st["is_weight"].tolist() == pytest.approx([math.exp(0.1), math.exp(3.0)], rel=1e-5)


def test_cispo_token_mean_and_dr_grpo_normalisers():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.5, -1.0])
    for agg, norm in [("token_mean", 5), ("dr_grpo", 2 * 3)]:
        algo = dict(ALGO, aggregation=agg)
        loss_sum, _ = T.loss_function(algo)(logp, None, adv, mask)  # on-policy: weight 1
        assert T.loss_normaliser(algo["aggregation"], 2, 5, 3) == norm
        # weight 1: -(0.5)(-1 - 2) - (-1)(-0.5 * 3) = 1.5 - 1.5 = 0
        assert loss_sum.item() == pytest.approx(-(0.5 * -3.0) - (-1.0 * -1.5), abs=1e-6)


def test_seq_mean_token_mean_is_rm_nlhf_eq3():
    """RM-NLHF Eq. 3: 1/G sum_i 1/|y_i| sum_t (...): each sequence's tokens averaged first, so a
    1-token sequence weighs as much as a 2-token one. On-policy CISPO (weight 1), by hand:
    row 0: (1/2)(-1*-1 + -1*-2) = 1.5; row 1: (1/1)(2 * -0.5) = -1.0; sum 0.5; / G = 2 -> 0.25.
    Gradient d/d logp_it = -A_i / (|y_i| G): row 0 -1/4 each, row 1 +2/2 = 1.0, masked 0."""
    logp = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -3.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    algo = dict(ALGO, aggregation="seq_mean_token_mean")
    loss_sum, _ = T.loss_function(algo)(logp, None, adv, mask)
    norm = T.loss_normaliser(algo["aggregation"], 2, 3, 3)
    assert norm == 2
    loss = loss_sum / norm
    assert loss.item() == pytest.approx(0.25, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-0.25, -0.25, 0.0]), pytest.approx([1.0, 0.0, 0.0])]
    # token_mean on the same numbers: (1 + 2 - 1) / 3 tokens, the 1-token row weighs half as much
    tm = dict(ALGO, aggregation="token_mean")
    assert (T.loss_function(tm)(logp, None, adv, mask)[0] / T.loss_normaliser(tm["aggregation"], 2, 3, 3)).item() == pytest.approx(2 / 3)


def test_cispo_long_sequence_does_not_overflow():
    # 100 tokens each with log-ratio 1.0: exp(100) overflows float32 without log-space clipping
    logp = torch.zeros(1, 100, requires_grad=True)
    behaviour = torch.full((1, 100), -1.0)
    mask = torch.ones(1, 100)
    loss_sum, st = T.loss_function(ALGO)(logp, behaviour, torch.tensor([2.0]), mask)
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == pytest.approx(-6.0 * 2.0)  # weight clipped at 1 + eps_high = 6
    assert st["clipped"].item()


def test_cispo_geometric_mean_ratio():
    logp = torch.zeros(1, 4, requires_grad=True)
    behaviour = torch.full((1, 4), -0.25)  # sum 1.0, mean 0.25
    algo = dict(ALGO, ratio="geometric_mean")
    _, st = T.loss_function(algo)(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 4))
    assert st["is_weight"].item() == pytest.approx(math.exp(0.25), rel=1e-6)


# --- GRPO (RM-NLHF Eq. 3; docs/method.md §4.5) -------------------------------------------------------------------------------

def test_k3_kl_value_and_gradient():
    logp = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-1.5])
    kl = T.k3_kl(logp, ref)
    assert kl.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-7)  # 0.1065307
    kl.backward()
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.5), abs=1e-7)  # 0.3934693


def test_grpo_token_clip_and_kl():
    algo = dict(ALGO, loss="grpo", kl_coef=0.001, aggregation="token_mean")
    logp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    behaviour = torch.zeros(1, 2)
    ref = torch.tensor([[0.0, 0.0]])
    loss_sum, st = T.grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2, kl_coef=0.001,
                               ref_logp=ref, aggregation="token_mean")
    assert T.loss_function(algo).func is T.grpo_loss  # what algo.loss grpo trains with
    # token 0: ratio 1.5, A>0 -> min(1.5, 1.2) = 1.2 (clipped, no gradient); token 1: ratio 1
    k3_0 = math.exp(-math.log(1.5)) + math.log(1.5) - 1
    assert loss_sum.item() == pytest.approx(-1.2 - 1.0 + 0.001 * k3_0, abs=1e-6)
    loss_sum.backward()
    assert logp.grad[0, 0].item() == pytest.approx(0.001 * (1 - 1 / 1.5), abs=1e-6)  # only the KL
    assert logp.grad[0, 1].item() == pytest.approx(-1.0, abs=1e-6)                  # d(-r)/dlogp = -r = -1
    assert st["clipped"].tolist() == [0.5]


# --- layout equivalence: micro-batches and ranks give one big batch's update -------------------------

def _layout_cfg(micro, agg, fast_paths=True, parallel="ddp", dtype="float32"):
    return {"algo": dict(ALGO, aggregation=agg), "optim": {"grad_clip": 0.0},
            "rollout": {"group_size": 2, "temperature": 0.8, "max_new_tokens": 5},
            "model": {"dtype": dtype},
            "train": {"micro_batch_size": micro, "fast_paths": fast_paths, "parallel": parallel}}


def _layout_batch():
    # 4 groups of 2: a group's rows share their prompt, as in a rollout (prompt sharing is exercised)
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 5, 2, 6)]
    prompts = [p for p in prompts for _ in range(2)]
    comp = torch.randint(3, 200, (8, 5), generator=g)
    lengths = [5, 2, 3, 5, 1, 4, 5, 2]
    mask = torch.zeros(8, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 2.0, -2.0])
    return {"prompt_ids": prompts, "completion_ids": comp, "completion_mask": mask, "advantages": adv}


def _run_layout(model_path, rank, world, micro, agg, out, port=None, fast_paths=True):
    import rollout
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


# --- config (docs/method.md §3) --------------------------------------------------------------------------------

def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_config_layering_and_overrides(tmp_path):
    a = _write(tmp_path, "a.yaml", "rollout:\n  group_size: 4\n  max_new_tokens: 64\n")
    b = _write(tmp_path, "b.yaml", "rollout:\n  group_size: 2\n")
    cfg = T.load_config([a, b], ["optim.lr=3e-6", "run.out_dir=/tmp/x"])
    assert cfg["rollout"]["group_size"] == 2 and cfg["rollout"]["max_new_tokens"] == 64
    assert cfg["optim"]["lr"] == 3e-6 and cfg["run"]["out_dir"] == "/tmp/x"
    assert cfg["algo"]["eps_high"] == 5.0  # untouched default from config.yaml


@pytest.mark.parametrize("override, message", [
    (["rollout.groupsize=4"], "unknown config key rollout.groupsize"),
    (["rollout.group_size=four"], "config key rollout.group_size: expected int"),
    (["algo.loss=ppo"], "config key algo.loss: 'ppo' is not one of"),
    (["reward.meta_questions=[{question: a, weight: 0}, {question: b, weight: 0.0}]"], "reward.meta_questions: every weight is 0"),
    (["reward.evaluators=[{kind: live, weight: 0}]"], "reward.evaluators: every weight is 0"),
    (["model.gradient_checkpointing=true"], "config key model.gradient_checkpointing: True is not one of ['none', 'full', 'selective']"),
    (["algo.minibatches=3"], "config key algo.minibatches=3 does not divide"),
    (["rollout.group_size=0"], "config key rollout.group_size: must be >= 1"),
    (["reward.evaluators=[{kind: frozen}]"], "reward.evaluators[0].path"),
    (["reward.meta_questions=[{question: a, wieght: 1}]"], "reward.meta_questions[0].wieght: unknown"),
    (["reward.evaluator_template='{question} {problem} {solution}'"], "must come after"),
    (["optim.lr"], "expected key.sub=value"),
    (["reward.meta_questions=[{weight: 1}]"], "reward.meta_questions[0].question: missing"),
    (["reward.evaluators=[{name: a}, {name: a, kind: frozen_self}]"], "names must be unique"),
    (["reward.meta_questions=[{question: Is it right?, weight: 1}]"],
     "override 'reward.meta_questions=[{question: Is it right?, weight: 1}]': the value is not valid YAML at line 1, column 24"),
    # settings that would silently do nothing or break mid-run (issue 13)
    (["algo.kl_coef=0.01"], "config key algo.kl_coef=0.01: the KL term is GRPO's"),
    (["task=rm_nlhf", "nlhf.lam=1.5"], "config key nlhf.lam: must be in [0.0, 1.0], got 1.5"),
    (["nlhf.lam=-0.1"], "config key nlhf.lam: must be in [0.0, 1.0], got -0.1"),
    (["optim.lr=-1"], "config key optim.lr: must be > 0, got -1.0"),
    (["optim.beta2=1.0"], "config key optim.beta2: must be in [0, 1), got 1.0"),
    (["reward.meta_questions=[{question: 'Is it right?', target: ''}]"], "reward.meta_questions[0].target: empty"),
    (["rollout.group_size=1"], "config key rollout.group_size: must be >= 2"),
    (["train.share_prompt=false"], "config key train.share_prompt was replaced by train.fast_paths"),
    (["model.dtype=float16", "train.parallel=fsdp2"], "model.dtype=float16 with train.parallel=fsdp2"),
    # RM-NLHF choices (issue 15): unknown names, and the released D_O form where it changes nothing
    (["judge.variant=coarse"], "config key judge.variant: 'coarse' is not one of ['core', 'all', 'meta_judge']"),
    (["nlhf.similarity=f2"], "config key nlhf.similarity: 'f2' is not one of ['f1', 'precision', 'recall']"),
    (["nlhf.grm_prompt=theirs"], "config key nlhf.grm_prompt: 'theirs' is not one of ['ours', 'authors']"),
    (["judge.on_failure=retry"], "config key judge.on_failure: 'retry' is not one of ['mask', 'zero']"),
    (["task=rm_nlhf", "nlhf.do_reward=released", "metarm.mode=metarm_only"],
     "nlhf.do_reward=released would change nothing here: metarm.mode=metarm_only"),
    (["task=rm_nlhf", "nlhf.do_reward=released", "nlhf.do=null"], "nlhf.do_reward=released would change nothing here: no D_O"),
    (["task=rm_nlhf", "nlhf.do_reward=released", "nlhf.gate_on_outcome=false"],
     "nlhf.do_reward=released would change nothing here: nlhf.gate_on_outcome=false"),
    # what a shell leaves of model.system_prompt="": YAML would read null, the default, silently
    (["model.system_prompt="], "override 'model.system_prompt=': no value (a shell drops the quotes"),
])
def test_config_errors_are_one_line(override, message):
    with pytest.raises(SystemExit) as e:
        T.load_config([], override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_empty_string_override_as_a_shell_passes_it():
    """model.system_prompt="''" in a shell reaches us as model.system_prompt='' : the empty string."""
    assert T.load_config([], ["model.system_prompt=''"])["model"]["system_prompt"] == ""
    assert T.load_config([], ["model.system_prompt=null"])["model"]["system_prompt"] is None


def test_invalid_yaml_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  seed: 1\n rollout: [\n")
    with pytest.raises(SystemExit) as e:
        T.load_config([str(bad)])
    assert str(e.value).startswith(f"config file {bad}: invalid YAML at line 3, column 2") and "\n" not in str(e.value)


def test_a_key_given_twice_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys silently; a preset's first value would never apply."""
    dup = _write(tmp_path, "dup.yaml", "algo:\n  aggregation: seq_sum\n  aggregation: token_mean\n")
    with pytest.raises(SystemExit) as e:
        T.load_config([dup])
    assert str(e.value) == f"config file {dup}: invalid YAML at line 3, column 3: key 'aggregation' appears twice"


def test_world_size_must_divide_prompts():
    cfg = T.load_config([], ["rollout.prompts_per_step=6"])
    with pytest.raises(SystemExit, match="not divisible by the world size 4"):
        config.validate_config(cfg, world_size=4)


@pytest.mark.parametrize("override, message", [
    ("rollout.top_p=1.5", "config key rollout.top_p: must be in (0, 1], got 1.5"),
    ("rollout.top_p=0", "config key rollout.top_p: must be in (0, 1], got 0.0"),
    ("rollout.top_k=-1", "config key rollout.top_k: must be >= 0 (0 = off), got -1"),
])
def test_sampling_settings_out_of_range(override, message):
    with pytest.raises(SystemExit) as e:
        config.validate_config(T.load_config([], [override]))
    assert str(e.value) == message


# --- data ---------------------------------------------------------------------------------------------

def test_gsm8k_items_and_anchoring():
    cfg = T.load_config([], [f"data.train={data_path('gsm8k', 'train.jsonl')}", "data.max_items=40",
                             "reward.anchor_fraction=0.25"])
    items = load_train_items(cfg)
    assert len(items) == 40 and items[0]["label"] == "72"  # Natalia: 48 + 24
    assert sum(it["anchored"] for it in items) == 10
    again = load_train_items(cfg)
    assert [it["anchored"] for it in again] == [it["anchored"] for it in items]  # chosen once, by seed


def test_step_items_whole_groups_per_rank_and_resume_order():
    items = [{"index": i} for i in range(10)]
    full = rollout.step_items(items, 3, 4, seed=0, rank=0, world=1)
    halves = rollout.step_items(items, 3, 4, 0, 0, 2) + rollout.step_items(items, 3, 4, 0, 1, 2)
    assert [x["index"] for x in full] == [x["index"] for x in halves]
    # the stream covers every item once per epoch
    epoch = [x["index"] for s in range(5) for x in rollout.step_items(items, s, 2, 0, 0, 1)]
    assert sorted(epoch) == list(range(10))


@pytest.mark.parametrize("content, message", [
    ('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": \n', "train.jsonl:2: not valid JSON"),
    ("", "is empty"),
])
def test_bad_data_files(tmp_path, content, message):
    p = _write(tmp_path, "train.jsonl", content)
    cfg = T.load_config([], [f"data.train={p}"])
    with pytest.raises(SystemExit, match=message):
        load_train_items(cfg)


def test_a_data_file_that_is_not_utf8_names_its_line(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_bytes('{"question": "a", "answer": "#### 1"}\n{"question": "é", "answer": "#### 2"}\n'.encode("latin-1"))
    with pytest.raises(SystemExit, match=r"train.jsonl:2: not UTF-8 text"):
        load_train_items(T.load_config([], [f"data.train={p}"]))


def test_a_config_file_is_read_as_yaml_bytes(tmp_path):
    """PyYAML detects the encoding of a byte stream: a UTF-16 file loads, a bad byte is one line."""
    wide = tmp_path / "wide.yaml"
    wide.write_bytes("run:\n  seed: 7\n".encode("utf-16"))
    assert T.load_config([str(wide)])["run"]["seed"] == 7
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"run:\n  seed: \xff\n")
    with pytest.raises(SystemExit) as e:
        T.load_config([str(bad)])
    assert str(e.value).startswith(f"config file {bad}: invalid YAML") and "\n" not in str(e.value)


def test_missing_field_and_file(tmp_path):
    p = _write(tmp_path, "train.jsonl", '{"problem": "a", "answer": "#### 1"}\n')
    with pytest.raises(SystemExit, match=r"data.question_field='question': no such field .*fields: problem, answer"):
        load_train_items(T.load_config([], [f"data.train={p}"]))
    with pytest.raises(SystemExit, match="does not exist"):
        load_train_items(T.load_config([], [f"data.train={tmp_path / 'nope.jsonl'}"]))


@pytest.mark.parametrize("preset", sorted(glob.glob(os.path.join(os.path.dirname(T.__file__), "configs", "*.yaml"))))
def test_every_preset_loads_and_validates(preset):
    """A preset that drifts from config.yaml's schema (a renamed key, a bad value) fails here, not
    halfway into somebody's run."""
    cfg = T.load_config([preset])
    config.validate_config(cfg)
    assert cfg["run"]["total_steps"] >= 1


def test_selective_checkpointing_keeps_only_matmul_outputs():
    """train.keep_matmul_outputs: matrix multiplies are saved, everything else is replayed."""
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        assert keep_matmul_outputs(None, op) == CheckpointPolicy.MUST_SAVE
    for op in (aten.mul.Tensor, aten.silu.default, aten.rsqrt.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert keep_matmul_outputs(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_clip_grad_norm_is_accurate_on_long_cpu_tensors():
    """The global norm sqrt(sum_i g_i^2) (what clipping divides by) within 1e-6 of float64, also for
    a 33M-element gradient (float32 norms of one long CPU tensor drift: ~1e-3 at this size); then
    clipping to max_norm = E/2 scales every gradient by (E/2) / (E + 1e-6) (torch's eps)."""
    torch.manual_seed(0)
    long = torch.nn.Parameter(torch.zeros(1 << 25))
    short = torch.nn.Parameter(torch.zeros(3))
    long.grad = torch.randn(1 << 25) * 1e-5
    short.grad = torch.tensor([3e-3, -4e-3, 12e-3])  # 3-4-12-13: norm 0.013
    policy = torch.nn.ParameterList([long, short])
    exact = float((long.grad.double().pow(2).sum() + 0.013 ** 2) ** 0.5)
    assert fast.clip_grad_norm(policy, 0.0) == pytest.approx(exact, rel=1e-6)
    assert short.grad.tolist() == pytest.approx([3e-3, -4e-3, 12e-3])  # measure only: unchanged
    assert fast.clip_grad_norm(policy, exact / 2) == pytest.approx(exact, rel=1e-6)
    coef = (exact / 2) / (exact + 1e-6)
    assert short.grad.tolist() == pytest.approx([3e-3 * coef, -4e-3 * coef, 12e-3 * coef], rel=1e-6)
    clipped = float((long.grad.double().pow(2).sum() + short.grad.double().pow(2).sum()) ** 0.5)
    assert clipped == pytest.approx(exact * coef, rel=1e-6)


# --- plain twins: every pass of the update, fast == plain (issue 13) -------------------------------

def _grm_batch(tok):
    """Two groups of 2 GRM prompts (RM-NLHF's pairwise prompt, ~100+ tokens) with random completions."""
    import reward as R
    g = torch.Generator().manual_seed(1)
    items = [{"context": "What is 2+3?", "response_a": "5", "response_b": "6"},
             {"context": "Name a prime number larger than ten.", "response_a": "12", "response_b": "13"}]
    prompts = [R.grm_prompt_ids(tok, it, True, {"max_critique_lines": 4, "grm_prompt": "ours"}) for it in items for _ in range(2)]
    comp = torch.randint(3, 200, (4, 6), generator=g)
    mask = torch.tensor([[1.0] * 6, [1.0] * 3 + [0.0] * 3, [1.0] * 4 + [0.0] * 2, [1.0] * 6])
    return {"prompt_ids": prompts, "completion_ids": comp, "completion_mask": mask,
            "advantages": torch.tensor([1.0, -1.0, 0.7, -0.7])}


def _update(model_path, cfg, batch, ref_path=None, checkpointing="none"):
    """One update_policy call with SGD(lr=1) (update = -grad); returns loss, grad norm, delta."""
    import rollout
    torch.manual_seed(0)
    policy, tok = load_model(model_path)
    before = torch.cat([p.detach().flatten().clone() for p in policy.parameters()])
    model = wrap_policy(policy, "ddp", 1, torch.device("cpu"), gradient_checkpointing=checkpointing)
    ref = load_model(ref_path)[0].eval().requires_grad_(False) if ref_path else None
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    upd = update_policy(model, policy, opt, batch, cfg, world=1, device=torch.device("cpu"), pad_id=tok.pad_token_id,
                          ref_model=ref)
    delta = torch.cat([p.detach().flatten() for p in policy.parameters()]) - before
    return {"loss": upd["loss"], "grad_norm": upd["grad_norms"][-1], "delta": delta}


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory):
    from conftest import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_ref"), seed=1)


@pytest.mark.parametrize("case", ["cispo", "cispo_off_policy", "grpo_kl", "grpo_kl_grm", "full", "selective"])
def test_update_passes_fast_equal_plain(tiny_model_path, other_model_path, case):
    """Every pass of the update through the fast paths (shared prompt pass, read-only cache,
    closed-form log-prob backward, chunked norm) gives what the plain twins give (one forward over
    prompt + completion per row, log_softmax + gather, clip_grad_norm_): the policy pass with
    gradient; the behaviour pass (off-policy: 2 updates per batch); the GRPO reference pass
    (kl_coef 1 so that the KL term weighs); the RM-NLHF GRM pass; under activation checkpointing."""
    import rollout
    cfg = _layout_cfg(2, "seq_sum")
    batch, ref = _layout_batch(), None
    if case == "cispo_off_policy":
        cfg["algo"]["updates_per_batch"] = 2
    if case.startswith("grpo"):
        cfg["algo"].update(loss="grpo", kl_coef=1.0, aggregation="token_mean", advantage_std=True)
        ref = other_model_path
    if case == "grpo_kl_grm":
        batch = _grm_batch(load_model(tiny_model_path)[1])
    checkpointing = case if case in ("full", "selective") else "none"
    cfg["optim"]["grad_clip"] = 1e-3  # clipping active: the norm itself is compared through the update
    fast_run = _update(tiny_model_path, cfg, batch, ref, checkpointing)
    plain = _update(tiny_model_path, copy.deepcopy(cfg) | {"train": dict(cfg["train"], fast_paths=False)}, batch, ref,
                    checkpointing)
    assert fast_run["delta"].abs().max() > 1e-6  # a real update
    assert fast_run["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-6)
    assert fast_run["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert (fast_run["delta"] - plain["delta"]).abs().max().item() < 1e-6 + 1e-4 * plain["delta"].abs().max().item()


def test_reference_pass_is_the_reference_model_alone(tiny_model_path, other_model_path):
    """GRPO's k3 KL compares the policy with the reference model: the no-grad reference pass runs
    the prompt AND the completion through the reference model (an earlier version built the
    prompt's KV cache with the policy: a hybrid up to 0.1 nats off). frozen_logprobs(ref) must be
    the plain per-row log-probs under ref, and differ from the policy's."""
    import rollout
    cfg = _layout_cfg(2, "seq_sum")
    batch = _layout_batch()
    policy, tok = load_model(tiny_model_path)
    ref, _ = load_model(other_model_path)
    got = frozen_logprobs(ref, batch, tok.pad_token_id, cfg, torch.device("cpu"))
    with torch.no_grad():
        want = rollout.completion_logprobs(ref, batch["prompt_ids"], batch["completion_ids"], tok.pad_token_id,
                                                 temperature=0.8)
        pol = rollout.completion_logprobs(policy, batch["prompt_ids"], batch["completion_ids"], tok.pad_token_id,
                                                temperature=0.8)
    m = batch["completion_mask"]
    for i, row in enumerate(got):
        n = int(m[i].sum())
        assert row[:n].tolist() == pytest.approx(want[i, :n].tolist(), abs=1e-5), i
    assert max((want - pol).abs().mul(m).max().item(), 0) > 1e-2  # the two models differ


def test_bf16_keeps_float32_master_weights_and_moves_them(tiny_model_path):
    """model.dtype bfloat16: the policy stays float32 and computes under autocast; one AdamW step of
    lr 1e-6 moves (nearly) every weight by ~lr, as in float32 (a bf16-stored weight of ~0.02 has a
    spacing of ~1e-4: the same step would round to nothing)."""
    import rollout
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


def test_clip_grad_norm_fast_equals_plain():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1 << 18, 7)]
    grads = [torch.randn(1 << 18) * 1e-3, torch.randn(7)]
    norms = []
    for use_fast in (True, False):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norms.append((fast.clip_grad_norm if use_fast else T.clip_grad_norm)(torch.nn.ParameterList(params), 0.5))
        clipped = [p.grad.clone() for p in params]
        norms.append(clipped)
    assert norms[0] == pytest.approx(norms[2], rel=1e-6)
    for a, b in zip(norms[1], norms[3]):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)


def test_off_policy_update_with_micro_batches_that_split_a_minibatch(tiny_model_path):
    """algo.minibatches=2 with train.micro_batch_size=3: the no-grad behaviour pass chunks rows
    [0,1,2] [3,4,5] [6,7] but the second optimizer step chunks them [4,5,6] [7], so a row's
    behaviour log-probs must cover any micro-batch width (rows 4 and 5 are 1 token long, row 6 is
    5). The update must equal the one with micro-batches that line up (4)."""
    def run(micro):
        torch.manual_seed(0)
        policy, tok = load_model(tiny_model_path)
        before = [p.detach().clone() for p in policy.parameters()]
        # lr 0.1: big enough that the second step is off-policy (weights != 1), small enough that
        # float32 rounding is not amplified (at lr 1.0 even two aligned layouts differ by 2e-4)
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        batch = _layout_batch()
        batch["completion_mask"] = torch.zeros(8, 5)
        for i, n in enumerate([5, 2, 3, 1, 1, 1, 5, 2]):
            batch["completion_mask"][i, :n] = 1
        cfg = _layout_cfg(micro, "seq_sum")
        cfg["algo"] = dict(cfg["algo"], minibatches=2)
        upd = update_policy(policy, policy, opt, batch, cfg, world=1, device=torch.device("cpu"),
                              pad_id=tok.pad_token_id)
        return upd, torch.cat([(p.detach() - q).flatten() for p, q in zip(policy.parameters(), before)])

    aligned, d_aligned = run(4)
    split, d_split = run(3)
    assert (aligned["is_weight"][4:] - 1).abs().max() > 1e-3  # the second step is off-policy
    assert split["loss"] == pytest.approx(aligned["loss"], rel=1e-5)
    torch.testing.assert_close(split["is_weight"], aligned["is_weight"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_split, d_aligned, rtol=1e-4, atol=1e-5)


# ---- step_metrics / emit: a step whose every reward is unknown -----------------------------------------------

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
