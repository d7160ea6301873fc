"""Issue 35: the papers' experiments as the release and the papers ran them. In-run validation on
the whole held-out file with a step-0 point (nlhf.val_size 0, run.eval_at_start: the RM-NLHF
release's val_before_train on its whole validation file), `evaluate.py pairwise` over the whole
benchmark by default. Expected numbers are worked out by hand in the comments."""
import json
import os

import pytest

from conftest import data_path
import train as T
from plumbing.config import load_config
from plumbing.pairwise import load_nlhf_val_items


def cfg_with(*overrides):
    # config.yaml's defaults roll out with vLLM (the GPU node's); these tiny-model runs use our decode
    return load_config([], ["rollout.backend=hf", *overrides])


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pairs_file(tmp_path, n):
    return write_jsonl(tmp_path / "val.jsonl", [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"}
                                                 for i in range(n)])


# ---- RM-NLHF validation: the whole file by default, a subset one key away ---------------------------

def test_nlhf_validation_scores_the_whole_file_by_default(tmp_path):
    """config.yaml's nlhf.val_size is 0 = every pair of nlhf.val (the release validates on its whole
    file); 3 = a seeded subset of 3 of the 7; a holdout still needs a count (0 pairs of D_H is no set)."""
    f = pairs_file(tmp_path, 7)
    base = ("task=rm_nlhf", "run.eval_every=5", f"nlhf.val={f}")
    cfg = cfg_with(*base)
    assert cfg["nlhf"]["val_size"] == 0
    val, dh = load_nlhf_val_items(cfg, ["dh"])
    assert sorted(it["context"] for it in val) == [f"question {i}" for i in range(7)] and dh == ["dh"]
    val3, _ = load_nlhf_val_items(cfg_with(*base, "nlhf.val_size=3"), ["dh"])
    assert len(val3) == 3 and {it["id"] for it in val3} <= {it["id"] for it in val}
    with pytest.raises(SystemExit, match="config key nlhf.val_size: must be >= 1, got 0"):
        cfg_with("task=rm_nlhf", "run.eval_every=5", "nlhf.val=holdout")


def test_paper_presets_validate_the_whole_file_before_training():
    """The RM-NLHF paper preset (and every preset layered on it) validates on all of HelpSteer3's
    validation split, also at step 0, as the release (data.val_files = the whole file,
    trainer.val_before_train=True, trainer.test_freq=20)."""
    from conftest import REPO
    cfg = load_config([os.path.join(REPO, "configs", "paper", "rm_nlhf_qwen7b.yaml")])
    assert (cfg["nlhf"]["val"], cfg["nlhf"]["val_split"], cfg["nlhf"]["val_size"]) == ("nvidia/HelpSteer3", "validation", 0)
    assert cfg["run"]["eval_at_start"] is True and cfg["run"]["eval_every"] == 20


# ---- run.eval_at_start: a step-0 point, counted by the monitor and the early-stop rule ---------------

def run_args(tmp_path, model, *extra):
    return [f"model.policy={model}", f"run.out_dir={tmp_path / 'run'}", f"data.train={data_path('gsm8k', 'train.jsonl')}",
            "run.total_steps=2", "run.save_every=0", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "train.device=cpu", "train.parallel=ddp", "model.dtype=float32", "rollout.backend=hf",
            f"data.val={data_path('gsm8k', 'test.jsonl')}", "data.val_size=3", "run.eval_every=1", *extra]


def test_step_zero_validation_line_and_early_stop_counts_it(tmp_path, tiny_model_path, monkeypatch, capsys):
    """Scripted held-out accuracies 0.9 (step 0, the initial policy), 0.5 (step 1), 0.2 (step 2) with
    early stop drop 0.25, patience 2. With the step-0 point the best is 0.9: 0.5 and 0.2 are both more
    than 0.25 below it (0.65), so the run stops early at step 2 (best step 0). Without it (the old run)
    the best is 0.5 at step 1 and only 0.2 is below 0.25: no stop. metrics.jsonl: a line
    {"step": 0, "val/accuracy": 0.9} alone (no training keys), then steps 1 and 2."""
    seen = []

    def scripted(accs):
        it = iter(accs)

        def step(state, cfg, s, records, reward_step):
            seen.append(s)
            return {"step": s, "val/accuracy": next(it)}
        return step
    args = run_args(tmp_path, tiny_model_path, "run.early_stop_drop=0.25", "run.early_stop_patience=2")
    from plumbing import validation
    monkeypatch.setattr(validation, "validation_step", scripted([0.9, 0.5, 0.2]))  # validate_at_start's
    monkeypatch.setattr(T, "validation_step", scripted([0.5, 0.2]))          # the loop's
    T.main(args + ["run.eval_at_start=true"])
    out = tmp_path / "run"
    lines = read_jsonl(out / "metrics.jsonl")
    assert seen == [0, 1, 2] and [m["step"] for m in lines] == [0, 1, 2]
    assert lines[0] == {"step": 0, "val/accuracy": 0.9}
    info = json.load(open(out / "early_stop.json"))
    assert (info["step"], info["best_accuracy"], info["best_step"]) == (2, 0.9, 0)
    said = capsys.readouterr()
    assert "[train] step 0, before training: held-out accuracy 0.9000" in said.out + said.err

    # the same run without the step-0 point: no early stop, no step-0 line
    other = tmp_path / "other"
    monkeypatch.setattr(T, "validation_step", scripted([0.5, 0.2]))
    T.main(args + [f"run.out_dir={other}"])
    assert [m["step"] for m in read_jsonl(other / "metrics.jsonl")] == [1, 2]
    assert not (other / "early_stop.json").exists()


# ---- the judge presets can finish a thinking answer --------------------------------------------------

def test_qwen3_judge_presets_sample_as_its_card_and_send_no_token_cap():
    """configs/rm_nlhf.yaml's judge is Qwen3-32B, which thinks before its answer: the request sends
    temperature 0.6 (Qwen3's card, thinking mode; config.yaml's 0 is greedy, which the card rules out)
    and no max_tokens (config.yaml's 512 ended most answers inside the thinking, before the score
    tags), with a 300 s timeout for a long answer. The paper preset sends neither field (the release's
    request), so the server's generation config (the card's) applies."""
    from conftest import REPO
    from plumbing.judge import judge_request_fields
    one_node = load_config([os.path.join(REPO, "configs", "rm_nlhf.yaml")])["judge"]
    assert one_node["model"] == "Qwen/Qwen3-32B"
    assert judge_request_fields(one_node) == {"temperature": 0.6} and one_node["timeout_s"] >= 300
    paper = load_config([os.path.join(REPO, "configs", "paper", "rm_nlhf_qwen7b.yaml")])["judge"]
    assert judge_request_fields(paper) == {} and paper["timeout_s"] >= 300


# ---- the authors' released data (Tongyi-ConvAI/RM-NLHF) in its own schema ----------------------------

def test_the_authors_released_data_schema_loads_as_dh_and_do():
    """tests/fixtures/rm_nlhf_sample.jsonl, 4 rows in the released schema: 2 HelpSteer3 rows with human
    feedback (dataset_type DataWithHumanCritique, processed_critique per response) and 2 Tulu-IF rows
    without. Detected as schema rm_nlhf; with the paper preset and nlhf.dh = the file, D_H is the 2
    critiqued rows, their critique the four per-response lines; the others load as D_O rows (no critique)."""
    from conftest import REPO
    from plumbing.pairwise import load_nlhf_items, load_pairwise
    fixture = os.path.join(REPO, "tests", "fixtures", "rm_nlhf_sample.jsonl")
    stats = {}
    items = load_pairwise(fixture, seed=0, stats=stats)
    assert stats["schema"] == ["rm_nlhf"] and len(items) == 4
    assert [it["meta"]["dataset_type"] for it in items] == ["DataWithHumanCritique"] * 2 + \
        ["Tulu-3-Pref-Personas-Instruction-Following"] * 2
    assert [it["critique"] is not None for it in items] == [True, True, False, False]
    first = items[0]
    good = "A" if first["response_a"] == "100 degrees Celsius." else "B"
    assert first["winner"] == good  # the winner follows its response through the A/B coin
    assert first["critique"] == (f"Response A strengths: {'Response A gives the correct value.' if good == 'A' else 'Response A is concise.'}\n"
                                 f"Response A weaknesses: {'none noted' if good == 'A' else 'Response A states a wrong temperature.'}\n"
                                 f"Response B strengths: {'Response B is concise.' if good == 'A' else 'Response B gives the correct value.'}\n"
                                 f"Response B weaknesses: {'Response B states a wrong temperature.' if good == 'A' else 'none noted'}")
    assert items[1]["meta"]["turns"][-1] == {"role": "user", "content": "Make it three lines."}
    cfg = load_config([os.path.join(REPO, "configs", "paper", "rm_nlhf_qwen7b.yaml")],
                      [f"nlhf.dh={fixture}", "nlhf.do=null", "metarm.mode=none"])
    dh, do, _ = load_nlhf_items(cfg)
    assert sorted(it["id"] for it in dh) == sorted(it["id"] for it in items[:2]) and do == []


def test_nocheat_runs_to_the_notes_cheating_test():
    """NoCheat's cheating test is at ~150-160 steps in the secondary notes: the preset runs 160 steps
    (was config.yaml's 116) with validation every 10, so at 150 and 160, and at step 0. 160 x 64 =
    10,240 prompts = 1.37 passes over GSM8K train's 7,473: data.epochs 2 lets it start (1 pass would stop it
    at start-up, naming 116 = 7,473 // 64)."""
    from conftest import REPO
    from plumbing import config
    cfg = load_config([os.path.join(REPO, "configs", "paper", "rlme", "nocheat.yaml")])
    r = cfg["run"]
    assert (r["total_steps"], r["eval_every"], r["eval_at_start"], cfg["data"]["epochs"]) == (160, 10, True, 2)
    assert {150, 160} <= set(range(r["eval_every"], r["total_steps"] + 1, r["eval_every"]))
    config.check_single_pass(cfg, 7473)  # 10,240 <= 2 x 7,473 = 14,946
    one_pass = load_config([os.path.join(REPO, "configs", "paper", "rlme", "nocheat.yaml")], ["data.epochs=1"])
    with pytest.raises(SystemExit, match="160 x 64 = 10240 prompts.*lower run.total_steps to 116"):
        config.check_single_pass(one_pass, 7473)


# ---- evaluate.py pairwise: the whole benchmark by default, a subset one flag away --------------------

def test_pairwise_scores_the_whole_benchmark_by_default(tmp_path, monkeypatch):
    """A 60-pair file, a fake GRM that always names the chosen response: by default all 60 pairs
    are scored in both orders (120 judgements; the old default scored a 50-pair subset); --n 7 draws
    a seeded subset of 7."""
    from plumbing import cli, eval_commands
    (tmp_path / "bench").mkdir()
    f = write_jsonl(tmp_path / "bench" / "b.jsonl",
                    [{"prompt": f"q{i}", "chosen": f"good{i}", "rejected": f"bad{i}"} for i in range(60)])
    calls = []

    def judge(queries):
        calls.append(len(queries))
        return [{"choice": "A" if a.startswith("good") else "B", "valid": True, "why": None, "critique": "c"}
                for _, a, b, _turns in queries]
    monkeypatch.setattr(eval_commands, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(eval_commands, "chat_format", lambda tok, chat: False)
    monkeypatch.setattr(eval_commands, "make_grm_judge", lambda model, tok, **kw: judge)
    assert cli.build_parser().parse_args(["pairwise", "--model", "m"]).n == 0
    r = cli.evaluate_main(["pairwise", "--model", "fake", f, "--out", str(tmp_path / "all")])
    assert r["files"][0]["n"] == 60 and r["files"][0]["acc"] == 1.0 and sum(calls) == 120 and r["n_per_file"] == 0
    r = cli.evaluate_main(["pairwise", "--model", "fake", f, "--n", "7", "--out", str(tmp_path / "sub")])
    assert r["files"][0]["n"] == 7
