"""Run setup shared by every script: seeding, run name, TensorBoard / wandb logging, sample tables, atomic saves."""

import ast
import contextlib
import dataclasses
import inspect
import json
import os
import shlex
import shutil
import sys
import tempfile
import textwrap
import time
import types

import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import set_seed
from rich.console import Console
from rich.table import Table

from common.core import UsageError
from common.performance import keep_freed_memory


def _report(kind, error, traceback) -> None:
    if issubclass(kind, UsageError):  # argparse's convention: one line on stderr, exit status 2
        sys.stdout.flush()
        print(f"error: {error}", file=sys.stderr, flush=True)
        os._exit(2)  # an exception hook cannot choose the exit status; nothing is left to clean up before training
    sys.__excepthook__(kind, error, traceback)  # anything unexpected keeps its traceback


def cli(args_class):
    """`tyro.cli(args_class)`, and from here on an uncaught UsageError ends the run with `error: <message>`, exit 2.
    A `resume_from` folder is checked here, before any model or data is loaded."""
    sys.excepthook = _report
    _flowing_help(args_class)
    args = tyro.cli(args_class)
    if getattr(args, "resume_from", None):
        read_checkpoint(args.resume_from)
    return args


def _flowing_help(args_class) -> None:
    """Hand tyro each field docstring of `args_class` as flowing text (the "help" metadata it reads first).

    tyro keeps a docstring's line break before any indented line, so a docstring wrapped at 120 columns in the
    source printed in --help as ragged lines; here its line breaks become spaces, and blank lines stay paragraphs.
    """
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(args_class))).body[0].body
    except (OSError, TypeError):  # no source to read (a class made at run time): tyro's own reading stands
        return
    for node, doc in zip(body, body[1:]):  # a field's docstring is the string expression right after it
        field = args_class.__dataclass_fields__.get(getattr(getattr(node, "target", None), "id", None))
        text = doc.value.value if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else None
        if field is None or "help" in field.metadata or not isinstance(text, str):
            continue
        paragraphs = inspect.cleandoc(text).split("\n\n")
        help_text = "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)
        field.metadata = types.MappingProxyType({**field.metadata, "help": help_text})


def start_run(args, accelerator: Accelerator) -> tuple[str, "RunLogger"]:
    """Seed every RNG with `args.seed + rank`, name the run and open its logger (main process only).

    `args` needs exp_name, seed, torch_deterministic, track, wandb_project_name, wandb_entity (CleanRL fields).
    """
    set_seed(args.seed + accelerator.process_index)  # per-rank seeds: ranks sample different data/responses
    if accelerator.device.type == "cpu":
        keep_freed_memory()
    torch.backends.cudnn.deterministic = args.torch_deterministic
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    return run_name, RunLogger(run_name, args, enabled=accelerator.is_main_process)


class RunLogger:
    """TensorBoard under runs/{run_name} (always) and wandb synced from it (`--track`), on the main process."""

    def __init__(self, run_name: str, args, enabled: bool = True):
        self.writer, self.track = None, args.track
        if not enabled:
            return
        config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
        if args.track:
            import wandb

            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=config,
                name=run_name,
                save_code=True,
            )
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(getattr(args, "log_dir", "runs"), run_name))
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, float(value), step)

    def samples(self, title: str, columns: dict[str, list], step: int, max_rows: int = 8, max_chars: int = 240) -> None:
        """Print a table of sample generations (cells over `max_chars` lose their middle) and log it to TensorBoard
        as markdown, in full."""
        if self.writer is None:
            return
        table = Table(title=title, show_lines=True)
        for name in columns:
            table.add_column(name)
        rows = list(zip(*columns.values()))[:max_rows]
        half = max_chars // 2
        for row in rows:
            cells = (f"{v:.3f}" if isinstance(v, float) else str(v) for v in row)
            table.add_row(*(c if len(c) <= max_chars else f"{c[:half]} … {c[-half:]}" for c in cells))
        Console().print(table)
        markdown = "|" + "|".join(columns) + "|\n|" + "-|" * len(columns) + "\n"
        markdown += "\n".join("|" + "|".join(str(v).replace("|", "/").replace("\n", " ") for v in row) + "|" for row in rows)
        self.writer.add_text(title, markdown, step)

    def image(self, title: str, image, step: int) -> None:
        """Log a PIL image to TensorBoard and save it as {log_dir}/{run_name}/{title}_{step}.png."""
        if self.writer is not None:
            import numpy as np

            self.writer.add_image(title, np.asarray(image.convert("RGB")), step, dataformats="HWC")
            image.save(os.path.join(self.writer.log_dir, f"{title}_{step}.png"))

    def close(self) -> None:
        """Flush TensorBoard and finish the wandb run (synced from it), here rather than at interpreter exit."""
        if self.writer is not None:
            self.writer.close()
            if self.track:
                import wandb

                wandb.finish()


def end_run(accelerator: Accelerator, logger: RunLogger) -> None:
    """The last line of every script: the logger closed, every rank past one last barrier, the process group destroyed
    by every rank together; then a run of several processes leaves at once (os._exit) instead of through interpreter
    exit, where about one 2-process CPU run in a hundred aborted after everything had been saved ("terminate called
    without an active exception" from a C++ destructor, no Python frame left: a failed launch)."""
    logger.close()
    accelerator.wait_for_everyone()
    several = accelerator.num_processes > 1
    accelerator.end_training()
    if several:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@contextlib.contextmanager
def atomic_directory(path: str):
    """Yield a temporary folder beside `path`; when the block succeeds it replaces `path`.

    The new folder is written as `.tmp-NAME-*`, renamed `.new-NAME-*` once complete, and only then is the previous
    `path` renamed aside (`.old-NAME-*`) and the new one renamed into place. A crash at any point leaves a complete
    copy: `path` itself, or (between the last two renames) a `.new-` or `.old-` folder that the next save of `path`
    moves back into place before it starts. Folders get the usual permissions (0755 under the usual umask).
    """
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    recover_directory(path)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    new = tmp.replace(f"{os.sep}.tmp-{name}-", f"{os.sep}.new-{name}-")
    os.rename(tmp, new)  # complete: from here on a crash never loses it
    old = new.replace(f"{os.sep}.new-{name}-", f"{os.sep}.old-{name}-")
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(new, path)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(accelerator: Accelerator, path: str, state: dict, model=None, tokenizer=None) -> None:
    """A resumable checkpoint, written atomically by the main process (every rank calls it): `model` and `tokenizer` in
    from_pretrained format if given, accelerate's state (model, optimizer, scheduler, RNG) in accelerate_state/, and
    the loop's own `state` (its step, controllers) in trainer_state.json."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_directory(path) as tmp:
            for part in (model, tokenizer):
                if part is not None:
                    part.save_pretrained(tmp)
            accelerator.save_state(os.path.join(tmp, "accelerate_state"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f)
    accelerator.wait_for_everyone()


def read_checkpoint(path: str) -> dict:
    """The loop's state in a checkpoint folder (trainer_state.json), once a save of it that was killed between its
    renames is finished or undone; a clear error when `path` is no checkpoint."""
    recover_directory(path)
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise UsageError(
            f"--resume-from {path}: not a checkpoint folder (no trainer_state.json); pass one of the "
            "folders the --save-* flags write, e.g. {output_dir}_checkpoints/step_N."
        )
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


def load_checkpoint(accelerator: Accelerator, path: str) -> dict:
    """Restore accelerate's state from a folder `save_checkpoint` wrote; return the loop's state saved with it."""
    state = read_checkpoint(path)
    accelerator.load_state(os.path.join(path, "accelerate_state"))
    return state


def recover_directory(path: str) -> None:
    """Finish or undo a save of `path` that was killed: the newest complete copy (`.new-`, else `.old-`) goes back
    into place if `path` is missing; half-written `.tmp-` folders and stale copies are removed."""
    parent, name = os.path.split(os.path.abspath(path))
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
