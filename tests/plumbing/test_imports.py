"""The import graph a reader and a static tool see (issue 32 item 6): every import statement of the
repository's own files (stage files, fast.py, plumbing/, scripts/, tests/), at module level and
inside functions and `if __name__ == "__main__":` blocks, read with `ast`. It has no circle, and no
import is hidden from it: no importlib.import_module, __import__, runpy, or module __getattr__.

A stage file run as a program (`python reward.py`) is imported a second time, as `__main__`, by
anything its `__main__` block imports that imports it back; that is a circle here too, so the
command lines of rollout.py, reward.py, metarm.py and evaluate.py are `python -m plumbing.cli
STAGE` (plumbing/cli.py), which nothing in plumbing/ imports."""
import ast
import os
import subprocess
import sys

import pytest

from conftest import REPO

# The module name each folder's files are imported under: the repository root and scripts/ are on
# sys.path when a stage file or a script runs, tests/ and its two subfolders under pytest (conftest.py).
ROOTS = ("", "scripts", "tests", os.path.join("tests", "algorithm"), os.path.join("tests", "plumbing"))
HIDDEN_CALLS = {"import_module", "__import__", "run_module", "run_path"}  # importlib, builtins, runpy


def repository_modules(repo):
    """{module name: file path} of the repository's own Python files (plumbing/ as a package)."""
    out = {}

    def add(name, path):
        assert name not in out, f"{path} and {out[name]} are both imported as {name!r}"
        out[name] = path
    for root in ROOTS:
        folder = os.path.join(repo, root)
        for f in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if f.endswith(".py"):
                add(f[:-3], os.path.join(folder, f))
    package = os.path.join(repo, "plumbing")
    for f in sorted(os.listdir(package)) if os.path.isdir(package) else []:
        if f.endswith(".py"):
            add("plumbing" if f == "__init__.py" else f"plumbing.{f[:-3]}", os.path.join(package, f))
    return out


def imports_of(tree, modules, package=None):
    """The repository modules that the import statements of one parsed file load (any depth).
    `import a.b` / `from a.b import c` load the longest prefix that is one of `modules`;
    `from plumbing import config` loads plumbing.config when that is a module."""
    def own(name):
        parts = name.split(".")
        return next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), None)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {own(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                up = (package or "").split(".")[:len((package or "").split(".")) - node.level + 1]
                base = ".".join([p for p in up if p] + ([node.module] if node.module else []))
            for a in node.names:
                out.add(own(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else own(base))
        elif isinstance(node, ast.Call) and call_name(node) in HIDDEN_CALLS and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.add(own(node.args[0].value))  # what it really loads (hidden_imports refuses it)
    return out - {None}


def call_name(node):
    """The name a call calls: f(...) -> 'f', a.b.f(...) -> 'f', anything else -> None."""
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def hidden_imports(tree):
    """Lines of `tree` that load a module where neither a reader's grep nor a static tool sees it:
    a call of importlib.import_module / __import__ / runpy.run_module / run_path, and a module-level
    __getattr__ (PEP 562: names that appear from nowhere)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and call_name(node) in HIDDEN_CALLS:
            found.append((node.lineno, f"{call_name(node)}(...)"))
    found += [(n.lineno, "module __getattr__") for n in tree.body
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "__getattr__"]
    return sorted(found)


def import_graph(repo):
    """({module: set of repository modules it imports}, {module: file path})."""
    modules = repository_modules(repo)
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        package = name.rpartition(".")[0] if not path.endswith("__init__.py") else name
        graph[name] = imports_of(tree, modules, package) - {name}
    return graph, modules


def circles(graph):
    """(one circle: a list of modules, first == last; the sorted modules of its component) per strongly
    connected component of more than one module (Tarjan's algorithm), sorted; [] for an acyclic graph."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)
    for v in sorted(graph):
        if v not in index:
            visit(v)

    def path_back(comp):  # the shortest walk from the component's first module back to itself
        start = min(comp)
        prev, frontier = {start: None}, [start]
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        walk = [v]
                        while prev[walk[-1]] is not None:
                            walk.append(prev[walk[-1]])
                        return walk[::-1] + [start]
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
    return sorted((path_back(c), sorted(c)) for c in comps)


def test_the_repository_imports_form_no_circle():
    graph, modules = import_graph(REPO)
    assert {"train", "reward", "plumbing.cli", "plumbing.run", "test_imports"} <= set(graph)  # it read the tree
    assert "rollout" in graph["reward"] and "plumbing.run" in graph["train"]  # and its edges
    found = circles(graph)
    assert found == [], "import circles (module -> module it imports; the modules of its strongly connected " \
        "component):\n" + "\n".join(f"{' -> '.join(walk)}  ({len(comp)} modules: {', '.join(comp)})" for walk, comp in found)


def test_no_import_is_hidden_from_a_reader():
    graph, modules = import_graph(REPO)
    bad = []
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            bad += [f"{os.path.relpath(path, REPO)}:{line}: {what}" for line, what in hidden_imports(ast.parse(f.read()))]
    assert bad == [], "imports a reader cannot see:\n" + "\n".join(bad)


def test_the_checks_find_a_circle_and_a_hidden_import(tmp_path):
    """The two checks on a made-up repository: a circle through a function-level import and a
    `__main__` block, a plain chain, and the three ways to hide an import."""
    (tmp_path / "plumbing").mkdir()
    (tmp_path / "plumbing" / "__init__.py").write_text("")
    (tmp_path / "plumbing" / "cli.py").write_text("import stage\nfrom plumbing import helpers\n")
    (tmp_path / "plumbing" / "helpers.py").write_text("import base\n")
    (tmp_path / "base.py").write_text("import os\n")
    (tmp_path / "stage.py").write_text("import base\n\ndef f():\n    import torch.nn\n\n"
                                       "if __name__ == '__main__':\n    from plumbing.cli import main\n")
    (tmp_path / "hidden.py").write_text("import importlib\nimportlib.import_module('stage')\n__import__('base')\n\n"
                                        "def __getattr__(name):\n    return name\n")
    graph, modules = import_graph(str(tmp_path))
    assert graph["plumbing.cli"] == {"stage", "plumbing.helpers"} and graph["plumbing.helpers"] == {"base"}
    assert graph["hidden"] == {"stage", "base"}  # what it really loads
    assert circles(graph) == [(["plumbing.cli", "stage", "plumbing.cli"], ["plumbing.cli", "stage"])]
    assert hidden_imports(ast.parse((tmp_path / "hidden.py").read_text())) == [
        (2, "import_module(...)"), (3, "__import__(...)"), (5, "module __getattr__")]
    (tmp_path / "stage.py").write_text("import base\n")
    assert circles(import_graph(str(tmp_path))[0]) == []


def run_python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("stage", ["rollout", "reward", "metarm", "evaluate"])
def test_a_stage_file_run_as_a_program_names_its_command_line(stage):
    """`python reward.py ...` runs nothing (its command line would import it a second time): one
    line naming `python -m plumbing.cli reward`, exit status 1."""
    p = run_python(f"{stage}.py", "--help")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [f"{stage}.py's command line: python -m plumbing.cli {stage} --help "
                                             f"(from the repository root)"]


def test_python_m_plumbing_cli_loads_each_file_once():
    """`python -m plumbing.cli reward --help`: reward's usage, and -X importtime lists no second copy of
    plumbing.cli (the module runs as __main__; a plumbing module importing it back would load it again)."""
    p = run_python("-X", "importtime", "-m", "plumbing.cli", "reward", "--help")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: python -m plumbing.cli reward")
    loaded = [line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")]
    assert "reward" in loaded and "plumbing.evaluators" in loaded and "plumbing.cli" not in loaded


def test_python_m_plumbing_cli_names_its_stages():
    p = run_python("-m", "plumbing.cli", "train")
    assert p.returncode == 1 and p.stderr.strip() == ("usage: python -m plumbing.cli {rollout,reward,metarm,evaluate} ... "
                                                      "(STAGE --help: its options); got 'train'")
    assert run_python("-m", "plumbing.cli", "--help").stdout.startswith("usage: python -m plumbing.cli {rollout,")
