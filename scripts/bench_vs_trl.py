"""Side-by-side benchmark: the same RLME step in our train.py and in TRL's GRPOTrainer (issue 6).

    # trl==1.16.0 comes with requirements.txt (plumbing.reward_functions.trl_reward_function is tested inside TRL)
    python scripts/bench_vs_trl.py --pairs 2 --steps 4              # P=4, G=4, N=128, SmolLM2 fp32 CPU
    python scripts/bench_vs_trl.py --check-loss                     # same loss and gradient on one batch
    python scripts/bench_vs_trl.py --check-loss model.gradient_checkpointing=selective   # ours checkpointed

What is "the same step": one rollout batch of P prompts x G completions of at most N new tokens
(T = 1, top_p = 1, no top-k), the live self-evaluation reward log P("Yes" | evaluator prompt) of
reward.py computed by the policy itself (the same function and prompt on both sides, so the
reward stage measures the same code), then one CISPO optimizer step with on-policy ratio 1,
mean-only advantages, no KL, the summed token loss divided by the batch's token count, AdamW at
a constant learning rate, grad clip 1, micro-batches of --micro-batch sequences (4).
TRL: GRPOTrainer(loss_type="cispo", importance_sampling_level="sequence", scale_rewards="none",
beta=0), everything else at TRL's defaults except fp32 (bf16=False) and the values above;
`--trl-gradient-checkpointing 0` turns off TRL's default activation checkpointing.

Every run is a fresh subprocess, so its peak RSS is its own; the runs alternate A B A B so both
sides see the same machine load. Printed per run: median seconds per step (the first step is
excluded: it warms allocators and caches), seconds by stage (rollout, reward, update), generated
tokens/s during rollout, peak RSS; and per pair the ratio ours/TRL. A JSON summary goes to --out.
`--check-loss` shows that both sides compute the same thing: our update and TRL's loss on one
fixed batch, losses and gradients compared (`check_loss`).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from plumbing.config import load_config  # noqa: E402
from plumbing.items import load_train_items  # noqa: E402
from plumbing.models import load_model  # noqa: E402
from plumbing.prompts import policy_chat  # noqa: E402
from plumbing.run import update_kwargs  # noqa: E402
from plumbing.scale import wrap_policy  # noqa: E402

# Our config values that make our step TRL's: TRL's CISPO divides the summed token loss by the
# batch's token count (our token_mean; our default, RLME Eq. 8, divides by the sequence count:
# one scalar, no cost, other numbers), and TRL here runs a constant learning rate.
OURS_AS_TRL = ["algo.aggregation=token_mean", "optim.warmup_steps=0", "optim.schedule=constant"]


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


def run_child(cmd, what):
    """Run one timed side in a fresh process; its stdout (progress bars) is dropped, its stderr
    shown. SystemExit (one line) when it fails: its own error is the line above."""
    if subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL).returncode:
        raise SystemExit(f"bench: {what} failed (its error is above)")


def summarize(steps):
    """steps: list of dicts {step, rollout, reward, update, tokens}; median over steps 2.. ."""
    timed = steps[1:] if len(steps) > 1 else steps
    med = lambda k: statistics.median(s[k] for s in timed)
    out = {k: med(k) for k in ("step", "rollout", "reward", "update")}
    out["tokens_per_s"] = sum(s["tokens"] for s in timed) / max(sum(s["rollout"] for s in timed), 1e-9)
    return out


# ----------------------------------------------------------------------------------------------
# Our side: train.py itself, read back from metrics.jsonl


def run_ours(a):
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", a.config,
               f"run.out_dir={out_dir}", f"run.total_steps={a.steps}", "run.save_every=0",
               f"rollout.prompts_per_step={a.P}", f"rollout.group_size={a.G}", f"rollout.max_new_tokens={a.N}",
               f"train.micro_batch_size={a.micro_batch}", f"reward.micro_batch_size={a.micro_batch}",
               *OURS_AS_TRL, *a.ours_override]
        t = time.perf_counter()
        run_child(cmd, "our train.py")
        wall = time.perf_counter() - t
        rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps = [{"step": r["time/step"], "rollout": r["time/rollout"], "reward": r["time/reward"],
              "update": r["time/update"], "tokens": r["completion/length_mean"] * a.P * a.G} for r in rows]
    return {"side": "ours", "steps": steps, "peak_rss_mb": max(r["memory/peak_mb"] for r in rows), "wall_s": wall,
            "loss": [r["loss"] for r in rows], "reward_mean": [r["reward/mean"] for r in rows]}


# ----------------------------------------------------------------------------------------------
# TRL's side: GRPOTrainer in this process (called as a child with --side trl)


def self_evaluation_reward(model, tok, chat, cfg, questions, completions, micro_batch):
    """RLME Eq. 2-3 with one live evaluator, the policy scoring its own answers: reward.py's
    rlme_reward with the config's meta-questions and template, the same call on both sides.
    Returns FloatTensor [N]."""
    import reward as R
    rw = cfg["reward"]
    import fast
    ev = [R.local_evaluator(model, tok, chat=chat, name="live", weight=1.0, answer_stub=rw["answer_stub"],
                            micro_batch_size=micro_batch, score=fast.score_targets)]
    return R.rlme_reward(ev, rw["meta_questions"], questions, completions,
                         template=rw["evaluator_template"] or R.DEFAULT_EVALUATOR_TEMPLATE)["reward"]


def trl_args(a, cfg):
    """TRL's GRPOConfig for the same step as ours: CISPO with sequence-level importance weights,
    advantages r - group mean, no KL, fp32 on the CPU, our optimiser settings; the rest TRL's defaults."""
    from trl import GRPOConfig
    o = cfg["optim"]
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, max_steps=a.steps, seed=cfg["run"]["seed"], shuffle_dataset=False,
        per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.P * a.G // a.micro_batch,
        num_generations=a.G, max_completion_length=a.N, temperature=1.0, top_p=1.0, top_k=0,
        loss_type="cispo", importance_sampling_level="sequence", scale_rewards="none", beta=0.0,
        epsilon_high=1.0 + cfg["algo"]["eps_high"], learning_rate=o["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=o["weight_decay"], adam_beta1=o["beta1"], adam_beta2=o["beta2"],
        max_grad_norm=o["grad_clip"], gradient_checkpointing=bool(a.trl_gradient_checkpointing),
        dataloader_num_workers=0, log_completions=False,
    )


def run_trl_child(a):
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import fast
    import rollout
    from plumbing import config

    cfg = load_config([a.config], [f"rollout.prompts_per_step={a.P}", f"rollout.group_size={a.G}",
                                   f"rollout.max_new_tokens={a.N}"])
    policy, tok = load_model(cfg["model"]["policy"], "float32", "cpu")
    chat = policy_chat(tok, cfg["model"])
    # the same prompts in the same order as our run: step_items for steps 0..S-1
    items = load_train_items(cfg)
    rows = []
    for step in range(a.steps):
        for it in rollout.step_items(items, step, a.P, cfg["run"]["seed"], rank=0, world=1):
            text = cfg["data"]["prompt_template"].format(question=it["question"])
            rows.append({"prompt": [{"role": "user", "content": text}] if chat else text, "question": it["question"]})
    holder = {}

    def live_self_eval(prompts, completions, question, **kwargs):
        """TRL's reward function: the policy being trained scores its own answers."""
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return self_evaluation_reward(holder["trainer"].model, tok, chat, cfg, questions=list(question),
                                      completions=texts, micro_batch=a.micro_batch).tolist()

    args = trl_args(a, cfg)
    timers = {"rollout": 0.0, "reward": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    steps, logs = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timers.update(rollout=0.0, reward=0.0, t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            total = time.perf_counter() - timers["t0"]
            steps.append({"step": total, "rollout": timers["rollout"], "reward": timers["reward"],
                          "update": total - timers["rollout"] - timers["reward"]})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                holder.setdefault("logs", []).append(dict(logs))

    trainer = GRPOTrainer(model=policy, processing_class=tok, reward_funcs=live_self_eval, args=args,
                          train_dataset=Dataset.from_list(rows), callbacks=[StepTimer()])
    holder["trainer"] = trainer
    # stage timers around TRL's own generation and reward calls (the reward is the same function as ours)
    trainer._generate_single_turn = timed("rollout", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    torch.manual_seed(cfg["run"]["seed"])
    trainer.train()
    for s, lg in zip(steps, holder.get("logs", [])):
        s["tokens"] = lg["completions/mean_length"] * a.P * a.G
    return {"side": "trl", "steps": steps, "peak_rss_mb": peak_rss_mb(),
            "loss": [lg.get("loss") for lg in holder.get("logs", [])],
            "reward_mean": [lg.get("reward") for lg in holder.get("logs", [])]}


def run_trl(a):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--side", "trl", "--result", f.name,
               "--config", a.config, "--steps", str(a.steps), "--P", str(a.P), "--G", str(a.G), "--N", str(a.N),
               "--micro-batch", str(a.micro_batch), "--trl-gradient-checkpointing", str(a.trl_gradient_checkpointing)]
        t = time.perf_counter()
        run_child(cmd, "the TRL run")
        res = json.load(open(f.name))
        res["wall_s"] = time.perf_counter() - t
        return res


# ----------------------------------------------------------------------------------------------
# The same numbers: both losses and gradients on one fixed batch (--check-loss)


def check_loss(a):
    """Our update's loss and gradient vs TRL's `_compute_loss` on ONE fixed batch.

    The batch: step 0's P prompts, G completions each from our sampler (the run's seed), the
    live self-evaluation reward of reward.py, advantages r - group mean. Both sides get the same
    token ids, masks and advantages in micro-batches of --micro-batch rows; ours runs
    train.update_policy (shared prompt pass, closed-form log-prob backward, token_mean
    normaliser) with an optimiser that only records the gradient, TRL runs its loss per
    micro-batch exactly as its training_step would (one full forward per row, then backward).
    Prints both losses and the gradient difference; exits 1 when they disagree beyond 1e-4.
    Extra key=value overrides apply to our side (e.g. model.gradient_checkpointing=selective).
    """
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    import fast
    import rollout
    import train
    from plumbing import config

    over = [f"rollout.prompts_per_step={a.P}", f"rollout.group_size={a.G}", f"rollout.max_new_tokens={a.N}",
            f"train.micro_batch_size={a.micro_batch}", *a.ours_override, "optim.grad_clip=0", *OURS_AS_TRL]
    cfg = load_config([a.config], over)
    config.validate_config(cfg)
    ro = cfg["rollout"]
    policy, tok = load_model(cfg["model"]["policy"], "float32", "cpu")
    # as train.py wraps it (one process: activation checkpointing if the overrides ask for it)
    model = wrap_policy(policy, "ddp", 1, torch.device("cpu"),
                              gradient_checkpointing=cfg["model"]["gradient_checkpointing"])
    chat = policy_chat(tok, cfg["model"])
    items = rollout.step_items(load_train_items(cfg), 0, a.P, cfg["run"]["seed"], rank=0, world=1)
    prompt_ids = [rollout.build_prompt_ids(tok, cfg["data"]["prompt_template"].format(question=it["question"]), chat)
                  for it in items]
    out = fast.generate(policy, tok, prompt_ids, group_size=a.G, max_new_tokens=a.N, temperature=ro["temperature"],
                           top_p=ro["top_p"], top_k=ro["top_k"], seed=train.sampling_seed(cfg["run"]["seed"], 0, 0))
    questions = [it["question"] for it in items for _ in range(a.G)]
    rewards = self_evaluation_reward(policy, tok, chat, cfg, questions=questions, completions=out["completions"],
                                     micro_batch=a.micro_batch)
    advantages = train.group_advantages(rewards, a.G)
    mask = out["completion_mask"]
    batch = {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"], "completion_mask": mask,
             "advantages": advantages}

    def gradient():
        g = torch.cat([p.grad.flatten() for p in policy.parameters()])
        policy.zero_grad(set_to_none=True)
        return g

    # ours: the optimiser's step() records the gradient instead of applying it
    grads = {}
    recorder = types.SimpleNamespace(step=lambda: grads.update(ours=gradient()), zero_grad=lambda set_to_none=True: None)
    passes = train.fast_or_plain(cfg["train"]["fast_paths"], cfg["train"]["logprob_chunk_tokens"])
    # train.update_policy's arguments as train.train binds them from the config (CISPO or GRPO, its numbers)
    settings = update_kwargs(cfg, passes, torch.device("cpu"), cispo_loss=train.cispo_loss, grpo_loss=train.grpo_loss,
                             world=1, pad_id=tok.pad_token_id)
    ours_loss = train.update_policy(model, policy, recorder, batch, **settings)["loss"]

    # TRL: its loss per micro-batch, inputs as its _generate_and_score_completions builds them
    trainer = GRPOTrainer(model=policy, processing_class=tok, reward_funcs=lambda **kw: [0.0] * len(kw["prompts"]),
                          args=trl_args(a, cfg), train_dataset=Dataset.from_list([{"prompt": "x"}] * a.P))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = a.P * a.G // a.micro_batch
    trl_loss = 0.0
    for s in range(0, a.P * a.G, a.micro_batch):
        rows = list(range(s, s + a.micro_batch))
        p_ids, p_mask = rollout.left_pad([out["prompt_ids"][i] for i in rows], tok.pad_token_id)
        inputs = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": out["completion_ids"][rows],
                  "completion_mask": mask[rows].long(), "advantages": advantages[rows],
                  "num_items_in_batch": mask.sum(), "old_per_token_logps": None}
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        trl_loss += loss.item()
    grads["trl"] = gradient()

    g_ours, g_trl = grads["ours"].double(), grads["trl"].double()  # float64: 135M-term sums
    rel = float((g_ours - g_trl).norm() / g_trl.norm())
    print(f"fixed batch: {a.P} prompts x {a.G} completions, {int(mask.sum())} completion tokens, "
          f"rewards {[round(float(r), 3) for r in rewards]}")
    print(f"loss        ours {ours_loss:.8f}   TRL {trl_loss:.8f}   |diff| {abs(ours_loss - trl_loss):.2e}")
    print(f"grad norm   ours {float(g_ours.norm()):.8f}   TRL {float(g_trl.norm()):.8f}")
    print(f"gradient    |ours - TRL| / |TRL| = {rel:.2e}, max |diff| {float((g_ours - g_trl).abs().max()):.2e}, "
          f"cosine {float(torch.nn.functional.cosine_similarity(g_ours, g_trl, dim=0)):.8f}")
    same = abs(ours_loss - trl_loss) <= 1e-4 * max(1.0, abs(trl_loss)) and rel <= 1e-4
    print("the same loss and gradient (within 1e-4)" if same else "DIFFERENT")
    return same


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "cpu.yaml"))
    p.add_argument("--pairs", type=int, default=2, help="A B pairs to run (ours, then TRL)")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    p.add_argument("--P", type=int, default=4, help="prompts per step")
    p.add_argument("--G", type=int, default=4, help="completions per prompt")
    p.add_argument("--N", type=int, default=128, help="max new tokens")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward, both sides")
    p.add_argument("--trl-gradient-checkpointing", type=int, default=1, help="TRL's default is 1 (on)")
    p.add_argument("--only", choices=["ours", "trl"], help="run one side only (e.g. a scaling sweep)")
    p.add_argument("--out", default=None, help="JSON summary file")
    p.add_argument("--check-loss", action="store_true",
                   help="instead of timing: compare our loss and gradient with TRL's on one fixed batch")
    p.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("ours_override", nargs="*", help="extra key=value overrides for our train.py")
    a = p.parse_args(argv)
    if a.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is not timed)")
    for name in ("pairs", "P", "G", "N", "micro_batch"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if (a.P * a.G) % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch} must divide P*G = {a.P * a.G}")
    if a.side == "trl":
        json.dump(run_trl_child(a), open(a.result, "w"))
        return
    if a.only != "ours" or a.check_loss:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -r requirements.txt (it pins trl==1.16.0), or use --only ours")
    if a.check_loss:
        raise SystemExit(0 if check_loss(a) else 1)

    sides = [s for s in ("ours", "trl") if a.only in (None, s)]
    results = []
    print(f"P={a.P} G={a.G} N={a.N} micro-batch={a.micro_batch} steps/run={a.steps} (first not timed) "
          f"TRL gradient checkpointing={a.trl_gradient_checkpointing}", flush=True)
    header = f"{'pair':>4} {'side':>5} {'step s':>7} {'rollout':>8} {'reward':>7} {'update':>7} {'tok/s':>6} {'peak GiB':>8}"
    print(header, flush=True)
    for pair in range(a.pairs):
        row = {}
        for side in sides:
            res = run_ours(a) if side == "ours" else run_trl(a)
            res["summary"] = summarize(res["steps"])
            row[side] = res
            s = res["summary"]
            print(f"{pair:>4} {side:>5} {s['step']:>7.1f} {s['rollout']:>8.1f} {s['reward']:>7.1f} {s['update']:>7.1f} "
                  f"{s['tokens_per_s']:>6.1f} {res['peak_rss_mb'] / 1024:>8.2f}", flush=True)
        if len(row) == 2:
            row["ratio_step"] = row["ours"]["summary"]["step"] / row["trl"]["summary"]["step"]
            row["ratio_rss"] = row["ours"]["peak_rss_mb"] / row["trl"]["peak_rss_mb"]
            print(f"{pair:>4} ours/TRL: step time x{row['ratio_step']:.2f}, peak RSS x{row['ratio_rss']:.2f}", flush=True)
        results.append(row)
    if len(sides) == 2:
        rs, rm = [r["ratio_step"] for r in results], [r["ratio_rss"] for r in results]
        print(f"median over {len(results)} pairs: step time x{statistics.median(rs):.2f}, "
              f"peak RSS x{statistics.median(rm):.2f}", flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        json.dump({"args": vars(a), "pairs": results}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
