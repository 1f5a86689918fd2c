"""Stale rollouts on the real model: grpo.py at the real-model recipe (builtin:smollm2-135m-instruct on reasoning-gym
chain_sum as chat prompts, 8 prompts x 4 completions of 32 tokens a update, 20 updates, learning rate 1e-5, beta 0; the
64 held-out problems of benchmarks/real_model.py, evaluated by grpo.py every 5 updates) with the rollout of update t
sampled by the weights of update t - k (--max-staleness k, the deterministic mode), over seeds:

- k = 0, 1 and 4, the sampler's drift corrected as TRL 1.16 does by default (the policy at the update's start
  recomputed, the rollout weighted by its sequence-level ratio to the sampler, zeroed outside [0, 3]: sequence_mask);
- k = 4 with no correction (--no-importance-sampling-correction), and with the ratio taken against the sampler itself
  (--old-logprobs sampler, TRL's AsyncGRPO);
- the asynchronous mode (--async-rollouts, k = 1) against the synchronous loop at equal updates: wall-clock;
- what skipping the old-log-prob forward saves (--old-logprobs sampler), where one is needed: two passes over each
  rollout (--num-iterations 2; with one optimizer step per rollout, the recipe's, pi_old is the training forward's own).

Each final model is then evaluated as benchmarks/real_model.py evaluates every method (its `evaluate`): greedy and
sampled accuracy on the 64 held-out problems, the KL to the initial model, the reply length and the distinct answers.

Writes benchmarks/RESULTS-offpolicy.json, RESULTS-offpolicy.md and RESULTS-offpolicy.png; resumable (what is in the
JSON is kept unless --rerun).

    python benchmarks/offpolicy.py                       # every run, seeds 1 2 3 (about 4 hours on 2 cores: 10-16 min a run)
    python benchmarks/offpolicy.py --report-only
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro
from records import machine, scalars

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-offpolicy.json")
RECIPE = (
    "--model-name builtin:smollm2-135m-instruct --dataset-name reasoning-gym:chain_sum --data-seed 1 "
    "--max-completion-length 32 --log-freq 10 --eval-samples 64 --batch-size 8 --num-generations 4 --mini-batch-size 8 "
    "--gradient-accumulation-steps 4 --total-prompts 160 --learning-rate 1e-5 --eval-freq 5"
).split()
RUNS = {  # name: (flags, seeds or None for every seed, what it is)
    "k0": ([], None, "on-policy (k = 0)"),
    "k1": (["--max-staleness", "1"], None, "k = 1, corrected (sequence_mask)"),
    "k4": (["--max-staleness", "4"], None, "k = 4, corrected (sequence_mask)"),
    "k4_none": (["--max-staleness", "4", "--no-importance-sampling-correction"], None, "k = 4, no correction"),
    "k4_sampler": (["--max-staleness", "4", "--old-logprobs", "sampler"], None, "k = 4, ratio to the sampler (AsyncGRPO)"),
    "k1_async": (["--max-staleness", "1", "--async-rollouts"], [1], "k = 1, asynchronous (a sampling thread)"),
    "k1_2it": (["--max-staleness", "1", "--num-iterations", "2"], None, "k = 1, two passes, pi_old recomputed"),
    "k1_2it_sampler": (
        ["--max-staleness", "1", "--num-iterations", "2", "--old-logprobs", "sampler"],
        None,
        "k = 1, two passes, pi_old = the sampler (no forward)",
    ),
}


@dataclass
class Args:
    runs: list[str] = field(default_factory=lambda: list(RUNS))
    """which runs: k0 k1 k4 k4_none k4_sampler k1_async k1_2it k1_2it_sampler"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """training seeds (the problems and the held-out evaluation stay fixed: --data-seed 1)"""
    out: str = "outputs/offpolicy"
    """where the runs write their models and logs"""
    rerun: bool = False
    """run again what the JSON already holds"""
    report_only: bool = False
    """only write the report and the plot from the JSON"""


def run(name: str, seed: int, out: str) -> dict:
    flags, _, _ = RUNS[name]
    folder = os.path.join(out, f"{name}_{seed}")
    command = ["python", "grpo.py", *RECIPE, "--seed", str(seed), *flags, "--output-dir", folder, "--overwrite"]
    command += ["--log-dir", folder + "_runs"]
    start = time.time()
    os.makedirs(os.path.join(ROOT, out), exist_ok=True)
    with open(os.path.join(ROOT, folder + ".log"), "w+") as log:  # a file, not a pipe: a long log never blocks the run
        with subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) as child:
            loads, sampled = [], 0.0
            while child.poll() is None:  # the machine's 1-minute load, every 30 s: was the run timed alone?
                if time.time() - sampled >= 30:
                    loads.append(os.getloadavg()[0])
                    sampled = time.time()
                time.sleep(1)
        if child.returncode:
            log.seek(0)
            sys.exit(f"{' '.join(command)} failed (its log: {folder}.log):\n{log.read()[-4000:]}")
    wall = time.time() - start
    logs = os.path.join(ROOT, folder + "_runs")  # its TensorBoard scalars
    curve = scalars(logs, "eval/reward")
    steps = [v for _, v in scalars(logs, "time/step")]
    result = dict(
        command=" ".join(command[:-4]),
        wall_s=wall,
        step_s=statistics.median(steps),
        load=statistics.fmean(loads[2:] or loads),
        curve=curve,
        accuracy=curve[-1][1],
        kl=None,
        length=scalars(logs, "eval/completion_length")[-1][1],
        top_answer_share=scalars(logs, "eval/top_answer_share")[-1][1],
        train_reward=[v for _, v in scalars(logs, "reward")],
        machine=machine(),
        final=final(folder),
    )
    for tag in ("staleness/mean", "importance_sampling/ratio_mean", "importance_sampling/corrected_fraction",
                "importance_sampling/ratio_min", "importance_sampling/ratio_max", "staleness/dropped",
                "time/waited_for_rollouts", "time/generate", "time/logprobs", "clip_ratio/region_mean"):  # fmt: skip
        values = [v for _, v in scalars(logs, tag)]
        if values:
            result[tag] = values
    return result


FINAL = ("greedy", "sampled", "kl", "length", "distinct")
# A run's own threads make a mean 1-minute load of about 2 on 2 cores (2.0-2.3 measured alone; 4 with --async-rollouts:
# the sampling thread's and the trainer's); a run above this shared the machine with other work (one that shared 7 of
# its 14 minutes with the fast test tier: 2.6), and its times are not shown
QUIET = 2.5


def timed(rows: list[dict]) -> list[dict]:
    """The runs timed alone on the machine (records without a load are the first ones, timed alone); a run whose wall
    time is over twice its updates' was paused or starved on the way, whatever its load."""
    return [
        r
        for r in rows
        if r.get("load", 0) <= QUIET + 2 * ("--async-rollouts" in r["command"])
        and r["wall_s"] <= 2 * len(r["train_reward"]) * r["step_s"]
    ]


def spread(values: list[float], digits: int) -> str:
    """mean ± sd over the seeds; the one value where there is one seed."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def final(folder: str) -> dict:
    """The saved model evaluated as benchmarks/real_model.py evaluates every method (2 sampled replies per problem)."""
    sys.path.insert(0, HERE)
    from real_model import evaluate
    from transformers.utils import logging

    logging.disable_progress_bar()  # no "Loading weights" bar between the runs' lines
    return evaluate(os.path.join(ROOT, folder), samples=2)


def runs_of(results: dict, name: str) -> list[dict]:
    """The seeds' runs of RUNS[name] (the keys are name_seed)."""
    return [run for key, run in results["runs"].items() if key.rsplit("_", 1)[0] == name]


def table(results: dict) -> list[str]:
    """The runs' table: each row's flags, grpo.py's held-out accuracy in training, its speed, and the final model's
    evaluation (mean ± sd over the seeds)."""
    lines = [
        "| run | flags | seeds | held-out accuracy in training, start -> end (mean ± sd [min, max]) | "
        "median s/update (runs timed alone) | wall (mean of those) | greedy | sampled | KL to the start | "
        "reply tokens | distinct answers (of 2) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (flags, _, label) in RUNS.items():
        rows = runs_of(results, name)
        if not rows:
            continue
        ends = [r["accuracy"] for r in rows]
        start = statistics.fmean(r["curve"][0][1] for r in rows)
        end = spread(ends, 2) + (f" [{min(ends):.2f}, {max(ends):.2f}]" if len(ends) > 1 else "")
        alone = timed(rows)
        speed = (
            f"{statistics.median(r['step_s'] for r in alone):.1f} ({len(alone)}) | "
            f"{statistics.fmean(r['wall_s'] for r in alone) / 60:.1f} min"
            if alone
            else "- | -"
        )
        lines.append(
            f"| {label} | `{' '.join(flags) or '-'}` | {len(rows)} | {start:.2f} -> {end} | {speed} | "
            + " | ".join(spread([r["final"][k] for r in rows], 1 if k == "length" else 2) for k in FINAL)
            + " |"
        )
    return lines


def reading(results: dict) -> list[str]:
    """Each row's final held-out accuracy against on-policy's, and k = 4's correction against none, set against the
    noise: two standard errors of the difference of the two rows' means, from the seeds' own spread where both rows
    have two seeds or more (it holds the evaluation's noise too), and never below the evaluation's alone, 2 sqrt(p (1 -
    p) / 64 (1 / n1 + 1 / n2)) at the pooled accuracy p of n1 and n2 64-problem evaluations."""
    lines = []

    def compare(name: str, against: str) -> None:
        ours, theirs = ([r["accuracy"] for r in runs_of(results, n)] for n in (name, against))
        if not ours or not theirs:
            return
        p, difference = statistics.fmean(ours + theirs), statistics.fmean(ours) - statistics.fmean(theirs)
        noise, source = 2 * math.sqrt(p * (1 - p) / 64 * (1 / len(ours) + 1 / len(theirs))), "the evaluation's"
        if min(len(ours), len(theirs)) >= 2:
            seeds = 2 * math.sqrt(statistics.variance(ours) / len(ours) + statistics.variance(theirs) / len(theirs))
            noise, source = max((seeds, "the seeds'"), (noise, source))
        verdict = "inside" if abs(difference) <= noise else "outside"
        lines.append(
            f"- {RUNS[name][2]} against {RUNS[against][2]}: {statistics.fmean(ours):.2f} against "
            f"{statistics.fmean(theirs):.2f} ({len(ours)} and {len(theirs)} seeds), {difference:+.2f}: {verdict} the "
            f"noise (two standard errors, {source}: {noise:.2f})"
        )

    for name in ("k1", "k4", "k4_none", "k4_sampler"):
        compare(name, "k0")
    compare("k4", "k4_none")
    compare("k4_sampler", "k4_none")
    compare("k1_2it_sampler", "k1_2it")
    return lines


def report(results: dict, path: str = os.path.join(HERE, "RESULTS-offpolicy.md")) -> None:
    """RESULTS-offpolicy.md (at `path`) and its PNG beside it, from the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "# Stale rollouts on the real model",
        "",
        f"`python benchmarks/offpolicy.py` ({results['machine']}, `python`, torch's default threads). The recipe: `python "
        f"grpo.py {' '.join(RECIPE)} --seed N` plus each row's flags; held-out accuracy is grpo.py's own evaluation of "
        "the 64 held-out problems (one sampled reply each, the same seed at every evaluation).",
        "",
        "The last columns evaluate each final model as `benchmarks/real_model.py` does (greedy, and 2 sampled replies "
        "per held-out problem; KL to the initial model in nats per reply, on the model's own replies); mean ± sd over "
        "the seeds. Times come only from runs that had the machine to themselves (a mean 1-minute load of at most "
        f"{QUIET}, {QUIET + 2} with --async-rollouts, and a wall time at most twice its updates'); the accuracy "
        "columns do not depend on it (the deterministic mode samples the same tokens).",
        "",
    ]
    lines += table(results)
    lines += ["", "## What the runs show", "", *reading(results)]
    lines += ["", "## Importance ratios of the stale rollouts", ""]
    for name in ("k1", "k4", "k4_none"):
        rows = runs_of(results, name)
        if rows and "importance_sampling/ratio_mean" in rows[0]:
            means = [v for r in rows for v in r["importance_sampling/ratio_mean"]]
            low = min(v for r in rows for v in r["importance_sampling/ratio_min"])
            high = max(v for r in rows for v in r["importance_sampling/ratio_max"])
            zeroed = statistics.fmean(v for r in rows for v in r["importance_sampling/corrected_fraction"])
            lines.append(
                f"- {RUNS[name][2]}: sequence ratio pi_old / pi_sampler mean {statistics.fmean(means):.3f} over the "
                f"updates (range {low:.3g} to {high:.3g}); {zeroed:.1%} of the sequences zeroed by the mask on average"
            )
    clipped = {  # the share of tokens the clip acted on, mean over the updates and the seeds
        name: statistics.fmean(v for r in rows for v in r["clip_ratio/region_mean"])
        for name in RUNS
        if (rows := runs_of(results, name)) and all("clip_ratio/region_mean" in r for r in rows)
    }
    if clipped:
        acting = [f"{RUNS[name][2]} {share:.1%}" for name, share in clipped.items() if share > 0]
        idle = [RUNS[name][2] for name, share in clipped.items() if share == 0]
        lines.append(
            f"- Tokens the clip acted on (`clip_ratio/region_mean`, mean over the updates and seeds): {'; '.join(acting)}"
            + (
                f"; none in {', '.join(idle)}: with one optimizer step per rollout the ratio to a recomputed pi_old "
                "is exactly 1, so only a ratio to the sampler or a second pass meets the clip"
                if idle
                else ""
            )
        )
    sync, asynchronous = results["runs"].get("k0_1"), results["runs"].get("k1_async_1")
    if sync and asynchronous:
        dropped = asynchronous.get("staleness/dropped", [0])[-1]
        lines += [
            "",
            "## The asynchronous mode's wall-clock",
            "",
            f"Seed 1, 20 updates each, both timed alone: the synchronous loop (k = 0) took {sync['wall_s'] / 60:.1f} "
            f"min, the asynchronous one (k = 1, a sampling thread beside the trainer) {asynchronous['wall_s'] / 60:.1f} "
            f"min ({asynchronous['wall_s'] / sync['wall_s'] - 1:+.0%}). Its median update took "
            f"{asynchronous['step_s']:.1f} s against {sync['step_s']:.1f} s: it no longer includes the sampling "
            f"({statistics.median(sync['time/generate']):.1f} s of the synchronous update), but the sampling thread "
            f"runs on the same 2 cores and slows the training passes; and of the {20 + dropped:.0f} rollouts it "
            f"sampled {dropped:.0f} were older than the bound when the trainer came to them and were dropped: on a "
            "CPU the asynchronous mode spends more than it saves. The trainer waited "
            f"{sum(asynchronous.get('time/waited_for_rollouts', [0])[-1:]):.0f} s for rollouts in all. On a GPU, "
            "where sampling and training would overlap, it has not been measured.",
        ]
    recompute, sampler = results["runs"].get("k1_2it_1"), results["runs"].get("k1_2it_sampler_1")
    if recompute and "time/logprobs" in recompute:
        forward, alone = statistics.median(recompute["time/logprobs"]), bool(timed([recompute]))
        lines += [
            "",
            "## The old-log-prob forward",
            "",
            "With one optimizer step per rollout (the recipe) pi_old is the training forward's own, detached, and no "
            "forward is spent on it. With two passes over each rollout (`--num-iterations 2`, k = 1, seed 1) it is "
            "recomputed at each update's start, a forward over the update's 32 completions without a gradient: "
            f"{forward:.1f} s per update (median of grpo.py's `time/logprobs`), {forward / recompute['step_s']:.0%} of "
            f"its {recompute['step_s']:.1f} s update{'' if alone else ' (the run shared the machine)'}. "
            "`--old-logprobs sampler` takes pi_old from the sampler's own log-probs, kept from the decoding, and skips it.",
        ]
        if sampler and alone and timed([sampler]):
            lines[-1] += (
                f" The same run with `--old-logprobs sampler`: {sampler['step_s']:.1f} s per update "
                f"({sampler['step_s'] - recompute['step_s']:+.1f} s; medians of one run each, both timed alone)."
            )
        ours, theirs = runs_of(results, "k1_2it_sampler"), runs_of(results, "k1_2it")
        if ours and theirs:  # where the two differ beyond the speed: how far each moved from the start
            kl = [[r["final"]["kl"] for r in rows] for rows in (theirs, ours)]
            lines[-1] += (
                f" KL to the start of the final models: {spread(kl[0], 2)} recomputed against {spread(kl[1], 2)} "
                f"with the sampler's ({len(kl[0])} and {len(kl[1])} seeds)."
            )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, (_, _, label) in RUNS.items():
        rows = runs_of(results, name)
        if not rows or name in ("k1_async", "k1_2it", "k1_2it_sampler"):
            continue
        steps = [u for u, _ in rows[0]["curve"]]
        mean = [statistics.fmean(r["curve"][i][1] for r in rows) for i in range(len(steps))]
        axes[0].plot(steps, mean, marker="o", label=label)
        alone = timed(rows)
        if alone:
            seconds = [statistics.fmean(r["step_s"] for r in alone) * u / 60 for u in steps]
            axes[1].plot(seconds, mean, marker="o", label=label)
    axes[0].set(xlabel="update", ylabel="held-out accuracy (sampled)", title="against updates")
    axes[1].set(xlabel="minutes of training (median s/update x updates)", title="against wall-clock")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.splitext(path)[0] + ".png", dpi=100)


if __name__ == "__main__":
    args = tyro.cli(Args)
    results = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {"runs": {}}
    results["machine"] = results.get("machine", machine())
    for name in args.runs if not args.report_only else ():
        for seed in RUNS[name][1] or args.seeds:
            key = f"{name}_{seed}"
            if key in results["runs"] and not args.rerun:
                continue
            results["runs"][key] = run(name, seed, args.out)
            print(
                f"{key}: held-out {results['runs'][key]['accuracy']:.3f}, {results['runs'][key]['wall_s'] / 60:.1f} min",
                flush=True,
            )
            with open(RESULTS, "w") as f:
                json.dump(results, f, indent=1)
    report(results)
