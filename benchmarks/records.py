"""What the benchmark drivers share: the machine a record was measured on, and a run's TensorBoard scalars."""

import glob
import os
import platform


def machine() -> str:
    """The CPU's model name and core count, as each results file records its machine."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point of `tag` in the TensorBoard run under `run_dir` ([] if it logged none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(glob.glob(os.path.join(run_dir, "*"))[0])
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)] if tag in accumulator.Tags()["scalars"] else []
