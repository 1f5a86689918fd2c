"""The wall time of the fast test tier (`-m "not slow"`) and of the whole suite, as the README and docs/forking.md give
them: each run once with `-n 2`, one after the other, on this machine with every built-in cached. Writes
benchmarks/RESULTS-tests.json, from which docs/build_assets.py renders the figures, with the 60 slowest tests of each
and pytest's warnings summary.

    python benchmarks/test_times.py
"""

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro
from records import machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMMAND = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "--durations", "60", "tests"]


def run(extra: list[str]) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    start = time.time()
    done = subprocess.run([*COMMAND, *extra], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.time() - start
    lines = done.stdout.strip().splitlines()
    summary = lines[-1]
    print(summary, flush=True)
    slowest = [line for line in lines if re.match(r"\d+\.\d+s (call|setup|teardown) ", line)]
    warned = done.stdout.split("= warnings summary =")[1].split("-- Docs:")[0] if "= warnings summary =" in done.stdout else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|error|deselected)", summary)}
    if done.returncode or counts.get("failed") or counts.get("error"):
        failures = done.stdout.split("= FAILURES =")[-1].split("slowest 60 durations")[0]  # the tracebacks, not the timings
        sys.exit(f"the suite failed:\n{failures[-20000:]}\n{summary}")
    return dict(
        seconds=seconds,
        passed=counts.get("passed", 0),
        deselected=counts.get("deselected", 0),
        warnings=warned.strip().splitlines()[:40],  # pytest's warnings summary: each test that warned, and the warning
        slowest=slowest[:60],
    )


@dataclass
class Args:
    """Time the fast tier, then the whole suite, and write benchmarks/RESULTS-tests.json (no options)."""


if __name__ == "__main__":
    tyro.cli(Args)
    fast = run(["-m", "not slow"])
    full = run([])
    record = dict(command="python benchmarks/test_times.py", machine=machine(), fast=fast, full=full)
    with open(os.path.join(HERE, "RESULTS-tests.json"), "w") as f:
        json.dump(record, f, indent=1)
