"""GKD: on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes"), in TRL 1.x GKDTrainer semantics, and the on-policy distillation of the 2025 reports (per-token
reverse KL as the reward of a policy gradient).

The student generates completions to the task's prompts and the teacher grades every token of them: the loss is the
generalized Jensen-Shannon divergence between the two next-token distributions at each completion token (beta = 0:
forward KL(teacher || student), 1: reverse KL(student || teacher), in between the JSD through their mixture). With
probability `lmbda` a batch's completions are the student's own (on-policy); otherwise the dataset's (supervised KD),
or with --seq-kd the teacher's (sequence-level KD). No reward model, no verifier: the teacher is the signal.

Usage:
    python gkd.py                                   # offline: SmolLM2-135M-Instruct teaches its 10-layer version
    python gkd.py --lmbda 0.5 --beta 0.5            # mixed on-policy / off-policy batches
    python gkd.py --lmbda 0 --seq-kd                # sequence-level KD: the teacher's completions
    python gkd.py --objective reverse_kl_pg         # on-policy distillation: advantage = log teacher - log student
    accelerate launch gkd.py --teacher-name Qwen/Qwen2.5-1.5B-Instruct --model-name Qwen/Qwen2.5-0.5B-Instruct
"""

import math
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_scheduler

from common.chat import bind_template_kwargs, render, text_of
from common.checkpoints import load_checkpoint, save_checkpoint, save_policy
from common.cli import cli
from common.core import (
    UsageError,
    adamw,
    check_adam,
    check_args,
    epoch_rows,
    json_object,
    logprobs_from_logits,
    masked_mean,
    pooled,
    warn_once,
)
from common.loading import context_length, load_pretrained, load_tokenizer
from common.models import disable_dropout, place_frozen
from common.outputs import check_finite
from common.rewards import distinct_answers, is_number, load_task, verifier
from common.run import end_run, start_run
from common.sampling import Sampler, check_sampling_args, cut, sampler_gap


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

    # Student, teacher, task
    model_name: str = "builtin:smollm2-student"
    """the student: a hub id, a local folder, or builtin:smollm2-student (SmolLM2-135M-Instruct with 10 of its 30 layers)"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    teacher_name: str = "builtin:smollm2-135m-instruct"
    """the teacher, a causal LM with the student's tokenizer (vocabulary)"""
    teacher_model_init_kwargs: str | None = None
    """from_pretrained options of the teacher as JSON, e.g. '{"dtype": "bfloat16"}' (TRL's teacher_model_init_kwargs)"""
    dtype: str = "float32"
    """the student's dtype (float32 as TRL: weights that train need it); the teacher keeps its checkpoint's own unless
    --teacher-model-init-kwargs names one"""
    dataset_name: str = "reasoning-gym:chain_sum"
    """reasoning-gym:<task> (held-out problems distinct from training), or a dataset with a prompt and a completion column"""
    task_config: str = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    """reasoning-gym only: the task's options as JSON"""
    train_size: int = 2000
    """reasoning-gym only: problems generated for training (seed: --seed)"""
    eval_size: int = 64
    """reasoning-gym only: distinct held-out problems (drawn with seed + 1); no training row repeats their questions"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    prompt_column: str = "prompt"
    """the prompt column (text or chat messages)"""
    answer_column: str = "answer"
    """the dataset's completion for off-policy batches (reasoning-gym: the task's answer)"""
    eval_fraction: float = 0.05
    """hub / local data: fraction held out for evaluation"""
    chat_template: bool = True
    """render string prompts as one user message with the tokenizer's chat template, when it has one"""
    system_prompt: str | None = None
    """a system message put before every chat prompt that has none (None: the template's default, if any)"""
    chat_template_kwargs: str | None = None
    """options of the chat template as JSON, e.g. '{"enable_thinking": false}' for Qwen3 (TRL's chat_template_kwargs)"""
    task_instruction: str = "Give only the final answer."
    """appended to each reasoning-gym question when it is rendered as a chat"""
    max_prompt_length: int = 96
    """prompts longer than this many tokens keep their last ones"""

    # GKD (defaults: TRL 1.x GKDConfig, except lmbda, beta, the learning rate and the sizes)
    objective: Literal["gkd", "reverse_kl_pg"] = "gkd"
    """gkd: the generalized JSD (TRL's GKDTrainer); reverse_kl_pg: on-policy distillation, a policy gradient with the
    per-token advantage log p_teacher - log p_student (no value function)"""
    lmbda: float = 1.0
    """the fraction of batches whose completions the student samples (on-policy); TRL's default is 0.5"""
    beta: float = 0.0
    """the JSD's interpolation: 0 forward KL(teacher || student), 1 reverse KL(student || teacher); TRL's default is 0.5"""
    temperature: float = 1.0
    """sampling temperature of on-policy and teacher completions (TRL: 0.9)"""
    top_k: int = 0
    """top-k sampling of on-policy and teacher completions (0: off)"""
    top_p: float = 1.0
    """nucleus sampling of on-policy and teacher completions (1.0: off)"""
    min_p: float | None = None
    """drop tokens below min_p x the most likely token's probability (TRL's min_p; None: off)"""
    repetition_penalty: float = 1.0
    """divide the logits of tokens already in the prompt or completion by it (HF's; 1.0: off)"""
    generation_kwargs: str | None = None
    """more sampling options as JSON: HF GenerationConfig's, or vLLM SamplingParams' with --use-vllm (TRL's)"""
    loss_temperature: float = 1.0
    """the temperature both distributions are taken at in the loss (TRL's generalized_jsd_loss default)"""
    seq_kd: bool = False
    """off-policy batches use the teacher's sampled completions (sequence-level KD) instead of the dataset's"""
    max_new_tokens: int = 32
    """new tokens per sampled completion"""
    total_steps: int = 40
    """optimizer steps"""
    batch_size: int = 16
    """prompts per step on each process"""
    mini_batch_size: int = 8
    """sequences per forward/backward pass (gradients accumulate over the batch)"""
    teacher_chunk_size: int = 8
    """sequences per teacher forward pass: bounds the memory of the teacher's [batch, length, vocab] logits"""
    learning_rate: float = 1e-4
    """AdamW learning rate (TRL: 2e-5, for a student that starts close to its teacher)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_beta1: float = 0.9
    """AdamW's beta1 (TRL's default)"""
    adam_beta2: float = 0.999
    """AdamW's beta2 (TRL's default)"""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon (TRL's default)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    warmup_ratio: float = 0.0
    """fraction of the steps spent warming up (then constant)"""

    # vLLM rollouts (docs/vllm.md): the student's samples, as TRL 1.16's vllm_mode, "colocate" or "server"
    use_vllm: bool = False
    """sample the student through vLLM, an engine in each process or a server (--vllm-mode; pip install -r
    requirements-vllm.txt, or -cpu.txt), its weights synced after every step; the teacher samples with HF generate"""
    vllm_gpu_memory_utilization: float = 0.3
    """the share of GPU memory vLLM may take for weights and KV cache (TRL's default 0.3 in colocate mode)"""
    vllm_tensor_parallel_size: int = 1
    """training processes (GPUs) one vLLM engine spans, a shard on each; their prompts sampled together (TRL's
    vllm_tensor_parallel_size)"""
    vllm_enable_sleep_mode: bool = False
    """on CUDA, free vLLM's memory between rollouts (TRL's vllm_enable_sleep_mode)"""
    vllm_dtype: str = "auto"
    """vLLM's weights and compute: auto (the student's --dtype, so that the sampler's log-probs match the trainer's),
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

    gradient_checkpointing: bool = False
    """recompute the student's activations in the backward pass: less memory, more time (TRL's default is on)"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters on the student (merged at the end)"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""

    # Logging, evaluation, saving
    log_freq: int = 10
    """print a table of sample completions every this many steps"""
    eval_freq: int = 10
    """evaluate on the held-out problems every this many steps (and at the start and the end)"""
    eval_samples: int = 64
    """held-out prompts per evaluation"""
    save_freq: int = 0
    """write a resumable checkpoint every this many steps (0: only the final model)"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder to resume from"""
    output_dir: str = "outputs/gkd"
    """where the final student goes (plain from_pretrained format)"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""


def generalized_jsd_loss(student_logits, teacher_logits, mask, beta: float = 0.5, temperature: float = 1.0):
    """The generalized Jensen-Shannon divergence (Agarwal et al. 2024, eq. 1; TRL 1.x `GKDTrainer.generalized_jsd_loss`
    with `labels` -100 outside the mask and reduction "batchmean"), its mean over the tokens where `mask` is true.

    student_logits, teacher_logits [B, T, V] predict the tokens at the mask's positions [B, T]. With p_S, p_T the
    distributions at `temperature` and M = (1 - beta) p_S + beta p_T: beta * KL(p_T || M) + (1 - beta) * KL(p_S || M);
    at beta 0 it is KL(p_T || p_S) (forward KL), at beta 1 KL(p_S || p_T) (reverse KL), each summed over the vocabulary.
    """
    student = F.log_softmax(student_logits.float() / temperature, -1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, -1)
    if beta == 0:
        jsd = F.kl_div(student, teacher, reduction="none", log_target=True)  # KL(teacher || student)
    elif beta == 1:
        jsd = F.kl_div(teacher, student, reduction="none", log_target=True)  # KL(student || teacher)
    else:
        mixture = torch.logsumexp(torch.stack([student + math.log(1 - beta), teacher + math.log(beta)]), 0)
        kl_teacher = F.kl_div(mixture, teacher, reduction="none", log_target=True)  # KL(teacher || M)
        kl_student = F.kl_div(mixture, student, reduction="none", log_target=True)  # KL(student || M)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    return jsd.sum(-1)[mask.bool()].sum() / mask.sum().clamp(min=1)


def reverse_kl_pg_loss(student_logprobs, teacher_logprobs, mask):
    """On-policy distillation as reinforcement learning: the per-token reward is the negative reverse KL estimate
    log p_teacher(y_t) - log p_student(y_t) of the student's own sampled token, used as the advantage of a policy
    gradient without a value function: -mean over the mask of A_t * log p_student(y_t), A_t detached. Its gradient is
    that of the reverse KL(student || teacher) along the sampled tokens. Inputs [B, T]; returns (loss, mean of A_t)."""
    advantages = (teacher_logprobs - student_logprobs).detach()
    return -masked_mean(advantages * student_logprobs, mask), masked_mean(advantages, mask)


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_args(
        args,
        positive=(
            "save_total_limit total_steps batch_size mini_batch_size teacher_chunk_size learning_rate max_new_tokens "
            "temperature loss_temperature max_prompt_length eval_samples log_freq train_size eval_size max_grad_norm"
        ),
        non_negative="weight_decay eval_freq save_freq top_k",
        fractions="eval_fraction",
    )
    check_sampling_args(args)
    if not (0 <= args.lmbda <= 1 and 0 <= args.beta <= 1 and 0 <= args.warmup_ratio < 1):
        raise UsageError(f"--lmbda {args.lmbda}, --beta {args.beta}: both lie in [0, 1], --warmup-ratio in [0, 1).")
    if args.objective == "reverse_kl_pg" and args.lmbda < 1:
        raise UsageError("--objective reverse_kl_pg is a policy gradient on the student's own samples: it needs --lmbda 1.")
    teacher_options(args)
    json_object(args.chat_template_kwargs, "--chat-template-kwargs", '{"enable_thinking": false}')
    if args.seq_kd and args.lmbda == 1:
        warn_once("--seq-kd has no effect with --lmbda 1: every batch is the student's own (lower --lmbda to use it)")


def teacher_options(args: Args) -> dict:
    """--teacher-model-init-kwargs as from_pretrained's keywords (the checkpoint's own dtype unless it names one)."""
    options = json_object(args.teacher_model_init_kwargs, "--teacher-model-init-kwargs", '{"dtype": "bfloat16"}')
    return {"dtype": "auto"} | options


def load_models(args: Args, accelerator: Accelerator):
    """The student (LoRA with --use-peft) prepared with its AdamW optimizer and schedule, and the frozen teacher on the
    device, in eval mode, in its checkpoint's dtype."""
    student = load_pretrained(args.model_name, AutoModelForCausalLM, dtype=args.dtype)
    teacher = load_pretrained(args.teacher_name, AutoModelForCausalLM, **teacher_options(args)).eval().requires_grad_(False)
    context = min(c for c in (context_length(student.config), context_length(teacher.config), 10**9) if c)
    if args.max_prompt_length + args.max_new_tokens > context:
        raise UsageError(
            f"max_prompt_length ({args.max_prompt_length}) + max_new_tokens ({args.max_new_tokens}) exceeds the "
            f"models' context of {context} tokens."
        )
    disable_dropout(student)  # as TRL: the student's distribution is the one sampled
    if args.use_peft:
        student = get_peft_model(student, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, task_type="CAUSAL_LM"))
    if args.gradient_checkpointing:  # activations recomputed in the backward (non-reentrant: LoRA needs no input grads)
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = adamw(args, student)
    ticks = accelerator.num_processes  # accelerate's prepared scheduler steps once per process per optimizer step
    warmup = int(args.warmup_ratio * args.total_steps) * ticks
    scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)
    student, optimizer, scheduler = accelerator.prepare(student, optimizer, scheduler)
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    accelerator.print(
        f"student {args.model_name}: {trainable:,} trainable parameters; teacher {args.teacher_name}: "
        f"{sum(p.numel() for p in teacher.parameters()):,} parameters, frozen"
    )
    return student, place_frozen(accelerator, teacher), optimizer, scheduler  # sharded like the student under FSDP2


def tokenize_answer(tokenizer, row: dict, chat: bool) -> list[int]:
    """The dataset's completion of a row (its answer) as the tokens that continue its prompt, EOS included."""
    if chat:
        return tokenizer(render(tokenizer, row["prompt"], str(row["answer"]))[1], add_special_tokens=False)["input_ids"]
    return tokenizer(" " + str(row["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def pad_completions(tokenizer, ids: list[list[int]], device) -> torch.Tensor:
    width = max(map(len, ids))
    return torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids], device=device)


def token_logits(model, prompts, prompt_mask, completions, mask) -> torch.Tensor:
    """The logits [B, T, V] that predict each completion token (left padding: positions count real tokens only)."""
    input_ids = torch.cat([prompts, completions], 1)
    attention_mask = torch.cat([prompt_mask, mask.long()], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    T = completions.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1).logits
    return logits[:, :-1]


@torch.no_grad()
@torch.random.fork_rng()  # evaluation draws from its own RNG: how often it runs never changes training
def evaluate(args: Args, sampler: Sampler, model, rows, logger, step: int, prefix: str, chat: bool, teacher=None):
    """Held-out accuracy of `model`, the student (the sampler's policy) or the teacher (one sampled completion per
    problem, the task's verifier), its completion length, the share of its most frequent answer and, given the teacher,
    the per-token KL to it on these completions (the mean of log p_model - log p_teacher over their tokens), over every
    process's share of the problems."""
    tokenizer, accelerator = sampler.tokenizer, sampler.accelerator
    torch.manual_seed(args.seed + accelerator.process_index)
    share = rows[accelerator.process_index :: accelerator.num_processes] or rows[:1]
    weight = 1.0 if rows[accelerator.process_index :: accelerator.num_processes] else 0.0
    prompts, prompt_mask = sampler.pad_left([r["prompt_ids"] for r in share])
    model.eval()
    if model is sampler.policy:
        completions, mask, _, _ = sampler.generate(prompts, prompt_mask, args.max_new_tokens)
    else:
        completions, mask, _ = sampler.generate_with(model, prompts, prompt_mask, args.max_new_tokens)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    columns = {k: [r[k] for r in share] for k in share[0] if k not in ("prompt", "prompt_ids")}
    scores = verifier([r["prompt"] for r in share], texts, **columns)
    top = distinct_answers(gather_object(texts if weight else []), all(is_number(r["answer"]) for r in share))[0]
    kl = torch.tensor(0.0, device=accelerator.device)
    if teacher is not None:
        inputs = (prompts, prompt_mask, completions, mask)
        logps = [logprobs_from_logits(token_logits(m, *inputs), completions) for m in (model, teacher)]
        kl = ((logps[0] - logps[1]) * mask).sum()
    totals = torch.tensor([sum(scores), mask.sum().item(), len(share), kl.item()], device=accelerator.device)
    totals = accelerator.reduce(totals * weight, "sum")
    metrics = {
        f"{prefix}/accuracy": (totals[0] / totals[2]).item(),
        f"{prefix}/completion_length": (totals[1] / totals[2]).item(),
        f"{prefix}/top_answer_share": float(top),  # over every process's completions
    }
    if teacher is not None:
        metrics[f"{prefix}/kl_to_teacher"] = (totals[3] / totals[1]).item()  # per token
    logger.log(metrics, step)
    logger.samples(f"{prefix} samples", {"prompt": [text_of(r["prompt"]) for r in share], "completion": texts}, step)
    return metrics


def main(args: Args) -> None:
    """Setup, then the loop in its numbered phases, then the final evaluation, save and summary."""
    check(args)
    accelerator = Accelerator()
    device, world = accelerator.device, accelerator.num_processes
    run_name, logger = start_run(args, accelerator)
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    bind_template_kwargs(tokenizer, json_object(args.chat_template_kwargs, "--chat-template-kwargs", "") or None)
    if len(tokenizer) != len(load_tokenizer(args.teacher_name)):
        raise UsageError(
            f"the student {args.model_name} and the teacher {args.teacher_name} have different vocabularies "
            f"({len(tokenizer)} and {len(load_tokenizer(args.teacher_name))} tokens): GKD compares their next-token "
            "distributions token by token, so both need the same tokenizer"
        )
    train_rows, eval_rows, chat = load_task(args, tokenizer, args.prompt_column, args.max_prompt_length)
    eval_rows = eval_rows[: args.eval_samples]
    student, teacher, optimizer, scheduler = load_models(args, accelerator)
    unwrapped = accelerator.unwrap_model(student, keep_torch_compile=False)
    answer_ids = {r["answer"]: tokenize_answer(tokenizer, r, chat) for r in train_rows}
    accelerator.print(
        f"{len(train_rows)} training prompts, {len(eval_rows)} held out (none of them among the training prompts); "
        f"{args.total_steps} steps of {args.batch_size * world} prompts, {args.lmbda:.0%} of them on-policy"
    )
    start_step, resumed = 0, {}
    if args.resume_from:
        resumed = load_checkpoint(accelerator, args.resume_from)
        start_step = resumed["step"]
        accelerator.print(f"resumed from {args.resume_from} at step {start_step}")
    sampler = Sampler(args, tokenizer, unwrapped, accelerator, args.max_prompt_length + args.max_new_tokens)
    accelerator.print(f"student samples: {sampler.name}; teacher samples: HF generate")
    teacher_eval = evaluate(args, sampler, teacher, eval_rows, logger, 0, "teacher", chat)
    first_eval = resumed.get("first_eval") or evaluate(args, sampler, unwrapped, eval_rows, logger, 0, "eval", chat, teacher)
    history, start_time = resumed.get("history", []), time.time()
    progress = tqdm(range(start_step, args.total_steps), disable=not accelerator.is_local_main_process, desc="gkd")
    for step in progress:
        step_start = time.time()
        # ================================ the algorithm ================================
        # 1. completions: the student's own (with probability lmbda: on-policy), else the teacher's (--seq-kd) or the
        #    dataset's; the same choice on every process, drawn from the seed and the step (a resume draws the same)
        rows = epoch_rows(train_rows, args.batch_size, step, args.seed, accelerator)  # seeded reshuffle per epoch
        prompts, prompt_mask = sampler.pad_left([r["prompt_ids"] for r in rows])
        on_policy = random.Random(args.seed * 1_000_003 + step).random() < args.lmbda
        source = "student" if on_policy else "teacher" if args.seq_kd else "dataset"
        sampled = None  # the sampler's log-probs of the student's tokens where it keeps them (vLLM), for the gap
        if source == "dataset":  # [B, T] mask: up to and including the first EOS
            completions = pad_completions(tokenizer, [answer_ids[r["answer"]] for r in rows], device)
            completions, mask, _ = cut(completions, tokenizer.eos_token_id, tokenizer.pad_token_id)
        elif source == "teacher":
            completions, mask, _ = sampler.generate_with(teacher.eval(), prompts, prompt_mask, args.max_new_tokens)
        else:
            unwrapped.eval()
            completions, mask, _, sampled = sampler.generate(prompts, prompt_mask, args.max_new_tokens)

        # 2. optimise: the student's divergence from the teacher at each completion token, the teacher's logits computed
        #    without gradients in chunks of rows, accumulated over mini-batches
        student.train()
        stats, gaps = [], []
        for j in range(0, len(rows), args.mini_batch_size):
            mb = slice(j, j + args.mini_batch_size)
            inputs = (prompts[mb], prompt_mask[mb], completions[mb], mask[mb])
            with torch.no_grad():
                chunks = torch.arange(len(inputs[0]), device=device).split(args.teacher_chunk_size)
                teacher_logits = torch.cat([token_logits(teacher, *(x[c] for x in inputs)) for c in chunks])
            logits = token_logits(student, *inputs)
            teacher_logprobs = logprobs_from_logits(teacher_logits, completions[mb])
            with torch.set_grad_enabled(args.objective != "gkd"):  # the JSD needs no gradient through these
                student_logprobs = logprobs_from_logits(logits, completions[mb])
            if args.objective == "gkd":
                loss = generalized_jsd_loss(logits, teacher_logits, mask[mb], args.beta, args.loss_temperature)
            else:
                loss, _ = reverse_kl_pg_loss(student_logprobs, teacher_logprobs, mask[mb])
            weight = mask[mb].sum() / mask.sum().clamp(min=1)  # the mini-batches' token means weighted into the batch's
            accelerator.backward(loss * weight)
            # KL(student || teacher) at each trained position, summed over the vocabulary (the JSD at beta 1, temperature
            # 1): exact whoever wrote the tokens (log p_student - log p_teacher of the token estimates it only on the
            # student's own samples, and goes negative on the teacher's or the dataset's)
            with torch.no_grad():
                kl = generalized_jsd_loss(logits, teacher_logits, mask[mb], beta=1.0) * mask[mb].sum()
            stats.append(torch.stack([loss.detach() * mask[mb].sum(), kl, mask[mb].sum()]))
            if sampled is not None:  # how far vLLM's log-probs lie from the trainer's, at the sampling temperature
                trainer = logprobs_from_logits(logits.detach() / args.temperature, completions[mb])
                gaps.append(sampler_gap(trainer, sampled[mb], mask[mb]))
        grad_norm = accelerator.clip_grad_norm_(student.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        sampler.sync(unwrapped)  # vLLM's copy of the student (a no-op otherwise): the next samples are on-policy

        # ================================ bookkeeping ================================
        totals = accelerator.reduce(torch.stack(stats).sum(0), "sum")
        metrics = {
            "train/loss": (totals[0] / totals[2]).item(),
            "train/kl_to_teacher": (totals[1] / totals[2]).item(),  # per token
            "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "train/on_policy": float(source == "student"),
            "train/completion_length": accelerator.reduce(mask.sum(1).mean(), "mean").item(),
            "charts/learning_rate": scheduler.get_last_lr()[0],
            "time/step": time.time() - step_start,
        } | (pooled(accelerator, gaps) if gaps else {})  # the same source on every process: all pool, or none
        norm = {"train/grad_norm": metrics["train/grad_norm"]} if grad_norm is not None else {}  # DeepSpeed may not say
        check_finite(step + 1, {"train/loss": metrics["train/loss"]} | norm)
        logger.log(metrics, step + 1)
        history.append((metrics["train/loss"], metrics["train/kl_to_teacher"]))
        progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", kl=f"{metrics['train/kl_to_teacher']:.3f}")
        if (step + 1) % args.log_freq == 0:
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            logger.samples("samples", {"prompt": [text_of(r["prompt"]) for r in rows], source: texts}, step + 1)
        if args.eval_freq and (step + 1) % args.eval_freq == 0 and step + 1 < args.total_steps:
            evaluate(args, sampler, unwrapped, eval_rows, logger, step + 1, "eval", chat, teacher)
        if args.save_freq and (step + 1) % args.save_freq == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"step_{step + 1}")
            state = {"step": step + 1, "first_eval": first_eval, "history": history}
            save_checkpoint(accelerator, folder, state, total_limit=args.save_total_limit)

    # ---- final evaluation, save and summary ----
    last_eval = evaluate(args, sampler, unwrapped, eval_rows, logger, args.total_steps, "eval", chat, teacher)
    save_policy(args, accelerator, unwrapped, tokenizer, last_eval, "gkd")  # plain from_pretrained format; LoRA merged
    window = max(1, len(history) // 10)
    first, last = np.mean(history[:window], 0), np.mean(history[-window:], 0)
    accelerator.print(
        f"gkd: {args.total_steps - start_step} steps in {time.time() - start_time:.0f}s; loss {first[0]:.3f} -> "
        f"{last[0]:.3f}, KL to the teacher per token {first[1]:.3f} -> {last[1]:.3f}; held-out accuracy: student "
        f"{first_eval['eval/accuracy']:.3f} -> {last_eval['eval/accuracy']:.3f}, teacher "
        f"{teacher_eval['teacher/accuracy']:.3f}; held-out KL to the teacher per token {first_eval['eval/kl_to_teacher']:.3f} "
        f"-> {last_eval['eval/kl_to_teacher']:.3f}; model saved to {args.output_dir}"
    )
    sampler.close()  # vLLM shut down while the process group exists
    end_run(accelerator, logger)


if __name__ == "__main__":
    main(cli(Args))
