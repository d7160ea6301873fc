"""train.py: advantages, CISPO / GRPO losses (values and gradients by hand), normalisers and
aggregations, the update's passes; end to end on a tiny model: RLME, RM-NLHF (proxy judge), exact
resume, LoRA, validation + early stop, TensorBoard, torchrun DDP and FSDP2."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import rollout
import train as T
from conftest import REPO, data_path, free_port, make_tiny_model


def cispo(logp, behaviour, adv, mask, aggregation="seq_sum"):
    return T.cispo_loss(logp, behaviour, adv, mask, eps_low=1.0, eps_high=5.0,
                        aggregation=aggregation)


def grpo(logp, behaviour, adv, mask, aggregation):
    return T.grpo_loss(logp, behaviour, adv, mask, clip_eps=0.2, kl_coef=0.0,
                       aggregation=aggregation)


# --- advantages (RLME Eq. 5; RM-NLHF Eq. 1-2 for GRPO's / std) ----------------------------------

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


def test_advantages_skip_invalid_samples():
    r = torch.tensor([1.0, 0.0, 5.0, float("nan")])
    a = T.group_advantages(r, 4, valid=torch.tensor([True, True, True, False]))
    assert a.tolist() == pytest.approx([-1.0, -2.0, 3.0, 0.0])


# --- CISPO (RLME Eq. 6-8, MiniMax-M1) -----------------------------------------------------------

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


def test_cispo_token_mean_and_dr_grpo_normalisers():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.5, -1.0])
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


def test_cispo_long_sequence_does_not_overflow():
    # 100 tokens each with log-ratio 1.0: exp(100) overflows float32 without log-space clipping
    logp = torch.zeros(1, 100, requires_grad=True)
    loss_sum, st = cispo(logp, torch.full((1, 100), -1.0), torch.tensor([2.0]), torch.ones(1, 100))
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == pytest.approx(-6.0 * 2.0)  # weight clipped at 1 + 5 = 6
    assert st["clipped"].item()


def test_cispo_geometric_mean_ratio():
    logp = torch.zeros(1, 4, requires_grad=True)
    _, st = T.cispo_loss(logp, torch.full((1, 4), -0.25), torch.tensor([1.0]), torch.ones(1, 4),
                         eps_low=1.0, eps_high=5.0, ratio="geometric_mean")  # sum 1.0, mean 0.25
    assert st["is_weight"].item() == pytest.approx(math.exp(0.25), rel=1e-6)


# --- GRPO (RM-NLHF Eq. 3) and the k3 KL ----------------------------------------------------------

def test_k3_kl_value_and_gradient():
    logp = torch.tensor([-1.0], requires_grad=True)
    kl = T.k3_kl(logp, torch.tensor([-1.5]))
    assert kl.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-7)  # 0.1065307
    kl.backward()
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.5), abs=1e-7)  # 0.3934693


def test_grpo_token_clip_and_kl():
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


# --- the update's passes on a tiny model ---------------------------------------------------------

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
                           max_new_tokens=5,
                           updates_per_batch=1, minibatches=minibatches, group_size=2,
                           micro_batch_size=micro, grad_clip=0.0, temperature=0.8, pad_id=0,
                           ref_model=ref)


def test_reference_pass_is_the_reference_model_alone(tiny_model_path, tmp_path):
    """GRPO's k3 KL compares the policy with the reference: the no-grad reference pass runs the
    prompt AND the completion through the reference model alone (an earlier version built the
    prompt's cache with the policy: a hybrid up to 0.1 nats off)."""
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
    """minibatches=2 with micro_batch_size=3: the no-grad behaviour pass chunks rows [0,1,2]
    [3,4,5] [6,7] but the second optimizer step chunks them [4,5,6] [7], so a row's behaviour
    log-probs must cover any micro-batch width. The update must equal the one with micro-batches
    that line up (4); and 1 sequence a micro-batch gives the same on-policy update as 8."""
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


# --- end to end on the tiny model ---------------------------------------------------------------

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


def test_rlme_run_and_exact_resume(tiny_model_path, gsm8k_file, tmp_path):
    """Two steps in one go == one step, then the same command resumed to two (as a run killed
    after its step-1 checkpoint): metrics.jsonl and samples.jsonl key by key, bit for bit."""
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


def test_lora_validation_tensorboard_and_early_stop(tiny_model_path, gsm8k_file, tmp_path):
    """LoRA (adapters only train), validation every step from step 0 on a held-out draw, the
    TensorBoard scalars; then the early-stop rule fires (a fall of more than drop for patience
    evaluations), writes early_stop.json, and the same command stops at start-up."""
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
    cfg = {"run": {"out_dir": str(tmp_path), "early_stop_drop": 0.5, "early_stop_patience": 1}}
    assert T.watch(state, cfg, {"step": 1, "val/accuracy": 0.3}, {"reward/mean": -1.0})
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
