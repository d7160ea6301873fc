"""rollout.py: masks with pad == EOS, temperature-scaled log-probs, padding-invariant forwards."""
import math

import pytest
import torch

import rollout


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


def test_token_logprobs_temperature_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    target = torch.tensor([2])
    # T = 2: logits/2 = [0.5, 1, 1.5]; log p(2) = 1.5 - log(e^0.5 + e^1 + e^1.5)
    expected = 1.5 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    assert rollout.token_logprobs(logits, target, temperature=2.0).item() == pytest.approx(expected, abs=1e-6)
    # T = 1 is the plain log-softmax
    expected1 = 3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert rollout.token_logprobs(logits, target).item() == pytest.approx(expected1, abs=1e-6)


def test_token_logprobs_gradient_by_hand():
    # d log softmax(z)[t] / d logits = (onehot(t) - softmax(z)) / T with z = logits / T.
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    rollout.token_logprobs(logits, torch.tensor([2]), temperature=2.0).sum().backward()
    e = [math.exp(0.5), math.exp(1.0), math.exp(1.5)]
    p = [x / sum(e) for x in e]
    expected = [(-p[0]) / 2, (-p[1]) / 2, (1 - p[2]) / 2]
    assert logits.grad[0].tolist() == pytest.approx(expected, abs=1e-7)
    assert logits.tolist() == [[1.0, 2.0, 3.0]]  # the caller's leaf is not overwritten


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_closed_form_backward_equals_autograd(temperature):
    # The hand-written backward (rollout._TokenLogprob) against autograd's log_softmax + gather, on
    # a non-contiguous view of an intermediate tensor (as completion_logprobs passes logits[:, :-1])
    # with an upstream weight, so the in-place backward path is the one exercised.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 4), generator=g)
    upstream = torch.randn(3, 4, generator=g)

    def run(fn):
        w.grad = None
        logits = (w * 3.0)[:, :-1]  # [3, 4, 50] view of a non-leaf
        lp = fn(logits)
        (lp * upstream).sum().backward()
        return lp.detach(), w.grad.clone()

    ours, ours_grad = run(lambda z: rollout.token_logprobs(z, targets, temperature))
    ref, ref_grad = run(lambda z: torch.log_softmax(z / temperature, -1).gather(-1, targets[..., None]).squeeze(-1))
    assert torch.allclose(ours, ref, atol=1e-6) and torch.allclose(ours_grad, ref_grad, atol=1e-6)
    assert ours_grad.abs().sum() > 0


def test_left_pad_and_positions():
    ids, mask = rollout.left_pad([[7, 8, 9], [5]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert rollout.positions_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_completion_logprobs_ignore_padding(tiny_model_path):
    """A row's log-probs must not depend on how much left padding its batch needed."""
    model, tok = rollout.load_model(tiny_model_path)
    model.eval()
    short, long = [1, 50, 60], [1, 50, 60, 70, 80, 90, 100]
    comp = torch.tensor([[11, 12, 13, 2], [21, 22, 2, 2]])
    with torch.no_grad():
        both = rollout.completion_logprobs(model, [short, long], comp, tok.pad_token_id, temperature=0.7)
        alone = rollout.completion_logprobs(model, [short], comp[:1], tok.pad_token_id, temperature=0.7)
        # the same thing by hand: one unpadded forward, logits / T, log-softmax
        full = torch.tensor([short + comp[0].tolist()])
        logits = model(input_ids=full).logits[0, len(short) - 1:-1] / 0.7
        manual = torch.log_softmax(logits, -1).gather(-1, comp[0][:, None]).squeeze(-1)
    assert torch.allclose(both[0], alone[0], atol=1e-5)
    assert torch.allclose(alone[0], manual, atol=1e-5)


def test_generate_groups_masks_and_seed(tiny_model_path):
    model, tok = rollout.load_model(tiny_model_path)
    prompts = [[1, 50, 60], [1, 70]]
    a = rollout.generate(model, tok, prompts, group_size=3, max_new_tokens=6, seed=123)
    b = rollout.generate(model, tok, prompts, group_size=3, max_new_tokens=6, seed=123)
    c = rollout.generate(model, tok, prompts, group_size=3, max_new_tokens=6, seed=124)
    assert a["prompt_ids"] == [prompts[0]] * 3 + [prompts[1]] * 3  # groups are adjacent rows
    assert a["completion_ids"].shape[0] == 6 and a["completion_ids"].shape[1] <= 6
    assert torch.equal(a["completion_ids"], b["completion_ids"])      # same seed, same samples
    assert not torch.equal(a["completion_ids"], c["completion_ids"])  # per-rank/step seeds differ
    mask, trunc = rollout.completion_mask(a["completion_ids"], rollout.eos_ids(model, tok))
    assert torch.equal(mask, a["completion_mask"]) and torch.equal(trunc, a["truncated"])


def test_prompt_runs():
    a, b = [1, 5], [1, 6]
    assert rollout.prompt_runs([a, a, a, b, b, a]) == ([a, b, a], [3, 2, 1])
    assert rollout.prompt_runs([a]) == ([a], [1])


def _draw(probs, n, seed=0, **kw):
    logits = torch.log(torch.tensor(probs)).expand(n, -1)
    g = torch.Generator().manual_seed(seed)
    return rollout.sample_next(logits, kw.pop("temperature", 1.0), kw.pop("top_p", 1.0), kw.pop("top_k", 0), g)


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


def test_greedy_generate_matches_transformers(tiny_model_path):
    """Our decode loop (shared prefill, static cache, left padding, group split across decode
    batches) picks exactly the tokens transformers' generate picks."""
    model, tok = rollout.load_model(tiny_model_path)
    prompts = [[1, 50, 60, 70, 80], [1, 90]]
    ours = rollout.generate(model, tok, prompts, group_size=3, max_new_tokens=8, temperature=0.0,
                            micro_batch_size=4)
    ids, attn = rollout.left_pad(prompts, tok.pad_token_id)
    hf = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=8, do_sample=False,
                        pad_token_id=tok.pad_token_id, eos_token_id=rollout.eos_ids(model, tok))[:, ids.shape[1]:]
    hf = torch.nn.functional.pad(hf, (0, 8 - hf.shape[1]), value=tok.pad_token_id).repeat_interleave(3, dim=0)
    mask = ours["completion_mask"].bool()
    assert torch.equal(ours["completion_ids"][:, :8][mask], hf[:, :ours["completion_ids"].shape[1]][mask])


@torch.no_grad()
def test_decode_cache_logits_equal_full_forward(tiny_model_path):
    """Decoding token by token into rollout.decode_cache (attention over the filled part only, left
    padding masked) gives the logits of one full forward over prompt + continuation."""
    model, tok = rollout.load_model(tiny_model_path)
    ids, attn = rollout.left_pad([[1, 50, 60, 70, 80], [1, 90]], tok.pad_token_id)
    cont = torch.tensor([[11, 12, 13], [21, 22, 23]])
    full_attn = torch.cat([attn, torch.ones_like(cont)], dim=1)
    ref = model(input_ids=torch.cat([ids, cont], dim=1), attention_mask=full_attn,
                position_ids=rollout.positions_from_mask(full_attn)).logits[:, ids.shape[1]:]  # [2, 3, V]
    cache = rollout.decode_cache(model.config, max_cache_len=ids.shape[1] + 3)
    model(input_ids=ids, attention_mask=attn, position_ids=rollout.positions_from_mask(attn), cache=cache, use_cache=True)
    pos = rollout.positions_from_mask(attn)[:, -1:]
    for t in range(3):
        attn, pos = torch.cat([attn, torch.ones(2, 1, dtype=attn.dtype)], dim=1), pos + 1
        out = model(input_ids=cont[:, t:t + 1], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        assert torch.allclose(out.logits[:, -1], ref[:, t], atol=1e-5)
    assert cache.layers[0].keys.shape[2] == ids.shape[1] + 3  # preallocated once, not grown


@pytest.mark.parametrize("grad", [False, True])
def test_shared_prompt_logprobs_equal_per_row(tiny_model_path, grad):
    """completion_logprobs running each group's prompt once == every row running its own prompt,
    values and gradients (unequal groups, unequal prompt lengths)."""
    model, tok = rollout.load_model(tiny_model_path)
    a, b, c = [1, 50, 60, 70], [1, 90], [1, 33, 44]
    prompts = [a, a, a, b, c, c]
    comp = torch.randint(3, 200, (6, 5), generator=torch.Generator().manual_seed(0))
    out = {}
    for share in (False, True):
        model.zero_grad()
        with torch.set_grad_enabled(grad):
            lp = rollout.completion_logprobs(model, prompts, comp, tok.pad_token_id, 0.7, share_prompt=share)
        if grad:
            (lp * torch.arange(1.0, 31.0).view(6, 5)).sum().backward()
        out[share] = (lp.detach(), [p.grad.clone() for p in model.parameters()] if grad else [])
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    for g1, g0 in zip(out[True][1], out[False][1]):  # float32 summation order: ~5e-6 of the largest entry
        assert (g1 - g0).abs().max() <= 2e-5 * g0.abs().max()


def test_model_path_errors(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        rollout.resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(SystemExit, match="without config.json"):
        rollout.resolve_model_path(str(tmp_path))
    with pytest.raises(SystemExit, match="not installed"):
        rollout.resolve_model_path("gguf:no_such_package_xyz/model.gguf")


def test_read_jsonl_lines_and_errors(tmp_path):
    """The one JSONL reader every stage uses: rows with their line numbers, one-line errors."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert rollout.read_jsonl(str(good)) == [(1, {"a": 1}), (3, {"a": 2})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: not valid JSON \(Expecting value at column 7\)$"):
        rollout.read_jsonl(str(bad))
    bad.write_text('{"a": 1}\n\n{"a": "b\n')  # an unclosed string: json's message alone has no position
    with pytest.raises(SystemExit, match=r"bad.jsonl:3: not valid JSON \(Unterminated string starting at column 7\)$"):
        rollout.read_jsonl(str(bad))
    listed = tmp_path / "list.jsonl"
    listed.write_text('[1, 2]\n')
    with pytest.raises(SystemExit, match=r"list.jsonl:1: expected a JSON object, got list"):
        rollout.read_jsonl(str(listed))
    with pytest.raises(SystemExit, match=r"missing.jsonl: file does not exist"):
        rollout.read_jsonl(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_activation_checkpointing_keeps_shared_prompt_and_numbers(tiny_model_path, checkpointing):
    """Under activation checkpointing (train.wrap_policy) the update still runs each group's
    prompt once (the prompt pass un-checkpointed, the completion pass reading a read-only cache)
    and computes the same log-probs and gradients as without checkpointing."""
    import train
    a, b = [1, 50, 60, 70], [1, 90]
    prompts = [a, a, a, b, b]
    comp = torch.randint(3, 200, (5, 6), generator=torch.Generator().manual_seed(1))
    weights = torch.arange(1.0, 31.0).view(5, 6)
    out = {}
    for mode in ("none", checkpointing):
        model, tok = rollout.load_model(tiny_model_path)
        model = train.wrap_policy(model, "ddp", 1, torch.device("cpu"), gradient_checkpointing=mode)
        model.train()
        calls = []
        model.register_forward_hook(lambda m, args, kwargs, o: calls.append(kwargs["input_ids"].shape), with_kwargs=True)
        lp = rollout.completion_logprobs(model, prompts, comp, tok.pad_token_id, 0.7, share_prompt=True)
        (lp * weights).sum().backward()
        # the 2 distinct prompts once (less their last token), then the 5 rows: last prompt token + completion
        assert calls == [torch.Size([2, 3]), torch.Size([5, 6])]
        out[mode] = (lp.detach(), [p.grad.clone() for p in model.parameters()])
    assert rollout.checkpointed_modules(model)
    assert torch.allclose(out[checkpointing][0], out["none"][0], atol=1e-6)
    for g1, g0 in zip(out[checkpointing][1], out["none"][1]):
        assert (g1 - g0).abs().max() <= 1e-6 * g0.abs().max()
    # the cache of the completion pass is read-only: the prompt's keys keep their length
    cache, _, _ = rollout.prefill(model, [a, b], [3, 2], tok.pad_token_id)
    ro = rollout.read_only_cache(cache)
    k, v = ro.layers[0].update(torch.zeros(5, 2, 6, 16), torch.zeros(5, 2, 6, 16), 0)
    assert k.shape[2] == 4 + 6 and ro.get_seq_length() == 4
