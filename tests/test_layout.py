"""The shape of the code: no import cycle among the project's modules, one door to sampling, and short `Args`
docstrings."""

import ast
import glob
import os
import re

from conftest import ROOT

SCRIPTS = ("ppo", "dpo", "kto", "reward_modeling", "sft", "ddpo", "ilql", "grpo", "rloo", "gkd")


def project_modules() -> dict[str, str]:
    """Module name -> file, for the scripts and top-level modules, common/, presets/ and benchmarks/ (which run with
    their folder on the path)."""
    modules = {}
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        modules[os.path.splitext(os.path.basename(path))[0]] = path
    for package in ("common", "presets"):
        for path in glob.glob(os.path.join(ROOT, package, "*.py")):
            name = os.path.splitext(os.path.basename(path))[0]
            modules[package if name == "__init__" else f"{package}.{name}"] = path
    return modules


def imported(path: str, modules: dict[str, str], own: str) -> set[str]:
    """The project modules that `path` imports anywhere in its syntax tree (function-local imports too): importing a.b
    also imports the package a, unless the importer is inside a."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != own and not own.startswith(prefix + "."):
                    found.add(prefix)
    return found


def test_no_import_cycle():
    modules = project_modules()
    graph = {name: imported(path, modules, name) for name, path in modules.items()}
    assert "presets" in graph["common.loading"] and "common" not in str(graph["presets"])  # the one door, one way
    # every other module reaches the built-ins by name (agents.py's by "presets.agents:calculator", imported when used)
    reach = {n for n, deps in graph.items() if any(d.split(".")[0] == "presets" for d in deps)}
    assert {n for n in reach if not n.startswith(("presets", "common.loading", "agent_runs"))} == set()
    # common/ imports point down: nothing above it (a script, pipeline.py, a benchmark) is imported from it
    upward = {f"{n} -> {d}" for n, deps in graph.items() if n.startswith("common") for d in deps}
    assert {u for u in upward if not u.split(" -> ")[1].startswith(("common", "presets"))} == set()
    state, stack = {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for other in sorted(graph[name]):
            assert state.get(other) != "open", "import cycle: " + " -> ".join(stack[stack.index(other) :] + [other])
            if other not in state:
                visit(other)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


# What common/ may hold besides what two scripts share: the design's list (value-head models, reference models, KL
# controllers, log-prob and masking utilities), and load_pipeline, ddpo.py's way through the one door to the built-ins
DESIGN_LIST = {
    "ValueHead", "AutoModelForCausalLMWithValueHead", "AutoModelForSeq2SeqLMWithValueHead", "Critic", "PolicyAndCritic",
    "load_critic", "RewardAdapter", "create_reference_model",
    "reference_context", "AdaptiveKLController", "FixedKLController", "kl_estimate", "logprobs_from_logits",
    "entropy_from_logprobs", "masked_mean", "masked_var", "masked_whiten", "LogitMask", "RunningMoments", "nanstd",
    "pad_right", "load_pipeline",
}  # fmt: skip


def names_read(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def definitions(path: str) -> dict[str, set[str]]:
    """The top-level functions, classes and constants of a module, each with the names it reads."""
    found = {}
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = names_read(node)
        elif isinstance(node, ast.Assign):
            found |= {target.id: names_read(node.value) for target in node.targets if isinstance(target, ast.Name)}
    return found


def test_common_holds_what_two_scripts_share_and_no_builtin():
    """Every public function and class in common/ is used by two programs or more (the algorithm scripts and
    pipeline.py, directly or through common/), or is on the design's list; the built-ins live in presets/."""
    files = glob.glob(os.path.join(ROOT, "common", "*.py"))
    assert "chatterbot" not in "".join(open(f).read() for f in files)
    graph, checked = {}, set()
    for path in files:
        found = definitions(path)
        graph |= found
        if os.sep + "common" + os.sep in path and not path.endswith("vllm_server.py"):  # (a program: the serve command)
            checked |= {name for name in found if not name.startswith("_") and not name.isupper()}
    reached = {}
    for script in (*SCRIPTS, "pipeline"):  # what each program reaches, through the shared modules' own calls
        frontier, seen = names_read(ast.parse(open(os.path.join(ROOT, f"{script}.py")).read())) & graph.keys(), set()
        while frontier:
            seen |= frontier
            frontier = set().union(*(graph[n] & graph.keys() for n in frontier)) - seen
        reached[script] = seen
    lonely = []
    for name in sorted(checked - DESIGN_LIST):
        users = {script for script, seen in reached.items() if name in seen}
        if len(users) < 2:
            lonely.append(f"{name} ({', '.join(sorted(users)) or 'no script'})")
    assert not lonely, f"in common/ but used by fewer than two scripts: {lonely}"


def test_args_docstrings_are_short():
    """Every Args field's docstring is at most 3 lines: what it does, its unit, the reference default where ours differs
    (measurements and history belong in the README)."""
    for script in SCRIPTS:
        path = os.path.join(ROOT, f"{script}.py")
        if not os.path.exists(path):
            continue
        args = next(n for n in ast.parse(open(path).read()).body if isinstance(n, ast.ClassDef) and n.name == "Args")
        for field, doc in zip(args.body, args.body[1:]):
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                lines = doc.value.value.strip().splitlines()
                assert len(lines) <= 3, f"{script}.py --{field.target.id.replace('_', '-')}: {len(lines)} lines"


def test_every_script_has_one_skeleton():
    """Every script reads top to bottom: Args, the algorithm's functions, then main(), whose loop starts after a short
    setup; no flat `if __name__` block (it calls main(cli(Args))); main() comes last."""
    for script in SCRIPTS:
        tree = ast.parse(open(os.path.join(ROOT, f"{script}.py")).read())
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        main = next(f for f in functions if f.name == "main")
        guard = tree.body[-1]
        assert isinstance(guard, ast.If) and ast.unparse(guard.body[0]) == "main(cli(Args))", f"{script}.py's __main__ block"
        assert functions[-1].name == "main", f"{script}.py: {functions[-1].name} comes after main()"
        loop = next(n for n in ast.walk(main) if isinstance(n, ast.For) and ast.unparse(n.iter) == "progress")
        assert loop.lineno - main.lineno <= 70, f"{script}.py: main's loop starts {loop.lineno - main.lineno} lines in"


OFFLINE = ("dpo", "kto", "sft", "reward_modeling", "ilql", "ddpo")


def test_one_door_to_sampling():
    """No code outside common/sampling.py and common/vllm_engine.py reads the vLLM backend or pads and cuts completions
    again after the sampler; and no offline script reaches the online engine (common/rollout.py, common/tools.py), directly
    or through another module."""
    sources = [os.path.join(ROOT, f"{s}.py") for s in SCRIPTS] + glob.glob(os.path.join(ROOT, "common", "*.py"))
    sources += [os.path.join(ROOT, "pipeline.py")]
    door = {os.path.join(ROOT, "common", name) for name in ("sampling.py", "vllm_engine.py")}
    side_doors = []
    for path in sorted(set(sources) - door):
        for number, line in enumerate(open(path), 1):
            if re.search(r"\.vllm\b|VLLMSampler|def pad_left|def truncate|def completion_mask", line):
                side_doors.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not side_doors, "\n".join(side_doors)
    modules = project_modules()
    graph = {name: imported(path, modules, name) for name, path in modules.items()}
    for script in OFFLINE:
        reached, frontier = set(), {script}
        while frontier:
            reached |= frontier
            frontier = set().union(*(graph[n] for n in frontier)) - reached
        assert not reached & {"common.rollout", "common.tools"}, (
            f"{script}.py reaches {reached & {'common.rollout', 'common.tools'}}"
        )


def test_each_recorded_run_is_an_entry_of_the_runner():
    """benchmarks/runs.py's RUNS: each entry's results file exists and its command names the entry; each recorded run
    is one of the entry's, with the entry's command line; and no single-figure driver is left beside the runner."""
    import json
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from runs import KEEP, RUNS

    for name, entry in RUNS.items():
        record = json.load(open(os.path.join(ROOT, "benchmarks", f"RESULTS-{entry.record}.json")))
        assert record["command"] == f"python benchmarks/runs.py {name}", (name, record["command"])
        assert set(record["runs"]) <= set(entry.runs), (name, set(record["runs"]) - set(entry.runs))
        for run, kept in record["runs"].items():
            assert kept.get("command", f"python {entry.runs[run]}") == f"python {entry.runs[run]}", (name, run)
        assert set(entry.keep) | set().union(*entry.keep_for.values()) <= set(KEEP), name
        assert os.path.exists(os.path.join(ROOT, entry.page.split(",")[0])), entry.page
    drivers = {"kto_default", "ppo_default", "pipeline_runs", "ppo_learned_reward", "gkd_variants", "default_lines"}
    drivers |= {"real_model_scripts"}
    assert not {d for d in drivers if os.path.exists(os.path.join(ROOT, "benchmarks", f"{d}.py"))}
