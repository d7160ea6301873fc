"""RLME / RLVR / RM-NLHF training loop under torchrun: rollout -> reward -> advantage -> CISPO/GRPO update.

    torchrun --nproc_per_node 8 train.py --config config.yaml            # GPU node (nccl)
    torchrun --nproc_per_node 1 train.py --config configs/cpu.yaml       # one CPU process (gloo)
    python train.py --config configs/cpu.yaml run.total_steps=3           # same, without torchrun

One training step, top to bottom in `train()`:
  1. this rank's P/world prompts -> G completions each              (rollout_batch: HF or vLLM)
  2. rewards: RLME meta-evaluation log p(Yes), or RLVR 0/1           (reward.rlme_reward)
  3. advantages: r - mean(group), optionally / std                    (RLME Eq. 5)
  4. behaviour log-probs (when the update is off-policy, or to log the vLLM gap)
  5. CISPO update: detached clipped IS weight x advantage x sum of token log-probs (Eq. 6-8),
     one global normaliser across micro-batches and ranks, grad clip, AdamW; then the new
     weights into the vLLM engine                                    (push_weights)
  6. metrics.jsonl / samples.jsonl on rank 0, atomic checkpoints
task: rm_nlhf (SPEC §5, configs/rm_nlhf.yaml) runs the same loop and update with GRPO; only the
prompts (GRM prompts for D_H + D_O pairs, nlhf_step_items) and step 2 differ: judge rewards for
D_H, MetaRM update, MetaRM prediction for D_O, D_O rewards, in that order (nlhf_rewards, §5.4).
Parallelism (train.parallel: ddp | fsdp2), the vLLM backend and the memory plan: docs_scale.md.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import re
import resource
import shutil
import time

import torch
import torch.distributed as dist
import yaml
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import metarm
import reward as R
import rollout

HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------------------
# Config (SPEC §3): config.yaml is the schema; presets and key=value overrides layer on top.

CHOICES = {
    "task": ["rlme", "rm_nlhf"],
    "model.dtype": ["float32", "bfloat16", "float16"],
    "model.chat_template": ["auto", True, False],
    "model.gradient_checkpointing": ["none", "full", "selective"],
    "data.label_format": ["gsm8k", "plain"],
    "rollout.backend": ["hf", "vllm"],
    "reward.kind": ["rlme", "rlvr"],
    "algo.loss": ["cispo", "grpo"],
    "algo.ratio": ["sequence", "geometric_mean"],
    "algo.aggregation": ["seq_sum", "token_mean", "dr_grpo"],
    "optim.schedule": ["constant", "cosine"],
    "train.parallel": ["ddp", "fsdp2"],
    "rollout.vllm_sleep_level": [1, 2],
    "train.device": ["auto", "cpu", "cuda"],
    "nlhf.dh_schema": ["auto", *R.PAIR_SCHEMAS],
    "nlhf.do_schema": ["auto", *R.PAIR_SCHEMAS],
    "judge.backend": ["openai", "proxy"],
    "metarm.mode": list(R.METARM_MODES),
    "metarm.dtype": ["float32", "bfloat16", "float16"],
}
# Keys allowed inside list items (the list itself replaces the default list).
LIST_ITEM_KEYS = {
    "reward.evaluators": {"name": str, "kind": str, "weight": float, "path": (str, type(None)),
                          "chat_template": (str, bool)},
    "reward.meta_questions": {"question": str, "weight": float, "target": str, "negative": str},
}


def _check_type(key, value, default):
    """One-line SystemExit when `value` does not have the type of the schema's default."""
    if key in CHOICES:  # check the choices themselves (type-strict: true is not 1), naming them
        if not any(type(value) is type(c) and value == c for c in CHOICES[key]):
            raise SystemExit(f"config key {key}: {value!r} is not one of {CHOICES[key]}")
        return
    if default is None or value is None and key in NULLABLE:
        return
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          list: lambda v: isinstance(v, list)}.get(type(default), lambda v: True)
    if not ok(value):
        raise SystemExit(f"config key {key}: expected {type(default).__name__}, got {value!r}")


# Keys that no longer exist, and what replaced them (a one-line error instead of "unknown key").
RENAMED = {"train.share_prompt": "train.fast_paths (true: the group's prompt runs once in the update)"}

NULLABLE = {"reward.evaluator_template", "nlhf.dh_config", "nlhf.do", "nlhf.do_config", "judge.model",
            "judge.api_key_env", "metarm.model", "metarm.path"}


def _get(cfg, key):
    """cfg value of a dotted key ('task', 'algo.loss')."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _merge(base, new, prefix=""):
    """Deep-merge `new` into `base` (in place), refusing keys the schema does not have."""
    if not isinstance(new, dict):
        raise SystemExit(f"config {prefix or 'file'}: expected a mapping, got {new!r}")
    for k, v in new.items():
        key = f"{prefix}{k}"
        if key in RENAMED:
            raise SystemExit(f"config key {key} was replaced by {RENAMED[key]}")
        if k not in base:
            raise SystemExit(f"unknown config key {key} (known: {', '.join(sorted(base))})")
        if isinstance(base[k], dict):
            _merge(base[k], v, key + ".")
        else:
            if isinstance(base[k], float) and isinstance(v, str):  # YAML 1.1 reads 3e-6 as a string
                try:
                    v = float(v)
                except ValueError:
                    pass
            _check_type(key, v, base[k])
            base[k] = float(v) if isinstance(base[k], float) and isinstance(v, int) else v


def _yaml_where(e):
    """'at line L, column C: problem' of a yaml error (1-based), for one-line config errors."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"at line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else f"({problem})"


def load_config(paths, overrides=(), schema_path=os.path.join(HERE, "config.yaml")):
    """Read config.yaml (the schema and defaults), then each file in `paths`, then `key=value`
    overrides (values typed by YAML). Returns the nested dict. Raises SystemExit (one line) on a
    missing file, bad YAML, unknown key, wrong type or a value outside CHOICES."""
    def read(p):
        try:
            with open(p) as f:
                return yaml.safe_load(f) or {}
        except OSError as e:
            raise SystemExit(f"config file {p}: {e.strerror}")
        except yaml.YAMLError as e:
            raise SystemExit(f"config file {p}: invalid YAML {_yaml_where(e)}")

    cfg = read(schema_path)
    for p in paths:
        if os.path.abspath(p) != os.path.abspath(schema_path):
            _merge(cfg, read(p))
    for o in overrides:
        key, eq, val = o.partition("=")
        if not eq:
            raise SystemExit(f"override {o!r}: expected key.sub=value")
        node = {}
        cur = node
        parts = key.split(".")
        for part in parts[:-1]:
            cur[part] = {}
            cur = cur[part]
        try:
            cur[parts[-1]] = yaml.safe_load(val)
        except yaml.YAMLError as e:
            raise SystemExit(f"override {o!r}: the value is not valid YAML {_yaml_where(e)} "
                             "(quote strings that contain ': ', '?', '#' or ',')")
        _merge(cfg, node)
    validate_config(cfg)
    return cfg


def validate_config(cfg, world_size=1):
    """Choices, list items and batch shapes; one-line SystemExit naming the key."""
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise SystemExit(f"config key {key}: {_get(cfg, key)!r} is not one of {allowed}")
    for key, fields in LIST_ITEM_KEYS.items():
        sec, k = key.split(".")
        items = cfg[sec][k]
        if not items:
            raise SystemExit(f"config key {key}: the list is empty")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise SystemExit(f"config key {key}[{i}]: expected a mapping, got {item!r}")
            for f, v in item.items():
                if f not in fields:
                    raise SystemExit(f"config key {key}[{i}].{f}: unknown (known: {', '.join(fields)})")
                t = fields[f]
                if not (isinstance(v, t) or t is float and isinstance(v, int) and not isinstance(v, bool)):
                    raise SystemExit(f"config key {key}[{i}].{f}: bad value {v!r}")
    # Fill the defaults of list items, so each meta-question carries its own weight and target
    # (a question list and a weight list of different lengths cannot happen by construction).
    for i, mq in enumerate(cfg["reward"]["meta_questions"]):
        if not mq.get("question"):
            raise SystemExit(f"config key reward.meta_questions[{i}].question: missing")
        for field in ("target", "negative"):
            if field in mq and not mq[field].strip():
                raise SystemExit(f"config key reward.meta_questions[{i}].{field}: empty (the evaluator's answer "
                                 f"to score, e.g. \"Yes\")")
        mq.setdefault("weight", 1.0)
        mq.setdefault("target", "Yes")
        mq.setdefault("negative", "No")
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        ev.setdefault("kind", "live")
        ev.setdefault("name", f"{ev['kind']}{i}")
        ev.setdefault("weight", 1.0)
        ev.setdefault("path", None)
        ev.setdefault("chat_template", "auto")
    names = [ev["name"] for ev in cfg["reward"]["evaluators"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"config key reward.evaluators: names must be unique, got {names}")
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        if ev.get("kind", "live") not in ("live", "frozen_self", "frozen"):
            raise SystemExit(f"config key reward.evaluators[{i}].kind: {ev.get('kind')!r} is not one of live, frozen_self, frozen")
        if ev.get("kind") == "frozen" and not ev.get("path"):
            raise SystemExit(f"config key reward.evaluators[{i}].path: a frozen evaluator needs a model path")
    if cfg["task"] == "rlme" and cfg["reward"]["kind"] == "rlme":
        # RLME Eq. 2-3: a weighted sum over evaluators x meta-questions; all-zero weights would
        # give every sample reward 0, every advantage 0 and no gradient, silently.
        for key in ("meta_questions", "evaluators"):
            if all(item["weight"] == 0 for item in cfg["reward"][key]):
                raise SystemExit(f"config key reward.{key}: every weight is 0, so every reward would be 0 (no learning signal)")
    r, a = cfg["rollout"], cfg["algo"]
    for key, v in [("rollout.prompts_per_step", r["prompts_per_step"]), ("rollout.group_size", r["group_size"]),
                   ("rollout.max_new_tokens", r["max_new_tokens"]), ("train.micro_batch_size", cfg["train"]["micro_batch_size"]),
                   ("algo.updates_per_batch", a["updates_per_batch"]), ("algo.minibatches", a["minibatches"]),
                   ("run.total_steps", cfg["run"]["total_steps"])]:
        if v < 1:
            raise SystemExit(f"config key {key}: must be >= 1, got {v}")
    if r["group_size"] < 2:
        # RLME Eq. 5 / GRPO: A = r - mean(group); a group of one has A = 0, so nothing is learned
        raise SystemExit(f"config key rollout.group_size: must be >= 2 (advantages compare the samples of a "
                         f"group; G = 1 gives every advantage 0), got {r['group_size']}")
    if a["loss"] == "cispo" and a["kl_coef"] > 0:
        raise SystemExit(f"config key algo.kl_coef={a['kl_coef']}: the KL term is GRPO's (algo.loss=grpo); "
                         f"CISPO (RLME Eq. 8) has none, so it would be ignored")
    o = cfg["optim"]
    for key, ok, need in [("lr", o["lr"] > 0, "> 0"), ("weight_decay", o["weight_decay"] >= 0, ">= 0"),
                          ("beta1", 0 <= o["beta1"] < 1, "in [0, 1)"), ("beta2", 0 <= o["beta2"] < 1, "in [0, 1)"),
                          ("grad_clip", o["grad_clip"] >= 0, ">= 0 (0 = off)"),
                          ("warmup_steps", o["warmup_steps"] >= 0, ">= 0")]:
        if not ok:
            raise SystemExit(f"config key optim.{key}: must be {need}, got {o[key]}")
    if cfg["data"]["max_prompt_tokens"] < 0 or cfg["nlhf"]["max_prompt_tokens"] < 0:
        raise SystemExit("config key data.max_prompt_tokens / nlhf.max_prompt_tokens: must be >= 0 (0 = model context - max_new_tokens)")
    if cfg["model"]["dtype"] == "float16" and cfg["train"]["parallel"] == "fsdp2":
        raise SystemExit("config key model.dtype=float16 with train.parallel=fsdp2: float16 needs loss scaling, "
                         "which is implemented for ddp only; use model.dtype=bfloat16")
    if r["prompts_per_step"] % world_size:
        raise SystemExit(f"config key rollout.prompts_per_step={r['prompts_per_step']} is not divisible by "
                         f"the world size {world_size} (whole groups per rank)")
    if (r["prompts_per_step"] // world_size) % a["minibatches"]:
        raise SystemExit(f"config key algo.minibatches={a['minibatches']} does not divide the "
                         f"{r['prompts_per_step'] // world_size} groups per rank")
    if cfg["reward"]["evaluator_template"] is not None:
        R.check_evaluator_template(cfg["reward"]["evaluator_template"])
    if not 0.0 <= cfg["reward"]["anchor_fraction"] <= 1.0:
        raise SystemExit("config key reward.anchor_fraction: must be in [0, 1]")
    if r["temperature"] <= 0:
        raise SystemExit("config key rollout.temperature: must be > 0 for RL sampling")
    if not 0 < r["top_p"] <= 1:
        raise SystemExit(f"config key rollout.top_p: must be in (0, 1], got {r['top_p']}")
    if r["top_k"] < 0:
        raise SystemExit(f"config key rollout.top_k: must be >= 0 (0 = off), got {r['top_k']}")
    if "{question}" not in cfg["data"]["prompt_template"]:
        raise SystemExit("config key data.prompt_template: must contain {question}")
    nl = cfg["nlhf"]
    # λ weighs the process reward against the outcome reward (RM-NLHF Eq. 8): a share in [0, 1]
    for key, lo, hi in [("dh_per_step", 0.0, 1.0), ("threshold", 0.0, 1.0), ("lam", 0.0, 1.0)]:
        if not lo <= nl[key] <= hi:
            raise SystemExit(f"config key nlhf.{key}: must be in [{lo}, {hi}], got {nl[key]}")
    if cfg["task"] == "rm_nlhf":
        if cfg["metarm"]["mode"] == "metarm_only" and not nl["do"]:
            raise SystemExit("config key metarm.mode=metarm_only needs D_O data (nlhf.do)")
        if nl["do"] and round(nl["dh_per_step"] * r["prompts_per_step"]) == 0:
            raise SystemExit(f"config key nlhf.dh_per_step={nl['dh_per_step']}: gives no D_H prompt per step "
                             f"(rollout.prompts_per_step={r['prompts_per_step']}); the MetaRM learns from D_H")


def check_scale_config(cfg, device):
    """Combinations that depend on the device (SPEC §7); one-line SystemExit naming the key."""
    t, ro = cfg["train"], cfg["rollout"]
    if t["cpu_offload"] and t["parallel"] != "fsdp2":
        raise SystemExit("config key train.cpu_offload=true needs train.parallel=fsdp2")
    if t["cpu_offload"] and device.type != "cuda":
        raise SystemExit("config key train.cpu_offload=true needs a CUDA device (on CPU the shards already live in CPU memory)")
    if ro["backend"] == "vllm":
        if device.type != "cuda":
            raise SystemExit("config key rollout.backend=vllm needs a CUDA device; use rollout.backend=hf on CPU")
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            raise SystemExit("config key rollout.backend=vllm: the vllm package is not installed "
                             "(pip install -r requirements-gpu.txt)")
    if not 0.0 < ro["vllm_gpu_memory_utilization"] < 1.0:
        raise SystemExit("config key rollout.vllm_gpu_memory_utilization: must be in (0, 1)")


# ----------------------------------------------------------------------------------------------
# Data


def load_dataset_rows(source, config_name=None, split="train"):
    """Rows of a hub dataset id or local .jsonl/.json file, loaded through `datasets`.
    Returns a datasets.Dataset. SystemExit (one line) when the file is missing or malformed, or
    the hub cannot be reached (naming the data.* key to point at a local file)."""
    import datasets
    datasets.disable_progress_bars()
    if source.endswith((".jsonl", ".json")) or os.path.exists(source):
        if not os.path.isfile(source):
            raise SystemExit(f"data file {source} does not exist")
        with open(source) as f:
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
                         f"set data.train to a local .jsonl file, e.g. data.train=../shared/data/gsm8k/train.jsonl")


def load_train_items(cfg):
    """Training items as dicts {index, question, label, anchored} (SPEC §4.2 anchoring chosen
    once by seed at load time)."""
    d = cfg["data"]
    ds = load_dataset_rows(d["train"], d["train_config"], d["train_split"])
    for key in ("question_field", "answer_field"):
        if d[key] not in ds.column_names:
            raise SystemExit(f"config key data.{key}={d[key]!r}: no such field in {d['train']} "
                             f"(fields: {', '.join(ds.column_names)})")
    if d["max_items"]:
        ds = ds.select(range(min(d["max_items"], len(ds))))
    items = []
    for i, row in enumerate(ds):
        answer = str(row[d["answer_field"]])
        try:
            label = R.clean_gsm8k_label(answer) if d["label_format"] == "gsm8k" else R.clean_number(answer)
        except ValueError:
            raise SystemExit(f"{d['train']} item {i}: field {d['answer_field']!r} has no '####' "
                             f"(set data.label_format=plain for bare answers)")
        items.append({"index": i, "question": str(row[d["question_field"]]), "label": label, "anchored": False})
    g = torch.Generator().manual_seed(cfg["run"]["seed"])
    n_anchor = round(cfg["reward"]["anchor_fraction"] * len(items))
    for i in torch.randperm(len(items), generator=g)[:n_anchor].tolist():
        items[i]["anchored"] = True
    return items


def step_items(items, step, prompts_per_step, seed, rank, world):
    """This rank's prompts for `step`: a seeded permutation per epoch, read as one stream, so the
    order depends only on (seed, step) and a resumed run sees the same prompts."""
    out = []
    for j in range(prompts_per_step):
        pos = step * prompts_per_step + j
        epoch, k = divmod(pos, len(items))
        perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(items[perm[k]])
    per_rank = prompts_per_step // world
    return out[rank * per_rank:(rank + 1) * per_rank]


# ----------------------------------------------------------------------------------------------
# Advantage and loss (RLME Eq. 5-8, SPEC §4.4-4.5)


def group_advantages(rewards, group_size, std=False, valid=None):
    """A_i = r_i - mean_group(r) (RLME Eq. 5), or / (population std + 1e-6) when std=True (GRPO).

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
    """Sum over this micro-batch of the per-token policy loss; the caller divides by the global
    normaliser (see `loss_normaliser`) so that the update equals one big batch.

    CISPO (RLME Eq. 6-8, MiniMax-M1): rho_i = exp(sum_t logp - sum_t behaviour) (or the GSPO
    geometric mean), clipped in LOG space to [log(1-eps_low), log(1+eps_high)] before exp so a
    100-token sequence cannot overflow, then DETACHED: every sample, clipped or not, gets
    gradient -sg(rho_hat_i) * A_i * grad sum_t log pi(y_it).
    GRPO (SPEC §4.5): token ratio r_t, PPO clip eps, -min(r_t A, clip(r_t) A) + beta * k3 with
    k3 = exp(ref - logp) - (ref - logp) - 1.

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
    return (per_token * mask).sum(), stats


def loss_normaliser(algo, num_seqs, num_tokens, max_new_tokens):
    """The one global divisor of a (mini-)batch (SPEC §4.4): sequences for seq_sum (Eq. 8),
    tokens for token_mean, sequences x max_new_tokens for Dr.GRPO. Counts are global (all
    micro-batches of all ranks), applied once."""
    return {"seq_sum": num_seqs, "token_mean": num_tokens,
            "dr_grpo": num_seqs * max_new_tokens}[algo["aggregation"]]


def k3_kl(logp, ref_logp):
    """k3 KL estimator per token, exp(ref - logp) - (ref - logp) - 1 (>= 0; SPEC §4.5)."""
    d = ref_logp - logp
    return d.exp() - d - 1


# ----------------------------------------------------------------------------------------------
# Distributed helpers


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


def all_max(x, world):
    """Max of a float over ranks (returns a float)."""
    return all_sum(x, world, op=dist.ReduceOp.MAX)


def sampling_seed(run_seed, step, rank):
    """The rollout sampling seed of (run seed, step, rank) (SPEC §7: distinct seeds per rank).
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
# Parallelism (SPEC §7): DDP for small models, FSDP2 (`fully_shard`) for 4B+. update_policy only
# needs grad_sync() and clip_grad_norm() to be the same code for both.


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

    What it buys (SmolLM2-135M, float32 CPU, micro-batches of 4 x 128 completion tokens; README,
    Performance): the memory held between forward and backward drops from 0.96 to 0.56 GB a
    micro-batch, for +2.0 s on a 21 s update (full checkpointing, which also replays the
    matmuls: 0.26 GB, +2.6 s). On this CPU the step's peak RSS falls only 4.35 -> 4.11 GB (the heap's
    free chunks and the weight-sized gradient temporaries dominate), so configs/cpu.yaml keeps
    "none"; it is for long sequences and big models, where activations dominate.
    """
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def wrap_policy(policy, parallel, world, device, dtype="float32", cpu_offload=False,
                gradient_checkpointing="none"):
    """Wrap the policy for training (SPEC §7).

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


def clip_grad_norm_plain(policy, max_norm):
    """Clip the global gradient norm to `max_norm` (<= 0: measure only); returns the norm before
    clipping as a float. torch's clip_grad_norm_; under FSDP2 the gradients are DTensor shards
    and the norm it returns is reduced over the mesh, i.e. the global one (tests/test_scale.py)."""
    from torch.distributed.tensor import DTensor
    gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm if max_norm > 0 else float("inf"))
    return float(gn.full_tensor() if isinstance(gn, DTensor) else gn)


def clip_grad_norm(policy, max_norm, fast=True):
    """`clip_grad_norm_plain`, with the norm of CPU gradients taken over 64K-element chunks
    (fast=False: the plain twin; tests/test_train.py compares both with float64).

    Why: torch's float32 CPU norm of one long tensor drifts (torch 2.13: ~1e-3 relative at a
    28M-element tied embedding, so the logged norm and the clip coefficient were off); chunked
    partial norms keep it within ~1e-6. GPU and FSDP2 (DTensor) gradients take the plain path.
    """
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    if not fast or not grads or any(isinstance(g, DTensor) or g.device.type != "cpu" for g in grads):
        return clip_grad_norm_plain(policy, max_norm)
    gn = torch.nn.utils.get_total_norm([c for g in grads for c in g.reshape(-1).split(1 << 16)])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(policy.parameters(), max_norm, gn)
    return float(gn)


@contextlib.contextmanager
def unsharded(model):
    """Full parameters on every rank for generation (SPEC §7, HF backend under FSDP2).

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


def full_state_items(policy):
    """(name, full tensor) for every entry of the policy's state dict, one at a time, so that
    pushing weights to vLLM never holds more than one gathered tensor (SPEC §7). Under FSDP2
    each `full_tensor()` is an all-gather: every rank must iterate the same way."""
    from torch.distributed.tensor import DTensor
    for name, t in policy.state_dict().items():
        if isinstance(t, DTensor):
            if t.device.type == "cpu" and torch.cuda.is_available():  # CPU offload: gather over nccl
                t = t.to("cuda")
            t = t.full_tensor()
        yield name, t


def logp_gap(trainer_rows, rollout_lp, mask):
    """|trainer - rollout engine| per-token log-prob over masked tokens (SPEC §7).

    Args:
        trainer_rows: list (N) of FloatTensor [>= L_i], the trainer's behaviour log-probs.
        rollout_lp: FloatTensor [N, L], the engine's (vLLM) log-probs of the same tokens.
        mask: FloatTensor [N, L], a prefix mask per row (SPEC §4.1).
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
# Checkpoints: plain save_pretrained folders, written atomically (tmp folder, then rename).


def latest_checkpoint(out_dir):
    """Path of the newest complete checkpoint folder in out_dir/checkpoints, or None."""
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"step_(\d+)", d))
             and os.path.isfile(os.path.join(root, d, "trainer_state.pt"))]
    return os.path.join(root, f"step_{max(steps):06d}") if steps else None


def save_checkpoint(out_dir, step, model, tokenizer, optimizer, scheduler, keep, rank=0, extra=None, scaler=None):
    """Write out_dir/checkpoints/step_NNNNNN atomically: a crash mid-write leaves a .tmp folder
    that resume ignores, never a half checkpoint. `extra(folder)`, if given, writes more state
    into the folder before it is renamed (RM-NLHF: the MetaRM, in metarm/; rank 0 only).

    Every rank calls this (under FSDP2 gathering the state is a collective); rank 0 writes.
    The checkpoint is layout-agnostic (SPEC §7): the full model state dict as a plain
    save_pretrained folder (FSDP2: float32 master weights), and the optimizer state as a full,
    parameter-name-keyed dict (torch.distributed.checkpoint.state_dict), so a run with any
    world size and either of ddp/fsdp2 resumes from it (load_trainer_state).

    Args:
        model: the unwrapped policy (plain, or FSDP2-sharded; never the DDP wrapper).
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
    model.save_pretrained(tmp, state_dict=model_sd)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None},
               os.path.join(tmp, "trainer_state.pt"))
    if extra is not None:
        extra(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    done = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d))
    for d in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


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
# Evaluators (SPEC §4.2)


def load_evaluators(cfg, policy, tokenizer, device):
    """The J evaluators as dicts {name, model, tokenizer, chat, weight}. `live` shares the
    policy's weights (scored without grad); `frozen_self` is a frozen copy of the initial policy;
    `frozen` loads another model."""
    evaluators = []
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        kind = ev.get("kind", "live")
        if kind == "live":
            model, tok = policy, tokenizer
        else:
            path = cfg["model"]["policy"] if kind == "frozen_self" else ev["path"]
            try:
                model, tok = rollout.load_model(path, cfg["model"]["dtype"], device)
            except SystemExit as e:  # name the config key, not just the path
                raise SystemExit(f"config key reward.evaluators[{i}].path: {e}")
            model.eval().requires_grad_(False)
        evaluators.append({"name": ev.get("name", f"{kind}{i}"), "model": model, "tokenizer": tok,
                           "chat": rollout.use_chat_template(tok, ev.get("chat_template", "auto")),
                           "weight": float(ev.get("weight", 1.0))})
    return evaluators


# ----------------------------------------------------------------------------------------------
# RM-NLHF (SPEC §5): the data and reward parts of a step when task == rm_nlhf. The loop, the
# advantages and update_policy are the same as for RLME; only these functions differ.


def load_dh_items(cfg):
    """D_H (SPEC §5.1): pairwise items WITH a human critique, from nlhf.dh; items without one are
    dropped. Returns list of reward.load_pairwise dicts. SystemExit (one line) on bad data or
    when no item has a critique."""
    nl = cfg["nlhf"]
    items = [it for it in R.load_pairwise(nl["dh"], nl["dh_schema"], seed=cfg["run"]["seed"], split=nl["dh_split"],
                                          config_name=nl["dh_config"]) if it["critique"]]
    if not items:
        raise SystemExit(f"config key nlhf.dh={nl['dh']}: no item has a human critique (D_H needs them)")
    return items[:nl["max_items"]] if nl["max_items"] else items


def load_do_items(cfg):
    """D_O (SPEC §5.1): pairwise items from nlhf.do with any critique removed (their process
    reward comes from the MetaRM). [] when nlhf.do is null."""
    nl = cfg["nlhf"]
    if not nl["do"]:
        return []
    items = [dict(it, critique=None) for it in R.load_pairwise(nl["do"], nl["do_schema"], seed=cfg["run"]["seed"],
                                                               split=nl["do_split"], config_name=nl["do_config"])]
    return items[:nl["max_items"]] if nl["max_items"] else items


def prompt_token_limit(setting, model, max_new_tokens, key):
    """The prompt-length limit in tokens: `setting`, or when it is 0 the model's context
    (config.max_position_embeddings) minus max_new_tokens. SystemExit (one line) when no prompt
    could fit."""
    context = getattr(model.config, "max_position_embeddings", None) or 10 ** 9
    limit = setting or context - max_new_tokens
    if limit < 1:
        raise SystemExit(f"config key {key}: no prompt fits (model context {context} tokens, "
                         f"rollout.max_new_tokens={max_new_tokens})")
    return limit


def keep_short(items, prompt_ids, limit, key, overhead):
    """Items whose prompt has at most `limit` tokens, and how many were dropped.

    A prompt longer than the model's context does not fail: it makes the rollout crawl (a
    64k-token GSM8K-style question sat at 0 % of step 1 for minutes), so it is dropped at load
    and counted. Only prompts whose UTF-8 length exceeds `limit` minus the template's own tokens
    are tokenised: a token covers at least one byte, so a shorter text cannot exceed the limit
    (GSM8K's 7.5k questions then need no tokenising at all).

    Args:
        items: list of item dicts. prompt_ids(item, text_only) -> list[int] of its prompt ids;
            with text_only=True it returns the prompt's text instead (for the byte bound).
        limit: int tokens. key: the config key named in the error.
        overhead: tokens the template adds around an empty text (chat header, BOS).
    Returns:
        (kept items, number dropped). Raises SystemExit (one line) when none is left.
    """
    kept, shortest = [], None
    for it in items:
        if len(prompt_ids(it, text_only=True).encode("utf-8")) + overhead + 16 <= limit:
            kept.append(it)
            continue
        n = len(prompt_ids(it, text_only=False))
        if n <= limit:
            kept.append(it)
        else:
            shortest = n if shortest is None else min(shortest, n)
    if items and not kept:
        raise SystemExit(f"config key {key}: every prompt is over {limit} tokens (the shortest has {shortest})")
    return kept, len(items) - len(kept)


def nlhf_step_items(dh, do, step, cfg, rank, world):
    """This rank's pairwise items for `step`: round(nlhf.dh_per_step x P) prompts from D_H and the
    rest from D_O, each set read as its own seeded stream (step_items, so a resumed run sees the
    same prompts), then the P prompts shuffled by (seed, step) so every rank gets a mix of both.
    Returns list of item dicts tagged "set": "dh" | "do"."""
    P, seed = cfg["rollout"]["prompts_per_step"], cfg["run"]["seed"]
    n_dh = round(cfg["nlhf"]["dh_per_step"] * P) if do else P
    both = ([dict(it, set="dh") for it in step_items(dh, step, n_dh, seed, 0, 1)]
            + [dict(it, set="do") for it in step_items(do, step, P - n_dh, seed + 1, 0, 1)])
    order = torch.randperm(P, generator=torch.Generator().manual_seed(seed * 100_019 + step)).tolist()
    per_rank = P // world
    return [both[k] for k in order[rank * per_rank:(rank + 1) * per_rank]]


def grm_prompt_ids(tokenizer, item, chat, nl, text_only=False):
    """Token ids of the GRM prompt for one pairwise item (reward.build_grm_prompt; chat template when `chat`);
    its text (the user message) with text_only=True."""
    text = R.build_grm_prompt(item["context"], item["response_a"], item["response_b"], nl["max_critique_lines"])
    return text if text_only else rollout.build_prompt_ids(tokenizer, text, chat)


def policy_prompt_ids(tokenizer, item, chat, template, text_only=False):
    """Token ids of the policy prompt for one training item (data.prompt_template, chat template
    when `chat`); its text with text_only=True."""
    text = template.format(question=item["question"])
    return text if text_only else rollout.build_prompt_ids(tokenizer, text, chat)


def setup_metarm(cfg, ckpt, policy, tokenizer, dh, judge, device, rank, world):
    """The MetaRM of an rm_nlhf run (SPEC §5.4), or None for metarm.mode none. Taken from, in order:
    (1) the copy saved inside the GRM checkpoint being resumed; (2) a saved MetaRM at metarm.path
    (default <out_dir>/metarm, e.g. written by `python metarm.py cold-start`); (3) a cold start
    from the base GRM (= the policy at step 0) on metarm.cold_start_items D_H items, saved to
    metarm.path; (4) a fresh regression head on metarm.model (metarm.cold_start: false).
    Rank 0 does (3) and saves; the other ranks then load the same folder, so all ranks start equal.
    Returns (mrm dict or None, source str, cold-start stats dict or None).
    Raises SystemExit when a resumed checkpoint has no MetaRM (the GRM and its MetaRM move together)."""
    m, nl = cfg["metarm"], cfg["nlhf"]
    if m["mode"] == "none":
        return None, "none", None
    path = m["path"] or os.path.join(cfg["run"]["out_dir"], "metarm")
    if ckpt:
        if not os.path.isfile(os.path.join(ckpt, "metarm", "metarm.json")):
            raise SystemExit(f"checkpoint {ckpt} has no MetaRM (metarm/); resume needs the one saved with the GRM")
        return metarm.load(os.path.join(ckpt, "metarm"), device, m["dtype"]), os.path.join(ckpt, "metarm"), None
    if os.path.isfile(os.path.join(path, "metarm.json")):
        return metarm.load(path, device, m["dtype"]), path, None
    base = m["model"] or cfg["model"]["policy"]
    stats = None
    if rank == 0:
        mrm = metarm.load_metarm(base, m["mode"], nl["lam"], m["dtype"], device, m["batch_size"], m["max_length"],
                                 m["online_lr"], m["weight_decay"])
        if m["cold_start"]:
            items = dh[:m["cold_start_items"]] if m["cold_start_items"] else dh
            # rank 0 alone samples: from the policy itself, unless FSDP2 sharded it (then from
            # a plain copy of the same base weights, freed after the cold start)
            grm = (policy, tokenizer) if cfg["train"]["parallel"] == "ddp" else \
                rollout.load_model(cfg["model"]["policy"], cfg["model"]["dtype"], device)
            stats = metarm.cold_start(mrm, cfg["model"]["policy"], items, judge,
                                      rollouts_per_prompt=m["rollouts_per_prompt"], max_new_tokens=m["max_new_tokens"],
                                      temperature=m["temperature"], epochs=m["epochs"], lr=m["lr"],
                                      warmup_frac=m["warmup_frac"], weight_decay=m["weight_decay"], nlhf=nl,
                                      chat_template=cfg["model"]["chat_template"], seed=cfg["run"]["seed"],
                                      micro_batch_size=cfg["rollout"]["micro_batch_size"] or None,
                                      log=lambda s: print(f"[train] {s}", flush=True), grm=grm,
                                      compute_dtype=cfg["model"]["dtype"], fast=cfg["train"]["fast_paths"])
            del grm
            metarm.save(mrm, path)
    if world > 1:
        dist.barrier()
        if not m["cold_start"]:  # a fresh head is random: take rank 0's
            mrm = mrm if rank == 0 else metarm.load_metarm(base, m["mode"], nl["lam"], m["dtype"], device, m["batch_size"],
                                                           m["max_length"], m["online_lr"], m["weight_decay"])
            broadcast_parameters(mrm["model"])
        elif rank != 0:
            mrm = metarm.load(path, device, m["dtype"])
    return mrm, "cold_start" if m["cold_start"] else "fresh", stats


def broadcast_parameters(model, src=0):
    """Copy rank `src`'s parameters and buffers into every rank's model (in place)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src)


def metarm_online_update(mrm, items, samples, world, seed):
    """SPEC §5.4 step 3: update the MetaRM on this step's D_H samples of ALL ranks.

    Under torchrun the (item, sample) pairs are all-gathered, rank 0 alone runs metarm.update (it
    holds the online optimizer state, which is saved with its checkpoints) and then broadcasts the
    new parameters, so every rank predicts D_O with the same, updated MetaRM. Returns the update's
    metrics (rank 0's) plus metarm/updates, the count after this step's update, on every rank."""
    if world > 1:
        pairs = gather_records(list(zip(items, samples)), world)
        items, samples = [p[0] for p in pairs], [p[1] for p in pairs]
    out = metarm.update(mrm, items, samples, seed=seed) if (world == 1 or dist.get_rank() == 0) else None
    if world > 1:
        box = [out, mrm["updates"]]
        dist.broadcast_object_list(box, src=0)
        out, mrm["updates"] = box
        broadcast_parameters(mrm["model"])
    return dict(out, **{"metarm/updates": mrm["updates"]})


def nlhf_rewards(items, completions, judge, mrm, cfg, world, step, t0):
    """Rewards of one step's GRM completions, SPEC §5.4 steps 2-5, in this order:
      (2) D_H: parse, judge (only valid+right verdicts), r = -1 | 0 | 1 + λ·1[F1 >= τ]  (RM-NLHF Eq. 4, 5, 8)
      (3) MetaRM update on those D_H samples (all ranks' samples, metarm_online_update)
      (4) MetaRM prediction R̂ for the D_O samples with the UPDATED MetaRM
      (5) D_O: r = -1 | 0 | 1 + clip(max(0, R̂ - 1), 0, λ)  (reward.do_reward; other ablation modes there)

    Args:
        items: list (N) of pairwise dicts tagged "set" ('dh'|'do'), one per completion (group-repeated).
        completions: list[str] (N). judge: reward.make_judge dict. mrm: MetaRM dict or None (mode none).
        t0: time.perf_counter() at the start of the step; the "order/*" metrics are seconds since it.
    Returns:
        dict: reward FloatTensor [N] (0.0 where the judge failed), valid BoolTensor [N] (False =
        judge failure: left out of group statistics and of the loss), samples list (N) of per-sample
        dicts for samples.jsonl, metrics dict (MetaRM loss/agreement, order of operations, times).
    """
    nl, mode = cfg["nlhf"], cfg["metarm"]["mode"]
    parsed = [R.parse_grm_output(c, nl["max_critique_lines"], nl["max_critique_chars"]) for c in completions]
    dh_idx = [i for i, it in enumerate(items) if it["set"] == "dh"]
    do_idx = [i for i, it in enumerate(items) if it["set"] == "do"]
    samples = [None] * len(items)
    metrics = {}
    # (2) D_H rewards from the judge
    dh = R.score_dh([parsed[i] for i in dh_idx], [items[i] for i in dh_idx], judge, nl["lam"], nl["threshold"],
                    nl["gate_on_outcome"])
    for i, s in zip(dh_idx, dh):
        s["f1_why"] = s["judge_why"] if s["judged"] else ("invalid format" if not s["valid"] else "wrong verdict: judge not called")
        samples[i] = dict(s, set="dh", r_hat=None)
    metrics["order/judge_done_s"] = time.perf_counter() - t0
    # (3) MetaRM update on the D_H samples, BEFORE it scores D_O
    updates_before = mrm["updates"] if mrm is not None else 0
    if mrm is not None:
        metrics.update(metarm_online_update(mrm, [items[i] for i in dh_idx], dh, world, seed=cfg["run"]["seed"] * 7_919 + step))
    metrics["order/metarm_update_done_s"] = time.perf_counter() - t0
    # (4) MetaRM prediction for D_O with the updated model (None for invalid verdicts: reward -1 anyway)
    metrics["order/metarm_predict_start_s"] = time.perf_counter() - t0
    critiques = [parsed[i]["critique"] if parsed[i]["valid"] else None for i in do_idx]
    r_hat = metarm.predict(mrm, [items[i] for i in do_idx], critiques) if mrm is not None else [None] * len(do_idx)
    metrics["metarm/updated_before_predict"] = mrm is None or metrics["order/metarm_update_done_s"] <= metrics["order/metarm_predict_start_s"]
    metrics["metarm/trained_this_step"] = mrm is not None and mrm["updates"] > updates_before
    # (5) D_O rewards
    do = R.score_do([parsed[i] for i in do_idx], [items[i] for i in do_idx], r_hat, nl["lam"], mode)
    for i, s in zip(do_idx, do):
        samples[i] = dict(s, set="do", human_critique=None, f1=None, precision=None, recall=None, judged=False,
                          judge_attempts=0, judge_why=None, r_process=None, f1_why="D_O: no human critique (MetaRM R̂ instead)",
                          metarm_updates=mrm["updates"] if mrm is not None else None)
    metrics["order/do_reward_done_s"] = time.perf_counter() - t0
    reward_t = torch.tensor([s["reward"] if s["reward"] is not None else 0.0 for s in samples])
    valid = torch.tensor([s["reward"] is not None for s in samples])
    return {"reward": reward_t, "valid": valid, "samples": samples, "metrics": metrics}


def nlhf_record(step, rank, group, item, s, ro_out, i, advantage, is_weight, clipped):
    """One samples.jsonl line of task rm_nlhf (the audit trail, SPEC §2): the pair's id and
    winner, the completion, its parsed verdict and critique, the judge's F1 (or None and why),
    the MetaRM prediction R̂ (D_O), the final reward (None = judge failure, masked) and advantage."""
    keep = ("choice", "valid", "why", "correct", "critique", "human_critique", "judged", "f1", "precision", "recall",
            "judge_why", "judge_attempts", "f1_why", "r_process", "r_hat", "reward")
    rec = {"step": step, "rank": rank, "item": item["id"], "group": group, "set": item["set"],
           "source": item["source"], "winner": item["winner"], "completion": ro_out["completions"][i],
           "truncated": bool(ro_out["truncated"][i]), "length": int(ro_out["completion_mask"][i].sum())}
    rec.update({k: s.get(k) for k in keep})
    rec.update(metarm_updates=s.get("metarm_updates"), advantage=advantage, importance_weight=is_weight, clipped=clipped)
    return rec


def nlhf_step_metrics(records, step_metrics):
    """SPEC §9 RM-NLHF metrics of one step from all ranks' sample records (rank 0): format-error
    rate, outcome accuracy (all and per set), process-reward rate, judge fail rate, mean R̂, plus
    the MetaRM loss/agreement and order-of-operations entries of `step_metrics`."""
    out = R.nlhf_metrics(records)
    for name in ("dh", "do"):
        part = [r for r in records if r["set"] == name]
        if part:
            out[f"nlhf/{name}/outcome_acc"] = sum(r["correct"] for r in part) / len(part)
            out[f"nlhf/{name}/reward_mean"] = (sum(r["reward"] for r in part if r["reward"] is not None)
                                               / max(1, sum(r["reward"] is not None for r in part)))
    hats = [r["r_hat"] for r in records if r["r_hat"] is not None]
    out["metarm/r_hat_mean"] = sum(hats) / len(hats) if hats else None
    out["judge/failed"] = sum(r["judged"] and r["f1"] is None for r in records)
    out.update(step_metrics)
    return out


# ----------------------------------------------------------------------------------------------
# The loop


def micro_batches(rows, size):
    """Consecutive chunks of `size` row indices (the last one shorter)."""
    rows = list(rows)
    return [rows[s:s + size] for s in range(0, len(rows), size)]


def rows_logprobs(model, batch, rows, pad_id, cfg, prompt_model=None):
    """Per-token log-probs of the completions of `rows` under `model` (logits / temperature),
    over the first `width` columns: the longest masked completion among `rows` (columns that
    are padding in every row are trimmed).

    Returns:
        (FloatTensor [len(rows), width], width). With grad when called under grad mode.
    """
    width = max(1, int(batch["completion_mask"][rows].sum(-1).max()))
    lp = rollout.completion_logprobs(model, [batch["prompt_ids"][i] for i in rows], batch["completion_ids"][rows, :width],
                                     pad_id, cfg["rollout"]["temperature"], fast=cfg["train"]["fast_paths"],
                                     prompt_model=prompt_model)
    return lp, width


@torch.no_grad()
def frozen_logprobs(model, batch, pad_id, cfg, device):
    """The no-grad pass of the update: per-token log-probs of every completion under `model`,
    prompt AND completion through `model` itself: the behaviour policy pi_b (model = the policy,
    before any optimizer step; RLME Eq. 6's denominator) or the GRPO reference pi_ref (model =
    the frozen initial policy; the k3 KL). A pass never borrows another model's prompt cache.

    Returns:
        list (N) of FloatTensor [L_i] on CPU (L_i = the width of row i's micro-batch).
    """
    out = [None] * len(batch["prompt_ids"])
    for rows in micro_batches(range(len(out)), cfg["train"]["micro_batch_size"]):
        with compute_context(cfg["model"]["dtype"], cfg["train"]["parallel"], device):
            lp, _ = rows_logprobs(model, batch, rows, pad_id, cfg)
        for i, row in zip(rows, lp.float().cpu()):
            out[i] = row
    return out


def update_policy(model, policy, optimizer, batch, cfg, world, device, pad_id, ref_model=None, scaler=None):
    """One rollout batch's worth of optimizer steps (SPEC §4.4): `algo.updates_per_batch` passes,
    each split into `algo.minibatches` optimizer steps over whole groups, each accumulated over
    micro-batches of `train.micro_batch_size` sequences.

    First the no-grad passes (`frozen_logprobs`): behaviour log-probs when the update is
    off-policy (or to log the vLLM gap), reference log-probs for GRPO's KL. Then the optimizer
    steps. The loss of an optimizer step is sum(per-token loss) / normaliser with ONE normaliser
    counted over all its micro-batches on all ranks, so 1 rank x 4 micro-batches, 2 ranks x 2 and
    1 rank x 1 give the same update (tests/test_train.py).

    Args:
        model: the policy, DDP-wrapped when world > 1 (used for the forward with grad).
        policy: the unwrapped policy (float32 master weights; no-grad passes, grad clipping).
        batch: dict with "prompt_ids" list[list[int]] (N), "completion_ids" LongTensor [N, L],
            "completion_mask" FloatTensor [N, L], "advantages" FloatTensor [N], and optionally
            "valid" BoolTensor [N] (False rows are left out of the loss and the normaliser).
        cfg: full config (reads algo, train, optim, model.dtype, rollout.temperature/max_new_tokens/group_size).
        ref_model: the frozen reference policy (GRPO with algo.kl_coef > 0), else None.
        scaler: torch.amp.GradScaler for model.dtype float16 (loss scaling), else None.
    Returns:
        dict: "loss" (float, this rank's share, summed over optimizer steps), "grad_norms"
        (list[float], global, before clipping), "is_weight" / "clipped" (FloatTensor [N], last
        pass), "logp_gap": (sum |trainer - rollout| log-prob, token count, max) over this rank's
        masked tokens when batch has "rollout_logprobs" [N, L] (vLLM), else None.
    """
    algo, o, ro = cfg["algo"], cfg["optim"], cfg["rollout"]
    G, per_mb = ro["group_size"], cfg["train"]["micro_batch_size"]
    mask = batch["completion_mask"].float()
    if "valid" in batch:
        mask = mask * batch["valid"].float()[:, None]
    advantages = batch["advantages"]
    n_local = len(batch["prompt_ids"])
    model.train()

    # No-grad passes. With one optimizer step per batch pi_theta == pi_b at the update, so the
    # ratio is exactly 1 and the behaviour pass is skipped; otherwise it runs before the first
    # step (RLME Eq. 6's pi_b). With vLLM rollouts the trainer recomputes it anyway, to log the gap
    # (README, Scale out).
    off_policy = algo["updates_per_batch"] > 1 or algo["minibatches"] > 1
    rollout_lp = batch.get("rollout_logprobs")
    behaviour = frozen_logprobs(policy, batch, pad_id, cfg, device) if off_policy or rollout_lp is not None else None
    ref = frozen_logprobs(ref_model, batch, pad_id, cfg, device) if ref_model is not None else None

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
                        lp, width = rows_logprobs(model, batch, rows, pad_id, cfg, prompt_model=policy)
                    beh = torch.stack([behaviour[i][:width] for i in rows]).to(device) if off_policy else None
                    rl = torch.stack([ref[i][:width] for i in rows]).to(device) if ref is not None else None
                    loss_sum, st = policy_loss(lp.float(), beh, advantages[rows].to(device),
                                               mask[rows, :width].to(device), algo, rl)
                    # DDP and FSDP2 average gradients over ranks; x world turns that into a global sum / norm.
                    loss = loss_sum * world / norm
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                loss_total += float(loss_sum.detach()) / norm
                is_weights[rows] = st["is_weight"].float().cpu()
                clipped[rows] = st["clipped"].float().cpu()
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip and log the true gradient norm
            grad_norms.append(clip_grad_norm(policy, o["grad_clip"], fast=cfg["train"]["fast_paths"]))
            if scaler is not None:
                scaler.step(optimizer)  # skipped when a gradient is inf/NaN (float16 overflow)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    gap = logp_gap(behaviour, rollout_lp, mask) if rollout_lp is not None else None
    return {"loss": loss_total, "grad_norms": grad_norms, "is_weight": is_weights, "clipped": clipped,
            "logp_gap": gap}


def make_rollout_engine(cfg, model_path, policy, rank):
    """None for the HF backend; for vLLM (SPEC §7) this rank's in-process engine as a dict
    {"llm", "asleep", "sleep_level", "tied"}, started from the same weights as the policy
    (`model_path`: the checkpoint being resumed, or model.policy)."""
    ro = cfg["rollout"]
    if ro["backend"] != "vllm":
        return None
    llm = rollout.make_vllm_engine(rollout.resolve_model_path(model_path), cfg["model"]["dtype"],
                                   ro["vllm_gpu_memory_utilization"], ro["vllm_max_model_len"],
                                   ro["vllm_enforce_eager"], seed=cfg["run"]["seed"] * 1_000_003 + rank)
    return {"llm": llm, "asleep": False, "sleep_level": ro["vllm_sleep_level"],
            "tied": bool(getattr(policy.config, "tie_word_embeddings", False))}


def rollout_batch(engine, model, policy, tokenizer, prompt_ids, cfg, seed):
    """G completions per prompt with this run's backend (SPEC §4.1, §7); the rollout dict.

    HF: `generate` on the policy; under FSDP2 inside `unsharded` (gathered once, no per-step
    collectives). vLLM: the engine samples, then sleeps so that reward scoring and the update
    get its GPU memory; push_weights wakes it with the new weights."""
    ro = cfg["rollout"]
    eos = rollout.eos_ids(policy, tokenizer)
    if engine is None:
        with unsharded(model), compute_context(cfg["model"]["dtype"], cfg["train"]["parallel"], policy.device):
            return rollout.generate(policy, tokenizer, prompt_ids, group_size=ro["group_size"],
                                    max_new_tokens=ro["max_new_tokens"], temperature=ro["temperature"],
                                    top_p=ro["top_p"], top_k=ro["top_k"], seed=seed,
                                    micro_batch_size=ro["micro_batch_size"] or None, fast=cfg["train"]["fast_paths"])
    out = rollout.generate_vllm(engine["llm"], tokenizer, prompt_ids, ro["group_size"], ro["max_new_tokens"],
                                ro["temperature"], ro["top_p"], ro["top_k"], seed=seed, eos=eos)
    rollout.vllm_sleep(engine)
    return out


def push_weights(engine, policy):
    """After the update: the new weights into the vLLM engine (gathered from FSDP2 shards one
    tensor at a time), then its prefix cache reset (SPEC §7). No-op for the HF backend, which
    samples from the policy itself."""
    if engine is not None:
        rollout.vllm_push_weights(engine, full_state_items(policy))


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
    output folder can be written. One-line SystemExit naming the key."""
    if cfg["train"]["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("config key train.device=cuda: no CUDA device on this machine (use train.device=cpu or auto)")
    out_dir = cfg["run"]["out_dir"]
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"config key run.out_dir={out_dir}: cannot write there ({e.strerror})")


def checkpoint_step(ckpt):
    """The step of a checkpoint folder out_dir/checkpoints/step_NNNNNN."""
    return int(os.path.basename(ckpt).split("_")[1])


def train(cfg):
    tc = cfg["train"]
    check_startup(cfg)
    rank, world, device = setup_distributed(tc["device"], always_group=tc["parallel"] == "fsdp2",
                                            cpu_collectives=tc["cpu_offload"])
    validate_config(cfg, world)
    check_scale_config(cfg, device)
    run, ro, rw, algo = cfg["run"], cfg["rollout"], cfg["reward"], cfg["algo"]
    out_dir = run["out_dir"]
    is_main = rank == 0
    ckpt = latest_checkpoint(out_dir) if run["resume"] else None
    if ckpt and checkpoint_step(ckpt) >= run["total_steps"]:
        if is_main:
            print(f"[train] {out_dir} is complete: its checkpoint is at step {checkpoint_step(ckpt)} and "
                  f"run.total_steps={run['total_steps']}; to train further raise run.total_steps "
                  f"(or set run.out_dir / run.resume=false for a new run)", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return

    # --- data, models, optimizer -------------------------------------------------------------
    task = cfg["task"]
    if task == "rm_nlhf":
        # start-up checks first (judge model name, API key variable), then D_H / D_O
        judge = R.make_judge(cfg["judge"])
        dh_items, do_items = load_dh_items(cfg), load_do_items(cfg)
    else:
        items = load_train_items(cfg)
    # The trained policy is float32 (master weights) whatever model.dtype says; its forwards
    # compute in model.dtype (compute_context, or FSDP2's MixedPrecisionPolicy on GPU).
    policy, tokenizer = rollout.load_model(ckpt or cfg["model"]["policy"], "float32", device)
    chat = rollout.use_chat_template(tokenizer, cfg["model"]["chat_template"])
    overhead = len(rollout.build_prompt_ids(tokenizer, "", chat))
    if task == "rm_nlhf":
        nl = cfg["nlhf"]
        limit = prompt_token_limit(nl["max_prompt_tokens"], policy, ro["max_new_tokens"], "nlhf.max_prompt_tokens")
        ids = functools.partial(grm_prompt_ids, tokenizer, chat=chat, nl=nl)
        dh_items, dropped = keep_short(dh_items, ids, limit, "nlhf.max_prompt_tokens", overhead)
        do_items, dropped_do = keep_short(do_items, ids, limit, "nlhf.max_prompt_tokens", overhead)
        dropped += dropped_do
    else:
        limit = prompt_token_limit(cfg["data"]["max_prompt_tokens"], policy, ro["max_new_tokens"], "data.max_prompt_tokens")
        ids = functools.partial(policy_prompt_ids, tokenizer, chat=chat, template=cfg["data"]["prompt_template"])
        items, dropped = keep_short(items, ids, limit, "data.max_prompt_tokens", overhead)
    if dropped and is_main:
        print(f"[train] dropped {dropped} items whose prompt is over {limit} tokens "
              f"({'nlhf' if task == 'rm_nlhf' else 'data'}.max_prompt_tokens)", flush=True)
    model = wrap_policy(policy, tc["parallel"], world, device, cfg["model"]["dtype"], tc["cpu_offload"],
                        cfg["model"]["gradient_checkpointing"])
    engine = make_rollout_engine(cfg, ckpt or cfg["model"]["policy"], policy, rank)
    evaluators = load_evaluators(cfg, policy, tokenizer, device) if task == "rlme" and rw["kind"] == "rlme" else []
    ref_model = None
    if algo["loss"] == "grpo" and algo["kl_coef"] > 0:  # frozen: may stay in model.dtype
        ref_model, _ = rollout.load_model(cfg["model"]["policy"], cfg["model"]["dtype"], device)
        ref_model.eval().requires_grad_(False)
    o = cfg["optim"]
    # fused=True: one kernel over all parameters. The default (foreach) makes full-size temporaries
    # and took ~8x longer on the 2-core CPU for SmolLM2's 135M parameters; same update (2e-7).
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o["lr"], betas=(o["beta1"], o["beta2"]),
                                  weight_decay=o["weight_decay"], fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # float16 has 5 exponent bits: small gradients underflow to 0 without loss scaling (bf16 has
    # float32's range and needs none)
    scaler = torch.amp.GradScaler(device.type) if cfg["model"]["dtype"] == "float16" else None
    start_step = 0
    if ckpt:
        start_step = load_trainer_state(ckpt, policy, optimizer, scheduler, scaler)
    mrm = None
    if task == "rm_nlhf":  # the MetaRM (SPEC §5.4): restored with the checkpoint, loaded, or cold-started
        mrm, mrm_source, _ = setup_metarm(cfg, ckpt, policy, tokenizer, dh_items, judge, device, rank, world)
    if is_main:  # out_dir exists: check_startup made it
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        for name in ("metrics.jsonl", "samples.jsonl"):
            if start_step:
                truncate_jsonl(os.path.join(out_dir, name), start_step)
            elif os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        what = (f"rm_nlhf | D_H {len(dh_items)} items, D_O {len(do_items)} | MetaRM {mrm_source}" if task == "rm_nlhf"
                else f"{rw['kind']} | {len(items)} items")
        print(f"[train] {what} | policy {cfg['model']['policy']} | world {world} | "
              f"{'resuming from ' + ckpt if ckpt else 'fresh start'}", flush=True)
    template = rw["evaluator_template"] or R.DEFAULT_EVALUATOR_TEMPLATE
    G = ro["group_size"]
    pbar = None
    if is_main:
        from tqdm import tqdm
        pbar = tqdm(total=run["total_steps"], initial=start_step, desc="train", dynamic_ncols=True)

    for step in range(start_step, run["total_steps"]):
        t0 = time.perf_counter()
        # --- 1. rollout: G completions for each of this rank's prompts (SPEC §4.1) -----------
        if task == "rm_nlhf":  # GRM prompts for a mix of D_H and D_O pairs (SPEC §5.2)
            batch = nlhf_step_items(dh_items, do_items, step, cfg, rank, world)
            prompt_ids = [grm_prompt_ids(tokenizer, it, chat, cfg["nlhf"]) for it in batch]
        else:
            batch = step_items(items, step, ro["prompts_per_step"], run["seed"], rank, world)
            prompt_ids = [policy_prompt_ids(tokenizer, it, chat, cfg["data"]["prompt_template"]) for it in batch]
        ro_out = rollout_batch(engine, model, policy, tokenizer, prompt_ids, cfg,
                               sampling_seed(run["seed"], step, rank))
        mask = ro_out["completion_mask"]
        samples = [it for it in batch for _ in range(G)]
        t1 = time.perf_counter()

        # --- 2. rewards (RLME Eq. 2-3, RLVR, or RM-NLHF SPEC §5.4 steps 2-5) --------------------
        rlvr = torch.tensor([R.rlvr_reward(c, it["label"]) for c, it in zip(ro_out["completions"], samples)]) if task == "rlme" else None
        logp_q = None
        nonfinite = 0
        valid = None  # False = reward unknown (judge failure): out of group statistics and loss
        if task == "rm_nlhf":
            nlhf = nlhf_rewards(samples, ro_out["completions"], judge, mrm, cfg, world, step, t0)
            rewards, valid = nlhf["reward"], nlhf["valid"]
        elif rw["kind"] == "rlme":
            with compute_context(cfg["model"]["dtype"], tc["parallel"], device):  # the live evaluator is the policy
                out = R.rlme_reward(evaluators, rw["meta_questions"], problems=[it["question"] for it in samples],
                                    solutions=ro_out["completions"], references=[it["label"] for it in samples],
                                    anchored=[it["anchored"] for it in samples], template=template,
                                    answer_stub=rw["answer_stub"], renormalize=rw["renormalize"],
                                    micro_batch_size=rw["micro_batch_size"], nonfinite_logp=rw["nonfinite_logp"],
                                    fast=tc["fast_paths"])
            rewards, logp_q, nonfinite = out["reward"], out["logp"], out["nonfinite"]
        else:
            rewards = rlvr.clone()
        t2 = time.perf_counter()

        # --- 3. advantages: r - mean of the group (RLME Eq. 5), / std for GRPO (SPEC §4.5);
        #        groups never straddle ranks; invalid (judge-failed) samples get 0 -------------
        advantages = group_advantages(rewards, G, std=algo["advantage_std"], valid=valid)

        # --- 4./5. CISPO (RLME Eq. 6-8) or GRPO (SPEC §4.5, k3 KL to ref_model) update --------
        batch = {"prompt_ids": ro_out["prompt_ids"], "completion_ids": ro_out["completion_ids"],
                 "completion_mask": mask, "advantages": advantages}
        if valid is not None:
            batch["valid"] = valid
        if "logprobs" in ro_out:  # vLLM: the trainer recomputes them and the gap is logged
            batch["rollout_logprobs"] = ro_out["logprobs"]
        upd = update_policy(model, policy, optimizer, batch, cfg, world, device, tokenizer.pad_token_id,
                            ref_model=ref_model, scaler=scaler)
        push_weights(engine, policy)  # the next rollout samples from the updated policy (SPEC §7)
        is_weights, clipped = upd["is_weight"], upd["clipped"]
        scheduler.step()
        t3 = time.perf_counter()

        # --- 6. logging (rank 0 sees every rank's samples) -----------------------------------
        records = []
        for i, it in enumerate(samples):
            if task == "rm_nlhf":
                records.append(nlhf_record(step + 1, rank, i // G, it, nlhf["samples"][i], ro_out, i,
                                           float(advantages[i]), float(is_weights[i]), float(clipped[i])))
                continue
            rec = {"step": step + 1, "rank": rank, "item": it["index"], "group": i // G,
                   "problem": it["question"], "completion": ro_out["completions"][i],
                   "extracted": R.extract_boxed(ro_out["completions"][i]), "label": it["label"],
                   "correct": bool(rlvr[i]), "anchored": it["anchored"], "truncated": bool(ro_out["truncated"][i]),
                   "length": int(mask[i].sum()), "reward": float(rewards[i]), "rlvr_reward": float(rlvr[i]),
                   "advantage": float(advantages[i]), "importance_weight": float(is_weights[i]),
                   "clipped": float(clipped[i])}
            if logp_q is not None:
                rec["logp"] = {ev["name"]: {mq["question"]: float(logp_q[i, j, k]) for k, mq in enumerate(rw["meta_questions"])}
                               for j, ev in enumerate(evaluators)}
            records.append(rec)
        records = gather_records(records, world)
        loss_total = all_sum(upd["loss"], world)
        grad_norms = upd["grad_norms"]
        nonfinite = all_sum(nonfinite, world)
        gen_tokens = all_sum(mask.sum(), world)
        gap = upd["logp_gap"]
        if gap is not None:
            gap = (all_sum(gap[0], world) / max(all_sum(gap[1], world), 1.0), all_max(gap[2], world))
        if is_main:
            # reward statistics over the samples whose reward is known (a failed judge call gives None)
            rew = torch.tensor([r["reward"] for r in records if r["reward"] is not None] or [0.0])
            lens = torch.tensor([r["length"] for r in records], dtype=torch.float)
            groups = [{r["reward"] for r in records[g:g + G] if r["reward"] is not None} for g in range(0, len(records), G)]
            metrics = {
                "step": step + 1, "reward/mean": rew.mean().item(), "reward/std": rew.std(unbiased=False).item(),
                "accuracy": sum(r["correct"] for r in records) / len(records),
                "advantage/abs_mean": sum(abs(r["advantage"]) for r in records) / len(records),
                "groups/zero_variance_frac": sum(len(g) <= 1 for g in groups) / len(groups),
                "completion/length_mean": lens.mean().item(), "completion/length_max": lens.max().item(),
                "completion/truncated_frac": sum(r["truncated"] for r in records) / len(records),
                "is_weight/mean": sum(r["importance_weight"] for r in records) / len(records),
                "is_weight/max": max(r["importance_weight"] for r in records),
                "is_weight/clip_frac": sum(r["clipped"] for r in records) / len(records),
                "loss": loss_total / (algo["updates_per_batch"] * algo["minibatches"]),
                "grad_norm": sum(grad_norms) / len(grad_norms), "lr": scheduler.get_last_lr()[0],
                "reward/nonfinite": nonfinite,
                "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/update": t3 - t2, "time/step": t3 - t0,
                "rollout/tokens_per_s": gen_tokens / max(t1 - t0, 1e-9), "memory/peak_mb": peak_memory_mb(device),
            }
            if task == "rlme":
                metrics["rlvr_reward/mean"] = sum(r["rlvr_reward"] for r in records) / len(records)
                metrics["completion/boxed_frac"] = sum(r["extracted"] is not None for r in records) / len(records)
            else:  # SPEC §9, RM-NLHF part; the judge's and MetaRM's own seconds are inside time/reward
                metrics.update(nlhf_step_metrics(records, nlhf["metrics"]))
            if gap is not None:
                metrics["rollout/logp_gap_mean"], metrics["rollout/logp_gap_max"] = gap
            if logp_q is not None:
                for ev in evaluators:
                    for mq in rw["meta_questions"]:
                        vals = torch.tensor([r["logp"][ev["name"]][mq["question"]] for r in records])
                        metrics[f"rlme/{ev['name']}/{mq['question']}/logp"] = vals.mean().item()
                        metrics[f"rlme/{ev['name']}/{mq['question']}/p"] = vals.exp().mean().item()
            with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if run["log_samples"]:
                with open(os.path.join(out_dir, "samples.jsonl"), "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in records)
            pbar.update(1)
            pbar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['accuracy']:.2f}",
                             s=f"{metrics['time/step']:.0f}")
        done = step + 1
        if (run["save_every"] and done % run["save_every"] == 0) or done == run["total_steps"]:
            save_checkpoint(out_dir, done, policy, tokenizer, optimizer, scheduler, run["keep_checkpoints"], rank,
                            extra=(lambda d: metarm.save(mrm, os.path.join(d, "metarm"))) if mrm is not None else None,
                            scaler=scaler)
            if world > 1:
                dist.barrier()
        if run["stop_after"] and done - start_step >= run["stop_after"]:
            break
    if pbar is not None:
        pbar.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description="RLME / RLVR / RM-NLHF training (see README).")
    ap.add_argument("--config", action="append", default=[], help="YAML file(s); later ones override earlier ones")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides (YAML-typed)")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    train(cfg)


if __name__ == "__main__":
    main()
