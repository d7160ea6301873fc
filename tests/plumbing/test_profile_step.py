"""scripts/profile_step.py's pure pieces (issue 36): the update's FLOP count, the profiler op ->
category mapping, the "other" arithmetic, the spread of repeated runs and /proc/stat's steal time.
The script itself needs the real model and prints timings; it is run by hand, never timed here."""
import contextlib
import functools
import math
import os
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import profile_step as ps  # noqa: E402

# a tiny Llama shape, by hand: d = 4, 1 layer, 2 query heads x head dim 2, 1 K/V head, MLP 8, V = 10
# per layer: q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate, up, down 3 x 4x8 = 16 + 8 + 8 + 16 + 96 = 144
TINY = dict(layer_params=144, head_params=40, last_layer_params=144, last_kv_params=16, attn_width=4, n_layers=1)


def test_update_flops_by_hand():
    # 2 rows, each 2 new tokens after 3 cached, the head on both: causal pairs 2*3 + (1 + 2) = 9
    #   forward, a row: linear 2*144*2 = 576, head 2*40*2 = 160, attention 4*1*4*9 = 144
    #   backward = 2 x forward: matmul 3 * 2 * (576 + 160) = 4416, attention 3 * 2 * 144 = 864
    assert ps.update_flops([(2, 3, 2, 2, False)], [], **TINY) == {"matmul": 4416, "attention": 864, "total": 5280}
    # plus a no-grad pass (forward only): 1 row, 3 new tokens, head on 4:
    #   2*144*3 + 2*40*4 = 1184, attention pairs 0 + 6: 4*1*4*6 = 96
    assert ps.update_flops([(2, 3, 2, 2, False)], [(1, 0, 3, 4, False)], **TINY) == {
        "matmul": 5600, "attention": 960, "total": 6560}
    # a cache_only pass (the shared prompt) with grad: 1 row, 3 tokens, head on 1 (forward only);
    #   forward 2*144*3 + 2*40*1 = 944, attention 4*1*4*6 = 96;
    #   backward: only the last (= only) layer's K/V weights: 2 * (2 * (144 - 144 + 16) * 3) = 192,
    #   attention of n_layers - 1 = 0 layers: 0
    assert ps.update_flops([(1, 0, 3, 1, True)], [], **TINY) == {"matmul": 944 + 192, "attention": 96, "total": 1232}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def test_matmul_shape_of_a_tiny_llama():
    # per layer: q 16x16 = 256, k, v 16x(2 heads x 4) = 128 each, o 256, gate, up, down 16x32 = 512 each
    assert ps.matmul_shape(tiny_llama()) == {"layer_params": 2 * 2304, "head_params": 64 * 16, "last_layer_params": 2304,
                                             "last_kv_params": 256, "attn_width": 16, "n_layers": 2}


def test_update_passes_by_hand():
    a, b = [1, 2, 3, 4, 5], [6, 7, 8]
    prompts = [a, a, b, b]  # 2 groups of 2
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]).float()  # lengths 3, 1, 2, 0
    kw = dict(updates_per_batch=1, minibatches=1, group_size=2)
    # one micro-batch: 2 distinct prompts, each but its last token (padded to 4) once; 4 rows x width 3
    assert ps.update_passes(prompts, mask, micro_batch_size=4, shared_prompt=True, **kw) == (
        [(2, 0, 4, 1, True), (4, 4, 3, 3, False)], [])
    # micro-batches of 2: one group each, each its own width (the longest masked completion, >= 1)
    assert ps.update_passes(prompts, mask, micro_batch_size=2, shared_prompt=True, **kw) == (
        [(1, 0, 4, 1, True), (2, 4, 3, 3, False), (1, 0, 2, 1, True), (2, 2, 2, 2, False)], [])
    # plain twin: every row runs [prompt padded to 5 | 3], the head on the last 4
    assert ps.update_passes(prompts, mask, micro_batch_size=4, shared_prompt=False, **kw) == ([(4, 0, 8, 4, False)], [])
    # the fast twin falls back to the plain forward when no prompt is shared, or one is a single token
    assert ps.update_passes([a, b], mask[:2], micro_batch_size=4, shared_prompt=True, updates_per_batch=1,
                            minibatches=1, group_size=1) == ([(2, 0, 8, 4, False)], [])
    assert ps.update_passes([[9], [9]], mask[2:], micro_batch_size=4, shared_prompt=True, updates_per_batch=1,
                            minibatches=1, group_size=2) == ([(2, 0, 1 + 2, 3, False)], [])
    # off-policy (2 minibatches of 1 group): the behaviour pass runs the whole batch once, no grad
    assert ps.update_passes(prompts, mask, micro_batch_size=4, shared_prompt=True, updates_per_batch=1,
                            minibatches=2, group_size=2) == (
        [(1, 0, 4, 1, True), (2, 4, 3, 3, False), (1, 0, 2, 1, True), (2, 2, 2, 2, False)],
        [(2, 0, 4, 1, True), (4, 4, 3, 3, False)])


@pytest.mark.parametrize("fast_paths,updates_per_batch,minibatches,micro_batch_size",
                         [(True, 1, 1, 4), (True, 1, 1, 2), (False, 1, 1, 4), (True, 2, 1, 2), (False, 1, 2, 4)])
def test_update_flops_equal_torch_flop_counter(fast_paths, updates_per_batch, minibatches, micro_batch_size):
    """The matmul FLOPs counted from the shape equal torch.utils.flop_counter's count of the
    matrix products train.update_policy really runs on a tiny Llama (integers: exact). (The counter
    has no formula for the CPU flash-attention kernel, so attention is checked by hand above; nor
    for oneDNN's linear, which fast.linear runs on an AMD CPU: ONEDNN_LINEAR_FLOPS.)"""
    from torch.utils.flop_counter import FlopCounterMode

    import fast
    import rollout
    import train
    count_onednn_linears()
    model = tiny_llama()
    prompts = [[1, 2, 3, 4, 5]] * 2 + [[6, 7, 8]] * 2
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]).float()
    batch = {"prompt_ids": prompts, "completion_ids": torch.randint(1, 64, (4, 5)), "completion_mask": mask,
             "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    logprobs = functools.partial(fast.completion_logprobs if fast_paths else rollout.completion_logprobs,
                                 pad_id=0, temperature=1.0)
    loss = functools.partial(train.cispo_loss, eps_low=1.0, eps_high=1.0, ratio="sequence", aggregation="seq_sum")
    with FlopCounterMode(display=False) as counter:
        train.update_policy(model, model, torch.optim.SGD(model.parameters(), lr=0.0), batch, loss_fn=loss,
                            aggregation="seq_sum", max_new_tokens=5, updates_per_batch=updates_per_batch,
                            minibatches=minibatches, group_size=2, micro_batch_size=micro_batch_size, grad_clip=1.0,
                            logprobs=logprobs, clip_grad_norm=fast.clip_grad_norm, context=contextlib.nullcontext,
                            world=1, device=torch.device("cpu"))
    with_grad, no_grad = ps.update_passes(prompts, mask, micro_batch_size=micro_batch_size,
                                          updates_per_batch=updates_per_batch, minibatches=minibatches, group_size=2,
                                          shared_prompt=fast_paths)
    assert ps.update_flops(with_grad, no_grad, **ps.matmul_shape(model))["matmul"] == counter.get_total_flops()


ONEDNN_LINEAR_FLOPS = {}  # registered once: torch.utils.flop_counter refuses a second formula


def count_onednn_linears():
    """Teach torch's FLOP counter oneDNN's linear (fast.linear where fast.ONEDNN holds): x [M, k]
    times W^T, W [n, k], is 2 M k n, as for aten.mm."""
    from torch.utils.flop_counter import register_flop_formula
    if ONEDNN_LINEAR_FLOPS or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return

    @register_flop_formula(torch.ops.mkldnn._linear_pointwise)
    def onednn_linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs):
        return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]
    ONEDNN_LINEAR_FLOPS["registered"] = onednn_linear_flops


AUTOGRAD = "autograd::engine::evaluate_function: "


@pytest.mark.parametrize("chain,category", [
    (["aten::mm"], "matmul"),
    (["aten::t", "aten::linear"], "matmul"),  # a matmul's own bookkeeping ops count with it
    (["aten::mm", "MmBackward0", AUTOGRAD + "MmBackward0"], "matmul"),
    ([AUTOGRAD + "AddmmBackward0"], "matmul"),
    (["mkldnn::_linear_pointwise"], "matmul"),  # oneDNN's linear
    (["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention"], "attention"),
    (["aten::_scaled_dot_product_flash_attention_for_cpu_backward", "ScaledDotProductFlashAttentionForCpuBackward0",
      AUTOGRAD + "ScaledDotProductFlashAttentionForCpuBackward0"], "attention"),
    # SDPA's math fallback runs bmm and softmax inside the attention op: attention, not matmul / sampling
    (["aten::bmm", "aten::matmul", "aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention"],
     "attention"),
    (["aten::_softmax", "aten::softmax", "aten::_scaled_dot_product_attention_math"], "attention"),
    (["aten::_to_copy", "aten::to", "sample_next"], "sampling"),  # inside fast.sample_rows' label
    (["aten::searchsorted", "sample_next"], "sampling"),
    (["aten::multinomial"], "sampling"),  # model.generate's, by name
    (["aten::sort"], "sampling"),
    (["aten::exp_", "_TokenLogprobBackward", AUTOGRAD + "_TokenLogprobBackward"], "logprob_backward"),
    ([AUTOGRAD + "_ChunkedHeadLogprobBackward"], "logprob_backward"),
    # the chunked backward's matmuls (the head's recompute, dh and dW) are matmuls
    (["aten::mm", "aten::linear", "_ChunkedHeadLogprobBackward", AUTOGRAD + "_ChunkedHeadLogprobBackward"], "matmul"),
    (["aten::addmm_", "_ChunkedHeadLogprobBackward"], "matmul"),
    (["aten::_log_softmax_backward_data", "LogSoftmaxBackward0"], "logprob_backward"),  # the plain twin's
    (["aten::_fused_adamw_", "Optimizer.step#AdamW.step"], "optimizer"),
    (["aten::_foreach_mul_", "Optimizer.step#SGD.step"], "optimizer"),
    (["aten::zero_", "Optimizer.zero_grad#AdamW.zero_grad"], "optimizer"),
    (["aten::linalg_vector_norm", "aten::_foreach_norm", ps.GRAD_NORM], "grad_norm"),
    (["aten::split", ps.GRAD_NORM], "grad_norm"),
    (["aten::mul"], "other"),
    (["aten::add_", "torch::autograd::AccumulateGrad", AUTOGRAD + "torch::autograd::AccumulateGrad"], "other"),
    (["aten::log_softmax"], "other"),  # the plain twin's forward log-softmax is no sampling
    (["aten::logsumexp", "_TokenLogprob"], "other"),  # the log-prob forward
    (["aten::embedding_dense_backward", "EmbeddingBackward0"], "other"),
])
def test_op_category(chain, category):
    assert ps.op_category(chain) == category


def test_breakdown_other_is_wall_minus_categorised():
    ops = [("matmul", 2.0), ("attention", 0.5), ("other", 0.25), ("matmul", 1.0), ("optimizer", 0.75), ("other", 0.5)]
    out = ps.breakdown(ops, 6.0)
    assert {k: out[k] for k in ps.CATEGORIES} == {"matmul": 3.0, "attention": 0.5, "sampling": 0.0,
                                                  "logprob_backward": 0.0, "optimizer": 0.75, "grad_norm": 0.0}
    assert out["other_ops"] == 0.75  # the uncategorised ops' self time
    assert out["other"] == 6.0 - 4.25  # wall - categorised
    assert out["untraced"] == 6.0 - 4.25 - 0.75  # wall - every op's self time
    assert out["wall"] == 6.0 and out["ops"] == 6


def test_profiled_splits_a_real_call():
    """The categories of one real profiled call: its matmul and its labelled gradient norm land in
    their categories, and the parts add up to the wall time."""
    x, g = torch.randn(256, 256), torch.randn(1 << 22)
    norm = ps.labelled(lambda: torch.linalg.vector_norm(g), ps.GRAD_NORM)
    out, wall, split, table, top = ps.profiled(lambda: (x @ x, norm()), top=20)
    assert out[0].shape == (256, 256) and "aten::mm" in table
    assert split["matmul"] >= top["aten::mm"] > 0 and split["attention"] == 0
    # the norm op inside the label counts as the label's (its enclosing range decides)
    assert split["grad_norm"] >= top["aten::linalg_vector_norm"] > 0
    assert sum(split[c] for c in ps.CATEGORIES) + split["other"] == pytest.approx(wall, rel=1e-9)
    assert split["wall"] == wall


def test_spread_and_steal_seconds():
    assert ps.spread([20.0, 47.0, 30.0]) == {"min": 20.0, "median": 30.0, "max": 47.0, "range_over_median": 0.9}
    stat = "cpu  100 0 50 1000 5 0 2 300 0 0\ncpu0 50 0 25 500 2 0 1 150 0 0\nintr 12345\n"
    assert ps.steal_seconds(stat, 100) == 3.0  # the 8th number of the "cpu" line: 300 ticks at 100 a second
    assert ps.steal_seconds("cpu  1 2 3 4\n", 100) == 0.0  # an old kernel without the field
