"""Every notebook is committed executed (its outputs and plots are what a reader sees on GitHub), runs top to bottom
again here (with a smaller budget injected after its `parameters` cell, the papermill convention), and its plots
render.

The notebooks of one test process share a kernel: each starts from an empty namespace and accelerate's process-wide
state reset (as a fresh kernel would give it), while the libraries it imports stay loaded. A fresh kernel per notebook
spent ~8 s of CPU importing torch, transformers and matplotlib again (the 12 notebook tests with `-n 2`: 187 s
wall and 340 CPU-s with a kernel each, 153 s and 257 CPU-s shared)."""

import base64
import io
import os
import re

import nbformat
import numpy as np
import pytest
from conftest import ROOT
from nbclient import NotebookClient
from PIL import Image

NOTEBOOKS = os.path.join(ROOT, "notebooks")
# Small budgets: each notebook's own defaults take a few minutes; these keep the suite short
BUDGETS = {
    "agents": {  # one SFT step of 2 traces, one grpo update of 2 problems x 2 episodes: SmolLM2 with tool schemas
        "SFT_STEPS": 1,
        "UPDATES": 1,
        "EPISODE_TOKENS": 24,
        "SFT_FLAGS": ["--batch-size", "2", "--eval-fraction", "0.001"],
        "FLAGS": ["--eval-samples", "2", "--batch-size", "2", "--num-generations", "2", "--mini-batch-size", "4"]
        + ["--gradient-accumulation-steps", "1", "--total-prompts", "2"],
    },
    "sft": {
        "MAX_STEPS": 4,
        "EVAL_STEPS": 4,
        "FLAGS": ["--eval-fraction", "0.01", "--num-sample-generations", "0", "--max-seq-length", "32"],
    },
    "reward_modeling": {"NUM_EPOCHS": 1, "MAX_STEPS": 6, "FLAGS": ["--eval-fraction", "0.02", "--max-length", "32"]},
    "ppo": {"TOTAL_EPISODES": 16, "FLAGS": ["--eval-samples", "8"]},
    "dpo": {"MAX_STEPS": 2, "FLAGS": ["--eval-fraction", "0.02", "--max-length", "32", "--max-prompt-length", "16"]},
    "kto": {"MAX_STEPS": 2, "FLAGS": ["--eval-fraction", "0.02", "--max-length", "32"]},
    "ddpo": {"NUM_EPOCHS": 1, "FLAGS": ["--eval-samples", "4", "--sample-num-steps", "4"]},
    "ilql": {"NUM_EPOCHS": 1, "FLAGS": ["--eval-samples", "16", "--max-length", "24"]},
    "gkd": {"TOTAL_STEPS": 2, "FLAGS": ["--eval-samples", "4", "--batch-size", "4", "--mini-batch-size", "4"]},
    "grpo": {  # the tiny built-in in place of the real model: 2 updates
        "MODEL_NAME": "builtin:tiny-arith",
        "TOTAL_PROMPTS": 16,
        "STALE_UPDATES": 1,
        "FLAGS": ["--eval-samples", "16", "--train-size", "64", "--eval-size", "16"],
    },
    # one thread: its runs are subprocesses beside the other pytest worker (2 threads each would oversubscribe 2 cores)
    "real_model": {
        "UPDATES": 1,
        "FLAGS": ["--eval-samples", "1", "--eval-problems", "4", "--threads", "1", "--prompts", "2"],
    },
    "rloo": {
        "MODEL_NAME": "builtin:tiny-arith",
        "TOTAL_PROMPTS": 16,
        "FLAGS": ["--eval-samples", "16", "--train-size", "128", "--eval-size", "16"],
    },
}


# Run before each notebook in the shared kernel: what its previous notebook left behind goes, as with a fresh kernel
FRESH = f"""\
%reset -f
import gc, os, sys
if "common.outputs" in sys.modules:  # the output folders the last notebook's runs hold, released as at a process's exit
    sys.modules["common.outputs"].release_outputs()
if "accelerate.state" in sys.modules:  # accelerate's process-wide state, as a new process starts it
    sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)
    sys.modules["accelerate.state"].GradientState._reset_state()
if "matplotlib.pyplot" in sys.modules:
    sys.modules["matplotlib.pyplot"].close("all")
os.chdir({NOTEBOOKS!r})
gc.collect()
%reset -f
"""


@pytest.fixture(scope="module")
def kernel():
    """One Python kernel for the notebooks this test process runs, started in notebooks/ as Jupyter starts one."""
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=NOTEBOOKS)
    yield manager
    manager.shutdown_kernel(now=True)


def test_every_notebook_has_a_budget():
    assert sorted(name[: -len(".ipynb")] for name in os.listdir(NOTEBOOKS) if name.endswith(".ipynb")) == sorted(BUDGETS)


def test_every_stored_run_names_its_machine():
    """A notebook's stored outputs are a record: a notebook that ran a script (its "$ python" lines) shows the machine
    it ran on and the thread count, as run() prints them (common.run.machine)."""
    unnamed = []
    for name in sorted(BUDGETS):
        notebook = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
        text = "\n".join(
            out.get("text", "") for c in notebook.cells if c.cell_type == "code" for out in c.outputs if "text" in out
        )
        if "$ python" in text and not re.search(r"\d+ (CPU )?cores", text):
            unnamed.append(name)
    assert not unnamed, unnamed


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_notebook_runs_and_renders_its_plots(name, tmp_path, kernel):
    notebook = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    # committed with the outputs a reader on GitHub should see: run top to bottom once, plots included
    assert [c.execution_count for c in code_cells] == list(range(1, len(code_cells) + 1)), "commit it executed, in order"
    assert any("image/png" in out.get("data", {}) for c in code_cells for out in c.outputs), "commit it with its plots"
    for cell in code_cells:  # the test runs it afresh
        cell.outputs, cell.execution_count = [], None
    (index,) = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
    overrides = BUDGETS[name] | {"OUT": str(tmp_path / "out")}
    for key in overrides:
        assert f"{key} = " in notebook.cells[index].source, f"{key} is not a parameter of {name}.ipynb"
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in overrides.items())))
    notebook.cells.insert(0, nbformat.v4.new_code_cell(FRESH))
    if not kernel.is_alive():  # an earlier notebook killed it
        kernel.restart_kernel(now=True)
    # a cell stops after 20 minutes: a hang, not a slow machine (real_model's short SmolLM2 run passed 600 s in the suite)
    client = NotebookClient(notebook, km=kernel, timeout=1200, resources={"metadata": {"path": NOTEBOOKS}})
    try:
        client.execute()
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
    pngs = [
        out["data"]["image/png"]
        for c in notebook.cells
        if c.cell_type == "code"
        for out in c.outputs
        if "image/png" in out.get("data", {})
    ]
    assert pngs, f"{name}.ipynb drew no plot"
    for png in pngs:
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(png))).convert("L"), dtype=float)
        assert min(image.shape) > 100 and image.std() > 1.0  # a real figure, not an empty canvas
