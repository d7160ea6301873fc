"""JSONL and rows of a file or a hub split, with one-line errors naming the file and line.

    read_jsonl(path)                 [(line number, row dict)]: every stage's JSONL reader
    jsonl_rows(path)                 the rows alone; an empty file refused
    json_error, not_utf8             the one-line messages of a bad JSON line, a byte that is not UTF-8
    looks_like_hub_id, load_rows     a local JSONL file or a hub dataset split (evaluate.py's --data)
"""
import json
import os


def json_error(path, line, e):
    """The one-line message for a json.JSONDecodeError `e` at `line` of `path`, with its column
    (json's e.msg alone drops it, and some messages end in "at": "Unterminated string starting at")."""
    return f"{path}:{line}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"


def not_utf8(path, line, e):
    """The one-line message for a UnicodeDecodeError `e` at `line` of `path` (None: line unknown)."""
    where = f"{path}:{line}" if line is not None else path
    return f"{where}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r}: {e.reason}); save it as UTF-8"


def read_jsonl(path):
    """The JSON objects of a JSON-lines file with their 1-based line numbers; blank lines skipped.

    Every stage reads its JSONL inputs through this one function, so a bad line gets the same
    one-line error everywhere.

    Returns:
        list[(line_number int, row dict)], empty for a file with no rows.
    Raises:
        SystemExit naming the file and line: the file does not exist, a line is not UTF-8 text
        (e.g. a UTF-16 export), a line is not valid JSON, or a line is not a JSON object.
    """
    if os.path.isdir(path):
        raise SystemExit(f"{path}: a folder, not a .jsonl file")
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: file does not exist")
    rows = []
    with open(path, "rb") as f:  # bytes, decoded line by line, so a bad byte's line can be named
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SystemExit(not_utf8(path, n, e))
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # without the newline, e.colno points into the line
            except json.JSONDecodeError as e:
                raise SystemExit(json_error(path, n, e))
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append((n, row))
    return rows


def jsonl_rows(path):
    """The rows of a JSONL file (read_jsonl: one-line errors naming the line).

    Raises:
        SystemExit: the file is missing, empty, or a line is not a JSON object.
    """
    rows = [row for _, row in read_jsonl(path)]
    if not rows:
        raise SystemExit(f"{path}: file is empty")
    return rows


def looks_like_hub_id(path):
    """'owner/name' (one slash, not a relative or absolute path) -> True."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def load_rows(path, split="test", hub_config=None, flag="--data"):
    """The rows of a local JSONL file, or of a hub dataset split read with `datasets`.

    A path that is a file, or does not look like 'owner/name', is read as JSONL (read_jsonl's
    one-line errors). Returns list[dict].
    Raises:
        SystemExit (one line naming `flag` and the id): the hub dataset could not be loaded (no
            network, no such id or split), with the way out: a local JSONL copy.
    """
    if os.path.isfile(path) or not looks_like_hub_id(path):
        return jsonl_rows(path)
    import datasets  # here, not at the top: slow to import and only hub ids need it
    try:
        rows = list(datasets.load_dataset(path, hub_config, split=split))
    except Exception as e:  # no hub access, or no such dataset: one line, not a traceback
        raise SystemExit(f"{flag} {path}: no such file, and it could not be loaded as a hub dataset "
                         f"({type(e).__name__}; split {split!r}); offline? pass a local JSONL copy: {flag} FILE.jsonl")
    if not rows:
        raise SystemExit(f"{flag} {path}: split {split!r} is empty")
    return rows
