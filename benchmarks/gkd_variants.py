"""gkd.py's three ways to pick the student's training completions at equal student steps, on the offline default
(teacher builtin:smollm2-135m-instruct, student builtin:smollm2-student, one-digit chain_sum): on-policy GKD
(`--lmbda 1`, the default), mixed (`--lmbda 0.5`) and sequence-level KD (`--lmbda 0 --seq-kd`). Records each run's
summary line and its held-out metrics along the run (accuracy, KL to the teacher per token, completion length, the
most frequent answer's share), the median step time and the wall time. Writes benchmarks/RESULTS-gkd-variants.json,
from which docs/gkd.md renders its table (docs/build_assets.py).

    python benchmarks/gkd_variants.py                # about 30 minutes on 2 cores
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-gkd-variants.json")
sys.path.insert(0, ROOT)

from records import machine, scalars  # noqa: E402

VARIANTS = {"on-policy": [], "mixed": ["--lmbda", "0.5"], "sequence-level": ["--lmbda", "0", "--seq-kd"]}
METRICS = ("accuracy", "kl_to_teacher", "completion_length", "top_answer_share")


def main() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("OMP_NUM_THREADS", None)
    record = {
        "command": "python benchmarks/gkd_variants.py",
        "machine": machine(),
        "launcher": "python",
        "threads": torch.get_num_threads(),  # the runs' too: OMP_NUM_THREADS is unset for them
        "torch": torch.__version__,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="rlhf-gkd-variants-") as folder:
        for name, flags in VARIANTS.items():
            runs, start = os.path.join(folder, "runs", name), time.time()
            command = [sys.executable, os.path.join(ROOT, "gkd.py"), *flags, "--output-dir", name, "--log-dir", runs]
            done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"python gkd.py {' '.join(flags)} exited {done.returncode}:\n{done.stderr[-3000:]}")
            steps = sorted(v for _, v in scalars(runs, "time/step"))
            record["runs"][name] = {
                "command": "python gkd.py " + " ".join(flags),
                "line": next(line for line in done.stdout.splitlines() if line.startswith("gkd: ")),
                "seconds": time.time() - start,
                "step_s": steps[len(steps) // 2],
                "eval": {m: [v for _, v in scalars(runs, f"eval/{m}")] for m in METRICS},
                "teacher_accuracy": [v for _, v in scalars(runs, "teacher/accuracy")][0],
            }
            print(record["runs"][name]["line"], flush=True)
    with open(RESULTS, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(RESULTS, ROOT)}")


if __name__ == "__main__":
    main()
