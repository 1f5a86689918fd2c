"""Recorded runs as data: each entry of RUNS is a few command lines run in a fresh folder (once per seed or variant),
what to keep of each, the results file it writes and the page that renders it (docs/build_assets.py). One runner for
them all; a record's "command" names the entry that regenerates it (tests/test_layout.py checks each against RUNS).

    python benchmarks/runs.py --list
    python benchmarks/runs.py kto-default                          # every run of the entry, one after another
    python benchmarks/runs.py default-lines --only sft dpo         # some runs; the others keep their recorded values
    python benchmarks/runs.py default-lines --check --only ddpo    # rerun, compare the line with the record, write nothing

`--check` reruns a run on the CPU kind, thread count and torch that the record names and compares the line it ends on
(but for the time): exit status 1 when one differs. It is the test of the lines the suite has no room to rerun.

What a command line cannot measure (speed side by side with TRL, profiles, the first run's memory, the saved models
of grpo.py's and rloo.py's default runs evaluated again) has a script of its own beside this file.
"""

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from records import header, machine, median, run_script, scalars, untimed  # noqa: E402

PPO_EVAL = ("reward_mean", "reward_std", "vader_sentiment", "distinct_2", "top_token_share")
KTO_EVAL = ("rewards/margins", "rewards/chosen", "rewards/rejected", "kl", "logps/chosen", "logps/rejected", "loss")
KTO_EVAL += ("samples/kl", "samples/length", "samples/distinct")
GKD_EVAL = ("accuracy", "kl_to_teacher", "completion_length", "top_answer_share")
SMOL = "builtin:smollm2-135m-instruct"
PIPELINE_STAGES = {"sft": "sft: ", "reward_model": "reward model: ", "ppo": "ppo: ", "dpo": "dpo: ", "kto": "kto: "}


def series(logs: str, tag: str) -> list[float]:
    return [v for _, v in scalars(logs, tag)]


def line_of(lines: list[str], prefix: str) -> str | None:
    return next((line for line in lines if line.startswith(prefix) and "it/s]" not in line), None)  # not a bar


def health(lines: list[str]) -> dict:
    """ppo.py's health line and the warning on the line after it (None if there is none)."""
    found = line_of(lines, "health:")
    after = lines[lines.index(found) + 1 :]
    return {"health": found, "warning": after[0] if after and after[0].startswith("warning:") else None}


# what a run keeps, by name: each a function of (the entry's argument, the run's stdout lines, its log folder, its
# working folder), returning the fields it adds to the run's record
KEEP = {
    "line": lambda prefix, lines, logs, folder: {"line": line_of(lines, prefix)},
    "ends": lambda tags, lines, logs, folder: {  # each eval/ tag at the first and the last evaluation
        "first": {t: series(logs, f"eval/{t}")[0] for t in tags},
        "last": {t: series(logs, f"eval/{t}")[-1] for t in tags},
    },
    "evaluations": lambda tag, lines, logs, folder: {"evaluations": len(series(logs, tag))},
    "last_kl": lambda tag, lines, logs, folder: {"last_kl": series(logs, tag)[-1]},  # the last update's
    "step_s": lambda tag, lines, logs, folder: {"step_s": median(series(logs, tag))},
    "eval": lambda tags, lines, logs, folder: {"eval": {t: series(logs, f"eval/{t}") for t in tags}},
    "teacher_accuracy": lambda tag, lines, logs, folder: {"teacher_accuracy": series(logs, tag)[0]},
    "health": lambda _, lines, logs, folder: health(lines),
    "pipeline": lambda path, lines, logs, folder: pipeline(os.path.join(folder, path), lines),
}


def pipeline(path: str, lines: list[str]) -> dict:
    """pipeline.py's results.json (every policy on the held-out prompts, each stage's seconds) and its stages' lines."""
    with open(path) as f:
        results = json.load(f)
    stage_lines = {name: line_of(lines, prefix) for name, prefix in PIPELINE_STAGES.items()}
    return {"policies": results["policies"], "stage_seconds": results["stage_seconds"], "stage_lines": stage_lines} | {
        "heldout_prompts": len(results["heldout_prompts"])
    }


@dataclass
class Entry:
    record: str  # benchmarks/RESULTS-{record}.json
    page: str  # the page that renders it
    runs: dict[str, str]  # run name -> its command line, run in a folder of its own (or, `shared`, one for all)
    keep: dict[str, object]  # what each run keeps: a KEEP name -> its argument
    shared: bool = False  # the runs share one folder, in order (a later one reads what an earlier one saved)
    kind_per_run: bool = False  # each run keeps its own machine, threads and torch (its runs are recorded one by one)
    keep_for: dict[str, dict] = field(default_factory=dict)  # what some runs keep instead of `keep`


def seeds(command: str, *numbers: int) -> dict[str, str]:
    return {str(n): command.format(seed=n) for n in numbers}


RUNS = {
    "default-lines": Entry(
        "default-lines",
        "docs/sft.md, reward_modeling.md, dpo.md, ddpo.md, ilql.md",
        {s: f"{s}.py" for s in ("sft", "reward_modeling", "dpo", "ddpo", "ilql")},
        {"line": None},  # the prefix: the script's own (reward_modeling's is "reward model: ")
        kind_per_run=True,
    ),
    "kto-default": Entry(
        "kto-default",
        "docs/kto.md",
        seeds("kto.py --seed {seed}", 1, 2, 3),
        {"line": "kto: ", "evaluations": "eval/loss", "ends": KTO_EVAL},
    ),
    "ppo-default": Entry(
        "ppo-default",
        "docs/ppo.md",
        seeds("ppo.py --seed {seed}", 1, 2, 3),
        {"line": "ppo: ", "ends": (*PPO_EVAL[:4], "distinct_words", "top_token_share"), "last_kl": "objective/kl"},
    ),
    "ppo-learned-reward": Entry(
        "ppo-learned-reward",
        "docs/ppo.md",
        {
            "reward_model": "reward_modeling.py",
            "ppo": "ppo.py --reward-model outputs/reward_model",
            "ppo_target_3": "ppo.py --reward-model outputs/reward_model --target 3 --output-dir outputs/ppo3",
        },
        {"line": "ppo: ", "ends": PPO_EVAL, "health": None},
        shared=True,
        keep_for={"reward_model": {"line": "reward model: "}},
    ),
    "gkd-variants": Entry(
        "gkd-variants",
        "docs/gkd.md",
        {"on-policy": "gkd.py", "mixed": "gkd.py --lmbda 0.5", "sequence-level": "gkd.py --lmbda 0 --seq-kd"},
        {"line": "gkd: ", "step_s": "time/step", "eval": GKD_EVAL, "teacher_accuracy": "teacher/accuracy"},
    ),
    "real-model-scripts": Entry(  # docs/real-model.md's commands, word for word, one after the other (~20 min)
        "real-model-scripts",
        "docs/real-model.md",
        {
            "sft.py": f"sft.py --model-name {SMOL} --dataset-name builtin:chatterbot-chat --assistant-only-loss "
            "--max-steps 30 --batch-size 8 --learning-rate 1e-5 --output-dir outputs/smol/sft",
            "reward_modeling.py": f"reward_modeling.py --model-name {SMOL} --dataset-name builtin:vader-preferences-chat "
            "--max-steps 30 --batch-size 8 --learning-rate 1e-5 --output-dir outputs/smol/rm",
            "dpo.py": f"dpo.py --model-name {SMOL} --dataset-name builtin:vader-preferences-chat --max-steps 20 "
            "--batch-size 8 --learning-rate 5e-6 --output-dir outputs/smol/dpo",
            "ppo.py": f"ppo.py --model-name {SMOL} --reward-model outputs/smol/rm --dataset-name "
            "builtin:vader-preferences-chat --total-episodes 96 --max-new-tokens 32 --eval-samples 32 "
            "--output-dir outputs/smol/ppo",
        },
        {"line": None},
        shared=True,
    ),
    "pipeline": Entry(
        "pipeline",
        "docs/pipeline.md",
        seeds("pipeline.py --seed {seed}", 1, 2, 3),
        {"line": "pipeline: ", "pipeline": "outputs/pipeline/results.json"},
    ),
}
# a run whose summary line does not start with its own name (a script's, less ".py")
PREFIX = {"reward_modeling": "reward model: ", "reward_modeling.py": "reward model: "}


def run(entry: Entry, name: str, folder: str) -> dict:
    """One run of `entry` in `folder`: its command, seconds and what the entry keeps."""
    argv = entry.runs[name].split()
    logs = os.path.join(folder, "runs", name) if entry.shared else os.path.join(folder, "runs")
    stdout, seconds = run_script([*argv, *(["--log-dir", logs] if entry.shared else [])], folder)
    lines, kept = stdout.splitlines(), {"command": f"python {entry.runs[name]}", "seconds": seconds}
    for what, argument in entry.keep_for.get(name, entry.keep).items():
        if what == "line" and argument is None:
            argument = PREFIX.get(name, f"{name.removesuffix('.py')}: ")
        kept |= KEEP[what](argument, lines, logs, folder)
    return kept


@dataclass
class Args:
    entry: tyro.conf.Positional[str] = ""
    """the entry of RUNS to run (--list names them)"""
    only: list[str] = field(default_factory=list)
    """its runs to run (a seed, a variant, a script); default: every one"""
    check: bool = False
    """rerun them and compare each line with the record (but for the time) instead of recording: exit 1 when one differs"""
    list: bool = False
    """name every entry, its runs, its record and its page"""


def main(args: Args) -> None:
    if args.list or not args.entry:
        for name, entry in RUNS.items():
            print(f"{name}: {', '.join(entry.runs)} -> benchmarks/RESULTS-{entry.record}.json ({entry.page})")
        return
    if args.entry not in RUNS:
        raise SystemExit(f"error: {args.entry}: not an entry; choose one of {', '.join(RUNS)}")
    entry = RUNS[args.entry]
    names = args.only or list(entry.runs)
    unknown = sorted(set(names) - set(entry.runs))
    if unknown:
        raise SystemExit(f"error: --only {' '.join(unknown)}: not a run of {args.entry} ({', '.join(entry.runs)})")
    path = os.path.join(HERE, f"RESULTS-{entry.record}.json")
    record = json.load(open(path)) if os.path.exists(path) else {"runs": {}}
    here = header(f"python benchmarks/runs.py {args.entry}")
    kind = ("machine", "threads", "torch")  # what a rerun must share with the record for its line to be the same
    differ = []
    order = list(entry.runs)
    if entry.shared:  # a later run reads what the earlier ones saved: they run too, kept only where named
        names = order[: max(order.index(n) for n in names) + 1]
    with tempfile.TemporaryDirectory(prefix=f"rlhf-{args.entry}-") as shared:
        for name in names:
            if entry.shared and args.only and name not in args.only:
                run(entry, name, shared)
                continue
            if args.check:
                recorded = record["runs"].get(name)
                source = recorded if entry.kind_per_run else record
                if recorded is None or [source.get(k) for k in kind] != [here[k] for k in kind]:
                    print(f"{name}: not checked (no record, or recorded on another CPU kind, thread count or torch)")
                    continue
            if entry.shared:
                kept = run(entry, name, shared)
            else:
                with tempfile.TemporaryDirectory(prefix=f"rlhf-{args.entry}-{name}-") as folder:
                    kept = run(entry, name, folder)
            if args.check:
                same = untimed(kept["line"]) == untimed(recorded["line"])
                differ += [] if same else [name]
                print(f"{name}: {'the recorded line' if same else 'differs'}\n  now:      {kept['line']}", flush=True)
                print("" if same else f"  recorded: {recorded['line']}", end="", flush=True)
                continue
            record["runs"][name] = kept | ({k: here[k] for k in ("machine", "launcher", *kind)} if entry.kind_per_run else {})
            print(kept["line"], flush=True)
            record |= {"command": here["command"]} if entry.kind_per_run else here
            with open(path, "w") as f:  # after each run: what is done stays done
                json.dump(record, f, indent=1)
                f.write("\n")
    if args.check:
        raise SystemExit(f"differs from the record: {' '.join(differ)}" if differ else 0)
    print(f"wrote benchmarks/RESULTS-{entry.record}.json ({machine()})")


if __name__ == "__main__":
    main(tyro.cli(Args))
