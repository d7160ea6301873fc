"""Where an RLME step's time goes: seconds by stage, top ops by stage, and the cost of K meta-questions.

    python scripts/profile_step.py                         # configs/cpu.yaml: P=4, G=4, N=128, SmolLM2 fp32
    python scripts/profile_step.py --K 1 4 --ops 8 rollout.max_new_tokens=64

Runs the three stages of train.py's step on one batch with the same functions train.py calls
(fast.generate, reward.rlme_reward, train.update_policy), after one untimed warm-up step:
  1. seconds per stage and generated tokens/s;
  2. the top `--ops` operators of each stage (torch.profiler, self CPU time);
  3. the reward stage with K = 1 and K = 4 meta-questions on the same completions (issue 6 asks
     K = 4 to cost <= 1.5 x K = 1: the K prompts share the problem+solution prefix).
"""
import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

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
        times, ops = {}, {}

        def timed(name, fn):
            t = time.perf_counter()
            if profiler:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out = fn()
                ops[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.ops)
            else:
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
        timed("update", lambda: train.update_policy(policy, policy, optimizer, b, **settings))
        return times, ops, out, samples

    step(0)  # warm-up: allocator, caches, AdamW state
    times, _, out, samples = step(1)
    tokens = float(out["completion_mask"].sum())
    print(f"P={ro['prompts_per_step']} G={ro['group_size']} N={ro['max_new_tokens']} "
          f"micro-batch train={cfg['train']['micro_batch_size']} reward={rw['micro_batch_size']}")
    print("seconds by stage: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
          + f", step {sum(times.values()):.1f}; rollout {tokens / times['rollout']:.0f} generated tokens/s")
    _, ops, _, _ = step(2, profiler=True)
    for name, table in ops.items():
        print(f"\n--- {name}: top ops by self CPU time ---\n{table}")
    print("\nreward stage vs number of meta-questions K (same completions):")
    base = None
    for k in a.K:
        t = time.perf_counter()
        R.rlme_reward(evaluators, questions(k), [it["question"] for it in samples], out["completions"],
                      template=template)
        dt = time.perf_counter() - t
        base = base or dt
        print(f"  K={k}: {dt:.1f} s  ({dt / base:.2f} x K={a.K[0]})")


if __name__ == "__main__":
    main()
