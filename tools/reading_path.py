"""How long a first reading is: the lines of one training step on the path a run executes, and
the product's size.

    python tools/reading_path.py                 # static figures + one RLME and one RM-NLHF step
    python tools/reading_path.py --static        # only the static figures (no run; a second)
    python tools/reading_path.py --list          # and every function counted, with its lines
    python tools/reading_path.py --rlme configs/cpu.yaml rollout.max_new_tokens=16   # other runs

Static (ast + tokenize, nothing imported): each product file's (every .py at the top of the
repository) lines and code lines, the total, the longest function, the lines over 100 characters.

One step, as the run executes it: `train.py` runs in this process (runpy, its own argv) for two
steps (FIXED: no checkpoint) under sys.settrace, which records the calls and lines of the product
files only (other code is not traced line by line). The step is the window between the first
and the second call of --marker (a function the loop calls once a step; default
train.py:group_advantages), so it is one whole cycle of the loop: an update, the metrics line,
the next step's prompts, rollout and reward. Counted:
  * every product function (or class method) called in the window: whole, from its `def`
    (decorators included) to its last line, docstring included, once;
  * a function already running when the window opens (the loop itself, in train.py): only the
    span of its lines the window executes (the loop body), not its set-up;
code lines are the same without blank lines, comment-only lines and docstrings. A nested function
is read with the function that holds it. Code run in another process (a vLLM engine worker) is
not seen. The budgets are issue 42's: 600 lines / 350 code for each step.
"""
import argparse
import ast
import io
import os
import runpy
import sys
import tempfile
import threading
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = {"lines": 600, "code": 350}
# the default runs; two steps each, no checkpoint (one is every run.save_every steps, not a step's)
STEPS = {"rlme": ["configs/cpu.yaml"], "rm_nlhf": ["configs/cpu_rm_nlhf.yaml"]}
FIXED = ["run.total_steps=2", "run.save_every=0"]


# ----------------------------------------------------------------------------------------------
# Static: a file's functions and their lines / code lines

def parse_file(path):
    """{"units": [(first, last, name, code object line)], "source": [str], "skip": {line}} of one
    file. Units: top-level functions and the methods of top-level classes; first includes the
    decorators. skip: comment-only and docstring lines (what code lines leave out)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    tree = ast.parse(text, path)
    units = []
    for node in tree.body:
        defs = [(node, node.name)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            else [(n, f"{node.name}.{n.name}") for n in getattr(node, "body", [])
                  if isinstance(node, ast.ClassDef)
                  and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn, name in defs:
            first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            units.append((first, fn.end_lineno, name, fn.lineno))
    skip = comment_lines(text)
    for sub in ast.walk(tree):  # docstrings of the module, classes and functions (nested too)
        body = getattr(sub, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    return {"units": units, "source": text.splitlines(), "skip": skip}


def comment_lines(text):
    """Line numbers (1-based) that hold only a comment."""
    comments, code = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return comments - code


def count(parsed, first, last):
    """(lines, code lines) of the line span [first, last] of a parsed file."""
    code = sum(1 for i in range(first, last + 1)
               if parsed["source"][i - 1].strip() and i not in parsed["skip"])
    return last - first + 1, code


def product_files(root=ROOT):
    """The product: every .py file at the repository's top (tools/ and tests/ are not)."""
    return sorted(n for n in os.listdir(root) if n.endswith(".py"))


def static_figures(root=ROOT):
    """{"files": {name: (lines, code)}, "total": (lines, code), "longest": (name, lines),
    "over_80": [names of functions over 80 lines], "long_lines": n (> 100 characters)} of the
    product files under `root`."""
    files, longest, long_lines, over_80 = {}, ("", 0), 0, []
    for name in product_files(root):
        p = parse_file(os.path.join(root, name))
        files[name] = count(p, 1, len(p["source"])) if p["source"] else (0, 0)
        long_lines += sum(1 for line in p["source"] if len(line) > 100)
        for first, last, fn, _ in p["units"]:
            if last - first + 1 > longest[1]:
                longest = (f"{name}:{fn}", last - first + 1)
            if last - first + 1 > 80:
                over_80.append(f"{name}:{fn}")
    total = tuple(sum(v[i] for v in files.values()) for i in (0, 1))
    return {"files": files, "total": total, "longest": longest, "over_80": over_80,
            "long_lines": long_lines}


# ----------------------------------------------------------------------------------------------
# Dynamic: what one step executes

class StepTracer:
    """sys.settrace hook recording, for the files in `paths`, the (file, def line) of each call
    and the (file, line) of each line executed while the window is open. The window opens at
    the first call of `marker` (file, def line) and closes at the second."""

    def __init__(self, paths, marker):
        self.paths, self.marker = set(paths), marker
        self.marker_calls, self.calls, self.lines = 0, set(), set()

    def __call__(self, frame, event, arg):
        path = frame.f_code.co_filename
        if path not in self.paths:
            return None  # no line events outside the product
        if event == "call":
            key = (path, frame.f_code.co_firstlineno)
            if key == self.marker:
                self.marker_calls += 1
            if self.marker_calls == 1:
                self.calls.add(key)
        return self.local

    def local(self, frame, event, arg):
        if event == "line" and self.marker_calls == 1:
            self.lines.add((frame.f_code.co_filename, frame.f_lineno))
        return self.local

    def run(self, fn):
        """fn() with this tracer on, in every thread (a judge's worker threads too)."""
        sys.settrace(self)
        threading.settrace(self)
        try:
            fn()
        except SystemExit as e:  # train.py's own sys.exit(main()): an error is one line
            if e.code not in (0, None):
                raise SystemExit(f"reading path: the traced run stopped: {e.code}")
        finally:
            sys.settrace(None)
            threading.settrace(None)


def step_figures(tracer, parsed):
    """{"functions", "lines", "code", "counted": [(name, lines, code, how)]} of a traced window.
    parsed: {path: parse_file(path)}. A unit whose def was called in the window counts whole; a
    unit with executed lines but no call (already running: the loop) counts its executed span."""
    counted = []
    for path, p in parsed.items():
        name = os.path.basename(path)
        for first, last, fn, def_line in p["units"]:
            run = [ln for (f, ln) in tracer.lines if f == path and first <= ln <= last]
            called = any(f == path and first <= ln <= last for (f, ln) in tracer.calls)
            # a decorated function's code starts at its first decorator
            if {(path, def_line), (path, first)} & tracer.calls or called and not run:
                counted.append((f"{name}:{fn}", *count(p, first, last), "whole"))
            elif called or run:
                lo, hi = min(run), max(run)
                counted.append((f"{name}:{fn} [{lo}-{hi}]", *count(p, lo, hi), "span"))
    return {"functions": len(counted), "lines": sum(c[1] for c in counted),
            "code": sum(c[2] for c in counted), "counted": sorted(counted)}


def trace_step(argv, marker="train.py:group_advantages", root=ROOT):
    """Run `python train.py *argv` in this process under StepTracer; step_figures of its window.
    Raises SystemExit (one line) when the marker is unknown or not called twice."""
    parsed = {os.path.join(root, n): parse_file(os.path.join(root, n)) for n in product_files(root)}
    file, _, fn = marker.partition(":")
    where = os.path.join(root, file)
    lines = [d for (_, _, name, d) in parsed.get(where, {"units": []})["units"] if name == fn]
    if not lines:
        raise SystemExit(f"reading path: --marker {marker}: no such function in {file}")
    tracer = StepTracer(parsed, (where, lines[0]))
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv, sys.path[:0] = [os.path.join(root, "train.py"), *argv], [root]
    os.chdir(root)
    try:
        tracer.run(lambda: runpy.run_path(os.path.join(root, "train.py"), run_name="__main__"))
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    if tracer.marker_calls < 2:
        raise SystemExit(f"reading path: {marker} ran {tracer.marker_calls} time(s) in "
                         f"`train.py {' '.join(argv)}`; a step needs two calls")
    return step_figures(tracer, parsed)


# ----------------------------------------------------------------------------------------------

def print_step(label, f, show):
    verdict = "fits" if f["lines"] <= BUDGET["lines"] and f["code"] <= BUDGET["code"] else "OVER"
    print(f"{label}: {f['functions']} functions, {f['lines']} lines ({f['code']} code)  "
          f"[budget {BUDGET['lines']} / {BUDGET['code']}: {verdict}]")
    by_file = {}
    for name, n, c, _ in f["counted"]:
        by_file[name.split(":")[0]] = by_file.get(name.split(":")[0], 0) + n
    print("    by file: " + ", ".join(f"{k} {v}" for k, v in sorted(by_file.items())))
    for name, n, c, how in f["counted"] if show else []:
        print(f"    {name:52s} {n:4d} {c:4d}  {how}")


# ----------------------------------------------------------------------------------------------
# Copying a piece: what a reader pastes to use one reward in their own trainer

COPIES = {  # issue 42's two cases and budgets (lines pasted; edits: 0)
    "RLME reward (one local evaluator, weighted meta-questions)": (
        ["reward.py:local_evaluator", "reward.py:rlme_reward",
         "reward.py:DEFAULT_EVALUATOR_TEMPLATE"], 120),
    "D_H reward (your judge callable) + the MetaRM loss and predict": (
        ["reward.py:parse_grm_output", "reward.py:score_dh",
         "metarm.py:metarm_loss", "metarm.py:predict"], 150),
}


def copy_closure(entries, root=ROOT):
    """{"lines", "pieces", "edits", "imports"} of pasting `entries` (FILE:NAME) and every top-level
    function, class or constant of the product they reach by name, transitively, into one file.
    lines: the pieces' spans (decorators included) + one line per import statement they use;
    edits: distinct `module.NAME` references to another product file (to rewrite as `NAME`)."""
    trees = {f: ast.parse(open(os.path.join(root, f), encoding="utf-8").read())
             for f in product_files(root)}
    tops, aliases, imports, from_product = {}, {}, {}, {}
    for f, tree in trees.items():
        for node in tree.body:
            names = [node.name] if hasattr(node, "name") else [
                t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                if isinstance(t, ast.Name)]
            for n in names:
                tops[(f, n)] = node
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    bound = (a.asname or a.name).split(".")[0]
                    mod = f"{a.name if isinstance(node, ast.Import) else node.module}.py"
                    if mod in trees and isinstance(node, ast.Import):
                        aliases[(f, bound)] = mod
                    elif mod in trees:  # from rollout import autocast: read in rollout.py
                        from_product[(f, bound)] = (mod, a.name)
                    else:
                        imports[(f, bound)] = node
    todo, seen, edits, used = [tuple(e.split(":")) for e in entries], set(), set(), set()
    while todo:
        key = todo.pop()
        if key in seen or key not in tops:
            continue
        seen.add(key)
        for sub in ast.walk(tops[key]):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                    and (key[0], sub.value.id) in aliases:
                target = (aliases[(key[0], sub.value.id)], sub.attr)
                edits.add(f"{sub.value.id}.{sub.attr}")
                todo.append(target)
            elif isinstance(sub, ast.Name):
                if (key[0], sub.id) in tops:
                    todo.append((key[0], sub.id))
                elif (key[0], sub.id) in from_product:
                    todo.append(from_product[(key[0], sub.id)])
                elif (key[0], sub.id) in imports:
                    used.add(id(imports[(key[0], sub.id)]))
    spans = sum(tops[k].end_lineno - min([tops[k].lineno] + [d.lineno for d in getattr(
        tops[k], "decorator_list", [])]) + 1 for k in seen)
    return {"lines": spans + len(used), "pieces": sorted(f"{f}:{n}" for f, n in seen),
            "edits": sorted(edits), "imports": len(used)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--static", action="store_true", help="the static figures only (no run)")
    ap.add_argument("--list", action="store_true", help="every function counted in each step")
    ap.add_argument("--step", choices=["rlme", "rm_nlhf", "both"], default="both")
    ap.add_argument("--marker", default="train.py:group_advantages",
                    help="FILE:FUNCTION the loop calls once a step (the window's edges)")
    ap.add_argument("--rlme", nargs="+", metavar="ARG", default=None,
                    help="CONFIG [key=value ...] of the RLME run (default: configs/cpu.yaml)")
    ap.add_argument("--rm-nlhf", nargs="+", metavar="ARG", default=None,
                    help="CONFIG [key=value ...] of the RM-NLHF run (configs/cpu_rm_nlhf.yaml)")
    a = ap.parse_args(argv)
    s = static_figures()
    print(f"product: {s['total'][0]} lines ({s['total'][1]} code) in {len(s['files'])} files: "
          + ", ".join(f"{k} {v[0]} ({v[1]})" for k, v in s["files"].items()))
    over = f"{len(s['over_80'])} ({', '.join(s['over_80'])})" if s["over_80"] else "0"
    print(f"longest function: {s['longest'][0]} ({s['longest'][1]} lines); functions over 80 "
          f"lines: {over}; lines over 100 characters: {s['long_lines']}")
    for label, (entries, budget) in COPIES.items():
        c = copy_closure(entries)
        print(f"copy {label}: {c['lines']} lines in {len(c['pieces'])} pieces + {c['imports']} "
              f"imports, {len(c['edits'])} edits (budget {budget}, 0 edits)"
              + (f": {', '.join(c['pieces'])}; edits {', '.join(c['edits'])}" if a.list else ""))
    if a.static:
        return 0
    over = False
    for label, args in (("RLME step", a.rlme), ("RM-NLHF step", a.rm_nlhf)):
        key = "rlme" if label.startswith("RLME") else "rm_nlhf"
        if a.step not in (key, "both"):
            continue
        config, *overrides = args or STEPS[key]
        args = ["--config", config, *FIXED, f"run.out_dir={tempfile.mkdtemp(prefix='rp_')}",
                *overrides]
        f = trace_step(args, a.marker)
        print_step(f"{label} (train.py {' '.join(args)})", f, a.list)
        over |= f["lines"] > BUDGET["lines"] or f["code"] > BUDGET["code"]
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
