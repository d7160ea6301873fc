"""The RLME training and held-out items (docs/method.md §4.1, §4.6): rows of data.train / data.val
through `datasets`, the question (text or a conversation), the context, the label, the anchoring.

    load_dataset_rows(source, ...)       a hub id or a local .jsonl/.json file as a datasets.Dataset
    load_train_items(cfg), load_val_items(cfg), val_draw(cfg, n)
                                         the items of a run; the seeded held-out draw
    items_from_rows(ds, cfg, source)     item dicts {index, question, context, problem, label, ...}
    read_question, is_chat_messages      a row's question: a str, a number, or chat messages (TRL's format)
    render_context(value, max_chars)     a QA context field (str, list, passages) as text, cut
    clean_gsm8k_label(answer)            GSM8K's '#### n' gold answer as a number string
"""
import os

import torch

import reward

from plumbing.jsonl import read_jsonl


def load_dataset_rows(source, config_name=None, split="train", key="data.train"):
    """Rows of a hub dataset id or local .jsonl/.json file, loaded through `datasets`.
    Returns a datasets.Dataset. SystemExit (one line) when the file is missing or malformed, or
    the hub cannot be reached (naming the data.* key to point at a local file)."""
    import datasets
    datasets.disable_progress_bars()
    if source.endswith((".jsonl", ".json")) or os.path.exists(source):
        if os.path.isdir(source):
            raise SystemExit(f"data file {source} is a folder ({key}): name a .jsonl / .json file in it")
        if not os.path.isfile(source):
            raise SystemExit(f"data file {source} does not exist ({key})")
        with open(source, "rb") as f:  # bytes: read_jsonl names a line that is not UTF-8
            if not f.read(4096).strip():
                raise SystemExit(f"data file {source} is empty")
        if source.endswith(".jsonl"):  # datasets' own parse errors do not name the line
            read_jsonl(source)
        try:
            ds = datasets.load_dataset("json", data_files=source, split="train")
        except Exception as e:  # datasets wraps parser errors in many types
            raise SystemExit(f"data file {source}: could not be read ({(str(e).splitlines() or [type(e).__name__])[0]})")
        if len(ds) == 0:
            raise SystemExit(f"data file {source} is empty")
        return ds
    try:
        return datasets.load_dataset(source, config_name, split=split)
    except Exception as e:
        raise SystemExit(f"dataset {source!r} could not be loaded from the hub ({type(e).__name__}); "
                         f"set {key} to a local .jsonl file, e.g. {key}=../shared/data/gsm8k/{'train' if key == 'data.train' else 'test'}.jsonl")


def load_train_items(cfg):
    """Training items (docs/method.md §4.1): dicts {index, question, context (str|None), problem
    (what the evaluator is shown: context + question), label (gsm8k/plain: the cleaned number as a
    string; text: a str or list of str; None without data.answer_field), answer_text (the
    reference as text, for {answer} and anchoring), anchored (docs/method.md §4.2: chosen once by
    seed at load time), messages (list of {role, content} dicts for a conversational question,
    else None; see read_question), where ('data.train: FILE row N', 1-based, for later errors)}.
    With data.val: holdout, the held-out draw is left out.
    SystemExit (one line naming file and row) on a missing field, a missing or empty question, or
    a label that cannot be read."""
    d = cfg["data"]
    items = items_from_rows(load_dataset_rows(d["train"], d["train_config"], d["train_split"]), cfg, d["train"])
    if d["max_items"]:
        items = items[:d["max_items"]]
    if d["val"] == "holdout":
        if d["val_size"] >= len(items):
            raise SystemExit(f"config key data.val_size={d['val_size']}: the holdout would take all {len(items)} "
                             f"training items")
        held = set(val_draw(cfg, len(items)))
        items = [it for i, it in enumerate(items) if i not in held]
    g = torch.Generator().manual_seed(cfg["run"]["seed"])
    n_anchor = round(cfg["reward"]["anchor_fraction"] * len(items))
    for i in torch.randperm(len(items), generator=g)[:n_anchor].tolist():
        items[i]["anchored"] = True
    return items


def load_val_items(cfg):
    """Held-out items for run.eval_every (docs/method.md §4.6), [] without data.val: "holdout" =
    data.val_size items of data.train (never trained on: load_train_items leaves them out),
    otherwise a file or hub id read like data.train and drawn from; the draw is seeded, fixed
    for the run."""
    d = cfg["data"]
    if not d["val"]:
        return []
    if d["val"] == "holdout":
        pool = items_from_rows(load_dataset_rows(d["train"], d["train_config"], d["train_split"]), cfg, d["train"])
        pool = pool[:d["max_items"]] if d["max_items"] else pool
    else:
        rows = load_dataset_rows(d["val"], d["val_config"], d["val_split"], key="data.val")
        pool = items_from_rows(rows, cfg, d["val"], key="data.val")
    return [pool[i] for i in val_draw(cfg, len(pool))]


def val_draw(cfg, n, size=None):
    """Indices (sorted) of the `size` (default data.val_size) held-out items among n, seeded by run.seed."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg["run"]["seed"] * 7 + 1)).tolist()
    return sorted(perm[:cfg["data"]["val_size"] if size is None else size])


def clean_gsm8k_label(answer):
    """GSM8K gold answer: the text after '####', with ',', '$' and spaces removed
    (reward.clean_number). '... #### 1,234' -> '1234'. Raises ValueError when there is no '####'."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####' line")
    return reward.clean_number(answer.split("####")[-1])


def render_context(value, max_chars):
    """A QA context field as the text the policy and the evaluator read (RLME §4: contexts cut at
    4,000 characters).

        str                                  -> as is
        list of str                          -> joined by blank lines
        list of [title, sentence, ...] lists -> "title: sentence sentence ..." per passage,
                                                passages joined by blank lines (QA-Feedback's
                                                `passages`, ../shared/data/qa_feedback/SOURCE.md)

    then cut to the first max_chars characters (0 = no cut). Raises ValueError (one line naming
    the type found) on any other type, or on max_chars < 0.
    """
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0 (0 = no cut), got {max_chars}")
    expected = "expected a str, a list of str, or a list of [title, sentence, ...] passages"
    if isinstance(value, str):
        text = value
    elif isinstance(value, list) and all(isinstance(x, str) for x in value):
        text = "\n\n".join(value)
    elif isinstance(value, list) and all(isinstance(x, list) and x and all(isinstance(t, str) for t in x)
                                         for x in value):
        text = "\n\n".join(f"{title}: {' '.join(sentences)}" if sentences else title
                            for title, *sentences in value)
    else:
        found = type(value).__name__
        if isinstance(value, list):  # it holds something that is not a str (else the 2nd branch took it)
            bad = next(x for x in value if not isinstance(x, str))
            found = f"a list holding {type(bad).__name__} {bad!r:.40}"
        raise ValueError(f"context: {expected}; got {found}")
    return text[:max_chars] if max_chars else text


def is_chat_messages(value):
    """True for a non-empty list of {"role": str, "content": str, ...} dicts: chat messages, as in
    TRL's conversational dataset format (its `prompt`, `chosen` and `rejected` columns)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def read_question(value, where, field):
    """The question of one RLME data row: (question text, chat messages or None).

    A str is the question. A list of {"role", "content"} dicts is a conversation (TRL's
    conversational `prompt` column): the messages are kept (keys holding None dropped: `datasets`
    gives every row the keys any row has) and the question is the content of the last message,
    which must be the user's (the policy answers it; the evaluators read it as the question).
    A number is its text.
    Args: value: the row's field. where: 'data.train: FILE row N'. field: data.question_field.
    Raises: SystemExit (one line naming `where` and the field): missing (null), empty or blank,
        or anything but a str, a number or a conversation ending in a non-empty user message.
    """
    name = f"the question field {field!r}"
    if value is None:
        raise SystemExit(f"{where}: {name} is missing (null)")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if value == [] or isinstance(value, str) and not value.strip():
        raise SystemExit(f"{where}: {name} is empty")
    if isinstance(value, str):
        return value, None
    if not is_chat_messages(value):
        raise SystemExit(f"{where}: {name} must be a string or a list of chat messages {{role, content}} "
                         f"(TRL's conversational format), got {type(value).__name__} {value!r:.60}")
    messages = [{k: v for k, v in m.items() if v is not None} for m in value]
    if messages[-1]["role"] != "user":
        raise SystemExit(f"{where}: {name} is a conversation that ends with a {messages[-1]['role']!r} message, "
                         f"not the user's (the policy answers the last user message)")
    if not messages[-1]["content"].strip():
        raise SystemExit(f"{where}: {name} is a conversation whose last user message is empty")
    return messages[-1]["content"], messages


def items_from_rows(ds, cfg, source, key="data.train"):
    """Item dicts (see load_train_items) of a datasets.Dataset read with the data.* field settings;
    `key` (data.train | data.val) is the config key that names `source` in errors. A conversational
    question needs the chat template: refused here when model.chat_template is false, and when
    model.system_prompt is set for a conversation with its own system message (two system
    messages); rollout.policy_prompt_ids refuses it for a plain-text policy found by `auto`."""
    d = cfg["data"]
    m = cfg.get("model", {})
    for field in ("question_field", "answer_field", "context_field"):
        if d[field] is not None and d[field] not in ds.column_names:
            raise SystemExit(f"config key data.{field}={d[field]!r}: no such field in {source} "
                             f"(fields: {', '.join(ds.column_names)})")
    items = []
    for i, row in enumerate(ds):
        where = f"{key}: {source} row {i + 1}"
        question, messages = read_question(row[d["question_field"]], where, d["question_field"])
        if messages and m.get("chat_template") is False:
            raise SystemExit(f"{where}: the question field {d['question_field']!r} holds chat messages, but "
                             f"config key model.chat_template is false (a plain-text prompt)")
        if messages and m.get("system_prompt") is not None and messages[0]["role"] == "system":
            raise SystemExit(f"{where}: the conversation has its own system message and config key "
                             f"model.system_prompt adds another; set model.system_prompt=null")
        label = None
        if d["answer_field"] is not None:
            value = row[d["answer_field"]]
            if d["label_format"] == "text":  # a str, a list of str, or SQuAD's {"text": [...]}
                label = value.get("text") if isinstance(value, dict) else value
                if isinstance(label, list):
                    label = [str(x) for x in label]
                    if not label:
                        raise SystemExit(f"{where}: field {d['answer_field']!r} holds no answer")
                else:
                    label = str(label)
            else:
                try:
                    label = clean_gsm8k_label(str(value)) if d["label_format"] == "gsm8k" else reward.clean_number(str(value))
                except ValueError:
                    raise SystemExit(f"{where}: field {d['answer_field']!r} has no '####' "
                                     f"(set data.label_format=plain for bare answers)")
        context = None
        if d["context_field"] is not None:
            try:
                context = render_context(row[d["context_field"]], d["context_max_chars"])
            except ValueError as e:
                raise SystemExit(f"{where}: field {d['context_field']!r}: {e}")
        items.append({"index": i, "question": question, "context": context,
                      "problem": f"{context}\n\n{question}" if context else question, "label": label,
                      "answer_text": label[0] if isinstance(label, list) else label, "anchored": False,
                      "messages": messages, "where": where})
    return items
