"""The speed twins: the same numbers as the plain functions in the stage files, computed faster.

Every function here has a plain twin with the same signature in a stage file; the plain one owns
the public name and is what a reader reads. train.py picks one set once, from `train.fast_paths`
(`train.fast_or_plain`); tests/algorithm/test_fast.py compares each pair (values, and gradients
where there are any). Timings: docs/performance.md.

    fast.generate             rollout.generate             one prefill per group, a static KV cache,
                                                           inverse-CDF sampling
    fast.token_logprobs       rollout.token_logprobs       closed-form backward, in place
    fast.completion_logprobs  rollout.completion_logprobs  each group's prompt runs once; with
                                                           chunk_tokens, the LM head + log-softmax
                                                           over chunks of positions (bounded
                                                           logits memory)
    fast.score_targets        reward.score_targets         the evaluator prompts' prefix tree
                                                           runs once
    fast.score_remote         plumbing.evaluators.score_remote  batched, concurrent requests
    fast.clip_grad_norm       train.clip_grad_norm         chunked float32 norm of CPU gradients
    fast.linear               torch.nn.functional.linear   float32 on an AMD CPU: oneDNN, not MKL
                                                           (inside generate, completion_logprobs,
                                                           score_targets: `onednn_linears`)

Who imports this file: train.py, for the one switch (`fast_or_plain`), and plumbing/ (cli.py,
eval_commands.py, evaluators.py); rollout.py, reward.py, metarm.py and evaluate.py never do, so a
reader of the method never needs it. It imports only rollout.py (tests/plumbing/test_layout.py,
test_imports.py).
"""
import concurrent.futures
import contextlib
import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rollout import (checkpointed_modules, completion_logits, eos_ids, eval_mode, is_fsdp, left_pad,
                     positions_from_mask, rollout_dict, set_attribute)


def _mkl_is_slow_here():
    """True where torch's float32 matmul (MKL's sgemm) runs well below oneDNN's: an AMD CPU.

    MKL picks its code path by CPU vendor; on an AMD EPYC (family 26) its fp32 sgemm reached
    180 GFLOP/s on 2 threads where oneDNN's reached 417 (docs/performance.md, 2026-12-03), and
    torch 2.13 has no switch that sends an exact-fp32 matmul to oneDNN
    (`torch.backends.mkldnn.matmul.fp32_precision` offers only bf16 / tf32 downcasts). On Intel
    MKL is kept: the side-by-side there was measured with it.
    """
    if not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:  # not Linux: keep torch's own matmul
        return False


ONEDNN = _mkl_is_slow_here()


def linear(x, weight, bias=None):
    """torch.nn.functional.linear(x, weight, bias) = x W^T + b, its plain twin, on oneDNN when
    ONEDNN holds and the numbers are float32 CPU tensors outside autocast (else F.linear itself).
    Pinned by tests/algorithm/test_fast.py::test_onednn_linear_equals_plain (values and the
    gradients w.r.t. x, W and b, within float32 summation-order bounds).

    Args:
        x: FloatTensor [..., d_in]. weight: [d_out, d_in] (a transposed view is fine).
        bias: [d_out] or None.
    Returns:
        FloatTensor [..., d_out].
    """
    # plain tensors only: a DTensor (FSDP2's sharded weight) or a tensor subclass keeps F.linear
    if (ONEDNN and x.dtype == weight.dtype == torch.float32
            and x.device.type == weight.device.type == "cpu" and type(x) is torch.Tensor
            and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and x.numel() > 0 and not torch.is_autocast_enabled("cpu")):
        return _OneDNNLinear.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


DW_CHUNK_FLOATS = 1 << 20  # g's entries per d W product (4 MB of float32: _OneDNNLinear)


def _onednn_mm(a, b):
    """a @ b^T on oneDNN: a [M, k], b [n, k] (either may be a transposed view) -> [M, n] float32."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """F.linear's forward and backward, each product on oneDNN. Saves what autograd saves for
    F.linear (the input and the weight, no copies): d x = g W, d W = g^T x, d b = sum_rows g.

    d W is written into one [d_out, d_in] tensor, DW_CHUNK_FLOATS of g at a time (one product,
    nothing copied, when g has no more entries than that: every layer but the LM head): handed a
    transposed view as its input, oneDNN first copies it, and the whole g^T is [d_out, M] (the LM
    head's logits' gradient: 96 MB at 512 x 49,152, on top of the step's peak); a chunk's copy is
    4 MB. Measured on that head (AMD EPYC, docs/performance.md): backward +154 MB of peak RSS
    against F.linear's +143 MB (d W itself is 108 MB), +251 MB unchunked.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dx = _onednn_mm(g, weight.t()).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = None
        rows = max(1, DW_CHUNK_FLOATS // g.shape[0])
        if ctx.needs_input_grad[1] and rows >= weight.shape[0]:  # one chunk: no copy into d W
            dw = _onednn_mm(g.t(), x2.t())
        elif ctx.needs_input_grad[1]:
            dw = torch.empty(weight.shape, dtype=weight.dtype)
            for s in range(0, weight.shape[0], rows):  # d W[s:e] = g[:, s:e]^T x
                dw[s:s + rows] = _onednn_mm(g[:, s:s + rows].t(), x2.t())
        db = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


@contextlib.contextmanager
def onednn_linear_layers(model):
    """Inside the block, the model's nn.Linear layers compute with `linear` (oneDNN where ONEDNN
    holds): each layer's forward is set on the instance, so the hooks of DDP, FSDP2 and peft still
    fire as usual. Layers that already have a forward of their own (accelerate's hooks, an outer
    block, chunked_head) are left alone. Nothing changes when ONEDNN is False or the model is
    not on the CPU.

    Under grad with activation checkpointing on, nothing changes either: the checkpoint replays
    each layer in backward, after the block has closed, and must meet the same autograd graph
    as in the forward (torch's CheckpointError otherwise).
    """
    on = (ONEDNN and next(model.parameters()).device.type == "cpu"  # a GPU's: no detour
          and not (torch.is_grad_enabled() and checkpointed_modules(model)))
    layers = [m for m in model.modules()
              if on and type(m) is torch.nn.Linear and "forward" not in m.__dict__]
    for m in layers:
        m.forward = functools.partial(_layer_forward, m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward  # the class's forward again


def _layer_forward(layer, x):
    return linear(x, layer.weight, layer.bias)


def onednn_linears(fn):
    """A fast twin whose first argument is the model runs inside `onednn_linear_layers(model)`."""
    @functools.wraps(fn)
    def with_onednn(model, *args, **kwargs):
        with onednn_linear_layers(model):
            return fn(model, *args, **kwargs)
    return with_onednn


@torch.no_grad()
@onednn_linears
def generate(model, tokenizer, prompt_ids, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
             top_k=0, seed=0, micro_batch_size=None):
    """rollout.generate's samples (RLME Eq. 1; docs/method.md §4.1) from our own decode loop
    (`sample_rows`) over the model's forward and a transformers StaticCache.

    Why not `model.generate`: on the 2-core CPU preset two things cost time there and neither is
    needed: every row re-runs its group's prompt (prefill G times), and multinomial sampling draws
    V exponentials per row per step; its DynamicCache also copies the whole cache every step.
    Sharing the prefill, a static cache and inverse-CDF sampling make the rollout of
    configs/cpu.yaml faster (timings: docs/performance.md). Plain twin: rollout.generate
    (`model.generate`): the same distribution, not the same samples for one seed. Pinned by
    tests/algorithm/test_fast.py: test_greedy_generate_fast_equals_plain (token for token),
    test_sampled_generate_fast_and_plain_follow_the_softmax, test_sample_next_* (the draws by hand).

    Args:
        prompt_ids: list[list[int]], P prompts.
        group_size: G completions per prompt; rows of one group are adjacent.
        temperature, top_p, top_k: sampling settings (top_k=0 means off; docs/method.md §4.1: T=1,
            top_p=1; T=0 is greedy decoding, used by evaluation).
        seed: sampling seed; train.py derives it from (run seed, rank, step) so runs resume
            with the same samples.
        micro_batch_size: rows per decode batch (None = all P*G at once).
    Returns:
        the rollout dict described at the top of this file.
    """
    rows = [p for p in prompt_ids for _ in range(group_size)]
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    device = next(model.parameters()).device
    mb = micro_batch_size or len(rows)
    generator = torch.Generator(device=device).manual_seed(seed)
    chunks = []
    with eval_mode(model):
        for start in range(0, len(rows), mb):
            distinct, counts = prompt_runs(rows[start:start + mb])
            chunks.append(sample_rows(
                model, distinct, counts, max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id,
                temperature=temperature, top_p=top_p, top_k=top_k, generator=generator).cpu())
    return rollout_dict(tokenizer, rows, chunks, eos=eos, pad_id=pad_id)


def prompt_runs(prompt_ids):
    """Runs of identical consecutive prompts (a group's G rows are adjacent, docs/method.md §4.1).

    Args:
        prompt_ids: list[list[int]], N rows.
    Returns:
        (distinct list[list[int]], counts list[int]) with sum(counts) == N, e.g.
        [a, a, a, b] -> ([a, b], [3, 1]).
    """
    distinct, counts = [], []
    for row in prompt_ids:
        if distinct and row == distinct[-1]:
            counts[-1] += 1
        else:
            distinct.append(row)
            counts.append(1)
    return distinct, counts


def sample_rows(model, prompts, counts, max_new_tokens, eos, pad_id, temperature, top_p, top_k,
                generator):
    """The decode loop: counts[d] completions of prompts[d], one token per forward.

    Each distinct prompt is prefilled once (a group's G rows share it, see `prefill`); rows that
    produced EOS keep stepping (the batch keeps its shape) but get pad_id; the loop stops when
    every row is done or after max_new_tokens.

    Returns:
        LongTensor [N, <= max_new_tokens] of completion ids, rows in prompt order.
    """
    device = next(model.parameters()).device
    shared, logits, attn = prefill(model, prompts, counts, pad_id)
    cache = decode_cache(model.config, max_cache_len=attn.shape[1] + max_new_tokens)
    for i, layer in enumerate(shared.layers):
        cache.update(layer.keys, layer.values, i)
    del shared
    pos = positions_from_mask(attn)[:, -1:]
    eos_t = torch.tensor(eos, device=device)
    done = torch.zeros(attn.shape[0], dtype=torch.bool, device=device)
    tokens = []
    for t in range(max_new_tokens):
        # its own category in scripts/profile_step.py
        with torch.profiler.record_function("sample_next"):
            nxt = sample_next(logits, temperature=temperature, top_p=top_p, top_k=top_k,
                              generator=generator)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens.append(nxt)
        done |= torch.isin(nxt, eos_t)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
        pos = pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, cache=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
    return torch.stack(tokens, dim=1)


def prefill(model, prompts, counts, pad_id):
    """One forward over each distinct prompt; its cache repeated to `counts` rows.

    Args:
        prompts: list[list[int]], D distinct prompts; counts: list[int], rows per prompt (N in all).
    Returns:
        (cache DynamicCache over N rows, last_logits FloatTensor [N, V] predicting the first
        completion token, attention_mask LongTensor [N, T_prompt] of the left-padded prompts).
    """
    from transformers import DynamicCache
    device = next(model.parameters()).device
    ids, attn = left_pad(prompts, pad_id)
    ids, attn = ids.to(device), attn.to(device)
    cache = DynamicCache(config=model.config)
    kw = dict(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn),
              use_cache=True, logits_to_keep=1)
    layers = [m for m in checkpointed_modules(model) if hasattr(m, "_can_checkpoint_with_cache")]
    if torch.is_grad_enabled() and layers and all(type(c) is DynamicLayer for c in cache.layers):
        # Under activation checkpointing (model.gradient_checkpointing) this pass is checkpointed
        # too: a layer's K/V are written once (write_once_cache) and the replay in backward gets its
        # recomputed K/V back without a second write, so a 6k-token prompt keeps its layer inputs,
        # not every activation (docs/scale-out.md "Memory plan"). The completion pass gets a fresh
        # cache of the same tensors: the replay still looks its layers up in `cache`.
        with set_attribute(layers, "_can_checkpoint_with_cache", True):
            out = model(cache=write_once_cache(cache), **kw)
        cache = copy_cache(cache, model.config)
    else:
        # This pass WRITES the cache: not checkpointed (transformers would drop the cache; kept, the
        # replay in backward would write it twice). Its activations stay: one row a group.
        with set_attribute(checkpointed_modules(model), "gradient_checkpointing", False):
            out = model(cache=cache, **kw)
    reps = torch.tensor(counts, device=device)
    repeat_cache(cache, reps)
    return (cache, out.logits[:, -1].repeat_interleave(reps, dim=0),
            attn.repeat_interleave(reps, dim=0))


def write_once_cache(cache):
    """`cache` (an empty DynamicCache of full-attention layers) whose layers store the first K/V
    they get and, on later calls (the backward replay of a checkpointed prompt pass), return the
    recomputed K/V as given, storing nothing: the replay sees the shapes of the first forward.
    Returns the same cache object."""
    class WriteOnceLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if self.is_initialized:
                return key_states, value_states
            return super().update(key_states, value_states, *args, **kwargs)
    cache.layers = [WriteOnceLayer() for _ in cache.layers]
    return cache


def copy_cache(cache, config):
    """A new DynamicCache holding `cache`'s keys and values (the same tensors, their autograd
    graph)."""
    from transformers import DynamicCache
    new = DynamicCache(config=config)
    for layer, old in zip(new.layers, cache.layers):
        layer.lazy_initialization(old.keys, old.values)
        layer.keys, layer.values = old.keys, old.values
    return new


def repeat_cache(cache, counts):
    """Copy each distinct prompt's KV cache to its rows, in place: the prompt of a group is run
    once instead of G times (prefill in `generate`, forward + backward in completion_logprobs).
    Differentiable: gradients of all G rows flow back into the one prompt forward.

    Args:
        cache: transformers DynamicCache over D distinct prompts (layers' keys/values [D, h, T, d]).
        counts: LongTensor [D], rows per distinct prompt.
    """
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(counts, dim=0)
        layer.values = layer.values.repeat_interleave(counts, dim=0)


def decode_cache(config, max_cache_len):
    """A transformers StaticCache whose full-attention layers hand attention only their filled part.

    Why preallocated: a DynamicCache concatenates, i.e. copies, the whole cache of every layer at
    every step. Why only the filled part: a plain
    StaticLayer returns all `max_cache_len` positions and masks the empty ones, so step t of the
    decode attends over prompt + N positions instead of prompt + t (timings: docs/performance.md).
    Sliding-window layers are kept as transformers builds them.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    class FilledStaticLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            n = int(self.cumulative_length)
            return keys[:, :, :n], values[:, :, :n]

        def get_mask_sizes(self, query_length):
            return int(self.get_seq_length()) + query_length, 0

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [FilledStaticLayer(max_cache_len=max_cache_len) if type(layer) is StaticLayer
                    else layer for layer in cache.layers]
    return cache


def sample_next(logits, temperature, top_p, top_k, generator):
    """Next tokens from logits: y_t ~ pi_theta(. | x, y_<t) of RLME Eq. 1 with the sampling settings
    of docs/method.md §4.1.

    Sampling is by inverse CDF with ONE uniform number per row (cumsum + searchsorted): exact,
    and much cheaper on CPU than torch.multinomial, which draws an exponential for each of the
    V vocabulary entries of every row (timings: docs/performance.md).

    Args:
        logits: FloatTensor [N, V]. temperature: 0 = greedy (argmax). top_p: nucleus mass kept
            (1 = off). top_k: keep the k largest (0 = off).
        generator: torch.Generator on the logits' device (the seed of the rollout).
    Returns:
        LongTensor [N].
    """
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        # keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    cdf = probs.double().cumsum(-1)  # float64: 49k-term running sums keep tail tokens reachable
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    # first index whose cdf exceeds u * total: token i is hit with probability p_i / total
    return (torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
            .clamp(max=probs.shape[-1] - 1))


class _TokenLogprob(torch.autograd.Function):
    """log softmax(z)[target], z = logits / T, with a hand-written backward.

    Why: autograd's version (gather - logsumexp) builds three more [.., V] tensors in the backward
    (exp(z - lse), a zero-filled scatter for the gather, their sum): with V = 49152 that is 300 MB
    and ~5 full passes over memory per micro-batch of 4 x 128 tokens. The gradient is known in
    closed form,  d logp / d z = onehot(target) - softmax(z),  and can be written into the saved z
    in place (nothing else reads the logits after this point; if anything did, autograd's
    saved-tensor version check would raise instead of computing a wrong gradient).
    Timings: docs/performance.md.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        z = logits if temperature == 1.0 else logits / temperature
        lse = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(z, targets, lse)
        ctx.temperature = temperature
        # z may be overwritten in the backward unless it is the caller's own leaf tensor
        ctx.owns_z = temperature != 1.0 or not logits.is_leaf
        return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        z, targets, lse = ctx.saved_tensors
        z = z if ctx.owns_z else z.clone()
        g = (grad / ctx.temperature).unsqueeze(-1)  # chain rule through z = logits / T
        dz = z.sub_(lse.unsqueeze(-1)).exp_().mul_(-g)  # -g * softmax(z), in place in z
        dz.scatter_add_(-1, targets.unsqueeze(-1), g)  # + g at the target
        return dz, None, None


def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / T)[target] without materialising the log-softmax. Plain twin:
    rollout.token_logprobs; pinned by
    tests/algorithm/test_fast.py::test_token_logprobs_fast_equals_plain.

    Args:
        logits: FloatTensor [..., V] (any float dtype; computed in float32);
            targets: LongTensor [...].
        temperature: the sampling temperature (RLME Eq. 6; docs/method.md §4.4: both sides divide by
            the same T).
    Returns:
        FloatTensor [...] in float32. With grad, the backward is `_TokenLogprob`'s
        closed form (equal to autograd's within float32 rounding).
    Note: under grad the fast backward overwrites the (float32) logits in place; do not reuse them.
    """
    return _TokenLogprob.apply(logits.float(), targets, float(temperature))


@onednn_linears
def completion_logprobs(model, prompt_ids, completion_ids, pad_id, temperature=1.0,
                        prompt_model=None, chunk_tokens=0):
    """Per-token log-probs of the completions under `model`, logits divided by `temperature`.

    rollout.completion_logprobs's numbers (its plain twin), faster; values and gradients pinned by
    tests/algorithm/test_fast.py::test_completion_logprobs_fast_equals_plain (and _bf16_autocast):
    - rows with the same prompt next to each other (a group) run the prompt ONCE, with grad; its
      KV cache is repeated to the group's rows and only the completion tokens run per row. For
      GSM8K prompts (~130 tokens), 128-token completions and G = 4 this skips a large part of
      the update's forward and backward (timings: docs/performance.md).
    - when no prompt is shared, or some prompt is a single token, it falls back to one batched
      forward over [left-padded prompt | completion], with token_logprobs' fast backward.
    Only the logits of positions that predict completion tokens are materialised; with
    `chunk_tokens` > 0 (train.logprob_chunk_tokens) not even those at once: the LM head runs inside
    `chunked_head`, chunk_tokens positions at a time, forward and backward (`head_logprobs`).

    Args:
        prompt_ids: list[list[int]], N rows.
        completion_ids: LongTensor [N, L].
        pad_id: int, padding id of the tokenizer.
        Works under activation
            checkpointing (both passes are checkpointed: `prefill` writes the prompt cache once).
        prompt_model: the module for the prompt pass (the unwrapped policy under DDP, so that
            DDP sees one forward per backward); default `model`. (The plain twin has it too,
            unused: one forward there.)
        chunk_tokens: 0 = the LM head over all N x L positions at once ([N, L, V] float32 logits);
            > 0 = at most that many positions' logits exist at a time (values and gradients as
            without: tests/algorithm/test_fast.py::test_chunked_logprobs_equal_plain*).
    Returns:
        FloatTensor [N, L] float32; positions after the first EOS hold junk and must be masked.
        Gradient flows when called under grad mode.
    """
    device = next(model.parameters()).device
    completion_ids = completion_ids.to(device)
    n, length = completion_ids.shape
    distinct, counts = prompt_runs(prompt_ids)
    if len(distinct) < n and min(map(len, distinct)) > 1:
        # The prompt pass runs all but each prompt's last token; the completion pass starts with
        # that token, so its L positions predict exactly the L completion tokens: one LM head
        # over [N, L, V], and no separate first-token logits (whose backward cost a [V, d]
        # weight-gradient product per micro-batch).
        cache, prompt_logits, p_mask = prefill(prompt_model or model, [p[:-1] for p in distinct],
                                               counts, pad_id)
        last = torch.tensor([p[-1] for p, c in zip(distinct, counts) for _ in range(c)],
                            device=device)
        inputs = torch.cat([last[:, None], completion_ids[:, :-1]], dim=1)
        attn = torch.cat([p_mask, p_mask.new_ones(n, length)], dim=1)
        # Under activation checkpointing (train.py) transformers replays each decoder layer in
        # backward and drops the KV cache, lest the replay write it twice. This pass only READS
        # the prompt's cache (read_only_cache), so the layers may keep it.
        layers = [m for m in checkpointed_modules(model)
                  if hasattr(m, "_can_checkpoint_with_cache")]
        with set_attribute(layers, "_can_checkpoint_with_cache", True), \
                chunked_head(model, completion_ids, temperature, chunk_tokens) as chunked:
            out = model(input_ids=inputs, attention_mask=attn,
                        position_ids=positions_from_mask(attn)[:, -length:],
                        cache=read_only_cache(cache), use_cache=False, logits_to_keep=length)
        lp = out.logits if chunked else token_logprobs(out.logits, completion_ids, temperature)
        if torch.is_grad_enabled() and is_fsdp(model):
            # FSDP2 unshards a layer's weights for backward when the layer's OUTPUT gets a
            # gradient. Only the prompt pass's KV cache reaches the loss, not its last layer's
            # output, whose backward would then find the weights resharded: route a zero
            # gradient through the prompt pass's (unused) logits. An empty slice sums to exactly
            # 0 even if a logit is inf or NaN (0.0 * sum would turn that into NaN log-probs).
            lp = lp + prompt_logits[..., :0].sum()
        return lp
    # no prompt to share: the plain twin's forward, with the closed-form log-prob backward
    with chunked_head(model, completion_ids, temperature, chunk_tokens) as chunked:
        logits = completion_logits(model, prompt_ids, completion_ids, pad_id)
    return logits if chunked else token_logprobs(logits, completion_ids, temperature)


# Config attributes of models whose forward changes the LM head's output (Gemma 2's soft cap,
# Cohere's logit_scale, Granite's logits_scaling): chunked_head leaves those models alone.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@contextlib.contextmanager
def chunked_head(model, targets, temperature, chunk_tokens):
    """Inside the block, the model's LM head returns log-probs of `targets` instead of logits.

    The head's forward is swapped, not bypassed: the model's own forward still runs (DDP's and
    FSDP2's hooks, which unshard the head's weight, fire as usual) and hands the head the hidden
    states of the kept positions [N, K, d]; it returns `head_logprobs` of them, [N, K], which the
    model passes on as `.logits`. Column k < L holds log p(targets[:, k]); columns >= L (the one
    extra column completion_logits keeps and drops) hold 0.

    Args:
        model: causal LM, or its DDP / peft wrapper. targets: LongTensor [N, L].
        chunk_tokens: positions per chunk; 0 = off.
    Yields:
        True when the head is swapped; False (nothing changed) when chunk_tokens is 0, when all
        N x L positions fit one chunk (the unchunked closed form is then just as bounded and has
        no recompute), or when the head is not a plain nn.Linear or the model post-processes its
        logits (LOGIT_POSTPROCESSING).
    """
    inner = model
    while hasattr(inner, "module") or hasattr(inner, "_orig_mod"):  # DDP / torch.compile wrappers
        inner = getattr(inner, "module", None) or inner._orig_mod
    # else: unchunked
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    config = getattr(inner, "config", None)
    if (chunk_tokens <= 0 or targets.numel() <= chunk_tokens or type(head) is not torch.nn.Linear
            or any(getattr(config, a, None) not in (None, 1, 1.0) for a in LOGIT_POSTPROCESSING)):
        yield False
        return
    # a forward set on the instance (accelerate's hooks), else None
    own = head.__dict__.get("forward")
    head.forward = lambda hidden: head_logprobs(hidden, head.weight, head.bias, targets,
                                                temperature=temperature, chunk_tokens=chunk_tokens)
    try:
        yield True
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own


def head_logprobs(hidden, weight, bias, targets, temperature, chunk_tokens):
    """log softmax((hidden W^T + b) / T)[target] for the first L of K positions, chunk by chunk.

    The same numbers as token_logprobs(F.linear(hidden, W, b)[:, :L], targets, T) (its closed-form
    gradient, d logp / d z = onehot(target) - softmax(z)) with at most chunk_tokens x V logits
    alive at once, forward and backward (`_ChunkedHeadLogprob`). Plain twin: the LM head then
    rollout.token_logprobs (rollout.completion_logprobs); pinned by tests/algorithm/test_fast.py::
    test_chunked_logprobs_equal_plain (values and gradients w.r.t. hidden, W and b).

    Args:
        hidden: FloatTensor [N, K, d], K >= L. weight: [V, d]; bias: [V] or None.
        targets: LongTensor [N, L]. temperature: float. chunk_tokens: int > 0, positions per chunk.
    Returns:
        FloatTensor [N, K] float32: log-probs in the first L columns, 0 in the rest.
    """
    n, length = targets.shape
    h = hidden[:, :length].reshape(n * length, hidden.shape[-1])
    lp = _ChunkedHeadLogprob.apply(h, weight, bias, targets.reshape(-1), float(temperature),
                                   int(chunk_tokens))
    return torch.nn.functional.pad(lp.view(n, length), (0, hidden.shape[1] - length))


class _ChunkedHeadLogprob(torch.autograd.Function):
    """head_logprobs' autograd: the forward keeps only log-sum-exp per position [M]; the backward
    recomputes each chunk's logits, turns them in place into the closed-form gradient (as
    _TokenLogprob does) and multiplies out d hidden and d W chunk by chunk.

    Memory: one chunk's [c, V] float32 logits (plus its copy in the compute dtype under bf16),
    instead of [M, V]; d W accumulates in one float32 [V, d] buffer (what autograd's would be).
    Cost: the LM head's matmul runs once more per chunk in the backward (the recompute).
    The compute dtype is the autocast dtype when autocast is on (as the head's own F.linear
    would run), else the hidden states' dtype; it is fixed in the forward and reused in backward,
    where autocast is off.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, chunk):
        device_type = h.device.type
        dt = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
              else h.dtype)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        out = torch.empty_like(lse)
        with torch.autocast(device_type, enabled=False):
            w, b = weight.to(dt), None if bias is None else bias.to(dt)
            for s in range(0, h.shape[0], chunk):
                z = _chunk_logits(h[s:s + chunk], w, b, dt, temperature)
                lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
                out[s:s + chunk] = (z.gather(-1, targets[s:s + chunk, None]).squeeze(-1)
                                    - lse[s:s + chunk])
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.dt, ctx.temperature, ctx.chunk = dt, temperature, chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        h, weight, bias, targets, lse = ctx.saved_tensors
        dt, chunk = ctx.dt, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.empty_like(h) if need_h else None
        dw = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w
              else None)
        db = (torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b
              else None)
        with torch.autocast(h.device.type, enabled=False):
            w, b = weight.to(dt), None if bias is None else bias.to(dt)
            for s in range(0, h.shape[0], chunk):
                hc = h[s:s + chunk].to(dt)
                z = _chunk_logits(hc, w, b, dt, ctx.temperature)
                # chain rule through z / T
                g = (grad[s:s + chunk].float() / ctx.temperature).unsqueeze(-1)
                # -g * softmax(z), in place in z
                dz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(-g)
                dz.scatter_add_(-1, targets[s:s + chunk, None], g)  # + g at the target
                if db is not None:
                    db += dz.sum(0)
                dz = dz.to(dt)
                if dh is not None:
                    dh[s:s + chunk] = linear(dz, w.t())  # dz @ w
                if dw is not None and dt == torch.float32:
                    dw.addmm_(dz.T, hc)
                elif dw is not None:  # bf16 / fp16 product, summed over chunks in float32
                    dw += (dz.T @ hc).float()
        return (dh, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None)


def _chunk_logits(h, w, b, dt, temperature):
    """Float32 logits / T [c, V] of one chunk of hidden states [c, d], the matmul in dtype `dt`."""
    z = linear(h.to(dt), w, b).float()
    return z if temperature == 1.0 else z.div_(temperature)


def read_only_cache(cache):
    """The prompt's KV cache for ONE forward over the completions, written by nobody.

    Each layer's update returns [prompt K/V | the new tokens' K/V] without storing the new part,
    so the completion forward can be replayed in backward (activation checkpointing) and sees
    the same keys both times; `get_seq_length` stays the prompt length, as the mask expects.

    Args:
        cache: transformers DynamicCache (keys/values [N, h, T, d]).
    Returns:
        the same cache object, its full-attention layers replaced. Other layers (sliding window)
        are kept: fine for one forward; under activation checkpointing their replay would write
        twice, which torch.utils.checkpoint reports as a metadata mismatch (never silent).
    """
    from transformers.cache_utils import DynamicLayer

    class ReadOnlyLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return (torch.cat([self.keys, key_states], dim=-2),
                    torch.cat([self.values, value_states], dim=-2))

    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            continue
        new = ReadOnlyLayer()
        new.lazy_initialization(layer.keys, layer.values)
        new.keys, new.values = layer.keys, layer.values
        cache.layers[i] = new
    return cache


@torch.no_grad()
@onednn_linears
def score_targets(model, prompt_ids, target_ids, pad_id, micro_batch_size=8, groups=None):
    """log p(target | prompt) under `model`, teacher-forced, full-vocabulary softmax: log p_{j,k}
    of RLME Eq. 2 (docs/method.md §4.2). Plain twin: reward.score_targets; pinned by
    tests/algorithm/test_fast.py::test_score_targets_fast_equals_plain_tiny.

    Nothing is computed twice. Evaluator prompts form a tree: the samples of one group share the
    problem (chat header, instructions, problem statement), the K prompts of one sample share the
    solution too, and only the meta-question tail + target differ. So each micro-batch runs
      A. each group's shared prefix once,                       KV cache repeated to its samples
      B. each sample's remaining prefix once, after A,          KV cache repeated K times
      C. the K suffixes (prompt tail + target), after A + B.
    K questions cost one long forward plus K short ones, and a group of G samples pays for its
    problem once instead of G times (timings: docs/performance.md).

    Args:
        model: causal LM (run in eval mode, rollout.eval_mode, its modes restored after; no grad).
        prompt_ids: list (N) of lists (K) of list[int].
        target_ids: same nesting, the target answer ids.
        pad_id: int.
        micro_batch_size: samples (each with all K rows) per forward.
        groups: list (N) of hashable group keys, e.g. the problem text: samples with the same
            key next to each other share stage A. None = no sharing across samples.
    Returns:
        FloatTensor [N, K] of sum_t log p(target_t | prompt, target_<t), float32, on CPU.
    """
    device = next(model.parameters()).device
    groups = list(range(len(prompt_ids))) if groups is None else list(groups)
    out = []
    with eval_mode(model):  # dropout off (a live evaluator is the policy, in train mode)
        for start in range(0, len(prompt_ids), micro_batch_size):
            prompts, targets = (prompt_ids[start:start + micro_batch_size],
                                target_ids[start:start + micro_batch_size])
            n, k = len(prompts), len(prompts[0])
            # B ends at least one token before each prompt's end, so every suffix row has a token
            # whose logits predict the first target token; A ends at least one token before B's end.
            cut = [min(_common_prefix_len(p), min(len(x) for x in p) - 1) for p in prompts]
            runs = []  # [first sample, count, shared length] per group run in this micro-batch
            for i, g in enumerate(groups[start:start + n]):
                if runs and g == groups[start + runs[-1][0]]:
                    runs[-1][1] += 1
                else:
                    runs.append([i, 1, 0])
            for r in runs:
                members = range(r[0], r[0] + r[1])
                r[2] = 0 if r[1] == 1 else min(
                    _common_prefix_len([prompts[i][0][:cut[i]] for i in members]),
                    min(cut[i] for i in members) - 1)
            shared = [r[2] for r in runs for _ in range(r[1])]
            reps = torch.tensor([r[1] for r in runs], device=device)
            cache, past = DynamicCache(config=model.config), None
            # A: one row per group run (left-padded), then repeated to the run's samples
            if max(shared) > 0:
                a_ids, a_mask = left_pad([prompts[r[0]][0][:r[2]] for r in runs], pad_id)
                past = _stage_forward(model, a_ids.to(device), a_mask.to(device), past_mask=None,
                                      cache=cache)
                repeat_cache(cache, reps)
                past = past.repeat_interleave(reps, dim=0)
            # B: the rest of each sample's common prefix (right-padded), then repeated K times
            b_ids, b_mask = _right_pad([p[0][s:c] for p, s, c in zip(prompts, shared, cut)],
                                       pad_id, device)
            past = _stage_forward(model, b_ids, b_mask, past_mask=past, cache=cache)
            repeat_cache(cache, torch.full((n,), k, device=device))
            past = past.repeat_interleave(k, dim=0)
            # C: suffix rows, right-padded: prompt tail + target
            rows, tgt_start, tgt_len = [], [], []
            for p, t, c in zip(prompts, targets, cut):
                for pk, tk in zip(p, t):
                    rows.append(pk[c:] + tk)
                    tgt_start.append(len(pk) - c)
                    tgt_len.append(len(tk))
            c_ids, c_mask = _right_pad(rows, pad_id, device)
            full = torch.cat([past, c_mask], dim=1)
            width = c_ids.shape[1]
            # the logits at suffix column j predict column j+1: the target tokens at columns
            # tgt_start .. tgt_start+len-1 are predicted from columns tgt_start-1 ... Only those go
            # through the LM head (a bool logits_to_keep), not every column of the K meta-question
            # tails (docs/performance.md).
            col = torch.arange(width, device=device)[None, :]
            first = torch.tensor(tgt_start, device=device)[:, None] - 1
            # [n*k, width]
            pred = (col >= first) & (col < first + torch.tensor(tgt_len, device=device)[:, None])
            logits = model(input_ids=c_ids, attention_mask=full,
                           position_ids=positions_from_mask(full)[:, -width:], cache=cache,
                           use_cache=True, logits_to_keep=pred).logits  # [tokens, V], row-major
            # column j holds the token at j+1
            next_ids = torch.cat([c_ids[:, 1:], c_ids[:, :1]], dim=1)
            lp = token_logprobs(logits, next_ids[pred])
            row = pred.nonzero()[:, 0]
            out.append(torch.zeros(n * k, device=device).index_add_(0, row, lp).view(n, k).cpu())
    return torch.cat(out)


def _common_prefix_len(rows):
    """Length of the longest common prefix of several id lists."""
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows[1:]):
            return i
    return n


def _stage_forward(model, ids, mask, past_mask, cache):
    """Run `ids` [B, T] (mask [B, T]) after what `cache` holds (its mask `past_mask` [B, T0], or
    None), only to extend the cache; returns the mask of everything so far. Positions count real
    tokens only, so left padding, and right padding between stages, leaves every token at its
    true position."""
    full = mask if past_mask is None else torch.cat([past_mask, mask], dim=1)
    pos = positions_from_mask(full)[:, full.shape[1] - ids.shape[1]:]
    model(input_ids=ids, attention_mask=full, position_ids=pos, cache=cache, use_cache=True,
          logits_to_keep=1)
    return full


def _right_pad(rows, pad_id, device):
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids.to(device), mask.to(device)


def score_remote(r, fulls):
    """The numbers of its plain twin plumbing.evaluators.score_remote, with batch_size texts per
    request (vLLM answers them as one batch) and `concurrency` requests in flight. Pinned by
    tests/algorithm/test_fast.py::test_batched_requests_equal_one_request_per_prompt."""
    chunks = [fulls[i:i + r["batch_size"]] for i in range(0, len(fulls), r["batch_size"])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, r["concurrency"])) as pool:
        # remote_request (plumbing/evaluators.py)
        out = list(pool.map(lambda c: r["request"](r, c), chunks))
    return [v for o in out for v in o[0]], [w for o in out for w in o[1]]


def clip_grad_norm(policy, max_norm):
    """Its plain twin train.clip_grad_norm, with the norm of CPU gradients taken over 64K-element
    chunks; pinned by tests/algorithm/test_fast.py::test_clip_grad_norm_fast_equals_plain (and
    against float64).

    Why: torch's float32 CPU norm of one long tensor drifts (torch 2.13: ~1e-3 relative at a
    28M-element tied embedding, so the logged norm and the clip coefficient were off); chunked
    partial norms keep it within ~1e-6. GPU and FSDP2 (DTensor) gradients take the plain path.
    """
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    if not grads or any(isinstance(g, DTensor) or g.device.type != "cpu" for g in grads):
        # train.clip_grad_norm's two lines
        gn = torch.nn.utils.clip_grad_norm_(policy.parameters(),
                                            max_norm if max_norm > 0 else float("inf"))
        return float(gn.full_tensor() if isinstance(gn, DTensor) else gn)
    gn = torch.nn.utils.get_total_norm([c for g in grads for c in g.reshape(-1).split(1 << 16)])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(policy.parameters(), max_norm, gn)
    return float(gn)
