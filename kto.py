"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024), in TRL 1.16 KTOTrainer semantics: preference learning from
unpaired feedback, a prompt, one completion and a label (desirable or not), as thumbs up / down give it.

No pairs and no reward model: each completion's implicit reward r = log pi(y|x) - log pi_ref(y|x) is pushed above the
reference point z0 when the completion is desirable and below it when not, through a sigmoid value function (eq. 7-8).
z0 is the policy's KL to the reference, estimated on each batch from mismatched pairs (x_i, y_{i-1}) and not
back-propagated. Paired data (prompt, chosen, rejected) is unpaired first, as TRL does: chosen desirable, rejected not.

Usage:
    python kto.py                                   # offline: builtin:tiny-chat on the built-in VADER pairs, unpaired
    accelerate launch kto.py --dataset-name feedback.jsonl --undesirable-weight 1.33
    python kto.py --loss-type apo_zero_unpaired     # APO-zero, unpaired (no reference point)
    accelerate launch --config_file configs/multi_gpu.yaml kto.py --model-name outputs/sft --use-peft
"""

import gc
import json
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_scheduler

from common.chat import render, text_of, use_chat
from common.checkpoints import load_checkpoint, save_checkpoint, save_policy
from common.cli import cli
from common.core import (
    UsageError,
    adamw,
    check_adam,
    check_args,
    epoch_rows,
    logprobs_from_logits,
    pad_right,
    plain,
    pooled,
)
from common.fast_paths import chunkable_head, lm_token_logprobs
from common.loading import (
    check_columns,
    context_length,
    load_config,
    load_data,
    load_pretrained,
    load_tokenizer,
    quantization_kwargs,
)
from common.models import (
    check_lora_targets,
    create_reference_model,
    disable_dropout,
    place_frozen,
    reference_context,
    sync_reference,
)
from common.outputs import check_finite
from common.run import end_run, rank_batches, start_run
from common.sampling import held_out_samples


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
    model_name: str = "builtin:tiny-chat"
    """the policy (and reference): a hub id, a local folder (e.g. outputs/sft) or a built-in (builtin:tiny-chat, built
    on first use); decoder-only, as TRL 1.16's KTOTrainer"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype of every model of the run: float32 as TRL (mixed precision comes from `accelerate launch
    --mixed_precision bf16`), auto for each checkpoint's own"""
    dataset_name: str = "builtin:vader-preferences"
    """a hub id, a local json/jsonl/csv/parquet file, or a built-in: unpaired (prompt, completion, label) rows, or
    preference pairs (prompt, chosen, rejected), which are unpaired first as TRL does"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    prompt_column: str = "prompt"
    """the prompt column (text or chat messages)"""
    completion_column: str = "completion"
    """the completion column of unpaired data"""
    label_column: str = "label"
    """the label column of unpaired data: true for a desirable completion, false for an undesirable one"""
    chosen_column: str = "chosen"
    """paired data: the preferred response column (becomes a desirable completion)"""
    rejected_column: str = "rejected"
    """paired data: the other response column (becomes an undesirable completion)"""
    max_length: int = 128
    """prompt + completion tokens; longer sequences lose their end (TRL), and a prompt this long drops its example"""
    chat_template: bool = True
    """render string prompts and completions as user and assistant messages with the tokenizer's chat template, when it
    has one (messages always are); --no-chat-template: raw text, prompt + completion + EOS, as TRL 1.16"""
    system_prompt: str | None = None
    """a system message put before every chat prompt that has none (None: the template's default, if any)"""
    text_format: Literal["spaced", "joined"] = "spaced"
    """raw text: spaced is BOS + prompt + " " + completion + EOS, as dpo.py and TRL 0.8 (the built-ins' format); joined
    is prompt + completion + EOS with the tokenizer's own special tokens, as TRL 1.16"""
    eval_fraction: float = 0.1
    """fraction of the prompts held out for evaluation (every completion of a held-out prompt goes with it)"""

    # KTO
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto (Ethayarajh et al. 2024) or apo_zero_unpaired (D'Oosterlinck et al. 2024, no reference point), as TRL 1.16"""
    beta: float = 0.1
    """the temperature of the implicit reward: higher keeps the policy closer to the reference"""
    desirable_weight: float = 1.0
    """lambda_D, the weight of a desirable example's loss (to balance unequal counts, eq. 8)"""
    undesirable_weight: float = 1.0
    """lambda_U, the weight of an undesirable example's loss"""
    train_sampling_strategy: Literal["random", "sequential"] = "random"
    """the order of the training examples: reshuffled every epoch, or the dataset's order every epoch (TRL 1.16's
    default; after unpairing, blocks of up to 1000 desirable, then as many undesirable)"""
    disable_dropout: bool = True
    """set every dropout probability of policy and reference to 0 (TRL default)"""
    sync_ref_model: bool = False
    """TR-DPO's moving reference (Gorbatovski et al. 2024): every --ref-model-sync-steps optimizer steps,
    ref <- alpha * policy + (1 - alpha) * ref (TRL's sync_ref_model)"""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha: the policy's share in each update of the reference (1: a hard copy)"""
    ref_model_sync_steps: int = 512
    """TR-DPO: optimizer steps between two updates of the reference"""
    precompute_ref_log_probs: bool = False
    """the reference log-probs of every example and of its KL pair once before training, then the reference freed; the
    KL pairs are then fixed as TRL forms them: rotated within each --batch-size chunk of the data's order"""

    # Optimisation
    learning_rate: float = 3e-5
    """peak learning rate (high because the default model is tiny; TRL's default 1e-6 suits a pretrained 7B model)"""
    lr_scheduler_type: str = "linear"
    """a transformers scheduler name"""
    weight_decay: float = 0.0
    """AdamW weight decay (TRL's default 0), on the weight matrices only: biases and norm weights are not decayed"""
    adam_beta1: float = 0.9
    """AdamW's beta1 (TRL's default)"""
    adam_beta2: float = 0.999
    """AdamW's beta2 (TRL's default)"""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon (TRL's default)"""
    warmup_ratio: float = 0.1
    """fraction of the steps spent warming up"""
    batch_size: int = 8
    """examples per forward/backward pass on each process; the KL estimate pairs them among themselves, so kto needs 2
    or more"""
    gradient_accumulation_steps: int = 1
    """forward/backward passes per optimizer step"""
    num_epochs: int = 1
    """passes over the training examples"""
    max_steps: int = -1
    """optimizer steps to run (overrides num_epochs when > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    gradient_checkpointing: bool = False
    """trade compute for memory"""
    chunked_logps: bool = True
    """log-probs from the last hidden states, the LM head run on the labelled tokens in chunks, so the [batch, length,
    vocab] logits are never held; FSDP / DeepSpeed (sharded head) and heads that scale or soft-cap logits: full logits"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (and at the end)"""
    generate_during_eval: bool = True
    """at each evaluation, sample replies to held-out prompts: log their KL to the reference, length and diversity, and
    print a table of policy and reference replies (TRL: off)"""
    save_steps: int = 0
    """write a resumable checkpoint every this many optimizer steps (0: only the final model)"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from"""
    output_dir: str = "outputs/kto"
    """where the final model and tokenizer go (plain from_pretrained format)"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters; the reference is the policy with its adapter disabled (no second model)"""
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


def kto_loss(policy_logps, reference_logps, labels, kl, beta, loss_type="kto", desirable_weight=1.0, undesirable_weight=1.0):
    """Per-example losses [B] and the detached implicit rewards beta * r [B], with r = log pi(y|x) - log pi_ref(y|x)
    the completions' log-ratios, `labels` [B] true for a desirable completion and `kl` the reference point z0 (a
    detached scalar):
    - kto (Ethayarajh et al. 2024, eq. 7-8): lambda_D (1 - sigmoid(beta (r - z0))) for a desirable completion,
      lambda_U (1 - sigmoid(beta (z0 - r))) for an undesirable one;
    - apo_zero_unpaired (D'Oosterlinck et al. 2024, eq. 7 unpaired, as TRL 1.16): 1 - sigmoid(beta r) for a desirable
      completion, sigmoid(beta r) for an undesirable one, each weighted as above; z0 plays no part.
    The batch's loss is the mean over all B (TRL: the weighted losses of both kinds, concatenated, then averaged).
    """
    logratios = policy_logps - reference_logps
    if loss_type == "kto":
        losses = torch.where(labels, 1 - F.sigmoid(beta * (logratios - kl)), 1 - F.sigmoid(beta * (kl - logratios)))
    elif loss_type == "apo_zero_unpaired":
        losses = torch.where(labels, 1 - F.sigmoid(beta * logratios), F.sigmoid(beta * logratios))
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}: choose kto or apo_zero_unpaired.")
    weights = torch.where(labels, desirable_weight, undesirable_weight).to(losses.dtype)
    return weights * losses, beta * logratios.detach()


def reference_point(policy_kl_logps, reference_kl_logps, mean_over_processes=lambda z: z):
    """KTO's z0: the mean of log pi(y'|x) - log pi_ref(y'|x) over the batch's mismatched pairs (x, y'), a Monte-Carlo
    estimate of KL(pi || pi_ref) (sec. 4.1), averaged over processes (`mean_over_processes`), clamped at 0 and detached
    (TRL: the mean over ranks, then the clamp)."""
    return mean_over_processes((policy_kl_logps - reference_kl_logps).mean().detach()).clamp(min=0)


def mismatched(completions: list) -> list:
    """The completions of the KL pairs: each example's prompt with the previous example's completion, the first taking
    the last's: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}) (TRL), so the batch's mismatched outputs are its own."""
    return completions[-1:] + completions[:-1]


def fixed_kl_pairs(examples: list[dict], batch_size: int) -> None:
    """--precompute-ref-log-probs: each example's KL completion fixed once, `mismatched` within each chunk of
    `batch_size` examples in the data's order (TRL 1.16's add_kl_completion_ids), in place."""
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        for example, kl_completion in zip(chunk, mismatched([e["completion_ids"] for e in chunk])):
            example["kl_completion_ids"] = kl_completion


def unpair(dataset, prompt: str, chosen: str, rejected: str, completion: str, label: str) -> Dataset:
    """TRL's `unpair_preference_dataset`: each pair becomes its chosen completion labelled true and its rejected one
    labelled false, in blocks of up to 1000 pairs (the block's chosen completions, then its rejected ones)."""
    rows = {prompt: [], completion: [], label: []}
    for start in range(0, len(dataset), 1000):
        block = dataset[start : start + 1000]
        rows[prompt] += block[prompt] * 2
        rows[completion] += block[chosen] + block[rejected]
        rows[label] += [True] * len(block[chosen]) + [False] * len(block[chosen])
    return Dataset.from_dict(rows)


def tokenize_example(
    tokenizer, prompt, completion, chat: bool, system_prompt: str | None = None, text_format: str = "joined"
) -> tuple[list, list]:
    """Prompt ids and completion ids (TRL 1.16 `tokenize_fn`). A chat: the rendered prompt's tokens, then the rendered
    answer's, its end-of-turn token included (common/chat.py). Text: prompt and prompt + completion + EOS tokenised, the
    completion starting where the two diverge (merges across the boundary); joined, with the tokenizer's own special
    tokens (TRL 1.16); spaced, with a space between prompt and completion and BOS first where the tokenizer has one
    (TRL 0.8, dpo.py)."""
    if chat:
        prompt_text, answer_text = render(tokenizer, prompt, completion, system_prompt)
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (prompt_text, answer_text)]
    eos, spaced = tokenizer.eos_token or "", text_format == "spaced"
    prompt, completion = prompt + " " * spaced, completion if completion.endswith(eos) else completion + eos
    prompt_ids = tokenizer(prompt, add_special_tokens=not spaced)["input_ids"]
    full = tokenizer(prompt + completion, add_special_tokens=not spaced)["input_ids"]
    shared = next((i for i, (a, b) in enumerate(zip(prompt_ids, full)) if a != b), min(len(prompt_ids), len(full)))
    bos = [tokenizer.bos_token_id] if spaced and tokenizer.bos_token_id is not None else []
    return bos + prompt_ids[:shared], full[shared:]


def generation_prompt(tokenizer, prompt, chat: bool, system_prompt: str | None, text_format: str) -> list[int]:
    """The tokens a held-out reply is sampled after, as `tokenize_example` tokenises a prompt: the rendered chat prompt,
    or the text (spaced: BOS first, and the space left to the reply's first token, where training has it)."""
    if chat:
        return tokenizer(render(tokenizer, prompt, system_prompt=system_prompt)[0], add_special_tokens=False)["input_ids"]
    spaced = text_format == "spaced"
    bos = [tokenizer.bos_token_id] if spaced and tokenizer.bos_token_id is not None else []
    return bos + tokenizer(prompt, add_special_tokens=not spaced)["input_ids"]


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_args(
        args,
        positive=(
            "save_total_limit beta learning_rate batch_size gradient_accumulation_steps num_epochs max_length "
            "eval_steps max_grad_norm desirable_weight undesirable_weight ref_model_sync_steps"
        ),
        non_negative="weight_decay save_steps",
        fractions="eval_fraction",
    )
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError(f"--warmup-ratio {args.warmup_ratio}: it lies in [0, 1).")
    if args.sync_ref_model and (args.use_peft or args.precompute_ref_log_probs):  # TRL refuses both too
        flag = "--use-peft has none" if args.use_peft else "--precompute-ref-log-probs frees it"
        raise UsageError(f"--sync-ref-model moves a reference copy during training, and {flag}: drop one.")
    if args.sync_ref_model and not 0 <= args.ref_model_mixup_alpha <= 1:
        raise UsageError(f"--ref-model-mixup-alpha {args.ref_model_mixup_alpha}: it lies in [0, 1].")
    if args.loss_type == "kto" and args.batch_size < 2:
        raise UsageError(
            "--batch-size 1 with --loss-type kto: the KL estimate pairs each prompt with another example's completion "
            "in the batch, so it needs 2 or more (TRL's rule too)."
        )


@dataclass
class Examples:
    """The tokenised examples of both splits ({prompt_ids, completion_ids, label}), the held-out rows (for the sample
    table), whether the chat template renders them, and the tokenizer."""

    train: list[dict]
    eval: list[dict]
    eval_prompts: list
    chat: bool
    tokenizer: object


def split_by_prompt(prompts: list, eval_fraction: float, seed: int) -> set:
    """The held-out prompts: `eval_fraction` of the distinct prompts (at least one), drawn with the seed, so that no
    held-out prompt occurs in training."""
    distinct = list(dict.fromkeys(json.dumps(p, sort_keys=True) for p in prompts))
    if len(distinct) < 2:
        raise UsageError(f"The dataset has {len(distinct)} distinct prompt: a training and a held-out one need 2.")
    order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(seed)).tolist()
    return {distinct[i] for i in order[: max(1, int(len(distinct) * eval_fraction))]}


def load_examples(args: Args, accelerator: Accelerator) -> Examples:
    """The feedback, checked, unpaired if it comes in pairs, split by prompt and tokenised, and the tokenizer: the data
    and the model's config are checked first, so an empty model folder names the missing model."""
    dataset = load_data(args.dataset_name, args.dataset_split)
    a = args
    if a.completion_column not in dataset.column_names and {a.chosen_column, a.rejected_column} <= set(dataset.column_names):
        check_columns(dataset, [a.prompt_column, a.chosen_column, a.rejected_column], "--prompt-column / --chosen-column")
        dataset = unpair(dataset, a.prompt_column, a.chosen_column, a.rejected_column, a.completion_column, a.label_column)
        accelerator.print(f"unpaired {len(dataset) // 2} preference pairs: chosen desirable, rejected undesirable")
    elif a.label_column not in dataset.column_names:
        raise UsageError(
            f"The dataset has no label column {a.label_column!r} (it has {dataset.column_names}): KTO learns from a "
            "true / false label per completion; name it with --label-column, or give preference pairs (--chosen-column "
            "/ --rejected-column)."
        )
    check_columns(
        dataset, [a.prompt_column, a.completion_column], "--prompt-column / --completion-column", prompts=(a.prompt_column,)
    )
    labels = dataset[a.label_column]
    bad = next((i for i, v in enumerate(labels) if not isinstance(v, bool)), None)
    if bad is not None:
        raise UsageError(
            f"The column {a.label_column!r}, row {bad}: {labels[bad]!r} is not a boolean; KTO labels are true (a "
            "desirable completion) or false (an undesirable one): convert the column, e.g. label = score > 0."
        )
    model_config = load_config(args.model_name)
    if getattr(model_config, "is_encoder_decoder", False):
        raise UsageError(
            f"--model-name {args.model_name} is an encoder-decoder model; kto.py trains decoder-only models (as TRL "
            "1.16's KTOTrainer): use dpo.py for encoder-decoder preference learning."
        )
    context = context_length(model_config)
    if context and args.max_length > context:
        raise UsageError(f"max_length={args.max_length} exceeds the model's context of {context} tokens: lower --max-length.")
    tokenizer = load_tokenizer(args.model_name, padding_side="right")
    chat = use_chat(tokenizer, args.chat_template, [dataset[0][a.prompt_column], dataset[0][a.completion_column]])
    held_out = split_by_prompt(dataset[a.prompt_column], args.eval_fraction, args.seed)
    train, eval_, eval_prompts, dropped = [], [], [], 0
    for row in dataset:
        prompt_ids, completion_ids = tokenize_example(
            tokenizer, row[a.prompt_column], row[a.completion_column], chat, args.system_prompt, args.text_format
        )
        if len(prompt_ids) >= args.max_length:  # no completion token would be left (TRL drops these too)
            dropped += 1
            continue
        example = dict(prompt_ids=prompt_ids, completion_ids=completion_ids, label=row[a.label_column])
        if json.dumps(row[a.prompt_column], sort_keys=True) in held_out:
            eval_.append(example)
            eval_prompts.append(row[a.prompt_column])
        else:
            train.append(example)
    if dropped:
        accelerator.print(f"warning: {dropped} examples dropped: their prompt alone fills --max-length {args.max_length}")
    for name, split in (("training", train), ("held-out", eval_)):
        desirable = sum(e["label"] for e in split)
        if desirable in (0, len(split)):
            raise UsageError(
                f"Every {name} label is {bool(desirable)}: KTO learns from desirable and undesirable completions side "
                "by side (for desirable ones alone, sft.py); add the other kind, or raise --eval-fraction."
            )
    distinct = {json.dumps(p, sort_keys=True): p for p in eval_prompts}  # each held-out prompt once, for the samples
    return Examples(train, eval_, list(distinct.values()), chat, tokenizer)


def balance_warning(args: Args, examples: list[dict]) -> str | None:
    """TRL's advice when desirable and undesirable counts differ: lambda_D n_D / (lambda_U n_U) should lie in [1, 4/3]
    (eq. 8), met by either weight."""
    n_d = max(sum(e["label"] for e in examples), 1)
    n_u = max(len(examples) - n_d, 1)
    if n_d == n_u:
        return None
    d_low, d_high = round(n_u * args.undesirable_weight / n_d, 2), round(n_u * args.undesirable_weight / n_d * 1.33, 2)
    u_low, u_high = round(n_d * args.desirable_weight / n_u / 1.33, 2), round(n_d * args.desirable_weight / n_u, 2)
    if d_low <= args.desirable_weight <= d_high or u_low <= args.undesirable_weight <= u_high:
        return None
    return (
        f"warning: {n_d} desirable and {n_u} undesirable examples; KTO suggests either --desirable-weight in "
        f"[{d_low}, {d_high}] or --undesirable-weight in [{u_low}, {u_high}] (eq. 8), not both"
    )


class Batches:
    """Examples as right-padded batches of prompt + completion, and of the mismatched pairs the KL estimate reads
    (prompt + the previous example's completion, `mismatched`); a rank's micro-batch of a step, reshuffled each epoch
    (--train-sampling-strategy random) or in the data's order, so that a resume continues exactly."""

    def __init__(self, args: Args, accelerator: Accelerator, tokenizer, steps_per_epoch: int):
        self.args, self.accelerator, self.tokenizer, self.steps_per_epoch = args, accelerator, tokenizer, steps_per_epoch

    def sequences(self, prompts: list, completions: list, prefix: str) -> dict:
        """input_ids, attention_mask and labels (-100 but on completion tokens), cut to --max-length (TRL)."""
        ids = [(p + c)[: self.args.max_length] for p, c in zip(prompts, completions)]
        labels = [([-100] * len(p) + c)[: self.args.max_length] for p, c in zip(prompts, completions)]
        return {
            f"{prefix}input_ids": pad_right(ids, self.tokenizer.pad_token_id),
            f"{prefix}attention_mask": pad_right([[1] * len(i) for i in ids], 0),
            f"{prefix}labels": pad_right(labels, -100),
        }

    def collate(self, examples: list[dict], kl: bool) -> dict:
        prompts, completions = [e["prompt_ids"] for e in examples], [e["completion_ids"] for e in examples]
        batch = self.sequences(prompts, completions, "")
        if kl:  # the batch's own completions rotated, or the pairs fixed before training (--precompute-ref-log-probs)
            fixed = [e["kl_completion_ids"] for e in examples] if "kl_completion_ids" in examples[0] else None
            batch |= self.sequences(prompts, fixed or mismatched(completions), "KL_")
        batch["label"] = torch.tensor([e["label"] for e in examples])
        for key in ("reference_logps", "KL_reference_logps") if "reference_logps" in examples[0] else ():
            batch[key] = torch.tensor([e[key] for e in examples])
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def micro_batch(self, examples: list[dict], step: int, kl: bool) -> dict:
        args, accelerator = self.args, self.accelerator
        if args.train_sampling_strategy == "random":
            return self.collate(epoch_rows(examples, args.batch_size, step, args.seed, accelerator), kl)
        i = step % self.steps_per_epoch  # the data's own order, every epoch (TRL's sequential sampler)
        start = (i * accelerator.num_processes + accelerator.process_index) * args.batch_size
        return self.collate(examples[start : start + args.batch_size], kl)


def load_models(args: Args, accelerator: Accelerator, quantization: dict):
    """The policy (LoRA with --use-peft) and its frozen reference (None for LoRA: the adapter disabled), on the device."""
    model = load_pretrained(args.model_name, AutoModelForCausalLM, dtype=args.dtype, **quantization)
    if args.disable_dropout:
        disable_dropout(model)
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
    ref_model = create_reference_model(model)  # None for peft: the adapter disabled
    if ref_model is not None:
        ref_model = place_frozen(accelerator, ref_model)
    return model.to(accelerator.device), ref_model


class Scorer:
    """The KTO loss of a batch and TRL's metrics, from the policy's and the reference's completion log-probs."""

    def __init__(self, args: Args, accelerator: Accelerator, model, ref_model):
        self.args, self.accelerator, self.model, self.ref_model = args, accelerator, model, ref_model
        self.sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        self.chunked = args.chunked_logps and chunkable_head(model, self.sharded) is not None
        self.kl = args.loss_type == "kto"  # apo_zero_unpaired has no reference point (TRL: calculate_KL)

    def mean_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(value, "mean")

    def completion_logps(self, policy, batch: dict, prefix: str = "") -> torch.Tensor:
        """log pi(completion | prompt) [B]: the sum over the completion's tokens."""
        ids, mask, labels = (batch[f"{prefix}{k}"] for k in ("input_ids", "attention_mask", "labels"))
        if self.chunked:
            head = self.accelerator.unwrap_model(policy).get_output_embeddings()
            with self.accelerator.autocast():  # the head runs outside the forward, which prepare wraps in autocast
                per_token, _, _ = lm_token_logprobs(policy, head, dict(input_ids=ids, attention_mask=mask), labels)
            return per_token.sum(-1)
        logits = policy(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        labels = labels[:, 1:]
        return (logprobs_from_logits(logits.float(), labels.clamp(min=0)) * (labels != -100)).sum(-1)

    @torch.no_grad()
    def reference_logps(self, batch: dict, prefix: str = "") -> torch.Tensor:
        """log pi_ref(completion | prompt) [B]: precomputed, the frozen copy's, or the policy's with its adapter off."""
        if f"{prefix}reference_logps" in batch:
            return batch[f"{prefix}reference_logps"]
        policy = self.accelerator.unwrap_model(self.model)
        with reference_context(policy, self.ref_model):
            return self.completion_logps(self.ref_model if self.ref_model is not None else policy, batch, prefix)

    def precompute_reference(self, examples, batches: "Batches") -> None:
        """--precompute-ref-log-probs: the KL pairs fixed, every example's reference log-probs (and its KL pair's)
        stored with it, then the frozen copy freed."""
        for split in (examples.train, examples.eval):
            if self.kl:
                fixed_kl_pairs(split, self.args.batch_size)
            starts = range(0, len(split), self.args.batch_size)
            for i in tqdm(starts, desc="reference log-probs", disable=not self.accelerator.is_local_main_process):
                chunk = split[i : i + self.args.batch_size]
                batch = batches.collate(chunk, self.kl)
                values = {"reference_logps": self.reference_logps(batch).tolist()}
                if self.kl:
                    values["KL_reference_logps"] = self.reference_logps(batch, "KL_").tolist()
                for j, example in enumerate(chunk):
                    example.update({key: v[j] for key, v in values.items()})
        self.ref_model = None  # the frozen copy is no longer needed
        gc.collect()

    def batch_metrics(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The KTO loss of a batch and the sums behind TRL's metrics (`summarise` turns them into means)."""
        args, labels = self.args, batch["label"]
        policy_logps = self.completion_logps(self.model, batch)
        reference_logps = self.reference_logps(batch)
        kl = torch.zeros((), device=policy_logps.device)
        if self.kl:  # z0: the mismatched pairs under the policy (no gradient) and the reference, over every process
            with torch.no_grad():
                policy_kl_logps = self.completion_logps(self.model, batch, "KL_")
            kl = reference_point(policy_kl_logps, self.reference_logps(batch, "KL_"), self.mean_over_processes)
        losses, rewards = kto_loss(
            policy_logps, reference_logps, labels, kl, args.beta, args.loss_type, args.desirable_weight,
            args.undesirable_weight,
        )  # fmt: skip
        loss = losses.mean()
        desirable = labels.float()
        sums = {
            "loss": loss.detach(),
            "kl": kl,
            "batches": torch.ones((), device=loss.device),
            "chosen": desirable.sum(),
            "rejected": (1 - desirable).sum(),
            "rewards/chosen": (rewards * desirable).sum(),
            "rewards/rejected": (rewards * (1 - desirable)).sum(),
            "logps/chosen": (policy_logps.detach() * desirable).sum(),
            "logps/rejected": (policy_logps.detach() * (1 - desirable)).sum(),
        }
        return loss, sums


def summarise(accelerator: Accelerator, sums: dict, prefix: str) -> dict[str, float]:
    """TRL's metrics from this process's sums over batches, pooled over the processes: the loss and z0 per batch,
    rewards and log-probs per completion of each kind, and the margin between the kinds' mean rewards."""
    per = {"loss": "batches", "kl": "batches", "rewards/chosen": "chosen", "rewards/rejected": "rejected"}
    per |= {"logps/chosen": "chosen", "logps/rejected": "rejected"}
    pair = lambda k, n: torch.stack([torch.as_tensor(sums[x], device=accelerator.device).float() for x in (k, n)])  # noqa: E731
    metrics = pooled(accelerator, [{k: pair(k, n) for k, n in per.items()}])
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


@torch.no_grad()
def evaluate(args: Args, scorer: Scorer, examples: Examples, batches: Batches, logger, step: int) -> dict[str, float]:
    """Metrics over the whole held-out split (its batches paired for z0 as in training); with --generate-during-eval,
    samples of the policy and the reference on held-out prompts."""
    accelerator, model = scorer.accelerator, scorer.model
    model.eval()
    sums = {}
    for chunk, weight in rank_batches(examples.eval, args.batch_size, accelerator):  # as many on every rank
        _, batch_sums = scorer.batch_metrics(batches.collate(chunk, scorer.kl))
        sums = {k: sums.get(k, 0) + v * weight for k, v in batch_sums.items()}
    results = summarise(accelerator, sums, "eval")
    if args.generate_during_eval and (accelerator.is_main_process or scorer.sharded):  # sharded: every rank decodes
        raw, tokenizer = examples.eval_prompts[:32], examples.tokenizer
        prompts = [generation_prompt(tokenizer, p, examples.chat, args.system_prompt, args.text_format) for p in raw]
        keep = max(1, args.max_length - 24)  # room for the 24 new tokens
        stats, replies = held_out_samples(
            accelerator, model, scorer.ref_model, tokenizer, prompts, False, keep, sharded=scorer.sharded
        )
        results |= {f"eval/samples/{k}": v for k, v in stats.items()}
        logger.samples("eval samples", {"prompt": [text_of(p) for p in raw[:4]], **replies}, step)
    logger.log(results, step)
    model.train()
    return results


def main(args: Args) -> None:
    """Setup, then the loop, then the final evaluation, save and summary."""
    check(args)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.sync_ref_model and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UsageError("--sync-ref-model runs in one process or under DDP, not with sharded weights (FSDP, DeepSpeed).")
    quantization = quantization_kwargs(args.model_name, args.load_in_8bit, args.load_in_4bit, args.use_peft)
    run_name, logger = start_run(args, accelerator)
    examples = load_examples(args, accelerator)  # checked before any model is built or loaded
    tokenizer = examples.tokenizer
    per_step = args.batch_size * accelerator.num_processes
    steps_per_epoch = len(examples.train) // per_step
    epoch_steps = steps_per_epoch * args.num_epochs // args.gradient_accumulation_steps
    total_steps = args.max_steps if args.max_steps > 0 else epoch_steps
    if total_steps == 0 or steps_per_epoch == 0:
        raise UsageError(
            f"{len(examples.train)} training examples make no optimizer step of {per_step} x "
            f"{args.gradient_accumulation_steps} examples: lower --batch-size or --gradient-accumulation-steps."
        )
    desirable = sum(e["label"] for e in examples.train)
    accelerator.print(
        f"{len(examples.train)} training examples ({desirable} desirable, {len(examples.train) - desirable} undesirable) "
        f"/ {len(examples.eval)} held-out; {total_steps} optimizer steps"
    )
    if warning := balance_warning(args, examples.train):
        accelerator.print(warning)
    batches = Batches(args, accelerator, tokenizer, steps_per_epoch)
    model, ref_model = load_models(args, accelerator, quantization)
    scorer = Scorer(args, accelerator, model, ref_model)
    if args.precompute_ref_log_probs:
        scorer.precompute_reference(examples, batches)
    optimizer = adamw(args, model)
    ticks = accelerator.num_processes  # accelerate's prepared scheduler steps once per process per optimizer step
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=int(args.warmup_ratio * total_steps) * ticks,
        num_training_steps=total_steps * ticks,
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    scorer.model = model
    if args.sync_ref_model:  # the moving reference: checkpointed with the optimizer, so a resume continues exactly
        accelerator.register_for_checkpointing(ref_model)
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
    first_eval, start_time = evaluate(args, scorer, examples, batches, logger, start_step), time.time()
    first_eval = resumed.get("first_eval", first_eval)  # after a resume the summary compares with the run's start
    model.train()
    progress = tqdm(range(start_step, total_steps), disable=not accelerator.is_local_main_process, desc="kto")
    for step in progress:
        step_start, grad_norm, sums = time.time(), None, {}
        # 1. the KTO loss of each micro-batch (z0 from its mismatched pairs), accumulated into one optimizer step
        for micro in range(args.gradient_accumulation_steps):
            with accelerator.accumulate(model):
                batch = batches.micro_batch(examples.train, step * args.gradient_accumulation_steps + micro, scorer.kl)
                loss, batch_sums = scorer.batch_metrics(batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            sums = {k: sums.get(k, 0) + v for k, v in batch_sums.items()}
        if args.sync_ref_model and (step + 1) % args.ref_model_sync_steps == 0:  # TR-DPO, after the optimizer step
            sync_reference(accelerator.unwrap_model(model), ref_model, args.ref_model_mixup_alpha)

        # 2. bookkeeping: one collective and one device sync for all the metrics
        metrics = summarise(accelerator, sums, "train")
        metrics["train/grad_norm"] = plain(grad_norm) if grad_norm is not None else 0.0
        check_finite(step + 1, {k: metrics[k] for k in ("train/loss", "train/grad_norm")})
        step_time = time.time() - step_start
        logger.log(
            metrics
            | {
                "train/learning_rate": scheduler.get_last_lr()[0],
                "time/step": step_time,
                "throughput/examples_per_s": per_step * args.gradient_accumulation_steps / step_time,
            },
            step + 1,
        )
        progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", margin=f"{metrics['train/rewards/margins']:.2f}")
        if (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            evaluate(args, scorer, examples, batches, logger, step + 1)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"step_{step + 1}")
            save_checkpoint(
                accelerator, folder, {"step": step + 1, "first_eval": first_eval}, total_limit=args.save_total_limit
            )

    # 3. the final evaluation, save (plain from_pretrained format; LoRA merged) and summary
    last_eval = evaluate(args, scorer, examples, batches, logger, total_steps)
    save_policy(args, accelerator, accelerator.unwrap_model(model), tokenizer, last_eval, "kto")  # LoRA merged
    elapsed = time.time() - start_time
    first, last = first_eval, last_eval
    replies = ""  # the held-out replies' KL to the start, length and share of distinct ones (--generate-during-eval)
    if "eval/samples/kl" in last and "eval/samples/length" in first:
        length, distinct = (
            f"{first[f'eval/samples/{k}']:.{d}f} -> {last[f'eval/samples/{k}']:.{d}f}"
            for k, d in (("length", 1), ("distinct", 2))
        )
        replies = f"; replies: KL {last['eval/samples/kl']:.2f}, length {length}, distinct {distinct}"
    accelerator.print(
        f"kto: {total_steps - start_step} steps in {elapsed:.0f}s; eval reward margin {first['eval/rewards/margins']:.3f} "
        f"-> {last['eval/rewards/margins']:.3f} (desirable {last['eval/rewards/chosen']:.3f}, undesirable "
        f"{last['eval/rewards/rejected']:.3f}){replies}; model saved to {args.output_dir}"
    )
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
