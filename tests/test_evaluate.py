"""evaluate.py: hand-computed numbers for every metric, bracket, summary and validation rule; one
CLI run per subcommand (fake generation where the numbers are hand-computed, the tiny random
model where the path is the point). Fixtures: tests/fixtures/ (markers in its README)."""
import json
import math
import os
import random
import types

import pytest
import torch

import data
import evaluate
import reward
import rollout
from conftest import REPO, data_path

FIXTURES = os.path.join(REPO, "tests", "fixtures")
HS3 = os.path.join(FIXTURES, "helpsteer3_sample.jsonl")
RB2 = os.path.join(FIXTURES, "reward_bench_2_sample.jsonl")
FAITHEVAL = os.path.join(FIXTURES, "faitheval_counterfactual_sample.jsonl")

def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)

def one_line_exit(argv, *needles):
    with pytest.raises(SystemExit) as e:
        evaluate.main(argv)
    msg = str(e.value.code)
    assert "\n" not in msg and all(n in msg for n in needles), msg

# ---- statistics ----------------------------------------------------------------------------------

def test_auroc_hand_computed_with_ties():
    # positives {0.9, 0.8}, negatives {0.8, 0.3, 0.8}: 0.9 wins 3; 0.8 wins 0.5 + 1 + 0.5 -> 5 / 6
    assert evaluate.auroc([0.9, 0.8, 0.8, 0.3, 0.8], [True, True, False, False, False]) == \
        pytest.approx(5 / 6)
    assert evaluate.auroc([1, 2, 3], [False, True, True]) == 1.0
    assert evaluate.auroc([1, 2, 3], [True, False, False]) == 0.0
    assert evaluate.auroc([5, 5, 5, 5], [True, False, True, False]) == 0.5  # all tied
    assert evaluate.auroc([1, 2], [True, True]) is None  # one class: undefined

def test_auroc_matches_pairwise_definition():
    rng = random.Random(0)
    scores = [rng.choice([-3.0, -2.0, -1.5, -1.0, 0.0]) for _ in range(60)]  # many ties
    labels = [rng.random() < 0.4 for _ in scores]
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    brute = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert evaluate.auroc(scores, labels) == pytest.approx(brute, abs=1e-12)

def test_within_problem_auroc_removes_problem_difficulty():
    # problem 0: right 9 > wrong 8 -> 1; problem 1: right 1 < wrong 2 -> 0; problem 2 has one
    # class -> skipped: mean 0.5 over 2 problems
    scores, labels = [9, 8, 1, 2, 5], [True, False, True, False, True]
    assert evaluate.within_problem_auroc(scores, labels, [0, 0, 1, 1, 2]) == (0.5, 2)
    assert evaluate.within_problem_auroc([1, 2], [True, True], [0, 0]) == (None, 0)
    # an evaluator that ranks every wrong answer above the right one of its problem, but scores
    # the problem without a right answer (1) low: pooled, right {9, 5} vs wrong {10, 1, 2, 6}:
    # 9 beats 3, 5 beats 2 -> 5/8 = 0.625; within problems: 0 and 0 (problem 1 skipped)
    scores, labels = [9, 10, 1, 2, 5, 6], [True, False, False, False, True, False]
    assert evaluate.auroc(scores, labels) == 0.625
    assert evaluate.within_problem_auroc(scores, labels, [0, 0, 1, 1, 2, 2]) == (0.0, 2)

def test_ema_is_bias_corrected_hand_numbers():
    # alpha 0.9, v = 1, 0, 0, 10: m = 0.1, 0.09, 0.081, 1.0729; / (1 - 0.9^t) = 0.1, 0.19, 0.271,
    # 0.3439 (the seeded EMA, e_1 = v_1, gave 1, 0.9, 0.81, 1.729)
    assert evaluate.ema([1.0, 0.0, 0.0, 10.0], 0.9) == pytest.approx(
        [1.0, 0.09 / 0.19, 0.081 / 0.271, 1.0729 / 0.3439])
    assert evaluate.ema([4.0, 2.0], 0.5) == pytest.approx([4.0, (0.5 * 4 + 2) / 1.5])
    assert evaluate.ema([3.0, -1.0], 0.0) == [3.0, -1.0]  # alpha 0: the raw values
    assert evaluate.ema([], 0.9) == []

# ---- tournaments ---------------------------------------------------------------------------------

def lower_wins(pairs):
    return [min(i, j) for i, j in pairs]

def second_wins(pairs):
    return [j for _, j in pairs]

def test_knockout_bracket_n5_with_byes():
    # P = 8, 3 byes for players 0, 1, 2; round 1 is (3, 4); then (0, 1), (2, w34); final.
    assert evaluate.knockout(5, lower_wins) == (0, [(3, 4, 3), (0, 1, 0), (2, 3, 2), (0, 2, 0)])
    assert evaluate.knockout(5, lambda ps: [max(p) for p in ps]) == (
        4, [(3, 4, 4), (0, 1, 1), (2, 4, 4), (1, 4, 4)])

def test_knockout_counts_and_rounds_batched():
    for n in range(1, 17):
        calls = []
        winner, matches = evaluate.knockout(n, lambda ps: calls.append(len(ps)) or lower_wins(ps))
        assert len(matches) == n - 1 and winner == 0
        assert len(calls) == (math.ceil(math.log2(n)) if n > 1 else 0)  # one judge batch a round
    assert evaluate.knockout(8, lower_wins)[1][:4] == [(0, 1, 0), (2, 3, 2), (4, 5, 4), (6, 7, 6)]

def test_double_elimination_n5_who_meets_whom():
    # WB1 (3,4): 4 drops. WB2 (0,1),(2,3): LB=[4,1,3] odd -> 4 bye, (1,3). WB3 (0,2): LB=[4,1,2]
    # -> 4 bye, (1,2). LB final (4,1). Grand final (0,1): the WB champion wins, no reset.
    winner, matches = evaluate.double_elimination(5, lower_wins)
    assert matches == [(3, 4, 3), (0, 1, 0), (2, 3, 2), (1, 3, 1), (0, 2, 0), (1, 2, 1),
                       (4, 1, 1), (0, 1, 0)]
    assert winner == 0 and len(matches) == 2 * 5 - 2

def test_double_elimination_reset_and_counts():
    # N = 2, the second-listed always wins: WB (0,1) -> 1; grand final (1,0) -> 0; reset -> 0
    assert evaluate.double_elimination(2, second_wins) == (0, [(0, 1, 1), (1, 0, 0), (1, 0, 0)])
    assert len(evaluate.double_elimination(5, second_wins)[1]) == 2 * 5 - 1  # reset
    assert evaluate.double_elimination(1, second_wins) == (0, [])
    rng = random.Random(1)
    for n in range(2, 17):
        for _ in range(5):
            winner, matches = evaluate.double_elimination(n, lambda ps: [rng.choice(p) for p in ps])
            losses = {i: 0 for i in range(n)}
            for i, j, w in matches:
                assert w in (i, j)
                losses[j if w == i else i] += 1
            assert len(matches) in (2 * n - 2, 2 * n - 1)
            assert losses[winner] <= 1 and all(losses[i] == 2 for i in range(n) if i != winner)

def bon_item(correct_idx, n):
    return {"id": 0, "question": "q", "samples": [
        {"completion": "right" if k == correct_idx else f"wrong{k}", "correct": k == correct_idx,
         "pred": "7" if k == correct_idx else str(k)} for k in range(n)]}

def text_judge(queries):  # picks the response saying 'right', whatever its position
    return [{"choice": "B" if q[2] == "right" else "A", "valid": True} for q in queries]

def test_best_of_n_with_fake_judge():
    r = evaluate.best_of_n(bon_item(5, 8), 8, text_judge, "knockout", random.Random(0))
    assert r["pick"] == 5 and r["correct"] and r["invalid"] == 0 and r["calls"] == 7
    r = evaluate.best_of_n(bon_item(5, 8), 8, text_judge, "double_elimination", random.Random(0))
    assert r["pick"] == 5 and r["calls"] == 14 == len(r["matches"])  # never loses: 2N - 2

    def broken_judge(queries):  # invalid output: the first-listed (higher seed) player advances
        return [{"choice": None, "valid": False} for _ in queries]
    r = evaluate.best_of_n(bon_item(3, 4), 4, broken_judge, "knockout", random.Random(0))
    assert r == {**r, "pick": 0, "correct": False, "calls": 3, "invalid": 3}
    r = evaluate.best_of_n(bon_item(0, 1), 1, broken_judge, "knockout", random.Random(0))
    assert r["pick"] == 0 and r["calls"] == 0 and r["correct"]

# ---- pairwise accuracy ---------------------------------------------------------------------------

def fake_judge(queries):
    """Picks the response containing 'good' (A when neither); 'bad' shown as A -> format failure."""
    return [{"choice": None, "valid": False, "why": "no_choice"} if "bad" in a else
            {"choice": "B" if "good" in b and "good" not in a else "A", "valid": True}
            for _, a, b, _turns in queries]

def test_pairwise_accuracy_both_orders_and_format_failure():
    items = [{"id": 1, "context": "q", "response_a": "good1", "response_b": "meh", "winner": "A"},
             {"id": 2, "context": "q", "response_a": "meh", "response_b": "meh2", "winner": "B"},
             {"id": 3, "context": "q", "response_a": "bad", "response_b": "good3", "winner": "B"},
             {"id": 4, "context": "q", "response_a": "meh", "response_b": "good4", "winner": "A"}]
    s, records = evaluate.pairwise_accuracy(items, fake_judge)
    # order ab: right, wrong (picks A), format failure, wrong (picks B)      -> 1/4
    # order ba: right (B=good1), right (A=meh2), right (A=good3), wrong (A)   -> 3/4
    assert s["n"] == 4 and s["acc_ab"] == 0.25 and s["acc_ba"] == 0.75 and s["acc"] == 0.5
    assert s["format_fail"] == 1 / 8 and s["both_right"] == 0.25
    assert s["pick_a"] == pytest.approx(5 / 7)  # 7 valid judgements, 5 chose A
    assert [r["ab"]["right"] for r in records] == [True, False, False, False]
    assert [r["ba"]["right"] for r in records] == [True, True, True, False]

def test_pairwise_aggregate_macro_over_benchmarks():
    def row(name, n, acc, fail):
        return {"benchmark": name, "n": n, "acc_ab": acc, "acc_ba": acc, "acc": acc,
                "format_fail": fail}
    rows = [row("X", 2, 0.5, 0.0), row("X", 6, 1.0, 0.5), row("Y", 4, 0.25, 1.0)]
    g = evaluate.aggregate_pairwise(rows)
    assert g["benchmarks"][0]["acc"] == pytest.approx(0.875)        # (2*0.5 + 6*1.0) / 8
    assert g["benchmarks"][0]["format_fail"] == pytest.approx(0.375)
    assert g["overall"]["acc"] == pytest.approx((0.875 + 0.25) / 2)  # not 0.708 by items
    assert g["overall"]["n"] == 12 and g["overall"]["n_benchmarks"] == 2
    # RM-NLHF Table 2, gpt-5: Overall 0.7456 = the unweighted mean of its seven accuracies
    gpt5 = [0.8245, 0.8344, 0.8147, 0.7595, 0.7617, 0.6304, 0.5939]
    rows = [row(str(k), 10 * (k + 1), a, 0.0) for k, a in enumerate(gpt5)]
    assert round(evaluate.aggregate_pairwise(rows)["overall"]["acc"], 4) == 0.7456

def marker_judge(queries):
    """The fixtures' markers: picks the response saying 'CHOSEN', unless the other says
    'wrong:<order>' or 'wrong:both'; 'format:<order>' -> a format failure (ab = first half)."""
    half, out = len(queries) // 2, []
    for k, (_, a, b, _turns) in enumerate(queries):
        order = "ab" if k < half else "ba"
        if f"format:{order}" in a + b:
            out.append({"choice": None, "valid": False, "why": "no_choice"})
            continue
        good, other = ("A", b) if "CHOSEN" in a else ("B", a)
        wrong = f"wrong:{order}" in other or "wrong:both" in other
        out.append({"choice": {"A": "B", "B": "A"}[good] if wrong else good, "valid": True})
    return out

def test_reward_bench_2_best_of_4_hand_computed():
    """A row counts in an order only if all 3 of its pairs are right (the Ties row is dropped):
      Factuality f1 all right -> ab, ba right; f2 wrong:ab -> ab wrong; f3 wrong:both -> both
                 wrong; f4 wrong:ab + wrong:ba -> both wrong   -> acc_ab 1/4, acc_ba 2/4
      Focus      g1 all right; g2 format:ba -> ba wrong        -> acc_ab 1, acc_ba 1/2
    Mean over subsets: acc_ab 0.625, acc_ba 0.5, acc 0.5625 (30 of 36 judgements right)."""
    items = data.load_benchmark(RB2, 0, 0)
    s, records = evaluate.score_unit(items, marker_judge)
    assert s["n"] == 6 and s["n_pairs"] == 18
    assert s["acc_ab"] == pytest.approx(0.625) and s["acc_ba"] == pytest.approx(0.5)
    assert s["acc"] == pytest.approx(0.5625)
    assert s["pair_acc"] == pytest.approx(30 / 36) and s["format_fail"] == pytest.approx(1 / 36)
    assert s["subsets"] == {"Factuality": {"n": 4, "acc_ab": 0.25, "acc_ba": 0.5, "acc": 0.375},
                            "Focus": {"n": 2, "acc_ab": 1.0, "acc_ba": 0.5, "acc": 0.75}}

def test_grm_judge_authors_prompt_and_too_long(monkeypatch, tiny_model_path):
    prompts = []
    monkeypatch.setattr(rollout, "build_prompt_ids", lambda tok, t, chat: prompts.append(t) or [1])
    monkeypatch.setattr(evaluate, "generate_texts", lambda model, tok, ids, *a, **k: [
        [{"completion": "<critics>\nB adds wrongly.\n</critics>\n<choice>A</choice>"}]
        for _ in ids])
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096))
    query = ("What is 2+3?", "5", "6", None)
    out = evaluate.make_grm_judge(model, None, style="authors")([query])
    assert prompts[-1] == reward.build_grm_prompt(*query[:3], style="authors")
    assert out[0]["valid"] and out[0]["choice"] == "A"  # the authors' parser takes a bare A
    assert not evaluate.make_grm_judge(model, None)([query])[0]["valid"]  # ours does not
    monkeypatch.undo()
    model, tok = rollout.load_model(tiny_model_path)
    judge = evaluate.make_grm_judge(model, tok, max_new_tokens=4, max_prompt_tokens=1)
    assert judge([query]) == [{"critique": None, "choice": None, "valid": False,
                               "why": "prompt too long", "text": ""}]

# ---- math and QA grading -------------------------------------------------------------------------

def test_math_grading():
    assert evaluate.math_equal("0.5", "\\frac{1}{2}") and evaluate.math_equal("x=3", "3")
    assert evaluate.math_equal("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)")
    assert not evaluate.math_equal("\\frac{1}{3}", "0.5") and not evaluate.math_equal(None, "3")
    p = {"kind": "math", "label": "3"}
    assert evaluate.grade(p, "so we get \\boxed{x=3}.") == {"pred": "x=3", "correct": True}
    assert evaluate.grade(p, "the answer is 3") == {"pred": None, "correct": False}  # no box
    g = {"kind": "gsm8k", "label": "1234"}
    assert evaluate.grade(g, "\\boxed{$1,234}") == {"pred": "$1,234", "correct": True}
    assert evaluate.grade(g, "\\boxed{1233}")["correct"] is False
    # evaluation accepts what math-verify reads around a number; the RLVR reward does not
    assert evaluate.numeric_correct("x = 18", "18") and not reward.numeric_equal("x = 18", "18")

def test_math_summary_pass1_mean_std():
    def ans(c):
        return {"correct": c, "truncated": False, "pred": "1" if c else None}
    items = [{"greedy": ans(True), "samples": [ans(True), ans(False), ans(True)]},
             {"greedy": ans(False), "samples": [ans(False), ans(False), ans(True)]}]
    s = evaluate.answer_summary(items)
    # per-sample-index accuracy [0.5, 0.0, 1.0] -> mean 0.5, population std sqrt(1/6)
    assert s["greedy_acc"] == 0.5 and s["greedy_no_box"] == 0.5
    assert s["sampled_pass1_per_sample"] == [0.5, 0.0, 1.0]
    assert s["sampled_pass1_mean"] == pytest.approx(0.5)
    assert s["sampled_pass1_std"] == pytest.approx(math.sqrt(1 / 6))
    assert s["sampled_pass_at_n"] == 1.0

def test_wrong_answer_rule():
    num = [{"label": x, "answer_text": x} for x in ("18", "0.5", "0")]
    assert [evaluate.wrong_answer(num, k) for k in range(3)] == ["19", "1.5", "1"]
    val = [{"label": "1,234", "answer_text": "1,234"},
           {"label": "\\frac{1}{2}", "answer_text": "\\frac{1}{2}"},
           {"label": ["7"], "answer_text": "7"}, {"label": "(1,2)", "answer_text": "(1,2)"}]
    assert [evaluate.wrong_answer(val, k) for k in range(4)] == ["1235", "1.5", "(1,2)", "1,234"]
    same = [{"label": "Lyon", "answer_text": "Lyon"}] * 2
    assert evaluate.wrong_answer(same, 0) == "none"

def test_grade_qa_letters_text_and_the_article_trap():
    p = {"label": ["It decreases."], "choice_letters": ["1", "A"]}
    g = evaluate.grade_qa
    assert g(p, "\\boxed{A}")["em"] == 1.0 and g(p, "\\boxed{(1)}")["f1"] == 1.0
    assert g(p, "\\boxed{it decreases}") == {"pred": "it decreases", "em": 1.0, "f1": 1.0,
                                             "correct": True}
    # F1 by hand: pred [it, decreases, slowly], gold [it, decreases]: P 2/3, R 1 -> 0.8
    assert g(p, "\\boxed{It decreases slowly}")["f1"] == pytest.approx(0.8)
    for wrong in ("\\boxed{the}", "\\boxed{}", "\\boxed{B}", "A", "\\boxed{A) It increases.}"):
        assert g(p, wrong)["em"] == 0.0 and not g(p, wrong)["correct"], wrong
    assert g({"label": ["x y"]}, "\\boxed{x}")["f1"] == pytest.approx(2 / 3)  # no letters

def test_judge_check_summary_hand_numbers():
    """f1 (0.6, 0.5, 0.2) -> (1, 0, 0) vs labels (1, 0, 0): 3/3; recall (0.5, 0.4, 0.8) ->
    (0, 0, 1): 1/3; precision (0.75, 0.9, 0.1) -> (1, 1, 0): 2/3; the failed row is counted."""
    rows = [{"label": 1, "f1": 0.6, "recall": 0.5, "precision": 0.75},
            {"label": 0, "f1": 0.5, "recall": 0.4, "precision": 0.9},
            {"label": 1, "f1": None, "recall": None, "precision": None},
            {"label": 0, "f1": 0.2, "recall": 0.8, "precision": 0.1}]
    assert evaluate.judge_check_summary(rows) == {
        "n": 4, "n_failed": 1, "acc_f1": 1.0, "acc_recall": pytest.approx(1 / 3),
        "acc_precision": pytest.approx(2 / 3)}
    assert evaluate.judge_check_summary(rows[2:3])["acc_f1"] is None

# ---- in-run validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("accs, drop, patience, stop", [
    ([0.5, 1.0, 0.75, 0.5], 0.25, 2, False),   # 0.75 is not below 1.0 - 0.25 (exact in binary)
    ([0.5, 1.0, 0.625, 0.5], 0.25, 2, True),   # 0.625 and 0.5 both are
    ([0.5, 0.6, 0.54, 0.53], 0.05, 2, True),   # 0.54 and 0.53 both < 0.55
    ([0.5, 0.6, 0.54, 0.53], 0.05, 3, False),  # 0.6 itself is one of the last three
    ([0.5, 0.6, 0.4, 0.58, 0.4], 0.05, 2, False),  # 0.58 recovered in between
    ([0.3], 0.05, 1, False),                   # the first evaluation is its own best
])
def test_early_stop_rule(accs, drop, patience, stop):
    assert evaluate.early_stop(accs, drop, patience) is stop

def test_monitor_warns_when_reward_rises_while_accuracy_falls():
    hist = []
    assert evaluate.monitor(hist, 2, 0.5, -1.5) is None  # mean of [-2, -1]
    # (-0.8 - 0.6) / 2 = -0.7 > -1.5 while accuracy 0.5 -> 0.45
    assert evaluate.monitor(hist, 4, 0.45, -0.7) == (
        "[monitor] step 4: training reward rose (-1.500 -> -0.700) while held-out accuracy fell "
        "(0.500 -> 0.450): reward hacking?")
    assert evaluate.monitor(hist, 6, 0.3, None) is None  # unknown reward (another rank, step 0)
    assert [h["accuracy"] for h in hist] == [0.5, 0.45, 0.3]
    assert evaluate.held_out_accuracy({"val/pairwise_accuracy": 0.7}) == 0.7

def test_rlme_val_metrics_hand_computed():
    """3 answers: 'x = 18' for 18 (math-verify: right; the reward's record says wrong), '7' for 8
    (wrong), an empty box for 3. Rewards -1, -3, NaN (masked): mean over known (-1 - 3) / 2 = -2;
    boxed 2/3; chars (6 + 1 + 0) / 3. Canary ':' rewards -0.5, -1.5 -> -1. all_sum doubles every
    number (two identical ranks): the ratios stay."""
    rew = {"records": [{"extracted": "x = 18", "label": "18", "correct": False},
                       {"extracted": "7", "label": "8", "correct": False},
                       {"extracted": "", "label": "3", "correct": False}],
           "reward": torch.tensor([-1.0, -3.0, float("nan")]),
           "valid": torch.tensor([True, True, False])}
    canary = {"records": [], "reward": torch.tensor([-0.5, -1.5]), "valid": None}
    m = evaluate.rlme_val_metrics(rew, ["x = 18", "7", ""], {"colon": canary}, numeric=True,
                                  injected=False, all_sum=lambda x: 2 * x)
    assert m == {"val/n": 6, "val/injected": False, "val/accuracy": pytest.approx(1 / 3),
                 "val/reward_mean": pytest.approx(-2.0), "val/boxed_frac": pytest.approx(2 / 3),
                 "val/chars_mean": pytest.approx(7 / 3), "val/canary/colon": pytest.approx(-1.0)}
    text = evaluate.rlme_val_metrics(rew, ["a", "b", "c"], {}, numeric=False, injected=True)
    assert text["val/accuracy"] == 0.0 and text["val/injected"]  # text labels: the record's grade
    recs = [{"reward": -1.0, "correct": True}, {"reward": -2.0, "correct": False},
            {"reward": None, "correct": None}]
    assert evaluate.val_auroc(recs) == {"val/auroc": 1.0}
    assert evaluate.val_auroc([{"reward": -1.0, "correct": None}]) == {}  # no labels: no AUROC

def test_nlhf_val_metrics_hand_computed():
    _, records = evaluate.pairwise_accuracy(
        [{"context": "q", "response_a": "good1", "response_b": "meh", "winner": "A"},
         {"context": "q", "response_a": "bad", "response_b": "good3", "winner": "B"}], fake_judge)
    # ab: right, format failure; ba: right, right -> 3 of 4, 1 format failure
    assert evaluate.nlhf_val_metrics(records) == {
        "val/n": 2, "val/pairwise_accuracy": 0.75, "val/acc_ab": 0.5, "val/acc_ba": 1.0,
        "val/format_error_rate": 0.25}

# ---- learning curves -----------------------------------------------------------------------------

def test_curve_mean_std_across_runs(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"step": 0, "r": 0.0}, {"step": 1, "r": 1.0},
                                           {"step": 2, "r": 5.0}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"step": 0, "r": 2.0}, {"step": 1, "r": 3.0}])
    # EMA 0.5 of a: 0, 0.5/0.75 = 2/3; of b: 2, (0.5 + 1.5)/0.75 = 8/3. Shared steps 0, 1: raw
    # mean 1, 2; EMA mean 1, 5/3; sample std of {0, 2} and {2/3, 8/3}: sqrt 2
    c = evaluate.curve([a, b], "r", 0.5)
    assert c["x"] == [0, 1] and c["runs"] == 2 and c["raw"] == pytest.approx([1.0, 2.0])
    assert c["ema"] == pytest.approx([1.0, 5 / 3]) and c["std"] == pytest.approx([2 ** 0.5] * 2)
    nan = write_jsonl(tmp_path / "n.jsonl", [{"step": 0, "r": 1.0}, {"step": 1, "r": None},
                                             {"step": 2, "r": 0.0}])
    assert evaluate.curve([nan], "r", 0.5) == {"x": [0, 2], "raw": [1.0, 0.0], "runs": 1,
                                               "ema": [1.0, pytest.approx(0.5 / 1.5)],
                                               "std": None}
    with pytest.raises(SystemExit, match=r"no numeric values for metric 'acc'"):
        evaluate.curve([a], "acc")

def test_band_is_plus_minus_one_std_across_runs(tmp_path):
    """RLME Fig. 2's ±1 std. Runs a = 0, 3; b = 3, 0; c = 6, 6 at steps 1, 2; EMA 0.5: a 0, 2;
    b 3, 1; c 6, 6. Step 1: {0, 3, 6}: mean 3, std 3; step 2: {2, 1, 6}: mean 3, std sqrt 7."""
    import matplotlib.pyplot as plt
    runs = [write_jsonl(tmp_path / f"{n}.jsonl", [{"step": 1, "r": u}, {"step": 2, "r": v}])
            for n, (u, v) in zip("abc", [(0.0, 3.0), (3.0, 0.0), (6.0, 6.0)])]
    c = evaluate.curve(runs, "r", 0.5)
    assert c["ema"] == pytest.approx([3.0, 3.0]) and c["std"] == pytest.approx([3.0, 7 ** 0.5])
    seen = {}
    monkey_close = plt.close
    plt.close = lambda fig: seen.setdefault("fig", fig)
    try:
        evaluate.plot_curves({"rlme": {"r": c}}, ["r"], str(tmp_path / "c.png"), 0.5)
    finally:
        plt.close = monkey_close
    ax = seen["fig"].axes[0]
    art = {x.get_gid(): x for x in list(ax.lines) + list(ax.collections) if x.get_gid()}
    assert set(art) == {"rlme/raw", "rlme/band", "rlme/ema"}
    verts = art["rlme/band"].get_paths()[0].vertices
    for x, h in zip((1, 2), (3.0, 7 ** 0.5)):
        ys = verts[verts[:, 0] == x][:, 1]
        assert min(ys) == pytest.approx(3.0 - h) and max(ys) == pytest.approx(3.0 + h)
    plt.close(seen["fig"])

def test_cli_plot_writes_the_png(tmp_path, capsys):
    runs = []
    for seed in range(2):
        rng = random.Random(seed)
        runs.append(write_jsonl(tmp_path / f"run{seed}.jsonl", [
            {"step": t, "reward/mean": -2 + t / 10 + rng.random() * 0.1,
             "val/accuracy": 0.3 - t / 100 + rng.random() * 0.05} for t in range(20)]))
    out = tmp_path / "plots"
    rows = evaluate.main(["plot", f"rlme={runs[0]},{runs[1]}", f"single={runs[0]}",
                          "--out", str(out)])
    assert (out / "curves.png").stat().st_size > 5000
    got = {(r["curve"], r["metric"]): r for r in json.load(open(out / "plot.json"))["table"]}
    assert got[("rlme", "reward/mean")]["runs"] == 2 and got[("rlme", "reward/mean")]["steps"] == 20
    assert got[("rlme", "reward/mean")]["last"] > got[("rlme", "reward/mean")]["first"]
    assert got[("single", "val/accuracy")]["last_std"] is None and rows[0]["last_std"] > 0
    assert "rlme" in capsys.readouterr().out
    one_line_exit(["plot", runs[0], "--ema", "1", "--out", str(out)], "--ema 1.0: must be in")

# ---- the command line: fake generation (hand-computed) -----------------------------------------

def fake_engine(monkeypatch, answer_for):
    """No model: a prompt's ids are its text, answer_for(prompt, temperature) its completion.
    Returns the list the prompts are appended to."""
    prompts = []
    monkeypatch.setattr(rollout, "build_prompt_ids", lambda tok, t, chat: prompts.append(t) or [t])

    def generate(model, tok, ids, group_size, max_new_tokens, temperature, top_p, top_k, seed):
        out = [answer_for(p[0], temperature) for p in ids for _ in range(group_size)]
        return {"completions": out, "truncated": [False] * len(out)}
    monkeypatch.setattr(evaluate, "generation_model", lambda a, path: (None, None, False, generate))
    return prompts

NOCHEAT = ("{question}\nThe answer is {answer}.\n"
           "Reason step by step, and put your final answer within \\boxed{{}}.")

def test_math_inject_wrong_counterfactual_accuracy(tmp_path, monkeypatch, capsys):
    """Labels 18, 3, 70: --inject wrong shows 19, 4, 71; the policy copies what it is shown except
    on Q2 (solves it): counterfactual accuracy 1/3 against the truth."""
    import re
    rows = [{"question": "Q1", "answer": "#### 18"}, {"question": "Q2", "answer": "#### 3"},
            {"question": "Q3", "answer": "#### 70"}]
    src = write_jsonl(tmp_path / "g.jsonl", rows)
    prompts = fake_engine(monkeypatch, lambda p, t: "\\boxed{3}" if p.startswith("Q2") else
                          "\\boxed{%s}" % re.search(r"The answer is (.*)\.\n", p).group(1))
    r = evaluate.main(["math", "--model", "m", "--data", src, "--prompt-template", NOCHEAT,
                       "--inject", "wrong", "--n-problems", "3", "--n-samples", "1",
                       "--out", str(tmp_path)])
    assert [re.search(r"is (\d+)\.", p).group(1) for p in prompts[:3]] == ["19", "4", "71"]
    assert r["counterfactual_acc"] == pytest.approx(1 / 3) == r["greedy_acc"]
    assert r["sampled_pass1_mean"] == pytest.approx(1 / 3) and r["sampled_pass1_std"] == 0.0
    items = [json.loads(x) for x in open(next(tmp_path.glob("math_*-g_inject-wrong.items.jsonl")))]
    assert [it["shown_answer"] for it in items] == ["19", "4", "71"]
    assert "COUNTERFACTUAL" in capsys.readouterr().out
    one_line_exit(["math", "--model", "m", "--data", src, "--prompt-template", NOCHEAT],
                  "--inject: the prompt template shows {answer}")
    one_line_exit(["math", "--model", "m", "--data", src, "--inject", "wrong"],
                  "--inject wrong: the prompt template has no {answer} to fill")
    one_line_exit(["math", "--model", "m", "--data", src, "--prompt-template", "{question}{x}"],
                  "placeholders ['question', 'x']; math needs ['question'] and can fill")
    one_line_exit(["math", "--model", "m", "--data", src, "--prompt-template", "{question"],
                  "the prompt template is not a format string")

def test_qa_faitheval_preset_hand_computed(tmp_path, monkeypatch):
    """Greedy: cf_1 Venus (1, 1); cf_2 C = the gold letter (1, 1); cf_3 'It decreases slowly'
    (0, 0.8); cf_4 blue (0, 0) -> EM 0.5, F1 0.7."""
    answers = {"closest": "\\boxed{Venus}", "freeze": "So \\boxed{C}.",
               "speed": "\\boxed{It decreases slowly}", "color": "\\boxed{blue}"}
    prompts = fake_engine(monkeypatch, lambda p, t: next(a for w, a in answers.items() if w in p))
    r = evaluate.main(["qa", "--model", "m", "--preset", "faitheval", "--data", FAITHEVAL,
                       "--out", str(tmp_path)])
    assert r["greedy_em"] == 0.5 and r["greedy_f1"] == pytest.approx(0.7) and r["multiple_choice"]
    assert r["answer_field"] == "answerKey" and r["split"] == "test"
    assert prompts[0].startswith("Recent observations established that Venus")
    run = tmp_path / "config.yaml"  # a run's config: its prompt template, not a hub config
    run.write_text('data:\n  prompt_template: "Q: {question}\\n{context}"\n')
    r = evaluate.main(["qa", "--model", "m", "--preset", "faitheval", "--data", FAITHEVAL,
                       "--config", str(run), "--out", str(tmp_path)])
    assert r["config"] is None and prompts[-1].startswith("Q: ") and r["greedy_em"] == 0.5
    one_line_exit(["qa", "--model", "m"], "qa: give --data FILE_OR_HUB_ID or --preset faitheval")

def test_pairwise_default_set_overall_hand_computed(tmp_path, monkeypatch):
    """Default set for base 2025-01 = HelpSteer3 + RewardBench 2 (the fixtures in their place).
    HelpSteer3 (tie dropped): right in both orders, wrong:both, wrong:ab -> acc 0.5;
    RewardBench 2: 0.5625. Overall = (0.5 + 0.5625) / 2 = 0.53125 (by items: 0.5417)."""
    files = {"helpsteer3": HS3, "reward_bench_2": RB2}
    monkeypatch.setattr(data, "benchmark_units", lambda name, root: [{
        "benchmark": data.BENCHMARKS[name][0], "file": "fixture", "path": files[name]}])
    monkeypatch.setattr(evaluate, "generation_model", lambda a, path: (None, None, False, None))
    seen = {}
    monkeypatch.setattr(evaluate, "make_grm_judge",
                        lambda *a, **kw: seen.update(kw, style=a[6]) or marker_judge)
    r = evaluate.main(["pairwise", "--model", "m", "--out", str(tmp_path)])
    bench = {b["benchmark"]: b for b in r["benchmarks"]}
    assert bench["HelpSteer3"]["acc"] == pytest.approx(0.5) and bench["HelpSteer3"]["n"] == 3
    assert bench["RewardBench 2"]["acc"] == pytest.approx(0.5625)
    assert r["overall"]["acc"] == pytest.approx(0.53125) and r["overall"]["n_benchmarks"] == 2
    assert seen == {"style": "ours", "temperature": 0.6, "seed": 0}
    assert r["decoding"]["max_new_tokens"] == 8192  # the release's decoding
    assert len(open(tmp_path / "pairwise.items.jsonl").readlines()) == 3 + 18

def test_bon_with_a_fake_judge_and_bad_input(tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "generation_model", lambda a, path: (None, None, False, None))
    monkeypatch.setattr(evaluate, "make_grm_judge", lambda *a, **kw: text_judge)
    samples = write_jsonl(tmp_path / "items.jsonl", [bon_item(1, 2), bon_item(0, 2)])
    r = evaluate.main(["bon", "--judge", "j", "--samples", samples, "--ns", "1,2",
                       "--out", str(tmp_path)])
    one, two = r["rows"]
    assert one["knockout_calls"] == 0 and one["mean_sample_acc"] == 0.5
    assert two["knockout_acc"] == 1.0 and two["knockout_calls"] == 2
    assert two["double_elimination_calls"] == 4 and two["oracle_pass_at_n"] == 1.0
    one_line_exit(["bon", "--judge", "j", "--samples", samples, "--ns", "4"],
                  "N=4 is larger than the samples available (2 per problem")
    one_line_exit(["bon", "--judge", "j", "--samples", samples, "--methods", "swiss"],
                  "--methods swiss: choose from")
    bad = write_jsonl(tmp_path / "x.jsonl", [{"question": "q"}])
    one_line_exit(["bon", "--judge", "j", "--samples", bad], "not an `evaluate math` items file")

def test_judge_check_proxy_end_to_end(tmp_path):
    """The offline proxy judge (lexical F1): a copied critique scores 1, an unrelated one 0."""
    base = {"context": "What is 2+3?", "response_a": "5", "response_b": "6",
            "human_critique": "Response B adds 2 and 3 wrongly."}
    src = write_jsonl(tmp_path / "d.jsonl", [
        dict(base, critique="Response B adds 2 and 3 wrongly.", label=1),
        dict(base, critique="Both responses are polite.", label=0)])
    s = evaluate.main(["judge-check", "--data", src, "--backend", "proxy",
                       "--out", str(tmp_path)])
    assert s["n"] == 2 and s["n_failed"] == 0 and s["acc_f1"] == 1.0
    rows = [json.loads(x) for x in open(tmp_path / "judge_check.items.jsonl")]
    assert [r["f1"] for r in rows] == [1.0, 0.0]

# ---- the command line on the tiny random model -------------------------------------------------

def test_cli_math_evaluator_check_and_pairwise_on_the_tiny_model(tiny_model_path, tmp_path):
    src = data_path("gsm8k", "test.jsonl")
    s = evaluate.main(["math", "--model", tiny_model_path, "--data", src, "--n-problems", "2",
                       "--n-samples", "2", "--max-new-tokens", "4", "--out", str(tmp_path)])
    assert s["n_problems"] == 2 and s["n_samples"] == 2 and s["kind"] == "gsm8k"
    items = tmp_path / "math_gsm8k-test.items.jsonl"
    assert len(open(items).readlines()) == 2
    s = evaluate.main(["evaluator-check", "--evaluator", tiny_model_path, "--samples", str(items),
                       "--out", str(tmp_path)])
    assert s["n_answers"] == 6
    recs = [json.loads(x) for x in open(tmp_path / "evaluator_check.items.jsonl")]
    assert all(r["logp"] <= 0 and r["p"] == pytest.approx(math.exp(r["logp"])) for r in recs)
    s = evaluate.main(["pairwise", "--model", tiny_model_path, HS3, "--n", "2", "--temperature",
                       "0", "--max-new-tokens", "4", "--out", str(tmp_path)])
    assert s["files"][0]["n"] == 2 and s["decoding"]["temperature"] == 0.0
    assert s["files"][0]["format_fail"] == 1.0  # a random model names no verdict
