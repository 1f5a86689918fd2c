"""Verifiable tasks and reward functions, shared by the scripts that sample and score completions (grpo.py, rloo.py).

A task is a list of rows: a `prompt`, its reference `answer`, and any other column, which reaches every reward function
by name. A reward function is a plain callable `(prompts, completions, **columns) -> list[float | None]` (TRL 1.x's
contract; None: this completion cannot be scored): a built-in (`verifier`, `format`), a function in your own file
(`my_rewards.py:brevity`), or a trained sequence classifier (`reward_model_function`).
"""

import importlib
import importlib.util
import json
import math
import os

import torch

from common.core import UsageError
from common.loading import check_columns, load_data, load_tokenizer, reward_model_text, train_eval_split
from common.models import load_reward_model


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


def score_completions(reward_funcs, rows: list[dict], completions: list[str], ended: list[bool], device) -> torch.Tensor:
    """Rewards [N, F] of each completion by each (name, function) in `reward_funcs`, NaN where a function returned
    None. Every column of the rows but the prompt reaches the functions by name, and `ended` (the completion ended
    with EOS) too."""
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "prompt_ids")}
    prompts = [r["prompt"] for r in rows]
    return torch.tensor(
        [check_rewards(f(prompts, completions, ended=ended, **columns), len(rows), name) for name, f in reward_funcs],
        device=device,
    ).T


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


def load_task(args, tokenizer) -> tuple[list[dict], list[dict], float]:
    """Training and held-out rows of `args.dataset_name` (reasoning-gym:<task>, or a dataset with a prompt and an answer
    column), each with its prompt's token ids (the last `max_prompt_length`), and the share of held-out prompts that
    also occur in training. Reads args.dataset_name, task_config, train_size, eval_size, seed, dataset_split,
    prompt_column, answer_column, eval_fraction, eval_samples, max_prompt_length."""
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
    return train_rows, eval_rows, overlap


def load_rewards(args, rows: list[dict], device) -> list:
    """(name, function) for each of --reward-funcs and --reward-model, each tried on two real rows first, so that a wrong
    length or a non-number fails before any generation."""
    reward_funcs = [(spec, resolve_reward(spec)) for spec in args.reward_funcs]
    if args.reward_model is not None:
        reward_funcs.append(("reward_model", reward_model_function(args.reward_model, args.reward_label, device, args.dtype)))
    probe = {k: [r[k] for r in rows[:2]] for k in rows[0] if k != "prompt_ids"}
    for spec, func in reward_funcs:
        columns = {k: v for k, v in probe.items() if k != "prompt"}
        check_rewards(func(probe["prompt"], [" 0", " 1"], ended=[True, False], **columns), 2, spec)
    return reward_funcs
