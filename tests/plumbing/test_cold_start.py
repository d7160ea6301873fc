"""The MetaRM cold start as a stage (plumbing/cold_start.py over metarm.cold_start_sample,
cold_start_examples and fit_cold_start; issue 34 item 1): bounded batches through a `sample` callable, the examples in
per-rank JSONL files as they are made, a killed cold start resumed to the same set and the same
MetaRM, the exchange through files with a deadline and one line, a file of other settings refused;
through train.main: bounded sample calls, no second GRM alive while the MetaRM trains, a run
interrupted in its cold start resumed to the uninterrupted run's MetaRM."""
import functools
import gc
import json
import os
import threading

import pytest
import torch

from conftest import data_path, make_judge
from test_e2e_nlhf import force_verdicts, load_pairs, nlhf_args, pair, read_jsonl
import fast
import metarm
import reward
import train

from plumbing import config
from plumbing.cold_start import rank_file, run_cold_start
from plumbing.models import load_model
from plumbing.pairwise import load_pairwise
from plumbing.metarm_setup import load_metarm
from plumbing.judge import proxy_f1

NLHF = config.load_config([])["nlhf"]
# config.yaml's numbers bound, as plumbing/cold_start.py's cold_start_settings binds them
PARSE = functools.partial(reward.parse_grm_output, max_lines=NLHF["max_critique_lines"],
                          max_chars=NLHF["max_critique_chars"], style=NLHF["grm_prompt"])
SCORE = functools.partial(reward.score_dh, lam=NLHF["lam"], threshold=NLHF["threshold"],
                          gate_on_outcome=NLHF["gate_on_outcome"], inclusive=NLHF["threshold_rule"] == "inclusive",
                          similarity=NLHF["similarity"])
IDENTITY = {"model.policy": "tiny"}
N_ROLLOUTS = 2


def fake_sample(calls=None, fail_at=None):
    """A deterministic sampler: per prompt, rollout 0 a right verdict whose critique depends on the
    seed, rollout 1 a wrong one, every third prompt an unparseable rollout 1; records each call's
    prompt count; raises KeyboardInterrupt (a Ctrl-C, as a kill mid-batch) at call `fail_at` (0-based)."""
    calls = [] if calls is None else calls

    def sample(prompt_ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0):
        calls.append(len(prompt_ids))
        if fail_at is not None and len(calls) - 1 == fail_at:
            raise KeyboardInterrupt
        out = []
        for p, ids in enumerate(prompt_ids):
            crit = "Response B adds 2 and 3 wrongly." if (seed + p) % 2 else "Response A is fine."
            out += [f"<critics>{crit}</critics><choice>[[A]]</choice>",
                    "no verdict" if ids[0] % 3 == 0 else f"<critics>{crit}</critics><choice>[[B]]</choice>"]
        return {"completions": out}
    return sample, calls


def prompt(item):  # a stand-in for reward.grm_prompt_ids: the sampler above reads only its first id
    return [int(item["id"][1:]), 7, 7]


def mrm_of(model_path):
    torch.manual_seed(0)
    return load_metarm(model_path, mode="online", batch_size=4, max_length=128)


def cold(model_path, folder, items, sample, **kw):
    mrm = kw.pop("mrm", None) or mrm_of(model_path)
    stats = run_cold_start(mrm, items, sample=sample, judge=make_judge({"backend": "proxy"}), prompt=prompt, parse=PARSE,
                           score=kw.pop("score", SCORE),                           folder=folder, identity=kw.pop("identity", IDENTITY), batch_size=kw.pop("batch_size", 2),
                           rollouts_per_prompt=N_ROLLOUTS, max_new_tokens=8, temperature=1.0, epochs=1, lr=1e-4,
                           warmup_frac=0.01, weight_decay=0.01, seed=3, poll_s=0.01, **kw)
    return mrm, stats


def flat(mrm):
    return torch.cat([p.detach().flatten() for p in mrm["model"].parameters()])


def examples_in(folder):
    """Every example line of the rank files, with its batch, in file order (a torn line left out)."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    try:
                        out += [r for r in [json.loads(line)] if "text" in r]
                    except ValueError:
                        assert "half a li" in line  # the one torn line the test wrote
    return out


def test_a_killed_cold_start_resumes_to_the_uninterrupted_set_and_metarm(tiny_model_path, tmp_path):
    """7 D_H items in batches of 2 (4 batches: 2, 2, 2, 1 prompts). Uninterrupted: 4 sample calls of
    at most 2 prompts. Interrupted at the 3rd call (batches 0 and 1 on disk), then a torn line
    appended as a SIGKILL mid-write leaves it: the rerun samples only batches 2 and 3, its file
    continues (the same file, its first lines kept), and examples, counts and the trained MetaRM
    equal the uninterrupted run's. Before: one generate call with every row, nothing on disk."""
    items = [pair(i) for i in range(7)]
    whole, calls = fake_sample()
    mrm_a, stats_a = cold(tiny_model_path, str(tmp_path / "a"), items, whole)
    assert calls == [2, 2, 2, 1]
    assert stats_a["batches"] == 4 and stats_a["resumed_batches"] == 0
    assert stats_a["rollouts"] == 14 and stats_a["examples"] > 0 and stats_a["loss_first"] is not None

    folder = str(tmp_path / "b")
    broken, calls_b = fake_sample(fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        cold(tiny_model_path, folder, items, broken)
    path = rank_file(folder, 0)
    with open(path) as f:
        before = f.read()
    assert sorted({r["batch"] for r in map(json.loads, before.splitlines()) if "done" in r}) == [0, 1]
    with open(path, "a") as f:
        f.write('{"batch": 2, "start": true}\n{"batch": 2, "text": "half a li')  # a kill mid-batch, mid-line
    rest, calls_c = fake_sample()
    mrm_c, stats_c = cold(tiny_model_path, folder, items, rest)
    assert calls_c == [0, 0, 2, 1]  # batches 0, 1 are on disk: the sampler is still called (a collective), with nothing
    with open(path) as f:
        assert f.read().startswith(before)  # the file continues
    assert stats_c["resumed_batches"] == 2
    strip = lambda rs: [(r["batch"], r["text"], r["r"], r["dh"]) for r in rs]  # noqa: E731
    assert strip(examples_in(folder)) == strip(examples_in(str(tmp_path / "a")))
    assert {k: v for k, v in stats_c.items() if k not in ("seconds", "resumed_batches")} == \
        {k: v for k, v in stats_a.items() if k not in ("seconds", "resumed_batches")}
    assert torch.equal(flat(mrm_c), flat(mrm_a))


def test_a_batch_is_judged_while_the_next_one_samples(tiny_model_path, tmp_path, monkeypatch):
    """The judge of batch 0 (a server round trip per rollout, RM-NLHF Eq. 4) runs while batch 1
    samples: batch 0's judging waits for the sampler's second call, which comes only if the two
    overlap (one after the other, the wait runs out and records False)."""
    second, overlapped = threading.Event(), []

    def score(*a, **kw):
        overlapped.append(second.wait(timeout=20))
        return SCORE(*a, **kw)
    inner, calls = fake_sample()

    def sample(prompt_ids, **kw):
        if len(calls) == 1:
            second.set()
        return inner(prompt_ids, **kw)
    _, stats = cold(tiny_model_path, str(tmp_path / "e"), [pair(i) for i in range(4)], sample, score=score)
    assert calls == [2, 2] and overlapped == [True, True] and stats["batches"] == 2


@pytest.mark.parametrize("level", [1, 2])
def test_a_vllm_engine_wakes_once_for_all_the_batches_and_sleeps_before_the_fit(tiny_model_path, tmp_path, monkeypatch,
                                                                                level):
    """The cold start through plumbing/engine.py's vLLM backend (its real sample / awake / push glue)
    over tests/plumbing/test_vllm.py's stand-in LLM, which records the calls, with sleep mode on as on
    a GPU; generate_vllm answers with fake_sample's completions. 7 D_H items in batches of 2: 4
    sample calls. The engine starts asleep (as after a validation), so the first call wakes it:
    level 1 wake_up, level 2 a push (the policy's weights reloaded in one call). Then the batches
    sample with no sleep, wake or push between them, and it sleeps once, before the MetaRM's fit.
    Before: a sleep after every batch and a wake before the next, at level 2 a whole push per batch
    (the FSDP2 shards gathered and reloaded 4 times; the CPU engine never sleeps, so only this shows it)."""
    from plumbing import engine as E
    from test_vllm import EXPECTED, _backend, _engine
    eng = _engine(True, level, EXPECTED)
    backend = _backend(monkeypatch, eng)
    eng["asleep"] = True
    llm, (inner, calls) = eng["llm"], fake_sample()

    def generate(llm_, tok, ids, group_size, max_new_tokens, *, seed, **kw):
        llm.calls.append(("generate",))
        return inner(ids, group_size=group_size, max_new_tokens=max_new_tokens, seed=seed)
    monkeypatch.setattr(E, "generate_vllm", generate)
    at_fit, fit = [], metarm.fit_cold_start
    monkeypatch.setattr(metarm, "fit_cold_start", lambda *a, **kw: at_fit.append((eng["asleep"], list(llm.calls)))
                        or fit(*a, **kw))
    _, stats = cold(tiny_model_path, str(tmp_path / "v"), [pair(i) for i in range(7)], backend["sample"],
                    awake=backend["awake"])
    assert calls == [2, 2, 2, 1] and stats["batches"] == 4 and stats["examples"] > 0
    wake = [("wake_up", None)] if level == 1 else [("wake_up", ("weights",)), ("reload_weights",),
                                                   ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert llm.calls == wake + [("generate",)] * 4 + [("sleep", level)]
    assert at_fit == [(True, llm.calls)]  # asleep when the MetaRM trains, and nothing after


def test_the_method_computes_the_rewards_by_hand(tiny_model_path):
    """metarm.cold_start_sample and cold_start_examples on known completions: the real prompt building of the tiny GRM, the
    proxy F1 of a copied human critique line: right + matched -> 1 + λ·1[F1 > 0.5], wrong -> 0,
    no format -> no example (R = -1 is never a MetaRM target); fit_cold_start sums the counts."""
    items = load_pairwise(data_path("mr_ben_math", "math.jsonl"))[:2]
    grm, tok = load_model(tiny_model_path)
    prompt_ids = functools.partial(reward.grm_prompt_ids, tok, chat=False, max_lines=NLHF["max_critique_lines"],
                                   style=NLHF["grm_prompt"])
    seen = {}

    def sample(ids, *, group_size, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0):
        seen.update(prompts=len(ids), g=group_size, first=tok.decode(ids[0]), seed=seed)
        texts = []
        for it in items:
            line, wrong = it["critique"].splitlines()[0], "B" if it["winner"] == "A" else "A"
            texts += [f"<critics>{line}</critics><choice>[[{it['winner']}]]</choice>",
                      f"<critics>{line}</critics><choice>[[{wrong}]]</choice>", "no format at all"]
        return {"completions": texts}

    mrm = mrm_of(tiny_model_path)
    completions = metarm.cold_start_sample(items, sample=sample, prompt=prompt_ids, rollouts_per_prompt=3,
                                           max_new_tokens=8, seed=11)
    assert seen["prompts"] == 2 and seen["g"] == 3 and seen["seed"] == 11 and "[Response A]" in seen["first"]
    ex, counts = metarm.cold_start_examples(mrm, items, completions, judge=make_judge({"backend": "proxy"}), parse=PARSE,
                                            score=SCORE, rollouts_per_prompt=3)
    f1 = [proxy_f1(it["critique"], it["critique"].splitlines()[0])["f1"] for it in items]
    assert [e["r"] for e in ex] == [r for f in f1 for r in (1.0 + 0.5 * (f > 0.5), 0.0)]
    assert counts == {"rollouts": 6, "invalid": 2, "judge_failures": 0, "examples": 4, "truncated": counts["truncated"]}
    stats = metarm.fit_cold_start(mrm, ex, [counts, dict(counts, rollouts=1)], epochs=1, lr=1e-4, warmup_frac=0.01,
                                  weight_decay=0.01, seed=0)
    assert stats["rollouts"] == 7 and stats["examples"] == 4 and stats["loss_first"] is not None
    assert stats["target_mean"] == pytest.approx(sum(e["r"] for e in ex) / 4)
    # nothing usable: nothing trained, and the numbers say so
    empty = metarm.fit_cold_start(mrm, [], [dict(counts, examples=0)], epochs=1, lr=1e-4, warmup_frac=0.01,
                                  weight_decay=0.01, seed=0)
    assert empty["loss_first"] is None and empty["target_mean"] is None


def test_a_rank_waits_for_the_others_files_with_a_deadline(tiny_model_path, tmp_path, monkeypatch):
    """Rank 0 of 2 runs batches 0 and 2 of 4; rank 1 never writes (it died): rank 0 waits on the
    files and stops after the deadline with one line naming the missing batches and their rank,
    instead of sitting in a collective until the process-group timeout."""
    items = [pair(i) for i in range(8)]
    sample, calls = fake_sample()
    with pytest.raises(SystemExit) as e:
        cold(tiny_model_path, str(tmp_path / "c"), items, sample, rank=0, world=2, timeout_s=0.3)
    assert calls == [2, 2]
    msg = str(e.value)
    assert "batches 1, 3 of 4 (ranks [1] of 2)" in msg and "train.dist_timeout_s" in msg and "resumes" in msg
    # rank 1's file arrives (a rerun of that rank): it finds all four batches and trains (with no
    # process group here, rank 0's weights are not broadcast)
    mrm = mrm_of(tiny_model_path)
    mrm["seams"] = dict(mrm["seams"], broadcast=lambda model: None)
    sample1, calls1 = fake_sample()
    cold(tiny_model_path, str(tmp_path / "c"), items, sample1, rank=1, world=2, timeout_s=5, mrm=mrm)
    assert calls1 == [2, 2]


def test_a_file_of_other_settings_is_refused(tiny_model_path, tmp_path):
    items = [pair(i) for i in range(2)]
    folder = str(tmp_path / "d")
    cold(tiny_model_path, folder, items, fake_sample()[0])
    with pytest.raises(SystemExit, match=r"examples.rank0.jsonl was made with model.policy='tiny' \(now 'other'\)"):
        cold(tiny_model_path, folder, items, fake_sample()[0], identity={"model.policy": "other"})
    with pytest.raises(SystemExit, match=r"batch_size=2 \(now 1\)"):
        cold(tiny_model_path, folder, items, fake_sample()[0], batch_size=1)


# ---- through train.main: the cold start of a run ------------------------------------------------

def live_causal_lms():
    """How many transformers causal LMs this process holds (the GRM and any copy of it)."""
    import warnings
    from transformers import PreTrainedModel
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches deprecated torch aliases
        warnings.simplefilter("ignore")
        return sum(isinstance(o, PreTrainedModel) and type(o).__name__.endswith("ForCausalLM") for o in gc.get_objects())


@pytest.mark.slow
def test_a_run_cold_starts_in_bounded_batches_with_one_grm_and_resumes(tiny_model_path, tmp_path, monkeypatch, capsys):
    """train.main with train.parallel fsdp2 (one rank) and no GRPO reference: the cold start
    samples 3 D_H prompts in 3 calls of 1 prompt x 2 rollouts (metarm.cold_start_batch_size 1),
    while the MetaRM trains the only causal LM alive is the policy, and a run interrupted in its
    cold start (Ctrl-C at the 3rd call) resumes it from its file to the uninterrupted run's MetaRM.
    Before: one call of all 6 rows, a second GRM loaded for the cold start and alive through the
    MetaRM's training, nothing on disk before the end."""
    force_verdicts(monkeypatch, load_pairs())
    real = fast.generate
    rows, fail = [], {"at": None}

    def generate(model, tok, prompt_ids, group_size, *a, **kw):
        rows.append(len(prompt_ids) * group_size)
        if fail["at"] is not None and len(rows) == fail["at"]:
            raise KeyboardInterrupt
        return real(model, tok, prompt_ids, group_size, *a, **kw)
    monkeypatch.setattr(fast, "generate", generate)
    alive = []
    real_train = metarm.train_metarm

    def train_metarm(*a, **kw):
        alive.append(live_causal_lms())
        return real_train(*a, **kw)
    monkeypatch.setattr(metarm, "train_metarm", train_metarm)
    extra = ["run.total_steps=1", "train.parallel=fsdp2", "algo.kl_coef=0", "metarm.cold_start_items=3",
             "metarm.cold_start_batch_size=1", "metarm.rollouts_per_prompt=2", "metarm.max_new_tokens=8",
             "rollout.max_new_tokens=8", "nlhf.max_prompt_tokens=800"]
    out_a = str(tmp_path / "a")
    train.main(nlhf_args(out_a, tiny_model_path, extra))
    assert rows[:3] == [2, 2, 2]  # the cold start's three calls; then the step's rollout
    assert alive == [1]
    stats = json.load(open(os.path.join(out_a, "cold_start.json")))
    assert stats["batches"] == 3 and stats["rollouts"] == 6 and stats["examples"] >= 3  # the forced verdicts

    out_b = str(tmp_path / "b")
    rows.clear()
    fail["at"] = 3
    capsys.readouterr()
    with pytest.raises(SystemExit):  # Ctrl-C: one line, exit 130 (guards.run_interruptible)
        train.main(nlhf_args(out_b, tiny_model_path, extra))
    assert f"the MetaRM cold start continues from the batches in {out_b}/cold_start" in capsys.readouterr().err
    done = [r["batch"] for r in read_jsonl(rank_file(os.path.join(out_b, "cold_start"), 0)) if "done" in r]
    assert done == [0, 1] and not os.path.exists(os.path.join(out_b, "metarm"))
    rows.clear()
    fail["at"] = None
    train.main(nlhf_args(out_b, tiny_model_path, extra))
    assert rows[:1] == [2] and len(rows) == 2  # batch 2 only, then the step's rollout
    weights = [load_metarm(os.path.join(o, "metarm"))["model"].score.weight for o in (out_a, out_b)]
    assert torch.equal(*weights)
    a, b = (read_jsonl(rank_file(os.path.join(o, "cold_start"), 0)) for o in (out_a, out_b))
    assert [r for r in a if "text" in r] == [r for r in b if "text" in r]


@pytest.mark.parametrize("value", [0, -2])
def test_the_batch_size_is_checked_before_any_model_loads(value):
    with pytest.raises(SystemExit, match=f"config key metarm.cold_start_batch_size: must be >= 1, got {value}"):
        config.load_config([], [f"metarm.cold_start_batch_size={value}"])  # load_config runs validate_config


def test_the_reader_takes_complete_lines_in_chunks(tmp_path):
    """new_lines over chunks shorter than a line: complete lines only, the offset never inside a
    line still being written; the rest of that line comes with the next read."""
    from plumbing.cold_start import new_lines
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a": 1}\n{"bb": 22}\n{"cc')
    st = {"offset": 0}
    assert list(new_lines(str(path), st, chunk=5)) == [b'{"a": 1}', b'{"bb": 22}'] and st["offset"] == 20
    with open(path, "ab") as f:
        f.write(b'c": 3}\n')
    assert list(new_lines(str(path), st, chunk=5)) == [b'{"ccc": 3}'] and st["offset"] == 31
