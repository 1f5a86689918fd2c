"""Where an update's time goes, against what this machine can do: the rate of a large matmul (float32 and bfloat16),
then each phase of a grpo.py / rloo.py update at the real-model recipe (builtin:smollm2-135m-instruct, reasoning-gym
chain_sum as chat prompts, 8 prompts x 4 completions of at most 32 tokens, mini-batches of 8, one optimizer step of
32), run through the functions the scripts call (common.rollout's Engine, score, sampling_logprobs; the training
forward and backward of common.sampling.per_token_logprobs, then AdamW). For each phase: its time (the median of
--repeats, after a warm-up), the FLOPs it executes (torch's FlopCounterMode: every matmul and attention product,
padding included), the useful FLOPs (PaLM's count over the real tokens only), and the share of the float32 matmul rate
each achieves. grpo.py and rloo.py run these same calls; their losses add no matmul. Writes
benchmarks/RESULTS-roofline.json, from which docs/benchmarks.md renders its table.

    python benchmarks/roofline.py
"""

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import tyro
from records import header, write

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
RECIPE = dict(  # benchmarks/speed_cpu.py's RECIPE: benchmarks/real_model.py's settings for grpo.py and rloo.py
    model_name="builtin:smollm2-135m-instruct", dataset_name="reasoning-gym:chain_sum", data_seed=1, seed=1,
    max_completion_length=32, batch_size=8, num_generations=4, mini_batch_size=8, gradient_accumulation_steps=4,
    learning_rate=1e-5, beta=0.0, eval_freq=0, total_prompts=8,
)  # fmt: skip


@dataclass
class Args:
    repeats: int = 3
    """timed runs of each phase after one warm-up; the record keeps their median"""
    size: int = 2048
    """the side of the square matmul whose rate is the roof"""


def matmul_rate(size: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of `size` x `size` matmuls in `dtype` on this machine's threads: the median of `repeats` timings."""
    a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def counted(phase) -> float:
    """The FLOPs `phase()` executes, as torch's FlopCounterMode counts them (matmuls and attention products)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        phase()
    return float(counter.get_total_flops())


def timed(phase, repeats: int) -> float:
    """The median wall seconds of `phase()` over `repeats` runs after one warm-up, each from the same seed."""
    times = []
    for i in range(repeats + 1):
        torch.manual_seed(0)
        start = time.perf_counter()
        phase()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def useful_flops(config, prompt_lengths: list[int], completion_lengths: list[int]) -> float:
    """PaLM's count of one forward over the real tokens only: 2 per weight of the layers' matrices per token, the LM head
    (2 x width x vocabulary) per completion token (each is scored, or drawn), and 4 x layers x width x the token's
    position for attention."""
    layers, width, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    kv = width * config.num_key_value_heads // config.num_attention_heads
    block = layers * (2 * width * width + 2 * width * kv + 3 * width * config.intermediate_size)  # q, o; k, v; MLP
    total = 0.0
    for p, c in zip(prompt_lengths, completion_lengths):
        total += (p + c) * 2 * block + c * 2 * width * vocab + 4 * layers * width * sum(range(1, p + c + 1))
    return total


def main(args: Args) -> None:
    from accelerate import Accelerator

    import grpo
    from common.rollout import Engine, batch_rows, load_online_task, load_policy, sampling_logprobs, score
    from common.sampling import per_token_logprobs

    rates = {name: matmul_rate(args.size, dtype) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    print({k: f"{v / 1e9:.1f} GFLOP/s" for k, v in rates.items()})
    run = grpo.Args(**RECIPE)
    accelerator = Accelerator()
    task = load_online_task(run, accelerator, 1)
    model, ref_model, optimizer, _ = load_policy(run, accelerator, 1)
    policy = accelerator.unwrap_model(model)
    engine = Engine(run, task, policy, accelerator, quiet=True)
    rows = batch_rows(run, task, accelerator, 0)
    torch.manual_seed(0)
    policy.eval()
    rollout = engine.rollout(rows)
    prompt_lengths = rollout.prompt_mask.sum(1).tolist()
    completion_lengths = rollout.mask.sum(1).int().tolist()
    advantages = torch.randn(len(rows))

    def generate():
        policy.eval()
        engine.rollout(rows)

    def logprobs():
        sampling_logprobs(run, accelerator, policy, ref_model, rollout, True, False)

    def train():  # the training forward and backward of every mini-batch, then one AdamW step (the last phase timed)
        model.train()
        for mb in torch.arange(len(rows)).split(run.mini_batch_size):
            out, _ = per_token_logprobs(
                model, rollout.prompts[mb], rollout.prompt_mask[mb], rollout.completions[mb], rollout.mask[mb], 1.0
            )
            loss = -(out * advantages[mb, None] * rollout.mask[mb]).sum() / rollout.mask[mb].sum()
            accelerator.backward(loss / run.gradient_accumulation_steps)
        optimizer.step()
        optimizer.zero_grad()

    def scoring():
        score(task, rows, rollout)

    config = policy.config
    phases = {
        "rollout": (generate, useful_flops(config, prompt_lengths, completion_lengths)),
        "score": (scoring, 0.0),
        "old or reference log-probs": (logprobs, useful_flops(config, prompt_lengths, completion_lengths)),
        "train (forward, backward, AdamW)": (train, 3 * useful_flops(config, prompt_lengths, completion_lengths)),
    }  # fmt: skip
    rows_out = []
    for name, (phase, useful) in phases.items():
        seconds = timed(phase, args.repeats)
        executed = counted(phase) if useful else 0.0
        rows_out.append(
            {
                "phase": name,
                "seconds": seconds,
                "executed_flops": executed,
                "useful_flops": useful,
                "executed_share": executed / seconds / rates["float32"],
                "useful_share": useful / seconds / rates["float32"],
            }
        )
        print(f"{name}: {seconds:.2f} s, {executed / 1e9:.1f} GFLOP executed, {useful / 1e9:.1f} useful")
    write(
        os.path.join(HERE, "RESULTS-roofline.json"),
        header("python benchmarks/roofline.py")
        | {
            "recipe": RECIPE,
            "matmul_size": args.size,
            "matmul_flops_per_s": rates,
            "tokens": {
                "completions": len(rows),
                "prompt_mean": statistics.mean(prompt_lengths),
                "prompt_max": max(prompt_lengths),
                "completion_mean": statistics.mean(completion_lengths),
                "completion_max": max(completion_lengths),
            },
            "phases": rows_out,
        },
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
