"""Evaluation: graders, summaries, the in-run validation numbers (train.py: rlme_val_metrics,
val_auroc, nlhf_val_metrics, held_out_accuracy, monitor, early_stop), the Fig. 2 plot, and
`python evaluate.py SUBCOMMAND ...` (each writes <out>/<name>.json and <name>.items.jsonl):

    math             GSM8K (RLME §4.1) / MATH-500 greedy accuracy, sampled pass@1 (ours; grade); a
                     NoCheat template ({answer}) + --inject wrong = counterfactual accuracy (Fig. 7)
    qa               context-QA exact match and token F1 (RLME Tables 1-2; grade_qa)
                     (Fig. 7, Tables 1-2: per secondary notes, docs/method.md §10)
    pairwise         a GRM's accuracy per benchmark in both A/B orders, Overall = mean over
                     benchmarks (RM-NLHF §4.2, Table 2); default set: App. G.1's rule
    bon              Best-of-N judged by the GRM: knockout / double elimination (RM-NLHF §4.4)
    evaluator-check  does P(target | meta-question) (RLME Eq. 2) rank right answers above wrong
    judge-check      the critique judge against human 0/1 labels (RM-NLHF §2.3, Table 1)
    plot             learning curves from metrics.jsonl: raw, EMA 0.9, ±1 std across seeds (Fig. 2)

`bon` and `evaluator-check` read the graded samples of a `math` items file.
"""
import argparse
import collections
import json
import math
import os
import random
import statistics
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

# ---- generation and grading ----------------------------------------------------------------------

def generate_texts(model, tok, prompt_ids, n=1, temperature=0.0, max_new_tokens=256, top_p=1.0,
                   seed=0, batch_size=8, generate=rollout.generate):
    """n completions per prompt -> [per prompt: n {"completion", "truncated"}], in input order;
    prompts sorted by length, ~batch_size rows a `generate` call, call b seeded seed + b."""
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
    """math-verify equivalence (`\\frac{1}{2}` == `0.5`, `x=3` == `3`); pred None -> False."""
    from math_verify import parse, verify
    return pred is not None and bool(verify(parse(f"\\boxed{{{gold}}}"),
                                            parse(f"\\boxed{{{pred}}}")))

def numeric_correct(pred, label):
    """reward.numeric_equal, else math-verify (`x = 18`): evaluation's and val/accuracy's grade of a
    numeric label; the RLVR reward keeps its stricter rule."""
    return reward.numeric_equal(pred, label) or math_equal(pred, label)

def grade(problem, completion):
    """{"pred": last \\boxed{} content, "correct"}: numeric_correct for GSM8K, else math-verify."""
    pred = reward.extract_boxed(completion)
    ok = numeric_correct if problem["kind"] == "gsm8k" else math_equal
    return {"pred": pred, "correct": ok(pred, problem["label"])}

def wrong_answer(items, k):
    """What a NoCheat {answer} shows for item k at validation and `math --inject wrong` (RLME
    Fig. 7): a numeric label + 1, else the next item's answer_text ("none" when equal)."""
    it = items[k]
    if isinstance(it["label"], str) and reward.to_number(it["label"]) is not None:
        return str(reward.to_number(it["label"]) + 1)
    other = items[(k + 1) % len(items)]["answer_text"]
    return other if other != it["answer_text"] else "none"

def answer_summary(items, fields={"correct": ("acc", "pass1")}):
    """greedy_<name>, greedy_no_box, greedy_truncated; per sample index j the mean over problems,
    then mean ± population std over j (sampled_<name>_mean/_std), sampled_pass_at_n. fields:
    {answer field: (greedy name, sampled name)}."""
    s, m = {"n_problems": len(items)}, len(items)
    for f, (name, _) in fields.items():
        s[f"greedy_{name}"] = sum(it["greedy"][f] for it in items) / m
    s["greedy_truncated"] = sum(it["greedy"]["truncated"] for it in items) / m
    s["greedy_no_box"] = sum(not it["greedy"]["pred"] for it in items) / m
    n = len(items[0]["samples"])
    if n:
        s["n_samples"] = n
        for f, (_, name) in fields.items():
            per_j = [sum(it["samples"][j][f] for it in items) / m for j in range(n)]
            s[f"sampled_{name}_mean"] = statistics.mean(per_j)
            s[f"sampled_{name}_std"] = statistics.pstdev(per_j)  # population std
            s[f"sampled_{name}_per_sample"] = per_j
        s["sampled_pass_at_n"] = sum(any(x["correct"] for x in it["samples"]) for it in items) / m
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

# ---- pairwise GRM accuracy (RM-NLHF §4.2, Table 2) ----------------------------------------------

def make_grm_judge(model, tok, max_new_tokens=256, batch_size=8, chat=False, max_prompt_tokens=None,
                   style="ours", generate=rollout.generate, *, temperature=0.0, top_p=1.0, seed=0,
                   max_lines=4, max_chars=1500):
    """judge(queries [(context, a, b, turns)]) -> [reward.parse_grm_output(...) + {"text"}]. A
    prompt over max_prompt_tokens (default context - max_new_tokens) is a format failure ("prompt
    too long"): the denominator never shrinks. Call c seeds seed + 1_000_003 c (fresh rounds)."""
    limit = max_prompt_tokens or model.config.max_position_embeddings - max_new_tokens
    calls = [0]

    def judge(queries):
        ids = [rollout.build_prompt_ids(tok, reward.build_grm_prompt(
            c, x, y, max_lines, style=style, turns=t), chat) for c, x, y, t in queries]
        ok = [i for i, x in enumerate(ids) if len(x) <= limit]
        outs = generate_texts(model, tok, [ids[i] for i in ok], 1, temperature, max_new_tokens,
                              top_p, seed + 1_000_003 * calls[0], batch_size, generate)
        calls[0] += 1
        out = [{"critique": None, "choice": None, "valid": False, "why": "prompt too long",
                "text": ""} for _ in queries]
        for i, (t,) in zip(ok, outs):
            out[i] = {**reward.parse_grm_output(t["completion"], max_lines, max_chars, style=style),
                      "text": t["completion"]}
        return out
    return judge

def pairwise_accuracy(items, judge):
    """Accuracy in both orders, "ab" as loaded then "ba" swapped, in one judge call; a format
    failure counts as wrong. Returns (summary {"n", "acc_ab", "acc_ba", "acc", "format_fail" (of
    2n), "both_right", "pick_a" (of valid: 0.5 = no position bias)}, records)."""
    ab = [(it["context"], it["response_a"], it["response_b"], (it.get("meta") or {}).get("turns"))
          for it in items]
    res = judge(ab + [(c, y, x, t) for c, x, y, t in ab])
    n, records = len(items), []
    for k, it in enumerate(items):
        right = {"ab": it["winner"], "ba": {"A": "B", "B": "A"}[it["winner"]]}
        records.append({"id": it.get("id", k), "source": it.get("source"),
                        "meta": it.get("meta", {}), "winner": it["winner"],
                        **{o: {**r, "right": bool(r.get("valid") and r.get("choice") == right[o])}
                           for o, r in (("ab", res[k]), ("ba", res[n + k]))}})
    r_ab, r_ba = sum(r["ab"]["right"] for r in records), sum(r["ba"]["right"] for r in records)
    valid = [r for r in res if r.get("valid")]
    summary = {"n": n, "acc_ab": r_ab / n, "acc_ba": r_ba / n, "acc": (r_ab + r_ba) / (2 * n),
               "format_fail": (2 * n - len(valid)) / (2 * n),
               "both_right": sum(r["ab"]["right"] and r["ba"]["right"] for r in records) / n,
               "pick_a": sum(r["choice"] == "A" for r in valid) / len(valid) if valid else None}
    return summary, records

def score_unit(items, judge):
    """pairwise_accuracy of one file. Grouped items: RewardBench 2's best-of-4 (a row, meta
    "group": 1 chosen vs 3 rejected, is right in an order only if all its pairs are; accuracy =
    the mean over subsets), per-pair numbers kept as n_pairs, pair_acc. -> (summary, records)."""
    summary, records = pairwise_accuracy(items, judge)
    if not all("group" in r["meta"] for r in records):
        return summary, records
    groups, per = {}, {}
    for r in records:
        g = groups.setdefault(r["meta"]["group"], {"subset": r["meta"].get("subset"),
                                                   "ab": True, "ba": True})
        g["ab"], g["ba"] = g["ab"] and r["ab"]["right"], g["ba"] and r["ba"]["right"]
    for g in groups.values():
        per.setdefault(g["subset"], []).append(g)
    for name, gs in per.items():
        ab, ba = sum(g["ab"] for g in gs) / len(gs), sum(g["ba"] for g in gs) / len(gs)
        per[name] = {"n": len(gs), "acc_ab": ab, "acc_ba": ba, "acc": (ab + ba) / 2}
    ab, ba = (sum(x[k] for x in per.values()) / len(per) for k in ("acc_ab", "acc_ba"))
    return {"n": len(groups), "acc_ab": ab, "acc_ba": ba, "acc": (ab + ba) / 2, "subsets": per,
            "n_pairs": summary["n"], "pair_acc": summary["acc"],
            "format_fail": summary["format_fail"], "pick_a": summary["pick_a"]}, records

def aggregate_pairwise(rows):
    """Per benchmark its files weighted by items; Overall = the unweighted mean over benchmarks
    (RM-NLHF Table 2's Overall column). Returns {"benchmarks": [...], "overall": {...}}."""
    keys, benches = ["acc_ab", "acc_ba", "acc", "format_fail"], []
    for name in dict.fromkeys(r["benchmark"] for r in rows):
        members = [r for r in rows if r["benchmark"] == name]
        n = sum(r["n"] for r in members)
        benches.append({"benchmark": name, "n": n,
                        **{k: sum(r[k] * r["n"] for r in members) / n for k in keys}})
    return {"benchmarks": benches, "overall": {
        "n": sum(b["n"] for b in benches), "n_benchmarks": len(benches),
        **{k: sum(b[k] for b in benches) / len(benches) for k in keys}}}

# ---- Best-of-N tournaments (RM-NLHF §4.4) -------------------------------------------------------
# compare(pairs) -> winners: a round in one judge call. Knockout: b = (next power of two) - N byes
# for players 0..b-1, later rounds pair neighbours: N - 1 matches. Double elimination: the losers
# of that knockout (one round at a time) drop to the losers' bracket (LB), an LB round pairs first
# vs last (the first waits when odd); if the LB champion wins the final, a reset: 2N-2 or 2N-1.

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
    """One of item's first n samples by a GRM-judged tournament: each match in a random order (rng:
    position bias), an invalid judgement to the first-listed. Returns {"pick", "correct", "calls",
    "invalid", "matches"}."""
    answers, invalid = [s["completion"] for s in item["samples"][:n]], [0]

    def compare(pairs):
        shown = [(j, i) if rng.random() < 0.5 else (i, j) for i, j in pairs]
        res = judge([(item["question"], answers[x], answers[y], None) for x, y in shown])
        winners = []
        for (i, _), (x, y), r in zip(pairs, shown, res):
            ok = bool(r.get("valid") and r.get("choice") in ("A", "B"))
            invalid[0] += not ok
            winners.append((x if r["choice"] == "A" else y) if ok else i)
        return winners
    pick, matches = (knockout if method == "knockout" else double_elimination)(n, compare)
    return {"pick": pick, "correct": bool(item["samples"][pick]["correct"]),
            "calls": len(matches), "invalid": invalid[0], "matches": matches}

# ---- statistics ----------------------------------------------------------------------------------

def ema(values, alpha=0.9):
    """Bias-corrected EMA (RLME §4.1's 0.9): m_t = alpha m_{t-1} + (1 - alpha) v_t, m_0 = 0,
    e_t = m_t / (1 - alpha^t) (Adam's debiasing: the first point weighs as any other)."""
    out, m = [], 0.0
    for t, v in enumerate(values, start=1):
        m = alpha * m + (1 - alpha) * v
        out.append(m / (1 - alpha ** t))
    return out

def auroc(scores, labels):
    """P(a random positive scores above a random negative), ties 1/2 (Mann-Whitney U over all
    positive-negative pairs). labels: bools (True = correct). None when a class is empty."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))

def within_problem_auroc(scores, labels, groups):
    """(mean over problems with both classes of the AUROC among that problem's answers, count).
    Pooled AUROC also rewards rating easy problems higher; GRPO compares answers to one prompt."""
    by = {}
    for s, y, g in zip(scores, labels, groups):
        by.setdefault(g, []).append((s, y))
    vals = [a for a in (auroc(*zip(*v)) for v in by.values()) if a is not None]
    return (sum(vals) / len(vals) if vals else None), len(vals)

def judge_check_summary(rows, threshold=0.5):
    """RM-NLHF Table 1: per similarity (f1, recall, precision) the accuracy of 1[S > threshold]
    (Eq. 4's strict rule) vs the human label over answered rows; failed rows (f1 None) counted."""
    ok = [r for r in rows if r["f1"] is not None]
    out = {"n": len(rows), "n_failed": len(rows) - len(ok)}
    for m in ("f1", "recall", "precision"):
        out[f"acc_{m}"] = (sum((r[m] > threshold) == bool(r["label"]) for r in ok) / len(ok)
                           if ok else None)
    return out

# ---- in-run validation (docs/method.md §4.6: held-out accuracy, early stop against hacking) -----
# train.py generates and scores; these turn the numbers into val/* metrics (the same on every
# rank: all_sum(x) sums a number across ranks).

def _mean_known(rew, all_sum):
    """The mean of a reward-step dict's known (unmasked) rewards over all ranks."""
    known = len(rew["reward"]) if rew["valid"] is None else int(rew["valid"].sum())
    return all_sum(float(rew["reward"].nansum())) / max(1, all_sum(known))

def rlme_val_metrics(rew, completions, canaries, *, numeric, injected, all_sum=lambda x: x):
    """val/accuracy (greedy answers graded as `math`; counterfactual when val/injected: NoCheat
    showed wrong_answer), val/reward_mean (over known rewards), val/boxed_frac, val/chars_mean (a
    reward can rise through format), val/canary/NAME. rew, canaries[NAME]: reward-step dicts
    {"records": [{"extracted", "label", "correct"}], "reward": [N] NaN = masked, "valid"}."""
    recs = rew["records"]
    n = all_sum(len(recs))
    correct = [numeric_correct(r["extracted"], r["label"]) if numeric and r["label"] is not None
               else bool(r["correct"]) for r in recs]
    out = {"val/n": n, "val/injected": injected, "val/accuracy": all_sum(sum(correct)) / n,
           "val/reward_mean": _mean_known(rew, all_sum),
           "val/boxed_frac": all_sum(sum(bool(r["extracted"]) for r in recs)) / n,
           "val/chars_mean": all_sum(sum(len(c) for c in completions)) / n}
    return {**out, **{f"val/canary/{k}": _mean_known(c, all_sum) for k, c in canaries.items()}}

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
    """Metric `key` of one setting's runs (metrics.jsonl) on the steps all share, each run's EMA
    averaged. Returns {"x", "raw", "ema", "std" (sample std of the EMAs; None for one run),
    "runs"}. SystemExit: a run without the metric."""
    runs = []
    for p in paths:
        rows = data.load_rows(p)
        pts = [(r.get("step", i), float(r[key])) for i, r in enumerate(rows)
               if type(r.get(key)) in (int, float) and math.isfinite(r[key])]
        if not pts:
            raise SystemExit(f"{p}: no numeric values for metric {key!r}")
        xs, ys = zip(*pts)
        runs.append((dict(pts), dict(zip(xs, ema(ys, alpha)))))
    common = sorted(set.intersection(*(set(raw) for raw, _ in runs)))
    if not common:
        raise SystemExit(f"runs {paths} share no steps with metric {key!r}")
    n, emas = len(runs), [[e[x] for _, e in runs] for x in common]
    return {"x": common, "raw": [sum(raw[x] for raw, _ in runs) / n for x in common],
            "ema": [sum(v) / n for v in emas],
            "std": [statistics.stdev(v) for v in emas] if n > 1 else None, "runs": n}

def plot_curves(curves, keys, path, alpha=0.9, min_span=0.1):
    """A PNG at `path`, one panel per key: raw values faint, the ±1 std band, the EMA (gids
    <label>/raw|band|ema). curves: {label: {key: curve(...)}}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for n, (label, c) in enumerate((lb, cs[k]) for lb, cs in curves.items()):
            ax.plot(c["x"], c["raw"], color=f"C{n}", alpha=0.35, linewidth=0.8, gid=f"{label}/raw")
            if c["std"]:
                ax.fill_between(c["x"], [m - s for m, s in zip(c["ema"], c["std"])],
                                [m + s for m, s in zip(c["ema"], c["std"])], color=f"C{n}",
                                alpha=0.2, linewidth=0, gid=f"{label}/band")
            ax.plot(c["x"], c["ema"], color=f"C{n}", linewidth=1.8, gid=f"{label}/ema",
                    label=f"{label} (n={c['runs']})")
        lo, hi = ax.get_ylim()  # at least min_span tall: autoscale turns drift into 'learning'
        pad = max(0.0, min_span - (hi - lo)) / 2
        ax.set(title=f"{k}: EMA {alpha}, ±1 std", xlabel="step", ylim=(lo - pad, hi + pad))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

# ---- the command line: python evaluate.py SUBCOMMAND ... ---------------------------------------

def report(out_dir, name, summary, items, rows, cols, title):
    """Write <out_dir>/<name>.json (summary) and <name>.items.jsonl (items, one a line), print
    `title` and the `cols` of each of `rows` (floats to 3 decimals). Returns summary."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if items is not None:
        with open(os.path.join(out_dir, f"{name}.items.jsonl"), "w") as f:
            f.writelines(json.dumps(it) + "\n" for it in items)
    print(title)
    for r in rows:
        print("  ".join(f"{c}={r[c]:.3f}" if isinstance(r.get(c), float) else f"{c}={r.get(c)}"
                        for c in cols))
    return summary

def prompt_template(a, default, allowed):
    """(template, inject): --prompt-template, else --config's data.prompt_template (a run's own),
    else `default`; a NoCheat {answer} (RLME Fig. 7) needs --inject reference|wrong. SystemExit
    (one line): a placeholder missing or one it cannot fill, a wrong --inject."""
    template, inject = a.prompt_template, getattr(a, "inject", None)
    if template is None and a.config:
        import yaml
        with open(a.config) as f:
            template = ((yaml.safe_load(f) or {}).get("data") or {}).get("prompt_template")
    template = template or default
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:  # an unmatched brace
        raise SystemExit(f"the prompt template is not a format string: {e}") from None
    if set(allowed) - {"answer"} - fields or fields - set(allowed):
        raise SystemExit(f"the prompt template has placeholders {sorted(fields)}; {a.cmd} needs "
                         f"{sorted(set(allowed) - {'answer'})} and can fill {sorted(allowed)}")
    if "answer" in fields and inject not in ("reference", "wrong"):
        raise SystemExit(f"--inject{' ' + inject if inject else ''}: the prompt template shows "
                         f"{{answer}} (NoCheat); choose --inject wrong or reference")
    if "answer" not in fields and inject not in (None, "none"):
        raise SystemExit(f"--inject {inject}: the prompt template has no {{answer}} to fill")
    return template, inject or "none"

def generation_model(a, path):
    """(model, tokenizer, chat, generate): rollout.load_model in --dtype, the chat template by
    --chat-template and --system-prompt (rollout.use_chat_template), rollout.generate."""
    model, tok = rollout.load_model(path, a.dtype)
    setting = {"auto": "auto", "true": True, "false": False}[a.chat_template]
    return model, tok, rollout.use_chat_template(tok, setting, path, a.system_prompt,
                                                 key=None), rollout.generate

def grm_judge(a, path):
    """(judge, decoding) of `pairwise` / `bon`. Default decoding: the RM-NLHF release's
    validation (T 0.6, 8192 tokens: an R1-based GRM reasons at length)."""
    dec = {"temperature": a.temperature, "max_new_tokens": a.max_new_tokens, "seed": a.seed}
    model, tok, chat, generate = generation_model(a, path)
    return make_grm_judge(model, tok, a.max_new_tokens, a.batch_size, chat, None, a.grm_prompt,
                          generate, temperature=a.temperature, seed=a.seed), dec

# the qa flags over --preset's (its hub "config" is the preset's: --config is a run's config.yaml)
QA_FIELDS = ("split", "question_field", "context_field", "answer_field", "choices_field")

def cmd_answers(a):
    """`math` and `qa`: the greedy and --n-samples sampled answers per problem on the training
    prompt (rollout.policy_prompt_ids), graded by grade / grade_qa, summarised."""
    qa, n = a.cmd == "qa", a.n_problems or None
    template, inject = prompt_template(a, *((QA_PROMPT_TEMPLATE, ("context", "question")) if qa
                                            else (PROMPT_TEMPLATE, ("question", "answer"))))
    preset = data.QA_PRESETS[a.preset] if qa and a.preset else {}
    st = {k: v for k, v in preset.items() if k != "data"}
    st.update({k: getattr(a, k) for k in QA_FIELDS if getattr(a, k, None) is not None})
    source = a.data or preset.get("data")
    if not source:
        raise SystemExit(f"qa: give --data FILE_OR_HUB_ID or --preset {'|'.join(data.QA_PRESETS)}")
    problems = (data.load_qa_items(source, n, context_max_chars=a.context_max_chars, **st) if qa
                else data.load_math_problems(source, n, **st))
    shown = {"none": [None] * len(problems), "reference": [p["answer_text"] for p in problems],
             "wrong": [wrong_answer(problems, k) for k in range(len(problems))]}[inject]
    model, tok, chat, generate = generation_model(a, a.model)
    ids = [rollout.policy_prompt_ids(tok, p, chat, template, answer=x)
           for p, x in zip(problems, shown)]
    kw = dict(max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size,
              generate=generate)
    greedy = generate_texts(model, tok, ids, 1, 0.0, **kw)
    sampled = (generate_texts(model, tok, ids, a.n_samples, a.temperature, **kw) if a.n_samples
               else [[] for _ in ids])
    items = []
    for p, g, samples, x in zip(problems, greedy, sampled, shown):
        for ans in g + samples:
            ans.update((grade_qa if qa else grade)(p, ans["completion"]))
        items.append({**p, **({"shown_answer": x} if inject != "none" else {}), "greedy": g[0],
                      "samples": samples})
    stem = os.path.splitext(os.path.basename(source))[0]  # 'gsm8k/test.jsonl' -> gsm8k-test
    name = (f"{os.path.basename(os.path.dirname(os.path.abspath(source)))}-{stem}"
            if os.path.isfile(source) else source.rstrip("/").split("/")[-1])
    name += "" if inject == "none" else f"_inject-{inject}"
    summary = {"model": a.model, "data": source, **st, "seed": a.seed, "temperature": a.temperature,
               "max_new_tokens": a.max_new_tokens, "prompt_template": template}
    if qa:
        summary.update(preset=a.preset, multiple_choice=st.get("choices_field") is not None,
                       context_max_chars=a.context_max_chars,
                       **answer_summary(items, {"em": ("em", "em"), "f1": ("f1", "f1")}))
        cols = ["greedy_em", "greedy_f1", "sampled_em_mean", "sampled_f1_mean"]
    else:  # --inject wrong: every prompt showed a wrong answer, graded against the truth
        summary.update(kind=problems[0]["kind"], inject=inject, **answer_summary(items))
        acc = "counterfactual_acc" if inject == "wrong" else "greedy_acc"
        summary[acc] = summary["greedy_acc"]
        cols = [acc, "sampled_pass1_mean", "sampled_pass1_std", "sampled_pass_at_n"]
    return report(a.out, f"{a.cmd}_{name}", summary, items, [{**summary, "data": name}],
                  ["data", "n_problems", *cols, "greedy_no_box"], ("COUNTERFACTUAL accuracy "
                  "(RLME Fig. 7)" if inject == "wrong" else a.cmd) + f": {a.model}")

def cmd_pairwise(a):
    # default: the Table 2 benchmarks readable here (RM-NLHF App. G.1's contamination rule)
    names = a.benchmarks.split(",") if a.benchmarks else [] if a.files else data.PAPER_BENCHMARKS
    units = [u for name in names for u in data.benchmark_units(name, data.SHARED_DATA)]
    for f in a.files:  # an explicit file: its folder names the benchmark
        units.append({"benchmark": os.path.basename(os.path.dirname(os.path.abspath(f))),
                      "path": f, "file": os.path.splitext(os.path.basename(f))[0]})
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
    table = groups["benchmarks"] + [{**groups["overall"], "benchmark": "Overall (mean)"}]
    return report(a.out, "pairwise", result, records, table, ["benchmark", "n", "acc_ab",
                  "acc_ba", "acc", "format_fail"], f"pairwise accuracy (Table 2): {a.model}")

def load_samples(a, need):
    """The graded answers of a `math` items file; SystemExit: not one, or under `need` samples."""
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
    if set(methods) - {"knockout", "double_elimination"}:
        raise SystemExit(f"--methods {a.methods}: choose from knockout, double_elimination")
    items = load_samples(a, ns[-1])
    judge, dec = grm_judge(a, a.judge)
    rng, rows, records, m = random.Random(a.seed), [], [], len(items)
    for n in ns:
        firsts = [it["samples"][:n] for it in items]
        row = {"N": n, "mean_sample_acc": sum(sum(s["correct"] for s in f) / n for f in firsts) / m,
               "oracle_pass_at_n": sum(any(s["correct"] for s in f) for f in firsts) / m}
        for method in methods:
            res = [best_of_n(it, n, judge, method, rng) for it in items]
            row[f"{method}_acc"] = sum(r["correct"] for r in res) / m
            row[f"{method}_calls"] = sum(r["calls"] for r in res)
            row[f"{method}_invalid"] = sum(r["invalid"] for r in res)
            records += [{"id": it["id"], "N": n, "method": method, **r}
                        for it, r in zip(items, res)]
        rows.append(row)
    result = {"judge": a.judge, "grm_prompt": a.grm_prompt, "judge_decoding": dec, "rows": rows,
              "samples": a.samples, "n_problems": m, "seed": a.seed, "methods": methods}
    return report(a.out, "bon", result, records, rows, list(rows[0]),
                  f"Best-of-N on {m} problems, judge {a.judge}")

def cmd_evaluator_check(a):
    """Every graded answer of a `math` items file (the greedy one and the samples) scored by the
    training reward: log p(target | meta-question), one evaluator, weights 1 (RLME Eq. 2-3)."""
    items = load_samples(a, 0)
    answers = [(k, it, s) for k, it in enumerate(items) for s in [it["greedy"], *it["samples"]]]
    model, tok, chat, _ = generation_model(a, a.evaluator)
    ev = reward.local_evaluator(model, tok, chat=chat, name="evaluator",
                                micro_batch_size=a.batch_size)
    lps = reward.rlme_reward([ev], [{"question": a.question, "target": a.target, "weight": 1.0}],
                             [it["question"] for _, it, _ in answers],
                             [s["completion"] for _, _, s in answers])["logp"][:, 0, 0].tolist()
    labels = [bool(s["correct"]) for _, _, s in answers]
    within, n_within = within_problem_auroc(lps, labels, [k for k, _, _ in answers])
    summary = {"evaluator": a.evaluator, "question": a.question, "target": a.target,
               "samples": a.samples, "n_problems": len(items), "n_answers": len(answers),
               "n_correct": sum(labels), "auroc": auroc(lps, labels),
               "auroc_within_problem": within, "n_problems_within": n_within,
               # the control: the same scores against shuffled labels separate nothing (~0.5)
               "auroc_shuffled": auroc(lps, random.Random(a.seed).sample(labels, len(labels)))}
    scored = [{"id": it["id"], "correct": y, "logp": x, "p": math.exp(x), "pred": s.get("pred")}
              for (_, it, s), x, y in zip(answers, lps, labels)]
    return report(a.out, "evaluator_check", summary, scored, [summary], ["n_answers", "n_correct",
                  "auroc", "auroc_within_problem", "auroc_shuffled"],
                  f"evaluator check: {a.evaluator}, {a.question!r} -> {a.target!r}")

JUDGE_FLAGS = ("backend", "variant", "base_url", "model", "api_key_env")

def cmd_judge_check(a):
    """The critique judge (--config's judge: section, the flags over it) vs human labels."""
    import yaml
    items = data.load_judge_check_items(a.data)
    with open(a.config) as f:
        settings = (yaml.safe_load(f) or {}).get("judge") or {}
    settings.update({k: getattr(a, k) for k in JUDGE_FLAGS if getattr(a, k) is not None})
    settings.pop("on_failure", None)  # training's rule for a failed call
    results = reward.make_judge(**settings)([(it["human_critique"], it["critique"], it)
                                             for it in items])
    rows = [dict(id=it["id"], label=it["label"], **res) for it, res in zip(items, results)]
    failures = dict(collections.Counter(r.get("why") for r in rows if r["f1"] is None))
    summary = dict(judge_check_summary(rows, a.threshold), data=a.data, threshold=a.threshold,
                   backend=settings.get("backend"), variant=settings.get("variant"),
                   model=settings.get("model"), failures=failures)
    return report(a.out, "judge_check", summary, rows, [summary], ["n", "n_failed", "acc_f1",
                  "acc_recall", "acc_precision"], f"judge check on {a.data}; failed: {failures}")

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
             "last_std": c["std"][-1] if c["std"] else None}
            for label, cs in curves.items() for k, c in cs.items()]
    report(a.out, "plot", {"ema": a.ema, "files": [png], "table": rows, "curves": curves}, None,
           rows, list(rows[0]), f"EMA {a.ema} (bias-corrected), ±1 std across runs: {png}")
    return rows

def main(argv=None):
    """python evaluate.py SUBCOMMAND ... (--help on each): returns the subcommand's summary."""
    ap = argparse.ArgumentParser(prog="python evaluate.py", description="RLME / RM-NLHF evaluation")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def command(name, fn, what, *flags, models=True):
        """flags: (name, default, help); a type = None of it; ... = required; a tuple = choices."""
        p = sub.add_parser(name, help=what, description=what)
        p.set_defaults(fn=fn)
        common = [("--out", os.path.join("runs", "eval"), "results folder")]
        if models:
            common += [("--dtype", tuple(rollout.DTYPES), "compute dtype"), ("--seed", 0, ""),
                       ("--batch-size", 8, "rows per generate call"),
                       ("--chat-template", ("auto", "true", "false"), "auto: when it has one"),
                       ("--system-prompt", str, "system message (chat template)")]
        for flag, default, text in common + list(flags):
            if flag[0] != "-":  # a positional: default = nargs
                p.add_argument(flag, nargs=default, help=text)
            elif isinstance(default, tuple):
                p.add_argument(flag, default=default[0], choices=[c for c in default if c],
                               help=text)
            elif default is ... or isinstance(default, type):  # required / a type, default None
                p.add_argument(flag, required=default is ..., help=text,
                               type=str if default is ... else default)
            else:
                p.add_argument(flag, default=default, type=type(default), help=text)

    def answers(n_problems, n_samples):
        return [("--model", ..., "HF folder, hub id or gguf:<pkg>/<file>"),
                ("--split", str, "split of a hub id"), ("--prompt-template", str, ""),
                ("--config", str, "a run's config: its data.prompt_template"),
                ("--n-problems", n_problems, "the first N (0 = all)"), ("--n-samples", n_samples,
                 "per problem"), ("--temperature", 1.0, "sampling"), ("--max-new-tokens", 512, "")]
    grm = [("--temperature", 0.6, "the RM-NLHF release's"), ("--max-new-tokens", 8192, ""),
           ("--grm-prompt", ("ours", "authors"), "authors: the RM-NLHF release's")]
    samples = [("--samples", ..., "an items JSONL of `math`"), ("--n-problems", 0, "first N")]
    command("math", cmd_answers, "GSM8K / MATH-500 accuracy: greedy and sampled pass@1",
            *answers(100, 4),
            ("--data", os.path.join(data.SHARED_DATA, "gsm8k", "test.jsonl"), "JSONL or hub id"),
            ("--inject", (None, "none", "reference", "wrong"), "NoCheat's {answer} (Fig. 7)"))
    command("qa", cmd_answers, "context QA: exact match and token F1 of the boxed answer",
            *answers(0, 0), ("--data", str, "JSONL or hub id"),
            ("--preset", (None, *data.QA_PRESETS), "a known set's source and fields"),
            *[(f"--{f.replace('_', '-')}", str, "") for f in QA_FIELDS[1:]],
            ("--context-max-chars", 4000, "0 = no cut"))
    command("pairwise", cmd_pairwise, "a GRM's pairwise accuracy per benchmark, both orders",
            ("files", "*", "pairwise JSONL files (default: App. G.1's set)"),
            ("--model", ..., "the GRM"), ("--n", 0, "a seeded subset of N items per file"),
            ("--benchmarks", str, "comma-separated: " + ", ".join(data.BENCHMARKS)), *grm)
    command("bon", cmd_bon, "Best-of-N: knockout / double elimination judged by a GRM",
            *samples, ("--judge", ..., "the GRM"), ("--ns", "1,2,4,8", ""),
            ("--methods", "knockout,double_elimination", ""), *grm)
    command("evaluator-check", cmd_evaluator_check, "AUROC of P(target) vs correctness", *samples,
            ("--evaluator", ..., ""), ("--question", "Is the answer correct?", "meta-question"),
            ("--target", "Yes", "its target answer"))
    command("judge-check", cmd_judge_check, "the critique judge vs human labels (Table 1)",
            ("--data", ..., "JSONL: context, response_a/_b, human_critique, critique, label"),
            ("--config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml"),
             "a config whose judge: section to use"),
            *[(f"--{f.replace('_', '-')}", str, f"judge.{f}") for f in JUDGE_FLAGS],
            ("--threshold", 0.5, "S > threshold = correct (Eq. 4)"), models=False)
    command("plot", cmd_plot, "learning curves: raw, EMA, ±1 std across runs (RLME Fig. 2)",
            ("runs", "+", "[LABEL=]metrics.jsonl[,metrics.jsonl...]"),
            ("--keys", "reward/mean,val/accuracy", ""), ("--ema", 0.9, "RLME's 0.9"), models=False)
    a = ap.parse_args(argv)
    return a.fn(a)

if __name__ == "__main__":
    main()
