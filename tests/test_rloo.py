import math
import os
import re

import pytest
import torch
from conftest import ARITH as ARITHS
from conftest import (
    DDP_ENV,
    ROOT,
    check_dynamic_sampling,
    check_resume,
    ddp_launch,
    read_scalars,
    require,
    run_failing,
    run_script,
)
from transformers import AutoModelForCausalLM

from rloo import gdpo_scores, rloo_advantages, rloo_loss

RLOO = os.path.join(ROOT, "rloo.py")
ARITH = ARITHS["rloo"]


def test_rloo_advantages_by_hand():
    """Each reward minus the mean of the other k - 1 of its group; an unscorable reward (NaN) is in no baseline."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, math.nan, 1.0, 0.0])
    expected = [
        1 - 1 / 3,
        0 - 2 / 3,
        0.5 - 0.5,
        0.5 - 0.5,  # group 1: (0 + .5 + .5) / 3, (1 + .5 + .5) / 3, ...
        2 - 0.5,
        0.0,
        1 - 1.0,
        0 - 1.5,
    ]  # group 2: baselines over the 2 scorable others; NaN -> 0
    assert rloo_advantages(rewards, 4).tolist() == pytest.approx(expected)
    full = torch.tensor([3.0, 1.0, 0.0, 2.0])  # all scorable: k / (k - 1) * (r - group mean)
    assert rloo_advantages(full, 4).tolist() == pytest.approx([4 / 3 * (r - 1.5) for r in full.tolist()])
    assert rloo_advantages(torch.tensor([math.nan, 3.0]), 2).tolist() == [0.0, 0.0]  # no scorable sibling: 0
    kept = [a for a, r in zip(expected, rewards.tolist()) if not math.isnan(r)]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((a - mean) ** 2 for a in kept) / (len(kept) - 1))
    normalized = [(a - mean) / (std + 1e-4) if not math.isnan(r) else 0.0 for a, r in zip(expected, rewards.tolist())]
    assert rloo_advantages(rewards, 4, normalize=True).tolist() == pytest.approx(normalized)


def test_leave_one_out_baseline_is_zero_mean_and_removes_the_prompts_difficulty():
    """A completion's baseline leaves its own reward out (so it does not bias the gradient) and each group's
    advantages sum to 0. Prompts differ in difficulty (success rate 0.05 or 0.95, groups of 4): the raw rewards vary
    mostly between prompts (variance ~0.25), the advantages only within them (~0.05 * 0.95 * 4/3 = 0.063)."""
    generator = torch.Generator().manual_seed(0)
    success = torch.where(torch.rand(1000, generator=generator) < 0.5, 0.05, 0.95).repeat_interleave(4)
    rewards = (torch.rand(4000, generator=generator) < success).float()
    advantages = rloo_advantages(rewards, 4)
    assert advantages.view(-1, 4).sum(1).abs().max() < 1e-5
    assert rewards.var() > 0.2 and advantages.var() < 0.1


def test_rloo_loss_by_hand():
    logps = torch.tensor([-3.0, -5.0, -2.0], requires_grad=True)
    old = torch.tensor([-3.3, -4.8, -1.0])
    advantages = torch.tensor([1.0, -1.0, 2.0])
    loss, stats = rloo_loss(logps, old, advantages, 0.2, 0.2)
    by_hand = []
    for lp, o, a in zip(logps.tolist(), old.tolist(), advantages.tolist()):
        ratio = math.exp(lp - o)
        by_hand.append(-min(ratio * a, min(max(ratio, 0.8), 1.2) * a))
    assert loss.item() == pytest.approx(sum(by_hand) / 3)
    # ratio e^0.3 > 1.2 with A > 0: clipped above; e^-0.2 = 0.82 and e^-1 (A > 0) are not clipped
    # [count, sequences], pooled over mini-batches and processes by the loop
    assert stats["clip_ratio/high_mean"].tolist() == [1, 3] and stats["clip_ratio/low_mean"].tolist() == [0, 3]
    assert stats["clip_ratio/region_mean"].tolist() == [1, 3]
    loss.backward()
    assert logps.grad[0] == 0  # clipped: no gradient
    assert logps.grad[1].item() == pytest.approx(math.exp(-0.2) / 3)  # A < 0: descent lowers log p
    assert logps.grad[2].item() == pytest.approx(-2 * math.exp(-1.0) / 3)  # A > 0: raised
    _, stats = rloo_loss(logps, old, advantages, 0.2, 0.4)  # a wider upper clip range
    assert stats["clip_ratio/high_mean"].tolist() == [0, 3]


def test_bad_input_fails_before_generation(tmp_path):
    (tmp_path / "rewards.py").write_text("def nan(prompts, completions, **kw):\n    return [float('nan')] * len(prompts)\n")
    for flags, message in (
        (["--num-generations", "1"], "at least 2"),
        (["--batch-size", "3", "--mini-batch-size", "5"], "is not divisible by"),
        (["--dataset-name", "reasoning-gym:no_such_task"], "reasoning_gym.factory.DATASETS"),
        (["--reward-funcs", f"{tmp_path / 'rewards.py'}:nan"], "must be a finite number or None"),
        (["--reward-clip-range", "1", "0"], "min < max"),
    ):
        assert message in run_failing([RLOO, *ARITH, *flags], tmp_path), flags


TINY = [
    "--total-prompts",
    "8",
    "--batch-size",
    "4",
    "--num-generations",
    "2",
    "--mini-batch-size",
    "4",
    "--gradient-accumulation-steps",
    "2",
    "--eval-samples",
    "8",
    "--train-size",
    "64",
    "--eval-size",
    "8",
    "--log-freq",
    "1",
]


@pytest.mark.parametrize(
    "flags",
    [
        ["--reward-funcs", "verifier", "alternate.py:alternate", "--multi-objective-aggregation", "normalize_then_sum"],
        [
            "--normalize-advantages",
            "--num-iterations",
            "2",
            "--mask-truncated-completions",
            "--reward-funcs",
            "verifier",
            "format",
            "--reward-clip-range",
            "0",
            "1.5",
        ],
        ["--use-peft", "--num-generations", "4", "--beta", "0", "--lr-scheduler-type", "linear"],
    ],
)
def test_options_run(tmp_path, flags):
    # 0, 1, 0, 1, ...: a reward that differs within every group, so that the first update moves the policy for sure
    (tmp_path / "alternate.py").write_text(
        "def alternate(prompts, completions, **kw):\n    return [i % 2 for i in range(len(prompts))]\n"
    )
    out = run_script([RLOO, *ARITH, *TINY, *flags], tmp_path)
    assert "rloo: 2 updates" in out
    tags = ("reward", "kl", "frac_reward_zero_std", "clip_ratio/region_mean", "entropy", "completions/clipped_ratio")
    for tag in (*tags, "time/logprobs"):
        assert len(read_scalars(str(tmp_path / "runs"), tag)) == 2, tag
    # TRL's linear decay reaches 0 at the last optimizer step: half the rate after the first of 2 updates
    rates = [5e-5, 0.0] if "linear" in flags else [1e-4, 1e-4]
    assert read_scalars(str(tmp_path / "runs"), "charts/learning_rate") == pytest.approx(rates)
    kl = read_scalars(str(tmp_path / "runs"), "kl")
    assert (kl[-1] == 0) == ("--beta" in flags)  # the KL is measured against a reference unless beta is 0


def test_resume_continues_where_it_stopped(tmp_path):
    """4 updates straight == 3 updates, checkpoint, resume for 1 more (same weights, bit for bit: the prompt order,
    the sampling and the mini-batch shuffles all continue); the checkpoint also loads with plain from_pretrained."""
    common = [RLOO, *ARITH, *TINY, "--total-prompts", "16", "--num-iterations", "2"]
    # the summary reads from the run's start (its first evaluation and reward history)
    out, checkpoint = check_resume(common, ["--save-freq", "3"], "update_3", r"train reward .*? of them\)", tmp_path)
    assert "rloo: 1 updates" in out and AutoModelForCausalLM.from_pretrained(checkpoint).config.n_layer > 0
    assert "raise --total-prompts" in run_failing([*common, "--total-prompts", "12", "--resume-from", checkpoint], tmp_path)


def test_reward_model_is_one_more_reward_function(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from common.loading import load_pretrained, load_tokenizer

    load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1).save_pretrained(tmp_path / "rm")
    load_tokenizer("builtin:tiny-gpt2").save_pretrained(tmp_path / "rm")
    run_script([RLOO, *ARITH, *TINY, "--reward-model", str(tmp_path / "rm"), "--reward-weights", "1", "0.5"], tmp_path)
    assert len(read_scalars(str(tmp_path / "runs"), "rewards/reward_model/mean")) == 2
    assert "2 --reward-weights for 3 rewards" in run_failing(
        [
            RLOO,
            *ARITH,
            "--reward-funcs",
            "verifier",
            "format",
            "--reward-model",
            str(tmp_path / "rm"),
            "--reward-weights",
            "1",
            "1",
        ]
        + ["--overwrite"],
        tmp_path,
    )


@pytest.mark.slow
def test_two_process_ddp_ranks_end_with_identical_weights(tmp_path):
    out = run_script(
        [*ddp_launch(), RLOO, *ARITH, *TINY, "--total-prompts", "16", "--normalize-advantages"],
        tmp_path,
        timeout=300,
        **DDP_ENV,
    )
    assert "rloo: 2 updates" in out and "weights identical on 2 ranks" in out


@pytest.mark.slow
def test_rloo_learns_a_reward_it_can_reach(tmp_path):
    """A plug-in reward the warm-started policy rarely earns at first (1 for answering "7", whatever the question): the
    held-out reward rises 0.078 -> 0.578 in 40 updates (measured). With the advantage sign flipped it falls to 0.000;
    with the ratio detached the loss has no gradient and the run stops with an error: both fail this test."""
    (tmp_path / "rewards.py").write_text(
        "def seven(prompts, completions, **columns):\n    return [float(c.strip() == '7') for c in completions]\n"
    )
    out = run_script(
        [
            RLOO,
            *ARITH,
            "--reward-funcs",
            "rewards.py:seven",
            "--total-prompts",
            "1280",
            "--batch-size",
            "32",
            "--mini-batch-size",
            "32",
            "--gradient-accumulation-steps",
            "2",
            "--eval-samples",
            "64",
            "--eval-freq",
            "0",
            "--log-freq",
            "1000",
        ],
        tmp_path,
    )
    first, last = (float(x) for x in re.search(r"eval reward ([\d.]+) -> ([\d.]+)", out).groups())
    assert first < 0.25 and last > first + 0.25, out[-1500:]


@pytest.mark.parametrize("script", ["rloo", "grpo"])
def test_masked_truncated_completions_still_reach_the_reward_and_the_length_statistics(tmp_path, script):
    """--mask-truncated-completions takes cut completions out of the loss only: the reward functions still read their
    text and the logged lengths still count their tokens (every completion is cut here: 3 tokens of a random model)."""
    (tmp_path / "seen.py").write_text(
        "def seen(prompts, completions, **kw):\n"
        "    with open('seen.txt', 'a') as f:\n"
        "        f.writelines(repr(c) + '\\n' for c in completions)\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    flags = [*TINY, "--model-name", "builtin:tiny-gpt2", "--max-completion-length", "3", "--reward-funcs", "seen.py:seen"]
    out = run_script([os.path.join(ROOT, f"{script}.py"), *flags, "--mask-truncated-completions"], tmp_path)
    assert "every completion was cut and --mask-truncated-completions drops them" in out
    seen = (tmp_path / "seen.txt").read_text().splitlines()[2:]  # after the two rows load_rewards tries
    assert seen and all(line != "''" for line in seen), seen[:8]
    assert read_scalars(str(tmp_path / "runs"), "completions/mean_length") == [3.0, 3.0]


def test_entropy_bonus_runs_and_logs_its_coefficient(tmp_path):
    """rloo.py's entropy bonus (GRPOConfig's field, common.core.EntropyBonus as grpo.py's): the coefficient is logged,
    and the bonus changes the trained weights."""
    from safetensors.torch import load_file

    run_script([RLOO, *ARITH, *TINY, "--output-dir", "plain", "--log-dir", "plain_runs"], tmp_path)
    run_script([RLOO, *ARITH, *TINY, "--entropy-coef", "0.5", "--output-dir", "bonus"], tmp_path)
    assert read_scalars(str(tmp_path / "runs"), "entropy_coef") == pytest.approx([0.5, 0.5])
    plain, bonus = (load_file(tmp_path / d / "model.safetensors") for d in ("plain", "bonus"))
    assert any(not torch.equal(plain[k], bonus[k]) for k in plain)


def test_tr_dpo_reference_with_alpha_1_keeps_the_kl_at_zero(tmp_path):
    """rloo.py --sync-ref-model (grpo.py's, tested against TRL's callback there): with --ref-model-mixup-alpha 1 after
    every optimizer step the reference is the policy that samples the next update, so the KL in the rewards is 0 (to
    float rounding) at every update, while a frozen reference's grows."""
    common = [RLOO, *ARITH, *TINY, "--total-prompts", "24", "--beta", "0.1", "--learning-rate", "1e-3"]
    sync = ["--sync-ref-model", "--ref-model-sync-steps", "1", "--ref-model-mixup-alpha", "1"]
    run_script([*common, *sync, "--log-dir", "synced"], tmp_path)
    run_script([*common, "--output-dir", "frozen", "--log-dir", "frozen_runs"], tmp_path)
    synced, frozen = (read_scalars(str(tmp_path / d), "kl") for d in ("synced", "frozen_runs"))
    assert len(synced) > 2 and synced == pytest.approx([0.0] * len(synced), abs=1e-6), synced
    assert frozen[-1] > 1e-3, frozen


def test_gdpo_scores_then_normalised_advantages_equal_trls_gdpo():
    """--multi-objective-aggregation normalize_then_sum (GDPO; RLOOConfig lacks it): each function normalised within its
    group, then the weighted sum, as TRL 1.16's GRPOTrainer (its normalize_then_sum block, reproduced below). Those sums
    have group mean 0, so the leave-one-out advantages are k/(k-1) times them, a factor --normalize-advantages divides
    out: with it the advantages are TRL's GDPO advantages (to the 1e-4 in each denominator). A completion no function
    scored gets 0."""
    generator = torch.Generator().manual_seed(0)
    rewards_per_func = torch.rand(12, 3, generator=generator) * torch.tensor([1.0, 10.0, 0.1])  # three scales
    rewards_per_func[2, 1] = math.nan  # one function could not score one completion
    weights, k = torch.tensor([1.0, 0.5, 2.0]), 4

    nanstd = require("trl").trainer.utils.nanstd  # TRL 1.16, grpo_trainer.py, normalize_then_sum
    grouped = rewards_per_func.view(-1, k, 3)
    reward_k = (grouped - torch.nanmean(grouped, 1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    rewards = (reward_k.view(-1, 3) * weights.unsqueeze(0)).nansum(dim=1)
    expected = (rewards - torch.nanmean(rewards)) / (nanstd(rewards).expand_as(rewards) + 1e-4)

    scores = gdpo_scores(rewards_per_func, weights, k)
    assert torch.allclose(scores, rewards, atol=1e-6)
    assert torch.allclose(rloo_advantages(scores, k), k / (k - 1) * rewards, atol=1e-5)
    assert torch.allclose(rloo_advantages(scores, k, normalize=True), expected, atol=1e-4)
    summed = rloo_advantages((rewards_per_func * weights).nansum(1), k, normalize=True)  # sum_then_normalize differs
    assert not torch.allclose(summed, expected, atol=1e-2)
    rewards_per_func[7] = math.nan  # no function could score this one
    assert rloo_advantages(gdpo_scores(rewards_per_func, weights, k), k)[7] == 0


def test_dynamic_sampling_fills_the_batch_with_groups_that_differ(tmp_path):
    """rloo.py --dynamic-sampling (grpo.py's, common.rollout.dynamic_sampling; conftest.check_dynamic_sampling says what
    is checked), and with stale rollouts it is one line. At --beta 0: with a KL penalty frac_reward_zero_std reads the
    penalised rewards (TRL's RLOO), in which a topped-up group whose answers all scored alike is not flat."""
    check_dynamic_sampling([RLOO, *ARITH, *TINY, "--beta", "0"], tmp_path)
    error = run_failing([RLOO, *ARITH, *TINY, "--dynamic-sampling", "--max-staleness", "1"], tmp_path)
    assert "--dynamic-sampling with --max-staleness" in error
