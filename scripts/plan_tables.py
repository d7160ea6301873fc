"""docs/scale-out.md's memory-plan tables, generated from `--plan` (plumbing/plan.py), never typed.

    python scripts/plan_tables.py            # rewrite the tables in docs/scale-out.md
    python scripts/plan_tables.py --check    # exit 1 and name the stale ones (tests/plumbing/test_plan_tables.py)

In the doc, a line `<!-- plan: FILE[+FILE...] world N -->` is followed by a ``` block holding
plan_table's output for those config files (layered in that order over config.yaml) at world N on
80 GiB GPUs; the block between `<!-- plan-peaks:begin -->` and `<!-- plan-peaks:end -->` is a
table of every shipped GPU preset's peak per stage (PRESETS). Offline: hub ids are read from
plumbing/model_configs/ (HF_HUB_OFFLINE=1 is set here).
"""
import argparse
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
DOC = os.path.join(ROOT, "docs", "scale-out.md")
GPU = 80 * 2**30
PAPER = "configs/paper/rm_nlhf_qwen7b.yaml"
STAGES = ["setup", "cold start", "cold-start fit", "rollout", "reward", "MetaRM update", "MetaRM predict", "update",
          "validation", "checkpoint"]


def presets():
    """Every shipped GPU preset as (config files, world): config.yaml, configs/rm_nlhf.yaml, the
    paper preset and the files layered on it, configs/paper/rlme/*, configs/gpu_check.yaml (one GPU)."""
    g = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    out = [([], 8), (["configs/rm_nlhf.yaml"], 8), ([PAPER], 8), ([PAPER, "configs/paper/released_code.yaml"], 8)]
    out += [([PAPER, f], 8) for f in g("configs/paper/ablations/*.yaml") + g("configs/paper/table10/*.yaml")]
    out += [([f], 8) for f in g("configs/paper/rlme/*.yaml")]
    return out + [(["configs/gpu_check.yaml"], 1)]


def plan(files, world):
    from plumbing.config import load_config
    from plumbing.plan import memory_plan
    return memory_plan(load_config([os.path.join(ROOT, f) for f in files], []), world=world, gpu_bytes=GPU)


def table(files, world):
    from plumbing.plan import plan_table
    return plan_table(plan(files, world))


def peaks_table():
    """Markdown: one row per preset, GiB per stage ("-" where the run has no such stage)."""
    rows = ["| preset | world | " + " | ".join(STAGES) + " | fits 80 GiB |", "|---|---|" + "---|" * len(STAGES) + "---|"]
    for files, world in presets():
        p = plan(files, world)
        name = " + ".join(f.removeprefix("configs/") for f in files) or "config.yaml"
        cells = [f"{p['stages'][s]['bytes'] / 2**30:.1f}" if s in p["stages"] else "-" for s in STAGES]
        rows.append(f"| {name} | {world} | " + " | ".join(cells) + f" | {'yes' if p['fits'] else '**no**: ' + p['peak_stage']} |")
    return "\n".join(rows)


MARK = re.compile(r"<!-- plan: (\S+) world (\d+) -->\n```\n(.*?)```\n", re.S)
PEAKS = re.compile(r"(<!-- plan-peaks:begin -->\n)(.*?)(<!-- plan-peaks:end -->)", re.S)


def regenerate(text):
    """(new text, [stale block names]) for the doc's text."""
    stale = []

    def block(m):
        new = table(m.group(1).split("+"), int(m.group(2))) + "\n"
        if new != m.group(3):
            stale.append(m.group(1))
        return f"<!-- plan: {m.group(1)} world {m.group(2)} -->\n```\n{new}```\n"

    text = MARK.sub(block, text)

    def peaks(m):
        new = peaks_table() + "\n"
        if new != m.group(2):
            stale.append("plan-peaks")
        return m.group(1) + new + m.group(3)

    return PEAKS.sub(peaks, text), stale


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a table is stale")
    ap.add_argument("--doc", default=DOC)
    a = ap.parse_args(argv)
    with open(a.doc) as f:
        text = f.read()
    new, stale = regenerate(text)
    if a.check:
        if stale:
            print(f"{a.doc}: stale plan tables: {', '.join(stale)} (python scripts/plan_tables.py rewrites them)")
            return 1
        print(f"{a.doc}: every plan table matches --plan")
        return 0
    with open(a.doc, "w") as f:
        f.write(new)
    print(f"{a.doc}: {len(stale)} plan tables rewritten" + (f" ({', '.join(stale)})" if stale else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
