"""The short-answer tasks of the miniature RLME Fig. 2 (configs/tasks/, docs/learning-runs.md):
problems SmolLM2-135M-Instruct partly solves, written as the JSONL files the presets read.

    python tools/make_tasks.py            # tasks/<task>/{train,val,test}.jsonl, seed 0 (committed)

Standalone (the standard library only): copy it, add a task to TASKS. tests/test_data.py checks
that the committed files are what this writes.
"""
import json
import os
import random
import sys

TASKS = {  # name: (every distinct problem, the question, its answer in the JSONL row)
    "larger": ([(a, b) for a in range(10, 100) for b in range(a + 1, 100)],
               "Which number is larger, {} or {}?", lambda p: f"#### {max(p)}"),
    "add1": ([(a, b) for a in range(10) for b in range(a, 10)], "What is {} + {}?",
             lambda p: f"#### {sum(p)}"),
    "add2": ([(a, b) for a in range(10, 100) for b in range(a, 100)], "What is {} + {}?",
             lambda p: f"#### {sum(p)}")}


def make_task(name, seed=0, val=100, test=200):
    """{"train", "val", "test"}: rows {"question", "answer": "#### N"} of TASKS[name] (GSM8K's
    format: data.label_format gsm8k, `evaluate.py math`). The distinct problems (a pair of numbers
    once, either order) are shuffled by `seed`, each pair's order drawn by it too (the larger
    comes first half the time), and cut in three, so no problem is in two splits; a task with few
    problems (add1: 55) gives val and test a fifth each."""
    problems, question, answer = TASKS[name]
    rng = random.Random(f"{name}:{seed}")
    problems = [p[::-1] if rng.random() < 0.5 else p for p in problems]
    rng.shuffle(problems)
    if val + test > len(problems) // 2:
        val = test = len(problems) // 5
    rows = [{"question": question.format(*p), "answer": answer(p)} for p in problems]
    return {"val": rows[:val], "test": rows[val:val + test], "train": rows[val + test:]}


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))), "tasks")
    for name in TASKS:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        for split, rows in make_task(name).items():
            with open(os.path.join(folder, name, f"{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
