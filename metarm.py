"""MetaRM: a scalar regression model that predicts the RM-NLHF reward where no human critique exists.

RM-NLHF §3.2, App. D. The GRM earns R = 1 + λ·R_process on D_H items (Eq. 5), where a judge compares
its critique with the human one (Eq. 4). D_O items have a preference label but no human critique, so
the process term is predicted instead: the MetaRM reads (conversation, response A, response B, GRM
critique), regresses the D_H reward R (∈ {0, 1, 1 + λ} with the default nlhf.gate_on_outcome; R = -1
samples are left out) with MSE (Eq. 6-7), and its prediction R̂, clipped to [0, 1 + λ], sets the D_O
reward R' = 1 + max(0, R̂ - 1) for a right verdict (Eq. 8): a bonus of at most λ, as on D_H.

One RM-NLHF step, in Algorithm 1's order (App. D.1; `nlhf_reward_step` does steps 2-4):
    Step 1  the GRM's completions for D_H and D_O prompts        train.py, stage 1
    Step 2  D_H rewards from the judge (Eq. 4-5)                 reward.score_dh
    Step 3  update the MetaRM on those D_H samples (Eq. 7)       online_update -> update -> fit
    Step 4  R̂ for D_O samples from the UPDATED MetaRM (Eq. 6),   predict
            then the D_O rewards (Eq. 8)                          reward.score_do / reward.do_reward
    Step 5  GRPO update of the GRM (Eq. 1-3)                      train.py, stages 3-4
The cold start (Algorithm 1, lines 2-10: cold_start_sample and cold_start_examples per batch of D_H prompts,
then fit_cold_start -> train_metarm -> fit) trains with the same loop; plumbing/cold_start.py runs it.

Ablation switches (`metarm.mode`, the paper's ablations, RM-NLHF §4 and App. H):
    none         no MetaRM: D_O reward is the outcome only (-1 / 0 / 1); cold start is skipped
    offline      cold start, then frozen: update() is a no-op that still reports agreement
    online       cold start + one update per step (default, the paper's method)
    metarm_only  online, but the D_O reward is clip(R̂, 0, 1 + λ) without the outcome term
    binary       online, the regression MetaRM as trained for `online`, its output discretised
                 (App. H.1: "outputs discretized to {0, 1}"): the process bit is 1[R̂ > 1 + λ/2]
                 (nearer 1 + λ than 1), so predict() returns R̂ = 1 + λ·bit
    binary_retrain  online; the MetaRM regresses y = 1[R > 1] (right AND critique matched) with MSE
                 instead, predict() returns R̂ = 1 + λ·1[ŷ >= 0.5] (ours: an earlier reading, kept)
    classifier   online; a 3-way classification head over the reward values (0, 1, 1 + λ) with
                 cross-entropy (3 classes, their expected value Σ p_c · value_c as R̂: ours; the paper
                 says only "classification head")
    binary_retrain, classifier: refused with nlhf.gate_on_outcome false or metarm.train_on_do (no
                 class / bit for the targets λ and 1 + λ/2; binary too without the gate: plumbing/config.py)

The MetaRM state is a plain dict (plumbing/run.py's load_metarm): {"model", "tokenizer",
"optimizer" (online AdamW, created on first update), "mode", "lam", "batch_size", "max_length",
"online_lr", "online_epochs", "weight_decay", "updates", "truncated", "dtype", "shard" ((rank, world),
world > 1: FSDP2 shards it)}. Its parameters and AdamW state are float32 (trained); `dtype`: autocast's.

Run alone: python metarm.py --config configs/cpu_rm_nlhf.yaml cold-start (saves to metarm.path, or
<run.out_dir>/metarm, where train.py picks it up instead of cold-starting itself)."""
import math
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import reward
import rollout


# ==============================================================================================
# THE RM-NLHF REWARD STEP (Algorithm 1, steps 2-4): judge D_H, update the MetaRM, predict D_O
# ==============================================================================================


def nlhf_reward_step(items, completions, *, judge, mrm, nlhf, mode, train_on_do, seed, world, t0):
    """Rewards of one step's GRM completions, Algorithm 1's steps 2-4 in its order (RM-NLHF App. D.1):
      Step 2  D_H: parse, judge (only valid + right verdicts), R = -1 | 0 | 1 + λ·R_process   (Eq. 4-5)
      Step 3  MetaRM update on those D_H samples (all ranks' samples: online_update)         (Eq. 7)
      Step 4  MetaRM prediction R̂ for the D_O samples with the UPDATED MetaRM               (Eq. 6)
              and R' = -1 | 0 | 1 + max(0, R̂ - 1), R̂ clipped to [0, 1 + λ]               (Eq. 8; reward.do_reward)

    items: list (N) of pairwise dicts tagged "set" ('dh'|'do'), one per completion (group-repeated);
    completions: list[str] (N); judge: a make_judge dict; mrm: the MetaRM dict or None (mode none);
    nlhf: the `nlhf:` config section; mode, train_on_do: metarm.mode and metarm.train_on_do; seed:
    this step's MetaRM shuffle seed (train.py: run.seed * 7919 + step); world: number of ranks; t0:
    time.perf_counter() at the step's start (the "order/*" metrics are seconds since it).
    Returns dict, the shape of train.rlme_reward_step's: "reward" FloatTensor [N] (0.0 where the judge
    failed), "valid" BoolTensor [N] (False = judge failure: out of group statistics and the loss),
    "records" list (N) of samples.jsonl fields (pair, verdict, critique, judge F1 or why not, R̂,
    reward), "metrics" dict (MetaRM loss/agreement, order of operations)."""
    parsed = [reward.parse_grm_completion(c, nlhf) for c in completions]
    dh_idx = [i for i, it in enumerate(items) if it["set"] == "dh"]
    do_idx = [i for i, it in enumerate(items) if it["set"] == "do"]
    samples = [None] * len(items)
    metrics = {}
    # Step 2: D_H rewards from the judge
    dh = judge_dh([parsed[i] for i in dh_idx], [items[i] for i in dh_idx], judge, nlhf)
    for i, s in zip(dh_idx, dh):
        s["f1_why"] = s["judge_why"] if s["judged"] else ("invalid format" if not s["valid"] else "wrong verdict: judge not called")
        samples[i] = dict(s, r_hat=None)
    metrics["order/judge_done_s"] = time.perf_counter() - t0
    # Step 3: MetaRM update on the D_H samples, BEFORE it scores D_O
    updates_before, truncated_before = (mrm["updates"], mrm["truncated"]) if mrm is not None else (0, 0)
    if mrm is not None:
        train_items, train_samples = [items[i] for i in dh_idx], dh
        if train_on_do:  # the "w/ D_O for MetaRM" ablation (RM-NLHF §4.3, Table 3)
            extra = do_training_samples([parsed[i] for i in do_idx], [items[i] for i in do_idx], lam=nlhf["lam"])
            train_items, train_samples = train_items + [items[i] for i in do_idx], train_samples + extra
        metrics.update(online_update(mrm, train_items, train_samples, world=world, seed=seed, gated=nlhf["gate_on_outcome"]))
    metrics["order/metarm_update_done_s"] = time.perf_counter() - t0
    # Step 4: MetaRM prediction for D_O with the updated model (None for invalid verdicts: reward -1 anyway)
    metrics["order/metarm_predict_start_s"] = time.perf_counter() - t0
    critiques = [parsed[i]["critique"] if parsed[i]["valid"] else None for i in do_idx]
    r_hat = predict(mrm, [items[i] for i in do_idx], critiques) if mrm is not None else [None] * len(do_idx)
    if mrm is not None:  # inputs cut to fit metarm.max_length this step (rank 0's update + this rank's D_O)
        metrics["metarm/truncated"] = mrm["truncated"] - truncated_before
    metrics["metarm/trained_this_step"] = mrm is not None and mrm["updates"] > updates_before
    # Step 4, continued: D_O rewards
    do = reward.score_do([parsed[i] for i in do_idx], [items[i] for i in do_idx], r_hat, lam=nlhf["lam"], mode=mode,
                         gate_on_outcome=nlhf["gate_on_outcome"], form=nlhf["do_reward"])
    for i, s in zip(do_idx, do):
        samples[i] = dict(s, human_critique=None, f1=None, precision=None, recall=None, judged=False, judge_failed=False,
                          judge_attempts=0, judge_why=None, r_process=None, f1_why="D_O: no human critique (MetaRM R̂ instead)",
                          metarm_updates=mrm["updates"] if mrm is not None else None)
    metrics["order/do_reward_done_s"] = time.perf_counter() - t0
    keep = ("choice", "valid", "why", "correct", "critique", "human_critique", "judged", "judge_failed", "f1", "precision", "recall",
            "judge_why", "judge_attempts", "f1_why", "r_process", "r_hat", "reward", "metarm_updates")
    records = [{"item": it["id"], "set": it["set"], "source": it["source"], "winner": it["winner"],
                **{k: s.get(k) for k in keep}} for it, s in zip(items, samples)]
    return {"reward": torch.tensor([s["reward"] if s["reward"] is not None else 0.0 for s in samples]),
            "valid": torch.tensor([s["reward"] is not None for s in samples]),
            "records": records, "metrics": metrics}


def judge_dh(parsed, items, judge, nl):
    """reward.score_dh (RM-NLHF Eq. 4-5) with the `nlhf` config section's numbers."""
    return reward.score_dh(parsed, items, judge, lam=nl["lam"], threshold=nl["threshold"],
                           gate_on_outcome=nl["gate_on_outcome"], inclusive=nl["threshold_rule"] == "inclusive",
                           similarity=nl["similarity"])


def do_training_samples(parsed, items, lam):
    """MetaRM training labels for D_O samples, the "w/ D_O for MetaRM" ablation (RM-NLHF §4.3,
    Table 3; config metarm.train_on_do): no human critique, so a valid verdict is labelled by its
    outcome alone, 1 + λ/2 when right (halfway: the process term is unknown) and 0 when wrong.
    The paper pairs "correct and incorrect" with "0 and 1 + λ/2" in that order; we read it as right
    -> 1 + λ/2, since a wrong verdict earns 0 everywhere else in the method. Returns {"valid",
    "reward", "critique", "outcome_label"} per verdict (invalid: reward None, not trained on)."""
    out = []
    for p, it in zip(parsed, items):
        right = p["valid"] and p["choice"] == it["winner"]
        out.append({"valid": p["valid"], "critique": p["critique"],
                    "reward": (1.0 + lam / 2 if right else 0.0) if p["valid"] else None, "outcome_label": True})
    return out


def online_update(mrm, items, samples, *, world, seed, gated=True):
    """Step 3: update the MetaRM on this step's D_H samples of ALL ranks (`update`).

    Under torchrun the (item, sample) pairs are all-gathered and every rank runs `update` on them:
    a replica (ddp) trains on all, then rank 0's parameters are broadcast (bit-equal weights even
    where a GPU kernel is not deterministic); FSDP2 shards (mrm["shard"]) train each rank's share
    of every batch (fit). Rank 0's metrics are broadcast. Returns them plus metarm/updates."""
    if world > 1:  # every rank's pairs, in rank order
        dist.all_gather_object(parts := [None] * world, list(zip(items, samples)))
        items, samples = [p[0] for part in parts for p in part], [p[1] for part in parts for p in part]
    out = update(mrm, items, samples, seed=seed, gated=gated)
    if world > 1:  # rank 0's metrics; its weights, unless FSDP2 shards them (broadcast_parameters)
        dist.broadcast_object_list(box := [out, mrm["updates"]], src=0)
        out, mrm["updates"] = box
        broadcast_parameters(mrm["model"])
    return dict(out, **{"metarm/updates": mrm["updates"]})


# ----------------------------------------------------------------------------------------------
# The MetaRM's input, target and loss (RM-NLHF Eq. 6-7)


def metarm_text(context, response_a, response_b, critique):
    """The MetaRM input M_φ(q, y_A, y_B, ĉ) (RM-NLHF Eq. 6): conversation, both responses and the GRM critique, as text.
    No chat template: this model is a regressor, not a chat model."""
    pair = reward.PAIR_TEXT.format(context=context.strip(), response_a=response_a.strip(), response_b=response_b.strip())
    return f"{pair}\n\n[Critique]\n{(critique or '').strip()}"


def metarm_input(mrm, context, response_a, response_b, critique):
    """metarm_text within the MetaRM's token budget (metarm.max_length), keeping every part Eq. 6
    conditions on: when the whole is too long, the MIDDLE of the conversation is cut first, then
    the middles of both responses (equal shares), and the critique's middle only as a last resort;
    a cut part keeps its head and tail around " [...] ". (Truncating the joined text from one side
    would drop the conversation and Response A of every long item.)
    Returns (text, truncated bool); mrm["truncated"] counts the truncated inputs."""
    tok = mrm["tokenizer"]
    parts = [context.strip(), response_a.strip(), response_b.strip(), (critique or "").strip()]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in parts]
    # the budget for the four parts: max_length less the labels, BOS/EOS, and a margin for the
    # few tokens that merge differently where parts are joined
    frame = len(tok(metarm_text("", "", "", ""))["input_ids"])
    over = sum(map(len, ids)) - (mrm["max_length"] - frame - 8)
    if over <= 0:
        return metarm_text(*parts), False
    over += 4 * (len(tok(" [...] ", add_special_tokens=False)["input_ids"]) + 2)  # the cut markers, seams
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
            parts[k] = (tok.decode(ids[k][:head]) + " [...] " + (tok.decode(ids[k][-tail:]) if tail else "")).strip()
    mrm["truncated"] += 1
    return metarm_text(*parts), True


def class_values(lam, gated=True):
    """(0, 1, 1 + λ): the 'classifier' mode's classes and the values of a D_H reward R >= 0 (RM-NLHF Eq. 5);
    gated=False (nlhf.gate_on_outcome false) adds λ, a wrong verdict whose critique matched."""
    return (0.0, 1.0, 1.0 + lam) if gated else (0.0, lam, 1.0, 1.0 + lam)


def train_target(r, mode, lam):
    """Regression/classification target for a D_H reward R (a float in {0, 1, 1 + λ}).
    binary_retrain: 1[R > 1]; classifier: index of the nearest class value; else R itself."""
    if mode == "binary_retrain":
        return 1.0 if r > 1.0 else 0.0
    if mode == "classifier":
        return min(range(3), key=lambda c: abs(class_values(lam)[c] - r))
    return float(r)


def examples_from_samples(mrm, items, samples):
    """MetaRM training examples {"text", "r", "dh" (False: a do_training_samples outcome label)} from
    scored samples (reward.score_dh output, with their pairwise items): every valid verdict whose
    reward is known. Invalid formats (R = -1; D_O never asks the MetaRM about them) and judge
    failures (reward None) are left out."""
    out = []
    for it, s in zip(items, samples):
        if s["valid"] and s["reward"] is not None:
            text, _ = metarm_input(mrm, it["context"], it["response_a"], it["response_b"], critique=s["critique"])
            out.append({"text": text, "r": float(s["reward"]), "dh": not s.get("outcome_label", False)})
    return out


def metarm_loss(mrm, texts, rewards):
    """Loss (scalar, with grad) on one batch of texts and their D_H rewards R: MSE(ŷ, R) (RM-NLHF
    Eq. 7; 'binary_retrain': MSE to 1[R > 1]); 'classifier': cross-entropy over (0, 1, 1 + λ)."""
    out, targets = _forward(mrm, texts), [train_target(r, mrm["mode"], mrm["lam"]) for r in rewards]
    if mrm["mode"] == "classifier":
        return F.cross_entropy(out, torch.tensor(targets, device=out.device))
    return F.mse_loss(out, torch.tensor(targets, dtype=torch.float32, device=out.device))


def _forward(mrm, texts):
    """Raw outputs [B] (regression) or [B, 3] (classifier) for a list of texts."""
    tok, model, device = mrm["tokenizer"], mrm["model"], next(mrm["model"].parameters()).device
    enc = tok(texts, padding=True, truncation=True, max_length=mrm["max_length"], return_tensors="pt").to(device)
    with rollout.autocast(mrm["dtype"], device.type):  # float32 weights, compute in metarm.dtype; backward runs outside (autocast guidance)
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.float()
    return logits if mrm["mode"] == "classifier" else logits[:, 0]


# ----------------------------------------------------------------------------------------------
# Predict and update (Algorithm 1, steps 3-4)


@torch.no_grad()
def raw_outputs(mrm, texts):
    """The MetaRM's raw outputs for texts, in batches: floats (regression) or [3] logit lists (classifier).
    Sharded, every rank runs the most batches of any rank (FSDP2 gathers per forward), dummies dropped."""
    model, out, bs = mrm["model"], [], mrm["batch_size"]
    n = torch.tensor(-(-len(texts) // bs), device=next(model.parameters()).device)
    if mrm["shard"][1] > 1: dist.all_reduce(n, op=dist.ReduceOp.MAX)  # noqa: E701
    was = model.training
    model.eval()
    for i in range(0, int(n) * bs, bs):
        out += _forward(mrm, texts[i:i + bs] or ["."]).tolist()[:len(texts[i:i + bs])]
    model.train(was)
    return out


def predict_texts(mrm, texts):
    """R̂ on the reward scale for a list of MetaRM input texts (see the mode table at the top)."""
    lam, mode, out = mrm["lam"], mrm["mode"], raw_outputs(mrm, texts)
    if mode == "classifier":  # the expected value Σ p_c · value_c
        return [sum(p * v for p, v in zip(torch.tensor(o).softmax(-1).tolist(), class_values(lam))) for o in out]
    if mode == "binary":  # the regression output, discretised to a process bit
        return [1.0 + lam * float(y > 1.0 + lam / 2) for y in out]
    if mode == "binary_retrain":  # a 0/1 regressor, thresholded at 0.5
        return [1.0 + lam * float(y >= 0.5) for y in out]
    return out


def predict(mrm, items, critiques):
    """R̂ for D_O samples (Algorithm 1, step 4; RM-NLHF Eq. 6). items: pairwise dicts; critiques: the GRM critiques
    (None for an invalid sample gives None: its reward is -1 whatever R̂ says). Returns list[float | None]."""
    idx = [i for i, c in enumerate(critiques) if c is not None]
    texts = [metarm_input(mrm, items[i]["context"], response_a=items[i]["response_a"],
                          response_b=items[i]["response_b"], critique=critiques[i])[0] for i in idx]
    preds = predict_texts(mrm, texts)  # with no text too: a sharded MetaRM's forwards are collectives
    out = dict(zip(idx, preds))
    return [out.get(i) for i in range(len(critiques))]


def agreement(outputs, rewards, lam, mode="online", gated=True):
    """metarm/agreement (docs/method.md §9), on D_H samples: mean_i 1[decode(o_i) = train_target(R_i)],
    R_i the judge-based reward, o_i the raw output (raw_outputs) of the mode's trained model; decode =
    the nearest of class_values(λ, gated) for a regressor (binary too: its output before the process
    bit, which is never 0), 1[o >= 0.5] for binary_retrain, the argmax class for the classifier. A
    perfect predictor (o = its target, all mass on the target class) scores 1 in every mode: each
    target is one of the decoded values. None for no sample."""
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


def update(mrm, items, samples, seed=0, gated=True):
    """Online MetaRM update on this step's D_H samples (Algorithm 1, step 3): fit with the
    persistent AdamW at `online_lr` (constant), `online_epochs` passes (1 by default; the paper's
    "Aggressive" ablation takes 2 at lr 1e-5, App. H.1). Agreement with the judge is measured on
    the samples BEFORE training on them (an honest held-out number). items, samples: the D_H
    samples' pairwise dicts and reward.score_dh output. Returns metrics metarm/n, metarm/loss (mean
    over all passes; None when nothing is trained), metarm/agreement; mode 'offline' trains nothing.
    """
    ex = examples_from_samples(mrm, items, samples)
    metrics = {"metarm/n": len(ex), "metarm/loss": None, "metarm/agreement": None}
    if not ex:
        return metrics
    judged, (r, w) = [e for e in ex if e["dh"]], mrm["shard"]  # D_O outcome labels (train_on_do) are not the judge's
    out = raw_outputs(mrm, [e["text"] for e in judged[r::w]])  # sharded: each rank its share, then all of them
    if w > 1:
        dist.all_gather_object(parts := [None] * w, out)
        out = [parts[i % w][i // w] for i in range(len(judged))]
    metrics["metarm/agreement"] = agreement(out, [e["r"] for e in judged], mrm["lam"], mode=mrm["mode"], gated=gated)
    if mrm["mode"] == "offline":
        return metrics
    if mrm["optimizer"] is None:
        mrm["optimizer"] = torch.optim.AdamW(mrm["model"].parameters(), lr=mrm["online_lr"], weight_decay=mrm["weight_decay"])
    steps = fit(mrm, ex, mrm["optimizer"], epochs=mrm["online_epochs"], seed=seed)
    mrm["updates"] += 1
    metrics["metarm/loss"] = sum(loss * n for loss, n in steps) / (len(ex) * mrm["online_epochs"])
    return metrics


def fit(mrm, examples, optimizer, *, epochs, seed, lr_at=None, log=None):
    """The MetaRM's one training loop (RM-NLHF Eq. 7), for the online update and the cold start:
    `epochs` passes over `examples` ({"text", "r"}: examples_from_samples), pass e in batches of
    mrm["batch_size"] shuffled by seed + e; per batch metarm_loss, backward, the gradient norm
    clipped to 1.0, an `optimizer` step, and with `lr_at` (the lr multiplier at optimizer step t,
    0-based) a LambdaLR step. log: None or a callable taking one progress line per step. FSDP2 (mrm["shard"]
    (r, w)): rank r runs batch[r::w] (empty: a dummy, weight 0), its mean loss x its share x w, so the w ranks'
    gradient mean is the batch's (Eq. 7), as in one process. Returns [(batch mean loss, batch size)] a step."""
    model, (r, w) = mrm["model"], mrm["shard"]
    model.train()
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at) if lr_at is not None else None
    total = epochs * math.ceil(len(examples) / mrm["batch_size"])
    steps = []
    for epoch in range(epochs):
        for b in _batches(len(examples), mrm["batch_size"], seed + epoch):
            mine = b[r::w]  # this rank's share (one process / ddp: all of b, weight 1.0)
            loss = metarm_loss(mrm, [examples[i]["text"] for i in mine] or ["."], [examples[i]["r"] for i in mine] or [0.0])
            loss = loss * (len(mine) * w / len(b))  # 1.0 in one process / ddp
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if sched is not None:
                sched.step()
            if w > 1: dist.all_reduce(loss := loss.detach().clone()); loss /= w  # noqa: E701,E702
            steps.append((loss.item(), len(b)))
            if log:
                log(f"metarm: epoch {epoch + 1}/{epochs} step {len(steps)}/{total} loss {steps[-1][0]:.4f}")
    return steps


def _batches(n, batch_size, seed):
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def broadcast_parameters(model, src=0):
    """Copy rank `src`'s parameters and buffers into every rank's model (in place); FSDP2 shards: nothing."""
    for t in [] if rollout.is_fsdp(model) else list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src)


# ----------------------------------------------------------------------------------------------
# Cold start (Algorithm 1, lines 2-10): N rollouts per D_H prompt from the base GRM, judge, train


COLD_START_COUNTS = ("rollouts", "invalid", "judge_failures", "examples", "truncated")


def cold_start_sample(items, *, sample, prompt, rollouts_per_prompt, max_new_tokens, temperature=1.0, seed=0):
    """Algorithm 1, line 4, on one batch of D_H items: N rollouts per prompt from the base GRM.
    items: list (B) of D_H pairwise dicts, B >= 0; sample: the rollout backend, sample(prompt_ids,
    *, group_size, max_new_tokens, temperature, top_p, top_k, seed) -> rollout dict (rollout.py's),
    called with no prompt too (B = 0: HF decode of an FSDP2 policy gathers its weights, a collective
    every rank joins); prompt: item -> GRM prompt ids (reward.grm_prompt_ids bound to the GRM's
    tokenizer); seed: the batch's. Returns the completions, list[str] (B x N, a prompt's adjacent)."""
    return sample([prompt(it) for it in items], group_size=rollouts_per_prompt, max_new_tokens=max_new_tokens,
                  temperature=temperature, seed=seed)["completions"]


def cold_start_examples(mrm, items, completions, *, judge, nlhf, rollouts_per_prompt):
    """Algorithm 1, lines 5-7, on one batch: the rollouts' rewards R from the judge (Eq. 4-5:
    judge_dh; judge: judge(pairs) -> list[dict], plumbing/services.py make_judge), the MetaRM
    examples (Eq. 6's input, R the Eq. 7 target: examples_from_samples). items, completions:
    cold_start_sample's; nlhf: the `nlhf:` config section.
    Returns (examples list of {"text", "r", "dh"}, counts {name: int for COLD_START_COUNTS}):
    "truncated" = inputs cut to metarm.max_length; judge failures and invalid formats give no example."""
    truncated, rows = mrm["truncated"], [it for it in items for _ in range(rollouts_per_prompt)]
    samples = judge_dh([reward.parse_grm_completion(c, nlhf) for c in completions], rows, judge, nlhf)
    ex = examples_from_samples(mrm, rows, samples)
    return ex, {"rollouts": len(samples), "invalid": sum(not s["valid"] for s in samples),
                "judge_failures": sum(s["judge_failed"] for s in samples), "examples": len(ex),
                "truncated": mrm["truncated"] - truncated}


def fit_cold_start(mrm, examples, counts, *, epochs, lr, warmup_frac, weight_decay, seed):
    """Algorithm 1, line 9: train_metarm on the cold-start examples (Eq. 7). counts: the batches'
    cold_start_examples counts. Returns dict: their sums, target_mean (None for no example), loss_first,
    loss_last (None: nothing trained, the MetaRM keeps its initial head; the numbers say so)."""
    stats = {k: sum(n[k] for n in counts) for k in COLD_START_COUNTS}
    stats.update(examples=len(examples), target_mean=sum(e["r"] for e in examples) / len(examples) if examples else None)
    losses = train_metarm(mrm, examples, epochs=epochs, lr=lr, warmup_frac=warmup_frac, weight_decay=weight_decay, seed=seed)
    return dict(stats, loss_first=(losses or [None])[0], loss_last=(losses or [None])[-1])


def train_metarm(mrm, examples, epochs=3, lr=1e-5, warmup_frac=0.01, weight_decay=0.01, seed=0, log=None):
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
    return [loss for loss, _ in fit(mrm, examples, opt, epochs=epochs, seed=seed, lr_at=lr_at, log=log)]


if __name__ == "__main__":  # the command line (arguments, loading, output files) is plumbing/cli.py's metarm_main
    import importlib
    importlib.import_module("plumbing.cli").metarm_main()
