"""grpo.py and rloo.py against TRL 1.16's GRPOTrainer and RLOOTrainer on the real model, side by side on one machine in
one sitting: the step time at the real-model recipe (builtin:smollm2-135m-instruct, reasoning-gym chain_sum as chat
prompts, 8 prompts x 4 completions of 32 tokens, learning rate 1e-5, beta 0, float32, full fine-tuning; TRL's defaults
otherwise, gradient checkpointing and bf16 off as ours have neither), each side a fresh process per run, the runs
interleaved (ours, TRL's, TRL's, ours, ...) for `--rounds` rounds so that the machine's drift hits both alike. A run's
step time is the median of its steps after the first; a row gives the min / median / max over the rounds and the ratio
of the medians. With --vllm, grpo.py --use-vllm runs beside them in the same rounds twice: in float32 and with
--vllm-dtype auto (bfloat16 where the machine computes it; the side is named by the dtype it picked). Writes
benchmarks/RESULTS-speed-cpu.json, from which the README's Speed table is rendered.

    python benchmarks/speed_cpu.py                      # grpo and rloo, 3 rounds of 4 steps (about 40 minutes on 2 cores)
    python benchmarks/speed_cpu.py --algos grpo --rounds 3 --steps 4
    python benchmarks/speed_cpu.py --algos grpo rloo --vllm     # and grpo.py --use-vllm beside them
    python benchmarks/speed_cpu.py --algos dpo kto sft          # the offline scripts: benchmarks/RESULTS-speed-offline.json

The offline scripts train the same model on their built-in data (dpo.py and kto.py the VADER pairs, kto.py unpaired as
TRL does, sft.py the chatterbot dialogues) as raw text (--no-chat-template: TRL renders string data as it is), at
OFFLINE's settings, against TRL's DPOTrainer, KTOTrainer and SFTTrainer with the same batch, length and loss. Each side
draws its batches in its own order, and a batch is as wide as its longest row: on the whole data a rare long row pads
a whole batch, at other steps on each side. So both train on the rows whose sequences are all BAND tokens long (within
8 tokens of each other; `banded`), where every batch has about one width.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import tyro
from records import machine, trl_settings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = "builtin:smollm2-135m-instruct"
RECIPE = (  # benchmarks/real_model.py's settings for grpo.py and rloo.py
    "--model-name builtin:smollm2-135m-instruct --dataset-name reasoning-gym:chain_sum --data-seed 1 --seed 1 "
    "--max-completion-length 32 --batch-size 8 --num-generations 4 --mini-batch-size 8 --gradient-accumulation-steps 4 "
    "--learning-rate 1e-5 --beta 0 --eval-freq 0 --eval-samples 8 --log-freq 1000"
).split()

OFFLINE = {  # the offline scripts' data and settings (TRL's trainers get the same batch, length and loss in trl_offline)
    "dpo": ("builtin:vader-preferences", "--batch-size 8 --max-length 128 --beta 0.1"),
    "kto": ("builtin:vader-preferences", "--batch-size 8 --max-length 128 --beta 0.1"),
    "sft": ("builtin:chatterbot-dialogue", "--batch-size 16 --max-seq-length 128"),
}
BAND = {"dpo": (16, 24), "kto": (16, 24), "sft": (24, 32)}  # tokens of a row's sequences (prompt + completion)


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
    """also grpo.py --use-vllm (vLLM colocated) in float32 and with --vllm-dtype auto, two more sides in grpo's rounds"""
    worker: str | None = None
    """internal: run one side once (JSON spec) and print its step times"""


def ours(algo: str, steps: int, folder: str, *flags: str) -> list[float]:
    """`python {algo}.py` at the recipe (and `flags`) for `steps` updates (steps); its logged time/step per update."""
    if algo in OFFLINE:
        command = [sys.executable, f"{algo}.py", "--model-name", MODEL, "--dataset-name", banded(algo, folder)]
        command += [*OFFLINE[algo][1].split(), "--no-chat-template"]
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


def step_timer(times: list):
    """A TrainerCallback that appends each optimizer step's wall time to `times`."""
    import time

    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.time()

        def on_step_end(self, *a, **k):
            times.append(time.time() - self.start)

    return Timer()


def trl(algo: str, steps: int, folder: str) -> list[float]:
    """TRL 1.16's trainer at the same settings for `steps` steps; the wall time of each (a callback's clock)."""
    import trl as library
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, ROOT)
    from common.loading import load_pretrained, load_tokenizer
    from common.rewards import load_task, verifier

    tokenizer = load_tokenizer(MODEL, padding_side="left")
    task_args = tyro.cli(__import__(algo).Args, args=RECIPE)
    train, _, _ = load_task(task_args, tokenizer, "prompt", task_args.max_prompt_length)
    rows = [dict(prompt=r["prompt"], answer=r["answer"], rg_entry=r["rg_entry"]) for r in train]
    times = []

    kind = algo.upper()
    config = getattr(library, f"{kind}Config")(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_completion_length=32,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        **trl_settings(folder, steps),
    )
    getattr(library, f"{kind}Trainer")(
        model=load_pretrained(MODEL, AutoModelForCausalLM),
        reward_funcs=verifier,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[step_timer(times)],
    ).train()
    return times


def auto_dtype() -> str:
    """The dtype grpo.py's --vllm-dtype auto picks on this machine (its float32 policy, the correction on)."""
    sys.path.insert(0, ROOT)
    from common.vllm_engine import engine_dtype

    return engine_dtype(tyro.cli(__import__("grpo").Args, args=RECIPE))


def banded(algo: str, folder: str) -> str:
    """OFFLINE[algo]'s built-in data, the rows whose sequences (prompt + each completion, SmolLM2's tokens) all have a
    length within BAND[algo], written to folder/data.jsonl; its path."""
    sys.path.insert(0, ROOT)
    from common.loading import load_data, load_tokenizer

    tokenizer, (low, high) = load_tokenizer(MODEL), BAND[algo]
    length = lambda *texts: len(tokenizer("".join(texts))["input_ids"])  # noqa: E731
    rows = [
        row
        for row in load_data(OFFLINE[algo][0], "train").to_list()
        if all(
            low <= n <= high
            for n in (
                [length(row["text"])] if algo == "sft" else [length(row["prompt"], row[c]) for c in ("chosen", "rejected")]
            )
        )
    ]
    path = os.path.join(folder, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": row["text"]} if algo == "sft" else row) + "\n" for row in rows)  # (text alone:
        # TRL would read prompt and completion columns as prompt-completion data)
    return path


def trl_offline(algo: str, steps: int, folder: str) -> list[float]:
    """TRL 1.16's DPOTrainer, KTOTrainer or SFTTrainer on the data and settings of OFFLINE[algo], for `steps` steps; the
    wall time of each (a callback's clock)."""

    import trl as library
    from transformers import AutoModelForCausalLM
    from trl.data_utils import unpair_preference_dataset

    sys.path.insert(0, ROOT)
    from common.loading import load_data, load_pretrained, load_tokenizer

    ours = tyro.cli(__import__(algo).Args, args=OFFLINE[algo][1].split())
    tokenizer = load_tokenizer(MODEL)
    dataset = load_data(banded(algo, folder), "train")
    times = []

    common = dict(per_device_train_batch_size=ours.batch_size, **trl_settings(folder, steps))
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
        callbacks=[step_timer(times)],
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
                    *(["--use-vllm"] if spec["side"] == "vllm_auto" else []),
                )
        print(json.dumps(times))
        sys.exit(0)
    import torch

    rows = {}
    for algo in args.algos:
        sides = ("ours", "vllm", "vllm_auto", "trl") if args.vllm and algo == "grpo" else ("ours", "trl")
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
            rows[algo]["vllm_auto_ratio"] = rows[algo]["vllm_auto"]["median"] / rows[algo]["trl"]["median"]
            rows[algo]["vllm_auto_dtype"] = auto_dtype()
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
            recipe=" ".join(RECIPE) if name == "speed-cpu" else {a: OFFLINE[a][1] for a in family},
            **({} if name == "speed-cpu" else {"data": {a: dict(source=OFFLINE[a][0], band=BAND[a]) for a in family}}),
            rows={a: rows[a] for a in family},
        )
        with open(os.path.join(HERE, f"RESULTS-{name}.json"), "w") as f:
            json.dump(record, f, indent=1)
