"""gkd.py's three ways to pick the student's training completions at equal student steps, on the offline default
(teacher builtin:smollm2-135m-instruct, student builtin:smollm2-student, one-digit chain_sum): on-policy GKD
(`--lmbda 1`, the default), mixed (`--lmbda 0.5`) and sequence-level KD (`--lmbda 0 --seq-kd`). Records each run's
summary line and its held-out metrics along the run (accuracy, KL to the teacher per token, completion length, the
most frequent answer's share), the median step time and the wall time. Writes benchmarks/RESULTS-gkd-variants.json,
from which docs/gkd.md renders its table (docs/build_assets.py).

    python benchmarks/gkd_variants.py                # about 30 minutes on 2 cores
"""

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-gkd-variants.json")
sys.path.insert(0, ROOT)

from records import header, run_script, scalars, write  # noqa: E402

VARIANTS = {"on-policy": [], "mixed": ["--lmbda", "0.5"], "sequence-level": ["--lmbda", "0", "--seq-kd"]}
METRICS = ("accuracy", "kl_to_teacher", "completion_length", "top_answer_share")


def main() -> None:
    record = header("python benchmarks/gkd_variants.py") | {"runs": {}}
    with tempfile.TemporaryDirectory(prefix="rlhf-gkd-variants-") as folder:
        for name, flags in VARIANTS.items():  # each in a folder of its own: the on-policy run is `python gkd.py`
            os.makedirs(os.path.join(folder, name))
            runs = os.path.join(folder, name, "runs")
            stdout, seconds = run_script(["gkd.py", *flags], os.path.join(folder, name))
            steps = sorted(v for _, v in scalars(runs, "time/step"))
            record["runs"][name] = {
                "command": " ".join(["python gkd.py", *flags]),
                "line": next(line for line in stdout.splitlines() if line.startswith("gkd: ")),
                "seconds": seconds,
                "step_s": steps[len(steps) // 2],
                "eval": {m: [v for _, v in scalars(runs, f"eval/{m}")] for m in METRICS},
                "teacher_accuracy": [v for _, v in scalars(runs, "teacher/accuracy")][0],
            }
            print(record["runs"][name]["line"], flush=True)
    write(RESULTS, record)


if __name__ == "__main__":
    main()
