"""The built-in datasets: real English text from the `chatterbot-corpus` package (~2,000 short conversations), ranked
offline by VADER sentiment where a dataset needs preferences or rewards.

builtin:chatterbot-prompts        prompt: the 749 distinct utterances that open a conversation (single-turn prompts)
builtin:chatterbot-dialogue       prompt, completion, text: every (utterance, reply) pair of consecutive turns
builtin:vader-preferences         prompt, chosen, rejected: a real reply and a random other one, ranked by VADER
builtin:chatterbot-mixed-replies  prompt, completion: each utterance with its reply and with a random one (offline RL)

Conversational variants (TRL's chat format, lists of {"role", "content"} messages):
builtin:chatterbot-chat           messages: every conversation, its turns alternately the user's and the assistant's
builtin:vader-preferences-chat    prompt (a user message), chosen, rejected (assistant messages): vader-preferences

Agents (agents.py's built-in tool and environment), with SFT warm-start traces (messages with tool calls, and the
tools' JSON schemas as a JSON string, TRL's `tools` column):
builtin:calculator-traces         messages, tools: reasoning-gym `products` (3-digit x 3-digit, drawn with seed 1000, apart
                                  from grpo.py's problems), each solved by one calculator call and the answer
builtin:guess-number              prompt, answer: find a number from 1 to 100 (the answer) with the guess tool
builtin:guess-number-traces       messages, tools: binary search for the 80 numbers that `--eval-fraction 0.2 --seed 1`
                                  trains on (grpo.py / rloo.py hold the other 20 out)
builtin:guess-range               prompt, answer: the same games for the guess_range environment (replies name the range left)
builtin:guess-range-traces        messages, tools: random search in guess_range, 4 games for each of the same 80 numbers
builtin:guess-mixed-traces        messages, tools: halving and random search in guess_range, 2 games each per number
"""

import functools
import glob
import os
import random

from datasets import Dataset

DATASETS = (
    "builtin:chatterbot-prompts",
    "builtin:chatterbot-dialogue",
    "builtin:vader-preferences",
    "builtin:chatterbot-mixed-replies",
    "builtin:chatterbot-chat",
    "builtin:vader-preferences-chat",
    "builtin:calculator-traces",
    "builtin:guess-number",
    "builtin:guess-number-traces",
    "builtin:guess-range",
    "builtin:guess-range-traces",
    "builtin:guess-mixed-traces",
)


@functools.cache
def chatterbot_conversations() -> tuple[tuple[str, ...], ...]:
    """The turns of every English chatterbot-corpus conversation (read once per process, by libyaml where PyYAML has
    it: the same turns, ten times faster than its pure-Python parser)."""
    import chatterbot_corpus
    import yaml

    conversations, loader = [], getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    folder = os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data", "english")
    for path in sorted(glob.glob(os.path.join(folder, "*.yml"))):
        with open(path) as f:
            conversations += [tuple(str(t).strip() for t in turns) for turns in yaml.load(f, loader)["conversations"]]
    return tuple(conversations)


def chatterbot_pairs(openers_only: bool = False) -> list[tuple[str, str]]:
    """(utterance, reply) pairs of consecutive turns of every conversation; `openers_only`: each conversation's first
    pair only (a mid-conversation line out of its context reads as a closing answer)."""
    pairs = []
    for turns in chatterbot_conversations():
        pairs += [(a, b) for a, b in zip(turns[:-1], turns[1:] if not openers_only else turns[1:2]) if a and b]
    return pairs


def vader_preferences(seed: int = 0, min_gap: float = 0.1) -> list[dict]:
    """For each utterance, its real reply and a random other reply, ranked by VADER compound sentiment; pairs whose
    sentiment gap is below `min_gap` are dropped, so every label carries signal (ranked once per process)."""
    return [dict(row) for row in ranked_pairs(seed, min_gap)]


@functools.cache
def ranked_pairs(seed: int, min_gap: float) -> tuple[dict, ...]:
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer, rng, pairs = SentimentIntensityAnalyzer(), random.Random(seed), chatterbot_pairs()
    rows = []
    for prompt, reply in pairs:
        other = rng.choice(pairs)[1]
        a, b = (analyzer.polarity_scores(r)["compound"] for r in (reply, other))
        if abs(a - b) >= min_gap:
            rows.append(dict(prompt=prompt, chosen=reply if a > b else other, rejected=other if a > b else reply))
    return tuple(rows)


def dataset(name: str, seed: int = 0) -> Dataset:
    """One of DATASETS; `seed` draws the random replies."""
    if name == "builtin:chatterbot-prompts":
        return Dataset.from_dict({"prompt": sorted({p for p, _ in chatterbot_pairs(openers_only=True)})})
    if name == "builtin:chatterbot-dialogue":
        pairs = chatterbot_pairs()
        return Dataset.from_dict(
            {
                "prompt": [p for p, _ in pairs],
                "completion": [" " + c for _, c in pairs],
                "text": [f"{p} {c}" for p, c in pairs],
            }
        )
    if name == "builtin:vader-preferences":
        return Dataset.from_list(vader_preferences(seed))
    if name == "builtin:chatterbot-mixed-replies":  # offline RL data: every utterance with its reply and a random one
        rng, pairs = random.Random(seed), chatterbot_pairs()
        rows = [(p, r) for p, reply in pairs for r in (reply, rng.choice(pairs)[1])]
        return Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [" " + r for _, r in rows]})
    if name == "builtin:chatterbot-chat":
        roles = ("user", "assistant")
        chats = [[{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)] for turns in chatterbot_conversations()]
        return Dataset.from_dict({"messages": [c for c in chats if len(c) > 1 and all(m["content"] for m in c)]})
    if name == "builtin:vader-preferences-chat":
        rows = vader_preferences(seed)
        return Dataset.from_list(
            [
                dict(
                    prompt=[{"role": "user", "content": r["prompt"]}],
                    chosen=[{"role": "assistant", "content": r["chosen"]}],
                    rejected=[{"role": "assistant", "content": r["rejected"]}],
                )
                for r in rows
            ]
        )
    if name.startswith(("builtin:calculator", "builtin:guess")):
        from presets import agents

        rows = {
            "builtin:calculator-traces": agents.calculator_traces,
            "builtin:guess-number": agents.guess_number_rows,
            "builtin:guess-number-traces": agents.guess_number_traces,
            "builtin:guess-range": lambda: agents.guess_number_rows(agents.GUESS_RANGE_PROMPT),
            "builtin:guess-range-traces": agents.guess_range_traces,
            "builtin:guess-mixed-traces": agents.guess_mixed_traces,
        }[name]()
        return Dataset.from_list(rows)
    raise KeyError(f"Unknown built-in dataset {name!r}: choose {', '.join(DATASETS)}.")
