"""Verifiable tasks and reward functions, shared by the scripts that sample and score completions (grpo.py, rloo.py,
ppo.py with --reward-funcs, gkd.py's evaluation): the file to read before writing a reward function of your own.

A task is a list of rows: a `prompt` (text, or chat messages), its reference `answer`, and any other column, which
reaches every reward function by name. A reward function follows TRL 1.x's contract: called with keywords
`prompts`, `completions`, `completion_ids` and the columns, it returns one float per completion (None: this one cannot
be scored). For conversational prompts, prompts are message lists and each completion is
[{"role": "assistant", "content": text}], as TRL's GRPOTrainer passes them; otherwise both are text. `ended` (the
completion ended with EOS) comes too. A reward function is a built-in (`verifier`, `format`, `r1_format`), a function
in your own file (`my_rewards.py:brevity`), or a trained sequence classifier (`RewardModel`; ppo.py's
`RewardAdapter`: a LoRA reward adapter on the policy's own base model).
"""

import contextlib
import json
import math
import numbers
import os
import re
from types import SimpleNamespace

import numpy as np
import torch
from safetensors.torch import load_file

from common.chat import is_conversation, render, text_of, use_chat
from common.core import UsageError
from common.loading import (
    answers_as_text,
    check_columns,
    context_length,
    load_data,
    load_function,
    load_tokenizer,
    plugin_error,
    reward_model_text,
    train_eval_split,
)
from common.models import REWARD_NORMALIZATION_FILE, load_reward_model, peft_model_of, place_frozen

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion, numeric: bool = True) -> str:
    """The answer in a completion: the text inside its last <answer>...</answer> when it has one; else, for a task with a
    numeric answer, the last number in it (chat models write "3 + 4 = 7" or "The answer is 7"); else its first line."""
    text = text_of(completion)
    tagged = ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    if numeric:
        numbers = NUMBER.findall(text)
        return numbers[-1] if numbers else text.strip()
    return text.strip().split("\n")[0].strip()


def is_number(text) -> bool:
    return NUMBER.fullmatch(str(text).strip()) is not None


def verifier(prompts, completions, answer, **columns) -> list[float | None]:
    """1 for a completion whose answer (`extract_answer`, by the last-number rule where the reference answer is a number)
    the task accepts: reasoning-gym's own `score_answer` for a reasoning-gym task (in [0, 1]; a `rg_entry` column
    carries the problem), else an exact match with the answer."""
    answers = [extract_answer(c, is_number(a)) for c, a in zip(completions, answer)]
    if "rg_entry" not in columns:
        return [float(x == str(a).strip()) for x, a in zip(answers, answer)]
    import reasoning_gym

    scores = []
    for x, entry in zip(answers, columns["rg_entry"]):
        entry = json.loads(entry)
        scores.append(float(reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])(x, entry)))
    return scores


def format_reward(prompts, completions, ended, **columns) -> list[float | None]:
    """1 for a completion that is one non-empty line and ends with EOS (a clean, parseable answer), else 0."""
    return [float(e and bool(text_of(c).strip()) and "\n" not in text_of(c).strip()) for c, e in zip(completions, ended)]


def r1_format_reward(prompts, completions, **columns) -> list[float | None]:
    """1 for a completion of DeepSeek-R1's form "<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>" (open-r1's and
    TRL's recipe `format_reward`), else 0."""
    form = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
    return [float(form.match(text_of(c).strip()) is not None) for c in completions]


REWARD_FUNCS = {"verifier": verifier, "format": format_reward, "r1_format": r1_format_reward}


def resolve_reward(spec: str):
    """A built-in reward function by name, or the function named by "module:function" or "file.py:function"
    (`common.loading.load_function`: a module that fails to import is a one-line error naming your file and line)."""
    return load_function(spec, REWARD_FUNCS, "--reward-funcs")


class RewardModel:
    """A trained sequence classifier as a reward (`common.models.load_reward_model`): its `label` logit on the text
    reward_modeling.py trains on (`reward_model_text`: the rendered chat, or "prompt response<eos>", EOS only after a
    response that ended), in batches of `batch_size`. `device`: where it runs now; `place` puts it where the run's
    accelerator wants it (sharded like the policy under FSDP2 / ZeRO-3) and scores under the run's autocast. Called as
    a reward function (TRL 1.x's keywords), or by `scores` on texts."""

    def __init__(self, name: str, label=None, dtype="float32", chat: bool = True, batch_size: int = 64, device=None):
        self.name, self.chat, self.batch_size, self.accelerator = name, chat, batch_size, None
        self.model, self.tokenizer, self.index = load_reward_model(name, label, dtype)
        self.model = self.model.to(device) if device is not None else self.model

    def place(self, accelerator) -> None:
        self.model, self.accelerator = place_frozen(accelerator, self.model), accelerator

    def check_context(self, rows: list[dict], policy_tokenizer, new_tokens: int, fix: str) -> None:
        """A one-line error when the longest prompt plus `new_tokens` would pass the reward model's context (a BERT-style
        one reads 512 tokens); responses are counted in policy tokens, an estimate. `fix`: the flags that shorten them."""
        context = context_length(self.model.config)
        if not context:
            return
        if self.chat:  # the rendered chat prompts, as the reward model reads them
            prompts = [reward_model_text(self.tokenizer, r["prompt"], "", False, True) for r in rows]
        else:
            prompts = [policy_tokenizer.decode(r["prompt_ids"], skip_special_tokens=True) for r in rows]
        longest = max(len(ids) for ids in self.tokenizer(prompts, add_special_tokens=not self.chat)["input_ids"])
        if longest + new_tokens + 1 > context:
            raise UsageError(
                f"Queries of up to {longest} reward-model tokens plus {new_tokens} response tokens exceed the reward "
                f"model's context of {context}: {fix}."
            )

    @torch.no_grad()
    def scores(self, prompts: list, responses: list[str], ended: list[bool]) -> torch.Tensor:
        """Rewards [N] (float32, on the CPU) of `responses` to `prompts` (text, or chat messages)."""
        texts = [reward_model_text(self.tokenizer, p, r, e, self.chat) for p, r, e in zip(prompts, responses, ended)]
        placed = self.accelerator is not None
        device = self.accelerator.device if placed else next(self.model.parameters()).device
        autocast = self.accelerator.autocast() if placed else contextlib.nullcontext()
        scores = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[i : i + self.batch_size], padding=True, add_special_tokens=not self.chat, return_tensors="pt"
            )
            with autocast:
                scores.append(self.model(**batch.to(device)).logits[:, self.index].float().cpu())
        return torch.cat(scores)

    def __call__(self, prompts, completions, ended, **columns) -> list[float]:
        return self.scores(prompts, [text_of(c) for c in completions], ended).tolist()


class RewardAdapter(RewardModel):
    """TRL's multi-adapter RL: the LoRA reward adapter and score head that `reward_modeling.py --use-peft` saves, loaded
    as a second, frozen adapter of the peft policy, so one copy of the base weights serves policy, reference (adapters
    off) and reward model; it scores as a `RewardModel` does. Load it before the model is wrapped for distributed
    training, and `place` it with the prepared policy."""

    def __init__(self, model, path: str, base_model_name: str, chat: bool = True, batch_size: int = 64, name="reward"):
        peft_model = peft_model_of(model)
        if peft_model is None:
            raise UsageError("A reward adapter is loaded onto the policy's LoRA base model: add --use-peft.")
        with open(os.path.join(path, "adapter_config.json")) as f:
            base = json.load(f)["base_model_name_or_path"]
        canonical = lambda name: os.path.realpath(name) if os.path.exists(name) else name  # noqa: E731 - a folder's real path
        if canonical(base) != canonical(base_model_name):
            raise UsageError(
                f"The reward adapter {path} was trained on {base}, the policy is {base_model_name}: "
                "they must share the base model (or use --reward-model with a full reward model)."
            )
        peft_model.load_adapter(path, name, is_trainable=False)
        weights = load_file(os.path.join(path, "adapter_model.safetensors"))
        score = {k.rsplit(".", 1)[1]: v for k, v in weights.items() if ".score." in k}
        if "weight" not in score:
            raise UsageError(f"{path} holds no score head: save the reward adapter with task_type SEQ_CLS.")
        self.score = torch.nn.Linear(score["weight"].shape[1], 1, bias="bias" in score).to(score["weight"])
        self.score.load_state_dict(score)
        self.score.requires_grad_(False)
        self.gain, self.bias = 1.0, 0.0
        normalization = os.path.join(path, REWARD_NORMALIZATION_FILE)  # reward_modeling.py --normalize-reward
        if os.path.isfile(normalization):
            with open(normalization) as f:
                stats = json.load(f)
            self.gain, self.bias = stats["gain"], stats["bias"]
        self.name, self.policy_adapter, self.policy = name, peft_model.active_adapter, model
        self.chat, self.batch_size, self.accelerator, self.index = chat, batch_size, None, 0
        self.tokenizer = load_tokenizer(base_model_name, padding_side="right")
        self.model = lambda **batch: SimpleNamespace(logits=self.forward(self.policy, **batch))  # RewardModel.scores'

    def place(self, accelerator, policy) -> None:
        self.accelerator, self.policy, self.score = accelerator, policy, self.score.to(accelerator.device)

    @torch.no_grad()
    def forward(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores [B, 1] at each sequence's last real token, with the reward adapter on for this pass only (TRL's
        `compute_reward_score`)."""
        peft_model = peft_model_of(model)
        peft_model.set_adapter(self.name)
        try:
            hidden = peft_model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1
            ).hidden_states[-1]
        finally:
            peft_model.set_adapter(self.policy_adapter)  # also makes the policy adapter the trainable one again
        last = (torch.arange(input_ids.shape[1], device=input_ids.device) * attention_mask).argmax(1)
        scores = self.score(hidden[torch.arange(len(hidden)), last].to(self.score.weight.dtype))
        return scores * self.gain + self.bias


def check_rewards(values, n: int, name: str) -> list[float]:
    """One number (or None) per completion, as floats with NaN for None; what reward functions naturally return is
    accepted (a list or tuple of Python or NumPy numbers, a NumPy array, a tensor); a one-line error otherwise."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise UsageError(
            f"reward function {name} returned {type(values).__name__} of length "
            f"{len(values) if hasattr(values, '__len__') else '?'} for {n} completions: return a list with "
            "one float (or None) each."
        )
    values = [v.item() if isinstance(v, (torch.Tensor, np.generic)) and np.size(v) == 1 else v for v in values]
    bad = [v for v in values if v is not None and not (isinstance(v, numbers.Real) and math.isfinite(v))]
    if bad:
        raise UsageError(f"reward function {name} returned {bad[0]!r}: every reward must be a finite number or None.")
    return [math.nan if v is None else float(v) for v in values]


def score_completions(
    reward_funcs, rows: list[dict], completions, completion_ids, ended, device, environments=None
) -> torch.Tensor:
    """Rewards [N, F] of each completion (text, or an episode's messages) by each (name, function) in `reward_funcs`,
    NaN where a function returned None, called with TRL 1.x's keywords (see the module docstring), `ended`, and the
    episodes' `environments` when there are some."""
    prompts = [r["prompt"] for r in rows]
    if is_conversation(prompts[0]) and isinstance(completions[0], str):  # TRL: conversational completions are messages
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "prompt_ids", "completion", "completion_ids")}
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, ended=ended, **columns)
    if environments is not None:
        kwargs["environments"] = environments
    rewards = []
    for name, function in reward_funcs:
        try:
            values = function(**kwargs)
        except Exception as error:  # noqa: BLE001 - the user's code: report it, whatever it raised
            raise UsageError(f"reward function {name} raised {plugin_error(error)}") from None
        rewards.append(check_rewards(values, len(rows), name))
    return torch.tensor(rewards, device=device).T if rewards else torch.zeros(len(rows), 0, device=device)


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


def load_task(
    args, tokenizer, prompt_column: str, max_prompt_length: int | None, tools=None
) -> tuple[list[dict], list[dict], bool]:
    """Training and held-out rows of a task: reasoning-gym:<task> (`train_size` problems drawn from `data_seed`, else
    `seed`, and `eval_size` distinct held-out ones from that seed + 1), or a dataset with a prompt and an answer column
    (`eval_fraction` held out, split by the same seed). No held-out problem occurs in training: training rows that
    repeat one (its prompt and its answer) are dropped. Prompts go through the chat template (`use_chat`: messages, or
    strings with `chat_template` for a tokenizer that has one; then a reasoning-gym question becomes a user message
    ending with `task_instruction`); each row gets the token ids of its rendered prompt (`prompt_ids`, with
    `system_prompt` and the `tools` schemas), the last `max_prompt_length` kept (None: all). Also returns whether
    prompts are chats. `args` holds those fields and dataset_name, task_config, dataset_split, answer_column (the
    scripts' names)."""
    dataset_name, eval_size, chat_template = args.dataset_name, args.eval_size, args.chat_template
    seed = args.seed if getattr(args, "data_seed", None) is None else args.data_seed
    if dataset_name.startswith("reasoning-gym:"):
        task = dataset_name.split(":", 1)[1]
        try:
            config = json.loads(args.task_config)
        except json.JSONDecodeError as error:
            raise UsageError(f"--task-config {args.task_config!r} is not JSON ({error.msg}).") from None
        train_rows, eval_rows = reasoning_gym_rows(task, config, args.train_size, seed), []
        for row in reasoning_gym_rows(task, config, 10 * eval_size, seed + 1):  # the first eval_size distinct questions
            if len(eval_rows) < eval_size and row["prompt"] not in {r["prompt"] for r in eval_rows}:
                eval_rows.append(row)
        chat = use_chat(tokenizer, chat_template, train_rows[0]["prompt"], args.system_prompt)
        if chat:
            for row in train_rows + eval_rows:
                row["prompt"] = [{"role": "user", "content": f"{row['prompt']} {args.task_instruction}".strip()}]
    else:
        dataset = load_data(dataset_name, args.dataset_split)
        check_columns(
            dataset, [prompt_column], f"--{prompt_column.replace('_', '-')}", prompts=(prompt_column,), source=dataset_name
        )
        dataset = answers_as_text(dataset, args.answer_column)
        check_columns(dataset, [args.answer_column], "--answer-column", chat=False)
        dataset = dataset.rename_columns({prompt_column: "prompt", args.answer_column: "answer"})
        train_data, eval_data = train_eval_split(dataset, args.eval_fraction, seed)
        train_rows, eval_rows = train_data.to_list(), eval_data.to_list()
        chat = use_chat(tokenizer, chat_template, train_rows[0]["prompt"], args.system_prompt)
    problem = lambda r: json.dumps([r["prompt"], r["answer"]])  # noqa: E731 - an environment's rows share one prompt
    held_out = {problem(r) for r in eval_rows}
    train_rows = [r for r in train_rows if problem(r) not in held_out]
    if not train_rows:
        raise UsageError(
            f"every training problem also occurs among the {len(eval_rows)} held-out ones: lower --eval-size or draw "
            "more problems (--train-size, --task-config)"
        )
    for row in train_rows + eval_rows:
        row["prompt_ids"] = prompt_ids(tokenizer, row["prompt"], chat, args.system_prompt, max_prompt_length, tools)
    return train_rows, eval_rows, chat


def prompt_ids(tokenizer, prompt, chat: bool, system_prompt=None, max_length: int | None = None, tools=None) -> list[int]:
    """The token ids of a prompt, rendered by the chat template (with `system_prompt` and the `tools` schemas) when
    `chat`, its last `max_length` kept (None: all). With tools, a prompt that would lose its first tokens (the tool
    schemas) is a one-line error instead."""
    text = render(tokenizer, prompt, system_prompt=system_prompt, tools=tools)[0] if chat else prompt
    ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
    if tools and max_length and len(ids) > max_length:
        raise UsageError(
            f"a prompt with the tool schemas takes {len(ids)} tokens, over --max-prompt-length {max_length}: raise it"
        )
    return ids[-max_length:] if max_length else ids


def load_rewards(specs: list[str], rows: list[dict], device, chat: bool, reward_model=None, label=None, dtype="float32"):
    """(name, function) for each of `specs` (--reward-funcs) and `reward_model` (a name), each tried on two real rows
    first, so that a wrong length or a non-number fails before any generation."""
    reward_funcs = [(spec, resolve_reward(spec)) for spec in specs]
    if reward_model is not None:
        reward_funcs.append(("reward_model", RewardModel(reward_model, label, dtype, chat, device=device)))
    score_completions(reward_funcs, rows[:2], [" 0", " 1"], [[15], [16]], [True, False], device)
    return reward_funcs


def distinct_answers(completions: list[str], numeric: bool) -> tuple[float, int]:
    """The share of the most frequent extracted answer, and the number of distinct answers: an RL run that collapses onto
    a few answers shows here."""
    answers = [extract_answer(c, numeric) for c in completions]
    counts = np.unique(answers, return_counts=True)[1]
    return counts.max() / len(answers), len(counts)


def distinct_bigrams(texts: list[str]) -> float:
    """Distinct word bigrams over all responses / all bigrams (distinct-2, Li et al. 2016): low when many responses
    repeat one phrase, even where each response is varied within itself."""
    bigrams = [pair for text in texts for pair in zip(text.split(), text.split()[1:])]
    return len(set(bigrams)) / max(1, len(bigrams))


def degenerate_batch(lengths: torch.Tensor, ended: torch.Tensor, rewards: torch.Tensor, mask_truncated: bool) -> list[str]:
    """Why a generation batch (every process's: completion lengths with their EOS, whether each ended, the rewards) has
    nothing to learn from, if it has nothing: every completion empty, no completion scored, every completion cut while
    --mask-truncated-completions leaves cut ones out of the loss."""
    reasons = [
        (bool((lengths <= ended.float()).all()), "every completion is empty"),
        (bool(rewards.isnan().all()), "no reward function scored any completion (all returned None)"),
        (mask_truncated and not bool(ended.any()), "every completion was cut and --mask-truncated-completions drops them"),
    ]
    return [why for hit, why in reasons if hit]
