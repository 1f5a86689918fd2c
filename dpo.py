"""Direct Preference Optimization (Rafailov et al. 2023) and TRL 1.16's loss family (`dpo_loss`: hinge, IPO, EXO, NCA,
robust, BCO, SPPO, AOT, APO, DiscoPOP, SFT, length-normalised sigmoid; weighted sums of them as in MPO; LD-DPO's length
weighting, f-DPO's divergences), with TRL 0.8's KTO-pair and conservative DPO (label smoothing), reference-free.

The policy is trained directly on (prompt, chosen, rejected) pairs: the loss compares the policy's log-ratio
log pi(chosen) - log pi(rejected) with the reference model's, so no reward model and no sampling are needed.
The implicit reward of a response is beta * (log pi(y|x) - log pi_ref(y|x)).

Usage:
    python dpo.py                                   # offline: builtin:tiny-chat on the built-in VADER-labelled pairs
    accelerate launch dpo.py --loss-type ipo --beta 0.5
    python dpo.py --loss-type sigmoid bco_pair sft --loss-weights 0.8 0.2 1.0   # MPO
    accelerate launch --config_file configs/multi_gpu.yaml dpo.py --model-name outputs/sft --use-peft
    python dpo.py --model-name builtin:tiny-t5       # encoder-decoder: prompt to the encoder, responses as labels
"""

import gc
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, get_scheduler

from common.chat import render, text_of, use_chat
from common.checkpoints import full_weights, load_checkpoint, save_checkpoint
from common.cli import cli
from common.core import UsageError, adamw, check_adam, check_args, masked_mean, pad_right, plain
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
from common.models import (
    check_lora_targets,
    create_reference_model,
    disable_dropout,
    peft_model_of,
    place_frozen,
    reference_context,
    sync_reference,
)
from common.outputs import atomic_directory, check_finite, write_model_card
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
    on first use); encoder-decoder models (builtin:tiny-t5, t5-small) get the prompt in the encoder"""
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
    """the prompt column"""
    chosen_column: str = "chosen"
    """the preferred response column"""
    rejected_column: str = "rejected"
    """the other response column"""
    max_length: int = 128
    """prompt + response tokens (decoder-only models)"""
    max_prompt_length: int = 64
    """prompt tokens kept when prompt + response exceeds max_length (then responses are cut to the rest); for an
    encoder-decoder model, the encoder's input is always cut to this length"""
    max_target_length: int = 64
    """encoder-decoder models: response tokens (decoder labels, EOS included) kept"""
    chat_template: bool = True
    """render string prompts and answers as user and assistant messages with the tokenizer's chat template, when it has
    one (messages always are); --no-chat-template: raw text, as TRL does with string pairs"""
    system_prompt: str | None = None
    """a system message put before every chat prompt that has none (None: the template's default, if any)"""
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    """which end of a long prompt to keep"""
    eval_fraction: float = 0.1
    """fraction of the pairs held out for evaluation"""

    # DPO
    beta: float = 0.1
    """temperature of the implicit reward (IPO: the regulariser tau)"""
    loss_type: list[
        Literal[
            "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
            "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "kto_pair", "cpo", "simpo", "orpo",
        ]
    ] = field(default_factory=lambda: ["sigmoid"])  # fmt: skip
    """TRL 1.16's losses (`dpo_loss`; kto_pair is TRL 0.8's), and cpo, simpo, orpo without a reference model
    (`reference_free_loss`); several are summed with --loss-weights (MPO)"""
    loss_weights: list[float] | None = None
    """one weight per --loss-type (None: 1 each)"""
    label_smoothing: float = 0.0
    """the chance a label is flipped: conservative DPO with sigmoid (TRL 0.8), robust, exo_pair, aot"""
    ld_alpha: float | None = None
    """LD-DPO: the weight of the tokens past the shorter reply of a pair, in [0, 1] (None: 1)"""
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    """the f-divergence to the reference (f-DPO); reverse_kl is DPO's"""
    f_alpha_divergence_coef: float = 0.5
    """alpha of --f-divergence-type alpha_divergence"""
    discopop_tau: float = 0.05
    """the temperature of DiscoPOP's mixing (--loss-type discopop)"""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (--loss-type simpo; TRL CPOConfig's simpo_gamma)"""
    use_weighting: bool = False
    """WPO: weight each pair's loss by its replies' length-normalised probabilities under the policy (TRL 1.16)"""
    reference_free: bool = False
    """ignore the reference model (an implicit uniform reference)"""
    precompute_ref_log_probs: bool = False
    """compute the reference log-probs of every pair once before training, then free the reference model"""
    disable_dropout: bool = True
    """set every dropout probability of policy and reference to 0 (TRL default)"""
    sync_ref_model: bool = False
    """TR-DPO (Gorbatovski et al. 2024): every --ref-model-sync-steps optimizer steps the reference moves towards the
    policy, ref <- alpha * policy + (1 - alpha) * ref (TRL's sync_ref_model)"""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha: the policy's share in each update of the reference (1: a hard copy)"""
    ref_model_sync_steps: int = 512
    """TR-DPO: optimizer steps between two updates of the reference"""

    # Optimisation
    learning_rate: float = 1e-4
    """peak learning rate (high because the default model is tiny and random; ~5e-7 for a pretrained 7B model)"""
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
    """pairs per forward/backward pass on each process (2x sequences: chosen and rejected together)"""
    gradient_accumulation_steps: int = 1
    """forward/backward passes per optimizer step"""
    num_epochs: int = 1
    """passes over the training pairs"""
    max_steps: int = -1
    """optimizer steps to run (overrides num_epochs when > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    gradient_checkpointing: bool = False
    """trade compute for memory"""
    chunked_logps: bool = True
    """decoder-only: log-probs from the last hidden states, the LM head run on 1024 labelled tokens at a time, so the
    [2 * batch, length, vocab] logits are never held (the values of `get_batch_logps`, tested); off, and for
    encoder-decoder models, FSDP / DeepSpeed (sharded head) and heads that scale or soft-cap logits: full logits"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (and at the end)"""
    generate_during_eval: bool = True
    """at each evaluation, sample replies to held-out prompts: log their KL to the reference, length and diversity, and
    print a table of policy and reference replies (TRL's default: off)"""
    save_steps: int = 0
    """write a resumable checkpoint every this many optimizer steps (0: only the final model)"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from"""
    output_dir: str = "outputs/dpo"
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


LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "kto_pair", "cpo", "simpo", "orpo",
)  # fmt: skip
# the losses of the policy's own log-probs, which need no reference model (TRL's experimental CPO and ORPO trainers)
REFERENCE_FREE = ("cpo", "simpo", "orpo")
# the losses built on the chosen-rejected score difference: the only ones an f-divergence generalises (TRL 1.16)
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def get_batch_token_logps(logits, labels, label_pad_token_id=-100, is_encoder_decoder=False):
    """log p(label) of each labelled token and the mask of labelled tokens: logits [B, T, V], labels [B, T] -> [B, T'].

    Decoder-only: logits at position t predict the token at t + 1, so labels are shifted left by one (T' = T - 1).
    Encoder-decoder: the decoder input is already shifted right (<start> + labels[:-1]), so logits at t predict labels
    at t (T' = T).
    """
    if not is_encoder_decoder:
        labels, logits = labels[:, 1:], logits[:, :-1]
    labels = labels.clone()
    loss_mask = labels != label_pad_token_id
    labels[~loss_mask] = 0  # any valid index; masked out below
    # log_softmax gathered at the labels, without materialising the [B, T, V] log-softmax
    logits = logits.float()
    per_token_logps = torch.gather(logits, 2, labels.unsqueeze(2)).squeeze(2) - torch.logsumexp(logits, -1)
    return per_token_logps * loss_mask, loss_mask


def get_batch_logps(logits, labels, average_log_prob=False, label_pad_token_id=-100, is_encoder_decoder=False) -> torch.Tensor:
    """Sum (or mean) of log p(label) over the labelled tokens: logits [B, T, V], labels [B, T] -> [B]."""
    per_token_logps, loss_mask = get_batch_token_logps(logits, labels, label_pad_token_id, is_encoder_decoder)
    if average_log_prob:  # TRL 0.8's IPO: log-probs averaged per token
        return masked_mean(per_token_logps, loss_mask, axis=-1)
    return per_token_logps.sum(-1)


def sequence_logps(per_token_logps, mask, ld_alpha: float | None = None) -> torch.Tensor:
    """A sequence's log-prob from its tokens' [2B, T] (the first B rows chosen, the last B rejected): the sum over its
    tokens, or with `ld_alpha` LD-DPO's (Liu et al. 2024, eq. 5): the tokens up to the shorter of its pair's two
    lengths count whole, the longer one's extra tokens count ld_alpha times."""
    if ld_alpha is None:
        return (per_token_logps * mask).sum(-1)
    position = mask.cumsum(-1)  # 1, 2, ... over each sequence's own tokens
    shared = torch.minimum(*mask.sum(-1).chunk(2)).repeat(2)[:, None]  # the pair's shorter length, on both rows
    weights = ((position > 0) & (position <= shared)).float() + ld_alpha * (position > shared).float()
    return (per_token_logps * mask * weights).sum(-1)


def log_sum_squared_probs(logits) -> torch.Tensor:
    """log sum_v p_v^2 of each position's next-token distribution: logits [..., V] -> [...] (no gradient)."""
    with torch.no_grad():
        return torch.logsumexp(2 * torch.log_softmax(logits.float(), -1), -1)


def wpo_weights(per_token_logps, log_sum_sq_probs, mask) -> torch.Tensor:
    """WPO's weight of each sequence [2B] (Zhou et al. 2024, eq. 2, as TRL 1.16's use_weighting):
    exp(mean over its tokens of log p(y_t) - log sum_v p_v^2), the probability of its tokens relative to the policy's
    own sampling distribution, detached; a pair's losses are multiplied by its chosen and rejected weights."""
    with torch.no_grad():
        aligned = ((per_token_logps - log_sum_sq_probs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return torch.exp(aligned)


def f_divergence_scores(logratios, f_divergence_type: str = "reverse_kl", alpha: float = 0.5):
    """The score f'(pi / pi_ref) that replaces the log-ratio under an f-divergence regulariser (f-DPO, Wang et al. 2023,
    Table 1; TRL 1.16): reverse KL log u (DPO), forward KL 1 - 1/u, Jensen-Shannon log(2u / (1 + u)), alpha-divergence
    (u^(alpha - 1) - 1) / (alpha - 1), with u = pi / pi_ref = exp(logratio)."""
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1) < 1e-6):
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":  # the exponent clamped so that exp stays finite (TRL)
        clamp = {torch.float16: 11.0, torch.bfloat16: 80.0}.get(logratios.dtype, 80.0)
        exponent = ((alpha - 1) * logratios).float().clamp(max=clamp)
        return (torch.exp(exponent) - 1).to(logratios.dtype) / (alpha - 1)
    raise ValueError(f"Unknown f_divergence_type {f_divergence_type!r}")


def dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps,
    reference_rejected_logps,
    beta,
    loss_type="sigmoid",
    label_smoothing=0.0,
    reference_free=False,
    chosen_lengths=None,
    rejected_lengths=None,
    f_divergence_type="reverse_kl",
    f_alpha_divergence_coef=0.5,
    discopop_tau=0.05,
    chosen_nll=None,
):
    """Per-pair losses and the detached implicit rewards beta * (log pi - log pi_ref) of chosen and rejected.

    With r_w, r_l the chosen and rejected log-ratios log pi - log pi_ref, s_w, s_l their f-divergence scores
    (`f_divergence_scores`; the log-ratios themselves by default), h = s_w - s_l and eps the label smoothing:
    - sigmoid: -log sigmoid(beta h) (DPO, Rafailov et al. 2023, eq. 7); with eps, TRL 0.8's conservative DPO
      -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (Mitchell 2023). TRL 1.16's sigmoid ignores eps.
    - hinge: relu(1 - beta h) (SLiC, Zhao et al. 2023, eq. 10 with delta = 1/beta).
    - ipo: (s_w / |y_w| - s_l / |y_l| - 1 / (2 beta))^2 (IPO, Azar et al. 2023, eq. 17, per token as TRL).
    - exo_pair: KL(softmax(beta s) || [1 - eps, eps]) over the pair (EXO, Ji et al. 2024, eq. 16); eps > 0.
    - nca_pair: -log sigmoid(beta r_w) - (log sigmoid(-beta r_w) + log sigmoid(-beta r_l)) / 2 (NCA, Chen et al. 2024).
    - robust: ((1 - eps) (-log sigmoid(beta h)) - eps (-log sigmoid(-beta h))) / (1 - 2 eps) (Chowdhury et al. 2024, eq. 4).
    - bco_pair: -log sigmoid(beta r_w) - log sigmoid(-beta r_l) (BCO, Jung et al. 2024, without its reward shift).
    - sppo_hard: (r_w - 1 / (2 beta))^2 + (r_l + 1 / (2 beta))^2 (SPPO, Wu et al. 2024, eq. 4.7 with hard P).
    - aot / aot_unpaired: the sigmoid loss with eps on the sorted policy-minus-reference log-ratio differences of the
      batch (AOT, Melnyk et al. 2024): paired, sort(log pi_w - log pi_l) - sort(log ref_w - log ref_l); unpaired,
      sort(r_w) - sort(r_l).
    - apo_zero: 1 - sigmoid(beta r_w) + sigmoid(beta r_l); apo_down: sigmoid(beta r_w) + 1 - sigmoid(beta (r_w - r_l))
      (APO, D'Oosterlinck et al. 2024, eqs. 7 and 8).
    - discopop: with z = beta h, m = sigmoid(z / tau): (1 - m) (-log sigmoid(z)) + m exp(-z) (DiscoPOP, Chris Lu et
      al. 2024, eq. 5).
    - sft: the chosen replies' negative log-likelihood per token, `chosen_nll` (the same for every pair).
    - sigmoid_norm: -log sigmoid(beta (s_w / |y_w| - s_l / |y_l|)).
    - kto_pair: TRL 0.8's: 1 - sigmoid(beta (r_w - KL_l)) and 1 - sigmoid(beta (KL_w - r_l)), each KL the clamped
      batch mean of the other half's log-ratio (KTO, Ethayarajh et al. 2023, eq. 7); 2B losses.
    `chosen_lengths` / `rejected_lengths`: the replies' token counts (ipo, sigmoid_norm). reference_free: the
    reference log-probs are taken as 0 (a uniform reference).
    """
    if reference_free:
        reference_chosen_logps = torch.zeros_like(policy_chosen_logps)
        reference_rejected_logps = torch.zeros_like(policy_rejected_logps)
    chosen_logratios = policy_chosen_logps - reference_chosen_logps
    rejected_logratios = policy_rejected_logps - reference_rejected_logps
    chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    h, eps = chosen_scores - rejected_scores, label_smoothing
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type in ("ipo", "sigmoid_norm"):  # the scores per token of their replies (lengths None: already are)
        n_w, n_l = (1, 1) if chosen_lengths is None else (chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1))
        h = chosen_scores / n_w - rejected_scores / n_l
        losses = (h - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * h)
    elif loss_type == "exo_pair":
        eps = torch.tensor(eps, device=h.device)
        q_w, q_l = torch.sigmoid(beta * h), torch.sigmoid(-beta * h)
        losses = q_w * (F.logsigmoid(beta * h) - torch.log1p(-eps)) + q_l * (F.logsigmoid(-beta * h) - torch.log(eps))
    elif loss_type == "nca_pair":
        w, l = beta * chosen_logratios, beta * rejected_logratios  # noqa: E741
        losses = -F.logsigmoid(w) - 0.5 * F.logsigmoid(-w) - 0.5 * F.logsigmoid(-l)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
    elif loss_type == "sppo_hard":
        losses = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    elif loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            policy = torch.sort(policy_chosen_logps - policy_rejected_logps, dim=0)[0]
            delta = policy - torch.sort(reference_chosen_logps - reference_rejected_logps, dim=0)[0]
        else:
            delta = torch.sort(chosen_logratios, dim=0)[0] - torch.sort(rejected_logratios, dim=0)[0]
        losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    elif loss_type == "apo_zero":
        losses = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
    elif loss_type == "discopop":
        z = beta * h
        mix = torch.sigmoid(z / discopop_tau)
        losses = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    elif loss_type == "sft":
        losses = chosen_nll.expand(len(policy_chosen_logps))
    elif loss_type == "kto_pair":
        chosen_kl = chosen_logratios.mean().clamp(min=0)
        rejected_kl = rejected_logratios.mean().clamp(min=0)
        losses = torch.cat(
            (
                1 - torch.sigmoid(beta * (chosen_logratios - rejected_kl)),
                1 - torch.sigmoid(beta * (chosen_kl - rejected_logratios)),
            ),
            0,
        )
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}.")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def tokenize_pair(
    tokenizer,
    prompt,
    chosen,
    rejected,
    max_length: int,
    max_prompt_length: int,
    truncation_mode: str = "keep_end",
    chat: bool = False,
    system_prompt: str | None = None,
) -> dict:
    """Token ids and labels of prompt + chosen and prompt + rejected (TRL 0.8 `tokenize_row`).

    Text: each answer is tokenised as part of prompt + answer, so BPE merges across the boundary survive; if the last
    prompt token merged with the answer, the boundary moves one token left; BOS is prepended and EOS appended only when
    the tokenizer has them. `chat`: the rendered prompt's tokens, then each rendered answer's, its end-of-turn token
    included (common/chat.py). A long pair loses prompt tokens first (keeping max_prompt_length), then answer tokens.
    Prompt positions are labelled -100.
    """
    out = {}
    answers = {}
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if chat:
            texts = render(tokenizer, prompt, answer, system_prompt)
            answers[name] = tuple(tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts)
            continue
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        full = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
        boundary = len(prompt_ids) if full[: len(prompt_ids)] == prompt_ids else len(prompt_ids) - 1
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        answers[name] = (bos + full[:boundary], full[boundary:] + eos)
    longest_answer = max(len(a) for _, a in answers.values())
    for name, (prompt_part, answer) in answers.items():
        if len(prompt_part) + longest_answer > max_length:
            keep_end = truncation_mode == "keep_end"
            prompt_part = prompt_part[-max_prompt_length:] if keep_end else prompt_part[:max_prompt_length]
        if len(prompt_part) + longest_answer > max_length:
            answer = answer[: max_length - max_prompt_length]
        out[f"{name}_input_ids"] = prompt_part + answer
        out[f"{name}_labels"] = [-100] * len(prompt_part) + answer
    return out


def tokenize_pair_seq2seq(
    tokenizer,
    prompt: str,
    chosen: str,
    rejected: str,
    max_prompt_length: int,
    max_target_length: int,
    truncation_mode: str = "keep_end",
) -> dict:
    """Encoder input ids and decoder labels for an encoder-decoder policy (TRL 0.8 `tokenize_row`, encoder-decoder).

    The prompt keeps the tokenizer's special tokens (T5: a closing </s>) and is cut to max_prompt_length from the end
    truncation_mode drops; each answer ends with EOS (appended where the tokenizer does not add it) and is cut to
    max_target_length, the EOS going first (a cut answer did not end).
    """
    prompt_ids = tokenizer(prompt)["input_ids"]
    if len(prompt_ids) > max_prompt_length:
        prompt_ids = prompt_ids[-max_prompt_length:] if truncation_mode == "keep_end" else prompt_ids[:max_prompt_length]
    out = {"prompt_input_ids": prompt_ids}
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        ids = tokenizer(answer)["input_ids"]
        if tokenizer.eos_token_id is not None and ids[-1:] != [tokenizer.eos_token_id]:
            ids = ids + [tokenizer.eos_token_id]
        out[f"{name}_labels"] = ids[:max_target_length]
    return out


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branching at -ln 2, as TRL's ORPO does)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def reference_free_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    chosen_lengths,
    rejected_lengths,
    beta,
    loss_type="cpo",
    label_smoothing=0.0,
    simpo_gamma=0.5,
    chosen_nll=None,
):
    """Per-pair losses and detached rewards of the losses that read the policy's own log-probs only.

    With eps the label smoothing:
    - cpo: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h), h = log pi(y_w) - log pi(y_l) (CPO, Xu et al.
      2024, eq. 3; TRL CPOTrainer's sigmoid loss). CPO's NLL term is `--loss-type cpo sft` (TRL's cpo_alpha 1).
    - simpo: the same on h = log pi(y_w) / |y_w| - log pi(y_l) / |y_l| - gamma / beta (SimPO, Meng et al. 2024, eq. 6;
      TRL CPOTrainer's simpo, whose log-probs are per token).
    - orpo: NLL(y_w) - beta log sigmoid(log odds(y_w) - log odds(y_l)), odds(y) = p / (1 - p) with log p the reply's
      per-token mean log-prob (ORPO, Hong et al. 2024, eqs. 4-7; TRL ORPOTrainer, beta its lambda).
    The rewards are beta times the log-probs each loss reads (per token for simpo and orpo), as TRL logs them."""
    chosen, rejected, eps = policy_chosen_logps, policy_rejected_logps, label_smoothing
    if loss_type in ("simpo", "orpo"):
        chosen, rejected = chosen / chosen_lengths.clamp(min=1), rejected / rejected_lengths.clamp(min=1)
    if loss_type in ("cpo", "simpo"):
        h = chosen - rejected - (simpo_gamma / beta if loss_type == "simpo" else 0.0)
        losses = -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps
    elif loss_type == "orpo":
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        losses = chosen_nll - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"Unknown reference-free loss_type {loss_type!r}: choose cpo, simpo or orpo.")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_args(
        args,
        positive=(
            "save_total_limit beta learning_rate batch_size gradient_accumulation_steps num_epochs max_length "
            "max_prompt_length max_target_length eval_steps max_grad_norm ref_model_sync_steps"
        ),
        non_negative="weight_decay save_steps",
        fractions="eval_fraction",
    )
    if not 0 <= args.label_smoothing < 0.5 or not 0 <= args.warmup_ratio < 1:
        raise UsageError(
            f"--label-smoothing {args.label_smoothing}, --warmup-ratio {args.warmup_ratio}: label smoothing "
            "(the chance a label is flipped) lies in [0, 0.5), the warmup ratio in [0, 1)."
        )
    types = args.loss_type
    smoothed = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired", "cpo", "simpo")
    if not types or len(set(types)) < len(types):
        raise UsageError(f"--loss-type {' '.join(types)}: name each loss once (one or more of {', '.join(LOSS_TYPES)}).")
    if args.loss_weights is not None and len(args.loss_weights) != len(types):
        raise UsageError(f"{len(args.loss_weights)} --loss-weights for {len(types)} --loss-type: give one weight each.")
    if args.label_smoothing and not set(types) & set(smoothed):
        raise UsageError(f"--label-smoothing applies to the {', '.join(smoothed)} losses, not {' '.join(types)}.")
    if "exo_pair" in types and args.label_smoothing == 0:
        raise UsageError("--loss-type exo_pair needs --label-smoothing above 0 (its target [1 - eps, eps]; EXO uses 1e-3).")
    if args.ld_alpha is not None and not 0 <= args.ld_alpha <= 1:
        raise UsageError(f"--ld-alpha {args.ld_alpha}: it lies in [0, 1] (1: no down-weighting, 0: extra tokens left out).")
    if args.f_divergence_type != "reverse_kl" and not set(types) <= set(F_DIVERGENCE_LOSSES):
        raise UsageError(
            f"--f-divergence-type {args.f_divergence_type} with --loss-type {' '.join(types)}: only "
            f"{', '.join(F_DIVERGENCE_LOSSES)} generalise to an f-divergence; use reverse_kl with the others."
        )
    if args.discopop_tau <= 0:
        raise UsageError(f"--discopop-tau {args.discopop_tau}: it must be positive.")
    if args.sync_ref_model and (args.use_peft or args.precompute_ref_log_probs or not uses_reference(args)):
        flags = ("--use-peft", "--precompute-ref-log-probs", "--reference-free")
        what = next((f for f in flags if getattr(args, f[2:].replace("-", "_"))), f"--loss-type {' '.join(types)}")
        raise UsageError(  # TRL refuses the first two too
            f"--sync-ref-model moves a reference copy during training, and {what} has none that can move: drop one."
        )
    if args.sync_ref_model and not 0 <= args.ref_model_mixup_alpha <= 1:
        raise UsageError(f"--ref-model-mixup-alpha {args.ref_model_mixup_alpha}: it lies in [0, 1].")
    if args.use_weighting and set(types) & {"aot", "aot_unpaired", "kto_pair"}:
        raise UsageError(
            f"--use-weighting with --loss-type {' '.join(types)}: aot and aot_unpaired sort the batch and kto_pair "
            "splits it, so a pair's weight has no loss of its own to scale (TRL refuses aot too)."
        )


def uses_reference(args: Args) -> bool:
    """Whether the run needs the reference model: not with --reference-free, nor with reference-free losses only
    (cpo, simpo, orpo, mixed with sft or not)."""
    own = set(args.loss_type) - {"sft"}
    return not args.reference_free and not (own and own <= set(REFERENCE_FREE))


@dataclass
class Pairs:
    """The tokenised preference pairs, the held-out rows (for the samples), the model's config, whether it is an
    encoder-decoder, whether the chat template renders the pairs, and the tokenizer."""

    train: list[dict]
    eval: list[dict]
    eval_rows: object
    model_config: object
    is_encoder_decoder: bool
    chat: bool
    tokenizer: object


def load_pairs(args: Args) -> Pairs:
    """The preference dataset, checked, split and tokenised (TRL 0.8's `tokenize_row`; chats rendered), and the
    tokenizer: the data and the model's config are checked first, so an empty model folder names the missing model."""
    dataset = load_data(args.dataset_name, args.dataset_split)
    columns = (args.prompt_column, args.chosen_column, args.rejected_column)
    check_columns(dataset, list(columns), "--prompt-column / --chosen-column / --rejected-column")
    model_config = load_config(args.model_name)
    is_encoder_decoder = getattr(model_config, "is_encoder_decoder", False)
    context = context_length(model_config)
    if context and not is_encoder_decoder and args.max_length > context:
        raise UsageError(f"max_length={args.max_length} exceeds the model's context of {context} tokens: lower --max-length.")
    if args.max_prompt_length >= args.max_length and not is_encoder_decoder:
        raise UsageError(
            f"max_prompt_length ({args.max_prompt_length}) must be below max_length ({args.max_length}), "
            "or no response token would be left."
        )
    tokenizer = load_tokenizer(args.model_name, padding_side="right")
    chat = use_chat(tokenizer, args.chat_template, [dataset[0][c] for c in columns], args.system_prompt)
    chat = chat and not is_encoder_decoder
    if all(c == r for c, r in zip(dataset[args.chosen_column], dataset[args.rejected_column])):
        raise UsageError("Every chosen response equals its rejected one: there is no preference to learn.")
    train_dataset, eval_dataset = train_eval_split(dataset, args.eval_fraction, args.seed)

    def tokenize(row: dict) -> dict:  # text: TRL 0.8 joins prompt and answer with a space; a chat renders both
        prompt, chosen, rejected = row[args.prompt_column], row[args.chosen_column], row[args.rejected_column]
        if is_encoder_decoder:
            return tokenize_pair_seq2seq(
                tokenizer, prompt, chosen, rejected, args.max_prompt_length, args.max_target_length, args.truncation_mode
            )
        prompt = prompt if chat else prompt + " "
        return tokenize_pair(
            tokenizer, prompt, chosen, rejected, args.max_length, args.max_prompt_length, args.truncation_mode, chat,
            args.system_prompt,
        )  # fmt: skip

    train, eval_ = [tokenize(row) for row in train_dataset], [tokenize(row) for row in eval_dataset]
    return Pairs(train, eval_, eval_dataset, model_config, is_encoder_decoder, chat, tokenizer)


class Batches:
    """Pairs as one right-padded [2B, T] batch, chosen then rejected (one forward for both; encoder-decoder: the prompt
    twice as encoder input, the answers as labels, the decoder input <start> + labels[:-1]); a rank's micro-batch of a
    step from a seeded reshuffle per epoch, so that a resume continues exactly."""

    def __init__(self, args: Args, accelerator: Accelerator, tokenizer, pairs: Pairs, steps_per_epoch: int):
        self.args, self.accelerator, self.tokenizer, self.pairs = args, accelerator, tokenizer, pairs
        self.steps_per_epoch = steps_per_epoch

    def collate(self, pairs: list[dict]) -> dict:
        seq2seq, pad = self.pairs.is_encoder_decoder, self.tokenizer.pad_token_id
        sources = ("prompt_input_ids",) * 2 if seq2seq else ("chosen_input_ids", "rejected_input_ids")
        sequences = [p[sources[0]] for p in pairs] + [p[sources[1]] for p in pairs]
        batch = dict(
            input_ids=pad_right(sequences, pad),
            attention_mask=pad_right([[1] * len(s) for s in sequences], 0),
            labels=pad_right([p["chosen_labels"] for p in pairs] + [p["rejected_labels"] for p in pairs], -100),
        )
        if seq2seq:
            shifted = batch["labels"][:, :-1].masked_fill(batch["labels"][:, :-1] == -100, pad)
            start = torch.full_like(shifted[:, :1], self.pairs.model_config.decoder_start_token_id)
            batch["decoder_input_ids"] = torch.cat([start, shifted], 1)
        if "reference_chosen_logps" in pairs[0]:
            batch["reference_logps"] = torch.tensor(
                [p["reference_chosen_logps"] for p in pairs] + [p["reference_rejected_logps"] for p in pairs]
            )
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def micro_batch(self, examples: list[dict], step: int) -> dict:
        args, accelerator = self.args, self.accelerator
        epoch, i = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(args.seed + epoch))
        start = (i * accelerator.num_processes + accelerator.process_index) * args.batch_size
        return self.collate([examples[j] for j in order[start : start + args.batch_size].tolist()])


def load_models(args: Args, accelerator: Accelerator, pairs: Pairs, quantization: dict):
    """The policy (LoRA with --use-peft) and its frozen reference (None for LoRA: the adapter disabled), on the device."""
    auto_class = AutoModelForSeq2SeqLM if pairs.is_encoder_decoder else AutoModelForCausalLM
    model = load_pretrained(args.model_name, auto_class, dtype=args.dtype, **quantization)
    if args.disable_dropout:
        disable_dropout(model)
    if args.gradient_checkpointing:  # activations recomputed in the backward (older transformers: gradient_checkpointing_*)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if quantization:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    if args.use_peft:
        check_lora_targets(model, args.lora_target_modules)
        task_type = "SEQ_2_SEQ_LM" if pairs.is_encoder_decoder else "CAUSAL_LM"
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type=task_type,
        )
        model = get_peft_model(model, lora)
    # None for peft (its adapter disabled), and where no loss reads a reference
    ref_model = create_reference_model(model) if uses_reference(args) else None
    if ref_model is not None:
        ref_model = place_frozen(accelerator, ref_model)
    return model.to(accelerator.device), ref_model


class Scorer:
    """The DPO loss of a batch and TRL's metrics, from the policy's and the reference's sequence log-probs."""

    def __init__(self, args: Args, accelerator: Accelerator, model, ref_model, pairs: Pairs):
        self.args, self.accelerator, self.model, self.ref_model = args, accelerator, model, ref_model
        self.is_encoder_decoder = pairs.is_encoder_decoder
        self.sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        self.chunked = args.chunked_logps and not self.is_encoder_decoder and chunkable_head(model, self.sharded) is not None

    def token_logps(self, policy, batch: dict, weighting: bool = False) -> tuple[torch.Tensor, ...]:
        """Log-probs [2B, T] of the labelled tokens, their mask [2B, T], the mean logits [2B] and, with `weighting`,
        log sum_v p_v^2 at each labelled token [2B, T] (else None)."""
        if self.chunked:
            head = self.accelerator.unwrap_model(policy).get_output_embeddings()
            with self.accelerator.autocast():  # the head runs outside the model's forward, which prepare wraps in autocast
                inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                per_token, mask, hidden = lm_token_logprobs(policy, head, inputs, batch["labels"])
            with torch.no_grad():  # the mean over the vocabulary of hidden @ W.T + b is hidden @ mean(W) + mean(b)
                mean_logits = (hidden.float() @ head.weight.float().mean(0)).mean(1)
                mean_logits += 0 if head.bias is None else head.bias.float().mean()
                squared = None
                if weighting:  # the head over the labelled positions, 1024 at a time, as the log-probs
                    rows = hidden[:, :-1][mask].float()
                    bias = None if head.bias is None else head.bias.float()
                    chunks = [F.linear(rows[i : i + 1024], head.weight.float(), bias) for i in range(0, len(rows), 1024)]
                    squared = torch.cat([log_sum_squared_probs(c) for c in chunks]) if chunks else rows[:, 0]
                    squared = torch.zeros(mask.shape, device=rows.device).masked_scatter(mask, squared)
            return per_token * mask, mask, mean_logits, squared
        decoder = {"decoder_input_ids": batch["decoder_input_ids"]} if self.is_encoder_decoder else {}
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **decoder).logits
        per_token, mask = get_batch_token_logps(logits, batch["labels"], is_encoder_decoder=self.is_encoder_decoder)
        squared = None
        if weighting:
            squared = log_sum_squared_probs(logits if self.is_encoder_decoder else logits[:, :-1]) * mask
        return per_token, mask.float(), logits.detach().float().mean((1, 2)), squared

    @torch.no_grad()
    def reference_logps(self, batch: dict) -> torch.Tensor:
        """Reference log-probs [2B]: precomputed, the frozen copy, or the policy with its adapter disabled."""
        if "reference_logps" in batch or not uses_reference(self.args):
            return batch.get("reference_logps", torch.zeros(len(batch["input_ids"]), device=self.accelerator.device))
        policy = self.accelerator.unwrap_model(self.model)
        with reference_context(policy, self.ref_model):
            per_token, mask, *_ = self.token_logps(self.ref_model if self.ref_model is not None else policy, batch)
            return sequence_logps(per_token, mask, self.args.ld_alpha)

    def pair_metrics(self, batch: dict, prefix: str) -> tuple[torch.Tensor, dict]:
        """The DPO loss of a batch (the --loss-weights sum of each --loss-type's mean, MPO) and TRL's metrics
        (rewards/, logps/, logits/)."""
        args = self.args
        per_token, mask, mean_logits, squared = self.token_logps(self.model, batch, args.use_weighting)
        policy_chosen, policy_rejected = sequence_logps(per_token, mask, args.ld_alpha).chunk(2)
        ref_chosen, ref_rejected = self.reference_logps(batch).chunk(2)
        chosen_lengths, rejected_lengths = mask.sum(-1).chunk(2)
        chosen_nll = -per_token.chunk(2)[0].sum() / chosen_lengths.sum().clamp(min=1)  # the sft loss, per chosen token
        pair_weights = 1.0
        if args.use_weighting:  # WPO: each pair's losses times its chosen and rejected replies' weights
            chosen_weights, rejected_weights = wpo_weights(per_token, squared, mask).chunk(2)
            pair_weights = chosen_weights * rejected_weights
        loss = 0.0
        for loss_type, weight in zip(args.loss_type, args.loss_weights or [1.0] * len(args.loss_type)):
            if loss_type in REFERENCE_FREE:
                losses, chosen_rewards, rejected_rewards = reference_free_loss(
                    policy_chosen, policy_rejected, chosen_lengths, rejected_lengths, args.beta, loss_type,
                    args.label_smoothing, args.simpo_gamma, chosen_nll,
                )  # fmt: skip
            else:
                losses, chosen_rewards, rejected_rewards = dpo_loss(
                    policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta, loss_type, args.label_smoothing,
                    args.reference_free, chosen_lengths, rejected_lengths, args.f_divergence_type,
                    args.f_alpha_divergence_coef, args.discopop_tau, chosen_nll,
                )  # fmt: skip
            loss = loss + weight * (losses * pair_weights).mean()
        metrics = {
            "loss": loss.detach(),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": policy_chosen.detach().mean(),
            "logps/rejected": policy_rejected.detach().mean(),
            "logits/chosen": mean_logits.chunk(2)[0].mean(),
            "logits/rejected": mean_logits.chunk(2)[1].mean(),
        }
        return loss, {f"{prefix}/{k}": v for k, v in metrics.items()}

    def precompute_reference(self, pairs: Pairs, batches: Batches) -> None:
        """--precompute-ref-log-probs: every pair's reference log-probs stored with it, then the frozen copy freed."""
        for examples in (pairs.train, pairs.eval):
            starts = range(0, len(examples), self.args.batch_size)
            for i in tqdm(starts, desc="reference log-probs", disable=not self.accelerator.is_local_main_process):
                chunk = examples[i : i + self.args.batch_size]
                chosen, rejected = self.reference_logps(batches.collate(chunk)).cpu().chunk(2)
                for example, c, r in zip(chunk, chosen.tolist(), rejected.tolist()):
                    example.update(reference_chosen_logps=c, reference_rejected_logps=r)
        self.ref_model = None  # the frozen copy is no longer needed
        gc.collect()


@torch.no_grad()
def evaluate(args: Args, scorer: Scorer, pairs: Pairs, batches: Batches, tokenizer, logger, step: int) -> dict[str, float]:
    """Metrics over the whole eval split, averaged over batches and ranks; with --generate-during-eval, samples of the
    policy and the reference on held-out prompts."""
    accelerator, model = scorer.accelerator, scorer.model
    model.eval()
    sums, count = {}, 0
    for chunk, weight in rank_batches(pairs.eval, args.batch_size, accelerator):  # as many on every rank
        _, metrics = scorer.pair_metrics(batches.collate(chunk), "eval")
        n = len(chunk) * weight
        sums = {k: sums.get(k, 0) + v * n for k, v in metrics.items()}
        count += n
    total = accelerator.reduce(torch.tensor(float(count), device=accelerator.device), "sum")
    results = {k: (accelerator.reduce(v, "sum") / total).item() for k, v in sums.items()}
    if args.generate_during_eval and (accelerator.is_main_process or scorer.sharded):  # sharded: every rank decodes
        raw = pairs.eval_rows[args.prompt_column][:32]
        chat, seq2seq = pairs.chat, pairs.is_encoder_decoder
        prompts = [render(tokenizer, p, system_prompt=args.system_prompt)[0] if chat else p + " " for p in raw]
        # prompts cut as in training (truncation_mode), leaving a causal model room for the 24 new tokens
        keep = args.max_prompt_length if seq2seq else max(1, min(args.max_prompt_length, args.max_length - 24))
        stats, replies = held_out_samples(
            accelerator, model, scorer.ref_model, tokenizer, prompts, not chat, keep, args.truncation_mode == "keep_end",
            scorer.sharded,
        )  # fmt: skip
        results |= {f"eval/samples/{k}": v for k, v in stats.items()}
        logger.samples("eval samples", {"prompt": [text_of(p) for p in raw[:4]], **replies}, step)
    logger.log(results, step)
    model.train()
    return results


def save(args: Args, accelerator: Accelerator, model, tokenizer, metrics: dict) -> None:
    """The policy in plain from_pretrained format (LoRA merged), with its tokenizer and model card, atomically."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if peft_model_of(unwrapped) is not None:
        unwrapped = unwrapped.merge_and_unload()
    weights = full_weights(accelerator, model)  # gathered on the main process when sharded (every rank calls it)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_directory(args.output_dir) as tmp:
            unwrapped.save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            write_model_card(tmp, args, "dpo", metrics)


def main(args: Args) -> None:
    """Setup, then the loop, then the final evaluation, save and summary."""
    check(args)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.sync_ref_model and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UsageError("--sync-ref-model runs in one process or under DDP, not with sharded weights (FSDP, DeepSpeed).")
    quantization = quantization_kwargs(args.model_name, args.load_in_8bit, args.load_in_4bit, args.use_peft)
    run_name, logger = start_run(args, accelerator)
    pairs = load_pairs(args)  # checked before any model is built or loaded
    tokenizer = pairs.tokenizer
    pairs_per_step = args.batch_size * accelerator.num_processes
    steps_per_epoch = len(pairs.train) // pairs_per_step
    # micro-batches run on across epoch boundaries, so accumulation need not divide an epoch
    epoch_steps = steps_per_epoch * args.num_epochs // args.gradient_accumulation_steps
    total_steps = args.max_steps if args.max_steps > 0 else epoch_steps
    if total_steps == 0 or steps_per_epoch == 0:  # fewer examples than one batch: no epoch to draw from
        raise UsageError(
            f"{len(pairs.train)} training pairs make no optimizer step of {pairs_per_step} x "
            f"{args.gradient_accumulation_steps} pairs: lower --batch-size or --gradient-accumulation-steps."
        )
    accelerator.print(
        f"{len(pairs.train)} training / {len(pairs.eval)} eval pairs; {total_steps} optimizer steps; each "
        f"epoch reshuffles and leaves out {len(pairs.train) % pairs_per_step} pairs"
    )
    batches = Batches(args, accelerator, tokenizer, pairs, steps_per_epoch)
    model, ref_model = load_models(args, accelerator, pairs, quantization)
    scorer = Scorer(args, accelerator, model, ref_model, pairs)
    if args.precompute_ref_log_probs and uses_reference(args):
        scorer.precompute_reference(pairs, batches)
    optimizer = adamw(args, model)
    ticks = accelerator.num_processes  # accelerate's prepared scheduler steps once per process per optimizer step
    warmup = int(args.warmup_ratio * total_steps) * ticks
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps * ticks
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
    first_eval, start_time = evaluate(args, scorer, pairs, batches, tokenizer, logger, start_step), time.time()
    first_eval = resumed.get("first_eval", first_eval)  # after a resume the summary compares with the run's start
    model.train()
    progress = tqdm(range(start_step, total_steps), disable=not accelerator.is_local_main_process, desc="dpo")
    for step in progress:
        step_start = time.time()
        # 1. the DPO loss of each micro-batch of pairs, accumulated into one optimizer step
        for micro in range(args.gradient_accumulation_steps):
            with accelerator.accumulate(model):
                batch = batches.micro_batch(pairs.train, step * args.gradient_accumulation_steps + micro)
                loss, metrics = scorer.pair_metrics(batch, "train")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        if args.sync_ref_model and (step + 1) % args.ref_model_sync_steps == 0:  # TR-DPO, after the optimizer step
            sync_reference(accelerator.unwrap_model(model), ref_model, args.ref_model_mixup_alpha)

        # 2. bookkeeping: one collective and one device sync for all the metrics
        norm = plain(grad_norm) if grad_norm is not None else 0.0
        metrics["train/grad_norm"] = torch.as_tensor(norm, device=accelerator.device).float()
        metrics = dict(zip(metrics, accelerator.reduce(torch.stack(list(metrics.values())).float(), "mean").tolist()))
        check_finite(step + 1, {k: metrics[k] for k in ("train/loss", "train/grad_norm")})
        step_time = time.time() - step_start
        logger.log(
            metrics
            | {
                "train/learning_rate": scheduler.get_last_lr()[0],
                "time/step": step_time,
                "throughput/pairs_per_s": pairs_per_step * args.gradient_accumulation_steps / step_time,
            },
            step + 1,
        )
        progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/rewards/accuracies']:.2f}")
        if (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            evaluate(args, scorer, pairs, batches, tokenizer, logger, step + 1)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"step_{step + 1}")
            state = {"step": step + 1, "first_eval": first_eval}
            save_checkpoint(accelerator, folder, state, total_limit=args.save_total_limit)

    # 3. the final evaluation, save (plain from_pretrained format; LoRA merged) and summary
    last_eval = evaluate(args, scorer, pairs, batches, tokenizer, logger, total_steps)
    save(args, accelerator, model, tokenizer, last_eval)
    elapsed = time.time() - start_time
    accelerator.print(
        f"dpo: {total_steps - start_step} steps in {elapsed:.0f}s ({(total_steps - start_step) / max(elapsed, 1e-9):.2f} "
        f"steps/s); eval reward accuracy {first_eval['eval/rewards/accuracies']:.3f} -> "
        f"{last_eval['eval/rewards/accuracies']:.3f}, margin {first_eval['eval/rewards/margins']:.3f} -> "
        f"{last_eval['eval/rewards/margins']:.3f}; model saved to {args.output_dir}"
    )
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
