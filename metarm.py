"""MetaRM (RM-NLHF §3.2, App. D) and Algorithm 1's reward step around it. A GRM verdict on a D_H
item earns R = 1 + λ·R_process (Eq. 4-5: a judge compares its critique with the human one). D_O
items have no critique: the MetaRM reads (conversation, A, B, GRM critique), regresses R with MSE
(Eq. 6-7), and its R̂, clipped to [0, 1 + λ], gives a right verdict R' = 1 + max(0, R̂ - 1) (Eq. 8).

Modes (metarm.mode; Table 3, App. H.1, Table 10): none (no MetaRM: D_O outcome only) | offline
(cold start, then frozen) | online (the paper's: one update a step) | metarm_only (D_O reward
clip(R̂, 0, 1 + λ)) | binary (the online regressor discretised: R̂ = 1 + λ·1[ŷ > 1 + λ/2]) |
binary_retrain (ours: regress 1[R > 1], R̂ = 1 + λ·1[ŷ >= 0.5]) | classifier (ours; the paper says
"classification head": cross-entropy over (0, 1, 1 + λ), R̂ = Σ p_c·value_c).
The state `mrm`: model, tokenizer, optimizer (online AdamW), SAVED, dtype, micro_batch_size,
updates, truncated. Every rank does the same update on all ranks' D_H samples (torchrun, FSDP2 too).
"""
import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.checkpoint.state_dict as dcp
from torch.distributed.fsdp import FSDPModule as FSDP

from reward import (NOT_JUDGED, PAIR_TEXT, do_training_samples, parse_grm_output, score_dh,
                    score_do)
from rollout import autocast, eval_mode, resolve_model_path

# ---- THE RM-NLHF REWARD STEP (Algorithm 1, steps 2-4) ---------------------------------------
def nlhf_reward_step(items, completions, *, judge, mrm, lam, threshold, inclusive, similarity,
                     gate_on_outcome, on_failure, max_lines, max_chars, style, form, mode,
                     train_on_do, seed, t0):
    """Rewards of N GRM completions (items: N pairwise dicts, "set" 'dh' | 'do'): D_H judged, R
    (Eq. 4-5); online_update (Eq. 7); R̂ for D_O from the UPDATED MetaRM (Eq. 6), R' (Eq. 8).
    mrm: None for mode none. -> {"reward": FloatTensor [N] (0 and "valid" BoolTensor [N] False:
    judge failed), "records": N samples.jsonl dicts, "metrics"}."""
    parsed = [parse_grm_output(c, max_lines, max_chars, style=style) for c in completions]
    dh_idx = [i for i, it in enumerate(items) if it["set"] == "dh"]
    do_idx = [i for i, it in enumerate(items) if it["set"] == "do"]
    dh_items, do_items = [items[i] for i in dh_idx], [items[i] for i in do_idx]
    do_parsed, samples, metrics = [parsed[i] for i in do_idx], [None] * len(items), {}
    # Step 2: D_H rewards from the judge
    dh = score_dh([parsed[i] for i in dh_idx], dh_items, judge, lam=lam, threshold=threshold,
                         gate_on_outcome=gate_on_outcome, inclusive=inclusive,
                         similarity=similarity, on_failure=on_failure)
    for i, s in zip(dh_idx, dh):
        s["f1_why"] = (s["judge_why"] if s["judged"] else "invalid format" if not s["valid"]
                       else "wrong verdict: judge not called")
        samples[i] = dict(s, r_hat=None)
    metrics["order/judge_done_s"] = time.perf_counter() - t0
    # Step 3: the MetaRM learns from this step's D_H samples BEFORE it scores D_O
    updates_before, cut_before = (mrm["updates"], mrm["truncated"]) if mrm else (0, 0)
    if mrm is not None:
        if train_on_do:  # the "w/ D_O for MetaRM" ablation (RM-NLHF §4.3, Table 3): D_O too
            dh_items = dh_items + do_items
            dh = dh + do_training_samples(do_parsed, do_items, lam=lam)
        metrics.update(online_update(mrm, dh_items, dh, seed=seed, gated=gate_on_outcome))
    metrics["order/metarm_update_done_s"] = time.perf_counter() - t0
    # Step 4: R̂ from the updated MetaRM (None for an invalid verdict: its reward is -1 anyway)
    metrics["order/metarm_predict_start_s"] = time.perf_counter() - t0
    r_hat = [None] * len(do_idx)
    if mrm is not None:
        r_hat, cut = predict(mrm, do_items, [p["critique"] if p["valid"] else None
                                             for p in do_parsed])
        mrm["truncated"] += cut
        metrics["metarm/truncated"] = mrm["truncated"] - cut_before  # inputs cut this step
    metrics["metarm/trained_this_step"] = mrm is not None and mrm["updates"] > updates_before
    do = score_do(do_parsed, do_items, r_hat, lam=lam, mode=mode,
                         gate_on_outcome=gate_on_outcome, form=form)
    for i, s in zip(do_idx, do):
        samples[i] = dict(s, **NOT_JUDGED, r_process=None,
                          f1_why="D_O: no human critique (MetaRM R̂ instead)",
                          metarm_updates=mrm["updates"] if mrm is not None else None)
    metrics["order/do_reward_done_s"] = time.perf_counter() - t0
    keep = ("choice valid why correct critique human_critique judged judge_failed f1 precision "
            "recall judge_why judge_attempts f1_why r_process r_hat reward metarm_updates").split()
    records = [{"item": it["id"], "set": it["set"], "source": it["source"], "winner": it["winner"],
                **{k: s.get(k) for k in keep}} for it, s in zip(items, samples)]
    return {"reward": torch.tensor([0.0 if s["reward"] is None else s["reward"] for s in samples]),
            "valid": torch.tensor([s["reward"] is not None for s in samples]),
            "records": records, "metrics": metrics}

def online_update(mrm, items, samples, *, seed, gated=True):
    """Step 3 on EVERY rank's scored samples: the agreement with the judge first (held out), then
    online_epochs passes ("Aggressive": 2), a step per online_batch_size (0: all); offline: none."""
    pairs = [x for p in all_ranks(list(zip(items, samples))) for x in p]  # every rank's, in order
    ex = examples_from_samples(mrm, [it for it, _ in pairs], [s for _, s in pairs])
    mrm["truncated"] += sum(e["truncated"] for e in ex)
    judged = [e for e in ex if e["dh"]]  # D_O outcome labels (train_on_do) are not the judge's
    agree = agreement(raw_outputs(mrm, [e["text"] for e in judged]), [e["r"] for e in judged],
                      mrm["lam"], mode=mrm["mode"], gated=gated)
    metrics = {"metarm/n": len(ex), "metarm/loss": None, "metarm/agreement": agree}
    if ex and mrm["mode"] != "offline":
        if mrm["optimizer"] is None:
            mrm["optimizer"] = torch.optim.AdamW(mrm["model"].parameters(), lr=mrm["online_lr"],
                                                 weight_decay=mrm["weight_decay"])
        steps = fit(mrm, ex, mrm["optimizer"], epochs=mrm["online_epochs"], seed=seed,
                    batch_size=mrm["online_batch_size"])
        metrics["metarm/loss"] = sum(x * n for x, n in steps) / (len(ex) * mrm["online_epochs"])
        mrm["updates"] += 1
        broadcast_weights(mrm["model"])
    return dict(metrics, **{"metarm/updates": mrm["updates"]})

def all_ranks(obj):
    """Every rank's `obj` in rank order (all_gather_object); [obj] in one process."""
    parts = [obj] * (dist.get_world_size() if dist.is_initialized() else 1)
    if len(parts) > 1:
        dist.all_gather_object(parts, obj)
    return parts

def broadcast_weights(model):
    """Rank 0's parameters and buffers on every rank of a replica MetaRM; FSDP2 shards: nothing."""
    if dist.is_initialized() and dist.get_world_size() > 1 and not isinstance(model, FSDP):
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, 0)

# ---- THE MODEL'S INPUT, TARGET AND LOSS (RM-NLHF Eq. 6-7) -----------------------------------
def metarm_text(context, response_a, response_b, critique):
    """M_φ(q, y_A, y_B, ĉ)'s input (Eq. 6): PAIR_TEXT and the critique (no chat template)."""
    pair = PAIR_TEXT.format(context=context.strip(), response_a=response_a.strip(),
                                   response_b=response_b.strip())
    return f"{pair}\n\n[Critique]\n{(critique or '').strip()}"

def metarm_input(tok, item, critique, *, max_length):
    """(metarm_text within max_length tokens, cut?): each part Eq. 6 reads kept, cut in its MIDDLE,
    the conversation first, then both responses (equal shares), the critique last."""
    parts = [item[k].strip() for k in ("context", "response_a", "response_b")]
    parts.append((critique or "").strip())
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in parts]
    # the budget: max_length less the labels, BOS/EOS and 8 tokens of margin for merges at joins
    frame = len(tok(metarm_text("", "", "", ""))["input_ids"])
    over = sum(map(len, ids)) - (max_length - frame - 8)
    if over <= 0:
        return metarm_text(*parts), False
    over += 4 * (len(tok(" [...] ", add_special_tokens=False)["input_ids"]) + 2)  # the markers
    keep, min_keep = [len(x) for x in ids], 32  # a cut part keeps 32 tokens while others can give
    for group in ([0], [1, 2], [3]):  # conversation, then both responses, then the critique
        for j, k in enumerate(group):
            share = -(-over // (len(group) - j))  # ceil: what this part must give
            give = min(share, max(0, keep[k] - min_keep) if group != [3] else keep[k])
            keep[k], over = keep[k] - give, over - give
        if over <= 0:
            break
    for k in range(4):
        if keep[k] < len(ids[k]):
            head, tail = keep[k] // 2, keep[k] - keep[k] // 2
            parts[k] = (tok.decode(ids[k][:head]) + " [...] "
                        + (tok.decode(ids[k][-tail:]) if tail else "")).strip()
    return metarm_text(*parts), True

def class_values(lam, gated=True):
    """Values of a D_H reward R >= 0 (Eq. 5): (0, 1, 1 + λ); ungated, λ too (a wrong verdict)."""
    return (0.0, 1.0, 1.0 + lam) if gated else (0.0, lam, 1.0, 1.0 + lam)

def train_target(r, mode, lam):
    """The target of reward R: R; binary_retrain 1[R > 1]; classifier the index of R's class.
    ValueError for those two when R is no class value (λ ungated, the D_O label 1 + λ/2)."""
    if mode not in ("binary_retrain", "classifier"):
        return float(r)
    values = class_values(lam)
    c = min(range(3), key=lambda c: abs(values[c] - r))
    if abs(values[c] - r) > 1e-6:
        raise ValueError(f"train_target: R = {r} is none of {values} (mode {mode})")
    return c if mode == "classifier" else (1.0 if r > 1.0 else 0.0)

def examples_from_samples(mrm, items, samples):
    """Examples {"text", "r", "dh" (False: do_training_samples'), "truncated"} of valid verdicts
    with a reward (R = -1 is never asked of the MetaRM; a judge failure has none)."""
    out = []
    for it, s in zip(items, samples):
        if s["valid"] and s["reward"] is not None:
            text, cut = metarm_input(mrm["tokenizer"], it, s["critique"],
                                     max_length=mrm["max_length"])
            out.append({"text": text, "r": float(s["reward"]),
                        "dh": not s.get("outcome_label", False), "truncated": cut})
    return out

def metarm_loss(mrm, texts, rewards):
    """Scalar loss of B texts and rewards R: MSE(ŷ, target) (Eq. 7); classifier: cross-entropy."""
    out = forward(mrm, texts)
    targets = [train_target(r, mrm["mode"], mrm["lam"]) for r in rewards]
    if mrm["mode"] == "classifier":
        return F.cross_entropy(out, torch.tensor(targets, device=out.device))
    return F.mse_loss(out, torch.tensor(targets, dtype=torch.float32, device=out.device))

def forward(mrm, texts):
    """Raw outputs float32 [B] ([B, 3]: classifier): the last token's logits of B texts (right-
    padded, cut from the left: new_metarm's tokenizer), in autocast dtype over float32 weights."""
    model, device = mrm["model"], next(mrm["model"].parameters()).device
    enc = mrm["tokenizer"](texts, padding=True, truncation=True, max_length=mrm["max_length"],
                           return_tensors="pt").to(device)
    with autocast(mrm["dtype"], device.type):  # backward runs outside (autocast guidance)
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    return logits.float() if mrm["mode"] == "classifier" else logits.float()[:, 0]

# ---- PREDICT (Eq. 6) AND FIT (Eq. 7) --------------------------------------------------------
@torch.no_grad()
def raw_outputs(mrm, texts):
    """forward over texts in batches of mrm["micro_batch_size"], eval mode: floats or [3] lists."""
    bs = mrm["micro_batch_size"]
    with eval_mode(mrm["model"]):
        return [o for i in range(0, len(texts), bs) for o in forward(mrm, texts[i:i + bs]).tolist()]

def predict(mrm, items, critiques):
    """R̂ for D_O items and GRM critiques (None: invalid, R̂ None) (Eq. 6) -> (R̂, unclipped: Eq. 8
    clips it; inputs cut). FSDP2: every rank runs all ranks' inputs and keeps its own R̂."""
    pairs = list(zip(items, critiques))
    parts = all_ranks(pairs) if isinstance(mrm["model"], FSDP) else [pairs]
    inputs = [metarm_input(mrm["tokenizer"], it, c, max_length=mrm["max_length"])
              for p in parts for it, c in p if c is not None]
    out, mode, lam = raw_outputs(mrm, [text for text, _ in inputs]), mrm["mode"], mrm["lam"]
    if mode == "classifier":  # the expected value Σ p_c · value_c
        out = [sum(p * v for p, v in zip(torch.tensor(o).softmax(-1).tolist(), class_values(lam)))
               for o in out]
    elif mode == "binary":  # the regression output, discretised to a process bit
        out = [1.0 + lam * float(y > 1.0 + lam / 2) for y in out]
    elif mode == "binary_retrain":  # a 0/1 regressor, thresholded at 0.5
        out = [1.0 + lam * float(y >= 0.5) for y in out]
    preds = iter(out)
    r_hat = [[None if c is None else next(preds) for _, c in p] for p in parts]
    return r_hat[dist.get_rank() if len(parts) > 1 else 0], sum(cut for _, cut in inputs)

def agreement(outputs, rewards, lam, mode="online", gated=True):
    """metarm/agreement: mean 1[decode(raw output) = train_target(R)] over D_H samples; decode:
    nearest class value, 1[o >= 0.5] (binary_retrain), argmax (classifier). None: no sample."""
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

def fit(mrm, examples, optimizer, *, epochs, seed, batch_size, lr_at=None):
    """Eq. 7: `epochs` passes over examples {"text", "r"}, pass e shuffled by seed + e; an AdamW
    step per batch_size examples (0: all), accumulated over micro-batches of mrm["micro_batch_size"]
    (the release's dp_reward.py), grad norm clipped to 1, lr_at(t) the lr factor. -> [(loss, n)]."""
    mrm["model"].train()
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at) if lr_at is not None else None
    steps, bs, mb = [], batch_size or max(1, len(examples)), mrm["micro_batch_size"]
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(order := list(range(len(examples))))
        for b in (order[i:i + bs] for i in range(0, len(order), bs)):
            optimizer.zero_grad(set_to_none=True)
            mean = 0.0
            for m in ([examples[i] for i in b[j:j + mb]] for j in range(0, len(b), mb)):
                loss = metarm_loss(mrm, [e["text"] for e in m], [e["r"] for e in m])
                (loss * (len(m) / len(b))).backward()  # grads add up to the batch mean's
                mean += loss.item() * len(m) / len(b)
            torch.nn.utils.clip_grad_norm_(mrm["model"].parameters(), 1.0)
            optimizer.step()
            if sched is not None:
                sched.step()
            steps.append((mean, len(b)))
    return steps

def train_metarm(mrm, examples, epochs=3, lr=1e-5, warmup_frac=0.01, weight_decay=0.01, seed=0):
    """Cold-start training (Algorithm 1 line 9): fit with a fresh AdamW, linear warmup over
    warmup_frac of the steps (at least 1), then cosine decay to 0. -> the losses."""
    total = math.ceil(len(examples) / (mrm["batch_size"] or max(1, len(examples)))) * epochs
    warmup = max(1, round(warmup_frac * total))
    def lr_at(t):
        return (t + 1) / warmup if t < warmup else 0.5 * (1.0 + math.cos(
            math.pi * (t - warmup) / max(1, total - warmup)))
    opt = torch.optim.AdamW(mrm["model"].parameters(), lr=lr, weight_decay=weight_decay)
    return [loss for loss, _ in fit(mrm, examples, opt, epochs=epochs, seed=seed, lr_at=lr_at,
                                    batch_size=mrm["batch_size"])]

# ---- A RUN'S METARM; THE COLD START (Algorithm 1, lines 2-10) ---------------------------------
# D_H is cut into batches of `batch_size` prompts, one sample() call each; batch b samples with
# seed + 1_000_003 b on rank b % world; its examples go to <folder>/<settings hash>/batch<b>.json,
# written whole then renamed. The ranks meet through these files (with a deadline); a killed cold
# start rerun skips the batches on disk, so its examples and MetaRM equal an uninterrupted run's.
COUNTS = ("rollouts", "invalid", "judge_failures", "examples", "truncated")

def setup_metarm(ckpt, *, mode, out_dir, model_path, lam, seed, dtype="float32", device="cpu",
                 wrap=None, gradient_checkpointing=False, batch_size=8, max_length=8192,
                 online_lr=5e-6, online_epochs=1, online_batch_size=0, micro_batch_size=4, **cold):
    """A run's MetaRM (every rank calls) -> (mrm | None, source, cold-start stats | None): <ckpt>/
    metarm; a saved <out_dir>/metarm; else new_metarm, run_cold_start(**cold), saved there."""
    if mode == "none":
        return None, "none", None
    path = os.path.join(ckpt, "metarm") if ckpt else os.path.join(out_dir, "metarm")
    place = dict(dtype=dtype, device=device, wrap=wrap,
                 gradient_checkpointing=gradient_checkpointing, micro_batch_size=micro_batch_size)
    if ckpt or os.path.isfile(os.path.join(path, "metarm.json")):
        return load_metarm(path, **place), path, None
    mrm = new_metarm(model_path, mode=mode, lam=lam, batch_size=batch_size, seed=seed,
                     max_length=max_length, online_lr=online_lr, online_epochs=online_epochs,
                     online_batch_size=online_batch_size, **place)
    stats = run_cold_start(mrm, folder=os.path.join(out_dir, "cold_start"), lam=lam, seed=seed,
                           **cold)
    save_metarm(mrm, path)
    return mrm, "cold_start", stats

def run_cold_start(mrm, items, *, sample, prompt, judge, folder, identity, rollouts_per_prompt,
                   max_new_tokens, temperature, epochs, lr, seed, lam, threshold, inclusive,
                   similarity, gate_on_outcome, on_failure, style, max_lines=4, max_chars=1500,
                   batch_size=4, rank=0, world=1, timeout_s=1800.0, poll_s=1.0):
    """The cold start (above), then train_metarm on all examples in batch order on every rank.
    sample(prompt_ids, *, group_size, max_new_tokens, temperature, seed) -> rollout dict, called
    once a round by every rank (with no prompt when it has no batch: FSDP2 decode is a collective);
    identity: model names; timeout_s: the longest wait with no batch finished (SystemExit).
    -> stats: COUNTS, target_mean, loss_first, loss_last."""
    t0, n = time.time(), math.ceil(len(items) / batch_size)
    score = dict(lam=lam, threshold=threshold, inclusive=inclusive, similarity=similarity,
                 gate_on_outcome=gate_on_outcome, on_failure=on_failure)
    parse = dict(max_lines=max_lines, max_chars=max_chars, style=style)
    settings = dict(identity, **score, **parse, batch_size=batch_size, seed=seed,
                    n=rollouts_per_prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                    items=[it["id"] for it in items], max_length=mrm["max_length"])
    # the settings name the folder: a rerun with other settings never reuses these batches
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    os.makedirs(folder := os.path.join(folder, key[:16]), exist_ok=True)
    path = lambda b: os.path.join(folder, f"batch{b:06d}.json")  # noqa: E731
    resumed = sum(os.path.exists(path(b)) for b in range(n))
    for b in range(rank, math.ceil(n / world) * world, world):  # round k: k * world + rank
        batch = [] if os.path.exists(path(b)) else items[b * batch_size:(b + 1) * batch_size]
        completions = sample([prompt(it) for it in batch], group_size=rollouts_per_prompt,
                             max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=seed + 1_000_003 * b)["completions"]
        if batch:  # lines 5-7: the rollouts' rewards R from the judge (Eq. 4-5), examples
            rows = [it for it in batch for _ in range(rollouts_per_prompt)]
            s = score_dh([parse_grm_output(c, **parse) for c in completions],
                                rows, judge, **score)
            ex = examples_from_samples(mrm, rows, s)
            counts = {"rollouts": len(s), "invalid": sum(not x["valid"] for x in s),
                      "judge_failures": sum(x["judge_failed"] for x in s),
                      "examples": len(ex), "truncated": sum(e["truncated"] for e in ex)}
            mrm["truncated"] += counts["truncated"]
            with open(f"{path(b)}.{os.getpid()}.tmp", "w") as f:  # whole, then renamed
                json.dump({"counts": counts, "examples": ex}, f)
            os.replace(f.name, path(b))
    last, seen = time.monotonic(), -1
    while missing := [b for b in range(n) if not os.path.exists(path(b))]:  # every rank's
        if n - len(missing) > seen:
            last, seen = time.monotonic(), n - len(missing)
        elif time.monotonic() - last > timeout_s:
            raise SystemExit(f"metarm cold start: rank {rank} waited {timeout_s:g} s; batches "
                             f"{missing[:8]} of {n} (ranks {sorted({b % world for b in missing})}"
                             f") are not in {folder}: rerun, the cold start resumes from disk")
        time.sleep(poll_s)
    done = [json.load(open(path(b))) for b in range(n)]
    examples = [e for d in done for e in d["examples"]]  # line 9: train on them (Eq. 7)
    stats = {k: sum(d["counts"][k] for d in done) for k in COUNTS}
    stats.update(examples=len(examples), target_mean=sum(e["r"] for e in examples) /
                 len(examples) if examples else None)
    losses = train_metarm(mrm, examples, epochs=epochs, lr=lr, seed=seed) or [None]
    broadcast_weights(mrm["model"])
    return dict(stats, loss_first=losses[0], loss_last=losses[-1], batches=n,
                resumed_batches=resumed, seconds=time.time() - t0)

def record_cold_start(out_dir, stats, rollouts_per_prompt):
    """The cold-start set's size, so an empty one is seen: <out_dir>/cold_start.json, one line.
    -> {"metarm/cold_start_<k>": int} for metrics.jsonl's first step (rank 0 calls it)."""
    counts = dict(prompts=stats["rollouts"] // rollouts_per_prompt,
                  **{k: stats[k] for k in ("rollouts", "invalid", "judge_failures", "examples")})
    with open(os.path.join(out_dir, "cold_start.json"), "w") as f:
        json.dump(dict(stats, prompts=counts["prompts"]), f, indent=1)
    print(f"[metarm] cold-start set: {counts} (rollouts_per_prompt {rollouts_per_prompt})"
          + ("" if counts["examples"] else ": WARNING, the MetaRM starts untrained"), flush=True)
    return {f"metarm/cold_start_{k}": v for k, v in counts.items()}

# ---- THE MODEL: a fresh head, a saved folder ------------------------------------------------
SAVED = ("mode", "lam", "batch_size", "max_length", "online_lr", "online_epochs", "weight_decay",
         "online_batch_size")  # a save made before online_batch_size loads with its default

def new_metarm(base, *, mode, lam, dtype="float32", batch_size=8, max_length=1024,
               online_lr=5e-6, online_epochs=1, weight_decay=0.01, gradient_checkpointing=False,
               device="cpu", seed=0, wrap=None, online_batch_size=0, micro_batch_size=4):
    """A MetaRM on the LM `base` (folder, hub id, gguf:...): a float32 sequence classifier (a 5e-6
    step on bf16 rounds to nothing), 1 output (classifier 3), head from `seed`; wrap: FSDP2."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    with torch.random.fork_rng(devices=[]):  # the caller's RNG untouched
        torch.manual_seed(seed)
        path = resolve_model_path(base)  # SystemExit (one line): not a model
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=3 if mode == "classifier" else 1, dtype=torch.float32)
    tok.pad_token = tok.pad_token or tok.eos_token
    model.config.pad_token_id = tok.pad_token_id  # the classifier pools the last non-pad token
    tok.padding_side, tok.truncation_side = "right", "left"  # forward's last token; keep critique
    if gradient_checkpointing:  # decoder layers keep their inputs only, replayed in backward
        model.activation_checkpointing_enable({"use_reentrant": False})
    model = model.to(device)
    if wrap:  # FSDP2; the root reshards after forward too, else a no-grad forward (agreement,
        model = wrap(model)  # D_O) leaves its gathered weights where AdamW steps the shards
        model.set_reshard_after_forward(True, recurse=False)
    return dict(model=model, tokenizer=tok, optimizer=None, mode=mode, lam=lam, dtype=dtype,
                batch_size=batch_size, max_length=max_length, online_lr=online_lr, updates=0,
                online_epochs=online_epochs, weight_decay=weight_decay, truncated=0,
                online_batch_size=online_batch_size, micro_batch_size=micro_batch_size)

def save_metarm(mrm, path):
    """HF model + tokenizer, metarm.json, optimizer.pt to <path>.tmp, renamed to `path` (a crash
    between renames leaves <path>.old, which load_metarm reads). Every rank calls; rank 0 saves."""
    path, model = os.path.abspath(path), mrm["model"]
    full = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = dcp.get_model_state_dict(model, options=full) if isinstance(model, FSDP) else None
    optim = mrm["optimizer"] and dcp.get_optimizer_state_dict(model, mrm["optimizer"], options=full)
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp, old = path + ".tmp", path + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=weights)
        mrm["tokenizer"].save_pretrained(tmp)
        with open(os.path.join(tmp, "metarm.json"), "w") as f:
            json.dump({k: mrm[k] for k in SAVED + ("updates",)}, f, indent=1)
        if optim:
            torch.save(optim, os.path.join(tmp, "optimizer.pt"))
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()  # no rank reads `path` before the rename

def load_metarm(path, dtype="float32", **place):
    """A MetaRM written by save_metarm (or its <path>.old) with its AdamW state; place: new_metarm's
    device, wrap, gradient_checkpointing, micro_batch_size. Every rank calls. SystemExit: none."""
    p = path if os.path.isfile(os.path.join(path, "metarm.json")) else path.rstrip("/") + ".old"
    if not os.path.isfile(os.path.join(p, "metarm.json")):
        raise SystemExit(f"metarm: no saved MetaRM (metarm.json) in {path}")
    meta = json.load(open(os.path.join(p, "metarm.json")))
    mrm = new_metarm(p, **{k: meta[k] for k in SAVED if k in meta}, dtype=dtype, **place)
    mrm["updates"], model = meta["updates"], mrm["model"]
    if os.path.isfile(opt := os.path.join(p, "optimizer.pt")):
        mrm["optimizer"] = torch.optim.AdamW(model.parameters(), lr=mrm["online_lr"],
                                             weight_decay=mrm["weight_decay"])
        full = dcp.StateDictOptions(full_state_dict=isinstance(model, FSDP))
        dcp.set_optimizer_state_dict(model, mrm["optimizer"], torch.load(opt), options=full)
    return mrm

# ---- COMMAND LINE: python metarm.py predict --metarm DIR --rows IN.jsonl --out OUT.jsonl ------
def main(argv=None):
    """R̂ (Eq. 6) of a saved MetaRM for each row of a JSONL file (fields context, response_a,
    response_b, critique), written to --out with "r_hat". SystemExit (file, line, field)."""
    ap = argparse.ArgumentParser(prog="python metarm.py", description=main.__doc__)
    p = ap.add_subparsers(dest="command", required=True).add_parser("predict")
    for flag in ("--metarm", "--rows", "--out"):
        p.add_argument(flag, required=True)
    a, rows = ap.parse_args(argv), []
    if not os.path.isfile(a.rows):
        raise SystemExit(f"{a.rows}: file does not exist")
    for n, line in enumerate(open(a.rows), 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except ValueError as e:
            raise SystemExit(f"{a.rows} line {n}: not JSON ({e})")
        if bad := [k for k in ("context", "response_a", "response_b", "critique")
                   if line.strip() and not isinstance(rows[-1].get(k), str)]:
            raise SystemExit(f"{a.rows} line {n}: field {bad[0]!r} missing or not text")
    mrm = load_metarm(a.metarm)
    r_hat, cut = predict(mrm, rows, [r["critique"] for r in rows])
    with open(a.out, "w") as f:
        f.writelines(json.dumps(dict(r, r_hat=x)) + "\n" for r, x in zip(rows, r_hat))
    print(f"{a.out}: R̂ of {len(rows)} rows ({cut} inputs cut to {mrm['max_length']} tokens)")

if __name__ == "__main__":
    main()
