"""Checkpoints: atomic folders and the exact resume (docs/method.md §4.7, docs/scale-out.md
"Checkpoints").

    save_checkpoint(...)      out_dir/checkpoints/step_NNNNNN: written into step_NNNNNN.tmp,
                              fsync'd, marked complete (CHECKPOINT_MARKER) last, renamed: a
                              checkpoint is whole or absent
    latest_checkpoint, complete_checkpoint, checkpoint_step
                              the folder a resume starts from, and its step
    load_trainer_state(...)   the optimizer state (resharded to this run's ranks), scheduler,
                              loss scaler; returns the step
    save_sharded, load_sharded
                              torch.distributed.checkpoint of a state dict: the policy's AdamW
                              state here, the MetaRM's in plumbing/metarm_setup.py
    fsync_tree, fsync_dir     on disk before the marker, the rename after it
    truncate_jsonl            metrics.jsonl / samples.jsonl cut back to the resume point
    no_progress_bars()        transformers' own progress bars off while a checkpoint is written
"""
import contextlib
import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist

from plumbing.guards import checkpoint_bytes, deferred_interrupts, write_failure
from plumbing.scale import save_merged


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
