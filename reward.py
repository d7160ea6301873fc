"""Rewards: RLVR, the RLME meta-evaluation reward, and the RM-NLHF rewards with their critique
judge (docs/method.md §4.2-4.3 and §5.1-5.3 say the same in prose).

* RLVR (RLME §4.1): 1 if the last \\boxed{} answer equals the label as a number, else 0; string
  answers (RLME §4 Tables 1-2) by SQuAD exact match or token F1 (answer_reward).
* RLME (RLME §3.1): p_{j,k} = pi_phi_j(a_k | x, y, q_k), evaluator j's teacher-forced probability
  of the target string a_k for meta-question q_k (Eq. 2); r(x, y) = sum_j v_j sum_k w_k log p_{j,k}
  <= 0 (Eq. 3). Off by default (not the paper's): renormalise over {target, negative}, transform
  "prob" (sum of p), an added RLVR part (hybrid_reward).
* RM-NLHF (RM-NLHF §3.1-3.2): on D_H, R = -1 invalid, 0 wrong verdict, 1 + lam * R_process right
  verdict, R_process = 1[S(h, c) > threshold] (Eq. 4-5), S the F1 of the core arguments the GRM
  critique shares with the human one, decided by an LLM judge (§2.3, App. E); on D_O,
  R' = -1 / 0 / 1 + clip(max(0, R_hat - 1), 0, lam) (Eq. 8), R_hat the MetaRM's (metarm.py).

Plain strings, lists and tensors throughout, so any logged reward can be recomputed by hand from
samples.jsonl. Run alone:

    python -m plumbing.cli reward --evaluator PATH --in samples.jsonl --out scored.jsonl
"""
import collections
import math
import re
import string

import torch

import rollout
from rollout import chat_prompt, eval_mode, token_logprobs


# ----------------------------------------------------------------------------------------------
# RLVR: answer extraction and the 0/1 reward (RLME §4.1; docs/method.md §4.3)


def extract_boxed(text):
    """Content (stripped) of the LAST `\\boxed{...}` or `\\fbox{...}` in `text`, braces matched,
    so `\\boxed{\\frac{1}{2}}` works (a naive regex stops at the first '}'); also `\\boxed 5`, a
    single token without braces. None when there is no closed box."""
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
    the (whole words), collapse white space. In that order, so a word joined by punctuation stays
    joined: "The A-Team!" -> "ateam" (the hyphen goes first, then "ateam" is no article)."""
    s = s.lower().translate(_DROP_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _gold_list(golds):
    """golds as a non-empty list of str (a single str -> [str]); ValueError otherwise."""
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds or not all(isinstance(g, str) for g in golds):
        raise ValueError(f"gold answers must be a str or a non-empty list of str, got {golds!r}")
    return golds


def qa_exact_match(prediction, golds):
    """SQuAD exact match EM = max_g 1[norm(prediction) == norm(g)] (RLME §4 Tables 1-2): 1.0 or
    0.0; prediction None (no answer extracted) -> 0.0. golds: str or non-empty list of str
    (ValueError otherwise)."""
    golds = _gold_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(g) for g in golds) else 0.0


def qa_f1(prediction, golds):
    """SQuAD token F1, the best over the gold answers (RLME §4 Tables 1-2): with P, G the tokens of
    the normalised prediction and gold and common = |P ∩ G| as multisets (min of the two counts),
    precision = common / |P|, recall = common / |G|, F1 = 2 precision recall / (precision + recall).
    An empty side gives 0.0, both empty 1.0 (as SQuAD); prediction None -> 0.0."""
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
    """RLVR reward in [0, 1] for label_format "gsm8k" / "plain" (rlvr_reward on the cleaned number,
    RLME §4.1) or "text" (qa_metric "em" or "f1" of the last \\boxed{} against the golds, §4
    Tables 1-2); no box -> 0.0. Text labels never go through clean_number: it deletes spaces and
    commas, which are part of a string answer ("New York, USA")."""
    if label_format not in LABEL_FORMATS:
        raise ValueError(f"label_format {label_format!r}: expected one of "
                         f"{', '.join(LABEL_FORMATS)}")
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

# Context QA (RLME §4 Tables 1-2; meta-question "Is the answer supported by the context, regardless
# of whether it seems right or wrong?"): {problem} is the context and the question. The delimiters
# are DEFAULT_EVALUATOR_TEMPLATE's: build_evaluator_text cuts exactly these out of the answer,
# which is what keeps an injected meta-question or fake delimiter out.
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


def check_evaluator_template(template):
    """Fail fast (one line) when a template would let the meta-question come before the solution
    or appear twice. Raises SystemExit naming the config key."""
    for field in ("{problem}", "{solution}", "{question}"):
        if template.count(field) != 1:
            raise SystemExit(f"reward.evaluator_template must contain {field} exactly once")
    if template.index("{question}") < template.index("{solution}"):
        raise SystemExit("reward.evaluator_template: {question} must come after {solution}")


def build_evaluator_text(template, problem, solution, question, meta_questions=(), reference=None):
    """The evaluator's user message for one (sample, meta-question) (docs/method.md §4.2);
    meta_questions: all the run's question strings; reference: the gold answer of an anchored item.

    The policy can and will write "Is the answer correct? Yes" or a fake closing delimiter into
    its solution, so every meta-question string and both delimiters are cut out of the solution
    first: the meta-question then appears exactly once, after the closing delimiter.
    The cutting repeats until the text stops changing: one pass can create what it removes, as in
    "Is the answer <<<BEGIN SOLUTION>>>correct?" (cutting the delimiter joins the question) or
    "Is the answer Is the answer correct?correct?" (cutting the inner copy leaves the outer one).
    Each pass that changes the text shortens it, so the loop ends.
    str.format does not re-read substituted values, so braces in the solution are harmless.
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
    """(prompt, prompt + target) strings for evaluator message `text` and target a_k (what a local
    evaluator tokenises, what a remote one sends): text + answer_stub, or with `chat`
    (use_chat_template's options) `text` in the chat template; the target after a space unless the
    prompt ends in one."""
    if chat:
        prompt = chat_prompt(tokenizer, text, chat, tokenize=False)
    else:
        prompt = text + answer_stub
    return prompt, prompt + ("" if prompt[-1:].isspace() else " ") + target


def evaluator_prompt_and_target_ids(tokenizer, text, target, chat, answer_stub="\nAnswer:"):
    """(prompt_ids, target_ids) of the evaluator prompt and the target string a_k (RLME Eq. 2;
    docs/method.md §4.2); arguments as evaluator_prompt_text.

    The target ids are found by tokenising prompt + target and removing the prompt ids, never
    by `tokenizer.encode("Yes")[0]`: after "Answer:" the natural continuation is " Yes" (with a
    space), after a chat header "...assistant\\n" it is "Yes", and multi-token answers need all
    their tokens. ValueError when the tokenizer merges the prompt's last token with the target
    (the prompt ids are not a prefix: change the template's ending).
    """
    prompt, full = evaluator_prompt_text(tokenizer, text, target, chat, answer_stub=answer_stub)
    # A rendered chat string already holds its special tokens: do not add a second BOS.
    prompt_ids = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=not chat)["input_ids"]
    if full_ids[:len(prompt_ids)] != prompt_ids or len(full_ids) == len(prompt_ids):
        raise ValueError(f"target {target!r}: prompt ids are not a prefix of prompt+target ids; "
                         f"end the evaluator template/answer stub with ':' or a newline")
    return prompt_ids, full_ids[len(prompt_ids):]


@torch.no_grad()
def score_targets(model, prompt_ids, target_ids, pad_id, micro_batch_size=8, groups=None):
    """log p(target | prompt) under `model`, teacher-forced (the plain twin of fast.score_targets):
    score[i, k] = sum_t log softmax(f(prompt_ik + target_ik[:t]))[target_ik[t]], FloatTensor [N, K]
    on CPU, for lists (N) of lists (K) of non-empty id lists. One unpadded forward per row, so no
    padding, positions or cache are involved (pad_id, micro_batch_size, groups: the fast twin's)."""
    device = next(model.parameters()).device
    out = torch.zeros(len(prompt_ids), len(prompt_ids[0]))
    with eval_mode(model):  # dropout off (a live evaluator is the policy, in train mode)
        for i, (prompts, targets) in enumerate(zip(prompt_ids, target_ids)):
            for k, (p, t) in enumerate(zip(prompts, targets)):
                # [len(p) + len(t), V]
                logits = model(input_ids=torch.tensor([p + t], device=device)).logits[0]
                # the logits at position j predict token j + 1: positions len(p)-1 .. end-1
                # predict t
                out[i, k] = token_logprobs(logits[len(p) - 1:-1],
                                           torch.tensor(t, device=device)).sum().cpu()
    return out


def local_evaluator(model, tokenizer, *, chat=False, name="self", weight=1.0,
                    answer_stub="\nAnswer:", micro_batch_size=8, score=score_targets):
    """An in-process evaluator j as the dict rlme_reward reads: {"name", "weight": v_j, "score"},
    with score(texts, targets, groups=None) -> [N, K] log p(target_k | texts[i][k]) = log p_{j,k}
    (RLME Eq. 2) through evaluator_prompt_and_target_ids and `score` (score_targets or
    fast.score_targets, which runs a shared prefix of adjacent samples with the same `groups` key
    once).
    A NaN a model computes is a broken number, not a failed request: it comes back as -inf, so
    rlme_reward replaces and counts it (NaN is what an evaluator returns for "could not score").
    chat=False scores the plain-text prompt; a training run passes what the evaluator's
    chat_template resolves to (auto: True for a model with a chat template; load_evaluator)."""
    def fn(texts, targets, groups=None):
        ids = [[evaluator_prompt_and_target_ids(tokenizer, t, a, chat=chat, answer_stub=answer_stub)
                for t, a in zip(row, targets)] for row in texts]
        logp = score(model, [[p for p, _ in r] for r in ids], [[t for _, t in r] for r in ids],
                     tokenizer.pad_token_id, micro_batch_size=micro_batch_size, groups=groups)
        return torch.nan_to_num(logp, nan=-float("inf"), posinf=float("inf"), neginf=-float("inf"))
    # model, tokenizer, chat: what it scores with, for inspection (rlme_reward reads name, weight,
    # score)
    return {"name": name, "weight": float(weight), "score": fn, "model": model,
            "tokenizer": tokenizer, "chat": chat}


def rlme_reward(evaluators, meta_questions, problems, solutions, references=None, anchored=None,
                template=DEFAULT_EVALUATOR_TEMPLATE, renormalize=False, nonfinite_logp=-50.0,
                transform="log"):
    """RLME reward r(x, y) = sum_j v_j sum_k w_k log p_{j,k} <= 0 (RLME Eq. 2-3; docs/method.md
    §4.2), p_{j,k} = pi_phi_j(a_k | x, y, q_k) evaluator j's probability of the whole target string
    a_k after the prompt for meta-question q_k (0 = certainty). transform "prob": sum_j v_j sum_k
    w_k p_{j,k} instead (the abstract's "probability": a near-0 p costs at most v w, not an
    unbounded log).

    evaluators: {"name", "weight": v_j, "score"} (local_evaluator; a remote one's "failures" holds
    the reasons its last call's failed requests give); meta_questions: {"question", "weight": w_k,
    "target": a_k, "negative"}; anchored[i] True shows references[i] to the evaluator (sparse
    ground-truth anchoring); renormalize: log p(a_k) - log(p(a_k) + p(negative_k)) instead; a log p
    that is inf (a broken evaluator) is replaced by nonfinite_logp and counted, so the update never
    sees it. Returns {"reward" [N], "logp" [N, J, K] (log p whatever the transform, after both),
    "nonfinite" count, "failed" [N, J, K] (not scored, e.g. a remote request failed after its
    retries: NaN, kept), "valid" [N] (no term failed; else the reward is NaN and the caller masks
    the sample), "why" {evaluator name: its first failure's reason or ""}}.
    """
    if transform not in ("log", "prob"):
        raise ValueError(f"transform {transform!r}: expected log or prob")
    questions, k = [m["question"] for m in meta_questions], len(meta_questions)
    targets = [m["target"] for m in meta_questions]
    if renormalize:  # score the negative answer too, as extra rows sharing the same prefix
        targets = targets + [m.get("negative", "No") for m in meta_questions]
    refs = [references[i] if anchored and anchored[i] else None for i in range(len(solutions))]
    texts = [[build_evaluator_text(template, x, y, questions[kk % k], meta_questions=questions,
                                   reference=ref)
              for kk in range(len(targets))]
             for x, y, ref in zip(problems, solutions, refs)]  # [N][K or 2K]
    # samples of one problem (a group) are adjacent: the fast scorer runs their shared prefix once
    logp = torch.stack([ev["score"](texts, targets, groups=problems)
                        for ev in evaluators], 1).float()  # [N, J, .]
    # could not score (stays NaN, masked); a broken number
    failed, bad = logp.isnan(), torch.isinf(logp)
    if renormalize:
        logp = logp[..., :k] - torch.logaddexp(logp[..., :k], logp[..., k:])
        failed, bad = failed[..., :k] | failed[..., k:], bad[..., :k] | bad[..., k:]
    bad = bad & ~failed
    logp = torch.where(bad, torch.full_like(logp, nonfinite_logp), logp)
    # after the replacement, so "prob" sees exp(nonfinite_logp) ~ 0, never NaN
    terms = logp if transform == "log" else logp.exp()
    reward = weighted_reward(terms, [ev["weight"] for ev in evaluators],
                             [m["weight"] for m in meta_questions])
    valid = ~failed.any(2).any(1)  # a sample missing any term has no reward: NaN, and masked
    why = {ev["name"]: next((w for w in ev["failures"] if w), "")
           for ev in evaluators if "failures" in ev}
    return {"reward": torch.where(valid, reward, torch.full_like(reward, float("nan"))),
            "logp": logp, "nonfinite": int(bad.sum()), "valid": valid, "failed": failed, "why": why}


def weighted_reward(logp, v, w):
    """r = sum_j v_j sum_k w_k log p_{j,k}  (RLME Eq. 3): logp [N, J, K], v J evaluator weights,
    w K meta-question weights -> FloatTensor [N]."""
    v = torch.as_tensor(v, dtype=logp.dtype)
    w = torch.as_tensor(w, dtype=logp.dtype)
    return (logp * v[None, :, None] * w[None, None, :]).sum((1, 2))


def hybrid_reward(rlvr, rlme, rlvr_weight=1.0):
    """r = rlvr_weight * r_RLVR + r_RLME (RLME §4 Tables 1-2, "RLVR + RLME"), float32 [N];
    ValueError when the parts differ in shape. The paper's rule for combining the two is not in the
    text we have: this additive form is our choice; both parts are logged (samples.jsonl)."""
    rlvr = torch.as_tensor(rlvr, dtype=torch.float32)
    rlme = torch.as_tensor(rlme, dtype=torch.float32)
    if rlvr.shape != rlme.shape:
        raise ValueError(f"hybrid_reward: RLVR part {tuple(rlvr.shape)} and RLME part "
                         f"{tuple(rlme.shape)} differ in shape")
    return rlvr_weight * rlvr + rlme


def meta_question_dicts(meta_questions, target="Yes"):
    """Meta-questions as rlme_reward's dicts {"question", "weight", "target", "negative"} (q_k, w_k,
    a_k of RLME Eq. 2-3) from str (target `target`, weight 1) or reward.meta_questions dicts;
    ValueError on none, a blank one or a repeat (the logp dicts are keyed by question)."""
    out = []
    for m in meta_questions:
        m = {"question": m} if isinstance(m, str) else dict(m)
        if not isinstance(m.get("question"), str) or not m["question"]:
            raise ValueError(f"meta-question {m!r}: needs a non-empty str 'question'")
        out.append({"question": m["question"], "weight": float(m.get("weight", 1.0)),
                    "target": m.get("target", target), "negative": m.get("negative", "No")})
    questions = [m["question"] for m in out]
    if not out or len(set(questions)) != len(questions):
        raise ValueError(f"meta_questions must be a non-empty list of distinct questions, "
                         f"got {questions}")
    return out


def logp_metric_name(evaluator, question):
    """The metric name of one evaluator's mean log p for one meta-question: the name train.py
    writes to metrics.jsonl (plumbing/metrics.py rlme_step_metrics): TRL's logs read the same."""
    return f"rlme/{evaluator}/{question}/logp"


# ----------------------------------------------------------------------------------------------
# RM-NLHF rewards (RM-NLHF §3.1-3.2, Eq. 4, 5, 8; docs/method.md §5.2-5.4): GRM prompt and
# parsing, the D_H and D_O rewards, the step metrics
#
# Data flow (one GRPO step, RM-NLHF Algorithm 1; docs/method.md §5.4):
#   items    = load_pairwise(...)                       plain dicts, A/B already shuffled (PLUMBING)
#   prompt   = build_grm_prompt(context, a, b)          the user message; rollout.py adds the
#                                                       template
#   parsed   = parse_grm_output(completion)             {critique, choice, valid, why}
#   D_H:  samples = score_dh(parsed, items, judge, ...)        judge(pairs) F1 -> R (Eq. 4, 5)
#   D_O:  samples = score_do(parsed, items, r_hat, ...)        MetaRM prediction R_hat -> R' (Eq. 8)
#   D_O labels for the MetaRM (metarm.train_on_do): do_training_samples(parsed, items, lam)
#   nlhf_metrics(samples)                               format errors, accuracy, judge fail rate
#
# A sample whose judge call failed gets reward None. It must be EXCLUDED from its group's mean/std
# and from the loss (advantage 0, loss mask 0, not counted in the token-mean denominator); it is
# counted in judge/fail_rate. We never substitute 0 (it would look like a real "no match" score),
# unless judge.on_failure says "zero" (the authors' released code; score_dh's on_failure).


# ---- GRM prompt and parsing (docs/method.md §5.2) ------------------------------------------

# The pair as every model in RM-NLHF reads it (the GRM, the meta-judge, the MetaRM:
# metarm.metarm_text)
PAIR_TEXT = """[Conversation]
{context}

[Response A]
{response_a}

[Response B]
{response_b}"""

GRM_PROMPT = (
    "You are judging two AI assistant responses to the same conversation. Decide which response is "
    "better: more helpful, correct, honest and harmless for the user.\n"
    "\n"
    + PAIR_TEXT + "\n"
    "\n"
    "Write a short critique (at most {max_lines} lines) that states the key reasons for your "
    "decision, inside <critics>...</critics>. Then give your verdict inside <choice>...</choice>: "
    "<choice>[[A]]</choice> if Response A is better, or <choice>[[B]]</choice> if Response B is "
    "better.")

# The RM-NLHF authors' GRM prompt (nlhf.grm_prompt: authors), verbatim from their release
# (PROMPT_GRM in Character-GenRM-NLHF/verl/verl/workers/reward_manager/pairwise_grm.py of
# github.com/liudan193/Qwen-Character, where their released GRMs judge policy samples), so a
# released checkpoint is scored in its own format. Its conversation is the turns rendered as
# "role:\ncontent\n" (authors_context). The paper's training template (its Fig. 9) is not public.
AUTHORS_GRM_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by two AI "
    "Chatbots to the Client question displayed below."
    """

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

Note: Use [[A]] if A is better, or [[B]] if B is better.""")

GRM_PROMPT_STYLES = ("ours", "authors")


def nlhf_step_items(dh, do, step, *, prompts_per_step, dh_per_step, seed, rank, world):
    """This rank's pairwise items for `step`: round(dh_per_step x P) of the P = prompts_per_step
    prompts from D_H and the rest from D_O (all from D_H when `do` is empty), each set read as its
    own seeded stream (step_items, so a resumed run sees the same prompts), then the P prompts
    shuffled by (seed, step) so every rank gets a mix of both. Items are tagged "set": "dh" |
    "do"."""
    P = prompts_per_step
    n_dh = round(dh_per_step * P) if do else P
    # each set as one stream for the whole step (rank 0 of 1); the ranks split it below
    dh_items = rollout.step_items(dh, step, n_dh, seed=seed, rank=0, world=1)
    do_items = rollout.step_items(do, step, P - n_dh, seed=seed + 1, rank=0, world=1)
    both = [dict(it, set="dh") for it in dh_items] + [dict(it, set="do") for it in do_items]
    order = torch.randperm(
        P, generator=torch.Generator().manual_seed(seed * 100_019 + step)).tolist()
    per_rank = P // world
    return [both[k] for k in order[rank * per_rank:(rank + 1) * per_rank]]


def grm_prompt_ids(tokenizer, item, chat, *, max_lines, style, text_only=False):
    """Token ids of the GRM prompt for one pairwise item: build_grm_prompt in `style` ("ours" |
    "authors", nlhf.grm_prompt) with the critique limit `max_lines` (nlhf.max_critique_lines), in
    the chat template when `chat`; its text (the user message) with text_only=True."""
    text = build_grm_prompt(item["context"], item["response_a"], item["response_b"], max_lines,
                            style=style, turns=item.get("meta", {}).get("turns"))
    return text if text_only else rollout.build_prompt_ids(tokenizer, text, chat)


def build_grm_prompt(context, response_a, response_b, max_lines=4, style="ours", turns=None):
    """The GRM user message (docs/method.md §5.2; the caller applies the chat template): style
    "ours" (GRM_PROMPT, telling the model the critique limit max_lines that parse_grm_output
    enforces) or "authors" (AUTHORS_GRM_PROMPT, with `turns` rendered by authors_context when the
    item kept its turns, else `context` as is)."""
    if style == "authors":
        conv = authors_context(turns) if turns else context.strip()
        return AUTHORS_GRM_PROMPT.format(context=conv, response_a=response_a, response_b=response_b)
    if style != "ours":
        raise ValueError(f"GRM prompt style {style!r} unknown; allowed: "
                         f"{', '.join(GRM_PROMPT_STYLES)}")
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

    Returns dict(critique: str|None, choice: 'A'|'B'|None, valid: bool, why: str), why one of ''
    (valid), 'no_critique', 'no_choice', 'too_many_lines' (> max_lines), 'too_long' (> max_chars).
    """
    text = text or ""
    blocks = re.findall(r"<critics>(.*?)</critics>", text, flags=re.S)
    choices = re.findall(r"<choice>(.*?)</choice>", text, flags=re.S)
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
        # the last <choice> block's [[A]] / [[B]]; without one there, the first anywhere
        m = re.search(r"\[\[([AB])\]\]", choices[-1]) if choices else None
        m = m or re.search(r"\[\[([AB])\]\]", text)
        choice = m.group(1) if m else None
        n_lines = (None if critique is None
                   else len([ln for ln in critique.splitlines() if ln.strip()]))
    else:
        raise ValueError(f"GRM prompt style {style!r} unknown; allowed: "
                         f"{', '.join(GRM_PROMPT_STYLES)}")
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
        f1 None where it is needed ->  None: judge failure, the sample is masked (see top of
                                      section)
        lam = 0                   ->  R_outcome: no process term, and no judge call needed
                                      ("w/o process reward", RM-NLHF Table 3)

    f1: S(h, c) in [0, 1] or None; threshold, inclusive: process_reward's. Returns (reward
    float|None, r_process 0.0|1.0|None).
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


METARM_MODES = ("none", "offline", "online", "metarm_only", "binary", "binary_retrain",
                "classifier")
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

    r_hat: the MetaRM output on the R scale (None for mode 'none'); mode: one of METARM_MODES;
    form: nlhf.do_reward, one of DO_REWARD_FORMS (config.py refuses 'released' where it would
    change nothing: modes 'none' / 'metarm_only', no outcome gate).
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


SIMILARITIES = ("f1", "precision", "recall")  # S(h, c) of Eq. 4: the judge number (nlhf.similarity)
JUDGE_FAILURES = ("mask", "zero")  # what a failed judge call gives (judge.on_failure; score_dh)
# a sample's judge fields before (or without: D_O) a judge call; samples.jsonl's schema
NOT_JUDGED = {"human_critique": None, "f1": None, "precision": None, "recall": None,
              "judge_why": None, "judge_attempts": 0, "judged": False, "judge_failed": False}


def score_dh(parsed, items, judge, lam=0.5, threshold=0.5, gate_on_outcome=True, inclusive=False,
             similarity="f1", on_failure="mask"):
    """Rewards of D_H samples: parse results + items -> judge (only where needed) -> RM-NLHF
    Eq. 4-5.

    parsed: parse_grm_output dicts, one per completion; items: their pairwise dicts (an item
    repeated G times for a group; read: "winner" 'A' | 'B', "critique", and whatever the judge
    reads); judge: a callable judge(pairs) -> list[dict], pairs a list of
    (human critique, GRM critique, item) tuples, each result {"f1", "precision", "recall", "why",
    "attempts"} with f1 None on a failure (plumbing/judge.py make_judge: the LLM judge or the
    offline proxy; the item is what judge.variant meta_judge reads); on_failure (judge.on_failure):
    what a failed call gives, "mask" (ours: reward None, the sample is left out) or "zero" (the
    authors' released code: S = 0, so R_process = 0); similarity: which judge number is S(h, c)
    in Eq. 4, "f1" (the paper's), "precision" or "recall" (RM-NLHF §2.3 compares them).
    Returns sample dicts: choice, valid, why, correct, critique, human_critique, f1, precision,
    recall, judge_why, judge_attempts, judged, judge_failed, r_process, reward (float or None).
    ValueError (a caller bug, before any judge call): lengths differ or an item has no critique.
    """
    if len(parsed) != len(items):
        raise ValueError(f"score_dh: {len(parsed)} parse results for {len(items)} items")
    if any(not it.get("critique") for it in items):
        raise ValueError("score_dh: an item has no human critique (D_O items go to score_do)")
    if on_failure not in JUDGE_FAILURES or similarity not in SIMILARITIES:
        raise ValueError(f"score_dh: on_failure {on_failure!r}, similarity {similarity!r}")
    samples, need = [], []
    for i, (p, it) in enumerate(zip(parsed, items)):
        correct = p["valid"] and p["choice"] == it["winner"]
        s = {"choice": p["choice"], "valid": p["valid"], "why": p["why"], "correct": bool(correct),
             "critique": p["critique"], **NOT_JUDGED, "human_critique": it.get("critique")}
        samples.append(s)
        # outcome regularisation: the judge only sees valid, right verdicts (RM-NLHF §3.1); with
        # λ = 0 the process term is zero whatever S says, so the judge is never called
        if lam > 0 and p["valid"] and (correct or not gate_on_outcome):
            need.append(i)
    results = (judge([(items[i]["critique"], parsed[i]["critique"], items[i]) for i in need])
               if need else [])
    if len(results) != len(need):  # zip would leave the rest unjudged, silently
        raise ValueError(f"score_dh: {len(results)} judge results for {len(need)} pairs")
    for i, r in zip(need, results):
        # failed: no S(h, c), the number Eq. 4 reads (a judge may give an f1 but no precision)
        failed = r[similarity] is None
        if failed and on_failure == "zero":  # the released code's rule: a failure scores 0
            r = dict(r, f1=0.0, precision=0.0, recall=0.0)
        samples[i].update(f1=r["f1"], precision=r["precision"], recall=r["recall"],
                          judge_why=r["why"], judge_attempts=r["attempts"], judged=True,
                          judge_failed=failed)
    for s in samples:
        s["reward"], s["r_process"] = dh_reward(
            s["valid"], s["correct"], s[similarity], lam=lam, threshold=threshold,
            gate_on_outcome=gate_on_outcome, inclusive=inclusive)
    return samples


def score_do(parsed, items, r_hat, lam=0.5, mode="online", gate_on_outcome=True, form="paper"):
    """Rewards of D_O samples (RM-NLHF Eq. 8; docs/method.md §5.4). r_hat: list of MetaRM
    predictions (None entries allowed for invalid samples or mode 'none'); form: do_reward's.
    Returns list of sample dicts with choice, valid, why, correct, critique, r_hat, reward."""
    out = []
    for p, it, rh in zip(parsed, items, r_hat):
        correct = p["valid"] and p["choice"] == it["winner"]
        out.append({"choice": p["choice"], "valid": p["valid"], "why": p["why"],
                    "correct": bool(correct), "critique": p["critique"], "r_hat": rh,
                    "reward": do_reward(p["valid"], correct, rh, lam=lam, mode=mode,
                                        gate_on_outcome=gate_on_outcome, form=form)})
    return out


def do_training_samples(parsed, items, lam):
    """MetaRM training labels for D_O samples, the "w/ D_O for MetaRM" ablation (RM-NLHF §4.3,
    Table 3; config metarm.train_on_do): no human critique, so a valid verdict is labelled by its
    outcome alone, 1 + λ/2 when right (halfway: the process term is unknown) and 0 when wrong.
    The paper pairs "correct and incorrect" with "0 and 1 + λ/2" in that order; we read it as right
    -> 1 + λ/2, since a wrong verdict earns 0 everywhere else in the method. Returns {"valid",
    "reward", "critique", "outcome_label"} per verdict (invalid: reward None, not trained on;
    metarm.examples_from_samples turns them into MetaRM examples)."""
    out = []
    for p, it in zip(parsed, items):
        right = p["valid"] and p["choice"] == it["winner"]
        out.append({"valid": p["valid"], "critique": p["critique"],
                    "reward": (1.0 + lam / 2 if right else 0.0) if p["valid"] else None,
                    "outcome_label": True})
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
            out[f"nlhf/{name}/reward_mean"] = (sum(r["reward"] for r in part
                                                   if r["reward"] is not None)
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
# an LLM behind any OpenAI-compatible server. score_dh calls it as a plain callable judge(pairs) ->
# list[dict]; plumbing/judge.py's make_judge builds it (the prompts and parsers below, requests
# judge.concurrency at a time, retries with backoff; after the last retry the result is f1=None
# with the reason in `why`, never an exception into the training loop).

# The judge's prompts, one per process-reward design of RM-NLHF §2.3 / App. E (judge.variant).
# "core" (the paper's choice, "Similarity w/ Core HC") and "all" ("Similarity w/ All HC") extract
# arguments from both critiques and match them; "meta_judge" ("LLM-as-a-Meta-Judge") rates the GRM
# critique's correctness directly, without the human one. The paper's prompt texts (Figs. 11, 13)
# are not in its text; these are written from its description. Both extraction prompts start with
# the repetition check (a critique that repeats itself must not collect matches).
_JUDGE_STEPS = {
    "core": ("2. List the CORE arguments of the reference: the decisive reasons that settle "
             "which response is better. Leave out nitpicks and minor points (style, small "
             "omissions, things that would not change the verdict). If the reference names a "
             "fatal error (one that by itself decides the comparison, e.g. a wrong final answer, "
             "a harmful or refused reply), count that error as the only core argument. Let H be "
             "their number.\n"
             "3. List the core arguments of the candidate the same way. Let C be their number."),
    "all": ("2. List ALL arguments of the reference: every distinct reason about one response (a "
            "flaw or a strength), minor ones included. Let H be their number.\n"
            "3. List all arguments of the candidate the same way. Let C be their number."),
}

JUDGE_PROMPT = (
    "You compare two critiques of the same pair of AI responses (Response A and Response B): a "
    "REFERENCE critique written by a human expert and a CANDIDATE critique written by a model. "
    "Measure how many of the reference's arguments the candidate makes.\n"
    "\n"
    "Work through these steps in order.\n"
    "1. Repetition check. If the candidate restates the same argument more than once (the same "
    "point in other words, copied sentences, or filler that repeats itself), stop here and answer "
    "precision 0, recall 0, f1 0.\n"
    "{steps}\n"
    "4. Match candidate arguments to reference arguments by meaning and stance: a match must be "
    "about the same response with the same polarity (both call it a flaw, or both a strength); "
    "wording may differ. Each reference argument and each candidate argument can be used in at "
    "most one match. Let M be the number of matches.\n"
    "5. precision = M / C, recall = M / H, f1 = 2 * precision * recall / (precision + recall), "
    "and 0 when M is 0.\n"
    "\n"
    "[Reference critique]\n"
    "{human}\n"
    "\n"
    "[Candidate critique]\n"
    "{model}\n"
    "\n"
    "Think briefly, then end your answer with exactly these tags, each holding a plain decimal "
    "number between 0 and 1 (for example 0.5):\n"
    "<precision>...</precision>\n"
    "<recall>...</recall>\n"
    "<f1>...</f1>")

META_JUDGE_PROMPT = (
    "You check a CRITIQUE that a model wrote about two AI responses to the same conversation. "
    "Decide whether the critique is correct: it identifies the real issues (or strengths) of the "
    "responses that decide which one is better, and claims nothing false about them.\n"
    "\n"
    "Work through these steps in order.\n"
    "1. Repetition check. If the critique restates the same point more than once, answer 0.\n"
    "2. Read the conversation and both responses; note any fatal error (one that by itself decides "
    "the comparison, e.g. a wrong final answer, a harmful or refused reply). A critique that "
    "misses a fatal error, or blames a response for a flaw it does not have, is not correct.\n"
    "3. Answer 1 if the critique is correct, else 0.\n"
    "\n"
    + PAIR_TEXT + "\n"
    "\n"
    "[Critique]\n"
    "{model}\n"
    "\n"
    "Think briefly, then end your answer with exactly this tag holding 1 or 0:\n"
    "<correct>...</correct>")

JUDGE_VARIANTS = ("core", "all", "meta_judge")


def judge_prompt(variant, human, model, item=None):
    """The judge's request for one GRM critique `model` (str): against the human critique `human`
    (core / all), or on its own with the pair `item` (context, response_a, response_b; meta_judge).
    Raises ValueError on an unknown variant or a meta_judge call without the item."""
    if variant == "meta_judge":
        if item is None:
            raise ValueError("judge.variant meta_judge needs the pair (context and both responses)")
        return META_JUDGE_PROMPT.format(context=item["context"].strip(),
                                        response_a=item["response_a"].strip(),
                                        response_b=item["response_b"].strip(), model=model.strip())
    if variant not in _JUDGE_STEPS:
        raise ValueError(f"unknown judge variant {variant!r} "
                         f"(one of {', '.join(JUDGE_VARIANTS)})")
    return JUDGE_PROMPT.format(steps=_JUDGE_STEPS[variant], human=human.strip(),
                               model=model.strip())


def parse_meta_judge_output(text):
    """The meta-judge's <correct>1|0</correct> as the judge dict of parse_judge_output: precision =
    recall = f1 = the 0/1 verdict (so nlhf.similarity and the threshold read it the same way), or
    all None with `why` when the tag is missing or holds anything else."""
    m = re.findall(r"<correct>\s*([01])\s*</correct>", text or "")
    if not m:
        return {"precision": None, "recall": None, "f1": None,
                "why": "no <correct>0|1</correct> tag"}
    v = float(m[-1])
    return {"precision": v, "recall": v, "f1": v, "why": ""}


# A plain decimal in [0, 1]: '0', '1', '0.5', '.5', '1.0'. Scientific notation ('1e-1'), 'nan',
# 'inf', fractions ('2/3') and percentages are parse failures: the prompt asks for a plain
# decimal, and accepting float()'s whole grammar would let 'nan' or 'inf' through.
_DECIMAL = re.compile(r"\d+(?:\.\d*)?|\.\d+")


def parse_judge_output(text):
    """Strictly parse the judge's answer (the LAST <precision>, <recall> and <f1> blocks) to
    dict(precision, recall, f1, why): floats in [0, 1] and why ''; on a missing tag, a value that
    is not a plain decimal (_DECIMAL) or one outside [0, 1], all three None and why says which."""
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


# load_evaluator, remote_evaluator, trl_reward_function and verl_compute_score (they load models and
# call servers; README, "The RLME reward in another trainer") are in plumbing/evaluators.py
# and plumbing/reward_functions.py.
# the command line imports this file, so it lives in plumbing/cli.py (reward_main)
if __name__ == "__main__":
    raise SystemExit("reward.py's command line: python -m plumbing.cli reward --help "
                     "(from the repository root)")
