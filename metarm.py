"""MetaRM: a scalar regression model that predicts the RM-NLHF reward where no human critique
exists.

RM-NLHF §3.2, App. D. The GRM earns R = 1 + λ·R_process on D_H items (Eq. 5), where a judge
compares its critique with the human one (Eq. 4). D_O items have a preference label but no human
critique, so the process term is predicted instead: the MetaRM reads (conversation, response A,
response B, GRM critique), regresses the D_H reward R (∈ {0, 1, 1 + λ} with the default
nlhf.gate_on_outcome; R = -1 samples are left out) with MSE (Eq. 6-7), and its prediction R̂
(`predict`: the raw output), clipped to [0, 1 + λ] by reward.do_reward, sets the D_O reward
R' = 1 + max(0, R̂ - 1) for a right verdict (Eq. 8): a bonus of at most λ, as on D_H.

One RM-NLHF step, in Algorithm 1's order (App. D.1; `nlhf_reward_step` does steps 2-4):
    Step 1  the GRM's completions for D_H and D_O prompts        train.py, stage 1
    Step 2  D_H rewards from the judge (Eq. 4-5)                 reward.score_dh
    Step 3  update the MetaRM on those D_H samples (Eq. 7)       online_update -> update -> fit
    Step 4  R̂ for D_O samples from the UPDATED MetaRM (Eq. 6),   predict
            then the D_O rewards (Eq. 8)                          reward.score_do / reward.do_reward
    Step 5  GRPO update of the GRM (Eq. 1-3)                      train.py, stages 3-4
The cold start (Algorithm 1, lines 2-10: cold_start_sample and cold_start_examples per batch of D_H
prompts, then fit_cold_start -> train_metarm -> fit) trains with the same loop;
plumbing/cold_start.py runs it.

Ablation switches (`metarm.mode`, the paper's ablations, RM-NLHF §4 and App. H):
    none         no MetaRM: D_O reward is the outcome only (-1 / 0 / 1); cold start is skipped
    offline      cold start, then frozen: update() is a no-op that still reports agreement
    online       cold start + one update per step (default, the paper's method)
    metarm_only  online, but the D_O reward is clip(R̂, 0, 1 + λ) without the outcome term
    binary       online, the regression MetaRM as trained for `online`, its output discretised
                 (App. H.1: "outputs discretized to {0, 1}"): the process bit is 1[R̂ > 1 + λ/2]
                 (nearer 1 + λ than 1), so predict() returns R̂ = 1 + λ·bit
    binary_retrain  online; the MetaRM regresses y = 1[R > 1] (right AND critique matched) with MSE
                 instead, predict() returns R̂ = 1 + λ·1[ŷ >= 0.5]
                 (ours: an earlier reading, kept)
    classifier   online; a 3-way classification head over the reward values (0, 1, 1 + λ) with
                 cross-entropy (3 classes, their expected value Σ p_c · value_c as R̂: ours; the
                 paper says only "classification head")
    binary_retrain, classifier: refused with nlhf.gate_on_outcome false or metarm.train_on_do (no
                 class / bit for the targets λ and 1 + λ/2; binary too without the gate:
                 plumbing/config.py)
metarm.train_on_do adds D_O verdicts with outcome-only labels (reward.do_training_samples).

The functions take the MetaRM model, its tokenizer and numbers (metarm_loss, predict, fit, update);
online_update and nlhf_reward_step keep its state, a plain dict (plumbing/metarm_setup.py
load_metarm): {"model", "tokenizer", "optimizer" (online AdamW, made by the first update that
trains), "mode", "lam", "batch_size", "max_length", "online_lr", "online_epochs", "weight_decay",
"dtype" (autocast's; parameters and AdamW state are float32), "updates", "truncated" (counts),
"shard" ((rank, world): FSDP2 shards it), "seams" (plumbing/scale.py metarm_seams: where torchrun's
ranks meet)}.

Run alone: python -m plumbing.cli metarm --config configs/cpu_rm_nlhf.yaml cold-start (saves to
metarm.path, or <run.out_dir>/metarm, where train.py picks it up instead of cold-starting
itself)."""
import math
import random
import time

import torch
import torch.nn.functional as F

import reward
import rollout


# ==============================================================================================
# THE RM-NLHF REWARD STEP (Algorithm 1, steps 2-4): judge D_H, update the MetaRM, predict D_O
# ==============================================================================================


def nlhf_reward_step(items, completions, *, judge, mrm, lam, threshold, inclusive, similarity,
                     gate_on_outcome, on_failure, max_lines, max_chars, style, form, mode,
                     train_on_do, seed, t0):
    """Rewards of one step's GRM completions, Algorithm 1's steps 2-4 in its order (RM-NLHF
    App. D.1):
      Step 2  D_H: parse, judge (only valid + right verdicts),
              R = -1 | 0 | 1 + λ·R_process                              (Eq. 4-5)
      Step 3  MetaRM update on those D_H samples (all ranks' samples:
              online_update)                                            (Eq. 7)
      Step 4  MetaRM prediction R̂ for the D_O samples with the UPDATED
              MetaRM                                                    (Eq. 6)
              and R' = -1 | 0 | 1 + max(0, R̂ - 1), R̂ clipped to
              [0, 1 + λ]                                                (Eq. 8; reward.do_reward)

    items: list (N) of pairwise dicts tagged "set" ('dh'|'do'), one per completion (group-repeated);
    completions: list[str] (N); judge: judge(pairs) -> list[dict]; mrm: the MetaRM dict or None
    (mode none); the numbers are reward.parse_grm_output's (max_lines, max_chars, style),
    reward.score_dh's (lam, threshold, inclusive, similarity, gate_on_outcome, on_failure),
    reward.do_reward's (form, mode), train_on_do (metarm.train_on_do; train.py binds them all from
    the config); seed: this step's MetaRM shuffle seed (train.py: run.seed * 7919 + step); t0:
    time.perf_counter() at the step's start (the "order/*" metrics are seconds since it).
    Returns dict, the shape of train.rlme_reward_step's: "reward" FloatTensor [N] (0.0 where the
    judge failed), "valid" BoolTensor [N] (False = judge failure: out of group statistics and the
    loss), "records" list (N) of samples.jsonl fields (pair, verdict, critique, judge F1 or why not,
    R̂, reward), "metrics" dict (MetaRM loss/agreement, order of operations)."""
    parsed = [reward.parse_grm_output(c, max_lines, max_chars, style=style) for c in completions]
    dh_idx = [i for i, it in enumerate(items) if it["set"] == "dh"]
    do_idx = [i for i, it in enumerate(items) if it["set"] == "do"]
    dh_items, do_items = [items[i] for i in dh_idx], [items[i] for i in do_idx]
    do_parsed = [parsed[i] for i in do_idx]
    samples, metrics = [None] * len(items), {}
    # Step 2: D_H rewards from the judge
    dh = reward.score_dh([parsed[i] for i in dh_idx], dh_items, judge, lam=lam, threshold=threshold,
                         gate_on_outcome=gate_on_outcome, inclusive=inclusive,
                         similarity=similarity, on_failure=on_failure)
    for i, s in zip(dh_idx, dh):
        s["f1_why"] = (s["judge_why"] if s["judged"]
                       else "invalid format" if not s["valid"]
                       else "wrong verdict: judge not called")
        samples[i] = dict(s, r_hat=None)
    metrics["order/judge_done_s"] = time.perf_counter() - t0
    # Step 3: MetaRM update on the D_H samples, BEFORE it scores D_O
    updates_before, cut_before = (mrm["updates"], mrm["truncated"]) if mrm is not None else (0, 0)
    if mrm is not None:
        train_items, train_samples = dh_items, dh
        if train_on_do:  # the "w/ D_O for MetaRM" ablation (RM-NLHF §4.3, Table 3)
            train_items = dh_items + do_items
            train_samples = dh + reward.do_training_samples(do_parsed, do_items, lam=lam)
        metrics.update(online_update(mrm, train_items, train_samples, seed=seed,
                                     gated=gate_on_outcome))
    metrics["order/metarm_update_done_s"] = time.perf_counter() - t0
    # Step 4: MetaRM prediction for D_O with the updated model (None for invalid verdicts:
    # reward -1 anyway)
    metrics["order/metarm_predict_start_s"] = time.perf_counter() - t0
    critiques = [p["critique"] if p["valid"] else None for p in do_parsed]
    r_hat = [None] * len(do_idx)
    if mrm is not None:
        r_hat, cut = predict(mrm["model"], mrm["tokenizer"], do_items, critiques, **settings(mrm),
                             outputs=mrm["seams"]["outputs"])
        mrm["truncated"] += cut
        # inputs cut to fit metarm.max_length this step (rank 0's update + this rank's D_O)
        metrics["metarm/truncated"] = mrm["truncated"] - cut_before
    metrics["metarm/trained_this_step"] = mrm is not None and mrm["updates"] > updates_before
    # Step 4, continued: D_O rewards
    do = reward.score_do(do_parsed, do_items, r_hat, lam=lam, mode=mode,
                         gate_on_outcome=gate_on_outcome, form=form)
    for i, s in zip(do_idx, do):
        samples[i] = dict(s, **reward.NOT_JUDGED, r_process=None,
                          f1_why="D_O: no human critique (MetaRM R̂ instead)",
                          metarm_updates=mrm["updates"] if mrm is not None else None)
    metrics["order/do_reward_done_s"] = time.perf_counter() - t0
    keep = ("choice", "valid", "why", "correct", "critique", "human_critique", "judged",
            "judge_failed", "f1", "precision", "recall", "judge_why", "judge_attempts", "f1_why",
            "r_process", "r_hat", "reward", "metarm_updates")
    records = [{"item": it["id"], "set": it["set"], "source": it["source"], "winner": it["winner"],
                **{k: s.get(k) for k in keep}} for it, s in zip(items, samples)]
    return {"reward": torch.tensor([s["reward"] if s["reward"] is not None else 0.0
                                    for s in samples]),
            "valid": torch.tensor([s["reward"] is not None for s in samples]),
            "records": records, "metrics": metrics}


def settings(mrm):
    """The MetaRM dict's numbers as keyword arguments of predict, update and fit."""
    return {k: mrm[k] for k in ("mode", "lam", "batch_size", "max_length", "dtype")}


def online_update(mrm, items, samples, *, seed, gated=True):
    """Step 3: update the MetaRM on this step's D_H samples of ALL ranks (`update`) with its
    persistent AdamW (made by the first update that trains); counts the update and the inputs cut
    (mrm["updates"], ["truncated"]). Under torchrun mrm["seams"] (plumbing/scale.py metarm_seams)
    gathers every rank's (item, sample) pairs first; a replica (ddp) trains on all, then takes rank
    0's parameters (bit-equal weights even where a GPU kernel is not deterministic); FSDP2 shards
    train each rank's share of every batch (fit); rank 0's metrics go to every rank. Returns
    update's metrics plus metarm/updates."""
    seams = mrm["seams"]
    if seams["gather"]:  # every rank's pairs, in rank order
        items, samples = seams["gather"](items, samples)
    ex = examples_from_samples(mrm["tokenizer"], items, samples, max_length=mrm["max_length"])
    mrm["truncated"] += sum(e["truncated"] for e in ex)
    if ex and mrm["optimizer"] is None and mrm["mode"] != "offline":
        mrm["optimizer"] = torch.optim.AdamW(mrm["model"].parameters(), lr=mrm["online_lr"],
                                             weight_decay=mrm["weight_decay"])
    out = update(mrm["model"], mrm["tokenizer"], mrm["optimizer"], ex, **settings(mrm),
                 epochs=mrm["online_epochs"], seed=seed, gated=gated, outputs=seams["all_outputs"],
                 share=seams["share"], mean=seams["mean"])
    if out["metarm/loss"] is not None:  # it trained
        mrm["updates"] += 1
    # rank 0's metrics; its weights, unless FSDP2 shards them (broadcast: nothing then)
    if seams["sync"]:
        out, mrm["updates"] = seams["sync"](out, mrm["updates"])
        seams["broadcast"](mrm["model"])
    return dict(out, **{"metarm/updates": mrm["updates"]})


# ----------------------------------------------------------------------------------------------
# The MetaRM's input, target and loss (RM-NLHF Eq. 6-7)


def metarm_text(context, response_a, response_b, critique):
    """The MetaRM input M_φ(q, y_A, y_B, ĉ) (RM-NLHF Eq. 6): conversation, both responses and the
    GRM critique, as text. No chat template: this model is a regressor, not a chat model."""
    pair = reward.PAIR_TEXT.format(context=context.strip(), response_a=response_a.strip(),
                                   response_b=response_b.strip())
    return f"{pair}\n\n[Critique]\n{(critique or '').strip()}"


def metarm_input(tokenizer, context, response_a, response_b, critique, *, max_length):
    """metarm_text within the MetaRM's token budget `max_length` (metarm.max_length), keeping every
    part Eq. 6 conditions on: when the whole is too long, the MIDDLE of the conversation is cut
    first, then the middles of both responses (equal shares), and the critique's middle only as a
    last resort; a cut part keeps its head and tail around " [...] ". (Truncating the joined text
    from one side would drop the conversation and Response A of every long item.)
    Returns (text, truncated bool)."""
    tok = tokenizer
    parts = [context.strip(), response_a.strip(), response_b.strip(), (critique or "").strip()]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in parts]
    # the budget for the four parts: max_length less the labels, BOS/EOS, and a margin for the
    # few tokens that merge differently where parts are joined
    frame = len(tok(metarm_text("", "", "", ""))["input_ids"])
    over = sum(map(len, ids)) - (max_length - frame - 8)
    if over <= 0:
        return metarm_text(*parts), False
    # the cut markers, seams
    over += 4 * (len(tok(" [...] ", add_special_tokens=False)["input_ids"]) + 2)
    keep = [len(x) for x in ids]
    min_keep = 32  # tokens of head + tail a cut part keeps, while others can still give
    for group in ([0], [1, 2], [3]):  # conversation, then both responses, then the critique
        for j, k in enumerate(group):
            share = -(-over // (len(group) - j))  # ceil: what this part must give
            give = min(share, max(0, keep[k] - min_keep) if group != [3] else keep[k])
            keep[k] -= give
            over -= give
        if over <= 0:
            break
    for k in range(4):
        if keep[k] < len(ids[k]):
            head, tail = keep[k] // 2, keep[k] - keep[k] // 2
            parts[k] = (tok.decode(ids[k][:head]) + " [...] "
                        + (tok.decode(ids[k][-tail:]) if tail else "")).strip()
    return metarm_text(*parts), True


def class_values(lam, gated=True):
    """(0, 1, 1 + λ): the 'classifier' mode's classes and the values of a D_H reward R >= 0
    (RM-NLHF Eq. 5); gated=False (nlhf.gate_on_outcome false) adds λ, a wrong verdict whose
    critique matched."""
    return (0.0, 1.0, 1.0 + lam) if gated else (0.0, lam, 1.0, 1.0 + lam)


def train_target(r, mode, lam):
    """Regression/classification target for a D_H reward R (a float in {0, 1, 1 + λ}).
    binary_retrain: 1[R > 1]; classifier: the index of R's class value; else R itself.
    ValueError: a mode that is not one of reward.METARM_MODES' trained ones; for these two, an R
    that is no class value (λ without the outcome gate, D_O's 1 + λ/2: the nearest is a guess)."""
    if mode not in reward.METARM_MODES or mode == "none":
        raise ValueError(f"train_target: MetaRM mode {mode!r}")
    if mode not in ("binary_retrain", "classifier"):
        return float(r)
    values = class_values(lam)
    c = min(range(3), key=lambda c: abs(values[c] - r))
    if abs(values[c] - r) > 1e-6:
        raise ValueError(f"train_target: R = {r} is none of {values} (mode {mode})")
    return c if mode == "classifier" else (1.0 if r > 1.0 else 0.0)


def examples_from_samples(tokenizer, items, samples, *, max_length):
    """MetaRM training examples {"text", "r", "dh" (False: a do_training_samples outcome label),
    "truncated" (metarm_input cut it to max_length)} from scored samples (reward.score_dh output,
    with their pairwise items): every valid verdict whose reward is known. Invalid formats (R = -1;
    D_O never asks the MetaRM about them) and judge failures (reward None) are left out."""
    out = []
    for it, s in zip(items, samples):
        if s["valid"] and s["reward"] is not None:
            text, cut = metarm_input(tokenizer, it["context"], it["response_a"], it["response_b"],
                                     s["critique"], max_length=max_length)
            out.append({"text": text, "r": float(s["reward"]),
                        "dh": not s.get("outcome_label", False), "truncated": cut})
    return out


def metarm_loss(model, tokenizer, texts, rewards, *, mode, lam, max_length, dtype="float32"):
    """Loss (scalar, with grad) on one batch of texts (list[str], B) and their D_H rewards R
    (list[float], B): MSE(ŷ, R) (RM-NLHF Eq. 7; mode 'binary_retrain': MSE to 1[R > 1]);
    'classifier': cross-entropy over the classes (0, 1, 1 + λ). max_length, dtype: forward's."""
    out = forward(model, tokenizer, texts, mode=mode, max_length=max_length, dtype=dtype)
    targets = [train_target(r, mode, lam) for r in rewards]
    if mode == "classifier":
        return F.cross_entropy(out, torch.tensor(targets, device=out.device))
    return F.mse_loss(out, torch.tensor(targets, dtype=torch.float32, device=out.device))


def forward(model, tokenizer, texts, *, mode, max_length, dtype="float32"):
    """The MetaRM's raw outputs, float32 [B] (regression) or [B, 3] (mode 'classifier'), for B
    texts: tokenized (right-padded, cut to max_length tokens from the left: load_metarm sets the
    tokenizer so), the forward in autocast `dtype` (metarm.dtype) over float32 weights; the model: a
    sequence classifier (its last token's logits). ValueError: a tokenizer that pads on the left
    or cuts from the right (its last token would not be the text's end)."""
    if tokenizer.padding_side != "right" or tokenizer.truncation_side != "left":
        raise ValueError("metarm.forward: the tokenizer must pad right and cut left (load_metarm)")
    device = next(model.parameters()).device
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt").to(device)
    # float32 weights, compute in metarm.dtype; backward runs outside (autocast guidance)
    with rollout.autocast(dtype, device.type):
        logits = model(input_ids=enc["input_ids"],
                       attention_mask=enc["attention_mask"]).logits.float()
    return logits if mode == "classifier" else logits[:, 0]


# ----------------------------------------------------------------------------------------------
# Predict and update (Algorithm 1, steps 3-4)


@torch.no_grad()
def raw_outputs(model, tokenizer, texts, *, mode, batch_size, max_length, dtype="float32"):
    """The MetaRM's raw outputs for texts, in batches of batch_size, in eval mode: floats
    (regression) or [3] logit lists (classifier). (Sharded, plumbing/scale.py forwards_alike runs
    every rank's forwards alike.)"""
    out = []
    with rollout.eval_mode(model):
        for i in range(0, len(texts), batch_size):
            out += forward(model, tokenizer, texts[i:i + batch_size], mode=mode,
                           max_length=max_length, dtype=dtype).tolist()
    return out


def predict_texts(model, tokenizer, texts, *, mode, lam, batch_size, max_length, dtype="float32",
                  outputs=raw_outputs):
    """R̂ on the reward scale for a list of MetaRM input texts (see the mode table at the top).
    outputs: raw_outputs (mrm["seams"]["outputs"] under FSDP2)."""
    out = outputs(model, tokenizer, texts, mode=mode, batch_size=batch_size, max_length=max_length,
                  dtype=dtype)
    if mode == "classifier":  # the expected value Σ p_c · value_c
        return [sum(p * v for p, v in zip(torch.tensor(o).softmax(-1).tolist(), class_values(lam)))
                for o in out]
    if mode == "binary":  # the regression output, discretised to a process bit
        return [1.0 + lam * float(y > 1.0 + lam / 2) for y in out]
    if mode == "binary_retrain":  # a 0/1 regressor, thresholded at 0.5
        return [1.0 + lam * float(y >= 0.5) for y in out]
    return out


def predict(model, tokenizer, items, critiques, *, mode, lam, batch_size, max_length,
            dtype="float32", outputs=raw_outputs):
    """R̂ for D_O samples (Algorithm 1, step 4; RM-NLHF Eq. 6). items: pairwise dicts; critiques:
    the GRM critiques (None for an invalid sample gives None: its reward is -1 whatever R̂ says);
    the rest: predict_texts'. Returns (list[float | None] R̂, number of inputs metarm_input cut to
    max_length); R̂ unclipped (reward.do_reward clips it to [0, 1 + λ], Eq. 8)."""
    idx = [i for i, c in enumerate(critiques) if c is not None]
    inputs = [metarm_input(tokenizer, items[i]["context"], items[i]["response_a"],
                           items[i]["response_b"], critiques[i], max_length=max_length)
              for i in idx]
    preds = predict_texts(model, tokenizer, [text for text, _ in inputs], mode=mode, lam=lam,
                          batch_size=batch_size, max_length=max_length, dtype=dtype,
                          outputs=outputs)  # with no text too: sharded, a collective
    out = dict(zip(idx, preds))
    return [out.get(i) for i in range(len(critiques))], sum(cut for _, cut in inputs)


def agreement(outputs, rewards, lam, mode="online", gated=True):
    """metarm/agreement (docs/method.md §9), on D_H samples: mean_i 1[decode(o_i) =
    train_target(R_i)], R_i the judge-based reward, o_i the raw output (raw_outputs) of the mode's
    trained model; decode = the nearest of class_values(λ, gated) for a regressor (binary too: its
    output before the process bit, which is never 0), 1[o >= 0.5] for binary_retrain, the argmax
    class for the classifier. A perfect predictor (o = its target, all mass on the target class)
    scores 1 in every mode: each target is one of the decoded values. None for no sample."""
    if not rewards:
        return None
    targets = [train_target(r, mode, lam) for r in rewards]
    if mode == "classifier":
        guess = [max(range(3), key=lambda c: o[c]) for o in outputs]
    elif mode == "binary_retrain":
        guess = [float(o >= 0.5) for o in outputs]
    else:
        guess = [min(class_values(lam, gated), key=lambda v: abs(v - o)) for o in outputs]
    return sum(abs(g - t) < 1e-9 for g, t in zip(guess, targets)) / len(targets)


def update(model, tokenizer, optimizer, examples, *, mode, lam, batch_size, max_length,
           dtype="float32", epochs=1, seed=0, gated=True, outputs=raw_outputs, share=None,
           mean=None):
    """One online MetaRM update (Algorithm 1, step 3) on examples_from_samples of this step's D_H
    samples: fit with `optimizer` (None for mode 'offline', which trains nothing), `epochs` passes
    (metarm.online_epochs; the paper's "Aggressive" ablation takes 2 at lr 1e-5, App. H.1).
    Agreement with the judge is measured BEFORE training on them (an honest held-out number),
    outputs: raw_outputs (FSDP2: metarm_seams' all_outputs); share, mean: fit's. Returns metrics
    metarm/n, metarm/loss (mean over all passes; None when nothing is trained), metarm/agreement."""
    metrics = {"metarm/n": len(examples), "metarm/loss": None, "metarm/agreement": None}
    if not examples:
        return metrics
    # D_O outcome labels (train_on_do) are not the judge's
    judged = [e for e in examples if e["dh"]]
    out = outputs(model, tokenizer, [e["text"] for e in judged], mode=mode, batch_size=batch_size,
                  max_length=max_length, dtype=dtype)
    metrics["metarm/agreement"] = agreement(out, [e["r"] for e in judged], lam, mode=mode,
                                            gated=gated)
    if mode == "offline":
        return metrics
    steps = fit(model, tokenizer, examples, optimizer, mode=mode, lam=lam, batch_size=batch_size,
                max_length=max_length, dtype=dtype, epochs=epochs, seed=seed, share=share,
                mean=mean)
    metrics["metarm/loss"] = sum(loss * n for loss, n in steps) / (len(examples) * epochs)
    return metrics


def fit(model, tokenizer, examples, optimizer, *, mode, lam, batch_size, max_length,
        dtype="float32", epochs, seed, lr_at=None, log=None, share=None, mean=None):
    """The MetaRM's one training loop (RM-NLHF Eq. 7), for the online update and the cold start:
    `epochs` passes over `examples` ({"text", "r"}: examples_from_samples), pass e in batches of
    batch_size shuffled by seed + e; per batch metarm_loss, backward, the gradient norm clipped to
    1.0, an `optimizer` step, and with `lr_at` (the lr multiplier at optimizer step t, 0-based) a
    LambdaLR step. log: None or a callable taking a progress line. share, mean: None in one process;
    under FSDP2 a rank trains its share of each batch, share(texts, rewards) -> (texts, rewards,
    weight), and logs mean(loss) -> the batch's mean loss (plumbing/scale.py batch_share,
    mean_over_ranks). Returns [(batch mean loss, batch size)] a step."""
    model.train()
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at) if lr_at is not None else None
    total = epochs * math.ceil(len(examples) / batch_size)
    steps = []
    for epoch in range(epochs):
        for b in _batches(len(examples), batch_size, seed + epoch):
            texts, rewards = [examples[i]["text"] for i in b], [examples[i]["r"] for i in b]
            # FSDP2: this rank's part of the batch, weighted so the ranks' gradient mean is the
            # batch's (weight 1.0 in one process)
            texts, rewards, weight = share(texts, rewards) if share else (texts, rewards, 1.0)
            loss = weight * metarm_loss(model, tokenizer, texts, rewards, mode=mode, lam=lam,
                                        max_length=max_length, dtype=dtype)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if sched is not None:
                sched.step()
            steps.append((mean(loss) if mean else loss.item(), len(b)))
            if log:
                log(f"metarm: epoch {epoch + 1}/{epochs} step {len(steps)}/{total} "
                    f"loss {steps[-1][0]:.4f}")
    return steps


def _batches(n, batch_size, seed):
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


# ----------------------------------------------------------------------------------------------
# Cold start (Algorithm 1, lines 2-10): N rollouts per D_H prompt from the base GRM, judge, train


COLD_START_COUNTS = ("rollouts", "invalid", "judge_failures", "examples", "truncated")


def cold_start_sample(items, *, sample, prompt, rollouts_per_prompt, max_new_tokens,
                      temperature=1.0, seed=0):
    """Algorithm 1, line 4, on one batch of D_H items: N rollouts per prompt from the base GRM.
    items: list (B) of D_H pairwise dicts, B >= 0; sample: the rollout backend, sample(prompt_ids,
    *, group_size, max_new_tokens, temperature, top_p, top_k, seed) -> rollout dict (rollout.py's),
    called with no prompt too (B = 0: HF decode of an FSDP2 policy gathers its weights, a collective
    every rank joins); prompt: item -> GRM prompt ids (reward.grm_prompt_ids bound to the GRM's
    tokenizer); seed: the batch's. Returns the completions, list[str] (B x N, a prompt's
    adjacent)."""
    return sample([prompt(it) for it in items], group_size=rollouts_per_prompt,
                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)["completions"]


def cold_start_examples(mrm, items, completions, *, judge, parse, score, rollouts_per_prompt):
    """Algorithm 1, lines 5-7, on one batch: the rollouts' rewards R from the judge (Eq. 4-5; judge:
    judge(pairs) -> list[dict], plumbing/judge.py make_judge), the MetaRM examples (Eq. 6's input, R
    the Eq. 7 target: examples_from_samples). items, completions: cold_start_sample's; parse:
    completion -> reward.parse_grm_output dict; score: (parsed, items, judge) -> reward.score_dh
    samples (both with the run's numbers bound: plumbing/cold_start.py cold_start_settings).
    Returns (examples list of {"text", "r", "dh", "truncated"}, counts {name: int for
    COLD_START_COUNTS}): "truncated" = inputs cut to metarm.max_length; judge failures and invalid
    formats give no example."""
    rows = [it for it in items for _ in range(rollouts_per_prompt)]
    samples = score([parse(c) for c in completions], rows, judge)
    ex = examples_from_samples(mrm["tokenizer"], rows, samples, max_length=mrm["max_length"])
    cut = sum(e["truncated"] for e in ex)
    mrm["truncated"] += cut
    return ex, {"rollouts": len(samples), "invalid": sum(not s["valid"] for s in samples),
                "judge_failures": sum(s["judge_failed"] for s in samples), "examples": len(ex),
                "truncated": cut}


def fit_cold_start(mrm, examples, counts, *, epochs, lr, warmup_frac, weight_decay, seed):
    """Algorithm 1, line 9: train_metarm on the cold-start examples (Eq. 7). counts: the batches'
    cold_start_examples counts. Returns dict: their sums, target_mean (None for no example),
    loss_first, loss_last (None: nothing trained, the MetaRM keeps its initial head; the numbers say
    so)."""
    stats = {k: sum(n[k] for n in counts) for k in COLD_START_COUNTS}
    stats.update(examples=len(examples),
                 target_mean=sum(e["r"] for e in examples) / len(examples) if examples else None)
    losses = train_metarm(mrm, examples, epochs=epochs, lr=lr, warmup_frac=warmup_frac,
                          weight_decay=weight_decay, seed=seed)
    return dict(stats, loss_first=(losses or [None])[0], loss_last=(losses or [None])[-1])


def train_metarm(mrm, examples, epochs=3, lr=1e-5, warmup_frac=0.01, weight_decay=0.01, seed=0,
                 log=None):
    """Cold-start training (Algorithm 1, line 9; docs/method.md §5.4): fit with a fresh AdamW,
    `epochs` passes, linear warmup over `warmup_frac` of the steps (at least 1 step), then cosine
    decay to 0. examples: examples_from_samples's {"text", "r"}. Returns the loss of every step."""
    if not examples:
        return []
    total = math.ceil(len(examples) / mrm["batch_size"]) * epochs
    warmup = max(1, round(warmup_frac * total))

    def lr_at(step):  # multiplier of lr at optimizer step `step` (0-based)
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    opt = torch.optim.AdamW(mrm["model"].parameters(), lr=lr, weight_decay=weight_decay)
    steps = fit(mrm["model"], mrm["tokenizer"], examples, opt, **settings(mrm), epochs=epochs,
                seed=seed, lr_at=lr_at, log=log, share=mrm["seams"]["share"],
                mean=mrm["seams"]["mean"])
    return [loss for loss, _ in steps]


# the command line imports this file, so it lives in plumbing/cli.py (metarm_main)
if __name__ == "__main__":
    raise SystemExit("metarm.py's command line: python -m plumbing.cli metarm --help "
                     "(from the repository root)")
