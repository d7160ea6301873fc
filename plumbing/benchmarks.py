"""The evaluation sets evaluate.py's commands read (docs/method.md §6): math problems, context-QA
items, the pairwise benchmark registry with its contamination rule, annotated judge-check items.

    load_math_problems(path, n, ...)       GSM8K / MATH-500 problems with their labels (`math`)
    load_qa_items(path, n, ...), QA_DEFAULTS, QA_PRESETS, parse_choices, gold_choice, qa_golds
                                           context-QA items, multiple choice included (`qa`)
    BENCHMARK_REGISTRY, BENCHMARKS, DEFAULT_BASE_RELEASE
                                           RM-NLHF Table 7's benchmarks and our local ones (`pairwise`)
    passes_contamination_rule, earliest_allowed, month_index, select_benchmarks, parse_sources,
    registry_entry_of_file                 which benchmarks a run evaluates (RM-NLHF App. G.1)
    benchmark_units, load_benchmark        where one is read from; a seeded subset of its pairs
    load_judge_check_items, JUDGE_CHECK_FIELDS
                                           annotated GRM critiques (`judge-check`)
    REPO, SHARED_DATA                      the repository root; ../shared/data beside it (RLME_SHARED_DATA)
"""
import os
import random
import re

from plumbing.items import clean_gsm8k_label, render_context
from plumbing.jsonl import jsonl_rows, load_rows
from plumbing.pairwise import load_pairwise


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


SHARED_DATA = os.environ.get("RLME_SHARED_DATA", os.path.join(REPO, "..", "shared", "data"))


def load_math_problems(path, n=None, split="test", hub_config=None):
    """Load GSM8K- or MATH-schema problems, the first `n` in file order.

    Args:
        path: a local JSONL file, or a hub id read with `datasets` (e.g. openai/gsm8k with
            hub_config='main').
    Returns:
        list of {"id", "question", "label", "answer_text", "kind": "gsm8k"|"math", "reference"}:
        GSM8K rows ({question, answer with '#### n'}) get the cleaned numeric label; MATH rows
        ({problem, answer}) keep the answer string. answer_text = the label, the reference answer a
        template's {answer} shows (as train.py's items).
    Raises:
        SystemExit: unknown schema (names the fields found), an empty file, or n larger than
            the number of problems.
    """
    rows = load_rows(path, split, hub_config)
    if n and n > len(rows):
        raise SystemExit(f"--n-problems {n}: {path} has only {len(rows)} problems")
    out = []
    for i, r in enumerate(rows[:n] if n else rows):
        if "question" in r and "answer" in r and "####" in str(r["answer"]):
            label = clean_gsm8k_label(r["answer"])
            out.append({"id": i, "question": r["question"], "label": label, "answer_text": label,
                        "kind": "gsm8k", "reference": r["answer"]})
        elif "problem" in r and "answer" in r:
            out.append({"id": r.get("unique_id", i), "question": r["problem"], "label": str(r["answer"]),
                        "answer_text": str(r["answer"]), "kind": "math", "reference": r.get("solution", "")})
        else:
            raise SystemExit(f"{path}: row {i + 1} has neither the GSM8K schema (question, answer with "
                             f"'####') nor the MATH schema (problem, answer); fields found: {sorted(r)}")
    return out


# Field defaults of `qa` (a flag, then --preset, then these).
QA_DEFAULTS = {"split": "test", "hub_config": None, "question_field": "question", "context_field": "context",
               "answer_field": "answer", "choices_field": None}


# --preset NAME: the data and fields of a known set. FaithEval-Counterfactual (Ming et al. 2024,
# arXiv 2410.03727; the RLME paper's out-of-domain QA test): 1,000 multiple-choice questions whose
# context states a counterfactual "fact"; the gold (answerKey) is the option the context supports.
# Rows: id, question, context, choices {"label": [...], "text": [...]}, answerKey, answer.
QA_PRESETS = {
    "faitheval": {"data": "Salesforce/FaithEval-counterfactual-v1.0", "split": "test", "hub_config": None,
                  "question_field": "question", "context_field": "context", "answer_field": "answerKey",
                  "choices_field": "choices"},
}


def parse_choices(value, where):
    """A multiple-choice field -> list of (label, text): the hub's {"label": [...], "text": [...]}
    (FaithEval, ARC) or a plain list of str (labelled A, B, C, ...).
    Raises SystemExit (one line naming `where`) for anything else."""
    if isinstance(value, dict) and isinstance(value.get("label"), list) and isinstance(value.get("text"), list) \
            and len(value["label"]) == len(value["text"]) and value["text"]:
        return [(str(lab), str(t)) for lab, t in zip(value["label"], value["text"])]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return [(chr(ord("A") + k), t) for k, t in enumerate(value)]
    raise SystemExit(f"{where}: expected {{'label': [...], 'text': [...]}} or a list of option texts, "
                     f"got {type(value).__name__} {value!r:.60}")


def gold_choice(choices, key, where):
    """Index of the gold option for answer key `key`: the option labelled `key`; else, when `key`
    is a capital letter and the labels are something else (ARC rows labelled 1-4 with key 'A'),
    its position (A = 0). Raises SystemExit naming `where` when neither exists."""
    labels = [lab for lab, _ in choices]
    if key in labels:
        return labels.index(key)
    if len(key) == 1 and "A" <= key <= "Z" and ord(key) - ord("A") < len(labels):
        return ord(key) - ord("A")
    raise SystemExit(f"{where}: answer key {key!r} is not one of the option labels {labels}")


def qa_golds(value, where):
    """An answer field -> non-empty list of str: a str, a list of str, or SQuAD's {"text": [...]}.
    Raises SystemExit naming `where` otherwise."""
    golds = value.get("text") if isinstance(value, dict) else value
    golds = [golds] if isinstance(golds, str) else golds
    if not isinstance(golds, list) or not golds or not all(isinstance(g, (str, int, float)) for g in golds):
        raise SystemExit(f"{where}: expected an answer string, a list of them or {{'text': [...]}}, got {value!r:.60}")
    return [str(g) for g in golds]


def load_qa_items(path, n=None, split="test", hub_config=None, question_field="question", context_field="context",
                  answer_field="answer", choices_field=None, context_max_chars=4000):
    """Context-QA items of a local JSONL file or a hub split, the first `n` in order.

    The context is render_context(row[context_field], context_max_chars) (a str, a list of
    str, or QA-Feedback's [title, sentence, ...] passages; RLME §4 cuts at 4,000 characters). The
    golds are the answer field (qa_golds). With `choices_field` (multiple choice, FaithEval) the
    answer field is the answer key: the options are listed under the question ("A) text" lines,
    so the model can name one), the gold is the key's option text and the accepted letters are its
    label and the key (gold_choice).
    Args: the --data / --split / --hub-config / --*-field / --context-max-chars flags.
    Returns:
        list of {"id", "question" (with the options when multiple choice), "context", "label"
        (list of gold str), "answer_text" (the first gold), "kind": "qa", "choice_letters"
        (list of str; multiple choice only)}.
    Raises:
        SystemExit (one line naming the row and flag): a missing field (the fields found listed),
        an unreadable context / answer / options field, n larger than the rows, no rows.
    """
    rows = load_rows(path, split, hub_config)
    if n and n > len(rows):
        raise SystemExit(f"--n-problems {n}: {path} has only {len(rows)} rows")
    fields = {"--question-field": question_field, "--context-field": context_field, "--answer-field": answer_field,
              "--choices-field": choices_field}
    items = []
    for i, r in enumerate(rows[:n] if n else rows):
        where = f"{path} row {i + 1}"
        for flag, f in fields.items():
            if f is not None and f not in r:
                raise SystemExit(f"{where}: no field {f!r} ({flag}); fields found: {sorted(r)}")
        try:
            context = render_context(r[context_field], context_max_chars)
        except ValueError as e:
            raise SystemExit(f"{where}: field {context_field!r} (--context-field): {e}")
        question = str(r[question_field])
        item = {"id": r.get("id", i), "question": question, "context": context, "kind": "qa"}
        if choices_field is None:
            item["label"] = qa_golds(r[answer_field], f"{where}: field {answer_field!r} (--answer-field)")
        else:
            choices = parse_choices(r[choices_field], f"{where}: field {choices_field!r} (--choices-field)")
            key = str(r[answer_field]).strip()
            k = gold_choice(choices, key, f"{where}: field {answer_field!r} (--answer-field)")
            item["question"] = question + "\nOptions:\n" + "\n".join(f"{lab}) {t}" for lab, t in choices)
            item["label"] = [choices[k][1]]
            item["choice_letters"] = list(dict.fromkeys([choices[k][0], key]))
        item["answer_text"] = item["label"][0]
        items.append(item)
    return items


# Pairwise benchmarks: name (what --benchmarks and --source take) -> how to read it.
#   title: the name in tables and JSON.  release: "YYYY-MM", as in RM-NLHF Table 7 (local-only
#   benchmarks: their paper's first arXiv month).  paper: "used" (Table 2's seven), "excluded"
#   (Table 7, too old for the paper's 2025-01 base models) or None (not in Table 7).
#   supported: whether this code can read it from its source.  local: folder under --data-root
#   (every .jsonl in it, schema detected per file), or None.  hub: {"id", "config", "split",
#   "schema"} for datasets.load_dataset, or None.  note: why it is not supported / what it holds.
# Order: Table 2's columns, then the rest of Table 7, then our local-only files.
NOT_AVAILABLE = "its data format is not available to us, so reward.py has no reader for it"


NOT_SET_UP = "no source set up here (the paper excludes it anyway)"


BENCHMARK_REGISTRY = {
    "helpsteer3": {"title": "HelpSteer3", "release": "2025-05", "paper": "used", "supported": True, "local": None,
                   "hub": {"id": "nvidia/HelpSteer3", "config": "preference", "split": "validation",
                           "schema": "helpsteer3"}, "note": "ties (overall_preference 0) dropped"},
    "reward_bench_2": {"title": "RewardBench 2", "release": "2025-06", "paper": "used", "supported": True,
                       "local": None, "hub": {"id": "allenai/reward-bench-2", "config": None, "split": "test",
                                              "schema": "reward_bench_2"},
                       "note": "best-of-4 per row, mean over subsets; Ties excluded"},
    "scan_hpd": {"title": "SCAN-HPD", "release": "2025-05", "paper": "used", "supported": False, "local": None,
                 "hub": None, "note": NOT_AVAILABLE},
    "href": {"title": "HREF", "release": "2024-12", "paper": "used", "supported": False, "local": None,
             "hub": None, "note": NOT_AVAILABLE},
    "litbench": {"title": "LitBench", "release": "2025-07", "paper": "used", "supported": False, "local": None,
                 "hub": None, "note": NOT_AVAILABLE},
    "wq_arena": {"title": "WQ-Arena", "release": "2025-04", "paper": "used", "supported": False, "local": None,
                 "hub": None, "note": NOT_AVAILABLE},
    "wpb": {"title": "WPB", "release": "2025-10", "paper": "used", "supported": False, "local": None,
            "hub": None, "note": NOT_AVAILABLE},
    "mt_bench": {"title": "MT-Bench", "release": "2023-06", "paper": "excluded", "supported": False, "local": None,
                 "hub": None, "note": NOT_SET_UP},
    "reward_bench": {"title": "RewardBench", "release": "2024-03", "paper": "excluded", "supported": False,
                     "local": None, "hub": None, "note": NOT_SET_UP},
    "rm_bench": {"title": "RM-Bench", "release": "2024-10", "paper": "excluded", "supported": True,
                 "local": "rm_bench", "hub": None, "note": "3x3 style grid per row, easy/normal/hard reported"},
    "ppe": {"title": "PPE", "release": "2024-10", "paper": "excluded", "supported": False, "local": None,
            "hub": None, "note": NOT_SET_UP},
    "judgebench": {"title": "JudgeBench", "release": "2024-10", "paper": "excluded", "supported": True,
                   "local": "judgebench", "hub": None, "note": ""},
    "rmb": {"title": "RMB", "release": "2024-10", "paper": "excluded", "supported": False, "local": None,
            "hub": None, "note": NOT_SET_UP},
    "llmbar": {"title": "LLMBar", "release": "2023-10", "paper": None, "supported": True, "local": "llmbar",
               "hub": None, "note": "with FairEval, LLMEval2 and MT-Bench human subsets"},
    "pandalm_testset": {"title": "PandaLM", "release": "2023-06", "paper": None, "supported": True,
                        "local": "pandalm_testset", "hub": None, "note": ""},
    "hh_rlhf_harmless_base": {"title": "HH-RLHF", "release": "2022-04", "paper": None, "supported": True,
                              "local": "hh_rlhf_harmless_base", "hub": None, "note": "harmless-base test split"},
}


# local folder -> title, to name explicitly passed files by their folder
BENCHMARKS = {b["local"]: b["title"] for b in BENCHMARK_REGISTRY.values() if b["local"]}


# The paper's base models (DeepSeek-R1-Distill-Qwen-7B/32B, -Llama-8B) were released 2025-01 (Table 7).
DEFAULT_BASE_RELEASE = "2025-01"


def month_index(s, what):
    """'YYYY-MM' -> months since year 0 (int), so that one month before is index - 1.
    Raises SystemExit naming `what` (e.g. '--base-release') when `s` is not YYYY-MM."""
    m = re.fullmatch(r"(\d{4})-(\d{2})", str(s))
    if not m or not 1 <= int(m.group(2)) <= 12:
        raise SystemExit(f"{what} {s!r}: expected a month as YYYY-MM, e.g. 2025-01")
    return int(m.group(1)) * 12 + int(m.group(2)) - 1


def passes_contamination_rule(release, base_release):
    """RM-NLHF App. G.1: a benchmark counts only if released no earlier than one month before the
    base model (release >= base - 1 month). With 2025-01 bases, HREF (2024-12) is in and
    JudgeBench (2024-10) is out, as Table 7's marks say; Table 7's caption words it the other way
    round ("released within 1 month before ... are excluded"), but the text and the marks agree
    with this rule, so we follow them. Args: 'YYYY-MM' strings. Returns: bool."""
    return month_index(release, "release") >= month_index(base_release, "--base-release") - 1


def earliest_allowed(base_release):
    """The earliest release month that passes the rule for `base_release` ('YYYY-MM')."""
    k = month_index(base_release, "--base-release") - 1
    return f"{k // 12:04d}-{k % 12 + 1:02d}"


def parse_sources(specs):
    """--source NAME=PATH (repeatable) -> {name: path}. Raises SystemExit for a spec without '=',
    an unknown NAME or a PATH that does not exist."""
    out = {}
    for s in specs or []:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--source {s!r}: expected NAME=PATH")
        if name not in BENCHMARK_REGISTRY:
            raise SystemExit(f"--source {s}: unknown benchmark {name!r}; known: {', '.join(BENCHMARK_REGISTRY)}")
        if not os.path.exists(path):
            raise SystemExit(f"--source {s}: {path} does not exist")
        out[name] = path
    return out


def select_benchmarks(names=None, files=(), base_release=DEFAULT_BASE_RELEASE, sources=None):
    """Which benchmarks `pairwise` evaluates (RM-NLHF App. G.1, Table 7).

    Default (no names, no files): every registry benchmark we can read (supported, or given a
    --source) that passes the contamination rule for `base_release`. Explicit names / files are
    taken as asked; one failing the rule gets a warning line, not a refusal.
    Args:
        names: list of registry names (--benchmarks) or None. files: explicit file paths.
        base_release: 'YYYY-MM' of the base model. sources: {name: local path} (--source).
    Returns:
        {"mode": "default"|"explicit", "rule": str, "chosen": [registry names], "files": [paths],
         "left_out": {name: why} (default mode), "warnings": [one-line str], "notes": [one-line str]}
    Raises:
        SystemExit (one line): an unknown or unsupported name, or nothing left by the rule.
    """
    sources = sources or {}
    floor = earliest_allowed(base_release)
    rule = f"released {floor} or later (one month before --base-release {base_release})"
    sel = {"mode": "explicit" if names is not None or files else "default", "rule": rule, "chosen": [],
           "files": list(files), "left_out": {}, "warnings": [], "notes": []}

    def warn(title, release):
        sel["warnings"].append(f"warning: {title} (released {release}) fails the contamination rule: not {rule}; "
                               f"evaluated because you asked for it (RM-NLHF App. G.1)")
    if sel["mode"] == "default":
        for name, b in BENCHMARK_REGISTRY.items():
            if not (b["supported"] or name in sources):
                sel["left_out"][name] = f"not supported here: {b['note']}"
            elif not passes_contamination_rule(b["release"], base_release):
                sel["left_out"][name] = f"not {rule}"
            else:
                sel["chosen"].append(name)
        if not sel["chosen"]:
            raise SystemExit(f"no benchmark left: none we can read is {rule}; pass --benchmarks NAME or files "
                             f"to evaluate older ones anyway")
        return sel
    for name in names or []:
        b = BENCHMARK_REGISTRY.get(name)
        if b is None:
            raise SystemExit(f"--benchmarks {name}: unknown; known: {', '.join(BENCHMARK_REGISTRY)}")
        if not (b["supported"] or name in sources):
            raise SystemExit(f"--benchmarks {name}: {b['title']} is not supported here ({b['note']}); "
                             f"--source {name}=PATH reads a copy converted to a PAIR_SCHEMAS schema")
        if not passes_contamination_rule(b["release"], base_release):
            warn(b["title"], b["release"])
        sel["chosen"].append(name)
    for path in files:
        entry = registry_entry_of_file(path)
        if entry is None:
            sel["notes"].append(f"note: {path}: release month unknown, contamination rule not checked")
        elif not passes_contamination_rule(entry["release"], base_release):
            warn(f"{entry['title']} file {path}", entry["release"])
    return sel


def registry_entry_of_file(path):
    """The registry entry whose local folder holds `path` (matched by folder name), or None."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return next((b for b in BENCHMARK_REGISTRY.values() if b["local"] == folder), None)


def benchmark_units(name, data_root=SHARED_DATA, sources=None):
    """Where registry benchmark `name` is read from, as units (one file or one hub split each).

    --source NAME=PATH wins (a file, or every .jsonl of a folder; read with the registry's hub
    schema when it has one, else schema auto); then the local folder under `data_root`; then the hub.
    Returns:
        list of {"name", "benchmark" (title), "file" (short tag), "path" (file or hub id),
                 "schema", "split", "config", "hub": bool}.
    Raises:
        SystemExit: a local folder with no .jsonl files.
    """
    b = BENCHMARK_REGISTRY[name]
    src = (sources or {}).get(name)
    base = {"name": name, "benchmark": b["title"], "split": "train", "config": None, "hub": False}
    if src or b["local"]:
        where = src or os.path.join(data_root, b["local"])
        files = (sorted(os.path.join(where, f) for f in os.listdir(where) if f.endswith(".jsonl"))
                 if os.path.isdir(where) else [where] if src else [])
        if not files:
            raise SystemExit(f"benchmark {name}: no .jsonl files in {where} "
                             f"({'--source' if src else '--data-root'})")
        schema = b["hub"]["schema"] if src and b["hub"] else "auto"
        return [dict(base, file=os.path.splitext(os.path.basename(f))[0], path=f, schema=schema) for f in files]
    hub = b["hub"]
    return [dict(base, file=hub["split"], path=hub["id"], schema=hub["schema"], split=hub["split"],
                 config=hub["config"], hub=True)]


def load_benchmark(path, n, seed, schema="auto", split="train", config_name=None):
    """Up to `n` pairwise items of one file or hub split via load_pairwise (which
    randomises the A/B order per item with `seed`, detects the schema and fails with one line
    naming the file and the fields found, or the hub id when it cannot be loaded).

    A subset is a seeded random sample in file order, not the first n items: RM-Bench gives 9
    style pairs per row and JudgeBench is sorted by source, so a prefix would cover one row or
    one category. Items that belong to a group (meta "group": RewardBench 2 gives 3 pairs per
    row, scored together by best_of_group_accuracy) are sampled by whole groups, and `n` counts
    groups. n = 0 or None: all items.
    Returns: list of load_pairwise items.
    Raises SystemExit for a missing/empty file, an unknown schema or an unreachable hub dataset.
    """
    if path.endswith(".jsonl"):
        jsonl_rows(path)  # one-line errors for a missing or empty file
    items = load_pairwise(path, schema=schema, seed=seed, split=split, config_name=config_name)
    if not items:
        raise SystemExit(f"{path}: no usable pairwise items (ties only?)")
    grouped = all("group" in (it.get("meta") or {}) for it in items)
    units = list(dict.fromkeys(it["meta"]["group"] for it in items)) if grouped else list(range(len(items)))
    if n and n < len(units):
        keep = sorted(random.Random(f"{seed}:{path}").sample(range(len(units)), n))
        if grouped:
            kept = {units[i] for i in keep}
            items = [it for it in items if it["meta"]["group"] in kept]
        else:
            items = [items[i] for i in keep]
    return items


JUDGE_CHECK_FIELDS = ("context", "response_a", "response_b", "human_critique", "critique", "label")


def load_judge_check_items(path):
    """Annotated GRM critiques, one JSON object per line with the fields JUDGE_CHECK_FIELDS:
    the pair (context, response_a, response_b), the human critique h, the GRM critique ĉ and label
    z (1 = the critique is correct, 0 = it is not; RM-NLHF App. E's annotation). Returns the list
    of dicts (an "id" added where missing). SystemExit (one line naming the file, line and field)
    on a missing field or a label other than 0/1."""
    items = jsonl_rows(path)
    if not items:
        raise SystemExit(f"{path}: no items")
    for n, it in enumerate(items, 1):
        for f in JUDGE_CHECK_FIELDS:
            if f not in it:
                raise SystemExit(f"{path} line {n}: missing field {f!r} (needs {', '.join(JUDGE_CHECK_FIELDS)})")
        if it["label"] not in (0, 1) or isinstance(it["label"], bool):
            raise SystemExit(f"{path} line {n}: field 'label' must be 0 or 1, got {it['label']!r}")
        it.setdefault("id", f"line{n}")
    return items
