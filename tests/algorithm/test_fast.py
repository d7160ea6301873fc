"""The fast paths (fast.py) against their plain twins: the same values, and gradients where there
are any (docs/method.md §4.4). train.fast_paths switches every pass of a step between the two
(train.fast_or_plain); each fast function's docstring names the test here that pins it."""
import copy
import math

import pytest
import torch

from conftest import update_policy
import fast
import reward as R
import rollout
from test_remote_evaluator import fake_evaluator, fake_server, fake_yes
from test_rollout import _small_vocab_model
from test_train import _layout_batch, _layout_cfg, other_model_path
import train as T

from plumbing.models import load_model
from plumbing.scale import wrap_policy
from plumbing.evaluators import score_remote


def test_clip_grad_norm_is_accurate_on_long_cpu_tensors():
    """The global norm sqrt(sum_i g_i^2) (what clipping divides by) within 1e-6 of float64, also for
    a 33M-element gradient (float32 norms of one long CPU tensor drift: ~1e-3 at this size); then
    clipping to max_norm = E/2 scales every gradient by (E/2) / (E + 1e-6) (torch's eps)."""
    torch.manual_seed(0)
    long = torch.nn.Parameter(torch.zeros(1 << 25))
    short = torch.nn.Parameter(torch.zeros(3))
    long.grad = torch.randn(1 << 25) * 1e-5
    short.grad = torch.tensor([3e-3, -4e-3, 12e-3])  # 3-4-12-13: norm 0.013
    policy = torch.nn.ParameterList([long, short])
    exact = float((long.grad.double().pow(2).sum() + 0.013 ** 2) ** 0.5)
    assert fast.clip_grad_norm(policy, 0.0) == pytest.approx(exact, rel=1e-6)
    assert short.grad.tolist() == pytest.approx([3e-3, -4e-3, 12e-3])  # measure only: unchanged
    assert fast.clip_grad_norm(policy, exact / 2) == pytest.approx(exact, rel=1e-6)
    coef = (exact / 2) / (exact + 1e-6)
    assert short.grad.tolist() == pytest.approx([3e-3 * coef, -4e-3 * coef, 12e-3 * coef], rel=1e-6)
    clipped = float((long.grad.double().pow(2).sum() + short.grad.double().pow(2).sum()) ** 0.5)
    assert clipped == pytest.approx(exact * coef, rel=1e-6)


def _grm_batch(tok):
    """Two groups of 2 GRM prompts (RM-NLHF's pairwise prompt, ~100+ tokens) with random completions."""
    import reward as R
    g = torch.Generator().manual_seed(1)
    items = [{"context": "What is 2+3?", "response_a": "5", "response_b": "6"},
             {"context": "Name a prime number larger than ten.", "response_a": "12", "response_b": "13"}]
    prompts = [R.grm_prompt_ids(tok, it, True, max_lines=4, style="ours") for it in items for _ in range(2)]
    comp = torch.randint(3, 200, (4, 6), generator=g)
    mask = torch.tensor([[1.0] * 6, [1.0] * 3 + [0.0] * 3, [1.0] * 4 + [0.0] * 2, [1.0] * 6])
    return {"prompt_ids": prompts, "completion_ids": comp, "completion_mask": mask,
            "advantages": torch.tensor([1.0, -1.0, 0.7, -0.7])}


def _update(model_path, cfg, batch, ref_path=None, checkpointing="none"):
    """One update_policy call with SGD(lr=1) (update = -grad); returns loss, grad norm, delta."""
    torch.manual_seed(0)
    policy, tok = load_model(model_path)
    before = torch.cat([p.detach().flatten().clone() for p in policy.parameters()])
    model = wrap_policy(policy, "ddp", 1, torch.device("cpu"), gradient_checkpointing=checkpointing)
    ref = load_model(ref_path)[0].eval().requires_grad_(False) if ref_path else None
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    upd = update_policy(model, policy, opt, batch, cfg, world=1, device=torch.device("cpu"), pad_id=tok.pad_token_id,
                          ref_model=ref)
    delta = torch.cat([p.detach().flatten() for p in policy.parameters()]) - before
    return {"loss": upd["loss"], "grad_norm": upd["grad_norms"][-1], "delta": delta}


@pytest.mark.parametrize("case", ["cispo", "cispo_off_policy", "grpo_kl", "grpo_kl_grm", "full", "selective"])
def test_update_passes_fast_equal_plain(tiny_model_path, other_model_path, case):
    """Every pass of the update through the fast paths (shared prompt pass, read-only cache,
    closed-form log-prob backward, chunked norm) gives what the plain twins give (one forward over
    prompt + completion per row, log_softmax + gather, clip_grad_norm_): the policy pass with
    gradient; the behaviour pass (off-policy: 2 updates per batch); the GRPO reference pass
    (kl_coef 1 so that the KL term weighs); the RM-NLHF GRM pass; under activation checkpointing."""
    cfg = _layout_cfg(2, "seq_sum")
    batch, ref = _layout_batch(), None
    if case == "cispo_off_policy":
        cfg["algo"]["updates_per_batch"] = 2
    if case.startswith("grpo"):
        cfg["algo"].update(loss="grpo", kl_coef=1.0, aggregation="token_mean", advantage_std=True)
        ref = other_model_path
    if case == "grpo_kl_grm":
        batch = _grm_batch(load_model(tiny_model_path)[1])
    checkpointing = case if case in ("full", "selective") else "none"
    cfg["optim"]["grad_clip"] = 1e-3  # clipping active: the norm itself is compared through the update
    fast_run = _update(tiny_model_path, cfg, batch, ref, checkpointing)
    plain = _update(tiny_model_path, copy.deepcopy(cfg) | {"train": dict(cfg["train"], fast_paths=False)}, batch, ref,
                    checkpointing)
    assert fast_run["delta"].abs().max() > 1e-6  # a real update
    assert fast_run["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-6)
    assert fast_run["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert (fast_run["delta"] - plain["delta"]).abs().max().item() < 1e-6 + 1e-4 * plain["delta"].abs().max().item()


def test_clip_grad_norm_fast_equals_plain():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1 << 18, 7)]
    grads = [torch.randn(1 << 18) * 1e-3, torch.randn(7)]
    norms = []
    for use_fast in (True, False):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norms.append((fast.clip_grad_norm if use_fast else T.clip_grad_norm)(torch.nn.ParameterList(params), 0.5))
        clipped = [p.grad.clone() for p in params]
        norms.append(clipped)
    assert norms[0] == pytest.approx(norms[2], rel=1e-6)
    for a, b in zip(norms[1], norms[3]):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)


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


HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# fast.ONEDNN as this CPU sets it, and on: the oneDNN linears run in the tests on any CPU
ONEDNN_CASES = sorted({fast.ONEDNN, True}) if HAS_ONEDNN else [False]


@pytest.mark.skipif(not HAS_ONEDNN, reason="torch built without oneDNN")
@pytest.mark.parametrize("shape", [(7, 5, 3), (2, 4, 33, 17), (1, 1, 1)])
@pytest.mark.parametrize("bias, transposed", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dw_chunk", [1 << 20, 16])  # 16: d W in chunks of 2 rows, one left over
def test_onednn_linear_equals_plain(shape, bias, transposed, dw_chunk, monkeypatch):
    """_OneDNNLinear (fast.linear where fast.ONEDNN holds) == F.linear, values and gradients w.r.t.
    x, W and b. Both sum the same float32 products in different orders: each entry of an
    n-term dot product then differs by at most 2 n u sum_i |a_i b_i| (u = 2^-24, the two
    orders' rounding bounds added), the bound checked entry by entry, on any CPU."""
    monkeypatch.setattr(fast, "DW_CHUNK_FLOATS", dw_chunk)
    *lead, d_in, d_out = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, d_in, generator=gen)
    w = torch.randn(d_in, d_out, generator=gen).t() if transposed else torch.randn(d_out, d_in, generator=gen)
    b = torch.randn(d_out, generator=gen) if bias else None
    g = torch.randn(*lead, d_out, generator=gen)
    out = {}
    for name, fn in (("plain", torch.nn.functional.linear), ("onednn", fast._OneDNNLinear.apply)):
        leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
        y = fn(leaves[0], leaves[1], leaves[2] if bias else None)
        y.backward(g)
        out[name] = [y.detach()] + [t.grad for t in leaves]
    u = 2.0 ** -24
    x2, g2 = x.reshape(-1, d_in), g.reshape(-1, d_out)
    bounds = [2 * (d_in + bias) * u * (x.abs() @ w.abs().t() + (b.abs() if bias else 0)),  # y = x W^T + b
              2 * d_out * u * (g.abs() @ w.abs()),                                       # dx = g W
              2 * x2.shape[0] * u * (g2.abs().t() @ x2.abs())]                            # dW = g^T x
    if bias:
        bounds.append(2 * x2.shape[0] * u * g2.abs().sum(0))                              # db = sum_rows g
    for plain, onednn, bound in zip(out["plain"], out["onednn"], bounds):
        assert onednn.shape == plain.shape
        assert ((onednn - plain).abs() <= bound + 1e-30).all()


def test_onednn_linear_layers_swaps_and_restores(tiny_model_path, monkeypatch):
    """Inside the block every nn.Linear of the model computes with fast.linear (its forward set on
    the instance), after it the class's forward again; with ONEDNN off, or under grad with
    activation checkpointing on, nothing is swapped."""
    model, _ = load_model(tiny_model_path)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears
    for on in (True, False):
        monkeypatch.setattr(fast, "ONEDNN", on)
        with fast.onednn_linear_layers(model):
            assert all(("forward" in m.__dict__) == on for m in linears)
            with fast.onednn_linear_layers(model):  # nested: the inner block leaves the outer's alone
                pass
            assert all(("forward" in m.__dict__) == on for m in linears)
        assert not any("forward" in m.__dict__ for m in linears)
    model = wrap_policy(model, "ddp", 1, torch.device("cpu"), gradient_checkpointing="full")
    monkeypatch.setattr(fast, "ONEDNN", True)
    with fast.onednn_linear_layers(model):
        assert not any("forward" in m.__dict__ for m in linears)
    with torch.no_grad(), fast.onednn_linear_layers(model):  # no replay without grad: swapped
        assert all("forward" in m.__dict__ for m in linears)


@pytest.mark.parametrize("onednn", ONEDNN_CASES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("grad", [False, True])
def test_completion_logprobs_fast_equals_plain(tiny_model_path, grad, layout, onednn, monkeypatch):
    """completion_logprobs (each group's prompt run once) == completion_logprobs_plain (every row
    runs its own prompt), values and gradients of the parameters; with the oneDNN linears too."""
    monkeypatch.setattr(fast, "ONEDNN", onednn)
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


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_activation_checkpointing_keeps_shared_prompt_and_numbers(tiny_model_path, checkpointing):
    """Under activation checkpointing (wrap_policy) the use_fast path still runs each group's
    prompt once (the prompt pass un-checkpointed, the completion pass reading a read-only cache),
    and both paths, with or without checkpointing, compute the log-probs and gradients of the
    plain twin without checkpointing."""
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
    # checkpointing replays the same computation: same path, same rounding. Except the fast path
    # where fast.ONEDNN holds (an AMD CPU): without checkpointing its linears multiply on oneDNN,
    # with it on torch's own matmul (fast.onednn_linear_layers), so float32 summation order as above.
    for use_fast in (False, True):
        atol, rtol = (1e-5, 2e-5) if use_fast and fast.ONEDNN else (1e-6, 1e-6)
        assert torch.allclose(out[checkpointing, use_fast][0], out["none", use_fast][0], atol=atol)
        for g1, g0 in zip(out[checkpointing, use_fast][1], out["none", use_fast][1]):
            assert (g1 - g0).abs().max() <= rtol * g0.abs().max()
    # the cache of the completion pass is read-only: the prompt's keys keep their length
    cache, _, _ = fast.prefill(model, [a, b], [3, 2], tok.pad_token_id)
    ro = fast.read_only_cache(cache)
    k, v = ro.layers[0].update(torch.zeros(5, 2, 6, 16), torch.zeros(5, 2, 6, 16), 0)
    assert k.shape[2] == 4 + 6 and ro.get_seq_length() == 4


def test_batched_requests_equal_one_request_per_prompt(fake_server):
    fulls = [(f"Problem {i} {'x' * i}\nAnswer: Yes", " Yes") for i in range(7)]
    ev = fake_evaluator(fake_server, batch_size=3, concurrency=2)
    fast_out = fast.score_remote(ev["remote"], fulls)
    assert sorted(len(p) for p in fake_server.requests) == [1, 3, 3]  # 3 requests for 7 prompts
    fake_server.requests.clear()
    plain = score_remote(ev["remote"], fulls)
    assert len(fake_server.requests) == 7
    assert fast_out == plain and plain[0] == [fake_yes(f) for f, _ in fulls]


@pytest.fixture(scope="module")
def frozen_evaluator_path(tmp_path_factory):
    """A second tiny model, differently seeded: a frozen evaluator that is not the policy."""
    from conftest import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_evaluator"), seed=1)


@pytest.mark.parametrize("which", ["policy", "frozen_evaluator"])
def test_score_targets_fast_equals_plain_tiny(tiny_model_path, frozen_evaluator_path, which):
    """score_targets' stages A (group prefix) + B (sample prefix) + C (K suffixes) ==
    score_targets_plain (one forward per prompt + target), with uneven groups and prompt lengths,
    a group split across micro-batches, identical solutions in a group, K = 2 questions and
    multi-token targets; on the policy and on a differently-seeded frozen evaluator."""
    model, tok = load_model(tiny_model_path if which == "policy" else frozen_evaluator_path)
    model.eval()
    problem = {0: [1, 11, 12, 13, 14, 15], 1: [1, 21, 22]}
    sols = [[40, 41, 42], [40, 43], [40, 41, 42], [50, 51, 52, 53], [60]]
    keys = [0, 0, 0, 1, 1]
    tails = [[7, 8], [7, 9, 9]]
    prompts = [[problem[g] + s + t for t in tails] for g, s in zip(keys, sols)]
    targets = [[[30], [31, 32]] for _ in sols]
    plain = R.score_targets(model, prompts, targets, tok.pad_token_id)
    assert plain.shape == (5, 2) and plain.dtype == torch.float32 and plain.device.type == "cpu"
    assert torch.equal(R.score_targets(model, prompts, targets, tok.pad_token_id, groups=keys), plain)
    for mb in (2, 5):
        for groups in (keys, None):
            fast_lp = fast.score_targets(model, prompts, targets, tok.pad_token_id, micro_batch_size=mb, groups=groups)
            assert torch.allclose(fast_lp, plain, atol=1e-5), (mb, groups, fast_lp, plain)
    # the plain twin by hand for one entry: log p(31 | prompt) + log p(32 | prompt, 31)
    with torch.no_grad():
        ids = torch.tensor([prompts[3][1] + [31, 32]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
    n = len(prompts[3][1])
    assert plain[3, 1].item() == pytest.approx((logp[n - 1, 31] + logp[n, 32]).item(), abs=1e-5)


def test_rlme_reward_fast_equals_plain_tiny(tiny_model_path, frozen_evaluator_path):
    """Evaluators built on fast.score_targets and on reward.score_targets give rlme_reward the same
    log-probs and rewards (shared-prefix scoring vs one forward per (prompt + target) row); two
    evaluators (one a chat-template one), K = 2 questions, a multi-token target, groups of samples
    per problem."""
    evs = {True: [], False: []}
    for path, chat, weight in ((tiny_model_path, False, 1.0), (frozen_evaluator_path, True, 0.5)):
        model, tok = load_model(path)
        for use_fast in (True, False):
            evs[use_fast].append(R.local_evaluator(model.eval(), tok, chat=chat, name=path, weight=weight,
                                                   micro_batch_size=3,
                                                   score=fast.score_targets if use_fast else R.score_targets))
    mq = [{"question": "Is the answer correct?", "weight": 1.0, "target": "Yes"},
          {"question": "Is the final answer boxed?", "weight": 0.5, "target": "Yes, it is"}]
    problems = ["What is 2+3?", "What is 2+3?", "What is 2+3?", "What is 7*6?"]
    solutions = [r"2 + 3 = 5, so \boxed{5}.", r"\boxed{6}", "", "7*6 = 42"]
    fast_out = R.rlme_reward(evs[True], mq, problems, solutions)
    plain = R.rlme_reward(evs[False], mq, problems, solutions)
    assert torch.allclose(fast_out["logp"], plain["logp"], atol=1e-5)
    assert torch.allclose(fast_out["reward"], plain["reward"], atol=1e-5)


# --- chunked log-probs (train.logprob_chunk_tokens): the LM head over chunks of positions -----------

@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 12])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_logprobs_equal_plain(chunk, temperature, bias):
    """fast.head_logprobs (chunks of `chunk` of the N x L = 12 positions; 5 and 7 do not divide it)
    == the LM head then rollout.token_logprobs: values, and gradients w.r.t. the hidden states, the
    head's weight and bias, under a completion mask (masked positions get no gradient); the K = L + 1
    kept column past L holds 0 and gets no gradient. Reference by hand for one position:
    log p = z_y - log sum exp(z)."""
    g = torch.Generator().manual_seed(0)
    n, length, d, v = 3, 4, 8, 11
    hidden = torch.randn(n, length + 1, d, generator=g, requires_grad=True)
    weight = torch.randn(v, d, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n, length), generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    up = torch.arange(1.0, 13.0).view(n, length) * mask  # the upstream gradient of a masked loss
    out = {}
    for chunked in (False, True):
        params = [hidden, weight] + ([b] if bias else [])
        for p in params:
            p.grad = None
        if chunked:
            lp = fast.head_logprobs(hidden, weight, b, targets, temperature=temperature, chunk_tokens=chunk)
            assert lp.shape == (n, length + 1) and torch.equal(lp[:, -1], torch.zeros(n))
            lp = lp[:, :length]
        else:
            logits = torch.nn.functional.linear(hidden, weight, b)[:, :length]
            lp = rollout.token_logprobs(logits, targets, temperature)
        (lp * up).sum().backward()
        out[chunked] = (lp.detach(), [p.grad.clone() for p in params])
    z = (torch.nn.functional.linear(hidden[1, 0], weight, b) / temperature).detach()
    assert out[True][0][1, 0].item() == pytest.approx((z[targets[1, 0]] - torch.logsumexp(z, 0)).item(), abs=1e-5)
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    for g1, g0 in zip(out[True][1], out[False][1]):
        assert torch.allclose(g1, g0, atol=1e-5, rtol=1e-5)
    dh = out[True][1][0]
    assert torch.equal(dh[:, -1], torch.zeros(n, d)) and torch.equal(dh[2, 1:], torch.zeros(length, d))


def test_chunked_logprobs_bf16_autocast_equal_plain():
    """Under bf16 autocast the chunks compute in bf16 as the head's own F.linear would (the same
    values up to bf16 rounding), and the gradients keep their inputs' dtypes (float32 weight)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (2, 6), generator=g)
    out = {}
    for chunked in (False, True):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunked:
                lp = fast.head_logprobs(hidden, weight, None, targets, temperature=0.7, chunk_tokens=5)
            else:
                lp = rollout.token_logprobs(torch.nn.functional.linear(hidden, weight), targets, 0.7)
        assert lp.dtype == torch.float32
        (lp * torch.arange(1.0, 13.0).view(2, 6)).sum().backward()
        out[chunked] = (lp.detach(), hidden.grad.clone(), weight.grad.clone())
    assert weight.grad.dtype == torch.float32
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)  # the same bf16 matmul rows
    for g1, g0 in zip(out[True][1:], out[False][1:]):  # dW: bf16 per chunk summed in float32 vs one bf16 product
        assert (g1 - g0).abs().max() <= 2e-2 * g0.abs().max()


@pytest.mark.parametrize("layout", ["groups", "no_sharing"])
@pytest.mark.parametrize("chunk", [4, 7, 30])
def test_chunked_completion_logprobs_equal_plain_tiny(tiny_model_path, layout, chunk):
    """fast.completion_logprobs(chunk_tokens=c) through the tiny model (both of its paths: the shared
    prompt pass and the one-pass fallback) == rollout.completion_logprobs: values and every
    parameter's gradient (the tied embedding / LM head included) under a completion mask. chunk 30 =
    all 6 x 5 positions: one chunk, so the unchunked closed form runs (no recompute), same numbers.
    While the chunked head runs, no [N, L, V] logits exist: the model hands back [N, L] log-probs."""
    model, tok = load_model(tiny_model_path)
    prompts = LAYOUTS[layout]
    comp = torch.randint(3, 200, (6, 5), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 5, 2, 4])[:, None]).float()
    shapes = []
    model.register_forward_hook(lambda m, a, o: shapes.append(tuple(o.logits.shape)))
    out = {}
    for use_fast in (False, True):
        model.zero_grad()
        shapes.clear()
        if use_fast:
            lp = fast.completion_logprobs(model, prompts, comp, tok.pad_token_id, temperature=0.7, chunk_tokens=chunk)
        else:
            lp = rollout.completion_logprobs(model, prompts, comp, tok.pad_token_id, temperature=0.7)
        (lp * torch.arange(1.0, 31.0).view(6, 5) * mask).sum().backward()
        out[use_fast] = (lp.detach() * mask, [p.grad.clone() for p in model.parameters()])
        if use_fast and chunk < 30:  # the completion pass's "logits" are the log-probs (K = L, or L + 1 kept)
            assert shapes[-1] in ((6, 5), (6, 6))
    assert model.get_output_embeddings().__dict__.get("forward") is None  # the head's forward restored
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    for g1, g0 in zip(out[True][1], out[False][1]):
        assert (g1 - g0).abs().max() <= 2e-5 * g0.abs().max()


def test_fast_or_plain_binds_the_chunk_size():
    """train.logprob_chunk_tokens reaches the fast log-probs (train.fast_or_plain); the plain twin
    has no chunking (it is the full-logits computation the chunked one is checked against)."""
    assert T.fast_or_plain(True, 512)["completion_logprobs"].keywords == {"chunk_tokens": 512}
    assert T.fast_or_plain(False, 512)["completion_logprobs"] is rollout.completion_logprobs


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_prompt_pass_is_checkpointed_too(tiny_model_path, checkpointing):
    """Issue 26: under model.gradient_checkpointing the shared prompt pass (fast.prefill) is
    checkpointed as well: a decoder layer's attention runs for the 2 distinct prompts [2, 3]
    once in forward and once more in backward's replay (before: once, never replayed), the 5 rows'
    completion pass [5, 6] twice as before; the log-probs and gradients stay the plain twin's
    without checkpointing."""
    a, b = [1, 50, 60, 70], [1, 90, 91, 92]
    prompts = [a, a, a, b, b]
    comp = torch.randint(3, 200, (5, 6), generator=torch.Generator().manual_seed(2))
    weights = torch.arange(1.0, 31.0).view(5, 6)
    out = {}
    for mode, use_fast in (("none", False), (checkpointing, True)):
        model, tok = load_model(tiny_model_path)
        model = wrap_policy(model, "ddp", 1, torch.device("cpu"), gradient_checkpointing=mode)
        model.train()
        shapes = []
        model.model.layers[0].self_attn.register_forward_hook(
            lambda m, args, kwargs, o: shapes.append(tuple(kwargs["hidden_states"].shape[:2])), with_kwargs=True)
        lp = (fast.completion_logprobs if use_fast else rollout.completion_logprobs)(model, prompts, comp, tok.pad_token_id)
        (lp * weights).sum().backward()
        out[use_fast] = (lp.detach(), [p.grad.clone() for p in model.parameters()], shapes)
    lp0, g0s, _ = out[False]
    lp1, g1s, shapes = out[True]
    assert sorted(shapes) == [(2, 3), (2, 3), (5, 6), (5, 6)]  # prompt replayed in backward
    assert torch.allclose(lp1, lp0, atol=1e-5)
    for g1, g0 in zip(g1s, g0s):
        assert (g1 - g0).abs().max() <= 2e-5 * g0.abs().max()
