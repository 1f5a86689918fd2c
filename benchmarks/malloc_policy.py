"""What `keep_freed_memory` (common/fast_paths.py) buys on CPU: dpo.py and ilql.py on the tiny presets, each run once
with the scripts' policy (glibc keeps freed blocks) and once with glibc's own (`MALLOC_TOP_PAD_` set to its default: any
`MALLOC_*` variable selects it), the two interleaved over rounds. Records each run's median step time (dpo.py's
`time/step`; ilql.py logs none), the whole run's wall time and its peak resident memory. Writes
benchmarks/RESULTS-malloc-policy.json, from which docs/scaling.md renders its table (docs/build_assets.py).

    python benchmarks/malloc_policy.py                 # 3 rounds, about 6 minutes on 2 cores
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-malloc-policy.json")
sys.path.insert(0, ROOT)

from records import header, scalars, write  # noqa: E402

SCRIPTS = {"dpo": ["--max-steps", "25"], "ilql": ["--max-steps", "25"]}
POLICIES = {"kept": {}, "glibc": {"MALLOC_TOP_PAD_": "131072"}}  # glibc's own default value


@dataclass
class Args:
    rounds: int = 3
    """interleaved rounds: each round runs every script under both policies"""


def run(script: str, policy: str, folder: str) -> dict:
    """One run in a fresh process: its step time, wall time and peak resident memory (its own, from wait4)."""
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")} | POLICIES[policy]
    name = f"{script}-{policy}-{time.time_ns()}"
    logs = os.path.join(folder, "runs", name)
    command = [sys.executable, os.path.join(ROOT, f"{script}.py"), *SCRIPTS[script], "--output-dir", f"out/{name}"]
    command += ["--log-dir", logs]
    start = time.time()
    process = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.time() - start
    if status != 0:
        raise SystemExit(f"python {script}.py exited {status}:\n{process.stderr.read().decode()[-3000:]}")
    steps = [v for _, v in scalars(logs, "time/step")][1:]
    return {"step_s": statistics.median(steps) if steps else None, "seconds": seconds, "peak_gib": usage.ru_maxrss / 2**20}


def main(args: Args) -> None:
    record = header("python benchmarks/malloc_policy.py" + (f" --rounds {args.rounds}" if args.rounds != 3 else "")) | {
        "runs": {f"{s}-{p}": [] for s in SCRIPTS for p in POLICIES}
    }
    with tempfile.TemporaryDirectory(prefix="rlhf-malloc-") as folder:
        for _ in range(args.rounds):
            for script in SCRIPTS:
                for policy in POLICIES:
                    record["runs"][f"{script}-{policy}"].append(result := run(script, policy, folder))
                    print(script, policy, result, flush=True)
    write(RESULTS, record)


if __name__ == "__main__":
    main(tyro.cli(Args))
