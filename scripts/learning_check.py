"""Did the run learn? Reward and a targeted behaviour per step, for one or several runs.

    python scripts/learning_check.py runs/learn-s0 runs/learn-s1 --out runs/learning_check.png

The behaviour of configs/cpu_learn.yaml is "shows its calculations as equations", measured from
samples.jsonl as the mean number of '=' signs per completion (`--behaviour equals`, the default);
`--behaviour answer` is the fraction of completions that say "answer" (the second screened question). Prints, per run, the mean
of the first and the last `--window` steps, and plots both quantities per step (thin: raw, thick:
EMA 0.9 as in the paper's curves).
"""
import argparse
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def per_step(run_dir, behaviour):
    """{step: (reward mean, behaviour mean)} from a run's samples.jsonl."""
    steps = {}
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        for line in f:
            s = json.loads(line)
            steps.setdefault(s["step"], []).append((s["reward"], behaviour(s)))
    return {k: (sum(r for r, _ in v) / len(v), sum(b for _, b in v) / len(v)) for k, v in sorted(steps.items())}


# behaviour name -> (plot title, function of one samples.jsonl record)
BEHAVIOURS = {
    "answer": ("fraction of solutions saying 'answer'",
               lambda rec: float(bool(re.search(r"(?i)\banswer", rec["completion"])))),
    "equals": ("'=' signs per completion", lambda rec: rec["completion"].count("=")),
    "length": ("completion length (tokens)", lambda rec: rec["length"]),
    "finished": ("fraction finished (EOS within max_new_tokens)", lambda rec: float(not rec["truncated"])),
}


def ema(xs, alpha=0.9):
    out = []
    for x in xs:
        out.append(x if not out else alpha * out[-1] + (1 - alpha) * x)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--behaviour", choices=sorted(BEHAVIOURS), default="equals")
    ap.add_argument("--out", default="learning_check.png")
    a = ap.parse_args()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    title, behaviour = BEHAVIOURS[a.behaviour]
    print(f"{'run':24s} {'reward first':>12s} {'reward last':>12s} {'beh. first':>10s} {'beh. last':>10s}")
    for run in a.runs:
        data = per_step(run, behaviour)
        steps = list(data)
        reward = [data[s][0] for s in steps]
        eq = [data[s][1] for s in steps]
        w = a.window
        print(f"{run:24s} {sum(reward[:w]) / w:12.3f} {sum(reward[-w:]) / w:12.3f} "
              f"{sum(eq[:w]) / w:10.3f} {sum(eq[-w:]) / w:10.3f}")
        for ax, ys in zip(axes, (reward, eq)):
            line, = ax.plot(steps, ys, alpha=0.3)
            ax.plot(steps, ema(ys), color=line.get_color(), label=os.path.basename(run.rstrip("/")))
    axes[0].set(title="reward (sum of log P(Yes))", xlabel="step")
    axes[1].set(title=title, xlabel="step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
