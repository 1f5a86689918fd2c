"""Run setup shared by every script: seeding, run name, TensorBoard / wandb logging, sample tables, atomic saves."""

import ast
import contextlib
import dataclasses
import glob
import inspect
import json
import logging
import math
import os
import pickle
import shlex
import shutil
import sys
import tempfile
import textwrap
import time
import types

import torch
import tyro
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
from accelerate.checkpointing import load as load_states
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from peft import set_peft_model_state_dict
from rich.console import Console
from rich.table import Table
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers.integrations import deepspeed as transformers_deepspeed
from transformers.utils import logging as transformers_logging

from common.core import UsageError, error_line, warn_once
from common.loading import FLAGS
from common.models import VALUE_HEAD_FILE, peft_model_of
from fast_paths import keep_freed_memory


def _report(kind, error, traceback) -> None:
    """argparse's convention for a UsageError: one line `error: ...` on stderr, exit status 2; anything unexpected keeps
    its traceback. With several processes every rank raises the same mistake and the main one reports it: another rank
    reports its own only if it is still running a moment later (the launcher stops every rank once one has failed)."""
    rank = int(os.environ.get("RANK", "0"))
    if issubclass(kind, UsageError):
        sys.stdout.flush()
        if rank:
            time.sleep(2)
        # torch.distributed's exception hook swaps sys.stderr for a buffer that os._exit would never write out
        sys.__stderr__.write(f"error: {error}\n")
        sys.__stderr__.flush()
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # the launcher's failure summary then names this line as its cause
            with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": f"error: {error}", "timestamp": int(time.time())}, f)
        os._exit(2)  # an exception hook cannot choose the exit status; nothing is left to clean up before training
    if rank and issubclass(kind, torch.distributed.DistError):
        time.sleep(3)  # a collective broken by another rank's failure: the launcher stops this rank meanwhile
    sys.__excepthook__(kind, error, traceback)


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


def cli(args_class):
    """`tyro.cli(args_class)`, and from here on an uncaught UsageError ends the run with `error: <message>`, exit 2.
    A `resume_from` folder is checked here, before any model or data is loaded. transformers' per-file progress bars
    (loading, writing) are off, so that the run's own bars stay readable."""
    sys.excepthook = _report
    for handler in transformers_logging.get_logger("transformers").handlers:
        handler.addFilter(HARMLESS)  # one instance: a filter already there is not added twice
    logging.getLogger("DeepSpeed").addFilter(HARMLESS)  # before deepspeed makes it: a logger keeps its filters
    transformers_logging.disable_progress_bar()
    _flowing_help(args_class)
    quiet = int(os.environ.get("RANK", "0")) > 0  # under a launcher --help and a usage box print once, from rank 0
    with open(os.devnull, "w") as devnull:
        with (
            contextlib.redirect_stdout(devnull if quiet else sys.stdout),
            contextlib.redirect_stderr(devnull if quiet else sys.stderr),
        ):
            args = tyro.cli(args_class)
    FLAGS.clear()  # each name on the command line by its flag, for the loaders' error lines
    for field in reversed(dataclasses.fields(args)):  # the first field that holds a name wins
        if isinstance(getattr(args, field.name), str):
            FLAGS[getattr(args, field.name)] = f"--{field.name.replace('_', '-')}"
    if getattr(args, "resume_from", None):
        script = read_checkpoint(args.resume_from).get("script")
        if script not in (None, os.path.basename(sys.argv[0])):
            raise UsageError(f"--resume-from {args.resume_from}: a checkpoint of {script}; resume it with {script}.")
    check_outputs(args)
    check_shared_flags(args)
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


def check_outputs(args) -> None:
    """Refuse, before anything loads, an output that would destroy what this codebase did not write: a run writes only
    into a folder that is new, empty, or one it saved (MARKER; replaced with --overwrite), its checkpoints into a folder
    of checkpoints only (resuming from one continues there), its logs into a new subfolder of --log-dir."""
    overwrite = getattr(args, "overwrite", False)
    resume = os.path.abspath(args.resume_from) if getattr(args, "resume_from", None) else None
    for flag, path in output_folders(args).items():
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
            raise UsageError(
                f"{flag} {path}: the folder holds files this codebase did not write ({shown}); a run replaces its "
                "output folder, so choose a new or empty one."
            )
        if ours and not overwrite and not resuming_here:
            raise UsageError(
                f"{flag} {path}: it holds the {'checkpoints' if checkpoints else 'model'} of an earlier run; pass "
                "--overwrite to replace what it saved, or choose another --output-dir."
            )
    log_dir = getattr(args, "log_dir", None)
    if log_dir is not None:
        _writable_folder(log_dir, "--log-dir")


def _writable_folder(path: str, flag: str) -> str:
    """The absolute path of a folder a run may create or fill: not empty, not the working directory or a folder above
    it, not a file, not under a file, and writable."""
    if not path.strip():
        raise UsageError(f"{flag} is empty: name a folder of its own, e.g. outputs/run1.")
    full, cwd = os.path.abspath(path), os.getcwd()
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


# The run's identity and arguments, recorded in its checkpoints: --save-total-limit prunes only this run's, a resume
# continues the checkpoint's run and says which arguments differ; RunLogger's hyperparameters table comes from here
RUN = {"id": None, "args": {}, "script": os.path.basename(sys.argv[0])}


def check_launch(accelerator: Accelerator, args=None) -> None:
    """Processes that a launcher started but accelerate runs alone (no GPU, no ACCELERATE_USE_CPU=1) are an error: each
    would train on its own and overwrite the others' files. An FSDP config on CPU runs FSDP2 over gloo: accelerate
    shards only on accelerators and would fall back to DDP, so the state is switched to FSDP here (configs/fsdp_cpu.yaml).
    Under DeepSpeed the script's flags go into its config (`deepspeed_settings`)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    if launched > 1 and accelerator.num_processes == 1:
        hint = (
            "DeepSpeed runs one process on CPU; for 2 use configs/fsdp_cpu.yaml" if deepspeed else "set ACCELERATE_USE_CPU=1"
        )
        raise UsageError(
            f"{launched} processes were launched but each would train alone (no GPU here): {hint} (docs/scaling.md)."
        )
    if accelerator.distributed_type == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP") == "true":
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    if deepspeed and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise UsageError(  # ACCELERATE_USE_CPU=1 makes accelerate run a DeepSpeed config as DDP
            "a DeepSpeed config with ACCELERATE_USE_CPU=1 would run as DDP: unset it (DeepSpeed runs one process on CPU)."
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED and args is not None:
        deepspeed_settings(accelerator.state.deepspeed_plugin, args)
    for flag in ("use_peft", "num_shared_layers", "normalize_reward"):  # a LoRA merge, shared or folded weights
        if getattr(args, flag, None) and accelerator.distributed_type == DistributedType.FSDP:
            raise UsageError(f"--{flag.replace('_', '-')} under FSDP is not supported: use DDP (configs/multi_gpu.yaml).")


def deepspeed_settings(plugin, args) -> None:
    """The script's flags where DeepSpeed's config says "auto": clipping (else 1.0), accumulation (another value: error),
    a micro-batch size. ZeRO-3: no zero.Init, so models load whole (a copied reference would be empty) to be partitioned."""
    config, steps = plugin.deepspeed_config, getattr(args, "gradient_accumulation_steps", 1)
    if plugin.zero_stage == 3:
        transformers_deepspeed.unset_hf_deepspeed_config()
    if config.get("gradient_accumulation_steps", "auto") not in ("auto", steps):
        raise UsageError(
            f"the DeepSpeed config accumulates {config['gradient_accumulation_steps']} steps and the script "
            f"{steps}: set gradient_accumulation_steps: {steps} in the config (or 'auto')."
        )
    config["gradient_accumulation_steps"] = steps
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = getattr(args, "max_grad_norm", getattr(args, "train_max_grad_norm", 0.0)) or 0.0
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = getattr(args, "mini_batch_size", getattr(args, "batch_size", 1))
    config.pop("train_batch_size", None)  # DeepSpeed derives it (an engine made before prepare would read "auto")


def start_run(args, accelerator: Accelerator) -> tuple[str, "RunLogger"]:
    """Check the launch (`check_launch`), seed every RNG with `args.seed + rank`, name the run and make its logger (main
    process only). `args` needs the CleanRL fields exp_name, seed, torch_deterministic, track, wandb_project_name,
    wandb_entity."""
    check_launch(accelerator, args)
    set_seed(args.seed + accelerator.process_index)  # per-rank seeds: ranks sample different data/responses
    if accelerator.device.type == "cpu":
        keep_freed_memory()
    torch.backends.cudnn.deterministic = args.torch_deterministic
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    RUN.update(
        id=run_name,
        script=os.path.basename(sys.argv[0]),
        args=dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args)),
    )
    return run_name, RunLogger(run_name, args, enabled=accelerator.is_main_process)


class RunLogger:
    """TensorBoard under runs/{run_name} (always) and wandb synced from it (`--track`), on the main process."""

    def __init__(self, run_name: str, args, enabled: bool = True):
        self.run_name, self.args, self.enabled, self.track, self._writer = run_name, args, enabled, args.track, None

    @property
    def writer(self):
        """TensorBoard's writer, opened (with the wandb run) on first use: a run that bad input stops leaves no folder."""
        if self._writer is None and self.enabled:
            args, config = self.args, RUN["args"]
            if args.track:
                import wandb

                wandb.init(
                    project=args.wandb_project_name,
                    entity=args.wandb_entity,
                    sync_tensorboard=True,
                    config=config,
                    name=self.run_name,
                    save_code=True,
                )
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(getattr(args, "log_dir", "runs"), self.run_name))
            self._writer.add_text(
                "hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items())
            )
        return self._writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, float(value), step)

    def samples(
        self, title: str, columns: dict[str, list], step: int, max_rows: int = 8, max_chars: int = 240, console: bool = True
    ) -> None:
        """Log a table of sample generations to TensorBoard as markdown, in full, and (with `console`) print it, cells
        over `max_chars` losing their middle."""
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
        if console:
            Console().print(table)
        markdown = "|" + "|".join(columns) + "|\n|" + "-|" * len(columns) + "\n"
        markdown += "\n".join("|" + "|".join(str(v).replace("|", "/").replace("\n", " ") for v in row) + "|" for row in rows)
        self.writer.add_text(title, markdown, step)

    def close(self) -> None:
        """Flush TensorBoard and finish the wandb run (synced from it), here rather than at interpreter exit."""
        if self._writer is not None:
            self._writer.close()
            if self.track:
                import wandb

                wandb.finish()


def end_run(accelerator: Accelerator, logger: RunLogger) -> None:
    """The last line of every script: the logger closed, one last barrier, the process group destroyed by every rank
    together; a run of several processes then leaves with os._exit, before a C++ destructor at interpreter exit can
    abort it ("terminate called without an active exception", about one 2-process CPU run in a hundred)."""
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
    """Yield a temporary folder beside `path`; when the block succeeds it replaces `path`. The new folder is written as
    `.tmp-NAME-*`, renamed `.new-NAME-*` once complete, and only then is the previous `path` renamed aside (`.old-NAME-*`)
    and the new one renamed into place. A crash at any point leaves a complete copy: `path` itself, or (between the last
    two renames) a `.new-` or `.old-` folder that the next save of `path` moves back into place before it starts.
    Folders get the usual permissions (0755 under the usual umask)."""
    parent, name = os.path.split(os.path.abspath(path))
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


def save_checkpoint(
    accelerator: Accelerator, path: str, state: dict, model=None, tokenizer=None, total_limit: int | None = None
) -> None:
    """A resumable checkpoint, written atomically by the main process (every rank calls it): `model` and `tokenizer` in
    from_pretrained format if given, accelerate's state (optimizer, scheduler, RNG, the other prepared models) in
    accelerate_state/, and the loop's own `state` (its step, controllers), the run's id and arguments in
    trainer_state.json. `model`'s weights are stored once, in its from_pretrained files (under FSDP / DeepSpeed also in
    accelerate's sharded state). With `total_limit`, only the newest `total_limit` checkpoints of this run stay beside
    it (TRL's save_total_limit); other runs' are kept."""
    accelerator.wait_for_everyone()
    once = model is not None and stored_once(accelerator)
    weights = full_weights(accelerator, model) if model is not None else None  # a collective when sharded
    shards = None
    if not stored_once(accelerator):  # every rank writes its part of a sharded state, beside the checkpoint
        shards = [os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-state-{RUN['id']}")]
        shards = broadcast_object_list(shards)[0]  # the main process's name (each rank's run id has its own time)
        accelerator.save_state(shards)
    if accelerator.is_main_process:
        with atomic_directory(path) as tmp:
            if model is not None:
                model.save_pretrained(tmp, **({"state_dict": weights} if weights is not None else {}))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            skipped = []
            if shards:
                os.rename(shards, os.path.join(tmp, "accelerate_state"))
            else:

                def skip_model(models, weights, _):  # accelerate's hook: its copy of `model`'s weights is not written
                    for i, prepared in enumerate(models):
                        if accelerator.unwrap_model(prepared) is model:
                            weights.pop(i)
                            skipped.append(i)
                            return

                hook = accelerator.register_save_state_pre_hook(skip_model) if once else None
                try:
                    accelerator.save_state(os.path.join(tmp, "accelerate_state"))
                finally:
                    if hook is not None:
                        hook.remove()
            state = state | ({"model_in_folder": skipped[0]} if skipped else {})
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state | {"run": RUN["id"], "script": RUN["script"], "args": RUN["args"]}, f, default=str)
        parent = os.path.dirname(os.path.abspath(path))
        ours = []
        for folder in os.listdir(parent):
            try:
                with open(os.path.join(parent, folder, "trainer_state.json")) as f:
                    saved = json.load(f)
            except (OSError, ValueError):
                continue
            if saved.get("run") == RUN["id"]:
                ours.append((os.path.getmtime(os.path.join(parent, folder, "trainer_state.json")), folder))
        for _, folder in sorted(ours)[: -total_limit if total_limit else 0]:
            shutil.rmtree(os.path.join(parent, folder), ignore_errors=True)
    accelerator.wait_for_everyone()


def full_weights(accelerator: Accelerator, model) -> dict | None:
    """`model`'s whole state dict for its save_pretrained when it is sharded (FSDP, DeepSpeed ZeRO-3): every rank must
    call this, and the main process gets the gathered weights. None otherwise: save_pretrained reads its own."""
    if stored_once(accelerator):
        return None
    if accelerator.is_fsdp2:  # accelerate's get_state_dict also asks for broadcast_from_rank0: DTensors come back on CPU
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3:  # accelerate's needs a 16-bit gather
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            state = accelerator.unwrap_model(model).state_dict()
            return {k: v.detach().cpu().clone() for k, v in state.items()} if accelerator.is_main_process else None
    return accelerator.get_state_dict(model)


def stored_once(accelerator: Accelerator) -> bool:
    """Whether a checkpoint keeps its model's weights only in the from_pretrained files: not where accelerate saves
    sharded states (FSDP, DeepSpeed, Megatron), whose restore needs its own files."""
    return accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def rank_batches(items: list, size: int, accelerator: Accelerator) -> list[tuple[list, float]]:
    """This rank's share of `items` in batches of `size`, with weights: the largest share's count of batches on every rank,
    a missing one as items[:1] at weight 0 (under FSDP or ZeRO-3 every forward is a collective that all ranks reach)."""
    share, largest = items[accelerator.process_index :: accelerator.num_processes], -(-len(items) // accelerator.num_processes)
    return [(share[i : i + size], 1.0) if share[i : i + size] else (items[:1], 0.0) for i in range(0, max(largest, 1), size)]


def load_weights(model: torch.nn.Module, folder: str) -> None:
    """Load into `model` (plain, peft, or with a value head) the weights its save_pretrained wrote to `folder`."""
    if hasattr(model, "v_head"):
        model.v_head.load_state_dict(load_file(os.path.join(folder, VALUE_HEAD_FILE)))
    peft = peft_model_of(model)
    if peft is not None:
        set_peft_model_state_dict(peft, load_file(os.path.join(folder, "adapter_model.safetensors")))
        return
    inner = getattr(model, "pretrained_model", model)
    weights = {}
    for file in sorted(glob.glob(os.path.join(folder, "model*.safetensors"))):
        weights |= load_file(file)
    missing = inner.load_state_dict(weights, strict=False).missing_keys
    state = inner.state_dict()
    loaded = {state[name].data_ptr() for name in weights if name in state}
    untied = [name for name in missing if state[name].data_ptr() not in loaded]  # tied copies are loaded
    if untied:
        raise UsageError(f"--resume-from {folder}: its weights lack {', '.join(sorted(untied)[:3])}.")


def read_checkpoint(path: str) -> dict:
    """The loop's state in a checkpoint folder (trainer_state.json), once a save of it that was killed between its
    renames is finished or undone; a clear error when `path` is no checkpoint."""
    recover_directory(path)
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise UsageError(
            f"--resume-from {path}: not a checkpoint folder (no trainer_state.json); pass one of the "
            "folders the --save-* flags write, e.g. {output_dir}_checkpoints/step_N."
        )
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        for file in glob.glob(os.path.join(path, "**", "*.safetensors"), recursive=True):
            with safe_open(file, "pt") as weights:  # reads the header and checks that the file holds all it lists
                weights.keys()
    except (ValueError, OSError, SafetensorError) as error:  # truncated or corrupt: name the file, no traceback
        raise UsageError(f"--resume-from {path}: a file of the checkpoint cannot be read ({error_line(error)}).") from None
    if not isinstance(state, dict):
        raise UsageError(f"--resume-from {path}: its trainer_state.json holds no state (a {type(state).__name__}).")
    return state


def load_checkpoint(accelerator: Accelerator, path: str) -> dict:
    """Restore accelerate's state from a folder `save_checkpoint` wrote (its random states must be readable: a resume
    that silently drew other random numbers would not continue the run); return the loop's state saved with it. The run
    continues as the checkpoint's, and a line says which arguments differ from the ones it was saved with."""
    state = read_checkpoint(path)
    folder = os.path.join(path, "accelerate_state")
    restored = []

    def take_model(models, _):  # the model whose weights save_checkpoint kept only in its from_pretrained files
        restored.append(models.pop(state["model_in_folder"]))

    rng = os.path.join(folder, f"random_states_{accelerator.process_index}.pkl")
    try:
        load_states(rng)  # accelerate's loader: weights_only, NumPy's generator state allowed
    except Exception as error:  # noqa: BLE001 - a missing, truncated or foreign file: one line, not a traceback
        raise UsageError(f"--resume-from {path}: its random state {rng} cannot be read ({type(error).__name__}).") from None
    hook = accelerator.register_load_state_pre_hook(take_model) if "model_in_folder" in state else None
    try:
        accelerator.load_state(folder)
        for model in restored:
            load_weights(accelerator.unwrap_model(model), path)
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError, SafetensorError) as error:
        if isinstance(error, UsageError):
            raise
        # a truncated optimizer file, or a checkpoint of another model or optimizer: one line, not a traceback
        raise UsageError(
            f"--resume-from {path}: the checkpoint does not load into this run ({error_line(error)}); resume "
            "with the arguments it was saved with, from an intact checkpoint."
        ) from None
    finally:
        if hook is not None:
            hook.remove()
    RUN["id"] = state.get("run", RUN["id"])
    ignore = {"resume_from", "output_dir", "log_dir", "checkpoint_dir", "exp_name", "track", "save_freq", "save_steps"}
    changed = [
        f"--{k.replace('_', '-')} {v} -> {RUN['args'].get(k)}"
        for k, v in state.get("args", {}).items()
        if k not in ignore and str(v) != str(RUN["args"].get(k))
    ]
    if changed:
        accelerator.print(f"resuming with arguments that differ from the checkpoint's: {', '.join(changed)}")
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
