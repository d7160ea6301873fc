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
  5. log         metrics.jsonl and samples.jsonl on rank 0 (+ run.report_to)  step_metrics, emit
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
import math
import time

import torch

import evaluate
import metarm
import reward as R
import rollout
from plumbing.config import load_config
import fast
from plumbing.cli import ArgumentParser
from plumbing.scale import generate_vllm, vllm_sleep, all_max, all_sum, compute_context, gather_records, grad_sync, logp_gap, peak_memory_mb, push_weights, unsharded
from plumbing.services import score_remote
from plumbing.run import emit, finish, latest_checkpoint, save_run, setup, write_early_stop


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
    out = generate_vllm(engine["llm"], state["tokenizer"], prompt_ids, group_size=ro["group_size"],
                                max_new_tokens=ro["max_new_tokens"], temperature=ro["temperature"],
                                top_p=ro["top_p"], top_k=ro["top_k"], seed=seed,
                                eos=rollout.eos_ids(policy, state["tokenizer"]))
    vllm_sleep(engine)
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


def step_metrics(state, cfg, records, upd, reward_metrics, times):
    """5. The step's metrics.jsonl line, from every rank's records (every rank calls this: the
    reductions are collectives; docs/method.md §9 lists the keys).

    Args:
        state: setup's dict. records: this rank's sample_records. upd: update_policy's dict.
        reward_metrics: the reward step's "metrics". times: {"rollout", "reward", "update"} seconds.
    Returns:
        (metrics dict, every rank's records) on rank 0, (None, None) on the other ranks.
    """
    world, G = state["world"], cfg["rollout"]["group_size"]
    records = gather_records(records, world)
    loss = all_sum(upd["loss"], world)
    gap = upd["logp_gap"]
    if gap is not None:
        gap = (all_sum(gap[0], world) / max(all_sum(gap[1], world), 1.0), all_max(gap[2], world))
    if state["rank"] != 0:
        return None, None
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
    return metrics, records


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
        metrics = emit(state, cfg, *step_metrics(state, cfg, records, upd, reward_metrics={**rew["metrics"], **val},
                                                 times={"rollout": t1 - t0, "reward": t2 - t1, "update": t3 - t2}))
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
            "score_targets": R.score_targets, "score_remote": score_remote, "clip_grad_norm": clip_grad_norm}


def main(argv=None):
    ap = ArgumentParser(description="RLME / RLVR / RM-NLHF training (README; docs/method.md).")
    ap.add_argument("--config", action="append", default=[],
                    help="YAML file(s) over config.yaml; later ones override earlier ones "
                         "(e.g. --config configs/cpu.yaml). Without one: config.yaml, the 8-GPU setup")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides (YAML-typed), e.g. run.total_steps=3")
    a = ap.parse_args(argv)
    train(load_config(a.config, a.overrides))


# ==============================================================================================
# PLUMBING: skip on first read (setup, data, distributed / FSDP2 / vLLM glue, checkpoints)
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# Data and evaluators


# ----------------------------------------------------------------------------------------------
# Distributed: process group, reductions over ranks, seeds


def sampling_seed(run_seed, step, rank):
    """The rollout sampling seed of (run seed, step, rank) (docs/scale-out.md: distinct seeds per rank).
    Ranks and steps never collide within a run (rank < 10_007), and a resumed run samples the
    same completions as an uninterrupted one."""
    return run_seed * 1_000_003 + step * 10_007 + rank


# ----------------------------------------------------------------------------------------------
# Parallelism (docs/scale-out.md): DDP for small models, FSDP2 (`fully_shard`) for 4B+; mixed precision.
# optimizer_steps only needs grad_sync() and clip_grad_norm() to be the same code for both.


# ----------------------------------------------------------------------------------------------
# vLLM glue (docs/scale-out.md): the engine, weight pushes, the trainer/engine log-prob gap


# ----------------------------------------------------------------------------------------------
# LoRA (model.lora; docs/method.md §4.7): peft adapters, the base model with them off, merging


# ----------------------------------------------------------------------------------------------
# Checkpoints: plain save_pretrained folders, written atomically (tmp folder, then rename)


# ----------------------------------------------------------------------------------------------
# Experiment trackers (run.report_to; docs/method.md §9). metrics.jsonl stays the source of truth:
# each tracker gets its numeric entries at the same step, and samples.jsonl's rows as a table.


# ----------------------------------------------------------------------------------------------
# Schedule and start-up checks


if __name__ == "__main__":
    main()


def clip_grad_norm(policy, max_norm):
    """Clip the global gradient norm to `max_norm` (<= 0: measure only); returns the norm before
    clipping as a float. torch's clip_grad_norm_; under FSDP2 the gradients are DTensor shards
    and the norm it returns is reduced over the mesh, i.e. the global one (tests/test_scale.py)."""
    from torch.distributed.tensor import DTensor
    gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm if max_norm > 0 else float("inf"))
    return float(gn.full_tensor() if isinstance(gn, DTensor) else gn)
