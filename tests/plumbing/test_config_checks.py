"""Start-up checks of the config and the command lines (issue 25): a NaN/inf in a list item, a
misspelt list-item or model.lora field (did you mean), a missing GGUF evaluator file (one line
before any model loads), and a help string on every flag of every CLI."""
import argparse
import os
import subprocess
import sys

import pytest

from conftest import REPO, data_path
import plumbing.cli as cli
from plumbing.config import check_evaluator_paths, load_config


@pytest.mark.parametrize("override, message", [
    ("reward.evaluators=[{name: self, kind: live, weight: .inf}]",
     "config key reward.evaluators[0].weight: inf is not a finite number"),
    ("reward.meta_questions=[{question: 'Is the answer correct?'}, {question: 'Is it short?', weight: -.inf}]",
     "config key reward.meta_questions[1].weight: -inf is not a finite number"),
    ("optim.lr=nan", "config key optim.lr: nan is not a finite number"),  # a YAML string, read as a float
    ("judge.timeout_s=.nan", "config key judge.timeout_s: nan is not a finite number"),
])
def test_a_non_finite_value_anywhere_is_one_line_naming_the_key(override, message):
    """No key of config.yaml takes inf as "unbounded" (each has its own off value, 0), so every
    non-finite number is refused."""
    with pytest.raises(SystemExit) as e:
        load_config([], [override])
    assert str(e.value) == message


@pytest.mark.parametrize("override, hint", [
    ("reward.evaluators=[{name: self, kind: live, wieght: 1.0}]", "(did you mean reward.evaluators[0].weight? known: "),
    ("reward.meta_questions=[{question: q, taget: Yes}]", "(did you mean reward.meta_questions[0].target? known: "),
    ("model.lora={r: 8, alpah: 16, target_modules: all-linear}", "(did you mean model.lora.alpha? known: "),
    ("judge.base_ulr=http://x", "(did you mean judge.base_url? known: "),
])
def test_a_misspelt_field_gets_a_did_you_mean(override, hint):
    """Before: list items and model.lora said only "unknown (known: ...)"."""
    with pytest.raises(SystemExit) as e:
        load_config([], [override])
    assert hint in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("judge.max_tokens_field=max_length",
     "config key judge.max_tokens_field: 'max_length' is not one of ['max_tokens', 'max_completion_tokens']"),
    ("judge.max_tokens=0", "config key judge.max_tokens: must be >= 1 or null (not sent), got 0"),
    ("judge.temperature=-0.5", "config key judge.temperature: must be >= 0 or null (not sent), got -0.5"),
])
def test_judge_sampling_keys_are_checked(override, message):
    """judge.temperature / max_tokens / max_tokens_field (issue 27): null is allowed (not sent), a
    value the request could not carry is one line naming the key."""
    with pytest.raises(SystemExit) as e:
        load_config([], [override])
    assert str(e.value) == message
    j = load_config([], ["judge.temperature=null", "judge.max_tokens=null", "judge.max_tokens_field=max_completion_tokens"])["judge"]
    assert (j["temperature"], j["max_tokens"], j["max_tokens_field"]) == (None, None, "max_completion_tokens")


def test_a_missing_gguf_evaluator_stops_before_any_model_loads(tmp_path):
    """Before: a GGUF path was not checked at start-up, so the run loaded the policy first (here
    a missing one, so the policy's error would come first: the line shows nothing was loaded)."""
    evs = f"reward.evaluators=[{{name: judge, kind: frozen, weight: 1.0, path: {tmp_path}/nothere.gguf}}]"
    p = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "cpu.yaml"),
                        evs, "model.policy=/no/such/model", f"run.out_dir={tmp_path}/run",
                        f"data.train={data_path('gsm8k', 'train.jsonl')}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and lines == [f"config key reward.evaluators[0].path (judge): model path "
                                           f"'{tmp_path}/nothere.gguf': file does not exist"], p.stderr[-1500:]
    cfg = load_config([], ["reward.evaluators=[{name: judge, kind: frozen, path: 'gguf:no_such_pkg_x/m.gguf'}]"])
    with pytest.raises(SystemExit, match=r"^config key reward.evaluators\[0\].path \(judge\): model path "
                                         r"'gguf:no_such_pkg_x/m.gguf': Python package 'no_such_pkg_x' is not installed"):
        check_evaluator_paths(cfg)  # what plumbing.run.setup calls right after validate_config


def test_a_missing_metarm_model_is_one_line_naming_the_key(tmp_path):
    """Before: metarm.model was only read when the MetaRM loaded, after the GRM (issue 25)."""
    cfg = load_config([os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")], [f"metarm.model={tmp_path}/no_metarm"])
    with pytest.raises(SystemExit, match=rf"^config key metarm.model: '{tmp_path}/no_metarm' does not exist$"):
        check_evaluator_paths(cfg)
    (tmp_path / "empty").mkdir()
    cfg = load_config([os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")], [f"metarm.model={tmp_path}/empty"])
    with pytest.raises(SystemExit, match="metarm.model: .* a folder without config.json"):
        check_evaluator_paths(cfg)
    check_evaluator_paths(load_config([os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")],
                                      [f"metarm.model={tmp_path}/empty", "metarm.mode=none"]))  # not loaded: not checked


class _Parsed(Exception):
    """Raised by _Capture.parse_args, carrying the parser a CLI built."""


class _Capture(cli.ArgumentParser):
    def parse_args(self, *args, **kwargs):
        raise _Parsed(self)


def built_parser(main, module, monkeypatch):
    """The ArgumentParser that `main` builds (module.ArgumentParser swapped for one that stops at
    parse_args): the stage CLIs build theirs inside main."""
    monkeypatch.setattr(module, "ArgumentParser", _Capture)
    with pytest.raises(_Parsed) as e:
        main([])
    return e.value.args[0]


def undescribed(parser, name):
    """'<cli> <flag>' of every action without a description (no help, or only its default)."""
    out = []
    for act in parser._actions:
        if isinstance(act, argparse._HelpAction):
            continue
        if isinstance(act, argparse._SubParsersAction):
            for sub_name, sub in act.choices.items():
                out += undescribed(sub, f"{name} {sub_name}")
            continue
        words = (act.help or "").replace("(default: %(default)s)", "").replace("(default: %(default)r)", "")
        if act.help is not argparse.SUPPRESS and not words.strip():
            out.append(f"{name} {'/'.join(act.option_strings) or act.dest}")
    return out


def test_every_flag_of_every_cli_has_a_help_string(monkeypatch):
    """Before: `python rollout.py --help` (now `python -m plumbing.cli rollout`) listed 8 flags with no
    description, reward.py's --dtype only its default, metarm.py's command none."""
    import train
    parsers = [(built_parser(cli.rollout_main, cli, monkeypatch), "rollout.py"),
               (built_parser(cli.reward_main, cli, monkeypatch), "reward.py"),
               (built_parser(cli.metarm_main, cli, monkeypatch), "metarm.py"),
               (built_parser(train.main, cli, monkeypatch), "train.py")]  # cli.train_main builds it
    monkeypatch.undo()
    parsers.append((cli.build_parser(), "evaluate.py"))
    assert all(len(p._actions) > 1 for p, _ in parsers)
    assert [u for p, name in parsers for u in undescribed(p, name)] == []


def test_help_marks_our_protocol_choices():
    """issue 27 item 10: evaluate.py --help says which pairwise / bon protocol choices are ours."""
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    text = " ".join(buf.getvalue().split())
    assert "both A/B orders averaged (ours: the paper does not say how it orders a pair)" in text
    assert "a match without a valid choice goes to the first-listed player (ours; the release picks at random)" in text


def test_logprob_chunk_tokens_is_checked():
    """train.logprob_chunk_tokens (fast.head_logprobs' chunk size) is a config key: 0 = off, never negative."""
    assert load_config([], [])["train"]["logprob_chunk_tokens"] == 1024
    assert load_config([], ["train.logprob_chunk_tokens=0"])["train"]["logprob_chunk_tokens"] == 0
    with pytest.raises(SystemExit) as e:
        load_config([], ["train.logprob_chunk_tokens=-1"])
    assert str(e.value) == "config key train.logprob_chunk_tokens: must be >= 0 (0 = off), got -1"


@pytest.mark.parametrize("value, message", [
    ("0", "config key train.dist_timeout_s: must be > 0 (seconds), got 0.0"),
    ("-5", "config key train.dist_timeout_s: must be > 0 (seconds), got -5.0"),
    ("soon", "config key train.dist_timeout_s: expected float, got 'soon'"),
])
def test_the_process_group_timeout_is_checked(value, message):
    with pytest.raises(SystemExit) as e:
        load_config([], [f"train.dist_timeout_s={value}"])
    assert str(e.value) == message


def test_the_process_group_timeout_reaches_init_process_group(monkeypatch):
    """train.dist_timeout_s becomes init_process_group's timeout= (NCCL's default watchdog: 10 min)."""
    import datetime
    import torch.distributed as dist
    from plumbing import scale
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    scale.setup_distributed("cpu", always_group=True, timeout_s=load_config([])["train"]["dist_timeout_s"])
    assert seen["timeout"] == datetime.timedelta(minutes=30) and seen["backend"] == "gloo"


def test_a_config_file_given_as_an_override_says_use_config():
    """`python train.py configs/cpu.yaml` (no --config): the line says where the file goes (a new
    user's slip, issue 25's fresh-clone check)."""
    with pytest.raises(SystemExit) as e:
        load_config([], ["configs/cpu.yaml"])
    assert str(e.value) == ("override 'configs/cpu.yaml': expected key.sub=value "
                            "(a config file goes after --config: --config configs/cpu.yaml)")
    with pytest.raises(SystemExit, match=r"^override 'lr': expected key.sub=value$"):
        load_config([], ["lr"])
