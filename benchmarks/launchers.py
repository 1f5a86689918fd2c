"""Every script under every launcher, on CPU: pass / fail, the loss gap to one process, peak memory per rank, wall time.

    python benchmarks/launchers.py            # writes benchmarks/RESULTS-launchers.md
    python benchmarks/launchers.py --scripts sft dpo --launchers python fsdp2

Launchers: `python script.py`, `accelerate launch` of 1 process, DDP x2 and FSDP2 x2 (configs/fsdp_cpu.yaml), both
over gloo with one thread per rank (DeepSpeed runs one process on CPU: benchmarks/deepspeed_matrix.py). Each script
trains a few steps on the tiny presets with the same global batch under every launcher (per-process batch halved for
2 processes). The loss gap is the largest relative difference of the per-step loss to the `python` run's: near 1e-6
where the runs must be equal; the online scripts (ppo, grpo, rloo, gkd, ddpo) sample from per-rank seeds, so theirs
differ with the process count by design (tests/test_launchers.py holds DDP x2 and FSDP2 x2 equal to each other). Peak
memory is the largest resident set of any one process of the run (getrusage of the waited-for children), wall time
the whole command's.
"""

import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from common.cli import cli  # noqa: E402
from common.run import machine  # noqa: E402

GRPO_LIKE = ["--model-name", "builtin:tiny-gpt2", "--total-prompts", "8", "--eval-samples", "8", "--train-size", "64"]
GRPO_LIKE += ["--eval-size", "8", "--num-generations", "4", "--gradient-accumulation-steps", "2", "--log-freq", "1"]
# script: (flags, flags of 1 process, flags of each of 2 processes); NODROP: the tiny GPT-2 without dropout
SCRIPTS = {
    "sft": (["--model-name", "NODROP", "--max-steps", "4", "--max-seq-length", "32", "--num-sample-generations", "0"],
            ["--batch-size", "8"], ["--batch-size", "4"]),
    "reward_modeling": (["--model-name", "NODROP", "--max-steps", "4", "--max-length", "64"],
                        ["--batch-size", "8"], ["--batch-size", "4"]),
    "dpo": (["--model-name", "NODROP", "--max-steps", "3", "--no-generate-during-eval"],
            ["--batch-size", "8"], ["--batch-size", "4"]),
    "ppo": (["--model-name", "builtin:tiny-gpt2", "--min-new-tokens", "8", "--max-new-tokens", "8", "--eval-samples",
             "8", "--total-episodes", "32", "--log-freq", "1"],
            ["--batch-size", "8", "--mini-batch-size", "4"], ["--batch-size", "4", "--mini-batch-size", "2"]),
    "grpo": (GRPO_LIKE, ["--batch-size", "4", "--mini-batch-size", "8"], ["--batch-size", "2", "--mini-batch-size", "4"]),
    "rloo": (GRPO_LIKE, ["--batch-size", "4", "--mini-batch-size", "8"], ["--batch-size", "2", "--mini-batch-size", "4"]),
    "gkd": (["--model-name", "builtin:tiny-gpt2", "--teacher-name", "builtin:tiny-arith", "--max-new-tokens", "8",
             "--eval-samples", "16", "--eval-size", "16", "--train-size", "200", "--total-steps", "3", "--log-freq", "1"],
            ["--batch-size", "8"], ["--batch-size", "4"]),
    "ilql": (["--model-name", "NODROP", "--max-steps", "3", "--max-length", "24", "--max-new-tokens", "4",
              "--eval-samples", "4"], ["--batch-size", "8"], ["--batch-size", "4"]),
    "ddpo": (["--sample-num-steps", "3", "--sample-num-batches-per-epoch", "1", "--eval-samples", "2", "--num-epochs",
              "2"], ["--sample-batch-size", "4", "--train-batch-size", "4"],
             ["--sample-batch-size", "2", "--train-batch-size", "2"]),
}  # fmt: skip


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: list(SCRIPTS))
    """which scripts to run"""
    launchers: list[str] = field(default_factory=lambda: ["python", "accelerate", "ddp2", "fsdp2"])
    """which launchers: python, accelerate (1 process), ddp2, fsdp2"""
    out: str = os.path.join(HERE, "RESULTS-launchers.md")
    """the results table"""
    work: str = "outputs/launchers"
    """where the runs write their models and logs"""
    memory: bool = True
    """also ppo.py's policy + reference + reward model at SmolLM2-135M's size under DDP x2 and FSDP2 x2: peak memory"""


def launcher_prefix(name: str, work: str, port: int) -> list[str] | None:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port)]
    if name == "python":
        return [sys.executable]
    if name == "accelerate":
        return [*launch, "--num_processes", "1"]
    if name == "ddp2":
        return [*launch, "--multi_gpu", "--num_processes", "2"]
    if name == "fsdp2":
        return [*launch, "--config_file", os.path.join(ROOT, "configs", "fsdp_cpu.yaml")]
    raise ValueError(name)


def run(command: list[str], env: dict) -> tuple[int, float, float, str]:
    """Exit code, wall seconds, the largest child's peak RSS in GiB, the output's last lines (in a fresh process, so
    that getrusage sees this run's children only)."""
    probe = (
        "import resource, subprocess, sys, json, time; t = time.time(); "
        "r = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True); "
        "print(json.dumps([r.returncode, time.time() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
        "(r.stdout + r.stderr)[-3000:]]))"
    )
    out = subprocess.run([sys.executable, "-c", probe, json.dumps(command)], capture_output=True, text=True, env=env)
    code, seconds, rss_kib, tail = json.loads(out.stdout.strip().splitlines()[-1])
    return code, seconds, rss_kib / 2**20, tail


def losses(log_dir: str) -> list[float]:
    """The per-step values of the run's first logged loss (else its gradient norm)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = glob.glob(os.path.join(log_dir, "*"))
    if not runs:
        return []
    accumulator = EventAccumulator(runs[0])
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    tag = next((t for t in sorted(tags) if "loss" in t and "grad_norm" not in t and not t.startswith("eval")), None)
    tag = tag or next((t for t in tags if "grad_norm" in t), None)
    return [e.value for e in accumulator.Scalars(tag)] if tag else []


def no_dropout_model(work: str) -> str:
    """builtin:tiny-gpt2 in a local folder with its dropout off: dropout draws per rank, so no launcher could match (the
    equality tests in tests/test_launchers.py use it too)."""
    from transformers import AutoModelForCausalLM

    from common.loading import load_pretrained, load_tokenizer

    folder = os.path.join(work, "tiny-gpt2-no-dropout")
    model = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)
    for key in ("attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout"):
        setattr(model.config, key, 0.0)
    model.save_pretrained(folder)
    load_tokenizer("builtin:tiny-gpt2").save_pretrained(folder)
    return folder


def smollm_reward_model(work: str) -> str:
    """A reward model of SmolLM2-135M's size for the memory measurement: the built-in's weights with a fresh score head,
    saved, so that ppo.py loads it as a trained classifier (its scores mean nothing; its memory is what is measured)."""
    from transformers import AutoModelForSequenceClassification

    from common.loading import load_pretrained, load_tokenizer

    folder = os.path.join(work, "smollm2-135m-reward-model")
    tokenizer = load_tokenizer("builtin:smollm2-135m-instruct")
    model = load_pretrained("builtin:smollm2-135m-instruct", AutoModelForSequenceClassification, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def memory_rows(work: str, env: dict) -> list[tuple]:
    """ppo.py on builtin:smollm2-135m-instruct with a reference and a 135M reward model, 2 processes, DDP and FSDP2."""
    reward_model = smollm_reward_model(work)
    flags = ["--model-name", "builtin:smollm2-135m-instruct", "--reward-model", reward_model, "--total-episodes", "8"]
    flags += ["--batch-size", "2", "--mini-batch-size", "1", "--min-new-tokens", "8", "--max-new-tokens", "8"]
    flags += ["--eval-samples", "2"]
    rows = []
    for port, launcher in enumerate(("ddp2", "fsdp2"), 29590):
        outputs = ["--output-dir", os.path.join(work, f"memory-{launcher}"), "--overwrite"]
        command = [*launcher_prefix(launcher, work, port), os.path.join(ROOT, "ppo.py"), *flags, *outputs]
        command += ["--log-dir", os.path.join(work, f"memory-{launcher}_runs")]
        code, seconds, rss, tail = run(command, env)
        rows.append((launcher, "pass" if code == 0 else "fail", f"{rss:.2f}", f"{seconds:.0f}"))
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main(args: Args) -> None:
    import torch

    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    nodrop = no_dropout_model(work)
    env = dict(os.environ, PYTHONPATH=ROOT, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env |= dict(HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    rows, port = [], 29600
    for script in args.scripts:
        flags, one, two = SCRIPTS[script]
        flags = [nodrop if f == "NODROP" else f for f in flags]
        reference = None
        for launcher in args.launchers:
            port += 1
            name = f"{script}-{launcher}"
            prefix = launcher_prefix(launcher, work, port)
            per_process = two if launcher.endswith("2") else one
            outputs = ["--output-dir", os.path.join(work, name), "--log-dir", os.path.join(work, f"{name}_runs")]
            command = [*prefix, os.path.join(ROOT, f"{script}.py"), *flags, *per_process, *outputs, "--overwrite"]
            code, seconds, rss, tail = run(command, env)
            values = losses(os.path.join(work, f"{name}_runs")) if code == 0 else []
            if launcher == "python":
                reference = values
            gap = ""
            if values and reference and len(values) == len(reference):
                gap = f"{max(abs(a - b) / max(abs(b), 1e-8) for a, b in zip(values, reference)):.1e}"
            # the script's one line, or the launcher's report of it ("traceback : error: ...") when it printed later
            error = next((line.split(" : ", 1)[-1] for line in tail.splitlines() if "error: " in line[:30]), "")
            if code and not error:
                error = next((line.strip() for line in reversed(tail.splitlines()) if "Error" in line), "")[:160]
            rows.append((script, launcher, "pass" if code == 0 else "fail", gap, f"{rss:.2f}", f"{seconds:.0f}", error))
            print(" | ".join(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        f.write("# Every script under every launcher (CPU)\n\n")
        f.write(f"Command: `python benchmarks/launchers.py`. Date: {time.strftime('%Y-%m-%d')}. Machine: {machine()}, ")
        f.write(f"torch {torch.__version__}, one thread per process, gloo; the launcher of each row in its column.\n\n")
        f.write(__doc__.split("\n\n", 2)[2].strip() + "\n\n")
        f.write("| script | launcher | result | loss gap to python | peak GiB per process | wall s | note |\n")
        f.write("|-|-|-|-|-|-|-|\n")
        for row in rows:
            f.write("| " + " | ".join(row) + " |\n")
        if args.memory:
            f.write("\n## Memory: ppo.py's three models at SmolLM2-135M's size\n\n")
            f.write("`ppo.py --model-name builtin:smollm2-135m-instruct --reward-model <135M classifier>`, 2 processes,")
            f.write(" 2 updates of 2 x 2 episodes: the policy with its value head and AdamW state, the reference and")
            f.write(" the reward model; peak resident memory of the largest process.\n\n")
            f.write("| launcher | result | peak GiB per process | wall s |\n|-|-|-|-|\n")
            for row in memory_rows(work, env):
                f.write("| " + " | ".join(row) + " |\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main(cli(Args))
