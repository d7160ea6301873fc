"""tools/: the memory plan's numbers by hand, the reading-path count on a made-up train.py and on
the repository, the benchmark's and the GPU check's argument checks (no TRL run, no GPU), the
short-answer tasks (make_tasks)."""
import json
import os
import sys

import pytest

from conftest import REPO, data_path

sys.path.insert(0, os.path.join(REPO, "tools"))
import bench_vs_trl  # noqa: E402
import gpu_check  # noqa: E402
import make_tasks  # noqa: E402
import memory_plan  # noqa: E402
import reading_path  # noqa: E402

# V 100, h 8, L 2, a 2, kv 1, d_h 4, i 16, tied: embeddings 800; a layer q 64 + k 32 + v 32 + o 64
# + MLP 3 x 8 x 16 = 384 + 2 norms 16 = 592; P = 800 + 2 x 592 + 8 (final norm) = 1,992
TINY = {"model_type": "llama", "vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
        "tie_word_embeddings": True}


def tiny_plan(tmp_path, *overrides, world=1):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = memory_plan.read_config([], [f"model.policy={tmp_path}", "model.dtype=float32",
                                       "train.parallel=ddp", "rollout.backend=hf", *overrides])
    return memory_plan.memory_plan(cfg, world=world, gpu_bytes=2**30)


def test_memory_plan_by_hand(tmp_path, capsys):
    p = tiny_plan(tmp_path, "rollout.prompts_per_step=2", "rollout.group_size=2",
                  "rollout.max_new_tokens=6", "rollout.max_prompt_tokens=10", "rollout.micro_batch_size=0")
    assert p["params"] == 1992
    assert p["items"]["policy weights"][0] == 4 * 1992 == 7968
    assert p["items"]["AdamW state"][0] == 8 * 1992
    # KV cache: 4 rows x (10 + 6) tokens x 2 layers x 2 (K, V) x 1 kv head x 4 d_h x 4 bytes
    assert p["items"]["KV cache"][0] == 4 * 16 * 2 * 2 * 1 * 4 * 4 == 4096
    # logits chunk: min(4 rows x 6 new, 1024) = 24 positions x 100 vocab x (4 + 8) bytes
    assert p["items"]["logits chunk"][0] == 24 * 100 * 12
    # update = weights + AdamW + gradients + activations + logits + head gradient, + the reserve
    update = sum(p["items"][n][0] for n in p["stages"]["update"][1])
    assert p["stages"]["update"][0] == int(update + 2**29 + 0.1 * update)
    assert p["fits"]
    print(memory_plan.plan_table(p))
    assert "peak" in capsys.readouterr().out


def test_memory_plan_vllm_nvls_host_and_setup_by_hand(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    vllm = ["rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.25",
            "rollout.max_prompt_tokens=10", "rollout.max_new_tokens=6"]
    p = tiny_plan(tmp_path, *vllm, "run.eval_every=5", world=2)
    items = {n: b for n, (b, _) in p["items"].items()}
    assert items["vLLM share"] == 0.25 * 2**30 == 268435456  # tiny_plan's GPU: 1 GiB
    assert items["vLLM asleep"] == memory_plan.VLLM_ASLEEP == 2**30  # the estimate, a constant
    # NVLS: 2 communicators x 16 channels x 2 (reduce, broadcast) x 128 KiB x 8 steps x 2 heads
    assert items["NCCL NVLS"] == 2 * 16 * 2 * 131072 * 8 * 2 == 128 * 2**20
    # sleep level 1's pinned copy: 2 engines on the node x 1,992 parameters x 4 bytes (float32)
    assert p["host"]["vLLM sleep backup"][0] == 2 * 1992 * 4 == 15936
    # setup: the engine awake (share + residue) + NVLS + the float32 weights, no AdamW state yet;
    # reserve 0.5 + 1.5 GiB (world 2) + 10 % of the torch bytes (the weights: 7,968)
    setup, names = p["stages"]["setup"]
    assert "AdamW state" not in names
    assert setup == int(268435456 + 2**30 + 128 * 2**20 + 7968 + 2**29 + 3 * 2**29 + 796.8)
    # validation (RLME, eval_every > 0): the engine awake + weights, AdamW and the evaluators'
    # scoring KV cache (8 prompts x (10 + 6 + 128) tokens x L 2 x (K, V) x kv 1 x d_h 4 x B 4)
    assert items["scoring KV cache"] == 8 * 144 * 2 * 2 * 1 * 4 * 4 == 73728
    torch_bytes = 7968 + 8 * 1992 + 73728
    assert p["stages"]["validation"][0] == int(268435456 + 2**30 + 128 * 2**20 + torch_bytes
                                               + 2**31 + 0.1 * torch_bytes)
    assert "validation" not in tiny_plan(tmp_path, *vllm, world=2)["stages"]  # eval_every 0
    # two nodes: 8 heads and 8 engines a node; NCCL_NVLS_ENABLE=0: no NVLS buffers
    p = tiny_plan(tmp_path, *vllm, world=16)
    assert p["items"]["NCCL NVLS"][0] == 2 * 16 * 2 * 2**20 * 8 == 512 * 2**20
    assert p["host"]["vLLM sleep backup"][0] == 8 * 1992 * 4
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert "NCCL NVLS" not in tiny_plan(tmp_path, *vllm, world=2)["items"]
    # RM-NLHF: the MetaRM cold start runs at setup with the engine awake
    p = tiny_plan(tmp_path, *vllm, "task=rm_nlhf", "metarm.max_length=16", world=1)
    assert "MetaRM activations" in p["stages"]["setup"][1]
    assert "NCCL NVLS" not in p["items"] and p["host"]["vLLM sleep backup"][0] == 1992 * 4
    # the advice it corrects: expandable segments with vLLM's sleep mode
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    memory_plan.main(["--config", os.path.join(REPO, "config.yaml")])
    out = capsys.readouterr().out
    assert "vLLM sleep backup" in out and "warning: PYTORCH_CUDA_ALLOC_CONF" in out


def test_memory_plan_lora_fsdp_and_real_count(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM
    # LoRA r 2 on q_proj, v_proj: 2 layers x 2 x ((8 + 8) + (8 + 4)) = 112 trained elements
    p = tiny_plan(tmp_path, "model.lora={r: 2, target_modules: [q_proj, v_proj]}")
    assert p["items"]["gradients"][0] == 4 * 112
    p = tiny_plan(tmp_path, "train.parallel=fsdp2", world=4)
    assert p["items"]["policy weights"][0] == 4 * 1992 // 4
    cfg = memory_plan.read_config([], [f"model.policy={tiny_model_path}"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert memory_plan.memory_plan(cfg, world=1)["params"] == model.num_parameters()


def test_memory_plan_presets_and_errors(capsys):
    assert memory_plan.main(["--config", os.path.join(REPO, "config.yaml")]) == 0
    assert "Qwen/Qwen3-4B-Base, 4.022 B parameters" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="expected key.sub=value"):
        memory_plan.read_config([], ["model.policy"])
    with pytest.raises(SystemExit, match="no readable config.json|not in SHAPES"):
        memory_plan.model_shape("/nonexistent/model")


FAKE_TRAIN = '''import sys


def group_advantages(x):
    return x


def helper(x):
    """Docstring."""
    # a comment
    return x + 1


def main():
    total = 0  # set-up: not in the step
    total += 1
    for step in range(3):
        total = helper(total)

        group_advantages(total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def test_reading_path_window_by_hand(tmp_path):
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    f = reading_path.trace_step([], root=str(tmp_path))
    # group_advantages 2 lines (2 code), helper 4 (2: no docstring, no comment), the loop body
    # lines 17-20 of main (3 code: the blank line is not)
    assert f["counted"] == [("train.py:group_advantages", 2, 2, "whole"),
                            ("train.py:helper", 4, 2, "whole"),
                            ("train.py:main [17-20]", 4, 3, "span")]
    assert (f["lines"], f["code"]) == (10, 7)
    with pytest.raises(SystemExit, match="no such function"):
        reading_path.trace_step([], marker="train.py:nothing", root=str(tmp_path))
    s = reading_path.static_figures(str(tmp_path))
    assert s["files"]["train.py"] == (25, 14) and s["longest"] == ("train.py:main", 8)


def test_reading_path_on_the_repository(capsys):
    assert reading_path.main(["--static"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("product: ") and "train.py" in out and "longest function" in out


def test_reading_path_rlme_step_tiny(tmp_path, tiny_model_path):
    data_path("gsm8k", "train.jsonl")
    f = reading_path.trace_step(["--config", "configs/cpu.yaml", f"model.policy={tiny_model_path}",
                                 f"run.out_dir={tmp_path}", "run.total_steps=2",
                                 "rollout.prompts_per_step=2", "rollout.group_size=2",
                                 "rollout.max_new_tokens=4"])
    names = [c[0] for c in f["counted"]]
    assert any(n.startswith("rollout.py:") for n in names)
    assert any(n.startswith("reward.py:") for n in names)
    assert 100 < f["lines"] < 2000


def test_bench_and_gpu_check_arguments(tmp_path, tiny_model_path):
    with pytest.raises(SystemExit, match="must divide"):
        bench_vs_trl.parse_args(["--micro-batch", "3"])
    with pytest.raises(SystemExit, match="--steps must be >= 2"):
        bench_vs_trl.parse_args(["--steps", "1"])
    steps = [{"step": 9.0, "rollout": 5.0, "reward": 1.0, "update": 3.0, "tokens": 100}] + \
        [{"step": s, "rollout": 2.0, "reward": 1.0, "update": 1.0, "tokens": 64} for s in (4, 5, 6)]
    assert bench_vs_trl.summarize(steps) == {"step": 5, "rollout": 2.0, "reward": 1.0,
                                             "update": 1.0, "tokens_per_s": 32.0}
    assert bench_vs_trl.cpu_name()
    with pytest.raises(SystemExit, match="needs --tokenizer"):
        gpu_check.main(["random-model", "--out", "x"])
    # the bare GPU machine's model: tiny here, its shape read back by the memory plan
    assert gpu_check.main(["random-model", "--tiny", "--tokenizer", tiny_model_path,
                           "--out", str(tmp_path)]) == 0
    assert memory_plan.model_shape(str(tmp_path))["layers"] == gpu_check.TINY["num_hidden_layers"]


def test_gpu_check_budget_hard_stop_and_preflight(tmp_path):
    import subprocess
    import time
    # the default budget + the documented outer `timeout -k 10 450` end inside 10 minutes
    assert gpu_check.BUDGET_S == 420 and gpu_check.MAX_BUDGET_S + 30 + 10 < 600
    for budget in ("0", "481"):
        with pytest.raises(SystemExit, match="--budget-s must be in"):
            gpu_check.main(["run", "--budget-s", budget])
    # the hard stop: train.py's process group killed, the report says so, exit 124
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    gpu_check.CHILDREN.append(child)
    codes = []
    try:
        gpu_check.hard_stop(0.2, str(tmp_path), exit=codes.append)
        assert child.wait(timeout=10) == -9
        for _ in range(100):
            if codes:
                break
            time.sleep(0.05)
    finally:
        gpu_check.CHILDREN.remove(child)
        child.kill()
    assert codes == [124]
    assert "ran out" in json.loads((tmp_path / "gpu_check.json").read_text())["stopped"]
    # the wheels a machine without a package index needs: transformers 5.24 and regex >= 2025.10.22
    gpu_check.preflight()  # this machine: requirements.txt's
    versions = {"transformers": "5.24.3", "regex": "2025.10.22"}
    assert gpu_check.preflight(versions.get) is None
    with pytest.raises(SystemExit, match=r"transformers 5.17.0 \(want 5.24.0\), regex 2025.10.21"):
        gpu_check.preflight({"transformers": "5.17.0", "regex": "2025.10.21"}.get)


def test_bench_check_loss_tiny(tiny_model_path, capsys):
    """Our train.update_policy and TRL's CISPO loss: the same loss and gradient on one batch."""
    pytest.importorskip("trl")
    data_path("gsm8k", "train.jsonl")
    assert bench_vs_trl.main(["--check-loss", "--P", "2", "--G", "2", "--N", "8", "--micro-batch",
                              "2", f"model.policy={tiny_model_path}"]) == 0
    assert "the same loss and gradient" in capsys.readouterr().out


# ---- the short-answer tasks (RLME Fig. 2 in miniature; configs/tasks/) ---------------------------

def test_task_splits_share_no_problem_answer_right_and_are_the_committed_files():
    task = make_tasks.make_task
    for name, sizes in [("larger", (3705, 100, 200)), ("add1", (33, 11, 11)),
                        ("add2", (3795, 100, 200))]:
        splits = task(name)
        assert tuple(len(splits[s]) for s in ("train", "val", "test")) == sizes, name
        qs = [{r["question"] for r in splits[s]} for s in ("train", "val", "test")]
        assert not (qs[0] & qs[1] or qs[0] & qs[2] or qs[1] & qs[2]), name
        for split, rows in splits.items():  # the files the presets read are these rows
            with open(os.path.join(REPO, "tasks", name, f"{split}.jsonl")) as f:
                assert [json.loads(line) for line in f] == rows, (name, split)
    assert task("larger", seed=1) != task("larger")
    rows = [r for name in ("larger", "add2") for s in task(name).values() for r in s]
    by_hand = {"Which number is larger, 40 or 93?": "#### 93", "What is 86 + 95?": "#### 181",
               "Which number is larger, 44 or 81?": "#### 81", "What is 54 + 31?": "#### 85"}
    assert sum(r["question"] in by_hand and by_hand[r["question"]] == r["answer"]
               for r in rows) == 4
    first = [r["question"].split()[-3] == r["answer"][5:] for r in task("larger")["train"]]
    assert 0.45 < sum(first) / len(first) < 0.55  # the larger is not always the first number
