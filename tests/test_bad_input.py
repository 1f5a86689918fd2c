"""Anticipated mistakes end every script with one line, `error: <what is wrong> (<how to fix it>)`, exit status 2 and
no traceback, before anything is trained or written."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ARITH, RANDOM_MODEL, ROOT, run_failing, run_in_process, run_script

from common.core import UsageError

NAMES = ("ppo", "dpo", "kto", "sft", "reward_modeling", "ilql", "ddpo", "gkd")
SCRIPTS = {name: os.path.join(ROOT, f"{name}.py") for name in NAMES}


@pytest.mark.slow
def test_one_line_error_exit_status_2_and_no_traceback(tmp_path):
    """A real interpreter: exit status 2 and stderr is the error line alone, with no traceback and no library notice
    printed while the script imports (ddpo.py imports diffusers, whose Stable Diffusion pipeline made transformers
    print two lines about torchvision)."""
    for script, flags, message in (
        ("ppo", ["--batch-size", "10", "--mini-batch-size", "4"], "--batch-size 10 is not divisible by --mini-batch-size 4"),
        ("ddpo", ["--train-clip-range", "-0.1"], "--train-clip-range -0.1: it must be > 0"),
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
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and message in line, result.stderr[-2000:]


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
        ("dpo", ["--loss-type", "sigmoid", "sigmoid"], "--loss-type sigmoid sigmoid: name each loss once"),
        ("dpo", ["--loss-type", "sigmoid", "sft", "--loss-weights", "1"], "1 --loss-weights for 2 --loss-type"),
        ("dpo", ["--loss-type", "exo_pair"], "--loss-type exo_pair needs --label-smoothing above 0"),
        ("dpo", ["--loss-type", "hinge", "--label-smoothing", "0.1"], "--label-smoothing applies to the sigmoid, robust"),
        ("dpo", ["--ld-alpha", "1.5"], "--ld-alpha 1.5: it lies in [0, 1]"),
        ("dpo", ["--loss-type", "aot", "--use-weighting"], "--use-weighting with --loss-type aot: aot and aot_unpaired"),
        ("kto", ["--batch-size", "1"], "--batch-size 1 with --loss-type kto: the KL estimate pairs"),
        ("kto", ["--desirable-weight", "0"], "--desirable-weight 0.0: it must be > 0"),
        ("dpo", ["--loss-type", "bco_pair", "--f-divergence-type", "forward_kl"], "only sigmoid, sigmoid_norm, hinge"),
        ("dpo", ["--max-prompt-length", "0"], "--max-prompt-length 0: it must be > 0"),
        ("sft", ["--max-seq-length", "1"], "a sequence needs at least 2 tokens"),
        ("ppo", ["--learning-rate", "0"], "--learning-rate 0.0: it must be > 0"),
        ("ppo", ["--eval-fraction", "1.5"], "--eval-fraction 1.5: it must be between 0 and 1"),
        ("ppo", ["--gamma", "2"], "gamma and lam lie in [0, 1]"),
        ("ilql", ["--tau", "1"], "--tau 1.0: it must be between 0 and 1"),
        ("ddpo", ["--train-clip-range", "-0.1"], "--train-clip-range -0.1: it must be > 0"),
        # files and folders that are not there, or not what they should be
        ("sft", ["--dataset-name", "missing/data.jsonl"], "no such file"),
        ("dpo", ["--model-name", "no/such-model-folder"], "--model-name no/such-model-folder: no such file or folder here"),
        (
            "ddpo",
            ["--pretrained-model", "no/such-pipeline"],
            "--pretrained-model no/such-pipeline: no such file or folder here",
        ),
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


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_stop_signal_inside_the_exception_hook_ends_it_as_the_hook_would(monkeypatch, capfd, rank):
    """The launcher's SIGTERM may reach a rank while it is already reporting a mistake (its exception hook, before the
    hook waits for the launcher): the main rank still writes its one line and exits 2, another rank exits 143 without
    a word; neither raises inside the hook (which printed "Error in sys.excepthook" and both tracebacks)."""
    import signal

    from common import cli

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli.os, "_exit", exit_)
    monkeypatch.setattr(cli, "_TERMINATED", [])
    monkeypatch.setattr(cli, "_wait_for_the_launcher", lambda seconds: None)
    stdout, flush = cli.sys.stdout, cli.sys.stdout.flush

    def signal_at_the_first_call():  # the hook's first call (stdout's flush), before the line
        stdout.flush = flush
        cli._terminate(signal.SIGTERM, sys._getframe(1))

    monkeypatch.setattr(stdout, "flush", signal_at_the_first_call)
    try:
        cli._report(UsageError, UsageError("--dataset-name missing.jsonl: no such file"), None)
    except Exited as exited:
        code = exited.args[0]
    except BaseException as error:  # noqa: BLE001 - Terminated, raised inside the hook
        pytest.fail(f"{type(error).__name__} raised inside the exception hook")
    assert code == (2 if rank == "0" else 143)
    err = capfd.readouterr().err
    assert ("error: --dataset-name missing.jsonl" in err) == (rank == "0") and "Traceback" not in err, err


def test_a_stop_signal_inside_torch_distributed_s_exception_hook_is_not_raised_there(monkeypatch):
    """torch.distributed wraps the exception hook in its own: a SIGTERM that lands in the wrapper, before it calls
    ours, is treated as one inside ours (raised there, it printed "Error in sys.excepthook" and both tracebacks)."""
    import signal

    from common import cli

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(cli, "_TERMINATED", [])

    def _distributed_excepthook(*args):  # torch's wrapper, as far as the signal is concerned
        cli._terminate(signal.SIGTERM, sys._getframe())

    monkeypatch.setattr(cli.sys, "excepthook", _distributed_excepthook)
    _distributed_excepthook(UsageError, UsageError("a mistake"), None)  # raises nothing
    assert cli._TERMINATED == []
    with pytest.raises(cli.Terminated):  # outside any hook the signal still stops the run
        cli._terminate(signal.SIGTERM, sys._getframe())


def test_a_stop_signal_inside_a_finalizer_ends_the_run_with_its_line(tmp_path):
    """A SIGTERM whose handler runs inside a `__del__` (garbage collection runs finalizers at any moment, imports
    included): Python would print Terminated as "Exception ignored" and train on, deaf to the next SIGTERM; the run
    ends with exit 143 and its one line instead."""
    script = tmp_path / "finalizer.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from common import cli\n"
        "sys.excepthook = cli._report\n"
        "cli.handle_signals()\n"
        "class Stop:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        sum(range(1000))\n"
        "Stop()\n"
        "time.sleep(10)\n"
        "print('trained on')\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60
    )
    assert result.returncode == 143 and "trained on" not in result.stdout, (result.stdout, result.stderr)
    assert result.stderr.strip() == "interrupted: nothing was saved.", result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_an_error_under_two_processes_is_one_line_on_the_main_process(tmp_path, launcher):
    """A mistake found after the Accelerator exists (so after torch.distributed installed its exception hook, which
    swaps stderr for a buffer): one `error:` line, every rank non-zero, no hang; over gloo on CPU. No frame of this
    code follows it: rank 1, stopped by the launcher while it waits for rank 0 to report, ends without a word (its
    SIGTERM raised inside the exception hook printed "Error in sys.excepthook" and both tracebacks). What remains
    under the line is the launcher's own failure summary, which names the line as its cause."""
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
        "error: --dataset-name missing.jsonl: no such file (from " + str(tmp_path) + ")"
    ], result.stderr[-3000:]
    assert "exitcode  : 0" not in result.stderr  # no rank ended as if nothing had gone wrong
    ours = re.search(rf'File "{re.escape(ROOT)}/(?!\.venv/)', result.stderr)  # a frame of this code, not a library's
    assert "Error in sys.excepthook" not in result.stderr and not ours, result.stderr[-3000:]


def test_cheap_checks_come_before_building_a_preset(tmp_path):
    """A missing dataset file is reported before the default policy (builtin:tiny-chat, minutes to build on a fresh
    cache) is built: the fresh cache stays without it."""
    for script in ("dpo", "reward_modeling", "sft", "ilql"):
        model = ["--model-name", "builtin:tiny-chat"]
        command = [SCRIPTS[script], *model, "--dataset-name", "missing.jsonl"]
        _, error = run_in_process(command, tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))  # exit 2: tests below
        assert isinstance(error, UsageError) and "no such file" in str(error), error
        assert not (tmp_path / "cache" / "rlhf-builtin" / "tiny-chat-v3").exists(), script


def test_degenerate_input_is_refused_before_training(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"prompt": "Hello", "chosen": "Hi", "rejected": "No"}\n')
    assert "at least 2" in run_failing([SCRIPTS["dpo"], *RANDOM_MODEL, "--dataset-name", "one.jsonl"], tmp_path)
    error = run_failing([SCRIPTS["ppo"], *RANDOM_MODEL, "--stop-sequences", "", "--reward-model", "None"], tmp_path)
    assert "empty stop sequence" in error


# ---------------------------------------------------------------- outputs: never destroy what this codebase did not write
ALL = ("ppo", "dpo", "kto", "sft", "reward_modeling", "ilql", "ddpo", "grpo", "rloo", "gkd")
SFT_QUICK = ["--max-steps", "2", "--eval-steps", "1000", "--max-seq-length", "32", "--num-sample-generations", "0"]


@pytest.mark.parametrize("script", [*ALL, "pipeline"])
def test_an_output_folder_that_is_not_ours_is_refused_and_left_as_it_is(tmp_path, script):
    """The working directory, a folder above it, a folder of the user's files, a file, '' and a folder under a file are
    refused before anything loads, and every file stays as it was."""
    path = os.path.join(ROOT, f"{script}.py")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "data.csv").write_text("precious")
    (tmp_path / "notes.txt").write_text("precious")
    for output, message in (
        (".", "that is the working directory"),
        (str(tmp_path), "that is the working directory"),
        ("..", "a folder above it"),
        ("", "--output-dir is empty"),
        ("project", "the folder holds files this codebase did not write (data.csv)"),
        ("notes.txt", "a file of that name exists"),
        ("notes.txt/model", "is a file, so no folder can be made under it"),
    ):
        error = run_failing([path, "--output-dir", output], tmp_path)
        assert error.startswith("UsageError: --output-dir") and message in error, (output, error)
    assert (tmp_path / "project" / "data.csv").read_text() == "precious" and (tmp_path / "notes.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "project"]  # nothing written, nothing left behind


@pytest.mark.slow
def test_a_model_folder_of_an_earlier_run_is_replaced_only_with_overwrite(tmp_path):
    """A run's folders carry a marker: a second run refuses them without --overwrite (model and checkpoints alike),
    replaces them with it, and resuming from one of its own checkpoints needs no flag; the marker never stops
    from_pretrained."""
    from transformers import AutoModelForCausalLM

    from common.outputs import MARKER

    command = [SCRIPTS["sft"], *RANDOM_MODEL, *SFT_QUICK, "--save-steps", "1", "--output-dir", "outputs/sft"]
    run_script(command, tmp_path)
    assert (tmp_path / "outputs" / "sft" / MARKER).is_file() and (
        tmp_path / "outputs" / "sft_checkpoints" / "step_1" / MARKER
    ).is_file()
    before = (tmp_path / "outputs" / "sft" / "model.safetensors").read_bytes()
    error = run_failing(command, tmp_path)
    assert "--output-dir outputs/sft: it holds the model of an earlier run; pass --overwrite" in error, error
    out = run_script([*command, "--overwrite", "--seed", "2"], tmp_path)
    assert "model saved to outputs/sft" in out and (tmp_path / "outputs" / "sft" / "model.safetensors").read_bytes() != before
    AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "sft")
    (tmp_path / "outputs" / "sft_checkpoints" / "mine.txt").write_text("precious")
    error = run_failing([*command, "--overwrite"], tmp_path)
    assert "outputs/sft_checkpoints: the folder holds files this codebase did not write (mine.txt)" in error, error


def test_atomic_saves_refuse_foreign_folders_and_non_finite_weights(tmp_path):
    """The last line of defence: a save never replaces a folder of other files, and never writes NaN or inf weights;
    the previous model stays as it was."""
    from safetensors.torch import save_file

    from common.core import UsageError
    from common.outputs import MARKER, atomic_directory

    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "a.txt").write_text("precious")
    with pytest.raises(UsageError, match="holds files this codebase did not write"):
        with atomic_directory(str(tmp_path / "theirs")) as tmp:
            pass
    assert (tmp_path / "theirs" / "a.txt").read_text() == "precious"
    with atomic_directory(str(tmp_path / "ours")) as tmp:
        save_file({"w": torch.ones(2)}, os.path.join(tmp, "model.safetensors"))
    with pytest.raises(UsageError, match="1 tensors hold NaN or inf"):
        with atomic_directory(str(tmp_path / "ours")) as tmp:
            save_file(
                {"w": torch.tensor([1.0, float("nan")]), "steps": torch.tensor([3])}, os.path.join(tmp, "model.safetensors")
            )
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "ours" / "model.safetensors"))["w"].tolist() == [1.0, 1.0]  # the previous save
    assert sorted(os.listdir(tmp_path)) == ["ours", "theirs"] and (tmp_path / "ours" / MARKER).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sft", "dpo", "kto", "reward_modeling", "ilql"])
def test_a_diverging_run_stops_with_one_line_and_saves_nothing(tmp_path, script, pairs_file):
    """A learning rate that blows the weights up: the run stops at the first non-finite loss or gradient norm, names
    the step, and the earlier model in --output-dir stays as it was."""
    data = [] if script in ("sft", "ilql") else ["--dataset-name", pairs_file]
    quick = ["--max-steps", "4", "--eval-steps", "1000", "--batch-size", "4"]
    (tmp_path / "outputs" / script).mkdir(parents=True)
    from common.outputs import MARKER

    (tmp_path / "outputs" / script / MARKER).write_text("{}")
    (tmp_path / "outputs" / script / "model.safetensors").write_text("the earlier model")
    flags = [*RANDOM_MODEL, *data, *quick, "--learning-rate", "1e9", "--max-grad-norm", "1e30", "--overwrite"]
    error = run_failing([SCRIPTS[script], *flags, "--output-dir", f"outputs/{script}"], tmp_path)
    assert re.search(r"UsageError: \S+ is (nan|inf) at step \d: training diverged \(lower --learning-rate", error), error
    assert (tmp_path / "outputs" / script / "model.safetensors").read_text() == "the earlier model"


# ---------------------------------------------------------------- data, models and checkpoints that cannot be read
@pytest.mark.parametrize(
    "script, rows, message",
    [
        ("reward_modeling", [{"margin": 1.0}, {"margin": float("nan")}], "The column 'margin', row 1: nan is not a finite"),
        ("ilql", [{"reward": float("inf")}, {"reward": 1.0}], "The column 'reward', row 0: inf is not a finite number"),
    ],
)
def test_numeric_columns_with_nan_or_inf_are_refused(tmp_path, script, rows, message):
    import json

    base = {"prompt": "Hi", "chosen": "Hello there", "rejected": "Go away", "completion": "Hello"}
    lines = [json.dumps(base | row).replace("NaN", "NaN").replace("Infinity", "Infinity") for row in rows * 4]
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    column = ["--margin-column", "margin"] if script == "reward_modeling" else ["--reward-column", "reward"]
    error = run_failing([SCRIPTS[script], *RANDOM_MODEL, "--dataset-name", "data.jsonl", *column], tmp_path)
    assert message in error, error


def test_data_files_that_are_not_utf8_json_lines(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}] * 4).to_parquet(tmp_path / "pairs.parquet")
    (tmp_path / "parquet.jsonl").write_bytes((tmp_path / "pairs.parquet").read_bytes())
    (tmp_path / "stray.jsonl").write_bytes(b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "caf\xe9"}\n')
    (tmp_path / "blank.jsonl").write_text("\n\n   \n")
    (tmp_path / "mixed.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n[1, 2]\n')
    for name, message in (
        ("parquet.jsonl", "--dataset-name parquet.jsonl, line 4: not UTF-8 text (byte 0x94)"),
        ("stray.jsonl", "--dataset-name stray.jsonl, line 2: not UTF-8 text (byte 0xe9)"),
        ("blank.jsonl", "--dataset-name blank.jsonl: the file holds only blank lines"),
        ("mixed.jsonl", "--dataset-name mixed.jsonl: its rows do not make one table"),
    ):
        error = run_failing([SCRIPTS["dpo"], *RANDOM_MODEL, "--dataset-name", name], tmp_path)
        assert message in error, error
    flags = ["--dataset-name", "pairs.parquet", "--max-steps", "2", "--batch-size", "2", "--eval-fraction", "0.25"]
    assert "dpo: 2 steps" in run_script([SCRIPTS["dpo"], *RANDOM_MODEL, *flags], tmp_path)  # a parquet file reads


def test_model_folders_without_weights_or_with_truncated_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from common.loading import load_pretrained, load_tokenizer

    model = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)
    for name in ("no_weights", "truncated"):
        model.save_pretrained(tmp_path / name)
        load_tokenizer("builtin:tiny-gpt2").save_pretrained(tmp_path / name)
    os.remove(tmp_path / "no_weights" / "model.safetensors")
    weights = tmp_path / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for name in ("no_weights", "truncated"):
        error = run_failing([SCRIPTS["sft"], "--model-name", str(tmp_path / name)], tmp_path)
        assert error.startswith(f"UsageError: --model-name {tmp_path / name}: its files cannot be loaded ("), error
        assert "save the model again, or pass another folder" in error, error


@pytest.mark.slow
def test_checkpoints_that_are_truncated_corrupt_or_of_another_script(tmp_path):
    import shutil

    command = [SCRIPTS["sft"], *RANDOM_MODEL, *SFT_QUICK, "--save-steps", "1", "--output-dir", "outputs/sft"]
    run_script(command, tmp_path)
    good = tmp_path / "outputs" / "sft_checkpoints" / "step_1"
    cases = {}
    for case in ("weights", "state", "optimizer"):
        cases[case] = tmp_path / f"bad_{case}"
        shutil.copytree(good, cases[case])
    weights = cases["weights"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (cases["state"] / "trainer_state.json").write_text('{"step": 1, "run"')
    optimizer = cases["optimizer"] / "accelerate_state" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    for case, message in (
        ("weights", "a file of the checkpoint cannot be read (SafetensorError"),
        ("state", "a file of the checkpoint cannot be read (JSONDecodeError"),
        ("optimizer", "the checkpoint does not load into this run ("),
    ):
        error = run_failing([*command, "--resume-from", str(cases[case]), "--output-dir", f"out_{case}"], tmp_path)
        assert error.startswith(f"UsageError: --resume-from {cases[case]}: {message}"), (case, error)
    error = run_failing([SCRIPTS["dpo"], *RANDOM_MODEL, "--resume-from", str(good)], tmp_path)
    assert f"--resume-from {good}: a checkpoint of sft.py; resume it with sft.py." in error, error


def test_tiny_datasets_with_max_steps_are_one_line(tmp_path, pairs_file):
    """Fewer examples than one batch, with --max-steps: no ZeroDivisionError, one line naming the sizes."""
    import json

    rows = [json.loads(line) for line in open(pairs_file)][:6]
    (tmp_path / "six.jsonl").write_text("\n".join(json.dumps(r | {"text": r["prompt"]}) for r in rows))
    for script in ("sft", "dpo", "reward_modeling", "ilql"):
        extra = ["--prompt-column", "prompt", "--response-column", "chosen"] if script == "ilql" else []
        error = run_failing(
            [SCRIPTS[script], *RANDOM_MODEL, "--dataset-name", "six.jsonl", "--max-steps", "5", *extra], tmp_path
        )
        assert re.search(r"^UsageError: [56] (training \w+|samples) make no optimizer step of (8|16|32) x 1", error), (
            script,
            error,
        )


def test_an_integer_answer_column_is_accepted(tmp_path):
    import json

    rows = [{"question": f"What is {a} + {b}?", "answer": a + b} for a in range(5) for b in range(4)]
    (tmp_path / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    flags = ["--dataset-name", "sums.jsonl", "--prompt-column", "question", "--total-prompts", "8", "--batch-size", "4"]
    flags += ["--num-generations", "2", "--mini-batch-size", "8", "--gradient-accumulation-steps", "1"]
    flags += ["--max-completion-length", "4", "--eval-samples", "4"]
    out = run_script([os.path.join(ROOT, "grpo.py"), *ARITH["grpo"], *RANDOM_MODEL, *flags], tmp_path)
    assert "grpo: 2 updates" in out


@pytest.mark.parametrize("script", ["grpo", "rloo", "gkd", "ppo"])
def test_an_empty_or_blank_prompt_is_one_line_naming_the_file_and_the_row(tmp_path, script):
    """An empty or whitespace-only prompt (text, or a chat whose messages are blank) is refused before any model loads,
    naming the file and the row: refused rather than skipped, since the data then trains on other rows than it says
    (TRL fails inside `generate` on it)."""
    rows = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(12)]
    for bad, value in ((3, ""), (5, " \n\t")):
        data = [dict(r) for r in rows]
        data[bad]["prompt"] = value
        (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in data))
        error = run_failing([os.path.join(ROOT, f"{script}.py"), "--dataset-name", "data.jsonl"], tmp_path)
        assert f"UsageError: data.jsonl: the column 'prompt', row {bad}: the prompt is empty" in error, error
    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    chats[7]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  "}]
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in chats))
    error = run_failing([os.path.join(ROOT, f"{script}.py"), "--dataset-name", "chats.jsonl"], tmp_path)
    assert "chats.jsonl: the column 'prompt', row 7: the prompt is empty" in error, error


# ---------------------------------------------------------------- the same checks everywhere
def test_ppo_catches_what_grpo_catches(tmp_path):
    (tmp_path / "unscored.py").write_text("def unscored(prompts, completions, **kw):\n    return [None] * len(completions)\n")
    (tmp_path / "empty.jsonl").write_text('{"prompt": ""}\n' * 20)
    tiny = [*RANDOM_MODEL, "--batch-size", "8", "--mini-batch-size", "4", "--min-new-tokens", "4", "--max-new-tokens", "4"]
    tiny += ["--eval-samples", "4"]
    error = run_failing([SCRIPTS["ppo"], *tiny, "--reward-weights", "1.0"], tmp_path)
    assert "--reward-weights weighs the --reward-funcs: pass the reward functions too" in error, error
    error = run_failing([SCRIPTS["ppo"], *tiny, "--dataset-name", "empty.jsonl", "--reward-model", "None"], tmp_path)
    assert "empty.jsonl: the column 'prompt', row 0: the prompt is empty" in error, error
    out = run_script([SCRIPTS["ppo"], *tiny, "--total-episodes", "8", "--reward-funcs", "unscored.py:unscored"], tmp_path)
    assert "warning: no reward function scored a batch of responses (all returned None)" in out


def test_ddpo_plugins_get_one_line_errors(tmp_path):
    (tmp_path / "plugins.py").write_text(
        "import torch\n\n\n"
        "def raising_prompt():\n    return {}['missing']\n\n\n"
        "def bare_prompt():\n    return 'a cat'\n\n\n"
        "def raising_reward(images, prompts, metadata):\n    return 1 / 0\n\n\n"
        "def words(images, prompts, metadata):\n    return ['high'] * len(images)\n"
    )
    (tmp_path / "broken.py").write_text("import no_such_module\n")
    for flags, message in (
        (["--prompt-fn", "broken.py:f"], "--prompt-fn broken.py:f: importing broken.py failed: ModuleNotFoundError"),
        (["--reward-fn", "no_such_module:f"], "importing no_such_module failed: ModuleNotFoundError: No module named"),
        (["--prompt-fn", "plugins.py:raising_prompt"], "--prompt-fn plugins.py:raising_prompt raised KeyError: 'missing'"),
        (["--prompt-fn", "plugins.py:bare_prompt"], "returned 'a cat': return (prompt, metadata dict)"),
        (["--reward-fn", "plugins.py:raising_reward"], "--reward-fn plugins.py:raising_reward raised ZeroDivisionError"),
        (["--reward-fn", "plugins.py:words"], "--reward-fn plugins.py:words returned \"['high', 'high']\""),
    ):
        error = run_failing([SCRIPTS["ddpo"], *flags], tmp_path)
        assert error.startswith("UsageError: ") and message in error, error
        if "raising" in flags[1]:
            assert "plugins.py, line" in error, error
        assert "importlib" not in error, error  # the user's file is named, never the import machinery's


@pytest.mark.slow
def test_flags_without_effect_warn_once_and_bad_lora_flags_fail(tmp_path):
    from conftest import run_in_process

    (tmp_path / "chat.jsonl").write_text(
        '{"messages": [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Hi"}]}\n'
    )
    cases = (
        (
            ["sft", "--lora-r", "4", "--dtype", "float16"],
            ["--lora-r has no effect without --use-peft", "--dtype float16 trains"],
        ),
        (["gkd", "--seq-kd"], ["--seq-kd has no effect with --lmbda 1"]),
        (["sft", "--dataset-name", "chat.jsonl"], ["unknown chat roles ['narrator']"]),
    )
    for (script, *flags), warnings in cases:
        stop = ["--model-name", "no/such-model"] if script != "sft" or "chat.jsonl" not in flags else []
        output, error = run_in_process(
            [SCRIPTS.get(script, os.path.join(ROOT, f"{script}.py")), *RANDOM_MODEL, *flags, *stop], tmp_path
        )
        assert error is not None, output[-1000:]
        for warning in warnings:
            assert output.count(f"warning: {warning}") == 1, (warning, output[-2000:])
    out = run_script([SCRIPTS["dpo"], *RANDOM_MODEL, "--system-prompt", "Be kind.", "--max-steps", "1"], tmp_path)
    assert out.count("warning: --system-prompt has no effect: the prompts go to the model as raw text") == 1, out[-2000:]
    for flags, message in (
        (["--seed", "-1"], "--seed -1: it must lie in [0, 2**32 - 1024)"),
        (["--use-peft", "--lora-r", "0"], "--lora-r 0: it must be > 0"),
        (["--use-peft", "--lora-dropout", "1"], "--lora-dropout 1.0: it must lie in [0, 1)"),
        (
            ["--use-peft", "--lora-target-modules", "q_proj"],
            "--lora-target-modules q_proj: no such module in the model; its linear layers",
        ),
    ):
        assert message in run_failing([SCRIPTS["sft"], *RANDOM_MODEL, *flags], tmp_path)


@pytest.mark.slow
def test_hub_ids_fail_at_once_offline_and_name_their_flag(tmp_path):
    """Without HF_HUB_OFFLINE and with no route to the hub: one line naming the flag and the fix, no retries."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_ENDPOINT"] = "https://hub.invalid"  # never resolves, whatever network this machine has
    result = subprocess.run(
        [sys.executable, SCRIPTS["ppo"], "--model-name", "no-such-org/no-such-model"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(env, PYTHONPATH=ROOT),
        timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1] == (
        "error: --model-name no-such-org/no-such-model: no such file or folder here, and the hub cannot be reached "
        "(offline); pass a local folder, a builtin: name, or a hub id with network access."
    ), result.stderr[-3000:]
    assert not any("retry" in line.lower() or "Traceback" in line for line in lines), result.stderr[-3000:]


@pytest.mark.slow
def test_a_usage_box_prints_once_under_two_processes(tmp_path):
    from conftest import DDP_ENV

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            free_port(),
            SCRIPTS["dpo"],
            "--no-such-flag",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, **DDP_ENV),
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and output.count("Unrecognized options: --no-such-flag") == 1, output[-3000:]


def test_a_byte_order_mark_is_read_and_a_system_only_conversation_is_refused(tmp_path):
    """A jsonl that a Windows editor saved with a UTF-8 byte-order mark trains like one without; a conversation of
    system messages only, with nothing to train on, is a one-line error naming its row."""
    from common.loading import load_data

    rows = [{"prompt": f"question {i}", "chosen": "good", "rejected": "bad"} for i in range(8)]
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    assert load_data(str(tmp_path / "bom.jsonl")).to_list() == rows
    flags = ["--dataset-name", "bom.jsonl", "--max-steps", "1", "--batch-size", "2", "--eval-fraction", "0.25"]
    assert "dpo: 1 steps" in run_script([SCRIPTS["dpo"], *RANDOM_MODEL, *flags], tmp_path)
    conversations = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]] * 3
    conversations.insert(2, [{"role": "system", "content": "You are helpful."}])
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in conversations))
    error = run_failing([SCRIPTS["sft"], "--dataset-name", "chat.jsonl", "--text-column", "messages"], tmp_path)
    assert "The column 'messages', row 2: a conversation of system messages only" in error, error


@pytest.mark.parametrize("script", ["grpo", "rloo", "ppo"])
def test_one_message_per_failed_check(tmp_path, script):
    """--top-p 0 names --top-p alone (it once shared a line with another flag's check)."""
    path = os.path.join(ROOT, f"{script}.py")
    error = run_failing([path, *RANDOM_MODEL, "--top-p", "0"], tmp_path)
    assert error == "UsageError: --top-p 0.0: it lies in (0, 1].", error


@pytest.mark.parametrize("script", ["sft", "grpo"])
def test_logs_inside_the_output_folder_are_refused_before_anything_loads(tmp_path, script):
    """The final save replaces its output folder, so --log-dir inside it (or equal to it) would lose the logs at the
    run's end: one line before anything loads, and nothing written."""
    for logs in ("out", "out/runs"):
        error = run_failing([os.path.join(ROOT, f"{script}.py"), "--output-dir", "out", "--log-dir", logs], tmp_path)
        assert f"--log-dir {logs} lies in --output-dir out, which a save replaces: keep them apart." in error, error
    assert os.listdir(tmp_path) == []
