"""The step's metrics.jsonl line (docs/method.md §9 lists its keys), from every rank's records.

    step_metrics(state, cfg, records, upd, reward_metrics, times)
                              reward, accuracy, advantage, completion, importance-weight, loss,
                              gradient-norm, learning-rate, time and memory entries; the streak of
                              skipped steps (optim.max_skipped_steps); a collective on every rank
    rlme_step_metrics(records, cfg)
                              RLME's own entries: the RLVR reward, non-empty \\boxed{} answers, each
                              evaluator's log p and p per meta-question (RM-NLHF's own:
                              reward.nlhf_step_metrics)
"""
import math

import torch

import reward as R

from plumbing.scale import all_max, all_sum, gather_records, peak_memory_mb


def step_metrics(state, cfg, records, upd, reward_metrics, times):
    """5. The step's metrics.jsonl line, from every rank's records (every rank calls this: the
    reductions are collectives; docs/method.md §9 lists the keys).

    Args:
        state: setup's dict. records: this rank's sample_records. upd: update_policy's dict.
        reward_metrics: the reward step's "metrics". times: {"rollout", "reward", "update"} seconds.
    Returns:
        (metrics dict, every rank's records) on rank 0, (None, None) on the other ranks.
    """
    world, G = state["world"], cfg["rollout"]["group_size"]
    records = gather_records(records, world)
    loss = all_sum(upd["loss"], world)
    gap = upd["logp_gap"]
    if gap is not None:
        gap = (all_sum(gap[0], world) / max(all_sum(gap[1], world), 1.0), all_max(gap[2], world))
    # optimizer steps skipped for a non-finite gradient norm (global: every rank counts alike;
    # under float16's GradScaler the scaler skips and recalibrates, which is not counted)
    skipped = 0 if state.get("scaler") else sum(not math.isfinite(g) for g in upd["grad_norms"])
    state["skipped_streak"] = state.get("skipped_streak", 0) + 1 if skipped == len(upd["grad_norms"]) else 0
    if state["rank"] != 0:
        return None, None
    # None: the judge call / remote evaluator failed. A step with no known reward has no mean
    # (None, never 0.0: the best RLME reward) and stays out of the monitor's training reward.
    known = [r["reward"] for r in records if r["reward"] is not None]
    rew = torch.tensor(known) if known else None
    lens = torch.tensor([r["length"] for r in records], dtype=torch.float)
    groups = [{r["reward"] for r in records[g:g + G] if r["reward"] is not None} for g in range(0, len(records), G)]
    n, steps = len(records), cfg["algo"]["updates_per_batch"] * cfg["algo"]["minibatches"]
    labelled = [r["correct"] for r in records if r["correct"] is not None]  # None: no labels (RLME only)
    metrics = {
        "step": records[0]["step"], "reward/mean": rew.mean().item() if known else None,
        "reward/std": rew.std(unbiased=False).item() if known else None,
        "accuracy": sum(labelled) / len(labelled) if labelled else None,
        "advantage/abs_mean": sum(abs(r["advantage"]) for r in records) / n,
        "groups/zero_variance_frac": sum(len(g) <= 1 for g in groups) / len(groups),
        "completion/length_mean": lens.mean().item(), "completion/length_max": lens.max().item(),
        # characters, the unit of RLME §4's conciseness meta-question ("between 200 and 500 characters")
        "completion/chars_mean": sum(len(r["completion"]) for r in records) / n,
        "completion/truncated_frac": sum(r["truncated"] for r in records) / n,
        "is_weight/mean": sum(r["importance_weight"] for r in records) / n,
        "is_weight/max": max(r["importance_weight"] for r in records),
        "is_weight/clip_frac": sum(r["clipped"] for r in records) / n,
        "loss": loss / steps, "grad_norm": sum(upd["grad_norms"]) / len(upd["grad_norms"]),
        "update/skipped_steps": skipped,
        "lr": state["scheduler"].get_last_lr()[0],
        **{f"time/{k}": v for k, v in times.items()}, "time/step": sum(times.values()),
        "rollout/tokens_per_s": sum(r["length"] for r in records) / max(times["rollout"], 1e-9),
        "memory/peak_mb": peak_memory_mb(state["device"]),
        **reward_metrics,
    }
    # the task's own entries (docs/method.md §9)
    if cfg["task"] == "rlme":
        metrics.update(rlme_step_metrics(records, cfg))
    else:
        metrics.update(R.nlhf_step_metrics(records, reward_metrics))
    if gap is not None:
        metrics["rollout/logp_gap_mean"], metrics["rollout/logp_gap_max"] = gap
    return metrics, records


def rlme_step_metrics(records, cfg):
    """RLME's own entries of metrics.jsonl from all ranks' records: RLVR reward of the rewarded
    answers, the share with a non-empty \\boxed{} answer, the RLME part's mean (hybrid: both
    parts), each evaluator's mean log p and p per meta-question."""
    n = len(records)
    # extracted: reward.extract_boxed's stripped content, "" for an empty \boxed{}: not an answer
    out = {"rlvr_reward/mean": sum(r["rlvr_reward"] for r in records) / n,
           "completion/boxed_frac": sum(bool(r["extracted"]) for r in records) / n}
    if "logp" in records[0]:  # None: a remote evaluator's failed request, left out of the means
        known = [r["rlme_reward"] for r in records if r["rlme_reward"] is not None]
        out["rlme_reward/mean"] = sum(known) / len(known) if known else None
        for ev in cfg["reward"]["evaluators"]:
            for mq in cfg["reward"]["meta_questions"]:
                vals = torch.tensor([v for r in records if (v := r["logp"][ev["name"]][mq["question"]]) is not None])
                out[R.logp_metric_name(ev["name"], mq["question"])] = vals.mean().item() if len(vals) else None
                out[f"rlme/{ev['name']}/{mq['question']}/p"] = vals.exp().mean().item() if len(vals) else None
    return out
