"""Tools, environments and the multi-turn episode loop, shared by grpo.py and rloo.py (with --tools / --environment):
the file to read before writing a tool or an environment of your own. TRL 1.x GRPOTrainer semantics (`tools=`,
`environment_factory`, `max_tool_calling_iterations`).

A tool is a plain Python function with type hints and a docstring whose "Args:" section describes each argument:
transformers' `get_json_schema` turns it into the JSON schema that the chat template shows the model (`tools=`). It
returns a string, the content of the tool message. An environment is a class: one instance per episode, `reset(**row)`
with the dataset row (a string it returns is appended to the prompt), its public methods the episode's tools, and an
optional `get_reward()` that becomes one more reward function (weight 1), as TRL's `environment_factory`.

An episode: the model generates until its turn ends (EOS); each <tool_call>{"name": ..., "arguments": {...}}</tool_call>
in the turn is run and its result appended as a tool message rendered by the chat template; generation continues. It
ends at a turn without a call, after `max_iterations` rounds of calls, or when the completion (the model's tokens and
the tools' together, as TRL counts) would pass `max_completion_length`. All episodes of a batch advance together, turn
by turn. The model's own tokens are marked 1 in `model_mask`, the tools' 0: the loss, the importance ratio, the KL and
the lengths use the model's tokens only, while the tool tokens stay in the context.

The built-in tool (`calculator`) and environments (`guess_number`, `guess_range`) are examples to copy: presets/agents.py.
"""

import inspect
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field

from transformers.utils import get_json_schema

from common.core import UsageError
from common.loading import load_function, plugin_error

# ChatML with Hermes-style tool calls (Qwen2.5's form): the tool schemas in the system message, calls as JSON in
# <tool_call> tags, consecutive tool results as <tool_response> blocks of one user turn. For templates without tools.
TOOL_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful AI assistant.' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\nYou can call functions. Their JSON schemas are within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, write its name and arguments as JSON within <tool_call></tool_call> tags:' }}
{{- '\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + arguments + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


TOOLS = {"calculator": "presets.agents:calculator"}  # the built-ins, imported when named (presets/ is deletable)
ENVIRONMENTS = {"guess_number": "presets.agents:GuessTheNumber", "guess_range": "presets.agents:GuessInRange"}


# ================================ loading: tools, environments, the chat template ================================
def tool_schema(function, flag: str) -> dict:
    """transformers' JSON schema of a tool; a one-line error naming what the function lacks."""
    try:
        return get_json_schema(function)
    except Exception as error:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise UsageError(
            f"{flag}: the tool {getattr(function, '__name__', function)!r} has no schema ({error}): give it type hints "
            "and a docstring whose Args: section describes each argument"
        ) from None


def environment_tools(environment) -> dict:
    """An environment's tools: its public methods other than reset and get_reward (TRL's contract)."""
    names = [n for n, _ in inspect.getmembers(type(environment), inspect.isfunction) if not n.startswith("_")]
    return {n: getattr(environment, n) for n in names if n not in ("reset", "get_reward")}


def load_environment(spec: str):
    """The environment class named by --environment (a built-in or "file.py:Class"), checked on one instance."""
    factory = load_function(spec, ENVIRONMENTS, "--environment")
    try:
        probe = factory()
    except Exception as error:  # noqa: BLE001 - the user's code
        raise UsageError(f"--environment {spec}: creating an instance raised {plugin_error(error)}") from None
    if not callable(getattr(probe, "reset", None)):
        raise UsageError(f"--environment {spec}: an environment needs a reset(**row) method (TRL's contract).")
    if not environment_tools(probe):
        raise UsageError(f"--environment {spec}: it has no public method for the model to call.")
    for method in environment_tools(probe).values():
        tool_schema(method, f"--environment {spec}")
    return factory


def supports_tools(tokenizer) -> bool:
    """Whether the chat template renders tool schemas, tool calls and tool results (TRL's `supports_tool_calling`)."""
    schema = {"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {}}}
    call = {"type": "function", "function": {"name": "probe_call", "arguments": {"x": 1}}}
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "probe_call", "content": "probe_result"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
        return False
    return all(s in text for s in ("probe_tool", "probe_call", "probe_result"))


def use_tool_template(tokenizer, path: str | None) -> str:
    """Set the template that renders the episodes: --chat-template-path's Jinja file, the tokenizer's own when it supports
    tools, else TOOL_TEMPLATE for a ChatML tokenizer (EOS <|im_end|>). Returns which, for the run's log."""
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                tokenizer.chat_template = file.read()
        except OSError as error:
            raise UsageError(f"--chat-template-path {path}: {error.strerror}.") from None
        which = path
    elif supports_tools(tokenizer):
        return "the tokenizer's own"
    elif tokenizer.eos_token == "<|im_end|>":
        tokenizer.chat_template, which = TOOL_TEMPLATE, "ChatML with <tool_call> tags (agents.TOOL_TEMPLATE)"
    else:
        raise UsageError(
            f"the chat template of {tokenizer.name_or_path!r} cannot render tool calls: give --chat-template-path a "
            "Jinja template that does (agents.TOOL_TEMPLATE is one for ChatML models)"
        )
    if not supports_tools(tokenizer):
        raise UsageError(f"--chat-template-path {path}: the template does not render tools, tool calls and tool results.")
    return which


# ================================ one turn: parse the calls, run them ================================
def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """A turn's text without its calls, and its calls in the Hermes form <tool_call>{"name": ..., "arguments":
    {...}}</tool_call>: {"name", "arguments"} each, or {"error": why} for one that cannot be run (bad JSON, no name,
    arguments that are not an object, an unclosed tag)."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        body, closed = match.group(1).strip(), match.group(0).endswith("</tool_call>")
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append({"error": f"the tool call is not JSON ({error.msg}): {body[:80]!r}"})
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not closed:
            calls.append({"error": "the tool call has no closing </tool_call> tag"})
        elif not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append({"error": 'a tool call is {"name": <function-name>, "arguments": <args-json-object>}'})
        else:
            calls.append({"name": call["name"], "arguments": arguments})
    return TOOL_CALL.sub("", text).strip(), calls


def run_calls(calls: list[list[dict]], toolboxes: list[dict], timeout: float) -> list[list[tuple[str, str, bool]]]:
    """Run each episode's calls in order, the episodes side by side (a thread each), every call under `timeout` seconds.
    Returns (name, result text, failed) per call: a call that is malformed, names an unknown tool, raises, returns a
    non-string or runs past the timeout is a failure whose text is {"error": ...}, never an exception of the run (a
    call past its timeout is abandoned to its thread; the episode's later calls are not run)."""
    results = [[None] * len(c) for c in calls]
    started = [[None] * len(c) for c in calls]

    def one(call: dict, tools: dict) -> tuple[str, str, bool]:
        if "error" in call:
            return "invalid", json.dumps({"error": call["error"]}), True
        name, function = call["name"], tools.get(call["name"])
        if function is None:
            return name, json.dumps({"error": f"unknown tool {name!r}; the tools are {sorted(tools)}"}), True
        try:
            value = function(**call["arguments"])
        except Exception as error:  # noqa: BLE001 - the tool's own failure goes back to the model
            return name, json.dumps({"error": f"{type(error).__name__}: {error}"}), True
        if not isinstance(value, str):
            return name, json.dumps({"error": f"the tool returned {type(value).__name__}, not a string"}), True
        return name, value, False

    def episode(e: int) -> None:
        for k, call in enumerate(calls[e]):
            started[e][k] = time.monotonic()
            results[e][k] = one(call, toolboxes[e])

    threads = [threading.Thread(target=episode, args=(e,), daemon=True) for e in range(len(calls)) if calls[e]]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if all(
            not t.is_alive() or any(s is not None and r is None and now - s > timeout for s, r in zip(started[e], results[e]))
            for t, e in zip(threads, [e for e in range(len(calls)) if calls[e]])
        ):
            break  # every episode still running is stuck in a call past its timeout
        time.sleep(0.002)
    for e, episode_calls in enumerate(calls):
        for k, call in enumerate(episode_calls):
            if results[e][k] is None:
                error = f"the tool did not return within --tool-timeout {timeout:g} s"
                results[e][k] = call.get("name", "invalid"), json.dumps({"error": error}), True
    return results


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens the template puts after a model turn that ended with EOS: the tool messages and the next generation
    prompt (TRL's `_get_tool_suffix_ids`, from a dummy conversation rendered with and without them)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    prefix = prefix[: eos[-1] + 1] if eos else prefix  # the template's newline after the end of turn is not generated
    if full[: len(prefix)] != prefix:
        raise UsageError("the chat template renders a turn differently when tool results follow it: it cannot run tools")
    return full[len(prefix) :]


# ================================ the episode loop ================================
@dataclass
class Episodes:
    """A batch of finished episodes. prompt_ids: each episode's prompt; completion_ids: every token after the prompt,
    the model's and the tools'; model_mask: 1 for the model's own tokens; messages: the completion as chat messages
    (assistant turns with their tool_calls, tool messages), as reward functions receive it; ended: the last turn ended
    with EOS."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    model_mask: list[list[int]]
    messages: list[list[dict]]
    ended: list[bool]
    tool_calls: list[int] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


def run_episodes(
    generate, tokenizer, prompt_ids, toolboxes, max_completion_length: int, max_iterations: int, timeout: float
) -> Episodes:
    """Every episode of a batch, advanced together turn by turn. `generate(contexts, max_new_tokens)` samples one turn
    for each context (token lists) and returns its tokens, cut after the first EOS; `toolboxes[i]` maps the tool names of
    episode i to their functions."""
    n = len(prompt_ids)
    out = Episodes(prompt_ids, [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [False] * n)
    max_iterations = math.inf if max_iterations is None else max_iterations
    out.tool_calls, out.failures, out.turns = [0] * n, [0] * n, [0] * n
    active, iteration = list(range(n)), 0
    while active:
        budget = {i: max_completion_length - len(out.completion_ids[i]) for i in active}
        turns = generate([prompt_ids[i] + out.completion_ids[i] for i in active], max(budget.values()))
        calling, calls = [], []
        for i, turn in zip(active, turns):
            turn = turn[: budget[i]]  # each episode's own budget in a batch generated to the largest
            out.completion_ids[i] += turn
            out.model_mask[i] += [1] * len(turn)
            out.ended[i] = bool(turn) and turn[-1] == tokenizer.eos_token_id
            out.turns[i] += 1
            content, turn_calls = parse_tool_calls(tokenizer.decode(turn, skip_special_tokens=True))
            valid = [{"type": "function", "function": c} for c in turn_calls if "error" not in c]
            out.messages[i].append({"role": "assistant", "content": content} | ({"tool_calls": valid} if valid else {}))
            if turn_calls and out.ended[i] and iteration < max_iterations:
                calling.append(i)
                calls.append(turn_calls)
        results = run_calls(calls, [toolboxes[i] for i in calling], timeout)
        active = []
        for i, episode_results in zip(calling, results):
            tool_messages = [{"role": "tool", "name": name, "content": text} for name, text, _ in episode_results]
            out.tool_calls[i] += len(episode_results)
            out.failures[i] += sum(failed for _, _, failed in episode_results)
            suffix = tool_suffix_ids(tokenizer, tool_messages)
            if len(out.completion_ids[i]) + len(suffix) >= max_completion_length:
                continue  # no room for the results and a reply: the episode ends with its last turn (TRL)
            out.messages[i] += tool_messages
            out.completion_ids[i] += suffix
            out.model_mask[i] += [0] * len(suffix)
            active.append(i)
        iteration += 1
    return out


def episode_text(messages: list[dict]) -> str:
    """An episode for the sample tables: each turn on its line, tool calls and results included."""
    lines = []
    for m in messages:
        calls = " ".join(f"{c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in m.get("tool_calls", []))
        lines.append(f"[{m['role']}] {m['content']}" + (f" -> {calls}" if calls else ""))
    return "\n".join(lines)


class Agent:
    """What --tools, --environment, --chat-template-path, --max-tool-calling-iterations and --tool-timeout set up for a
    run: the tools (checked before any model loads), the environment class, the template, and the episodes of a batch."""

    def __init__(self, args, tokenizer):
        self.tools = {}
        for spec in args.tools:
            function = load_function(spec, TOOLS, "--tools")
            tool_schema(function, f"--tools {spec}")
            self.tools[function.__name__] = function
        self.factory = load_environment(args.environment) if args.environment else None
        env_tools = environment_tools(self.factory()) if self.factory else {}
        self.schemas = [tool_schema(f, "--tools") for f in (self.tools | env_tools).values()]
        self.template = use_tool_template(tokenizer, args.chat_template_path)
        self.tokenizer, self.args = tokenizer, args

    def reward_function(self):
        """The environment's get_reward() as a reward function named after its class (TRL), or None."""
        if self.factory is None or not callable(getattr(self.factory, "get_reward", None)):
            return None

        def environment_reward(environments, **columns) -> list[float]:
            return [environment.get_reward() for environment in environments]

        return self.factory.__name__, environment_reward

    def run(self, rows: list[dict], generate, render_ids) -> tuple[Episodes, list]:
        """The episodes of `rows` (one each) and their environments (None each without --environment): each environment
        reset with its row (a string it returns ends the prompt's last message, re-rendered by `render_ids`)."""
        environments, prompt_ids, toolboxes = [], [], []
        for row in rows:
            ids, environment = row["prompt_ids"], None
            if self.factory is not None:
                environment = self.factory()
                columns = {k: v for k, v in row.items() if k != "prompt_ids"}
                try:
                    observation = environment.reset(**columns)
                except Exception as error:  # noqa: BLE001 - the user's code
                    raise UsageError(f"--environment {self.args.environment}: reset raised {plugin_error(error)}") from None
                if isinstance(observation, str):
                    prompt = row["prompt"][:-1] + [row["prompt"][-1] | {"content": row["prompt"][-1]["content"] + observation}]
                    ids = render_ids(prompt)
            environments.append(environment)
            prompt_ids.append(ids)
            toolboxes.append(self.tools | (environment_tools(environment) if environment is not None else {}))
        args = self.args
        episodes = run_episodes(
            generate,
            self.tokenizer,
            prompt_ids,
            toolboxes,
            args.max_completion_length,
            args.max_tool_calling_iterations,
            args.tool_timeout,
        )
        return episodes, environments
