"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) and its successors, with verifiable
rewards, in TRL 1.x GRPOTrainer semantics: Dr. GRPO (Liu et al. 2025), DAPO (Yu et al. 2025), GSPO (Zheng et al. 2025).

No critic: each prompt is answered `num_generations` (G) times, every completion is scored by plain Python reward
functions (a verifier of the answer, a format check, ...), and a completion's advantage is its reward minus the mean
reward of its group (divided by the group's std, unless --scale-rewards none). The policy then takes `num_iterations`
passes of PPO's clipped objective over the completions, token by token (or per sequence: GSPO), optionally with a
k3 KL penalty to a reference model (beta > 0).

Usage:
    python grpo.py                                  # offline: builtin:tiny-arith on reasoning-gym's chain_sum problems
    python grpo.py --loss-type dr_grpo --scale-rewards none                 # Dr. GRPO
    python grpo.py --epsilon-high 0.28 --mask-truncated-completions --drop-zero-std-groups --overlong-buffer 2  # DAPO
    accelerate launch grpo.py --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset-name reasoning-gym:countdown \\
        --reward-funcs verifier format --max-completion-length 256
"""

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import gather_object
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_scheduler

from agents import Agent, Episodes, episode_text
from common.chat import text_of
from common.core import UsageError, check_args, exact_div, masked_mean, warn_once, weight_decay_groups
from common.loading import context_length, load_pretrained, load_tokenizer
from common.models import create_reference_model, peft_model_of, place_frozen, reference_context
from common.run import (
    atomic_directory,
    check_finite,
    cli,
    end_run,
    full_weights,
    load_checkpoint,
    rank_batches,
    save_checkpoint,
    start_run,
    write_model_card,
)
from fast_paths import FastGenerator, sampling_kwargs
from rewards import (
    degenerate_batch,
    distinct_answers,
    is_number,
    load_rewards,
    load_task,
    prompt_ids,
    score_completions,
)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (each rank adds its index)"""
    data_seed: int | None = None
    """seed of the problems and of the held-out split (TRL's `data_seed`); default: --seed. Fixed while --seed varies,
    seeds change only the training order, the initialisation and the sampling"""
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
    model_name: str = "builtin:tiny-arith"
    """the policy: a hub id, a local folder, or a built-in (builtin:tiny-arith: a small GPT-2 warm-started on the default
    task's answers, built on first use)"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype of every model of the run: float32 as TRL (weights that train need it; mixed precision comes from
    `accelerate launch --mixed_precision bf16`), bfloat16 for frozen weights, auto for each checkpoint's own"""
    dataset_name: str = "reasoning-gym:chain_sum"
    """reasoning-gym:<task> (seeded train and held-out problems, scored by the task's own verifier), or a hub id /
    local json/jsonl/csv/parquet file with a prompt column and an answer column"""
    task_config: str = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    """reasoning-gym only: the task's options as JSON (the default: sums and differences of two one-digit numbers)"""
    train_size: int = 2000
    """reasoning-gym only: problems generated for training (seed: --seed)"""
    eval_size: int = 64
    """reasoning-gym only: distinct held-out problems (drawn with seed + 1); no training row repeats their questions"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    prompt_column: str = "prompt"
    """the prompt column (reasoning-gym: the question)"""
    answer_column: str = "answer"
    """the reference answer column; every column reaches the reward functions by name"""
    eval_fraction: float = 0.05
    """hub / local data: fraction held out for evaluation"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens keep their last ones"""
    chat_template: bool = True
    """render string prompts as one user message with the tokenizer's chat template, when it has one (messages always
    are); --no-chat-template sends them as raw text, as TRL does with string prompts"""
    system_prompt: str | None = None
    """a system message put before every chat prompt that has none (None: the template's default, if any)"""
    task_instruction: str = "Give only the final answer."
    """appended to each reasoning-gym question when it is rendered as a chat (the answer is then its last number)"""

    # Rewards
    reward_funcs: list[str] = field(default_factory=lambda: ["verifier"])
    """reward functions, summed with --reward-weights: verifier (the task's answer check), format (one line ending with
    EOS), or "module:function" / "file.py:function", a callable (prompts, completions, **columns) -> list[float | None]"""
    reward_model: str | None = None
    """a trained sequence classifier as one more reward (hub id, folder from reward_modeling.py, builtin:tiny-chat-rm),
    scored on "prompt completion<eos>"; its weight is the last of --reward-weights"""
    reward_label: str | None = None
    """which logit of --reward-model is the reward: a label name or an index; None: a single-logit head"""
    reward_weights: list[float] | None = None
    """one weight per reward function, then one for --reward-model (None: all 1)"""

    # GRPO (defaults: TRL 1.x GRPOConfig, except the learning rate and sizes, set for the tiny default)
    total_prompts: int = 7680
    """prompts answered over the run, across all processes (each num_generations times)"""
    batch_size: int = 16
    """prompts per update on each process"""
    num_generations: int = 8
    """G: completions per prompt, normalised together"""
    mini_batch_size: int = 32
    """completions per forward/backward pass"""
    gradient_accumulation_steps: int = 4
    """mini-batches per optimizer step (the default: one step per generation batch of 16 x 8 completions)"""
    num_iterations: int = 1
    """mu: passes of the clipped objective over each generation batch"""
    learning_rate: float = 1e-4
    """AdamW learning rate (TRL: 1e-6, for billion-parameter models; the tiny default policy needs more)"""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """the learning rate over the run: constant, or decayed to 0 by its last step (TRL: linear)"""
    weight_decay: float = 0.0
    """AdamW weight decay (biases and norm weights are not decayed)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    beta: float = 0.0
    """coefficient of the k3 KL penalty to the reference model in the loss (TRL's default 0: no reference model)"""
    epsilon: float = 0.2
    """clip range below 1 (and above 1 unless --epsilon-high)"""
    epsilon_high: float | None = None
    """clip range above 1 (DAPO's clip-higher: 0.28); None: epsilon"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """aggregation of the per-token losses: grpo (per sequence, then mean), bnpo (a mini-batch's tokens), dr_grpo
    (sum / (sequences * max_completion_length)), dapo (the completion tokens of the whole step; TRL's default)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantages divided by the group's reward std (GRPO), the batch's (batch), or not at all (Dr. GRPO)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio per token (GRPO); sequence: one ratio per completion from its mean log-ratio (GSPO)"""
    mask_truncated_completions: bool = False
    """DAPO: completions cut by max_completion_length (no EOS) take no part in the loss"""
    drop_zero_std_groups: bool = False
    """DAPO's dynamic sampling, as a filter: groups whose rewards are all equal (no signal) are left out of the loss"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: completions longer than max_completion_length - overlong_buffer lose up to
    overlong_penalty, linearly (0: off)"""
    overlong_penalty: float = 1.0
    """the largest overlong punishment"""

    # Generation
    max_completion_length: int = 32
    """new tokens per completion"""
    temperature: float = 1.0
    """sampling temperature (log-probs use it too)"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    inverse_cdf_sampling: bool = True
    """draw each token by inverse CDF, HF's `do_sample=True` distribution at a fraction of its CPU time
    (fast_paths.py); --no-inverse-cdf-sampling: HF's own sampling"""
    fast_generation: bool = True
    """on CUDA, sample with `FastGenerator` (static KV cache, compiled decoding step; not with FSDP / DeepSpeed);
    --no-fast-generation: HF `generate`"""

    # Tools and environments: multi-turn episodes (agents.py)
    tools: list[str] = field(default_factory=list)
    """functions the model may call: calculator (built-in), or "module:function" / "file.py:function", each with type
    hints and a docstring (its JSON schema reaches the model through the chat template's tools=)"""
    environment: str | None = None
    """an environment class, one instance per episode: guess_number (built-in) or "file.py:Class"; reset(**row) starts
    it, its public methods are the episode's tools, its get_reward() one more reward (TRL's environment_factory)"""
    max_tool_calling_iterations: int | None = None
    """rounds of tool calls per episode (None: as many as --max-completion-length allows, which bounds the model's and
    the tools' tokens together)"""
    tool_timeout: float = 10.0
    """seconds a tool call may run; a slower one becomes an error message to the model, counted as a failure"""
    chat_template_path: str | None = None
    """a Jinja chat template that renders tools, calls and results (None: the tokenizer's own if it can, else
    agents.TOOL_TEMPLATE for ChatML models such as SmolLM2)"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters (merged at the end); with beta > 0 the reference is the adapter-disabled policy"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""

    # Logging, evaluation, saving
    log_freq: int = 10
    """print a table of sample completions every this many updates"""
    eval_freq: int = 80
    """evaluate on the held-out problems every this many updates (and at the start and the end)"""
    eval_samples: int = 200
    """held-out prompts per evaluation (at most), one completion each, sampled as in training with a fixed seed"""
    save_freq: int = 0
    """write a resumable checkpoint every this many updates to {output_dir}_checkpoints/update_N (0: only the final
    model): the policy in from_pretrained format beside accelerate's state"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from (policy, optimizer, scheduler, RNG, update)"""
    output_dir: str = "outputs/grpo"
    """where the final model and tokenizer go (plain from_pretrained format)"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"):
    """Group-relative advantages (Shao et al. 2024, Section 4.1.2; TRL 1.x), rewards [N] with N = groups x G in group
    order: A_i = r_i - mean(group), divided by std(group) + 1e-4 ("group"), std(batch) + 1e-4 ("batch") or nothing
    ("none", Dr. GRPO). NaN rewards (unscorable) are left out of the statistics and get advantage 0. Standard
    deviations are Bessel-corrected. Returns (advantages [N], is_std_zero [N]: the group's rewards are all equal)."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.nanmean(1, keepdim=True)
    std = nanstd(grouped, dim=1).unsqueeze(1).expand_as(grouped).reshape(-1)
    advantages = (grouped - mean).reshape(-1)
    is_std_zero = torch.isclose(std, torch.zeros_like(std)) | std.isnan()
    if scale_rewards == "group":
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(rewards) + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}: choose group, batch or none.")
    return torch.nan_to_num(advantages, nan=0.0), is_std_zero


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation over the non-NaN values (NaN with fewer than two)."""
    keep = ~values.isnan()
    count = keep.sum(dim) if dim is not None else keep.sum()
    mean = values.nanmean(dim, keepdim=dim is not None)
    squares = torch.where(keep, (values - mean) ** 2, 0.0)
    return (squares.sum(dim) if dim is not None else squares.sum()).div(count - 1).sqrt()


def grpo_loss(
    logprobs,
    old_logprobs,
    ref_logprobs,
    advantages,
    mask,
    beta,
    epsilon_low,
    epsilon_high,
    loss_type,
    max_completion_length,
    importance_sampling_level="token",
    num_items_in_batch=None,
):
    """The clipped surrogate of GRPO and its successors (TRL 1.x `GRPOTrainer._compute_loss`).

    logprobs, old_logprobs, ref_logprobs, mask: [B, T]; advantages: [B]. The ratio is exp(logp - old_logp) per token,
    or per sequence from the masked mean log-ratio (GSPO, "sequence"); per-token loss
    -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * (exp(ref - logp) - (ref - logp) - 1) (k3 KL,
    when beta > 0). Aggregation: grpo (masked mean per sequence, then mean), bnpo (masked mean over all tokens),
    dr_grpo (sum / (B * max_completion_length)), dapo (sum / num_items_in_batch: the completion tokens of the whole
    optimizer step divided by the number of processes, which DDP's gradient average turns into the global count).
    Returns (loss, stats): for the clip fractions (low / high / region) and the KL, their [sum, count] over the masked
    tokens (over the sequences with GSPO's one ratio each), so that the caller weights them by tokens across
    mini-batches and processes, as TRL 1.x logs them.
    """
    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion, its tokens' mean log-ratio
        log_ratio = masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1)
    elif importance_sampling_level != "token":
        raise ValueError(f"Unknown importance_sampling_level {importance_sampling_level!r}: choose token or sequence.")
    ratio = torch.exp(log_ratio)  # [B, T] or [B, 1]
    advantages = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)  # Schulman et al. 2017, eq. 7
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1  # k3, Schulman 2020: unbiased, >= 0
        per_token_loss = per_token_loss + beta * kl
    per_token_loss = per_token_loss.expand_as(mask)
    if loss_type == "grpo":
        loss = masked_mean(per_token_loss, mask, axis=-1).mean()
    elif loss_type == "bnpo":
        loss = masked_mean(per_token_loss, mask)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        loss = (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}: choose grpo, bnpo, dr_grpo or dapo.")
    with torch.no_grad():

        def sum_count(values):  # TRL's global_masked_mean, before the sum over processes
            if values.shape[1] == 1:  # one value per sequence (GSPO's ratio)
                return torch.stack([values.sum(), torch.tensor(float(len(values)), device=values.device)])
            return torch.stack([(values * mask).sum(), mask.sum()])

        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
        stats = {
            "clip_ratio/low_mean": sum_count(low),
            "clip_ratio/high_mean": sum_count(high),
            "clip_ratio/region_mean": sum_count(torch.maximum(low, high)),
        }
        if kl is not None:
            stats["kl"] = sum_count(kl)
    return loss, stats


def main(args: Args) -> None:
    """The run: setup (the helpers below the loop), then the loop in its numbered phases, then the final save."""
    check(args)
    # accumulate(): DDP syncs and DeepSpeed steps only at each optimizer step's last mini-batch
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    device, world = accelerator.device, accelerator.num_processes
    per_process = args.batch_size * args.num_generations  # completions per generation batch on each process
    step_size = args.mini_batch_size * args.gradient_accumulation_steps  # completions per optimizer step
    exact_div(per_process, step_size, "batch_size * num_generations / (mini_batch_size * gradient_accumulation_steps)")
    num_updates = exact_div(args.total_prompts, args.batch_size * world, "total_prompts / (batch_size * world_size)")
    run_name, logger = start_run(args, accelerator)
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    agent = Agent(args, tokenizer) if args.tools or args.environment else None  # multi-turn episodes with tools
    schemas = agent.schemas if agent else None
    train_rows, eval_rows, chat = load_task(args, tokenizer, args.prompt_column, args.max_prompt_length, schemas)
    if agent and not chat:
        raise UsageError("--tools / --environment need chat prompts: drop --no-chat-template.")
    if agent and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UsageError(  # a sharded forward is a collective: every rank would have to take as many turns
            "--tools / --environment under FSDP / DeepSpeed: episodes take different numbers of turns on each rank; "
            "use DDP (configs/multi_gpu.yaml)."
        )
    eval_rows = eval_rows[: args.eval_samples]
    batches_per_epoch = len(train_rows) // (args.batch_size * world)
    if batches_per_epoch == 0:
        raise UsageError(f"{len(train_rows)} training prompts are fewer than one batch of {args.batch_size * world}.")
    reward_funcs = load_rewards(args.reward_funcs, train_rows, device, chat, args.reward_model, args.reward_label, args.dtype)
    weights = args.reward_weights or [1.0] * len(reward_funcs)  # one each: check()
    if agent and agent.reward_function():  # the environment's get_reward(), weight 1 (TRL)
        reward_funcs, weights = reward_funcs + [agent.reward_function()], weights + [1.0]
    if not reward_funcs:
        raise UsageError("no reward: give --reward-funcs, --reward-model, or an --environment with get_reward().")
    weights = torch.tensor(weights, device=device)
    distinct = len({json.dumps(r["prompt"]) for r in train_rows})
    accelerator.print(
        f"{len(train_rows)} training prompts ({distinct} distinct), {len(eval_rows)} held out (none of them among the "
        f"training prompts){', rendered by the chat template' if chat else ''}; {num_updates} updates of "
        f"{args.batch_size * world} prompts x {args.num_generations} completions"
    )
    model, ref_model, optimizer, scheduler = load_models(args, accelerator, num_updates)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    render_ids = functools.partial(prompt_ids, tokenizer, chat=chat, system_prompt=args.system_prompt, tools=schemas)
    sampler = Sampler(args, tokenizer, unwrapped, accelerator, agent, render_ids)
    resumed = resume(args, accelerator, num_updates)  # after load_models: the reference keeps the initial weights
    start_update = resumed.get("update", 0)

    def score(rows, rollout):  # rewards [N, F] of the completions (decoded, or the episodes' messages) and their texts
        completions, mask, ended, episodes = rollout.completions, rollout.mask, rollout.ended, rollout.episodes
        ids = [row[m.bool()].tolist() for row, m in zip(completions, mask)]
        if episodes is None:
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            return score_completions(reward_funcs, rows, texts, ids, ended.tolist(), device), texts
        environments = rollout.environments if agent.factory else None
        rewards = score_completions(reward_funcs, rows, episodes.messages, ids, ended.tolist(), device, environments)
        return rewards, [episode_text(m) for m in episodes.messages]

    first_eval, start_time = evaluate(args, sampler, eval_rows, score, logger, start_update), time.time()
    first_eval, history = resumed.get("first_eval", first_eval), resumed.get("history", [])  # the run's start, kept
    degenerate = resumed.get("degenerate", 0)  # updates whose batch had nothing to learn from
    progress = tqdm(range(start_update, num_updates), disable=not accelerator.is_local_main_process, desc="grpo")
    for update in progress:
        update_start = time.time()
        # ================================ the algorithm ================================
        # 1. generate: G completions of each of this rank's prompts, the G of a prompt side by side (group order)
        epoch, i = divmod(update, batches_per_epoch)
        order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(args.seed + epoch))
        start = (i * world + accelerator.process_index) * args.batch_size
        rows = [train_rows[j] for j in order[start : start + args.batch_size].tolist() for _ in range(args.num_generations)]
        unwrapped.eval()
        rollout = sampler.rollout(rows)  # completions [N, T], N = batch_size * G; with tools, whole episodes
        prompts, prompt_mask, completions, mask = rollout.prompts, rollout.prompt_mask, rollout.completions, rollout.mask
        ended, model_mask = rollout.ended, rollout.model_mask  # model_mask: the policy's own tokens (not a tool's)
        generate_time = time.time() - update_start

        # 2. score: every reward function on every completion, a weighted sum; DAPO's overlong punishment
        rewards_per_func, completions_text = score(rows, rollout)  # [N, F]
        rewards = (rewards_per_func * weights).nansum(1)
        rewards[rewards_per_func.isnan().all(1)] = math.nan  # every function returned None: unscorable
        if args.overlong_buffer:
            lengths = model_mask.sum(1)
            over = (lengths - (args.max_completion_length - args.overlong_buffer)).clamp(min=0)
            rewards = rewards - args.overlong_penalty * over / args.overlong_buffer

        # 3. group advantages over every process's groups: A = r - mean(group), / std (group, batch or none)
        all_rewards = accelerator.gather(rewards)  # [world * N]: "batch" scaling uses the whole batch
        all_advantages, is_std_zero = group_advantages(all_rewards, args.num_generations, args.scale_rewards)
        local = slice(accelerator.process_index * len(rows), (accelerator.process_index + 1) * len(rows))
        advantages = all_advantages[local]
        loss_mask = model_mask.clone()  # tool and environment tokens: context, never loss
        if args.mask_truncated_completions:  # DAPO: a cut completion's tokens take no part in the loss
            loss_mask = loss_mask * ended[:, None].float()
        if args.drop_zero_std_groups:  # DAPO's dynamic sampling: equal rewards in a group carry no gradient
            loss_mask = loss_mask * (~is_std_zero[local])[:, None].float()

        # 4. old (and reference) log-probs: the policy that sampled, before any update of this batch. With one pass
        #    and one optimizer step per generation batch (the default) no mini-batch sees an updated policy, so the old
        #    log-probs are the training forward's own, detached (TRL skips this pass too)
        on_policy = args.num_iterations == 1 and step_size == len(rows)
        with torch.no_grad():
            old_logprobs, ref_logprobs = [], []
            for j in range(0, len(rows), args.mini_batch_size) if not on_policy or args.beta > 0 else ():
                mb = slice(j, j + args.mini_batch_size)
                inputs = (prompts[mb], prompt_mask[mb], completions[mb], mask[mb], args.temperature)
                if not on_policy:
                    old_logprobs.append(per_token_logprobs(unwrapped, *inputs)[0])
                if args.beta > 0:
                    with reference_context(unwrapped, ref_model), accelerator.autocast():
                        ref_logprobs.append(per_token_logprobs(ref_model or unwrapped, *inputs)[0])
            old_logprobs = torch.cat(old_logprobs) if old_logprobs else None
            ref_logprobs = torch.cat(ref_logprobs) if ref_logprobs else None

        # 5. optimise: num_iterations passes of the clipped objective over shuffled mini-batches
        model.train()
        stats_list, grad_norms = [], []
        for _ in range(args.num_iterations):
            permutation = torch.randperm(len(rows), device=device)
            for s in range(0, len(rows), step_size):
                step_indices = permutation[s : s + step_size]
                # dapo: the completion tokens of this optimizer step over every process, per process
                num_items = accelerator.reduce(loss_mask[step_indices].sum(), "sum") / world
                for mb in step_indices.split(args.mini_batch_size):
                    with accelerator.accumulate(model):
                        logprobs, entropy = per_token_logprobs(
                            model, prompts[mb], prompt_mask[mb], completions[mb], mask[mb], args.temperature, entropy=True
                        )
                        old = logprobs.detach() if old_logprobs is None else old_logprobs[mb]
                        ref = old if ref_logprobs is None else ref_logprobs[mb]  # unused at beta 0
                        loss, stats = grpo_loss(
                            logprobs,
                            old,
                            ref,
                            advantages[mb],
                            loss_mask[mb],
                            args.beta,
                            args.epsilon,
                            args.epsilon_high or args.epsilon,
                            args.loss_type,
                            args.max_completion_length,
                            args.importance_sampling_level,
                            num_items,
                        )
                        # accelerate divides by the accumulation steps (the step's gradient: the mini-batches' mean, for
                        # grpo / bnpo / dr_grpo); dapo's loss is already per token of the whole step
                        steps = args.gradient_accumulation_steps
                        accelerator.backward(loss * steps if args.loss_type == "dapo" else loss)
                        entropy_stats = torch.stack([(entropy * model_mask[mb]).sum(), model_mask[mb].sum()])
                        stats_list.append(stats | {"entropy": entropy_stats})
                grad_norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

        # ================================ bookkeeping ================================
        all_rewards_per_func = accelerator.gather(rewards_per_func)
        lengths, all_ended = accelerator.gather(model_mask.sum(1)), accelerator.gather(ended)
        metrics = {
            f"rewards/{spec}/{stat}": value
            for (spec, _), values in zip(reward_funcs, all_rewards_per_func.T)
            for stat, value in (("mean", values.nanmean().item()), ("std", nanstd(values).item()))
        }
        # each statistic weighted by tokens over the processes, per mini-batch, then the mean over mini-batches (TRL 1.x)
        totals = accelerator.reduce(torch.stack([torch.stack(list(s.values())) for s in stats_list]), "sum")
        step_stats = (totals[..., 0] / totals[..., 1].clamp(min=1.0)).mean(0)
        metrics |= {k: v for k, v in zip(stats_list[0], step_stats.tolist())}
        metrics |= {
            "reward": all_rewards.nanmean().item(),
            "reward_std": nanstd(all_rewards).item(),
            "frac_reward_zero_std": is_std_zero.float().mean().item(),
            "grad_norm": sum(float(g) for g in grad_norms if g is not None) / len(grad_norms),  # mean over the steps
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": 1 - all_ended.float().mean().item(),
            "charts/learning_rate": scheduler.get_last_lr()[0],
            "time/generate": generate_time,
            "time/step": time.time() - update_start,
        }
        if rollout.episodes is not None:
            metrics |= episode_metrics(accelerator, rollout)
        for reason in degenerate_batch(lengths, all_ended, all_rewards, args.mask_truncated_completions):
            degenerate += 1  # not silent: a warning line and a counter in the logs
            accelerator.print(f"warning: update {update + 1} has nothing to learn from: {reason}")
        metrics["degenerate_updates"] = degenerate
        check_finite(update + 1, {"grad_norm": metrics["grad_norm"]})
        logger.log(metrics, update + 1)
        history.append((metrics["reward"], metrics.get("kl", math.nan)))
        progress.set_postfix(reward=f"{metrics['reward']:.3f}", zero_std=f"{metrics['frac_reward_zero_std']:.2f}")
        if (update + 1) % args.log_freq == 0:
            samples = {"prompt": [text_of(r["prompt"]) for r in rows], "completion": completions_text}
            logger.samples("samples", samples | {"reward": rewards.tolist(), "advantage": advantages.tolist()}, update + 1)
        if args.eval_freq and (update + 1) % args.eval_freq == 0 and update + 1 < num_updates:
            evaluate(args, sampler, eval_rows, score, logger, update + 1)
        if args.save_freq and (update + 1) % args.save_freq == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"update_{update + 1}")
            state = {"update": update + 1, "first_eval": first_eval, "history": history, "degenerate": degenerate}
            save_checkpoint(accelerator, folder, state, unwrapped, tokenizer, total_limit=args.save_total_limit)

    # ---- final evaluation, save (plain from_pretrained format; LoRA merged) and summary ----
    last_eval = evaluate(args, sampler, eval_rows, score, logger, num_updates)
    save_final(args, accelerator, unwrapped, tokenizer, last_eval)
    window, done = max(1, len(history) // 10), num_updates - start_update  # updates this process ran
    first, last = np.mean(history[:window], 0), np.mean(history[-window:], 0)
    kl_text = f" (KL per token {last[1]:.3f})" if args.beta > 0 else ""
    accelerator.print(
        f"grpo: {done} updates, {done * args.batch_size * world} prompts x {args.num_generations} in "
        f"{time.time() - start_time:.0f}s; train reward {first[0]:.3f} -> {last[0]:.3f}{kl_text}; "
        f"eval reward {first_eval['eval/reward']:.3f} -> {last_eval['eval/reward']:.3f} (most frequent answer "
        f"{first_eval['eval/top_answer_share']:.0%} -> {last_eval['eval/top_answer_share']:.0%} of them); "
        f"model saved to {args.output_dir}"
        + (f" ({'sharded over' if sampler.sharded else 'weights identical on'} {world} ranks)" if world > 1 else "")
    )
    first_top, last_top = first_eval["eval/top_answer_share"], last_eval["eval/top_answer_share"]
    if last_top > max(0.2, 2 * first_top):  # a reward won by answering the same thing everywhere is not learning
        accelerator.print(
            f"warning: one answer fills {last_top:.0%} of the held-out completions ({first_top:.0%} at the "
            "start): the policy collapsed onto a few answers; lower --learning-rate"
        )
    end_run(accelerator, logger)  # every rank leaves together


# ================================ plumbing: what the loop above calls ================================
def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_args(
        args,
        positive=(
            "save_total_limit total_prompts batch_size mini_batch_size gradient_accumulation_steps num_iterations "
            "learning_rate max_grad_norm epsilon epsilon_high max_completion_length temperature max_prompt_length "
            "eval_samples log_freq train_size eval_size tool_timeout"
        ),
        non_negative=(
            "beta weight_decay top_k eval_freq save_freq overlong_buffer overlong_penalty max_tool_calling_iterations"
        ),
        fractions="eval_fraction",
    )
    if args.num_generations < 2:
        raise UsageError(f"--num-generations {args.num_generations}: a group needs at least 2 completions to compare.")
    if not 0 < args.top_p <= 1 or args.overlong_buffer >= args.max_completion_length:
        raise UsageError(
            f"--top-p {args.top_p} lies in (0, 1]; --overlong-buffer {args.overlong_buffer} must be below "
            f"--max-completion-length {args.max_completion_length}."
        )
    if not (args.tools or args.environment) and (args.chat_template_path or args.max_tool_calling_iterations is not None):
        warn_once("--chat-template-path and --max-tool-calling-iterations take effect with --tools or --environment")
    sources = len(args.reward_funcs) + (args.reward_model is not None)
    if args.reward_weights and len(args.reward_weights) != sources:
        raise UsageError(
            f"{len(args.reward_weights)} --reward-weights for {sources} rewards (--reward-funcs, then --reward-model): "
            "give one weight each."
        )


def load_models(args: Args, accelerator: Accelerator, num_updates: int):
    """The policy (LoRA with --use-peft) prepared with its AdamW optimizer and learning-rate schedule, and the frozen
    reference (None at beta 0, or with LoRA: the adapter-disabled policy is the reference)."""
    model = load_pretrained(args.model_name, AutoModelForCausalLM, dtype=args.dtype)
    context = context_length(model.config)
    if context and args.max_prompt_length + args.max_completion_length > context:
        raise UsageError(
            f"max_prompt_length ({args.max_prompt_length}) + max_completion_length "
            f"({args.max_completion_length}) exceeds the model's context of {context} tokens."
        )
    for module in model.modules():  # log-probs of sampling and training must agree (TRL disables dropout too)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if args.use_peft:
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, task_type="CAUSAL_LM"))
    ref_model = create_reference_model(model) if args.beta > 0 else None
    if ref_model is not None:
        ref_model = place_frozen(accelerator, ref_model)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, args.weight_decay), lr=args.learning_rate, fused=True)
    per_process = args.batch_size * args.num_generations
    steps_per_update = args.num_iterations * per_process // (args.mini_batch_size * args.gradient_accumulation_steps)
    # accelerate steps a prepared scheduler once per process per optimizer step
    total_steps = num_updates * steps_per_update * accelerator.num_processes
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    reference = "none (beta 0)" if args.beta == 0 else "frozen copy" if ref_model is not None else "adapter disabled"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(f"policy {args.model_name}: {trainable:,} trainable parameters; reference: {reference}")
    return model, ref_model, optimizer, scheduler


def resume(args: Args, accelerator: Accelerator, num_updates: int) -> dict:
    """The loop's state saved with --resume-from's checkpoint, whose weights and optimizer it restores ({} without)."""
    if not args.resume_from:
        return {}
    resumed = load_checkpoint(accelerator, args.resume_from)
    if resumed["update"] >= num_updates:
        raise UsageError(
            f"--resume-from {args.resume_from}: the checkpoint is at update {resumed['update']}, and this run "
            f"has {num_updates}: raise --total-prompts to train further."
        )
    accelerator.print(f"resumed from {args.resume_from} at update {resumed['update']}")
    return resumed


@dataclass
class Rollout:
    """Sampled completions: left-padded prompts [N, P] and their mask, right-padded completions [N, T], their mask (the
    context), the mask of the policy's own tokens (the loss; tool results excluded), whether each ended with EOS [N];
    with tools, the episodes (agents.Episodes) and their environments."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    completions: torch.Tensor
    mask: torch.Tensor
    model_mask: torch.Tensor
    ended: torch.Tensor
    episodes: Episodes | None = None
    environments: list | None = None


class Sampler:
    """Left-padded prompts and sampled completions of the policy: HF `generate` with the inverse-CDF draw, or on CUDA
    `FastGenerator` (the same distribution); with an `agent`, multi-turn episodes with tools (agents.py)."""

    def __init__(self, args: Args, tokenizer, policy, accelerator: Accelerator, agent=None, render_ids=None):
        self.args, self.tokenizer, self.policy, self.accelerator = args, tokenizer, policy, accelerator
        self.agent, self.render_ids = agent, render_ids
        self.sampling = sampling_kwargs(args.temperature, args.top_k, args.top_p, args.inverse_cdf_sampling)
        self.fast = None
        self.sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        if (
            args.fast_generation
            and accelerator.device.type == "cuda"
            and args.inverse_cdf_sampling
            and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
        ):
            self.fast = FastGenerator(policy, args.temperature, args.top_k, args.top_p)
        accelerator.print(f"rollouts: {'compiled static-cache decoding' if self.fast else 'HF generate'}")
        if agent:
            tools = ", ".join(s["function"]["name"] for s in agent.schemas)
            accelerator.print(f"episodes: tools {tools}; chat template: {agent.template}")

    def pad_left(self, token_lists: list[list[int]]):
        batch = self.tokenizer.pad({"input_ids": token_lists}, return_tensors="pt")
        return batch["input_ids"].to(self.accelerator.device), batch["attention_mask"].to(self.accelerator.device)

    def rollout(self, rows: list[dict]) -> Rollout:
        """One completion of each row's prompt; with tools, one episode each, advanced together turn by turn."""
        if self.agent is None:
            prompts, prompt_mask = self.pad_left([r["prompt_ids"] for r in rows])
            completions, mask, ended = self.generate(prompts, prompt_mask)
            return Rollout(prompts, prompt_mask, completions, mask, mask, ended)

        def generate(contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
            completions, mask, _ = self.generate(*self.pad_left(contexts), max_new_tokens)
            return [row[m.bool()].tolist() for row, m in zip(completions, mask)]

        episodes, environments = self.agent.run(rows, generate, self.render_ids)
        device, width = self.accelerator.device, max(1, *map(len, episodes.completion_ids))
        padded = lambda lists, value: torch.tensor([x + [value] * (width - len(x)) for x in lists], device=device)  # noqa: E731
        completions = padded(episodes.completion_ids, self.tokenizer.pad_token_id)
        mask = padded([[1] * len(x) for x in episodes.completion_ids], 0).float()
        model_mask = padded(episodes.model_mask, 0).float()
        ended = torch.tensor(episodes.ended, device=device)
        return Rollout(*self.pad_left(episodes.prompt_ids), completions, mask, model_mask, ended, episodes, environments)

    @torch.no_grad()
    def generate(self, prompts, prompt_mask, max_new_tokens: int | None = None):
        """Completions [N, T] cut after the first EOS, their mask [N, T] and whether each ended with EOS [N]."""
        tokenizer, length = self.tokenizer, max_new_tokens or self.args.max_completion_length
        with self.accelerator.autocast():
            if self.fast is not None:
                completions = self.fast(prompts, prompt_mask, length, tokenizer.eos_token_id, tokenizer.pad_token_id)[0]
            else:
                out = self.policy.generate(
                    input_ids=prompts,
                    attention_mask=prompt_mask,
                    **self.sampling,
                    max_new_tokens=length,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    synced_gpus=self.sharded,  # every rank decodes until all are done: each step is a collective
                )
                completions = out[:, prompts.shape[1] :]
        is_eos = completions == tokenizer.eos_token_id
        ended = is_eos.any(1)
        last = torch.where(ended, is_eos.float().argmax(1), completions.shape[1] - 1)
        mask = torch.arange(completions.shape[1], device=completions.device)[None] <= last[:, None]
        return completions.masked_fill(~mask, tokenizer.pad_token_id), mask.float(), ended


def per_token_logprobs(net, prompts, prompt_mask, completions, completion_mask, temperature: float, entropy: bool = False):
    """log pi(completion token) [N, T], logits / temperature as in sampling, and with `entropy` the policy's entropy
    [N, T] (for the logs; None otherwise)."""
    input_ids = torch.cat([prompts, completions], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    T = completions.shape[1]
    logits = net(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1).logits
    logits = logits[:, :-1]
    if temperature != 1.0:  # a full-vocabulary copy, skipped at temperature 1
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)  # once, for both the log-probs and the entropy
    with torch.no_grad():
        entropies = -logp.exp().mul_(logp).sum(-1) if entropy else None  # H = -sum_v p_v log p_v, one buffer
    return logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1), entropies


@torch.no_grad()
@torch.random.fork_rng()  # evaluation draws from its own RNG: how often it runs never changes training
def evaluate(args: Args, sampler: Sampler, eval_rows: list[dict], score, logger, update: int) -> dict[str, float]:
    """The held-out verifier score: one completion per held-out prompt (this rank's share), sampled as in training
    (TRL's evaluation) with the same seed at every evaluation, scored by the first reward function."""
    accelerator, device = sampler.accelerator, sampler.accelerator.device
    torch.manual_seed(args.seed + accelerator.process_index)
    sampler.policy.eval()
    totals, tools = torch.zeros(3, device=device), 0
    table = {"prompt": [], "completion": [], "answer": [], "score": []}
    for chunk, weight in rank_batches(eval_rows, 64, accelerator):  # this rank's share, as many chunks on every rank
        rollout = sampler.rollout(chunk)
        scores, texts = score(chunk, rollout)
        scores = scores[:, 0]
        count = torch.tensor(len(chunk), device=device)
        totals += weight * torch.stack([scores.nan_to_num().sum(), rollout.model_mask.sum(), count])
        if sampler.agent is not None:  # tool use on the held-out prompts, pooled over the chunks
            tools = tools + weight * episode_totals(rollout)
        if weight:  # (not a rank's stand-in)
            table = {
                "prompt": table["prompt"] + [text_of(r["prompt"]) for r in chunk],
                "completion": table["completion"] + texts,
                "answer": table["answer"] + [r["answer"] for r in chunk],
                "score": table["score"] + scores.tolist(),
            }
    totals = accelerator.reduce(totals, "sum")
    # the share of the most frequent answer among every process's completions (a collapse shows here)
    completions = gather_object(table["completion"])
    top_share = distinct_answers(completions, all(is_number(r["answer"]) for r in eval_rows))[0]
    metrics = {
        "eval/reward": (totals[0] / totals[2]).item(),
        "eval/completion_length": (totals[1] / totals[2]).item(),
        "eval/top_answer_share": float(top_share),
    }
    if sampler.agent is not None:
        metrics |= {f"eval/{k}": v for k, v in episode_stats(accelerator.reduce(tools, "sum")).items()}
    logger.log(metrics, update)
    logger.samples("eval samples", table, update)
    return metrics


def episode_totals(rollout: Rollout) -> torch.Tensor:
    """Sums over a rollout's episodes: episodes, tool calls, failed calls, turns, the model's tokens, the tools' tokens."""
    e = rollout.episodes
    model_tokens, all_tokens = rollout.model_mask.sum(), rollout.mask.sum()
    values = [len(e.turns), sum(e.tool_calls), sum(e.failures), sum(e.turns), model_tokens, all_tokens - model_tokens]
    return torch.tensor([float(v) for v in values], device=rollout.mask.device)


def episode_stats(totals: torch.Tensor) -> dict[str, float]:
    """Per-episode means of `episode_totals` (summed over processes), and the share of the calls that failed."""
    episodes, calls, failures, turns, model_tokens, tool_tokens = totals.tolist()
    return {
        "tools/call_frequency": calls / episodes,  # TRL's name: tool calls per episode
        "tools/failure_frequency": failures / calls if calls else 0.0,  # TRL's name: the share of calls that failed
        "episodes/turns": turns / episodes,
        "episodes/model_tokens": model_tokens / episodes,
        "episodes/tool_tokens": tool_tokens / episodes,
    }


def episode_metrics(accelerator: Accelerator, rollout: Rollout) -> dict[str, float]:
    """The tool-use metrics of an update's episodes, pooled over the processes."""
    return episode_stats(accelerator.reduce(episode_totals(rollout), "sum"))


def save_final(args: Args, accelerator: Accelerator, policy, tokenizer, metrics: dict) -> None:
    """The trained policy in plain from_pretrained format (LoRA merged), with its tokenizer and model card, written
    atomically; first a check that DDP kept every rank's weights the same."""
    weights = full_weights(accelerator, policy)  # gathered on the main process when sharded (every rank calls it)
    if weights is None:  # replicated: every rank holds the same weights
        checksums = accelerator.gather(torch.stack([p.detach().float().sum() for p in policy.parameters()]).sum()[None])
        if not torch.allclose(checksums, checksums[0].expand_as(checksums)):
            raise RuntimeError(f"the ranks' weights differ (parameter sums {checksums.tolist()})")
    policy = policy.merge_and_unload() if peft_model_of(policy) is not None else policy
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_directory(args.output_dir) as tmp:
            policy.save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            write_model_card(tmp, args, "grpo", metrics)


if __name__ == "__main__":
    main(cli(Args))
