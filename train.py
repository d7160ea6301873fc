"""RLME and RM-NLHF training in one file: prompts -> rollout -> reward -> advantages -> update.

    python train.py --config configs/cpu.yaml [key.sub=value ...]     # one CPU process
    torchrun --nproc_per_node 8 train.py --config config.yaml         # one 8-GPU node

The step is `train()`, top to bottom; the functions after it follow in the order it calls them:
  1. prompts     this rank's P/world items; RM-NLHF mixes D_H and D_O       step_items, prompt_of
  2. rollout     G completions per prompt (RLME Eq. 1): HF generate or vLLM            sample
  3. reward      RLME: the evaluators' weighted log p(target) (Eq. 2-3)      rlme_reward_step
                 RM-NLHF: judge D_H, update the MetaRM, predict D_O (Alg. 1) nlhf_reward_step
  4. advantages  A = r - mean(group) (RLME Eq. 5), / std for GRPO (RM-NLHF Eq. 1-2)
  5. update      CISPO (RLME Eq. 6-8) or GRPO + k3 KL (RM-NLHF Eq. 3)           update_policy
  6. log         metrics.jsonl + samples.jsonl (rank 0), TensorBoard, the bar      log_step
  7. validate    every run.eval_every steps; the monitor, the early stop     validate, watch
  8. checkpoint  atomic; re-running the same command resumes exactly     save_checkpoint
Below them: setup (the models and data from the config), main (the command line).

What is simplified, and why:
  - On-policy by default (algo.updates_per_batch = algo.minibatches = 1): the policy that sampled
    is the one updated, so CISPO's importance weight is exactly 1 and the behaviour pass is
    skipped. Either above 1 gives RLME Eq. 6's off-policy update; the same code runs it.
  - The live evaluator IS the policy (RLME §4.1): it scores without gradient between rollout
    and update, so no second model is held. No value model; RM-NLHF's one extra is the MetaRM.
  - LoRA trains adapters only; "the initial policy" (frozen_self evaluators, the GRPO
    reference) is then the policy with its adapters off, not a second copy. LoRA samples with
    HF generate: the vLLM weight push sends whole weights, not merged adapters.
  - One tracker (TensorBoard) besides metrics.jsonl; the config is read once, here: every
    function takes numbers, tensors and callables.
Formulas and the choices the papers leave open: docs/method.md; parallelism: docs/scale-out.md.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import yaml
from tqdm import tqdm

import data
import evaluate
import metarm
import reward as R
import rollout
from _infra import (BaseModelView, all_max, all_sum, apply_lora, checkpoint_step, gather_records,
                    grad_sync, latest_checkpoint, load_checkpoint, load_config, load_sharded_model,
                    lock_run, lr_lambda, peak_memory_mb, save_checkpoint, setup_process_group,
                    shard_frozen, truncate_jsonl, unsharded, wrap_policy)


# ---------------------------------------------------------------------------------------------
# The loop


def train(cfg):
    """Run cfg["run"]["total_steps"] steps, or resume the unfinished run in run.out_dir."""
    state = setup(cfg)
    if state is None:  # the run in run.out_dir is complete or stopped early
        return
    algo, ro, run, nl, task = cfg["algo"], cfg["rollout"], cfg["run"], cfg["nlhf"], cfg["task"]
    G, P, rank, world, seed = (ro["group_size"], ro["prompts_per_step"], state["rank"],
                               state["world"], run["seed"])
    total, every = run["total_steps"], run["eval_every"]
    if every and run["eval_at_start"] and state["start_step"] == 0:  # the initial policy: step 0
        log_step(state, cfg, val := validate(state, cfg, 0, []), [])
        watch(state, cfg, val, None)  # the monitor's first point (one cannot trigger a stop)
    for step in range(state["start_step"], total):
        t0 = time.perf_counter()
        # --- 1. prompts: this rank's share of the step's items -------------------------------
        items = R.nlhf_step_items(
            state["dh"], state["do"], step, prompts_per_step=P, dh_per_step=nl["dh_per_step"],
            seed=seed, rank=rank, world=world) if task == "rm_nlhf" else rollout.step_items(
            state["items"], step, P, seed=seed, rank=rank, world=world)
        # --- 2. rollout: G completions per prompt (RLME Eq. 1), seeded by (run, step, rank) ---
        out = sample(state, [prompt_of(state, cfg, it) for it in items], group_size=G,
                     max_new_tokens=ro["max_new_tokens"], temperature=ro["temperature"],
                     top_p=ro["top_p"], seed=sampling_seed(seed, step, rank))
        if state["engine"] is not None:  # vLLM: its memory to the reward and the update
            rollout.vllm_sleep(state["engine"])
        samples = [it for it in items for _ in range(G)]  # the item of each completion
        t1 = time.perf_counter()
        # --- 3. rewards: {"reward" [N], "valid" [N] or None, "records", "metrics"} ------------
        if task == "rm_nlhf":  # judge D_H, update the MetaRM, it predicts D_O (Algorithm 1)
            rew = metarm.nlhf_reward_step(
                samples, out["completions"], judge=state["judge"], mrm=state["mrm"],
                lam=nl["lam"], threshold=nl["threshold"],
                inclusive=nl["threshold_rule"] == "inclusive", similarity=nl["similarity"],
                gate_on_outcome=nl["gate_on_outcome"], on_failure=cfg["judge"]["on_failure"],
                max_lines=nl["max_critique_lines"], max_chars=nl["max_critique_chars"],
                style=nl["grm_prompt"], form=nl["do_reward"], mode=cfg["metarm"]["mode"],
                train_on_do=cfg["metarm"]["train_on_do"], seed=seed * 7_919 + step, t0=t0)
        else:  # the evaluators' log p(target) to the meta-questions (RLME Eq. 2-3)
            rew = rlme_reward_step(state, cfg, samples, out["completions"])
        t2 = time.perf_counter()
        # --- 4. advantages: r - group mean (RLME Eq. 5), / std for GRPO; unknown rewards: 0 ---
        adv = group_advantages(rew["reward"], G, std=algo["advantage_std"], valid=rew["valid"],
                               unbiased=algo["std_unbiased"])
        # --- 5. update: CISPO (RLME Eq. 6-8) or GRPO + k3 KL (RM-NLHF Eq. 3) ----------------
        batch = dict(out, advantages=adv, valid=rew["valid"])
        if cfg["model"]["lora"] and cfg["model"]["lora"]["dropout"] > 0:
            # LoRA dropout draws from torch's RNG: seeded per step, so a resumed run draws alike
            torch.manual_seed(sampling_seed(seed, step, rank))
        upd = update_policy(
            state["model"], state["policy"], state["optimizer"], batch, loss=algo["loss"],
            eps_low=algo["eps_low"], eps_high=algo["eps_high"], ratio=algo["ratio"],
            clip_eps=algo["clip_eps"], kl_coef=algo["kl_coef"], aggregation=algo["aggregation"],
            max_new_tokens=ro["max_new_tokens"], updates_per_batch=algo["updates_per_batch"],
            minibatches=algo["minibatches"], group_size=G,
            micro_batch_size=cfg["train"]["micro_batch_size"], grad_clip=cfg["optim"]["grad_clip"],
            temperature=ro["temperature"], pad_id=state["tokenizer"].pad_token_id,
            dtype=cfg["model"]["dtype"], world=world, ref_model=state["ref_model"],
            scaler=state["scaler"])
        if state["engine"] is not None:  # vLLM samples the next step with the updated weights
            rollout.vllm_push_weights(state["engine"], state["policy"])
        state["scheduler"].step()
        t3 = time.perf_counter()
        # --- 6. log (rank 0 gets every rank's samples); 7. validate every run.eval_every -----
        done = step + 1
        records = sample_records(done, rank, out, rew["records"], adv, upd, G)
        val = validate(state, cfg, done, records) if every and (
            done % every == 0 or done == total) else {}
        times = {"rollout": t1 - t0, "reward": t2 - t1, "update": t3 - t2}
        metrics, records = step_metrics(state, cfg, records, upd, {**rew["metrics"], **val}, times)
        log_step(state, cfg, metrics, records)
        stop = bool(val) and watch(state, cfg, val, metrics)
        # --- 8. checkpoint (the MetaRM rides along in metarm/); an early stop ends the run ---
        if (run["save_every"] and done % run["save_every"] == 0) or done == total or stop:
            save_checkpoint(run["out_dir"], done, state["policy"], state["tokenizer"],
                            state["optimizer"], state["scheduler"], run["keep_checkpoints"], rank,
                            world, state["scaler"], extra=state["mrm"] and (
                                lambda d: metarm.save_metarm(state["mrm"], f"{d}/metarm")))
        if stop:
            break
    finish(state)


def sampling_seed(run_seed, step, rank):
    """The rollout's seed of (run seed, step, rank): distinct for every rank and step (rank <
    10_007), so a resumed run samples what the uninterrupted one did."""
    return run_seed * 1_000_003 + step * 10_007 + rank


def prompt_of(state, cfg, item):
    """1. An item's prompt ids: an RLME problem in data.prompt_template, or the GRM prompt of an
    RM-NLHF pair (nlhf.grm_prompt), in the policy's chat template (or plain text)."""
    tok, chat, nl = state["tokenizer"], state["chat"], cfg["nlhf"]
    if cfg["task"] == "rm_nlhf":
        return R.grm_prompt_ids(tok, item, chat, max_lines=nl["max_critique_lines"],
                                style=nl["grm_prompt"])
    return rollout.policy_prompt_ids(tok, item, chat, cfg["data"]["prompt_template"])


def sample(state, prompt_ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
           seed=0):
    """2. Completions through the run's engine: vLLM, or HF generate on the policy in the compute
    dtype. Under FSDP2 each call gathers the weights (a collective: every rank calls, with or
    without prompts). Returns the rollout dict (rollout.py; vLLM adds "logprobs")."""
    if state["engine"] is not None:
        return rollout.vllm_generate(state["engine"], prompt_ids, group_size, max_new_tokens,
                                     temperature, top_p, top_k, seed)
    with unsharded(state["model"]), rollout.autocast(state["dtype"], state["device"].type):
        return rollout.generate(state["policy"], state["tokenizer"], prompt_ids, group_size,
                                max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, micro_batch_size=state["generate_batch"])


# ---------------------------------------------------------------------------------------------
# 3-4. Rewards and advantages


def rlme_reward_step(state, cfg, items, completions):
    """3. One RLME step's rewards: r = sum_j v_j sum_k w_k log p_jk (RLME Eq. 2-3), RLVR's reward
    against the label (reward.kind rlvr), or hybrid: rlvr_weight x RLVR + the RLME terms.
    items: N item dicts (one per completion); completions: N str. Returns {"reward" [N],
    "valid": None, or BoolTensor [N] False where a remote evaluator failed (masked), "records":
    N samples.jsonl dicts (every evaluator's log p per question: the reward recomputes by hand),
    "metrics": reward/nonfinite, reward/masked, evaluator/<name>/failed}."""
    rw, fmt, world, evs = cfg["reward"], cfg["data"]["label_format"], state["world"], state[
        "evaluators"]
    # RLVR (docs/method.md §4.3): kind rlvr's reward, hybrid's first part; the accuracy always
    # (exact match for text labels, whatever qa_metric); no label: None
    labels = [it["label"] for it in items]
    rlvr = torch.tensor([R.answer_reward(c, y, fmt, rw["qa_metric"]) if y is not None else 0.0
                         for c, y in zip(completions, labels)])
    correct = [R.answer_reward(c, y, fmt, "em") >= 1.0 if y is not None else None
               for c, y in zip(completions, labels)]
    logp, rlme, nonfinite, valid = None, None, 0, torch.ones(len(items), dtype=torch.bool)
    if rw["kind"] in ("rlme", "hybrid"):
        with rollout.autocast(state["dtype"], state["device"].type):
            o = R.rlme_reward(evs, rw["meta_questions"], problems=[it["problem"] for it in items],
                              solutions=completions, references=[it["answer_text"] for it in items],
                              anchored=[it["anchored"] for it in items], template=state["template"],
                              renormalize=rw["renormalize"], transform=rw["transform"])
        rlme, logp, nonfinite, failed, valid = o["reward"], o["logp"], o["nonfinite"], o[
            "failed"], o["valid"]
    rewards = (R.hybrid_reward(rlvr, rlme, rlvr_weight=rw["rlvr_weight"]) if rw["kind"] == "hybrid"
               else {"rlme": rlme, "rlvr": rlvr}[rw["kind"]])
    records = []
    for i, (it, c) in enumerate(zip(items, completions)):  # reward None: masked
        ok = bool(valid[i])
        rec = {"item": it["index"], "problem": it["problem"], "extracted": R.extract_boxed(c),
               "label": it["label"], "correct": correct[i], "anchored": it["anchored"],
               "reward": float(rewards[i]) if ok else None, "rlvr_reward": float(rlvr[i])}
        if logp is not None:  # logp [N, J evaluators, K questions]; None: a failed request
            rec["rlme_reward"] = float(rlme[i]) if ok else None
            rec["logp"] = {ev["name"]: {mq["question"]: None if failed[i, j, k] else float(
                logp[i, j, k]) for k, mq in enumerate(rw["meta_questions"])}
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
    """4. A_i = r_i - mean_group(r) (RLME Eq. 5), or / (std + 1e-6) with std=True (GRPO, RM-NLHF
    Eq. 1-2): the population std, or with unbiased=True sum / (n - 1) (the authors' verl).
    rewards: FloatTensor [N], groups contiguous; valid: BoolTensor [N] or None (an invalid
    sample, a failed judge call, leaves its group's statistics and gets 0). Returns
    FloatTensor [N]; a group whose valid rewards are all equal gets exactly 0 (no NaN)."""
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


# ---------------------------------------------------------------------------------------------
# 5. The update


def update_policy(model, policy, optimizer, batch, *, loss, eps_low, eps_high, ratio, clip_eps,
                  kl_coef, aggregation, max_new_tokens, updates_per_batch, minibatches,
                  group_size, micro_batch_size, grad_clip, temperature, pad_id, dtype="float32",
                  world=1, ref_model=None, scaler=None):
    """5. One rollout batch's update (docs/method.md §4.4): `updates_per_batch` passes, each
    `minibatches` optimizer steps over whole groups, each accumulated over micro-batches of
    `micro_batch_size` rows. An optimizer step's loss is sum(per-token loss) / ONE normaliser
    counted over all its micro-batches on all ranks, so 1 rank x 4 micro-batches, 2 ranks x 2
    and 1 x 1 give the same update. No-grad passes first: pi_b when off-policy (RLME Eq. 6's
    denominator), pi_ref for GRPO's KL (ref_model).

    model: what trains (DDP / FSDP2 / the policy); policy: unwrapped. batch: "prompt_ids" (N
    lists), "completion_ids" LongTensor [N, L], "completion_mask" [N, L], "advantages" [N],
    "valid" BoolTensor [N] | None (False rows leave the loss). loss "cispo" (eps_low, eps_high,
    ratio) | "grpo" (clip_eps, kl_coef); grad_clip <= 0: measured only; scaler: float16's.
    Returns {"loss" (this rank's, summed over optimizer steps), "grad_norms" (before clipping; a
    non-finite one: that step skipped), "is_weight", "clipped" ([N], the last pass)}.
    """
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
                with grad_sync(model, world, sync=c == len(chunks) - 1):
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
                    scaled = loss_sum * world / norm
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                loss_total += float(loss_sum.detach()) / norm
                is_weights[rows] = st["is_weight"].float().cpu()
                clipped[rows] = st["clipped"].float().cpu()
            grad_norms.append(optimizer_step(policy, optimizer, grad_clip, scaler))
    return {"loss": loss_total, "grad_norms": grad_norms, "is_weight": is_weights,
            "clipped": clipped}


def optimizer_step(policy, optimizer, grad_clip, scaler=None):
    """Clip the global gradient norm to `grad_clip` (<= 0: measure only; torch's clip_grad_norm_,
    under FSDP2 reduced over the mesh) and step; a non-finite norm skips the step, so a NaN never
    reaches AdamW or a checkpoint. Returns the norm before clipping (float)."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip and log the true gradient norm
    gn = torch.nn.utils.clip_grad_norm_(policy.parameters(),
                                        grad_clip if grad_clip > 0 else float("inf"))
    gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
    if scaler is not None:
        scaler.step(optimizer)  # skipped when a gradient is inf/NaN (float16 overflow)
        scaler.update()
    elif math.isfinite(gn):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return gn


@torch.no_grad()
def frozen_logprobs(model, batch, micro_batch_size, temperature, pad_id, dtype="float32"):
    """The no-grad pass: every completion's per-token log-probs under `model`, prompt AND
    completion through `model` itself: pi_b (the policy before any optimizer step) or pi_ref
    (the frozen initial policy). Returns N FloatTensors [L] on CPU, zero past the row's
    micro-batch width (masked), so the optimizer steps may chunk the rows differently."""
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
    """(log-probs [len(rows), width], width) of the completions of `rows` over their first `width`
    columns (the longest masked completion among them); with grad under grad mode."""
    width = max(1, int(batch["completion_mask"][rows].sum(-1).max()))
    return rollout.completion_logprobs(model, [batch["prompt_ids"][i] for i in rows],
                                       batch["completion_ids"][rows, :width], pad_id,
                                       temperature=temperature), width


def micro_batches(rows, size):
    """Consecutive chunks of `size` row indices (the last one shorter)."""
    rows = list(rows)
    return [rows[s:s + size] for s in range(0, len(rows), size)]


def loss_normaliser(aggregation, num_seqs, num_tokens, max_new_tokens):
    """The one global divisor of an optimizer step (docs/method.md §4.4): sequences for seq_sum
    (RLME Eq. 8), seq_mean_token_mean (RM-NLHF Eq. 3's 1/G) and micro_batch_token_mean; tokens
    for token_mean; sequences x max_new_tokens for Dr.GRPO."""
    return {"seq_sum": num_seqs, "seq_mean_token_mean": num_seqs,
            "micro_batch_token_mean": num_seqs, "token_mean": num_tokens,
            "dr_grpo": num_seqs * max_new_tokens}[aggregation]


def cispo_loss(logp, behaviour_logp, advantages, mask, *, eps_low, eps_high, ratio="sequence",
               aggregation="seq_sum"):
    """Sum over this micro-batch of CISPO's per-token loss (RLME Eq. 6-8, MiniMax-M1); the caller
    divides by loss_normaliser's global count, so the update equals one big batch's:

        L = -sum_i sg(clip(rho_i, 1 - eps_low, 1 + eps_high)) A_i sum_t log pi(y_it)      (Eq. 8)
        rho_i = exp(sum_t [log pi(y_it) - log pi_b(y_it)])                               (Eq. 6)

    ratio "geometric_mean": the GSPO per-token mean, exp(mean_t [...]). rho_i is clipped in LOG
    space before exp (a 100-token sequence cannot overflow), then DETACHED: every sample, clipped
    or not, keeps its gradient -sg(rho_hat_i) A_i grad sum_t log pi (PPO-clip would zero it).

    logp: FloatTensor [B, L] with grad; behaviour_logp: [B, L] or None (on-policy: logp detached,
    ratio 1); advantages [B]; mask [B, L]; eps_low >= 1: no lower clip. Returns (loss_sum scalar,
    {"is_weight": [B] before clipping, "clipped": BoolTensor [B]}).
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

    Arguments as cispo_loss's, plus clip_eps (eps), kl_coef (beta), ref_logp ([B, L] pi_ref's, or
    None: no KL). Returns (loss_sum, {"is_weight": token-mean ratio [B], "clipped": share of
    clipped tokens [B]})."""
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
    """Sum of the masked per-token losses [B, L] of a micro-batch (the caller divides by
    loss_normaliser's count): seq_mean_token_mean takes each sequence's token mean first
    (RM-NLHF Eq. 3's 1/|y_i|); micro_batch_token_mean is the micro-batch's token mean x its
    sequence count (verl 0.4.1's token-mean under use_dynamic_bsz: the RM-NLHF release)."""
    per_token = per_token * mask
    if aggregation == "seq_mean_token_mean":
        per_token = per_token / mask.sum(-1, keepdim=True).clamp(min=1)
    if aggregation == "micro_batch_token_mean":
        return per_token.sum() * (mask.sum(-1) > 0).sum() / mask.sum().clamp(min=1)
    return per_token.sum()


def k3_kl(logp, ref_logp):
    """The k3 KL estimator per token, >= 0 (docs/method.md §4.5): exp(ref - logp) - (ref - logp)
    - 1, the shape of logp."""
    d = ref_logp - logp
    return d.exp() - d - 1


# ---------------------------------------------------------------------------------------------
# 6. The metrics line, samples.jsonl, TensorBoard, the progress bar


def sample_records(step, rank, out, fields, advantages, upd, group_size):
    """This rank's samples.jsonl lines: where the sample sits, the reward step's fields, the
    completion, and what the update made of it (advantage, importance weight, clipped)."""
    return [{"step": step, "rank": rank, "group": i // group_size, **f,
             "completion": out["completions"][i], "truncated": bool(out["truncated"][i]),
             "length": int(out["completion_mask"][i].sum()), "advantage": float(advantages[i]),
             "importance_weight": float(upd["is_weight"][i]), "clipped": float(upd["clipped"][i])}
            for i, f in enumerate(fields)]


def step_metrics(state, cfg, records, upd, reward_metrics, times):
    """The step's metrics.jsonl line from every rank's records (docs/method.md §9 lists the keys);
    every rank calls it (collectives). Returns (metrics, all records) on rank 0, else Nones."""
    world, G, algo = state["world"], cfg["rollout"]["group_size"], cfg["algo"]
    records, loss = gather_records(records, world), all_sum(upd["loss"], world)
    # steps skipped for a non-finite gradient norm (float16's GradScaler skips on its own)
    skipped = 0 if state["scaler"] else sum(not math.isfinite(g) for g in upd["grad_norms"])
    if state["rank"] != 0:
        return None, None
    # reward None: a failed judge call / remote evaluator; no known reward: no mean (never 0.0)
    known = [r["reward"] for r in records if r["reward"] is not None]
    rew = torch.tensor(known) if known else None
    lens = torch.tensor([r["length"] for r in records], dtype=torch.float)
    groups = [{r["reward"] for r in records[g:g + G] if r["reward"] is not None}
              for g in range(0, len(records), G)]
    n, steps = len(records), algo["updates_per_batch"] * algo["minibatches"]
    labelled = [r["correct"] for r in records if r["correct"] is not None]
    metrics = {
        "step": records[0]["step"], "reward/mean": rew.mean().item() if known else None,
        "reward/std": rew.std(unbiased=False).item() if known else None,
        "accuracy": sum(labelled) / len(labelled) if labelled else None,
        "advantage/abs_mean": sum(abs(r["advantage"]) for r in records) / n,
        "groups/zero_variance_frac": sum(len(g) <= 1 for g in groups) / len(groups),
        "completion/length_mean": lens.mean().item(), "completion/length_max": lens.max().item(),
        # characters: the unit of RLME §4's conciseness meta-question ("200 to 500 characters")
        "completion/chars_mean": sum(len(r["completion"]) for r in records) / n,
        "completion/truncated_frac": sum(r["truncated"] for r in records) / n,
        "is_weight/mean": sum(r["importance_weight"] for r in records) / n,
        "is_weight/max": max(r["importance_weight"] for r in records),
        "is_weight/clip_frac": sum(r["clipped"] for r in records) / n,
        "loss": loss / steps, "grad_norm": sum(upd["grad_norms"]) / len(upd["grad_norms"]),
        "update/skipped_steps": skipped, "lr": state["scheduler"].get_last_lr()[0],
        **{f"time/{k}": v for k, v in times.items()}, "time/step": sum(times.values()),
        "rollout/tokens_per_s": sum(r["length"] for r in records) / max(times["rollout"], 1e-9),
        "memory/peak_mb": peak_memory_mb(state["device"]), **reward_metrics}
    if cfg["task"] == "rm_nlhf":
        metrics.update(R.nlhf_step_metrics(records, reward_metrics))
    else:  # the RLVR reward, boxed answers, each evaluator's log p and p per meta-question
        metrics["rlvr_reward/mean"] = sum(r["rlvr_reward"] for r in records) / n
        metrics["completion/boxed_frac"] = sum(bool(r["extracted"]) for r in records) / n
        if "logp" in records[0]:  # None: a remote evaluator's failed request, left out
            rl = [r["rlme_reward"] for r in records if r["rlme_reward"] is not None]
            metrics["rlme_reward/mean"] = sum(rl) / len(rl) if rl else None
            for ev in cfg["reward"]["evaluators"]:
                for q in (mq["question"] for mq in cfg["reward"]["meta_questions"]):
                    v = torch.tensor([x for r in records
                                      if (x := r["logp"][ev["name"]][q]) is not None])
                    metrics[R.logp_metric_name(ev["name"], q)] = v.mean().item() if len(v) else None
                    metrics[f"rlme/{ev['name']}/{q}/p"] = v.exp().mean().item() if len(v) else None
    return metrics, records


def log_step(state, cfg, metrics, records):
    """Rank 0 (metrics not None): the metrics.jsonl line (NaN / inf as null: NaN is not JSON),
    the samples.jsonl lines, TensorBoard's scalars, the progress bar."""
    if metrics is None:
        return
    training = "reward/mean" in metrics  # step 0's validation line has no reward
    if training:  # the MetaRM cold start's counts join the first step's line
        metrics = {**metrics, **state.pop("first_metrics", {})}
    metrics, out_dir = finite(metrics), cfg["run"]["out_dir"]
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


# ---------------------------------------------------------------------------------------------
# 7. Validation, the reward-hacking monitor, the early stop (RLME §4; docs/method.md §4.6)


def validate(state, cfg, step, records):
    """Held-out validation with the current policy; every rank calls it (collectives). RLME:
    data.val's problems answered greedily, graded as `evaluate.py math` does, their training
    reward, the canaries' (non-answers an evaluator must not like) and the AUROC of this step's
    rewards against correctness. RM-NLHF: the GRM's pairwise accuracy on held-out pairs, both
    A/B orders (RM-NLHF Figs. 3, 6), sampled at T 0.6 (the release's) in calls of at most a
    rollout's rows, as many on every rank (a rank with fewer pairs calls with none: under FSDP2
    each call is a collective). Returns val/* (the same on every rank), val/seconds, step."""
    t0, world, rank, ro, d, nl = (time.perf_counter(), state["world"], state["rank"],
                                  cfg["rollout"], cfg["data"], cfg["nlhf"])
    total, val = (lambda x: all_sum(x, world)), state["val_items"]  # noqa: E731
    mine = val[rank::world]
    if cfg["task"] == "rlme":
        inject = "{answer}" in d["prompt_template"]  # NoCheat: a seeded WRONG answer is shown
        prompts = [rollout.policy_prompt_ids(state["tokenizer"], val[k], state["chat"],
                                             d["prompt_template"], answer=evaluate.wrong_answer(
                                                 val, k) if inject else None)
                   for k in range(rank, len(val), world)]
        greedy = sample(state, prompts, group_size=1, max_new_tokens=ro["max_new_tokens"],
                        temperature=0.0, seed=0)
        rew = rlme_reward_step(state, cfg, mine, greedy["completions"])
        few = mine[:max(1, 8 // world)]
        canaries = {name: rlme_reward_step(state, cfg, few, [text] * len(few))
                    for name, text in evaluate.CANARIES.items()}
        out = evaluate.rlme_val_metrics(rew, greedy["completions"], canaries, injected=inject,
                                        numeric=d["label_format"] != "text", all_sum=total)
        out.update(evaluate.val_auroc(gather_records(records, world)))
    else:
        chunk = max(1, ro["prompts_per_step"] * ro["group_size"] // world)
        calls = []

        def generate(model, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0,
                     top_p=1.0, top_k=0, seed=0, micro_batch_size=0):
            calls.append(len(prompt_ids))  # rollout.generate's signature, through the engine
            return sample(state, prompt_ids, group_size=group_size, temperature=temperature,
                          max_new_tokens=max_new_tokens, top_p=top_p, top_k=top_k, seed=seed)

        judge = evaluate.make_grm_judge(
            state["policy"], state["tokenizer"], max_new_tokens=ro["max_new_tokens"],
            batch_size=chunk, chat=state["chat"], style=nl["grm_prompt"], generate=generate,
            max_prompt_tokens=ro["vllm_max_model_len"] - ro["max_new_tokens"] if state[
                "engine"] is not None else None,  # vLLM stops a longer prompt at its context
            temperature=0.6, top_p=1.0, seed=cfg["run"]["seed"] * 1_000_003 + 7_919 * step + rank,
            max_lines=nl["max_critique_lines"], max_chars=nl["max_critique_chars"])
        pairs = evaluate.pairwise_accuracy(mine, judge)[1] if mine else []
        for _ in range(-(-2 * -(-len(val) // world) // chunk) - len(calls)):  # rank 0's count
            generate(None, None, [], 1, 1)
        out = evaluate.nlhf_val_metrics(pairs, all_sum=total)
    return {**out, "val/seconds": all_max(time.perf_counter() - t0, world), "step": step}


def watch(state, cfg, val, metrics):
    """After a validation: the reward-hacking monitor (rank 0 warns when the training reward since
    the last validation rose while held-out accuracy fell) and the early-stop rule (run.early_
    stop_*, every rank alike). True: stop; rank 0 then writes early_stop.json, and the same
    command stops at start-up instead of training on."""
    run, hist, acc = cfg["run"], state["history"], evaluate.held_out_accuracy(val)
    since, state["rewards_since_eval"] = state["rewards_since_eval"], []
    warning = evaluate.monitor(hist, val["step"], acc, sum(since) / len(since) if (
        metrics is not None and since) else None)
    if warning and state["bar"] is not None:
        state["bar"].write(warning)
    stop = bool(run["early_stop_patience"]) and evaluate.early_stop(
        [h["accuracy"] for h in hist], run["early_stop_drop"], run["early_stop_patience"])
    if stop and state["rank"] == 0:
        best = max(hist, key=lambda h: h["accuracy"])
        with open(os.path.join(run["out_dir"], "early_stop.json"), "w") as f:
            json.dump({"step": val["step"], "accuracy": acc, "best_accuracy": best["accuracy"],
                       "best_step": best["step"]}, f, indent=1)
        print(f"[train] early stop at step {val['step']}: held-out accuracy {acc:.3f}, more than "
              f"{run['early_stop_drop']} below its best ({best['accuracy']:.3f}, step "
              f"{best['step']}) for {run['early_stop_patience']} evaluations", flush=True)
    return stop


# ---------------------------------------------------------------------------------------------
# Setup: the run's models and data, from the config (read here, once)


def setup(cfg):
    """Everything the loop needs, one dict, or None when run.out_dir holds a finished run
    (checkpoint at run.total_steps, or early_stop.json). The policy keeps float32 master weights
    and computes in model.dtype (rollout.autocast; FSDP2 shards it as it loads)."""
    tc, m, run = cfg["train"], cfg["model"], cfg["run"]
    rank, world, device = setup_process_group(tc["device"], tc["parallel"])
    lock, out_dir = lock_run(run["out_dir"], rank), run["out_dir"]
    ckpt = latest_checkpoint(out_dir, rank)
    start, stopped = checkpoint_step(ckpt) if ckpt else 0, os.path.join(out_dir, "early_stop.json")
    if ckpt and (start >= run["total_steps"] or os.path.exists(stopped)):
        if rank == 0:
            print(f"[train] {out_dir}: " + (f"stopped early ({stopped}; delete it to train on)"
                                            if os.path.exists(stopped) else f"complete at step "
                                            f"{start} (raise run.total_steps to train on)"))
        return finish({"lock": lock, "bar": None, "writer": None})
    lora, source = m["lora"], ckpt if ckpt and not m["lora"] else m["policy"]  # LoRA: base
    if tc["parallel"] == "fsdp2":  # only rank 0 ever holds the full weights
        policy, tok = load_sharded_model(
            lambda: rollout.load_model(source, "float32", "cpu"), lambda p: wrap_policy(
                p, "fsdp2", world, device, m["dtype"], m["gradient_checkpointing"]),
            device, rank, world)
    else:
        policy, tok = rollout.load_model(source, "float32", device)
    if lora:  # the adapters: fresh, or the checkpoint's
        policy = apply_lora(policy, lora, seed=run["seed"], ckpt=ckpt)
    state = {"rank": rank, "world": world, "device": device, "dtype": m["dtype"], "lock": lock,
             "start_step": start, "policy": policy, "tokenizer": tok, "history": [],
             "rewards_since_eval": [], "bar": None, "writer": None, "mrm": None, "engine": None,
             "chat": rollout.use_chat_template(tok, m["chat_template"], m["policy"]),
             "generate_batch": cfg["rollout"]["micro_batch_size"]}
    load_data(state, cfg)
    state["model"] = policy if tc["parallel"] == "fsdp2" else wrap_policy(
        policy, "ddp", world, device, m["dtype"], m["gradient_checkpointing"])
    load_models(state, cfg, ckpt)
    open_run(state, cfg)
    return state


def load_data(state, cfg):
    """The items (data.py): RLME's problems, or RM-NLHF's D_H, D_O pairs (and the judge), and
    the held-out ones. A prompt over rollout.max_prompt_tokens (0: context - max_new_tokens) is
    dropped: one 64k-token prompt makes a whole step crawl."""
    d, ro, nl, seed = cfg["data"], cfg["rollout"], cfg["nlhf"], cfg["run"]["seed"]
    context = getattr(state["policy"].config, "max_position_embeddings", None) or 10 ** 9
    limit = ro["max_prompt_tokens"] or context - ro["max_new_tokens"]

    def short(items):
        return [it for it in items if len(prompt_of(state, cfg, it)) <= limit]

    if cfg["task"] == "rm_nlhf":
        j = cfg["judge"]
        state["judge"] = R.make_judge(
            backend=j["backend"], variant=j["variant"], base_url=j["base_url"], model=j["model"],
            api_key_env=j["api_key_env"], timeout_s=j["timeout_s"],
            temperature=j["temperature"], max_tokens=j["max_tokens"])
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
            context_field=d["context_field"])
        state["items"], state["val_items"] = short(items), short(val)
        n = len(state["items"])
    if not n:
        raise SystemExit(f"config key rollout.max_prompt_tokens: every prompt is over {limit}")
    need = cfg["run"]["total_steps"] * ro["prompts_per_step"]
    if d["epochs"] and need > d["epochs"] * n:  # RLME §4.1: one pass over the data
        raise SystemExit(f"config key run.total_steps: {need} prompts are more than data.epochs="
                         f"{d['epochs']} pass(es) over {n} items")


def load_models(state, cfg, ckpt):
    """Into `state`: the rollout engine, the RLME evaluators, the GRPO reference, AdamW and its
    schedule (restored from `ckpt`), the MetaRM."""
    m, ro, rw, o, algo = cfg["model"], cfg["rollout"], cfg["reward"], cfg["optim"], cfg["algo"]
    policy, device, rank, world = state["policy"], state["device"], state["rank"], state["world"]
    if ro["backend"] == "vllm":  # from the policy's own weights (the checkpoint's on resume)
        if m["lora"]:  # a push sends whole weights; merging adapters into them is not done here
            raise SystemExit("config key model.lora: needs rollout.backend=hf")
        state["engine"] = rollout.make_vllm_engine(
            ckpt or m["policy"], dtype=m["dtype"],
            seed=(cfg["run"]["seed"] * 1_000_003 + rank) % 2 ** 32,
            gpu_memory_utilization=ro["vllm_gpu_memory_utilization"],
            max_model_len=ro["vllm_max_model_len"])
    # RLME Eq. 2-3's evaluator prompt: null = the default, "qa" = context QA's, else a string
    state["template"] = {None: R.DEFAULT_EVALUATOR_TEMPLATE, "qa": R.QA_EVALUATOR_TEMPLATE}.get(
        rw["evaluator_template"], rw["evaluator_template"])
    state["evaluators"] = [make_evaluator(state, cfg, i, ev) for i, ev in enumerate(
        rw["evaluators"])] if cfg["task"] == "rlme" and rw["kind"] != "rlvr" else []
    state["ref_model"] = None  # GRPO's pi_ref: the initial policy, frozen
    if algo["loss"] == "grpo" and algo["kl_coef"] > 0 and m["lora"]:
        state["ref_model"] = BaseModelView(policy)  # the policy with its adapters off
    elif algo["loss"] == "grpo" and algo["kl_coef"] > 0 and cfg["train"]["parallel"] == "fsdp2":
        state["ref_model"] = load_sharded_model(  # 1/world of it a rank, as the policy
            lambda: rollout.load_model(m["policy"], m["dtype"], "cpu"),
            lambda r: shard_frozen(r.eval(), world, device), device, rank, world)[0]
    elif algo["loss"] == "grpo" and algo["kl_coef"] > 0:
        state["ref_model"] = rollout.load_model(m["policy"], m["dtype"], device)[0]
        state["ref_model"].eval().requires_grad_(False)
    # AdamW over what trains (LoRA: the adapters); fused: one kernel over all parameters
    state["optimizer"] = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],
                                           lr=o["lr"], weight_decay=o["weight_decay"], fused=True)
    state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, then constant
        state["optimizer"], lr_lambda(o["warmup_steps"]))
    # float16 has 5 exponent bits: small gradients underflow without loss scaling (bf16: none)
    state["scaler"] = torch.amp.GradScaler(device.type) if m["dtype"] == "float16" else None
    if ckpt:
        state["start_step"] = load_checkpoint(ckpt, policy, state["optimizer"],
                                              state["scheduler"], state["scaler"], rank)
    if cfg["task"] == "rm_nlhf" and cfg["metarm"]["mode"] != "none":
        setup_metarm(state, cfg, ckpt)


def make_evaluator(state, cfg, i, ev):
    """reward.evaluators[i] (RLME Eq. 2-3's pi_phi_j, weight v_j) as reward.rlme_reward's dict:
    live (the policy itself), frozen_self (the initial policy; LoRA: the policy with adapters
    off), frozen (the model at `path`), remote (a server's prompt log-probs). live and
    frozen_self take the policy's chat template unless they set their own."""
    m, kind, name, weight = cfg["model"], ev["kind"], ev["name"], ev["weight"]
    if kind == "remote":
        settings = ("api_key_env", "timeout_s", "max_retries", "concurrency")  # else reward's
        return R.remote_evaluator(ev["base_url"], ev["model"], name=name, weight=weight,
                                  tokenizer=ev["path"], chat=ev["chat_template"],
                                  **{k: ev[k] for k in settings if k in ev})
    model, tok, path = state["policy"], state["tokenizer"], ev["path"] or m["policy"]
    if kind == "frozen_self" and m["lora"]:
        model = BaseModelView(model)
    elif kind != "live":
        model, tok = rollout.load_model(path, m["dtype"], state["device"])
    own = kind == "frozen" or ev["chat_template"] != "auto"
    chat = rollout.use_chat_template(
        tok, ev["chat_template"] if own else m["chat_template"], path,
        system=ev["system_prompt"], kwargs=ev["chat_template_kwargs"])
    return R.local_evaluator(model, tok, chat=chat, name=name, weight=weight,
                             micro_batch_size=cfg["reward"]["micro_batch_size"],
                             frozen=kind != "live")


def setup_metarm(state, cfg, ckpt):
    """RM-NLHF's MetaRM (§3.2): restored with the checkpoint (the GRM and its MetaRM move
    together), loaded from <out_dir>/metarm (a cold start done before), or a fresh head
    cold-started on D_H (Algorithm 1 lines 2-10, App. G.3) through the run's engine and saved
    there. FSDP2 with several ranks shards it like the policy."""
    mc, nl, run, ro, m = cfg["metarm"], cfg["nlhf"], cfg["run"], cfg["rollout"], cfg["model"]
    rank, world, device = state["rank"], state["world"], state["device"]
    wrap = None if cfg["train"]["parallel"] != "fsdp2" or world == 1 else (
        lambda model: wrap_policy(model, "fsdp2", world, device, mc["dtype"]))
    path = os.path.join(ckpt or run["out_dir"], "metarm")
    if ckpt or os.path.isfile(os.path.join(path, "metarm.json")):
        state["mrm"] = metarm.load_metarm(path, mc["dtype"], device=device, wrap=wrap,
                                          gradient_checkpointing=mc["gradient_checkpointing"])
        return
    state["mrm"] = metarm.new_metarm(
        m["policy"], mode=mc["mode"], lam=nl["lam"], dtype=mc["dtype"],
        batch_size=mc["batch_size"], max_length=mc["max_length"], online_lr=mc["online_lr"],
        online_epochs=mc["online_epochs"], gradient_checkpointing=mc["gradient_checkpointing"],
        device=device, seed=run["seed"], wrap=wrap)

    def cold_sample(prompt_ids, *, group_size, max_new_tokens, temperature=1.0, seed=0):
        return sample(state, prompt_ids, group_size=group_size, max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed)

    stats = metarm.run_cold_start(
        state["mrm"], state["dh"][:mc["cold_start_items"] or None], sample=cold_sample,
        prompt=lambda item: prompt_of(state, cfg, item), judge=state["judge"],
        folder=os.path.join(run["out_dir"], "cold_start"), batch_size=4,
        identity={"model.policy": m["policy"], "model.dtype": m["dtype"],
                  "judge": [cfg["judge"][k] for k in ("backend", "model", "variant")]},
        rollouts_per_prompt=mc["rollouts_per_prompt"], max_new_tokens=ro["max_new_tokens"],
        temperature=ro["temperature"], epochs=mc["epochs"], lr=1e-5, warmup_frac=0.01,
        weight_decay=0.01, seed=run["seed"], lam=nl["lam"], threshold=nl["threshold"],
        inclusive=nl["threshold_rule"] == "inclusive", similarity=nl["similarity"],
        gate_on_outcome=nl["gate_on_outcome"], on_failure=cfg["judge"]["on_failure"],
        max_lines=nl["max_critique_lines"], max_chars=nl["max_critique_chars"],
        style=nl["grm_prompt"], rank=rank, world=world, log=print if rank == 0 else None)
    metarm.save_metarm(state["mrm"], path)
    if rank == 0:  # the cold-start set's size, so an empty one is seen: the first step's line
        state["first_metrics"] = metarm.record_cold_start(run["out_dir"], stats,
                                                          mc["rollouts_per_prompt"])


def open_run(state, cfg):
    """The run folder (rank 0): the resolved config, the logs cut back to the resume point (a
    killed run's later lines are redone), TensorBoard, the progress bar. On resume, the
    monitor's history from metrics.jsonl, so a resumed run decides the early stop alike."""
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
                if evaluate.held_out_accuracy(line) is not None:
                    evaluate.monitor(state["history"], line["step"],
                                     evaluate.held_out_accuracy(line), None)


def finish(state):
    """Close the progress bar, TensorBoard, the run lock and the process group."""
    for closable in (state["bar"], state["writer"], state["lock"]):
        if closable is not None:
            closable.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv=None):
    """`python train.py --config A.yaml [--config B.yaml ...] [key.sub=value ...]` (torchrun
    too): config.yaml's defaults, then each preset, then the overrides (load_config)."""
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
