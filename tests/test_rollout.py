"""rollout.py: masks with pad == EOS, temperature-scaled log-probs, padding-invariant forwards."""
import math

import pytest
import torch

import rollout
import fast
from plumbing.cli import rollout_main
from plumbing.data import load_model, read_jsonl, resolve_model_path
from plumbing.scale import wrap_policy


def test_mask_pad_equals_eos():
    eos = 2  # SmolLM2: pad id == EOS id == 2
    ids = torch.tensor([[5, 6, 2, 2, 2],    # EOS at 2, then pad (=EOS)
                        [2, 2, 2, 2, 2],    # empty completion: the EOS itself is kept
                        [5, 6, 7, 8, 9],    # no EOS: truncated
                        [5, 2, 7, 2, 9]])   # junk after the first EOS is masked
    mask, truncated = rollout.completion_mask(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]
    # `ids != pad` would have dropped the real EOS of row 0:
    assert (ids[0] != eos).float().tolist() != mask[0].tolist()


def test_mask_several_eos_ids():
    mask, truncated = rollout.completion_mask(torch.tensor([[4, 7, 3, 3], [4, 9, 3, 3]]), [7, 9])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]] and truncated.tolist() == [False, False]


@pytest.mark.parametrize("use_fast", [True, False])
def test_token_logprobs_temperature_by_hand(use_fast):
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    target = torch.tensor([2])
    # T = 2: logits/2 = [0.5, 1, 1.5]; log p(2) = 1.5 - log(e^0.5 + e^1 + e^1.5)
    expected = 1.5 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    assert (fast.token_logprobs if use_fast else rollout.token_logprobs)(logits, target, temperature=2.0).item() == pytest.approx(expected, abs=1e-6)
    # T = 1 is the plain log-softmax
    expected1 = 3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert (fast.token_logprobs if use_fast else rollout.token_logprobs)(logits, target).item() == pytest.approx(expected1, abs=1e-6)


@pytest.mark.parametrize("use_fast", [True, False])
def test_token_logprobs_gradient_by_hand(use_fast):
    # d log softmax(z)[t] / d logits = (onehot(t) - softmax(z)) / T with z = logits / T.
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    (fast.token_logprobs if use_fast else rollout.token_logprobs)(logits, torch.tensor([2]), temperature=2.0).sum().backward()
    e = [math.exp(0.5), math.exp(1.0), math.exp(1.5)]
    p = [x / sum(e) for x in e]
    expected = [(-p[0]) / 2, (-p[1]) / 2, (1 - p[2]) / 2]
    assert logits.grad[0].tolist() == pytest.approx(expected, abs=1e-7)
    assert logits.tolist() == [[1.0, 2.0, 3.0]]  # the caller's leaf is not overwritten


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_fast_equals_plain(temperature, dtype):
    """The hand-written backward (fast._TokenLogprob) against token_logprobs_plain (autograd's
    log_softmax + gather), values and gradients, on a non-contiguous view of an intermediate tensor
    (as completion_logprobs passes logits[:, :-1]) with an upstream weight, so the in-place
    backward path is the one exercised; bf16 logits are upcast to float32 by both."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 4), generator=g)
    upstream = torch.randn(3, 4, generator=g)

    def run(use_fast):
        w.grad = None
        logits = (w * 3.0).to(dtype)[:, :-1]  # [3, 4, 50] view of a non-leaf
        lp = (fast.token_logprobs if use_fast else rollout.token_logprobs)(logits, targets, temperature)
        (lp * upstream).sum().backward()
        return lp.detach(), w.grad.clone()

    ours, ours_grad = run(True)
    ref, ref_grad = run(False)
    assert ours.dtype == ref.dtype == torch.float32
    assert torch.equal(ref, rollout.token_logprobs((w * 3.0).to(dtype)[:, :-1], targets, temperature))
    # float32 rounding of log-probs of magnitude ~10 and of gradients of magnitude ~1
    assert torch.allclose(ours, ref, atol=1e-5) and torch.allclose(ours_grad, ref_grad, atol=1e-6)
    assert ours_grad.abs().sum() > 0


def test_left_pad_and_positions():
    ids, mask = rollout.left_pad([[7, 8, 9], [5]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert rollout.positions_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("use_fast", [True, False])
def test_completion_logprobs_ignore_padding(tiny_model_path, use_fast):
    """A row's log-probs must not depend on how much left padding its batch needed."""
    model, tok = load_model(tiny_model_path)
    model.eval()
    short, long = [1, 50, 60], [1, 50, 60, 70, 80, 90, 100]
    comp = torch.tensor([[11, 12, 13, 2], [21, 22, 2, 2]])
    with torch.no_grad():
        both = (fast.completion_logprobs if use_fast else rollout.completion_logprobs)(model, [short, long], comp, tok.pad_token_id, temperature=0.7)
        alone = (fast.completion_logprobs if use_fast else rollout.completion_logprobs)(model, [short], comp[:1], tok.pad_token_id, temperature=0.7)
        # the same thing by hand: one unpadded forward, logits / T, log-softmax
        full = torch.tensor([short + comp[0].tolist()])
        logits = model(input_ids=full).logits[0, len(short) - 1:-1] / 0.7
        manual = torch.log_softmax(logits, -1).gather(-1, comp[0][:, None]).squeeze(-1)
    assert torch.allclose(both[0], alone[0], atol=1e-5)
    assert torch.allclose(alone[0], manual, atol=1e-5)


def test_generate_groups_masks_and_seed(tiny_model_path):
    model, tok = load_model(tiny_model_path)
    prompts = [[1, 50, 60], [1, 70]]
    a = fast.generate(model, tok, prompts, group_size=3, max_new_tokens=6, seed=123)
    b = fast.generate(model, tok, prompts, group_size=3, max_new_tokens=6, seed=123)
    c = fast.generate(model, tok, prompts, group_size=3, max_new_tokens=6, seed=124)
    assert a["prompt_ids"] == [prompts[0]] * 3 + [prompts[1]] * 3  # groups are adjacent rows
    assert a["completion_ids"].shape[0] == 6 and a["completion_ids"].shape[1] <= 6
    assert torch.equal(a["completion_ids"], b["completion_ids"])      # same seed, same samples
    assert not torch.equal(a["completion_ids"], c["completion_ids"])  # per-rank/step seeds differ
    mask, trunc = rollout.completion_mask(a["completion_ids"], rollout.eos_ids(model, tok))
    assert torch.equal(mask, a["completion_mask"]) and torch.equal(trunc, a["truncated"])


def test_prompt_runs():
    a, b = [1, 5], [1, 6]
    assert fast.prompt_runs([a, a, a, b, b, a]) == ([a, b, a], [3, 2, 1])
    assert fast.prompt_runs([a]) == ([a], [1])


def _draw(probs, n, seed=0, **kw):
    logits = torch.log(torch.tensor(probs)).expand(n, -1)
    g = torch.Generator().manual_seed(seed)
    return fast.sample_next(logits, kw.pop("temperature", 1.0), kw.pop("top_p", 1.0), kw.pop("top_k", 0), g)


def test_sample_next_inverse_cdf_by_hand():
    # one uniform u per row; cdf of [0.1, 0, 0.6, 0.3] is [0.1, 0.1, 0.7, 1.0] and the token is the
    # first index whose cdf exceeds u: u < 0.1 -> 0, 0.1 <= u < 0.7 -> 2 (never the 0-mass token 1), else 3
    probs = [0.1, 0.0, 0.6, 0.3]
    u = torch.rand(8, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64).squeeze(1)
    expected = [0 if x < 0.1 else 2 if x < 0.7 else 3 for x in u.tolist()]
    assert _draw(probs, 8, seed=3).tolist() == expected
    # frequencies over many rows follow the distribution
    counts = torch.bincount(_draw(probs, 20000), minlength=4).float() / 20000
    assert counts[1] == 0 and torch.allclose(counts, torch.tensor(probs), atol=0.01)


def test_sample_next_top_k_top_p_and_greedy():
    probs = [0.1, 0.0, 0.6, 0.3]
    for kw in ({"top_k": 2}, {"top_p": 0.65}):  # both keep {2, 3}, renormalised to 2/3, 1/3
        counts = torch.bincount(_draw(probs, 20000, **kw), minlength=4).float() / 20000
        assert counts[0] == 0 and counts[1] == 0, kw
        assert counts[2].item() == pytest.approx(2 / 3, abs=0.01), kw
    # top_p = 0.5: the most likely token alone already reaches it
    assert set(_draw(probs, 1000, top_p=0.5).tolist()) == {2}
    assert set(_draw(probs, 10, temperature=0.0).tolist()) == {2}  # T = 0: argmax


def _small_vocab_model(tok, sharpen, seed=0, vocab=96):
    """A tiny untied Llama over the first `vocab` ids of the real tokenizer, built in memory, its
    final norm scaled by `sharpen` so that its next-token distribution is peaked: greedy decoding
    then changes token from step to step and some rows reach EOS early, and a few thousand samples
    resolve the whole sampling distribution (over the full 49k vocabulary each draw would cost a
    [rows, 49152] softmax)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval()


@pytest.mark.parametrize("which, pad", [("tiny", "eos"), ("small_vocab", "eos"), ("small_vocab", "other")])
def test_greedy_generate_fast_equals_plain(tiny_model_path, which, pad):
    """Greedy decoding: generate (shared prefill, static cache, inverse-CDF sampler) == generate_plain
    (transformers' generate) token for token, with left padding, a group split across decode
    batches, rows that end early (padded after their EOS, pad == EOS as on SmolLM2, or another id)
    and rows that run to max_new_tokens."""
    model, tok = load_model(tiny_model_path)
    if which == "small_vocab":
        model = _small_vocab_model(tok, sharpen=40.0)
        model.generation_config.repetition_penalty = 5.0  # a checkpoint's default that must not apply
    if pad == "other":
        tok.pad_token = tok.convert_ids_to_tokens(0)
        assert tok.pad_token_id not in rollout.eos_ids(model, tok)
    prompts = [[1, 50, 60, 70, 80], [1, 90], [1, 5, 6]]
    kw = dict(group_size=3, max_new_tokens=12, temperature=0.0, micro_batch_size=4)
    fast_out = fast.generate(model, tok, prompts, **kw)
    plain = rollout.generate(model, tok, prompts, **kw)
    assert torch.equal(fast_out["completion_ids"], plain["completion_ids"])
    for key in ("completion_mask", "truncated"):
        assert torch.equal(fast_out[key], plain[key]), key
    assert fast_out["completions"] == plain["completions"] and fast_out["prompt_ids"] == plain["prompt_ids"]
    if which == "small_vocab":  # the case that tests the stopping rule: some rows end early, some do not
        ends = plain["completion_mask"].sum(1)
        assert plain["truncated"].any() and (ends < 12).any()
        row = int((ends < 12).nonzero()[0])
        assert (plain["completion_ids"][row, int(ends[row]):] == tok.pad_token_id).all()


def _sampling_probs(logits, temperature, top_k=0, top_p=1.0):
    """The distribution the samplers must draw from, written out in float64: softmax(logits / T),
    restricted to the top_k most likely tokens, then to the smallest most-likely set whose mass
    reaches top_p, renormalised. Returns (probs [V], the cumulative masses of the sorted kept
    tokens, to check that top_p is not on a boundary where rounding could decide)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[:top_k] if top_k > 0 else order] = True
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    cum = p[order].cumsum(0)
    if top_p < 1.0:
        n_keep = int((cum < top_p).sum()) + 1  # the first sorted token whose cumulative mass reaches top_p is kept
        p[order[n_keep:]] = 0.0
        p = p / p.sum()
    return p, cum


def _chi_square_ok(counts, probs, n):
    """Pearson's chi-square of `counts` against `probs` (tokens with expected count < 5 pooled into
    one bin) below the 1e-4 upper quantile of its distribution (Wilson-Hilferty approximation),
    and no draw of a token of probability 0. Returns (ok, statistic, threshold)."""
    if counts[probs == 0].sum() > 0:
        return False, float("inf"), 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]) if (~big).any() else counts[big]
    exp = torch.cat([expected[big], expected[~big].sum()[None]]) if (~big).any() else expected[big]
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    z = 3.719  # the standard normal's 1e-4 upper quantile
    threshold = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < threshold, stat, threshold


# T = 2 flattens the distribution: 12 % of its mass lies outside the 50 most likely tokens, which
# transformers' default top_k = 50 would cut (generate_plain must pass top_k = 0, "off", to it).
@pytest.mark.parametrize("settings", [dict(temperature=2.0), dict(temperature=0.7, top_k=5),
                                      dict(temperature=1.3, top_p=0.71), dict(temperature=1.0, top_k=8, top_p=0.9)],
                         ids=["T2", "T0.7-k5", "T1.3-p0.71", "T1-k8-p0.9"])
def test_sampled_generate_fast_and_plain_follow_the_softmax(tiny_model_path, settings):
    """Sampled tokens of both generate paths, one step from a fixed prompt, follow the model's
    next-token distribution (temperature, top_k, top_p) by a chi-square test at a fixed seed."""
    _, tok = load_model(tiny_model_path)
    model = _small_vocab_model(tok, sharpen=20.0)
    model.generation_config.min_p = 0.05  # a checkpoint's sampling default that must not apply
    prompt, n = [1, 50, 60], 5000
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs, cum = _sampling_probs(logits, **settings)
    top_p = settings.get("top_p", 1.0)
    assert top_p == 1.0 or (cum - top_p).abs().min() > 1e-3  # a well-posed top_p: not on a boundary
    assert (probs > 0).sum() > 3 and probs.max() < 0.9  # a distribution worth testing
    for use_fast in (True, False):
        out = (fast.generate if use_fast else rollout.generate)(model, tok, [prompt], group_size=n, max_new_tokens=1, seed=7,
                               top_k=settings.get("top_k", 0), top_p=top_p, temperature=settings["temperature"])
        counts = torch.bincount(out["completion_ids"][:, 0], minlength=probs.shape[0]).double()
        ok, stat, threshold = _chi_square_ok(counts, probs, n)
        assert ok, (use_fast, stat, threshold)


def test_sampled_generate_full_vocabulary_top_k(tiny_model_path):
    """The same on the tiny model with the tokenizer's full vocabulary (49k logits per row): with
    top_k = 4 only the 4 most likely tokens come out, at their renormalised probabilities."""
    model, tok = load_model(tiny_model_path)
    prompt, n = [1, 50, 60], 600
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs, _ = _sampling_probs(logits, temperature=0.5, top_k=4)
    for use_fast in (True, False):
        out = (fast.generate if use_fast else rollout.generate)(model, tok, [prompt], group_size=n, max_new_tokens=1, temperature=0.5, top_k=4,
                               seed=3)
        counts = torch.bincount(out["completion_ids"][:, 0], minlength=probs.shape[0]).double()
        ok, stat, threshold = _chi_square_ok(counts, probs, n)
        assert ok, (use_fast, stat, threshold)


def test_generate_plain_seeded_and_leaves_global_rng(tiny_model_path):
    """generate_plain: same seed, same samples; another seed, other samples; the caller's global
    RNG stream is not advanced (the draws run in a forked RNG)."""
    _, tok = load_model(tiny_model_path)
    model = _small_vocab_model(tok, sharpen=20.0)
    prompts = [[1, 50, 60], [1, 70]]
    kw = dict(group_size=4, max_new_tokens=6)
    torch.manual_seed(99)
    before = torch.random.get_rng_state()
    a = rollout.generate(model, tok, prompts, seed=5, **kw)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = rollout.generate(model, tok, prompts, seed=5, **kw)
    c = rollout.generate(model, tok, prompts, seed=6, **kw)
    assert torch.equal(a["completion_ids"], b["completion_ids"])
    assert not torch.equal(a["completion_ids"], c["completion_ids"])
    assert a["prompt_ids"] == [prompts[0]] * 4 + [prompts[1]] * 4
    mask, trunc = rollout.completion_mask(a["completion_ids"], rollout.eos_ids(model, tok))
    assert torch.equal(mask, a["completion_mask"]) and torch.equal(trunc, a["truncated"])


@torch.no_grad()
def test_decode_cache_logits_equal_full_forward(tiny_model_path):
    """Decoding token by token into fast.decode_cache (attention over the filled part only, left
    padding masked) gives the logits of one full forward over prompt + continuation."""
    model, tok = load_model(tiny_model_path)
    ids, attn = rollout.left_pad([[1, 50, 60, 70, 80], [1, 90]], tok.pad_token_id)
    cont = torch.tensor([[11, 12, 13], [21, 22, 23]])
    full_attn = torch.cat([attn, torch.ones_like(cont)], dim=1)
    ref = model(input_ids=torch.cat([ids, cont], dim=1), attention_mask=full_attn,
                position_ids=rollout.positions_from_mask(full_attn)).logits[:, ids.shape[1]:]  # [2, 3, V]
    cache = fast.decode_cache(model.config, max_cache_len=ids.shape[1] + 3)
    model(input_ids=ids, attention_mask=attn, position_ids=rollout.positions_from_mask(attn), cache=cache, use_cache=True)
    pos = rollout.positions_from_mask(attn)[:, -1:]
    for t in range(3):
        attn, pos = torch.cat([attn, torch.ones(2, 1, dtype=attn.dtype)], dim=1), pos + 1
        out = model(input_ids=cont[:, t:t + 1], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        assert torch.allclose(out.logits[:, -1], ref[:, t], atol=1e-5)
    assert cache.layers[0].keys.shape[2] == ids.shape[1] + 3  # preallocated once, not grown


A, B, C = [1, 50, 60, 70], [1, 90], [1, 33, 44]
LAYOUTS = {
    "groups": [A, A, A, B, C, C],             # shared-prompt path: unequal groups and prompt lengths
    "no_sharing": [A, B, C, [1, 5, 6, 7, 8], [1, 9], [1, 2, 3]],  # fast falls back to one pass
    "one_token_prompt": [A, A, A, [1], [1], [1]],                  # ... as it does for 1-token prompts
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("grad", [False, True])
def test_completion_logprobs_fast_equals_plain(tiny_model_path, grad, layout):
    """completion_logprobs (each group's prompt run once) == completion_logprobs_plain (every row
    runs its own prompt), values and gradients of the parameters."""
    model, tok = load_model(tiny_model_path)
    prompts = LAYOUTS[layout]
    comp = torch.randint(3, 200, (6, 5), generator=torch.Generator().manual_seed(0))
    out = {}
    for use_fast in (False, True):
        model.zero_grad()
        with torch.set_grad_enabled(grad):
            lp = (fast.completion_logprobs if use_fast else rollout.completion_logprobs)(model, prompts, comp, tok.pad_token_id, temperature=0.7)
        if grad:
            (lp * torch.arange(1.0, 31.0).view(6, 5)).sum().backward()
        out[use_fast] = (lp.detach(), [p.grad.clone() for p in model.parameters()] if grad else [])
    with torch.no_grad():
        direct = rollout.completion_logprobs(model, prompts, comp, tok.pad_token_id, temperature=0.7)
    assert torch.equal(out[False][0], direct)  # fast=False is the plain twin itself
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    for g1, g0 in zip(out[True][1], out[False][1]):  # float32 summation order: ~5e-6 of the largest entry
        assert (g1 - g0).abs().max() <= 2e-5 * g0.abs().max()


def test_completion_logprobs_fast_equals_plain_bf16_autocast(tiny_model_path):
    """Under bf16 autocast (float32 weights, as train.py's CPU/GPU bf16 presets run) the shared-
    prompt path still computes what the plain twin computes, values and gradients."""
    model, tok = load_model(tiny_model_path)
    prompts = LAYOUTS["groups"]
    comp = torch.randint(3, 200, (6, 5), generator=torch.Generator().manual_seed(0))
    out = {}
    for use_fast in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = (fast.completion_logprobs if use_fast else rollout.completion_logprobs)(model, prompts, comp, tok.pad_token_id, temperature=0.7)
        (lp * torch.arange(1.0, 31.0).view(6, 5)).sum().backward()
        out[use_fast] = (lp.detach(), [p.grad.clone() for p in model.parameters()])
    assert out[True][0].dtype == torch.float32
    # bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3) and the two paths round at
    # different places (a cached prompt pass vs one pass): 1e-2 on log-probs of magnitude ~11, and
    # 3e-2 of the largest gradient entry, instead of float32's 1e-5 and 2e-5.
    assert torch.allclose(out[True][0], out[False][0], atol=1e-2)
    for g1, g0 in zip(out[True][1], out[False][1]):
        assert (g1 - g0).abs().max() <= 3e-2 * g0.abs().max()


def test_model_path_errors(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(SystemExit, match="without config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(SystemExit, match="not installed"):
        resolve_model_path("gguf:no_such_package_xyz/model.gguf")


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "a"}\n{"question": "b"}\n', "in.jsonl:2: missing field 'prompt' (--field; fields found: ['question'])"),
    (b'{"prompt": "a"}\n{"prompt": \n', "in.jsonl:2: not valid JSON"),
    ('{"prompt": "é"}\n'.encode("latin-1"), "in.jsonl:1: not UTF-8 text"),
])
def test_rollout_cli_input_errors_are_one_line_before_the_model_loads(tmp_path, content, message):
    """The model path does not exist: reaching the model load would end in its own error instead."""
    (tmp_path / "in.jsonl").write_bytes(content)
    with pytest.raises(SystemExit) as e:
        rollout_main(["--model", str(tmp_path / "no_model"), "--in", str(tmp_path / "in.jsonl"),
                      "--out", str(tmp_path / "out.jsonl")])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_read_jsonl_lines_and_errors(tmp_path):
    """The one JSONL reader every stage uses: rows with their line numbers, one-line errors."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert read_jsonl(str(good)) == [(1, {"a": 1}), (3, {"a": 2})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: not valid JSON \(Expecting value at column 7\)$"):
        read_jsonl(str(bad))
    bad.write_text('{"a": 1}\n\n{"a": "b\n')  # an unclosed string: json's message alone has no position
    with pytest.raises(SystemExit, match=r"bad.jsonl:3: not valid JSON \(Unterminated string starting at column 7\)$"):
        read_jsonl(str(bad))
    listed = tmp_path / "list.jsonl"
    listed.write_text('[1, 2]\n')
    with pytest.raises(SystemExit, match=r"list.jsonl:1: expected a JSON object, got list"):
        read_jsonl(str(listed))
    with pytest.raises(SystemExit, match=r"missing.jsonl: file does not exist"):
        read_jsonl(str(tmp_path / "missing.jsonl"))
    # not UTF-8: a UTF-16 export (its BOM on line 1), a Latin-1 byte on line 2 (was a traceback)
    wide = tmp_path / "utf16.jsonl"
    wide.write_bytes('{"a": 1}\n'.encode("utf-16"))
    with pytest.raises(SystemExit, match=r"utf16.jsonl:1: not UTF-8 text \(byte b'\\xff': invalid start byte\); save it as UTF-8$"):
        read_jsonl(str(wide))
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"a": "x"}\n{"a": "café"}\n'.encode("latin-1"))
    with pytest.raises(SystemExit, match=r"latin1.jsonl:2: not UTF-8 text"):
        read_jsonl(str(latin))


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_activation_checkpointing_keeps_shared_prompt_and_numbers(tiny_model_path, checkpointing):
    """Under activation checkpointing (wrap_policy) the use_fast path still runs each group's
    prompt once (the prompt pass un-checkpointed, the completion pass reading a read-only cache),
    and both paths, with or without checkpointing, compute the log-probs and gradients of the
    plain twin without checkpointing."""
    import train
    a, b = [1, 50, 60, 70], [1, 90]
    prompts = [a, a, a, b, b]
    comp = torch.randint(3, 200, (5, 6), generator=torch.Generator().manual_seed(1))
    weights = torch.arange(1.0, 31.0).view(5, 6)
    out = {}
    for mode in ("none", checkpointing):
        for use_fast in (False, True):
            model, tok = load_model(tiny_model_path)
            model = wrap_policy(model, "ddp", 1, torch.device("cpu"), gradient_checkpointing=mode)
            model.train()
            calls = []
            model.register_forward_hook(lambda m, args, kwargs, o: calls.append(kwargs["input_ids"].shape),
                                        with_kwargs=True)
            lp = (fast.completion_logprobs if use_fast else rollout.completion_logprobs)(model, prompts, comp, tok.pad_token_id, temperature=0.7)
            (lp * weights).sum().backward()
            if use_fast:  # the 2 distinct prompts once (less their last token), then the 5 rows: last prompt token + completion
                assert calls == [torch.Size([2, 3]), torch.Size([5, 6])]
            else:  # one pass over [left-padded prompt | completion]
                assert calls == [torch.Size([5, 4 + 6])]
            out[mode, use_fast] = (lp.detach(), [p.grad.clone() for p in model.parameters()])
    assert rollout.checkpointed_modules(model)
    ref_lp, ref_grads = out["none", False]
    for key, (lp, grads) in out.items():
        assert torch.allclose(lp, ref_lp, atol=1e-5), key
        for g1, g0 in zip(grads, ref_grads):  # float32 summation order
            assert (g1 - g0).abs().max() <= 2e-5 * g0.abs().max(), key
    # checkpointing replays the same computation: same path, same rounding
    for use_fast in (False, True):
        assert torch.allclose(out[checkpointing, use_fast][0], out["none", use_fast][0], atol=1e-6)
        for g1, g0 in zip(out[checkpointing, use_fast][1], out["none", use_fast][1]):
            assert (g1 - g0).abs().max() <= 1e-6 * g0.abs().max()
    # the cache of the completion pass is read-only: the prompt's keys keep their length
    cache, _, _ = fast.prefill(model, [a, b], [3, 2], tok.pad_token_id)
    ro = fast.read_only_cache(cache)
    k, v = ro.layers[0].update(torch.zeros(5, 2, 6, 16), torch.zeros(5, 2, 6, 16), 0)
    assert k.shape[2] == 4 + 6 and ro.get_seq_length() == 4
