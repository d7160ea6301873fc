"""Chat-template options (docs/method.md §4.1): model.chat_template_kwargs / system_prompt and
their per-evaluator twins reach every apply_chat_template; auto = plain text for "-Base" models;
settings that would do nothing are one-line errors."""
import json
import os
import shutil

import pytest
import transformers

from plumbing import config
import reward as R
import rollout
import train
from conftest import REPO, data_path
from plumbing.cli import evaluate_main, reward_main
from plumbing.models import load_model
from plumbing.prompts import render_prompt, use_chat_template
from plumbing.evaluators import load_evaluators, remote_evaluator

# Qwen3's handling of enable_thinking and of the system message, cut down to what a single-turn
# prompt renders (Qwen3's template: `enable_thinking is defined and enable_thinking is false`
# appends an empty think block to the generation prompt). Qwen3's block ends in "\n\n", which
# Qwen's tokenizer keeps in one piece before "Yes"; the SmolLM2 tokenizer used here would split
# "\n\nYes" differently from "\n\n" (reward.evaluator_prompt_and_target_ids refuses that), so
# this block ends in one newline.
QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages if m.role != 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n' }}{%- endif %}"
    "{%- endif %}")
NO_SYSTEM = ("{%- for m in messages if m.role != 'system' %}"
             "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def qwen3_style(tiny_model_path, tmp_path_factory):
    """The tiny model's folder with QWEN3_STYLE as its chat template; (path, tokenizer)."""
    path = str(tmp_path_factory.mktemp("tpl") / "tiny-Instruct")
    shutil.copytree(tiny_model_path, path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN3_STYLE
    tok.save_pretrained(path)
    return path, transformers.AutoTokenizer.from_pretrained(path)


def test_auto_is_plain_text_for_a_base_model_even_when_its_tokenizer_has_a_template(tiny_model_path, tmp_path):
    # Qwen3-4B-Base ships the instruct chat template in its tokenizer: "has a template" alone
    # would wrap a base model's prompt in a chat format it was never trained on.
    base = str(tmp_path / "Tiny-135M-Base")
    shutil.copytree(tiny_model_path, base)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    assert tok.chat_template is not None
    assert use_chat_template(tok, "auto", model_path=base) is False
    assert use_chat_template(tok, "auto", model_path=base + "/") is False
    assert use_chat_template(tok, "auto", model_path="Qwen/Qwen3-4B-Base") is False
    assert use_chat_template(tok, "auto", model_path="gguf:pkg/Tiny-Base.Q4_1.gguf") is False
    for instruct in ("Qwen/Qwen3-4B", "HuggingFaceTB/SmolLM2-135M-Instruct", "org/based-model", None):
        assert use_chat_template(tok, "auto", model_path=instruct) == {"system": None, "kwargs": {}}
    assert use_chat_template(tok, True, model_path=base)  # an explicit true wins
    # the prompt ids follow: plain text has no chat header
    assert rollout.build_prompt_ids(tok, "Q", False) == tok("Q")["input_ids"]


def test_options_reach_every_template_call_hand_rendered(qwen3_style):
    path, tok = qwen3_style
    chat = use_chat_template(tok, "auto", model_path=path, system="Be brief.",
                                     template_kwargs={"enable_thinking": False})
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n")
    assert render_prompt(tok, "Q", chat) == expected
    assert rollout.build_prompt_ids(tok, "Q", chat) == tok(expected, add_special_tokens=False)["input_ids"]
    # the evaluator prompt (RLME Eq. 2): the same header, then the target right after the think block
    p, t = R.evaluator_prompt_and_target_ids(tok, "Q", "Yes", chat=chat)
    assert p == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode(t) == "Yes"
    # the GRM prompt (RM-NLHF) goes through the same builder
    nl = config.load_config([])["nlhf"]
    item = {"context": "Hi", "response_a": "A", "response_b": "B"}
    fmt = dict(max_lines=nl["max_critique_lines"], style=nl["grm_prompt"])
    text = R.grm_prompt_ids(tok, item, chat, **fmt, text_only=True)
    assert tok.decode(R.grm_prompt_ids(tok, item, chat, **fmt)) == expected.replace("\nQ<", f"\n{text}<")
    # without options: no system block, no think block
    assert render_prompt(tok, "Q", True) == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_settings_that_would_do_nothing_are_one_line_errors(qwen3_style, tiny_model_path, tmp_path):
    path, tok = qwen3_style
    smol = transformers.AutoTokenizer.from_pretrained(tiny_model_path)  # SmolLM2's template: no enable_thinking
    cases = [
        (lambda: use_chat_template(smol, "auto", template_kwargs={"enable_thinking": False}),
         "config key model.chat_template_kwargs: enable_thinking=False renders the same prompt"),
        (lambda: use_chat_template(tok, "auto", template_kwargs={"enable_thinking": True}),
         "enable_thinking=True renders the same prompt"),  # Qwen3's default
        (lambda: use_chat_template(tok, False, template_kwargs={"enable_thinking": False}),
         "config key model.chat_template_kwargs: the prompt is plain text"),
        (lambda: use_chat_template(tok, "auto", model_path="x/Tiny-Base", system="S"),
         "config key model.system_prompt: the prompt is plain text"),
        (lambda: _no_system(tok, "S"), "config key reward.evaluators[1].system_prompt: the chat template drops"),
        (lambda: use_chat_template(tok, "auto", template_kwargs={"enable_thinking": 0}, key=None),
         "--chat-template-kwargs: enable_thinking=0 renders the same prompt"),
        # SmolLM2's template puts this system message in when none is given
        (lambda: use_chat_template(smol, "auto", system=SMOL_DEFAULT_SYSTEM),
         f"config key model.system_prompt: {SMOL_DEFAULT_SYSTEM!r} renders the same prompt as without it"),
        (lambda: use_chat_template(tok, "auto", model_path="x/Tiny-Base", system=""),
         "config key model.system_prompt: the prompt is plain text"),
        # apply_chat_template's own arguments: a TypeError (add_generation_prompt given twice) before
        (lambda: use_chat_template(smol, "auto", template_kwargs={"add_generation_prompt": False}),
         "config key model.chat_template_kwargs: add_generation_prompt is an argument of apply_chat_template"),
        (lambda: use_chat_template(smol, "auto", template_kwargs={"tokenize": False}),
         "config key model.chat_template_kwargs: tokenize is an argument of apply_chat_template"),
    ]
    for call, message in cases:
        with pytest.raises(SystemExit) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_an_empty_system_prompt_removes_the_default_one(tiny_model_path):
    """model.system_prompt "" is an empty system message, not "no option": for SmolLM2 it replaces
    the template's default system message (before, "" was dropped and the default stayed)."""
    smol = transformers.AutoTokenizer.from_pretrained(tiny_model_path)
    chat = use_chat_template(smol, "auto", system="")
    assert chat == {"system": "", "kwargs": {}}
    assert render_prompt(smol, "Q", chat) == "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert SMOL_DEFAULT_SYSTEM in render_prompt(smol, "Q", True)


def _no_system(tok, system):
    t = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    t.chat_template = NO_SYSTEM
    return use_chat_template(t, True, system=system, key="reward.evaluators[1]")


def test_config_keys_are_checked_before_any_model_loads():
    cfg = config.load_config([], ["model.chat_template_kwargs={enable_thinking: false}", "model.system_prompt=Be brief."])
    assert cfg["model"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert cfg["reward"]["evaluators"][0]["chat_template_kwargs"] is None  # = the model's (live)
    for override, message in [("model.chat_template_kwargs=[1]", "config key model.chat_template_kwargs: expected a mapping"),
                              ("model.system_prompt=3", "config key model.system_prompt: expected"),
                              ("reward.evaluators=[{kind: live, chat_template_kwargs: [1]}]",
                               "config key reward.evaluators[0].chat_template_kwargs: bad value")]:
        with pytest.raises(SystemExit) as e:
            config.load_config([], [override])
        assert message in str(e.value), str(e.value)


def test_cli_bad_json_is_one_line_before_the_model_loads(tmp_path):
    for main, argv in [(evaluate_main, ["math", "--model", "no/such-model", "--chat-template-kwargs", "{oops"]),
                       (reward_main, ["--evaluator", "no/such-model", "--in", str(tmp_path / "x.jsonl"),
                                 "--out", str(tmp_path / "y.jsonl"), "--chat-template-kwargs", "[1]"])]:
        if main is reward_main:
            (tmp_path / "x.jsonl").write_text('{"problem": "p", "completion": "c"}\n')
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert str(e.value).startswith("--chat-template-kwargs: "), str(e.value)


@pytest.mark.slow
def test_training_passes_the_options_to_every_template_call(qwen3_style, tmp_path, monkeypatch):
    """One training step with live + frozen_self evaluators: every apply_chat_template call gets
    enable_thinking=False (the evaluators inherit the model's kwargs); the policy prompts get the
    system prompt, the evaluator prompts their own (frozen_self) or none (live)."""
    path, _ = qwen3_style
    calls = []
    real = transformers.PreTrainedTokenizerBase.apply_chat_template

    def spy(self, conversation, *args, **kwargs):
        calls.append((conversation, kwargs))
        return real(self, conversation, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "apply_chat_template", spy)
    out = str(tmp_path / "run")
    train.main(["--config", os.path.join(REPO, "configs", "cpu.yaml"), f"model.policy={path}", f"run.out_dir={out}",
                "run.total_steps=1", f"data.train={data_path('gsm8k', 'train.jsonl')}", "rollout.prompts_per_step=2",
                "rollout.group_size=2", "rollout.max_new_tokens=4", "model.chat_template_kwargs={enable_thinking: false}",
                "model.system_prompt=Solve it.",
                "reward.evaluators=[{name: self, kind: live}, {name: self0, kind: frozen_self, system_prompt: Judge it.}]"])
    calls = [(c, kw) for c, kw in calls if c[-1]["content"] != "2 + 2 = ?"]  # use_chat_template's own checks
    assert calls and all(kw.get("enable_thinking") is False for _, kw in calls)
    systems = {c[0]["content"] if c[0]["role"] == "system" else None for c, _ in calls}
    assert systems == {"Solve it.", "Judge it.", None}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1]


def test_live_and_frozen_self_evaluators_follow_the_policy_format(qwen3_style):
    """auto / None on a live or frozen_self evaluator mean "as the policy" (same model, same
    template); a frozen evaluator decides for itself."""
    path, tok = qwen3_style
    cfg = config.load_config([], [f"model.policy={path}", "model.chat_template=false", "model.dtype=float32",
                                  f"reward.evaluators=[{{kind: live}}, {{kind: frozen_self}}, {{kind: frozen, path: {path}}}]"])
    policy, _ = load_model(path)
    evs = load_evaluators(cfg, policy, tok, "cpu", train.fast_or_plain(True))
    assert [ev["chat"] for ev in evs] == [False, False, {"system": None, "kwargs": {}}]
    cfg["model"].update(chat_template="auto", chat_template_kwargs={"enable_thinking": False})
    evs = load_evaluators(cfg, policy, tok, "cpu", train.fast_or_plain(True))
    assert [ev["chat"]["kwargs"] for ev in evs] == [{"enable_thinking": False}] * 2 + [{}]


def test_remote_evaluator_prompts_carry_the_options(qwen3_style):
    """A remote evaluator renders its prompt with the served model's tokenizer: the same options."""
    path, _ = qwen3_style
    ev = remote_evaluator("http://127.0.0.1:9/v1", "m", tokenizer=path, system_prompt="Judge it.",
                            chat_template_kwargs={"enable_thinking": False}, probe=False)
    prompt, full = R.evaluator_prompt_text(ev["tokenizer"], "Q", "Yes", ev["chat"])
    assert prompt == ("<|im_start|>system\nJudge it.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                      "<|im_start|>assistant\n<think>\n\n</think>\n") and full == prompt + "Yes"
    with pytest.raises(SystemExit) as e:  # no tokenizer: plain text, so the options would do nothing
        remote_evaluator("http://127.0.0.1:9/v1", "m", system_prompt="S", probe=False)
    assert "need the served model's tokenizer" in str(e.value)
