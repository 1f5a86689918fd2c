"""What the benchmark drivers share: the machine a record was measured on, a run's TensorBoard scalars, and a summary
line without its time."""

import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.run import machine  # noqa: E402  (every record names its machine as common.run.machine does)


def untimed(line: str) -> str:
    """A summary line without its wall time and rate ("in 40s", "(2.65 steps/s)"): what a rerun of a default run must
    repeat (`benchmarks/runs.py --check`, and tests/conftest.py's `default_run`)."""
    return re.sub(r" in \d+s|\s?\([\d.]+ steps/s\)", "", line)


def scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point of `tag` in the newest TensorBoard run under `run_dir` ([] if there is none, or it
    logged no such tag)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = sorted(glob.glob(os.path.join(run_dir, "*")))
    if not found:
        return []
    accumulator = EventAccumulator(found[-1])
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)] if tag in accumulator.Tags()["scalars"] else []


def median(values: list[float]) -> float:
    """The upper median (the middle value of an odd count); nan for no values."""
    return sorted(values)[len(values) // 2] if values else float("nan")


def run_script(argv: list[str], folder: str) -> tuple[str, float]:
    """`python ROOT/argv[0] argv[1:]` in `folder`, offline, with torch's default thread count: its stdout and wall
    seconds, or the end of its stderr as the benchmark's one-line failure."""
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("OMP_NUM_THREADS", None)
    start = time.time()
    done = subprocess.run(
        [sys.executable, os.path.join(root, argv[0]), *argv[1:]], cwd=folder, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"python {' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout, time.time() - start


def header(command: str) -> dict:
    """What every record begins with: its command, the machine, the launcher, torch's thread count (its runs' too:
    run_script unsets OMP_NUM_THREADS) and torch's version."""
    import torch

    return {
        "command": command,
        "machine": machine(),
        "launcher": "python",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def write(path: str, record: dict) -> None:
    """`record` into the results file at `path`, and the line saying so."""
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote benchmarks/{os.path.basename(path)}")


def trl_settings(folder: str, steps: int) -> dict:
    """What every TRL side shares: `steps` steps on the CPU in float32 without gradient checkpointing (ours have
    neither), nothing reported or saved, seed 1."""
    return dict(
        output_dir=os.path.join(folder, "trl"),
        max_steps=steps,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=1,
    )
