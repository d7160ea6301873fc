"""RLME and RM-NLHF training in one file: prompts -> rollout -> reward -> advantages -> update.

    python train.py --config configs/cpu.yaml [key.sub=value ...]     # one CPU process
    torchrun --nproc_per_node 8 train.py --config config.yaml         # one 8-GPU node

The step is `train()`, top to bottom; the functions after it follow in the order it calls them:
  1. prompts     this rank's P/world items; RM-NLHF mixes D_H and D_O                step_items
  2. rollout     G completions per prompt (RLME Eq. 1): HF generate or vLLM            sample
  3. reward      RLME: the evaluators' weighted log p(target) (Eq. 2-3)      rlme_reward_step
                 RM-NLHF: judge D_H, update the MetaRM, predict D_O (Alg. 1) nlhf_reward_step
  4. advantages  A = r - mean(group) (RLME Eq. 5), / std for GRPO (RM-NLHF Eq. 1-2)
  5. update      CISPO (RLME Eq. 6-8) or GRPO + k3 KL (RM-NLHF Eq. 3)           update_policy
  6. log         metrics.jsonl + samples.jsonl (rank 0), TensorBoard, the bar      log_step
  7. validate    every run.eval_every steps; the monitor, the early stop     validate, watch
  8. checkpoint  atomic; re-running the same command resumes exactly     save_checkpoint
Then setup (the models and data), and how a run is run: the config (load_config), processes,
DDP / FSDP2, LoRA, checkpoints, the run lock; main (the command line) last.

What is simplified, and why:
  - On-policy by default (algo.updates_per_batch = algo.minibatches = 1): CISPO's importance
    weight is exactly 1, the behaviour pass skipped; either above 1 gives RLME Eq. 6's off-policy
    update. The live evaluator IS the policy (RLME §4.1): no second model, no value model.
  - LoRA: "the initial policy" (frozen_self, the GRPO reference) is the policy with its adapters
    off; LoRA samples with HF generate (the vLLM weight push sends whole weights).
  - float32 master weights, compute in float32 or bfloat16; TensorBoard besides metrics.jsonl.
Formulas and the choices the papers leave open: docs/method.md; parallelism: docs/scale-out.md.
"""
import argparse
import datetime
import difflib
import fcntl
import functools
import glob
import json
import math
import os
import re
import resource
import shutil
import string
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from tqdm import tqdm

import data
import evaluate
import metarm
import reward as R
import rollout

HERE = os.path.dirname(os.path.abspath(__file__))
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp alone: our intent


# ---- The loop ------------------------------------------------------------------------------------


def train(cfg):
    """Run cfg["run"]["total_steps"] steps, or resume the unfinished run in run.out_dir."""
    state = setup(cfg)
    if state is None:  # the run in run.out_dir is complete or stopped early
        return
    algo, ro, run, nl, d = cfg["algo"], cfg["rollout"], cfg["run"], cfg["nlhf"], cfg["data"]
    G, P, rank, world, seed = (ro["group_size"], ro["prompts_per_step"], state["rank"],
                               state["world"], run["seed"])
    total, every, task = run["total_steps"], run["eval_every"], cfg["task"]
    check = functools.partial(  # 7. held-out validation (step, records) -> val/*
        validate, state, task=task, reward=state["reward"], template=d["prompt_template"],
        numeric=d["label_format"] != "text", max_new_tokens=ro["max_new_tokens"],
        chunk=max(1, P * G // world), style=nl["grm_prompt"], max_lines=nl["max_critique_lines"],
        max_chars=nl["max_critique_chars"], seed=seed, max_prompt_tokens=(
            ro["vllm_max_model_len"] - ro["max_new_tokens"]) if state["engine"] else None)
    stop_rule = functools.partial(watch, state, out_dir=run["out_dir"],
                                  drop=run["early_stop_drop"], patience=run["early_stop_patience"])
    if every and run["eval_at_start"] and state["start_step"] == 0:  # the initial policy: step 0
        log_step(state, val := check(0, []), [], out_dir=run["out_dir"])
        stop_rule(val, None)  # the monitor's first point (one cannot trigger a stop)
    for step in range(state["start_step"], total):
        t0 = time.perf_counter()
        # --- 1. prompts: this rank's share of the step's items -------------------------------
        items = R.nlhf_step_items(
            state["dh"], state["do"], step, prompts_per_step=P, dh_per_step=nl["dh_per_step"],
            seed=seed, rank=rank, world=world) if task == "rm_nlhf" else rollout.step_items(
            state["items"], step, P, seed=seed, rank=rank, world=world)
        # --- 2. rollout: G completions per prompt (RLME Eq. 1), seeded by (run, step, rank) ---
        out = sample(state, [state["prompt"](it) for it in items], group_size=G,
                     max_new_tokens=ro["max_new_tokens"], temperature=ro["temperature"],
                     top_p=ro["top_p"], seed=sampling_seed(seed, step, rank))
        if state["engine"] is not None:  # vLLM: its memory to the reward and the update
            rollout.vllm_sleep(state["engine"])
        t1 = time.perf_counter()
        # --- 3. rewards: RLME's evaluators (Eq. 2-3) or RM-NLHF's Algorithm 1 (judge, MetaRM)
        rew = state["reward"]([it for it in items for _ in range(G)], out["completions"],
                              step=step, t0=t0)
        t2 = time.perf_counter()
        # --- 4. advantages: r - group mean (RLME Eq. 5), / std for GRPO; unknown rewards: 0 ---
        adv = group_advantages(rew["reward"], G, std=algo["advantage_std"], valid=rew["valid"],
                               unbiased=algo["std_unbiased"])
        # --- 5. update: CISPO (RLME Eq. 6-8) or GRPO + k3 KL (RM-NLHF Eq. 3) ----------------
        if (cfg["model"]["lora"] or {}).get("dropout", 0) > 0:  # LoRA dropout: seeded per step
            torch.manual_seed(sampling_seed(seed, step, rank))
        upd = update_policy(
            state["model"], state["policy"], state["optimizer"],
            dict(out, advantages=adv, valid=rew["valid"]), loss=algo["loss"],
            eps_low=algo["eps_low"], eps_high=algo["eps_high"], ratio=algo["ratio"],
            clip_eps=algo["clip_eps"], kl_coef=algo["kl_coef"], aggregation=algo["aggregation"],
            max_new_tokens=ro["max_new_tokens"], updates_per_batch=algo["updates_per_batch"],
            minibatches=algo["minibatches"], group_size=G,
            micro_batch_size=cfg["train"]["micro_batch_size"], grad_clip=cfg["optim"]["grad_clip"],
            temperature=ro["temperature"], pad_id=state["tokenizer"].pad_token_id,
            dtype=cfg["model"]["dtype"], world=world, ref_model=state["ref_model"])
        if state["engine"] is not None:  # vLLM samples the next step with the updated weights
            rollout.vllm_push_weights(state["engine"], state["policy"])
        state["scheduler"].step()
        times = {"rollout": t1 - t0, "reward": t2 - t1, "update": time.perf_counter() - t2}
        # --- 6. log (rank 0 gets every rank's samples); 7. validate every run.eval_every -----
        done = step + 1
        records = [{"step": done, "rank": rank, "group": i // G, **f,  # samples.jsonl's lines
                    "completion": out["completions"][i], "truncated": bool(out["truncated"][i]),
                    "length": int(out["completion_mask"][i].sum()), "advantage": float(adv[i]),
                    "importance_weight": float(upd["is_weight"][i]),
                    "clipped": float(upd["clipped"][i])} for i, f in enumerate(rew["records"])]
        val = check(done, records) if every and (done % every == 0 or done == total) else {}
        metrics, records = step_metrics(state, records, upd, {**rew["metrics"], **val}, times,
                                        group_size=G, nlhf=task == "rm_nlhf",
                                        steps=algo["updates_per_batch"] * algo["minibatches"])
        log_step(state, metrics, records, out_dir=run["out_dir"])
        stop = bool(val) and stop_rule(val, metrics)
        # --- 8. checkpoint (the MetaRM rides along in metarm/); an early stop ends the run ---
        if (run["save_every"] and done % run["save_every"] == 0) or done == total or stop:
            save_checkpoint(run["out_dir"], done, state["policy"], state["tokenizer"],
                            state["optimizer"], state["scheduler"], run["keep_checkpoints"], rank,
                            world, extra=state["mrm"] and (
                                lambda d: metarm.save_metarm(state["mrm"], f"{d}/metarm")))
        if stop:
            break
    finish(state)


def sampling_seed(run_seed, step, rank):
    """The rollout's seed, distinct per rank and step: a resumed run samples alike."""
    return run_seed * 1_000_003 + step * 10_007 + rank


def sample(state, prompt_ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
           seed=0):
    """2. Completions by vLLM or HF generate (FSDP2: a collective, every rank calls): the rollout
    dict (rollout.py)."""
    if state["engine"] is not None:
        return rollout.vllm_generate(state["engine"], prompt_ids, group_size, max_new_tokens,
                                     temperature, top_p, top_k, seed)
    with unsharded(state["model"]), rollout.autocast(state["dtype"], state["device"].type):
        return rollout.generate(state["policy"], state["tokenizer"], prompt_ids, group_size,
                                max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, micro_batch_size=state["generate_batch"])


# ---- 3-4. Rewards and advantages -----------------------------------------------------------------


def rlme_reward_step(state, items, completions, *, meta_questions, kind, label_format, qa_metric,
                     rlvr_weight, renormalize, transform):
    """3. RLME rewards of N (item, completion) pairs: r = sum_j v_j sum_k w_k log p_jk (RLME Eq.
    2-3), RLVR's (kind rlvr), or hybrid: rlvr_weight x RLVR + RLME. Returns {"reward" [N], "valid":
    None or BoolTensor [N] (False: a remote evaluator failed), "records", "metrics"}."""
    world, evs = state["world"], state["evaluators"]
    # RLVR (docs/method.md §4.3): kind rlvr's reward, hybrid's first part; the accuracy always
    # (exact match for text labels, whatever qa_metric); no label: None
    labels = [it["label"] for it in items]
    rlvr = torch.tensor([R.answer_reward(c, y, label_format, qa_metric) if y is not None else 0.0
                         for c, y in zip(completions, labels)])
    correct = [R.answer_reward(c, y, label_format, "em") >= 1.0 if y is not None else None
               for c, y in zip(completions, labels)]
    logp, rlme, nonfinite, valid = None, None, 0, torch.ones(len(items), dtype=torch.bool)
    if kind in ("rlme", "hybrid"):
        with rollout.autocast(state["dtype"], state["device"].type):
            o = R.rlme_reward(evs, meta_questions, problems=[it["problem"] for it in items],
                              solutions=completions, references=[it["answer_text"] for it in items],
                              anchored=[it["anchored"] for it in items], template=state["template"],
                              renormalize=renormalize, transform=transform)
        rlme, logp, nonfinite, failed, valid = o["reward"], o["logp"], o["nonfinite"], o[
            "failed"], o["valid"]
    rewards = (R.hybrid_reward(rlvr, rlme, rlvr_weight=rlvr_weight) if kind == "hybrid"
               else {"rlme": rlme, "rlvr": rlvr}[kind])
    records = []
    for i, (it, c) in enumerate(zip(items, completions)):  # reward None: masked
        ok = bool(valid[i])
        rec = {"item": it["index"], "problem": it["problem"], "extracted": R.extract_boxed(c),
               "label": it["label"], "correct": correct[i], "anchored": it["anchored"],
               "reward": float(rewards[i]) if ok else None, "rlvr_reward": float(rlvr[i])}
        if logp is not None:  # logp [N, J evaluators, K questions]; None: a failed request
            rec["rlme_reward"] = float(rlme[i]) if ok else None
            rec["logp"] = {ev["name"]: {mq["question"]: None if failed[i, j, k] else float(
                logp[i, j, k]) for k, mq in enumerate(meta_questions)}
                for j, ev in enumerate(evs)}
        records.append(rec)
    metrics = {"reward/nonfinite": all_sum(nonfinite, world),
               "reward/masked": all_sum(int((~valid).sum()), world)}
    for j, ev in enumerate(evs if logp is not None else []):
        if "failures" in ev:  # a remote evaluator: the samples it could not score
            metrics[f"evaluator/{ev['name']}/failed"] = all_sum(int(failed[:, j].any(1).sum()),
                                                                world)
    return {"reward": rewards, "valid": None if bool(valid.all()) else valid, "records": records,
            "metrics": metrics}


def group_advantages(rewards, group_size, std=False, valid=None, unbiased=False):
    """4. A_i = r_i - mean_group(r) (RLME Eq. 5), or / (std + 1e-6) with std=True (RM-NLHF Eq. 1-2;
    unbiased: / (n - 1), the authors' verl). rewards: FloatTensor [N], groups contiguous; valid:
    BoolTensor [N] | None (invalid: out of the statistics, A = 0). A flat group gets exactly 0."""
    r = rewards.view(-1, group_size).float()
    v = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.view(-1, group_size)
    count = v.sum(1, keepdim=True).clamp(min=1)
    mean = torch.where(v, r, torch.zeros_like(r)).sum(1, keepdim=True) / count
    adv = torch.where(v, r - mean, torch.zeros_like(r))
    if std:  # the population | unbiased variance
        var = (adv ** 2).sum(1, keepdim=True) / (count - int(unbiased)).clamp(min=1)
        adv = adv / (var.sqrt() + 1e-6)
    big = torch.finfo(r.dtype).max  # flat: max == min over the valid rewards (no 1-ulp residue)
    flat = (torch.where(v, r, torch.full_like(r, -big)).amax(1, keepdim=True)
            == torch.where(v, r, torch.full_like(r, big)).amin(1, keepdim=True))
    return torch.where(flat | ~v, torch.zeros_like(adv), adv).view(-1)


# ---- 5. The update -------------------------------------------------------------------------------


def update_policy(model, policy, optimizer, batch, *, loss, eps_low, eps_high, ratio, clip_eps,
                  kl_coef, aggregation, max_new_tokens, updates_per_batch, minibatches,
                  group_size, micro_batch_size, grad_clip, temperature, pad_id, dtype="float32",
                  world=1, ref_model=None):
    """5. One rollout batch's update (docs/method.md §4.4): `updates_per_batch` passes, each
    `minibatches` optimizer steps over whole groups, each accumulated over micro-batches; a step's
    loss is sum(per-token loss) / ONE normaliser over all its micro-batches on all ranks. batch:
    "prompt_ids" (N lists), "completion_ids" LongTensor [N, L], "completion_mask" [N, L],
    "advantages" [N], "valid" BoolTensor [N] | None. Returns {"loss", "grad_norms" (before
    clipping; non-finite: step skipped), "is_weight", "clipped" ([N], the last pass)}."""
    mask = batch["completion_mask"].float()
    if batch["valid"] is not None:  # a failed judge call: the row leaves the loss
        mask = mask * batch["valid"].float()[:, None]
    adv, n, device = batch["advantages"], len(batch["prompt_ids"]), next(policy.parameters()).device
    # One optimizer step per batch: pi_theta == pi_b at the update, the ratio is exactly 1 and
    # the behaviour pass is skipped (the loss takes logp.detach())
    behaviour = ref = None
    if updates_per_batch > 1 or minibatches > 1:
        behaviour = frozen_logprobs(policy, batch, micro_batch_size, temperature, pad_id, dtype)
    if ref_model is not None:
        ref = frozen_logprobs(ref_model, batch, micro_batch_size, temperature, pad_id, dtype)
    model.train()
    size = n // group_size // minibatches * group_size  # rows per optimizer step
    loss_total, grad_norms, is_weights, clipped = 0.0, [], torch.ones(n), torch.zeros(n)
    for _ in range(updates_per_batch):
        for m in range(minibatches):
            idx = list(range(m * size, (m + 1) * size))
            # the one global normaliser of this optimizer step: all micro-batches, all ranks
            norm = max(loss_normaliser(aggregation, all_sum((mask[idx].sum(-1) > 0).sum(), world),
                                       all_sum(mask[idx].sum(), world), max_new_tokens), 1.0)
            chunks = micro_batches(idx, micro_batch_size)
            for c, rows in enumerate(chunks):
                # DDP all-reduces on the last micro-batch only (FSDP2 reduce-scatters each)
                ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
                with model.no_sync() if ddp and c < len(chunks) - 1 else nullcontext():
                    with rollout.autocast(dtype, device.type):
                        lp, width = rows_logprobs(model, batch, rows, temperature, pad_id)
                    lp, m_rows, a = lp.float(), mask[rows, :width].to(device), adv[rows].to(device)
                    beh = None if behaviour is None else torch.stack(
                        [behaviour[i][:width] for i in rows]).to(device)
                    if loss == "cispo":
                        loss_sum, st = cispo_loss(lp, beh, a, m_rows, eps_low=eps_low,
                                                  eps_high=eps_high, ratio=ratio,
                                                  aggregation=aggregation)
                    else:
                        ref_lp = None if ref is None else torch.stack(
                            [ref[i][:width] for i in rows]).to(device)
                        loss_sum, st = grpo_loss(lp, beh, a, m_rows, clip_eps=clip_eps,
                                                 kl_coef=kl_coef, ref_logp=ref_lp,
                                                 aggregation=aggregation)
                    # DDP and FSDP2 average gradients over ranks; x world makes it a global sum
                    (loss_sum * world / norm).backward()
                loss_total += float(loss_sum.detach()) / norm
                is_weights[rows] = st["is_weight"].float().cpu()
                clipped[rows] = st["clipped"].float().cpu()
            # clip the global norm (grad_clip <= 0: measure only); a non-finite one skips the step
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(),
                                                grad_clip if grad_clip > 0 else float("inf"))
            grad_norms.append(float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn))
            if math.isfinite(grad_norms[-1]):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_total, "grad_norms": grad_norms, "is_weight": is_weights,
            "clipped": clipped}


@torch.no_grad()
def frozen_logprobs(model, batch, micro_batch_size, temperature, pad_id, dtype="float32"):
    """The no-grad pass of pi_b (the policy before any step) or pi_ref (the initial policy):
    N FloatTensors [L] on CPU, zero past the row's micro-batch width (masked)."""
    out, full = [None] * len(batch["prompt_ids"]), batch["completion_ids"].shape[1]
    device = next(model.parameters()).device
    for rows in micro_batches(range(len(out)), micro_batch_size):
        # eval mode: pi_b and pi_ref are the policies' probabilities, dropout (LoRA's) off
        with rollout.autocast(dtype, device.type), rollout.eval_mode(model):
            lp, width = rows_logprobs(model, batch, rows, temperature, pad_id)
        for i, row in zip(rows, lp.float().cpu()):
            out[i] = torch.nn.functional.pad(row, (0, full - width))
    return out


def rows_logprobs(model, batch, rows, temperature, pad_id):
    """(log-probs [len(rows), width], width): `rows`' completions up to their longest one."""
    width = max(1, int(batch["completion_mask"][rows].sum(-1).max()))
    return rollout.completion_logprobs(model, [batch["prompt_ids"][i] for i in rows],
                                       batch["completion_ids"][rows, :width], pad_id,
                                       temperature=temperature), width


def micro_batches(rows, size):  # consecutive chunks of `size` row indices
    return [list(rows)[s:s + size] for s in range(0, len(rows), size)]


def loss_normaliser(aggregation, num_seqs, num_tokens, max_new_tokens):
    """The one global divisor of an optimizer step (docs/method.md §4.4): sequences (RLME Eq. 8,
    RM-NLHF Eq. 3's 1/G), tokens for token_mean, sequences x max_new_tokens for Dr.GRPO."""
    return {"seq_sum": num_seqs, "seq_mean_token_mean": num_seqs,
            "micro_batch_token_mean": num_seqs, "token_mean": num_tokens,
            "dr_grpo": num_seqs * max_new_tokens}[aggregation]


def cispo_loss(logp, behaviour_logp, advantages, mask, *, eps_low, eps_high, ratio="sequence",
               aggregation="seq_sum"):
    """Sum over this micro-batch of CISPO's per-token loss (RLME Eq. 6-8, MiniMax-M1); the caller
    divides by loss_normaliser's global count, so the update equals one big batch's:

        L = -sum_i sg(clip(rho_i, 1 - eps_low, 1 + eps_high)) A_i sum_t log pi(y_it)      (Eq. 8)
        rho_i = exp(sum_t [log pi(y_it) - log pi_b(y_it)])                               (Eq. 6)
    ratio "geometric_mean": the GSPO per-token mean. rho_i is clipped in LOG space, then
    DETACHED: every sample keeps its gradient -sg(rho_hat_i) A_i grad sum_t log pi.
    logp: FloatTensor [B, L] with grad; behaviour_logp: [B, L] or None (on-policy: ratio 1);
    advantages [B]; mask [B, L]. Returns (loss_sum, {"is_weight" [B], "clipped" BoolTensor [B]}).
    """
    old = logp.detach() if behaviour_logp is None else behaviour_logp
    seq_log_ratio = ((logp.detach() - old) * mask).sum(-1)  # [B]
    if ratio == "geometric_mean":
        seq_log_ratio = seq_log_ratio / mask.sum(-1).clamp(min=1)
    lo = math.log(1 - eps_low) if eps_low < 1 else -float("inf")
    hi = math.log(1 + eps_high)
    weight = seq_log_ratio.clamp(lo, hi).exp()  # already detached
    per_token = -(weight * advantages)[:, None] * logp
    stats = {"is_weight": seq_log_ratio.clamp(max=80).exp(),
             "clipped": (seq_log_ratio < lo) | (seq_log_ratio > hi)}
    return aggregate(per_token, mask, aggregation), stats


def grpo_loss(logp, behaviour_logp, advantages, mask, *, clip_eps, kl_coef=0.0, ref_logp=None,
              aggregation="seq_mean_token_mean"):
    """Sum over this micro-batch of GRPO's per-token loss (RM-NLHF Eq. 3; docs/method.md §4.5):
        L = sum_i sum_t -min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i) + beta k3_it,
        r_it = pi(y_it) / pi_b(y_it)  (the token ratio; A_i from RM-NLHF Eq. 1-2)
    Arguments as cispo_loss's, plus ref_logp ([B, L] pi_ref's, or None: no KL). Returns (loss_sum,
    {"is_weight": token-mean ratio [B], "clipped": share of clipped tokens [B]})."""
    old = logp.detach() if behaviour_logp is None else behaviour_logp
    # the log ratio clamped at +-20 so exp cannot overflow (PPO clips such a ratio anyway)
    ratio = ((logp - old) * mask).clamp(-20, 20).exp()
    a = advantages[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    if kl_coef > 0 and ref_logp is not None:
        per_token = per_token + kl_coef * k3_kl(logp, ref_logp)
    n = mask.sum(-1).clamp(min=1)
    stats = {"is_weight": (ratio.detach() * mask).sum(-1) / n,
             "clipped": ((ratio.detach() - 1).abs() > clip_eps).float().mul(mask).sum(-1) / n}
    return aggregate(per_token, mask, aggregation), stats


def aggregate(per_token, mask, aggregation):
    """Sum of the masked per-token losses [B, L]: seq_mean_token_mean takes each sequence's token
    mean first (RM-NLHF Eq. 3's 1/|y_i|); micro_batch_token_mean is the micro-batch's token mean x
    its sequence count (verl 0.4.1's token-mean under use_dynamic_bsz: the RM-NLHF release)."""
    per_token = per_token * mask
    if aggregation == "seq_mean_token_mean":
        per_token = per_token / mask.sum(-1, keepdim=True).clamp(min=1)
    if aggregation == "micro_batch_token_mean":
        return per_token.sum() * (mask.sum(-1) > 0).sum() / mask.sum().clamp(min=1)
    return per_token.sum()


def k3_kl(logp, ref_logp):
    """The k3 KL estimator per token, >= 0 (docs/method.md §4.5), the shape of logp."""
    d = ref_logp - logp
    return d.exp() - d - 1


# ---- 6. The metrics line, samples.jsonl, TensorBoard, the progress bar ---------------------------


def step_metrics(state, records, upd, reward_metrics, times, *, group_size, steps, nlhf):
    """The step's metrics.jsonl line (docs/method.md §9), from every rank's records (collectives).
    Returns (metrics, all records) on rank 0, else Nones."""
    world, G, dev = state["world"], group_size, state["device"]
    records, loss = gather_records(records, world), all_sum(upd["loss"], world)
    skipped = sum(not math.isfinite(g) for g in upd["grad_norms"])  # a non-finite norm: skipped
    if state["rank"] != 0:
        return None, None
    # reward None: a failed judge call / remote evaluator; no known reward: no mean (never 0.0)
    known = [r["reward"] for r in records if r["reward"] is not None]
    rew = torch.tensor(known) if known else None
    lens = torch.tensor([r["length"] for r in records], dtype=torch.float)
    groups = [{r["reward"] for r in records[g:g + G] if r["reward"] is not None}
              for g in range(0, len(records), G)]
    n, labelled = len(records), [r["correct"] for r in records if r["correct"] is not None]
    metrics = {
        "step": records[0]["step"], "reward/mean": rew.mean().item() if known else None,
        "reward/std": rew.std(unbiased=False).item() if known else None,
        "accuracy": sum(labelled) / len(labelled) if labelled else None,
        "advantage/abs_mean": sum(abs(r["advantage"]) for r in records) / n,
        "groups/zero_variance_frac": sum(len(g) <= 1 for g in groups) / len(groups),
        "completion/length_mean": lens.mean().item(), "completion/length_max": lens.max().item(),
        # characters: the unit of the conciseness question (secondary notes: docs/method.md §10)
        "completion/chars_mean": sum(len(r["completion"]) for r in records) / n,
        "completion/truncated_frac": sum(r["truncated"] for r in records) / n,
        "is_weight/mean": sum(r["importance_weight"] for r in records) / n,
        "is_weight/max": max(r["importance_weight"] for r in records),
        "is_weight/clip_frac": sum(r["clipped"] for r in records) / n,
        "loss": loss / steps, "grad_norm": sum(upd["grad_norms"]) / len(upd["grad_norms"]),
        "update/skipped_steps": skipped, "lr": state["scheduler"].get_last_lr()[0],
        **{f"time/{k}": v for k, v in times.items()}, "time/step": sum(times.values()),
        "rollout/tokens_per_s": sum(r["length"] for r in records) / max(times["rollout"], 1e-9),
        "memory/peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **reward_metrics}  # KB
    if nlhf:
        metrics.update(R.nlhf_step_metrics(records, reward_metrics))
    else:  # the RLVR reward, boxed answers, each evaluator's log p and p per meta-question
        metrics["rlvr_reward/mean"] = sum(r["rlvr_reward"] for r in records) / n
        metrics["completion/boxed_frac"] = sum(bool(r["extracted"]) for r in records) / n
        if "logp" in records[0]:  # None: a remote evaluator's failed request, left out
            rl = [r["rlme_reward"] for r in records if r["rlme_reward"] is not None]
            metrics["rlme_reward/mean"] = sum(rl) / len(rl) if rl else None
            for name, questions in records[0]["logp"].items():  # evaluators x meta-questions
                for q in questions:
                    v = torch.tensor([x for r in records if (x := r["logp"][name][q]) is not None])
                    metrics[R.logp_metric_name(name, q)] = v.mean().item() if len(v) else None
                    metrics[f"rlme/{name}/{q}/p"] = v.exp().mean().item() if len(v) else None
    return metrics, records


def log_step(state, metrics, records, *, out_dir):
    """Rank 0: metrics.jsonl (NaN / inf as null), samples.jsonl, TensorBoard, the progress bar."""
    if metrics is None:
        return
    training = "reward/mean" in metrics  # step 0's validation line has no reward
    if training:  # the MetaRM cold start's counts join the first step's line
        metrics = {**metrics, **state.pop("first_metrics", {})}
    metrics = finite(metrics)
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    with open(os.path.join(out_dir, "samples.jsonl"), "a") as f:
        f.writelines(json.dumps(finite(r)) + "\n" for r in records)
    if state["writer"] is not None:  # numbers (a bool as 0/1); None is not plotted
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)):
                state["writer"].add_scalar(k, float(v), metrics["step"])
        state["writer"].flush()  # a crash loses no logged step
    if training:
        r = metrics["reward/mean"]
        if r is not None:  # for the reward-hacking monitor
            state["rewards_since_eval"].append(r)
        state["bar"].set_postfix(reward="masked" if r is None else f"{r:.3f}",
                                 s=f"{metrics['time/step']:.0f}", refresh=False)
        state["bar"].update(1)


def finite(x):
    """x with every NaN / inf float replaced by None (JSON null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x


# ---- 7. Validation, the reward-hacking monitor, the early stop (docs/method.md §4.6) -------


def validate(state, step, records, *, task, reward, template, numeric, max_new_tokens, chunk,
             style, max_lines, max_chars, max_prompt_tokens, seed):
    """Held-out validation (every rank; collectives). RLME: greedy answers graded as `evaluate.py
    math` does, their reward, the canaries', the AUROC of the step's rewards. RM-NLHF: the GRM's
    pairwise accuracy, both A/B orders (Figs. 3, 6), at T 0.6 in calls of <= `chunk` rows on every
    rank. Returns val/* (alike on every rank), step."""
    t0, world, rank = time.perf_counter(), state["world"], state["rank"]
    total, val = (lambda x: all_sum(x, world)), state["val_items"]  # noqa: E731
    mine = val[rank::world]
    if task == "rlme":
        inject = "{answer}" in template  # NoCheat: a seeded WRONG answer is shown
        prompts = [rollout.policy_prompt_ids(state["tokenizer"], val[k], state["chat"], template,
                                             answer=evaluate.wrong_answer(val, k) if inject
                                             else None) for k in range(rank, len(val), world)]
        greedy = sample(state, prompts, group_size=1, max_new_tokens=max_new_tokens,
                        temperature=0.0, seed=0)
        rew = reward(mine, greedy["completions"])
        few = mine[:max(1, 8 // world)]
        canaries = {name: reward(few, [text] * len(few))
                    for name, text in evaluate.CANARIES.items()}
        out = evaluate.rlme_val_metrics(rew, greedy["completions"], canaries, injected=inject,
                                        numeric=numeric, all_sum=total)
        out.update(evaluate.val_auroc(gather_records(records, world)))
    else:
        calls = []

        def generate(model, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0,
                     top_p=1.0, top_k=0, seed=0, micro_batch_size=0):
            calls.append(len(prompt_ids))  # rollout.generate's signature, through the engine
            return sample(state, prompt_ids, group_size=group_size, temperature=temperature,
                          max_new_tokens=max_new_tokens, top_p=top_p, top_k=top_k, seed=seed)

        judge = evaluate.make_grm_judge(
            state["policy"], state["tokenizer"], max_new_tokens=max_new_tokens, batch_size=chunk,
            chat=state["chat"], style=style, generate=generate, max_prompt_tokens=max_prompt_tokens,
            temperature=0.6, top_p=1.0, seed=seed * 1_000_003 + 7_919 * step + rank,
            max_lines=max_lines, max_chars=max_chars)
        pairs = evaluate.pairwise_accuracy(mine, judge)[1] if mine else []
        for _ in range(-(-2 * -(-len(val) // world) // chunk) - len(calls)):  # rank 0's count
            generate(None, None, [], 1, 1)
        out = evaluate.nlhf_val_metrics(pairs, all_sum=total)
    took = all_sum(time.perf_counter() - t0, world, op=dist.ReduceOp.MAX)
    return {**out, "val/seconds": took, "step": step}


def watch(state, val, metrics, *, out_dir, drop, patience):
    """The reward-hacking monitor (the training reward rose while held-out accuracy fell) and the
    early stop (accuracy > `drop` below its best for `patience` evaluations; True: stop)."""
    hist, acc = state["history"], evaluate.held_out_accuracy(val)
    since, state["rewards_since_eval"] = state["rewards_since_eval"], []
    warning = evaluate.monitor(hist, val["step"], acc, sum(since) / len(since) if (
        metrics is not None and since) else None)
    if warning and state["bar"] is not None:
        state["bar"].write(warning)
    stop = bool(patience) and evaluate.early_stop([h["accuracy"] for h in hist], drop, patience)
    if stop and state["rank"] == 0:
        best = max(hist, key=lambda h: h["accuracy"])
        with open(os.path.join(out_dir, "early_stop.json"), "w") as f:
            json.dump({"step": val["step"], "accuracy": acc, "best_accuracy": best["accuracy"],
                       "best_step": best["step"]}, f, indent=1)
        print(f"[train] early stop at step {val['step']}: held-out accuracy {acc:.3f}, more than "
              f"{drop} below its best ({best['accuracy']:.3f}, step {best['step']}) for "
              f"{patience} evaluations", flush=True)
    return stop


# ---- Setup: the run's models and data, from the config (read here, once) -------------------------


def setup(cfg):
    """Everything the loop needs, one dict, or None when run.out_dir holds a finished run."""
    tc, m, run = cfg["train"], cfg["model"], cfg["run"]
    rank, world, device = setup_process_group(tc["device"], tc["parallel"])
    lock, out_dir = lock_run(run["out_dir"], rank), run["out_dir"]
    ckpt = latest_checkpoint(out_dir, rank)
    start = int(ckpt.rsplit("_", 1)[1]) if ckpt else 0
    stopped = os.path.join(out_dir, "early_stop.json")
    if ckpt and (start >= run["total_steps"] or os.path.exists(stopped)):
        if rank == 0:
            print(f"[train] {out_dir}: " + (f"stopped early ({stopped}; delete it to train on)"
                                            if os.path.exists(stopped) else f"complete at step "
                                            f"{start} (raise run.total_steps to train on)"))
        return finish({"lock": lock, "bar": None, "writer": None})
    fsdp2, nl, rw = tc["parallel"] == "fsdp2", cfg["nlhf"], cfg["reward"]
    policy, tok = rollout.load_model(ckpt if ckpt and not m["lora"] else m["policy"],  # LoRA: base
                                     "float32", "cpu" if fsdp2 else device)
    if m["lora"]:  # the adapters: fresh, or the checkpoint's
        policy = apply_lora(policy, m["lora"], seed=run["seed"], ckpt=ckpt)
    model = wrap_policy(policy, tc["parallel"], world, device, m["dtype"],  # FSDP2: in place
                        m["gradient_checkpointing"])
    chat = rollout.use_chat_template(tok, m["chat_template"], m["policy"])
    state = {"rank": rank, "world": world, "device": device, "dtype": m["dtype"], "lock": lock,
             "start_step": start, "policy": policy, "model": model, "tokenizer": tok, "chat": chat,
             "history": [], "rewards_since_eval": [], "bar": None, "writer": None, "mrm": None,
             "engine": None, "generate_batch": cfg["rollout"]["micro_batch_size"],
             "prompt": lambda it: R.grm_prompt_ids(  # 1. item -> its prompt ids (RM-NLHF, RLME)
                 tok, it, chat, max_lines=nl["max_critique_lines"], style=nl["grm_prompt"])
             if cfg["task"] == "rm_nlhf" else rollout.policy_prompt_ids(
                 tok, it, chat, cfg["data"]["prompt_template"])}
    judging = dict(  # RM-NLHF's judged reward (Eq. 4-5), in the loop and the MetaRM cold start
        lam=nl["lam"], threshold=nl["threshold"], inclusive=nl["threshold_rule"] == "inclusive",
        similarity=nl["similarity"], gate_on_outcome=nl["gate_on_outcome"],
        on_failure=cfg["judge"]["on_failure"], max_lines=nl["max_critique_lines"],
        max_chars=nl["max_critique_chars"], style=nl["grm_prompt"])
    load_data(state, cfg)
    load_models(state, cfg, ckpt, judging)
    if cfg["task"] == "rm_nlhf":  # (items, completions, step, t0) -> rewards (Algorithm 1)
        state["reward"] = lambda items, completions, step, t0: metarm.nlhf_reward_step(
            items, completions, judge=state["judge"], mrm=state["mrm"], form=nl["do_reward"],
            mode=cfg["metarm"]["mode"], train_on_do=cfg["metarm"]["train_on_do"],
            seed=run["seed"] * 7_919 + step, t0=t0, **judging)
    else:  # (items, completions) -> rewards (RLME Eq. 2-3)
        state["reward"] = lambda items, completions, step=0, t0=0: rlme_reward_step(
            state, items, completions, meta_questions=rw["meta_questions"], kind=rw["kind"],
            label_format=cfg["data"]["label_format"], qa_metric=rw["qa_metric"],
            rlvr_weight=rw["rlvr_weight"], renormalize=rw["renormalize"],
            transform=rw["transform"])
    open_run(state, cfg)
    return state


def load_data(state, cfg):
    """RLME's problems or RM-NLHF's D_H, D_O pairs (and judge), held-out ones; long prompts out."""
    d, ro, nl, seed = cfg["data"], cfg["rollout"], cfg["nlhf"], cfg["run"]["seed"]
    context = getattr(state["policy"].config, "max_position_embeddings", None) or 10 ** 9
    limit = ro["max_prompt_tokens"] or context - ro["max_new_tokens"]
    short = lambda items: [it for it in items if len(state["prompt"](it)) <= limit]  # noqa: E731
    if cfg["task"] == "rm_nlhf":
        judge = {k: v for k, v in cfg["judge"].items() if k != "on_failure"}
        state["judge"] = R.make_judge(  # λ = 0: never called; ends before the ranks' collective
            **judge, deadline_s=COLLECTIVE_TIMEOUT_S / 2) if nl["lam"] > 0 else None
        dh, do, note = data.load_nlhf_items(nl["dh"], nl["do"], seed=seed,
                                            split_dh_fraction=nl["split_dh_fraction"])
        state["dh"], state["do"], state["val_items"] = short(dh), short(do), []
        if d["val"]:  # a holdout comes from the D_H pairs that fit
            val, state["dh"] = data.load_nlhf_val_items(d["val"], state["dh"], size=d["val_size"],
                                                        seed=seed, config=d["val_config"],
                                                        split=d["val_split"])
            state["val_items"] = short(val)
        if note and state["rank"] == 0:
            print(f"[train] {note}", flush=True)
        n = len(state["dh"]) + len(state["do"])
    else:
        items, val = data.load_rlme_items(
            d["train"], d["val"], train_config=d["train_config"], val_config=d["val_config"],
            val_split=d["val_split"], val_size=d["val_size"], seed=seed,
            anchor_fraction=cfg["reward"]["anchor_fraction"], question_field=d["question_field"],
            answer_field=d["answer_field"], label_format=d["label_format"],
            context_field=d["context_field"],
            **{k: d[k] for k in ["context_max_chars"] if k in d})  # config.yaml may hold it
        state["items"], state["val_items"] = short(items), short(val)
        n = len(state["items"])
    if not n:
        raise SystemExit(f"config key rollout.max_prompt_tokens: every prompt is over {limit}")
    need = cfg["run"]["total_steps"] * ro["prompts_per_step"]
    if d["epochs"] and need > d["epochs"] * n:  # RLME §4.1: one pass over the data
        raise SystemExit(f"config key run.total_steps: {need} prompts are more than data.epochs="
                         f"{d['epochs']} pass(es) over {n} items")


def load_models(state, cfg, ckpt, judging):
    """The rollout engine, the evaluators, the GRPO reference, AdamW, its schedule, the MetaRM."""
    m, ro, rw, o, algo = cfg["model"], cfg["rollout"], cfg["reward"], cfg["optim"], cfg["algo"]
    policy, device, rank, world = state["policy"], state["device"], state["rank"], state["world"]
    if ro["backend"] == "vllm":  # from the policy's own weights (the checkpoint's on resume)
        state["engine"] = rollout.make_vllm_engine(
            ckpt or m["policy"], dtype=m["dtype"],
            seed=(cfg["run"]["seed"] * 1_000_003 + rank) % 2 ** 32,
            gpu_memory_utilization=ro["vllm_gpu_memory_utilization"],
            max_model_len=ro["vllm_max_model_len"])
    # RLME Eq. 2-3's evaluator prompt: null = the default, "qa" = context QA's, else a string
    state["template"] = R.check_evaluator_template({
        None: R.DEFAULT_EVALUATOR_TEMPLATE, "qa": R.QA_EVALUATOR_TEMPLATE}.get(
        rw["evaluator_template"], rw["evaluator_template"]))
    state["evaluators"] = [make_evaluator(
        ev, policy=policy, tokenizer=state["tokenizer"], device=device, dtype=m["dtype"],
        lora=m["lora"], policy_path=m["policy"], chat_template=m["chat_template"],
        micro_batch_size=rw["micro_batch_size"]) for ev in rw["evaluators"]
    ] if cfg["task"] == "rlme" and rw["kind"] != "rlvr" else []
    state["ref_model"] = None  # GRPO's pi_ref: the initial policy, frozen
    if algo["loss"] == "grpo" and algo["kl_coef"] > 0 and m["lora"]:
        state["ref_model"] = BaseModelView(policy)  # the policy with its adapters off
    elif algo["loss"] == "grpo" and algo["kl_coef"] > 0:  # FSDP2: 1/world of it a rank
        fsdp2 = cfg["train"]["parallel"] == "fsdp2"
        ref = rollout.load_model(m["policy"], m["dtype"], "cpu" if fsdp2 else device)[0]
        state["ref_model"] = ref.eval().requires_grad_(False)
        if fsdp2:
            state["ref_model"] = fully_shard_layers(ref, device, world)
    # AdamW over what trains (LoRA: the adapters); fused: one kernel over all parameters
    state["optimizer"] = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],
                                           lr=o["lr"], weight_decay=o["weight_decay"], fused=True)
    state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, then constant
        state["optimizer"], lr_lambda(o["warmup_steps"]))
    if ckpt:
        state["start_step"] = load_checkpoint(ckpt, policy, state["optimizer"],
                                              state["scheduler"], rank)
    if cfg["task"] != "rm_nlhf":
        return
    # RM-NLHF's MetaRM (§3.2): the checkpoint's, a saved <out_dir>/metarm, or a fresh head
    # cold-started on D_H (Algorithm 1 lines 2-10, App. G.3); FSDP2 shards it like the policy
    mc, run, j = cfg["metarm"], cfg["run"], cfg["judge"]
    state["mrm"], _, stats = metarm.setup_metarm(
        ckpt, mode=mc["mode"], out_dir=run["out_dir"], model_path=m["policy"], seed=run["seed"],
        dtype=mc["dtype"], device=device, wrap=None if cfg["train"]["parallel"] != "fsdp2"
        or world == 1 else lambda model: wrap_policy(model, "fsdp2", world, device, mc["dtype"]),
        **{k: mc[k] for k in ("gradient_checkpointing", "batch_size", "max_length", "online_lr",
                              "online_epochs", "online_batch_size")},
        items=state["dh"][:mc["cold_start_items"] or None], prompt=state["prompt"],
        sample=lambda ids, **kw: sample(state, ids, **kw), judge=state["judge"],
        identity={"model.policy": m["policy"], "model.dtype": m["dtype"],
                  "judge": [j[k] for k in ("backend", "model", "variant")]},
        rollouts_per_prompt=mc["rollouts_per_prompt"], max_new_tokens=ro["max_new_tokens"],
        temperature=ro["temperature"], epochs=mc["epochs"], lr=1e-5, rank=rank, world=world,
        micro_batch_size=cfg["train"]["micro_batch_size"], **judging)
    if stats is not None and rank == 0:  # the cold start's counts: the first step's line
        state["first_metrics"] = metarm.record_cold_start(run["out_dir"], stats,
                                                          mc["rollouts_per_prompt"])


def make_evaluator(ev, *, policy, tokenizer, device, dtype, lora, policy_path, chat_template,
                   micro_batch_size):
    """A reward.evaluators item (RLME Eq. 2-3's pi_phi_j, weight v_j): live (the policy),
    frozen_self (the initial policy), frozen (the model at `path`), remote (a server)."""
    kind, path = ev["kind"], ev["path"] or policy_path
    own = kind == "frozen" or ev["chat_template"] != "auto"
    template = dict(system=ev["system_prompt"], kwargs=ev["chat_template_kwargs"])
    if kind == "remote":
        from transformers import AutoTokenizer
        tok = ev["path"] and AutoTokenizer.from_pretrained(rollout.resolve_model_path(path))
        # no path: plain text + "\nAnswer:"; a path: the served model's tokenizer and template
        settings = ("api_key_env", "timeout_s", "max_retries", "concurrency")  # else reward's
        return R.remote_evaluator(
            ev["base_url"], ev["model"], name=ev["name"], weight=ev["weight"],
            tokenizer=tok or None, chat=bool(tok) and rollout.use_chat_template(
                tok, ev["chat_template"], path, **template),
            **{k: ev[k] for k in settings if k in ev})
    model, tok = policy, tokenizer
    if kind == "frozen_self" and lora:
        model = BaseModelView(model)
    elif kind != "live":
        model, tok = rollout.load_model(path, dtype, device)
    chat = rollout.use_chat_template(tok, ev["chat_template"] if own else chat_template, path,
                                     **template)
    return R.local_evaluator(model, tok, chat=chat, name=ev["name"], weight=ev["weight"],
                             micro_batch_size=micro_batch_size, frozen=kind != "live")


def open_run(state, cfg):
    """The run folder: the config, logs cut back to the resume point, TensorBoard, the bar."""
    run, start, out_dir = cfg["run"], state["start_step"], cfg["run"]["out_dir"]
    if state["rank"] == 0:
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        for name in ("metrics.jsonl", "samples.jsonl", "early_stop.json"):
            path = os.path.join(out_dir, name)
            if start and name != "early_stop.json":
                truncate_jsonl(path, start)
            elif not start and os.path.exists(path):  # a fresh run over an old folder
                os.remove(path)
        if run["tensorboard"]:  # purge_step: a killed run's steps past its checkpoint go
            from torch.utils.tensorboard import SummaryWriter
            state["writer"] = SummaryWriter(os.path.join(out_dir, "tensorboard"),
                                            purge_step=start + 1)
        n = (f"D_H {len(state['dh'])} + D_O {len(state['do'])} pairs" if cfg["task"] == "rm_nlhf"
             else f"{len(state['items'])} items")
        print(f"[train] {cfg['task']} | {n} | policy {cfg['model']['policy']} | world "
              f"{state['world']} | " + (f"resuming at step {start}" if start else "fresh start"))
        state["bar"] = tqdm(total=run["total_steps"], initial=start, desc="train",
                            dynamic_ncols=True)
    if state["world"] > 1:
        torch.distributed.barrier()  # the logs are cut before any rank reads them
    if start and run["eval_every"]:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            for line in map(json.loads, f):
                if (acc := evaluate.held_out_accuracy(line)) is not None:
                    evaluate.monitor(state["history"], line["step"], acc, None)


def finish(state):
    """Close the progress bar, TensorBoard, the run lock and the process group."""
    for closable in (state["bar"], state["writer"], state["lock"]):
        if closable is not None:
            closable.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ==== Config: config.yaml is the schema and the defaults; presets and key=value overrides layer on
# top. An unknown key or a value unlike its default's type stops with one line (docs/config.md).

CHOICES = {
    "task": ["rlme", "rm_nlhf"], "model.dtype": ["float32", "bfloat16"],
    "model.chat_template": ["auto", True, False], "model.gradient_checkpointing": ["none", "full"],
    "data.label_format": ["gsm8k", "plain", "text"], "rollout.backend": ["hf", "vllm"],
    "reward.kind": ["rlme", "rlvr", "hybrid"], "reward.transform": ["log", "prob"],
    "reward.qa_metric": ["em", "f1"], "algo.loss": ["cispo", "grpo"],
    "algo.ratio": ["sequence", "geometric_mean"], "algo.aggregation": [
        "seq_sum", "seq_mean_token_mean", "token_mean", "micro_batch_token_mean", "dr_grpo"],
    "nlhf.threshold_rule": ["strict", "inclusive"], "nlhf.grm_prompt": ["ours", "authors"],
    "nlhf.similarity": ["f1", "precision", "recall"], "nlhf.do_reward": ["paper", "released"],
    "judge.backend": ["openai", "proxy"], "judge.variant": list(R.JUDGE_VARIANTS),
    "judge.on_failure": ["mask", "zero"], "metarm.mode": [
        "none", "offline", "online", "metarm_only", "binary", "binary_retrain", "classifier"],
    "metarm.dtype": ["float32", "bfloat16", "float16"], "train.parallel": ["ddp", "fsdp2"],
    "train.device": ["auto", "cpu", "cuda"]}
NULLABLE = {"data.answer_field", "nlhf.do", "judge.temperature", "judge.max_tokens"}  # null: off
OPT, ANY = (str, type(None)), (dict, type(None))
ITEMS = {  # a list item's fields: (types, default); no default: the field may be left out
    "reward.evaluators": dict(
        kind=(str, "live"), name=(str,), weight=(float, 1.0), path=(OPT, None),
        chat_template=((str, bool), "auto"), chat_template_kwargs=(ANY, None),
        system_prompt=(OPT, None), base_url=(str,), model=(str,), api_key_env=(OPT,),
        timeout_s=(float,), max_retries=(int,), concurrency=(int,)),
    "reward.meta_questions": dict(question=(str,), weight=(float, 1.0), target=(str, "Yes"),
                                  negative=(str, "No")),
    "model.lora": dict(r=(int,), alpha=(float,), dropout=(float, 0.0),
                       target_modules=((list, str),))}


def _keys(d, prefix=""):
    """Every dotted leaf key of a nested dict."""
    for k, v in d.items():
        yield from _keys(v, prefix + k + ".") if isinstance(v, dict) and v else [prefix + k]


def _type_ok(value, t):
    """isinstance, except: a bool is no number, an int is a float, nan/inf is no value at all."""
    t = t if isinstance(t, tuple) else (t,)
    if isinstance(value, float) and not math.isfinite(value):
        return False  # a NaN lr or weight would train on silently wrong numbers
    return bool in t if isinstance(value, bool) else isinstance(value, t) or (
        float in t and isinstance(value, int))


def _merge(base, new, where, known, prefix=""):
    """Deep-merge `new` into `base` in place; one-line SystemExit on an unknown key or wrong type.
    A non-empty mapping is a section; a null or {} default takes any value (replaced whole)."""
    if not isinstance(new, dict):
        what = f"config key {prefix[:-1]}:" if prefix else "the file"
        raise SystemExit(f"{where}: {what} must be a mapping, got {new!r}")
    for k, v in new.items():
        key, default = prefix + k, base.get(k, KeyError)
        if default is KeyError:  # the nearest name, or the same name in another section
            near = ([n for n in known if n.split(".")[-1] == k]
                    or difflib.get_close_matches(key, known, n=1) or [None])[0]
            raise SystemExit(f"{where}: unknown config key {key}"
                             + (f" (did you mean {near}?)" if near else ""))
        if isinstance(default, dict) and default:
            _merge(default, v, where, known, key + ".")
            continue
        if isinstance(default, float) and isinstance(v, str):  # YAML 1.1 reads 3e-6 as a string
            try:
                v = float(v)
            except ValueError:
                pass
        if not (default is None or (v is None and key in NULLABLE) or (
                any(type(v) is type(c) and v == c for c in CHOICES[key]) if key in CHOICES
                else _type_ok(v, type(default)))):
            want = f"one of {CHOICES[key]}" if key in CHOICES else type(default).__name__
            raise SystemExit(f"{where}: config key {key}: expected {want}, got {v!r}")
        base[k] = float(v) if isinstance(default, float) and isinstance(v, int) else v


def _read_yaml(path):
    try:
        with open(path, "rb") as f:
            return yaml.safe_load(f) or {}
    except OSError as e:
        raise SystemExit(f"config file {path}: {e.strerror}")
    except yaml.YAMLError as e:
        at = f" at line {e.problem_mark.line + 1}" if getattr(e, "problem_mark", None) else ""
        raise SystemExit(f"config file {path}: invalid YAML{at}: {getattr(e, 'problem', e)}")


def load_config(paths, overrides=(), schema_path=os.path.join(HERE, "config.yaml")):
    """config.yaml, then each preset in `paths`, then `key.sub=value` overrides (typed by YAML):
    the nested dict, or SystemExit (one line) on a missing file, bad YAML, bad key or value."""
    cfg = _read_yaml(schema_path)
    known, layers = list(_keys(cfg)), [(_read_yaml(p), f"config file {p}") for p in paths
                                       if os.path.abspath(p) != os.path.abspath(schema_path)]
    for o in overrides:
        key, eq, val = o.partition("=")
        if not eq or not key:
            raise SystemExit(f"override {o!r}: expected key.sub=value (files go after --config)")
        try:
            value = yaml.safe_load(val)
        except yaml.YAMLError:
            raise SystemExit(f"override {o!r}: the value is not valid YAML (quote it)")
        for part in reversed(key.split(".")):
            value = {part: value}
        layers.append((value, f"override {o!r}"))
    for new, where in layers:
        _merge(cfg, new, where, known)
    _check(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    return cfg


def _check(cfg, world):
    """List items (fields, types, defaults), the few rules across keys."""
    for key, fields in ITEMS.items():
        sec, name = key.split(".")
        items = [cfg[sec][name]] if key == "model.lora" and cfg[sec][name] else cfg[sec][name]
        if key != "model.lora" and (not isinstance(items, list) or not items):
            raise SystemExit(f"config key {key}: expected a non-empty list")
        for i, item in enumerate(items or []):
            where = key if key == "model.lora" else f"{key}[{i}]"
            for f, v in item.items() if isinstance(item, dict) else [("", item)]:
                near = difflib.get_close_matches(f, list(fields), n=1)
                if f not in fields or not _type_ok(v, fields[f][0]):
                    raise SystemExit(f"config key {where}.{f}: " + (
                        f"bad value {v!r}" if f in fields else "unknown"
                        + (f" (did you mean {near[0]}?)" if near else "")))
            item.update({f: s[1] for f, s in fields.items() if len(s) > 1 and f not in item})
    ro, a, nl, run, d, rw = (cfg[k] for k in ("rollout", "algo", "nlhf", "run", "data", "reward"))
    for i, ev in enumerate(rw["evaluators"]):
        ev.setdefault("name", f"{ev['kind']}{i}")
    n, par, lora, names = (ro["prompts_per_step"] // world, cfg["train"]["parallel"],
                           cfg["model"]["lora"], [ev["name"] for ev in rw["evaluators"]])
    fields = {f for _, f, _, _ in string.Formatter().parse(d["prompt_template"]) if f}
    zero = cfg["task"] == "rlme" and rw["kind"] != "rlvr" and any(
        all(x["weight"] == 0 for x in rw[k]) for k in ("evaluators", "meta_questions"))
    need = {"live": (), "frozen_self": (), "frozen": ("path",), "remote": ("base_url", "model")}
    for bad, msg in [  # (broken, "key: what it needs")
            *[(cfg[k.split(".")[0]][k.split(".")[1]] < 1, f"{k}: must be >= 1") for k in (
                "rollout.prompts_per_step", "rollout.max_new_tokens", "train.micro_batch_size",
                "algo.updates_per_batch", "algo.minibatches", "run.total_steps",
                "run.keep_checkpoints")],
            *[(not all(ev.get(f) for f in need.get(ev["kind"], [None])),
               f"reward.evaluators[{i}]: kind must be live, frozen_self, frozen (needs path) or "
               "remote (needs base_url, model)") for i, ev in enumerate(rw["evaluators"])],
            (len(set(names)) != len(names), f"reward.evaluators: names must be unique: {names}"),
            (not all(q.get("question") and q["target"].strip() and q["negative"].strip()
                     for q in rw["meta_questions"]),
             "reward.meta_questions: each needs a question, a target, a negative"),
            (lora and not (lora["dropout"] < 1 and min(lora.get("r", 0), lora.get("alpha", 0)) > 0
                           and lora.get("target_modules")),
             "model.lora: needs r > 0, alpha > 0, target_modules (names or all-linear); dropout "
             "in [0, 1)"),
            (not cfg["optim"]["lr"] > 0 or min(cfg["optim"][k] for k in (
                "weight_decay", "grad_clip", "warmup_steps")) < 0,
             "optim: lr > 0; weight_decay, grad_clip, warmup_steps >= 0"),
            (min(cfg["metarm"][k] for k in ("batch_size", "online_batch_size")) < 0,
             "metarm.batch_size / online_batch_size: must be >= 0 (0 = all)"),
            (not all(0 <= nl[k] <= 1 for k in ("dh_per_step", "lam", "threshold")),
             "nlhf.dh_per_step / lam / threshold: must be in [0, 1]"),
            (ro["group_size"] < 2, "rollout.group_size: must be >= 2 (A = r - mean(group))"),
            (ro["prompts_per_step"] % world, f"rollout.prompts_per_step: not divisible by {world}"),
            (n % a["minibatches"], f"algo.minibatches: must divide the {n} groups of a rank"),
            (a["loss"] == "cispo" and a["kl_coef"] > 0, "algo.kl_coef: needs algo.loss grpo"),
            (ro["temperature"] <= 0 or not 0 < ro["top_p"] <= 1, "rollout.temperature / top_p: "
                                                                 "> 0 / in (0, 1]"),
            (zero, "reward.evaluators / meta_questions: every weight is 0 (RLME Eq. 3: no reward)"),
            (d["answer_field"] is None and rw["kind"] != "rlme", "reward.kind: needs labels"),
            ("question" not in fields or fields - {"question", "context", "answer"},
             "data.prompt_template: needs {question}; may hold {context}, {answer}"),
            (lora and par != "ddp", "model.lora: needs train.parallel ddp"),
            (lora and ro["backend"] == "vllm", "model.lora: needs rollout.backend hf"),
            (not 0 <= nl["split_dh_fraction"] < 1 or nl["split_dh_fraction"] and nl["do"],
             "nlhf.split_dh_fraction: in [0, 1), and only with nlhf.do: null"),
            (cfg["metarm"]["mode"] in ("binary", "binary_retrain", "classifier")
             and not nl["gate_on_outcome"], "metarm.mode: binary/classifier need gate_on_outcome"),
            ((run["early_stop_drop"] > 0) != (run["early_stop_patience"] > 0),
             "run.early_stop_drop / early_stop_patience: set both or neither"),
            (bool(run["eval_every"]) != bool(d["val"]), "run.eval_every / data.val: both or none")]:
        if bad:
            raise SystemExit(f"config key {msg}")


# ==== Processes: torchrun's environment, the process group, reductions over ranks =================


COLLECTIVE_TIMEOUT_S = 1800.0  # torch's default; a step's judge phase ends within half of it


def setup_process_group(device_setting, parallel, timeout_s=COLLECTIVE_TIMEOUT_S):
    """The process group under torchrun (gloo | nccl; FSDP2 even alone): (rank, world, device)."""
    cuda = device_setting == "cuda" or device_setting == "auto" and torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized() and (world > 1 or parallel == "fsdp2"):
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                store=None if world > 1 else dist.HashStore(),  # alone: no port
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, torch.device("cuda", local) if cuda else torch.device("cpu")


def all_sum(x, world, op=dist.ReduceOp.SUM):
    """A number summed (or `op`) over ranks, as a float."""
    if world == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return float(t.item())


def gather_records(records, world):
    """Every rank's list of per-sample dicts, in rank order, on every rank."""
    return records if world == 1 else [r for part in metarm.all_ranks(records) for r in part]


# ==== Wrapping: DDP or FSDP2 (docs/scale-out.md); float32 master weights, compute in model.dtype.


def fully_shard_layers(model, device, world, mp_dtype=None):
    """fully_shard each decoder layer, then the root, in place; mp_dtype: compute in it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"mesh": init_device_mesh(device.type, (world,))}
    if mp_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    names = set(getattr(model, "_no_split_modules", None) or [])
    for layer in [m for m in model.modules() if type(m).__name__ in names]:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def wrap_policy(policy, parallel, world, device, dtype="float32", gradient_checkpointing="none"):
    """The module to run forward/backward on: DDP (world > 1) or the policy; or FSDP2, on GPU
    computing in `dtype`. gradient_checkpointing "full": each decoder layer replayed in backward."""
    if gradient_checkpointing == "full":  # non-reentrant: the variant FSDP2 and no_sync take
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": False})
    if parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(policy, ids) if world > 1 else policy
    cuda_mp = device.type == "cuda" and dtype != "float32"
    return fully_shard_layers(policy, device, world, getattr(torch, dtype) if cuda_mp else None)


@contextmanager
def unsharded(model):
    """Full FSDP2 parameters through HF generate (ranks stop at different steps: per-layer
    gathers would deadlock); else a no-op."""
    from torch.distributed.fsdp import FSDPModule
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # fully_shard's default


# ==== LoRA (model.lora; docs/method.md §4.7): W x + (alpha / r) B A x, only A and B train. =======


def apply_lora(policy, lora, seed, ckpt=None):
    """A PeftModel: LoRA adapters on lora["target_modules"], fresh (B = 0) or `ckpt`'s."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    names = {n.rsplit(".", 1)[-1] for n, m in policy.named_modules()
             if isinstance(m, torch.nn.Linear)}
    for t in [] if lora["target_modules"] == "all-linear" else lora["target_modules"]:
        if t not in names:
            raise SystemExit(f"config key model.lora.target_modules: no Linear layer {t!r} "
                             f"(the model's: {', '.join(sorted(names))})")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft reads a deprecated transformers name
        torch.manual_seed(seed)
        model = get_peft_model(policy, LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"], task_type="CAUSAL_LM"))
    if ckpt is not None:
        path = os.path.join(ckpt, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise SystemExit(f"checkpoint {ckpt} holds no LoRA adapter: resume without model.lora")
        set_peft_model_state_dict(model, load_file(path))
    return model


class BaseModelView(torch.nn.Module):
    """The LoRA policy with its adapters off: the initial policy, without a second copy."""

    def __init__(self, policy):
        super().__init__()
        self.policy, self.config = policy, policy.config

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()


# ==== Checkpoints: out_dir/checkpoints/step_NNNNNN, written as .tmp, renamed; weights:
# save_pretrained (float32); AdamW: torch.distributed.checkpoint, resharded to any world size.


def lr_lambda(warmup_steps):
    """LambdaLR's factor: linear warmup (step + 1) / (warmup_steps + 1), then constant."""
    return lambda step: (step + 1) / (warmup_steps + 1) if step < warmup_steps else 1.0


def save_checkpoint(out_dir, step, policy, tokenizer, optimizer, scheduler, keep, rank=0, world=1,
                    extra=None):
    """Every rank calls this: the weights (LoRA: the adapter), optimizer/, trainer_state.pt,
    rng_<rank>.pt, what `extra(folder)` writes (the MetaRM); keeps the newest `keep`."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    policy = getattr(policy, "module", policy)  # never the DDP wrapper
    final = os.path.join(root := os.path.join(out_dir, "checkpoints"), f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if world > 1:
        dist.barrier()
    dcp.save(get_optimizer_state_dict(policy, optimizer),  # every rank its part, in parallel
             checkpoint_id=os.path.join(tmp, "optimizer"), no_dist=not dist.is_initialized())
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if rank == 0:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # its bars would break the training bar's line
        policy.save_pretrained(tmp, state_dict=full)
        hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(tmp)
        torch.save({"step": step, "scheduler": scheduler.state_dict()},
                   os.path.join(tmp, "trainer_state.pt"))
    del full
    torch.save(torch.get_rng_state(), os.path.join(tmp, f"rng_{rank}.pt"))  # e.g. LoRA dropout
    if extra is not None:
        extra(tmp)
    if world > 1:
        dist.barrier()  # every rank's files are written before the rename
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d))
        for d in done[:-keep]:
            shutil.rmtree(os.path.join(root, d))


def latest_checkpoint(out_dir, rank=0):
    """The newest checkpoint that reads, or None; a damaged one is reported in one line."""
    from safetensors import safe_open
    root = os.path.join(out_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    for name in sorted((n for n in names if re.fullmatch(r"step_\d+", n)), reverse=True):
        folder = os.path.join(root, name)
        try:
            weights = glob.glob(f"{folder}/**/*.safetensors", recursive=True)  # the MetaRM's too
            for f in weights or [os.path.join(folder, "model.safetensors")]:
                with safe_open(f, "pt"):
                    pass
            torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)
            open(os.path.join(folder, "optimizer", ".metadata"), "rb").close()
            return folder
        except Exception as e:  # noqa: BLE001  (whatever it is, the older checkpoint is tried)
            if rank == 0:
                print(f"[resume] skipping checkpoint {root}/{name}: {type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0]}", file=sys.stderr)


def load_checkpoint(ckpt, policy, optimizer, scheduler, rank=0):
    """Restore AdamW (resharded), the scheduler and this rank's RNG; returns the step."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    policy = getattr(policy, "module", policy)
    osd = get_optimizer_state_dict(policy, optimizer)  # this rank's layout, for dcp to fill
    dcp.load(osd, checkpoint_id=os.path.join(ckpt, "optimizer"), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(policy, optimizer, osd)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    scheduler.load_state_dict(state["scheduler"])
    if os.path.isfile(rng := os.path.join(ckpt, f"rng_{rank}.pt")):
        torch.set_rng_state(torch.load(rng))
    return state["step"]


def truncate_jsonl(path, last_step):
    """Drop the lines of metrics.jsonl / samples.jsonl after `last_step` (a resume redoes them)."""
    if os.path.exists(path):
        with open(path) as f:
            keep = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def lock_run(out_dir, rank=0):
    """One live run per out_dir: rank 0 flocks <out_dir>/run.lock (its pid) while it lives."""
    if rank != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, "run.lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise SystemExit(f"{out_dir}: another run (pid {f.read().strip() or '?'}) is using this "
                         "folder; wait for it, stop it, or set another run.out_dir")
    f.truncate(0), f.write(str(os.getpid())), f.flush()
    return f


def main(argv=None):
    """`python train.py --config A.yaml [--config B.yaml ...] [key.sub=value ...]`."""
    p = argparse.ArgumentParser(description="RLME / RM-NLHF training (config.yaml)")
    p.add_argument("--config", action="append", default=[], help="a preset YAML (repeatable)")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    args = p.parse_args(argv)
    try:
        train(load_config(args.config, args.overrides))
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; the same command resumes
        print("[train] interrupted: the same command resumes from the newest checkpoint",
              file=sys.stderr)
        raise SystemExit(130)


if __name__ == "__main__":
    main()
