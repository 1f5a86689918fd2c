#!/usr/bin/env bash
# One GPU, one call: sft.py (and dpo.py) at 0.5B towards the MFU aim, the settings of gpu_profile.sh (bf16 autocast,
# 8 x 1,024 packed tokens per SFT step, 8 pairs of up to 2 x 512 tokens per DPO step). Each run under
# benchmarks/profile_steps.py (steps 5-6 profiled, the others timed unprofiled):
# - the chunked LM head's backward in four passes over each [chunk, vocab] block against seven (OLD: a checkout of
#   the scripts before that change, run from its own folder);
# - larger micro-batches (16 and 32 x 1,024 tokens per step: 21 GiB of the GPU's memory held at 8);
# - accelerate's regional compilation (ACCELERATE_DYNAMO_BACKEND=inductor with USE_REGIONAL_COMPILATION: each decoder
#   layer compiled once, the compiled code reused by all 24; the whole model's compile never finished a step in 150 s).
#
#   OLD=path/to/old/checkout bash benchmarks/gpu_mfu.sh OUT      # RUNS="sft new 8;dpo new 8": some of the runs
set -uo pipefail
out=$(realpath -m "${1:?output folder}")
mkdir -p "$out"
shape=${SHAPE:-qwen2-0.5b}  # SHAPE=tiny SEQ=128 MP=no: a dry run on CPU
seq=${SEQ:-1024}
model=/tmp/$shape data=/tmp/mfu_data
if [ -d .whl ] && [ -n "${WHEELS-1}" ]; then  # the GPU machine has no registry: wheels carried
    python3 -m pip install -q --no-deps .whl/* 2>&1 | tail -2
fi
python3 - <<PY || exit 1
import sys; sys.path[:0] = [".", "benchmarks"]
import bench, os
bench.save_random_model("$shape", "$model")
os.makedirs("$data", exist_ok=True)
bench.sft_texts(1024).to_json("$data/sft.jsonl")
bench.preference_pairs(1024).to_json("$data/pairs.jsonl")
PY
export ACCELERATE_MIXED_PRECISION=${MP:-bf16} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
sft="sft.py --model-name $model --dataset-name $data/sft.jsonl --packing --max-seq-length $seq --max-steps 10"
sft="$sft --num-sample-generations 0 --eval-steps 100 --output-dir /tmp/sft_out --overwrite"
dpo="dpo.py --model-name $model --dataset-name $data/pairs.jsonl --max-length $(( seq / 2 )) --max-prompt-length $(( seq / 4 ))"
dpo="$dpo --max-target-length $(( seq / 4 )) --batch-size 8 --max-steps 10 --eval-steps 100 --no-generate-during-eval"
dpo="$dpo --output-dir /tmp/dpo_out --overwrite"
root=$PWD
IFS=";" read -ra runs <<< "${RUNS:-sft old 8;sft new 8;sft new 16;sft new 32;dpo old 8;dpo new 8;sft compiled 8}"
for run in "${runs[@]}"; do
    set -- $run
    name=${1}_${2}_b$3
    command="${!1} --batch-size $3"
    folder=$root dynamo=no
    [ $2 = old ] && folder=${OLD:?a checkout before the change}
    [ $2 = compiled ] && dynamo=inductor
    start=$(date +%s)
    (cd "$folder" && ACCELERATE_DYNAMO_BACKEND=$dynamo ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true \
        timeout ${RUN_TIMEOUT:-240} python3 "$root/benchmarks/profile_steps.py" --skip 4 --steps 2 --rows 25 \
        --out "$out/$name.txt" -- $command > "$out/$name.log" 2>&1)
    echo "$name: exit $?, $(( $(date +%s) - start )) s"
    grep -E "^(every step|peak memory)" "$out/$name.txt" 2>/dev/null
    grep -E "^error|Error" "$out/$name.log" | tail -2
done
