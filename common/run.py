"""Run setup shared by every script: the launch checked, every RNG seeded, the run named; TensorBoard / wandb logging
and sample tables; the run's end; each rank's share of an evaluation."""

import dataclasses
import os
import platform
import sys
import time

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DistributedType, set_seed
from rich.console import Console
from rich.table import Table
from transformers.integrations import deepspeed as transformers_deepspeed

from common.core import UsageError
from common.fast_paths import keep_freed_memory
from common.outputs import RUN, release_outputs


def machine() -> str:
    """The machine a run measured on, as every results file and notebook names it: the GPU's model and count where
    there is one, else the CPU's model name with the vector instructions torch's kernels use (one model name covers
    CPUs with and without AVX-512, whose kernels round differently and run at different speeds); and the cores."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.machine()
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores"


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
    # a sharded run is there to save memory: it keeps glibc's own policy (with every freed all-gather buffer kept
    # resident, ppo.py's three 135M models under FSDP2 x2 outgrew a 24 GiB machine: benchmarks/RESULTS-launchers.md)
    if accelerator.device.type == "cpu" and accelerator.distributed_type not in (
        DistributedType.FSDP,
        DistributedType.DEEPSPEED,
    ):
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
    """TensorBoard under runs/{run_name} (always) and wandb synced from it (`--track`), on the main process; the
    hyperparameters and the machine as text."""

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
            self._writer.add_text("machine", f"{machine()}, {torch.get_num_threads()} threads")  # what the run timed
        return self._writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        RUN["step"] = step  # for the line an interrupted run ends with
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


def end_run(accelerator: Accelerator, logger: RunLogger | None = None) -> None:
    """The last line of every script (and of any launched program that builds an Accelerator): the logger closed, one
    last barrier, the process group destroyed by every rank together; a run with a process group (several processes,
    or DeepSpeed's one) then leaves with os._exit, before a C++ destructor or a hook at interpreter exit can abort it
    ("terminate called without an active exception", about one 2-process CPU run in a hundred; vLLM's shutdown hook
    on the destroyed group)."""
    if logger is not None:
        logger.close()
    release_outputs()
    accelerator.wait_for_everyone()
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    accelerator.end_training()
    if grouped:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def rank_batches(items: list, size: int, accelerator: Accelerator) -> list[tuple[list, float]]:
    """This rank's share of `items` in batches of `size`, with weights: the largest share's count of batches on every rank,
    a missing one as items[:1] at weight 0 (under FSDP or ZeRO-3 every forward is a collective that all ranks reach)."""
    share, largest = items[accelerator.process_index :: accelerator.num_processes], -(-len(items) // accelerator.num_processes)
    return [(share[i : i + size], 1.0) if share[i : i + size] else (items[:1], 0.0) for i in range(0, max(largest, 1), size)]
