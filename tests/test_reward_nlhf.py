"""RM-NLHF pieces of reward.py (docs/method.md §5.1-5.3): pairwise loaders, GRM parsing, the reward table,
the critique judge (tag parsing, retries against a real local HTTP server, failures) and the
offline proxy. Every expected number below is computed by hand in the comment next to it."""
import http.server
import json
import socket
import threading
import time

import pytest

from conftest import data_path, make_judge
import reward
from plumbing.data import load_pairwise, structured_critique
from plumbing.services import backoff_delay, proxy_f1


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


# ---- pairwise data ---------------------------------------------------------------------------

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


# ---- GRM prompt and parsing --------------------------------------------------------------------

def test_grm_prompt_contains_everything():
    p = reward.build_grm_prompt("Q?", "ans A", "ans B")
    assert "Q?" in p and "[Response A]\nans A" in p and "[Response B]\nans B" in p
    assert "<critics>" in p and "<choice>[[A]]</choice>" in p and "at most 4 lines" in p


def test_parse_last_block_wins():
    t = "<critics>draft</critics><choice>[[B]]</choice> on second thought <critics>A is right.</critics><choice>[[A]]</choice>"
    assert reward.parse_grm_output(t) == {"critique": "A is right.", "choice": "A", "valid": True, "why": ""}


def test_parse_fallback_first_bracket():
    t = "<critics>B misses the unit.</critics> Verdict: [[A]] not [[B]]"
    assert reward.parse_grm_output(t) == {"critique": "B misses the unit.", "choice": "A", "valid": True, "why": ""}
    # a <choice> without a letter also falls back
    assert reward.parse_grm_output("<critics>x</critics><choice>A</choice> [[B]]")["choice"] == "B"


def test_parse_invalid_cases():
    four = "<critics>1\n2\n\n3\n4</critics><choice>[[A]]</choice>"  # blank lines are not counted
    assert reward.parse_grm_output(four)["valid"]
    five = "<critics>1\n2\n3\n4\n5</critics><choice>[[A]]</choice>"
    assert reward.parse_grm_output(five) == {"critique": "1\n2\n3\n4\n5", "choice": "A", "valid": False, "why": "too_many_lines"}
    ok = reward.parse_grm_output("<critics>" + "x" * 1500 + "</critics><choice>[[B]]</choice>")
    assert ok["valid"]
    long = reward.parse_grm_output("<critics>" + "x" * 1501 + "</critics><choice>[[B]]</choice>")
    assert (long["valid"], long["why"]) == (False, "too_long")
    assert reward.parse_grm_output("<critics>fine</critics> no verdict") == {"critique": "fine", "choice": None, "valid": False, "why": "no_choice"}
    assert reward.parse_grm_output("<choice>[[A]]</choice>")["why"] == "no_critique"
    assert reward.parse_grm_output("<critics>  </critics><choice>[[A]]</choice>")["why"] == "no_critique"
    assert reward.parse_grm_output("<critics>unclosed <choice>[[A]]</choice>")["why"] == "no_critique"
    assert reward.parse_grm_output("")["valid"] is False
    # limits are arguments (config values)
    assert reward.parse_grm_output(five, max_lines=5)["valid"]


# ---- reward table (RM-NLHF Eq. 4, 5, 8) --------------------------------------------------------

@pytest.mark.parametrize("valid,correct,f1,expected", [
    (False, False, None, (-1.0, None)),     # invalid format
    (False, True, 0.9, (-1.0, None)),       # invalid beats everything
    (True, False, None, (0.0, None)),       # wrong choice, judge not called
    (True, True, 0.49, (1.0, 0.0)),         # 0.49 < 0.5 -> R_process 0 -> 1 + 0.5*0
    (True, True, 0.5, (1.0, 0.0)),          # Eq. 4 is strict: S = 0.5 is not > 0.5 -> 1 + 0.5*0
    (True, True, 0.51, (1.5, 1.0)),         # 1 + 0.5*1
    (True, True, 0.8, (1.5, 1.0)),
    (True, True, None, (None, None)),       # judge failure -> masked sample
])
def test_dh_reward_table(valid, correct, f1, expected):
    assert reward.dh_reward(valid, correct, f1, lam=0.5, threshold=0.5) == expected


def test_threshold_rule_strict_by_default_inclusive_as_option():
    """S exactly at the threshold: 0 under Eq. 4's strict rule, 1 under the released code's >=."""
    assert reward.process_reward(0.5) == 0.0 and reward.process_reward(0.5, inclusive=True) == 1.0
    assert reward.process_reward(0.4, inclusive=True) == 0.0 and reward.process_reward(0.6) == 1.0
    assert reward.process_reward(None, inclusive=True) is None
    assert reward.dh_reward(True, True, 0.5, lam=0.5, inclusive=True) == (1.5, 1.0)
    assert reward.dh_reward(True, True, 0.75, lam=0.5, threshold=0.75) == (1.0, 0.0)
    assert reward.dh_reward(True, True, 0.75, lam=0.5, threshold=0.75, inclusive=True) == (1.5, 1.0)


def test_lambda_zero_is_outcome_only_and_never_calls_the_judge():
    """λ = 0 ("w/o process reward", RM-NLHF Table 3): R = -1 | 0 | 1 and the judge is not asked, so
    a failing judge masks nothing (an unreachable server would give f1 None = masked otherwise)."""
    dead = make_judge({"base_url": "http://127.0.0.1:1/v1", "model": "m", "max_retries": 0}, sleep=lambda x: None)
    item = {"winner": "A", "critique": "A is right."}
    outs = ["<critics>A is right.</critics><choice>[[A]]</choice>",
            "<critics>B.</critics><choice>[[B]]</choice>", "no format"]
    s = reward.score_dh([reward.parse_grm_output(o) for o in outs], [item] * 3, dead, lam=0.0,
                        gate_on_outcome=False)
    assert [x["reward"] for x in s] == [1.0, 0.0, -1.0]
    assert not any(x["judged"] for x in s) and all(x["r_process"] is None for x in s)
    assert reward.dh_reward(True, True, None, lam=0.0) == (1.0, None)
    # with λ > 0 the same dead judge is called for the right verdict and masks it
    s = reward.score_dh([reward.parse_grm_output(o) for o in outs], [item] * 3, dead, lam=0.5)
    assert s[0]["judged"] and s[0]["reward"] is None


def test_similarity_choice_drives_the_process_reward():
    """nlhf.similarity picks which judge number is S(h, c) (RM-NLHF §2.3): the proxy judge on a
    one-point GRM critique against a two-point human one gives precision 1, recall 0.5, F1 2/3,
    so with threshold 0.6 (strict) F1 and precision earn the bonus and recall does not."""
    judge = make_judge({"backend": "proxy"})
    item = {"winner": "A", "critique": "Response B adds 2 and 3 wrongly. Response A cites the source."}
    out = [reward.parse_grm_output("<critics>Response B adds 2 and 3 wrongly.</critics><choice>[[A]]</choice>")]
    rewards = {}
    for sim in ("f1", "precision", "recall"):
        s = reward.score_dh(out, [item], judge, lam=0.5, threshold=0.6, similarity=sim)[0]
        assert (s["precision"], s["recall"]) == (1.0, 0.5) and s["f1"] == pytest.approx(2 / 3)
        rewards[sim] = s["reward"]
    assert rewards == {"f1": 1.5, "precision": 1.5, "recall": 1.0}


def test_do_reward_without_outcome_regularisation():
    """nlhf.gate_on_outcome false on D_O: a wrong verdict gets the predicted process part,
    clip(R̂, 0, λ); a right one is unchanged, 1 + clip(R̂ - 1, 0, λ); invalid stays -1."""
    assert reward.do_reward(True, False, 0.3, lam=0.5) == 0.0                          # gated (default)
    assert reward.do_reward(True, False, 0.3, lam=0.5, gate_on_outcome=False) == 0.3
    assert reward.do_reward(True, False, 0.9, lam=0.5, gate_on_outcome=False) == 0.5   # capped at λ
    assert reward.do_reward(True, False, -0.2, lam=0.5, gate_on_outcome=False) == 0.0
    assert reward.do_reward(True, True, 1.2, lam=0.5, gate_on_outcome=False) == pytest.approx(1.2)
    assert reward.do_reward(False, False, 0.3, lam=0.5, gate_on_outcome=False) == -1.0


def test_dh_reward_without_outcome_gate_and_other_lambda():
    assert reward.dh_reward(True, False, 0.8, gate_on_outcome=False) == (0.5, 1.0)  # 0 + 0.5*1
    assert reward.dh_reward(True, False, 0.2, gate_on_outcome=False) == (0.0, 0.0)
    assert reward.dh_reward(True, True, 0.7, lam=0.25) == (1.25, 1.0)


@pytest.mark.parametrize("r_hat,expected", [
    (0.3, 1.0),    # max(0, 0.3-1) = 0 -> 1 + 0
    (1.0, 1.0),
    (1.2, 1.2),    # 1 + 0.2
    (1.5, 1.5),    # 1 + 0.5 (= lam)
    (2.7, 1.5),    # clipped at lam
    (-4.0, 1.0),
])
def test_do_reward_clip(r_hat, expected):
    assert reward.do_reward(True, True, r_hat, lam=0.5) == pytest.approx(expected, abs=1e-12)


def test_do_reward_other_cases():
    assert reward.do_reward(False, True, 2.0) == -1.0
    assert reward.do_reward(True, False, 1.5) == 0.0
    assert reward.do_reward(True, True, None, mode="none") == 1.0
    assert reward.do_reward(True, False, None, mode="none") == 0.0
    assert reward.do_reward(True, False, 1.3, mode="metarm_only") == pytest.approx(1.3)  # no outcome term
    assert reward.do_reward(True, False, 9.0, mode="metarm_only") == 1.5
    assert reward.do_reward(True, False, -1.0, mode="metarm_only") == 0.0


# ---- judge tag parsing -------------------------------------------------------------------------

def test_parse_judge_output():
    good = "reasoning...\n<precision>0.5</precision>\n<recall>1</recall>\n<f1>.6667</f1>"
    assert reward.parse_judge_output(good) == {"precision": 0.5, "recall": 1.0, "f1": 0.6667, "why": ""}
    # last tag wins (the prompt's own example tags may be echoed first)
    assert reward.parse_judge_output("<f1>0.1</f1>" + good)["f1"] == 0.6667
    assert reward.parse_judge_output("<precision>0.5</precision><recall>1</recall>")["why"] == "missing <f1> tag"
    r = reward.parse_judge_output("<precision>0.5</precision><recall>1</recall><f1>1.2</f1>")
    assert (r["f1"], r["why"]) == (None, "<f1> outside [0, 1]: 1.2")
    # scientific notation is rejected on purpose (documented at _DECIMAL)
    r = reward.parse_judge_output("<precision>1e-1</precision><recall>1</recall><f1>0.2</f1>")
    assert (r["f1"], r["why"]) == (None, "<precision> is not a plain decimal: '1e-1'")
    for junk in ("<precision>high</precision><recall>1</recall><f1>1</f1>",
                 "<precision>nan</precision><recall>1</recall><f1>1</f1>",
                 "<precision>-0.1</precision><recall>1</recall><f1>1</f1>",
                 "<precision>2/3</precision><recall>1</recall><f1>1</f1>",
                 "garbage", "", None):
        assert reward.parse_judge_output(junk)["f1"] is None


def test_backoff_delay_numbers():
    # d = min(cap, base*2^k); delay = d/2 + u*d/2
    assert backoff_delay(0, 1.0, 30.0, 0.5) == 0.75
    assert backoff_delay(1, 1.0, 30.0, 0.5) == 1.5
    assert backoff_delay(3, 1.0, 30.0, 0.0) == 4.0
    assert backoff_delay(10, 1.0, 30.0, 1.0) == 30.0


# ---- judge over HTTP: a real tiny server on 127.0.0.1 ------------------------------------------

def completion_body(content):
    return json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": content}}]})


@pytest.fixture
def fake_server():
    """A ThreadingHTTPServer answering POSTs from a plan of (status, content type, body)."""
    state = {"plan": [], "calls": 0, "bodies": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            state["bodies"].append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
            state["calls"] += 1
            code, ctype, body = state["plan"].pop(0) if state["plan"] else (500, "text/plain", "empty plan")
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{srv.server_port}/v1"
    yield state
    srv.shutdown()
    srv.server_close()


def test_retry_429_429_200(fake_server):
    rate = (429, "application/json", '{"error": {"message": "slow down"}}')
    fake_server["plan"] = [rate, rate, (200, "application/json",
                                        completion_body("<precision>0.5</precision><recall>1</recall><f1>0.6667</f1>"))]
    sleeps = []
    judge = make_judge({"base_url": fake_server["url"], "model": "judge-m", "concurrency": 1,
                        "backoff_base_s": 1.0, "max_retries": 4}, sleep=sleeps.append, rand=lambda: 0.5)
    out = reward.judge_scores(judge, [("human says A", "model says A")])
    assert out == [{"precision": 0.5, "recall": 1.0, "f1": 0.6667, "why": "", "attempts": 3}]
    assert sleeps == [0.75, 1.5]  # (1/2 + 0.5/2)*1, (1/2 + 0.5/2)*2
    assert fake_server["calls"] == 3
    msg = fake_server["bodies"][0]["messages"][0]["content"]
    assert fake_server["bodies"][0]["model"] == "judge-m"
    assert "[Reference critique]\nhuman says A" in msg and "[Candidate critique]\nmodel says A" in msg


def test_parse_failures_are_retried_then_none(fake_server):
    fake_server["plan"] = [(200, "application/json", completion_body("<f1>1e-1</f1>"))] * 3
    sleeps = []
    judge = make_judge({"base_url": fake_server["url"], "model": "m", "max_retries": 2}, sleep=sleeps.append,
                       rand=lambda: 0.0)
    out = reward.judge_scores(judge, [("h", "c")])
    assert out[0]["f1"] is None and out[0]["attempts"] == 3
    assert out[0]["why"] == "parse failure: missing <precision> tag"
    assert sleeps == [0.5, 1.0] and fake_server["calls"] == 3


def test_html_answer_and_404_are_counted_failures(fake_server):
    fake_server["plan"] = [(200, "text/html", "<html><body>login</body></html>")] * 2
    judge = make_judge({"base_url": fake_server["url"], "model": "m", "max_retries": 1}, sleep=lambda s: None)
    out = reward.judge_scores(judge, [("h", "c")])
    assert out[0]["f1"] is None and out[0]["attempts"] == 2 and "HTML" in out[0]["why"]
    fake_server["plan"] = [(404, "text/html", "<html>not found</html>")]
    out = reward.judge_scores(judge, [("h", "c")])
    assert out[0] == {"precision": None, "recall": None, "f1": None, "why": "HTTP 404", "attempts": 1}  # no retry


def test_refused_connection_is_a_counted_failure():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    sleeps = []
    judge = make_judge({"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "max_retries": 2},
                       sleep=sleeps.append, rand=lambda: 1.0)
    out = reward.judge_scores(judge, [("h", "c"), ("h2", "c2")])
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


def test_score_dh_calls_judge_only_for_valid_right(fake_server):
    ok = (200, "application/json", completion_body("<precision>1</precision><recall>0.5</recall><f1>0.6667</f1>"))
    fake_server["plan"] = [ok]
    judge = make_judge({"base_url": fake_server["url"], "model": "m", "max_retries": 0, "concurrency": 1})
    item = {"winner": "A", "critique": "Response B is wrong."}
    outs = ["<critics>B errs.</critics><choice>[[A]]</choice>",   # right -> judged, 0.6667 > 0.5 -> 1.5
            "<critics>A errs.</critics><choice>[[B]]</choice>",   # wrong -> 0, no call
            "[[A]] without critique",                             # invalid -> -1, no call
            "<critics>B errs.</critics><choice>[[A]]</choice>"]   # right, but the plan is empty -> 500 -> None
    s = reward.score_dh([reward.parse_grm_output(o) for o in outs], [item] * 4, judge)
    assert [x["reward"] for x in s] == [1.5, 0.0, -1.0, None]
    assert [x["judged"] for x in s] == [True, False, False, True]
    assert fake_server["calls"] == 2
    assert s[3]["judge_why"] == "HTTP 500" and s[0]["r_process"] == 1.0
    m = reward.nlhf_metrics(s)
    # 1 of 4 invalid; right verdicts: samples 0 and 3 -> 2/4; judged 2, failed 1
    assert m == {"nlhf/format_error_rate": 0.25, "nlhf/outcome_acc": 0.5, "judge/calls": 2, "judge/fail_rate": 0.5,
                 "nlhf/process_rate": 1.0, "judge/f1_mean": 0.6667}


def test_score_do_uses_metarm_prediction():
    parsed = [reward.parse_grm_output(t) for t in ("<critics>x</critics><choice>[[B]]</choice>",
                                                   "<critics>x</critics><choice>[[A]]</choice>", "nothing")]
    s = reward.score_do(parsed, [{"winner": "B"}] * 3, [1.3, 1.9, None], lam=0.5)
    assert [x["reward"] for x in s] == [pytest.approx(1.3), 0.0, -1.0]


# ---- offline proxy ------------------------------------------------------------------------------

def test_proxy_f1_hand_numbers():
    human = "Response A gives the wrong total of 12 apples. Response B is polite but vague."
    model = "Response A computes the wrong total of apples. Response B is too long."
    # human points {resp_a, gives, wrong, total, 12, apples}, {resp_b, polite, vague}
    # model points {resp_a, computes, wrong, total, apples}, {resp_b, long}
    # Dice: 2*4/(6+5) = 0.727 (match), 2*1/(3+2) = 0.4 (match at 0.4), cross pairs share nothing
    r = proxy_f1(human, model)
    assert (r["precision"], r["recall"], r["f1"], r["why"]) == (1.0, 1.0, 1.0, "proxy")
    r = proxy_f1(human, "Response A computes the wrong total of apples. The tone is fine.")
    # model points {resp_a, computes, wrong, total, apples}, {tone, fine}: M=1, C=2, H=2 -> P=R=F1=0.5
    assert (r["precision"], r["recall"], r["f1"]) == (0.5, 0.5, 0.5)
    rep = proxy_f1(human, "Response A has the wrong total. Response A has the wrong total!")
    assert (rep["f1"], rep["why"]) == (0.0, "proxy: repetition")
    assert proxy_f1("", "anything")["f1"] is None
    assert proxy_f1(human, "")["f1"] == 0.0
    judge = make_judge({"backend": "proxy"})
    assert reward.judge_scores(judge, [(human, model)])[0]["f1"] == 1.0


# ---- integration: a real OpenAI-compatible server (transformers serve + SmolLM2) ---------------

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


def test_score_dh_rejects_items_without_critique():
    judge = make_judge({"backend": "proxy"})
    p = [reward.parse_grm_output("<critics>x</critics><choice>[[A]]</choice>")]
    with pytest.raises(ValueError, match="no human critique"):
        reward.score_dh(p, [{"winner": "A", "critique": None}], judge)
    with pytest.raises(ValueError, match="1 parse results for 2 items"):
        reward.score_dh(p, [{"winner": "A", "critique": "c"}] * 2, judge)


# ---- judge variants (RM-NLHF §2.3, App. E) --------------------------------------------------------

def test_judge_prompts_per_variant():
    """core (the paper's) and all extract arguments from both critiques, repetition check first;
    core keeps only the decisive ones and the fatal-error rule; meta_judge sees the pair and the GRM
    critique, never the human critique."""
    item = {"context": "What is 2+3?", "response_a": "5", "response_b": "6"}
    core = reward.judge_prompt("core", "HUMAN says B is wrong.", "MODEL says B is wrong.", item)
    every = reward.judge_prompt("all", "HUMAN says B is wrong.", "MODEL says B is wrong.", item)
    meta = reward.judge_prompt("meta_judge", "HUMAN says B is wrong.", "MODEL says B is wrong.", item)
    for p in (core, every):
        assert p.index("Repetition check") < p.index("List") and "HUMAN says" in p and "MODEL says" in p
        assert p.rstrip().endswith("<f1>...</f1>")
    assert "CORE arguments" in core and "nitpicks" in core and "fatal error" in core
    assert "ALL arguments" in every and "minor ones included" in every and "fatal error" not in every
    assert "HUMAN says" not in meta and "MODEL says B is wrong." in meta and "What is 2+3?" in meta
    assert "[Response B]\n6" in meta and meta.index("Repetition check") < meta.index("fatal error")
    with pytest.raises(ValueError, match="needs the pair"):
        reward.judge_prompt("meta_judge", "h", "c")
    with pytest.raises(ValueError, match="unknown judge variant"):
        reward.judge_prompt("some", "h", "c")
    with pytest.raises(SystemExit, match=r"judge.variant: 'some' unknown"):
        make_judge({"backend": "proxy", "variant": "some"})


def test_parse_meta_judge_output():
    assert reward.parse_meta_judge_output("ok. <correct>1</correct>")["f1"] == 1.0
    assert reward.parse_meta_judge_output("<correct>1</correct> on second thought <correct> 0 </correct>") == \
        {"precision": 0.0, "recall": 0.0, "f1": 0.0, "why": ""}
    for bad in ("<correct>yes</correct>", "<correct>0.5</correct>", "", None):
        assert reward.parse_meta_judge_output(bad)["f1"] is None


def test_meta_judge_over_http(fake_server):
    """judge.variant meta_judge through a real HTTP round trip: the request carries the pair and the
    GRM critique (not the human one), the 0/1 answer becomes S, and the reward follows Eq. 4-5."""
    fake_server["plan"] = [(200, "application/json", completion_body("Correct. <correct>1</correct>"))]
    judge = make_judge({"base_url": fake_server["url"], "model": "m", "variant": "meta_judge", "max_retries": 0})
    item = {"winner": "A", "critique": "HUMAN CRITIQUE", "context": "What is 2+3?", "response_a": "5",
            "response_b": "6"}
    out = [reward.parse_grm_output("<critics>Response B is wrong: 2+3 is 5.</critics><choice>[[A]]</choice>")]
    s = reward.score_dh(out, [item], judge, lam=0.5)[0]
    assert s["f1"] == 1.0 and s["reward"] == 1.5 and s["judged"]
    sent = fake_server["bodies"][0]["messages"][0]["content"]
    assert "Response B is wrong: 2+3 is 5." in sent and "What is 2+3?" in sent and "HUMAN CRITIQUE" not in sent


# ---- the authors' released formats (nlhf.grm_prompt, nlhf.do_reward, judge.on_failure) -------

def test_authors_grm_prompt_renders_turns_like_the_release():
    """style 'authors': their PROMPT_GRM with the conversation as 'role:\\ncontent\\n' per turn."""
    turns = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    p = reward.build_grm_prompt("ignored when turns exist", "ans A", "ans B", style="authors", turns=turns)
    assert "[Client Question]\nuser:\nHi?\nassistant:\nHello.\n\n\n[The Start of Chatbot A's Response]\nans A\n" in p
    assert p.endswith("Note: Use [[A]] if A is better, or [[B]] if B is better.")
    assert "ignored" not in p
    # no turns kept (a plain-text context): the context string as is
    assert "[Client Question]\nQ?\n" in reward.build_grm_prompt("Q?", "a", "b", style="authors")
    with pytest.raises(ValueError, match="style 'theirs' unknown"):
        reward.build_grm_prompt("Q?", "a", "b", style="theirs")
    # grm_prompt_ids reads the item's kept turns (HelpSteer3 / rm_nlhf rows)
    item = {"context": "User: Hi?", "response_a": "x", "response_b": "y", "meta": {"turns": turns}}
    text = reward.grm_prompt_ids(None, item, False, {"max_critique_lines": 4, "grm_prompt": "authors"}, text_only=True)
    assert "user:\nHi?\nassistant:\nHello.\n" in text


def test_authors_parser_differs_from_ours_where_the_release_does():
    """The released parse_llm_evaluation + format check, case by case (docs/method.md §5.2)."""
    P = lambda t, **k: reward.parse_grm_output(t, style="authors", **k)
    # the release's own answer format: the letter anywhere inside the last <choice> block
    assert P("<critics>\nA is right.\n</critics>\n\n<choice>\n[[A]]\n</choice>") == \
        {"critique": "A is right.", "choice": "A", "valid": True, "why": ""}
    assert P("<critics>x</critics><choice>B</choice>")["choice"] == "B"   # ours needs [[B]]
    assert reward.parse_grm_output("<critics>x</critics><choice>B</choice>")["choice"] is None
    # both letters in the block: no choice, and NO fallback to a [[A]] elsewhere (ours falls back)
    t = "<critics>x</critics> [[A]] <choice>A or B</choice>"
    assert P(t)["why"] == "no_choice" and reward.parse_grm_output(t)["choice"] == "A"
    # no <choice> block at all: the first [[ A ]] (spaces allowed) anywhere
    assert P("<critics>x</critics> verdict [[ B ]] then [[A]]")["choice"] == "B"
    # an empty critique block is a valid (empty) critique there; ours calls it no_critique
    assert P("<critics> </critics><choice>A</choice>") == {"critique": "", "choice": "A", "valid": True, "why": ""}
    # lines: the release counts blank lines too (split on '\n'): 3 points + 2 blank lines = 5 > 4
    five = "<critics>1\n\n2\n\n3</critics><choice>A</choice>"
    assert P(five)["why"] == "too_many_lines" and reward.parse_grm_output(five.replace("<choice>A", "<choice>[[A]]"))["valid"]
    assert P("<critics>" + "x" * 1501 + "</critics><choice>A</choice>")["why"] == "too_long"
    nl = {"max_critique_lines": 4, "max_critique_chars": 1500, "grm_prompt": "authors"}
    assert reward.parse_grm_completion("<critics>x</critics><choice>B</choice>", nl)["valid"]


def test_do_reward_released_form_is_unclipped():
    """nlhf.do_reward: released = 1 + λ·max(0, R̂ - 1) (their reward manager, weight 0.5 = λ);
    the paper's Eq. 8 clips the bonus to [0, λ]. R̂ = 2.2, λ = 0.5: released 1 + 0.5·1.2 = 1.6,
    paper 1 + min(1.2, 0.5) = 1.5; R̂ = 1.4: released 1.2, paper 1.4; R̂ = 0.3: both 1.0."""
    f = lambda r_hat, form: reward.do_reward(True, True, r_hat, lam=0.5, form=form)
    assert f(2.2, "released") == pytest.approx(1.6) and f(2.2, "paper") == pytest.approx(1.5)
    assert f(1.4, "released") == pytest.approx(1.2) and f(1.4, "paper") == pytest.approx(1.4)
    assert f(0.3, "released") == 1.0 and f(0.3, "paper") == 1.0
    assert reward.do_reward(True, False, 2.2, lam=0.5, form="released") == 0.0     # wrong verdict: 0
    assert reward.do_reward(False, True, 2.2, lam=0.5, form="released") == -1.0    # invalid: -1
    out = reward.score_do([reward.parse_grm_output("<critics>x</critics><choice>[[A]]</choice>")], [{"winner": "A"}],
                          [2.2], lam=0.5, form="released")
    assert out[0]["reward"] == pytest.approx(1.6)


def test_judge_failure_masks_by_default_and_scores_zero_as_the_release_does():
    """judge.on_failure: a right verdict whose judge call fails is masked (reward None, ours) or
    gets S = 0, so R = 1 + λ·0 = 1 (the release); either way it counts as a failed call."""
    item = {"winner": "A", "critique": "A is right."}
    parsed = [reward.parse_grm_output("<critics>A is right.</critics><choice>[[A]]</choice>")]
    for policy, want in (("mask", None), ("zero", 1.0)):
        dead = make_judge({"base_url": "http://127.0.0.1:1/v1", "model": "m", "max_retries": 0, "on_failure": policy})
        s = reward.score_dh(parsed, [item], dead, lam=0.5)
        assert s[0]["reward"] == want and s[0]["judge_failed"] and s[0]["judged"]
        m = reward.nlhf_metrics(s)
        assert m["judge/fail_rate"] == 1.0 and "judge/f1_mean" not in m
    with pytest.raises(SystemExit, match="judge.on_failure: 'retry' unknown"):
        make_judge({"backend": "proxy", "on_failure": "retry"})


# ---- per-response human critiques and the authors' released data ------------------------------

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
