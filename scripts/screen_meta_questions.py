"""Screen meta-questions before a learning run: can the evaluator judge the behaviour, and can the
policy change it?

    python scripts/screen_meta_questions.py --n-prompts 16 --samples 4 rollout.max_new_tokens=64
    python scripts/screen_meta_questions.py --n-prompts 32 --samples 8 --only concise,answer rollout.max_new_tokens=96

For each candidate (meta-question, behaviour test on the completion text) this samples completions
from the policy (configs/cpu.yaml by default), scores log P("Yes" | question) with the evaluator
(the policy itself: live self-evaluation, reward.rlme_reward), and prints
  - base rate: the fraction of completions that show the behaviour (the policy can only be pushed
    toward a behaviour it sometimes shows; near 0 or 1 leaves nothing to learn),
  - AUROC of P(Yes) for "shows the behaviour" (evaluate.auroc; 0.5 = the evaluator cannot tell),
  - mean log P(Yes) with and without the behaviour.
A candidate worth a learning run has a base rate between ~0.1 and ~0.7 and an AUROC well above 0.5.
"""
import argparse
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import evaluate  # noqa: E402
import reward as R  # noqa: E402
import rollout  # noqa: E402
import fast  # noqa: E402
from plumbing.config import load_config  # noqa: E402
from plumbing.items import load_train_items
from plumbing.models import load_model
from plumbing.prompts import policy_chat

CANDIDATES = {
    "steps": ("Is the solution written as numbered steps?",
              lambda s: bool(re.search(r"(?im)^\s*(step\s*1\b|1[.)]\s)", s))),
    "equations": ("Does the solution show its calculations as equations?", lambda s: "=" in s),
    "first": ("Does the solution start with the word 'First'?", lambda s: s.lstrip().lower().startswith("first")),
    "answer": ("Does the solution state the final answer?", lambda s: bool(re.search(r"(?i)\banswer", s))),
    "digits": ("Does the solution contain numbers?", lambda s: bool(re.search(r"\d", s))),
    "short": ("Is the solution short?", None),
    "concise": ("Is the solution concise?", None),
    "complete": ("Is the solution complete?", None),
}

# Numeric properties of a completion (text, token count, finished before max_new_tokens). The
# evaluator's P(Yes) to a question is useful for a learning run when it tracks one of these
# (rank correlation far from 0) and the property varies across samples.
FEATURES = {
    "tokens": lambda text, n, done: float(n),
    "lines": lambda text, n, done: float(text.count("\n") + 1),
    "finished": lambda text, n, done: float(done),
    "equals": lambda text, n, done: float(text.count("=")),
    "answer": lambda text, n, done: float(bool(re.search(r"(?i)\banswer", text))),
}


def spearman(xs, ys):
    """Spearman rank correlation (mid-ranks for ties, evaluate.midranks); nan when either side is constant."""
    a, b = torch.tensor(evaluate.midranks(xs)), torch.tensor(evaluate.midranks(ys))
    a, b = a - a.mean(), b - b.mean()
    den = (a.pow(2).sum() * b.pow(2).sum()).sqrt()
    return float("nan") if den == 0 else (a * b).sum().item() / den.item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs", "cpu.yaml"))
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--only", default=None,
                   help=f"comma-separated candidates to screen (default: all of {','.join(sorted(CANDIDATES))})")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    a = p.parse_args(argv)
    names = a.only.split(",") if a.only else sorted(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"--only: unknown candidate(s) {', '.join(unknown)}; choose from {', '.join(sorted(CANDIDATES))}")
    cfg = load_config([a.config], a.overrides)
    ro, rw = cfg["rollout"], cfg["reward"]
    policy, tok = load_model(cfg["model"]["policy"], cfg["model"]["dtype"], "cpu")
    chat = policy_chat(tok, cfg["model"])
    items = load_train_items(cfg)[:a.n_prompts]
    prompts = [rollout.build_prompt_ids(tok, cfg["data"]["prompt_template"].format(question=it["question"]), chat)
               for it in items]
    out = fast.generate(policy, tok, prompts, group_size=a.samples, max_new_tokens=ro["max_new_tokens"],
                           temperature=ro["temperature"], top_p=ro["top_p"], top_k=ro["top_k"],
                           seed=cfg["run"]["seed"], micro_batch_size=16)
    problems = [it["question"] for it in items for _ in range(a.samples)]
    evaluator = [R.local_evaluator(policy, tok, chat=chat, name="live", weight=1.0, answer_stub=rw["answer_stub"],
                                   micro_batch_size=rw["micro_batch_size"], score=fast.score_targets)]
    mq = [{"question": CANDIDATES[n][0], "weight": 1.0, "target": "Yes"} for n in names]
    logp = R.rlme_reward(evaluator, mq, problems, out["completions"])["logp"][:, 0, :]  # [N, K]
    print(f"{len(out['completions'])} completions, max {ro['max_new_tokens']} new tokens, "
          f"truncated {out['truncated'].float().mean():.2f}")
    print(f"{'candidate':>10} {'base rate':>9} {'AUROC':>6} {'logP yes|has':>13} {'logP yes|not':>13}  question")
    for k, n in enumerate(names):
        if CANDIDATES[n][1] is None:  # no yes/no behaviour test: see the correlation table below
            continue
        has = torch.tensor([CANDIDATES[n][1](c) for c in out["completions"]])
        lp = logp[:, k]
        auc = evaluate.auroc(lp.tolist(), has.tolist()) if 0 < has.sum() < len(has) else float("nan")
        m1 = lp[has].mean().item() if has.any() else float("nan")
        m0 = lp[~has].mean().item() if (~has).any() else float("nan")
        print(f"{n:>10} {has.float().mean():>9.2f} {auc:>6.3f} {m1:>13.3f} {m0:>13.3f}  {CANDIDATES[n][0]}")
    n_tok = out["completion_mask"].sum(-1).tolist()
    feats = {f: [fn(c, t, not tr) for c, t, tr in zip(out["completions"], n_tok, out["truncated"].tolist())]
             for f, fn in FEATURES.items()}
    print("\nproperty mean (std): " + ", ".join(f"{f} {torch.tensor(v).mean():.2f} ({torch.tensor(v).std():.2f})"
                                            for f, v in feats.items()))
    print("Spearman correlation of log P(Yes) with each property:")
    print(f"{'candidate':>10} " + " ".join(f"{f:>8}" for f in feats) + f" {'std logP':>8}")
    for k, n in enumerate(names):
        lp = logp[:, k].tolist()
        print(f"{n:>10} " + " ".join(f"{spearman(lp, v):>8.3f}" for v in feats.values()) +
              f" {logp[:, k].std():>8.3f}")


if __name__ == "__main__":
    main()
