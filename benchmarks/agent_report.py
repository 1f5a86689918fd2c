"""The agent sweep's results, by key, and how they render: benchmarks/RESULTS-agents.md (every stage's table, the
number-guessing sections and the commands) and its PNG, from benchmarks/RESULTS-agents.json. benchmarks/agent_runs.py
runs the stages and calls `report`; reading the record needs neither torch nor a model.

    python benchmarks/agent_runs.py --stages       # no stage: the report again, from the JSON
"""

import os

GUESS_RUNS = [  # stage, results key, run folder, the Args field with its updates
    ("guess", "guess: sft then grpo", "guess_grpo", "guess_updates"),
    ("guess-long", "guess: sft then grpo, longer", "guess_grpo_long", "guess_long_updates"),
]


def binary_search_reward() -> float:
    """The guess_number reward of a binary search (guess the middle of what is left), averaged over 1..100."""
    total = 0.0
    for secret in range(1, 101):
        low, high, guesses = 1, 100, 1
        while (guess := (low + high) // 2) != secret:
            low, high, guesses = (guess + 1, high, guesses + 1) if secret > guess else (low, guess - 1, guesses + 1)
        total += 1 - (guesses - 1) / 7
    return total / 100


ROWS = [
    ("base without tools", "the base model, no tools"),
    ("base with the calculator", "the base model with the calculator"),
    ("sft warm start", "after SFT on tool traces (the warm start)"),
    ("sft then grpo", "SFT, then grpo.py with the live calculator"),
    ("sft then rloo", "SFT, then rloo.py with the live calculator"),
    ("sft then grpo, longer", "SFT, then grpo.py with the live calculator"),
    ("sft then trl grpo", "SFT, then TRL 1.16 GRPOTrainer(tools=[calculator])"),
]


GUESS_ROWS = [
    ("guess: base", "the base model"),
    ("guess: sft (12 steps)", "after 12 SFT steps on binary-search traces (an earlier run)"),
    ("guess: sft", "after SFT on binary-search traces (the warm start)"),
    ("guess: sft then grpo", "SFT, then grpo.py in the environment"),
    ("guess: sft then grpo, longer", "SFT, then grpo.py in the environment"),
]


SHAPED_WARM = "guess: sft, 4 episodes each"  # (4: --guess-episodes' default; each row records its own)
SHAPED_RUN = "guess: sft then grpo, shaped"
RANGE_SFT = "guess_range: sft on random search"
RANGE_RUN = "guess_range: sft then grpo"
MIXED_SFT = "guess_range: sft on halving and random search"
MIXED_RUN = "guess_range: sft on both, then grpo"
MIXED_MORE = "guess_range: sft on both, then grpo, on for more updates"
WIDE = ", a larger evaluation"  # the guess-mixed-more stage's second evaluation of the warm start and its model
SEARCH_STAGES = {  # stage: its SFT key, its RL key, the SFT traces, the runs' folder prefix
    "guess-range": (RANGE_SFT, RANGE_RUN, "builtin:guess-range-traces", "range"),
    "guess-mixed": (MIXED_SFT, MIXED_RUN, "builtin:guess-mixed-traces", "mixed"),
}
RANGE_GAME_ONLY = "guess_range: sft then grpo, game reward only (stopped after 8 updates)"  # an earlier command
RANGE_CURVES = [  # the guess-range run's logged curves: tag, what it is, its label in the plot
    ("eval/reward", "held-out game reward + guess_progress (grpo.py's own evaluation, 20 numbers)", "held-out sum"),
    ("rewards/GuessInRange/mean", "the training episodes' game reward (32 an update)", "training game reward"),
    ("rewards/presets.agents:guess_progress/mean", "the training episodes' guess_progress", "training guess_progress"),
    ("eval/tools/call_frequency", "held-out guesses per episode", None),
    ("entropy", "the policy's entropy per token on the training episodes", None),
    ("frac_reward_zero_std", "the share of groups with equal rewards (no gradient)", None),
]
SHAPED_CURVES = [  # the guess-shaped run's logged curves: tag, what it is, its label in the plot
    ("eval/reward", "held-out guess_progress (grpo.py's own evaluation, 20 numbers)", "held-out guess_progress"),
    ("rewards/GuessTheNumber/mean", "the training episodes' game reward (32 an update)", "training game reward"),
]


def solve_gap(before: dict, after: dict) -> str:
    """How far the held-out solve rate moved, against the standard error of the difference (the same episodes)."""
    n = 20 * after["episodes"]
    se = (before["solved"] * (1 - before["solved"]) / n + after["solved"] * (1 - after["solved"]) / n) ** 0.5
    gap = after["solved"] - before["solved"]
    return (
        f"The solve rate moved {gap:+.2f} ({before['solved']:.2f} -> {after['solved']:.2f}); the standard error of that "
        f"difference over {n} episodes each is {se:.2f}, so it is "
        + ("beyond two standard errors." if abs(gap) > 2 * se else "inside two standard errors.")
    )


def shaped_report(after: dict, before: dict, row, game: list[str]) -> list[str]:
    """The guess-shaped stage's section: the warm start and grpo.py with partial credit, on the same episodes per
    held-out number, and the run's own curves (the held-out guess_progress, the training episodes' game reward)."""
    n = 20 * after["episodes"]
    lines = [
        "",
        "### With partial credit for narrowing the search",
        "",
        "The game's reward separates an episode only by solved or not (and by its number of guesses), so a group of "
        "4 episodes that all fail, or all solve in the same number of guesses, gives no gradient. `--reward-funcs "
        "presets.agents:guess_progress --reward-weights 0.5` adds half of 1 - log2(numbers still possible) / log2(100) "
        "(1 once solved; an unsolved search that left 2 numbers scores 0.85, one that left 25 scores 0.30) beside the "
        "game's reward. grpo.py from the same warm start, 8 numbers x 4 episodes per update, two passes over each "
        f"(`--num-iterations 2`), learning rate 2e-5. Both rows on {after['episodes']} episodes per held-out number "
        f"({n} episodes), the game's own reward:",
        "",
        "| model | solved | mean reward | guesses per episode | failure rate | turns per episode | KL to the start | "
        "policy tokens | wall | s/update | machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        row("after SFT on binary-search traces (the warm start)", before, game),
        row("SFT, then grpo.py with partial credit", after, game),
        "",
        solve_gap(before, after)
        + f" (The {n} episodes are {after['episodes']} on each of 20 numbers, the same 20 before and after.)",
    ]
    for tag, what, _ in SHAPED_CURVES:
        points = ", ".join(f"{u}: {v:.2f}" for u, v in after.get("curves", {}).get(tag, []))
        lines += ["", f"{what}, by update: {points}"]
    return lines


def range_report(after: dict, before: dict, game_only: dict | None, row) -> list[str]:
    """The guess-range stage's section: SFT on random search, then grpo.py, on the same episodes per held-out number."""
    n = 20 * after["episodes"]
    game = ["solved", "accuracy", "calls_per_episode", "off_middle", "failure_rate", "turns", "kl", "reply_tokens"]
    lines = [
        "",
        "### Searching better than the demonstrations",
        "",
        "The guess_range environment is the same game with replies that also name the numbers still possible "
        '("higher: 51 to 100"), so each guess needs only the last reply. Its SFT traces (builtin:guess-range-traces) '
        "draw every guess uniformly from that range, 4 games for each of the 80 training numbers (sft.py, "
        f"{before['step']} steps of 8, {before.get('train_seconds', 0) / 60:.1f} min). The traces solve 46% of their "
        "games, where halving the range solves all of them; the warm start copies them loosely (it also guesses "
        "outside the range left). grpo.py "
        "then plays with the game's reward plus guess_progress (`--reward-funcs presets.agents:guess_progress "
        "--reward-weights 1.0`: 1 - log2(numbers left) / log2(100) at the end, a sum over the guesses of how much each "
        f"narrowed the range), {after['updates']} updates of 8 numbers x 4 episodes, two passes over each, learning "
        f"rate 2e-5. Both rows on {after['episodes']} episodes per held-out number ({n} episodes), the game's own "
        "reward. Off the middle (a mean, so that a few guesses far outside a small range weigh most): "
        "|guess - middle of the range left| / numbers left, averaged over the guesses: 0.25 for a uniform draw, 0 for "
        "halving.",
        "",
        *before_after(before, after, game, "random-search traces", row),
    ]
    lines += curve_lines(after)
    if game_only:  # the first try, with the game's reward alone: its logged curves
        curves = {tag: ", ".join(f"{u}: {v:.2f}" for u, v in points) for tag, points in game_only["curves"].items()}
        lines += [
            "",
            "Tried first, from the same warm start: the game's reward alone (`--reward-funcs` with no function, 12 "
            "updates planned, learning rate 3e-5; its command below), stopped after 8 updates for want of progress. "
            f"Held-out mean reward (20 numbers) by update: {curves['eval/reward']}; the training episodes' reward: "
            f"{curves['rewards/GuessInRange/mean']}; groups with equal rewards: {curves['frac_reward_zero_std']}; "
            f"entropy per token: {curves['entropy']}. Most training games went unsolved, so many groups gave no "
            "gradient; the policy grew surer (its entropy halved) without learning to halve the range.",
        ]
    return lines


COLUMNS = {  # a guessing table's column for each figure
    "solved": "solved",
    "accuracy": "mean reward",
    "guess_progress": "guess_progress",
    "calls_per_episode": "guesses per episode",
    "off_middle": "off the middle",
    "opens_middle": "opens with 50",
    "solved_opening_middle": "solved, opening with 50",
    "solved_otherwise": "solved, other openings",
    "at_middle": "at the middle",
    "failure_rate": "failure rate",
    "turns": "turns per episode",
    "kl": "KL to the start",
    "reply_tokens": "policy tokens",
}


def before_after(before: dict, after: dict, game: list[str], traces: str, row) -> list[str]:
    """A guess_range stage's table (the warm start, then grpo.py) and how far the solve rate moved."""
    columns = ["model", *(COLUMNS[k] for k in game), "wall", "s/update", "machine"]
    return [
        "| " + " | ".join(columns) + " |",
        "|---" * len(columns) + "|",
        row(f"after SFT on {traces} (the warm start)", before, [*game, "step_s"]),
        row("SFT, then grpo.py", after, [*game, "step_s"]),
        "",
        solve_gap(before, after),
    ]


def curve_lines(after: dict) -> list[str]:
    """A guess_range run's logged curves (RANGE_CURVES), one line each."""
    lines = []
    for tag, what, _ in RANGE_CURVES:
        points = ", ".join(f"{u}: {v:.2f}" for u, v in after.get("curves", {}).get(tag, []))
        lines += ["", f"{what}, by update: {points}"]
    return lines


def mixed_report(after: dict, before: dict, row) -> list[str]:
    """The guess-mixed stage's section: SFT on halving and random search, then grpo.py at the guess-range settings."""
    n = 20 * after["episodes"]
    game = ["solved", "accuracy", "guess_progress", "calls_per_episode", "opens_middle", "solved_opening_middle"]
    game += ["solved_otherwise", "at_middle", "failure_rate", "turns", "kl", "reply_tokens"]
    training = after["curves"]["rewards/presets.agents:guess_progress/mean"]
    peak, last = max(training, key=lambda point: point[1]), training[-1]
    lines = [
        "",
        "### Choosing the better of two demonstrated searches",
        "",
        "The same game, with SFT traces (builtin:guess-mixed-traces) from two players, 2 games each for every training "
        "number: one halves the range left (it opens with 50 and solves every game), the other draws each guess "
        "uniformly from it (as above). Behaviour cloning copies both: the warm start plays some games by halving and "
        f"others at random (sft.py, {before['step']} steps of 8, {before.get('train_seconds', 0) / 60:.1f} min). "
        "grpo.py then runs at the settings of the run above (the game's reward plus guess_progress, "
        f"{after['updates']} updates of 8 numbers x 4 episodes, two passes over each, learning rate 2e-5). Both rows on "
        f"{after['episodes']} episodes per held-out number ({n} episodes), the game's own reward. Opens with 50: the "
        "share of episodes whose first guess halves 1..100 (50 or 51); at the middle: the share of all guesses within "
        "half a number of the middle of the range left.",
        "",
        *before_after(before, after, game, "halving and random search", row),
        "",
        progress_gap(before, after),
        "",
        f"grpo.py moved the policy to the better of the two demonstrated players: {after['opens_middle']:.0%} of the "
        f"held-out episodes open with 50 ({before['opens_middle']:.0%} before), {after['at_middle']:.0%} of the guesses "
        f"halve the range left ({before['at_middle']:.0%}), and the held-out partial credit rose. The solve rate did not "
        "follow: on the held-out numbers the warm start's games that opened with 50 solved "
        f"{before['solved_opening_middle']:.2f}, hardly more than its others ({before['solved_otherwise']:.2f}), so "
        "choosing to halve could add little by itself; half of the guesses still miss the middle, and a search that "
        "narrows the range to a few numbers earns partial credit without the solve. The training episodes' "
        f"guess_progress (8 numbers an update) peaked at {peak[1]:.2f} in update {peak[0]} and ended at {last[1]:.2f}.",
    ]
    return lines + curve_lines(after)


def more_report(more: dict, after: dict, before: dict, wide: list[dict], row) -> list[str]:
    """The guess-mixed-more stage's section: grpo.py on from the guess-mixed run's model, against the warm start (and,
    where measured, the two again on more episodes: `wide`)."""
    game = ["solved", "accuracy", "guess_progress", "calls_per_episode", "opens_middle", "at_middle", "off_middle"]
    game += ["failure_rate", "turns", "kl", "reply_tokens"]
    columns = ["model", *(COLUMNS[k] for k in game), "wall", "s/update", "machine"]
    total, alone = after["updates"] + more["updates"], {k: v for k, v in more.items() if k != "updates"}
    return [
        "",
        f"### On for {more['updates']} more updates",
        "",
        f"grpo.py on from the model above for {more['updates']} more updates at the same settings (`--model-name` "
        "its output; a new optimizer, as the first run saved no checkpoint to resume from; 8 numbers an update, so "
        f"{8 * more['updates']} numbers: each training number once, in the order `--seed 1` draws). The rows on the "
        "same held-out episodes as above; the wall time of the last row is that of the further updates, and the "
        f"curves below count the further updates (update 0: the model after the first {after['updates']}).",
        "",
        "| " + " | ".join(columns) + " |",
        "|---" * len(columns) + "|",
        row("after SFT on halving and random search (the warm start)", before, [*game, "step_s"]),
        row("SFT, then grpo.py", after, [*game, "step_s"]),
        row(f"SFT, then grpo.py, {after['updates']} + {more['updates']} = {total} updates", alone, [*game, "step_s"]),
        "",
        solve_gap(before, more),
        "",
        progress_gap(before, more),
        *curve_lines(more),
        *wide_lines(*wide, before, more, total),
    ]


def wide_lines(before: dict | None, after: dict | None, first_before: dict, first_after: dict, updates: int) -> list[str]:
    """The larger evaluation of the guess-mixed-more stage: the warm start and the final model on more episodes."""
    if not (before and after):
        return []
    n, first = 20 * after["episodes"], 20 * first_after["episodes"]
    pooled = [(w["solved"] * n + f["solved"] * first) / (n + first) for w, f in ((before, first_before), (after, first_after))]
    se = sum(p * (1 - p) / (n + first) for p in pooled) ** 0.5
    return [
        "",
        f"The two evaluated again on {after['episodes']} episodes per held-out number ({n} each, the evaluation's seed "
        f"unchanged): the warm start solves {before['solved']:.2f} (guess_progress "
        f"{before['guess_progress']:.2f}) and the model after {updates} updates "
        f"{after['solved']:.2f} ({after['guess_progress']:.2f}). " + solve_gap(before, after) + " This evaluation ran "
        f"after the first fell short of two standard errors; over both ({n + first} episodes of each model) the solve "
        f"rate moved {pooled[1] - pooled[0]:+.2f} ({pooled[0]:.2f} -> {pooled[1]:.2f}), standard error {se:.2f}.",
    ]


def progress_gap(before: dict, after: dict) -> str:
    """How far the held-out guess_progress moved, against the largest standard error its means allow (a score in [0, 1]
    with mean m varies at most m (1 - m); the per-episode scores are not kept)."""
    n, b, a = 20 * after["episodes"], before["guess_progress"], after["guess_progress"]
    se = ((b * (1 - b) + a * (1 - a)) / n) ** 0.5
    return (
        f"The held-out guess_progress moved {a - b:+.2f} ({b:.2f} -> {a:.2f}); the standard error of that difference is "
        f"at most {se:.2f} (the largest variance a score in [0, 1] with these means can have), so it is "
        + ("beyond two standard errors." if abs(a - b) > 2 * se else "not shown beyond two standard errors.")
    )


def report(results: dict, path: str) -> None:
    """RESULTS-agents.md and its PNG from the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cell(r, key, fmt="{:.2f}"):
        return fmt.format(r[key]) if key in r else "-"

    keys = [k for k, _ in ROWS + GUESS_ROWS] + [SHAPED_WARM, SHAPED_RUN, RANGE_SFT, RANGE_RUN, MIXED_SFT, MIXED_RUN]
    keys += [MIXED_MORE, MIXED_SFT + WIDE, MIXED_MORE + WIDE]
    measured = [results[k] for k in keys if k in results] + results.get("sft curve", [])
    measured += results.get("guess: sft", {}).get("curve", [])
    machines = sorted({r["machine"] for r in measured if "machine" in r})

    def where(r):  # the machine a row ran on, named in full
        return r["machine"] if "machine" in r else "?"

    lines = [
        "# Agents on the real model",
        "",
        "builtin:smollm2-135m-instruct, 2 CPU cores, `python` (the threads: below); `python benchmarks/agent_runs.py`. "
        "Held-out: reasoning-gym `products` (3-digit x 3-digit) drawn with seed 2, none of them among the RL (seed 1) or "
        "SFT (seed 1000) problems; one episode per problem sampled at temperature 1.",
        "",
        "Machines (the sweep resumes, so rows may come from different ones; compare times only on one): "
        + "; ".join(machines),
        "",
        "| model | held-out accuracy (sampled) | tool calls per episode | failure rate | well-formed call | KL to the "
        "start | policy tokens | distinct answers | wall | s/update | machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def row(name: str, r: dict, keys: list[str]) -> str:  # the figures, then the wall time, s/update and machine
        name += f", {r['updates']} updates" if "updates" in r else f", {r['step']} steps" if "step" in r else ""
        wall = f"{r['seconds'] / 60:.1f} min" if "seconds" in r else "-"
        cells = [
            cell(r, k, "{:.1f}" if k in ("reply_tokens", "step_s") else "{}" if k == "distinct_answers" else "{:.2f}")
            for k in keys
        ]
        return "| " + " | ".join([name, *cells[:-1], wall, cells[-1], where(r)]) + " |"

    calculator = ["accuracy", "calls_per_episode", "failure_rate", "well_formed", "kl", "reply_tokens", "distinct_answers"]
    lines += [row(name, results[key], [*calculator, "step_s"]) for key, name in ROWS if key in results]
    trl = results.get("sft then trl grpo", {})
    if "ours_step_s" in trl:
        lines += [
            "",
            f"Step time at the same settings, one run after the other on {where(trl)}: TRL's GRPOTrainer "
            f"{trl['step_s']:.1f} s per step, grpo.py {trl['ours_step_s']:.1f} s per update (its rollout "
            f"{trl['ours_generate_s']:.1f} s of it), {trl['ours_step_s'] / trl['step_s']:.2f}x TRL's (medians over "
            "each run's steps; grpo.py's run: `grpo.py timed beside trl` below).",
        ]
    if "sft curve" in results:
        lines += ["", "SFT warm start (8 traces per step, learning rate 2e-5), each checkpoint evaluated:", ""]
        lines += [
            "| SFT steps | well-formed call | accuracy | tool calls per episode | failure rate | KL | machine |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in results["sft curve"]:
            lines.append(
                f"| {c['step']} | {c['well_formed']:.2f} | {c['accuracy']:.2f} | {c['calls_per_episode']:.2f} | "
                f"{c['failure_rate']:.2f} | {c['kl']:.2f} | {where(c)} |"
            )
    for key in ("sft then grpo", "sft then rloo", "sft then grpo, longer"):
        if key in results and results[key].get("curve"):
            points = ", ".join(f"update {u}: {a:.2f}" for u, a in results[key]["curve"])
            lines += ["", f"{key}, the script's own evaluation during the run (16 of the held-out problems): {points}"]
            short = results.get("sft then grpo", {}).get("curve", [])
            if key.endswith("longer") and short and results[key]["curve"][: len(short)] == short:
                lines[-1] += " (the same seed: its first evaluations are the shorter run's, whose curve it hides in the plot)"
    guess = [(k, n) for k, n in GUESS_ROWS if k in results]
    if guess:
        lines += [
            "",
            "## Number guessing",
            "",
            "The guess_number environment (a whole number from 1 to 100 within 7 guesses, told higher or lower; a solve "
            "scores 1 for the first guess and 1/7 less for each further one), on the 20 numbers that `--eval-fraction "
            "0.2 --seed 1` holds out (the SFT traces and the RL episodes never see them), one episode each at "
            "temperature 1:",
            "",
            "| model | solved | mean reward | guesses per episode | failure rate | turns per episode | KL to the start | "
            "policy tokens | wall | s/update | machine |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        game = ["solved", "accuracy", "calls_per_episode", "failure_rate", "turns", "kl", "reply_tokens", "step_s"]
        lines += [row(name, results[key], game) for key, name in guess]
        first = results.get("guess: grpo first update")
        if first:  # a run stopped after its first update, and why
            lines += [
                "",
                f"grpo.py from the 12-step warm start ({where(first)}): in its first update every one of the 16 "
                f"episodes scored {first['reward']:.0f} (no number found; {first['frac_reward_zero_std']:.0%} of the "
                f"groups with equal rewards, so no gradient; {first['calls_per_episode']:.2f} guesses per episode, "
                f"{first['step_s']:.0f} s). With no solved episode there is nothing to reinforce, and the run was "
                "stopped there: a warm start that solves some games comes first.",
            ]
        sft_curve = results.get("guess: sft", {}).get("curve")
        if sft_curve:
            sft = results["guess: sft"]
            lines += [
                "",
                f"SFT on the binary-search traces (8 games a step, learning rate 2e-5; {sft['train_steps']} steps took "
                f"{sft['train_seconds'] / 60:.1f} min on {where(sft_curve[-1])}), checkpoints evaluated; the "
                "warm start is the first that solves at least a fifth of the games:",
                "",
            ]
            lines += ["| SFT steps | solved | mean reward | guesses per episode | failure rate | turns | KL | machine |"]
            lines += ["|---|---|---|---|---|---|---|---|"]
            for c in sft_curve:
                lines.append(
                    f"| {c['step']} | {c['solved']:.2f} | {c['accuracy']:.2f} | {c['calls_per_episode']:.2f} | "
                    f"{c['failure_rate']:.2f} | {c['turns']:.2f} | {c['kl']:.2f} | {where(c)} |"
                )
        guess_runs = [key for _, key, _, _ in GUESS_RUNS if results.get(key, {}).get("curve")]
        for key in guess_runs:
            points = ", ".join(f"update {u}: {a:.2f}" for u, a in results[key]["curve"])
            lines += ["", f"{key}, grpo.py's own evaluation (mean reward on the held-out numbers): {points}"]
        if guess_runs:
            lines += [
                "",
                f"The ceiling of the mean reward: a binary search that always halves scores {binary_search_reward():.2f} "
                "on average over 1..100 (it needs 6 or 7 guesses for 69 of the numbers), so the mean reward moves "
                "little; the solve rate is the figure to watch. On 20 games one solve is 0.05, and the standard error of "
                "a solve rate near 0.5 is 0.11.",
            ]
            before = results["guess: sft"]
            for key in guess_runs:
                after = results[key]
                gap = after["solved"] - before["solved"]
                lines[-1] += (
                    f" After {after['updates']} updates grpo.py solves {after['solved']:.2f} of the games against the "
                    f"warm start's {before['solved']:.2f} ({round(gap * 20):+d} of 20), with the mean reward at "
                    f"{after['accuracy']:.2f} against {before['accuracy']:.2f}: "
                    + ("inside two standard errors." if abs(gap) < 0.22 else "beyond two standard errors.")
                )
    shaped, warm_many = results.get(SHAPED_RUN), results.get(SHAPED_WARM)
    if shaped and warm_many:
        lines += shaped_report(shaped, warm_many, row, game)
    if RANGE_RUN in results and "solved" in results.get(RANGE_SFT, {}):
        lines += range_report(results[RANGE_RUN], results[RANGE_SFT], results.get(RANGE_GAME_ONLY), row)
    if MIXED_RUN in results and "solved" in results.get(MIXED_SFT, {}):
        lines += mixed_report(results[MIXED_RUN], results[MIXED_SFT], row)
        if "solved" in results.get(MIXED_MORE, {}):
            wide = [results.get(MIXED_SFT + WIDE), results.get(MIXED_MORE + WIDE)]
            lines += more_report(results[MIXED_MORE], results[MIXED_RUN], results[MIXED_SFT], wide, row)
    lines += ["", f"![SFT warm start and RL with the live calculator]({os.path.basename(path)[: -len('.md')]}.png)", ""]
    lines += [
        "Each row is one run (seed 1). The commands (benchmarks/agent_runs.py runs them, then evaluates each model):",
        "",
    ]
    lines += [f"- {key}: `{command}`" for key, command in results.get("commands", {}).items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    guess_curves = [(key, results[key]["curve"]) for _, key, _, _ in GUESS_RUNS if results.get(key, {}).get("curve")]
    guess_curve = guess_curves[-1][1] if guess_curves else None
    shaped, ranged = results.get(SHAPED_RUN, {}).get("curves"), results.get(RANGE_RUN, {}).get("curves")
    mixed, more = results.get(MIXED_RUN, {}).get("curves"), results.get(MIXED_MORE, {}).get("curves")
    panels = 2 + bool(guess_curve) + bool(shaped) + bool(ranged) + bool(mixed)
    rows_, columns = (panels + 2) // 3, min(panels, 3)
    fig, grid = plt.subplots(rows_, columns, figsize=(5 * columns, 3.5 * rows_), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.axis("off")
    if "sft curve" in results:
        steps = [c["step"] for c in results["sft curve"]]
        axes[0].plot(steps, [c["well_formed"] for c in results["sft curve"]], marker="o", label="well-formed call")
        axes[0].plot(steps, [c["accuracy"] for c in results["sft curve"]], marker="o", label="accuracy")
        axes[0].set(xlabel="SFT steps", ylim=(0, 1), title="SFT warm start")
        axes[0].legend()
    for key in ("sft then grpo", "sft then rloo", "sft then grpo, longer"):
        if key in results and results[key].get("curve"):
            axes[1].plot(*zip(*results[key]["curve"]), marker="o", label=key)  # the longer run's first 10 = the 10
    axes[1].set(xlabel="update", ylabel="held-out accuracy (16 problems)", ylim=(0, 1), title="RL with the live calculator")
    axes[1].legend()
    if guess_curve:
        for i, (key, points) in enumerate(guess_curves):
            label = f"grpo.py, {results[key]['updates']} updates"
            axes[2].plot(*zip(*points), marker="o", color=f"C{i + 1}", label=label)
        for key, style, label in (("guess: base", ":", "base"), ("guess: sft", "--", "SFT warm start")):
            if key in results:
                axes[2].axhline(results[key]["accuracy"], color="grey", linestyle=style, label=label)
        axes[2].axhline(binary_search_reward(), color="C3", linestyle="-.", label="binary search (the ceiling)")
        axes[2].set(xlabel="update", ylabel="held-out mean reward (20 numbers)", ylim=(0, 1), title="Number guessing")
        axes[2].legend()
    if shaped:
        ax = axes[2 + bool(guess_curve)]
        for (tag, _, label), color in zip(SHAPED_CURVES, ("C1", "C2")):
            ax.plot(*zip(*shaped[tag]), marker="o", color=color, label=label)
        ax.set(xlabel="update", ylim=(0, 1), title="Number guessing, with partial credit")
        ax.legend()
    titles = ["Guessing in the range left, from random search"] * bool(ranged)
    titles += ["Range left, halving and random" + " (dashed: on)" * bool(more)] * bool(mixed)
    for curves, title, ax in zip([c for c in (ranged, mixed) if c], titles, axes[panels - len(titles) : panels]):
        for (tag, _, label), color in zip(RANGE_CURVES[:3], ("C1", "C2", "C0")):
            ax.plot(*zip(*curves[tag]), marker="o", color=color, label=label)
            if curves is mixed and more:  # the run on from its end, at its update count
                shift = results[MIXED_RUN]["updates"]
                ax.plot([u + shift for u, _ in more[tag]], [v for _, v in more[tag]], marker="o", color=color, ls="--")
        if curves is mixed:  # agent_runs.py's own evaluations: the solve rate on 4 episodes per held-out number
            points = [(0, results[MIXED_SFT]), (results[MIXED_RUN]["updates"], results[MIXED_RUN])]
            points += [(points[1][0] + results[MIXED_MORE]["updates"], results[MIXED_MORE])] * bool(more)
            label = f"held-out solved ({20 * results[MIXED_RUN]['episodes']} episodes)"
            ax.plot([u for u, _ in points], [r["solved"] for _, r in points], marker="s", color="C3", label=label)
        ax.set(xlabel="update", ylabel="mean reward" + " / share solved" * (curves is mixed), ylim=(0, 1), title=title)
        ax.legend(**(dict(fontsize=7, loc=(0.3, 0.55)) if curves is mixed else {}))
    fig.tight_layout()
    fig.savefig(path[: -len(".md")] + ".png", dpi=100)
