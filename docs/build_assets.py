"""Generate the parts of the docs that come from the code, so that they cannot drift from it:

- each algorithm page's flag table (between `<!-- flags -->` and `<!-- /flags -->`), from the script's `Args`:
  every field as its `--flag`, default and docstring (the text of `--help`);
- every figure block (between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`) in README.md and docs/, rendered
  by FIGURES[NAME] from the results file (JSON) that the command which measured it wrote: a number is typed once, by
  the command, and a page can only show what its record holds;
- docs/img/: the training curves of each notebook's run (the cell that plots its TensorBoard scalars) and the
  real-model plots of benchmarks/.

    python docs/build_assets.py            # rewrite them all
    python docs/build_assets.py --check    # exit status 1 if a flag table or a figure is out of date (CI runs it)
"""

import base64
import dataclasses
import glob
import importlib
import json
import logging
import os
import re
import shutil
import statistics
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("ppo", "dpo", "kto", "sft", "reward_modeling", "ddpo", "ilql", "grpo", "rloo", "gkd")
START, END = "<!-- flags -->", "<!-- /flags -->"
# the notebook cell whose figure is each page's curves: the one that reads the run's TensorBoard scalars
CURVES = "logs = scalars(LOGS)"


def flag_table(script: str) -> str:
    """The markdown table of `script`'s flags: name, default, help (the docstring under the field)."""
    sys.path.insert(0, ROOT)
    from common.cli import _flowing_help

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


def record(name: str) -> dict:
    """benchmarks/NAME, or one line naming the benchmark that writes it."""
    path = os.path.join(ROOT, "benchmarks", name)
    if not os.path.exists(path):
        writers = [f for f in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))) if name in open(f).read()]
        commands = " or ".join(f"python benchmarks/{os.path.basename(f)}" for f in writers) or "its benchmark"
        raise SystemExit(f"error: benchmarks/{name} does not exist: run {commands} to write it, then this again")
    with open(path) as f:
        return json.load(f)


def value(stat: dict, digits: int = 2, spread: bool = False) -> str:
    """A record's aggregate as "mean ± sd", with " [min, max]" if `spread`."""
    text = f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}"
    return text + (f" [{stat['min']:.{digits}f}, {stat['max']:.{digits}f}]" if spread else "")


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} minutes"


def test_times() -> str:
    """The fast tier's and the whole suite's wall time (benchmarks/RESULTS-tests.json, `python
    benchmarks/test_times.py`)."""
    r = record("RESULTS-tests.json")
    fast, full = r["fast"], r["full"]
    return (
        f"On {r['machine']} (`{r['command']}`): the fast tier ran {fast['passed']} tests in {minutes(fast['seconds'])}, "
        f"the whole suite {full['passed']} tests in {minutes(full['seconds'])}, every built-in cached."
    )


def real_model_table() -> str:
    """The side-by-side table of the real model's results (benchmarks/RESULTS-real-model.json, `python
    benchmarks/real_model.py --seeds 1 2 3`): mean ± sd over the seeds, the sampled accuracy's min and max."""
    r = record("RESULTS-real-model.json")
    labels = {
        "grpo": "`grpo.py` (the verifier's reward)",
        "rloo": "`rloo.py`",
        "ppo": "`ppo.py --reward-funcs verifier`",
        "ppo_critic": "`ppo.py` with a separate critic, 4 completions a prompt (`--value-model-path auto`)",
        "rft": "rejection-sampling SFT (`sft.py`)",
        "dpo": "`dpo.py` on verifier-ranked pairs",
        "kto": "`kto.py` on the same pairs, unpaired",
        "rm_ppo": "reward model (16 replies per question), then `ppo.py` against it",
        "rm_ppo_kl": "a reward model trained the same way, then `ppo.py` with the KL held near 2 (`--target 2 --horizon 32`)",
        "rm_ppo_small": "the first try: reward model on DPO's pairs, then `ppo.py`",
        "trl_grpo": "TRL 1.16 `GRPOTrainer`, the same settings",
        "trl_rloo": "TRL 1.16 `RLOOTrainer`, the same settings",
        "grpo_linear": "`grpo.py` with TRL's learning-rate decay to 0 (`--lr-scheduler-type linear`)",
        "rloo_linear": "`rloo.py` with TRL's learning-rate decay to 0",
        "grpo_vllm": "`grpo.py --use-vllm --vllm-dtype float32` (rollouts sampled by vLLM)",
    }

    base = r["base"]
    rows = [
        "| method | seeds | greedy accuracy | sampled accuracy [min, max] | KL to the start | reply tokens |",
        "|---|---|---|---|---|---|",
        f"| before training | - | {base['greedy']:.2f} | {base['sampled']:.2f} | 0 | {base['length']:.1f} |",
    ]
    for method, label in labels.items():
        a = r["aggregate"][method]
        rows.append(
            f"| {label} | {a['sampled']['n']} | {value(a['greedy'], 2)} | {value(a['sampled'], 2, spread=True)} | "
            f"{value(a['kl'], 2)} | {value(a['length'], 1)} |"
        )
    return "\n".join(rows)


def default_runs(script: str) -> str:
    """The offline default run of `script` over seeds (benchmarks/RESULTS-default-runs.json, `python
    benchmarks/default_runs.py`): the script's own held-out score and training reward, then the initial and the saved
    model evaluated on the same held-out problems."""
    r = record("RESULTS-default-runs.json")
    runs = {k: v for k, v in r["runs"].items() if k.startswith(f"{script}-")}
    samples = next(iter(runs.values()))["final"]["samples"]
    rows = [
        "| seed | held-out score in training, first -> last evaluation | train reward, first -> last tenth | greedy "
        f"accuracy | sampled accuracy ({samples} per problem) | distinct answers (of {samples}) | reply tokens | KL to "
        "the start (nats per reply) | minutes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in sorted(runs.items()):
        a, b = run["final"]["start"], run["final"]["end"]
        rows.append(
            f"| {name.split('-')[-1]} | {run['eval'][0]:.3f} -> {run['eval'][1]:.3f} | {run['train'][0]:.3f} -> "
            f"{run['train'][1]:.3f} | {a['greedy']:.2f} -> {b['greedy']:.2f} | {a['sampled']:.2f} -> {b['sampled']:.2f} | "
            f"{a['distinct']:.2f} -> {b['distinct']:.2f} | {a['length']:.1f} -> {b['length']:.1f} | {b['kl']:.2f} | "
            f"{run['seconds'] / 60:.1f} |"
        )
    first = sum(v["eval"][0] for v in runs.values()) / len(runs)
    last = sum(v["eval"][1] for v in runs.values()) / len(runs)
    rows.append(f"| mean | {first:.3f} -> {last:.3f} ({last - first:+.3f}) | | | | | | | |")
    problems = run["final"]["problems"]
    where = (
        f"{r['machine']}, `{r['launcher']}`, {r['threads']} threads; each row `python {script}.py --seed N`, its wall "
        f"time the whole command's. The columns from greedy accuracy on evaluate the initial and the saved model on the "
        f"run's {problems} held-out problems, {samples} sampled replies each (temperature 1); the KL is the saved "
        "model's to the initial one on its own replies."
    )
    return "\n".join(rows) + f"\n\n{where}\n\n{default_runs_reading(runs, problems)}\n\n" + seed_line(script, runs)


def beyond_noise(a: float, b: float, n: int) -> bool:
    """Whether two accuracies, each over n single samples, differ by more than two standard errors of a difference
    (at their pooled accuracy)."""
    import math

    p = (a + b) / 2
    return abs(b - a) > 2 * math.sqrt(2 * p * (1 - p) / n)


def default_runs_reading(runs: dict, problems: int) -> str:
    """What the table of default runs says, computed from it: how many seeds raise the training reward, in how many
    the held-out score rises beyond its noise and the greedy accuracy falls beyond it, and how the saved model compares
    with the initial one."""
    import math

    n = len(runs)
    rose = sum(v["train"][1] > v["train"][0] for v in runs.values())
    first = sum(v["eval"][0] for v in runs.values()) / n
    last = sum(v["eval"][1] for v in runs.values()) / n
    # a difference of two means of n seeds x `problems` single samples each, at the pooled accuracy
    p = (first + last) / 2
    noise = 2 * math.sqrt(2 * p * (1 - p) / (n * problems))
    ends = [(v["final"]["start"], v["final"]["end"]) for v in runs.values()]
    up = sum(v["eval"][1] > v["eval"][0] and beyond_noise(*v["eval"], problems) for v in runs.values())
    greedy_down = sum(b["greedy"] < a["greedy"] and beyond_noise(a["greedy"], b["greedy"], problems) for a, b in ends)

    top = [sum(v["top_answer"][i] for v in runs.values()) / n for i in (0, 1)]

    def fewer(key: str) -> str:  # the seeds whose saved model is lower than the initial one on `key`
        k = sum(b[key] < a[key] for a, b in ends)
        return count_of(k, n) if k else "no seed"

    def mean(key: str, side: int) -> float:
        return sum(pair[side][key] for pair in ends) / n

    if up == n and not greedy_down:
        verdict = (
            "The held-out score rises with the training reward in every seed and greedy accuracy does not fall: what "
            "the policy learns carries over to problems it never saw."
        )
    elif rose == n and abs(last - first) <= noise:
        verdict = (
            "The training reward rises while the held-out score stays within its noise: the policy fits its training "
            "problems, and what it learns does not carry over to held-out ones."
        )
    else:
        moved = "beyond" if abs(last - first) > noise else "within"
        verdict = f"The held-out score {'rises' if last > first else 'falls'} {moved} its noise."
    return (
        f"Computed from the table: the training reward rises in {count_of(rose, n)}; the held-out score rises beyond two "
        f"standard errors of its own evaluation ({problems} single samples at the start and at the end) in "
        f"{count_of(up, n)}, and its mean moves {last - first:+.3f}, {'within' if abs(last - first) <= noise else 'beyond'} "
        f"two standard errors of a difference ({noise:.3f}, at its mean over {n} x {problems} single samples). The "
        f"saved model's greedy accuracy falls beyond two standard errors in "
        f"{count_of(greedy_down, n) if greedy_down else 'no seed'} "
        f"(mean {mean('greedy', 0):.2f} -> {mean('greedy', 1):.2f}), its sampled accuracy is lower in {fewer('sampled')} "
        f"(mean {mean('sampled', 0):.2f} -> {mean('sampled', 1):.2f}), and its distinct answers fewer in "
        f"{fewer('distinct')} (mean {mean('distinct', 0):.2f} -> {mean('distinct', 1):.2f}); the most frequent answer's "
        f"share of the held-out replies, which a collapse onto one answer would raise, goes "
        f"{top[0]:.0%} -> {top[1]:.0%} (mean). " + verdict
    )


def every_default_run() -> str:
    """Every script's default run over seeds (benchmarks/RESULTS-default-runs.json): its held-out metric first -> last
    in each seed, the mean change against two standard errors over the seeds, the wall time, and a computed reading."""
    import statistics

    r = record("RESULTS-default-runs.json")
    rows = [
        "| script | held-out metric | first -> last, by seed | mean change (2 standard errors over the seeds) | minutes "
        "| reading |",
        "|---|---|---|---|---|---|",
    ]
    for script, (metric, higher) in r["metrics"].items():
        runs = [v for k, v in sorted(r["runs"].items()) if k.rsplit("-", 1)[0] == script]
        if not runs:
            rows.append(f"| `{script}.py` | {metric} | not recorded yet | | | |")
            continue
        values = [v.get("held_out", v.get("eval")) for v in runs]
        gains = [(b - a) if higher else (a - b) for a, b in values]
        mean = statistics.fmean(gains)
        if len(gains) > 1:
            noise = 2 * statistics.stdev(gains) / len(gains) ** 0.5
            better = sum(g > 0 for g in gains)
            verdict = (
                f"{'better' if mean > 0 else 'worse'} in {count_of(better if mean > 0 else len(gains) - better, len(gains))}, "
                f"{'beyond' if abs(mean) > noise else 'within'} the noise"
            )
            change = f"{mean:+.3f} ({noise:.3f})"
        else:
            verdict, change = f"{'better' if mean > 0 else 'worse'} in its one seed; the noise is not measured", f"{mean:+.3f}"
        minutes = statistics.fmean(v["seconds"] for v in runs) / 60
        seeds = ", ".join(f"{a:.3f} -> {b:.3f}" for a, b in values)
        rows.append(
            f"| `{script}.py` | {metric}{'' if higher else ' (lower is better)'} | {seeds} | {change} | "
            f"{minutes:.1f} | {verdict} |"
        )
    kinds = {}  # machine, launcher, threads -> the scripts run there (a run names its own; older ones, the record's)
    for key, run in sorted(r["runs"].items()):
        kind, script = tuple(run.get(k, r[k]) for k in ("machine", "launcher", "threads")), key.rsplit("-", 1)[0]
        if script not in kinds.setdefault(kind, []):
            kinds[kind].append(script)
    machines = "; ".join(
        f"{machine}, `{launcher}`, {threads} threads"
        + (f" ({', '.join(f'`{s}.py`' for s in scripts)})" if len(kinds) > 1 else "")
        for (machine, launcher, threads), scripts in kinds.items()
    )
    where = (
        f"{machines}; each run `python SCRIPT.py --seed N` in a folder of "
        "its own (`python benchmarks/default_runs.py --scripts ...`), its metric read off its summary line; the change "
        "is the improvement (for a loss or a KL, its fall), its mean over the seeds beside two standard errors of that "
        "mean."
    )
    return "\n".join(rows) + f"\n\n{where}"


def count_of(k: int, n: int) -> str:
    return ("its one seed" if n == 1 else "every seed") if k == n else f"{k} of {n} seeds"


def seed_line(script: str, runs: dict) -> str:
    """The line seed 1's default run ended on, and the command that reruns it against the record."""
    run = runs[f"{script}-1"]
    return f"Seed 1 ended on\n\n```\n{run['summary']}\n```\n\n{rerun_by_check(script)}"


CHECKS = {  # the command that reruns each recorded default line against its record
    "kto": "python benchmarks/runs.py kto-default --check --only 1",
    "gkd": "python benchmarks/runs.py gkd-variants --check --only on-policy",
    "grpo": "python benchmarks/default_runs.py --check --scripts grpo --seeds 1",
    "rloo": "python benchmarks/default_runs.py --check --scripts rloo --seeds 1",
}


def rerun_by_check(script: str) -> str:
    """Which command reruns a recorded default line that no test has room to rerun."""
    command = CHECKS.get(script, f"python benchmarks/runs.py default-lines --check --only {script}")
    return (
        f"No test runs it again (the suite has no room for its length): `{command}` does, and exits 1 when it ends on "
        "another line (on the CPU kind and torch named here)."
    )


def agents_calculator() -> str:
    """The calculator table and the machines of benchmarks/RESULTS-agents.md, which `python benchmarks/agent_runs.py`
    renders from RESULTS-agents.json."""
    with open(os.path.join(ROOT, "benchmarks", "RESULTS-agents.md")) as f:
        lines = f.read().splitlines()
    machines = next(line for line in lines if line.startswith("Machines"))

    def table(head: str) -> list[str]:
        start = next(i for i, line in enumerate(lines) if line.startswith(head))
        return lines[start : next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))]

    sft = table("| SFT steps | well-formed call | accuracy |")
    text = "\n".join(table("| model |")) + "\n\nThe SFT warm start, each checkpoint of one run evaluated:\n\n"
    return text + "\n".join(sft) + f"\n\n{machines}"


REAL_MODEL_ROWS = {  # the docs page's labels of benchmarks/real_model.py's methods
    "grpo": "GRPO (`grpo.py`, the verifier's reward)",
    "rloo": "RLOO (`rloo.py`, the verifier's reward)",
    "ppo": "PPO (`ppo.py --reward-funcs verifier`, value head, adaptive KL)",
    "ppo_critic": "PPO with a separate critic (`ppo.py --value-model-path auto`, 4 completions a prompt, no KL)",
    "rft": "rejection-sampling SFT (`sft.py` on its own correct replies, 2 epochs)",
    "dpo": "DPO (`dpo.py` on verifier-ranked pairs of its own replies)",
    "kto": "KTO (`kto.py` on the same pairs, unpaired: each correct reply desirable, each wrong one not)",
    "rm_ppo": "reward model on 16 replies per question (up to 8 pairs each, 1 epoch), then PPO against it",
    "rm_ppo_kl": "a reward model trained the same way, then PPO with the KL held near 2 nats (`--target 2 --horizon 32`)",
    "rm_ppo_small": "the first try: reward model on DPO's pairs (2 epochs), then PPO against it",
    "trl_grpo": "TRL 1.16 `GRPOTrainer`, the same settings",
    "trl_rloo": "TRL 1.16 `RLOOTrainer`, the same settings",
    "grpo_linear": "GRPO with TRL's learning-rate decay (`grpo.py --lr-scheduler-type linear`, the same settings)",
    "rloo_linear": "RLOO with TRL's learning-rate decay (`rloo.py --lr-scheduler-type linear`, the same settings)",
    "grpo_vllm": "GRPO sampling through vLLM (`grpo.py --use-vllm --vllm-dtype float32`, the same settings)",
}


def real_model_full_table() -> str:
    """docs/real-model.md's table: every column of benchmarks/RESULTS-real-model.json's aggregate, and each method's
    statistics over its seeds with their min and max, and the comparisons with TRL that real_model.py makes."""
    r = record("RESULTS-real-model.json")

    base = r["base"]
    rows = [
        "| method | seeds | completions sampled | greedy accuracy | sampled accuracy (2 per problem) [min, max] | KL to "
        "the start (nats per reply) | reply tokens | distinct answers (of 2) |",
        "|---|---|---|---|---|---|---|---|",
        f"| SmolLM2-135M-Instruct, before training | - | 0 | {base['greedy']:.2f} | {base['sampled']:.2f} | 0 | "
        f"{base['length']:.1f} | {base['distinct']:.2f} |",
    ]
    for method, label in REAL_MODEL_ROWS.items():
        a = r["aggregate"][method]
        rows.append(
            f"| {label} | {a['sampled']['n']} | {a['completions']['mean']:,.0f} | {value(a['greedy'])} | "
            f"{value(a['sampled'], spread=True)} | {value(a['kl'])} | {value(a['length'], 1)} | {value(a['distinct'])} |"
        )
    seeds = [
        f"- {REAL_MODEL_ROWS[m].split(' (')[0]} over {r['aggregate'][m]['sampled']['n']} seeds: sampled "
        f"{value(r['aggregate'][m]['sampled'], spread=True)}, greedy {value(r['aggregate'][m]['greedy'], spread=True)}, "
        f"KL {value(r['aggregate'][m]['kl'], spread=True)}"
        for m in ("grpo", "rloo", "ppo", "ppo_critic", "trl_grpo", "trl_rloo", "grpo_linear", "rloo_linear", "grpo_vllm")
    ]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from real_model_report import comparison

    compared = ("grpo", "rloo", "ppo", "ppo_critic", "trl_grpo", "trl_rloo", "grpo_linear", "rloo_linear", "grpo_vllm")
    stats = {m: r["aggregate"][m] for m in compared}
    tests = comparison(stats, problems=64, samples=2)
    return (
        "\n".join(rows)
        + "\n\nEach method over its seeds, mean ± sd [min, max]:\n\n"
        + "\n".join(seeds)
        + (
            "\n\nEach difference (with TRL, and of the learning-rate decay) against the seeds' spread and, for "
            "accuracies, against two binomial standard errors of the evaluation (64 problems, 1 or 2 replies each):"
            f"\n\n{tests}"
        )
    )


def ppo_critic() -> str:
    """docs/ppo.md: ppo.py with a separate critic on the real-model task, seed by seed, against grpo.py and TRL 0.8's PPO
    at the comparisons docs/real-model.md makes (benchmarks/RESULTS-real-model.json), with seed 1's command."""
    r = record("RESULTS-real-model.json")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from real_model_report import comparison

    seeds = sorted((s for s in r["seeds"] if "ppo_critic" in r["seeds"][s]), key=int)
    rows = [
        "| seed | greedy accuracy | sampled accuracy (2 per problem) | KL to the start (nats per reply) | reply tokens | "
        "distinct answers (of 2) | critic's explained variance, median of the last 4 updates | minutes (threads) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        run = r["seeds"][seed]["ppo_critic"]
        last = [y for _, y in run["critic"]["explained_variance"][-4:] if y is not None]
        rows.append(
            f"| {seed} | {run['greedy']:.2f} | {run['sampled']:.2f} | {run['kl']:.2f} | {run['length']:.1f} | "
            f"{run['distinct']:.2f} | {statistics.median(last):.2f} | {run['wall_s'] / 60:.0f} ({run['threads']}) |"
        )
    base = r["base"]
    stats = {m: r["aggregate"][m] for m in ("ppo_critic", "grpo", "ppo")}
    below = [s for s in seeds if r["seeds"][s]["ppo_critic"]["sampled"] < base["sampled"]]
    below += [s for s in seeds if r["seeds"][s]["ppo_critic"]["greedy"] < base["greedy"] and s not in below]
    # the record keeps absolute paths; the page shows them from the repository root, wherever it was cloned
    command = re.sub(r"/\S*?/(outputs/)", r"\1", r["seeds"][seeds[0]]["ppo_critic"]["commands"][0])
    return (
        "\n".join(rows)
        + f"\n\nBefore training: {base['greedy']:.2f} greedy, {base['sampled']:.2f} sampled. Seeds that end below it: "
        + (", ".join(below) if below else "none")
        + f". {r['seeds'][seeds[0]]['ppo_critic']['machine']}, `python`. Against grpo.py (640 completions) and TRL 0.8's "
        "PPO (320), as docs/real-model.md compares:\n\n"
        + comparison(stats, problems=64, samples=2)
        + "\n\nSeed 1's command (`python benchmarks/real_model.py --methods ppo_critic --seeds 1 2 3`):\n\n```bash\n"
        + command
        + "\n```"
    )


def grpo_features() -> str:
    """docs/grpo.md: the adaptive entropy bonus and dynamic sampling on grpo.py's real-model recipe, one seed each
    (benchmarks/RESULTS-real-model.json, `python benchmarks/real_model.py --methods grpo_entropy grpo_dynamic`): what
    each holds, update by update, and where the run ends."""
    r = record("RESULTS-real-model.json")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from real_model_report import FEATURES

    runs = {m: r["seeds"]["1"][m] for m in ("grpo_entropy", "grpo_dynamic") if m in r["seeds"]["1"]}
    grpo = r["aggregate"]["grpo"]
    lines = []
    if "grpo_entropy" in runs:
        flags = FEATURES["grpo_entropy"]
        run, target = runs["grpo_entropy"], float(flags[flags.index("--entropy-target") + 1])
        entropy = run["feature"]["entropy"]
        half = entropy[len(entropy) // 2 :]
        mean = sum(half) / len(half)
        verdict = "within" if abs(mean - target) <= 0.1 * target else "outside"
        lines.append(
            f"- `{' '.join(flags)}`: the per-token entropy went "
            f"{entropy[0]:.2f} -> {entropy[-1]:.2f} nats; over the last half of the run its mean was {mean:.2f}, "
            f"{verdict} 10% of the target; the coefficient ended at {run['feature']['entropy_coef'][-1]:.2f} "
            f"(at most {max(run['feature']['entropy_coef']):.2f}). Held-out accuracy {run['greedy']:.2f} greedy, "
            f"{run['sampled']:.2f} sampled, KL {run['kl']:.2f}, {run['length']:.1f} reply tokens."
        )
    if "grpo_dynamic" in runs:
        run = runs["grpo_dynamic"]
        zero, filled, rounds = (run["feature"][k] for k in ("frac_reward_zero_std", "dynamic_sampling/filled",
                                                             "dynamic_sampling/rounds"))  # fmt: skip
        unfilled = [z for z, f in zip(zero, filled) if f == 0]
        lines.append(
            f"- `{' '.join(FEATURES['grpo_dynamic'])}`: {len(zero)} updates drew {sum(rounds):.0f} rounds of "
            f"generation ({max(rounds):.0f} at most in one); the largest share of groups with equal rewards in an update "
            f"that needed no topping up: {max(unfilled) if unfilled else 0:.2f}; groups topped up over the run: "
            f"{sum(filled):.0f}. Held-out accuracy {run['greedy']:.2f} greedy, {run['sampled']:.2f} sampled, KL "
            f"{run['kl']:.2f}, {run['wall_s'] / 60:.1f} minutes."
        )
    first = next(iter(runs.values())) if runs else {}
    machine = f"{first.get('machine', '')}, `python`, {first.get('threads', '')} threads"
    return (
        "\n".join(lines) + f"\n\ngrpo.py's own recipe over 3 seeds, for comparison: {value(grpo['greedy'])} greedy, "
        f"{value(grpo['sampled'])} sampled, KL {value(grpo['kl'])}. Seed 1 each, {machine}."
    )


def real_model_command() -> str:
    """grpo.py's measured recipe on the real model, as benchmarks/RESULTS-real-model.json recorded its seed-1 run, with
    its wall time, machine and threads."""
    run = record("RESULTS-real-model.json")["seeds"]["1"]["grpo"]
    words = run["commands"][0].split()
    keep = []
    for word in words:  # the run's own output folders are the benchmark's, not the reader's
        if keep and keep[-1] in ("--output-dir", "--log-dir"):
            keep.pop()
            continue
        keep.append(word)
    lines, line = [], ""
    for word in keep:
        if line and len(line) + len(word) > 100 and word.startswith("--"):
            lines.append(line + " \\")
            line = "   "
        line += f" {word}" if line else word
    when = f"{minutes(run['wall_s'])} on {run['machine']}, `python`, {run['threads']} threads"
    return "```bash\n" + "\n".join(lines + [line]) + f"\n```\n\n{run['updates']} updates of 8 prompts x 4 completions: {when}."


def spread(side: dict, digits: int = 1) -> str:
    """A side's step time over the rounds: "median [min, max]"."""
    return f"{side['median']:.{digits}f} [{side['min']:.{digits}f}, {side['max']:.{digits}f}]"


def speed_cpu() -> str:
    """The CPU Speed rows (benchmarks/RESULTS-speed-cpu.json, `python benchmarks/speed_cpu.py`): each side's median step
    time over the interleaved rounds with its min and max, and the ratio of the medians."""
    r = record("RESULTS-speed-cpu.json")
    names = {"grpo": ("grpo.py", "GRPOTrainer"), "rloo": ("rloo.py", "RLOOTrainer")}
    rows = ["| script, SmolLM2-135M-Instruct, 8 x 4 completions of 32 tokens, float32 | ours, s/update | TRL 1.16, s/step | "
            "ours / TRL |", "|---|---|---|---|"]  # fmt: skip
    for algo, row in r["rows"].items():
        ours, theirs = row["ours"], row["trl"]
        rows.append(
            f"| {names[algo][0]} against {names[algo][1]} | {spread(ours)} | {spread(theirs)} | **{row['ratio']:.2f}x** |"
        )
        if "vllm" in row:  # the same rounds, a third side: grpo.py sampling through vLLM
            v = row["vllm"]
            rows.append(
                f"| {names[algo][0]} --use-vllm --vllm-dtype float32 against {names[algo][1]} | {spread(v)} | "
                f"{spread(theirs)} | **{row['vllm_ratio']:.2f}x** |"
            )
        if "vllm_auto" in row:  # and with --vllm-dtype auto: the dtype it picked on the record's machine
            v = row["vllm_auto"]
            rows.append(
                f"| {names[algo][0]} --use-vllm ({row['vllm_auto_dtype']}: `auto` there) against {names[algo][1]} | "
                f"{spread(v)} | {spread(theirs)} | **{row['vllm_auto_ratio']:.2f}x** |"
            )
    return "\n".join(rows) + interleaved(r)


def interleaved(r: dict, sides: str = "") -> str:
    """The line under a speed_cpu.py table: machine, launcher, threads, command, and how its rows were timed."""
    rounds = len(next(iter(r["rows"].values()))["ours"]["runs"])
    return (
        f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads; `{r['command']}`: {sides}each side a fresh "
        f"process per run, the runs interleaved over {rounds} rounds; a run's step time is the median of its steps after "
        "the first; median [min, max] over the rounds."
    )


def speed_offline() -> str:
    """The offline scripts' CPU rows (benchmarks/RESULTS-speed-offline.json, `python benchmarks/speed_cpu.py --algos dpo
    kto sft`): each side's median step time over the interleaved rounds with its min and max, and the ratio."""
    r = record("RESULTS-speed-offline.json")
    names = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "sft": "SFTTrainer"}
    rows = ["| script, SmolLM2-135M-Instruct, float32 | settings | ours, s/step | TRL 1.16, s/step | ours / TRL |",
            "|---|---|---|---|---|"]  # fmt: skip
    for algo, row in r["rows"].items():
        ours, theirs = row["ours"], row["trl"]
        rows.append(
            f"| {algo}.py against {names[algo]} | `{r['recipe'][algo]}`, {r['data'][algo]['source']} rows of "
            f"{r['data'][algo]['band'][0]}-{r['data'][algo]['band'][1]} tokens | {spread(ours, 2)} | {spread(theirs, 2)} | "
            f"**{row['ratio']:.2f}x** |"
        )
    return "\n".join(rows) + interleaved(r, "raw text on both sides (`--no-chat-template`), ")


def roofline() -> str:
    """Each phase of a grpo.py / rloo.py update, and of a ppo.py update with its separate critic, against the machine's
    matmul rate (benchmarks/RESULTS-roofline.json, `python benchmarks/roofline.py`): time, executed and useful GFLOP,
    and the share of the float32 rate each achieves."""
    r = record("RESULTS-roofline.json")
    rate = r["matmul_flops_per_s"]

    def table(part: dict) -> list[str]:
        rows = ["| phase | seconds | GFLOP executed | GFLOP useful | executed / (time x matmul rate) | useful / (time x "
                "matmul rate) |", "|---|---|---|---|---|---|"]  # fmt: skip
        for p in part["phases"]:
            rows.append(
                f"| {p['phase']} | {p['seconds']:.2f} | {p['executed_flops'] / 1e9:.1f} | {p['useful_flops'] / 1e9:.1f} | "
                f"{100 * p['executed_share']:.0f}% | {100 * p['useful_share']:.0f}% |"
            )
        t = part["tokens"]
        return rows + [
            "",
            f"{t['completions']} completions, prompts of {t['prompt_mean']:.1f} tokens on average (at most "
            f"{t['prompt_max']}), completions of {t['completion_mean']:.1f} (at most {t['completion_max']}); the phases "
            f"add to {sum(p['seconds'] for p in part['phases']):.1f} s.",
        ]

    lines = ["grpo.py and rloo.py (the log-prob forward runs only with several optimizer steps per update or a "
             "reference, --beta > 0):", "", *table(r)]  # fmt: skip
    if "ppo" in r:
        lines += ["", "ppo.py with a separate critic (the policy's copy, without the LM head):", "", *table(r["ppo"])]
    return "\n".join(lines) + (
        f"\n\nThe roof: a {r['matmul_size']} x {r['matmul_size']} matmul at {rate['float32'] / 1e9:.0f} GFLOP/s in "
        f"float32 ({rate['bfloat16'] / 1e9:.0f} in bfloat16). "
        f"{r['machine']}, `{r['launcher']}`, {r['threads']} threads, torch {r['torch']}; `{r['command']}`."
    )


def offpolicy() -> str:
    """grpo.py with stale rollouts on the real model (benchmarks/RESULTS-offpolicy.json, `python
    benchmarks/offpolicy.py`): benchmarks/offpolicy.py's own table."""
    r = record("RESULTS-offpolicy.json")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from offpolicy import reading, table

    return "\n".join([*table(r), "", *reading(r)]) + (
        f"\n\n{r['machine']}, `python`, torch's default threads; `python benchmarks/offpolicy.py`. The accuracy in "
        "training is grpo.py's own evaluation (one sampled reply per held-out problem); the last five columns evaluate "
        "the final model as `benchmarks/real_model.py` does (greedy, 2 sampled replies per problem, KL in nats per reply)."
    )


def tool_calls() -> str:
    """The cost of a round of tool calls in a forked process (benchmarks/RESULTS-tool-calls.json, `python
    benchmarks/tool_calls.py`)."""
    r = record("RESULTS-tool-calls.json")
    rows = ["| the process holds | episodes in the round | the round | per call |", "|---|---|---|---|"]
    for row in r["rows"]:
        rows.append(f"| {row['resident']} | {row['episodes']} | {row['round_s']:.3f} s | {row['per_call_ms']:.1f} ms |")
    return "\n".join(rows) + f"\n\n{r['machine']}; `{r['command']}`."


def vllm_speed() -> str:
    """Rollout tokens/s of HF generate and vLLM on CPU (benchmarks/RESULTS-vllm-speed.json, `python
    benchmarks/vllm_speed.py`)."""
    r = record("RESULTS-vllm-speed.json")
    names = {
        "hf_inverse_cdf": "HF `generate`, inverse-CDF draw (the engine on CPU)",
        "hf_do_sample": "HF `generate`, `do_sample=True`",
        "vllm_float32": "vLLM, float32 (`--use-vllm --vllm-dtype float32`)",
        "vllm_bfloat16": "vLLM, bfloat16 (`--use-vllm --vllm-dtype bfloat16`; grpo.py's and rloo.py's `auto` here)",
    }
    shapes = [f"{row['prompts']} x {row['new_tokens']}" for row in r["rows"]]
    lines = ["| sampler | " + " | ".join(f"{s} tokens/s" for s in shapes) + " |", "|---|" + "---|" * len(shapes)]
    for side, label in names.items():
        base = [row["hf_inverse_cdf"]["tokens_per_s"] for row in r["rows"]]
        cells = [f"{row[side]['tokens_per_s']:.0f} ({row[side]['tokens_per_s'] / b:.1f}x)" for row, b in zip(r["rows"], base)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\nSmolLM2-135M-Instruct, prompts x new tokens with EOS suppressed (equal work), in brackets against the "
        f"first row; {r['machine']}, `{r['launcher']}`, {r['threads']} threads; `{r['command']}`: each side a fresh "
        "process, the median of its timed calls after a warm-up call."
    )


def vllm_server() -> str:
    """grpo.py's step and rollout time with a vLLM server against a colocated engine (benchmarks/RESULTS-vllm-server.json,
    `python benchmarks/vllm_server.py`)."""
    r = record("RESULTS-vllm-server.json")
    names = {
        "colocate": "colocated engine (`--use-vllm --vllm-dtype float32`)",
        "server": "vLLM server (`--vllm-mode server`)",
    }
    lines = ["| grpo.py sampling through | s / update | of which rollout | step time against colocated |", "|---|---|---|---|"]
    base = r["rows"]["colocate"]["step"]["median"]
    for side, label in names.items():
        row = r["rows"][side]
        runs = ", ".join(f"{v:.1f}" for v in row["step"]["runs"])
        lines.append(
            f"| {label} | {row['step']['median']:.1f} ({runs}) | {row['generate']['median']:.1f} | "
            f"{row['step']['median'] / base:.2f}x |"
        )
    return "\n".join(lines) + (
        f"\n\nMedians over {len(r['rows']['colocate']['step']['runs'])} interleaved rounds (each round's run in "
        f"brackets: the median of its updates after the first); the server, float32 as the trainer, started once in "
        f"{r['server_start_s']:.0f} s. {r['machine']}, `{r['launcher']}`, {r['threads']} threads, the server on the "
        f"same cores; `{r['command']}`."
    )


def vllm_memory() -> str:
    """grpo.py's bytes per GPU with vLLM in each mode, from the bytes per parameter (20 trained with a reference, 2 for
    a bf16 vLLM copy): arithmetic, not a measurement, computed here so that the table and its formulas agree."""
    trained, copy, gpus, fits = 20, 2, 8, 80

    def gb(per_param: float, billions: float) -> str:
        size = per_param * billions
        return f"{size:.1f} GB".replace(".0 GB", " GB") + ("" if size <= fits else ": does not fit an 80 GB GPU")

    rows = [
        ("colocate, DDP: each GPU", "20P + 2P", trained + copy),
        ("colocate, FSDP2: each GPU", "20P / 8 + 2P", trained / gpus + copy),
        ("colocate, FSDP2, `--vllm-tensor-parallel-size 2`: each GPU", "20P / 8 + 2P / 2", trained / gpus + copy / 2),
        ("server on 1 GPU, FSDP2 on 7: a training GPU", "20P / 7", trained / (gpus - 1)),
        ("server on 1 GPU, FSDP2 on 7: the server's GPU", "2P", copy),
    ]
    out = ["| 8 GPUs | per GPU | P = 1.5B | P = 7B |", "|-|-|-|-|"]
    out += [f"| {name} | {formula} | {gb(b, 1.5)} | {gb(b, 7)} |" for name, formula, b in rows]
    return "\n".join(out) + (
        "\n\nWeights, gradients, AdamW's moments and a float32 reference (20 bytes a parameter), and vLLM's bfloat16 "
        "copy (2 bytes); activations and vLLM's KV cache, which takes what `--vllm-gpu-memory-utilization` (colocate) or "
        "the server's `--gpu-memory-utilization` leaves, come on top."
    )


def vllm_learning() -> str:
    """grpo.py --use-vllm on the real-model recipe against grpo.py with HF generate (benchmarks/RESULTS-real-model.json,
    `python benchmarks/real_model.py --methods grpo_vllm --seeds 1 2 3`): accuracy, KL and the sampler-trainer gap per
    token along each run (step times: the interleaved speed benchmark, not these runs of several machines)."""
    r = record("RESULTS-real-model.json")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from real_model_report import comparison

    a, b = r["aggregate"]["grpo_vllm"], r["aggregate"]["grpo"]
    seeds = sorted(s for s, runs in r["seeds"].items() if "grpo_vllm" in runs)
    gaps = [[v for _, v in r["seeds"][s]["grpo_vllm"]["sampler_gap"]] for s in seeds]
    machines = sorted({r["seeds"][s]["grpo_vllm"]["machine"] for s in seeds})
    bf16 = r["aggregate"].get("grpo_vllm_bf16")  # vLLM in bfloat16, the trainer in float32 (the correction on)
    samplers = [("vLLM, float32 (`--use-vllm --vllm-dtype float32`)", a)]
    samplers += [("vLLM, bfloat16 (`--use-vllm`: `auto` here)", bf16)] if bf16 else []
    rows = [
        "| sampler | seeds | greedy accuracy | sampled accuracy [min, max] | KL to the start |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {x['sampled']['n']} | {value(x['greedy'])} | {value(x['sampled'], spread=True)} | {value(x['kl'])} |"
            for label, x in [*samplers, ("HF `generate`", b)]
        ),
    ]
    shown = [u for u in (1, 5, 10, 15, 20) if u <= min(map(len, gaps))]
    curve = ["| seed | " + " | ".join(f"update {u}" for u in shown) + " |", "|---|" + "---|" * len(shown)]
    curve += [f"| {s} | " + " | ".join(f"{g[u - 1]:.1e}" for u in shown) + " |" for s, g in zip(seeds, gaps)]
    return (
        "\n".join(rows)
        + f"\n\n{comparison({'grpo_vllm': a, 'grpo': b}, problems=64, samples=2)}\n"
        + (f"{comparison({'grpo_vllm_bf16': bf16, 'grpo_vllm': a}, problems=64, samples=2)}\n" if bf16 else "")
        + "\n"
        + "The sampler-trainer gap along each run, nats per token (`sampling/sampling_logp_difference/mean`, float32 "
        + "vLLM against the float32 trainer):\n\n"
        + "\n".join(curve)
        + f"\n\n{', '.join(machines)}, `python`, 2 threads; the HF row's machines as the results file gives them."
    )


def first_run() -> str:
    """The line `python ppo.py` ends on, its time on an empty built-in cache and on a built one, and its peak memory
    (benchmarks/RESULTS-first-run.json, `python benchmarks/first_run.py`); tests/test_ppo.py checks the line."""
    r = record("RESULTS-first-run.json")
    cold, warm = r["cold"], r["warm"]
    return (
        f"```\n{warm['line']}\n```\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`): the "
        f"first run, the two built-ins built, took {minutes(cold['seconds'])} at a peak of {cold['peak_gib']:.1f} GiB "
        f"resident; a later one {minutes(warm['seconds'])}, {warm['peak_gib']:.1f} GiB. "
        + (
            "Both ended on this line, but for the time."
            if strip_time(cold["line"]) == strip_time(warm["line"])
            else f"The first run ended on another line: `{cold['line']}`."
        )
    )


def ppo_default_runs() -> str:
    """ppo.py's default run over seeds (benchmarks/RESULTS-ppo-default.json, `python benchmarks/runs.py ppo-default`)."""
    r = record("RESULTS-ppo-default.json")
    rows = [
        "| seed | eval reward | initial std | KL, last tenth (target 6) | VADER sentiment | distinct words | distinct-2 "
        "| top token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gains, kls, vader_up = [], [], 0
    for seed, run in sorted(r["runs"].items()):
        a, b = run["first"], run["last"]
        gains.append((b["reward_mean"] - a["reward_mean"]) / a["reward_std"])
        kls.append(float(run["line"].split("; KL ")[1].split(";")[0]))  # the summary's: the mean of the last tenth
        vader_up += b["vader_sentiment"] > a["vader_sentiment"]
        rows.append(
            f"| {seed} | {a['reward_mean']:.3f} -> {b['reward_mean']:.3f} | {a['reward_std']:.2f} | {kls[-1]:.2f} | "
            f"{a['vader_sentiment']:.3f} -> {b['vader_sentiment']:.3f} | {b['distinct_words']:.2f} | "
            f"{a['distinct_2']:.2f} -> {b['distinct_2']:.2f} | {b['top_token_share']:.0%} |"
        )
    first = min(r["runs"])
    return (
        "\n".join(rows)
        + f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`); seed {first} ended on\n\n"
        + f"```\n{r['runs'][first]['line']}\n```\n\n"
        + f"The held-out reward rises by {min(gains):.2f}-{max(gains):.2f} standard deviations of the initial policy's "
        + f"held-out rewards over these {len(gains)} seeds, at a KL of {min(kls):.2f}-{max(kls):.2f} over the last tenth of "
        + "the run (the controller's target: 6), and VADER, the labeller behind the reward model's preference pairs, rises "
        + f"with it on {vader_up} of them."
    )


def kto_default_runs() -> str:
    """kto.py's default run over seeds (benchmarks/RESULTS-kto-default.json, `python benchmarks/runs.py kto-default`)."""
    r = record("RESULTS-kto-default.json")
    rows = [
        "| seed | held-out margin | desirable reward | undesirable reward | replies' KL | reply tokens | distinct replies |",
        "|---|---|---|---|---|---|---|",
    ]
    rose = 0
    for seed, run in sorted(r["runs"].items()):
        a, b = run["first"], run["last"]
        rose += b["rewards/margins"] > a["rewards/margins"]
        rows.append(
            f"| {seed} | {a['rewards/margins']:.3f} -> {b['rewards/margins']:.3f} | {b['rewards/chosen']:.3f} | "
            f"{b['rewards/rejected']:.3f} | {b['samples/kl']:.2f} | {a['samples/length']:.1f} -> "
            f"{b['samples/length']:.1f} | {a['samples/distinct']:.2f} -> {b['samples/distinct']:.2f} |"
        )
    first = min(r["runs"])
    return (
        "\n".join(rows)
        + f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`); the rewards and the KL at "
        + f"the last evaluation, on held-out prompts. The margin rises on {rose} of {len(r['runs'])} seeds. Seed "
        + f"{first} ended on\n\n```\n{r['runs'][first]['line']}\n```\n\n{rerun_by_check('kto')}"
    )


def pipeline_runs() -> str:
    """The whole pipeline over seeds (benchmarks/RESULTS-pipeline.json, `python benchmarks/runs.py pipeline`): every
    policy on the held-out prompts, each stage's time, and which methods beat the SFT policy on which score."""
    r = record("RESULTS-pipeline.json")
    policies = list(next(iter(r["runs"].values()))["policies"])
    rows = [
        "| seed | policy | reward model | VADER | KL to SFT | distinct-2 | response tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for seed, run in sorted(r["runs"].items()):
        for name, m in run["policies"].items():
            rows.append(
                f"| {seed} | {name} | {m['reward model']:.3f} | {m['VADER']:.3f} | {m['KL to SFT']:.2f} | "
                f"{m['distinct-2']:.2f} | {m['response tokens']:.1f} |"
            )
    runs = list(r["runs"].values())
    gains = []
    for name in policies[1:]:
        rm = sum(run["policies"][name]["reward model"] > run["policies"]["sft"]["reward model"] for run in runs)
        vader = sum(run["policies"][name]["VADER"] > run["policies"]["sft"]["VADER"] for run in runs)
        gains.append(f"{name.upper()} on {rm} and {vader}")
    stages = ", ".join(
        f"{name} {min(run['stage_seconds'][name] for run in runs):.0f}-{max(run['stage_seconds'][name] for run in runs):.0f} s"
        for name in runs[0]["stage_seconds"]
    )

    def spread(name: str, key: str) -> str:
        values = [run["policies"][name][key] for run in runs]
        return f"{min(values):.2f}-{max(values):.2f}"

    mean = {n: sum(run["policies"][n]["distinct-2"] for run in runs) / len(runs) for n in policies}
    repeats = min(policies[1:], key=mean.get)
    first = min(r["runs"])
    return (
        "\n".join(rows)
        + f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`); "
        + f"{r['runs'][first]['heldout_prompts']} held-out prompts. {repeats.upper()}'s answers repeat each other most: "
        + f"distinct-2 {spread(repeats, 'distinct-2')}, the SFT policy's {spread('sft', 'distinct-2')}, at a KL to SFT of "
        + f"{spread(repeats, 'KL to SFT')}. Each stage's time over the seeds: {stages}. Over "
        + f"the {len(runs)} seeds, the policies beat the SFT policy on the reward model's score and on VADER: "
        + "; ".join(gains)
        + f" of them. Seed {first} ended on\n\n```\n{r['runs'][first]['line']}\n```"
    )


def notebook_line(name: str) -> str:
    """The summary line a notebook's script run printed, from the notebook's stored outputs (notebooks/NAME.ipynb, run
    top to bottom and committed executed), with the machine it names if any."""
    with open(os.path.join(ROOT, "notebooks", f"{name}.ipynb")) as f:
        cells = json.load(f)["cells"]
    texts = ["".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])]
    summary = re.compile(rf"{name}: \d+ \w+ in \d+s")  # the summary, not a progress bar's "ilql:  50%|..."
    line = next(line for text in texts for line in text.splitlines() if summary.match(line))
    line = re.sub(r"; model saved to (\S*/)?(outputs/)", r"; model saved to \2", line)  # the run's folder, not its path
    return f"```\n{line}\n```"


def ppo_learned_reward() -> str:
    """PPO against a reward model trained here (benchmarks/RESULTS-ppo-learned-reward.json, `python
    benchmarks/runs.py ppo-learned-reward`), with and without a lower KL target."""
    r = record("RESULTS-ppo-learned-reward.json")
    rows = [
        "| run | held-out score (initial std) | VADER | distinct-2 | top token | health warning |",
        "|---|---|---|---|---|---|",
    ]
    ppo_runs = ("ppo", "ppo_target_3")
    for name in ppo_runs:
        run = r["runs"][name]
        a, b = run["first"], run["last"]
        rows.append(
            f"| `{run['command']}` | {a['reward_mean']:.2f} -> {b['reward_mean']:.2f} ({a['reward_std']:.2f}) | "
            f"{a['vader_sentiment']:.3f} -> {b['vader_sentiment']:.3f} | {a['distinct_2']:.2f} -> {b['distinct_2']:.2f} | "
            f"{a['top_token_share']:.0%} -> {b['top_token_share']:.0%} | {'yes' if run['warning'] else 'no'} |"
        )
    vader_rose = {k: r["runs"][k]["last"]["vader_sentiment"] > r["runs"][k]["first"]["vader_sentiment"] for k in ppo_runs}
    verdict = " ".join(
        f"{label}: VADER {'rises' if vader_rose[k] else 'does not rise'} and the health line "
        f"{'warns' if r['runs'][k]['warning'] else 'does not warn'}."
        for k, label in (("ppo", "At the default target"), ("ppo_target_3", "With `--target 3`"))
    )
    lines = [r["runs"]["reward_model"]["line"]]
    lines += [x for k in ppo_runs for x in (r["runs"][k]["health"], r["runs"][k]["warning"]) if x]
    logs = "\n".join(lines)
    return (
        "\n".join(rows)
        + f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`). {verdict} The reward "
        + f"model's line, then each PPO run's health line (and warning):\n\n```\n{logs}\n```"
    )


def first_run_memory() -> str:
    """The default run's peak resident memory (benchmarks/RESULTS-first-run.json)."""
    r = record("RESULTS-first-run.json")
    return (
        f"Peak resident memory on CPU of `python ppo.py`, the default run: {r['cold']['peak_gib']:.1f} GiB on its first "
        f"run (the built-ins built), {r['warm']['peak_gib']:.1f} GiB on a later one ({r['machine']}, `{r['launcher']}`, "
        f"{r['threads']} threads; `{r['command']}`)."
    )


def strip_time(line: str) -> str:
    """A summary line less its wall time ("in 245s"), the one part that varies between equal runs."""
    import re

    return re.sub(r" in \d+s;", " in Ns;", line)


def agents_headline() -> str:
    """The calculator's headline, from benchmarks/RESULTS-agents.json (`python benchmarks/agent_runs.py`)."""
    r = record("RESULTS-agents.json")
    base, warm = r["base with the calculator"], r["sft warm start"]
    short, longer, rloo, trl = (r[k] for k in ("sft then grpo", "sft then grpo, longer", "sft then rloo", "sft then trl grpo"))
    alone = max(r["sft curve"], key=lambda point: point["accuracy"])
    alone = min((p for p in r["sft curve"] if p["accuracy"] == alone["accuracy"]), key=lambda p: p["step"])
    machines = sorted({v["machine"] for v in (base, warm, short, longer, rloo, trl, alone)})
    return (
        f"On SmolLM2-135M-Instruct with the calculator on 3-digit x 3-digit products (`python benchmarks/agent_runs.py`, "
        f"held-out problems, one sampled episode each; {'; '.join(machines)}): the base model reaches accuracy "
        f"{base['accuracy']:.2f}, calling the tool {base['calls_per_episode']:.2f} times an episode; {warm['step']} SFT "
        f"steps on tool traces reach {warm['accuracy']:.2f}, and `grpo.py` with the live tool from there "
        f"{short['accuracy']:.2f} in {short['updates']} updates and {longer['accuracy']:.2f} in {longer['updates']} "
        f"(`rloo.py` {rloo['accuracy']:.2f} and TRL 1.16's `GRPOTrainer(tools=[calculator])` {trl['accuracy']:.2f} in "
        f"{rloo['updates']} and {trl['updates']}); **{alone['step']} SFT steps alone reach {alone['accuracy']:.2f}**"
        + (", so on this task the demonstrations do the work." if alone["accuracy"] >= longer["accuracy"] else ".")
    )


def md_table(name: str, heading: str, nth: int = 1) -> str:
    """The `nth` table under the section of benchmarks/NAME (a results file a benchmark wrote, with its machine and
    command) whose heading starts with `heading`, copied as the file has it, and the line naming where it is from."""
    path = os.path.join(ROOT, "benchmarks", name)
    with open(path) as f:
        lines = f.read().splitlines()
    title = lines[0].lstrip("# ")
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and line.lstrip("# ").startswith(heading))
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next(
        (i for i in range(start + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])),
        len(lines),
    )
    tables, table = [], []
    for line in lines[start + 1 : end] + [""]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            tables, table = tables + ["\n".join(table)], []
    section = lines[start].lstrip("# ")
    return f'{tables[nth - 1]}\n\n*{title}: `benchmarks/{name}`, section "{section}"; the file gives the machine and command.*'


def memory_on_paper() -> str:
    """ppo.py's bytes per GPU by launcher, from the bytes per parameter (16 trained, 4 frozen): arithmetic, not a
    measurement, computed here so that the table and its formulas cannot disagree."""
    trained, frozen, gpus, fits = 16, 4, 8, 80

    def gb(per_param: float, billions: float) -> str:
        size = per_param * billions
        return f"{size:.1f} GB".replace(".0 GB", " GB") + ("" if size <= fits else f": does not fit an {fits} GB GPU")

    rows = [
        ("DDP (`multi_gpu.yaml`)", "16P + 4P + 4P = 24P", trained + 2 * frozen),
        (
            "DeepSpeed ZeRO-2 (gradients and optimizer state sharded; the frozen models are not prepared by DeepSpeed)",
            "4P + 12P / N + 8P",
            4 + 12 / gpus + 2 * frozen,
        ),
        (
            "FSDP2 full sharding (`fsdp.yaml`; frozen models sharded too) or ZeRO-3",
            "24P / N, plus one gathered layer at a time",
            (trained + 2 * frozen) / gpus,
        ),
    ]
    out = ["| config | per GPU | P = 1.5B, 8 GPUs | P = 7B, 8 GPUs |", "|-|-|-|-|"]
    out += [f"| {name} | {formula} | {gb(b, 1.5)} | {gb(b, 7)} |" for name, formula, b in rows]
    grpo = trained + frozen
    return "\n".join(out) + (
        f"\n\ngrpo.py and rloo.py without a reward model: {grpo}P under DDP, {grpo}P / N under FSDP2 (1.5B: "
        f"{gb(grpo, 1.5)} and {gb(grpo / gpus, 1.5)})."
    )


def malloc_policy() -> str:
    """keep_freed_memory against glibc's own policy (benchmarks/RESULTS-malloc-policy.json, `python
    benchmarks/malloc_policy.py`): median over the rounds of each run's step time, wall time and peak memory."""
    r = record("RESULTS-malloc-policy.json")
    med = lambda runs, key: statistics.median(run[key] for run in runs)  # noqa: E731
    out = [
        "| script, 25 steps | glibc keeps freed blocks (the default) | glibc's own policy (`MALLOC_TOP_PAD_` set) | "
        "kept / own |",
        "|-|-|-|-|",
    ]
    for script in ("dpo", "ilql"):
        kept, own = r["runs"][f"{script}-kept"], r["runs"][f"{script}-glibc"]
        if kept[0]["step_s"] is not None:
            out.append(
                f"| {script}.py, step time | {med(kept, 'step_s'):.2f} s | {med(own, 'step_s'):.2f} s | "
                f"{med(kept, 'step_s') / med(own, 'step_s'):.2f}x |"
            )
        out.append(
            f"| {script}.py, whole run | {med(kept, 'seconds'):.1f} s | {med(own, 'seconds'):.1f} s | "
            f"{med(kept, 'seconds') / med(own, 'seconds'):.2f}x |"
        )
        out.append(
            f"| {script}.py, peak resident memory | {med(kept, 'peak_gib'):.2f} GiB | {med(own, 'peak_gib'):.2f} GiB | "
            f"{med(kept, 'peak_gib') / med(own, 'peak_gib'):.2f}x |"
        )
    rounds = len(r["runs"]["dpo-kept"])
    return "\n".join(out) + (
        f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`): medians over {rounds} "
        "rounds, the runs interleaved, each a fresh process on the tiny presets."
    )


def md_sections(name: str) -> list[tuple[str, str]]:
    """(heading, body) of each section of benchmarks/NAME, the file's title first."""
    with open(os.path.join(ROOT, "benchmarks", name)) as f:
        parts = re.split(r"^(#{1,3} .*)$", f.read(), flags=re.M)
    return [(parts[i].lstrip("# "), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def md_rows(body: str) -> list[dict]:
    """The rows of the first table in `body`, each as {column: cell}."""
    lines = [line for line in body.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return [dict(zip(cells[0], row)) for row in cells[2:]] if cells else []


def bench_cpu() -> str:
    """Each algorithm's latest row in benchmarks/RESULTS.md (`python benchmarks/bench.py`): a later run of an algorithm
    replaces the earlier one's row; each run is named with its date, machine and command."""
    latest, runs = {}, []
    for _, body in md_sections("RESULTS.md"):
        rows = md_rows(body)
        if not rows or "ours/TRL" not in rows[0]:
            continue
        date = re.search(r"Date: ([\d-]+)", body).group(1)
        machine = re.search(r"Machine: ([^;]+);", body).group(1)
        command = re.search(r"Command: `([^`]+)`", body).group(1)
        runs.append(f"{date}, {machine}, `{command}`")
        for row in rows:
            latest[(row["algorithm"], row["batch"])] = (row, len(runs))
    used = sorted({run for _, run in latest.values()})  # the runs that still own a row, numbered afresh
    several = len(used) > 1
    out = [
        "| algorithm | batch | ours s/step | TRL s/step | ours / TRL | ours / TRL peak MB |" + " run |" * several,
        "|-|-|-|-|-|-|" + "-|" * several,
    ]
    for (algorithm, batch), (row, run) in latest.items():
        out.append(
            f"| {algorithm} | {batch} | {row['ours s/step']} | {row['TRL s/step']} | **{float(row['ours/TRL']):.2f}x** | "
            f"{row.get('ours peak MB', '-')} / {row.get('TRL peak MB', '-')} |" + f" {used.index(run) + 1} |" * several
        )
    if several:
        how = "Runs: " + "; ".join(f"{n + 1}: {runs[run - 1]}" for n, run in enumerate(used))
        how += ". Each run alternates the two sides in one process; the rows of different runs were measured apart"
    else:
        how = f"One run: {runs[used[0] - 1]}. It alternates the two sides in one process, row by row"
    return "\n".join(out) + (
        f"\n\nbuiltin:tiny-gpt2 (DDPO: builtin:tiny-sd), float32. {how}, so compare a row's ratio, not times across "
        "rows (`benchmarks/RESULTS.md`)."
    )


# ---------------------------- docs/real-model.md: what the sweep's record says, seed by seed ----------------------------


def real_model_scripts() -> str:
    """Each script on the real model (benchmarks/RESULTS-real-model-scripts.json, `python benchmarks/runs.py
    real-model-scripts`): the command, its data, its wall time and its summary line."""
    r = record("RESULTS-real-model-scripts.json")
    data = {
        "sft.py": "`builtin:chatterbot-chat`: whole conversations (`messages`), loss on the assistant turns",
        "reward_modeling.py": "`builtin:vader-preferences-chat`: a user message, chosen / rejected assistant messages",
        "dpo.py": "the same pairs",
        "ppo.py": "the same prompts, scored by that reward model",
    }
    rows = ["| command | data | wall time | its summary line |", "|-|-|-|-|"]
    for script, run in r["runs"].items():
        line = run["line"].split("; model saved to")[0]
        rows.append(f"| {script} | {data[script]} | {minutes(run['seconds'])} | {line} |")
    return "\n".join(rows) + (
        f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`: the commands above, one after "
        "the other); the wall times include loading the model and the evaluations."
    )


def real_model_machines() -> str:
    """Which machine and thread count ran each method's seeds (benchmarks/RESULTS-real-model.json)."""
    r = record("RESULTS-real-model.json")
    groups: dict[tuple, list[str]] = {}
    for method in REAL_MODEL_ROWS:
        for seed, runs in r["seeds"].items():
            if method in runs:
                run = runs[method]
                key = (run.get("machine", r["machine"]), str(run.get("threads", "?")))
                groups.setdefault(key, []).append((method, seed))
    lines = []
    for (machine, threads), runs in groups.items():
        by_method: dict[str, list[str]] = {}
        for method, seed in runs:
            by_method.setdefault(method, []).append(seed)
        what = "; ".join(f"{m} {', '.join(seeds)}" for m, seeds in by_method.items())
        lines.append(f"- {machine}, `python`, {threads} thread{'s' if threads != '1' else ''}: {what}")
    return "The machine of each run (method and seeds), as the record names it:\n\n" + "\n".join(lines)


def curve_text(run: dict) -> str:
    return " -> ".join(f"{v:.2f}" for _, v in run["curve"])


def real_model_online() -> str:
    """GRPO, RLOO and PPO with the verifier, seed by seed: held-out accuracy along the run, the final evaluation, and
    how far each moved from the base model (benchmarks/RESULTS-real-model.json)."""
    r = record("RESULTS-real-model.json")
    base = r["base"]
    lines = []
    for method in ("grpo", "rloo", "ppo"):
        runs = sorted((seed, runs[method]) for seed, runs in r["seeds"].items() if method in runs)
        points = [c for c, _ in runs[0][1]["curve"]]
        lines.append(
            f"- **{method}.py**, held-out accuracy (one sampled reply per problem, the script's own evaluation) at "
            f"{', '.join(map(str, points))} completions:"
        )
        for seed, run in runs:
            lines.append(
                f"  - seed {seed}: {curve_text(run)}; final evaluation {run['greedy']:.2f} greedy, {run['sampled']:.2f} "
                f"sampled, KL {run['kl']:.2f}, {run['length']:.1f} reply tokens, {run['distinct']:.2f} distinct answers of 2"
            )
    below = [
        (m, seed)
        for m in ("grpo", "rloo", "ppo")
        for seed, runs in r["seeds"].items()
        if m in runs and runs[m]["greedy"] < base["greedy"]
    ]
    grpo_rloo = [runs[m] for runs in r["seeds"].values() for m in ("grpo", "rloo") if m in runs]
    summary = (
        f"Before training: {base['greedy']:.2f} greedy, {base['sampled']:.2f} sampled, {base['length']:.1f} reply tokens, "
        f"{base['distinct']:.2f} distinct answers of 2. GRPO's and RLOO's runs end {min(x['kl'] for x in grpo_rloo):.1f}-"
        f"{max(x['kl'] for x in grpo_rloo):.1f} nats per reply from the start, with {min(x['length'] for x in grpo_rloo):.1f}-"
        f"{max(x['length'] for x in grpo_rloo):.1f} reply tokens and {min(x['distinct'] for x in grpo_rloo):.2f}-"
        f"{max(x['distinct'] for x in grpo_rloo):.2f} distinct answers of 2. "
    )
    summary += (
        "Runs that end below the base model's greedy accuracy: " + ", ".join(f"{m}.py seed {seed}" for m, seed in below) + "."
        if below
        else "No run ends below the base model's greedy accuracy."
    )
    spread = ", ".join(
        f"{m}.py {r['aggregate'][m]['sampled']['min']:.2f}-{r['aggregate'][m]['sampled']['max']:.2f}"
        for m in ("grpo", "rloo", "ppo")
    )
    return "\n".join(lines) + "\n\n" + summary + f" The final sampled accuracy's range over the seeds: {spread}."


def real_model_offline() -> str:
    """Rejection-sampling SFT, DPO and KTO seed by seed: the self-sampled data and where each run ends
    (benchmarks/RESULTS-real-model.json)."""
    r = record("RESULTS-real-model.json")
    lines = []
    for method, what in (("rft", "correct replies learned from"), ("dpo", "pairs"), ("kto", "pairs, unpaired")):
        for seed, runs in sorted(r["seeds"].items()):
            if method not in runs:
                continue
            run, data = runs[method], runs[method]["self_samples"]
            count = data["rft"] if method == "rft" else data["pairs"]
            lines.append(
                f"- {REAL_MODEL_ROWS[method].split(' (')[0]}, seed {seed}: {data['correct']} of {data['samples']} samples "
                f"correct ({data['correct'] / data['samples']:.1%}), {count} {what}; KL {run['kl']:.2f}, greedy "
                f"{run['greedy']:.2f}, sampled {run['sampled']:.2f}"
            )
    return "\n".join(lines)


def real_model_learned_reward() -> str:
    """The learned-reward rows seed by seed: the reward model's pair accuracy, and along PPO the proxy score, the
    watched verifier's accuracy, their correlation on the policy's held-out samples, the KL and its coefficient
    (benchmarks/RESULTS-real-model.json)."""
    r = record("RESULTS-real-model.json")
    base = r["base"]
    out = []
    for method in ("rm_ppo_small", "rm_ppo", "rm_ppo_kl"):
        out.append(f"**{REAL_MODEL_ROWS[method]}** (`{method}`):\n")
        ended_below = []
        for seed, runs in sorted(r["seeds"].items()):
            run = runs.get(method)
            if not run:
                continue
            if not run.get("learned_reward"):
                out.append(f"- seed {seed}: {run['sampled']:.2f} sampled, {run['greedy']:.2f} greedy (no curves recorded)")
                continue
            lr, data = run["learned_reward"], run["self_samples"]
            fmt = lambda key, lr=lr: " -> ".join(f"{v:.2f}" for _, v in lr[key])  # noqa: E731
            peak = max(range(len(lr["gold"])), key=lambda i: lr["gold"][i][1])
            out.append(
                f"- seed {seed}: {data['pairs']} pairs, the reward model right on {lr['rm_accuracy']:.0%} of its held-out "
                f"pairs. Along PPO: proxy score {fmt('proxy')}; verifier's accuracy {fmt('gold')} (highest at evaluation "
                f"{peak + 1} of {len(lr['gold'])}); correlation of the two {fmt('correlation')}; KL coefficient "
                f"{lr['kl_coef'][0][1]:.2f} -> {lr['kl_coef'][-1][1]:.2f}. Final: {run['sampled']:.2f} sampled, "
                f"{run['greedy']:.2f} greedy, KL {run['kl']:.2f}"
            )
            if run["greedy"] < base["greedy"]:
                ended_below.append(seed)
        out.append(
            "\n"
            + (
                f"Seeds ending below the base model's greedy accuracy ({base['greedy']:.2f}): {', '.join(ended_below)}."
                if ended_below
                else f"No seed ends below the base model's greedy accuracy ({base['greedy']:.2f})."
            )
            + "\n"
        )
    return "\n".join(out).rstrip()


def real_model_h100_kl() -> str:
    """Each method's KL to the start on the H100 (benchmarks/RESULTS-real-model-H100.json, one seed) against the range
    of the CPU's seeds (benchmarks/RESULTS-real-model.json), and the method furthest outside it."""
    cpu, gpu = record("RESULTS-real-model.json"), record("RESULTS-real-model-H100.json")
    # the H100's rm_ppo ran before the row took 16 replies per question: it is the CPU's rm_ppo_small (DPO's pairs)
    same = {"rm_ppo": "rm_ppo_small"}
    found = []  # (label, KL on the H100, the CPU's min and max)
    for gpu_method in ("grpo", "rloo", "ppo", "rft", "dpo", "rm_ppo", "trl_grpo", "trl_rloo"):
        method = same.get(gpu_method, gpu_method)
        if gpu_method in gpu and method in cpu["aggregate"]:
            a = cpu["aggregate"][method]["kl"]
            found.append((REAL_MODEL_ROWS[method].split(" (")[0], gpu[gpu_method]["kl"], a["min"], a["max"]))
    rows = ["| method | KL on the H100 (one seed) | KL on CPU, seeds [min, max] | inside the CPU's range |", "|-|-|-|-|"]
    for label, k, lo, hi in found:
        rows.append(f"| {label} | {k:.2f} | [{lo:.2f}, {hi:.2f}] | {'yes' if lo <= k <= hi else 'no'} |")
    where = f"\n\nH100: {gpu['machine']}, {gpu['date']}; CPU: the sweep above."
    outside = [(max(lo - k, k - hi) / max(hi - lo, 1e-9), label) for label, k, lo, hi in found if not lo <= k <= hi]
    if outside:
        where += f" Furthest outside the CPU's range, in widths of that range: {max(outside)[1]}."
    return "\n".join(rows) + where


def gkd_variants() -> str:
    """gkd.py's on-policy, mixed and sequence-level KD at equal student steps (benchmarks/RESULTS-gkd-variants.json,
    `python benchmarks/runs.py gkd-variants`), and what the record says about them."""
    import math

    r = record("RESULTS-gkd-variants.json")
    rows = [
        "| completions | student held-out accuracy (best on the way) | teacher | held-out KL to the teacher, per token | "
        "reply tokens | top answer share | s/step | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in r["runs"].items():
        e = run["eval"]
        rows.append(
            f"| {name}, `{run['command'].strip()}` | {e['accuracy'][0]:.3f} -> {e['accuracy'][-1]:.3f} "
            f"({max(e['accuracy']):.3f}) | "
            f"{run['teacher_accuracy']:.3f} | {e['kl_to_teacher'][0]:.2f} -> {e['kl_to_teacher'][-1]:.2f} | "
            f"{e['completion_length'][0]:.1f} -> {e['completion_length'][-1]:.1f} | {e['top_answer_share'][-1]:.2f} | "
            f"{run['step_s']:.1f} | {minutes(run['seconds'])} |"
        )
    runs = r["runs"]
    finals = [run["eval"]["accuracy"][-1] for run in runs.values()]
    p = sum(finals) / len(finals)
    se = math.sqrt(max(p * (1 - p), 1e-12) / 64)
    lowest = min(runs, key=lambda k: runs[k]["eval"]["kl_to_teacher"][-1])
    cheaper = 1 - runs["on-policy"]["step_s"] / runs["sequence-level"]["step_s"]
    return (
        "\n".join(rows)
        + f"\n\n{r['machine']}, `{r['launcher']}`, {r['threads']} threads (`{r['command']}`). One sampled reply on 64 "
        + f"problems leaves a binomial standard error of about {se:.2f} on each final accuracy (at their mean, {p:.3f}): "
        + f"the largest difference between two of them, {max(finals) - min(finals):.3f}, is "
        + ("within" if max(finals) - min(finals) <= 2 * math.sqrt(2) * se else "beyond")
        + f" two standard errors of a difference ({2 * math.sqrt(2) * se:.3f}). "
        + f"The {lowest} run ends with the lowest KL to the teacher; on-policy GKD's steps take "
        + f"{abs(cheaper):.0%} {'less' if cheaper > 0 else 'more'} time than sequence-level KD's (the student samples, "
        + f"not the teacher). The on-policy run, `python gkd.py`, ended on\n\n```\n{runs['on-policy']['line']}\n```\n\n"
        + rerun_by_check("gkd")
    )


def default_line(script: str) -> str:
    """The line `python SCRIPT.py` ends on, as it comes (benchmarks/RESULTS-default-lines.json, `python
    benchmarks/runs.py default-lines`), with its machine, threads and wall time."""
    run = record("RESULTS-default-lines.json")["runs"][script]
    return (
        f"```\n{run['line']}\n```\n\n{run['machine']}, `{run['launcher']}`, {run['threads']} threads, "
        f"{minutes(run['seconds'])} with loading and evaluation (`python benchmarks/runs.py default-lines --only {script}`). "
        + (
            f"`tests/test_{script}.py` runs it again and fails when it ends on another line (on the CPU kind and torch "
            "named here)."
            if f'default_run("{script}"' in open(os.path.join(ROOT, "tests", f"test_{script}.py")).read()
            else rerun_by_check(script)
        )
    )


DEFAULT_LINES = ("sft", "reward_modeling", "dpo", "ddpo", "ilql")  # the runs of benchmarks/runs.py default-lines
TRL_CONFIGS = {  # our script: TRL 1.16's config (module, class)
    "grpo": ("trl", "GRPOConfig"),
    "rloo": ("trl", "RLOOConfig"),
    "dpo": ("trl", "DPOConfig"),
    "kto": ("trl", "KTOConfig"),
    "sft": ("trl", "SFTConfig"),
    "reward_modeling": ("trl", "RewardConfig"),
    "gkd": ("trl.experimental.distillation", "DistillationConfig"),
}


def trl_fields() -> str:
    """docs/trl-fields.md: one row per field that each TRL 1.16 config defines itself (not inherited from transformers'
    TrainingArguments or TRL's shared base), against the script's `Args`: the flag of the same name, or the note of
    docs/trl-fields.json (another name, partial, or left out, and why). A field with neither fails the render."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # TRL imports the installed vLLM: its notes before it logs
    sys.path.insert(0, ROOT)
    notes = json.load(open(os.path.join(ROOT, "docs", "trl-fields.json")))
    counts, tables = ["| TRL 1.16 config | our script | fields | ours | partial | left out |", "|---|---|---|---|---|---|"], []
    for script, (module, name) in TRL_CONFIGS.items():
        with warnings.catch_warnings():  # TRL's notes on the installed vLLM's version
            warnings.simplefilter("ignore")
            config = getattr(importlib.import_module(module), name)
        ours = dataclasses.fields(importlib.import_module(script).Args)
        ours, own = {f.name for f in ours}, []
        for cls in config.__mro__:  # the config and its same-named wrappers, up to the shared base
            if cls.__name__ != name:
                break
            own += [f for f in cls.__dict__.get("__annotations__", {}) if f not in own]
        rows, tally = ["| field | here | how |", "|---|---|---|"], {"ours": 0, "partial": 0, "out": 0}
        for field in own:
            status, note = notes[script].get(field) or [None, None]  # this script's note, its flag, then the shared note
            if field in ours and status is None:
                status, note = "ours", f"`--{field.replace('_', '-')}`"
            status, note = (status, note) if status else notes["common"].get(field, [None, None])
            if status is None:
                raise SystemExit(f"{name}.{field}: no flag of that name in {script}.py and no note in docs/trl-fields.json")
            tally[status] += 1
            rows.append(f"| `{field}` | {dict(ours='ours', partial='partial', out='left out')[status]} | {note} |")
        counts.append(
            f"| `{name}` | [{script}.py]({script}.md) | {len(own)} | {tally['ours']} | {tally['partial']} | {tally['out']} |"
        )
        tables.append(f"### {name} -> {script}.py\n\n" + "\n".join(rows))
    return "\n".join(counts) + "\n\n" + "\n\n".join(tables)


FIGURES = {
    **{f"default-line-{script}": (lambda script=script: default_line(script)) for script in DEFAULT_LINES},
    "gkd-variants": gkd_variants,
    "real-model-scripts": real_model_scripts,
    "real-model-machines": real_model_machines,
    "real-model-online": real_model_online,
    "real-model-offline": real_model_offline,
    "real-model-learned-reward": real_model_learned_reward,
    "real-model-h100-kl": real_model_h100_kl,
    "bench-cpu": bench_cpu,
    "h100-smollm": lambda: md_table("RESULTS-H100.md", "0.", 1),
    "h100-grpo-qwen": lambda: md_table("RESULTS-H100.md", "0.", 2),
    "h100-generation": lambda: md_table("RESULTS-H100.md", "1.", 1),
    "h100-ppo": lambda: md_table("RESULTS-H100.md", "2.", 1),
    "h100-mfu": lambda: md_table("RESULTS-H100.md", "4.", 1),
    "h200-mfu": lambda: md_table("RESULTS-H200.md", "1.", 1),
    "h200-rollouts": lambda: md_table("RESULTS-H200.md", "2b.", 1),
    "h200-rollout-batches": lambda: md_table("RESULTS-H200.md", "7.", 1),
    "malloc-policy": malloc_policy,
    "h200-deepspeed": lambda: md_table("RESULTS-H200.md", "4.", 2),
    "h200-compile": lambda: md_table("RESULTS-H200.md", "5.", 2),
    "h200-fsdp": lambda: md_table("RESULTS-H200.md", "3.", 1),
    "launchers-memory": lambda: md_table("RESULTS-launchers.md", "Memory", 1),
    "memory-on-paper": memory_on_paper,
    "first-run": first_run,
    "first-run-memory": first_run_memory,
    "ppo-default-runs": ppo_default_runs,
    "ppo-learned-reward": ppo_learned_reward,
    "kto-default-runs": kto_default_runs,
    "pipeline-runs": pipeline_runs,
    "ilql-notebook-line": lambda: notebook_line("ilql"),
    "agents-headline": agents_headline,
    "vllm-learning": vllm_learning,
    "vllm-speed": vllm_speed,
    "vllm-server": vllm_server,
    "vllm-memory": vllm_memory,
    "tool-calls": tool_calls,
    "offpolicy": offpolicy,
    "speed-cpu": speed_cpu,
    "speed-offline": speed_offline,
    "roofline": roofline,
    "real-model-full-table": real_model_full_table,
    "real-model-command": real_model_command,
    "ppo-critic": ppo_critic,
    "grpo-features": grpo_features,
    "agents-calculator": agents_calculator,
    "test-times": test_times,
    "real-model-table": real_model_table,
    "every-default-run": every_default_run,
    "grpo-default-runs": lambda: default_runs("grpo"),
    "rloo-default-runs": lambda: default_runs("rloo"),
    "trl-fields": trl_fields,
}


def with_figures(text: str, skip: tuple[str, ...] = ()) -> str:
    """`text` with every figure block rendered afresh from its record, less the blocks named in `skip`."""
    for name, render in FIGURES.items():
        if name in skip:
            continue
        start, end = f"<!-- figures:{name} -->", f"<!-- /figures:{name} -->"
        while start in text:
            head, rest = text.split(start, 1)
            if end in rest:
                rest = rest.split(end, 1)[1]
            text = f"{head}{start.replace('figures:', 'figures@')}\n{render()}\n{end}{rest}"
        text = text.replace(start.replace("figures:", "figures@"), start)
    return text


def pages() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
    )


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
        "RESULTS-real-model-critic.png",
        "RESULTS-real-model-H100.png",
        "RESULTS-agents.png",
    ):
        shutil.copyfile(os.path.join(ROOT, "benchmarks", name), os.path.join(ROOT, "docs", "img", name))


if __name__ == "__main__":
    stale = []
    for script in SCRIPTS:
        text, fresh = page_with_flags(script)
        if text != fresh:
            stale.append(f"docs/{script}.md (flags)")
            if "--check" not in sys.argv:
                with open(os.path.join(ROOT, "docs", f"{script}.md"), "w") as f:
                    f.write(fresh)
    for path in pages():
        with open(path) as f:
            text = f.read()
        fresh = with_figures(text)
        if text != fresh:
            stale.append(f"{os.path.relpath(path, ROOT)} (figures)")
            if "--check" not in sys.argv:
                with open(path, "w") as f:
                    f.write(fresh)
    if "--check" in sys.argv:
        print(f"out of date: {stale} (run python docs/build_assets.py)" if stale else "flag tables and figures up to date")
        sys.exit(1 if stale else 0)
    extract_images()
    print(f"rewritten: {stale or 'none'}; images in docs/img/")
