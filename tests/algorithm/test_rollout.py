"""rollout.py: masks with pad == EOS, temperature-scaled log-probs, padding-invariant forwards."""
import math

import pytest
import torch

import fast
import rollout

from plumbing.models import load_model


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




def test_autocast_takes_a_name_or_a_torch_dtype():
    """rollout.autocast (metarm.forward's and the update's mixed precision) takes "bfloat16" or
    torch.bfloat16 alike (a copied MetaRM loss handed torch.bfloat16 raised KeyError); float32 is
    no autocast at all; anything else is a one-line ValueError."""
    for dtype in ("bfloat16", torch.bfloat16):
        with rollout.autocast(dtype, "cpu"):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for dtype in ("float32", torch.float32):
        with rollout.autocast(dtype, "cpu"):
            assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        rollout.autocast("fp8", "cpu")
