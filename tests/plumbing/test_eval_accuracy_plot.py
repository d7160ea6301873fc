"""Issue 25 items 9, 11, 12 (part), issue 35 item 1: what `evaluate.py plot` draws (raw values, a
bias-corrected EMA (ours; --ema-start first seeds it), a ±1 std band only across runs as RLME Fig. 2
draws it (--band se: the standard error), a sensible y-range), `boxed_frac` counting only
non-empty boxes, accuracy in evaluation and validation accepting what math-verify accepts while
the RLVR reward keeps its rule, and where `evaluate.py` writes and what it says before a long
run. Expected numbers are worked out by hand in the comments."""
import contextlib
import functools
import json
import os
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import evaluate  # noqa: E402
import reward as R  # noqa: E402
import train as T  # noqa: E402
from conftest import REPO, data_path, reward_kwargs  # noqa: E402
from plumbing import cli, eval_commands, plots  # noqa: E402
from plumbing.config import load_config  # noqa: E402
from plumbing.models import load_model  # noqa: E402
from plumbing.engine import hf_backend  # noqa: E402
from plumbing.metrics import rlme_step_metrics  # noqa: E402
from plumbing.validation import validation_step  # noqa: E402


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def artists(ax):
    """{gid: artist} of an Axes' lines and collections (draw_curve names them <label>/raw|band|ema)."""
    return {a.get_gid(): a for a in list(ax.lines) + list(ax.collections) if a.get_gid()}


# ---- the EMA: bias-corrected (Adam's debiasing), not seeded with the first point ----------------

def test_ema_is_bias_corrected_hand_numbers():
    # alpha 0.9, v = 1, 0, 0, 10: m = 0.1, 0.09, 0.081, 0.0729 + 1 = 1.0729; divided by 1 - 0.9^t =
    # 0.1, 0.19, 0.271, 0.3439 -> 1, 0.473684, 0.298893, 3.119802 (= (0.729*1 + 10) / 3.439, the
    # 0.9^(t-i)-weighted mean). The seeded EMA (e_1 = v_1) gave 1, 0.9, 0.81, 1.729.
    assert evaluate.ema([1.0, 0.0, 0.0, 10.0], 0.9) == pytest.approx([1.0, 0.09 / 0.19, 0.081 / 0.271, 1.0729 / 0.3439])
    assert evaluate.ema([4.0, 2.0], 0.5) == pytest.approx([4.0, (0.5 * 4 + 2) / 1.5])  # 4, 2.6667
    assert evaluate.ema([3.0, -1.0], 0.0) == [3.0, -1.0]  # alpha 0: the raw values
    assert evaluate.ema([], 0.9) == []
    assert plots.ema is evaluate.ema  # the plot's EMA (plumbing/plots.py curve) is this one


def test_standard_error_none_for_one_value():
    assert evaluate.standard_error([0.0, 2.0]) == pytest.approx(1.0)  # sample std sqrt(2), / sqrt(2)
    assert evaluate.standard_error([1.0, 2.0, 3.0]) == pytest.approx(1 / 3 ** 0.5)  # std 1 / sqrt(3)
    assert evaluate.standard_error([5.0]) is None


# ---- what the plot draws, read back from the Axes --------------------------------------------------

@pytest.fixture
def two_settings(tmp_path):
    """'pair': runs a (steps 0-2: 0, 1, 5) and b (steps 0-1: 2, 3); 'solo': run a alone."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"step": 0, "r": 0.0}, {"step": 1, "r": 1.0}, {"step": 2, "r": 5.0}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"step": 0, "r": 2.0}, {"step": 1, "r": 3.0}])
    return {"pair": {"r": plots.curve([a, b], "r", 0.5)}, "solo": {"r": plots.curve([a], "r", 0.5)}}


def test_curve_raw_ema_and_standard_error(two_settings):
    # EMA 0.5 of a: 0, 0.5/0.75 = 2/3, (0.25 + 2.5)/0.875 = 22/7; of b: 2, (0.5 + 1.5)/0.75 = 8/3.
    # Steps shared: 0, 1. Raw mean (0+2)/2 = 1, (1+3)/2 = 2; EMA mean 1, (2/3 + 8/3)/2 = 5/3;
    # sample std of {0, 2} and of {2/3, 8/3}: sqrt(2) at both steps; s.e. sqrt(2) / sqrt(2) = 1.
    pair, solo = two_settings["pair"]["r"], two_settings["solo"]["r"]
    assert pair["x"] == [0, 1] and pair["runs"] == 2
    assert pair["raw"] == pytest.approx([1.0, 2.0]) and pair["ema"] == pytest.approx([1.0, 5 / 3])
    assert pair["std"] == pytest.approx([2 ** 0.5, 2 ** 0.5]) and pair["se"] == pytest.approx([1.0, 1.0])
    assert solo == {"x": [0, 1, 2], "raw": [0.0, 1.0, 5.0], "ema": pytest.approx([0.0, 2 / 3, 22 / 7]),
                    "std": None, "se": None, "runs": 1}


@pytest.fixture
def three_runs(tmp_path):
    """Three hand-made runs of one setting, steps 1-2: a = 0, 3; b = 3, 0; c = 6, 6."""
    return [write_jsonl(tmp_path / f"{n}.jsonl", [{"step": 1, "r": v1}, {"step": 2, "r": v2}])
            for n, (v1, v2) in zip("abc", [(0.0, 3.0), (3.0, 0.0), (6.0, 6.0)])]


def test_band_is_plus_minus_one_std_across_runs_as_rlme_fig2(three_runs):
    """RLME §4.1, Fig. 2: "across 6 trials with ±1 std shown by the shaded region". Debiased EMA 0.5:
    a: 0, (0.5*0 + 0.5*3) / 0.75 = 2; b: 3, (0.75 + 0) / 0.75 = 1; c: 6, 6. Step 1: {0, 3, 6}, mean 3,
    sample std sqrt((9 + 0 + 9) / 2) = 3; step 2: {2, 1, 6}, mean 3, std sqrt((1 + 4 + 9) / 2) = sqrt(7).
    The band is EMA mean -/+ std: [0, 6] and [3 - sqrt(7), 3 + sqrt(7)] (the standard error, the old
    band, is std / sqrt(3): sqrt(3) and sqrt(7/3), 1.73x narrower)."""
    c = plots.curve(three_runs, "r", 0.5)
    assert c["ema"] == pytest.approx([3.0, 3.0])
    assert c["std"] == pytest.approx([3.0, 7 ** 0.5]) and c["se"] == pytest.approx([3 ** 0.5, (7 / 3) ** 0.5])
    for band, half in (("std", [3.0, 7 ** 0.5]), ("se", [3 ** 0.5, (7 / 3) ** 0.5])):
        fig = plots.curves_figure({"rlme": {"r": c}}, ["r"], 0.5, min_span=0.1, band=band)
        try:
            verts = artists(fig.axes[0])["rlme/band"].get_paths()[0].vertices
            for x, h in zip((1, 2), half):
                ys = verts[verts[:, 0] == x][:, 1]
                assert min(ys) == pytest.approx(3.0 - h) and max(ys) == pytest.approx(3.0 + h)
            assert fig._suptitle.get_text().endswith(f"band: ±1 {'std' if band == 'std' else 's.e.'} across runs (2+ runs)")
        finally:
            plt.close(fig)


def test_ema_start_is_ours_and_one_flag_away(three_runs, tmp_path):
    """The default EMA is bias-corrected (ours: the paper says only "EMA with decay 0.9"); --ema-start
    first seeds it with the first point: a: 0, 0.5*0 + 0.5*3 = 1.5; b: 3, 1.5; c: 6, 6 -> step 2 mean
    3, std sqrt((2.25 + 2.25 + 9) / 2) = sqrt(6.75)."""
    assert plots.seeded_ema([0.0, 3.0, 1.0], 0.5) == [0.0, 1.5, 1.25]
    c = plots.curve(three_runs, "r", 0.5, ema_start="first")
    assert c["ema"] == pytest.approx([3.0, 3.0]) and c["std"] == pytest.approx([3.0, 6.75 ** 0.5])
    assert plots.plot_note(0.9) == "faint: raw per step; line: EMA 0.9 (bias-corrected, ours); band: ±1 std across runs (2+ runs)"
    glob_spec = "fig2=" + str(tmp_path / "*.jsonl")  # a quoted wildcard: the runs it matches, sorted
    assert plots.parse_curve(glob_spec) == ("fig2", sorted(three_runs))
    rows = cli.evaluate_main(["plot", glob_spec, "--keys", "r", "--ema", "0.5", "--ema-start", "first",
                              "--band", "se", "--reward-key", "r", "--acc-key", "r", "--out", str(tmp_path / "plots")])
    assert rows[0]["runs"] == 3 and rows[0]["last_std"] == pytest.approx(6.75 ** 0.5)
    assert rows[0]["last_se"] == pytest.approx((6.75 / 3) ** 0.5)
    res = json.load(open(tmp_path / "plots" / "plot.json"))
    assert res["band"] == "se" and res["ema_rule"] == "seeded with the first point (ours)"


def test_plot_draws_raw_behind_the_ema_and_a_band_only_across_runs(two_settings):
    fig = plots.curves_figure(two_settings, ["r"], 0.5, min_span=0.1, band="se")
    try:
        ax = fig.axes[0]
        got = artists(ax)
        assert set(got) == {"pair/raw", "pair/band", "pair/ema", "solo/raw", "solo/ema"}  # no band for one run
        assert got["solo/raw"].get_xydata().tolist() == [[0, 0.0], [1, 1.0], [2, 5.0]]
        assert got["solo/ema"].get_xydata()[:, 1] == pytest.approx([0.0, 2 / 3, 22 / 7])
        assert got["pair/raw"].get_xydata().tolist() == [[0, 1.0], [1, 2.0]]
        assert got["pair/ema"].get_xydata()[:, 1] == pytest.approx([1.0, 5 / 3])
        # the band (--band se): EMA mean -/+ 1 s.e. = [0, 2] at step 0, [2/3, 8/3] at step 1
        verts = got["pair/band"].get_paths()[0].vertices
        for x, lo, hi in ((0, 0.0, 2.0), (1, 2 / 3, 8 / 3)):
            ys = verts[verts[:, 0] == x][:, 1]
            assert min(ys) == pytest.approx(lo) and max(ys) == pytest.approx(hi)
        # raw behind: faint and below the EMA in drawing order; the EMA is the legend's entry
        assert got["solo/raw"].get_alpha() < 1 and got["solo/raw"].get_zorder() <= got["solo/ema"].get_zorder()
        assert ax.lines.index(got["solo/raw"]) < ax.lines.index(got["solo/ema"])
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["pair (n=2)", "solo (n=1)"]
        # y-range: every raw value (0..5) with a 5% margin: (-0.25, 5.25)
        assert ax.get_ylim() == pytest.approx((-0.25, 5.25))
    finally:
        plt.close(fig)


def test_plot_y_range_is_never_a_zoom_into_noise(tmp_path):
    # 0.70, 0.72, 0.71 nats: the data span 0.02 (+5% margins = 0.022) is below --min-y-span 0.1,
    # so the axis is 0.1 tall around the middle 0.71: (0.66, 0.76). Autoscale would show ~0.021.
    f = write_jsonl(tmp_path / "m.jsonl", [{"step": s, "r": v} for s, v in enumerate([0.70, 0.72, 0.71])])
    c = {"run": {"r": plots.curve([f], "r", 0.9)}}
    fig = plots.curves_figure(c, ["r"], 0.9, min_span=0.1)
    try:
        assert fig.axes[0].get_ylim() == pytest.approx((0.66, 0.76))
    finally:
        plt.close(fig)
    # reward vs accuracy, --min-y-span 0.5: both axes (0.46, 0.96); the accuracy curve dashed
    fig = plots.reward_accuracy_figure({"run": c["run"]["r"]}, {"run": c["run"]["r"]}, "r", "acc", 0.9, 0.5)
    try:
        left, right = fig.axes
        assert left.get_ylim() == pytest.approx((0.46, 0.96)) and right.get_ylim() == pytest.approx((0.46, 0.96))
        assert set(artists(left)) == {"run r/raw", "run r/ema"} and set(artists(right)) == {"run acc/raw", "run acc/ema"}
        assert artists(right)["run acc/ema"].get_linestyle() == "--"
    finally:
        plt.close(fig)


def test_cli_plot_writes_the_curves_and_refuses_a_bad_ema(tmp_path, capsys):
    f = write_jsonl(tmp_path / "run.jsonl", [{"step": s, "reward/mean": -2 + s / 10, "accuracy": 0.3} for s in range(5)])
    rows = cli.evaluate_main(["plot", f"solo={f}", "--out", str(tmp_path / "plots")])
    res = json.load(open(tmp_path / "plots" / "plot.json"))
    assert res["ema_rule"].startswith("bias-corrected") and {r["last_se"] for r in rows} == {None}
    assert res["band"] == "std" and {r["last_std"] for r in rows} == {None}
    assert res["curves"]["solo"]["reward/mean"]["raw"] == pytest.approx([-2, -1.9, -1.8, -1.7, -1.6])
    assert (tmp_path / "plots" / "curves.png").stat().st_size > 5000
    assert "last_se" in capsys.readouterr().out
    for bad in ("1", "-0.1"):
        with pytest.raises(SystemExit, match=r"--ema .*: must be in \[0, 1\)"):
            cli.evaluate_main(["plot", f, "--ema", bad, "--out", str(tmp_path)])


# ---- boxed_frac: an empty \boxed{} is not an answer -------------------------------------------------

def test_boxed_frac_counts_only_non_empty_boxes():
    texts = ["\\boxed{}", "so \\boxed{18}", "no box at all", "\\boxed{ }", "\\boxed 7"]
    records = [{"rlvr_reward": 0.0, "extracted": R.extract_boxed(t)} for t in texts]
    assert [r["extracted"] for r in records] == ["", "18", None, "", "7"]  # the extraction itself is unchanged
    assert rlme_step_metrics(records, cfg={})["completion/boxed_frac"] == pytest.approx(2 / 5)


# ---- accuracy: numbers, then math-verify; the RLVR reward keeps its rule ----------------------------

# (boxed answer, label): right answers the numeric comparison alone rejects (issue 25 item 12)
LENIENT = [("18 \\text{ apples}", "18"), ("x = 18", "18"), ("\u221218", "-18"), ("\\frac12", "0.5"),
           ("18 \\mbox{ cm}", "18")]
WRONG = [("17", "18"), ("x = 17", "18"), ("18 \\text{ apples and } 3", "18"), ("\\frac13", "0.5"), ("", "18")]


@pytest.mark.parametrize("pred, label", LENIENT)
def test_evaluation_accepts_what_math_verify_accepts_the_rlvr_reward_does_not(pred, label):
    completion = f"Reasoning ... so the answer is \\boxed{{{pred}}}."
    assert evaluate.grade({"kind": "gsm8k", "label": label}, completion) == (pred, True)
    assert evaluate.numeric_correct(pred, label)
    assert R.rlvr_reward(completion, label) == 0.0  # the RLVR reward's rule, unchanged
    assert R.answer_reward(completion, label, "gsm8k") == 0.0 and R.answer_reward(completion, label, "plain") == 0.0


@pytest.mark.parametrize("pred, label", WRONG)
def test_evaluation_still_rejects_wrong_answers(pred, label):
    assert evaluate.grade({"kind": "gsm8k", "label": label}, f"\\boxed{{{pred}}}")[1] is False
    assert not evaluate.numeric_correct(pred, label) and not evaluate.numeric_correct(None, label)


def test_validation_accuracy_uses_the_evaluation_grade(tiny_model_path):
    """validation_step on 7 held-out problems with scripted greedy answers (the generation is
    fake, the grading and the reward are the real ones): the 5 LENIENT answers, one plain right
    answer and one wrong one -> val/accuracy 6/7 (the RLVR rule said 1/7), val/reward_mean (RLVR)
    1/7; boxes: all 7 hold a non-empty one, then an empty box replaces the wrong answer."""
    model, tok = load_model(tiny_model_path)
    answers = [p for p, _ in LENIENT] + ["18", "17"]
    labels = [lab for _, lab in LENIENT] + ["18", "18"]
    val = [{"index": i, "question": f"Question {i}?", "problem": f"Question {i}?", "label": lab, "answer_text": lab,
            "anchored": False, "context": None} for i, lab in enumerate(labels)]
    cfg = load_config([], ["reward.kind=rlvr", "train.device=cpu", "rollout.backend=hf"])  # the HF backend below

    def run(completions):
        def generate(policy, tok_, prompts, group_size, **kw):  # the scripted greedy answers, in item order
            assert group_size == 1 and len(prompts) == len(completions)
            return {"completions": completions}
        state = {"rank": 0, "world": 1, "tokenizer": tok, "val_items": val, "chat": False, "policy": model,
                 "model": model, "rollout": hf_backend(model, model, tok, generate=generate, context=contextlib.nullcontext)}
        step = functools.partial(T.rlme_reward_step, **reward_kwargs(cfg, evaluators=[],
                                                                     context=contextlib.nullcontext, world=1))
        return validation_step(state, cfg, 2, [], step), step(val, completions)
    out, rew = run([f"so \\boxed{{{a}}}" for a in answers])
    assert [r["correct"] for r in rew["records"]] == [False] * 5 + [True, False]  # the RLVR rule, unchanged
    assert out["val/accuracy"] == pytest.approx(6 / 7) and out["val/reward_mean"] == pytest.approx(1 / 7)
    assert out["val/boxed_frac"] == pytest.approx(1.0)
    out, _ = run([f"so \\boxed{{{a}}}" for a in answers[:-1]] + ["so \\boxed{}"])
    assert out["val/accuracy"] == pytest.approx(6 / 7) and out["val/boxed_frac"] == pytest.approx(6 / 7)


# ---- where evaluate.py writes, and what it says before a long generation ----------------------------

@pytest.mark.parametrize("argv", [["math", "--model", "m"], ["qa", "--model", "m"], ["pairwise", "--model", "m"],
                                  ["bon", "--judge", "m"], ["evaluator-check", "--evaluator", "m"], ["plot", "f.jsonl"]])
def test_default_out_is_under_runs_and_ignored_by_git(argv):
    out = cli.build_parser().parse_args(argv).out
    assert out == os.path.join("runs", "eval")
    p = subprocess.run(["git", "check-ignore", "-q", os.path.join(out, "math_gsm8k-test.json")], cwd=REPO)
    assert p.returncode == 0, f"{out} is not ignored by git"


class ModelLoaded(Exception):
    pass


def stop_at_model(*a, **kw):
    raise ModelLoaded


@pytest.mark.parametrize("extra, line", [
    ([], "math: 100 problems x 5 answers x up to 512 new tokens = up to 256,000 tokens to generate"),
    (["--n-problems", "3", "--n-samples", "2", "--no-greedy", "--max-new-tokens", "64"],
     "math: 3 problems x 2 answers x up to 64 new tokens = up to 384 tokens to generate"),
])
def test_math_states_the_work_and_the_flags_before_the_model_loads(monkeypatch, capsys, extra, line):
    monkeypatch.setattr(eval_commands, "load_model", stop_at_model)
    with pytest.raises(ModelLoaded):
        cli.evaluate_main(["math", "--model", "m", "--data", data_path("gsm8k", "test.jsonl"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line)
    assert "on the CPU" in err[0] and "smaller: --n-problems, --n-samples, --max-new-tokens, --no-greedy" in err[0]


def test_qa_and_policy_sampling_state_the_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(eval_commands, "load_model", stop_at_model)
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "context": "c", "answer": "a"} for i in range(4)])
    with pytest.raises(ModelLoaded):
        cli.evaluate_main(["qa", "--model", "m", "--data", qa, "--n-samples", "1"])
    assert capsys.readouterr().err.startswith("qa: 4 problems x 2 answers x up to 512 new tokens = up to 4,096")
    with pytest.raises(ModelLoaded):
        cli.evaluate_main(["bon", "--judge", "j", "--policy", "m", "--data", data_path("gsm8k", "test.jsonl"),
                           "--n-problems", "2", "--ns", "1,4"])
    err = capsys.readouterr().err
    assert err.startswith("bon --policy: 2 problems x 4 answers x up to 512 new tokens = up to 4,096") and "--ns" in err


def test_greedy_no_box_counts_an_empty_box():
    """`\\boxed{}` answers nothing: math_summary and qa_summary count it with the missing boxes
    (issue 25: 4 of command 1's 5 boxed answers were empty, and none counted)."""
    def item(pred, correct=False):
        return {"greedy": {"pred": pred, "correct": correct, "truncated": False, "em": 0.0, "f1": 0.0},
                "samples": []}
    items = [item("18", True), item(""), item(None), item("7")]
    assert evaluate.math_summary(items)["greedy_no_box"] == 2 / 4
    assert evaluate.qa_summary(items)["greedy_no_box"] == 2 / 4
