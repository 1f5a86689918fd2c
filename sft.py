"""Supervised fine-tuning (SFT) of a causal LM: the first stage of the RLHF pipeline (TRL 0.7-0.8 `SFTTrainer`).

Trains next-token prediction on a text column (plain text, or chat messages rendered by the tokenizer's chat
template), or on prompt/completion columns with the loss on the completion only. Options: packing (best-fit
decreasing, or constant-length blocks), a completion-only loss after a response template, LoRA, NEFTune embedding
noise (Jain et al. 2023), gradient checkpointing.

Usage:
    python sft.py                                   # offline: tiny GPT-2 on the built-in chatterbot dialogue
    accelerate launch sft.py --packing --max-seq-length 128
    accelerate launch --config_file configs/multi_gpu.yaml sft.py --model-name gpt2 --dataset-name data.jsonl
"""

import bisect
import collections
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_scheduler

from common.chat import as_messages, is_conversation, render, text_of, use_chat, use_tool_template
from common.checkpoints import full_weights, load_checkpoint, save_checkpoint
from common.cli import cli
from common.core import UsageError, adamw, check_adam, check_args, logprobs_from_logits, pad_right, plain
from common.fast_paths import chunkable_head, lm_token_logprobs
from common.loading import (
    check_columns,
    context_length,
    load_config,
    load_data,
    load_pretrained,
    load_tokenizer,
    quantization_kwargs,
    train_eval_split,
)
from common.models import check_lora_targets, peft_model_of
from common.outputs import atomic_directory, check_finite, write_model_card
from common.run import end_run, rank_batches, start_run


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (each rank adds its index)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    track: bool = False
    """if toggled, the run is tracked with Weights and Biases (synced from TensorBoard)"""
    wandb_project_name: str = "rlhf"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    log_dir: str = "runs"
    """TensorBoard logs go to {log_dir}/{run_name}"""

    # Model and data
    model_name: str = "builtin:tiny-gpt2"
    """a hub id, a local folder, or builtin:tiny-gpt2"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype of every model of the run: float32 as TRL (weights that train need it; mixed precision comes from
    `accelerate launch --mixed_precision bf16`), bfloat16 for frozen weights, auto for each checkpoint's own"""
    dataset_name: str = "builtin:chatterbot-dialogue"
    """a hub id, a local json/jsonl/csv/parquet file, or builtin:chatterbot-dialogue"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    text_column: str = "text"
    """the column to train on when prompt_column is None: plain text, or whole conversations as chat messages (TRL's
    conversational format; a "messages" column is found without it), rendered by the tokenizer's chat template"""
    prompt_column: str | None = None
    """with completion_column: train on prompt + completion, the loss on the completion tokens only"""
    completion_column: str = "completion"
    """the completion column (with prompt_column)"""
    chat_template: bool = True
    """render string prompt / completion pairs as a user and an assistant message with the tokenizer's chat template,
    when it has one (messages always are); --no-chat-template: raw text, as TRL does with string pairs"""
    system_prompt: str | None = None
    """a system message put before every chat prompt that has none (None: the template's default, if any)"""
    chat_template_path: str | None = None
    """a Jinja chat template file to render the data with (saved with the model); None: the tokenizer's own, or for
    messages with tool calls that it cannot render, common.chat.TOOL_TEMPLATE on ChatML models such as SmolLM2"""
    assistant_only_loss: bool = False
    """messages data: the loss on the assistant turns only, each with its end-of-turn token (TRL 1.x)"""
    response_template: str | None = None
    """completion-only loss on text: tokens up to and including this string get no loss (TRL
    DataCollatorForCompletionOnlyLM); examples without it are dropped with a warning"""
    max_seq_length: int = 128
    """longer examples are truncated; with packing, the length of every block"""
    packing: bool = False
    """pack the examples into rows of at most max_seq_length tokens (see --packing-strategy)"""
    packing_strategy: Literal["bfd", "wrapped"] = "bfd"
    """bfd: whole examples, best-fit decreasing, each attending only to itself, any loss (TRL 1.16's default);
    wrapped: EOS-separated texts cut into full blocks (ConstantLengthDataset), whole texts only"""
    eval_fraction: float = 0.05
    """fraction of the examples held out for evaluation"""

    # Optimisation
    loss_type: Literal["nll", "dft"] = "nll"
    """nll: the mean next-token negative log-likelihood; dft: each token's NLL scaled by its own probability, detached
    (Dynamic Fine-Tuning, Wu et al. 2025; TRL 1.16's loss_type). The eval loss stays the NLL"""
    learning_rate: float = 1e-3
    """peak learning rate (high because the default model is tiny and random; ~2e-5 for a pretrained model)"""
    lr_scheduler_type: str = "cosine"
    """a transformers scheduler name (linear, cosine, constant_with_warmup, ...)"""
    warmup_ratio: float = 0.03
    """fraction of the steps spent warming up"""
    weight_decay: float = 0.0
    """AdamW weight decay, on the weight matrices only: biases and norm weights are not decayed (as TRL)"""
    adam_beta1: float = 0.9
    """AdamW's beta1 (TRL's default)"""
    adam_beta2: float = 0.999
    """AdamW's beta2 (TRL's default)"""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon (TRL's default)"""
    batch_size: int = 16
    """examples per forward/backward pass on each process"""
    gradient_accumulation_steps: int = 1
    """forward/backward passes per optimizer step"""
    num_epochs: int = 1
    """passes over the training set"""
    max_steps: int = -1
    """optimizer steps to run (overrides num_epochs when > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    neftune_noise_alpha: float | None = None
    """NEFTune: add uniform noise of scale alpha / sqrt(seq_len * hidden) to the input embeddings in training"""
    gradient_checkpointing: bool = False
    """trade compute for memory"""
    chunked_loss: bool = True
    """the loss from the last hidden states with the LM head run on 1024 tokens at a time (common/fast_paths.py: no
    [batch, length, vocab] logits); off, and under FSDP / DeepSpeed or with logit soft-capping: `model(**batch).loss`"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (and at the end)"""
    save_steps: int = 0
    """write a resumable checkpoint every this many optimizer steps (0: only the final model); it holds the model in
    from_pretrained format (with LoRA: the adapter) and accelerate's state"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from"""
    output_dir: str = "outputs/sft"
    """where the final model and tokenizer go (plain from_pretrained format)"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""
    num_sample_generations: int = 4
    """held-out prompts to generate from at the end"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters (merged into the saved model)"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""
    lora_dropout: float = 0.05
    """LoRA dropout"""
    lora_target_modules: list[str] | None = None
    """modules to adapt (None: peft's default for the architecture)"""
    load_in_8bit: bool = False
    """load the base model in 8 bits (bitsandbytes, CUDA only) and train LoRA adapters on it; needs --use-peft"""
    load_in_4bit: bool = False
    """load the base model in 4 bits (NF4, bf16 compute; bitsandbytes, CUDA only); needs --use-peft"""


def pack_sequences(token_lists: list[list[int]], seq_length: int, eos_token_id: int) -> list[list[int]]:
    """Concatenate the texts, each followed by EOS, and cut the stream into full blocks of `seq_length`.

    As TRL's ConstantLengthDataset: the incomplete tail block is dropped, texts may span two blocks.
    """
    stream = [token for tokens in token_lists for token in (*tokens, eos_token_id)]
    return [stream[i : i + seq_length] for i in range(0, len(stream) - seq_length + 1, seq_length)]


def pack_bfd(examples: list[dict], seq_length: int) -> list[dict]:
    """Best-fit decreasing (TRL 1.16's packing_strategy="bfd"): the examples (each at most seq_length tokens), longest
    first, each into the row with the least room left that holds it (of equals, the one that came to that room first),
    or a new row. A row keeps each example's labels, less the first label of each after the first (no token is
    predicted across examples), and positions that restart at 0 with each example: attention stays within it."""
    rows, rooms, waiting = [], [], collections.defaultdict(collections.deque)  # rooms: sorted; waiting: rows by room
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i]["input_ids"])):  # stable, as TRL's sort
        ids, labels = examples[i]["input_ids"], examples[i]["labels"]
        k = bisect.bisect_left(rooms, len(ids))  # the least room that holds the example
        if k < len(rooms):
            room, row = rooms[k], waiting[rooms[k]].popleft()
            if not waiting[room]:
                rooms.pop(k)
        else:
            room, row = seq_length, dict(input_ids=[], labels=[], position_ids=[])
            rows.append(row)
        row["labels"] += ([-100] + labels[1:]) if row["input_ids"] else labels
        row["input_ids"] += ids
        row["position_ids"] += list(range(len(ids)))
        if (left := room - len(ids)) > 0:
            if not waiting[left]:
                bisect.insort(rooms, left)
            waiting[left].append(row)
    return rows


def model_inputs(batch: dict) -> dict:
    """The forward's inputs: packed rows (bfd) pass their position ids, no mask and no cache, so that transformers
    attends within each example (it reads the examples off the positions only then); others the padding mask."""
    if "position_ids" in batch:
        return dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    return dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def completion_only_labels(input_ids: list[int], response_template_ids: list[int]) -> list[int] | None:
    """Labels with -100 on every token up to and including the first response template; None if it is absent."""
    n = len(response_template_ids)
    for start in range(len(input_ids) - n + 1):
        if input_ids[start : start + n] == response_template_ids:
            return [-100] * (start + n) + input_ids[start + n :]
    return None


def neftune_hook(alpha: float):
    """Forward hook for the input embeddings: uniform noise of magnitude alpha / sqrt(L * d) (NEFTune, eq. 1)."""

    def hook(module, inputs, output):
        if module.training:
            magnitude = alpha / math.sqrt(output.shape[1] * output.shape[2])
            output = output + torch.zeros_like(output).uniform_(-magnitude, magnitude)
        return output

    return hook


def render_conversation(tokenizer, messages: list[dict], system_prompt: str | None = None, tools=None) -> str:
    """A whole conversation rendered (with the `tools` schemas), ending with the end-of-turn token (EOS appended where
    the template ends the turn with another token)."""
    messages = as_messages(messages, "user", system_prompt)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False).rstrip()
    return text if not tokenizer.eos_token or text.endswith(tokenizer.eos_token) else text + tokenizer.eos_token


def conversation_pieces(
    tokenizer, messages: list[dict], system_prompt: str | None = None, tools=None
) -> list[tuple[str, bool]]:
    """A whole conversation rendered as consecutive (text, is_assistant) pieces: each assistant turn is the answer that
    continues the conversation before it (`render`), the rest is what the template puts around them. Their
    concatenation is the rendered conversation (checked); TRL's --assistant-only-loss trains on the assistant pieces."""
    messages, pieces, done = as_messages(messages, "user", system_prompt), [], ""
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and i > 0:
            prompt_text, answer_text = render(tokenizer, messages[:i], [message], tools=tools)
            if not (prompt_text.startswith(done) and full.startswith(prompt_text + answer_text)):
                raise UsageError(
                    "the chat template renders the conversation differently from its turns one by one: "
                    "drop --assistant-only-loss"
                )
            pieces += [(prompt_text[len(done) :], False), (answer_text, True)]
            done = prompt_text + answer_text
    return [(text, flag) for text, flag in pieces + [(full[len(done) :].rstrip(), False)] if text]


def row_tools(row: dict) -> list[dict] | None:
    """A row's tool schemas (TRL's `tools` column: JSON schemas, or their JSON text), for the chat template."""
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def tokenize_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Token ids of rendered pieces, each tokenised alone (the template's text already holds its special tokens), and
    which of them belong to a piece marked True."""
    ids, flags = [], []
    for text, flag in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, flags = ids + piece, flags + [flag] * len(piece)
    return ids, flags


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_args(
        args,
        positive="save_total_limit learning_rate batch_size gradient_accumulation_steps num_epochs eval_steps max_grad_norm",
        non_negative="weight_decay save_steps num_sample_generations neftune_noise_alpha",
        fractions="eval_fraction",
    )
    if args.max_seq_length < 2 or not 0 <= args.warmup_ratio < 1:
        raise UsageError(
            f"--max-seq-length {args.max_seq_length}, --warmup-ratio {args.warmup_ratio}: a sequence needs "
            "at least 2 tokens (one to predict from, one to predict), the warmup ratio lies in [0, 1)."
        )
    if args.packing and args.packing_strategy == "wrapped" and (args.prompt_column or args.response_template):
        raise UsageError(
            "--packing-strategy wrapped trains on whole texts: for a completion-only loss use --packing-strategy bfd."
        )


@dataclass
class Data:
    """The tokenised examples (input_ids and labels, -100 where no loss is taken) and what the samples at the end need:
    the held-out rows, their text column, whether they are conversations, whether the chat template renders them."""

    train: list[dict]
    eval: list[dict]
    eval_rows: object
    text_column: str
    conversations: bool
    chat: bool


def load_examples(args: Args, accelerator: Accelerator, tokenizer) -> Data:
    """The dataset, checked, split, tokenised (chats rendered as common/chat.py says) and labelled, or packed."""
    dataset = load_data(args.dataset_name, args.dataset_split)
    text_column = args.text_column
    if not args.prompt_column and text_column not in dataset.column_names and "messages" in dataset.column_names:
        text_column = "messages"  # TRL's conversational language-modelling column
    columns = [args.prompt_column, args.completion_column] if args.prompt_column else [text_column]
    check_columns(dataset, columns, "--text-column / --prompt-column / --completion-column")
    context = context_length(load_config(args.model_name))
    if context and args.max_seq_length > context:
        raise UsageError(f"max_seq_length={args.max_seq_length} exceeds the model's context of {context} tokens.")
    conversations = not args.prompt_column and is_conversation(dataset[0][text_column])
    chat = use_chat(tokenizer, args.chat_template, [dataset[0][c] for c in columns], args.system_prompt) and (
        conversations or args.prompt_column
    )
    if args.assistant_only_loss and not conversations:
        raise UsageError("--assistant-only-loss trains on the assistant turns of a messages column: this data has none.")
    calls = conversations and any(m["role"] == "tool" or m.get("tool_calls") for m in dataset[0][text_column])
    if chat and (args.chat_template_path or calls or "tools" in dataset.column_names):
        accelerator.print(f"chat template: {use_tool_template(tokenizer, args.chat_template_path)}")
    train_dataset, eval_dataset = train_eval_split(dataset, args.eval_fraction, args.seed)
    if args.packing and args.packing_strategy == "wrapped":  # whole texts, untruncated: a text may span two blocks
        train, eval_ = (pack(args, tokenizer, split, text_column, conversations) for split in (train_dataset, eval_dataset))
    else:
        train, eval_ = (
            tokenize(args, tokenizer, split, text_column, conversations, chat) for split in (train_dataset, eval_dataset)
        )
        if len(train) < len(train_dataset):
            accelerator.print(
                f"warning: {len(train_dataset) - len(train)} training examples dropped "
                "(no response template, or nothing left to learn after truncation)"
            )
        if args.packing:  # bfd: whole examples, as tokenised (and truncated) above, side by side in rows
            train, eval_ = pack_bfd(train, args.max_seq_length), pack_bfd(eval_, args.max_seq_length)
    if not train or not eval_:
        raise UsageError(
            f"Nothing to train or evaluate on ({len(train)} train / {len(eval_)} eval "
            "examples): use more data, a larger --max-seq-length (prompts that fill it leave no completion "
            "to learn), a smaller one with --packing, or a larger --eval-fraction."
        )
    return Data(train, eval_, eval_dataset, text_column, conversations, chat)


def tokenize(args: Args, tokenizer, split, text_column: str, conversations: bool, chat: bool) -> list[dict]:
    """Each example -> input_ids and labels (-100 where no loss is taken); chats rendered as common/chat.py says."""
    template_ids = tokenizer(args.response_template, add_special_tokens=False)["input_ids"] if args.response_template else None
    examples = []
    for row in split:
        if args.prompt_column:
            if chat:  # the rendered answer continues the rendered prompt, its end-of-turn token (EOS) included
                texts = render(tokenizer, row[args.prompt_column], row[args.completion_column], args.system_prompt)
                prompt, completion = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts)
            else:
                prompt = tokenizer(row[args.prompt_column])["input_ids"]
                completion = tokenizer(row[args.completion_column])["input_ids"] + [tokenizer.eos_token_id]
            ids = (prompt + completion)[: args.max_seq_length]
            labels = ([-100] * len(prompt) + completion)[: args.max_seq_length]
        elif conversations and args.assistant_only_loss:  # the loss on the assistant turns only (TRL 1.x)
            pieces = conversation_pieces(tokenizer, row[text_column], args.system_prompt, row_tools(row))
            ids, assistant = (x[: args.max_seq_length] for x in tokenize_pieces(tokenizer, pieces))
            labels = [i if a else -100 for i, a in zip(ids, assistant)]
        elif conversations:  # a whole conversation, rendered, ending with its end-of-turn token (EOS)
            text = render_conversation(tokenizer, row[text_column], args.system_prompt, row_tools(row))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.max_seq_length]
            labels = completion_only_labels(ids, template_ids) if template_ids else list(ids)
        else:
            ids = (tokenizer(row[text_column])["input_ids"] + [tokenizer.eos_token_id])[: args.max_seq_length]
            labels = completion_only_labels(ids, template_ids) if template_ids else list(ids)
        if labels is not None and any(label != -100 for label in labels):
            examples.append(dict(input_ids=ids, labels=labels))
    return examples


def pack(args: Args, tokenizer, split, text_column: str, conversations: bool) -> list[dict]:
    """Whole texts packed into blocks of --max-seq-length (each conversation's closing EOS is the separator
    pack_sequences puts after every text)."""
    if conversations:
        texts = [render_conversation(tokenizer, r[text_column], args.system_prompt, row_tools(r)) for r in split]
        token_lists = [
            ids[:-1] if ids[-1:] == [tokenizer.eos_token_id] else ids
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
        ]
    else:
        token_lists = tokenizer(list(split[text_column]))["input_ids"]
    return [dict(input_ids=b, labels=b) for b in pack_sequences(token_lists, args.max_seq_length, tokenizer.eos_token_id)]


class Batches:
    """Right-padded batches of examples (labels padded with -100), on the run's device; a rank's micro-batch of a step
    from a seeded reshuffle per epoch, so that a resume continues exactly."""

    def __init__(self, args: Args, accelerator: Accelerator, tokenizer, steps_per_epoch: int):
        self.args, self.accelerator, self.tokenizer, self.steps_per_epoch = args, accelerator, tokenizer, steps_per_epoch

    def collate(self, batch: list[dict]) -> dict:
        device, pad = self.accelerator.device, self.tokenizer.pad_token_id
        out = dict(
            input_ids=pad_right([e["input_ids"] for e in batch], pad).to(device),
            attention_mask=pad_right([[1] * len(e["input_ids"]) for e in batch], 0).to(device),
            labels=pad_right([e["labels"] for e in batch], -100).to(device),
        )
        if "position_ids" in batch[0]:  # bfd rows: each example's positions from 0
            out["position_ids"] = pad_right([e["position_ids"] for e in batch], 0).to(device)
        return out

    def micro_batch(self, examples: list[dict], step: int) -> dict:
        args, accelerator = self.args, self.accelerator
        epoch, i = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(args.seed + epoch))
        start = (i * accelerator.num_processes + accelerator.process_index) * args.batch_size
        return self.collate([examples[j] for j in order[start : start + args.batch_size].tolist()])


def load_model(args: Args, accelerator: Accelerator, quantization: dict, total_steps: int):
    """The model (LoRA with --use-peft, NEFTune's hook with its flag) prepared with its AdamW optimizer and schedule."""
    model = load_pretrained(args.model_name, AutoModelForCausalLM, dtype=args.dtype, **quantization)
    if args.gradient_checkpointing:  # activations recomputed in the backward (older transformers: gradient_checkpointing_*)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if quantization:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    if args.use_peft:
        check_lora_targets(model, args.lora_target_modules)
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    if args.neftune_noise_alpha:
        model.get_input_embeddings().register_forward_hook(neftune_hook(args.neftune_noise_alpha))
    optimizer = adamw(args, model)
    ticks = accelerator.num_processes  # accelerate's prepared scheduler steps once per process per optimizer step
    warmup = int(args.warmup_ratio * total_steps) * ticks
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps * ticks
    )
    return accelerator.prepare(model, optimizer, scheduler)


def token_loss(logprobs: torch.Tensor, mask: torch.Tensor, loss_type: str = "nll") -> torch.Tensor:
    """The mean over the labelled tokens of -log p (nll), or of -sg(p) log p (dft: Wu et al. 2025, "On the
    Generalization of SFT", eq. 8; TRL 1.16 SFTTrainer.compute_loss), whose gradient -p grad log p = -grad p weighs
    each token by its own probability, as an on-policy gradient would. logprobs, mask: [B, T]."""
    per_token = -logprobs
    if loss_type == "dft":
        per_token = per_token * logprobs.exp().detach()
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def lm_loss(model, head, accelerator: Accelerator, batch: dict, loss_type: str = "nll") -> torch.Tensor:
    """`token_loss` over the labelled tokens (the model's own loss for nll without the chunked head)."""
    if head is None and loss_type == "nll":
        return model(**model_inputs(batch), labels=batch["labels"]).loss
    if head is None:
        logits = model(**model_inputs(batch)).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        logprobs = logprobs_from_logits(logits, labels.clamp(min=0)) * mask
    else:
        with accelerator.autocast():  # the head runs outside the model's forward, which prepare wraps in autocast
            logprobs, mask, _ = lm_token_logprobs(model, head, model_inputs(batch), batch["labels"])
    return token_loss(logprobs, mask, loss_type)


@torch.no_grad()
def evaluate(args: Args, model, head, accelerator: Accelerator, data: Data, batches: Batches, logger, step: int) -> float:
    """Token-weighted eval loss over all ranks, and perplexity."""
    model.eval()
    total_loss, total_tokens = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    for chunk, weight in rank_batches(data.eval, args.batch_size, accelerator):  # as many on every rank
        batch = batches.collate(chunk)
        n_tokens = (batch["labels"][:, 1:] != -100).sum() * weight
        total_loss += lm_loss(model, head, accelerator, batch) * n_tokens
        total_tokens += n_tokens
    loss = (accelerator.reduce(total_loss, "sum") / accelerator.reduce(total_tokens, "sum")).item()
    logger.log({"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50))}, step)
    model.train()
    return loss


def save_and_sample(args: Args, accelerator: Accelerator, model, tokenizer, data: Data, logger, loss: float, step: int):
    """The model in plain from_pretrained format (LoRA merged) with its tokenizer and model card, written atomically;
    then a table of sampled continuations of held-out prompts."""
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if peft_model_of(unwrapped) is not None:
        unwrapped = unwrapped.merge_and_unload()
    weights = full_weights(accelerator, model)  # gathered on the main process when sharded (every rank calls it)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_directory(args.output_dir) as tmp:
            unwrapped.save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            write_model_card(tmp, args, "sft", {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50))})
    if not (accelerator.is_main_process or sharded) or args.num_sample_generations <= 0:  # sharded: every rank decodes
        return
    rows = data.eval_rows.select(range(min(args.num_sample_generations, len(data.eval_rows))))
    if data.conversations:  # the conversation up to its last assistant turn, ready for the assistant's answer
        prompts = [
            m[: max([i for i, x in enumerate(m) if x["role"] == "assistant"] or [len(m)])] for m in rows[data.text_column]
        ]
    elif args.prompt_column:
        prompts = list(rows[args.prompt_column])
    else:
        template = args.response_template
        prompts = [t.split(template)[0] + template if template else " ".join(t.split()[:4]) for t in rows[data.text_column]]
    tools = [row_tools(r) for r in rows]
    chat = data.chat
    texts = [render(tokenizer, p, None, args.system_prompt, t)[0] for p, t in zip(prompts, tools)] if chat else prompts
    keep = max(1, args.max_seq_length - 24)  # a prompt's last tokens, so that 24 new ones fit in max_seq_length
    ids = [i[-keep:] for i in tokenizer(texts, add_special_tokens=not chat)["input_ids"]]
    batch = tokenizer.pad({"input_ids": ids}, padding_side="left", return_tensors="pt").to(accelerator.device)
    unwrapped.eval()
    with torch.no_grad():
        out = unwrapped.generate(
            **batch, max_new_tokens=24, do_sample=True, top_k=50, pad_token_id=tokenizer.pad_token_id, synced_gpus=sharded
        )
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    shown = [text_of(p) if isinstance(p, list) else p for p in prompts]
    logger.samples("samples", {"prompt": shown, "completion": completions}, step)


def main(args: Args) -> None:
    """Setup, then the loop, then the final evaluation, save and summary."""
    check(args)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    quantization = quantization_kwargs(args.model_name, args.load_in_8bit, args.load_in_4bit, args.use_peft)
    run_name, logger = start_run(args, accelerator)
    tokenizer = load_tokenizer(args.model_name, padding_side="right")
    data = load_examples(args, accelerator, tokenizer)  # checked before any model is built or loaded
    examples_per_step = args.batch_size * accelerator.num_processes
    steps_per_epoch = len(data.train) // examples_per_step
    # micro-batches run on across epoch boundaries, so accumulation need not divide an epoch
    epoch_steps = steps_per_epoch * args.num_epochs // args.gradient_accumulation_steps
    total_steps = args.max_steps if args.max_steps > 0 else epoch_steps
    if total_steps == 0 or steps_per_epoch == 0:  # fewer examples than one batch: no epoch to draw from
        raise UsageError(
            f"{len(data.train)} training examples make no optimizer step of {examples_per_step} x "
            f"{args.gradient_accumulation_steps} examples: lower --batch-size or --gradient-accumulation-steps."
        )
    batches = Batches(args, accelerator, tokenizer, steps_per_epoch)
    model, optimizer, scheduler = load_model(args, accelerator, quantization, total_steps)
    accelerator.print(
        f"{len(data.train)} training / {len(data.eval)} eval examples; {total_steps} optimizer steps "
        f"of {examples_per_step * args.gradient_accumulation_steps} examples; each epoch reshuffles and "
        f"leaves out {len(data.train) % examples_per_step} examples"
    )
    start_step, resumed = 0, {}
    if args.resume_from:
        resumed = load_checkpoint(accelerator, args.resume_from)
        start_step = resumed["step"]
        if start_step >= total_steps:
            raise UsageError(
                f"--resume-from {args.resume_from}: the checkpoint is at step {start_step}, and this run has "
                f"{total_steps}: raise --max-steps or --num-epochs to train further."
            )
        accelerator.print(f"resumed from {args.resume_from} at step {start_step}")
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    head = chunkable_head(accelerator.unwrap_model(model), sharded) if args.chunked_loss else None
    first_eval_loss, start_time = evaluate(args, model, head, accelerator, data, batches, logger, start_step), time.time()
    first_eval_loss = resumed.get("first_eval", first_eval_loss)  # after a resume the summary compares with the start
    model.train()
    progress = tqdm(range(start_step, total_steps), disable=not accelerator.is_local_main_process, desc="sft")
    for step in progress:
        step_start, step_tokens = time.time(), 0
        # 1. accumulate the mean next-token loss over the step's micro-batches, then one optimizer step
        for micro in range(args.gradient_accumulation_steps):
            batch = batches.micro_batch(data.train, step * args.gradient_accumulation_steps + micro)
            step_tokens += batch["attention_mask"].sum()
            tokens = (batch["labels"][:, 1:] != -100).sum()  # the loss is the mean over the global batch's tokens:
            share = tokens * accelerator.num_processes / accelerator.reduce(tokens, "sum")  # a rank weighs its share
            with accelerator.accumulate(model):
                loss = lm_loss(model, head, accelerator, batch, args.loss_type) * share
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

        # 2. bookkeeping: one collective and one device sync (mean loss, mean tokens per rank, the gradient norm)
        norm = torch.as_tensor(plain(grad_norm) if grad_norm is not None else 0.0).float().to(loss.device)
        train_loss, tokens, grad_norm = accelerator.reduce(
            torch.stack([loss.detach().float(), step_tokens.float(), norm]), "mean"
        ).tolist()
        check_finite(step + 1, {"train/loss": train_loss, "train/grad_norm": grad_norm})
        progress.set_postfix(loss=f"{train_loss:.3f}")
        step_time = time.time() - step_start
        logger.log(
            {
                "train/loss": train_loss,
                "train/learning_rate": scheduler.get_last_lr()[0],
                "train/grad_norm": grad_norm,
                "train/epoch": (step + 1) * args.gradient_accumulation_steps / steps_per_epoch,
                "time/step": step_time,
                "throughput/tokens_per_s": tokens * accelerator.num_processes / step_time,
            },
            step + 1,
        )
        if (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            evaluate(args, model, head, accelerator, data, batches, logger, step + 1)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"step_{step + 1}")
            state = {"step": step + 1, "first_eval": first_eval_loss}
            policy = accelerator.unwrap_model(model, keep_torch_compile=False)
            save_checkpoint(accelerator, folder, state, policy, tokenizer, total_limit=args.save_total_limit)

    # 3. the final evaluation, save (plain from_pretrained format; LoRA merged), samples and summary
    last_eval_loss = evaluate(args, model, head, accelerator, data, batches, logger, total_steps)
    save_and_sample(args, accelerator, model, tokenizer, data, logger, last_eval_loss, total_steps)
    accelerator.print(
        f"sft: {total_steps - start_step} steps in {time.time() - start_time:.0f}s; eval loss "
        f"{first_eval_loss:.3f} -> {last_eval_loss:.3f} (perplexity {math.exp(min(last_eval_loss, 50)):.1f}); "
        f"model saved to {args.output_dir}"
    )
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
