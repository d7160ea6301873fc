"""Everything a training run needs that is not the method: kept out of the stage files so that
they read as the papers' algorithms (README, "Read the code").

    config.py    config.yaml's loader and validation: one-line errors before any model loads
    run.py       setup (models, data, optimizer, resume point), checkpoints and exact resume,
                 trackers, metrics.jsonl / samples.jsonl, early stop, the MetaRM of a run
    scale.py     process group and reductions, mixed precision, DDP / FSDP2, activation
                 checkpointing, the vLLM engine and its weight pushes, LoRA
    data.py      datasets: RLME items, pairwise schemas, the benchmark registry; model loading
                 and GGUF; chat-template options; JSONL with line-numbered errors
    services.py  evaluators loaded from a path or a config (local and remote over HTTP), the
                 judge's client with retries and the proxy judge, the TRL and verl adapters
    cli.py       the command lines of rollout.py, reward.py, metarm.py and evaluate.py

Imports go one way: plumbing imports the stage files and fast.py; the stage files (rollout.py,
reward.py, metarm.py, evaluate.py) never import plumbing; nothing here imports train.py.
"""
