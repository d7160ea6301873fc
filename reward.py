"""Rewards: RLVR, the RLME meta-evaluation reward, and the RM-NLHF rewards with their critique judge.

What is computed (docs/method.md §4.2-4.3 and §5.1-5.3 say the same in prose):

* RLVR, the RLME paper's baseline (RLME §4.1): r = 1 if the last \\boxed{} answer equals the
  GSM8K label as a number, else 0. For string answers (open-domain QA, RLME §4 Tables 1-2) the
  box is scored against the gold answers by SQuAD's normalised exact match or token F1
  (answer_reward).
* RLME (RLME §3.1): evaluator j's teacher-forced probability of the whole target string a_k
  (e.g. "Yes") for meta-question q_k, p_{j,k} = pi_phi_j(a_k | x, y, q_k) (Eq. 2), and the reward
  r(x, y) = sum_j v_j sum_k w_k log p_{j,k} <= 0 (Eq. 3). Optional and off by default (not the
  paper's reward): renormalise over {target, negative}, log p(a_k) - log(p(a_k) + p(neg_k)); sum
  p_{j,k} instead of log p_{j,k} (transform "prob"); add an RLVR part (hybrid_reward).
* RM-NLHF (RM-NLHF §3.1-3.2): the GRM writes a critique c and a verdict. On D_H (items with a
  human critique h): R_process = 1 if S(h, c) >= threshold else 0 (Eq. 4; see process_reward) and
  R = -1 invalid format, 0 wrong verdict, 1 + lam * R_process right verdict (Eq. 5, outcome
  regularisation: the judge is only asked about right verdicts). On D_O (no human critique):
  R' = -1 / 0 / 1 + clip(max(0, R_hat - 1), 0, lam) (Eq. 8), with R_hat the MetaRM's prediction
  of R (Eq. 6, metarm.py).
* S(h, c), the critique similarity (RM-NLHF §2.3 "Similarity w/ Core HC", App. E): F1 of the
  core arguments the two critiques share, decided by an LLM judge behind any OpenAI-compatible
  server; proxy_f1 is an offline lexical stand-in for tests.

Every function works on plain strings, lists and tensors so a reader can recompute any logged
reward by hand from samples.jsonl. Sections: RLVR, RLME, the RLME reward outside our trainer (a
TRL reward function, a verl compute_score, load_evaluator), RM-NLHF, the judge; the pairwise data
loaders and the command line are plumbing at the end.

Run alone (JSONL rows with problem and completion in, the same rows with logp and reward out):
    python reward.py --evaluator PATH --in samples.jsonl --out scored.jsonl
"""
import collections
import concurrent.futures
import glob
import json
import math
import os
import random
import re
import string
import time

import torch

import rollout
from rollout import read_jsonl, token_logprobs


# ----------------------------------------------------------------------------------------------
# RLVR: answer extraction and the 0/1 reward (RLME §4.1; docs/method.md §4.3)


def extract_boxed(text):
    """Content of the LAST `\\boxed{...}` in `text`, braces matched (nested braces allowed).

    A naive regex stops at the first '}' and breaks on `\\boxed{\\frac{1}{2}}`. Also accepts
    `\\boxed 5` (a single token without braces) and `\\fbox{}`.

    Args:
        text: str, a completion.
    Returns:
        str, the stripped box content, or None when there is no (closed) box.
    """
    if not text:
        return None
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1:i].strip()
            continue  # unclosed box: try the one before it
        m = re.match(r"[^\s$]+", text[start:])  # '\boxed 5'
        if m:
            return m.group(0).strip()
    return None


def rlvr_reward(completion, label):
    """RLVR baseline reward (RLME §4.1; docs/method.md §4.3): 1.0 if the last boxed answer equals
    the cleaned label, else 0.0 (no box -> 0.0)."""
    return 1.0 if numeric_equal(extract_boxed(completion), label) else 0.0


def clean_gsm8k_label(answer):
    """GSM8K gold answer: the text after '####', with ',', '$' and spaces removed.
    '... #### 1,234' -> '1234'. Raises ValueError when there is no '####'."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####' line")
    return clean_number(answer.split("####")[-1])


def clean_number(s):
    """Strip the decorations a number may carry in a box or a label: ',', '$', spaces, a
    trailing '.', '%', and a wrapping \\text{...}."""
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    for junk in ("\\$", "$", ",", " ", "\\%", "%", "\\!"):
        s = s.replace(junk, "")
    return s.rstrip(".")


def to_number(s):
    """'42' -> 42, '3.50' -> 3.5, '1/2' or '\\frac{1}{2}' -> 0.5; None when not a number."""
    if s is None:
        return None
    s = clean_number(s)
    m = re.fullmatch(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}|(-?[\d.]+)/(-?[\d.]+)", s)
    try:
        if m:
            num, den = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            return float(num) / float(den)
        return int(s) if re.fullmatch(r"-?\d+", s) else float(s)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_equal(pred, label):
    """GSM8K answer equivalence: both parse as numbers and are equal (int, float fallback with a
    1e-6 relative tolerance). pred None (no box) -> False."""
    a, b = to_number(pred), to_number(label)
    if a is None or b is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# String answers (open-domain QA, RLME §4 Tables 1-2): the rule of the SQuAD v1.1 evaluation
# script, so our EM / F1 are comparable with published QA numbers. Our own code.
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(s):
    """SQuAD answer normalisation: lower case, drop ASCII punctuation, drop the articles a / an /
    the (whole words only), collapse white space.

    The steps run in that order, so a word joined by punctuation is joined for good:
    "The A-Team!" -> "ateam" (the hyphen goes first, then "ateam" is no article).

    Args:
        s: str.
    Returns:
        str, the normalised answer ("" when nothing is left).
    """
    s = s.lower().translate(_DROP_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _gold_list(golds):
    """golds as a non-empty list of str (a single str -> [str]); ValueError otherwise."""
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds or not all(isinstance(g, str) for g in golds):
        raise ValueError(f"gold answers must be a str or a non-empty list of str, got {golds!r}")
    return golds


def qa_exact_match(prediction, golds):
    """SQuAD exact match: EM = max_g 1[norm(prediction) == norm(g)]  (RLME §4 Tables 1-2).

    Args:
        prediction: str, or None (no answer extracted).
        golds: str or non-empty list of str, the accepted answers.
    Returns:
        float, 1.0 or 0.0 (prediction None -> 0.0).
    Raises:
        ValueError: golds empty or not str.
    """
    golds = _gold_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(g) for g in golds) else 0.0


def qa_f1(prediction, golds):
    """SQuAD token F1, the best over the gold answers (RLME §4 Tables 1-2):

        common = |P ∩ G| (multiset: a token counts min(#in P, #in G) times)
        precision = common / |P|,  recall = common / |G|,  F1 = 2 precision recall / (precision + recall)

    with P, G the tokens of the normalised prediction and gold (normalize_answer, split on
    white space). An empty side gives 0.0, unless both are empty: 1.0 (as SQuAD).

    Args:
        prediction: str, or None (no answer extracted).
        golds: str or non-empty list of str.
    Returns:
        float in [0, 1] (prediction None -> 0.0).
    Raises:
        ValueError: golds empty or not str.
    """
    golds = _gold_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    best = 0.0
    for g in golds:
        gold = normalize_answer(g).split()
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


LABEL_FORMATS = ("gsm8k", "plain", "text")
QA_METRICS = ("em", "f1")


def answer_reward(completion, label, label_format, qa_metric="em"):
    """RLVR reward for any label (RLME §4.1 for numbers; RLME §4 Tables 1-2 for string answers):

        gsm8k / plain: 1.0 if the last \\boxed{} answer equals the label as a number, else 0.0
                       (rlvr_reward; the label is already cleaned: clean_gsm8k_label / clean_number)
        text:          EM or F1 (qa_metric) of the last \\boxed{} content against the gold answers

    No box -> 0.0. Text labels are never passed through clean_number: it deletes spaces and
    commas, which are part of a string answer ("New York, USA").

    Args:
        completion: str, the policy's answer.
        label: str (gsm8k / plain); str or list of str (text).
        label_format: "gsm8k" | "plain" | "text" (config data.label_format).
        qa_metric: "em" (qa_exact_match) | "f1" (qa_f1); read for text labels only.
    Returns:
        float in [0, 1].
    Raises:
        ValueError: unknown label_format or qa_metric.
    """
    if label_format not in LABEL_FORMATS:
        raise ValueError(f"label_format {label_format!r}: expected one of {', '.join(LABEL_FORMATS)}")
    if qa_metric not in QA_METRICS:
        raise ValueError(f"qa_metric {qa_metric!r}: expected one of {', '.join(QA_METRICS)}")
    if label_format != "text":
        return rlvr_reward(completion, label)
    score = qa_exact_match if qa_metric == "em" else qa_f1
    return score(extract_boxed(completion), label)  # extract_boxed None (no box) -> 0.0


# ----------------------------------------------------------------------------------------------
# RLME meta-evaluation reward (RLME §3.1, Eq. 2-3; docs/method.md §4.2)

# The evaluator sees the problem, the solution between delimiters, the extracted answer, and
# then, once, the meta-question. {reference} is empty except for anchored items (sparse
# ground-truth anchoring, docs/method.md §4.2).
DEFAULT_EVALUATOR_TEMPLATE = (
    "Below is a math problem and a proposed solution.\n\n"
    "Problem:\n{problem}\n\n"
    "{reference}"
    "<<<BEGIN SOLUTION>>>\n{solution}\n<<<END SOLUTION>>>\n\n"
    "Final answer extracted from the solution: {extracted}\n\n"
    "Question about the solution above: {question}\n"
    "Reply with Yes or No."
)
REFERENCE_LINE = "Reference answer (from the answer key): {answer}\n\n"
SOLUTION_DELIMITERS = ("<<<BEGIN SOLUTION>>>", "<<<END SOLUTION>>>")

# Context QA (reading comprehension, RLME §4 Tables 1-2): {problem} is the rendered context
# (render_context) followed by the question; the paper's meta-question for it is "Is the answer
# supported by the context, regardless of whether it seems right or wrong?". Same placeholders as
# DEFAULT_EVALUATOR_TEMPLATE, and the same delimiter strings: build_evaluator_text cuts exactly
# these out of the answer, which is what keeps an injected meta-question or fake delimiter out.
QA_EVALUATOR_TEMPLATE = (
    "Below is a context (one or more passages), a question about it, and a proposed answer to the "
    "question.\n\n"
    "Context and question:\n{problem}\n\n"
    "{reference}"
    "Proposed answer:\n<<<BEGIN SOLUTION>>>\n{solution}\n<<<END SOLUTION>>>\n\n"
    "Final answer extracted from the proposed answer: {extracted}\n\n"
    "Question about the proposed answer above: {question}\n"
    "Reply with Yes or No."
)


def render_context(value, max_chars):
    """A QA context field as the text the policy and the evaluator read (RLME §4: contexts cut at
    4,000 characters).

        str                                  -> as is
        list of str                          -> joined by blank lines
        list of [title, sentence, ...] lists -> "title: sentence sentence ..." per passage,
                                                passages joined by blank lines (QA-Feedback's
                                                `passages`, ../shared/data/qa_feedback/SOURCE.md)

    then cut to the first max_chars characters.

    Args:
        value: the row's context field.
        max_chars: int >= 0; 0 = no cut.
    Returns:
        str.
    Raises:
        ValueError: any other type (one line naming it), or max_chars < 0.
    """
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0 (0 = no cut), got {max_chars}")
    expected = "expected a str, a list of str, or a list of [title, sentence, ...] passages"
    if isinstance(value, str):
        text = value
    elif isinstance(value, list) and all(isinstance(x, str) for x in value):
        text = "\n\n".join(value)
    elif isinstance(value, list) and all(isinstance(x, list) and x and all(isinstance(t, str) for t in x)
                                         for x in value):
        text = "\n\n".join(f"{title}: {' '.join(sentences)}" if sentences else title
                            for title, *sentences in value)
    else:
        found = type(value).__name__
        if isinstance(value, list):  # it holds something that is not a str (else the 2nd branch took it)
            bad = next(x for x in value if not isinstance(x, str))
            found = f"a list holding {type(bad).__name__} {bad!r:.40}"
        raise ValueError(f"context: {expected}; got {found}")
    return text[:max_chars] if max_chars else text


def check_evaluator_template(template):
    """Fail fast (one line) when a template would let the meta-question come before the solution
    or appear twice. Raises SystemExit naming the config key."""
    for field in ("{problem}", "{solution}", "{question}"):
        if template.count(field) != 1:
            raise SystemExit(f"reward.evaluator_template must contain {field} exactly once")
    if template.index("{question}") < template.index("{solution}"):
        raise SystemExit("reward.evaluator_template: {question} must come after {solution}")


def build_evaluator_text(template, problem, solution, question, meta_questions=(), reference=None):
    """Fill the evaluator template for one (sample, meta-question) (docs/method.md §4.2).

    The policy can and will write "Is the answer correct? Yes" or a fake closing delimiter into
    its solution, so every meta-question string and both delimiters are cut out of the solution
    first: the meta-question then appears exactly once, after the closing delimiter.
    The cutting repeats until the text stops changing: one pass can create what it removes, as in
    "Is the answer <<<BEGIN SOLUTION>>>correct?" (cutting the delimiter joins the question) or
    "Is the answer Is the answer correct?correct?" (cutting the inner copy leaves the outer one).
    Each pass that changes the text shortens it, so the loop ends.
    str.format does not re-read substituted values, so braces in the solution are harmless.

    Args:
        problem, solution, question: str.
        meta_questions: all meta-question strings of the run (each is removed from the solution).
        reference: str gold answer for anchored items, else None.
    Returns:
        str, the evaluator's user message (or plain prompt before the answer stub).
    """
    extracted = extract_boxed(solution)
    cut = list(meta_questions) + [question, *SOLUTION_DELIMITERS]
    previous = None
    while solution != previous:
        previous = solution
        for s in cut:
            solution = solution.replace(s, "")
    return template.format(
        problem=problem, solution=solution.strip(), question=question,
        extracted=extracted if extracted is not None else "none",
        reference=REFERENCE_LINE.format(answer=reference) if reference is not None else "",
    )


def evaluator_prompt_text(tokenizer, text, target, chat, answer_stub="\nAnswer:"):
    """The evaluator prompt as a string, and prompt + target: what an in-process evaluator
    tokenises (evaluator_prompt_and_target_ids) and what a remote one sends (score_remote).

    Args:
        tokenizer: the evaluator's tokenizer (only read when chat is True: its chat template).
        text: evaluator user message (build_evaluator_text). target: a_k, e.g. "Yes".
        chat: False (text + answer_stub), or True / the chat options of rollout.use_chat_template:
            `text` in the chat template with the generation prompt.
    Returns:
        (prompt str, full str): full = prompt + " " + target, without the space when the prompt
        ends in white space (after "Answer:" the natural continuation is " Yes").
    """
    if chat:
        prompt = rollout.chat_prompt(tokenizer, text, chat, tokenize=False)
    else:
        prompt = text + answer_stub
    return prompt, prompt + ("" if prompt[-1:].isspace() else " ") + target


def evaluator_prompt_and_target_ids(tokenizer, text, target, chat, answer_stub="\nAnswer:"):
    """Token ids of the evaluator prompt and of the target answer string a_k (RLME Eq. 2;
    docs/method.md §4.2).

    The target ids are found by tokenising prompt + target and removing the prompt ids, never
    by `tokenizer.encode("Yes")[0]`: after "Answer:" the natural continuation is " Yes" (with a
    space), after a chat header "...assistant\\n" it is "Yes", and multi-token answers need all
    their tokens. A separating space is added when the prompt does not end in white space.

    Args:
        text: evaluator user message (build_evaluator_text).
        target: answer string a_k, e.g. "Yes".
        chat: False, or True / the chat options of rollout.use_chat_template: wrap `text` in the
            evaluator's chat template (then no answer stub).
    Returns:
        (prompt_ids list[int], target_ids list[int])
    Raises:
        ValueError: the tokenizer merges the prompt's last token with the target, so the
            prompt ids are not a prefix (change the template's ending).
    """
    prompt, full = evaluator_prompt_text(tokenizer, text, target, chat, answer_stub=answer_stub)
    # A rendered chat string already holds its special tokens: do not add a second BOS.
    prompt_ids = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=not chat)["input_ids"]
    if full_ids[:len(prompt_ids)] != prompt_ids or len(full_ids) == len(prompt_ids):
        raise ValueError(f"target {target!r}: prompt ids are not a prefix of prompt+target ids; "
                         f"end the evaluator template/answer stub with ':' or a newline")
    return prompt_ids, full_ids[len(prompt_ids):]


# A REMOTE evaluator (`kind: remote`): the same log p(target | prompt), scored by an
# OpenAI-compatible /v1/completions server that echoes the prompt with its log-probs (`echo: true`,
# `logprobs`, no generation): the target's log p is the sum of the echoed log-probs of the tokens
# that spell " Yes" at the end of prompt + target (echo_target_logprob). A request that fails
# after its retries gives None, never a number: the sample is masked (rlme_reward's "valid").
# Servers that work, and the tokenizer caveat: docs/scale-out.md, "Remote evaluators".


@torch.no_grad()
def score_targets(model, prompt_ids, target_ids, pad_id, micro_batch_size=8, groups=None):
    """log p(target | prompt) under `model`, teacher-forced (the plain twin of score_targets):

        score[i, k] = sum_t log softmax(f(prompt_ik + target_ik[:t]))[target_ik[t]]

    one unpadded forward per (prompt + target) row, so no padding, positions or cache are involved.

    Args:
        model: causal LM (run in eval mode, rollout.eval_mode, its modes restored after; no grad).
        prompt_ids: list (N) of lists (K) of list[int], each non-empty.
        target_ids: same nesting, the target answer ids (each non-empty).
        pad_id, micro_batch_size, groups: unused here (no padding, one row per forward); the fast
            twin (fast.score_targets) takes them.
    Returns:
        FloatTensor [N, K] float32, on CPU.
    """
    device = next(model.parameters()).device
    out = torch.zeros(len(prompt_ids), len(prompt_ids[0]))
    with rollout.eval_mode(model):  # dropout off (a live evaluator is the policy, in train mode)
        for i, (prompts, targets) in enumerate(zip(prompt_ids, target_ids)):
            for k, (p, t) in enumerate(zip(prompts, targets)):
                logits = model(input_ids=torch.tensor([p + t], device=device)).logits[0]  # [len(p) + len(t), V]
                # the logits at position j predict token j + 1: positions len(p)-1 .. end-1 predict t
                out[i, k] = token_logprobs(logits[len(p) - 1:-1], torch.tensor(t, device=device)).sum().cpu()
    return out


def local_evaluator(model, tokenizer, *, chat=False, name="self", weight=1.0, answer_stub="\nAnswer:",
                    micro_batch_size=8, score=score_targets):
    """An in-process evaluator j as the dict rlme_reward reads: {"name", "weight": v_j, "score"}.

    score(texts, targets, groups=None) -> FloatTensor [N, K] of log p(target_k | texts[i][k]), the
    log p_{j,k} of RLME Eq. 2: each text is rendered as an evaluator prompt
    (evaluator_prompt_and_target_ids: the chat template, or plain text + `answer_stub`) and scored
    by `score` (score_targets, or its fast twin fast.score_targets, which shares the prompts'
    common prefixes: samples with the same `groups` key next to each other share their problem).
    A NaN a model computes is a broken number, not a failed request: it comes back as -inf, so
    rlme_reward replaces and counts it (NaN is what an evaluator returns for "could not score").

    Args:
        model: causal LM, scored in eval mode without grad (the policy itself for `kind: live`).
        tokenizer: its tokenizer. chat: False, or the chat options of rollout.use_chat_template.
        micro_batch_size: samples (each with all K rows) per forward.
    """
    def fn(texts, targets, groups=None):
        ids = [[evaluator_prompt_and_target_ids(tokenizer, t, a, chat=chat, answer_stub=answer_stub)
                for t, a in zip(row, targets)] for row in texts]
        logp = score(model, [[p for p, _ in r] for r in ids], [[t for _, t in r] for r in ids], tokenizer.pad_token_id,
                     micro_batch_size=micro_batch_size, groups=groups)
        return torch.nan_to_num(logp, nan=-float("inf"), posinf=float("inf"), neginf=-float("inf"))
    # model, tokenizer, chat: what it scores with, for inspection (rlme_reward reads name, weight, score)
    return {"name": name, "weight": float(weight), "score": fn, "model": model, "tokenizer": tokenizer, "chat": chat}


def rlme_reward(evaluators, meta_questions, problems, solutions, references=None, anchored=None,
                template=DEFAULT_EVALUATOR_TEMPLATE, renormalize=False, nonfinite_logp=-50.0, transform="log"):
    """RLME reward r(x, y) = sum_j v_j sum_k w_k log p_{j,k}   (RLME Eq. 2-3; docs/method.md §4.2).

    p_{j,k} = pi_phi_j(a_k | x, y, q_k) is evaluator j's probability of the whole target string
    a_k after the evaluator prompt for meta-question q_k. The reward is <= 0; 0 means certainty.
    With transform "prob" it is r = sum_j v_j sum_k w_k p_{j,k} instead (the abstract's wording,
    "probability"; in [0, sum v w] for positive weights: a near-0 p costs at most v w, not an
    unbounded log).

    Args:
        evaluators: list of dicts {"name", "weight": v_j, "score"} (local_evaluator; a remote one,
            plumbing/services.py's remote_evaluator, also has "failures": the reasons of the
            requests that failed in its last call).
        meta_questions: list of dicts {"question", "weight": w_k, "target": a_k, "negative": str}.
        problems, solutions: list[str] of length N.
        references: list[str] gold answers (only read for anchored items), or None.
        anchored: list[bool], True = show the reference answer to the evaluator (sparse
            ground-truth anchoring), or None.
        renormalize: use log p(a_k) - log(p(a_k) + p(negative_k)) instead (off by default: not
            the paper's reward).
        nonfinite_logp: a log p that is inf (a broken evaluator) is replaced by this value and
            counted, so the update never sees it.
        transform: "log" (RLME Eq. 3) | "prob" (sum of p); config `reward.transform`.
    Returns:
        dict with "reward" FloatTensor [N], "logp" FloatTensor [N, J, K] (log p whatever the
        transform, after renormalising and the nonfinite replacement), "nonfinite" int count of
        replaced values; "failed" BoolTensor [N, J, K]: the evaluator could not score that term
        (a remote request that failed after its retries: NaN, not replaced); "valid" BoolTensor [N]:
        no term failed (where False the reward is NaN: the caller masks the sample, never scores
        it); "why" {evaluator name: the first failure's reason, "" if none} for evaluators that
        report failures.
    Raises:
        ValueError: unknown transform.
    """
    if transform not in ("log", "prob"):
        raise ValueError(f"transform {transform!r}: expected log or prob")
    questions, k = [m["question"] for m in meta_questions], len(meta_questions)
    targets = [m["target"] for m in meta_questions]
    if renormalize:  # score the negative answer too, as extra rows sharing the same prefix
        targets = targets + [m.get("negative", "No") for m in meta_questions]
    refs = [references[i] if anchored and anchored[i] else None for i in range(len(solutions))]
    texts = [[build_evaluator_text(template, x, y, questions[kk % k], meta_questions=questions, reference=ref)
              for kk in range(len(targets))] for x, y, ref in zip(problems, solutions, refs)]  # [N][K or 2K]
    # samples of one problem (a group) are adjacent: the fast scorer runs their shared prefix once
    logp = torch.stack([ev["score"](texts, targets, groups=problems) for ev in evaluators], 1).float()  # [N, J, .]
    failed, bad = logp.isnan(), torch.isinf(logp)  # could not score (stays NaN, masked); a broken number
    if renormalize:
        logp = logp[..., :k] - torch.logaddexp(logp[..., :k], logp[..., k:])
        failed, bad = failed[..., :k] | failed[..., k:], bad[..., :k] | bad[..., k:]
    bad = bad & ~failed
    logp = torch.where(bad, torch.full_like(logp, nonfinite_logp), logp)
    # after the replacement, so "prob" sees exp(nonfinite_logp) ~ 0, never NaN
    terms = logp if transform == "log" else logp.exp()
    reward = weighted_reward(terms, [ev["weight"] for ev in evaluators], [m["weight"] for m in meta_questions])
    valid = ~failed.any(2).any(1)  # a sample missing any term has no reward: NaN, and masked
    why = {ev["name"]: next((w for w in ev["failures"] if w), "") for ev in evaluators if "failures" in ev}
    return {"reward": torch.where(valid, reward, torch.full_like(reward, float("nan"))), "logp": logp,
            "nonfinite": int(bad.sum()), "valid": valid, "failed": failed, "why": why}


def weighted_reward(logp, v, w):
    """r = sum_j v_j sum_k w_k log p_{j,k}  (RLME Eq. 3).

    Args:
        logp: FloatTensor [N, J, K]; v: J evaluator weights; w: K meta-question weights.
    Returns:
        FloatTensor [N].
    """
    v = torch.as_tensor(v, dtype=logp.dtype)
    w = torch.as_tensor(w, dtype=logp.dtype)
    return (logp * v[None, :, None] * w[None, None, :]).sum((1, 2))


def hybrid_reward(rlvr, rlme, rlvr_weight=1.0):
    """r = rlvr_weight * r_RLVR + r_RLME: the verifiable reward plus the weighted meta-evaluation
    terms (RLME §4 Tables 1-2, "RLVR + RLME").

    The paper's rule for combining the two is not in the text we have: this additive form is our
    choice. The caller logs both parts separately (samples.jsonl rlvr_reward / rlme_reward), so
    either can be recomputed from the log.

    Args:
        rlvr: FloatTensor [N] (or N floats), answer_reward per sample.
        rlme: FloatTensor [N] (or N floats), rlme_reward's "reward".
        rlvr_weight: float, the RLVR part's weight (config `reward.rlvr_weight`).
    Returns:
        FloatTensor [N], float32.
    Raises:
        ValueError: the two parts differ in shape.
    """
    rlvr = torch.as_tensor(rlvr, dtype=torch.float32)
    rlme = torch.as_tensor(rlme, dtype=torch.float32)
    if rlvr.shape != rlme.shape:
        raise ValueError(f"hybrid_reward: RLVR part {tuple(rlvr.shape)} and RLME part {tuple(rlme.shape)} "
                         f"differ in shape")
    return rlvr_weight * rlvr + rlme


# ----------------------------------------------------------------------------------------------
# The RLME reward outside our trainer: a TRL reward function, a verl compute_score, an evaluator
# loader (RLME Eq. 2-3; `python reward.py` scores a JSONL file, see main)
#
# The factories below close over already-loaded evaluators and return the callable each trainer
# expects; every score is reward.rlme_reward on the same (problem, completion) pairs, so a reward
# logged by TRL or verl can be recomputed with this file alone. Only FROZEN evaluators: a reward
# function gets texts, not the trainer's current weights, so train.py's `kind: live` (the policy
# scoring its own answers) is not possible from outside a trainer (scripts/bench_vs_trl.py shows
# a TRL-internal workaround for benchmarking only).
#
#   import reward
#   ev = reward.load_evaluator("HuggingFaceTB/SmolLM2-135M-Instruct")
#   fn = reward.trl_reward_function([ev], ["Is the answer correct?"], problem_key="question")
#   GRPOTrainer(model=..., reward_funcs=fn, ...)        # TRL: one call per generation batch
#   compute_score = reward.verl_compute_score([ev], ["Is the answer correct?"])   # verl: per sample


def load_evaluator(path, name="evaluator", weight=1.0, chat_template="auto", dtype="float32", device="cpu",
                   system_prompt=None, chat_template_kwargs=None, answer_stub="\nAnswer:", micro_batch_size=8,
                   score=score_targets):
    """A frozen evaluator j as the dict rlme_reward reads (what train.load_evaluators builds for
    `kind: frozen`), so no train.py or config is needed.

    Args:
        path: str, an HF folder, hub id or GGUF file (rollout.resolve_model_path).
        name: str, the evaluator's name in logp dicts and metric names.
        weight: float, v_j of RLME Eq. 3.
        chat_template: "auto" (the template if the tokenizer has one, plain text for a "-Base"
            model) | True | False: wrap the evaluator prompt in the chat template, else plain
            text + answer stub (rollout.use_chat_template).
        dtype: "float32" | "bfloat16" | "float16".
        device: str or torch.device the model is moved to.
        system_prompt: str or None, a system message before the evaluator prompt (chat only).
        chat_template_kwargs: dict or None, extra template variables, e.g. {"enable_thinking": False}.
        answer_stub, micro_batch_size, score: as local_evaluator (score=fast.score_targets: the
            same numbers, faster).
    Returns:
        local_evaluator's dict {"name", "weight", "score"} over the loaded model (eval mode, no grad).
    Raises:
        ValueError: unknown dtype.
        SystemExit (one line): the path is not a causal LM, chat_template True without a template,
            or a system prompt / template kwarg that would do nothing (rollout.use_chat_template).
    """
    if dtype not in rollout.DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(rollout.DTYPES)}")
    model, tok = rollout.load_model(path, dtype=dtype, device=device)
    model.eval().requires_grad_(False)  # frozen: scored without grad, never trained
    chat = rollout.use_chat_template(tok, chat_template, model_path=path, system=system_prompt,
                                     template_kwargs=chat_template_kwargs, key=None)
    return local_evaluator(model, tok, chat=chat, name=name, weight=weight, answer_stub=answer_stub,
                           micro_batch_size=micro_batch_size, score=score)


def meta_question_dicts(meta_questions, target="Yes"):
    """Meta-questions k as the dicts rlme_reward reads (RLME Eq. 2-3: q_k, a_k, w_k).

    Args:
        meta_questions: list of str (target `target`, weight 1.0) or dicts {"question", optional
            "weight", "target", "negative"} (config.yaml's reward.meta_questions form).
        target: str, a_k for questions given as plain strings.
    Returns:
        list of dicts {"question", "weight": float, "target", "negative"}.
    Raises:
        ValueError: empty list, a question that is not a non-empty str, or the same question twice
            (the logp dicts are keyed by question).
    """
    out = []
    for m in meta_questions:
        m = {"question": m} if isinstance(m, str) else dict(m)
        if not isinstance(m.get("question"), str) or not m["question"]:
            raise ValueError(f"meta-question {m!r}: needs a non-empty str 'question'")
        out.append({"question": m["question"], "weight": float(m.get("weight", 1.0)),
                    "target": m.get("target", target), "negative": m.get("negative", "No")})
    questions = [m["question"] for m in out]
    if not out or len(set(questions)) != len(questions):
        raise ValueError(f"meta_questions must be a non-empty list of distinct questions, got {questions}")
    return out


def checked_template(template):
    """The evaluator template to use: None -> DEFAULT_EVALUATOR_TEMPLATE; any other is checked now
    (check_evaluator_template, then one trial fill) so that a bad one fails before the models load
    or the first batch, not inside it.

    Raises:
        SystemExit (one line): {problem} / {solution} / {question} missing, repeated or out of
            order, or an unknown {placeholder}.
    """
    template = template or DEFAULT_EVALUATOR_TEMPLATE
    check_evaluator_template(template)
    try:
        build_evaluator_text(template, "problem", "solution", "question")
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"evaluator template: cannot be filled ({type(e).__name__}: {e}); allowed "
                         f"placeholders: {{problem}} {{solution}} {{extracted}} {{reference}} {{question}}")
    return template


def _checked_setup(evaluators, meta_questions, template, transform):
    """The factories' start-up checks (one place, so TRL and verl fail alike, before any batch is
    scored). Returns (meta-question dicts, template)."""
    if transform not in ("log", "prob"):
        raise ValueError(f"transform {transform!r}: expected log or prob")
    keys = {"name", "weight", "score"}
    if not evaluators:
        raise ValueError("evaluators: need at least one (reward.load_evaluator builds one)")
    for i, ev in enumerate(evaluators):
        if not isinstance(ev, dict) or not keys <= set(ev):
            raise ValueError(f"evaluators[{i}]: expected a dict with keys {sorted(keys)} (reward.load_evaluator)")
    return meta_question_dicts(meta_questions), checked_template(template)


def logp_metric_name(evaluator, question):
    """The metric name of one evaluator's mean log p for one meta-question: the name train.py
    writes to metrics.jsonl (train.rlme_step_metrics), so TRL's logs read the same."""
    return f"rlme/{evaluator}/{question}/logp"


def _message_text(content):
    """A chat message's content as text: a str as is, a list of content blocks
    ([{"type": "text", "text": ...}, ...], TRL's multimodal form) -> its text blocks joined."""
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")


def problem_text(prompt):
    """The problem the evaluator reads, from a TRL prompt (or a dataset column holding one).

    Args:
        prompt: str (standard dataset), or a list of {"role", "content"} messages
            (conversational dataset): the LAST user message is the problem (a system message or
            earlier turns are not shown to the evaluator).
    Returns:
        str.
    Raises:
        ValueError: a message list without a user message, or another type.
    """
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return _message_text(users[-1].get("content", ""))
        raise ValueError(f"conversational prompt has no user message: roles {[m.get('role') for m in prompt]}")
    raise ValueError(f"prompt: expected a str or a list of messages, got {type(prompt).__name__}")


def solution_text(completion):
    """The solution y the evaluator judges, from a TRL completion.

    Args:
        completion: str (standard dataset), or a list of {"role", "content"} messages
            (conversational): the contents of all assistant messages joined by blank lines (one
            message in single-turn generation; tool results between turns are not included).
    Returns:
        str ("" for a message list without assistant content).
    """
    if isinstance(completion, str):
        return completion
    return "\n\n".join(_message_text(m.get("content") or "") for m in completion
                       if isinstance(m, dict) and m.get("role") == "assistant")


def trl_reward_function(evaluators, meta_questions, *, template=None, transform="log", problem_key="prompt",
                        name="rlme_reward"):
    """A TRL reward function (GRPOTrainer's reward_funcs) returning the RLME reward
    r(x, y) = sum_j v_j sum_k w_k log p_{j,k}, p_{j,k} = pi_phi_j(a_k | x, y, q_k) (RLME Eq. 2-3):
    reward.rlme_reward on the batch, so the values are exactly those of rlme_reward on the same
    (problem, completion) pairs.

    The returned `fn(prompts, completions, **kwargs) -> list[float]` has TRL's custom reward
    signature (trl 1.16 GRPOTrainer._calculate_rewards): prompts / completions are str or lists
    of {"role", "content"} messages (problem_text, solution_text); dataset columns other than
    "prompt" arrive as keyword lists; TRL also passes `log_metric(name, value)`, through which the
    batch mean of every evaluator's log p per meta-question is logged as
    "rlme/<evaluator>/<question>/logp" (logp_metric_name), plus "rlme/nonfinite" (log p values
    replaced because they were NaN/inf). The rest of TRL's keywords (trainer_state, log_extra,
    completion_ids, ...) are accepted and ignored. Returns None only for a sample a remote
    evaluator failed to score after its retries (TRL then leaves it out; logged as
    "evaluator/<name>/failed"), never a made-up number.
    fn.__name__ is `name`: TRL logs the reward as "rewards/<name>/mean".

    Evaluators must be frozen models loaded beforehand (load_evaluator) or remote ones
    (remote_evaluator): a reward function sees
    texts, not the trainer's current weights, so a live evaluator (the policy itself) is not
    possible here. The samples of one prompt are adjacent in TRL's batch, so their shared
    evaluator prefix runs once (score_targets).

    Args:
        evaluators: list of evaluator dicts {"name", "weight": v_j, "score"} (load_evaluator,
            remote_evaluator; the answer stub of plain-text prompts and the scoring micro-batch
            are theirs).
        meta_questions: list of str or dicts (meta_question_dicts).
        template: evaluator prompt template; None = DEFAULT_EVALUATOR_TEMPLATE (math), or
            QA_EVALUATOR_TEMPLATE, or your own with the same placeholders.
        transform: "log" (RLME Eq. 3) | "prob" (sum of p instead).
        problem_key: "prompt" = the problem is the prompt itself (its last user message), which
            includes any instructions the prompt template adds; any other value names a dataset
            column holding the bare problem (e.g. "question").
        name: str, fn.__name__.
    Returns:
        callable fn(prompts, completions, **kwargs) -> list[float], one reward per completion.
    Raises:
        ValueError (at once): unknown transform, malformed evaluators or meta-questions.
        SystemExit (at once): a template without {problem}/{solution}/{question} in order, or
            with an unknown placeholder.
        ValueError (when called): the dataset has no column `problem_key`.
    """
    mqs, template = _checked_setup(evaluators, meta_questions, template, transform)

    def fn(prompts, completions, **kwargs):
        if problem_key == "prompt":
            problems = [problem_text(p) for p in prompts]
        elif problem_key in kwargs:
            problems = [problem_text(p) for p in kwargs[problem_key]]
        else:
            columns = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra", "log_metric"))
            raise ValueError(f"reward function {name!r}: problem_key {problem_key!r} is not a dataset column "
                             f"(columns passed: {columns}); use problem_key='prompt' to read the prompt")
        out = rlme_reward(evaluators, mqs, problems, [solution_text(c) for c in completions], template=template,
                          transform=transform)
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:  # TRL averages these over the logging step
            means = out["logp"].nanmean(0)  # [J, K]; NaN: a remote evaluator's failed requests
            for j, ev in enumerate(evaluators):
                for k, mq in enumerate(mqs):
                    log_metric(logp_metric_name(ev["name"], mq["question"]), means[j, k].item())
                if "failures" in ev:  # a remote evaluator
                    log_metric(f"evaluator/{ev['name']}/failed", float(out["failed"][:, j].any(1).sum()))
            log_metric("rlme/nonfinite", float(out["nonfinite"]))
        # None where a remote evaluator failed: TRL leaves such a sample out of the reward (NaN)
        return [r if ok else None for r, ok in zip(out["reward"].tolist(), out["valid"].tolist())]

    fn.__name__ = fn.__qualname__ = name
    return fn


def verl_compute_score(evaluators, meta_questions, *, template=None, transform="log", problem_key="question"):
    """A verl custom reward function returning the RLME reward of one sample (RLME Eq. 2-3):
    reward.rlme_reward on the single (problem, solution) pair.

    The returned `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float`
    has the signature of verl's documented custom reward function (custom_reward_function.path /
    .name; verl's reward managers call it with these keywords, one sample per call). So every call
    is a batch of one: no batching across samples and no shared group prefix, which makes it slow
    (about N forward passes of the evaluator per step instead of N / micro-batch); for large runs
    a batched verl reward manager calling rlme_reward is the fast route.
    The problem is read from extra_info[problem_key]: verl's own data preprocessing scripts (e.g.
    examples/data_preprocess/gsm8k.py) store the bare question as extra_info["question"].
    data_source and ground_truth are not read: the RLME reward needs no labels.
    Evaluators must be frozen models (load_evaluator) or remote ones (remote_evaluator; a failed
    request raises RuntimeError: no made-up score); a live evaluator is not possible from outside
    the trainer. The module that builds compute_score is imported by each verl reward worker, so
    every worker loads its own evaluator copy.

    Args:
        evaluators, meta_questions, template, transform: as trl_reward_function.
        problem_key: the extra_info key holding the problem.
    Returns:
        callable compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float.
    Raises:
        ValueError / SystemExit (at once): as trl_reward_function.
        ValueError (when called): extra_info is not a dict holding problem_key.
    """
    mqs, template = _checked_setup(evaluators, meta_questions, template, transform)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if not isinstance(extra_info, dict) or not isinstance(extra_info.get(problem_key), str):
            found = sorted(extra_info) if isinstance(extra_info, dict) else type(extra_info).__name__
            raise ValueError(f"verl compute_score: extra_info[{problem_key!r}] must hold the problem text "
                             f"(found {found}); add it in your data preprocessing")
        out = rlme_reward(evaluators, mqs, [extra_info[problem_key]], [solution_str], template=template,
                          transform=transform)
        if not out["valid"][0]:  # verl wants a float: no number rather than a made-up one
            raise RuntimeError(f"verl compute_score: remote evaluator failed: {'; '.join(w for w in out['why'].values() if w)}")
        return float(out["reward"][0])

    return compute_score


# ----------------------------------------------------------------------------------------------
# RM-NLHF rewards (RM-NLHF §3.1-3.2, Eq. 4, 5, 8; docs/method.md §5.2-5.4): GRM prompt and
# parsing, the D_H and D_O rewards, the step metrics
#
# Data flow (one GRPO step, RM-NLHF Algorithm 1; docs/method.md §5.4):
#   items    = load_pairwise(...)                       plain dicts, A/B already shuffled (PLUMBING)
#   prompt   = build_grm_prompt(context, a, b)          the user message; rollout.py adds the template
#   parsed   = parse_grm_output(completion)             {critique, choice, valid, why}
#   D_H:  samples = score_dh(parsed, items, judge, ...)        judge F1 -> R (Eq. 4, 5)
#   D_O:  samples = score_do(parsed, items, r_hat, ...)        MetaRM prediction R_hat -> R' (Eq. 8)
#   nlhf_metrics(samples)                               format errors, accuracy, judge fail rate
#
# A sample whose judge call failed gets reward None. It must be EXCLUDED from its group's mean/std
# and from the loss (advantage 0, loss mask 0, not counted in the token-mean denominator); it is
# counted in judge/fail_rate. We never substitute 0 (it would look like a real "no match" score).


# ---- GRM prompt and parsing (docs/method.md §5.2) ------------------------------------------

# The pair as every model in RM-NLHF reads it (the GRM, the meta-judge, the MetaRM: metarm.metarm_text)
PAIR_TEXT = """[Conversation]
{context}

[Response A]
{response_a}

[Response B]
{response_b}"""

GRM_PROMPT = """You are judging two AI assistant responses to the same conversation. Decide which response is better: more helpful, correct, honest and harmless for the user.

""" + PAIR_TEXT + """

Write a short critique (at most {max_lines} lines) that states the key reasons for your decision, inside <critics>...</critics>. Then give your verdict inside <choice>...</choice>: <choice>[[A]]</choice> if Response A is better, or <choice>[[B]]</choice> if Response B is better."""

# The RM-NLHF authors' GRM prompt (nlhf.grm_prompt: authors), verbatim from their release
# (PROMPT_GRM in Character-GenRM-NLHF/verl/verl/workers/reward_manager/pairwise_grm.py of
# github.com/liudan193/Qwen-Character, where their released GRMs judge policy samples), so a
# released checkpoint is scored in its own format. Its conversation is the turns rendered as
# "role:\ncontent\n" (authors_context). The paper's training template (its Fig. 9) is not public.
AUTHORS_GRM_PROMPT = """Please act as an impartial judge and evaluate the quality of the responses provided by two AI Chatbots to the Client question displayed below.

[Client Question]
{context}

[The Start of Chatbot A's Response]
{response_a}
[The End of Chatbot A's Response]


[The Start of Chatbot B's Response]
{response_b}
[The End of Chatbot B's Response]

Output your final verdict by strictly following this format:

<critics>
[Provide a brief summary of your reasoning for the choice]
</critics>

<choice>
[[A]]
</choice>

Note: Use [[A]] if A is better, or [[B]] if B is better."""

GRM_PROMPT_STYLES = ("ours", "authors")


def nlhf_step_items(dh, do, step, cfg, rank, world):
    """This rank's pairwise items for `step`: round(nlhf.dh_per_step x P) prompts from D_H and the
    rest from D_O, each set read as its own seeded stream (step_items, so a resumed run sees the
    same prompts), then the P prompts shuffled by (seed, step) so every rank gets a mix of both.
    Returns list of item dicts tagged "set": "dh" | "do"."""
    P, seed = cfg["rollout"]["prompts_per_step"], cfg["run"]["seed"]
    n_dh = round(cfg["nlhf"]["dh_per_step"] * P) if do else P
    # each set as one stream for the whole step (rank 0 of 1); the ranks split it below
    both = ([dict(it, set="dh") for it in rollout.step_items(dh, step, prompts_per_step=n_dh, seed=seed,
                                                             rank=0, world=1)]
            + [dict(it, set="do") for it in rollout.step_items(do, step, prompts_per_step=P - n_dh, seed=seed + 1,
                                                               rank=0, world=1)])
    order = torch.randperm(P, generator=torch.Generator().manual_seed(seed * 100_019 + step)).tolist()
    per_rank = P // world
    return [both[k] for k in order[rank * per_rank:(rank + 1) * per_rank]]


def grm_prompt_ids(tokenizer, item, chat, nl, text_only=False):
    """Token ids of the GRM prompt for one pairwise item (build_grm_prompt in the style
    nl["grm_prompt"], in the chat template when `chat`; nl: the `nlhf` config section); its text
    (the user message) with text_only=True."""
    text = build_grm_prompt(item["context"], item["response_a"], item["response_b"], nl["max_critique_lines"],
                            style=nl["grm_prompt"], turns=item.get("meta", {}).get("turns"))
    return text if text_only else rollout.build_prompt_ids(tokenizer, text, chat)


def build_grm_prompt(context, response_a, response_b, max_lines=4, style="ours", turns=None):
    """The GRM user message (docs/method.md §5.2); the caller applies the chat template
    (rollout.build_prompt_ids).

    Args: context, response_a, response_b: str. max_lines: the critique limit told to the model
        (style "ours"; the same value parse_grm_output enforces). style: "ours" (GRM_PROMPT) or
        "authors" (AUTHORS_GRM_PROMPT; the conversation is `turns` rendered by authors_context
        when the item kept its turns, else `context` as is).
    Returns: str.
    """
    if style == "authors":
        conv = authors_context(turns) if turns else context.strip()
        return AUTHORS_GRM_PROMPT.format(context=conv, response_a=response_a, response_b=response_b)
    if style != "ours":
        raise ValueError(f"GRM prompt style {style!r} unknown; allowed: {', '.join(GRM_PROMPT_STYLES)}")
    return GRM_PROMPT.format(context=context.strip(), response_a=response_a.strip(),
                             response_b=response_b.strip(), max_lines=max_lines)


def authors_context(turns):
    """A conversation (list of {role, content}) as the authors' release renders it for the GRM
    and the MetaRM: "role:\ncontent\n" per turn, concatenated."""
    return "".join(f"{t.get('role', 'unknown')}:\n{t.get('content', '')}\n" for t in turns)


def parse_grm_output(text, max_lines=4, max_chars=1500, style="ours"):
    """Parse a GRM completion (docs/method.md §5.2; limits from the RM-NLHF authors' released code,
    reward_function_rm_nlhf in liudan193/Qwen-Character's Character-GenRM-NLHF).

    style "ours": critique = the LAST closed <critics>...</critics> block (stripped; blank ->
    none); choice = the letter in the LAST <choice>...</choice> block; when that is missing or
    holds no [[A]]/[[B]], the first [[A]] or [[B]] anywhere. Lines = non-blank lines.
    style "authors" (their parse_llm_evaluation + format check, for nlhf.grm_prompt: authors):
    critique = the last <critics> block stripped (an empty block is a valid empty critique);
    choice = the last <choice> block's text when it holds exactly one of the letters A, B
    (anywhere, e.g. "[[A]]" or "A"), else none; only when there is no <choice> block at all, the
    first [[A]] / [[ B ]] anywhere. Lines = every line, blank ones included (split on "\n").

    Args:
        text: str, the decoded completion. max_lines, max_chars: int, the format limits.
        style: "ours" | "authors".
    Returns:
        dict(critique: str|None, choice: 'A'|'B'|None, valid: bool, why: str) with why one of
        '' (valid), 'no_critique', 'no_choice', 'too_many_lines', 'too_long'.
    """
    text = text or ""
    blocks = re.findall(r"<critics>(.*?)</critics>", text, flags=re.S)
    choices = re.findall(r"<choice>(.*?)</choice>", text, flags=re.S)
    choice = None
    if style == "authors":
        critique = blocks[-1].strip() if blocks else None
        if choices:
            last = choices[-1].strip()
            choice = {(True, False): "A", (False, True): "B"}.get(("A" in last, "B" in last))
        else:
            m = re.search(r"\[\[\s*([AB])\s*\]\]", text)
            choice = m.group(1) if m else None
        n_lines = None if critique is None else len(critique.split("\n"))
    elif style == "ours":
        critique = (blocks[-1].strip() if blocks else None) or None
        if choices:
            m = re.search(r"\[\[([AB])\]\]", choices[-1])
            choice = m.group(1) if m else None
        if choice is None:
            m = re.search(r"\[\[([AB])\]\]", text)
            choice = m.group(1) if m else None
        n_lines = None if critique is None else len([ln for ln in critique.splitlines() if ln.strip()])
    else:
        raise ValueError(f"GRM prompt style {style!r} unknown; allowed: {', '.join(GRM_PROMPT_STYLES)}")
    why = ""
    if critique is None:
        why = "no_critique"
    elif choice is None:
        why = "no_choice"
    elif n_lines > max_lines:
        why = "too_many_lines"
    elif len(critique) > max_chars:
        why = "too_long"
    return {"critique": critique, "choice": choice, "valid": why == "", "why": why}


def parse_grm_completion(text, nl):
    """parse_grm_output with the `nlhf` config section's format limits and prompt style."""
    return parse_grm_output(text, nl["max_critique_lines"], nl["max_critique_chars"], style=nl["grm_prompt"])


# ---- rewards (RM-NLHF Eq. 4, 5, 8; docs/method.md §5.3-5.4) ----------------------------------


def process_reward(f1, threshold=0.5, inclusive=False):
    """R_process (RM-NLHF Eq. 4) = 1 if S(h, c) > threshold else 0; None when the judge failed.

    Eq. 4 and Algorithm 1 are strict (S > 0.5): one of two core arguments matched (F1 = 0.5
    exactly, common) earns nothing. inclusive=True gives S >= threshold, the RM-NLHF authors'
    released code (config nlhf.threshold_rule: inclusive)."""
    if f1 is None:
        return None
    return 1.0 if (f1 >= threshold if inclusive else f1 > threshold) else 0.0


def dh_reward(valid, correct, f1, lam=0.5, threshold=0.5, gate_on_outcome=True, inclusive=False):
    """Reward of a D_H sample (RM-NLHF Eq. 4-5; docs/method.md §5.3).

        invalid format            -> -1
        wrong choice              ->  0                       (gate_on_outcome=True, the paper)
        right choice              ->  1 + lam * R_process(f1)
        gate_on_outcome=False     ->  R_outcome + lam * R_process for every valid sample (ablation
                                      without outcome regularisation, RM-NLHF §4.3: a wrong
                                      verdict can earn lam)
        f1 None where it is needed ->  None: judge failure, the sample is masked (see top of section)
        lam = 0                   ->  R_outcome: no process term, and no judge call needed
                                      ("w/o process reward", RM-NLHF Table 3)

    Args: valid, correct: bool; f1: float in [0, 1] or None; lam: λ; threshold, inclusive: on S
        (process_reward).
    Returns: (reward float|None, r_process 0.0|1.0|None).
    """
    if not valid:
        return -1.0, None
    outcome = 1.0 if correct else 0.0
    if not correct and gate_on_outcome or lam == 0:
        return outcome, None
    r_proc = process_reward(f1, threshold, inclusive=inclusive)
    if r_proc is None:
        return None, None
    return outcome + lam * r_proc, r_proc


METARM_MODES = ("none", "offline", "online", "metarm_only", "binary", "binary_retrain", "classifier")


DO_REWARD_FORMS = ("paper", "released")


def do_reward(valid, correct, r_hat, lam=0.5, mode="online", gate_on_outcome=True, form="paper"):
    """Reward of a D_O sample from the MetaRM prediction R̂ (RM-NLHF Eq. 8, modes from App. H.1;
    docs/method.md §5.4).

        invalid                  -> -1
        mode 'none' (no MetaRM)  -> 1 if right else 0                      (outcome only)
        mode 'metarm_only'       -> clip(R̂, 0, 1 + lam), no outcome term
        otherwise: wrong -> 0; right -> 1 + clip(max(0, R̂ - 1), 0, lam)   (form 'paper', Eq. 8)
                                        right -> 1 + lam * max(0, R̂ - 1)   (form 'released': the
                                    authors' released reward manager, unclipped, weight 0.5 = λ)
        gate_on_outcome=False    -> wrong: clip(R̂, 0, lam), the predicted process part of a
                                    wrong verdict (R = 0 + λ·R_process on D_H without the gate):
                                    the "w/o outcome regularisation" ablation on D_O too

    Args: valid, correct: bool; r_hat: float (MetaRM output on the R scale) or None for mode
        'none'; lam: λ; mode: one of METARM_MODES; gate_on_outcome: nlhf.gate_on_outcome;
        form: nlhf.do_reward, one of DO_REWARD_FORMS (config.py refuses 'released' where it
        would change nothing: modes 'none' / 'metarm_only', no outcome gate).
    Returns: float.
    """
    if not valid:
        return -1.0
    if mode == "none":
        return 1.0 if correct else 0.0
    if mode == "metarm_only":
        return min(max(float(r_hat), 0.0), 1.0 + lam)
    if not correct:
        return 0.0 if gate_on_outcome else min(max(float(r_hat), 0.0), lam)
    if form == "released":
        return 1.0 + lam * max(float(r_hat) - 1.0, 0.0)
    return 1.0 + min(max(float(r_hat) - 1.0, 0.0), lam)


def score_dh(parsed, items, judge, lam=0.5, threshold=0.5, gate_on_outcome=True, inclusive=False,
             similarity="f1", sleep=time.sleep, rand=random.random):
    """Rewards of D_H samples: parse results + items -> judge (only where needed) -> RM-NLHF Eq. 4-5.

    Args:
        parsed: list of parse_grm_output dicts, one per completion.
        items: list of pairwise dicts (same length; repeat an item G times for a group).
        judge: make_judge(...) dict.
        similarity: which of the judge's numbers is S(h, c) in Eq. 4: "f1" (the paper's), "precision"
            or "recall" (RM-NLHF §2.3 compares them; config nlhf.similarity).
        judge["on_failure"]: "mask" (ours: a failed call gives reward None, the sample is left out)
            or "zero" (the authors' released code: a failed call scores S = 0, so R_process = 0).
    Returns:
        list of sample dicts: choice, valid, why, correct, critique, human_critique, f1, precision,
        recall, judge_why, judge_attempts, judged (bool), judge_failed (bool), r_process, reward
        (float or None).
    Raises:
        ValueError (a caller bug, before any judge call): lengths differ or an item has no critique.
        Judge failures never raise: they give reward None.
    """
    if len(parsed) != len(items):
        raise ValueError(f"score_dh: {len(parsed)} parse results for {len(items)} items")
    if any(not it.get("critique") for it in items):
        raise ValueError("score_dh: an item has no human critique (D_O items go to score_do)")
    samples, need = [], []
    for i, (p, it) in enumerate(zip(parsed, items)):
        correct = p["valid"] and p["choice"] == it["winner"]
        s = {"choice": p["choice"], "valid": p["valid"], "why": p["why"], "correct": bool(correct),
             "critique": p["critique"], "human_critique": it.get("critique"), "f1": None, "precision": None,
             "recall": None, "judge_why": None, "judge_attempts": 0, "judged": False, "judge_failed": False}
        samples.append(s)
        # outcome regularisation: the judge only sees valid, right verdicts (RM-NLHF §3.1); with
        # λ = 0 the process term is zero whatever S says, so the judge is never called
        if lam > 0 and p["valid"] and (correct or not gate_on_outcome):
            need.append(i)
    results = judge_scores(judge, [(items[i]["critique"], parsed[i]["critique"], items[i]) for i in need],
                           sleep=sleep, rand=rand)
    for i, r in zip(need, results):
        failed = r["f1"] is None
        if failed and judge["on_failure"] == "zero":  # the released code's rule: a failure scores 0
            r = dict(r, f1=0.0, precision=0.0, recall=0.0)
        samples[i].update(f1=r["f1"], precision=r["precision"], recall=r["recall"], judge_why=r["why"],
                          judge_attempts=r["attempts"], judged=True, judge_failed=failed)
    for s in samples:
        s["reward"], s["r_process"] = dh_reward(s["valid"], s["correct"], s[similarity], lam=lam,
                                                threshold=threshold, gate_on_outcome=gate_on_outcome,
                                                inclusive=inclusive)
    return samples


def score_do(parsed, items, r_hat, lam=0.5, mode="online", gate_on_outcome=True, form="paper"):
    """Rewards of D_O samples (RM-NLHF Eq. 8; docs/method.md §5.4). r_hat: list of MetaRM
    predictions (None entries allowed for invalid samples or mode 'none'); form: do_reward's.
    Returns list of sample dicts with choice, valid, why, correct, critique, r_hat, reward."""
    out = []
    for p, it, rh in zip(parsed, items, r_hat):
        correct = p["valid"] and p["choice"] == it["winner"]
        out.append({"choice": p["choice"], "valid": p["valid"], "why": p["why"], "correct": bool(correct),
                    "critique": p["critique"], "r_hat": rh,
                    "reward": do_reward(p["valid"], correct, rh, lam=lam, mode=mode,
                                        gate_on_outcome=gate_on_outcome, form=form)})
    return out


def nlhf_metrics(samples):
    """RM-NLHF metrics (docs/method.md §9) over a list of score_dh/score_do samples.

    format_error_rate and outcome_acc are over all samples (an invalid verdict counts as wrong);
    judge/fail_rate = failed / judged calls; process_rate and f1_mean over successful calls."""
    n = max(len(samples), 1)
    judged = [s for s in samples if s.get("judged")]
    ok = [s for s in judged if not s["judge_failed"]]
    out = {"nlhf/format_error_rate": sum(not s["valid"] for s in samples) / n,
           "nlhf/outcome_acc": sum(s["correct"] for s in samples) / n,
           "judge/calls": len(judged),
           "judge/fail_rate": (len(judged) - len(ok)) / len(judged) if judged else 0.0}
    if ok:
        out["nlhf/process_rate"] = sum(s["r_process"] == 1.0 for s in ok) / len(ok)
        out["judge/f1_mean"] = sum(s["f1"] for s in ok) / len(ok)
    return out


def nlhf_step_metrics(records, step_metrics):
    """RM-NLHF metrics (docs/method.md §9) of one step from all ranks' sample records (rank 0):
    format-error rate, outcome accuracy (all and per set), process-reward rate, judge fail rate,
    mean R̂, plus the MetaRM loss/agreement and order-of-operations entries of `step_metrics`."""
    out = nlhf_metrics(records)
    for name in ("dh", "do"):
        part = [r for r in records if r["set"] == name]
        if part:
            out[f"nlhf/{name}/outcome_acc"] = sum(r["correct"] for r in part) / len(part)
            out[f"nlhf/{name}/reward_mean"] = (sum(r["reward"] for r in part if r["reward"] is not None)
                                               / max(1, sum(r["reward"] is not None for r in part)))
    hats = [r["r_hat"] for r in records if r["r_hat"] is not None]
    out["metarm/r_hat_mean"] = sum(hats) / len(hats) if hats else None
    out["judge/failed"] = sum(r["judged"] and r["judge_failed"] for r in records)
    out.update(step_metrics)
    return out


# ----------------------------------------------------------------------------------------------
# The critique-similarity judge S(h, c): the paper's "Similarity w/ Core HC" (RM-NLHF §2.3, App. E;
# docs/method.md §5.3)
#
# S(h, c) = F1 of core arguments between the human critique h and the GRM critique c, decided by
# an LLM behind any OpenAI-compatible server (vllm serve, transformers serve, a hosted API).
# Failures (HTTP 429/5xx, timeouts, refused connections, HTML pages, unparseable answers) are
# retried with exponential backoff and jitter; after the last retry the result is f1=None with the
# reason in `why`. Nothing in here raises into the training loop.

# The judge's prompts, one per process-reward design of RM-NLHF §2.3 / App. E (judge.variant).
# "core" (the paper's choice, "Similarity w/ Core HC") and "all" ("Similarity w/ All HC") extract
# arguments from both critiques and match them; "meta_judge" ("LLM-as-a-Meta-Judge") rates the GRM
# critique's correctness directly, without the human one. The paper's prompt texts (Figs. 11, 13)
# are not in its text; these are written from its description. Both extraction prompts start with
# the repetition check (a critique that repeats itself must not collect matches).
_JUDGE_STEPS = {
    "core": """2. List the CORE arguments of the reference: the decisive reasons that settle which response is better. Leave out nitpicks and minor points (style, small omissions, things that would not change the verdict). If the reference names a fatal error (one that by itself decides the comparison, e.g. a wrong final answer, a harmful or refused reply), count that error as the only core argument. Let H be their number.
3. List the core arguments of the candidate the same way. Let C be their number.""",
    "all": """2. List ALL arguments of the reference: every distinct reason about one response (a flaw or a strength), minor ones included. Let H be their number.
3. List all arguments of the candidate the same way. Let C be their number.""",
}

JUDGE_PROMPT = """You compare two critiques of the same pair of AI responses (Response A and Response B): a REFERENCE critique written by a human expert and a CANDIDATE critique written by a model. Measure how many of the reference's arguments the candidate makes.

Work through these steps in order.
1. Repetition check. If the candidate restates the same argument more than once (the same point in other words, copied sentences, or filler that repeats itself), stop here and answer precision 0, recall 0, f1 0.
{steps}
4. Match candidate arguments to reference arguments by meaning and stance: a match must be about the same response with the same polarity (both call it a flaw, or both a strength); wording may differ. Each reference argument and each candidate argument can be used in at most one match. Let M be the number of matches.
5. precision = M / C, recall = M / H, f1 = 2 * precision * recall / (precision + recall), and 0 when M is 0.

[Reference critique]
{human}

[Candidate critique]
{model}

Think briefly, then end your answer with exactly these tags, each holding a plain decimal number between 0 and 1 (for example 0.5):
<precision>...</precision>
<recall>...</recall>
<f1>...</f1>"""

META_JUDGE_PROMPT = """You check a CRITIQUE that a model wrote about two AI responses to the same conversation. Decide whether the critique is correct: it identifies the real issues (or strengths) of the responses that decide which one is better, and claims nothing false about them.

Work through these steps in order.
1. Repetition check. If the critique restates the same point more than once, answer 0.
2. Read the conversation and both responses; note any fatal error (one that by itself decides the comparison, e.g. a wrong final answer, a harmful or refused reply). A critique that misses a fatal error, or blames a response for a flaw it does not have, is not correct.
3. Answer 1 if the critique is correct, else 0.

""" + PAIR_TEXT + """

[Critique]
{model}

Think briefly, then end your answer with exactly this tag holding 1 or 0:
<correct>...</correct>"""

JUDGE_VARIANTS = ("core", "all", "meta_judge")


def judge_prompt(variant, human, model, item=None):
    """The judge's request for one GRM critique `model` (str): against the human critique `human`
    (core / all), or on its own with the pair `item` (context, response_a, response_b; meta_judge).
    Raises ValueError on an unknown variant or a meta_judge call without the item."""
    if variant == "meta_judge":
        if item is None:
            raise ValueError("judge.variant meta_judge needs the pair (context and both responses)")
        return META_JUDGE_PROMPT.format(context=item["context"].strip(), response_a=item["response_a"].strip(),
                                        response_b=item["response_b"].strip(), model=model.strip())
    if variant not in _JUDGE_STEPS:
        raise ValueError(f"unknown judge variant {variant!r} (one of {', '.join(JUDGE_VARIANTS)})")
    return JUDGE_PROMPT.format(steps=_JUDGE_STEPS[variant], human=human.strip(), model=model.strip())


def parse_meta_judge_output(text):
    """The meta-judge's <correct>1|0</correct> as the judge dict of parse_judge_output: precision =
    recall = f1 = the 0/1 verdict (so nlhf.similarity and the threshold read it the same way), or
    all None with `why` when the tag is missing or holds anything else."""
    m = re.findall(r"<correct>\s*([01])\s*</correct>", text or "")
    if not m:
        return {"precision": None, "recall": None, "f1": None, "why": "no <correct>0|1</correct> tag"}
    v = float(m[-1])
    return {"precision": v, "recall": v, "f1": v, "why": ""}


# A plain decimal in [0, 1]: '0', '1', '0.5', '.5', '1.0'. Scientific notation ('1e-1'), 'nan',
# 'inf', fractions ('2/3') and percentages are parse failures: the prompt asks for a plain
# decimal, and accepting float()'s whole grammar would let 'nan' or 'inf' through.
_DECIMAL = re.compile(r"\d+(?:\.\d*)?|\.\d+")


def parse_judge_output(text):
    """Strictly parse the judge's tags (the LAST <precision>, <recall> and <f1> blocks).

    Args:
        text: str, the judge's answer.
    Returns:
        dict(precision, recall, f1, why): floats in [0, 1] and why '' on success; on a missing
        tag, a value that is not a plain decimal (see _DECIMAL: '1e-1' is rejected) or a value
        outside [0, 1]: all three None and why says which.
    """
    out = {"precision": None, "recall": None, "f1": None, "why": ""}
    vals = {}
    for tag in ("precision", "recall", "f1"):
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", text or "", flags=re.S)
        if not found:
            return dict(out, why=f"missing <{tag}> tag")
        s = found[-1].strip()
        if not _DECIMAL.fullmatch(s):
            return dict(out, why=f"<{tag}> is not a plain decimal: {s[:40]!r}")
        v = float(s)
        if not 0.0 <= v <= 1.0:
            return dict(out, why=f"<{tag}> outside [0, 1]: {s}")
        vals[tag] = v
    return dict(vals, why="")


def judge_scores(judge, pairs, sleep=time.sleep, rand=random.random):
    """Critique similarity S(h, c) for many (human, model) critique pairs (RM-NLHF §2.3, App. E;
    docs/method.md §5.3).

    Args:
        judge: make_judge(...) dict. pairs: list of (human critique str, GRM critique str) or of
            (human, GRM critique, pair item): the item is what judge.variant meta_judge reads.
        sleep, rand: injectable for tests (backoff waits and jitter draws).
    Returns:
        list (same order) of dict(f1, precision, recall, why, attempts); f1 None = failure.
        Never raises: every failure is returned with its reason.
    """
    if not pairs:
        return []
    if judge["backend"] == "proxy":  # lexical F1 against the human critique, whatever the variant
        return [dict(proxy_f1(p[0], p[1]), attempts=1) for p in pairs]

    def one(pair):
        try:
            prompt = judge_prompt(judge["variant"], pair[0], pair[1], pair[2] if len(pair) > 2 else None)
            return _judge_call(judge, prompt, sleep=sleep, rand=rand)
        except Exception as e:  # belt and braces: a judge bug must not kill a training run
            return {"precision": None, "recall": None, "f1": None, "why": f"{type(e).__name__}: {e}", "attempts": 0}

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(judge["concurrency"]))) as pool:
        return list(pool.map(one, pairs))


# ==============================================================================================
# PLUMBING: skip on first read (pairwise data loading; the judge's client with retries; the proxy judge;
# the command line)
# ==============================================================================================


# Required fields per schema; `detect_schema` tries them in this order (HelpSteer3 before the
# generic one: some HelpSteer3 derivatives also carry `chosen`/`rejected`).
PAIR_SCHEMAS = {
    "rm_nlhf": ("extra_info",),                         # the RM-NLHF authors' release (Tongyi-ConvAI/RM-NLHF)
    "helpsteer3": ("context", "response1", "response2", "overall_preference"),
    "mr_ben": ("Question_UUID", "Question", "Model_Solution_Steps", "Model_Solution_Correctness"),
    "pandalm": ("instruction", "response1", "response2", "annotator1", "annotator2", "annotator3"),
    "llmbar": ("input", "output_1", "output_2", "label"),
    "judgebench": ("question", "response_A", "response_B", "label"),
    "reward_bench_2": ("prompt", "chosen", "rejected", "num_correct"),  # 1 chosen vs 3 rejected
    "rm_bench": ("prompt", "chosen", "rejected"),        # chosen/rejected: list of 3 styles
    "chosen_rejected": ("chosen", "rejected"),          # + optional prompt, optional critique
}


def detect_schema(row, where):
    """Schema name of one row from its field names (docs/method.md §5.1).

    Args:
        row: dict, the first row of a file. where: str, 'file:line' for the error message.
    Returns:
        str, a key of PAIR_SCHEMAS.
    Raises:
        SystemExit naming the file and the fields found when nothing matches.
    """
    if not isinstance(row, dict):
        raise SystemExit(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    for name, fields in PAIR_SCHEMAS.items():
        if all(f in row for f in fields):
            if name == "rm_bench" and not isinstance(row["chosen"], list):
                continue  # plain chosen/rejected strings with a prompt field: the generic schema
            return name
    raise SystemExit(f"{where}: unknown pairwise schema, fields found: {sorted(row)}; "
                     f"known: {', '.join(PAIR_SCHEMAS)}")


def _read_rows(path, split="train", config_name=None):
    """Rows of a local .jsonl/.json file, a folder of them, or a hub dataset.

    Returns list[(file, where, row)] with where = 'file:line' (or 'hub_id[split] row N') so every
    later error can name the exact place. Local JSON is read with the json module (datasets would
    lose the line numbers); other local formats and hub ids go through datasets.load_dataset.
    """
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.json")))
        if not files:
            raise SystemExit(f"{path}: folder has no .jsonl or .json files")
        return [r for f in files for r in _read_rows(f, split, config_name)]
    if path.endswith(".jsonl"):
        return [(path, f"{path}:{n}", row) for n, row in read_jsonl(path)]
    if path.endswith(".json"):
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: file does not exist")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(rollout.json_error(path, e.lineno, e))
        except UnicodeDecodeError as e:
            raise SystemExit(rollout.not_utf8(path, None, e))
        if isinstance(data, list):
            return [(path, f"{path} element {i}", r) for i, r in enumerate(data)]
        if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
            # upstream Mr-Ben layout: {Question_UUID: [solution records]}
            return [(path, f"{path} [{k!r}][{j}]", r) for k, v in data.items() for j, r in enumerate(v)]
        raise SystemExit(f"{path}: expected a JSON array of rows (or JSONL)")
    import datasets  # here, not at the top: slow to import and only hub ids / other formats need it
    try:
        if os.path.isfile(path):  # .parquet / .csv / ...
            ds = datasets.load_dataset(path.rsplit(".", 1)[-1], data_files=path, split="train")
        elif path.startswith((".", "/", "~")):
            raise SystemExit(f"{path}: file does not exist")
        else:
            ds = datasets.load_dataset(path, config_name, split=split)
    except SystemExit:
        raise
    except Exception as e:  # the hub, the network or the file format: one line, no trace
        raise SystemExit(f"{path}: could not be loaded with datasets ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})")
    return [(path, f"{path}[{split}] row {i}", r) for i, r in enumerate(ds)]


def _need(row, field, where, schema, kind=str):
    """row[field], checked to be present and of type `kind`; else a one-line SystemExit.
    For kind=str a JSON scalar is turned into text (6 PandaLM rows hold `true` as a response)."""
    v = row.get(field)
    if v is None:
        raise SystemExit(f"{where}: missing field {field!r} (schema {schema})")
    if kind is str and isinstance(v, (bool, int, float)):
        return str(v)
    if kind is not None and not isinstance(v, kind):
        raise SystemExit(f"{where}: field {field!r} must be {getattr(kind, '__name__', kind)}, "
                         f"got {type(v).__name__} (schema {schema})")
    return v


def render_turns(turns, where):
    """A conversation as plain text. str -> itself; list of {role, content} -> 'User: ...' /
    'Assistant: ...' blocks separated by blank lines (HelpSteer3 `context`)."""
    if isinstance(turns, str):
        return turns
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "content" in t for t in turns):
        raise SystemExit(f"{where}: field 'context' must be a string or a list of {{role, content}} turns")
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    return "\n\n".join(f"{names.get(t.get('role'), str(t.get('role')).title())}: {t['content']}" for t in turns)


def _split_hh(chosen, rejected):
    """hh-rlhf: the prompt is embedded in both transcripts ('\\n\\nHuman: ...\\n\\nAssistant: ...').
    Context = the common part up to the last '\\n\\nAssistant:' that both share; responses = what
    follows it. Using the longest common prefix (not chosen.rfind) handles the 5 rows of the
    harmless-base test split whose chosen response itself contains '\\n\\nAssistant:'."""
    marker = "\n\nAssistant:"
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    cut = chosen.rfind(marker, 0, k)
    if cut < 0:
        return None
    context = chosen[:cut].strip()
    return context, chosen[cut + len(marker):].strip(), rejected[cut + len(marker):].strip()


def _text_field(value, where, field):
    """A critique part as text: a string, or a list of strings (one point per line)."""
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(v.strip() for v in value if v.strip())
    if not isinstance(value, str):
        raise SystemExit(f"{where}: field {field!r} must be a string or a list of strings, got {type(value).__name__}")
    return value.strip()


# The released data's critique parts, per response (reward_function.py of the authors' release)
STRUCTURED_KEYS = ("strengths_A", "weaknesses_A", "strengths_B", "weaknesses_B")


def _rm_nlhf_pair(where, row, stem, n):
    """One row of the RM-NLHF authors' released data (hub: Tongyi-ConvAI/RM-NLHF; read by their
    Character-GenRM-NLHF code in liudan193/Qwen-Character). Everything is in `extra_info` (a dict
    or its JSON text): context (list of {role, content} or str), response_A, response_B, winner
    'A'|'B', dataset_type, and for rows with human feedback processed_critique = {strengths_A,
    weaknesses_A, strengths_B, weaknesses_B}. A row without those parts is a D_O row."""
    info = row["extra_info"]
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{where}: field 'extra_info' is not valid JSON ({e.msg})")
    if not isinstance(info, dict):
        raise SystemExit(f"{where}: field 'extra_info' must be an object (schema rm_nlhf)")
    schema = "rm_nlhf"
    turns = _need(info, "context", where, schema, kind=None)
    winner = _need(info, "winner", where, schema)
    if winner not in ("A", "B"):
        raise SystemExit(f"{where}: field 'extra_info.winner' must be 'A' or 'B', got {winner!r}")
    parts, pc = None, info.get("processed_critique")
    if isinstance(pc, dict) and any(_text_field(pc.get(k), where, k) for k in STRUCTURED_KEYS):
        # 'Response A/B' (or 'Chatbot A/B') inside a part -> 'Response 1/2', relabelled after the shuffle
        ab = lambda t: re.sub(r"\b(?:[Rr]esponse|[Cc]hatbot)\s*([AB])\b",
                              lambda m: f"Response {'1' if m.group(1) == 'A' else '2'}", t)
        parts = {k: {kind: ab(_text_field(pc.get(f"{kind}_{letter}"), where, f"{kind}_{letter}"))
                     for kind in ("strengths", "weaknesses")} for k, letter in ((1, "A"), (2, "B"))}
    meta = {"dataset_type": info.get("dataset_type")}
    if isinstance(turns, list):
        meta["turns"] = turns
    return [{"id": str(info.get("id", row.get("id", f"{stem}:{n}"))), "context": render_turns(turns, where),
             "r1": _need(info, "response_A", where, schema), "r2": _need(info, "response_B", where, schema),
             "winner": 1 if winner == "A" else 2, "critique": None, "critique_parts": parts,
             "source": f"{schema}/{stem}", "meta": meta}]


def structured_critique(parts):
    """A human critique kept per response (RM-NLHF §2.3's human critiques; the authors' released
    data stores them as strengths and weaknesses of A and of B) as the text the judge reads:

        Response A strengths: ...
        Response A weaknesses: ...
        Response B strengths: ...
        Response B weaknesses: ...

    Args: parts: {"A": {"strengths": str, "weaknesses": str}, "B": {...}} (empty -> "none noted").
    Returns: str."""
    return "\n".join(f"Response {letter} {kind}: {parts[letter][kind].strip() or 'none noted'}"
                     for letter in "AB" for kind in ("strengths", "weaknesses"))


def _raw_pairs(schema, where, row, stem, n):
    """One row (the n-th of its file, 0-based; default id '<stem>:<n>') -> list of 'raw' pairs in
    the row's own order: {id, context, r1, r2, winner: 1|2, critique (refers to 'Response 1'/
    'Response 2') or None, optional critique_parts {1: {strengths, weaknesses}, 2: {...}}
    (a critique kept per response; finalize_pair renders it), source, meta}. [] = dropped (tie).
    Mr-Ben is built per question in `_mr_ben_pairs` instead."""
    src = f"{schema}/{stem}"
    base = {"critique": None, "source": src, "meta": {}}
    if schema == "rm_nlhf":
        return _rm_nlhf_pair(where, row, stem, n)
    if schema == "reward_bench_2":
        # RewardBench 2: 1 chosen vs 3 rejected; one pair per rejected response, grouped by the
        # row id (meta.group) so an evaluation can apply its best-of-4 rule (the chosen response
        # must win all three). Ties rows (several right answers, scored by their own rule) are
        # dropped.
        if row.get("subset") == "Ties":
            return []
        chosen = _need(row, "chosen", where, schema, kind=list)
        rejected = _need(row, "rejected", where, schema, kind=list)
        if len(chosen) != 1 or not rejected or not all(isinstance(s, str) for s in chosen + rejected):
            raise SystemExit(f"{where}: fields 'chosen'/'rejected' must be lists of strings, one chosen (schema {schema})")
        group = str(row.get("id", f"{stem}:{n}"))
        return [dict(base, id=f"{group}:{k}", context=render_turns(_need(row, "prompt", where, schema, kind=None), where),
                     r1=chosen[0], r2=r, winner=1, meta={"subset": row.get("subset"), "group": group,
                                                         "group_size": len(rejected)})
                for k, r in enumerate(rejected)]
    if schema == "helpsteer3":
        pref = _need(row, "overall_preference", where, schema, kind=int)
        if isinstance(pref, bool) or not -3 <= pref <= 3:
            raise SystemExit(f"{where}: field 'overall_preference' must be an integer in -3..3, got {pref!r}")
        if pref == 0:
            return []  # tie: no winner to learn (docs/method.md §5.1)
        # the annotators' reasonings are comparative ("@Response 1 is better because ..."), not
        # per response, so they stay one text (docs/method.md §5.1); the authors' release holds
        # them split per response (schema rm_nlhf)
        reasons = [p.get("reasoning") for p in row.get("individual_preference") or [] if isinstance(p, dict)]
        critique = "\n".join(r.strip() for r in reasons if isinstance(r, str) and r.strip()) or None
        turns = _need(row, "context", where, schema, kind=None)
        meta = {"overall_preference": pref, **({"turns": turns} if isinstance(turns, list) else {})}
        return [dict(base, id=str(row.get("id", f"{stem}:{n}")), context=render_turns(turns, where),
                     r1=_need(row, "response1", where, schema), r2=_need(row, "response2", where, schema),
                     winner=1 if pref < 0 else 2,  # negative = response1 better (HelpSteer3 card)
                     critique=critique, meta=meta)]
    if schema == "pandalm":
        votes = [_need(row, f"annotator{k}", where, schema, kind=int) for k in (1, 2, 3)]
        if any(v not in (0, 1, 2) for v in votes):
            raise SystemExit(f"{where}: annotator labels must be 0, 1 or 2, got {votes}")
        top = max((1, 2), key=votes.count)
        if votes.count(top) < 2:
            return []  # no majority for either response (or majority tie '0'): dropped
        context = _need(row, "instruction", where, schema)
        if row.get("input"):
            context += "\n\n" + row["input"]
        return [dict(base, id=f"pandalm:{row.get('idx', n)}", context=context,
                     r1=_need(row, "response1", where, schema), r2=_need(row, "response2", where, schema),
                     winner=top, meta={"votes": votes})]
    if schema == "llmbar":
        label = _need(row, "label", where, schema, kind=int)
        if label not in (1, 2):
            raise SystemExit(f"{where}: field 'label' must be 1 or 2, got {label!r}")
        return [dict(base, id=f"{stem}:{n}", context=_need(row, "input", where, schema),
                     r1=_need(row, "output_1", where, schema), r2=_need(row, "output_2", where, schema),
                     winner=label)]
    if schema == "judgebench":
        label = _need(row, "label", where, schema)
        if label not in ("A>B", "B>A"):
            if label in ("A=B", "B=A"):
                return []
            raise SystemExit(f"{where}: field 'label' must be 'A>B' or 'B>A', got {label!r}")
        return [dict(base, id=str(row.get("pair_id", f"{stem}:{n}")), context=_need(row, "question", where, schema),
                     r1=_need(row, "response_A", where, schema), r2=_need(row, "response_B", where, schema),
                     winner=1 if label == "A>B" else 2, meta={"category": row.get("source")})]
    if schema == "rm_bench":
        chosen = _need(row, "chosen", where, schema, kind=list)
        rejected = _need(row, "rejected", where, schema, kind=list)
        if not chosen or len(chosen) != len(rejected) or not all(isinstance(s, str) for s in chosen + rejected):
            raise SystemExit(f"{where}: fields 'chosen'/'rejected' must be equal-length lists of strings")
        # the full style grid (upstream scoring): i > j easy, i == j normal, i < j hard accuracy,
        # with 0 concise, 1 detailed plain, 2 detailed markdown
        return [dict(base, id=f"{stem}:{row.get('id', n)}:{i}{j}", context=_need(row, "prompt", where, schema),
                     r1=c, r2=r, winner=1, meta={"subset": row.get("subset"), "chosen_style": i, "rejected_style": j})
                for i, c in enumerate(chosen) for j, r in enumerate(rejected)]
    if schema == "chosen_rejected":
        chosen, rejected = _need(row, "chosen", where, schema), _need(row, "rejected", where, schema)
        if row.get("prompt") is not None:
            context = render_turns(row["prompt"], where)
        else:  # hh-rlhf: prompt embedded in the transcripts
            split = _split_hh(chosen, rejected)
            if split is None:
                raise SystemExit(f"{where}: no 'prompt' field and no '\\n\\nAssistant:' turn in "
                                 f"'chosen'/'rejected' (schema {schema})")
            context, chosen, rejected = split
        if chosen == rejected:
            return []
        critique = row.get("critique")
        return [dict(base, id=str(row.get("id", f"{stem}:{n}")), context=context,
                     r1=chosen, r2=rejected, winner=1,
                     critique=critique.strip() or None if isinstance(critique, str) else None)]
    raise SystemExit(f"{where}: schema {schema!r} unknown; known: {', '.join(PAIR_SCHEMAS)}")


def _mr_ben_pairs(rows, stem):
    """Mr-Ben math as D_H: for every question, every (correct, incorrect) pair of its solutions.
    Critique, kept per response (structured_critique): the correct solution's strength is being
    correct; the incorrect one's weakness is its first error step and the human error reasons
    (`Model_Solution_Error_Reason`, one per annotator). 306 questions on disk give 192 pairs
    (58 questions with 1 correct of 3 and 38 with 2 of 3, each giving 2 pairs)."""
    by_q = {}
    for where, row in rows:
        for f in PAIR_SCHEMAS["mr_ben"]:
            _need(row, f, where, "mr_ben", kind=None)
        if row["Model_Solution_Correctness"] not in ("correct", "incorrect"):
            raise SystemExit(f"{where}: field 'Model_Solution_Correctness' must be 'correct' or "
                             f"'incorrect', got {row['Model_Solution_Correctness']!r}")
        if row["Model_Solution_Correctness"] == "incorrect":
            reasons = row.get("Model_Solution_Error_Reason")
            if not isinstance(reasons, list) or not any(isinstance(r, str) and r.strip() for r in reasons):
                raise SystemExit(f"{where}: incorrect solution without 'Model_Solution_Error_Reason' texts")
        by_q.setdefault(row["Question_UUID"], []).append((where, row))
    pairs = []
    for qid, sols in by_q.items():
        good = [r for _, r in sols if r["Model_Solution_Correctness"] == "correct"]
        bad = [r for _, r in sols if r["Model_Solution_Correctness"] == "incorrect"]
        for g in good:
            for b in bad:
                step = b.get("Model_Solution_First_Error_Step")
                reasons = [r.strip() for r in b["Model_Solution_Error_Reason"] if isinstance(r, str) and r.strip()]
                parts = {1: {"strengths": "Its solution is correct.", "weaknesses": ""},
                         2: {"strengths": "", "weaknesses": f"Its solution is incorrect; the first error is in step {step}. "
                                                            + " ".join(reasons)}}
                context = g["Question"] + ("\n\nOptions:\n" + g["Options"].strip() if g.get("Options") else "")
                pairs.append({"id": f"{qid}:{g.get('Sampled_Model')}>{b.get('Sampled_Model')}",
                              "context": context, "r1": "\n".join(g["Model_Solution_Steps"]),
                              "r2": "\n".join(b["Model_Solution_Steps"]), "winner": 1, "critique": None,
                              "critique_parts": parts,
                              "source": f"mr_ben/{stem}",
                              "meta": {"first_error_step": step, "subject": g.get("Subject")}})
    return pairs


def _relabel(text, one, two):
    """Rewrite '(@)Response 1/2' references in a critique to the final letters (HelpSteer3
    reasonings say '@Response 1'); the judge matches stance per response, so the letters in the
    human critique must follow the A/B shuffle."""
    return re.sub(r"@?\b[Rr]esponse\s*([12])\b", lambda m: f"Response {one if m.group(1) == '1' else two}", text)


def finalize_pair(raw, seed, shuffle=True):
    """Raw pair (r1, r2, winner 1|2) -> the public dict, A/B order randomised per item.

    The coin for an item is random.Random(f'{seed}:{id}') (string seeds are hashed with SHA-512,
    so the order is stable across runs and independent of which other rows were loaded).

    Returns:
        {"id", "context", "response_a", "response_b", "winner": "A"|"B", "critique": str|None,
         "source", "meta"}
    """
    swap = shuffle and random.Random(f"{seed}:{raw['id']}").random() < 0.5
    a, b = (raw["r2"], raw["r1"]) if swap else (raw["r1"], raw["r2"])
    winner = ("A" if raw["winner"] == 1 else "B") if not swap else ("B" if raw["winner"] == 1 else "A")
    one, two = ("B", "A") if swap else ("A", "B")  # the final letters of response 1 and response 2
    critique = raw["critique"]
    if critique is not None:
        critique = _relabel(critique, one, two)
    if raw.get("critique_parts"):
        parts = {letter: {k: _relabel(v, one, two) for k, v in raw["critique_parts"][n].items()}
                 for n, letter in ((1, one), (2, two))}
        critique = structured_critique(parts)
    return {"id": raw["id"], "context": raw["context"], "response_a": a, "response_b": b, "winner": winner,
            "critique": critique, "source": raw["source"], "meta": dict(raw["meta"], swapped=swap)}


def load_pairwise(path_or_hub_id, schema="auto", seed=0, shuffle=True, split="train", max_items=None,
                  stats=None, config_name=None):
    """Load pairwise preference items (docs/method.md §5.1).

    Args:
        path_or_hub_id: local .jsonl/.json (or .parquet/.csv), a folder of .jsonl/.json files, or
            a Hugging Face dataset id (read with datasets.load_dataset(id, config_name, split=split);
            HelpSteer3: 'nvidia/HelpSteer3', its default config is the preference subset).
        schema: 'auto' (per file, from the first row's field names) or a key of PAIR_SCHEMAS:
            helpsteer3 (overall_preference < 0: response1 wins; 0: tie, dropped; critique =
            individual_preference[].reasoning joined by newlines), rm_nlhf (the RM-NLHF authors'
            release: extra_info with response_A/B, winner and a per-response processed_critique,
            see _rm_nlhf_pair), mr_ben (correct-vs-incorrect pairs, critique per response =
            human error reasons), reward_bench_2 (one pair per rejected response, meta.group =
            the row; Ties dropped), pandalm (majority of 3 annotators; no
            majority or majority tie dropped), llmbar (label 1|2), judgebench ('A>B'|'B>A'),
            rm_bench (3x3 style grid per row, meta holds the styles), chosen_rejected (prompt +
            chosen + rejected strings, or hh-rlhf transcripts; optional 'critique' field).
        seed: int, the A/B shuffling seed. shuffle: False keeps the dataset's own order (response1
            / chosen first), e.g. for evaluating both orders.
        max_items: keep the first N items (after dropping ties), None = all.
        stats: optional dict, filled with {'rows', 'items', 'dropped' (rows giving no item: ties,
            Mr-Ben questions without a correct/incorrect pair), 'schema' (list of names)}.
    Returns:
        list of {"id", "context", "response_a", "response_b", "winner": "A"|"B",
                 "critique": str|None, "source", "meta": dict}. D_H = items with a critique.
    Raises:
        SystemExit, one line naming the file, line and field, on any malformed row or unknown schema.
    """
    if schema != "auto" and schema not in PAIR_SCHEMAS:
        raise SystemExit(f"schema {schema!r} unknown; allowed: auto, {', '.join(PAIR_SCHEMAS)}")
    rows = _read_rows(path_or_hub_id, split, config_name)
    if not rows:
        raise SystemExit(f"{path_or_hub_id}: no rows")
    by_file = {}  # a folder may mix schemas: one schema per file
    for file, where, row in rows:
        by_file.setdefault(file, []).append((where, row))
    raw, names, dropped = [], [], 0
    for file, frows in by_file.items():
        name = detect_schema(frows[0][1], frows[0][0]) if schema == "auto" else schema
        names.append(name)
        stem = os.path.splitext(os.path.basename(file))[0] or file
        if name == "mr_ben":
            pairs = _mr_ben_pairs(frows, stem)
            used = {p["id"].split(":")[0] for p in pairs}
            dropped += sum(r["Question_UUID"] not in used for _, r in frows)  # no correct/incorrect pair
            raw += pairs
        else:
            for n, (where, row) in enumerate(frows):
                if not isinstance(row, dict):
                    raise SystemExit(f"{where}: expected a JSON object, got {type(row).__name__}")
                pairs = _raw_pairs(name, where, row, stem=stem, n=n)
                dropped += not pairs  # ties
                raw += pairs
    items = [finalize_pair(r, seed, shuffle) for r in raw]
    if max_items is not None:
        items = items[:max_items]
    if stats is not None:
        stats.update(rows=len(rows), items=len(items), dropped=dropped, schema=sorted(set(names)))
    return items


def load_dh_items(cfg):
    """D_H (RM-NLHF §3.2.1; docs/method.md §5.1): pairwise items WITH a human critique, from
    nlhf.dh; items without one are dropped. Returns list of load_pairwise dicts. SystemExit (one
    line) on bad data or when no item has a critique."""
    nl = cfg["nlhf"]
    items = [it for it in load_pairwise(nl["dh"], schema=nl["dh_schema"], seed=cfg["run"]["seed"],
                                        split=nl["dh_split"], config_name=nl["dh_config"]) if it["critique"]]
    if not items:
        raise SystemExit(f"config key nlhf.dh={nl['dh']}: no item has a human critique (D_H needs them)")
    return items[:nl["max_items"]] if nl["max_items"] else items


def load_do_items(cfg):
    """D_O (RM-NLHF §3.2.1; docs/method.md §5.1): pairwise items from nlhf.do with any critique
    removed (their process reward comes from the MetaRM). [] when nlhf.do is null."""
    nl = cfg["nlhf"]
    if not nl["do"]:
        return []
    items = [dict(it, critique=None)
             for it in load_pairwise(nl["do"], schema=nl["do_schema"], seed=cfg["run"]["seed"], split=nl["do_split"],
                                     config_name=nl["do_config"])]
    return items[:nl["max_items"]] if nl["max_items"] else items


# ----------------------------------------------------------------------------------------------
# The judge's client (one request with retries and backoff) and the offline proxy judge


# The keys of config.yaml's `judge:` section, which holds their defaults and meanings (the only copy).
JUDGE_KEYS = ("backend", "variant", "on_failure", "base_url", "model", "api_key_env", "concurrency", "timeout_s", "max_retries",
              "backoff_base_s", "backoff_max_s", "temperature", "max_tokens")


def make_judge(cfg):
    """Build the judge from the `judge:` config section (start-up checks happen here).

    Args:
        cfg: config.yaml's `judge:` section, every key of JUDGE_KEYS (config.load_config fills
            them from config.yaml).
    Returns:
        dict with the settings, plus 'client' (an openai.OpenAI with its own retries off: we retry
        ourselves) for backend 'openai'. The API key lives only inside the client object.
    Raises:
        SystemExit (one line): unknown or missing key, unknown backend, no model name, or api_key_env names an
        environment variable that is unset (a hosted judge would fail every call otherwise).
    """
    unknown, missing = set(cfg) - set(JUDGE_KEYS), set(JUDGE_KEYS) - set(cfg)
    if unknown or missing:
        raise SystemExit(f"judge: unknown key(s) {sorted(unknown)}, missing key(s) {sorted(missing)}; "
                         f"config.yaml's judge section has them all")
    j = dict(cfg)
    if j["variant"] not in JUDGE_VARIANTS:
        raise SystemExit(f"judge.variant: {j['variant']!r} unknown; allowed: {', '.join(JUDGE_VARIANTS)}")
    if j["on_failure"] not in ("mask", "zero"):
        raise SystemExit(f"judge.on_failure: {j['on_failure']!r} unknown; allowed: mask, zero")
    if j["backend"] == "proxy":
        return j
    if j["backend"] != "openai":
        raise SystemExit(f"judge.backend: {j['backend']!r} unknown; allowed: openai, proxy")
    if not j["model"]:
        raise SystemExit("judge.model: required for backend 'openai' (the model name the server serves)")
    j["client"] = openai_client(j["base_url"], j["api_key_env"], j["timeout_s"], where="judge.api_key_env",
                                needed_for=f"the judge at {j['base_url']}")
    return j


def openai_client(base_url, api_key_env, timeout_s, *, where, needed_for):
    """An openai.OpenAI client for an OpenAI-compatible server (the judge, a remote evaluator).

    Args:
        api_key_env: NAME of the environment variable holding the key, or None (a local server:
            it ignores the key, but the client insists on one). timeout_s: seconds per request.
        where, needed_for: for the error message.
    Returns:
        openai.OpenAI with max_retries 0: our call_with_retries does the retrying (and counts it).
    Raises:
        SystemExit (one line): api_key_env names a variable that is not set.
    """
    key = "EMPTY"
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise SystemExit(f"{where}: environment variable {api_key_env} is not set (needed for {needed_for})")
    import openai  # here, not at the top: only these servers need the package
    return openai.OpenAI(base_url=base_url, api_key=key, timeout=float(timeout_s), max_retries=0)


def backoff_delay(attempt, base, cap, u):
    """Seconds to wait before retry `attempt` (0-based): 'equal jitter' exponential backoff,
    d = min(cap, base * 2**attempt), delay = d/2 + u * d/2 with u ~ U[0, 1). Half the delay is
    guaranteed (the server gets a break), the other half spreads the clients out."""
    d = min(cap, base * 2 ** attempt)
    return d / 2 + u * d / 2


def call_with_retries(call, max_retries, backoff_base_s, backoff_max_s, sleep=time.sleep, rand=random.random):
    """One request to an OpenAI-compatible server, retried: the judge's and the remote evaluator's.

    Retried: HTTP 408/409/429/5xx, timeouts, refused connections, and answers that `call` rejects
    (it returns value None: an HTML page, an unparseable judge answer); other HTTP 4xx are not
    (they will not heal). Waits backoff_delay between tries.

    Args:
        call: () -> (value, why); raises the openai client's errors.
        max_retries: int, retries after the first try. backoff_base_s, backoff_max_s: backoff_delay's.
        sleep, rand: injectable for tests (waits and jitter draws).
    Returns:
        (value or None, why str: the last failure's reason, attempts int). Never raises.
    """
    import openai
    why, attempt = "", 0
    for attempt in range(int(max_retries) + 1):
        retry = True
        try:
            value, why = call()
            if value is not None:
                return value, why, attempt + 1
        except openai.APIStatusError as e:
            why = f"HTTP {e.status_code}"
            retry = e.status_code in (408, 409, 429) or e.status_code >= 500  # others will not heal
        except openai.APITimeoutError:
            why = "timeout"
        except openai.APIConnectionError as e:
            why = f"connection error: {type(e.__cause__ or e).__name__}"
        except Exception as e:  # anything else (bad JSON body, ...) is a failed call, not a crash
            why = f"{type(e).__name__}: {str(e)[:100]}"
        if not retry or attempt == int(max_retries):
            break
        sleep(backoff_delay(attempt, base=backoff_base_s, cap=backoff_max_s, u=rand()))
    return None, why, attempt + 1


def _judge_call(judge, prompt, sleep, rand):
    """One judge request (judge_prompt's text) with retries. Returns dict(f1, precision, recall,
    why, attempts)."""
    parse = parse_meta_judge_output if judge["variant"] == "meta_judge" else parse_judge_output

    def call():
        resp = judge["client"].chat.completions.create(
            model=judge["model"], messages=[{"role": "user", "content": prompt}],
            temperature=judge["temperature"], max_tokens=judge["max_tokens"])
        if isinstance(resp, str) or not getattr(resp, "choices", None):
            # the client hands back the raw body when the server does not answer JSON
            return None, f"not a chat completion (HTML page or wrong URL?): {str(resp)[:60]!r}"
        parsed = parse(resp.choices[0].message.content)
        return (parsed, "") if parsed["f1"] is not None else (None, "parse failure: " + parsed["why"])

    parsed, why, attempts = call_with_retries(call, judge["max_retries"], judge["backoff_base_s"],
                                              judge["backoff_max_s"], sleep=sleep, rand=rand)
    if parsed is not None:
        return dict(parsed, attempts=attempts)
    return {"precision": None, "recall": None, "f1": None, "why": why, "attempts": attempts}


# ----------------------------------------------------------------------------------------------
# The remote evaluator's client (reward.evaluators[].kind: remote; docs/scale-out.md, "Remote
# evaluators"): settings, the start-up probe, one /v1/completions request, the echo parser

# Settings of a remote evaluator and their defaults (config.yaml's reward.evaluators comment
# documents them; config.validate_config fills them in for `kind: remote` entries).
REMOTE_DEFAULTS = {"api_key_env": None, "timeout_s": 60.0, "max_retries": 4, "backoff_base_s": 1.0,
                   "backoff_max_s": 30.0, "concurrency": 4, "batch_size": 1, "max_tokens": 0}


def remote_evaluator(base_url, model, *, name="remote", weight=1.0, tokenizer=None, chat_template="auto",
                     system_prompt=None, chat_template_kwargs=None, probe=True, where=None, config_key=None,
                     answer_stub="\nAnswer:", score_requests=None, **settings):
    """A remote evaluator j as the dict rlme_reward reads: log p(target | prompt) from an
    OpenAI-compatible /v1/completions server that returns prompt log-probs (`echo` + `logprobs`:
    vllm serve, llama-cpp-python's server; docs/scale-out.md). Usable outside train.py too:
    reward.trl_reward_function([reward.remote_evaluator("http://127.0.0.1:8000/v1", "M")], ...).

    Args:
        base_url: str, e.g. "http://127.0.0.1:8000/v1". model: str, the model name the server serves.
        name, weight: as load_evaluator.
        tokenizer: None (plain-text prompts: text + answer stub) or a path (HF folder, hub id,
            GGUF) whose tokenizer's chat template renders the prompt; it must be the served
            model's tokenizer.
        chat_template: "auto" (= a tokenizer with a chat template is given, unless its path
            names a "-Base" model) | True | False.
        system_prompt, chat_template_kwargs: the chat options, as load_evaluator.
        probe: score one short text now (a 1-line SystemExit if that fails: an unreachable server,
            one that ignores echo/logprobs, one that refuses batch_size prompts in one request).
        where: str naming the evaluator in error messages (default f"remote evaluator {name}").
        config_key: "reward.evaluators[i]" when built from a config (chat-option errors name its
            keys), else None (they name the command-line flags).
        answer_stub: appended to plain-text prompts (as local_evaluator).
        score_requests: score_remote (default: one request per text) or fast.score_remote
            (batch_size texts per request, concurrency requests in flight; the same numbers).
        settings: REMOTE_DEFAULTS's keys: api_key_env (NAME of the variable holding the key; None =
            a local server), timeout_s per request, max_retries after the first try,
            backoff_base_s / backoff_max_s (backoff_delay), concurrency (requests in flight),
            batch_size (texts per request; 1 for llama-cpp-python, whose server takes one),
            max_tokens (sent with echo: 0 for vLLM; llama-cpp-python reads 0 as "no limit": 1).
    Returns:
        dict {"name", "weight", "score", "failures" (each text's failure reason in the last
        call, "" where scored), "remote" (settings + "client", "base_url", "model"), and for
        inspection "tokenizer", "chat"}; score returns NaN for a text whose request failed after
        its retries.
    Raises:
        SystemExit (one line): an unknown setting or bad value, an unset api_key_env variable, a
            chat template asked for without a tokenizer, a failed probe.
    """
    where = where or f"remote evaluator {name}"
    score_requests = score_requests or score_remote
    unknown = set(settings) - set(REMOTE_DEFAULTS)
    if unknown:
        raise SystemExit(f"{where}: unknown setting(s) {sorted(unknown)} (known: {', '.join(REMOTE_DEFAULTS)})")
    r = dict(REMOTE_DEFAULTS, **settings, base_url=base_url, model=model)
    if not base_url or not model:
        raise SystemExit(f"{where}: needs base_url and model (the model name the server serves)")
    for key, low in (("timeout_s", 1e-9), ("max_retries", 0), ("backoff_base_s", 0), ("backoff_max_s", 0),
                     ("concurrency", 1), ("batch_size", 1), ("max_tokens", 0)):
        if not isinstance(r[key], (int, float)) or isinstance(r[key], bool) or r[key] < low:
            raise SystemExit(f"{where}: {key} must be a number >= {low:g}, got {r[key]!r}")
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(rollout.resolve_model_path(tokenizer))
        except (OSError, ValueError) as e:  # no such folder, an offline hub, not a tokenizer
            raise SystemExit(f"{where}: path {tokenizer!r}: cannot load the tokenizer ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:150]})")
        except SystemExit as e:
            raise SystemExit(f"{where}: path: {e}")
    if chat_template is True and tok is None:
        raise SystemExit(f"{where}: chat_template true needs the served model's tokenizer (path) to render it")
    r["client"] = openai_client(base_url, r["api_key_env"], r["timeout_s"], where=f"{where}: api_key_env",
                                needed_for=base_url)
    if tok is None and (system_prompt is not None or chat_template_kwargs):
        raise SystemExit(f"{where}: system_prompt / chat_template_kwargs need the served model's tokenizer "
                         f"(path) to render the chat template; without it the prompt is plain text")
    chat = False if tok is None else rollout.use_chat_template(
        tok, chat_template, model_path=tokenizer, system=system_prompt, template_kwargs=chat_template_kwargs,
        key=config_key)
    # as evaluator_prompt_and_target_ids tokenises: a rendered chat string holds its BOS already
    r["add_special_tokens"] = not chat
    if probe:
        probe_remote(r, tok, chat, where)

    def score(texts, targets, groups=None):  # groups: unused (the server shares prefixes itself, or not)
        fulls = []
        for row in texts:
            for text, target in zip(row, targets):
                prompt, full = evaluator_prompt_text(tok, text, target, chat=chat, answer_stub=answer_stub)
                fulls.append((full, full[len(prompt):]))
        vals, whys = score_requests(r, fulls)
        ev["failures"][:] = whys  # rlme_reward reports the first reason
        return torch.tensor([float("nan") if v is None else v for v in vals]).view(len(texts), len(targets))
    ev = {"name": name, "weight": float(weight), "score": score, "failures": [], "remote": r, "tokenizer": tok,
          "chat": chat}
    return ev


def probe_remote(r, tokenizer, chat, where):
    """Start-up check of a remote evaluator (`r`: its settings): score batch_size copies of one
    short text (one request, the configured retries). Raises SystemExit, one line, naming the
    evaluator, the server and the reason."""
    prompt, full = evaluator_prompt_text(tokenizer, "Is 2 + 2 = 4? Reply with Yes or No.", "Yes",
                                         chat=chat, answer_stub="\nAnswer:")
    texts = [(full, full[len(prompt):])] * r["batch_size"]
    vals, whys = remote_request(r, texts)
    if any(v is None for v in vals):
        why = next(w for w in whys if w)
        hint = " (set batch_size: 1: the server takes one prompt per request)" if r["batch_size"] > 1 else ""
        raise SystemExit(f"{where}: cannot score at {r['base_url']} (model {r['model']}): {why}{hint}")


def remote_request(r, fulls, sleep=time.sleep, rand=random.random):
    """One /v1/completions request for a list of texts, with retries (call_with_retries): echo the
    texts with their log-probs, generate nothing (max_tokens r["max_tokens"], temperature 0).

    Args:
        r: a remote evaluator's settings (remote_evaluator's ev["remote"]).
        fulls: list of (full text, suffix): the target's log p is read from the tokens spelling
            `suffix` at the end of `full` (echo_target_logprob).
    Returns:
        (list of float or None, list of str reasons: "" where scored). Never raises. A failed
        request fails all its texts; an answer that cannot be read fails only its text (not
        retried: the same request gets the same answer).
    """
    def call():
        resp = r["client"].completions.create(
            model=r["model"], prompt=[f for f, _ in fulls] if len(fulls) > 1 else fulls[0][0],
            max_tokens=r["max_tokens"], echo=True, logprobs=1, temperature=0.0,
            # a chat string holds its BOS: vLLM's switch not to add another (as our tokenizer call);
            # sent only then, as strict servers refuse unknown fields (transformers serve: HTTP 422)
            extra_body={} if r.get("add_special_tokens", True) else {"add_special_tokens": False})
        choices = None if isinstance(resp, str) else getattr(resp, "choices", None)
        if not choices or len(choices) != len(fulls):
            return None, (f"not a completion for {len(fulls)} prompt(s) (HTML page or wrong URL?): "
                          f"{str(resp)[:60]!r}")
        choices = sorted(choices, key=lambda c: c.index or 0)
        return [echo_target_logprob(c.model_dump() if hasattr(c, "model_dump") else c, full, suffix)
                for c, (full, suffix) in zip(choices, fulls)], ""

    out, why, _ = call_with_retries(call, r["max_retries"], r["backoff_base_s"], r["backoff_max_s"],
                                    sleep=sleep, rand=rand)
    if out is None:
        return [None] * len(fulls), [why] * len(fulls)
    return [o[0] for o in out], [o[1] for o in out]


def echo_target_logprob(choice, full, suffix):
    """The target's log p from one echoed completion choice: the sum of the echoed log-probs of
    the tokens whose texts spell `suffix` at the end of the echoed `full` text.

    The boundary is found from the end, by token texts, not by text_offset: llama-cpp-python's
    offsets leave out special tokens (a chat prompt's <|im_start|>) and vLLM's count a BOS, so
    offsets are not positions in our string; the tokens that end the echo are the same text on
    every server. Tokens the server generated after the echo (max_tokens >= 1: choice["text"] is
    full + what it generated) are dropped first when listed (vLLM lists them, llama-cpp-python does
    not); a prompt that itself ends in target + generated text would be misread, which our
    prompts (ending in "Answer:" or a chat header) never do.

    Args:
        choice: dict, an OpenAI completion choice {"text", "logprobs": {"tokens",
            "token_logprobs", ...}}.
        full: str, the text sent (prompt + suffix). suffix: str, the target as it follows the
            prompt (" Yes").
    Returns:
        (float, "") or (None, reason) when the answer cannot be read safely: no log-probs (the
        server ignores echo/logprobs), the echo does not start with `full`, a token straddles the
        prompt/target boundary or the target tokens do not spell `suffix` (a tokenizer differing
        from the one the prompt was built for), a missing or non-finite log-prob.
    """
    lp = choice.get("logprobs") or {}
    tokens, values = lp.get("tokens"), lp.get("token_logprobs")
    if not tokens or not isinstance(values, list) or len(values) != len(tokens):
        return None, "no prompt log-probs in the answer (does the server support echo with logprobs?)"
    text = choice.get("text")
    if not isinstance(text, str) or not text.startswith(full):
        return None, f"the answer does not echo the prompt (text starts {str(text)[:40]!r})"
    # tokens generated after the echo are listed by vLLM, not by llama-cpp-python: drop them when
    # the listed tokens end with target + generated text
    generated, end, tail = text[len(full):], len(tokens), ""
    if generated and "".join(tokens).endswith(suffix + generated):
        while end > 0 and len(tail) < len(generated):
            end -= 1
            tail = tokens[end] + tail
        if tail != generated:
            return None, f"cannot separate the generated tokens {tail!r} from the echo (generated {generated!r})"
    if end == 0 or not tokens[end - 1]:
        return None, "the echo ends in an empty token (an end-of-text token?): cannot tell where the target is"
    start, spelled = end, ""
    while start > 0 and len(spelled) < len(suffix):
        start -= 1
        spelled = tokens[start] + spelled
    if spelled != suffix:
        reason = ("a token straddles the prompt and the target" if spelled.endswith(suffix)
                  else "the last tokens do not spell the target (a different tokenizer?)")
        return None, f"{reason}: tokens {tokens[start:end]!r}, target {suffix!r}"
    vals = values[start:end]
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in vals):
        return None, f"missing or non-finite log-prob for the target tokens: {vals!r}"
    return float(sum(vals)), ""


# Offline PROXY of the judge (no server). It is a lexical stand-in for tests and laptops, not the
# paper's LLM judge: it cannot tell paraphrases or stances apart beyond shared content words.
_STOP = set("""a an the and or but if then than so of to in on at by for with from as is are was
were be been being it its this that these those there here which who whom what when where why how
not no yes do does did done has have had can could should would will shall may might must very
also just only more most less least such both each other into about over under again further
their they them he she his her we our you your i me my too response""".split())


def _points(text):
    """Sentence-level points of a critique as sets of content words. 'Response A' / 'Response B'
    become the tokens 'resp_a' / 'resp_b' so the response a point is about survives."""
    text = re.sub(r"\bresponse\s+([ab])\b", r"resp_\1", (text or "").lower())
    out = []
    for sent in re.split(r"(?<=[.!?;])\s+|\n+", text):
        words = {w for w in re.findall(r"[a-z0-9_]+", sent) if w not in _STOP}
        if words:
            out.append(words)
    return out


def _dice(x, y):
    return 2 * len(x & y) / (len(x) + len(y))


def proxy_f1(human, model, match=0.4, repeat=0.8):
    """PROXY critique similarity: F1 of greedily matched sentence-level points (lexical).

    Points = sentences as content-word sets (_points). Repetition check first: two candidate
    points with Dice overlap >= `repeat` -> F1 0. Then pairs (human point, model point) with
    Dice >= `match` are matched greedily by decreasing overlap, each point at most once;
    precision = M / C, recall = M / H, F1 = 2PR / (P + R) (0 when M = 0).

    Returns dict(f1, precision, recall, why); f1 None (why 'empty human critique') when the human
    critique has no content words.
    """
    hp, mp = _points(human), _points(model)
    if not hp:
        return {"f1": None, "precision": None, "recall": None, "why": "proxy: empty human critique"}
    for i in range(len(mp)):
        for j in range(i + 1, len(mp)):
            if _dice(mp[i], mp[j]) >= repeat:
                return {"f1": 0.0, "precision": 0.0, "recall": 0.0, "why": "proxy: repetition"}
    cand = sorted(((_dice(h, m), i, j) for i, h in enumerate(hp) for j, m in enumerate(mp)), reverse=True)
    used_h, used_m = set(), set()
    for sim, i, j in cand:
        if sim >= match and i not in used_h and j not in used_m:
            used_h.add(i)
            used_m.add(j)
    m = len(used_h)
    p, r = (m / len(mp) if mp else 0.0), m / len(hp)
    f1 = 2 * p * r / (p + r) if m else 0.0
    return {"f1": f1, "precision": p, "recall": r, "why": "proxy"}


# ----------------------------------------------------------------------------------------------
# CLI: JSONL (problem, completion[, reference]) in, the same rows with the RLME reward out


def read_scoring_rows(path, problem_field="problem", completion_field="completion", reference_field="reference"):
    """The rows `python reward.py` scores, checked before any model loads.

    Args:
        path: str, a JSONL file (our samples.jsonl has the fields problem and completion).
        problem_field, completion_field: str fields that every row must hold.
        reference_field: optional field; a row where it holds a str or number is scored with the
            reference answer shown to the evaluator (anchored, docs/method.md §4.2).
    Returns:
        (rows list[dict], problems list[str], completions list[str], references list[str | None]).
    Raises:
        SystemExit (one line naming file and line): no file, invalid JSON, no rows, a missing or
            non-string problem / completion, a reference that is not a str or number.
    """
    rows = read_jsonl(path)
    if not rows:
        raise SystemExit(f"{path}: no rows (the file is empty)")
    problems, completions, references = [], [], []
    for n, row in rows:
        for field, flag, out in ((problem_field, "--problem-field", problems),
                                 (completion_field, "--completion-field", completions)):
            if field not in row:
                raise SystemExit(f"{path}:{n}: missing field {field!r} (fields found: {sorted(row)}; "
                                 f"{flag} names another)")
            if not isinstance(row[field], str):
                raise SystemExit(f"{path}:{n}: field {field!r} must be a string, got {type(row[field]).__name__}")
            out.append(row[field])
        ref = row.get(reference_field)
        if ref is not None and (isinstance(ref, bool) or not isinstance(ref, (str, int, float))):
            raise SystemExit(f"{path}:{n}: field {reference_field!r} must be a string or number, "
                             f"got {type(ref).__name__}")
        references.append(None if ref is None else str(ref))
    return [row for _, row in rows], problems, completions, references


def main(argv=None):
    """`python reward.py`: score a JSONL file with one frozen evaluator (RLME Eq. 2-3) and write
    each row back with "logp" {evaluator: {question: log p}} and "reward" added. Existing "logp" /
    "reward" fields (as in samples.jsonl) are replaced. Input errors end in one line before the
    model loads."""
    # defaults shown as "(default: ...)" in --help, written out: argparse's own formatter also
    # prints "(default: None)" for the required and the unset options
    ap = rollout.ArgumentParser(
        description="Score JSONL rows (problem, completion[, reference]) with the RLME reward "
                    "r = sum_k w_k log p(target | problem, completion, question_k) of one evaluator (RLME Eq. 2-3).")
    ap.add_argument("--evaluator", required=True,
                    help="evaluator model: HF folder, hub id or GGUF file; or remote:URL, an OpenAI-compatible "
                         "server returning prompt log-probs (remote:http://127.0.0.1:8000/v1; docs/scale-out.md)")
    ap.add_argument("--remote-model", default=None, help="remote: the model name the server serves (required)")
    ap.add_argument("--remote-tokenizer", default=None,
                    help="remote: the served model's tokenizer (folder, hub id, GGUF), to render its chat template; "
                         "without it the prompt is plain text + answer stub")
    ap.add_argument("--remote-max-tokens", type=int, default=0,
                    help="remote: max_tokens sent with echo (vLLM 0; llama-cpp-python 1) (default: %(default)s)")
    ap.add_argument("--remote-batch-size", type=int, default=1,
                    help="remote: prompts per request (vLLM: many; llama-cpp-python: 1) (default: %(default)s)")
    ap.add_argument("--remote-max-retries", type=int, default=4,
                    help="remote: retries of a failed request; then its rows get reward null (default: %(default)s)")
    ap.add_argument("--in", dest="inp", required=True, help="JSONL input, one row per line")
    ap.add_argument("--out", required=True, help="JSONL output: the input rows plus logp and reward")
    ap.add_argument("--question", action="append", default=None,
                    help="meta-question, weight 1; repeat for several (default: 'Is the answer correct?')")
    ap.add_argument("--target", default="Yes", help="target answer a_k of every question (default: %(default)s)")
    ap.add_argument("--template-file", default=None,
                    help="evaluator template file with {problem} {solution} {extracted} {reference} {question} "
                         "(default: reward.DEFAULT_EVALUATOR_TEMPLATE)")
    ap.add_argument("--answer-stub", default="\nAnswer:",
                    help="appended to plain-text (non-chat) evaluator prompts; a newline in bash: $'\\nAnswer:' "
                         "(default: %(default)r)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="samples per scoring forward (default: %(default)s)")
    ap.add_argument("--transform", default="log", choices=["log", "prob"],
                    help="log: sum of log p (RLME Eq. 3) | prob: sum of p (default: %(default)s)")
    ap.add_argument("--problem-field", default="problem", help="input field holding the problem (default: %(default)s)")
    ap.add_argument("--completion-field", default="completion",
                    help="input field holding the answer to score (default: %(default)s)")
    ap.add_argument("--reference-field", default="reference",
                    help="optional input field; a row that has it is scored with this reference answer shown "
                         "to the evaluator (default: %(default)s)")
    ap.add_argument("--evaluator-name", default="evaluator",
                    help="the evaluator's key in the output logp dicts (default: %(default)s)")
    ap.add_argument("--chat-template", default="auto", choices=["auto", "true", "false"],
                    help="wrap the evaluator prompt in the tokenizer's chat template; auto: if it has one, "
                         "except for a '-Base' model (default: %(default)s)")
    ap.add_argument("--system-prompt", default=None, help="system message before the evaluator prompt (chat only)")
    ap.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help='extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
    ap.add_argument("--dtype", default="float32", choices=list(rollout.DTYPES), help="(default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.micro_batch_size < 1:
        raise SystemExit(f"--micro-batch-size must be >= 1, got {a.micro_batch_size}")
    try:
        meta_questions = meta_question_dicts(a.question or ["Is the answer correct?"], target=a.target)
    except ValueError as e:
        raise SystemExit(f"--question: {e}")
    template = DEFAULT_EVALUATOR_TEMPLATE
    if a.template_file:
        if not os.path.isfile(a.template_file):
            raise SystemExit(f"{a.template_file}: file does not exist (--template-file)")
        try:
            with open(a.template_file, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise SystemExit(rollout.not_utf8(a.template_file, None, e) + " (--template-file)")
        try:
            template = checked_template(text)
        except SystemExit as e:
            raise SystemExit(f"{a.template_file}: {e}")
    rows, problems, completions, references = read_scoring_rows(
        a.inp, problem_field=a.problem_field, completion_field=a.completion_field, reference_field=a.reference_field)
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir):
        raise SystemExit(f"--out {a.out}: folder {out_dir} does not exist")

    template_kwargs = rollout.parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")
    chat = {"auto": "auto", "true": True, "false": False}[a.chat_template]
    if a.evaluator.startswith("remote:"):
        if not a.remote_model:
            raise SystemExit("--evaluator remote:URL needs --remote-model (the model name the server serves)")
        ev = remote_evaluator(a.evaluator[len("remote:"):], a.remote_model, name=a.evaluator_name,
                              tokenizer=a.remote_tokenizer, chat_template=chat, where=f"--evaluator {a.evaluator}",
                              system_prompt=a.system_prompt, chat_template_kwargs=template_kwargs,
                              max_tokens=a.remote_max_tokens, batch_size=a.remote_batch_size,
                              max_retries=a.remote_max_retries, answer_stub=a.answer_stub)
    else:
        ev = load_evaluator(a.evaluator, name=a.evaluator_name, chat_template=chat, dtype=a.dtype, device=a.device,
                            system_prompt=a.system_prompt, chat_template_kwargs=template_kwargs,
                            answer_stub=a.answer_stub, micro_batch_size=a.micro_batch_size)
    out = rlme_reward([ev], meta_questions, problems, completions, references=references,
                      anchored=[r is not None for r in references], template=template, transform=a.transform)
    with open(a.out, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):  # None: a remote request that failed after its retries
            logp = {ev["name"]: {mq["question"]: None if out["failed"][i, 0, k] else float(out["logp"][i, 0, k])
                                 for k, mq in enumerate(meta_questions)}}
            f.write(json.dumps(dict(row, logp=logp, reward=float(out["reward"][i]) if out["valid"][i] else None)) + "\n")
    rewards = out["reward"][out["valid"]]
    stats = (f"reward mean {rewards.mean().item():.4f}, min {rewards.min().item():.4f}, max {rewards.max().item():.4f}"
             if len(rewards) else "no reward known")
    failed = int((~out["valid"]).sum())
    print(f"{a.out}: {len(rows)} rows scored by {a.evaluator} ({len(meta_questions)} meta-question(s), transform "
          f"{a.transform}); {stats}; {out['nonfinite']} non-finite log p replaced"
          + (f"; {failed} rows NOT scored (reward null): {out['why'][ev['name']]}" if failed else ""))


if __name__ == "__main__":
    main()


def score_remote(r, fulls):
    """log p(target | prompt) from a remote evaluator, one request per text, one after another
    (fast.score_remote batches and overlaps the requests).

    Args:
        r: a remote evaluator's settings with its client (remote_evaluator's ev["remote"]).
        fulls: list of (full text str, suffix str): full = prompt + suffix, suffix = the target as
            the evaluator reads it (" Yes"; evaluator_prompt_text).
    Returns:
        (list of float log p or None, list of str failure reasons, "" where scored).
    """
    out = [remote_request(r, [f]) for f in fulls]
    return [o[0][0] for o in out], [o[1][0] for o in out]
