"""Configuration and data plumbing (plumbing/config.py, plumbing/items.py): layering and overrides, one-line errors naming the key, file or line, every preset loading, the RLME items and their labels."""
import glob
import os

import pytest

from conftest import data_path
import train as T

from plumbing.config import load_config
from plumbing.items import load_train_items
from plumbing import config


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_config_layering_and_overrides(tmp_path):
    a = _write(tmp_path, "a.yaml", "rollout:\n  group_size: 4\n  max_new_tokens: 64\n")
    b = _write(tmp_path, "b.yaml", "rollout:\n  group_size: 2\n")
    cfg = load_config([a, b], ["optim.lr=3e-6", "run.out_dir=/tmp/x"])
    assert cfg["rollout"]["group_size"] == 2 and cfg["rollout"]["max_new_tokens"] == 64
    assert cfg["optim"]["lr"] == 3e-6 and cfg["run"]["out_dir"] == "/tmp/x"
    assert cfg["algo"]["eps_high"] == 5.0  # untouched default from config.yaml


@pytest.mark.parametrize("override, message", [
    (["rollout.groupsize=4"], "unknown config key rollout.groupsize"),
    (["rollout.group_size=four"], "config key rollout.group_size: expected int"),
    (["algo.loss=ppo"], "config key algo.loss: 'ppo' is not one of"),
    (["reward.meta_questions=[{question: a, weight: 0}, {question: b, weight: 0.0}]"], "reward.meta_questions: every weight is 0"),
    (["reward.evaluators=[{kind: live, weight: 0}]"], "reward.evaluators: every weight is 0"),
    (["model.gradient_checkpointing=true"], "config key model.gradient_checkpointing: True is not one of ['none', 'full', 'selective']"),
    (["algo.minibatches=3"], "config key algo.minibatches=3 does not divide"),
    (["rollout.group_size=0"], "config key rollout.group_size: must be >= 1"),
    (["reward.evaluators=[{kind: frozen}]"], "reward.evaluators[0].path"),
    (["reward.meta_questions=[{question: a, wieght: 1}]"], "reward.meta_questions[0].wieght: unknown"),
    (["reward.evaluator_template='{question} {problem} {solution}'"], "must come after"),
    (["optim.lr"], "expected key.sub=value"),
    (["reward.meta_questions=[{weight: 1}]"], "reward.meta_questions[0].question: missing"),
    (["reward.evaluators=[{name: a}, {name: a, kind: frozen_self}]"], "names must be unique"),
    (["reward.meta_questions=[{question: Is it right?, weight: 1}]"],
     "override 'reward.meta_questions=[{question: Is it right?, weight: 1}]': the value is not valid YAML at line 1, column 24"),
    # settings that would silently do nothing or break mid-run (issue 13)
    (["algo.kl_coef=0.01"], "config key algo.kl_coef=0.01: the KL term is GRPO's"),
    (["task=rm_nlhf", "nlhf.lam=1.5"], "config key nlhf.lam: must be in [0.0, 1.0], got 1.5"),
    (["nlhf.lam=-0.1"], "config key nlhf.lam: must be in [0.0, 1.0], got -0.1"),
    (["optim.lr=-1"], "config key optim.lr: must be > 0, got -1.0"),
    (["optim.beta2=1.0"], "config key optim.beta2: must be in [0, 1), got 1.0"),
    (["reward.meta_questions=[{question: 'Is it right?', target: ''}]"], "reward.meta_questions[0].target: empty"),
    (["rollout.group_size=1"], "config key rollout.group_size: must be >= 2"),
    (["train.share_prompt=false"], "config key train.share_prompt was replaced by train.fast_paths"),
    (["model.dtype=float16", "train.parallel=fsdp2"], "model.dtype=float16 with train.parallel=fsdp2"),
    # RM-NLHF choices (issue 15): unknown names, and the released D_O form where it changes nothing
    (["judge.variant=coarse"], "config key judge.variant: 'coarse' is not one of ['core', 'all', 'meta_judge']"),
    (["nlhf.similarity=f2"], "config key nlhf.similarity: 'f2' is not one of ['f1', 'precision', 'recall']"),
    (["nlhf.grm_prompt=theirs"], "config key nlhf.grm_prompt: 'theirs' is not one of ['ours', 'authors']"),
    (["judge.on_failure=retry"], "config key judge.on_failure: 'retry' is not one of ['mask', 'zero']"),
    (["task=rm_nlhf", "nlhf.do_reward=released", "metarm.mode=metarm_only"],
     "nlhf.do_reward=released would change nothing here: metarm.mode=metarm_only"),
    (["task=rm_nlhf", "nlhf.do_reward=released", "nlhf.do=null"], "nlhf.do_reward=released would change nothing here: no D_O"),
    (["task=rm_nlhf", "nlhf.do_reward=released", "nlhf.gate_on_outcome=false"],
     "nlhf.do_reward=released would change nothing here: nlhf.gate_on_outcome=false"),
    # what a shell leaves of model.system_prompt="": YAML would read null, the default, silently
    (["model.system_prompt="], "override 'model.system_prompt=': no value (a shell drops the quotes"),
])
def test_config_errors_are_one_line(override, message):
    with pytest.raises(SystemExit) as e:
        load_config([], override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_empty_string_override_as_a_shell_passes_it():
    """model.system_prompt="''" in a shell reaches us as model.system_prompt='' : the empty string."""
    assert load_config([], ["model.system_prompt=''"])["model"]["system_prompt"] == ""
    assert load_config([], ["model.system_prompt=null"])["model"]["system_prompt"] is None


def test_invalid_yaml_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  seed: 1\n rollout: [\n")
    with pytest.raises(SystemExit) as e:
        load_config([str(bad)])
    assert str(e.value).startswith(f"config file {bad}: invalid YAML at line 3, column 2") and "\n" not in str(e.value)


def test_a_key_given_twice_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys silently; a preset's first value would never apply."""
    dup = _write(tmp_path, "dup.yaml", "algo:\n  aggregation: seq_sum\n  aggregation: token_mean\n")
    with pytest.raises(SystemExit) as e:
        load_config([dup])
    assert str(e.value) == f"config file {dup}: invalid YAML at line 3, column 3: key 'aggregation' appears twice"


def test_a_config_file_error_names_the_file_and_the_line(tmp_path):
    """A typo'd key, a wrong type, a section that is not a mapping: inside a preset the one-line
    error starts with the file and the key's line (before: the key only, and a preset has many);
    an override's error names the override as before."""
    cases = {"run:\n  total_steps: 3\n  totl_steps: 4\n":
             ", line 3: unknown config key run.totl_steps (did you mean run.total_steps? ",
             "run:\n  seed: 1\nalgo:\n  eps_high: fast\n":
             ", line 4: config key algo.eps_high: expected float, got 'fast'",
             "run:\n  seed: 1\nrollout: 5\n": ", line 3: config key rollout: expected a mapping, got 5"}
    for i, (text, message) in enumerate(cases.items()):
        path = _write(tmp_path, f"c{i}.yaml", text)
        with pytest.raises(SystemExit) as e:
            load_config([path])
        assert str(e.value).startswith(f"config file {path}{message}"), str(e.value)
    with pytest.raises(SystemExit) as e:
        load_config([], ["run.totl_steps=4"])
    assert str(e.value).startswith("unknown config key run.totl_steps (did you mean run.total_steps? ")


def test_world_size_must_divide_prompts():
    cfg = load_config([], ["rollout.prompts_per_step=6"])
    with pytest.raises(SystemExit, match="not divisible by the world size 4"):
        config.validate_config(cfg, world_size=4)


@pytest.mark.parametrize("override, message", [
    ("rollout.top_p=1.5", "config key rollout.top_p: must be in (0, 1], got 1.5"),
    ("rollout.top_p=0", "config key rollout.top_p: must be in (0, 1], got 0.0"),
    ("rollout.top_k=-1", "config key rollout.top_k: must be >= 0 (0 = off), got -1"),
])
def test_sampling_settings_out_of_range(override, message):
    with pytest.raises(SystemExit) as e:
        config.validate_config(load_config([], [override]))
    assert str(e.value) == message


def test_gsm8k_items_and_anchoring():
    cfg = load_config([], [f"data.train={data_path('gsm8k', 'train.jsonl')}", "data.max_items=40",
                           "reward.anchor_fraction=0.25"])
    items = load_train_items(cfg)
    assert len(items) == 40 and items[0]["label"] == "72"  # Natalia: 48 + 24
    assert sum(it["anchored"] for it in items) == 10
    again = load_train_items(cfg)
    assert [it["anchored"] for it in again] == [it["anchored"] for it in items]  # chosen once, by seed


@pytest.mark.parametrize("content, message", [
    ('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": \n', "train.jsonl:2: not valid JSON"),
    ("", "is empty"),
])
def test_bad_data_files(tmp_path, content, message):
    p = _write(tmp_path, "train.jsonl", content)
    cfg = load_config([], [f"data.train={p}"])
    with pytest.raises(SystemExit, match=message):
        load_train_items(cfg)


def test_a_data_file_that_is_not_utf8_names_its_line(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_bytes('{"question": "a", "answer": "#### 1"}\n{"question": "é", "answer": "#### 2"}\n'.encode("latin-1"))
    with pytest.raises(SystemExit, match=r"train.jsonl:2: not UTF-8 text"):
        load_train_items(load_config([], [f"data.train={p}"]))


def test_a_config_file_is_read_as_yaml_bytes(tmp_path):
    """PyYAML detects the encoding of a byte stream: a UTF-16 file loads, a bad byte is one line."""
    wide = tmp_path / "wide.yaml"
    wide.write_bytes("run:\n  seed: 7\n".encode("utf-16"))
    assert load_config([str(wide)])["run"]["seed"] == 7
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"run:\n  seed: \xff\n")
    with pytest.raises(SystemExit) as e:
        load_config([str(bad)])
    assert str(e.value).startswith(f"config file {bad}: invalid YAML") and "\n" not in str(e.value)


def test_missing_field_and_file(tmp_path):
    p = _write(tmp_path, "train.jsonl", '{"problem": "a", "answer": "#### 1"}\n')
    with pytest.raises(SystemExit, match=r"data.question_field='question': no such field .*fields: problem, answer"):
        load_train_items(load_config([], [f"data.train={p}"]))
    with pytest.raises(SystemExit, match="does not exist"):
        load_train_items(load_config([], [f"data.train={tmp_path / 'nope.jsonl'}"]))
    # a folder is named as one (it said "does not exist" of a folder that does)
    with pytest.raises(SystemExit, match=rf"^data file {tmp_path} is a folder \(data.train\): name a .jsonl"):
        load_train_items(load_config([], [f"data.train={tmp_path}"]))
    from plumbing.jsonl import read_jsonl
    with pytest.raises(SystemExit, match=rf"^{tmp_path}: a folder, not a .jsonl file$"):
        read_jsonl(str(tmp_path))


@pytest.mark.parametrize("preset", sorted(glob.glob(os.path.join(os.path.dirname(T.__file__), "configs", "*.yaml"))))
def test_every_preset_loads_and_validates(preset):
    """A preset that drifts from config.yaml's schema (a renamed key, a bad value) fails here, not
    halfway into somebody's run."""
    cfg = load_config([preset])
    config.validate_config(cfg)
    assert cfg["run"]["total_steps"] >= 1
