"""The MetaRM model of an rm_nlhf run (RM-NLHF §3.2): where it comes from, loading and saving it.

    setup_metarm(cfg, ckpt, tokenizer, *, sample, dh, judge, device, rank, world)
                              restored with the checkpoint, loaded from metarm.path, cold-started
                              (plumbing/cold_start.py run_cold_start) or a fresh head
    load_metarm(path, mode, ...)
                              a sequence classifier with a new head, or a saved MetaRM's folder;
                              FSDP2-sharded like the policy under train.parallel fsdp2
    save_metarm(mrm, path), load_saved_metarm(path, ...)
                              the atomic folder (float32 weights, metarm.json, the online AdamW
                              state) and its reader

Beside plumbing/cold_start.py, not in it: the cold start is one way to train a MetaRM that
load_metarm made, while loading and saving also serve a resume, a checkpoint and `python -m
plumbing.cli metarm cold-start`; this file imports cold_start.py, never the other way round.
"""
import contextlib
import json
import os
import shutil

import torch
import torch.distributed as dist

from metarm import raw_outputs
import reward
import rollout

from plumbing.checkpoints import fsync_dir, fsync_tree, load_sharded, save_sharded
from plumbing.cold_start import cold_start_settings, run_cold_start
from plumbing.models import resolve_model_path
from plumbing.scale import broadcast_parameters, metarm_seams, wrap_policy
from plumbing.sharded_load import load_sharded_model


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
    holds it, online_update, and the ranks write it in parallel, plumbing/checkpoints.py save_sharded).
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
