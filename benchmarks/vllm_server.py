"""grpo.py sampling through a vLLM server (`--vllm-mode server`) against a colocated float32 engine (`--use-vllm`), on one
machine in one sitting: benchmarks/speed_cpu.py's real-model recipe (builtin:smollm2-135m-instruct, 8 prompts x 4
completions of 32 tokens, float32), each side a fresh process per run, the runs interleaved for `--rounds` rounds. One
server (`python -m common.vllm_server`, float32) serves every server-mode run; its start is timed once. A run's step
time is the median of its updates after the first, and its rollout time (time/generate) likewise. Writes
benchmarks/RESULTS-vllm-server.json (docs/vllm.md renders it).

    python benchmarks/vllm_server.py              # 3 rounds of 4 updates (about 10 minutes on 2 cores)
"""

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro
from records import header, scalars
from speed_cpu import MODEL, RECIPE

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class Args:
    rounds: int = 3
    """interleaved rounds: one run of each side per round"""
    steps: int = 4
    """updates per run; the first is left out of the timing"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(steps: int, *flags: str) -> dict:
    """grpo.py at the recipe for `steps` updates: the median time/step and time/generate after the first update."""
    with tempfile.TemporaryDirectory(prefix="rlhf-vllm-server-") as folder:
        command = [sys.executable, "grpo.py", *RECIPE, "--use-vllm", *flags, "--total-prompts", str(8 * steps)]
        command += ["--output-dir", os.path.join(folder, "out"), "--log-dir", os.path.join(folder, "runs")]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        logs = os.path.join(folder, "runs")
        return {tag: statistics.median(v for _, v in scalars(logs, f"time/{tag}")[1:]) for tag in ("step", "generate")}


if __name__ == "__main__":
    args = tyro.cli(Args)
    port = free_port()
    serve = [sys.executable, "-m", "common.vllm_server", "--model-name", MODEL, "--port", str(port), "--dtype", "float32"]
    start = time.time()
    server = subprocess.Popen(serve, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while subprocess.run(["curl", "-sf", f"{url}/health"], capture_output=True).returncode:
            if server.poll() is not None:
                sys.exit("the vLLM server did not start: run its command by hand to see why")
            time.sleep(1)
        started = time.time() - start
        print(f"server up in {started:.0f}s", flush=True)
        sides = {"colocate": ["--vllm-dtype", "float32"], "server": ["--vllm-mode", "server", "--vllm-server-base-url", url]}
        results = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                results[side].append(run(args.steps, *sides[side], "--vllm-group-port", str(free_port())))
                print(f"round {round_ + 1} {side}: {results[side][-1]}", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
    rows = {
        side: {tag: dict(median=statistics.median(r[tag] for r in runs), runs=[r[tag] for r in runs]) for tag in runs[0]}
        for side, runs in results.items()
    }
    record = header(f"python benchmarks/vllm_server.py --rounds {args.rounds} --steps {args.steps}")
    record |= dict(recipe=" ".join(RECIPE), server_start_s=started, rows=rows)
    record["ratio"] = rows["server"]["step"]["median"] / rows["colocate"]["step"]["median"]
    with open(os.path.join(HERE, "RESULTS-vllm-server.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"server / colocate step time: {record['ratio']:.2f} (wrote benchmarks/RESULTS-vllm-server.json)")
