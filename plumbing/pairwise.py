"""RM-NLHF's pairwise data (docs/method.md §5.1): the schemas of the files we read, one item dict
per pair with its A/B order drawn per item, and D_H / D_O / the validation pairs of a run.

    PAIR_SCHEMAS, PROMPT_FIELDS, detect_schema    the schemas and how a row's fields pick one
    load_pairwise(path_or_hub_id, schema, seed, ...)
                                                  items {id, context, response_a, response_b, winner,
                                                  critique, source, meta} of a file, folder or hub split
    finalize_pair, structured_critique, render_turns
                                                  the A/B shuffle, a per-response critique as text,
                                                  a conversation as text
    split_dh_do, load_nlhf_items, load_dh_items, load_do_items, load_nlhf_val_items
                                                  D_H and D_O of an rm_nlhf run; its held-out pairs
    _read_rows, _raw_pairs, _rm_nlhf_pair, _trl_pair, _mr_ben_pairs, ...
                                                  the per-schema readers behind load_pairwise
"""
import glob
import json
import os
import random
import re

from plumbing.items import is_chat_messages, val_draw
from plumbing.jsonl import json_error, not_utf8, read_jsonl


# Required fields per schema; `detect_schema` tries them in this order (HelpSteer3 before the
# generic one: some HelpSteer3 derivatives also carry `chosen`/`rejected`).
PAIR_SCHEMAS = {
    "rm_nlhf": ("extra_info",),                         # the RM-NLHF authors' release (Tongyi-ConvAI/RM-NLHF)
    "helpsteer3": ("context", "response1", "response2", "overall_preference"),
    "mr_ben": ("Question_UUID", "Question", "Model_Solution_Steps", "Model_Solution_Correctness"),
    "pandalm": ("instruction", "response1", "response2", "annotator1", "annotator2", "annotator3"),
    "llmbar": ("input", "output_1", "output_2", "label"),
    "judgebench": ("question", "response_A", "response_B", "label"),
    "trl_conversational": ("chosen", "rejected"),       # chosen/rejected: chat messages (TRL), + optional prompt
    "reward_bench_2": ("prompt", "chosen", "rejected", "num_correct"),  # 1 chosen vs 3 rejected
    "rm_bench": ("prompt", "chosen", "rejected"),        # chosen/rejected: list of 3 styles (str)
    "chosen_rejected": ("chosen", "rejected"),          # + optional prompt, optional critique
}


# The field each schema's context (the prompt) comes from, for the error on an empty one
PROMPT_FIELDS = {"rm_nlhf": "extra_info.context", "helpsteer3": "context", "mr_ben": "Question",
                 "pandalm": "instruction", "llmbar": "input", "judgebench": "question",
                 "trl_conversational": "prompt", "reward_bench_2": "prompt", "rm_bench": "prompt",
                 "chosen_rejected": "prompt"}


def detect_schema(row, where):
    """Schema name of one row from its field names (docs/method.md §5.1), and for the ones that
    share `chosen`/`rejected`, their types: chat messages -> trl_conversational, a list of str
    with a prompt -> rm_bench (reward_bench_2 also has num_correct), str -> chosen_rejected.

    Args:
        row: dict, the first row of a file. where: str, 'file:line' for the error message.
    Returns:
        str, a key of PAIR_SCHEMAS.
    Raises:
        SystemExit naming the file and the fields found when nothing matches.
    """
    if not isinstance(row, dict):
        raise SystemExit(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    for name, fields in PAIR_SCHEMAS.items():
        if all(f in row for f in fields):
            if name == "trl_conversational" and not is_chat_messages(row["chosen"]):
                continue
            if name == "rm_bench" and not (isinstance(row["chosen"], list)
                                           and all(isinstance(c, str) for c in row["chosen"])):
                continue  # plain chosen/rejected strings with a prompt field: the generic schema
            return name
    raise SystemExit(f"{where}: unknown pairwise schema, fields found: {sorted(row)}; "
                     f"known: {', '.join(PAIR_SCHEMAS)}")


def _read_rows(path, split="train", config_name=None):
    """Rows of a local .jsonl/.json file, a folder of them, or a hub dataset.

    Returns list[(file, where, row)] with where = 'file:line' (or 'hub_id[split] row N') so every
    later error can name the exact place. Local JSON is read with the json module (datasets would
    lose the line numbers); other local formats and hub ids go through datasets.load_dataset.
    """
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.json")))
        if not files:
            raise SystemExit(f"{path}: folder has no .jsonl or .json files")
        return [r for f in files for r in _read_rows(f, split, config_name)]
    if path.endswith(".jsonl"):
        return [(path, f"{path}:{n}", row) for n, row in read_jsonl(path)]
    if path.endswith(".json"):
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: file does not exist")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(json_error(path, e.lineno, e))
        except UnicodeDecodeError as e:
            raise SystemExit(not_utf8(path, None, e))
        if isinstance(data, list):
            return [(path, f"{path} element {i}", r) for i, r in enumerate(data)]
        if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
            # upstream Mr-Ben layout: {Question_UUID: [solution records]}
            return [(path, f"{path} [{k!r}][{j}]", r) for k, v in data.items() for j, r in enumerate(v)]
        raise SystemExit(f"{path}: expected a JSON array of rows (or JSONL)")
    import datasets  # here, not at the top: slow to import and only hub ids / other formats need it
    try:
        if os.path.isfile(path):  # .parquet / .csv / ...
            ds = datasets.load_dataset(path.rsplit(".", 1)[-1], data_files=path, split="train")
        elif path.startswith((".", "/", "~")):
            raise SystemExit(f"{path}: file does not exist")
        else:
            ds = datasets.load_dataset(path, config_name, split=split)
    except SystemExit:
        raise
    except Exception as e:  # the hub, the network or the file format: one line, no trace
        raise SystemExit(f"{path}: could not be loaded with datasets ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})")
    return [(path, f"{path}[{split}] row {i}", r) for i, r in enumerate(ds)]


def _need(row, field, where, schema, kind=str):
    """row[field], checked to be present and of type `kind`; else a one-line SystemExit.
    For kind=str a JSON scalar is turned into text (6 PandaLM rows hold `true` as a response)."""
    v = row.get(field)
    if v is None:
        raise SystemExit(f"{where}: missing field {field!r} (schema {schema})")
    if kind is str and isinstance(v, (bool, int, float)):
        return str(v)
    if kind is not None and not isinstance(v, kind):
        raise SystemExit(f"{where}: field {field!r} must be {getattr(kind, '__name__', kind)}, "
                         f"got {type(v).__name__} (schema {schema})")
    return v


def render_turns(turns, where):
    """A conversation as plain text. str -> itself; list of {role, content} -> 'User: ...' /
    'Assistant: ...' blocks separated by blank lines (HelpSteer3 `context`)."""
    if isinstance(turns, str):
        return turns
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "content" in t for t in turns):
        raise SystemExit(f"{where}: field 'context' must be a string or a list of {{role, content}} turns")
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    return "\n\n".join(f"{names.get(t.get('role'), str(t.get('role')).title())}: {t['content']}" for t in turns)


def _split_hh(chosen, rejected):
    """hh-rlhf: the prompt is embedded in both transcripts ('\\n\\nHuman: ...\\n\\nAssistant: ...').
    Context = the common part up to the last '\\n\\nAssistant:' that both share; responses = what
    follows it. Using the longest common prefix (not chosen.rfind) handles the 5 rows of the
    harmless-base test split whose chosen response itself contains '\\n\\nAssistant:'."""
    marker = "\n\nAssistant:"
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    cut = chosen.rfind(marker, 0, k)
    if cut < 0:
        return None
    context = chosen[:cut].strip()
    return context, chosen[cut + len(marker):].strip(), rejected[cut + len(marker):].strip()


def _text_field(value, where, field):
    """A critique part as text: a string, or a list of strings (one point per line)."""
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(v.strip() for v in value if v.strip())
    if not isinstance(value, str):
        raise SystemExit(f"{where}: field {field!r} must be a string or a list of strings, got {type(value).__name__}")
    return value.strip()


# The released data's critique parts, per response (reward_function.py of the authors' release)
STRUCTURED_KEYS = ("strengths_A", "weaknesses_A", "strengths_B", "weaknesses_B")


def _rm_nlhf_pair(where, row, stem, n):
    """One row of the RM-NLHF authors' released data (hub: Tongyi-ConvAI/RM-NLHF; read by their
    Character-GenRM-NLHF code in liudan193/Qwen-Character). Everything is in `extra_info` (a dict
    or its JSON text): context (list of {role, content} or str), response_A, response_B, winner
    'A'|'B', dataset_type, and for rows with human feedback processed_critique = {strengths_A,
    weaknesses_A, strengths_B, weaknesses_B}. A row without those parts is a D_O row."""
    info = row["extra_info"]
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{where}: field 'extra_info' is not valid JSON ({e.msg})")
    if not isinstance(info, dict):
        raise SystemExit(f"{where}: field 'extra_info' must be an object (schema rm_nlhf)")
    schema = "rm_nlhf"
    turns = _need(info, "context", where, schema, kind=None)
    winner = _need(info, "winner", where, schema)
    if winner not in ("A", "B"):
        raise SystemExit(f"{where}: field 'extra_info.winner' must be 'A' or 'B', got {winner!r}")
    parts, pc = None, info.get("processed_critique")
    if isinstance(pc, dict) and any(_text_field(pc.get(k), where, k) for k in STRUCTURED_KEYS):
        # 'Response A/B' (or 'Chatbot A/B') inside a part -> 'Response 1/2', relabelled after the shuffle
        ab = lambda t: re.sub(r"\b(?:[Rr]esponse|[Cc]hatbot)\s*([AB])\b",
                              lambda m: f"Response {'1' if m.group(1) == 'A' else '2'}", t)
        parts = {k: {kind: ab(_text_field(pc.get(f"{kind}_{letter}"), where, f"{kind}_{letter}"))
                     for kind in ("strengths", "weaknesses")} for k, letter in ((1, "A"), (2, "B"))}
    meta = {"dataset_type": info.get("dataset_type")}
    if isinstance(turns, list):
        meta["turns"] = turns
    return [{"id": str(info.get("id", row.get("id", f"{stem}:{n}"))), "context": render_turns(turns, where),
             "r1": _need(info, "response_A", where, schema), "r2": _need(info, "response_B", where, schema),
             "winner": 1 if winner == "A" else 2, "critique": None, "critique_parts": parts,
             "source": f"{schema}/{stem}", "meta": meta}]


def structured_critique(parts):
    """A human critique kept per response (RM-NLHF §2.3's human critiques; the authors' released
    data stores them as strengths and weaknesses of A and of B) as the text the judge reads:

        Response A strengths: ...
        Response A weaknesses: ...
        Response B strengths: ...
        Response B weaknesses: ...

    Args: parts: {"A": {"strengths": str, "weaknesses": str}, "B": {...}} (empty -> "none noted").
    Returns: str."""
    return "\n".join(f"Response {letter} {kind}: {parts[letter][kind].strip() or 'none noted'}"
                     for letter in "AB" for kind in ("strengths", "weaknesses"))


def _raw_pairs(schema, where, row, stem, n):
    """One row (the n-th of its file, 0-based; default id '<stem>:<n>') -> list of 'raw' pairs in
    the row's own order: {id, context, r1, r2, winner: 1|2, critique (refers to 'Response 1'/
    'Response 2') or None, optional critique_parts {1: {strengths, weaknesses}, 2: {...}}
    (a critique kept per response; finalize_pair renders it), source, meta}. [] = dropped (tie).
    Mr-Ben is built per question in `_mr_ben_pairs` instead."""
    src = f"{schema}/{stem}"
    base = {"critique": None, "source": src, "meta": {}}
    if schema == "rm_nlhf":
        return _rm_nlhf_pair(where, row, stem, n)
    if schema == "reward_bench_2":
        # RewardBench 2: 1 chosen vs 3 rejected; one pair per rejected response, grouped by the
        # row id (meta.group) so an evaluation can apply its best-of-4 rule (the chosen response
        # must win all three). Ties rows (several right answers, scored by their own rule) are
        # dropped.
        if row.get("subset") == "Ties":
            return []
        chosen = _need(row, "chosen", where, schema, kind=list)
        rejected = _need(row, "rejected", where, schema, kind=list)
        if len(chosen) != 1 or not rejected or not all(isinstance(s, str) for s in chosen + rejected):
            raise SystemExit(f"{where}: fields 'chosen'/'rejected' must be lists of strings, one chosen (schema {schema})")
        group = str(row.get("id", f"{stem}:{n}"))
        return [dict(base, id=f"{group}:{k}", context=render_turns(_need(row, "prompt", where, schema, kind=None), where),
                     r1=chosen[0], r2=r, winner=1, meta={"subset": row.get("subset"), "group": group,
                                                         "group_size": len(rejected)})
                for k, r in enumerate(rejected)]
    if schema == "helpsteer3":
        pref = _need(row, "overall_preference", where, schema, kind=int)
        if isinstance(pref, bool) or not -3 <= pref <= 3:
            raise SystemExit(f"{where}: field 'overall_preference' must be an integer in -3..3, got {pref!r}")
        if pref == 0:
            return []  # tie: no winner to learn (docs/method.md §5.1)
        # the annotators' reasonings are comparative ("@Response 1 is better because ..."), not
        # per response, so they stay one text (docs/method.md §5.1); the authors' release holds
        # them split per response (schema rm_nlhf)
        reasons = [p.get("reasoning") for p in row.get("individual_preference") or [] if isinstance(p, dict)]
        critique = "\n".join(r.strip() for r in reasons if isinstance(r, str) and r.strip()) or None
        turns = _need(row, "context", where, schema, kind=None)
        meta = {"overall_preference": pref, **({"turns": turns} if isinstance(turns, list) else {})}
        return [dict(base, id=str(row.get("id", f"{stem}:{n}")), context=render_turns(turns, where),
                     r1=_need(row, "response1", where, schema), r2=_need(row, "response2", where, schema),
                     winner=1 if pref < 0 else 2,  # negative = response1 better (HelpSteer3 card)
                     critique=critique, meta=meta)]
    if schema == "pandalm":
        votes = [_need(row, f"annotator{k}", where, schema, kind=int) for k in (1, 2, 3)]
        if any(v not in (0, 1, 2) for v in votes):
            raise SystemExit(f"{where}: annotator labels must be 0, 1 or 2, got {votes}")
        top = max((1, 2), key=votes.count)
        if votes.count(top) < 2:
            return []  # no majority for either response (or majority tie '0'): dropped
        context = _need(row, "instruction", where, schema)
        if row.get("input"):
            context += "\n\n" + row["input"]
        return [dict(base, id=f"pandalm:{row.get('idx', n)}", context=context,
                     r1=_need(row, "response1", where, schema), r2=_need(row, "response2", where, schema),
                     winner=top, meta={"votes": votes})]
    if schema == "llmbar":
        label = _need(row, "label", where, schema, kind=int)
        if label not in (1, 2):
            raise SystemExit(f"{where}: field 'label' must be 1 or 2, got {label!r}")
        return [dict(base, id=f"{stem}:{n}", context=_need(row, "input", where, schema),
                     r1=_need(row, "output_1", where, schema), r2=_need(row, "output_2", where, schema),
                     winner=label)]
    if schema == "judgebench":
        label = _need(row, "label", where, schema)
        if label not in ("A>B", "B>A"):
            if label in ("A=B", "B=A"):
                return []
            raise SystemExit(f"{where}: field 'label' must be 'A>B' or 'B>A', got {label!r}")
        return [dict(base, id=str(row.get("pair_id", f"{stem}:{n}")), context=_need(row, "question", where, schema),
                     r1=_need(row, "response_A", where, schema), r2=_need(row, "response_B", where, schema),
                     winner=1 if label == "A>B" else 2, meta={"category": row.get("source")})]
    if schema in ("rm_bench", "chosen_rejected") and is_chat_messages(row.get("chosen")):
        raise SystemExit(f"{where}: field 'chosen' holds chat messages (TRL's conversational preference format), "
                         f"not schema {schema}'s; read it with schema trl_conversational (or auto)")
    if schema == "trl_conversational":
        return _trl_pair(where, row, stem, n)
    if schema == "rm_bench":
        chosen = _need(row, "chosen", where, schema, kind=list)
        rejected = _need(row, "rejected", where, schema, kind=list)
        if not chosen or len(chosen) != len(rejected) or not all(isinstance(s, str) for s in chosen + rejected):
            raise SystemExit(f"{where}: fields 'chosen'/'rejected' must be equal-length lists of strings")
        # the full style grid (upstream scoring): i > j easy, i == j normal, i < j hard accuracy,
        # with 0 concise, 1 detailed plain, 2 detailed markdown
        return [dict(base, id=f"{stem}:{row.get('id', n)}:{i}{j}", context=_need(row, "prompt", where, schema),
                     r1=c, r2=r, winner=1, meta={"subset": row.get("subset"), "chosen_style": i, "rejected_style": j})
                for i, c in enumerate(chosen) for j, r in enumerate(rejected)]
    if schema == "chosen_rejected":
        chosen, rejected = _need(row, "chosen", where, schema), _need(row, "rejected", where, schema)
        if row.get("prompt") is not None:
            context = render_turns(row["prompt"], where)
        else:  # hh-rlhf: prompt embedded in the transcripts
            split = _split_hh(chosen, rejected)
            if split is None:
                raise SystemExit(f"{where}: no 'prompt' field and no '\\n\\nAssistant:' turn in "
                                 f"'chosen'/'rejected' (schema {schema}; TRL's implicit-prompt format with "
                                 f"plain text is read only as hh-rlhf transcripts: add a 'prompt' field)")
            context, chosen, rejected = split
        if chosen == rejected:
            return []
        critique = row.get("critique")
        return [dict(base, id=str(row.get("id", f"{stem}:{n}")), context=context,
                     r1=chosen, r2=rejected, winner=1,
                     critique=critique.strip() or None if isinstance(critique, str) else None)]
    raise SystemExit(f"{where}: schema {schema!r} unknown; known: {', '.join(PAIR_SCHEMAS)}")


def _trl_pair(where, row, stem, n):
    """One row of TRL's conversational preference format (TRL docs, "Dataset formats"): explicit
    prompt {prompt: [messages], chosen: [messages], rejected: [messages]}, or implicit prompt
    {chosen: [conversation], rejected: [conversation]} whose shared leading messages are the
    prompt. -> one raw pair: context = the prompt turns as text (render_turns; meta.turns keeps
    them, as for HelpSteer3), r1 = the chosen reply, r2 = the rejected one, winner 1 (finalize_pair
    then draws the A/B order); an optional 'critique' string as in chosen_rejected. Each
    completion must be one assistant message: a pair compares two replies to one context, so a
    completion of several messages (turns, tool calls) has no faithful mapping and is refused.
    [] (dropped) when both replies are the same."""
    fmt = "TRL's conversational preference format"
    for f in ("chosen", "rejected"):
        if not is_chat_messages(row.get(f)):
            raise SystemExit(f"{where}: field {f!r} must be a list of chat messages {{role, content}} ({fmt}), "
                             f"got {type(row.get(f)).__name__} {row.get(f)!r:.60}")
    # role and content only: datasets gives every message the keys any message has (None elsewhere)
    chosen, rejected = ([{"role": m["role"], "content": m["content"]} for m in row[f]] for f in ("chosen", "rejected"))
    prompt = row.get("prompt")
    if prompt is not None:
        if not (isinstance(prompt, str) or is_chat_messages(prompt)):
            raise SystemExit(f"{where}: field 'prompt' must be a string or a list of chat messages ({fmt}), "
                             f"got {type(prompt).__name__} {prompt!r:.60}")
        turns = prompt if isinstance(prompt, str) else [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:  # implicit prompt: the messages both conversations begin with
        k = 0
        while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
            k += 1
        if k == 0:
            raise SystemExit(f"{where}: no 'prompt' field, and 'chosen' and 'rejected' share no leading message "
                             f"({fmt}, implicit prompt)")
        turns, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    if chosen == rejected:
        return []
    for f, msgs in (("chosen", chosen), ("rejected", rejected)):
        if len(msgs) != 1 or msgs[0]["role"] != "assistant":
            raise SystemExit(f"{where}: the {f} completion is {[m['role'] for m in msgs]} messages; a pairwise item "
                             f"needs one assistant reply each ({fmt})")
    critique = row.get("critique")
    return [{"id": str(row.get("id", f"{stem}:{n}")), "context": render_turns(turns, where),
             "r1": chosen[0]["content"], "r2": rejected[0]["content"], "winner": 1,
             "critique": critique.strip() or None if isinstance(critique, str) else None,
             "source": f"trl_conversational/{stem}", "meta": {"turns": turns} if isinstance(turns, list) else {}}]


def _empty_prompt(pair):
    """True when a raw pair's context is blank (a conversation: every turn's content blank)."""
    turns = pair["meta"].get("turns")
    if isinstance(turns, list):
        return not any(isinstance(t, dict) and str(t.get("content") or "").strip() for t in turns)
    return not pair["context"].strip()


def _mr_ben_pairs(rows, stem):
    """Mr-Ben math as D_H: for every question, every (correct, incorrect) pair of its solutions.
    Critique, kept per response (structured_critique): the correct solution's strength is being
    correct; the incorrect one's weakness is its first error step and the human error reasons
    (`Model_Solution_Error_Reason`, one per annotator). 306 questions on disk give 192 pairs
    (58 questions with 1 correct of 3 and 38 with 2 of 3, each giving 2 pairs)."""
    by_q = {}
    for where, row in rows:
        for f in PAIR_SCHEMAS["mr_ben"]:
            _need(row, f, where, "mr_ben", kind=None)
        if not str(row["Question"]).strip():
            raise SystemExit(f"{where}: the prompt field 'Question' is empty (schema mr_ben)")
        if row["Model_Solution_Correctness"] not in ("correct", "incorrect"):
            raise SystemExit(f"{where}: field 'Model_Solution_Correctness' must be 'correct' or "
                             f"'incorrect', got {row['Model_Solution_Correctness']!r}")
        if row["Model_Solution_Correctness"] == "incorrect":
            reasons = row.get("Model_Solution_Error_Reason")
            if not isinstance(reasons, list) or not any(isinstance(r, str) and r.strip() for r in reasons):
                raise SystemExit(f"{where}: incorrect solution without 'Model_Solution_Error_Reason' texts")
        by_q.setdefault(row["Question_UUID"], []).append((where, row))
    pairs = []
    for qid, sols in by_q.items():
        good = [r for _, r in sols if r["Model_Solution_Correctness"] == "correct"]
        bad = [r for _, r in sols if r["Model_Solution_Correctness"] == "incorrect"]
        for g in good:
            for b in bad:
                step = b.get("Model_Solution_First_Error_Step")
                reasons = [r.strip() for r in b["Model_Solution_Error_Reason"] if isinstance(r, str) and r.strip()]
                parts = {1: {"strengths": "Its solution is correct.", "weaknesses": ""},
                         2: {"strengths": "", "weaknesses": f"Its solution is incorrect; the first error is in step {step}. "
                                                            + " ".join(reasons)}}
                context = g["Question"] + ("\n\nOptions:\n" + g["Options"].strip() if g.get("Options") else "")
                pairs.append({"id": f"{qid}:{g.get('Sampled_Model')}>{b.get('Sampled_Model')}",
                              "context": context, "r1": "\n".join(g["Model_Solution_Steps"]),
                              "r2": "\n".join(b["Model_Solution_Steps"]), "winner": 1, "critique": None,
                              "critique_parts": parts,
                              "source": f"mr_ben/{stem}",
                              "meta": {"first_error_step": step, "subject": g.get("Subject")}})
    return pairs


def _relabel(text, one, two):
    """Rewrite '(@)Response 1/2' references in a critique to the final letters (HelpSteer3
    reasonings say '@Response 1'); the judge matches stance per response, so the letters in the
    human critique must follow the A/B shuffle."""
    return re.sub(r"@?\b[Rr]esponse\s*([12])\b", lambda m: f"Response {one if m.group(1) == '1' else two}", text)


def finalize_pair(raw, seed, shuffle=True):
    """Raw pair (r1, r2, winner 1|2) -> the public dict, A/B order randomised per item.

    The coin for an item is random.Random(f'{seed}:{id}') (string seeds are hashed with SHA-512,
    so the order is stable across runs and independent of which other rows were loaded).

    Returns:
        {"id", "context", "response_a", "response_b", "winner": "A"|"B", "critique": str|None,
         "source", "meta"}
    """
    swap = shuffle and random.Random(f"{seed}:{raw['id']}").random() < 0.5
    a, b = (raw["r2"], raw["r1"]) if swap else (raw["r1"], raw["r2"])
    winner = ("A" if raw["winner"] == 1 else "B") if not swap else ("B" if raw["winner"] == 1 else "A")
    one, two = ("B", "A") if swap else ("A", "B")  # the final letters of response 1 and response 2
    critique = raw["critique"]
    if critique is not None:
        critique = _relabel(critique, one, two)
    if raw.get("critique_parts"):
        parts = {letter: {k: _relabel(v, one, two) for k, v in raw["critique_parts"][n].items()}
                 for n, letter in ((1, one), (2, two))}
        critique = structured_critique(parts)
    return {"id": raw["id"], "context": raw["context"], "response_a": a, "response_b": b, "winner": winner,
            "critique": critique, "source": raw["source"], "meta": dict(raw["meta"], swapped=swap)}


def load_pairwise(path_or_hub_id, schema="auto", seed=0, shuffle=True, split="train", max_items=None,
                  stats=None, config_name=None):
    """Load pairwise preference items (docs/method.md §5.1).

    Args:
        path_or_hub_id: local .jsonl/.json (or .parquet/.csv), a folder of .jsonl/.json files, or
            a Hugging Face dataset id (read with datasets.load_dataset(id, config_name, split=split);
            HelpSteer3: 'nvidia/HelpSteer3', its default config is the preference subset).
        schema: 'auto' (per file, from the first row's field names) or a key of PAIR_SCHEMAS:
            helpsteer3 (overall_preference < 0: response1 wins; 0: tie, dropped; critique =
            individual_preference[].reasoning joined by newlines), rm_nlhf (the RM-NLHF authors'
            release: extra_info with response_A/B, winner and a per-response processed_critique,
            see _rm_nlhf_pair), mr_ben (correct-vs-incorrect pairs, critique per response =
            human error reasons), reward_bench_2 (one pair per rejected response, meta.group =
            the row; Ties dropped), pandalm (majority of 3 annotators; no
            majority or majority tie dropped), llmbar (label 1|2), judgebench ('A>B'|'B>A'),
            rm_bench (3x3 style grid per row, meta holds the styles), chosen_rejected (prompt +
            chosen + rejected strings, or hh-rlhf transcripts; optional 'critique' field),
            trl_conversational (TRL's conversational preference rows, explicit or implicit
            prompt; see _trl_pair).
        seed: int, the A/B shuffling seed. shuffle: False keeps the dataset's own order (response1
            / chosen first), e.g. for evaluating both orders.
        max_items: keep the first N items (after dropping ties), None = all.
        stats: optional dict, filled with {'rows', 'items', 'dropped' (rows giving no item: ties,
            Mr-Ben questions without a correct/incorrect pair), 'schema' (list of names)}.
    Returns:
        list of {"id", "context", "response_a", "response_b", "winner": "A"|"B",
                 "critique": str|None, "source", "meta": dict}. D_H = items with a critique.
    Raises:
        SystemExit, one line naming the file, line and field, on any malformed row, a missing or
        empty prompt (PROMPT_FIELDS) or an unknown schema.
    """
    if schema != "auto" and schema not in PAIR_SCHEMAS:
        raise SystemExit(f"schema {schema!r} unknown; allowed: auto, {', '.join(PAIR_SCHEMAS)}")
    rows = _read_rows(path_or_hub_id, split, config_name)
    if not rows:
        raise SystemExit(f"{path_or_hub_id}: no rows")
    by_file = {}  # a folder may mix schemas: one schema per file
    for file, where, row in rows:
        by_file.setdefault(file, []).append((where, row))
    raw, names, dropped = [], [], 0
    for file, frows in by_file.items():
        name = detect_schema(frows[0][1], frows[0][0]) if schema == "auto" else schema
        names.append(name)
        stem = os.path.splitext(os.path.basename(file))[0] or file
        if name == "mr_ben":
            pairs = _mr_ben_pairs(frows, stem)
            used = {p["id"].split(":")[0] for p in pairs}
            dropped += sum(r["Question_UUID"] not in used for _, r in frows)  # no correct/incorrect pair
            raw += pairs
        else:
            for n, (where, row) in enumerate(frows):
                if not isinstance(row, dict):
                    raise SystemExit(f"{where}: expected a JSON object, got {type(row).__name__}")
                pairs = _raw_pairs(name, where, row, stem=stem, n=n)
                if any(_empty_prompt(p) for p in pairs):  # a judge shown no question: refused, not trained on
                    implicit = name in ("chosen_rejected", "trl_conversational") and row.get("prompt") is None
                    field = "the part shared by 'chosen' and 'rejected'" if implicit else PROMPT_FIELDS[name]
                    raise SystemExit(f"{where}: the prompt ({field}) is empty (schema {name})")
                dropped += not pairs  # ties
                raw += pairs
    items = [finalize_pair(r, seed, shuffle) for r in raw]
    if max_items is not None:
        items = items[:max_items]
    if stats is not None:
        stats.update(rows=len(rows), items=len(items), dropped=dropped, schema=sorted(set(names)))
    return items


def split_dh_do(items, fraction, seed):
    """Split ONE pairwise dataset into D_H and D_O by a seeded ratio (nlhf.split_dh_fraction; RM-NLHF
    App. F: "we randomly split the HelpSteer3 dataset into two equal parts with a 1:1 ratio, serving
    as D_H and D_O"). Item k's key is random.Random(f"{seed}:split:{id_k}").random() (a string seed,
    hashed with SHA-512, as finalize_pair's coin); the floor(fraction x n + 0.5) items with the
    smallest (key, k) go to D_H, the rest to D_O, both in the dataset's order. A key per item id,
    so an item's side does not depend on the order the rows were read in.
    Returns (dh, do): two lists of the load_pairwise dicts, together all of `items`."""
    order = sorted(range(len(items)), key=lambda k: (random.Random(f"{seed}:split:{items[k]['id']}").random(), k))
    to_dh = set(order[:int(fraction * len(items) + 0.5)])
    return [it for k, it in enumerate(items) if k in to_dh], [it for k, it in enumerate(items) if k not in to_dh]


def load_nlhf_items(cfg, want_dh=True, want_do=True):
    """D_H and D_O (RM-NLHF §3.2.1; docs/method.md §5.1). D_H: the pairwise items of nlhf.dh WITH a
    human critique (items without one are dropped); D_O: those of nlhf.do with any critique removed
    (their process reward comes from the MetaRM), [] when nlhf.do is null. With nlhf.split_dh_fraction
    f > 0, nlhf.dh alone is read and split (split_dh_do, seed run.seed): D_H is its f share, D_O the
    rest. nlhf.max_items then cuts each set. want_dh / want_do False: that set is [] and, unless
    split from nlhf.dh, not read (the cold start needs D_H alone).
    Returns (dh, do, note): note is one line for the start-up log (the split's counts), or None.
    SystemExit (one line) on bad data or when no D_H item has a critique."""
    nl, seed = cfg["nlhf"], cfg["run"]["seed"]
    dh, do, note = [], [], None
    if want_dh or nl["split_dh_fraction"]:
        dh = load_pairwise(nl["dh"], schema=nl["dh_schema"], seed=seed, split=nl["dh_split"], config_name=nl["dh_config"])
    if nl["split_dh_fraction"]:
        n = len(dh)
        dh, do = split_dh_do(dh, nl["split_dh_fraction"], seed)
        note = (f"nlhf.split_dh_fraction={nl['split_dh_fraction']}: {n} pairs of {nl['dh']} split by run.seed={seed} "
                f"into {len(dh)} D_H + {len(do)} D_O (samples.jsonl names each sample's item and set)")
    elif nl["do"] and want_do:
        do = load_pairwise(nl["do"], schema=nl["do_schema"], seed=seed, split=nl["do_split"], config_name=nl["do_config"])
    dh = [it for it in dh if it["critique"]] if want_dh else []
    if want_dh and not dh:
        raise SystemExit(f"config key nlhf.dh={nl['dh']}: no item has a human critique (D_H needs them)")
    do = [dict(it, critique=None) for it in do]
    cut = (lambda x: x[:nl["max_items"]]) if nl["max_items"] else (lambda x: x)
    return cut(dh), cut(do) if want_do else [], note


def load_dh_items(cfg):
    """D_H alone (load_nlhf_items), e.g. for the MetaRM cold start. Returns list of load_pairwise dicts."""
    return load_nlhf_items(cfg, want_do=False)[0]


def load_do_items(cfg):
    """D_O alone (load_nlhf_items). Returns list of load_pairwise dicts, critique None."""
    return load_nlhf_items(cfg, want_dh=False)[1]


def load_nlhf_val_items(cfg, dh_items):
    """The held-out pairs of an rm_nlhf run's validation (run.eval_every; RM-NLHF Figs. 3 and 6),
    and D_H without them: nlhf.val "holdout" = nlhf.val_size pairs of `dh_items` (load_dh_items'),
    removed from D_H so they are never trained on; a file / folder / hub id = up to nlhf.val_size
    pairs of it, every pair with nlhf.val_size 0 (critique or not: only the preference is scored). Both draws are
    seeded by run.seed (val_draw) and fixed for the run. [] and D_H as is without nlhf.val.
    Returns (val_items, dh_items). SystemExit (one line naming the key) when the holdout would take
    all of D_H or the file has no pair."""
    nl = cfg["nlhf"]
    if not nl["val"] or not cfg["run"]["eval_every"]:
        return [], dh_items
    if nl["val"] == "holdout":
        if nl["val_size"] >= len(dh_items):
            raise SystemExit(f"config key nlhf.val_size={nl['val_size']}: the holdout would take all "
                             f"{len(dh_items)} D_H pairs")
        held = set(val_draw(cfg, len(dh_items), nl["val_size"]))
        return ([it for i, it in enumerate(dh_items) if i in held],
                [it for i, it in enumerate(dh_items) if i not in held])
    try:
        pool = load_pairwise(nl["val"], schema=nl["val_schema"], seed=cfg["run"]["seed"], split=nl["val_split"],
                             config_name=nl["val_config"])
    except SystemExit as e:
        raise SystemExit(f"config key nlhf.val: {e.code}")
    if not pool:
        raise SystemExit(f"config key nlhf.val={nl['val']}: no pair to validate on")
    return [pool[i] for i in val_draw(cfg, len(pool), nl["val_size"] or len(pool))], dh_items  # 0: the whole file
