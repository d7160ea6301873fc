"""data.py: rows and their errors, RLME items, every pairwise schema, D_H / D_O, eval sets."""
import glob
import json
import os
import random

import pytest

from conftest import data_path
import data as D

GOOD = {"question": "What is 2 + 3?", "answer": "#### 5"}

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)

def refused(fn, *args, **kw):  # the one-line SystemExit message of fn(*args, **kw)
    with pytest.raises(SystemExit) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)

def msg(role, content):
    return {"role": role, "content": content}

def fixture(name):
    return os.path.join(os.path.dirname(__file__), "fixtures", name)

# ---- rows: bad files and lines ------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    ('{"question": "a"}\n{"question": "b", "answer": \n', ":2: not UTF-8 JSON (Expecting value"),
    ('{"a": 1}\n[1, 2]\n', ":2: expected a JSON object, got list"),
    ("", ": no rows"),
])
def test_bad_jsonl_files_name_the_line(tmp_path, content, message):
    p = tmp_path / "train.jsonl"
    p.write_text(content)
    assert refused(D.load_rows, str(p)).startswith(f"{p}{message}")

def test_not_utf8_missing_file_folder_and_too_few_rows(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_bytes('{"question": "a"}\n{"question": "é"}\n'.encode("latin-1"))
    assert refused(D.read_jsonl, str(p)).startswith(
        f"{p}:2: not UTF-8 JSON ('utf-8' codec can't decode byte 0xe9")
    nope = str(tmp_path / "nope.jsonl")
    assert refused(D.load_rows, nope) == refused(D.load_pairwise, nope) == \
        f"{nope}: file does not exist"
    assert refused(D.read_jsonl, str(tmp_path)) == f"{tmp_path}: a folder, not a .jsonl file"
    p = write_jsonl(tmp_path / "t.jsonl", [GOOD] * 3)
    assert refused(D.load_rows, p, n=5) == f"{p}: only 3 rows, 5 asked"

def test_parquet_goes_through_datasets_like_a_hub_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [hs3(-2), hs3(0), hs3(1)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "hs3.parquet"))
    assert D.load_pairwise(str(tmp_path / "hs3.parquet")) == D.load_pairwise(
        write_jsonl(tmp_path / "hs3.jsonl", rows))

# ---- RLME items ---------------------------------------------------------------------------------

def items_of(tmp_path, rows, **kw):
    p = write_jsonl(tmp_path / "train.jsonl", rows)
    return D.load_items(D.load_rows(p), where=f"data.train: {p}", **kw)

def test_gsm8k_items_are_the_old_dicts_and_anchoring_is_seeded(tmp_path):
    p = data_path("gsm8k", "train.jsonl")
    items = D.load_items(D.load_rows(p), where=f"data.train: {p}")
    assert len(items) == 7473 and items[16]["where"] == f"data.train: {p} row 17"
    q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
         "in May. How many clips did Natalia sell altogether in April and May?")
    assert items[0] == {"index": 0, "question": q, "context": None, "problem": q, "label": "72",
                        "answer_text": "72", "anchored": False, "messages": None,
                        "where": f"data.train: {p} row 1"}
    # round(0.25 x 40) = 10 items: torch.randperm(40) of Generator().manual_seed(0), first ten
    p40 = write_jsonl(tmp_path / "t40.jsonl", D.load_rows(p, n=40))
    idx = [it["index"] for it in D.load_rlme_items(p40, anchor_fraction=0.25)[0] if it["anchored"]]
    assert idx == [4, 5, 11, 14, 16, 17, 21, 26, 29, 39]

def test_holdout_and_val_file(tmp_path):
    p = data_path("gsm8k", "train.jsonl")
    items, held = D.load_rlme_items(p, "holdout", val_size=5, anchor_fraction=0.25, seed=0)
    # val_draw: torch.randperm(7473) of Generator().manual_seed(0 * 7 + 1), the first 5, sorted
    assert [it["index"] for it in held] == [460, 1421, 4570, 5782, 6613] == D.val_draw(7473, 5, 0)
    assert len(items) == 7468 and not {it["index"] for it in held} & {it["index"] for it in items}
    assert sum(it["anchored"] for it in items) == 1867 and not any(it["anchored"] for it in held)
    assert D.val_draw(10, 3, 0) == [1, 5, 6] and D.val_draw(10, 3, 1) == [0, 3, 5]
    val = write_jsonl(tmp_path / "val.jsonl", [GOOD, {"question": "", "answer": "#### 2"}])
    assert refused(D.load_rlme_items, p, val, val_size=1) == (
        f"data.val: {val} row 2: the question field 'question' is empty")
    small = write_jsonl(tmp_path / "small.jsonl", [GOOD] * 3)
    assert refused(D.load_rlme_items, small, "holdout", val_size=3) == (
        "config key data.val_size=3: the holdout takes all 3")
    assert len(D.load_rlme_items(small, small, val_size=0)[1]) == 3  # 0 = all of a val file

@pytest.mark.parametrize("bad, what", [
    ({"question": "", "answer": "#### 1"}, "is empty"),
    ({"question": "  \n ", "answer": "#### 1"}, "is empty"),
    ({"question": None, "answer": "#### 1"}, "is missing (null)"),
    ({"answer": "#### 1"}, "is missing (null)"),
    ({"question": [], "answer": "#### 1"}, "is empty"),
])
def test_an_empty_or_missing_question_names_file_and_row(tmp_path, bad, what):
    msg = refused(items_of, tmp_path, [GOOD, GOOD, bad, GOOD])
    assert msg == f"data.train: {tmp_path}/train.jsonl row 3: the question field 'question' {what}"

def test_label_and_field_errors_name_the_row(tmp_path):
    w = f"data.train: {tmp_path / 'train.jsonl'} row 2"
    assert refused(items_of, tmp_path, [GOOD, {"question": "q", "answer": "5"}]) == (
        f"{w}: field 'answer' has no '####' (set data.label_format=plain for bare answers)")
    assert refused(items_of, tmp_path, [GOOD, {"question": "q"}]) == (
        f"{w}: no field 'answer' (fields: question)")
    rows = [GOOD, {"question": 7, "answer": "$1,234."}]
    assert items_of(tmp_path, rows, label_format="plain")[1]["label"] == "1234"
    rows = [dict(GOOD, ctx="c"), dict(GOOD, ctx=5)]
    assert refused(items_of, tmp_path, rows, context_field="ctx") == (
        f"{w}: field 'ctx': expected a str, a list of str or [title, sentence, ...] passages, "
        f"got 5")

def test_text_labels_and_qa_feedback_passages(tmp_path):
    rows = [{"question": "Q1", "answer": {"text": ["Paris", "paris"]}, "ctx": "Some text."},
            {"question": "Q2", "answer": "Lyon", "ctx": [["Title", "One.", "Two."], ["Solo"]]}]
    items = items_of(tmp_path, rows, label_format="text", context_field="ctx", context_max_chars=12)
    assert [(it["label"], it["answer_text"]) for it in items] == [
        (["Paris", "paris"], "Paris"), ("Lyon", "Lyon")]
    assert items[0]["problem"] == "Some text.\n\nQ1" and items[1]["context"] == "Title: One. "
    assert D.render_context([["Title", "One.", "Two."], ["Solo"]], 0) == "Title: One. Two.\n\nSolo"
    rows = D.load_rows(data_path("qa_feedback", "dev_feedback.jsonl"))
    qa = D.load_items(rows, answer_field="gold", label_format="text", context_field="passages")
    assert len(qa) == 500 and all(len(it["context"]) <= 4000 and it["label"] for it in qa)

CONVERSATION = [msg("system", "Answer with a number."), msg("user", "I have 2 apples."),
                msg("assistant", "Fine."), msg("user", "I get 3 more. How many now?")]

def test_a_conversational_question_keeps_its_messages(tmp_path):
    one = [{"role": "user", "content": "What is 2 + 3?", "name": None}]
    rows = [{"prompt": CONVERSATION, "answer": "#### 5"}, {"prompt": one, "answer": "#### 5"}]
    items = items_of(tmp_path, rows, question_field="prompt")
    assert [it["question"] for it in items] == [CONVERSATION[-1]["content"], "What is 2 + 3?"]
    assert items[0]["messages"] == CONVERSATION and items[0]["problem"] == items[0]["question"]
    assert items[1]["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]  # None dropped

@pytest.mark.parametrize("prompt", [
    [msg("user", "Hi"), msg("assistant", "Hello")], [msg("user", "  ")], ["Hi", "there"], {"t": 1}])
def test_a_malformed_conversation_is_refused(tmp_path, prompt):
    msg = refused(items_of, tmp_path, [{"q": prompt}], question_field="q", answer_field=None)
    assert msg.startswith(f"data.train: {tmp_path}/train.jsonl row 1: the question field 'q' must "
                          f"be a string or chat messages {{role, content}} ending in a non-empty")

# ---- pairwise schemas ---------------------------------------------------------------------------

def hs3(pref, r1="first answer", r2="second answer",
        reasons=("@Response 1 is wrong.", "@Response 2 is clear.")):
    turns = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Sum 2+2?"}]
    return {"context": turns, "response1": r1, "response2": r2, "overall_preference": pref,
            "individual_preference": [{"score": pref, "reasoning": r} for r in reasons]}

def test_helpsteer3_sign_ties_and_critique_letters(tmp_path):
    rows = [hs3(-2), hs3(0), hs3(3), hs3(-1, reasons=())]
    items = D.load_pairwise(write_jsonl(tmp_path / "hs3.jsonl", rows), shuffle=False)
    # -2: response1 better -> A (unshuffled); the tie (row 2) is dropped; +3: response2 -> B
    c = "Response A is wrong.\nResponse B is clear."  # '@Response 1' -> the (unswapped) letter
    assert [(it["id"], it["winner"], it["critique"]) for it in items] == [
        ("hs3:0", "A", c), ("hs3:2", "B", c), ("hs3:3", "A", None)]  # no reasoning: a D_O item
    assert items[0]["context"] == "User: Hi?\n\nAssistant: Hello.\n\nUser: Sum 2+2?"
    assert items[0]["meta"] == {"overall_preference": -2, "turns": rows[0]["context"], "swapped": 0}
    p = write_jsonl(tmp_path / "many.jsonl", [hs3(-3, f"good {i}", f"bad {i}") for i in range(40)])
    items = D.load_pairwise(p, seed=7)
    assert 5 < sum(it["meta"]["swapped"] for it in items) < 35  # a fair coin per item
    for it in items:  # the winner and the critique's letters follow response1 through the swap
        assert (it["response_a"] if it["winner"] == "A" else it["response_b"]).startswith("good")
        assert it["critique"].splitlines()[0] == f"Response {it['winner']} is wrong."
    assert D.load_pairwise(p, seed=7, max_items=5) == items[:5]  # the coin: (seed, id) only

def test_bad_pairwise_rows_give_one_line_errors(tmp_path):
    bad = hs3(-1)
    del bad["response2"]
    p = write_jsonl(tmp_path / "hs3.jsonl", [hs3(-1), bad])
    assert refused(D.load_pairwise, p) == f"{p}:2: missing field 'response2' (schema helpsteer3)"
    p = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    assert refused(D.load_pairwise, p).startswith(
        f"{p}:1: unknown pairwise schema, fields found: ['answer', 'question']")
    p = write_jsonl(tmp_path / "cr.jsonl", [dict(prompt="p", chosen="x", rejected="y"),
                                            dict(prompt="p", chosen="x", rejected=None)])
    assert refused(D.load_pairwise, p).startswith(f"{p}:2: missing field 'rejected' (schema")
    p = write_jsonl(tmp_path / "trl.jsonl", [dict(prompt="p", chosen=[msg("assistant", "x")],
                                                  rejected=[msg("assistant", "y")])])
    assert refused(D.load_pairwise, p) == (f"{p}:1: 'chosen' and 'rejected' must be strings (chat "
                                           f"messages are not read) (schema chosen_rejected)")
    p = write_jsonl(tmp_path / "lb.jsonl", [dict(input="q", output_1="a", output_2="b", label=3)])
    assert refused(D.load_pairwise, p) == (
        f"{p}:1: field 'label' must be one of [1, 2], got 3 (schema llmbar)")

def test_generic_chosen_rejected_with_optional_critique(tmp_path):
    items = D.load_pairwise(write_jsonl(tmp_path / "cr.jsonl", [
        dict(prompt="Q1", chosen="good", rejected="bad", critique="Response 2 is rude."),
        dict(prompt=[msg("user", "Q2")], chosen="c", rejected="r"),
        dict(prompt="Q3", chosen="same", rejected="same")]), shuffle=False)  # equal: dropped
    assert [(it["context"], it["response_a"], it["critique"]) for it in items] == [
        ("Q1", "good", "Response B is rude."), ("User: Q2", "c", None)]

def pair_rows(n):
    return [{"prompt": f"Question {k}?", "chosen": f"good {k}", "rejected": f"bad {k}"}
            for k in range(n)]

@pytest.mark.parametrize("row, field, schema", [
    ({"prompt": "", "chosen": "c", "rejected": "r"}, "prompt", "chosen_rejected"),
    ({"input": "  ", "output_1": "a", "output_2": "b", "label": 1}, "input", "llmbar"),
    ({"question": "", "response_A": "a", "response_B": "b", "label": "A>B"}, "question",
     "judgebench"),
    ({"prompt": "", "chosen": ["a", "b"], "rejected": ["c", "d"]}, "prompt", "rm_bench"),
    ({"context": [msg("user", "")], "response1": "a", "response2": "b", "overall_preference": -1},
     "context", "helpsteer3"),
    ({"Question_UUID": "q1", "Question": " ", "Model_Solution_Steps": ["s"],
      "Model_Solution_Correctness": "correct"}, "Question", "mr_ben"),
])
def test_an_empty_pairwise_prompt_names_file_and_line(tmp_path, row, field, schema):
    """A judge shown no question: refused at load, for D_O too."""
    p = write_jsonl(tmp_path / "pairs.jsonl", [row])
    assert refused(D.load_pairwise, p) == f"{p}:1: the prompt ({field}) is empty (schema {schema})"
    if schema == "chosen_rejected":
        q = write_jsonl(tmp_path / "dh.jsonl", [dict(row, prompt="Q", critique="Response 1 wins.")])
        assert refused(D.load_nlhf_items, q, p, seed=0) == (
            f"{p}:1: the prompt (prompt) is empty (schema {schema})")

def test_pandalm_majority_and_judgebench_ties(tmp_path):
    base = {"idx": 0, "instruction": "Do it", "input": "", "response1": "r1", "response2": True}
    votes = [(1, 0, 1), (2, 0, 0), (2, 1, 2), (1, 2, 0), (0, 0, 0)]
    rows = [dict(base, idx=i, annotator1=a, annotator2=b, annotator3=c)
            for i, (a, b, c) in enumerate(votes)]
    items = D.load_pairwise(write_jsonl(tmp_path / "p.jsonl", rows), shuffle=False)
    assert [(it["id"], it["winner"], it["response_b"]) for it in items] == [
        ("pandalm:0", "A", "True"), ("pandalm:2", "B", "True")]  # a JSON `true` response as text
    jb = [{"pair_id": f"j{k}", "question": "Q", "response_A": "a", "response_B": "b", "label": lab,
           "source": "math"} for k, lab in enumerate(["A>B", "A=B", "B>A"])]
    items = D.load_pairwise(write_jsonl(tmp_path / "jb.jsonl", jb), shuffle=False)
    assert [(it["id"], it["winner"], it["meta"]["category"]) for it in items] == [
        ("j0", "A", "math"), ("j2", "B", "math")]

def released_row(winner="A", critique=True, **over):
    info = {"context": [msg("user", "Capital of France?")], "response_A": "Paris.",
            "response_B": "Lyon.", "winner": winner, "dataset_type": "DataWithHumanCritique"}
    if critique:
        info["processed_critique"] = {
            "strengths_A": "Response A names the right city.", "weaknesses_A": "",
            "strengths_B": ["Short."], "weaknesses_B": "Response B is wrong, unlike Response A."}
    return {"prompt": [msg("user", "...")], "extra_info": dict(info, **over)}

def test_released_schema_keeps_critiques_per_response_through_the_shuffle(tmp_path):
    rows = [released_row(id=f"r{k}") for k in range(12)] + [released_row(critique=False, id="x")]
    rows[-1]["extra_info"] = json.dumps(rows[-1]["extra_info"])  # some rows hold it as JSON text
    items = D.load_pairwise(write_jsonl(tmp_path / "rel.jsonl", rows), seed=0)
    kept, swapped = ([it for it in items[:12] if it["meta"]["swapped"] == s] for s in (False, True))
    assert kept and swapped and items[0]["context"] == "User: Capital of France?"
    for it in kept:
        assert it["winner"] == "A" and it["critique"] == (
            "Response A strengths: Response A names the right city.\n"
            "Response A weaknesses: none noted\nResponse B strengths: Short.\n"
            "Response B weaknesses: Response B is wrong, unlike Response A.")
    for it in swapped:  # the parts AND the letters inside them follow their responses
        assert it["winner"] == "B" and it["response_b"] == "Paris." and it["critique"] == (
            "Response A strengths: Short.\n"
            "Response A weaknesses: Response A is wrong, unlike Response B.\n"
            "Response B strengths: Response B names the right city.\n"
            "Response B weaknesses: none noted")
    assert items[-1]["critique"] is None  # no human feedback: a D_O row
    p = write_jsonl(tmp_path / "bad.jsonl", [released_row(winner="C")])
    assert refused(D.load_pairwise, p) == (
        f"{p}:1: field 'extra_info.winner' must be 'A' or 'B', got 'C' (schema rm_nlhf)")
    p = write_jsonl(tmp_path / "bad2.jsonl", [{"extra_info": "{not json"}])
    assert refused(D.load_pairwise, p).startswith(f"{p}:1: Expecting property name")

def test_the_fixtures_load():
    hs = D.load_pairwise(fixture("helpsteer3_sample.jsonl"), seed=0)  # the tie dropped
    assert [it["winner"] for it in hs] == ["A", "B", "B"] and hs[2]["id"] == "helpsteer3_sample:2"
    assert hs[0]["critique"] == "Response A is better: 9 = 3 x 3 is not prime."
    rel = D.load_pairwise(fixture("rm_nlhf_sample.jsonl"), seed=0)
    assert len(rel) == 4 and rel[0]["critique"].startswith("Response A strengths: Response A is")
    rb2 = D.load_pairwise(fixture("reward_bench_2_sample.jsonl"), shuffle=False)  # Ties dropped
    assert [it["id"] for it in rb2[:3]] == ["f1:0", "f1:1", "f1:2"] and len(rb2) == 6 * 3

def test_real_pairwise_sets_load_with_their_counts():
    hh = D.load_pairwise(data_path("hh_rlhf_harmless_base", "test.jsonl"), shuffle=False)
    assert len(hh) == 2312 and all(it["critique"] is None and it["winner"] == "A" for it in hh)
    assert hh[0]["context"].startswith("Human: what are some pranks with a pen i can do?\n\nAssis")
    # row 1254: the chosen response itself holds the marker; the prompt is the shared part
    assert hh[1254]["context"].endswith("Human: Isn't that drag kings?")
    assert hh[1254]["response_a"].startswith("No. Men who impersonate")
    assert hh[1254]["response_b"].startswith("A drag king is the opposite")
    assert len(D.load_pairwise(data_path("pandalm_testset", "testset-v1.jsonl"))) == 894  # 105 ties
    assert len(D.load_pairwise(data_path("llmbar"))) == 885  # 8 files in the folder
    assert len(D.load_pairwise(data_path("judgebench"))) == 350 + 270
    for path in sorted(glob.glob(data_path("rm_bench", "*.jsonl"))):
        assert D._detect(D.read_jsonl(path)[0][1], path) == "rm_bench"
    rm = D.load_pairwise(data_path("rm_bench", "chat_filtered.jsonl"), shuffle=False)
    assert len(rm) == 129 * 9  # the 3x3 style grid
    assert (rm[5]["meta"]["chosen_style"], rm[5]["meta"]["rejected_style"]) == (1, 2)

def test_mr_ben_pairs_on_the_real_file():
    """306 questions: 58 with 1 correct of 3, 38 with 2 of 3, 2 pairs each: 192 pairs."""
    path, qid = data_path("mr_ben_math", "math.jsonl"), "1b2038d9-ea05-4e45-9a11-7d73463cdd20"
    items = D.load_pairwise(path)
    assert len(items) == 192 and all(it["critique"] for it in items)
    q = [it for it in items if it["id"].startswith(f"{qid}:")]
    assert [it["id"].split(":")[1] for it in q] == ["GPT3.5>Claude2", "GPT3.5>mistral-medium"]
    sols = {r["Sampled_Model"]: r for _, r in D.read_jsonl(path) if r["Question_UUID"] == qid}
    for it, bad in zip(q, ["Claude2", "mistral-medium"]):
        win, lose = it["winner"], "B" if it["winner"] == "A" else "A"
        steps = lambda m: "\n".join(sols[m]["Model_Solution_Steps"])  # noqa: E731
        assert (it[f"response_{win.lower()}"], it[f"response_{lose.lower()}"]) == (steps("GPT3.5"),
                                                                                 steps(bad))
        lines = it["critique"].splitlines()  # per response, in the final A/B letters
        assert lines["AB".index(win) * 2] == f"Response {win} strengths: Its solution is correct."
        assert lines["AB".index(lose) * 2 + 1].startswith(
            f"Response {lose} weaknesses: Its solution is incorrect; the first error is in step "
            f"{sols[bad]['Model_Solution_First_Error_Step']}. ")
        assert all(r.strip() in it["critique"] for r in sols[bad]["Model_Solution_Error_Reason"])
        assert it["context"].startswith(sols["GPT3.5"]["Question"])
        assert "Options:\nA:" in it["context"]

# ---- D_H, D_O and the held-out pairs (RM-NLHF §3.2.1, App. F) -----------------------------------

def test_split_one_dataset_into_dh_and_do(tmp_path):
    """Item k's key is random.Random(f"{seed}:split:trl:{k}").random(); by hand for 7 items, seed 0:
    keys (0.1924, 0.4286, 0.4084, 0.1215, 0.7754, 0.5079, 0.6483), so with f = 0.5 the
    floor(3.5 + 0.5) = 4 smallest, items 3, 0, 2, 1, are D_H and 4, 5, 6 D_O; seed 1: keys (0.6590,
    0.4891, 0.3398, 0.7111, 0.6713, 0.4624, 0.5132) -> D_H 2, 5, 1, 6; f = 0.3, seed 0:
    floor(2.1 + 0.5) = 2 -> D_H 3, 0."""
    rows = [dict(r, critique=f"Response 1 is right about {k}.") for k, r in enumerate(pair_rows(7))]
    p = write_jsonl(tmp_path / "trl.jsonl", rows)
    for seed, frac, want_dh in [(0, 0.5, [0, 1, 2, 3]), (1, 0.5, [1, 2, 5, 6]), (0, 0.3, [0, 3])]:
        dh, do, note = D.load_nlhf_items(p, seed=seed, split_dh_fraction=frac)
        want_do = [k for k in range(7) if k not in want_dh]
        assert [it["id"] for it in dh] == [f"trl:{k}" for k in want_dh]
        assert [it["id"] for it in do] == [f"trl:{k}" for k in want_do]
        assert all(it["critique"] for it in dh) and all(it["critique"] is None for it in do)
        assert note == (f"nlhf.split_dh_fraction={frac}: 7 pairs of {p} split by run.seed={seed} "
                        f"into {len(want_dh)} D_H + {len(want_do)} D_O (samples.jsonl names each "
                        f"sample's item and set)")
    # an item's side follows its id, not the order the rows were read in
    dh, do = D.split_dh_do(D.load_pairwise(p, seed=0)[::-1], 0.5, 0)
    assert sorted(it["id"] for it in dh) == [f"trl:{k}" for k in (0, 1, 2, 3)] and len(do) == 3
    assert [len(x) for x in D.load_nlhf_items(p, seed=0)[:2]] == [7, 0]

def test_dh_needs_critiques_and_do_drops_them(tmp_path):
    rows = pair_rows(4)
    rows[1]["critique"] = "Response 1 answers the question; Response 2 does not."
    p = write_jsonl(tmp_path / "trl.jsonl", rows)
    dh, do, note = D.load_nlhf_items(p, p, seed=0)
    assert [it["id"] for it in dh] == ["trl:1"] and note is None
    win, lose = dh[0]["winner"], "B" if dh[0]["winner"] == "A" else "A"  # letters follow the coin
    assert dh[0]["critique"] == f"Response {win} answers the question; Response {lose} does not."
    assert len(do) == 4 and all(it["critique"] is None for it in do)
    q = write_jsonl(tmp_path / "plain.jsonl", pair_rows(2))
    assert refused(D.load_nlhf_items, q, seed=0) == (
        f"config key nlhf.dh={q}: no item has a human critique (D_H needs them)")

def test_nlhf_validation_pairs():
    dh = D.load_pairwise(data_path("mr_ben_math", "math.jsonl"))
    val, rest = D.load_nlhf_val_items("holdout", dh, size=2, seed=0)
    assert [it["id"] for it in val] == [dh[i]["id"] for i in D.val_draw(192, 2, 0)]
    assert len(rest) == 190
    assert refused(D.load_nlhf_val_items, "holdout", dh[:2], size=2, seed=0).endswith("takes all 2")
    val, rest = D.load_nlhf_val_items(fixture("helpsteer3_sample.jsonl"), dh, size=0, seed=0)
    assert len(val) == 3 and rest is dh

# ---- evaluation sets ----------------------------------------------------------------------------

def test_math_problems():
    gsm = D.load_math_problems(data_path("gsm8k", "test.jsonl"), 2)
    assert [(p["label"], p["answer_text"], p["kind"]) for p in gsm] == [("18", "18", "gsm8k"),
                                                                          ("3", "3", "gsm8k")]
    m = D.load_math_problems(data_path("math500", "test.jsonl"))
    assert len(m) == 500 and m[0]["id"] == "test/precalculus/807.json" and m[0]["kind"] == "math"
    assert refused(D.load_math_problems, data_path("math500", "test.jsonl"), 501).endswith(
        "only 500 rows, 501 asked")

def test_faitheval_multiple_choice_and_plain_qa(tmp_path):
    fields = {k: v for k, v in D.QA_PRESETS["faitheval"].items() if k.endswith("_field")}
    items = D.load_qa_items(fixture("faitheval_counterfactual_sample.jsonl"), **fields)
    assert [(it["label"], it["choice_letters"]) for it in items[:3]] == [
        (["Venus"], ["B"]), (["100 degrees Celsius"], ["C"]), (["It decreases."], ["1", "A"])]
    assert items[2]["question"].endswith(  # a positional key: 'A' on options labelled 1-4
        "\nOptions:\n1) It decreases.\n2) It increases.\n3) It stays the same.\n4) It doubles at "
        "once.")
    rows = [{"question": "Q", "context": ["a", "b"], "answer": {"text": ["x", "y"]}},
            {"question": "Q2", "context": "c", "answer": "z"}]
    p = write_jsonl(tmp_path / "qa.jsonl", rows)
    assert [(it["context"], it["label"], it["answer_text"]) for it in D.load_qa_items(p)] == [
        ("a\n\nb", ["x", "y"], "x"), ("c", ["z"], "z")]
    assert refused(D.load_qa_items, p, answer_field="gold") == (
        f"{p} row 1: no field 'gold'; fields: ['answer', 'context', 'question']")

def test_benchmarks_and_their_seeded_subsets():
    assert len(D.benchmark_units("llmbar")) == 8
    assert D.benchmark_units("helpsteer3") == [{
        "name": "helpsteer3", "benchmark": "HelpSteer3", "schema": "helpsteer3",
        "split": "validation", "config": "preference", "file": "validation",
        "path": "nvidia/HelpSteer3", "hub": True}]
    rb2 = D.load_benchmark(fixture("reward_bench_2_sample.jsonl"), 2, seed=0)  # whole groups
    # units f1 f2 f3 f4 g1 g2 (file order); random.Random("0:reward_bench_2_sample.jsonl") keeps 0, 2
    assert [it["id"] for it in rb2] == ["f1:0", "f1:1", "f1:2", "f3:0", "f3:1", "f3:2"]
    path = data_path("rm_bench", "chat_filtered.jsonl")
    every = D.load_pairwise(path, seed=0)
    keep = sorted(random.Random("0:chat_filtered.jsonl").sample(range(len(every)), 5))  # (seed,
    # the file's name): the same subset in every checkout
    assert D.load_benchmark(path, 5, seed=0) == [every[i] for i in keep]  # a sample, in file order

def test_judge_check_items(tmp_path):
    row = dict(context="c", response_a="a", response_b="b", human_critique="h", critique="g",
               label=1)
    p = write_jsonl(tmp_path / "jc.jsonl", [row, dict(row, id="x")])
    assert [it["id"] for it in D.load_judge_check_items(p)] == ["line1", "x"]
    p = write_jsonl(tmp_path / "bad.jsonl", [row, dict(row, label=True)])
    assert refused(D.load_judge_check_items, p) == f"{p}:2: field 'label' must be 0 or 1, got True"
    p = write_jsonl(tmp_path / "bad2.jsonl", [dict(row, critique=None), {}])
    assert refused(D.load_judge_check_items, p) == f"{p}:2: missing field 'context'"
