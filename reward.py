"""Rewards: answer extraction, RLVR, the RLME meta-evaluation reward, and the RM-NLHF rewards.

SPEC §4.2-4.3 (RLME) and §5.2-5.3 (RM-NLHF). Every function works on plain strings, lists and
tensors so a reader can recompute any logged reward by hand from samples.jsonl.
"""
import math
import re

import torch


# ----------------------------------------------------------------------------------------------
# Answer extraction and RLVR (SPEC §4.3)


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


def rlvr_reward(completion, label):
    """RLVR baseline reward (SPEC §4.3): 1.0 if the last boxed answer equals the cleaned label,
    else 0.0 (no box -> 0.0)."""
    return 1.0 if numeric_equal(extract_boxed(completion), label) else 0.0


# ----------------------------------------------------------------------------------------------
# RLME meta-evaluation reward (SPEC §4.2, RLME Eq. 2-3)

# The evaluator sees the problem, the solution between delimiters, the extracted answer, and
# then, once, the meta-question. {reference} is empty except for anchored items (SPEC §4.2).
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


def check_evaluator_template(template):
    """Fail fast (one line) when a template would let the meta-question come before the solution
    or appear twice. Raises SystemExit naming the config key."""
    for field in ("{problem}", "{solution}", "{question}"):
        if template.count(field) != 1:
            raise SystemExit(f"reward.evaluator_template must contain {field} exactly once")
    if template.index("{question}") < template.index("{solution}"):
        raise SystemExit("reward.evaluator_template: {question} must come after {solution}")


def build_evaluator_text(template, problem, solution, question, meta_questions=(), reference=None):
    """Fill the evaluator template for one (sample, meta-question) (SPEC §4.2).

    The policy can and will write "Is the answer correct? Yes" or a fake closing delimiter into
    its solution, so every meta-question string and both delimiters are cut out of the solution
    first: the meta-question then appears exactly once, after the closing delimiter.
    str.format does not re-read substituted values, so braces in the solution are harmless.

    Args:
        problem, solution, question: str.
        meta_questions: all meta-question strings of the run (each is removed from the solution).
        reference: str gold answer for anchored items, else None.
    Returns:
        str, the evaluator's user message (or plain prompt before the answer stub).
    """
    extracted = extract_boxed(solution)
    for s in list(meta_questions) + [question, *SOLUTION_DELIMITERS]:
        solution = solution.replace(s, "")
    return template.format(
        problem=problem, solution=solution.strip(), question=question,
        extracted=extracted if extracted is not None else "none",
        reference=REFERENCE_LINE.format(answer=reference) if reference is not None else "",
    )


def evaluator_prompt_and_target_ids(tokenizer, text, target, chat, answer_stub="\nAnswer:"):
    """Token ids of the evaluator prompt and of the target answer string (SPEC §4.2).

    The target ids are found by tokenising prompt + target and removing the prompt ids, never
    by `tokenizer.encode("Yes")[0]`: after "Answer:" the natural continuation is " Yes" (with a
    space), after a chat header "...assistant\\n" it is "Yes", and multi-token answers need all
    their tokens. A separating space is added when the prompt does not end in white space.

    Args:
        text: evaluator user message (build_evaluator_text).
        target: answer string a_k, e.g. "Yes".
        chat: bool, wrap `text` in the evaluator's chat template (then no answer stub).
    Returns:
        (prompt_ids list[int], target_ids list[int])
    Raises:
        ValueError: the tokenizer merges the prompt's last token with the target, so the
            prompt ids are not a prefix (change the template's ending).
    """
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
    else:
        prompt = text + answer_stub
    full = prompt + ("" if prompt[-1:].isspace() else " ") + target
    # A rendered chat string already holds its special tokens: do not add a second BOS.
    prompt_ids = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=not chat)["input_ids"]
    if full_ids[:len(prompt_ids)] != prompt_ids or len(full_ids) == len(prompt_ids):
        raise ValueError(f"target {target!r}: prompt ids are not a prefix of prompt+target ids; "
                         f"end the evaluator template/answer stub with ':' or a newline")
    return prompt_ids, full_ids[len(prompt_ids):]


def _common_prefix_len(rows):
    """Length of the longest common prefix of several id lists."""
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows[1:]):
            return i
    return n


@torch.no_grad()
def score_targets(model, prompt_ids, target_ids, pad_id, micro_batch_size=8):
    """log p(target | prompt) under `model`, teacher-forced, full-vocabulary softmax (SPEC §4.2).

    prompt_ids[i] holds the K prompts of sample i (one per meta-question); they share the
    problem+solution prefix. That prefix is run once per sample with the KV cache kept, and
    the K suffixes (prompt tail + target) then attend to the cached prefix: K questions cost
    one long forward plus K short ones instead of K long ones.

    Args:
        model: causal LM (eval mode; no grad is taken).
        prompt_ids: list (N) of lists (K) of list[int].
        target_ids: same nesting, the target answer ids.
        pad_id: int.
        micro_batch_size: samples (each with all K rows) per forward.
    Returns:
        FloatTensor [N, K] of sum_t log p(target_t | prompt, target_<t), float32, on CPU.
    """
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(prompt_ids), micro_batch_size):
        prompts, targets = prompt_ids[start:start + micro_batch_size], target_ids[start:start + micro_batch_size]
        n, k = len(prompts), len(prompts[0])
        # The shared prefix stops at least one token before each prompt's end, so every suffix
        # row has a token whose logits predict the first target token.
        cut = [min(_common_prefix_len(p), min(len(x) for x in p) - 1) for p in prompts]
        from rollout import left_pad, positions_from_mask, token_logprobs
        pre_ids, pre_mask = left_pad([p[0][:c] for p, c in zip(prompts, cut)], pad_id)
        pre_ids, pre_mask = pre_ids.to(device), pre_mask.to(device)
        cache = None
        if pre_ids.shape[1] > 0:
            cache = model(input_ids=pre_ids, attention_mask=pre_mask,
                          position_ids=positions_from_mask(pre_mask), use_cache=True,
                          logits_to_keep=1).cache
            cache.batch_repeat_interleave(k)  # [n, ...] -> [n*k, ...], rows of one sample adjacent
        # Suffix rows, right-padded: prompt tail + target.
        rows, tgt_start, tgt_len = [], [], []
        for p, t, c in zip(prompts, targets, cut):
            for pk, tk in zip(p, t):
                rows.append(pk[c:] + tk)
                tgt_start.append(len(pk) - c)
                tgt_len.append(len(tk))
        width = max(len(r) for r in rows)
        suf_ids = torch.full((n * k, width), pad_id, dtype=torch.long)
        suf_mask = torch.zeros((n * k, width), dtype=torch.long)
        for i, r in enumerate(rows):
            suf_ids[i, :len(r)] = torch.tensor(r)
            suf_mask[i, :len(r)] = 1
        suf_ids, suf_mask = suf_ids.to(device), suf_mask.to(device)
        prefix_len = torch.tensor(cut, device=device).repeat_interleave(k)  # real prefix tokens
        attn = torch.cat([pre_mask.repeat_interleave(k, 0), suf_mask], dim=1)
        pos = prefix_len[:, None] + torch.arange(width, device=device)[None, :]
        logits = model(input_ids=suf_ids, attention_mask=attn, position_ids=pos,
                       cache=cache, use_cache=cache is not None).logits
        # logits at suffix column j predict column j+1; target tokens sit at columns
        # tgt_start .. tgt_start+len-1, so they are predicted from columns tgt_start-1 ...
        lp = token_logprobs(logits[:, :-1], suf_ids[:, 1:])  # [n*k, width-1]
        col = torch.arange(width - 1, device=device)[None, :]
        start_t = torch.tensor(tgt_start, device=device)[:, None] - 1
        sel = (col >= start_t) & (col < start_t + torch.tensor(tgt_len, device=device)[:, None])
        out.append((lp * sel).sum(-1).view(n, k).cpu())
    return torch.cat(out)


def rlme_reward(evaluators, meta_questions, problems, solutions, references=None, anchored=None,
                template=DEFAULT_EVALUATOR_TEMPLATE, answer_stub="\nAnswer:", renormalize=False,
                micro_batch_size=8, nonfinite_logp=-50.0):
    """RLME reward r(x, y) = sum_j v_j sum_k w_k log p_{j,k}   (RLME Eq. 2-3, SPEC §4.2).

    p_{j,k} = pi_phi_j(a_k | x, y, q_k) is evaluator j's probability of the whole target string
    a_k after the evaluator prompt for meta-question q_k. The reward is <= 0; 0 means certainty.

    Args:
        evaluators: list of dicts {"name", "model", "tokenizer", "chat": bool, "weight": v_j}.
        meta_questions: list of dicts {"question", "weight": w_k, "target": a_k, "negative": str}.
        problems, solutions: list[str] of length N.
        references: list[str] gold answers (only read for anchored items), or None.
        anchored: list[bool], True = show the reference answer to the evaluator (sparse
            ground-truth anchoring), or None.
        renormalize: use log p(a_k) - log(p(a_k) + p(negative_k)) instead (off by default: not
            the paper's reward).
        nonfinite_logp: a log p that is NaN/inf (a broken evaluator) is replaced by this value
            and counted, so the update never sees NaN.
    Returns:
        dict with "reward" FloatTensor [N], "logp" FloatTensor [N, J, K] (after renormalising),
        "nonfinite" int count of replaced values.
    """
    n = len(solutions)
    anchored = anchored or [False] * n
    questions = [m["question"] for m in meta_questions]
    targets = [m["target"] for m in meta_questions]
    if renormalize:  # score the negative answer too, as extra rows sharing the same prefix
        targets = targets + [m.get("negative", "No") for m in meta_questions]
    logp = torch.zeros(n, len(evaluators), len(meta_questions))
    for j, ev in enumerate(evaluators):
        prompt_rows, target_rows = [], []
        for i in range(n):
            ref = references[i] if anchored[i] else None
            ps, ts = [], []
            for kk, tgt in enumerate(targets):
                q = questions[kk % len(questions)]
                text = build_evaluator_text(template, problems[i], solutions[i], q, questions, ref)
                p, t = evaluator_prompt_and_target_ids(ev["tokenizer"], text, tgt, ev["chat"], answer_stub)
                ps.append(p)
                ts.append(t)
            prompt_rows.append(ps)
            target_rows.append(ts)
        lp = score_targets(ev["model"], prompt_rows, target_rows, ev["tokenizer"].pad_token_id,
                           micro_batch_size)
        if renormalize:
            k = len(questions)
            lp = lp[:, :k] - torch.logaddexp(lp[:, :k], lp[:, k:])
        logp[:, j] = lp
    bad = ~torch.isfinite(logp)
    logp = torch.where(bad, torch.full_like(logp, nonfinite_logp), logp)
    reward = weighted_reward(logp, [ev["weight"] for ev in evaluators], [m["weight"] for m in meta_questions])
    return {"reward": reward, "logp": logp, "nonfinite": int(bad.sum())}


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


# ----------------------------------------------------------------------------------------------
# RM-NLHF (SPEC §5.1-5.3): pairwise data, GRM prompt and parsing, critique judge, rewards
