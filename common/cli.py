"""The command line every script shares: tyro's parse of its `Args`, the checks of the flags many scripts have, the
output folders taken before anything loads, and how a run ends on a mistake (one line `error: ...`, exit status 2), on
Ctrl-C or on SIGTERM (one line saying what was kept, exit status 130 or 143)."""

import ast
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import re
import signal
import sys
import textwrap
import time
import types
import warnings

import torch
import tyro
from transformers.utils import logging as transformers_logging

from common.checkpoints import read_checkpoint
from common.core import Terminated, UsageError, die_with_parent, warn_once
from common.loading import FLAGS, REMOTE_CODE
from common.outputs import check_outputs, hold_outputs, interrupted_line, release_outputs

_TERMINATED = []  # the signal, once SIGTERM or SIGHUP arrived: whatever exception the run then ends with, it ends so


def _terminate(signum, frame) -> None:
    """SIGTERM or SIGHUP: raise Terminated in the main thread, once (a second signal while the run unwinds is not). A
    run already ending in its exception hook (`_report`: another rank failed, and the launcher stops this one) ends as
    the hook would: the main rank still writes its line, another rank stops without a word (Terminated raised inside
    the hook would print "Error in sys.excepthook" and both tracebacks)."""
    hooks = (_report.__code__, getattr(sys.excepthook, "__code__", None))  # ours, or torch.distributed's around it
    while frame is not None and frame.f_code not in hooks:
        frame = frame.f_back
    if frame is not None:  # inside the hook
        if int(os.environ.get("RANK", "0")):
            release_outputs()
            os._exit(128 + signum)
        return
    if not _TERMINATED:
        _TERMINATED.append(signum)
        raise Terminated()


def _unraisable(unraisable) -> None:
    """A stop signal whose handler ran inside a finalizer (a `__del__` or weakref callback, which garbage collection
    runs at any moment, imports included): Python would print Terminated's traceback as "Exception ignored" and carry
    on training, deaf to the next SIGTERM. The run ends here as its exception hook would end it (a save stopped midway
    leaves the folder as it was: saves are atomic)."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _report(type(unraisable.exc_value), unraisable.exc_value, unraisable.exc_traceback)
    sys.__unraisablehook__(unraisable)


def handle_signals() -> None:
    """SIGTERM (and SIGHUP: the terminal or ssh session closed) ends the run as Ctrl-C does (`_report`), with exit
    status 143 (129). A process started by a launcher (`accelerate launch`, `torchrun`) also gets SIGTERM when its
    launcher dies: accelerate's one-process launcher does not pass a SIGTERM on, and a launcher killed outright would
    otherwise leave its workers training with nobody to stop them."""
    signal.signal(signal.SIGTERM, _terminate)
    sys.unraisablehook = _unraisable
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # not under nohup, which ignores it on purpose
        signal.signal(signal.SIGHUP, _terminate)
    launched = any(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND"))
    if launched and sys.platform == "linux":
        die_with_parent(signal.SIGTERM)


def _report(kind, error, traceback) -> None:
    """argparse's convention for a UsageError: one line `error: ...` on stderr, exit status 2; anything unexpected keeps
    its traceback. With several processes every rank raises the same mistake and the main one reports it: another rank
    reports its own only if it is still running a moment later (the launcher stops every rank once one has failed).
    Ctrl-C and SIGTERM (also when another rank's exit broke a collective first) end with the line of what was kept."""
    rank = int(os.environ.get("RANK", "0"))
    if issubclass(kind, KeyboardInterrupt) or _TERMINATED:  # what was kept, in one line (a save in progress was undone)
        sys.stdout.flush()
        if not rank:
            sys.__stderr__.write(f"{interrupted_line()}\n")
            sys.__stderr__.flush()
        release_outputs()
        os._exit(128 + _TERMINATED[0] if _TERMINATED else 130)  # the shell's statuses: SIGTERM 143, SIGHUP 129, SIGINT 130
    if issubclass(kind, UsageError):
        sys.stdout.flush()
        if rank:
            _wait_for_the_launcher(2)
        # torch.distributed's exception hook swaps sys.stderr for a buffer that os._exit would never write out
        sys.__stderr__.write(f"error: {error}\n")
        sys.__stderr__.flush()
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # the launcher's failure summary then names this line as its cause
            with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": f"error: {error}", "timestamp": int(time.time())}, f)
        release_outputs()
        os._exit(2)  # an exception hook cannot choose the exit status; nothing is left to clean up before training
    if rank and issubclass(kind, torch.distributed.DistError):
        _wait_for_the_launcher(3)  # a collective broken by another rank's failure: the launcher stops this rank meanwhile
    sys.__excepthook__(kind, error, traceback)


def _wait_for_the_launcher(seconds: float) -> None:
    """A rank other than the main one, after a failure that the main rank reports: the launcher stops it meanwhile with
    SIGTERM, and it then ends without a word (Terminated raised inside this hook would print "Error in sys.excepthook"
    and both tracebacks under the main rank's one line)."""

    def stop(signum, frame):
        release_outputs()
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    time.sleep(seconds)


class _Harmless(logging.Filter):
    """Third-party warnings that read as errors but say nothing about this run: `generate`'s attention-mask warning (every
    call here passes one), diffusers' CLIP processor asking for torchvision, a GPT-2 config naming no loss (the causal-LM
    loss, the one wanted, is used) and DeepSpeed's guess at the device (accelerate imports it wherever installed)."""

    HARMLESS = (
        "We strongly recommend passing in an `attention_mask`",
        "requires torchvision (not installed)",
        "`loss_type=None` was set in the config but it is unrecognized",  # GPT-2 configs: the default loss is meant
        "Setting accelerator to CPU. If you have GPU or other accelerator",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.HARMLESS)


HARMLESS = _Harmless()

# peft's warnings at every LoRA run on a GPT-2 model or a built-in: transformers' deprecation of the attribute peft
# reads, the Conv1D layout that peft then handles itself, and a vocabulary check that looks for a hub config (no
# script here resizes the embeddings, so there is nothing for it to find)
HARMLESS_WARNINGS = (
    "`is_gradient_checkpointing` is deprecated",
    "fan_in_fan_out is set to False but the target module is `Conv1D`",
    "Could not find a config file in builtin:",
)


def cli(args_class):
    """`tyro.cli(args_class)`, and from here on an uncaught UsageError ends the run with `error: <message>`, exit 2.
    A `resume_from` folder is checked here, before any model or data is loaded. transformers' per-file progress bars
    (loading, writing) are off, so that the run's own bars stay readable."""
    sys.excepthook = _report
    handle_signals()
    for handler in transformers_logging.get_logger("transformers").handlers:
        handler.addFilter(HARMLESS)  # one instance: a filter already there is not added twice
    logging.getLogger("DeepSpeed").addFilter(HARMLESS)  # before deepspeed makes it: a logger keeps its filters
    for text in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{re.escape(text)}")
    transformers_logging.disable_progress_bar()
    _flowing_help(args_class)
    quiet = int(os.environ.get("RANK", "0")) > 0  # under a launcher --help and a usage box print once, from rank 0
    with open(os.devnull, "w") as devnull:
        with (
            contextlib.redirect_stdout(devnull if quiet else sys.stdout),
            contextlib.redirect_stderr(devnull if quiet else sys.stderr),
        ):
            args = tyro.cli(args_class)
    REMOTE_CODE["trusted"] = bool(getattr(args, "trust_remote_code", False))
    FLAGS.clear()  # each name on the command line by its flag, for the loaders' error lines
    for field in reversed(dataclasses.fields(args)):  # the first field that holds a name wins
        if isinstance(getattr(args, field.name), str):
            FLAGS[getattr(args, field.name)] = f"--{field.name.replace('_', '-')}"
    if getattr(args, "resume_from", None):
        script = read_checkpoint(args.resume_from).get("script")
        if script not in (None, os.path.basename(sys.argv[0])):
            raise UsageError(f"--resume-from {args.resume_from}: a checkpoint of {script}; resume it with {script}.")
    check_outputs(args, given=any(a.split("=")[0] in ("--output-dir", "--output_dir") for a in sys.argv[1:]))
    check_shared_flags(args)
    hold_outputs(args)  # after every cheap check: a run refused for its flags holds nothing
    return args


def check_shared_flags(args) -> None:
    """The flags many scripts share: the seed's and LoRA's ranges (an error), and a warning for LoRA flags that
    --use-peft (ddpo.py: --use-lora) is not there to use, and for float16 training weights."""
    if not 0 <= getattr(args, "seed", 0) < 2**32 - 1024:  # each rank seeds with seed + rank: numpy takes 32 bits
        raise UsageError(f"--seed {args.seed}: it must lie in [0, 2**32 - 1024).")
    lora = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name.startswith("lora_")}
    for name in ("lora_r", "lora_rank", "lora_alpha"):
        if name in lora and lora[name] <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {lora[name]}: it must be > 0.")
    if not 0 <= lora.get("lora_dropout", 0) < 1:
        raise UsageError(f"--lora-dropout {lora['lora_dropout']}: it must lie in [0, 1).")
    switch = "use_peft" if hasattr(args, "use_peft") else "use_lora"
    if hasattr(args, switch) and not getattr(args, switch):
        defaults = {f.name: f.default for f in dataclasses.fields(args)}
        changed = [f"--{k.replace('_', '-')}" for k, v in lora.items() if v != defaults[k]]
        if changed:
            warn_once(f"{', '.join(changed)} has no effect without --{switch.replace('_', '-')}")
    if getattr(args, "dtype", None) == "float16":
        warn_once(
            "--dtype float16 trains float16 weights, whose updates underflow and overflow without loss scaling: "
            "train in float32 (or bfloat16) and take float16 compute from `accelerate launch --mixed_precision fp16`"
        )


def _flowing_help(args_class) -> None:
    """Hand tyro each field docstring of `args_class` as flowing text (the "help" metadata it reads first): tyro keeps
    a docstring's line breaks, which print in --help as ragged lines; here they become spaces (blank lines stay)."""
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
