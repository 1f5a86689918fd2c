"""PPO against a reward model of your own, on the offline defaults: `python reward_modeling.py` (builtin:tiny-chat on
the VADER pairs), then `python ppo.py --reward-model outputs/reward_model`, then the same with `--target 3`. Records
each run's summary line, its health line and warning (if any), and ppo's held-out metrics at the first and the last
evaluation, read from its TensorBoard log. Writes benchmarks/RESULTS-ppo-learned-reward.json, from which docs/ppo.md
renders its paragraph (docs/build_assets.py).

    python benchmarks/ppo_learned_reward.py          # about 5 minutes on 2 cores
"""

import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-ppo-learned-reward.json")
sys.path.insert(0, ROOT)

from records import header, scalars, write  # noqa: E402

METRICS = ("reward_mean", "reward_std", "vader_sentiment", "distinct_2", "top_token_share")
COMMANDS = {
    "reward_model": ["reward_modeling.py"],
    "ppo": ["ppo.py", "--reward-model", "outputs/reward_model"],
    "ppo_target_3": ["ppo.py", "--reward-model", "outputs/reward_model", "--target", "3", "--output-dir", "outputs/ppo3"],
}


def main() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("OMP_NUM_THREADS", None)
    record = header("python benchmarks/ppo_learned_reward.py") | {"runs": {}}
    with tempfile.TemporaryDirectory(prefix="rlhf-ppo-learned-reward-") as folder:
        for name, command in COMMANDS.items():
            start = time.time()
            runs = os.path.join(folder, "runs", name)
            done = subprocess.run(
                [sys.executable, os.path.join(ROOT, command[0]), *command[1:], "--log-dir", runs],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise SystemExit(f"python {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
            lines = done.stdout.splitlines()
            prefix = "reward model: " if name == "reward_model" else "ppo: "
            run = {
                "command": "python " + " ".join(command),
                "seconds": time.time() - start,
                "line": next(line for line in lines if line.startswith(prefix)),
            }
            if name != "reward_model":
                metrics = {m: [v for _, v in scalars(runs, f"eval/{m}")] for m in METRICS}
                run |= {
                    "first": {k: v[0] for k, v in metrics.items()},
                    "last": {k: v[-1] for k, v in metrics.items()},
                    "health": next(line for line in lines if line.startswith("health:")),
                    "warning": None,  # the health line's own warning, the line right after it
                }
                after = lines[lines.index(run["health"]) + 1 :]
                if after and after[0].startswith("warning:"):
                    run["warning"] = after[0]
            record["runs"][name] = run
            print(run["line"], flush=True)
    write(RESULTS, record)


if __name__ == "__main__":
    main()
