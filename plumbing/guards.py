"""What keeps a run from going silently wrong or losing work: one lock per run folder, a resume
that refuses settings it cannot honour, free space before the first checkpoint, Ctrl-C that
says where the run is, and JSON logs that never hold NaN.

    lock_out_dir(out_dir, rank, world)       the run folder's lock (fcntl: released when the process dies)
    resume_changes, check_resume, record_resume, apply_optim_settings
                                             the config of a resumed run against the run's own (RESUMABLE)
    checkpoint_bytes, checkpoints_at_peak, check_free_space, write_failure
                                             what a checkpoint needs on disk, checked before training
    deferred_interrupts, last_logged_step    Ctrl-C / SIGTERM: never half a save; the step a run reached
                                             (plumbing/run.py's run_interruptible: one line, exit 130)
    finite_or_none, no_signal_note           JSON-safe metrics; a step that cannot learn says so
    stop_together, flatten                   rank 0's problem stops every rank; a config as dotted keys
"""
import contextlib
import datetime
import errno
import json
import math
import os
import shutil
import signal
import socket

import torch.distributed as dist

# Keys that may differ between the run in run.out_dir and the command that resumes it: they say
# how long, how often, where to and how fast the run goes, never what one step computes. Any
# other difference stops the resume (check_resume) unless run.force_resume is true; what changed
# is recorded in <out_dir>/resumes.jsonl either way.
RESUMABLE = (
    "run.total_steps", "run.save_every", "run.keep_checkpoints", "run.resume", "run.force_resume",
    "run.log_samples", "run.stop_after", "run.eval_every", "run.eval_at_start", "run.early_stop_drop", "run.early_stop_patience",
    "run.report_to", "run.tracking_project",
    "data.val", "data.val_config", "data.val_split", "data.val_size",                 # the held-out validation
    "nlhf.val_temperature", "nlhf.val_max_new_tokens",  # (nlhf.val, val_size: a holdout changes D_H)
    "train.micro_batch_size", "rollout.micro_batch_size", "reward.micro_batch_size",  # memory: one global
    "model.gradient_checkpointing", "metarm.gradient_checkpointing", "train.fast_paths",                               # normaliser, same update
    "metarm.cold_start_batch_size",  # the cold start is over once a checkpoint exists (its MetaRM is in it)
    "train.parallel", "train.cpu_offload", "train.device", "train.dist_timeout_s",  # the checkpoint is layout-agnostic (docs/scale-out.md)
    "rollout.vllm_gpu_memory_utilization", "rollout.vllm_enforce_eager", "rollout.vllm_sleep_level",
    "judge.base_url", "judge.api_key_env", "judge.concurrency", "judge.timeout_s", "judge.max_retries",
    "judge.backoff_base_s", "judge.backoff_max_s",
)
LOCK_NAME = "run.lock"
_held = {}  # lock path -> open file, for this process (an earlier train() call in it has ended)


# --- the run folder's lock ------------------------------------------------------------------------

def lock_out_dir(out_dir, rank=0, world=1):
    """Rank 0 takes an exclusive lock on <out_dir>/run.lock for as long as this process lives;
    every rank stops (one line on rank 0) when another live run holds it.

    flock, not a pid file: the kernel drops the lock when its process dies, kill -9 included, so
    a stale lock never blocks a resume. The file holds the holder's pid, host and start time for
    the message. Returns the open file (keep it referenced; closing it releases the lock) or None
    on ranks > 0. Raises SystemExit naming the holder.
    """
    import fcntl
    held, handle = "", None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.abspath(os.path.join(out_dir, LOCK_NAME))
        if path in _held:  # this process's own earlier run (train() called again, e.g. in tests)
            _held.pop(path).close()
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            try:
                h = json.loads(handle.read() or "{}")
            except ValueError:
                h = {}
            handle.close()
            held = (f"run.out_dir={out_dir} is in use by another run (pid {h.get('pid', '?')} on "
                    f"{h.get('host', '?')}, started {h.get('started', '?')}; {path}): wait for it to end, "
                    f"or give this run another run.out_dir")
        else:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "started": datetime.datetime.now().isoformat(timespec="seconds")}))
            handle.flush()
            _held[path] = handle
    stop_together(held, rank, world)
    return handle


def stop_together(problem, rank, world):
    """Rank 0's `problem` (a one-line message, or None/"") stops every rank: SystemExit with the
    message on rank 0, a silent SystemExit(1) elsewhere; no rank is left waiting in a collective."""
    if world > 1 and dist.is_initialized():
        box = [problem or ""]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
        if problem and rank != 0:
            raise SystemExit(1)
    if problem:
        raise SystemExit(problem)


# --- resume: the new config against the run's own --------------------------------------------------

def flatten(cfg, prefix=""):
    """{"a.b": value} for every leaf of a nested dict (lists stay values)."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_changes(saved, cfg):
    """The keys whose value differs between the run's saved config and this one, as
    {key: (saved value, new value)}. Keys only one of them has are left out: they come from a
    different version of config.yaml (a new key takes its default), not from the user."""
    a, b = flatten(saved), flatten(cfg)
    return {k: (a[k], b[k]) for k in sorted(set(a) & set(b)) if a[k] != b[k]}


def check_resume(cfg, ckpt):
    """Before a resume from checkpoint `ckpt` (before any model loads): compare cfg with
    <run.out_dir>/config.yaml, the config of the run's last segment. Returns the differences
    ({key: (old, new)}); raises SystemExit (one line naming the keys) when one is outside
    RESUMABLE and run.force_resume is false."""
    import yaml
    path = os.path.join(cfg["run"]["out_dir"], "config.yaml")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        changes = resume_changes(yaml.safe_load(f) or {}, cfg)
    # micro_batch_token_mean weights each micro-batch's token mean: there the micro-batch size changes the update
    fixed = [k for k in changes if k not in RESUMABLE or (k == "train.micro_batch_size"
                                                           and cfg["algo"]["aggregation"] == "micro_batch_token_mean")]
    if fixed and not cfg["run"]["force_resume"]:
        shown = ", ".join(f"{k} ({changes[k][0]!r} -> {changes[k][1]!r})" for k in fixed[:4])
        more = f" and {len(fixed) - 4} more" if len(fixed) > 4 else ""
        raise SystemExit(f"resume from {ckpt}: the config differs from the run's ({path}) in {shown}{more}; "
                         f"these change what a step computes: set run.out_dir to a new folder (or run.resume=false) "
                         f"for a new run, or run.force_resume=true to apply them from step "
                         f"{int(os.path.basename(ckpt).split('_')[1]) + 1} on (recorded in resumes.jsonl)")
    return changes


def record_resume(out_dir, step, changes, forced):
    """Append one line to <out_dir>/resumes.jsonl: the step resumed from, when, and each changed
    key with its old and new value (config.yaml then describes the steps after `step`)."""
    line = {"step": step, "time": datetime.datetime.now().isoformat(timespec="seconds"), "forced": bool(forced),
            "changed": {k: list(v) for k, v in changes.items()}}
    with open(os.path.join(out_dir, "resumes.jsonl"), "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def apply_optim_settings(optimizer, scheduler, optim):
    """After load_trainer_state: the config's lr, betas and weight decay win over the restored
    ones (equal unless run.force_resume changed them), so the saved config is what applies; the
    schedule continues at its step from the config's lr."""
    scheduler.base_lrs = [optim["lr"]] * len(optimizer.param_groups)
    for g, f in zip(optimizer.param_groups, scheduler.lr_lambdas):
        g.update(initial_lr=optim["lr"], lr=optim["lr"] * f(scheduler.last_epoch),
                 betas=(optim["beta1"], optim["beta2"]), weight_decay=optim["weight_decay"])
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


# --- disk space ------------------------------------------------------------------------------------

def checkpoint_bytes(policy, *, lora=False, merged=False, mrm=None):
    """Bytes one checkpoint folder takes (save_checkpoint), from the parameter counts: the weights
    as saved (float32 master weights; under LoRA the adapters alone, plus the merged model's
    weights when `merged`), AdamW's two float32 moments per trained parameter, and the MetaRM
    with its AdamW moments (every mode but offline trains it). Tokenizer and JSON files: 2 % +
    16 MiB on top. tests/plumbing/test_guards.py holds it against a real folder's size."""
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.parameters())
    size = (trained + (total if merged else 0) if lora else total) * 4 + trained * 8
    if mrm is not None:
        n = sum(p.numel() for p in mrm["model"].parameters())
        size += n * 4 + (n * 8 if mrm["mode"] != "offline" else 0)
    return int(size * 1.02) + (16 << 20)


def checkpoints_at_peak(*, keep, existing, to_write):
    """How many more checkpoint folders than the `existing` ones the disk holds at the peak:
    save_checkpoint writes the new folder before it deletes the oldest, so `keep` + 1 folders
    (run.keep_checkpoints: 0 = keep all: every one of the `to_write` still to come)."""
    if keep <= 0:
        return max(to_write, 1)
    return max(min(keep + 1, existing + to_write) - existing, 1)


def check_free_space(out_dir, *, need, detail, free=None):
    """SystemExit (one line) when run.out_dir has fewer than `need` bytes free (`free` defaults
    to shutil.disk_usage of the folder). `detail` says how `need` was counted."""
    free = shutil.disk_usage(out_dir).free if free is None else free
    if free < need:
        raise SystemExit(f"run.out_dir={out_dir}: {free / 1e9:.2f} GB free, the checkpoints need about "
                         f"{need / 1e9:.2f} GB ({detail}): free space, lower run.keep_checkpoints or move run.out_dir")


DISK_ERRORS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def write_failure(e, folder, need):
    """The one line for a checkpoint write that failed with `e` (OSError, or torch.save's
    RuntimeError, which carries no errno: "iostream error", "unexpected pos"), or None when `e`
    is not a failed write. `need`: bytes the checkpoint takes (checkpoint_bytes)."""
    text = str(e)
    if isinstance(e, OSError) and e.errno in DISK_ERRORS:
        why = os.strerror(e.errno)
    elif isinstance(e, RuntimeError) and any(s in text for s in ("iostream error", "unexpected pos",
                                                                   "failed writing", "No space left")):
        why = "the write failed"
    else:
        return None
    parent = os.path.dirname(folder)
    free = shutil.disk_usage(parent).free if os.path.isdir(parent) else 0
    return (f"checkpoint {folder} could not be written ({why}): it needs about {need / 1e9:.2f} GB and "
            f"{free / 1e9:.2f} GB are free there; the partial folder was removed, the last complete checkpoint "
            f"is intact: free space (or lower run.keep_checkpoints) and run the same command to resume")


# --- interrupts ------------------------------------------------------------------------------------

@contextlib.contextmanager
def deferred_interrupts():
    """Inside the block SIGINT and SIGTERM are held back and delivered (as KeyboardInterrupt) when
    it ends: a checkpoint is either written whole or, on an interrupt before the block, not begun."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    old = {s: signal.signal(s, lambda n, f: caught.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if caught:
            raise KeyboardInterrupt


def last_logged_step(path):
    """The last step in metrics.jsonl, 0 when there is none."""
    step = 0
    with contextlib.suppress(OSError):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    step = json.loads(line).get("step", step)
    return step


# --- logs --------------------------------------------------------------------------------------------

def finite_or_none(x):
    """x with every NaN / inf float replaced by None (JSON null): json.dumps would write NaN,
    which is not JSON, and a reader's parser stops there."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


def no_signal_note(metrics, *, temperature):
    """Why this step cannot change the policy, or None: every reward masked, or every group flat
    (all G rewards equal, so every advantage is 0 and the update is 0), with the likely cause."""
    if metrics["reward/mean"] is None:
        return "no reward known: every sample masked (failed judge / remote evaluator calls; reward/masked)"
    if metrics["groups/zero_variance_frac"] < 1.0:
        return None
    why = "every group's rewards are equal, so every advantage and the update are 0"
    if metrics.get("nlhf/format_error_rate") == 1.0:
        return why + " (every GRM output failed to parse: nlhf/format_error_rate 1.0, reward -1 everywhere)"
    if temperature < 0.3:
        return why + f" (rollout.temperature={temperature}: the G completions of a prompt are likely identical)"
    return why
