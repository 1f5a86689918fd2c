"""What running each turn's tool calls in a process of their own costs (common/tools.py, `run_calls`): the calculator
called once per episode, for 1 and 32 episodes side by side, in a process holding little and in one holding 1 GiB of
tensors (as a run does once its model and optimizer are loaded: a fork copies the page tables). Writes
benchmarks/RESULTS-tool-calls.json.

    python benchmarks/tool_calls.py
"""

import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.loading import load_function  # noqa: E402
from common.tools import TOOLS, run_calls  # noqa: E402

calculator = load_function("calculator", TOOLS, "--tools")  # the built-in, by name


def per_round(episodes: int, repeats: int = 5) -> float:
    """Seconds for one round of calls, `episodes` episodes with one calculator call each (the median of `repeats`)."""
    calls = [[{"name": "calculator", "arguments": {"expression": "361 * 220"}}] for _ in range(episodes)]
    tools = [{"calculator": calculator}] * episodes
    run_calls(calls, tools, timeout=10)  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        assert run_calls(calls, tools, timeout=10)[0] == [("calculator", "79420", False)]
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    rows, held = [], []
    for resident in ("small", "1 GiB"):
        if resident == "1 GiB":
            held = [torch.ones(1024, 1024) for _ in range(256)]  # touched: resident, as loaded weights are
        for episodes in (1, 32):
            seconds = per_round(episodes)
            rows.append(dict(resident=resident, episodes=episodes, round_s=seconds, per_call_ms=1000 * seconds / episodes))
            per_call = rows[-1]["per_call_ms"]
            print(f"{resident:>6} process, {episodes:2d} episodes: {seconds * 1000:6.1f} ms a round, {per_call:.1f} ms a call")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    record = {"command": "python benchmarks/tool_calls.py", "machine": machine, "rows": rows}
    with open(os.path.join(ROOT, "benchmarks", "RESULTS-tool-calls.json"), "w") as f:
        json.dump(record, f, indent=1)
