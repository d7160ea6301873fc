"""MetaRM: a scalar regression model that predicts the RM-NLHF reward where no human critique exists.

SPEC §5.4. The GRM earns 1 + λ·R_process on D_H items, where a judge compares its critique with
the human one. D_O items have a preference label but no human critique, so the process term is
predicted instead: the MetaRM reads (conversation, response A, response B, GRM critique) and
regresses the D_H reward R ∈ {0, 1, 1 + λ} with MSE.

Order of one online step (SPEC §5.4), wired in train.py:
    (1) roll out the GRM on D_H and D_O prompts
    (2) D_H rewards from the judge                      reward.score_dh
    (3) update the MetaRM on those D_H samples          metarm.update     (lr 5e-6, one pass)
    (4) predict R̂ for D_O samples with the UPDATED MetaRM   metarm.predict
    (5) D_O rewards                                     reward.score_do / reward.do_reward
    (6) GRPO update of the GRM

Ablation switches (`metarm.mode`, the paper's ablations):
    none         no MetaRM: D_O reward is the outcome only (-1 / 0 / 1); cold start is skipped
    offline      cold start, then frozen: update() is a no-op that still reports agreement
    online       cold start + one update per step (default, the paper's method)
    metarm_only  online, but the D_O reward is clip(R̂, 0, 1 + λ) without the outcome term
    binary       online; the MetaRM regresses y = 1[R > 1] (right AND critique matched) with MSE,
                 and predict() returns R̂ = 1 + λ·1[ŷ >= 0.5] (a yes/no process reward)
    classifier   online; a 3-way classification head over the reward values (0, 1, 1 + λ) with
                 cross-entropy, predict() returns the expected value Σ p_c · value_c

The MetaRM state is a plain dict:
    mrm = {"model", "tokenizer", "optimizer" (online AdamW, created on first update), "mode",
           "lam", "batch_size", "max_length", "online_lr", "weight_decay", "updates", "dtype"}
It is trained, so its parameters and AdamW state are float32 whatever `metarm.dtype` says;
`dtype` is the compute dtype of its forwards (autocast), as for the policy (train.compute_context).

Run alone:  python metarm.py --config configs/cpu_rm_nlhf.yaml cold-start   (saves to metarm.path or <run.out_dir>/metarm,
            where train.py picks it up instead of cold-starting itself)
"""
import argparse
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

import reward
import rollout

METARM_DEFAULTS = {
    "mode": "online",              # none | offline | online | metarm_only | binary | classifier (see top)
    "model": None,                 # base weights; None = the GRM's base (model.policy)
    "cold_start": True,            # train.py: cold-start at step 0 when no saved MetaRM exists
    "rollouts_per_prompt": 4,      # N cold-start rollouts per D_H prompt (SPEC default 4; paper text 8)
    "cold_start_items": 0,         # D_H items used for the cold start; 0 = all
    "epochs": 3,                   # cold start
    "lr": 1.0e-5,                  # cold start, cosine with warmup
    "warmup_frac": 0.01,
    "weight_decay": 0.01,
    "online_lr": 5.0e-6,           # online update, one pass per step, constant
    "batch_size": 8,
    "max_length": 1024,            # tokens; truncated from the LEFT so the critique (at the end) survives
    "max_new_tokens": 256,         # cold-start rollouts
    "temperature": 1.0,
    "dtype": "float32",
    "path": None,                  # where cold-start saves / train.py resumes the MetaRM; None = <out_dir>/metarm
}


# ----------------------------------------------------------------------------------------------
# Inputs and targets


def metarm_text(context, response_a, response_b, critique):
    """The MetaRM input (SPEC §5.4): conversation, both responses and the GRM critique, as text.
    No chat template: this model is a regressor, not a chat model."""
    return (f"[Conversation]\n{context.strip()}\n\n[Response A]\n{response_a.strip()}\n\n"
            f"[Response B]\n{response_b.strip()}\n\n[Critique]\n{(critique or '').strip()}")


def class_values(lam):
    """The reward values the 'classifier' mode predicts over: (0, 1, 1 + λ)."""
    return (0.0, 1.0, 1.0 + lam)


def train_target(r, mode, lam):
    """Regression/classification target for a D_H reward R (a float in {0, 1, 1 + λ}).
    binary: 1[R > 1]; classifier: index of the nearest class value; else R itself."""
    if mode == "binary":
        return 1.0 if r > 1.0 else 0.0
    if mode == "classifier":
        return min(range(3), key=lambda c: abs(class_values(lam)[c] - r))
    return float(r)


def examples_from_samples(items, samples):
    """MetaRM training examples from scored D_H samples: every valid verdict whose reward is known.

    Invalid formats (R = -1) are left out: SPEC §5.4 trains on R ∈ {0, 1, 1 + λ} and D_O never
    asks the MetaRM about them. Judge failures (reward None) are left out too.

    Args:
        items: list of pairwise dicts; samples: reward.score_dh output (same length).
    Returns:
        list of {"text", "r"}.
    """
    out = []
    for it, s in zip(items, samples):
        if s["valid"] and s["reward"] is not None:
            out.append({"text": metarm_text(it["context"], it["response_a"], it["response_b"], s["critique"]),
                        "r": float(s["reward"])})
    return out


# ----------------------------------------------------------------------------------------------
# Model


def load_metarm(path, mode="online", lam=0.5, dtype="float32", device="cpu", batch_size=8, max_length=1024,
                online_lr=5e-6, weight_decay=0.01):
    """Load a MetaRM from a base LM (new scalar head) or from a saved MetaRM folder.

    Args:
        path: HF folder, hub id or gguf:<package>/<file> (see rollout.resolve_model_path).
        mode: one of reward.METARM_MODES except 'none'; 'classifier' gets 3 outputs, others 1.
        dtype: the compute dtype of its forwards; the weights load in float32 (they are trained:
            an AdamW step of ~5e-6 on a bf16 weight rounds to nothing).
    Returns:
        the mrm dict (see the top of this file).
    Raises:
        SystemExit with one line when the path cannot be loaded or mode is unknown.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    if mode not in reward.METARM_MODES or mode == "none":
        raise SystemExit(f"metarm.mode: {mode!r} cannot load a model; allowed: {', '.join(reward.METARM_MODES[1:])}")
    resolved = rollout.resolve_model_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(resolved)
        model = AutoModelForSequenceClassification.from_pretrained(
            resolved, num_labels=3 if mode == "classifier" else 1, dtype=torch.float32).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(f"metarm model {path!r} could not be loaded: {str(e).splitlines()[0]}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    # the sequence classifier pools the last non-pad token and needs the pad id in its config
    model.config.pad_token_id = tok.pad_token_id
    tok.padding_side = "right"
    tok.truncation_side = "left"  # keep the critique, which comes last
    return {"model": model, "tokenizer": tok, "optimizer": None, "mode": mode, "lam": float(lam),
            "batch_size": int(batch_size), "max_length": int(max_length), "online_lr": float(online_lr),
            "weight_decay": float(weight_decay), "updates": 0, "dtype": dtype}


def _forward(mrm, texts):
    """Raw outputs [B] (regression) or [B, 3] (classifier) for a list of texts."""
    tok, model = mrm["tokenizer"], mrm["model"]
    device = next(model.parameters()).device
    enc = tok(texts, padding=True, truncation=True, max_length=mrm["max_length"], return_tensors="pt").to(device)
    with rollout.autocast(mrm["dtype"], device.type):  # float32 weights, compute in metarm.dtype; backward runs outside (autocast guidance)
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.float()
    return logits if mrm["mode"] == "classifier" else logits[:, 0]


def metarm_loss(mrm, texts, rewards):
    """Loss on one batch. MSE(ŷ, R) (SPEC §5.4; 'binary': MSE to 1[R > 1]); 'classifier':
    cross-entropy over the classes (0, 1, 1 + λ).

    Args: texts: list[str]; rewards: list[float] D_H rewards R. Returns: scalar tensor (grad).
    """
    out = _forward(mrm, texts)
    targets = [train_target(r, mrm["mode"], mrm["lam"]) for r in rewards]
    if mrm["mode"] == "classifier":
        return F.cross_entropy(out, torch.tensor(targets, device=out.device))
    return F.mse_loss(out, torch.tensor(targets, dtype=torch.float32, device=out.device))


@torch.no_grad()
def predict_texts(mrm, texts):
    """R̂ on the reward scale for a list of MetaRM input texts (see the mode table at the top)."""
    model = mrm["model"]
    was = model.training
    model.eval()
    preds = []
    for i in range(0, len(texts), mrm["batch_size"]):
        out = _forward(mrm, texts[i:i + mrm["batch_size"]])
        if mrm["mode"] == "classifier":
            values = torch.tensor(class_values(mrm["lam"]), device=out.device)
            preds += (out.softmax(-1) * values).sum(-1).tolist()
        elif mrm["mode"] == "binary":
            preds += [1.0 + mrm["lam"] * float(y >= 0.5) for y in out.tolist()]
        else:
            preds += out.tolist()
    model.train(was)
    return preds


def predict(mrm, items, critiques):
    """R̂ for D_O samples (SPEC §5.4 step 4). items: pairwise dicts; critiques: the GRM critiques
    (None for an invalid sample gives None: its reward is -1 whatever R̂ says).
    Returns list[float | None]."""
    idx = [i for i, c in enumerate(critiques) if c is not None]
    preds = predict_texts(mrm, [metarm_text(items[i]["context"], items[i]["response_a"], items[i]["response_b"],
                                            critiques[i]) for i in idx]) if idx else []
    out = [None] * len(critiques)
    for i, p in zip(idx, preds):
        out[i] = p
    return out


def _batches(n, batch_size, seed):
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def train_metarm(mrm, examples, epochs=3, lr=1e-5, warmup_frac=0.01, weight_decay=0.01, seed=0, log=None):
    """Cold-start training (SPEC §5.4): AdamW, `epochs` passes, linear warmup over `warmup_frac`
    of the steps (at least 1 step), then cosine decay to 0.

    Args:
        examples: list of {"text", "r"} (examples_from_samples).
    Returns:
        list[float], the loss of every optimizer step.
    """
    if not examples:
        return []
    model = mrm["model"]
    model.train()
    steps_per_epoch = math.ceil(len(examples) / mrm["batch_size"])
    total = steps_per_epoch * epochs
    warmup = max(1, round(warmup_frac * total))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def lr_at(step):  # multiplier of lr at optimizer step `step` (0-based)
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses = []
    for epoch in range(epochs):
        for b in _batches(len(examples), mrm["batch_size"], seed + epoch):
            loss = metarm_loss(mrm, [examples[i]["text"] for i in b], [examples[i]["r"] for i in b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log:
                log(f"metarm cold start: epoch {epoch + 1}/{epochs} step {len(losses)}/{total} loss {loss.item():.4f}")
    return losses


def agreement(preds, rewards, lam):
    """Share of samples where R̂, rounded to the nearest reward value in (0, 1, 1 + λ), equals
    the judge-based reward R (SPEC §9: 'MetaRM agreement with the judge')."""
    if not rewards:
        return None
    vals = class_values(lam)
    near = [min(vals, key=lambda v: abs(v - p)) for p in preds]
    return sum(abs(n - r) < 1e-9 for n, r in zip(near, rewards)) / len(rewards)


def update(mrm, items, samples, seed=0):
    """Online MetaRM update on this step's D_H samples (SPEC §5.4 step 3): one pass at
    `online_lr` (constant) with a persistent AdamW. Agreement with the judge is measured on the
    samples BEFORE training on them (an honest held-out number).

    Args:
        items: pairwise dicts of the D_H samples (one per sample); samples: reward.score_dh output.
    Returns:
        dict metrics: metarm/n, metarm/loss (mean over the pass; None when nothing to train on),
        metarm/agreement. Mode 'offline' reports agreement and trains nothing.
    """
    ex = examples_from_samples(items, samples)
    metrics = {"metarm/n": len(ex), "metarm/loss": None, "metarm/agreement": None}
    if not ex:
        return metrics
    rewards = [e["r"] for e in ex]
    metrics["metarm/agreement"] = agreement(predict_texts(mrm, [e["text"] for e in ex]), rewards, mrm["lam"])
    if mrm["mode"] == "offline":
        return metrics
    model = mrm["model"]
    if mrm["optimizer"] is None:
        mrm["optimizer"] = torch.optim.AdamW(model.parameters(), lr=mrm["online_lr"], weight_decay=mrm["weight_decay"])
    model.train()
    losses = []
    for b in _batches(len(ex), mrm["batch_size"], seed):
        loss = metarm_loss(mrm, [ex[i]["text"] for i in b], [ex[i]["r"] for i in b])
        mrm["optimizer"].zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mrm["optimizer"].step()
        losses.append(loss.item() * len(b))
    mrm["updates"] += 1
    metrics["metarm/loss"] = sum(losses) / len(ex)
    return metrics


# ----------------------------------------------------------------------------------------------
# Save / load (atomic)

_META = ("mode", "lam", "batch_size", "max_length", "online_lr", "weight_decay", "updates")


def save(mrm, path):
    """Write the MetaRM to `path` atomically: everything goes to `<path>.tmp` first, then renames.
    A crash leaves either the old folder, or `<path>.old` (which load() falls back to).
    Contents: HF model + tokenizer, metarm.json (settings), optimizer.pt (online AdamW state)."""
    path = os.path.abspath(path)
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    mrm["model"].save_pretrained(tmp)
    mrm["tokenizer"].save_pretrained(tmp)
    with open(os.path.join(tmp, "metarm.json"), "w") as f:
        json.dump({k: mrm[k] for k in _META}, f, indent=1)
    if mrm["optimizer"] is not None:
        torch.save(mrm["optimizer"].state_dict(), os.path.join(tmp, "optimizer.pt"))
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load(path, device="cpu", dtype="float32"):
    """Load a MetaRM written by save() (settings from metarm.json, optimizer state if any).
    Raises SystemExit when neither `path` nor `<path>.old` holds one."""
    for p in (path, os.path.abspath(path) + ".old"):
        if os.path.isfile(os.path.join(p, "metarm.json")):
            with open(os.path.join(p, "metarm.json")) as f:
                meta = json.load(f)
            mrm = load_metarm(p, meta["mode"], meta["lam"], dtype, device, meta["batch_size"], meta["max_length"],
                              meta["online_lr"], meta["weight_decay"])
            mrm["updates"] = meta["updates"]
            opt_path = os.path.join(p, "optimizer.pt")
            if os.path.isfile(opt_path):
                mrm["optimizer"] = torch.optim.AdamW(mrm["model"].parameters(), lr=mrm["online_lr"],
                                                     weight_decay=mrm["weight_decay"])
                mrm["optimizer"].load_state_dict(torch.load(opt_path, map_location=device))
            return mrm
    raise SystemExit(f"metarm: no saved MetaRM (metarm.json) in {path}")


# ----------------------------------------------------------------------------------------------
# Cold start (SPEC §5.4)


def cold_start(mrm, grm_path, dh_items, judge, rollouts_per_prompt=4, max_new_tokens=256, temperature=1.0,
               epochs=3, lr=1e-5, warmup_frac=0.01, weight_decay=0.01, nlhf=None, chat_template="auto",
               seed=0, micro_batch_size=None, log=print, grm=None, compute_dtype="float32", fast=True):
    """Cold start: N rollouts per D_H prompt from the base GRM, judge rewards, then train.

    Args:
        mrm: load_metarm(...) dict. grm_path: the base GRM (model.policy).
        grm: optional (model, tokenizer) of the base GRM already in memory (train.py passes its
            policy at step 0); None = load grm_path on the CPU.
        dh_items: pairwise dicts with human critiques. judge: reward.make_judge(...) dict.
        nlhf: dict with lam, threshold, gate_on_outcome, max_critique_lines, max_critique_chars
            (defaults: 0.5, 0.5, True, 4, 1500).
        compute_dtype: the GRM's compute dtype while sampling (model.dtype; autocast).
        fast: False samples with the plain twin (rollout.generate_plain, train.fast_paths).
    Returns:
        dict: rollouts, examples, invalid, judge_failures, target_mean, loss_first, loss_last,
        seconds. With no usable example (e.g. every rollout invalid) nothing is trained and the
        MetaRM keeps its initial head; the numbers say so.
    """
    nl = {"lam": 0.5, "threshold": 0.5, "gate_on_outcome": True, "max_critique_lines": 4,
          "max_critique_chars": 1500, **(nlhf or {})}
    t0 = time.time()
    grm, tok = grm or rollout.load_model(grm_path)
    chat = rollout.use_chat_template(tok, chat_template)
    prompts = [rollout.build_prompt_ids(tok, reward.build_grm_prompt(it["context"], it["response_a"], it["response_b"],
                                                                     nl["max_critique_lines"]), chat) for it in dh_items]
    device = next(grm.parameters()).device
    with rollout.autocast(compute_dtype, device.type):
        out = rollout.generate(grm, tok, prompts, group_size=rollouts_per_prompt, max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed, micro_batch_size=micro_batch_size, fast=fast)
    del grm
    items = [it for it in dh_items for _ in range(rollouts_per_prompt)]
    parsed = [reward.parse_grm_output(c, nl["max_critique_lines"], nl["max_critique_chars"]) for c in out["completions"]]
    samples = reward.score_dh(parsed, items, judge, nl["lam"], nl["threshold"], nl["gate_on_outcome"])
    ex = examples_from_samples(items, samples)
    stats = {"rollouts": len(samples), "examples": len(ex), "invalid": sum(not s["valid"] for s in samples),
             "judge_failures": sum(s["judged"] and s["f1"] is None for s in samples),
             "target_mean": sum(e["r"] for e in ex) / len(ex) if ex else None}
    log(f"metarm cold start: {stats['rollouts']} rollouts, {stats['invalid']} invalid, "
        f"{stats['judge_failures']} judge failures, {stats['examples']} training examples")
    losses = train_metarm(mrm, ex, epochs, lr, warmup_frac, weight_decay, seed, log=None)
    stats.update(loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
                 seconds=time.time() - t0)
    return stats


# ----------------------------------------------------------------------------------------------
# CLI


def metarm_settings(cfg):
    """The `metarm:` section with defaults; unknown keys and modes fail with one line."""
    sec = cfg.get("metarm") or {}
    unknown = set(sec) - set(METARM_DEFAULTS)
    if unknown:
        raise SystemExit(f"metarm: unknown key(s) {sorted(unknown)}; allowed: {sorted(METARM_DEFAULTS)}")
    m = dict(METARM_DEFAULTS, **sec)
    if m["mode"] not in reward.METARM_MODES:
        raise SystemExit(f"metarm.mode: {m['mode']!r} unknown; allowed: {', '.join(reward.METARM_MODES)}")
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description="MetaRM (SPEC §5.4): cold start from D_H rollouts of the base GRM.")
    ap.add_argument("--config", action="append", required=True, help="YAML file(s); later ones override")
    ap.add_argument("command", choices=["cold-start"])
    ap.add_argument("--out", default=None, help="save folder (default metarm.path or <run.out_dir>/metarm)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides (YAML-typed), as for train.py")
    a = ap.parse_args(argv)
    import train  # lazily: train.py imports this module at its top
    cfg = train.load_config(a.config, a.overrides)  # config.yaml is the schema (SPEC §3)
    m = metarm_settings(cfg)
    if m["mode"] == "none":
        raise SystemExit("metarm.mode is 'none': there is no MetaRM to cold-start")
    nl = cfg["nlhf"]
    base = m["model"] or cfg["model"]["policy"]
    seed = cfg["run"]["seed"]
    out = a.out or m["path"] or os.path.join(cfg["run"]["out_dir"], "metarm")
    judge = reward.make_judge(cfg["judge"])  # start-up checks (key variable, model name) first
    items = train.load_dh_items(cfg)
    if m["cold_start_items"]:
        items = items[:m["cold_start_items"]]
    mrm = load_metarm(base, m["mode"], nl["lam"], m["dtype"], "cpu", m["batch_size"], m["max_length"],
                      m["online_lr"], m["weight_decay"])
    stats = cold_start(mrm, cfg["model"]["policy"], items, judge, rollouts_per_prompt=m["rollouts_per_prompt"],
                       max_new_tokens=m["max_new_tokens"], temperature=m["temperature"], epochs=m["epochs"], lr=m["lr"],
                       warmup_frac=m["warmup_frac"], weight_decay=m["weight_decay"], nlhf=nl,
                       chat_template=cfg["model"]["chat_template"], seed=seed, fast=cfg["train"]["fast_paths"])
    save(mrm, out)
    print(json.dumps(dict(stats, saved=out)))


if __name__ == "__main__":
    main()
