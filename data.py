"""data.py: the data files every stage reads, as plain item dicts; a bad row is one line of error.
Rows (a JSONL file or a hub split): read_jsonl, load_rows. RLME items (RLME §4.1): load_items,
load_rlme_items, val_draw. RM-NLHF pairs (§3.2): PAIR_SCHEMAS, load_pairwise, split_dh_do,
load_nlhf_items, load_nlhf_val_items. evaluate.py's sets: load_math_problems, load_qa_items,
QA_PRESETS, BENCHMARKS, benchmark_units, load_benchmark, load_judge_check_items."""
import glob
import json
import os
import random
import re

import torch

SHARED_DATA = os.environ.get("RLME_SHARED_DATA", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data"))

def read_jsonl(path):
    """[(1-based line, row dict)] of a JSON-lines file, blank lines skipped. SystemExit naming file
    and line: a folder or no file, a line not UTF-8 (a UTF-16 export), not JSON, not an object."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: " + ("a folder, not a .jsonl file" if os.path.isdir(path)
                                        else "file does not exist"))
    rows = []
    with open(path, "rb") as f:  # bytes, decoded line by line, so a bad byte's line can be named
        for n, raw in enumerate(f, 1):
            try:
                row = json.loads(raw.decode("utf-8").rstrip("\r\n")) if raw.strip() else {}
            except ValueError as e:  # UnicodeDecodeError (save it as UTF-8) or JSONDecodeError
                raise SystemExit(f"{path}:{n}: not UTF-8 JSON ({e})")
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows += [(n, row)] if raw.strip() else []
    return rows

def _rows(path, config=None, split="train"):
    """[(where, row)]: a local .jsonl ('file:line'), else via datasets ('path[split] row i')."""
    if path.endswith(".jsonl") or os.path.isdir(path) or path.startswith((".", "/", "~")) \
            and not os.path.exists(path):
        return [(f"{path}:{n}", row) for n, row in read_jsonl(path)]
    import datasets  # here: slow to import, and only hub ids and other formats need it
    try:
        ds = (datasets.load_dataset(path.rsplit(".", 1)[-1], data_files=path, split="train")
              if os.path.isfile(path) else datasets.load_dataset(path, config, split=split))
    except Exception as e:  # the hub, the network or the format: one line, no traceback
        raise SystemExit(f"{path}: could not be loaded with datasets ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}); offline? pass a local .jsonl copy")
    return [(f"{path}[{split}] row {i}", dict(r)) for i, r in enumerate(ds)]

def load_rows(path, config=None, split="train", n=None):
    """The first n (None: all) rows (list[dict]) of a JSONL file or hub split; too few: exits."""
    rows = [row for _, row in _rows(path, config, split)]
    if not rows or n and n > len(rows):
        raise SystemExit(f"{path}: " + (f"only {len(rows)} rows, {n} asked" if rows else "no rows"))
    return rows[:n]

def clean_number(s):
    """A number's text without ',', '$', spaces, a trailing '.', '%' and a wrapping \\text{...}
    (labels here; both sides of reward.numeric_equal)."""
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    for junk in ("\\$", "$", ",", " ", "\\%", "%", "\\!"):
        s = s.replace(junk, "")
    return s.rstrip(".")

def render_context(value, max_chars):
    """A QA context cut to max_chars (0: no cut; RLME: 4,000): a str, a list of str or QA-Feedback's
    [title, sentence, ...] passages ('title: sentences'), blank-line joined; else ValueError."""
    passages = isinstance(value, list) and all(isinstance(x, list) and x for x in value)
    if passages and all(isinstance(t, str) for x in value for t in x):
        value = [f"{title}: {' '.join(rest)}" if rest else title for title, *rest in value]
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        value = "\n\n".join(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a str, a list of str or [title, sentence, ...] passages, "
                         f"got {value!r:.60}")
    return value[:max_chars] if max_chars else value

def _question(value, where):
    """(text, messages or None): a str, a number, or chat messages ending in a user message."""
    value = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if value is None or value == [] or isinstance(value, str) and not value.strip():
        raise SystemExit(f"{where} is {'missing (null)' if value is None else 'empty'}")
    if isinstance(value, str):
        return value, None
    chat = isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value)
    # keys holding None (`datasets` gives every message the keys any message has) dropped
    messages = chat and [{k: v for k, v in m.items() if v is not None} for m in value]
    if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise SystemExit(f"{where} must be a string or chat messages {{role, content}} ending in a "
                         f"non-empty user message (TRL's conversational format), got {value!r:.60}")
    return messages[-1]["content"], messages

def load_items(rows, *, question_field="question", answer_field="answer", label_format="gsm8k",
               context_field=None, context_max_chars=4000, where="data.train: FILE"):
    """RLME items {index, question, context (str|None), problem (context + question: what the
    evaluator sees), label (gsm8k/plain: the cleaned number; text: a str or list of str; None
    without answer_field), answer_text, anchored, messages (a chat question's), where: 'row N'}."""
    items = []
    for i, row in enumerate(rows):
        w = f"{where} row {i + 1}"
        missing = [f for f in (answer_field, context_field) if f is not None and f not in row]
        if missing:
            raise SystemExit(f"{w}: no field {missing[0]!r} (fields: {', '.join(row)})")
        question, messages = _question(row.get(question_field),
                                       f"{w}: the question field {question_field!r}")
        label, value = None, row.get(answer_field)
        if answer_field is not None and label_format == "text":  # str, list of str, SQuAD {"text"}
            label = value.get("text") if isinstance(value, dict) else value
            label = [str(x) for x in label] if isinstance(label, list) else str(label)
        elif answer_field is not None:
            if label_format == "gsm8k" and "####" not in str(value):
                raise SystemExit(f"{w}: field {answer_field!r} has no '####' "
                                 f"(set data.label_format=plain for bare answers)")
            label = clean_number(str(value).split("####")[-1] if label_format == "gsm8k"
                                  else str(value))
        if label == []:
            raise SystemExit(f"{w}: field {answer_field!r} holds no answer")
        try:
            context = context_field and render_context(row[context_field], context_max_chars)
        except ValueError as e:
            raise SystemExit(f"{w}: field {context_field!r}: {e}")
        items.append({"index": i, "question": question, "context": context,
                      "problem": f"{context}\n\n{question}" if context else question,
                      "label": label, "answer_text": label[0] if isinstance(label, list) else label,
                      "anchored": False, "messages": messages, "where": w})
    return items

def val_draw(n, size, seed):
    """Sorted indices of `size` held-out items among n: a seeded draw, fixed for the run."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7 + 1)).tolist()
    return sorted(perm[:size])

def _holdout(items, size, seed):
    """(the val_draw of `size` of items, the rest: never trained on)."""
    if size >= len(items):
        raise SystemExit(f"config key data.val_size={size}: the holdout takes all {len(items)}")
    held = val_draw(len(items), size, seed)  # sorted
    return [items[i] for i in held], [it for i, it in enumerate(items) if i not in held]

def load_rlme_items(train, val=None, *, train_config=None, val_config=None, val_split="test",
                    val_size=64, anchor_fraction=0.0, seed=0, **fields):
    """(training items, held-out items): load_items dicts (`fields`: its keywords), round(fraction x
    N) of them anchored (drawn by `seed`); val "holdout" takes val_size of them out, a file or hub
    id gives val_size (0 = all) drawn ones."""
    items = load_items(load_rows(train, train_config), where=f"data.train: {train}", **fields)
    held = []
    if val == "holdout":
        held, items = _holdout(items, val_size, seed)
    elif val:
        pool = load_items(load_rows(val, val_config, val_split), where=f"data.val: {val}", **fields)
        held = [pool[i] for i in val_draw(len(pool), val_size or len(pool), seed)]
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))
    for i in perm[:round(anchor_fraction * len(items))].tolist():  # sparse ground-truth anchoring
        items[i]["anchored"] = True
    return items, held

PAIR_SCHEMAS = {  # name: (the fields that identify it, tried in order; its prompt's field)
    "rm_nlhf": (("extra_info",), "extra_info.context"),  # the authors' release (Tongyi-ConvAI)
    "helpsteer3": (("context", "response1", "response2", "overall_preference"), "context"),
    "mr_ben": (("Question_UUID", "Question", "Model_Solution_Steps", "Model_Solution_Correctness"),
               "Question"),
    "pandalm": (("instruction", "response1", "response2", "annotator1", "annotator2", "annotator3"),
                "instruction"),
    "llmbar": (("input", "output_1", "output_2", "label"), "input"),
    "judgebench": (("question", "response_A", "response_B", "label"), "question"),
    "reward_bench_2": (("prompt", "chosen", "rejected", "num_correct"), "prompt"),  # 1 vs 3
    "rm_bench": (("prompt", "chosen", "rejected"), "prompt"),  # lists of 3 styles
    "chosen_rejected": (("chosen", "rejected"), "prompt"),  # str; a prompt or hh-rlhf transcripts
}

def _detect(row, where):
    """A file's schema from its first row's field names (and chosen's type, where they share)."""
    for name, (fields, _) in PAIR_SCHEMAS.items():  # HelpSteer3 derivatives carry chosen/rejected
        if all(f in row for f in fields) and (name != "rm_bench" or isinstance(row["chosen"], list)
                                              and all(isinstance(c, str) for c in row["chosen"])):
            return name
    raise SystemExit(f"{where}: unknown pairwise schema, fields found: {sorted(row)}; "
                     f"known: {', '.join(PAIR_SCHEMAS)}")

def render_turns(turns):
    """A prompt as text: a str as is, {role, content} turns as 'User: ...' blocks."""
    return turns if isinstance(turns, str) else "\n\n".join(
        f"{str(t.get('role')).title()}: {t['content']}" for t in turns)

def _pair(rid, context, r1, r2, winner, source, meta, critique=None, parts=None):
    """A raw pair (finalize_pair): winner 1|2 names r1|r2, made text (PandaLM has `true` ones)."""
    return {"id": rid, "context": context, "r1": str(r1), "r2": str(r2), "winner": winner,
            "critique": critique, "critique_parts": parts, "source": source, "meta": meta}

def _labelled(schema, row, stem, n):
    """helpsteer3 / pandalm / llmbar / judgebench: [raw pair] from the first 3 fields, [] a tie."""
    p, f1, f2 = PAIR_SCHEMAS[schema][0][:3]
    rid, meta, critique = f"{stem}:{n}", {}, None
    if schema == "helpsteer3":  # overall_preference -3..3, negative: response1 better (its card)
        pref = row["overall_preference"]
        winner = None if pref == 0 else 1 if pref < 0 else 2
        # the annotators' reasonings compare ("@Response 1 is better ..."): they stay one text
        why = [x.get("reasoning") for x in row.get("individual_preference") or []
               if isinstance(x, dict)]
        critique = "\n".join(r.strip() for r in why if isinstance(r, str) and r.strip()) or None
        rid, meta = str(row.get("id", rid)), {"overall_preference": pref}
    elif schema == "pandalm":  # 3 annotators: 1, 2, or 0 (tie)
        votes = [row[f"annotator{k}"] for k in (1, 2, 3)]
        winner = next((v for v in (1, 2) if votes.count(v) >= 2), None)
        rid, meta = f"pandalm:{row.get('idx', n)}", {"votes": votes}
    else:  # llmbar: label 1|2; judgebench: 'A>B' | 'B>A' ('A=B': a tie)
        to = {1: 1, 2: 2} if schema == "llmbar" else {"A>B": 1, "B>A": 2, "A=B": None, "B=A": None}
        if row["label"] not in to:
            raise ValueError(f"field 'label' must be one of {list(to)}, got {row['label']!r}")
        winner = to[row["label"]]
        if schema == "judgebench":
            rid, meta = str(row.get("pair_id", rid)), {"category": row.get("source")}
    meta.update({"turns": row[p]} if isinstance(row[p], list) else {})
    extra = f"\n\n{row['input']}" if schema == "pandalm" and row.get("input") else ""
    return [] if winner is None else [_pair(
        rid, render_turns(str(row[p]) if schema != "helpsteer3" else row[p]) + extra, row[f1],
        row[f2], winner, f"{schema}/{stem}", meta, critique)]

def _chosen_rejected(row, stem, n):
    """chosen_rejected: [raw pair]; no prompt: hh-rlhf's, cut after the last shared Assistant:."""
    turns, chosen, rejected, c = (row.get(f) for f in ("prompt", "chosen", "rejected", "critique"))
    if not isinstance(chosen, str) or not isinstance(rejected, str):
        raise ValueError("'chosen' and 'rejected' must be strings (chat messages are not read)")
    if turns is None:
        k = chosen.rfind("\n\nAssistant:", 0, len(os.path.commonprefix([chosen, rejected])))
        if k <= 0:
            raise ValueError("no 'prompt' field, and 'chosen' and 'rejected' share no prompt")
        cut = k + len("\n\nAssistant:")
        turns, chosen, rejected = chosen[:k].strip(), chosen[cut:].strip(), rejected[cut:].strip()
    return [] if chosen == rejected else [_pair(
        str(row.get("id", f"{stem}:{n}")), render_turns(turns), chosen, rejected, 1,
        f"chosen_rejected/{stem}", {}, c.strip() or None if isinstance(c, str) else None)]

def _rm_nlhf(row, stem, n):
    """The authors' release: `extra_info` (dict or JSON); processed_critique kept per response."""
    info = json.loads(info) if isinstance(info := row["extra_info"], str) else info
    if info["winner"] not in ("A", "B"):
        raise ValueError(f"field 'extra_info.winner' must be 'A' or 'B', got {info['winner']!r}")
    turns, pc = info["context"], info.get("processed_critique")
    part = lambda v: "\n".join(str(x).strip() for x in v if str(x).strip()) if isinstance(  # noqa
        v, list) else str(v or "").strip()  # a str or a list of points (one per line)
    # 'Response A/B' (or 'Chatbot A/B') -> 'Response 1/2', relabelled after the A/B shuffle
    ab = lambda t: re.sub(r"\b(?:[Rr]esponse|[Cc]hatbot)\s*([AB])\b",  # noqa: E731
                          lambda m: f"Response {'1' if m.group(1) == 'A' else '2'}", t)
    parts = {i: {k: ab(part(pc.get(f"{k}_{x}"))) for k in ("strengths", "weaknesses")}
             for i, x in ((1, "A"), (2, "B"))} if isinstance(pc, dict) else {}
    meta = {"dataset_type": info.get("dataset_type"),
            **({"turns": turns} if isinstance(turns, list) else {})}
    return [_pair(str(info.get("id", row.get("id", f"{stem}:{n}"))), render_turns(turns),
                  info["response_A"], info["response_B"], 1 if info["winner"] == "A" else 2,
                  f"rm_nlhf/{stem}", meta, parts=parts if any(
                      v for p in parts.values() for v in p.values()) else None)]

def _mr_ben(rows, stem):
    """Mr-Ben math as D_H: every (correct, incorrect) pair of a question's solutions (192 here)."""
    by_q, pairs = {}, []
    for row in rows:
        by_q.setdefault(row["Question_UUID"], []).append(row)
    for qid, sols in by_q.items():
        for g, b in [(g, b) for g in sols for b in sols if (g["Model_Solution_Correctness"],
                     b["Model_Solution_Correctness"]) == ("correct", "incorrect")]:
            step = b.get("Model_Solution_First_Error_Step")
            why = " ".join(r.strip() for r in b.get("Model_Solution_Error_Reason") or []
                           if isinstance(r, str) and r.strip())
            parts = {1: {"strengths": "Its solution is correct.", "weaknesses": ""},
                     2: {"strengths": "", "weaknesses": "Its solution is incorrect; the first "
                                                        f"error is in step {step}. {why}"}}
            options = "\n\nOptions:\n" + g["Options"].strip() if g.get("Options") else ""
            pairs.append(_pair(f"{qid}:{g.get('Sampled_Model')}>{b.get('Sampled_Model')}",
                               g["Question"] + options, "\n".join(g["Model_Solution_Steps"]),
                               "\n".join(b["Model_Solution_Steps"]), 1, f"mr_ben/{stem}",
                               {"first_error_step": step, "subject": g.get("Subject")},
                               parts=parts))
    return pairs

def _pairs(schema, row, stem, n):
    """One row -> its raw pairs (_pair); [] = dropped (a tie, or two equal responses)."""
    if schema in ("helpsteer3", "pandalm", "llmbar", "judgebench"):
        return _labelled(schema, row, stem, n)
    if schema in ("chosen_rejected", "rm_nlhf"):
        return (_chosen_rejected if schema == "chosen_rejected" else _rm_nlhf)(row, stem, n)
    source, chosen, rejected = f"{schema}/{stem}", row["chosen"], row["rejected"]
    if schema == "reward_bench_2":  # a pair per rejected response, grouped for the best-of-4 rule
        rid = str(row.get("id", f"{stem}:{n}"))
        return [] if row.get("subset") == "Ties" else [  # Ties: several right answers, own rule
            _pair(f"{rid}:{k}", render_turns(row["prompt"]), chosen[0], r, 1, source,
                  {"subset": row.get("subset"), "group": rid, "group_size": len(rejected)})
            for k, r in enumerate(rejected)]
    # rm_bench: the 3x3 style grid (upstream: i > j easy, i == j normal, i < j hard)
    return [_pair(f"{stem}:{row.get('id', n)}:{i}{j}", str(row["prompt"]), c, r, 1, source,
                  {"subset": row.get("subset"), "chosen_style": i, "rejected_style": j})
            for i, c in enumerate(chosen) for j, r in enumerate(rejected)]

def finalize_pair(raw, seed, shuffle=True):
    """Raw pair -> {id, context, response_a, response_b, winner 'A'|'B', critique (str|None),
    source, meta (+ swapped)}; A/B: the coin random.Random(f'{seed}:{id}'), the critique follows."""
    swap = shuffle and random.Random(f"{seed}:{raw['id']}").random() < 0.5
    one, two = ("B", "A") if swap else ("A", "B")  # the final letters of response 1 and response 2
    relabel = lambda t: re.sub(r"@?\b[Rr]esponse\s*([12])\b",  # noqa: E731
                               lambda m: f"Response {one if m.group(1) == '1' else two}", t)
    critique, meta = raw["critique"] and relabel(raw["critique"]), dict(raw["meta"], swapped=swap)
    if raw["critique_parts"]:  # kept per response (RM-NLHF §2.3): 'Response A strengths: ...'
        parts = meta["critique_parts"] = {x: {k: relabel(v).strip() for k, v in raw[
            "critique_parts"][i].items()} for i, x in ((1, one), (2, two))}  # judge.variant authors
        critique = "\n".join(f"Response {x} {k}: {parts[x][k] or 'none noted'}"
                             for x in "AB" for k in ("strengths", "weaknesses"))
    return {"id": raw["id"], "context": raw["context"], "response_a": raw["r2" if swap else "r1"],
            "response_b": raw["r1" if swap else "r2"], "winner": one if raw["winner"] == 1 else two,
            "critique": critique, "source": raw["source"], "meta": meta}

def load_pairwise(path, schema="auto", seed=0, shuffle=True, split="train", max_items=None,
                  config=None):
    """The first max_items finalize_pair items of a .jsonl file, a folder of them, another format or
    a hub split; schema 'auto': each file's first row decides; shuffle False: response 1 / chosen is
    A. SystemExit naming file and line: a missing field, a wrong value, an empty prompt, no rows."""
    files = sorted(glob.glob(os.path.join(path, "*.jsonl"))) if os.path.isdir(path) else [path]
    raw = []
    for file in files or [path]:  # an empty folder: read_jsonl refuses it
        rows, stem = _rows(file, config, split), os.path.splitext(os.path.basename(file))[0] or file
        if not rows:
            raise SystemExit(f"{file}: no rows")
        name = schema if schema != "auto" else _detect(rows[0][1], rows[0][0])
        for n, (where, row) in enumerate(rows):
            try:  # the readers index fields directly: a KeyError etc. is the row's fault
                missing = [f for f in PAIR_SCHEMAS[name][0] if row.get(f) is None]
                if missing:
                    raise KeyError(missing[0])
                pairs = [] if name == "mr_ben" else _pairs(name, row, stem, n)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                raise SystemExit(f"{where}: {'missing field ' * isinstance(e, KeyError)}{e} "
                                 f"(schema {name})")
            turns = [p["meta"].get("turns") or [{"content": p["context"]}] for p in pairs]
            if any(not any(str(t.get("content") or "").strip() for t in ts) for ts in turns) \
                    or name == "mr_ben" and not str(row["Question"]).strip():
                raise SystemExit(f"{where}: the prompt ({PAIR_SCHEMAS[name][1]}) is empty "
                                 f"(schema {name})")  # a judge shown no question: refused
            raw += pairs
        raw += _mr_ben([row for _, row in rows], stem) if name == "mr_ben" else []
    return [finalize_pair(r, seed, shuffle) for r in raw][:max_items]

def split_dh_do(items, fraction, seed):
    """ONE pairwise dataset split into (D_H, D_O) (RM-NLHF App. F splits HelpSteer3 1:1). Item k's
    key is random.Random(f"{seed}:split:{id_k}").random(); the floor(fraction x n + 0.5) items with
    the smallest (key, k) are D_H, the rest D_O, both in dataset order (a side follows the id)."""
    key = lambda k: (random.Random(f"{seed}:split:{items[k]['id']}").random(), k)  # noqa: E731
    to_dh = set(sorted(range(len(items)), key=key)[:int(fraction * len(items) + 0.5)])
    return [items[k] for k in sorted(to_dh)], [it for k, it in enumerate(items) if k not in to_dh]

def load_nlhf_items(dh, do=None, *, seed, split_dh_fraction=0.0):
    """(D_H, D_O, note) (RM-NLHF §3.2.1): D_H = the items of `dh` WITH a human critique, D_O those
    of `do` without; split_dh_fraction f > 0: split_dh_do(dh, f), note a line for the log."""
    items, rest, note = load_pairwise(dh, seed=seed), [], None
    if split_dh_fraction:
        items, rest = split_dh_do(items, split_dh_fraction, seed)
        note = (f"nlhf.split_dh_fraction={split_dh_fraction}: {len(items) + len(rest)} pairs of "
                f"{dh} split by run.seed={seed} into {len(items)} D_H + {len(rest)} D_O (samples"
                f".jsonl names each sample's item and set)")
    elif do:
        rest = load_pairwise(do, seed=seed)
    items = [it for it in items if it["critique"]]
    if not items:
        raise SystemExit(f"config key nlhf.dh={dh}: no item has a human critique (D_H needs them)")
    return items, [dict(it, critique=None) for it in rest], note

def load_nlhf_val_items(val, dh_items, *, size, seed, config=None, split="validation"):
    """(held-out pairs, D_H without them) (RM-NLHF Figs. 3, 6): "holdout" or `size` drawn pairs."""
    if val == "holdout":
        return _holdout(dh_items, size, seed)
    pool = load_pairwise(val, seed=seed, split=split, config=config)
    return [pool[i] for i in val_draw(len(pool), size or len(pool), seed)], dh_items

def load_math_problems(path, n=None, split="test", config=None):
    """The first n GSM8K / MATH-500 problems {id, question, label, answer_text, kind, reference}."""
    out = []
    for i, r in enumerate(load_rows(path, config, split, n)):
        if "question" in r and "####" in str(r.get("answer")):
            label = clean_number(r["answer"].split("####")[-1])
            out.append({"id": i, "question": r["question"], "label": label, "answer_text": label,
                        "kind": "gsm8k", "reference": r["answer"]})
        elif "problem" in r and "answer" in r:
            out.append({"id": r.get("unique_id", i), "question": r["problem"],
                        "label": str(r["answer"]), "answer_text": str(r["answer"]), "kind": "math",
                        "reference": r.get("solution", "")})
        else:
            raise SystemExit(f"{path}: row {i + 1} has neither GSM8K's fields (question, answer "
                             f"with '####') nor MATH's (problem, answer); fields: {sorted(r)}")
    return out

# FaithEval-Counterfactual (Ming et al. 2024), RLME's out-of-domain QA test (multiple choice)
QA_PRESETS = {"faitheval": dict(
    data="Salesforce/FaithEval-counterfactual-v1.0", split="test", config=None,
    question_field="question", context_field="context", answer_field="answerKey",
    choices_field="choices")}

def load_qa_items(path, n=None, split="test", config=None, question_field="question",
                  context_field="context", answer_field="answer", choices_field=None,
                  context_max_chars=4000):
    """The first n context-QA items {id, question, context, kind 'qa', label (the golds: list[str]),
    answer_text}. choices_field ({"label", "text"} lists or texts A, B, ...): the answer is the key,
    the options go under the question, the gold is the key's option (a letter on other labels, ARC's
    1-4, is a position), choice_letters [its label, the key]."""
    items = []
    for i, r in enumerate(load_rows(path, config, split, n)):
        w = f"{path} row {i + 1}"
        try:
            q, ctx, gold, c = (r[f] if f else None for f in (question_field, context_field,
                                                             answer_field, choices_field))
            item = {"id": r.get("id", i), "question": str(q),
                    "context": render_context(ctx, context_max_chars), "kind": "qa"}
        except (KeyError, ValueError) as e:
            raise SystemExit(f"{w}: {'no field ' * isinstance(e, KeyError)}{e}; fields: "
                             f"{sorted(r)}")
        golds = gold.get("text") if isinstance(gold, dict) else gold  # a str, a list, SQuAD's
        item["label"] = [str(g) for g in (golds if isinstance(golds, list) else [golds])]
        if c is not None:
            key = str(gold).strip()
            options = (list(zip(map(str, c["label"]), map(str, c["text"]))) if isinstance(c, dict)
                       else [(chr(65 + k), str(t)) for k, t in enumerate(c)])
            k = next((j for j, (x, _) in enumerate(options) if x == key), ord(key) - 65 if len(key)
                     == 1 else -1)  # a letter key on other labels is a position
            if not 0 <= k < len(options):
                raise SystemExit(f"{w}: answer key {key!r} is not one of the options "
                                 f"{[x for x, _ in options]}")
            item["question"] += "\nOptions:\n" + "\n".join(f"{x}) {t}" for x, t in options)
            item["label"] = [options[k][1]]
            item["choice_letters"] = list(dict.fromkeys([options[k][0], key]))
        if not item["label"]:
            raise SystemExit(f"{w}: field {answer_field!r} holds no answer")
        items.append(dict(item, answer_text=item["label"][0]))
    return items

# RM-NLHF Table 7's pairwise benchmarks: a folder under data_root (schema auto) or a hub split (id,
# config, split, schema). PAPER_BENCHMARKS: Table 2's (App. G.1's contamination rule)
BENCHMARKS = {
    "helpsteer3": ("HelpSteer3", ("nvidia/HelpSteer3", "preference", "validation", "helpsteer3")),
    "reward_bench_2": ("RewardBench 2", ("allenai/reward-bench-2", None, "test", "reward_bench_2")),
    "rm_bench": ("RM-Bench", "rm_bench"), "judgebench": ("JudgeBench", "judgebench"),
    "llmbar": ("LLMBar", "llmbar"), "pandalm_testset": ("PandaLM", "pandalm_testset"),
    "hh_rlhf_harmless_base": ("HH-RLHF", "hh_rlhf_harmless_base")}
PAPER_BENCHMARKS = ("helpsteer3", "reward_bench_2")

def benchmark_units(name, data_root=SHARED_DATA):
    """Where `name` is read: [{name, benchmark, file, path, schema, split, config, hub}]."""
    title, where = BENCHMARKS[name]
    unit = {"name": name, "benchmark": title, "schema": "auto", "split": "train", "config": None}
    if isinstance(where, tuple):  # (hub id, config, split, schema)
        return [dict(unit, path=where[0], config=where[1], file=where[2], split=where[2],
                     schema=where[3], hub=True)]
    files = sorted(glob.glob(os.path.join(data_root, where, "*.jsonl")))
    if not files:
        raise SystemExit(f"benchmark {name}: no .jsonl files in {os.path.join(data_root, where)}")
    return [dict(unit, file=os.path.splitext(os.path.basename(f))[0], path=f, hub=False)
            for f in files]

def load_benchmark(path, n, seed, schema="auto", split="train", config=None):
    """Up to n (0/None = all) load_pairwise items: a seeded sample in file order, not a prefix
    (JudgeBench is sorted by source); a meta "group" (RewardBench 2's 3 pairs) counts as one."""
    items = load_pairwise(path, schema=schema, seed=seed, split=split, config=config)
    if not items:
        raise SystemExit(f"{path}: no usable pairwise items (ties only?)")
    groups = [it["meta"].get("group", k) for k, it in enumerate(items)]  # an item is its own unit
    units = list(dict.fromkeys(groups))
    if n and n < len(units):
        name = os.path.basename(os.path.normpath(path))  # not the path: the same in any checkout
        kept = {units[i] for i in random.Random(f"{seed}:{name}").sample(range(len(units)), n)}
        items = [it for it, g in zip(items, groups) if g in kept]
    return items

def load_judge_check_items(path):
    """Annotated GRM critiques (RM-NLHF App. E), one per line: context, response_a, response_b,
    human_critique, critique (the GRM's), label (1 = correct, 0 not); "id" added where missing."""
    items = []
    for n, it in read_jsonl(path):
        missing = [f for f in ("context", "response_a", "response_b", "human_critique", "critique",
                               "label") if f not in it]
        if missing:
            raise SystemExit(f"{path}:{n}: missing field {missing[0]!r}")
        if it["label"] not in (0, 1) or isinstance(it["label"], bool):
            raise SystemExit(f"{path}:{n}: field 'label' must be 0 or 1, got {it['label']!r}")
        items.append(dict(it, id=it.get("id", f"line{n}")))
    if not items:
        raise SystemExit(f"{path}: no items")
    return items
