"""What a run writes (common/outputs.py): one run per output folder at a time, links written through, and Ctrl-C or
SIGTERM (under every launcher) that ends a run with one line, its previous model intact."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import RANDOM_MODEL, ROOT, free_port, run_failing, run_script

SFT = os.path.join(ROOT, "sft.py")
TINY_SFT = [SFT, *RANDOM_MODEL, "--max-seq-length", "32", "--eval-steps", "1000", "--eval-fraction", "0.01"]

# Runs a script as __main__ with every save into a `.tmp-<name>-` folder paused for a minute once its model is written,
# after touching the file $PAUSED: a test can then interrupt the run in the middle of that save, every time
PAUSE_SAVE = """
import os, runpy, sys, time
import transformers

save = transformers.PreTrainedModel.save_pretrained

def paused_save(self, folder, *args, **kwargs):
    save(self, folder, *args, **kwargs)
    if os.path.basename(str(folder)).startswith(".tmp-" + os.environ["PAUSE_IN"] + "-"):
        open(os.environ["PAUSED"], "w").close()
        time.sleep(60)

transformers.PreTrainedModel.save_pretrained = paused_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def start(args: list[str], cwd, **env) -> subprocess.Popen:
    """A run as a terminal starts it: SIGINT at its default (Python then turns it into KeyboardInterrupt) even where
    the suite itself was started in the background (`cmd &`), whose children inherit it ignored."""
    environment = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env)
    return subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def wait_for(path, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_command_run_twice_gives_two_runs_each_in_its_own_folder(tmp_path):
    """`python ppo.py` twice in one folder: --output-dir left at its default, the second run saves beside the first
    (outputs/ppo-2, saying so), whose model stays as it was; a third takes outputs/ppo-3. Given explicitly, a folder
    holding a model is refused as before."""
    ppo = [os.path.join(ROOT, "ppo.py"), "--model-name", "builtin:tiny-gpt2", "--reward-model", "None"]
    ppo += ["--total-episodes", "8", "--batch-size", "8", "--mini-batch-size", "8", "--max-new-tokens", "4"]
    ppo += ["--min-new-tokens", "4", "--eval-samples", "4", "--ppo-epochs", "1"]
    assert "model saved to outputs/ppo\n" in run_script(ppo, tmp_path) + "\n"
    first = (tmp_path / "outputs" / "ppo" / "model.safetensors").read_bytes()
    second = run_script([*ppo, "--seed", "2"], tmp_path)
    assert "outputs/ppo holds an earlier run's output: this run saves to outputs/ppo-2" in second, second
    assert "model saved to outputs/ppo-2" in second
    assert (tmp_path / "outputs" / "ppo" / "model.safetensors").read_bytes() == first
    assert (tmp_path / "outputs" / "ppo-2" / "model.safetensors").read_bytes() != first
    assert "model saved to outputs/ppo-3" in run_script(ppo, tmp_path)
    error = run_failing([*ppo, "--output-dir", "outputs/ppo"], tmp_path)
    assert "--output-dir outputs/ppo: it holds the model of an earlier run; pass --overwrite" in error, error


@pytest.mark.slow
def test_a_second_run_into_a_held_folder_stops_with_one_line_naming_the_first(tmp_path):
    """Two real processes, one output folder: the second stops at once (exit 2, one line naming the first run's script
    and process), the first trains and saves undisturbed, and its lock file is gone once it ends."""
    (tmp_path / "PAUSE").write_text(PAUSE_SAVE)
    first = start(
        ["PAUSE", *TINY_SFT, "--max-steps", "3", "--output-dir", "out/same"], tmp_path, PAUSE_IN="same", PAUSED="paused"
    )
    wait_for(tmp_path / "paused", first)  # the first run is in the middle of its final save
    lock = json.loads((tmp_path / "out" / ".same.lock").read_text())
    second = start([*TINY_SFT, "--max-steps", "3", "--output-dir", "out/same", "--overwrite"], tmp_path)
    _, stderr = second.communicate(timeout=120)
    assert second.returncode == 2 and "Traceback" not in stderr, stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("error: --output-dir out/same: another run is writing there (sft.py, process ") and (
        f"process {first.pid} " in line and f"started {lock['started']}" in line
    ), line
    first.send_signal(signal.SIGINT)  # the first run, interrupted in its save, leaves no model and no lock behind
    first.communicate(timeout=60)
    assert first.returncode == 130 and not (tmp_path / "out").exists()  # made only to hold the lock: removed


@pytest.mark.slow
def test_the_checkpoint_folder_is_held_too_and_a_crashed_runs_lock_is_taken_over(tmp_path):
    """A run whose checkpoint folder another run holds stops before it trains; a lock file left by a process that died
    (here: one nobody holds) does not stop the next run, which removes it at its end."""
    (tmp_path / "PAUSE").write_text(PAUSE_SAVE)
    command = ["--max-steps", "4", "--save-steps", "2"]
    first = start(["PAUSE", *TINY_SFT, *command, "--output-dir", "a"], tmp_path, PAUSE_IN="step_2", PAUSED="paused")
    wait_for(tmp_path / "paused", first)
    os.rename(tmp_path / ".a.lock", tmp_path / "a.lock.kept")  # only the checkpoint folder stays held
    error = run_failing([*TINY_SFT, *command, "--output-dir", "a"], tmp_path)
    assert "another run is writing there (sft.py, process" in error and "a_checkpoints" in error, error
    first.kill()
    first.communicate()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".model.lock").write_text('{"script": "sft.py", "pid": 1}')  # left by a killed run: unlocked
    run_script([*TINY_SFT, "--max-steps", "1", "--output-dir", "out/model"], tmp_path)
    assert sorted(os.listdir(tmp_path / "out")) == ["model"]


@pytest.mark.slow
def test_an_output_folder_given_as_a_link_is_written_through_the_link(tmp_path):
    """The link stays a link, the model goes into its target, and the target is replaced only with --overwrite."""
    (tmp_path / "target").mkdir()
    (tmp_path / "out").mkdir()
    os.symlink("../target", tmp_path / "out" / "link")
    command = [*TINY_SFT, "--max-steps", "1", "--output-dir", "out/link"]
    assert "model saved to out/link" in run_script(command, tmp_path)
    assert os.path.islink(tmp_path / "out" / "link") and os.listdir(tmp_path / "out") == ["link"]
    assert (tmp_path / "target" / "model.safetensors").is_file()
    assert "pass --overwrite" in run_failing(command, tmp_path)
    run_script([*command, "--overwrite"], tmp_path)
    assert os.readlink(tmp_path / "out" / "link") == "../target" and (tmp_path / "target" / "config.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out", "runs", "target"]  # no .old- or .tmp- folder, no lock, no old link


@pytest.mark.slow
def test_ctrl_c_during_the_final_save_is_one_line_keeping_the_previous_model_and_the_checkpoints(tmp_path):
    """A real SIGINT in the middle of the final save: exit status 130, no traceback, one line saying that the previous
    model is intact and which checkpoint is the last complete one; no partial folder is left and the model is
    unchanged, bit for bit."""
    run_script([*TINY_SFT, "--max-steps", "1", "--output-dir", "out/model"], tmp_path)
    before = (tmp_path / "out" / "model" / "model.safetensors").read_bytes()
    (tmp_path / "PAUSE").write_text(PAUSE_SAVE)
    command = [*TINY_SFT, "--max-steps", "4", "--save-steps", "2", "--output-dir", "out/model", "--overwrite"]
    run = start(["PAUSE", *command], tmp_path, PAUSE_IN="model", PAUSED="paused")
    wait_for(tmp_path / "paused", run)
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        "interrupted at step 4: the previous model in out/model is intact; checkpoint out/model_checkpoints/step_4 is the "
        "last complete one (--resume-from it)."
    ), stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["model", "model_checkpoints"]
    assert (tmp_path / "out" / "model" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path / "out" / "model_checkpoints")) == ["step_2", "step_4"]


@pytest.mark.slow
def test_ctrl_c_while_training_says_nothing_was_saved(tmp_path):
    """Interrupted between steps, before any save: one line, exit 130, nothing written, the lock gone."""
    (tmp_path / "PAUSE").write_text(PAUSE_SAVE)
    run = start(
        ["PAUSE", *TINY_SFT, "--max-steps", "4", "--save-steps", "2", "--output-dir", "out/model"],
        tmp_path,
        PAUSE_IN="step_2",
        PAUSED="paused",
    )
    wait_for(tmp_path / "paused", run)  # paused inside the first checkpoint's save: interrupted there
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted at step 2: nothing was saved to out/model.", stderr[-2000:]
    assert os.listdir(tmp_path / "out") == ["model_checkpoints"] and os.listdir(tmp_path / "out" / "model_checkpoints") == []


@pytest.mark.slow
def test_sigterm_while_training_is_one_line_exit_143_and_frees_the_folder_at_once(tmp_path):
    """SIGTERM (timeout, SLURM, Kubernetes) in the middle of a checkpoint's save: the Ctrl-C line, exit status 143, the
    half-written folder and the lock file removed; the next run into the same folder starts at once and saves."""
    (tmp_path / "PAUSE").write_text(PAUSE_SAVE)
    command = [*TINY_SFT, "--max-steps", "4", "--save-steps", "2", "--output-dir", "out/model"]
    run = start(["PAUSE", *command], tmp_path, PAUSE_IN="step_2", PAUSED="paused")
    wait_for(tmp_path / "paused", run)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 143 and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "interrupted at step 2: nothing was saved to out/model.", stderr[-2000:]
    assert os.listdir(tmp_path / "out") == ["model_checkpoints"] and os.listdir(tmp_path / "out" / "model_checkpoints") == []
    assert "model saved to out/model" in run_script([*TINY_SFT, "--max-steps", "1", "--output-dir", "out/model"], tmp_path)


def holder_pid(tmp_path, folder: str, process: subprocess.Popen) -> int:
    """The process that holds `folder` (its lock file names it): the training process under a launcher."""
    lock = tmp_path / "out" / f".{folder}.lock"
    wait_for(lock, process)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            return json.loads(lock.read_text())["pid"]
        except (ValueError, KeyError, FileNotFoundError):
            time.sleep(0.05)
    raise AssertionError("the lock file never named its holder")


def gone(pid: int, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_sigterm_to_a_launcher_stops_its_runs_with_the_line(tmp_path, launcher):
    """SIGTERM to the launcher alone, as Kubernetes sends it to a container's first process: torchrun passes it to its
    workers; accelerate's one-process launcher dies without passing it on, and the run then gets it from the kernel
    (it asked for SIGTERM at its parent's death). Either way the run ends with the line and leaves no lock file."""
    if launcher == "accelerate":
        launch = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"]
    else:
        launch = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    command = [*TINY_SFT, "--max-steps", "2000", "--output-dir", "out/model"]
    environment = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    with open(tmp_path / "stderr", "w") as log:
        run = subprocess.Popen([sys.executable, *launch, *command], cwd=tmp_path, env=environment, stderr=log)
    pid = holder_pid(tmp_path, "model", run)
    deadline = time.monotonic() + 120
    while not re.search(r" [1-9]\d*/2000 ", (tmp_path / "stderr").read_text()):  # in the training loop
        assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    run.wait(timeout=90)
    assert gone(pid), f"the run {pid} outlived its launcher"
    stderr = (tmp_path / "stderr").read_text()
    assert re.search(r"^interrupted at step \d+: nothing was saved to out/model\.$", stderr, re.M), stderr[-3000:]
    assert not (tmp_path / "out").exists()  # no lock file, no half-written folder: the folder made for the lock removed
