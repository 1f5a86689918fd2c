"""Rollout generation alone: tokens/s of each way of sampling responses, interleaved, after warm-up.

Every variant samples `--new-tokens` tokens for `--batch-sizes` left-padded chat prompts (at most 48 tokens) from the
same randomly initialised model; the variants run in a rotating order in every round, so machine drift hits all alike,
and the first `--warmup` rounds are left out (they hold the compilations and CUDA-graph recordings).

- `hf-sample-fp32`: HF `generate(do_sample=True)` in fp32 outside autocast, as TRL 0.8.6's PPOTrainer.generate calls it;
- `hf-sample-autocast`: the same call under bf16 autocast;
- `ours-eager`: the scripts' call on CPU and with `--no-fast-generation`: a greedy `generate` whose last logits
  processor draws by inverse CDF (`common.sampling_kwargs`), under bf16 autocast;
- `hf-static`: the same processors with transformers' static KV cache, whose decoding forward transformers compiles on
  CUDA (`cache_implementation="static"`);
- `fast`: `common.FastGenerator`, our static-cache decoding loop with each step's forward one compiled CUDA graph, the
  rollout path of ppo.py / grpo.py / rloo.py on CUDA (under bf16 autocast its linear weights held in bf16, refreshed
  once per call);
- `fast-uncast`: the same with `cast_weights=False`: the float32 weights cast by autocast at every product;
- `trl-0.8.6`: TRL 0.8.6's `PPOTrainer.generate` itself, when benchmarks/.trl-0.8.6 is there.

With `--profile`, a torch.profiler table of one call of each variant at the smallest batch; with `--check-logprobs`,
the per-token log-probs of the fast path's samples against the training forward's (teacher-forced) ones.

    python benchmarks/generation.py --batch-sizes 16 64 256 --profile --check-logprobs
"""

import contextlib
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, os.path.join(HERE, ".trl-0.8.6"))

from common.cli import cli  # noqa: E402
from common.fast_paths import FastGenerator, sampling_kwargs  # noqa: E402
from common.loading import load_data, load_tokenizer  # noqa: E402


@dataclass
class Args:
    batch_sizes: list[int] = field(default_factory=lambda: [16, 64, 256])
    """prompts per generate call"""
    new_tokens: int = 16
    """tokens sampled per prompt (every variant samples all of them: EOS is never drawn by a random model in practice)"""
    model: Literal["gpt2-124m", "qwen2-0.5b", "tiny"] = "gpt2-124m"
    """randomly initialised GPT-2 small (124M), a Qwen2-0.5B-shaped model (494M), or a 2-layer 64-wide GPT-2"""
    variants: list[str] = field(
        default_factory=lambda: [
            "hf-sample-fp32",
            "hf-sample-autocast",
            "ours-eager",
            "hf-static",
            "fast-uncast",
            "fast",
            "trl-0.8.6",
        ]
    )
    """which variants to time"""
    rounds: int = 5
    """timed rounds"""
    warmup: int = 2
    """rounds left out of the timing"""
    profile: bool = False
    """print a torch.profiler table of one call of each variant at the smallest batch size"""
    check_logprobs: bool = False
    """compare the sampled tokens' log-probs under the sampling and the training forward"""


def build(args: Args, device: str):
    from bench import random_model

    tokenizer = load_tokenizer("builtin:tiny-gpt2", padding_side="left")
    torch.manual_seed(0)
    model = random_model(args.model, tokenizer)
    prompts = load_data("builtin:chatterbot-prompts")["prompt"]
    return model.eval().to(device), tokenizer, prompts


def main(args: Args) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, prompts = build(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.model}: {n_params / 1e6:.0f}M parameters on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}"
        f", torch {torch.__version__}, {args.new_tokens} new tokens",
        flush=True,
    )
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    T, pad, eos = args.new_tokens, tokenizer.pad_token_id, tokenizer.eos_token_id
    common_kwargs = dict(max_new_tokens=T, pad_token_id=pad, eos_token_id=eos)
    trl_trainer = {}
    fast = {}  # one per batch size: a generator runs a smaller batch in a larger cache it already holds

    def fast_generate(batch, cast_weights=True):
        B = len(batch["input_ids"])
        fast.setdefault((B, cast_weights), FastGenerator(model, compile=device == "cuda", cast_weights=cast_weights))
        return fast[B, cast_weights](batch["input_ids"], batch["attention_mask"], T, eos, pad)

    def trl_generate(batch):
        from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

        B = len(batch["input_ids"])
        if B not in trl_trainer:
            value_model = AutoModelForCausalLMWithValueHead(model)
            trl_trainer[B] = PPOTrainer(
                PPOConfig(batch_size=B, mini_batch_size=B, exp_name="bench"), value_model, tokenizer=tokenizer
            )
        queries = [ids[m.bool()] for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
        return trl_trainer[B].generate(
            queries, batch_size=B, return_prompt=False, max_new_tokens=T, top_k=0, top_p=1.0, do_sample=True, pad_token_id=pad
        )

    calls = {
        "hf-sample-fp32": (contextlib.nullcontext, lambda b: model.generate(**b, do_sample=True, top_k=0, **common_kwargs)),
        "hf-sample-autocast": (lambda: autocast, lambda b: model.generate(**b, do_sample=True, top_k=0, **common_kwargs)),
        "ours-eager": (lambda: autocast, lambda b: model.generate(**b, **sampling_kwargs(1.0, 0, 1.0), **common_kwargs)),
        "hf-static": (
            lambda: autocast,
            lambda b: model.generate(**b, **sampling_kwargs(1.0, 0, 1.0), **common_kwargs, cache_implementation="static"),
        ),
        "fast-uncast": (lambda: autocast, lambda b: fast_generate(b, cast_weights=False)),
        "fast": (lambda: autocast, fast_generate),
        "trl-0.8.6": (contextlib.nullcontext, trl_generate),
    }
    variants = [v for v in args.variants if v in calls]
    if "trl-0.8.6" in variants:
        try:
            import trl  # noqa: F401
        except ImportError as e:
            print(f"trl-0.8.6 left out: {e}")
            variants.remove("trl-0.8.6")

    def batch_of(B: int, seed: int):
        rows = [tokenizer(p)["input_ids"][-48:] for p in random.Random(seed).sample(prompts, B)]
        return tokenizer.pad({"input_ids": rows}, return_tensors="pt").to(device)

    def timed(variant, batch) -> float:
        context, call = calls[variant]
        torch.cuda.synchronize() if device == "cuda" else None
        t0 = time.perf_counter()
        with torch.no_grad(), context():
            call(batch)
        torch.cuda.synchronize() if device == "cuda" else None
        return time.perf_counter() - t0

    results = {}
    for B in args.batch_sizes:
        times = {v: [] for v in variants}
        for r in range(args.warmup + args.rounds):
            batch = batch_of(B, r)
            order = variants[r % len(variants) :] + variants[: r % len(variants)]  # rotate the order every round
            for v in order:
                seconds = timed(v, batch)
                if r >= args.warmup:
                    times[v].append(seconds)
                elif r == 0:
                    print(f"  batch {B} {v}: first call {seconds:.1f} s", flush=True)
        results[B] = {v: B * T / statistics.median(t) for v, t in times.items()}
        print(f"batch {B}: " + ", ".join(f"{v} {tps:.0f}" for v, tps in results[B].items()) + " tokens/s", flush=True)

    print("\n| variant | " + " | ".join(f"batch {B} tokens/s" for B in args.batch_sizes) + " |")
    print("|-" * (len(args.batch_sizes) + 1) + "|")
    for v in variants:
        print(f"| {v} | " + " | ".join(f"{results[B][v]:.0f}" for B in args.batch_sizes) + " |")
    base = "hf-sample-fp32" if "hf-sample-fp32" in variants else variants[0]
    for v in variants:
        print(f"{v} / {base}: " + ", ".join(f"{results[B][v] / results[B][base]:.2f}x" for B in args.batch_sizes))

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        B = min(args.batch_sizes)
        batch = batch_of(B, 99)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        for v in variants:
            context, call = calls[v]
            with profile(activities=activities) as prof, torch.no_grad(), context():
                call(batch)
                torch.cuda.synchronize() if device == "cuda" else None
            events = prof.key_averages()
            launches = sum(
                e.count
                for e in events
                if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchKernelExC")
            )
            gpu_us = sum(e.self_device_time_total for e in events) if device == "cuda" else 0
            cpu_us = max(e.cpu_time_total for e in events)
            print(
                f"\n== profile {v}, batch {B}: {launches} launches, GPU busy {gpu_us / 1e3:.1f} ms, CPU {cpu_us / 1e3:.1f} ms"
            )
            sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            print(events.table(sort_by=sort, row_limit=12, max_name_column_width=60))

    if args.check_logprobs:
        B = max(args.batch_sizes)
        batch = batch_of(B, 123)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad(), autocast:
            tokens, logprobs = FastGenerator(model, compile=device == "cuda")(ids, mask, T, None, pad, return_logprobs=True)
            full_mask = torch.cat([mask, torch.ones_like(tokens)], 1)
            logits = model(
                input_ids=torch.cat([ids, tokens], 1),
                attention_mask=full_mask,
                position_ids=(full_mask.cumsum(1) - 1).clamp(min=0),
            ).logits[:, ids.shape[1] - 1 : -1]
        recomputed = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
        diff = (recomputed - logprobs).abs()
        print(
            f"\nlog-probs of {B}x{T} sampled tokens, fast path vs training forward (bf16 autocast): "
            f"max |diff| {diff.max():.4f}, mean {diff.mean():.5f}, mean log-prob {logprobs.mean():.3f}"
        )


if __name__ == "__main__":
    main(cli(Args))
