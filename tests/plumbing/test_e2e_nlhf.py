"""RM-NLHF end to end (docs/method.md §5): train.py with task rm_nlhf, Algorithm 1's order (RM-NLHF App. D.1), resume with the
MetaRM, judge failures inside a run, and one-line start-up errors through the CLI."""
import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, SMOLLM2, data_path, make_judge
import metarm
import reward
import rollout
import train
import fast
from plumbing.config import load_config
from plumbing.pairwise import load_pairwise
from plumbing.prompts import keep_short, prompt_token_limit
from plumbing.metarm_setup import load_metarm, load_saved_metarm
from plumbing.judge import JUDGE_KEYS

CPU_PRESET = os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")
NLHF_METRICS = {"nlhf/format_error_rate", "nlhf/outcome_acc", "nlhf/process_rate", "judge/fail_rate", "judge/calls",
                "metarm/loss", "metarm/agreement", "metarm/updates",
                "order/judge_done_s", "order/metarm_update_done_s", "order/metarm_predict_start_s",
                "order/do_reward_done_s", "reward/mean", "advantage/abs_mean", "loss", "grad_norm",
                "time/rollout", "time/reward", "time/update"}
NLHF_SAMPLE = {"step", "set", "item", "winner", "completion", "choice", "valid", "why", "correct", "critique",
               "human_critique", "f1", "f1_why", "judge_why", "r_process", "r_hat", "reward", "advantage"}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pair(i, winner="A", critique="Response B adds 2 and 3 wrongly. Response A is right."):
    return {"id": f"p{i}", "context": f"What is {i}+3?", "response_a": f"{i + 3}", "response_b": f"{i + 4}",
            "winner": winner, "critique": critique, "source": "t", "meta": {}}


def verdict(critique, choice):
    return f"<critics>{critique}</critics>\n<choice>[[{choice}]]</choice>"


def small_cfg(**over):
    cfg = load_config([CPU_PRESET])
    for k, v in over.items():
        sec, key = k.split(".")
        cfg[sec][key] = v
    return cfg


# ---- fast: the pieces of a step ------------------------------------------------------------------

def test_config_schema_has_the_nlhf_sections():
    cfg = load_config([CPU_PRESET], ["judge.model=null", "metarm.path=null", "nlhf.do=null"])
    assert cfg["task"] == "rm_nlhf" and cfg["algo"]["loss"] == "grpo" and cfg["algo"]["kl_coef"] == 0.001
    assert set(cfg["judge"]) == set(JUDGE_KEYS)
    with pytest.raises(SystemExit, match=r"config key task: 'rlhf' is not one of \['rlme', 'rm_nlhf'\]"):
        load_config([], ["task=rlhf"])
    with pytest.raises(SystemExit, match="config key nlhf.dh_schema: 'nope' is not one of"):
        load_config([CPU_PRESET], ["nlhf.dh_schema=nope"])
    with pytest.raises(SystemExit, match=r"nlhf.dh_per_step=0.2: gives no D_H prompt"):
        load_config([CPU_PRESET], ["nlhf.dh_per_step=0.2"])  # round(0.2 x 2) = 0
    with pytest.raises(SystemExit, match=r"config key nlhf.threshold: must be in \[0.0, 1.0\]"):
        load_config([CPU_PRESET], ["nlhf.threshold=1.5"])


def test_step_items_mix_sets_and_split_ranks():
    mix = dict(prompts_per_step=8, dh_per_step=0.25, seed=small_cfg()["run"]["seed"])
    dh, do = [pair(i) for i in range(5)], [dict(pair(100 + i), critique=None) for i in range(7)]
    whole = reward.nlhf_step_items(dh, do, 3, **mix, rank=0, world=1)
    assert sum(it["set"] == "dh" for it in whole) == 2 and sum(it["set"] == "do" for it in whole) == 6
    halves = (reward.nlhf_step_items(dh, do, 3, **mix, rank=0, world=2)
              + reward.nlhf_step_items(dh, do, 3, **mix, rank=1, world=2))
    assert [it["id"] for it in halves] == [it["id"] for it in whole]  # ranks partition the same global batch
    assert [it["id"] for it in reward.nlhf_step_items(dh, do, 3, **mix, rank=0, world=1)] == [it["id"] for it in whole]
    assert all(it["set"] == "dh" for it in reward.nlhf_step_items(dh, [], 3, **mix, rank=0, world=1))


def test_keep_short_drops_long_prompts(tiny_model_path):
    """Prompts over the limit are dropped and counted (GRM prompts and policy prompts alike); the
    limit defaults to the model's context minus max_new_tokens; none left is a one-line error."""
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    nl = dict(small_cfg()["nlhf"])
    items = [pair(0), dict(pair(1), response_b="very long " * 300)]
    n0 = len(reward.grm_prompt_ids(tok, items[0], True, max_lines=nl["max_critique_lines"], style=nl["grm_prompt"]))
    overhead = len(rollout.build_prompt_ids(tok, "", True))
    ids = lambda it, text_only: reward.grm_prompt_ids(tok, it, True, max_lines=nl["max_critique_lines"],
                                                      style=nl["grm_prompt"], text_only=text_only)
    kept, dropped = keep_short(items, ids, n0, "nlhf.max_prompt_tokens", overhead)
    assert [it["id"] for it in kept] == ["p0"] and dropped == 1
    assert keep_short(items, ids, 10 ** 6, "k", overhead)[1] == 0
    n1 = len(ids(items[1], False))
    with pytest.raises(SystemExit, match=rf"config key nlhf.max_prompt_tokens: every prompt is over {n0 - 1} tokens "
                                         rf"\(the shortest has {n0}\)"):
        keep_short(items, ids, n0 - 1, "nlhf.max_prompt_tokens", overhead)
    assert n1 > n0
    # a GSM8K-style question of 200,000 characters (the 64k-token prompt) among short ones
    model = SimpleNamespace(config=AutoConfig.from_pretrained(tiny_model_path))  # context 2048
    limit = prompt_token_limit(0, model, 12, "data.max_prompt_tokens")
    assert limit == 2048 - 12
    qs = [{"question": "What is 2+3?"}, {"question": "How many? " * 20_000}, {"question": "What is 4+4?"}]
    pids = lambda it, text_only: rollout.policy_prompt_ids(tok, it, True, "{question}\nAnswer.", text_only=text_only)
    kept, dropped = keep_short(qs, pids, limit, "data.max_prompt_tokens", overhead)
    assert [q["question"] for q in kept] == ["What is 2+3?", "What is 4+4?"] and dropped == 1
    with pytest.raises(SystemExit, match="config key data.max_prompt_tokens: no prompt fits"):
        prompt_token_limit(0, model, 2048, "data.max_prompt_tokens")


def reward_step(items, comps, *, mrm, cfg, step):
    """metarm.nlhf_reward_step with the proxy judge and the config's values, as train.py binds them."""
    nl = cfg["nlhf"]
    return metarm.nlhf_reward_step(items, comps, judge=make_judge({"backend": "proxy"}), mrm=mrm, lam=nl["lam"],
                                   threshold=nl["threshold"], inclusive=nl["threshold_rule"] == "inclusive",
                                   similarity=nl["similarity"], gate_on_outcome=nl["gate_on_outcome"],
                                   on_failure=cfg["judge"]["on_failure"], max_lines=nl["max_critique_lines"],
                                   max_chars=nl["max_critique_chars"], style=nl["grm_prompt"], form=nl["do_reward"],
                                   mode=cfg["metarm"]["mode"], train_on_do=cfg["metarm"]["train_on_do"],
                                   seed=cfg["run"]["seed"] * 7_919 + step, t0=0.0)


def predicted(mrm, items, critiques):
    """metarm.predict with the MetaRM dict's model, tokenizer and numbers: R̂ per sample."""
    return metarm.predict(mrm["model"], mrm["tokenizer"], items, critiques, **metarm.settings(mrm))[0]


def test_rewards_without_metarm_hand_numbers():
    """metarm.mode none: D_O gets the outcome only. D_H: a copied human critique has proxy F1 1 ->
    1 + 0.5; a wrong verdict 0 without a judge call; no tags -1."""
    cfg = small_cfg()
    cfg["metarm"]["mode"] = "none"
    h = "Response B adds 2 and 3 wrongly. Response A is right."
    items = [dict(pair(0, critique=h), set="dh")] * 3 + [dict(pair(1, "B", None), set="do")] * 2
    comps = [verdict(h, "A"), verdict(h, "B"), "no tags", verdict("B is right.", "B"), verdict("A.", "A")]
    out = reward_step(items, comps, mrm=None, cfg=cfg, step=0)
    assert out["reward"].tolist() == [1.5, 0.0, -1.0, 1.0, 0.0] and out["valid"].all()
    s = out["records"]
    assert s[0]["f1"] == 1.0 and s[0]["judged"] and not s[1]["judged"] and s[1]["f1_why"].startswith("wrong verdict")
    assert s[2]["f1_why"] == "invalid format" and s[3]["r_hat"] is None and s[3]["f1"] is None


def test_do_training_labels_for_the_w_do_ablation():
    """metarm.train_on_do: D_O verdicts labelled by outcome alone, right 1 + λ/2, wrong 0, invalid
    not trained on (reward None), with their own critiques; λ = 0.5 -> 1.25."""
    items = [pair(0, "A", None), pair(1, "B", None), pair(2, "A", None)]
    parsed = [reward.parse_grm_output(verdict("A is right.", "A")), reward.parse_grm_output(verdict("A.", "A")),
              reward.parse_grm_output("no tags")]
    out = reward.do_training_samples(parsed, items, lam=0.5)
    assert [s["reward"] for s in out] == [1.25, 0.0, None]
    assert out[0]["critique"] == "A is right." and [s["valid"] for s in out] == [True, True, False]


def test_train_on_do_adds_the_valid_do_verdicts_to_the_metarm_update(tiny_model_path):
    cfg = small_cfg()
    cfg["metarm"]["train_on_do"] = True
    h = "Response B adds 2 and 3 wrongly. Response A is right."
    mrm = load_metarm(tiny_model_path, "online", 0.5, batch_size=4, max_length=128, online_lr=1e-2)
    items = [dict(pair(0, critique=h), set="dh")] * 2 + [dict(pair(1, "B", None), set="do")] * 2
    comps = [verdict(h, "A"), verdict("Response A is wrong.", "B"), verdict("Response B is right.", "B"), "none"]
    out = reward_step(items, comps, mrm=mrm, cfg=cfg, step=0)
    assert out["metrics"]["metarm/n"] == 3  # 2 D_H + the 1 valid D_O verdict
    cfg["metarm"]["train_on_do"] = False
    out = reward_step(items, comps, mrm=mrm, cfg=cfg, step=1)
    assert out["metrics"]["metarm/n"] == 2


def test_metarm_updated_before_it_scores_do(tiny_model_path):
    """Algorithm 1's order (RM-NLHF App. D.1): the R̂ used for D_O is the prediction of the MetaRM AFTER this step's update
    on the D_H samples, not before; D_O reward = 1 + clip(R̂ - 1, 0, λ) for a right verdict."""
    cfg = small_cfg()
    h = "Response B adds 2 and 3 wrongly. Response A is right."
    mrm = load_metarm(tiny_model_path, "online", 0.5, batch_size=4, max_length=128, online_lr=1e-2)
    before = copy.deepcopy(mrm)
    items = [dict(pair(0, critique=h), set="dh")] * 2 + [dict(pair(1, "B", None), set="do")] * 2
    comps = [verdict(h, "A"), verdict("Response A is wrong.", "B"), verdict("Response B is right.", "B"), "none"]
    out = reward_step(items, comps, mrm=mrm, cfg=cfg, step=4)
    r_hat = out["records"][2]["r_hat"]
    assert r_hat == pytest.approx(predicted(mrm, [items[2]], ["Response B is right."])[0], abs=1e-6)
    assert abs(r_hat - predicted(before, [items[2]], ["Response B is right."])[0]) > 1e-4
    assert out["reward"].tolist()[:2] == [1.5, 0.0] and out["reward"][3] == -1.0
    assert out["reward"][2].item() == pytest.approx(1.0 + min(max(r_hat - 1.0, 0.0), 0.5), abs=1e-6)
    m = out["metrics"]
    assert m["metarm/n"] == 2 and m["metarm/updates"] == 1 and m["metarm/trained_this_step"]
    assert m["order/judge_done_s"] <= m["order/metarm_update_done_s"] <= m["order/metarm_predict_start_s"]
    assert out["records"][2]["metarm_updates"] == 1


# ---- end to end: train.main in this process --------------------------------------------------------

def with_completions(out, tok, rows):
    """The rollout dict `out` with row r's completion replaced by `text` for each (r, text) in rows
    (ids = the text's tokens + EOS, mask 1 on them, not truncated); the ids tensor is widened when
    a text is longer than the sampled completions. Shared by force_verdicts and
    test_configs.force_answers."""
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, t in rows]
    width = max([out["completion_ids"].shape[1]] + [len(x) for x in ids])
    cids = torch.full((out["completion_ids"].shape[0], width), tok.pad_token_id, dtype=torch.long)
    cmask = torch.zeros(cids.shape)
    cids[:, :out["completion_ids"].shape[1]] = out["completion_ids"]
    cmask[:, :out["completion_ids"].shape[1]] = out["completion_mask"]
    for (r, text), x in zip(rows, ids):
        cids[r], cmask[r] = tok.pad_token_id, 0.0
        cids[r, :len(x)], cmask[r, :len(x)] = torch.tensor(x), 1.0
        out["completions"][r] = text
        out["truncated"][r] = False
    return dict(out, completion_ids=cids, completion_mask=cmask)


def force_verdicts(monkeypatch, pairs):
    """Replace the FIRST completion of every group by a well-formed verdict for the human winner
    (D_H: the first line of the human critique; D_O: a one-line critique); the other completions
    stay the model's own. Why: SmolLM2-135M does not write <critics>...<choice>[[X]]</choice> in a
    few dozen tokens, so every reward would be -1 and nothing past the parser (judge, MetaRM
    update and prediction, non-zero GRPO advantages) would run. Ids and masks are rebuilt from
    the text, so the update trains on exactly what is logged."""
    def find(text):  # the pair whose context and both responses all appear in the decoded prompt
        return next((it for it in pairs if all(it[k].strip()[:300] in text for k in ("context", "response_a", "response_b"))),
                    None)  # None: a prompt from none of `pairs` (e.g. a validation file's) keeps the model's own text
    real = fast.generate

    def generate(model, tok, prompt_ids, group_size, max_new_tokens, *a, **kw):
        out = real(model, tok, prompt_ids, group_size, max_new_tokens, *a, **kw)
        rows = []
        for g, ids in enumerate(prompt_ids):
            text = tok.decode(ids)
            it = find(text)
            if it is None:
                continue
            crit = it["critique"].splitlines()[0] if it["critique"] else f"Response {it['winner']} is more helpful."
            rows.append((g * group_size, verdict(crit, it["winner"])))
        return with_completions(out, tok, rows)

    monkeypatch.setattr(fast, "generate", generate)  # train.fast_paths true: train.fast_or_plain reads it


def nlhf_args(out, model, extra=()):
    return ["--config", CPU_PRESET, f"model.policy={model}", f"run.out_dir={out}", "run.total_steps=2",
            f"nlhf.dh={data_path('mr_ben_math', 'math.jsonl')}",
            f"nlhf.do={data_path('hh_rlhf_harmless_base', 'test.jsonl')}",
            "rollout.max_new_tokens=16", "metarm.max_new_tokens=16", *extra]


def load_pairs():
    return (load_pairwise(data_path("mr_ben_math", "math.jsonl"), seed=0)
            + [dict(it, critique=None) for it in load_pairwise(data_path("hh_rlhf_harmless_base", "test.jsonl"), seed=0)])


@pytest.mark.slow
def test_smollm2_two_grpo_steps_with_resume(tmp_path, monkeypatch, capsys):
    """2 GRPO steps of the real SmolLM2 GRM on Mr-Ben D_H + hh-rlhf D_O with the proxy judge and a
    MetaRM cold start: step 1 then stop (run.stop_after=1), then a second process-like call resumes."""
    pairs = load_pairs()
    force_verdicts(monkeypatch, pairs)
    out = str(tmp_path / "run")
    args = nlhf_args(out, SMOLLM2, ["metarm.online_lr=1e-4"])
    train.main(args + ["run.stop_after=1"])
    assert os.path.isfile(os.path.join(out, "metarm", "metarm.json"))  # the cold start, saved before step 1
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_000001", "metarm", "metarm.json"))
    assert [m["step"] for m in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1]
    capsys.readouterr()
    train.main(args)
    log = capsys.readouterr().out
    assert "MetaRM " + os.path.join(out, "checkpoints", "step_000001", "metarm") in log and "resuming from" in log
    assert "cold start" not in log

    metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert NLHF_METRICS <= set(m), NLHF_METRICS - set(m)
        assert all(v == v for v in m.values() if isinstance(v, float))
        assert m["metarm/trained_this_step"] is True
        assert m["order/judge_done_s"] <= m["order/metarm_update_done_s"] <= m["order/metarm_predict_start_s"] \
            <= m["order/do_reward_done_s"] <= m["time/rollout"] + m["time/reward"] + 1e-6
        assert m["judge/calls"] == 1 and m["judge/fail_rate"] == 0.0
    # the MetaRM came back from the checkpoint: its update count continues (cold start again would say 1)
    assert [m["metarm/updates"] for m in metrics] == [1, 2]

    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert len(samples) == 8 and all(NLHF_SAMPLE <= set(s) for s in samples)
    for s in samples:  # every reward recomputed by hand from the logged fields (RM-NLHF Eq. 4-8; docs/method.md §5.3-5.4)
        if not s["valid"]:
            assert s["reward"] == -1.0
        elif s["set"] == "dh":
            assert s["correct"] and s["reward"] == 1.0 + 0.5 * (s["f1"] > 0.5)  # Eq. 4: strict
        else:
            assert s["correct"] and s["reward"] == pytest.approx(1.0 + min(max(s["r_hat"] - 1.0, 0.0), 0.5))
    for st in (1, 2):  # GRPO advantages: (r - mean) / (population std + 1e-6), groups of 2
        for g in (0, 1):
            grp = [s for s in samples if s["step"] == st and s["group"] == g]
            r = torch.tensor([s["reward"] for s in grp])
            expect = (r - r.mean()) / (r.std(unbiased=False) + 1e-6) if r[0] != r[1] else torch.zeros(2)
            assert [s["advantage"] for s in grp] == pytest.approx(expect.tolist(), abs=1e-5)
    # Algorithm 1's order: step 2's R̂ is what the MetaRM saved AFTER step 2's update predicts; the
    # MetaRM before step 2 (in the step-1 checkpoint) predicts something else
    by_id = {it["id"]: it for it in pairs}
    s2 = next(s for s in samples if s["step"] == 2 and s["set"] == "do" and s["valid"])
    after = load_saved_metarm(os.path.join(out, "checkpoints", "step_000002", "metarm"))
    item = by_id[s2["item"]]
    assert predicted(after, [item], [s2["critique"]])[0] == pytest.approx(s2["r_hat"], abs=1e-4)
    # the step-1 checkpoint was deleted by keep_checkpoints=2? no: 2 kept; compare with it
    earlier = load_saved_metarm(os.path.join(out, "checkpoints", "step_000001", "metarm"))
    assert abs(predicted(earlier, [item], [s2["critique"]])[0] - s2["r_hat"]) > 1e-4
    cfg_text = open(os.path.join(out, "config.yaml")).read()
    assert "task: rm_nlhf" in cfg_text


@pytest.mark.slow
def test_refused_judge_is_counted_and_key_never_written(tmp_path, monkeypatch, tiny_model_path):
    """A judge URL that refuses connections: the D_H sample is masked (reward None, advantage 0),
    judge/fail_rate counts it, the run goes on. The API key is in no file the run writes."""
    secret = "sk-test-DO-NOT-LOG-4242"
    monkeypatch.setenv("RLME_TEST_JUDGE_KEY", secret)
    force_verdicts(monkeypatch, load_pairs())
    # the server goes away after start-up: the start-up probe (tests/plumbing/test_judge_probe.py) is passed over
    monkeypatch.setattr("plumbing.judge.probe_judge", lambda *a, **k: None)
    out = str(tmp_path / "run")
    train.main(nlhf_args(out, tiny_model_path, [
        "run.total_steps=1", "judge.backend=openai", "judge.base_url=http://127.0.0.1:9/v1", "judge.model=m",
        "judge.api_key_env=RLME_TEST_JUDGE_KEY", "judge.max_retries=1", "judge.backoff_base_s=0.01",
        "metarm.cold_start=false", "rollout.max_new_tokens=4"]))
    m = read_jsonl(os.path.join(out, "metrics.jsonl"))[0]
    assert m["judge/calls"] == 1 and m["judge/fail_rate"] == 1.0 and m["judge/failed"] == 1
    failed = [s for s in read_jsonl(os.path.join(out, "samples.jsonl")) if s["judged"]]
    assert len(failed) == 1 and failed[0]["reward"] is None and failed[0]["advantage"] == 0.0
    assert failed[0]["f1"] is None and failed[0]["judge_why"].startswith("connection error")
    assert m["metarm/n"] == 0  # a failed judge call is no training example
    for root, _, files in os.walk(out):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                assert secret.encode() not in fh.read(), os.path.join(root, f)
    assert "RLME_TEST_JUDGE_KEY" in open(os.path.join(out, "config.yaml")).read()


@pytest.mark.slow
def test_cold_start_set_size_is_logged(tmp_path, monkeypatch, capsys, tiny_model_path):
    """The MetaRM cold start's set is recorded where an empty one would be seen (issue 27): 1 D_H
    prompt x 2 rollouts, the first forced to a well-formed verdict for the human winner (judged by
    the proxy: no failure, an example), the second the tiny random model's own 16 tokens
    (unparseable: no example) -> 1 prompt, 2 rollouts, 1 unparseable, 0 judge failures, 1 example,
    in cold_start.json, in one printed line and in metrics.jsonl's first step only (before: the
    stats were dropped; only a zero-example warning was printed)."""
    force_verdicts(monkeypatch, load_pairs())
    out = str(tmp_path / "run")
    train.main(nlhf_args(out, tiny_model_path, ["run.total_steps=2", "metarm.cold_start_items=1",
                                                "metarm.rollouts_per_prompt=2"]))
    want = {"prompts": 1, "rollouts": 2, "invalid": 1, "judge_failures": 0, "examples": 1}
    saved = json.load(open(os.path.join(out, "cold_start.json")))
    assert {k: saved[k] for k in want} == want and saved["loss_first"] is not None
    first, second = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert {k: first[f"metarm/cold_start_{k}"] for k in want} == want
    assert not any(k.startswith("metarm/cold_start_") for k in second)
    log = capsys.readouterr().out
    assert (f"[train] MetaRM cold-start set: 1 D_H prompts x 2 = 2 rollouts, 1 unparseable, 0 judge failures -> "
            f"1 training examples ({out}/cold_start.json;") in log


@pytest.mark.slow
def test_validation_during_the_run_logs_pairwise_accuracy(tmp_path, monkeypatch, tiny_model_path):
    """run.eval_every=1 with nlhf.val=holdout (configs/cpu_rm_nlhf.yaml: 2 pairs, 32 new tokens),
    2 steps: metrics.jsonl has val/* at steps 1 and 2 (every step and the last). force_verdicts
    makes every validation answer the human winner AS LOADED, read off the pair's content, so it
    is right in order ab and wrong in order ba (the responses swap places, the letter does not):
    accuracy (2 + 0) / 4 = 0.5, acc_ab 1, acc_ba 0, no format error. The held-out pairs are
    never trained on: no sample of the run comes from them."""
    import evaluate
    pairs = load_pairs()
    force_verdicts(monkeypatch, pairs)
    held, real = [], evaluate.pairwise_accuracy
    monkeypatch.setattr(evaluate, "pairwise_accuracy", lambda items, judge: held.append([it["id"] for it in items])
                        or real(items, judge))
    out = str(tmp_path / "run")
    train.main(nlhf_args(out, tiny_model_path, ["run.eval_every=1", "nlhf.val=holdout"]))
    metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["val/n"] == 2 and m["val/pairwise_accuracy"] == 0.5
        assert m["val/acc_ab"] == 1.0 and m["val/acc_ba"] == 0.0 and m["val/format_error_rate"] == 0.0
        assert m["val/seconds"] > 0
    assert len(held) == 2 and held[0] == held[1] and len(held[0]) == 2  # the same 2 pairs each time
    trained = {s["item"] for s in read_jsonl(os.path.join(out, "samples.jsonl"))}
    assert trained and not trained & set(held[0])


# ---- bad input through the command line: one line, no traceback ---------------------------------

def test_startup_errors_are_one_line(tmp_path):
    (tmp_path / "nofields.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    (tmp_path / "norejected.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "RLME_UNSET_KEY_VAR"}
    base = [sys.executable, os.path.join(REPO, "train.py"), "--config", CPU_PRESET,
            f"nlhf.dh={data_path('mr_ben_math', 'math.jsonl')}", f"nlhf.do={data_path('hh_rlhf_harmless_base', 'test.jsonl')}"]
    cases = {
        "judge.api_key_env: environment variable RLME_UNSET_KEY_VAR is not set":
            ["judge.backend=openai", "judge.model=m", "judge.api_key_env=RLME_UNSET_KEY_VAR"],
        "config key nlhf.do_schema: 'helpsteer4' is not one of": ["nlhf.do_schema=helpsteer4"],
        "nofields.jsonl": [f"nlhf.do={tmp_path}/nofields.jsonl"],
        "'rejected'": [f"nlhf.do={tmp_path}/norejected.jsonl", "nlhf.do_schema=chosen_rejected"],
    }
    procs = {msg: subprocess.Popen(base + extra + [f"run.out_dir={tmp_path}/o{i}"], stdout=subprocess.PIPE,  # one folder
                                   stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)  # each: the run.lock
             for i, (msg, extra) in enumerate(cases.items())}
    for msg, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode != 0 and msg in err and "Traceback" not in err, (msg, err[-1500:])
        assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err


# ---- torchrun: the MetaRM update over 2 ranks ---------------------------------------------------

def _metarm_rank(rank, world, model_path, port, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same fresh head on both ranks (setup_metarm loads one saved folder)
    mrm = load_metarm(model_path, "online", 0.5, batch_size=4, max_length=64, online_lr=1e-2, rank=rank, world=world)
    items, samples = _rank_samples(rank)
    m = metarm.online_update(mrm, items, samples, seed=5)
    pred = predicted(mrm, [pair(9)], ["Response B is wrong."])[0]
    from plumbing.metarm_setup import save_metarm
    save_metarm(mrm, os.path.join(out_dir, "saved"), rank=rank, world=world)  # the AdamW state: every rank writes
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"pred": pred, "updates": mrm["updates"], "n": m["metarm/n"]}, f)
    dist.destroy_process_group()


def _rank_samples(rank):
    """Two D_H samples per rank, different on each rank (rewards 1.5/0 and 1/0)."""
    items = [pair(2 * rank), pair(2 * rank + 1)]
    samples = [{"valid": True, "reward": [1.5, 0.0, 1.0, 0.0][2 * rank + k], "critique": f"critique {rank} {k}"}
               for k in range(2)]
    return items, samples


@pytest.mark.slow
def test_metarm_update_over_two_ranks_equals_one_process(tiny_model_path, tmp_path):
    """metarm.online_update under 2 gloo ranks: every rank ends with the MetaRM that ONE process
    gets from all 4 D_H samples (gathered in rank order), so D_O is scored identically everywhere."""
    import socket
    import torch.multiprocessing as mp
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(_metarm_rank, args=(2, tiny_model_path, port, str(tmp_path)), nprocs=2, join=True)
    torch.manual_seed(0)
    ref = load_metarm(tiny_model_path, "online", 0.5, batch_size=4, max_length=64, online_lr=1e-2)
    (i0, s0), (i1, s1) = _rank_samples(0), _rank_samples(1)
    m = metarm.online_update(ref, i0 + i1, s0 + s1, seed=5)
    want = predicted(ref, [pair(9)], ["Response B is wrong."])[0]
    for rank in (0, 1):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        assert got["updates"] == 1 and got["pred"] == pytest.approx(want, abs=1e-5)
    assert json.load(open(tmp_path / "rank0.json"))["n"] == m["metarm/n"] == 4
    # the online AdamW state, saved by both ranks (torch.distributed.checkpoint), loads in one process
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(tmp_path / "saved" / "optimizer"))
    back = load_saved_metarm(str(tmp_path / "saved"))
    assert back["updates"] == 1
    for a, b in zip(ref["optimizer"].state.values(), back["optimizer"].state.values()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert (a[k] - b[k]).abs().max().item() < 1e-6
