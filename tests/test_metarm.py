"""metarm.py: the MetaRM's input, targets, loss and modes (hand-computed numbers), the online
update, the reward step's order (Algorithm 1), save/load, the cold start's batches, files and
resume, and the command line. The tiny random Llama of conftest.py is the regressor."""
import copy
import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch

import metarm
import reward

H = "Response B adds 2 and 3 wrongly. Response A is right."

def item(i=0, winner="A", critique=H):
    return {"id": f"p{i}", "context": f"What is {i}+3?", "response_a": f"{i + 3}",
            "response_b": f"{i + 4}", "winner": winner, "critique": critique, "source": "t",
            "meta": {}}

def verdict(critique, choice):
    return f"<critics>{critique}</critics>\n<choice>[[{choice}]]</choice>"

def fresh(path, **kw):
    return metarm.new_metarm(path, **dict({"mode": "online", "lam": 0.5, "batch_size": 4,
                                           "max_length": 128}, **kw))

@pytest.fixture(scope="module")
def tiny_mrm(tiny_model_path):
    """A MetaRM on the tiny random Llama (new scalar head), module-shared; tests that train copy."""
    return fresh(tiny_model_path)


loss_of, outputs = metarm.metarm_loss, metarm.forward

def input_text(mrm, text):
    """The MetaRM input of an item whose conversation is `text` (critique "c")."""
    return metarm.metarm_input(mrm["tokenizer"], dict(item(0), context=text), "c",
                               max_length=mrm["max_length"])[0]

def predict_texts(mrm, texts):
    """metarm.predict's R̂ for items whose conversations are `texts` (critique "c")."""
    return metarm.predict(mrm, [dict(item(0), context=t) for t in texts], ["c"] * len(texts))[0]

def examples(mrm, items, samples):
    return metarm.examples_from_samples(mrm, items, samples)

def flat(mrm):
    return torch.cat([p.detach().flatten() for p in mrm["model"].parameters()])

# ---- input, targets, loss, modes (hand-computed) ----------------------------------------------

def test_text_and_targets():
    t = metarm.metarm_text(" Q ", "a", "b", "Response B errs.")
    assert t == ("[Conversation]\nQ\n\n[Response A]\na\n\n[Response B]\nb\n\n[Critique]\n"
                 "Response B errs.")
    assert [metarm.train_target(r, "online", 0.5) for r in (0.0, 1.0, 1.5)] == [0.0, 1.0, 1.5]
    assert [metarm.train_target(r, "binary", 0.5) for r in (0.0, 1.0, 1.5)] == [0.0, 1.0, 1.5]
    assert [metarm.train_target(r, "binary_retrain", 0.5) for r in (0.0, 1.0, 1.5)] == [0, 0, 1]
    assert [metarm.train_target(r, "classifier", 0.5) for r in (0.0, 1.0, 1.5)] == [0, 1, 2]
    # R = λ (ungated wrong verdict) and 1 + λ/2 (a D_O label) are no class value: refused
    for mode in ("binary_retrain", "classifier"):
        for r in (0.5, 1.25):
            with pytest.raises(ValueError, match=rf"R = {r} is none of \(0.0, 1.0, 1.5\)"):
                metarm.train_target(r, mode, 0.5)
    assert [metarm.train_target(r, "online", 0.5) for r in (0.5, 1.25)] == [0.5, 1.25]
    # nearest values of (0.2, 1.3, 1.2, 0.6) in (0, 1, 1.5): (0, 1.5, 1, 1) vs R (0, 1.5, 1.5, 1)
    assert metarm.agreement([0.2, 1.3, 1.2, 0.6], [0.0, 1.5, 1.5, 1.0], 0.5) == 0.75
    assert metarm.agreement([], [], 0.5) is None

def test_agreement_decodes_each_modes_own_target():
    """binary: (0.4, 1.2, 1.3, 0.6) -> nearest of (0, 1, 1.5) = (0, 1, 1.5, 1) vs R (0, 1, 1.5, 0):
    3 of 4; binary_retrain: (0.49, 0.5, 0.7) -> (0, 1, 1) vs 1[R > 1] of (1.5, 1.5, 1) = (1, 1, 0):
    1 of 3; classifier: argmax of (2, 1, 0), (0, 1, 3) = (0, 2) vs (0, 1): 1 of 2; ungated 0.45
    -> λ = 0.5 (nearest of 0, 0.5, 1, 1.5)."""
    assert metarm.agreement([0.4, 1.2, 1.3, 0.6], [0.0, 1.0, 1.5, 0.0], 0.5, mode="binary") == 0.75
    assert metarm.agreement([0.49, 0.5, 0.7], [1.5, 1.5, 1.0], 0.5,
                            mode="binary_retrain") == pytest.approx(1 / 3)
    assert metarm.agreement([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]], [0.0, 1.0], 0.5,
                            mode="classifier") == 0.5
    assert metarm.agreement([0.45, 0.2], [0.5, 0.0], 0.5, gated=False) == 1.0
    assert metarm.agreement([0.45], [0.5], 0.5) == 0.0  # gated grid (0, 1, 1.5): 0.45 -> 0

def test_examples_skip_invalid_and_judge_failures(tiny_mrm):
    samples = [{"valid": True, "reward": 1.5, "critique": "c0"},
               {"valid": False, "reward": -1.0, "critique": None},
               {"valid": True, "reward": None, "critique": "c2"},
               {"valid": True, "reward": 0.0, "critique": "c3"}]
    ex = examples(tiny_mrm, [item(i) for i in range(4)], samples)
    assert [e["r"] for e in ex] == [1.5, 0.0] and [e["truncated"] for e in ex] == [False, False]
    assert ex[1]["text"].endswith("[Critique]\nc3") and "What is 3+3?" in ex[1]["text"]

def test_input_budget_cuts_middles_and_keeps_every_part(tiny_model_path):
    """max_length too small: the conversation's middle goes first, then the responses' middles;
    heads, tails and the whole critique stay (Eq. 6 conditions on all four) and it fits."""
    mrm = fresh(tiny_model_path, max_length=160)
    tok = mrm["tokenizer"]
    conv = "START " + " ".join(f"word{i}" for i in range(300)) + " END"
    a, b, critique = "Alpha answer here.", "Beta answer here.", "Response B is wrong because of X."
    text, cut = metarm.metarm_input(tok, dict(context=conv, response_a=a, response_b=b), critique,
                                    max_length=160)
    assert cut and len(tok(text)["input_ids"]) <= 160 and " [...] " in text
    assert "[Conversation]\nSTART" in text and "END\n\n[Response A]\nAlpha answer here." in text
    assert "[Response B]\nBeta answer here." in text and text.endswith("[Critique]\n" + critique)
    # long responses too: the conversation keeps 32 tokens, then each response gives a share
    long_a, long_b = "A0 " + "alpha " * 200 + "A9", "B0 " + "beta " * 200 + "B9"
    text, cut = metarm.metarm_input(tok, dict(context=conv, response_a=long_a, response_b=long_b),
                                    critique, max_length=160)
    assert cut and len(tok(text)["input_ids"]) <= 160 and text.endswith(critique)
    assert all(x in text for x in ("START", "END", "A0", "A9", "B0", "B9"))
    assert text.count(" [...] ") == 3
    assert metarm.metarm_input(tok, dict(context="Q", response_a="a", response_b="b"), "c",
                               max_length=160) == (
        metarm.metarm_text("Q", "a", "b", "c"), False)
    # counted in the state: 2 of 3 D_O inputs cut (predict), 1 of 2 examples (online_update)
    r_hat, n_cut = metarm.predict(mrm, [dict(item(0), context=conv)] * 2 + [item(1)],
                                  ["c", "c", "c"])
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

class FixedOutputs(torch.nn.Module):
    """A stand-in sequence classifier: logits of row i = the parameter row out[i], any text."""
    def __init__(self, out):
        super().__init__()
        self.out = torch.nn.Parameter(torch.tensor(out))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.out[:len(input_ids)].reshape(len(input_ids), -1))

def test_metarm_loss_with_plain_numbers_hand_computed(tiny_mrm):
    """Eq. 7 with outputs ŷ = (0.5, 1, 2), R = (0, 1, 1.5), λ = 0.5: MSE = (0.25 + 0 + 0.25) / 3
    = 1/6, gradient 2 (ŷ - R) / 3 = (1/3, 0, 1/3); binary_retrain regresses 1[R > 1] = (0, 0, 1):
    (0.25 + 1 + 1) / 3 = 0.75; classifier, logits (ln 1, ln 1, ln 2), class 2: -log(2/4) = ln 2."""
    reg = dict(tiny_mrm, model=FixedOutputs([[0.5], [1.0], [2.0]]), max_length=4096,
               micro_batch_size=2)
    texts = ["a", "b c", "d"]
    loss = metarm.metarm_loss(reg, texts, [0.0, 1.0, 1.5])
    assert loss.item() == pytest.approx(1 / 6, rel=1e-6)
    loss.backward()
    assert reg["model"].out.grad.flatten().tolist() == pytest.approx([1 / 3, 0, 1 / 3], rel=1e-6)
    assert metarm.metarm_loss(dict(reg, mode="binary_retrain"), texts, [0.0, 1.0, 1.5]).item() \
        == pytest.approx(0.75, rel=1e-6)
    clf = dict(reg, model=FixedOutputs([[0.0, 0.0, math.log(2.0)]]), mode="classifier")
    assert metarm.metarm_loss(clf, ["t"], [1.5]).item() == pytest.approx(math.log(2), rel=1e-6)
    # predict: R̂ = ŷ for a regressor; classifier Σ p_c value_c = (0 + 1 + 2 · 1.5) / 4 = 1
    r_hat, cut = metarm.predict(reg, [item(0), item(1), item(2)], ["c", None, "c"])
    assert r_hat == pytest.approx([0.5, None, 1.0]) and cut == 0  # the 2 valid: rows 0 and 1
    assert metarm.predict(dict(clf, micro_batch_size=1), [item(0)], ["c"])[0] == pytest.approx(
        [1.0])

def test_classifier_and_binary_predictions(tiny_model_path):
    clf = fresh(tiny_model_path, mode="classifier")
    assert clf["model"].config.num_labels == 3
    with torch.no_grad():
        p = outputs(clf, [input_text(clf, "some text")]).softmax(-1)[0]
        logits = outputs(clf, ["t"])[0]
    expected = p[1].item() * 1.0 + p[2].item() * 1.5  # Σ p_c value_c over (0, 1, 1.5)
    assert predict_texts(clf, ["some text"])[0] == pytest.approx(expected, rel=1e-6)
    assert loss_of(clf, ["t"], [1.5]).item() == pytest.approx(
        -torch.log_softmax(logits, -1)[2].item(), rel=1e-5)  # class 2
    assert all(x in (1.0, 1.5) for x in predict_texts(fresh(tiny_model_path, mode="binary"),
                                                      ["x", "y z"]))

def test_binary_discretises_the_regression_output(tiny_mrm, monkeypatch):
    """App. H.1 "Binary": 1[R̂ > 1 + λ/2]; λ = 0.5 cuts at 1.25: raw (1.24, 1.26, 0.3, 1.9) ->
    (1, 1.5, 1, 1.5). binary_retrain thresholds a 0/1 regressor at 0.5: (0.49, 0.5) -> (1, 1.5)."""
    raw = {"binary": [1.24, 1.26, 0.3, 1.9], "binary_retrain": [0.49, 0.5]}
    for mode, want in [("binary", [1.0, 1.5, 1.0, 1.5]), ("binary_retrain", [1.0, 1.5])]:
        monkeypatch.setattr(metarm, "forward", lambda m, texts:
                            torch.tensor(raw[m["mode"]][:len(texts)]))
        assert predict_texts(dict(tiny_mrm, mode=mode), ["t"] * len(want)) == want
    # the D_O reward of a right verdict is then 1 or 1 + λ (RM-NLHF Eq. 8)
    assert [reward.do_reward(True, True, r, lam=0.5, mode="binary") for r in (1.0, 1.5)] == [1, 1.5]

# ---- training: the online update and the cold-start fit ---------------------------------------

def test_mse_is_the_mean_square_and_a_step_lowers_it(tiny_model_path):
    mrm = fresh(tiny_model_path, online_lr=1e-3)
    items = [item(i) for i in range(4)]
    samples = [{"valid": True, "reward": r, "critique": f"critique {i}"}
               for i, r in enumerate([0.0, 1.0, 1.5, 1.0])]
    ex = examples(mrm, items, samples)
    texts, rs = [e["text"] for e in ex], [e["r"] for e in ex]
    with torch.no_grad():
        manual = ((outputs(mrm, texts) - torch.tensor(rs)) ** 2).mean()
        before = loss_of(mrm, texts, rs)
    assert before.item() == pytest.approx(manual.item(), rel=1e-6)
    m = metarm.online_update(mrm, items, samples, seed=0)
    with torch.no_grad():
        after = loss_of(mrm, texts, rs)
    assert m["metarm/n"] == 4 and m["metarm/loss"] == pytest.approx(before.item(), rel=1e-5)
    assert 0.0 <= m["metarm/agreement"] <= 1.0 and after.item() < before.item()
    assert mrm["updates"] == 1 and mrm["optimizer"] is not None and m["metarm/updates"] == 1

def test_cold_start_training_lowers_loss(tiny_model_path):
    mrm = fresh(tiny_model_path)
    ex = [{"text": f"example {i}", "r": [0.0, 1.0, 1.5][i % 3]} for i in range(6)]
    texts, rs = [e["text"] for e in ex], [e["r"] for e in ex]
    with torch.no_grad():
        before = loss_of(mrm, texts, rs).item()
    losses = metarm.train_metarm(mrm, ex, epochs=3, lr=1e-3, warmup_frac=0.01)
    assert len(losses) == 3 * 2  # 6 examples / batch 4 -> 2 steps per epoch
    with torch.no_grad():
        assert loss_of(mrm, texts, rs).item() < before
    assert metarm.train_metarm(mrm, [], epochs=3) == []

def test_offline_mode_does_not_train(tiny_model_path):
    mrm = fresh(tiny_model_path, mode="offline", online_lr=1e-3)
    w = mrm["model"].score.weight.clone()
    m = metarm.online_update(mrm, [item(0)], [{"valid": True, "reward": 1.5, "critique": "c"}],
                             seed=0)
    assert m["metarm/loss"] is None and m["metarm/n"] == 1 and m["metarm/agreement"] in (0.0, 1.0)
    assert torch.equal(w, mrm["model"].score.weight) and mrm["updates"] == 0
    assert mrm["optimizer"] is None

def test_online_epochs_are_passes_with_one_persistent_optimizer(tiny_model_path):
    """online_epochs = 2 (App. H.1 "Aggressive") is two one-pass updates in a row (pass k shuffled
    by seed + k, one AdamW), counted as ONE update; its loss is the mean over both passes."""
    items = [item(0), item(1), item(2)]
    samples = [{"valid": True, "reward": r, "critique": f"critique {k}"}
               for k, r in enumerate([1.5, 0.0, 1.0])]
    two = fresh(tiny_model_path, online_epochs=2, online_batch_size=2, online_lr=1e-3, seed=0)
    one = fresh(tiny_model_path, online_batch_size=2, online_lr=1e-3, seed=0)
    start = flat(two).clone()
    assert torch.equal(start, flat(one))  # the same seed, the same fresh head
    m2 = metarm.online_update(two, items, samples, seed=3)
    a = metarm.online_update(one, items, samples, seed=3)
    b = metarm.online_update(one, items, samples, seed=4)
    assert two["updates"] == 1 and one["updates"] == 2
    torch.testing.assert_close(flat(two), flat(one))
    assert not torch.equal(flat(two), start)
    assert m2["metarm/loss"] == pytest.approx((a["metarm/loss"] + b["metarm/loss"]) / 2, rel=1e-5)

# ---- optimizer steps and gradient accumulation (hand-counted) --------------------------------

TEN = [{"text": f"example {i} " * (1 + i % 4), "r": [0.0, 1.0, 1.5][i % 3]} for i in range(10)]

def adam_steps(opt):
    """The AdamW steps taken, read from its state (one count per parameter: all equal)."""
    return {int(s["step"]) for s in opt.state.values()}

def count_forwards(monkeypatch):
    """The sizes of the micro-batches metarm_loss is called on (one forward/backward each)."""
    sizes, loss = [], metarm.metarm_loss

    def counted(mrm, texts, rewards):
        sizes.append(len(texts))
        return loss(mrm, texts, rewards)
    monkeypatch.setattr(metarm, "metarm_loss", counted)
    return sizes

@pytest.mark.parametrize("micro,forwards", [(1, [1] * 10), (3, [3, 3, 3, 1]), (10, [10])])
def test_online_update_is_one_optimizer_step_per_call(tiny_model_path, monkeypatch, micro,
                                                      forwards):
    """metarm.online_batch_size 0 (the default, the release's): 10 D_H examples make ONE AdamW
    step a call, in forwards of at most micro_batch_size; two calls: 2 steps in all."""
    mrm = fresh(tiny_model_path, online_lr=1e-3, micro_batch_size=micro)
    items = [item(i) for i in range(10)]
    samples = [{"valid": True, "reward": e["r"], "critique": e["text"]} for e in TEN]
    sizes = count_forwards(monkeypatch)
    for call in (1, 2):
        del sizes[:]
        m = metarm.online_update(mrm, items, samples, seed=call)
        assert adam_steps(mrm["optimizer"]) == {call} and sizes == forwards and m["metarm/n"] == 10

def test_fit_steps_per_batch_size_in_micro_batches(tiny_model_path, monkeypatch):
    """10 examples, batch_size 4, micro_batch_size 3, 2 epochs: ceil(10 / 4) = 3 AdamW steps an
    epoch, on batches of 4, 4, 2, each in forwards of 3 + 1, 3 + 1, 2: 6 steps in all."""
    mrm = fresh(tiny_model_path, micro_batch_size=3)
    sizes = count_forwards(monkeypatch)
    opt = torch.optim.AdamW(mrm["model"].parameters(), lr=1e-3)
    steps = metarm.fit(mrm, TEN, opt, epochs=2, seed=0, batch_size=4)
    assert [n for _, n in steps] == [4, 4, 2] * 2 and adam_steps(opt) == {6}
    assert sizes == [3, 1, 3, 1, 2] * 2

@pytest.mark.parametrize("batch_size,total", [(4, 3 * 3), (0, 1 * 3)])
def test_cold_start_counts_its_steps_for_the_schedule(tiny_model_path, monkeypatch, batch_size,
                                                      total):
    """train_metarm, 10 examples, 3 epochs: batch_size 4 -> 3 steps an epoch, 0 (all) -> 1. The
    cosine ends at lr 0 exactly after the last step only if `total` counted those steps."""
    mrm = fresh(tiny_model_path, batch_size=batch_size, micro_batch_size=4)
    opts, fit = [], metarm.fit

    def spied(mrm, examples, optimizer, **kw):
        opts.append(optimizer)
        return fit(mrm, examples, optimizer, **kw)
    monkeypatch.setattr(metarm, "fit", spied)
    assert len(metarm.train_metarm(mrm, TEN, epochs=3, lr=1e-3)) == total
    assert adam_steps(opts[0]) == {total} and opts[0].param_groups[0]["lr"] == 0.0

def test_accumulated_gradient_equals_the_batch_mean_gradient(tiny_model_path, monkeypatch):
    """One batch of 10 in micro-batches of 3 (3 + 3 + 3 + 1, each mean loss weighted 3/10 or 1/10):
    the gradient AdamW would step on (read where fit clips it) is that of the mean loss over all
    10 in one forward. Tolerance: the same 10 per-example float32 terms, summed in another order
    and padded otherwise (masked: the same logits up to rounding), differ by rounding of the order
    eps (1.2e-7) x the largest gradient (~3 here): ~5e-7 measured, so atol 1e-6, rtol 1e-5. A
    wrong weight (1 instead of len(micro) / len(batch)) is off by a factor of ~3."""
    acc, one = fresh(tiny_model_path, micro_batch_size=3), fresh(tiny_model_path)
    got = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: got.append(
        [p.grad.clone() for p in params]))
    steps = metarm.fit(acc, TEN, torch.optim.AdamW(acc["model"].parameters(), lr=0.0), epochs=1,
                       seed=0, batch_size=0)
    one["model"].train()
    loss = metarm.metarm_loss(one, [e["text"] for e in TEN], [e["r"] for e in TEN])
    loss.backward()
    assert len(got) == 1 and steps[0] == (pytest.approx(loss.item(), rel=1e-5), 10)
    for g, p in zip(got[0], one["model"].parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("mode,raw", [
    ("online", [0.0, 1.0, 1.5]), ("offline", [0.0, 1.0, 1.5]), ("metarm_only", [0.0, 1.0, 1.5]),
    ("binary", [0.0, 1.0, 1.5]), ("binary_retrain", [0.0, 0.0, 1.0]),
    ("classifier", [[30.0, 0.0, 0.0], [0.0, 30.0, 0.0], [0.0, 0.0, 30.0]])])
def test_a_perfect_metarm_agrees_fully_in_every_mode(tiny_mrm, monkeypatch, mode, raw):
    """D_H rewards R = (0, 1, 1.5) and the mode's perfect raw outputs: metarm/agreement is 1."""
    mrm = dict(tiny_mrm, mode=mode, online_lr=0.0, optimizer=None)
    monkeypatch.setattr(metarm, "forward", lambda m, texts:
                        torch.tensor(raw[:len(texts)], requires_grad=True))
    samples = [{"valid": True, "reward": r, "critique": f"c{i}"} for i, r in enumerate([0, 1, 1.5])]
    m = metarm.online_update(mrm, [item(i) for i in range(3)], samples, seed=0)
    assert m["metarm/agreement"] == 1.0

def test_agreement_with_train_on_do_and_without_the_gate(tiny_mrm, monkeypatch):
    """train_on_do: D_O labels (right 1 + λ/2 = 1.25, wrong 0) train the MetaRM but are not the
    judge's: agreement counts D_H only, so a predictor perfect on (0, 1.5 | 1.25, 0) scores 1.
    Ungated, a wrong verdict whose critique matched has R = λ = 0.5: its perfect output scores 1."""
    mrm = dict(tiny_mrm, online_lr=0.0, optimizer=None)
    outs = [0.0, 1.5, 1.25, 0.0]
    monkeypatch.setattr(metarm, "forward", lambda m, texts:
                        torch.tensor(outs[:len(texts)], requires_grad=True))
    dh = [{"valid": True, "reward": 0.0, "critique": "a"},
          {"valid": True, "reward": 1.5, "critique": "b"}]
    parsed = [{"valid": True, "choice": "A", "critique": "c"},
              {"valid": True, "choice": "B", "critique": "d"}]
    do = reward.do_training_samples(parsed, [item(2, "A"), item(3, "A")], lam=0.5)
    assert [s["reward"] for s in do] == [1.25, 0.0]
    items = [item(0), item(1), item(2), item(3)]
    m = metarm.online_update(mrm, items, dh + do, seed=0)
    assert m["metarm/n"] == 4 and m["metarm/agreement"] == 1.0
    outs[:] = [0.5, 1.0]
    ungated = [{"valid": True, "reward": 0.5, "critique": "a"},
               {"valid": True, "reward": 1.0, "critique": "b"}]
    assert metarm.online_update(mrm, items[:2], ungated, seed=0,
                                gated=False)["metarm/agreement"] == 1.0

def test_gradient_checkpointing_keeps_the_numbers(tiny_model_path):
    """metarm.gradient_checkpointing: the same loss and gradients (layers replayed in backward)."""
    got = []
    for ckpt in (False, True):
        mrm = fresh(tiny_model_path, gradient_checkpointing=ckpt, seed=0)
        mrm["model"].train()
        loss = loss_of(mrm, ["a long critique " * 20, "short"], [1.5, 0.0])
        loss.backward()
        got.append((loss.item(), [p.grad.clone() for p in mrm["model"].parameters()]))
    assert got[1][0] == pytest.approx(got[0][0], rel=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(got[0][1], got[1][1])) < 1e-6

# ---- the reward step (Algorithm 1, steps 2-4) -------------------------------------------------

def reward_step(items, comps, *, mrm, mode="online", train_on_do=False, step=0):
    """nlhf_reward_step with the proxy judge and config.yaml's nlhf / judge values."""
    return metarm.nlhf_reward_step(
        items, comps, judge=reward.make_judge(backend="proxy"), mrm=mrm, lam=0.5, threshold=0.5,
        inclusive=False, similarity="f1", gate_on_outcome=True, on_failure="mask", max_lines=4,
        max_chars=1500, style="ours", form="paper", mode=mode, train_on_do=train_on_do,
        seed=7_919 + step, t0=0.0)

def test_rewards_without_metarm_hand_numbers():
    """mode none: D_O gets the outcome only. D_H: a copied human critique (proxy F1 1) -> 1 + 0.5;
    a wrong verdict 0 without a judge call; no tags -1."""
    items = [dict(item(0), set="dh")] * 3 + [dict(item(1, "B", None), set="do")] * 2
    comps = [verdict(H, "A"), verdict(H, "B"), "no tags", verdict("B is right.", "B"),
             verdict("A.", "A")]
    out = reward_step(items, comps, mrm=None, mode="none")
    assert out["reward"].tolist() == [1.5, 0.0, -1.0, 1.0, 0.0] and out["valid"].all()
    s = out["records"]
    assert s[0]["f1"] == 1.0 and s[0]["judged"] and not s[1]["judged"]
    assert s[1]["f1_why"].startswith("wrong verdict") and s[2]["f1_why"] == "invalid format"
    assert s[3]["r_hat"] is None and s[3]["f1"] is None and s[3]["metarm_updates"] is None

def test_metarm_updated_before_it_scores_do(tiny_model_path):
    """Algorithm 1's order (App. D.1): D_O's R̂ is the MetaRM's AFTER this step's update on the
    D_H samples; D_O reward = 1 + clip(R̂ - 1, 0, λ) for a right verdict; train_on_do adds the
    valid D_O verdicts to the update (2 D_H + 1 D_O)."""
    mrm = fresh(tiny_model_path, online_lr=1e-2)
    before = copy.deepcopy(mrm)
    items = [dict(item(0), set="dh")] * 2 + [dict(item(1, "B", None), set="do")] * 2
    comps = [verdict(H, "A"), verdict("Response A is wrong.", "B"),
             verdict("Response B is right.", "B"), "none"]
    out = reward_step(items, comps, mrm=mrm, step=4)
    r_hat = out["records"][2]["r_hat"]
    crit = ["Response B is right."]
    assert r_hat == pytest.approx(metarm.predict(mrm, [items[2]], crit)[0][0], abs=1e-6)
    assert abs(r_hat - metarm.predict(before, [items[2]], crit)[0][0]) > 1e-4
    assert out["reward"].tolist()[:2] == [1.5, 0.0] and out["reward"][3] == -1.0
    assert out["reward"][2].item() == pytest.approx(1 + min(max(r_hat - 1, 0), 0.5), abs=1e-6)
    m = out["metrics"]
    assert m["metarm/n"] == 2 and m["metarm/updates"] == 1 and m["metarm/trained_this_step"]
    assert m["order/judge_done_s"] <= m["order/metarm_update_done_s"]
    assert m["order/metarm_update_done_s"] <= m["order/metarm_predict_start_s"]
    assert out["records"][2]["metarm_updates"] == 1 and m["metarm/truncated"] == 0
    assert reward_step(items, comps, mrm=mrm, train_on_do=True)["metrics"]["metarm/n"] == 3

# ---- save / load -------------------------------------------------------------------------------

def test_save_load_roundtrip_is_atomic(tiny_model_path, tmp_path):
    mrm = fresh(tiny_model_path, online_lr=1e-3, online_batch_size=2)
    metarm.online_update(mrm, [item(0)], [{"valid": True, "reward": 1.5, "critique": "c"}], seed=0)
    out = str(tmp_path / "metarm")
    metarm.save_metarm(mrm, out)
    metarm.save_metarm(mrm, out)  # over an existing save: through <out>.old, nothing left behind
    assert sorted(os.listdir(tmp_path)) == ["metarm"]
    back = metarm.load_metarm(out)
    assert back["updates"] == 1 and back["mode"] == "online" and back["online_lr"] == 1e-3
    assert back["online_batch_size"] == 2
    assert back["model"].config.pad_token_id == mrm["tokenizer"].pad_token_id
    texts = ["abc", "longer text here"]
    assert predict_texts(back, texts) == pytest.approx(predict_texts(mrm, texts), abs=1e-6)
    a, b = mrm["optimizer"].state_dict()["state"], back["optimizer"].state_dict()["state"]
    assert torch.equal(a[0]["exp_avg"], b[0]["exp_avg"])
    # the loaded AdamW continues exactly as the saved one
    more = [item(1)], [{"valid": True, "reward": 0.0, "critique": "d"}]
    metarm.online_update(mrm, *more, seed=1)
    metarm.online_update(back, *more, seed=1)
    torch.testing.assert_close(flat(back), flat(mrm))
    os.replace(out, out + ".old")  # as if a crash hit between the two renames
    assert metarm.load_metarm(out)["updates"] == 1
    meta = json.load(open(f := os.path.join(out + ".old", "metarm.json")))
    with open(f, "w") as fh:
        json.dump({k: v for k, v in meta.items() if k != "online_batch_size"}, fh)
    assert metarm.load_metarm(out)["online_batch_size"] == 0  # a save from before the key loads
    with pytest.raises(SystemExit, match="no saved MetaRM"):
        metarm.load_metarm(str(tmp_path / "nothing"))

# ---- the cold start (Algorithm 1, lines 2-10) ----------------------------------------------------

def fake_sample(calls=None, fail_at=None):
    """A deterministic sampler: per prompt, rollout 0 a right verdict whose critique depends on the
    seed, rollout 1 a wrong one (every third prompt unparseable); records each call's prompt
    count; raises KeyboardInterrupt (a kill mid-batch) at call `fail_at` (0-based)."""
    calls = [] if calls is None else calls

    def sample(prompt_ids, *, group_size, max_new_tokens, temperature=1.0, seed=0):
        calls.append(len(prompt_ids))
        if fail_at is not None and len(calls) - 1 == fail_at:
            raise KeyboardInterrupt
        out = []
        for p, ids in enumerate(prompt_ids):
            crit = "Response B adds 2 and 3 wrongly." if (seed + p) % 2 else "Response A is fine."
            out += [verdict(crit, "A"), "no verdict" if ids[0] % 3 == 0 else verdict(crit, "B")]
        return {"completions": out}
    return sample, calls

def cold(mrm, folder, items, sample, **kw):
    """run_cold_start with a stand-in prompt (the sampler reads only its first id), the proxy
    judge and config.yaml's nlhf numbers; 2 rollouts a prompt, batches of 2."""
    args = dict(sample=sample, prompt=lambda it: [int(it["id"][1:]), 7, 7],
                judge=reward.make_judge(backend="proxy"), folder=folder,
                identity={"policy": "tiny"}, batch_size=2, rollouts_per_prompt=2,
                max_new_tokens=8, temperature=1.0, epochs=1, lr=1e-4, seed=3, lam=0.5,
                threshold=0.5, inclusive=False,
                similarity="f1", gate_on_outcome=True, on_failure="mask", max_lines=4,
                max_chars=1500, style="ours", poll_s=0.01)
    return metarm.run_cold_start(mrm, items, **dict(args, **kw))

def test_a_killed_cold_start_resumes_to_the_uninterrupted_set_and_metarm(tiny_model_path, tmp_path,
                                                                         capsys):
    """7 D_H items in batches of 2 (2, 2, 2, 1 prompts): 4 sample calls. Killed at the 3rd call
    (batches 0 and 1 on disk, a torn temporary file beside them), the rerun samples only batches
    2 and 3 (the sampler still called for 0 and 1, with nothing: a collective under FSDP2), and
    its stats and MetaRM equal the uninterrupted run's. Other settings start a new folder."""
    items = [item(i) for i in range(7)]
    whole, calls = fake_sample()
    mrm_a = fresh(tiny_model_path, seed=0)
    stats_a = cold(mrm_a, str(tmp_path / "a"), items, whole)
    assert calls == [2, 2, 2, 1] and stats_a["batches"] == 4 and stats_a["resumed_batches"] == 0
    assert stats_a["rollouts"] == 14 and stats_a["examples"] > 0
    assert stats_a["loss_first"] is not None and stats_a["target_mean"] > 0
    broken, _ = fake_sample(fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        cold(fresh(tiny_model_path, seed=0), str(tmp_path / "b"), items, broken)
    (sub,) = os.listdir(tmp_path / "b")
    folder = tmp_path / "b" / sub
    assert sorted(os.listdir(folder)) == ["batch000000.json", "batch000001.json"]
    (folder / "batch000002.json.99.tmp").write_text('{"counts": {"rollouts"')  # a kill mid-write
    rest, calls_c = fake_sample()
    mrm_c = fresh(tiny_model_path, seed=0)
    stats_c = cold(mrm_c, str(tmp_path / "b"), items, rest)
    assert calls_c == [0, 0, 2, 1] and stats_c["resumed_batches"] == 2
    drop = ("seconds", "resumed_batches")
    assert {k: v for k, v in stats_c.items() if k not in drop} == \
        {k: v for k, v in stats_a.items() if k not in drop}
    assert torch.equal(flat(mrm_c), flat(mrm_a))
    other = cold(fresh(tiny_model_path), str(tmp_path / "b"), items, fake_sample()[0],
                 identity={"policy": "other"})
    assert other["resumed_batches"] == 0 and len(os.listdir(tmp_path / "b")) == 2
    # the record: cold_start.json, one line, the first step's metrics
    m = metarm.record_cold_start(str(tmp_path), stats_a, 2)
    assert m == {"metarm/cold_start_prompts": 7, "metarm/cold_start_rollouts": 14,
                 "metarm/cold_start_invalid": stats_a["invalid"],
                 "metarm/cold_start_judge_failures": 0,
                 "metarm/cold_start_examples": stats_a["examples"]}
    assert json.load(open(tmp_path / "cold_start.json"))["batches"] == 4
    assert "{'prompts': 7, 'rollouts': 14," in capsys.readouterr().out

def test_the_cold_start_computes_the_rewards_by_hand(tiny_model_path, tmp_path):
    """Real GRM prompts (reward.grm_prompt_ids, the tiny tokenizer) and known completions: the
    proxy F1 of a copied first human line -> right + matched 1 + λ·1[F1 > 0.5], wrong 0, no
    format no example (R = -1 is never a MetaRM target); the sampler gets batch 0's seed."""
    crit = "Response B adds 2 and 3 wrongly.\nResponse A is right."
    items = [item(0, critique=crit), item(1, "B", critique=crit)]
    mrm = fresh(tiny_model_path)
    seen = {}

    def sample(ids, *, group_size, max_new_tokens, temperature=1.0, seed=0):
        seen.update(prompts=len(ids), g=group_size, first=mrm["tokenizer"].decode(ids[0]),
                    seed=seed)
        line = crit.splitlines()[0]
        return {"completions": [t for it in items for t in (
            verdict(line, it["winner"]), verdict(line, "B" if it["winner"] == "A" else "A"),
            "no format at all")]}
    prompt = lambda it: reward.grm_prompt_ids(mrm["tokenizer"], it, False, max_lines=4,  # noqa
                                              style="ours")
    stats = cold(mrm, str(tmp_path), items, sample, prompt=prompt, rollouts_per_prompt=3)
    assert seen["prompts"] == 2 and seen["g"] == 3 and seen["seed"] == 3
    assert "[Response A]" in seen["first"]
    f1 = reward.proxy_f1(crit, crit.splitlines()[0])["f1"]
    assert stats["rollouts"] == 6 and stats["invalid"] == 2 and stats["examples"] == 4
    assert stats["target_mean"] == pytest.approx((2 * (1.0 + 0.5 * (f1 > 0.5))) / 4)

def test_a_rank_waits_for_the_others_files_with_a_deadline(tiny_model_path, tmp_path):
    """Rank 0 of 2 runs batches 0 and 2 of 4; rank 1 never writes (it died): rank 0 stops after
    the deadline with one line naming the missing batches and their rank. Rank 1's rerun (no
    process group here) then finds all four batches and trains."""
    items = [item(i) for i in range(8)]
    sample, calls = fake_sample()
    with pytest.raises(SystemExit) as e:
        cold(fresh(tiny_model_path), str(tmp_path), items, sample, rank=0, world=2, timeout_s=0.3)
    assert calls == [2, 2]
    assert "batches [1, 3] of 4 (ranks [1])" in str(e.value) and "resumes" in str(e.value)
    sample1, calls1 = fake_sample()
    stats = cold(fresh(tiny_model_path), str(tmp_path), items, sample1, rank=1, world=2,
                 timeout_s=5)
    assert calls1 == [2, 2] and stats["batches"] == 4 and stats["resumed_batches"] == 2

# ---- the command line ----------------------------------------------------------------------------

def test_cli_predict_and_its_one_line_errors(tiny_model_path, tmp_path, capsys):
    mrm = fresh(tiny_model_path)
    metarm.save_metarm(mrm, str(tmp_path / "m"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(dict(item(0), critique="c")) + "\n\n"
                    + json.dumps(dict(item(1), critique="d")) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["predict", "--metarm", str(tmp_path / "m"), "--rows", str(rows), "--out", str(out)]
    metarm.main(args)
    got = [json.loads(line)["r_hat"] for line in open(out)]
    assert got == pytest.approx(metarm.predict(mrm, [item(0), item(1)], ["c", "d"])[0])
    assert "2 rows" in capsys.readouterr().out
    for text, msg in [('{"context": "q"\n', "line 1: not JSON"),
                      (json.dumps(dict(item(0), critique=None)) + "\n",
                       "line 1: field 'critique' missing or not text")]:
        rows.write_text(text)
        with pytest.raises(SystemExit, match=msg):
            metarm.main(args)
    with pytest.raises(SystemExit, match="missing.jsonl: file does not exist"):
        metarm.main(args[:3] + ["--rows", str(tmp_path / "missing.jsonl"), "--out", str(out)])
    rows.write_text(json.dumps(dict(item(0), critique="c")) + "\n")
    with pytest.raises(SystemExit, match="no saved MetaRM"):
        metarm.main(["predict", "--metarm", str(tmp_path), "--rows", str(rows), "--out", str(out)])

# ---- two gloo ranks: a replica and an FSDP2-sharded MetaRM equal one process --------------------

def _rank(rank, port, path, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def shard(model):  # as train.py's FSDP2: each decoder layer, then the root
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    got = {}
    for name, wrap in (("replica", None), ("fsdp2", shard)):
        mrm = fresh(path, online_lr=1e-2, online_batch_size=3, seed=0, wrap=wrap)
        got[name] = metarm.online_update(mrm, *RANK_SAMPLES[rank], seed=5)
        got[name + "/do"] = metarm.predict(mrm, *RANK_DO[rank])[0]
        metarm.save_metarm(mrm, os.path.join(out, name))
    torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()

RANK_SAMPLES = {r: ([item(k) for k in ks], [{"valid": True, "reward": [1.5, 0.0, 1.0][k % 3],
                                             "critique": f"critique {k}"} for k in ks])
                for r, ks in ((0, [0, 1, 2]), (1, [3, 4]))}
RANK_DO = {0: ([item(k) for k in (10, 11, 12)], ["c", None, "d"]), 1: ([item(13)], ["e"])}

@pytest.mark.slow  # two spawned processes
def test_two_ranks_update_and_predict_as_one_process(tiny_model_path, tmp_path):
    """2 gloo ranks, 3 + 2 D_H samples (batches of 3 over all 5, in rank order) and 2 + 1 D_O
    inputs: the replica and the FSDP2 MetaRM report one process's metrics, predict each rank's
    own R̂ as one process does, and save one process's weights."""
    import torch.multiprocessing as mp
    from conftest import free_port
    mp.start_processes(_rank, args=(free_port(), tiny_model_path, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    one = fresh(tiny_model_path, online_lr=1e-2, online_batch_size=3, seed=0)
    want = metarm.online_update(one, *[a + b for a, b in zip(RANK_SAMPLES[0], RANK_SAMPLES[1])],
                                seed=5)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for name in ("replica", "fsdp2"):
            assert got[name] == pytest.approx(want, abs=1e-6) and got[name]["metarm/n"] == 5
            assert got[name + "/do"] == pytest.approx(metarm.predict(one, *RANK_DO[r])[0],
                                                      abs=1e-5)
    for name in ("replica", "fsdp2"):
        torch.testing.assert_close(flat(metarm.load_metarm(str(tmp_path / name))), flat(one))

# ---- a judge that never answers on one rank: the step still ends (issue: a stuck judge server) --

def _judged_rank(rank, port, path, hole, out, deadline_s):
    import datetime
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=10))
    judge = reward.make_judge(backend="proxy") if rank == 0 else reward.make_judge(
        base_url=f"http://127.0.0.1:{hole}/v1", model="m", probe=False, timeout_s=15,
        max_retries=0, deadline_s=deadline_s)  # rank 1's server accepts and never answers
    items = [dict(item(k), set="dh") for k in (2 * rank, 2 * rank + 1)]
    got = metarm.nlhf_reward_step(
        items, [verdict(H, "A")] * 2, judge=judge, mrm=fresh(path, online_lr=1e-2), lam=0.5,
        threshold=0.5, inclusive=False, similarity="f1", gate_on_outcome=True,
        on_failure="mask", max_lines=4, max_chars=1500, style="ours", form="paper",
        mode="online", train_on_do=False, seed=0, t0=time.perf_counter())
    torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()

@pytest.mark.slow  # two spawned processes
def test_a_hung_judge_on_one_rank_is_masked_by_the_deadline(tiny_model_path, tmp_path):
    """Rank 1's judge server never answers (a socket that is never read; the client would wait
    15 s, the ranks' collective 10 s): with a 3 s deadline both ranks end the step, rank 1's
    two D_H samples masked ("deadline"), rank 0's judged, the MetaRM trained on rank 0's."""
    import socket
    import torch.multiprocessing as mp
    from conftest import free_port
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # the kernel accepts the connections; nobody reads the requests
    mp.start_processes(_judged_rank, args=(free_port(), tiny_model_path, hole.getsockname()[1],
                                           str(tmp_path), 3.0), nprocs=2, start_method="spawn")
    hole.close()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["valid"].tolist() == [True, True] and r1["valid"].tolist() == [False, False]
    assert all(s["judge_why"].startswith("deadline") and s["judge_failed"]
               for s in r1["records"])
    assert r1["metrics"]["order/judge_done_s"] < 3.0 + 2.0  # the deadline, + thread scheduling
    assert r0["metrics"]["metarm/n"] == r1["metrics"]["metarm/n"] == 2
