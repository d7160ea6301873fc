"""The MetaRM cold start as a stage of its own (RM-NLHF Algorithm 1, lines 2-10): the method is
metarm.py's cold_start_sample, cold_start_examples (judge, examples) and fit_cold_start (Eq. 7);
this file runs it at a preset's scale: in bounded batches, over ranks, resumably, with no rank
waiting in a collective, a batch judged while the next one samples.

    run_cold_start            the batches dealt to the ranks, examples to files as they are made,
                              a killed cold start resumed, the exchange through the files, the fit
    cold_start_settings       run_cold_start's keyword arguments from the config
    record_cold_start         the set's size: cold_start.json, one line, first-step metrics

Batches. D_H (metarm.cold_start_items of it) is cut into batches of metarm.cold_start_batch_size
prompts: one sample() call each, batch_size x metarm.rollouts_per_prompt rows, so the sampler's
memory (HF: rows x (prompt + max_new_tokens) of KV cache) is bounded by the key, not by D_H. Batch b
samples with batch_seed(run.seed, b) whoever runs it: the examples depend on neither the world size
nor how often the cold start was interrupted.

Ranks. Batch b goes to rank b % world, in rounds: in round k rank r runs batch k * world + r. Its
judging (the judge's requests, Eq. 4-5, and the examples) runs in a thread while the rank samples
its next batch: the judge server and the GPU work at once. Every rank calls sample() once a round,
with no prompt when its batch is past the end or already on disk, because HF decode of an FSDP2
policy (plumbing/engine.py hf_backend) gathers the weights, a collective every rank must join; a rank then waits at
most one batch of another rank there. Nothing else in the sampling
is a collective: the examples are exchanged through the files (wait_for_batches), where a rank
waits with a deadline (train.dist_timeout_s without any rank finishing a batch) and one line.

Files: <run.out_dir>/cold_start/examples.rank<r>.jsonl, one per rank that ever ran, each written by
that rank only, append-only. Line 1: {"settings": ...} (what makes an example: settings() below; a
file with other settings stops the run with one line naming the keys). Then for each batch
{"batch": b, "start": true}, its examples {"batch": b, "text", "r", "dh"} in order, and
{"batch": b, "done": counts} (metarm.cold_start_examples' counts), written in one piece, flushed and
fsync'd. A batch exists once its "done" line is on disk; a kill mid-batch leaves lines without it,
ignored (a redo starts the batch again with "start"), and a torn last line is ended with a newline
before the rank appends again. The folder stays after the cold start: the record of what the MetaRM
was first trained on (with cold_start.json).

    run_cold_start(...)                    the cold start over `world` ranks (the above)
    batch_seed, settings                   a batch's sampling seed; the files' header
    rank_file, open_rank_file, write_batch one rank's file: its path, opened (header first), a batch
    scan, new_lines, check_header, wait_for_batches
                                           reading every rank's file until all batches are there
    cold_start_settings, record_cold_start run_cold_start's arguments from the config; the set's log
"""
import concurrent.futures
import contextlib
import functools
import glob
import hashlib
import json
import math
import os
import time

import torch

import metarm
import reward
from plumbing.prompts import policy_chat


# ----------------------------------------------------------------------------------------------
# The sampler


def batch_seed(seed, batch):
    """The sampling seed of cold-start batch `batch` (0-based): the same whichever rank runs it and in
    whichever attempt (batch 0 samples with run.seed, as rank 0 did before batches)."""
    return seed + 1_000_003 * batch


# ----------------------------------------------------------------------------------------------
# The stage


def run_cold_start(mrm, dh_items, *, sample, judge, prompt, parse, score, folder, identity, batch_size, rollouts_per_prompt,
                   max_new_tokens, temperature, epochs, lr, warmup_frac, weight_decay, seed, rank=0, world=1,
                   timeout_s=1800.0, log=None, poll_s=1.0, awake=contextlib.nullcontext):
    """The MetaRM cold start over `world` ranks (the module docstring says how): every rank samples
    (metarm.cold_start_sample) and judges (metarm.cold_start_examples, in a thread while the next
    batch samples) its batches, appending each to its file in `folder`, then reads every
    rank's file until all batches are there and trains on all the examples in batch order
    (metarm.fit_cold_start: every rank the same fit; FSDP2 shards, mrm["shard"], each their
    share); replicas then take rank 0's weights. A cold start killed and run again skips the
    batches on disk: its examples and its MetaRM equal an uninterrupted run's.

    Args:
        mrm: the fresh MetaRM (equal on every rank). dh_items: the D_H items, the same list on every rank.
        sample, judge, prompt, parse, score: metarm.cold_start_sample's and cold_start_examples'. folder: where the files go.
        awake: the rollout engine's (plumbing/engine.py): a context manager factory inside which
            `sample` keeps a vLLM engine awake between its calls; every batch samples inside one, so
            the engine wakes (or, at rollout.vllm_sleep_level 2, is pushed the policy) at most once
            for the whole cold start, not once a batch, and sleeps before the MetaRM's fit. Default:
            nothing (the HF backend's; a stand-in sampler).
        identity: dict of the settings, besides the numbers here, that make an example (the model,
            judge and nlhf keys: cold_start_settings); a file written with others stops the run.
        batch_size: metarm.cold_start_batch_size; the rest: metarm.* (sampling, train_metarm), run.seed.
        timeout_s: the longest wait for another rank's batch with no batch finished meanwhile (train.dist_timeout_s).
        log: None or a callable taking progress lines (rank 0's). poll_s: seconds between looks at the files.
    Returns:
        dict: metarm.fit_cold_start's (all ranks' counts) plus batches, resumed_batches (on disk at
        the start), seconds.
    Raises:
        SystemExit (one line): a file of other settings, a broken file, or the wait ran out.
    """
    t0 = time.time()
    n_batches = math.ceil(len(dh_items) / batch_size)
    header = {"settings": settings(identity, dh_items, batch_size=batch_size, rollouts_per_prompt=rollouts_per_prompt,
                                   max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)}
    os.makedirs(folder, exist_ok=True)
    view = {"files": {}, "done": {}}
    scan(view, folder, header)  # what earlier attempts left, in every rank's file
    resumed = len(view["done"])
    if log and resumed:
        log(f"metarm cold start: {resumed} of {n_batches} batches already in {folder}, resuming")
    with open_rank_file(folder, rank, header) as f, concurrent.futures.ThreadPoolExecutor(1) as judging:
        rounds, judged = math.ceil(n_batches / world), None

        def judge_and_write(b, items, completions):
            ex, counts = metarm.cold_start_examples(mrm, items, completions, judge=judge, parse=parse, score=score,
                                                    rollouts_per_prompt=rollouts_per_prompt)
            write_batch(f, b, ex, counts)

        # a vLLM engine stays awake from the first batch to the last (one wake, not one per batch;
        # plumbing/engine.py vllm_backend) and sleeps on leaving, before the fit below
        with awake():
            for k in range(rounds):
                b = k * world + rank
                items = dh_items[b * batch_size:(b + 1) * batch_size] if b < n_batches and b not in view["done"] else []
                completions = metarm.cold_start_sample(items, sample=sample, prompt=prompt, max_new_tokens=max_new_tokens,
                                                       rollouts_per_prompt=rollouts_per_prompt, temperature=temperature,
                                                       seed=batch_seed(seed, b))
                if judged is not None:  # the previous batch, judged while this one sampled, is on disk first
                    judged.result()
                judged = judging.submit(judge_and_write, b, items, completions) if items else None
                if log and ((k + 1) % max(1, rounds // 20) == 0 or k + 1 == rounds):  # ~20 lines in all
                    log(f"metarm cold start: round {k + 1}/{rounds} ({world} batches of up to {batch_size} D_H prompts "
                        f"x {rollouts_per_prompt} rollouts a round; this rank's: {len(items)} prompts), "
                        f"{time.time() - t0:.0f} s")
        if judged is not None:
            judged.result()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the decode's KV cache, before the MetaRM trains (and an engine wakes)
    done = wait_for_batches(view, folder, header, n_batches, timeout_s=timeout_s, poll_s=poll_s, rank=rank, world=world)
    examples = [e for b in range(n_batches) for e in done[b][0]]
    stats = metarm.fit_cold_start(mrm, examples, [done[b][1] for b in range(n_batches)], epochs=epochs, lr=lr,
                                  warmup_frac=warmup_frac, weight_decay=weight_decay, seed=seed)
    if world > 1:  # replicas: rank 0's weights (FSDP2 shards: nothing)
        mrm["seams"]["broadcast"](mrm["model"])
    return dict(stats, batches=n_batches, resumed_batches=resumed, seconds=time.time() - t0)


def settings(identity, dh_items, **numbers):
    """The header of the cold-start files: `identity`, the numbers, and the D_H items' count and a
    sha256 of their ids in order (the batches are cut from that list)."""
    ids = "\n".join(str(it["id"]) for it in dh_items).encode()
    return dict(identity, **numbers, items=len(dh_items), items_sha256=hashlib.sha256(ids).hexdigest())


def rank_file(folder, rank):
    return os.path.join(folder, f"examples.rank{rank}.jsonl")


def open_rank_file(folder, rank, header):
    """This rank's file, open for appending: created with its header (atomically) when absent or
    when a kill tore the header (nothing else can be in it then), a torn last line ended."""
    path = rank_file(folder, rank)
    with open(path, "ab+") as f:
        f.seek(0)
        first = f.readline()
        f.seek(0, os.SEEK_END)
        size = f.tell()
    if not first.endswith(b"\n"):  # absent, empty, or its header torn
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write((json.dumps(header) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        size = None
    f = open(path, "ab")
    if size:
        with open(path, "rb") as g:
            g.seek(size - 1)
            if g.read(1) != b"\n":
                f.write(b"\n")  # the line a kill cut off becomes a line of its own, skipped when read
    return f


def write_batch(f, batch, examples, counts):
    """Batch `batch`'s lines (start, examples, done) in one write, flushed and fsync'd before the next batch."""
    lines = [{"batch": batch, "start": True}] + [dict(e, batch=batch) for e in examples] + [{"batch": batch, "done": counts}]
    f.write("".join(json.dumps(x) + "\n" for x in lines).encode())
    f.flush()
    os.fsync(f.fileno())


def scan(view, folder, header):
    """Read what is new in every rank's file of `folder` into view {"files": {path: read state},
    "done": {batch: (examples, counts)}}: complete lines only (a line still being written waits
    for the next scan); a batch counts at its "done" line. Raises SystemExit (one line): a file
    with other settings, no header, or a batch whose example count disagrees with its "done" line."""
    for path in sorted(glob.glob(os.path.join(folder, "examples.rank*.jsonl"))):
        st = view["files"].setdefault(path, {"offset": 0, "line": 0, "pending": {}})
        for raw in new_lines(path, st):
            st["line"] += 1
            try:
                rec = json.loads(raw)
            except ValueError:
                if st["line"] == 1:
                    raise SystemExit(f"metarm cold start: {path} line 1 is not a cold-start header; delete the file")
                continue  # a line a kill cut off: its batch has no "done" line after it here
            if st["line"] == 1:
                check_header(path, rec, header)
            elif rec.get("start"):
                st["pending"][rec["batch"]] = []
            elif "done" in rec:
                ex = st["pending"].pop(rec["batch"], [])
                if len(ex) != rec["done"]["examples"]:
                    raise SystemExit(f"metarm cold start: {path} line {st['line']}: batch {rec['batch']} says "
                                     f"{rec['done']['examples']} examples, the file holds {len(ex)}; delete the file "
                                     f"(its batches are sampled again)")
                view["done"].setdefault(rec["batch"], (ex, rec["done"]))
            elif rec["batch"] in st["pending"]:
                st["pending"][rec["batch"]].append({k: rec[k] for k in ("text", "r", "dh")})


def new_lines(path, st, chunk=1 << 24):
    """The complete lines of `path` past st["offset"], read 16 MiB at a time (a file can hold GBs
    of examples); st["offset"] moves past each one, never into a line still being written."""
    with open(path, "rb") as f:
        f.seek(st["offset"])
        buf = b""
        while data := f.read(chunk):
            buf += data
            end = buf.rfind(b"\n") + 1
            done, buf = buf[:end], buf[end:]
            st["offset"] += len(done)
            yield from done.splitlines()


def check_header(path, rec, header):
    if "settings" not in rec:
        raise SystemExit(f"metarm cold start: {path} line 1 is not a cold-start header; delete the file")
    old, new = rec["settings"], header["settings"]
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        said = ", ".join(f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in diff[:4])
        raise SystemExit(f"metarm cold start: {path} was made with {said}{' and more' if len(diff) > 4 else ''}: "
                         f"its examples are not this cold start's; delete {os.path.dirname(path)} to start it over, "
                         f"or run with those settings to resume it")


def wait_for_batches(view, folder, header, n_batches, *, timeout_s, poll_s=1.0, rank=0, world=1,
                     clock=time.monotonic, sleep=time.sleep):
    """Every batch 0..n_batches-1, read from the files (scan) until all are there. The deadline
    counts from the last batch that arrived: timeout_s with none finished anywhere means a rank
    stopped (or one batch is slower than the timeout). Returns view["done"]. Raises SystemExit."""
    last, seen = clock(), -1
    while True:
        scan(view, folder, header)
        have = sum(b in view["done"] for b in range(n_batches))
        if have == n_batches:
            return view["done"]
        if have > seen:
            last, seen = clock(), have
        elif clock() - last > timeout_s:
            missing = [b for b in range(n_batches) if b not in view["done"]]
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise SystemExit(f"metarm cold start: rank {rank} waited {timeout_s:.0f} s (train.dist_timeout_s) with no "
                             f"batch finished; batches {shown} of {n_batches} (ranks "
                             f"{sorted({b % world for b in missing})} of {world}) are not in {folder}: a rank stopped, or "
                             f"one batch takes longer than that (metarm.cold_start_batch_size). Run the same command "
                             f"again: the cold start resumes from the batches on disk")
        sleep(poll_s)


# ----------------------------------------------------------------------------------------------
# From the config; the record


def cold_start_settings(cfg, tokenizer):
    """run_cold_start's keyword arguments from the config (metarm.*, nlhf.*, model.*, judge.*,
    run.seed; the GRM's `tokenizer` for its prompts): one place, for train.py's cold start and
    the CLI's (python -m plumbing.cli metarm cold-start)."""
    m, nl, j = cfg["metarm"], cfg["nlhf"], cfg["judge"]
    identity = {"model.policy": cfg["model"]["policy"], "model.dtype": cfg["model"]["dtype"],
                "metarm.model": m["model"] or cfg["model"]["policy"], "metarm.max_length": m["max_length"],
                "judge.backend": j["backend"], "judge.model": j["model"], "judge.variant": j["variant"],
                "judge.on_failure": j["on_failure"],
                **{f"nlhf.{k}": nl[k] for k in ("lam", "threshold", "threshold_rule", "similarity", "gate_on_outcome",
                                               "grm_prompt", "max_critique_lines", "max_critique_chars")}}
    prompt = functools.partial(reward.grm_prompt_ids, tokenizer, chat=policy_chat(tokenizer, cfg["model"]),
                               max_lines=nl["max_critique_lines"], style=nl["grm_prompt"])
    parse = functools.partial(reward.parse_grm_output, max_lines=nl["max_critique_lines"],
                              max_chars=nl["max_critique_chars"], style=nl["grm_prompt"])
    score = functools.partial(reward.score_dh, lam=nl["lam"], threshold=nl["threshold"],
                              gate_on_outcome=nl["gate_on_outcome"], inclusive=nl["threshold_rule"] == "inclusive",
                              similarity=nl["similarity"], on_failure=j["on_failure"])
    return dict(prompt=prompt, parse=parse, score=score, identity=identity, batch_size=m["cold_start_batch_size"],
                rollouts_per_prompt=m["rollouts_per_prompt"], max_new_tokens=m["max_new_tokens"],
                temperature=m["temperature"], epochs=m["epochs"], lr=m["lr"], warmup_frac=m["warmup_frac"],
                weight_decay=m["weight_decay"], seed=cfg["run"]["seed"])


def record_cold_start(out_dir, stats, rollouts_per_prompt):
    """The MetaRM cold start's set (RM-NLHF §3.2.2: N rollouts per D_H prompt, judged, then
    trained on), so that an empty or tiny one cannot pass unnoticed: <out_dir>/cold_start.json
    (run_cold_start's stats), one printed line (and a warning when it is empty), and the metarm/cold_start_* metrics returned
    for metrics.jsonl's first step (emit adds them).

    Args: stats: run_cold_start's dict (rollouts, invalid, judge_failures, examples, ...).
        rollouts_per_prompt: metarm.rollouts_per_prompt (prompts = rollouts / it).
    Returns: {"metarm/cold_start_<name>": int} for prompts, rollouts, invalid, judge_failures, examples.
    """
    counts = dict(prompts=stats["rollouts"] // rollouts_per_prompt,
                  **{k: stats[k] for k in ("rollouts", "invalid", "judge_failures", "examples")})
    with open(os.path.join(out_dir, "cold_start.json"), "w") as f:
        json.dump(dict(stats, prompts=counts["prompts"]), f, indent=1)
    print(f"[train] MetaRM cold-start set: {counts['prompts']} D_H prompts x {rollouts_per_prompt} = "
          f"{counts['rollouts']} rollouts, {counts['invalid']} unparseable, {counts['judge_failures']} judge "
          f"failures -> {counts['examples']} training examples ({out_dir}/cold_start.json; metrics.jsonl's first "
          f"step: metarm/cold_start_*)", flush=True)
    if not counts["examples"]:  # a MetaRM trained on nothing: its D_O bonus is a random head's
        print(f"[train] WARNING: the MetaRM cold start had 0 training examples ({counts['rollouts']} rollouts, "
              f"{counts['invalid']} unparseable, {counts['judge_failures']} judge failures): its D_O predictions "
              f"start untrained; the GRM cannot yet write its verdict format (nlhf.*, metarm.max_new_tokens)",
              flush=True)
    return {f"metarm/cold_start_{k}": v for k, v in counts.items()}
