"""The whole pipeline over seeds (`python pipeline.py --seed S`: SFT -> reward model -> PPO, DPO and KTO, on the offline
defaults): each run's results.json (every policy on the held-out prompts: the reward model's score, VADER, the KL to
the SFT policy, distinct-2, reply length; each stage's seconds) and the line it ends on. Writes
benchmarks/RESULTS-pipeline.json, from which docs/pipeline.md renders its tables (docs/build_assets.py).

    python benchmarks/pipeline_runs.py               # seeds 1 2 3, one after another (about 20 minutes on 2 cores)
    python benchmarks/pipeline_runs.py --seeds 1
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-pipeline.json")
sys.path.insert(0, ROOT)

from records import header, write  # noqa: E402


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """the seeds to run (each `python pipeline.py --seed S`)"""


def run(seed: int) -> dict:
    """`python pipeline.py --seed S` in a fresh folder, with torch's default thread count; its results and line."""
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("OMP_NUM_THREADS", None)
    with tempfile.TemporaryDirectory(prefix="rlhf-pipeline-") as folder:
        start = time.time()
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "pipeline.py"), "--seed", str(seed)],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise SystemExit(f"python pipeline.py --seed {seed} exited {result.returncode}:\n{result.stderr[-3000:]}")
        results = json.load(open(os.path.join(folder, "outputs", "pipeline", "results.json")))
    lines = result.stdout.splitlines()
    prefixes = {"sft": "sft: ", "reward_model": "reward model: ", "ppo": "ppo: ", "dpo": "dpo: ", "kto": "kto: "}
    stage_lines = {name: next((line for line in lines if line.startswith(p)), None) for name, p in prefixes.items()}
    return {
        "line": next(line for line in lines if line.startswith("pipeline: ")),
        "seconds": time.time() - start,
        "policies": results["policies"],
        "stage_seconds": results["stage_seconds"],
        "stage_lines": stage_lines,
        "heldout_prompts": len(results["heldout_prompts"]),
    }


def main(args: Args) -> None:
    record = header("python benchmarks/pipeline_runs.py --seeds " + " ".join(map(str, args.seeds))) | {"runs": {}}
    for seed in args.seeds:
        record["runs"][str(seed)] = run(seed)
        print(record["runs"][str(seed)]["line"], flush=True)
    write(RESULTS, record)


if __name__ == "__main__":
    main(tyro.cli(Args))
