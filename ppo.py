"""PPO for language models: RLHF as in Ziegler et al. 2019 (lm-human-preferences) and TRL 0.7-0.8's PPOTrainer.

Each update: sample queries, generate responses, score them (a reward function or a reward model), compute a
per-token reward = -kl_coef * KL(policy || reference) with the score added at the last response token, estimate
advantages with GAE, then run `ppo_epochs` of clipped PPO over mini-batches. Details follow "The N Implementation
Details of RLHF with PPO" (Huang et al. 2023): left padding with explicit position_ids, logprobs computed with the
sampling temperature, truncation after the first EOS, zero-initialised value head, dropout disabled.

Usage:
    python ppo.py                                   # offline: builtin:tiny-chat policy, chatterbot prompts, built-in RM
    accelerate launch ppo.py --learning-rate 1.41e-5
    accelerate launch --config_file configs/multi_gpu.yaml ppo.py --model-name gpt2 --reward-model outputs/reward_model
"""

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from tqdm.auto import tqdm
from transformers import get_scheduler

from common.chat import render, text_of, use_chat
from common.checkpoints import save_checkpoint, save_policy
from common.cli import cli
from common.core import (
    INVALID_LOGPROB,
    AdaptiveKLController,
    FixedKLController,
    LogitMask,
    RunningMoments,
    UsageError,
    check_args,
    clock,
    entropy_from_logprobs,
    epoch_rows,
    exact_div,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    pooled,
    sizes,
    warn_once,
)
from common.loading import (
    answers_as_text,
    check_columns,
    context_length,
    load_config,
    load_data,
    load_tokenizer,
    quantization_kwargs,
    train_eval_split,
)
from common.models import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PolicyAndCritic,
    check_lora_targets,
    create_reference_model,
    disable_dropout,
    load_critic,
    peft_model_of,
    place_frozen,
    reference_context,
)
from common.outputs import check_finite
from common.rewards import RewardAdapter, RewardModel, distinct_bigrams, load_rewards, load_task, score_completions
from common.rollout import resume
from common.run import end_run, start_run
from common.sampling import Sampler, check_sampling_args, decode, sampler_gap


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
    model_name: str = "builtin:tiny-chat"
    """the policy: a hub id, a local folder, or a built-in (builtin:tiny-chat: a small GPT-2 pretrained on the built-in
    dialogue, built on first use); encoder-decoder models (T5) are detected from their config"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype of every model of the run: float32 as TRL (weights that train need it; mixed precision comes from
    `accelerate launch --mixed_precision bf16`), bfloat16 for frozen weights, auto for each checkpoint's own"""
    dataset_name: str = "builtin:chatterbot-prompts"
    """prompts: a hub id, a local json/jsonl/csv/parquet file, or builtin:chatterbot-prompts"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    query_column: str = "prompt"
    """the dataset column holding the query text"""
    eval_fraction: float = 0.1
    """fraction of the prompts held out for evaluation"""
    max_query_length: int | None = None
    """queries longer than this many tokens are an error (or truncated from the left with --truncate-queries); None:
    any length that fits the model's context with max_new_tokens, as TRL takes its queries"""
    truncate_queries: bool = False
    """keep the last `max_query_length` tokens of long queries instead of stopping with an error"""
    chat_template: bool = True
    """render string queries as one user message with the tokenizer's chat template, when it has one (messages always
    are); --no-chat-template sends them as raw text"""
    system_prompt: str | None = None
    """a system message put before every chat query that has none (None: the template's default, if any)"""
    reward_model: str | None = "builtin:tiny-chat-rm"
    """a sequence-classification reward model: a hub id, a local folder (from reward_modeling.py), or
    builtin:tiny-chat-rm (built on first use); None: `reward_fn` in this file (VADER sentiment)"""
    reward_label: str | None = None
    """which logit of the reward model is the reward: a label name (e.g. POSITIVE) or an index; None: a single logit"""
    reward_adapter: str | None = None
    """instead of --reward-model: a LoRA reward adapter from `reward_modeling.py --use-peft`, loaded on the policy's base
    model, so one copy of the base weights is policy, reference and reward model (TRL's multi-adapter RL)"""
    reward_batch_size: int = 64
    """batch size of the reward model's forward passes"""
    reward_funcs: list[str] = field(default_factory=list)
    """instead of a reward model: verifiable reward functions with grpo.py's semantics (verifier, format, r1_format,
    "file.py:function"), summed with --reward-weights; the dataset's columns reach them by name"""
    reward_weights: list[float] | None = None
    """one weight per --reward-funcs function (None: all 1)"""
    gold_reward_funcs: list[str] = field(default_factory=list)
    """reward functions that are watched, never trained on (e.g. verifier beside a learned --reward-model): their means
    (env/gold/*, eval/gold/*) and their correlation with the reward, to see a reward model over-optimised"""
    answer_column: str = "answer"
    """the reference answer column (reasoning-gym: the task's answer) for --reward-funcs"""
    task_config: str = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    """reasoning-gym:<task> datasets only: the task's options as JSON (as in grpo.py)"""
    train_size: int = 2000
    """reasoning-gym only: problems generated for training (seed: --seed)"""
    eval_size: int = 64
    """reasoning-gym only: distinct held-out problems (drawn with seed + 1); no training row repeats their questions"""
    task_instruction: str = "Give only the final answer."
    """appended to each reasoning-gym question when it is rendered as a chat"""

    # Generation
    min_new_tokens: int = 16
    """each rollout batch generates L new tokens, L drawn uniformly from [min_new_tokens, max_new_tokens]
    (TRL's LengthSampler)"""
    max_new_tokens: int = 16
    """see min_new_tokens"""
    temperature: float = 1.0
    """sampling temperature; logprobs are computed from logits / temperature too (TRL 0.8 did not divide)"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    inverse_cdf_sampling: bool = True
    """draw each token by inverse CDF, HF's `do_sample=True` distribution at a fraction of its CPU time
    (common/fast_paths.py); --no-inverse-cdf-sampling: HF's own sampling"""
    fast_generation: bool = True
    """on CUDA, sample with `FastGenerator` (static KV cache, compiled decoding step; decoder-only policies without a logit
    mask, quantisation, FSDP or DeepSpeed); --no-fast-generation: HF `generate`"""
    stop_sequences: list[str] = field(default_factory=list)
    """responses are truncated after the first of these strings (trlX `stop_sequences`), as after an EOS"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of responses that end without EOS or a stop sequence (TRL PPOv2); None: none"""
    generation_batch_size: int | None = None
    """queries per `generate` call (None: the whole batch at once)"""
    logit_mask: str | None = None
    """trlX's logit mask: a JSON file {"token id": [ids allowed next], ...} (or trlX's dense [vocab][vocab] booleans),
    applied in sampling and in the policy's and the reference's log-probs"""

    # vLLM rollouts (docs/vllm.md): TRL 1.16's vllm_mode, "colocate" or "server"
    use_vllm: bool = False
    """sample through vLLM, an engine in each training process or a server (--vllm-mode; pip install -r
    requirements-vllm.txt, or requirements-vllm-cpu.txt), its weights synced after every update"""
    vllm_gpu_memory_utilization: float = 0.3
    """the share of GPU memory vLLM may take for weights and KV cache (TRL's default 0.3 in colocate mode)"""
    vllm_tensor_parallel_size: int = 1
    """training processes (GPUs) one vLLM engine spans, a shard on each; their prompts sampled together (TRL's
    vllm_tensor_parallel_size)"""
    vllm_enable_sleep_mode: bool = False
    """on CUDA, free vLLM's memory between rollouts (TRL's vllm_enable_sleep_mode)"""
    vllm_dtype: str = "auto"
    """vLLM's weights and compute: auto (the policy's --dtype, so that the sampler's log-probs match the trainer's),
    bfloat16, float16, float32"""
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

    # PPO (defaults: TRL 0.8 PPOConfig, except the learning rate and the controller's horizon, sized for the default)
    total_episodes: int = 960
    """total number of queries answered over the run, across all processes"""
    batch_size: int = 16
    """queries per PPO update on each process"""
    mini_batch_size: int = 8
    """samples per forward/backward pass in the optimisation phase"""
    gradient_accumulation_steps: int = 1
    """mini-batches per optimizer step"""
    ppo_epochs: int = 4
    """optimisation epochs over each batch of rollouts"""
    learning_rate: float = 7e-5
    """Adam learning rate (TRL: 1.41e-5, for GPT-2-sized models; the small default policy learns faster at 7e-5, see
    the README)"""
    lr_anneal: bool = False
    """if toggled, the learning rate decays linearly to 0 over the run"""
    adam_eps: float = 1e-5
    """Adam epsilon (lm-human-preferences)"""
    adam_beta1: float = 0.9
    """Adam's beta1 (TRL's default)"""
    adam_beta2: float = 0.999
    """Adam's beta2 (TRL's default)"""
    max_grad_norm: float | None = None
    """gradient clipping norm (None: no clipping)"""
    init_kl_coef: float = 0.2
    """initial KL penalty coefficient"""
    adap_kl_ctrl: bool = True
    """adapt the KL coefficient towards `target` (Ziegler et al. 2019); otherwise it stays fixed"""
    target: float = 6.0
    """target KL of the adaptive controller"""
    horizon: float = 320
    """horizon of the adaptive controller: each update moves kl_coef by at most a factor 1 +- 0.2 * batch / horizon
    (lm-human-preferences: 10000 for batches of 512; scale it with the batch)"""
    kl_penalty: Literal["kl", "abs", "mse", "k3", "full"] = "kl"
    """per-token KL estimate in the reward: kl (logp - ref), abs, mse (0.5 * diff^2), k3, full (exact, over the
    vocabulary: keeps [batch, response_len, vocab] tensors)"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """PPO policy clip range"""
    cliprange_value: float = 0.2
    """PPO value clip range"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    whiten_rewards: bool = False
    """whiten the per-token rewards before GAE (mean kept)"""
    ratio_threshold: float = 10.0
    """skip a mini-batch (zero loss) whose mean probability ratio exceeds this"""
    early_stopping: bool = False
    """stop the PPO epochs of an update when policy KL > 1.5 * target_kl"""
    target_kl: float = 1.0
    """KL threshold for early stopping"""
    use_score_scaling: bool = False
    """divide scores by their running std"""
    use_score_norm: bool = False
    """with use_score_scaling: also subtract the running mean"""
    score_clip: float | None = None
    """clip scores to [-score_clip, score_clip] (after scaling)"""
    num_shared_layers: int | None = None
    """share (and freeze) the embeddings and the first k blocks between policy and reference"""
    disable_dropout: bool = True
    """set every dropout probability of the policy to 0 (logprobs of rollouts and updates then agree)"""
    value_head_init: Literal["zero", "normal"] = "zero"
    """value head init: zero (lm-human-preferences) or normal(0, 0.2)"""

    # The PPO of today's field (OpenRLHF, verl, VC-PPO, VAPO): each part off by default, which is TRL 0.8's PPO
    value_model_path: str | None = None
    """a separate critic (its own weights and learning rate) started from: a hub id, a folder (a causal LM, a reward
    model, a critic ppo.py saved), a built-in, `policy`, or `auto` (the reward model if the run has one that reads the
    policy's tokens, else the policy); None: TRL 0.8's value head on the policy's trunk"""
    critic_learning_rate: float | None = None
    """the separate critic's Adam learning rate (OpenRLHF's critic_learning_rate); None: --learning-rate"""
    freezing_actor_steps: int = 0
    """updates at the start that train only the critic, the policy held still (OpenRLHF's freezing_actor_steps,
    VC-PPO's value pretraining); needs --value-model-path"""
    critic_lam: float | None = None
    """the GAE lambda of the critic's targets, decoupled from the policy's --lam (VC-PPO: 1.0, unbiased returns);
    None: --lam"""
    lam_length_alpha: float | None = None
    """VAPO's length-adaptive policy lambda = 1 - 1 / (alpha * response length), per response, clamped to [0, 1]
    (VAPO: alpha 0.05, for responses of thousands of tokens); None: --lam"""
    use_kl_loss: bool = False
    """the KL to the reference as a term of the policy loss (kl_coef x the --kl-penalty estimate, k3 as GRPO) instead
    of a penalty in the reward (OpenRLHF's use_kl_loss)"""
    n_samples_per_prompt: int = 1
    """completions sampled per query (OpenRLHF's n_samples_per_prompt): --batch-size counts completions, so an update
    answers batch_size / n queries, each n times"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """how the losses average over a mini-batch: token-mean (every response token weighs the same: TRL 0.8, OpenRLHF,
    verl's default) or seq-mean-token-mean (each response's mean, then the mean over responses)"""

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

    # Logging, evaluation, saving
    log_freq: int = 20
    """log a table of sample generations every this many updates"""
    log_ref_responses: bool = False
    """with each sample table, also answer its queries with the reference model and show those responses and scores
    (TRL's generate_ref_response); logs env/ref_reward_mean"""
    eval_freq: int = 20
    """evaluate on the held-out prompts every this many updates (and at the end); 0: only at the end"""
    eval_samples: int = 64
    """held-out prompts per evaluation"""
    save_freq: int = 0
    """write a checkpoint every this many updates (0: only the final model)"""
    output_dir: str = "outputs/ppo"
    """where the final model goes (plain from_pretrained format, value head in value_head.safetensors)"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""
    checkpoint_dir: str | None = None
    """where --save-freq checkpoints go (None: {output_dir}_checkpoints)"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from (model, optimizer, scheduler, KL controller, RNG, step)"""
    save_best: bool = False
    """keep the policy whose rollout batch had the highest mean raw score in {output_dir}_best, saved before that
    batch's update (TRL's push_to_hub_if_best); with --push-to-hub, upload each new best instead of the final model"""
    compare_steps: int = 1
    """with --save-best, compare the batch reward with the best so far every this many updates"""
    push_to_hub: bool = False
    """push the final model to the hub as `hub_model_id`"""
    hub_model_id: str | None = None
    """the hub repository for --push-to-hub"""

    # to be filled in runtime (not flags)
    world_size: tyro.conf.Suppress[int] = 0
    """number of processes"""
    num_updates: tyro.conf.Suppress[int] = 0
    """number of PPO updates"""


def reward_fn(queries: list[str], responses: list[str]) -> list[float]:
    """The default reward: VADER compound sentiment of each response, in [-1, 1]. Replace it with your own."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = reward_fn.analyzer = getattr(reward_fn, "analyzer", None) or SentimentIntensityAnalyzer()
    return [analyzer.polarity_scores(r)["compound"] for r in responses]


def metric_fn(queries: list[str], responses: list[str]) -> dict[str, list[float]]:
    """Extra evaluation metrics (trlX `metric_fn`): name -> one value per sample. Replace it with your own."""
    return {
        "response_words": [float(len(r.split())) for r in responses],
        "distinct_words": [len(set(r.split())) / max(1, len(r.split())) for r in responses],
        "vader_sentiment": reward_fn(queries, responses),
    }  # the labeller behind builtin:tiny-chat-rm's preferences


def shape_scores(args: Args, scores, ended, running: RunningMoments, gather):
    """TRL 0.8's score shaping, in order: --missing-eos-penalty off responses that did not end, then scaling by the
    running std of every process's scores (`gather`; and centering with --use-score-norm), then clipping."""
    scores = scores.clone()
    if args.missing_eos_penalty is not None:
        scores[~ended] -= args.missing_eos_penalty
    if args.use_score_scaling:
        running.update(gather(scores))
        shifted = scores - running.mean if args.use_score_norm else scores
        scores = shifted / (running.std + torch.finfo(scores.dtype).eps)
    if args.score_clip is not None:
        scores = scores.clamp(-args.score_clip, args.score_clip)
    return scores


def compute_rewards(scores, logprobs, ref_logprobs, masks, kl_coef, kl_penalty="kl"):
    """Per-token rewards: -kl_coef * KL at every response token, plus the score at the last one (TRL 0.8).

    scores [B]; logprobs, ref_logprobs [B, T] (or [B, T, V] for kl_penalty="full"); masks [B, T] with each row
    a run of ones from the first response token. Returns (rewards, non_score_rewards, kls), each [B, T].
    """
    kls = kl_estimate(logprobs, ref_logprobs, kl_penalty) * masks
    non_score_rewards = -kl_coef * kls
    last_index = (masks.cumsum(1) == masks.sum(1, keepdim=True)).long().argmax(1)  # last response token
    rewards = non_score_rewards.clone()
    rewards[torch.arange(len(scores)), last_index] += scores
    return rewards, non_score_rewards, kls


def compute_advantages(values, rewards, mask, gamma, lam, whiten_rewards=False):
    """GAE (Schulman et al. 2016, eq. 16) over the response tokens, exactly TRL 0.8's `compute_advantages`.

    values, rewards, mask: [B, T]. Returns (values * mask, whitened advantages, returns = advantages + values).
    With `whiten_rewards`, padded positions stay 0 (TRL PPOv2); everything else is TRL 0.8 exactly.
    """
    values, rewards = values * mask, rewards * mask
    if whiten_rewards:  # re-masked after whitening (as TRL PPOv2): TRL 0.8 let padding's shifted mean leak into GAE
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    lastgaelam, advantages_reversed, gen_len = 0.0, [], rewards.shape[-1]
    for t in reversed(range(gen_len)):
        nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask).detach()
    return values, advantages, returns


def ppo_loss(
    old_logprobs,
    values,
    logprobs,
    vpreds,
    mask,
    advantages,
    returns,
    cliprange,
    cliprange_value,
    vf_coef,
    ratio_threshold=10.0,
    loss_agg_mode="token-mean",
):
    """Clipped PPO objective (Schulman et al. 2017, eq. 7) and clipped value loss, as TRL 0.8's `loss` (and OpenRLHF's
    PolicyLoss and ValueLoss, for a separate critic too), averaged by `aggregate`.

    All inputs [B, T]. Returns (pg_loss, vf_coef * vf_loss, stats); both losses are zeroed when the mean ratio
    exceeds `ratio_threshold` (the mini-batch is skipped, stats["ppo/skipped"] = 1).
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1, vf_losses2 = (vpreds - returns) ** 2, (vpredclipped - returns) ** 2
    vf_loss = 0.5 * aggregate(torch.max(vf_losses1, vf_losses2), mask, loss_agg_mode)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = aggregate(torch.max(pg_losses, pg_losses2), mask, loss_agg_mode)
    keep = (masked_mean(ratio, mask) <= ratio_threshold).float()  # a tensor, not an `if`: no device sync
    pg_loss, vf_loss = pg_loss * keep, vf_loss * keep
    with torch.no_grad():
        stats = {
            "ppo/loss/policy": pg_loss,
            "ppo/loss/value": vf_coef * vf_loss,
            "ppo/loss/total": pg_loss + vf_coef * vf_loss,
            "ppo/policy/approxkl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask),
            "ppo/policy/policykl": masked_mean(old_logprobs - logprobs, mask),
            "ppo/policy/clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses).float(), mask),
            "ppo/policy/ratio": masked_mean(ratio, mask),
            "ppo/returns/mean": masked_mean(returns, mask),
            "ppo/returns/var": masked_var(returns, mask),
            "ppo/val/vpred": masked_mean(vpreds, mask),
            "ppo/val/error": masked_mean(vf_losses1, mask),
            "ppo/val/clipfrac": masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask),
            "ppo/val/var_explained": explained_variance(returns, vpreds, mask),
            "ppo/skipped": 1 - keep,
        }
    return pg_loss, vf_coef * vf_loss, stats


def explained_variance(returns, vpreds, mask):
    """1 - var(returns - values) / var(returns) over the masked tokens (TRL 0.8's ppo/val/var_explained): 1 when the
    values predict the returns, 0 when they are no better than their mean; NaN (left out of the update's mean) when
    the returns do not vary beyond float rounding, as when every response of a mini-batch scored alike without a KL
    penalty (GAE's returns then differ by ~1e-8: the ratio would be noise over noise)."""
    variance = masked_var(returns, mask)
    return torch.where(variance > 1e-10, 1 - masked_var(returns - vpreds, mask) / variance, torch.nan)


def aggregate(losses, mask, mode="token-mean"):
    """A mini-batch's loss from per-token losses [B, T]: token-mean (TRL 0.8, OpenRLHF, verl's default: every response
    token weighs the same, so long responses weigh more) or seq-mean-token-mean (each response's mean, then their mean)."""
    if mode == "token-mean":
        return masked_mean(losses, mask)
    return masked_mean(losses, mask, axis=1).mean()


def length_adaptive_lam(mask, alpha):
    """VAPO's policy lambda, one per response [B]: 1 - 1 / (alpha * length), clamped to [0, 1] (short responses lean on
    the critic, long ones on the returns)."""
    return (1 - 1 / (alpha * mask.sum(1).clamp(min=1))).clamp(0.0, 1.0)


def gae_targets(values, rewards, mask, gamma, lam, critic_lam, whiten_rewards=False):
    """Decoupled GAE (VC-PPO): the policy's whitened advantages with `lam` (a float, or one per response [B]), the
    critic's targets with `critic_lam` (1.0: the Monte-Carlo returns, unbiased by the critic's own errors). With
    critic_lam == lam this is `compute_advantages`. Returns (values * mask, advantages, returns)."""
    values, advantages, returns = compute_advantages(values, rewards, mask, gamma, lam, whiten_rewards)
    if not isinstance(lam, float) or critic_lam != lam:
        returns = compute_advantages(values, rewards, mask, gamma, critic_lam, whiten_rewards)[2]
    return values, advantages, returns


def forward(model, queries, query_mask, responses, response_mask, temperature, decoder_start_token_id=None, logit_mask=None):
    """Policy/reference forward pass over query+response: (logits / temperature, values) at the response tokens.

    queries [B, Q] left-padded, responses [B, T]; returns logits [B, T, V] where logits[:, t] predicts
    responses[:, t], and values [B, T] (the value of the state before token t). Encoder-decoder models are
    marked by their `decoder_start_token_id`. A `LogitMask` masks the transitions from each previous token.
    """
    # the token before each response token: the last query token (left padding), or the decoder's start token
    first = queries[:, -1:] if decoder_start_token_id is None else torch.full_like(responses[:, :1], decoder_start_token_id)
    previous = torch.cat([first, responses[:, :-1]], 1)
    if decoder_start_token_id is not None:  # the query goes to the encoder; the decoder reads <start> + response[:-1]
        decoder_input_ids = previous
        decoder_mask = torch.cat([torch.ones_like(first), response_mask[:, :-1]], 1)
        logits, values = model(
            input_ids=queries,
            attention_mask=query_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_mask,
        )
    else:
        input_ids = torch.cat([queries, responses], 1)
        attention_mask = torch.cat([query_mask, response_mask], 1)
        # Left padding: positions must count real tokens only, or logits differ from the unpadded ones
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
        # Only the last T + 1 logits are needed: skips the vocabulary projection over the query
        T = responses.shape[1]
        logits, values = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1
        )
        logits, values = logits[:, :-1], values[:, -T - 1 : -1]
    logits = logits / temperature if temperature != 1.0 else logits
    return (logit_mask.apply(logits, previous) if logit_mask is not None else logits), values


# ================================ plumbing: what the loop in main() calls ================================


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_args(
        args,
        positive=(
            "save_total_limit total_episodes batch_size mini_batch_size gradient_accumulation_steps ppo_epochs learning_rate "
            "max_query_length temperature target horizon cliprange cliprange_value reward_batch_size eval_samples log_freq "
            "compare_steps ratio_threshold generation_batch_size adam_eps max_grad_norm score_clip critic_learning_rate "
            "lam_length_alpha n_samples_per_prompt"
        ),
        non_negative="init_kl_coef vf_coef top_k eval_freq save_freq target_kl freezing_actor_steps",
        fractions="eval_fraction",
    )
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1):
        raise UsageError(f"--adam-beta1 {args.adam_beta1}, --adam-beta2 {args.adam_beta2}: the betas lie in [0, 1).")
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1 and 0 <= (args.critic_lam or 0) <= 1):
        raise UsageError(
            f"--gamma {args.gamma}, --lam {args.lam}, --critic-lam {args.critic_lam}: gamma and lam lie in [0, 1] (the "
            "critic's lam too)."
        )
    if args.batch_size % args.n_samples_per_prompt:
        raise UsageError(
            f"--batch-size {args.batch_size} counts completions, --n-samples-per-prompt {args.n_samples_per_prompt} "
            "of them per query: make the batch size a multiple of it."
        )
    if args.value_model_path is None:
        for flag, on in (
            ("--critic-learning-rate", args.critic_learning_rate),
            ("--freezing-actor-steps", args.freezing_actor_steps),
        ):
            if on:
                raise UsageError(f"{flag} sets the separate critic: add --value-model-path (e.g. auto), or drop {flag}.")
    else:
        shared = [flag for flag, on in (("--use-peft", args.use_peft), ("--reward-adapter", args.reward_adapter)) if on]
        if shared:
            raise UsageError(
                f"--value-model-path with {shared[0]}: the separate critic trains whole weights beside a LoRA policy "
                "not yet; drop one of the two."
            )
    if args.use_kl_loss and args.kl_penalty == "full":
        raise UsageError("--use-kl-loss with --kl-penalty full: the loss takes a per-token estimate (k3, kl, mse, abs).")
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        raise UsageError(f"Need 1 <= min_new_tokens ({args.min_new_tokens}) <= max_new_tokens ({args.max_new_tokens}).")
    if args.truncate_queries and args.max_query_length is None:
        raise UsageError("--truncate-queries keeps the last --max-query-length tokens of a query: pass that limit too.")
    if any(not s for s in args.stop_sequences):
        raise UsageError(f"--stop-sequences {args.stop_sequences}: an empty stop sequence would end every response at once.")
    if args.reward_funcs and (args.reward_adapter or args.reward_model not in (None, Args.reward_model)):
        raise UsageError(
            "--reward-funcs replaces the reward model: drop --reward-model / --reward-adapter, or --reward-funcs."
        )
    if args.use_vllm:
        quantized = args.load_in_8bit or args.load_in_4bit
        refused = [flag for flag, on in (("--logit-mask", args.logit_mask), ("--load-in-8bit / 4bit", quantized)) if on]
        if refused:
            raise UsageError(f"--use-vllm with {refused[0]}: vLLM samples without it; drop one of the two.")
    check_sampling_args(args)  # --top-p, and with --use-vllm vLLM's flags
    if args.reward_weights and not args.reward_funcs:
        raise UsageError("--reward-weights weighs the --reward-funcs: pass the reward functions too, or drop the weights.")
    if args.reward_funcs and len(args.reward_weights or args.reward_funcs) != len(args.reward_funcs):
        raise UsageError(
            f"{len(args.reward_weights)} --reward-weights for {len(args.reward_funcs)} --reward-funcs: give one each."
        )


def batch_sizes(args: Args, accelerator: Accelerator) -> int:
    """The batch arithmetic checked against the process count (one line on a mismatch): sets args.world_size and
    args.num_updates, returns the samples of one optimizer step (mini_batch_size x gradient_accumulation_steps)."""
    args.world_size = accelerator.num_processes
    step_size = args.mini_batch_size * args.gradient_accumulation_steps
    exact_div(
        args.batch_size, step_size, sizes(args, "batch_size"), sizes(args, "mini_batch_size", "gradient_accumulation_steps")
    )
    args.num_updates = exact_div(
        args.total_episodes,
        args.batch_size * args.world_size,
        sizes(args, "total_episodes"),
        sizes(args, "batch_size", processes=args.world_size),
    )
    if args.generation_batch_size:
        exact_div(args.batch_size, args.generation_batch_size, sizes(args, "batch_size"), sizes(args, "generation_batch_size"))
    return step_size


def load_queries(args: Args, tokenizer, accelerator: Accelerator) -> tuple[list[dict], list[dict], bool]:
    """The training and held-out rows (the query as `prompt`, the ids the policy reads as `prompt_ids`, every other
    column for --reward-funcs), checked before any model is loaded, and whether the queries are chats."""
    if args.dataset_name.startswith("reasoning-gym:"):  # problems and answers for verifiable rewards (grpo.py's tasks)
        train_rows, eval_rows, chat = load_task(args, tokenizer, args.query_column, args.max_query_length)
        eval_rows = eval_rows[: args.eval_samples]
    else:
        dataset = load_data(args.dataset_name, args.dataset_split)
        check_columns(dataset, [args.query_column], "--query-column", prompts=(args.query_column,), source=args.dataset_name)
        verifiable = args.reward_funcs or args.gold_reward_funcs
        if verifiable and args.answer_column in dataset.column_names:  # grpo.py's name for the reference answer
            dataset = answers_as_text(dataset, args.answer_column)
            dataset = dataset.rename_column(args.answer_column, "answer") if args.answer_column != "answer" else dataset
        chat = use_chat(tokenizer, args.chat_template, dataset[0][args.query_column], args.system_prompt)
        data_seed = args.seed if args.data_seed is None else args.data_seed
        train_dataset, eval_dataset = train_eval_split(dataset, args.eval_fraction, data_seed)
        train_rows, eval_rows = train_dataset.to_list(), eval_dataset.to_list()[: args.eval_samples]
        held_out = {json.dumps(r[args.query_column]) for r in eval_rows}  # no held-out query occurs in training
        train_rows = [r for r in train_rows if json.dumps(r[args.query_column]) not in held_out]
        for row in train_rows + eval_rows:
            row["prompt"] = row[args.query_column]
            text = render(tokenizer, row["prompt"], system_prompt=args.system_prompt)[0] if chat else row["prompt"]
            row["prompt_ids"] = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        limit = args.max_query_length  # None: no limit
        too_long = [len(r["prompt_ids"]) for r in train_rows + eval_rows if limit and len(r["prompt_ids"]) > limit]
        if too_long and not args.truncate_queries:
            raise UsageError(
                f"{len(too_long)} queries are longer than max_query_length={args.max_query_length} tokens "
                f"(longest {max(too_long)}): raise --max-query-length or pass --truncate-queries."
            )
        if not all(r["prompt_ids"] for r in train_rows + eval_rows):
            accelerator.print(f"warning: {sum(not r['prompt_ids'] for r in train_rows + eval_rows)} empty queries left out")
        train_rows, eval_rows = ([r for r in rows if r["prompt_ids"]] for rows in (train_rows, eval_rows))
        if not train_rows or not eval_rows:
            raise UsageError(f"--query-column {args.query_column}: every query is empty once tokenised; fill that column.")
        if too_long:  # --truncate-queries: each long query keeps its last `limit` tokens
            for row in train_rows + eval_rows:
                row["prompt_ids"] = row["prompt_ids"][-limit:]
    per_update = args.batch_size * args.world_size // args.n_samples_per_prompt
    if len(train_rows) < per_update:
        raise UsageError(f"{len(train_rows)} training queries are fewer than one batch of {per_update}.")
    accelerator.print(
        f"{len(train_rows)} training queries, {len(eval_rows)} held out{', rendered by the chat template' if chat else ''}; "
        f"{args.num_updates} updates of {per_update} "
        + (f"queries x {args.n_samples_per_prompt} completions" if args.n_samples_per_prompt > 1 else "episodes")
        + "; each pass over the data reshuffles and leaves out "
        f"{len(train_rows) % per_update} queries (different ones each pass)"
    )
    if not chat:  # a raw-text query as the policy reads it (truncated, decoded) is what the rewards and tables read
        for row in train_rows + eval_rows:
            row["prompt"] = tokenizer.decode(row["prompt_ids"], skip_special_tokens=True)
    for specs in (args.reward_funcs, args.gold_reward_funcs):
        if specs:  # tried on two real rows before any model loads: a bad plug-in is a one-line error here
            load_rewards(specs, train_rows, "cpu", chat)
    return train_rows, eval_rows, chat


def load_models(args: Args, accelerator: Accelerator, tokenizer, quantization: dict, chat: bool, train_rows, eval_rows):
    """The policy with its value head (LoRA with --use-peft), the frozen reference (None with LoRA: the policy with its
    adapter disabled), and the `Rewards` of responses."""
    is_encoder_decoder = getattr(load_config(args.model_name), "is_encoder_decoder", False)
    wrapper_class = AutoModelForSeq2SeqLMWithValueHead if is_encoder_decoder else AutoModelForCausalLMWithValueHead
    if is_encoder_decoder and args.use_vllm:
        raise UsageError(f"--use-vllm with {args.model_name}, an encoder-decoder: vLLM samples decoder-only models here.")
    if is_encoder_decoder and args.value_model_path:
        raise UsageError(f"--value-model-path with {args.model_name}, an encoder-decoder: the critic reads decoder-only LMs.")
    # Always the initial weights, also on resume: the reference is a copy of them; the resumed policy comes
    # from the checkpoint's accelerate state
    model = wrapper_class.from_pretrained(
        args.model_name, value_head_kwargs=dict(init=args.value_head_init), dtype=args.dtype, **quantization
    )
    context = context_length(model.config)
    longest = max(len(r["prompt_ids"]) for r in train_rows + eval_rows)  # at most --max-query-length
    if context and not is_encoder_decoder and longest + args.max_new_tokens > context:
        raise UsageError(
            f"the longest query ({longest} tokens) + max_new_tokens ({args.max_new_tokens}) exceeds the model's context "
            f"of {context} tokens: lower --max-new-tokens, or cut queries (--max-query-length with --truncate-queries)."
        )
    if args.disable_dropout:
        disable_dropout(model)
    if quantization:
        model.pretrained_model = prepare_model_for_kbit_training(model.pretrained_model)
    if args.use_peft and peft_model_of(model) is None:
        check_lora_targets(model.pretrained_model, args.lora_target_modules)
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type="SEQ_2_SEQ_LM" if is_encoder_decoder else "CAUSAL_LM",
        )
        model.pretrained_model = get_peft_model(model.pretrained_model, lora)
    ref_model = create_reference_model(model, num_shared_layers=args.num_shared_layers)  # None with peft
    scoring = Rewards(args, model, accelerator, chat, train_rows)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(
        f"policy {args.model_name}: {n_trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,} "
        f"parameters; reference: {'adapter disabled' if ref_model is None else 'frozen copy'}"
        f"{f', {args.num_shared_layers} shared blocks' if args.num_shared_layers else ''}"
    )
    if args.value_model_path:  # the policy's own value head is dropped: the separate critic gives the values
        rm = scoring.reward_model
        critic = load_critic(args.value_model_path, model, rm, tokenizer, args.dtype, args.value_head_init, args.reward_label)
        if args.disable_dropout:
            disable_dropout(critic)
        model = PolicyAndCritic(model.pretrained_model, critic)
        accelerator.print(
            f"critic: a separate value model from {args.value_model_path} "
            f"({sum(p.numel() for p in critic.parameters()):,} parameters, learning rate "
            f"{args.critic_learning_rate or args.learning_rate:g})"
        )
    if scoring.reward_model is not None:  # "query response<eos>" must fit the reward model too
        fix = "lower --max-query-length (with --truncate-queries) or --max-new-tokens"
        scoring.reward_model.check_context(train_rows + eval_rows, tokenizer, args.max_new_tokens, fix)
    return model, ref_model, scoring


class Rewards:
    """One score per (query, response) from the first of: the verifiable rewards of --reward-funcs (grpo.py's semantics,
    weighted by --reward-weights; an unscorable response gets 0), a `RewardAdapter` on the policy's base, a `RewardModel`
    (common/rewards.py, as grpo.py's --reward-model), `reward_fn` (VADER); each called as a reward function is (TRL 1.x's
    keywords, `score_completions`). And the --gold-reward-funcs, watched beside."""

    def __init__(self, args: Args, model, accelerator: Accelerator, chat: bool, rows: list[dict]):
        self.accelerator, self.reward_model, self.adapter, device = accelerator, None, None, accelerator.device
        if args.reward_funcs:
            self.funcs = load_rewards(args.reward_funcs, rows, device, chat)
        elif args.reward_adapter is not None:  # the reward model is the policy's base with a second, frozen adapter
            self.adapter = RewardAdapter(model, args.reward_adapter, args.model_name, chat, args.reward_batch_size)
            self.funcs = [(f"--reward-adapter {args.reward_adapter}", self.adapter)]
        elif args.reward_model is not None:
            self.reward_model = RewardModel(args.reward_model, args.reward_label, args.dtype, chat, args.reward_batch_size)
            self.funcs = [(f"--reward-model {args.reward_model}", self.reward_model)]
        else:  # reward_fn in this file, on the query and response texts
            texts = lambda values: [text_of(v) for v in values]  # noqa: E731
            self.funcs = [("reward_fn", lambda prompts, completions, **_: reward_fn(texts(prompts), texts(completions)))]
        self.trial = not args.reward_funcs  # (load_rewards tried the reward functions on real rows already)
        self.weights = torch.tensor(args.reward_weights or [1.0] * len(self.funcs), device=device)
        self.gold = load_rewards(args.gold_reward_funcs, rows, device, chat) if args.gold_reward_funcs else []

    def ready(self, policy) -> None:
        """On the accelerator's device, with the prepared policy: a bad reward (wrong length, NaN) fails here."""
        if self.reward_model is not None:
            self.reward_model.place(self.accelerator)
        if self.adapter is not None:
            self.adapter.place(self.accelerator, policy)
        if self.trial:
            self([{"prompt": "Hello"}, {"prompt": "Hi"}], [" there", " you"], [[15], [16]], [True, False])

    @torch.no_grad()
    def __call__(self, rows: list[dict], responses_text: list[str], response_ids, ended: list[bool]):
        """Scores [B] of the responses to `rows` (each row's `prompt` as the reward model reads it)."""
        rewards = score_completions(self.funcs, rows, responses_text, response_ids, ended, self.accelerator.device)
        if rewards.isnan().all():  # grpo.py counts such a batch as degenerate; here it would train on zeros
            warn_once("no reward function scored a batch of responses (all returned None): they score 0 there")
        return (rewards * self.weights).nansum(1).cpu()

    @torch.no_grad()
    def watch(self, rows: list[dict], responses_text: list[str], response_ids, ended: list[bool], scores, prefix: str):
        """The --gold-reward-funcs on the responses that earned `scores`, over every process's: each function's mean
        and the Pearson correlation of the scores with the first function's ({prefix}/gold/*; NaN if either is constant).
        A learned reward being over-optimised shows as its score rising while the gold mean and the correlation fall."""
        if not self.gold:
            return {}
        device = self.accelerator.device
        gold = self.accelerator.gather(score_completions(self.gold, rows, responses_text, response_ids, ended, device))
        scores = self.accelerator.gather(scores.to(device)).float()
        metrics = {
            f"{prefix}/gold/{name.rsplit(':', 1)[-1]}": gold[:, j].nanmean().item() for j, (name, _) in enumerate(self.gold)
        }
        scored = ~gold[:, 0].isnan()
        pair = torch.stack([scores[scored], gold[scored, 0].float()])
        metrics[f"{prefix}/gold/correlation"] = torch.corrcoef(pair)[0, 1].item() if scored.sum() > 1 else float("nan")
        return metrics


def load_sampler(args: Args, tokenizer, model, accelerator: Accelerator, quantization: dict, rows: list[dict]):
    """The policy's responses through the shared `Sampler` (common/sampling.py: HF `generate` with the inverse-CDF
    draw, on CUDA `FastGenerator`, or with --use-vllm vLLM, synced after each update), cut after the first EOS or stop
    sequence; and the sampling-time settings (temperature, decoder start, logit mask) every forward pass must see."""
    # seq2seq: the decoder starts from this token (passed explicitly: a DDP wrapper has no .config)
    decoder_start = model.config.decoder_start_token_id if model.config.is_encoder_decoder else None
    logit_mask = LogitMask.from_file(args.logit_mask, model.config.vocab_size) if args.logit_mask else None
    settings = dict(temperature=args.temperature, decoder_start_token_id=decoder_start, logit_mask=logit_mask)
    # forbidden transitions are masked before the temperature / top-k / top-p warpers and the draw; the fast path
    # serves the policy as prepare moves and wraps its parameters in place, but not a quantized one
    processors = [logit_mask] if logit_mask is not None else []
    length = max(len(r["prompt_ids"]) for r in rows) + args.max_new_tokens  # vLLM's context: the longest of each
    stops = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in args.stop_sequences]
    batch, fast = args.generation_batch_size or args.batch_size, not quantization
    sampler = Sampler(args, tokenizer, model, accelerator, length, processors, fast, stops, batch_size=batch)
    accelerator.print(f"rollouts: {sampler.name}{', weights synced after each update' * bool(args.use_vllm)}")
    return sampler, settings


def prepare_training(args: Args, accelerator: Accelerator, model, step_size: int):
    """The model prepared with its Adam optimizer (fused: one kernel over all parameters, several times faster than the
    per-tensor update; a separate critic is a parameter group of its own) and a constant or linearly annealed learning
    rate."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    critic = [p for p in getattr(model, "critic", torch.nn.Module()).parameters() if p.requires_grad]
    if critic:  # the separate critic: a parameter group of its own (its learning rate, its own Adam moments)
        ids = {id(p) for p in critic}
        critic_lr = args.critic_learning_rate or args.learning_rate
        trainable = [{"params": [p for p in trainable if id(p) not in ids]}, {"params": critic, "lr": critic_lr}]
    betas = (args.adam_beta1, args.adam_beta2)
    optimizer = torch.optim.Adam(trainable, lr=args.learning_rate, betas=betas, eps=args.adam_eps, fused=True)
    optimizer_steps = args.num_updates * args.ppo_epochs * args.batch_size // step_size
    # accelerate's prepared scheduler steps once per process per optimizer step
    scheduler = get_scheduler(
        "linear" if args.lr_anneal else "constant",
        optimizer,
        num_warmup_steps=0,
        num_training_steps=optimizer_steps * args.world_size,
    )
    return accelerator.prepare(model, optimizer, scheduler)


@torch.no_grad()
def sampling_forwards(args: Args, accelerator, unwrapped, ref_model, settings, queries, query_mask, responses, response_mask):
    """Phase 3's forward passes without gradients, by mini-batches: the policy's log-probs and values at sampling time
    ("old") and the reference's log-probs, logits / temperature as in sampling (Huang et al. 2023, detail 8); and what
    the KL penalty reads (the full distributions [B, T, V] for --kl-penalty full, else the two log-probs)."""
    full = args.kl_penalty == "full"  # the exact KL needs both full distributions [B, T, V]
    old_logprobs, ref_logprobs, values, full_logprobs, full_ref_logprobs = [], [], [], [], []
    for i in range(0, args.batch_size, args.mini_batch_size):
        mb = slice(i, i + args.mini_batch_size)
        inputs = (queries[mb], query_mask[mb], responses[mb], response_mask[mb])
        logits, value = forward(unwrapped, *inputs, **settings)
        with reference_context(unwrapped, ref_model), accelerator.autocast():  # the reference is not prepared
            ref_logits, _ = forward(ref_model if ref_model is not None else unwrapped, *inputs, **settings)
        old_logprobs.append(logprobs_from_logits(logits, responses[mb]))
        ref_logprobs.append(logprobs_from_logits(ref_logits, responses[mb]))
        values.append(value)
        if full:
            full_logprobs.append(torch.log_softmax(logits.float(), -1))
            full_ref_logprobs.append(torch.log_softmax(ref_logits.float(), -1))
    old_logprobs, ref_logprobs, values = torch.cat(old_logprobs), torch.cat(ref_logprobs), torch.cat(values)
    kl_inputs = (torch.cat(full_logprobs), torch.cat(full_ref_logprobs)) if full else (old_logprobs, ref_logprobs)
    return old_logprobs, ref_logprobs, values, kl_inputs


def update_metrics(args: Args, accelerator, values: dict, grad_norms, marks, kl_ctl, scheduler, update: int) -> dict:
    """An update's metrics (TRL 0.8's names), averaged over the processes: the PPO statistics of every mini-batch, the
    objective's KL, entropy and non-score reward, the scores, lengths, the gradient norm, each phase's time, the
    throughput; then the adaptive KL coefficient moves towards its target (Ziegler et al. 2019)."""
    mask, stats = values["mask"], values["stats"]
    with torch.no_grad():
        metrics = {k: torch.stack([s[k].float() for s in stats]).mean() for k in stats[0]}
        metrics["ppo/val/var_explained"] = torch.stack([s["ppo/val/var_explained"] for s in stats]).nanmean()
        metrics |= {
            "objective/kl": values["kls"].sum(1).mean(),
            "objective/entropy": (-values["old_logprobs"] * mask).sum(1).mean(),
            "objective/non_score_reward": values["non_score_rewards"].sum(1).mean(),
            "env/reward_mean": values["raw_scores"].mean(),
            "env/reward_std": values["raw_scores"].std(),
            "env/score_mean": values["scores"].mean(),
            "env/contains_eos": values["ended"].float().mean(),
            "tokens/query_len": values["query_mask"].sum(1).float().mean(),
            "tokens/response_len": mask.sum(1).mean(),
            "ppo/epochs_done": torch.tensor(float(values["epochs_done"])),
        }
        metrics = pooled(accelerator, [metrics])
    norms = [float(g) for g in grad_norms if g is not None]  # measured only with --max-grad-norm (clipping)
    if norms:
        metrics["ppo/grad_norm"] = sum(norms) / len(norms)
    check_finite(update + 1, {k: metrics[k] for k in ("ppo/loss/total", "ppo/grad_norm") if k in metrics})
    metrics["objective/kl_coef"] = kl_ctl.value  # the coefficient used in this update's rewards
    kl_ctl.update(metrics["objective/kl"], args.batch_size * args.world_size)  # towards its target KL
    phases = ("rollout", "score", None, "forward", "optimise")  # None: the --save-best interval, not timed
    times = {name: b - a for name, a, b in zip(phases, marks, marks[1:]) if name}
    step_time, tokens = sum(times.values()), metrics["tokens/query_len"] + metrics["tokens/response_len"]
    per_update = args.batch_size * args.world_size
    return (
        metrics
        | {f"time/{phase}": t for phase, t in times.items()}
        | {
            "throughput/episodes_per_s": per_update / step_time,
            "throughput/tokens_per_s": per_update * tokens / step_time,
            "charts/learning_rate": scheduler.get_last_lr()[0],
            "charts/episodes": (update + 1) * per_update,
        }
    )


@torch.no_grad()
@torch.random.fork_rng()  # evaluation draws from its own RNG: how often it runs never changes training
def evaluate(args: Args, sampler: Sampler, scoring: Rewards, policy, eval_rows, logger, update: int) -> dict[str, float]:
    """Sample on the held-out prompts and report reward and `metric_fn` metrics over every process's samples."""
    accelerator = sampler.accelerator
    torch.manual_seed(args.seed + accelerator.process_index)
    queries, query_mask = sampler.pad_left([r["prompt_ids"] for r in eval_rows])
    policy.eval()
    responses, response_mask, ended, _ = sampler.generate(queries, query_mask, args.max_new_tokens)
    responses_text, response_ids = decode(sampler.tokenizer, responses, response_mask)
    scores = scoring(eval_rows, responses_text, response_ids, ended.tolist())
    queries_text = [text_of(r["prompt"]) for r in eval_rows]
    extra = metric_fn(queries_text, responses_text)  # per-sample values; every process scores as many samples
    metrics = pooled(accelerator, [{f"eval/{k}": torch.tensor(v).float().mean() for k, v in extra.items()}])
    every = accelerator.gather(scores.to(accelerator.device)).cpu()  # the statistics of every process's samples
    metrics |= {
        "eval/reward_mean": every.mean().item(),
        "eval/reward_std": every.std().item(),
        "eval/top_token_share": top_token_share(gather_object(responses[response_mask.bool()].tolist())),
        "eval/distinct_2": distinct_bigrams(gather_object(responses_text)),
    }
    metrics |= scoring.watch(eval_rows, responses_text, response_ids, ended.tolist(), scores, "eval")
    logger.log(metrics, update)
    columns = {"query": queries_text, "response": responses_text, "score": scores.tolist()}
    logger.samples("eval samples", columns, update, console=update in (0, args.num_updates))  # between: TensorBoard only
    return metrics


def log_samples(args: Args, sampler: Sampler, scoring: Rewards, logger, policy, ref_model, sampled: tuple, step: int):
    """The update's sample table (query, response, score), with the reference model's responses to the same queries
    and their scores beside them (and env/ref_reward_mean) with --log-ref-responses."""
    rows, responses_text, raw_scores, queries, query_mask, max_new_tokens = sampled
    columns = {"query": [text_of(r["prompt"]) for r in rows], "response": responses_text, "score": raw_scores.tolist()}
    if args.log_ref_responses:
        columns |= ref_responses(sampler, scoring, policy, ref_model, rows, queries, query_mask, max_new_tokens)
        ref_mean = pooled(sampler.accelerator, [{"env/ref_reward_mean": torch.tensor(columns["ref score"]).mean()}])
        logger.log(ref_mean, step)
    logger.samples("samples", columns, step)


@torch.no_grad()
@torch.random.fork_rng()  # sampling from the reference never changes the training run's random stream
def ref_responses(sampler: Sampler, scoring: Rewards, policy, ref_model, rows, queries, query_mask, max_new_tokens):
    """Reference-model responses to the logged queries and their scores, as sample-table columns."""
    with reference_context(policy, ref_model):
        responses, mask, ended = sampler.generate_with(ref_model or policy, queries, query_mask, max_new_tokens)
    responses_text, ids = decode(sampler.tokenizer, responses, mask)
    return {"ref response": responses_text, "ref score": scoring(rows, responses_text, ids, ended.tolist()).tolist()}


def save_best(args: Args, accelerator, policy, tokenizer, raw_scores, best_reward: float, update: int, run_name: str) -> float:
    """TRL's push_to_hub_if_best: if this batch's mean raw score (over ranks) is the best so far, save the weights that
    produced it (before this update's optimisation) to {output_dir}_best. Returns the best batch reward so far."""
    batch_reward = accelerator.reduce(raw_scores.mean(), "mean").item()
    if batch_reward <= best_reward:
        return best_reward
    metrics = {"best/reward_mean": batch_reward, "best/update": update}
    save_model(args, accelerator, policy, tokenizer, f"{args.output_dir}_best", metrics, final=False, run_name=run_name)
    return batch_reward


def save_model(args: Args, accelerator, policy, tokenizer, path: str, metrics: dict, final: bool, run_name: str) -> None:
    """`save_policy` (plain from_pretrained format, LoRA merged, the value head beside it), uploaded with --push-to-hub
    (the final model, or each new best with --save-best)."""
    save_policy(args, accelerator, policy, tokenizer, metrics, "ppo", path, final)
    if args.push_to_hub and final != args.save_best and accelerator.is_main_process:  # the LM as saved (LoRA merged)
        policy.auto_class.from_pretrained(path).push_to_hub(args.hub_model_id or run_name)
        tokenizer.push_to_hub(args.hub_model_id or run_name)


def summary(args: Args, accelerator, start_update, start_time, histories, first_eval, last_eval, best_reward):
    """The run's last lines: what it did and what moved, then the health line (a reward that rose while the policy
    left its reference is reward hacking, not learning)."""
    per_update, (reward_history, kl_history, explained_history) = args.batch_size * args.world_size, histories
    window = max(1, len(reward_history) // 10)
    final_kl = float(np.mean(kl_history[-window:]))
    accelerator.print(
        f"ppo: {args.num_updates - start_update} updates, {(args.num_updates - start_update) * per_update} episodes in "
        f"{time.time() - start_time:.0f}s; train reward {np.mean(reward_history[:window]):.3f} -> "
        f"{np.mean(reward_history[-window:]):.3f}; eval reward {first_eval['eval/reward_mean']:.3f} -> "
        f"{last_eval['eval/reward_mean']:.3f} (initial std {first_eval['eval/reward_std']:.3f}); "
        + "".join(f"{k[5:]} {first_eval[k]:.3f} -> {v:.3f}; " for k, v in last_eval.items() if k.startswith("eval/gold/"))
        + f"KL {final_kl:.2f}; "
        f"model saved to {args.output_dir}"
        + (f" (best batch reward {best_reward:.3f}: {args.output_dir}_best)" if args.save_best else "")
    )
    # ---- health: a reward that rose while the policy left its reference is reward hacking, not learning ----
    golds = [k for k in last_eval if k.startswith("eval/gold/") and k != "eval/gold/correlation"]
    # verifiable rewards (--reward-funcs) are their own gold: replies that agree on a checked answer are no hacking
    verified = ("+".join(args.reward_funcs), first_eval["eval/reward_mean"], last_eval["eval/reward_mean"])
    verified = verified if args.reward_funcs else None
    health, warning = health_check(
        final_kl,
        args.target,
        last_eval["eval/top_token_share"],
        last_eval["eval/distinct_words"],
        last_eval["eval/distinct_2"],
        first_eval["eval/distinct_2"],
        first_eval["eval/top_token_share"],
        (golds[0].removeprefix("eval/gold/"), first_eval[golds[0]], last_eval[golds[0]]) if golds else verified,
    )
    accelerator.print(health + (f"\n{warning}" if warning else ""))
    explained = [x for x in explained_history[-window:] if np.isfinite(x)]  # NaN: returns that did not vary
    explained = float(np.mean(explained)) if explained else float("nan")  # the critic explains the returns, or not
    if explained < 0.05:  # near zero: the values are no better than their mean
        fix = "--critic-learning-rate, or warm it up with --freezing-actor-steps" if args.value_model_path else "--vf-coef"
        accelerator.print(
            f"warning: the critic does not learn (it explains {explained:.2f} of the returns' variance over the last "
            f"updates): its advantages are the raw returns' noise; raise {fix}"
        )


def health_check(
    final_kl: float,
    target: float,
    top_share: float,
    distinct_words: float,
    distinct_2: float,
    start_distinct_2: float,
    start_top_share: float,
    gold: tuple[str, float, float] | None = None,
) -> tuple[str, str | None]:
    """A summary of whether the run stayed near its reference, and a warning when it did not: a KL past 3x its target,
    responses collapsed into one token (over 30% of response tokens), responses filling up with one token (its share
    tripled, to over 20%: e.g. whitespace padding a reward model happens to like), or responses that repeat each other
    (distinct-2 below 0.7 of its value at the start: a third of the replies sharing a few phrases the reward model
    likes) mean reward hacking, not learning. Repetition is only a note where a watched gold reward (`gold`: its name,
    first and last evaluation) rose: short correct answers ("6 + 2 = 8") share their bigrams by nature."""
    line = (
        f"health: KL to the reference {final_kl:.2f} nats at the end (target {target:g}); responses: "
        f"{distinct_words:.2f} distinct words per word, distinct-2 {distinct_2:.2f} ({start_distinct_2:.2f} at the "
        f"start), the most frequent token {top_share:.0%} of response tokens ({start_top_share:.0%} at the start)"
    )
    advice = (
        "a reward gained this way is reward hacking, not learning: lower --learning-rate or --target, or raise --init-kl-coef"
    )
    if final_kl > 3 * target:
        return line, f"warning: the policy has left its reference (KL {final_kl:.1f} > 3 x target {target:g}); {advice}"
    if top_share > 0.3:
        return line, f"warning: the responses collapsed (one token is {top_share:.0%} of them); {advice}"
    if top_share > max(0.2, 3 * start_top_share):
        return line, (
            f"warning: the responses fill up with one token ({top_share:.0%} of them, {start_top_share:.0%} at "
            f"the start); {advice}"
        )
    if distinct_2 < 0.7 * start_distinct_2:
        if gold and gold[2] > gold[1]:
            return line, (
                f"note: the responses repeat each other (distinct-2 {distinct_2:.2f}, {start_distinct_2:.2f} at the "
                f"start) while the gold reward {gold[0]} rose ({gold[1]:.3f} -> {gold[2]:.3f}): the answers' form"
            )
        return line, (
            f"warning: the responses repeat each other (distinct-2 {distinct_2:.2f}, {start_distinct_2:.2f} at "
            f"the start); {advice}"
        )
    return line, None


def top_token_share(tokens: list[int]) -> float:
    """The share of the most frequent token among all response tokens: a collapse into one repeated word shows as a
    share near 1; varied replies stay low."""
    return Counter(tokens).most_common(1)[0][1] / len(tokens) if tokens else 0.0


def main(args: Args) -> None:
    """The run: setup (the helpers above), then the loop in its numbered phases, then the final save."""
    check(args)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    quantization = quantization_kwargs(args.model_name, args.load_in_8bit, args.load_in_4bit, args.use_peft)
    device, step_size = accelerator.device, batch_sizes(args, accelerator)  # sets args.world_size and num_updates
    run_name, logger = start_run(args, accelerator)
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    train_rows, eval_rows, chat = load_queries(args, tokenizer, accelerator)
    model, ref_model, scoring = load_models(args, accelerator, tokenizer, quantization, chat, train_rows, eval_rows)
    sampler, settings = load_sampler(args, tokenizer, model, accelerator, quantization, train_rows + eval_rows)
    model, optimizer, scheduler = prepare_training(args, accelerator, model, step_size)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    ref_model = place_frozen(accelerator, ref_model) if ref_model is not None else None
    scoring.ready(unwrapped)
    kl_ctl, running = FixedKLController(args.init_kl_coef), RunningMoments()
    if args.adap_kl_ctrl:  # Ziegler et al. 2019: the coefficient moves the KL towards --target
        kl_ctl = AdaptiveKLController(args.init_kl_coef, args.target, args.horizon)
    state = resume(args, accelerator, args.num_updates, "--total-episodes")  # {} without --resume-from
    if state:  # the KL coefficient and the running score moments go on as they were
        kl_ctl.value = state["kl_coef"]
        running.__dict__.update(state["running_moments"])
    start_update, best_reward = state.get("update", 0), state.get("best_reward", float("-inf"))

    first_eval = evaluate(args, sampler, scoring, unwrapped, eval_rows, logger, start_update)
    first_eval = state.get("first_eval", first_eval)  # after a resume: the summary compares with the run's start
    reward_history, kl_history = state.get("reward_history", []), state.get("kl_history", [])
    explained_history = state.get("explained_history", [])  # the critic's explained variance, update by update
    clipping = dict(cliprange=args.cliprange, cliprange_value=args.cliprange_value, ratio_threshold=args.ratio_threshold)
    clipping |= dict(loss_agg_mode=args.loss_agg_mode)
    actor = [p for p in unwrapped.pretrained_model.parameters() if p.requires_grad] if args.freezing_actor_steps else []
    start_time = time.time()
    progress = tqdm(range(start_update, args.num_updates), disable=not accelerator.is_local_main_process, desc="ppo")
    for update in progress:
        # ================================ the algorithm: phases 1-6 ================================
        marks = [clock(device)]  # phase boundaries, for time/* (bookkeeping below)

        # 1. rollout: this rank's queries, responses of a length drawn from [min, max]_new_tokens (TRL's LengthSampler)
        n = args.n_samples_per_prompt  # each query answered n times (OpenRLHF's n_samples_per_prompt)
        rows = epoch_rows(train_rows, args.batch_size // n, update, args.seed, accelerator)  # seeded reshuffle per epoch
        rows = [row for row in rows for _ in range(n)]
        queries, query_mask = sampler.pad_left([r["prompt_ids"] for r in rows])
        max_new_tokens = int(np.random.randint(args.min_new_tokens, args.max_new_tokens + 1))
        unwrapped.eval()
        responses, mask, ended, sampler_logprobs = sampler.generate(queries, query_mask, max_new_tokens)  # mask: float
        response_mask = mask.long()
        marks.append(clock(device))

        # 2. score: one scalar per response, then the optional shaping (EOS penalty, running scaling, clipping)
        responses_text, response_ids = decode(tokenizer, responses, mask)
        raw_scores = scoring(rows, responses_text, response_ids, ended.tolist()).to(device)  # [B]
        scores = shape_scores(args, raw_scores, ended, running, accelerator.gather)
        marks.append(clock(device))
        if args.save_best and update % args.compare_steps == 0:  # plumbing: the weights before this update's changes
            best_reward = save_best(args, accelerator, unwrapped, tokenizer, raw_scores, best_reward, update, run_name)
        marks.append(clock(device))  # saving the best weights is not part of the step time

        # 3. forward passes without gradients: the policy's log-probs and values at sampling time ("old"), and the
        #    reference's log-probs, with logits / temperature as in sampling (Huang et al. 2023, detail 8)
        old_logprobs, ref_logprobs, values, kl_inputs = sampling_forwards(
            args, accelerator, unwrapped, ref_model, settings, queries, query_mask, responses, response_mask
        )
        with torch.no_grad():
            # 4. per-token rewards: r_t = -kl_coef * KL_t, plus the score at the last response token (compute_rewards)
            #    (with --use-kl-loss the KL leaves the reward for the policy loss: r_t is the score alone)
            kl_coef = 0.0 if args.use_kl_loss else kl_ctl.value
            rewards, non_score_rewards, kls = compute_rewards(scores, *kl_inputs, mask, kl_coef, args.kl_penalty)
            del kl_inputs

            # 5. advantages: GAE, A_t = delta_t + gamma * lam * A_{t+1} with delta_t = r_t + gamma V_{t+1} - V_t
            #    (compute_advantages), then whitened; returns = A + V are the value head's targets
            #    (gae_targets: the critic's targets may take their own lambda, VC-PPO's decoupled GAE; the policy's
            #    lambda may adapt to each response's length, VAPO's)
            lam = length_adaptive_lam(mask, args.lam_length_alpha) if args.lam_length_alpha else args.lam
            critic_lam = args.lam if args.critic_lam is None else args.critic_lam
            values, advantages, returns = gae_targets(values, rewards, mask, args.gamma, lam, critic_lam, args.whiten_rewards)
            # Padding gets an obviously wrong log-prob *after* the rewards used the real ones: a masking bug in the
            # loss then shows up as exploding ratios instead of passing silently
            old_logprobs = old_logprobs.masked_fill(mask == 0, INVALID_LOGPROB)
        marks.append(clock(device))

        # 6. optimise: ppo_epochs passes over shuffled mini-batches of the clipped policy and value losses (ppo_loss);
        #    for the first --freezing-actor-steps updates only the critic learns (VC-PPO's value pretraining)
        frozen = update < args.freezing_actor_steps
        model.train()
        all_stats, epochs_done, grad_norms = [], 0, []
        for _ in range(args.ppo_epochs):
            for mb in torch.randperm(args.batch_size).split(args.mini_batch_size):
                with accelerator.accumulate(model):
                    logits, vpreds = forward(model, queries[mb], query_mask[mb], responses[mb], response_mask[mb], **settings)
                    logp = F.log_softmax(logits.float(), dim=-1)  # [B, T, V], once: the log-probs and the entropy
                    logprobs = torch.gather(logp, -1, responses[mb].unsqueeze(-1)).squeeze(-1)
                    old, value, adv, ret = old_logprobs[mb], values[mb], advantages[mb], returns[mb]
                    pg_loss, vf_loss, stats = ppo_loss(
                        old, value, logprobs, vpreds, mask[mb], adv, ret, vf_coef=args.vf_coef, **clipping
                    )
                    loss = pg_loss * (not frozen) + vf_loss  # frozen: 0 x the policy loss keeps every rank's graph alike
                    if args.use_kl_loss:  # OpenRLHF's use_kl_loss: kl_coef x the mean per-token estimate
                        kl = aggregate(kl_estimate(logprobs, ref_logprobs[mb], args.kl_penalty), mask[mb], args.loss_agg_mode)
                        loss, stats["ppo/policy/kl_loss"] = loss + kl_ctl.value * kl * (not frozen), kl.detach()
                    accelerator.backward(loss)
                    if args.max_grad_norm is not None and accelerator.sync_gradients:
                        grad_norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                    for p in actor if frozen and accelerator.sync_gradients else ():
                        p.grad = None  # Adam skips the policy: its weights and moments stay as they are
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    stats["ppo/policy/entropy"] = entropy_from_logprobs(logp[mask[mb].bool()]).mean()  # response tokens
                all_stats.append(stats)
            epochs_done += 1
            if args.early_stopping:  # TRL 0.8: checked on the last mini-batch's policy KL, across ranks
                policykl = accelerator.reduce(stats["ppo/policy/policykl"].to(device), "mean").item()
                if policykl > 1.5 * args.target_kl:
                    optimizer.zero_grad()
                    break
        sampler.sync(unwrapped)  # vLLM's copy of the weights (a no-op otherwise): the next rollout is on-policy
        marks.append(clock(device))

        # ================================ bookkeeping: plumbing from here on ================================
        phases = dict(stats=all_stats, kls=kls, old_logprobs=old_logprobs, mask=mask, non_score_rewards=non_score_rewards)
        batch = dict(raw_scores=raw_scores, scores=scores, ended=ended, query_mask=query_mask, epochs_done=epochs_done)
        watched = scoring.watch(rows, responses_text, response_ids, ended.tolist(), raw_scores, "env")
        metrics = update_metrics(args, accelerator, phases | batch, grad_norms, marks, kl_ctl, scheduler, update) | watched
        if sampler_logprobs is not None:  # vLLM: how far its log-probs lie from the trainer's (TRL 1.16's sampling/*)
            metrics |= pooled(accelerator, [sampler_gap(old_logprobs, sampler_logprobs, mask)])
        logger.log(metrics, update + 1)
        reward_history.append(metrics["env/reward_mean"])
        kl_history.append(metrics["objective/kl"])
        explained_history.append(metrics["ppo/val/var_explained"])
        progress.set_postfix(reward=f"{reward_history[-1]:.3f}", kl=f"{kl_history[-1]:.2f}")
        if (update + 1) % args.log_freq == 0:
            sampled = (rows, responses_text, raw_scores, queries, query_mask, max_new_tokens)
            log_samples(args, sampler, scoring, logger, unwrapped, ref_model, sampled, update + 1)
        if args.eval_freq and (update + 1) % args.eval_freq == 0 and update + 1 < args.num_updates:
            evaluate(args, sampler, scoring, unwrapped, eval_rows, logger, update + 1)
        if args.save_freq and (update + 1) % args.save_freq == 0:
            folder = os.path.join(args.checkpoint_dir or f"{args.output_dir}_checkpoints", f"update_{update + 1}")
            # the run's first evaluation and histories too: the summary and the health line compare with its start
            state = dict(update=update + 1, kl_coef=kl_ctl.value, running_moments=running.__dict__, best_reward=best_reward)
            state |= dict(first_eval=first_eval, reward_history=reward_history, kl_history=kl_history)
            state |= dict(explained_history=explained_history)
            save_checkpoint(accelerator, folder, state, unwrapped, tokenizer, total_limit=args.save_total_limit)

    # ---- final evaluation and save (plain from_pretrained format; a peft policy is merged) ----
    last_eval = evaluate(args, sampler, scoring, unwrapped, eval_rows, logger, args.num_updates)
    accelerator.wait_for_everyone()
    save_model(args, accelerator, unwrapped, tokenizer, args.output_dir, last_eval, final=True, run_name=run_name)
    histories = (reward_history, kl_history, explained_history)
    summary(args, accelerator, start_update, start_time, histories, first_eval, last_eval, best_reward)
    sampler.close()  # vLLM shut down while the process group exists
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
