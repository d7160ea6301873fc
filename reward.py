"""Rewards: RLVR and QA metrics, the RLME meta-evaluation reward, the RM-NLHF rewards and their
critique judge.

* RLVR (RLME §4.1): answer_reward (boxed number == label; SQuAD EM / F1 for string answers:
  docs/method.md §4.3, the QA setup from secondary notes).
* RLME (RLME §3.1): rlme_reward, r = sum_j v_j sum_k w_k log p_{j,k} (Eq. 2-3), p_{j,k} evaluator
  j's teacher-forced probability of target a_k after meta-question q_k; local_evaluator (live,
  frozen_self, frozen: the K questions on one shared prefix, score_targets), remote_evaluator
  (a vLLM server's echoed prompt log-probs). Ours, off by default: "prob", hybrid_reward.
* RM-NLHF (RM-NLHF §3.1-3.2): build_grm_prompt / parse_grm_output (ours, the authors');
  score_dh (Eq. 4-5, S(h, c) from make_judge or proxy_f1), score_do (Eq. 8, the MetaRM's R_hat).
A server request that fails after the `openai` client's retries is masked and counted, never 0.
"""
import collections
import concurrent.futures
import math
import os
import re
import string
import threading

import torch
from transformers import DynamicCache

import rollout
from data import clean_number
from rollout import chat_prompt, eval_mode, left_pad, token_logprobs


# RLVR (RLME §4.1) and SQuAD EM / F1 (docs/method.md §4.3: the QA tables per secondary notes)
def extract_boxed(text):
    """The content of the LAST closed \\boxed{...} / \\fbox{...} (braces matched) or \\boxed 5."""
    for start in reversed([m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*", text or "")]):
        if text[start:start + 1] == "{":
            depth = 0
            for i in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1:i].strip()
            continue  # unclosed box: try the one before it
        m = re.match(r"[^\s$]+", text[start:])  # '\boxed 5'
        if m:
            return m.group(0)
    return None

def rlvr_reward(completion, label):
    """1.0 if the last boxed answer equals the label as a number, else 0.0 (RLME §4.1)."""
    return 1.0 if numeric_equal(extract_boxed(completion), label) else 0.0

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
    """Both parse as numbers and are equal (ints exactly, else 1e-6 relative); None -> False."""
    a, b = to_number(pred), to_number(label)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)

_ARTICLES = re.compile(r"\b(?:a|an|the)\b")  # the SQuAD v1.1 evaluation script's rule
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)

def normalize_answer(s):
    """Lower case, drop punctuation, THEN articles, collapse spaces: "The A-Team!" -> "ateam"."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_DROP_PUNCTUATION)).split())

def qa_exact_match(prediction, golds):
    """EM = max_g 1[norm(prediction) == norm(g)]; prediction None (no answer) -> 0.0."""
    golds = [golds] if isinstance(golds, str) else golds
    return float(prediction is not None and any(normalize_answer(prediction) == normalize_answer(g)
                                                for g in golds))

def qa_f1(prediction, golds):
    """SQuAD token F1, the best over the golds: common = |P ∩ G| as multisets, precision =
    common/|P|, recall = common/|G|; one side empty -> 0.0, both -> 1.0; None -> 0.0."""
    golds, best = [golds] if isinstance(golds, str) else golds, 0.0
    pred = normalize_answer(prediction).split() if prediction is not None else None
    for gold in (normalize_answer(g).split() for g in golds if pred is not None):
        common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
        if not pred or not gold:
            best = max(best, float(pred == gold))
        elif common:
            p, r = common / len(pred), common / len(gold)
            best = max(best, 2 * p * r / (p + r))
    return best

def answer_reward(completion, label, label_format, qa_metric="em"):
    """RLVR reward in [0, 1]: label_format gsm8k / plain -> rlvr_reward; text -> qa_metric em | f1
    of the last box (never clean_number: "New York, USA" keeps its comma)."""
    if label_format != "text":
        return rlvr_reward(completion, label)
    return (qa_exact_match if qa_metric == "em" else qa_f1)(extract_boxed(completion), label)

# RLME: the evaluator prompt (RLME §3.1). {reference} is filled only for anchored items (sparse
# ground-truth anchoring); the delimiters are what build_evaluator_text cuts out of the solution.
DEFAULT_EVALUATOR_TEMPLATE = (
    "Below is a math problem and a proposed solution.\n\n"
    "Problem:\n{problem}\n\n"
    "{reference}"
    "<<<BEGIN SOLUTION>>>\n{solution}\n<<<END SOLUTION>>>\n\n"
    "Final answer extracted from the solution: {extracted}\n\n"
    "Question about the solution above: {question}\nReply with Yes or No.")
QA_EVALUATOR_TEMPLATE = (  # context QA (docs/method.md §4.2): {problem} = context + question
    "Below is a context (one or more passages), a question about it, and a proposed answer to the "
    "question.\n\n"
    "Context and question:\n{problem}\n\n"
    "{reference}"
    "Proposed answer:\n<<<BEGIN SOLUTION>>>\n{solution}\n<<<END SOLUTION>>>\n\n"
    "Final answer extracted from the proposed answer: {extracted}\n\n"
    "Question about the proposed answer above: {question}\nReply with Yes or No.")
REFERENCE_LINE = "Reference answer (from the answer key): {answer}\n\n"
SOLUTION_DELIMITERS = ("<<<BEGIN SOLUTION>>>", "<<<END SOLUTION>>>")

def check_evaluator_template(template):
    """The template, or SystemExit (one line): {problem} / {solution} / {question} missing or
    repeated, {question} before {solution}, or a trial fill fails (an unknown placeholder)."""
    for field in ("{problem}", "{solution}", "{question}"):
        if template.count(field) != 1:
            raise SystemExit(f"reward.evaluator_template must contain {field} exactly once")
    if template.index("{question}") < template.index("{solution}"):
        raise SystemExit("reward.evaluator_template: {question} must come after {solution}")
    try:
        build_evaluator_text(template, "problem", "solution", "question")
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"reward.evaluator_template cannot be filled ({type(e).__name__}: {e}); "
                         "placeholders: {problem} {solution} {extracted} {reference} {question}")
    return template

def build_evaluator_text(template, problem, solution, question, meta_questions=(), reference=None):
    """The evaluator's message for one (sample, meta-question); reference: an anchored item's gold.
    The meta-questions and delimiters are cut out of the solution until it stops changing (one
    pass can create what it removes), so the question appears once, after the closing delimiter."""
    extracted = extract_boxed(solution)
    cut, previous = [*meta_questions, question, *SOLUTION_DELIMITERS], None
    while solution != previous:
        previous = solution
        for s in cut:
            solution = solution.replace(s, "")
    return template.format(
        problem=problem, solution=solution.strip(), question=question,
        extracted=extracted if extracted is not None else "none",
        reference=REFERENCE_LINE.format(answer=reference) if reference is not None else "")

def evaluator_prompt_text(tokenizer, text, target, chat):
    """(prompt, prompt + target): text + "\nAnswer:", or the chat template's; a space before the
    target unless the prompt ends in one (" Yes" after "Answer:", "Yes" after a chat header)."""
    prompt = chat_prompt(tokenizer, text, chat, tokenize=False) if chat else text + "\nAnswer:"
    return prompt, prompt + ("" if prompt[-1:].isspace() else " ") + target

def evaluator_prompt_and_target_ids(tokenizer, text, target, chat):
    """(prompt_ids, target_ids) for a_k (RLME Eq. 2): ids(prompt + target) minus ids(prompt), never
    encode("Yes")[0] (" Yes" is not "Yes"; multi-token targets keep all theirs); a rendered chat
    string holds its BOS. ValueError when the tokenizer merges the prompt's end with the target."""
    prompt, full = evaluator_prompt_text(tokenizer, text, target, chat)
    prompt_ids = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=not chat)["input_ids"]
    if full_ids[:len(prompt_ids)] != prompt_ids or len(full_ids) == len(prompt_ids):
        raise ValueError(f"target {target!r}: prompt ids are not a prefix of prompt+target ids; "
                         f"end the evaluator template/answer stub with ':' or a newline")
    return prompt_ids, full_ids[len(prompt_ids):]

# RLME: the evaluators (RLME Eq. 2). Each is a dict {"name", "weight": v_j, "score"}, score(texts
# [N][K] str, targets [K] str) -> FloatTensor [N, K] of log p_{j,k}; NaN = could not score.
@torch.no_grad()
def score_targets(model, prompt_ids, target_ids, pad_id, micro_batch_size=8):
    """[N, K] float32 CPU log p(target | prompt) (teacher-forced, eval mode, no grad) for
    prompt_ids, target_ids: N lists of K non-empty id lists; micro_batch_size samples a forward.
    The K prompts of a sample differ only in the meta-question tail: (1) the common prefix runs
    once (left-padded; its KV cache repeated K times), (2) the K suffixes (tail + target) after
    it. Positions count real tokens only (mask cumsum), so the padding between the stages leaves
    every token at its position; only logits predicting targets reach the LM head."""
    device, out = next(model.parameters()).device, []
    with eval_mode(model):  # dropout off (a live evaluator is the policy, in train mode)
        for s in range(0, len(prompt_ids), micro_batch_size):
            prompts, targets = (x[s:s + micro_batch_size] for x in (prompt_ids, target_ids))
            k = len(prompts[0])
            # the common prefix ends >= 1 token before the shortest prompt, so every suffix row
            # holds the position whose logits predict its first target token
            cut = [min(len(os.path.commonprefix(p)), min(map(len, p)) - 1) for p in prompts]
            cache = DynamicCache(config=model.config)
            ids, past = (x.to(device) for x in left_pad([p[0][:c] for p, c in zip(prompts, cut)],
                                                        pad_id))
            model(input_ids=ids, attention_mask=past, cache=cache, use_cache=True, logits_to_keep=1,
                  position_ids=(past.cumsum(-1) - 1).clamp(min=0))
            for layer in cache.layers:
                layer.keys = layer.keys.repeat_interleave(k, dim=0)
                layer.values = layer.values.repeat_interleave(k, dim=0)
            rows = [pk[c:] + tk for p, t, c in zip(prompts, targets, cut) for pk, tk in zip(p, t)]
            ids, mask = (x.to(device) for x in left_pad(rows, pad_id))
            full, width = torch.cat([past.repeat_interleave(k, dim=0), mask], dim=1), ids.shape[1]
            # column j predicts column j + 1; each row ends with its target: predicted from columns
            # width - 1 - len(target) .. width - 2 (the last column predicts nothing we read)
            n_tgt = torch.tensor([[len(tk)] for t in targets for tk in t], device=device)
            col = torch.arange(width, device=device)
            pred = (col >= width - 1 - n_tgt) & (col < width - 1)
            logits = model(input_ids=ids, attention_mask=full, cache=cache, use_cache=True,
                           position_ids=(full.cumsum(-1) - 1).clamp(min=0)[:, -width:],
                           logits_to_keep=pred).logits  # [target tokens, V], row-major
            lp = token_logprobs(logits, torch.roll(ids, -1, dims=1)[pred])
            sums = torch.zeros(len(rows), device=device).index_add_(0, pred.nonzero()[:, 0], lp)
            out.append(sums.view(-1, k).cpu())
    return torch.cat(out)

def local_evaluator(model, tokenizer, *, chat=False, name="self", weight=1.0, micro_batch_size=8,
                    frozen=False):
    """An in-process evaluator: live = the policy; frozen_self / frozen = a loaded copy of the
    initial policy / another model (frozen=True: eval, no grad). A NaN the model computes is a
    broken number, not a failed request: -inf, which rlme_reward replaces and counts."""
    if frozen:
        model.eval().requires_grad_(False)
    def score(texts, targets):
        ids = [[evaluator_prompt_and_target_ids(tokenizer, t, a, chat)
                for t, a in zip(row, targets)] for row in texts]
        logp = score_targets(model, [[p for p, _ in r] for r in ids],
                             [[t for _, t in r] for r in ids], tokenizer.pad_token_id,
                             micro_batch_size=micro_batch_size)
        return torch.nan_to_num(logp, nan=-math.inf)
    return {"name": name, "weight": float(weight), "score": score}

def _openai_client(base_url, api_key_env, timeout_s, max_retries, where, on_request=None):
    """openai.OpenAI retrying 408/409/429/5xx, timeouts, refused connections with backoff;
    api_key_env: the key's variable (None: a local server); on_request(request): each try."""
    import openai
    key = os.environ.get(api_key_env) if api_key_env else "EMPTY"
    if not key:
        raise SystemExit(f"{where}: environment variable {api_key_env} is not set")
    return openai.OpenAI(base_url=base_url, api_key=key, timeout=float(timeout_s),
                         max_retries=int(max_retries), http_client=openai.DefaultHttpxClient(
                             event_hooks={"request": [on_request] if on_request else []}))

def _why(err):
    """A failed request in one line: 'InternalServerError: Error code: 500 - ...'."""
    return " ".join(f"{type(err).__name__}: {getattr(err, '__cause__', None) or err}".split())[:200]

def remote_evaluator(base_url, model, *, name="remote", weight=1.0, tokenizer=None, chat=False,
                     api_key_env=None, timeout_s=60.0, max_retries=4, concurrency=4):
    """An evaluator scored by an OpenAI-compatible /v1/completions server (`vllm serve`) echoing
    the prompt's log-probs (max_tokens=1: vLLM generates >= 1 token, not read); tokenizer + chat:
    the served model's chat template (add_special_tokens false is sent). "failures": each text's
    reason in the last call; a request failing after the retries scores NaN (masked). One text is
    scored now: SystemExit (one line) on failure."""
    client = _openai_client(base_url, api_key_env, timeout_s, max_retries, f"evaluator {name}")
    def one(prompt, full):
        try:
            resp = client.completions.create(
                model=model, prompt=full, max_tokens=1, echo=True, logprobs=1, temperature=0.0,
                extra_body={"add_special_tokens": False} if chat else None)
            return echo_target_logprob(resp.choices[0].model_dump(), full, full[len(prompt):],
                                       resp.usage.prompt_tokens)
        except Exception as e:
            return None, _why(e)
    def score(texts, targets):
        pairs = [evaluator_prompt_text(tokenizer, t, a, chat) for row in texts
                 for t, a in zip(row, targets)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            res = list(pool.map(lambda pf: one(*pf), pairs))
        ev["failures"][:] = [w for _, w in res]
        return torch.tensor([math.nan if v is None else v for v, _ in res]).view(len(texts), -1)
    ev = {"name": name, "weight": float(weight), "score": score, "failures": []}
    v, why = one(*evaluator_prompt_text(tokenizer, "Is 2 + 2 = 4?", "Yes", chat))
    if v is None:
        raise SystemExit(f"evaluator {name}: cannot score at {base_url} (model {model}): {why}")
    return ev

def echo_target_logprob(choice, full, suffix, prompt_tokens):
    """(log p of `suffix`, "") or (None, reason) from an echoed choice: the sum over the last
    tokens of its first `prompt_tokens` that spell `suffix` (by texts: servers' offsets differ)."""
    lp = choice.get("logprobs") or {}
    tokens, values = (lp.get("tokens") or [])[:prompt_tokens], lp.get("token_logprobs") or []
    if not tokens or not str(choice.get("text")).startswith(full):
        return None, "no echoed prompt with log-probs (does the server support echo+logprobs?)"
    start = len(tokens)
    while start > 0 and len("".join(tokens[start:])) < len(suffix):
        start -= 1
    vals = values[start:len(tokens)]
    if "".join(tokens[start:]) != suffix or not all(isinstance(v, (int, float)) for v in vals):
        return None, f"the last tokens {tokens[start:]!r} ({vals}) are not the target {suffix!r}"
    return float(sum(vals)), ""

# RLME: the reward (RLME Eq. 2-3)
def rlme_reward(evaluators, meta_questions, problems, solutions, references=None, anchored=None,
                template=DEFAULT_EVALUATOR_TEMPLATE, renormalize=False, nonfinite_logp=-50.0,
                transform="log"):
    """r(x, y) = sum_j v_j sum_k w_k log p_{j,k} (RLME Eq. 2-3); "prob": v w p summed instead.
    renormalize (not the paper's reward, off by default): log p(a_k) - log(p(a_k) + p(negative_k)),
    the negatives scored as K extra rows on the same prefix. anchored[i] shows references[i]
    (sparse anchoring); an inf log p (a broken evaluator) becomes nonfinite_logp, counted.
    Returns {"reward" [N] (NaN where not valid), "logp" [N, J, K], "nonfinite", "failed"
    [N, J, K] (NaN: not scored; a remote evaluator's reasons: its "failures"), "valid" [N]}."""
    questions, targets = ([m[key] for m in meta_questions] for key in ("question", "target"))
    k = len(questions)
    if renormalize:  # q_k asked twice: once scored on a_k, once on its negative
        negatives = [m.get("negative", "No") for m in meta_questions]
        questions, targets = questions * 2, targets + negatives
    refs = [references[i] if anchored and anchored[i] else None for i in range(len(solutions))]
    texts = [[build_evaluator_text(template, x, y, q, questions[:k], reference=ref)
              for q in questions] for x, y, ref in zip(problems, solutions, refs)]
    logp = torch.stack([ev["score"](texts, targets) for ev in evaluators], 1).float()
    failed, bad = logp.isnan(), torch.isinf(logp)
    if renormalize:
        logp = logp[..., :k] - torch.logaddexp(logp[..., :k], logp[..., k:])
        failed, bad = failed[..., :k] | failed[..., k:], bad[..., :k] | bad[..., k:]
    bad = bad & ~failed
    logp = torch.where(bad, torch.full_like(logp, nonfinite_logp), logp)
    terms = logp if transform == "log" else logp.exp()  # after the replacement: never NaN
    reward = weighted_reward(terms, [ev["weight"] for ev in evaluators],
                             [m["weight"] for m in meta_questions])
    valid = ~failed.any(2).any(1)
    return {"reward": torch.where(valid, reward, torch.full_like(reward, math.nan)), "logp": logp,
            "nonfinite": int(bad.sum()), "valid": valid, "failed": failed}

def weighted_reward(logp, v, w):
    """r = sum_j v_j sum_k w_k log p_{j,k} (RLME Eq. 3): logp [N, J, K], v [J], w [K] -> [N]."""
    v, w = torch.as_tensor(v, dtype=logp.dtype), torch.as_tensor(w, dtype=logp.dtype)
    return (logp * v[None, :, None] * w[None, None, :]).sum((1, 2))

def hybrid_reward(rlvr, rlme, rlvr_weight=1.0):
    """rlvr_weight * r_RLVR + r_RLME, float32 [N] ("RLVR + RLME" of RLME's QA tables per secondary
    notes, docs/method.md §4.2; the additive form is our choice)."""
    rlvr, rlme = (torch.as_tensor(x, dtype=torch.float32) for x in (rlvr, rlme))
    return rlvr_weight * rlvr + rlme

def logp_metric_name(evaluator, question):
    """The metric name of an evaluator's mean log p for one meta-question (ours and TRL's)."""
    return f"rlme/{evaluator}/{question}/logp"

# RM-NLHF: the GRM prompts and parser (RM-NLHF §3.1)
PAIR_TEXT = "[Conversation]\n{context}\n\n[Response A]\n{response_a}\n\n[Response B]\n{response_b}"
GRM_PROMPT = (
    "You are judging two AI assistant responses to the same conversation. Decide which response "
    "is better: more helpful, correct, honest and harmless for the user.\n\n" + PAIR_TEXT + "\n\n"
    "Write a short critique (at most {max_lines} lines) that states the key reasons for your "
    "decision, inside <critics>...</critics>. Then give your verdict inside <choice>...</choice>: "
    "<choice>[[A]]</choice> if Response A is better, or <choice>[[B]]</choice> if Response B is "
    "better.")
# The authors' prompt, verbatim from their release (PROMPT_GRM in Character-GenRM-NLHF's
# verl/workers/reward_manager/pairwise_grm.py, github.com/liudan193/Qwen-Character)
AUTHORS_GRM_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by two "
    "AI Chatbots to the Client question displayed below.\n\n[Client Question]\n{context}\n\n"
    "[The Start of Chatbot A's Response]\n{response_a}\n[The End of Chatbot A's Response]\n\n\n"
    "[The Start of Chatbot B's Response]\n{response_b}\n[The End of Chatbot B's Response]\n\n"
    "Output your final verdict by strictly following this format:\n\n<critics>\n[Provide a brief "
    "summary of your reasoning for the choice]\n</critics>\n\n<choice>\n[[A]]\n</choice>\n\n"
    "Note: Use [[A]] if A is better, or [[B]] if B is better.")

def nlhf_step_items(dh, do, step, *, prompts_per_step, dh_per_step, seed, rank, world):
    """This rank's items for `step`: round(dh_per_step P) of P from D_H (all without D_O), the rest
    from D_O, each a seeded stream (rollout.step_items), shuffled by (seed, step), tagged "set"."""
    P = prompts_per_step
    n_dh = round(dh_per_step * P) if do else P
    both = ([dict(it, set="dh") for it in rollout.step_items(dh, step, n_dh, seed, 0, 1)]
            + [dict(it, set="do") for it in rollout.step_items(do, step, P - n_dh, seed + 1, 0, 1)])
    order = torch.randperm(P, generator=torch.Generator().manual_seed(seed * 100_019 + step))
    return [both[k] for k in order[rank * (P // world):(rank + 1) * (P // world)].tolist()]

def grm_prompt_ids(tokenizer, item, chat, *, max_lines, style):
    """The GRM prompt's ids for a pairwise item (in the chat template when `chat`)."""
    text = build_grm_prompt(item["context"], item["response_a"], item["response_b"], max_lines,
                            style=style, turns=item.get("meta", {}).get("turns"))
    return rollout.build_prompt_ids(tokenizer, text, chat)

def build_grm_prompt(context, response_a, response_b, max_lines=4, style="ours", turns=None):
    """The GRM user message: "ours" (stating the max_lines that parse_grm_output enforces) or
    "authors" (their prompt; the conversation's `turns` as "role:\\ncontent\\n" when kept)."""
    if style == "authors":
        conv = "".join(f"{t.get('role', 'unknown')}:\n{t.get('content', '')}\n"
                       for t in turns or [])
        return AUTHORS_GRM_PROMPT.format(context=conv or context.strip(), response_a=response_a,
                                         response_b=response_b)
    return GRM_PROMPT.format(context=context.strip(), response_a=response_a.strip(),
                             response_b=response_b.strip(), max_lines=max_lines)

def parse_grm_output(text, max_lines=4, max_chars=1500, style="ours"):
    """A GRM completion -> {critique, choice, valid, why: '' | no_critique | no_choice |
    too_many_lines | too_long} (limits: the authors' reward_function_rm_nlhf). "ours": the LAST
    <critics> (blank: none), the [[A]]/[[B]] of the last <choice>, else the first anywhere;
    non-blank lines. "authors" (their parse_llm_evaluation): an empty critique is valid; the last
    <choice>'s letter if only one of A, B is in it, [[ A ]] only without <choice>; all lines."""
    text = text or ""
    blocks = re.findall(r"<critics>(.*?)</critics>", text, flags=re.S)
    choices = re.findall(r"<choice>(.*?)</choice>", text, flags=re.S)
    critique = blocks[-1].strip() if blocks else None
    if style == "ours":
        critique = critique or None
        m = [re.search(r"\[\[([AB])\]\]", t) for t in (choices[-1:] + [text])]  # last block first
        choice = next((x.group(1) for x in m if x), None)
        n_lines = critique and len([ln for ln in critique.splitlines() if ln.strip()])
    else:
        m = None if choices else re.search(r"\[\[\s*([AB])\s*\]\]", text)
        last = choices[-1] if choices else ""
        choice = {(True, False): "A", (False, True): "B"}.get(("A" in last, "B" in last)) \
            if choices else m and m.group(1)
        n_lines = critique is not None and len(critique.split("\n"))
    why = ("no_critique" if critique is None else "no_choice" if choice is None
           else "too_many_lines" if n_lines > max_lines
           else "too_long" if len(critique) > max_chars else "")
    return {"critique": critique, "choice": choice, "valid": why == "", "why": why}

# RM-NLHF: the D_H and D_O rewards (Eq. 4, 5, 8) and the step metrics. A sample whose judge call
# failed gets reward None: it is left out of its group's mean/std and of the loss, and counted in
# judge/fail_rate; never 0 (a real "no match" score) unless on_failure "zero" (the release's).
def process_reward(f1, threshold=0.5, inclusive=False):
    """R_process (Eq. 4) = 1 if S(h, c) > threshold else 0 (strict, as Eq. 4 and Alg. 1: F1 = 0.5
    earns nothing); inclusive: >= (the released code); None when the judge failed."""
    if f1 is None:
        return None
    return 1.0 if (f1 >= threshold if inclusive else f1 > threshold) else 0.0

def dh_reward(valid, correct, f1, lam=0.5, threshold=0.5, gate_on_outcome=True, inclusive=False):
    """(reward, r_process) of a D_H sample (Eq. 4-5): invalid -1, wrong 0, right 1 + lam R_process;
    f1 None where needed -> None (masked); lam 0: outcome only (Table 3); gate_on_outcome False:
    R_outcome + lam R_process for any valid verdict (§4.3 ablation)."""
    if not valid:
        return -1.0, None
    outcome = 1.0 if correct else 0.0
    if not correct and gate_on_outcome or lam == 0:
        return outcome, None
    r_proc = process_reward(f1, threshold, inclusive=inclusive)
    return (None, None) if r_proc is None else (outcome + lam * r_proc, r_proc)

def do_reward(valid, correct, r_hat, lam=0.5, mode="online", gate_on_outcome=True, form="paper"):
    """A D_O reward from R_hat (Eq. 8, App. H.1): invalid -1; mode none: outcome; metarm_only:
    clip(R_hat, 0, 1 + lam); else wrong 0 (no gate: clip(R_hat, 0, lam)), right 1 +
    clip(R_hat - 1, 0, lam) (form paper) or 1 + lam max(0, R_hat - 1) (released, unclipped)."""
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

# a sample's judge fields before (or without: D_O) a judge call; samples.jsonl's schema
NOT_JUDGED = {"human_critique": None, "f1": None, "precision": None, "recall": None,
              "judge_why": None, "judge_attempts": 0, "judged": False, "judge_failed": False}

def score_dh(parsed, items, judge, lam=0.5, threshold=0.5, gate_on_outcome=True, inclusive=False,
             similarity="f1", on_failure="mask"):
    """D_H rewards (Eq. 4-5): the judge (make_judge's) sees only valid right verdicts (§3.1; any
    valid one without the gate; none when lam = 0); similarity: the judge number that is S(h, c)
    (§2.3); on_failure "mask" -> None, "zero" -> S = 0."""
    samples = [{"choice": p["choice"], "valid": p["valid"], "why": p["why"],
                "correct": bool(p["valid"] and p["choice"] == it["winner"]),
                "critique": p["critique"], **NOT_JUDGED, "human_critique": it["critique"]}
               for p, it in zip(parsed, items)]
    need = [i for i, s in enumerate(samples)
            if lam > 0 and s["valid"] and (s["correct"] or not gate_on_outcome)]
    results = judge([(items[i]["critique"], parsed[i]["critique"], items[i]) for i in need]
                    ) if need else []
    for i, r in zip(need, results):
        failed = r[similarity] is None  # no S(h, c) for Eq. 4
        if failed and on_failure == "zero":
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
    """D_O sample dicts {choice, valid, why, correct, critique, r_hat, reward} (Eq. 8)."""
    out = [{"choice": p["choice"], "valid": p["valid"], "why": p["why"],
            "correct": bool(p["valid"] and p["choice"] == it["winner"]),
            "critique": p["critique"], "r_hat": rh} for p, it, rh in zip(parsed, items, r_hat)]
    return [dict(s, reward=do_reward(s["valid"], s["correct"], s["r_hat"], lam=lam, mode=mode,
                                     gate_on_outcome=gate_on_outcome, form=form)) for s in out]

def do_training_samples(parsed, items, lam):
    """MetaRM labels for D_O ("w/ D_O for MetaRM", Table 3): right 1 + lam/2 (process unknown),
    wrong 0, invalid None (not trained on). §4.3 gives correct 0, incorrect 1 + lam/2: read as
    reversed (docs/method.md §5.4)."""
    return [{"valid": p["valid"], "critique": p["critique"], "reward": None if not p["valid"]
             else 1.0 + lam / 2 if p["choice"] == it["winner"] else 0.0, "outcome_label": True}
            for p, it in zip(parsed, items)]

def nlhf_step_metrics(records, step_metrics=None):
    """A step's RM-NLHF metrics (all ranks' records): format_error_rate, outcome_acc (invalid =
    wrong), judge/fail_rate = failed / judged calls, process_rate and f1_mean over the successful
    calls, per set outcome_acc and reward_mean, mean R_hat, failed calls; then `step_metrics`."""
    n = max(len(records), 1)
    judged = [s for s in records if s.get("judged")]
    ok = [s for s in judged if not s["judge_failed"]]
    out = {"nlhf/format_error_rate": sum(not s["valid"] for s in records) / n,
           "nlhf/outcome_acc": sum(s["correct"] for s in records) / n,
           "judge/calls": len(judged),
           "judge/fail_rate": (len(judged) - len(ok)) / len(judged) if judged else 0.0}
    if ok:
        out["nlhf/process_rate"] = sum(s["r_process"] == 1.0 for s in ok) / len(ok)
        out["judge/f1_mean"] = sum(s["f1"] for s in ok) / len(ok)
    for name in ("dh", "do"):
        part = [r for r in records if r.get("set") == name]
        if part:
            scored = [r["reward"] for r in part if r["reward"] is not None]
            out[f"nlhf/{name}/outcome_acc"] = sum(r["correct"] for r in part) / len(part)
            out[f"nlhf/{name}/reward_mean"] = sum(scored) / max(1, len(scored))
    hats = [r["r_hat"] for r in records if r.get("r_hat") is not None]
    out["metarm/r_hat_mean"] = sum(hats) / len(hats) if hats else None
    out["judge/failed"] = len(judged) - len(ok)
    return {**out, **(step_metrics or {})}

# The critique judge S(h, c) (RM-NLHF §2.3, App. E): "Similarity w/ Core HC" (variant core, the
# paper's), "w/ All HC" (all), "LLM-as-a-Meta-Judge" (meta_judge: the GRM critique alone). The
# paper's prompt texts (Figs. 11, 13) are not public: ours follow its description.
_JUDGE_STEPS = {
    "core": "2. List the CORE arguments of the reference: the decisive reasons that settle which "
            "response is better. Leave out nitpicks and minor points (style, small omissions, "
            "things that would not change the verdict). If the reference names a fatal error "
            "(one that by itself decides the comparison, e.g. a wrong final answer, a harmful or "
            "refused reply), count that error as the only core argument. Let H be their number."
            "\n3. List the core arguments of the candidate the same way. Let C be their number.",
    "all": "2. List ALL arguments of the reference: every distinct reason about one response (a "
           "flaw or a strength), minor ones included. Let H be their number.\n3. List all "
           "arguments of the candidate the same way. Let C be their number."}
JUDGE_PROMPT = (
    "You compare two critiques of the same pair of AI responses (Response A and Response B): a "
    "REFERENCE critique written by a human expert and a CANDIDATE critique written by a model. "
    "Measure how many of the reference's arguments the candidate makes.\n\n"
    "Work through these steps in order.\n1. Repetition check. If the candidate restates the same "
    "argument more than once (the same point in other words, copied sentences, or filler that "
    "repeats itself), stop here and answer precision 0, recall 0, f1 0.\n{steps}\n4. Match "
    "candidate arguments to reference arguments by meaning and stance: a match must be about the "
    "same response with the same polarity (both call it a flaw, or both a strength); wording may "
    "differ. Each reference argument and each candidate argument can be used in at most one "
    "match. Let M be the number of matches.\n5. precision = M / C, recall = M / H, f1 = 2 * "
    "precision * recall / (precision + recall), and 0 when M is 0.\n\n"
    "[Reference critique]\n{human}\n\n[Candidate critique]\n{model}\n\n"
    "Think briefly, then end your answer with exactly these tags, each holding a plain decimal "
    "number between 0 and 1 (for example 0.5):\n<precision>...</precision>\n<recall>...</recall>\n"
    "<f1>...</f1>")
META_JUDGE_PROMPT = (
    "You check a CRITIQUE that a model wrote about two AI responses to the same conversation. "
    "Decide whether the critique is correct: it identifies the real issues (or strengths) of the "
    "responses that decide which one is better, and claims nothing false about them.\n\n"
    "Work through these steps in order.\n1. Repetition check. If the critique restates the same "
    "point more than once, answer 0.\n2. Read the conversation and both responses; note any fatal "
    "error (one that by itself decides the comparison, e.g. a wrong final answer, a harmful or "
    "refused reply). A critique that misses a fatal error, or blames a response for a flaw it "
    "does not have, is not correct.\n3. Answer 1 if the critique is correct, else 0.\n\n"
    + PAIR_TEXT + "\n\n[Critique]\n{model}\n\n"
    "Think briefly, then end your answer with exactly this tag holding 1 or 0:\n"
    "<correct>...</correct>")
# authors: the release's Core-HC judge, verbatim (the object of study, like a paper's prompt):
# prompt_f1_based_similarity_score, github.com/liudan193/Qwen-Character Character-GenRM-NLHF/verl/
# recipe/rm_nlhf/reward_function.py lines 109-174; judge_prompt renders as its lines 216-238.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                       "rm_nlhf_release_judge.txt")) as _f:  # the text, byte for byte
    AUTHORS_JUDGE_PROMPT = _f.read()
JUDGE_VARIANTS = ("core", "all", "meta_judge", "authors")

def judge_prompt(variant, human, model, item=None):
    """The judge's request for GRM critique `model`: against the human critique (core, all,
    authors) or alone with the pair `item` (meta_judge). authors: each inside <critics>, the human
    one as the item's parts (meta "critique_parts": <strengths_A>...</weaknesses_B>, the release's
    processed_critique), else (HelpSteer3's reasoning) as its text."""
    if variant == "authors":
        parts = (item or {}).get("meta", {}).get("critique_parts")
        human = "\n\n".join(f"<{k}_{x}>\n{parts[x][k]}\n</{k}_{x}>" for x in "AB" for k in (
            "strengths", "weaknesses")) if parts else human.strip()
        return AUTHORS_JUDGE_PROMPT.format(critiques=f"<critics>\n{model.strip()}\n</critics>",
                                           reference_critiques=f"<critics>\n{human}\n</critics>")
    if variant == "meta_judge":
        return META_JUDGE_PROMPT.format(context=item["context"].strip(), model=model.strip(),
                                        response_a=item["response_a"].strip(),
                                        response_b=item["response_b"].strip())
    return JUDGE_PROMPT.format(steps=_JUDGE_STEPS[variant], human=human.strip(),
                               model=model.strip())

def parse_meta_judge_output(text):
    """The last <correct>1|0</correct> as precision = recall = f1; all None with `why` else."""
    m = re.findall(r"<correct>\s*([01])\s*</correct>", text or "")
    v = float(m[-1]) if m else None
    return {"precision": v, "recall": v, "f1": v,
            "why": "" if m else "no <correct>0|1</correct> tag"}

_DECIMAL = re.compile(r"\d+(?:\.\d*)?|\.\d+")  # not float()'s grammar: it accepts 'nan', 'inf'

def parse_judge_output(text, authors=False):
    """The LAST <precision>, <recall>, <f1> -> floats in [0, 1] and why ''; else all None, why.
    authors (the release's parse_similarity_scores, reward_function.py lines 86-107, and line
    283): each <critique_TAG>'s FIRST match of \\d+\\.?\\d* (re.search: ' 0.5', 'nan', '-1' never
    match), only f1 checked in [0, 1]."""
    out, vals = {"precision": None, "recall": None, "f1": None, "why": ""}, {}
    value = r"\d+\.?\d*" if authors else ".*?"
    for tag in ("precision", "recall", "f1"):
        name = "critique_" * authors + tag
        found = re.findall(rf"<{name}>({value})</{name}>", text or "", flags=re.S)
        if not found:
            return dict(out, why=f"missing <{name}> tag" + " with a number" * authors)
        s = found[0 if authors else -1].strip()
        if not _DECIMAL.fullmatch(s):
            return dict(out, why=f"<{tag}> is not a plain decimal: {s[:40]!r}")
        if not 0.0 <= float(s) <= 1.0 and (tag == "f1" or not authors):
            return dict(out, why=f"<{name}> outside [0, 1]: {s}")
        vals[tag] = float(s)
    return dict(vals, why="")

def make_judge(*, backend="openai", variant="core", base_url="http://127.0.0.1:8000/v1",
               model=None, api_key_env=None, concurrency=8, timeout_s=60.0, max_retries=4,
               temperature=0.0, max_tokens=512, probe=True, deadline_s=None):
    """judge(pairs [(human critique, GRM critique, item)]) -> [{"f1", "precision", "recall", "why",
    "attempts": HTTP requests, retries included}] in order, `concurrency` at a time; a failure is
    f1 None, never an exception. "openai": judge_prompt to a chat server (an answer that does not
    parse fails, not retried; None temperature / max_tokens are not sent); "proxy": proxy_f1.
    SystemExit (one line): an unknown backend / variant; probe: a short start-up request fails.
    deadline_s: judge() returns by then, a pair still pending failed ("deadline"; its request ends
    in the background): a stuck server must not outlast the ranks' collective timeout."""
    if backend not in ("openai", "proxy"):
        raise SystemExit(f"judge.backend: {backend!r} unknown; allowed: openai, proxy")
    if variant not in JUDGE_VARIANTS:
        raise SystemExit(f"judge.variant: {variant!r} unknown; allowed: {'|'.join(JUDGE_VARIANTS)}")
    if backend == "proxy":
        def one(pair):
            return dict(proxy_f1(pair[0], pair[1]), attempts=1)
    else:
        if not model:
            raise SystemExit("judge.model: required for backend 'openai' (the name it serves)")
        tries = threading.local()  # the client retries in the calling thread: count per call
        client = _openai_client(base_url, api_key_env, timeout_s, max_retries, "judge.api_key_env",
                                lambda request: setattr(tries, "n", getattr(tries, "n", 0) + 1))
        parse = parse_meta_judge_output if variant == "meta_judge" else lambda t: (
            parse_judge_output(t, authors=variant == "authors"))
        fields = {k: v for k, v in (("temperature", temperature),
                                    ("max_completion_tokens", max_tokens)) if v is not None}
        short = {"max_completion_tokens": min(max_tokens, 8)} if max_tokens else {}
        try:  # probe: a wrong base_url / model stops here, not as every step's masked calls
            if probe:  # the answer is not read
                client.chat.completions.create(model=model, messages=[
                    {"role": "user", "content": "Say OK."}], **{**fields, **short})
        except Exception as e:
            raise SystemExit(f"judge.base_url / judge.model: the start-up request to {base_url} "
                             f"(model {model}) failed: {_why(e)}")
        def one(pair):
            tries.n = 0
            try:
                resp = client.chat.completions.create(model=model, messages=[{
                    "role": "user", "content": judge_prompt(variant, *(pair + (None,))[:3])}],
                    **fields)
                if isinstance(resp, str):  # what the client gives for a non-JSON answer
                    raise ValueError(f"not a chat completion (HTML page or wrong URL?): "
                                     f"{resp[:60]!r}")
                r = parse(resp.choices[0].message.content)
                why = "parse failure: " + r["why"] if r["f1"] is None else ""
            except Exception as e:
                r, why = {"precision": None, "recall": None, "f1": None}, _why(e)
            return dict(r, why=why, attempts=tries.n)

    def judge(pairs):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(concurrency)))
        calls = [pool.submit(one, tuple(pair)) for pair in pairs]
        concurrent.futures.wait(calls, timeout=deadline_s)
        pool.shutdown(wait=False, cancel_futures=True)  # not yet started: never sent
        late = {"precision": None, "recall": None, "f1": None, "attempts": 0,
                "why": f"deadline: no answer within {deadline_s} s"}
        return [c.result() if c.done() and not c.cancelled() else dict(late) for c in calls]
    return judge

# The offline PROXY judge: a lexical stand-in for tests and laptops, not the paper's LLM judge.
_STOP = set("""a an the and or but if then than so of to in on at by for with from as is are was
were be been being it its this that these those there here which who whom what when where why how
not no yes do does did done has have had can could should would will shall may might must very
also just only more most less least such both each other into about over under again further
their they them he she his her we our you your i me my too response""".split())

def _points(text):
    """Sentences as content-word sets; 'Response A' -> 'resp_a' (the response a point is about)."""
    text = re.sub(r"\bresponse\s+([ab])\b", r"resp_\1", (text or "").lower())
    words = ({w for w in re.findall(r"[a-z0-9_]+", s) if w not in _STOP}
             for s in re.split(r"(?<=[.!?;])\s+|\n+", text))
    return [w for w in words if w]

def proxy_f1(human, model, match=0.4, repeat=0.8):
    """F1 of greedily matched sentence points: model points overlapping >= `repeat` (Dice) -> 0;
    (human, model) pairs with Dice >= `match` matched by decreasing overlap, each point once."""
    def dice(x, y):
        return 2 * len(x & y) / (len(x) + len(y))
    hp, mp = _points(human), _points(model)
    if not hp:
        return {"f1": None, "precision": None, "recall": None, "why": "proxy: empty human critique"}
    if any(dice(mp[i], mp[j]) >= repeat for i in range(len(mp)) for j in range(i + 1, len(mp))):
        return {"f1": 0.0, "precision": 0.0, "recall": 0.0, "why": "proxy: repetition"}
    used_h, used_m = set(), set()
    for sim, i, j in sorted(((dice(h, m), i, j) for i, h in enumerate(hp)
                             for j, m in enumerate(mp)), reverse=True):
        if sim >= match and i not in used_h and j not in used_m:
            used_h.add(i)
            used_m.add(j)
    m = len(used_h)
    p, r = (m / len(mp) if mp else 0.0), m / len(hp)
    return {"f1": 2 * p * r / (p + r) if m else 0.0, "precision": p, "recall": r, "why": "proxy"}
