"""metarm.py (docs/method.md §5.4): inputs and targets, the MSE step, prediction modes, atomic save/load,
cold-start training and the command line (the cold start's batches, files and resume:
tests/plumbing/test_cold_start.py)."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch

import metarm
import reward

from plumbing.metarm_setup import load_metarm
from plumbing import config


NLHF = config.load_config([])["nlhf"]  # config.yaml's nlhf: section


def item(i=0, winner="A"):
    return {"id": f"x{i}", "context": f"What is {i}+{i}?", "response_a": f"{2 * i}", "response_b": f"{2 * i + 1}",
            "winner": winner, "critique": "Response B adds wrongly.", "source": "t", "meta": {}}


@pytest.fixture(scope="module")
def tiny_mrm(tiny_model_path):
    """A MetaRM on the tiny random Llama (new scalar head), module-shared; tests that train copy it."""
    return load_metarm(tiny_model_path, mode="online", batch_size=4, max_length=128)


def fresh(path, **kw):
    return load_metarm(path, **dict({"batch_size": 4, "max_length": 128}, **kw))


def loss_of(mrm, texts, rewards):
    """metarm_loss with the MetaRM dict's model, tokenizer and numbers."""
    return metarm.metarm_loss(mrm["model"], mrm["tokenizer"], texts, rewards, mode=mrm["mode"], lam=mrm["lam"],
                              max_length=mrm["max_length"], dtype=mrm["dtype"])


def predict_texts(mrm, texts):
    return metarm.predict_texts(mrm["model"], mrm["tokenizer"], texts, **metarm.settings(mrm))


def outputs(mrm, texts):
    return metarm.forward(mrm["model"], mrm["tokenizer"], texts, mode=mrm["mode"], max_length=mrm["max_length"])


def examples(mrm, items, samples):
    return metarm.examples_from_samples(mrm["tokenizer"], items, samples, max_length=mrm["max_length"])


def test_text_and_targets():
    t = metarm.metarm_text(" Q ", "a", "b", "Response B errs.")
    assert t == "[Conversation]\nQ\n\n[Response A]\na\n\n[Response B]\nb\n\n[Critique]\nResponse B errs."
    assert [metarm.train_target(r, "online", 0.5) for r in (0.0, 1.0, 1.5)] == [0.0, 1.0, 1.5]
    assert [metarm.train_target(r, "binary", 0.5) for r in (0.0, 1.0, 1.5)] == [0.0, 1.0, 1.5]  # trained as online
    assert [metarm.train_target(r, "binary_retrain", 0.5) for r in (0.0, 1.0, 1.5)] == [0.0, 0.0, 1.0]
    assert [metarm.train_target(r, "classifier", 0.5) for r in (0.0, 1.0, 1.5)] == [0, 1, 2]
    # R = λ (a wrong verdict without the outcome gate) and 1 + λ/2 (a D_O label) are no class value:
    # refused (the nearest class was a silent guess: 0.5 became class 0, 1.25 class 1); regression
    # modes take them as they are
    for mode in ("binary_retrain", "classifier"):
        for r in (0.5, 1.25):
            with pytest.raises(ValueError, match=rf"R = {r} is none of \(0.0, 1.0, 1.5\) \(mode {mode}\)"):
                metarm.train_target(r, mode, 0.5)
    assert [metarm.train_target(r, "online", 0.5) for r in (0.5, 1.25)] == [0.5, 1.25]
    # nearest values of (0.2, 1.3, 1.2, 0.6) in (0, 1, 1.5) are (0, 1.5, 1, 1) vs R (0, 1.5, 1.5, 1): 3 of 4
    assert metarm.agreement([0.2, 1.3, 1.2, 0.6], [0.0, 1.5, 1.5, 1.0], 0.5) == 0.75
    assert metarm.agreement([], [], 0.5) is None


def test_examples_skip_invalid_and_judge_failures(tiny_mrm):
    samples = [{"valid": True, "reward": 1.5, "critique": "c0"}, {"valid": False, "reward": -1.0, "critique": None},
               {"valid": True, "reward": None, "critique": "c2"}, {"valid": True, "reward": 0.0, "critique": "c3"}]
    ex = examples(tiny_mrm, [item(i) for i in range(4)], samples)
    assert [e["r"] for e in ex] == [1.5, 0.0] and [e["truncated"] for e in ex] == [False, False]
    assert ex[1]["text"].endswith("[Critique]\nc3") and "What is 3+3?" in ex[1]["text"]


def test_input_budget_cuts_middles_and_keeps_every_part(tiny_model_path):
    """metarm.max_length too small for the item: the conversation's middle goes first, then the
    responses' middles; both responses' heads and tails and the whole critique stay (Eq. 6
    conditions on all four), and the result fits the budget. Left-truncating the joined text
    would have dropped the conversation and Response A entirely."""
    mrm = fresh(tiny_model_path, max_length=160)
    tok = mrm["tokenizer"]
    conv = "START " + " ".join(f"word{i}" for i in range(300)) + " END"
    a, b, critique = "Alpha answer here.", "Beta answer here.", "Response B is wrong because of X."
    text, cut = metarm.metarm_input(tok, conv, a, b, critique, max_length=160)
    assert cut
    assert len(tok(text)["input_ids"]) <= 160
    assert "[Conversation]\nSTART" in text and "END\n\n[Response A]\nAlpha answer here." in text and " [...] " in text
    assert "[Response B]\nBeta answer here." in text and text.endswith("[Critique]\n" + critique)
    # long responses too: the conversation keeps 32 tokens, then each response gives an equal share
    long_a, long_b = "A0 " + "alpha " * 200 + "A9", "B0 " + "beta " * 200 + "B9"
    text, cut = metarm.metarm_input(tok, conv, long_a, long_b, critique, max_length=160)
    assert cut and len(tok(text)["input_ids"]) <= 160 and text.endswith(critique)
    for head, tail in [("START", "END"), ("A0", "A9"), ("B0", "B9")]:
        assert head in text and tail in text
    assert text.count(" [...] ") == 3
    # short inputs are untouched
    assert metarm.metarm_input(tok, "Q", "a", "b", "c", max_length=160) == (metarm.metarm_text("Q", "a", "b", "c"), False)
    # counted where the MetaRM dict is kept: 2 of 3 D_O inputs cut (predict), 1 of 2 examples (online_update)
    r_hat, n_cut = metarm.predict(mrm["model"], tok, [dict(item(0), context=conv)] * 2 + [item(1)], ["c", "c", "c"],
                                  **metarm.settings(mrm))
    assert n_cut == 2 and len(r_hat) == 3
    samples = [{"valid": True, "reward": 1.0, "critique": "c"}] * 2
    metarm.online_update(mrm, [dict(item(0), context=conv), item(1)], samples, seed=0)
    assert mrm["truncated"] == 1


def test_pad_id_set_and_padding_does_not_change_predictions(tiny_mrm):
    assert tiny_mrm["model"].config.pad_token_id == tiny_mrm["tokenizer"].pad_token_id
    assert tiny_mrm["model"].config.num_labels == 1
    short, long = "short text", "a much longer text " * 10
    alone = predict_texts(tiny_mrm, [short])[0]
    batched = predict_texts(tiny_mrm, [long, short])[1]  # short one padded on the right
    assert batched == pytest.approx(alone, abs=1e-5)


def test_a_left_padding_or_right_cutting_tokenizer_and_an_unknown_mode_are_refused(tiny_mrm):
    """forward reads the last token as the text's end: a tokenizer as from_pretrained leaves it
    (cutting on the right, or padding on the left) would give other numbers silently, so it is
    refused; so is a mode train_target does not know (it used to train it as a regression)."""
    tok = copy.copy(tiny_mrm["tokenizer"])
    for attr, value in (("truncation_side", "right"), ("padding_side", "left")):
        bad = copy.copy(tok)
        setattr(bad, attr, value)
        with pytest.raises(ValueError, match="pad right and cut left"):
            metarm.forward(tiny_mrm["model"], bad, ["a text"], mode="online", max_length=128)
    for mode in ("regression", "none"):
        with pytest.raises(ValueError, match=f"MetaRM mode '{mode}'"):
            metarm.train_target(1.0, mode, 0.5)


def test_mse_is_the_mean_square_and_a_step_lowers_it(tiny_model_path):
    mrm = fresh(tiny_model_path, online_lr=1e-3)
    items = [item(i) for i in range(4)]
    samples = [{"valid": True, "reward": r, "critique": f"critique {i}"} for i, r in enumerate([0.0, 1.0, 1.5, 1.0])]
    ex = examples(mrm, items, samples)
    texts, rs = [e["text"] for e in ex], [e["r"] for e in ex]
    with torch.no_grad():
        preds = outputs(mrm, texts)
        manual = ((preds - torch.tensor(rs)) ** 2).mean()
        before = loss_of(mrm, texts, rs)
    assert before.item() == pytest.approx(manual.item(), rel=1e-6)
    m = metarm.online_update(mrm, items, samples, seed=0)
    with torch.no_grad():
        after = loss_of(mrm, texts, rs)
    assert m["metarm/n"] == 4 and m["metarm/loss"] == pytest.approx(before.item(), rel=1e-5)  # one batch of 4
    assert 0.0 <= m["metarm/agreement"] <= 1.0
    assert after.item() < before.item()
    assert mrm["updates"] == 1 and mrm["optimizer"] is not None


class FixedOutputs(torch.nn.Module):
    """A stand-in sequence classifier whose logits for row i are the parameter row out[i] (whatever the text)."""
    def __init__(self, out):
        super().__init__()
        self.out = torch.nn.Parameter(torch.tensor(out))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.out[:len(input_ids)].reshape(len(input_ids), -1))


def test_metarm_loss_with_plain_numbers_hand_computed(tiny_model_path):
    """metarm_loss (RM-NLHF Eq. 7) takes the model, its tokenizer and numbers, no MetaRM dict. Outputs
    ŷ = (0.5, 1, 2), rewards R = (0, 1, 1.5), λ = 0.5: MSE = (0.25 + 0 + 0.25) / 3 = 1/6, its gradient
    2 (ŷ - R) / 3 = (1/3, 0, 1/3); binary_retrain regresses 1[R > 1] = (0, 0, 1): (0.25 + 1 + 1) / 3 = 0.75;
    classifier, logits (ln 1, ln 1, ln 2) for class 2 (R = 1 + λ): -log(2 / 4) = ln 2."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side, tok.truncation_side = "right", "left"  # as load_metarm sets them (forward checks)
    model, texts = FixedOutputs([[0.5], [1.0], [2.0]]), ["a", "b c", "d"]
    loss = metarm.metarm_loss(model, tok, texts, [0.0, 1.0, 1.5], mode="online", lam=0.5, max_length=16)
    assert loss.item() == pytest.approx(1 / 6, rel=1e-6)
    loss.backward()
    assert model.out.grad.flatten().tolist() == pytest.approx([1 / 3, 0.0, 1 / 3], rel=1e-6)
    assert metarm.metarm_loss(model, tok, texts, [0.0, 1.0, 1.5], mode="binary_retrain", lam=0.5,
                              max_length=16).item() == pytest.approx(0.75, rel=1e-6)
    clf = FixedOutputs([[0.0, 0.0, math.log(2.0)]])
    assert metarm.metarm_loss(clf, tok, ["t"], [1.5], mode="classifier", lam=0.5,
                              max_length=16).item() == pytest.approx(math.log(2.0), rel=1e-6)
    # predict on the same stand-in: R̂ = ŷ for a regressor; classifier Σ p_c value_c = (0 + 1 + 2 · 1.5) / 4 = 1
    r_hat, cut = metarm.predict(model, tok, [item(0), item(1), item(2)], ["c", None, "c"], mode="online", lam=0.5,
                                batch_size=2, max_length=4096)
    assert r_hat == pytest.approx([0.5, None, 1.0]) and cut == 0  # the 2 valid critiques: one batch, rows 0 and 1
    assert metarm.predict(clf, tok, [item(0)], ["c"], mode="classifier", lam=0.5, batch_size=1,
                          max_length=4096)[0] == pytest.approx([1.0], rel=1e-6)


def test_cold_start_training_lowers_loss(tiny_model_path):
    mrm = fresh(tiny_model_path)
    ex = [{"text": f"example {i}", "r": [0.0, 1.0, 1.5][i % 3]} for i in range(6)]
    with torch.no_grad():
        before = loss_of(mrm, [e["text"] for e in ex], [e["r"] for e in ex]).item()
    losses = metarm.train_metarm(mrm, ex, epochs=3, lr=1e-3, warmup_frac=0.01)
    assert len(losses) == 3 * 2  # 6 examples / batch 4 -> 2 steps per epoch
    with torch.no_grad():
        after = loss_of(mrm, [e["text"] for e in ex], [e["r"] for e in ex]).item()
    assert after < before
    assert metarm.train_metarm(mrm, [], epochs=3) == []


def test_offline_mode_does_not_train(tiny_model_path):
    mrm = fresh(tiny_model_path, mode="offline", online_lr=1e-3)
    w = mrm["model"].score.weight.clone()
    m = metarm.online_update(mrm, [item(0)], [{"valid": True, "reward": 1.5, "critique": "c"}], seed=0)
    assert m["metarm/loss"] is None and m["metarm/n"] == 1 and m["metarm/agreement"] in (0.0, 1.0)
    assert torch.equal(w, mrm["model"].score.weight) and mrm["updates"] == 0 and mrm["optimizer"] is None


def test_classifier_and_binary_predictions(tiny_model_path):
    clf = fresh(tiny_model_path, mode="classifier")
    assert clf["model"].config.num_labels == 3
    text = ["some text"]
    with torch.no_grad():
        p = outputs(clf, text).softmax(-1)[0]
    expected = p[1].item() * 1.0 + p[2].item() * 1.5  # Σ p_c value_c over (0, 1, 1.5)
    assert predict_texts(clf, text)[0] == pytest.approx(expected, rel=1e-6)
    loss = loss_of(clf, ["t"], [1.5])  # class 2
    with torch.no_grad():
        logits = outputs(clf, ["t"])[0]
    assert loss.item() == pytest.approx(-torch.log_softmax(logits, -1)[2].item(), rel=1e-5)
    binary = fresh(tiny_model_path, mode="binary")
    for pred in predict_texts(binary, ["x", "y z"]):
        assert pred in (1.0, 1.5)


def test_binary_discretises_the_regression_output(tiny_model_path, monkeypatch):
    """App. H.1 "Binary": the online regression MetaRM's output discretised to a process bit,
    1[R̂ > 1 + λ/2]: with λ = 0.5 the cut is 1.25, so raw (1.24, 1.26, 0.3, 1.9) -> (1, 1.5, 1, 1.5).
    binary_retrain thresholds a 0/1 regressor at 0.5 instead: raw (0.49, 0.5) -> (1, 1.5)."""
    raw = {"binary": [1.24, 1.26, 0.3, 1.9], "binary_retrain": [0.49, 0.5]}
    for mode, want in [("binary", [1.0, 1.5, 1.0, 1.5]), ("binary_retrain", [1.0, 1.5])]:
        mrm = fresh(tiny_model_path, mode=mode, lam=0.5)
        monkeypatch.setattr(metarm, "forward", lambda m, tok, texts, mode, **kw: torch.tensor(raw[mode][:len(texts)]))
        assert predict_texts(mrm, ["t"] * len(want)) == want
    # the D_O reward of a right verdict is then 1 or 1 + λ (RM-NLHF Eq. 8)
    assert [reward.do_reward(True, True, r, lam=0.5, mode="binary") for r in (1.0, 1.5)] == [1.0, 1.5]


def test_predict_skips_invalid_samples(tiny_mrm):
    m, tok, kw = tiny_mrm["model"], tiny_mrm["tokenizer"], metarm.settings(tiny_mrm)
    preds, cut = metarm.predict(m, tok, [item(0), item(1)], [None, "Response A is right."], **kw)
    assert preds[0] is None and isinstance(preds[1], float) and cut == 0
    assert metarm.predict(m, tok, [item(0)], [None], **kw) == ([None], 0)


def test_online_epochs_are_passes_with_one_persistent_optimizer(tiny_model_path):
    """metarm.online_epochs = 2 (the paper's "Aggressive" ablation, App. H.1) is exactly two
    one-pass updates in a row (pass k shuffled by seed + k, the same AdamW), counted as ONE
    update of the step; the reported loss is the mean over both passes."""
    items = [item(0), item(1), item(2)]
    samples = [{"valid": True, "reward": r, "critique": f"critique {k}"} for k, r in enumerate([1.5, 0.0, 1.0])]
    torch.manual_seed(0)  # the same fresh regression head for both
    two = fresh(tiny_model_path, online_epochs=2, batch_size=2, online_lr=1e-3)
    torch.manual_seed(0)
    one = fresh(tiny_model_path, batch_size=2, online_lr=1e-3)
    fresh_params = [p.detach().clone() for p in two["model"].parameters()]
    m2 = metarm.online_update(two, items, samples, seed=3)
    a = metarm.online_update(one, items, samples, seed=3)
    b = metarm.online_update(one, items, samples, seed=4)
    assert two["updates"] == 1 and one["updates"] == 2
    moved = False
    for p, q, r in zip(two["model"].parameters(), one["model"].parameters(), fresh_params):
        torch.testing.assert_close(p, q)
        moved |= not torch.equal(p, r)
    assert moved
    assert m2["metarm/loss"] == pytest.approx((a["metarm/loss"] + b["metarm/loss"]) / 2, rel=1e-5)


def test_agreement_decodes_each_modes_own_target():
    """metarm/agreement = mean 1[decode(o) = train_target(R)] (metarm.agreement), by hand, λ = 0.5:
    binary: raw regression outputs (0.4, 1.2, 1.3, 0.6) -> nearest of (0, 1, 1.5) = (0, 1, 1.5, 1)
    vs R (0, 1, 1.5, 0): 3 of 4; binary_retrain: (0.49, 0.5, 0.7) -> 1[o >= 0.5] = (0, 1, 1) vs
    1[R > 1] for R (1.5, 1.5, 1) = (1, 1, 0): 1 of 3; classifier: argmax of logits (2, 1, 0), (0, 1, 3)
    = (0, 2) vs classes of R (0, 1) = (0, 1): 1 of 2; ungated: 0.45 -> λ = 0.5 (nearest of 0, 0.5, 1, 1.5)."""
    assert metarm.agreement([0.4, 1.2, 1.3, 0.6], [0.0, 1.0, 1.5, 0.0], 0.5, mode="binary") == 0.75
    assert metarm.agreement([0.49, 0.5, 0.7], [1.5, 1.5, 1.0], 0.5, mode="binary_retrain") == pytest.approx(1 / 3)
    assert metarm.agreement([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]], [0.0, 1.0], 0.5, mode="classifier") == 0.5
    assert metarm.agreement([0.45, 0.2], [0.5, 0.0], 0.5, gated=False) == 1.0
    assert metarm.agreement([0.45], [0.5], 0.5) == 0.0  # gated grid (0, 1, 1.5): 0.45 -> 0


@pytest.mark.parametrize("mode,raw", [
    ("online", [0.0, 1.0, 1.5]), ("offline", [0.0, 1.0, 1.5]), ("metarm_only", [0.0, 1.0, 1.5]),
    ("binary", [0.0, 1.0, 1.5]),  # the regressor binary discretises, perfect: was 2/3 (R = 0 -> R̂ = 1)
    ("binary_retrain", [0.0, 0.0, 1.0]),  # a perfect 0/1 regressor of 1[R > 1]: was 2/3
    ("classifier", [[30.0, 0.0, 0.0], [0.0, 30.0, 0.0], [0.0, 0.0, 30.0]])])
def test_a_perfect_metarm_agrees_fully_in_every_mode(tiny_model_path, monkeypatch, mode, raw):
    """D_H rewards R = (0, 1, 1.5) and the mode's perfect raw outputs: metarm/agreement is 1."""
    mrm = fresh(tiny_model_path, mode=mode, lam=0.5, online_lr=0.0)
    monkeypatch.setattr(metarm, "forward", lambda m, tok, texts, **kw: torch.tensor(raw[:len(texts)], requires_grad=True))
    samples = [{"valid": True, "reward": r, "critique": f"c{i}"} for i, r in enumerate([0.0, 1.0, 1.5])]
    assert metarm.online_update(mrm, [item(i) for i in range(3)], samples, seed=0)["metarm/agreement"] == 1.0


def test_agreement_with_train_on_do_and_without_the_gate(tiny_model_path, monkeypatch):
    """train_on_do: D_O labels (right 1 + λ/2 = 1.25, wrong 0) train the MetaRM but are not the
    judge's, so agreement counts the D_H samples only: a predictor perfect on all four targets
    (0, 1.5 | 1.25, 0) scores 1 (it was 3/4: 1.25 rounded to 1). Ungated (nlhf.gate_on_outcome
    false), a wrong verdict whose critique matched has R = λ = 0.5: its perfect output scores 1."""
    mrm = fresh(tiny_model_path, mode="online", lam=0.5, online_lr=0.0)
    outs = [0.0, 1.5, 1.25, 0.0]
    monkeypatch.setattr(metarm, "forward", lambda m, tok, texts, **kw: torch.tensor(outs[:len(texts)], requires_grad=True))
    dh = [{"valid": True, "reward": 0.0, "critique": "a"}, {"valid": True, "reward": 1.5, "critique": "b"}]
    parsed = [{"valid": True, "choice": "A", "critique": "c"}, {"valid": True, "choice": "B", "critique": "d"}]
    do = reward.do_training_samples(parsed, [item(2, "A"), item(3, "A")], lam=0.5)
    assert [s["reward"] for s in do] == [1.25, 0.0]
    items = [item(0), item(1), item(2), item(3)]
    m = metarm.online_update(mrm, items, dh + do, seed=0)
    assert m["metarm/n"] == 4 and m["metarm/agreement"] == 1.0
    outs[:] = [0.5, 1.0]
    ungated = [{"valid": True, "reward": 0.5, "critique": "a"}, {"valid": True, "reward": 1.0, "critique": "b"}]
    assert metarm.online_update(mrm, items[:2], ungated, seed=0, gated=False)["metarm/agreement"] == 1.0


@pytest.mark.parametrize("overrides,msg", [
    (["metarm.mode=binary", "nlhf.gate_on_outcome=false"],
     "config keys metarm.mode=binary and nlhf.gate_on_outcome=false do not combine: an ungated wrong verdict's "
     "target λ has no process bit there"),
    (["metarm.mode=classifier", "nlhf.gate_on_outcome=false"],
     "config keys metarm.mode=classifier and nlhf.gate_on_outcome=false do not combine: an ungated wrong verdict's "
     "target λ has no class there"),
    (["metarm.mode=binary_retrain", "nlhf.gate_on_outcome=false"],
     "config keys metarm.mode=binary_retrain and nlhf.gate_on_outcome=false do not combine: an ungated wrong "
     "verdict's target λ has no process bit there"),
    (["metarm.mode=classifier", "metarm.train_on_do=true"],
     "config keys metarm.mode=classifier and metarm.train_on_do=true do not combine: the D_O label 1 + λ/2 has no "
     "class there"),
    (["metarm.mode=binary_retrain", "metarm.train_on_do=true"],
     "config keys metarm.mode=binary_retrain and metarm.train_on_do=true do not combine: the D_O label 1 + λ/2 has "
     "no process bit there")])
def test_modes_without_a_class_for_the_target_are_refused(overrides, msg):
    with pytest.raises(SystemExit) as e:
        config.load_config([], ["task=rm_nlhf", *overrides])
    assert str(e.value) == msg
    config.load_config([], ["task=rm_nlhf", "metarm.mode=binary", "metarm.train_on_do=true"])  # binary regresses R: fine
    config.load_config([], ["task=rm_nlhf", "metarm.mode=online", "nlhf.gate_on_outcome=false"])
