"""RLME's experiment plumbing in train.py and config.py (issue 16; docs/method.md §4.1, §4.6):
the single-pass guard, {context} / {answer} prompts, held-out items, the hybrid reward step, the
in-run validation with its reward-hacking monitor and early-stop rule. Expected numbers are
worked out by hand in the comments."""
import contextlib
import json
import os

import pytest
import torch

from conftest import data_path, reward_kwargs
import reward as R
import rollout
import train as T
import fast
from plumbing.config import load_config
from plumbing.items import load_train_items, load_val_items
from plumbing.models import load_model
from plumbing import config
from plumbing.pairwise import load_nlhf_val_items, load_pairwise
from plumbing.engine import hf_backend
from plumbing.metrics import rlme_step_metrics
from plumbing.validation import early_stop, monitor, nlhf_validation_step, validation_step, wrong_answer


def cfg_with(*overrides):
    return load_config([], list(overrides))


# ---- the single-pass guard (RLME §4.1) -----------------------------------------------------------

def test_single_pass_guard_numbers():
    """config.yaml: 116 steps x 64 prompts = 7,424 <= 7,473 GSM8K train items (one pass); 117 steps
    = 7,488 > 7,473 stops with the largest allowed step count, 7,473 // 64 = 116."""
    config.check_single_pass(cfg_with(), 7473)
    with pytest.raises(SystemExit) as e:
        config.check_single_pass(cfg_with("run.total_steps=117"), 7473)
    assert str(e.value) == ("config key data.epochs=1: run.total_steps x rollout.prompts_per_step = 117 x 64 = 7488 "
                            "prompts, more than 1 pass(es) over the 7473 training items (RLME §4.1 is single-pass); "
                            "lower run.total_steps to 116 or raise data.epochs")
    config.check_single_pass(cfg_with("run.total_steps=117", "data.epochs=2"), 7473)   # 7,488 <= 14,946
    config.check_single_pass(cfg_with("run.total_steps=10000", "data.epochs=0"), 7473)  # 0 = no limit
    config.check_single_pass(cfg_with("task=rm_nlhf", "run.total_steps=10000"), 10)     # RM-NLHF: not limited


def test_single_pass_stops_the_run_before_a_model_loads(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(5)))
    with pytest.raises(SystemExit, match=r"3 x 2 = 6 prompts, more than 1 pass\(es\) over the 5 training items"):
        T.main([f"data.train={p}", "run.total_steps=3", "rollout.prompts_per_step=2", "model.policy=/nonexistent",
                f"run.out_dir={tmp_path / 'out'}", "train.device=cpu", "train.parallel=ddp", "rollout.backend=hf"])


# ---- prompts: {context}, {answer}, the wrong answer of the counterfactual test ------------------------

def test_prompt_placeholders_and_the_injected_answer():
    item = {"question": "2+2?", "context": "Sums.", "answer_text": "4"}
    t = "{context}|{question}|{answer}"
    assert rollout.policy_prompt_ids(None, item, False, t, text_only=True) == "Sums.|2+2?|4"
    assert rollout.policy_prompt_ids(None, item, False, t, text_only=True, answer="5") == "Sums.|2+2?|5"
    # a number's wrong answer is label + 1; a text label takes the next item's answer
    val = [{"label": "18", "answer_text": "18"}, {"label": ["Paris", "paris"], "answer_text": "Paris"},
           {"label": "Lyon", "answer_text": "Lyon"}, {"label": "Lyon", "answer_text": "Lyon"}]
    assert wrong_answer(val, 0) == "19"
    assert wrong_answer(val, 1) == "Lyon"
    assert wrong_answer(val, 2) == "none"   # the next answer is the same one
    assert wrong_answer(val, 3) == "18"     # wraps around to item 0


@pytest.mark.parametrize("overrides, message", [
    (["data.answer_field=null", "data.prompt_template='{question} {answer}'"],
     "config key data.prompt_template: uses {answer} but data.answer_field is null"),
    (["data.prompt_template='{question} {ctx}'"], "unknown placeholder(s) ['ctx']"),
    (["data.prompt_template='{context} {question}'"], "uses {context} but data.context_field is null"),
    (["data.context_field=passages"], "data.prompt_template has no {context}"),
    (["reward.kind=rlvr_plus"], "config key reward.kind: 'rlvr_plus' is not one of ['rlme', 'rlvr', 'hybrid']"),
    (["run.eval_every=5"], "config key run.eval_every=5: needs held-out problems: set data.val"),
    (["data.val=holdout"], "config key data.val='holdout': is read only by run.eval_every > 0"),
    (["run.eval_every=5", "data.val=holdout", "run.early_stop_patience=2"], "the early-stop rule needs both"),
    (["reward.kind=rlvr", "reward.transform=prob"], "config key reward.transform=prob: acts on the RLME terms"),
    (["reward.rlvr_weight=2.0"], "config key reward.rlvr_weight=2.0: is read only by reward.kind=hybrid"),
    (["task=rm_nlhf", "run.eval_every=5", "data.val=holdout"], "config key data.val='holdout': is RLME's held-out set; task rm_nlhf validates on nlhf.val"),
    (["task=rm_nlhf", "run.eval_every=5"], "config key run.eval_every=5: needs held-out pairs for task rm_nlhf: set nlhf.val"),
    (["task=rm_nlhf", "nlhf.val=holdout"], "config key nlhf.val='holdout': is read only by run.eval_every > 0 with task rm_nlhf"),
    (["run.eval_every=5", "data.val=holdout", "nlhf.val=holdout"], "config key nlhf.val='holdout': is read only by run.eval_every > 0 with task rm_nlhf"),
    (["task=rm_nlhf", "run.eval_every=5", "nlhf.val=holdout", "nlhf.val_size=0"], "config key nlhf.val_size: must be >= 1, got 0"),
    (["task=rm_nlhf", "run.eval_every=5", "nlhf.val=holdout", "nlhf.val_max_new_tokens=0"], "config key nlhf.val_max_new_tokens: must be >= 1"),
    (["data.answer_field=null", "run.eval_every=5", "data.val=holdout"], "config key run.eval_every: validation accuracy needs labels"),
])
def test_experiment_settings_that_cannot_work_are_one_line_errors(overrides, message):
    with pytest.raises(SystemExit) as e:
        cfg_with(*overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- items: holdout, context QA, no labels ------------------------------------------------------------

def test_holdout_is_a_fixed_draw_never_trained_on():
    cfg = cfg_with(f"data.train={data_path('gsm8k', 'train.jsonl')}", "data.max_items=30", "data.val=holdout",
                   "data.val_size=5", "run.eval_every=1")
    train_items, val = load_train_items(cfg), load_val_items(cfg)
    assert len(train_items) == 25 and len(val) == 5
    assert not {it["index"] for it in train_items} & {it["index"] for it in val}
    assert [it["index"] for it in load_val_items(cfg)] == [it["index"] for it in val]  # seeded, fixed


def test_context_qa_items_from_the_offline_set():
    """QA-Feedback (ASQA): passages rendered into the context, cut at 4,000 characters; the gold
    answer is a text label; the evaluator sees context + question."""
    cfg = cfg_with(f"data.train={data_path('qa_feedback', 'dev_feedback.jsonl')}", "data.answer_field=gold",
                   "data.label_format=text", "data.context_field=passages",
                   "data.prompt_template='{context} Q: {question} A in \\boxed{{}}.'", "data.max_items=3")
    items = load_train_items(cfg)
    row = json.loads(open(data_path("qa_feedback", "dev_feedback.jsonl")).readline())
    it = items[0]
    assert it["label"] == row["gold"] and it["answer_text"] == row["gold"]
    assert len(it["context"]) <= 4000 and it["context"].startswith(row["passages"][0][0])
    assert it["problem"] == it["context"] + "\n\n" + row["question"]
    text = rollout.policy_prompt_ids(None, it, False, cfg["data"]["prompt_template"], text_only=True)
    assert text == f"{it['context']} Q: {row['question']} A in \\boxed{{}}."


def test_no_labels_for_pure_rlme(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps({"question": "Say hi."}) + "\n")
    items = load_train_items(cfg_with(f"data.train={p}", "data.answer_field=null"))
    assert items[0]["label"] is None and items[0]["answer_text"] is None


# ---- the reward step: hybrid = RLVR + the RLME terms, both logged ------------------------------------

def test_hybrid_reward_step_adds_the_parts(tiny_model_path):
    model, tok = load_model(tiny_model_path)
    evs = [R.local_evaluator(model, tok, chat=False, name="self", weight=1.0)]
    items = [{"index": 0, "question": "2+2?", "problem": "2+2?", "label": "4", "answer_text": "4", "anchored": False}] * 2
    ro = {"completions": ["so \\boxed{4}", "so \\boxed{5}"]}
    out = {}
    for kind in ("rlme", "rlvr", "hybrid"):
        cfg = cfg_with(f"reward.kind={kind}", "train.device=cpu")
        out[kind] = T.rlme_reward_step(items, ro["completions"], **reward_kwargs(
            cfg, evaluators=evs if kind != "rlvr" else [], context=contextlib.nullcontext, world=1))
    assert out["rlvr"]["reward"].tolist() == [1.0, 0.0]
    # hybrid = 1 x RLVR + the RLME reward of the same completions (the live evaluator is deterministic)
    assert torch.allclose(out["hybrid"]["reward"], out["rlvr"]["reward"] + out["rlme"]["reward"])
    rec = out["hybrid"]["records"][0]
    assert rec["rlvr_reward"] == 1.0 and rec["rlme_reward"] == pytest.approx(float(out["rlme"]["reward"][0]))
    assert rec["correct"] is True and out["hybrid"]["records"][1]["correct"] is False
    m = rlme_step_metrics(out["hybrid"]["records"], cfg)
    assert m["rlvr_reward/mean"] == 0.5 and m["rlme_reward/mean"] == pytest.approx(out["rlme"]["reward"].mean().item())


# ---- the early-stop rule and the monitor ------------------------------------------------------------

@pytest.mark.parametrize("accs, drop, patience, stop", [
    ([0.5, 1.0, 0.75, 0.5], 0.25, 2, False),   # best 1.0; 0.75 is not below 1.0 - 0.25 = 0.75 (exact in binary)
    ([0.5, 1.0, 0.625, 0.5], 0.25, 2, True),   # 0.625 and 0.5 both are
    ([0.5, 0.6, 0.54, 0.53], 0.05, 2, True),   # 0.54 and 0.53 both < 0.55
    ([0.5, 0.6, 0.54, 0.53], 0.05, 3, False),  # 0.6 itself is one of the last three
    ([0.5, 0.6, 0.4, 0.58, 0.4], 0.05, 2, False),  # 0.58 recovered in between
    ([0.3], 0.05, 1, False),                   # the first evaluation is its own best
])
def test_early_stop_rule(accs, drop, patience, stop):
    assert early_stop(accs, drop, patience) is stop


class Bar:
    def __init__(self):
        self.lines, self.postfix = [], {}

    def write(self, s):
        self.lines.append(s)

    def set_postfix(self, **kw):
        self.postfix = kw


def test_monitor_warns_when_reward_rises_while_accuracy_falls():
    cfg = cfg_with("run.eval_every=1", "data.val=holdout", "run.early_stop_drop=0.1", "run.early_stop_patience=2")
    state = {"val_history": [], "rewards_since_eval": [-2.0, -1.0], "pbar": Bar()}
    assert not monitor(state, cfg, {"step": 2, "val/accuracy": 0.5}, {"reward/mean": -1.0})
    # the mean training reward since the last evaluation: (-0.8 - 0.6) / 2 = -0.7 > -1.5, accuracy 0.5 -> 0.45
    state["rewards_since_eval"] = [-0.8, -0.6]
    assert not monitor(state, cfg, {"step": 4, "val/accuracy": 0.45}, {"reward/mean": -0.6})
    assert state["pbar"].lines == ["[monitor] step 4: training reward rose (-1.500 -> -0.700) while held-out "
                                   "accuracy fell (0.500 -> 0.450): reward hacking?"]
    assert state["pbar"].postfix["warn"] == "hack?"
    # 0.45 is not below 0.5 - 0.1; then 0.3 and 0.35 both are: stop after patience 2
    state["rewards_since_eval"] = [-0.5]
    assert not monitor(state, cfg, {"step": 6, "val/accuracy": 0.3}, {"reward/mean": -0.5})
    state["rewards_since_eval"] = [-0.4]
    assert monitor(state, cfg, {"step": 8, "val/accuracy": 0.35}, {"reward/mean": -0.4})


# ---- a run: validation metrics, the counterfactual prompt, early stop and its rerun ------------------

def run_args(tmp_path, model, *extra):
    return [f"model.policy={model}", f"run.out_dir={tmp_path / 'run'}", f"data.train={data_path('gsm8k', 'train.jsonl')}",
            "run.total_steps=4", "run.save_every=0", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "train.device=cpu", "train.parallel=ddp", "model.dtype=float32", "rollout.backend=hf",
            f"data.val={data_path('gsm8k', 'test.jsonl')}", "data.val_size=3", *extra]


def test_validation_metrics_and_the_injected_wrong_answer(tmp_path, tiny_model_path, monkeypatch):
    seen = []
    real = fast.generate

    def spy(model, tok, prompt_ids, group_size, *a, **kw):
        if group_size == 1:
            seen.extend(tok.decode(p) for p in prompt_ids)
        return real(model, tok, prompt_ids, group_size, *a, **kw)
    monkeypatch.setattr(fast, "generate", spy)
    T.main(run_args(tmp_path, tiny_model_path, "run.eval_every=2",
                    "data.prompt_template='{question} The answer is {answer}. Box it: \\boxed{{}}'"))
    ms = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert ["val/accuracy" in m for m in ms] == [False, True, False, True]
    m = ms[1]
    assert m["val/n"] == 3 and m["val/injected"] is True and m["val/seconds"] > 0
    assert {"val/reward_mean", "val/canary/colon", "val/canary/step_by_step", "val/canary/claims_correct"} <= set(m)
    assert "completion/chars_mean" in m
    # the three test problems drawn (seeded), each shown a WRONG answer: label + 1
    val = load_val_items(load_config([], run_args(tmp_path, tiny_model_path, "run.eval_every=2")))
    for it in val:
        assert any(it["question"] in s and f"The answer is {int(it['label']) + 1}." in s for s in seen)


def test_early_stop_writes_its_file_and_a_rerun_stops_at_start(tmp_path, tiny_model_path, monkeypatch, capsys):
    accs = iter([0.5, 0.2, 0.1, 0.0])

    def scripted(state, cfg, step, records, reward_step):  # held-out accuracy 0.5, 0.2, 0.1: falls 0.3 and 0.4 below 0.5
        return {"step": step, "val/accuracy": next(accs)}
    monkeypatch.setattr(T, "validation_step", scripted)
    args = run_args(tmp_path, tiny_model_path, "run.eval_every=1", "run.early_stop_drop=0.25",
                    "run.early_stop_patience=2")
    T.main(args)
    out = tmp_path / "run"
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2, 3]
    info = json.load(open(out / "early_stop.json"))
    assert (info["step"], info["accuracy"], info["best_accuracy"], info["best_step"]) == (3, 0.1, 0.5, 1)
    assert os.path.isdir(out / "checkpoints" / "step_000003")
    capsys.readouterr()
    T.main(args)  # the same command again: refuses to train on, says why
    assert "stopped early at step 3" in capsys.readouterr().out
    assert len(open(out / "metrics.jsonl").readlines()) == 3


# ---- RM-NLHF's in-run validation: the GRM's pairwise accuracy on held-out pairs (issue 27 item 6) -----

def pair(i, winner):
    return {"id": f"v{i}", "context": f"question {i}", "response_a": f"alpha{i}", "response_b": f"beta{i}",
            "winner": winner, "critique": "c", "source": "t", "meta": {}}


def test_nlhf_validation_accuracy_hand_computed(tiny_model_path):
    """3 held-out pairs, human winners A, B, A. A fake generate answers per prompt (order ab shows
    the pair as loaded, order ba swapped): pair 0 always [[A]] (right in ab, wrong in ba); pair 1
    names beta1 in both orders (right twice); pair 2 writes no verdict in ab (a format error) and
    names alpha2 in ba (right). Right = 1 + 2 + 1 = 4 of 6 -> val/pairwise_accuracy 2/3; ab: 2/3
    (pairs 0, 1), ba: 2/3 (pairs 1, 2); format errors 1 of 6. The decoding keys reach the call."""
    _, tok = load_model(tiny_model_path)
    calls = []

    def verdict(text):  # the letter the fake GRM picks for one decoded prompt
        if "question 0" in text:
            return "[[A]]"
        if "question 1" in text:  # beta1 is shown as B in order ab, as A in order ba
            return "[[B]]" if text.index("beta1") > text.index("alpha1") else "[[A]]"
        return "no verdict" if text.index("alpha2") < text.index("beta2") else "[[B]]"

    def generate(model, tok, prompt_ids, group_size, max_new_tokens, temperature, top_p, top_k, seed, micro_batch_size):
        calls.append({"rows": len(prompt_ids), "max_new_tokens": max_new_tokens, "temperature": temperature,
                      "top_p": top_p, "seed": seed})
        outs = []
        for ids in prompt_ids:
            v = verdict(tok.decode(ids))
            outs.append(v if v == "no verdict" else f"<critics>\nOne is wrong.\n</critics>\n<choice>{v}</choice>")
        return {"completions": outs, "truncated": [False] * len(outs)}

    cfg = cfg_with("task=rm_nlhf", "run.eval_every=2", "nlhf.val=holdout", "nlhf.val_size=3", "nlhf.val_max_new_tokens=48",
                   "run.seed=1", "rollout.backend=hf")  # the HF backend below (config.yaml's is vllm)
    from types import SimpleNamespace
    policy = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(max_position_embeddings=10 ** 6))
    state = {"rank": 0, "world": 1, "policy": policy, "model": policy, "tokenizer": tok, "chat": False,
             "rollout": hf_backend(policy, policy, tok, generate=generate, context=contextlib.nullcontext),
             "val_items": [pair(0, "A"), pair(1, "B"), pair(2, "A")]}
    out = validation_step(state, cfg, 4, records=None, reward_step=None)  # dispatches on the task
    assert out["val/n"] == 3 and out["step"] == 4
    assert out["val/pairwise_accuracy"] == pytest.approx(4 / 6)
    assert out["val/acc_ab"] == pytest.approx(2 / 3) and out["val/acc_ba"] == pytest.approx(2 / 3)
    assert out["val/format_error_rate"] == pytest.approx(1 / 6)
    # one call, 6 rows (rollout.micro_batch_size 0 = all at once): the release's T 0.6, top-p 1.0, the
    # key's budget, seed run.seed x 1,000,003 + 7,919 x step + rank = 1,000,003 + 31,676
    assert calls == [{"rows": 6, "max_new_tokens": 48, "temperature": 0.6, "top_p": 1.0, "seed": 1_031_679}]
    # the monitor and the early-stop rule follow val/pairwise_accuracy for this task
    state.update(val_history=[], rewards_since_eval=[1.0], pbar=Bar())
    assert not monitor(state, cfg, out, {"reward/mean": 1.0})
    assert state["val_history"] == [{"step": 4, "accuracy": pytest.approx(4 / 6), "train_reward": 1.0}]


def test_nlhf_validation_wakes_a_vllm_engine_once_for_all_its_calls(tiny_model_path, monkeypatch):
    """RM-NLHF validation through plumbing/engine.py's vLLM backend (its real sample / awake glue over
    tests/plumbing/test_vllm.py's stand-in LLM, sleep level 2 as on a GPU; generate_vllm answers with
    no verdict): 3 pairs x 2 orders = 6 rows in calls of P x G / world = 4 rows, 2 calls. The engine
    is asleep (after the step's rollout, no push since): one push before the first call, none
    between them, one sleep after the last. Before: a sleep after each call and a whole push
    (FSDP2 gather + reload) before the next."""
    from types import SimpleNamespace
    from plumbing import engine as E
    from test_vllm import EXPECTED, _backend, _engine
    _, tok = load_model(tiny_model_path)
    eng = _engine(True, 2, EXPECTED)
    backend = _backend(monkeypatch, eng)
    eng["asleep"] = True
    llm = eng["llm"]

    def generate(llm_, tok_, ids, group_size, max_new_tokens, **kw):
        llm.calls.append(("generate",))
        return {"completions": ["no verdict"] * len(ids), "truncated": [False] * len(ids)}
    monkeypatch.setattr(E, "generate_vllm", generate)
    cfg = cfg_with("task=rm_nlhf", "run.eval_every=2", "nlhf.val=holdout", "nlhf.val_size=3", "nlhf.val_max_new_tokens=48",
                   "rollout.prompts_per_step=2", "rollout.group_size=2")
    policy = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(max_position_embeddings=10 ** 6))
    state = {"rank": 0, "world": 1, "policy": policy, "model": policy, "tokenizer": tok, "chat": False,
             "rollout": backend, "val_items": [pair(0, "A"), pair(1, "B"), pair(2, "A")]}
    out = nlhf_validation_step(state, cfg, 2)
    assert out["val/n"] == 3 and out["val/format_error_rate"] == 1.0
    push = [("wake_up", ("weights",)), ("reload_weights",), ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert llm.calls == push + [("generate",)] * 2 + [("sleep", 2)]


def test_nlhf_holdout_leaves_dh_and_a_file_is_drawn_from():
    """nlhf.val holdout: val_size pairs of D_H, seeded, removed from D_H; a file: val_size of its pairs."""
    dh = [pair(i, "A") for i in range(6)]
    cfg = cfg_with("task=rm_nlhf", "run.eval_every=1", "nlhf.val=holdout", "nlhf.val_size=2")
    val, rest = load_nlhf_val_items(cfg, dh)
    assert len(val) == 2 and len(rest) == 4 and {it["id"] for it in val} | {it["id"] for it in rest} == {it["id"] for it in dh}
    assert [it["id"] for it in load_nlhf_val_items(cfg, dh)[0]] == [it["id"] for it in val]  # fixed for the run
    with pytest.raises(SystemExit, match=r"config key nlhf.val_size=6: the holdout would take all 6 D_H pairs"):
        load_nlhf_val_items(cfg_with("task=rm_nlhf", "run.eval_every=1", "nlhf.val=holdout", "nlhf.val_size=6"), dh)
    f = data_path("llmbar", "LLMBar_Natural.jsonl")
    val, rest = load_nlhf_val_items(cfg_with("task=rm_nlhf", "run.eval_every=1", f"nlhf.val={f}", "nlhf.val_size=3"), dh)
    assert rest is dh and len(val) == 3 and {it["id"] for it in val} <= {it["id"] for it in load_pairwise(f, seed=0)}
    with pytest.raises(SystemExit, match=r"^config key nlhf.val: "):
        load_nlhf_val_items(cfg_with("task=rm_nlhf", "run.eval_every=1", "nlhf.val=/no/such.jsonl"), dh)
