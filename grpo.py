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

import importlib
import importlib.util
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from accelerate import Accelerator, DistributedType
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_scheduler

from common import (
    FastGenerator,
    UsageError,
    atomic_directory,
    check_args,
    check_columns,
    cli,
    context_length,
    create_reference_model,
    end_run,
    exact_div,
    load_checkpoint,
    load_data,
    load_pretrained,
    load_reward_model,
    load_tokenizer,
    peft_model_of,
    reference_context,
    reward_model_text,
    sampling_kwargs,
    save_checkpoint,
    start_run,
    train_eval_split,
    weight_decay_groups,
    write_model_card,
)


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
    model_name: str = "builtin:tiny-arith"
    """the policy: a hub id, a local folder, or builtin:tiny-arith (builtin:tiny-chat after a short SFT pass on the
    default task's answers, built on first use: a warm start that already answers some problems right)"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype every model of the run is loaded in. float32, TRL's default: Adam's small updates round away in bf16
    weights, so weights that train need it (mixed precision, `accelerate launch --mixed_precision bf16`, runs the matmuls
    in bf16). bfloat16 halves the memory of frozen weights (e.g. a LoRA base with --use-peft); auto keeps each
    checkpoint's dtype (transformers 5's default, bf16 for most hub models)"""
    dataset_name: str = "reasoning-gym:chain_sum"
    """reasoning-gym:<task> (seeded train and held-out problems, scored by the task's own verifier), or a hub id /
    local json/jsonl/csv/parquet file with a prompt column and an answer column"""
    task_config: str = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    """reasoning-gym only: the task's options as JSON (the default: sums and differences of two one-digit numbers)"""
    train_size: int = 2000
    """reasoning-gym only: problems generated for training (seed: --seed)"""
    eval_size: int = 200
    """reasoning-gym only: held-out problems (another seed: seed + 1)"""
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

    # Rewards
    reward_funcs: list[str] = field(default_factory=lambda: ["verifier"])
    """reward functions, summed with --reward-weights: verifier (reasoning-gym's score_answer, else an exact match
    with the answer column), format (1 if the completion is one line that ends with EOS), or "module:function" /
    "file.py:function", a callable (prompts, completions, **columns) -> list[float | None]"""
    reward_model: str | None = None
    """a reward model as one more reward function (TRL: a model in reward_funcs), logged as reward_model: a trained
    sequence classifier (a hub id, a folder written by reward_modeling.py, builtin:tiny-chat-rm) scored on
    "prompt completion<eos>" as reward_modeling.py trains it; its weight is the last of --reward-weights"""
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
    """AdamW learning rate (TRL: 1e-6 for billion-parameter models; the small default policy needs more: at 3e-4 it
    learns slower, at 1e-3 it collapses onto a few answers)"""
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
    """aggregation of the per-token losses: grpo (mean per sequence, then mean), bnpo (mean over a mini-batch's
    tokens), dr_grpo (sum / (sequences * max_completion_length)), dapo (sum / the completion tokens of the whole
    optimizer step across processes; TRL's default)"""
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
    max_completion_length: int = 8
    """new tokens per completion"""
    temperature: float = 1.0
    """sampling temperature (log-probs use it too)"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    inverse_cdf_sampling: bool = True
    """draw each token by inverse CDF (`common.InverseCDFSampler`): the distribution of HF's `do_sample=True`, whose
    torch.multinomial draws one exponential variate per vocabulary entry (on CPU, 3/4 of a rollout at GPT-2's 50k
    vocabulary); --no-inverse-cdf-sampling: HF's own sampling"""
    fast_generation: bool = True
    """on CUDA, sample completions with `common.FastGenerator`: a static KV cache, each decoding step's forward one compiled
    CUDA graph, the same distribution as the inverse-CDF `generate` (each new batch shape compiles first: 15-30 s on an
    H100). Not with FSDP or DeepSpeed; --no-fast-generation, --no-inverse-cdf-sampling and CPU use HF `generate`"""

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
    """held-out prompts per evaluation, one completion each, sampled as in training with a fixed seed"""
    save_freq: int = 0
    """write a resumable checkpoint every this many updates to {output_dir}_checkpoints/update_N (0: only the final
    model): the policy in from_pretrained format (with LoRA: the adapter) beside accelerate's state"""
    resume_from: str | None = None
    """a checkpoint folder to resume from (policy, optimizer, scheduler, RNG, update)"""
    output_dir: str = "outputs/grpo"
    """where the final model and tokenizer go (plain from_pretrained format)"""


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
    Returns (loss, stats: clip fractions low / high / region and the mean KL, each over the masked tokens).
    """
    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion, its tokens' mean log-ratio
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
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
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        loss = (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}: choose grpo, bnpo, dr_grpo or dapo.")
    with torch.no_grad():

        def share(flags):  # over the masked tokens
            return (flags.expand_as(mask).float() * mask).sum() / mask.sum().clamp(min=1.0)

        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        stats = {
            "clip_ratio/low_mean": share(low),
            "clip_ratio/high_mean": share(high),
            "clip_ratio/region_mean": share(low | high),
        }
        if kl is not None:
            stats["kl"] = share(kl)
    return loss, stats


def extract_answer(completion: str) -> str:
    """The answer in a completion: its first line, stripped."""
    return completion.strip().split("\n")[0].strip()


def verifier(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float | None]:
    """1 for a completion whose answer (`extract_answer`) the task accepts: reasoning-gym's own `score_answer` for a
    reasoning-gym task (in [0, 1]; a `rg_entry` column carries the problem), else an exact match with the answer."""
    if "rg_entry" in columns:
        import reasoning_gym

        scores = []
        for completion, entry in zip(completions, columns["rg_entry"]):
            entry = json.loads(entry)
            score = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
            scores.append(float(score(extract_answer(completion), entry)))
        return scores
    return [float(extract_answer(c) == str(a).strip()) for c, a in zip(completions, answer)]


def format_reward(prompts: list[str], completions: list[str], ended: list[bool], **columns) -> list[float | None]:
    """1 for a completion that is one non-empty line and ends with EOS (a clean, parseable answer), else 0."""
    return [float(e and bool(c.strip()) and "\n" not in c.strip()) for c, e in zip(completions, ended)]


REWARD_FUNCS = {"verifier": verifier, "format": format_reward}


def resolve_reward(spec: str):
    """A built-in reward function by name, or the function named by "module:function" or "file.py:function"."""
    if spec in REWARD_FUNCS:
        return REWARD_FUNCS[spec]
    if ":" not in spec:
        raise UsageError(f"Unknown reward function {spec!r}: choose {sorted(REWARD_FUNCS)} or give 'module:function'.")
    module_name, name = spec.rsplit(":", 1)
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise UsageError(f"--reward-funcs {spec}: no such file {module_name!r}.")
        module_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    if not callable(getattr(module, name, None)):
        raise UsageError(f"--reward-funcs {spec}: {module_name} has no function {name!r}.")
    return getattr(module, name)


def reward_model_function(name: str, label: str | None, device: torch.device, dtype: str = "float32"):
    """A trained sequence classifier as a reward function (`common.load_reward_model`): its `label` logit on
    "prompt completion<eos>" (the EOS only after a completion that ended), the text reward_modeling.py trains on."""
    model, index = load_reward_model(name, label, dtype)
    model, tokenizer = model.to(device), load_tokenizer(name, padding_side="right")

    @torch.no_grad()
    def reward_model(prompts: list[str], completions: list[str], ended: list[bool], **columns) -> list[float]:
        texts = [reward_model_text(p, c, tokenizer.eos_token, e) for p, c, e in zip(prompts, completions, ended)]
        batches = (
            tokenizer(texts[i : i + 64], padding=True, return_tensors="pt").to(device) for i in range(0, len(texts), 64)
        )
        return [x for batch in batches for x in model(**batch).logits[:, index].float().tolist()]

    return reward_model


def check_rewards(values, n: int, name: str) -> list[float]:
    """One number (or None) per completion, as floats with NaN for None; a one-line error otherwise."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise UsageError(
            f"reward function {name} returned {type(values).__name__} of length "
            f"{len(values) if hasattr(values, '__len__') else '?'} for {n} completions: return a list with "
            "one float (or None) each."
        )
    bad = [v for v in values if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v))]
    if bad:
        raise UsageError(f"reward function {name} returned {bad[0]!r}: every reward must be a finite number or None.")
    return [math.nan if v is None else float(v) for v in values]


def reasoning_gym_rows(task: str, config: dict, size: int, seed: int) -> list[dict]:
    """Seeded problems of a reasoning-gym task: prompt, answer, and the whole entry (for its verifier) as JSON."""
    import reasoning_gym

    try:
        problems = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (KeyError, ValueError, TypeError) as error:
        raise UsageError(
            f"reasoning-gym:{task} with {config}: {error} (reasoning_gym.factory.DATASETS lists the "
            "tasks; --task-config takes the task's options as JSON)."
        ) from None
    return [dict(prompt=e["question"], answer=str(e["answer"]), rg_entry=json.dumps(e, default=str)) for e in problems]


if __name__ == "__main__":
    args = cli(Args)
    check_args(
        args,
        positive=(
            "total_prompts batch_size mini_batch_size gradient_accumulation_steps num_iterations learning_rate "
            "max_grad_norm epsilon epsilon_high max_completion_length temperature max_prompt_length eval_samples "
            "log_freq train_size eval_size"
        ),
        non_negative="beta weight_decay top_k eval_freq save_freq overlong_buffer overlong_penalty",
        fractions="eval_fraction",
    )
    if args.num_generations < 2:
        raise UsageError(f"--num-generations {args.num_generations}: a group needs at least 2 completions to compare.")
    if not 0 < args.top_p <= 1 or args.overlong_buffer >= args.max_completion_length:
        raise UsageError(
            f"--top-p {args.top_p} lies in (0, 1]; --overlong-buffer {args.overlong_buffer} must be below "
            f"--max-completion-length {args.max_completion_length}."
        )
    accelerator = Accelerator()
    device, world = accelerator.device, accelerator.num_processes
    per_process = args.batch_size * args.num_generations  # completions per generation batch on each process
    exact_div(
        per_process,
        args.mini_batch_size * args.gradient_accumulation_steps,
        "batch_size * num_generations / (mini_batch_size * gradient_accumulation_steps)",
    )
    num_updates = exact_div(args.total_prompts, args.batch_size * world, "total_prompts / (batch_size * world_size)")
    reward_funcs = [(spec, resolve_reward(spec)) for spec in args.reward_funcs]  # (name, function); the model below
    sources = len(reward_funcs) + (args.reward_model is not None)
    weights = torch.tensor(args.reward_weights or [1.0] * sources, device=device)
    if len(weights) != sources:
        raise UsageError(
            f"{len(weights)} --reward-weights for {sources} rewards (--reward-funcs, then --reward-model): "
            "give one weight each."
        )
    run_name, logger = start_run(args, accelerator)

    # ---- data: prompts, reference answers and every other column (for the reward functions) ----
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    if args.dataset_name.startswith("reasoning-gym:"):
        task = args.dataset_name.split(":", 1)[1]
        try:
            config = json.loads(args.task_config)
        except json.JSONDecodeError as error:
            raise UsageError(f"--task-config {args.task_config!r} is not JSON ({error.msg}).") from None
        train_rows = reasoning_gym_rows(task, config, args.train_size, args.seed)
        eval_rows = reasoning_gym_rows(task, config, args.eval_size, args.seed + 1)
    else:
        dataset = load_data(args.dataset_name, args.dataset_split)
        check_columns(dataset, [args.prompt_column, args.answer_column], "--prompt-column / --answer-column")
        dataset = dataset.rename_columns({args.prompt_column: "prompt", args.answer_column: "answer"})
        train_data, eval_data = train_eval_split(dataset, args.eval_fraction, args.seed)
        train_rows, eval_rows = train_data.to_list(), eval_data.to_list()
    eval_rows = eval_rows[: args.eval_samples]
    overlap = len({r["prompt"] for r in eval_rows} & {r["prompt"] for r in train_rows}) / len(eval_rows)
    for rows in (train_rows, eval_rows):
        for row in rows:
            row["prompt_ids"] = tokenizer(row["prompt"])["input_ids"][-args.max_prompt_length :]
    batches_per_epoch = len(train_rows) // (args.batch_size * world)
    if batches_per_epoch == 0:
        raise UsageError(f"{len(train_rows)} training prompts are fewer than one batch of {args.batch_size * world}.")
    if args.reward_model is not None:
        reward_funcs.append(("reward_model", reward_model_function(args.reward_model, args.reward_label, device, args.dtype)))
    # every reward function on two real rows before any generation: a wrong length or a non-number fails now
    probe = {k: [r[k] for r in train_rows[:2]] for k in train_rows[0] if k != "prompt_ids"}
    for spec, func in reward_funcs:
        check_rewards(
            func(probe["prompt"], [" 0", " 1"], ended=[True, False], **{k: v for k, v in probe.items() if k != "prompt"}),
            2,
            spec,
        )
    accelerator.print(
        f"{len(train_rows)} training prompts, {len(eval_rows)} held out ({overlap:.0%} of them also among "
        f"the training prompts); {num_updates} updates of {args.batch_size * world} prompts x "
        f"{args.num_generations} completions"
    )

    # ---- models ----
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
    # beta 0 (the default) needs no reference model at all; with LoRA the reference is the adapter-disabled policy
    ref_model = create_reference_model(model) if args.beta > 0 else None
    if ref_model is not None:
        ref_model = ref_model.to(device)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, args.weight_decay), lr=args.learning_rate, fused=True)
    steps_per_update = args.num_iterations * per_process // (args.mini_batch_size * args.gradient_accumulation_steps)
    scheduler = get_scheduler("constant", optimizer, num_training_steps=num_updates * steps_per_update * world)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    unwrapped = accelerator.unwrap_model(model)
    reference = "none (beta 0)" if args.beta == 0 else "frozen copy" if ref_model is not None else "adapter disabled"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(f"policy {args.model_name}: {trainable:,} trainable parameters; reference: {reference}")
    start_update, resumed = 0, {}
    if args.resume_from:  # the reference above is the initial weights; the policy's come from the checkpoint
        resumed = load_checkpoint(accelerator, args.resume_from)
        start_update = resumed["update"]
        if start_update >= num_updates:
            raise UsageError(
                f"--resume-from {args.resume_from}: the checkpoint is at update {start_update}, and this run "
                f"has {num_updates}: raise --total-prompts to train further."
            )
        accelerator.print(f"resumed from {args.resume_from} at update {start_update}")

    def pad_left(rows: list[dict]):
        batch = tokenizer.pad({"input_ids": [r["prompt_ids"] for r in rows]}, return_tensors="pt")
        return batch["input_ids"].to(device), batch["attention_mask"].to(device)

    sampling = sampling_kwargs(args.temperature, args.top_k, args.top_p, args.inverse_cdf_sampling)
    fast_generator = None
    if (
        args.fast_generation
        and device.type == "cuda"
        and args.inverse_cdf_sampling
        and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
    ):
        fast_generator = FastGenerator(unwrapped, args.temperature, args.top_k, args.top_p)
    accelerator.print(f"rollouts: {'compiled static-cache decoding' if fast_generator else 'HF generate'}")

    @torch.no_grad()
    def generate(prompts, prompt_mask):
        """Completions [N, T] cut after the first EOS, their mask [N, T] and whether each ended with EOS [N]."""
        with accelerator.autocast():
            if fast_generator is not None:
                completions = fast_generator(
                    prompts, prompt_mask, args.max_completion_length, tokenizer.eos_token_id, tokenizer.pad_token_id
                )[0]
            else:
                out = unwrapped.generate(
                    input_ids=prompts,
                    attention_mask=prompt_mask,
                    **sampling,
                    max_new_tokens=args.max_completion_length,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
                completions = out[:, prompts.shape[1] :]
        is_eos = completions == tokenizer.eos_token_id
        ended = is_eos.any(1)
        last = torch.where(ended, is_eos.float().argmax(1), completions.shape[1] - 1)
        mask = torch.arange(completions.shape[1], device=device)[None] <= last[:, None]
        return completions.masked_fill(~mask, tokenizer.pad_token_id), mask.float(), ended

    def per_token_logprobs(net, prompts, prompt_mask, completions, completion_mask, entropy: bool = False):
        """log pi(completion token) [N, T], logits / temperature as in sampling, and with `entropy` the policy's
        entropy [N, T] (for the logs; None otherwise)."""
        input_ids = torch.cat([prompts, completions], 1)
        attention_mask = torch.cat([prompt_mask, completion_mask.long()], 1)
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
        T = completions.shape[1]
        logits = net(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1
        ).logits[:, :-1]
        if args.temperature != 1.0:  # a full-vocabulary copy, skipped at temperature 1
            logits = logits / args.temperature
        logp = torch.log_softmax(logits.float(), dim=-1)  # once, for both the log-probs and the entropy
        with torch.no_grad():
            entropies = -logp.exp().mul_(logp).sum(-1) if entropy else None  # H = -sum_v p_v log p_v, one buffer
        return logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1), entropies

    def score(rows: list[dict], completions_text: list[str], ended: list[bool]) -> torch.Tensor:
        """Rewards [N, F] of each completion by each reward function (NaN where a function returned None)."""
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "prompt_ids")}
        prompts_text = [r["prompt"] for r in rows]
        return torch.tensor(
            [
                check_rewards(f(prompts_text, completions_text, ended=ended, **columns), len(rows), spec)
                for spec, f in reward_funcs
            ],
            device=device,
        ).T

    @torch.no_grad()
    @torch.random.fork_rng()  # evaluation draws from its own RNG: how often it runs never changes training
    def evaluate(update: int) -> dict[str, float]:
        """The held-out verifier score: one completion per held-out prompt (this rank's share), sampled as in training
        (TRL's evaluation) with the same seed at every evaluation, scored by the first reward function."""
        torch.manual_seed(args.seed + accelerator.process_index)
        unwrapped.eval()
        share = eval_rows[accelerator.process_index :: world]
        rows, weight = share or eval_rows[:1], 1.0 if share else 0.0  # a rank without prompts scores one at weight 0
        totals = torch.zeros(3, device=device)
        table = {"prompt": [], "completion": [], "answer": [], "score": []}
        for i in range(0, len(rows), 64):
            chunk = rows[i : i + 64]
            completions, mask, ended = generate(*pad_left(chunk))
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            scores = score(chunk, texts, ended.tolist())[:, 0]
            totals += weight * torch.stack([scores.nan_to_num().sum(), mask.sum(), torch.tensor(len(chunk), device=device)])
            table = {
                "prompt": table["prompt"] + [r["prompt"] for r in chunk],
                "completion": table["completion"] + texts,
                "answer": table["answer"] + [r["answer"] for r in chunk],
                "score": table["score"] + scores.tolist(),
            }
        totals = accelerator.reduce(totals, "sum")
        answers = [extract_answer(c) for c in table["completion"]]  # collapse onto a few answers shows here
        top_share = accelerator.reduce(torch.tensor(max(map(answers.count, answers)) / len(answers), device=device), "mean")
        metrics = {
            "eval/reward": (totals[0] / totals[2]).item(),
            "eval/completion_length": (totals[1] / totals[2]).item(),
            "eval/top_answer_share": top_share.item(),
        }
        logger.log(metrics, update)
        logger.samples("eval samples", table, update)
        return metrics

    def write_policy(folder: str) -> None:
        """A checkpoint's from_pretrained files (with LoRA: the adapter) beside accelerate's state."""
        unwrapped.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    first_eval, start_time = evaluate(start_update), time.time()  # after a resume: logged at the resumed update,
    first_eval, history = resumed.get("first_eval", first_eval), resumed.get("history", [])  # and the run's start kept
    progress = tqdm(range(start_update, num_updates), disable=not accelerator.is_local_main_process, desc="grpo")
    for update in progress:
        update_start = time.time()
        # ================================ the algorithm ================================
        # 1. generate: G completions of each of this rank's prompts, the G of a prompt side by side (group order)
        epoch, i = divmod(update, batches_per_epoch)
        order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(args.seed + epoch))
        start = (i * world + accelerator.process_index) * args.batch_size
        rows = [train_rows[j] for j in order[start : start + args.batch_size].tolist() for _ in range(args.num_generations)]
        prompts, prompt_mask = pad_left(rows)
        unwrapped.eval()
        completions, mask, ended = generate(prompts, prompt_mask)  # [N, T], N = batch_size * G
        completions_text = tokenizer.batch_decode(completions, skip_special_tokens=True)
        generate_time = time.time() - update_start

        # 2. score: every reward function on every completion, a weighted sum; DAPO's overlong punishment
        rewards_per_func = score(rows, completions_text, ended.tolist())  # [N, F]
        rewards = (rewards_per_func * weights).nansum(1)
        rewards[rewards_per_func.isnan().all(1)] = math.nan  # every function returned None: unscorable
        if args.overlong_buffer:
            lengths = mask.sum(1)
            over = (lengths - (args.max_completion_length - args.overlong_buffer)).clamp(min=0)
            rewards = rewards - args.overlong_penalty * over / args.overlong_buffer

        # 3. group advantages over every process's groups: A = r - mean(group), / std (group, batch or none)
        all_rewards = accelerator.gather(rewards)  # [world * N]: "batch" scaling uses the whole batch
        all_advantages, is_std_zero = group_advantages(all_rewards, args.num_generations, args.scale_rewards)
        local = slice(accelerator.process_index * len(rows), (accelerator.process_index + 1) * len(rows))
        advantages = all_advantages[local]
        loss_mask = mask.clone()
        if args.mask_truncated_completions:  # DAPO: a cut completion's tokens take no part in the loss
            loss_mask = loss_mask * ended[:, None].float()
        if args.drop_zero_std_groups:  # DAPO's dynamic sampling: equal rewards in a group carry no gradient
            loss_mask = loss_mask * (~is_std_zero[local])[:, None].float()

        # 4. old (and reference) log-probs: the policy that sampled, before any update of this batch. With one pass
        #    and one optimizer step per generation batch (the default) no mini-batch sees an updated policy, so the old
        #    log-probs are the training forward's own, detached (TRL skips this pass too)
        step_size = args.mini_batch_size * args.gradient_accumulation_steps
        on_policy = args.num_iterations == 1 and step_size == len(rows)
        with torch.no_grad():
            old_logprobs, ref_logprobs = [], []
            for j in range(0, len(rows), args.mini_batch_size) if not on_policy or args.beta > 0 else ():
                mb = slice(j, j + args.mini_batch_size)
                inputs = (prompts[mb], prompt_mask[mb], completions[mb], mask[mb])
                if not on_policy:
                    old_logprobs.append(per_token_logprobs(unwrapped, *inputs)[0])
                if args.beta > 0:
                    with reference_context(unwrapped, ref_model), accelerator.autocast():
                        ref_logprobs.append(per_token_logprobs(ref_model or unwrapped, *inputs)[0])
            old_logprobs = torch.cat(old_logprobs) if old_logprobs else None
            ref_logprobs = torch.cat(ref_logprobs) if ref_logprobs else None

        # 5. optimise: num_iterations passes of the clipped objective over shuffled mini-batches
        model.train()
        stats_list, entropies = [], []
        for _ in range(args.num_iterations):
            permutation = torch.randperm(len(rows), device=device)
            for s in range(0, len(rows), step_size):
                step_indices = permutation[s : s + step_size]
                # dapo: the completion tokens of this optimizer step over every process, per process
                num_items = accelerator.reduce(loss_mask[step_indices].sum(), "sum") / world
                for mb in step_indices.split(args.mini_batch_size):
                    logprobs, entropy = per_token_logprobs(
                        model, prompts[mb], prompt_mask[mb], completions[mb], mask[mb], entropy=True
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
                    # grpo / bnpo / dr_grpo average each mini-batch: the step's gradient is their mean
                    accelerator.backward(loss if args.loss_type == "dapo" else loss / args.gradient_accumulation_steps)
                    stats_list.append(stats)
                    entropies.append((entropy * mask[mb]).sum() / mask[mb].sum().clamp(min=1))
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

        # ================================ bookkeeping ================================
        all_rewards_per_func = accelerator.gather(rewards_per_func)
        lengths = accelerator.gather(mask.sum(1))
        metrics = {
            f"rewards/{spec}/{stat}": value
            for (spec, _), values in zip(reward_funcs, all_rewards_per_func.T)
            for stat, value in (("mean", values.nanmean().item()), ("std", nanstd(values).item()))
        }
        step_stats = accelerator.reduce(torch.stack([torch.stack(list(s.values())) for s in stats_list]).mean(0), "mean")
        metrics |= {k: v for k, v in zip(stats_list[0], step_stats.tolist())}
        metrics |= {
            "reward": all_rewards.nanmean().item(),
            "reward_std": nanstd(all_rewards).item(),
            "frac_reward_zero_std": is_std_zero.float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": 1 - accelerator.gather(ended.float()).mean().item(),
            "entropy": accelerator.reduce(torch.stack(entropies).mean(), "mean").item(),
            "charts/learning_rate": scheduler.get_last_lr()[0],
            "time/generate": generate_time,
            "time/step": time.time() - update_start,
        }
        logger.log(metrics, update + 1)
        history.append((metrics["reward"], metrics.get("kl", math.nan)))
        progress.set_postfix(reward=f"{metrics['reward']:.3f}", zero_std=f"{metrics['frac_reward_zero_std']:.2f}")
        if (update + 1) % args.log_freq == 0:
            logger.samples(
                "samples",
                {
                    "prompt": [r["prompt"] for r in rows],
                    "completion": completions_text,
                    "reward": rewards.tolist(),
                    "advantage": advantages.tolist(),
                },
                update + 1,
            )
        if args.eval_freq and (update + 1) % args.eval_freq == 0 and update + 1 < num_updates:
            evaluate(update + 1)
        if args.save_freq and (update + 1) % args.save_freq == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"update_{update + 1}")
            save_checkpoint(
                accelerator, folder, {"update": update + 1, "first_eval": first_eval, "history": history}, write_policy
            )

    # ---- final evaluation and save (plain from_pretrained format; LoRA merged) ----
    last_eval = evaluate(num_updates)
    # DDP averages the gradients, so every rank must hold the same weights: checked, not assumed
    checksums = accelerator.gather(torch.stack([p.detach().float().sum() for p in unwrapped.parameters()]).sum()[None])
    if not torch.allclose(checksums, checksums[0].expand_as(checksums)):
        raise RuntimeError(f"the ranks' weights differ (parameter sums {checksums.tolist()})")
    policy = unwrapped.merge_and_unload() if peft_model_of(unwrapped) is not None else unwrapped
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_directory(args.output_dir) as tmp:
            policy.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_model_card(tmp, args, "grpo", last_eval)
    window, done = max(1, len(history) // 10), num_updates - start_update  # updates this process ran
    first, last = np.mean(history[:window], 0), np.mean(history[-window:], 0)
    kl_text = f" (KL per token {last[1]:.3f})" if args.beta > 0 else ""
    accelerator.print(
        f"grpo: {done} updates, {done * args.batch_size * world} prompts x {args.num_generations} in "
        f"{time.time() - start_time:.0f}s; train reward {first[0]:.3f} -> {last[0]:.3f}{kl_text}; "
        f"eval reward {first_eval['eval/reward']:.3f} -> {last_eval['eval/reward']:.3f} (most frequent answer "
        f"{first_eval['eval/top_answer_share']:.0%} -> {last_eval['eval/top_answer_share']:.0%} of them); "
        f"model saved to {args.output_dir}" + (f" (weights identical on {world} ranks)" if world > 1 else "")
    )
    first_top, last_top = first_eval["eval/top_answer_share"], last_eval["eval/top_answer_share"]
    if last_top > max(0.2, 2 * first_top):  # a reward won by answering the same thing everywhere is not learning
        accelerator.print(
            f"warning: one answer fills {last_top:.0%} of the held-out completions ({first_top:.0%} at the "
            "start): the policy collapsed onto a few answers; lower --learning-rate"
        )
    end_run(accelerator, logger)  # every rank leaves together
