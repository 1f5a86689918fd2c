#!/usr/bin/env bash
# One GPU: sft.py at 0.5B under configs/fsdp.yaml (FSDP2, 1 process) against a plain 1-process launch (bf16 mixed
# precision both), peak memory and step time from benchmarks/profile_steps.py; then ppo.py on the tiny presets under
# FSDP2 (rollouts from the sharded policy with its value head, the reference and reward model sharded).
#
#   bash benchmarks/gpu_sharded.sh OUT DATA      # DATA: sft.jsonl as for gpu_profile.sh
set -uo pipefail
out=${1:?output folder}
data=${2:?data folder}
mkdir -p "$out"
model=/tmp/qwen2-0.5b
python3 -c "import sys; sys.path[:0] = ['.', 'benchmarks']; import bench; bench.save_random_model('qwen2-0.5b', '$model')" || exit 1
export PYTHONUNBUFFERED=1
sft="sft.py --model-name $model --dataset-name $data/sft.jsonl --packing --max-seq-length 1024 --batch-size 8 --max-steps 6"
sft="$sft --num-sample-generations 2 --eval-steps 100"
for launcher in plain fsdp; do
    if [ $launcher = fsdp ]; then cfg="--config_file configs/fsdp.yaml --num_processes 1"; else cfg="--num_processes 1 --mixed_precision bf16"; fi
    accelerate launch $cfg --main_process_port 29511 benchmarks/profile_steps.py --skip 2 --steps 2 --rows 12 \
        --out "$out/sft_$launcher.txt" -- $sft --output-dir /tmp/sft_$launcher > "$out/sft_$launcher.log" 2>&1
    grep -E "^sft: |^error" "$out/sft_$launcher.log" | tail -3
    python3 -c "from transformers import AutoModelForCausalLM as M; m = M.from_pretrained('/tmp/sft_$launcher'); print('$launcher: the saved model loads,', sum(p.numel() for p in m.parameters()), 'parameters')"
done
accelerate launch --config_file configs/fsdp.yaml --num_processes 1 --main_process_port 29512 ppo.py \
    --model-name builtin:tiny-gpt2 --reward-model builtin:tiny-chat-rm --total-episodes 64 --batch-size 16 \
    --mini-batch-size 8 --eval-samples 16 --output-dir /tmp/ppo_fsdp > "$out/ppo_fsdp.log" 2>&1
grep -E "^ppo: |^error|Error" "$out/ppo_fsdp.log" | tail -6
