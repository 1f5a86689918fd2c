"""Where an update's time goes, against what this machine can do: the rate of a large matmul (float32 and bfloat16),
then each phase of an update at the real-model recipe (builtin:smollm2-135m-instruct, reasoning-gym chain_sum as chat
prompts, completions of at most 32 tokens), run through the functions the scripts call:
- grpo.py / rloo.py: 8 prompts x 4 completions, mini-batches of 8, one optimizer step of 32 (common.rollout's Engine,
  score, sampling_logprobs; the training forward and backward of common.sampling.per_token_logprobs, then AdamW; their
  losses add no matmul);
- ppo.py with its separate critic, at benchmarks/real_model.py's ppo_critic settings: 8 prompts x 4, one epoch of 4
  mini-batches of 8, an Adam step each (its load_sampler, Rewards, sampling_forwards, forward and ppo_loss).
For each phase: its time (the median of --repeats, after a warm-up), the FLOPs it executes (torch's FlopCounterMode:
every matmul and attention product, padding included), the useful FLOPs (PaLM's count over the real tokens only), and
the share of the float32 matmul rate each achieves. Writes benchmarks/RESULTS-roofline.json, from which
docs/benchmarks.md renders its tables.

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
PPO_RECIPE = dict(  # benchmarks/real_model.py's ppo_critic: the policy's copy as the critic, lambda 1, no KL
    model_name="builtin:smollm2-135m-instruct", dataset_name="reasoning-gym:chain_sum", data_seed=1, seed=1,
    min_new_tokens=32, max_new_tokens=32, reward_funcs=["verifier"], batch_size=32, n_samples_per_prompt=4,
    mini_batch_size=8, ppo_epochs=1, learning_rate=1e-5, value_model_path="auto", critic_learning_rate=5e-5, lam=1.0,
    critic_lam=1.0, init_kl_coef=0.0, adap_kl_ctrl=False, total_episodes=32, eval_freq=0,
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


def useful_flops(config, prompt_lengths: list[int], completion_lengths: list[int], head: bool = True) -> float:
    """PaLM's count of one forward over the real tokens only: 2 per weight of the layers' matrices per token, the LM head
    (2 x width x vocabulary) per completion token (each is scored, or drawn; `head` False: a critic's trunk, without
    it), and 4 x layers x width x the token's position for attention."""
    layers, width, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    kv = width * config.num_key_value_heads // config.num_attention_heads
    block = layers * (2 * width * width + 2 * width * kv + 3 * width * config.intermediate_size)  # q, o; k, v; MLP
    total = 0.0
    for p, c in zip(prompt_lengths, completion_lengths):
        total += (p + c) * 2 * block + head * c * 2 * width * vocab + 4 * layers * width * sum(range(1, p + c + 1))
    return total


def measure(phases: dict, repeats: int, rate: float) -> list[dict]:
    """Each phase's row: its median time, the FLOPs it executes and the useful ones, each as a share of `rate`."""
    rows = []
    for name, (phase, useful) in phases.items():
        seconds = timed(phase, repeats)
        executed = counted(phase) if useful else 0.0
        rows.append(
            {
                "phase": name,
                "seconds": seconds,
                "executed_flops": executed,
                "useful_flops": useful,
                "executed_share": executed / seconds / rate,
                "useful_share": useful / seconds / rate,
            }
        )
        print(f"{name}: {seconds:.2f} s, {executed / 1e9:.1f} GFLOP executed, {useful / 1e9:.1f} useful")
    return rows


def lengths(prompt_mask, completion_mask) -> tuple[list[int], list[int], dict]:
    """The real tokens of each prompt and completion, and their summary for the record."""
    prompts, completions = prompt_mask.sum(1).int().tolist(), completion_mask.sum(1).int().tolist()
    summary = {
        "completions": len(completions),
        "prompt_mean": statistics.mean(prompts),
        "prompt_max": max(prompts),
        "completion_mean": statistics.mean(completions),
        "completion_max": max(completions),
    }
    return prompts, completions, summary


def ppo_phases(repeats: int, rate: float) -> dict:
    """ppo.py's update at PPO_RECIPE, phase by phase, through its own functions; the critic is a trunk without the LM
    head, so it counts the useful FLOPs of the policy's forward less the head."""
    import torch.nn.functional as F
    from accelerate import Accelerator

    import ppo
    from common.loading import load_tokenizer
    from common.sampling import decode

    run = ppo.Args(**PPO_RECIPE)
    accelerator = Accelerator()
    step_size = ppo.batch_sizes(run, accelerator)
    tokenizer = load_tokenizer(run.model_name, padding_side="left")
    train_rows, eval_rows, chat = ppo.load_queries(run, tokenizer, accelerator)
    model, ref_model, scoring = ppo.load_models(run, accelerator, tokenizer, {}, chat, train_rows, eval_rows)
    sampler, settings = ppo.load_sampler(run, tokenizer, model, accelerator, {}, train_rows)
    model, optimizer, _ = ppo.prepare_training(run, accelerator, model, step_size)
    policy = accelerator.unwrap_model(model)
    scoring.ready(policy)
    rows = [row for row in train_rows[: run.batch_size // run.n_samples_per_prompt] for _ in range(run.n_samples_per_prompt)]
    queries, query_mask = sampler.pad_left([r["prompt_ids"] for r in rows])
    torch.manual_seed(0)
    policy.eval()
    responses, response_mask, ended, _ = sampler.generate(queries, query_mask, run.max_new_tokens)
    texts, ids = decode(tokenizer, responses, response_mask)
    response_mask = response_mask.long()  # as ppo.py's loop holds it
    batch = (queries, query_mask, responses, response_mask)
    old, _, values, _ = ppo.sampling_forwards(run, accelerator, policy, ref_model, settings, *batch)
    mask, advantages, returns = response_mask.float(), torch.randn_like(old), torch.randn_like(old)

    def generate():
        policy.eval()
        sampler.generate(queries, query_mask, run.max_new_tokens)

    def forwards():
        ppo.sampling_forwards(run, accelerator, policy, ref_model, settings, *batch)

    def train():  # one epoch over the mini-batches: the policy's and the critic's forward, backward and Adam step each
        model.train()
        for mb in torch.arange(run.batch_size).split(run.mini_batch_size):
            logits, vpreds = ppo.forward(model, queries[mb], query_mask[mb], responses[mb], response_mask[mb], **settings)
            logprobs = torch.gather(F.log_softmax(logits.float(), -1), -1, responses[mb, :, None])[..., 0]
            pg_loss, vf_loss, _ = ppo.ppo_loss(
                old[mb], values[mb], logprobs, vpreds, mask[mb], advantages[mb], returns[mb], 0.2, 0.2, run.vf_coef
            )
            accelerator.backward(pg_loss + vf_loss)
            optimizer.step()
            optimizer.zero_grad()

    prompts, completions, tokens = lengths(query_mask, response_mask)
    config = policy.config
    lm, trunk = useful_flops(config, prompts, completions), useful_flops(config, prompts, completions, head=False)
    phases = {
        "rollout": (generate, lm),
        "score": (lambda: scoring(rows, texts, ids, ended.tolist()), 0.0),
        "old log-probs and values, reference log-probs": (forwards, 2 * lm + trunk),
        "train (policy and critic: forward, backward, Adam)": (train, 3 * (lm + trunk)),
    }  # fmt: skip
    return {"recipe": PPO_RECIPE, "tokens": tokens, "phases": measure(phases, repeats, rate)}


def grpo_phases(repeats: int, rate: float) -> dict:
    """A grpo.py / rloo.py update at RECIPE, phase by phase, through common.rollout's functions."""
    from accelerate import Accelerator

    import grpo
    from common.rollout import Engine, batch_rows, load_online_task, load_policy, sampling_logprobs, score
    from common.sampling import per_token_logprobs

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

    prompts, completions, tokens = lengths(rollout.prompt_mask, rollout.mask)
    useful = useful_flops(policy.config, prompts, completions)
    phases = {
        "rollout": (generate, useful),
        "score": (lambda: score(task, rows, rollout), 0.0),
        "old or reference log-probs": (logprobs, useful),
        "train (forward, backward, AdamW)": (train, 3 * useful),
    }  # fmt: skip
    return {"recipe": RECIPE, "tokens": tokens, "phases": measure(phases, repeats, rate)}


def main(args: Args) -> None:
    rates = {name: matmul_rate(args.size, dtype) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    print({k: f"{v / 1e9:.1f} GFLOP/s" for k, v in rates.items()})
    record = header("python benchmarks/roofline.py") | {"matmul_size": args.size, "matmul_flops_per_s": rates}
    record |= grpo_phases(args.repeats, rates["float32"])
    record["ppo"] = ppo_phases(args.repeats, rates["float32"])
    write(os.path.join(HERE, "RESULTS-roofline.json"), record)


if __name__ == "__main__":
    main(tyro.cli(Args))
