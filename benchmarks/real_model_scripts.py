"""Each script on the real model as docs/real-model.md gives them: sft.py, reward_modeling.py, dpo.py and ppo.py (the
last against the reward model just trained) on `builtin:smollm2-135m-instruct` and the built-in chat data, one after
the other in one fresh folder. Records each command, its summary line and its wall time (loading and evaluations
included). Writes benchmarks/RESULTS-real-model-scripts.json, from which docs/real-model.md renders its first table
(docs/build_assets.py).

    python benchmarks/real_model_scripts.py            # about 20 minutes on 2 cores
"""

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-real-model-scripts.json")
sys.path.insert(0, ROOT)

from records import header, run_script, write  # noqa: E402

M = "builtin:smollm2-135m-instruct"
# (the summary line's prefix, the command): docs/real-model.md's commands, word for word
COMMANDS = [
    ("sft: ", f"sft.py --model-name {M} --dataset-name builtin:chatterbot-chat --assistant-only-loss --max-steps 30 "
     "--batch-size 8 --learning-rate 1e-5 --output-dir outputs/smol/sft"),
    ("reward model: ", f"reward_modeling.py --model-name {M} --dataset-name builtin:vader-preferences-chat --max-steps 30 "
     "--batch-size 8 --learning-rate 1e-5 --output-dir outputs/smol/rm"),
    ("dpo: ", f"dpo.py --model-name {M} --dataset-name builtin:vader-preferences-chat --max-steps 20 --batch-size 8 "
     "--learning-rate 5e-6 --output-dir outputs/smol/dpo"),
    ("ppo: ", f"ppo.py --model-name {M} --reward-model outputs/smol/rm --dataset-name builtin:vader-preferences-chat "
     "--total-episodes 96 --max-new-tokens 32 --eval-samples 32 --output-dir outputs/smol/ppo"),
]  # fmt: skip


def main() -> None:
    record = header("python benchmarks/real_model_scripts.py") | {"runs": {}}
    with tempfile.TemporaryDirectory(prefix="rlhf-real-model-scripts-") as folder:
        for prefix, command in COMMANDS:
            stdout, seconds = run_script(command.split(), folder)
            line = next(line for line in stdout.splitlines() if line.startswith(prefix))
            script = command.split()[0]
            record["runs"][script] = {"command": f"python {command}", "line": line, "seconds": seconds}
            print(line, flush=True)
    write(RESULTS, record)


if __name__ == "__main__":
    main()
