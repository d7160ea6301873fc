"""Plot what the in-run validation and reward-hacking monitor saw in one run (docs/method.md §4.6).

    python scripts/plot_monitor.py runs/learn-monitor-s0 --out docs/monitor_demo.png

Three panels from the run's metrics.jsonl: the training reward per step with the held-out greedy
answers' reward and the canary non-answers' rewards at each evaluation; the share of answers with a
\\boxed{} final answer (training samples per step, held-out greedy answers per evaluation) with
held-out accuracy; the answers' length in characters. Prints the evaluation rows as a table.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run folder with metrics.jsonl (trained with run.eval_every > 0)")
    ap.add_argument("--out", default=None, help="PNG to write (default: <run>/monitor.png)")
    a = ap.parse_args()
    path = os.path.join(a.run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file")
    ms = [json.loads(line) for line in open(path) if line.strip()]
    ev = [m for m in ms if "val/accuracy" in m]
    if not ev:
        raise SystemExit(f"{path}: no validation rows (train with run.eval_every > 0)")
    steps, vsteps = [m["step"] for m in ms], [m["step"] for m in ev]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(steps, [m["reward/mean"] for m in ms], color="0.6", label="training reward (batch mean)")
    ax[0].plot(vsteps, [m["val/reward_mean"] for m in ev], "o-", label="held-out greedy answers")
    for k in sorted(k for k in ev[0] if k.startswith("val/canary/")):
        ax[0].plot(vsteps, [m[k] for m in ev], "x--", label=f"canary: {k.split('/')[-1]}")
    ax[0].set_title("reward (Σ log P(Yes))")
    ax[1].plot(steps, [m["completion/boxed_frac"] for m in ms], color="0.6", label="training samples")
    ax[1].plot(vsteps, [m["val/boxed_frac"] for m in ev], "o-", label="held-out greedy answers")
    ax[1].plot(vsteps, [m["val/accuracy"] for m in ev], "s-", label="held-out accuracy")
    ax[1].set_title("share with a \\boxed{} answer; accuracy")
    ax[1].set_ylim(-0.05, 1.05)
    ax[2].plot(steps, [m["completion/chars_mean"] for m in ms], color="0.6", label="training samples")
    ax[2].plot(vsteps, [m["val/chars_mean"] for m in ev], "o-", label="held-out greedy answers")
    ax[2].set_title("length (characters)")
    for x in ax:
        x.set_xlabel("step")
        x.legend(fontsize=7)
    fig.tight_layout()
    out = a.out or os.path.join(a.run, "monitor.png")
    fig.savefig(out, dpi=110)
    keys = ["step", "val/accuracy", "val/reward_mean", "val/boxed_frac", "val/chars_mean"] + \
        sorted(k for k in ev[0] if k.startswith("val/canary/")) + ["val/seconds"]
    print(" | ".join(k.replace("val/", "") for k in keys))
    for m in ev:
        print(" | ".join(f"{m[k]:.3f}" if isinstance(m[k], float) else str(m[k]) for k in keys))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
