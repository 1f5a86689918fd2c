"""The rollout engine of the online scripts (grpo.py, rloo.py): the task and its rewards, the policy and its reference,
sampling completions (common/sampling.py: HF `generate`, `FastGenerator` or vLLM) or whole multi-turn episodes with
tools, log-probs over completions, held-out evaluation, resuming and the final save. Written once here; each script
keeps its algorithm (losses, advantages) and its loop.

An episode (`run_episodes`): the model generates until its turn ends (EOS); each tool call in the turn (in the chat
template's format, common/tools.py) is run and its result appended as a tool message rendered by the template;
generation continues. It ends at a turn without a call, after `max_iterations` rounds of calls, or when the completion
(the model's tokens and the tools' together, as TRL counts) would pass `max_completion_length`. All episodes of a batch
advance together, turn by turn. The model's own tokens are marked 1 in `model_mask`, the tools' 0: the loss, the
importance ratio, the KL and the lengths read the model's tokens only, while the tool tokens stay in the context.
"""

import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import gather_object
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, get_scheduler

from common.chat import FORMATS, bind_template_kwargs, text_of
from common.checkpoints import load_checkpoint, save_checkpoint
from common.core import (
    UsageError,
    adamw,
    check_args,
    epoch_rows,
    error_line,
    exact_div,
    json_object,
    nanstd,
    sizes,
    warn_once,
)
from common.loading import context_length, load_pretrained, load_tokenizer
from common.models import cast_lm_head, create_reference_model, disable_dropout, place_frozen, reference_context
from common.outputs import check_finite
from common.rewards import (
    RewardModel,
    degenerate_batch,
    distinct_answers,
    is_number,
    load_rewards,
    load_task,
    prompt_ids,
    score_completions,
)
from common.run import rank_batches
from common.sampling import Sampler, check_sampling_args, decode, per_token_logprobs
from common.tools import Toolset, run_calls, tool_suffix_ids

# ================================ the flags every online script shares ================================
SHARED_POSITIVE = (
    "save_total_limit total_prompts batch_size mini_batch_size gradient_accumulation_steps num_iterations learning_rate "
    "max_grad_norm epsilon epsilon_high max_completion_length temperature max_prompt_length eval_samples log_freq "
    "num_generations_eval ref_model_sync_steps "
    "train_size eval_size tool_timeout"
)


def check_online_args(args, positive: str = "", non_negative: str = "") -> None:
    """A one-line error for each shared flag out of its range (and the script's own `positive` / `non_negative`
    fields), before anything is loaded; a warning for tool flags without tools."""
    check_args(
        args,
        positive=f"{SHARED_POSITIVE} {positive}",
        non_negative=f"beta weight_decay top_k eval_freq save_freq max_tool_calling_iterations warmup_steps {non_negative}",
        fractions="eval_fraction",
    )
    if args.num_generations < 2:
        raise UsageError(f"--num-generations {args.num_generations}: a group needs at least 2 completions to compare.")
    check_sampling_args(args)
    if (args.tools or args.environment) and args.max_tool_calling_iterations == 0:
        raise UsageError(
            "--max-tool-calling-iterations 0 with --tools / --environment: no tool call would ever run; allow at least 1 "
            "round, or drop the tools."
        )
    if not (args.tools or args.environment) and (args.chat_template_path or args.max_tool_calling_iterations is not None):
        warn_once("--chat-template-path and --max-tool-calling-iterations take effect with --tools or --environment")
    check_off_policy_args(args)
    if getattr(args, "dynamic_sampling", False):
        tools = "--tools / --environment" if args.tools or args.environment else ""
        refused = "--max-staleness" if args.max_staleness else tools
        if refused:
            raise UsageError(f"--dynamic-sampling with {refused}: it samples again on-policy, without tools; drop one.")
        if args.max_num_gen_batches < 1:
            raise UsageError(f"--max-num-gen-batches {args.max_num_gen_batches}: at least 1 round of generation.")
    json_object(args.chat_template_kwargs, "--chat-template-kwargs", '{"enable_thinking": false}')
    try:  # the schedule, on a stand-in parameter: a name or option that transformers cannot take is one line
        learning_rate_schedule(args, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 10, 1)
    except (ValueError, TypeError, KeyError, json.JSONDecodeError) as error:
        raise UsageError(
            f"--lr-scheduler-type {args.lr_scheduler_type} (--lr-scheduler-kwargs {args.lr_scheduler_kwargs}): "
            f"{error_line(error)}; pass a transformers scheduler and the options it takes."
        ) from None
    if args.sync_ref_model and (args.beta == 0 or args.use_peft):  # TRL refuses both too
        what = "--beta 0 leaves no reference" if args.beta == 0 else "--use-peft has no reference copy"
        raise UsageError(f"--sync-ref-model moves a reference copy during training, and {what} to move: drop one.")
    if args.sync_ref_model and not 0 <= args.ref_model_mixup_alpha <= 1:
        raise UsageError(f"--ref-model-mixup-alpha {args.ref_model_mixup_alpha}: it lies in [0, 1].")
    sources = len(args.reward_funcs) + (args.reward_model is not None)
    if args.reward_weights and len(args.reward_weights) != sources:
        raise UsageError(
            f"{len(args.reward_weights)} --reward-weights for {sources} rewards (--reward-funcs, then --reward-model): "
            "give one weight each."
        )


def check_off_policy_args(args) -> None:
    """The flags of stale rollouts and their corrections: ranges, and the combinations that cannot work."""
    check_args(args, positive="weight_sync_steps rollout_timeout", non_negative="max_staleness")
    off_policy = args.max_staleness > 0
    bounds = (args.importance_sampling_clip_min, args.importance_sampling_clip_max)
    if (
        all(b is None for b in bounds)
        or (None not in bounds and bounds[0] >= bounds[1])
        or any(b is not None and b < 0 for b in bounds)
    ):
        raise UsageError(
            f"--importance-sampling-clip-min {bounds[0]} --importance-sampling-clip-max {bounds[1]}: give at least one "
            "bound, each >= 0, the lower below the upper."
        )
    if args.async_rollouts and not off_policy:
        warn_once("--async-rollouts takes effect with --max-staleness > 0 (at 0 every rollout is the current policy's)")
    if off_policy and (args.tools or args.environment):
        raise UsageError(
            "--max-staleness with --tools / --environment: stale multi-turn episodes are not supported yet; train "
            "on-policy (--max-staleness 0)."
        )
    if off_policy and args.resume_from and not args.async_rollouts:
        raise UsageError(
            "--resume-from with --max-staleness > 0: the rollouts sampled ahead are not in the checkpoint, so the run "
            "could not continue as it would have; resume on-policy, or start the stale run afresh."
        )
    if off_policy and args.old_logprobs == "recompute" and not args.importance_sampling_correction:
        warn_once(
            f"--max-staleness {args.max_staleness} with --no-importance-sampling-correction: nothing corrects for the "
            "stale samples (the ratio is taken against the current policy); use --importance-sampling-correction or "
            "--old-logprobs sampler"
        )


# ================================ the task, the policy, resuming ================================
@dataclass
class Task:
    """What an online run trains on: the tokenizer (left padding), the training and held-out rows (each with its
    `prompt_ids`), whether prompts are chats, the reward functions (name, function) with their weights [F], and the
    tools (None without --tools / --environment)."""

    tokenizer: object
    train_rows: list[dict]
    eval_rows: list[dict]
    chat: bool
    reward_funcs: list[tuple[str, object]]
    weights: torch.Tensor
    toolset: Toolset | None


def load_online_task(args, accelerator: Accelerator, num_updates: int) -> Task:
    """The task of --dataset-name with its rewards and tools, every mistake a one-line error before any model loads; a
    line saying what the run of `num_updates` updates will train on."""
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    bind_template_kwargs(tokenizer, json_object(args.chat_template_kwargs, "--chat-template-kwargs", "") or None)
    toolset = Toolset(args, tokenizer) if args.tools or args.environment else None
    schemas = toolset.schemas if toolset else None
    train_rows, eval_rows, chat = load_task(args, tokenizer, args.prompt_column, args.max_prompt_length, schemas)
    if toolset and not chat:
        raise UsageError("--tools / --environment need chat prompts: drop --no-chat-template.")
    if toolset and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UsageError(  # a sharded forward is a collective: every rank would have to take as many turns
            "--tools / --environment under FSDP / DeepSpeed: episodes take different numbers of turns on each rank; "
            "use DDP (configs/multi_gpu.yaml)."
        )
    world = accelerator.num_processes
    if len(train_rows) < args.batch_size * world:
        raise UsageError(f"{len(train_rows)} training prompts are fewer than one batch of {args.batch_size * world}.")
    device = accelerator.device
    reward_funcs = load_rewards(args.reward_funcs, train_rows, device, chat, args.reward_model, args.reward_label, args.dtype)
    for _, function in reward_funcs:  # "prompt completion<eos>" must fit a reward model's context
        if isinstance(function, RewardModel):
            fix = "lower --max-prompt-length or --max-completion-length"
            function.check_context(train_rows + eval_rows, tokenizer, args.max_completion_length, fix)
    weights = args.reward_weights or [1.0] * len(reward_funcs)  # one each: checked with the flags
    if toolset and toolset.reward_function():  # the environment's get_reward(), weight 1 (TRL)
        reward_funcs, weights = reward_funcs + [toolset.reward_function()], weights + [1.0]
    if not reward_funcs:
        raise UsageError("no reward: give --reward-funcs, --reward-model, or an --environment with get_reward().")
    eval_rows = eval_rows[: args.eval_samples]
    accelerator.print(
        f"{len(train_rows)} training prompts, {len(eval_rows)} held out (none of them among the training prompts)"
        f"{', rendered by the chat template' if chat else ''}; {num_updates} updates of {args.batch_size * world} "
        f"prompts x {args.num_generations} completions"
    )
    return Task(tokenizer, train_rows, eval_rows, chat, reward_funcs, torch.tensor(weights, device=device), toolset)


def update_sizes(args, accelerator: Accelerator) -> tuple[int, int, int]:
    """The batch arithmetic of an online run, checked against the process count (one line on a mismatch): its updates,
    the completions of one optimizer step on each process, and its optimizer steps (for the learning-rate schedule)."""
    per_process = args.batch_size * args.num_generations  # completions per generation batch on each process
    step_size = args.mini_batch_size * args.gradient_accumulation_steps  # completions per optimizer step
    exact_div(
        per_process,
        step_size,
        sizes(args, "batch_size", "num_generations"),
        sizes(args, "mini_batch_size", "gradient_accumulation_steps"),
    )
    world = accelerator.num_processes
    num_updates = exact_div(
        args.total_prompts, args.batch_size * world, sizes(args, "total_prompts"), sizes(args, "batch_size", processes=world)
    )
    return num_updates, step_size, num_updates * args.num_iterations * per_process // step_size


def batch_rows(args, task: Task, accelerator: Accelerator, update: int) -> list[dict]:
    """This rank's prompts of an update, each repeated num_generations times side by side (group order): a seeded
    shuffle of the training rows per epoch, the same on every rank, each rank taking its own slice."""
    rows = epoch_rows(task.train_rows, args.batch_size, update, args.seed, accelerator)
    return [row for row in rows for _ in range(args.num_generations)]


def load_policy(args, accelerator: Accelerator, optimizer_steps: int):
    """The policy (LoRA with --use-peft) prepared with its AdamW optimizer and a learning-rate schedule over
    `optimizer_steps` steps, and the frozen reference (None at beta 0, or with LoRA: the adapter-disabled policy)."""
    model = load_pretrained(args.model_name, AutoModelForCausalLM, dtype=args.dtype)
    context = context_length(model.config)
    if context and args.max_prompt_length + args.max_completion_length > context:
        raise UsageError(
            f"max_prompt_length ({args.max_prompt_length}) + max_completion_length "
            f"({args.max_completion_length}) exceeds the model's context of {context} tokens."
        )
    if getattr(args, "cast_lm_head_to_fp32", False):  # before LoRA and the reference: both inherit the head
        cast_lm_head(model)
    disable_dropout(model)  # log-probs of sampling and training must agree (TRL disables dropout too)
    if args.use_peft:
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, task_type="CAUSAL_LM"))
    ref_model = create_reference_model(model) if args.beta > 0 else None
    if ref_model is not None:
        ref_model = place_frozen(accelerator, ref_model)
    if args.gradient_checkpointing:  # activations recomputed in the backward (non-reentrant: LoRA needs no input grads)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = adamw(args, model)
    scheduler = learning_rate_schedule(args, optimizer, optimizer_steps, accelerator.num_processes)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if getattr(args, "sync_ref_model", False):  # TR-DPO's moving reference: checkpointed, so a resume continues exactly
        if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise UsageError("--sync-ref-model runs in one process or under DDP, not with sharded weights (FSDP, DeepSpeed).")
        accelerator.register_for_checkpointing(ref_model)
    reference = "none (beta 0)" if args.beta == 0 else "frozen copy" if ref_model is not None else "adapter disabled"
    if getattr(args, "sync_ref_model", False):
        reference += f", moving (TR-DPO: alpha {args.ref_model_mixup_alpha:g} every {args.ref_model_sync_steps} steps)"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(f"policy {args.model_name}: {trainable:,} trainable parameters; reference: {reference}")
    return model, ref_model, optimizer, scheduler


def learning_rate_schedule(args, optimizer, optimizer_steps: int, processes: int):
    """--lr-scheduler-type over the run's optimizer steps, after --warmup-steps of linear warm-up (a count, or below 1
    a fraction of them, rounded up as transformers does), with --lr-scheduler-kwargs. accelerate steps a prepared
    scheduler once per process and optimizer step: both lengths are counted in those ticks."""
    w = args.warmup_steps
    warmup = (int(w) if w >= 1 else math.ceil(w * optimizer_steps)) * processes
    options = json.loads(args.lr_scheduler_kwargs) if args.lr_scheduler_kwargs else None
    return get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=optimizer_steps * processes,
        scheduler_specific_kwargs=options,
    )


def resume(args, accelerator: Accelerator, num_updates: int, total: str = "--total-prompts") -> dict:
    """The loop's state saved with --resume-from's checkpoint, whose weights and optimizer it restores ({} without);
    `total`: the flag that sets the run's length."""
    if not args.resume_from:
        return {}
    resumed = load_checkpoint(accelerator, args.resume_from)
    if resumed["update"] >= num_updates:
        raise UsageError(
            f"--resume-from {args.resume_from}: the checkpoint is at update {resumed['update']}, and this run "
            f"has {num_updates}: raise {total} to train further."
        )
    accelerator.print(f"resumed from {args.resume_from} at update {resumed['update']}")
    return resumed


class Ledger:
    """What the loop carries from update to update, and into its checkpoints: the run's first evaluation (the summary
    compares with it, also after a resume), the (reward, KL) history, the count of updates with nothing to learn from,
    and when this process started training."""

    def __init__(self, resumed: dict, first_eval: dict):
        self.first_eval = resumed.get("first_eval", first_eval)
        self.history, self.degenerate, self.start = resumed.get("history", []), resumed.get("degenerate", 0), time.time()
        self.extra = resumed.get("extra", {})  # a script's own state (a controller): checkpointed as it is

    def record(self, accelerator: Accelerator, logger, update: int, metrics: dict, reasons: list[str]) -> None:
        """An update's end: a warning line for each reason it had nothing to learn from (and the counter in the logs),
        the check that its gradient norm is finite, its metrics logged, its reward and KL kept."""
        for reason in reasons:
            accelerator.print(f"warning: update {update + 1} has nothing to learn from: {reason}")
        self.degenerate += len(reasons)
        metrics["degenerate_updates"] = self.degenerate
        check_finite(update + 1, {"grad_norm": metrics["grad_norm"]})
        logger.log(metrics, update + 1)
        self.history.append((metrics["reward"], metrics.get("kl", math.nan)))

    def checkpoint(self, args, accelerator: Accelerator, update: int, policy, tokenizer) -> None:
        """Every --save-freq updates: a resumable checkpoint of the policy and this ledger (--save-total-limit kept)."""
        if args.save_freq and (update + 1) % args.save_freq == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"update_{update + 1}")
            state = {"update": update + 1, "first_eval": self.first_eval, "history": self.history}
            state |= {"degenerate": self.degenerate, "extra": self.extra}
            save_checkpoint(accelerator, folder, state, policy, tokenizer, total_limit=args.save_total_limit)


# ================================ episodes ================================
@dataclass
class Episodes:
    """A batch of finished episodes. prompt_ids: each episode's prompt; completion_ids: every token after the prompt,
    the model's and the tools'; model_mask: 1 for the model's own tokens; messages: the completion as chat messages
    (assistant turns with their tool_calls, tool messages), as reward functions receive it; ended: the last turn ended
    with EOS; environments: each episode's environment (None without --environment)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    model_mask: list[list[int]]
    messages: list[list[dict]]
    ended: list[bool]
    tool_calls: list[int] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    environments: list = field(default_factory=list)
    logprobs: list[list[float]] | None = None  # the sampler's log-prob of each completion token (0 on the tools')


def run_episodes(
    generate, tokenizer, prompt_ids, toolboxes, max_completion_length: int, max_iterations, timeout: float, form=FORMATS[0]
) -> Episodes:
    """Every episode of a batch, advanced together turn by turn. `generate(contexts, max_new_tokens)` samples one turn
    for each context (token lists) and returns its tokens, cut after the first EOS (or those and the sampler's log-prob
    of each token, kept in `Episodes.logprobs`); `toolboxes[i]` maps the tool names of episode i to their functions;
    `form` reads the calls in a turn (the template's `ToolCallFormat`)."""
    n = len(prompt_ids)
    out = Episodes(prompt_ids, [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [False] * n)
    max_iterations = math.inf if max_iterations is None else max_iterations
    out.tool_calls, out.failures, out.turns = [0] * n, [0] * n, [0] * n
    active, iteration = list(range(n)), 0
    while active:
        # 1. a turn of every active episode, each within its own budget of tokens
        budget = {i: max_completion_length - len(out.completion_ids[i]) for i in active}
        turns = generate([prompt_ids[i] + out.completion_ids[i] for i in active], max(budget.values()))
        turns, turn_logprobs = turns if isinstance(turns, tuple) else (turns, None)
        if turn_logprobs is not None and out.logprobs is None:
            out.logprobs = [[] for _ in range(n)]
        calling, calls = [], []
        for j, (i, turn) in enumerate(zip(active, turns)):
            turn = turn[: budget[i]]
            out.completion_ids[i] += turn
            out.model_mask[i] += [1] * len(turn)  # the policy's tokens: in the loss
            if turn_logprobs is not None:
                out.logprobs[i] += turn_logprobs[j][: len(turn)]
            out.ended[i] = bool(turn) and turn[-1] == tokenizer.eos_token_id
            out.turns[i] += 1
            # 2. the turn's tool calls, read in the template's format
            content, turn_calls = form.parse(tokenizer.decode(turn, skip_special_tokens=True))
            valid = [{"type": "function", "function": c} for c in turn_calls if "error" not in c]
            out.messages[i].append({"role": "assistant", "content": content} | ({"tool_calls": valid} if valid else {}))
            if turn_calls and out.ended[i] and iteration < max_iterations:
                calling.append(i)
                calls.append(turn_calls)
        # 3. run them (a failing tool: {"error": ...}, never a crash), 4. append the results, rendered by the template
        results = run_calls(calls, [toolboxes[i] for i in calling], timeout)
        active = []
        for i, episode_results in zip(calling, results):
            tool_messages = [{"role": "tool", "name": name, "content": text} for name, text, _ in episode_results]
            out.tool_calls[i] += len(episode_results)
            out.failures[i] += sum(failed for _, _, failed in episode_results)
            suffix = tool_suffix_ids(tokenizer, tool_messages)
            if len(out.completion_ids[i]) + len(suffix) >= max_completion_length:
                continue  # no room for the results and a reply: the episode ends with its last turn (TRL)
            out.messages[i] += tool_messages
            out.completion_ids[i] += suffix
            out.model_mask[i] += [0] * len(suffix)  # the tools' tokens: context only
            if out.logprobs is not None:
                out.logprobs[i] += [0.0] * len(suffix)
            active.append(i)
        iteration += 1
    return out


def episode_text(messages: list[dict]) -> str:
    """An episode for the sample tables: each turn on its line, tool calls and results included."""
    lines = []
    for m in messages:
        calls = " ".join(f"{c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in m.get("tool_calls", []))
        lines.append(f"[{m['role']}] {m['content']}" + (f" -> {calls}" if calls else ""))
    return "\n".join(lines)


# ================================ sampling ================================
@dataclass
class Rollout:
    """Sampled completions: left-padded prompts [N, P] and their mask, right-padded completions [N, T], their mask (the
    context), the mask of the policy's own tokens (the loss; tool results excluded), whether each ended with EOS [N];
    with tools, the episodes (their environments among them)."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    completions: torch.Tensor
    mask: torch.Tensor
    model_mask: torch.Tensor
    ended: torch.Tensor
    episodes: Episodes | None = None
    sampling_logprobs: torch.Tensor | None = None  # [N, T]: log-probs under the policy that sampled (--max-staleness)
    version: int = 0  # the update whose weights sampled it


class Engine:
    """Sampled completions of the policy's prompts through the run's `Sampler` (common/sampling.py, the one door:
    whichever backend samples, and its weight sync); with tools, multi-turn episodes (`run_episodes`). `sampler`:
    another one to sample through (the asynchronous worker's `fork`)."""

    def __init__(self, args, task: Task, policy, accelerator: Accelerator, quiet: bool = False, sampler=None):
        self.args, self.task, self.tokenizer, self.policy, self.accelerator = args, task, task.tokenizer, policy, accelerator
        length = args.max_prompt_length + args.max_completion_length
        self.sampler = sampler or Sampler(args, task.tokenizer, policy, accelerator, length)
        # the sampler's log-probs, for the off-policy loss (and --old-logprobs sampler), or because its numerics differ
        # from the trainer's even on-policy (vLLM: TRL's vllm_importance_sampling_correction)
        keep = getattr(args, "max_staleness", 0) > 0 or getattr(args, "old_logprobs", "") == "sampler"
        self.keep_logprobs = keep or self.sampler.keeps_logprobs
        if quiet:
            return
        how, k = self.sampler.name, getattr(args, "max_staleness", 0)
        if self.sampler.keeps_logprobs:
            every = "update" if args.weight_sync_steps == 1 else f"{args.weight_sync_steps} updates"
            how = f"{how[:-1]}, weights synced every {every}; sampler log-probs kept for the correction)"
        updates = f"{k} update{'s' if k > 1 else ''}"
        if k and getattr(args, "async_rollouts", False):
            every = "every update" if args.weight_sync_steps == 1 else f"every {args.weight_sync_steps} updates"
            how += f"; up to {updates} old, sampled ahead in a background thread whose weights are refreshed {every}"
        elif k:
            how += f"; each update trains on a rollout sampled by the weights of {updates} before"
        accelerator.print(f"rollouts: {how}")
        if task.toolset:
            tools = ", ".join(s["function"]["name"] for s in task.toolset.schemas)
            accelerator.print(f"episodes: tools {tools}; chat template: {task.toolset.template}")

    def rollout(self, rows: list[dict]) -> Rollout:
        """One completion of each row's prompt; with tools, one episode each, advanced together turn by turn."""
        toolset = self.task.toolset
        if toolset is None:
            prompts, prompt_mask = self.sampler.pad_left([r["prompt_ids"] for r in rows])
            completions, mask, ended, logprobs = self.generate(prompts, prompt_mask, logprobs=self.keep_logprobs)
            return Rollout(prompts, prompt_mask, completions, mask, mask, ended, sampling_logprobs=logprobs)
        environments, contexts, toolboxes = [], [], []
        for row in rows:  # each episode's environment, reset with its row; what reset() returns ends the prompt
            environment, tools, observation = toolset.start(row)
            ids = row["prompt_ids"]
            if observation is not None:
                prompt = row["prompt"][:-1] + [row["prompt"][-1] | {"content": row["prompt"][-1]["content"] + observation}]
                ids = prompt_ids(self.tokenizer, prompt, True, self.args.system_prompt, tools=toolset.schemas)
            environments.append(environment)
            contexts.append(ids)
            toolboxes.append(tools)
        args = self.args
        episodes = run_episodes(
            self.generate_turns,
            self.tokenizer,
            contexts,
            toolboxes,
            args.max_completion_length,
            toolset.max_iterations,
            toolset.timeout,
            toolset.format,
        )
        episodes.environments = environments
        device, width = self.accelerator.device, max(1, *map(len, episodes.completion_ids))
        padded = lambda lists, value: torch.tensor([x + [value] * (width - len(x)) for x in lists], device=device)  # noqa: E731
        completions = padded(episodes.completion_ids, self.tokenizer.pad_token_id)
        mask = padded([[1] * len(x) for x in episodes.completion_ids], 0).float()
        model_mask = padded(episodes.model_mask, 0).float()
        ended = torch.tensor(episodes.ended, device=device)
        logprobs = padded(episodes.logprobs, 0.0) if episodes.logprobs is not None else None
        return Rollout(*self.sampler.pad_left(episodes.prompt_ids), completions, mask, model_mask, ended, episodes, logprobs)

    def generate_turns(self, contexts: list[list[int]], max_new_tokens: int):
        """A turn for each context (token lists): its tokens, cut after the first EOS; with the sampler's log-probs kept
        (vLLM, stale rollouts), those tokens and their log-probs."""
        completions, mask, _, sampled = self.generate(
            *self.sampler.pad_left(contexts), max_new_tokens, logprobs=self.keep_logprobs
        )
        turns = [row[m.bool()].tolist() for row, m in zip(completions, mask)]
        return turns if sampled is None else (turns, [row[m.bool()].tolist() for row, m in zip(sampled, mask)])

    def close(self) -> None:
        """The end of sampling: vLLM shut down (HF generate has nothing to close)."""
        self.sampler.close()

    def generate(self, prompts, prompt_mask, max_new_tokens: int | None = None, logprobs: bool = False):
        """`Sampler.generate` at --max-completion-length unless told otherwise: completions [N, T] cut after the first
        EOS, their mask, whether each ended, and with `logprobs` the sampler's log-prob of each token."""
        return self.sampler.generate(prompts, prompt_mask, max_new_tokens or self.args.max_completion_length, logprobs)


class RolloutStream:
    """The rollouts the loop trains on, with bounded staleness (--max-staleness k; TRL's AsyncGRPO semantics): the
    rollout of update t may come from the weights of an earlier update, never more than k updates old.

    - k = 0: each update's rollout is sampled at its start, by the weights it trains: the on-policy loop.
    - deterministic (the default for k > 0): the rollout of update t is sampled by the weights of update t - k exactly
      (the first k by the initial weights), one after the other in this process; two runs are identical, so a curve
      over k is a controlled experiment.
    - asynchronous (--async-rollouts): a background thread holds its own copy of the policy, refreshed from the trainer
      every --weight-sync-steps updates, and samples ahead while the trainer trains; a rollout more than k updates old
      when the trainer takes it is dropped and counted, as TRL does. Each process runs its own worker on its own share
      of the prompts; every process trains on one rollout per update, so their collectives stay in step.
    """

    def __init__(self, args, task: Task, engine: Engine, accelerator: Accelerator, start: int, num_updates: int):
        self.args, self.task, self.engine, self.accelerator = args, task, engine, accelerator
        self.k, self.num_updates, self.queue, self.dropped = args.max_staleness, num_updates, [], 0
        self.waited = 0.0  # seconds the trainer waited for rollouts (the asynchronous worker's: for the trainer)
        self.worker = None
        if getattr(args, "async_rollouts", False) and self.k > 0:
            self.worker = RolloutWorker(args, task, engine, accelerator, start)
        for update in range(start, min(start + self.k, num_updates)) if self.worker is None else ():
            self.queue.append(self._sample(update, version=start))  # the first k: sampled by the initial weights

    def _sample(self, update: int, version: int):
        rows = batch_rows(self.args, self.task, self.accelerator, update)
        self.engine.policy.eval()
        rollout = self.engine.rollout(rows)
        rollout.version = version - self.engine.sampler.lag  # synced every --weight-sync-steps: its weights may be older
        return rows, rollout

    def next(self, update: int):
        """The rows and rollout to train update `update` on, and the rollout's staleness (updates since its weights)."""
        start = time.time()
        if self.worker is not None:
            while True:
                rows, rollout = self.worker.take(self.args.rollout_timeout)
                if update - rollout.version <= self.k:
                    break
                self.dropped += 1  # older than the bound: dropped, as TRL's AsyncGRPO drops it
        else:
            if update + self.k < self.num_updates:  # sampled now, by the weights of update `update`, for update + k
                self.queue.append(self._sample(update + self.k, version=update))
            rows, rollout = self.queue.pop(0)
        self.waited += time.time() - start
        return rows, rollout, update - rollout.version

    def trained(self, update: int, policy) -> None:
        """After update `update`'s optimizer steps, every --weight-sync-steps updates: the sampler's weights refreshed
        (the worker's copy, or vLLM's). This is the one place where weights go to a sampler."""
        sync = (update + 1) % self.args.weight_sync_steps == 0
        if sync and self.worker is not None:
            self.worker.sync(policy, update + 1)
        else:
            self.engine.sampler.updated(policy, sync)

    def metrics(self, staleness: int) -> dict[str, float]:
        """The update's staleness (mean and max over the processes), the rollouts dropped so far, and the seconds the
        trainer waited for rollouts and (asynchronous) the worker for the trainer, so far ({} when on-policy)."""
        if self.k == 0:
            return {}
        device = self.accelerator.device
        every = self.accelerator.gather(torch.tensor([float(staleness), float(self.dropped)], device=device)[None])
        return {
            "staleness/mean": every[:, 0].mean().item(),
            "staleness/max": every[:, 0].max().item(),
            "staleness/dropped": every[:, 1].sum().item(),
            "time/waited_for_rollouts": self.waited,
            "time/worker_waited": self.worker.idle if self.worker is not None else 0.0,
        }

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()


class RolloutWorker:
    """The asynchronous sampler: a thread with its own copy of the policy and its own engine, sampling the rollouts of
    the coming updates into a queue of at most max_staleness + 1 while the trainer trains. Its failure ends the run
    with one line naming the cause, and a worker that produces nothing within --rollout-timeout seconds does too."""

    def __init__(self, args, task: Task, engine: Engine, accelerator: Accelerator, start: int):
        import queue
        import threading

        self.args, self.task, self.accelerator = args, task, accelerator
        # its own sampler: through vLLM's copy of the weights where the engine has one, else over a copy of the policy
        sampler = engine.sampler.fork()
        self.engine = Engine(args, task, sampler.policy, accelerator, quiet=True, sampler=sampler)
        self.version, self.lock, self.error, self.idle = start, threading.Lock(), None, 0.0
        self.queue, self.stopping = queue.Queue(maxsize=args.max_staleness + 1), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(start,), daemon=True, name="rollout-worker")
        self.thread.start()

    def _run(self, update: int) -> None:
        try:
            while not self.stopping.is_set():
                rows = batch_rows(self.args, self.task, self.accelerator, update)
                with self.lock:
                    rollout, version = self.engine.rollout(rows), self.version
                rollout.version = version
                start = time.time()
                while not self.stopping.is_set():  # the queue is full: the worker waits for the trainer
                    try:
                        self.queue.put((rows, rollout), timeout=0.1)
                        break
                    except Exception:  # noqa: BLE001 - queue.Full
                        continue
                self.idle += time.time() - start
                update += 1
        except BaseException as error:  # noqa: BLE001 - reported by the trainer, in one line
            self.error = error

    def take(self, timeout: float):
        import queue

        deadline = time.time() + timeout
        while True:
            try:
                return self.queue.get(timeout=0.5)
            except queue.Empty:
                if self.error is not None:  # set before its thread ends
                    raise UsageError(f"the rollout worker failed: {type(self.error).__name__}: {self.error}") from None
                if not self.thread.is_alive():
                    raise UsageError("the rollout worker ended without a rollout or an error") from None
                if time.time() > deadline:
                    raise UsageError(
                        f"the rollout worker produced nothing in {timeout:g} s (--rollout-timeout): it hangs"
                    ) from None

    def sync(self, policy, version: int) -> None:
        """The trainer's weights into the worker's copy, between two of its rollouts."""
        with self.lock:
            self.engine.sampler.sync(policy)
            self.version = version

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)


@torch.no_grad()
def sampling_logprobs(args, accelerator: Accelerator, policy, ref_model, rollout: Rollout, old: bool, ref: bool):
    """Per-token log-probs [N, T] of the completions, by mini-batches: under the policy as it sampled (`old`: before any
    update of this batch) and under the reference (`ref`: the frozen copy, or the policy with its adapter off); None
    for what is not asked."""
    old_logprobs, ref_logprobs = [], []
    for j in range(0, len(rollout.completions), args.mini_batch_size) if old or ref else ():
        mb = slice(j, j + args.mini_batch_size)
        inputs = (rollout.prompts[mb], rollout.prompt_mask[mb], rollout.completions[mb], rollout.mask[mb], args.temperature)
        if old:
            old_logprobs.append(per_token_logprobs(policy, *inputs)[0])
        if ref:
            with reference_context(policy, ref_model), accelerator.autocast():
                ref_logprobs.append(per_token_logprobs(ref_model or policy, *inputs)[0])
    return (torch.cat(old_logprobs) if old else None), (torch.cat(ref_logprobs) if ref else None)


# ================================ DAPO's dynamic sampling ================================
def dynamic_sampling(args, task: Task, engine: Engine, accelerator: Accelerator, update: int, rows, rollout, scored, score):
    """DAPO's dynamic sampling (Yu et al. 2025, Algorithm 1; verl's filter_groups): a group whose rewards are all equal
    has no advantage to learn from, so it is set aside and more prompts are sampled, round after round, until this rank
    holds batch_size groups whose rewards differ, or --max-num-gen-batches rounds were drawn; the batch is then topped
    up with groups set aside. Every rank samples in every round while any rank lacks groups (their collectives stay in
    step). `scored` is `score(rows, rollout)`: a tuple of per-completion tensors or lists, its first the rewards [N]
    that decide. Returns the batch's rows, rollout and scores, the rounds drawn, and the groups topped up."""
    G, want = args.num_generations, args.batch_size
    kept, aside, rounds = [], [], 0
    while True:
        for g, flat in enumerate(zero_std_groups(scored[0], G).tolist()):  # this rank's groups: all rewards equal
            (aside if flat else kept).append((rows, rollout, scored, slice(g * G, (g + 1) * G)))
        rounds += 1
        short = accelerator.reduce(torch.tensor(float(len(kept) < want), device=accelerator.device), "max")
        if short.item() == 0 or rounds >= args.max_num_gen_batches:
            break
        # the next prompts: a draw of its own per (update, round), the same on every rank, each rank its slice
        draw = (update + 1) * args.max_num_gen_batches + rounds + 10**6
        rows = [row for row in epoch_rows(task.train_rows, want, draw, args.seed, accelerator) for _ in range(G)]
        engine.policy.eval()
        rollout = engine.rollout(rows)
        scored = score(rows, rollout)
    chosen = (kept + aside)[:want]
    rows = [row for part_rows, _, _, part in chosen for row in part_rows[part]]

    def joined(i):  # the i-th score of the chosen groups
        parts = [(s[i], part) for _, _, s, part in chosen]
        return torch.cat([v[p] for v, p in parts]) if torch.is_tensor(parts[0][0]) else [x for v, p in parts for x in v[p]]

    scored = tuple(joined(i) for i in range(len(scored)))
    rollout = cat_rollouts([(r, part) for _, r, _, part in chosen], task.tokenizer.pad_token_id)
    return rows, rollout, scored, rounds, max(0, want - len(kept))


def dynamic_metrics(accelerator: Accelerator, rounds: int, filled: int) -> dict[str, float]:
    """The update's generation rounds (the most over the processes) and the groups topped up (summed over them)."""
    values = accelerator.gather(torch.tensor([[float(rounds), float(filled)]], device=accelerator.device))
    return {"dynamic_sampling/rounds": values[:, 0].max().item(), "dynamic_sampling/filled": values[:, 1].sum().item()}


def cat_rollouts(parts: list, pad_id: int) -> Rollout:
    """One rollout of the `(rollout, slice)` parts: prompts left-padded and completions right-padded to the widest."""
    first = parts[0][0]
    P = max(r.prompts.shape[1] for r, _ in parts)
    T = max(r.completions.shape[1] for r, _ in parts)

    def left(x, value):
        return torch.nn.functional.pad(x, (P - x.shape[1], 0), value=value)

    def right(x, value):
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

    def cat(name, pad, value):
        return torch.cat([pad(getattr(r, name)[part], value) for r, part in parts])

    sampled = None if first.sampling_logprobs is None else cat("sampling_logprobs", right, 0.0)
    return type(first)(
        cat("prompts", left, pad_id), cat("prompt_mask", left, 0), cat("completions", right, pad_id),
        cat("mask", right, 0), cat("model_mask", right, 0), torch.cat([r.ended[part] for r, part in parts]),
        sampling_logprobs=sampled, version=first.version,
    )  # fmt: skip


# ================================ scoring and evaluation ================================
def score(task: Task, rows: list[dict], rollout: Rollout) -> tuple[torch.Tensor, list[str]]:
    """Rewards [N, F] of the completions (decoded, or the episodes' messages) by every reward function, and their texts."""
    completions, mask, ended, episodes = rollout.completions, rollout.mask, rollout.ended, rollout.episodes
    texts, ids = decode(task.tokenizer, completions, mask)
    device = completions.device
    if episodes is None:
        return score_completions(task.reward_funcs, rows, texts, ids, ended.tolist(), device), texts
    environments = episodes.environments if task.toolset.factory else None
    rewards = score_completions(task.reward_funcs, rows, episodes.messages, ids, ended.tolist(), device, environments)
    return rewards, [episode_text(m) for m in episodes.messages]


@torch.no_grad()
@torch.random.fork_rng()  # evaluation draws from its own RNG: how often it runs never changes training
def evaluate(args, engine: Engine, logger, update: int) -> dict[str, float]:
    """The held-out verifier score: one completion per held-out prompt (this rank's share; --num-generations-eval k: k
    of them, with pass@k and mean@k), sampled as in training (TRL's evaluation) with the same seed at every evaluation,
    scored by the first reward function; the completion length, the share of the most frequent answer, and with tools
    the episodes' metrics."""
    accelerator, device, task = engine.accelerator, engine.accelerator.device, engine.task
    torch.manual_seed(args.seed + accelerator.process_index)
    engine.policy.eval()
    k = args.num_generations_eval or 1
    totals, tools = torch.zeros(4, device=device), 0
    table = {"prompt": [], "completion": [], "answer": [], "score": []}
    for rows, weight in rank_batches(task.eval_rows, 64, accelerator):  # this rank's share, as many chunks on every rank
        chunk = [row for row in rows for _ in range(k)]  # each problem k times, side by side
        rollout = engine.rollout(chunk)
        scores, texts = score(task, chunk, rollout)
        scores = scores[:, 0]
        count = torch.tensor(len(chunk), device=device)
        best = scores.nan_to_num().view(-1, k).max(1).values.sum()  # pass@k: each problem's best of its k
        totals += weight * torch.stack([scores.nan_to_num().sum(), rollout.model_mask.sum(), count, best])
        if task.toolset is not None:  # tool use on the held-out prompts, pooled over the chunks
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
    top_share = distinct_answers(completions, all(is_number(r["answer"]) for r in task.eval_rows))[0]
    metrics = {
        "eval/reward": (totals[0] / totals[2]).item(),
        "eval/completion_length": (totals[1] / totals[2]).item(),
        "eval/top_answer_share": float(top_share),
    }
    if k > 1:  # the problems' best of k (pass@k for a 0/1 verifier) and the mean over all k (mean@k, = eval/reward)
        metrics |= {f"eval/pass@{k}": (totals[3] * k / totals[2]).item(), f"eval/mean@{k}": metrics["eval/reward"]}
    if task.toolset is not None:
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
    """The tool-use metrics of an update's episodes, pooled over the processes ({} without tools)."""
    if rollout.episodes is None:
        return {}
    return episode_stats(accelerator.reduce(episode_totals(rollout), "sum"))


def rollout_metrics(args, accelerator: Accelerator, task: Task, rollout: Rollout, rewards_per_func, all_rewards):
    """What every online script logs of an update's completions, over every process's (TRL 1.x's names): each reward
    function's mean and std, `reward` (the weighted sum of the reward functions, the task's reward, before any shaping
    by the algorithm), `frac_reward_zero_std` (the share of groups whose rewards, as the advantages read them, are all
    equal: no signal), the completions' lengths in the policy's own tokens and the share cut by the length limit, and
    with tools the episodes' metrics. `all_rewards` [world * N] are every process's rewards as the advantages read
    them. Also returns why the update had nothing to learn from, if it had nothing (`rewards.degenerate_batch`)."""
    task_rewards = (rewards_per_func * task.weights).nansum(1)
    task_rewards[rewards_per_func.isnan().all(1)] = math.nan  # every function returned None: unscorable
    all_rewards_per_func, all_task_rewards = accelerator.gather((rewards_per_func, task_rewards))
    lengths, ended = accelerator.gather((rollout.model_mask.sum(1), rollout.ended))
    metrics = {
        f"rewards/{spec}/{stat}": value
        for (spec, _), values in zip(task.reward_funcs, all_rewards_per_func.T)
        for stat, value in (("mean", values.nanmean().item()), ("std", nanstd(values).item()))
    }
    reasons = degenerate_batch(lengths, ended, all_task_rewards, args.mask_truncated_completions)
    return reasons, metrics | {
        "reward": all_task_rewards.nanmean().item(),
        "reward_std": nanstd(all_task_rewards).item(),
        "frac_reward_zero_std": zero_std_groups(all_rewards, args.num_generations).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": 1 - ended.float().mean().item(),
    } | episode_metrics(accelerator, rollout)


def zero_std_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups]: whether a group's rewards are all equal (std 0), or fewer than two are scorable (TRL 1.x: isclose)."""
    std = nanstd(rewards.view(-1, num_generations), dim=1)
    return torch.isclose(std, torch.zeros_like(std)) | std.isnan()


def summary(algorithm: str, args, accelerator: Accelerator, done: int, seconds: float, history, first_eval, last_eval, kl):
    """The run's last line: updates, prompts and time, the training reward's first and last tenth (with `kl`, the KL
    per token at the end), the held-out reward and the share of its most frequent answer; then a warning if the policy
    collapsed onto a few answers."""
    window, world = max(1, len(history) // 10), accelerator.num_processes
    first, last = np.mean(history[:window], 0), np.mean(history[-window:], 0)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    accelerator.print(
        f"{algorithm}: {done} updates, {done * args.batch_size * world} prompts x {args.num_generations} in "
        f"{seconds:.0f}s; train reward {first[0]:.3f} -> {last[0]:.3f}{f' (KL per token {last[1]:.3f})' if kl else ''}; "
        f"eval reward {first_eval['eval/reward']:.3f} -> {last_eval['eval/reward']:.3f} (most frequent answer "
        f"{first_eval['eval/top_answer_share']:.0%} -> {last_eval['eval/top_answer_share']:.0%} of them); "
        f"model saved to {args.output_dir}"
        + (f" ({'sharded over' if sharded else 'weights identical on'} {world} ranks)" if world > 1 else "")
    )
    first_top, last_top = first_eval["eval/top_answer_share"], last_eval["eval/top_answer_share"]
    if last_top > max(0.2, 2 * first_top):  # a reward won by answering the same thing everywhere is not learning
        accelerator.print(
            f"warning: one answer fills {last_top:.0%} of the held-out completions ({first_top:.0%} at the "
            "start): the policy collapsed onto a few answers; lower --learning-rate"
        )
