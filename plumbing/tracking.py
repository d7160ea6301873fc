"""Experiment trackers (run.report_to: tensorboard, trackio, wandb; docs/method.md §9), on rank 0.

    open_trackers(cfg, start_step)   one dict per tracker (log, close); a resumed run continues
                                     the same tracker runs (<out_dir>/tracking.json)
    track_step(trackers, metrics, records)
                                     one step's metrics.jsonl line and its samples as a table
    close_trackers(trackers)         flush and finish them
    tracker_metrics, samples_table, markdown_table
                                     what a tracker is sent: numbers, a table, its markdown
    check_wandb_credentials()        wandb online without an API key: one line at start-up,
                                     before any model loads (plumbing/run.py check_startup)
"""
import json
import os
import secrets


def tracker_metrics(metrics, prefix=""):
    """The numeric entries of a metrics.jsonl line for a tracker: ints, floats and bools (as 0/1),
    nested dicts flattened to "outer/inner"; None (e.g. accuracy without labels), strings and the
    "step" entry (the trackers' x axis) left out."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(tracker_metrics(v, prefix=f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and (prefix or k != "step"):
            out[prefix + k] = float(v) if isinstance(v, bool) else v
    return out


def samples_table(records):
    """(columns, rows) of one step's samples.jsonl records: every field any record has, in first-seen
    order; numbers, strings, bools and None as they are, anything else (the evaluators' log-probs,
    list labels) as its JSON text, so each column holds one kind of value."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    cell = lambda v: v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v)
    return columns, [[cell(r.get(c)) for c in columns] for r in records]


def markdown_table(columns, rows):
    """A markdown table (TensorBoard's text plugin renders it): | and newlines escaped."""
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                     + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def open_trackers(cfg, start_step):
    """Rank 0's trackers of run.report_to: a list of {"name", "log"(metrics, step, table), "close",
    "skip_through" (steps up to it are not sent again), "info" (tracking.json's dict), "path"}.

    A resumed run continues the same tracker runs: <out_dir>/tracking.json keeps the run id (a
    fresh run, start_step 0, draws a new one) and the last step each tracker got. The steps a
    killed run logged after its checkpoint are redone on resume (truncate_jsonl drops them from
    metrics.jsonl): TensorBoard purges them (purge_step) and takes the new values; trackio and wandb
    cannot delete logged steps, so they skip the steps they already have (resume is exact, so only
    time/*, memory/* and rollout/tokens_per_s can differ; metrics.jsonl has the redone values)."""
    run = cfg["run"]
    if not run["report_to"]:
        return []
    out_dir, path = run["out_dir"], os.path.join(run["out_dir"], "tracking.json")
    info = None
    if start_step and os.path.exists(path):
        with open(path) as f:
            info = json.load(f)
    if info is None:
        info = {"id": secrets.token_hex(4), "name": os.path.basename(os.path.normpath(os.path.abspath(out_dir))),
                "last_step": {}}
    trackers, shared = [], {"info": info, "path": path}  # track_step rewrites tracking.json from info
    for name in run["report_to"]:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: readers drop this folder's events at steps >= it (a killed run's steps past its checkpoint)
            writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=start_step + 1)

            def log(metrics, step, table, writer=writer):
                for k, v in metrics.items():
                    writer.add_scalar(k, v, step)
                if table is not None:
                    writer.add_text("samples", markdown_table(*table), step)
                writer.flush()  # a crash loses no logged step
            trackers.append({**shared, "name": name, "log": log, "close": writer.close, "skip_through": -1})
            continue
        try:
            if name == "trackio":  # local store ($TRACKIO_DIR, default ~/.cache/huggingface/trackio): no server, no network
                import trackio
                r = trackio.init(project=run["tracking_project"], name=f"{info['name']}-{info['id']}", config=cfg,
                                 resume="allow")
                make_table = lambda columns, rows: trackio.Table(columns=columns, data=rows)
            else:  # wandb: online unless WANDB_MODE=offline (then `wandb sync <out_dir>/wandb/offline-run-*` uploads it)
                import wandb
                r = wandb.init(project=run["tracking_project"], id=info["id"], name=info["name"], resume="allow",
                               dir=out_dir, config=cfg)
                make_table = lambda columns, rows: wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
        except Exception as e:  # noqa: BLE001 - e.g. wandb's CommError when its server cannot be reached
            why = (str(e).strip().splitlines() or [""])[0]
            raise SystemExit(f"config key run.report_to: {name} could not start its run ({type(e).__name__}: {why})"
                             + ("; WANDB_MODE=offline logs locally" if name == "wandb" else ""))

        def log(metrics, step, table, r=r, make_table=make_table):
            r.log({**metrics, **({"samples": make_table(*table)} if table is not None else {})}, step=step)
        trackers.append({**shared, "name": name, "log": log, "close": r.finish,
                         "skip_through": info["last_step"].get(name, 0) if start_step else -1})  # -1: step 0 (run.eval_at_start) too
    return trackers


def track_step(trackers, metrics, records):
    """Send one step's metrics.jsonl line (tracker_metrics) and, unless records is None, its
    samples.jsonl records as a table (samples_table) to every tracker, then record the step in
    tracking.json (atomic)."""
    if not trackers:
        return
    step, values = metrics["step"], tracker_metrics(metrics)
    table = samples_table(records) if records else None
    for t in trackers:
        if step > t["skip_through"]:
            t["log"](values, step, table)
            t["info"]["last_step"][t["name"]] = step
    info, path = trackers[0]["info"], trackers[0]["path"]
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(path + ".tmp", path)


def close_trackers(trackers):
    """Flush and close every tracker (wandb and trackio finish their runs)."""
    for t in trackers:
        t["close"]()


def check_wandb_credentials():
    """wandb in online mode needs a W&B API key: without one wandb.init fails (no terminal) or
    prompts, after every model has loaded. SystemExit (one line) before that instead."""
    import wandb
    if wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):  # WANDB_MODE or wandb's settings file
        return
    if not wandb.login(verify=False, prompt=False):  # WANDB_API_KEY, wandb's settings, ~/.netrc; no network
        raise SystemExit("config key run.report_to: wandb is online but no W&B API key is configured: run "
                         "`wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log locally")
