import os
import sys

# Offline by default: no hub retries, no wandb uploads
for key, value in dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
                       TOKENIZERS_PARALLELISM="false").items():
    os.environ.setdefault(key, value)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import subprocess  # noqa: E402

import pytest  # noqa: E402


def run_script(args: list[str], cwd: str, timeout: int = 600, **env_overrides) -> str:
    """Run a script through its real CLI (like CleanRL's tests); fail with its output when it fails."""
    env = dict(os.environ, PYTHONPATH=ROOT, **env_overrides)
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}")
    return result.stdout + result.stderr


# Real 2-process DDP over gloo on CPU: accelerate needs ACCELERATE_USE_CPU, or each process runs alone
DDP_LAUNCH = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
DDP_ENV = dict(ACCELERATE_USE_CPU="1")
