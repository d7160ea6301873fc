"""The layout a reader relies on (README, "Read the code"): the stage files never import plumbing/
or fast.py, nothing imports train.py, each fast twin has its plain twin's signature, and reward's
README names still import."""
import ast
import inspect
import os

import pytest

import fast
import reward
import rollout
import train
from conftest import REPO
from plumbing import services

STAGE = ("rollout.py", "reward.py", "metarm.py", "evaluate.py")


def imported_modules(path):
    """Every module an import statement in `path` names, at any depth (function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", STAGE)
def test_stage_files_import_neither_plumbing_nor_fast(path):
    bad = {m for m in imported_modules(path) if m.split(".")[0] in ("plumbing", "fast", "train")}
    assert not bad, f"{path} imports {sorted(bad)}"


def test_nothing_imports_train():
    files = ["fast.py"] + [os.path.join("plumbing", f) for f in os.listdir(os.path.join(REPO, "plumbing"))
                           if f.endswith(".py")]
    assert [f for f in files + list(STAGE) if "train" in imported_modules(f)] == []


@pytest.mark.parametrize("use_fast", [True, False])
def test_the_one_switch_picks_twins_with_one_signature(use_fast):
    picked, other = train.fast_or_plain(use_fast), train.fast_or_plain(not use_fast)
    assert set(picked) == set(other)
    for name, fn in picked.items():
        fn, twin = getattr(fn, "func", fn), getattr(other[name], "func", other[name])  # functools.partial: its function
        assert (fn.__module__ == "fast") == use_fast, name
        assert inspect.signature(fn) == inspect.signature(twin), name
    assert inspect.signature(fast.token_logprobs) == inspect.signature(rollout.token_logprobs)


def test_reward_forwards_its_readme_names_to_plumbing():
    for name in reward.SERVICES:
        assert getattr(reward, name) is getattr(services, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        reward.no_such_name


def test_the_readme_recipe_leaves_hf_evaluate_its_name(tmp_path):
    """README's recipe for other trainers appends the repository to sys.path: an installed package
    named `evaluate` (Hugging Face's, which lm-eval imports) is still the one `import evaluate`
    finds, and `import reward` works. (sys.path.insert(0, repo), the old recipe, shadowed it.)"""
    import subprocess
    import sys
    readme = open(os.path.join(REPO, "README.md")).read()
    recipe = 'import sys; sys.path.append("/path/to/this/repo")'
    assert recipe in readme and 'sys.path.insert(0, "/path/to/this/repo")' not in readme
    site = tmp_path / "site"
    (site / "evaluate").mkdir(parents=True)
    (site / "evaluate" / "__init__.py").write_text("HF = True\n")
    code = (recipe.replace("/path/to/this/repo", REPO) + "\nimport reward, evaluate\nprint(getattr(evaluate, 'HF', False))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=str(site)))
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr[-1500:]
