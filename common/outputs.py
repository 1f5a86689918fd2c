"""What a run writes and may replace: the output folders it holds for its whole life (one run per folder), the checks
that it writes only where it may, atomic saves, the finiteness check before anything is kept, the model card, and the
one line an interrupted run ends with."""

import atexit
import contextlib
import dataclasses
import fcntl
import glob
import json
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import torch
from safetensors import safe_open

from common.core import UsageError

# The run's identity and arguments, recorded in what it saves: --save-total-limit prunes only this run's checkpoints, a
# resume continues the checkpoint's run and says which arguments differ; RunLogger's hyperparameters table comes from
# here. `step` is the last step logged, `held` the folders this process holds (see hold_outputs)
RUN = {"id": None, "args": {}, "script": os.path.basename(sys.argv[0]), "step": None, "folders": {}, "held": {}}

# Written into every folder this codebase saves (a model, a checkpoint): the one kind of folder it may replace
MARKER = ".rlhf-output"


def output_folders(args) -> dict[str, str]:
    """The folders a run of `args` may replace, by the flag that names them: --output-dir, its {output_dir}_best
    (ppo.py --save-best) and, where the run saves checkpoints, their folder ({output_dir}_checkpoints)."""
    output = getattr(args, "output_dir", None)
    if output is None:
        return {}
    folders = {"--output-dir": output}
    if getattr(args, "save_best", False):
        folders["--save-best"] = f"{output}_best"
    if getattr(args, "save_steps", 0) or getattr(args, "save_freq", 0):
        folders["the checkpoint folder"] = getattr(args, "checkpoint_dir", None) or f"{output}_checkpoints"
    return folders


def check_outputs(args, given: bool = True) -> None:
    """Refuse, before anything loads, an output that would destroy what this codebase did not write: a run writes only
    into a folder that is new, empty, or one it saved (MARKER; replaced with --overwrite), its checkpoints into a folder
    of checkpoints only (resuming from one continues there), its logs into a new subfolder of --log-dir.

    An --output-dir left at its default (`given` False) that an earlier run saved into, or that holds other files, is
    not refused: the run takes the first free folder beside it (outputs/ppo-2, outputs/ppo-3, ...), so that a command
    run twice gives two runs. Every rank finds the same one, since no rank saves before the run's end."""
    default = getattr(args, "output_dir", None)
    for n in range(1 if given or getattr(args, "overwrite", False) else 100):
        args.output_dir = default if n == 0 else f"{default}-{n + 1}"
        conflicts = [c for flag, path in output_folders(args).items() if (c := _conflict(args, flag, path))]
        if not conflicts:
            break
    else:  # none free (or --checkpoint-dir taken): refused as an explicit folder is
        args.output_dir = default
        conflicts = [c for flag, path in output_folders(args).items() if (c := _conflict(args, flag, path))]
    if args.output_dir != default and not int(os.environ.get("RANK", "0")):
        print(f"{default} holds an earlier run's output: this run saves to {args.output_dir} (--output-dir to choose)")
    if conflicts:
        raise UsageError(conflicts[0])
    log_dir = getattr(args, "log_dir", None)
    if log_dir is not None:
        logs = os.path.realpath(_writable_folder(log_dir, "--log-dir"))
        for flag, path in output_folders(args).items():  # a save replaces its folder: logs inside it would go with it
            full = os.path.realpath(path)
            if logs == full or logs.startswith(full + os.sep):
                raise UsageError(f"--log-dir {log_dir} lies in {flag} {path}, which a save replaces: keep them apart.")


def _conflict(args, flag: str, path: str) -> str | None:
    """Why the run may not write `path` (what the folder holds), or None."""
    resume = os.path.realpath(args.resume_from) if getattr(args, "resume_from", None) else None
    checkpoints = flag == "the checkpoint folder"
    full = _writable_folder(path, flag)
    # what is there, less a save's own leftovers (atomic_directory's .tmp- / .new- / .old-), which the next clears
    entries = [e for e in os.listdir(full) if not e.startswith((".tmp-", ".new-", ".old-"))] if os.path.isdir(full) else []
    if checkpoints:  # its entries are checkpoint folders (each with MARKER): ours only, nothing else
        foreign = [e for e in entries if not os.path.isfile(os.path.join(full, e, MARKER))]
        resuming_here = resume is not None and os.path.dirname(resume) == full
        ours = bool(entries) and not foreign
    else:
        foreign = [] if MARKER in entries else entries
        resuming_here, ours = False, MARKER in entries
    if foreign:
        shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
        return (
            f"{flag} {path}: the folder holds files this codebase did not write ({shown}); a run replaces its output "
            "folder, so choose a new or empty one."
        )
    if ours and not getattr(args, "overwrite", False) and not resuming_here:
        return (
            f"{flag} {path}: it holds the {'checkpoints' if checkpoints else 'model'} of an earlier run; pass "
            "--overwrite to replace what it saved, or choose another --output-dir."
        )
    return None


def _writable_folder(path: str, flag: str) -> str:
    """The absolute path of a folder a run may create or fill: not empty, not the working directory or a folder above
    it, not a file, not under a file, and writable."""
    if not path.strip():
        raise UsageError(f"{flag} is empty: name a folder of its own, e.g. outputs/run1.")
    full, cwd = os.path.realpath(path), os.getcwd()  # a link is the user's: the run writes into its target
    if full == cwd or cwd.startswith(full.rstrip(os.sep) + os.sep) or full == os.path.expanduser("~"):
        raise UsageError(
            f"{flag} {path}: that is the working directory, a folder above it or the home folder; name a new folder."
        )
    if os.path.lexists(full) and not os.path.isdir(full):
        raise UsageError(f"{flag} {path}: a file of that name exists; name a folder.")
    existing = full
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {path}: {existing} is a file, so no folder can be made under it.")
    beside = os.path.dirname(full) if existing == full else existing  # where a save makes its folder first
    try:  # tried once: os.access says yes to root on a read-only disk
        os.rmdir(tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(full)}-", dir=beside))
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write there ({error.strerror}).") from None
    return full


DIVERGED = "lower --learning-rate, or look for extreme values in the data"


def check_finite(step: int, values: dict[str, float], hint: str = DIVERGED) -> None:
    """Stop the run with one line when a loss, gradient norm or reward is NaN or infinite: nothing after it could be
    trusted, and nothing of it is saved (the output folder keeps what it held)."""
    for name, value in values.items():
        if value is not None and not math.isfinite(value):
            raise UsageError(
                f"{name} is {value} at step {step}: training diverged ({hint}); nothing was saved and the output folder "
                "is as it was."
            )


def non_finite_tensors(folder: str) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an infinity in the *.safetensors files under `folder`."""
    bad = []
    for file in sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True)):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    bad.append(f"{os.path.relpath(file, folder)}:{name}")
    return bad


# ================================ one run per output folder ================================
def hold_outputs(args) -> None:
    """Take every folder the run may write (`output_folders`) for the run's whole life, before anything expensive: a
    second run into a held folder stops with one line naming the run that holds it. The hold is an exclusive lock on
    `.NAME.lock` beside the folder, which names its holder; the kernel drops it when the process ends, however it ends,
    so a crashed run's file is taken over, and a run that ends removes it (`release_outputs`). The main process holds
    the folders for every rank (RANK 0 under every launcher)."""
    release_outputs()  # an earlier run of this process that did not end (tests run scripts in-process)
    RUN["folders"] = output_folders(args)
    if int(os.environ.get("RANK", "0")):
        return
    atexit.register(release_outputs)
    for flag, path in RUN["folders"].items():
        _hold(os.path.realpath(path), f"{flag} {path}")


def _hold(folder: str, named: str) -> None:
    parent, name = os.path.split(folder)
    lock = os.path.join(parent, f".{name}.lock")
    made, above = [], parent  # the folders made to hold the lock (deepest first): removed if the run leaves them empty
    while not os.path.exists(above):
        made, above = made + [above], os.path.dirname(above)
    while True:
        os.makedirs(parent, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            release_outputs()
            raise UsageError(
                f"{named}: another run is writing there ({_holder_text(holder)}); wait for it to end, or choose another "
                "--output-dir."
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)  # its holder removed the file between our open and our lock: take the new one
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    holder = dict(script=RUN["script"], pid=os.getpid(), host=socket.gethostname(), started=started, command=sys.argv)
    os.write(fd, json.dumps(holder).encode())
    RUN["held"][folder] = (fd, lock, made)


def _holder_text(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"{h['script']}, process {h['pid']} on {h['host']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "a run that is starting"


def release_outputs() -> None:
    """Give back the folders `hold_outputs` took: each lock file removed (before it is unlocked, so that a run opening it
    meanwhile takes a new one), with the parent folders that were made only to hold it, if still empty."""
    held = list(RUN["held"].values())
    for fd, lock, _ in held:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)
    for _, _, made in reversed(held):  # a later folder's lock may sit in a folder made for an earlier one
        for folder in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only an empty one: anything the run saved keeps it
    RUN["held"].clear()


# ================================ an interrupted run ================================
def interrupted_line() -> str:
    """What an interrupted run (Ctrl-C) kept, in one line: for each output folder, whether it holds the previous run's
    model (a save stopped midway leaves it as it was), this run's, or nothing; the newest complete checkpoint."""
    kept = []
    for flag, path in RUN["folders"].items():
        folder = os.path.realpath(path)
        if flag == "the checkpoint folder":
            ours = [name for name, _ in _checkpoints(folder)]
            if ours:
                name = max(ours, key=lambda n: os.path.getmtime(os.path.join(folder, n, "trainer_state.json")))
                kept.append(f"checkpoint {os.path.join(path, name)} is the last complete one (--resume-from it)")
            continue
        try:
            with open(os.path.join(folder, MARKER)) as f:
                saved_by = json.load(f).get("run")
        except (OSError, ValueError, AttributeError):
            saved_by = False
        if saved_by is False:
            kept.append(f"nothing was saved to {path}")
        elif saved_by == RUN["id"]:
            kept.append(f"{path} holds this run's saved model")
        else:
            kept.append(f"the previous model in {path} is intact")
    where = f" at step {RUN['step']}" if RUN["step"] is not None else ""
    return f"interrupted{where}: {'; '.join(kept) or 'nothing was saved'}."


def _checkpoints(folder: str) -> list[tuple[str, dict]]:
    """This run's complete checkpoints in `folder`: (name, its trainer_state.json)."""
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name, "trainer_state.json")) as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and state.get("run") == RUN["id"]:
            found.append((name, state))
    return found


@contextlib.contextmanager
def _uninterrupted():
    """Hold Ctrl-C, SIGTERM and SIGHUP back for the block (the renames of a finished save) and deliver them after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = {}
    previous = {
        s: signal.signal(s, lambda n, frame: caught.setdefault(n, frame))
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for s, frame in caught.items():  # delivered as it would have been, by the handler that was there
        handler = previous[s]
        if callable(handler):
            handler(s, frame)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(s)


# ================================ atomic saves ================================
@contextlib.contextmanager
def atomic_directory(path: str):
    """Yield a temporary folder beside `path`; when the block succeeds it replaces `path`. The new folder is written as
    `.tmp-NAME-*`, renamed `.new-NAME-*` once complete, and only then is the previous `path` renamed aside (`.old-NAME-*`)
    and the new one renamed into place. A crash at any point leaves a complete copy: `path` itself, or (between the last
    two renames) a `.new-` or `.old-` folder that the next save of `path` moves back into place before it starts.
    Folders and files get the usual permissions (0755 and 0644 under the usual umask). A `path` that is a symbolic link
    stays one: the save goes into its target. Ctrl-C during the save leaves the previous `path` as it was."""
    path = os.path.realpath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    recover_directory(path)
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, MARKER)):
        raise UsageError(f"{path}: the folder holds files this codebase did not write; they are left as they are.")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{path}: a file of that name exists; it is left as it is.")
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
    try:
        yield tmp
        bad = non_finite_tensors(tmp)
        if bad:
            raise UsageError(
                f"{path}: not saved, {len(bad)} tensors hold NaN or inf (first {bad[0]}); the folder is as it was."
            )
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"script": RUN["script"], "run": RUN["id"]}, f)
        for folder, _, files in os.walk(tmp):
            for file in files:  # safetensors writes its files 0600: a saved model reads like any other file
                if not os.path.islink(os.path.join(folder, file)):  # a link's target is not ours to change
                    os.chmod(os.path.join(folder, file), 0o666 & ~umask)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with _uninterrupted():  # the renames run to their end: a Ctrl-C here is delivered once the new folder is in place
        new = tmp.replace(f"{os.sep}.tmp-{name}-", f"{os.sep}.new-{name}-")
        os.rename(tmp, new)  # complete: from here on a crash never loses it
        old = new.replace(f"{os.sep}.new-{name}-", f"{os.sep}.old-{name}-")
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(new, path)
        shutil.rmtree(old, ignore_errors=True)


def recover_directory(path: str) -> None:
    """Finish or undo a save of `path` that was killed: the newest complete copy (`.new-`, else `.old-`) goes back
    into place if `path` is missing; half-written `.tmp-` folders and stale copies are removed."""
    path = os.path.realpath(path)
    parent, name = os.path.split(path)
    if not os.path.isdir(parent):
        return

    def ours(folder: str, kind: str) -> bool:  # .KIND-NAME- and mkdtemp's 8 characters: not .KIND-NAME-2-...
        rest = folder[len(f".{kind}-{name}-") :]
        return folder.startswith(f".{kind}-{name}-") and len(rest) == 8 and "-" not in rest

    leftovers = {
        kind: sorted((os.path.join(parent, d) for d in os.listdir(parent) if ours(d, kind)), key=os.path.getmtime)
        for kind in ("tmp", "new", "old")
    }
    if not os.path.exists(path) and (leftovers["new"] or leftovers["old"]):
        with contextlib.suppress(FileNotFoundError):  # every rank recovers: another may have renamed it first
            os.rename((leftovers["new"] or leftovers["old"]).pop(), path)
    for folder in sum(leftovers.values(), []):
        shutil.rmtree(folder, ignore_errors=True)


def write_model_card(directory: str, args, algorithm: str, metrics: dict[str, float], library: str = "transformers") -> None:
    """Write a README.md model card into `directory`: base model, dataset, algorithm, hyperparameters, final metrics
    and the command line that produced it (hub model cards read the YAML header)."""
    config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
    world = config.get("world_size") or int(os.environ.get("WORLD_SIZE", 1))
    launcher = f"accelerate launch --num_processes {world}" if world > 1 else "python"

    def table(rows, head: str = "name") -> str:
        return f"| {head} | value |\n|-|-|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)

    card = f"""---
library_name: {library}
tags: [{algorithm}, rlhf]
---

# {os.path.basename(os.path.normpath(config.get("output_dir", directory)))}

Trained with `{algorithm}.py` ({algorithm.upper()}).

- base model: `{config.get("model_name") or config.get("pretrained_model")}`
- dataset: `{config.get("dataset_name") or config.get("prompt_fn")}`

## Final metrics

{table(((k, f"{v:.4g}") for k, v in metrics.items()), "metric")}

## Command

```bash
{launcher} {shlex.join(sys.argv)}
```

## Hyperparameters

{table(config.items())}
"""
    with open(os.path.join(directory, "README.md"), "w") as f:
        f.write(card)
