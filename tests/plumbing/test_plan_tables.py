"""docs/scale-out.md's memory-plan tables are `--plan`'s output (scripts/plan_tables.py), so the
doc cannot drift from plumbing/plan.py; and the check does catch a stale table."""
import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import plan_tables  # noqa: E402


def test_the_docs_plan_tables_equal_the_plan(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with open(plan_tables.DOC) as f:
        text = f.read()
    assert text.count("<!-- plan: ") >= 5 and "<!-- plan-peaks:begin -->" in text
    new, stale = plan_tables.regenerate(text)
    assert not stale, f"stale: {stale}; run python scripts/plan_tables.py"
    assert new == text


def test_a_stale_table_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- plan: configs/gpu_check.yaml world 1 -->\n```\nold numbers\n```\n")
    assert plan_tables.main(["--check", "--doc", str(doc)]) == 1
    assert "configs/gpu_check.yaml" in capsys.readouterr().out
    assert plan_tables.main(["--doc", str(doc)]) == 0 and plan_tables.main(["--check", "--doc", str(doc)]) == 0
    assert "peaks: setup" in doc.read_text()
