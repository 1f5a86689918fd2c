"""Generate the parts of the docs that come from the code, so that they cannot drift from it:

- each algorithm page's flag table (between `<!-- flags -->` and `<!-- /flags -->`), from the script's `Args`:
  every field as its `--flag`, default and docstring (the text of `--help`);
- docs/img/: the training curves of each notebook's run (the cell that plots its TensorBoard scalars) and the
  real-model plots of benchmarks/.

    python docs/build_assets.py            # rewrite both
    python docs/build_assets.py --check    # exit status 1 if a page's flag table is out of date (CI runs the test)
"""

import base64
import dataclasses
import importlib
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("ppo", "dpo", "sft", "reward_modeling", "ddpo", "ilql", "grpo", "rloo", "gkd")
START, END = "<!-- flags -->", "<!-- /flags -->"
# the notebook cell whose figure is each page's curves: the one that reads the run's TensorBoard scalars
CURVES = "logs = scalars(LOGS)"


def flag_table(script: str) -> str:
    """The markdown table of `script`'s flags: name, default, help (the docstring under the field)."""
    sys.path.insert(0, ROOT)
    from common.run import _flowing_help

    args = importlib.import_module(script).Args
    _flowing_help(args)
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for field in dataclasses.fields(args):
        if "Suppress" in str(field.type):  # filled in at run time, not a flag
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        text = field.metadata.get("help", "").replace("|", "\\|").replace("\n\n", " ").replace("\n", " ")
        rows.append(f"| `--{field.name.replace('_', '-')}` | `{default}` | {text} |")
    return "\n".join(rows)


def page_with_flags(script: str) -> tuple[str, str]:
    """The page's text as it is, and as it is with a fresh flag table."""
    path = os.path.join(ROOT, "docs", f"{script}.md")
    with open(path) as f:
        text = f.read()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return text, f"{head}{START}\n{flag_table(script)}\n{END}{tail}"


def extract_images() -> None:
    """Each notebook's curves figure, and the real-model plots, into docs/img/."""
    for script in SCRIPTS:
        with open(os.path.join(ROOT, "notebooks", f"{script}.ipynb")) as f:
            cells = json.load(f)["cells"]
        for cell in cells:
            if CURVES in "".join(cell["source"]):
                png = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
                with open(os.path.join(ROOT, "docs", "img", f"{script}.png"), "wb") as f:
                    f.write(base64.b64decode(png[-1]))
    for name in (
        "RESULTS-real-model.png",
        "RESULTS-real-model-learned-reward.png",
        "RESULTS-real-model-H100.png",
        "RESULTS-agents.png",
    ):
        shutil.copyfile(os.path.join(ROOT, "benchmarks", name), os.path.join(ROOT, "docs", "img", name))


if __name__ == "__main__":
    stale = []
    for script in SCRIPTS:
        text, fresh = page_with_flags(script)
        if text != fresh:
            stale.append(script)
            if "--check" not in sys.argv:
                with open(os.path.join(ROOT, "docs", f"{script}.md"), "w") as f:
                    f.write(fresh)
    if "--check" in sys.argv:
        print(f"flag tables out of date: {stale} (run python docs/build_assets.py)" if stale else "flag tables up to date")
        sys.exit(1 if stale else 0)
    extract_images()
    print(f"flag tables rewritten: {stale or 'none'}; images in docs/img/")
