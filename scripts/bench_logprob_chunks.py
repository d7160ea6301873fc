"""Peak memory and time of ONE update of configs/cpu.yaml with and without chunked log-probs
(train.logprob_chunk_tokens, fast.head_logprobs; issue 26 item 5).

    python scripts/bench_logprob_chunks.py --chunks 0 128 256 --repeats 2
    python scripts/bench_logprob_chunks.py --what logprobs --chunks 0 128 256   # one micro-batch's forward + backward

The batch: step 0's P x G GSM8K prompts of configs/cpu.yaml (SmolLM2-135M-Instruct, float32,
micro-batches of train.micro_batch_size rows) with random completions of the full
rollout.max_new_tokens (the longest a micro-batch gets), all tokens masked in. Each setting runs in
a fresh subprocess: one update to warm up (AdamW allocates its state), then the peak RSS is reset
(/proc/self/clear_refs) and a second update is timed; printed: seconds and the peak RSS over the
RSS before that update (what the update itself adds: logits, activations, gradients).
--what logprobs: the same for the log-probs of ONE micro-batch (fast.completion_logprobs, forward
and backward of sum(logp), no optimizer), where the logits are a larger share of the peak.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rss_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def child(chunk, config, overrides, what):
    import torch
    import rollout
    import train
    from plumbing import config as C
    from plumbing.config import load_config
    from plumbing.items import load_train_items
    from plumbing.models import load_model
    from plumbing.prompts import policy_chat
    from plumbing.run import update_kwargs
    from plumbing.scale import wrap_policy
    cfg = load_config([config], [f"train.logprob_chunk_tokens={chunk}", *overrides])
    C.validate_config(cfg)
    ro, P, G = cfg["rollout"], cfg["rollout"]["prompts_per_step"], cfg["rollout"]["group_size"]
    policy, tok = load_model(cfg["model"]["policy"], "float32", "cpu")
    model = wrap_policy(policy, "ddp", 1, torch.device("cpu"), gradient_checkpointing=cfg["model"]["gradient_checkpointing"])
    chat = policy_chat(tok, cfg["model"])
    items = rollout.step_items(load_train_items(cfg), 0, P, cfg["run"]["seed"], rank=0, world=1)
    prompts = [rollout.build_prompt_ids(tok, cfg["data"]["prompt_template"].format(question=it["question"]), chat)
               for it in items for _ in range(G)]
    comp = torch.randint(3, len(tok), (P * G, ro["max_new_tokens"]), generator=torch.Generator().manual_seed(0))
    batch = {"prompt_ids": prompts, "completion_ids": comp, "completion_mask": torch.ones(comp.shape),
             "advantages": torch.linspace(-1, 1, P * G)}
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    passes = train.fast_or_plain(cfg["train"]["fast_paths"], chunk)
    # train.update_policy's arguments as train.train binds them from the config (CISPO or GRPO, its numbers)
    settings = update_kwargs(cfg, passes, torch.device("cpu"), cispo_loss=train.cispo_loss, grpo_loss=train.grpo_loss,
                             world=1, pad_id=tok.pad_token_id)
    train.update_policy(model, policy, opt, batch, **settings)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    before = rss_mb("VmRSS")
    t0 = time.perf_counter()
    if what == "logprobs":
        mb = cfg["train"]["micro_batch_size"]
        lp = settings["logprobs"](model, prompts[:mb], comp[:mb], prompt_model=policy)
        lp.sum().backward()
        upd = {"loss": float(lp.detach().sum())}
    else:
        upd = train.update_policy(model, policy, opt, batch, **settings)
    print(json.dumps({"what": what, "chunk": chunk, "update_s": time.perf_counter() - t0, "rss_before_mb": before,
                      "peak_mb": rss_mb("VmHWM"), "added_mb": rss_mb("VmHWM") - before, "loss": upd["loss"],
                      "tokens_per_micro_batch": cfg["train"]["micro_batch_size"] * ro["max_new_tokens"]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 128], help="train.logprob_chunk_tokens values")
    ap.add_argument("--repeats", type=int, default=1, help="runs per value (alternating)")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/cpu.yaml"), help="the preset")
    ap.add_argument("--what", default="update", choices=["update", "logprobs"], help="what is measured")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child, a.config, a.overrides, a.what)
    for _ in range(a.repeats):
        for c in a.chunks:
            subprocess.run([sys.executable, __file__, "--child", str(c), "--what", a.what, "--config", a.config, *a.overrides], check=True)


if __name__ == "__main__":
    main()
