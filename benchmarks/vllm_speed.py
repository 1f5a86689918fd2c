"""Rollout speed on the real model, side by side in one sitting: HF `generate` as the engine runs it on CPU (the
inverse-CDF draw), HF's own sampling (`do_sample=True`), and vLLM (`--use-vllm`'s sampler, common/vllm_engine.py) in
float32 and bfloat16, at 32 prompts x 32 new tokens and 64 x 256. Every completion is exactly that long (EOS
suppressed), so each side does the same work; tokens/s = prompts x new tokens / seconds, the median of `--repeats`
timed calls after a warm-up one, each side in a fresh process, the sides interleaved. Writes
benchmarks/RESULTS-vllm-speed.json (docs/vllm.md renders it).

    python benchmarks/vllm_speed.py                 # about 10 minutes on 2 CPU cores
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro
from records import machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = "builtin:smollm2-135m-instruct"
SIDES = ("hf_inverse_cdf", "hf_do_sample", "vllm_float32", "vllm_bfloat16")


@dataclass
class Args:
    shapes: list[str] = field(default_factory=lambda: ["32x32", "64x256"])
    """prompts x new tokens"""
    repeats: int = 2
    """timed calls per side and shape, after one warm-up call"""
    worker: str | None = None
    """internal: time one side at one shape (JSON spec) and print the seconds of each call"""


def prompts(n: int, tokenizer) -> list[list[int]]:
    """n chat prompts of the real-model task (reasoning-gym chain_sum questions, as grpo.py renders them)."""
    sys.path.insert(0, ROOT)
    from common.rewards import prompt_ids, reasoning_gym_rows

    rows = reasoning_gym_rows("chain_sum", {}, n, 1)
    return [prompt_ids(tokenizer, [{"role": "user", "content": r["prompt"]}], True) for r in rows]


def time_side(side: str, n: int, length: int, repeats: int) -> list[float]:
    """Seconds of each timed call of one side (after a warm-up call)."""
    import torch

    sys.path.insert(0, ROOT)
    from common.loading import load_pretrained, load_tokenizer, resolve

    tokenizer = load_tokenizer(MODEL, padding_side="left")
    ids = prompts(n, tokenizer)
    if side.startswith("vllm"):
        from vllm import LLM, SamplingParams

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        folder = resolve(MODEL)  # the built-in's folder, its weights as saved
        llm = LLM(model=folder, dtype=side.split("_")[1], enforce_eager=True, max_model_len=512, seed=0)
        params = SamplingParams(temperature=1.0, max_tokens=length, min_tokens=length, logprobs=0, seed=0)

        def call():
            llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    else:
        from transformers import AutoModelForCausalLM

        from common.fast_paths import sampling_kwargs

        model = load_pretrained(MODEL, AutoModelForCausalLM).eval()
        batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        sampling = sampling_kwargs(1.0, 0, 1.0, inverse_cdf=side == "hf_inverse_cdf")

        def call():
            with torch.no_grad():
                model.generate(
                    **batch, **sampling, max_new_tokens=length, min_new_tokens=length, pad_token_id=tokenizer.pad_token_id
                )

    call()  # warm-up: first-call compilation and allocation
    seconds = []
    for _ in range(repeats):
        start = time.time()
        call()
        seconds.append(time.time() - start)
    return seconds


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(time_side(spec["side"], spec["n"], spec["length"], spec["repeats"])))
        sys.exit(0)
    import torch

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    rows = []
    for shape in args.shapes:
        n, length = map(int, shape.split("x"))
        row = dict(prompts=n, new_tokens=length)
        for side in SIDES:
            spec = json.dumps(dict(side=side, n=n, length=length, repeats=args.repeats))
            done = subprocess.run(
                [sys.executable, __file__, "--worker", spec], cwd=ROOT, env=env, capture_output=True, text=True
            )
            if done.returncode:
                sys.exit(f"{side} at {shape} failed:\n{done.stderr[-3000:]}")
            seconds = json.loads(done.stdout.strip().splitlines()[-1])
            row[side] = dict(seconds=seconds, tokens_per_s=n * length / statistics.median(seconds))
            print(f"{shape} {side}: {row[side]['tokens_per_s']:.0f} tokens/s ({seconds})", flush=True)
        rows.append(row)
    record = dict(
        command=f"python benchmarks/vllm_speed.py --shapes {' '.join(args.shapes)} --repeats {args.repeats}",
        machine=machine(),
        launcher="python",
        threads=torch.get_num_threads(),
        rows=rows,
    )
    with open(os.path.join(HERE, "RESULTS-vllm-speed.json"), "w") as f:
        json.dump(record, f, indent=1)
