"""Reward modelling from pairwise preferences: the second stage of the RLHF pipeline.

A sequence-classification model with one output scores prompt + response at its last non-pad token, trained
with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) (Stiennon et al. 2020, eq. 1; the margin
of Llama 2, Touvron et al. 2023, section 3.2.2). TRL 0.7-0.8 `RewardTrainer` semantics. Optionally the rewards are
normalised after training to mean 0 and std 1 (lm-human-preferences), folded into the saved model's weights.

Usage:
    python reward_modeling.py                       # offline: builtin:tiny-chat on the built-in VADER-labelled pairs
    accelerate launch reward_modeling.py --model-name path/to/minilm --normalize-reward
    accelerate launch --config_file configs/multi_gpu.yaml reward_modeling.py --model-name gpt2 --dataset-name pairs.jsonl
"""

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, get_scheduler
from transformers.utils import logging as transformers_logging

from common.chat import use_chat
from common.checkpoints import full_weights, load_checkpoint, save_checkpoint
from common.cli import cli
from common.core import UsageError, adamw, check_adam, check_args, plain
from common.loading import (
    check_columns,
    context_length,
    load_config,
    load_data,
    load_pretrained,
    load_tokenizer,
    quantization_kwargs,
    reward_model_text,
    train_eval_split,
)
from common.models import REWARD_NORMALIZATION_FILE, check_lora_targets, classifier_pad, disable_dropout, peft_model_of
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
    model_name: str = "builtin:tiny-chat"
    """backbone: a hub id, a local folder (e.g. an encoder such as all-MiniLM-L6-v2), or a built-in preset
    (builtin:tiny-chat: a small GPT-2 pretrained on the built-in dialogue, built on first use; builtin:tiny-gpt2:
    random)"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype of every model of the run: float32 as TRL (weights that train need it; mixed precision comes from
    `accelerate launch --mixed_precision bf16`), bfloat16 for frozen weights, auto for each checkpoint's own"""
    dataset_name: str = "builtin:vader-preferences"
    """a hub id, a local json/jsonl/csv/parquet file, or builtin:vader-preferences"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    prompt_column: str = "prompt"
    """the prompt column ("" when chosen/rejected already hold the full texts)"""
    chosen_column: str = "chosen"
    """the preferred response"""
    rejected_column: str = "rejected"
    """the other response"""
    chat_template: bool = True
    """render string prompts and responses as user and assistant messages with the tokenizer's chat template, when it
    has one (messages always are); --no-chat-template: "prompt response<eos>" as raw text"""
    margin_column: str | None = None
    """an optional per-pair margin (Llama 2): loss = -logsigmoid(r_chosen - r_rejected - margin)"""
    center_rewards_coefficient: float | None = None
    """weight of the auxiliary loss mean((r_chosen + r_rejected)^2), which keeps the rewards centred on 0 (Eisenstein
    et al. 2023; TRL's center_rewards_coefficient, e.g. 0.01); None: off"""
    max_length: int = 128
    """prompt + response tokens; longer pairs are truncated from the left (the response end is kept)"""
    truncate_long_pairs: bool = True
    """cut a pair past --max-length from the left; --no-truncate-long-pairs drops it, as TRL 1.16's RewardTrainer does"""
    eval_fraction: float = 0.1
    """fraction of the pairs held out for evaluation"""

    # Optimisation
    learning_rate: float = 3e-4
    """peak learning rate (high because the default model is tiny and random; ~1e-5 for a pretrained one)"""
    lr_scheduler_type: str = "linear"
    """a transformers scheduler name"""
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
    """pairs per forward/backward pass on each process (2x sequences: chosen and rejected together)"""
    gradient_accumulation_steps: int = 1
    """forward/backward passes per optimizer step"""
    length_groups: int = 2
    """a batch's 2 x batch_size sequences, sorted by length, run in this many forward passes, each padded to its own
    longest: the same rewards and gradients with fewer pad tokens; 1: one padded pass (TRL's)"""
    num_epochs: int = 4
    """passes over the training pairs"""
    max_steps: int = -1
    """optimizer steps to run (overrides num_epochs when > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    disable_dropout: bool = True
    """set every dropout probability of the model to 0 (TRL's RewardConfig default): training scores texts as PPO
    will; on CPU it also avoids the slow dropout path of scaled-dot-product attention"""
    eval_steps: int = 50
    """evaluate every this many optimizer steps (and at the end)"""
    save_steps: int = 0
    """write a resumable checkpoint every this many optimizer steps (0: only the final model); it holds the model as
    trained so far (not yet normalised) in from_pretrained format (with LoRA: the adapter) and accelerate's state"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from"""
    normalize_reward: bool = False
    """after training, fold a gain and bias into the model so rewards on the training responses have mean 0, std 1"""
    output_dir: str = "outputs/reward_model"
    """where the final model and tokenizer go (plain from_pretrained format)"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters and the score head: merged into the saved model, and also saved unmerged as
    {output_dir}/reward_adapter for `ppo.py --use-peft --reward-adapter` (one base model for policy and reward)"""
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


def reward_loss(
    rewards_chosen: torch.Tensor,
    rewards_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coefficient: float | None = None,
):
    """Pairwise loss -log sigmoid(r_chosen - r_rejected - margin), averaged (Stiennon et al. 2020; Llama 2 margin),
    plus center_coefficient * mean((r_chosen + r_rejected)^2) (Eisenstein et al. 2023, TRL RewardTrainer.compute_loss):
    the pairwise loss sees only differences, this term pins the rewards' level near 0."""
    logits = rewards_chosen - rewards_rejected
    if margin is not None:
        logits = logits - margin
    loss = -F.logsigmoid(logits).mean()
    if center_coefficient is not None:
        loss = loss + center_coefficient * ((rewards_chosen + rewards_rejected) ** 2).mean()
    return loss


def fold_reward_normalization(model, gain: float, bias: float) -> None:
    """Make the model output gain * r + bias, in its own weights, so plain from_pretrained applies it.

    The gain scales the score head. The bias goes into the head's bias, or, for heads without one (GPT-2,
    Llama), into the bias of the norm feeding the head: a shift along the head's weight w by bias * w / |w|^2.
    """
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1][-1]
    with torch.no_grad():
        head.weight.mul_(gain)
        if head.bias is not None:
            head.bias.mul_(gain).add_(bias)
            return
        norms = [m for m in model.modules() if "norm" in type(m).__name__.lower() and getattr(m, "bias", None) is not None]
        if not norms or norms[-1].bias.shape != head.weight.shape[1:]:
            raise UsageError(
                f"Cannot fold a reward bias into {type(model).__name__}: its score head has no bias "
                "and no final norm with a bias feeds it; train without --normalize-reward."
            )
        norms[-1].bias.add_(bias * head.weight[0] / head.weight[0].square().sum())


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_args(
        args,
        positive=(
            "save_total_limit learning_rate batch_size gradient_accumulation_steps num_epochs eval_steps max_grad_norm "
            "max_length"
        ),
        non_negative="weight_decay save_steps center_rewards_coefficient",
        fractions="eval_fraction",
    )
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError(f"--warmup-ratio {args.warmup_ratio}: it lies in [0, 1).")
    if args.length_groups < 1:
        raise UsageError(f"--length-groups {args.length_groups}: a batch needs at least one forward pass (1 = TRL's).")


def load_pairs(args: Args, accelerator: Accelerator, tokenizer) -> tuple[list[dict], list[dict]]:
    """The preference pairs, checked, split and tokenised as ppo.py and grpo.py score them (`reward_model_text`: the
    rendered chat, or "prompt response<eos>"), left-truncated (or, past --max-length, dropped as TRL 1.16 does):
    (chosen ids, rejected ids, margin) each."""
    dataset = load_data(args.dataset_name, args.dataset_split)
    columns = [c for c in (args.prompt_column, args.chosen_column, args.rejected_column, args.margin_column) if c]
    flags = "--prompt-column / --chosen-column / --rejected-column / --margin-column"
    check_columns(dataset, columns, flags, numeric=(args.margin_column,))
    context = context_length(load_config(args.model_name))
    if context and args.max_length > context:
        raise UsageError(f"max_length={args.max_length} exceeds the model's context of {context} tokens.")
    chat = use_chat(tokenizer, args.chat_template, [dataset[0][c] for c in columns if c != args.margin_column])
    splits, dropped = [], 0
    for split in train_eval_split(dataset, args.eval_fraction, args.seed):
        pairs = []
        for row in split:
            prompt = row[args.prompt_column] if args.prompt_column else None
            texts = [
                reward_model_text(tokenizer, prompt, row[c], True, chat) for c in (args.chosen_column, args.rejected_column)
            ]
            ids = [tokenizer(t, add_special_tokens=not chat)["input_ids"] for t in texts]
            if not args.truncate_long_pairs and max(map(len, ids)) > args.max_length:
                dropped += 1  # TRL 1.16: a pair with either side past max_length is filtered out
                continue
            margin = float(row[args.margin_column]) if args.margin_column else 0.0
            pairs.append(dict(chosen=ids[0][-args.max_length :], rejected=ids[1][-args.max_length :], margin=margin))
        splits.append(pairs)
    train_pairs, eval_pairs = splits
    if dropped:
        accelerator.print(f"dropped {dropped} pairs longer than --max-length {args.max_length} (--no-truncate-long-pairs)")
    if dropped and (not train_pairs or (args.eval_fraction and not eval_pairs)):
        raise UsageError(
            f"no {'training' if not train_pairs else 'held-out'} pair is within --max-length {args.max_length} tokens: "
            "raise --max-length, or truncate them (--truncate-long-pairs)."
        )
    identical = sum(p["chosen"] == p["rejected"] for p in train_pairs)
    if identical == len(train_pairs):
        raise UsageError("Every chosen response equals its rejected one: there is no preference to learn.")
    if identical:
        accelerator.print(f"warning: {identical} pairs have identical chosen and rejected texts (they add a constant loss)")
    return train_pairs, eval_pairs


class Batches:
    """A batch's 2B sequences (chosen, then rejected) sorted by length into --length-groups right-padded groups, one
    forward pass each (`order` puts their rewards back in chosen-then-rejected order); a rank's micro-batch of a step
    from a seeded reshuffle per epoch, so that a resume continues exactly."""

    def __init__(self, args: Args, accelerator: Accelerator, tokenizer, steps_per_epoch: int):
        self.args, self.accelerator, self.tokenizer, self.steps_per_epoch = args, accelerator, tokenizer, steps_per_epoch

    def collate(self, batch: list[dict]) -> dict:
        args, device, pad = self.args, self.accelerator.device, self.tokenizer.pad_token_id
        sequences = [torch.tensor(s) for s in [p["chosen"] for p in batch] + [p["rejected"] for p in batch]]
        lengths = torch.tensor([len(s) for s in sequences])
        by_length = lengths.argsort(stable=True) if args.length_groups > 1 else torch.arange(len(sequences))
        groups = [[sequences[i] for i in g] for g in by_length.tensor_split(min(args.length_groups, len(sequences)))]
        groups = [
            dict(
                input_ids=pad_sequence(g, batch_first=True, padding_value=pad).to(device),
                attention_mask=pad_sequence([torch.ones_like(s) for s in g], batch_first=True).to(device),
            )
            for g in groups
        ]
        margin = torch.tensor([p["margin"] for p in batch], device=device)
        return dict(groups=groups, order=by_length.argsort().to(device), margin=margin)

    def micro_batch(self, pairs: list[dict], step: int) -> dict:
        args, accelerator = self.args, self.accelerator
        epoch, i = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(args.seed + epoch))
        start = (i * accelerator.num_processes + accelerator.process_index) * args.batch_size
        return self.collate([pairs[j] for j in order[start : start + args.batch_size].tolist()])


def load_model(args: Args, accelerator: Accelerator, tokenizer, quantization: dict, total_steps: int):
    """The sequence classifier (a new one-logit score head where the checkpoint has none; LoRA with --use-peft)
    prepared with its AdamW optimizer and schedule."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its LOAD REPORT calls a new score head MISSING: new on purpose, said below
    loaded = load_pretrained(
        args.model_name, AutoModelForSequenceClassification, num_labels=1, dtype=args.dtype, output_loading_info=True,
        **quantization,
    )  # fmt: skip
    transformers_logging.set_verbosity(verbosity)
    model, info = loaded if isinstance(loaded, tuple) else (loaded, {"missing_keys": ["every weight (a random preset)"]})
    new = sorted({k.split(".")[0] for k in info["missing_keys"]})
    accelerator.print(f"reward model from {args.model_name}: " + (f"new, trained here: {new}" if new else "its own head"))
    classifier_pad(tokenizer, model)  # the classifier scores each text at its last token that is not the pad token
    if args.disable_dropout:
        disable_dropout(model)
    if quantization:
        model = prepare_model_for_kbit_training(model)
    if args.use_peft:
        check_lora_targets(model, args.lora_target_modules)
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type="SEQ_CLS",
        )
        model = get_peft_model(model, lora)
    optimizer = adamw(args, model)
    ticks = accelerator.num_processes  # accelerate's prepared scheduler steps once per process per optimizer step
    warmup = int(args.warmup_ratio * total_steps) * ticks
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps * ticks
    )
    return accelerator.prepare(model, optimizer, scheduler)


def batch_rewards(net, batch: dict) -> torch.Tensor:
    """Rewards of the batch's 2B sequences, chosen then rejected, from one forward pass per length group."""
    return torch.cat([net(**group).logits[:, 0] for group in batch["groups"]]).float()[batch["order"]]


def pair_metrics(args: Args, model, batch: dict) -> tuple[torch.Tensor, dict]:
    """Loss and metrics of a batch of pairs."""
    chosen, rejected = batch_rewards(model, batch).chunk(2)
    loss = reward_loss(chosen, rejected, batch["margin"] if args.margin_column else None, args.center_rewards_coefficient)
    return loss, {
        "loss": loss.detach(),
        "accuracy": (chosen > rejected).float().mean(),
        "margin": (chosen - rejected).mean().detach(),
        "reward_chosen": chosen.mean().detach(),
        "reward_rejected": rejected.mean().detach(),
    }


@torch.no_grad()
def evaluate(args: Args, accelerator: Accelerator, model, eval_pairs, batches: Batches, logger, step: int) -> dict[str, float]:
    """Metrics over the whole eval split, gathered over ranks (pairs weighted equally)."""
    model.eval()
    device = accelerator.device
    sums, count = {}, torch.zeros((), device=device)
    for chunk, weight in rank_batches(eval_pairs, args.batch_size, accelerator):  # as many on every rank
        batch = batches.collate(chunk)
        _, metrics = pair_metrics(args, model, batch)
        n = torch.tensor(len(batch["margin"]) * weight, device=device)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0) + v * n
        count += n
    total = accelerator.reduce(count, "sum")
    results = {f"eval/{k}": (accelerator.reduce(v, "sum") / total).item() for k, v in sums.items()}
    logger.log(results, step)
    model.train()
    return results


@torch.no_grad()
def normalization(args: Args, accelerator: Accelerator, unwrapped, train_pairs, batches: Batches) -> tuple[float, float]:
    """lm-human-preferences' normalisation: the gain and bias that take the rewards of the training responses to mean
    0 and std 1 (every rank's, summed in two passes); (1, 0) without --normalize-reward."""
    if not args.normalize_reward:
        return 1.0, 0.0
    unwrapped.eval()
    scored = [
        (batch_rewards(unwrapped, batches.collate(chunk)), w)
        for chunk, w in rank_batches(train_pairs, args.batch_size, accelerator)
    ]
    rewards, weights = torch.cat([r for r, _ in scored]), torch.cat([torch.full_like(r, w) for r, w in scored])
    n, total = accelerator.reduce(torch.stack([weights.sum(), (rewards * weights).sum()]), "sum").tolist()
    mean = total / n
    std = math.sqrt(accelerator.reduce(((rewards - mean).square() * weights).sum(), "sum").item() / (n - 1))
    accelerator.print(f"reward normalised: mean {mean:.3f}, std {std:.3f} -> 0, 1")
    return 1.0 / std, -mean / std


def save(args: Args, accelerator: Accelerator, model, unwrapped, tokenizer, gain: float, bias: float, metrics: dict):
    """The reward model in plain from_pretrained format (the normalisation folded into its head; with LoRA also the
    adapter, for ppo.py --reward-adapter), with its tokenizer and model card, written atomically."""
    weights = full_weights(accelerator, model)  # gathered on the main process when sharded (every rank calls it)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    with atomic_directory(args.output_dir) as tmp:
        if peft_model_of(unwrapped) is not None:
            adapter_dir = os.path.join(tmp, "reward_adapter")
            unwrapped.save_pretrained(adapter_dir)  # LoRA + score head (peft's modules_to_save for SEQ_CLS)
            if args.normalize_reward:  # the adapter keeps its weights; ppo.py applies gain and bias from this file
                with open(os.path.join(adapter_dir, REWARD_NORMALIZATION_FILE), "w") as f:
                    json.dump({"gain": gain, "bias": bias}, f)
            unwrapped = unwrapped.merge_and_unload()
        if args.normalize_reward:
            fold_reward_normalization(unwrapped, gain, bias)
        unwrapped.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        write_model_card(tmp, args, "reward_modeling", metrics)


def main(args: Args) -> None:
    """Setup, then the loop, then the final evaluation, the normalisation, the save and the summary."""
    check(args)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    quantization = quantization_kwargs(args.model_name, args.load_in_8bit, args.load_in_4bit, args.use_peft)
    run_name, logger = start_run(args, accelerator)
    # right padding is fine: the classifier scores the last non-pad token, and its pad is distinct from EOS
    tokenizer = load_tokenizer(args.model_name, padding_side="right")
    train_pairs, eval_pairs = load_pairs(args, accelerator, tokenizer)  # checked before any model is built or loaded
    pairs_per_step = args.batch_size * accelerator.num_processes
    steps_per_epoch = len(train_pairs) // pairs_per_step
    # micro-batches run on across epoch boundaries, so accumulation need not divide an epoch
    epoch_steps = steps_per_epoch * args.num_epochs // args.gradient_accumulation_steps
    total_steps = args.max_steps if args.max_steps > 0 else epoch_steps
    if total_steps == 0 or steps_per_epoch == 0:  # fewer examples than one batch: no epoch to draw from
        raise UsageError(
            f"{len(train_pairs)} training pairs make no optimizer step of {pairs_per_step} x "
            f"{args.gradient_accumulation_steps} pairs: lower --batch-size or --gradient-accumulation-steps."
        )
    batches = Batches(args, accelerator, tokenizer, steps_per_epoch)
    model, optimizer, scheduler = load_model(args, accelerator, tokenizer, quantization, total_steps)
    accelerator.print(
        f"{len(train_pairs)} training / {len(eval_pairs)} eval pairs; {total_steps} optimizer steps; each "
        f"epoch reshuffles and leaves out {len(train_pairs) % pairs_per_step} pairs"
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
    first_eval, start_time = evaluate(args, accelerator, model, eval_pairs, batches, logger, start_step), time.time()
    first_eval = resumed.get("first_eval", first_eval)  # after a resume the summary compares with the run's start
    model.train()
    progress = tqdm(range(start_step, total_steps), disable=not accelerator.is_local_main_process, desc="reward model")
    for step in progress:
        step_start = time.time()
        # 1. the Bradley-Terry loss of each micro-batch of pairs, accumulated into one optimizer step
        for micro in range(args.gradient_accumulation_steps):
            with accelerator.accumulate(model):
                batch = batches.micro_batch(train_pairs, step * args.gradient_accumulation_steps + micro)
                loss, metrics = pair_metrics(args, model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

        # 2. bookkeeping: one collective and one device sync for all the metrics
        norm = plain(grad_norm) if grad_norm is not None else 0.0
        metrics["grad_norm"] = torch.as_tensor(norm, device=accelerator.device).float()
        values = accelerator.reduce(torch.stack(list(metrics.values())).float(), "mean").tolist()
        metrics = {f"train/{k}": v for k, v in zip(metrics, values)}
        check_finite(step + 1, {k: metrics[k] for k in ("train/loss", "train/grad_norm")})
        step_time = time.time() - step_start
        logger.log(
            metrics
            | {
                "train/learning_rate": scheduler.get_last_lr()[0],
                "train/epoch": (step + 1) * args.gradient_accumulation_steps / steps_per_epoch,
                "time/step": step_time,
                "throughput/pairs_per_s": pairs_per_step * args.gradient_accumulation_steps / step_time,
            },
            step + 1,
        )
        progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/accuracy']:.2f}")
        if (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            evaluate(args, accelerator, model, eval_pairs, batches, logger, step + 1)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"step_{step + 1}")
            state = {"step": step + 1, "first_eval": first_eval}
            unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
            save_checkpoint(accelerator, folder, state, unwrapped, tokenizer, total_limit=args.save_total_limit)

    # 3. the final evaluation, the normalisation (lm-human-preferences), the save and the summary
    last_eval = evaluate(args, accelerator, model, eval_pairs, batches, logger, total_steps)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    gain, bias = normalization(args, accelerator, unwrapped, train_pairs, batches)
    save(args, accelerator, model, unwrapped, tokenizer, gain, bias, last_eval)
    accelerator.print(
        f"reward model: {total_steps - start_step} steps in {time.time() - start_time:.0f}s; eval accuracy "
        f"{first_eval['eval/accuracy']:.3f} -> {last_eval['eval/accuracy']:.3f}, "
        f"loss {first_eval['eval/loss']:.3f} "
        f"-> {last_eval['eval/loss']:.3f}; model saved to {args.output_dir}"
    )
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
