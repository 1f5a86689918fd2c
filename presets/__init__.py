"""The offline built-ins: every `--model-name` / `--dataset-name` / `--pretrained-model` that starts with "builtin:".

common/loading.py reaches this package at one point, when it resolves a `builtin:` name; every other name goes through
the normal `from_pretrained` / `load_dataset` path. A fork that never runs offline deletes this folder and that branch.

Models, pretrained on first use and cached (presets/pretrained.py): builtin:tiny-chat, builtin:tiny-chat-rm,
builtin:tiny-arith, builtin:smollm2-135m-instruct. Random, built from configs in a second (presets/tiny.py):
builtin:tiny-gpt2, builtin:tiny-t5, builtin:tiny-sd. Data (presets/data.py): builtin:chatterbot-prompts,
builtin:chatterbot-dialogue, builtin:vader-preferences, builtin:chatterbot-mixed-replies.

Unknown names raise KeyError, which the loaders report as a one-line usage error.
"""

from presets import cache, data, pretrained, tiny


def is_builtin(name: str) -> bool:
    return name.startswith("builtin:")


def is_random(name: str) -> bool:
    """A built-in model with random weights (tiny-gpt2, tiny-t5), as opposed to a pretrained one (tiny-chat)."""
    return is_builtin(name) and name not in pretrained.FOLDERS


def folder(name: str) -> str:
    """The folder of a pretrained built-in model, built and cached on first use."""
    return pretrained.pretrained_folder(name)


def tokenizer(name: str):
    """A built-in model's tokenizer: SmolLM2's own (from its folder), else the one every other built-in model shares
    (GPT-2's cut to the built-in texts' tokens, with a distinct pad token; cached on its own, no model built)."""
    if name in pretrained.FOLDERS and name not in pretrained.CHAT_MODELS:
        return cache.loaded_tokenizer(folder(name))
    return tiny.chat_tokenizer()


config = tiny.config  # the config of a random built-in model
random_model = tiny.random_model  # a random built-in model through an auto class, seeded
dataset = data.dataset  # a built-in dataset


def pipeline(name: str, seed: int = 0):
    """builtin:tiny-sd, a tiny random Stable Diffusion pipeline (seeded)."""
    if name != "builtin:tiny-sd":
        raise KeyError(f"Unknown built-in pipeline {name!r}: choose builtin:tiny-sd.")
    return tiny.tiny_sd_pipeline(seed)


MODELS = (*pretrained.FOLDERS, *tiny.MODELS)
