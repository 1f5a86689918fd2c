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

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro
from accelerate import Accelerator, DistributedType
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from tqdm.auto import tqdm
from transformers import get_scheduler

from common import (
    INVALID_LOGPROB,
    AdaptiveKLController,
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    FastGenerator,
    FixedKLController,
    LogitMask,
    RunningMoments,
    UsageError,
    atomic_directory,
    check_args,
    check_columns,
    check_scores,
    cli,
    clip_by_value,
    context_length,
    create_reference_model,
    end_run,
    entropy_from_logits,
    exact_div,
    kl_estimate,
    load_checkpoint,
    load_config,
    load_data,
    load_reward_model,
    load_tokenizer,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    peft_model_of,
    quantization_kwargs,
    reference_context,
    reward_model_text,
    sampling_kwargs,
    save_checkpoint,
    start_run,
    train_eval_split,
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
    model_name: str = "builtin:tiny-chat"
    """policy: a hub id, a local folder, or a built-in preset (builtin:tiny-chat: a small GPT-2 pretrained on the built-in
    dialogue, built on first use; builtin:tiny-gpt2, builtin:tiny-t5: random); encoder-decoder models (T5) are detected
    from their config"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the dtype every model of the run is loaded in. float32, TRL's default: Adam's small updates round away in bf16
    weights, so weights that train need it (mixed precision, `accelerate launch --mixed_precision bf16`, runs the matmuls
    in bf16). bfloat16 halves the memory of frozen weights (e.g. a LoRA base with --use-peft); auto keeps each
    checkpoint's dtype (transformers 5's default, bf16 for most hub models)"""
    dataset_name: str = "builtin:chatterbot-prompts"
    """prompts: a hub id, a local json/jsonl/csv/parquet file, or builtin:chatterbot-prompts"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    query_column: str = "prompt"
    """the dataset column holding the query text"""
    eval_fraction: float = 0.1
    """fraction of the prompts held out for evaluation (74 of the 749 built-in prompts)"""
    max_query_length: int = 48
    """queries longer than this many tokens are an error (or truncated from the left with --truncate-queries)"""
    truncate_queries: bool = False
    """keep the last `max_query_length` tokens of long queries instead of stopping with an error"""
    reward_model: str | None = "builtin:tiny-chat-rm"
    """a sequence-classification reward model: a hub id, a local folder (e.g. the output of reward_modeling.py), or
    builtin:tiny-chat-rm (tiny-chat trained on the built-in VADER preference pairs, built on first use). None scores
    with `reward_fn` in this file (VADER sentiment of the response): too sparse a signal for the default policy, whose
    chat replies hold few sentiment words, where the reward model separates its responses"""
    reward_label: str | None = None
    """which logit of the reward model is the reward: a label name (e.g. POSITIVE, TRL's gpt2-sentiment recipe with a
    2-label classifier) or an index; None: the model must have a single-logit head"""
    reward_adapter: str | None = None
    """instead of --reward-model: a LoRA reward adapter saved by `reward_modeling.py --use-peft`
    ({output_dir}/reward_adapter), loaded as a second adapter on the policy's base model, so one copy of the base
    weights is policy, reference (adapters off) and reward model (TRL's multi-adapter RL). Needs --use-peft and the
    reward model's base model as --model-name; replaces --reward-model"""
    reward_batch_size: int = 64
    """batch size of the reward model's forward passes"""

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
    """draw each token by inverse CDF (`common.InverseCDFSampler`): the distribution of HF's `do_sample=True`, whose
    torch.multinomial draws one exponential variate per vocabulary entry (on CPU, most of a rollout at GPT-2's 50k
    vocabulary); --no-inverse-cdf-sampling: HF's own sampling"""
    fast_generation: bool = True
    """on CUDA, sample rollouts with `common.FastGenerator`: a static KV cache, each decoding step's forward one compiled
    CUDA graph, the same distribution as the inverse-CDF `generate` (each new batch shape compiles first: 15-30 s on an
    H100). For decoder-only policies sampled by inverse CDF without a logit mask, quantisation, FSDP or DeepSpeed;
    --no-fast-generation, and on CPU: HF `generate`"""
    stop_sequences: list[str] = field(default_factory=list)
    """responses are truncated after the first of these strings (trlX `stop_sequences`), as after an EOS"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of responses that end without EOS or a stop sequence (TRL PPOv2); None: none"""
    generation_batch_size: int | None = None
    """queries per `generate` call (None: the whole batch at once)"""
    logit_mask: str | None = None
    """trlX's logit mask: a JSON file of allowed transitions, {"token id": [ids allowed next], ...}, or trlX's dense
    [vocab][vocab] booleans (True: forbidden). Applied in generation and in the policy's and the reference's
    log-probs, so forbidden tokens are never sampled and carry zero probability"""

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
    """Adam learning rate. TRL's default 1.41e-5 suits GPT-2-sized models (use it there); on the small default policy
    it raises the held-out reward slowly (seed 1: -0.81 -> -0.04 in the default 60 updates, KL 2.0), 7e-5 faster
    (seeds 1-3: -0.81 -> 0.34, -0.65 -> 0.39, -0.57 -> 0.06) with the KL below its target; at 1e-4 the replies of some
    seeds converge on a few phrases the reward model likes (seed 2: distinct-2 0.95 -> 0.63, the health warning)"""
    lr_anneal: bool = False
    """if toggled, the learning rate decays linearly to 0 over the run"""
    adam_eps: float = 1e-5
    """Adam epsilon (lm-human-preferences)"""
    max_grad_norm: float | None = None
    """gradient clipping norm (None: no clipping)"""
    init_kl_coef: float = 0.2
    """initial KL penalty coefficient"""
    adap_kl_ctrl: bool = True
    """adapt the KL coefficient towards `target` (Ziegler et al. 2019); otherwise it stays fixed"""
    target: float = 6.0
    """target KL of the adaptive controller"""
    horizon: float = 320
    """horizon of the adaptive controller: each update moves kl_coef by at most a factor 1 +- 0.2 * batch / horizon.
    lm-human-preferences' 10000 was meant for batches of 256-512 (2-5% per update); with the default 16 episodes per
    update it would stay put (0.03% per update), so 320 gives the same 5% per update. Scale it with the batch"""
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
    log_freq: int = 5
    """log a table of sample generations every this many updates"""
    log_ref_responses: bool = False
    """with each sample table, also answer its queries with the reference model and show those responses and
    scores beside the policy's (TRL's generate_ref_response); logs env/ref_reward_mean"""
    eval_freq: int = 20
    """evaluate on the held-out prompts every this many updates (and at the end); 0: only at the end"""
    eval_samples: int = 64
    """held-out prompts per evaluation"""
    save_freq: int = 0
    """write a checkpoint every this many updates (0: only the final model)"""
    output_dir: str = "outputs/ppo"
    """where the final model goes (plain from_pretrained format, value head in value_head.safetensors)"""
    checkpoint_dir: str | None = None
    """where --save-freq checkpoints go (None: {output_dir}_checkpoints)"""
    resume_from: str | None = None
    """a checkpoint folder to resume from (model, optimizer, scheduler, KL controller, RNG, step)"""
    save_best: bool = False
    """keep the policy whose rollout batch had the highest mean reward (the reward function's or reward model's raw
    score) in {output_dir}_best, saved before that batch's update (TRL's push_to_hub_if_best). With --push-to-hub,
    each new best is uploaded instead of the final model"""
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


def top_token_share(responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """The share of the most frequent token among all response tokens [B, T] (padding left out): a collapse into one
    repeated word shows as a share near 1; varied replies stay low."""
    tokens = responses[responses != pad_token_id]
    return tokens.unique(return_counts=True)[1].max() / len(tokens) if len(tokens) else torch.tensor(0.0)


def distinct_bigrams(texts: list[str]) -> float:
    """Distinct word bigrams over all responses / all bigrams (distinct-2, Li et al. 2016): low when many responses
    repeat one phrase, even where each response is varied within itself."""
    bigrams = [pair for text in texts for pair in zip(text.split(), text.split()[1:])]
    return len(set(bigrams)) / max(1, len(bigrams))


def health_check(
    final_kl: float,
    target: float,
    top_share: float,
    distinct_words: float,
    distinct_2: float,
    start_distinct_2: float,
    start_top_share: float,
) -> tuple[str, str | None]:
    """A summary of whether the run stayed near its reference, and a warning when it did not: a KL past 3x its target,
    responses collapsed into one token (over 30% of response tokens), responses filling up with one token (its share
    tripled, to over 20%: e.g. whitespace padding a reward model happens to like), or responses that repeat each other
    (distinct-2 below 0.7 of its value at the start: a third of the replies sharing a few phrases the reward model
    likes) mean reward hacking, not learning."""
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
        return line, (
            f"warning: the responses repeat each other (distinct-2 {distinct_2:.2f}, {start_distinct_2:.2f} at "
            f"the start); {advice}"
        )
    return line, None


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
):
    """Clipped PPO objective (Schulman et al. 2017, eq. 7) and clipped value loss, as TRL 0.8's `loss`.

    All inputs [B, T]. Returns (pg_loss, vf_coef * vf_loss, stats); both losses are zeroed when the mean ratio
    exceeds `ratio_threshold` (the mini-batch is skipped, stats["ppo/skipped"] = 1).
    """
    vpredclipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1, vf_losses2 = (vpreds - returns) ** 2, (vpredclipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
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
            "ppo/val/var_explained": 1 - masked_var(returns - vpreds, mask) / masked_var(returns, mask),
            "ppo/skipped": 1 - keep,
        }
    return pg_loss, vf_coef * vf_loss, stats


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


def truncate_responses(responses, eos_token_id, pad_token_id, stop_token_ids=()):
    """Cut each response after its first EOS or stop sequence; return (responses, mask, ended).

    The mask marks tokens up to and including the first EOS (or the end of a stop sequence); later tokens
    become padding. A pad token sampled mid-response stays a real token: the mask does not look at pad ids.
    `ended` is True for responses that hit an EOS or a stop sequence.
    """
    T = responses.shape[1]
    positions = torch.arange(T, device=responses.device)
    is_eos = responses == eos_token_id
    ended = is_eos.any(1)
    ends = torch.where(ended, is_eos.float().argmax(1), T - 1)
    for stop in stop_token_ids:  # a stop sequence ends at index i if responses[i-len+1 : i+1] == stop
        if len(stop) > T:
            continue
        windows = responses.unfold(1, len(stop), 1)  # [B, T - len + 1, len]
        hit = (windows == torch.tensor(stop, device=responses.device)).all(-1)
        stop_end = torch.where(hit.any(1), hit.float().argmax(1) + len(stop) - 1, T - 1)
        ends, ended = torch.minimum(ends, stop_end), ended | hit.any(1)
    mask = (positions[None] <= ends[:, None]).long()
    return responses.masked_fill(mask == 0, pad_token_id), mask, ended


if __name__ == "__main__":
    args = cli(Args)
    check_args(
        args,
        positive=(
            "total_episodes batch_size mini_batch_size gradient_accumulation_steps ppo_epochs learning_rate "
            "max_query_length temperature target horizon cliprange cliprange_value reward_batch_size eval_samples "
            "log_freq compare_steps ratio_threshold generation_batch_size adam_eps max_grad_norm score_clip"
        ),
        non_negative="init_kl_coef vf_coef top_k eval_freq save_freq target_kl",
        fractions="eval_fraction",
    )
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1 and 0 < args.top_p <= 1):
        raise UsageError(
            f"--gamma {args.gamma}, --lam {args.lam}, --top-p {args.top_p}: gamma and lam lie in [0, 1], top_p in (0, 1]."
        )
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    quantization = quantization_kwargs(args.model_name, args.load_in_8bit, args.load_in_4bit, args.use_peft)
    device = accelerator.device
    args.world_size = accelerator.num_processes

    # ---- sizes, checked before anything expensive ----
    exact_div(
        args.batch_size,
        args.mini_batch_size * args.gradient_accumulation_steps,
        "batch_size / (mini_batch_size * gradient_accumulation_steps)",
    )
    args.num_updates = exact_div(
        args.total_episodes, args.batch_size * args.world_size, "total_episodes / (batch_size * world_size)"
    )
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        raise UsageError(f"Need 1 <= min_new_tokens ({args.min_new_tokens}) <= max_new_tokens ({args.max_new_tokens}).")
    generation_batch_size = args.generation_batch_size or args.batch_size
    exact_div(args.batch_size, generation_batch_size, "batch_size / generation_batch_size")
    run_name, logger = start_run(args, accelerator)

    # ---- data: tokenised queries, a held-out split for evaluation (checked before any model is loaded) ----
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    dataset = load_data(args.dataset_name, args.dataset_split)
    check_columns(dataset, [args.query_column], "--query-column")
    train_dataset, eval_dataset = train_eval_split(dataset, args.eval_fraction, args.seed)
    train_queries = [tokenizer(q)["input_ids"] for q in train_dataset[args.query_column]]
    eval_queries = [tokenizer(q)["input_ids"] for q in eval_dataset[args.query_column]][: args.eval_samples]
    too_long = [len(q) for q in train_queries + eval_queries if len(q) > args.max_query_length]
    if too_long and not args.truncate_queries:
        raise UsageError(
            f"{len(too_long)} queries are longer than max_query_length={args.max_query_length} tokens "
            f"(longest {max(too_long)}): raise --max-query-length or pass --truncate-queries."
        )
    if not all(train_queries) or not all(eval_queries):
        accelerator.print(f"warning: {sum(not q for q in train_queries + eval_queries)} empty queries left out")
    train_queries = [q[-args.max_query_length :] for q in train_queries if q]
    eval_queries = [q[-args.max_query_length :] for q in eval_queries if q]
    per_update = args.batch_size * args.world_size
    batches_per_epoch = len(train_queries) // per_update
    if batches_per_epoch == 0:
        raise UsageError(f"{len(train_queries)} training queries are fewer than one batch of {per_update}.")
    accelerator.print(
        f"{len(train_queries)} training queries, {len(eval_queries)} held out; {args.num_updates} updates "
        f"of {per_update} episodes; each pass over the data reshuffles and leaves out "
        f"{len(train_queries) % per_update} queries (different ones each pass)"
    )

    # ---- models ----
    is_encoder_decoder = getattr(load_config(args.model_name), "is_encoder_decoder", False)
    wrapper_class = AutoModelForSeq2SeqLMWithValueHead if is_encoder_decoder else AutoModelForCausalLMWithValueHead
    # Always the initial weights, also on resume: the reference is a copy of them; the resumed policy comes
    # from the checkpoint's accelerate state below
    model = wrapper_class.from_pretrained(
        args.model_name, value_head_kwargs=dict(init=args.value_head_init), dtype=args.dtype, **quantization
    )
    # seq2seq: the decoder starts from this token (passed explicitly: a DDP wrapper has no .config)
    decoder_start = model.config.decoder_start_token_id if is_encoder_decoder else None
    context = context_length(model.config)
    if context and not is_encoder_decoder and args.max_query_length + args.max_new_tokens > context:
        raise UsageError(
            f"max_query_length ({args.max_query_length}) + max_new_tokens ({args.max_new_tokens}) "
            f"exceeds the model's context of {context} tokens: shorten one of them."
        )
    if args.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if quantization:
        model.pretrained_model = prepare_model_for_kbit_training(model.pretrained_model)
    if args.use_peft and peft_model_of(model) is None:
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type="SEQ_2_SEQ_LM" if is_encoder_decoder else "CAUSAL_LM",
        )
        model.pretrained_model = get_peft_model(model.pretrained_model, lora)
    ref_model = create_reference_model(model, num_shared_layers=args.num_shared_layers)  # None with peft
    reward_model = reward_tokenizer = None
    reward_index = 0  # the logit of the reward model that is the reward
    if args.reward_model is not None and args.reward_adapter is None:
        reward_model, reward_index = load_reward_model(args.reward_model, args.reward_label, args.dtype)
        reward_tokenizer = load_tokenizer(args.reward_model, padding_side="right")
    if args.reward_adapter is not None:  # the reward model is the policy's base with a second, frozen adapter
        model.load_reward_adapter(args.reward_adapter, base_model_name=args.model_name)
        reward_tokenizer = load_tokenizer(args.model_name, padding_side="right")
    logit_mask = LogitMask.from_file(args.logit_mask, model.config.vocab_size) if args.logit_mask else None
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(
        f"policy {args.model_name}: {n_trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,} "
        f"parameters; reference: {'adapter disabled' if ref_model is None else 'frozen copy'}"
        f"{f', {args.num_shared_layers} shared blocks' if args.num_shared_layers else ''}"
    )

    reward_context = context_length(reward_model.config if reward_model is not None else None)
    if reward_context:  # "query response<eos>" must fit the reward model too (a BERT-style one reads 512 tokens)
        texts = tokenizer.batch_decode(train_queries + eval_queries, skip_special_tokens=True)
        longest = max(len(ids) for ids in reward_tokenizer(texts)["input_ids"])
        if longest + args.max_new_tokens + 1 > reward_context:  # responses counted in policy tokens: an estimate
            raise UsageError(
                f"Queries of up to {longest} reward-model tokens plus {args.max_new_tokens} response tokens "
                f"exceed the reward model's context of {reward_context}: lower --max-query-length (with "
                "--truncate-queries) or --max-new-tokens."
            )

    def batch_indices(update: int) -> list[int]:
        """This rank's query indices for an update: a seeded reshuffle per data pass, so a resume continues exactly."""
        epoch, i = divmod(update, batches_per_epoch)
        order = torch.randperm(len(train_queries), generator=torch.Generator().manual_seed(args.seed + epoch))
        start = (i * args.world_size + accelerator.process_index) * args.batch_size
        return order[start : start + args.batch_size].tolist()

    def pad_left(queries: list[list[int]]):
        batch = tokenizer.pad({"input_ids": queries}, return_tensors="pt")
        return batch["input_ids"].to(device), batch["attention_mask"].to(device)

    stop_token_ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in args.stop_sequences]

    # the log-probs of the forward passes see what sampling saw: logits / temperature, the logit mask
    forward_kwargs = dict(temperature=args.temperature, decoder_start_token_id=decoder_start, logit_mask=logit_mask)
    # forbidden transitions are masked before the temperature / top-k / top-p warpers and the draw
    sampling = sampling_kwargs(
        args.temperature, args.top_k, args.top_p, args.inverse_cdf_sampling, [logit_mask] if logit_mask is not None else []
    )

    fast_generator = None  # parameters are moved and wrapped in place by prepare: it keeps serving the policy
    if (
        args.fast_generation
        and device.type == "cuda"
        and args.inverse_cdf_sampling
        and not is_encoder_decoder
        and logit_mask is None
        and not quantization
        and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
    ):
        fast_generator = FastGenerator(model.pretrained_model, args.temperature, args.top_k, args.top_p)
    accelerator.print(f"rollouts: {'compiled static-cache decoding' if fast_generator else 'HF generate'}")

    @torch.no_grad()
    def generate(policy, queries, query_mask, max_new_tokens: int, fast: bool = True):
        """Sample responses in batches of generation_batch_size (KV cache, left padding), cut after the first EOS or
        stop sequence: (responses [B, T], mask [B, T], ended [B]) as `truncate_responses` returns them. `fast`: the
        policy's own samples, which `fast_generator` (when there is one) draws instead of `policy.generate`."""
        outputs = []
        for i in range(0, len(queries), generation_batch_size):
            ids, mask = queries[i : i + generation_batch_size], query_mask[i : i + generation_batch_size]
            with accelerator.autocast():  # mixed precision reaches generate too (prepare wraps forward only)
                if fast and fast_generator is not None:  # the responses only
                    out = fast_generator(ids, mask, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)[0]
                else:
                    out = policy.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        max_new_tokens=max_new_tokens,
                        pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id,
                        **sampling,
                    )
                    out = out[:, 1:] if decoder_start is not None else out[:, queries.shape[1] :]
            outputs.append(out)
        width = max(o.shape[1] for o in outputs)  # generation stops early when every sequence has ended
        responses = torch.cat(
            [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=tokenizer.pad_token_id) for o in outputs]
        )
        return truncate_responses(responses, tokenizer.eos_token_id, tokenizer.pad_token_id, stop_token_ids)

    @torch.no_grad()
    def score(queries_text: list[str], responses_text: list[str], ended: list[bool]) -> torch.Tensor:
        """One score per (query, response): `reward_fn`, or the reward model's logit on the text as
        reward_modeling.py trains it: "query response<eos>", the EOS only for responses that ended."""
        if reward_tokenizer is None:
            return check_scores(reward_fn(queries_text, responses_text), len(responses_text), "reward_fn")
        eos = reward_tokenizer.eos_token
        texts = [reward_model_text(q, r, eos, e) for q, r, e in zip(queries_text, responses_text, ended)]
        scores = []
        for i in range(0, len(texts), args.reward_batch_size):
            batch = reward_tokenizer(texts[i : i + args.reward_batch_size], padding=True, return_tensors="pt").to(device)
            with accelerator.autocast():
                logits = reward_model(**batch).logits if reward_model is not None else unwrapped.compute_reward_score(**batch)
            scores.append(logits[:, reward_index].float().cpu())
        return check_scores(torch.cat(scores), len(texts), f"reward model {args.reward_model or args.reward_adapter}")

    # ---- optimiser, KL controller, resume ----
    # fused: one kernel over all parameters, several times faster than the per-tensor update
    optimizer = torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad], lr=args.learning_rate, eps=args.adam_eps, fused=True
    )
    optimizer_steps = (
        args.num_updates * args.ppo_epochs * args.batch_size // (args.mini_batch_size * args.gradient_accumulation_steps)
    )
    # accelerate's prepared scheduler steps once per process per optimizer step
    scheduler = get_scheduler(
        "linear" if args.lr_anneal else "constant",
        optimizer,
        num_warmup_steps=0,
        num_training_steps=optimizer_steps * args.world_size,
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    unwrapped = accelerator.unwrap_model(model)
    if ref_model is not None:
        ref_model = ref_model.to(device)
    if reward_model is not None:
        reward_model = reward_model.to(device)
    score(["Hello", "Hi"], [" there", " you"], [True, False])  # a bad reward (wrong length, NaN) fails before training
    kl_ctl = (
        AdaptiveKLController(args.init_kl_coef, args.target, args.horizon)
        if args.adap_kl_ctrl
        else FixedKLController(args.init_kl_coef)
    )
    running = RunningMoments()
    start_update, best_reward, state = 0, float("-inf"), {}
    if args.resume_from:
        state = load_checkpoint(accelerator, args.resume_from)
        start_update, kl_ctl.value, best_reward = state["update"], state["kl_coef"], state.get("best_reward", float("-inf"))
        if start_update >= args.num_updates:
            raise UsageError(
                f"--resume-from {args.resume_from}: the checkpoint is at update {start_update}, and this run "
                f"has {args.num_updates}: raise --total-episodes to train further."
            )
        running.__dict__.update(state["running_moments"])
        accelerator.print(f"resumed from {args.resume_from} at update {start_update}")

    def checkpoint(path: str, update: int) -> None:
        """Model + value head (from_pretrained format), optimizer, scheduler, RNG, KL controller, step, and the run's
        first evaluation and reward / KL histories (the summary and the health line compare with the run's start)."""
        state = dict(
            update=update,
            kl_coef=kl_ctl.value,
            running_moments=running.__dict__,
            best_reward=best_reward,
            first_eval=first_eval,
            reward_history=reward_history,
            kl_history=kl_history,
        )
        save_checkpoint(accelerator, path, state, lambda tmp: (unwrapped.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))

    def save_model(path: str, metrics: dict[str, float], final: bool) -> None:
        """Policy (plain from_pretrained format, value head beside it), tokenizer and model card, written atomically
        by the main process; uploaded with --push-to-hub (the final model, or each new best with --save-best)."""
        policy = unwrapped
        if peft_model_of(unwrapped) is not None:  # LoRA merged into the base: loads with plain from_pretrained
            # the final save merges in place; a best checkpoint merges a copy, so training goes on
            merged = (unwrapped.pretrained_model if final else copy.deepcopy(unwrapped.pretrained_model)).merge_and_unload()
            policy = wrapper_class(merged)
            policy.v_head = unwrapped.v_head
        with atomic_directory(path) as tmp:
            policy.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_model_card(tmp, args, "ppo", metrics)
        if args.push_to_hub and final != args.save_best:
            policy.pretrained_model.push_to_hub(args.hub_model_id or run_name)
            tokenizer.push_to_hub(args.hub_model_id or run_name)

    def reduce_mean(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Average scalar metrics over ranks in one collective and one device sync."""
        names = list(metrics)
        values = accelerator.reduce(torch.stack([metrics[k].float().to(device) for k in names]), "mean")
        return dict(zip(names, values.tolist()))

    @torch.no_grad()
    @torch.random.fork_rng()  # evaluation draws from its own RNG: how often it runs never changes training
    def evaluate(update: int) -> dict[str, float]:
        """Sample on the held-out prompts and report reward and `metric_fn` metrics, gathered over ranks."""
        torch.manual_seed(args.seed + accelerator.process_index)
        queries, query_mask = pad_left(eval_queries)
        unwrapped.eval()
        responses, _, ended = generate(unwrapped, queries, query_mask, args.max_new_tokens)
        queries_text = tokenizer.batch_decode(queries, skip_special_tokens=True)
        responses_text = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = score(queries_text, responses_text, ended.tolist())
        metrics = {
            "eval/reward_mean": scores.mean(),
            "eval/reward_std": scores.std(),
            "eval/top_token_share": top_token_share(responses, tokenizer.pad_token_id),
            "eval/distinct_2": torch.tensor(distinct_bigrams(responses_text)),
        }
        extra = metric_fn(queries_text, responses_text)
        metrics.update({f"eval/{k}": torch.tensor(v).float().mean() for k, v in extra.items()})
        metrics = reduce_mean(metrics)
        logger.log(metrics, update)
        logger.samples("eval samples", {"query": queries_text, "response": responses_text, "score": scores.tolist()}, update)
        return metrics

    @torch.no_grad()
    @torch.random.fork_rng()  # sampling from the reference never changes the training run's random stream
    def ref_responses(queries, query_mask, queries_text: list[str], max_new_tokens: int, update: int) -> dict:
        """Reference-model responses to the logged queries and their scores, as sample-table columns."""
        with reference_context(unwrapped, ref_model):
            responses, _, ended = generate(
                ref_model if ref_model is not None else unwrapped, queries, query_mask, max_new_tokens, fast=False
            )
        responses_text = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = score(queries_text, responses_text, ended.tolist())
        logger.log(reduce_mean({"env/ref_reward_mean": scores.mean()}), update)
        return {"ref response": responses_text, "ref score": scores.tolist()}

    def clock() -> float:
        """Wall time once the device has finished its queued work, so that phase times add up on a GPU too."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.time()

    def save_best(update: int, raw_scores: torch.Tensor) -> float:
        """TRL's push_to_hub_if_best: every compare_steps updates, if this batch's mean raw score (over ranks) is the
        best so far, save the weights that produced it (those before this update's optimisation) to {output_dir}_best.
        Returns the best batch reward so far."""
        if not args.save_best or update % args.compare_steps:
            return best_reward
        batch_reward = accelerator.reduce(raw_scores.mean(), "mean").item()
        if batch_reward <= best_reward:
            return best_reward
        if accelerator.is_main_process:
            save_model(f"{args.output_dir}_best", {"best/reward_mean": batch_reward, "best/update": update}, final=False)
        return batch_reward

    first_eval = evaluate(start_update)  # after a resume: logged at the resumed update, and the run's start kept
    first_eval = state.get("first_eval", first_eval)
    reward_history, kl_history = state.get("reward_history", []), state.get("kl_history", [])
    start_time = time.time()
    progress = tqdm(range(start_update, args.num_updates), disable=not accelerator.is_local_main_process, desc="ppo")
    for update in progress:
        # ================================ the algorithm: phases 1-6 ================================
        marks = [clock()]  # phase boundaries, for time/* (bookkeeping below)

        # 1. rollout: this rank's queries, responses of a length drawn from [min, max]_new_tokens (TRL's LengthSampler)
        queries, query_mask = pad_left([train_queries[i] for i in batch_indices(update)])
        max_new_tokens = int(np.random.randint(args.min_new_tokens, args.max_new_tokens + 1))
        unwrapped.eval()
        responses, response_mask, ended = generate(unwrapped, queries, query_mask, max_new_tokens)  # [B, T] each
        mask = response_mask.float()
        marks.append(clock())

        # 2. score: one scalar per response, then the optional shaping (EOS penalty, running scaling, clipping)
        queries_text = tokenizer.batch_decode(queries, skip_special_tokens=True)
        responses_text = tokenizer.batch_decode(responses, skip_special_tokens=True)
        raw_scores = score(queries_text, responses_text, ended.tolist()).to(device)  # [B]
        scores = raw_scores.clone()
        if args.missing_eos_penalty is not None:
            scores[~ended] -= args.missing_eos_penalty
        if args.use_score_scaling:
            running.update(accelerator.gather(scores))
            shifted = scores - running.mean if args.use_score_norm else scores
            scores = shifted / (running.std + torch.finfo(scores.dtype).eps)
        if args.score_clip is not None:
            scores = scores.clamp(-args.score_clip, args.score_clip)
        marks.append(clock())
        best_reward = save_best(update, raw_scores)  # plumbing (--save-best), before this update changes the weights
        marks.append(clock())  # saving the best weights is not part of the step time

        # 3. forward passes without gradients: the policy's log-probs and values at sampling time ("old"), and the
        #    reference's log-probs, with logits / temperature as in sampling (Huang et al. 2023, detail 8)
        full = args.kl_penalty == "full"  # the exact KL needs both full distributions [B, T, V]
        old_logprobs, ref_logprobs, values, full_logprobs, full_ref_logprobs = [], [], [], [], []
        with torch.no_grad():
            for i in range(0, args.batch_size, args.mini_batch_size):
                mb = slice(i, i + args.mini_batch_size)
                inputs = (queries[mb], query_mask[mb], responses[mb], response_mask[mb])
                logits, value = forward(unwrapped, *inputs, **forward_kwargs)
                with reference_context(unwrapped, ref_model), accelerator.autocast():  # the reference is not prepared
                    ref_logits, _ = forward(ref_model if ref_model is not None else unwrapped, *inputs, **forward_kwargs)
                old_logprobs.append(logprobs_from_logits(logits, responses[mb]))
                ref_logprobs.append(logprobs_from_logits(ref_logits, responses[mb]))
                values.append(value)
                if full:
                    full_logprobs.append(torch.log_softmax(logits.float(), -1))
                    full_ref_logprobs.append(torch.log_softmax(ref_logits.float(), -1))
            old_logprobs, ref_logprobs, values = torch.cat(old_logprobs), torch.cat(ref_logprobs), torch.cat(values)

            # 4. per-token rewards: r_t = -kl_coef * KL_t, plus the score at the last response token (compute_rewards)
            kl_inputs = (torch.cat(full_logprobs), torch.cat(full_ref_logprobs)) if full else (old_logprobs, ref_logprobs)
            rewards, non_score_rewards, kls = compute_rewards(scores, *kl_inputs, mask, kl_ctl.value, args.kl_penalty)
            del kl_inputs, full_logprobs, full_ref_logprobs

            # 5. advantages: GAE, A_t = delta_t + gamma * lam * A_{t+1} with delta_t = r_t + gamma V_{t+1} - V_t
            #    (compute_advantages), then whitened; returns = A + V are the value head's targets
            values, advantages, returns = compute_advantages(values, rewards, mask, args.gamma, args.lam, args.whiten_rewards)
            # Padding gets an obviously wrong log-prob *after* the rewards used the real ones: a masking bug in the
            # loss then shows up as exploding ratios instead of passing silently
            old_logprobs = old_logprobs.masked_fill(mask == 0, INVALID_LOGPROB)
        marks.append(clock())

        # 6. optimise: ppo_epochs passes over shuffled mini-batches of the clipped policy and value losses (ppo_loss)
        model.train()
        all_stats, epochs_done = [], 0
        for _ in range(args.ppo_epochs):
            for mb in torch.randperm(args.batch_size).split(args.mini_batch_size):
                with accelerator.accumulate(model):
                    logits, vpreds = forward(
                        model, queries[mb], query_mask[mb], responses[mb], response_mask[mb], **forward_kwargs
                    )
                    logprobs = logprobs_from_logits(logits, responses[mb])
                    pg_loss, vf_loss, stats = ppo_loss(
                        old_logprobs[mb],
                        values[mb],
                        logprobs,
                        vpreds,
                        mask[mb],
                        advantages[mb],
                        returns[mb],
                        args.cliprange,
                        args.cliprange_value,
                        args.vf_coef,
                        args.ratio_threshold,
                    )
                    accelerator.backward(pg_loss + vf_loss)
                    if args.max_grad_norm is not None and accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    stats["ppo/policy/entropy"] = masked_mean(entropy_from_logits(logits), mask[mb])
                all_stats.append(stats)
            epochs_done += 1
            if args.early_stopping:  # TRL 0.8: checked on the last mini-batch's policy KL, across ranks
                policykl = accelerator.reduce(stats["ppo/policy/policykl"].to(device), "mean").item()
                if policykl > 1.5 * args.target_kl:
                    optimizer.zero_grad()
                    break
        marks.append(clock())

        # ================================ bookkeeping: plumbing from here on ================================
        with torch.no_grad():
            metrics = {k: torch.stack([s[k].float() for s in all_stats]).mean() for k in all_stats[0]}
            metrics.update(
                {
                    "objective/kl": kls.sum(1).mean(),
                    "objective/entropy": (-old_logprobs * mask).sum(1).mean(),
                    "objective/non_score_reward": non_score_rewards.sum(1).mean(),
                    "env/reward_mean": raw_scores.mean(),
                    "env/reward_std": raw_scores.std(),
                    "env/score_mean": scores.mean(),
                    "env/contains_eos": ended.float().mean(),
                    "tokens/query_len": query_mask.sum(1).float().mean(),
                    "tokens/response_len": mask.sum(1).mean(),
                    "ppo/epochs_done": torch.tensor(float(epochs_done)),
                }
            )
            metrics = reduce_mean(metrics)
        mean_kl = metrics["objective/kl"]
        metrics["objective/kl_coef"] = kl_ctl.value  # the coefficient used in this update's rewards
        kl_ctl.update(mean_kl, args.batch_size * args.world_size)  # towards its target KL (Ziegler et al. 2019)
        phases = ("rollout", "score", None, "forward", "optimise")  # None: the --save-best interval, not timed
        times = {name: b - a for name, a, b in zip(phases, marks, marks[1:]) if name}
        step_time, tokens = sum(times.values()), metrics["tokens/query_len"] + metrics["tokens/response_len"]
        metrics.update(
            {f"time/{phase}": t for phase, t in times.items()}
            | {
                "throughput/episodes_per_s": per_update / step_time,
                "throughput/tokens_per_s": per_update * tokens / step_time,
                "charts/learning_rate": scheduler.get_last_lr()[0],
                "charts/episodes": (update + 1) * per_update,
            }
        )
        logger.log(metrics, update + 1)
        reward_history.append(metrics["env/reward_mean"])
        kl_history.append(mean_kl)
        progress.set_postfix(reward=f"{metrics['env/reward_mean']:.3f}", kl=f"{mean_kl:.2f}")
        if (update + 1) % args.log_freq == 0:
            columns = {"query": queries_text, "response": responses_text, "score": raw_scores.tolist()}
            if args.log_ref_responses:
                columns |= ref_responses(queries, query_mask, queries_text, max_new_tokens, update + 1)
            logger.samples("samples", columns, update + 1)
        if args.eval_freq and (update + 1) % args.eval_freq == 0 and update + 1 < args.num_updates:
            evaluate(update + 1)
        if args.save_freq and (update + 1) % args.save_freq == 0:
            folder = args.checkpoint_dir or f"{args.output_dir}_checkpoints"
            checkpoint(os.path.join(folder, f"update_{update + 1}"), update + 1)

    # ---- final evaluation and save (plain from_pretrained format; a peft policy is merged) ----
    last_eval = evaluate(args.num_updates)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_model(args.output_dir, last_eval, final=True)
    window = max(1, len(reward_history) // 10)
    final_kl = float(np.mean(kl_history[-window:]))
    accelerator.print(
        f"ppo: {args.num_updates - start_update} updates, {(args.num_updates - start_update) * per_update} episodes in "
        f"{time.time() - start_time:.0f}s; train reward {np.mean(reward_history[:window]):.3f} -> "
        f"{np.mean(reward_history[-window:]):.3f}; eval reward {first_eval['eval/reward_mean']:.3f} -> "
        f"{last_eval['eval/reward_mean']:.3f} (initial std {first_eval['eval/reward_std']:.3f}); KL {final_kl:.2f}; "
        f"model saved to {args.output_dir}"
        + (f" (best batch reward {best_reward:.3f}: {args.output_dir}_best)" if args.save_best else "")
    )
    # ---- health: a reward that rose while the policy left its reference is reward hacking, not learning ----
    health, warning = health_check(
        final_kl,
        args.target,
        last_eval["eval/top_token_share"],
        last_eval["eval/distinct_words"],
        last_eval["eval/distinct_2"],
        first_eval["eval/distinct_2"],
        first_eval["eval/top_token_share"],
    )
    accelerator.print(health + (f"\n{warning}" if warning else ""))
    end_run(accelerator, logger)  # every rank leaves together
