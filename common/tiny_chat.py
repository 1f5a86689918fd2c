"""The pretrained built-in models, trained here on first use and cached: what every default run starts from.

builtin:tiny-chat     GPT-2 (4 layers x 128, tied embeddings) trained as a language model on the built-in chatterbot
                      dialogue, each exchange written "utterance reply<eos>": a policy that already answers in English.
builtin:tiny-chat-rm  a reward model: tiny-chat with a one-logit score head, trained on the built-in VADER preference
                      pairs as reward_modeling.py trains one ("prompt response<eos>", Bradley-Terry loss).
builtin:tiny-arith    grpo.py's and rloo.py's default policy: tiny-chat after an SFT pass (8 epochs, 2,000 problems)
                      on reasoning-gym's chain_sum (two one-digit terms), "question answer<eos>" with the loss on the
                      answer: a warm start whose most likely answer is right on ~80% of held-out problems but whose
                      samples (temperature 1) are right on only ~40%, so that rewards differ within a group and RL on
                      the verifier's reward has something to learn.

All are built deterministically from a fixed seed (same weights on the same machine and thread count), written
atomically into the cache (~/.cache/rlhf-builtin, or $XDG_CACHE_HOME), guarded by a file lock so that concurrent
processes build once, and load with plain `from_pretrained(folder)`.
"""

import contextlib
import fcntl
import itertools
import os
import random
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

# Bump a version when its recipe changes: the cache then builds the new one beside the old
FOLDERS = {
    "builtin:tiny-chat": "tiny-chat-v1",
    "builtin:tiny-chat-rm": "tiny-chat-rm-v1",
    "builtin:tiny-arith": "tiny-arith-v2",
}
ARITH_TASK = ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1))  # grpo.py's default task
CHAT_SIZES = dict(n_positions=256, n_embd=128, n_layer=4, n_head=4, tie_word_embeddings=True)


def cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rlhf-builtin")


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive lock on `path` (created if missing) for the block: a second process waits for the first."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pretrained_folder(name: str) -> str:
    """The cached folder of a pretrained built-in model, built first if it is not there yet."""
    folder = os.path.join(cache_root(), FOLDERS[name])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        with file_lock(folder + ".lock"):
            if not os.path.isfile(os.path.join(folder, "config.json")):  # another process may have built it meanwhile
                tmp = tempfile.mkdtemp(prefix=f".tmp-{FOLDERS[name]}-", dir=cache_root())
                try:
                    start = time.time()
                    builders = {
                        "builtin:tiny-chat": build_tiny_chat,
                        "builtin:tiny-chat-rm": build_tiny_chat_rm,
                        "builtin:tiny-arith": build_tiny_arith,
                    }
                    builders[name](tmp)
                    os.chmod(tmp, 0o755)
                    shutil.rmtree(folder, ignore_errors=True)
                    os.rename(tmp, folder)
                    print(f"{name}: built in {time.time() - start:.0f}s, cached in {folder}", flush=True)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return folder


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

    from common.presets import builtin_tokenizer, chatterbot_pairs

    tokenizer = builtin_tokenizer()
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
        f"{len(stream):,} tokens of the built-in dialogue ({steps} steps, once; about 3 minutes on 2 CPU cores)",
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
    folder: str, epochs: int = 2, batch_size: int = 16, lr: float = 3e-4, max_length: int = 128, seed: int = 0
) -> None:
    """Train builtin:tiny-chat-rm into `folder`: tiny-chat with a one-logit score head on the VADER preference pairs,
    each text "prompt response<eos>" (the format reward_modeling.py trains and ppo.py scores)."""
    from transformers import AutoModelForSequenceClassification, get_scheduler

    from common.loading import reward_model_text
    from common.presets import builtin_tokenizer, vader_preferences

    tokenizer = builtin_tokenizer()
    tokenizer.truncation_side = "left"  # a long pair keeps the end of its response, as reward_modeling.py does
    base = pretrained_folder("builtin:tiny-chat")
    generator = _seeded(seed)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    rows = vader_preferences(seed)
    texts = {k: [reward_model_text(r["prompt"], r[k], tokenizer.eos_token) for r in rows] for k in ("chosen", "rejected")}
    steps = epochs * (len(rows) // batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=steps // 30, num_training_steps=steps)
    print(
        f"builtin:tiny-chat-rm: training a reward model from builtin:tiny-chat on {len(rows):,} VADER-ranked pairs "
        f"({steps} steps, once; about 30 seconds on 2 CPU cores)",
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
    _fit("builtin:tiny-chat-rm", model, batches, pair_loss, optimizer, scheduler, steps, folder, builtin_tokenizer())


def build_tiny_arith(
    folder: str, problems: int = 2000, epochs: int = 8, batch_size: int = 32, lr: float = 1e-3, seed: int = 0
) -> None:
    """Train builtin:tiny-arith into `folder`: builtin:tiny-chat fine-tuned on `problems` reasoning-gym problems of
    ARITH_TASK (generated with seed 10_000 + seed: not grpo.py's training or evaluation draws), each
    "question answer<eos>" with the loss on " answer<eos>" only, AdamW with a linear decay."""
    import reasoning_gym
    from transformers import AutoModelForCausalLM, get_scheduler

    from common.core import pad_right
    from common.presets import builtin_tokenizer

    tokenizer = builtin_tokenizer()
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
        f"({steps} steps, once; about three minutes on 2 CPU cores)",
        flush=True,
    )

    def answer_loss(indices) -> torch.Tensor:  # next-token loss on " answer<eos>" only
        ids, labels = zip(*(examples[i] for i in indices))
        input_ids = pad_right(list(ids), tokenizer.pad_token_id)
        return model(
            input_ids=input_ids,
            attention_mask=(input_ids != tokenizer.pad_token_id).long(),
            labels=pad_right(list(labels), -100),
        ).loss

    batches = (
        i
        for _ in range(epochs)
        for i in torch.randperm(len(examples), generator=generator).split(batch_size)[: steps // epochs]
    )
    _fit("builtin:tiny-arith", model, batches, answer_loss, optimizer, scheduler, steps, folder, tokenizer)
