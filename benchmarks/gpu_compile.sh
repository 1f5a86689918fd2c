#!/usr/bin/env bash
# One GPU: sft.py and dpo.py at 0.5B with accelerate's torch.compile (ACCELERATE_DYNAMO_BACKEND=inductor, what
# `accelerate launch --dynamo_backend inductor` sets) against the eager run, in one call; the settings of
# gpu_profile.sh (bf16 autocast, 8 x 1,024 packed tokens per SFT step, 8 pairs of up to 2 x 512 tokens per DPO step),
# and SFT at 16 x 1,024 compiled.
#
#   bash benchmarks/gpu_compile.sh OUT DATA      # DATA: sft.jsonl and pairs.jsonl as for gpu_profile.sh
set -uo pipefail
out=${1:?output folder}
data=${2:?data folder}
mkdir -p "$out"
shape=${SHAPE:-qwen2-0.5b}  # SHAPE=tiny SEQ=128: a dry run on CPU
seq=${SEQ:-1024}  # RUN_TIMEOUT: seconds per run (default 200)
model=/tmp/$shape
python3 -c "import sys; sys.path[:0] = ['.', 'benchmarks']; import bench; bench.save_random_model('$shape', '$model')" || exit 1
export ACCELERATE_MIXED_PRECISION=${MP:-bf16} PYTHONUNBUFFERED=1  # MP=no for the dry run
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
sft="sft.py --model-name $model --dataset-name $data/sft.jsonl --packing --max-seq-length $seq --max-steps 8"
sft="$sft --num-sample-generations 0 --eval-steps 100 --output-dir /tmp/sft_out --overwrite"
dpo="dpo.py --model-name $model --dataset-name $data/pairs.jsonl --max-length $(( seq / 2 )) --max-prompt-length $(( seq / 4 ))"
dpo="$dpo --max-target-length $(( seq / 4 )) --batch-size 8 --max-steps 10 --eval-steps 100 --no-generate-during-eval"
dpo="$dpo --output-dir /tmp/dpo_out --overwrite"
for run in "sft no 8" "sft inductor 8" "dpo no 8" "dpo inductor 8" "sft inductor 16"; do
    set -- $run
    if [ $1 = sft ]; then command="$sft --batch-size $3"; skip=4; else command="$dpo"; skip=6; fi
    start=$(date +%s)
    ACCELERATE_DYNAMO_BACKEND=$2 timeout ${RUN_TIMEOUT:-200} python3 benchmarks/profile_steps.py --skip $skip --steps 2 \
        --rows 12 --out "$out/${1}_${2}_b$3.txt" -- $command > "$out/${1}_${2}_b$3.log" 2>&1
    echo "$1 dynamo=$2 batch=$3: exit $?, $(( $(date +%s) - start )) s"
    grep -E "^(every step|peak memory|profiled)" "$out/${1}_${2}_b$3.txt" 2>/dev/null
    grep -E "^(sft|dpo): .* in |^error|Error" "$out/${1}_${2}_b$3.log" | tail -2
done
