"""The offline default run of kto.py over seeds (`python kto.py --seed S`: builtin:tiny-chat on the built-in VADER
pairs, unpaired; the held-out prompts never occur in training): the line each run ends on and its held-out metrics at
the first and the last evaluation, read from its TensorBoard log. Writes benchmarks/RESULTS-kto-default.json, from
which docs/kto.md renders its seed table (docs/build_assets.py).

    python benchmarks/kto_default.py                 # seeds 1 2 3, one after another (about 10 minutes on 2 cores)
    python benchmarks/kto_default.py --seeds 1
"""

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-kto-default.json")
sys.path.insert(0, ROOT)

from records import header, scalars, write  # noqa: E402

METRICS = ("rewards/margins", "rewards/chosen", "rewards/rejected", "kl", "logps/chosen", "logps/rejected", "loss")
METRICS += ("samples/kl", "samples/length", "samples/distinct")


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """the seeds to run (each `python kto.py --seed S`)"""


def run(seed: int) -> dict:
    """`python kto.py --seed S` in a fresh folder, with torch's default thread count; its line and held-out metrics."""
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("OMP_NUM_THREADS", None)
    with tempfile.TemporaryDirectory(prefix="rlhf-kto-default-") as folder:
        start = time.time()
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "kto.py"), "--seed", str(seed)],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise SystemExit(f"python kto.py --seed {seed} exited {result.returncode}:\n{result.stderr[-3000:]}")
        metrics = {name: [v for _, v in scalars(os.path.join(folder, "runs"), f"eval/{name}")] for name in METRICS}
    line = next(line for line in result.stdout.splitlines() if line.startswith("kto: "))
    return {
        "line": line,
        "seconds": time.time() - start,
        "evaluations": len(metrics["loss"]),
        "first": {k: v[0] for k, v in metrics.items()},
        "last": {k: v[-1] for k, v in metrics.items()},
    }


def main(args: Args) -> None:
    record = header("python benchmarks/kto_default.py --seeds " + " ".join(map(str, args.seeds))) | {"runs": {}}
    for seed in args.seeds:
        record["runs"][str(seed)] = run(seed)
        print(record["runs"][str(seed)]["line"], flush=True)
    write(RESULTS, record)


if __name__ == "__main__":
    main(tyro.cli(Args))
