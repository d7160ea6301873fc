"""train.py: advantages, CISPO / GRPO losses (values and gradients by hand), normalisers and
aggregations, the update's passes; end to end on a tiny model: RLME, RM-NLHF (proxy judge), exact
resume (also past a truncated newest checkpoint), LoRA, validation + early stop, TensorBoard,
torchrun DDP and FSDP2; the run machinery: the config (every preset loads; bad input is one line),
checkpoints, the run lock, LoRA adapters, FSDP2 checkpoints."""
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import yaml

import rollout
import train as T
from conftest import REPO, data_path, free_port, make_tiny_model
from train import load_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp alone


def cispo(logp, behaviour, adv, mask, aggregation="seq_sum"):
    return T.cispo_loss(logp, behaviour, adv, mask, eps_low=1.0, eps_high=5.0,
                        aggregation=aggregation)


def grpo(logp, behaviour, adv, mask, aggregation):
    return T.grpo_loss(logp, behaviour, adv, mask, clip_eps=0.2, kl_coef=0.0,
                       aggregation=aggregation)


# --- advantages (RLME Eq. 5; RM-NLHF Eq. 1-2 for GRPO's / std) ------------------------------------

def test_mean_only_advantages_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, -0.7, -0.7, -0.7, -0.7])
    a = T.group_advantages(r, 4)
    assert a[:4].tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])
    assert a[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # exactly 0, no 1-ulp residue
    r = torch.tensor([1.0, 0.0, 5.0, float("nan")])  # an invalid sample leaves its group
    a = T.group_advantages(r, 4, valid=torch.tensor([True, True, True, False]))
    assert a.tolist() == pytest.approx([-1.0, -2.0, 3.0, 0.0])


def test_std_advantages_zero_variance_and_one_of_four():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3])
    a = T.group_advantages(r, 4, std=True)
    # mean 0.25, population std sqrt(0.1875) = 0.4330127
    s = math.sqrt(0.1875)
    assert a[:4].tolist() == pytest.approx([0.75 / (s + 1e-6)] + [-0.25 / (s + 1e-6)] * 3,
                                           abs=1e-6)
    assert a[4:].tolist() == [0.0] * 4 and not torch.isnan(a).any()


def test_unbiased_std_advantages_by_hand():
    """algo.std_unbiased (the RM-NLHF release's verl divides by torch.std, n - 1): rewards
    (1, 0, 0, 0): deviations (0.75, -0.25, -0.25, -0.25), squares sum 0.75, / 3 = 0.25, std 0.5,
    so A = (1.5, -0.5, -0.5, -0.5) up to the 1e-6. With the 3rd sample invalid, (1, 0, 0) over 3:
    deviations (2/3, -1/3, -1/3), squares 6/9, / 2 = 1/3, std 0.57735: A_1 = 1.1547."""
    a = T.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, std=True, unbiased=True)
    assert a.tolist() == pytest.approx([0.75 / 0.500001] + [-0.25 / 0.500001] * 3, abs=1e-6)
    valid = torch.tensor([True, True, False, True])
    a = T.group_advantages(torch.tensor([1.0, 0.0, 9.0, 0.0]), 4, std=True, valid=valid,
                           unbiased=True)
    s = math.sqrt(1 / 3)
    assert a.tolist() == pytest.approx([(2 / 3) / (s + 1e-6), (-1 / 3) / (s + 1e-6), 0.0,
                                        (-1 / 3) / (s + 1e-6)], abs=1e-6)
    assert a[0].item() == pytest.approx(1.1547, abs=1e-4)
    one = T.group_advantages(torch.tensor([1.0, 0.0]), 2, std=True,
                             valid=torch.tensor([True, False]), unbiased=True)
    assert one.tolist() == [0.0, 0.0]  # n = 1: no NaN


# --- CISPO (RLME Eq. 6-8, MiniMax-M1) -------------------------------------------------------------

def test_cispo_loss_value_and_gradient_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    behaviour = torch.tensor([[-1.1, -2.0, 0.0], [-1.5, -1.5, -1.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.5, -1.0])
    loss_sum, st = cispo(logp, behaviour, adv, mask)
    loss = loss_sum / T.loss_normaliser("seq_sum", num_seqs=2, num_tokens=5, max_new_tokens=3)
    # sample 0: log rho = 0.1 -> weight e^0.1; term -(e^0.1)(0.5)(-3.0) = 1.5 e^0.1
    # sample 1: log rho = 3.0 > log 6 -> weight clipped to 6; term -(6)(-1)(-1.5) = -9
    assert loss.item() == pytest.approx((1.5 * math.exp(0.1) - 9.0) / 2, abs=1e-5)
    loss.backward()
    # d/d logp_0t = -e^0.1 * 0.5 / 2 on real tokens, 0 on the masked one
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(0.1) * 0.25] * 2 + [0.0], abs=1e-6)
    # the clipped sample still gets gradient (PPO-clip would give 0 here): -6 * -1 / 2 = 3
    assert logp.grad[1].tolist() == pytest.approx([3.0, 3.0, 3.0], abs=1e-6)
    assert st["clipped"].tolist() == [False, True]
    assert st["is_weight"].tolist() == pytest.approx([math.exp(0.1), math.exp(3.0)], rel=1e-5)
    for agg, norm in [("token_mean", 5), ("dr_grpo", 2 * 3)]:
        loss_sum, _ = cispo(logp, None, adv, mask, agg)  # on-policy: weight 1
        assert T.loss_normaliser(agg, 2, 5, 3) == norm
        # weight 1: -(0.5)(-1 - 2) - (-1)(-0.5 * 3) = 1.5 - 1.5 = 0
        assert loss_sum.item() == pytest.approx(-(0.5 * -3.0) - (-1.0 * -1.5), abs=1e-6)


def test_seq_mean_token_mean_is_rm_nlhf_eq3():
    """RM-NLHF Eq. 3: 1/G sum_i 1/|y_i| sum_t (...): a 1-token sequence weighs as much as a
    2-token one. On-policy CISPO (weight 1), by hand: row 0: (1/2)(-1*-1 + -1*-2) = 1.5; row 1:
    (1/1)(2 * -0.5) = -1.0; sum 0.5; / G = 2 -> 0.25. Gradient -A_i / (|y_i| G): row 0 -1/4 each,
    row 1 +2/2 = 1.0, masked 0."""
    logp = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -3.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss_sum, _ = cispo(logp, None, adv, mask, "seq_mean_token_mean")
    assert T.loss_normaliser("seq_mean_token_mean", 2, 3, 3) == 2
    loss = loss_sum / 2
    assert loss.item() == pytest.approx(0.25, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-0.25, -0.25, 0.0]),
                                  pytest.approx([1.0, 0.0, 0.0])]
    # token_mean on the same numbers: (1 + 2 - 1) / 3 tokens, the 1-token row weighs half
    tm = cispo(logp, None, adv, mask, "token_mean")[0] / T.loss_normaliser("token_mean", 2, 3, 3)
    assert tm.item() == pytest.approx(2 / 3)


def test_micro_batch_token_mean_is_the_released_verl_token_mean():
    """algo.aggregation micro_batch_token_mean = the RM-NLHF release's loss (verl 0.4.1 with
    use_dynamic_bsz: each micro-batch's token-mean loss x len(micro-batch) / mini-batch size).
    Five sequences of 16, 1, 1, 1, 1 tokens, on-policy GRPO (ratio 1), advantages -1, 0, 0, 0, 0:
    per-token loss 1 on sequence 0's 16 tokens, 0 elsewhere. By hand:
      packed [0] [1 2 3 4]:      (1 x 16/16 + 4 x 0/4) / 5 = 0.20
      packed [0 1] [2 3] [4]:    (2 x 16/17 + 0 + 0) / 5 = 32/85 = 0.376
      one micro-batch [0..4]:    5 x 16/20 / 5 = 0.80 (= token_mean: 16 / 20)
    RM-NLHF Eq. 3 (seq_mean_token_mean): (16/16 + 0 + 0 + 0 + 0) / 5 = 0.20, whatever the packing.
    Gradient on each of sequence 0's tokens, packed [0 1] [2 3] [4]: (2 / 17) / 5 = 2/85."""
    mask = torch.zeros(5, 16)
    mask[0] = 1.0
    mask[1:, 0] = 1.0
    adv = torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.0])

    def loss(aggregation, packing):
        logp = torch.zeros(5, 16, requires_grad=True)
        total = sum(grpo(logp[rows], None, adv[rows], mask[rows], aggregation)[0]
                    for rows in packing)
        out = total / T.loss_normaliser(aggregation, 5, int(mask.sum()), 16)
        out.backward()
        return out.item(), logp.grad

    alone, pairs = [[0], [1, 2, 3, 4]], T.micro_batches(range(5), 2)
    assert pairs == [[0, 1], [2, 3], [4]]
    assert loss("micro_batch_token_mean", alone)[0] == pytest.approx(0.20)
    value, grad = loss("micro_batch_token_mean", pairs)
    assert value == pytest.approx(32 / 85) and round(value, 2) == 0.38
    assert grad[0].tolist() == pytest.approx([2 / 85] * 16) and grad[1:].abs().sum() == 0
    assert loss("micro_batch_token_mean", [list(range(5))])[0] == pytest.approx(0.80)
    assert loss("token_mean", pairs)[0] == pytest.approx(0.80)  # a global token mean
    for packing in (alone, pairs, [list(range(5))]):
        assert loss("seq_mean_token_mean", packing)[0] == pytest.approx(0.20)
    assert T.loss_normaliser("micro_batch_token_mean", 5, 20, 16) == 5


def test_cispo_long_sequence_does_not_overflow_and_the_geometric_mean_ratio():
    # 100 tokens each with log-ratio 1.0: exp(100) overflows float32 without log-space clipping
    logp = torch.zeros(1, 100, requires_grad=True)
    loss_sum, st = cispo(logp, torch.full((1, 100), -1.0), torch.tensor([2.0]), torch.ones(1, 100))
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == pytest.approx(-6.0 * 2.0)  # weight clipped at 1 + 5 = 6
    assert st["clipped"].item()
    logp = torch.zeros(1, 4, requires_grad=True)  # algo.ratio geometric_mean (GSPO)
    _, st = T.cispo_loss(logp, torch.full((1, 4), -0.25), torch.tensor([1.0]), torch.ones(1, 4),
                         eps_low=1.0, eps_high=5.0, ratio="geometric_mean")  # sum 1.0, mean 0.25
    assert st["is_weight"].item() == pytest.approx(math.exp(0.25), rel=1e-6)


# --- GRPO (RM-NLHF Eq. 3) and the k3 KL -----------------------------------------------------------

def test_k3_kl_value_and_gradient_and_grpo_token_clip_and_kl():
    logp = torch.tensor([-1.0], requires_grad=True)
    kl = T.k3_kl(logp, torch.tensor([-1.5]))
    assert kl.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-7)  # 0.1065307
    kl.backward()
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.5), abs=1e-7)  # 0.3934693
    logp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    loss_sum, st = T.grpo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                               clip_eps=0.2, kl_coef=0.001, ref_logp=torch.zeros(1, 2),
                               aggregation="token_mean")
    # token 0: ratio 1.5, A>0 -> min(1.5, 1.2) = 1.2 (clipped, no gradient); token 1: ratio 1
    k3_0 = math.exp(-math.log(1.5)) + math.log(1.5) - 1
    assert loss_sum.item() == pytest.approx(-1.2 - 1.0 + 0.001 * k3_0, abs=1e-6)
    loss_sum.backward()
    assert logp.grad[0, 0].item() == pytest.approx(0.001 * (1 - 1 / 1.5), abs=1e-6)  # KL only
    assert logp.grad[0, 1].item() == pytest.approx(-1.0, abs=1e-6)  # d(-r)/dlogp = -r = -1
    assert st["clipped"].tolist() == [0.5]


# --- the update's passes on a tiny model ----------------------------------------------------------

def _batch(lengths=(5, 2, 3, 5, 1, 4, 5, 2)):
    """4 groups of 2 (a group's rows share their prompt, as in a rollout)."""
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 5, 2, 6)]
    mask = torch.zeros(8, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return {"prompt_ids": [p for p in prompts for _ in range(2)],
            "completion_ids": torch.randint(3, 200, (8, 5), generator=g), "completion_mask": mask,
            "advantages": torch.tensor([0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 2.0, -2.0]),
            "valid": None, "rollout_logprobs": None}


def _update(model, opt, batch, micro, minibatches=1, loss="cispo", ref=None):
    return T.update_policy(model, model, opt, batch, loss=loss, eps_low=1.0, eps_high=5.0,
                           ratio="sequence", clip_eps=0.2, kl_coef=0.001, aggregation="seq_sum",
                           max_new_tokens=5, updates_per_batch=1, minibatches=minibatches,
                           group_size=2,
                           micro_batch_size=micro, grad_clip=0.0, temperature=0.8, pad_id=0,
                           ref_model=ref)


def test_reference_pass_is_the_reference_model_alone(tiny_model_path, tmp_path):
    """GRPO's k3 KL: the no-grad reference pass runs the prompt AND the completion through the
    reference model alone (not a prompt cache built by the policy: up to 0.1 nats off)."""
    batch = _batch()
    policy, tok = rollout.load_model(tiny_model_path)
    ref, _ = rollout.load_model(make_tiny_model(tmp_path / "ref", seed=1))
    got = T.frozen_logprobs(ref, batch, 2, 0.8, tok.pad_token_id)
    with torch.no_grad():
        want, pol = (rollout.completion_logprobs(m, batch["prompt_ids"], batch["completion_ids"],
                                                 tok.pad_token_id, temperature=0.8)
                     for m in (ref, policy))
    m = batch["completion_mask"]
    for i, row in enumerate(got):
        n = int(m[i].sum())
        assert row[:n].tolist() == pytest.approx(want[i, :n].tolist(), abs=1e-5), i
    assert (want - pol).abs().mul(m).max().item() > 1e-2  # the two models differ


def test_off_policy_update_with_micro_batches_that_split_a_minibatch(tiny_model_path):
    """minibatches=2, micro_batch_size=3: the behaviour pass chunks rows [0,1,2] [3,4,5] [6,7],
    the second optimizer step [4,5,6] [7]; the update equals the aligned one (4). On-policy: 1
    sequence a micro-batch gives the update of 8."""
    def run(micro, minibatches=2):
        policy, _ = rollout.load_model(tiny_model_path)
        before = [p.detach().clone() for p in policy.parameters()]
        # lr 0.1: the second step is off-policy (weights != 1), float32 rounding stays small
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        upd = _update(policy, opt, _batch((5, 2, 3, 1, 1, 1, 5, 2)), micro, minibatches)
        return upd, torch.cat([(p.detach() - q).flatten()
                               for p, q in zip(policy.parameters(), before)])

    aligned, d_aligned = run(4)
    split, d_split = run(3)
    assert (aligned["is_weight"][4:] - 1).abs().max() > 1e-3  # the second step is off-policy
    assert split["loss"] == pytest.approx(aligned["loss"], rel=1e-5)
    torch.testing.assert_close(split["is_weight"], aligned["is_weight"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_split, d_aligned, rtol=1e-4, atol=1e-5)
    one, d_one = run(1, minibatches=1)
    whole, d_whole = run(8, minibatches=1)
    assert one["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    torch.testing.assert_close(d_one, d_whole, rtol=1e-4, atol=1e-6)


# --- end to end on the tiny model -----------------------------------------------------------------

VOLATILE = ("time/", "memory/", "rollout/tokens_per_s", "val/seconds", "order/")


def _lines(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(VOLATILE)} for x in f]


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as f:
        for i in range(12):
            f.write(json.dumps({"question": f"What is {i} + {i + 1}?",
                                "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}) + "\n")
    return str(path)


def _rlme_args(model, data, out_dir, *extra):
    return ["model.policy=" + model, "model.dtype=float32", "data.train=" + data,
            "data.epochs=0", "rollout.backend=hf", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=6", "train.micro_batch_size=2",
            "train.parallel=ddp", "train.device=cpu", "optim.lr=1e-3", "optim.warmup_steps=2",
            "run.out_dir=" + str(out_dir), "run.save_every=1", "run.total_steps=2", *extra]


def test_rlme_run_and_exact_resume(tiny_model_path, gsm8k_file, tmp_path, capsys):
    """Two steps in one go == one step, then the same command resumed to two (as a run killed
    after its step-1 checkpoint): metrics.jsonl and samples.jsonl key by key, bit for bit. A
    newest checkpoint whose weights were cut short: one line, and the run resumes before it."""
    T.main(_rlme_args(tiny_model_path, gsm8k_file, tmp_path / "a"))
    T.main(_rlme_args(tiny_model_path, gsm8k_file, tmp_path / "b", "run.total_steps=1"))
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:  # a line a killed run left behind
        f.write(json.dumps({"step": 2, "loss": 123.0}) + "\n")
    T.main(_rlme_args(tiny_model_path, gsm8k_file, tmp_path / "b"))
    a, b = (_lines(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert [m["step"] for m in a] == [1, 2] and a == b
    assert a[0]["loss"] != 0.0 and a[0]["lr"] == pytest.approx(2e-3 / 3)  # next: (1 + 1) / 3
    for key in ("reward/mean", "accuracy", "rlvr_reward/mean", "rlme_reward/mean", "grad_norm",
                "completion/boxed_frac", "rlme/self/Is the answer correct?/p"):
        assert key in a[0], key
    assert _lines(tmp_path / "a" / "samples.jsonl") == _lines(tmp_path / "b" / "samples.jsonl")
    samples = _lines(tmp_path / "a" / "samples.jsonl")
    assert len(samples) == 8 and set(samples[0]["logp"]) == {"self"}
    weights = tmp_path / "a" / "checkpoints" / "step_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])  # killed while writing: "incomplete metadata"
    capsys.readouterr()
    T.main(_rlme_args(tiny_model_path, gsm8k_file, tmp_path / "a"))
    out = capsys.readouterr()
    skipped = [ln for ln in out.err.splitlines() if "[resume]" in ln]
    assert len(skipped) == 1 and "step_000002: SafetensorError" in skipped[0], out.err
    assert "resuming at step 1" in out.out and _lines(tmp_path / "a" / "metrics.jsonl") == a


def test_rm_nlhf_run_with_the_proxy_judge_and_resume(tiny_model_path, tmp_path):
    """RM-NLHF end to end (Algorithm 1) on the tiny GRM: the MetaRM cold start (its counts on the
    first line), GRPO + k3 KL, the MetaRM saved with each checkpoint and restored on resume."""
    args = ["task=rm_nlhf", "model.policy=" + tiny_model_path, "model.dtype=float32",
            "nlhf.dh=" + data_path("mr_ben_math", "math.jsonl"),
            "nlhf.do=" + data_path("hh_rlhf_harmless_base", "test.jsonl"), "judge.backend=proxy",
            "rollout.backend=hf", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "rollout.max_prompt_tokens=600", "algo.loss=grpo",
            "algo.advantage_std=true", "algo.kl_coef=0.001",
            "algo.aggregation=seq_mean_token_mean", "metarm.cold_start_items=1",
            "metarm.rollouts_per_prompt=2", "metarm.epochs=1", "metarm.batch_size=4",
            "metarm.max_length=256", "metarm.gradient_checkpointing=false",
            "train.micro_batch_size=1", "train.parallel=ddp", "train.device=cpu",
            "data.epochs=0", "run.out_dir=" + str(tmp_path), "run.save_every=1"]
    T.main(args + ["run.total_steps=1"])
    T.main(args + ["run.total_steps=2"])
    lines = _lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[0]["metarm/cold_start_rollouts"] == 2  # the cold start's counts: first line only
    assert "metarm/cold_start_rollouts" not in lines[1]
    for key in ("nlhf/format_error_rate", "nlhf/outcome_acc", "judge/calls", "reward/mean", "loss"):
        assert key in lines[1], key
    ckpt = tmp_path / "checkpoints" / sorted(os.listdir(tmp_path / "checkpoints"))[-1]
    assert (ckpt / "metarm" / "metarm.json").is_file()
    sets = {r["set"] for r in _lines(tmp_path / "samples.jsonl")}
    assert sets == {"dh", "do"}


def test_rm_nlhf_lambda_0_runs_without_a_judge_server(tiny_model_path, tmp_path):
    """λ = 0 (Table 3 "w/o process reward", Fig. 3's outcome-only arm): no judge is built, so a
    judge.base_url where nothing listens stops nothing; the MetaRM cold start and a step run."""
    args = ["task=rm_nlhf", "model.policy=" + tiny_model_path, "model.dtype=float32",
            "nlhf.dh=" + data_path("mr_ben_math", "math.jsonl"),
            "nlhf.do=" + data_path("hh_rlhf_harmless_base", "test.jsonl"), "nlhf.lam=0",
            "judge.backend=openai", f"judge.base_url=http://127.0.0.1:{free_port()}/v1",
            "judge.model=nobody", "rollout.backend=hf", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=8",
            "rollout.max_prompt_tokens=600", "algo.loss=grpo", "algo.advantage_std=true",
            "metarm.cold_start_items=1", "metarm.rollouts_per_prompt=2", "metarm.epochs=1",
            "metarm.batch_size=4", "metarm.max_length=256", "metarm.gradient_checkpointing=false",
            "train.micro_batch_size=1", "train.device=cpu", "data.epochs=0",
            "run.out_dir=" + str(tmp_path), "run.total_steps=1"]
    T.main(args)
    (line,) = _lines(tmp_path / "metrics.jsonl")
    assert (line["step"], line["judge/calls"], line["metarm/cold_start_rollouts"]) == (1, 0, 2)
    assert all(r["reward"] in (-1.0, 0.0, 1.0) for r in _lines(tmp_path / "samples.jsonl")
               if r["set"] == "dh")


def test_lora_validation_tensorboard_and_early_stop(tiny_model_path, gsm8k_file, tmp_path):
    """LoRA, validation every step from step 0 on a held-out draw, TensorBoard; then the early
    stop fires, writes early_stop.json, and the same command stops at start-up."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    args = _rlme_args(tiny_model_path, gsm8k_file, tmp_path, "run.total_steps=1",
                      "model.lora={r: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj]}",
                      "data.val=holdout", "data.val_size=2", "run.eval_every=1",
                      "run.eval_at_start=true", "run.tensorboard=true")
    T.main(args)
    lines = _lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in lines] == [0, 1] and "loss" not in lines[0]
    for m in lines:
        assert m["val/n"] == 2 and 0 <= m["val/accuracy"] <= 1, m
        assert {"val/reward_mean", "val/canary/colon", "val/boxed_frac"} <= set(m)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1]
    assert [e.step for e in events.Scalars("val/accuracy")] == [0, 1]
    assert os.path.isfile(tmp_path / "checkpoints" / "step_000001" / "adapter_model.safetensors")
    # the rule: each of the last `patience` accuracies more than `drop` below the best
    state = {"history": [{"step": 0, "accuracy": 0.9, "train_reward": None}], "rank": 0,
             "rewards_since_eval": [-1.0], "bar": None}
    assert T.watch(state, {"step": 1, "val/accuracy": 0.3}, {"reward/mean": -1.0},
                   out_dir=str(tmp_path), drop=0.5, patience=1)
    with open(tmp_path / "early_stop.json") as f:
        assert json.load(f)["best_step"] == 0
    T.main(args + ["run.total_steps=2"])  # stopped: nothing more is trained
    assert len(_lines(tmp_path / "metrics.jsonl")) == 2


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_torchrun_two_processes(parallel, tiny_model_path, gsm8k_file, tmp_path):
    """torchrun, 2 CPU processes over gloo: DDP and FSDP2 train, every rank's samples reach
    samples.jsonl, and the run checkpoints."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(REPO, "train.py"),
           *_rlme_args(tiny_model_path, gsm8k_file, tmp_path, "run.total_steps=1",
                       "rollout.prompts_per_step=2", "train.parallel=" + parallel)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    samples = _lines(tmp_path / "samples.jsonl")
    assert sorted({r["rank"] for r in samples}) == [0, 1] and len(samples) == 4
    assert math.isfinite(_lines(tmp_path / "metrics.jsonl")[0]["grad_norm"])
    assert os.path.isdir(tmp_path / "checkpoints" / "step_000001")


# === the run machinery ============================================================================
PRESETS = sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/configs/**/*.yaml",
                                                              recursive=True))


def layers(preset):
    """The --config files of the first train.py command in the preset's header (how the README
    runs it: Table 3/10 rows on top of configs/paper/rm_nlhf_qwen7b.yaml, ...), else itself."""
    line = next((ln for ln in open(os.path.join(REPO, preset)) if "train.py" in ln
                 and "--config" in ln), "")
    return [os.path.join(REPO, p) for p in re.findall(r"--config (\S+)", line)] or [
        os.path.join(REPO, preset)]


def one_line_error(paths=(), overrides=()):
    with pytest.raises(SystemExit) as e:
        load_config(list(paths), list(overrides))
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


# --- config ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_as_its_header_layers_it(preset):
    ls = layers(preset)
    assert os.path.join(REPO, preset) in ls
    cfg = load_config(ls)
    raw = yaml.safe_load(open(os.path.join(REPO, preset))) or {}
    for sec, vals in raw.items():  # the preset's own numbers arrive (it is the last layer)
        for k, v in (vals.items() if isinstance(vals, dict) else [(None, vals)]):
            got = cfg[sec] if k is None else cfg[sec][k]
            if k not in ("lora", "evaluators", "meta_questions"):  # these get defaults filled in
                assert got == v, (preset, sec, k)


def test_paper_rows_layer_on_the_paper_preset():
    ls = layers("configs/paper/ablations/binary.yaml")
    assert ls[:2] == [f"{REPO}/configs/paper/{p}.yaml" for p in ("rm_nlhf_qwen7b",
                                                                  "table10/qwen7b")]
    cfg = load_config(ls)
    assert (cfg["metarm"]["mode"], cfg["nlhf"]["split_dh_fraction"], cfg["run"]["total_steps"],
            cfg["rollout"]["max_new_tokens"], cfg["algo"]["kl_coef"]) == ("binary", 0.5, 150,
                                                                         8192, 0.001)


def test_config_yaml_has_at_most_100_keys_each_on_one_short_commented_line():
    text = open(os.path.join(REPO, "config.yaml")).read()
    assert max(len(ln) for ln in text.splitlines()) <= 100
    assert len(list(T._keys(yaml.safe_load(text)))) <= 100
    for ln in text.splitlines():  # every key line carries its comment (sections and lists aside)
        if re.match(r"\s*\w+: \S", ln) and not ln.rstrip().endswith(":"):
            assert "#" in ln or ln.lstrip().startswith(("prompt_template", "- ")), ln


def test_layering_and_overrides(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("rollout:\n  group_size: 4\n  max_new_tokens: 64\n")
    b.write_text("rollout:\n  group_size: 2\n")
    cfg = load_config([str(a), str(b)], ["optim.lr=3e-6", "run.out_dir=/tmp/x", "algo.eps_high=5"])
    assert cfg["rollout"]["group_size"] == 2 and cfg["rollout"]["max_new_tokens"] == 64
    assert cfg["optim"]["lr"] == 3e-6 and cfg["run"]["out_dir"] == "/tmp/x"
    assert cfg["algo"]["eps_high"] == 5.0 and isinstance(cfg["algo"]["eps_high"], float)
    assert cfg["algo"]["eps_low"] == 1.0  # untouched default
    lora = "model.lora={r: 8, alpha: 16, target_modules: all-linear}"  # null default: any value
    assert load_config([], [lora, "train.parallel=ddp", "rollout.backend=hf"])["model"]["lora"][
        "dropout"] == 0.0
    assert load_config([], ["judge.temperature=null"])["judge"]["temperature"] is None
    mq = load_config([], ["reward.meta_questions=[{question: q}]"])["reward"]["meta_questions"]
    assert mq == [{"question": "q", "weight": 1.0, "target": "Yes", "negative": "No"}]
    ev = load_config([], ["reward.evaluators=[{kind: frozen_self}]"])["reward"]["evaluators"][0]
    assert ev == {"kind": "frozen_self", "name": "frozen_self0", "weight": 1.0, "path": None,
                  "chat_template": "auto", "chat_template_kwargs": None, "system_prompt": None}


@pytest.mark.parametrize("overrides, message", [
    (["run.total_step=3"], "override 'run.total_step=3': unknown config key run.total_step "
                           "(did you mean run.total_steps?)"),
    (["rollout.group_sise=4"], "(did you mean rollout.group_size?)"),
    (["train.fast_paths=false"], "unknown config key train.fast_paths"),
    (["nlhf.val=holdout"], "unknown config key nlhf.val (did you mean data.val?)"),
    (["metarm.temperature=0.7"], "(did you mean rollout.temperature?)"),
    (["rollout.group_size=four"], "config key rollout.group_size: expected int, got 'four'"),
    (["run.total_steps=null"], "config key run.total_steps: expected int, got None"),
    (["run.tensorboard=1"], "config key run.tensorboard: expected bool, got 1"),
    (["optim.lr=fast"], "config key optim.lr: expected float, got 'fast'"),
    (["rollout=5"], "config key rollout: must be a mapping"),
    (["algo.loss=ppo"], "config key algo.loss: expected one of ['cispo', 'grpo'], got 'ppo'"),
    (["model.gradient_checkpointing=true"], "expected one of ['none', 'full']"),
    (["judge.variant=coarse"], "expected one of ['core', 'all', 'meta_judge', 'authors'], got 'coarse'"),
    (["optim.lr"], "override 'optim.lr': expected key.sub=value"),
    (["configs/cpu.yaml"], "expected key.sub=value (files go after --config)"),
    (["reward.meta_questions=[{question: Is it right?, weight: 1}]"], "not valid YAML"),
    (["reward.evaluators=[{name: self, kind: live, wieght: 1.0}]"],
     "config key reward.evaluators[0].wieght: unknown (did you mean weight?)"),
    (["reward.meta_questions=[{question: q, taget: Yes}]"], "taget: unknown (did you mean target"),
    (["reward.meta_questions=[{weight: 1}]"], "reward.meta_questions: each needs a question"),
    (["reward.meta_questions=[{question: q, target: ''}]"], "needs a question, a target"),
    (["reward.meta_questions=[]"], "reward.meta_questions: expected a non-empty list"),
    (["reward.meta_questions=[{question: a, weight: 0}]"], "every weight is 0"),
    (["reward.evaluators=[{kind: frozen}]"], "kind must be live, frozen_self, frozen"),
    (["reward.evaluators=[{kind: judge}]"], "reward.evaluators[0]: kind must be live"),
    (["reward.evaluators=[{kind: remote, model: m}]"], "or remote (needs base_url, model)"),
    (["reward.evaluators=[{name: a}, {name: a, kind: frozen_self}]"], "names must be unique"),
    (["train.parallel=ddp", "model.lora={r: 8, alpah: 16, target_modules: all-linear}"],
     "config key model.lora.alpah: unknown"),
    (["train.parallel=ddp", "model.lora={r: 0, alpha: 16, target_modules: [q_proj]}"],
     "config key model.lora: needs r > 0"),
    (["train.parallel=ddp", "model.lora={r: 8, alpha: 16}"], "config key model.lora: needs r > 0"),
    (["model.lora={r: 8, alpha: 16, target_modules: [q_proj]}"], "lora: needs train.parallel"),
    (["algo.kl_coef=0.01"], "config key algo.kl_coef: needs algo.loss grpo"),
    (["rollout.group_size=1"], "config key rollout.group_size: must be >= 2"),
    (["rollout.prompts_per_step=0"], "config key rollout.prompts_per_step: must be >= 1"),
    (["optim.lr=nan"], "config key optim.lr: expected float, got nan"),
    (["reward.evaluators=[{name: self, kind: live, weight: .inf}]"],
     "config key reward.evaluators[0].weight: bad value inf"),
    (["optim.lr=-1"], "config key optim: lr > 0; weight_decay, grad_clip, warmup_steps >= 0"),
    (["nlhf.lam=1.5"], "config key nlhf.dh_per_step / lam / threshold: must be in [0, 1]"),
    (["algo.minibatches=3"], "config key algo.minibatches: must divide the 64 groups of a rank"),
    (["rollout.top_p=1.5"], "config key rollout.temperature / top_p: > 0"),
    (["rollout.temperature=0"], "rollout.temperature / top_p"),
    (["nlhf.split_dh_fraction=0.5"], "only with nlhf.do: null"),
    (["metarm.mode=binary", "nlhf.gate_on_outcome=false"], "need gate_on_outcome"),
    (["model.dtype=float16"], "model.dtype: expected one of ['float32', 'bfloat16']"),
    (["rollout.backend=vllm", "train.parallel=ddp", "model.lora={r: 8, alpha: 16, target_modules: "
      "all-linear}"], "model.lora: needs rollout.backend hf"),
    (["run.early_stop_drop=0.1"], "set both or neither"),
    (["run.eval_every=5"], "run.eval_every / data.val: both or none"),
    (["data.val=holdout"], "run.eval_every / data.val: both or none"),
    (["data.answer_field=null", "reward.kind=rlvr"], "reward.kind: needs labels"),
    (["data.prompt_template='{problem}'"], "config key data.prompt_template: needs {question}"),
])
def test_bad_input_is_one_line_naming_the_key(overrides, message):
    assert message in one_line_error(overrides=overrides)


def test_bad_files_and_an_unsplittable_world_are_one_line(tmp_path, monkeypatch):
    bad, typo, listed = tmp_path / "bad.yaml", tmp_path / "typo.yaml", tmp_path / "list.yaml"
    bad.write_text("run:\n  seed: 1\n rollout: [\n")
    typo.write_text("run:\n  total_steps: 3\n  totl_steps: 4\n")
    listed.write_text("- a\n- b\n")
    assert one_line_error([bad]).startswith(f"config file {bad}: invalid YAML at line 3")
    assert one_line_error([typo]) == (f"config file {typo}: unknown config key run.totl_steps "
                                      "(did you mean run.total_steps?)")
    assert one_line_error([listed]).startswith(f"config file {listed}: the file must be a mapping")
    assert "No such file" in one_line_error([tmp_path / "none.yaml"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_config([], ["rollout.prompts_per_step=8"])["rollout"]["prompts_per_step"] == 8
    assert "rollout.prompts_per_step: not divisible by 4" in one_line_error(
        overrides=["rollout.prompts_per_step=6"])


# --- checkpoints ----------------------------------------------------------------------------------

class Tok:  # the tokenizer's part in a checkpoint, without loading one
    def save_pretrained(self, path):
        open(os.path.join(path, "tokenizer.json"), "w").write("{}")


def tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, tie_word_embeddings=True))


def train_steps(model, steps=2, warmup=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, T.lr_lambda(warmup))
    for s in range(steps):
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(s))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
    return opt, sched


def opt_tensors(opt):
    return [t for s in opt.state_dict()["state"].values() for t in s.values()]


def test_lr_lambda_and_a_checkpoint_round_trip_is_exact(tmp_path):
    from transformers import LlamaForCausalLM
    assert [T.lr_lambda(3)(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert T.lr_lambda(0)(0) == 1.0
    model = tiny()
    opt, sched = train_steps(model)
    T.save_checkpoint(str(tmp_path), 2, model, Tok(), opt, sched, keep=2)
    ckpt = T.latest_checkpoint(str(tmp_path))
    assert ckpt == str(tmp_path / "checkpoints" / "step_000002")
    assert not glob.glob(f"{tmp_path}/checkpoints/*.tmp")
    back = LlamaForCausalLM.from_pretrained(ckpt)  # the weights: a plain HF folder, float32
    for (n, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b) and b.dtype == torch.float32, n
    opt2 = torch.optim.AdamW(back.parameters(), lr=1e-2, weight_decay=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, T.lr_lambda(3))
    assert T.load_checkpoint(ckpt, back, opt2, sched2) == 2
    assert all(torch.equal(a, b) for a, b in zip(opt_tensors(opt), opt_tensors(opt2)))
    assert sched2.state_dict()["last_epoch"] == 2 and opt2.param_groups[0]["lr"] == 0.75e-2
    train_steps(model, 1), train_steps(back, 1)  # and the next step is the same step


def test_keep_newest_and_a_truncated_newest_falls_back_in_one_line(tmp_path, capsys):
    from safetensors.torch import save_file
    model = tiny()
    opt, sched = train_steps(model, 1)

    def metarm(folder):  # what `extra` adds (the MetaRM): its weights are checked too
        os.makedirs(f"{folder}/metarm")
        save_file({"w": torch.ones(64)}, f"{folder}/metarm/model.safetensors")
    for step in (1, 2, 3):
        T.save_checkpoint(str(tmp_path), step, model, Tok(), opt, sched, keep=2, extra=metarm)
    os.makedirs(tmp_path / "checkpoints" / "step_000009.tmp")  # a crash mid-write: ignored
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_000002", "step_000003", "step_000009.tmp"]
    for name in ("model.safetensors", "metarm/model.safetensors"):
        weights = tmp_path / "checkpoints" / "step_000003" / name
        data = weights.read_bytes()
        for cut in (len(data) // 2, 20):  # cut inside the tensors, then inside the header
            weights.write_bytes(data[:cut])
            assert T.latest_checkpoint(str(tmp_path)).endswith("step_000002")
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
            assert len(err) == 1 and "skipping checkpoint" in err[0] and "step_000003" in err[0]
        weights.write_bytes(data)
        assert T.latest_checkpoint(str(tmp_path)).endswith("step_000003")
    os.remove(tmp_path / "checkpoints" / "step_000003" / "trainer_state.pt")
    os.remove(tmp_path / "checkpoints" / "step_000002" / "optimizer" / ".metadata")
    assert T.latest_checkpoint(str(tmp_path)) is None
    assert T.latest_checkpoint(str(tmp_path / "nothing")) is None


# --- the run lock ---------------------------------------------------------------------------------

HOLD = ("import sys, time; sys.path.insert(0, {repo!r}); import train; "
        "h = train.lock_run({out!r}); print('held', flush=True); time.sleep(600)")


def test_a_second_live_run_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=REPO, out=out)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=rf"^[^\n]*another run \(pid {p.pid}\) is using "):
            T.lock_run(out)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    h = T.lock_run(out)  # the dead holder's lock (its pid still in the file) is taken over
    assert open(os.path.join(out, "run.lock")).read() == str(os.getpid())
    assert T.lock_run(out, rank=1) is None  # only rank 0 locks
    h.close()


# --- processes, wrapping, LoRA --------------------------------------------------------------------

def test_one_process_ddp_is_the_policy_and_an_fsdp2_checkpoint_reads_back(tmp_path):
    """DDP alone: no group, reductions are identities, the policy unwrapped. FSDP2 (one CPU
    process, gloo): the saved weights are the full float32 model, and its sharded AdamW state
    loads into a plain model."""
    from transformers import LlamaForCausalLM
    rank, world, device = T.setup_process_group("cpu", "ddp")
    assert (rank, world, device.type) == (0, 1, "cpu") and not torch.distributed.is_initialized()
    assert T.all_sum(3, 1) == 3.0 and T.gather_records([{}], 1) == [{}]
    plain = tiny()
    assert T.wrap_policy(plain, "ddp", 1, device) is plain
    try:
        rank, world, device = T.setup_process_group("cpu", "fsdp2")
        wrap = lambda m: T.wrap_policy(m, "fsdp2", world, device, gradient_checkpointing="full")
        sharded = wrap(tiny())  # every rank loads the whole model, then keeps its shard
        assert type(sharded).__name__.startswith("FSDP")
        with T.unsharded(sharded):
            full = {n: p.detach().clone() for n, p in sharded.named_parameters()}  # gathered
        assert all(torch.equal(full[n], p) for n, p in plain.named_parameters())
        opt, sched = train_steps(sharded, 1)
        popt, psched = train_steps(plain, 1)
        T.save_checkpoint(str(tmp_path), 1, sharded, Tok(), opt, sched, keep=1)
        ckpt = T.latest_checkpoint(str(tmp_path))
    finally:
        torch.distributed.destroy_process_group()
    back = LlamaForCausalLM.from_pretrained(ckpt)
    for a, b in zip(plain.parameters(), back.parameters()):
        torch.testing.assert_close(a, b)  # FSDP2 trained the same step
    opt2, sched2 = train_steps(back, 0)
    T.load_checkpoint(ckpt, back, opt2, sched2)
    for a, b in zip(opt_tensors(popt), opt_tensors(opt2)):
        torch.testing.assert_close(a, b)


def test_lora_adapters_round_trip_and_the_base_view_is_the_initial_policy(tmp_path):
    base = tiny()
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = base(input_ids=ids).logits
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    model = T.apply_lora(base, lora, seed=0)
    torch.testing.assert_close(model(input_ids=ids).logits, ref)  # B = 0: the base at step 0
    opt, sched = train_steps(model, 2)
    assert not torch.allclose(model(input_ids=ids).logits, ref)
    torch.testing.assert_close(T.BaseModelView(model)(input_ids=ids).logits, ref)
    T.save_checkpoint(str(tmp_path), 2, model, Tok(), opt, sched, keep=1)
    ckpt = T.latest_checkpoint(str(tmp_path))
    assert os.path.isfile(os.path.join(ckpt, "adapter_model.safetensors"))
    back = T.apply_lora(tiny(), lora, seed=0, ckpt=ckpt)
    torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(SystemExit, match="no Linear layer 'qq_proj'"):
        T.apply_lora(tiny(), {**lora, "target_modules": ["qq_proj"]}, seed=0)


def test_each_task_arm_runs_a_step_and_the_figure_draws(tiny_model_path, tmp_path):
    """configs/tasks/: one step of each arm of the miniature Fig. 2 at tiny size (held-out
    accuracy at steps 0 and 1), then `evaluate.py plot` of all four (no timing here)."""
    import evaluate
    runs = []
    for arm in ("rlvr", "rlme_live", "rlme_frozen", "format_only"):
        T.main(["--config", f"{REPO}/configs/tasks/larger.yaml", "--config",
                f"{REPO}/configs/tasks/{arm}.yaml", "model.policy=" + tiny_model_path,
                f"data.train={REPO}/tasks/larger/train.jsonl",
                f"data.val={REPO}/tasks/larger/val.jsonl", "data.val_size=4",
                "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                "run.total_steps=1", "run.eval_every=1", f"run.out_dir={tmp_path / arm}"])
        lines = _lines(tmp_path / arm / "metrics.jsonl")
        assert [m["step"] for m in lines] == [0, 1] and "val/accuracy" in lines[1], arm
        assert any(k.startswith("rlme/") for k in lines[1]) == (arm != "rlvr"), arm
        runs.append(f"{arm}={tmp_path / arm / 'metrics.jsonl'}")
    rows = evaluate.main(["plot", *runs, "--out", str(tmp_path / "plot")])
    assert (tmp_path / "plot" / "curves.png").stat().st_size > 0 and len(rows) == 8
