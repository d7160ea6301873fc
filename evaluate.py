"""Evaluation: math and context-QA accuracy, pairwise GRM accuracy, Best-of-N tournaments, evaluator check, plots.

What each subcommand measures (docs/method.md §6 says the same in prose):

* math: GSM8K / MATH-500 accuracy of a checkpoint, greedy and sampled pass@1 (the RLME paper's
  accuracy, RLME §4.1; answers graded as in RLVR: last \\boxed{}, docs/method.md §4.3). With a
  NoCheat template ({answer}), --inject wrong gives the counterfactual accuracy (RLME §4, Fig. 7).
* qa: context-QA exact match and token F1 of the boxed answer (RLME §4, Tables 1-2), on a JSONL
  file or hub id with configurable fields, or --preset faitheval (FaithEval-Counterfactual).
* pairwise: a generative reward model's accuracy on pairwise benchmarks, both A/B orders
  (RM-NLHF §4.2, Table 2; benchmarks and their contamination rule App. G.1, Table 7; RewardBench 2
  scored best-of-4; Overall = unweighted mean over benchmarks).
* bon: Best-of-N with the GRM as judge (--grm-prompt as pairwise) in a knockout or
  double-elimination tournament (RM-NLHF §4.4).
* evaluator-check: how well an evaluator's P(target | meta-question), RLME Eq. 2, separates right
  from wrong answers (AUROC, calibration) before a run spends compute on it.
* judge-check: the critique judge's agreement with human 0/1 labels of GRM critiques (RM-NLHF
  §2.3, Table 1: accuracy of S > 0.5 for F1, recall and precision), through a real server.
* plot: learning curves with an exponential moving average (0.9) and a ±1 std band across runs,
  as in RLME §4.1's figures.

Every subcommand writes its results as JSON (summary) and JSONL (one record per item)
under --out and prints a readable table:

    python evaluate.py math --model PATH --data ../shared/data/gsm8k/test.jsonl --n-problems 50
    python evaluate.py math --model PATH --config configs/paper/rlme/nocheat.yaml --inject wrong
    python evaluate.py qa --model PATH --preset faitheval [--data LOCAL_COPY.jsonl]
    python evaluate.py pairwise --model GRM [--benchmarks NAME,...] [BENCHMARK.jsonl ...]  (default: BENCHMARK_REGISTRY's, App. G.1 rule)
    python evaluate.py bon --judge GRM --samples OUT/math_gsm8k-test.items.jsonl --ns 1,2,4,8
    python evaluate.py evaluator-check --evaluator PATH --samples OUT/math_gsm8k-test.items.jsonl
    python evaluate.py judge-check --data ANNOTATED.jsonl --base-url http://127.0.0.1:8000/v1 --model M
    python evaluate.py plot rlme=run1/metrics.jsonl,run2/metrics.jsonl rlvr=run3/metrics.jsonl

The `math` items file is the interchange format: `bon` and `evaluator-check` read its sampled,
graded answers (or sample their own with --policy), so one sampling pass serves all three.
Bad input (not a model, unknown benchmark schema or field, empty file, unreachable hub id,
N > samples) ends with one line, before a model loads where the data is at fault.
Sections follow the subcommands; file reading, tables and the command line are plumbing at the end.
"""
import argparse
import json
import math
import os
import random
import re
import sys

import torch

import reward
import rollout
import fast

REPO = os.path.dirname(os.path.abspath(__file__))
SHARED_DATA = os.environ.get("RLME_SHARED_DATA", os.path.join(REPO, "..", "shared", "data"))

# The generator prompt (docs/method.md §4.1): the problem, then the request to reason and box the answer.
# It must be the one the model was trained with (config.yaml data.prompt_template, the default
# below is a copy of it; `math --config run/config.yaml` reads a run's own), or accuracy
# measures a different task.
PROMPT_TEMPLATE = "{question}\nReason step by step, and put your final answer within \\boxed{{}}."

# Answers that fool weak judges (they contain no solution at all), shown next to a known-wrong one.
CANARIES = {"colon": ":", "step_by_step": "Let's solve this step by step.",
            "claims_correct": "The answer is correct."}


# ----------------------------------------------------------------------------------------------
# Math accuracy (RLME §4.1; docs/method.md §4.3, §6)


def load_math_problems(path, n=None, split="test", hub_config=None):
    """Load GSM8K- or MATH-schema problems, the first `n` in file order.

    Args:
        path: a local JSONL file, or a hub id read with `datasets` (e.g. openai/gsm8k with
            hub_config='main').
    Returns:
        list of {"id", "question", "label", "answer_text", "kind": "gsm8k"|"math", "reference"}:
        GSM8K rows ({question, answer with '#### n'}) get the cleaned numeric label; MATH rows
        ({problem, answer}) keep the answer string. answer_text = the label, the reference answer a
        template's {answer} shows (as train.py's items).
    Raises:
        SystemExit: unknown schema (names the fields found), an empty file, or n larger than
            the number of problems.
    """
    rows = load_rows(path, split, hub_config)
    if n and n > len(rows):
        raise SystemExit(f"--n-problems {n}: {path} has only {len(rows)} problems")
    out = []
    for i, r in enumerate(rows[:n] if n else rows):
        if "question" in r and "answer" in r and "####" in str(r["answer"]):
            label = reward.clean_gsm8k_label(r["answer"])
            out.append({"id": i, "question": r["question"], "label": label, "answer_text": label,
                        "kind": "gsm8k", "reference": r["answer"]})
        elif "problem" in r and "answer" in r:
            out.append({"id": r.get("unique_id", i), "question": r["problem"], "label": str(r["answer"]),
                        "answer_text": str(r["answer"]), "kind": "math", "reference": r.get("solution", "")})
        else:
            raise SystemExit(f"{path}: row {i + 1} has neither the GSM8K schema (question, answer with "
                             f"'####') nor the MATH schema (problem, answer); fields found: {sorted(r)}")
    return out


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


def grade(problem, completion):
    """(extracted answer, correct) of one completion: last \\boxed{} (docs/method.md §4.3), then numeric
    comparison for GSM8K and math-verify for MATH. No box -> (None, False)."""
    pred = reward.extract_boxed(completion)
    if problem["kind"] == "gsm8k":
        return pred, reward.numeric_equal(pred, problem["label"])
    return pred, math_equal(pred, problem["label"])


def generate_texts(model, tok, prompt_ids, n=1, temperature=0.0, max_new_tokens=256, top_p=1.0,
                   seed=0, batch_size=8, desc="generate", *, progress=None):
    """n completions per prompt, in batches of about `batch_size` rows.

    Prompts are sorted by length before batching (left padding to the longest prompt wastes
    compute otherwise) and results put back in input order. Each batch samples with seed+batch.
    Args:
        prompt_ids: list[list[int]]; temperature 0 = greedy.
        desc: label of the progress bar.
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
        r = fast.generate(model, tok, [prompt_ids[i] for i in idx], group_size=n, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=0, seed=seed + b)
        for k, i in enumerate(idx):
            out[i] = [{"completion": r["completions"][k * n + g], "truncated": bool(r["truncated"][k * n + g])}
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
    (train.wrong_answer calls it) and `evaluate.py math --inject wrong`.

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
        raise SystemExit(f"--inject{given}: the prompt template shows {{answer}} (NoCheat, RLME §4 Fig. 7); "
                         f"choose --inject wrong (counterfactual accuracy) or --inject reference")
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
                     template=PROMPT_TEMPLATE, chat="auto", greedy=True, shown=None, grader=None):
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
    chat = chat_format(tok, chat)
    shown_list = shown or [None] * len(problems)
    ids = [rollout.policy_prompt_ids(tok, p, chat, template, answer=a) for p, a in zip(problems, shown_list)]
    with tqdm(total=len(problems) * (int(greedy) + n_samples), desc="generate", unit="answer") as bar:
        greedy_out = [None] * len(problems)
        if greedy:
            greedy_out = generate_texts(model, tok, ids, n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                                        seed=seed, batch_size=batch_size, desc="greedy", progress=bar)
        sampled = [[] for _ in problems]
        if n_samples:
            sampled = generate_texts(model, tok, ids, n=n_samples, temperature=temperature,
                                     max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
                                     desc="sample", progress=bar)
    items = []
    for p, g, s, a in zip(problems, greedy_out, sampled, shown_list):
        for ans in (g or []) + s:
            ans.update(grader(p, ans["completion"]))
        items.append({**p, **({"shown_answer": a} if shown else {}), "greedy": g[0] if g else None, "samples": s})
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
        s["greedy_no_box"] = sum(it["greedy"]["pred"] is None for it in items) / len(items)
    n = len(items[0]["samples"]) if items else 0
    if n:
        per_j = [sum(it["samples"][j]["correct"] for it in items) / len(items) for j in range(n)]
        s["n_samples"] = n
        s["sampled_pass1_mean"], s["sampled_pass1_std"] = mean_std(per_j)
        s["sampled_pass1_per_sample"] = per_j
        s["sampled_pass_at_n"] = sum(any(a["correct"] for a in it["samples"]) for it in items) / len(items)
    return s


def cmd_math(a):
    a.prompt_template = prompt_template(a)
    inject = check_inject(a.prompt_template, a.inject)
    problems = load_math_problems(a.data, a.n_problems, a.split, a.hub_config)
    shown = shown_answers(problems, inject)
    model, tok = rollout.load_model(a.model, a.dtype)
    items = sample_and_grade(model, tok, problems, n_samples=a.n_samples, temperature=a.temperature,
                             max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size,
                             template=a.prompt_template, chat=parse_chat(a, a.model), greedy=not a.no_greedy,
                             shown=shown)
    name = a.name or data_name(a.data) + ("" if inject == "none" else f"_inject-{inject}")
    summary = {"model": a.model, "data": a.data, "kind": problems[0]["kind"], "seed": a.seed,
               "temperature": a.temperature, "max_new_tokens": a.max_new_tokens,
               "prompt_template": a.prompt_template, "inject": inject, **math_summary(items)}
    if inject == "wrong":  # every prompt showed a wrong answer, graded against the truth (RLME Fig. 7)
        summary["counterfactual_acc"] = summary.get("greedy_acc")
        summary["counterfactual_pass1_mean"] = summary.get("sampled_pass1_mean")
    write_results(a.out, f"math_{name}", summary, items)
    row = {**summary, "data": name}
    acc, pass1 = ("counterfactual_acc", "counterfactual pass@1") if inject == "wrong" else ("greedy_acc", "sampled pass@1")
    if "sampled_pass1_mean" in summary:
        row[pass1] = f"{summary['sampled_pass1_mean']:.3f} ± {summary['sampled_pass1_std']:.3f}"
    title = {"none": f"math accuracy: {a.model}",
             "reference": f"math accuracy with the reference answer shown (--inject reference): {a.model}",
             "wrong": f"COUNTERFACTUAL accuracy (NoCheat, RLME §4 Fig. 7): each prompt shows a wrong answer, "
                      f"graded against the true label: {a.model}"}[inject]
    print_table([row], ["data", "n_problems", acc, pass1, "n_samples",
                        "sampled_pass_at_n", "greedy_no_box", "greedy_truncated"], title=title)
    return summary


# ----------------------------------------------------------------------------------------------
# Context QA: exact match and token F1 (RLME §4, Tables 1-2; FaithEval-Counterfactual out of
# domain; docs/method.md §4.3, §6)

# The QA prompt of configs/paper/rlme/qa_rlvr.yaml (data.prompt_template; a test keeps the two
# equal): a checkpoint is scored on the task it was trained on. --config reads a run's own.
QA_PROMPT_TEMPLATE = ("{context}\n\nQuestion: {question}\nAnswer the question using the passages above, "
                      "and put your final answer within \\boxed{{}}.")

# Field defaults of `qa` (a flag, then --preset, then these).
QA_DEFAULTS = {"split": "test", "hub_config": None, "question_field": "question", "context_field": "context",
               "answer_field": "answer", "choices_field": None}
# --preset NAME: the data and fields of a known set. FaithEval-Counterfactual (Ming et al. 2024,
# arXiv 2410.03727; the RLME paper's out-of-domain QA test): 1,000 multiple-choice questions whose
# context states a counterfactual "fact"; the gold (answerKey) is the option the context supports.
# Rows: id, question, context, choices {"label": [...], "text": [...]}, answerKey, answer.
QA_PRESETS = {
    "faitheval": {"data": "Salesforce/FaithEval-counterfactual-v1.0", "split": "test", "hub_config": None,
                  "question_field": "question", "context_field": "context", "answer_field": "answerKey",
                  "choices_field": "choices"},
}


def parse_choices(value, where):
    """A multiple-choice field -> list of (label, text): the hub's {"label": [...], "text": [...]}
    (FaithEval, ARC) or a plain list of str (labelled A, B, C, ...).
    Raises SystemExit (one line naming `where`) for anything else."""
    if isinstance(value, dict) and isinstance(value.get("label"), list) and isinstance(value.get("text"), list) \
            and len(value["label"]) == len(value["text"]) and value["text"]:
        return [(str(lab), str(t)) for lab, t in zip(value["label"], value["text"])]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return [(chr(ord("A") + k), t) for k, t in enumerate(value)]
    raise SystemExit(f"{where}: expected {{'label': [...], 'text': [...]}} or a list of option texts, "
                     f"got {type(value).__name__} {value!r:.60}")


def gold_choice(choices, key, where):
    """Index of the gold option for answer key `key`: the option labelled `key`; else, when `key`
    is a capital letter and the labels are something else (ARC rows labelled 1-4 with key 'A'),
    its position (A = 0). Raises SystemExit naming `where` when neither exists."""
    labels = [lab for lab, _ in choices]
    if key in labels:
        return labels.index(key)
    if len(key) == 1 and "A" <= key <= "Z" and ord(key) - ord("A") < len(labels):
        return ord(key) - ord("A")
    raise SystemExit(f"{where}: answer key {key!r} is not one of the option labels {labels}")


def qa_golds(value, where):
    """An answer field -> non-empty list of str: a str, a list of str, or SQuAD's {"text": [...]}.
    Raises SystemExit naming `where` otherwise."""
    golds = value.get("text") if isinstance(value, dict) else value
    golds = [golds] if isinstance(golds, str) else golds
    if not isinstance(golds, list) or not golds or not all(isinstance(g, (str, int, float)) for g in golds):
        raise SystemExit(f"{where}: expected an answer string, a list of them or {{'text': [...]}}, got {value!r:.60}")
    return [str(g) for g in golds]


def load_qa_items(path, n=None, split="test", hub_config=None, question_field="question", context_field="context",
                  answer_field="answer", choices_field=None, context_max_chars=4000):
    """Context-QA items of a local JSONL file or a hub split, the first `n` in order.

    The context is reward.render_context(row[context_field], context_max_chars) (a str, a list of
    str, or QA-Feedback's [title, sentence, ...] passages; RLME §4 cuts at 4,000 characters). The
    golds are the answer field (qa_golds). With `choices_field` (multiple choice, FaithEval) the
    answer field is the answer key: the options are listed under the question ("A) text" lines,
    so the model can name one), the gold is the key's option text and the accepted letters are its
    label and the key (gold_choice).
    Args: the --data / --split / --hub-config / --*-field / --context-max-chars flags.
    Returns:
        list of {"id", "question" (with the options when multiple choice), "context", "label"
        (list of gold str), "answer_text" (the first gold), "kind": "qa", "choice_letters"
        (list of str; multiple choice only)}.
    Raises:
        SystemExit (one line naming the row and flag): a missing field (the fields found listed),
        an unreadable context / answer / options field, n larger than the rows, no rows.
    """
    rows = load_rows(path, split, hub_config)
    if n and n > len(rows):
        raise SystemExit(f"--n-problems {n}: {path} has only {len(rows)} rows")
    fields = {"--question-field": question_field, "--context-field": context_field, "--answer-field": answer_field,
              "--choices-field": choices_field}
    items = []
    for i, r in enumerate(rows[:n] if n else rows):
        where = f"{path} row {i + 1}"
        for flag, f in fields.items():
            if f is not None and f not in r:
                raise SystemExit(f"{where}: no field {f!r} ({flag}); fields found: {sorted(r)}")
        try:
            context = reward.render_context(r[context_field], context_max_chars)
        except ValueError as e:
            raise SystemExit(f"{where}: field {context_field!r} (--context-field): {e}")
        question = str(r[question_field])
        item = {"id": r.get("id", i), "question": question, "context": context, "kind": "qa"}
        if choices_field is None:
            item["label"] = qa_golds(r[answer_field], f"{where}: field {answer_field!r} (--answer-field)")
        else:
            choices = parse_choices(r[choices_field], f"{where}: field {choices_field!r} (--choices-field)")
            key = str(r[answer_field]).strip()
            k = gold_choice(choices, key, f"{where}: field {answer_field!r} (--answer-field)")
            item["question"] = question + "\nOptions:\n" + "\n".join(f"{lab}) {t}" for lab, t in choices)
            item["label"] = [choices[k][1]]
            item["choice_letters"] = list(dict.fromkeys([choices[k][0], key]))
        item["answer_text"] = item["label"][0]
        items.append(item)
    return items


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
        s["greedy_no_box"] = sum(it["greedy"]["pred"] is None for it in items) / len(items)
        s["greedy_truncated"] = sum(it["greedy"]["truncated"] for it in items) / len(items)
    n = len(items[0]["samples"]) if items else 0
    if n:
        s["n_samples"] = n
        for k in ("em", "f1"):
            per_j = [sum(it["samples"][j][k] for it in items) / len(items) for j in range(n)]
            s[f"sampled_{k}_mean"], s[f"sampled_{k}_std"] = mean_std(per_j)
    return s


def qa_settings(a):
    """The data source and fields of `qa`: a flag given wins, then --preset's value, then
    QA_DEFAULTS. Returns dict data, split, hub_config, *_field. SystemExit without --data or --preset."""
    preset = QA_PRESETS[a.preset] if a.preset else {}
    out = {k: getattr(a, k) if getattr(a, k) is not None else preset.get(k, v) for k, v in QA_DEFAULTS.items()}
    out["data"] = a.data or preset.get("data")
    if not out["data"]:
        raise SystemExit(f"qa: give --data FILE_OR_HUB_ID or --preset {'|'.join(QA_PRESETS)}")
    return out


def cmd_qa(a):
    if a.context_max_chars < 0:
        raise SystemExit(f"--context-max-chars {a.context_max_chars}: must be >= 0 (0 = no cut)")
    a.prompt_template = prompt_template(a, default=QA_PROMPT_TEMPLATE, allowed=("context", "question"),
                                        required=("context", "question"))
    st = qa_settings(a)
    items = load_qa_items(st["data"], a.n_problems, split=st["split"], hub_config=st["hub_config"],
                          question_field=st["question_field"], context_field=st["context_field"],
                          answer_field=st["answer_field"], choices_field=st["choices_field"],
                          context_max_chars=a.context_max_chars)
    model, tok = rollout.load_model(a.model, a.dtype)
    items = sample_and_grade(model, tok, items, n_samples=a.n_samples, temperature=a.temperature,
                             max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size,
                             template=a.prompt_template, chat=parse_chat(a, a.model), greedy=not a.no_greedy,
                             grader=grade_qa)
    name = a.name or data_name(st["data"])
    summary = {"model": a.model, **st, "preset": a.preset, "multiple_choice": st["choices_field"] is not None,
               "context_max_chars": a.context_max_chars, "seed": a.seed, "temperature": a.temperature,
               "max_new_tokens": a.max_new_tokens, "prompt_template": a.prompt_template, **qa_summary(items)}
    write_results(a.out, f"qa_{name}", summary, items)
    row = {**summary, "data": name}
    for k in ("em", "f1"):
        if f"sampled_{k}_mean" in summary:
            row[f"sampled {k.upper()}"] = f"{summary[f'sampled_{k}_mean']:.3f} ± {summary[f'sampled_{k}_std']:.3f}"
    print_table([row], ["data", "n_problems", "greedy_em", "greedy_f1", "sampled EM", "sampled F1", "n_samples",
                        "greedy_no_box", "greedy_truncated"],
                title=f"context QA: {a.model} (last \\boxed{{}} vs gold, SQuAD-normalised exact match and token F1"
                      f"{'; the gold option text or its letter' if summary['multiple_choice'] else ''})")
    return summary


# ----------------------------------------------------------------------------------------------
# Pairwise GRM accuracy (RM-NLHF §4.2, Table 2; benchmarks and contamination rule App. G.1, Table 7;
# docs/method.md §5.2, §6)

# Pairwise benchmarks: name (what --benchmarks and --source take) -> how to read it.
#   title: the name in tables and JSON.  release: "YYYY-MM", as in RM-NLHF Table 7 (local-only
#   benchmarks: their paper's first arXiv month).  paper: "used" (Table 2's seven), "excluded"
#   (Table 7, too old for the paper's 2025-01 base models) or None (not in Table 7).
#   supported: whether this code can read it from its source.  local: folder under --data-root
#   (every .jsonl in it, schema detected per file), or None.  hub: {"id", "config", "split",
#   "schema"} for datasets.load_dataset, or None.  note: why it is not supported / what it holds.
# Order: Table 2's columns, then the rest of Table 7, then our local-only files.
NOT_AVAILABLE = "its data format is not available to us, so reward.py has no reader for it"
NOT_SET_UP = "no source set up here (the paper excludes it anyway)"
BENCHMARK_REGISTRY = {
    "helpsteer3": {"title": "HelpSteer3", "release": "2025-05", "paper": "used", "supported": True, "local": None,
                   "hub": {"id": "nvidia/HelpSteer3", "config": "preference", "split": "validation",
                           "schema": "helpsteer3"}, "note": "ties (overall_preference 0) dropped"},
    "reward_bench_2": {"title": "RewardBench 2", "release": "2025-06", "paper": "used", "supported": True,
                       "local": None, "hub": {"id": "allenai/reward-bench-2", "config": None, "split": "test",
                                              "schema": "reward_bench_2"},
                       "note": "best-of-4 per row, mean over subsets; Ties excluded"},
    "scan_hpd": {"title": "SCAN-HPD", "release": "2025-05", "paper": "used", "supported": False, "local": None,
                 "hub": None, "note": NOT_AVAILABLE},
    "href": {"title": "HREF", "release": "2024-12", "paper": "used", "supported": False, "local": None,
             "hub": None, "note": NOT_AVAILABLE},
    "litbench": {"title": "LitBench", "release": "2025-07", "paper": "used", "supported": False, "local": None,
                 "hub": None, "note": NOT_AVAILABLE},
    "wq_arena": {"title": "WQ-Arena", "release": "2025-04", "paper": "used", "supported": False, "local": None,
                 "hub": None, "note": NOT_AVAILABLE},
    "wpb": {"title": "WPB", "release": "2025-10", "paper": "used", "supported": False, "local": None,
            "hub": None, "note": NOT_AVAILABLE},
    "mt_bench": {"title": "MT-Bench", "release": "2023-06", "paper": "excluded", "supported": False, "local": None,
                 "hub": None, "note": NOT_SET_UP},
    "reward_bench": {"title": "RewardBench", "release": "2024-03", "paper": "excluded", "supported": False,
                     "local": None, "hub": None, "note": NOT_SET_UP},
    "rm_bench": {"title": "RM-Bench", "release": "2024-10", "paper": "excluded", "supported": True,
                 "local": "rm_bench", "hub": None, "note": "3x3 style grid per row, easy/normal/hard reported"},
    "ppe": {"title": "PPE", "release": "2024-10", "paper": "excluded", "supported": False, "local": None,
            "hub": None, "note": NOT_SET_UP},
    "judgebench": {"title": "JudgeBench", "release": "2024-10", "paper": "excluded", "supported": True,
                   "local": "judgebench", "hub": None, "note": ""},
    "rmb": {"title": "RMB", "release": "2024-10", "paper": "excluded", "supported": False, "local": None,
            "hub": None, "note": NOT_SET_UP},
    "llmbar": {"title": "LLMBar", "release": "2023-10", "paper": None, "supported": True, "local": "llmbar",
               "hub": None, "note": "with FairEval, LLMEval2 and MT-Bench human subsets"},
    "pandalm_testset": {"title": "PandaLM", "release": "2023-06", "paper": None, "supported": True,
                        "local": "pandalm_testset", "hub": None, "note": ""},
    "hh_rlhf_harmless_base": {"title": "HH-RLHF", "release": "2022-04", "paper": None, "supported": True,
                              "local": "hh_rlhf_harmless_base", "hub": None, "note": "harmless-base test split"},
}
# local folder -> title, to name explicitly passed files by their folder
BENCHMARKS = {b["local"]: b["title"] for b in BENCHMARK_REGISTRY.values() if b["local"]}
# The paper's base models (DeepSeek-R1-Distill-Qwen-7B/32B, -Llama-8B) were released 2025-01 (Table 7).
DEFAULT_BASE_RELEASE = "2025-01"


def month_index(s, what):
    """'YYYY-MM' -> months since year 0 (int), so that one month before is index - 1.
    Raises SystemExit naming `what` (e.g. '--base-release') when `s` is not YYYY-MM."""
    m = re.fullmatch(r"(\d{4})-(\d{2})", str(s))
    if not m or not 1 <= int(m.group(2)) <= 12:
        raise SystemExit(f"{what} {s!r}: expected a month as YYYY-MM, e.g. 2025-01")
    return int(m.group(1)) * 12 + int(m.group(2)) - 1


def passes_contamination_rule(release, base_release):
    """RM-NLHF App. G.1: a benchmark counts only if released no earlier than one month before the
    base model (release >= base - 1 month). With 2025-01 bases, HREF (2024-12) is in and
    JudgeBench (2024-10) is out, as Table 7's marks say; Table 7's caption words it the other way
    round ("released within 1 month before ... are excluded"), but the text and the marks agree
    with this rule, so we follow them. Args: 'YYYY-MM' strings. Returns: bool."""
    return month_index(release, "release") >= month_index(base_release, "--base-release") - 1


def earliest_allowed(base_release):
    """The earliest release month that passes the rule for `base_release` ('YYYY-MM')."""
    k = month_index(base_release, "--base-release") - 1
    return f"{k // 12:04d}-{k % 12 + 1:02d}"


def parse_sources(specs):
    """--source NAME=PATH (repeatable) -> {name: path}. Raises SystemExit for a spec without '=',
    an unknown NAME or a PATH that does not exist."""
    out = {}
    for s in specs or []:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--source {s!r}: expected NAME=PATH")
        if name not in BENCHMARK_REGISTRY:
            raise SystemExit(f"--source {s}: unknown benchmark {name!r}; known: {', '.join(BENCHMARK_REGISTRY)}")
        if not os.path.exists(path):
            raise SystemExit(f"--source {s}: {path} does not exist")
        out[name] = path
    return out


def select_benchmarks(names=None, files=(), base_release=DEFAULT_BASE_RELEASE, sources=None):
    """Which benchmarks `pairwise` evaluates (RM-NLHF App. G.1, Table 7).

    Default (no names, no files): every registry benchmark we can read (supported, or given a
    --source) that passes the contamination rule for `base_release`. Explicit names / files are
    taken as asked; one failing the rule gets a warning line, not a refusal.
    Args:
        names: list of registry names (--benchmarks) or None. files: explicit file paths.
        base_release: 'YYYY-MM' of the base model. sources: {name: local path} (--source).
    Returns:
        {"mode": "default"|"explicit", "rule": str, "chosen": [registry names], "files": [paths],
         "left_out": {name: why} (default mode), "warnings": [one-line str], "notes": [one-line str]}
    Raises:
        SystemExit (one line): an unknown or unsupported name, or nothing left by the rule.
    """
    sources = sources or {}
    floor = earliest_allowed(base_release)
    rule = f"released {floor} or later (one month before --base-release {base_release})"
    sel = {"mode": "explicit" if names is not None or files else "default", "rule": rule, "chosen": [],
           "files": list(files), "left_out": {}, "warnings": [], "notes": []}

    def warn(title, release):
        sel["warnings"].append(f"warning: {title} (released {release}) fails the contamination rule: not {rule}; "
                               f"evaluated because you asked for it (RM-NLHF App. G.1)")
    if sel["mode"] == "default":
        for name, b in BENCHMARK_REGISTRY.items():
            if not (b["supported"] or name in sources):
                sel["left_out"][name] = f"not supported here: {b['note']}"
            elif not passes_contamination_rule(b["release"], base_release):
                sel["left_out"][name] = f"not {rule}"
            else:
                sel["chosen"].append(name)
        if not sel["chosen"]:
            raise SystemExit(f"no benchmark left: none we can read is {rule}; pass --benchmarks NAME or files "
                             f"to evaluate older ones anyway")
        return sel
    for name in names or []:
        b = BENCHMARK_REGISTRY.get(name)
        if b is None:
            raise SystemExit(f"--benchmarks {name}: unknown; known: {', '.join(BENCHMARK_REGISTRY)}")
        if not (b["supported"] or name in sources):
            raise SystemExit(f"--benchmarks {name}: {b['title']} is not supported here ({b['note']}); "
                             f"--source {name}=PATH reads a copy converted to a reward.PAIR_SCHEMAS schema")
        if not passes_contamination_rule(b["release"], base_release):
            warn(b["title"], b["release"])
        sel["chosen"].append(name)
    for path in files:
        entry = registry_entry_of_file(path)
        if entry is None:
            sel["notes"].append(f"note: {path}: release month unknown, contamination rule not checked")
        elif not passes_contamination_rule(entry["release"], base_release):
            warn(f"{entry['title']} file {path}", entry["release"])
    return sel


def registry_entry_of_file(path):
    """The registry entry whose local folder holds `path` (matched by folder name), or None."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return next((b for b in BENCHMARK_REGISTRY.values() if b["local"] == folder), None)


def benchmark_units(name, data_root=SHARED_DATA, sources=None):
    """Where registry benchmark `name` is read from, as units (one file or one hub split each).

    --source NAME=PATH wins (a file, or every .jsonl of a folder; read with the registry's hub
    schema when it has one, else schema auto); then the local folder under `data_root`; then the hub.
    Returns:
        list of {"name", "benchmark" (title), "file" (short tag), "path" (file or hub id),
                 "schema", "split", "config", "hub": bool}.
    Raises:
        SystemExit: a local folder with no .jsonl files.
    """
    b = BENCHMARK_REGISTRY[name]
    src = (sources or {}).get(name)
    base = {"name": name, "benchmark": b["title"], "split": "train", "config": None, "hub": False}
    if src or b["local"]:
        where = src or os.path.join(data_root, b["local"])
        files = (sorted(os.path.join(where, f) for f in os.listdir(where) if f.endswith(".jsonl"))
                 if os.path.isdir(where) else [where] if src else [])
        if not files:
            raise SystemExit(f"benchmark {name}: no .jsonl files in {where} "
                             f"({'--source' if src else '--data-root'})")
        schema = b["hub"]["schema"] if src and b["hub"] else "auto"
        return [dict(base, file=os.path.splitext(os.path.basename(f))[0], path=f, schema=schema) for f in files]
    hub = b["hub"]
    return [dict(base, file=hub["split"], path=hub["id"], schema=hub["schema"], split=hub["split"],
                 config=hub["config"], hub=True)]


def make_grm_judge(model, tok, max_new_tokens=256, batch_size=8, chat="auto", max_prompt_tokens=None,
                   style="ours"):
    """A judge function backed by a generative reward model (greedy decoding).

    The returned judge(queries) takes a list of (context, response_a, response_b[, turns]) and
    returns, per query, reward.parse_grm_output(text, style=style) plus {"text": the raw output}.
    The prompt is reward.build_grm_prompt(context, a, b, style=style, turns=turns): style "ours"
    (the prompt we train with) or "authors" (the RM-NLHF release's, so a released checkpoint is
    scored in its own format; it renders `turns`, a list of {role, content}, when an item kept
    them). A prompt longer than `max_prompt_tokens` (default: model context - max_new_tokens) is
    not generated; it counts as a format failure with why="prompt too long", so the accuracy
    denominator never shrinks silently.
    """
    chat = chat_format(tok, chat)
    limit = max_prompt_tokens or (getattr(model.config, "max_position_embeddings", 10 ** 9) - max_new_tokens)

    def judge(queries):
        texts = [reward.build_grm_prompt(q[0], q[1], q[2], style=style, turns=q[3] if len(q) > 3 else None)
                 for q in queries]
        ids = [rollout.build_prompt_ids(tok, t, chat) for t in texts]
        ok = [i for i, x in enumerate(ids) if len(x) <= limit]
        outs = generate_texts(model, tok, [ids[i] for i in ok], n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, desc="judge")
        out = [{"critique": None, "choice": None, "valid": False, "why": "prompt too long", "text": ""}
               for _ in queries]
        for i, t in zip(ok, outs):
            out[i] = {**reward.parse_grm_output(t[0]["completion"], style=style), "text": t[0]["completion"]}
        return out
    return judge


def pairwise_accuracy(items, judge):
    """GRM accuracy on pairwise items, each judged in both A/B orders.

    Order "ab" shows the item as loaded (response_a first); order "ba" swaps the responses, so
    the right choice flips. A format failure (no parsable choice) counts as wrong in the
    accuracy and is also reported as its own rate.
    Args:
        items: list of {"id", "context", "response_a", "response_b", "winner": "A"|"B", "meta"?}.
        judge: list[(context, a, b, turns|None)] -> list[{"choice": "A"|"B"|None, "valid": bool, ...}];
            the first n queries are order ab, the next n order ba; turns = item meta "turns".
    Returns:
        (summary, records): summary = {"n", "acc_ab", "acc_ba", "acc" (mean of both orders),
        "format_fail" (share of the 2n judgements), "both_right" (share of items right in both
        orders), "pick_a" (share of valid judgements choosing A: 0.5 = no position bias)};
        records = one dict per item with both judgements.
    """
    turns = [(it.get("meta") or {}).get("turns") for it in items]
    queries = [(it["context"], it["response_a"], it["response_b"], t) for it, t in zip(items, turns)]
    queries += [(it["context"], it["response_b"], it["response_a"], t) for it, t in zip(items, turns)]
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
        records.append({"id": it.get("id", k), "source": it.get("source"), "meta": it.get("meta", {}),
                        "winner": it["winner"], "ab": {**ab, "right": r1}, "ba": {**ba, "right": r2}})
    valid = [r for r in res if r.get("valid")]
    summary = {"n": n, "acc_ab": sum(right_ab) / n, "acc_ba": sum(right_ba) / n,
               "acc": (sum(right_ab) + sum(right_ba)) / (2 * n),
               "format_fail": (2 * n - len(valid)) / (2 * n),
               "both_right": sum(a and b for a, b in zip(right_ab, right_ba)) / n,
               "pick_a": sum(r["choice"] == "A" for r in valid) / len(valid) if valid else None}
    return summary, records


def load_benchmark(path, n, seed, schema="auto", split="train", config_name=None):
    """Up to `n` pairwise items of one file or hub split via reward.load_pairwise (which
    randomises the A/B order per item with `seed`, detects the schema and fails with one line
    naming the file and the fields found, or the hub id when it cannot be loaded).

    A subset is a seeded random sample in file order, not the first n items: RM-Bench gives 9
    style pairs per row and JudgeBench is sorted by source, so a prefix would cover one row or
    one category. Items that belong to a group (meta "group": RewardBench 2 gives 3 pairs per
    row, scored together by best_of_group_accuracy) are sampled by whole groups, and `n` counts
    groups. n = 0 or None: all items.
    Returns: list of reward.load_pairwise items.
    Raises SystemExit for a missing/empty file, an unknown schema or an unreachable hub dataset.
    """
    if path.endswith(".jsonl"):
        read_jsonl(path)  # one-line errors for a missing or empty file
    items = reward.load_pairwise(path, schema=schema, seed=seed, split=split, config_name=config_name)
    if not items:
        raise SystemExit(f"{path}: no usable pairwise items (ties only?)")
    grouped = all("group" in (it.get("meta") or {}) for it in items)
    units = list(dict.fromkeys(it["meta"]["group"] for it in items)) if grouped else list(range(len(items)))
    if n and n < len(units):
        keep = sorted(random.Random(f"{seed}:{path}").sample(range(len(units)), n))
        if grouped:
            kept = {units[i] for i in keep}
            items = [it for it in items if it["meta"]["group"] in kept]
        else:
            items = [items[i] for i in keep]
    return items


def best_of_group_accuracy(records):
    """RewardBench 2's best-of-4 accuracy (Malik et al. 2025; RM-NLHF Table 2's RewardBench V2).

    A group (one RewardBench 2 row: 1 chosen vs its 3 rejected responses, meta "group") is right
    in an order only if ALL its pairs are right in that order; a subset's accuracy per order is
    the share of its groups right; the benchmark's accuracy is the unweighted mean over subsets
    (meta "subset": Factuality, Precise IF, Math, Safety, Focus). Ties rows never get here
    (reward.load_pairwise drops them; they need their own rule).
    Args:
        records: pairwise_accuracy records with meta {"group", "subset"}.
    Returns:
        {"n" (groups), "acc_ab", "acc_ba", "acc" (mean of both orders), "subsets":
         {subset: {"n", "acc_ab", "acc_ba", "acc"}}}, subsets in first-seen order.
    """
    groups = {}
    for r in records:
        g = groups.setdefault(r["meta"]["group"], {"subset": r["meta"].get("subset"), "ab": True, "ba": True,
                                                   "pairs": 0, "size": r["meta"].get("group_size")})
        g["ab"] = g["ab"] and r["ab"]["right"]
        g["ba"] = g["ba"] and r["ba"]["right"]
        g["pairs"] += 1
    for key, g in groups.items():  # a row missing a pair would be scored too leniently
        if g["size"] is not None and g["pairs"] != g["size"]:
            raise SystemExit(f"RewardBench 2 row {key}: {g['pairs']} of its {g['size']} pairs were judged; "
                             f"a row is scored whole")
    subsets = {}
    for g in groups.values():
        subsets.setdefault(g["subset"], []).append(g)
    per = {}
    for name, gs in subsets.items():
        ab, ba = sum(g["ab"] for g in gs) / len(gs), sum(g["ba"] for g in gs) / len(gs)
        per[name] = {"n": len(gs), "acc_ab": ab, "acc_ba": ba, "acc": (ab + ba) / 2}
    acc_ab = sum(s["acc_ab"] for s in per.values()) / len(per)
    acc_ba = sum(s["acc_ba"] for s in per.values()) / len(per)
    return {"n": len(groups), "acc_ab": acc_ab, "acc_ba": acc_ba, "acc": (acc_ab + acc_ba) / 2, "subsets": per}


def rm_bench_grid(records):
    """RM-Bench's easy / normal / hard accuracy (mean of both orders) from records whose meta
    holds the chosen and rejected styles (0 concise, 1 detailed plain, 2 detailed markdown):
    easy = chosen more detailed than rejected, normal = same style, hard = chosen less detailed."""
    out = {}
    for name, test in (("easy", lambda c, r: c > r), ("normal", lambda c, r: c == r), ("hard", lambda c, r: c < r)):
        sel = [x for x in records if test(x["meta"]["chosen_style"], x["meta"]["rejected_style"])]
        out[f"acc_{name}"] = sum(x["ab"]["right"] + x["ba"]["right"] for x in sel) / (2 * len(sel)) if sel else None
    return out


def score_unit(items, judge):
    """pairwise_accuracy of one file / hub split, with its benchmark's own rule: grouped items
    (RewardBench 2) -> best-of-4 accuracy over subsets (n = groups; the plain per-pair numbers
    kept as pair_acc, n_pairs), RM-Bench -> plus its easy / normal / hard grid.
    Returns (summary, records) as pairwise_accuracy."""
    summary, records = pairwise_accuracy(items, judge)
    if all("group" in r["meta"] for r in records):
        bo = best_of_group_accuracy(records)
        summary = {"n": bo["n"], "n_pairs": summary["n"], "acc_ab": bo["acc_ab"], "acc_ba": bo["acc_ba"],
                   "acc": bo["acc"], "pair_acc": summary["acc"], "format_fail": summary["format_fail"],
                   "pick_a": summary["pick_a"], "scoring": "best-of-4 per row, mean over subsets (Ties excluded)",
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
        benches.append({"benchmark": name, "n": n, **{k: sum(r[k] * r["n"] for r in members) / n for k in keys}})
    overall = {"n": sum(b["n"] for b in benches), "n_benchmarks": len(benches),
               **{k: sum(b[k] for b in benches) / len(benches) for k in keys},
               "definition": "unweighted mean over benchmarks of each benchmark's accuracy (RM-NLHF Table 2 Overall)"}
    return {"benchmarks": benches, "overall": overall}


def print_selection(sel):
    """The benchmarks chosen and, grouped by reason, those left out (stdout); notes and warnings
    (stderr), one line each."""
    def named(n):
        return f"{BENCHMARK_REGISTRY[n]['title']} ({BENCHMARK_REGISTRY[n]['release']})"
    how = (f"default: every one we can read that was {sel['rule']}, RM-NLHF App. G.1" if sel["mode"] == "default"
           else "as asked by --benchmarks / files")
    print(f"benchmarks ({how}): {', '.join([named(n) for n in sel['chosen']] + sel['files'])}")
    for why in dict.fromkeys(sel["left_out"].values()):
        print(f"  left out, {why}: {', '.join(named(n) for n, w in sel['left_out'].items() if w == why)}")
    for line in sel["notes"] + sel["warnings"]:
        print(line, file=sys.stderr)


def cmd_pairwise(a):
    sources = parse_sources(a.source)
    names = [s.strip() for s in a.benchmarks.split(",") if s.strip()] if a.benchmarks is not None else None
    if names == []:
        raise SystemExit("--benchmarks: no names given")
    sel = select_benchmarks(names, a.files, a.base_release, sources)
    print_selection(sel)
    units = [u for name in sel["chosen"] for u in benchmark_units(name, a.data_root, sources)]
    for f in a.files:
        bench, sub = benchmark_name(f)
        units.append({"name": None, "benchmark": bench, "file": sub, "path": f, "schema": "auto",
                      "split": "train", "config": None, "hub": False})
    data = []  # fail on bad input (and on an unreachable hub) before loading a model
    for u in units:
        try:
            data.append((u, load_benchmark(u["path"], a.n, a.seed, schema=u["schema"], split=u["split"],
                                           config_name=u["config"])))
        except SystemExit as e:
            if not u["hub"]:
                raise
            raise SystemExit(f"{e.code} [benchmark {u['name']}; offline? --source {u['name']}=PATH reads a local copy]")
    model, tok = rollout.load_model(a.model, a.dtype)
    judge = make_grm_judge(model, tok, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                           chat=parse_chat(a, a.model), max_prompt_tokens=a.max_prompt_tokens or None,
                           style=a.grm_prompt)
    rows, all_records = [], []
    for u, items in data:
        summary, records = score_unit(items, judge)
        rows.append({"benchmark": u["benchmark"], "file": u["file"], "path": u["path"], **summary})
        all_records += [{"benchmark": u["benchmark"], "file": u["file"], **r} for r in records]
        # long runs (JudgeBench prompts are ~2k tokens): show each file as it finishes
        print(f"{u['benchmark']}/{u['file']}: n={summary['n']} acc={summary['acc']:.3f} "
              f"format_fail={summary['format_fail']:.3f}", flush=True)
    groups = aggregate_pairwise(rows)
    releases = {b["title"]: b["release"] for b in BENCHMARK_REGISTRY.values()}
    for b in groups["benchmarks"]:
        b["release"] = releases.get(b["benchmark"])
    paper = [b["title"] for b in BENCHMARK_REGISTRY.values() if b["paper"] == "used"]
    groups["overall"]["paper_benchmarks"] = [t for t in paper if t in {b["benchmark"] for b in groups["benchmarks"]}]
    result = {"model": a.model, "seed": a.seed, "n_per_file": a.n, "max_new_tokens": a.max_new_tokens,
              "max_prompt_tokens": a.max_prompt_tokens, "grm_prompt": a.grm_prompt, "base_release": a.base_release,
              "selection": sel, "files": rows, "benchmarks": groups["benchmarks"], "overall": groups["overall"]}
    write_results(a.out, "pairwise", result, all_records)
    cols = ["file", "n", "acc_ab", "acc_ba", "acc", "format_fail", "pick_a"]
    print_table([{**r, "file": f"{r['benchmark']}/{r['file']}"} for r in rows], cols,
                title=f"pairwise accuracy: {a.model} (--grm-prompt {a.grm_prompt})")
    for r in rows:
        if "subsets" in r:
            print()
            print_table([{**s, "file": name} for name, s in r["subsets"].items()], cols[:-2],
                        title=f"{r['benchmark']}/{r['file']}: {r['scoring']}; n = rows")
    print()
    k = groups["overall"]["n_benchmarks"]
    print_table([{**r, "file": r["benchmark"]} for r in groups["benchmarks"]] +
                [{**groups["overall"], "file": f"Overall (mean of {k})", "release": None}], ["file", "release"] + cols[1:-1])
    m = len(groups["overall"]["paper_benchmarks"])
    print(f"Overall = unweighted mean of the {k} benchmarks' acc, as RM-NLHF Table 2's Overall column, which "
          f"averages the paper's 7 benchmarks; {m} of those 7 are here" + (" (so not comparable)." if m < 7 else "."))
    return result


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


def load_or_sample(a, need):
    """Graded policy answers: read --samples (a `math` items file) or sample with --policy.
    Raises SystemExit when a problem has fewer than `need` samples."""
    if a.samples:
        items = read_jsonl(a.samples)[:a.n_problems]
        if any("samples" not in it or "question" not in it for it in items):
            raise SystemExit(f"{a.samples}: not a `evaluate.py math` items file (needs 'question' and "
                             f"'samples'); fields found: {sorted(items[0])}")
    elif a.policy:
        problems = load_math_problems(a.data, a.n_problems)
        model, tok = rollout.load_model(a.policy, a.dtype)
        items = sample_and_grade(model, tok, problems, n_samples=need, temperature=a.temperature,
                                 max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size, greedy=False)
        del model
    else:
        raise SystemExit("give --samples FILE (from `evaluate.py math`) or --policy MODEL")
    have = min(len(it["samples"]) for it in items)
    if have < need:
        raise SystemExit(f"N={need} is larger than the samples available ({have} per problem"
                         f"{' in ' + a.samples if a.samples else ''}); lower --ns or sample more")
    return items


def cmd_bon(a):
    try:
        ns = sorted(int(x) for x in a.ns.split(","))
    except ValueError:
        ns = [0]
    if ns[0] < 1:
        raise SystemExit(f"--ns must be comma-separated positive integers, got {a.ns!r}")
    bad = set(a.methods.split(",")) - {"knockout", "double_elimination"}
    if bad:
        raise SystemExit(f"--methods: unknown {sorted(bad)}; allowed: knockout, double_elimination")
    items = load_or_sample(a, ns[-1])
    model, tok = rollout.load_model(a.judge, a.dtype)
    judge = make_grm_judge(model, tok, max_new_tokens=a.judge_max_new_tokens, batch_size=a.batch_size,
                           chat=parse_chat(a, a.judge), style=a.grm_prompt)
    rng = random.Random(a.seed)
    rows, records = [], []
    for n in ns:
        row = {"N": n, "mean_sample_acc": sum(sum(s["correct"] for s in it["samples"][:n]) / n for it in items) / len(items),
               "oracle_pass_at_n": sum(any(s["correct"] for s in it["samples"][:n]) for it in items) / len(items),
               "majority_acc": sum(bool(it["samples"][majority_vote(it["samples"][:n])]["correct"]) for it in items) / len(items)}
        for method in a.methods.split(","):
            res = [best_of_n(it, n, judge, method=method, rng=rng) for it in items]
            row[f"{method}_acc"] = sum(r["correct"] for r in res) / len(items)
            row[f"{method}_calls"] = sum(r["calls"] for r in res)
            row[f"{method}_invalid"] = sum(r["invalid"] for r in res)
            records += [{"id": it["id"], "N": n, "method": method, **r} for it, r in zip(items, res)]
        rows.append(row)
    result = {"judge": a.judge, "grm_prompt": a.grm_prompt, "samples": a.samples or a.policy,
              "n_problems": len(items), "seed": a.seed, "methods": a.methods.split(","), "rows": rows}
    write_results(a.out, "bon", result, records)
    cols = ["N", "mean_sample_acc", "majority_acc", "oracle_pass_at_n"]
    for m in a.methods.split(","):
        cols += [f"{m}_acc", f"{m}_calls", f"{m}_invalid"]
    print_table(rows, cols, title=f"Best-of-N on {len(items)} problems, judge {a.judge} (--grm-prompt {a.grm_prompt})")
    return result


# ----------------------------------------------------------------------------------------------
# Metrics: mean ± std, AUROC, reliability, EMA


def mean_std(xs):
    """(mean, population std) of a non-empty list of numbers; std of one value is 0."""
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


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
        (rows, ece): rows = list of {"bin": "[lo,hi)", "n", "mean_p", "frac_correct"} for
        non-empty bins; ece = sum_b n_b/n * |frac_correct_b - mean_p_b| (expected calibration error).
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


def ema(values, alpha=0.9):
    """Exponential moving average as in the papers' plots: e_0 = v_0, e_t = alpha*e_{t-1} + (1-alpha)*v_t.
    Starting at v_0 (not 0) avoids the bias toward 0 at the start without a debias term."""
    out = []
    for v in values:
        out.append(v if not out else alpha * out[-1] + (1 - alpha) * v)
    return out


# ----------------------------------------------------------------------------------------------
# Evaluator check (RLME Eq. 2; docs/method.md §4.2, §6): does P(target | meta-question) separate right from wrong?


def evaluator_logprobs(model, tok, problems, solutions, question, target="Yes", chat="auto", batch_size=8,
                       template=None):
    """log p(target | evaluator prompt) for each (problem, solution), via the training reward's
    own scorer (reward.rlme_reward with one evaluator and one meta-question, weights 1), so the
    check measures exactly the signal RLME would train on (RLME Eq. 2-3; docs/method.md §4.2).

    Args:
        problems, solutions: list[str] of equal length. question, target: the meta-question and
            its target answer a_k. template: evaluator template (default: reward's).
    Returns:
        list[float], log p(target) per solution (<= 0).
    """
    ev = reward.local_evaluator(model, tok, chat=chat_format(tok, chat), name="evaluator",
                                micro_batch_size=batch_size, score=fast.score_targets)
    mq = {"question": question, "target": target, "weight": 1.0}
    out = reward.rlme_reward([ev], [mq], problems, solutions, template=template or reward.DEFAULT_EVALUATOR_TEMPLATE)
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


def cmd_evaluator_check(a):
    items = load_or_sample(a, a.n_samples if not a.samples else 0)
    # every graded answer of the file is labelled data: the greedy one (when present) and the samples
    answers = [(it, s) for it in items for s in ([it["greedy"]] if it.get("greedy") else []) + it["samples"]]
    if not answers:
        raise SystemExit(f"{a.samples or a.policy}: no graded answers to check")
    model, tok = rollout.load_model(a.evaluator, a.dtype)
    chat = parse_chat(a, a.evaluator)
    lps = evaluator_logprobs(model, tok, [it["question"] for it, _ in answers], [s["completion"] for _, s in answers],
                             question=a.question, target=a.target, chat=chat, batch_size=a.batch_size)
    labels = [bool(s["correct"]) for _, s in answers]
    probs = [math.exp(x) for x in lps]
    table, ece = reliability_table(probs, labels, a.bins)
    right = [x for x, y in zip(lps, labels) if y]
    wrong = [x for x, y in zip(lps, labels) if not y]
    # canaries: the same problems, answered with non-solutions / a known-wrong boxed answer
    # (and the reference solution as the positive control, when the items carry it)
    can_items = items[:a.n_canary]
    texts = {name: [t] * len(can_items) for name, t in CANARIES.items()}
    texts["known_wrong"] = [reference_solution(it, known_wrong_answer(it["label"])) or
                            f"The answer is \\boxed{{{known_wrong_answer(it['label'])}}}." for it in can_items]
    if all(reference_solution(it) for it in can_items):
        texts["reference"] = [reference_solution(it) for it in can_items]
    shown = dict(CANARIES, known_wrong="the dataset's solution with a wrong final answer (label+1)",
                 reference="the dataset's solution")
    canary_rows = []
    per_name = {name: evaluator_logprobs(model, tok, [it["question"] for it in can_items], sols, question=a.question,
                                         target=a.target, chat=chat, batch_size=a.batch_size)
                for name, sols in texts.items()}
    for name, vals in per_name.items():
        beats = sum(v > w for v, w in zip(vals, per_name["known_wrong"])) / len(vals)
        canary_rows.append({"answer": name, "text": shown[name],
                            "mean_p": sum(math.exp(v) for v in vals) / len(vals), "mean_logp": sum(vals) / len(vals),
                            "beats_known_wrong": None if name == "known_wrong" else beats})
    summary = {"evaluator": a.evaluator, "question": a.question, "target": a.target,
               "samples": a.samples or a.policy, "n_problems": len(items), "n_answers": len(answers),
               "n_correct": len(right), "auroc": auroc(lps, labels),
               "mean_logp_correct": sum(right) / len(right) if right else None,
               "mean_logp_incorrect": sum(wrong) / len(wrong) if wrong else None,
               "ece": ece, "reliability": table, "canaries": canary_rows, "n_canary_problems": len(can_items),
               # reference vs the same reasoning with a wrong final answer: labelled pairs that need
               # no policy skill (a weak policy may have no correct sample, leaving AUROC undefined)
               "control_auroc": auroc(per_name["reference"] + per_name["known_wrong"],
                                      [True] * len(can_items) + [False] * len(can_items))
               if "reference" in per_name else None}
    records = [{"id": it["id"], "correct": y, "logp": x, "p": math.exp(x), "pred": s.get("pred")}
               for (it, s), x, y in zip(answers, lps, labels)]
    write_results(a.out, "evaluator_check", summary, records)
    print(f"evaluator check: {a.evaluator}, question {a.question!r}, target {a.target!r}")
    print_table([summary], ["n_answers", "n_correct", "auroc", "mean_logp_correct", "mean_logp_incorrect", "ece",
                            "control_auroc"])
    print()
    print_table(table, ["bin", "n", "mean_p", "frac_correct"], title="reliability (P(target) bins)")
    print()
    print_table(canary_rows, ["answer", "mean_p", "mean_logp", "beats_known_wrong"],
                title=f"canaries on {len(can_items)} problems (beats_known_wrong = share with P above the known-wrong answer)")
    return summary


# ----------------------------------------------------------------------------------------------
# Judge check (RM-NLHF §2.3, Table 1; App. E): does the critique judge agree with human labels?

JUDGE_CHECK_FIELDS = ("context", "response_a", "response_b", "human_critique", "critique", "label")


def load_judge_check_items(path):
    """Annotated GRM critiques, one JSON object per line with the fields JUDGE_CHECK_FIELDS:
    the pair (context, response_a, response_b), the human critique h, the GRM critique ĉ and label
    z (1 = the critique is correct, 0 = it is not; RM-NLHF App. E's annotation). Returns the list
    of dicts (an "id" added where missing). SystemExit (one line naming the file, line and field)
    on a missing field or a label other than 0/1."""
    items = read_jsonl(path)
    if not items:
        raise SystemExit(f"{path}: no items")
    for n, it in enumerate(items, 1):
        for f in JUDGE_CHECK_FIELDS:
            if f not in it:
                raise SystemExit(f"{path} line {n}: missing field {f!r} (needs {', '.join(JUDGE_CHECK_FIELDS)})")
        if it["label"] not in (0, 1) or isinstance(it["label"], bool):
            raise SystemExit(f"{path} line {n}: field 'label' must be 0 or 1, got {it['label']!r}")
        it.setdefault("id", f"line{n}")
    return items


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
        out[f"acc_{metric}"] = (sum((r[metric] > threshold) == bool(r["label"]) for r in ok) / len(ok)) if ok else None
    return out


def cmd_judge_check(a):
    import config
    items = load_judge_check_items(a.data)
    settings = config.load_config([a.config] if a.config else [])["judge"]
    for key in ("backend", "variant", "base_url", "model", "api_key_env", "max_tokens", "max_retries"):
        if getattr(a, key) is not None:  # a flag given on the command line wins over the config
            settings[key] = getattr(a, key)
    judge = reward.make_judge(settings)
    results = reward.judge_scores(judge, [(it["human_critique"], it["critique"], it) for it in items])
    rows = [dict(id=it["id"], label=it["label"], **res) for it, res in zip(items, results)]
    summary = dict(judge_check_summary(rows, a.threshold), data=a.data, threshold=a.threshold,
                   backend=settings["backend"], variant=settings["variant"], model=settings["model"])
    write_results(a.out, "judge_check", summary, rows)
    print(f"judge check: {settings['variant']} judge {settings['model'] or settings['backend']} on {a.data}")
    print_table([summary], ["n", "n_failed", "acc_f1", "acc_recall", "acc_precision"])
    return summary


# ----------------------------------------------------------------------------------------------
# Plots (RLME §4.1's figures: EMA 0.9, several runs with a ±1 std band; docs/method.md §6)


def parse_curve(spec):
    """'label=a.jsonl,b.jsonl' or 'a.jsonl' -> (label, [paths]); runs in one spec are averaged."""
    label, sep, paths = spec.partition("=")
    if not sep:
        label, paths = os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec, spec
    return label, [p for p in paths.split(",") if p]


def run_series(rows, key, path):
    """(steps, values) of metric `key` in metrics rows, skipping rows without a finite value.
    x = row['step'] when present, else the row index. Raises SystemExit when the key never appears."""
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r.get("step", i))
            ys.append(float(v))
    if not xs:
        keys = sorted({k for r in rows for k in r})
        raise SystemExit(f"{path}: no numeric values for metric {key!r}; keys found: {keys}")
    return xs, ys


def curve(paths, key, alpha=0.9):
    """EMA-smoothed mean and population std across runs of metric `key`, on the steps all runs share.
    Returns {"x": [...], "mean": [...], "std": [...], "runs": n}."""
    smoothed = []
    for p in paths:
        xs, ys = run_series(read_jsonl(p), key, p)
        smoothed.append(dict(zip(xs, ema(ys, alpha))))
    common = sorted(set.intersection(*(set(s) for s in smoothed)))
    if not common:
        raise SystemExit(f"runs {paths} share no steps with metric {key!r}")
    stats = [mean_std([s[x] for s in smoothed]) for x in common]
    return {"x": common, "mean": [m for m, _ in stats], "std": [s for _, s in stats], "runs": len(paths)}


def cmd_plot(a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    specs = [parse_curve(s) for s in a.runs]
    keys = a.keys.split(",")
    curves = {label: {k: curve(paths, k, a.ema) for k in keys} for label, paths in specs}
    os.makedirs(a.out, exist_ok=True)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for label, cs in curves.items():
            c = cs[k]
            ax.plot(c["x"], c["mean"], label=f"{label} (n={c['runs']})")
            ax.fill_between(c["x"], [m - s for m, s in zip(c["mean"], c["std"])],
                            [m + s for m, s in zip(c["mean"], c["std"])], alpha=0.25)
        ax.set_title(f"{k} (EMA {a.ema})")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    files = [os.path.join(a.out, "curves.png")]
    fig.savefig(files[0], dpi=120)
    plt.close(fig)
    # reward and accuracy on twin axes: reward rising while accuracy falls = reward hacking
    if a.reward_key and a.acc_key:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        ax2 = ax.twinx()
        for n, (label, paths) in enumerate(specs):
            color = f"C{n}"
            r, acc = curve(paths, a.reward_key, a.ema), curve(paths, a.acc_key, a.ema)
            ax.plot(r["x"], r["mean"], color=color, label=f"{label} {a.reward_key}")
            ax2.plot(acc["x"], acc["mean"], color=color, linestyle="--", label=f"{label} {a.acc_key}")
        ax.set_xlabel("step")
        ax.set_ylabel(f"{a.reward_key} (solid)")
        ax2.set_ylabel(f"{a.acc_key} (dashed)")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")
        ax.set_title(f"reward vs accuracy (EMA {a.ema})")
        fig.tight_layout()
        files.append(os.path.join(a.out, "reward_vs_accuracy.png"))
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    rows = [{"curve": label, "metric": k, "runs": c["runs"], "steps": len(c["x"]), "first": c["mean"][0],
             "last": c["mean"][-1], "last_std": c["std"][-1]} for label, cs in curves.items() for k, c in cs.items()]
    write_results(a.out, "plot", {"ema": a.ema, "files": files, "table": rows, "curves": curves})
    print_table(rows, ["curve", "metric", "runs", "steps", "first", "last", "last_std"], title=f"EMA {a.ema} curves")
    print("wrote " + ", ".join(files))
    return rows


# ==============================================================================================
# PLUMBING: skip on first read (file reading and naming, result files, text tables, the command line)
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# Files and tables


def read_jsonl(path):
    """The rows of a JSONL file (rollout.read_jsonl: one-line errors naming the line).

    Raises:
        SystemExit: the file is missing, empty, or a line is not a JSON object.
    """
    rows = [row for _, row in rollout.read_jsonl(path)]
    if not rows:
        raise SystemExit(f"{path}: file is empty")
    return rows


def looks_like_hub_id(path):
    """'owner/name' (one slash, not a relative or absolute path) -> True."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def load_rows(path, split="test", hub_config=None, flag="--data"):
    """The rows of a local JSONL file, or of a hub dataset split read with `datasets`.

    A path that is a file, or does not look like 'owner/name', is read as JSONL (read_jsonl's
    one-line errors). Returns list[dict].
    Raises:
        SystemExit (one line naming `flag` and the id): the hub dataset could not be loaded (no
            network, no such id or split), with the way out: a local JSONL copy.
    """
    if os.path.isfile(path) or not looks_like_hub_id(path):
        return read_jsonl(path)
    import datasets  # here, not at the top: slow to import and only hub ids need it
    try:
        rows = list(datasets.load_dataset(path, hub_config, split=split))
    except Exception as e:  # no hub access, or no such dataset: one line, not a traceback
        raise SystemExit(f"{flag} {path}: no such file, and it could not be loaded as a hub dataset "
                         f"({type(e).__name__}; split {split!r}); offline? pass a local JSONL copy: {flag} FILE.jsonl")
    if not rows:
        raise SystemExit(f"{flag} {path}: split {split!r} is empty")
    return rows


def write_results(out_dir, name, summary, items=None):
    """Write `<out_dir>/<name>.json` (summary) and `<out_dir>/<name>.items.jsonl` (per item)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if items is not None:
        with open(os.path.join(out_dir, f"{name}.items.jsonl"), "w") as f:
            for it in items:
                f.write(json.dumps(it) + "\n")


def benchmark_name(path):
    """(benchmark title, file tag) of an explicitly passed file: its folder's registry title
    (BENCHMARKS) or the folder name, and the file name without extension."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return BENCHMARKS.get(folder, folder), os.path.splitext(os.path.basename(path))[0]


def data_name(path):
    """'../shared/data/gsm8k/test.jsonl' -> 'gsm8k-test'; a hub id 'openai/gsm8k' -> 'gsm8k'."""
    if os.path.isfile(path):
        return f"{os.path.basename(os.path.dirname(os.path.abspath(path)))}-{os.path.splitext(os.path.basename(path))[0]}"
    return path.rstrip("/").split("/")[-1]


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def print_table(rows, cols, title=None):
    """Print list-of-dicts `rows` as an aligned text table with columns `cols`."""
    cells = [[c for c in cols]] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    if title:
        print(title)
    for k, row in enumerate(cells):
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


# ----------------------------------------------------------------------------------------------
# CLI


def template_fields(template):
    """The placeholder names of a prompt template ({question} -> "question"; '{{' is a brace).
    Raises SystemExit (one line) when it is not a valid format string."""
    import string
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise SystemExit(f"the prompt template is not a valid format string ({e}); write a literal brace as {{{{ or }}}}")


def prompt_template(a, default=PROMPT_TEMPLATE, allowed=("question", "answer"), required=("question",)):
    """--prompt-template, else data.prompt_template of --config, else `default`.

    Args: a: the parsed flags (prompt_template, config). allowed / required: placeholder names.
    Returns: str. Raises: SystemExit (one line) for a missing --config file or key, a required
    placeholder missing, or one not allowed here ({context} belongs to `qa`, {answer} to `math`).
    """
    template = a.prompt_template
    if template is None and a.config:
        import yaml
        if not os.path.isfile(a.config):
            raise SystemExit(f"--config {a.config}: no such file")
        with open(a.config) as f:
            template = ((yaml.safe_load(f) or {}).get("data") or {}).get("prompt_template")
        if template is None:
            raise SystemExit(f"--config {a.config}: no data.prompt_template key")
    template = template or default
    fields = template_fields(template)
    for name in required:
        if name not in fields:
            raise SystemExit(f"the prompt template must contain {{{name}}}")
    unknown = sorted(fields - set(allowed))
    if unknown:
        raise SystemExit(f"the prompt template has placeholder(s) {unknown} this subcommand cannot fill; "
                         f"allowed: {', '.join('{' + n + '}' for n in allowed)}")
    return template


def parse_chat(a, model_path):
    """The prompt format from the common flags (--chat-template, --system-prompt,
    --chat-template-kwargs) as the dict chat_format reads; model_path for "auto"'s base-model rule."""
    return {"setting": {"auto": "auto", "true": True, "false": False}[a.chat_template], "model_path": model_path,
            "system": a.system_prompt, "kwargs": rollout.parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")}


def chat_format(tok, chat):
    """rollout.use_chat_template for a `chat` argument that is a setting ("auto" | True | False)
    or parse_chat's dict: False (plain text) or the chat options."""
    c = chat if isinstance(chat, dict) else {"setting": chat}
    return rollout.use_chat_template(tok, c["setting"], model_path=c.get("model_path"), system=c.get("system"),
                                     template_kwargs=c.get("kwargs"), key=None)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, except where there is none to show (required options,
    None, False of a store_true flag)."""

    def _get_help_string(self, action):
        if action.required or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser():
    ap = rollout.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def subcommand(name, help):
        return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    def common(p, model_flags=True):
        p.add_argument("--out", default="eval_out", help="results folder (JSON summary + JSONL items)")
        if model_flags:
            p.add_argument("--dtype", default="float32", choices=list(rollout.DTYPES), help="compute dtype of the models")
            p.add_argument("--batch-size", type=int, default=8, help="rows per generate/forward call")
            p.add_argument("--chat-template", default="auto", choices=["auto", "true", "false"],
                           help="auto = use the tokenizer's chat template when it has one, plain text for a '-Base' model")
            p.add_argument("--system-prompt", default=None, help="system message before each prompt (chat template only)")
            p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                           help='extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
            p.add_argument("--seed", type=int, default=0, help="random seed (sampling, A/B orders, subsets)")

    def sampling(p, n_problems, n_samples=None):
        p.add_argument("--data", default=os.path.join(SHARED_DATA, "gsm8k", "test.jsonl"),
                       help="GSM8K/MATH JSONL file or hub id")
        p.add_argument("--n-problems", type=int, default=n_problems, help="first N problems (0 = all)")
        if n_samples is not None:
            p.add_argument("--n-samples", type=int, default=n_samples, help="sampled answers per problem")
        p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the sampled answers")
        p.add_argument("--max-new-tokens", type=int, default=512, help="longest answer, in tokens")

    def answers(p):  # the graded answers that bon and evaluator-check score (load_or_sample)
        p.add_argument("--samples", default=None, help="items JSONL from `evaluate.py math` (else --policy samples)")
        p.add_argument("--policy", default=None, help="policy model to sample answers from")

    p = subcommand("math", "GSM8K / MATH-500 accuracy: greedy and sampled pass@1")
    common(p)
    sampling(p, 100, 4)
    p.add_argument("--model", required=True, help="checkpoint folder, hub id or gguf:<pkg>/<file>")
    p.add_argument("--split", default="test", help="split for a hub id")
    p.add_argument("--hub-config", default=None, help="dataset config for a hub id (openai/gsm8k: main)")
    p.add_argument("--prompt-template", default=None,
                   help="format string with {question} (default: --config's data.prompt_template, else PROMPT_TEMPLATE)")
    p.add_argument("--config", default=None, help="a run's config.yaml: take data.prompt_template from it")
    p.add_argument("--inject", default=None, choices=list(INJECT_CHOICES),
                   help="what a template's {answer} shows (NoCheat, RLME §4 Fig. 7): wrong = a seeded wrong answer "
                        "(wrong_answer), graded against the true label = counterfactual accuracy; reference = the "
                        "true answer; required when the template has {answer}, else only none")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    p.add_argument("--name", default=None, help="results file tag (default: from --data, plus _inject-<kind>)")
    p.set_defaults(fn=cmd_math)

    p = subcommand("qa", "context QA: exact match and token F1 of the boxed answer (RLME Tables 1-2; FaithEval)")
    common(p)
    p.add_argument("--model", required=True, help="checkpoint folder, hub id or gguf:<pkg>/<file>")
    p.add_argument("--data", default=None, help="QA JSONL file or hub id (default: --preset's hub id)")
    p.add_argument("--preset", default=None, choices=list(QA_PRESETS),
                   help="a known set's hub id, split and fields (faitheval: Salesforce/FaithEval-counterfactual-v1.0, "
                        "test, multiple choice); flags given win, --data FILE reads a local copy")
    p.add_argument("--split", default=None, help=f"split for a hub id (default: {QA_DEFAULTS['split']})")
    p.add_argument("--hub-config", default=None, help="dataset config for a hub id")
    p.add_argument("--question-field", default=None, help=f"default: {QA_DEFAULTS['question_field']}")
    p.add_argument("--context-field", default=None, help=f"str, list of str or [title, sentence, ...] passages "
                                                         f"(default: {QA_DEFAULTS['context_field']})")
    p.add_argument("--answer-field", default=None, help=f"gold: str, list of str or {{'text': [...]}}; with "
                                                        f"--choices-field the answer key (default: "
                                                        f"{QA_DEFAULTS['answer_field']})")
    p.add_argument("--choices-field", default=None,
                   help="multiple choice: options {'label': [...], 'text': [...]} or a list; the gold option's text "
                        "or its letter counts as right")
    p.add_argument("--context-max-chars", type=int, default=4000, help="contexts cut to this many characters "
                                                                       "(RLME §4); 0 = no cut")
    p.add_argument("--n-problems", type=int, default=0, help="first N rows (0 = all)")
    p.add_argument("--n-samples", type=int, default=0, help="sampled answers per question, next to the greedy one")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the sampled answers")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest answer, in tokens")
    p.add_argument("--prompt-template", default=None,
                   help="format string with {context} and {question} (default: --config's data.prompt_template, "
                        "else QA_PROMPT_TEMPLATE, configs/paper/rlme/qa_rlvr.yaml's)")
    p.add_argument("--config", default=None, help="a run's config.yaml: take data.prompt_template from it")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    p.add_argument("--name", default=None, help="results file tag (default: from --data)")
    p.set_defaults(fn=cmd_qa)

    p = subcommand("pairwise", "pairwise GRM accuracy per benchmark, both A/B orders")
    common(p)
    p.add_argument("files", nargs="*", help="pairwise JSONL files, named by their folder (default: the registry "
                                            "benchmarks that pass the contamination rule)")
    p.add_argument("--model", required=True, help="the generative reward model")
    p.add_argument("--benchmarks", default=None,
                   help=f"comma-separated registry names, evaluated even when too old (a warning says so); "
                        f"known: {', '.join(BENCHMARK_REGISTRY)}")
    p.add_argument("--base-release", default=DEFAULT_BASE_RELEASE,
                   help="YYYY-MM release of the GRM's base model: the default set is the benchmarks released "
                        "one month before it or later (RM-NLHF App. G.1)")
    p.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                   help="read registry benchmark NAME from a local file or folder instead of its hub id / "
                        "folder (e.g. a downloaded HelpSteer3 split); repeatable")
    p.add_argument("--grm-prompt", default="ours", choices=list(reward.GRM_PROMPT_STYLES),
                   help="GRM prompt and output parser: ours, or authors (the RM-NLHF release's, to score a "
                        "released checkpoint in its own format)")
    p.add_argument("--n", type=int, default=50, help="a seeded random subset of N items per file (0 = all); "
                                                    "RewardBench 2: N rows of 3 pairs each")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest GRM output (critique + choice), in tokens")
    p.add_argument("--data-root", default=SHARED_DATA, help="folder holding the registry's local benchmark folders")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="skip longer GRM prompts, counted as format failures (why='prompt too long'); "
                        "0 = model context - max new tokens")
    p.set_defaults(fn=cmd_pairwise)

    p = subcommand("bon", "Best-of-N: knockout / double-elimination tournaments judged by a GRM")
    common(p)
    sampling(p, 50)
    p.add_argument("--judge", required=True, help="the generative reward model")
    answers(p)
    p.add_argument("--ns", default="1,2,4,8", help="comma-separated N values")
    p.add_argument("--methods", default="knockout,double_elimination", help="comma-separated tournament kinds")
    p.add_argument("--judge-max-new-tokens", type=int, default=256, help="longest GRM output per match, in tokens")
    p.add_argument("--grm-prompt", default="ours", choices=list(reward.GRM_PROMPT_STYLES),
                   help="GRM prompt and output parser of the judge: ours, or authors (the RM-NLHF release's)")
    p.set_defaults(fn=cmd_bon)

    p = subcommand("evaluator-check", "AUROC / calibration of P(target) for a meta-question")
    common(p)
    sampling(p, 50, 4)
    p.add_argument("--evaluator", required=True, help="evaluator model")
    answers(p)
    p.add_argument("--question", default="Is the answer correct?", help="the meta-question q_k")
    p.add_argument("--target", default="Yes", help="its target answer a_k")
    p.add_argument("--bins", type=int, default=10, help="equal-width probability bins of the reliability table")
    p.add_argument("--n-canary", type=int, default=16, help="problems the canary answers are scored on")
    p.set_defaults(fn=cmd_evaluator_check)

    p = subcommand("judge-check", "critique judge vs human 0/1 labels: accuracy of S > threshold (RM-NLHF Table 1)")
    common(p, model_flags=False)
    p.add_argument("--data", required=True, help="annotated JSONL: context, response_a, response_b, "
                                                 "human_critique, critique, label (1 = the critique is correct)")
    p.add_argument("--config", default=None, help="a config (e.g. a run's config.yaml) whose judge: section to use "
                                                  "(default: config.yaml's)")
    p.add_argument("--backend", default=None, choices=["openai", "proxy"], help="judge.backend")
    p.add_argument("--variant", default=None, choices=list(reward.JUDGE_VARIANTS), help="judge.variant")
    p.add_argument("--base-url", default=None, help="judge.base_url of an OpenAI-compatible server")
    p.add_argument("--model", default=None, help="judge.model: the name the server serves")
    p.add_argument("--api-key-env", default=None, help="judge.api_key_env: the NAME of the variable with the key")
    p.add_argument("--max-tokens", type=int, default=None, help="judge.max_tokens")
    p.add_argument("--max-retries", type=int, default=None, help="judge.max_retries")
    p.add_argument("--threshold", type=float, default=0.5, help="S > threshold counts as 'correct' (Eq. 4)")
    p.set_defaults(fn=cmd_judge_check)

    p = subcommand("plot", "learning curves (EMA, ±1 std across runs) and reward vs accuracy")
    common(p, model_flags=False)
    p.add_argument("runs", nargs="+", help="[LABEL=]metrics.jsonl[,metrics.jsonl...]: one curve each, "
                                           "several files = several runs averaged")
    p.add_argument("--keys", default="reward/mean,accuracy", help="comma-separated metric keys")
    p.add_argument("--ema", type=float, default=0.9, help="EMA weight of the previous value")
    p.add_argument("--reward-key", default="reward/mean", help="metric on the left axis of reward_vs_accuracy.png")
    p.add_argument("--acc-key", default="accuracy", help="metric on the right axis of reward_vs_accuracy.png")
    p.set_defaults(fn=cmd_plot)
    return ap


def main(argv=None):
    a = build_parser().parse_args(argv)
    for k in ("n_problems", "n"):
        if getattr(a, k, None) is not None and getattr(a, k) < 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be >= 0")
    if getattr(a, "n_problems", None) == 0:
        a.n_problems = None
    if hasattr(a, "chat_template_kwargs"):  # a bad JSON object: one line before any model loads
        rollout.parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")
    if hasattr(a, "seed"):
        torch.manual_seed(a.seed)
    return a.fn(a)


if __name__ == "__main__":
    main()
