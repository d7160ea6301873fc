"""A training run's loop glue: what train.py's loop calls that is not the method.

    setup(cfg, passes)        models, data, optimizer, resume point: the `state` dict (its keys in
                              setup's docstring), every check that needs no model first
                              (check_startup; stop_if_disk_short / free_space_problem once the
                              policy has loaded); start_run does the work once the run folder is locked
    update_kwargs(cfg, passes, device, ...), policy_loss(algo, ...)
                              train.update_policy's keyword arguments (the policy loss among
                              them) bound from a config as train.train binds them, for the
                              scripts and tests that call update_policy on their own
    emit(...)                 metrics.jsonl, samples.jsonl, the trackers (run.report_to), the bar
    save_run, save_and_stop   after a step: the checkpoint (the MetaRM rides along), the
                              monitor, whether to stop
    finished_run, finish      a run that must not train on; the bar, trackers and process group closed
    lr_lambda(cfg)            the learning-rate schedule (warm-up, then constant or cosine)
    run_interruptible(train, cfg)  Ctrl-C / SIGTERM: one line with the step reached and the checkpoint
                              the same command resumes from, exit 130 (here, not in guards.py: it
                              needs latest_checkpoint, and checkpoints.py imports guards.py)

The rest of a run's plumbing, one topic a file, which this one calls:
    plumbing/checkpoints.py   atomic checkpoint folders and the exact resume (docs/method.md §4.7)
    plumbing/tracking.py      tensorboard / trackio / wandb
    plumbing/metrics.py       the step's metrics.jsonl line (step_metrics)
    plumbing/validation.py    the held-out validation (run.eval_every; step 0 with run.eval_at_start),
                              the reward-hacking monitor, the early stop
    plumbing/metarm_setup.py  the MetaRM of an rm_nlhf run: restored, loaded or cold-started
                              (the cold start itself: plumbing/cold_start.py)
"""
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys

import torch
import torch.distributed as dist
import yaml

import reward
import rollout

from plumbing.checkpoints import (checkpoint_step, latest_checkpoint, load_trainer_state, save_checkpoint,
                                  truncate_jsonl)
from plumbing.cold_start import record_cold_start
from plumbing.config import check_evaluator_paths, check_scale_config, check_single_pass, validate_config
from plumbing.engine import rollout_backend
from plumbing.evaluators import load_evaluators, remote_evaluators
from plumbing.guards import (apply_optim_settings, check_free_space, check_resume, checkpoint_bytes,
                             checkpoints_at_peak, finite_or_none, lock_out_dir, no_signal_note,
                             last_logged_step, record_resume, stop_together, LOCK_NAME)
from plumbing.items import load_train_items, load_val_items
from plumbing.judge import make_judge
from plumbing.metarm_setup import save_metarm, setup_metarm
from plumbing.models import load_model
from plumbing.pairwise import load_nlhf_items, load_nlhf_val_items
from plumbing.plan import check_memory_plan
from plumbing.prompts import keep_short, policy_chat, prompt_token_limit
from plumbing.scale import (BaseModelView, apply_lora, check_checkpoint_kind, compute_context, setup_distributed,
                            shard_frozen, wrap_policy)
from plumbing.sharded_load import load_sharded_model
from plumbing.tracking import check_wandb_credentials, close_trackers, open_trackers, track_step
from plumbing.validation import held_out_accuracy, monitor, write_early_stop


def setup(cfg, passes):
    """Everything the loop needs, in one dict `state`, or None when the run in run.out_dir is complete.

    Order: what can fail without loading a model first (device, out_dir, config against the world
    size; on a GPU the memory plan, plumbing/plan.py; the run folder's lock, guards.lock_out_dir; on a resume the config against the run's,
    guards.check_resume; data files, the judge's settings), then the policy (float32 master weights, whatever
    model.dtype says: its forwards compute in model.dtype, see compute_context; LoRA adapters on
    it with model.lora, apply_lora), the free space the policy's checkpoints need (guards.check_free_space,
    before anything slow starts), prompts over the length limit dropped, the wrapped model, the rollout
    engine (HF or vLLM), evaluators, the GRPO reference, AdamW + schedule (+ GradScaler for float16), the
    resume point, the MetaRM (rm_nlhf) and the free space again with its share, then the run folder.

    Returns:
        dict: rank, world, device, policy (unwrapped), model (what forward/backward runs on: DDP
        wrapper or the FSDP2-sharded policy), tokenizer, chat, rollout (the rollout engine,
        plumbing/engine.py's {"sample", "push", "sleep", "awake", "llm"}), evaluators,
        ref_model, optimizer, scheduler, scaler, start_step, mrm, pbar (rank 0), lock (rank 0),
        checkpoint_bytes, the streaks emit and step_metrics count (no_signal_streak,
        skipped_streak), and the data: items (rlme) or judge, dh_items, do_items (rm_nlhf).
    """
    tc = cfg["train"]
    check_startup(cfg)
    rank, world, device = setup_distributed(tc["device"], always_group=tc["parallel"] == "fsdp2",
                                            cpu_collectives=tc["cpu_offload"], timeout_s=tc["dist_timeout_s"])
    validate_config(cfg, world)
    check_evaluator_paths(cfg)  # before the policy loads (load_evaluators comes after it)
    check_scale_config(cfg, device)
    check_memory_plan(cfg, world, device)  # on a GPU: a run the memory plan says cannot fit stops here (plumbing/plan.py)
    out_dir = cfg["run"]["out_dir"]
    created = os.path.abspath(out_dir)  # the topmost folder this start creates, if any
    while not os.path.exists(os.path.dirname(created)):
        created = os.path.dirname(created)
    created = None if os.path.exists(created) else created
    lock = lock_out_dir(out_dir, rank, world)  # held until this process ends (a second run stops here)
    try:
        state = start_run(cfg, passes, rank, world, device)
    except BaseException:  # a failed start leaves no run folder of its own behind
        if lock:
            lock.close()
        if created and rank == 0 and os.listdir(out_dir) == [LOCK_NAME]:
            shutil.rmtree(created, ignore_errors=True)
        raise
    if state is None and lock:
        lock.close()
    elif state is not None:
        state["lock"] = lock
    return state


def start_run(cfg, passes, rank, world, device):
    """setup's work once the run folder is locked; the same return value."""
    tc, run, ro, algo = cfg["train"], cfg["run"], cfg["rollout"], cfg["algo"]
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
    # a resume keeps the run's config but for the keys guards.RESUMABLE lists (or run.force_resume)
    changes = check_resume(cfg, ckpt) if ckpt else {}
    state = {"rank": rank, "world": world, "device": device, "passes": passes, "val_items": [], "val_history": [],
             "rewards_since_eval": [], "no_signal_streak": 0, "skipped_streak": 0}

    # data (rm_nlhf: the judge's start-up checks, model name and API key variable, come first)
    task = cfg["task"]
    if task == "rm_nlhf":
        state["judge"] = make_judge(cfg["judge"])
        state["dh_items"], state["do_items"], note = load_nlhf_items(cfg)
        if note and is_main:  # the D_H / D_O split of one dataset (nlhf.split_dh_fraction), for the audit
            print(f"[train] {note}", flush=True)
        if cfg["nlhf"]["val"] != "holdout":  # run.eval_every's held-out pairs from a file (a holdout: below)
            state["val_items"], _ = load_nlhf_val_items(cfg, state["dh_items"])
    else:
        state["items"], state["val_items"] = load_train_items(cfg), load_val_items(cfg)
        check_single_pass(cfg, len(state["items"]))
    # remote evaluators: reachable and returning prompt log-probs, checked before any model loads
    state["remote"] = remote_evaluators(cfg, passes) if task == "rlme" and cfg["reward"]["kind"] in ("rlme", "hybrid") else {}

    # the policy and its prompts; a prompt over the length limit is dropped and counted. Under LoRA
    # (model.lora) the base always comes from model.policy and the adapters from the checkpoint.
    lora = cfg["model"]["lora"]
    check_checkpoint_kind(ckpt, lora)
    source = ckpt if ckpt and not lora else cfg["model"]["policy"]
    wrap = functools.partial(wrap_policy, parallel=tc["parallel"], world=world, device=device, dtype=cfg["model"]["dtype"],
                             cpu_offload=tc["cpu_offload"], gradient_checkpointing=cfg["model"]["gradient_checkpointing"],
                             reduce_every_micro_batch=tc["fsdp_reduce_every_micro_batch"])
    if tc["parallel"] == "fsdp2":  # built on the meta device and sharded, then rank 0's weights (no LoRA here)
        policy, tokenizer = load_sharded_model(lambda: load_model(source, "float32", "cpu"), wrap, device=device,
                                               rank=rank, world=world)
    else:
        policy, tokenizer = load_model(source, "float32", device)
    if lora:
        policy = apply_lora(policy, lora, seed=run["seed"], ckpt=ckpt)
    # free space, first without the MetaRM: a disk that cannot hold the policy's checkpoints stops
    # here, not after the rollout engine started and the MetaRM cold-started (minutes to hours)
    stop_if_disk_short(cfg, state, policy, start=checkpoint_step(ckpt) if ckpt else 0)
    chat = policy_chat(tokenizer, cfg["model"])
    overhead = len(rollout.build_prompt_ids(tokenizer, "", chat))
    if task == "rm_nlhf":
        section, names = "nlhf", ("dh_items", "do_items", "val_items")
        ids = functools.partial(reward.grm_prompt_ids, tokenizer, chat=chat, max_lines=cfg["nlhf"]["max_critique_lines"],
                                style=cfg["nlhf"]["grm_prompt"])
    else:
        section, names = "data", ("items", "val_items")
        ids = functools.partial(rollout.policy_prompt_ids, tokenizer, chat=chat, template=cfg["data"]["prompt_template"])
    key = f"{section}.max_prompt_tokens"
    limit = prompt_token_limit(cfg[section]["max_prompt_tokens"], policy, ro["max_new_tokens"], key)
    dropped = 0
    for name in names:
        state[name], n = keep_short(state[name], ids, limit=limit, key=key, overhead=overhead)
        dropped += n
    if dropped and is_main:
        print(f"[train] dropped {dropped} items whose prompt is over {limit} tokens ({key})", flush=True)
    if task == "rlme":
        check_single_pass(cfg, len(state["items"]))  # again, after the long prompts left
    elif cfg["nlhf"]["val"] == "holdout":  # from the D_H pairs that fit, so none is dropped; D_H keeps the rest
        state["val_items"], state["dh_items"] = load_nlhf_val_items(cfg, state["dh_items"])

    # models: the wrapped policy, the rollout engine, evaluators, the GRPO reference
    model = policy if tc["parallel"] == "fsdp2" else wrap(policy)  # fsdp2: sharded as it loaded
    state.update(policy=policy, model=model, tokenizer=tokenizer, chat=chat)
    # the rollout engine (rollout.backend; plumbing/engine.py): every large generation of the run samples through it
    state["rollout"] = rollout_backend(cfg, policy=policy, model=model, tokenizer=tokenizer, generate=passes["generate"],
                                       context=functools.partial(compute_context, cfg["model"]["dtype"], tc["parallel"], device),
                                       model_path=ckpt if ckpt and not lora else cfg["model"]["policy"], rank=rank)
    if lora and ckpt:  # a vLLM engine started from the base: the resumed adapters, merged, go in now
        state["rollout"]["push"](policy)
    rlme = task == "rlme" and cfg["reward"]["kind"] in ("rlme", "hybrid")
    state["evaluators"] = load_evaluators(cfg, policy, tokenizer, device, passes, remote=state["remote"]) if rlme else []
    state["ref_model"] = None
    if algo["loss"] == "grpo" and algo["kl_coef"] > 0 and lora and tc["fast_paths"]:
        state["ref_model"] = BaseModelView(policy)  # pi_ref = the initial policy = the policy with adapters off
    elif algo["loss"] == "grpo" and algo["kl_coef"] > 0 and tc["parallel"] == "fsdp2":
        # frozen, in model.dtype, 1/world of it a rank as the policy (plumbing/scale.py shard_frozen)
        state["ref_model"], _ = load_sharded_model(lambda: load_model(cfg["model"]["policy"], cfg["model"]["dtype"], "cpu"),
                                                   lambda m: shard_frozen(m.eval(), world, device), device=device,
                                                   rank=rank, world=world)
    elif algo["loss"] == "grpo" and algo["kl_coef"] > 0:  # frozen: may stay in model.dtype
        state["ref_model"], _ = load_model(cfg["model"]["policy"], cfg["model"]["dtype"], device)
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
        apply_optim_settings(state["optimizer"], state["scheduler"], o)  # the config's lr / betas, not the saved ones
    state["mrm"], mrm_source, cold = None, None, None
    if task == "rm_nlhf":  # the MetaRM (RM-NLHF §3.2): restored with the checkpoint, loaded, or cold-started
        # the cold start samples through the run's rollout engine (rollout.backend: HF decode or vLLM)
        state["mrm"], mrm_source, cold = setup_metarm(cfg, ckpt, tokenizer, sample=state["rollout"]["sample"], dh=state["dh_items"],
                                                      judge=state["judge"], device=device, rank=rank, world=world,
                                                      awake=state["rollout"]["awake"])

    # free space for the checkpoints still to come with the MetaRM's share, before the first step
    # (every rank stops alike)
    if state["mrm"] is not None:
        stop_if_disk_short(cfg, state, policy, start=state["start_step"], mrm=state["mrm"])

    # the run folder: the resolved config, logs truncated to the resume point; trackers; the progress bar
    state["pbar"], state["trackers"] = None, []
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:  # the config of the steps from here on
            yaml.safe_dump(cfg, f, sort_keys=False)
        if changes:  # what changed at this resume (resumes.jsonl; config.yaml now says the new values)
            record_resume(out_dir, state["start_step"], changes, forced=run["force_resume"])
            print(f"[train] resuming with changed {', '.join(changes)} (recorded in {out_dir}/resumes.jsonl)",
                  flush=True)
        for name in ("metrics.jsonl", "samples.jsonl"):
            if state["start_step"]:
                truncate_jsonl(os.path.join(out_dir, name), state["start_step"])
            elif os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        if not state["start_step"] and os.path.exists(stopped):
            os.remove(stopped)  # a fresh run over an early-stopped folder
        if cold is not None:  # the cold-start set's size: an empty one is seen
            state["first_step_metrics"] = record_cold_start(out_dir, cold, cfg["metarm"]["rollouts_per_prompt"])
        state["trackers"] = open_trackers(cfg, state["start_step"])
        what = (f"rm_nlhf | D_H {len(state['dh_items'])} items, D_O {len(state['do_items'])} | MetaRM {mrm_source}"
                if task == "rm_nlhf" else f"{cfg['reward']['kind']} | {len(state['items'])} items")
        print(f"[train] {what} | policy {cfg['model']['policy']} | world {world} | "
              f"{'resuming from ' + ckpt if ckpt else 'fresh start'}", flush=True)
        if state["val_items"]:
            print(f"[train] validation every {run['eval_every']} steps on {len(state['val_items'])} held-out "
                  + (f"problems ({cfg['data']['val']})" if task == "rlme" else f"pairs ({cfg['nlhf']['val']})"),
                  flush=True)
        from tqdm import tqdm
        state["pbar"] = tqdm(total=run["total_steps"], initial=state["start_step"], desc="train", dynamic_ncols=True)
    if state["world"] > 1:
        dist.barrier()  # metrics.jsonl is truncated before any rank reads it
    if state["start_step"] and cfg["run"]["eval_every"]:  # the monitor's history, so a resumed run decides alike
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            state["val_history"] = [{"step": m["step"], "accuracy": held_out_accuracy(m), "train_reward": None}
                                    for m in map(json.loads, f) if held_out_accuracy(m) is not None]
    return state


def stop_if_disk_short(cfg, state, policy, *, start, mrm=None):
    """Set state["checkpoint_bytes"] (guards.checkpoint_bytes of the policy, with the MetaRM's share
    when `mrm` is given) and stop every rank alike when run.out_dir cannot hold the checkpoints of
    the steps after `start` (free_space_problem, decided on rank 0)."""
    lora = cfg["model"]["lora"]
    state["checkpoint_bytes"] = checkpoint_bytes(policy, lora=bool(lora), merged=bool(lora and lora["merged"]),
                                                 mrm=mrm)
    problem = free_space_problem(cfg, start, state["checkpoint_bytes"]) if state["rank"] == 0 else None
    stop_together(problem, state["rank"], state["world"])


def free_space_problem(cfg, start, nbytes):
    """The one line why run.out_dir cannot hold the checkpoints of the steps after `start`, each
    `nbytes` (guards.checkpoint_bytes), or None (guards.check_free_space)."""
    r = cfg["run"]
    steps = range(start + 1, r["total_steps"] + 1)
    to_write = sum(1 for s in steps if (r["save_every"] and s % r["save_every"] == 0) or s == r["total_steps"])
    root = os.path.join(r["out_dir"], "checkpoints")
    existing = len([d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)]) if os.path.isdir(root) else 0
    n = checkpoints_at_peak(keep=r["keep_checkpoints"], existing=existing, to_write=to_write)
    where = r["out_dir"] if os.path.isdir(r["out_dir"]) else os.path.dirname(os.path.abspath(r["out_dir"]))
    try:
        check_free_space(where, need=n * nbytes,
                         detail=f"{n} more checkpoint folder(s) of {nbytes / 1e9:.2f} GB at the "
                                f"peak, run.keep_checkpoints={r['keep_checkpoints']}")
    except SystemExit as e:
        return str(e)
    return None


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


def finish(state):
    """Close the progress bar, the experiment trackers and the process group."""
    if state["pbar"] is not None:
        state["pbar"].close()
    close_trackers(state["trackers"])
    if state.get("lock"):
        state["lock"].close()
    if dist.is_initialized():
        dist.destroy_process_group()


def save_run(state, cfg, step):
    """6. The checkpoint of `step` (save_checkpoint; the MetaRM rides along in metarm/), then a
    barrier so no rank runs ahead of rank 0's rename."""
    mrm = state["mrm"]
    lora = cfg["model"]["lora"]
    save_checkpoint(cfg["run"]["out_dir"], step, state["policy"], state["tokenizer"], optimizer=state["optimizer"],
                    scheduler=state["scheduler"], keep=cfg["run"]["keep_checkpoints"], rank=state["rank"],
                    scaler=state["scaler"], merged=bool(lora and lora["merged"]),
                    extra=(lambda d: save_metarm(mrm, os.path.join(d, "metarm"), rank=state["rank"], world=state["world"]))
                    if mrm is not None else None)
    if state["world"] > 1:
        dist.barrier()


def save_and_stop(state, cfg, step, val, metrics):
    """7. After step `step`: the reward-hacking monitor on this step's validation `val` (every
    rank), the checkpoint (run.save_every, the last step, an early stop), then whether to stop:
    the early-stop rule fired (early_stop.json is written, so a rerun stops at start-up) or
    run.stop_after steps ran in this process (as if killed; it says what the same command does).
    Returns: True when the loop must stop."""
    r = cfg["run"]
    limit = cfg["optim"]["max_skipped_steps"]
    if limit and state.get("skipped_streak", 0) >= limit:  # every rank: the streak is global
        ckpt = latest_checkpoint(r["out_dir"])
        raise SystemExit(f"[train] step {step}: the gradient norm was non-finite (NaN/inf) in every optimizer step of "
                         f"the last {state['skipped_streak']} steps (optim.max_skipped_steps={limit}); each was skipped, "
                         f"so no NaN reached the weights or a checkpoint. Usual causes: a non-finite reward or "
                         f"advantage (reward/mean, samples.jsonl), too high an optim.lr, model.dtype float16 without "
                         f"headroom. The same command resumes from " + (ckpt or "the start (no checkpoint yet)"))
    stop_early = bool(val) and monitor(state, cfg, val, metrics)
    if (r["save_every"] and step % r["save_every"] == 0) or step == r["total_steps"] or stop_early:
        save_run(state, cfg, step)
    if stop_early:  # held-out accuracy fell too far for too long (run.early_stop_*)
        write_early_stop(state, cfg, step)
        return True
    if r["stop_after"] and step - state["start_step"] >= r["stop_after"]:
        if state["pbar"] is not None:  # rank 0
            ckpt = latest_checkpoint(r["out_dir"])
            state["pbar"].write(f"[train] run.stop_after={r['stop_after']}: stopped after step {step} "
                                "(as if killed); the same command " + (f"resumes from {ckpt}" if ckpt else
                                f"starts afresh: no checkpoint yet (run.save_every={r['save_every']})"))
        return True
    return False


def policy_loss(algo, *, cispo_loss, grpo_loss):
    """The policy loss train.train picks for config.yaml's `algo:` section, its numbers bound:
    CISPO (RLME Eq. 6-8: eps_low, eps_high, ratio) or GRPO (RM-NLHF Eq. 3: clip_eps, kl_coef).
    cispo_loss, grpo_loss: train.cispo_loss and train.grpo_loss (passed in: nothing in plumbing/
    imports train.py). Returns: functools.partial of one of them."""
    if algo["loss"] == "cispo":
        return functools.partial(cispo_loss, eps_low=algo["eps_low"], eps_high=algo["eps_high"],
                                 ratio=algo["ratio"], aggregation=algo["aggregation"])
    return functools.partial(grpo_loss, clip_eps=algo["clip_eps"], kl_coef=algo["kl_coef"],
                             aggregation=algo["aggregation"])


def update_kwargs(cfg, passes, device, *, cispo_loss, grpo_loss, world, pad_id, ref_model=None, scaler=None):
    """train.update_policy's keyword arguments from `cfg` (algo, rollout, train, optim, model.dtype)
    and `passes` (train.fast_or_plain's), bound as the block at the top of train.train binds them,
    for the scripts and tests that call update_policy without train.train
    (tests/plumbing/test_train_run.py checks that the two are equal, keyword for keyword).

    Args: device: where the loss is computed (and the compute context's device). cispo_loss,
        grpo_loss: policy_loss's. world: number of ranks. pad_id: the tokenizer's pad token id.
        ref_model, scaler: update_policy's (None: no GRPO reference, no float16 loss scaling).
    Returns: dict of update_policy's keyword arguments.
    """
    algo, ro = cfg["algo"], cfg["rollout"]
    logprobs = functools.partial(passes["completion_logprobs"], temperature=ro["temperature"], pad_id=pad_id)
    return dict(loss_fn=policy_loss(algo, cispo_loss=cispo_loss, grpo_loss=grpo_loss),
                aggregation=algo["aggregation"], max_new_tokens=ro["max_new_tokens"],
                updates_per_batch=algo["updates_per_batch"], minibatches=algo["minibatches"],
                group_size=ro["group_size"], micro_batch_size=cfg["train"]["micro_batch_size"],
                grad_clip=cfg["optim"]["grad_clip"], logprobs=logprobs, clip_grad_norm=passes["clip_grad_norm"],
                context=functools.partial(compute_context, cfg["model"]["dtype"], cfg["train"]["parallel"], device),
                world=world, device=device, ref_model=ref_model, scaler=scaler)


def emit(state, cfg, metrics, records):
    """Rank 0 (metrics not None): the metrics.jsonl line, the samples.jsonl lines, the trackers
    (run.report_to), the progress bar; a step whose every reward is masked says so. Returns metrics."""
    if metrics is None:
        return None
    n, known = len(records), metrics["reward/mean"] is not None
    metrics = finite_or_none({**metrics, **state.pop("first_step_metrics", {})})  # e.g. record_cold_start's  # NaN / inf as null: json.dumps would write NaN, which is not JSON
    with open(os.path.join(cfg["run"]["out_dir"], "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if cfg["run"]["log_samples"]:
        with open(os.path.join(cfg["run"]["out_dir"], "samples.jsonl"), "a") as f:
            f.writelines(json.dumps(finite_or_none(r)) + "\n" for r in records)
    track_step(state["trackers"], metrics, records if cfg["run"]["log_samples"] else None)  # run.report_to
    # one redraw a step (a log file gets one line a step): the postfix first, without its own redraw
    acc = held_out_accuracy(metrics)
    acc = metrics["accuracy"] if acc is None else acc
    # a step that cannot move the policy (every reward masked, every group flat) says so in the bar,
    # in the log the first time, and again after 10, 100, ... such steps in a row
    note = no_signal_note(metrics, temperature=cfg["rollout"]["temperature"])
    streak = state["no_signal_streak"] = state.get("no_signal_streak", 0) + 1 if note else 0
    state["pbar"].set_postfix(reward=f"{metrics['reward/mean']:.3f}" if known else "masked",
                              **({"acc": f"{acc:.2f}"} if acc is not None else {}),
                              **({"signal": "none"} if note else {}), s=f"{metrics['time/step']:.0f}", refresh=False)
    if known:
        state["rewards_since_eval"].append(metrics["reward/mean"])  # for the reward-hacking monitor
    if note and not known and streak == 1:
        state["pbar"].write(f"[train] step {metrics['step']}: no reward known, all {n} samples masked "
                            f"(failed judge / remote evaluator calls; reward/masked, samples.jsonl)")
    elif note and (streak == 1 or math.log10(streak).is_integer()):
        state["pbar"].write(f"[train] step {metrics['step']}: nothing to learn from" +
                            (f" for {streak} steps in a row" if streak > 1 else "") + f": {note}")
    state["pbar"].update(1)
    return metrics


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
            found = importlib.util.find_spec(name) is not None  # installed? (find_spec imports nothing)
        except ImportError:
            found = False
        if not found:
            raise SystemExit(f"config key run.report_to: {name} needs the `{name}` package: pip install {name}")
    if "wandb" in cfg["run"]["report_to"]:
        check_wandb_credentials()


def run_interruptible(train, cfg):
    """train(cfg), where Ctrl-C (or the SIGTERM torchrun and schedulers send) ends in one line on
    rank 0, the step reached and what the same command does, and exit status 130."""
    def term(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, term)
    try:
        train(cfg)
    except KeyboardInterrupt:
        out_dir = cfg["run"]["out_dir"]
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):  # the bar closes now, not below the line at exit
            bar.close()
        if int(os.environ.get("RANK", "0")) == 0:
            ckpt = latest_checkpoint(out_dir)
            reached = last_logged_step(os.path.join(out_dir, "metrics.jsonl"))
            cold = os.path.join(out_dir, "cold_start")  # plumbing/cold_start.py: its batches on disk are kept
            print(f"[train] interrupted after step {reached} of {cfg['run']['total_steps']}; the same command "
                  + (f"resumes from {os.path.basename(ckpt)} ({ckpt})" if ckpt else
                     "starts afresh: no checkpoint yet (run.save_every)"
                     + (f"; the MetaRM cold start continues from the batches in {cold}" if os.path.isdir(cold) else "")), file=sys.stderr, flush=True)
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGTERM, old)
