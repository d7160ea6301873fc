"""Data rows (issue 25 item 8; plumbing/items.py, plumbing/pairwise.py, rollout.policy_prompt_ids): a missing or empty
question or pairwise prompt is refused at load with one line naming file and row; TRL's
conversational `prompt` column is read as chat messages through the policy's chat template; TRL's
preference rows (explicit and implicit prompt) are read as pairwise items, not taken for RM-Bench."""
import json
import re

import pytest

from conftest import SMOLLM2, data_path
import rollout

from plumbing.config import load_config
from plumbing.items import load_train_items, load_val_items
from plumbing.jsonl import read_jsonl
from plumbing.models import resolve_model_path
from plumbing.pairwise import detect_schema, load_dh_items, load_do_items, load_nlhf_items, load_pairwise, split_dh_do
from plumbing.prompts import keep_short, policy_chat


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def refused(fn, *args):
    """The one-line SystemExit message of fn(*args)."""
    with pytest.raises(SystemExit) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def tok():
    """The real SmolLM2-135M-Instruct tokenizer (its chat template, no BOS of its own)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model_path(SMOLLM2))


def template_ids(tok, messages, tokenize=True):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
    return list(out["input_ids"] if hasattr(out, "keys") else out) if tokenize else out


GOOD = {"question": "What is 2 + 3?", "answer": "#### 5"}


# -- RLME rows: a missing or empty question ----------------------------------------------------


@pytest.mark.parametrize("bad, what", [
    ({"question": "", "answer": "#### 1"}, "is empty"),
    ({"question": "  \n ", "answer": "#### 1"}, "is empty"),
    ({"question": None, "answer": "#### 1"}, "is missing (null)"),
    ({"answer": "#### 1"}, "is missing (null)"),       # datasets fills the absent key with None
    ({"question": [], "answer": "#### 1"}, "is empty"),
])
def test_an_empty_or_missing_question_names_file_and_row(tmp_path, bad, what):
    """The old code trained on the literal prompt "None" or ""."""
    p = write_jsonl(tmp_path / "train.jsonl", [GOOD, GOOD, bad, GOOD])
    msg = refused(load_train_items, load_config([], [f"data.train={p}"]))
    assert msg == f"data.train: {p} row 3: the question field 'question' {what}"


def test_an_empty_question_in_the_validation_file_names_data_val(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [GOOD] * 4)
    val = write_jsonl(tmp_path / "val.jsonl", [GOOD, {"question": "", "answer": "#### 2"}])
    cfg = load_config([], [f"data.train={train}", f"data.val={val}", "data.val_size=1", "run.eval_every=1"])
    assert len(load_train_items(cfg)) == 4
    assert refused(load_val_items, cfg) == f"data.val: {val} row 2: the question field 'question' is empty"


def test_other_row_errors_name_the_row_1_based(tmp_path):
    p = write_jsonl(tmp_path / "train.jsonl", [GOOD, {"question": "q", "answer": "5"}])
    msg = refused(load_train_items, load_config([], [f"data.train={p}"]))
    assert msg.startswith(f"data.train: {p} row 2: field 'answer' has no '####'")


def test_real_gsm8k_rows_all_load():
    p = data_path("gsm8k", "train.jsonl")
    items = load_train_items(load_config([], [f"data.train={p}", "data.val=null"]))
    assert len(items) == 7473 and all(it["question"].strip() and it["messages"] is None for it in items)
    assert items[16]["where"] == f"data.train: {p} row 17"


# -- RLME rows: TRL's conversational prompt column ---------------------------------------------


CONVERSATION = [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "I have 2 apples."},
                {"role": "assistant", "content": "Fine."},
                {"role": "user", "content": "I get 3 more. How many now?"}]


def conversational_cfg(tmp_path, *overrides):
    rows = [{"prompt": CONVERSATION, "answer": "#### 5"},
            {"prompt": [{"role": "user", "content": "What is 2 + 3?", "name": "ann"}], "answer": "#### 5"}]
    p = write_jsonl(tmp_path / "train.jsonl", rows)
    return load_config([], [f"data.train={p}", "data.question_field=prompt", *overrides]), p


def test_a_conversational_prompt_is_read_as_messages(tmp_path):
    cfg, p = conversational_cfg(tmp_path)
    items = load_train_items(cfg)
    # the evaluators' text question (reward.py reads item["question"]) is the last user message
    assert [it["question"] for it in items] == ["I get 3 more. How many now?", "What is 2 + 3?"]
    assert items[0]["problem"] == "I get 3 more. How many now?"
    assert items[0]["messages"] == CONVERSATION
    # datasets gives every message the keys any message has; the None ones are dropped
    assert [m.keys() for m in items[1]["messages"]] == [{"role", "content", "name"}]
    assert all("None" not in m["content"] and "[{" not in it["question"] for it in items for m in it["messages"])


def test_a_conversational_prompt_gives_the_chat_template_ids(tmp_path, tok):
    """Exactly apply_chat_template(messages, add_generation_prompt=True, tokenize=True): no second
    BOS, no repr of the list. The old code trained on str(list)."""
    cfg, _ = conversational_cfg(tmp_path, "model.chat_template=true")
    item = load_train_items(cfg)[0]
    chat = policy_chat(tok, cfg["model"])
    assert chat == {"system": None, "kwargs": {}}
    assert rollout.policy_prompt_ids(tok, item, chat, "{question}") == template_ids(tok, CONVERSATION)
    # the prompt template fills the last user message; earlier messages stay as they are
    template = cfg["data"]["prompt_template"]
    wrapped = CONVERSATION[:-1] + [{"role": "user", "content": template.format(question=CONVERSATION[-1]["content"])}]
    assert rollout.policy_prompt_ids(tok, item, chat, template) == template_ids(tok, wrapped)
    assert rollout.policy_prompt_ids(tok, item, chat, template, text_only=True) == template_ids(tok, wrapped, False)
    # keep_short's byte bound reads the whole rendered prompt: a limit just under its length drops it
    n = len(template_ids(tok, wrapped))
    ids = lambda it, text_only: rollout.policy_prompt_ids(tok, it, chat, template, text_only=text_only)
    overhead = len(rollout.build_prompt_ids(tok, "", chat))
    assert keep_short([item], ids, limit=n, key="data.max_prompt_tokens", overhead=overhead) == ([item], 0)
    with pytest.raises(SystemExit, match="every prompt is over"):
        keep_short([item], ids, limit=n - 1, key="data.max_prompt_tokens", overhead=overhead)


def test_a_conversational_prompt_needs_the_chat_template(tmp_path, tok):
    cfg, p = conversational_cfg(tmp_path)
    item = load_train_items(cfg)[0]
    msg = refused(rollout.policy_prompt_ids, tok, item, False, "{question}")
    assert msg.startswith(f"data.train: {p} row 1: the question is chat messages, but the policy prompt is plain "
                          f"text (config key model.chat_template)")
    # model.chat_template=false is known before the model loads: refused at load
    cfg, p = conversational_cfg(tmp_path, "model.chat_template=false")
    assert refused(load_train_items, cfg) == (f"data.train: {p} row 1: the question field 'prompt' holds chat messages, "
                                              f"but config key model.chat_template is false (a plain-text prompt)")


def test_a_conversation_with_its_own_system_message_and_model_system_prompt(tmp_path):
    cfg, p = conversational_cfg(tmp_path, "model.system_prompt=''")
    assert "row 1: the conversation has its own system message and config key model.system_prompt" \
        in refused(load_train_items, cfg)


@pytest.mark.parametrize("prompt, what", [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
     "is a conversation that ends with a 'assistant' message"),
    ([{"role": "user", "content": "  "}], "is a conversation whose last user message is empty"),
    (["Hi", "there"], "must be a string or a list of chat messages {role, content} (TRL's conversational format)"),
    ({"text": "Hi"}, "must be a string or a list of chat messages"),
])
def test_a_malformed_conversation_is_refused(tmp_path, prompt, what):
    p = write_jsonl(tmp_path / "train.jsonl", [{"prompt": prompt, "answer": "#### 1"}])
    msg = refused(load_train_items, load_config([], [f"data.train={p}", "data.question_field=prompt"]))
    assert msg.startswith(f"data.train: {p} row 1: the question field 'prompt' {what}")


# -- pairwise rows: TRL's preference format ------------------------------------------------------


def trl_rows(n, implicit=False):
    rows = []
    for k in range(n):
        prompt = [{"role": "user", "content": f"Question {k}?"}]
        chosen = [{"role": "assistant", "content": f"good {k}"}]
        rejected = [{"role": "assistant", "content": f"bad {k}"}]
        rows.append({"chosen": prompt + chosen, "rejected": prompt + rejected} if implicit
                    else {"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


@pytest.mark.parametrize("implicit", [False, True])
def test_trl_preference_rows_are_pairwise_items(tmp_path, implicit):
    """The old code took explicit-prompt rows for RM-Bench ("must be equal-length lists of
    strings") and implicit-prompt ones for strings ("field 'chosen' must be str")."""
    p = write_jsonl(tmp_path / "trl.jsonl", trl_rows(40, implicit))
    stats = {}
    items = load_pairwise(p, seed=3, stats=stats)
    assert stats["schema"] == ["trl_conversational"] and len(items) == 40
    for k, it in enumerate(items):
        assert it["context"] == f"User: Question {k}?"
        assert it["meta"]["turns"] == [{"role": "user", "content": f"Question {k}?"}]
        win, lose = (it["response_a"], it["response_b"]) if it["winner"] == "A" else (it["response_b"], it["response_a"])
        assert (win, lose) == (f"good {k}", f"bad {k}")
    # the loader's seeded coin decides the order: chosen is not always A, and the same seed gives the same order
    winners = [it["winner"] for it in items]
    assert 5 < winners.count("A") < 35
    assert winners == [it["winner"] for it in load_pairwise(p, seed=3)]
    assert [it["winner"] for it in load_pairwise(p, shuffle=False)] == ["A"] * 40


def test_trl_rows_as_d_h_and_d_o(tmp_path):
    rows = trl_rows(4)
    rows[1]["critique"] = "Response 1 answers the question; Response 2 does not."
    p = write_jsonl(tmp_path / "trl.jsonl", rows)
    cfg = load_config([], ["task=rm_nlhf", f"nlhf.dh={p}", f"nlhf.do={p}"])
    dh = load_dh_items(cfg)
    assert [it["id"] for it in dh] == ["trl:1"]
    assert re.fullmatch(r"Response ([AB]) answers the question; Response ([AB]) does not\.", dh[0]["critique"])
    assert dh[0]["critique"].startswith(f"Response {dh[0]['winner']} ")  # the letters follow the shuffle
    assert len(load_do_items(cfg)) == 4 and all(it["critique"] is None for it in load_do_items(cfg))


def test_a_multi_turn_implicit_prompt(tmp_path):
    shared = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Tell a joke."}]
    p = write_jsonl(tmp_path / "trl.jsonl", [{"chosen": shared + [{"role": "assistant", "content": "A pun."}],
                                              "rejected": shared + [{"role": "assistant", "content": "No."}]}])
    it = load_pairwise(p, shuffle=False)[0]
    assert it["meta"]["turns"] == shared and (it["response_a"], it["response_b"]) == ("A pun.", "No.")
    assert it["context"] == "System: Be kind.\n\nUser: Hi\n\nAssistant: Hello!\n\nUser: Tell a joke."


@pytest.mark.parametrize("row, what", [
    ({"prompt": [{"role": "user", "content": "Q"}],
      "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]},
     "the chosen completion is ['assistant', 'user'] messages; a pairwise item needs one assistant reply each "
     "(TRL's conversational preference format)"),
    ({"chosen": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "b"}]},
     "no 'prompt' field, and 'chosen' and 'rejected' share no leading message (TRL's conversational preference "
     "format, implicit prompt)"),
    ({"prompt": [{"role": "user", "content": " "}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]},
     "the prompt (prompt) is empty (schema trl_conversational)"),
])
def test_trl_rows_that_cannot_be_mapped_are_refused(tmp_path, row, what):
    p = write_jsonl(tmp_path / "trl.jsonl", [trl_rows(1)[0], row])
    assert refused(load_pairwise, p) == f"{p}:2: {what}"


def test_rm_bench_rows_stay_rm_bench_and_trl_rows_are_not_taken_for_them(tmp_path):
    path = data_path("rm_bench", "chat_filtered.jsonl")
    first = read_jsonl(path)[0][1]
    assert detect_schema(first, path) == "rm_bench"
    stats = {}
    items = load_pairwise(path, stats=stats)
    assert stats["schema"] == ["rm_bench"] and len(items) == 9 * stats["rows"]
    assert detect_schema(trl_rows(1)[0], "x") == "trl_conversational"
    assert detect_schema(trl_rows(1, implicit=True)[0], "x") == "trl_conversational"
    assert detect_schema({"prompt": "p", "chosen": "c", "rejected": "r"}, "x") == "chosen_rejected"
    # a TRL file read with a named schema says which format it is
    p = write_jsonl(tmp_path / "trl.jsonl", trl_rows(2))
    assert "holds chat messages (TRL's conversational preference format), not schema rm_bench's; read it with " \
           "schema trl_conversational (or auto)" in refused(load_pairwise, p, "rm_bench")


# -- pairwise rows: a missing or empty prompt ------------------------------------------------------


@pytest.mark.parametrize("row, what", [
    ({"prompt": "", "chosen": "c", "rejected": "r"}, "the prompt (prompt) is empty (schema chosen_rejected)"),
    ({"input": "  ", "output_1": "a", "output_2": "b", "label": 1}, "the prompt (input) is empty (schema llmbar)"),
    ({"question": "", "response_A": "a", "response_B": "b", "label": "A>B"},
     "the prompt (question) is empty (schema judgebench)"),
    ({"prompt": "", "chosen": ["a", "b"], "rejected": ["c", "d"]}, "the prompt (prompt) is empty (schema rm_bench)"),
    ({"context": [{"role": "user", "content": ""}], "response1": "a", "response2": "b", "overall_preference": -1},
     "the prompt (context) is empty (schema helpsteer3)"),
    ({"chosen": "\n\nAssistant: a", "rejected": "\n\nAssistant: b"},
     "the prompt (the part shared by 'chosen' and 'rejected') is empty (schema chosen_rejected)"),
])
def test_an_empty_pairwise_prompt_names_file_and_line(tmp_path, row, what):
    """The old code made an item with an empty context (a judge shown no question)."""
    good = {k: (v if k not in ("prompt", "input", "question") else "Q") for k, v in row.items()}
    if "context" in row:
        good["context"] = "Q"
    if "prompt" not in row and "chosen" in row:
        good = {"chosen": "\n\nHuman: Q\n\nAssistant: a", "rejected": "\n\nHuman: Q\n\nAssistant: b"}
    p = write_jsonl(tmp_path / "pairs.jsonl", [good, good, row])
    assert refused(load_pairwise, p) == f"{p}:3: {what}"


def test_an_empty_pairwise_prompt_stops_d_o_at_load(tmp_path):
    p = write_jsonl(tmp_path / "do.jsonl", [{"prompt": "Q", "chosen": "a", "rejected": "b"},
                                            {"prompt": " ", "chosen": "a", "rejected": "b"}])
    cfg = load_config([], ["task=rm_nlhf", f"nlhf.do={p}"])
    assert refused(load_do_items, cfg) == f"{p}:2: the prompt (prompt) is empty (schema chosen_rejected)"


def test_an_empty_mr_ben_question(tmp_path):
    row = {"Question_UUID": "q1", "Question": "", "Model_Solution_Steps": ["s"], "Model_Solution_Correctness": "correct"}
    p = write_jsonl(tmp_path / "mrben.jsonl", [row])
    assert refused(load_pairwise, p) == f"{p}:1: the prompt field 'Question' is empty (schema mr_ben)"


@pytest.mark.parametrize("folder", ["rm_bench", "llmbar", "judgebench", "pandalm_testset", "hh_rlhf_harmless_base",
                                    "mr_ben_math"])
def test_the_real_pairwise_sets_still_load(folder):
    import glob
    for path in sorted(glob.glob(data_path(folder, "*.jsonl"))):
        items = load_pairwise(path)
        assert items and all(it["context"].strip() for it in items)


def test_split_one_dataset_into_dh_and_do(tmp_path):
    """nlhf.split_dh_fraction (RM-NLHF App. F's 1:1 split of HelpSteer3). Item k's key is
    random.Random(f"{seed}:split:trl:{k}").random(); by hand for 7 items, seed 0: keys (0.1924,
    0.4286, 0.4084, 0.1215, 0.7754, 0.5079, 0.6483), so with f = 0.5 the floor(3.5 + 0.5) = 4
    smallest, items 3, 0, 2, 1, are D_H and 4, 5, 6 D_O; seed 1: keys (0.6590, 0.4891, 0.3398,
    0.7111, 0.6713, 0.4624, 0.5132) -> D_H 2, 5, 1, 6 and D_O 0, 3, 4; f = 0.3, seed 0:
    floor(2.1 + 0.5) = 2 -> D_H 3, 0."""
    rows = [dict(r, critique=f"Response 1 is right about {k}.") for k, r in enumerate(trl_rows(7))]
    p = write_jsonl(tmp_path / "trl.jsonl", rows)
    for seed, frac, want_dh in [(0, 0.5, [0, 1, 2, 3]), (1, 0.5, [1, 2, 5, 6]), (0, 0.3, [0, 3])]:
        cfg = load_config([], ["task=rm_nlhf", f"nlhf.dh={p}", "nlhf.do=null", f"nlhf.split_dh_fraction={frac}",
                               f"run.seed={seed}"])
        dh, do, note = load_nlhf_items(cfg)
        want_do = [k for k in range(7) if k not in want_dh]
        assert [it["id"] for it in dh] == [f"trl:{k}" for k in want_dh]
        assert [it["id"] for it in do] == [f"trl:{k}" for k in want_do]
        assert all(it["critique"] for it in dh) and all(it["critique"] is None for it in do)
        assert note == (f"nlhf.split_dh_fraction={frac}: 7 pairs of {p} split by run.seed={seed} into {len(want_dh)} D_H "
                        f"+ {len(want_do)} D_O (samples.jsonl names each sample's item and set)")
        assert [it["id"] for it in load_dh_items(cfg)] == [it["id"] for it in dh]  # the cold start's D_H
        assert [it["id"] for it in load_do_items(cfg)] == [it["id"] for it in do]
    # an item's side follows its id, not the order the rows were read in
    items = load_pairwise(p, seed=0)
    dh, do = split_dh_do(items[::-1], 0.5, 0)
    assert sorted(it["id"] for it in dh) == [f"trl:{k}" for k in (0, 1, 2, 3)] and len(do) == 3
    # without the key nothing is split, and the split needs nlhf.do: null
    cfg = load_config([], ["task=rm_nlhf", f"nlhf.dh={p}", "nlhf.do=null"])
    assert [len(x) if x is not None else None for x in load_nlhf_items(cfg)] == [7, 0, None]
    assert refused(load_config, [], ["task=rm_nlhf", "nlhf.split_dh_fraction=0.5"]) == (
        "config key nlhf.split_dh_fraction=0.5 splits nlhf.dh into D_H and D_O: set nlhf.do: null (it is Anthropic/hh-rlhf)")
    assert refused(load_config, [], ["task=rm_nlhf", "nlhf.do=null", "nlhf.split_dh_fraction=1.0"]) == (
        "config key nlhf.split_dh_fraction: must be in [0, 1) (0 = off; the share of nlhf.dh that becomes D_H), got 1.0")
    # D_O from the split counts as D_O: metarm_only is allowed
    load_config([], ["task=rm_nlhf", f"nlhf.dh={p}", "nlhf.do=null", "nlhf.split_dh_fraction=0.5", "metarm.mode=metarm_only"])
