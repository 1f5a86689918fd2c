"""Refactoring guard: short fixed runs of every script, whose trained weights must come out bit for bit the same when
the code is only reorganised (a renamed variable, a moved helper, a loop rewritten in phases).

    git stash && python tests/parity.py /tmp/parity --record && git stash pop    # the code before your change
    python tests/parity.py /tmp/parity                                          # after it: exit 1 if a weight moved

A run repeats exactly on one machine and thread count (each runs on one thread here), not across machines or library
versions, so this compares two versions of the code on the same machine and keeps no reference results in the
repository. A change that is meant to alter the math (a new default, another random stream) shows up here too:
then the learning tests and the measured figures are what to re-check.
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Annotated

import torch
import tyro
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import ARITH  # noqa: E402 - grpo.py's and rloo.py's tiny setting (their defaults train the real model)

# A few updates of each script from its offline default (the pretrained presets where the script starts from them)
RUNS = {
    "ppo": ["--total-episodes", "32", "--eval-samples", "8"],
    # ppo.py's other paths: a separate critic started from the reward model, with the KL as a loss and 2 samples a
    # query; verifiable rewards on reasoning-gym with a watched gold function and the logged reference responses
    "ppo-critic": ["--total-episodes", "32", "--eval-samples", "8", "--value-model-path", "auto"]
    + ["--freezing-actor-steps", "1", "--use-kl-loss", "--kl-penalty", "k3", "--n-samples-per-prompt", "2"],
    "ppo-funcs": ["--model-name", "builtin:tiny-arith", "--dataset-name", "reasoning-gym:chain_sum", "--reward-funcs"]
    + ["verifier", "format", "--reward-weights", "1", "0.1", "--gold-reward-funcs", "verifier", "--total-episodes", "32"]
    + ["--eval-samples", "8", "--log-freq", "1", "--log-ref-responses", "--save-best", "--min-new-tokens", "4"]
    + ["--max-new-tokens", "8"],
    "dpo": ["--max-steps", "4"],
    "kto": ["--max-steps", "4"],
    "grpo": [*ARITH["grpo"], "--total-prompts", "32", "--eval-samples", "16"],
    "rloo": [*ARITH["rloo"], "--total-prompts", "128", "--eval-samples", "16"],
    "gkd": ["--total-steps", "2", "--batch-size", "4", "--eval-samples", "8", "--lmbda", "0.5"],
    "sft": ["--max-steps", "4"],
    "reward_modeling": ["--max-steps", "4"],
    "ilql": ["--max-steps", "4", "--eval-samples", "8"],
    "ddpo": [
        "--num-epochs",
        "1",
        "--sample-num-steps",
        "3",
        "--sample-batch-size",
        "2",
        "--sample-num-batches-per-epoch",
        "1",
        "--train-batch-size",
        "2",
        "--eval-samples",
        "2",
    ],
}


@dataclass
class Args:
    folder: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="FOLDER")]
    """where the reference runs' weights are: written with --record, compared against otherwise"""
    record: bool = False
    """run the scripts and keep their weights in `folder` (on the code before your change)"""
    scripts: list[str] = field(default_factory=lambda: list(RUNS))
    """which runs: scripts, or a script's variant (ppo-critic)"""


def run(name: str, folder: str) -> None:
    """`python {script}.py` with the fixed flags of the run `name` ({script} or {script}-{variant}), the model saved
    to {folder}/{name}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    command = [
        sys.executable,
        f"{name.split('-')[0]}.py",
        *RUNS[name],
        "--output-dir",
        os.path.join(folder, name),
        "--log-dir",
        os.path.join(folder, "runs"),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def weights(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file under `folder`, keyed by file and tensor name."""
    return {
        f"{os.path.relpath(path, folder)}:{name}": tensor
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True))
        for name, tensor in load_file(path).items()
    }


def differences(reference: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[str]:
    """What differs between two sets of weights: missing or extra tensors, and tensors that are not equal bit for bit."""
    found = [f"only before: {k}" for k in reference.keys() - new.keys()]
    found += [f"only after: {k}" for k in new.keys() - reference.keys()]
    for key in sorted(reference.keys() & new.keys()):
        before, after = reference[key], new[key]
        if before.shape != after.shape or not torch.equal(before, after):
            gap = (before.float() - after.float()).abs().max().item() if before.shape == after.shape else float("nan")
            found.append(f"{key}: max |difference| {gap:.3g}")
    return found


if __name__ == "__main__":
    args = tyro.cli(Args, description=__doc__)
    unknown = [s for s in args.scripts if s not in RUNS]
    if unknown:
        sys.exit(f"error: unknown scripts {unknown}: choose from {list(RUNS)}")
    scratch = args.folder if args.record else tempfile.mkdtemp(prefix="parity-")
    changed = []
    for script in args.scripts:
        start = time.time()
        if args.record:
            shutil.rmtree(os.path.join(args.folder, script), ignore_errors=True)
        elif not os.path.isdir(os.path.join(args.folder, script)):
            sys.exit(f"error: no recorded run of {script} in {args.folder}: record one first (--record)")
        run(script, scratch)
        if args.record:
            print(f"{script}: recorded {len(weights(os.path.join(scratch, script)))} tensors ({time.time() - start:.0f}s)")
            continue
        found = differences(weights(os.path.join(args.folder, script)), weights(os.path.join(scratch, script)))
        changed += [script] if found else []
        print(
            f"{script}: "
            + (f"{len(found)} differences, e.g. {found[:3]}" if found else "the same weights, bit for bit")
            + f" ({time.time() - start:.0f}s)"
        )
    if not args.record:
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"parity: {'changed: ' + ', '.join(changed) if changed else 'every script trains the same weights'}")
        sys.exit(1 if changed else 0)
