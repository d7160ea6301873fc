"""Did the run learn? Reward and a targeted behaviour per step, for one or several runs.

    python scripts/learning_check.py runs/learn-s0 runs/learn-s1 --out runs/learning_check.png

The behaviours configs/cpu_learn.yaml targets: completion length in tokens (`--behaviour length`,
the default; "Is the solution concise?"), the fraction that finish within max_new_tokens
(`finished`), and the fraction that state a \boxed{} final answer (`boxed`: the format the prompt
asks for, which the evaluator prompt shows as "Final answer extracted from the solution");
`equals` ('=' signs) and `answer` (says "answer") measure the earlier presets' questions (docs/learning-runs.md). Prints, per run, the mean of the first and the last
`--window` steps with the standard error of each window's mean (step-to-step noise: sd of the
window's step means / sqrt(window)), and plots both quantities per step (thin: raw, thick: EMA 0.9
as in the paper's curves).

Per-step training numbers mix the policy's progress with which P problems the step drew. The
held-out check takes the problem draw out: `--heldout N` samples `--samples` completions for each
of the first N GSM8K test problems from the initial policy and from the run's latest checkpoint
(same seeds, the run's prompt template and sampling settings) and scores both with the run's
evaluators and meta-questions (a frozen_self evaluator is the initial policy for both):

    python scripts/learning_check.py runs/cpu-learn --heldout 32 --samples 4

It prints, for both models, the mean reward, P(Yes) per meta-question, length and fraction
finished, and the per-problem paired difference (checkpoint - initial) as mean ± standard error
over the N problems.
"""
import argparse
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluate  # noqa: E402
import fast  # noqa: E402
from evaluate import ema
from plumbing.benchmarks import load_math_problems
from plumbing.config import load_config  # noqa: E402
from plumbing.jsonl import jsonl_rows
from plumbing.models import load_model
from plumbing.prompts import policy_chat
from plumbing.checkpoints import latest_checkpoint
from plumbing.evaluators import load_evaluators


def per_step(records, quantity):
    """{step: mean of quantity(record)} over a run's samples.jsonl records."""
    steps = {}
    for s in records:
        steps.setdefault(s["step"], []).append(quantity(s))
    return {k: sum(v) / len(v) for k, v in sorted(steps.items())}


# behaviour name -> (plot title, function of one samples.jsonl record)
BEHAVIOURS = {
    "answer": ("fraction of solutions saying 'answer'",
               lambda rec: float(bool(re.search(r"(?i)\banswer", rec["completion"])))),
    "equals": ("'=' signs per completion", lambda rec: rec["completion"].count("=")),
    "length": ("completion length (tokens)", lambda rec: rec["length"]),
    "finished": ("fraction finished (EOS within max_new_tokens)", lambda rec: float(not rec["truncated"])),
    "boxed": ("fraction with a \\boxed{} final answer", lambda rec: float(rec["extracted"] is not None)),
}


def window(xs):
    """'mean ± standard error' of a list of per-step means."""
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5
    return f"{m:.3f} ± {sd / len(xs) ** 0.5:.3f}"


def heldout(run_dir, n_problems, samples, data):
    """Initial policy vs the run's latest checkpoint on the same held-out problems (see above)."""
    import torch
    import reward as R
    import rollout
    import train
    cfg = load_config([os.path.join(run_dir, "config.yaml")])
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"{run_dir}: no checkpoint to compare with the initial policy")
    ro, rw = cfg["rollout"], cfg["reward"]
    data = os.path.normpath(data)
    problems = load_math_problems(data, n_problems)
    per_model = {}
    for name, path in (("initial", cfg["model"]["policy"]), (os.path.basename(ckpt), ckpt)):
        model, tok = load_model(path, cfg["model"]["dtype"], "cpu")
        chat = policy_chat(tok, cfg["model"])
        prompts = [rollout.build_prompt_ids(tok, cfg["data"]["prompt_template"].format(question=p["question"]), chat)
                   for p in problems]
        out = fast.generate(model, tok, prompts, group_size=samples, max_new_tokens=ro["max_new_tokens"],
                               temperature=ro["temperature"], top_p=ro["top_p"], top_k=ro["top_k"],
                               seed=cfg["run"]["seed"], micro_batch_size=16)
        evaluators = load_evaluators(cfg, model, tok, "cpu", train.fast_or_plain(True))
        r = R.rlme_reward(evaluators, rw["meta_questions"], [p["question"] for p in problems for _ in range(samples)],
                          out["completions"])
        per_model[name] = {"reward": r["reward"].view(-1, samples),                  # [N, samples]
                           "p_yes": r["logp"].exp().mean(1).view(-1, samples, r["logp"].shape[-1]),
                           "length": out["completion_mask"].sum(-1).view(-1, samples),
                           "finished": (~out["truncated"]).float().view(-1, samples),
                           "boxed": torch.tensor([float(R.extract_boxed(c) is not None) for c in out["completions"]]
                                                 ).view(-1, samples)}
    names = list(per_model)
    print(f"held-out: first {n_problems} problems of {data}, {samples} samples each")
    rows = [("reward", lambda m: m["reward"])]
    rows += [(f"P(Yes) {q['question']}", lambda m, k=k: m["p_yes"][..., k]) for k, q in enumerate(rw["meta_questions"])]
    rows += [("length (tokens)", lambda m: m["length"].float()), ("finished", lambda m: m["finished"]),
             ("boxed final answer", lambda m: m["boxed"])]
    print(f"{'':45s} {names[0]:>10s} {names[1]:>12s}   paired difference (mean ± s.e. over problems)")
    for label, get in rows:
        a, b = get(per_model[names[0]]).mean(1), get(per_model[names[1]]).mean(1)  # per-problem means [N]
        d = b - a
        print(f"{label:45s} {a.mean():10.3f} {b.mean():12.3f}   {d.mean():+.3f} ± {d.std() / len(d) ** 0.5:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--behaviour", nargs="+", choices=sorted(BEHAVIOURS), default=["length", "boxed"])
    ap.add_argument("--out", default="learning_check.png")
    ap.add_argument("--heldout", type=int, default=0, help="held-out check on the first N test problems (0 = off)")
    ap.add_argument("--samples", type=int, default=4, help="completions per held-out problem")
    ap.add_argument("--data", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                   "..", "shared", "data", "gsm8k", "test.jsonl"))
    a = ap.parse_args()
    if a.heldout:
        for run in a.runs:
            heldout(run, a.heldout, a.samples, a.data)
        return
    names = ["reward"] + a.behaviour
    titles = ["reward (sum of log P(Yes))"] + [BEHAVIOURS[b][0] for b in a.behaviour]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.5), squeeze=False)
    print(f"{'run':24s} {'quantity':10s} {'steps':>5s} {'first':>15s} {'last':>15s}   "
          f"(mean ± s.e. of the first / last {a.window} step means)")
    for run in a.runs:
        records = jsonl_rows(os.path.join(run, "samples.jsonl"))
        series = [per_step(records, lambda rec: rec["reward"])] + [per_step(records, BEHAVIOURS[b][1]) for b in a.behaviour]
        steps = list(series[0])
        w = max(1, min(a.window, len(steps) // 2))
        for name, ax, data in zip(names, axes[0], series):
            ys = [data[s] for s in steps]
            print(f"{run:24s} {name:10s} {len(steps):5d} {window(ys[:w]):>15s} {window(ys[-w:]):>15s}")
            line, = ax.plot(steps, ys, alpha=0.3)
            ax.plot(steps, ema(ys), color=line.get_color(), label=os.path.basename(run.rstrip("/")))
    for ax, title in zip(axes[0], titles):
        ax.set(title=title, xlabel="step")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
