"""Loading by name: models, tokenizers, datasets and Stable Diffusion pipelines from a hub id, a local path or an
offline built-in (`builtin:` names, resolved by `builtin` below: the door to presets/ for models, datasets and pipelines;
agents.py names its built-in tool and environment itself), each anticipated failure a one-line error; and the checks
every script runs on the data it loaded (columns, value kinds, the held-out split).
"""

import functools
import importlib
import importlib.util
import json
import math
import os
import socket
import sys
import sysconfig
import traceback
import zlib
from urllib.parse import urlparse

import torch
from datasets import Dataset, load_dataset
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

import presets
from common.chat import as_messages, check_roles, is_conversation, render, text_of, use_chat
from common.core import UsageError, error_line

DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def from_cache(make, *args, **kwargs):
    """`make(*args, **kwargs)`, a presets/ function that may build or rebuild a cached built-in: a damaged cache it
    cannot rebuild (a read-only one) is a one-line error naming the folder to delete."""
    try:
        return make(*args, **kwargs)
    except presets.cache.CacheError as error:
        raise UsageError(str(error)) from None


def builtin(name: str, kind: str = "model") -> str:
    """The door to the offline built-ins: `name` itself once checked against the built-ins of its kind (a one-line
    error otherwise)."""
    known = {"model": presets.MODELS, "dataset": presets.data.DATASETS, "pipeline": ("builtin:tiny-sd",)}[kind]
    if name not in known:
        raise UsageError(f"Unknown built-in {kind} {name!r}: choose {', '.join(known)}.")
    return name


def is_random_builtin(name: str) -> bool:
    """A built-in model with random weights (builtin:tiny-gpt2, builtin:tiny-t5): built from a config, no folder."""
    return presets.is_builtin(name) and presets.is_random(builtin(name))


def resolve(name: str) -> str:
    """The folder or hub id that `from_pretrained` reads: a pretrained built-in's cached folder (built on first use)."""
    return from_cache(presets.folder, builtin(name)) if presets.is_builtin(name) and not is_random_builtin(name) else name


# The flag each name on the command line came from (filled by common.cli.cli), so that an error names the flag
FLAGS: dict[str, str] = {}
# --trust-remote-code of the run (set by common.cli.cli): a model, config or tokenizer that ships its own code runs it
REMOTE_CODE = {"trusted": False}


def remote_code() -> dict:
    """from_pretrained's trust_remote_code, always given: left unset, transformers would stop to ask at the terminal."""
    return {"trust_remote_code": REMOTE_CODE["trusted"]}


@functools.cache
def hub_reachable() -> bool:
    """Whether the hub can be reached (one 2-s connection attempt, unless HF_HUB_OFFLINE); if not, the hub libraries go
    offline for the run, so a hub id loads from the local cache or fails at once instead of after 45 s of retries."""
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE:
        return False
    try:
        socket.create_connection((urlparse(hub.ENDPOINT).hostname, 443), timeout=2).close()
        return True
    except OSError:
        import datasets.config

        hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
        return False


def located(load, name: str, what: str):
    """`load(name)`; a local path that does not exist, a folder without `config.json` or whose files cannot be read,
    or a hub id that cannot be reached from here is a one-line error naming the flag and which of them it is."""
    flag = FLAGS.get(name, what)
    if what == "model" and os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise UsageError(
            f"{flag} {name}: no config.json in the folder, so it holds no saved model (save_pretrained writes one)"
        )
    online = os.path.exists(name) or hub_reachable()
    try:
        return load(name)
    except (OSError, ConnectionError, ValueError, SafetensorError) as error:  # a missing repo or file, a corrupt one
        if "trust_remote_code" in str(error):
            raise UsageError(
                f"{flag} {name} ships its own code, which runs only when asked: pass --trust-remote-code (for code you trust)."
            ) from None
        if os.path.exists(name):
            if isinstance(error, UsageError):
                raise
            raise UsageError(
                f"{flag} {name}: its files cannot be loaded ({error_line(error)}); save the {what} again, or pass another "
                "folder."
            ) from None
        if not isinstance(error, (OSError, ConnectionError)):
            raise
        where = "no such file or folder here" + ("" if online else ", and the hub cannot be reached (offline)")
        raise UsageError(
            f"{flag} {name}: {where}; pass a local folder, a builtin: name, or a hub id with network access."
        ) from None


def load_config(name: str):
    """The config of a built-in preset, hub id or local folder."""
    if is_random_builtin(name):
        return from_cache(presets.config, name)
    return located(lambda n: AutoConfig.from_pretrained(n, **remote_code()), resolve(name), "model")


def context_length(config) -> int | None:
    """The most positions a model reads (max_position_embeddings, GPT-2's n_positions), or None where positions are
    relative (T5) or absent (ALiBi)."""
    return getattr(config.get_text_config(), "max_position_embeddings", None) if config is not None else None


def load_pretrained(name: str, auto_class, seed: int = 0, dtype: str | torch.dtype = "float32", **kwargs):
    """`auto_class.from_pretrained(name)` with its weights in `dtype` (float32 by default, as TRL trains; "auto": the
    checkpoint's, README "weight dtype"), or for a random built-in name a tiny model initialised with `seed`."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    if is_random_builtin(name):
        dtype = torch.float32 if dtype == "auto" else dtype
        return from_cache(presets.random_model, name, auto_class, seed, dtype=dtype, **kwargs)
    load = lambda n: auto_class.from_pretrained(n, dtype=dtype, **(remote_code() | kwargs))  # noqa: E731
    loaded = located(load, resolve(name), "model")
    if presets.is_builtin(name):  # peft records it as the adapter's base (loaded: maybe (model, info))
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.config.name_or_path = model.name_or_path = name
    return loaded


def quantization_kwargs(name: str, load_in_8bit: bool, load_in_4bit: bool, use_peft: bool) -> dict:
    """from_pretrained kwargs for --load-in-8bit / --load-in-4bit (bitsandbytes), after checking they can work:
    quantised weights are frozen, LoRA adapters train on top (peft's prepare_model_for_kbit_training)."""
    if not (load_in_8bit or load_in_4bit):
        return {}
    flag = "--load-in-8bit" if load_in_8bit else "--load-in-4bit"
    if load_in_8bit and load_in_4bit:
        raise UsageError("Pass one of --load-in-8bit and --load-in-4bit, not both.")
    if not use_peft:
        raise UsageError(f"{flag} loads frozen quantised weights: add --use-peft to train LoRA adapters on them.")
    if presets.is_builtin(name):
        raise UsageError(f"{flag} quantises large pretrained weights: {name} is a tiny built-in preset; pass a hub model.")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available():
        raise UsageError(
            f"{flag} needs a CUDA GPU and bitsandbytes (pip install bitsandbytes); this machine has "
            f"{'no CUDA GPU' if not torch.cuda.is_available() else 'no bitsandbytes'}. Drop the flag "
            "to train in full precision."
        )
    from accelerate import PartialState
    from transformers import BitsAndBytesConfig

    config = (
        BitsAndBytesConfig(load_in_8bit=True)
        if load_in_8bit
        else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    )
    return dict(quantization_config=config, device_map={"": PartialState().local_process_index})


def load_tokenizer(name: str, padding_side: str = "right") -> PreTrainedTokenizerBase:
    """The tokenizer of a model name; a clear error when it has no pad token (add one, do not reuse EOS)."""
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model", "tokenizer.model")
    if os.path.isdir(name) and not any(os.path.isfile(os.path.join(name, f)) for f in tokenizer_files):
        raise UsageError(
            f"no tokenizer files in the folder {name!r}: save the tokenizer beside the model "
            "(tokenizer.save_pretrained(folder))"
        )
    if presets.is_builtin(name):
        tokenizer = from_cache(presets.tokenizer, builtin(name))
    else:
        tokenizer = located(lambda n: AutoTokenizer.from_pretrained(n, **remote_code()), name, "tokenizer")
    if tokenizer.pad_token is None:
        raise UsageError(
            f"The tokenizer of {name!r} has no pad token. Add a distinct one (tokenizer.add_special_tokens("
            "{'pad_token': '<|pad|>'}) and resize the model's embeddings), then save and pass that folder."
        )
    tokenizer.padding_side = padding_side
    return tokenizer


def load_data(name: str, split: str = "train", seed: int = 0) -> Dataset:
    """A built-in dataset, a local json/jsonl/csv/parquet/txt file, or a hub id / local dataset folder."""
    if presets.is_builtin(name):
        return from_cache(presets.dataset, builtin(name, "dataset"), seed)
    extension = os.path.splitext(name)[1].lower()
    flag = FLAGS.get(name, "the dataset file")
    if extension in DATA_FILE_TYPES and not os.path.exists(name):
        raise UsageError(f"{flag} {name}: no such file (from {os.getcwd()})")
    if os.path.isfile(name):
        if os.path.getsize(name) == 0:
            raise UsageError(f"{flag} {name}: the file is empty.")
        if extension not in DATA_FILE_TYPES:
            raise UsageError(f"{flag} {name}: cannot read it; use a {', '.join(DATA_FILE_TYPES)} file.")
        if extension in (".json", ".jsonl", ".csv", ".txt"):
            check_text_file(name, flag, extension)
        try:
            with open(name, "rb") as f:
                bom = f.read(3) == b"\xef\xbb\xbf"
            options = {"encoding": "utf-8-sig"} if bom and extension == ".txt" else {}  # json and csv skip it themselves
            return load_dataset(DATA_FILE_TYPES[extension], data_files=name, split="train", **options)
        except Exception as error:  # noqa: BLE001 - rows that do not make one table: one line, not the parser's internals
            raise UsageError(f"{flag} {name}: its rows do not make one table ({error_line(error)}).") from None
    return located(lambda n: load_dataset(n, split=split), name, "dataset")


def check_text_file(name: str, flag: str, extension: str) -> None:
    """A one-line error for a text data file that is not UTF-8 (a parquet file named .jsonl, stray bytes), holds only
    blank lines, or (JSON lines) has a line that is not valid JSON."""
    with open(name, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not data
    except UnicodeDecodeError as bad:
        line = raw[: bad.start].count(b"\n") + 1
        raise UsageError(
            f"{flag} {name}, line {line}: not UTF-8 text (byte {raw[bad.start]:#04x}); save it as UTF-8"
            f"{' JSON lines' if extension != '.csv' else ''}, or give a binary file its own extension (.parquet)."
        ) from None
    if not text.strip():
        raise UsageError(f"{flag} {name}: the file holds only blank lines.")
    if extension == ".json":
        try:
            json.loads(text)  # one JSON document (an array of rows, or an object); else JSON lines, as .jsonl
            return
        except json.JSONDecodeError:
            pass
    if extension in (".json", ".jsonl"):
        for number, line in enumerate(text.splitlines(), 1):
            try:
                line.strip() and json.loads(line)
            except json.JSONDecodeError as bad:
                raise UsageError(f"{flag} {name}, line {number}: not valid JSON ({bad.msg}): {line.strip()[:80]!r}") from None


def reward_model_text(tokenizer, prompt, response, ended: bool = True, chat: bool = True) -> str:
    """The text a reward model reads, as reward_modeling.py trains it and ppo.py / grpo.py score it: with a chat
    template, the conversation rendered (the assistant's turn closed only after a response that ended); without one,
    "prompt response<eos>" (EOS only after a response that ended; without a prompt, the response alone)."""
    if use_chat(tokenizer, chat, [prompt, response]):
        response = response if is_conversation(response) else response.strip()
        if not prompt:  # the response is a whole conversation (TRL's implicit prompt)
            return tokenizer.apply_chat_template(as_messages(response, "assistant"), tokenize=False).rstrip()
        prompt_text, answer_text = render(tokenizer, prompt, response)
        return prompt_text + (answer_text if ended else text_of(response))
    return (f"{prompt} " if prompt else "") + response.strip() + (tokenizer.eos_token or "" if ended else "")


def check_columns(
    dataset: Dataset,
    columns: list[str],
    flag_hint: str = "the --*-column arguments",
    numeric: tuple = (),
    chat: bool = True,
    prompts: tuple = (),
    source: str = "",
) -> None:
    """A clear error naming the missing columns and the ones the dataset has, or a value of the wrong kind with its column
    and row: the `numeric` columns hold numbers, the others text, or (with `chat`) chat messages in every row; the
    `prompts` columns (what a policy samples from) hold no empty or whitespace-only prompt. `source`, the dataset's name,
    starts the line of a bad row."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise UsageError(
            f"The dataset has no column {missing} (it has {dataset.column_names}); "
            f"rename them or point {flag_hint} at the right ones."
        )
    if len(dataset) == 0:
        raise UsageError("The dataset is empty.")
    for column in columns:
        values = dataset[column]
        messages = is_conversation(values[0])
        if messages and not chat:
            raise UsageError(
                f"The column {column!r} holds chat messages ([{{'role': ..., 'content': ...}}, ...]), where this script "
                "reads text: render each conversation into a string first (tokenizer.apply_chat_template(messages, "
                "tokenize=False))."
            )
        if messages:
            check_roles(v for v in values if is_conversation(v))
        for row, value in enumerate(values):
            ok = is_conversation(value) if messages else isinstance(value, (int, float) if column in numeric else str)
            if not ok or isinstance(value, bool):
                wanted = "chat messages" if messages else "a number" if column in numeric else "text"
                raise UsageError(f"The column {column!r}, row {row}: {value!r} is not {wanted} (fix or drop that row).")
            if messages and all(m["role"] == "system" for m in value):
                raise UsageError(
                    f"The column {column!r}, row {row}: a conversation of system messages only, with nothing to train on "
                    "or answer (add a user or assistant turn, or drop that row)."
                )
            text = " ".join(m["content"] for m in value if m["role"] != "system") if messages else value
            if column in prompts and not text.strip():  # nothing to sample from: refused, never skipped silently
                raise UsageError(
                    f"{source + ': ' if source else ''}the column {column!r}, row {row}: the prompt is empty (write a "
                    "prompt or drop that row)."
                )
            if column in numeric and not math.isfinite(value):  # one NaN in a reward or margin turns every weight NaN
                raise UsageError(
                    f"The column {column!r}, row {row}: {value} is not a finite number (NaN or inf: fix or drop that row)."
                )


def answers_as_text(dataset: Dataset, column: str) -> Dataset:
    """A numeric answer column (many datasets store answers as numbers) as text, which the verifiers compare."""
    if column in dataset.column_names and getattr(dataset.features[column], "dtype", "").startswith(("int", "uint", "float")):
        return dataset.remove_columns(column).add_column(column, [str(v) for v in dataset[column]])
    return dataset


def train_eval_split(dataset: Dataset, eval_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """A seeded shuffle split; `eval_fraction` of the rows (at least one) are held out."""
    if len(dataset) < 2:
        raise UsageError(f"The dataset has {len(dataset)} row: a training row and a held-out one need at least 2.")
    splits = dataset.train_test_split(test_size=max(1, int(len(dataset) * eval_fraction)), seed=seed)
    return splits["train"], splits["test"]


def load_pipeline(name: str, seed: int = 0, **kwargs):
    """`StableDiffusionPipeline.from_pretrained(name)`, or for builtin:tiny-sd a tiny random one (seeded)."""
    if presets.is_builtin(name):
        return from_cache(presets.pipeline, builtin(name, "pipeline"), seed)
    from diffusers import StableDiffusionPipeline

    load = functools.partial(
        StableDiffusionPipeline.from_pretrained,
        safety_checker=None,
        requires_safety_checker=False,
        **({"trust_remote_code": True} if REMOTE_CODE["trusted"] else {}) | kwargs,
    )
    return located(load, name, "pipeline")


def load_function(spec: str, builtins: dict, flag: str):
    """A plug-in: a built-in by name (a function, or its "module:function"), or "package.module:function" or
    "path/to/file.py:function"; a module that fails to import is a one-line error naming the exception and your line."""
    spec = builtins.get(spec, spec)  # a built-in: the function, or where it lives ("presets.agents:calculator")
    if callable(spec):
        return spec
    if ":" not in spec:
        raise UsageError(f"{flag} {spec}: unknown; choose one of {sorted(builtins)} or give 'module:function'.")
    module_name, name = spec.rsplit(":", 1)
    if module_name.endswith(".py") and not os.path.isfile(module_name):
        raise UsageError(f"{flag} {spec}: no such file {module_name!r}.")
    try:
        if module_name.endswith(".py"):  # imported once per file, under a name of its own: its classes pickle by name
            registered = f"plugin_{os.path.basename(module_name)[:-3]}_{zlib.crc32(os.path.abspath(module_name).encode()):x}"
            module = sys.modules.get(registered)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(registered, module_name)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[registered] = module
                try:
                    module_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[registered]
                    raise
        else:
            module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - the user's code: report it, whatever it raised
        raise UsageError(f"{flag} {spec}: importing {module_name} failed: {plugin_error(error)}") from None
    if not callable(getattr(module, name, None)):
        raise UsageError(f"{flag} {spec}: {module_name} has no function {name!r}.")
    return getattr(module, name)


def plugin_error(error: BaseException) -> str:
    """An exception raised in a plug-in, in one line: its type, message and the last place outside this repository,
    the standard library and the installed packages where it happened (the user's file and line)."""
    ours = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
    frames = traceback.extract_tb(error.__traceback__)
    theirs = [f for f in frames if not (f.filename.startswith(("<", *ours)) or "-packages" in f.filename)]
    where = f" ({theirs[-1].filename}, line {theirs[-1].lineno})" if theirs else ""
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({error.filename}, line {error.lineno})"
    return f"{type(error).__name__}: {error}{where}"
