"""How long a first reading is: the README's reading path and the static closure of train.train.

    python scripts/reading_path.py           # the figures, one line each
    python scripts/reading_path.py --list    # and every function counted, with its lines

Two measures, both from the source alone (ast; nothing is imported or run):

* The README's path: the `file.py:function` anchors of each step under "## Read the code in this
  order" ("**One RLME step**", "**One RM-NLHF step**"). Lines: each named function from its `def`
  (decorators included) to its last line, docstring included, each function once; code lines: the
  same without blank lines, comment-only lines and docstrings. Cross-file jumps: the times the
  next function to read, in the README's order, is in another file. A function already read
  (earlier in the step; for the RM-NLHF step, "the same loop", also the RLME step's) is not read
  again: no lines, no jump; the figure that counts those moves too is printed beside it.
* The static closure of `train.train`: every function of the stage files reachable from it by name
  (called, or passed as a value: functools.partial(f, ...), {"generate": rollout.generate}), both
  methods' branches, stopping at fast.py and plumbing/ (speed and plumbing, not the method), counted
  the same way.

The budgets are issue 32's (`BUDGETS`); tests/plumbing/test_layout.py runs this file and checks them.
An anchor that names no function of its file is an error: the README must not point at nothing.
"""
import argparse
import ast
import io
import os
import re
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE_FILES = ("train", "rollout", "reward", "metarm", "evaluate")  # the method; fast/plumbing are not entered
STEPS = {"rlme": "**One RLME step**", "rm_nlhf": "**One RM-NLHF step**"}
# issue 32's budgets: lines, code lines, cross-file jumps of each README step; the closure's lines
BUDGETS = {"rlme": {"lines": 700, "code": 400, "jumps": 6}, "rm_nlhf": {"lines": 600, "code": 350, "jumps": 6},
           "closure": {"lines": 1200}}
ANCHOR = re.compile(r"`(\w+)\.py:(\w+)`")


def parse_module(name, repo=REPO):
    """{"functions": {name: (first line, last line, ast node)}, "aliases": {local name: stage module},
    "imported": {local name: (stage module, function)}, "source": list[str]} of one stage file."""
    path = os.path.join(repo, name + ".py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    tree = ast.parse(text, path)
    functions, aliases, imported = {}, {}, {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            functions[node.name] = (first, node.end_lineno, node)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in STAGE_FILES:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module in STAGE_FILES and node.level == 0:
            for a in node.names:
                imported[a.asname or a.name] = (node.module, a.name)
    return {"functions": functions, "aliases": aliases, "imported": imported, "source": text.splitlines(),
            "comments": comment_lines(text)}


def comment_lines(text):
    """Line numbers (1-based) that hold only a comment."""
    out = set()
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return out - code


def count(module, name):
    """(lines, code lines) of the top-level function `name` of a parsed module."""
    first, last, node = module["functions"][name]
    skip = set(module["comments"])
    for sub in ast.walk(node):  # the docstrings of the function and of anything defined inside it
        body = getattr(sub, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = sum(1 for i in range(first, last + 1) if module["source"][i - 1].strip() and i not in skip)
    return last - first + 1, code


def readme_steps(readme_text):
    """{step: [(file, function), ...]} in the README's order, from its reading-path section."""
    section = readme_text.split("## Read the code in this order", 1)[1].split("\n## ", 1)[0]
    out, current = {}, None
    for line in section.splitlines():
        for step, heading in STEPS.items():
            if line.startswith(heading):
                current, out[step] = step, []
        if current is not None:
            out[current] += ANCHOR.findall(line)
    missing = [s for s in STEPS if s not in out]
    if missing:
        raise SystemExit(f"README.md: no {', '.join(STEPS[s] for s in missing)} in 'Read the code in this order'")
    return out


def path_figures(anchors, modules, read_before=()):
    """{"functions", "lines", "code", "jumps", "jumps_with_revisits", "counted"} of one README
    step's anchors. A function read before (earlier in the step, or in `read_before`: the RLME
    step, for the RM-NLHF step that says it runs the same loop) is a revisit: counted once, and a
    move to its file is no jump (the README marks it "(step n)"); jumps_with_revisits counts them."""
    seen, lines, code, counted, first_reads = set(read_before), 0, 0, [], []
    for file, name in anchors:
        if file not in modules or name not in modules[file]["functions"]:
            raise SystemExit(f"README.md: the anchor `{file}.py:{name}` names no top-level function of {file}.py")
        if (file, name) not in seen:
            seen.add((file, name))
            first_reads.append(file)
            n, c = count(modules[file], name)
            lines, code = lines + n, code + c
            counted.append((f"{file}.py:{name}", n, c))
    jumps = sum(1 for a, b in zip(first_reads, first_reads[1:]) if a != b)
    with_revisits = sum(1 for a, b in zip(anchors, anchors[1:]) if a[0] != b[0])
    return {"functions": len(counted), "lines": lines, "code": code, "jumps": jumps,
            "jumps_with_revisits": with_revisits, "counted": counted}


def references(module_name, node, modules):
    """The stage-file functions the body of `node` names: f(...) / f of its own module, alias.f of
    an imported stage module, or a name imported from one. Names of fast / plumbing are not followed."""
    mod = modules[module_name]
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in mod["functions"]:
            out.add((module_name, sub.id))
        elif isinstance(sub, ast.Name) and sub.id in mod["imported"]:
            out.add(mod["imported"][sub.id])
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in mod["aliases"]:
            target = mod["aliases"][sub.value.id]
            if sub.attr in modules[target]["functions"]:
                out.add((target, sub.attr))
    return out


def closure(modules, root=("train", "train")):
    """{"functions", "lines", "code", "counted"} of every stage-file function reachable from `root`."""
    seen, todo = {root}, [root]
    while todo:
        file, name = todo.pop()
        for ref in references(file, modules[file]["functions"][name][2], modules):
            if ref not in seen:
                seen.add(ref)
                todo.append(ref)
    counted = sorted((f"{f}.py:{n}", *count(modules[f], n)) for f, n in seen)
    return {"functions": len(seen), "lines": sum(c[1] for c in counted), "code": sum(c[2] for c in counted),
            "counted": counted}


def measure(repo=REPO):
    """{"rlme": path_figures, "rm_nlhf": path_figures, "closure": closure's} of the repository at `repo`."""
    modules = {m: parse_module(m, repo) for m in STAGE_FILES}
    with open(os.path.join(repo, "README.md"), encoding="utf-8") as f:
        steps = readme_steps(f.read())
    out = {"rlme": path_figures(steps["rlme"], modules)}
    out["rm_nlhf"] = path_figures(steps["rm_nlhf"], modules, read_before=steps["rlme"])
    out["closure"] = closure(modules)
    return out


def over_budget(figures):
    """One line per figure over its BUDGETS entry ([] when all fit)."""
    return [f"{part} {key} {figures[part][key]} > {limit}" for part, b in BUDGETS.items()
            for key, limit in b.items() if figures[part][key] > limit]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--list", action="store_true", help="every function counted, with its lines and code lines")
    a = ap.parse_args(argv)
    figures = measure()
    for part in ("rlme", "rm_nlhf", "closure"):
        f = figures[part]
        jumps = (f", {f['jumps']} cross-file jumps ({f['jumps_with_revisits']} counting moves back to a function"
                 f" already read)" if "jumps" in f else "")
        budget = ", ".join(f"{k} <= {v}" for k, v in BUDGETS[part].items())
        print(f"{part}: {f['functions']} functions, {f['lines']} lines ({f['code']} code){jumps}  [budget: {budget}]")
        if a.list:
            for name, n, c in f["counted"]:
                print(f"    {name:48s} {n:4d} {c:4d}")
    bad = over_budget(figures)
    for line in bad:
        print("over budget:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
