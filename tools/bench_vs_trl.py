"""Side by side: the same RLME step in our train.py and in TRL's GRPOTrainer (step time, peak RSS).

    python tools/bench_vs_trl.py                      # 3 A/B pairs, P=4 G=4 N=128, SmolLM2 fp32 CPU
    python tools/bench_vs_trl.py --pairs 5 --out runs/bench.json
    python tools/bench_vs_trl.py --only ours rollout.backend=vllm     # one side, extra overrides
    python tools/bench_vs_trl.py --check-loss     # the same loss and gradient on one fixed batch

The same step: P prompts x G completions of at most N new tokens (T 1, top-p 1, no top-k), the live
self-evaluation reward log P("Yes" | evaluator prompt) of reward.py computed by the policy itself
(the same function and prompt on both sides), then one CISPO step: on-policy ratio 1, advantages
r - group mean, no KL, the summed token loss over the batch's token count, AdamW at a constant
learning rate, grad clip 1, micro-batches of --micro-batch sequences. Ours: `python train.py
--config configs/cpu.yaml` with OURS_AS_TRL. TRL: GRPOTrainer(loss_type="cispo",
importance_sampling_level="sequence", scale_rewards="none", beta=0), TRL's defaults otherwise
(fp32, its activation checkpointing unless --trl-gradient-checkpointing 0).

Each run is a fresh subprocess; its peak RSS is the kernel's figure for that child (os.wait4's
ru_maxrss), the same measure on both sides. Runs alternate A B A B so both see the same load.
Per run: the median seconds per step (the first step excluded: it warms caches), the seconds by
stage, tokens/s during the rollout, peak RSS; per pair the ratios ours/TRL, then their medians.
The CPU's name, core count and load average are printed: a timing on a busy machine says little.
--check-loss shows both sides compute the same thing: one fixed batch through our update and
TRL's loss, losses and gradients compared (check_loss).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
from memory_plan import get, read_config  # noqa: E402  (the YAML read once, without checks)

# Our config values that make our step TRL's: TRL's CISPO divides the summed token loss by the
# batch's token count (our token_mean; our default, RLME Eq. 8, divides by the sequence count),
# and TRL here runs a constant learning rate (ours: constant after optim.warmup_steps).
OURS_AS_TRL = ["algo.aggregation=token_mean", "optim.warmup_steps=0"]


def cpu_name():
    """The CPU's model name (/proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0]
    except (OSError, IndexError):
        return platform.processor() or "unknown CPU"


def run_child(cmd, what):
    """Run one side in a fresh process (its stdout dropped, its stderr shown); return its peak
    RSS in MiB. SystemExit (one line) when it fails: its own error is the line above."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"bench: {what} failed with exit {proc.returncode} (its error is above)")
    return usage.ru_maxrss / 1024  # Linux: KiB


def summarize(steps):
    """steps: [{step, rollout, reward, update, tokens}] -> medians over steps 2.. and tokens/s."""
    timed = steps[1:] if len(steps) > 1 else steps
    out = {k: statistics.median(s[k] for s in timed)
           for k in ("step", "rollout", "reward", "update")}
    rollout_s = max(sum(s["rollout"] for s in timed), 1e-9)
    out["tokens_per_s"] = sum(s["tokens"] for s in timed) / rollout_s
    return out


def size_overrides(a):
    return [f"rollout.prompts_per_step={a.P}", f"rollout.group_size={a.G}",
            f"rollout.max_new_tokens={a.N}"]


# ----------------------------------------------------------------------------------------------
# Our side: train.py itself, read back from its metrics.jsonl


def run_ours(a):
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", a.config,
               f"run.out_dir={out_dir}", f"run.total_steps={a.steps}", "run.save_every=0",
               *size_overrides(a), f"train.micro_batch_size={a.micro_batch}",
               f"reward.micro_batch_size={a.micro_batch}", *OURS_AS_TRL, *a.ours_override]
        t = time.perf_counter()
        rss = run_child(cmd, "our train.py")
        wall = time.perf_counter() - t
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    steps = [{"step": r["time/step"], "rollout": r["time/rollout"], "reward": r["time/reward"],
              "update": r["time/update"], "tokens": r["completion/length_mean"] * a.P * a.G}
             for r in rows]
    return {"side": "ours", "steps": steps, "peak_rss_mb": rss, "wall_s": wall,
            "loss": [r.get("loss") for r in rows],
            "reward_mean": [r.get("reward/mean") for r in rows]}


# ----------------------------------------------------------------------------------------------
# TRL's side: GRPOTrainer in a child process (this file with --side trl)


def self_evaluation_reward(model, tok, chat, cfg, problems, completions, micro_batch):
    """RLME Eq. 2-3 with one live evaluator, the policy scoring its own answers: reward.py's
    rlme_reward with the config's meta-questions and template. Returns FloatTensor [N]."""
    import reward as R
    ev = [R.local_evaluator(model, tok, chat=chat, name="live", weight=1.0,
                            micro_batch_size=micro_batch)]
    mq = [dict({"weight": 1.0, "target": "Yes", "negative": "No"}, **m)  # config.yaml's defaults
          for m in get(cfg, "reward.meta_questions")]
    return R.rlme_reward(ev, mq, problems,
                         completions, template=get(cfg, "reward.evaluator_template")
                         or R.DEFAULT_EVALUATOR_TEMPLATE)["reward"]


def trl_args(a, cfg):
    """TRL's GRPOConfig for our step: CISPO with sequence-level importance weights, advantages
    r - group mean, no KL, fp32 on the CPU, our optimiser's numbers; TRL's defaults otherwise."""
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, max_steps=a.steps, seed=get(cfg, "run.seed", 0), shuffle_dataset=False,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.P * a.G // a.micro_batch, num_generations=a.G,
        max_completion_length=a.N, temperature=1.0, top_p=1.0, top_k=0, loss_type="cispo",
        importance_sampling_level="sequence", scale_rewards="none", beta=0.0,
        epsilon_high=1.0 + get(cfg, "algo.eps_high", 5.0), learning_rate=get(cfg, "optim.lr"),
        lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=get(cfg, "optim.weight_decay", 0.0),
        adam_beta1=0.9, adam_beta2=0.999,  # ours: AdamW's defaults
        max_grad_norm=get(cfg, "optim.grad_clip", 1.0),
        gradient_checkpointing=bool(a.trl_gradient_checkpointing), dataloader_num_workers=0,
        log_completions=False)


def step_items(a, cfg, tok):
    """Our run's items of steps 0..S-1 in its order (rollout.step_items), and the policy's chat
    setting (rollout.use_chat_template), as train.py makes them."""
    import data
    import rollout
    chat = rollout.use_chat_template(tok, get(cfg, "model.chat_template", "auto"),
                                     get(cfg, "model.policy"),
                                     kwargs=get(cfg, "model.chat_template_kwargs"))
    d, seed = cfg["data"], get(cfg, "run.seed", 0)
    items, _ = data.load_rlme_items(
        d["train"], None, train_config=d.get("train_config"), seed=seed,
        anchor_fraction=get(cfg, "reward.anchor_fraction", 0.0),
        **{k: d[k] for k in ("question_field", "answer_field", "label_format", "context_field")})
    return [rollout.step_items(items, s, a.P, seed, rank=0, world=1) for s in range(a.steps)], chat


def trl_rows(a, cfg, tok):
    """TRL's dataset rows: our prompts' text (the chat messages with a chat template), in our
    order, with the problem the evaluator reads; and the chat setting."""
    import rollout
    steps, chat = step_items(a, cfg, tok)
    rows = []
    for it in [it for items in steps for it in items]:
        text = rollout.policy_prompt_ids(tok, it, chat, cfg["data"]["prompt_template"],
                                         text_only=True)
        rows.append({"prompt": [{"role": "user", "content": text}] if chat else text,
                     "problem": it["problem"]})
    return rows, chat


def run_trl_child(a):
    """The TRL run, in this process: timers around TRL's generation and reward calls."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import rollout
    cfg = read_config([a.config], size_overrides(a))
    policy, tok = rollout.load_model(get(cfg, "model.policy"), "float32", "cpu")
    rows, chat = trl_rows(a, cfg, tok)
    holder, timers, steps = {"logs": []}, {"rollout": 0.0, "reward": 0.0}, []

    def live_self_eval(prompts, completions, problem, **kwargs):
        """TRL's reward function: the policy being trained scores its own answers."""
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        model = holder["trainer"].model
        return self_evaluation_reward(model, tok, chat, cfg, list(problem), texts,
                                      a.micro_batch).tolist()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timers.update(rollout=0.0, reward=0.0, t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            total = time.perf_counter() - timers["t0"]
            steps.append({"step": total, "rollout": timers["rollout"], "reward": timers["reward"],
                          "update": total - timers["rollout"] - timers["reward"]})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                holder["logs"].append(dict(logs))

    trainer = GRPOTrainer(model=policy, processing_class=tok, reward_funcs=live_self_eval,
                          args=trl_args(a, cfg), train_dataset=Dataset.from_list(rows),
                          callbacks=[StepTimer()])
    holder["trainer"] = trainer
    trainer._generate_single_turn = timed("rollout", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    torch.manual_seed(get(cfg, "run.seed", 0))
    trainer.train()
    for s, lg in zip(steps, holder["logs"]):
        s["tokens"] = lg["completions/mean_length"] * a.P * a.G
    return {"side": "trl", "steps": steps, "loss": [lg.get("loss") for lg in holder["logs"]],
            "reward_mean": [lg.get("reward") for lg in holder["logs"]]}


def run_trl(a):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--side", "trl", "--result", f.name,
               "--config", a.config, "--steps", str(a.steps), "--P", str(a.P), "--G", str(a.G),
               "--N", str(a.N), "--micro-batch", str(a.micro_batch),
               "--trl-gradient-checkpointing", str(a.trl_gradient_checkpointing)]
        t = time.perf_counter()
        rss = run_child(cmd, "the TRL run")
        res = json.load(open(f.name))
    res.update(peak_rss_mb=rss, wall_s=time.perf_counter() - t)
    return res


# ----------------------------------------------------------------------------------------------
# The same numbers: both losses and gradients on one fixed batch (--check-loss)


def check_loss(a):
    """Our update's loss and gradient vs TRL's `_compute_loss` on ONE fixed batch: step 0's P
    prompts, G completions each (rollout.generate, our run's seed), the live self-evaluation
    reward, advantages r - group mean (train.group_advantages). Ours: train.update_policy (CISPO,
    token_mean, on-policy) with an optimizer that records the gradient instead of stepping;
    TRL: its loss per micro-batch as its training_step runs it, then backward. Extra key=value
    overrides apply to both (e.g. model.policy=DIR). Returns True when the losses and gradients
    agree within 1e-4 (relative)."""
    import types

    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    import rollout
    import train
    cfg = read_config([a.config], size_overrides(a) + a.ours_override)
    policy, tok = rollout.load_model(get(cfg, "model.policy"), "float32", "cpu")
    steps, chat = step_items(a, cfg, tok)
    items, seed = steps[0], get(cfg, "run.seed", 0)
    prompts = [rollout.policy_prompt_ids(tok, it, chat, cfg["data"]["prompt_template"])
               for it in items]
    out = rollout.generate(policy, tok, prompts, a.G, a.N, seed=train.sampling_seed(seed, 0, 0))
    problems = [it["problem"] for it in items for _ in range(a.G)]
    rewards = self_evaluation_reward(policy, tok, chat, cfg, problems, out["completions"],
                                     a.micro_batch)
    adv, mask = train.group_advantages(rewards, a.G), out["completion_mask"]
    batch = {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"],
             "completion_mask": mask, "advantages": adv, "valid": None, "rollout_logprobs": None}

    def gradient():
        g = torch.cat([p.grad.flatten() for p in policy.parameters()]).double()
        policy.zero_grad(set_to_none=True)
        return g

    grads = {}
    recorder = types.SimpleNamespace(step=lambda: grads.update(ours=gradient()),
                                     zero_grad=lambda set_to_none=True: None)
    ours = train.update_policy(
        policy, policy, recorder, batch, loss="cispo", eps_low=get(cfg, "algo.eps_low", 1.0),
        eps_high=get(cfg, "algo.eps_high", 5.0), ratio="sequence", clip_eps=0.2, kl_coef=0.0,
        aggregation="token_mean", max_new_tokens=a.N, updates_per_batch=1, minibatches=1,
        group_size=a.G, micro_batch_size=a.micro_batch, grad_clip=0.0, temperature=1.0,
        pad_id=tok.pad_token_id)["loss"]
    trainer = GRPOTrainer(model=policy, processing_class=tok,
                          reward_funcs=lambda **kw: [0.0] * len(kw["prompts"]),
                          args=trl_args(a, cfg), train_dataset=Dataset.from_list([{"prompt": "x"}]))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = a.P * a.G // a.micro_batch
    theirs = 0.0
    for s in range(0, a.P * a.G, a.micro_batch):
        rows = list(range(s, s + a.micro_batch))
        p_ids, p_mask = rollout.left_pad([out["prompt_ids"][i] for i in rows], tok.pad_token_id)
        loss = trainer._compute_loss(trainer.model, {
            "prompt_ids": p_ids, "prompt_mask": p_mask,
            "completion_ids": out["completion_ids"][rows], "completion_mask": mask[rows].long(), "advantages": adv[rows],
            "num_items_in_batch": mask.sum(), "old_per_token_logps": None})
        loss.backward()
        theirs += loss.item()
    g_ours, g_trl = grads["ours"], gradient()  # float64: sums over 135M terms
    rel = float((g_ours - g_trl).norm() / g_trl.norm())
    print(f"fixed batch: {a.P} prompts x {a.G} completions, {int(mask.sum())} completion tokens")
    print(f"loss      ours {ours:.8f}   TRL {theirs:.8f}   |diff| {abs(ours - theirs):.2e}")
    print(f"gradient  |ours - TRL| / |TRL| = {rel:.2e}, cosine "
          f"{float(torch.nn.functional.cosine_similarity(g_ours, g_trl, dim=0)):.8f}")
    same = abs(ours - theirs) <= 1e-4 * max(1.0, abs(theirs)) and rel <= 1e-4
    print("the same loss and gradient (within 1e-4)" if same else "DIFFERENT")
    return same


# ----------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "cpu.yaml"))
    p.add_argument("--pairs", type=int, default=3, help="A B pairs (ours, then TRL)")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    p.add_argument("--P", type=int, default=4, help="prompts per step")
    p.add_argument("--G", type=int, default=4, help="completions per prompt")
    p.add_argument("--N", type=int, default=128, help="max new tokens")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    p.add_argument("--trl-gradient-checkpointing", type=int, default=1, help="TRL's default: 1")
    p.add_argument("--only", choices=["ours", "trl"], help="run one side only")
    p.add_argument("--out", default=None, help="JSON summary file")
    p.add_argument("--check-loss", action="store_true",
                   help="instead of timing: our loss and gradient vs TRL's on one fixed batch")
    p.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("ours_override", nargs="*", help="extra key=value overrides for our train.py")
    a = p.parse_args(argv)
    if a.steps < 2:
        raise SystemExit("bench: --steps must be >= 2 (the first step is not timed)")
    for name in ("pairs", "P", "G", "N", "micro_batch"):
        if getattr(a, name) < 1:
            raise SystemExit(f"bench: --{name.replace('_', '-')} must be >= 1")
    if (a.P * a.G) % a.micro_batch:
        raise SystemExit(f"bench: --micro-batch {a.micro_batch} must divide P*G = {a.P * a.G}")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.side == "trl":
        with open(a.result, "w") as f:
            json.dump(run_trl_child(a), f)
        return 0
    if a.only != "ours" or a.check_loss:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("bench: TRL is not installed (pip install -r requirements.txt), "
                             "or run --only ours")
    if a.check_loss:
        return 0 if check_loss(a) else 1
    sides = [s for s in ("ours", "trl") if a.only in (None, s)]
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    print(f"P={a.P} G={a.G} N={a.N} micro-batch={a.micro_batch} steps/run={a.steps} (first not "
          f"timed), TRL gradient checkpointing={a.trl_gradient_checkpointing}", flush=True)
    print(f"{'pair':>4} {'side':>5} {'step s':>7} {'rollout':>8} {'reward':>7} {'update':>7} "
          f"{'tok/s':>6} {'peak GiB':>8}", flush=True)
    results = []
    for pair in range(a.pairs):
        row = {}
        for side in sides:
            res = run_ours(a) if side == "ours" else run_trl(a)
            s = res["summary"] = summarize(res["steps"])
            row[side] = res
            print(f"{pair:>4} {side:>5} {s['step']:>7.1f} {s['rollout']:>8.1f} {s['reward']:>7.1f} "
                  f"{s['update']:>7.1f} {s['tokens_per_s']:>6.1f} "
                  f"{res['peak_rss_mb'] / 1024:>8.2f}", flush=True)
        if len(row) == 2:
            row["ratio_step"] = row["ours"]["summary"]["step"] / row["trl"]["summary"]["step"]
            row["ratio_rss"] = row["ours"]["peak_rss_mb"] / row["trl"]["peak_rss_mb"]
            print(f"{pair:>4} ours/TRL: step time x{row['ratio_step']:.2f}, "
                  f"peak RSS x{row['ratio_rss']:.2f}", flush=True)
        results.append(row)
    if len(sides) == 2:
        rs, rm = [r["ratio_step"] for r in results], [r["ratio_rss"] for r in results]
        print(f"median over {len(results)} pairs: step time x{statistics.median(rs):.2f}, "
              f"peak RSS x{statistics.median(rm):.2f} (load average now "
              f"{os.getloadavg()[0]:.1f})", flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "cpu": cpu_name(), "pairs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
