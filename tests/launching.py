"""`python script.py` and `accelerate launch` for the tests, without paying each process's imports: the processes are
forked from a server process that imported torch, transformers, accelerate, datasets, peft and common/ once per test
worker (the standard library's "forkserver"), instead of each importing them again (~9 s a process on 2 cores, ~20 s
of CPU a 2-process launch).

What a process sees is what the command gives it: a fresh process (the script as `__main__`, its folder first on
sys.path, its uncaught exception through its own excepthook, its atexit functions, its exit status) with the
environment it is given. A launch's ranks get the environment of accelerate's own launch code
(`_validate_launch_command`, then `prepare_multi_gpu_env` or `prepare_deepspeed_cmd_env`, as `launch_command` picks
for a config file or --multi_gpu) plus the variables torchrun's agent sets for each rank (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...); all ranks write to one stdout and one stderr as the
launcher's do, and when one rank fails the others are stopped, as torchrun stops them. The launchers themselves (the
`accelerate launch` and `torchrun` commands, their signals and their error lines) are tested by the tests that run
them as commands (test_bad_input.py, test_outputs.py, the tensor-parallel run of test_vllm.py).

The server imports on one thread and never computes: a process forked from one that has run OpenMP on several threads
hangs in its next parallel region (GNU libgomp), so processes are forked from it, never from a test's process. Each
process takes the thread count its environment names (a launch's ranks: 1 unless told, as under torchrun).
"""

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

PRELOAD = ["torch", "transformers", "accelerate", "datasets", "peft", "common.rollout", "common.checkpoints"]
_context = None


def _run(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """One process of a run: its streams into the run's, the environment it is given, the script as __main__ with
    its folder first on sys.path, as `python script.py` runs it."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams, line by line
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # as a fresh process reads it (the server's OpenMP is unused)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    status = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:  # as the interpreter ends on one: None is 0, a message is printed and is 1
        status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        if status and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does: the script's excepthook, then status 1
        sys.excepthook(*sys.exc_info())
        status = 1
    atexit._run_exitfuncs()  # noqa: SLF001 - the interpreter's exit, which a forked process's os._exit skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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
    port = str(args.master_port or args.main_process_port)
    if getattr(args, "standalone", False):  # the port was taken meanwhile: torchrun would rendezvous on a free one
        from accelerate.utils.other import get_free_port

        port = str(get_free_port())
    return env, int(args.nproc_per_node or args.num_processes), port


def forks(args: list[str], env: dict[str, str]) -> bool:
    """Whether `run` forks `python ARGS`: an `accelerate launch` (torchrun gives each rank one thread unless told) or a
    script told its thread count (a fresh process would otherwise take one a core)."""
    return args[:2] == ["-m", "accelerate.commands.launch"] or (str(args[0]).endswith(".py") and "OMP_NUM_THREADS" in env)


def run(args: list[str], cwd: str, env: dict[str, str], timeout: int) -> tuple[int, str, str]:
    """Run `python ARGS` (`script.py ...`, or `-m accelerate.commands.launch [launch options] script.py ...`) in `cwd`
    with `env`, in processes forked from the server; return the exit status (a launch's: its first failing rank's),
    the stdout and the stderr (a launch's: its ranks' together, as the launcher's). Past `timeout` seconds the processes
    are stopped and subprocess.TimeoutExpired is raised, as subprocess.run does."""
    global _context
    assert forks(args, env), args
    script_at = next(i for i, a in enumerate(args) if str(a).endswith(".py"))
    launch_args, script = [str(a) for a in args[2:script_at]], [str(a) for a in args[script_at:]]
    saved, processes, logs = dict(os.environ), [], []
    for stream in ("out", "err"):
        fd, path = tempfile.mkstemp(prefix=f"run-{stream}-", suffix=".log")
        os.close(fd)
        logs.append(path)
    try:
        envs = [env]
        if script_at:  # an accelerate launch
            os.environ.update(env)  # what the launcher reads from its environment (ACCELERATE_USE_CPU)
            rank_env, ranks, port = launch_env(launch_args, script)
            world, envs = str(ranks), []
            for rank in range(ranks):  # torchrun's variables for each rank
                torchrun = dict(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank))
                torchrun |= dict(ROLE_NAME="default", LOCAL_WORLD_SIZE=world, WORLD_SIZE=world, GROUP_WORLD_SIZE="1")
                torchrun |= dict(ROLE_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                torchrun |= dict(TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
                envs.append({"OMP_NUM_THREADS": "1"} | rank_env | torchrun | {"TORCHELASTIC_USE_AGENT_STORE": "False"})
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's, if the first process below starts it
        for process_env in envs:
            processes.append(_context.Process(target=_run, args=(script, str(cwd), process_env, *logs)))
            processes[-1].start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    deadline, status, late = time.time() + timeout, 0, False
    while any(p.is_alive() for p in processes):
        failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        late = time.time() > deadline
        if failed or late:  # as torchrun: one rank failed, so the others are stopped
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
    outputs = []
    for path in logs:
        with open(path) as f:
            outputs.append(f.read())
        os.remove(path)
    if late:  # as subprocess.run(timeout=...) ends
        raise subprocess.TimeoutExpired(["python", *map(str, args)], timeout, *outputs)
    return status, *outputs
