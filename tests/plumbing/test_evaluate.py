"""evaluate.py: exact numbers for every metric and bracket, bad input, and one end-to-end CLI run
per subcommand on the real SmolLM2 model (marked slow)."""
import json
import math
import os
import random
import subprocess
import sys

import pytest

import evaluate
import reward
from conftest import REPO, SMOLLM2, data_path
from plumbing import cli, eval_commands
from evaluate import ema
from plumbing.cli import evaluate_main
from plumbing.eval_commands import load_or_sample, prompt_template
from plumbing.plots import curve, parse_curve
from plumbing.benchmarks import (BENCHMARK_REGISTRY, QA_PRESETS, earliest_allowed, load_benchmark, load_math_problems,
                                 load_qa_items, passes_contamination_rule, select_benchmarks)
from plumbing.items import render_context
from plumbing.models import load_model
from plumbing.validation import wrong_answer



def run_cli(*args, timeout=600, **env_vars):
    """Run `python -m plumbing.cli evaluate ARGS` as a user would (env_vars: extra environment); returns CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", **env_vars)
    return subprocess.run([sys.executable, "-m", "plumbing.cli", "evaluate", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    for n in needles:
        assert n in last, last


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


# ----------------------------------------------------------------------------------------------
# Metrics


def test_auroc_hand_computed_with_ties():
    # positives {0.9, 0.8}, negatives {0.8, 0.3, 0.8}: pairs won 0.9 -> 3; 0.8 -> 0.5 + 1 + 0.5
    # = 2; AUROC = 5 / 6
    assert evaluate.auroc([0.9, 0.8, 0.8, 0.3, 0.8], [True, True, False, False, False]) == pytest.approx(5 / 6)
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


def test_reliability_table_and_ece():
    rows, ece = evaluate.reliability_table([0.05, 0.15, 0.12, 0.95, 1.0], [False, True, False, True, True], 10)
    assert [r["n"] for r in rows] == [1, 2, 2]
    assert [r["bin"] for r in rows] == ["[0.00,0.10)", "[0.10,0.20)", "[0.90,1.00)"]
    assert rows[1]["mean_p"] == pytest.approx(0.135) and rows[1]["frac_correct"] == 0.5
    assert rows[2]["mean_p"] == pytest.approx(0.975) and rows[2]["frac_correct"] == 1.0
    # ECE = 1/5*|0-0.05| + 2/5*|0.5-0.135| + 2/5*|1-0.975| = 0.01 + 0.146 + 0.01
    assert ece == pytest.approx(0.166)


def test_ema_exact():  # bias-corrected (evaluate.ema): the alpha^(t-i)-weighted mean of v_1..v_t
    assert ema([1.0, 0.0, 0.0, 10.0], 0.9) == pytest.approx([1.0, 0.09 / 0.19, 0.081 / 0.271, 1.0729 / 0.3439])
    assert ema([4.0, 2.0], 0.5) == pytest.approx([4.0, 4 / 1.5])
    assert ema([], 0.9) == []


def test_mean_std_population():
    assert evaluate.mean_std([1.0, 3.0]) == (2.0, 1.0)
    assert evaluate.mean_std([7.0]) == (7.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Tournaments


def lower_wins(pairs):
    return [min(i, j) for i, j in pairs]


def higher_wins(pairs):
    return [max(i, j) for i, j in pairs]


def second_wins(pairs):
    return [j for _, j in pairs]


def test_knockout_bracket_n5_with_byes():
    # P = 8, 3 byes for players 0, 1, 2; round 1 is (3, 4); then (0, 1), (2, w34); final.
    winner, matches = evaluate.knockout(5, lower_wins)
    assert matches == [(3, 4, 3), (0, 1, 0), (2, 3, 2), (0, 2, 0)]
    assert winner == 0
    winner, matches = evaluate.knockout(5, higher_wins)
    assert matches == [(3, 4, 4), (0, 1, 1), (2, 4, 4), (1, 4, 4)]
    assert winner == 4


def test_knockout_counts_and_rounds_batched():
    for n in range(1, 17):
        calls = []
        winner, matches = evaluate.knockout(n, lambda pairs: calls.append(len(pairs)) or lower_wins(pairs))
        assert len(matches) == n - 1 and winner == 0
        assert len(calls) == (math.ceil(math.log2(n)) if n > 1 else 0)  # one judge batch per round
    _, matches = evaluate.knockout(8, lower_wins)
    assert matches[:4] == [(0, 1, 0), (2, 3, 2), (4, 5, 4), (6, 7, 6)]  # power of two: no byes


def test_double_elimination_n5_who_meets_whom():
    # WB1 (3,4): 4 drops.  WB2 (0,1),(2,3): LB=[4,1,3] odd -> 4 bye, (1,3).  WB3 (0,2): LB=[4,1,2]
    # -> 4 bye, (1,2).  LB final (4,1).  Grand final (0,1): WB champion wins, no reset.
    winner, matches = evaluate.double_elimination(5, lower_wins)
    assert matches == [(3, 4, 3), (0, 1, 0), (2, 3, 2), (1, 3, 1), (0, 2, 0), (1, 2, 1), (4, 1, 1), (0, 1, 0)]
    assert winner == 0 and len(matches) == 2 * 5 - 2


def test_double_elimination_reset_and_counts():
    # N = 2, the second-listed always wins: WB (0,1) -> 1; grand final (1,0) -> 0; reset (1,0) -> 0
    winner, matches = evaluate.double_elimination(2, second_wins)
    assert matches == [(0, 1, 1), (1, 0, 0), (1, 0, 0)] and winner == 0
    winner, matches = evaluate.double_elimination(5, second_wins)
    assert len(matches) == 2 * 5 - 1  # the LB champion wins the grand final: reset
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


# ----------------------------------------------------------------------------------------------
# Pairwise accuracy (fake judge)


def fake_judge(queries):
    """Picks the response containing 'good' (A when neither); 'bad' shown as A -> format failure."""
    out = []
    for _, a, b, _turns in queries:
        if "bad" in a:
            out.append({"choice": None, "valid": False, "why": "no_choice"})
        else:
            out.append({"choice": "B" if "good" in b and "good" not in a else "A", "valid": True, "why": ""})
    return out


def test_pairwise_accuracy_both_orders_and_format_failure():
    items = [{"id": 1, "context": "q", "response_a": "good1", "response_b": "meh", "winner": "A"},
             {"id": 2, "context": "q", "response_a": "meh", "response_b": "meh2", "winner": "B"},
             {"id": 3, "context": "q", "response_a": "bad", "response_b": "good3", "winner": "B"},
             {"id": 4, "context": "q", "response_a": "meh", "response_b": "good4", "winner": "A"}]
    s, records = evaluate.pairwise_accuracy(items, fake_judge)
    # order ab: right, wrong (picks A), format failure, wrong (picks B)      -> 1/4
    # order ba: right (B=good1), right (A=meh2), right (A=good3), wrong (A)   -> 3/4
    assert s["n"] == 4
    assert s["acc_ab"] == 0.25 and s["acc_ba"] == 0.75 and s["acc"] == 0.5
    assert s["format_fail"] == 1 / 8
    assert s["both_right"] == 0.25
    assert s["pick_a"] == pytest.approx(5 / 7)  # 7 valid judgements, 5 chose A
    assert [r["ab"]["right"] for r in records] == [True, False, False, False]
    assert [r["ba"]["right"] for r in records] == [True, True, True, False]


def test_grm_judge_real_generation_and_too_long_prompt(tiny_model_path):
    model, tok = load_model(tiny_model_path)
    judge = evaluate.make_grm_judge(model, tok, max_new_tokens=4, max_prompt_tokens=1)
    assert judge([("q", "a", "b")]) == [{"critique": None, "choice": None, "valid": False,
                                          "why": "prompt too long", "text": ""}]
    judge = evaluate.make_grm_judge(model, tok, max_new_tokens=4, batch_size=2)
    out = judge([("q", "a", "b"), ("a much longer question " * 5, "x", "y"), ("q3", "c", "d")])
    assert len(out) == 3 and all(isinstance(o["text"], str) and o["valid"] is False for o in out)  # random model


def test_pairwise_aggregate_macro_over_benchmarks():
    rows = [{"benchmark": "X", "n": 2, "acc_ab": 0.5, "acc_ba": 0.5, "acc": 0.5, "format_fail": 0.0},
            {"benchmark": "X", "n": 6, "acc_ab": 1.0, "acc_ba": 1.0, "acc": 1.0, "format_fail": 0.5},
            {"benchmark": "Y", "n": 4, "acc_ab": 0.25, "acc_ba": 0.25, "acc": 0.25, "format_fail": 1.0}]
    g = evaluate.aggregate_pairwise(rows)
    assert g["benchmarks"][0]["acc"] == pytest.approx(0.875)        # (2*0.5 + 6*1.0) / 8
    assert g["benchmarks"][0]["format_fail"] == pytest.approx(0.375)
    assert g["overall"]["acc"] == pytest.approx((0.875 + 0.25) / 2)  # unweighted over benchmarks, not 0.708 by items
    assert g["overall"]["n"] == 12 and g["overall"]["n_benchmarks"] == 2
    assert "Table 2" in g["overall"]["definition"]
    # RM-NLHF Table 2, gpt-5: Overall 0.7456 = the unweighted mean of its seven benchmark accuracies
    gpt5 = [0.8245, 0.8344, 0.8147, 0.7595, 0.7617, 0.6304, 0.5939]
    rows = [{"benchmark": str(k), "n": 10 * (k + 1), "acc_ab": a, "acc_ba": a, "acc": a, "format_fail": 0.0}
            for k, a in enumerate(gpt5)]
    assert round(evaluate.aggregate_pairwise(rows)["overall"]["acc"], 4) == 0.7456


def test_rm_bench_grid():
    def rec(c, r, ab, ba):
        return {"meta": {"chosen_style": c, "rejected_style": r}, "ab": {"right": ab}, "ba": {"right": ba}}
    g = evaluate.rm_bench_grid([rec(2, 0, True, True), rec(1, 1, True, False), rec(0, 2, False, False),
                                rec(0, 1, True, False)])
    assert g == {"acc_easy": 1.0, "acc_normal": 0.5, "acc_hard": 0.25}


def test_load_benchmark_subset_and_helpsteer3(tmp_path):
    items = load_benchmark(data_path("llmbar", "LLMBar_Natural.jsonl"), 5, seed=0)
    assert len(items) == 5 and all(it["winner"] in ("A", "B") for it in items)
    assert [it["id"] for it in items] == [it["id"] for it in load_benchmark(
        data_path("llmbar", "LLMBar_Natural.jsonl"), 5, seed=0)]  # seeded subset is reproducible
    hs = write_jsonl(tmp_path / "hs3.jsonl", [
        {"context": [{"role": "user", "content": "hi"}], "response1": "r1", "response2": "r2",
         "overall_preference": -2, "individual_preference": [{"reasoning": "@Response 1 is kinder."}]},
        {"context": "q", "response1": "x", "response2": "y", "overall_preference": 0},  # tie: dropped
        {"context": "q2", "response1": "x", "response2": "good", "overall_preference": 3}])
    items = load_benchmark(hs, 0, seed=0)
    assert len(items) == 2
    s, _ = evaluate.pairwise_accuracy(items, fake_judge)
    assert s["acc_ab"] + s["acc_ba"] >= 0.5  # item 2's 'good' response is found in both orders


# ----------------------------------------------------------------------------------------------
# Benchmark registry, contamination rule, RewardBench 2 best-of-4, Overall (RM-NLHF App. G.1,
# Table 7, Table 2). Fixtures: tests/fixtures/ (hand-written; markers explained in its README).

FIXTURES = os.path.join(REPO, "tests", "fixtures")
HS3_FIXTURE = os.path.join(FIXTURES, "helpsteer3_sample.jsonl")
RB2_FIXTURE = os.path.join(FIXTURES, "reward_bench_2_sample.jsonl")
FIXTURE_SOURCES = ["--source", f"helpsteer3={HS3_FIXTURE}", "--source", f"reward_bench_2={RB2_FIXTURE}"]


def marker_judge(queries):
    """A fake judge reading the fixtures' markers. pairwise_accuracy sends order ab as the first
    half of the queries and order ba as the second. It picks the response saying 'CHOSEN', unless
    the other one says 'wrong:<this order>' or 'wrong:both' (then it picks that one);
    'format:<this order>' on either response -> a format failure."""
    half = len(queries) // 2
    out = []
    for k, (_, a, b, _turns) in enumerate(queries):
        order = "ab" if k < half else "ba"
        if f"format:{order}" in a + b:
            out.append({"choice": None, "valid": False, "why": "no_choice"})
            continue
        good, other = ("A", b) if "CHOSEN" in a else ("B", a)
        wrong = f"wrong:{order}" in other or "wrong:both" in other
        out.append({"choice": {"A": "B", "B": "A"}[good] if wrong else good, "valid": True, "why": ""})
    return out


def test_registry_is_table_7():
    """Release months and usage marks typed from RM-NLHF Table 7; the seven used ones in Table 2's
    column order; only HelpSteer3 and RewardBench 2 of them are readable here (hub)."""
    table_7 = {"mt_bench": ("2023-06", "excluded"), "reward_bench": ("2024-03", "excluded"),
               "rm_bench": ("2024-10", "excluded"), "ppe": ("2024-10", "excluded"),
               "judgebench": ("2024-10", "excluded"), "rmb": ("2024-10", "excluded"),
               "href": ("2024-12", "used"), "wq_arena": ("2025-04", "used"), "scan_hpd": ("2025-05", "used"),
               "helpsteer3": ("2025-05", "used"), "reward_bench_2": ("2025-06", "used"),
               "litbench": ("2025-07", "used"), "wpb": ("2025-10", "used")}
    reg = BENCHMARK_REGISTRY
    assert {k: (reg[k]["release"], reg[k]["paper"]) for k in table_7} == table_7
    used = [b["title"] for b in reg.values() if b["paper"] == "used"]
    assert used == ["HelpSteer3", "RewardBench 2", "SCAN-HPD", "HREF", "LitBench", "WQ-Arena", "WPB"]
    assert [k for k, b in reg.items() if b["paper"] == "used" and b["supported"]] == ["helpsteer3", "reward_bench_2"]
    assert reg["helpsteer3"]["hub"] == {"id": "nvidia/HelpSteer3", "config": "preference", "split": "validation",
                                        "schema": "helpsteer3"}
    assert reg["reward_bench_2"]["hub"]["id"] == "allenai/reward-bench-2" and reg["reward_bench_2"]["hub"]["split"] == "test"
    local = {k: (b["local"], b["release"]) for k, b in reg.items() if b["local"]}
    assert local == {"rm_bench": ("rm_bench", "2024-10"), "judgebench": ("judgebench", "2024-10"),
                     "llmbar": ("llmbar", "2023-10"), "pandalm_testset": ("pandalm_testset", "2023-06"),
                     "hh_rlhf_harmless_base": ("hh_rlhf_harmless_base", "2022-04")}
    for b in reg.values():
        assert b["supported"] == bool(b["local"] or b["hub"]) and (b["supported"] or b["note"])


def test_contamination_rule_default_sets():
    """Released no earlier than one month before the base model (App. G.1): base 2025-01 -> 2024-12
    or later, so Table 7's seven pass (HREF 2024-12 just), the 2024-10 ones do not."""
    reg = BENCHMARK_REGISTRY
    passing = {k for k, b in reg.items() if passes_contamination_rule(b["release"], "2025-01")}
    assert passing == {"helpsteer3", "reward_bench_2", "scan_hpd", "href", "litbench", "wq_arena", "wpb"}
    assert earliest_allowed("2025-01") == "2024-12"  # across the year boundary
    assert not passes_contamination_rule("2024-12", "2025-02")
    sel = select_benchmarks(None, (), "2025-01")
    assert sel["chosen"] == ["helpsteer3", "reward_bench_2"] and sel["mode"] == "default" and not sel["warnings"]
    assert sel["left_out"]["href"].startswith("not supported here")
    assert sel["left_out"]["judgebench"].startswith("not released 2024-12 or later")
    assert set(sel["left_out"]) == set(reg) - {"helpsteer3", "reward_bench_2"}
    # a base model of 2024-10: the 2024-10 benchmarks we can read join (RM-Bench, JudgeBench); PPE, RMB cannot
    passing = {k for k, b in reg.items() if passes_contamination_rule(b["release"], "2024-10")}
    assert passing == {"helpsteer3", "reward_bench_2", "scan_hpd", "href", "litbench", "wq_arena", "wpb",
                       "rm_bench", "ppe", "judgebench", "rmb"}
    assert select_benchmarks(None, (), "2024-10")["chosen"] == ["helpsteer3", "reward_bench_2", "rm_bench",
                                                                        "judgebench"]
    with pytest.raises(SystemExit, match=r"^--base-release '2025/01': expected a month as YYYY-MM"):
        select_benchmarks(None, (), "2025/01")


def test_nothing_left_and_bad_names_are_one_line_errors(tmp_path):
    cases = [(["--base-release", "2026-01"], r"^no benchmark left: none we can read is released 2025-12 or later"),
             (["--benchmarks", "nope"], r"^--benchmarks nope: unknown; known: helpsteer3, "),
             (["--benchmarks", "href"], r"^--benchmarks href: HREF is not supported here"),
             (["--benchmarks", ","], r"^--benchmarks: no names given"),
             (["--source", "helpsteer3"], r"^--source 'helpsteer3': expected NAME=PATH"),
             (["--source", f"helpsteer3={tmp_path}/none.jsonl"], r"^--source helpsteer3=.*none.jsonl does not exist")]
    for args, msg in cases:
        with pytest.raises(SystemExit, match=msg) as e:  # before any model is loaded ('x' is no model)
            evaluate_main(["pairwise", "--model", "x", "--out", str(tmp_path), *args])
        assert "\n" not in str(e.value.code)


def test_hub_unreachable_is_one_line():
    """The default set reads HelpSteer3 from the hub; offline, the run stops with one line naming
    the hub id and the --source way out, before loading a model."""
    p = run_cli("pairwise", "--model", "not-a-model", "--n", 1, timeout=120, HF_HUB_OFFLINE="1")
    assert_one_line_error(p, "nvidia/HelpSteer3", "--source helpsteer3=PATH")


def test_reward_bench_2_best_of_4_hand_computed():
    """tests/fixtures/reward_bench_2_sample.jsonl with marker_judge; a row counts in an order only
    if all 3 of its pairs are right in that order (the Ties row is dropped):
      Factuality f1 all right        -> ab right, ba right
                 f2 one wrong:ab     -> ab wrong, ba right
                 f3 one wrong:both   -> ab wrong, ba wrong
                 f4 wrong:ab + wrong:ba (4 of 6 judgements right) -> ab wrong, ba wrong
                 -> acc_ab 1/4, acc_ba 2/4, acc 0.375
      Focus      g1 all right        -> ab right, ba right
                 g2 one format:ba    -> ab right, ba wrong
                 -> acc_ab 1, acc_ba 1/2, acc 0.75
    RewardBench 2 = mean over subsets: acc_ab (0.25 + 1) / 2 = 0.625, acc_ba (0.5 + 0.5) / 2 = 0.5,
    acc 0.5625 (pooling the 6 rows instead would give 0.5; per pair, 30 of 36 judgements are right)."""
    items = load_benchmark(RB2_FIXTURE, 0, seed=0)
    assert len(items) == 18 and {it["meta"]["subset"] for it in items} == {"Factuality", "Focus"}
    s, records = evaluate.score_unit(items, marker_judge)
    assert s["n"] == 6 and s["n_pairs"] == 18
    assert s["acc_ab"] == pytest.approx(0.625) and s["acc_ba"] == pytest.approx(0.5)
    assert s["acc"] == pytest.approx(0.5625)
    assert s["pair_acc"] == pytest.approx(30 / 36) and s["format_fail"] == pytest.approx(1 / 36)
    assert s["subsets"] == {"Factuality": {"n": 4, "acc_ab": 0.25, "acc_ba": 0.5, "acc": 0.375},
                            "Focus": {"n": 2, "acc_ab": 1.0, "acc_ba": 0.5, "acc": 0.75}}
    assert "Ties excluded" in s["scoring"]
    assert len(records) == 18 and records[0]["id"] == "f1:0"
    with pytest.raises(SystemExit, match="row f1: 2 of its 3 pairs were judged"):  # a split row is refused
        evaluate.best_of_group_accuracy(records[1:])


def test_subsample_keeps_reward_bench_2_rows_whole():
    """--n counts RewardBench 2 rows: n=2 gives 2 rows x 3 pairs, never a split row."""
    picks = set()
    for seed in range(6):
        items = load_benchmark(RB2_FIXTURE, 2, seed=seed)
        groups = [it["meta"]["group"] for it in items]
        assert len(items) == 6 and len(set(groups)) == 2 and all(groups.count(g) == 3 for g in groups)
        assert [it["id"] for it in items] == [it["id"] for it in load_benchmark(RB2_FIXTURE, 2, seed=seed)]
        picks.add(frozenset(groups))
    assert len(picks) > 1  # a seeded random choice of rows, not the first two
    assert len(load_benchmark(RB2_FIXTURE, 99, seed=0)) == 18
    assert len(load_benchmark(HS3_FIXTURE, 2, seed=0)) == 2  # ungrouped: n counts items


def fake_grm(monkeypatch, seen):
    """Replace model loading and the GRM judge of cmd_pairwise by marker_judge; `seen` gets the
    keyword arguments make_grm_judge was called with."""
    monkeypatch.setattr(eval_commands, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(eval_commands, "chat_format", lambda tok, chat: False)
    monkeypatch.setattr(eval_commands, "make_grm_judge", lambda model, tok, **kw: seen.update(kw) or marker_judge)


def test_cli_pairwise_default_set_overall_hand_computed(tmp_path, monkeypatch, capsys):
    """The default set (base 2025-01) = HelpSteer3 + RewardBench 2, read from the fixtures via
    --source. HelpSteer3 (tie dropped): row 1 right in both orders, row 2 wrong:both, row 3
    wrong:ab -> acc_ab 1/3, acc_ba 2/3, acc 0.5. RewardBench 2: 0.5625 (test above).
    Overall = (0.5 + 0.5625) / 2 = 0.53125 (by items it would be (3*0.5 + 6*0.5625) / 9 = 0.5417)."""
    seen = {}
    fake_grm(monkeypatch, seen)
    r = evaluate_main(["pairwise", "--model", "fake", *FIXTURE_SOURCES, "--n", "0", "--out", str(tmp_path)])
    out = capsys.readouterr()
    bench = {b["benchmark"]: b for b in r["benchmarks"]}
    assert list(bench) == ["HelpSteer3", "RewardBench 2"]
    assert bench["HelpSteer3"]["acc"] == pytest.approx(0.5) and bench["HelpSteer3"]["n"] == 3
    assert bench["HelpSteer3"]["acc_ab"] == pytest.approx(1 / 3) and bench["HelpSteer3"]["release"] == "2025-05"
    assert bench["RewardBench 2"]["acc"] == pytest.approx(0.5625) and bench["RewardBench 2"]["n"] == 6
    assert r["overall"]["acc"] == pytest.approx(0.53125) and r["overall"]["n_benchmarks"] == 2
    assert r["overall"]["paper_benchmarks"] == ["HelpSteer3", "RewardBench 2"]
    assert r["grm_prompt"] == "ours" and seen["style"] == "ours" and r["base_release"] == "2025-01"
    assert r["selection"]["chosen"] == ["helpsteer3", "reward_bench_2"] and "wpb" in r["selection"]["left_out"]
    saved = json.load(open(tmp_path / "pairwise.json"))
    assert saved["overall"]["acc"] == pytest.approx(0.53125) and saved["files"][1]["subsets"]["Focus"]["acc"] == 0.75
    assert len(open(tmp_path / "pairwise.items.jsonl").readlines()) == 3 + 18
    left = [ln for ln in out.out.splitlines() if ln.startswith("  left out")]
    assert len(left) == 3  # one line per reason: not supported (2 notes), too old
    assert "left out, not supported here: " in left[0] and "SCAN-HPD (2025-05), HREF (2024-12)" in left[0]
    assert left[2].startswith("  left out, not released 2024-12 or later") and "JudgeBench (2024-10)" in left[2]
    assert "Ties excluded" in out.out and "Overall (mean of 2)" in out.out and "warning" not in out.err
    r = evaluate_main(["pairwise", "--model", "fake", *FIXTURE_SOURCES, "--grm-prompt", "authors",
                       "--out", str(tmp_path)])
    assert r["grm_prompt"] == "authors" and seen["style"] == "authors"


def test_cli_pairwise_explicit_old_benchmark_warns(tmp_path, monkeypatch, capsys):
    """Asking for JudgeBench (2024-10) with a 2025-01 base: evaluated, one warning line naming it;
    an explicit RM-Bench file: the same; HelpSteer3 (2025-05): no warning."""
    fake_grm(monkeypatch, {})
    rm_file = data_path("rm_bench", "chat_filtered.jsonl")
    r = evaluate_main(["pairwise", "--model", "fake", "--benchmarks", "helpsteer3,judgebench", *FIXTURE_SOURCES,
                       rm_file, "--n", "2", "--out", str(tmp_path)])
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2
    assert "JudgeBench (released 2024-10) fails the contamination rule" in warnings[0]
    assert "RM-Bench file " in warnings[1] and "chat_filtered.jsonl (released 2024-10) fails" in warnings[1]
    assert [b["benchmark"] for b in r["benchmarks"]] == ["HelpSteer3", "JudgeBench", "RM-Bench"]
    assert r["selection"]["mode"] == "explicit" and r["selection"]["left_out"] == {}


def test_grm_judge_authors_prompt_and_parser(monkeypatch):
    """--grm-prompt authors: the judge builds the RM-NLHF authors' prompt (their 'role:\\ncontent'
    rendering of the item's turns) and parses with their parser, which takes a bare 'A' in
    <choice>; ours would not."""
    import types
    prompts = []
    monkeypatch.setattr(evaluate.rollout, "build_prompt_ids", lambda tok, text, chat: prompts.append(text) or [1, 2])
    monkeypatch.setattr(evaluate, "generate_texts", lambda model, tok, ids, **kw: [
        [{"completion": "<critics>\nB adds wrongly.\n</critics>\n<choice>A</choice>", "truncated": False}] for _ in ids])
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096))
    item = [it for it in load_benchmark(HS3_FIXTURE, 0, seed=0) if len(it["meta"]["turns"]) == 3][0]
    turns = item["meta"]["turns"]
    query = (item["context"], item["response_a"], item["response_b"], turns)
    out = evaluate.make_grm_judge(model, None, style="authors")([query])
    assert prompts[-1] == reward.build_grm_prompt(*query[:3], style="authors", turns=turns)
    assert "[The Start of Chatbot A's Response]" in prompts[-1] and "user:\nAnd 2 + 3?\n" in prompts[-1]
    assert out[0]["valid"] and out[0]["choice"] == "A"
    out = evaluate.make_grm_judge(model, None)([query])  # default: ours
    assert prompts[-1] == reward.build_grm_prompt(*query[:3]) and "Chatbot A" not in prompts[-1]
    assert not out[0]["valid"] and out[0]["why"] == "no_choice"


# ----------------------------------------------------------------------------------------------
# Math grading


def test_math_verify_equivalence():
    assert evaluate.math_equal("0.5", "\\frac{1}{2}")
    assert evaluate.math_equal("\\frac{1}{2}", "0.5")
    assert evaluate.math_equal("x=3", "3")
    assert evaluate.math_equal("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)")
    assert not evaluate.math_equal("\\frac{1}{3}", "0.5")
    assert not evaluate.math_equal(None, "3")
    p = {"kind": "math", "label": "3"}
    assert evaluate.grade(p, "so we get \\boxed{x=3}.") == ("x=3", True)
    assert evaluate.grade(p, "the answer is 3") == (None, False)  # no box -> wrong (docs/method.md §4.3)


def test_gsm8k_grading_numeric():
    p = {"kind": "gsm8k", "label": "1234"}
    assert evaluate.grade(p, "\\boxed{$1,234}") == ("$1,234", True)
    assert evaluate.grade(p, "\\boxed{1233}")[1] is False


def test_load_math_problems_schemas(tmp_path):
    g = load_math_problems(data_path("gsm8k", "test.jsonl"), 2)
    assert [x["label"] for x in g] == ["18", "3"] and g[0]["kind"] == "gsm8k"
    m = load_math_problems(data_path("math500", "test.jsonl"), 1)
    assert m[0]["kind"] == "math" and m[0]["id"] == "test/precalculus/807.json"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "target": "y"}])
    with pytest.raises(SystemExit, match=r"bad.jsonl.*fields found: \['prompt', 'target'\]"):
        load_math_problems(bad)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="empty.jsonl: file is empty"):
        load_math_problems(str(tmp_path / "empty.jsonl"))
    two = write_jsonl(tmp_path / "two.jsonl", [{"question": "q", "answer": "#### 1"}] * 2)
    with pytest.raises(SystemExit, match=r"--n-problems 3: .*two.jsonl has only 2 problems"):
        load_math_problems(two, 3)


def test_prompt_template_is_the_training_one(tmp_path):
    import argparse
    import yaml
    cfg = yaml.safe_load(open(os.path.join(REPO, "config.yaml")))
    assert evaluate.PROMPT_TEMPLATE == cfg["data"]["prompt_template"]  # accuracy = the trained task
    run_cfg = tmp_path / "config.yaml"
    run_cfg.write_text('data:\n  prompt_template: "Q: {question}\\nA:"\n')
    ns = argparse.Namespace(prompt_template=None, config=str(run_cfg))
    assert prompt_template(ns) == "Q: {question}\nA:"
    ns = argparse.Namespace(prompt_template="no field", config=None)
    with pytest.raises(SystemExit, match="must contain {question}"):
        prompt_template(ns)


def test_math_summary_pass1_mean_std():
    def ans(c):
        return {"correct": c, "truncated": False, "pred": "1" if c else None}
    items = [{"greedy": ans(True), "samples": [ans(True), ans(False), ans(True)]},
             {"greedy": ans(False), "samples": [ans(False), ans(False), ans(True)]}]
    s = evaluate.math_summary(items)
    # per-sample-index accuracy: [0.5, 0.0, 1.0] -> mean 0.5, population std sqrt(1/6)
    assert s["greedy_acc"] == 0.5 and s["greedy_no_box"] == 0.5
    assert s["sampled_pass1_per_sample"] == [0.5, 0.0, 1.0]
    assert s["sampled_pass1_mean"] == pytest.approx(0.5)
    assert s["sampled_pass1_std"] == pytest.approx(math.sqrt(1 / 6))
    assert s["sampled_pass_at_n"] == 1.0


# ----------------------------------------------------------------------------------------------
# Best-of-N


def bon_item(correct_idx, n):
    return {"id": 0, "question": "q", "samples": [
        {"completion": "right" if k == correct_idx else f"wrong{k}", "correct": k == correct_idx,
         "pred": "7" if k == correct_idx else str(k)} for k in range(n)]}


def test_best_of_n_with_fake_judge():
    def text_judge(queries):  # picks the response saying 'right', whatever its position
        return [{"choice": "B" if b == "right" else "A", "valid": True} for _, a, b in queries]
    for method, calls in (("knockout", 7), ("double_elimination", None)):
        r = evaluate.best_of_n(bon_item(5, 8), 8, text_judge, method, random.Random(0))
        assert r["pick"] == 5 and r["correct"] and r["invalid"] == 0
        assert r["calls"] == (calls or len(r["matches"])) and r["calls"] == len(r["matches"])
    r = evaluate.best_of_n(bon_item(5, 8), 8, text_judge, "double_elimination", random.Random(0))
    assert r["calls"] == 14  # the right answer never loses: 2N-2

    def broken_judge(queries):  # invalid output: the first-listed (higher seed) player advances
        return [{"choice": None, "valid": False} for _ in queries]
    r = evaluate.best_of_n(bon_item(3, 4), 4, broken_judge, "knockout", random.Random(0))
    assert r == {**r, "pick": 0, "correct": False, "calls": 3, "invalid": 3}
    r = evaluate.best_of_n(bon_item(0, 1), 1, broken_judge, "knockout", random.Random(0))
    assert r["pick"] == 0 and r["calls"] == 0 and r["correct"]


def test_load_or_sample_bad_files(tmp_path):
    import argparse
    ns = argparse.Namespace(samples=write_jsonl(tmp_path / "x.jsonl", [{"question": "q"}]), n_problems=None, policy=None)
    with pytest.raises(SystemExit, match=r"not an `evaluate math` items file.*fields found: \['question'\]"):
        load_or_sample(ns, 1)
    ns.samples = write_jsonl(tmp_path / "y.jsonl", [bon_item(0, 3), bon_item(1, 2)])
    assert len(load_or_sample(ns, 2)) == 2
    with pytest.raises(SystemExit, match=r"N=3 is larger than the samples available \(2 per problem"):
        load_or_sample(ns, 3)


def test_reference_solution_control():
    it = {"kind": "gsm8k", "label": "18", "reference": "She sells 16 - 7 = <<16-7=9>>9 eggs.\n#### 18"}
    assert evaluate.reference_solution(it) == "She sells 16 - 7 = 9 eggs.\nThe answer is \\boxed{18}."
    assert evaluate.grade(it, evaluate.reference_solution(it)) == ("18", True)
    wrong = evaluate.reference_solution(it, evaluate.known_wrong_answer("18"))
    assert wrong == "She sells 16 - 7 = 9 eggs.\nThe answer is \\boxed{19}." and evaluate.grade(it, wrong)[1] is False
    assert evaluate.reference_solution({"kind": "math", "label": "3", "reference": "\\boxed{3}"}) is None


def test_known_wrong_answer():
    assert evaluate.known_wrong_answer("18") == "19"
    assert evaluate.known_wrong_answer("0.5") == "1.5"
    assert evaluate.known_wrong_answer("\\pi") == "0" and evaluate.known_wrong_answer("0") == "1"


def test_majority_vote():
    s = [{"pred": "3"}, {"pred": None}, {"pred": "5"}, {"pred": "5"}, {"pred": "3"}]
    assert evaluate.majority_vote(s) == 0  # tie 3 vs 5: the first sample holding a top answer
    assert evaluate.majority_vote(s[1:]) == 1
    assert evaluate.majority_vote([{"pred": None}]) == 0


# ----------------------------------------------------------------------------------------------
# Plot helpers


def test_curve_mean_std_across_runs(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"step": 0, "r": 0.0}, {"step": 1, "r": 1.0}, {"step": 2, "r": 5.0}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"step": 0, "r": 2.0}, {"step": 1, "r": 3.0}])  # shorter run
    c = curve([a, b], "r", 0.9)
    # bias-corrected EMA a: [0, 0.1/0.19], b: [2, (0.18 + 0.3)/0.19]; common steps 0, 1
    assert c["x"] == [0, 1] and c["runs"] == 2 and c["raw"] == pytest.approx([1.0, 2.0])
    assert c["ema"] == pytest.approx([1.0, (0.1 + 0.48) / 0.19 / 2])
    assert c["se"] == pytest.approx([1.0, abs(0.48 - 0.1) / 0.19 / 2])  # 2 runs: s.e. = |difference| / 2
    assert c["std"] == pytest.approx([2 ** 0.5, abs(0.48 - 0.1) / 0.19 / 2 ** 0.5])  # std = |difference| / sqrt(2)
    nan = write_jsonl(tmp_path / "n.jsonl", [{"step": 0, "r": 1.0}, {"step": 1}, {"step": 2, "r": 0.0}])
    assert curve([nan], "r", 0.5) == {"x": [0, 2], "raw": [1.0, 0.0], "ema": [1.0, pytest.approx(0.5 / 1.5)],
                                      "std": None, "se": None, "runs": 1}
    with pytest.raises(SystemExit, match=r"no numeric values for metric 'acc'; keys found: \['r', 'step'\]"):
        curve([a], "acc")
    assert parse_curve("rlme=x/m.jsonl,y/m.jsonl") == ("rlme", ["x/m.jsonl", "y/m.jsonl"])


def test_cli_plot_end_to_end(tmp_path):
    runs = []
    for seed in range(2):
        rng = random.Random(seed)
        rows = [{"step": t, "reward/mean": -2 + t / 10 + rng.random() * 0.1,
                 "accuracy": 0.3 - t / 100 + rng.random() * 0.05} for t in range(20)]
        runs.append(write_jsonl(tmp_path / f"run{seed}.jsonl", rows))
    out = tmp_path / "plots"
    p = run_cli("plot", f"rlme={runs[0]},{runs[1]}", f"single={runs[0]}", "--out", out, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (out / "curves.png").stat().st_size > 5000 and (out / "reward_vs_accuracy.png").stat().st_size > 5000
    res = json.load(open(out / "plot.json"))
    rows = {(r["curve"], r["metric"]): r for r in res["table"]}
    assert rows[("rlme", "reward/mean")]["runs"] == 2 and rows[("rlme", "reward/mean")]["steps"] == 20
    assert rows[("rlme", "reward/mean")]["last"] > rows[("rlme", "reward/mean")]["first"]  # rising reward
    assert rows[("rlme", "accuracy")]["last"] < rows[("rlme", "accuracy")]["first"]         # falling accuracy
    assert rows[("single", "accuracy")]["last_se"] is None and rows[("rlme", "accuracy")]["last_se"] > 0
    assert "rlme" in p.stdout and "reward_vs_accuracy.png" in p.stdout


# ----------------------------------------------------------------------------------------------
# Bad input: one line, no stack trace


def test_bad_inputs_one_line(tmp_path):
    notmodel = tmp_path / "ckpt"
    notmodel.mkdir()
    (notmodel / "notes.txt").write_text("hi")
    assert_one_line_error(run_cli("math", "--model", notmodel, "--n-problems", "1", timeout=120), "not a model")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(run_cli("plot", empty, "--out", tmp_path, timeout=120), "empty.jsonl: file is empty")
    samples = write_jsonl(tmp_path / "items.jsonl", [bon_item(0, 2), bon_item(1, 2)])
    assert_one_line_error(run_cli("bon", "--judge", SMOLLM2, "--samples", samples, "--ns", "1,4", timeout=120),
                          "N=4 is larger than the samples available (2 per problem")
    assert_one_line_error(run_cli("bon", "--judge", SMOLLM2, "--samples", samples, "--methods", "swiss", timeout=120),
                          "unknown ['swiss']")


def test_bad_benchmark_schema_one_line(tmp_path):
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "good": "x", "worse": "y"}])
    p = run_cli("pairwise", "--model", SMOLLM2, odd, timeout=120)
    assert_one_line_error(p, "odd.jsonl", "['good', 'question', 'worse']")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(run_cli("pairwise", "--model", SMOLLM2, empty, timeout=120), "empty.jsonl")


# ----------------------------------------------------------------------------------------------
# Fake generation: prompts recorded, answers chosen per prompt (no model is loaded)


def fake_generation(monkeypatch, answer_for):
    """Replace model loading and generation: a prompt's 'ids' are its text; answer_for(prompt,
    temperature) gives the completion. Returns the list the prompts are appended to."""
    prompts = []
    monkeypatch.setattr(eval_commands, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(eval_commands, "use_chat_template", lambda tok, chat, **kw: False)
    monkeypatch.setattr(evaluate.rollout, "build_prompt_ids", lambda tok, text, chat: prompts.append(text) or [text])

    def generate(model, tok, ids, n=1, temperature=0.0, **kw):
        return [[{"completion": answer_for(p[0], temperature), "truncated": False} for _ in range(n)] for p in ids]
    monkeypatch.setattr(evaluate, "generate_texts", generate)
    return prompts


def read_items(folder, prefix):
    names = [f for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".items.jsonl")]
    assert len(names) == 1, names
    return [json.loads(ln) for ln in open(os.path.join(folder, names[0]))]


# ----------------------------------------------------------------------------------------------
# NoCheat's counterfactual accuracy: `math --inject` (RLME §4, Fig. 7)

NOCHEAT = "{question}\nThe answer is {answer}.\nReason step by step, and put your final answer within \\boxed{{}}."


def copy_shown_except(truths):
    """A policy that copies the answer its prompt shows, except for questions in `truths`
    ({question: completion})."""
    import re

    def answer(prompt, temperature):
        for q, text in truths.items():
            if prompt.startswith(q + "\n"):
                return text
        return "\\boxed{%s}" % re.search(r"The answer is (.*)\.\n", prompt).group(1)
    return answer


def test_math_inject_wrong_shows_a_wrong_answer_and_grades_against_the_truth(tmp_path, monkeypatch, capsys):
    """GSM8K labels 18, 3, 70. --inject wrong shows 19, 4, 71 (label + 1), never the truth; the
    policy copies what it is shown except on Q2 (solves it: 3). Graded against the truth:
    counterfactual accuracy 1/3. --inject reference shows 18, 3, 70: copying gives 3/3."""
    data = write_jsonl(tmp_path / "g.jsonl", [{"question": "Q1 eggs?", "answer": "16 - 3 = 13\n#### 18"},
                                              {"question": "Q2 bolts?", "answer": "#### 3"},
                                              {"question": "Q3 profit?", "answer": "#### 70"}])
    prompts = fake_generation(monkeypatch, copy_shown_except({"Q2 bolts?": "so \\boxed{3}"}))
    out = tmp_path / "out"
    r = evaluate_main(["math", "--model", "fake", "--data", data, "--prompt-template", NOCHEAT, "--inject", "wrong",
                       "--n-problems", "3", "--n-samples", "0", "--out", str(out)])
    assert len(prompts) == 3
    for p, truth, shown in zip(prompts, ("18", "3", "70"), ("19", "4", "71")):
        assert f"The answer is {shown}." in p and f"The answer is {truth}." not in p
    assert r["inject"] == "wrong" and r["counterfactual_acc"] == pytest.approx(1 / 3) == r["greedy_acc"]
    items = read_items(out, "math_")
    assert [it["shown_answer"] for it in items] == ["19", "4", "71"]
    assert [it["greedy"]["pred"] for it in items] == ["19", "3", "71"]
    assert [it["greedy"]["correct"] for it in items] == [False, True, False]
    assert json.load(open(next(out.glob("math_*_inject-wrong.json"))))["counterfactual_acc"] == pytest.approx(1 / 3)
    printed = capsys.readouterr().out
    assert "COUNTERFACTUAL accuracy" in printed and "counterfactual_acc" in printed
    prompts.clear()
    r = evaluate_main(["math", "--model", "fake", "--data", data, "--prompt-template", NOCHEAT, "--inject",
                       "reference", "--n-problems", "3", "--n-samples", "0", "--out", str(out)])
    assert [f"The answer is {t}." in p for p, t in zip(prompts, ("18", "3", "70"))] == [True, True, True]
    assert r["greedy_acc"] == 1.0 and "counterfactual_acc" not in r and r["inject"] == "reference"
    assert "COUNTERFACTUAL" not in capsys.readouterr().out


def test_math_inject_text_labels_take_the_next_answer(tmp_path, monkeypatch):
    """MATH answers that are not numbers: the next problem's answer is shown, "none" when it is the
    same, wrapping round; a policy copying it is wrong on all three."""
    data = write_jsonl(tmp_path / "m.jsonl", [{"problem": "P1", "answer": "(1,2)"}, {"problem": "P2", "answer": "(3,4)"},
                                              {"problem": "P3", "answer": "(3,4)"}])
    prompts = fake_generation(monkeypatch, copy_shown_except({}))
    r = evaluate_main(["math", "--model", "fake", "--data", data, "--prompt-template", NOCHEAT, "--inject", "wrong",
                       "--n-problems", "3", "--n-samples", "0", "--out", str(tmp_path)])
    assert ["The answer is (3,4)." in prompts[0], "The answer is none." in prompts[1],
            "The answer is (1,2)." in prompts[2]] == [True, True, True]
    assert "(1,2)" not in prompts[0] and r["counterfactual_acc"] == 0.0


def old_train_wrong_answer(val, k):
    """wrong_answer as it was before the rule moved to evaluate.wrong_answer (a copy)."""
    it = val[k]
    if isinstance(it["label"], str) and reward.to_number(it["label"]) is not None:
        return evaluate.known_wrong_answer(it["label"])
    other = val[(k + 1) % len(val)]["answer_text"]
    return other if other != it["answer_text"] else "none"


def test_wrong_answer_is_the_training_rule():
    lists = [
        [{"label": "18", "answer_text": "18"}, {"label": ["Paris", "paris"], "answer_text": "Paris"},
         {"label": "Lyon", "answer_text": "Lyon"}, {"label": "Lyon", "answer_text": "Lyon"}],
        [{"label": "1,234", "answer_text": "1,234"}, {"label": "\\frac{1}{2}", "answer_text": "\\frac{1}{2}"},
         {"label": ["7"], "answer_text": "7"}, {"label": "(1,2)", "answer_text": "(1,2)"}],
        [{"label": None, "answer_text": None}, {"label": None, "answer_text": None}],
        [{"label": "x", "answer_text": "x"}],
    ]
    for val in lists:
        for k in range(len(val)):
            assert evaluate.wrong_answer(val, k) == old_train_wrong_answer(val, k) == wrong_answer(val, k)
    assert [evaluate.wrong_answer(lists[1], k) for k in range(4)] == ["1235", "1.5", "(1,2)", "1,234"]
    assert evaluate.wrong_answer(lists[2], 0) == "none" and evaluate.wrong_answer(lists[3], 0) == "none"


@pytest.mark.parametrize("args, message", [
    (["--prompt-template", NOCHEAT], "--inject: the prompt template shows {answer} (NoCheat, RLME §4 Fig. 7); "
                                     "choose --inject wrong"),
    (["--prompt-template", NOCHEAT, "--inject", "none"], "--inject none: the prompt template shows {answer}"),
    (["--inject", "wrong"], "--inject wrong: the prompt template has no {answer} to fill"),
    (["--inject", "reference"], "--inject reference: the prompt template has no {answer} to fill"),
    (["--prompt-template", "{context} {question}"], "placeholder(s) ['context'] this subcommand cannot fill"),
    (["--prompt-template", "{question} {}"], "placeholder(s) [''] this subcommand cannot fill"),
    (["--prompt-template", "{question"], "the prompt template is not a valid format string"),
])
def test_math_inject_errors_are_one_line_before_the_model(tmp_path, args, message):
    data = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(SystemExit) as e:  # 'x' is no model: these stop before loading one
        evaluate_main(["math", "--model", "x", "--data", data, "--out", str(tmp_path), *args])
    assert message in str(e.value.code) and "\n" not in str(e.value.code)


def test_math_inject_from_a_run_config(tmp_path):
    """The template of a NoCheat run (configs/paper/rlme/nocheat.yaml) needs --inject; the CLI says so in one line."""
    p = run_cli("math", "--model", "x", "--config", os.path.join(REPO, "configs", "paper", "rlme", "nocheat.yaml"),
                "--out", tmp_path, timeout=120)
    assert_one_line_error(p, "--inject: the prompt template shows {answer}")


# ----------------------------------------------------------------------------------------------
# Context QA: `qa` (RLME §4 Tables 1-2; FaithEval-Counterfactual)

FE_FIXTURE = os.path.join(FIXTURES, "faitheval_counterfactual_sample.jsonl")
FE_FIELDS = {k: v for k, v in QA_PRESETS["faitheval"].items() if k.endswith("_field")}


def test_qa_prompt_template_is_the_qa_rlvr_one():
    import yaml
    cfg = yaml.safe_load(open(os.path.join(REPO, "configs", "paper", "rlme", "qa_rlvr.yaml")))
    assert evaluate.QA_PROMPT_TEMPLATE == cfg["data"]["prompt_template"]
    assert QA_PRESETS["faitheval"]["data"] == "Salesforce/FaithEval-counterfactual-v1.0"
    assert QA_PRESETS["faitheval"]["split"] == "test"


def test_load_qa_items_faitheval_schema():
    """Options listed under the question; gold = the key's option text; letters = its label and
    the key (row 3 is labelled 1-4 with key 'A', as some ARC-derived rows: the first option)."""
    items = load_qa_items(FE_FIXTURE, **FE_FIELDS)
    assert len(items) == 4 and items[0]["id"] == "cf_1" and items[0]["kind"] == "qa"
    assert items[0]["question"] == ("Which planet is closest to the Sun?\nOptions:\nA) Mercury\nB) Venus\nC) Earth\n"
                                    "D) Mars")
    assert items[0]["context"].startswith("Recent observations established that Venus")
    assert [it["label"] for it in items] == [["Venus"], ["100 degrees Celsius"], ["It decreases."], ["green"]]
    assert [it["choice_letters"] for it in items] == [["B"], ["C"], ["1", "A"], ["B"]]
    assert load_qa_items(FE_FIXTURE, n=2, **FE_FIELDS)[1]["answer_text"] == "100 degrees Celsius"


def test_grade_qa_letters_text_and_the_article_trap():
    """The letter A normalises to "" under SQuAD rules (an article), so it would match an empty or
    article-only box if it were a gold string; the letter rule takes only a letter."""
    p = {"label": ["It decreases."], "choice_letters": ["1", "A"]}
    g = evaluate.grade_qa
    assert g(p, "\\boxed{A}")["em"] == 1.0 and g(p, "\\boxed{(1)}")["f1"] == 1.0 and g(p, "\\boxed{a.}")["correct"]
    assert g(p, "\\boxed{it decreases}") == {"pred": "it decreases", "em": 1.0, "f1": 1.0, "correct": True}
    # F1 by hand: pred [it, decreases, slowly], gold [it, decreases]: P 2/3, R 1 -> 0.8
    assert g(p, "\\boxed{It decreases slowly}") == {"pred": "It decreases slowly", "em": 0.0,
                                                     "f1": pytest.approx(0.8), "correct": False}
    for wrong in ("\\boxed{the}", "\\boxed{}", "\\boxed{B}", "\\boxed{2}", "A", "\\boxed{A) It increases.}"):
        assert g(p, wrong)["em"] == 0.0 and not g(p, wrong)["correct"], wrong
    assert reward.qa_exact_match("the", ["It decreases.", "A"]) == 1.0  # why the letter is not a gold string
    assert g({"label": ["x y"]}, "\\boxed{x}")["f1"] == pytest.approx(2 / 3)  # free-form: no letters


def test_cli_qa_faitheval_preset_on_the_fixture_hand_computed(tmp_path, monkeypatch, capsys):
    """--preset faitheval with --data the local fixture, 1 greedy + 1 sampled answer each:
      greedy  cf_1 Venus (1, 1); cf_2 C = the gold letter (1, 1); cf_3 'It decreases slowly'
              (0, 0.8); cf_4 blue (0, 0)                      -> EM 2/4 = 0.5, F1 2.8/4 = 0.7
      sampled cf_1 'B)' (1, 1); cf_2 '100 degrees' vs '100 degrees celsius': P 1, R 2/3 (0, 0.8);
              cf_3 'the' (0, 0); cf_4 no box (0, 0)           -> EM 0.25, F1 0.45 (std 0: one sample)"""
    answers = {("closest", 0): "\\boxed{Venus}", ("freeze", 0): "So \\boxed{C}.",
               ("speed", 0): "\\boxed{It decreases slowly}", ("color", 0): "\\boxed{blue}",
               ("closest", 1): "\\boxed{B)}", ("freeze", 1): "\\boxed{100 degrees}", ("speed", 1): "\\boxed{the}",
               ("color", 1): "green, I think"}

    def answer_for(prompt, temperature):
        return next(a for (word, t), a in answers.items() if word in prompt and t == (temperature > 0))
    prompts = fake_generation(monkeypatch, answer_for)
    r = evaluate_main(["qa", "--model", "fake", "--preset", "faitheval", "--data", FE_FIXTURE, "--n-samples", "1",
                       "--out", str(tmp_path)])
    assert r["greedy_em"] == 0.5 and r["greedy_f1"] == pytest.approx(0.7) and r["greedy_no_box"] == 0.0
    assert r["sampled_em_mean"] == 0.25 and r["sampled_f1_mean"] == pytest.approx(0.45) and r["sampled_em_std"] == 0.0
    assert r["multiple_choice"] and r["split"] == "test" and r["answer_field"] == "answerKey" and r["preset"] == "faitheval"
    assert prompts[0] == evaluate.QA_PROMPT_TEMPLATE.format(
        context="Recent observations established that Venus, not Mercury, is the planet closest to the Sun.",
        question="Which planet is closest to the Sun?\nOptions:\nA) Mercury\nB) Venus\nC) Earth\nD) Mars")
    items = read_items(tmp_path, "qa_")
    assert [it["greedy"]["f1"] for it in items] == [1.0, 1.0, pytest.approx(0.8), 0.0]
    assert [it["samples"][0]["em"] for it in items] == [1.0, 0.0, 0.0, 0.0] and items[3]["samples"][0]["pred"] is None
    assert "greedy_em" in capsys.readouterr().out


def test_cli_qa_generic_fields_on_qa_feedback(tmp_path, monkeypatch):
    """QA-Feedback (question, passages, gold), contexts cut at 300 characters. Row 1 answers its
    gold: EM 1, F1 1. Row 2 answers 'Tarzana, California': its gold has 48 tokens after
    normalisation (articles dropped), holding tarzana once and california twice -> common 2,
    P 1, R 2/48, F1 = 2 (2/48) / (1 + 2/48) = 4/50 = 0.08. Means: EM 0.5, F1 0.54."""
    path = data_path("qa_feedback", "dev_feedback.jsonl")
    rows = [json.loads(ln) for ln in open(path)][:2]
    prompts = fake_generation(monkeypatch, lambda prompt, t: "\\boxed{%s}" % (
        rows[0]["gold"] if "bloom by troye" in prompt else "Tarzana, California"))
    r = evaluate_main(["qa", "--model", "fake", "--data", path, "--context-field", "passages", "--answer-field", "gold",
                       "--context-max-chars", "300", "--n-problems", "2", "--out", str(tmp_path)])
    assert r["greedy_em"] == 0.5 and r["greedy_f1"] == pytest.approx(0.54) and not r["multiple_choice"]
    ctx = render_context(rows[0]["passages"], 300)
    assert len(ctx) == 300 and ctx.startswith("Bloom (Troye Sivan album): Bloom (Troye Sivan album)\n\nBloom is")
    assert prompts[0] == evaluate.QA_PROMPT_TEMPLATE.format(context=ctx, question=rows[0]["question"])
    assert [it["greedy"]["f1"] for it in read_items(tmp_path, "qa_")] == [1.0, pytest.approx(0.08)]


def test_cli_qa_real_generation_on_the_tiny_model(tiny_model_path, tmp_path):
    """The whole path with a real (random) model: 2 FaithEval fixture rows, greedy + 1 sample."""
    r = evaluate_main(["qa", "--model", tiny_model_path, "--preset", "faitheval", "--data", FE_FIXTURE,
                       "--n-problems", "2", "--n-samples", "1", "--max-new-tokens", "4", "--out", str(tmp_path)])
    assert r["n_problems"] == 2 and r["n_samples"] == 1 and 0.0 <= r["greedy_f1"] <= 1.0
    items = read_items(tmp_path, "qa_fixtures-faitheval_counterfactual_sample")
    assert len(items) == 2 and all(isinstance(it["greedy"]["completion"], str) for it in items)


@pytest.mark.parametrize("rows, args, message", [
    (None, [], "qa: give --data FILE_OR_HUB_ID or --preset faitheval"),
    ([{"question": "q", "passages": "p", "answer": "a"}], [], "row 1: no field 'context' (--context-field); "
                                                              "fields found: ['answer', 'passages', 'question']"),
    ([{"question": "q", "context": 5, "answer": "a"}], [], "row 1: field 'context' (--context-field): context: expected"),
    ([{"question": "q", "context": "c", "answer": []}], [], "row 1: field 'answer' (--answer-field): expected"),
    ([{"question": "q", "context": "c", "choices": {"label": ["A", "B"], "text": ["x", "y"]}, "answerKey": "E"}],
     ["--preset", "faitheval"], "row 1: field 'answerKey' (--answer-field): answer key 'E' is not one of the option "
                                "labels ['A', 'B']"),
    ([{"question": "q", "context": "c", "choices": "x y", "answerKey": "A"}], ["--preset", "faitheval"],
     "row 1: field 'choices' (--choices-field): expected"),
    ([{"question": "q", "context": "c", "answer": "a"}], ["--prompt-template", "{question}"],
     "the prompt template must contain {context}"),
    ([{"question": "q", "context": "c", "answer": "a"}], ["--prompt-template", "{context}{question}{answer}"],
     "placeholder(s) ['answer'] this subcommand cannot fill"),
    ([{"question": "q", "context": "c", "answer": "a"}], ["--context-max-chars", "-1"], "--context-max-chars -1"),
    ([{"question": "q", "context": "c", "answer": "a"}], ["--n-problems", "2"], "--n-problems 2: "),
])
def test_qa_bad_input_is_one_line_before_the_model(tmp_path, rows, args, message):
    data = ["--data", write_jsonl(tmp_path / "d.jsonl", rows)] if rows is not None else []
    with pytest.raises(SystemExit) as e:  # 'x' is no model: these stop before loading one
        evaluate_main(["qa", "--model", "x", *data, "--out", str(tmp_path), *args])
    assert message in str(e.value.code) and "\n" not in str(e.value.code)


def test_qa_faitheval_hub_unreachable_is_one_line(tmp_path):
    p = run_cli("qa", "--model", "not-a-model", "--preset", "faitheval", "--out", tmp_path, timeout=180,
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assert_one_line_error(p, "--data Salesforce/FaithEval-counterfactual-v1.0: ", "could not be loaded as a hub dataset",
                          "pass a local JSONL copy: --data FILE.jsonl")


# ----------------------------------------------------------------------------------------------
# bon --grm-prompt (as pairwise's)


def test_bon_passes_the_grm_prompt_style(tmp_path, monkeypatch):
    seen = {}

    def text_judge(queries):  # picks the answer saying 'right'
        return [{"choice": "B" if b == "right" else "A", "valid": True} for _, a, b in queries]
    monkeypatch.setattr(eval_commands, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(eval_commands, "chat_format", lambda tok, chat: False)
    monkeypatch.setattr(eval_commands, "make_grm_judge", lambda model, tok, **kw: seen.update(kw) or text_judge)
    samples = write_jsonl(tmp_path / "items.jsonl", [bon_item(1, 2), bon_item(0, 2)])
    r = evaluate_main(["bon", "--judge", "fake", "--samples", samples, "--ns", "2", "--out", str(tmp_path)])
    assert seen["style"] == "ours" and r["grm_prompt"] == "ours" and r["rows"][0]["knockout_acc"] == 1.0
    r = evaluate_main(["bon", "--judge", "fake", "--samples", samples, "--ns", "2", "--grm-prompt", "authors",
                       "--out", str(tmp_path)])
    assert seen["style"] == "authors" and r["grm_prompt"] == "authors"
    assert json.load(open(tmp_path / "bon.json"))["grm_prompt"] == "authors"


# ----------------------------------------------------------------------------------------------
# The GRM's decoding in pairwise and bon (issue 27 item 5): the release's by default, greedy256 one flag away


def recording_generate(monkeypatch, calls, text="<critics>\nB is wrong.\n</critics>\n<choice>[[A]]</choice>"):
    """fast.generate (what the CLI passes to make_grm_judge) replaced by a fake that records the
    decoding arguments of each call and answers `text` for every row; prompts become [1, 2]."""
    import types
    import fast
    monkeypatch.setattr(evaluate.rollout, "build_prompt_ids", lambda tok, text, chat: [1, 2])
    monkeypatch.setattr(eval_commands, "load_model", lambda *a, **k: (
        types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=10 ** 6)), None))
    monkeypatch.setattr(eval_commands, "chat_format", lambda tok, chat: False)

    def generate(model, tok, prompt_ids, group_size, max_new_tokens, temperature, top_p, top_k, seed):
        calls.append({"rows": len(prompt_ids) * group_size, "max_new_tokens": max_new_tokens,
                      "temperature": temperature, "top_p": top_p, "seed": seed})
        return {"completions": [text] * (len(prompt_ids) * group_size), "truncated": [False] * len(prompt_ids)}
    monkeypatch.setattr(fast, "generate", generate)


@pytest.mark.parametrize("flags, expect", [
    # the release's validation: sampling at T 0.6, 8,192 new tokens, top-p 1.0 (seed: --seed, 0)
    ([], {"temperature": 0.6, "max_new_tokens": 8192, "top_p": 1.0, "seed": 0}),
    (["--seed", "5", "--top-p", "0.9"], {"temperature": 0.6, "max_new_tokens": 8192, "top_p": 0.9, "seed": 5}),
    # today's protocol, one flag away; a single value can still be changed
    (["--protocol", "greedy256"], {"temperature": 0.0, "max_new_tokens": 256, "top_p": 1.0, "seed": 0}),
    (["--protocol", "greedy256", "--temperature", "0.3"], {"temperature": 0.3, "max_new_tokens": 256, "top_p": 1.0, "seed": 0}),
    (["--max-new-tokens", "1024"], {"temperature": 0.6, "max_new_tokens": 1024, "top_p": 1.0, "seed": 0}),
])
def test_pairwise_decoding_reaches_the_generation_call(tmp_path, monkeypatch, capsys, flags, expect):
    """HelpSteer3 fixture: 3 pairs (its tie dropped) x 2 orders = 6 rows in one batch (--batch-size 8)
    -> one generation call with exactly these settings; the work line says 3 x 2 x T tokens."""
    calls = []
    recording_generate(monkeypatch, calls)
    r = evaluate_main(["pairwise", "--model", "fake", HS3_FIXTURE, "--n", "0", "--out", str(tmp_path), *flags])
    assert calls == [{"rows": 6, **expect}]
    assert r["decoding"] == {"protocol": "greedy256" if "greedy256" in flags else "release", **expect}
    assert r["max_new_tokens"] == expect["max_new_tokens"]
    T = expect["max_new_tokens"]
    err = capsys.readouterr().err
    assert f"pairwise: 3 items x 2 A/B orders x up to {T} new tokens = up to {6 * T:,} tokens to generate" in err
    assert r["files"][0]["format_fail"] == 0.0 and r["files"][0]["pick_a"] == 1.0  # the fake always says [[A]]


def test_bon_judge_decoding_and_its_seeds(tmp_path, monkeypatch, capsys):
    """bon: the judge samples with the release's settings whatever the policy's --temperature says;
    two problems, N = 2, knockout only: one match per problem, one judge call each (one row), the
    c-th call seeded --seed + 1,000,003 c. Work line: 2 problems x 1 call x 8192 tokens."""
    calls = []
    recording_generate(monkeypatch, calls)
    samples = write_jsonl(tmp_path / "items.jsonl", [bon_item(1, 2), bon_item(0, 2)])
    r = evaluate_main(["bon", "--judge", "fake", "--samples", samples, "--ns", "2", "--methods", "knockout",
                       "--temperature", "1.0", "--seed", "3", "--out", str(tmp_path)])
    assert calls == [{"rows": 1, "max_new_tokens": 8192, "temperature": 0.6, "top_p": 1.0, "seed": 3},
                     {"rows": 1, "max_new_tokens": 8192, "temperature": 0.6, "top_p": 1.0, "seed": 3 + 1_000_003}]
    assert r["judge_decoding"]["protocol"] == "release"
    assert "bon judge: 2 problems x 1 judge calls (at most) x up to 8192 new tokens = up to 16,384" in capsys.readouterr().err
    calls.clear()
    evaluate_main(["bon", "--judge", "fake", "--samples", samples, "--ns", "1,2", "--protocol", "greedy256",
                   "--judge-max-new-tokens", "64", "--out", str(tmp_path)])
    # N = 1 plays no match; N = 2: knockout 1 + double elimination 2 or 3 matches per problem
    assert {(c["temperature"], c["max_new_tokens"]) for c in calls} == {(0.0, 64)}
    assert "2 problems x 4 judge calls (at most)" in capsys.readouterr().err  # 0 + 0 + 1 + 3


@pytest.mark.parametrize("flags, line", [
    (["--temperature", "-1"], "--temperature: must be >= 0 (0 = greedy), got -1.0"),
    (["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
])
def test_pairwise_bad_decoding_flags_are_one_line(tmp_path, monkeypatch, flags, line):
    monkeypatch.setattr(eval_commands, "load_model", stop_at_model)
    with pytest.raises(SystemExit) as e:
        evaluate_main(["pairwise", "--model", "fake", HS3_FIXTURE, "--out", str(tmp_path), *flags])
    assert str(e.value) == line


def stop_at_model(*a, **kw):
    raise AssertionError("a model was loaded")


def test_greedy256_gives_the_earlier_default_exactly(tiny_model_path, tmp_path):
    """--protocol greedy256 = what `pairwise` ran before this flag existed: greedy, 256 new tokens,
    through fast.generate, the GRM prompt in the tokenizer's chat template (make_grm_judge's plain
    greedy path). Same outputs, same numbers, on the tiny random model; the default (release)
    samples and, with an 8,192-token budget over this model's 2,048-token context, generates nothing."""
    import fast
    f = data_path("llmbar", "LLMBar_Natural.jsonl")
    r = evaluate_main(["pairwise", "--model", tiny_model_path, f, "--n", "2", "--protocol", "greedy256",
                       "--out", str(tmp_path)])
    model, tok = load_model(tiny_model_path)
    chat = eval_commands.chat_format(tok, eval_commands.parse_chat(cli.build_parser().parse_args(["pairwise", "--model", "m"]), tiny_model_path))
    items = load_benchmark(f, 2, seed=0)
    judge = evaluate.make_grm_judge(model, tok, max_new_tokens=256, batch_size=8, chat=chat, generate=fast.generate)
    summary, records = evaluate.pairwise_accuracy(items, judge)
    saved = [json.loads(line) for line in open(tmp_path / "pairwise.items.jsonl")]
    assert [(x["ab"]["text"], x["ba"]["text"]) for x in saved] == [(x["ab"]["text"], x["ba"]["text"]) for x in records]
    assert all(x["ab"]["text"] for x in saved)  # something was generated
    for k in ("acc_ab", "acc_ba", "acc", "format_fail"):
        assert r["files"][0][k] == summary[k]
    r = evaluate_main(["pairwise", "--model", tiny_model_path, f, "--n", "2", "--out", str(tmp_path)])
    assert r["decoding"]["temperature"] == 0.6 and r["files"][0]["format_fail"] == 1.0  # every prompt "too long"


# ----------------------------------------------------------------------------------------------
# End to end on the real SmolLM2 model (slow)


@pytest.fixture(scope="module")
def gsm8k_items(tmp_path_factory):
    """`evaluate.py math` on 2 GSM8K test problems, greedy + 2 samples, 16 new tokens."""
    out = tmp_path_factory.mktemp("math")
    p = run_cli("math", "--model", SMOLLM2, "--data", data_path("gsm8k", "test.jsonl"), "--n-problems", 2,
                "--n-samples", 2, "--max-new-tokens", 16, "--out", out)
    assert p.returncode == 0, p.stderr
    return out


@pytest.mark.slow
def test_cli_math_gsm8k(gsm8k_items):
    s = json.load(open(gsm8k_items / "math_gsm8k-test.json"))
    assert s["n_problems"] == 2 and s["n_samples"] == 2 and s["kind"] == "gsm8k"
    for k in ("greedy_acc", "sampled_pass1_mean", "sampled_pass1_std", "sampled_pass_at_n", "greedy_truncated"):
        assert 0.0 <= s[k] <= 1.0, k
    items = [json.loads(l) for l in open(gsm8k_items / "math_gsm8k-test.items.jsonl")]
    assert [it["label"] for it in items] == ["18", "3"]
    for it in items:
        assert it["greedy"]["completion"] and len(it["samples"]) == 2
        for a in [it["greedy"]] + it["samples"]:
            assert a["correct"] == evaluate.numeric_correct(a["pred"], it["label"])


@pytest.mark.slow
def test_cli_math_math500_greedy(tmp_path):
    p = run_cli("math", "--model", SMOLLM2, "--data", data_path("math500", "test.jsonl"), "--n-problems", 2,
                "--n-samples", 0, "--max-new-tokens", 16, "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    s = json.load(open(tmp_path / "math_math500-test.json"))
    assert s["kind"] == "math" and s["n_problems"] == 2 and 0.0 <= s["greedy_acc"] <= 1.0
    assert "sampled_pass1_mean" not in s and "math500-test" in p.stdout


@pytest.mark.slow
def test_cli_evaluator_check(gsm8k_items, tmp_path):
    p = run_cli("evaluator-check", "--evaluator", SMOLLM2, "--samples", gsm8k_items / "math_gsm8k-test.items.jsonl",
                "--n-canary", 2, "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    s = json.load(open(tmp_path / "evaluator_check.json"))
    assert s["n_answers"] == 6 and s["question"] == "Is the answer correct?"
    assert s["auroc"] is None or 0.0 <= s["auroc"] <= 1.0
    assert 0.0 <= s["control_auroc"] <= 1.0  # 2 references vs the same with a wrong answer
    assert sum(r["n"] for r in s["reliability"]) == 6
    names = [c["answer"] for c in s["canaries"]]
    assert names == ["colon", "step_by_step", "claims_correct", "known_wrong", "reference"]
    for c in s["canaries"]:
        assert 0.0 < c["mean_p"] <= 1.0 and c["mean_logp"] <= 0.0
    recs = [json.loads(l) for l in open(tmp_path / "evaluator_check.items.jsonl")]
    assert len(recs) == 6 and all(r["logp"] <= 0 and r["p"] == pytest.approx(math.exp(r["logp"])) for r in recs)
    assert "canaries" in p.stdout and "reliability" in p.stdout


@pytest.mark.slow
def test_cli_bon(gsm8k_items, tmp_path):
    p = run_cli("bon", "--judge", SMOLLM2, "--samples", gsm8k_items / "math_gsm8k-test.items.jsonl",
                "--n-problems", 2, "--ns", "1,2", "--judge-max-new-tokens", 16, "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    s = json.load(open(tmp_path / "bon.json"))
    rows = {r["N"]: r for r in s["rows"]}
    assert set(rows) == {1, 2} and s["n_problems"] == 2
    assert rows[1]["knockout_calls"] == 0 and rows[1]["double_elimination_calls"] == 0
    assert rows[2]["knockout_calls"] == 2 and rows[2]["double_elimination_calls"] in (4, 5, 6)
    for r in rows.values():  # a picked answer can never beat the oracle (any sample right)
        for k in ("knockout_acc", "double_elimination_acc", "mean_sample_acc", "majority_acc"):
            assert 0.0 <= r[k] <= r["oracle_pass_at_n"] <= 1.0
    recs = [json.loads(l) for l in open(tmp_path / "bon.items.jsonl")]
    assert len(recs) == 2 * 2 * 2  # N values x methods x problems


@pytest.mark.slow
def test_cli_pairwise(tmp_path):
    files = [data_path("llmbar", "LLMBar_Natural.jsonl"), data_path("hh_rlhf_harmless_base", "test.jsonl")]
    p = run_cli("pairwise", "--model", SMOLLM2, *files, "--n", 2, "--max-new-tokens", 16, "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    s = json.load(open(tmp_path / "pairwise.json"))
    assert [r["benchmark"] for r in s["benchmarks"]] == ["LLMBar", "HH-RLHF"]
    for r in s["files"] + s["benchmarks"] + [s["overall"]]:
        for k in ("acc_ab", "acc_ba", "acc", "format_fail"):
            assert 0.0 <= r[k] <= 1.0
        assert r["acc"] <= 1.0 - r["format_fail"] + 1e-9  # format failures count as wrong
    recs = [json.loads(l) for l in open(tmp_path / "pairwise.items.jsonl")]
    assert len(recs) == 4 and all("text" in r["ab"] and "text" in r["ba"] for r in recs)
    assert "Overall (mean of 2)" in p.stdout
    assert "fails the contamination rule" in p.stderr  # LLMBar 2023-10, HH-RLHF 2022-04: asked for, so warned


@pytest.mark.slow
def test_cli_policy_sampling_paths_on_tiny_model(tiny_model_path, tmp_path):
    """bon and evaluator-check sampling their own answers (--policy) instead of reading a file."""
    gsm = data_path("gsm8k", "test.jsonl")
    p = run_cli("bon", "--policy", tiny_model_path, "--judge", tiny_model_path, "--data", gsm, "--n-problems", 2,
                "--ns", "1,2", "--max-new-tokens", 4, "--judge-max-new-tokens", 4, "--out", tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {r["N"]: r for r in json.load(open(tmp_path / "bon.json"))["rows"]}
    assert rows[2]["knockout_calls"] == 2 and rows[2]["knockout_invalid"] == 2  # random model: no valid verdict
    assert rows[2]["knockout_acc"] == rows[2]["mean_sample_acc"] == 0.0
    p = run_cli("evaluator-check", "--policy", tiny_model_path, "--evaluator", tiny_model_path, "--data", gsm,
                "--n-problems", 2, "--n-samples", 2, "--max-new-tokens", 4, "--n-canary", 1, "--out", tmp_path,
                timeout=300)
    assert p.returncode == 0, p.stderr
    s = json.load(open(tmp_path / "evaluator_check.json"))
    assert s["n_answers"] == 4 and s["n_correct"] == 0 and s["auroc"] is None  # one class: undefined


# ---- judge-check (RM-NLHF §2.3, Table 1) ------------------------------------------------------------

def test_judge_check_summary_hand_numbers():
    """Accuracy of 1[S > 0.5] against the human label per similarity, over answered rows:
    f1 (0.6, 0.5, 0.2) -> (1, 0, 0) vs labels (1, 0, 0): 3/3; recall (0.5, 0.4, 0.8) -> (0, 0, 1): 1/3;
    precision (0.75, 0.9, 0.1) -> (1, 1, 0): 2/3; the failed row is counted, not scored."""
    rows = [{"label": 1, "f1": 0.6, "recall": 0.5, "precision": 0.75},
            {"label": 0, "f1": 0.5, "recall": 0.4, "precision": 0.9},
            {"label": 1, "f1": None, "recall": None, "precision": None},
            {"label": 0, "f1": 0.2, "recall": 0.8, "precision": 0.1}]
    s = evaluate.judge_check_summary(rows, threshold=0.5)
    assert s == {"n": 4, "n_failed": 1, "acc_f1": 1.0, "acc_recall": pytest.approx(1 / 3),
                 "acc_precision": pytest.approx(2 / 3)}
    assert evaluate.judge_check_summary(rows[2:3])["acc_f1"] is None


def _judge_check_file(path, rows):
    base = {"context": "What is 2+3?", "response_a": "5", "response_b": "6",
            "human_critique": "Response B adds 2 and 3 wrongly."}
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(dict(base, **r)) + "\n")
    return str(path)


def test_judge_check_proxy_and_bad_input(tmp_path):
    """The CLI end to end with the offline proxy judge (lexical F1): a copied critique scores 1, an
    unrelated one 0; labels 1 and 0 -> accuracy 1. Bad files stop with one line naming the line."""
    data = _judge_check_file(tmp_path / "ok.jsonl", [{"critique": "Response B adds 2 and 3 wrongly.", "label": 1},
                                                     {"critique": "Both responses are polite.", "label": 0}])
    s = evaluate_main(["judge-check", "--data", data, "--backend", "proxy", "--out", str(tmp_path / "out")])
    assert s["n"] == 2 and s["n_failed"] == 0 and s["acc_f1"] == 1.0 and s["variant"] == "core"
    rows = [json.loads(ln) for ln in open(tmp_path / "out" / "judge_check.items.jsonl")]
    assert [r["f1"] for r in rows] == [1.0, 0.0] and [r["id"] for r in rows] == ["line1", "line2"]
    bad = _judge_check_file(tmp_path / "bad.jsonl", [{"critique": "c", "label": 1}, {"critique": "c", "label": 2}])
    with pytest.raises(SystemExit, match=r"bad.jsonl line 2: field 'label' must be 0 or 1, got 2"):
        evaluate_main(["judge-check", "--data", bad, "--backend", "proxy"])
    (tmp_path / "missing.jsonl").write_text(json.dumps({"critique": "c", "label": 1}) + "\n")
    with pytest.raises(SystemExit, match=r"missing.jsonl line 1: missing field 'context'"):
        evaluate_main(["judge-check", "--data", str(tmp_path / "missing.jsonl"), "--backend", "proxy"])


@pytest.mark.slow
@pytest.mark.server
def test_judge_check_against_transformers_serve(tiny_judge_server, tmp_path):
    """judge-check through a real OpenAI-compatible server (`transformers serve` of the tiny random
    model), core and meta_judge prompts: every row comes back answered or as a counted parse
    failure, never a connection error; the summary counts them."""
    data = _judge_check_file(tmp_path / "d.jsonl", [{"critique": "Response B is wrong.", "label": 1},
                                                    {"critique": "Response A is wrong.", "label": 0}])
    for variant in ("core", "meta_judge"):
        out = tmp_path / variant
        s = evaluate_main(["judge-check", "--data", data, "--base-url", tiny_judge_server["base_url"],
                           "--model", tiny_judge_server["model"], "--variant", variant, "--max-tokens", "8",
                           "--max-retries", "0", "--out", str(out)])
        rows = [json.loads(ln) for ln in open(out / "judge_check.items.jsonl")]
        assert s["n"] == 2 and s["variant"] == variant and len(rows) == 2
        assert s["n_failed"] == sum(r["f1"] is None for r in rows)
        for r in rows:
            assert r["f1"] is not None or r["why"].startswith("parse failure"), r["why"]
