"""scripts/reading_path.py: the README's reading path and the static closure of train.train,
counted by hand on a small example, and the repository's figures against issue 32's budgets."""
import os
import shutil
import sys
import textwrap

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import reading_path as RP  # noqa: E402

TRAIN = '''\
import rollout
import fast


def train(cfg):
    """Doc."""
    # a comment
    x = helper(1)

    return rollout.generate(x) + fast.generate(x)


def helper(v):
    return v


def unused():
    return 0
'''
ROLLOUT = '''\
def generate(x):
    """Two-line
    docstring."""
    return x
'''


def _modules(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "rollout.py").write_text(ROLLOUT)
    return {m: RP.parse_module(m, str(tmp_path)) for m in ("train", "rollout")}


def test_counts_by_hand(tmp_path):
    """train: 6 lines (def, docstring, comment, assignment, blank, return), 3 of code; helper 2 and 2;
    rollout.generate 4 lines, 2 of code (the docstring's two lines out). fast.py is not entered and
    `unused` is not reachable: the closure is 3 functions, 12 lines, 7 code lines."""
    modules = _modules(tmp_path)
    assert RP.count(modules["train"], "train") == (6, 3)
    assert RP.count(modules["train"], "helper") == (2, 2)
    assert RP.count(modules["rollout"], "generate") == (4, 2)
    c = RP.closure(modules)
    assert (c["functions"], c["lines"], c["code"]) == (3, 12, 7)
    # the path train -> rollout -> train -> back to rollout.generate (already read): 2 jumps, 3 with
    # the move back; the function read twice is counted once
    anchors = [("train", "train"), ("rollout", "generate"), ("train", "helper"), ("rollout", "generate")]
    p = RP.path_figures(anchors, modules)
    assert (p["functions"], p["lines"], p["code"], p["jumps"], p["jumps_with_revisits"]) == (3, 12, 7, 2, 3)
    # read before (the RLME step, for RM-NLHF): no lines, no jump
    p = RP.path_figures([("rollout", "generate"), ("train", "helper")], modules, read_before=[("rollout", "generate")])
    assert (p["functions"], p["lines"], p["jumps"], p["jumps_with_revisits"]) == (1, 2, 0, 1)


def test_an_anchor_that_names_nothing_is_an_error(tmp_path):
    for f in RP.STAGE_FILES:
        shutil.copy(os.path.join(REPO, f + ".py"), tmp_path)
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "`train.py:group_advantages`" in readme
    (tmp_path / "README.md").write_text(readme.replace("`train.py:group_advantages`", "`train.py:no_such_function`"))
    with pytest.raises(SystemExit, match="train.py:no_such_function"):
        RP.measure(str(tmp_path))


def test_readme_steps_are_found():
    text = textwrap.dedent("""\
        ## Read the code in this order
        **One RLME step**, ...
        1. `train.py:train` → `rollout.py:generate`
        **One RM-NLHF step**: ...
        1. `reward.py:dh_reward`
        ## The equations
        `train.py:not_in_the_section`
        """)
    assert RP.readme_steps("x\n" + text) == {"rlme": [("train", "train"), ("rollout", "generate")],
                                             "rm_nlhf": [("reward", "dh_reward")]}


@pytest.fixture(scope="module")
def figures():
    return RP.measure()


@pytest.mark.parametrize("part, key", [("rlme", "jumps"), ("rm_nlhf", "lines"), ("rm_nlhf", "code"),
                                       ("rm_nlhf", "jumps")])
def test_the_reading_path_fits_its_budget(figures, part, key):
    assert figures[part][key] <= RP.BUDGETS[part][key], (part, key, figures[part][key])


# Over budget (docs/performance.md, 2026-12-06): with every function a value passes through named,
# lines kept to 100 characters and the docstrings the house style asks for (shapes, dtypes, the
# equation, errors), the RLME step is over 700 lines / 400 code, and the closure over 1,200 lines:
# the two README steps alone hold ~1,300 of the closure's lines, so 1,200 cannot be met without
# cutting those docstrings or moving method code out of the stage files. Strict: the day a figure
# fits, this fails until its marker goes.
@pytest.mark.xfail(strict=True, reason="issue 32's budgets: over, said why (docs/performance.md)")
@pytest.mark.parametrize("part, key", [("rlme", "lines"), ("rlme", "code"), ("closure", "lines")])
def test_the_reading_path_fits_its_budget_later(figures, part, key):
    assert figures[part][key] <= RP.BUDGETS[part][key], (part, key, figures[part][key])
