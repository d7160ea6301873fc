"""RM-NLHF's plumbing: the pairwise dataset schemas (plumbing/pairwise.py: HelpSteer3, Mr-Ben, the authors' rm_nlhf rows, RewardBench 2, parquet) and the critique judge's client (plumbing/judge.py, plumbing/http_client.py: retries and backoff against a real local HTTP server, start-up errors, transformers serve)."""
import json
import socket
import time

import pytest

from conftest import chat_body, data_path, make_judge
import reward

from plumbing.pairwise import load_pairwise
from plumbing.http_client import backoff_delay


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def hs3(pref, r1="first answer", r2="second answer", reasons=("@Response 1 is wrong.", "@Response 2 is clear.")):
    return {"domain": "general", "language": "english",
            "context": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": "Sum 2+2?"}],
            "response1": r1, "response2": r2, "overall_preference": pref,
            "individual_preference": [{"score": pref, "reasoning": r, "feedback1": "", "feedback2": ""} for r in reasons]}


def test_helpsteer3_sign_and_ties(tmp_path):
    path = write_jsonl(tmp_path / "hs3.jsonl", [hs3(-2), hs3(0), hs3(3), hs3(-1, reasons=())])
    stats = {}
    items = load_pairwise(path, shuffle=False, stats=stats)
    assert stats == {"rows": 4, "items": 3, "dropped": 1, "schema": ["helpsteer3"]}
    # -2: response1 better -> A (unshuffled); the tie (line 2) is dropped; +3: response2 -> B
    assert [it["winner"] for it in items] == ["A", "B", "A"]
    assert [it["id"] for it in items] == ["hs3:0", "hs3:2", "hs3:3"]
    assert items[0]["response_a"] == "first answer" and items[0]["response_b"] == "second answer"
    assert items[0]["context"] == "User: Hi?\n\nAssistant: Hello.\n\nUser: Sum 2+2?"
    # reasonings joined by newlines, '@Response 1/2' mapped to the (unswapped) letters
    assert items[0]["critique"] == "Response A is wrong.\nResponse B is clear."
    assert items[2]["critique"] is None  # no reasoning texts -> D_O item


def test_shuffle_flips_winner_and_critique_letters(tmp_path):
    rows = [hs3(-3, r1=f"good {i}", r2=f"bad {i}") for i in range(40)]
    path = write_jsonl(tmp_path / "hs3.jsonl", rows)
    items = load_pairwise(path, seed=7)
    swapped = [it["meta"]["swapped"] for it in items]
    assert 5 < sum(swapped) < 35  # a fair coin per item, 40 flips
    for it in items:
        winner_text = it["response_a"] if it["winner"] == "A" else it["response_b"]
        assert winner_text.startswith("good")  # the winner follows its response through the swap
        # the human critique faults response1 ('@Response 1 is wrong.'), wherever it ended up
        assert it["critique"].splitlines()[0] == ("Response B is wrong." if it["meta"]["swapped"] else "Response A is wrong.")
    again = load_pairwise(path, seed=7)
    assert [it["winner"] for it in again] == [it["winner"] for it in items]
    # the coin depends on (seed, id) only: loading a subset does not change an item's order
    assert load_pairwise(path, seed=7, max_items=5) == items[:5]
    other = load_pairwise(path, seed=8)
    assert [it["winner"] for it in other] != [it["winner"] for it in items]


def test_bad_rows_give_one_line_errors(tmp_path):
    bad = hs3(-1)
    del bad["response2"]
    path = write_jsonl(tmp_path / "hs3.jsonl", [hs3(-1), bad])
    with pytest.raises(SystemExit, match=r"hs3.jsonl:2: missing field 'response2' \(schema helpsteer3\)"):
        load_pairwise(path)
    path = write_jsonl(tmp_path / "pref.jsonl", [hs3(5)])
    with pytest.raises(SystemExit, match=r"pref.jsonl:1: field 'overall_preference' must be an integer in -3..3, got 5"):
        load_pairwise(path)
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(SystemExit, match=r"odd.jsonl:1: unknown pairwise schema, fields found: \['answer', 'question'\]"):
        load_pairwise(path)
    path = write_jsonl(tmp_path / "cr.jsonl", [{"prompt": "p", "chosen": "x", "rejected": "y"}, {"prompt": "p", "chosen": "x"}])
    with pytest.raises(SystemExit, match=r"cr.jsonl:2: missing field 'rejected'"):
        load_pairwise(path)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "p"}\n{not json\n')
    with pytest.raises(SystemExit, match=r"broken.jsonl:2: not valid JSON"):
        load_pairwise(str(tmp_path / "broken.jsonl"))
    with pytest.raises(SystemExit, match="does not exist"):
        load_pairwise(str(tmp_path / "nope.jsonl"))
    with pytest.raises(SystemExit, match="schema 'foo' unknown"):
        load_pairwise(path, schema="foo")


def test_generic_chosen_rejected_with_optional_critique(tmp_path):
    path = write_jsonl(tmp_path / "cr.jsonl", [
        {"prompt": "Q1", "chosen": "good", "rejected": "bad", "critique": "Response 2 is rude."},
        {"prompt": [{"role": "user", "content": "Q2"}], "chosen": "c", "rejected": "r"},
        {"prompt": "Q3", "chosen": "same", "rejected": "same"}])  # identical responses: dropped
    items = load_pairwise(path, shuffle=False)
    assert [(it["context"], it["response_a"], it["response_b"], it["winner"]) for it in items] == [
        ("Q1", "good", "bad", "A"), ("User: Q2", "c", "r", "A")]
    assert items[0]["critique"] == "Response B is rude." and items[1]["critique"] is None


def test_mr_ben_pairs_on_real_file():
    path = data_path("mr_ben_math", "math.jsonl")
    stats = {}
    items = load_pairwise(path, stats=stats)
    # 306 questions: 58 with 1 correct + 2 incorrect (2 pairs each), 38 with 2 + 1 (2 pairs each);
    # 205 all-incorrect and 5 all-correct questions give none: 116 + 76 = 192 pairs, 210*3 = 630 rows unused
    assert stats == {"rows": 918, "items": 192, "dropped": 630, "schema": ["mr_ben"]}
    assert all(it["critique"] for it in items)
    # question 1b2038d9...: Claude2 incorrect, GPT3.5 correct, mistral-medium incorrect
    q = [it for it in items if it["id"].startswith("1b2038d9-ea05-4e45-9a11-7d73463cdd20:")]
    assert [it["id"].split(":")[1] for it in q] == ["GPT3.5>Claude2", "GPT3.5>mistral-medium"]
    rows = [json.loads(line) for line in open(path)]
    sols = {r["Sampled_Model"]: r for r in rows if r["Question_UUID"] == "1b2038d9-ea05-4e45-9a11-7d73463cdd20"}
    for it, bad in zip(q, ["Claude2", "mistral-medium"]):
        win = it["response_a"] if it["winner"] == "A" else it["response_b"]
        lose = it["response_b"] if it["winner"] == "A" else it["response_a"]
        assert win == "\n".join(sols["GPT3.5"]["Model_Solution_Steps"])
        assert lose == "\n".join(sols[bad]["Model_Solution_Steps"])
        loser = "B" if it["winner"] == "A" else "A"
        step = sols[bad]["Model_Solution_First_Error_Step"]
        # kept per response, in the final A/B letters (structured_critique)
        lines = it["critique"].splitlines()
        assert lines[["A", "B"].index(it["winner"]) * 2] == f"Response {it['winner']} strengths: Its solution is correct."
        assert lines[["A", "B"].index(loser) * 2 + 1].startswith(
            f"Response {loser} weaknesses: Its solution is incorrect; the first error is in step {step}. ")
        assert f"Response {loser} strengths: none noted" in lines
        for reason in sols[bad]["Model_Solution_Error_Reason"]:
            assert reason.strip() in it["critique"]
        assert it["context"].startswith(sols["GPT3.5"]["Question"]) and "Options:\nA:" in it["context"]


def test_offline_sets_load_with_expected_counts():
    hh = load_pairwise(data_path("hh_rlhf_harmless_base", "test.jsonl"), shuffle=False)
    assert len(hh) == 2312 and all(it["critique"] is None and it["winner"] == "A" for it in hh)
    assert hh[0]["context"].startswith("Human: what are some pranks with a pen i can do?\n\nAssistant:")
    assert hh[0]["response_a"].startswith("No, sorry!  All of these involve a pen")
    # row 1254: the chosen response itself contains 'Human:'; the prompt is the shared prefix
    assert hh[1254]["context"].endswith("Human: Isn't that drag kings?")
    assert hh[1254]["response_a"].startswith("No. Men who impersonate")
    assert hh[1254]["response_b"].startswith("A drag king is the opposite")
    # PandaLM: 999 rows, 105 without a 1-or-2 majority (e.g. (0,0,0), (2,0,0)) dropped
    assert len(load_pairwise(data_path("pandalm_testset", "testset-v1.jsonl"))) == 894
    assert len(load_pairwise(data_path("llmbar"))) == 885  # 8 files in the folder
    assert len(load_pairwise(data_path("judgebench"))) == 350 + 270
    rm = load_pairwise(data_path("rm_bench", "chat_filtered.jsonl"), shuffle=False)
    assert len(rm) == 129 * 9  # the 3x3 style grid
    assert rm[5]["meta"]["chosen_style"] == 1 and rm[5]["meta"]["rejected_style"] == 2


def test_pandalm_majority(tmp_path):
    base = {"idx": 0, "instruction": "Do it", "input": "", "response1": "r1", "response2": "r2"}
    votes = [(1, 0, 1), (2, 0, 0), (2, 1, 2), (1, 2, 0), (0, 0, 0)]
    rows = [dict(base, idx=i, annotator1=a, annotator2=b, annotator3=c) for i, (a, b, c) in enumerate(votes)]
    items = load_pairwise(write_jsonl(tmp_path / "p.jsonl", rows), shuffle=False)
    assert [(it["id"], it["winner"]) for it in items] == [("pandalm:0", "A"), ("pandalm:2", "B")]


def test_backoff_delay_numbers():
    # d = min(cap, base*2^k); delay = d/2 + u*d/2
    assert backoff_delay(0, 1.0, 30.0, 0.5) == 0.75
    assert backoff_delay(1, 1.0, 30.0, 0.5) == 1.5
    assert backoff_delay(3, 1.0, 30.0, 0.0) == 4.0
    assert backoff_delay(10, 1.0, 30.0, 1.0) == 30.0


def test_retry_429_429_200(stub_server):
    rate = (429, {}, '{"error": {"message": "slow down"}}')
    stub_server["plan"] = [rate, rate, (200, {},
                                        chat_body("<precision>0.5</precision><recall>1</recall><f1>0.6667</f1>"))]
    sleeps = []
    judge = make_judge({"base_url": stub_server["url"], "model": "judge-m", "concurrency": 1,
                        "backoff_base_s": 1.0, "max_retries": 4}, sleep=sleeps.append, rand=lambda: 0.5)
    out = judge([("human says A", "model says A")])
    assert out == [{"precision": 0.5, "recall": 1.0, "f1": 0.6667, "why": "", "attempts": 3}]
    assert sleeps == [0.75, 1.5]  # (1/2 + 0.5/2)*1, (1/2 + 0.5/2)*2
    assert len(stub_server["requests"]) == 3
    msg = stub_server["requests"][0]["body"]["messages"][0]["content"]
    assert stub_server["requests"][0]["body"]["model"] == "judge-m"
    assert "[Reference critique]\nhuman says A" in msg and "[Candidate critique]\nmodel says A" in msg


def test_parse_failures_are_retried_then_none(stub_server):
    stub_server["plan"] = [(200, {}, chat_body("<f1>1e-1</f1>"))] * 3
    sleeps = []
    judge = make_judge({"base_url": stub_server["url"], "model": "m", "max_retries": 2}, sleep=sleeps.append,
                       rand=lambda: 0.0)
    out = judge([("h", "c")])
    assert out[0]["f1"] is None and out[0]["attempts"] == 3
    assert out[0]["why"] == "parse failure: missing <precision> tag"
    assert sleeps == [0.5, 1.0] and len(stub_server["requests"]) == 3


def test_html_answer_and_404_are_counted_failures(stub_server):
    stub_server["plan"] = [(200, {"Content-Type": "text/html"}, "<html><body>login</body></html>")] * 2
    judge = make_judge({"base_url": stub_server["url"], "model": "m", "max_retries": 1}, sleep=lambda s: None)
    out = judge([("h", "c")])
    assert out[0]["f1"] is None and out[0]["attempts"] == 2 and "HTML" in out[0]["why"]
    stub_server["plan"] = [(404, {"Content-Type": "text/html"}, "<html>not found</html>")]
    out = judge([("h", "c")])
    assert out[0] == {"precision": None, "recall": None, "f1": None, "why": "HTTP 404", "attempts": 1}  # no retry


def test_refused_connection_is_a_counted_failure():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    sleeps = []
    judge = make_judge({"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "max_retries": 2},
                       sleep=sleeps.append, rand=lambda: 1.0)
    out = judge([("h", "c"), ("h2", "c2")])
    assert [o["f1"] for o in out] == [None, None]
    assert all(o["why"].startswith("connection error") and o["attempts"] == 3 for o in out)
    assert sorted(sleeps) == [1.0, 1.0, 2.0, 2.0]


def test_make_judge_startup_errors(monkeypatch):
    monkeypatch.delenv("NLHF_TEST_KEY", raising=False)
    with pytest.raises(SystemExit, match="judge.api_key_env: environment variable NLHF_TEST_KEY is not set"):
        make_judge({"model": "gpt", "base_url": "https://api.example.com/v1", "api_key_env": "NLHF_TEST_KEY"})
    with pytest.raises(SystemExit, match="judge.model: required"):
        make_judge({"base_url": "http://127.0.0.1:1/v1"})
    with pytest.raises(SystemExit, match=r"judge: unknown key\(s\) \['modle'\]"):
        make_judge({"modle": "x"})
    with pytest.raises(SystemExit, match="judge.backend: 'vllm' unknown"):
        make_judge({"backend": "vllm", "model": "x"})
    monkeypatch.setenv("NLHF_TEST_KEY", "sk-very-secret")
    judge = make_judge({"model": "gpt", "api_key_env": "NLHF_TEST_KEY"})
    assert "sk-very-secret" not in repr(judge)  # the key lives only inside the client


@pytest.mark.slow
@pytest.mark.server
def test_judge_against_transformers_serve(smollm2_path, tmp_path):
    from conftest import start_transformers_serve, stop_server
    proc, base_url = start_transformers_serve(smollm2_path, tmp_path / "serve.log")
    try:
        # a 2-core CPU makes ~2-3 tokens/s here: one short answer, one retry, bounded by timeout_s
        judge = make_judge({"base_url": base_url, "model": smollm2_path,
                                   "max_retries": 1, "timeout_s": 30, "max_tokens": 12, "concurrency": 2,
                                   "backoff_base_s": 0.1})
        item = {"winner": "A", "critique": "Response B adds 2 and 3 wrongly; Response A is right."}
        parsed = [reward.parse_grm_output("<critics>Response B miscounts 2+3.</critics><choice>[[A]]</choice>"),
                  reward.parse_grm_output("<critics>Response A is wrong.</critics><choice>[[B]]</choice>")]
        t0 = time.time()
        samples = reward.score_dh(parsed, [item] * 2, judge)
        assert time.time() - t0 < 2 * 30 + 5
        assert samples[1]["reward"] == 0.0 and not samples[1]["judged"]  # wrong verdict: no judge call
        samples = samples[:1]
        for smp in samples:  # a 135M judge rarely follows the tag format: a score or a counted failure
            assert smp["judged"] and smp["judge_attempts"] >= 1
            assert (smp["f1"] is not None and 0 <= smp["f1"] <= 1 and smp["reward"] in (1.0, 1.5)) or \
                   (smp["f1"] is None and smp["reward"] is None and smp["judge_why"])
        m = reward.nlhf_metrics(samples)
        assert m["judge/calls"] == 1 and 0.0 <= m["judge/fail_rate"] <= 1.0
    finally:
        stop_server(proc)


def test_parquet_goes_through_datasets_like_the_hub(tmp_path):
    """Hub ids and non-JSON files are read with datasets.load_dataset; same items as from JSONL."""
    import datasets
    rows = [hs3(-2), hs3(0), hs3(1)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "hs3.parquet"))
    from_parquet = load_pairwise(str(tmp_path / "hs3.parquet"))
    from_jsonl = load_pairwise(write_jsonl(tmp_path / "hs3.jsonl", rows))
    assert [(it["id"], it["winner"], it["critique"]) for it in from_parquet] == \
           [(it["id"], it["winner"], it["critique"]) for it in from_jsonl]


def test_meta_judge_over_http(stub_server):
    """judge.variant meta_judge through a real HTTP round trip: the request carries the pair and the
    GRM critique (not the human one), the 0/1 answer becomes S, and the reward follows Eq. 4-5."""
    stub_server["plan"] = [(200, {}, chat_body("Correct. <correct>1</correct>"))]
    judge = make_judge({"base_url": stub_server["url"], "model": "m", "variant": "meta_judge", "max_retries": 0})
    item = {"winner": "A", "critique": "HUMAN CRITIQUE", "context": "What is 2+3?", "response_a": "5",
            "response_b": "6"}
    out = [reward.parse_grm_output("<critics>Response B is wrong: 2+3 is 5.</critics><choice>[[A]]</choice>")]
    s = reward.score_dh(out, [item], judge, lam=0.5)[0]
    assert s["f1"] == 1.0 and s["reward"] == 1.5 and s["judged"]
    sent = stub_server["requests"][0]["body"]["messages"][0]["content"]
    assert "Response B is wrong: 2+3 is 5." in sent and "What is 2+3?" in sent and "HUMAN CRITIQUE" not in sent


def test_judge_failure_masks_by_default_and_scores_zero_as_the_release_does():
    """judge.on_failure (score_dh's on_failure): a right verdict whose judge call fails is masked
    (reward None, ours) or gets S = 0, so R = 1 + λ·0 = 1 (the release); either way it counts as a
    failed call. The judge callable is the same for both: the rule is the reward's, not the judge's."""
    item = {"winner": "A", "critique": "A is right."}
    parsed = [reward.parse_grm_output("<critics>A is right.</critics><choice>[[A]]</choice>")]
    dead = make_judge({"base_url": "http://127.0.0.1:1/v1", "model": "m", "max_retries": 0})
    for policy, want in (("mask", None), ("zero", 1.0)):
        s = reward.score_dh(parsed, [item], dead, lam=0.5, on_failure=policy)
        assert s[0]["reward"] == want and s[0]["judge_failed"] and s[0]["judged"]
        m = reward.nlhf_metrics(s)
        assert m["judge/fail_rate"] == 1.0 and "judge/f1_mean" not in m
    with pytest.raises(SystemExit, match="judge.on_failure: 'retry' unknown"):
        make_judge({"backend": "proxy", "on_failure": "retry"})


def released_row(winner="A", critique=True, **over):
    info = {"context": [{"role": "user", "content": "Capital of France?"}], "response_A": "Paris.",
            "response_B": "Lyon.", "winner": winner, "dataset_type": "DataWithHumanCritique" if critique else "other"}
    if critique:
        info["processed_critique"] = {"strengths_A": "Response A names the right city.", "weaknesses_A": "",
                                      "strengths_B": ["Short."], "weaknesses_B": "Response B is wrong, unlike Response A."}
    info.update(over)
    return {"prompt": [{"role": "user", "content": "..."}], "data_source": "helpsteer3", "extra_info": info}


def test_released_schema_keeps_critiques_per_response_through_the_shuffle(tmp_path):
    """schema rm_nlhf: extra_info holds the pair, the winner and strengths/weaknesses of A and of B;
    after the A/B shuffle the parts AND the letters inside them follow their responses."""
    rows = [released_row(id=f"r{k}") for k in range(12)] + [released_row(critique=False, id="plain")]
    path = write_jsonl(tmp_path / "rel.jsonl", rows[:-1] + [dict(rows[-1], extra_info=json.dumps(rows[-1]["extra_info"]))])
    stats = {}
    items = load_pairwise(path, seed=0, stats=stats)
    assert stats["schema"] == ["rm_nlhf"] and len(items) == 13
    swapped = [it for it in items[:12] if it["meta"]["swapped"]]
    kept = [it for it in items[:12] if not it["meta"]["swapped"]]
    assert swapped and kept  # 12 coins at seed 0 land both ways
    for it in kept:
        assert it["winner"] == "A" and it["response_a"] == "Paris."
        assert it["critique"] == ("Response A strengths: Response A names the right city.\n"
                                  "Response A weaknesses: none noted\n"
                                  "Response B strengths: Short.\n"
                                  "Response B weaknesses: Response B is wrong, unlike Response A.")
    for it in swapped:
        assert it["winner"] == "B" and it["response_b"] == "Paris."
        assert it["critique"] == ("Response A strengths: Short.\n"
                                  "Response A weaknesses: Response A is wrong, unlike Response B.\n"
                                  "Response B strengths: Response B names the right city.\n"
                                  "Response B weaknesses: none noted")
    assert items[0]["meta"]["turns"] == [{"role": "user", "content": "Capital of France?"}]
    assert items[0]["context"] == "User: Capital of France?"
    assert items[-1]["critique"] is None  # a row without human feedback: D_O
    bad = write_jsonl(tmp_path / "bad.jsonl", [released_row(winner="C")])
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: field 'extra_info.winner' must be 'A' or 'B', got 'C'"):
        load_pairwise(bad)
    bad = write_jsonl(tmp_path / "bad2.jsonl", [{"extra_info": "{not json"}])
    with pytest.raises(SystemExit, match=r"bad2.jsonl:1: field 'extra_info' is not valid JSON"):
        load_pairwise(bad)


def test_reward_bench_2_rows_become_grouped_pairs(tmp_path):
    """schema reward_bench_2: one pair per rejected response (chosen wins), grouped by the row for
    the best-of-4 rule; Ties rows (several right answers) are dropped and counted."""
    rows = [{"id": 7, "prompt": "P", "chosen": ["good"], "rejected": ["b1", "b2", "b3"], "num_correct": 1,
             "subset": "Math"},
            {"id": 8, "prompt": "T", "chosen": ["t1", "t2"], "rejected": ["t3"], "num_correct": 2, "subset": "Ties"}]
    stats = {}
    items = load_pairwise(write_jsonl(tmp_path / "rb2.jsonl", rows), shuffle=False, stats=stats)
    assert stats == {"rows": 2, "items": 3, "dropped": 1, "schema": ["reward_bench_2"]}
    assert [(it["id"], it["response_a"], it["response_b"], it["winner"]) for it in items] == \
        [("7:0", "good", "b1", "A"), ("7:1", "good", "b2", "A"), ("7:2", "good", "b3", "A")]
    assert {it["meta"]["group"] for it in items} == {"7"} and items[0]["meta"]["subset"] == "Math"
