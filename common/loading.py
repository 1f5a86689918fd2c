"""Loading by name: models, tokenizers, datasets and Stable Diffusion pipelines from a hub id, a local path or an
offline built-in (`builtin:` names, resolved by `builtin` below: the one door to presets/), each anticipated failure a
one-line error; and the checks every script runs on the data it loaded (columns, value kinds, the held-out split).
"""

import json
import os
from functools import partial

import torch
from datasets import Dataset, load_dataset
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

import presets
from common.chat import as_messages, is_conversation, render, text_of, use_chat
from common.core import UsageError

DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


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
    return presets.folder(builtin(name)) if presets.is_builtin(name) and not is_random_builtin(name) else name


def located(load, name: str, what: str):
    """`load(name)`; a local path that does not exist, a folder without `config.json`, or a hub id that cannot be reached
    from here is a one-line error naming which of them it is."""
    if what == "model" and os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise UsageError(f"no config.json in the folder {name!r}: it holds no saved model (save_pretrained writes one)")
    try:
        return load(name)
    except (OSError, ConnectionError) as error:  # transformers and datasets raise these for a missing repo or file
        if os.path.exists(name):
            raise
        raise UsageError(
            f"{what} {name!r}: no such file or folder here, nor a hub id that can be reached from here "
            f"({type(error).__name__}; HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')})"
        ) from error


def load_config(name: str):
    """The config of a built-in preset, hub id or local folder."""
    return presets.config(name) if is_random_builtin(name) else located(AutoConfig.from_pretrained, resolve(name), "model")


def context_length(config) -> int | None:
    """The most positions a model reads (max_position_embeddings, GPT-2's n_positions), or None where positions are
    relative (T5) or absent (ALiBi)."""
    return getattr(config.get_text_config(), "max_position_embeddings", None) if config is not None else None


def load_pretrained(name: str, auto_class, seed: int = 0, dtype: str | torch.dtype = "float32", **kwargs):
    """`auto_class.from_pretrained(name)` with its weights in `dtype` (float32 by default, as TRL trains; "auto": the
    checkpoint's, README "weight dtype"), or for a random built-in name a tiny model initialised with `seed`."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    if is_random_builtin(name):
        return presets.random_model(name, auto_class, seed, dtype=torch.float32 if dtype == "auto" else dtype, **kwargs)
    # (model, info) with output_loading_info=True
    loaded = located(lambda n: auto_class.from_pretrained(n, dtype=dtype, **kwargs), resolve(name), "model")
    if presets.is_builtin(name):  # peft records it as the adapter's base model
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
        tokenizer = presets.tokenizer(builtin(name))
    else:
        tokenizer = located(AutoTokenizer.from_pretrained, name, "tokenizer")
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
        return presets.dataset(builtin(name, "dataset"), seed)
    extension = os.path.splitext(name)[1].lower()
    if extension in DATA_FILE_TYPES and not os.path.exists(name):
        raise UsageError(f"the dataset file {name!r}: no such file (from {os.getcwd()})")
    if os.path.isfile(name):
        if os.path.getsize(name) == 0:
            raise UsageError(f"The dataset file {name!r} is empty.")
        if extension not in DATA_FILE_TYPES:
            raise UsageError(f"Cannot read {name!r}: use a {', '.join(DATA_FILE_TYPES)} file.")
        try:
            return load_dataset(DATA_FILE_TYPES[extension], data_files=name, split="train")
        except Exception:  # a corrupt line: name it rather than the parser's internals
            if extension in (".json", ".jsonl"):
                with open(name) as f:
                    for number, line in enumerate(f, 1):
                        try:
                            line.strip() and json.loads(line)
                        except json.JSONDecodeError as bad:
                            text = line.strip()[:80]
                            raise UsageError(f"{name}, line {number}: not valid JSON ({bad.msg}): {text!r}") from None
            raise
    return located(lambda n: load_dataset(n, split=split), name, "dataset")


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
    dataset: Dataset, columns: list[str], flag_hint: str = "the --*-column arguments", numeric: tuple = (), chat: bool = True
) -> None:
    """A clear error naming the missing columns and the ones the dataset has, or a value of the wrong kind with its column
    and row: the `numeric` columns hold numbers, the others text, or (with `chat`) chat messages in every row."""
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
        for row, value in enumerate(values):
            ok = is_conversation(value) if messages else isinstance(value, (int, float) if column in numeric else str)
            if not ok or isinstance(value, bool):
                wanted = "chat messages" if messages else "a number" if column in numeric else "text"
                raise UsageError(f"The column {column!r}, row {row}: {value!r} is not {wanted} (fix or drop that row).")


def train_eval_split(dataset: Dataset, eval_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """A seeded shuffle split; `eval_fraction` of the rows (at least one) are held out."""
    if len(dataset) < 2:
        raise UsageError(f"The dataset has {len(dataset)} row: a training row and a held-out one need at least 2.")
    splits = dataset.train_test_split(test_size=max(1, int(len(dataset) * eval_fraction)), seed=seed)
    return splits["train"], splits["test"]


def load_pipeline(name: str, seed: int = 0, **kwargs):
    """`StableDiffusionPipeline.from_pretrained(name)`, or for builtin:tiny-sd a tiny random one (seeded)."""
    if presets.is_builtin(name):
        return presets.pipeline(builtin(name, "pipeline"), seed)
    from diffusers import StableDiffusionPipeline

    load = partial(StableDiffusionPipeline.from_pretrained, safety_checker=None, requires_safety_checker=False, **kwargs)
    return located(load, name, "pipeline")
