"""grpo.py and rloo.py against TRL 1.16's GRPOTrainer and RLOOTrainer on the real model, side by side on one machine in
one sitting: the step time at the real-model recipe (builtin:smollm2-135m-instruct, reasoning-gym chain_sum as chat
prompts, 8 prompts x 4 completions of 32 tokens, learning rate 1e-5, beta 0, float32, full fine-tuning; TRL's defaults
otherwise, gradient checkpointing and bf16 off as ours have neither), each side a fresh process per run, the runs
interleaved (ours, TRL's, TRL's, ours, ...) for `--rounds` rounds so that the machine's drift hits both alike. A run's
step time is the median of its steps after the first; a row gives the min / median / max over the rounds and the ratio
of the medians. With --vllm, grpo.py --use-vllm --vllm-dtype float32 runs as a third side in the same rounds. Writes
benchmarks/RESULTS-speed-cpu.json, from which the README's Speed table is rendered.

    python benchmarks/speed_cpu.py                      # grpo and rloo, 3 rounds of 4 steps (about 40 minutes on 2 cores)
    python benchmarks/speed_cpu.py --algos grpo --rounds 3 --steps 4
    python benchmarks/speed_cpu.py --algos grpo rloo --vllm     # and grpo.py --use-vllm beside them
    python benchmarks/speed_cpu.py --algos dpo kto sft          # the offline scripts: benchmarks/RESULTS-speed-offline.json

The offline scripts train the same model on their built-in data (dpo.py and kto.py the VADER pairs, kto.py unpaired as
TRL does, sft.py the chatterbot dialogues) as raw text (--no-chat-template: TRL renders string data as it is), at
OFFLINE's settings, against TRL's DPOTrainer, KTOTrainer and SFTTrainer with the same batch, length and loss.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import tyro
from records import machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = "builtin:smollm2-135m-instruct"
RECIPE = (  # benchmarks/real_model.py's settings for grpo.py and rloo.py
    "--model-name builtin:smollm2-135m-instruct --dataset-name reasoning-gym:chain_sum --data-seed 1 --seed 1 "
    "--max-completion-length 32 --batch-size 8 --num-generations 4 --mini-batch-size 8 --gradient-accumulation-steps 4 "
    "--learning-rate 1e-5 --beta 0 --eval-freq 0 --eval-samples 8 --log-freq 1000"
).split()

OFFLINE = {  # the offline scripts' settings (TRL's trainers get the same batch, length and loss in trl_offline)
    "dpo": "--dataset-name builtin:vader-preferences --batch-size 8 --max-length 128 --beta 0.1",
    "kto": "--dataset-name builtin:vader-preferences --batch-size 8 --max-length 128 --beta 0.1",
    "sft": "--dataset-name builtin:chatterbot-dialogue --batch-size 16 --max-seq-length 128",
}


@dataclass
class Args:
    algos: list[str] = field(default_factory=lambda: ["grpo", "rloo"])
    """which comparisons: grpo, rloo (against GRPOTrainer, RLOOTrainer); dpo, kto, sft (DPOTrainer, KTOTrainer,
    SFTTrainer; recorded apart, in RESULTS-speed-offline.json)"""
    rounds: int = 3
    """interleaved rounds: one run of each side per round"""
    steps: int = 4
    """optimizer steps (updates) per run; the first is left out of the timing"""
    vllm: bool = False
    """also grpo.py --use-vllm --vllm-dtype float32 (vLLM colocated), a third side in grpo's rounds"""
    worker: str | None = None
    """internal: run one side once (JSON spec) and print its step times"""


def ours(algo: str, steps: int, folder: str, *flags: str) -> list[float]:
    """`python {algo}.py` at the recipe (and `flags`) for `steps` updates (steps); its logged time/step per update."""
    if algo in OFFLINE:
        command = [sys.executable, f"{algo}.py", "--model-name", MODEL, *OFFLINE[algo].split(), "--no-chat-template"]
        command += ["--max-steps", str(steps), "--seed", "1", "--eval-fraction", "0.02"]  # a short evaluation, untimed
        command += [] if algo == "sft" else ["--no-generate-during-eval"]
    else:
        command = [sys.executable, f"{algo}.py", *RECIPE, *flags, "--total-prompts", str(8 * steps)]
    command += ["--output-dir", os.path.join(folder, "out"), "--log-dir", os.path.join(folder, "runs")]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = os.path.join(folder, "runs", os.listdir(os.path.join(folder, "runs"))[0])
    accumulator = EventAccumulator(run)
    accumulator.Reload()
    return [e.value for e in accumulator.Scalars("time/step")]


def trl(algo: str, steps: int, folder: str) -> list[float]:
    """TRL 1.16's trainer at the same settings for `steps` steps; the wall time of each (a callback's clock)."""
    import time

    import trl as library
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    sys.path.insert(0, ROOT)
    from common.loading import load_pretrained, load_tokenizer
    from common.rewards import load_task, verifier

    tokenizer = load_tokenizer(MODEL, padding_side="left")
    task_args = tyro.cli(__import__(algo).Args, args=RECIPE)
    train, _, _ = load_task(task_args, tokenizer, "prompt", task_args.max_prompt_length)
    rows = [dict(prompt=r["prompt"], answer=r["answer"], rg_entry=r["rg_entry"]) for r in train]
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.time()

        def on_step_end(self, *a, **k):
            times.append(time.time() - self.start)

    kind = algo.upper()
    config = getattr(library, f"{kind}Config")(
        output_dir=os.path.join(folder, "trl"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_completion_length=32,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        max_steps=steps,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=1,
    )
    getattr(library, f"{kind}Trainer")(
        model=load_pretrained(MODEL, AutoModelForCausalLM),
        reward_funcs=verifier,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Timer()],
    ).train()
    return times


def trl_offline(algo: str, steps: int, folder: str) -> list[float]:
    """TRL 1.16's DPOTrainer, KTOTrainer or SFTTrainer on the data and settings of OFFLINE[algo], for `steps` steps; the
    wall time of each (a callback's clock)."""
    import time

    import trl as library
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl.data_utils import unpair_preference_dataset

    sys.path.insert(0, ROOT)
    from common.loading import load_data, load_pretrained, load_tokenizer

    ours = tyro.cli(__import__(algo).Args, args=OFFLINE[algo].split())
    tokenizer = load_tokenizer(MODEL)
    dataset = load_data(ours.dataset_name, "train")
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.time()

        def on_step_end(self, *a, **k):
            times.append(time.time() - self.start)

    common = dict(
        output_dir=os.path.join(folder, "trl"),
        per_device_train_batch_size=ours.batch_size,
        max_steps=steps,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=1,
    )
    if algo == "sft":
        config = library.SFTConfig(max_length=ours.max_seq_length, dataset_text_field=ours.text_column, **common)
    else:
        config = getattr(library, f"{algo.upper()}Config")(max_length=ours.max_length, beta=ours.beta, **common)
        dataset = unpair_preference_dataset(dataset) if algo == "kto" else dataset
    reference = {} if algo == "sft" else {"ref_model": load_pretrained(MODEL, AutoModelForCausalLM)}  # (not a hub id)
    getattr(library, f"{algo.upper()}Trainer")(
        model=load_pretrained(MODEL, AutoModelForCausalLM),
        **reference,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    ).train()
    return times


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.worker:
        spec = json.loads(args.worker)
        with tempfile.TemporaryDirectory() as folder:
            if spec["side"] == "trl":
                times = (trl_offline if spec["algo"] in OFFLINE else trl)(spec["algo"], spec["steps"], folder)
            else:
                times = ours(
                    spec["algo"],
                    spec["steps"],
                    folder,
                    *(["--use-vllm", "--vllm-dtype", "float32"] if spec["side"] == "vllm" else []),
                )
        print(json.dumps(times))
        sys.exit(0)
    import torch

    rows = {}
    for algo in args.algos:
        sides = ("ours", "vllm", "trl") if args.vllm and algo == "grpo" else ("ours", "trl")
        medians = {side: [] for side in sides}
        for round_ in range(args.rounds):
            order = sides if round_ % 2 == 0 else sides[::-1]
            for side in order:
                spec = json.dumps(dict(algo=algo, side=side, steps=args.steps))
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", spec], cwd=ROOT, capture_output=True, text=True, check=True
                )
                times = json.loads(done.stdout.strip().splitlines()[-1])
                medians[side].append(statistics.median(times[1:]))
                print(f"{algo} round {round_ + 1} {side}: {medians[side][-1]:.1f} s per step ({times})", flush=True)
        rows[algo] = {side: dict(min=min(v), median=statistics.median(v), max=max(v), runs=v) for side, v in medians.items()}
        rows[algo]["ratio"] = rows[algo]["ours"]["median"] / rows[algo]["trl"]["median"]
        if "vllm" in rows[algo]:
            rows[algo]["vllm_ratio"] = rows[algo]["vllm"]["median"] / rows[algo]["trl"]["median"]
    for name, family in (
        ("speed-cpu", [a for a in rows if a not in OFFLINE]),
        ("speed-offline", [a for a in rows if a in OFFLINE]),
    ):
        if not family:
            continue
        algos = "" if family == ["grpo", "rloo"] else f" --algos {' '.join(family)}"
        record = dict(
            command=f"python benchmarks/speed_cpu.py{algos} --rounds {args.rounds} --steps {args.steps}"
            + (" --vllm" * (args.vllm and "grpo" in family)),
            machine=machine(),
            launcher="python",
            threads=torch.get_num_threads(),
            recipe=" ".join(RECIPE) if name == "speed-cpu" else {a: OFFLINE[a] for a in family},
            rows={a: rows[a] for a in family},
        )
        with open(os.path.join(HERE, f"RESULTS-{name}.json"), "w") as f:
            json.dump(record, f, indent=1)
