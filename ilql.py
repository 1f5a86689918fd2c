"""ILQL: Implicit Language Q-Learning (Snell et al. 2022), offline RL for language models, as in trlX's
AccelerateILQLTrainer / ILQLConfig / AutoModelForCausalLMWithILQLHeads.

From a fixed dataset of (prompt, response, reward), learn token-level Q(s, a) and V(s) on top of a causal LM:
V fits an upper expectile of Q (implicit Q-learning, Kostrikov et al. 2021), so no action outside the data is ever
queried; Q fits reward + gamma * V(next). The LM itself is trained on the data (AWAC-weighted cross entropy), a CQL
term keeps Q low on unseen tokens. At generation the behaviour policy's log-probs are shifted by beta * (Q - V).

Usage:
    python ilql.py                                  # offline: builtin:tiny-chat, chatterbot replies scored by VADER
    accelerate launch ilql.py --gen-beta 2 --cql-scale 0.5
    accelerate launch --config_file configs/multi_gpu.yaml ilql.py --model-name gpt2 --dataset-name data.jsonl \\
        --reward-column reward
"""

import copy
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_scheduler

from common.checkpoints import full_weights, load_checkpoint, save_checkpoint
from common.cli import cli
from common.core import LogitMask, UsageError, check_adam, check_args, check_scores, masked_mean, pad_right, plain
from common.fast_paths import cache_argument
from common.loading import (
    check_columns,
    context_length,
    load_config,
    load_data,
    load_pretrained,
    load_tokenizer,
    train_eval_split,
)
from common.models import peft_model_of
from common.outputs import atomic_directory, check_finite, write_model_card
from common.run import end_run, rank_batches, start_run

HEADS_FILE = "ilql_heads.safetensors"


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
    """a causal LM (hub id, local folder, or a built-in preset: builtin:tiny-chat, pretrained on the built-in dialogue
    and built on first use; builtin:tiny-gpt2, random) or a folder saved by this script (heads load back)"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    dataset_name: str = "builtin:chatterbot-mixed-replies"
    """a hub id, a local json/jsonl/csv/parquet file, or a built-in: chatterbot-mixed-replies (each utterance with its
    reply and with a random other one, so every state has actions of different return: offline RL data of mixed
    quality) or chatterbot-dialogue (one reply per utterance)"""
    dataset_split: str = "train"
    """the split to load from a hub dataset"""
    prompt_column: str | None = "prompt"
    """the prompt column; None for (text, reward) data: the whole text is the response to an empty (BOS) prompt"""
    response_column: str = "completion"
    """the response column (the text column for (text, reward) data)"""
    reward_column: str | None = None
    """the reward column; None scores every response with `reward_fn` in this file (VADER sentiment)"""
    max_length: int = 32
    """prompt + response tokens; longer samples lose prompt tokens from the left, then response tokens"""
    eval_fraction: float = 0.03
    """fraction of the rows held out; their prompts are used for evaluation"""

    # ILQL (defaults: trlX's ILQLConfig, except the target sync rate)
    tau: float = 0.7
    """expectile of the V loss: V fits the tau-expectile of Q (0.5: the mean; towards 1: the max)"""
    gamma: float = 0.99
    """discount factor"""
    cql_scale: float = 0.1
    """weight of the CQL term (cross entropy of Q as logits against the data's tokens)"""
    awac_scale: float = 1.0
    """weight of the AWAC term (the LM's cross entropy, weighted by exp(awac_beta * (Q - V)))"""
    awac_beta: float = 0.0
    """temperature of the AWAC weights (trlX's `beta`; 0: plain cross entropy, the behaviour policy)"""
    alpha: float = 0.1
    """Polyak rate: at a sync, target <- alpha * online + (1 - alpha) * target (trlX: 0.001 every 5 steps, for runs of
    thousands of steps; in the few hundred steps of a CPU run such targets stay at their init)"""
    steps_for_target_q_sync: int = 1
    """optimizer steps between target Q head syncs (trlX: 5)"""
    two_qs: bool = True
    """two Q heads (and targets); the minimum of the targets is used (clipped double Q)"""

    # Optimisation
    num_epochs: int = 2
    """passes over the training data"""
    max_steps: int = -1
    """if > 0: stop after this many optimizer steps (overrides num_epochs)"""
    batch_size: int = 32
    """samples per micro-batch on each process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    learning_rate: float = 1e-3
    """AdamW learning rate (trlX's examples use 5e-5 on pretrained GPT-2; the random tiny default needs more)"""
    weight_decay: float = 1e-6
    """AdamW weight decay"""
    adam_beta1: float = 0.9
    """AdamW's beta1 (TRL's default)"""
    adam_beta2: float = 0.999
    """AdamW's beta2 (TRL's default)"""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon (TRL's default)"""
    lr_scheduler_type: str = "cosine"
    """transformers scheduler name (linear, cosine, constant, ...)"""
    warmup_ratio: float = 0.0
    """fraction of the steps spent warming up the learning rate"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    use_peft: bool = False
    """train LoRA adapters on the LM (the heads are trained fully); merged into the saved model"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""

    # Generation and evaluation
    gen_beta: float = 4.0
    """advantage scale at generation: log pi(a|s) + gen_beta * (Q(s, a) - V(s)); 0 samples the behaviour policy"""
    top_k: int = 20
    """top-k of the shifted logits (0: off)"""
    temperature: float = 1.0
    """sampling temperature"""
    logit_mask: str | None = None
    """trlX's logit mask: a JSON file of allowed transitions, {"token id": [ids allowed next], ...}, or trlX's dense
    [vocab][vocab] booleans (True: forbidden). Applied to the LM's logits before the advantage shift, as trlX does"""
    max_new_tokens: int = 12
    """response tokens generated at evaluation"""
    eval_samples: int = 64
    """held-out prompts per evaluation (each process)"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (and at the start and end)"""
    save_steps: int = 0
    """write a resumable checkpoint every this many steps (0: only the final model)"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints of this run (TRL's save_total_limit); None: every one"""
    resume_from: str | None = None
    """a checkpoint folder ({output_dir}_checkpoints/step_N) to continue from"""
    output_dir: str = "outputs/ilql"
    """the LM (plain from_pretrained format, LoRA merged) and ilql_heads.safetensors"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""


def reward_fn(prompts: list[str], responses: list[str]) -> list[float]:
    """The default reward: VADER compound sentiment of each response, in [-1, 1]. Replace it with your own."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = reward_fn.analyzer = getattr(reward_fn, "analyzer", None) or SentimentIntensityAnalyzer()
    return [analyzer.polarity_scores(r)["compound"] for r in responses]


def metric_fn(prompts: list[str], responses: list[str]) -> dict[str, list[float]]:
    """Extra evaluation metrics (trlX `metric_fn`): name -> one value per sample. Replace it with your own."""
    return {
        "response_words": [float(len(r.split())) for r in responses],
        "distinct_words": [len(set(r.split())) / max(1, len(r.split())) for r in responses],
    }


def make_head(hidden_size: int, out_size: int) -> nn.Sequential:
    """trlX's head: Linear(h, 2h) -> ReLU -> Linear(2h, out)."""
    return nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size), nn.ReLU(), nn.Linear(2 * hidden_size, out_size))


class CausalLMWithILQLHeads(nn.Module):
    """A causal LM with a V head, one or two Q heads over the vocabulary, and frozen target copies of the Q heads,
    all on the LM's final hidden states. `save_pretrained` writes the LM (plain `from_pretrained` loads it) and the
    heads in ilql_heads.safetensors beside it; `from_pretrained` loads them back."""

    def __init__(self, lm: nn.Module, two_qs: bool = True):
        super().__init__()
        self.lm = lm
        hidden_size, vocab_size = lm.config.get_text_config().hidden_size, lm.get_output_embeddings().weight.shape[0]
        self.v_head = make_head(hidden_size, 1)
        self.q_heads = nn.ModuleList(make_head(hidden_size, vocab_size) for _ in range(2 if two_qs else 1))
        self.target_q_heads = copy.deepcopy(self.q_heads).requires_grad_(False)

    @classmethod
    def from_pretrained(cls, name: str, two_qs: bool = True):
        model = cls(load_pretrained(name, AutoModelForCausalLM), two_qs)
        heads_file = os.path.join(name, HEADS_FILE)
        if os.path.isfile(heads_file):
            model.load_state_dict(load_file(heads_file), strict=False)
        return model

    def save_pretrained(self, directory: str, state_dict: dict | None = None) -> None:
        """`state_dict`: this module's whole state (gathered when sharded); None: its own."""
        state = self.state_dict() if state_dict is None else state_dict
        lm = None if state_dict is None else {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
        self.lm.save_pretrained(directory, state_dict=lm)
        heads = {k: v.contiguous() for k, v in state.items() if not k.startswith("lm.")}
        save_file(heads, os.path.join(directory, HEADS_FILE))

    def forward(self, input_ids, attention_mask, states_ixs, actions_ixs, actions):
        """At the N action positions: LM logits [B, N, V], each Q head's [B, N, V], each target Q head's value of the
        taken action [B, N]; V [B, N + 1] at the states."""
        hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

        def at(ixs):  # the hidden states at positions ixs [B, N]
            return hidden.gather(1, ixs.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))

        actions_hidden = at(actions_ixs)
        logits = self.lm.get_output_embeddings()(actions_hidden)  # only where an action is taken
        qs = [head(actions_hidden) for head in self.q_heads]
        with torch.no_grad():  # targets need only the taken token: its row of the last layer, not all V of them
            target_qs = []
            for head in self.target_q_heads:
                features, last = head[:-1](actions_hidden), head[-1]
                target_qs.append((features * last.weight[actions]).sum(-1) + last.bias[actions])
        return logits, qs, target_qs, self.v_head(at(states_ixs)).squeeze(-1)

    @torch.no_grad()
    def sync_target_q_heads(self, alpha: float) -> None:
        """Polyak averaging: target <- alpha * online + (1 - alpha) * target."""
        for target, online in zip(self.target_q_heads.parameters(), self.q_heads.parameters()):
            target.copy_(alpha * online + (1.0 - alpha) * target)


def ilql_loss(
    logits: torch.Tensor,
    qs: list[torch.Tensor],
    target_qs: list[torch.Tensor],
    vs: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    dones: torch.Tensor,
    gamma: float,
    tau: float,
    cql_scale: float,
    awac_scale: float,
    awac_beta: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """trlX's `ILQLConfig.loss` (Snell et al. 2022, Eq. 1-3 with the CQL and AWAC terms of Section 4).

    logits, qs: [B, N, V] at the N action positions; target_qs: each target head's Q of the taken action [B, N];
    vs: [B, N + 1] at the states (the N states an action was taken from, then the final state); actions, rewards:
    [B, N]; dones: [B, N + 1], 1 where a state is followed by another (0 at the final state and in padding). Every
    term averages over the real (non-padded) actions.
    """
    terminal_mask = dones[:, :-1].float()  # [B, N]: the real actions
    n = terminal_mask.sum().clamp(min=1)
    q = [qi.gather(-1, actions.unsqueeze(-1)).squeeze(-1) for qi in qs]
    target_q = torch.stack(target_qs).amin(0).detach()  # clipped double Q
    v, v_next = vs[:, :-1], vs[:, 1:] * dones[:, 1:]  # V(s'), zero after the last action
    q_target = rewards + gamma * v_next.detach()
    loss_q = sum(((qi - q_target) ** 2 * terminal_mask).sum() / n for qi in q)
    # expectile regression of V towards the (target) Q: weight tau above V, 1 - tau below
    weight = torch.where(target_q >= v, tau, 1 - tau)
    loss_v = (weight * (target_q - v) ** 2 * terminal_mask).sum() / n

    def cross_entropy(logits):  # [B, N, V] -> [B, N]
        return F.cross_entropy(logits.flatten(0, 1).float(), actions.flatten(), reduction="none").view_as(actions)

    loss_cql = sum((cross_entropy(qi) * terminal_mask).sum() / n for qi in qs)
    awac_weight = torch.exp(awac_beta * (target_q - v)).detach()
    loss_awac = (cross_entropy(logits) * awac_weight * terminal_mask).sum() / n
    loss = loss_q + loss_v + cql_scale * loss_cql + awac_scale * loss_awac
    stats = {
        "losses/loss": loss,
        "losses/loss_q": loss_q,
        "losses/loss_v": loss_v,
        "losses/loss_cql": loss_cql,
        "losses/loss_awac": loss_awac,
        "values/v": masked_mean(v, terminal_mask),
        "values/q": masked_mean(q[0], terminal_mask),
        "values/advantage": masked_mean(target_q - v, terminal_mask),
    }
    return loss, {k: x.detach().float() for k, x in stats.items()}


def advantage_logits(logits: torch.Tensor, target_qs: list[torch.Tensor], v: torch.Tensor, beta: float) -> torch.Tensor:
    """trlX's generation scores: log_softmax(logits) + beta * (min_i target Q_i - V). logits, Q: [..., V]; v: [...]."""
    return F.log_softmax(logits.float(), -1) + beta * (torch.stack(target_qs).amin(0) - v.unsqueeze(-1))


def tokenize_sample(tokenizer, prompt: str | None, response: str, max_length: int) -> dict | None:
    """Tokens of prompt + response + EOS; actions are the response tokens (trlX's `make_experience`).

    states_ixs: the positions an action is taken from (the one before each response token) and the last position;
    dones: 1 for every state but the last. None when nothing of the response fits.
    """
    prompt_ids = tokenizer(prompt)["input_ids"] if prompt else [tokenizer.bos_token_id]
    response_ids = tokenizer(response)["input_ids"] + [tokenizer.eos_token_id]
    prompt_ids = prompt_ids[-max(1, max_length - len(response_ids)) :]  # keep the prompt's end
    response_ids = response_ids[: max_length - len(prompt_ids)]
    if not response_ids:
        return None
    actions_ixs = list(range(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1))
    return dict(
        input_ids=prompt_ids + response_ids,
        actions_ixs=actions_ixs,
        states_ixs=actions_ixs + [actions_ixs[-1] + 1],
        dones=[1] * len(actions_ixs) + [0],
    )


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_adam(args)
    check_args(
        args,
        positive=(
            "save_total_limit learning_rate batch_size gradient_accumulation_steps num_epochs eval_steps max_grad_norm "
            "max_length max_new_tokens eval_samples steps_for_target_q_sync temperature"
        ),
        non_negative="weight_decay save_steps cql_scale awac_scale gen_beta top_k",
        fractions="eval_fraction tau",
    )
    if not (0 < args.alpha <= 1 and 0 <= args.gamma <= 1 and 0 <= args.warmup_ratio < 1):
        raise UsageError(
            f"--alpha {args.alpha}, --gamma {args.gamma}, --warmup-ratio {args.warmup_ratio}: alpha lies in "
            "(0, 1], gamma in [0, 1], the warmup ratio in [0, 1)."
        )


@dataclass
class Data:
    """The tokenised training samples (their terminal rewards normalised, as trlX does), this rank's held-out prompts
    and their weights (0 for a rank's stand-in), and the mean raw reward of the training data."""

    samples: list[dict]
    eval_prompts: list[str]
    eval_batches: list
    eval_weights: torch.Tensor
    mean_score: float


def load_samples(args: Args, accelerator: Accelerator, tokenizer) -> Data:
    """The (prompt, response, reward) data, checked, split, scored (the reward column, else reward_fn) and tokenised."""
    dataset = load_data(args.dataset_name, args.dataset_split)
    columns = [c for c in (args.prompt_column, args.response_column, args.reward_column) if c]
    flags = "--prompt-column / --response-column / --reward-column"
    check_columns(dataset, columns, flags, numeric=(args.reward_column,), chat=False)
    context = context_length(load_config(args.model_name))
    if context and args.max_length + args.max_new_tokens > context:
        raise UsageError(
            f"max_length ({args.max_length}) + max_new_tokens ({args.max_new_tokens}) exceeds the model's "
            f"context of {context} tokens: lower one of them."
        )
    train_dataset, eval_dataset = train_eval_split(dataset, args.eval_fraction, args.seed)
    prompts = list(train_dataset[args.prompt_column]) if args.prompt_column else [None] * len(train_dataset)
    responses = list(train_dataset[args.response_column])
    scores = train_dataset[args.reward_column] if args.reward_column else reward_fn([p or "" for p in prompts], responses)
    source = f"the reward column {args.reward_column!r}" if args.reward_column else "reward_fn"
    returns = check_scores(scores, len(responses), source)
    if args.reward_column:  # training reads the column; generated replies have no column value, so say what scores them
        accelerator.print(
            f"note: training rewards come from the column {args.reward_column!r}; held-out generations are scored by "
            "reward_fn in ilql.py (VADER sentiment): replace it with your reward to evaluate what you train"
        )
    returns = (returns - returns.mean()) / (returns.std() + torch.finfo(returns.dtype).eps)  # trlX normalises returns
    samples = []
    for prompt, response, ret in zip(prompts, responses, returns.tolist()):
        sample = tokenize_sample(tokenizer, prompt, response, args.max_length)
        if sample is not None:
            samples.append(sample | {"rewards": [0.0] * (len(sample["actions_ixs"]) - 1) + [ret]})
    if args.prompt_column:
        eval_prompts = list(dict.fromkeys(eval_dataset[args.prompt_column]))[: args.eval_samples]
    else:  # (text, reward) data: the start of held-out texts as prompts
        eval_prompts = [" ".join(t.split()[:3]) for t in eval_dataset[args.response_column]][: args.eval_samples]
    eval_batches = rank_batches(eval_prompts, 64, accelerator)  # this rank's share, as many batches on every rank
    eval_prompts = [p for chunk, _ in eval_batches for p in chunk]
    eval_weights = torch.tensor([w for chunk, w in eval_batches for _ in chunk], device=accelerator.device)
    mean_score = torch.as_tensor(scores, dtype=torch.float).mean().item()
    return Data(samples, eval_prompts, eval_batches, eval_weights, mean_score)


def micro_batch(args: Args, accelerator: Accelerator, tokenizer, samples: list[dict], steps_per_epoch: int, step: int):
    """This rank's micro-batch: a seeded reshuffle per epoch (a resume continues exactly), right-padded."""
    epoch, i = divmod(step, steps_per_epoch)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(args.seed + epoch))
    start = (i * accelerator.num_processes + accelerator.process_index) * args.batch_size
    chunk = [samples[j] for j in order[start : start + args.batch_size].tolist()]
    padding = dict(input_ids=tokenizer.pad_token_id, actions_ixs=0, states_ixs=0, dones=0, rewards=0.0)
    batch = {key: pad_right([s[key] for s in chunk], value) for key, value in padding.items()}
    batch["attention_mask"] = pad_right([[1] * len(s["input_ids"]) for s in chunk], 0)
    return {k: v.to(accelerator.device) for k, v in batch.items()}


def load_model(args: Args, accelerator: Accelerator, total_steps: int):
    """The LM with its V, Q and target Q heads (LoRA on the LM with --use-peft; the heads as rank 0 drew them),
    prepared with its AdamW optimizer and schedule."""
    model = CausalLMWithILQLHeads.from_pretrained(args.model_name, args.two_qs)
    if args.use_peft:
        model.lm = get_peft_model(model.lm, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, task_type="CAUSAL_LM"))
    model.to(accelerator.device)
    if accelerator.num_processes > 1:  # the new heads as rank 0 drew them (per-rank seeds; FSDP2 shards each rank's own)
        for head in (model.v_head, model.q_heads, model.target_q_heads):
            for parameter in head.parameters():
                torch.distributed.broadcast(parameter.data, src=0)
    # fused: one kernel over all parameters, several times faster than the per-tensor update
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained,
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=True,
    )
    ticks = accelerator.num_processes  # accelerate's prepared scheduler steps once per process per optimizer step
    warmup = int(args.warmup_ratio * total_steps) * ticks
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps * ticks
    )
    return accelerator.prepare(model, optimizer, scheduler)


@torch.no_grad()
def generate(args: Args, accelerator: Accelerator, model, tokenizer, logit_mask, prompts: list[str], beta: float):
    """Sample from the advantage-shifted policy, token by token with the KV cache (left padding)."""
    device, heads = accelerator.device, accelerator.unwrap_model(model)
    sharded = hasattr(heads, "unshard")  # FSDP2: the root's own weights gathered, every rank decodes every step
    if sharded:
        heads.unshard()
    ids = [i[-args.max_length :] for i in tokenizer(prompts)["input_ids"]]  # a long prompt keeps its end, as in training
    inputs = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(device)
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    past, generated, cache_kw = None, [], cache_argument(heads.lm)
    for _ in range(args.max_new_tokens):
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
        out = heads.lm(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **{cache_kw: past},
            use_cache=True, output_hidden_states=True,
        )  # fmt: skip
        past, hidden, logits = out[cache_kw], out.hidden_states[-1][:, -1], out.logits[:, -1]
        if logit_mask is not None:  # the last token fed in (prompt end, or the last sampled) decides what may follow
            logits = logit_mask.apply(logits, input_ids[:, -1])
        scores = advantage_logits(logits, [h(hidden) for h in heads.target_q_heads], heads.v_head(hidden).squeeze(-1), beta)
        if args.top_k:
            scores = scores.masked_fill(scores < scores.topk(args.top_k, -1).values[:, -1:], float("-inf"))
        tokens = torch.multinomial(F.softmax(scores / args.temperature, -1), 1).squeeze(-1)
        tokens = tokens.masked_fill(finished, tokenizer.pad_token_id)
        generated.append(tokens)
        finished |= tokens == tokenizer.eos_token_id
        real = ~finished | (tokens == tokenizer.eos_token_id)  # the EOS itself is attended to, padding after it not
        input_ids, attention_mask = tokens[:, None], torch.cat([attention_mask, real[:, None].long()], 1)
        if finished.all() and not sharded:
            break
    if sharded:
        heads.reshard()
    return tokenizer.batch_decode(torch.stack(generated, 1), skip_special_tokens=True)


@torch.no_grad()
def evaluate(args: Args, accelerator: Accelerator, model, tokenizer, logit_mask, data: Data, logger, step: int) -> dict:
    """Reward of generations on the held-out prompts with beta = 0 (behaviour policy) and beta = gen_beta."""
    device = accelerator.device
    model.eval()
    results, columns = {}, {"prompt": data.eval_prompts}
    with torch.random.fork_rng():
        torch.manual_seed(args.seed + accelerator.process_index)  # the same draws at every evaluation
        for beta in dict.fromkeys([0.0, args.gen_beta]):
            responses = [
                r
                for chunk, _ in data.eval_batches
                for r in generate(args, accelerator, model, tokenizer, logit_mask, chunk, beta)
            ]
            rewards = check_scores(reward_fn(data.eval_prompts, responses), len(responses), "reward_fn").to(device)
            extra = metric_fn(data.eval_prompts, responses)
            metrics = {"reward": rewards} | {k: torch.tensor(v, device=device) for k, v in extra.items()}
            # means over every rank's samples: sums and counts, one collective
            weights = data.eval_weights
            sums = accelerator.reduce(
                torch.stack([(v.float() * weights).sum() for v in metrics.values()] + [weights.sum()]), "sum"
            )
            results |= {f"eval/{k}_beta_{beta:g}": (v / sums[-1]).item() for k, v in zip(metrics, sums[:-1])}
            columns |= {f"beta={beta:g}": responses, f"reward (beta={beta:g})": rewards.tolist()}
    logger.log(results, step)
    logger.samples("eval samples", columns, step)
    model.train()
    return results


def save(args: Args, accelerator: Accelerator, model, tokenizer, metrics: dict) -> None:
    """The LM in plain from_pretrained format (LoRA merged), the heads beside it, the tokenizer and the model card."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if peft_model_of(unwrapped.lm) is not None:
        unwrapped.lm = unwrapped.lm.merge_and_unload()
    weights = full_weights(accelerator, model)  # gathered on the main process when sharded (every rank calls it)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_directory(args.output_dir) as tmp:
            unwrapped.save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            write_model_card(tmp, args, "ilql", metrics)


def main(args: Args) -> None:
    """Setup, then the loop, then the final evaluation, save and summary."""
    check(args)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    run_name, logger = start_run(args, accelerator)
    tokenizer = load_tokenizer(args.model_name, padding_side="left")
    data = load_samples(args, accelerator, tokenizer)  # checked before any model is built or loaded
    per_step = args.batch_size * accelerator.num_processes
    steps_per_epoch = len(data.samples) // per_step
    epoch_steps = steps_per_epoch * args.num_epochs // args.gradient_accumulation_steps
    total_steps = args.max_steps if args.max_steps > 0 else epoch_steps
    if total_steps == 0 or steps_per_epoch == 0:  # fewer examples than one batch: no epoch to draw from
        raise UsageError(
            f"{len(data.samples)} samples make no optimizer step of {per_step} x {args.gradient_accumulation_steps}: "
            "lower --batch-size or --gradient-accumulation-steps."
        )
    accelerator.print(
        f"{len(data.samples)} training samples (reward mean {data.mean_score:.3f}), "
        f"{len(data.eval_prompts)} eval prompts per process; {total_steps} optimizer steps"
    )
    model, optimizer, scheduler = load_model(args, accelerator, total_steps)
    vocab = accelerator.unwrap_model(model).lm.config.vocab_size
    logit_mask = LogitMask.from_file(args.logit_mask, vocab) if args.logit_mask else None
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
    first_eval, start_time = evaluate(args, accelerator, model, tokenizer, logit_mask, data, logger, start_step), time.time()
    first_eval = resumed.get("first_eval", first_eval)  # after a resume the summary compares with the run's start
    model.train()
    progress = tqdm(range(start_step, total_steps), disable=not accelerator.is_local_main_process, desc="ilql")
    for step in progress:
        # 1. the ILQL loss (V's expectile, Q's TD, CQL, AWAC) of each micro-batch, accumulated into one optimizer step
        for micro in range(args.gradient_accumulation_steps):
            batch = micro_batch(
                args, accelerator, tokenizer, data.samples, steps_per_epoch, step * args.gradient_accumulation_steps + micro
            )
            actions_here = batch["dones"][:, :-1].sum()  # every term is a mean over the global batch's actions:
            share = actions_here * accelerator.num_processes / accelerator.reduce(actions_here, "sum").clamp(min=1)
            with accelerator.accumulate(model):
                actions = batch["input_ids"].gather(1, batch["actions_ixs"] + 1)  # the token each action emits
                logits, qs, target_qs, vs = model(
                    batch["input_ids"], batch["attention_mask"], batch["states_ixs"], batch["actions_ixs"], actions
                )
                loss, metrics = ilql_loss(
                    logits, qs, target_qs, vs, actions, batch["rewards"], batch["dones"], args.gamma, args.tau,
                    args.cql_scale, args.awac_scale, args.awac_beta,
                )  # fmt: skip
                metrics = {k: v * share for k, v in metrics.items()}  # so the ranks' mean below is the pooled mean
                accelerator.backward(loss * share)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        # 2. the target Q heads follow the online ones (Polyak averaging)
        if (step + 1) % args.steps_for_target_q_sync == 0:
            accelerator.unwrap_model(model).sync_target_q_heads(args.alpha)

        # 3. bookkeeping: one collective and one device sync for all the metrics
        norm = plain(grad_norm) if grad_norm is not None else 0.0
        metrics["losses/grad_norm"] = torch.as_tensor(norm, device=accelerator.device).float()
        metrics = dict(zip(metrics, accelerator.reduce(torch.stack(list(metrics.values())), "mean").tolist()))
        check_finite(step + 1, {k: metrics[k] for k in ("losses/loss", "losses/grad_norm")})
        logger.log(metrics | {"train/learning_rate": scheduler.get_last_lr()[0]}, step + 1)
        progress.set_postfix(loss=f"{metrics['losses/loss']:.3f}", adv=f"{metrics['values/advantage']:.3f}")
        if (step + 1) % args.eval_steps == 0 and step + 1 < total_steps:
            evaluate(args, accelerator, model, tokenizer, logit_mask, data, logger, step + 1)
        if args.save_steps and (step + 1) % args.save_steps == 0:
            folder = os.path.join(f"{args.output_dir}_checkpoints", f"step_{step + 1}")
            state = {"step": step + 1, "first_eval": first_eval}
            save_checkpoint(accelerator, folder, state, total_limit=args.save_total_limit)

    # 4. the final evaluation, save and summary
    last_eval = evaluate(args, accelerator, model, tokenizer, logit_mask, data, logger, total_steps)
    save(args, accelerator, model, tokenizer, last_eval)
    beta_key = f"eval/reward_beta_{args.gen_beta:g}"
    accelerator.print(
        f"ilql: {total_steps - start_step} steps in {time.time() - start_time:.0f}s; eval reward beta=0 "
        f"{first_eval['eval/reward_beta_0']:.3f} -> {last_eval['eval/reward_beta_0']:.3f}, beta={args.gen_beta:g} "
        f"{first_eval[beta_key]:.3f} -> {last_eval[beta_key]:.3f}; model saved to {args.output_dir}"
    )
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
