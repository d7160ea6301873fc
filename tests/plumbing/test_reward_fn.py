"""The RLME reward outside our trainer (reward.py): TRL's reward function, verl's compute_score,
load_evaluator and `python -m plumbing.cli reward`. Every value must be reward.rlme_reward's on the same
(problem, completion) pairs (RLME Eq. 2-3)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import reward as R
from plumbing.cli import reward_main
from plumbing.evaluators import load_evaluator
from plumbing.reward_functions import trl_reward_function, verl_compute_score

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/plumbing/ -> the repository

QUESTIONS = [{"question": "Is the answer correct?", "weight": 1.0, "target": "Yes"},
             {"question": "Is the solution concise?", "weight": 0.5, "target": "Yes"}]
# two problems x two completions, the samples of one problem adjacent (as TRL orders them)
PROBLEMS = ["What is 2 + 3?", "What is 2 + 3?", "Tom has 4 apples and eats 1. How many are left?",
            "Tom has 4 apples and eats 1. How many are left?"]
COMPLETIONS = [r"2 + 3 = 5, so \boxed{5}.", r"\boxed{6}", r"4 - 1 = 3. \boxed{3}", "I do not know."]


@pytest.fixture(scope="module")
def evaluators(tiny_model_path):
    """J = 2 frozen evaluators: the tiny model with its chat template (v = 1) and as plain text
    with the answer stub (v = 0.5), so both prompt forms and the evaluator weights are exercised."""
    return [load_evaluator(tiny_model_path, name="chat"),
            load_evaluator(tiny_model_path, name="plain", weight=0.5, chat_template=False)]


def expected(evaluators, problems=PROBLEMS, completions=COMPLETIONS, **kw):
    return R.rlme_reward(evaluators, QUESTIONS, problems, completions, **kw)


def test_load_evaluator_builds_a_frozen_evaluator(evaluators):
    ev, plain = evaluators
    assert set(ev) == {"name", "weight", "score", "model", "tokenizer", "chat"}  # reward.local_evaluator's dict
    # "chat": the template options (plumbing.prompts.use_chat_template), False for plain text
    assert (ev["name"], ev["chat"], ev["weight"]) == ("chat", {"system": None, "kwargs": {}}, 1.0)
    assert (plain["chat"], plain["weight"]) == (False, 0.5)
    # the chat template and the plain-text prompt score the same text differently
    texts, targets = [["Is 2 + 2 = 4?"]], ["Yes"]
    assert ev["score"](texts, targets).shape == (1, 1)
    assert not torch.equal(ev["score"](texts, targets), plain["score"](texts, targets))
    assert not ev["model"].training
    assert not any(p.requires_grad for p in ev["model"].parameters())


def test_trl_function_on_strings_equals_rlme_reward(evaluators):
    fn = trl_reward_function(evaluators, QUESTIONS)
    got = fn(prompts=PROBLEMS, completions=COMPLETIONS, completion_ids=[[1]] * 4, trainer_state=None)
    assert got == expected(evaluators)["reward"].tolist()
    assert all(isinstance(r, float) and r <= 0 for r in got)


def test_trl_function_on_conversational_inputs_equals_rlme_reward(evaluators):
    """TRL's chat form: the problem is the LAST user message (the system message and earlier turns
    are not shown to the evaluator), the solution the assistant message's content."""
    prompts = [[{"role": "system", "content": "You are a careful solver."},
                {"role": "user", "content": "an earlier turn"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": p}] for p in PROBLEMS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    fn = trl_reward_function(evaluators, QUESTIONS)
    assert fn(prompts, completions) == expected(evaluators)["reward"].tolist()


def test_trl_function_reads_the_problem_from_a_dataset_column(evaluators):
    """problem_key names a column: the prompt (with its instructions) is not what the evaluator sees."""
    prompts = [[{"role": "user", "content": f"Solve and box the answer: {p}"}] for p in PROBLEMS]
    fn = trl_reward_function(evaluators, QUESTIONS, problem_key="question")
    got = fn(prompts, COMPLETIONS, question=PROBLEMS, answer=["5", "5", "3", "3"])
    assert got == expected(evaluators)["reward"].tolist()
    with pytest.raises(ValueError, match="problem_key 'question' is not a dataset column.*'answer'"):
        fn(prompts, COMPLETIONS, answer=["5"] * 4, log_metric=lambda name, value: None)


def test_trl_function_logs_every_mean_logp_through_log_metric(evaluators):
    logged = []
    fn = trl_reward_function(evaluators, QUESTIONS)
    fn(PROBLEMS, COMPLETIONS, log_metric=lambda name, value: logged.append((name, value)))
    means = expected(evaluators)["logp"].mean(0)  # [J, K]
    want = {f"rlme/{ev['name']}/{q['question']}/logp": means[j, k].item()
            for j, ev in enumerate(evaluators) for k, q in enumerate(QUESTIONS)}
    want["rlme/nonfinite"] = 0.0
    assert dict(logged) == want
    assert len(logged) == len(want)  # each once per call


def test_trl_function_name_transform_and_options(evaluators, tiny_model_path):
    from trl.trainer.utils import get_callable_name  # how GRPOTrainer names the reward column
    assert get_callable_name(trl_reward_function(evaluators, QUESTIONS)) == "rlme_reward"
    # the answer stub of plain-text prompts and the scoring micro-batch are the evaluator's own
    reply = [load_evaluator(tiny_model_path, name="plain", chat_template=False, answer_stub="\nReply:",
                              micro_batch_size=3)]
    fn = trl_reward_function(reply, ["Is the answer correct?"], name="rlme_correct", transform="prob")
    assert fn.__name__ == "rlme_correct" and get_callable_name(fn) == "rlme_correct"
    plain_q = [{"question": "Is the answer correct?", "weight": 1.0, "target": "Yes"}]
    want = R.rlme_reward(reply, plain_q, PROBLEMS, COMPLETIONS, transform="prob")
    assert fn(PROBLEMS, COMPLETIONS) == want["reward"].tolist()
    stub = R.rlme_reward(evaluators[1:], plain_q, PROBLEMS, COMPLETIONS, transform="prob")
    assert want["reward"].tolist() != stub["reward"].tolist()  # "\nReply:" is not the default "\nAnswer:"


def test_factories_fail_at_once_on_bad_settings(evaluators):
    for factory in (trl_reward_function, verl_compute_score):
        with pytest.raises(ValueError, match="transform 'logit'"):
            factory(evaluators, QUESTIONS, transform="logit")
        with pytest.raises(ValueError, match="distinct questions"):
            factory(evaluators, ["Is it right?", "Is it right?"])
        with pytest.raises(ValueError, match=r"evaluators\[0\]"):
            factory([{"model": None}], QUESTIONS)
        with pytest.raises(SystemExit, match="must contain {solution}"):
            factory(evaluators, QUESTIONS, template="{problem} {question}")
        with pytest.raises(SystemExit, match="cannot be filled.*'answer'"):
            factory(evaluators, QUESTIONS, template="{problem} {solution} {answer} {question}")


def test_verl_compute_score_equals_the_per_sample_reward(evaluators):
    score = verl_compute_score(evaluators, QUESTIONS)
    batched = expected(evaluators)["reward"]
    for i, (p, c) in enumerate(zip(PROBLEMS, COMPLETIONS)):
        # the keywords verl's reward managers pass; ground truth and data source are not read
        got = score(data_source="openai/gsm8k", solution_str=c, ground_truth="5",
                    extra_info={"question": p, "index": i, "split": "train"})
        assert isinstance(got, float)
        assert got == expected(evaluators, problems=[p], completions=[c])["reward"].item()
        assert got == pytest.approx(batched[i].item(), abs=1e-4)  # batched: other padding, same value
    with pytest.raises(ValueError, match=r"extra_info\['question'\].*\['index'\]"):
        score("openai/gsm8k", "x", "5", {"index": 0})
    with pytest.raises(ValueError, match=r"extra_info\['question'\]"):
        score("openai/gsm8k", "x", "5")
    by_key = verl_compute_score(evaluators, QUESTIONS, problem_key="problem")
    assert by_key("d", COMPLETIONS[0], "5", {"problem": PROBLEMS[0]}) == score("d", COMPLETIONS[0], "5",
                                                                               {"question": PROBLEMS[0]})


# ---- python -m plumbing.cli reward -----------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def samples_rows():
    """Rows as train.py writes samples.jsonl (problem, completion, old logp / reward, other fields),
    the third with a reference answer."""
    rows = [{"step": 1, "group": i // 2, "problem": p, "completion": c, "label": "5", "reward": 0.0,
             "logp": {"self0": {"Is the answer correct?": -1.0}}} for i, (p, c) in enumerate(zip(PROBLEMS, COMPLETIONS))]
    rows[2]["reference"] = "3"
    return rows


def test_cli_round_trip_equals_rlme_reward(tmp_path, tiny_model_path, capsys):
    rows = samples_rows()
    inp, out = write_jsonl(tmp_path / "samples.jsonl", rows), str(tmp_path / "scored.jsonl")
    reward_main(["--evaluator", tiny_model_path, "--in", inp, "--out", out, "--question", "Is the answer correct?",
            "--question", "Is the solution concise?", "--evaluator-name", "tiny", "--micro-batch-size", "3"])
    assert f"{out}: 4 rows scored" in capsys.readouterr().out
    got = [json.loads(line) for line in open(out)]
    ev = load_evaluator(tiny_model_path, name="tiny", micro_batch_size=3)  # as --micro-batch-size 3
    qs = R.meta_question_dicts(["Is the answer correct?", "Is the solution concise?"])
    want = R.rlme_reward([ev], qs, PROBLEMS, COMPLETIONS, references=[None, None, "3", None],
                         anchored=[False, False, True, False])
    assert len(got) == len(rows)
    for i, (row, g) in enumerate(zip(rows, got)):
        assert {k: v for k, v in g.items() if k not in ("logp", "reward")} == \
               {k: v for k, v in row.items() if k not in ("logp", "reward")}  # the other fields kept
        assert g["reward"] == want["reward"][i].item()  # the old reward and logp replaced
        assert g["logp"] == {"tiny": {q["question"]: want["logp"][i, 0, k].item() for k, q in enumerate(qs)}}
    # the reference row was anchored: without the reference its log p differs
    plain = R.rlme_reward([ev], qs, PROBLEMS[2:3], COMPLETIONS[2:3])["reward"].item()
    assert got[2]["reward"] != plain


def test_cli_runs_on_its_own(tmp_path, tiny_model_path):
    """`python -m plumbing.cli reward` as a program, from another folder: default question, --transform prob,
    other field names; its evaluator is named "self" by default, as the training run's samples.jsonl names it."""
    rows = [{"q": p, "a": c} for p, c in zip(PROBLEMS[:2], COMPLETIONS[:2])]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out.jsonl")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "plumbing.cli", "reward", "--evaluator", tiny_model_path, "--in", inp,
                        "--out", out, "--problem-field", "q", "--completion-field", "a", "--transform", "prob"],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stderr
    assert "2 rows scored" in r.stdout
    got = [json.loads(line) for line in open(out)]
    ev = load_evaluator(tiny_model_path)
    want = R.rlme_reward([ev], R.meta_question_dicts(["Is the answer correct?"]), PROBLEMS[:2], COMPLETIONS[:2],
                         transform="prob")
    for i, g in enumerate(got):  # another process (its own thread count): equal up to float sums
        assert g["reward"] == pytest.approx(want["reward"][i].item(), abs=1e-5)
        assert g["reward"] == pytest.approx(math.exp(g["logp"]["self"]["Is the answer correct?"]), abs=1e-6)


@pytest.mark.parametrize("case, rows, extra, message", [
    ("missing file", None, [], "no_such.jsonl: file does not exist"),
    ("empty file", [], [], "no rows (the file is empty)"),
    ("missing field", [{"problem": "p", "completion": "c"}, {"problem": "p"}], [],
     "in.jsonl:2: missing field 'completion' (fields found: ['problem']; --completion-field names another)"),
    ("field not a string", [{"problem": "p", "completion": ["c"]}], [],
     "in.jsonl:1: field 'completion' must be a string, got list"),
    ("reference not a string", [{"problem": "p", "completion": "c", "reference": {"a": 1}}], [],
     "in.jsonl:1: field 'reference' must be a string or number, got dict"),
    ("other field name", [{"problem": "p", "completion": "c"}], ["--problem-field", "question"],
     "in.jsonl:1: missing field 'question'"),
    ("bad json", "{not json\n", [], "in.jsonl:1: not valid JSON"),
    ("not utf-8", '{"problem": "p", "completion": "c"}\n{"problem": "é", "completion": "c"}\n'.encode("latin-1"), [],
     "in.jsonl:2: not UTF-8 text"),
    ("template not utf-8", [{"problem": "p", "completion": "c"}], ["--template-file", "{latin}"],
     "not UTF-8 text"),
    ("template file missing", [{"problem": "p", "completion": "c"}], ["--template-file", "nope.txt"],
     "nope.txt: file does not exist (--template-file)"),
    ("template without solution", [{"problem": "p", "completion": "c"}], ["--template-file", "{tpl}"],
     "must contain {solution} exactly once"),
    ("same question twice", [{"problem": "p", "completion": "c"}], ["--question", "Ok?", "--question", "Ok?"],
     "--question: meta_questions must be a non-empty list of distinct questions"),
    ("out folder missing", [{"problem": "p", "completion": "c"}], ["--out", "{tmp}/no/dir/out.jsonl"],
     "/no/dir does not exist"),
    ("micro-batch 0", [{"problem": "p", "completion": "c"}], ["--micro-batch-size", "0"],
     "--micro-batch-size must be >= 1, got 0"),
])
def test_cli_input_errors_are_one_line_before_the_model_loads(tmp_path, case, rows, extra, message):
    """A model path that does not exist: reaching the model load would end in its own error instead."""
    inp = str(tmp_path / ("no_such.jsonl" if rows is None else "in.jsonl"))
    if isinstance(rows, str):
        (tmp_path / "in.jsonl").write_text(rows)
    elif isinstance(rows, bytes):
        (tmp_path / "in.jsonl").write_bytes(rows)
    elif rows is not None:
        write_jsonl(tmp_path / "in.jsonl", rows)
    tpl = tmp_path / "tpl.txt"
    tpl.write_text("{problem} {question}")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("{problem} {solution} {question} é".encode("latin-1"))
    extra = [x.replace("{tpl}", str(tpl)).replace("{tmp}", str(tmp_path)).replace("{latin}", str(latin)) for x in extra]
    argv = ["--evaluator", str(tmp_path / "no_model"), "--in", inp, "--out", str(tmp_path / "out.jsonl"), *extra]
    with pytest.raises(SystemExit) as e:
        reward_main(argv)
    text = str(e.value)
    assert message in text and "\n" not in text, text
    assert not os.path.exists(tmp_path / "out.jsonl")


# ---- TRL's GRPOTrainer with our reward ------------------------------------------------------------


@pytest.mark.slow
def test_trl_grpo_trainer_runs_two_steps_with_the_rlme_reward(tmp_path, smollm2_path):
    """GRPOTrainer (trl 1.16, CPU) trains the real SmolLM2-135M-Instruct for 2 steps with our reward
    function, a frozen SmolLM2 as the evaluator: the run finishes, TRL logs our reward and our
    per-question log p, every reward TRL received is rlme_reward's on the texts it passed, and the
    policy's weights moved."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    ev = load_evaluator(smollm2_path, name="smol")  # frozen, a separate copy from the policy
    questions = ["What is 2 + 3?", "What is 7 - 4?", "What is 3 * 3?", "What is 8 / 2?"]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Solve, box the answer: {q}"}], "question": q}
                              for q in questions])
    rlme = trl_reward_function([ev], ["Is the answer correct?"], problem_key="question")
    calls = []

    def recorded(prompts, completions, **kwargs):
        rewards = rlme(prompts, completions, **kwargs)
        calls.append((list(kwargs["question"]), [c[0]["content"] for c in completions], rewards))
        return rewards
    recorded.__name__ = rlme.__name__

    policy = AutoModelForCausalLM.from_pretrained(smollm2_path)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                      logging_steps=1, max_steps=2, seed=0, per_device_train_batch_size=2,
                      gradient_accumulation_steps=1, num_generations=2, max_completion_length=8,
                      activation_checkpointing=False, dataloader_num_workers=0, log_completions=False)
    trainer = GRPOTrainer(model=policy, processing_class=tok, reward_funcs=recorded, args=args, train_dataset=data)
    trainer.train()

    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "rewards/rlme_reward/mean" in h]
    assert len(logs) == 2
    for h in logs:
        logp = h["rlme/smol/Is the answer correct?/logp"]
        # one evaluator, one question of weight 1: the reward is the log p, so are their means
        assert math.isfinite(logp) and logp < 0
        assert h["rewards/rlme_reward/mean"] == pytest.approx(logp, abs=1e-5)
        assert h["rlme/nonfinite"] == 0.0
    assert len(calls) == 2
    for problems, completions, rewards in calls:
        want = R.rlme_reward([ev], R.meta_question_dicts(["Is the answer correct?"]), problems, completions)
        assert rewards == want["reward"].tolist()
    moved = [n for n, p in policy.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) > len(before) // 2, f"TRL's update moved {len(moved)} of {len(before)} tensors"
