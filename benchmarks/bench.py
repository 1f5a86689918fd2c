"""Speed and memory of this repository's scripts against TRL on the same work, side by side.

Each algorithm runs in a worker process of its own, in which our script (run through its real CLI, in-process) and
the matching TRL trainer alternate A/B/A/B for `--rounds` rounds: same model (a saved copy of builtin:tiny-gpt2),
same data, batch size, sequence lengths and optimisation passes, so machine noise hits both alike. The two sides of
each algorithm are in benchmarks/bench_sides.py; this file runs them, measures and reports.

- time per step: the interval between consecutive optimizer-step ends (PPO: rollout + scoring + PPO step), the median
  over the steps after `--warmup`, pooled over the rounds;
- peak memory: a fresh process per implementation imports both libraries, then runs one of them once; on CPU the
  growth of its peak RSS over the RSS before the run, under glibc's default allocator policy (large blocks are
  unmapped when freed, so RSS follows the live tensors), on GPU `torch.cuda.max_memory_allocated`.

- model FLOPs utilisation: the model FLOPs of the step's useful (non-padding) tokens, PaLM's convention (forward 2N
  per token plus 4 * layers * width * context for attention, backward twice the forward), over the median time, as
  achieved TFLOP/s and as a fraction of the device's peak (MFU); for PPO per phase (generation, forward/backward).

On a GPU the default model is a randomly initialised GPT-2-small-sized one (124M parameters) in bf16 mixed precision;
on CPU builtin:tiny-gpt2 in fp32.

Peers: TRL's current release for SFT / reward modelling / DPO, TRL 0.8.6 for PPO and DDPO (the last release with the
PPOTrainer and DDPOTrainer this repository follows). On CPU both sides run under the allocator policy our scripts set
(`keep_freed_memory`) for the timings, so the comparison is of the training code, not of glibc's settings.
`bash benchmarks/setup.sh` puts both in benchmarks/.trl-*/.

    bash benchmarks/setup.sh
    python benchmarks/bench.py                                     # all algorithms, a table on stdout
    python benchmarks/bench.py --algos dpo --rounds 5 --steps 10
    python benchmarks/bench.py --write benchmarks/RESULTS.md       # also write the results file
    python benchmarks/bench.py --model gpt2-124m --bf16 True --peak-tflops 989   # model, precision, peak
"""

import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Literal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)  # imported by the GPU scripts and generation.py too: bench_sides beside it

from bench_sides import ONLINE, RUNS, clock, ppo_queries, preference_pairs, random_model, setup, sft_texts  # noqa: E402

TRL_PATHS = {"current": os.path.join(HERE, ".trl-current"), "0.8.6": os.path.join(HERE, ".trl-0.8.6")}
PEER = {
    "sft": "current",
    "rm": "current",
    "dpo": "current",
    "ppo": "0.8.6",
    "ddpo": "0.8.6",
    "grpo": "current",
    "rloo": "current",
}
# our flags whose peak memory is measured too, and whether TRL's run has the same option (TRL 0.8.6's peft path
# needs a peft model passed in, so --use-peft is ours only; TRL's reward step is always one padded pass)
MEMORY_VARIANTS = {
    "ppo": [(["--num-shared-layers", "1"], True), (["--use-peft"], False)],
    "sft": [(["--gradient-checkpointing"], True)],
    "rm": [(["--length-groups", "1"], False)],
    "dpo": [(["--precompute-ref-log-probs"], True), (["--gradient-checkpointing"], True)],
}
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0)]  # dense bf16, by GPU name
TARGET = {
    "sft": 0.8,
    "rm": 0.8,
    "dpo": 0.7,
    "ppo": {16: 0.6, 64: 0.8},
    "ddpo": None,
    "grpo": 0.7,
    "rloo": 0.7,
}  # ours / TRL per step, at most


@dataclass
class Args:
    algos: list[str] = field(default_factory=lambda: ["sft", "rm", "dpo", "ppo", "ddpo", "grpo", "rloo"])
    """which comparisons to run: sft, rm, dpo, ppo, ddpo, grpo, rloo"""
    rounds: int = 3
    """A/B rounds per comparison: one run of each side per round, in alternating order (A B B A ...)"""
    warmup: int = 2
    """steps of each run left out of the timing"""
    steps: int = 6
    """timed steps per run"""
    ppo_batch_sizes: list[int] = field(default_factory=lambda: [16, 64])
    """PPO batch sizes to compare (mini-batch = half the batch, 4 PPO epochs, 16 new tokens)"""
    rollout_batch_sizes: list[int] = field(default_factory=lambda: [16, 64, 256])
    """batch sizes of the generation-only measurement (tokens/s of rollouts)"""
    rollout_rounds: int = 6
    """timed A/B rounds of the generation-only measurement (after two warm-up rounds); a call is short, so more
    rounds than `--rounds` are cheap and average out the machine's drift"""
    model: Literal["auto", "tiny", "gpt2-124m", "qwen2-0.5b"] = "auto"
    """policy model: builtin:tiny-gpt2 (2 layers, 64 wide), gpt2-124m (GPT-2 small's shape) or qwen2-0.5b (Qwen2-0.5B's
    shape, 494M parameters), both randomly initialised; auto picks gpt2-124m on a GPU and tiny otherwise (DDPO always
    runs builtin:tiny-sd)"""
    seq_length: int = 128
    """tokens per sequence of the SFT / reward-model / DPO comparisons. At 128 they train on the built-in data as it
    is; longer, on rows cut from the dialogue lines to fill it: SFT texts of `seq_length` tokens (truncated to it on
    both sides), preference pairs whose prompt and answers take just under half of it each (none dropped by TRL)"""
    bf16: bool | None = None
    """run both sides in bf16 mixed precision (default: on a GPU)"""
    peak_tflops: float | None = None
    """the device's peak dense bf16 TFLOP/s, for MFU (default: looked up for H100 / H200 / A100; otherwise only the
    achieved TFLOP/s is reported)"""
    inverse_cdf_sampling: bool = True
    """our side samples by inverse CDF, the scripts' default (`common.InverseCDFSampler`); --no-inverse-cdf-sampling
    gives ppo.py, grpo.py, rloo.py and the rollout measurement HF's sampler, the one TRL uses"""
    fast_generation: bool = True
    """on CUDA our side samples with the scripts' default compiled static-cache decoding (`common.FastGenerator`);
    --no-fast-generation: HF `generate` (benchmarks/generation.py compares the ways of sampling alone)"""
    memory: bool = True
    """also measure peak memory (one fresh process per implementation and variant)"""
    write: str | None = None
    """write the results as markdown to this file"""
    worker: str | None = None
    """internal: run one comparison (JSON spec) and print its results"""


# ---------------------------------------------------------------- the worker: one comparison in a process of its own


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save_random_model(name: str, folder: str) -> None:
    """`random_model(name)` and the built-in tokenizer saved to `folder`, for the GPU scripts (gpu_profile.sh and its kin)."""
    from common.loading import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    random_model(name, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def rollouts(spec, env, tmp) -> dict:
    """Generation only, 16 new tokens: tokens/s of ppo.py's rollout call and of TRL 0.8.6's generate."""
    import torch
    from transformers import AutoTokenizer
    from trl import AutoModelForCausalLMWithValueHead as TrlValueHead
    from trl import PPOConfig, PPOTrainer

    from common.fast_paths import FastGenerator, sampling_kwargs
    from common.loading import load_tokenizer
    from common.models import AutoModelForCausalLMWithValueHead

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours_model = AutoModelForCausalLMWithValueHead.from_pretrained(env["model"]).eval().to(device)
    # both sides under the same autocast (TRL 0.8.6 generates outside its accelerator's autocast)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=spec["bf16"])
    ours_tok = load_tokenizer(env["model"], padding_side="left")
    trl_tok = AutoTokenizer.from_pretrained(env["model"])
    trl_tok.pad_token = trl_tok.eos_token
    results = {}
    for batch in spec["rollout_batch_sizes"]:  # a generator per batch size (it would run a smaller batch in a larger cache)
        fast = (
            FastGenerator(ours_model.pretrained_model)
            if device == "cuda" and spec["fast_generation"] and spec["inverse_cdf"]
            else None
        )
        trainer = PPOTrainer(
            PPOConfig(
                batch_size=batch,
                mini_batch_size=batch,
                exp_name="bench",
                accelerator_kwargs=dict(mixed_precision="bf16" if spec["bf16"] else "no"),
            ),
            TrlValueHead.from_pretrained(env["model"]),
            tokenizer=trl_tok,
        )
        times = {"ours": [], "trl": []}
        for r in range(spec["rollout_rounds"] + 2):
            queries = [q.to(device) for q in ppo_queries(env, batch, r)]
            padded = ours_tok.pad({"input_ids": [q.tolist() for q in queries]}, return_tensors="pt").to(device)
            calls = {
                "ours": lambda: (
                    ours_model.generate(
                        **padded,
                        max_new_tokens=16,
                        min_new_tokens=16,
                        **sampling_kwargs(1.0, 0, 1.0, spec["inverse_cdf"]),
                        pad_token_id=ours_tok.pad_token_id,
                        eos_token_id=ours_tok.eos_token_id,
                    )
                    if fast is None
                    else fast(padded["input_ids"], padded["attention_mask"], 16, None, ours_tok.pad_token_id)
                ),  # ppo.py's rollout on CUDA (no EOS: 16 tokens)
                "trl": lambda: trainer.generate(
                    queries,
                    batch_size=batch,
                    return_prompt=False,
                    min_new_tokens=16,
                    max_new_tokens=16,
                    top_k=0,
                    top_p=1.0,
                    do_sample=True,
                    pad_token_id=trl_tok.eos_token_id,
                ),
            }
            for impl in ("ours", "trl")[:: 1 if r % 2 == 0 else -1]:  # A B B A ...
                t0 = clock()
                with torch.no_grad(), autocast:
                    calls[impl]()
                if r > 1:  # the first two rounds warm up (compilation, CUDA-graph recording)
                    times[impl].append(clock() - t0)
        results[batch] = {k: batch * 16 / statistics.median(v) for k, v in times.items()}
    return results


def worker(spec: dict) -> dict:
    """One comparison, in this process: interleaved timing rounds, or one memory run (spec["memory"])."""
    import torch

    torch.manual_seed(0)
    import trl  # noqa: F401 - both libraries are imported before any measurement
    from peft import LoraConfig  # noqa: F401

    import common  # noqa: F401
    from common.fast_paths import keep_freed_memory

    if not torch.cuda.is_available():  # what our scripts' start_run does, here for both sides from the start
        keep_freed_memory()
    ours, theirs = RUNS[spec["algo"]]
    with tempfile.TemporaryDirectory() as tmp:
        env = setup(spec, tmp)
        if spec.get("memory"):
            impl, flags = spec["memory"]
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            gc.collect()
            before = rss_mb()
            (ours if impl == "ours" else theirs)(spec, env, tmp, "memory", flags)
            return dict(peak_mb=torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb() - before)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(env["model"])
        with torch.device("meta"):  # the layers' weight matrices, counted without allocating them
            shapes = AutoModelForCausalLM.from_config(config)
        block_weights = sum(
            p.numel()
            for n, p in shapes.named_parameters()
            if p.dim() == 2 and not any(k in n for k in ("wte", "wpe", "embed_tokens", "lm_head"))
        )
        results = {
            "ours": {},
            "trl": {},
            "dims": [config.num_hidden_layers, config.hidden_size, config.vocab_size, block_weights],
        }
        for r in range(spec["rounds"]):  # A B B A ...: neither side always runs first
            for impl, fn in (("ours", ours), ("trl", theirs))[:: 1 if r % 2 == 0 else -1]:
                out = fn(spec, env, tmp, f"{impl}_{r}")
                for key, values in out.items():
                    results[impl].setdefault(key, []).extend(values[spec["warmup"] :])
        if spec["algo"] == "ppo" and spec.get("rollout_batch_sizes"):
            results["rollouts"] = rollouts(spec, env, tmp)
        return results


# ---------------------------------------------------------------- the driver


def spawn(spec: dict) -> dict:
    path = [TRL_PATHS[PEER[spec["algo"]]], ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(path),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        ACCELERATE_MIXED_PRECISION="bf16" if spec["bf16"] else "no",
    )  # our scripts' Accelerator reads it
    if spec.get("memory"):  # glibc's default policy (any MALLOC_* variable turns keep_freed_memory off)
        env["MALLOC_MMAP_MAX_"] = "65536"
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True, text=True)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if proc.returncode or not marker:
        raise RuntimeError(f"benchmark worker {spec} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(marker[-1][len("BENCH_RESULT ") :])


def mean_tokens(algo: str, seq_length: int = 128) -> float:
    """Tokens per sample of the benchmark data (ours' tokenisation; both sides see the same texts)."""
    from common.loading import load_data, load_tokenizer

    tok = load_tokenizer("builtin:tiny-gpt2")
    if algo == "sft":
        return statistics.mean(min(seq_length, len(tok(t)["input_ids"]) + 1) for t in sft_texts(seq_length)["text"])
    if algo in ("rm", "dpo"):  # chosen and rejected, each with its EOS
        d = preference_pairs(seq_length)
        return statistics.mean(
            len(tok(p + " " + c)["input_ids"]) + len(tok(p + " " + r)["input_ids"]) + 2
            for p, c, r in zip(d["prompt"], d["chosen"], d["rejected"])
        )
    if algo == "ddpo":  # images, not tokens
        return math.nan
    if algo in ONLINE:  # a completion: its prompt and 16 new tokens
        import reasoning_gym

        rows = reasoning_gym.create_dataset("chain_sum", size=512, seed=0, min_terms=2, max_terms=2, max_digits=1)
        return statistics.mean(len(tok(e["question"])["input_ids"]) for e in rows) + 16
    return statistics.mean(min(48, len(tok(p)["input_ids"])) for p in load_data("builtin:chatterbot-prompts")["prompt"]) + 16


def forward_flops(dims: list[int], context: float, head: bool = True) -> float:
    """Model FLOPs of one token's forward pass (PaLM's convention): 2 per weight of the layers' matrices (12 * width^2
    per layer for GPT-2) and of the vocabulary projection when the model has one, plus 4 * layers * width * context for
    attention."""
    layers, width, vocab, block_weights = dims
    return 2 * (block_weights + (width * vocab if head else 0)) + 4 * layers * width * context


def step_flops(algo: str, batch: int, tokens: float, dims: list[int]) -> dict[str, float]:
    """Model FLOPs of one step's useful tokens, per phase (backward = 2x forward)."""
    if algo == "sft":
        return {"step": batch * tokens * 3 * forward_flops(dims, tokens)}
    if algo == "rm":  # chosen and rejected, tokens per pair; a score head, no vocabulary projection
        return {"step": batch * tokens * 3 * forward_flops(dims, tokens / 2, head=False)}
    if algo == "dpo":  # policy forward + backward, reference forward, on chosen and rejected
        return {"step": batch * tokens * 4 * forward_flops(dims, tokens / 2)}
    if algo == "ppo":  # generation; policy (with values) and reference forwards; 4 epochs of forward + backward
        per_token = forward_flops(dims, tokens)
        phases = {"generation": batch * tokens * per_token, "forward_backward": batch * tokens * (2 + 4 * 3) * per_token}
        return dict(phases, step=sum(phases.values()))
    return {}  # DDPO: UNet FLOPs are not counted


def peak_tflops(args: Args) -> float | None:
    import torch

    if args.peak_tflops or not torch.cuda.is_available():
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def main(args: Args) -> None:
    missing = [p for p in {TRL_PATHS[PEER[a]] for a in args.algos} if not os.path.isdir(p)]
    if missing:
        sys.exit(f"TRL is not installed in {missing}: run `bash benchmarks/setup.sh` first.")
    import torch

    cuda = torch.cuda.is_available()
    args.model = args.model if args.model != "auto" else "gpt2-124m" if cuda else "tiny"
    args.bf16 = cuda if args.bf16 is None else args.bf16
    peak = peak_tflops(args)
    base = dict(
        rounds=args.rounds,
        warmup=args.warmup,
        steps=args.steps,
        model=args.model,
        bf16=args.bf16,
        inverse_cdf=args.inverse_cdf_sampling,
        fast_generation=args.fast_generation,
        seq_length=args.seq_length,
    )
    samples = {"sft": 16, "rm": 16, "dpo": 8, "ddpo": 16, "grpo": 128, "rloo": 128}  # grpo / rloo: completions
    rows, extras = [], []
    for algo in args.algos:
        configs = [dict(batch_size=b) for b in args.ppo_batch_sizes] if algo == "ppo" else [dict(batch_size=samples[algo])]
        for i, config in enumerate(configs):
            spec = dict(base, algo=algo, **config)
            if algo == "ppo" and i == 0:
                spec["rollout_batch_sizes"], spec["rollout_rounds"] = args.rollout_batch_sizes, args.rollout_rounds
            print(f"[bench] {algo} batch {config['batch_size']}: {args.rounds} rounds of ours / TRL ...", flush=True)
            result = spawn(spec)
            ours, trl = (statistics.median(result[k]["step"]) for k in ("ours", "trl"))
            batch, tokens = config["batch_size"], mean_tokens(algo, args.seq_length)
            row = dict(
                algo=algo,
                batch=batch,
                ours=ours,
                trl=trl,
                ratio=ours / trl,
                tokens=tokens,
                target=TARGET[algo][batch] if algo == "ppo" else TARGET[algo],
            )
            median = {k: {phase: statistics.median(v) for phase, v in result[k].items()} for k in ("ours", "trl")}
            row["tflops"] = {
                phase: {k: flops / median[k][phase] / 1e12 for k in ("ours", "trl")}
                for phase, flops in step_flops(algo, batch, tokens, result["dims"]).items()
            }
            row["peak"] = peak
            if algo == "ppo":  # phase shares of the median step
                row["share"] = {k: m["generation"] / m["step"] for k, m in median.items()}
                row["share_fb"] = {k: m["forward_backward"] / m["step"] for k, m in median.items()}
            if "rollouts" in result:
                extras.append(
                    (f"rollout tokens/s (16 new tokens, median of {args.rollout_rounds} A/B rounds)", result["rollouts"])
                )
            if args.memory:

                def peak_mb(impl, flags=()):
                    return spawn(dict(spec, rollout_batch_sizes=None, rounds=1, memory=[impl, list(flags)]))["peak_mb"]

                row["memory"] = {impl: peak_mb(impl) for impl in ("ours", "trl")}
                for flags, trl_has_it in MEMORY_VARIANTS.get(algo, []) if i == 0 else []:
                    extras.append(
                        (
                            f"{algo} peak memory with {' '.join(flags)}",
                            {"ours": peak_mb("ours", flags), "trl": peak_mb("trl", flags) if trl_has_it else None},
                        )
                    )
                    print(f"[bench] {extras[-1]}", flush=True)
            rows.append(row)
            print(format_row(row), flush=True)
    text = report(args, rows, extras)
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)


MODEL_TEXT = {
    "tiny": "builtin:tiny-gpt2 (2 layers, 64 wide, the built-in models' 6818-token vocabulary)",
    "gpt2-124m": "a randomly initialised GPT-2-small-sized model (12 layers, 768 wide, 124M parameters)",
    "qwen2-0.5b": "a randomly initialised Qwen2-0.5B-shaped model (24 layers, 896 wide, 14 / 2 heads, "
    "151936-token vocabulary, 494M parameters)",
}


def format_row(row: dict) -> str:
    def per_s(t):
        return row["batch"] / t

    mem = row.get("memory", {})
    target = "n/a" if row["target"] is None else f"<= {row['target']} ({'met' if row['ratio'] <= row['target'] else 'missed'})"
    cells = [
        row["algo"],
        row["batch"],
        f"{row['ours']:.3f}",
        f"{row['trl']:.3f}",
        f"{row['ratio']:.2f}",
        f"{per_s(row['ours']):.1f}",
        f"{per_s(row['trl']):.1f}",
        f"{per_s(row['ours']) * row['tokens']:.0f}",
        f"{per_s(row['trl']) * row['tokens']:.0f}",
        f"{mem.get('ours', float('nan')):.0f}",
        f"{mem.get('trl', float('nan')):.0f}",
        target,
    ]
    return "| " + " | ".join(map(str, cells)) + " |"


def report(args: Args, rows: list[dict], extras: list) -> str:
    import torch
    import transformers
    from records import machine

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else machine()
    device += f", `python`, {torch.get_num_threads()} threads"
    lines = [
        "# Benchmarks: this repository vs TRL",
        "",
        f"Date: {datetime.date.today()}. Machine: {device}, {platform.platform()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}.",
        "",
        f"Command: `python benchmarks/bench.py {' '.join(sys.argv[1:])}`",
        "",
        f"Model: {MODEL_TEXT[args.model]} saved to a folder, both sides loading it with from_pretrained; "
        f"{'bf16 mixed precision' if args.bf16 else 'fp32'}. {args.rounds} rounds of ours and TRL (A B B A) in one process "
        "per row; "
        f"{args.warmup} warm-up + {args.steps} timed steps per run; seconds per step are medians. SFT / reward model / "
        f"DPO at {args.seq_length} tokens per sequence. DDPO: builtin:tiny-sd "
        f"saved to a folder, one step = one epoch (sample 16 images, then train on them); samples are images. TRL's "
        f"SFT / reward / DPO trainers run with gradient_checkpointing=False (TRL 1.x turns it on by default; ours only "
        f"with --gradient-checkpointing, measured for memory below), so both sides do the same work. GRPO / RLOO: one "
        f"optimizer step per generation batch of 128 completions (GRPO 16 prompts x 8, dapo loss, beta 0; RLOO 64 x 2, "
        f"beta 0.05 with a reference model), 16 new tokens, micro-batches of 32, an exact-match reward, no vLLM; a "
        f"sample is a completion.",
        "",
        "| algorithm | batch | ours s/step | TRL s/step | ours/TRL | ours samples/s | TRL samples/s | ours tokens/s "
        "| TRL tokens/s | ours peak MB | TRL peak MB | target |",
        "|-|-|-|-|-|-|-|-|-|-|-|-|",
        *[format_row(r) for r in rows],
        "",
    ]
    for row in rows:
        if "share" in row:
            lines.append(
                f"- PPO batch {row['batch']}: generation takes {row['share']['ours']:.0%} of our step and "
                f"{row['share']['trl']:.0%} of TRL's; forward/backward passes {row['share_fb']['ours']:.0%} "
                f"and {row['share_fb']['trl']:.0%}."
            )
    for row in rows:
        for phase, tflops in row["tflops"].items():

            def mfu(v, peak=row["peak"]):
                return "" if peak is None else f" (MFU {v / peak:.1%})"

            lines.append(
                f"- {row['algo']} batch {row['batch']}, {phase.replace('_', '/')}: ours {tflops['ours']:.3g} "
                f"TFLOP/s{mfu(tflops['ours'])}, TRL {tflops['trl']:.3g} TFLOP/s{mfu(tflops['trl'])}"
            )
    for name, values in extras:
        if "rollout" in name:
            lines.append(
                f"- {name}: " + "; ".join(f"batch {b}: ours {v['ours']:.0f}, TRL {v['trl']:.0f}" for b, v in values.items())
            )
        else:
            trl = "n/a" if values["trl"] is None else f"{values['trl']:.0f} MB"
            lines.append(f"- {name}: ours {values['ours']:.0f} MB, TRL {trl}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from common.cli import cli  # tyro.cli with --help text that flows

    args = cli(Args)
    if args.worker:
        print("BENCH_RESULT " + json.dumps(worker(json.loads(args.worker))))
    else:
        main(args)
