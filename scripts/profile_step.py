"""Where an RLME step's time goes: seconds by stage, top ops by stage, and the cost of K meta-questions.

    python scripts/profile_step.py                         # configs/cpu.yaml: P=4, G=4, N=128, SmolLM2 fp32
    python scripts/profile_step.py --K 1 4 --ops 8 rollout.max_new_tokens=64
    python scripts/profile_step.py --runs 5 --profile-runs --json prof.json  # the update's spread (issue 36)

Runs the three stages of train.py's step on one batch with the same functions train.py calls
(fast.generate, reward.rlme_reward, train.update_policy), after one untimed warm-up step:
  1. seconds per stage and generated tokens/s;
  2. the top `--ops` operators of each stage (torch.profiler, self CPU time);
  3. the reward stage with K = 1 and K = 4 meta-questions on the same completions (issue 6 asks
     K = 4 to cost <= 1.5 x K = 1: the K prompts share the problem+solution prefix);
  4. per stage, the profiled wall time split into CATEGORIES (`op_category`, `breakdown`): matmuls,
     attention, sampling, the log-prob backward, the optimizer step, the gradient norm, and
     "other" = wall - the categorised ops' self times (the other ops, plus the Python and
     framework time the profiler records no op for: "untraced");
  5. the update's model FLOPs (`update_flops`) per second against this machine's measured fp32
     matmul peak (`matmul_peak`: torch.mm's, and oneDNN's on the same product), printed with the
     CPU model, torch's threads, its BLAS / oneDNN settings and code paths (`machine_info`);
  6. with `--runs N`: the update stage N more times on one batch, each run's seconds, process CPU
     seconds, the machine's steal time (/proc/stat) and involuntary context switches, and the
     spread (`--profile-runs`: each run profiled and split as in 4).
`--json PATH` writes every figure. Timings on a loaded machine say little: note the load with them.
"""
import argparse
import os
import re
import resource
import statistics
import sys
import tempfile
import time

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fast  # noqa: E402
import reward as R  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from plumbing.config import load_config  # noqa: E402
from plumbing.items import load_train_items
from plumbing.models import load_model
from plumbing.prompts import policy_chat
from plumbing.run import update_kwargs
from plumbing.evaluators import load_evaluators

EXTRA_QUESTIONS = ["Is the reasoning free of arithmetic mistakes?", "Does the solution answer the question that was asked?",
                   "Is the final answer stated clearly?", "Is every step justified?", "Is the solution concise?",
                   "Are the units handled correctly?", "Is the answer a plausible quantity?"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs", "cpu.yaml"))
    p.add_argument("--ops", type=int, default=8, help="top operators printed per stage")
    p.add_argument("--runs", type=int, default=0, help="time the update stage this many more times on one batch")
    p.add_argument("--profile-runs", action="store_true", help="profile each of the --runs (slower) and split its time")
    p.add_argument("--peak-size", type=int, default=2048, help="n of the n x n fp32 matmul that measures the peak")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--K", type=int, nargs="+", default=[1, 4], help="meta-question counts to time")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, as for train.py")
    a = p.parse_args(argv)
    cfg = load_config([a.config], a.overrides)
    ro, rw = cfg["rollout"], cfg["reward"]
    device = torch.device("cpu")
    policy, tok = load_model(cfg["model"]["policy"], cfg["model"]["dtype"], device)
    chat = policy_chat(tok, cfg["model"])
    items = load_train_items(cfg)
    passes = train.fast_or_plain(cfg["train"]["fast_paths"], cfg["train"]["logprob_chunk_tokens"])  # train.fast_paths=false profiles the plain twins
    evaluators = load_evaluators(cfg, policy, tok, device, passes)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg["optim"]["lr"], fused=True)  # as train.py
    template = rw["evaluator_template"] or R.DEFAULT_EVALUATOR_TEMPLATE
    # train.update_policy's arguments as train.train binds them from the config (CISPO or GRPO, its numbers)
    settings = update_kwargs(cfg, passes, device, cispo_loss=train.cispo_loss, grpo_loss=train.grpo_loss,
                             world=1, pad_id=tok.pad_token_id)

    def questions(k):  # the config's meta-questions, padded with EXTRA_QUESTIONS up to k
        return (rw["meta_questions"] + [{"question": q, "weight": 1.0, "target": "Yes"} for q in EXTRA_QUESTIONS])[:k]

    def step(s, profiler=None):
        batch = rollout.step_items(items, s, ro["prompts_per_step"], cfg["run"]["seed"], rank=0, world=1)
        prompts = [rollout.build_prompt_ids(tok, cfg["data"]["prompt_template"].format(question=it["question"]), chat)
                   for it in batch]
        samples = [it for it in batch for _ in range(ro["group_size"])]
        times, ops, split, top = {}, {}, {}, {}

        def timed(name, fn):
            if profiler:
                out, times[name], split[name], ops[name], top[name] = profiled(fn, a.ops)
            else:
                t = time.perf_counter()
                out = fn()
                times[name] = time.perf_counter() - t
            return out

        out = timed("rollout", lambda: passes["generate"](policy, tok, prompts, group_size=ro["group_size"],
                                                          max_new_tokens=ro["max_new_tokens"], temperature=ro["temperature"],
                                                          top_p=ro["top_p"], top_k=ro["top_k"], seed=s))
        rew = timed("reward", lambda: R.rlme_reward(evaluators, rw["meta_questions"], [it["question"] for it in samples],
                                                    out["completions"], template=template))
        adv = train.group_advantages(rew["reward"], ro["group_size"])
        b = {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"],
             "completion_mask": out["completion_mask"], "advantages": adv}
        # the gradient norm labelled for the profiler (its own category in `op_category`)
        labelled_settings = dict(settings, clip_grad_norm=labelled(settings["clip_grad_norm"], GRAD_NORM))

        def update():
            return train.update_policy(policy, policy, optimizer, b, **labelled_settings)
        timed("update", update)
        return {"times": times, "ops": ops, "split": split, "top": top, "out": out, "samples": samples,
                "batch": b, "update": update}

    machine = machine_info()
    print_machine(machine)
    peak = matmul_peak(a.peak_size)
    onednn = matmul_peak(a.peak_size, library="onednn") if torch.backends.mkldnn.is_available() else None
    print(f"fp32 matmul peak: torch.mm {peak:.1f} GFLOP/s" + (f", oneDNN {onednn:.1f} GFLOP/s" if onednn else "")
          + f" ({a.peak_size}^3 x 2 FLOP, best of 5, {torch.get_num_threads()} threads)")
    # the library the update's linears run on: oneDNN where fast.py routes them there (fast.ONEDNN)
    on_onednn = bool(cfg["train"]["fast_paths"] and fast.ONEDNN and onednn)
    print(f"the fast paths' float32 linears: {'oneDNN' if fast.ONEDNN else 'torch.mm'} (fast.ONEDNN = {fast.ONEDNN}); "
          f"this run: {'oneDNN' if on_onednn else 'torch.mm'}")
    report = {"machine": machine, "matmul_peak_gflops": peak, "onednn_peak_gflops": onednn, "peak_size": a.peak_size,
              "linears_on_onednn": on_onednn,
              "config": {"P": ro["prompts_per_step"], "G": ro["group_size"], "N": ro["max_new_tokens"],
                         "train_micro_batch": cfg["train"]["micro_batch_size"],
                         "reward_micro_batch": rw["micro_batch_size"], "fast_paths": cfg["train"]["fast_paths"],
                         "overrides": a.overrides}}
    shape = matmul_shape(policy)
    algo = cfg["algo"]

    def flops(b):  # the update's model FLOPs of batch b, as update_policy runs it (update_flops)
        grad, frozen = update_passes(b["prompt_ids"], b["completion_mask"], micro_batch_size=cfg["train"]["micro_batch_size"],
                                     updates_per_batch=algo["updates_per_batch"], minibatches=algo["minibatches"],
                                     group_size=ro["group_size"], shared_prompt=cfg["train"]["fast_paths"])
        return update_flops(grad, frozen, **shape)

    step(0)  # warm-up: allocator, caches, AdamW state
    timed_step = step(1)
    times, out, samples = timed_step["times"], timed_step["out"], timed_step["samples"]
    tokens = float(out["completion_mask"].sum())
    print(f"\nP={ro['prompts_per_step']} G={ro['group_size']} N={ro['max_new_tokens']} "
          f"micro-batch train={cfg['train']['micro_batch_size']} reward={rw['micro_batch_size']}")
    print("seconds by stage: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
          + f", step {sum(times.values()):.1f}; rollout {tokens / times['rollout']:.0f} generated tokens/s")
    f1 = flops(timed_step["batch"])
    print(f"update: {f1['total'] / 1e9:.1f} GFLOP (matmul {f1['matmul'] / 1e9:.1f}, attention {f1['attention'] / 1e9:.1f}) "
          f"in {times['update']:.2f} s = {rate(f1['total'], times['update']):.1f} GFLOP/s, "
          f"{100 * rate(f1['total'], times['update']) / peak:.0f}% of torch.mm's peak"
          + (f", {100 * rate(f1['total'], times['update']) / onednn:.0f}% of oneDNN's" if onednn else ""))
    report.update(stage_s=times, rollout_tokens_per_s=tokens / times["rollout"], update_flops=f1,
                  update_gflops=rate(f1["total"], times["update"]))

    prof_step = step(2, profiler=True)
    for name, table in prof_step["ops"].items():
        print(f"\n--- {name}: top ops by self CPU time ---\n{table}")
    print("\nseconds by category, profiled step (the profiler's overhead included; other = wall - categorised):")
    print(format_breakdown(prof_step["split"]))
    f2, s2 = flops(prof_step["batch"]), prof_step["split"]["update"]
    print(f"update, profiled: matmuls {rate(f2['matmul'], s2['matmul']):.1f} GFLOP/s, "
          f"attention {rate(f2['attention'], s2['attention']):.1f} GFLOP/s (model FLOPs / category seconds)")
    report["profiled"] = {"stage_s": prof_step["times"], "split": prof_step["split"], "update_flops": f2,
                          "top_ops_s": prof_step["top"]}

    if a.runs > 0:
        report["runs"] = repeat_update(timed_step["update"], a.runs, profile=a.profile_runs, flops=f1["total"],
                                       peak=onednn if on_onednn else peak, library="oneDNN" if on_onednn else "torch.mm")

    print("\nreward stage vs number of meta-questions K (same completions):")
    base, report["reward_vs_K_s"] = None, {}
    for k in a.K:
        t = time.perf_counter()
        R.rlme_reward(evaluators, questions(k), [it["question"] for it in samples], out["completions"],
                      template=template)
        dt = time.perf_counter() - t
        base = base or dt
        report["reward_vs_K_s"][k] = dt
        print(f"  K={k}: {dt:.1f} s  ({dt / base:.2f} x K={a.K[0]})")
    report["load_average_end"] = os.getloadavg()
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in report['load_average_end'])}")
    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"figures: {a.json}")


# ----------------------------------------------------------------------------------------------
# Where the time goes: profiler ops -> categories

GRAD_NORM = "clip_grad_norm"  # the record_function label main() puts around update_policy's clip_grad_norm
CATEGORIES = ("matmul", "attention", "sampling", "logprob_backward", "optimizer", "grad_norm")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::linear",
              "aten::matmul", "aten::mv", "aten::addmv", "aten::dot", "aten::_addmm_activation",
              # autograd's backward nodes of the matmuls (their children: mm, t, reshapes)
              "MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "MvBackward0", "LinearBackward0"}
SAMPLING_OPS = {"sample_next",  # fast.sample_rows labels fast.sample_next; model.generate's ops by name:
                "aten::softmax", "aten::_softmax", "aten::multinomial", "aten::exponential_", "aten::topk",
                "aten::sort", "aten::cumsum", "aten::searchsorted", "aten::argmax", "aten::rand", "aten::uniform_"}
# the closed-form backward (fast._TokenLogprob, fast._ChunkedHeadLogprob: autograd names a custom
# Function's node after its class) and autograd's backward of the plain twin's log_softmax + gather
LOGPROB_BACKWARD_OPS = {"_TokenLogprobBackward", "_ChunkedHeadLogprobBackward", "LogSoftmaxBackward0",
                        "GatherBackward0", "aten::_log_softmax_backward_data"}
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "


def op_category(chain):
    """The category (one of CATEGORIES, or "other") of one profiled op.

    Args:
        chain: list[str], the op's name then the names of the ranges around it, nearest first
            (e.g. ["aten::exp_", "_TokenLogprobBackward", "autograd::engine::evaluate_function:
            _TokenLogprobBackward"]).
    Rules: anything inside a scaled_dot_product_attention op is attention (SDPA's math fallback
    runs bmm and softmax inside it); otherwise the nearest name in the chain that belongs to a
    category decides, so a matmul inside the chunked log-prob backward (the LM head's recompute
    and its two gradient products) counts as a matmul, the in-place exp / scatter over [tokens, V]
    around it as the log-prob backward, and everything inside `Optimizer.step` / `zero_grad` or
    the GRAD_NORM label as the optimizer / the gradient norm. oneDNN's matmuls (mkldnn / onednn
    ops named linear, matmul, mm or gemm) are matmuls.
    """
    names = [n[len(AUTOGRAD_PREFIX):] if n.startswith(AUTOGRAD_PREFIX) else n for n in chain]
    if any("scaled_dot_product" in n.lower() or "scaleddotproduct" in n.lower() or "flash_attention" in n.lower()
           for n in names):
        return "attention"
    for n in names:
        low = n.lower()
        if n in MATMUL_OPS or (("mkldnn" in low or "onednn" in low)
                               and any(k in low for k in ("linear", "matmul", "_mm", "::mm", "gemm"))):
            return "matmul"
        if n in SAMPLING_OPS:
            return "sampling"
        if n in LOGPROB_BACKWARD_OPS:
            return "logprob_backward"
        if n.startswith("Optimizer.") or n.startswith("aten::_fused_adam"):
            return "optimizer"
        if n == GRAD_NORM:
            return "grad_norm"
    return "other"


def breakdown(ops, wall_s):
    """A stage's wall seconds split by category.

    Args:
        ops: iterable of (category, self seconds), one per profiled op (self time: the op's own
            time, its children's excluded, so the self times of all ops add up to the time the
            profiler saw at all).
        wall_s: the stage's wall seconds, measured around the same call.
    Returns:
        dict: seconds of each of CATEGORIES; "other_ops" (the self time of uncategorised ops);
        "untraced" = wall - the self time of all ops (Python, the framework, waiting);
        "other" = wall - the categorised self time = other_ops + untraced; "wall"; "ops" (how many:
        a cost paid per op, such as a thread pool's barrier, grows with it).
    """
    out = dict.fromkeys(CATEGORIES, 0.0)
    out["other_ops"], out["ops"] = 0.0, 0
    for category, seconds in ops:
        out["other_ops" if category == "other" else category] += seconds
        out["ops"] += 1
    categorised = sum(out[c] for c in CATEGORIES)
    out["untraced"] = wall_s - categorised - out["other_ops"]
    out["other"] = wall_s - categorised
    out["wall"] = wall_s
    return out


def profiled(fn, top):
    """Run fn() under torch.profiler (CPU). Returns (fn's result, wall seconds of the call,
    `breakdown` of its ops, the top `top` ops' table by self CPU time, those ops as {name: self s})."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t
    averages = sorted(prof.key_averages(), key=lambda x: -x.self_cpu_time_total)[:top]
    return (out, wall, breakdown(categorised_ops(prof), wall),
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top),
            {x.key: x.self_cpu_time_total / 1e6 for x in averages})


def categorised_ops(prof):
    """(op_category, self seconds) of every op a finished torch.profiler.profile recorded."""
    ops = []
    for e in prof.events():
        chain, up = [e.name], e.cpu_parent
        while up is not None:
            chain.append(up.name)
            up = up.cpu_parent
        ops.append((op_category(chain), e.self_cpu_time_total / 1e6))
    return ops


def labelled(fn, label):
    """fn inside torch.profiler.record_function(label) (a few microseconds a call without a profiler)."""
    def call(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return call


def format_breakdown(splits):
    """`breakdown`s by stage as a table: seconds and % of the stage's wall time."""
    cols = [*CATEGORIES, "other"]
    lines = [f"{'stage':<8} {'wall s':>7}  " + "  ".join(f"{c:>16}" for c in cols) + f"  {'(untraced)':>16}  {'ops':>7}"]
    for stage, d in splits.items():
        cell = [f"{d[c]:7.2f} ({100 * d[c] / d['wall']:3.0f}%)" for c in [*cols, "untraced"]]
        lines.append(f"{stage:<8} {d['wall']:7.2f}  " + "  ".join(f"{x:>16}" for x in cell) + f"  {d['ops']:7d}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The update's FLOPs

def matmul_shape(model):
    """The numbers `update_flops` needs from a causal LM.

    Returns:
        dict: layer_params (elements of every nn.Linear weight but the LM head's: the decoder
        layers' q, k, v, o, gate, up, down), head_params (the LM head's weight, V x d; tied to the
        embedding in SmolLM2, whose lookup is no matmul), last_layer_params and last_kv_params
        (the last decoder layer's linear weights, and of those its k_proj + v_proj; where a model
        names none so, all of the layer's), attn_width (query heads x head dim), n_layers.
    """
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]  # transformers' decoder layers
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layer_params = sum(m.weight.numel() for m in linears)
    last = ({n: m.weight.numel() for n, m in layers[-1].named_modules() if isinstance(m, torch.nn.Linear)}
            if layers else {"": layer_params // c.num_hidden_layers})
    kv = sum(v for n, v in last.items() if n.endswith(("k_proj", "v_proj"))) or sum(last.values())
    return {"layer_params": layer_params, "head_params": head.weight.numel(), "last_layer_params": sum(last.values()),
            "last_kv_params": kv, "attn_width": c.num_attention_heads * head_dim, "n_layers": c.num_hidden_layers}


def logprob_passes(prompt_ids, width, shared_prompt):
    """The forward passes one micro-batch's log-probs run (train.rows_logprobs), as
    (rows, context, new, head, cache_only) tuples: `rows` sequences each run `new` tokens after
    `context` cached ones, the LM head on `head` of them; lengths padded as the kernels see them;
    cache_only: only the pass's KV cache reaches the loss.

    shared_prompt (train.fast_paths, fast.completion_logprobs): when some rows share a prompt and
    no prompt is one token, each distinct prompt but its last token runs once, left-padded, its
    head on one position (cache_only: the loss sees its K/V, not its logits), then every row runs
    `width` tokens (the prompt's last and the completion's first width - 1) after that cache, the
    head on all `width`. Otherwise (rollout.completion_logprobs, and the fast twin's fallback):
    every row runs [left-padded prompt | width completion tokens], the head on the last width + 1.
    """
    n = len(prompt_ids)
    distinct, _ = fast.prompt_runs(prompt_ids)
    if shared_prompt and len(distinct) < n and min(map(len, distinct)) > 1:
        context = max(map(len, distinct)) - 1
        return [(len(distinct), 0, context, 1, True), (n, context, width, width, False)]
    return [(n, 0, max(map(len, prompt_ids)) + width, width + 1, False)]


def update_passes(prompt_ids, completion_mask, *, micro_batch_size, updates_per_batch, minibatches, group_size,
                  shared_prompt):
    """The passes of train.update_policy over one batch, as `logprob_passes` tuples.

    Args:
        prompt_ids: list[list[int]] (N); completion_mask: FloatTensor [N, L] (a micro-batch runs
            its longest masked completion, train.rows_logprobs). The rest: update_policy's.
    Returns:
        (with_grad, no_grad): the passes of every optimizer step's micro-batches, and of the
        behaviour pass (frozen_logprobs, run when the update is off-policy: updates_per_batch > 1
        or minibatches > 1).
    """
    def passes(rows):
        width = max(1, int(completion_mask[rows].sum(-1).max()))
        return logprob_passes([prompt_ids[i] for i in rows], width, shared_prompt)
    n = len(prompt_ids)
    mb_rows = n // group_size // minibatches * group_size
    with_grad = [p for _ in range(updates_per_batch) for m in range(minibatches)
                 for rows in train.micro_batches(range(m * mb_rows, (m + 1) * mb_rows), micro_batch_size)
                 for p in passes(rows)]
    off_policy = updates_per_batch > 1 or minibatches > 1
    no_grad = [p for rows in train.micro_batches(range(n), micro_batch_size) for p in passes(rows)] if off_policy else []
    return with_grad, no_grad


def update_flops(with_grad, no_grad, *, layer_params, head_params, last_layer_params, last_kv_params, attn_width,
                 n_layers):
    """Model FLOPs of the update: the matrix products of its forwards and backwards, from the
    model's shape (`matmul_shape`) and the token counts of its passes (`update_passes`).

    A forward pass (rows, context, new, head, cache_only) costs

        F = rows * (2 * layer_params * new + 2 * head_params * head + 4 * n_layers * attn_width * pairs),
        pairs = new * context + new * (new + 1) / 2

    (a weight element does one multiply-add per token; attention's QK^T and PV one per query-key
    pair and channel, causally: the i-th new token sees the context and i new tokens). Its
    backward costs B = 2 F (gradients w.r.t. the inputs and the weights: twice the forward's
    products), except for a cache_only pass (the shared prompt): only its K/V reach the loss, so
    its head and its last layer's q, o, MLP and attention get no gradient:

        B = 2 * rows * (2 * (layer_params - last_layer_params + last_kv_params) * new
                        + 4 * (n_layers - 1) * attn_width * pairs).

    update = sum (F + B) over the passes with grad + sum F over the no-grad (behaviour) passes.
    Counted as the kernels run them (padding included), without recomputation (activation
    checkpointing, the chunked LM head's backward): "model FLOPs". Norms, activations, the
    embedding lookup and the softmax are left out (elementwise).

    Returns:
        dict of FLOPs: "matmul" (the linear layers and the LM head), "attention", "total".
    """
    def count(passes, backward):
        lin = att = 0
        for rows, ctx, new, head, cache_only in passes:
            pairs = new * ctx + new * (new + 1) // 2
            lin += rows * (2 * layer_params * new + 2 * head_params * head)
            att += rows * 4 * n_layers * attn_width * pairs
            if backward and cache_only:
                lin += 2 * rows * 2 * (layer_params - last_layer_params + last_kv_params) * new
                att += 2 * rows * 4 * (n_layers - 1) * attn_width * pairs
            elif backward:
                lin += 2 * rows * (2 * layer_params * new + 2 * head_params * head)
                att += 2 * rows * 4 * n_layers * attn_width * pairs
        return lin, att
    (lg, ag), (ln, an) = count(with_grad, True), count(no_grad, False)
    out = {"matmul": lg + ln, "attention": ag + an}
    out["total"] = out["matmul"] + out["attention"]
    return out


def rate(flops, seconds):
    """GFLOP/s (0 when no time was spent)."""
    return flops / seconds / 1e9 if seconds > 0 else 0.0


def matmul_peak(n=2048, repeats=5, library="torch.mm"):
    """This machine's fp32 matmul rate on torch's current threads: GFLOP/s of the best of `repeats`
    [n, n] @ [n, n] products (2 n^3 FLOPs each), after one untimed.

    library: "torch.mm" (what the model's matmuls call: MKL's sgemm in the CPU wheels,
    `kernel_libraries`), or "onednn" (torch.ops.aten.mkldnn_linear on oneDNN tensors, fp32, the
    same IEEE arithmetic): MKL and oneDNN pick their code paths per CPU vendor, so on one CPU the
    two can differ by far (issue 36 asks about the dispatch on AMD).
    """
    x, y = torch.randn(n, n), torch.randn(n, n)
    if library == "onednn":
        xm, wm = x.to_mkldnn(), y.t().contiguous().to_mkldnn()  # x @ y = linear(x, y^T)

        def run():
            return torch.ops.aten.mkldnn_linear(xm, wm)
    else:
        out = torch.empty(n, n)

        def run():
            return torch.mm(x, y, out=out)
    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


# ----------------------------------------------------------------------------------------------
# The machine, and the update run again

THREAD_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "DNNL_", "ONEDNN_", "ATEN_", "TORCH_", "OPENBLAS_", "MALLOC_", "LD_PRELOAD")


def machine_info():
    """The CPU and torch's threading / BLAS / oneDNN settings, as a dict of strings and numbers."""
    cpus = []  # one {field: value} per logical CPU of /proc/cpuinfo
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for block in f.read().strip().split("\n\n"):
                cpus.append({k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in block.splitlines())})
    first = cpus[0] if cpus else {}
    flags = first.get("flags", "").split()
    show = torch.__config__.show()
    blas = [ln.strip(" -") for ln in show.splitlines()
            if any(k in ln for k in ("Math Kernel", "MKL-DNN", "oneDNN", "OpenBLAS", "CPU capability"))]
    blas += re.findall(r"\b(?:BLAS_INFO|LAPACK_INFO|USE_MKL|USE_MKLDNN|USE_OPENMP)=[^,\s]*", show)
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(),
            "cpu": first.get("model name", "unknown"), "vendor": first.get("vendor_id"),
            "family_model": f"{first.get('cpu family')}/{first.get('model')}", "mhz": first.get("cpu MHz"),
            "cache": first.get("cache size"),
            "physical_cores": len({(c.get("physical id"), c.get("core id")) for c in cpus}),
            "cpu_flags": " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags),
            "os_cpus": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "num_threads": torch.get_num_threads(),
            "num_interop_threads": torch.get_num_interop_threads(),
            "mkldnn": torch.backends.mkldnn.is_available(), "mkl": torch.backends.mkl.is_available(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas, **kernel_libraries(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(THREAD_ENV)},
            "parallel_info": torch.__config__.parallel_info()}


def kernel_libraries():
    """Which library runs an fp32 torch.mm, and the code path MKL and oneDNN pick on this CPU, from
    their own verbose lines (MKL's names the ISA branch it dispatched to; on a CPU it does not
    recognise it says only "Intel(R) Architecture processors"; oneDNN's says "isa:...")."""
    def stdout_of(fn):  # the C libraries print to file descriptor 1
        with tempfile.TemporaryFile() as f:
            sys.stdout.flush()
            saved = os.dup(1)
            os.dup2(f.fileno(), 1)
            try:
                fn()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            f.seek(0)
            return f.read().decode(errors="replace")

    def mm():
        with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))

    def onednn():
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            torch.nn.functional.linear(torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16))
    out = {"fp32_mm": "unknown", "mkl_code_path": None, "onednn_isa": None}
    if torch.backends.mkl.is_available():
        text = stdout_of(mm)
        out["fp32_mm"] = "MKL sgemm" if "SGEMM" in text else "not MKL (no MKL_VERBOSE SGEMM line)"
        out["mkl_code_path"] = next((ln.split(" for ", 1)[-1] for ln in text.splitlines() if "oneMKL" in ln or "Intel(R) MKL" in ln), None)
    if torch.backends.mkldnn.is_available():
        out["onednn_isa"] = next((ln.split("isa:", 1)[1] for ln in stdout_of(onednn).splitlines() if "isa:" in ln), None)
    return out


def print_machine(m):
    print(f"{m['date']}, load average (1, 5, 15 min) {' '.join(f'{x:.1f}' for x in m['load_average'])}")
    print(f"CPU: {m['cpu']} ({m['vendor']}, family/model {m['family_model']}, {m['mhz']} MHz, cache {m['cache']}; "
          f"{m['os_cpus']} logical CPUs on {m['physical_cores']} cores, {m['affinity_cpus']} in this process's affinity; "
          f"{m['cpu_flags']})")
    print(f"torch {m['torch']}: {m['num_threads']} threads, {m['num_interop_threads']} inter-op; "
          f"mkldnn {m['mkldnn']}, mkl {m['mkl']}, CPU capability {m['cpu_capability']}")
    print("BLAS / oneDNN: " + "; ".join(m["blas"]))
    print(f"fp32 torch.mm runs on: {m['fp32_mm']}; MKL's code path: {m['mkl_code_path']}; oneDNN's ISA: {m['onednn_isa']}")
    print("env: " + (" ".join(f"{k}={v}" for k, v in m["env"].items()) or "no OMP_/MKL_/KMP_/DNNL_ variables set"))
    print(m["parallel_info"].rstrip())


def steal_seconds(stat_text, ticks_per_s):
    """Seconds the hypervisor ran other guests on this VM's CPUs (all CPUs summed), from the text
    of /proc/stat: the 8th number of its "cpu" line, in clock ticks."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return int(fields[8]) / ticks_per_s if len(fields) > 8 else 0.0
    return 0.0


def spread(seconds):
    """min, median, max of a list of seconds, and (max - min) / median."""
    mid = statistics.median(seconds)
    return {"min": min(seconds), "median": mid, "max": max(seconds),
            "range_over_median": (max(seconds) - min(seconds)) / mid if mid > 0 else 0.0}


def counters():
    """(wall, process CPU = user + system of all its threads, steal, involuntary context switches)."""
    with open("/proc/stat") as f:
        steal = steal_seconds(f.read(), os.sysconf("SC_CLK_TCK"))
    t = os.times()
    return time.perf_counter(), t.user + t.system, steal, resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def repeat_update(update, runs, *, profile, flops, peak, library="torch.mm"):
    """Run update() `runs` times; print and return each run's figures and the spread of its seconds.
    A run whose CPU seconds / wall stay near the thread count but whose wall grows lost time to
    other guests (steal) or processes; one whose CPU seconds grow with its wall did more work or spun.
    Before each run a small matmul probe (`matmul_peak` at n = 1024, best of 3, ~0.05 s) says
    whether the machine itself was slower then (frequency, neighbours) or only the update."""
    print(f"\nupdate stage x {runs} (same batch; the optimizer steps each time):")
    header = (f"{'run':>3} {'wall s':>7} {'cpu s':>7} {'cpu/wall':>8} {'steal s':>7} {'inv. csw':>8} {'GFLOP/s':>7} "
              f"{'probe':>7}")
    print(header + ("  " + "  ".join(f"{c:>9}" for c in [*CATEGORIES, "other"]) if profile else ""))
    rows = []
    for i in range(runs):
        probe = matmul_peak(1024, repeats=3)
        if profile:  # the counters inside the profile: its start, stop and the op walk are not the run's
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                before = counters()
                update()
                after = counters()
        else:
            before = counters()
            update()
            after = counters()
        wall, cpu, steal, csw = (b - a for a, b in zip(before, after))
        split = breakdown(categorised_ops(prof), wall) if profile else None
        row = {"wall_s": wall, "cpu_s": cpu, "steal_s": steal, "involuntary_csw": csw, "gflops": rate(flops, wall),
               "probe_gflops": probe, "split": split}
        rows.append(row)
        line = f"{i + 1:>3} {wall:7.2f} {cpu:7.2f} {cpu / wall:8.2f} {steal:7.2f} {csw:8d} {row['gflops']:7.1f} {probe:7.1f}"
        print(line + ("  " + "  ".join(f"{split[c]:9.2f}" for c in [*CATEGORIES, "other"]) if profile else ""))
    s = spread([r["wall_s"] for r in rows])
    print(f"spread: min {s['min']:.2f} s, median {s['median']:.2f} s, max {s['max']:.2f} s "
          f"((max - min) / median {100 * s['range_over_median']:.0f}%); median {rate(flops, s['median']):.1f} GFLOP/s "
          f"= {100 * rate(flops, s['median']) / peak:.0f}% of {library}'s peak (the library the linears ran on)")
    return {"runs": rows, "spread": s}


if __name__ == "__main__":
    main()
