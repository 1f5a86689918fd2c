"""Each script's default run, as a reader first runs it: `python sft.py`, `python reward_modeling.py`, `python dpo.py`,
`python ddpo.py` and `python ilql.py`, each in a fresh folder with every built-in cached. Records each run's summary
line and wall time, with the machine, launcher and thread count. Writes benchmarks/RESULTS-default-lines.json, from
which each script's page renders the line its default run ends on (docs/build_assets.py). ppo.py's default run has its
own record (benchmarks/first_run.py, ppo_default.py), as have kto.py's (kto_default.py), gkd.py's (gkd_variants.py)
and grpo.py's and rloo.py's (default_runs.py).

    python benchmarks/default_lines.py                     # every script above, one after the other
    python benchmarks/default_lines.py --scripts sft dpo   # some of them; the others keep their recorded lines
    python benchmarks/default_lines.py --check --scripts ddpo ilql   # rerun, compare with the record, write nothing

`--check` is the test of the lines the suite has no room to rerun (tests/conftest.py's `default_run` reruns the
short ones): on the CPU kind and torch the record names, each run must end on its recorded line but for the time. It
also checks the lines the other records hold, rerunning each one's first run as that record ran it: kto.py's seed 1
(RESULTS-kto-default.json), gkd.py's on-policy run, its default (RESULTS-gkd-variants.json), and grpo.py's and
rloo.py's seed 1 (RESULTS-default-runs.json).

    python benchmarks/default_lines.py --check --scripts kto gkd grpo rloo
"""

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch
import tyro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS-default-lines.json")
sys.path.insert(0, ROOT)

from records import machine, run_script, untimed  # noqa: E402

PREFIX = {"sft": "sft: ", "reward_modeling": "reward model: ", "dpo": "dpo: ", "ddpo": "ddpo: ", "ilql": "ilql: "}
KIND = ("machine", "threads", "torch")  # what a rerun must share with the record for its line to be the same


def recorded(script: str) -> tuple[list[str], str, dict] | None:
    """The argv, the line and the machine of the recorded run of `script` that --check reruns (None if none)."""
    if script in PREFIX:
        run = read(RESULTS)["runs"].get(script)
        return None if run is None else ([f"{script}.py"], run["line"], run)
    if script == "kto":  # benchmarks/kto_default.py: `python kto.py --seed S`, each in a fresh folder
        r = read(os.path.join(HERE, "RESULTS-kto-default.json"))
        return ["kto.py", "--seed", "1"], r["runs"]["1"]["line"], r
    if script == "gkd":  # benchmarks/gkd_variants.py: its on-policy run is the default one
        r = read(os.path.join(HERE, "RESULTS-gkd-variants.json"))
        return ["gkd.py"], r["runs"]["on-policy"]["line"], r
    r = read(os.path.join(HERE, "RESULTS-default-runs.json"))  # benchmarks/default_runs.py: grpo.py and rloo.py
    run = r["runs"].get(f"{script}-1")
    if run is None:
        return None
    return [f"{script}.py", "--seed", "1", "--output-dir", run["folder"]], run["summary"], r


def read(path: str) -> dict:
    if not os.path.exists(path):
        return {"runs": {}}
    with open(path) as f:
        return json.load(f)


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: list(PREFIX))
    """the scripts whose default run to (re)record; with --check, also kto, gkd, grpo and rloo"""
    check: bool = False
    """rerun them and compare each line with the record (but for the time) instead of recording: exit status 1 when
    one differs"""


def main(args: Args) -> None:
    others = {"kto": "kto_default.py", "gkd": "gkd_variants.py", "grpo": "default_runs.py", "rloo": "default_runs.py"}
    elsewhere = sorted(set(args.scripts) & set(others)) if not args.check else []
    if elsewhere:
        raise SystemExit(
            f"error: --scripts {' '.join(elsewhere)}: recorded by "
            f"{', '.join(f'benchmarks/{others[s]}' for s in elsewhere)}; here only with --check"
        )
    unknown = sorted(set(args.scripts) - set(PREFIX) - set(others))
    if unknown:
        raise SystemExit(f"error: --scripts {' '.join(unknown)}: not one of {', '.join([*PREFIX, *others])}")
    record = read(RESULTS)
    here = {"machine": machine(), "launcher": "python", "threads": torch.get_num_threads(), "torch": torch.__version__}
    differ = []
    for script in args.scripts:
        if args.check:
            found = recorded(script)
            if found is None:
                raise SystemExit(f"error: {script}.py has no recorded line to check: record it first (without --check)")
            argv, recorded_line, kind = found
            if [kind.get(k) for k in KIND] != [here[k] for k in KIND]:
                print(
                    f"{script}: not checked, recorded on {kind['machine']}, {kind.get('threads')} threads, torch "
                    f"{kind.get('torch')} (here {here['machine']}, {here['threads']} threads, torch {here['torch']})"
                )
                continue
        else:
            argv = [f"{script}.py"]
        with tempfile.TemporaryDirectory(prefix=f"rlhf-default-{script}-") as folder:
            stdout, seconds = run_script(argv, folder)
        line = next(line for line in stdout.splitlines() if line.startswith(PREFIX.get(script, f"{script}: ")))
        if args.check:
            same = untimed(line) == untimed(recorded_line)
            print(
                f"{script}: {'the recorded line' if same else 'differs'} (python {' '.join(argv)}, {seconds:.0f} s)\n"
                f"  now:      {line}" + ("" if same else f"\n  recorded: {recorded_line}"),
                flush=True,
            )
            differ += [] if same else [script]
            continue
        record["runs"][script] = {"command": f"python {script}.py", "line": line, "seconds": seconds, **here}
        print(line, flush=True)
        with open(RESULTS, "w") as f:  # after each run: what is done stays done
            json.dump(record, f, indent=1)
            f.write("\n")
    if args.check:
        raise SystemExit(f"differs from the record: {' '.join(differ)}" if differ else 0)
    print(f"wrote {os.path.relpath(RESULTS, ROOT)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
