"""Evaluation: math and context-QA accuracy, pairwise GRM accuracy, Best-of-N tournaments,
evaluator check, plots.

What each subcommand measures (docs/method.md §6 says the same in prose):

* math: GSM8K / MATH-500 accuracy of a checkpoint, greedy and sampled pass@1 (the RLME paper's
  accuracy, RLME §4.1; the last \\boxed{} as in RLVR, docs/method.md §4.3, graded by numbers and
  then math-verify: numeric_correct, more lenient than the RLVR reward). With a
  NoCheat template ({answer}), --inject wrong gives the counterfactual accuracy (RLME Fig. 7, per
  secondary notes on its experiments after §4.1, not in our text).
* qa: context-QA exact match and token F1 of the boxed answer (RLME Tables 1-2, per secondary
  notes), on a JSONL file or hub id with configurable fields, or --preset faitheval
  (FaithEval-Counterfactual).
* pairwise: a generative reward model's accuracy on pairwise benchmarks, both A/B orders
  (RM-NLHF §4.2, Table 2; benchmarks and their contamination rule App. G.1, Table 7; RewardBench 2
  scored best-of-4; Overall = unweighted mean over benchmarks). The GRM decodes as the RM-NLHF
  authors' release validates (GRM_PROTOCOLS: sampling at T 0.6, up to 8,192 new tokens, which an
  R1-based GRM needs to reach its critique and choice); --protocol greedy256 = greedy, 256 tokens.
* bon: Best-of-N with the GRM as judge (--grm-prompt and --protocol as pairwise) in a knockout or
  double-elimination tournament (RM-NLHF §4.4).
* evaluator-check: how well an evaluator's P(target | meta-question), RLME Eq. 2, separates right
  from wrong answers (AUROC, calibration) before a run spends compute on it.
* judge-check: the critique judge's agreement with human 0/1 labels of GRM critiques (RM-NLHF
  §2.3, Table 1: accuracy of S > 0.5 for F1, recall and precision), through a real server.
* plot: learning curves: the raw per-step values, a bias-corrected exponential moving average
  (0.9, as RLME §4.1's figures; ema) over them and, for several runs, a ±1 standard-error band.

Every subcommand writes its results as JSON (summary) and JSONL (one record per item)
under --out (default runs/eval, git-ignored) and prints a readable table. The command line is
plumbing/cli.py's, run from the repository root:

    python -m plumbing.cli evaluate math --model PATH --data ../shared/data/gsm8k/test.jsonl
        --n-problems 50
    python -m plumbing.cli evaluate math --model PATH --config configs/paper/rlme/nocheat.yaml
        --inject wrong
    python -m plumbing.cli evaluate qa --model PATH --preset faitheval [--data LOCAL_COPY.jsonl]
    python -m plumbing.cli evaluate pairwise --model GRM [--benchmarks NAME,...]
        [BENCHMARK.jsonl ...]
        (default: BENCHMARK_REGISTRY's, App. G.1 rule)
    python -m plumbing.cli evaluate bon --judge GRM --samples OUT/math_gsm8k-test.items.jsonl
        --ns 1,2,4,8
    python -m plumbing.cli evaluate evaluator-check --evaluator PATH
        --samples OUT/math_gsm8k-test.items.jsonl
    python -m plumbing.cli evaluate judge-check --data ANNOTATED.jsonl
        --base-url http://127.0.0.1:8000/v1 --model M
    python -m plumbing.cli evaluate plot rlme=run1/metrics.jsonl,run2/metrics.jsonl
        rlvr=run3/metrics.jsonl

The `math` items file is the interchange format: `bon` and `evaluator-check` read its sampled,
graded answers (or sample their own with --policy), so one sampling pass serves all three.
Bad input (not a model, unknown benchmark schema or field, empty file, unreachable hub id,
N > samples) ends with one line, before a model loads where the data is at fault.
Sections follow the subcommands; file reading, tables and the command line are plumbing at the end.
"""
import math
import re


import reward
import rollout


# The generator prompt (docs/method.md §4.1): the problem, then the request to reason and box the
# answer. It must be the one the model was trained with (config.yaml data.prompt_template, the
# default below is a copy of it; `math --config run/config.yaml` reads a run's own), or accuracy
# measures a different task.
PROMPT_TEMPLATE = "{question}\nReason step by step, and put your final answer within \\boxed{{}}."

# Answers that fool weak judges (they contain no solution at all), shown next to a known-wrong one.
CANARIES = {"colon": ":", "step_by_step": "Let's solve this step by step.",
            "claims_correct": "The answer is correct."}


# ----------------------------------------------------------------------------------------------
# Math accuracy (RLME §4.1; docs/method.md §4.3, §6)


def math_equal(pred, gold):
    """MATH answer equivalence with math-verify: `\\frac{1}{2}` == `0.5`, `x=3` == `3`.

    Both sides are wrapped in \\boxed{} so that math-verify parses the whole string as one answer
    (it otherwise looks for a LaTeX environment and finds nothing in plain `(3, \\pi/2)`).
    Args: pred, gold: str (pred None = no box = wrong). Returns: bool.
    """
    from math_verify import parse, verify
    if pred is None:
        return False
    return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")))


def numeric_correct(pred, label):
    """Evaluation's grade of an answer to a numeric label (GSM8K; data.label_format gsm8k / plain,
    so in-run validation's val/accuracy too): the RLVR rule reward.numeric_equal, and where it
    fails, math-verify (math_equal), which reads what a right solution may box around the number:
    `18 \\text{ apples}`, `x = 18`, `−18` (Unicode minus), `\\frac12`, `18 \\mbox{ cm}`. Accuracy
    should count every right answer; the RLVR reward keeps its stricter rule (docs/method.md §4.3).
    Args: pred: str | None (None = no box = wrong); label: str, a number. Returns: bool."""
    return reward.numeric_equal(pred, label) or math_equal(pred, label)


def grade(problem, completion):
    """(extracted answer, correct) of one completion: last \\boxed{} (docs/method.md §4.3), then
    numeric_correct for GSM8K and math-verify for MATH. No box -> (None, False)."""
    pred = reward.extract_boxed(completion)
    if problem["kind"] == "gsm8k":
        return pred, numeric_correct(pred, problem["label"])
    return pred, math_equal(pred, problem["label"])


def generate_texts(model, tok, prompt_ids, n=1, temperature=0.0, max_new_tokens=256, top_p=1.0,
                   seed=0, batch_size=8, desc="generate", *, progress=None,
                   generate=rollout.generate):
    """n completions per prompt, in batches of about `batch_size` rows.

    Prompts are sorted by length before batching (left padding to the longest prompt wastes
    compute otherwise) and results put back in input order. Each batch samples with seed+batch.
    Args:
        prompt_ids: list[list[int]]; temperature 0 = greedy.
        desc: label of the progress bar.
        generate: rollout.generate, or its fast twin fast.generate (what the command line uses).
        progress: a tqdm bar to advance by n answers per prompt as each batch finishes (the
            caller's bar over several calls; its label becomes `desc`); None = a bar of its own,
            shown when there are two batches or more.
    Returns:
        list (one per prompt) of list (n) of {"completion": str, "truncated": bool}.
    """
    from tqdm import tqdm
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    per_call = max(1, batch_size // n)
    out = [None] * len(prompt_ids)
    starts = range(0, len(order), per_call)
    if progress is None:
        bar = tqdm(total=len(prompt_ids) * n, desc=desc, unit="answer", disable=len(starts) < 2)
    else:
        bar = progress
        bar.set_description(desc)
    for b, start in enumerate(starts):
        idx = order[start:start + per_call]
        r = generate(model, tok, [prompt_ids[i] for i in idx], group_size=n,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=0,
                     seed=seed + b)
        for k, i in enumerate(idx):
            out[i] = [{"completion": r["completions"][k * n + g],
                       "truncated": bool(r["truncated"][k * n + g])}
                      for g in range(n)]
        bar.update(len(idx) * n)
    if progress is None:
        bar.close()
    return out


# NoCheat (RLME §4, Fig. 7; docs/method.md §4.6): training prompts show the reference answer
# through the template's {answer}; the test shows a WRONG one there and grades against the truth.
INJECT_CHOICES = ("none", "reference", "wrong")


def wrong_answer(items, k):
    """The seeded wrong answer shown in place of item k's reference answer: NoCheat's
    counterfactual test (RLME §4, Fig. 7). The one rule for training validation
    (plumbing/validation.py's wrong_answer calls it) and `evaluate.py math --inject wrong`.

        label a number (a str that reward.to_number reads) -> known_wrong_answer: label + 1
        otherwise (text labels, MATH expressions)          -> the next item's answer_text
                                                              (wrapping round), "none" when equal

    Deterministic given the items and their order, so "seeded" by whatever fixed their order.
    Args:
        items: list of dicts with "label" (str, list of str or None) and "answer_text" (str or
            None): train.py's items or load_math_problems'. k: int index into items.
    Returns:
        str (or the next item's answer_text as is).
    """
    it = items[k]
    if isinstance(it["label"], str) and reward.to_number(it["label"]) is not None:
        return known_wrong_answer(it["label"])
    other = items[(k + 1) % len(items)]["answer_text"]
    return other if other != it["answer_text"] else "none"


def template_fields(template):
    """The placeholder names of a prompt template ({question} -> "question"; '{{' is a brace).
    Raises SystemExit (one line) when it is not a valid format string."""
    import string
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise SystemExit(f"the prompt template is not a valid format string ({e}); "
                         f"write a literal brace as {{{{ or }}}}")


def check_inject(template, inject):
    """Which answer `math` shows through the template's {answer} (RLME §4, Fig. 7).

    A template with {answer} needs --inject reference (the true answer, as in training) or wrong
    (wrong_answer: the counterfactual accuracy); one without takes only none (or no flag).
    Args: template: str. inject: None | "none" | "reference" | "wrong" (the --inject flag).
    Returns: "none" | "reference" | "wrong".
    Raises: SystemExit (one line naming --inject) for the other combinations.
    """
    shows = "answer" in template_fields(template)
    if shows and inject not in ("reference", "wrong"):
        given = f" {inject}" if inject else ""
        raise SystemExit(f"--inject{given}: the prompt template shows {{answer}} "
                         f"(NoCheat, RLME §4 Fig. 7); choose --inject wrong (counterfactual "
                         f"accuracy) or --inject reference")
    if not shows and inject not in (None, "none"):
        raise SystemExit(f"--inject {inject}: the prompt template has no {{answer}} to fill "
                         f"(give a NoCheat template with --prompt-template or --config)")
    return inject or "none"


def shown_answers(problems, inject):
    """What {answer} shows per problem: None (inject "none"), the true answer_text ("reference"),
    or wrong_answer ("wrong"). Returns list[str] or None."""
    if inject == "none":
        return None
    if inject == "reference":
        return [p["answer_text"] for p in problems]
    return [wrong_answer(problems, k) for k in range(len(problems))]


def sample_and_grade(model, tok, problems, n_samples, temperature, max_new_tokens, seed, batch_size,
                     template=PROMPT_TEMPLATE, chat=False, greedy=True, shown=None, grader=None,
                     generate=rollout.generate):
    """Generate (greedy and/or n sampled) answers for `problems` and grade them.

    Prompts are rollout.policy_prompt_ids (the training prompt: {question}, {context}, {answer}).
    A progress bar on stderr (tqdm) counts the answers, problems x (1 greedy + n_samples),
    advancing as each generation batch finishes; it is closed before the caller prints results.
    Args:
        shown: list[str] per problem, what the template's {answer} shows (shown_answers), or None.
            Grading is always against the problem's own label.
        grader: (problem, completion) -> dict of fields for the graded answer, at least "pred"
            and "correct"; default: grade (math).
    Returns:
        list of item dicts: the problem fields plus "greedy" (one graded answer or None),
        "samples" (list of n graded answers) and, with `shown`, "shown_answer"; a graded answer is
        {"completion", "truncated", "pred", "correct", ...grader's other fields}.
    """
    from tqdm import tqdm
    if grader is None:
        def grader(p, completion):
            pred, correct = grade(p, completion)
            return {"pred": pred, "correct": correct}
    shown_list = shown or [None] * len(problems)
    ids = [rollout.policy_prompt_ids(tok, p, chat, template, answer=a)
           for p, a in zip(problems, shown_list)]
    with tqdm(total=len(problems) * (int(greedy) + n_samples), desc="generate",
              unit="answer") as bar:
        greedy_out = [None] * len(problems)
        if greedy:
            greedy_out = generate_texts(model, tok, ids, n=1, temperature=0.0,
                                        max_new_tokens=max_new_tokens, seed=seed,
                                        batch_size=batch_size, desc="greedy", progress=bar,
                                        generate=generate)
        sampled = [[] for _ in problems]
        if n_samples:
            sampled = generate_texts(model, tok, ids, n=n_samples, temperature=temperature,
                                     max_new_tokens=max_new_tokens, seed=seed,
                                     batch_size=batch_size, desc="sample", progress=bar,
                                     generate=generate)
    items = []
    for p, g, s, a in zip(problems, greedy_out, sampled, shown_list):
        for ans in (g or []) + s:
            ans.update(grader(p, ans["completion"]))
        items.append({**p, **({"shown_answer": a} if shown else {}),
                      "greedy": g[0] if g else None, "samples": s})
    return items


def math_summary(items):
    """Accuracy summary of graded items.

    greedy_acc: share of problems whose greedy answer is right. Sampled pass@1 is computed per
    sample index j (accuracy of the j-th sample over all problems), then mean ± population std
    over j: the std says how much a single sampled evaluation would move.
    """
    s = {"n_problems": len(items)}
    if items and items[0]["greedy"] is not None:
        s["greedy_acc"] = sum(it["greedy"]["correct"] for it in items) / len(items)
        s["greedy_truncated"] = sum(it["greedy"]["truncated"] for it in items) / len(items)
        # an empty \boxed{} too
        s["greedy_no_box"] = sum(not it["greedy"]["pred"] for it in items) / len(items)
    n = len(items[0]["samples"]) if items else 0
    if n:
        per_j = [sum(it["samples"][j]["correct"] for it in items) / len(items) for j in range(n)]
        s["n_samples"] = n
        s["sampled_pass1_mean"], s["sampled_pass1_std"] = mean_std(per_j)
        s["sampled_pass1_per_sample"] = per_j
        s["sampled_pass_at_n"] = (sum(any(a["correct"] for a in it["samples"]) for it in items)
                                  / len(items))
    return s


# ----------------------------------------------------------------------------------------------
# Context QA: exact match and token F1 (RLME §4, Tables 1-2; FaithEval-Counterfactual out of
# domain; docs/method.md §4.3, §6)

# The QA prompt of configs/paper/rlme/qa_rlvr.yaml (data.prompt_template; a test keeps the two
# equal): a checkpoint is scored on the task it was trained on. --config reads a run's own.
QA_PROMPT_TEMPLATE = ("{context}\n\nQuestion: {question}\nAnswer the question using the passages "
                      "above, and put your final answer within \\boxed{{}}.")


def choice_letter_match(pred, letters):
    """Whether a boxed answer names one of the gold option `letters`: 'B', 'b', '(B)', 'B)', 'B.'.
    A separate rule, not a gold string for answer_reward: SQuAD normalisation drops the article
    'a', so the letter A would normalise to "" and match an empty or article-only box."""
    if pred is None:
        return False
    core = pred.strip().strip("().:").strip()
    return bool(core) and core.upper() in {x.upper() for x in letters}


def grade_qa(problem, completion):
    """EM and token F1 of one answer (RLME §4 Tables 1-2; docs/method.md §4.3): the last
    \\boxed{} content against the golds with reward.answer_reward(label_format="text"), SQuAD-
    normalised, best over the golds; a multiple-choice item also accepts its letter
    (choice_letter_match: EM = F1 = 1). No box -> 0.
    Returns: {"pred": str|None, "em": float, "f1": float, "correct": em == 1}."""
    pred = reward.extract_boxed(completion)
    em = reward.answer_reward(completion, problem["label"], "text", "em")
    f1 = reward.answer_reward(completion, problem["label"], "text", "f1")
    if problem.get("choice_letters") and choice_letter_match(pred, problem["choice_letters"]):
        em = f1 = 1.0
    return {"pred": pred, "em": em, "f1": f1, "correct": em == 1.0}


def qa_summary(items):
    """Means of graded QA items: greedy_em, greedy_f1 (and greedy_no_box, greedy_truncated);
    with samples, per sample index j the mean EM / F1 over problems, then mean ± population std
    over j (sampled_em_*, sampled_f1_*; as math_summary's pass@1)."""
    s = {"n_problems": len(items)}
    if items and items[0]["greedy"] is not None:
        for k in ("em", "f1"):
            s[f"greedy_{k}"] = sum(it["greedy"][k] for it in items) / len(items)
        # an empty \boxed{} too
        s["greedy_no_box"] = sum(not it["greedy"]["pred"] for it in items) / len(items)
        s["greedy_truncated"] = sum(it["greedy"]["truncated"] for it in items) / len(items)
    n = len(items[0]["samples"]) if items else 0
    if n:
        s["n_samples"] = n
        for k in ("em", "f1"):
            per_j = [sum(it["samples"][j][k] for it in items) / len(items) for j in range(n)]
            s[f"sampled_{k}_mean"], s[f"sampled_{k}_std"] = mean_std(per_j)
    return s


# ----------------------------------------------------------------------------------------------
# Pairwise GRM accuracy (RM-NLHF §4.2, Table 2; benchmarks and contamination rule App. G.1,
# Table 7; docs/method.md §5.2, §6)


# The GRM's decoding in evaluation. RELEASE_DECODING: the RM-NLHF authors' validation (their
# release, Character-GenRM-NLHF/verl/recipe/rm_nlhf/run_full_exp_qwen_7b_rm_nlhf.sh:
# val_kwargs do_sample=True, n=1, temperature=0.6; the response budget data.max_response_length
# 8192, top-p verl's default 1.0), the default of `pairwise` and `bon`: an R1-based GRM reasons at
# length before its critique and choice. GREEDY256: our earlier protocol (greedy, 256 new
# tokens), fine for short-output GRMs and reproducible without a seed.
RELEASE_DECODING = {"temperature": 0.6, "max_new_tokens": 8192}
GREEDY256 = {"temperature": 0.0, "max_new_tokens": 256}
GRM_PROTOCOLS = {"release": RELEASE_DECODING, "greedy256": GREEDY256}


def make_grm_judge(model, tok, max_new_tokens=256, batch_size=8, chat=False, max_prompt_tokens=None,
                   style="ours", generate=rollout.generate, *, temperature=0.0, top_p=1.0, seed=0,
                   max_lines=4, max_chars=1500):
    """A judge function backed by a generative reward model.

    The returned judge(queries) takes a list of (context, response_a, response_b[, turns]) and
    returns, per query, reward.parse_grm_output(text, max_lines, max_chars, style=style) plus
    {"text": the raw output}.
    The prompt is reward.build_grm_prompt(context, a, b, max_lines, style=style, turns=turns): style
    "ours" (the prompt we train with) or "authors" (the RM-NLHF release's, so a released checkpoint
    is scored in its own format; it renders `turns`, a list of {role, content}, when an item kept
    them). A prompt longer than `max_prompt_tokens` (default: model context - max_new_tokens) is not
    generated; it counts as a format failure with why="prompt too long", so the accuracy denominator
    never shrinks silently.
    Decoding: temperature 0 = greedy, > 0 = sampling at that temperature and top_p (one output
    per query; GRM_PROTOCOLS has the release's and the greedy one). Call c of the judge samples
    with seed + 1_000_003 c (generate_texts adds the batch index), so repeated calls (bon's
    rounds) draw afresh and the whole evaluation is fixed by `seed`.
    """
    limit = max_prompt_tokens or (getattr(model.config, "max_position_embeddings", 10 ** 9)
                                  - max_new_tokens)
    calls = [0]

    def judge(queries):
        texts = [reward.build_grm_prompt(q[0], q[1], q[2], max_lines, style=style,
                                         turns=q[3] if len(q) > 3 else None)
                 for q in queries]
        ids = [rollout.build_prompt_ids(tok, t, chat) for t in texts]
        ok = [i for i, x in enumerate(ids) if len(x) <= limit]
        outs = generate_texts(model, tok, [ids[i] for i in ok], n=1, temperature=temperature,
                              top_p=top_p, max_new_tokens=max_new_tokens,
                              seed=seed + 1_000_003 * calls[0], batch_size=batch_size,
                              desc="judge", generate=generate)
        calls[0] += 1
        out = [{"critique": None, "choice": None, "valid": False, "why": "prompt too long",
                "text": ""}
               for _ in queries]
        for i, t in zip(ok, outs):
            out[i] = {**reward.parse_grm_output(t[0]["completion"], max_lines, max_chars,
                                                style=style),
                      "text": t[0]["completion"]}
        return out
    return judge


def pairwise_accuracy(items, judge):
    """GRM accuracy on pairwise items, each judged in both A/B orders.

    Order "ab" shows the item as loaded (response_a first); order "ba" swaps the responses, so
    the right choice flips. A format failure (no parsable choice) counts as wrong in the
    accuracy and is also reported as its own rate.
    Args:
        items: list of {"id", "context", "response_a", "response_b", "winner": "A"|"B", "meta"?}.
        judge: list[(context, a, b, turns|None)]
            -> list[{"choice": "A"|"B"|None, "valid": bool, ...}]; the first n queries are order
            ab, the next n order ba; turns = item meta "turns".
    Returns:
        (summary, records): summary = {"n", "acc_ab", "acc_ba", "acc" (mean of both orders),
        "format_fail" (share of the 2n judgements), "both_right" (share of items right in both
        orders), "pick_a" (share of valid judgements choosing A: 0.5 = no position bias)};
        records = one dict per item with both judgements.
    """
    turns = [(it.get("meta") or {}).get("turns") for it in items]
    queries = [(it["context"], it["response_a"], it["response_b"], t)
               for it, t in zip(items, turns)]
    queries += [(it["context"], it["response_b"], it["response_a"], t)
                for it, t in zip(items, turns)]
    res = judge(queries)
    n = len(items)
    flip = {"A": "B", "B": "A"}
    records, right_ab, right_ba = [], [], []
    for k, it in enumerate(items):
        ab, ba = res[k], res[n + k]
        r1 = bool(ab.get("valid") and ab.get("choice") == it["winner"])
        r2 = bool(ba.get("valid") and ba.get("choice") == flip[it["winner"]])
        right_ab.append(r1)
        right_ba.append(r2)
        records.append({"id": it.get("id", k), "source": it.get("source"),
                        "meta": it.get("meta", {}), "winner": it["winner"],
                        "ab": {**ab, "right": r1}, "ba": {**ba, "right": r2}})
    valid = [r for r in res if r.get("valid")]
    summary = {"n": n, "acc_ab": sum(right_ab) / n, "acc_ba": sum(right_ba) / n,
               "acc": (sum(right_ab) + sum(right_ba)) / (2 * n),
               "format_fail": (2 * n - len(valid)) / (2 * n),
               "both_right": sum(a and b for a, b in zip(right_ab, right_ba)) / n,
               "pick_a": sum(r["choice"] == "A" for r in valid) / len(valid) if valid else None}
    return summary, records


def best_of_group_accuracy(records):
    """RewardBench 2's best-of-4 accuracy (Malik et al. 2025; RM-NLHF Table 2's RewardBench V2).

    A group (one RewardBench 2 row: 1 chosen vs its 3 rejected responses, meta "group") is right
    in an order only if ALL its pairs are right in that order; a subset's accuracy per order is
    the share of its groups right; the benchmark's accuracy is the unweighted mean over subsets
    (meta "subset": Factuality, Precise IF, Math, Safety, Focus). Ties rows never get here
    (load_pairwise drops them; they need their own rule).
    Args:
        records: pairwise_accuracy records with meta {"group", "subset"}.
    Returns:
        {"n" (groups), "acc_ab", "acc_ba", "acc" (mean of both orders), "subsets":
         {subset: {"n", "acc_ab", "acc_ba", "acc"}}}, subsets in first-seen order.
    """
    groups = {}
    for r in records:
        g = groups.setdefault(r["meta"]["group"], {"subset": r["meta"].get("subset"),
                                                   "ab": True, "ba": True, "pairs": 0,
                                                   "size": r["meta"].get("group_size")})
        g["ab"] = g["ab"] and r["ab"]["right"]
        g["ba"] = g["ba"] and r["ba"]["right"]
        g["pairs"] += 1
    for key, g in groups.items():  # a row missing a pair would be scored too leniently
        if g["size"] is not None and g["pairs"] != g["size"]:
            raise SystemExit(f"RewardBench 2 row {key}: {g['pairs']} of its {g['size']} pairs "
                             f"were judged; a row is scored whole")
    subsets = {}
    for g in groups.values():
        subsets.setdefault(g["subset"], []).append(g)
    per = {}
    for name, gs in subsets.items():
        ab, ba = sum(g["ab"] for g in gs) / len(gs), sum(g["ba"] for g in gs) / len(gs)
        per[name] = {"n": len(gs), "acc_ab": ab, "acc_ba": ba, "acc": (ab + ba) / 2}
    acc_ab = sum(s["acc_ab"] for s in per.values()) / len(per)
    acc_ba = sum(s["acc_ba"] for s in per.values()) / len(per)
    return {"n": len(groups), "acc_ab": acc_ab, "acc_ba": acc_ba, "acc": (acc_ab + acc_ba) / 2,
            "subsets": per}


def rm_bench_grid(records):
    """RM-Bench's easy / normal / hard accuracy (mean of both orders) from records whose meta
    holds the chosen and rejected styles (0 concise, 1 detailed plain, 2 detailed markdown):
    easy = chosen more detailed than rejected, normal = same style, hard = chosen less detailed."""
    out = {}
    for name, test in (("easy", lambda c, r: c > r), ("normal", lambda c, r: c == r),
                       ("hard", lambda c, r: c < r)):
        sel = [x for x in records if test(x["meta"]["chosen_style"], x["meta"]["rejected_style"])]
        out[f"acc_{name}"] = (sum(x["ab"]["right"] + x["ba"]["right"] for x in sel)
                              / (2 * len(sel)) if sel else None)
    return out


def score_unit(items, judge):
    """pairwise_accuracy of one file / hub split, with its benchmark's own rule: grouped items
    (RewardBench 2) -> best-of-4 accuracy over subsets (n = groups; the plain per-pair numbers
    kept as pair_acc, n_pairs), RM-Bench -> plus its easy / normal / hard grid.
    Returns (summary, records) as pairwise_accuracy."""
    summary, records = pairwise_accuracy(items, judge)
    if all("group" in r["meta"] for r in records):
        bo = best_of_group_accuracy(records)
        summary = {"n": bo["n"], "n_pairs": summary["n"], "acc_ab": bo["acc_ab"],
                   "acc_ba": bo["acc_ba"], "acc": bo["acc"], "pair_acc": summary["acc"],
                   "format_fail": summary["format_fail"], "pick_a": summary["pick_a"],
                   "scoring": "best-of-4 per row, mean over subsets (Ties excluded)",
                   "subsets": bo["subsets"]}
    elif all("chosen_style" in r["meta"] for r in records):
        summary.update(rm_bench_grid(records))
    return summary, records


def aggregate_pairwise(rows):
    """Per-benchmark rows (item-weighted over its files) and the Overall row.

    Overall = the unweighted mean over benchmarks of each benchmark's numbers, as RM-NLHF
    Table 2's Overall column (e.g. gpt-5: the mean of its 7 benchmark accuracies, 0.7456); it
    equals the paper's only when the same benchmarks are evaluated.
    Args: rows: list of {"benchmark", "n", "acc_ab", "acc_ba", "acc", "format_fail", ...}.
    Returns: {"benchmarks": [rows], "overall": {"n", "n_benchmarks", "acc_ab", "acc_ba", "acc",
        "format_fail", "definition"}}.
    """
    keys = ["acc_ab", "acc_ba", "acc", "format_fail"]
    benches = []
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


# ----------------------------------------------------------------------------------------------
# Best-of-N with the GRM as judge: tournaments over N candidates (RM-NLHF §4.4; docs/method.md §6)
#
# compare(pairs) takes a list of (i, j) candidate indices and returns the list of winners; one
# pair is one judge call. A whole round is passed at once so the judge can batch it.
#
# Knockout over N players (seed order 0..N-1): let P be the smallest power of two >= N and
# b = P - N byes. Round 1: players 0..b-1 get a bye; players b..N-1 play (b, b+1), (b+2, b+3), ...
# Every later round takes the survivors in order [bye players, then match winners in match order]
# and pairs neighbours (s0, s1), (s2, s3), ... (a power of two, so no more byes). N-1 matches.
#
# Double elimination: a player is out after two losses. Winners bracket (WB, no loss) = the
# knockout above, one round at a time; WB losers drop to the losers bracket (LB, one loss).
# After each WB round, the LB list is [LB survivors in order] + [new drop-downs in match order];
# an LB round pairs it by folding (first vs last, second vs second-last, ...), and with an odd
# count the first (longest-waiting) player gets a bye; LB losers are out. WB and LB rounds
# alternate until each bracket has one player; LB rounds continue alone once WB is done. Grand
# final: WB champion vs LB champion; if the LB champion wins, both have one loss and a reset
# match decides. Matches: 2N-2 if the WB champion wins the grand final, else 2N-1.


def knockout(n, compare):
    """Single-elimination bracket over players 0..n-1 (rules above).

    Args:
        n: number of players (>= 1). compare: list[(i, j)] -> list[winner].
    Returns:
        (winner, matches) with matches = list of (i, j, winner) in play order; n-1 matches.
    """
    size = 1
    while size < n:
        size *= 2
    byes = size - n
    alive, matches = list(range(n)), []
    first = True
    while len(alive) > 1:
        waiting, playing = (alive[:byes], alive[byes:]) if first else ([], alive)
        pairs = [(playing[k], playing[k + 1]) for k in range(0, len(playing), 2)]
        winners = compare(pairs)
        matches += [(i, j, w) for (i, j), w in zip(pairs, winners)]
        alive, first = waiting + list(winners), False
    return alive[0], matches


def double_elimination(n, compare):
    """Double-elimination bracket over players 0..n-1 (rules above).

    Returns:
        (winner, matches) with matches = list of (i, j, winner) in play order;
        2n-2 matches, or 2n-1 when the grand final needs a reset.
    """
    if n == 1:
        return 0, []
    size = 1
    while size < n:
        size *= 2
    wb, lb, matches, byes = list(range(n)), [], [], size - n

    def play(pairs):
        winners = compare(pairs)
        matches.extend((i, j, w) for (i, j), w in zip(pairs, winners))
        return winners

    while len(wb) > 1 or len(lb) > 1:
        if len(wb) > 1:
            waiting, playing = wb[:byes], wb[byes:]
            byes = 0
            pairs = [(playing[k], playing[k + 1]) for k in range(0, len(playing), 2)]
            winners = play(pairs)
            wb = waiting + list(winners)
            lb = lb + [i if w == j else j for (i, j), w in zip(pairs, winners)]
        if len(lb) > 1:
            waiting, playing = (lb[:1], lb[1:]) if len(lb) % 2 else ([], lb)
            pairs = [(playing[k], playing[-1 - k]) for k in range(len(playing) // 2)]
            lb = waiting + list(play(pairs))
    champ, challenger = wb[0], lb[0]
    if play([(champ, challenger)])[0] == champ:
        return champ, matches
    return play([(champ, challenger)])[0], matches  # bracket reset: both have one loss now


def best_of_n(item, n, judge, method, rng):
    """Pick one of the first n samples of `item` with a tournament judged by the GRM.

    Each match shows the two answers in a random order (rng), so the judge's position bias does
    not favour the higher seed; a judgement with no valid choice goes to the first-listed player
    of the pair (the higher seed). Returns {"pick", "correct", "calls", "invalid", "matches"}.
    """
    answers = [s["completion"] for s in item["samples"][:n]]
    invalid = [0]

    def compare(pairs):
        swapped = [rng.random() < 0.5 for _ in pairs]
        shown = [(j, i) if s else (i, j) for (i, j), s in zip(pairs, swapped)]
        res = judge([(item["question"], answers[x], answers[y]) for x, y in shown])
        winners = []
        for (i, j), (x, y), r in zip(pairs, shown, res):
            if r.get("valid") and r.get("choice") in ("A", "B"):
                winners.append(x if r["choice"] == "A" else y)
            else:
                invalid[0] += 1
                winners.append(i)
        return winners
    pick, matches = (knockout if method == "knockout" else double_elimination)(n, compare)
    return {"pick": pick, "correct": bool(item["samples"][pick]["correct"]), "calls": len(matches),
            "invalid": invalid[0], "matches": matches}


def majority_vote(samples):
    """Index of the first sample whose extracted answer is the most common one (no box = no vote);
    0 when nothing was boxed. A label-free baseline for Best-of-N."""
    preds = [s.get("pred") for s in samples]
    counts = {}
    for p in preds:
        if p is not None:
            counts[p] = counts.get(p, 0) + 1
    if not counts:
        return 0
    best = max(counts.values())
    return next(k for k, p in enumerate(preds) if p is not None and counts[p] == best)


# ----------------------------------------------------------------------------------------------
# Metrics: mean ± std, AUROC, reliability, EMA


def mean_std(xs):
    """(mean, population std) of a non-empty list of numbers; std of one value is 0."""
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def standard_error(xs):
    """Standard error of the mean of `xs` (list of numbers): the sample std (divided by n - 1)
    over sqrt(n); None for fewer than two values (one run says nothing about run-to-run spread:
    no band, not a zero-width one)."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def ema(values, alpha=0.9):
    """Bias-corrected exponential moving average (Adam's debiasing, TensorBoard's smoothing):
    m_0 = 0, m_t = alpha * m_{t-1} + (1 - alpha) * v_t, e_t = m_t / (1 - alpha^t), t = 1, 2, ...
    e_t is the mean of v_1..v_t weighted by alpha^(t-i): the first point weighs as any other,
    instead of seeding the curve (e_1 = v_1 keeps weight alpha^(t-1) on v_1, 0.35 after ten
    steps, which draws the early curve toward one noisy step). alpha = 0: the raw values.
    Args: values: list[float]; alpha: float in [0, 1). Returns: list[float], len(values)."""
    out, m = [], 0.0
    for t, v in enumerate(values, start=1):
        m = alpha * m + (1 - alpha) * v
        out.append(m / (1 - alpha ** t))
    return out


def midranks(values):
    """1-based ranks of `values` (list[float]); equal values share the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def auroc(scores, labels):
    """Area under the ROC curve = P(score of a random positive > score of a random negative),
    ties counting 1/2 (Mann-Whitney U with mid-ranks).

    Args:
        scores: list[float]; labels: list[bool] (True = positive, e.g. a correct answer).
    Returns:
        float in [0, 1], or None when one class is empty (undefined).
    """
    n_pos = sum(1 for y in labels if y)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = midranks(scores)
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def reliability_table(probs, labels, n_bins=10):
    """Calibration of probabilities `probs` against 0/1 `labels` in equal-width bins on [0, 1].

    Bin b holds p in [b/n_bins, (b+1)/n_bins) (the last bin includes 1.0).
    Returns:
        (rows, ece): rows = list of {"bin": "[lo,hi)", "n", "mean_p", "frac_correct"} for non-empty
        bins; ece = sum_b n_b/n * |frac_correct_b - mean_p_b| (expected calibration error).
    """
    bins = [[] for _ in range(n_bins)]
    for p, y in zip(probs, labels):
        bins[min(int(p * n_bins), n_bins - 1)].append((p, y))
    rows, ece = [], 0.0
    for b, members in enumerate(bins):
        if not members:
            continue
        mean_p = sum(p for p, _ in members) / len(members)
        acc = sum(1 for _, y in members if y) / len(members)
        ece += len(members) / len(probs) * abs(acc - mean_p)
        rows.append({"bin": f"[{b / n_bins:.2f},{(b + 1) / n_bins:.2f})", "n": len(members),
                     "mean_p": mean_p, "frac_correct": acc})
    return rows, ece


# ----------------------------------------------------------------------------------------------
# Evaluator check (RLME Eq. 2; docs/method.md §4.2, §6): does P(target | meta-question) separate
# right from wrong?


def evaluator_logprobs(model, tok, problems, solutions, question, target="Yes", chat=False,
                       batch_size=8, template=None, score=reward.score_targets):
    """log p(target | evaluator prompt) for each (problem, solution), via the training reward's
    own scorer (reward.rlme_reward with one evaluator and one meta-question, weights 1), so the
    check measures exactly the signal RLME would train on (RLME Eq. 2-3; docs/method.md §4.2).

    Args:
        problems, solutions: list[str] of equal length. question, target: the meta-question and
            its target answer a_k. template: evaluator template (default: reward's).
    Returns:
        list[float], log p(target) per solution (<= 0).
    """
    ev = reward.local_evaluator(model, tok, chat=chat, name="evaluator",
                                micro_batch_size=batch_size, score=score)
    mq = {"question": question, "target": target, "weight": 1.0}
    out = reward.rlme_reward([ev], [mq], problems, solutions,
                             template=template or reward.DEFAULT_EVALUATOR_TEMPLATE)
    return out["logp"][:, 0, 0].tolist()


def known_wrong_answer(label):
    """A wrong final answer for canary comparison: label + 1 for numbers, else '0' (or '1')."""
    x = reward.to_number(label)
    if x is not None:
        return str(x + 1)
    return "1" if str(label).strip() == "0" else "0"


def reference_solution(item, answer=None):
    """The dataset's own GSM8K solution with a boxed final answer (`answer`, default the label):
    '#### n' -> 'The answer is \\boxed{n}.', calculator annotations <<...>> removed. With a wrong
    `answer` it is the known-wrong control: the same reasoning, a wrong final answer. None for
    items without a GSM8K reference."""
    if item.get("kind") != "gsm8k" or "####" not in (item.get("reference") or ""):
        return None
    body = re.sub(r"<<[^>]*>>", "", item["reference"].split("####")[0]).strip()
    return f"{body}\nThe answer is \\boxed{{{item['label'] if answer is None else answer}}}."


# ----------------------------------------------------------------------------------------------
# Judge check (RM-NLHF §2.3, Table 1; App. E): does the critique judge agree with human labels?


def judge_check_summary(rows, threshold=0.5):
    """Table 1's protocol: for each similarity (f1, recall, precision) the accuracy of
    1[S > threshold] (Eq. 4's strict rule) against the human label, over the rows the judge
    answered; the rows it failed on are counted, not scored.

    Args: rows: dicts with label (0/1) and the judge's f1, precision, recall (None = failed).
    Returns: dict n, n_failed, acc_f1, acc_recall, acc_precision (None when nothing was answered).
    """
    ok = [r for r in rows if r["f1"] is not None]
    out = {"n": len(rows), "n_failed": len(rows) - len(ok)}
    for metric in ("f1", "recall", "precision"):
        out[f"acc_{metric}"] = ((sum((r[metric] > threshold) == bool(r["label"]) for r in ok)
                                 / len(ok)) if ok else None)
    return out


# the command line imports this file, so it lives in plumbing/cli.py (evaluate_main)
if __name__ == "__main__":
    raise SystemExit("evaluate.py's command line: python -m plumbing.cli evaluate --help "
                     "(from the repository root)")
