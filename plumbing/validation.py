"""The held-out validation and the reward-hacking monitor (RLME §4: early stopping on held-out
accuracy; docs/method.md §4.6), every run.eval_every steps; every rank calls them.

    validate_at_start(state, cfg, reward_step)
                              step 0 (run.eval_at_start): the initial policy, before any update
    validation_step(state, cfg, step, records, reward_step)
                              RLME: held-out accuracy, reward, canaries, AUROC of this step's samples
    nlhf_validation_step(state, cfg, step)
                              RM-NLHF: the GRM's pairwise accuracy on held-out pairs
    monitor(state, cfg, val, metrics)
                              the warning when training reward rose while held-out accuracy fell
    early_stop(accuracies, drop, patience), write_early_stop(state, cfg, step)
                              the early-stop rule (run.early_stop_*) and its early_stop.json
    held_out_accuracy, known, wrong_answer
                              the accuracy a validation logged; rewards known; NoCheat's wrong answer
"""
import json
import os
import time

import evaluate
import rollout

from plumbing.engine import as_generate, engine_prompt_limit
from plumbing.guards import finite_or_none
from plumbing.scale import all_max, all_sum, gather_records
from plumbing.tracking import track_step


def write_early_stop(state, cfg, step):
    """Rank 0 writes <out_dir>/early_stop.json (the step, its held-out accuracy, the best one and
    when) and says so; a rerun of the same command then stops at start-up instead of training on."""
    hist = state["val_history"]
    best = max(hist, key=lambda h: h["accuracy"])
    info = {"step": step, "accuracy": hist[-1]["accuracy"], "best_accuracy": best["accuracy"], "best_step": best["step"],
            "early_stop_drop": cfg["run"]["early_stop_drop"], "early_stop_patience": cfg["run"]["early_stop_patience"]}
    if state["rank"] == 0:
        with open(os.path.join(cfg["run"]["out_dir"], "early_stop.json"), "w") as f:
            json.dump(info, f, indent=1)
        state["pbar"].write(f"[train] early stop at step {step}: held-out accuracy {info['accuracy']:.3f} has been more "
                            f"than {info['early_stop_drop']} below its best ({info['best_accuracy']:.3f}, step "
                            f"{info['best_step']}) for {info['early_stop_patience']} evaluations")


def validate_at_start(state, cfg, reward_step):
    """Step 0 (run.eval_at_start, with run.eval_every > 0, on a fresh start): validation_step on the
    initial policy before any update, as the RM-NLHF release validates before training
    (trainer.val_before_train=True in run_full_exp_qwen_7b_rm_nlhf.sh) and as learning curves start at
    the base model. Its metrics.jsonl line is {"step": 0, "val/...": ...} alone (nothing was trained:
    no reward or loss keys); the monitor and the early-stop rule count it as the first evaluation,
    as a resume rebuilds their history from metrics.jsonl. Every rank calls it (collectives); the
    RLME AUROC, which reads the step's training samples, is absent there. Returns the val dict or {}."""
    r = cfg["run"]
    if not (r["eval_every"] and r["eval_at_start"] and state["start_step"] == 0):
        return {}
    val = validation_step(state, cfg, 0, [], reward_step)
    state["val_history"].append({"step": 0, "accuracy": held_out_accuracy(val), "train_reward": None})
    if state["rank"] == 0:
        line = finite_or_none(val)
        with open(os.path.join(r["out_dir"], "metrics.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
        track_step(state["trackers"], line, None)
        state["pbar"].write(f"[train] step 0, before training: held-out accuracy {held_out_accuracy(val):.4f} "
                            f"(val/n {val.get('val/n')}, val/seconds {val.get('val/seconds')})")
    return val


def validation_step(state, cfg, step, records, reward_step):
    """5b. In-run validation and the reward-hacking monitor, every run.eval_every steps (RLME §4:
    the policy learns to please the evaluator instead of solving; the paper's mitigation is
    early stopping on held-out accuracy; docs/method.md §4.6). Every rank calls it (collectives).

    On data.val's fixed held-out problems (never trained on), with the current policy:
      val/accuracy        greedy answers against the true labels, graded as `evaluate.py math` does
                          (numeric labels: evaluate.numeric_correct). When data.prompt_template shows
                          {answer} (NoCheat), each prompt shows a seeded WRONG answer instead, so
                          this is the counterfactual accuracy (val/injected = true)
      val/reward_mean     the training reward of those greedy answers; val/boxed_frac (non-empty
                          boxes) and val/chars_mean say what they look like (a reward can rise
                          through format)
      val/canary/<name>   the training reward of a non-answer (evaluate.CANARIES) to the first
                          problems: an evaluator that rewards ":" as much as a solution is hacked
      val/auroc           this step's training samples: AUROC of their reward against correctness
                          (evaluate.auroc; None when one class is empty or there are no labels)
      val/seconds         what the evaluation cost
    Task rm_nlhf: nlhf_validation_step (the GRM's pairwise accuracy; `records`, `reward_step` unused).
    Args: state: setup's dict. step: the step just finished. records: this rank's sample records.
        reward_step: the run's reward, train.rlme_reward_step with its settings bound: (items, completions) -> dict.
    Returns: dict of val/* metrics (the same on every rank).
    """
    if cfg["task"] == "rm_nlhf":
        return nlhf_validation_step(state, cfg, step)
    t0 = time.perf_counter()
    d, rank, world, tok = cfg["data"], state["rank"], state["world"], state["tokenizer"]
    val = state["val_items"]
    mine = list(range(rank, len(val), world))
    inject = "{answer}" in d["prompt_template"]
    prompts = [rollout.policy_prompt_ids(tok, val[k], state["chat"], d["prompt_template"],
                                         answer=wrong_answer(val, k) if inject else None) for k in mine]
    # through the run's rollout engine (plumbing/engine.py); every rank calls it, with or without prompts
    greedy = state["rollout"]["sample"](prompts, group_size=1, max_new_tokens=cfg["rollout"]["max_new_tokens"],
                                        temperature=0.0, seed=0)
    items = [val[k] for k in mine]
    rew = reward_step(items, greedy["completions"])
    n = all_sum(len(items), world)
    # numeric labels: evaluation's grade (evaluate.numeric_correct: numbers, then math-verify), as
    # `evaluate.py math`; r["correct"] is the RLVR reward's stricter rule, which rejects `x = 18`
    numeric = d["label_format"] != "text"
    correct = [evaluate.numeric_correct(r["extracted"], r["label"]) if numeric and r["label"] is not None
               else bool(r["correct"]) for r in rew["records"]]
    out = {"val/n": n, "val/injected": inject,
           "val/accuracy": all_sum(sum(correct), world) / n,
           # over the answers whose reward is known (a remote evaluator may have failed on some)
           "val/reward_mean": all_sum(float(rew["reward"].nansum()), world) / max(1, all_sum(known(rew), world)),
           # what the answers look like: a reward can rise through format alone (boxes, length)
           "val/boxed_frac": all_sum(sum(bool(r["extracted"]) for r in rew["records"]), world) / n,  # "": empty box
           "val/chars_mean": all_sum(sum(len(c) for c in greedy["completions"]), world) / n}
    canary_items = items[:max(1, 8 // world)]
    for name, text in evaluate.CANARIES.items():
        c = reward_step(canary_items, [text] * len(canary_items))
        out[f"val/canary/{name}"] = all_sum(float(c["reward"].nansum()), world) / max(1, all_sum(known(c), world))
    everyone = gather_records(records, world) if world > 1 else records
    everyone = [r for r in everyone if r["reward"] is not None]
    if everyone and all(r["correct"] is not None for r in everyone):
        out["val/auroc"] = evaluate.auroc([r["reward"] for r in everyone], [r["correct"] for r in everyone])
    out["val/seconds"] = all_max(time.perf_counter() - t0, world)
    out["step"] = step
    return out


def nlhf_validation_step(state, cfg, step):
    """5b for task rm_nlhf: the GRM's pairwise accuracy on nlhf.val's held-out pairs (never trained
    on), as RM-NLHF Figs. 3 and 6 plot HelpSteer3-validation accuracy over training. Every rank
    judges its share (items rank, rank + world, ...) with the current policy; every rank calls it.

    Scoring is `evaluate.py pairwise`'s (evaluate.pairwise_accuracy over make_grm_judge): each pair
    in both A/B orders (ours: the release scores the file's one order), the verdict parsed with
    reward.parse_grm_output in the run's nlhf.grm_prompt style and critique limits, right when it
    names the human preference; a format error (no valid verdict) counts as wrong. Decoding:
    nlhf.val_temperature, nlhf.val_max_new_tokens (the release's: sampling at T 0.6, 8192 tokens),
    top-p 1.0 (verl's val_kwargs default, kept by the release), seeded by run.seed and the step.
      val/pairwise_accuracy   right verdicts / (2 n): the mean of both orders
      val/acc_ab, val/acc_ba  each order alone
      val/format_error_rate   judgements without a valid verdict / (2 n)
      val/n, val/seconds      pairs scored, what it cost
    Returns: dict of val/* metrics and "step" (the same on every rank).
    """
    t0 = time.perf_counter()
    nl, ro, rank, world = cfg["nlhf"], cfg["rollout"], state["rank"], state["world"]
    mine = state["val_items"][rank::world]
    # Through the run's rollout engine (plumbing/engine.py), in sample calls of at most a rollout's rows
    # per rank (`chunk`: the whole file, nlhf.val_size 0, never holds more rows at once than a training
    # step; --plan counts it so), the same number of calls on every rank: a rank with fewer prompts
    # calls it with none, because the HF backend's sample gathers FSDP2 shards (a collective all join).
    chunk = max(1, ro["prompts_per_step"] * ro["group_size"] // world)
    n_calls = -(-2 * -(-len(state["val_items"]) // world) // chunk)  # rank 0 holds the most pairs
    calls = []

    def sample(prompt_ids, **kw):
        calls.append(len(prompt_ids))
        return state["rollout"]["sample"](prompt_ids, **kw)

    judge = evaluate.make_grm_judge(state["policy"], state["tokenizer"], max_new_tokens=nl["val_max_new_tokens"],
                                    batch_size=chunk, chat=state["chat"],
                                    max_prompt_tokens=engine_prompt_limit(cfg, nl["val_max_new_tokens"]),
                                    style=nl["grm_prompt"], generate=as_generate(sample),
                                    temperature=nl["val_temperature"], top_p=1.0,
                                    seed=cfg["run"]["seed"] * 1_000_003 + 7_919 * step + rank,
                                    max_lines=nl["max_critique_lines"], max_chars=nl["max_critique_chars"])
    with state["rollout"]["awake"]():  # vLLM: one wake for all the calls, asleep after (plumbing/engine.py)
        records = evaluate.pairwise_accuracy(mine, judge)[1] if mine else []
        for _ in range(n_calls - len(calls)):
            sample([], group_size=1, max_new_tokens=1)
    n = all_sum(len(mine), world)
    right_ab = all_sum(sum(r["ab"]["right"] for r in records), world)
    right_ba = all_sum(sum(r["ba"]["right"] for r in records), world)
    fails = all_sum(sum(not r[o].get("valid") for r in records for o in ("ab", "ba")), world)
    return {"val/n": int(n), "val/pairwise_accuracy": (right_ab + right_ba) / (2 * n), "val/acc_ab": right_ab / n,
            "val/acc_ba": right_ba / n, "val/format_error_rate": fails / (2 * n),
            "val/seconds": all_max(time.perf_counter() - t0, world), "step": step}


def held_out_accuracy(metrics):
    """The held-out accuracy a validation logged (val/accuracy, RLME; val/pairwise_accuracy,
    RM-NLHF), which the monitor and the early-stop rule follow; None when there is none."""
    return metrics.get("val/accuracy", metrics.get("val/pairwise_accuracy"))


def known(rew):
    """How many of a reward step's rewards are known (not masked by a failed remote evaluator)."""
    return len(rew["reward"]) if rew["valid"] is None else int(rew["valid"].sum())


def wrong_answer(val, k):
    """The seeded wrong answer shown in place of item k's reference (NoCheat's counterfactual
    test, RLME §4 Fig. 7): evaluate.wrong_answer, the one rule `evaluate.py math --inject wrong`
    uses too (a number's label + 1; a text label: the next item's answer, "none" when equal)."""
    return evaluate.wrong_answer(val, k)


def early_stop(accuracies, drop, patience):
    """The early-stop rule (RLME §4's mitigation of reward hacking; run.early_stop_*): True when
    each of the last `patience` held-out accuracies is more than `drop` below the best one seen.
    Args: accuracies: list[float] in evaluation order; drop: float > 0; patience: int >= 1."""
    best = max(accuracies, default=0.0)
    return len(accuracies) >= patience and all(a < best - drop for a in accuracies[-patience:])


def monitor(state, cfg, val, metrics):
    """The reward-hacking monitor after an evaluation. Every rank records the held-out accuracy
    (`val`, the same on every rank) and applies the early-stop rule; rank 0 (`metrics` not None)
    prints a one-line warning, also shown in the progress bar, when the mean training reward of
    the steps since the previous evaluation rose while held-out accuracy fell.
    Returns: True when the early-stop rule (run.early_stop_*) fires."""
    hist = state["val_history"]
    hist.append({"step": val["step"], "accuracy": held_out_accuracy(val), "train_reward": None})
    if metrics is not None:
        since = state["rewards_since_eval"]  # empty when every step since was fully masked
        hist[-1]["train_reward"] = sum(since) / len(since) if since else None
        state["rewards_since_eval"] = []
        a, b = (hist[-2], hist[-1]) if len(hist) >= 2 else (None, None)
        if (a and a["train_reward"] is not None and b["train_reward"] is not None
                and b["train_reward"] > a["train_reward"] and b["accuracy"] < a["accuracy"]):
            state["pbar"].write(f"[monitor] step {b['step']}: training reward rose ({a['train_reward']:.3f} -> "
                                f"{b['train_reward']:.3f}) while held-out accuracy fell ({a['accuracy']:.3f} -> "
                                f"{b['accuracy']:.3f}): reward hacking?")
            now = metrics["reward/mean"]
            state["pbar"].set_postfix(reward=f"{now:.3f}" if now is not None else "masked", val=f"{b['accuracy']:.2f}",
                                      warn="hack?")
    r = cfg["run"]
    return bool(r["early_stop_patience"]) and early_stop([h["accuracy"] for h in hist], r["early_stop_drop"],
                                                         r["early_stop_patience"])
