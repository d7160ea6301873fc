"""`python -m plumbing.cli evaluate plot`: learning curves from metrics.jsonl files (raw values,
EMA, ±1 std across runs as RLME Fig. 2) and reward vs accuracy.

    cmd_plot(a)               curves.png and reward_vs_accuracy.png, plot.json, a printed table
    parse_curve(spec), run_series(rows, key, path)
                              LABEL=a.jsonl,b.jsonl and one metric's (steps, values)
    curve(paths, key, alpha, ema_start)
                              one setting's runs on their shared steps: raw mean, EMA mean, std, s.e.
    seeded_ema, sample_std    the EMA seeded with the first point (EMA_STARTS); the band (BANDS)
    draw_curve, y_limits, plot_note, curves_figure, reward_accuracy_figure
                              the matplotlib figures
"""
import glob
import math
import os

from evaluate import ema, standard_error

from plumbing.eval_commands import print_table, write_results
from plumbing.jsonl import jsonl_rows


def parse_curve(spec):
    """'label=a.jsonl,b.jsonl' or 'a.jsonl' -> (label, [paths]); runs in one spec are averaged. A path
    with a wildcard ('runs/fig2-rlme-s*/metrics.jsonl', quoted so the shell leaves it) stands for the
    files it matches, sorted; one that matches nothing is kept, so its read says which file is missing."""
    label, sep, paths = spec.partition("=")
    if not sep:
        label, paths = os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec, spec
    out = []
    for p in (p for p in paths.split(",") if p):
        matched = sorted(glob.glob(p)) if glob.has_magic(p) else []
        out += matched or [p]
    return label, out


def run_series(rows, key, path):
    """(steps, values) of metric `key` in metrics rows, skipping rows without a finite value.
    x = row['step'] when present, else the row index. Raises SystemExit when the key never appears."""
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r.get("step", i))
            ys.append(float(v))
    if not xs:
        keys = sorted({k for r in rows for k in r})
        raise SystemExit(f"{path}: no numeric values for metric {key!r}; keys found: {keys}")
    return xs, ys


# The EMA's first point, a choice of ours (RLME §4.1 says only "an exponential moving average with
# decay β = 0.9"): "debiased" (default) = evaluate.ema, Adam's bias correction, the β-weighted mean of
# the points so far; "first" = seeded with the first point, e_1 = v_1 (pandas' ewm(adjust=False)).
EMA_STARTS = ("debiased", "first")


# The band across runs: "std" (default) = ±1 sample standard deviation of the per-run EMAs, RLME
# Fig. 2's "±1 std shown by the shaded region"; "se" = ±1 standard error, std / sqrt(n).
BANDS = ("std", "se")


def seeded_ema(values, alpha=0.9):
    """The EMA seeded with the first value: e_1 = v_1, e_t = alpha * e_(t-1) + (1 - alpha) * v_t.
    Args: values: list[float]; alpha: float in [0, 1). Returns: list[float], len(values)."""
    out = []
    for v in values:
        out.append(v if not out else alpha * out[-1] + (1 - alpha) * v)
    return out


def sample_std(xs):
    """Sample standard deviation of `xs` (list of numbers, divided by n - 1); None for fewer than two
    values (one run says nothing about run-to-run spread: no band, not a zero-width one)."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def curve(paths, key, alpha=0.9, ema_start="debiased"):
    """Metric `key` of one setting's runs on the steps they all share (a run that stopped early
    shortens the curve). Each run is smoothed on its own (evaluate.ema, or seeded_ema with
    ema_start "first"), then the runs are averaged.

    Args: paths: list of metrics.jsonl files, runs of one setting; key: str; alpha: EMA weight;
        ema_start: one of EMA_STARTS.
    Returns: {"x": steps, "raw": per step, the mean over runs of the logged values, "ema": the mean
        over runs of each run's EMA, "std": per step, the sample standard deviation across runs of
        those EMAs (sample_std), "se": their standard error (evaluate.standard_error, std / sqrt(n)),
        both None for one run (no band), "runs": n}.
    Raises: SystemExit (one line): a file without the metric, runs that share no step.
    """
    smooth = ema if ema_start == "debiased" else seeded_ema
    runs = []
    for p in paths:
        xs, ys = run_series(jsonl_rows(p), key, p)
        runs.append((dict(zip(xs, ys)), dict(zip(xs, smooth(ys, alpha)))))
    common = sorted(set.intersection(*(set(raw) for raw, _ in runs)))
    if not common:
        raise SystemExit(f"runs {paths} share no steps with metric {key!r}")
    n = len(runs)
    return {"x": common, "raw": [sum(raw[x] for raw, _ in runs) / n for x in common],
            "ema": [sum(e[x] for _, e in runs) / n for x in common],
            "std": [sample_std([e[x] for _, e in runs]) for x in common] if n > 1 else None,
            "se": [standard_error([e[x] for _, e in runs]) for x in common] if n > 1 else None, "runs": n}


def y_limits(curves, min_span, band="std"):
    """(low, high) of a y-axis that shows every raw value, EMA and band edge (c[band]) of `curves`,
    padded by 5%, and at least `min_span` tall around the data's middle. matplotlib's autoscale would
    zoom into whatever range the EMA has, so that 0.02 nats of drift fill the panel and look like learning."""
    vals = []
    for c in curves:
        vals += c["raw"] + c["ema"]
        if c[band] is not None:
            vals += [m + s for m, s in zip(c["ema"], c[band])] + [m - s for m, s in zip(c["ema"], c[band])]
    lo, hi = min(vals), max(vals)
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    if hi - lo < min_span:
        mid = (lo + hi) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    return lo, hi


def draw_curve(ax, c, label, color, linestyle="-", band="std"):
    """One curve on `ax`: the raw per-step values (faint, dots), the band EMA ± c[band] across runs
    when there are several (band "std": ±1 std, RLME Fig. 2's; "se": ±1 standard error), the EMA on
    top (the one legend entry). Artists carry gid "<label>/raw", "<label>/band", "<label>/ema"
    (tests read them back)."""
    ax.plot(c["x"], c["raw"], color=color, linestyle=linestyle, alpha=0.35, linewidth=0.8, marker=".",
            markersize=3, gid=f"{label}/raw")
    if c[band] is not None:
        ax.fill_between(c["x"], [m - s for m, s in zip(c["ema"], c[band])],
                        [m + s for m, s in zip(c["ema"], c[band])], color=color, alpha=0.2, linewidth=0,
                        gid=f"{label}/band")
    ax.plot(c["x"], c["ema"], color=color, linestyle=linestyle, linewidth=1.8, label=f"{label} (n={c['runs']})",
            gid=f"{label}/ema")


def plot_note(alpha, band="std", ema_start="debiased"):
    """The one line under every figure that says what is drawn."""
    start = "bias-corrected, ours" if ema_start == "debiased" else "seeded with the first point"
    spread = "±1 std" if band == "std" else "±1 s.e."
    return f"faint: raw per step; line: EMA {alpha} ({start}); band: {spread} across runs (2+ runs)"


def curves_figure(curves, keys, alpha, min_span, band="std", ema_start="debiased"):
    """curves.png: one panel per metric key, every setting's curve (draw_curve) on it.
    Args: curves: {label: {key: curve()}}; min_span: y_limits'; band: one of BANDS; ema_start: the
    note's (curve() smoothed them). Returns: a matplotlib Figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for n, (label, cs) in enumerate(curves.items()):
            draw_curve(ax, cs[k], label, f"C{n}", band=band)
        ax.set_ylim(*y_limits([cs[k] for cs in curves.values()], min_span, band))
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(plot_note(alpha, band, ema_start), fontsize=8)
    fig.tight_layout()
    return fig


def reward_accuracy_figure(rewards, accs, reward_key, acc_key, alpha, min_span, band="std", ema_start="debiased"):
    """reward_vs_accuracy.png: reward (solid, left axis) and accuracy (dashed, right axis) of every
    setting on twin axes: reward rising while accuracy falls is reward hacking.
    Args: rewards, accs: {label: curve()}; band, ema_start: as curves_figure. Returns: a matplotlib Figure."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax2 = ax.twinx()
    for n, label in enumerate(rewards):
        draw_curve(ax, rewards[label], f"{label} {reward_key}", f"C{n}", band=band)
        draw_curve(ax2, accs[label], f"{label} {acc_key}", f"C{n}", linestyle="--", band=band)
    ax.set_ylim(*y_limits(rewards.values(), min_span, band))
    ax2.set_ylim(*y_limits(accs.values(), min_span, band))
    ax.set_xlabel("step")
    ax.set_ylabel(f"{reward_key} (solid)")
    ax2.set_ylabel(f"{acc_key} (dashed)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")
    ax.set_title(f"reward vs accuracy\n{plot_note(alpha, band, ema_start)}", fontsize=8)
    fig.tight_layout()
    return fig


def cmd_plot(a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not 0 <= a.ema < 1:
        raise SystemExit(f"--ema {a.ema}: must be in [0, 1) (the weight of the previous value; 0 = raw values)")
    if a.min_y_span < 0:
        raise SystemExit(f"--min-y-span {a.min_y_span}: must be >= 0")
    specs = [parse_curve(s) for s in a.runs]
    keys = a.keys.split(",")
    curves = {label: {k: curve(paths, k, a.ema, a.ema_start) for k in keys} for label, paths in specs}
    os.makedirs(a.out, exist_ok=True)
    figs = [("curves.png", curves_figure(curves, keys, a.ema, a.min_y_span, a.band, a.ema_start))]
    if a.reward_key and a.acc_key:
        def per_label(k):  # the curves of --keys where they are there already
            return {label: curves[label][k] if k in keys else curve(paths, k, a.ema, a.ema_start)
                    for label, paths in specs}
        figs.append(("reward_vs_accuracy.png", reward_accuracy_figure(
            per_label(a.reward_key), per_label(a.acc_key), a.reward_key, a.acc_key, a.ema, a.min_y_span, a.band,
            a.ema_start)))
    files = []
    for name, fig in figs:
        files.append(os.path.join(a.out, name))
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    rows = [{"curve": label, "metric": k, "runs": c["runs"], "steps": len(c["x"]), "first": c["ema"][0],
             "last": c["ema"][-1], "last_std": c["std"][-1] if c["std"] else None,
             "last_se": c["se"][-1] if c["se"] else None}
            for label, cs in curves.items() for k, c in cs.items()]
    rule = "bias-corrected (evaluate.ema; ours)" if a.ema_start == "debiased" else "seeded with the first point (ours)"
    write_results(a.out, "plot", {"ema": a.ema, "ema_rule": rule, "band": a.band, "files": files,
                                  "table": rows, "curves": curves})
    print_table(rows, ["curve", "metric", "runs", "steps", "first", "last", "last_std", "last_se"],
                title=f"EMA {a.ema} curves ({rule}; band ±1 {a.band} across runs; last_std / last_se: "
                      f"sample std / standard error across runs at the last step)")
    print("wrote " + ", ".join(files))
    return rows
