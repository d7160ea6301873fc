"""RM-NLHF pieces of reward.py (docs/method.md §5.1-5.3): pairwise loaders, GRM parsing, the reward table,
the critique judge (tag parsing, retries against a real local HTTP server, failures) and the
offline proxy. Every expected number below is computed by hand in the comment next to it."""

import pytest

from conftest import chat_body, make_judge
import reward

from plumbing.judge import proxy_f1


# ---- pairwise data ---------------------------------------------------------------------------


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


# ---- judge over HTTP: a real tiny server on 127.0.0.1 ------------------------------------------

def test_score_dh_calls_judge_only_for_valid_right(stub_server):
    ok = (200, {}, chat_body("<precision>1</precision><recall>0.5</recall><f1>0.6667</f1>"))
    stub_server["plan"] = [ok]
    judge = make_judge({"base_url": stub_server["url"], "model": "m", "max_retries": 0, "concurrency": 1})
    item = {"winner": "A", "critique": "Response B is wrong."}
    outs = ["<critics>B errs.</critics><choice>[[A]]</choice>",   # right -> judged, 0.6667 > 0.5 -> 1.5
            "<critics>A errs.</critics><choice>[[B]]</choice>",   # wrong -> 0, no call
            "[[A]] without critique",                             # invalid -> -1, no call
            "<critics>B errs.</critics><choice>[[A]]</choice>"]   # right, but the plan is empty -> 500 -> None
    s = reward.score_dh([reward.parse_grm_output(o) for o in outs], [item] * 4, judge)
    assert [x["reward"] for x in s] == [1.5, 0.0, -1.0, None]
    assert [x["judged"] for x in s] == [True, False, False, True]
    assert len(stub_server["requests"]) == 2
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
    assert judge([(human, model)])[0]["f1"] == 1.0 and judge([]) == []


# ---- integration: a real OpenAI-compatible server (transformers serve + SmolLM2) ---------------


def test_score_dh_rejects_items_without_critique():
    judge = make_judge({"backend": "proxy"})
    p = [reward.parse_grm_output("<critics>x</critics><choice>[[A]]</choice>")]
    with pytest.raises(ValueError, match="no human critique"):
        reward.score_dh(p, [{"winner": "A", "critique": None}], judge)
    with pytest.raises(ValueError, match="1 parse results for 2 items"):
        reward.score_dh(p, [{"winner": "A", "critique": "c"}] * 2, judge)


def test_score_dh_refuses_bad_settings_before_the_judge_and_a_short_judge_answer():
    """A mistyped on_failure (which would have meant "mask") or similarity (a KeyError after the
    paid judge calls) is refused before any call; a judge answering fewer pairs than it was sent
    is refused (zip would have left the rest unjudged, reward None, silently)."""
    calls = []

    def judge(pairs):
        calls.append(len(pairs))
        return [{"f1": 0.75, "precision": 1.0, "recall": 0.6, "why": "", "attempts": 1}]

    item = {"winner": "A", "critique": "B is wrong."}
    parsed = [reward.parse_grm_output("<critics>B errs.</critics><choice>[[A]]</choice>")] * 2
    for bad in (dict(on_failure="zeros"), dict(similarity="F1")):
        with pytest.raises(ValueError, match="on_failure .*similarity"):
            reward.score_dh(parsed, [item] * 2, judge, **bad)
    assert calls == []
    with pytest.raises(ValueError, match="1 judge results for 2 pairs"):
        reward.score_dh(parsed, [item] * 2, judge)
    assert [s["reward"] for s in reward.score_dh(parsed[:1], [item], judge)] == [1.5]


def test_score_dh_takes_a_plain_judge_callable():
    """The judge is any judge(pairs) -> list[dict] (before: a dict, and a plain callable raised
    TypeError). Only the valid right verdicts reach it (2 of 4), in order, with their items; F1
    0.75 > 0.5 -> R = 1 + 0.5 = 1.5; the failed call -> None ("mask") or S = 0 -> R = 1 ("zero")."""
    calls = []

    def judge(pairs):
        calls.append(pairs)
        return [{"f1": 0.75, "precision": 1.0, "recall": 0.6, "why": "", "attempts": 1},
                {"f1": None, "precision": None, "recall": None, "why": "down", "attempts": 3}][:len(pairs)]

    item = {"winner": "A", "critique": "B is wrong."}
    outs = ["<critics>B errs.</critics><choice>[[A]]</choice>", "<critics>A errs.</critics><choice>[[B]]</choice>",
            "no format", "<critics>B fails.</critics><choice>[[A]]</choice>"]
    parsed = [reward.parse_grm_output(o) for o in outs]
    s = reward.score_dh(parsed, [item] * 4, judge, lam=0.5)
    assert [x["reward"] for x in s] == [1.5, 0.0, -1.0, None] and [x["r_process"] for x in s] == [1.0, None, None, None]
    assert calls == [[("B is wrong.", "B errs.", item), ("B is wrong.", "B fails.", item)]]
    z = reward.score_dh(parsed, [item] * 4, judge, lam=0.5, on_failure="zero")
    assert [x["reward"] for x in z] == [1.5, 0.0, -1.0, 1.0] and z[3]["judge_failed"] and z[3]["f1"] == 0.0
    calls.clear()  # nothing needs the judge (a wrong verdict, an invalid one): it is not called at all
    assert [x["reward"] for x in reward.score_dh(parsed[1:3], [item] * 2, judge)] == [0.0, -1.0] and calls == []


def test_judge_pool_keeps_order_and_turns_exceptions_into_failures():
    """plumbing/judge.py judge_pool (make_judge's thread pool): results in the pairs' order at
    any concurrency; a similarity that raises fails that pair only, with the reason."""
    import time
    from plumbing.judge import judge_pool

    def similarity(human, critique, item):
        if critique == "boom":
            raise RuntimeError("bad")
        time.sleep(0.01 * (5 - int(critique)))  # later pairs finish first
        return {"f1": int(critique) / 10, "precision": None, "recall": None, "why": "", "attempts": 1}

    judge = judge_pool(similarity, concurrency=4)
    out = judge([("h", str(k)) for k in range(5)] + [("h", "boom", {"x": 1})])
    assert [o["f1"] for o in out] == [0.0, 0.1, 0.2, 0.3, 0.4, None]
    assert out[5] == {"precision": None, "recall": None, "f1": None, "why": "RuntimeError: bad", "attempts": 0}
    assert judge([]) == []


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
    text = reward.grm_prompt_ids(None, item, False, max_lines=4, style="authors", text_only=True)
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


# ---- per-response human critiques and the authors' released data ------------------------------


@pytest.mark.parametrize("on_failure, reward_", [("mask", None), ("zero", 1.0)])
def test_a_missing_similarity_is_a_judge_failure(on_failure, reward_):
    """similarity: precision with a judge that gives an f1 and no precision (judge_pool's callable
    may): Eq. 4 has no S(h, c), so the sample is a judge failure, flagged as one; before, its
    reward was None (masked) while judge_failed said False. Right verdict, λ = 0.5: "mask" -> None,
    "zero" -> S = 0 -> R = 1 + 0.5 x 0 = 1.0."""
    def judge(pairs):
        return [{"f1": 0.9, "precision": None, "recall": None, "why": "", "attempts": 1}] * len(pairs)

    parsed = [reward.parse_grm_output("<critics>B errs.</critics><choice>[[A]]</choice>")]
    item = {"winner": "A", "critique": "B is wrong."}
    s = reward.score_dh(parsed, [item], judge, lam=0.5, similarity="precision", on_failure=on_failure)[0]
    assert s["reward"] == reward_ and s["judge_failed"] is True and s["judged"] is True
    f = reward.score_dh(parsed, [item], judge, lam=0.5, similarity="f1", on_failure=on_failure)[0]
    assert f["reward"] == 1.5 and f["judge_failed"] is False  # its own number is there: judged
