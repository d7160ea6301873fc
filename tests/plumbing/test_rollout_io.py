"""Rollout plumbing: model paths, the rollout command line's one-line errors, JSONL reading."""
import pytest

from plumbing.cli import rollout_main
from plumbing.jsonl import read_jsonl
from plumbing.models import resolve_model_path


def test_model_path_errors(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(SystemExit, match="without config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(SystemExit, match="not installed"):
        resolve_model_path("gguf:no_such_package_xyz/model.gguf")


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "a"}\n{"question": "b"}\n', "in.jsonl:2: missing field 'prompt' (--field; fields found: ['question'])"),
    (b'{"prompt": "a"}\n{"prompt": \n', "in.jsonl:2: not valid JSON"),
    ('{"prompt": "é"}\n'.encode("latin-1"), "in.jsonl:1: not UTF-8 text"),
])
def test_rollout_cli_input_errors_are_one_line_before_the_model_loads(tmp_path, content, message):
    """The model path does not exist: reaching the model load would end in its own error instead."""
    (tmp_path / "in.jsonl").write_bytes(content)
    with pytest.raises(SystemExit) as e:
        rollout_main(["--model", str(tmp_path / "no_model"), "--in", str(tmp_path / "in.jsonl"),
                      "--out", str(tmp_path / "out.jsonl")])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_read_jsonl_lines_and_errors(tmp_path):
    """The one JSONL reader every stage uses: rows with their line numbers, one-line errors."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert read_jsonl(str(good)) == [(1, {"a": 1}), (3, {"a": 2})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: not valid JSON \(Expecting value at column 7\)$"):
        read_jsonl(str(bad))
    bad.write_text('{"a": 1}\n\n{"a": "b\n')  # an unclosed string: json's message alone has no position
    with pytest.raises(SystemExit, match=r"bad.jsonl:3: not valid JSON \(Unterminated string starting at column 7\)$"):
        read_jsonl(str(bad))
    listed = tmp_path / "list.jsonl"
    listed.write_text('[1, 2]\n')
    with pytest.raises(SystemExit, match=r"list.jsonl:1: expected a JSON object, got list"):
        read_jsonl(str(listed))
    with pytest.raises(SystemExit, match=r"missing.jsonl: file does not exist"):
        read_jsonl(str(tmp_path / "missing.jsonl"))
    # not UTF-8: a UTF-16 export (its BOM on line 1), a Latin-1 byte on line 2 (was a traceback)
    wide = tmp_path / "utf16.jsonl"
    wide.write_bytes('{"a": 1}\n'.encode("utf-16"))
    with pytest.raises(SystemExit, match=r"utf16.jsonl:1: not UTF-8 text \(byte b'\\xff': invalid start byte\); save it as UTF-8$"):
        read_jsonl(str(wide))
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"a": "x"}\n{"a": "café"}\n'.encode("latin-1"))
    with pytest.raises(SystemExit, match=r"latin1.jsonl:2: not UTF-8 text"):
        read_jsonl(str(latin))
