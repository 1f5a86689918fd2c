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
short ones): on the CPU kind and torch the record names, each run must end on its recorded line but for the time.
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


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: list(PREFIX))
    """the scripts whose default run to (re)record"""
    check: bool = False
    """rerun them and compare each line with the record (but for the time) instead of recording: exit status 1 when
    one differs"""


def main(args: Args) -> None:
    unknown = sorted(set(args.scripts) - set(PREFIX))
    if unknown:
        raise SystemExit(f"error: --scripts {' '.join(unknown)}: not one of {', '.join(PREFIX)}")
    record = {"runs": {}}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            record = json.load(f)
    here = {"machine": machine(), "launcher": "python", "threads": torch.get_num_threads(), "torch": torch.__version__}
    differ = []
    for script in args.scripts:
        recorded = record["runs"].get(script)
        if args.check and recorded is None:
            raise SystemExit(f"error: {script}.py has no recorded line to check: record it first (without --check)")
        kind = ["machine", "threads", "torch"]
        if args.check and [recorded[k] for k in kind] != [here[k] for k in kind]:
            print(
                f"{script}: not checked, recorded on {recorded['machine']}, {recorded['threads']} threads, torch "
                f"{recorded['torch']} (here {here['machine']}, {here['threads']} threads, torch {here['torch']})"
            )
            continue
        with tempfile.TemporaryDirectory(prefix=f"rlhf-default-{script}-") as folder:
            stdout, seconds = run_script([f"{script}.py"], folder)
        line = next(line for line in stdout.splitlines() if line.startswith(PREFIX[script]))
        if args.check:
            same = untimed(line) == untimed(recorded["line"])
            print(
                f"{script}: {'the recorded line' if same else 'differs'} ({seconds:.0f} s)\n  now:      {line}"
                + ("" if same else f"\n  recorded: {recorded['line']}"),
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
