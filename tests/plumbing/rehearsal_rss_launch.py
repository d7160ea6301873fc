"""torchrun entry of tests/plumbing/test_rehearsal_nlhf.py: rehearsal_launch.py's run (train.main,
RM-NLHF verdicts forced), recording this rank's memory to $REHEARSAL_RSS_DIR/rank<r>.json, also when
the run fails: "base_kib", the resident set once torch, transformers and the project are imported
(before train.main loads anything); "peak_kib", resource.getrusage's ru_maxrss (the peak resident
set, KiB on Linux) at the end; "stages", each of the cold start, validation and checkpoint with the
resident set at its start and the peak at its end."""
import json
import os
import resource
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]


def rss_kib():
    """The resident set now (VmRSS of /proc/self/status), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def peak_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def recorded(fn, name, stages):
    def wrapper(*a, **kw):
        start = rss_kib()
        try:
            return fn(*a, **kw)
        finally:
            stages.append({"stage": name, "start_kib": start, "peak_kib": peak_kib()})
    return wrapper


if __name__ == "__main__":
    import train  # noqa: F401  (torch, transformers and the project: the base)
    import rehearsal_launch
    from plumbing import metarm_setup, run, validation
    base, stages = rss_kib(), []
    # each patched where its caller looks it up: setup_metarm, validation_step, save_run
    for module, attr, name in [(metarm_setup, "run_cold_start", "cold_start"),
                               (validation, "nlhf_validation_step", "validation"),
                               (run, "save_checkpoint", "checkpoint")]:
        setattr(module, attr, recorded(getattr(module, attr), name, stages))
    try:
        rehearsal_launch.main(sys.argv[1:])
    finally:
        with open(os.path.join(os.environ["REHEARSAL_RSS_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({"base_kib": base, "peak_kib": peak_kib(), "stages": stages}, f)
