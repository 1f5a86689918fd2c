"""`accelerate launch` for the tests, without paying each rank's imports: the launched ranks are forked from a server
process that imported torch, transformers, accelerate, datasets, peft and common/ once per test worker (the standard
library's "forkserver"), instead of each rank importing them again (~9 s a rank on 2 cores, ~20 s of CPU a launch).

What the ranks see is what `accelerate launch` gives them: the environment comes from accelerate's own launch code
(`_validate_launch_command`, then `prepare_multi_gpu_env` or `prepare_deepspeed_cmd_env`, as `launch_command` picks
for a config file or --multi_gpu), plus the variables torchrun's agent sets for each rank (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...); each rank runs the script as `__main__` in a fresh
process, all ranks write to one output as the launcher's do, and when one rank fails the others are stopped, as
torchrun stops them. The launchers themselves (the `accelerate launch` and `torchrun` commands, their signals and
their error lines) are tested by the tests that run them as commands (test_bad_input.py, test_outputs.py,
test_vllm.py).

The server imports on one thread and never computes: a process forked from one that has run OpenMP on several threads
hangs in its next parallel region (GNU libgomp), so the ranks are forked from it, never from a test's process.
"""

import multiprocessing
import os
import runpy
import signal
import sys
import tempfile
import time

PRELOAD = ["torch", "transformers", "accelerate", "datasets", "peft", "common.rollout", "common.checkpoints"]
_context = None


def _rank(argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """One rank: its output into the run's log, the launcher's environment, the script as __main__."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the rank's own streams, line by line
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env:  # as a fresh process reads it (the server's OpenMP started on one thread)
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def launch_env(launch_args: list[str], script: list[str]) -> tuple[dict[str, str], int, str]:
    """The environment `accelerate launch LAUNCH_ARGS SCRIPT...` gives its ranks (before torchrun's per-rank
    variables), the number of ranks and the rendezvous port."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args([*launch_args, *script])
    args, defaults, precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed and not args.cpu:  # as launch_command: the config's DeepSpeed fields, its precision too
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * precision_from_config)
        _, env = prepare_deepspeed_cmd_env(args)
    elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
        env = prepare_multi_gpu_env(args)
    else:
        raise ValueError(f"tests launch DDP, FSDP or DeepSpeed runs only: {' '.join(launch_args)}")
    return env, int(args.nproc_per_node or args.num_processes), str(args.master_port or args.main_process_port)


def launch(args: list[str], cwd: str, env: dict[str, str], timeout: int) -> tuple[int, str]:
    """Run `-m accelerate.commands.launch [launch options] script.py [script options]` (`args`, as the command line
    takes them) with `env`; return the first failing rank's exit status (0 if none) and every rank's output."""
    global _context
    assert args[:2] == ["-m", "accelerate.commands.launch"], args
    script_at = next(i for i, a in enumerate(args) if str(a).endswith(".py"))
    launch_args, script = [str(a) for a in args[2:script_at]], [str(a) for a in args[script_at:]]
    saved, processes = dict(os.environ), []
    fd, log = tempfile.mkstemp(prefix="launch-", suffix=".log")
    os.close(fd)
    try:
        os.environ.update(env)  # what the launcher reads from its environment (ACCELERATE_USE_CPU)
        rank_env, ranks, port = launch_env(launch_args, script)
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's, if the first rank below starts it
        world = str(ranks)
        for rank in range(ranks):  # torchrun's variables for each rank
            torchrun = dict(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default")
            torchrun |= dict(LOCAL_WORLD_SIZE=world, WORLD_SIZE=world, GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=world)
            torchrun |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RESTART_COUNT="0")
            torchrun |= dict(TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="False")
            processes.append(_context.Process(target=_rank, args=(script, str(cwd), rank_env | torchrun, log)))
            processes[-1].start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    deadline, status = time.time() + timeout, 0
    while any(p.is_alive() for p in processes):
        failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if failed or time.time() > deadline:  # as torchrun: one rank failed, so the others are stopped
            status = failed[0] if failed else -signal.SIGKILL
            for p in processes:
                p.terminate()
            for p in processes:
                p.join(10)
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    status = status or next((p.exitcode for p in processes if p.exitcode), 0)
    with open(log) as f:
        output = f.read()
    os.remove(log)
    return status, output
