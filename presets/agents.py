"""The offline built-ins of agents.py: a calculator tool, a number-guessing environment, and their data: problems and
SFT warm-start traces (messages with tool calls and tool results, and a `tools` column of JSON schemas as JSON text,
TRL's conversational tool format), served as builtin: datasets by presets/data.py.

A tool is a plain function with type hints and a docstring whose Args: section describes each argument; an environment
is a class with reset(**row), public methods as its tools and get_reward() (agents.py says the contract).
"""

import ast
import json
import math
import operator
import random

from datasets import Dataset
from transformers.utils import get_json_schema

GUESS_PROMPT = (
    "I am thinking of a whole number from 1 to 100. Find it with the guess tool: after each guess I say higher, lower or "
    "correct. You have 7 guesses."
)
GUESS_RANGE_PROMPT = (
    "I am thinking of a whole number from 1 to 100. Find it with the guess tool: after each guess I say higher or lower "
    "and which numbers are still possible, or correct. You have 7 guesses."
)
PRODUCTS = {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3}  # reasoning-gym products: 3 x 3 digits


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the arithmetic expression, for example "123 * 456"
    """
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("give the expression as a string of at most 200 characters")

    def value(node):  # parsed by ast and walked: model output is never passed to eval or exec
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("the power is too large")
            result = _OPERATORS[type(node.op)](left, right)
            if abs(result) > 1e100 or (isinstance(result, float) and not math.isfinite(result)):
                raise ValueError("the result is too large")
            return result
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result)) if float(result).is_integer() and abs(result) < 2**53 else f"{result:.10g}"


class GuessTheNumber:
    """Guess a whole number from 1 to 100 within 7 guesses, told "higher" or "lower" after each: the row's `answer`
    is the secret. The reward, 0 unsolved, is 1 for the first guess and 1/7 less for each further one. `low` and `high`
    bound what the replies so far leave possible (guess_progress scores them)."""

    max_guesses = 7

    def reset(self, answer, **row) -> None:
        self.secret, self.guesses, self.solved, self.low, self.high = int(answer), 0, False, 1, 100

    def guess(self, number: int) -> str:
        """Guesses the secret number; the reply is "higher" (the secret is larger), "lower" or "correct".

        Args:
            number: a whole number from 1 to 100
        """
        if self.solved or self.guesses >= self.max_guesses:
            return "The game is over."
        self.guesses += 1
        number = int(number)
        if number == self.secret:
            self.solved, self.low, self.high = True, number, number
            return "correct"
        if self.secret > number:
            self.low = max(self.low, number + 1)
            return "higher"
        self.high = min(self.high, number - 1)
        return "lower"

    def get_reward(self) -> float:
        return (self.max_guesses + 1 - self.guesses) / self.max_guesses if self.solved else 0.0


class GuessInRange(GuessTheNumber):
    """GuessTheNumber whose replies also say which numbers are still possible ("higher: 51 to 100"): each turn's state
    is in its last message, so a policy acts on the range left instead of recalling it from the whole history."""

    def guess(self, number: int) -> str:
        """Guesses the secret number; the reply is "higher" or "lower" with the numbers still possible (for example
        "higher: 51 to 100"), or "correct".

        Args:
            number: a whole number from 1 to 100
        """
        reply = super().guess(number)
        return f"{reply}: {self.low} to {self.high}" if reply in ("higher", "lower") else reply


def guess_progress(completions, environments=None, **columns) -> list[float | None]:
    """A reward for guess_number episodes (--reward-funcs presets.agents:guess_progress): how far the guesses narrowed
    the numbers still possible, 1 - log2(numbers left) / log2(100), so 1 once solved and partial credit for an unsolved
    search (with 2 left: 0.85). The game's own reward says only solved or not; this one separates the failures too."""
    if environments is None:  # not an episode of the game
        return [None] * len(completions)
    return [1 - math.log2(game.high - game.low + 1) / math.log2(100) for game in environments]


def guess_number_rows(prompt: str = GUESS_PROMPT) -> list[dict]:
    """The game for every number from 1 to 100: the prompt, and the number as the answer (reset's argument)."""
    return [{"prompt": prompt, "answer": str(n)} for n in range(1, 101)]


def training_secrets() -> list[int]:
    """The 80 numbers that grpo.py trains on with --eval-fraction 0.2 --seed 1 (held out as
    common.loading.train_eval_split does); the traces below play only these."""
    rows = Dataset.from_list(guess_number_rows())
    return sorted(int(a) for a in rows.train_test_split(test_size=int(len(rows) * 0.2), seed=1)["train"]["answer"])


def calculator_traces(size: int = 1000, instruction: str = "Give only the final answer.") -> list[dict]:
    """Each question (as grpo.py renders a reasoning-gym one: the question and --task-instruction) answered by one
    calculator call on its product and then the result."""
    import reasoning_gym

    tools = json.dumps([get_json_schema(calculator)])
    rows = []
    for entry in reasoning_gym.create_dataset("products", size=size, seed=1000, **PRODUCTS):
        expression = entry["question"].split(": ", 1)[1].split(".")[0].strip()  # "Solve ...: 361 * 220. Give ..."
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        messages = [
            {"role": "user", "content": f"{entry['question']} {instruction}"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": calculator(expression)},
            {"role": "assistant", "content": str(entry["answer"])},
        ]
        rows.append({"messages": messages, "tools": tools})
    return rows


def guess_traces(game: GuessTheNumber, prompt: str, pick, plays: int) -> list[dict]:
    """`plays` games for each training number, each guess pick(low, high) of the numbers the replies leave possible,
    until correct or out of guesses; the last message says the number (or that the guesses ran out)."""
    tools = json.dumps([get_json_schema(game.guess)])
    rows = []
    for secret in training_secrets():
        for _ in range(plays):
            game.reset(answer=secret)
            messages, reply = [{"role": "user", "content": prompt}], ""
            while reply != "correct" and game.guesses < game.max_guesses:
                guess = pick(game.low, game.high)
                reply = game.guess(guess)
                call = {"type": "function", "function": {"name": "guess", "arguments": {"number": guess}}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                messages.append({"role": "tool", "name": "guess", "content": reply})
            end = f"The number is {secret}." if game.solved else "I ran out of guesses."
            rows.append({"messages": [*messages, {"role": "assistant", "content": end}], "tools": tools})
    return rows


def middle(low: int, high: int) -> int:
    """Binary search's guess: the middle of the numbers still possible (the lower one of two)."""
    return (low + high) // 2


def guess_number_traces() -> list[dict]:
    """Binary search for each number that grpo.py trains on: guess the middle of what is left, then say the number."""
    return guess_traces(GuessTheNumber(), GUESS_PROMPT, middle, plays=1)


def guess_range_traces(plays: int = 4, seed: int = 0) -> list[dict]:
    """Random search in GuessInRange for each number that grpo.py trains on: each guess drawn uniformly from the
    numbers still possible, `plays` games a number. Such play solves about half of the games within 7 guesses
    (halving solves all): demonstrations that RL has to improve on, not copy."""
    draw = random.Random(seed)
    return guess_traces(GuessInRange(), GUESS_RANGE_PROMPT, draw.randint, plays)


def guess_mixed_traces(plays: int = 2, seed: int = 0) -> list[dict]:
    """Two players in GuessInRange for each number that grpo.py trains on, `plays` games each: halving the range left
    (its first guess is always 50; it solves every game) and random search (guess_range_traces). Behaviour cloning
    copies both; RL can learn to play the better one."""
    return guess_traces(GuessInRange(), GUESS_RANGE_PROMPT, middle, plays) + guess_range_traces(plays, seed)
