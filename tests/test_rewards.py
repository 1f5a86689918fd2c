"""common/rewards.py: answer extraction, the built-in reward functions under TRL 1.x's contract, reward checks, and the
held-out split of a task's distinct questions."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from common.rewards import (
    check_rewards,
    distinct_answers,
    distinct_bigrams,
    extract_answer,
    load_task,
    r1_format_reward,
    score_completions,
    verifier,
)


def test_answer_extraction_reads_what_chat_models_write():
    assert extract_answer("3 + 4 = 7") == "7"  # the last number, for a numeric answer
    assert extract_answer("The answer is -3.") == "-3"
    assert extract_answer("<answer>12</answer> (and not 13)") == "12"  # an answer tag wins
    assert extract_answer(" 7\nand then 9", numeric=False) == "7"  # non-numeric tasks: the first line
    assert extract_answer([{"role": "assistant", "content": "so 5"}]) == "5"  # TRL's conversational completion
    assert extract_answer("no number here") == "no number here"


def test_verifier_scores_text_and_messages_with_the_tasks_own_check():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=1, min_terms=2, max_terms=2, max_digits=1)[0]
    answer = entry["answer"]
    columns = dict(answer=[answer] * 4, rg_entry=[json.dumps(entry, default=str)] * 4)
    completions = [" " + answer, f" {int(answer) + 5}", f"The sum is {answer}.", f"{answer} is wrong, it is {int(answer) + 1}"]
    assert verifier(["q"] * 4, completions, **columns) == [1.0, 0.0, 1.0, 0.0]
    messages = [[{"role": "assistant", "content": c}] for c in completions]
    assert verifier(["q"] * 4, messages, **columns) == [1.0, 0.0, 1.0, 0.0]
    assert verifier(["q", "q"], [" 4", "4 "], answer=["4", "5"]) == [1.0, 0.0]  # exact match without reasoning-gym
    assert verifier(["q", "q"], ["Paris\nis big", "paris"], answer=["Paris", "Paris"]) == [1.0, 0.0]  # text: first line


def test_r1_format_reward_and_distinct_answers():
    good = "<think>\n3 plus 4\n</think>\n<answer>\n7\n</answer>"
    assert r1_format_reward(["q"] * 3, [good, "<answer>7</answer>", good + " extra"]) == [1.0, 0.0, 0.0]
    assert distinct_answers(["7", "it is 7", "8", "<answer>7</answer>"], numeric=True) == (0.75, 2)


def test_reward_checks_and_trl_keyword_contract():
    assert math.isnan(check_rewards([1, None, 0.5], 3, "f")[1])  # None -> NaN
    with pytest.raises(ValueError, match="length 2 for 3 completions"):
        check_rewards([1.0, 2.0], 3, "f")
    with pytest.raises(ValueError, match="returned 'high'"):
        check_rewards([1.0, "high", 2.0], 3, "f")
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kwargs):  # as TRL 1.x calls reward functions
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer, ended=kwargs["ended"])
        return [1.0, None]

    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "prompt_ids": [1]}] * 2
    rewards = score_completions([("spy", spy)], rows, ["4", "5"], [[9], [10]], [True, False], torch.device("cpu"))
    assert rewards.shape == (2, 1) and rewards[0, 0] == 1 and rewards[1, 0].isnan()
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["prompts"] == [rows[0]["prompt"]] * 2 and seen["answer"] == ["4", "4"] and seen["ids"] == [[9], [10]]


def test_held_out_problems_are_distinct_questions_never_seen_in_training():
    """One-digit two-term chain_sum has only 200 distinct problems: drawing train and held-out problems from two seeds
    makes most held-out ones training ones. The split holds out distinct questions and drops their training copies."""
    from common.loading import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    config = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    args = SimpleNamespace(dataset_name="reasoning-gym:chain_sum", seed=1, task_config=config, train_size=2000, eval_size=64)
    args.__dict__.update(chat_template=True, task_instruction="Give only the final answer.", system_prompt=None)
    train, held_out, chat = load_task(args, tokenizer, "prompt", 64)
    questions = {r["prompt"] for r in train}
    assert not chat and len(held_out) == 64 == len({r["prompt"] for r in held_out})
    assert not questions & {r["prompt"] for r in held_out} and len(questions) == 136 and len(train) > 1000
    assert all(r["prompt_ids"] == tokenizer(r["prompt"])["input_ids"] for r in held_out)


def test_the_data_seed_fixes_the_problems_while_the_seed_varies():
    """--data-seed (default --seed) draws the problems and the held-out split: with it fixed, another --seed trains and
    evaluates on the same problems (benchmarks/real_model.py --seeds relies on it); without it, the problems change."""
    from common.loading import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    config = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'

    def problems(**seeds):
        args = SimpleNamespace(dataset_name="reasoning-gym:chain_sum", task_config=config, train_size=200, eval_size=16)
        args.__dict__.update(chat_template=True, task_instruction="", system_prompt=None, **seeds)
        train, held_out, _ = load_task(args, tokenizer, "prompt", 64)
        return [r["prompt"] for r in train], [r["prompt"] for r in held_out]

    assert problems(seed=2, data_seed=1) == problems(seed=1) == problems(seed=1, data_seed=None)
    train, held_out = problems(seed=2)
    assert held_out != problems(seed=1)[1] and train != problems(seed=1)[0]


def test_distinct_bigrams_by_hand():
    # (a b) (b c) | (a b) (b d) | none: 3 distinct of 4; the same phrase everywhere: 1 of 3
    assert distinct_bigrams(["a b c", "a b d", "e"]) == 0.75
    assert abs(distinct_bigrams(["fine thanks"] * 3) - 1 / 3) < 1e-12
    assert distinct_bigrams(["", "one"]) == 0.0
