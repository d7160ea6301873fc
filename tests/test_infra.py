"""train.py's run machinery (_infra.py): the config (every preset loads; bad input is one line),
checkpoints (a round trip is exact; a damaged newest one falls back), the run lock, LoRA, FSDP2."""
import glob
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import REPO
import _infra as I
from _infra import load_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp alone
PRESETS = sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/configs/**/*.yaml",
                                                              recursive=True))


def layers(preset):
    """The --config files of the first train.py command in the preset's header (how the README
    runs it: Table 3/10 rows on top of configs/paper/rm_nlhf_qwen7b.yaml, ...), else itself."""
    line = next((ln for ln in open(os.path.join(REPO, preset)) if "train.py" in ln
                 and "--config" in ln), "")
    return [os.path.join(REPO, p) for p in re.findall(r"--config (\S+)", line)] or [
        os.path.join(REPO, preset)]


def one_line_error(paths=(), overrides=()):
    with pytest.raises(SystemExit) as e:
        load_config(list(paths), list(overrides))
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


# ---------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_as_its_header_layers_it(preset):
    ls = layers(preset)
    assert os.path.join(REPO, preset) in ls
    cfg = load_config(ls)
    raw = yaml.safe_load(open(os.path.join(REPO, preset))) or {}
    for sec, vals in raw.items():  # the preset's own numbers arrive (it is the last layer)
        for k, v in (vals.items() if isinstance(vals, dict) else [(None, vals)]):
            got = cfg[sec] if k is None else cfg[sec][k]
            if k not in ("lora", "evaluators", "meta_questions"):  # these get defaults filled in
                assert got == v, (preset, sec, k)


def test_paper_rows_layer_on_the_paper_preset():
    assert layers("configs/paper/ablations/binary.yaml")[:2] == [
        f"{REPO}/configs/paper/rm_nlhf_qwen7b.yaml", f"{REPO}/configs/paper/table10/qwen7b.yaml"]
    cfg = load_config(layers("configs/paper/ablations/binary.yaml"))
    assert (cfg["metarm"]["mode"], cfg["nlhf"]["split_dh_fraction"], cfg["run"]["total_steps"],
            cfg["rollout"]["max_new_tokens"], cfg["algo"]["kl_coef"]) == ("binary", 0.5, 150, 8192,
                                                                         0.001)
    assert load_config(layers("configs/paper/released_code.yaml"))["nlhf"]["threshold_rule"] == \
        "inclusive"


def test_config_yaml_has_at_most_100_keys_each_on_one_short_commented_line():
    text = open(os.path.join(REPO, "config.yaml")).read()
    assert max(len(ln) for ln in text.splitlines()) <= 100
    assert len(list(I._keys(yaml.safe_load(text)))) <= 100
    for ln in text.splitlines():  # every key line carries its comment (sections and lists aside)
        if re.match(r"\s*\w+: \S", ln) and not ln.rstrip().endswith(":"):
            assert "#" in ln or ln.lstrip().startswith(("prompt_template", "- ")), ln


def test_layering_and_overrides(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("rollout:\n  group_size: 4\n  max_new_tokens: 64\n")
    b.write_text("rollout:\n  group_size: 2\n")
    cfg = load_config([str(a), str(b)], ["optim.lr=3e-6", "run.out_dir=/tmp/x", "algo.eps_high=5"])
    assert cfg["rollout"]["group_size"] == 2 and cfg["rollout"]["max_new_tokens"] == 64
    assert cfg["optim"]["lr"] == 3e-6 and cfg["run"]["out_dir"] == "/tmp/x"
    assert cfg["algo"]["eps_high"] == 5.0 and isinstance(cfg["algo"]["eps_high"], float)
    assert cfg["algo"]["eps_low"] == 1.0  # untouched default
    lora = "model.lora={r: 8, alpha: 16, target_modules: all-linear}"  # null default: any value
    assert load_config([], [lora, "train.parallel=ddp"])["model"]["lora"]["dropout"] == 0.0
    assert load_config([], ["judge.temperature=null"])["judge"]["temperature"] is None
    mq = load_config([], ["reward.meta_questions=[{question: q}]"])["reward"]["meta_questions"]
    assert mq == [{"question": "q", "weight": 1.0, "target": "Yes", "negative": "No"}]
    ev = load_config([], ["reward.evaluators=[{kind: frozen_self}]"])["reward"]["evaluators"][0]
    assert ev == {"kind": "frozen_self", "name": "frozen_self0", "weight": 1.0, "path": None,
                  "chat_template": "auto", "chat_template_kwargs": None, "system_prompt": None}


@pytest.mark.parametrize("overrides, message", [
    (["run.total_step=3"], "override 'run.total_step=3': unknown config key run.total_step "
                           "(did you mean run.total_steps?)"),
    (["rollout.group_sise=4"], "(did you mean rollout.group_size?)"),
    (["train.fast_paths=false"], "unknown config key train.fast_paths"),
    (["nlhf.val=holdout"], "unknown config key nlhf.val (did you mean data.val?)"),
    (["metarm.temperature=0.7"], "(did you mean rollout.temperature?)"),
    (["rollout.group_size=four"], "config key rollout.group_size: expected int, got 'four'"),
    (["run.total_steps=null"], "config key run.total_steps: expected int, got None"),
    (["run.tensorboard=1"], "config key run.tensorboard: expected bool, got 1"),
    (["optim.lr=fast"], "config key optim.lr: expected float, got 'fast'"),
    (["rollout=5"], "config key rollout: must be a mapping"),
    (["algo.loss=ppo"], "config key algo.loss: expected one of ['cispo', 'grpo'], got 'ppo'"),
    (["model.gradient_checkpointing=true"], "expected one of ['none', 'full']"),
    (["judge.variant=coarse"], "expected one of ['core', 'all', 'meta_judge'], got 'coarse'"),
    (["optim.lr"], "override 'optim.lr': expected key.sub=value"),
    (["configs/cpu.yaml"], "expected key.sub=value (files go after --config)"),
    (["reward.meta_questions=[{question: Is it right?, weight: 1}]"], "not valid YAML"),
    (["optim.lr=nan"], "config key optim.lr: nan is not a finite number"),
    (["reward.evaluators=[{name: self, kind: live, weight: .inf}]"],
     "config key reward.evaluators[0].weight: inf is not a finite number"),
    (["reward.evaluators=[{name: self, kind: live, wieght: 1.0}]"],
     "config key reward.evaluators[0].wieght: unknown (did you mean weight?)"),
    (["reward.meta_questions=[{question: q, taget: Yes}]"], "taget: unknown (did you mean target"),
    (["reward.meta_questions=[{weight: 1}]"], "reward.meta_questions[0]: needs a question"),
    (["reward.meta_questions=[{question: q, target: ''}]"], "needs a question, a target"),
    (["reward.meta_questions=[]"], "reward.meta_questions: expected a non-empty list"),
    (["reward.meta_questions=[{question: a, weight: 0}]"], "every weight is 0"),
    (["reward.evaluators=[{kind: frozen}]"], "reward.evaluators[0].path: frozen needs a model"),
    (["reward.evaluators=[{kind: judge}]"], "reward.evaluators[0].kind: not one of live"),
    (["reward.evaluators=[{kind: remote, model: m}]"], "kind: remote needs base_url and model"),
    (["reward.evaluators=[{name: a}, {name: a, kind: frozen_self}]"], "names must be unique"),
    (["train.parallel=ddp", "model.lora={r: 8, alpah: 16, target_modules: all-linear}"],
     "config key model.lora.alpah: unknown"),
    (["train.parallel=ddp", "model.lora={r: 0, alpha: 16, target_modules: [q_proj]}"],
     "config key model.lora: needs r > 0"),
    (["train.parallel=ddp", "model.lora={r: 8, alpha: 16}"], "config key model.lora: needs r > 0"),
    (["model.lora={r: 8, alpha: 16, target_modules: [q_proj]}"], "lora: needs train.parallel"),
    (["algo.kl_coef=0.01"], "config key algo.kl_coef: needs algo.loss grpo"),
    (["rollout.group_size=1"], "config key rollout.group_size: must be >= 2"),
    (["rollout.prompts_per_step=0"], "config key rollout.prompts_per_step: must be >= 1"),
    (["algo.minibatches=3"], "config key algo.minibatches: must divide the 64 groups of a rank"),
    (["rollout.top_p=1.5"], "config key rollout.temperature / top_p: > 0"),
    (["rollout.temperature=0"], "rollout.temperature / top_p"),
    (["optim.lr=-1"], "config key optim: lr must be > 0"),
    (["nlhf.lam=1.5"], "config key nlhf.dh_per_step / lam / threshold: must be in [0, 1]"),
    (["nlhf.split_dh_fraction=0.5"], "only with nlhf.do: null"),
    (["metarm.mode=binary", "nlhf.gate_on_outcome=false"], "need gate_on_outcome"),
    (["model.dtype=float16"], "model.dtype float16: ddp only"),
    (["run.early_stop_drop=0.1"], "set both or neither"),
    (["run.eval_every=5"], "run.eval_every / data.val: both or none"),
    (["data.val=holdout"], "run.eval_every / data.val: both or none"),
    (["data.answer_field=null", "reward.kind=rlvr"], "reward.kind: needs labels"),
    (["data.prompt_template='{problem}'"], "config key data.prompt_template: needs {question}"),
])
def test_bad_input_is_one_line_naming_the_key(overrides, message):
    assert message in one_line_error(overrides=overrides)


def test_bad_files_are_one_line(tmp_path):
    bad, typo, listed = tmp_path / "bad.yaml", tmp_path / "typo.yaml", tmp_path / "list.yaml"
    bad.write_text("run:\n  seed: 1\n rollout: [\n")
    typo.write_text("run:\n  total_steps: 3\n  totl_steps: 4\n")
    listed.write_text("- a\n- b\n")
    assert one_line_error([bad]).startswith(f"config file {bad}: invalid YAML at line 3")
    assert one_line_error([typo]) == (f"config file {typo}: unknown config key run.totl_steps "
                                      "(did you mean run.total_steps?)")
    assert one_line_error([listed]).startswith(f"config file {listed}: the file must be a mapping")
    assert "No such file" in one_line_error([tmp_path / "none.yaml"])


def test_prompts_per_step_must_split_over_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_config([], ["rollout.prompts_per_step=8"])["rollout"]["prompts_per_step"] == 8
    assert "rollout.prompts_per_step: not divisible by 4" in one_line_error(
        overrides=["rollout.prompts_per_step=6"])


# ---------------------------------------------------------------------------------------------
# checkpoints


class Tok:  # the tokenizer's part in a checkpoint, without loading one
    def save_pretrained(self, path):
        open(os.path.join(path, "tokenizer.json"), "w").write("{}")


def tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, tie_word_embeddings=True))


def train_steps(model, steps=2, warmup=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, I.lr_lambda(warmup))
    for s in range(steps):
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(s))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def opt_tensors(opt):
    return [t for s in opt.state_dict()["state"].values() for t in s.values()]


def test_lr_lambda_warms_up_linearly_then_stays():
    f = I.lr_lambda(3)
    assert [f(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert I.lr_lambda(0)(0) == 1.0


def test_checkpoint_round_trip_is_exact(tmp_path):
    from transformers import LlamaForCausalLM
    model = tiny()
    opt, sched = train_steps(model)
    I.save_checkpoint(str(tmp_path), 2, model, Tok(), opt, sched, keep=2)
    ckpt = I.latest_checkpoint(str(tmp_path))
    assert ckpt == str(tmp_path / "checkpoints" / "step_000002") and I.checkpoint_step(ckpt) == 2
    assert not glob.glob(f"{tmp_path}/checkpoints/*.tmp")
    back = LlamaForCausalLM.from_pretrained(ckpt)  # the weights: a plain HF folder, float32
    for (n, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b) and b.dtype == torch.float32, n
    opt2 = torch.optim.AdamW(back.parameters(), lr=1e-2, weight_decay=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, I.lr_lambda(3))
    assert I.load_checkpoint(ckpt, back, opt2, sched2) == 2
    assert all(torch.equal(a, b) for a, b in zip(opt_tensors(opt), opt_tensors(opt2)))
    assert sched2.state_dict()["last_epoch"] == 2 and opt2.param_groups[0]["lr"] == 0.75e-2
    train_steps(model, 1), train_steps(back, 1)  # and the next step is the same step


def test_resume_continues_exactly(tmp_path):
    """Two steps, save, resume, one step == three steps straight (weights and AdamW)."""
    from transformers import LlamaForCausalLM

    def step(model, opt, sched, s):
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(s))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step(), sched.step(), opt.zero_grad()

    def make(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, I.lr_lambda(2))
    straight, resumed = tiny(), tiny()
    opt, sched = make(straight)
    for s in range(3):
        step(straight, opt, sched, s)
    opt, sched = make(resumed)
    for s in range(2):
        step(resumed, opt, sched, s)
    I.save_checkpoint(str(tmp_path), 2, resumed, Tok(), opt, sched, keep=1)
    back = LlamaForCausalLM.from_pretrained(I.latest_checkpoint(str(tmp_path)))
    opt, sched = make(back)
    step(back, opt, sched, I.load_checkpoint(I.latest_checkpoint(str(tmp_path)), back, opt, sched))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), back.parameters()))


def test_keep_newest_and_a_truncated_newest_falls_back_in_one_line(tmp_path, capsys):
    from safetensors.torch import save_file
    model = tiny()
    opt, sched = train_steps(model, 1)

    def metarm(folder):  # what `extra` adds (the MetaRM): its weights are checked too
        os.makedirs(f"{folder}/metarm")
        save_file({"w": torch.ones(64)}, f"{folder}/metarm/model.safetensors")
    for step in (1, 2, 3):
        I.save_checkpoint(str(tmp_path), step, model, Tok(), opt, sched, keep=2, extra=metarm)
    os.makedirs(tmp_path / "checkpoints" / "step_000009.tmp")  # a crash mid-write: ignored
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_000002", "step_000003", "step_000009.tmp"]
    for name in ("model.safetensors", "metarm/model.safetensors"):
        weights = tmp_path / "checkpoints" / "step_000003" / name
        data = weights.read_bytes()
        for cut in (len(data) // 2, 20):  # cut inside the tensors, then inside the header
            weights.write_bytes(data[:cut])
            assert I.latest_checkpoint(str(tmp_path)).endswith("step_000002")
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
            assert len(err) == 1 and "skipping checkpoint" in err[0] and "step_000003" in err[0]
        weights.write_bytes(data)
        assert I.latest_checkpoint(str(tmp_path)).endswith("step_000003")
    os.remove(tmp_path / "checkpoints" / "step_000003" / "trainer_state.pt")
    os.remove(tmp_path / "checkpoints" / "step_000002" / "optimizer" / ".metadata")
    assert I.latest_checkpoint(str(tmp_path)) is None
    assert I.latest_checkpoint(str(tmp_path / "nothing")) is None


def test_truncate_jsonl_drops_the_steps_a_resume_redoes(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3)))
    I.truncate_jsonl(str(p), 2)
    assert [json.loads(ln)["step"] for ln in p.read_text().splitlines()] == [0, 1, 2]
    I.truncate_jsonl(str(tmp_path / "absent.jsonl"), 2)


# ---------------------------------------------------------------------------------------------
# the run lock

HOLD = ("import sys, time; sys.path.insert(0, {repo!r}); import _infra; "
        "h = _infra.lock_run({out!r}); print('held', flush=True); time.sleep(600)")


def test_a_second_live_run_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=REPO, out=out)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as e:
            I.lock_run(out)
        assert f"another run (pid {p.pid}) is using this folder" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    h = I.lock_run(out)  # the dead holder's lock (its pid still in the file) is taken over
    assert open(os.path.join(out, "run.lock")).read() == str(os.getpid())
    assert I.lock_run(out, rank=1) is None  # only rank 0 locks
    h.close()


# ---------------------------------------------------------------------------------------------
# processes, wrapping, LoRA


def test_one_process_needs_no_group_and_reductions_are_identities():
    rank, world, device = I.setup_process_group("cpu", "ddp")
    assert (rank, world, device.type) == (0, 1, "cpu") and not torch.distributed.is_initialized()
    assert I.all_sum(3, 1) == 3.0 and I.all_max(2, 1) == 2.0 and I.gather_records([{}], 1) == [{}]
    model = tiny()
    assert I.wrap_policy(model, "ddp", 1, device) is model
    with I.grad_sync(model, 1, sync=False), I.unsharded(model):
        pass
    assert I.peak_memory_mb(device) > 0


def test_fsdp2_checkpoint_reads_back_into_a_plain_model(tmp_path):
    """FSDP2 (one CPU process, gloo): the model loads into its shards from rank 0; the saved
    weights are the full float32 model, and its sharded AdamW state loads into a plain model."""
    from transformers import LlamaForCausalLM
    plain = tiny()
    try:
        rank, world, device = I.setup_process_group("cpu", "fsdp2")
        wrap = lambda m: I.wrap_policy(m, "fsdp2", world, device, gradient_checkpointing="full")
        sharded, tok = I.load_sharded_model(lambda: (tiny(), Tok()), wrap, device, rank, world)
        assert isinstance(tok, Tok) and type(sharded).__name__.startswith("FSDP")
        with I.unsharded(sharded):
            full = {n: p.detach().clone() for n, p in sharded.named_parameters()}  # gathered
        assert all(torch.equal(full[n], p) for n, p in plain.named_parameters())
        opt, sched = train_steps(sharded, 1)
        popt, psched = train_steps(plain, 1)
        I.save_checkpoint(str(tmp_path), 1, sharded, Tok(), opt, sched, keep=1)
        ckpt = I.latest_checkpoint(str(tmp_path))
    finally:
        torch.distributed.destroy_process_group()
    back = LlamaForCausalLM.from_pretrained(ckpt)
    for a, b in zip(plain.parameters(), back.parameters()):
        torch.testing.assert_close(a, b)  # FSDP2 trained the same step
    opt2, sched2 = train_steps(back, 0)
    I.load_checkpoint(ckpt, back, opt2, sched2)
    for a, b in zip(opt_tensors(popt), opt_tensors(opt2)):
        torch.testing.assert_close(a, b)


def test_lora_adapters_round_trip_and_the_base_view_is_the_initial_policy(tmp_path):
    base = tiny()
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = base(input_ids=ids).logits
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    model = I.apply_lora(base, lora, seed=0)
    torch.testing.assert_close(model(input_ids=ids).logits, ref)  # B = 0: the base at step 0
    opt, sched = train_steps(model, 2)
    assert not torch.allclose(model(input_ids=ids).logits, ref)
    torch.testing.assert_close(I.BaseModelView(model)(input_ids=ids).logits, ref)
    I.save_checkpoint(str(tmp_path), 2, model, Tok(), opt, sched, keep=1)
    ckpt = I.latest_checkpoint(str(tmp_path))
    assert os.path.isfile(os.path.join(ckpt, "adapter_model.safetensors"))
    back = I.apply_lora(tiny(), lora, seed=0, ckpt=ckpt)
    torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(SystemExit, match="no Linear layer 'qq_proj'"):
        I.apply_lora(tiny(), {**lora, "target_modules": ["qq_proj"]}, seed=0)
