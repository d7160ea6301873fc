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

# a country: its capital (one word each; '_' stands for a space)
CAPITALS = dict(p.split(":") for p in """France:Paris Germany:Berlin Italy:Rome Spain:Madrid
Japan:Tokyo Egypt:Cairo Russia:Moscow Greece:Athens Portugal:Lisbon Austria:Vienna Norway:Oslo
Sweden:Stockholm Finland:Helsinki Denmark:Copenhagen Poland:Warsaw Ireland:Dublin Kenya:Nairobi
Peru:Lima Chile:Santiago Cuba:Havana Thailand:Bangkok Vietnam:Hanoi Iran:Tehran Iraq:Baghdad
Turkey:Ankara China:Beijing Canada:Ottawa Australia:Canberra Hungary:Budapest Belgium:Brussels
Netherlands:Amsterdam Switzerland:Bern Ukraine:Kyiv Romania:Bucharest Bulgaria:Sofia
Serbia:Belgrade Croatia:Zagreb Nigeria:Abuja Ghana:Accra Ethiopia:Addis_Ababa Morocco:Rabat
Colombia:Bogota Venezuela:Caracas Argentina:Buenos_Aires Mexico:Mexico_City India:New_Delhi
Indonesia:Jakarta Philippines:Manila Pakistan:Islamabad Bangladesh:Dhaka""".split())

TASKS = {  # name: (every distinct problem, the question, its answer in the JSONL row)
    "larger": ([(a, b) for a in range(10, 100) for b in range(a + 1, 100)],
               "Which number is larger, {} or {}?", lambda p: f"#### {max(p)}"),
    "add1": ([(a, b) for a in range(10) for b in range(a, 10)], "What is {} + {}?",
             lambda p: f"#### {sum(p)}"),
    "add2": ([(a, b) for a in range(10, 100) for b in range(a, 100)], "What is {} + {}?",
             lambda p: f"#### {sum(p)}"),
    "capital": ([(c,) for c in sorted(CAPITALS)], "What is the capital of {}?",
                lambda p: CAPITALS[p[0]].replace("_", " "))}


def make_task(name, seed=0, val=100, test=200):
    """{"train", "val", "test"}: rows {"question", "answer"} of TASKS[name] (numbers: GSM8K's
    '#### N', data.label_format gsm8k; capital: the bare name, label_format text). The distinct
    problems are shuffled by `seed` (a pair's two numbers too: the larger comes first half the
    time) and cut in three, so no problem is in two splits; a task with few problems (add1: 55,
    capital: 50) gives val and test a fifth each."""
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
