"""The offline default run of ppo.py over seeds (`python ppo.py --seed S`: builtin:tiny-chat against
builtin:tiny-chat-rm, 64 held-out prompts): the line each run ends on and its held-out metrics at the first and the
last evaluation, read from its TensorBoard log. Writes benchmarks/RESULTS-ppo-default.json, from which docs/ppo.md
renders its seed table (docs/build_assets.py).

    python benchmarks/ppo_default.py                 # seeds 1 2 3, one after another (about 15 minutes on 2 cores)
    python benchmarks/ppo_default.py --seeds 1
"""

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-ppo-default.json")
sys.path.insert(0, ROOT)

from records import machine, scalars, write  # noqa: E402

METRICS = ("reward_mean", "reward_std", "vader_sentiment", "distinct_words", "distinct_2", "top_token_share")


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """the seeds to run (each `python ppo.py --seed S`)"""


def run(seed: int) -> dict:
    """`python ppo.py --seed S` in a fresh folder, with torch's default thread count; its line and held-out metrics."""
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("OMP_NUM_THREADS", None)
    with tempfile.TemporaryDirectory(prefix="rlhf-ppo-default-") as folder:
        start = time.time()
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "ppo.py"), "--seed", str(seed)],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise SystemExit(f"python ppo.py --seed {seed} exited {result.returncode}:\n{result.stderr[-3000:]}")
        runs = os.path.join(folder, "runs")
        metrics = {name: [v for _, v in scalars(runs, f"eval/{name}")] for name in METRICS}
        kl = [v for _, v in scalars(runs, "objective/kl")]
    line = next(line for line in result.stdout.splitlines() if line.startswith("ppo: "))
    return {
        "line": line,
        "seconds": time.time() - start,
        "first": {k: v[0] for k, v in metrics.items()},
        "last": {k: v[-1] for k, v in metrics.items()},
        "last_kl": kl[-1],  # the last update's; the line's KL is the mean of the last tenth (the summary's)
    }


def main(args: Args) -> None:
    record = {
        "command": "python benchmarks/ppo_default.py --seeds " + " ".join(map(str, args.seeds)),
        "machine": machine(),
        "launcher": "python",
        "threads": torch.get_num_threads(),  # the runs' too: OMP_NUM_THREADS is unset for them
        "runs": {},
    }
    for seed in args.seeds:
        record["runs"][str(seed)] = run(seed)
        print(record["runs"][str(seed)]["line"], flush=True)
    write(RESULTS, record)


if __name__ == "__main__":
    main(tyro.cli(Args))
