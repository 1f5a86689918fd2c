"""Every script under DeepSpeed ZeRO-2 and ZeRO-3 (and ppo.py under FSDP2) with one process against `python script.py`;
on a GPU also sft.py at Qwen2-0.5B's size under each config: step time, peak memory, the saved model.

    python benchmarks/deepspeed_matrix.py --out OUT_FOLDER --no-big      # on CPU: DeepSpeed runs one process there
    python benchmarks/deepspeed_matrix.py --out OUT_FOLDER --ppo-verifier # on one GPU (benchmarks/RESULTS-H200.md)

Part 1 runs launchers.py's tiny-preset commands (the same flags, in float32, online scripts with HF `generate` so
that every launcher samples alike) under `python`, ZeRO-2 and ZeRO-3 (DeepSpeed's config written per run with the
script's gradient accumulation, zero.Init asked for at stage 3) and, for ppo.py, configs/fsdp.yaml (bf16); several
at a time. The loss gap is the largest relative difference of a per-step loss to the `python` run's (online scripts:
a last-digit difference can change a later sample, and the loss with it). Part 2 runs benchmarks/profile_steps.py
around sft.py at 0.5B (bf16) with `accelerate launch --num_processes 1` plain, and with configs/deepspeed_zero2.yaml
and deepspeed_zero3.yaml (DeepSpeed steps each parameter group apart: two optimizer-hook times per step). Writes
OUT/deepspeed.md and OUT/logs.tar.gz.
"""

import argparse
import os
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from launchers import SCRIPTS, losses, no_dropout_model  # noqa: E402

DS = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: {steps}
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: {zero3}
  zero_stage: {stage}
num_machines: 1
num_processes: 1
mixed_precision: 'no'
use_cpu: false
"""


def command(script: str, launcher: str, work: str, nodrop: str, port: int, verifier: bool) -> list[str]:
    flags, one, _ = SCRIPTS[script]
    flags = [nodrop if f == "NODROP" else f for f in flags] + one
    flags += (
        ["--dataset-name", "reasoning-gym:chain_sum", "--reward-funcs", "verifier"] if script == "ppo" and verifier else []
    )
    flags += ["--no-fast-generation"] if script in ("ppo", "grpo", "rloo") else []
    steps = flags[flags.index("--gradient-accumulation-steps") + 1] if "--gradient-accumulation-steps" in flags else 1
    name = f"{script}-{launcher}"
    outputs = ["--output-dir", f"{work}/{name}", "--log-dir", f"{work}/{name}_runs", "--overwrite"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port)]
    if launcher == "python":
        prefix = [sys.executable]
    elif launcher == "fsdp1":
        prefix = [*launch, "--config_file", f"{ROOT}/configs/fsdp.yaml", "--num_processes", "1"]
    else:
        stage = launcher[-1]
        path = f"{work}/{name}.yaml"
        with open(path, "w") as f:
            f.write(DS.format(steps=steps, stage=stage, zero3=str(stage == "3").lower()))
        prefix = [*launch, "--config_file", path]
    return [*prefix, f"{ROOT}/{script}.py", *flags, *outputs]


def run(job) -> tuple:
    script, launcher, cmd, log, timeout = job
    start = time.time()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return script, launcher, code, time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where deepspeed.md (the table) and logs.tar.gz go")
    parser.add_argument("--table", help="the table's path instead of OUT/deepspeed.md, under a header naming the run")
    parser.add_argument("--work", default="/tmp/deepspeed_matrix")
    parser.add_argument(
        "--scripts", nargs="*", default=["sft", "reward_modeling", "dpo", "ppo", "grpo", "rloo", "gkd", "ilql"]
    )
    parser.add_argument("--launchers", nargs="*", default=["python", "zero2", "zero3", "fsdp1"])
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--job-timeout", type=int, default=300, help="seconds per run of part 1")
    parser.add_argument(
        "--ppo-verifier",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="ppo.py with the verifier on reasoning-gym:chain_sum, not builtin:tiny-chat-rm (built by training, once)",
    )
    parser.add_argument("--big", action=argparse.BooleanOptionalAction, default=True, help="part 2 (sft at 0.5B)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    os.environ.update(
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="2",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
    )
    os.environ.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    nodrop = no_dropout_model(args.work)
    jobs, port = [], 29700
    for script in args.scripts:
        for launcher in [x for x in args.launchers if x != "fsdp1" or script == "ppo"]:
            port += 1
            cmd = command(script, launcher, args.work, nodrop, port, args.ppo_verifier)
            jobs.append((script, launcher, cmd, f"{args.work}/{script}-{launcher}.log", args.job_timeout))
    with ThreadPoolExecutor(args.parallel) as pool:
        done = {(s, name): (c, t) for s, name, c, t in pool.map(run, jobs)}
    lines = ["| script | launcher | result | loss gap to python | steps | wall s | last error line |", "|-|-|-|-|-|-|-|"]
    for script, launcher, _, log, _ in jobs:
        code, seconds = done[(script, launcher)]
        values = losses(f"{args.work}/{script}-{launcher}_runs") if code == 0 else []
        reference = losses(f"{args.work}/{script}-python_runs")
        gap = ""
        if values and reference and len(values) == len(reference):
            gap = f"{max(abs(a - b) / max(abs(b), 1e-8) for a, b in zip(values, reference)):.1e}"
        text = open(log).read().splitlines()
        error = next((x for x in text if x.startswith("error:")), "") or next(
            (x.strip() for x in reversed(text) if "Error" in x or "error" in x), ""
        )
        result = "pass" if code == 0 else "fail"
        lines.append(f"| {script} | {launcher} | {result} | {gap} | {len(values)} | {seconds:.0f} | {error[:200]} |")
        print(lines[-1], flush=True)
    write(args, lines)
    if args.big:
        write(args, lines + ["", "sft.py at 0.5B (bf16), 1 process:", ""] + big(args.work))


def write(args, lines: list[str]) -> None:
    """The table so far, and every log, under --out (written after each part: a run cut short keeps the first)."""
    import torch

    with open(args.table or f"{args.out}/deepspeed.md", "w") as f:
        if args.table:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPU cores"
            f.write(
                f"# DeepSpeed with one process\n\nCommand: `python benchmarks/deepspeed_matrix.py {' '.join(sys.argv[1:])}`"
            )
            f.write(f". Date: {time.strftime('%Y-%m-%d')}. Machine: {device}, torch {torch.__version__}.\n\n")
            f.write(__doc__.split("\n\n", 2)[2].strip() + "\n\n")
        f.write("\n".join(lines) + "\n")
    with tarfile.open(f"{args.out}/logs.tar.gz", "w:gz") as tar:
        for name in sorted(os.listdir(args.work)):
            if name.endswith((".log", ".txt", ".yaml")):
                tar.add(f"{args.work}/{name}", arcname=name)


def step_times(line: str) -> str:
    """profile_steps.py's hook intervals as optimizer-step times: DeepSpeed steps each parameter group apart (two
    hooks per step for the scripts' two AdamW groups), so pairs of intervals are summed."""
    every = [float(x) for x in line.split(": ")[-1].rstrip(" s").split(", ") if x]
    if len(every) > 8:  # 8 steps give 7 intervals, or 15 with two hooks per step
        every = [a + b for a, b in zip(every[0::2], every[1::2])]
    every = sorted(every)
    return f"{every[len(every) // 2]:.3f} s ({every[0]:.3f}-{every[-1]:.3f})" if every else ""


def big(work: str) -> list[str]:
    import bench

    from common.loading import load_tokenizer

    shape = os.environ.get("SHAPE", "qwen2-0.5b")  # SHAPE=tiny: a dry run on CPU
    model = f"{work}/{shape}"
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    bench.random_model(shape, tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = f"{work}/sft.jsonl"
    bench.sft_texts(1024).to_json(data)
    sft = ["--model-name", model, "--dataset-name", data, "--packing", "--packing-strategy", "wrapped"]  # as recorded
    sft += ["--max-seq-length", "1024", "--batch-size", "8"]
    sft += ["--max-steps", "8", "--num-sample-generations", "0", "--eval-steps", "100"]
    rows = ["| launch | step time, median (range) | peak GiB | saved model |", "|-|-|-|-|"]
    for port, (name, cfg) in enumerate(
        [
            ("plain", ["--num_processes", "1", "--mixed_precision", "bf16"]),
            ("zero2", ["--config_file", f"{ROOT}/configs/deepspeed_zero2.yaml", "--num_processes", "1"]),
            ("zero3", ["--config_file", f"{ROOT}/configs/deepspeed_zero3.yaml", "--num_processes", "1"]),
        ],
        29800,
    ):
        profile = f"{work}/sft05b-{name}.txt"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port), *cfg]
        cmd += [f"{HERE}/profile_steps.py", "--skip", "5", "--steps", "1", "--rows", "15", "--out", profile, "--"]
        cmd += ["sft.py", *sft, "--output-dir", f"{work}/sft05b-{name}", "--overwrite"]
        with open(f"{work}/sft05b-{name}.log", "w") as f:
            try:
                code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=150).returncode
            except subprocess.TimeoutExpired:
                code = 124
        steps, peak, saved = "", "", ""
        if code == 0 and os.path.exists(profile):
            text = open(profile).read().splitlines()
            steps = step_times(next((x for x in text if x.startswith("every step")), ""))
            peak = next((x for x in text if x.startswith("peak memory")), "").split(": ")[-1]
            probe = (
                "import torch, sys; from transformers import AutoModelForCausalLM as M; m = M.from_pretrained(sys.argv[1]);"
                "p = list(m.parameters()); print(sum(x.numel() for x in p), p[0].dtype,"
                "all(torch.isfinite(x).all().item() for x in p))"
            )
            saved = (
                subprocess.run(
                    [sys.executable, "-c", probe, f"{work}/sft05b-{name}"], capture_output=True, text=True
                ).stdout.strip()
                or "does not load"
            )
        rows.append(f"| {name} | {steps if code == 0 else 'fail'} | {peak} | {saved} |")
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
