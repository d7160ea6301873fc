"""GPU check of the scale-out path (SPEC §7, issue 5); called by scripts/gpu_check.sh.

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
tokens/s, peak memory, vLLM-trainer gap) into one JSON file and prints it.

Written without a GPU: none of these figures has been measured yet.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402

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
    return torch.tensor(rollout.vllm_token_logprobs(ids[start:], out.prompt_logprobs[start:]))


def trainer_score(model, ids, start):
    lp = rollout.completion_logprobs(model, [ids[:start]], torch.tensor([ids[start:]]), 0)
    return lp[0].float().cpu()


def engine_checks(model_path, out_path):
    from vllm import SamplingParams
    res = {"model": model_path, "gpu": torch.cuda.get_device_name(0)}
    model, tok = rollout.load_model(model_path, "bfloat16", "cuda")
    model.eval()
    eos = rollout.eos_ids(model, tok)
    t = time.perf_counter()
    llm = rollout.make_vllm_engine(model_path, "bfloat16", 0.3, 2048, enforce_eager=False, seed=0)
    res["engine_start_s"] = time.perf_counter() - t
    res["used_gib_after_start"] = used_gib()

    # 1. generation throughput (sampling, T = 1, like training)
    questions = [f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
                 for a in range(3, 67) for b in (5,)]
    prompts = [rollout.build_prompt_ids(tok, q + "\nPut the final answer within \\boxed{}.", True) for q in questions]
    t = time.perf_counter()
    r = rollout.generate_vllm(llm, tok, prompts, 8, 256, seed=1, eos=eos)
    dt = time.perf_counter() - t
    res["gen"] = {"prompts": len(prompts), "group_size": 8, "max_new_tokens": 256, "seconds": dt,
                  "tokens": int(r["completion_mask"].sum()), "tokens_per_s": float(r["completion_mask"].sum()) / dt,
                  "truncated_frac": float(r["truncated"].float().mean())}
    # the rollout log-probs vs the trainer's on the same samples (first 32 rows)
    n = 32
    width = int(r["completion_mask"][:n].sum(-1).max())
    with torch.no_grad():
        tr = rollout.completion_logprobs(model, r["prompt_ids"][:n], r["completion_ids"][:n, :width], tok.pad_token_id).float().cpu()
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
        engine = {"llm": llm, "asleep": False, "sleep_level": 1, "tied": bool(model.config.tie_word_embeddings)}
        rollout.vllm_sleep(engine)
        t = time.perf_counter()
        rollout.vllm_push_weights(engine, model.state_dict().items())
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
    res = {"measured": True, "note": "scripts/gpu_check.sh on one GPU; see docs_scale.md"}
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
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["engine", "data", "report"])
    ap.add_argument("--model")
    ap.add_argument("--out", required=True)
    ap.add_argument("inputs", nargs="*")
    a = ap.parse_intermixed_args()
    if a.what == "engine":
        engine_checks(a.model, a.out)
    elif a.what == "data":
        synthetic_data(a.out)
    else:
        report(a.out, a.inputs[0], a.inputs[1:])


if __name__ == "__main__":
    main()
