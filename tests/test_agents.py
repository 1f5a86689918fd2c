"""Multi-turn episodes with tools and environments (agents.py, grpo.py / rloo.py --tools / --environment): parsing,
the safe calculator, failing tools, the episode loop's limits and masks, and whole runs on a tiny random Llama whose
turns are scripted (a random model never writes a tool call; the log-probs and the training are the model's own)."""

import importlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from conftest import ARITH, ROOT, read_scalars, run_failing, run_script

from common.chat import TOOL_TEMPLATE, HermesFormat, supports_tools, use_tool_template
from common.core import UsageError
from common.loading import load_tokenizer
from common.rollout import Engine, run_episodes
from common.tools import run_calls, tool_suffix_ids
from presets.agents import GuessInRange, GuessTheNumber, calculator, guess_progress

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(chat_llama):
    tokenizer = load_tokenizer(chat_llama, padding_side="left")
    assert not supports_tools(tokenizer)  # SmolLM2's template: no tools
    use_tool_template(tokenizer, None)
    assert tokenizer.chat_template == TOOL_TEMPLATE and supports_tools(tokenizer)
    return tokenizer


def test_tool_calls_are_parsed_one_or_several_and_malformed_ones_are_failures():
    assert HermesFormat().parse("The answer is 6.") == ("The answer is 6.", [])
    content, calls = HermesFormat().parse(f"Let me compute. {CALL}\n{CALL.replace('2 * 3', '4 + 5')}")
    assert content == "Let me compute."
    assert calls == [
        {"name": "calculator", "arguments": {"expression": "2 * 3"}},
        {"name": "calculator", "arguments": {"expression": "4 + 5"}},
    ]
    # arguments written as a JSON string are accepted
    quoted = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert HermesFormat().parse(quoted)[1] == [{"name": "f", "arguments": {"x": 1}}]
    for bad, why in [
        ("<tool_call>{name: f}</tool_call>", "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '{"name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '{"name"'),
        ('<tool_call>{"name": "f", "arguments": {}}', "closing"),
    ]:
        (call,) = HermesFormat().parse(bad)[1]
        assert why in call["error"], (bad, call)


def test_the_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert [calculator(e) for e in ["361 * 220", "7 / 2", "-(3 + 4) ** 2", "17 // 5", "17 % 5", "1.5 * 4"]] == [
        "79420",
        "3.5",
        "-49",
        "3",
        "2",
        "6",
    ]
    for bad in ["__import__('os').system('true')", "open('x')", "x + 1", "(1).real", "[1, 2]", "2 ** 10000", "1e308 * 10"]:
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)
    with pytest.raises(ZeroDivisionError):
        calculator("1 / 0")


def test_failing_tools_become_error_messages_and_never_stop_or_hang_the_run():
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def raises(x: int) -> str:
        raise RuntimeError("boom")

    def number(x: int) -> int:
        return x

    tools = {"calculator": calculator, "slow": slow, "raises": raises, "number": number}
    calls = [
        [{"name": "calculator", "arguments": {"expression": "6 * 7"}}],
        [{"name": "slow", "arguments": {"seconds": 30}}, {"name": "calculator", "arguments": {"expression": "1 + 1"}}],
        [{"name": "raises", "arguments": {"x": 1}}],
        [{"name": "number", "arguments": {"x": 1}}],
        [{"name": "nothing", "arguments": {}}],
        [{"name": "calculator", "arguments": {"wrong": "1"}}],
        [{"error": "the tool call is not JSON"}],
        [],
    ]
    start = time.monotonic()
    results = run_calls(calls, [tools] * len(calls), timeout=0.3)
    assert time.monotonic() - start < 10  # the 30-second tool was abandoned at its timeout
    assert results[0] == [("calculator", "42", False)]
    assert [failed for *_, failed in results[1]] == [True, True] and "--tool-timeout" in results[1][0][1]
    assert "RuntimeError: boom" in results[2][0][1] and results[2][0][2]
    assert "returned int, not a string" in results[3][0][1]
    assert "unknown tool 'nothing'" in results[4][0][1]
    assert "TypeError" in results[5][0][1] and results[5][0][2]
    assert json.loads(results[6][0][1]) == {"error": "the tool call is not JSON"}
    assert results[7] == []


def test_a_tool_that_exits_or_interrupts_is_a_failed_call_with_its_reason(tmp_path):
    """SystemExit, sys.exit and KeyboardInterrupt inside a tool end neither the run nor the episode: each is a failed
    call saying what happened (never a timeout), and the episode's other calls still run. os._exit ends the round's
    process: its call, and any call of the round still running, fail saying so."""

    def exits(code: int) -> str:
        sys.exit(code)

    def interrupts(x: int) -> str:
        raise KeyboardInterrupt

    def hard_exit(code: int) -> str:
        os._exit(code)

    tools = {"exits": exits, "interrupts": interrupts, "hard_exit": hard_exit, "calculator": calculator}
    calls = [
        [{"name": "exits", "arguments": {"code": 3}}, {"name": "calculator", "arguments": {"expression": "1 + 1"}}],
        [{"name": "interrupts", "arguments": {"x": 1}}],
    ]
    results = run_calls(calls, [tools] * len(calls), timeout=30)
    assert results[0] == [("exits", '{"error": "SystemExit: 3"}', True), ("calculator", "2", False)]
    assert results[1] == [("interrupts", '{"error": "KeyboardInterrupt"}', True)]
    calls = [[{"name": "hard_exit", "arguments": {"code": 5}}, {"name": "calculator", "arguments": {"expression": "1"}}]]
    assert run_calls(calls, [tools], timeout=30) == [
        [
            ("hard_exit", '{"error": "the tool ended its process (exit status 5)"}', True),
            ("calculator", '{"error": "not run: an earlier call of this turn failed to return"}', True),
        ]
    ]


def breaks_pipe(then: str) -> str:
    """Write the start of a message into the worker's pipe to the run, then hang or exit (a tool gone wrong).

    Args:
        then: "hang" or "exit"
    """
    import gc
    import multiprocessing.connection

    (pipe,) = [c for c in gc.get_objects() if isinstance(c, multiprocessing.connection.Connection) and c.writable]
    os.write(pipe.fileno(), b"\x00\x00\x03\xe8abc")  # a header announcing 1,000 bytes, and 3 of them
    if then == "exit":
        os._exit(0)
    time.sleep(60)
    return "never"


def test_a_worker_that_breaks_its_pipe_fails_its_call_within_the_timeout():
    """A tool that leaves half a message in the pipe and hangs, or exits: the run reads no result, stops the worker within
    --tool-timeout, and the call fails saying so; the run goes on."""
    for then in ("hang", "exit"):
        start = time.monotonic()
        calls = [
            [{"name": "breaks_pipe", "arguments": {"then": then}}],
            [{"name": "calculator", "arguments": {"expression": "2"}}],
        ]
        results = run_calls(calls, [{"breaks_pipe": breaks_pipe, "calculator": calculator}] * 2, timeout=2)
        assert time.monotonic() - start < 4, then
        ((name, text, failed),) = results[0]
        assert name == "breaks_pipe" and failed and "the tool broke its pipe" in text, results


DRIVER = """
import os, subprocess, sys, time
from common.cli import _report, handle_signals
from common.tools import run_calls

sys.excepthook, here = _report, sys.argv[1]
handle_signals()  # as every script's cli() does


def slow_tool(seconds: int) -> str:
    \"\"\"Start a process of its own, sleep, then act.

    Args:
        seconds: how long
    \"\"\"
    child = subprocess.Popen(["sleep", "60"])
    open(os.path.join(here, "started"), "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(seconds)
    open(os.path.join(here, "side-effect"), "w").write("the tool acted after its run ended")
    return "done"


run_calls([[{"name": "slow_tool", "arguments": {"seconds": 3}}]], [{"slow_tool": slow_tool}], timeout=60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_tool_never_outlives_its_run(tmp_path, signum):
    """A tool asleep in its call, with a process of its own, when its run gets SIGTERM (the run stops the tool's process
    group) or SIGKILL (the kernel tells the tool's worker, which stops its group): both are gone at once, and what the
    tool would have done after the run ended never happens."""
    (tmp_path / "driver.py").write_text(DRIVER)
    environment = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.Popen([sys.executable, "driver.py", str(tmp_path)], cwd=tmp_path, env=environment, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() or len((tmp_path / "started").read_text().split()) < 2:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    worker, child = map(int, (tmp_path / "started").read_text().split())
    run.send_signal(signum)
    _, stderr = run.communicate(timeout=30)
    assert run.returncode == (143 if signum == signal.SIGTERM else -signal.SIGKILL), stderr
    if signum == signal.SIGTERM:
        assert stderr.decode().strip() == "interrupted: nothing was saved.", stderr
    for pid in (worker, child):
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]:
            assert time.monotonic() < deadline, f"process {pid} outlived its run"
            time.sleep(0.05)
    time.sleep(4)  # past the moment the tool would have acted
    assert not (tmp_path / "side-effect").exists()


class Counter:  # an environment whose second tool is slow (module-level: environments pickle by name)
    def reset(self, marker: str = "", **row):
        self.count, self.marker = 0, marker

    def add(self, n: int) -> str:
        """Add to the count.

        Args:
            n: how much
        """
        self.count += n
        return str(self.count)

    def slow_add(self, n: int) -> str:
        """Add, slowly.

        Args:
            n: how much
        """
        time.sleep(3.0)
        self.count += n
        open(self.marker, "w").write("ran after its timeout")
        return str(self.count)


def test_a_timed_out_tool_is_stopped_and_nothing_it_does_later_reaches_the_episode(tmp_path):
    """A call past --tool-timeout is stopped: what it would have done after the timeout (here: write a file, change the
    environment) never happens, the episode's later calls do not run, and the environment keeps the state its earlier
    calls left."""
    marker = tmp_path / "after-timeout"

    environment = Counter()
    environment.reset(marker=str(marker))
    tools = {"add": environment.add, "slow_add": environment.slow_add}
    calls = [
        [
            {"name": "add", "arguments": {"n": 2}},
            {"name": "slow_add", "arguments": {"n": 5}},
            {"name": "add", "arguments": {"n": 1}},
        ]
    ]
    start = time.monotonic()
    results = run_calls(calls, [tools], timeout=0.3)
    assert time.monotonic() - start < 2.5  # stopped at its timeout, not run to its end (3 s): room for a loaded machine
    assert results[0][0] == ("add", "2", False) and "--tool-timeout 0.3 s" in results[0][1][1]
    assert results[0][2] == ("add", '{"error": "not run: an earlier call of this turn failed to return"}', True)
    time.sleep(3.0)
    assert not marker.exists() and environment.count == 2  # the first call's effect came back, the second's never


@pytest.mark.skipif(sys.platform != "linux", reason="the worker's start is slowed in a Linux-only step")
def test_a_tool_worker_slow_to_start_does_not_eat_the_calls_timeout(monkeypatch):
    """The timeout counts the tool's own time: a round's process that takes a second to start (a large run forked on a
    loaded machine) does not fail its first call."""
    import common.tools

    monkeypatch.setattr(common.tools, "die_with_parent", lambda signum: time.sleep(1.0))  # runs in the forked worker
    environment = Counter()
    environment.reset()
    results = run_calls([[{"name": "add", "arguments": {"n": 2}}]], [{"add": environment.add}], timeout=0.3)
    assert results == [[("add", "2", False)]] and environment.count == 2


def scripted(tokenizer, answers):
    """A policy whose turns are fixed: a calculator call first, then after each tool result the next of `answers`
    (a call again where the answer is CALL); returns generate(contexts, max_new_tokens) and each episode's turns."""
    eos = tokenizer.eos_token_id

    def generate(contexts, max_new_tokens):
        turns = []
        for context in contexts:
            results = tokenizer.decode(context).count("<tool_response>")
            text = CALL if results == 0 else answers[min(results - 1, len(answers) - 1)]
            turns.append((tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])[:max_new_tokens])
        return turns

    return generate


def test_an_episode_masks_exactly_the_tool_tokens_and_stops_at_each_limit(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2 * 3?"}], add_generation_prompt=True, return_dict=False
    )
    eos = tokenizer.eos_token_id
    call_ids = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]
    answer_ids = tokenizer("6", add_special_tokens=False)["input_ids"] + [eos]
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": "6"}])
    tools = [{"calculator": calculator}]

    # a call, its result, the answer: two turns; the mask is 1 on both turns and 0 on the tool's tokens only
    out = run_episodes(scripted(tokenizer, ["6"]), tokenizer, [prompt], tools, 200, None, 5.0)
    assert out.completion_ids[0] == call_ids + suffix + answer_ids
    assert out.model_mask[0] == [1] * len(call_ids) + [0] * len(suffix) + [1] * len(answer_ids)
    assert (out.turns, out.tool_calls, out.failures, out.ended) == ([2], [1], [0], [True])
    assert [m["role"] for m in out.messages[0]] == ["assistant", "tool", "assistant"]
    assert out.messages[0][1]["content"] == "6" and out.messages[0][2]["content"] == "6"
    assert out.messages[0][0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2 * 3"}}
    # the rendered conversation is what the model sees: the completion continues the prompt token for token
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2 * 3?"}, *out.messages[0]], tokenize=True, return_dict=False
    )
    assert rendered[: len(prompt) + len(out.completion_ids[0])] == prompt + out.completion_ids[0]

    # --max-tool-calling-iterations: a policy that always calls stops after that many rounds of calls
    out = run_episodes(scripted(tokenizer, [CALL]), tokenizer, [prompt], tools, 500, 2, 5.0)
    assert (out.turns, out.tool_calls) == ([3], [2])
    # --max-completion-length bounds the model's and the tools' tokens together; no room for a result: it stops
    for limit in (len(call_ids) + len(suffix), len(call_ids) + len(suffix) + 2, 5):
        out = run_episodes(scripted(tokenizer, ["6"]), tokenizer, [prompt], tools, limit, None, 5.0)
        assert len(out.completion_ids[0]) <= limit and len(out.completion_ids[0]) == len(out.model_mask[0])
    assert out.ended == [False] and out.tool_calls == [0]  # cut mid-call: never run
    # a turn without a call ends the episode at once
    out = run_episodes(lambda c, n: [answer_ids] * len(c), tokenizer, [prompt, prompt], tools * 2, 200, None, 5.0)
    assert out.turns == [1, 1] and out.model_mask == [[1] * len(answer_ids)] * 2


def test_the_guessing_game_rewards_fewer_guesses():
    from common.loading import load_function
    from common.tools import ENVIRONMENTS, TOOLS

    assert load_function("guess_number", ENVIRONMENTS, "--environment") is GuessTheNumber  # built-ins by name
    assert load_function("calculator", TOOLS, "--tools") is calculator
    game = GuessTheNumber()
    game.reset(answer="37", prompt="...")
    assert [game.guess(50), game.guess(25), game.guess(37)] == ["lower", "higher", "correct"]
    assert game.get_reward() == pytest.approx(5 / 7)
    game.reset(answer=37)
    assert game.guess(37) == "correct" and game.get_reward() == 1.0
    game.reset(answer=37)
    assert [game.guess(1) for _ in range(8)][-1] == "The game is over." and game.get_reward() == 0.0
    assert load_function("guess_range", ENVIRONMENTS, "--environment") is GuessInRange
    game = GuessInRange()  # the same game; its replies name the numbers still possible
    game.reset(answer="37")
    assert [game.guess(50), game.guess(25), game.guess(40)] == ["lower: 1 to 49", "higher: 26 to 49", "lower: 26 to 39"]
    assert game.guess(37) == "correct" and game.get_reward() == pytest.approx(4 / 7)


def test_guess_progress_scores_what_the_replies_leave_possible():
    games = [GuessTheNumber() for _ in range(4)]
    for game in games:
        game.reset(answer="30")
    games[0].guess(50), games[0].guess(25)  # lower, higher: 26..49 left
    games[1].guess(30)  # solved
    games[2].guess(29), games[2].guess(200), games[2].guess(29)  # 30..100, then 30..199 changes nothing, then again
    scores = guess_progress([[]] * 4, environments=games)
    assert scores == pytest.approx([1 - math.log2(24) / math.log2(100), 1.0, 1 - math.log2(71) / math.log2(100), 0.0])
    assert guess_progress([" 0", " 1"]) == [None, None]  # text completions, no game: no score


@pytest.mark.parametrize("dataset_name", ["builtin:guess-number", "builtin:guess-range"])
def test_the_guessing_games_held_out_numbers_are_never_trained_on(tokenizer, dataset_name):
    """Every row of a guessing dataset shares one prompt; a problem is its prompt and its answer (the secret), so
    `--eval-fraction 0.2` holds out 20 numbers and trains on the other 80, the ones the SFT traces play."""
    from types import SimpleNamespace

    from common.rewards import load_task
    from presets.agents import guess_number_traces, training_secrets

    args = SimpleNamespace(dataset_name=dataset_name, dataset_split="train", answer_column="answer", seed=1)
    args.__dict__.update(eval_fraction=0.2, eval_size=64, chat_template=True, system_prompt=None)
    train, held_out, chat = load_task(args, tokenizer, "prompt", 400)
    assert chat and len(train) == 80 and len(held_out) == 20 and len({json.dumps(r["prompt"]) for r in train}) == 1
    secrets = {r["answer"] for r in train}
    assert len(secrets) == 80 and not secrets & {r["answer"] for r in held_out}
    solved = {t["messages"][-1]["content"].removeprefix("The number is ").rstrip(".") for t in guess_number_traces()}
    assert solved == secrets == {str(n) for n in training_secrets()}


def test_random_search_traces_draw_each_guess_from_the_range_left():
    """builtin:guess-range-traces: 4 games for each training number, each guess inside the range the replies left
    (read back from the replies), at most 7 guesses; such play solves about half of the games (halving solves all)."""
    from presets.agents import guess_range_traces, training_secrets

    traces, solved, offsets = guess_range_traces(), 0, []
    assert len(traces) == 4 * len(training_secrets())
    for trace in traces:
        low, high, secret = 1, 100, None
        guesses = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in trace["messages"] if "tool_calls" in m]
        replies = [m["content"] for m in trace["messages"] if m["role"] == "tool"]
        assert len(guesses) == len(replies) <= 7
        for guess, reply in zip(guesses, replies):
            assert low <= guess <= high
            offsets.append(abs(guess - (low + high) / 2) / (high - low + 1))
            if reply == "correct":
                secret = guess
                break
            left = tuple(int(n) for n in reply.split(": ")[1].split(" to "))
            assert left == ((guess + 1, high) if reply.startswith("higher") else (low, guess - 1))
            low, high = left
        solved += secret is not None
        assert trace["messages"][-1]["content"] == (f"The number is {secret}." if secret else "I ran out of guesses.")
    assert 0.35 < solved / len(traces) < 0.6 and 0.22 < sum(offsets) / len(offsets) < 0.28


def test_mixed_traces_halve_in_half_of_the_games_and_search_at_random_in_the_rest():
    """builtin:guess-mixed-traces: for each training number 2 games that guess the middle of the range left (each
    opens with 50 and solves within 7 guesses) and 2 games of random search (guess_range_traces' player)."""
    from presets.agents import guess_mixed_traces, guess_range_traces, training_secrets

    traces, secrets = guess_mixed_traces(), training_secrets()
    halving, random_search = traces[: 2 * len(secrets)], traces[2 * len(secrets) :]
    assert random_search == guess_range_traces(plays=2)
    for trace, secret in zip(halving, [s for s in secrets for _ in range(2)]):
        messages, low, high = trace["messages"], 1, 100
        guesses = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in messages if "tool_calls" in m]
        assert guesses[0] == 50 and len(guesses) <= 7 and guesses[-1] == secret
        for guess in guesses:
            assert guess == (low + high) // 2
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        assert messages[-1]["content"] == f"The number is {secret}."


RECORDER = '''
import json, os

def final_answer(prompts, completions, environments=None, **columns):
    """1 for an episode whose last message says 6; every call's completions are written to received.jsonl."""
    with open(os.path.join(os.path.dirname(__file__), "received.jsonl"), "a") as f:
        f.write(json.dumps({"completions": completions, "environments": environments is not None}) + "\\n")
    return [float(c[-1]["content"].strip() == "6") if isinstance(c, list) else 0.0 for c in completions]
'''


def agent_args(script, chat_llama, tmp_path, *extra):
    return [
        script,
        *ARITH[os.path.basename(script)[: -len(".py")]],
        "--model-name",
        chat_llama,
        "--dataset-name",
        "reasoning-gym:products",
        "--task-config",
        '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        "--train-size",
        "40",
        "--eval-size",
        "4",
        "--eval-samples",
        "4",
        "--max-prompt-length",
        "400",
        "--max-completion-length",
        "96",
        "--total-prompts",
        "8",
        "--batch-size",
        "4",
        "--num-generations",
        "2",
        "--mini-batch-size",
        "4",
        "--gradient-accumulation-steps",
        "2",
        "--log-freq",
        "1",
        "--output-dir",
        str(tmp_path / "out"),
        "--log-dir",
        str(tmp_path / "runs"),
        *extra,
    ]


# Llama 3.1's form of tool calls on ChatML turns: a call is the whole assistant turn, one JSON object {"name": ...,
# "parameters": {...}}; results come back in an "ipython" turn
JSON_TOOL_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful AI assistant.' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}{{- '\\n\\nTo call a function, respond with JSON {"name": its name, "parameters": its arguments}:' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message.role == 'tool' %}{{- '<|im_start|>ipython\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function if message.tool_calls[0].function is defined else message.tool_calls[0] %}
{{- '<|im_start|>assistant\\n{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
JSON_CALL = '{"name": "calculator", "parameters": {"expression": "2 * 3"}}'


def test_each_template_family_has_its_call_format_and_an_unreadable_one_is_refused(chat_llama):
    """The format is read off the template by a probe call rendered and parsed back: Hermes tags for TOOL_TEMPLATE,
    Llama 3.1's JSON for the JSON template; a template whose calls no format reads is a one-line error."""
    from common.chat import JsonFormat, tool_call_format

    tokenizer = load_tokenizer(chat_llama)
    tokenizer.chat_template = JSON_TOOL_TEMPLATE
    assert isinstance(tool_call_format(tokenizer), JsonFormat)
    assert JsonFormat().parse(JSON_CALL) == ("", [{"name": "calculator", "arguments": {"expression": "2 * 3"}}])
    assert JsonFormat().parse("The answer is 6.") == ("The answer is 6.", [])
    assert "error" in JsonFormat().parse('{"name": "calculator", "parameters": {')[1][0]
    assert HermesFormat().parse(JSON_CALL) == (JSON_CALL, [])  # the Hermes reader finds no call there: the template decides
    tokenizer.chat_template = JSON_TOOL_TEMPLATE.replace('{"name": "', "CALL ").replace(', "parameters": ', "(")
    with pytest.raises(UsageError, match="writes tool calls in a form this codebase cannot read"):
        tool_call_format(tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("script, form", [("grpo", "hermes"), ("rloo", "hermes"), ("grpo", "llama3_json")])
def test_a_run_with_a_tool_trains_on_the_models_tokens_only(script, form, chat_llama, tmp_path, monkeypatch):
    """The whole loop with the calculator, in each template family's call format: the loss mask of every mini-batch is
    exactly the policy's turns (a tool token in the loss fails), reward functions receive the episodes as messages,
    and the tool metrics are logged."""
    module = importlib.import_module(script)
    tokenizer = load_tokenizer(chat_llama, padding_side="left")
    template = []
    if form == "llama3_json":
        (tmp_path / "template.jinja").write_text(JSON_TOOL_TEMPLATE)
        template = ["--chat-template-path", str(tmp_path / "template.jinja")]
    use_tool_template(tokenizer, template[1] if template else None)
    call, result = (CALL, "<tool_response>") if form == "hermes" else (JSON_CALL, "ipython")
    answers, count = ["6", "7"], itertools.count()  # alternate answers: the rewards of a group differ

    def generate(self, prompts, prompt_mask, max_new_tokens=None, logprobs=False):
        """The scripted policy's turns for Engine.rollout: a calculator call, then after its result an answer."""
        turns = []
        for p, m in zip(prompts, prompt_mask):
            text = call if result not in tokenizer.decode(p[m.bool()]) else answers[next(count) % 2]
            turns.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        width = max(map(len, turns))
        completions = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t in turns])
        mask = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in turns])
        return completions, mask, torch.ones(len(turns), dtype=torch.bool), None

    monkeypatch.setattr(Engine, "generate", generate)
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    model_turns = {
        tuple(call_ids + tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]) for a in answers
    }
    seen, forward = [], module.per_token_logprobs

    def recording(net, prompts, prompt_mask, completions, mask, temperature, entropy=False):
        logprobs, entropies = forward(net, prompts, prompt_mask, completions, mask, temperature, entropy)
        if entropy:  # the training forward: the loss of these rows follows, with this logprobs tensor
            seen.append(completions)
            logprobs.register_hook(lambda grad: seen.append(grad))
        return logprobs, entropies

    monkeypatch.setattr(module, "per_token_logprobs", recording)
    (tmp_path / "recorder.py").write_text(RECORDER)
    recorder = f"{tmp_path}/recorder.py:final_answer"
    args = agent_args(f"{script}.py", chat_llama, tmp_path, "--tools", "calculator", "--reward-funcs", recorder, *template)
    monkeypatch.setattr("sys.argv", [str(a) for a in args])
    monkeypatch.chdir(ROOT)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    module.main(module.cli(module.Args))

    # every training row's gradient reaches exactly the policy's own tokens: the call turn and the answer turn
    pairs = list(zip(seen[0::2], seen[1::2]))
    assert pairs
    for completions, grad in pairs:
        for row, g in zip(completions, grad):
            assert tuple(row[g != 0].tolist()) in model_turns, tokenizer.decode(row[g != 0])
    received = [json.loads(line) for line in open(tmp_path / "received.jsonl")]
    episode = received[-1]["completions"][0]
    assert [m["role"] for m in episode] == ["assistant", "tool", "assistant"] and episode[1]["content"] == "6"
    run_dir = os.path.join(tmp_path, "runs", os.listdir(tmp_path / "runs")[0])
    assert read_scalars(run_dir, "tools/call_frequency") == [1.0, 1.0]
    assert read_scalars(run_dir, "tools/failure_frequency") == [0.0, 0.0]
    assert read_scalars(run_dir, "episodes/turns") == [2.0, 2.0]
    assert read_scalars(run_dir, "completions/mean_length")[0] == pytest.approx(len(call_ids) + 2)  # model tokens
    assert read_scalars(run_dir, "eval/tools/call_frequency") == [1.0, 1.0]


def test_an_environment_run_resets_per_episode_and_its_reward_is_scored(chat_llama, tmp_path):
    """rloo.py with a plug-in environment: each episode's instance is reset with its row, its tool is called by the
    policy (a random one: it never calls, so the episode is one turn), and get_reward() becomes a logged reward."""
    (tmp_path / "env.py").write_text(
        "class Counter:\n"
        "    def reset(self, answer, **row):\n"
        "        self.answer = answer\n"
        "        return ' Count with the tool.'\n"
        "    def count(self, n: int) -> str:\n"
        '        """Counts.\n\n        Args:\n            n: how far\n        """\n'
        "        return str(n)\n"
        "    def get_reward(self) -> float:\n"
        "        return float(self.answer.isdigit())\n"
    )
    environment = ["--environment", f"{tmp_path}/env.py:Counter", "--reward-funcs"]  # the environment's reward alone
    args = agent_args("rloo.py", chat_llama, tmp_path, *environment, "--max-completion-length", "8")
    output = run_script(args, ROOT)
    assert "episodes: tools count" in output
    run_dir = os.path.join(tmp_path, "runs", os.listdir(tmp_path / "runs")[0])
    assert read_scalars(run_dir, "rewards/Counter/mean") == [1.0, 1.0]  # reset saw each row's answer
    assert read_scalars(run_dir, "episodes/turns") == [1.0, 1.0] and read_scalars(run_dir, "eval/reward") == [1.0, 1.0]


BAD_TOOLS = """
import threading


def variadic(*numbers: int) -> str:
    \"""Sum.

    Args:
        numbers: the numbers
    \"""
    return str(sum(numbers))


def keywords(x: int, **options: int) -> str:
    \"""Echo.

    Args:
        x: a number
    \"""
    return str(x)


def positional(x: int, /) -> str:
    \"""Echo.

    Args:
        x: a number
    \"""
    return str(x)


class Unpicklable:
    def __init__(self):
        self.lock = threading.Lock()

    def reset(self, **row):
        pass

    def ping(self) -> str:
        \"""Answer.\"""
        return "pong"
"""


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tools", "nowhere.py:f"], "--tools nowhere.py:f: no such file"),
        (["--tools", "common.tools:run_calls"], "has no schema"),
        (["--environment", "presets.agents:calculator"], "creating an instance raised TypeError"),
        (["--tools", "calculator", "--tool-timeout", "0"], "--tool-timeout 0"),
        (["--tools", "calculator", "--reward-funcs"], "no reward"),
        (["--tools", "calculator", "--max-prompt-length", "32"], "raise it"),
        (["--tools", "calculator", "--chat-template-path", "missing.jinja"], "--chat-template-path missing.jinja"),
        (["--tools", "calculator", "--max-tool-calling-iterations", "0"], "no tool call would ever run"),
        (["--tools", "TOOLS:variadic"], "the tool 'variadic' takes *args, which a call by named arguments cannot fill"),
        (["--tools", "TOOLS:keywords"], "the tool 'keywords' takes **kwargs"),
        (["--tools", "TOOLS:positional"], "the tool 'positional' takes positional-only arguments"),
        (["--environment", "TOOLS:Unpicklable"], "an instance cannot be pickled"),
    ],
)
def test_bad_tools_are_one_line_errors_before_any_model_loads(extra, message, chat_llama, tmp_path):
    (tmp_path / "tools.py").write_text(BAD_TOOLS)
    extra = [e.replace("TOOLS", str(tmp_path / "tools.py")) for e in extra]
    error = run_failing(agent_args("grpo.py", chat_llama, tmp_path, *extra), ROOT)
    assert error.startswith("UsageError") and message in error, error


def test_sft_trains_on_the_call_and_the_answer_of_a_tool_trace(tokenizer):
    """sft.py --assistant-only-loss on builtin:calculator-traces: the assistant pieces are the call turn and the final
    answer, each ending with its end-of-turn token; the tool's result and the prompt (with the schemas) are not trained."""
    from presets.data import dataset
    from sft import conversation_pieces, row_tools

    row = dataset("builtin:calculator-traces")[0]
    pieces = conversation_pieces(tokenizer, row["messages"], None, row_tools(row))
    trained = [text for text, flag in pieces if flag]
    expression = row["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call><|im_end|>'
    assert trained == [call, row["messages"][3]["content"] + "<|im_end|>"]
    untrained = "".join(text for text, flag in pieces if not flag)
    assert "<tools>" in untrained and f"<tool_response>\n{row['messages'][2]['content']}" in untrained
    assert (
        "".join(text for text, _ in pieces)
        == tokenizer.apply_chat_template(row["messages"], tools=row_tools(row), tokenize=False).rstrip()
    )
