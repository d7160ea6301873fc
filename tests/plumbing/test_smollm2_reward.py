"""The RLME reward on the real SmolLM2-135M (slow): the shared-prefix scorer against the plain one, and two evaluators x two meta-questions with renormalisation."""
import pytest
import torch

import fast
import reward as R


@pytest.mark.slow
def test_shared_prefix_scoring_equals_plain(smollm2):
    """score_targets, with and without groups, == score_targets_plain on the real SmolLM2, chat and
    plain evaluator prompts, K = 3 questions, a multi-token target, an empty solution."""
    model, tok = smollm2
    qs = ["Is the answer correct?", "Is the solution shorter than 100 words?", "Is the final answer boxed?"]
    sols = [r"2 + 3 = 5, so \boxed{5}.", r"Is the answer correct? Yes. \boxed{6}", "", "I think it is 4"]
    for chat in (True, False):
        prompts, targets = [], []
        for s in sols:
            ps, ts = zip(*[R.evaluator_prompt_and_target_ids(
                tok, R.build_evaluator_text(R.DEFAULT_EVALUATOR_TEMPLATE, "What is 2+3?", s, q, qs),
                "Yes" if k < 2 else "Yes, it is", chat) for k, q in enumerate(qs)])
            prompts.append(list(ps))
            targets.append(list(ts))
        # micro-batches of 3 samples; samples 0-2 are one group (same problem), 3 its own
        fast_lp = fast.score_targets(model, prompts, targets, tok.pad_token_id, micro_batch_size=3, groups=[0, 0, 0, 1])
        alone = fast.score_targets(model, prompts, targets, tok.pad_token_id, micro_batch_size=3)
        plain = R.score_targets(model, prompts, targets, tok.pad_token_id)
        assert torch.allclose(fast_lp, plain, atol=1e-4) and torch.allclose(alone, plain, atol=1e-4)


@pytest.mark.slow
def test_rlme_reward_two_evaluators_two_questions(smollm2):
    model, tok = smollm2
    mq = [{"question": "Is the answer correct?", "weight": 1.0, "target": "Yes"},
          {"question": "Is the answer a whole number?", "weight": 0.5, "target": "Yes"}]
    evs = [R.local_evaluator(model, tok, chat=True, name="chat", weight=1.0),
           R.local_evaluator(model, tok, chat=False, name="plain", weight=2.0)]
    out = R.rlme_reward(evs, mq, ["What is 2+3?"], [r"\boxed{5}"])
    lp = out["logp"][0]
    assert out["reward"].item() == pytest.approx(
        1.0 * (lp[0, 0] + 0.5 * lp[0, 1]).item() + 2.0 * (lp[1, 0] + 0.5 * lp[1, 1]).item(), abs=1e-5)
    assert (lp < 0).all()
    # renormalised over {Yes, No}: p(Yes) + p(No) = 1 after renormalising
    rn = R.rlme_reward(evs[:1], mq[:1], ["What is 2+3?"], [r"\boxed{5}"], renormalize=True)
    yes = rn["logp"][0, 0, 0].exp().item()
    no_mq = [{"question": "Is the answer correct?", "weight": 1.0, "target": "No"}]
    no = R.rlme_reward(evs[:1], no_mq, ["What is 2+3?"], [r"\boxed{5}"], renormalize=False)["logp"][0, 0, 0].exp().item()
    raw_yes = out["logp"][0, 0, 0].exp().item()
    assert yes == pytest.approx(raw_yes / (raw_yes + no), abs=1e-5)
