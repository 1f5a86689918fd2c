import math
import os
import re

import pytest
import torch
from conftest import RANDOM_MODEL, ROOT, check_model_card, run_failing, run_script
from transformers import AutoModelForCausalLM

from common.loading import load_pretrained, load_tokenizer
from ilql import CausalLMWithILQLHeads, advantage_logits, ilql_loss, tokenize_sample

ILQL = os.path.join(ROOT, "ilql.py")
TINY = [*RANDOM_MODEL, "--batch-size", "4", "--max-length", "24", "--max-new-tokens", "4", "--eval-samples", "4"]


def reference_ilql_loss(logits, qs, target_qs, vs, actions, rewards, n_actions, gamma, tau, cql_scale, awac_scale, beta):
    """The ILQL terms written out action by action (Snell et al. 2022), for samples with n_actions[b] real actions."""
    loss_q = loss_v = loss_cql = loss_awac = 0.0
    for b, n in enumerate(n_actions):
        for t in range(n):
            a = actions[b, t].item()
            target_q = min(tq[b, t].item() for tq in target_qs)
            v = vs[b, t].item()
            v_next = vs[b, t + 1].item() if t + 1 < n else 0.0  # the last action leads to the terminal state
            for q in qs:
                loss_q += (q[b, t, a].item() - (rewards[b, t].item() + gamma * v_next)) ** 2
                loss_cql += -q[b, t].log_softmax(-1)[a].item()
            loss_v += (tau if target_q >= v else 1 - tau) * (target_q - v) ** 2
            loss_awac += -logits[b, t].log_softmax(-1)[a].item() * math.exp(beta * (target_q - v))
    total = sum(n_actions)
    return {
        "losses/loss_q": loss_q / total,
        "losses/loss_v": loss_v / total,
        "losses/loss_cql": loss_cql / total,
        "losses/loss_awac": loss_awac / total,
        "losses/loss": (loss_q + loss_v + cql_scale * loss_cql + awac_scale * loss_awac) / total,
    }


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_ilql_loss_matches_the_terms_written_out(beta):
    torch.manual_seed(0)
    B, N, V = 2, 3, 5  # sample 0: 3 actions; sample 1: 1 action, then padding
    logits, vs = torch.randn(B, N, V), torch.randn(B, N + 1)
    qs, target_qs = [torch.randn(B, N, V) for _ in range(2)], [torch.randn(B, N) for _ in range(2)]
    actions = torch.tensor([[0, 4, 2], [1, 3, 3]])
    rewards = torch.tensor([[0.0, 0.0, 1.5], [-0.7, 9.0, 9.0]])  # padded rewards must not count
    dones = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    vs[1, 2:] = 100.0  # padded states must not count either
    loss, stats = ilql_loss(
        logits, qs, target_qs, vs, actions, rewards, dones, gamma=0.9, tau=0.7, cql_scale=0.1, awac_scale=1.0, awac_beta=beta
    )
    expected = reference_ilql_loss(logits, qs, target_qs, vs, actions, rewards, [3, 1], 0.9, 0.7, 0.1, 1.0, beta)
    for key, value in expected.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-5), key
    assert loss.item() == pytest.approx(expected["losses/loss"], rel=1e-5)


def test_expectile_asymmetry_and_two_q_minimum():

    def one(x):  # one action, a vocabulary of one token
        return torch.tensor([[[x]]])

    common = dict(
        actions=torch.tensor([[0]]),
        rewards=torch.zeros(1, 1),
        dones=torch.tensor([[1, 0]]),
        gamma=1.0,
        tau=0.9,
        cql_scale=0.0,
        awac_scale=0.0,
    )
    # target Qs 1 and 3: the minimum, 1, is what V regresses on

    def target(x):
        return torch.tensor([[x]])

    _, below = ilql_loss(one(0.0), [one(0.0)], [target(1.0), target(3.0)], torch.tensor([[0.0, 5.0]]), **common)
    _, above = ilql_loss(one(0.0), [one(0.0)], [target(3.0), target(1.0)], torch.tensor([[2.0, 5.0]]), **common)
    assert below["losses/loss_v"].item() == pytest.approx(0.9 * 1.0)  # V under Q: weight tau
    assert above["losses/loss_v"].item() == pytest.approx(0.1 * 1.0)  # V over Q: weight 1 - tau
    # the next state is terminal: Q regresses on the reward alone, not on V(next) = 5
    assert below["losses/loss_q"].item() == pytest.approx(0.0)


def test_target_heads_move_by_alpha_and_files_round_trip(tmp_path):
    model = CausalLMWithILQLHeads(load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM))
    with torch.no_grad():
        for p in model.q_heads.parameters():
            p.add_(1.0)  # online != target
    online = [p.clone() for p in model.q_heads.parameters()]
    before = [p.clone() for p in model.target_q_heads.parameters()]
    model.sync_target_q_heads(0.25)
    for target, o, b in zip(model.target_q_heads.parameters(), online, before):
        torch.testing.assert_close(target, 0.25 * o + 0.75 * b)
        assert not target.requires_grad
    # the forward pass: logits at the action positions, target Qs of exactly the taken tokens
    ids = torch.tensor([[464, 3797, 3332, 319, 262]])
    actions_ixs, actions = torch.tensor([[1, 2, 3]]), ids[:, 2:]
    logits, qs, target_qs, vs = model(ids, torch.ones_like(ids), torch.tensor([[1, 2, 3, 4]]), actions_ixs, actions)
    with torch.no_grad():
        torch.testing.assert_close(logits, model.lm(ids).logits[:, 1:4])
        hidden = model.lm(ids, output_hidden_states=True).hidden_states[-1]
        for head, target_q in zip(model.target_q_heads, target_qs):
            torch.testing.assert_close(target_q, head(hidden[:, 1:4]).gather(-1, actions[..., None]).squeeze(-1))
        torch.testing.assert_close(vs, model.v_head(hidden[:, 1:5]).squeeze(-1))
    model.save_pretrained(str(tmp_path))
    loaded = CausalLMWithILQLHeads.from_pretrained(str(tmp_path))
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    assert isinstance(AutoModelForCausalLM.from_pretrained(str(tmp_path)), torch.nn.Module)


def test_advantage_logits_formula():
    torch.manual_seed(0)
    logits, q1, q2, v = torch.randn(2, 7), torch.randn(2, 7), torch.randn(2, 7), torch.randn(2)
    expected = logits.log_softmax(-1) + 3.0 * (torch.minimum(q1, q2) - v[:, None])
    torch.testing.assert_close(advantage_logits(logits, [q1, q2], v, 3.0), expected)
    torch.testing.assert_close(advantage_logits(logits, [q1], v, 0.0), logits.log_softmax(-1))


def test_tokenize_sample_positions_and_truncation():
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    sample = tokenize_sample(tokenizer, "Hello there", " how are you", 64)
    prompt, response = tokenizer("Hello there")["input_ids"], tokenizer(" how are you")["input_ids"]
    assert sample["input_ids"] == prompt + response + [tokenizer.eos_token_id]
    # action k is taken from position p + k - 1 and emits token p + k
    assert sample["actions_ixs"] == list(range(len(prompt) - 1, len(sample["input_ids"]) - 1))
    assert sample["states_ixs"] == sample["actions_ixs"] + [len(sample["input_ids"]) - 1]
    assert sample["dones"] == [1] * len(sample["actions_ixs"]) + [0]
    short = tokenize_sample(tokenizer, "Hello there", " how are you", 4)  # the prompt keeps one token
    assert short["input_ids"] == prompt[-1:] + response[:3] and len(short["actions_ixs"]) == 3
    assert tokenize_sample(tokenizer, None, "hi", 8)["input_ids"][0] == tokenizer.bos_token_id


@pytest.mark.slow
def test_smoke_resume_and_saved_model(tmp_path):
    straight_out = run_script([ILQL, *TINY, "--max-steps", "4", "--save-steps", "2", "--output-dir", "straight"], tmp_path)
    out = run_script(
        [
            ILQL,
            *TINY,
            "--max-steps",
            "4",
            "--resume-from",
            str(tmp_path / "straight_checkpoints" / "step_2"),
            "--output-dir",
            "resumed",
        ],
        tmp_path,
    )
    assert "resumed from" in out and re.search(r"ilql: 2 steps .* eval reward beta=0 ", out)
    first_last = re.compile(r" steps in .*?(eval [^;]*);")  # the run's first evaluation comes from the checkpoint
    assert first_last.findall(out) == first_last.findall(straight_out) and first_last.findall(out)
    check_model_card(tmp_path / "resumed", "ilql")
    straight = CausalLMWithILQLHeads.from_pretrained(str(tmp_path / "straight"))
    resumed = CausalLMWithILQLHeads.from_pretrained(str(tmp_path / "resumed"))
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    assert "raise --max-steps" in run_failing(
        [ILQL, *TINY, "--max-steps", "2", "--resume-from", str(tmp_path / "straight_checkpoints" / "step_2")], tmp_path
    )


def test_text_reward_data_peft_and_bad_input(tmp_path):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(f'{{"text": "I really like sample {i}", "score": {i % 3}}}\n' for i in range(40)))
    out = run_script(
        [
            ILQL,
            *TINY,
            "--max-steps",
            "2",
            "--dataset-name",
            str(data),
            "--prompt-column",
            "None",
            "--response-column",
            "text",
            "--reward-column",
            "score",
            "--use-peft",
            "--lora-r",
            "4",
        ],
        tmp_path,
    )
    assert "ilql: 2 steps" in out
    assert "no column ['reward']" in run_failing(
        [
            ILQL,
            *RANDOM_MODEL,
            "--overwrite",
            "--dataset-name",
            str(data),
            "--prompt-column",
            "None",
            "--response-column",
            "text",
            "--reward-column",
            "reward",
        ],
        tmp_path,
    )
    assert "exceeds the model's context of 256" in run_failing(
        [ILQL, *RANDOM_MODEL, "--max-length", "250", "--overwrite"], tmp_path
    )  # + 12 new
    data.write_text("".join(f'{{"text": "x {i}", "score": NaN}}\n' for i in range(40)))
    assert "NaN" in run_failing(
        [
            ILQL,
            *RANDOM_MODEL,
            "--overwrite",
            "--dataset-name",
            str(data),
            "--prompt-column",
            "None",
            "--response-column",
            "text",
            "--reward-column",
            "score",
        ],
        tmp_path,
    )


def test_long_eval_prompts_keep_their_last_max_length_tokens(tmp_path):
    """Prompts of ~300 tokens (the tiny model's context is 256) are cut to their last max_length tokens for
    evaluation, as in training, or the position embeddings run out."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(f'{{"prompt": "{"word " * 300}question {i}?", "completion": " fine"}}\n' for i in range(40)))
    out = run_script([ILQL, *TINY, "--max-steps", "1", "--dataset-name", str(data), "--eval-fraction", "0.1"], tmp_path)
    assert "ilql: 1 steps" in out


def test_logit_mask_restricts_generation(tmp_path, positive_mask_file):
    """trlX's logit mask in generation: every token may only be followed by " good", " great", " happy" or " love",
    so even the untrained model's replies score high with VADER (about 0 without the mask), at beta 0 and 4."""
    out = run_script([ILQL, *TINY, "--max-steps", "1", "--logit-mask", positive_mask_file], tmp_path)
    behaviour, steered = map(float, re.search(r"beta=0 \S+ -> (-?[\d.]+), beta=4 \S+ -> (-?[\d.]+)", out).groups())
    assert behaviour > 0.5 and steered > 0.5, out[-3000:]


@pytest.mark.slow
def test_advantage_steering_prefers_the_rewarded_answer(tmp_path):
    """Half the answers are " yes" (reward 1), half " no" (reward 0): the behaviour policy says yes about half the
    time, the advantage-shifted policy (beta = 4) should mostly say yes. Eval scores with VADER: yes 0.40, no -0.30.
    Measured: beta=0 -0.023, beta=4 0.402 after 4 epochs."""
    import json
    import random

    rng = random.Random(0)
    with open(tmp_path / "yesno.jsonl", "w") as f:
        for i in range(320):
            yes = rng.random() < 0.5
            f.write(
                json.dumps(
                    {"prompt": f"Question {i}: do you agree?", "completion": " yes" if yes else " no", "reward": float(yes)}
                )
                + "\n"
            )
    out = run_script(
        [
            ILQL,
            *RANDOM_MODEL,
            "--dataset-name",
            "yesno.jsonl",
            "--reward-column",
            "reward",
            "--eval-fraction",
            "0.2",
            "--num-epochs",
            "4",
            "--batch-size",
            "16",
            "--max-new-tokens",
            "4",
            "--eval-steps",
            "1000",
        ],
        tmp_path,
    )
    behaviour, steered = map(float, re.search(r"beta=0 \S+ -> (-?[\d.]+), beta=4 \S+ -> (-?[\d.]+)", out).groups())
    assert steered > behaviour + 0.15, out[-3000:]
