"""RLME and RM-NLHF training under torchrun, one file: rollout -> reward -> advantage -> update.

    torchrun --nproc_per_node 8 train.py --config config.yaml        # one 8-GPU node (nccl)
    python train.py --config configs/cpu.yaml                        # one CPU process (gloo)

`train()` is one step, top to bottom; the functions after it come in the order the step calls them:
  1. prompts     this rank's P/world items, or RM-NLHF's D_H/D_O mix           step_prompts
  2. rollout     G completions per prompt (RLME Eq. 1)                   state["rollout"]["sample"]
  3. reward      RLME: the evaluators' weighted log p("Yes") (RLME Eq. 2-3)     rlme_reward_step
                 RM-NLHF: judge D_H, update the MetaRM, predict D_O      metarm.nlhf_reward_step
                 (RM-NLHF Eq. 4-8, Algorithm 1)
  4. advantage   A = r - mean(group) (RLME Eq. 5); / std for GRPO              group_advantages
  5. update      the no-grad passes, then optimizer steps with CISPO           update_policy
                 (RLME Eq. 6-8) or GRPO (chosen in train()), one normaliser    cispo_loss, grpo_loss
  6. log         metrics.jsonl and samples.jsonl on rank 0                     plumbing.run.emit
  7. checkpoint  atomic; re-running the same command resumes exactly           plumbing.run.save_run

What is simplified, and why:
  - On-policy by default (algo.updates_per_batch = algo.minibatches = 1): the policy that sampled
    is the one being updated, so CISPO's importance weight is exactly 1 and the behaviour pass is
    skipped. Set either above 1 for RLME Eq. 6's off-policy update; the same code then runs it.
  - The live evaluator IS the policy ("live self-evaluation", RLME §4.1): it scores without
    gradient between rollout and update, so no second model is held. Frozen evaluators are config.
  - No value model and no learned reward model for RLME; RM-NLHF's only extra model is the MetaRM.
  - LoRA (model.lora, off by default) trains peft adapters only; "the initial policy" (frozen_self
    evaluators, the GRPO reference) is then the policy with its adapters off, not a second copy.
  - Speed lives in fast.py: `fast_or_plain` picks, once, the fast twins or the plain functions of
    the stage files (train.fast_paths: false), with the same signatures; the tests compare them.
  - Everything that is not the method (setup, data, checkpoints, trackers, the validation
    monitor, DDP / FSDP2 / vLLM) is in plumbing/; this file imports these seams from it: setup
    (models, data, optimizer, resume point), emit / save_and_stop / finish (log, checkpoint, end),
    step_metrics, compute_context (mixed precision), grad_sync / all_sum / logp_gap (the
    collectives), validate_at_start / validation_step (the monitor), score_remote (a remote
    evaluator's plain twin) and train_main (the command line).
Formulas and the choices the papers leave open: docs/method.md; parallelism: docs/scale-out.md.
"""
import functools
import math
import time

import torch

import fast
import metarm
import reward as R
import rollout
from plumbing.cli import train_main
from plumbing.evaluators import score_remote
from plumbing.metrics import step_metrics
from plumbing.run import emit, finish, save_and_stop, setup
from plumbing.scale import all_sum, compute_context, grad_sync, logp_gap
from plumbing.validation import validate_at_start, validation_step


def train(cfg):
    """Run cfg["run"]["total_steps"] steps (or resume the unfinished run in run.out_dir)."""
    # the one switch: fast.py's twins or the plain functions
    passes = fast_or_plain(cfg["train"]["fast_paths"], cfg["train"]["logprob_chunk_tokens"])
    state = setup(cfg, passes)  # models, data, optimizer, resume point (plumbing/run.py)
    if state is None:  # the run in run.out_dir is already complete
        return
    algo, ro, rw, seed = cfg["algo"], cfg["rollout"], cfg["reward"], cfg["run"]["seed"]
    G, rank, world, device = ro["group_size"], state["rank"], state["world"], state["device"]
    # the forwards' mixed precision: a context (torch.autocast or none; plumbing/scale.py)
    context = functools.partial(compute_context, cfg["model"]["dtype"], cfg["train"]["parallel"],
                                device)
    # The config, read once: each stage gets numbers and callables.
    # 3. RLME's reward (Eq. 2-3): the evaluators' log p(target) to the meta-questions in a template
    template = {None: R.DEFAULT_EVALUATOR_TEMPLATE, "qa": R.QA_EVALUATOR_TEMPLATE}.get(
        rw["evaluator_template"], rw["evaluator_template"])  # null: the default; "qa": context QA's
    reward_step = functools.partial(
        rlme_reward_step, evaluators=state["evaluators"], meta_questions=rw["meta_questions"],
        kind=rw["kind"], template=template, label_format=cfg["data"]["label_format"],
        qa_metric=rw["qa_metric"], rlvr_weight=rw["rlvr_weight"], renormalize=rw["renormalize"],
        nonfinite_logp=rw["nonfinite_logp"], transform=rw["transform"], context=context,
        world=world)
    # 3. RM-NLHF's reward (Alg. 1): the GRM's verdict format, Eq. 4-5 (D_H), Eq. 8 (D_O), the MetaRM
    nl = cfg["nlhf"]
    nlhf_step = functools.partial(
        metarm.nlhf_reward_step, judge=state.get("judge"), mrm=state["mrm"], lam=nl["lam"],
        threshold=nl["threshold"], inclusive=nl["threshold_rule"] == "inclusive",
        similarity=nl["similarity"], gate_on_outcome=nl["gate_on_outcome"],
        on_failure=cfg["judge"]["on_failure"], max_lines=nl["max_critique_lines"],
        max_chars=nl["max_critique_chars"], style=nl["grm_prompt"], form=nl["do_reward"],
        mode=cfg["metarm"]["mode"], train_on_do=cfg["metarm"]["train_on_do"])
    # 5. The policy loss and its numbers. CISPO (RLME Eq. 6-8) clips the detached sequence weight to
    # [1 - eps_low, 1 + eps_high]; GRPO (RM-NLHF Eq. 3) clips the token ratio to 1 +- clip_eps.
    if algo["loss"] == "cispo":
        loss_fn = functools.partial(cispo_loss, eps_low=algo["eps_low"], eps_high=algo["eps_high"],
                                    ratio=algo["ratio"], aggregation=algo["aggregation"])
    else:  # "grpo", plus kl_coef x the k3 KL to the reference
        loss_fn = functools.partial(grpo_loss, clip_eps=algo["clip_eps"], kl_coef=algo["kl_coef"],
                                    aggregation=algo["aggregation"])
    # the update's log-probs: the policy's, at the sampling temperature (RLME Eq. 6, 8)
    logprobs = functools.partial(passes["completion_logprobs"], temperature=ro["temperature"],
                                 pad_id=state["tokenizer"].pad_token_id)
    update = functools.partial(
        update_policy, loss_fn=loss_fn, aggregation=algo["aggregation"],
        max_new_tokens=ro["max_new_tokens"], updates_per_batch=algo["updates_per_batch"],
        minibatches=algo["minibatches"], group_size=G,
        micro_batch_size=cfg["train"]["micro_batch_size"], grad_clip=cfg["optim"]["grad_clip"],
        logprobs=logprobs, clip_grad_norm=passes["clip_grad_norm"], context=context, world=world,
        device=device, ref_model=state["ref_model"], scaler=state["scaler"])
    total, every = cfg["run"]["total_steps"], cfg["run"]["eval_every"]
    sampling = {k: ro[k] for k in ("group_size", "max_new_tokens", "temperature", "top_p", "top_k")}
    validate_at_start(state, cfg, reward_step)  # run.eval_at_start: step 0, before any update
    for step in range(state["start_step"], total):
        t0 = time.perf_counter()
        # --- 1-2. prompts and rollout: G completions for each of this rank's prompts (RLME Eq. 1)
        items, prompt_ids = step_prompts(state, cfg, step)
        # rollout.backend (plumbing/engine.py): HF decode on the policy, or vLLM (which then sleeps)
        ro_out = state["rollout"]["sample"](prompt_ids, **sampling,
                                            seed=sampling_seed(seed, step, rank))
        samples = [it for it in items for _ in range(G)]  # the item of each completion
        t1 = time.perf_counter()

        # --- 3. rewards: {"reward" [N], "valid" [N] or None, "records", "metrics"} ----------------
        # judge D_H, MetaRM update, MetaRM predicts D_O (RM-NLHF Alg. 1)
        if cfg["task"] == "rm_nlhf":
            rew = nlhf_step(samples, ro_out["completions"], seed=seed * 7_919 + step, t0=t0)
        else:  # the evaluators' log p(target) to the meta-questions (RLME Eq. 2-3)
            rew = reward_step(samples, ro_out["completions"])
        t2 = time.perf_counter()

        # --- 4. advantages: r - group mean (RLME Eq. 5), / std for GRPO; groups never straddle
        #        ranks; unknown rewards get 0
        advantages = group_advantages(rew["reward"], G, std=algo["advantage_std"],
                                      valid=rew["valid"], unbiased=algo["std_unbiased"])

        # --- 5. update: CISPO (RLME Eq. 6-8) or GRPO (+ k3 KL to the reference) ----------------
        batch = {"prompt_ids": ro_out["prompt_ids"], "completion_ids": ro_out["completion_ids"],
                 "completion_mask": ro_out["completion_mask"], "advantages": advantages}
        if rew["valid"] is not None:
            batch["valid"] = rew["valid"]
        if "logprobs" in ro_out:  # vLLM: the trainer recomputes them and logs the gap
            batch["rollout_logprobs"] = ro_out["logprobs"]
        if cfg["model"]["lora"] and cfg["model"]["lora"]["dropout"] > 0:
            # LoRA dropout draws from torch's RNG: seeded per step, so a resumed run draws alike
            torch.manual_seed(sampling_seed(seed, step, rank))
        upd = update(state["model"], state["policy"], state["optimizer"], batch)
        state["rollout"]["push"](state["policy"])  # vLLM: the engine gets the updated weights
        state["scheduler"].step()
        t3 = time.perf_counter()

        # --- 6. log: metrics.jsonl, samples.jsonl (rank 0 sees every rank's samples); every
        #        run.eval_every steps the held-out validation and the reward-hacking monitor -------
        done = step + 1
        records = sample_records(done, rank, ro_out, fields=rew["records"], advantages=advantages,
                                 upd=upd, group_size=G)
        evaluate_now = every and (done % every == 0 or done == total)
        val = validation_step(state, cfg, done, records, reward_step) if evaluate_now else {}
        times = {"rollout": t1 - t0, "reward": t2 - t1, "update": t3 - t2}
        metrics = emit(state, cfg, *step_metrics(state, cfg, records, upd, times=times,
                                                 reward_metrics={**rew["metrics"], **val}))

        # --- 7. checkpoint: atomic; re-running the same command resumes from the newest. Stop when
        #        held-out accuracy fell too far for too long (run.early_stop_*) or at run.stop_after
        if save_and_stop(state, cfg, done, val, metrics):
            break
    finish(state)


def fast_or_plain(fast_paths, logprob_chunk_tokens=0):
    """The one switch (train.fast_paths): the functions every pass of a step calls, fast.py's speed
    twins (log-probs over chunks of train.logprob_chunk_tokens positions) or the plain ones (same
    signatures; tests/algorithm/test_fast.py)."""
    if fast_paths:
        lp = functools.partial(fast.completion_logprobs, chunk_tokens=logprob_chunk_tokens)
        return {"generate": fast.generate, "completion_logprobs": lp,
                "score_targets": fast.score_targets, "score_remote": fast.score_remote,
                "clip_grad_norm": fast.clip_grad_norm}
    return {"generate": rollout.generate, "completion_logprobs": rollout.completion_logprobs,
            "score_targets": R.score_targets, "score_remote": score_remote,
            "clip_grad_norm": clip_grad_norm}


def step_prompts(state, cfg, step):
    """1. This rank's share of the step's prompts, as (items, prompt_ids): RLME's items x ~ D in
    the policy's prompt template, or RM-NLHF's D_H / D_O mix (RM-NLHF §3.2) in the GRM prompt."""
    rank, world, tok, chat = state["rank"], state["world"], state["tokenizer"], state["chat"]
    P, seed, nl = cfg["rollout"]["prompts_per_step"], cfg["run"]["seed"], cfg["nlhf"]
    if cfg["task"] == "rm_nlhf":
        items = R.nlhf_step_items(state["dh_items"], state["do_items"], step, prompts_per_step=P,
                                  dh_per_step=nl["dh_per_step"], seed=seed, rank=rank, world=world)
        fmt = dict(max_lines=nl["max_critique_lines"], style=nl["grm_prompt"])  # the GRM prompt's
        return items, [R.grm_prompt_ids(tok, it, chat, **fmt) for it in items]
    items = rollout.step_items(state["items"], step, P, seed=seed, rank=rank, world=world)
    template = cfg["data"]["prompt_template"]
    return items, [rollout.policy_prompt_ids(tok, it, chat, template) for it in items]


def sampling_seed(run_seed, step, rank):
    """The rollout sampling seed of (run seed, step, rank) (docs/scale-out.md: distinct seeds per
    rank). Ranks and steps never collide within a run (rank < 10_007), and a resumed run samples
    the same completions as an uninterrupted one."""
    return run_seed * 1_000_003 + step * 10_007 + rank


def rlme_reward_step(items, completions, *, evaluators, meta_questions, kind, template,
                     label_format, qa_metric, rlvr_weight, renormalize, nonfinite_logp, transform,
                     context, world):
    """3. Rewards of one RLME step: r = sum_j v_j sum_k w_k log p_jk (RLME Eq. 2-3,
    reward.rlme_reward), RLVR's reward against the label (kind rlvr), or both (hybrid:
    rlvr_weight x RLVR + the RLME terms, reward.hybrid_reward). train() binds the settings from
    config.yaml's reward.* and data.label_format.

    Args:
        items: list (N) of item dicts (plumbing/items.py's load_train_items), one per completion.
        completions: list[str] (N). evaluators: reward.local_evaluator / remote dicts ([] for rlvr).
        context: the forward's mixed-precision context (the live evaluator is the policy).
        world: number of ranks (the metrics are summed over them).
    Returns:
        dict: "reward" FloatTensor [N]; "valid" None when every reward is known, else BoolTensor
        [N], False where a remote evaluator failed after its retries (the sample is masked, as a
        failed judge call); "records" list (N) of samples.jsonl fields (problem, extracted answer,
        label, correctness, both parts, every evaluator's log p per meta-question: the reward can
        be recomputed by hand); "metrics" (reward/nonfinite, reward/masked,
        evaluator/<name>/failed).
    """
    # RLVR (docs/method.md §4.3): the reward for kind rlvr, hybrid's first part; accuracy always
    # (correct = exact match for text labels, whatever qa_metric); no labels: None
    labels = [it["label"] for it in items]
    rlvr = torch.tensor([R.answer_reward(c, y, label_format, qa_metric) if y is not None else 0.0
                         for c, y in zip(completions, labels)])
    correct = [R.answer_reward(c, y, label_format, "em") >= 1.0 if y is not None else None
               for c, y in zip(completions, labels)]
    logp, rlme, nonfinite, failed = None, None, 0, None
    valid = torch.ones(len(items), dtype=torch.bool)
    if kind in ("rlme", "hybrid"):
        with context():
            out = R.rlme_reward(evaluators, meta_questions,
                                problems=[it["problem"] for it in items],
                                solutions=completions,
                                references=[it["answer_text"] for it in items],
                                anchored=[it["anchored"] for it in items], template=template,
                                renormalize=renormalize, nonfinite_logp=nonfinite_logp,
                                transform=transform)
        rlme, logp, nonfinite = out["reward"], out["logp"], out["nonfinite"]
        failed, valid = out["failed"], out["valid"]  # a remote evaluator's failed requests
    rewards = R.hybrid_reward(rlvr, rlme, rlvr_weight=rlvr_weight) if kind == "hybrid" else \
        {"rlme": rlme, "rlvr": rlvr}[kind]
    records = []
    for i, (it, c) in enumerate(zip(items, completions)):
        # problem: what the evaluator was shown (context QA: the passages + the question), so
        # `python -m plumbing.cli reward` on samples.jsonl recomputes the reward
        # reward None: a remote evaluator failed, the sample is masked (as a failed judge call)
        ok = bool(valid[i])
        rec = {"item": it["index"], "problem": it["problem"], "extracted": R.extract_boxed(c),
               "label": it["label"], "correct": correct[i], "anchored": it["anchored"],
               "reward": float(rewards[i]) if ok else None, "rlvr_reward": float(rlvr[i])}
        if logp is not None:  # logp: [N, J evaluators, K meta-questions]; None = a failed request
            rec["rlme_reward"] = float(rlme[i]) if ok else None
            rec["logp"] = {ev["name"]: {mq["question"]: (None if failed[i, j, k]
                                                         else float(logp[i, j, k]))
                                        for k, mq in enumerate(meta_questions)}
                           for j, ev in enumerate(evaluators)}
        records.append(rec)
    metrics = {"reward/nonfinite": all_sum(nonfinite, world),
               "reward/masked": all_sum(int((~valid).sum()), world)}
    for j, ev in enumerate(evaluators if logp is not None else []):
        if "failures" in ev:  # a remote evaluator: samples it could not score (after retries)
            n_failed = int(failed[:, j].any(1).sum())
            metrics[f"evaluator/{ev['name']}/failed"] = all_sum(n_failed, world)
    return {"reward": rewards, "valid": None if bool(valid.all()) else valid, "records": records,
            "metrics": metrics}


def group_advantages(rewards, group_size, std=False, valid=None, unbiased=False):
    """A_i = r_i - mean_group(r) (RLME Eq. 5), or / (std + 1e-6) when std=True (GRPO, RM-NLHF
    Eq. 1-2): the population std (sum / n), or with unbiased=True sum / (n - 1) (torch.std, the
    authors' verl).

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
        # the population | unbiased variance
        var = (adv ** 2).sum(1, keepdim=True) / (count - int(unbiased)).clamp(min=1)
        adv = adv / (var.sqrt() + 1e-6)
    big = torch.finfo(r.dtype).max
    flat = (torch.where(v, r, torch.full_like(r, -big)).amax(1, keepdim=True)
            == torch.where(v, r, torch.full_like(r, big)).amin(1, keepdim=True))
    return torch.where(flat | ~v, torch.zeros_like(adv), adv).view(-1)


def update_policy(model, policy, optimizer, batch, *, loss_fn, aggregation, max_new_tokens,
                  updates_per_batch, minibatches, group_size, micro_batch_size, grad_clip, logprobs,
                  clip_grad_norm, context, world, device, ref_model=None, scaler=None):
    """5. One rollout batch's update (docs/method.md §4.4): the no-grad passes, then
    `updates_per_batch` passes over the batch, each split into `minibatches` optimizer steps over
    whole groups, each accumulated over micro-batches of `micro_batch_size` sequences.

    No-grad passes (`frozen_logprobs`, each through the model it is about, prompt included):
    behaviour log-probs pi_b when the update is off-policy (RLME Eq. 6's denominator) or to log
    the vLLM gap; reference log-probs pi_ref for GRPO's KL when `ref_model` is given.
    The loss of one optimizer step is sum(per-token loss) / normaliser with ONE normaliser counted
    over all its micro-batches on all ranks (loss_normaliser), so 1 rank x 4 micro-batches,
    2 ranks x 2 and 1 rank x 1 give the same update (tests/algorithm/test_train.py).

    Args:
        model: the policy, DDP-wrapped when world > 1 (the forward with grad). policy: unwrapped.
        batch: dict with "prompt_ids" list[list[int]] (N), "completion_ids" LongTensor [N, L],
            "completion_mask" FloatTensor [N, L], "advantages" FloatTensor [N], optionally
            "valid" BoolTensor [N] (False rows are left out of the loss and the normaliser) and
            "rollout_logprobs" FloatTensor [N, L] (vLLM's log-probs of the same tokens).
        loss_fn: cispo_loss or grpo_loss with its numbers bound (train() picks it):
            (logp, behaviour_logp, advantages, mask[, ref_logp=]) -> (loss_sum, stats).
        aggregation, max_new_tokens: loss_normaliser's. group_size: G (minibatches: whole groups).
        grad_clip: the global gradient norm's bound (<= 0: measured, not clipped).
        logprobs: (model, prompt_ids, completion_ids, prompt_model=None) -> FloatTensor [N, L], the
            per-token log-probs at the sampling temperature: rollout.completion_logprobs or its fast
            twin, pad_id and temperature bound.
        clip_grad_norm: (policy, max_norm) -> float: clip_grad_norm or its fast twin.
        context: the forward's mixed-precision context (compute_context). world: number of ranks.
        device: where the loss is computed. ref_model: the frozen reference policy (GRPO with
            algo.kl_coef > 0; under LoRA the policy with its adapters off, BaseModelView), else
            None. scaler: a GradScaler for float16, else None.
    Returns:
        dict: "loss" (float, this rank's share, summed over optimizer steps), "grad_norms"
        (list[float], global, before clipping; a non-finite one: that step skipped), "is_weight" /
        "clipped" (FloatTensor [N], last pass), "logp_gap": (sum |trainer - rollout| log-prob,
        token count, max) over this rank's masked tokens when batch has "rollout_logprobs", else
        None.
    """
    # the loss mask [N, L]: the completion mask, rows whose reward is unknown (a failed judge
    # call: batch["valid"] False) zeroed
    mask = batch["completion_mask"].float()
    if "valid" in batch:
        mask = mask * batch["valid"].float()[:, None]
    advantages, n_local = batch["advantages"], len(batch["prompt_ids"])
    frozen = functools.partial(frozen_logprobs, batch=batch, micro_batch_size=micro_batch_size,
                               logprobs=logprobs, context=context)
    # With one optimizer step per batch pi_theta == pi_b at the update: the ratio is exactly 1 and
    # the behaviour pass is skipped. With vLLM rollouts it runs anyway, to log the engine's gap.
    off_policy = updates_per_batch > 1 or minibatches > 1
    rollout_lp = batch.get("rollout_logprobs")
    behaviour = frozen(policy) if off_policy or rollout_lp is not None else None
    ref = frozen(ref_model) if ref_model is not None else None
    gap = logp_gap(behaviour, rollout_lp, mask) if rollout_lp is not None else None
    behaviour = behaviour if off_policy else None  # on-policy: the loss takes logp.detach()

    model.train()
    mb_groups = n_local // group_size // minibatches
    loss_total, grad_norms = 0.0, []
    is_weights, clipped = torch.ones(n_local), torch.zeros(n_local)
    for _ in range(updates_per_batch):
        for m in range(minibatches):
            idx = list(range(m * mb_groups * group_size, (m + 1) * mb_groups * group_size))
            # the one global normaliser of this optimizer step: all micro-batches, all ranks
            n_seq = all_sum((mask[idx].sum(-1) > 0).sum(), world)
            n_tok = all_sum(mask[idx].sum(), world)
            norm = max(loss_normaliser(aggregation, n_seq, n_tok, max_new_tokens), 1.0)
            chunks = micro_batches(idx, micro_batch_size)
            for c, rows in enumerate(chunks):
                # DDP all-reduces / FSDP2 reduce-scatters gradients on the last micro-batch only.
                with grad_sync(model, world, sync=c == len(chunks) - 1):
                    with context():
                        # the prompt pass goes through the unwrapped policy: DDP sees one forward
                        # per backward
                        lp, width = rows_logprobs(model, batch, rows, logprobs=logprobs,
                                                  prompt_model=policy)
                    beh, kl = None, {}
                    if behaviour is not None:
                        beh = torch.stack([behaviour[i][:width] for i in rows]).to(device)
                    if ref is not None:
                        kl["ref_logp"] = torch.stack([ref[i][:width] for i in rows]).to(device)
                    loss_sum, st = loss_fn(lp.float(), beh, advantages[rows].to(device),
                                           mask[rows, :width].to(device), **kl)
                    # DDP and FSDP2 average gradients over ranks; x world makes it a global sum
                    loss = loss_sum * world / norm
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                loss_total += float(loss_sum.detach()) / norm
                is_weights[rows] = st["is_weight"].float().cpu()
                clipped[rows] = st["clipped"].float().cpu()
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip and log the true gradient norm
            grad_norms.append(clip_grad_norm(policy, grad_clip))
            if scaler is not None:
                scaler.step(optimizer)  # skipped when a gradient is inf/NaN (float16 overflow)
                scaler.update()
            elif math.isfinite(grad_norms[-1]):
                # a NaN/inf gradient never reaches AdamW or a checkpoint: the step is skipped;
                # plumbing.run counts it and stops a run that keeps it up
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_total, "grad_norms": grad_norms, "is_weight": is_weights,
            "clipped": clipped, "logp_gap": gap}


@torch.no_grad()
def frozen_logprobs(model, *, batch, micro_batch_size, logprobs, context):
    """The no-grad pass of the update: per-token log-probs of every completion under `model`,
    prompt AND completion through `model` itself: the behaviour policy pi_b (model = the policy,
    before any optimizer step; RLME Eq. 6's denominator) or the GRPO reference pi_ref (model =
    the frozen initial policy; the k3 KL). A pass never borrows another model's prompt cache.
    Arguments as update_policy's.

    Returns:
        list (N) of FloatTensor [L] on CPU, L = batch["completion_ids"].shape[1], zero past the
        row's micro-batch width (masked), so the optimizer steps may chunk the rows differently.
    """
    out, full = [None] * len(batch["prompt_ids"]), batch["completion_ids"].shape[1]
    for rows in micro_batches(range(len(out)), micro_batch_size):
        # eval mode: pi_b and pi_ref are the policies' probabilities, dropout (LoRA's) off
        with context(), rollout.eval_mode(model):
            lp, width = rows_logprobs(model, batch, rows, logprobs=logprobs)
        for i, row in zip(rows, lp.float().cpu()):
            out[i] = torch.nn.functional.pad(row, (0, full - width))
    return out


def rows_logprobs(model, batch, rows, *, logprobs, prompt_model=None):
    """Per-token log-probs of the completions of `rows` under `model` (update_policy's `logprobs`),
    over the first `width` columns: the longest masked completion among `rows` (columns that
    are padding in every row are trimmed).

    Returns:
        (FloatTensor [len(rows), width], width). With grad when called under grad mode.
    """
    width = max(1, int(batch["completion_mask"][rows].sum(-1).max()))
    prompts = [batch["prompt_ids"][i] for i in rows]
    lp = logprobs(model, prompts, batch["completion_ids"][rows, :width], prompt_model=prompt_model)
    return lp, width


def micro_batches(rows, size):
    """Consecutive chunks of `size` row indices (the last one shorter)."""
    rows = list(rows)
    return [rows[s:s + size] for s in range(0, len(rows), size)]


def loss_normaliser(aggregation, num_seqs, num_tokens, max_new_tokens):
    """The one global divisor of a (mini-)batch (docs/method.md §4.4): sequences for seq_sum (RLME
    Eq. 8), for seq_mean_token_mean (RM-NLHF Eq. 3's 1/G; the loss already divided each sequence
    by its length) and for micro_batch_token_mean (the n_b-weighted micro-batch token means), tokens
    for token_mean, sequences x max_new_tokens for Dr.GRPO. Counts are global (all micro-batches of
    all ranks), applied once."""
    return {"seq_sum": num_seqs, "seq_mean_token_mean": num_seqs,
            "micro_batch_token_mean": num_seqs, "token_mean": num_tokens,
            "dr_grpo": num_seqs * max_new_tokens}[aggregation]


def cispo_loss(logp, behaviour_logp, advantages, mask, *, eps_low, eps_high, ratio="sequence",
               aggregation="seq_sum"):
    """Sum over this micro-batch of CISPO's per-token loss (RLME Eq. 6-8, MiniMax-M1); the caller
    divides by the global normaliser (loss_normaliser) so that the update equals one big batch.

    rho_i = exp(sum_t logp - sum_t behaviour) (ratio "geometric_mean": the GSPO per-token mean),
    clipped in LOG space to [log(1-eps_low), log(1+eps_high)] before exp so a 100-token sequence
    cannot overflow, then DETACHED: every sample, clipped or not, gets gradient
    -sg(rho_hat_i) * A_i * grad sum_t log pi(y_it).

    Args:
        logp: FloatTensor [B, L] current token log-probs (with grad).
        behaviour_logp: FloatTensor [B, L] or None (= logp detached: on-policy, ratio 1).
        advantages: FloatTensor [B]. mask: FloatTensor [B, L].
        eps_low, eps_high: the clip range (eps_low >= 1: no lower clip).
        aggregation: loss_normaliser's (aggregate).
    Returns:
        (loss_sum scalar tensor, stats {"is_weight": FloatTensor [B] before clipping,
        "clipped": BoolTensor [B]})
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
    """Sum over this micro-batch of GRPO's per-token loss (RM-NLHF Eq. 3; docs/method.md §4.5): the
    token ratio r_t, PPO's clip eps, -min(r_t A, clip(r_t) A) + kl_coef * k3 to the reference.

    Args: as cispo_loss, plus clip_eps (PPO's eps), kl_coef (beta) and ref_logp (FloatTensor
        [B, L] reference log-probs, or None: no KL term).
    Returns:
        (loss_sum scalar tensor, stats {"is_weight": token-mean ratio [B],
        "clipped": share of clipped tokens [B]})
    """
    old = logp.detach() if behaviour_logp is None else behaviour_logp
    # log ratio clamped at +-20 so exp cannot overflow (a ratio of e^20 is clipped by PPO anyway
    # whenever it matters)
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
    """Sum of the masked per-token losses [B, L] of one micro-batch; seq_mean_token_mean takes each
    sequence's token mean first (RM-NLHF Eq. 3); micro_batch_token_mean is the micro-batch's token
    mean x its sequence count n_b (verl 0.4.1's token-mean under use_dynamic_bsz, the RM-NLHF
    release: policy_loss x len(micro-batch) / mini-batch size). The caller divides by
    loss_normaliser's count."""
    per_token = per_token * mask
    if aggregation == "seq_mean_token_mean":
        per_token = per_token / mask.sum(-1, keepdim=True).clamp(min=1)
    if aggregation == "micro_batch_token_mean":
        return per_token.sum() * (mask.sum(-1) > 0).sum() / mask.sum().clamp(min=1)
    return per_token.sum()


def k3_kl(logp, ref_logp):
    """k3 KL estimator per token: exp(ref - logp) - (ref - logp) - 1 >= 0 (docs/method.md §4.5)."""
    d = ref_logp - logp
    return d.exp() - d - 1


def sample_records(step, rank, ro_out, *, fields, advantages, upd, group_size):
    """This rank's samples.jsonl lines of one step, built the same way for every task: where the
    sample sits (step, rank, group), the reward step's fields, the completion, and what the update
    made of it (advantage, importance weight before clipping, clipped)."""
    mask = ro_out["completion_mask"]
    return [{"step": step, "rank": rank, "group": i // group_size, **f,
             "completion": ro_out["completions"][i], "truncated": bool(ro_out["truncated"][i]),
             "length": int(mask[i].sum()),
             "advantage": float(advantages[i]), "importance_weight": float(upd["is_weight"][i]),
             "clipped": float(upd["clipped"][i])}
            for i, f in enumerate(fields)]


def clip_grad_norm(policy, max_norm):
    """Clip the global gradient norm to `max_norm` (<= 0: measure only); returns the norm before
    clipping (float). Under FSDP2 torch reduces it over the mesh: the global one
    (tests/plumbing/test_scale.py)."""
    from torch.distributed.tensor import DTensor
    bound = max_norm if max_norm > 0 else float("inf")
    gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), bound)
    return float(gn.full_tensor() if isinstance(gn, DTensor) else gn)


def main(argv=None):
    """`python train.py --config FILE ... [key.sub=value ...] [--plan]` (plumbing/cli.py train_main:
    --plan prints the run's plan and trains nothing; Ctrl-C ends in one line, exit 130)."""
    train_main(train, argv)


if __name__ == "__main__":
    main()
