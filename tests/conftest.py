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


def run_failing(args: list[str], cwd: str) -> str:
    """Run a script's CLI that must fail on bad input; return its error message.

    In-process (runpy, as `python script.py ...` would): bad input is rejected before any training, so this
    skips the seconds a subprocess spends importing torch and transformers.
    """
    import runpy

    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv, error = [str(a) for a in args], None
    os.chdir(cwd)
    try:
        runpy.run_path(args[0], run_name="__main__")
    except Exception as e:  # noqa: BLE001 - the error is what the test checks
        error = f"{type(e).__name__}: {e}"
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    assert error is not None, f"{' '.join(map(str, args))} should have failed"
    return error


def ddp_launch() -> list[str]:
    """`accelerate launch` of 2 processes on a free port (tests may run in parallel workers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(port)]


# Real 2-process DDP over gloo on CPU: accelerate needs ACCELERATE_USE_CPU, or each process runs alone
DDP_ENV = dict(ACCELERATE_USE_CPU="1")
