"""Anticipated mistakes end every script with one line, `error: <what is wrong> (<how to fix it>)`, exit status 2 and
no traceback, before anything is trained or written."""

import os
import subprocess
import sys

import pytest
from conftest import RANDOM_MODEL, ROOT, run_failing

SCRIPTS = {name: os.path.join(ROOT, f"{name}.py") for name in ("ppo", "dpo", "sft", "reward_modeling", "ilql", "ddpo")}


def test_one_line_error_exit_status_2_and_no_traceback(tmp_path):
    for script, flags, message in (
        ("ppo", ["--batch-size", "10", "--mini-batch-size", "4"], "is not divisible by 4"),
        ("dpo", ["--beta", "-1"], "--beta -1.0: it must be > 0"),
    ):
        result = subprocess.run(
            [sys.executable, SCRIPTS[script], *flags],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT),
            timeout=120,
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1].startswith("error: ")
        assert message in result.stderr


@pytest.mark.parametrize(
    "script, flags, message",
    [
        # zero and negative budgets: nothing to train is an error, not a run that replaces the output with an untrained model
        ("ppo", ["--total-episodes", "0"], "--total-episodes 0: it must be > 0"),
        ("sft", ["--num-epochs", "0"], "--num-epochs 0: it must be > 0"),
        ("reward_modeling", ["--num-epochs", "-1"], "--num-epochs -1: it must be > 0"),
        ("dpo", ["--num-epochs", "0"], "--num-epochs 0: it must be > 0"),
        ("ilql", ["--num-epochs", "0"], "--num-epochs 0: it must be > 0"),
        ("ddpo", ["--num-epochs", "0"], "--num-epochs 0: it must be > 0"),
        # values that would silently train something else
        ("dpo", ["--label-smoothing", "0.5"], "label smoothing (the chance a label is flipped) lies in [0, 0.5)"),
        ("dpo", ["--max-prompt-length", "0"], "--max-prompt-length 0: it must be > 0"),
        ("sft", ["--max-seq-length", "1"], "a sequence needs at least 2 tokens"),
        ("ppo", ["--learning-rate", "0"], "--learning-rate 0.0: it must be > 0"),
        ("ppo", ["--eval-fraction", "1.5"], "--eval-fraction 1.5: it must be between 0 and 1"),
        ("ppo", ["--gamma", "2"], "gamma and lam lie in [0, 1]"),
        ("ilql", ["--tau", "1"], "--tau 1.0: it must be between 0 and 1"),
        ("ddpo", ["--train-clip-range", "-0.1"], "--train-clip-range -0.1: it must be > 0"),
        # files and folders that are not there, or not what they should be
        ("sft", ["--dataset-name", "missing/data.jsonl"], "no such file"),
        ("dpo", ["--model-name", "no/such-model-folder"], "no such file or folder here, nor a hub id"),
        ("ddpo", ["--pretrained-model", "no/such-pipeline"], "pipeline 'no/such-pipeline': no such file or folder here"),
        ("ddpo", ["--prompt-fn", "missing.py:prompts"], "no such file 'missing.py'"),
    ],
)
def test_bad_values_fail_before_training(tmp_path, script, flags, message):
    model = [] if script == "ddpo" else RANDOM_MODEL  # ddpo's is a pipeline: its default is already tiny
    error = run_failing([SCRIPTS[script], *model, *flags], tmp_path)
    assert error.startswith("UsageError: ") and message in error, error
    assert not (tmp_path / "outputs").exists()  # nothing written


def test_model_folders_without_a_model_or_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM

    from common.loading import load_pretrained

    (tmp_path / "empty").mkdir()
    assert "no config.json in the folder" in run_failing([SCRIPTS["dpo"], "--model-name", str(tmp_path / "empty")], tmp_path)
    load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).save_pretrained(tmp_path / "weights_only")
    error = run_failing([SCRIPTS["sft"], "--model-name", str(tmp_path / "weights_only")], tmp_path)
    assert "no tokenizer files in the folder" in error, error


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_an_error_under_two_processes_is_one_line_on_the_main_process(tmp_path, launcher):
    """A mistake found after the Accelerator exists (so after torch.distributed installed its exception hook, which
    swaps stderr for a buffer): one `error:` line, every rank non-zero, no hang; over gloo on CPU."""
    from conftest import DDP_ENV

    port = free_port()
    command = (
        ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", port]
        if launcher == "accelerate"
        else ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    )
    result = subprocess.run(
        [sys.executable, *command, SCRIPTS["dpo"], *RANDOM_MODEL, "--dataset-name", "missing.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, **DDP_ENV),
        timeout=300,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors == [
        "error: the dataset file 'missing.jsonl': no such file (from " + str(tmp_path) + ")"
    ], result.stderr[-3000:]
    assert "exitcode  : 0" not in result.stderr  # no rank ended as if nothing had gone wrong


def test_cheap_checks_come_before_building_a_preset(tmp_path):
    """A missing dataset file is reported before the default policy (builtin:tiny-chat, minutes to build on a fresh
    cache) is built: the fresh cache stays without it."""
    for script in ("dpo", "reward_modeling", "sft", "ilql"):
        model = ["--model-name", "builtin:tiny-chat"]
        result = subprocess.run(
            [sys.executable, SCRIPTS[script], *model, "--dataset-name", "missing.jsonl"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT, XDG_CACHE_HOME=str(tmp_path / "cache")),
            timeout=120,
        )
        assert result.returncode == 2 and "no such file" in result.stderr, result.stderr[-2000:]
        assert not (tmp_path / "cache" / "rlhf-builtin" / "tiny-chat-v1").exists(), script


def test_degenerate_input_is_refused_before_training(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"prompt": "Hello", "chosen": "Hi", "rejected": "No"}\n')
    assert "at least 2" in run_failing([SCRIPTS["dpo"], *RANDOM_MODEL, "--dataset-name", "one.jsonl"], tmp_path)
    error = run_failing([SCRIPTS["ppo"], *RANDOM_MODEL, "--stop-sequences", "", "--reward-model", "None"], tmp_path)
    assert "empty stop sequence" in error
