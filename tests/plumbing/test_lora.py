"""LoRA through peft (model.lora; docs/method.md §4.7): config errors, the merge, the base model
with adapters off against a separately loaded frozen copy, a run on SmolLM2, exact resume."""
import json
import os

import pytest
import torch

import train as T
from conftest import REPO, SMOLLM2, data_path, frozen_logprobs, update_policy
import fast
from plumbing.config import load_config
from plumbing.models import load_model
from plumbing.pairwise import load_pairwise
from plumbing.scale import BaseModelView, apply_lora, check_checkpoint_kind, merged_state_items, wrap_policy
from plumbing.evaluators import load_evaluators

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "merged": False}
CPU = torch.device("cpu")


def lora_policy(model_path, lora=LORA, seed=0, perturb=True):
    """A LoRA policy on `model_path`; perturb=True gives B random values (peft starts B at 0, when
    the adapters change nothing and a test comparing with the base could not fail)."""
    policy, tok = load_model(model_path)
    policy = apply_lora(policy, lora, seed=seed)
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return policy, tok


# ---- config: one line per bad value ---------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("model.lora={r: 0, alpha: 8, target_modules: [q_proj]}", "config key model.lora.r: must be an integer > 0"),
    ("model.lora={r: 4, alpha: -1, target_modules: [q_proj]}", "config key model.lora.alpha: must be a number > 0"),
    ("model.lora={r: 4, alpha: 8, dropout: 1.0, target_modules: [q_proj]}", "config key model.lora.dropout: must be a number in [0, 1)"),
    ("model.lora={r: 4, alpha: 8, target_modules: []}", "config key model.lora.target_modules: must be a non-empty list"),
    ("model.lora={r: 4, alpha: 8, target_modules: q_proj}", "config key model.lora.target_modules: must be a non-empty list"),
    ("model.lora={r: 4, target_modules: [q_proj]}", "config key model.lora.alpha: missing"),
    ("model.lora={r: 4, alpha: 8, target_modules: [q_proj], rank: 3}", "config key model.lora.rank: unknown"),
    ("model.lora=3", "config key model.lora: expected a mapping or null"),
])
def test_lora_config_errors_are_one_line(override, message):
    from plumbing.config import load_config
    with pytest.raises(SystemExit) as e:
        load_config([os.path.join(REPO, "configs", "cpu.yaml")], [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_lora_config_layers_and_switches_off():
    from plumbing.config import load_config
    layers = [os.path.join(REPO, "configs", "cpu.yaml"), os.path.join(REPO, "configs", "cpu_lora.yaml")]
    cfg = load_config(layers, ["model.lora.r=8"])  # one field over the preset's mapping
    assert cfg["model"]["lora"]["r"] == 8 and cfg["model"]["lora"]["alpha"] == 32
    assert load_config(layers, ["model.lora=null"])["model"]["lora"] is None
    assert load_config([os.path.join(REPO, "configs", "cpu.yaml")])["model"]["lora"] is None  # off by default
    with pytest.raises(SystemExit, match="model.lora with train.parallel=fsdp2: not supported"):
        load_config(layers, ["train.parallel=fsdp2"])


def test_missing_or_non_linear_target_module_is_one_line(tiny_model_path):
    policy, _ = load_model(tiny_model_path)
    with pytest.raises(SystemExit) as e:
        apply_lora(policy, dict(LORA, target_modules=["q_proj", "qkv_proj"]), seed=0)
    msg = str(e.value)
    assert msg.startswith("config key model.lora.target_modules: no module named 'qkv_proj' in LlamaForCausalLM")
    assert "q_proj" in msg and "\n" not in msg
    # a tied lm_head is no Linear layer a user may name, so the lists in these messages leave it out
    assert "lm_head" not in msg
    with pytest.raises(SystemExit, match="'input_layernorm' is a LlamaRMSNorm, not a Linear layer"):
        apply_lora(policy, dict(LORA, target_modules=["input_layernorm"]), seed=0)
    with pytest.raises(SystemExit, match="'embed_tokens' is an Embedding, not a Linear layer"):
        apply_lora(policy, dict(LORA, target_modules=["embed_tokens"]), seed=0)
    with pytest.raises(SystemExit, match="lm_head is tied"):
        apply_lora(policy, dict(LORA, target_modules=["lm_head"]), seed=0)


# ---- the merge (vLLM push, merged/ folder) against peft's own ------------------------------------

def test_merged_state_items_equal_peft_merge_and_unload(tiny_model_path):
    """W' = W + (alpha/r) B A under the plain model's names, as peft's merge_and_unload gives."""
    policy, _ = lora_policy(tiny_model_path, dict(LORA, target_modules=["q_proj", "v_proj", "down_proj"]))
    ours = dict(merged_state_items(policy))
    # the formula by hand on one layer
    q = policy.base_model.model.model.layers[0].self_attn.q_proj
    want_q = q.base_layer.weight + (8 / 4) * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert torch.allclose(ours["model.layers.0.self_attn.q_proj.weight"], want_q, atol=1e-6)
    assert not torch.allclose(want_q, q.base_layer.weight, atol=1e-3)  # the adapter weighs
    merged = policy.merge_and_unload().state_dict()  # in place: done last
    assert set(ours) == set(merged)
    for k in merged:
        assert torch.allclose(ours[k], merged[k], atol=1e-6), k


# ---- the base model with adapters off == a separately loaded frozen copy -------------------------

def _cfg(fast_paths=True, evaluators=None):
    from plumbing.config import load_config
    cfg = load_config([os.path.join(REPO, "configs", "cpu.yaml")], [f"model.lora={json.dumps(LORA)}"])
    cfg["train"]["fast_paths"] = fast_paths
    cfg["reward"]["evaluators"] = evaluators or [{"name": "self", "kind": "live", "weight": 1.0},
                                                 {"name": "base", "kind": "frozen_self", "weight": 1.0}]
    return cfg


def test_frozen_self_under_lora_scores_what_a_frozen_copy_scores(tiny_model_path):
    """Under LoRA the frozen_self evaluator is the policy with its adapters off (BaseModelView, no
    second copy); its plain twin (train.fast_paths false) loads the frozen copy. Same scores,
    exactly; the live evaluator (adapters on) scores differently."""
    import reward as R
    policy, tok = lora_policy(tiny_model_path)
    fast_cfg, plain = _cfg(True), _cfg(False)
    fast_cfg["model"]["policy"] = plain["model"]["policy"] = tiny_model_path
    evs_view = load_evaluators(fast_cfg, policy, tok, CPU, T.fast_or_plain(True))
    evs_copy = load_evaluators(plain, policy, tok, CPU, T.fast_or_plain(False))
    assert isinstance(evs_view[1]["model"], BaseModelView) and evs_view[1]["model"].policy is policy
    assert not isinstance(evs_copy[1]["model"], BaseModelView)
    kw = dict(meta_questions=fast_cfg["reward"]["meta_questions"], problems=["What is 2+3?"] * 2 + ["What is 7*6?"] * 2,
              solutions=["5", "It is \\boxed{6}.", "42", "I think 41"])
    a = R.rlme_reward(evs_view, **kw)["logp"]  # [N, J, K]
    b = R.rlme_reward(evs_copy, **kw)["logp"]
    assert torch.equal(a[:, 1], b[:, 1])  # frozen_self: bit for bit
    # the live evaluator: fast.score_targets batches its forwards differently from the plain twin,
    # so the two agree to the tolerance tests/algorithm/test_fast.py pins (bit-equal on some CPUs only)
    assert torch.allclose(a[:, 0], b[:, 0], atol=1e-5)
    assert (a[:, 0] - a[:, 1]).abs().max() > 1e-3  # the live evaluator (adapters on) differs
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)  # the view froze nothing


def test_grpo_reference_under_lora_is_the_base(tiny_model_path):
    """pi_ref for GRPO's KL: frozen_logprobs through BaseModelView == through the frozen copy."""
    from test_train import _layout_batch, _layout_cfg
    policy, tok = lora_policy(tiny_model_path)
    base, _ = load_model(tiny_model_path)
    cfg, batch = _layout_cfg(2, "seq_sum"), _layout_batch()
    got = frozen_logprobs(BaseModelView(policy), batch, tok.pad_token_id, cfg, CPU)
    want = frozen_logprobs(base, batch, tok.pad_token_id, cfg, CPU)
    live = frozen_logprobs(policy, batch, tok.pad_token_id, cfg, CPU)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert max((x - y).abs().max().item() for x, y in zip(got, live)) > 1e-3


# ---- dropout: only the gradient pass sees it ------------------------------------------------------

@pytest.mark.parametrize("use_fast", [True, False])
def test_probabilities_under_lora_dropout_do_not_depend_on_the_rng(tiny_model_path, use_fast):
    """With model.lora.dropout > 0 and the policy in train mode (as it is between updates), the
    live evaluator's scores, the rollout and the behaviour log-probs are computed with dropout
    off (rollout.eval_mode): the same under any global RNG state and equal to eval mode's, and
    the policy is left in train mode. (A resumed run scored differently otherwise.)"""
    import reward as R
    import rollout
    from test_train import _layout_batch, _layout_cfg
    policy, tok = lora_policy(tiny_model_path, dict(LORA, dropout=0.5))
    evs = [R.local_evaluator(policy, tok, chat=False, name="self", weight=1.0,
                             score=fast.score_targets if use_fast else R.score_targets)]
    kw = dict(meta_questions=R.meta_question_dicts(["Is the answer correct?"]),
              problems=["What is 2+3?"] * 2, solutions=["5", "It is \\boxed{6}."])
    cfg, batch = _layout_cfg(2, "seq_sum"), _layout_batch()
    cfg["train"]["fast_paths"] = use_fast  # each pass and its plain twin

    def passes(seed):
        torch.manual_seed(seed)
        ro = (fast.generate if use_fast else rollout.generate)(policy, tok, [[1, 2, 3]], group_size=2, max_new_tokens=4, seed=0)
        return (R.rlme_reward(evs, **kw)["logp"], ro["completion_ids"],
                frozen_logprobs(policy, batch, tok.pad_token_id, cfg, CPU, use_fast))

    policy.eval()
    want = passes(0)
    policy.train()
    for seed in (1, 2):
        got = passes(seed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(torch.equal(x, y) for x, y in zip(got[2], want[2]))
        assert policy.training and all(m.training for m in policy.modules())  # mode restored
    # the gradient pass does see dropout: two train-mode forwards differ
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert not torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)


# ---- the update: only adapters move, with and without activation checkpointing -------------------

def _lora_update(model_path, checkpointing):
    from test_train import _layout_batch, _layout_cfg
    policy, tok = lora_policy(model_path)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    model = wrap_policy(policy, "ddp", 1, CPU, gradient_checkpointing=checkpointing)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)  # update = -grad
    update_policy(model, policy, opt, _layout_batch(), _layout_cfg(2, "seq_sum"), world=1, device=CPU,
                    pad_id=tok.pad_token_id)
    return {n: p.detach() - before[n] for n, p in policy.named_parameters()}


def test_lora_update_moves_only_adapters_and_checkpointing_changes_nothing(tiny_model_path):
    plain = _lora_update(tiny_model_path, "none")
    assert all(not d.any() for n, d in plain.items() if "lora_" not in n)  # the base, bit for bit
    assert all(d.abs().max() > 0 for n, d in plain.items() if "lora_" in n)  # A and B (B != 0 here)
    # Checkpointing replays the same products; except where fast.ONEDNN holds (an AMD CPU): without
    # checkpointing the fast paths' linears multiply on oneDNN, with it on torch's own matmul
    # (fast.onednn_linear_layers), so float32 summation order: 2e-5 of the largest entry, as
    # tests/algorithm/test_fast.py allows the fast and plain gradients.
    largest = max(d.abs().max().item() for d in plain.values())
    tol = 2e-5 * largest if fast.ONEDNN else 1e-6
    for mode in ("full", "selective"):
        got = _lora_update(tiny_model_path, mode)
        assert max((got[n] - plain[n]).abs().max().item() for n in plain) < tol, (mode, largest)


# ---- runs: SmolLM2 moves only the adapters; resume is exact --------------------------------------

def run_args(model, out, steps, extra=()):
    return ["--config", os.path.join(REPO, "configs", "cpu.yaml"), "--config", os.path.join(REPO, "configs", "cpu_lora.yaml"),
            f"model.policy={model}", f"run.out_dir={out}", f"run.total_steps={steps}", "run.save_every=1",
            f"data.train={data_path('gsm8k', 'train.jsonl')}", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=8", *extra]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_lora_run_on_smollm2_moves_only_adapter_weights(tmp_path, smollm2_path):
    """One step of configs/cpu_lora.yaml on the real SmolLM2 with merged: true: the adapter-only
    checkpoint, and its merged/ folder differs from SmolLM2 exactly in the adapted layers."""
    from test_configs import load_weights
    out = str(tmp_path / "smol")
    T.main(run_args(SMOLLM2, out, 1, ["model.lora.merged=true"]))
    ckpt = os.path.join(out, "checkpoints", "step_000001")
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "merged"} <= set(os.listdir(ckpt))
    assert not os.path.exists(os.path.join(ckpt, "model.safetensors"))  # no second copy of the base
    adapter = load_weights(ckpt)
    assert all("lora_" in k for k in adapter)
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 0  # B left 0: it trained
    base, merged = load_weights(smollm2_path), load_weights(os.path.join(ckpt, "merged"))
    assert set(merged) <= set(base)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    moved = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert moved and all(k.split(".")[-2] in targets for k in moved), sorted(moved)[:5]
    # the optimizer holds state for the adapters alone
    from torch.distributed.checkpoint import FileSystemReader
    keys = [k for k in FileSystemReader(os.path.join(ckpt, "optimizer")).read_metadata().state_dict_metadata
            if k.startswith("state.")]
    assert keys and all("lora_" in k for k in keys)


@pytest.mark.slow
def test_lora_resume_is_exact(tiny_model_path, tmp_path):
    """2 steps in one go == 1 step, stop (as if killed), the same command again: metrics,
    completions and the adapter weights at step 2, with a frozen_self evaluator and LoRA dropout.
    The merged/ folder loads as a plain model that computes what the adapted policy computes."""
    extra = ["reward.evaluators=[{name: self, kind: live}, {name: base, kind: frozen_self}]",
             "model.lora.merged=true"]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    T.main(run_args(tiny_model_path, full, 2, extra))
    T.main(run_args(tiny_model_path, cut, 2, extra + ["run.stop_after=1"]))
    assert [m["step"] for m in read_jsonl(os.path.join(cut, "metrics.jsonl"))] == [1]
    T.main(run_args(tiny_model_path, cut, 2, extra))
    a, b = read_jsonl(os.path.join(full, "metrics.jsonl")), read_jsonl(os.path.join(cut, "metrics.jsonl"))
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        for k in ("reward/mean", "loss", "grad_norm", "lr", "rlme/base/Is the answer correct?/p"):
            assert x[k] == y[k], (x["step"], k)
    assert [s["completion"] for s in read_jsonl(os.path.join(full, "samples.jsonl"))] == \
        [s["completion"] for s in read_jsonl(os.path.join(cut, "samples.jsonl"))]
    from safetensors.torch import load_file
    wa = load_file(os.path.join(full, "checkpoints", "step_000002", "adapter_model.safetensors"))
    wb = load_file(os.path.join(cut, "checkpoints", "step_000002", "adapter_model.safetensors"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    # merged/ is the adapted policy as a plain model
    ckpt = os.path.join(full, "checkpoints", "step_000002")
    import yaml
    with open(os.path.join(full, "config.yaml")) as f:
        lora = yaml.safe_load(f)["model"]["lora"]  # the run's own, as resume reads it
    policy, tok = load_model(tiny_model_path)
    policy = apply_lora(policy, lora, seed=0, ckpt=ckpt)
    merged, _ = load_model(os.path.join(ckpt, "merged"))
    ids = torch.tensor([tok.encode("What is 2+3? The answer is 5.")])
    with torch.no_grad():
        assert torch.allclose(policy.eval()(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


def test_checkpoint_and_model_lora_must_agree(tmp_path):
    ck = tmp_path / "step_000001"
    ck.mkdir()
    with pytest.raises(SystemExit, match="holds a full model, no LoRA adapter"):
        check_checkpoint_kind(str(ck), LORA)
    (ck / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit, match="holds a LoRA adapter: resume it with the run's model.lora"):
        check_checkpoint_kind(str(ck), None)


@pytest.mark.slow
def test_lora_rm_nlhf_grpo_reference_and_metarm_run(tiny_model_path, tmp_path, monkeypatch):
    """configs/cpu_rm_nlhf.yaml under LoRA, one step: GRPO's KL reference is the policy with its
    adapters off (no reference model is loaded), the MetaRM cold start samples from the LoRA policy."""
    from test_configs import swaps
    from test_e2e_nlhf import force_verdicts
    cfg = load_config([os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml")])
    pairs = (load_pairwise(data_path("mr_ben_math", "math.jsonl"), "auto", seed=0)
             + [dict(it, critique=None) for it in load_pairwise(data_path("hh_rlhf_harmless_base", "test.jsonl"),
                                                                       "auto", seed=0)])
    force_verdicts(monkeypatch, pairs)
    loads = []
    real_load = load_model
    from plumbing import evaluators, run
    for module in (run, evaluators):  # where setup and the evaluators load models
        monkeypatch.setattr(module, "load_model", lambda path, *a, **kw: loads.append(path) or real_load(path, *a, **kw))
    out = str(tmp_path / "nlhf")
    args = swaps(cfg, tiny_model_path, out) + ["run.total_steps=1", f"model.lora={json.dumps(LORA)}"]
    T.main(["--config", os.path.join(REPO, "configs", "cpu_rm_nlhf.yaml"), *args])
    (m,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert all(v == v for v in m.values() if isinstance(v, float)) and m["grad_norm"] > 0
    assert loads == [tiny_model_path]  # the policy only: no reference copy
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_000001", "adapter_model.safetensors"))


@pytest.mark.slow
def test_lora_under_torchrun_two_ranks_ddp(tiny_model_path, tmp_path):
    """DDP over a peft model (frozen base parameters, trainable adapters): 2 ranks, 1 step, then a
    resume to step 2 in the same layout."""
    from test_e2e import torchrun
    out = str(tmp_path / "ddp")
    torchrun(2, run_args(tiny_model_path, out, 1))
    torchrun(2, run_args(tiny_model_path, out, 2))
    m = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [x["step"] for x in m] == [1, 2] and all(x["grad_norm"] > 0 for x in m)
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_000002", "adapter_model.safetensors"))
