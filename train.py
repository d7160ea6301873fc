"""RLME and RM-NLHF training under torchrun, one file: rollout -> reward -> advantage -> update.

    torchrun --nproc_per_node 8 train.py --config config.yaml        # one 8-GPU node (nccl)
    python train.py --config configs/cpu.yaml                        # one CPU process (gloo)

One step of `train()`, top to bottom (the stage numbers are the loop's comments):
  1. rollout     this rank's P/world prompts, G completions each          rollout_batch (RLME Eq. 1)
  2. reward      RLME: evaluators' weighted log p("Yes") to meta-questions  rlme_reward_step (RLME Eq. 2-3)
                 RM-NLHF: judge D_H, update the MetaRM, predict D_O         metarm.nlhf_reward_step
                                                                             (RM-NLHF Eq. 4, 5, 8; Algorithm 1)
  3. advantage   A = r - mean(group) (RLME Eq. 5); / std for GRPO         group_advantages
  4. update      no-grad behaviour/reference passes, then optimizer steps   update_policy
                 with CISPO (RLME Eq. 6-8) or GRPO, one global normaliser   (policy_loss, loss_normaliser)
  5. log         metrics.jsonl and samples.jsonl on rank 0 (+ run.report_to)  log_step
  6. checkpoint  atomic save_pretrained folders; re-running resumes exactly  save_run

What is simplified, and why:
  - On-policy by default (algo.updates_per_batch = algo.minibatches = 1): the policy that sampled
    is the one being updated, so CISPO's importance weight is exactly 1 and the behaviour pass is
    skipped. Set either above 1 for RLME Eq. 6's off-policy update; the same code then runs it.
  - The live evaluator IS the policy ("live self-evaluation", RLME §4.1): it scores without
    gradient between rollout and update, so no second model is held. Frozen evaluators are config.
  - No value model and no learned reward model for RLME; RM-NLHF's only extra model is the MetaRM.
  - LoRA (model.lora, off by default) trains peft adapters only; "the initial policy" (frozen_self
    evaluators, the GRPO reference) is then the policy with its adapters off, not a second copy.
  - Generation is our own decode loop over HF models (fast.generate; its plain twin is HF's
    `model.generate`) or vLLM on GPU (rollout.backend); with vLLM the trainer recomputes the
    behaviour log-probs itself and logs the gap to the engine's.
  - Every fast path has a plain twin directly above it; train.fast_paths: false routes every pass
    through the plain versions (tests compare the two).

Read `train()` (THE LOOP) first, then the functions it calls, which sit above it in reading
order: ALGORITHM (the equations), THE UPDATE, ONE STEP. Everything under PLUMBING (setup, whose
docstring lists the keys of the `state` dict the loop reads; data; distributed / FSDP2 / vLLM
glue; checkpoints) can be skipped on first read.
docs/method.md has every formula and every choice the papers leave open; docs/scale-out.md the
parallelism and memory plan.
"""
import contextlib
import functools
import importlib
import json
import math
import os
import re
import resource
import secrets
import shutil
import time
import warnings

import torch
import torch.distributed as dist
import yaml
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import evaluate
import metarm
import reward as R
import rollout
from config import check_scale_config, check_single_pass, load_config, validate_config
import fast


# ==============================================================================================
# ALGORITHM: advantage and loss (RLME Eq. 5-8; GRPO with the k3 KL, docs/method.md §4.4-4.5)
# ==============================================================================================


def group_advantages(rewards, group_size, std=False, valid=None):
    """A_i = r_i - mean_group(r) (RLME Eq. 5), or / (population std + 1e-6) when std=True (GRPO,
    RM-NLHF Eq. 1-2).

    Args:
        rewards: FloatTensor [N], N = groups x group_size, groups contiguous.
        valid: BoolTensor [N] or None; invalid samples (e.g. a failed judge call) are left out
            of their group's statistics and get advantage 0.
    Returns:
        FloatTensor [N]. A group whose valid rewards are all equal gets exactly 0 (no NaN, no
        1-ulp residue from the mean).
    """
    r = rewards.view(-1, group_size).float()
    v = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.view(-1, group_size)
    r0 = torch.where(v, r, torch.zeros_like(r))
    count = v.sum(1, keepdim=True).clamp(min=1)
    mean = r0.sum(1, keepdim=True) / count
    adv = torch.where(v, r - mean, torch.zeros_like(r))
    if std:
        var = (adv ** 2).sum(1, keepdim=True) / count  # population variance
        adv = adv / (var.sqrt() + 1e-6)
    big = torch.finfo(r.dtype).max
    flat = (torch.where(v, r, torch.full_like(r, -big)).amax(1, keepdim=True)
            == torch.where(v, r, torch.full_like(r, big)).amin(1, keepdim=True))
    return torch.where(flat | ~v, torch.zeros_like(adv), adv).view(-1)


def policy_loss(logp, behaviour_logp, advantages, mask, algo, ref_logp=None):
    """Sum over this micro-batch of the per-token policy loss (each sequence's tokens divided by its
    length first for algo.aggregation seq_mean_token_mean); the caller divides by the global
    normaliser (see `loss_normaliser`) so that the update equals one big batch.

    CISPO (RLME Eq. 6-8, MiniMax-M1): rho_i = exp(sum_t logp - sum_t behaviour) (or the GSPO
    geometric mean), clipped in LOG space to [log(1-eps_low), log(1+eps_high)] before exp so a
    100-token sequence cannot overflow, then DETACHED: every sample, clipped or not, gets
    gradient -sg(rho_hat_i) * A_i * grad sum_t log pi(y_it).
    GRPO (RM-NLHF Eq. 3; docs/method.md §4.5): token ratio r_t, PPO clip eps,
    -min(r_t A, clip(r_t) A) + beta * k3 with k3 = exp(ref - logp) - (ref - logp) - 1.

    Args:
        logp: FloatTensor [B, L] current token log-probs (with grad).
        behaviour_logp: FloatTensor [B, L] or None (= logp detached: on-policy, ratio 1).
        advantages: FloatTensor [B]. mask: FloatTensor [B, L].
        algo: the config's `algo` dict.
        ref_logp: FloatTensor [B, L] reference log-probs (GRPO KL) or None.
    Returns:
        (loss_sum scalar tensor, stats dict of tensors [B]: importance weight before clipping,
        clipped flag; for GRPO token-level means)
    """
    old = logp.detach() if behaviour_logp is None else behaviour_logp
    log_ratio = (logp.detach() - old) * mask  # [B, L]
    if algo["loss"] == "cispo":
        seq_log_ratio = log_ratio.sum(-1)
        if algo["ratio"] == "geometric_mean":
            seq_log_ratio = seq_log_ratio / mask.sum(-1).clamp(min=1)
        lo = math.log(1 - algo["eps_low"]) if algo["eps_low"] < 1 else -float("inf")
        hi = math.log(1 + algo["eps_high"])
        weight = seq_log_ratio.clamp(lo, hi).exp()  # already detached
        per_token = -(weight * advantages)[:, None] * logp
        stats = {"is_weight": seq_log_ratio.clamp(max=80).exp(), "clipped": (seq_log_ratio < lo) | (seq_log_ratio > hi)}
    else:
        # Token ratio with gradient; log ratio clamped at +-20 so exp cannot overflow (a ratio
        # of e^20 is clipped by PPO anyway whenever it matters).
        ratio = ((logp - old) * mask).clamp(-20, 20).exp()
        a = advantages[:, None]
        eps = algo["clip_eps"]
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        if algo["kl_coef"] > 0 and ref_logp is not None:
            per_token = per_token + algo["kl_coef"] * k3_kl(logp, ref_logp)
        n = mask.sum(-1).clamp(min=1)
        stats = {"is_weight": (ratio.detach() * mask).sum(-1) / n,
                 "clipped": ((ratio.detach() - 1).abs() > eps).float().mul(mask).sum(-1) / n}
    per_token = per_token * mask
    if algo["aggregation"] == "seq_mean_token_mean":  # RM-NLHF Eq. 3: each sequence's token mean first
        per_token = per_token / mask.sum(-1, keepdim=True).clamp(min=1)
    return per_token.sum(), stats


def loss_normaliser(algo, num_seqs, num_tokens, max_new_tokens):
    """The one global divisor of a (mini-)batch (docs/method.md §4.4): sequences for seq_sum (RLME
    Eq. 8) and for seq_mean_token_mean (RM-NLHF Eq. 3's 1/G; policy_loss already divided each
    sequence by its length), tokens for token_mean, sequences x max_new_tokens for Dr.GRPO. Counts
    are global (all micro-batches of all ranks), applied once."""
    return {"seq_sum": num_seqs, "seq_mean_token_mean": num_seqs, "token_mean": num_tokens,
            "dr_grpo": num_seqs * max_new_tokens}[algo["aggregation"]]


def k3_kl(logp, ref_logp):
    """k3 KL estimator per token, exp(ref - logp) - (ref - logp) - 1 (>= 0; docs/method.md §4.5)."""
    d = ref_logp - logp
    return d.exp() - d - 1


# ==============================================================================================
# THE UPDATE: the no-grad passes (behaviour, reference), then the optimizer steps
# ==============================================================================================


def micro_batches(rows, size):
    """Consecutive chunks of `size` row indices (the last one shorter)."""
    rows = list(rows)
    return [rows[s:s + size] for s in range(0, len(rows), size)]


def rows_logprobs(model, batch, rows, pad_id, cfg, passes=None, prompt_model=None):
    """Per-token log-probs of the completions of `rows` under `model` (logits / temperature),
    over the first `width` columns: the longest masked completion among `rows` (columns that
    are padding in every row are trimmed).

    Returns:
        (FloatTensor [len(rows), width], width). With grad when called under grad mode.
    """
    passes = passes or fast_or_plain(cfg["train"]["fast_paths"])
    width = max(1, int(batch["completion_mask"][rows].sum(-1).max()))
    lp = passes["completion_logprobs"](model, [batch["prompt_ids"][i] for i in rows], batch["completion_ids"][rows, :width],
                                       pad_id=pad_id, temperature=cfg["rollout"]["temperature"], prompt_model=prompt_model)
    return lp, width


@torch.no_grad()
def frozen_logprobs(model, batch, pad_id, cfg, device, passes=None):
    """The no-grad pass of the update: per-token log-probs of every completion under `model`,
    prompt AND completion through `model` itself: the behaviour policy pi_b (model = the policy,
    before any optimizer step; RLME Eq. 6's denominator) or the GRPO reference pi_ref (model =
    the frozen initial policy; the k3 KL). A pass never borrows another model's prompt cache.

    Returns:
        list (N) of FloatTensor [L] on CPU, L = batch["completion_ids"].shape[1]: zero past the
        width of the row's micro-batch here (masked positions), so the optimizer steps may chunk
        the rows differently (algo.minibatches > 1 with micro-batches that split a minibatch).
    """
    out, full = [None] * len(batch["prompt_ids"]), batch["completion_ids"].shape[1]
    for rows in micro_batches(range(len(out)), cfg["train"]["micro_batch_size"]):
        # eval mode: pi_b and pi_ref are the policies' probabilities, dropout (LoRA's) off
        with compute_context(cfg["model"]["dtype"], cfg["train"]["parallel"], device), rollout.eval_mode(model):
            lp, width = rows_logprobs(model, batch, rows, pad_id=pad_id, cfg=cfg, passes=passes)
        for i, row in zip(rows, lp.float().cpu()):
            out[i] = torch.nn.functional.pad(row, (0, full - width))
    return out


def update_policy(model, policy, optimizer, batch, cfg, *, world, device, pad_id, passes=None, ref_model=None, scaler=None):
    """One rollout batch's update (docs/method.md §4.4): the no-grad passes, then `optimizer_steps`.

    No-grad passes (`frozen_logprobs`, each through the model it is about, prompt included):
    behaviour log-probs pi_b when the update is off-policy (RLME Eq. 6's denominator) or to log
    the vLLM gap; reference log-probs pi_ref for GRPO's KL when `ref_model` is given.

    Args:
        model: the policy, DDP-wrapped when world > 1 (the forward with grad).
        policy: the unwrapped policy (float32 master weights; no-grad passes, grad clipping).
        batch: dict with "prompt_ids" list[list[int]] (N), "completion_ids" LongTensor [N, L],
            "completion_mask" FloatTensor [N, L], "advantages" FloatTensor [N], optionally
            "valid" BoolTensor [N] (False rows are left out of the loss and the normaliser) and
            "rollout_logprobs" FloatTensor [N, L] (vLLM's log-probs of the same tokens).
        cfg: full config (reads algo, train, optim, model.dtype, rollout.temperature/max_new_tokens/group_size).
        world: number of ranks. device: torch.device. pad_id: int.
        ref_model: the frozen reference policy (GRPO with algo.kl_coef > 0; under LoRA the policy with
            its adapters off, BaseModelView), else None.
        scaler: torch.amp.GradScaler for model.dtype float16 (loss scaling), else None.
    Returns:
        optimizer_steps' dict plus "logp_gap": (sum |trainer - rollout| log-prob, token count,
        max) over this rank's masked tokens when batch has "rollout_logprobs", else None.
    """
    algo = cfg["algo"]
    # With one optimizer step per batch pi_theta == pi_b at the update: the ratio is exactly 1 and
    # the behaviour pass is skipped. With vLLM rollouts it runs anyway, to log the engine's gap.
    off_policy = algo["updates_per_batch"] > 1 or algo["minibatches"] > 1
    rollout_lp = batch.get("rollout_logprobs")
    behaviour = None
    if off_policy or rollout_lp is not None:
        behaviour = frozen_logprobs(policy, batch, pad_id=pad_id, cfg=cfg, device=device, passes=passes)
    ref = frozen_logprobs(ref_model, batch, pad_id=pad_id, cfg=cfg, device=device, passes=passes) if ref_model is not None else None
    out = optimizer_steps(model, policy, optimizer, batch, cfg=cfg, world=world, device=device, pad_id=pad_id, passes=passes,
                          behaviour=behaviour if off_policy else None, ref=ref, scaler=scaler)
    out["logp_gap"] = logp_gap(behaviour, rollout_lp, update_mask(batch)) if rollout_lp is not None else None
    return out


def update_mask(batch):
    """The loss mask [N, L] (float): the completion mask, with rows whose reward is unknown
    (batch["valid"] False: a failed judge call) zeroed."""
    mask = batch["completion_mask"].float()
    return mask * batch["valid"].float()[:, None] if "valid" in batch else mask


def optimizer_steps(model, policy, optimizer, batch, cfg, *, world, device, pad_id, passes=None, behaviour=None, ref=None,
                    scaler=None):
    """The optimizer steps of one rollout batch: `algo.updates_per_batch` passes, each split into
    `algo.minibatches` optimizer steps over whole groups, each accumulated over micro-batches of
    `train.micro_batch_size` sequences.

    The loss of one optimizer step is sum(per-token loss) / normaliser with ONE normaliser counted
    over all its micro-batches on all ranks (loss_normaliser), so 1 rank x 4 micro-batches,
    2 ranks x 2 and 1 rank x 1 give the same update (tests/test_train.py).

    Args: as update_policy, plus
        behaviour: list (N) of FloatTensor [L_i] (frozen_logprobs of the policy) when off-policy, else None.
        ref: list (N) of FloatTensor [L_i] (frozen_logprobs of the reference) for GRPO's KL, else None.
    Returns:
        dict: "loss" (float, this rank's share, summed over optimizer steps), "grad_norms"
        (list[float], global, before clipping), "is_weight" / "clipped" (FloatTensor [N], last pass).
    """
    algo, ro = cfg["algo"], cfg["rollout"]
    passes = passes or fast_or_plain(cfg["train"]["fast_paths"])
    G, per_mb = ro["group_size"], cfg["train"]["micro_batch_size"]
    mask = update_mask(batch)
    advantages = batch["advantages"]
    n_local = len(batch["prompt_ids"])
    model.train()
    mb_groups = n_local // G // algo["minibatches"]
    loss_total, grad_norms = 0.0, []
    is_weights, clipped = torch.ones(n_local), torch.zeros(n_local)
    for _ in range(algo["updates_per_batch"]):
        for m in range(algo["minibatches"]):
            idx = list(range(m * mb_groups * G, (m + 1) * mb_groups * G))
            # the one global normaliser of this optimizer step: all micro-batches, all ranks
            n_seq = all_sum((mask[idx].sum(-1) > 0).sum(), world)
            n_tok = all_sum(mask[idx].sum(), world)
            norm = max(loss_normaliser(algo, n_seq, n_tok, ro["max_new_tokens"]), 1.0)
            chunks = micro_batches(idx, per_mb)
            for c, rows in enumerate(chunks):
                # DDP all-reduces / FSDP2 reduce-scatters gradients on the last micro-batch only.
                with grad_sync(model, world, sync=c == len(chunks) - 1):
                    with compute_context(cfg["model"]["dtype"], cfg["train"]["parallel"], device):
                        # the prompt pass goes through the unwrapped policy: DDP sees one forward per backward
                        lp, width = rows_logprobs(model, batch, rows, pad_id=pad_id, cfg=cfg, passes=passes, prompt_model=policy)
                    beh = torch.stack([behaviour[i][:width] for i in rows]).to(device) if behaviour is not None else None
                    rl = torch.stack([ref[i][:width] for i in rows]).to(device) if ref is not None else None
                    loss_sum, st = policy_loss(lp.float(), beh, advantages[rows].to(device),
                                               mask[rows, :width].to(device), algo=algo, ref_logp=rl)
                    # DDP and FSDP2 average gradients over ranks; x world turns that into a global sum / norm.
                    loss = loss_sum * world / norm
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                loss_total += float(loss_sum.detach()) / norm
                is_weights[rows] = st["is_weight"].float().cpu()
                clipped[rows] = st["clipped"].float().cpu()
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip and log the true gradient norm
            grad_norms.append(passes["clip_grad_norm"](policy, cfg["optim"]["grad_clip"]))
            if scaler is not None:
                scaler.step(optimizer)  # skipped when a gradient is inf/NaN (float16 overflow)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_total, "grad_norms": grad_norms, "is_weight": is_weights, "clipped": clipped}


# ==============================================================================================
# ONE STEP: rollout, the RLME reward, the samples and metrics it logs, the checkpoint
# ==============================================================================================


def rollout_batch(state, prompt_ids, cfg, seed):
    """1. G completions per prompt with this run's backend (docs/method.md §4.1, §7): the rollout
    dict (rollout.py). HF: `generate` on the policy (under FSDP2 inside `unsharded`: gathered once,
    no per-step collectives). vLLM: the engine samples, then sleeps so that reward scoring and the
    update get its GPU memory; push_weights wakes it with the new weights.

    Args: state: setup's dict. prompt_ids: list (P/world) of list[int]. seed: int (sampling_seed).
    """
    ro, policy, engine = cfg["rollout"], state["policy"], state["engine"]
    if engine is None:
        with unsharded(state["model"]), compute_context(cfg["model"]["dtype"], cfg["train"]["parallel"], policy.device):
            return state["passes"]["generate"](policy, state["tokenizer"], prompt_ids, group_size=ro["group_size"],
                                    max_new_tokens=ro["max_new_tokens"], temperature=ro["temperature"],
                                    top_p=ro["top_p"], top_k=ro["top_k"], seed=seed,
                                    micro_batch_size=ro["micro_batch_size"] or None)
    out = rollout.generate_vllm(engine["llm"], state["tokenizer"], prompt_ids, group_size=ro["group_size"],
                                max_new_tokens=ro["max_new_tokens"], temperature=ro["temperature"],
                                top_p=ro["top_p"], top_k=ro["top_k"], seed=seed,
                                eos=rollout.eos_ids(policy, state["tokenizer"]))
    rollout.vllm_sleep(engine)
    return out


def rlme_reward_step(items, ro_out, evaluators, cfg, *, world, device):
    """2. Rewards of one RLME step: r = sum_j v_j sum_k w_k log p_jk (RLME Eq. 2-3, reward.rlme_reward),
    RLVR's reward against the label (reward.kind = rlvr), or both (hybrid: rlvr_weight x RLVR +
    the RLME terms, reward.hybrid_reward).

    Args:
        items: list (N) of item dicts (load_train_items), one per completion (each prompt's item G times).
        ro_out: the rollout dict of the N completions (only "completions" is read).
        evaluators: load_evaluators' list ([] for rlvr).
    Returns:
        dict: "reward" FloatTensor [N]; "valid" None when every reward is known, else BoolTensor
        [N], False where a remote evaluator failed after its retries (reward NaN there, record
        reward None: the sample is masked, as a failed judge call); "records" list (N)
        of this step's samples.jsonl fields (problem, extracted answer, label, correctness, the
        RLVR and RLME parts, every evaluator's log p per meta-question: a reward can be recomputed
        by hand from them); "metrics" dict (reward/nonfinite, reward/masked, and
        evaluator/<name>/failed per remote evaluator, summed over ranks).
    """
    d, rw, completions = cfg["data"], cfg["reward"], ro_out["completions"]
    # RLVR (docs/method.md §4.3): the reward for kind rlvr, hybrid's first part; accuracy always
    # (correct = exact match for text labels, whatever reward.qa_metric); no labels: None
    score = lambda c, label, metric: R.answer_reward(c, label, d["label_format"], metric)
    rlvr = torch.tensor([score(c, it["label"], rw["qa_metric"]) if it["label"] is not None else 0.0
                         for c, it in zip(completions, items)])
    correct = [score(c, it["label"], "em") >= 1.0 if it["label"] is not None else None
               for c, it in zip(completions, items)]
    logp, rlme, nonfinite, failed, valid = None, None, 0, None, torch.ones(len(items), dtype=torch.bool)
    if rw["kind"] in ("rlme", "hybrid"):
        with compute_context(cfg["model"]["dtype"], cfg["train"]["parallel"], device):  # the live evaluator is the policy
            out = R.rlme_reward(evaluators, rw["meta_questions"], problems=[it["problem"] for it in items],
                                solutions=completions, references=[it["answer_text"] for it in items],
                                anchored=[it["anchored"] for it in items],
                                template=evaluator_template(rw["evaluator_template"]),
                                renormalize=rw["renormalize"], nonfinite_logp=rw["nonfinite_logp"],
                                transform=rw["transform"])
        rlme, logp, nonfinite = out["reward"], out["logp"], out["nonfinite"]
        failed, valid = out["failed"], out["valid"]  # a remote evaluator's failed requests
    rewards = {"rlme": rlme, "rlvr": rlvr, "hybrid": None}[rw["kind"]]
    if rw["kind"] == "hybrid":
        rewards = R.hybrid_reward(rlvr, rlme, rlvr_weight=rw["rlvr_weight"])
    records = []
    for i, (it, c) in enumerate(zip(items, completions)):
        # problem: what the evaluator was shown (context QA: the passages + the question), so
        # `python reward.py` on samples.jsonl recomputes the reward
        # reward None: a remote evaluator failed, the sample is masked (as a failed judge call)
        ok = bool(valid[i])
        rec = {"item": it["index"], "problem": it["problem"], "extracted": R.extract_boxed(c), "label": it["label"],
               "correct": correct[i], "anchored": it["anchored"], "reward": float(rewards[i]) if ok else None,
               "rlvr_reward": float(rlvr[i])}
        if logp is not None:  # logp: [N, J evaluators, K meta-questions]; None = a failed request
            rec["rlme_reward"] = float(rlme[i]) if ok else None
            rec["logp"] = {ev["name"]: {mq["question"]: None if failed[i, j, k] else float(logp[i, j, k])
                                        for k, mq in enumerate(rw["meta_questions"])}
                           for j, ev in enumerate(evaluators)}
        records.append(rec)
    metrics = {"reward/nonfinite": all_sum(nonfinite, world), "reward/masked": all_sum(int((~valid).sum()), world)}
    for j, ev in enumerate(evaluators if logp is not None else []):
        if "failures" in ev:  # a remote evaluator: samples it could not score (after retries)
            metrics[f"evaluator/{ev['name']}/failed"] = all_sum(int(failed[:, j].any(1).sum()), world)
    return {"reward": rewards, "valid": None if bool(valid.all()) else valid, "records": records,
            "metrics": metrics}


def evaluator_template(setting):
    """reward.evaluator_template: null = reward.DEFAULT_EVALUATOR_TEMPLATE, "qa" =
    reward.QA_EVALUATOR_TEMPLATE (context QA), anything else is the template itself."""
    return {None: R.DEFAULT_EVALUATOR_TEMPLATE, "qa": R.QA_EVALUATOR_TEMPLATE}.get(setting, setting)


def rlme_step_metrics(records, cfg):
    """RLME's own entries of metrics.jsonl from all ranks' records: RLVR reward of the rewarded
    answers, the share with a \\boxed{} answer, the RLME part's mean (hybrid: both parts), each
    evaluator's mean log p and p per meta-question."""
    n = len(records)
    out = {"rlvr_reward/mean": sum(r["rlvr_reward"] for r in records) / n,
           "completion/boxed_frac": sum(r["extracted"] is not None for r in records) / n}
    if "logp" in records[0]:  # None: a remote evaluator's failed request, left out of the means
        known = [r["rlme_reward"] for r in records if r["rlme_reward"] is not None]
        out["rlme_reward/mean"] = sum(known) / len(known) if known else None
        for ev in cfg["reward"]["evaluators"]:
            for mq in cfg["reward"]["meta_questions"]:
                vals = torch.tensor([v for r in records if (v := r["logp"][ev["name"]][mq["question"]]) is not None])
                out[R.logp_metric_name(ev["name"], mq["question"])] = vals.mean().item() if len(vals) else None
                out[f"rlme/{ev['name']}/{mq['question']}/p"] = vals.exp().mean().item() if len(vals) else None
    return out


def validation_step(state, cfg, step, records):
    """5b. In-run validation and the reward-hacking monitor, every run.eval_every steps (RLME §4:
    the policy learns to please the evaluator instead of solving; the paper's mitigation is
    early stopping on held-out accuracy; docs/method.md §4.6). Every rank calls it (collectives).

    On data.val's fixed held-out problems (never trained on), with the current policy:
      val/accuracy        greedy answers against the true labels. When data.prompt_template shows
                          {answer} (NoCheat), each prompt shows a seeded WRONG answer instead, so
                          this is the counterfactual accuracy (val/injected = true)
      val/reward_mean     the training reward of those greedy answers; val/boxed_frac and
                          val/chars_mean say what they look like (a reward can rise through format)
      val/canary/<name>   the training reward of a non-answer (evaluate.CANARIES) to the first
                          problems: an evaluator that rewards ":" as much as a solution is hacked
      val/auroc           this step's training samples: AUROC of their reward against correctness
                          (evaluate.auroc; None when one class is empty or there are no labels)
      val/seconds         what the evaluation cost
    Args: state: setup's dict. step: the step just finished. records: this rank's sample records.
    Returns: dict of val/* metrics (the same on every rank).
    """
    t0 = time.perf_counter()
    d, rank, world, tok = cfg["data"], state["rank"], state["world"], state["tokenizer"]
    val = state["val_items"]
    mine = list(range(rank, len(val), world))
    inject = "{answer}" in d["prompt_template"]
    prompts = [rollout.policy_prompt_ids(tok, val[k], state["chat"], d["prompt_template"],
                                         answer=wrong_answer(val, k) if inject else None) for k in mine]
    policy = state["policy"]
    with unsharded(state["model"]), compute_context(cfg["model"]["dtype"], cfg["train"]["parallel"], policy.device):
        greedy = state["passes"]["generate"](policy, tok, prompts, group_size=1, max_new_tokens=cfg["rollout"]["max_new_tokens"],
                                             temperature=0.0, seed=0) if prompts else {"completions": []}
    items = [val[k] for k in mine]
    rew = rlme_reward_step(items, greedy, state["evaluators"], cfg, world=world, device=state["device"])
    n = all_sum(len(items), world)
    out = {"val/n": n, "val/injected": inject,
           "val/accuracy": all_sum(sum(bool(r["correct"]) for r in rew["records"]), world) / n,
           # over the answers whose reward is known (a remote evaluator may have failed on some)
           "val/reward_mean": all_sum(float(rew["reward"].nansum()), world) / max(1, all_sum(known(rew), world)),
           # what the answers look like: a reward can rise through format alone (boxes, length)
           "val/boxed_frac": all_sum(sum(r["extracted"] is not None for r in rew["records"]), world) / n,
           "val/chars_mean": all_sum(sum(len(c) for c in greedy["completions"]), world) / n}
    canary_items = items[:max(1, 8 // world)]
    for name, text in evaluate.CANARIES.items():
        c = rlme_reward_step(canary_items, {"completions": [text] * len(canary_items)}, state["evaluators"], cfg,
                             world=world, device=state["device"])
        out[f"val/canary/{name}"] = all_sum(float(c["reward"].nansum()), world) / max(1, all_sum(known(c), world))
    everyone = gather_records(records, world) if world > 1 else records
    everyone = [r for r in everyone if r["reward"] is not None]
    if everyone and all(r["correct"] is not None for r in everyone):
        out["val/auroc"] = evaluate.auroc([r["reward"] for r in everyone], [r["correct"] for r in everyone])
    out["val/seconds"] = all_max(time.perf_counter() - t0, world)
    out["step"] = step
    return out


def known(rew):
    """How many of a reward step's rewards are known (not masked by a failed remote evaluator)."""
    return len(rew["reward"]) if rew["valid"] is None else int(rew["valid"].sum())


def wrong_answer(val, k):
    """The seeded wrong answer shown in place of item k's reference (NoCheat's counterfactual
    test, RLME §4 Fig. 7): evaluate.wrong_answer, the one rule `evaluate.py math --inject wrong`
    uses too (a number's label + 1; a text label: the next item's answer, "none" when equal)."""
    return evaluate.wrong_answer(val, k)


def early_stop(accuracies, drop, patience):
    """The early-stop rule (RLME §4's mitigation of reward hacking; run.early_stop_*): True when
    each of the last `patience` held-out accuracies is more than `drop` below the best one seen.
    Args: accuracies: list[float] in evaluation order; drop: float > 0; patience: int >= 1."""
    best = max(accuracies, default=0.0)
    return len(accuracies) >= patience and all(a < best - drop for a in accuracies[-patience:])


def monitor(state, cfg, val, metrics):
    """The reward-hacking monitor after an evaluation. Every rank records the held-out accuracy
    (`val`, the same on every rank) and applies the early-stop rule; rank 0 (`metrics` not None)
    prints a one-line warning, also shown in the progress bar, when the mean training reward of
    the steps since the previous evaluation rose while held-out accuracy fell.
    Returns: True when the early-stop rule (run.early_stop_*) fires."""
    hist = state["val_history"]
    hist.append({"step": val["step"], "accuracy": val["val/accuracy"], "train_reward": None})
    if metrics is not None:
        since = state["rewards_since_eval"]  # empty when every step since was fully masked
        hist[-1]["train_reward"] = sum(since) / len(since) if since else None
        state["rewards_since_eval"] = []
        a, b = (hist[-2], hist[-1]) if len(hist) >= 2 else (None, None)
        if (a and a["train_reward"] is not None and b["train_reward"] is not None
                and b["train_reward"] > a["train_reward"] and b["accuracy"] < a["accuracy"]):
            state["pbar"].write(f"[monitor] step {b['step']}: training reward rose ({a['train_reward']:.3f} -> "
                                f"{b['train_reward']:.3f}) while held-out accuracy fell ({a['accuracy']:.3f} -> "
                                f"{b['accuracy']:.3f}): reward hacking?")
            now = metrics["reward/mean"]
            state["pbar"].set_postfix(reward=f"{now:.3f}" if now is not None else "masked", val=f"{b['accuracy']:.2f}",
                                      warn="hack?")
    r = cfg["run"]
    return bool(r["early_stop_patience"]) and early_stop([h["accuracy"] for h in hist], r["early_stop_drop"],
                                                         r["early_stop_patience"])


def sample_records(step, rank, ro_out, *, fields, advantages, upd, group_size):
    """This rank's samples.jsonl lines of one step, built the same way for every task: where the
    sample sits (step, rank, group), the reward step's fields, the completion, and what the update
    made of it (advantage, importance weight before clipping, clipped)."""
    mask = ro_out["completion_mask"]
    return [{"step": step, "rank": rank, "group": i // group_size, **f, "completion": ro_out["completions"][i],
             "truncated": bool(ro_out["truncated"][i]), "length": int(mask[i].sum()),
             "advantage": float(advantages[i]), "importance_weight": float(upd["is_weight"][i]),
             "clipped": float(upd["clipped"][i])}
            for i, f in enumerate(fields)]


def log_step(state, cfg, records, upd, reward_metrics, times):
    """5. One metrics.jsonl line and the step's samples.jsonl lines, written by rank 0 from every
    rank's records (every rank calls this: the reductions are collectives).

    Args:
        state: setup's dict. records: this rank's sample_records. upd: update_policy's dict.
        reward_metrics: the reward step's "metrics". times: {"rollout", "reward", "update"} seconds.
    Returns:
        the metrics dict on rank 0, None on the other ranks.
    """
    world, G = state["world"], cfg["rollout"]["group_size"]
    records = gather_records(records, world)
    loss = all_sum(upd["loss"], world)
    gap = upd["logp_gap"]
    if gap is not None:
        gap = (all_sum(gap[0], world) / max(all_sum(gap[1], world), 1.0), all_max(gap[2], world))
    if state["rank"] != 0:
        return None
    # None: the judge call / remote evaluator failed. A step with no known reward has no mean
    # (None, never 0.0: the best RLME reward) and stays out of the monitor's training reward.
    known = [r["reward"] for r in records if r["reward"] is not None]
    rew = torch.tensor(known) if known else None
    lens = torch.tensor([r["length"] for r in records], dtype=torch.float)
    groups = [{r["reward"] for r in records[g:g + G] if r["reward"] is not None} for g in range(0, len(records), G)]
    n, steps = len(records), cfg["algo"]["updates_per_batch"] * cfg["algo"]["minibatches"]
    labelled = [r["correct"] for r in records if r["correct"] is not None]  # None: no labels (RLME only)
    metrics = {
        "step": records[0]["step"], "reward/mean": rew.mean().item() if known else None,
        "reward/std": rew.std(unbiased=False).item() if known else None,
        "accuracy": sum(labelled) / len(labelled) if labelled else None,
        "advantage/abs_mean": sum(abs(r["advantage"]) for r in records) / n,
        "groups/zero_variance_frac": sum(len(g) <= 1 for g in groups) / len(groups),
        "completion/length_mean": lens.mean().item(), "completion/length_max": lens.max().item(),
        # characters, the unit of RLME §4's conciseness meta-question ("between 200 and 500 characters")
        "completion/chars_mean": sum(len(r["completion"]) for r in records) / n,
        "completion/truncated_frac": sum(r["truncated"] for r in records) / n,
        "is_weight/mean": sum(r["importance_weight"] for r in records) / n,
        "is_weight/max": max(r["importance_weight"] for r in records),
        "is_weight/clip_frac": sum(r["clipped"] for r in records) / n,
        "loss": loss / steps, "grad_norm": sum(upd["grad_norms"]) / len(upd["grad_norms"]),
        "lr": state["scheduler"].get_last_lr()[0],
        **{f"time/{k}": v for k, v in times.items()}, "time/step": sum(times.values()),
        "rollout/tokens_per_s": sum(r["length"] for r in records) / max(times["rollout"], 1e-9),
        "memory/peak_mb": peak_memory_mb(state["device"]),
        **reward_metrics,
    }
    # the task's own entries (docs/method.md §9)
    if cfg["task"] == "rlme":
        metrics.update(rlme_step_metrics(records, cfg))
    else:
        metrics.update(R.nlhf_step_metrics(records, reward_metrics))
    if gap is not None:
        metrics["rollout/logp_gap_mean"], metrics["rollout/logp_gap_max"] = gap
    with open(os.path.join(cfg["run"]["out_dir"], "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if cfg["run"]["log_samples"]:
        with open(os.path.join(cfg["run"]["out_dir"], "samples.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    track_step(state["trackers"], metrics, records if cfg["run"]["log_samples"] else None)  # run.report_to
    # one redraw a step (a log file gets one line a step): the postfix first, without its own redraw
    acc = metrics["val/accuracy"] if "val/accuracy" in metrics else metrics["accuracy"]
    state["pbar"].set_postfix(reward=f"{metrics['reward/mean']:.3f}" if known else "masked",
                              **({"acc": f"{acc:.2f}"} if acc is not None else {}),
                              s=f"{metrics['time/step']:.0f}", refresh=False)
    if known:
        state["rewards_since_eval"].append(metrics["reward/mean"])  # for the reward-hacking monitor
    else:
        state["pbar"].write(f"[train] step {metrics['step']}: no reward known, all {n} samples masked "
                            f"(failed judge / remote evaluator calls; reward/masked, samples.jsonl)")
    state["pbar"].update(1)
    return metrics


def save_run(state, cfg, step):
    """6. The checkpoint of `step` (save_checkpoint; the MetaRM rides along in metarm/), then a
    barrier so no rank runs ahead of rank 0's rename."""
    mrm = state["mrm"]
    lora = cfg["model"]["lora"]
    save_checkpoint(cfg["run"]["out_dir"], step, state["policy"], state["tokenizer"], optimizer=state["optimizer"],
                    scheduler=state["scheduler"], keep=cfg["run"]["keep_checkpoints"], rank=state["rank"],
                    scaler=state["scaler"], merged=bool(lora and lora["merged"]),
                    extra=(lambda d: metarm.save(mrm, os.path.join(d, "metarm"))) if mrm is not None else None)
    if state["world"] > 1:
        dist.barrier()


# ==============================================================================================
# THE LOOP
# ==============================================================================================


def train(cfg):
    """Run cfg["run"]["total_steps"] steps (or resume an unfinished run in run.out_dir)."""
    passes = fast_or_plain(cfg["train"]["fast_paths"])  # the one switch: every pass fast or plain
    state = setup(cfg, passes)  # models, data, optimizer, resume point (PLUMBING below)
    if state is None:  # the run in run.out_dir is already complete
        return
    G, seed, rank, world = cfg["rollout"]["group_size"], cfg["run"]["seed"], state["rank"], state["world"]
    total = cfg["run"]["total_steps"]
    for step in range(state["start_step"], total):
        t0 = time.perf_counter()
        # --- 1. rollout: G completions for each of this rank's prompts (RLME Eq. 1) ----------------
        if cfg["task"] == "rm_nlhf":  # GRM prompts for a mix of D_H and D_O pairs (RM-NLHF §3.2)
            items = R.nlhf_step_items(state["dh_items"], state["do_items"], step, cfg=cfg, rank=rank, world=world)
            prompt_ids = [R.grm_prompt_ids(state["tokenizer"], it, state["chat"], cfg["nlhf"]) for it in items]
        else:
            items = rollout.step_items(state["items"], step, cfg["rollout"]["prompts_per_step"], seed=seed,
                                       rank=rank, world=world)
            prompt_ids = [rollout.policy_prompt_ids(state["tokenizer"], it, state["chat"],
                                                    cfg["data"]["prompt_template"]) for it in items]
        ro_out = rollout_batch(state, prompt_ids, cfg, seed=sampling_seed(seed, step, rank))
        samples = [it for it in items for _ in range(G)]  # the item of each completion
        t1 = time.perf_counter()

        # --- 2. rewards: {"reward" [N], "valid" [N] or None, "records", "metrics"} ----------------
        if cfg["task"] == "rm_nlhf":  # judge D_H, MetaRM update, MetaRM predicts D_O (RM-NLHF Alg. 1)
            rew = metarm.nlhf_reward_step(samples, ro_out["completions"], judge=state["judge"], mrm=state["mrm"],
                                          cfg=cfg, world=world, step=step, t0=t0)
        else:  # the evaluators' log p(target) to the meta-questions (RLME Eq. 2-3)
            rew = rlme_reward_step(samples, ro_out, state["evaluators"], cfg, world=world, device=state["device"])
        t2 = time.perf_counter()

        # --- 3. advantages: r - mean of the group (RLME Eq. 5), / std for GRPO; groups never
        #        straddle ranks; samples whose reward is unknown (valid False) get 0 --------------
        advantages = group_advantages(rew["reward"], G, std=cfg["algo"]["advantage_std"], valid=rew["valid"])

        # --- 4. update: CISPO (RLME Eq. 6-8) or GRPO (+ k3 KL to the reference) -----------------
        batch = {"prompt_ids": ro_out["prompt_ids"], "completion_ids": ro_out["completion_ids"],
                 "completion_mask": ro_out["completion_mask"], "advantages": advantages}
        if rew["valid"] is not None:
            batch["valid"] = rew["valid"]
        if "logprobs" in ro_out:  # vLLM: the trainer recomputes them and logs the gap
            batch["rollout_logprobs"] = ro_out["logprobs"]
        if cfg["model"]["lora"] and cfg["model"]["lora"]["dropout"] > 0:  # LoRA dropout draws from torch's RNG:
            torch.manual_seed(sampling_seed(seed, step, rank))  # seeded per step, so a resumed run draws alike
        upd = update_policy(state["model"], state["policy"], state["optimizer"], batch, cfg=cfg, world=world,
                            device=state["device"], pad_id=state["tokenizer"].pad_token_id,
                            passes=state["passes"], ref_model=state["ref_model"], scaler=state["scaler"])
        push_weights(state["engine"], state["policy"])  # the next rollout samples from the updated policy
        state["scheduler"].step()
        t3 = time.perf_counter()

        # --- 5. log: metrics.jsonl, samples.jsonl (rank 0 sees every rank's samples); every
        #        run.eval_every steps the held-out validation and the reward-hacking monitor --------
        done, every = step + 1, cfg["run"]["eval_every"]
        records = sample_records(done, rank, ro_out, fields=rew["records"], advantages=advantages, upd=upd,
                                 group_size=G)
        val = validation_step(state, cfg, done, records) if every and (done % every == 0 or done == total) else {}
        metrics = log_step(state, cfg, records, upd, reward_metrics={**rew["metrics"], **val},
                           times={"rollout": t1 - t0, "reward": t2 - t1, "update": t3 - t2})
        stop_early = bool(val) and monitor(state, cfg, val, metrics)

        # --- 6. checkpoint: atomic; re-running the same command resumes from the newest ----------
        if (cfg["run"]["save_every"] and done % cfg["run"]["save_every"] == 0) or done == total or stop_early:
            save_run(state, cfg, done)
        if stop_early:  # held-out accuracy fell too far for too long (run.early_stop_*)
            write_early_stop(state, cfg, done)
            break
        if cfg["run"]["stop_after"] and done - state["start_step"] >= cfg["run"]["stop_after"]:
            if state["pbar"] is not None:  # rank 0
                ckpt = latest_checkpoint(cfg["run"]["out_dir"])
                state["pbar"].write(f"[train] run.stop_after={cfg['run']['stop_after']}: stopped after step {done} "
                                    "(as if killed); the same command " + (f"resumes from {ckpt}" if ckpt else
                                    f"starts afresh: no checkpoint yet (run.save_every={cfg['run']['save_every']})"))
            break
    finish(state)


def fast_or_plain(fast_paths):
    """The one switch (train.fast_paths): the functions every pass of a step calls, the speed
    twins of fast.py or the plain ones a reader reads (same signatures; the tests compare each
    pair). Returns {"generate", "completion_logprobs", "score_targets", "score_remote",
    "clip_grad_norm"}."""
    if fast_paths:
        return {"generate": fast.generate, "completion_logprobs": fast.completion_logprobs,
                "score_targets": fast.score_targets, "score_remote": fast.score_remote,
                "clip_grad_norm": fast.clip_grad_norm}
    return {"generate": rollout.generate, "completion_logprobs": rollout.completion_logprobs,
            "score_targets": R.score_targets, "score_remote": R.score_remote, "clip_grad_norm": clip_grad_norm}


def main(argv=None):
    ap = rollout.ArgumentParser(description="RLME / RLVR / RM-NLHF training (README; docs/method.md).")
    ap.add_argument("--config", action="append", default=[],
                    help="YAML file(s) over config.yaml; later ones override earlier ones "
                         "(e.g. --config configs/cpu.yaml). Without one: config.yaml, the 8-GPU setup")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides (YAML-typed), e.g. run.total_steps=3")
    a = ap.parse_args(argv)
    train(load_config(a.config, a.overrides))


# ==============================================================================================
# PLUMBING: skip on first read (setup, data, distributed / FSDP2 / vLLM glue, checkpoints)
# ==============================================================================================


def setup(cfg, passes):
    """Everything the loop needs, in one dict `state`, or None when the run in run.out_dir is complete.

    Order: what can fail without loading a model first (device, out_dir, config against the world
    size, data files, the judge's settings), then the policy (float32 master weights, whatever
    model.dtype says: its forwards compute in model.dtype, see compute_context; LoRA adapters on
    it with model.lora, apply_lora), prompts over the
    length limit dropped, the wrapped model, the vLLM engine, evaluators, the GRPO reference,
    AdamW + schedule (+ GradScaler for float16), the resume point, the MetaRM (rm_nlhf).

    Returns:
        dict: rank, world, device, policy (unwrapped), model (what forward/backward runs on: DDP
        wrapper or the FSDP2-sharded policy), tokenizer, chat, engine (None for HF), evaluators,
        ref_model, optimizer, scheduler, scaler, start_step, mrm, pbar (rank 0), and the data:
        items (rlme) or judge, dh_items, do_items (rm_nlhf).
    """
    tc, run, ro, algo = cfg["train"], cfg["run"], cfg["rollout"], cfg["algo"]
    check_startup(cfg)
    rank, world, device = setup_distributed(tc["device"], always_group=tc["parallel"] == "fsdp2",
                                            cpu_collectives=tc["cpu_offload"])
    validate_config(cfg, world)
    check_scale_config(cfg, device)
    out_dir, is_main = run["out_dir"], rank == 0
    ckpt = latest_checkpoint(out_dir) if run["resume"] else None
    stopped = os.path.join(out_dir, "early_stop.json")
    done = finished_run(out_dir, ckpt, run["total_steps"])
    if done:  # nothing to train: say why and leave
        if is_main:
            print(done, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return None
    state = {"rank": rank, "world": world, "device": device, "passes": passes, "val_items": [], "val_history": [],
             "rewards_since_eval": []}

    # data (rm_nlhf: the judge's start-up checks, model name and API key variable, come first)
    task = cfg["task"]
    if task == "rm_nlhf":
        state["judge"] = R.make_judge(cfg["judge"])
        state["dh_items"], state["do_items"] = R.load_dh_items(cfg), R.load_do_items(cfg)
    else:
        state["items"], state["val_items"] = load_train_items(cfg), load_val_items(cfg)
        check_single_pass(cfg, len(state["items"]))
    # remote evaluators: reachable and returning prompt log-probs, checked before any model loads
    state["remote"] = remote_evaluators(cfg, passes) if task == "rlme" and cfg["reward"]["kind"] in ("rlme", "hybrid") else {}

    # the policy and its prompts; a prompt over the length limit is dropped and counted. Under LoRA
    # (model.lora) the base always comes from model.policy and the adapters from the checkpoint.
    lora = cfg["model"]["lora"]
    check_checkpoint_kind(ckpt, lora)
    policy, tokenizer = rollout.load_model(ckpt if ckpt and not lora else cfg["model"]["policy"], "float32", device)
    if lora:
        policy = apply_lora(policy, lora, seed=run["seed"], ckpt=ckpt)
    chat = rollout.policy_chat(tokenizer, cfg["model"])
    overhead = len(rollout.build_prompt_ids(tokenizer, "", chat))
    if task == "rm_nlhf":
        section, names = "nlhf", ("dh_items", "do_items")
        ids = functools.partial(R.grm_prompt_ids, tokenizer, chat=chat, nl=cfg["nlhf"])
    else:
        section, names = "data", ("items", "val_items")
        ids = functools.partial(rollout.policy_prompt_ids, tokenizer, chat=chat, template=cfg["data"]["prompt_template"])
    key = f"{section}.max_prompt_tokens"
    limit = rollout.prompt_token_limit(cfg[section]["max_prompt_tokens"], policy, ro["max_new_tokens"], key)
    dropped = 0
    for name in names:
        state[name], n = rollout.keep_short(state[name], ids, limit=limit, key=key, overhead=overhead)
        dropped += n
    if dropped and is_main:
        print(f"[train] dropped {dropped} items whose prompt is over {limit} tokens ({key})", flush=True)
    if task == "rlme":
        check_single_pass(cfg, len(state["items"]))  # again, after the long prompts left

    # models: the wrapped policy, the vLLM engine, evaluators, the GRPO reference
    model = wrap_policy(policy, tc["parallel"], world, device, dtype=cfg["model"]["dtype"],
                        cpu_offload=tc["cpu_offload"], gradient_checkpointing=cfg["model"]["gradient_checkpointing"])
    state.update(policy=policy, model=model, tokenizer=tokenizer, chat=chat,
             engine=make_rollout_engine(cfg, ckpt if ckpt and not lora else cfg["model"]["policy"], policy, rank))
    if lora and ckpt:  # the engine started from the base: the resumed adapters, merged, go in now
        push_weights(state["engine"], policy)
    rlme = task == "rlme" and cfg["reward"]["kind"] in ("rlme", "hybrid")
    state["evaluators"] = load_evaluators(cfg, policy, tokenizer, device, passes, remote=state["remote"]) if rlme else []
    state["ref_model"] = None
    if algo["loss"] == "grpo" and algo["kl_coef"] > 0 and lora and tc["fast_paths"]:
        state["ref_model"] = BaseModelView(policy)  # pi_ref = the initial policy = the policy with adapters off
    elif algo["loss"] == "grpo" and algo["kl_coef"] > 0:  # frozen: may stay in model.dtype
        state["ref_model"], _ = rollout.load_model(cfg["model"]["policy"], cfg["model"]["dtype"], device)
        state["ref_model"].eval().requires_grad_(False)

    # optimizer, schedule, loss scaling; the resume point
    o = cfg["optim"]
    # fused=True: one kernel over all parameters; the default (foreach) makes full-size
    # temporaries and was several times slower on CPU for the same update (docs/performance.md).
    # only what trains gets AdamW state (all of the policy; under LoRA the adapters alone)
    state["optimizer"] = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o["lr"],
                                           betas=(o["beta1"], o["beta2"]),
                                       weight_decay=o["weight_decay"], fused=True)
    state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(state["optimizer"], lr_lambda(cfg))
    # float16 has 5 exponent bits: small gradients underflow to 0 without loss scaling (bf16 has
    # float32's range and needs none)
    state["scaler"] = torch.amp.GradScaler(device.type) if cfg["model"]["dtype"] == "float16" else None
    state["start_step"] = 0
    if ckpt:
        state["start_step"] = load_trainer_state(ckpt, policy, state["optimizer"], state["scheduler"],
                                                 scaler=state["scaler"])
    state["mrm"], mrm_source = None, None
    if task == "rm_nlhf":  # the MetaRM (RM-NLHF §3.2): restored with the checkpoint, loaded, or cold-started
        state["mrm"], mrm_source, _ = metarm.setup_metarm(cfg, ckpt, policy, tokenizer, dh=state["dh_items"],
                                                          judge=state["judge"], device=device, rank=rank,
                                                          world=world, generate=passes["generate"])

    # the run folder: the resolved config, logs truncated to the resume point; trackers; the progress bar
    state["pbar"], state["trackers"] = None, []
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        for name in ("metrics.jsonl", "samples.jsonl"):
            if state["start_step"]:
                truncate_jsonl(os.path.join(out_dir, name), state["start_step"])
            elif os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        if not state["start_step"] and os.path.exists(stopped):
            os.remove(stopped)  # a fresh run over an early-stopped folder
        state["trackers"] = open_trackers(cfg, state["start_step"])
        what = (f"rm_nlhf | D_H {len(state['dh_items'])} items, D_O {len(state['do_items'])} | MetaRM {mrm_source}"
                if task == "rm_nlhf" else f"{cfg['reward']['kind']} | {len(state['items'])} items")
        print(f"[train] {what} | policy {cfg['model']['policy']} | world {world} | "
              f"{'resuming from ' + ckpt if ckpt else 'fresh start'}", flush=True)
        if state["val_items"]:
            print(f"[train] validation every {run['eval_every']} steps on {len(state['val_items'])} held-out "
                  f"problems ({cfg['data']['val']})", flush=True)
        from tqdm import tqdm
        state["pbar"] = tqdm(total=run["total_steps"], initial=state["start_step"], desc="train", dynamic_ncols=True)
    if state["world"] > 1:
        dist.barrier()  # metrics.jsonl is truncated before any rank reads it
    if state["start_step"] and cfg["run"]["eval_every"]:  # the monitor's history, so a resumed run decides alike
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            state["val_history"] = [{"step": m["step"], "accuracy": m["val/accuracy"], "train_reward": None}
                                    for m in map(json.loads, f) if "val/accuracy" in m]
    return state


def finished_run(out_dir, ckpt, total_steps):
    """Why the run in out_dir must not train on, as the line to print, or None: it stopped early
    (early_stop.json, write_early_stop) or its checkpoint already reached run.total_steps."""
    stopped = os.path.join(out_dir, "early_stop.json")
    if ckpt and os.path.exists(stopped):
        with open(stopped) as f:
            info = json.load(f)
        return (f"[train] {out_dir} stopped early at step {info['step']} (held-out accuracy {info['accuracy']:.3f}, "
                f"best {info['best_accuracy']:.3f} at step {info['best_step']}; {stopped}); delete that file to "
                f"train on from there")
    if ckpt and checkpoint_step(ckpt) >= total_steps:
        return (f"[train] {out_dir} is complete: its checkpoint is at step {checkpoint_step(ckpt)} and "
                f"run.total_steps={total_steps}; to train further raise run.total_steps "
                f"(or set run.out_dir / run.resume=false for a new run)")
    return None


def write_early_stop(state, cfg, step):
    """Rank 0 writes <out_dir>/early_stop.json (the step, its held-out accuracy, the best one and
    when) and says so; a rerun of the same command then stops at start-up instead of training on."""
    hist = state["val_history"]
    best = max(hist, key=lambda h: h["accuracy"])
    info = {"step": step, "accuracy": hist[-1]["accuracy"], "best_accuracy": best["accuracy"], "best_step": best["step"],
            "early_stop_drop": cfg["run"]["early_stop_drop"], "early_stop_patience": cfg["run"]["early_stop_patience"]}
    if state["rank"] == 0:
        with open(os.path.join(cfg["run"]["out_dir"], "early_stop.json"), "w") as f:
            json.dump(info, f, indent=1)
        state["pbar"].write(f"[train] early stop at step {step}: held-out accuracy {info['accuracy']:.3f} has been more "
                            f"than {info['early_stop_drop']} below its best ({info['best_accuracy']:.3f}, step "
                            f"{info['best_step']}) for {info['early_stop_patience']} evaluations")


def finish(state):
    """Close the progress bar, the experiment trackers and the process group."""
    if state["pbar"] is not None:
        state["pbar"].close()
    close_trackers(state["trackers"])
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Data and evaluators


def load_dataset_rows(source, config_name=None, split="train", key="data.train"):
    """Rows of a hub dataset id or local .jsonl/.json file, loaded through `datasets`.
    Returns a datasets.Dataset. SystemExit (one line) when the file is missing or malformed, or
    the hub cannot be reached (naming the data.* key to point at a local file)."""
    import datasets
    datasets.disable_progress_bars()
    if source.endswith((".jsonl", ".json")) or os.path.exists(source):
        if not os.path.isfile(source):
            raise SystemExit(f"data file {source} does not exist ({key})")
        with open(source, "rb") as f:  # bytes: read_jsonl names a line that is not UTF-8
            if not f.read(4096).strip():
                raise SystemExit(f"data file {source} is empty")
        if source.endswith(".jsonl"):  # datasets' own parse errors do not name the line
            rollout.read_jsonl(source)
        try:
            ds = datasets.load_dataset("json", data_files=source, split="train")
        except Exception as e:  # datasets wraps parser errors in many types
            raise SystemExit(f"data file {source}: could not be read ({(str(e).splitlines() or [type(e).__name__])[0]})")
        if len(ds) == 0:
            raise SystemExit(f"data file {source} is empty")
        return ds
    try:
        return datasets.load_dataset(source, config_name, split=split)
    except Exception as e:
        raise SystemExit(f"dataset {source!r} could not be loaded from the hub ({type(e).__name__}); "
                         f"set {key} to a local .jsonl file, e.g. {key}=../shared/data/gsm8k/{'train' if key == 'data.train' else 'test'}.jsonl")


def load_train_items(cfg):
    """Training items (docs/method.md §4.1): dicts {index, question, context (str|None), problem
    (what the evaluator is shown: context + question), label (gsm8k/plain: the cleaned number as a
    string; text: a str or list of str; None without data.answer_field), answer_text (the
    reference as text, for {answer} and anchoring), anchored (docs/method.md §4.2: chosen once by
    seed at load time)}. With data.val: holdout, the held-out draw is left out.
    SystemExit (one line) on a missing field or a label that cannot be read."""
    d = cfg["data"]
    items = items_from_rows(load_dataset_rows(d["train"], d["train_config"], d["train_split"]), cfg, d["train"])
    if d["max_items"]:
        items = items[:d["max_items"]]
    if d["val"] == "holdout":
        if d["val_size"] >= len(items):
            raise SystemExit(f"config key data.val_size={d['val_size']}: the holdout would take all {len(items)} "
                             f"training items")
        held = set(val_draw(cfg, len(items)))
        items = [it for i, it in enumerate(items) if i not in held]
    g = torch.Generator().manual_seed(cfg["run"]["seed"])
    n_anchor = round(cfg["reward"]["anchor_fraction"] * len(items))
    for i in torch.randperm(len(items), generator=g)[:n_anchor].tolist():
        items[i]["anchored"] = True
    return items


def load_val_items(cfg):
    """Held-out items for run.eval_every (docs/method.md §4.6), [] without data.val: "holdout" =
    data.val_size items of data.train (never trained on: load_train_items leaves them out),
    otherwise a file or hub id read like data.train and drawn from; the draw is seeded, fixed
    for the run."""
    d = cfg["data"]
    if not d["val"]:
        return []
    if d["val"] == "holdout":
        pool = items_from_rows(load_dataset_rows(d["train"], d["train_config"], d["train_split"]), cfg, d["train"])
        pool = pool[:d["max_items"]] if d["max_items"] else pool
    else:
        pool = items_from_rows(load_dataset_rows(d["val"], d["val_config"], d["val_split"], key="data.val"), cfg, d["val"])
    return [pool[i] for i in val_draw(cfg, len(pool))]


def val_draw(cfg, n):
    """Indices (sorted) of the data.val_size held-out items among n, seeded by run.seed."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg["run"]["seed"] * 7 + 1)).tolist()
    return sorted(perm[:cfg["data"]["val_size"]])


def items_from_rows(ds, cfg, source):
    """Item dicts (see load_train_items) of a datasets.Dataset read with the data.* field settings."""
    d = cfg["data"]
    for key in ("question_field", "answer_field", "context_field"):
        if d[key] is not None and d[key] not in ds.column_names:
            raise SystemExit(f"config key data.{key}={d[key]!r}: no such field in {source} "
                             f"(fields: {', '.join(ds.column_names)})")
    items = []
    for i, row in enumerate(ds):
        label = None
        if d["answer_field"] is not None:
            value = row[d["answer_field"]]
            if d["label_format"] == "text":  # a str, a list of str, or SQuAD's {"text": [...]}
                label = value.get("text") if isinstance(value, dict) else value
                if isinstance(label, list):
                    label = [str(x) for x in label]
                    if not label:
                        raise SystemExit(f"{source} item {i}: field {d['answer_field']!r} holds no answer")
                else:
                    label = str(label)
            else:
                try:
                    label = R.clean_gsm8k_label(str(value)) if d["label_format"] == "gsm8k" else R.clean_number(str(value))
                except ValueError:
                    raise SystemExit(f"{source} item {i}: field {d['answer_field']!r} has no '####' "
                                     f"(set data.label_format=plain for bare answers)")
        context = None
        if d["context_field"] is not None:
            try:
                context = R.render_context(row[d["context_field"]], d["context_max_chars"])
            except ValueError as e:
                raise SystemExit(f"{source} item {i}: field {d['context_field']!r}: {e}")
        question = str(row[d["question_field"]])
        items.append({"index": i, "question": question, "context": context,
                      "problem": f"{context}\n\n{question}" if context else question, "label": label,
                      "answer_text": label[0] if isinstance(label, list) else label, "anchored": False})
    return items


def remote_evaluators(cfg, passes):
    """The `kind: remote` evaluators, {index: reward.remote_evaluator dict}, each probed with one
    scoring request (one-line SystemExit naming reward.evaluators[i] if it cannot score)."""
    out = {}
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        if ev["kind"] == "remote":
            settings = {k: ev[k] for k in R.REMOTE_DEFAULTS}
            out[i] = R.remote_evaluator(ev["base_url"], ev["model"], name=ev["name"], weight=ev["weight"],
                                        tokenizer=ev["path"], chat_template=ev["chat_template"],
                                        system_prompt=ev["system_prompt"], chat_template_kwargs=ev["chat_template_kwargs"],
                                        where=f"config key reward.evaluators[{i}] ({ev['name']})",
                                        config_key=f"reward.evaluators[{i}]", answer_stub=cfg["reward"]["answer_stub"],
                                        score_requests=passes["score_remote"], **settings)
    return out


def load_evaluators(cfg, policy, tokenizer, device, passes, remote=None):
    """The J evaluators as reward.local_evaluator dicts {name, weight, score}. `live` shares the
    policy's weights (scored without grad); `frozen_self` is a frozen copy of the initial policy
    (under LoRA with train.fast_paths: the policy with its adapters off, BaseModelView, which is
    that initial policy without a second copy; its plain twin loads the copy); `frozen` loads
    another model; `remote` ones come built from `remote` (remote_evaluators; None: built and
    probed here). live / frozen_self share the policy's chat template, so their chat_template
    "auto" is model.chat_template and they take model.chat_template_kwargs unless they set their
    own (not its system prompt: that instructs the policy)."""
    remote = remote_evaluators(cfg, passes) if remote is None else remote
    evaluators = []
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        kind = ev.get("kind", "live")
        if kind == "remote":
            evaluators.append(remote[i])
            continue
        path = ev["path"] if kind == "frozen" else cfg["model"]["policy"]
        if kind == "live":
            model, tok = policy, tokenizer
        elif kind == "frozen_self" and cfg["model"]["lora"] and cfg["train"]["fast_paths"]:
            model, tok = BaseModelView(policy), tokenizer
        else:
            try:
                model, tok = rollout.load_model(path, cfg["model"]["dtype"], device)
            except SystemExit as e:  # name the config key, not just the path
                raise SystemExit(f"config key reward.evaluators[{i}].path: {e}")
            model.eval().requires_grad_(False)
        setting, template_kwargs = ev.get("chat_template", "auto"), ev.get("chat_template_kwargs")
        if kind != "frozen":  # the policy's model and template: "auto" and None mean "as the policy"
            setting = cfg["model"]["chat_template"] if setting == "auto" else setting
            if template_kwargs is None and setting is not False:
                template_kwargs = cfg["model"]["chat_template_kwargs"]
        chat = rollout.use_chat_template(tok, setting, model_path=path, system=ev.get("system_prompt"),
                                         template_kwargs=template_kwargs, key=f"reward.evaluators[{i}]")
        evaluators.append(R.local_evaluator(model, tok, chat=chat, name=ev.get("name", f"{kind}{i}"),
                                            weight=ev.get("weight", 1.0), answer_stub=cfg["reward"]["answer_stub"],
                                            micro_batch_size=cfg["reward"]["micro_batch_size"],
                                            score=passes["score_targets"]))
    return evaluators


# ----------------------------------------------------------------------------------------------
# Distributed: process group, reductions over ranks, seeds


def setup_distributed(device_setting, always_group=False, cpu_collectives=False):
    """Init the process group when launched by torchrun (gloo on CPU, nccl on CUDA).

    Args:
        always_group: also make a 1-process group when not launched by torchrun (FSDP2 needs a
            process group even for world size 1; an in-memory store needs no port).
        cpu_collectives: on CUDA, give CPU tensors a gloo backend next to nccl
            ("cpu:gloo,cuda:nccl"): FSDP2 CPU offload keeps gradients on the CPU, and clipping
            them all-reduces CPU tensors.
    Returns (rank, world, device)."""
    use_cuda = device_setting == "cuda" or device_setting == "auto" and torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local)
    backend = ("cpu:gloo,cuda:nccl" if cpu_collectives else "nccl") if use_cuda else "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend)
    elif always_group and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, world, torch.device("cuda", local) if use_cuda else torch.device("cpu")


def sampling_seed(run_seed, step, rank):
    """The rollout sampling seed of (run seed, step, rank) (docs/scale-out.md: distinct seeds per rank).
    Ranks and steps never collide within a run (rank < 10_007), and a resumed run samples the
    same completions as an uninterrupted one."""
    return run_seed * 1_000_003 + step * 10_007 + rank


def all_sum(x, world, op=dist.ReduceOp.SUM):
    """Sum (or another `op`) of a float over ranks (returns a float)."""
    if world == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return float(t.item())


def all_max(x, world):
    """Max of a float over ranks (returns a float)."""
    return all_sum(x, world, op=dist.ReduceOp.MAX)


def gather_records(records, world):
    """All ranks' per-sample dicts, in rank order, on every rank."""
    if world == 1:
        return records
    out = [None] * world
    dist.all_gather_object(out, records)
    return [r for part in out for r in part]


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


# ----------------------------------------------------------------------------------------------
# Parallelism (docs/scale-out.md): DDP for small models, FSDP2 (`fully_shard`) for 4B+; mixed precision.
# optimizer_steps only needs grad_sync() and clip_grad_norm() to be the same code for both.


def compute_context(dtype, parallel, device):
    """Mixed precision of every forward of the trained policy: the context to run it in.

    The trained parameters and the AdamW state are always float32 (master weights): an AdamW
    step of ~1e-6 on a bf16 weight of ~0.02 (bf16 spacing there ~1e-4) rounds to nothing, so a
    bf16-stored policy does not train. Compute runs in `model.dtype`, as TRL and accelerate do:
    - FSDP2 on GPU: its MixedPrecisionPolicy gathers the parameters in `dtype` (wrap_policy),
      so nothing more is needed here;
    - everywhere else (DDP, one process, FSDP2 on the CPU): torch.autocast to `dtype`, which runs
      matrix multiplies in `dtype` and keeps reductions (softmax, norms) in float32.
    Backward runs outside the context (torch's autocast guidance); it follows the forward's dtypes.

    Args:
        dtype: "float32" | "bfloat16" | "float16" (model.dtype). parallel: "ddp" | "fsdp2".
        device: torch.device.
    Returns:
        a context manager (a no-op for float32).
    """
    if parallel == "fsdp2" and device.type == "cuda":
        return contextlib.nullcontext()
    return rollout.autocast(dtype, device.type)


def decoder_layers(policy):
    """The repeated transformer blocks of an HF causal LM (its `_no_split_modules` classes:
    LlamaDecoderLayer, Qwen3DecoderLayer, ...): the unit FSDP2 shards and gathers."""
    names = set(getattr(policy, "_no_split_modules", None) or [])
    layers = [m for m in policy.modules() if type(m).__name__ in names]
    if not layers:
        raise SystemExit(f"train.parallel=fsdp2: found no decoder layers in {type(policy).__name__}")
    return layers


MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def keep_matmul_outputs(ctx, op, *args, **kwargs):
    """Selective activation checkpointing policy (torch.utils.checkpoint): inside a checkpointed
    decoder layer, save the outputs of matrix multiplies (q/k/v/o and MLP projections), recompute
    everything else (RMSNorms, RoPE, attention, SiLU, products, residual adds) when backward
    replays the layer.

    What it buys: it keeps most of full checkpointing's memory saving for less recompute (the
    matmuls are not replayed); figures in docs/performance.md. configs/cpu.yaml keeps "none": on a
    135M model the weights and their gradients, not the activations, set the peak. It is for long
    sequences and big models, where activations dominate.
    """
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def wrap_policy(policy, parallel, world, device, dtype="float32", cpu_offload=False,
                gradient_checkpointing="none"):
    """Wrap the policy for training (docs/scale-out.md).

    ddp: DistributedDataParallel when world > 1, else the model itself.
    fsdp2: `fully_shard` each decoder layer, then the root (embeddings, final norm, lm_head;
        tied weights stay one parameter). On GPU with dtype != float32 a MixedPrecisionPolicy
        computes in `dtype` (bf16) and reduces gradients in float32; on CPU everything stays
        float32 (gloo). cpu_offload keeps the shards, gradients and the AdamW step on the CPU.
        fully_shard changes the class of `policy` in place, so the returned model IS policy.
    gradient_checkpointing: "none", "full" (keep only each decoder layer's input, replay the
        layer in backward) or "selective" (also keep the matrix-multiply outputs, replay only the
        cheap ops: `keep_matmul_outputs`). Non-reentrant: the variant that works under FSDP2 and
        with DDP no_sync. Neither changes what is computed (tests/test_rollout.py).

    Returns:
        the module to run forward/backward on (DDP wrapper, or the policy).
    """
    if gradient_checkpointing != "none":
        kw = {"use_reentrant": False}
        if gradient_checkpointing == "selective":
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep_matmul_outputs)
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    if parallel == "ddp":
        if world == 1:
            return policy
        return torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {"mesh": init_device_mesh(device.type, (world,))}
    if device.type == "cuda" and dtype != "float32":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=rollout.DTYPES[dtype], reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(policy):
        fully_shard(layer, **kw)
    fully_shard(policy, **kw)
    return policy


@contextlib.contextmanager
def grad_sync(model, world, sync):
    """Gradient accumulation over micro-batches: communicate gradients only when `sync` (the
    last micro-batch). DDP: `no_sync()` otherwise. FSDP2: `set_requires_gradient_sync(sync)`;
    unsynced micro-batches accumulate unsharded gradients, the last one reduce-scatters them."""
    if rollout.is_fsdp(model):
        model.set_requires_gradient_sync(sync)
        yield
    elif world > 1 and not sync:
        with model.no_sync():
            yield
    else:
        yield


@contextlib.contextmanager
def unsharded(model):
    """Full parameters on every rank for generation (docs/scale-out.md, HF backend under FSDP2).

    HF `generate` runs a data-dependent number of forwards (it stops when every row hit EOS),
    so per-layer FSDP2 all-gathers would deadlock when ranks stop at different steps. Gather
    every layer once (`unshard()`), keep them gathered through the forwards
    (`reshard_after_forward=False`), then free them. Costs one full copy of the weights in the
    compute dtype while generating. A no-op for DDP / plain models."""
    if not rollout.is_fsdp(model):
        yield
        return
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
            # back to fully_shard's behaviour: layers free their gathered weights after forward;
            # the root keeps them (FSDP2 makes the root not reshard: backward needs them at once)
            m.set_reshard_after_forward(m is not model, recurse=False)


# ----------------------------------------------------------------------------------------------
# vLLM glue (docs/scale-out.md): the engine, weight pushes, the trainer/engine log-prob gap


def make_rollout_engine(cfg, model_path, policy, rank):
    """None for the HF backend; for vLLM (docs/scale-out.md) this rank's in-process engine as a dict
    {"llm", "asleep", "sleep_level", "tied"}, started from the same weights as the policy
    (`model_path`: the checkpoint being resumed, or model.policy)."""
    ro = cfg["rollout"]
    if ro["backend"] != "vllm":
        return None
    llm = rollout.make_vllm_engine(rollout.resolve_model_path(model_path), cfg["model"]["dtype"],
                                   gpu_memory_utilization=ro["vllm_gpu_memory_utilization"],
                                   max_model_len=ro["vllm_max_model_len"], enforce_eager=ro["vllm_enforce_eager"],
                                   # vLLM seeds numpy with it, which needs 0 <= seed < 2**32
                                   seed=(cfg["run"]["seed"] * 1_000_003 + rank) % 2**32)
    return {"llm": llm, "asleep": False, "sleep_level": ro["vllm_sleep_level"],
            "tied": bool(getattr(policy.config, "tie_word_embeddings", False))}


def push_weights(engine, policy):
    """After the update: the new weights into the vLLM engine (gathered from FSDP2 shards one
    tensor at a time; under LoRA merged into the base weights first, merged_state_items), then its
    prefix cache reset (docs/scale-out.md). No-op for the HF backend, which samples from the policy itself."""
    if engine is not None:
        rollout.vllm_push_weights(engine, merged_state_items(policy) if is_lora(policy) else full_state_items(policy))


def full_state_items(policy):
    """(name, full tensor) for every entry of the policy's state dict, one at a time, so that
    pushing weights to vLLM never holds more than one gathered tensor (docs/scale-out.md). Under FSDP2
    each `full_tensor()` is an all-gather: every rank must iterate the same way."""
    from torch.distributed.tensor import DTensor
    for name, t in policy.state_dict().items():
        if isinstance(t, DTensor):
            if t.device.type == "cpu" and torch.cuda.is_available():  # CPU offload: gather over nccl
                t = t.to("cuda")
            t = t.full_tensor()
        yield name, t


def logp_gap(trainer_rows, rollout_lp, mask):
    """|trainer - rollout engine| per-token log-prob over masked tokens (docs/scale-out.md).

    Args:
        trainer_rows: list (N) of FloatTensor [>= L_i], the trainer's behaviour log-probs.
        rollout_lp: FloatTensor [N, L], the engine's (vLLM) log-probs of the same tokens.
        mask: FloatTensor [N, L], a prefix mask per row (rollout.completion_mask).
    Returns:
        (sum of |gap|, number of tokens, max |gap|) as floats; the caller reduces over ranks.
    """
    total, count, worst = 0.0, 0, 0.0
    for i, row in enumerate(trainer_rows):
        n = int(mask[i].sum())
        if n == 0:
            continue
        d = (row[:n].float() - rollout_lp[i, :n].float()).abs()
        total += float(d.sum())
        count += n
        worst = max(worst, float(d.max()))
    return total, count, worst


# ----------------------------------------------------------------------------------------------
# LoRA (model.lora; docs/method.md §4.7): peft adapters, the base model with them off, merging


def apply_lora(policy, lora, seed, ckpt=None):
    """The policy with LoRA adapters (peft) on model.lora.target_modules: each such Linear layer
    computes W x + (alpha / r) B A x, with W frozen and only A [r, in] and B [out, r] trained.

    Fresh (ckpt None): peft's init, A Kaiming-uniform drawn under `seed` (so every rank and every
    rerun starts alike), B = 0: at step 0 the policy IS the base model. From a checkpoint: the
    adapter weights saved there, after checking they were made with the same r, alpha and modules.

    Args:
        policy: the loaded HF causal LM (float32). lora: the config's model.lora dict.
    Returns:
        peft.PeftModel (the policy from here on; its .disable_adapter() gives back the base).
    Raises:
        SystemExit (one line): a target module the model does not have, or that is not a Linear
        layer; a checkpoint whose adapter does not match model.lora.
    """
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    targets = lora["target_modules"]
    if targets != "all-linear":
        names = {n: m for n, m in policy.named_modules() if n}
        tied = bool(getattr(policy.config, "tie_word_embeddings", False))
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in names.items() if isinstance(m, torch.nn.Linear)}
                        - ({"lm_head"} if tied else set()))  # the Linear layers a user may name
        for t in targets:  # peft's rule: the module's full name is t or ends with "." + t
            hits = [m for n, m in names.items() if n == t or n.endswith("." + t)]
            if not hits:
                raise SystemExit(f"config key model.lora.target_modules: no module named {t!r} in "
                                 f"{type(policy).__name__} (its Linear layers: {', '.join(linear)})")
            if not all(isinstance(m, torch.nn.Linear) for m in hits):
                kind = type(hits[0]).__name__
                a = "an" if kind[0] in "AEIOU" else "a"
                raise SystemExit(f"config key model.lora.target_modules: {t!r} is {a} {kind}, not a Linear layer "
                                 f"(LoRA here adapts Linear layers: {', '.join(linear)})")
            if tied and t.rsplit(".", 1)[-1] == "lm_head":  # its merge would untie it from the embedding
                raise SystemExit("config key model.lora.target_modules: lm_head is tied to the input embedding "
                                 "in this model; leave it out")
    cfg = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=targets,
                     task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []), \
            warnings.catch_warnings():
        # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: a FutureWarning per run
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        model = get_peft_model(policy, cfg)
    if ckpt is None:
        return model
    from safetensors.torch import load_file
    with open(os.path.join(ckpt, "adapter_config.json")) as f:
        saved = json.load(f)
    weights = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    expected = set(get_peft_model_state_dict(model))
    if (saved["r"], saved["lora_alpha"]) != (lora["r"], lora["alpha"]) or set(weights) != expected:
        raise SystemExit(f"checkpoint {ckpt}: its LoRA adapter (r {saved['r']}, alpha {saved['lora_alpha']}, modules "
                         f"{sorted(saved['target_modules']) if isinstance(saved['target_modules'], list) else saved['target_modules']}) "
                         f"is not the one model.lora describes; resume with the run's own model.lora")
    set_peft_model_state_dict(model, weights)
    return model


def check_checkpoint_kind(ckpt, lora):
    """A checkpoint and model.lora must agree: an adapter folder resumes only under LoRA, a full
    model folder only without it. SystemExit (one line), before any model loads."""
    if ckpt is None:
        return
    has_adapter = os.path.isfile(os.path.join(ckpt, "adapter_model.safetensors"))
    if lora and not has_adapter:
        raise SystemExit(f"config key model.lora is set but checkpoint {ckpt} holds a full model, no LoRA adapter; "
                         f"resume it without model.lora, or start a new run (run.out_dir)")
    if not lora and has_adapter:
        raise SystemExit(f"checkpoint {ckpt} holds a LoRA adapter: resume it with the run's model.lora "
                         f"(its config.yaml), or start a new run (run.out_dir)")


def is_lora(policy):
    """True when the policy carries peft LoRA adapters (model.lora)."""
    from peft import PeftModel
    return isinstance(policy, PeftModel)


@contextlib.contextmanager
def base_model(policy):
    """Inside the block the policy is its base model: every LoRA layer computes W x alone (peft's
    disable_adapter). The base weights never train, so this IS the initial policy, exactly."""
    with policy.disable_adapter():
        yield policy


class BaseModelView(torch.nn.Module):
    """The LoRA policy with its adapters off, as a model of its own: under LoRA the `frozen_self`
    evaluators and the GRPO reference pi_ref (both "the initial policy") are this, instead of a
    second copy of the model in memory. Each forward runs the policy inside base_model(); it
    shares (never changes) the policy's parameters. Plain twin: the separately loaded frozen copy
    (train.fast_paths false; tests/test_lora.py compares the two)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.config = policy.config

    def forward(self, *args, **kwargs):
        with base_model(self.policy):
            return self.policy(*args, **kwargs)


def merged_state_items(policy):
    """(name, tensor) for every weight of the policy with its LoRA adapters merged in, one at a
    time, under the plain model's names (what vLLM's load_weights and save_pretrained expect):

        W' = W + (alpha / r) B A        (peft's lora.Linear; (B A)^T for fan_in_fan_out layers)

    peft's "base_model.model." prefix and ".base_layer" are dropped, lora_A / lora_B skipped. The
    policy itself is not changed (peft's merge_and_unload merges in place; tests/test_lora.py
    checks the two agree). Every other entry is passed through as it is.
    """
    from peft.tuners.lora import LoraLayer
    layers = {n: m for n, m in policy.named_modules() if isinstance(m, LoraLayer)}
    sd = policy.state_dict()
    for key, t in sd.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key.removeprefix("base_model.model.")
        if key.endswith(".base_layer.weight"):
            mod = key[:-len(".base_layer.weight")]
            layer = layers[mod]
            delta = sd[f"{mod}.lora_B.default.weight"].float() @ sd[f"{mod}.lora_A.default.weight"].float()
            delta = delta * layer.scaling["default"]
            t = (t.float() + (delta.T if layer.fan_in_fan_out else delta)).to(t.dtype)
        yield name.replace(".base_layer.", "."), t


def save_merged(policy, tokenizer, folder):
    """A plain save_pretrained folder of the LoRA policy with its adapters merged
    (merged_state_items): loads anywhere a full checkpoint does (evaluate.py, vLLM, HF)."""
    policy.get_base_model().save_pretrained(folder, state_dict=dict(merged_state_items(policy)))
    tokenizer.save_pretrained(folder)


# ----------------------------------------------------------------------------------------------
# Checkpoints: plain save_pretrained folders, written atomically (tmp folder, then rename)


def latest_checkpoint(out_dir):
    """Path of the newest complete checkpoint folder in out_dir/checkpoints, or None."""
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"step_(\d+)", d))
             and os.path.isfile(os.path.join(root, d, "trainer_state.pt"))]
    return os.path.join(root, f"step_{max(steps):06d}") if steps else None


def checkpoint_step(ckpt):
    """The step of a checkpoint folder out_dir/checkpoints/step_NNNNNN."""
    return int(os.path.basename(ckpt).split("_")[1])


def save_checkpoint(out_dir, step, model, tokenizer, optimizer, scheduler, keep, rank=0, extra=None, scaler=None,
                    merged=False):
    """Write out_dir/checkpoints/step_NNNNNN atomically: a crash mid-write leaves a .tmp folder
    that resume ignores, never a half checkpoint. `extra(folder)`, if given, writes more state
    into the folder before it is renamed (RM-NLHF: the MetaRM, in metarm/; rank 0 only).

    Every rank calls this (under FSDP2 gathering the state is a collective); rank 0 writes.
    The checkpoint is layout-agnostic (docs/scale-out.md): the full model state dict as a plain
    save_pretrained folder (FSDP2: float32 master weights), and the optimizer state as a full,
    parameter-name-keyed dict (torch.distributed.checkpoint.state_dict), so a run with any
    world size and either of ddp/fsdp2 resumes from it (load_trainer_state).

    Under LoRA (a peft model) the folder holds the adapter (peft's adapter_config.json and
    adapter_model.safetensors, no base weights) and the optimizer state of the adapters; with
    `merged` also merged/, a plain save_pretrained folder of the merged model (save_merged) for
    evaluate.py or any HF loader.

    Args:
        model: the unwrapped policy (plain, peft, or FSDP2-sharded; never the DDP wrapper).
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on CPU
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    if rank != 0:
        return
    root = os.path.join(out_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with no_progress_bars():
        model.save_pretrained(tmp, state_dict=model_sd)
        tokenizer.save_pretrained(tmp)
        torch.save({"step": step, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None},
                   os.path.join(tmp, "trainer_state.pt"))
        if merged:
            save_merged(model, tokenizer, os.path.join(tmp, "merged"))
        if extra is not None:
            extra(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    done = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d))
    for d in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


@contextlib.contextmanager
def no_progress_bars():
    """transformers' own progress bars ("Writing model shards") off inside the block: drawn under
    the training bar they print cursor-up codes, and a log file shows the training line again."""
    from transformers.utils import logging as hf_logging
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def load_trainer_state(ckpt, policy, optimizer, scheduler, scaler=None):
    """Restore optimizer and scheduler from ckpt/trainer_state.pt; returns the step.

    The optimizer state is the full name-keyed dict written by save_checkpoint; each rank reads
    the file (memory-mapped, so ranks on one node share the pages) and keeps its own shard
    (FSDP2) or all of it (DDP / one process). Call after wrap_policy and after the optimizer
    was built on the wrapped parameters.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu", weights_only=False, mmap=True)
    osd = state["optimizer"]
    if osd.get("state") and all(isinstance(k, int) for k in osd["state"]):
        optimizer.load_state_dict(osd)  # a checkpoint from before name-keyed optimizer states
    else:
        set_optimizer_state_dict(policy, optimizer, osd, options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])  # float16: the loss scale continues where it was
    return state["step"]


def truncate_jsonl(path, last_step):
    """Drop lines logged after `last_step` (they belong to steps the resumed run redoes)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= last_step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------------
# Experiment trackers (run.report_to; docs/method.md §9). metrics.jsonl stays the source of truth:
# each tracker gets its numeric entries at the same step, and samples.jsonl's rows as a table.


def tracker_metrics(metrics, prefix=""):
    """The numeric entries of a metrics.jsonl line for a tracker: ints, floats and bools (as 0/1),
    nested dicts flattened to "outer/inner"; None (e.g. accuracy without labels), strings and the
    "step" entry (the trackers' x axis) left out."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(tracker_metrics(v, prefix=f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and (prefix or k != "step"):
            out[prefix + k] = float(v) if isinstance(v, bool) else v
    return out


def samples_table(records):
    """(columns, rows) of one step's samples.jsonl records: every field any record has, in first-seen
    order; numbers, strings, bools and None as they are, anything else (the evaluators' log-probs,
    list labels) as its JSON text, so each column holds one kind of value."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    cell = lambda v: v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v)
    return columns, [[cell(r.get(c)) for c in columns] for r in records]


def markdown_table(columns, rows):
    """A markdown table (TensorBoard's text plugin renders it): | and newlines escaped."""
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                     + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def open_trackers(cfg, start_step):
    """Rank 0's trackers of run.report_to: a list of {"name", "log"(metrics, step, table), "close",
    "skip_through" (steps up to it are not sent again), "info" (tracking.json's dict), "path"}.

    A resumed run continues the same tracker runs: <out_dir>/tracking.json keeps the run id (a
    fresh run, start_step 0, draws a new one) and the last step each tracker got. The steps a
    killed run logged after its checkpoint are redone on resume (truncate_jsonl drops them from
    metrics.jsonl): TensorBoard purges them (purge_step) and takes the new values; trackio and wandb
    cannot delete logged steps, so they skip the steps they already have (resume is exact, so only
    time/*, memory/* and rollout/tokens_per_s can differ; metrics.jsonl has the redone values)."""
    run = cfg["run"]
    if not run["report_to"]:
        return []
    out_dir, path = run["out_dir"], os.path.join(run["out_dir"], "tracking.json")
    info = None
    if start_step and os.path.exists(path):
        with open(path) as f:
            info = json.load(f)
    if info is None:
        info = {"id": secrets.token_hex(4), "name": os.path.basename(os.path.normpath(os.path.abspath(out_dir))),
                "last_step": {}}
    trackers, shared = [], {"info": info, "path": path}  # track_step rewrites tracking.json from info
    for name in run["report_to"]:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: readers drop this folder's events at steps >= it (a killed run's steps past its checkpoint)
            writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=start_step + 1)

            def log(metrics, step, table, writer=writer):
                for k, v in metrics.items():
                    writer.add_scalar(k, v, step)
                if table is not None:
                    writer.add_text("samples", markdown_table(*table), step)
                writer.flush()  # a crash loses no logged step
            trackers.append({**shared, "name": name, "log": log, "close": writer.close, "skip_through": 0})
            continue
        try:
            if name == "trackio":  # local store ($TRACKIO_DIR, default ~/.cache/huggingface/trackio): no server, no network
                import trackio
                r = trackio.init(project=run["tracking_project"], name=f"{info['name']}-{info['id']}", config=cfg,
                                 resume="allow")
                make_table = lambda columns, rows: trackio.Table(columns=columns, data=rows)
            else:  # wandb: online unless WANDB_MODE=offline (then `wandb sync <out_dir>/wandb/offline-run-*` uploads it)
                import wandb
                r = wandb.init(project=run["tracking_project"], id=info["id"], name=info["name"], resume="allow",
                               dir=out_dir, config=cfg)
                make_table = lambda columns, rows: wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
        except Exception as e:  # noqa: BLE001 - e.g. wandb's CommError when its server cannot be reached
            why = (str(e).strip().splitlines() or [""])[0]
            raise SystemExit(f"config key run.report_to: {name} could not start its run ({type(e).__name__}: {why})"
                             + ("; WANDB_MODE=offline logs locally" if name == "wandb" else ""))

        def log(metrics, step, table, r=r, make_table=make_table):
            r.log({**metrics, **({"samples": make_table(*table)} if table is not None else {})}, step=step)
        trackers.append({**shared, "name": name, "log": log, "close": r.finish,
                         "skip_through": info["last_step"].get(name, 0) if start_step else 0})
    return trackers


def track_step(trackers, metrics, records):
    """Send one step's metrics.jsonl line (tracker_metrics) and, unless records is None, its
    samples.jsonl records as a table (samples_table) to every tracker, then record the step in
    tracking.json (atomic)."""
    if not trackers:
        return
    step, values = metrics["step"], tracker_metrics(metrics)
    table = samples_table(records) if records else None
    for t in trackers:
        if step > t["skip_through"]:
            t["log"](values, step, table)
            t["info"]["last_step"][t["name"]] = step
    info, path = trackers[0]["info"], trackers[0]["path"]
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(path + ".tmp", path)


def close_trackers(trackers):
    """Flush and close every tracker (wandb and trackio finish their runs)."""
    for t in trackers:
        t["close"]()


# ----------------------------------------------------------------------------------------------
# Schedule and start-up checks


def lr_lambda(cfg):
    o, total = cfg["optim"], cfg["run"]["total_steps"]

    def f(step):
        if step < o["warmup_steps"]:
            return (step + 1) / (o["warmup_steps"] + 1)
        if o["schedule"] == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - o["warmup_steps"]) / max(1, total - o["warmup_steps"]))))
        return 1.0
    return f


def check_startup(cfg):
    """What can be known about this machine before anything is loaded: the device exists, the
    output folder can be written. One-line SystemExit naming the key.

    The folder itself is made later (setup, rank 0), so a start that fails on bad data or a bad
    model path leaves no empty run folder behind: here a probe file is written and removed in
    run.out_dir, or in its nearest existing parent when it does not exist yet."""
    if cfg["train"]["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("config key train.device=cuda: no CUDA device on this machine (use train.device=cpu or auto)")
    out_dir = cfg["run"]["out_dir"]
    where = os.path.abspath(out_dir)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        if not os.path.isdir(where):
            raise NotADirectoryError(20, f"{where} is a file, not a folder")
        probe = os.path.join(where, f".rlme_write_test_{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"config key run.out_dir={out_dir}: cannot write there ({e.strerror})")
    for name in cfg["run"]["report_to"]:  # each tracker's name is its package (config.TRACKERS)
        try:
            importlib.import_module(name)
        except ImportError:
            raise SystemExit(f"config key run.report_to: {name} needs the `{name}` package: pip install {name}")
    if "wandb" in cfg["run"]["report_to"]:
        check_wandb_credentials()


def check_wandb_credentials():
    """wandb in online mode needs a W&B API key: without one wandb.init fails (no terminal) or
    prompts, after every model has loaded. SystemExit (one line) before that instead."""
    import wandb
    if wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):  # WANDB_MODE or wandb's settings file
        return
    if not wandb.login(verify=False, prompt=False):  # WANDB_API_KEY, wandb's settings, ~/.netrc; no network
        raise SystemExit("config key run.report_to: wandb is online but no W&B API key is configured: run "
                         "`wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log locally")


if __name__ == "__main__":
    main()


def clip_grad_norm(policy, max_norm):
    """Clip the global gradient norm to `max_norm` (<= 0: measure only); returns the norm before
    clipping as a float. torch's clip_grad_norm_; under FSDP2 the gradients are DTensor shards
    and the norm it returns is reduced over the mesh, i.e. the global one (tests/test_scale.py)."""
    from torch.distributed.tensor import DTensor
    gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm if max_norm > 0 else float("inf"))
    return float(gn.full_tensor() if isinstance(gn, DTensor) else gn)
