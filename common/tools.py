"""Tools and environments for multi-turn episodes (grpo.py, rloo.py --tools / --environment; sft.py on tool traces),
TRL 1.x semantics (`tools=`, `environment_factory`): loading and checking them, and running calls where they can be
stopped (a chat template's tool-call format: common/chat.py). The file to read before writing a tool or an
environment of your own.

A tool is a plain Python function with type hints and a docstring whose "Args:" section describes each argument:
transformers' `get_json_schema` turns it into the JSON schema that the chat template shows the model (`tools=`). It
returns a string, the content of the tool message. An environment is a class: one instance per episode, `reset(**row)`
with the dataset row (a string it returns is appended to the prompt), its public methods the episode's tools, and an
optional `get_reward()` that becomes one more reward function (weight 1), as TRL's `environment_factory`.

Each round of calls runs in a process of its own, forked from the run (each episode's calls in a thread there): a
call that raises anything, exits or runs past its timeout is a failed call whose message goes back to the model, and a
call past its timeout is stopped with that process. So an environment's state must pickle (it comes back from that
process after each call), and a tool's module-level state (a cache, a counter) does not outlive its round.

The built-in tool (`calculator`) and environments (`guess_number`, `guess_range`) are examples to copy:
presets/agents.py. The episode loop that runs them is `common.rollout.run_episodes`.
"""

import contextlib
import inspect
import json
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time

from transformers.utils import get_json_schema

from common.chat import tool_call_format, use_tool_template
from common.core import UsageError, die_with_parent, error_line
from common.loading import load_function, plugin_error


# ================================ loading: tools, environments, the chat template ================================
def tool_schema(function, flag: str) -> dict:
    """transformers' JSON schema of a tool, once its signature is checked: every argument can be passed by name (the
    model calls a tool with a JSON object of named arguments); a one-line error naming what the function lacks."""
    name = getattr(function, "__name__", function)
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    kinds = {inspect.Parameter.VAR_POSITIONAL: "*args", inspect.Parameter.VAR_KEYWORD: "**kwargs"}
    kinds[inspect.Parameter.POSITIONAL_ONLY] = "positional-only arguments"
    odd = [kinds[p.kind] for p in parameters if p.kind in kinds]
    if odd:
        raise UsageError(
            f"{flag}: the tool {name!r} takes {odd[0]}, which a call by named arguments cannot fill: give it named "
            "arguments, each with a type hint"
        )
    try:
        return get_json_schema(function)
    except Exception as error:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise UsageError(
            f"{flag}: the tool {name!r} has no schema ({error}): give it type hints and a docstring whose Args: section "
            "describes each argument"
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
    try:  # its tool calls run in a process of their own, and its state comes back from there by pickle
        pickle.loads(pickle.dumps(probe))
    except Exception as error:  # noqa: BLE001 - whatever pickling the user's class raises
        raise UsageError(
            f"--environment {spec}: an instance cannot be pickled ({error_line(error)}); keep its state in plain "
            "attributes (tool calls run in a separate process, and the state comes back by pickle)"
        ) from None
    return factory


# ================================ running calls ================================
def run_calls(calls: list[list[dict]], toolboxes: list[dict], timeout: float) -> list[list[tuple[str, str, bool]]]:
    """Run each episode's calls in order, the episodes side by side (a thread each), in one process forked for the
    round, so that the tools and environments are there as they are here. Returns (name, result text, failed) per call:
    a call that is malformed, names an unknown tool, raises anything (SystemExit and KeyboardInterrupt too), returns a
    non-string, ends its process or runs past `timeout` seconds is a failure whose text is {"error": ...}, never an
    exception of the run. A call past its timeout is stopped with the process once every other episode's calls are
    done: nothing it does after its timeout reaches the episode, and the episode's later calls are not run. An
    environment (the object behind a toolbox's methods) comes back after each call, by pickle, so that the next call
    and get_reward() see what the calls did."""
    results = [[None] * len(c) for c in calls]
    episodes = [e for e, c in enumerate(calls) if c]
    if not episodes:
        return results
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_call_worker, args=(calls, toolboxes, send), daemon=True)
    worker.start()
    with contextlib.suppress(OSError):  # its own process group, which the worker also makes itself (no race either way)
        os.setpgid(worker.pid, worker.pid)
    send.close()
    stop = lambda: _stop_group(worker.pid)  # noqa: E731 - the worker and every process its tools started
    try:
        # the clocks start once the worker runs: forking a large process on a loaded machine is not the tools' time
        try:
            ready = receive.poll(WORKER_START_S) and receive.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        for e in episodes if not ready else ():
            results[e][0] = _failure(calls[e][0], f"the tool process did not start within {WORKER_START_S} s")
        waiting = dict.fromkeys(episodes if ready else (), time.monotonic())  # episode -> when its current call started
        late = set()  # episodes whose call ran past its timeout by the worker's own clock
        while waiting:  # until every episode's calls are done, or stuck in a call past its timeout
            now = time.monotonic()
            running = [e for e, started in waiting.items() if e not in late and now - started <= timeout]
            # a result sent in time may wait in the pipe for a run that was slow to wake: it is read before giving up
            if not receive.poll(max(0.0, min(waiting[e] for e in running) + timeout - now) if running else 0):
                if not running:
                    break
                continue
            watchdog = threading.Timer(timeout, stop)  # a message cut off midway by a hung worker: stop it, read EOF
            watchdog.start()
            try:
                e, k, name, text, failed, state, took = receive.recv()
            except (EOFError, OSError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as error:
                # the pipe broke: a tool ended the process (os._exit, a crash), closed or wrote into the pipe
                stop()
                worker.join(timeout)
                why = "ended its process" if isinstance(error, EOFError) else f"broke its pipe ({error_line(error)})"
                exit_status = worker.exitcode if worker.exitcode is not None and worker.exitcode >= 0 else None
                why += f" (exit status {exit_status})" if isinstance(error, EOFError) and exit_status is not None else ""
                for e in waiting:
                    results[e][results[e].index(None)] = _failure(calls[e][results[e].index(None)], f"the tool {why}")
                waiting.clear()
                break
            finally:
                watchdog.cancel()
            if e in late or took > timeout:  # what it did after its timeout never reaches the episode
                late.add(e)
                continue
            results[e][k] = name, text, failed
            _restore(toolboxes[e], state)
            waiting[e] = time.monotonic()
            if None not in results[e]:
                del waiting[e]
    finally:  # stopped, whatever still runs in it: no call outlives the round (Ctrl-C and SIGTERM included)
        stop()
        worker.join(timeout)  # SIGKILL'd: it is gone at once; the bound keeps a wait from ever hanging the run
        receive.close()
    for e in waiting:  # each is in a call past its timeout
        k = results[e].index(None)
        results[e][k] = _failure(calls[e][k], f"the tool did not return within --tool-timeout {timeout:g} s")
    for e, episode_calls in enumerate(calls):
        for k, call in enumerate(episode_calls):
            if results[e][k] is None:
                results[e][k] = _failure(call, "not run: an earlier call of this turn failed to return")
    return results


def _stop_group(pid: int) -> None:
    """SIGKILL the worker's process group: the worker and whatever its tools started (unless one left the group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)  # a worker not yet in its group (killed right after the fork)


def _failure(call: dict, why: str) -> tuple[str, str, bool]:
    return call.get("name", "invalid"), json.dumps({"error": why}), True


def _call_worker(calls: list[list[dict]], toolboxes: list[dict], connection) -> None:
    """The process that runs a round of calls: each episode's in order in a thread of its own, each result sent back as
    it comes with the state of the environments behind the tools (pickled); then an exit that runs no handler of the
    run's (os._exit), once every thread is done (the run stops this process if one hangs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle: it stops this process
    # a process group of its own, which the run stops whole: the processes a tool starts go with it; and if the run
    # dies without stopping it (SIGKILL, the OOM killer), the kernel's SIGTERM makes it stop its group itself
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    if sys.platform == "linux":
        die_with_parent(signal.SIGTERM)
    lock = threading.Lock()
    connection.send("ready")  # the run's clocks for the calls start here

    def episode(e: int) -> None:
        for k, call in enumerate(calls[e]):
            start = time.monotonic()
            name, text, failed = _call(call, toolboxes[e])
            took = time.monotonic() - start
            try:
                state = pickle.dumps(_environments(toolboxes[e]))
            except Exception as error:  # noqa: BLE001 - whatever pickling the user's class raises
                state = UsageError(
                    f"an environment's state cannot be pickled after its tool {name!r} ran ({error_line(error)}): keep "
                    "its state in plain attributes (tool calls run in a separate process; the state comes back by pickle)"
                )
            with lock:
                connection.send((e, k, name, text, failed, state, took))

    threads = [threading.Thread(target=episode, args=(e,), daemon=True) for e in range(len(calls)) if calls[e]]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        connection.close()
        with contextlib.suppress(BaseException):  # what the tools printed (the run's own output was flushed at the fork)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


def _call(call: dict, tools: dict) -> tuple[str, str, bool]:
    """One call: (name, result text, failed)."""
    if "error" in call:
        return "invalid", json.dumps({"error": call["error"]}), True
    name, function = call["name"], tools.get(call["name"])
    if function is None:
        return name, json.dumps({"error": f"unknown tool {name!r}; the tools are {sorted(tools)}"}), True
    try:
        value = function(**call["arguments"])
    except BaseException as error:  # noqa: BLE001 - the tool's own failure, SystemExit included, goes back to the model
        return name, json.dumps({"error": error_line(error)}), True
    if not isinstance(value, str):
        return name, json.dumps({"error": f"the tool returned {type(value).__name__}, not a string"}), True
    return name, value, False


def _environments(tools: dict) -> list:
    """The objects whose methods are among `tools` (an episode's environment), once each, in a fixed order."""
    owners = []
    for function in tools.values():
        owner = getattr(function, "__self__", None)
        if inspect.ismethod(function) and not any(owner is o for o in owners):
            owners.append(owner)
    return owners


def _restore(tools: dict, state) -> None:
    """Give the environments behind `tools` the state their calls left in the worker process."""
    if isinstance(state, UsageError):
        raise state
    for here, there in zip(_environments(tools), pickle.loads(state)):
        vars(here).clear()
        vars(here).update(vars(there))


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


# ================================ what a run's tool flags set up ================================
WORKER_START_S = 60  # how long a round's forked process may take to start before its calls fail

TOOLS = {"calculator": "presets.agents:calculator"}  # the built-ins, imported when named (presets/ is deletable)
ENVIRONMENTS = {"guess_number": "presets.agents:GuessTheNumber", "guess_range": "presets.agents:GuessInRange"}


class Toolset:
    """What --tools, --environment, --chat-template-path, --max-tool-calling-iterations and --tool-timeout set up for a
    run, checked before any model loads: the tools, the environment class, the template and its call format."""

    def __init__(self, args, tokenizer):
        self.tools = {}
        for spec in args.tools:
            function = load_function(spec, TOOLS, "--tools")
            tool_schema(function, f"--tools {spec}")
            self.tools[function.__name__] = function
        self.factory = load_environment(args.environment) if args.environment else None
        self.spec = args.environment
        env_tools = environment_tools(self.factory()) if self.factory else {}
        self.schemas = [tool_schema(f, "--tools") for f in (self.tools | env_tools).values()]
        self.template = use_tool_template(tokenizer, args.chat_template_path)
        self.format = tool_call_format(tokenizer)
        self.max_iterations, self.timeout = args.max_tool_calling_iterations, args.tool_timeout

    def reward_function(self):
        """The environment's get_reward() as a reward function named after its class (TRL), or None."""
        if self.factory is None or not callable(getattr(self.factory, "get_reward", None)):
            return None

        def environment_reward(environments, **columns) -> list[float]:
            return [environment.get_reward() for environment in environments]

        return self.factory.__name__, environment_reward

    def start(self, row: dict):
        """An episode's environment (None without --environment), reset with its row; its tools; and what reset()
        returned to append to the prompt (None: nothing)."""
        if self.factory is None:
            return None, dict(self.tools), None
        environment = self.factory()
        try:
            observation = environment.reset(**{k: v for k, v in row.items() if k != "prompt_ids"})
        except Exception as error:  # noqa: BLE001 - the user's code
            raise UsageError(f"--environment {self.spec}: reset raised {plugin_error(error)}") from None
        return environment, self.tools | environment_tools(environment), observation if isinstance(observation, str) else None
