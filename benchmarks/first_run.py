"""The README's first two commands as a new user runs them: `accelerate config default`, then `accelerate launch ppo.py`,
once with an empty built-in cache (a temporary XDG_CACHE_HOME, so the two built-ins are built), then again on that
cache; accelerate's config goes to a temporary HF_HOME. For each run: the line it ends on, its wall time, and the peak
resident memory (VmHWM) of the training process. Writes benchmarks/RESULTS-first-run.json, from which README.md
renders the line (docs/build_assets.py); tests/test_ppo.py runs the default again and compares its line with it.

    python benchmarks/first_run.py

The thread count recorded is what accelerate gives the process (on CPU: one thread per physical core).

Runs in a temporary folder; nothing else is written but the record.
"""

import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-first-run.json")
sys.path.insert(0, ROOT)

from records import machine, write  # noqa: E402


def descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in descendants(c)]


def peak_memory(pid: int, peak: list) -> None:
    """Poll the VmHWM (peak resident set so far) of the launcher's processes until it exits: the largest is the
    training process's peak."""
    while os.path.exists(f"/proc/{pid}"):
        for p in [pid, *descendants(pid)]:
            try:
                with open(f"/proc/{p}/status") as f:
                    peak[0] = max(peak[0], next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20)
            except (OSError, StopIteration):
                pass
        time.sleep(0.2)


def environment(cache: str, home: str) -> dict:
    """A new user's environment, offline, with the built-ins and accelerate's config in these folders."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", HF_HOME=home)
    env.pop("OMP_NUM_THREADS", None)  # accelerate's own choice, as a new user gets it
    env["XDG_CACHE_HOME"] = cache
    return env


def launch(script: str, env: dict, cwd: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", script]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)


def run(cache: str, home: str) -> dict:
    """`accelerate launch ppo.py` in a fresh folder, the built-ins in `cache` (built there if it is empty)."""
    env = environment(cache, home)
    with tempfile.TemporaryDirectory(prefix="rlhf-first-run-") as folder:
        start, peak = time.time(), [0.0]
        process = launch(os.path.join(ROOT, "ppo.py"), env, folder)
        watcher = threading.Thread(target=peak_memory, args=(process.pid, peak), daemon=True)
        watcher.start()
        output = process.communicate()[0]
        seconds = time.time() - start
        watcher.join(timeout=5)
    if process.returncode != 0:
        raise SystemExit(f"python ppo.py exited {process.returncode}:\n{output[-3000:]}")
    line = next(line for line in output.splitlines() if line.startswith("ppo: "))
    return {"line": line, "seconds": seconds, "peak_gib": peak[0]}


def main() -> None:
    import torch

    with tempfile.TemporaryDirectory(prefix="rlhf-new-user-") as root:
        cache, home = os.path.join(root, "cache"), os.path.join(root, "hf")
        env = environment(cache, home)
        config = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default"]
        subprocess.run(config, env=env, check=True, capture_output=True)
        probe = os.path.join(root, "threads.py")
        with open(probe, "w") as f:
            f.write("import torch\nprint(torch.get_num_threads())\n")
        threads = int(launch(probe, env, root).communicate()[0].split()[-1])
        record = {
            "command": "python benchmarks/first_run.py",
            "machine": machine(),
            "launcher": "accelerate launch",
            "threads": threads,
            "torch": torch.__version__,
            "cold": run(cache, home),
        }
        print(f"cold: {record['cold']}", flush=True)
        record["warm"] = run(cache, home)
    print(f"warm: {record['warm']}")
    write(RESULTS, record)


if __name__ == "__main__":
    main()
