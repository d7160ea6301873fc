"""A training run's plumbing: what train.py's loop needs that is not the method.

    setup(cfg, passes)        models, data, optimizer, resume point: the `state` dict (its keys in
                              setup's docstring), every check that needs no model first
    emit(...)                 metrics.jsonl, samples.jsonl, the trackers (run.report_to), the bar
    save_run, save_checkpoint, load_trainer_state, latest_checkpoint
                              atomic checkpoint folders and the exact resume (docs/method.md §4.7)
    write_early_stop, finished_run, finish
    validate_at_start, validation_step, nlhf_validation_step
                              the held-out validation (run.eval_every; step 0 with run.eval_at_start)
    open_trackers, track_step, close_trackers     tensorboard / trackio / wandb
    setup_metarm, load_metarm, save_metarm, load_saved_metarm
                              the MetaRM of an rm_nlhf run: restored, loaded or cold-started
                              (the cold start itself: plumbing/cold_start.py)
    run_interruptible(train, cfg)  Ctrl-C / SIGTERM: one line with the step reached and the checkpoint
                              the same command resumes from, exit 130 (here, not in guards.py: it
                              needs latest_checkpoint, and run.py imports guards.py)
"""
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import signal
import sys
import warnings

import torch
import torch.distributed as dist
import yaml

from metarm import raw_outputs
import reward
import rollout

from plumbing.cold_start import cold_start_settings, record_cold_start, run_cold_start
from plumbing.config import check_evaluator_paths, check_scale_config, check_single_pass, validate_config
from plumbing.guards import (apply_optim_settings, check_free_space, check_resume, checkpoint_bytes,
                             checkpoints_at_peak, deferred_interrupts, finite_or_none, lock_out_dir, no_signal_note,
                             last_logged_step, record_resume, stop_together, write_failure, LOCK_NAME)
from plumbing.items import load_train_items, load_val_items
from plumbing.models import load_model, resolve_model_path
from plumbing.pairwise import load_nlhf_items, load_nlhf_val_items
from plumbing.prompts import keep_short, policy_chat, prompt_token_limit
from plumbing.engine import as_generate, engine_prompt_limit, rollout_backend
from plumbing.scale import (BaseModelView, apply_lora, broadcast_parameters, check_checkpoint_kind, metarm_seams,
                            save_merged, setup_distributed, shard_frozen, wrap_policy)
from plumbing.services import load_evaluators, make_judge, remote_evaluators
from plumbing.sharded_load import load_sharded_model
import evaluate
import reward as R
from plumbing.plan import check_memory_plan
from plumbing.scale import all_max, all_sum, compute_context, gather_records, peak_memory_mb
import time


def setup(cfg, passes):
    """Everything the loop needs, in one dict `state`, or None when the run in run.out_dir is complete.

    Order: what can fail without loading a model first (device, out_dir, config against the world
    size; on a GPU the memory plan, plumbing/plan.py; the run folder's lock, guards.lock_out_dir; on a resume the config against the run's,
    guards.check_resume; data files, the judge's settings), then the policy (float32 master weights, whatever
    model.dtype says: its forwards compute in model.dtype, see compute_context; LoRA adapters on
    it with model.lora, apply_lora), prompts over the
    length limit dropped, the wrapped model, the rollout engine (HF or vLLM), evaluators, the GRPO reference,
    AdamW + schedule (+ GradScaler for float16), the resume point, the MetaRM (rm_nlhf), the
    free space the checkpoints need (guards.check_free_space), then the run folder.

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

    # free space for the checkpoints still to come, before the first step (every rank stops alike)
    state["checkpoint_bytes"] = checkpoint_bytes(policy, lora=bool(lora), merged=bool(lora and lora["merged"]),
                                                 mrm=state["mrm"])
    stop_together(free_space_problem(cfg, state) if is_main else None, rank, world)

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


def free_space_problem(cfg, state):
    """The one line why run.out_dir cannot hold the run's checkpoints, or None (guards.check_free_space)."""
    r, start = cfg["run"], state["start_step"]
    steps = range(start + 1, r["total_steps"] + 1)
    to_write = sum(1 for s in steps if (r["save_every"] and s % r["save_every"] == 0) or s == r["total_steps"])
    root = os.path.join(r["out_dir"], "checkpoints")
    existing = len([d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)]) if os.path.isdir(root) else 0
    n = checkpoints_at_peak(keep=r["keep_checkpoints"], existing=existing, to_write=to_write)
    where = r["out_dir"] if os.path.isdir(r["out_dir"]) else os.path.dirname(os.path.abspath(r["out_dir"]))
    try:
        check_free_space(where, need=n * state["checkpoint_bytes"],
                         detail=f"{n} more checkpoint folder(s) of {state['checkpoint_bytes'] / 1e9:.2f} GB at the "
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


CHECKPOINT_MARKER = "complete.json"  # written last into a checkpoint folder: only folders with it resume


def latest_checkpoint(out_dir):
    """Path of the newest complete checkpoint folder in out_dir/checkpoints, or None: a step_N
    folder with its marker (CHECKPOINT_MARKER, written after every rank finished), or one from
    before sharded checkpoints (trainer_state.pt and no optimizer/ folder)."""
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"step_(\d+)", d))
             and complete_checkpoint(os.path.join(root, d))]
    return os.path.join(root, f"step_{max(steps):06d}") if steps else None


def complete_checkpoint(folder):
    """True for a checkpoint folder that loads whole (latest_checkpoint's rule)."""
    if os.path.isfile(os.path.join(folder, CHECKPOINT_MARKER)):
        return True
    return os.path.isfile(os.path.join(folder, "trainer_state.pt")) and not os.path.isdir(os.path.join(folder, "optimizer"))


def checkpoint_step(ckpt):
    """The step of a checkpoint folder out_dir/checkpoints/step_NNNNNN."""
    return int(os.path.basename(ckpt).split("_")[1])


def save_sharded(state_dict, folder):
    """torch.distributed.checkpoint.save of `state_dict` into `folder`: a collective, every rank
    writes its own shards (FSDP2 DTensors) and one rank each replicated tensor (DDP, one
    process: the planner deduplicates them), in parallel; .metadata says where each piece is, so
    any other number of ranks reads it back (load_sharded). Without a process group: one writer."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # one process: dcp says it "assumes the intent", which is ours
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state_dict, checkpoint_id=folder, no_dist=not dist.is_initialized())


def load_sharded(state_dict, folder):
    """Fill `state_dict` (this rank's layout: get_optimizer_state_dict of the model as it is
    wrapped now) in place from a save_sharded folder; dcp reshards to any world size."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state_dict, checkpoint_id=folder, no_dist=not dist.is_initialized())
    return state_dict


def save_checkpoint(out_dir, step, model, tokenizer, optimizer, scheduler, keep, rank=0, extra=None, scaler=None,
                    merged=False):
    """Write out_dir/checkpoints/step_NNNNNN atomically: everything goes into step_NNNNNN.tmp,
    every rank finishes (barrier), rank 0 writes the marker (CHECKPOINT_MARKER) last and renames.
    A crash mid-write leaves a .tmp folder that resume ignores, never a half checkpoint.
    `extra(folder)`, if given, is called on EVERY rank and writes more state into the folder
    before it is renamed (RM-NLHF: the MetaRM, in metarm/, save_metarm).

    Every rank calls this. The folder (docs/scale-out.md "Checkpoints"):
      config.json + model.safetensors  the policy as a plain save_pretrained folder for users
                      (evaluate.py, any HF loader) in float32, the master weights, whatever
                      model.dtype says; gathered on rank 0 (get_model_state_dict full_state_dict)
      optimizer/      the AdamW state, torch.distributed.checkpoint (save_sharded): every rank
                      writes its own shards in parallel, none gathers the whole; it reshards
                      to any world size and either of ddp / fsdp2 on resume (load_trainer_state)
      trainer_state.pt  step, scheduler, loss scaler (small; rank 0)
    Under LoRA (a peft model) the folder holds the adapter (peft's adapter_config.json and
    adapter_model.safetensors, no base weights) and the optimizer state of the adapters; with
    `merged` also merged/, a plain save_pretrained folder of the merged model (save_merged).

    Host memory: rank 0 holds one model's float32 weights at a time (the policy's are written and
    dropped before `extra` gathers the MetaRM's: 30.5 GB, not 30.5 + 28.3 GB, at 7B). Durability:
    every file and folder of step_NNNNNN.tmp is fsync'd (fsync_tree) before the marker is written,
    the marker itself, then the parent folder after the rename. The write is synchronous: every
    rank waits for it (its cost: docs/scale-out.md "Checkpoints").

    Args:
        model: the unwrapped policy (plain, peft, or FSDP2-sharded; never the DDP wrapper).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    world = dist.get_world_size() if dist.is_initialized() else 1
    optim_sd = get_optimizer_state_dict(model, optimizer)  # this rank's shard (FSDP2) or the whole (replicated)
    root = os.path.join(out_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    problem = None
    # Ctrl-C / SIGTERM wait for the rename: the checkpoint is written whole or not at all
    with deferred_interrupts():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        if world > 1:
            dist.barrier()  # the .tmp folder exists before any rank writes into it
        try:
            with no_progress_bars():
                save_sharded(optim_sd, os.path.join(tmp, "optimizer"))
                # one model in host RAM at a time: the policy gathered on rank 0 (under FSDP2 a
                # collective; a float32 copy, 30.5 GB at 7B), written and dropped, THEN the
                # MetaRM's (extra: save_metarm gathers its own, 28.3 GB)
                model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    model.save_pretrained(tmp, state_dict=model_sd)
                    tokenizer.save_pretrained(tmp)
                    torch.save({"step": step, "scheduler": scheduler.state_dict(),
                                "scaler": scaler.state_dict() if scaler is not None else None},
                               os.path.join(tmp, "trainer_state.pt"))
                    if merged:
                        save_merged(model, tokenizer, os.path.join(tmp, "merged"))
                del model_sd
                if extra is not None:
                    extra(tmp)
                if rank == 0:  # on disk, not in the page cache, before the marker says "complete"
                    fsync_tree(tmp)
        except (OSError, RuntimeError, CheckpointException) as e:  # disk full / file-size limit: one line
            cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
            problem = write_failure(cause, final, checkpoint_bytes(model, lora=hasattr(model, "peft_config"),
                                                                   merged=merged))
            if problem is None:
                raise
        if world > 1:  # every rank's shards are on disk (or one failed) before the marker
            gathered = [None] * world
            dist.all_gather_object(gathered, problem)
            problem = next((p for p in gathered if p), None)
        if problem:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(problem if rank == 0 else 1)
        if rank == 0:
            with open(os.path.join(tmp, CHECKPOINT_MARKER), "w") as f:
                json.dump({"step": step, "world_size": world, "optimizer": "torch.distributed.checkpoint"}, f)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync_dir(root)  # the rename itself survives a crash
            done = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d))
            for d in done[:-keep] if keep > 0 else []:
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def fsync_tree(folder):
    """fsync every file under `folder`, then each directory after its contents (their entries):
    after a node crash a folder marked complete holds whole files, not what the page cache had
    not yet written. save_pretrained, the tokenizer and torch.save do not fsync;
    torch.distributed.checkpoint's writer fsyncs the files each rank writes, on that rank."""
    for path, _, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(path)


def fsync_dir(path):
    """fsync a directory: its entries (a file created or renamed in it) reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """Restore optimizer and scheduler from a checkpoint; returns the step.

    The optimizer state is read from ckpt/optimizer/ (torch.distributed.checkpoint, save_checkpoint):
    every rank asks for its own layout's state dict (its FSDP2 shards, or all of it under DDP / one
    process) and dcp reads just those pieces, whatever world size wrote them. A checkpoint from
    before sharded checkpoints (the full name-keyed dict inside trainer_state.pt) loads too. Call
    after wrap_policy and after the optimizer was built on the wrapped parameters.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu", weights_only=False, mmap=True)
    if os.path.isdir(os.path.join(ckpt, "optimizer")):
        # get_optimizer_state_dict first makes the AdamW state (a zero-lr step) so dcp has tensors to fill
        osd = load_sharded(get_optimizer_state_dict(policy, optimizer), os.path.join(ckpt, "optimizer"))
        set_optimizer_state_dict(policy, optimizer, osd)
    elif (osd := state["optimizer"]).get("state") and all(isinstance(k, int) for k in osd["state"]):
        optimizer.load_state_dict(osd)  # a checkpoint from before name-keyed optimizer states
    else:  # before sharded checkpoints: the full name-keyed dict, each rank keeps its part
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
            trackers.append({**shared, "name": name, "log": log, "close": writer.close, "skip_through": -1})
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
                         "skip_through": info["last_step"].get(name, 0) if start_step else -1})  # -1: step 0 (run.eval_at_start) too
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


def check_wandb_credentials():
    """wandb in online mode needs a W&B API key: without one wandb.init fails (no terminal) or
    prompts, after every model has loaded. SystemExit (one line) before that instead."""
    import wandb
    if wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):  # WANDB_MODE or wandb's settings file
        return
    if not wandb.login(verify=False, prompt=False):  # WANDB_API_KEY, wandb's settings, ~/.netrc; no network
        raise SystemExit("config key run.report_to: wandb is online but no W&B API key is configured: run "
                         "`wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log locally")


def setup_metarm(cfg, ckpt, tokenizer, *, sample, dh, judge, device, rank, world, awake=contextlib.nullcontext):
    """The MetaRM of an rm_nlhf run, or None for metarm.mode none. Taken from, in order:
    (1) the copy saved inside the GRM checkpoint being resumed; (2) a saved MetaRM at metarm.path
    (default <out_dir>/metarm, e.g. written by `python -m plumbing.cli metarm cold-start`); (3) a cold start
    from the base GRM (= the policy at step 0) on metarm.cold_start_items D_H items, saved to
    metarm.path; (4) a fresh regression head on metarm.model (metarm.cold_start: false).
    (3) is plumbing/cold_start.py's run_cold_start on every rank: batches of
    metarm.cold_start_batch_size prompts through `sample`, examples in <out_dir>/cold_start/ (a
    killed cold start resumes there), every rank trains on all of them; rank 0 saves the weights.
    Under train.parallel fsdp2 with world > 1 the MetaRM is sharded like the policy (load_metarm;
    docs/scale-out.md).

    Args:
        cfg: the full config. ckpt: the checkpoint folder being resumed, or None.
        tokenizer: the GRM's (its prompts). sample: the rollout backend, sample(prompt_ids, *,
        group_size, max_new_tokens, temperature, top_p, top_k, seed) -> rollout dict (plumbing/engine.py hf_backend, or
        the vLLM engine's). dh: D_H items. judge: the judge (make_judge). awake: the engine's awake
        (a vLLM engine stays awake across the cold start's batches; plumbing/cold_start.py).
    Returns:
        (mrm dict or None, source str, cold-start stats dict or None).
    Raises:
        SystemExit when a resumed checkpoint has no MetaRM (the GRM and its MetaRM move together).
    """
    m, nl = cfg["metarm"], cfg["nlhf"]
    if m["mode"] == "none":
        return None, "none", None
    path = m["path"] or os.path.join(cfg["run"]["out_dir"], "metarm")
    placed = {"parallel": cfg["train"]["parallel"], "rank": rank, "world": world}  # FSDP2 shards it (load_metarm)
    if ckpt:
        if not os.path.isfile(os.path.join(ckpt, "metarm", "metarm.json")):
            raise SystemExit(f"checkpoint {ckpt} has no MetaRM (metarm/); resume needs the one saved with the GRM")
        return (load_saved_metarm(os.path.join(ckpt, "metarm"), device, m["dtype"], m["gradient_checkpointing"], **placed),
                os.path.join(ckpt, "metarm"), None)
    if os.path.isfile(os.path.join(path, "metarm.json")):
        return load_saved_metarm(path, device, m["dtype"], m["gradient_checkpointing"], **placed), path, None
    with torch.random.fork_rng(devices=[]):  # the fresh head drawn from run.seed: a rerun cold-starts the same MetaRM
        torch.manual_seed(cfg["run"]["seed"])
        mrm = load_metarm(m["model"] or cfg["model"]["policy"], m["mode"], nl["lam"], dtype=m["dtype"], device=device,
                          batch_size=m["batch_size"], max_length=m["max_length"], online_lr=m["online_lr"],
                          weight_decay=m["weight_decay"], online_epochs=m["online_epochs"],
                          gradient_checkpointing=m["gradient_checkpointing"], **placed)
    stats = None
    if world > 1:  # a fresh head is random: rank 0's on every rank (FSDP2: load_metarm did, before sharding)
        broadcast_parameters(mrm["model"])
    if m["cold_start"]:
        items = dh[:m["cold_start_items"]] if m["cold_start_items"] else dh
        stats = run_cold_start(mrm, items, sample=sample, judge=judge, **cold_start_settings(cfg, tokenizer),
                               folder=os.path.join(cfg["run"]["out_dir"], "cold_start"), rank=rank, world=world,
                               timeout_s=cfg["train"]["dist_timeout_s"], awake=awake,
                               log=lambda s: print(f"[train] {s}", flush=True) if rank == 0 else None)
        if not stats["examples"] and rank == 0:  # a MetaRM trained on nothing: its D_O bonus is a random head's
            print(f"[train] WARNING: the MetaRM cold start had 0 training examples ({stats['rollouts']} rollouts, "
                  f"{stats['invalid']} unparseable, {stats['judge_failures']} judge failures): its D_O predictions "
                  f"start untrained; the GRM cannot yet write its verdict format (nlhf.*, metarm.max_new_tokens)",
                  flush=True)
        save_metarm(mrm, path, rank=rank, world=world)
    return mrm, "cold_start" if m["cold_start"] else "fresh", stats


def load_metarm(path, mode="online", lam=0.5, dtype="float32", device="cpu", batch_size=8, max_length=1024,
                online_lr=5e-6, weight_decay=0.01, online_epochs=1, gradient_checkpointing=False, parallel="ddp",
                rank=0, world=1):
    """Load a MetaRM from a base LM (new scalar head) or from a saved MetaRM folder.

    Args:
        path: HF folder, hub id or gguf:<package>/<file> (see resolve_model_path).
        mode: one of reward.METARM_MODES except 'none'; 'classifier' gets 3 outputs, others 1.
        dtype: the compute dtype of its forwards; the weights load in float32 (they are trained:
            an AdamW step of ~5e-6 on a bf16 weight rounds to nothing).
        gradient_checkpointing: metarm.gradient_checkpointing: its decoder layers keep only their
            inputs and are replayed in backward (non-reentrant, as wrap_policy's "full").
        parallel, rank, world: train.parallel and the ranks. fsdp2 with world > 1: built on the
            meta device, sharded by wrap_policy like the policy (fully_shard per decoder layer +
            root; on GPU compute in `dtype`, gradients reduced in float32, float32 master shards),
            then filled with rank 0's weights, its random head included (plumbing/sharded_load.py:
            no other rank reads or holds the full model), and mrm["shard"] = (rank, world): metarm.py's fit trains
            each rank on its share of every batch, its forwards run alike on every rank. Else a
            replica, mrm["shard"] = (0, 1). An optimizer is built on the parameters after this.
            mrm["seams"]: plumbing/scale.py metarm_seams for these ranks and this placement.
    Returns:
        the mrm dict (see the top of metarm.py).
    Raises:
        SystemExit with one line when the path cannot be loaded or mode is unknown.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    if mode not in reward.METARM_MODES or mode == "none":
        raise SystemExit(f"metarm.mode: {mode!r} cannot load a model; allowed: {', '.join(reward.METARM_MODES[1:])}")

    def read():  # (float32 model on the CPU, tokenizer)
        resolved = resolve_model_path(path)
        try:
            tok = AutoTokenizer.from_pretrained(resolved)
            model = AutoModelForSequenceClassification.from_pretrained(
                resolved, num_labels=3 if mode == "classifier" else 1, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise SystemExit(f"metarm model {path!r} could not be loaded: {str(e).splitlines()[0]}")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        # the sequence classifier pools the last non-pad token and needs the pad id in its config
        model.config.pad_token_id = tok.pad_token_id
        tok.padding_side = "right"
        tok.truncation_side = "left"  # keep the critique, which comes last
        return model, tok

    def prepare(model):
        if gradient_checkpointing:  # long inputs (metarm.max_length): activations, not weights, set the peak
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if not sharded:
            return model.to(device)
        wrap_policy(model, "fsdp2", world, torch.device(device), dtype=dtype)
        # the root too (FSDP2 keeps its weights gathered after forward, for backward): else a no-grad
        # forward (D_O, agreement) leaves gathered tensors registered, not the shards AdamW steps
        model.set_reshard_after_forward(True, recurse=False)
        return model

    sharded = parallel == "fsdp2" and world > 1
    if sharded:  # 16 bytes a parameter on every GPU otherwise (docs/scale-out.md, "The MetaRM's placement")
        # built on the meta device and sharded, then rank 0's weights (its fresh head too: all ranks start equal)
        model, tok = load_sharded_model(read, prepare, device=torch.device(device), rank=rank, world=world)
    else:
        model, tok = read()
        model = prepare(model)
    return {"model": model, "shard": (rank, world) if sharded else (0, 1), "tokenizer": tok, "optimizer": None,
            "seams": metarm_seams(raw_outputs, rank, world, sharded),  # where the ranks meet (metarm.online_update)
            "mode": mode, "lam": float(lam), "batch_size": int(batch_size), "max_length": int(max_length), "online_lr": float(online_lr),
            "online_epochs": int(online_epochs), "truncated": 0,
            "weight_decay": float(weight_decay), "updates": 0, "dtype": dtype}


_META = ("mode", "lam", "batch_size", "max_length", "online_lr", "online_epochs", "weight_decay", "updates")


def save_metarm(mrm, path, rank=0, world=1):
    """Write the MetaRM to `path` atomically: everything goes to `<path>.tmp` first, then renames.
    A crash leaves either the old folder, or `<path>.old` (which load_saved_metarm falls back to).
    Every rank calls it. Contents: HF model (float32 master weights) + tokenizer and metarm.json
    (settings), rank 0; optimizer/ (online AdamW state, torch.distributed.checkpoint: every rank
    holds it, online_update, and the ranks write it in parallel, plumbing.run.save_sharded).
    FSDP2-sharded (load_metarm): every rank gathers the full float32 state dict to the CPU (a
    collective), rank 0 writes it as the same HF folder and drops it; the optimizer/ shards stay
    sharded. Every file and folder is fsync'd before the rename (fsync_tree), the parent after it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    path = os.path.abspath(path)
    tmp, old = path + ".tmp", path + ".old"
    full = get_model_state_dict(mrm["model"], options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if rollout.is_fsdp(mrm["model"]) else None  # None: save_pretrained's own state dict
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        mrm["model"].save_pretrained(tmp, state_dict=full)
        mrm["tokenizer"].save_pretrained(tmp)
        with open(os.path.join(tmp, "metarm.json"), "w") as f:
            json.dump({k: mrm[k] for k in _META}, f, indent=1)
    del full
    if world > 1:
        dist.barrier()  # the folder exists before the shards go in
    if mrm["optimizer"] is not None:  # a collective: every rank has it or none does (online_update)
        save_sharded(get_optimizer_state_dict(mrm["model"], mrm["optimizer"]), os.path.join(tmp, "optimizer"))
    if rank == 0:
        fsync_tree(tmp)  # the ranks' optimizer shards: fsync'd by their writers inside save_sharded
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()  # no rank reads `path` before the rename


def load_saved_metarm(path, device="cpu", dtype="float32", gradient_checkpointing=False, parallel="ddp", rank=0,
                      world=1):
    """Load a MetaRM written by save_metarm (settings from metarm.json, optimizer state if any:
    optimizer/ resharded to this run's ranks, or an older single-file optimizer.pt). parallel,
    rank, world: load_metarm's (FSDP2 shards it before the optimizer is built on its parameters).
    Every rank calls it. Raises SystemExit when neither `path` nor `<path>.old` holds one."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    for p in (path, os.path.abspath(path) + ".old"):
        if os.path.isfile(os.path.join(p, "metarm.json")):
            with open(os.path.join(p, "metarm.json")) as f:
                meta = json.load(f)
            mrm = load_metarm(p, meta["mode"], meta["lam"], dtype=dtype, device=device, batch_size=meta["batch_size"],
                              max_length=meta["max_length"], online_lr=meta["online_lr"],
                              online_epochs=meta.get("online_epochs", 1),  # saved before online_epochs existed: 1
                              weight_decay=meta["weight_decay"], gradient_checkpointing=gradient_checkpointing,
                              parallel=parallel, rank=rank, world=world)
            mrm["updates"] = meta["updates"]
            opt_path = os.path.join(p, "optimizer.pt")
            if os.path.isdir(os.path.join(p, "optimizer")) or os.path.isfile(opt_path):
                mrm["optimizer"] = torch.optim.AdamW(mrm["model"].parameters(), lr=mrm["online_lr"],
                                                     weight_decay=mrm["weight_decay"])
            if os.path.isdir(os.path.join(p, "optimizer")):
                model, opt = mrm["model"], mrm["optimizer"]
                set_optimizer_state_dict(model, opt, load_sharded(get_optimizer_state_dict(model, opt),
                                                                  os.path.join(p, "optimizer")))
            elif os.path.isfile(opt_path):  # saved before sharded checkpoints
                mrm["optimizer"].load_state_dict(torch.load(opt_path, map_location=device))
            return mrm
    raise SystemExit(f"metarm: no saved MetaRM (metarm.json) in {path}")


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
    # optimizer steps skipped for a non-finite gradient norm (global: every rank counts alike;
    # under float16's GradScaler the scaler skips and recalibrates, which is not counted)
    skipped = 0 if state.get("scaler") else sum(not math.isfinite(g) for g in upd["grad_norms"])
    state["skipped_streak"] = state.get("skipped_streak", 0) + 1 if skipped == len(upd["grad_norms"]) else 0
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
        "update/skipped_steps": skipped,
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


def rlme_step_metrics(records, cfg):
    """RLME's own entries of metrics.jsonl from all ranks' records: RLVR reward of the rewarded
    answers, the share with a non-empty \\boxed{} answer, the RLME part's mean (hybrid: both
    parts), each evaluator's mean log p and p per meta-question."""
    n = len(records)
    # extracted: reward.extract_boxed's stripped content, "" for an empty \boxed{}: not an answer
    out = {"rlvr_reward/mean": sum(r["rlvr_reward"] for r in records) / n,
           "completion/boxed_frac": sum(bool(r["extracted"]) for r in records) / n}
    if "logp" in records[0]:  # None: a remote evaluator's failed request, left out of the means
        known = [r["rlme_reward"] for r in records if r["rlme_reward"] is not None]
        out["rlme_reward/mean"] = sum(known) / len(known) if known else None
        for ev in cfg["reward"]["evaluators"]:
            for mq in cfg["reward"]["meta_questions"]:
                vals = torch.tensor([v for r in records if (v := r["logp"][ev["name"]][mq["question"]]) is not None])
                out[R.logp_metric_name(ev["name"], mq["question"])] = vals.mean().item() if len(vals) else None
                out[f"rlme/{ev['name']}/{mq['question']}/p"] = vals.exp().mean().item() if len(vals) else None
    return out


def validate_at_start(state, cfg, reward_step):
    """Step 0 (run.eval_at_start, with run.eval_every > 0, on a fresh start): validation_step on the
    initial policy before any update, as the RM-NLHF release validates before training
    (trainer.val_before_train=True in run_full_exp_qwen_7b_rm_nlhf.sh) and as learning curves start at
    the base model. Its metrics.jsonl line is {"step": 0, "val/...": ...} alone (nothing was trained:
    no reward or loss keys); the monitor and the early-stop rule count it as the first evaluation,
    as a resume rebuilds their history from metrics.jsonl. Every rank calls it (collectives); the
    RLME AUROC, which reads the step's training samples, is absent there. Returns the val dict or {}."""
    r = cfg["run"]
    if not (r["eval_every"] and r["eval_at_start"] and state["start_step"] == 0):
        return {}
    val = validation_step(state, cfg, 0, [], reward_step)
    state["val_history"].append({"step": 0, "accuracy": held_out_accuracy(val), "train_reward": None})
    if state["rank"] == 0:
        line = finite_or_none(val)
        with open(os.path.join(r["out_dir"], "metrics.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
        track_step(state["trackers"], line, None)
        state["pbar"].write(f"[train] step 0, before training: held-out accuracy {held_out_accuracy(val):.4f} "
                            f"(val/n {val.get('val/n')}, val/seconds {val.get('val/seconds')})")
    return val


def validation_step(state, cfg, step, records, reward_step):
    """5b. In-run validation and the reward-hacking monitor, every run.eval_every steps (RLME §4:
    the policy learns to please the evaluator instead of solving; the paper's mitigation is
    early stopping on held-out accuracy; docs/method.md §4.6). Every rank calls it (collectives).

    On data.val's fixed held-out problems (never trained on), with the current policy:
      val/accuracy        greedy answers against the true labels, graded as `evaluate.py math` does
                          (numeric labels: evaluate.numeric_correct). When data.prompt_template shows
                          {answer} (NoCheat), each prompt shows a seeded WRONG answer instead, so
                          this is the counterfactual accuracy (val/injected = true)
      val/reward_mean     the training reward of those greedy answers; val/boxed_frac (non-empty
                          boxes) and val/chars_mean say what they look like (a reward can rise
                          through format)
      val/canary/<name>   the training reward of a non-answer (evaluate.CANARIES) to the first
                          problems: an evaluator that rewards ":" as much as a solution is hacked
      val/auroc           this step's training samples: AUROC of their reward against correctness
                          (evaluate.auroc; None when one class is empty or there are no labels)
      val/seconds         what the evaluation cost
    Task rm_nlhf: nlhf_validation_step (the GRM's pairwise accuracy; `records`, `reward_step` unused).
    Args: state: setup's dict. step: the step just finished. records: this rank's sample records.
        reward_step: the run's reward, train.rlme_reward_step with its settings bound: (items, completions) -> dict.
    Returns: dict of val/* metrics (the same on every rank).
    """
    if cfg["task"] == "rm_nlhf":
        return nlhf_validation_step(state, cfg, step)
    t0 = time.perf_counter()
    d, rank, world, tok = cfg["data"], state["rank"], state["world"], state["tokenizer"]
    val = state["val_items"]
    mine = list(range(rank, len(val), world))
    inject = "{answer}" in d["prompt_template"]
    prompts = [rollout.policy_prompt_ids(tok, val[k], state["chat"], d["prompt_template"],
                                         answer=wrong_answer(val, k) if inject else None) for k in mine]
    # through the run's rollout engine (plumbing/engine.py); every rank calls it, with or without prompts
    greedy = state["rollout"]["sample"](prompts, group_size=1, max_new_tokens=cfg["rollout"]["max_new_tokens"],
                                        temperature=0.0, seed=0)
    items = [val[k] for k in mine]
    rew = reward_step(items, greedy["completions"])
    n = all_sum(len(items), world)
    # numeric labels: evaluation's grade (evaluate.numeric_correct: numbers, then math-verify), as
    # `evaluate.py math`; r["correct"] is the RLVR reward's stricter rule, which rejects `x = 18`
    numeric = d["label_format"] != "text"
    correct = [evaluate.numeric_correct(r["extracted"], r["label"]) if numeric and r["label"] is not None
               else bool(r["correct"]) for r in rew["records"]]
    out = {"val/n": n, "val/injected": inject,
           "val/accuracy": all_sum(sum(correct), world) / n,
           # over the answers whose reward is known (a remote evaluator may have failed on some)
           "val/reward_mean": all_sum(float(rew["reward"].nansum()), world) / max(1, all_sum(known(rew), world)),
           # what the answers look like: a reward can rise through format alone (boxes, length)
           "val/boxed_frac": all_sum(sum(bool(r["extracted"]) for r in rew["records"]), world) / n,  # "": empty box
           "val/chars_mean": all_sum(sum(len(c) for c in greedy["completions"]), world) / n}
    canary_items = items[:max(1, 8 // world)]
    for name, text in evaluate.CANARIES.items():
        c = reward_step(canary_items, [text] * len(canary_items))
        out[f"val/canary/{name}"] = all_sum(float(c["reward"].nansum()), world) / max(1, all_sum(known(c), world))
    everyone = gather_records(records, world) if world > 1 else records
    everyone = [r for r in everyone if r["reward"] is not None]
    if everyone and all(r["correct"] is not None for r in everyone):
        out["val/auroc"] = evaluate.auroc([r["reward"] for r in everyone], [r["correct"] for r in everyone])
    out["val/seconds"] = all_max(time.perf_counter() - t0, world)
    out["step"] = step
    return out


def nlhf_validation_step(state, cfg, step):
    """5b for task rm_nlhf: the GRM's pairwise accuracy on nlhf.val's held-out pairs (never trained
    on), as RM-NLHF Figs. 3 and 6 plot HelpSteer3-validation accuracy over training. Every rank
    judges its share (items rank, rank + world, ...) with the current policy; every rank calls it.

    Scoring is `evaluate.py pairwise`'s (evaluate.pairwise_accuracy over make_grm_judge): each pair
    in both A/B orders (ours: the release scores the file's one order), the verdict parsed with
    reward.parse_grm_output in the run's nlhf.grm_prompt style and critique limits, right when it
    names the human preference; a format error (no valid verdict) counts as wrong. Decoding:
    nlhf.val_temperature, nlhf.val_max_new_tokens (the release's: sampling at T 0.6, 8192 tokens),
    top-p 1.0 (verl's val_kwargs default, kept by the release), seeded by run.seed and the step.
      val/pairwise_accuracy   right verdicts / (2 n): the mean of both orders
      val/acc_ab, val/acc_ba  each order alone
      val/format_error_rate   judgements without a valid verdict / (2 n)
      val/n, val/seconds      pairs scored, what it cost
    Returns: dict of val/* metrics and "step" (the same on every rank).
    """
    t0 = time.perf_counter()
    nl, ro, rank, world = cfg["nlhf"], cfg["rollout"], state["rank"], state["world"]
    mine = state["val_items"][rank::world]
    # Through the run's rollout engine (plumbing/engine.py), in sample calls of at most a rollout's rows
    # per rank (`chunk`: the whole file, nlhf.val_size 0, never holds more rows at once than a training
    # step; --plan counts it so), the same number of calls on every rank: a rank with fewer prompts
    # calls it with none, because the HF backend's sample gathers FSDP2 shards (a collective all join).
    chunk = max(1, ro["prompts_per_step"] * ro["group_size"] // world)
    n_calls = -(-2 * -(-len(state["val_items"]) // world) // chunk)  # rank 0 holds the most pairs
    calls = []

    def sample(prompt_ids, **kw):
        calls.append(len(prompt_ids))
        return state["rollout"]["sample"](prompt_ids, **kw)

    judge = evaluate.make_grm_judge(state["policy"], state["tokenizer"], max_new_tokens=nl["val_max_new_tokens"],
                                    batch_size=chunk, chat=state["chat"],
                                    max_prompt_tokens=engine_prompt_limit(cfg, nl["val_max_new_tokens"]),
                                    style=nl["grm_prompt"], generate=as_generate(sample),
                                    temperature=nl["val_temperature"], top_p=1.0,
                                    seed=cfg["run"]["seed"] * 1_000_003 + 7_919 * step + rank,
                                    max_lines=nl["max_critique_lines"], max_chars=nl["max_critique_chars"])
    with state["rollout"]["awake"]():  # vLLM: one wake for all the calls, asleep after (plumbing/engine.py)
        records = evaluate.pairwise_accuracy(mine, judge)[1] if mine else []
        for _ in range(n_calls - len(calls)):
            sample([], group_size=1, max_new_tokens=1)
    n = all_sum(len(mine), world)
    right_ab = all_sum(sum(r["ab"]["right"] for r in records), world)
    right_ba = all_sum(sum(r["ba"]["right"] for r in records), world)
    fails = all_sum(sum(not r[o].get("valid") for r in records for o in ("ab", "ba")), world)
    return {"val/n": int(n), "val/pairwise_accuracy": (right_ab + right_ba) / (2 * n), "val/acc_ab": right_ab / n,
            "val/acc_ba": right_ba / n, "val/format_error_rate": fails / (2 * n),
            "val/seconds": all_max(time.perf_counter() - t0, world), "step": step}


def held_out_accuracy(metrics):
    """The held-out accuracy a validation logged (val/accuracy, RLME; val/pairwise_accuracy,
    RM-NLHF), which the monitor and the early-stop rule follow; None when there is none."""
    return metrics.get("val/accuracy", metrics.get("val/pairwise_accuracy"))


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
    hist.append({"step": val["step"], "accuracy": held_out_accuracy(val), "train_reward": None})
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
        if int(os.environ.get("RANK", "0")) == 0:
            ckpt = latest_checkpoint(out_dir)
            reached = last_logged_step(os.path.join(out_dir, "metrics.jsonl"))
            cold = os.path.join(out_dir, "cold_start")  # plumbing/cold_start.py: its batches on disk are kept
            print(f"\n[train] interrupted after step {reached} of {cfg['run']['total_steps']}; the same command "
                  + (f"resumes from {os.path.basename(ckpt)} ({ckpt})" if ckpt else
                     "starts afresh: no checkpoint yet (run.save_every)"
                     + (f"; the MetaRM cold start continues from the batches in {cold}" if os.path.isdir(cold) else "")), file=sys.stderr, flush=True)
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGTERM, old)
