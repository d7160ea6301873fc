"""train.py: advantages, CISPO/GRPO loss values and gradients, normalisers, layout equivalence,
config and data errors."""
import math

import pytest
import torch

from conftest import frozen_logprobs, loss_fn, update_policy
import rollout
import train as T

from plumbing.models import load_model


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


def test_unbiased_std_advantages_by_hand():
    """algo.std_unbiased (the RM-NLHF release's verl GRPO divides by torch.std, n - 1): rewards
    (1, 0, 0, 0): deviations (0.75, -0.25, -0.25, -0.25), squares sum 0.75, / 3 = 0.25, std 0.5, so
    A = (1.5, -0.5, -0.5, -0.5) up to the 1e-6. With the 3rd sample invalid, (1, 0, 0) over 3:
    deviations (2/3, -1/3, -1/3), squares 6/9, / 2 = 1/3, std 0.57735: A_1 = 1.1547 (population: 1.4142)."""
    a = T.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, std=True, unbiased=True)
    assert a.tolist() == pytest.approx([0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001], abs=1e-6)
    valid = torch.tensor([True, True, False, True])
    a = T.group_advantages(torch.tensor([1.0, 0.0, 9.0, 0.0]), 4, std=True, valid=valid, unbiased=True)
    s = math.sqrt(1 / 3)
    assert a.tolist() == pytest.approx([(2 / 3) / (s + 1e-6), (-1 / 3) / (s + 1e-6), 0.0, (-1 / 3) / (s + 1e-6)], abs=1e-6)
    assert a[0].item() == pytest.approx(1.1547, abs=1e-4)
    one = T.group_advantages(torch.tensor([1.0, 0.0]), 2, std=True, valid=torch.tensor([True, False]), unbiased=True)
    assert one.tolist() == [0.0, 0.0]  # n = 1: no NaN
    from plumbing import config
    with pytest.raises(SystemExit) as e:
        config.load_config([], ["algo.std_unbiased=true"])
    assert str(e.value) == "config key algo.std_unbiased=true changes nothing with algo.advantage_std=false (no std is divided by)"
    assert config.load_config([], ["algo.std_unbiased=true", "algo.advantage_std=true", "algo.loss=grpo"])["algo"]["std_unbiased"]


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
        loss_sum, _ = loss_fn(algo)(logp, None, adv, mask)  # on-policy: weight 1
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
    loss_sum, _ = loss_fn(algo)(logp, None, adv, mask)
    norm = T.loss_normaliser(algo["aggregation"], 2, 3, 3)
    assert norm == 2
    loss = loss_sum / norm
    assert loss.item() == pytest.approx(0.25, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-0.25, -0.25, 0.0]), pytest.approx([1.0, 0.0, 0.0])]
    # token_mean on the same numbers: (1 + 2 - 1) / 3 tokens, the 1-token row weighs half as much
    tm = dict(ALGO, aggregation="token_mean")
    assert (loss_fn(tm)(logp, None, adv, mask)[0] / T.loss_normaliser(tm["aggregation"], 2, 3, 3)).item() == pytest.approx(2 / 3)


def test_micro_batch_token_mean_is_the_released_verl_token_mean():
    """algo.aggregation micro_batch_token_mean = the RM-NLHF release's loss (verl 0.4.1 with
    use_dynamic_bsz, dp_actor.update_policy: each micro-batch's token-mean loss x len(micro-batch) /
    ppo_mini_batch_size). Five sequences of 16, 1, 1, 1, 1 tokens, on-policy GRPO (ratio 1) with
    advantages -1, 0, 0, 0, 0: per-token loss 1 on sequence 0's 16 tokens, 0 elsewhere. By hand:
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
        fn = loss_fn(dict(ALGO, loss="grpo", clip_eps=0.2, kl_coef=0.0, aggregation=aggregation))
        total = sum(fn(logp[rows], None, adv[rows], mask[rows])[0] for rows in packing)
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
    assert loss("token_mean", pairs)[0] == pytest.approx(0.80)  # our global token mean: packing-free
    for packing in (alone, pairs, [list(range(5))]):
        assert loss("seq_mean_token_mean", packing)[0] == pytest.approx(0.20)
    assert T.loss_normaliser("micro_batch_token_mean", 5, 20, 16) == 5


def test_cispo_long_sequence_does_not_overflow():
    # 100 tokens each with log-ratio 1.0: exp(100) overflows float32 without log-space clipping
    logp = torch.zeros(1, 100, requires_grad=True)
    behaviour = torch.full((1, 100), -1.0)
    mask = torch.ones(1, 100)
    loss_sum, st = loss_fn(ALGO)(logp, behaviour, torch.tensor([2.0]), mask)
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == pytest.approx(-6.0 * 2.0)  # weight clipped at 1 + eps_high = 6
    assert st["clipped"].item()


def test_cispo_geometric_mean_ratio():
    logp = torch.zeros(1, 4, requires_grad=True)
    behaviour = torch.full((1, 4), -0.25)  # sum 1.0, mean 0.25
    algo = dict(ALGO, ratio="geometric_mean")
    _, st = loss_fn(algo)(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 4))
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
    logp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    behaviour = torch.zeros(1, 2)
    ref = torch.tensor([[0.0, 0.0]])
    loss_sum, st = T.grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2, kl_coef=0.001,
                               ref_logp=ref, aggregation="token_mean")
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


# --- config (docs/method.md §3) --------------------------------------------------------------------------------


# --- data ---------------------------------------------------------------------------------------------


def test_step_items_whole_groups_per_rank_and_resume_order():
    items = [{"index": i} for i in range(10)]
    full = rollout.step_items(items, 3, 4, seed=0, rank=0, world=1)
    halves = rollout.step_items(items, 3, 4, 0, 0, 2) + rollout.step_items(items, 3, 4, 0, 1, 2)
    assert [x["index"] for x in full] == [x["index"] for x in halves]
    # the stream covers every item once per epoch
    epoch = [x["index"] for s in range(5) for x in rollout.step_items(items, s, 2, 0, 0, 1)]
    assert sorted(epoch) == list(range(10))


# --- plain twins: every pass of the update, fast == plain (issue 13) -------------------------------


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory):
    from conftest import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_ref"), seed=1)


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
