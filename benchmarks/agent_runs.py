"""Agents on the real model: builtin:smollm2-135m-instruct with the calculator on reasoning-gym `products` (3-digit x
3-digit), and in the number-guessing environment. Writes benchmarks/RESULTS-agents.md, its JSON and a PNG.

Stages, each run through its script's own CLI and skipped when its result is already in the JSON (a sweep resumes):
- base: the model as it comes, without tools and with the calculator;
- sft: sft.py on builtin:calculator-traces (--assistant-only-loss), a checkpoint every --sft-every steps, each evaluated:
  the share of episodes with a well-formed call, accuracy, failures; the warm start is the first checkpoint where at
  least half of the episodes call the tool well;
- grpo, rloo: from that checkpoint, with the live calculator, 4 problems x 4 episodes per update (their own
  evaluation during the run on 16 of the held-out problems, the final one here on all); grpo-long: grpo.py for
  --long-updates updates;
- trl: TRL 1.16's GRPOTrainer with tools=[calculator] from the same warm start, at the same settings;
- guess: sft.py on builtin:guess-number-traces (checkpoints evaluated on the way), then grpo.py in the guess_number
  environment from the first checkpoint that solves at least a fifth of the held-out games (else the last);
  guess-long: the same grpo.py run for --guess-long-updates updates; guess-shaped: grpo.py with guess_progress (partial
  credit for narrowing the search) beside the game's reward, 8 games x 4 episodes per update, two passes over each,
  the warm start and the result evaluated on 4 episodes per held-out number;
- guess-range: sft.py on builtin:guess-range-traces (random search in the guess_range game, whose replies name the
  range left), then grpo.py from it with guess_progress beside the game's reward; both evaluated on 4 episodes per
  held-out number, with how far each guess falls from the middle of the range left;
- guess-mixed: the same, with SFT on builtin:guess-mixed-traces (halving and random search, half the games each);
  guess-mixed-more: grpo.py on from that run's model for --more-updates updates, at the same settings; its warm
  start and its model are evaluated again on --wide-episodes episodes per held-out number.

Every evaluation: the held-out problems (reasoning-gym's seed 2, none of them among the training or the SFT problems),
one episode each sampled at temperature 1 (grpo.py's evaluation), the verifier's score, tool calls and failures per
episode, turns, the model's tokens, distinct answers, and the KL to the base model (the mean over episodes of the summed
log-ratio of the model's own tokens, on the evaluated model's samples).

    python benchmarks/agent_runs.py                  # everything
    python benchmarks/agent_runs.py --stages base sft
"""

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from accelerate import Accelerator  # noqa: E402
from agent_report import (  # noqa: E402
    GUESS_RUNS,
    MIXED_MORE,
    MIXED_SFT,
    RANGE_CURVES,
    SEARCH_STAGES,
    SHAPED_CURVES,
    SHAPED_RUN,
    SHAPED_WARM,
    WIDE,
    report,
)
from records import median, scalars, trl_settings  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import grpo  # noqa: E402
from common.cli import cli  # noqa: E402
from common.loading import load_pretrained, load_tokenizer  # noqa: E402
from common.rewards import distinct_answers, extract_answer, load_task, verifier  # noqa: E402
from common.rollout import Engine, Task, per_token_logprobs  # noqa: E402
from common.tools import Toolset  # noqa: E402
from presets.agents import PRODUCTS, guess_progress  # noqa: E402

BASE = "builtin:smollm2-135m-instruct"
TASK = ["--dataset-name", "reasoning-gym:products", "--task-config", json.dumps(PRODUCTS)]
EPISODE = ["--max-prompt-length", "400", "--max-completion-length", "96"]
GUESS_TOKENS = 384  # an episode's tokens, the model's and the game's: binary-search traces take 61-373 after the prompt
GAMES = {  # environment: its dataset and an episode's tokens (guess_range's random-search traces take up to 435)
    "guess_number": ("builtin:guess-number", GUESS_TOKENS),
    "guess_range": ("builtin:guess-range", 448),
}


STAGES = "base sft grpo rloo trl grpo-long guess guess-long guess-shaped guess-range guess-mixed guess-mixed-more"


@dataclass
class Args:
    out: str = "outputs/agents"
    """the runs' folders (replaced by a rerun of their stage)"""
    results: str = os.path.join(ROOT, "benchmarks", "RESULTS-agents.json")
    """the measured results, read first so that finished stages are skipped"""
    stages: list[str] = field(default_factory=lambda: STAGES.split())
    """which stages to run (the default: all of them, in this order)"""
    eval_size: int = 64
    """held-out problems per evaluation"""
    sft_steps: int = 30
    """the longest SFT warm start tried"""
    sft_every: int = 5
    """steps between the SFT checkpoints"""
    sft_curve: list[int] = field(default_factory=lambda: [5, 10, 20])
    """the SFT checkpoints evaluated (an evaluation of 64 episodes takes about 5 minutes on 2 CPU cores)"""
    rl_updates: int = 10
    """grpo / rloo updates of 4 problems x 4 episodes (and TRL's steps)"""
    long_updates: int = 30
    """grpo.py's updates in the grpo-long stage"""
    guess_sft_steps: int = 40
    """SFT steps on the binary-search traces (80 games, 8 a step)"""
    guess_sft_curve: list[int] = field(default_factory=lambda: [20, 40])
    """the guess SFT checkpoints evaluated"""
    guess_updates: int = 10
    """grpo.py's updates in the guess_number environment"""
    guess_long_updates: int = 20
    """grpo.py's updates in the environment in the guess-long stage"""
    guess_shaped_updates: int = 12
    """grpo.py's updates (8 games x 4 episodes each) in the guess-shaped stage"""
    guess_episodes: int = 4
    """episodes per held-out number in the guess-shaped, guess-range and guess-mixed stages' evaluations (20 numbers)"""
    range_sft_steps: int = 60
    """SFT steps on the traces of the guess-range and guess-mixed stages (320 games each, 8 a step)"""
    range_updates: int = 8
    """grpo.py's updates (8 games x 4 episodes each) in the guess-range and guess-mixed stages"""
    more_updates: int = 10
    """grpo.py's further updates in the guess-mixed-more stage (10: each of the 80 training numbers once)"""
    wide_episodes: int = 8
    """episodes per held-out number in the guess-mixed-more stage's second, larger evaluation (of the warm start and
    the final model)"""
    threads: int = 2
    """torch threads of each run"""


def run(command: list[str], threads: int) -> float:
    """A script through its CLI; returns its wall time (s)."""
    start = time.time()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    print("$", " ".join(command), flush=True)
    subprocess.run([sys.executable, *command], cwd=ROOT, env=env, check=True)
    return time.time() - start


@torch.no_grad()
def evaluate(folder: str, tools: bool, eval_size: int, base=None, environment: str | None = None, episodes: int = 1) -> dict:
    """`episodes` sampled episodes per held-out problem (the rollout engine grpo.py samples with), scored by the verifier
    (or the environment's reward)."""
    flags = dict(model_name=folder, max_prompt_length=400, max_completion_length=96, eval_size=eval_size, train_size=64)
    if environment:
        dataset, tokens = GAMES[environment]
        flags |= dict(dataset_name=dataset, eval_fraction=0.2, environment=environment, max_completion_length=tokens)
    else:
        flags |= dict(dataset_name="reasoning-gym:products", task_config=json.dumps(PRODUCTS), tools=["calculator"] * tools)
    args = grpo.Args(**flags)
    accelerator = Accelerator()
    tokenizer = load_tokenizer(folder, padding_side="left")
    agent = Toolset(args, tokenizer) if tools or environment else None
    _, rows, chat = load_task(args, tokenizer, "prompt", args.max_prompt_length, agent.schemas if agent else None)
    rows = [row for row in rows for _ in range(episodes)]
    policy = load_pretrained(folder, AutoModelForCausalLM).eval()
    sampler = Engine(args, Task(tokenizer, [], rows, chat, [], torch.ones(0), agent), policy, accelerator)
    torch.manual_seed(args.seed)
    scores, calls, failures, turns, tokens, formed, kls, texts, states, progress = [], [], [], [], [], [], [], [], [], []
    for i in range(0, len(rows), 32):
        chunk = rows[i : i + 32]
        rollout = sampler.rollout(chunk)
        if rollout.episodes is None:
            completions = tokenizer.batch_decode(rollout.completions, skip_special_tokens=True)
            messages = [[{"role": "assistant", "content": c}] for c in completions]
        else:
            messages = rollout.episodes.messages
            calls += rollout.episodes.tool_calls
            failures += rollout.episodes.failures
            turns += rollout.episodes.turns
            formed += [any(m.get("tool_calls") for m in e) for e in messages]
        if environment:
            scores += [e.get_reward() for e in rollout.episodes.environments]
            progress += guess_progress(messages, rollout.episodes.environments)
            states += [guess_states(episode) for episode in messages]
        else:
            scores += verifier(None, messages, [r["answer"] for r in chunk], rg_entry=[r["rg_entry"] for r in chunk])
        texts += [m[-1]["content"] for m in messages]
        tokens += rollout.model_mask.sum(1).tolist()
        if base is not None:  # sum over the model's own tokens of log pi - log pi_base, on the model's samples
            inputs = (rollout.prompts, rollout.prompt_mask, rollout.completions, rollout.mask, 1.0)
            ratio = per_token_logprobs(policy, *inputs)[0] - per_token_logprobs(base, *inputs)[0]
            kls += (ratio * rollout.model_mask).sum(1).tolist()
    n = len(scores)
    result = {
        "accuracy": sum(scores) / n,
        "reply_tokens": sum(tokens) / n,
        "distinct_answers": distinct_answers(texts, True)[1],
        "kl": sum(kls) / n if kls else 0.0,
        "samples": [{"answer": r["answer"], "reply": extract_answer(t), "text": t} for r, t in zip(rows[:3], texts)],
    }
    if agent:
        result |= {
            "calls_per_episode": sum(calls) / n,
            "failure_rate": sum(failures) / max(1, sum(calls)),
            "turns": sum(turns) / n,
            "well_formed": sum(formed) / n,
        }
    if environment:
        result |= {"solved": sum(s > 0 for s in scores) / n, "episodes": episodes}
        result |= search_figures(states, scores) | {"guess_progress": sum(progress) / n}
    return result


def guess_states(messages: list[dict]) -> list[tuple[int, int, int]]:
    """Each guess of a guessing episode with the numbers its replies so far left possible: (guess, low, high), read
    back from the replies (malformed calls and guesses after the game ended are left out)."""
    low, high, pending, states = 1, 100, [], []
    for message in messages:
        if message["role"] == "assistant":
            pending += [call["function"].get("arguments") for call in message.get("tool_calls") or []]
        elif message["role"] == "tool" and pending:
            arguments, reply = pending.pop(0), message["content"]
            number = arguments.get("number") if isinstance(arguments, dict) else None
            if not isinstance(number, int) or not reply.startswith(("higher", "lower", "correct")):
                continue
            states.append((number, low, high))
            low, high = (max(low, number + 1), high) if reply.startswith("higher") else (low, high)
            low, high = (low, min(high, number - 1)) if reply.startswith("lower") else (low, high)
    return states


def search_figures(episodes: list[list[tuple[int, int, int]]], scores: list[float]) -> dict:
    """How the guesses sit in the range left: off_middle, the mean of |guess - middle| / numbers left (0 halves the
    range, a uniform draw averages 0.25, 0.5 and more is at an end or outside it); at_middle, the share of guesses that
    halve it (within half a number of the middle); opens_middle, the share of episodes whose first guess is 50 or 51,
    and the solve rate of those episodes and of the others."""
    states = [state for episode in episodes for state in episode]
    offsets = [abs(guess - (low + high) / 2) / (high - low + 1) for guess, low, high in states]
    middle = [abs(guess - (low + high) / 2) <= 0.5 for guess, low, high in states]
    opens = [bool(e) and abs(e[0][0] - 50.5) <= 0.5 for e in episodes]
    share = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    opening = [s > 0 for s, o in zip(scores, opens) if o]
    otherwise = [s > 0 for s, o in zip(scores, opens) if not o]
    figures = {"off_middle": share(offsets), "at_middle": share(middle), "opens_middle": share(opens)}
    figures |= {"solved_opening_middle": share(opening)} if opening else {}  # no such episodes: no figure
    figures |= {"solved_otherwise": share(otherwise)} if otherwise else {}
    return figures | {"guesses": len(states)}


def main(args: Args) -> None:
    results = json.load(open(args.results)) if os.path.exists(args.results) else {}
    base_model = load_pretrained(BASE, AutoModelForCausalLM).eval() if args.stages else None  # the KL's reference

    def save():
        with open(args.results + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.results + ".tmp", args.results)  # a killed sweep keeps what it measured

    def launch(key: str, command: list[str]) -> float:  # a script run, its command kept for the report
        results.setdefault("commands", {})[key] = "python " + shlex.join(command)
        return run(command, args.threads)

    def measure(key: str, folder: str, tools: bool = True, **kw) -> None:
        if key not in results:  # each row keeps the machine it was measured on (sweeps resume across machines)
            results[key] = evaluate(folder, tools, args.eval_size, base_model, **kw) | {"machine": machine(args.threads)}
        print(key, {k: v for k, v in results[key].items() if k != "samples"}, flush=True)
        save()

    def checkpoint_curve(points: list, prefix: str, steps: list[int], label: str, **kw) -> None:
        """Evaluate the SFT checkpoints `prefix`_checkpoints/step_N not yet in `points` (kept sorted by step)."""
        for step in steps:
            if step not in [c["step"] for c in points]:
                folder = os.path.join(f"{prefix}_checkpoints", f"step_{step}")
                point = evaluate(folder, True, args.eval_size, base_model, **kw) | {"machine": machine(args.threads)}
                points.append({"step": step} | point)
                points.sort(key=lambda c: c["step"])
                print(label, {k: v for k, v in point.items() if k != "samples"}, flush=True)
                save()

    torch.set_num_threads(args.threads)
    if "base" in args.stages:
        measure("base without tools", BASE, tools=False)
        measure("base with the calculator", BASE)
    sft_dir = os.path.join(args.out, "sft")
    if "sft" in args.stages:
        last = os.path.join(f"{sft_dir}_checkpoints", f"step_{args.sft_steps}")
        if not os.path.isdir(last):  # train once; the checkpoints are evaluated one by one below
            sft = ["sft.py", "--model-name", BASE, "--dataset-name", "builtin:calculator-traces", "--assistant-only-loss"]
            sft += ["--max-steps", str(args.sft_steps), "--save-steps", str(args.sft_every), "--batch-size", "8"]
            sft += ["--learning-rate", "2e-5", "--max-seq-length", "320", "--eval-steps", "1000", "--eval-fraction", "0.02"]
            sft += ["--output-dir", sft_dir, "--overwrite", "--log-dir", os.path.join(args.out, "runs")]
            results["sft seconds"] = launch("sft", sft)
        checkpoint_curve(results.setdefault("sft curve", []), sft_dir, args.sft_curve, "sft")
    logs, warm_folder = os.path.join(args.out, "runs"), None
    if "sft curve" in results:
        warm = next((c for c in results["sft curve"] if c["well_formed"] >= 0.5), results["sft curve"][-1])
        results["sft warm start"] = warm
        warm_folder = os.path.join(f"{sft_dir}_checkpoints", f"step_{warm['step']}")
        for stage, script, key, updates in RL_RUNS:
            updates = getattr(args, updates)
            if stage not in args.stages or key in results:
                continue
            folder = os.path.join(args.out, stage)
            command = [*rl_command(script, warm_folder, updates), "--eval-freq", "5", "--eval-samples", "16"]
            command += ["--output-dir", folder, "--overwrite", "--log-dir", os.path.join(logs, stage)]
            seconds = launch(key, command)
            measure(key, folder)
            results[key] |= {"seconds": seconds, "updates": updates}
            save()
    if "trl" in args.stages and "sft warm start" in results and "sft then trl grpo" not in results:
        folder = os.path.join(args.out, "trl_grpo")
        results.setdefault("commands", {})["sft then trl grpo"] = "python benchmarks/agent_runs.py --stages trl"
        start = time.time()
        step_s = trl_grpo(args, warm_folder, folder)
        seconds = time.time() - start
        measure("sft then trl grpo", folder)
        results["sft then trl grpo"] |= {"seconds": seconds, "step_s": step_s}
        # grpo.py's step at the same settings, timed on this machine right after TRL's (no evaluation inside)
        command = [*rl_command("grpo", warm_folder, 5), "--eval-freq", "100", "--eval-samples", "16", "--output-dir"]
        command += [os.path.join(args.out, "grpo_timing"), "--overwrite", "--log-dir", os.path.join(logs, "grpo_timing")]
        launch("grpo.py timed beside trl", command)
        results["sft then trl grpo"] |= {
            "ours_step_s": median([v for _, v in curve(os.path.join(logs, "grpo_timing"), "time/step")]),
            "ours_generate_s": median([v for _, v in curve(os.path.join(logs, "grpo_timing"), "time/generate")]),
        }
        save()
    if {"guess", "guess-long", "guess-shaped"} & set(
        args.stages
    ):  # the environment: before and after SFT on binary-search traces, then after GRPO
        game = dict(environment="guess_number")
        measure("guess: base", BASE, **game)
        guess_sft = os.path.join(args.out, "guess_sft")
        last = os.path.join(f"{guess_sft}_checkpoints", f"step_{args.guess_sft_steps}")
        if "guess: sft" not in results or not os.path.isdir(last):
            command = ["sft.py", "--model-name", BASE, "--dataset-name", "builtin:guess-number-traces"]
            command += ["--assistant-only-loss", "--max-steps", str(args.guess_sft_steps), "--batch-size", "8"]
            command += ["--save-steps", str(min(args.guess_sft_curve)), "--learning-rate", "2e-5"]
            command += ["--max-seq-length", "640", "--eval-steps", "1000", "--eval-fraction", "0.05"]
            command += ["--output-dir", guess_sft, "--overwrite"]
            seconds = launch("guess: sft", command + ["--log-dir", os.path.join(args.out, "runs", "guess_sft")])
            results["guess: sft"] = {"train_seconds": seconds, "train_steps": args.guess_sft_steps, "curve": []}
        points = results["guess: sft"]["curve"]
        checkpoint_curve(points, guess_sft, args.guess_sft_curve, "guess sft", **game)
        warm = next((c for c in points if c["solved"] >= 0.2), points[-1])
        results["guess: sft"] |= warm
        guess_warm = os.path.join(f"{guess_sft}_checkpoints", f"step_{warm['step']}")
        play = ["grpo.py", "--model-name", guess_warm, "--environment", "guess_number", "--dataset-name"]
        play += ["builtin:guess-number", "--eval-fraction", "0.2", "--max-prompt-length", "400"]
        play += ["--max-completion-length", str(GUESS_TOKENS)]  # grpo.py in the game from the warm start
        for stage, key, name, updates in GUESS_RUNS:
            updates = getattr(args, updates)
            if stage not in args.stages or key in results:
                continue
            folder = os.path.join(args.out, name)
            command = [*play, "--reward-funcs", "--batch-size", "4", "--num-generations", "4"]  # 633-token episodes
            command += ["--mini-batch-size", "4"]
            command += ["--gradient-accumulation-steps", "4", "--total-prompts", str(4 * updates)]
            command += ["--learning-rate", "1e-5", "--eval-freq", "5", "--output-dir", folder, "--overwrite"]
            seconds = launch(key, command + ["--log-dir", os.path.join(args.out, "runs", name)])
            measure(key, folder, **game)
            results[key] |= {"seconds": seconds, "updates": updates}
        if "guess-shaped" in args.stages:  # the game's reward plus partial credit, on more games per update
            many = dict(environment="guess_number", episodes=args.guess_episodes)
            measure(SHAPED_WARM, guess_warm, **many)
            key, name, updates = SHAPED_RUN, "guess_grpo_shaped", args.guess_shaped_updates
            if key not in results:
                folder = os.path.join(args.out, name)
                command = [*play, "--reward-funcs", "presets.agents:guess_progress", "--reward-weights", "0.5"]
                command += ["--batch-size", "8", "--num-generations", "4", "--mini-batch-size", "4"]
                command += ["--gradient-accumulation-steps", "8", "--num-iterations", "2"]
                command += ["--total-prompts", str(8 * updates), "--learning-rate", "2e-5", "--eval-freq", "4"]
                seconds = launch(key, command + ["--output-dir", folder, "--overwrite", "--log-dir", f"{logs}/{name}"])
                measure(key, folder, **many)
                results[key] |= {"seconds": seconds, "updates": updates}
            if "curves" not in results[key]:  # the run's own curves, from its logs
                run_logs = os.path.join(logs, name)
                results[key] |= {"curves": {tag: curve(run_logs, tag) for tag, _, _ in SHAPED_CURVES}}
                results[key]["step_s"] = median([v for _, v in curve(run_logs, "time/step")])
    for stage, (sft_key, key, traces, name) in SEARCH_STAGES.items():  # in the game that names the range left
        more = stage == "guess-mixed" and "guess-mixed-more" in args.stages  # on from the end of the guess-mixed run
        if stage not in args.stages and not more:
            continue
        range_game, sft_folder = dict(environment="guess_range", episodes=args.guess_episodes), f"{args.out}/{name}_sft"
        warm = os.path.join(f"{sft_folder}_checkpoints", f"step_{args.range_sft_steps}")
        if not os.path.isdir(warm):
            command = ["sft.py", "--model-name", BASE, "--dataset-name", traces]
            command += ["--assistant-only-loss", "--max-steps", str(args.range_sft_steps), "--batch-size", "8"]
            command += ["--save-steps", "20", "--learning-rate", "2e-5", "--max-seq-length", "768"]
            command += ["--eval-steps", "1000", "--eval-fraction", "0.05", "--output-dir", sft_folder, "--overwrite"]
            results[sft_key] = {"train_seconds": launch(sft_key, command + ["--log-dir", f"{logs}/{name}_sft"])}
        if "solved" not in results.get(sft_key, {}):
            point = evaluate(warm, True, args.eval_size, base_model, **range_game) | {"step": args.range_sft_steps}
            results[sft_key] = results.get(sft_key, {}) | point | {"machine": machine(args.threads)}
            save()
        runs = [(key, warm, f"{name}_grpo", args.range_updates, ["--eval-freq", "4"])]  # key, start, folder, ...
        if more:
            extra = ["--eval-freq", "5", "--save-freq", "5"]
            runs.append((MIXED_MORE, os.path.join(args.out, f"{name}_grpo"), f"{name}_grpo_more", args.more_updates, extra))
        for run_key, start, run_name, updates, extra in runs:  # each trained once, then evaluated once
            folder, run_logs = os.path.join(args.out, run_name), os.path.join(logs, run_name)
            if run_key not in results:
                command = ["grpo.py", "--model-name", start, "--environment", "guess_range", "--dataset-name"]
                command += ["builtin:guess-range", "--eval-fraction", "0.2", "--max-prompt-length", "400"]
                command += ["--max-completion-length", str(GAMES["guess_range"][1]), "--reward-funcs"]
                command += ["presets.agents:guess_progress", "--reward-weights", "1.0", "--batch-size", "8"]
                command += ["--num-generations", "4", "--mini-batch-size", "4", "--gradient-accumulation-steps", "8"]
                command += ["--num-iterations", "2", "--total-prompts", str(8 * updates), "--learning-rate", "2e-5"]
                command += [*extra, "--output-dir", folder, "--overwrite", "--log-dir", run_logs]
                results[run_key] = {"seconds": launch(run_key, command), "updates": updates}
                save()
            if "solved" not in results[run_key]:
                point = evaluate(folder, True, args.eval_size, base_model, **range_game)
                results[run_key] |= point | {"machine": machine(args.threads)}
                results[run_key]["step_s"] = median([v for _, v in curve(run_logs, "time/step")])
                results[run_key]["curves"] = {tag: curve(run_logs, tag) for tag, _, _ in RANGE_CURVES}
                save()
            print(run_key, {k: v for k, v in results[run_key].items() if k not in ("samples", "curves")}, flush=True)
        if more:  # the warm start and the final model again, on more episodes: a smaller standard error
            wide = dict(environment="guess_range", episodes=args.wide_episodes)
            measure(MIXED_SFT + WIDE, warm, **wide)
            measure(MIXED_MORE + WIDE, os.path.join(args.out, f"{name}_grpo_more"), **wide)
    runs = [(key, stage) for stage, _, key, _ in RL_RUNS] + [(key, name) for _, key, name, _ in GUESS_RUNS]
    for key, run_name in runs:
        if key in results and "curve" not in results[key]:  # the held-out curve of each RL run, from its logs
            run_logs = os.path.join(logs, run_name)
            results[key] |= {"curve": curve(run_logs), "step_s": median([v for _, v in curve(run_logs, "time/step")])}
    if args.stages:  # the machine of this sweep (`--stages` with none redraws the report from the JSON alone)
        results["machine"] = machine(args.threads)
    save()
    report(results, args.results[: -len(".json")] + ".md")


def trl_grpo(args: Args, warm_start: str, folder: str) -> float:
    """TRL 1.16's GRPOTrainer with tools=[calculator] from the same warm start and at the same settings (4 problems x 4
    episodes per step, 96 tokens, lr 1e-5, beta 0, temperature 1, float32, the verifier's reward). TRL parses tool calls
    with a response template it knows by the chat template; ours (common.chat.TOOL_TEMPLATE) is not among them, so the
    tokenizer gets TRL's Qwen3 one, which reads the same <tool_call> JSON. Returns the median step time."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", ".trl-current"))  # benchmarks/setup.sh installs it there
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.chat_template_utils import qwen3_template

    from presets.agents import calculator

    args_ = grpo.Args(model_name=warm_start, train_size=2000, tools=["calculator"], max_prompt_length=400)
    args_.dataset_name, args_.task_config = "reasoning-gym:products", json.dumps(PRODUCTS)
    tokenizer = load_tokenizer(warm_start, padding_side="left")
    tokenizer.response_template = qwen3_template
    train, _, _ = load_task(args_, tokenizer, "prompt", 400, Toolset(args_, tokenizer).schemas)
    rows = [dict(prompt=r["prompt"], answer=r["answer"], rg_entry=r["rg_entry"]) for r in train]
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.time()

        def on_step_end(self, *a, **k):
            times.append(time.time() - self.start)
            print(f"trl step {len(times)}: {times[-1]:.1f}s", flush=True)

    config = trl.GRPOConfig(
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=96,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        **trl_settings(folder, args.rl_updates) | dict(output_dir=folder + "_tmp"),
    )
    trainer = trl.GRPOTrainer(
        model=load_pretrained(warm_start, AutoModelForCausalLM),
        reward_funcs=verifier,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[calculator],
        callbacks=[Timer()],
    )
    trainer.train()
    trainer.model.save_pretrained(folder)
    load_tokenizer(warm_start).save_pretrained(folder)
    return median(times)


RL_RUNS = [  # stage, script, results key, the Args field with its updates
    ("grpo", "grpo", "sft then grpo", "rl_updates"),
    ("rloo", "rloo", "sft then rloo", "rl_updates"),
    ("grpo-long", "grpo", "sft then grpo, longer", "long_updates"),
]


def rl_command(script: str, warm_start: str, updates: int) -> list[str]:
    """grpo.py's or rloo.py's command with the live calculator from the warm start: 4 problems x 4 episodes per update."""
    command = [f"{script}.py", "--model-name", warm_start, *TASK, "--tools", "calculator", *EPISODE]
    command += ["--batch-size", "4", "--num-generations", "4", "--mini-batch-size", "16"]
    return command + ["--gradient-accumulation-steps", "1", "--total-prompts", str(4 * updates), "--learning-rate", "1e-5"]


def curve(log_dir: str, tag: str = "eval/reward") -> list[tuple[int, float]]:
    """A run's logged scalar (the held-out reward at each evaluation)."""
    return [(step, round(value, 4)) for step, value in scalars(log_dir, tag)]


def machine(threads: int) -> str:
    """The machine (common.run.machine), the launcher and the thread count of the runs."""
    from common.run import machine as name

    return f"{name()}, `python`, {threads} threads"


if __name__ == "__main__":
    main(cli(Args))
