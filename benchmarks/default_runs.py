"""Every script's offline default run (`python sft.py`, `python grpo.py`, ...) over seeds, each in a folder of its own:
the script's held-out metric at its first and last evaluation, read off its summary line, and the wall time. For
grpo.py and rloo.py (SmolLM2-135M-Instruct on reasoning-gym's one-digit chain_sum, 64 held-out problems that never
occur in training) also the training reward's first and last tenth, then the initial and the saved model on the
run's held-out problems, 4 sampled replies each: greedy and sampled accuracy, distinct answers, reply length, and the
saved model's KL to the initial one. Writes benchmarks/RESULTS-default-runs.json, from which docs/grpo.md and
docs/rloo.md render their tables and docs/getting-started.md the table of every script (docs/build_assets.py).

    python benchmarks/default_runs.py                  # grpo and rloo, seeds 1 2 3 (about an hour on 2 cores)
    python benchmarks/default_runs.py --scripts sft reward_modeling dpo kto ppo ddpo gkd ilql
    python benchmarks/default_runs.py --scripts grpo --seeds 1
    python benchmarks/default_runs.py --final-only     # only evaluate the saved models of the runs in the JSON
    python benchmarks/default_runs.py --check --scripts grpo --seeds 1   # rerun, compare the line, write nothing
"""

import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import tyro
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-default-runs.json")
sys.path.insert(0, ROOT)

from records import machine, run_script, scalars, untimed  # noqa: E402

from common.core import logprobs_from_logits  # noqa: E402
from common.fast_paths import sampling_kwargs  # noqa: E402
from common.loading import load_pretrained, load_tokenizer  # noqa: E402
from common.rewards import distinct_answers, load_task, verifier  # noqa: E402

# Each script's held-out metric, read off its summary line: what it is, the pattern of its "first -> last" values, and
# whether higher is better
METRICS = {
    "sft": ("held-out loss", r"eval loss ([-\d.]+) -> ([-\d.]+)", False),
    "reward_modeling": ("held-out pair accuracy", r"eval accuracy ([-\d.]+) -> ([-\d.]+)", True),
    "dpo": ("held-out reward margin", r"margin ([-\d.]+) -> ([-\d.]+)", True),
    "kto": ("held-out reward margin", r"eval reward margin ([-\d.]+) -> ([-\d.]+)", True),
    "ppo": ("held-out reward (the reward model)", r"eval reward ([-\d.]+) -> ([-\d.]+)", True),
    "grpo": ("held-out accuracy (one sample each)", r"eval reward ([-\d.]+) -> ([-\d.]+)", True),
    "rloo": ("held-out accuracy (one sample each)", r"eval reward ([-\d.]+) -> ([-\d.]+)", True),
    "gkd": ("held-out KL to the teacher per token", r"held-out KL to the teacher per token ([-\d.]+) -> ([-\d.]+)", False),
    "ilql": ("held-out reward, beta 4", r"beta=4 ([-\d.]+) -> ([-\d.]+)", True),
    "ddpo": ("held-out reward (JPEG compressibility)", r"eval reward ([-\d.]+) -> ([-\d.]+)", True),
}
VERIFIED = ("grpo", "rloo")  # their saved models are evaluated again on the held-out problems (final)


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: list(VERIFIED))
    """which scripts to run, each with its defaults: any of sft, reward_modeling, dpo, kto, ppo, grpo, rloo, gkd, ilql,
    ddpo"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """--seed of each run"""
    out: str = "outputs/default-runs"
    """where the runs write their models and logs (replaced)"""
    final_only: bool = False
    """only evaluate the saved models of the runs already in the JSON (those without an evaluation)"""
    samples: int = 4
    """sampled replies per held-out problem in the evaluation of the saved models"""
    check: bool = False
    """rerun each run and compare its summary line with the record (but for the time), writing nothing: exit status 1
    when one differs (on the CPU kind, thread count and torch the record names)"""


def check(args: Args, results: dict) -> None:
    """--check: each run again in a fresh folder, its summary line against the recorded one."""
    import tempfile

    here, differ = [machine(), torch.get_num_threads(), torch.__version__], []
    for key in (f"{script}-{seed}" for script in args.scripts for seed in args.seeds):
        run = results["runs"].get(key)
        if run is None or [run.get(k, results.get(k)) for k in ("machine", "threads", "torch")] != here:
            print(f"{key}: not checked (no record, or recorded on another CPU kind, thread count or torch)")
            continue
        with tempfile.TemporaryDirectory(prefix=f"rlhf-{key}-") as folder:
            stdout, _ = run_script([*run["command"].split()[1:], "--output-dir", run["folder"]], folder)
        line = next(line for line in reversed(stdout.splitlines()) if re.search(METRICS[key.rsplit("-", 1)[0]][1], line))
        same = untimed(line) == untimed(run["summary"])
        differ += [] if same else [key]
        print(f"{key}: {'the recorded line' if same else 'differs'}\n  now:      {line}", flush=True)
    sys.exit(f"differs from the record: {' '.join(differ)}" if differ else 0)


def values(run_dir: str, tag: str) -> list[float]:
    return [v for _, v in scalars(run_dir, tag)]


@torch.no_grad()
def generate(model, tokenizer, rows: list[dict], n: int, max_new_tokens: int, greedy: bool = False):
    """n replies to each row's prompt (its `prompt_ids`), as text and token ids up to the first EOS: HF `generate` at
    temperature 1 by the scripts' own sampler, or greedy; seeded, so the start and the end see the same draws."""
    torch.manual_seed(0)
    prompts, texts, ids = [r["prompt_ids"] for r in rows for _ in range(n)], [], []
    sampling = dict(do_sample=False) if greedy else sampling_kwargs(1.0, 0, 1.0)
    for i in range(0, len(prompts), 128):
        batch = tokenizer.pad({"input_ids": prompts[i : i + 128]}, padding_side="left", return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
        for row in out[:, batch["input_ids"].shape[1] :]:
            ended = (row == tokenizer.eos_token_id).nonzero()
            row = row[: ended[0, 0] + 1] if len(ended) else row
            ids.append(row.tolist())
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts, ids


@torch.no_grad()
def kl_to(model, base, tokenizer, prompts: list[list[int]], replies: list[list[int]]) -> float:
    """The mean over replies of sum_t log pi(y_t) - log pi_0(y_t), on pi's own sampled replies: KL(pi || pi_0) in nats
    per reply (k1, unbiased)."""
    kls = []
    for i in range(0, len(replies), 64):
        rows = [p + c for p, c in zip(prompts[i : i + 64], replies[i : i + 64])]
        batch = tokenizer.pad({"input_ids": rows}, padding_side="left", return_tensors="pt")
        position_ids = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
        labels = batch["input_ids"][:, 1:]
        logps = [logprobs_from_logits(m(**batch, position_ids=position_ids).logits[:, :-1], labels) for m in (model, base)]
        reply = torch.zeros_like(labels, dtype=torch.bool)  # the reply's tokens: the last len(reply) positions
        for j, c in enumerate(replies[i : i + 64]):
            reply[j, labels.shape[1] - len(c) :] = True
        kls += ((logps[0] - logps[1]) * reply).sum(1).tolist()
    return sum(kls) / len(kls)


def final(script: str, folder: str, samples: int, flags: list[str]) -> dict:
    """The initial and the saved model of a run on its own held-out problems (the script's defaults with `flags`, as
    the run had them): greedy accuracy, the accuracy of `samples` sampled replies per problem, the distinct answers
    among them, their length in tokens, and (the saved model) the KL to the initial one. notebooks/grpo.ipynb and
    rloo.ipynb call it too."""
    args = tyro.cli(importlib.import_module(script).Args, args=flags)
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    rows = load_task(args, tokenizer, args.prompt_column, args.max_prompt_length)[1][: args.eval_samples]
    answers, entries = [r["answer"] for r in rows], [r["rg_entry"] for r in rows]
    base = load_pretrained(args.model_name, AutoModelForCausalLM).eval()
    trained = load_pretrained(os.path.join(ROOT, folder), AutoModelForCausalLM).eval()
    out = {}
    for name, model in (("start", base), ("end", trained)):
        greedy, _ = generate(model, tokenizer, rows, 1, args.max_completion_length, greedy=True)
        texts, ids = generate(model, tokenizer, rows, samples, args.max_completion_length)
        repeat = [i for i in range(len(rows)) for _ in range(samples)]
        out[name] = dict(
            greedy=sum(verifier(None, greedy, answers, rg_entry=entries)) / len(rows),
            sampled=sum(verifier(None, texts, [answers[i] for i in repeat], rg_entry=[entries[i] for i in repeat]))
            / len(texts),
            distinct=statistics.fmean(
                distinct_answers(texts[i * samples : (i + 1) * samples], True)[1] for i in range(len(rows))
            ),
            length=statistics.fmean(len(i) for i in ids),
        )
        if name == "end":
            out[name]["kl"] = kl_to(model, base, tokenizer, [rows[i]["prompt_ids"] for i in repeat], ids)
    return out | dict(samples=samples, problems=len(rows))


def train(script: str, seed: int, out: str) -> dict:
    """One default run: its summary line, its held-out metric first -> last, its wall time; for grpo and rloo their
    curves read back from the TensorBoard logs."""
    folder = os.path.join(out, f"{script}-{seed}")
    command = [sys.executable, f"{script}.py", "--seed", str(seed), "--output-dir", folder, "--overwrite"]
    command += ["--log-dir", os.path.join(folder + "-runs")]
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    seconds, pattern = time.time() - start, METRICS[script][1]
    summary = next(line for line in reversed(done.stdout.splitlines()) if re.search(pattern, line))
    run = dict(
        command=f"python {script}.py --seed {seed}",
        folder=folder,
        held_out=[float(x) for x in re.search(pattern, summary).groups()],
        seconds=seconds,
        summary=summary,
    )
    if script not in VERIFIED:
        return run
    run_dir = os.path.join(ROOT, folder + "-runs")
    rewards, evals = values(run_dir, "reward"), values(run_dir, "eval/reward")
    window = max(1, len(rewards) // 10)
    return run | dict(
        eval=[evals[0], evals[-1]],
        train=[sum(rewards[:window]) / window, sum(rewards[-window:]) / window],
        top_answer=[values(run_dir, "eval/top_answer_share")[i] for i in (0, -1)],
        kl=values(run_dir, "kl")[-1] if values(run_dir, "kl") else None,
    )


if __name__ == "__main__":
    args = tyro.cli(Args)
    unknown = sorted(set(args.scripts) - set(METRICS))
    if unknown:
        sys.exit(f"error: --scripts {' '.join(unknown)}: not one of {', '.join(METRICS)}")
    results = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {"runs": {}}
    if args.check:
        check(args, results)
    results["metrics"] = {script: [name, higher] for script, (name, _, higher) in METRICS.items()}
    for script in args.scripts:
        for seed in args.seeds:
            key = f"{script}-{seed}"
            if not args.final_only:
                # each run names its own machine (the record's fields name the runs recorded before runs did)
                kind = dict(machine=machine(), launcher="python", threads=torch.get_num_threads(), torch=torch.__version__)
                results["runs"][key] = train(script, seed, args.out) | kind
                print(f"{script} seed {seed}: {results['runs'][key]['summary']}", flush=True)
            run = results["runs"].get(key)
            if run is not None and script in VERIFIED and not ("final" in run and args.final_only):
                folder = run.get("folder", os.path.join(args.out, key))
                run["final"] = final(script, folder, args.samples, ["--seed", str(seed)])
                print(f"{key}: {run['final']}", flush=True)
            with open(RESULTS, "w") as f:
                json.dump(results, f, indent=1)
