#!/usr/bin/env bash
# One GPU, one command: profile sft.py and dpo.py at 0.5B (bf16 autocast, the settings of RESULTS-H100.md section 4)
# and time long rollouts (256 and 1,024 new tokens) of HF generate and FastGenerator at 0.5B.
#
#   bash benchmarks/gpu_profile.sh OUT_FOLDER DATA_FOLDER
#
# DATA_FOLDER holds sft.jsonl and pairs.jsonl (bench.py's sft_texts(1024) and preference_pairs(1024), written with
# `to_json`); the Qwen2-0.5B-shaped model is built randomly initialised on the GPU machine (bench.random_model).
set -uo pipefail
out=${1:?output folder}
data=${2:?data folder}
mkdir -p "$out"
shape=${SHAPE:-qwen2-0.5b}  # SHAPE=tiny TOKENS=64: a dry run on CPU
model=/tmp/$shape
python3 -c "import sys; sys.path[:0] = ['.', 'benchmarks']; import bench; bench.save_random_model('$shape', '$model')" || exit 1
export ACCELERATE_MIXED_PRECISION=bf16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
python3 benchmarks/profile_steps.py --skip 3 --steps 3 --out "$out/profile_sft.txt" -- sft.py --model-name $model \
    --dataset-name "$data/sft.jsonl" --packing --max-seq-length 1024 --batch-size 8 --max-steps 8 \
    --num-sample-generations 0 --eval-steps 100 --output-dir /tmp/sft_out 2>&1 | tail -3
python3 benchmarks/profile_steps.py --skip 3 --steps 3 --out "$out/profile_dpo.txt" -- dpo.py --model-name $model \
    --dataset-name "$data/pairs.jsonl" --max-length 512 --max-prompt-length 256 --max-target-length 256 \
    --batch-size 8 --max-steps 8 --eval-steps 100 --no-generate-during-eval --output-dir /tmp/dpo_out 2>&1 | tail -3
[ "${ROLLOUTS:-1}" = 0 ] && exit 0  # ROLLOUTS=0: the two profiles only
for tokens in ${TOKENS:-256 1024}; do
    rounds=$(( tokens > 256 ? 1 : 2 ))
    timeout 200 python3 benchmarks/generation.py --model $shape --new-tokens $tokens --batch-sizes 64 \
        --variants hf-sample-autocast fast --rounds $rounds --warmup 1 --no-profile --no-check-logprobs 2>&1 \
        | grep -v "it/s\]" | tail -12 | tee "$out/rollout_$tokens.txt"
done
