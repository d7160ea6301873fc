"""RLME / RLVR training loop under torchrun: rollout -> reward -> advantage -> CISPO update.

    torchrun --nproc_per_node 8 train.py --config config.yaml            # GPU node (nccl)
    torchrun --nproc_per_node 1 train.py --config configs/cpu.yaml       # this laptop (gloo)
    python train.py --config configs/cpu.yaml run.total_steps=3           # same, without torchrun

One training step, top to bottom in `train()`:
  1. this rank's P/world prompts -> G completions each              (rollout.generate)
  2. rewards: RLME meta-evaluation log p(Yes), or RLVR 0/1           (reward.rlme_reward)
  3. advantages: r - mean(group), optionally / std                    (RLME Eq. 5)
  4. behaviour log-probs (only needed when the update is off-policy)
  5. CISPO update: detached clipped IS weight x advantage x sum of token log-probs (Eq. 6-8),
     one global normaliser across micro-batches and ranks, grad clip, AdamW
  6. metrics.jsonl / samples.jsonl on rank 0, atomic checkpoints
"""
import argparse
import json
import math
import os
import re
import resource
import shutil
import sys
import time

import torch
import torch.distributed as dist
import yaml

import reward as R
import rollout

HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------------------
# Config (SPEC §3): config.yaml is the schema; presets and key=value overrides layer on top.

CHOICES = {
    "model.dtype": ["float32", "bfloat16", "float16"],
    "model.chat_template": ["auto", True, False],
    "data.label_format": ["gsm8k", "plain"],
    "rollout.backend": ["hf", "vllm"],
    "reward.kind": ["rlme", "rlvr"],
    "algo.loss": ["cispo", "grpo"],
    "algo.ratio": ["sequence", "geometric_mean"],
    "algo.aggregation": ["seq_sum", "token_mean", "dr_grpo"],
    "optim.schedule": ["constant", "cosine"],
    "train.parallel": ["ddp", "fsdp2"],
    "train.device": ["auto", "cpu", "cuda"],
}
# Keys allowed inside list items (the list itself replaces the default list).
LIST_ITEM_KEYS = {
    "reward.evaluators": {"name": str, "kind": str, "weight": float, "path": (str, type(None)),
                          "chat_template": (str, bool)},
    "reward.meta_questions": {"question": str, "weight": float, "target": str, "negative": str},
}


def _check_type(key, value, default):
    """One-line SystemExit when `value` does not have the type of the schema's default."""
    if default is None or value is None and key in NULLABLE:
        return
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          list: lambda v: isinstance(v, list)}.get(type(default), lambda v: True)
    if not ok(value):
        raise SystemExit(f"config key {key}: expected {type(default).__name__}, got {value!r}")


NULLABLE = {"reward.evaluator_template"}


def _merge(base, new, prefix=""):
    """Deep-merge `new` into `base` (in place), refusing keys the schema does not have."""
    if not isinstance(new, dict):
        raise SystemExit(f"config {prefix or 'file'}: expected a mapping, got {new!r}")
    for k, v in new.items():
        key = f"{prefix}{k}"
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
            raise SystemExit(f"config file {p}: invalid YAML ({str(e).splitlines()[0]})")

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
        cur[parts[-1]] = yaml.safe_load(val)
        _merge(cfg, node)
    validate_config(cfg)
    return cfg


def validate_config(cfg, world_size=1):
    """Choices, list items and batch shapes; one-line SystemExit naming the key."""
    for key, allowed in CHOICES.items():
        sec, k = key.split(".")
        if cfg[sec][k] not in allowed:
            raise SystemExit(f"config key {key}: {cfg[sec][k]!r} is not one of {allowed}")
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
    r, a = cfg["rollout"], cfg["algo"]
    for key, v in [("rollout.prompts_per_step", r["prompts_per_step"]), ("rollout.group_size", r["group_size"]),
                   ("rollout.max_new_tokens", r["max_new_tokens"]), ("train.micro_batch_size", cfg["train"]["micro_batch_size"]),
                   ("algo.updates_per_batch", a["updates_per_batch"]), ("algo.minibatches", a["minibatches"]),
                   ("run.total_steps", cfg["run"]["total_steps"])]:
        if v < 1:
            raise SystemExit(f"config key {key}: must be >= 1, got {v}")
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
    if "{question}" not in cfg["data"]["prompt_template"]:
        raise SystemExit("config key data.prompt_template: must contain {question}")


# ----------------------------------------------------------------------------------------------
# Data


def read_jsonl_checked(path):
    """Find the first malformed line of a JSON-lines file; SystemExit naming file and line."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: malformed JSON ({e.msg})")
                if not isinstance(row, dict):
                    raise SystemExit(f"{path}:{n}: expected a JSON object per line")


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
        if source.endswith(".jsonl"):
            read_jsonl_checked(source)
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


def setup_distributed(device_setting):
    """Init the process group when launched by torchrun (gloo on CPU, nccl on CUDA).
    Returns (rank, world, device)."""
    use_cuda = device_setting == "cuda" or device_setting == "auto" and torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, torch.device("cuda", local) if use_cuda else torch.device("cpu")


def all_sum(x, world):
    """Sum a float over ranks (returns a float)."""
    if world == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
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
# Checkpoints: plain save_pretrained folders, written atomically (tmp folder, then rename).


def latest_checkpoint(out_dir):
    """Path of the newest complete checkpoint folder in out_dir/checkpoints, or None."""
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"step_(\d+)", d))
             and os.path.isfile(os.path.join(root, d, "trainer_state.pt"))]
    return os.path.join(root, f"step_{max(steps):06d}") if steps else None


def save_checkpoint(out_dir, step, model, tokenizer, optimizer, scheduler, keep):
    """Write out_dir/checkpoints/step_NNNNNN atomically (rank 0 only): a crash mid-write leaves
    a .tmp folder that resume ignores, never a half checkpoint."""
    root = os.path.join(out_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    done = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d))
    for d in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


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
            model, tok = rollout.load_model(path, cfg["model"]["dtype"], device)
            model.eval().requires_grad_(False)
        evaluators.append({"name": ev.get("name", f"{kind}{i}"), "model": model, "tokenizer": tok,
                           "chat": rollout.use_chat_template(tok, ev.get("chat_template", "auto")),
                           "weight": float(ev.get("weight", 1.0))})
    return evaluators


# ----------------------------------------------------------------------------------------------
# The loop


def update_policy(model, policy, optimizer, batch, cfg, world, device, pad_id, ref_model=None):
    """One rollout batch's worth of optimizer steps (SPEC §4.4): `algo.updates_per_batch` passes,
    each split into `algo.minibatches` optimizer steps over whole groups, each accumulated over
    micro-batches of `train.micro_batch_size` sequences.

    The loss of an optimizer step is sum(per-token loss) / normaliser with ONE normaliser
    counted over all its micro-batches on all ranks, so 1 rank x 4 micro-batches, 2 ranks x 2 and
    1 rank x 1 give the same update (tests/test_train.py).

    Args:
        model: the policy, DDP-wrapped when world > 1 (used for the forward with grad).
        policy: the unwrapped policy (no-grad forwards, grad clipping).
        batch: dict with "prompt_ids" list[list[int]] (N), "completion_ids" LongTensor [N, L],
            "completion_mask" FloatTensor [N, L], "advantages" FloatTensor [N], and optionally
            "valid" BoolTensor [N] (False rows are left out of the loss and the normaliser).
        cfg: full config (reads algo, train, optim, rollout.temperature/max_new_tokens/group_size).
    Returns:
        dict: "loss" (float, this rank's share, summed over optimizer steps), "grad_norms"
        (list[float], before clipping), "is_weight" / "clipped" (FloatTensor [N], last pass).
    """
    algo, o, ro = cfg["algo"], cfg["optim"], cfg["rollout"]
    G, per_mb, temperature = ro["group_size"], cfg["train"]["micro_batch_size"], ro["temperature"]
    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
    mask = batch["completion_mask"].float()
    if "valid" in batch:
        mask = mask * batch["valid"].float()[:, None]
    advantages = batch["advantages"]
    n_local = len(prompt_ids)
    model.train()

    def forward(m, rows):
        width = max(1, int(mask[rows].sum(-1).max()))  # trim columns that are padding everywhere
        return rollout.completion_logprobs(m, [prompt_ids[i] for i in rows], completion_ids[rows, :width],
                                           pad_id, temperature), width

    # Behaviour log-probs: with one optimizer step per batch, pi_theta == pi_b at the update, so
    # the ratio is exactly 1 and we skip a whole forward pass; otherwise recompute them with the
    # training model before the first update, without grad (SPEC §4.4). Same for the reference.
    off_policy = algo["updates_per_batch"] > 1 or algo["minibatches"] > 1
    behaviour, ref = [None] * n_local, [None] * n_local
    with torch.no_grad():
        for s in range(0, n_local, per_mb):
            rows = list(range(s, min(s + per_mb, n_local)))
            if off_policy:
                lp, _ = forward(policy, rows)
                for i, row in zip(rows, lp.cpu()):
                    behaviour[i] = row
            if ref_model is not None:
                lp, _ = forward(ref_model, rows)
                for i, row in zip(rows, lp.cpu()):
                    ref[i] = row

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
            chunks = [idx[s:s + per_mb] for s in range(0, len(idx), per_mb)]
            for c, rows in enumerate(chunks):
                # DDP all-reduces gradients on the last micro-batch only.
                last = c == len(chunks) - 1
                with model.no_sync() if world > 1 and not last else torch.enable_grad():
                    lp, width = forward(model, rows)
                    beh = torch.stack([behaviour[i][:width] for i in rows]).to(device) if off_policy else None
                    rl = torch.stack([ref[i][:width] for i in rows]).to(device) if ref_model is not None else None
                    loss_sum, st = policy_loss(lp, beh, advantages[rows].to(device), mask[rows, :width].to(device), algo, rl)
                    # DDP averages gradients over ranks; x world turns that into a global sum / norm.
                    (loss_sum * world / norm).backward()
                loss_total += float(loss_sum.detach()) / norm
                is_weights[rows] = st["is_weight"].float().cpu()
                clipped[rows] = st["clipped"].float().cpu()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), o["grad_clip"] if o["grad_clip"] > 0 else float("inf"))
            grad_norms.append(float(gn))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_total, "grad_norms": grad_norms, "is_weight": is_weights, "clipped": clipped}


def lr_lambda(cfg):
    o, total = cfg["optim"], cfg["run"]["total_steps"]

    def f(step):
        if step < o["warmup_steps"]:
            return (step + 1) / (o["warmup_steps"] + 1)
        if o["schedule"] == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - o["warmup_steps"]) / max(1, total - o["warmup_steps"]))))
        return 1.0
    return f


def train(cfg):
    rank, world, device = setup_distributed(cfg["train"]["device"])
    validate_config(cfg, world)
    run, ro, rw, algo = cfg["run"], cfg["rollout"], cfg["reward"], cfg["algo"]
    out_dir = run["out_dir"]
    is_main = rank == 0
    if ro["backend"] == "vllm":
        raise SystemExit("config key rollout.backend=vllm: the vLLM backend is not available in this "
                         "version; use rollout.backend=hf")
    if cfg["train"]["parallel"] != "ddp":
        raise SystemExit("config key train.parallel=fsdp2: not available in this version; use ddp")

    # --- data, models, optimizer -------------------------------------------------------------
    items = load_train_items(cfg)
    ckpt = latest_checkpoint(out_dir) if run["resume"] else None
    policy, tokenizer = rollout.load_model(ckpt or cfg["model"]["policy"], cfg["model"]["dtype"], device)
    if cfg["model"]["gradient_checkpointing"]:
        # non-reentrant checkpointing works with DDP and with inputs that need no grad
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    chat = rollout.use_chat_template(tokenizer, cfg["model"]["chat_template"])
    model = policy
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device.index] if device.type == "cuda" else None)
    evaluators = load_evaluators(cfg, policy, tokenizer, device) if rw["kind"] == "rlme" else []
    ref_model = None
    if algo["loss"] == "grpo" and algo["kl_coef"] > 0:
        ref_model, _ = rollout.load_model(cfg["model"]["policy"], cfg["model"]["dtype"], device)
        ref_model.eval().requires_grad_(False)
    o = cfg["optim"]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o["lr"], betas=(o["beta1"], o["beta2"]),
                                  weight_decay=o["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    start_step = 0
    if ckpt:
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location=device, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = state["step"]
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        for name in ("metrics.jsonl", "samples.jsonl"):
            if start_step:
                truncate_jsonl(os.path.join(out_dir, name), start_step)
            elif os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        print(f"[train] {rw['kind']} | policy {cfg['model']['policy']} | {len(items)} items | world {world} | "
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
        batch = step_items(items, step, ro["prompts_per_step"], run["seed"], rank, world)
        prompt_ids = [rollout.build_prompt_ids(tokenizer, cfg["data"]["prompt_template"].format(question=it["question"]), chat)
                      for it in batch]
        ro_out = rollout.generate(policy, tokenizer, prompt_ids, G, ro["max_new_tokens"], ro["temperature"],
                                  ro["top_p"], ro["top_k"], seed=run["seed"] * 1_000_003 + step * 10_007 + rank,
                                  micro_batch_size=ro["micro_batch_size"] or None)
        mask = ro_out["completion_mask"]
        samples = [it for it in batch for _ in range(G)]
        t1 = time.perf_counter()

        # --- 2. rewards (RLME Eq. 2-3 or RLVR) --------------------------------------------------
        rlvr = torch.tensor([R.rlvr_reward(c, it["label"]) for c, it in zip(ro_out["completions"], samples)])
        logp_q = None
        nonfinite = 0
        if rw["kind"] == "rlme":
            out = R.rlme_reward(evaluators, rw["meta_questions"], [it["question"] for it in samples],
                                ro_out["completions"], [it["label"] for it in samples],
                                [it["anchored"] for it in samples], template, rw["answer_stub"],
                                rw["renormalize"], rw["micro_batch_size"], rw["nonfinite_logp"])
            rewards, logp_q, nonfinite = out["reward"], out["logp"], out["nonfinite"]
        else:
            rewards = rlvr.clone()
        t2 = time.perf_counter()

        # --- 3. advantages: r - mean of the group (RLME Eq. 5); groups never straddle ranks ---
        advantages = group_advantages(rewards, G, std=algo["advantage_std"])

        # --- 4./5. CISPO update (RLME Eq. 6-8) --------------------------------------------------
        batch = {"prompt_ids": ro_out["prompt_ids"], "completion_ids": ro_out["completion_ids"],
                 "completion_mask": mask, "advantages": advantages}
        upd = update_policy(model, policy, optimizer, batch, cfg, world, device, tokenizer.pad_token_id, ref_model)
        is_weights, clipped = upd["is_weight"], upd["clipped"]
        scheduler.step()
        t3 = time.perf_counter()

        # --- 6. logging (rank 0 sees every rank's samples) -----------------------------------
        records = []
        for i, it in enumerate(samples):
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
        if is_main:
            rew = torch.tensor([r["reward"] for r in records])
            lens = torch.tensor([r["length"] for r in records], dtype=torch.float)
            grp = rew.view(-1, G)
            metrics = {
                "step": step + 1, "reward/mean": rew.mean().item(), "reward/std": rew.std(unbiased=False).item(),
                "accuracy": sum(r["correct"] for r in records) / len(records),
                "rlvr_reward/mean": sum(r["rlvr_reward"] for r in records) / len(records),
                "advantage/abs_mean": sum(abs(r["advantage"]) for r in records) / len(records),
                "groups/zero_variance_frac": (grp.amax(1) == grp.amin(1)).float().mean().item(),
                "completion/length_mean": lens.mean().item(), "completion/length_max": lens.max().item(),
                "completion/truncated_frac": sum(r["truncated"] for r in records) / len(records),
                "completion/boxed_frac": sum(r["extracted"] is not None for r in records) / len(records),
                "is_weight/mean": sum(r["importance_weight"] for r in records) / len(records),
                "is_weight/max": max(r["importance_weight"] for r in records),
                "is_weight/clip_frac": sum(r["clipped"] for r in records) / len(records),
                "loss": loss_total / (algo["updates_per_batch"] * algo["minibatches"]),
                "grad_norm": sum(grad_norms) / len(grad_norms), "lr": scheduler.get_last_lr()[0],
                "reward/nonfinite": nonfinite,
                "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/update": t3 - t2, "time/step": t3 - t0,
                "rollout/tokens_per_s": gen_tokens / max(t1 - t0, 1e-9), "memory/peak_mb": peak_memory_mb(device),
            }
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
            if is_main:
                save_checkpoint(out_dir, done, policy, tokenizer, optimizer, scheduler, run["keep_checkpoints"])
            if world > 1:
                dist.barrier()
        if run["stop_after"] and done - start_step >= run["stop_after"]:
            break
    if pbar is not None:
        pbar.close()
    if world > 1:
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
