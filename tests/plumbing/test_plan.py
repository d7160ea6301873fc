"""The memory plan (plumbing/plan.py; issue 26 item 4; docs/scale-out.md "Memory plan"): its
parameter, gradient and AdamW bytes equal the real tensors (FSDP2 on 2 gloo ranks, and one
process), hand-computed activation / logits / KV numbers, `--plan` for every shipped GPU preset
offline, and a plan that does not fit stopping at start-up with one line naming the key."""
import glob
import json
import os

import pytest
import torch

from test_scale import _init, _spawn
import train as T
from plumbing import plan as PL
from plumbing.config import load_config
from plumbing.benchmarks import REPO
from plumbing.models import load_model

CPU = torch.device("cpu")
GiB = 2**30


def _real_bytes(policy, optimizer, local):
    """Bytes of this rank's weights, gradients and AdamW state tensors, as they are in memory."""
    b = lambda t: local(t).numel() * t.element_size()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"policy weights": sum(b(p) for p in policy.parameters()),
            "policy gradients": sum(b(p.grad) for p in policy.parameters()),
            "AdamW state": sum(b(v) for v in state)}


def _one_step(policy, model):
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, fused=True)
    ids = torch.arange(1, 9)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return opt


def _fsdp_plan_worker(rank, world, port, model_path, out):
    from plumbing.scale import wrap_policy
    _init(rank, world, port)
    policy, _ = load_model(model_path, "float32", CPU)
    model = wrap_policy(policy, "fsdp2", world, CPU)
    opt = _one_step(policy, model)
    real = _real_bytes(policy, opt, lambda t: t.to_local() if hasattr(t, "to_local") else t)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(real, f)


def _cfg(model_path, *extra):
    return load_config([os.path.join(REPO, "configs", "cpu.yaml")], [f"model.policy={model_path}", *extra])


def test_plan_bytes_equal_the_real_fsdp2_tensors_on_2_gloo_ranks(tiny_model_path, tmp_path):
    """Before: no plan. Rank 0 and rank 1 of the tiny model's FSDP2 shards (its 49,152 x 64 tied
    embedding splits 24,576 rows each): the plan's weight, gradient and AdamW bytes are the bytes
    of the DTensors' local shards after one fused AdamW step."""
    out = str(tmp_path / "real")
    _spawn(_fsdp_plan_worker, 2, tiny_model_path, out)
    cfg = _cfg(tiny_model_path, "train.parallel=fsdp2")
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            real = json.load(f)
        p = PL.memory_plan(cfg, world=2, gpu_bytes=80 * GiB, rank=rank)
        assert {k: p["items"][k] for k in real} == real
        assert real["AdamW state"] > 2 * real["policy weights"]  # two moments + a step per tensor


def test_plan_bytes_equal_the_real_tensors_in_one_process(tiny_model_path):
    """ddp, world 1: full float32 weights, gradients, AdamW moments + step."""
    policy, _ = load_model(tiny_model_path, "float32", CPU)
    real = _real_bytes(policy, _one_step(policy, policy), lambda t: t)
    p = PL.memory_plan(_cfg(tiny_model_path, "train.parallel=ddp"), world=1, gpu_bytes=80 * GiB)
    assert {k: p["items"][k] for k in real} == real
    n = sum(t.numel() for t in policy.parameters())
    assert p["params"] == n and real["policy weights"] == 4 * n


def test_activation_logits_and_kv_formulas_by_hand():
    """A tiny shape: h 64, 4 heads, 2 KV heads of 16, MLP 128, 2 layers, bf16 (2 bytes), the
    residual stream in bf16 (FSDP2). Per token and layer (plumbing/plan.py layer_saved_bytes):
    two RMSNorms 2 (4 h + 4 + 2 h) = 776, their outputs 2 x 2 h = 256, q and the attention output
    2 x 2 x 4 x 16 = 256, log-sum-exp 4 x 4 = 16, MLP 4 x 2 x 128 = 1024: 2328; per row k / v
    2 x 2 x 16 x 2 = 128 a position (2 KV heads; 4 heads under a mask: 256, + 2 bytes of mask a
    query-key pair). Root per token: norm 388 + its output 128 + cos / sin 2 x 2 x 16 + ids 8 = 588."""
    arch = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)
    one = lambda **kw: PL.layer_saved_bytes(**{k: v for k, v in arch.items() if k != "layers"}, qk_norm=False,
                                            dtype_bytes=2, residual_bytes=2, **kw)
    assert one(rows=1, q_len=10, kv_len=10, masked=False) == 10 * 2328 + 10 * 128 == 24560
    assert one(rows=2, q_len=5, kv_len=8, masked=True) == 10 * 2328 + 2 * (8 * 256 + 5 * 8 * 2) == 27536
    qk = PL.layer_saved_bytes(**{k: v for k, v in arch.items() if k != "layers"}, qk_norm=True, dtype_bytes=2,
                              residual_bytes=2, rows=1, q_len=10, kv_len=10, masked=False)
    assert qk - 24560 == 10 * ((4 + 2) * 6 * 16 + 4 * 6)  # Qwen3's q_norm and k_norm over 4 + 2 heads
    # autocast over float32 weights (DDP): float32 norms 2 (4 h + 4 + 4 h) and 5 bf16 casts of their outputs
    assert PL.layer_saved_bytes(**{k: v for k, v in arch.items() if k != "layers"}, qk_norm=False, dtype_bytes=2,
                                residual_bytes=4, rows=1, q_len=10, kv_len=10, masked=False) \
        == 10 * (2 * (8 * 64 + 4) + 5 * 2 * 64 + 256 + 16 + 1024 + 128)
    act = lambda ck, **kw: PL.activation_bytes(dtype_bytes=2, checkpointing=ck, **arch, **kw)
    assert act("none", tokens=10) == 2 * 24560 + 10 * 588 == 55000
    assert act("full", tokens=10) == 10 * 2 * 2 * 64 + 24560 + 5880 == 33000  # layer inputs + one replayed layer + root
    # kept: input 128 + q, k, v (4 + 2 x 2) x 16 x 2 = 256 + o 128 + gate, up 512 + down 128 = 1152 a layer and token
    assert act("selective", tokens=10) == 2 * 10 * 1152 + 24560 + 5880 == 53480
    assert act("none", tokens=10, rows=2, kv_len=8, masked=True, root=False) == 2 * 27536
    nog = PL.no_grad_pass_bytes(rows=2, q_len=5, kv_len=8, masked=True, dtype_bytes=2,
                                **{k: v for k, v in arch.items() if k != "layers"})
    # attention 10 (2 h + 2 (a + kv) d_h) 2 + k / v on 4 heads 2 x 8 x 2 x 4 x 16 x 2 + mask 2 x 5 x 8 x 2 = 10,656
    # > MLP 10 (2 h + 3 i) 2 = 10,240; + the boolean mask 80
    assert nog == 10656 + 80
    assert PL.head_backward_bytes(vocab=10, hidden=64, dtype_bytes=2, chunked=True, positions=6) == (4 + 2 + 4) * 640
    assert PL.head_backward_bytes(vocab=10, hidden=64, dtype_bytes=4, chunked=True, positions=6) == 4 * 640
    assert PL.head_backward_bytes(vocab=10, hidden=64, dtype_bytes=2, chunked=False, positions=6) == 2 * (6 * 10 + 640)
    assert PL.reserve_bytes(0, 1) == GiB // 2 and PL.reserve_bytes(10 * GiB, 8) == 2 * GiB + GiB
    lg = lambda **kw: PL.logits_bytes(rows=2, tokens=3, vocab=10, dtype_bytes=2, **kw)
    assert lg(plain=False) == 6 * 10 * (2 + 4) == 360
    assert lg(plain=True) == 6 * 10 * (2 + 4 + 8) == 840  # + float32 log-softmax and its gradient
    assert lg(plain=False, chunk_tokens=4) == 4 * 10 * 6 == 240
    assert lg(plain=False, chunk_tokens=100) == 360  # a chunk longer than the batch changes nothing
    assert PL.kv_bytes_per_token({"layers": 2, "kv_heads": 2, "head_dim": 16}, 2) == 2 * 2 * 2 * 16 * 2 == 256
    # FSDP2 dim-0 chunks: 5 rows over 2 ranks = 3 + 2; 1 row over 2 = 1 + 0
    assert [PL.shard_numel((5, 3), 2, r) for r in (0, 1)] == [9, 6]
    assert [PL.shard_numel((1, 4), 2, r) for r in (0, 1)] == [4, 0]
    # groups per micro-batch: 8 rows, G 2, micro-batch 3 -> [0,3) spans groups 0-1, [3,6) 1-2, [6,8) 3
    assert PL.distinct_prompts(8, 3, 2) == 2 and PL.distinct_prompts(8, 4, 8) == 1 and PL.distinct_prompts(6, 4, 3) == 2


def test_qwen3_4b_numbers():
    """The 4B preset's shapes (plumbing/model_configs/Qwen--Qwen3-4B-Base.json): 4,022,468,096
    parameters (tied); KV 36 x 2 x 8 x 128 x 2 = 147,456 bytes a token; full logits 4 x 1024 x
    151,936 x 6 bytes, chunked at 1024 tokens a quarter of it."""
    # rollout.backend=hf: the HF loop's KV cache below (config.yaml rolls out with vLLM since issue 33)
    p = PL.memory_plan(load_config([], ["train.logprob_chunk_tokens=0", "rollout.backend=hf"]), world=8, gpu_bytes=80 * GiB)
    assert p["params"] == 4_022_468_096
    assert p["items"]["logits"] == p["logits_full"] == 4 * 1024 * 151936 * 6
    default = PL.memory_plan(load_config([], []), world=8, gpu_bytes=80 * GiB)  # config.yaml: chunks of 1024
    assert default["items"]["logits"] == 1024 * 151936 * 6
    plain = PL.memory_plan(load_config([], ["train.fast_paths=false"]), world=8, gpu_bytes=80 * GiB)
    assert plain["items"]["logits"] == plain["logits_full"]  # the plain twin never chunks
    assert p["logits_chunked"] == 1024 * 151936 * 6
    assert p["items"]["rollout KV cache"] == 64 * (256 + 1024) * 147456
    chunked = PL.memory_plan(load_config([], []) | {"train": {**load_config([], [])["train"], "logprob_chunk_tokens": 512}},
                             world=8, gpu_bytes=80 * GiB)
    assert chunked["items"]["logits"] == 512 * 151936 * 6  # read when the key exists (chunked log-prob fast path)


def _presets():
    paper = os.path.join("configs", "paper", "rm_nlhf_qwen7b.yaml")
    out = [([], 8), (["configs/rm_nlhf.yaml"], 8), ([paper], 8), ([paper, "configs/paper/released_code.yaml"], 8)]
    out += [([paper, f], 8) for f in sorted(glob.glob("configs/paper/ablations/*.yaml", root_dir=REPO))]
    out += [([paper, f], 8) for f in sorted(glob.glob("configs/paper/table10/*.yaml", root_dir=REPO))]
    out += [([f], 8) for f in sorted(glob.glob("configs/paper/rlme/*.yaml", root_dir=REPO))]
    return out + [(["configs/gpu_check.yaml"], 1), (["configs/gpu_bare.yaml"], 1)]


@pytest.mark.parametrize("configs, world", _presets(), ids=lambda v: "+".join(v) or "config.yaml" if isinstance(v, list) else str(v))
def test_plan_runs_offline_for_every_shipped_gpu_preset(configs, world, tiny_model_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    extra = [f"model.policy={tiny_model_path}"] if "gpu_bare" in "".join(configs) else []  # gpu_check.sh writes its model
    args = [a for c in configs for a in ("--config", c)] + ["--plan", "--world-size", str(world), "--gpu-memory", "80"]
    T.main(args + extra)
    out = capsys.readouterr().out
    assert "memory plan per GPU" in out and "peaks: setup" in out and "policy weights" in out
    assert out.rstrip().endswith(": fits"), out[-600:]  # issue 34: every shipped GPU preset fits by the corrected plan


def test_a_cpu_presets_plan_says_what_its_gpu_table_means(tiny_model_path, capsys):
    """configs/cpu.yaml's --plan still prints the per-GPU table (the same config on one GPU), then a
    line that says so for a train.device: cpu run (before: only "GPU 80.0 GiB: fits")."""
    T.main(["--config", os.path.join(REPO, "configs", "cpu.yaml"), "--plan",  # its world: 1 process
            f"model.policy={tiny_model_path}"])
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("train.device is cpu: the table is what one GPU would hold"), last


def test_plan_flags_without_plan_and_a_world_that_does_not_divide_are_one_line_each():
    """--world-size / --gpu-memory size the plan only: without --plan they would be silently ignored
    (a run's world is torchrun's); a preset whose prompts do not divide the plan's default world of
    8 names the flag that sets it."""
    for flag in (["--world-size", "4"], ["--gpu-memory", "40"]):
        with pytest.raises(SystemExit, match="size the plan: they need --plan"):
            T.main(["--config", os.path.join(REPO, "configs", "cpu.yaml"), *flag])
    with pytest.raises(SystemExit) as e:  # config.yaml (the 8-GPU node's) with 4 prompts a step
        T.main(["--plan", "rollout.prompts_per_step=4"])
    assert "not divisible by the plan's world size 8 (--world-size N sets it" in str(e.value) and "\n" not in str(e.value)


def test_plan_with_a_model_that_cannot_be_read_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for policy, words in (("/nonexistent/model", "does not exist"), ("nobody/no-such-model", "plumbing/model_configs/")):
        with pytest.raises(SystemExit) as e:
            T.main(["--plan", f"model.policy={policy}"])
        assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, key", [
    (["train.micro_batch_size=32"], "model.gradient_checkpointing=full"),
    (["train.micro_batch_size=64", "model.gradient_checkpointing=full", "train.logprob_chunk_tokens=0"], "train.micro_batch_size"),  # the logits
    (["rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.95"],
     "rollout.vllm_gpu_memory_utilization"),
])
def test_a_preset_that_does_not_fit_stops_at_start_up_naming_the_key(overrides, key, monkeypatch, tmp_path):
    """config.yaml made not to fit an 80 GiB GPU at world 8 stops in plumbing.run.setup, before
    the run folder is locked or any model loads (load_model is never called), with one line."""
    import plumbing.run as run
    cfg = load_config([], overrides + [f"run.out_dir={tmp_path / 'run'}"])
    monkeypatch.setattr(run, "setup_distributed", lambda *a, **k: (0, 8, torch.device("cuda", 0)))
    monkeypatch.setattr(run, "check_scale_config", lambda cfg, device: None)  # vllm is not installed here
    monkeypatch.setattr(run, "check_memory_plan", lambda cfg, world, device: PL.check_memory_plan(
        cfg, world, device, gpu_bytes=80 * GiB))
    monkeypatch.setattr(run, "load_model", lambda *a, **k: pytest.fail("a model loaded before the memory check"))
    with pytest.raises(SystemExit) as e:
        run.setup(cfg, T.fast_or_plain(True))
    msg = str(e.value)
    assert msg.startswith("memory plan: the ") and key in msg and "\n" not in msg, msg
    assert not os.path.exists(tmp_path / "run")


def test_shipped_presets_that_fit_pass_the_start_up_check():
    """config.yaml and configs/rm_nlhf.yaml fit 80 GiB at world 8 (no SystemExit)."""
    for configs in ([], ["configs/rm_nlhf.yaml"]):
        cfg = load_config([os.path.join(REPO, c) for c in configs], [])
        PL.check_memory_plan(cfg, 8, torch.device("cuda", 0), gpu_bytes=80 * GiB)


def test_cpu_offload_and_lora_change_what_trains_on_the_gpu():
    """train.cpu_offload: FSDP2's shards, gradients and AdamW live in host memory (0 on the GPU);
    model.lora (ddp): the full float32 base stays, gradients and AdamW only for the adapters:
    q_proj and v_proj of 36 layers, r 16: 16 x ((2560 + 4096) + (2560 + 1024)) = 163,840 each."""
    base = PL.memory_plan(load_config([], []), world=8, gpu_bytes=80 * GiB)["items"]
    off = PL.memory_plan(load_config([], ["train.cpu_offload=true"]), world=8, gpu_bytes=80 * GiB)["items"]
    assert off["policy weights"] == off["policy gradients"] == off["AdamW state"] == 0
    assert off["gradient accumulation"] == base["gradient accumulation"] > 0
    lora = PL.memory_plan(load_config([], ["train.parallel=ddp", "model.lora={r: 16, alpha: 32, target_modules: [q_proj, v_proj]}"]),
                          world=8, gpu_bytes=80 * GiB)["items"]
    n = 36 * 163_840
    assert lora["policy weights"] == 4 * 4_022_468_096
    assert lora["policy gradients"] == 4 * n and lora["AdamW state"] == 8 * n + 4 * 2 * 72


def test_paper_presets_fit_8_x_80_gib_and_the_new_items_by_hand():
    """Issues 26 and 34. DeepSeek-R1-Distill-Qwen-7B (28 layers, h 3584, 28 heads, 4 KV heads of
    128, MLP 18,944; 7,615,616,512 parameters, bf16) at world 8, micro-batch 2, G 8, 6144-token prompts:
      - one layer saves 225,400 bytes a token unmasked (layer_saved_bytes: norms 57,352 with their
        outputs, q + output 14,336, log-sum-exp 112, MLP 151,552, k/v 2,048), the root 29,196;
      - prompt pass under full checkpointing (fast.prefill): 6143 tokens x (28 layer inputs x 3584
        x 2 + one replayed layer 225,400 + root 29,196), + the KV cache of the 2 rows and of the
        write-once prompt cache the replay reads: 3 x 6143 x 57,344;
      - the completions (full checkpointing): 2 x 8192 tokens x (28 x 7168 + 29,196) + one layer
        replayed under the padding mask against 14,335 positions: k/v on all 28 heads
        (14,336 bytes a position and row) + the 2-byte mask;
      - the chunked head's backward: (4 + 2 + 4) x 152,064 x 3584 bytes (5.08 GiB);
      - train.fsdp_reduce_every_micro_batch: no unsharded float32 gradient (was 4 x params);
      - the GRPO reference: its 1/8 FSDP2 shard in bf16 = 2 x the policy's shard elements;
      - vLLM at 0.5 x 80 GiB = 40 GiB, no HF KV cache, no unsharded weights; the cold start and
        the validation sample through it.
    The paper preset and both Table 10 blocks fit 80 GiB at world 8 in every stage."""
    paper = os.path.join(REPO, "configs", "paper", "rm_nlhf_qwen7b.yaml")
    p = PL.memory_plan(load_config([paper], []), world=8, gpu_bytes=80 * GiB)
    it = p["items"]
    assert it["prompt pass"] == 6143 * (28 * 7168 + 225_400 + 29_196) + 3 * 6143 * 57_344
    one = 2 * (8192 * (225_400 - 2048) + 14_335 * (14_336 + 2 * 8192))
    assert it["activations"] == 2 * 8192 * (28 * 7168 + 29_196) + one
    # > 2 layers' reduce-scatter buffers, (2 + 4) bytes x 233,057,792 parameters each (shape_facts layer_params)
    assert it["backward transient"] == 10 * 152_064 * 3584 > 2 * 6 * 233_057_792
    assert list(p["stages"]) == ["setup", "cold start", "cold-start fit", "rollout", "reward", "MetaRM update",
                                 "MetaRM predict", "update", "validation", "checkpoint"]
    assert "vLLM engine" in p["stages"]["cold start"]["items"] and "vLLM engine" in p["stages"]["validation"]["items"]
    assert "AdamW state" not in p["stages"]["cold start"]["items"]  # a cold start is a fresh run's: no AdamW state yet
    assert it["gradient accumulation"] == 0
    assert it["GRPO reference"] == 2 * it["policy weights"] // 4
    assert it["vLLM engine"] == 40 * GiB and "rollout KV cache" not in it and "unsharded weights" not in it
    old = PL.memory_plan(load_config([paper], ["train.fsdp_reduce_every_micro_batch=false"]), world=8, gpu_bytes=80 * GiB)
    assert old["items"]["gradient accumulation"] == 4 * 7_615_616_512
    none = PL.memory_plan(load_config([paper], ["model.gradient_checkpointing=none"]), world=8, gpu_bytes=80 * GiB)
    # not checkpointed: every layer's saved set, and only the 2 rows' repeated KV cache
    assert none["items"]["prompt pass"] == 6143 * (28 * 225_400 + 29_196) + 2 * 6143 * 57_344
    for extra in ([], ["configs/paper/table10/qwen7b.yaml"], ["configs/paper/table10/llama8b.yaml"]):
        q = PL.memory_plan(load_config([paper] + [os.path.join(REPO, e) for e in extra], []), world=8, gpu_bytes=80 * GiB)
        assert q["fits"], (extra, q["peak_stage"], q["peak_bytes"] / GiB)
        assert all(v["bytes"] <= 80 * GiB for v in q["stages"].values())
    llama = PL.memory_plan(load_config([paper, os.path.join(REPO, "configs/paper/table10/llama8b.yaml")], []), world=8, gpu_bytes=80 * GiB)
    assert llama["params"] == 8_030_261_248  # Llama-3.1-8B's shape (plumbing/model_configs/)
