"""Profile a training script's optimizer steps with torch.profiler: the top kernels by device time, and the step time.

    python benchmarks/profile_steps.py --skip 3 --steps 3 --out profile_sft.txt -- sft.py --model-name ... --max-steps 8

The script runs unchanged, in this process (as `python script.py ...` would run it); a global optimizer-step hook starts
the profiler after `--skip` steps and stops it `--steps` steps later, so the table covers whole steps only (forward,
backward and optimizer step, after the warm-up and any compilation). Written to `--out`: the steps' wall times and
the kernel table sorted by device time (CUDA when there is a GPU, else CPU).
"""

import argparse
import os
import runpy
import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", type=int, default=3, help="optimizer steps run before the profiler starts")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps profiled")
    parser.add_argument("--rows", type=int, default=30, help="rows of the kernel table")
    parser.add_argument("--out", default="profile.txt", help="where the step times and the kernel table go")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py and its arguments")
    args = parser.parse_args()
    command = args.script[1:] if args.script[:1] == ["--"] else args.script
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiler = torch.profiler.profile(activities=activities, record_shapes=False)
    state = {"step": 0, "times": []}

    def hook(optimizer, *_):
        if cuda:
            torch.cuda.synchronize()
        state["step"] += 1
        state["times"].append(time.perf_counter())
        if state["step"] == args.skip:
            profiler.start()
        elif state["step"] == args.skip + args.steps:
            profiler.stop()

    register_optimizer_step_post_hook(hook)
    sys.argv = command
    sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
    runpy.run_path(command[0], run_name="__main__")
    times = state["times"]
    steps = [b - a for a, b in zip(times, times[1:])][args.skip - 1 : args.skip - 1 + args.steps]
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70)
    with open(args.out, "w") as f:
        f.write(f"command: {' '.join(command)}\n")
        f.write(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}\n")
        f.write(f"profiled steps {args.skip + 1}-{args.skip + args.steps}: " + ", ".join(f"{s:.3f}" for s in steps) + " s\n")
        every = [b - a for a, b in zip(times, times[1:])]
        f.write("every step from the second (profiled ones inflated): " + ", ".join(f"{s:.3f}" for s in every) + " s\n")
        if cuda:
            f.write(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB\n")
        f.write(table)
    print(f"profile of {len(steps)} steps written to {args.out}")


if __name__ == "__main__":
    main()
