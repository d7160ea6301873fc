# How a run is run (train.py's lower part): config, processes, wrapping, LoRA, checkpoints, lock.
import copy
import datetime
import difflib
import fcntl
import glob
import json
import math
import os
import re
import resource
import shutil
import string
import sys
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp alone: our intent

# ==============================================================================================
# Config: config.yaml is the schema and the defaults; presets and key=value overrides layer on
# top. An unknown key or a value unlike its default's type stops with one line (docs/config.md).

CHOICES = {
    "task": ["rlme", "rm_nlhf"], "model.dtype": ["float32", "bfloat16", "float16"],
    "model.chat_template": ["auto", True, False], "model.gradient_checkpointing": ["none", "full"],
    "data.label_format": ["gsm8k", "plain", "text"], "rollout.backend": ["hf", "vllm"],
    "reward.kind": ["rlme", "rlvr", "hybrid"], "reward.transform": ["log", "prob"],
    "reward.qa_metric": ["em", "f1"], "algo.loss": ["cispo", "grpo"],
    "algo.ratio": ["sequence", "geometric_mean"], "algo.aggregation": [
        "seq_sum", "seq_mean_token_mean", "token_mean", "micro_batch_token_mean", "dr_grpo"],
    "nlhf.threshold_rule": ["strict", "inclusive"],
    "nlhf.similarity": ["f1", "precision", "recall"],
    "nlhf.do_reward": ["paper", "released"], "nlhf.grm_prompt": ["ours", "authors"],
    "judge.backend": ["openai", "proxy"], "judge.variant": ["core", "all", "meta_judge"],
    "judge.on_failure": ["mask", "zero"], "metarm.mode": [
        "none", "offline", "online", "metarm_only", "binary", "binary_retrain", "classifier"],
    "metarm.dtype": ["float32", "bfloat16", "float16"], "train.parallel": ["ddp", "fsdp2"],
    "train.device": ["auto", "cpu", "cuda"]}
NULLABLE = {"data.answer_field", "nlhf.do", "judge.temperature", "judge.max_tokens"}  # null: off
OPT = (str, type(None))
ITEM_FIELDS = {  # the fields a list item may hold, and their types (defaults: _check_items)
    "reward.evaluators": {"name": str, "kind": str, "weight": float, "path": OPT,
                          "chat_template": (str, bool), "chat_template_kwargs": (dict, type(None)),
                          "system_prompt": OPT, "base_url": str, "model": str, "api_key_env": OPT,
                          "timeout_s": float, "max_retries": int, "concurrency": int},
    "reward.meta_questions": {"question": str, "weight": float, "target": str, "negative": str},
    "model.lora": {"r": int, "alpha": float, "dropout": float, "target_modules": (list, str)}}


def _keys(d, prefix=""):
    """Every dotted leaf key of a nested dict."""
    for k, v in d.items():
        yield from _keys(v, prefix + k + ".") if isinstance(v, dict) and v else [prefix + k]


def _type_ok(value, t):
    """isinstance, except that a bool is no number and an int is a float."""
    types = t if isinstance(t, tuple) else (t,)
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types) or (float in types and isinstance(value, int))


def _merge(base, new, where, schema, prefix=""):
    """Deep-merge `new` into `base` in place; one-line SystemExit on an unknown key or wrong type.
    A non-empty mapping is a section; a null or {} default takes any value (replaced whole)."""
    if not isinstance(new, dict):
        what = f"config key {prefix[:-1]}:" if prefix else "the file"
        raise SystemExit(f"{where}: {what} must be a mapping, got {new!r}")
    for k, v in new.items():
        key = f"{prefix}{k}"
        if k not in base:
            known = list(_keys(schema))  # the nearest name, or the same name in another section
            near = ([n for n in known if n.split(".")[-1] == k]
                    or difflib.get_close_matches(key, known, n=1, cutoff=0.6) or [None])[0]
            raise SystemExit(f"{where}: unknown config key {key}"
                             + (f" (did you mean {near}?)" if near else ""))
        default = base[k]
        if isinstance(default, dict) and default:
            _merge(default, v, where, schema, key + ".")
            continue
        if isinstance(default, float) and isinstance(v, str):  # YAML 1.1 reads 3e-6 as a string
            try:
                v = float(v)
            except ValueError:
                pass
        ok = default is None or (v is None and key in NULLABLE) or (
            any(type(v) is type(c) and v == c for c in CHOICES[key]) if key in CHOICES
            else _type_ok(v, type(default)))
        if not ok:
            want = (f"one of {CHOICES[key]}" if key in CHOICES else type(default).__name__)
            raise SystemExit(f"{where}: config key {key}: expected {want}, got {v!r}")
        base[k] = float(v) if isinstance(default, float) and isinstance(v, int) else v


def _read_yaml(path):
    try:
        with open(path, "rb") as f:
            return yaml.safe_load(f) or {}
    except OSError as e:
        raise SystemExit(f"config file {path}: {e.strerror}")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise SystemExit(f"config file {path}: invalid YAML{at}: {getattr(e, 'problem', e)}")


def load_config(paths, overrides=(), schema_path=os.path.join(HERE, "config.yaml")):
    """config.yaml, then each preset in `paths`, then `key.sub=value` overrides (typed by YAML).
    Returns the nested dict, list items with their defaults filled in. Raises SystemExit (one
    line) on a missing file, bad YAML, unknown key, wrong type or a rule of _check broken."""
    schema = _read_yaml(schema_path)
    cfg = copy.deepcopy(schema)
    for p in paths:
        if os.path.abspath(p) != os.path.abspath(schema_path):
            _merge(cfg, _read_yaml(p), f"config file {p}", schema)
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
        _merge(cfg, value, f"override {o!r}", schema)
    _check(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    return cfg


def _check_items(cfg):
    """List items (evaluators, meta-questions) and model.lora: known fields, types, defaults."""
    for key, fields in ITEM_FIELDS.items():
        items = cfg[key.split(".")[0]][key.split(".")[1]]
        if key == "model.lora":  # null (off) or one mapping
            items = [] if items is None else [items]
        elif not isinstance(items, list) or not items:
            raise SystemExit(f"config key {key}: expected a non-empty list")
        for i, item in enumerate(items):
            where = key if key == "model.lora" else f"{key}[{i}]"
            for f, v in item.items() if isinstance(item, dict) else [("", item)]:
                near = difflib.get_close_matches(f, list(fields), n=1)
                if f not in fields or not _type_ok(v, fields[f]):
                    raise SystemExit(f"config key {where}.{f}: " + (
                        f"bad value {v!r}" if f in fields else "unknown"
                        + (f" (did you mean {near[0]}?)" if near else "")))
    for i, mq in enumerate(cfg["reward"]["meta_questions"]):
        mq.setdefault("weight", 1.0)
        if not (mq.get("question") and mq.setdefault("target", "Yes").strip()
                and mq.setdefault("negative", "No").strip()):
            raise SystemExit(f"config key reward.meta_questions[{i}]: needs a question, a target")
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        kind = ev.setdefault("kind", "live")
        for f, v in (("name", f"{kind}{i}"), ("weight", 1.0), ("path", None),
                     ("chat_template", "auto"), ("chat_template_kwargs", None),
                     ("system_prompt", None)):
            ev.setdefault(f, v)
        for bad, why in [
                (kind not in ("live", "frozen_self", "frozen", "remote"), "kind: not one of live, "
                 "frozen_self, frozen, remote"),
                (kind == "frozen" and not ev["path"], "path: frozen needs a model"),
                (kind == "remote" and not {"base_url", "model"} <= set(ev), "kind: remote needs "
                 "base_url and model")]:
            if bad:
                raise SystemExit(f"config key reward.evaluators[{i}].{why}")
    names = [ev["name"] for ev in cfg["reward"]["evaluators"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"config key reward.evaluators: names must be unique, got {names}")
    lora = cfg["model"]["lora"]
    if lora is not None and not (lora.setdefault("dropout", 0.0) < 1 and min(
            lora.get("r", 0), lora.get("alpha", 0)) > 0 and lora.get("target_modules")):
        raise SystemExit("config key model.lora: needs r > 0, alpha > 0, target_modules "
                         "(names or all-linear); dropout in [0, 1)")


def _check(cfg, world):
    """Finite numbers, list items, and the few rules across keys; one-line SystemExit."""
    def finite(v, key):
        if isinstance(v, float) and not math.isfinite(v):
            raise SystemExit(f"config key {key}: {v} is not a finite number")
        for k, x in v.items() if isinstance(v, dict) else ():
            finite(x, f"{key}.{k}" if key else k)
        for i, x in enumerate(v) if isinstance(v, list) else ():
            finite(x, f"{key}[{i}]")
    finite(cfg, "")
    _check_items(cfg)
    for key in ("rollout.prompts_per_step", "rollout.max_new_tokens", "train.micro_batch_size",
                "algo.updates_per_batch", "algo.minibatches", "run.total_steps",
                "run.keep_checkpoints"):
        if cfg[key.split(".")[0]][key.split(".")[1]] < 1:
            raise SystemExit(f"config key {key}: must be >= 1")
    ro, a, o, nl, run, d, rw = (cfg[k] for k in (
        "rollout", "algo", "optim", "nlhf", "run", "data", "reward"))
    n, dtype, par = ro["prompts_per_step"] // world, cfg["model"]["dtype"], cfg["train"]["parallel"]
    fields = {f for _, f, _, _ in string.Formatter().parse(d["prompt_template"]) if f}
    zero = cfg["task"] == "rlme" and rw["kind"] != "rlvr" and any(
        all(x["weight"] == 0 for x in rw[k]) for k in ("evaluators", "meta_questions"))
    for bad, msg in [  # (broken, "key: what it needs")
            (ro["group_size"] < 2, "rollout.group_size: must be >= 2 (A = r - mean(group))"),
            (ro["prompts_per_step"] % world, f"rollout.prompts_per_step: not divisible by {world}"),
            (n % a["minibatches"], f"algo.minibatches: must divide the {n} groups of a rank"),
            (a["loss"] == "cispo" and a["kl_coef"] > 0, "algo.kl_coef: needs algo.loss grpo"),
            (ro["temperature"] <= 0 or not 0 < ro["top_p"] <= 1, "rollout.temperature / top_p: "
                                                                 "> 0 / in (0, 1]"),
            (min(o["weight_decay"], o["grad_clip"], o["warmup_steps"]) < 0 or not o["lr"] > 0,
             "optim: lr must be > 0, weight_decay / grad_clip / warmup_steps >= 0"),
            (zero, "reward.evaluators / meta_questions: every weight is 0 (RLME Eq. 3: no reward)"),
            (d["answer_field"] is None and rw["kind"] != "rlme", "reward.kind: needs labels"),
            ("question" not in fields or fields - {"question", "context", "answer"},
             "data.prompt_template: needs {question}; may hold {context}, {answer}"),
            (cfg["model"]["lora"] and par != "ddp", "model.lora: needs train.parallel ddp"),
            (dtype == "float16" and par == "fsdp2", "model.dtype float16: ddp only (loss scaling)"),
            (any(not 0 <= nl[k] <= 1 for k in ("dh_per_step", "lam", "threshold")),
             "nlhf.dh_per_step / lam / threshold: must be in [0, 1]"),
            (not 0 <= nl["split_dh_fraction"] < 1 or nl["split_dh_fraction"] and nl["do"],
             "nlhf.split_dh_fraction: in [0, 1), and only with nlhf.do: null"),
            (cfg["metarm"]["mode"] in ("binary", "binary_retrain", "classifier")
             and not nl["gate_on_outcome"], "metarm.mode: binary/classifier need gate_on_outcome"),
            ((run["early_stop_drop"] > 0) != (run["early_stop_patience"] > 0),
             "run.early_stop_drop / early_stop_patience: set both or neither"),
            (bool(run["eval_every"]) != bool(d["val"]), "run.eval_every / data.val: both or none")]:
        if bad:
            raise SystemExit(f"config key {msg}")


# ==============================================================================================
# Processes: torchrun's environment, the process group, reductions over ranks


def setup_process_group(device_setting, parallel, timeout_s=1800.0):
    """The process group under torchrun (gloo on CPU, nccl on GPU), and a one-process one for
    FSDP2, which needs a group even alone. timeout_s: how long a collective waits for the slowest
    rank (a 7B checkpoint on a slow disk takes ~15 minutes). Returns (rank, world, device)."""
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


def all_max(x, world):
    return all_sum(x, world, op=dist.ReduceOp.MAX)


def gather_records(records, world):
    """Every rank's list of per-sample dicts, in rank order, on every rank."""
    if world == 1:
        return records
    out = [None] * world
    dist.all_gather_object(out, records)
    return [r for part in out for r in part]


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KB


# ==============================================================================================
# Wrapping: DDP or FSDP2 (docs/scale-out.md). The trained weights and AdamW state are float32
# master weights, compute runs in model.dtype: an AdamW step of 1e-6 on a bf16 weight of 0.02
# (bf16's spacing there: ~1e-4) would round to nothing.


def _fully_shard(model, device, world, mp_dtype=None):
    """fully_shard each decoder layer (the model's _no_split_modules), then the root; FSDP2
    changes the model's class in place. mp_dtype: gather in it for compute, reduce in float32."""
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
    """The module to run forward/backward on. ddp: DistributedDataParallel when world > 1, else
    the policy. fsdp2: fully_shard per decoder layer and the root; on GPU a MixedPrecisionPolicy
    computes in `dtype` (on CPU gloo keeps float32). gradient_checkpointing "full": only each
    decoder layer's input is kept, the layer replayed in backward (same numbers, less memory)."""
    if gradient_checkpointing == "full":  # non-reentrant: the variant FSDP2 and no_sync take
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": False})
    if parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(policy, ids) if world > 1 else policy
    cuda_mp = device.type == "cuda" and dtype != "float32"
    return _fully_shard(policy, device, world, getattr(torch, dtype) if cuda_mp else None)


def shard_frozen(model, world, device):
    """FSDP2 shards of a frozen model (the GRPO reference): 1/world of its weights a rank."""
    return _fully_shard(model.requires_grad_(False), device, world)


def load_sharded_model(load, shard, device, rank, world):
    """(FSDP2 model, tokenizer) without any rank but 0 holding the full weights: rank 0 runs
    load() -> (CPU model, tokenizer); every rank builds the architecture on the meta device,
    `shard`s it, and receives its slice of rank 0's tensors one tensor at a time (at 7B: not
    8 ranks x 30 GB of float32 copies in the node's RAM at once)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full, tok = load() if rank == 0 else (None, None)
    box = [type(full), full.config, full.generation_config, tok] if rank == 0 else [None] * 4
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    with torch.device("meta"):
        model = box[0]._from_config(box[1], dtype=box[1].dtype)
    model.generation_config = box[2]
    model = shard(model)
    model.to_empty(device=device)
    set_model_state_dict(model, full.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buf in model.named_buffers():  # RoPE's inv_freq is in no state dict
        if rank == 0:
            buf.copy_(full.get_buffer(name))
        if world > 1:
            dist.broadcast(buf, src=0)
    return model, box[3]


@contextmanager
def grad_sync(model, world, sync):
    """Gradient accumulation: DDP all-reduces on the step's last micro-batch only (`sync`). FSDP2
    reduce-scatters every micro-batch into the float32 shard (its default: no rank ever holds an
    unsharded gradient; the same sum up to float32 order)."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    with model.no_sync() if ddp and not sync else nullcontext():
        yield


@contextmanager
def unsharded(model):
    """Full FSDP2 parameters through a block of forwards (HF generate: ranks stop at different
    steps, so per-layer all-gathers would deadlock): one gather, then reshard. Else a no-op."""
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


# ==============================================================================================
# LoRA (model.lora; docs/method.md §4.7): W x + (alpha / r) B A x, only A and B train.


def apply_lora(policy, lora, seed, ckpt=None):
    """The policy with peft LoRA adapters on lora["target_modules"], A drawn under `seed` and
    B = 0 (at step 0 the policy IS the base), or the adapter saved in `ckpt`. A PeftModel."""
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
    """The LoRA policy with its adapters off: the initial policy (frozen_self evaluators, the GRPO
    reference) without a second copy of the weights; it shares, never changes, the policy's."""

    def __init__(self, policy):
        super().__init__()
        self.policy, self.config = policy, policy.config

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()


# ==============================================================================================
# Checkpoints: out_dir/checkpoints/step_NNNNNN, written into step_NNNNNN.tmp and renamed: a folder
# without .tmp is whole. The weights: save_pretrained (float32; any HF loader reads them). AdamW:
# torch.distributed.checkpoint, every rank its own shard, resharded to any world size on resume.


def lr_lambda(warmup_steps):
    """LambdaLR's factor: linear warmup (step + 1) / (warmup_steps + 1), then constant."""
    return lambda step: (step + 1) / (warmup_steps + 1) if step < warmup_steps else 1.0


def save_checkpoint(out_dir, step, policy, tokenizer, optimizer, scheduler, keep, rank=0, world=1,
                    scaler=None, extra=None):
    """Every rank calls this. step_NNNNNN holds the weights (rank 0; under FSDP2 gathered, a
    collective; under LoRA the adapter), optimizer/ (every rank its part), trainer_state.pt (step,
    scheduler, loss scaler), rng_<rank>.pt, and what `extra(folder)` writes on every rank (the
    MetaRM). Rank 0 then renames it into place and deletes all but the newest `keep`."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from transformers.utils import logging as hf_logging
    policy = getattr(policy, "module", policy)  # never the DDP wrapper
    root = os.path.join(out_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
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
        hf_logging.disable_progress_bar()  # its bars would break the training bar's line
        policy.save_pretrained(tmp, state_dict=full)
        hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(tmp)
        torch.save({"step": step, "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None},
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


def checkpoint_step(ckpt):
    return int(os.path.basename(ckpt).split("_")[1])


def _unreadable(folder):
    """Why a checkpoint cannot be resumed from, or None. A weights file cut short reads as
    safetensors' "incomplete metadata"; any read error counts."""
    from safetensors import safe_open
    try:
        weights = glob.glob(f"{folder}/**/*.safetensors", recursive=True)  # the MetaRM's too
        for f in weights or [os.path.join(folder, "model.safetensors")]:
            with safe_open(f, "pt"):
                pass
        torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)
        open(os.path.join(folder, "optimizer", ".metadata"), "rb").close()
    except Exception as e:  # noqa: BLE001  (whatever it is, the older checkpoint is tried)
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


def latest_checkpoint(out_dir, rank=0):
    """The newest checkpoint in out_dir/checkpoints that reads, or None. A damaged one (a weights
    file cut short by a crash) is reported in one line (rank 0) and the one before it is used."""
    root = os.path.join(out_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    for name in sorted((n for n in names if re.fullmatch(r"step_\d+", n)), reverse=True):
        why = _unreadable(os.path.join(root, name))
        if why is None:
            return os.path.join(root, name)
        if rank == 0:
            print(f"[resume] skipping checkpoint {root}/{name}: {why}", file=sys.stderr)
    return None


def load_checkpoint(ckpt, policy, optimizer, scheduler, scaler=None, rank=0):
    """Restore AdamW (resharded to this run's ranks), the scheduler, the loss scaler and this
    rank's RNG; returns the step. The weights come from `ckpt` already (load_model, apply_lora);
    `optimizer` is built on the wrapped policy's parameters."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    policy = getattr(policy, "module", policy)
    osd = get_optimizer_state_dict(policy, optimizer)  # this rank's layout, for dcp to fill
    dcp.load(osd, checkpoint_id=os.path.join(ckpt, "optimizer"), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(policy, optimizer, osd)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
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


# ==============================================================================================
# The run lock: one live run per out_dir. flock on <out_dir>/run.lock, which holds the pid; the
# kernel drops the lock when its process dies (kill -9 too), so a stale lock is taken over.


def lock_run(out_dir, rank=0):
    """Rank 0 locks the run folder for this process's life: returns the open lock file (keep it),
    None on other ranks. SystemExit naming the pid of a live run that holds it."""
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
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f
