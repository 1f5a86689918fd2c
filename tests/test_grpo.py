import json
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

from common.core import nanstd
from common.rewards import RewardModel
from grpo import group_advantages, grpo_loss

GRPO = os.path.join(ROOT, "grpo.py")
ARITH = ARITHS["grpo"]


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    advantages, is_std_zero = group_advantages(rewards, 4, "group")
    std = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected std of [1, 0, 1, 0]
    assert advantages.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 2 + [0.0] * 4)
    assert is_std_zero.tolist() == [False] * 4 + [True] * 4
    none, _ = group_advantages(rewards, 4, "none")  # Dr. GRPO: no division
    assert none.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0])
    batch, _ = group_advantages(rewards, 4, "batch")
    batch_std = torch.tensor(rewards.tolist()).std().item()  # torch's std is Bessel-corrected
    assert batch.tolist() == pytest.approx([x / (batch_std + 1e-4) for x in none.tolist()])


def test_group_advantages_leave_unscorable_rewards_out():
    """A None reward (NaN) takes no part in its group's mean and std, and gets advantage 0."""
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0])
    advantages, is_std_zero = group_advantages(rewards, 4, "group")
    mean, std = 2 / 3, math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    expected = [(1 - mean) / (std + 1e-4), 0.0, (0 - mean) / (std + 1e-4), (1 - mean) / (std + 1e-4)]
    assert advantages.tolist() == pytest.approx(expected) and not is_std_zero.any()
    assert nanstd(torch.tensor([1.0, math.nan, 3.0])).item() == pytest.approx(math.sqrt(2))


LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
OLD = torch.tensor([[-1.2, -1.8, -0.5], [-1.0, -0.3, 5.0]])  # row 2, token 3: padding with a junk value
REF = torch.tensor([[-1.1, -2.5, -0.4], [-1.5, -0.1, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])


def per_token_by_hand(eps_low=0.2, eps_high=0.2, beta=0.0, sequence=False):
    """The per-token losses written out, one scalar at a time."""
    losses = [[0.0] * 3 for _ in range(2)]
    for b in range(2):
        n = int(MASK[b].sum())
        seq_log_ratio = sum(LOGPROBS[b, t].item() - OLD[b, t].item() for t in range(n)) / n
        for t in range(n):
            log_ratio = seq_log_ratio if sequence else LOGPROBS[b, t].item() - OLD[b, t].item()
            ratio, a = math.exp(log_ratio), ADVANTAGES[b].item()
            loss = -min(ratio * a, min(max(ratio, 1 - eps_low), 1 + eps_high) * a)
            d = REF[b, t].item() - LOGPROBS[b, t].item()
            losses[b][t] = loss + beta * (math.exp(d) - d - 1)
    return losses


@pytest.mark.parametrize("beta, sequence", [(0.0, False), (0.1, False), (0.0, True)])
def test_grpo_loss_aggregations_by_hand(beta, sequence):
    losses = per_token_by_hand(beta=beta, sequence=sequence)
    level = "sequence" if sequence else "token"
    sums = [sum(row) for row in losses]
    expected = {
        "grpo": (sums[0] / 3 + sums[1] / 2) / 2,
        "bnpo": sum(sums) / 5,
        "dr_grpo": sum(sums) / (2 * 4),
        "dapo": sum(sums) / 10,
    }
    for loss_type, value in expected.items():
        loss, stats = grpo_loss(
            LOGPROBS,
            OLD,
            REF,
            ADVANTAGES,
            MASK,
            beta,
            0.2,
            0.2,
            loss_type,
            4,
            level,
            num_items_in_batch=10.0 if loss_type == "dapo" else None,
        )
        assert loss.item() == pytest.approx(value, rel=1e-5), loss_type
    assert ("kl" in stats) == (beta > 0)


def test_grpo_loss_clip_fractions_and_clip_higher():
    # token ratios: e^0.2, e^-0.2, 1 (A = +1); e^-0.5, e^0.1 (A = -1)
    _, stats = grpo_loss(LOGPROBS, OLD, REF, ADVANTAGES, MASK, 0.0, 0.2, 0.2, "bnpo", 4)
    # high: ratio > 1.2 with A > 0: none (e^0.2 = 1.2214 > 1.2: yes, one); low: ratio < 0.8 with A < 0: e^-0.5
    # [sum, count] over the masked tokens, so that a step pools them by tokens over mini-batches and processes (TRL 1.x)
    assert stats["clip_ratio/high_mean"].tolist() == [1, 5] and stats["clip_ratio/low_mean"].tolist() == [1, 5]
    assert stats["clip_ratio/region_mean"].tolist() == [2, 5]
    loss, stats = grpo_loss(LOGPROBS, OLD, REF, ADVANTAGES, MASK, 0.0, 0.2, 0.28, "bnpo", 4)  # DAPO clip-higher
    assert stats["clip_ratio/high_mean"].tolist() == [0, 5]
    # GSPO: one ratio per sequence (log-ratio means 0 and -0.2): counted per sequence, as TRL counts them
    _, stats = grpo_loss(LOGPROBS, OLD, REF, ADVANTAGES, MASK, 0.0, 0.1, 0.1, "bnpo", 4, "sequence")
    assert stats["clip_ratio/low_mean"].tolist() == [1, 2] and stats["clip_ratio/high_mean"].tolist() == [0, 2]
    assert loss.item() == pytest.approx(sum(map(sum, per_token_by_hand(eps_high=0.28))) / 5)


def test_bnpo_equals_grpo_with_one_sequence_per_mini_batch():
    for b in range(2):
        rows = slice(b, b + 1)
        args = (LOGPROBS[rows], OLD[rows], REF[rows], ADVANTAGES[rows], MASK[rows], 0.0, 0.2, 0.2)
        assert grpo_loss(*args, "bnpo", 4)[0].item() == pytest.approx(grpo_loss(*args, "grpo", 4)[0].item())


def test_grpo_loss_gradient_follows_the_advantage_and_ignores_padding():
    logprobs = LOGPROBS.clone().requires_grad_(True)
    loss, _ = grpo_loss(logprobs, OLD, REF, ADVANTAGES, MASK, 0.0, 0.2, 0.2, "dapo", 4)
    loss.backward()
    assert (logprobs.grad[0, 1:] < 0).all() and logprobs.grad[1, 1] > 0  # A=+1 pushed up, A=-1 down
    assert logprobs.grad[1, 2] == 0  # the padded token
    # clipped, so no gradient: ratio e^0.2 > 1.2 with A > 0, and e^-0.5 < 0.8 with A < 0
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[1, 0] == 0


def test_bad_input_fails_before_generation(tmp_path):
    (tmp_path / "rewards.py").write_text("def short(prompts, completions, **kw):\n    return [1.0]\n")
    for flags, message in (
        (["--num-generations", "1"], "at least 2 completions"),
        (["--batch-size", "3", "--mini-batch-size", "5"], "is not divisible by"),
        (["--dataset-name", "reasoning-gym:no_such_task"], "reasoning_gym.factory.DATASETS"),
        (["--reward-funcs", f"{tmp_path / 'rewards.py'}:short"], "returned list of length 1 for 2"),
        (["--reward-funcs", "nope"], "--reward-funcs nope: unknown; choose one of"),
        (["--task-config", "{bad"], "is not JSON"),
    ):
        assert message in run_failing([GRPO, *ARITH, *flags], tmp_path), flags


TINY = [
    "--total-prompts",
    "8",
    "--batch-size",
    "4",
    "--num-generations",
    "4",
    "--mini-batch-size",
    "8",
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
        [
            "--loss-type",
            "grpo",
            "--beta",
            "0.1",
            "--importance-sampling-level",
            "sequence",
            "--lr-scheduler-type",
            "linear",
            "--dtype",
            "bfloat16",
            "--cast-lm-head-to-fp32",
        ],
        ["--loss-type", "dr_grpo", "--scale-rewards", "none", "--use-peft", "--beta", "0.1"],
        [
            "--epsilon-high",
            "0.28",
            "--mask-truncated-completions",
            "--drop-zero-std-groups",
            "--overlong-buffer",
            "2",
            "--reward-funcs",
            "verifier",
            "format",
            "--reward-weights",
            "1",
            "0.5",
            "--num-iterations",
            "2",
            "--multi-objective-aggregation",
            "normalize_then_sum",
        ],
    ],
)
def test_options_run(tmp_path, flags):
    out = run_script([GRPO, *ARITH, *TINY, *flags], tmp_path)
    assert "grpo: 2 updates" in out
    tags = ("reward", "frac_reward_zero_std", "clip_ratio/region_mean", "entropy", "completions/clipped_ratio")
    for tag in (*tags, "time/logprobs"):
        assert len(read_scalars(str(tmp_path / "runs"), tag)) == 2, tag
    # TRL's linear decay reaches 0 at the last optimizer step: half the rate after the first of 2 updates
    rates = [5e-5, 0.0] if "linear" in flags else [1e-4, 1e-4]
    assert read_scalars(str(tmp_path / "runs"), "charts/learning_rate") == pytest.approx(rates)


@pytest.mark.parametrize("sync", [[], ["--sync-ref-model", "--ref-model-sync-steps", "3"]], ids=["frozen", "tr-dpo"])
def test_resume_continues_where_it_stopped(tmp_path, sync):
    """4 updates straight == 3 updates, checkpoint, resume for 1 more (same weights, bit for bit: the prompt order,
    the sampling and the mini-batch shuffles all continue; TR-DPO's moving reference and its step count too); the
    checkpoint also loads with plain from_pretrained."""
    common = [GRPO, *ARITH, *TINY, "--total-prompts", "16", "--beta", "0.1", "--num-iterations", "2", *sync]
    # the summary reads from the run's start (its first evaluation and reward history)
    out, checkpoint = check_resume(common, ["--save-freq", "3"], "update_3", r"train reward .*? of them\)", tmp_path)
    assert "grpo: 1 updates" in out and AutoModelForCausalLM.from_pretrained(checkpoint).config.n_layer > 0
    assert "raise --total-prompts" in run_failing([*common, "--total-prompts", "12", "--resume-from", checkpoint], tmp_path)


def test_tr_dpo_reference_with_alpha_1_keeps_the_kl_at_zero(tmp_path):
    """grpo.py --sync-ref-model (TRL's GRPOConfig field): with --ref-model-mixup-alpha 1 after every optimizer step the
    reference is the policy that samples the next update, whose one optimizer step computes every mini-batch before
    it moves: the logged KL is exactly 0 at every update (a frozen reference's grows); --beta 0 has no reference: one
    line."""
    common = [GRPO, *ARITH, *TINY, "--total-prompts", "24", "--beta", "0.1", "--learning-rate", "1e-3"]
    sync = ["--sync-ref-model", "--ref-model-sync-steps", "1", "--ref-model-mixup-alpha", "1"]
    run_script([*common, *sync, "--log-dir", "synced"], tmp_path)
    run_script([*common, "--output-dir", "frozen", "--log-dir", "frozen_runs"], tmp_path)
    synced, frozen = (read_scalars(str(tmp_path / d), "kl") for d in ("synced", "frozen_runs"))
    assert len(synced) == 6 and synced == [0.0] * 6, synced
    assert frozen[0] == 0.0 and frozen[-1] > 0, frozen
    error = run_failing([GRPO, *ARITH, *TINY, *sync, "--overwrite"], tmp_path)
    assert "--sync-ref-model moves a reference copy during training, and --beta 0 leaves no reference" in error


def test_reward_model_scores_prompt_completion_eos_and_is_logged(tmp_path):
    """--reward-model: the classifier's logit on "prompt completion<eos>" (no EOS after a truncated completion), the
    same number as the model on that text alone; a causal LM is refused; a run logs it as rewards/reward_model."""
    from transformers import AutoModelForSequenceClassification

    from common.core import UsageError
    from common.loading import load_pretrained, load_tokenizer

    classifier = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1).eval()
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    classifier.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    score = RewardModel(str(tmp_path / "rm"), device=torch.device("cpu"))
    scores = score(["What is 2 + 3?", "Hi"], [" 5", " there you"], ended=[True, False])
    with torch.no_grad():
        expected = [
            classifier(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()
            for text in ("What is 2 + 3? 5" + tokenizer.eos_token, "Hi there you")
        ]
    assert scores == pytest.approx(expected, abs=1e-5) and scores[0] != scores[1]
    load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(UsageError, match="no trained classification head"):
        RewardModel(str(tmp_path / "lm"), device=torch.device("cpu"))
    run_script([GRPO, *ARITH, *TINY, "--reward-model", str(tmp_path / "rm"), "--reward-weights", "1", "0.5"], tmp_path)
    assert len(read_scalars(str(tmp_path / "runs"), "rewards/reward_model/mean")) == 2


@pytest.mark.slow
def test_grpo_learns_a_reward_it_can_reach(tmp_path):
    """A plug-in reward the warm-started policy rarely earns at first (1 for answering "7", whatever the question):
    measured, the held-out reward rises 0.078 -> 0.750 in 40 updates. With the advantage sign flipped it falls to
    0.000; with the ratio detached the loss has no gradient and the run stops with an error: both fail this test."""
    (tmp_path / "rewards.py").write_text(
        "def seven(prompts, completions, **columns):\n    return [float(c.strip() == '7') for c in completions]\n"
    )
    out = run_script(
        [
            GRPO,
            *ARITH,
            "--reward-funcs",
            "rewards.py:seven",
            "--total-prompts",
            "320",
            "--batch-size",
            "8",
            "--mini-batch-size",
            "32",
            "--gradient-accumulation-steps",
            "2",
            "--learning-rate",
            "1e-4",
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


def test_reward_plugins_that_fail_are_named_with_their_line(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module\n")
    (tmp_path / "plugins.py").write_text(
        "import numpy as np\n\n\n"
        "def raises(prompts, completions, **kw):\n    return [len(c) / 0 for c in completions]\n\n\n"
        "def array(prompts, completions, **kw):\n    return np.array([float(len(c) > 2) for c in completions])\n\n\n"
        "def unscored(prompts, completions, **kw):\n    return [None] * len(completions)\n"
    )
    error = run_failing([GRPO, *ARITH, *TINY, "--reward-funcs", "broken.py:f"], tmp_path)
    assert "importing broken.py failed: ModuleNotFoundError" in error and "broken.py, line 1)" in error, error
    error = run_failing([GRPO, *ARITH, *TINY, "--reward-funcs", "plugins.py:raises"], tmp_path)
    assert "reward function plugins.py:raises raised ZeroDivisionError" in error and "plugins.py, line 5)" in error, error
    assert "grpo: 2 updates" in run_script(
        [GRPO, *ARITH, *TINY, "--reward-funcs", "plugins.py:array"], tmp_path
    )  # NumPy is fine
    # a batch no reward function scored trains nothing: said in a warning line and counted in the logs, never silent
    out = run_script(
        [GRPO, *ARITH, *TINY, "--reward-funcs", "plugins.py:unscored", "--log-dir", "unscored", "--overwrite"], tmp_path
    )
    assert "warning: update 1 has nothing to learn from: no reward function scored any completion" in out
    assert read_scalars(str(tmp_path / "unscored"), "degenerate_updates") == [1, 2]


@pytest.mark.slow
def test_eval_statistics_pool_every_process(tmp_path):
    """With --top-k 1 the completions are the same under 1 and 2 processes, so the held-out statistics must be too (the
    share of the most frequent answer was a mean of per-process shares: 33% on one process, 75% on two)."""
    flags = [GRPO, *ARITH, *TINY, "--top-k", "1"]
    run_script([*flags, "--log-dir", "one"], tmp_path)
    run_script([*ddp_launch(), *flags, "--log-dir", "two", "--output-dir", "model_two"], tmp_path, **DDP_ENV)
    for tag in ("eval/top_answer_share", "eval/reward", "eval/completion_length"):
        one, two = (read_scalars(str(tmp_path / d), tag)[0] for d in ("one", "two"))
        assert one == pytest.approx(two), (tag, one, two)


# ---------------------------------------------------------------- off-policy losses, masks and corrections: TRL 1.16
def trl_compute_loss(loss_type, logprobs, old, advantages, mask, ref=None, beta=0.0, entropies=None, **options):
    """TRL 1.16's own `GRPOTrainer._compute_loss` on these tensors: its method called with a stand-in trainer whose
    forward returns `logprobs` (and `entropies`), in eval mode on one process (no accumulation scaling)."""
    from collections import defaultdict
    from types import SimpleNamespace

    GRPOTrainer = require("trl").GRPOTrainer

    entropies = torch.ones_like(logprobs) if entropies is None else entropies
    accelerator = SimpleNamespace(
        num_processes=1,
        reduce=lambda x, reduction: x,
        gather=lambda x: x,
        pad_across_processes=lambda x, dim, pad_index: x,
        gather_for_metrics=lambda x: x,
    )
    args = SimpleNamespace(
        use_bias_correction_kl=options.get("bias_correction_kl", False),
        delta=options.get("delta"),
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=1,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, entropies, None),
        aux_loss_enabled=False,
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        importance_sampling_level=options.get("importance_sampling_level", "token"),
        beta=beta,
        args=args,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=options.get("epsilon_high", 0.28),
        use_vllm=options.get("is_ratio") is not None,
        vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=False),
        current_gradient_accumulation_steps=1,
        max_completion_length=mask.shape[1],
        accelerator=accelerator,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _entropy_bonus_enabled=False,
    )
    trainer.get_high_entropy_mask = lambda e, m, t: GRPOTrainer.get_high_entropy_mask(trainer, e, m, t)
    B, T = mask.shape
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.long),
        completion_ids=torch.zeros(B, T, dtype=torch.long),
        completion_mask=mask,
        advantages=advantages,
        old_per_token_logps=old,
        num_items_in_batch=mask.sum(),
    )
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if options.get("sampling") is not None:
        inputs["sampling_per_token_logps"] = options["sampling"]
    if options.get("is_ratio") is not None:
        inputs["importance_sampling_ratio"] = options["is_ratio"]
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def off_policy_batch(seed: int = 0):
    """Log-probs of a batch whose sampler lagged the policy: current, old (the start of the update), sampler, reference."""
    generator = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    logprobs = -torch.rand(B, T, generator=generator) * 3
    old = logprobs - 0.4 * torch.randn(B, T, generator=generator)
    sampling = old - 0.5 * torch.randn(B, T, generator=generator)
    ref = logprobs - 0.3 * torch.rand(B, T, generator=generator)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    advantages = torch.tensor([1.5, -1.0, 0.5, -2.0, 0.0, 1.0])
    return logprobs, old, sampling, ref, mask, advantages


@pytest.mark.parametrize(
    "loss_type, options",
    [
        ("cispo", dict(epsilon_high=1.3)),
        ("sapo", {}),
        ("luspo", dict(importance_sampling_level="sequence")),
        ("vespo", dict(is_ratio=True)),
        ("dapo", dict(off_policy_mask_threshold=0.1)),
        ("grpo", dict(bias_correction_kl=True, beta=0.05)),
        ("dapo", dict(top_entropy_quantile=0.4)),
        ("dapo", dict(delta=1.2, is_ratio=True)),
        ("bnpo", dict(is_ratio=True, off_policy_mask_threshold=0.2, beta=0.1, bias_correction_kl=True)),
    ],
)
def test_off_policy_losses_and_masks_equal_trls_own_code(loss_type, options):
    """Each new loss, mask and correction in value and gradient against TRL 1.16's `_compute_loss` run on the same
    tensors (its own method, not a copy)."""
    from grpo import high_entropy_mask, importance_sampling_ratio, off_policy_mask

    logprobs, old, sampling, ref, mask, advantages = off_policy_batch()
    options = dict(options)
    beta = options.pop("beta", 0.0)
    is_ratio = (
        importance_sampling_ratio(old, sampling, mask, "token_truncate", None, 3.0) if options.pop("is_ratio", 0) else None
    )
    entropies = torch.rand(logprobs.shape, generator=torch.Generator().manual_seed(1)) * 4
    ours_input = logprobs.clone().requires_grad_()
    theirs_input = logprobs.clone().requires_grad_()
    theirs = trl_compute_loss(
        loss_type, theirs_input, old, advantages, mask, ref, beta, entropies, sampling=sampling, is_ratio=is_ratio, **options
    )
    theirs.backward()
    sequence_mask = entropy_mask = None
    if options.get("off_policy_mask_threshold") is not None:
        sequence_mask = off_policy_mask(advantages[:, None], ours_input, sampling, mask, options["off_policy_mask_threshold"])
        assert 0 < sequence_mask.sum() < len(mask)  # the case tests something: some sequences dropped, not all
    if options.get("top_entropy_quantile", 1.0) < 1.0:
        entropy_mask = high_entropy_mask(entropies, mask, options["top_entropy_quantile"], entropies[mask.bool()])
    ours, _ = grpo_loss(
        ours_input, old, ref, advantages, mask, beta, 0.2, options.get("epsilon_high", 0.28), loss_type, mask.shape[1],
        options.get("importance_sampling_level", "token"), mask.sum(), is_ratio=is_ratio, sequence_mask=sequence_mask,
        entropy_mask=entropy_mask, bias_correction_kl=options.get("bias_correction_kl", False), delta=options.get("delta"),
    )  # fmt: skip
    ours.backward()
    assert torch.allclose(ours, theirs, atol=1e-6), (ours.item(), theirs.item())
    assert torch.allclose(ours_input.grad, theirs_input.grad, atol=1e-6)
    assert ours_input.grad.abs().sum() > 0


def test_importance_sampling_ratio_truncates_and_masks_by_hand():
    """w = exp(old - sampling): per token, or per sequence from the summed log-ratio; truncated into [C_min, C_max] or
    zeroed outside it. A flipped bound (masking below C_max, or truncating from below) fails here."""
    from grpo import importance_sampling_ratio

    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    sampling = torch.tensor([[-1.5, 0.5, 0.0], [-0.2, -0.3, 9.0]])  # row 2, token 3: padding
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    e = math.exp
    token = importance_sampling_ratio(old, sampling, mask, "token_truncate", 0.5, 3.0)
    assert token.flatten().tolist() == pytest.approx([3.0, e(-0.5), 1.0, e(0.2), e(0.3), 1.0])
    token = importance_sampling_ratio(old, sampling, mask, "token_mask", 0.7, 3.0)
    assert token.flatten().tolist() == pytest.approx([0.0, 0.0, 1.0, e(0.2), e(0.3), 1.0])
    sequence = importance_sampling_ratio(old, sampling, mask, "sequence_truncate", None, 1.5)
    assert sequence.flatten().tolist() == pytest.approx([1.5, 1.5])  # exp(1.0), exp(0.5): both above 1.5
    sequence = importance_sampling_ratio(old, sampling, mask, "sequence_mask", None, 2.0)
    assert sequence.flatten().tolist() == pytest.approx([0.0, e(0.5)])


def test_off_policy_mask_drops_only_negative_advantages_that_drifted():
    """A sequence goes only if its advantage is negative and its mean KL to the sampler is above the threshold: a mask
    applied to the positive advantages, or to the low-KL sequences, fails here."""
    from grpo import off_policy_mask

    logprobs = torch.zeros(4, 2)
    sampling = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.1, 0.1], [0.1, 0.1]])  # KL 1.0, 1.0, 0.1, 0.1
    advantages = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    assert off_policy_mask(advantages, logprobs, sampling, torch.ones(4, 2), 0.5).flatten().tolist() == [1, 0, 1, 1]


def test_cispo_and_sapo_gradients_by_hand():
    """CISPO: the gradient per token is -clip(ratio, max=eps_high) * A (times logp's own gradient), the ratio a
    constant, so a token far past the bound still moves; SAPO: -sigmoid'(tau (r - 1)) * 4 * A * r (d ratio / d logp)."""
    logprobs = torch.tensor([[0.5, -0.5]], requires_grad=True)  # ratio exp(0.5) = 1.65 and exp(-0.5) = 0.61
    old = torch.zeros(1, 2)
    loss, stats = grpo_loss(
        logprobs, old, old, torch.tensor([2.0]), torch.ones(1, 2), 0.0, 0.2, 1.2, "cispo", 2, num_items_in_batch=2
    )
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-1.2 * 2 / 2, -math.exp(-0.5) * 2 / 2])
    assert stats["cispo_clip_ratio"].tolist() == [1.0, 2.0]
    logprobs = torch.tensor([[0.5, -0.5]], requires_grad=True)
    loss, _ = grpo_loss(logprobs, old, old, torch.tensor([2.0]), torch.ones(1, 2), 0.0, 0.2, 0.28, "sapo", 2)
    loss.backward()
    for r, g in zip((math.exp(0.5), math.exp(-0.5)), logprobs.grad[0].tolist()):
        s = 1 / (1 + math.exp(-(r - 1)))
        assert g == pytest.approx(-s * (1 - s) * 4 * 2 * r / 2)  # tau 1 for A > 0; the mean over 2 tokens


def test_evaluating_more_often_leaves_the_trained_weights_bit_for_bit_the_same(tmp_path, monkeypatch):
    """Evaluation samples from its own random stream: a run that evaluates after every update trains the same weights
    as one that evaluates only at its start and end (benchmarks/real_model.py --check relies on it)."""
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    import grpo

    flags = ["--total-prompts", "32", "--batch-size", "8", "--num-generations", "4", "--mini-batch-size", "32"]
    flags += ["--gradient-accumulation-steps", "1", "--eval-samples", "8", "--learning-rate", "1e-3"]
    for name, every in (("often", "1"), ("rarely", "100")):
        args = [GRPO, *ARITH, *flags, "--eval-freq", every, "--output-dir", str(tmp_path / name)]
        monkeypatch.setattr("sys.argv", args + ["--log-dir", str(tmp_path / f"{name}_runs")])
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        grpo.main(grpo.cli(grpo.Args))
    often, rarely = (len(read_scalars(str(tmp_path / f"{n}_runs"), "eval/reward")) for n in ("often", "rarely"))
    assert often > rarely, (often, rarely)
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("often", "rarely"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stale_rollouts_come_from_the_weights_k_updates_back_and_repeat_exactly(tmp_path, monkeypatch):
    """--max-staleness 2 (deterministic): the rollout trained at update t was sampled by the weights the policy had at
    the start of update max(0, t - 2), and two runs give the same weights bit for bit; the staleness is logged."""
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    import grpo
    from common.rollout import Engine, RolloutStream

    weights_at, rollout, next_ = {}, Engine.rollout, RolloutStream.next

    def checksum(model):
        return sum(p.detach().double().sum().item() for p in model.parameters())

    def tagged_rollout(self, rows):
        out = rollout(self, rows)
        out.sampled_by = checksum(self.policy)
        return out

    def recorded_next(self, update):
        weights_at[update] = checksum(self.engine.policy)
        rows, out, staleness = next_(self, update)
        assert out.sampled_by == weights_at[max(0, update - 2)] and staleness == min(update, 2), update
        return rows, out, staleness

    monkeypatch.setattr(Engine, "rollout", tagged_rollout)
    monkeypatch.setattr(RolloutStream, "next", recorded_next)
    flags = ["--total-prompts", "40", "--batch-size", "8", "--num-generations", "4", "--mini-batch-size", "32"]
    flags += ["--gradient-accumulation-steps", "1", "--eval-samples", "8", "--max-staleness", "2", "--learning-rate", "1e-3"]
    for name in ("a", "b"):
        args = [GRPO, *ARITH, *flags, "--output-dir", str(tmp_path / name), "--log-dir", str(tmp_path / f"{name}_runs")]
        monkeypatch.setattr("sys.argv", args)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        grpo.main(grpo.cli(grpo.Args))
    assert sorted(weights_at) == [0, 1, 2, 3, 4] and len(set(weights_at.values())) == 5  # the weights moved each update
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_scalars(str(tmp_path / "a_runs"), "staleness/mean") == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(0 <= v <= 1 for v in read_scalars(str(tmp_path / "a_runs"), "importance_sampling/corrected_fraction"))


def test_the_asynchronous_worker_keeps_the_bound_and_its_failure_is_one_line(tmp_path, monkeypatch):
    """--async-rollouts: no rollout older than --max-staleness is trained on (older ones are dropped and counted); a
    worker that fails ends the run with one line naming the cause, and never hangs the trainer."""
    flags = [GRPO, *ARITH, "--total-prompts", "48", "--batch-size", "8", "--num-generations", "4", "--mini-batch-size", "32"]
    flags += ["--gradient-accumulation-steps", "1", "--eval-samples", "8", "--max-staleness", "1", "--async-rollouts"]
    out = run_script([*flags, "--log-dir", "runs"], tmp_path)
    assert "rollouts: HF generate; up to 1 update old, sampled ahead in a background thread" in out, out[:1000]
    staleness = read_scalars(str(tmp_path / "runs"), "staleness/max")
    assert len(staleness) == 6 and max(staleness) <= 1
    from common.rollout import RolloutWorker

    rollout = RolloutWorker._run

    def failing(self, update):
        self.engine.rollout = lambda rows: (_ for _ in ()).throw(RuntimeError("the sampler crashed"))
        rollout(self, update)

    monkeypatch.setattr(RolloutWorker, "_run", failing)
    error = run_failing([*flags, "--output-dir", "failed"], tmp_path)
    assert error == "UsageError: the rollout worker failed: RuntimeError: the sampler crashed", error


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--loss-type", "luspo"], "add --importance-sampling-level sequence"),
        (["--loss-type", "vespo", "--max-staleness", "2"], "choose --importance-sampling-mode token_truncate"),
        (["--max-staleness", "1", "--tools", "calculator"], "stale multi-turn episodes are not supported yet"),
        (["--max-staleness", "1", "--resume-from", "checkpoint"], "could not continue as it would have"),
        (["--importance-sampling-clip-min", "2", "--importance-sampling-clip-max", "1"], "the lower below the upper"),
        (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile 1.5: it lies in [0, 1]"),
        (["--max-staleness", "-1"], "--max-staleness -1: it must be >= 0"),
    ],
)
def test_off_policy_flags_that_cannot_work_are_one_line_errors(tmp_path, flags, message):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "trainer_state.json").write_text('{"update": 1, "script": "grpo.py"}')
    error = run_failing([GRPO, *ARITH, *flags], tmp_path)
    assert error.startswith("UsageError") and message in error, error


def test_a_stale_run_without_a_correction_warns_naming_it(tmp_path):
    out = run_script(
        [
            GRPO,
            *ARITH,
            "--total-prompts",
            "32",
            "--eval-samples",
            "8",
            "--max-staleness",
            "1",
            "--no-importance-sampling-correction",
        ],
        tmp_path,
    )
    assert "warning: --max-staleness 1 with --no-importance-sampling-correction: nothing corrects" in out
    assert "each update trains on a rollout sampled by the weights of 1 update before" in out, out[:1000]


@pytest.mark.slow
def test_grpo_learns_from_rollouts_two_updates_stale(tmp_path):
    """The learning test's reward with every rollout sampled by the weights of two updates back, corrected as TRL does
    (the ratio to the sampler, sequence_mask): the held-out reward still rises."""
    (tmp_path / "rewards.py").write_text(
        "def seven(prompts, completions, **columns):\n    return [float(c.strip() == '7') for c in completions]\n"
    )
    flags = ["--reward-funcs", "rewards.py:seven", "--total-prompts", "320", "--batch-size", "8", "--mini-batch-size"]
    flags += ["32", "--gradient-accumulation-steps", "2", "--learning-rate", "1e-4", "--eval-samples", "64"]
    out = run_script([GRPO, *ARITH, *flags, "--eval-freq", "0", "--log-freq", "1000", "--max-staleness", "2"], tmp_path)
    first, last = (float(x) for x in re.search(r"eval reward ([\d.]+) -> ([\d.]+)", out).groups())
    assert first < 0.25 and last > first + 0.25, out[-1500:]


@pytest.mark.parametrize("adaptive", [False, True])
def test_entropy_bonus_equals_trls_own_code(adaptive):
    """The entropy bonus (and Skywork-OR1's adaptive coefficient) against TRL 1.16's `_compute_loss`, step by step: the
    loss, its gradient with respect to the log-probs and to the entropies, and the coefficient after each optimizer step
    (the gate opens and closes as the entropy crosses the target). A bonus of the wrong sign, a sum for the mean, or a
    controller that moves the other way fails here."""
    from types import SimpleNamespace

    from common.core import EntropyBonus

    logprobs, old, _, _, mask, advantages = off_policy_batch()
    settings = dict(entropy_coef=0.3, use_adaptive_entropy=adaptive, entropy_coef_min=0.0, entropy_coef_max=0.32)
    settings |= dict(entropy_coef_delta=0.01, entropy_target=1.5)
    ours_bonus = EntropyBonus(SimpleNamespace(**settings))
    theirs_state = dict(entropy_coef=0.3, last=math.inf, window=None)
    accelerator = SimpleNamespace(reduce=lambda x, reduction: x)
    coefficients, pulls = [], []
    for step, scale in enumerate((1.0, 0.5, 0.4, 1.2)):  # mean entropy about 2, 1, 0.8, 2.4: across the target
        entropies = torch.rand(logprobs.shape, generator=torch.Generator().manual_seed(step)) * 4 * scale
        ours_in, theirs_in = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
        ours_h, theirs_h = entropies.clone().requires_grad_(), entropies.clone().requires_grad_()
        theirs = trl_entropy_loss(theirs_in, old, advantages, mask, theirs_h, settings, theirs_state)
        ours, _ = grpo_loss(ours_in, old, old, advantages, mask, 0.0, 0.2, 0.28, "dapo", mask.shape[1], "token", mask.sum())
        ours = ours + ours_bonus.loss(ours_h, mask)
        ours_bonus.step(accelerator)
        (ours + 0).backward()
        theirs.backward()
        assert torch.allclose(ours, theirs, atol=1e-6), (step, ours.item(), theirs.item())
        assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-6)
        assert torch.allclose(ours_h.grad, theirs_h.grad, atol=1e-7)
        assert ours_bonus.coef == pytest.approx(theirs_state["entropy_coef"]), step
        coefficients.append(ours_bonus.coef)
        pulls.append(theirs_h.grad.abs().sum().item() > 0)  # the bonus reached the entropies
    if adaptive:  # fell above the target, rose at or below it; applied after a step at or below it
        assert coefficients == pytest.approx([0.29, 0.30, 0.31, 0.30]) and pulls == [False, False, True, True]
    else:
        assert coefficients == [0.3] * 4 and all(pulls)


def trl_entropy_loss(logprobs, old, advantages, mask, entropies, settings, state):
    """TRL 1.16's `_compute_loss` (dapo, train mode, one process, no accumulation) with the entropy bonus on: one
    optimizer step, the controller's state carried in `state` from step to step."""
    from collections import defaultdict
    from types import SimpleNamespace

    GRPOTrainer = require("trl").GRPOTrainer
    accelerator = SimpleNamespace(
        num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x, sync_gradients=True
    )  # fmt: skip
    args = SimpleNamespace(
        use_bias_correction_kl=False, delta=None, steps_per_generation=1,
        **{k: v for k, v in settings.items() if k.startswith("entropy_") and k != "entropy_coef"},
    )  # fmt: skip
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, args=args, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=mask.shape[1], accelerator=accelerator,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _entropy_bonus_enabled=True, use_adaptive_entropy=settings["use_adaptive_entropy"],
        entropy_coef=state["entropy_coef"], _last_world_entropy=state["last"], _entropy_window_stats=state["window"],
    )  # fmt: skip
    B, T = mask.shape
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
        completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=mask, advantages=advantages,
        old_per_token_logps=old, num_items_in_batch=mask.sum(),
    )  # fmt: skip
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    state |= dict(entropy_coef=trainer.entropy_coef, last=trainer._last_world_entropy, window=trainer._entropy_window_stats)
    return loss


@pytest.mark.slow
def test_adaptive_entropy_coefficient_steps_and_resumes(tmp_path):
    """--use-adaptive-entropy with a target above any entropy: the coefficient rises by delta at each optimizer step (one
    an update here), is logged as entropy_coef, and a resumed run takes the checkpoint's controller on."""
    import json

    flags = ["--entropy-coef", "0.01", "--use-adaptive-entropy", "--entropy-target", "100", "--entropy-coef-delta", "0.005"]
    run_script([GRPO, *ARITH, *TINY, *flags, "--save-freq", "1", "--output-dir", "straight"], tmp_path)
    assert read_scalars(str(tmp_path / "runs"), "entropy_coef") == pytest.approx([0.015, 0.02])
    checkpoint = tmp_path / "straight_checkpoints" / "update_1"
    state = json.load(open(checkpoint / "trainer_state.json"))["extra"]["entropy_bonus"]
    assert state["coef"] == pytest.approx(0.015) and 0 < state["last"] < 100
    out = run_script(
        [GRPO, *ARITH, *TINY, *flags, "--resume-from", str(checkpoint), "--output-dir", "resumed", "--log-dir", "again"],
        tmp_path,
    )
    assert "resumed from" in out and read_scalars(str(tmp_path / "again"), "entropy_coef") == pytest.approx([0.02])


def test_gdpo_normalize_then_sum_equals_trls_formula():
    """GDPO's aggregation against TRL 1.16's normalize_then_sum block (GRPOTrainer._generate_and_score_completions,
    reproduced line by line below): each function normalised within its group, the weighted sum over the batch; a
    completion no function scored gets advantage 0, a NaN reward stays out of its function's group statistics."""
    from grpo import gdpo_advantages

    generator = torch.Generator().manual_seed(0)
    rewards_per_func = torch.rand(12, 3, generator=generator) * torch.tensor([1.0, 10.0, 0.1])  # three scales
    rewards_per_func[2, 1] = math.nan  # one function could not score one completion
    rewards_per_func[7] = math.nan  # no function could score this one
    weights, num_generations = torch.tensor([1.0, 0.5, 2.0]), 4

    # TRL 1.16, grpo_trainer.py, multi_objective_aggregation == "normalize_then_sum" (with TRL's own nanstd)
    nanstd = require("trl").trainer.utils.nanstd
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, 3)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, 3)
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards)
    expected = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4), nan=0.0)

    advantages, is_std_zero = gdpo_advantages(rewards_per_func, weights, num_generations)
    assert torch.allclose(advantages, expected, atol=1e-6) and advantages[7] == 0
    assert not is_std_zero.any()
    summed, _ = group_advantages((rewards_per_func * weights).nansum(1), num_generations)  # sum_then_normalize differs
    assert not torch.allclose(advantages, summed, atol=1e-2)


def test_cast_lm_head_to_fp32_matches_trls_cast(tmp_path):
    """--cast-lm-head-to-fp32 (ScaleRL) against TRL 1.16's own cast (GRPOTrainer.__init__'s closure, reproduced below)
    on a bfloat16 model with a head tied to its embeddings: the same float32 logits, bit for bit, the embeddings'
    output still bfloat16; a deep copy (the reference) keeps a head of its own; with vLLM in another dtype: one line."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    from common.models import cast_lm_head

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)).to(torch.bfloat16).eval()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    cast_lm_head(ours)

    lm_head = theirs.lm_head.float()  # TRL 1.16, grpo_trainer.py, _cast_lm_head_to_fp32
    lm_head.forward = lambda h: torch.nn.functional.linear(h.to(torch.float32), lm_head.weight.to(torch.float32), None)
    theirs.transformer.wte.register_forward_hook(lambda module, args, output: output.to(torch.bfloat16))

    ids = torch.randint(0, 50, (2, 7))
    logits, expected, plain = (m(input_ids=ids).logits for m in (ours, theirs, base))
    assert ours.lm_head.weight.dtype == logits.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert torch.equal(logits, expected) and ours.transformer.wte(ids).dtype == torch.bfloat16
    assert ours.lm_head.weight is ours.transformer.wte.weight  # still tied
    reference = copy.deepcopy(ours)
    with torch.no_grad():
        ours.lm_head.weight.add_(1.0)
    assert torch.equal(reference(input_ids=ids).logits, expected)  # the copy reads its own weights
    flags = ["--dtype", "bfloat16", "--cast-lm-head-to-fp32", "--use-vllm"]
    assert "add --vllm-dtype float32" in run_failing([GRPO, *ARITH, *TINY, *flags], tmp_path)


@pytest.mark.slow
def test_gradient_checkpointing_trains_the_same_and_warmup_schedules(tmp_path):
    """--gradient-checkpointing recomputes the activations: the same weights as without (to float rounding); a warm-up
    of 2 optimizer steps under constant_with_warmup logs half the rate after the first and the whole after the second;
    a scheduler transformers cannot build is one line before anything loads."""
    from safetensors.torch import load_file

    run_script([GRPO, *ARITH, *TINY, "--output-dir", "plain", "--log-dir", "plain_runs"], tmp_path)
    schedule = ["--lr-scheduler-type", "constant_with_warmup", "--warmup-steps", "2", "--learning-rate", "1e-4"]
    run_script([GRPO, *ARITH, *TINY, "--gradient-checkpointing", "--output-dir", "ckpt"], tmp_path)
    plain, ckpt = (load_file(tmp_path / d / "model.safetensors") for d in ("plain", "ckpt"))
    assert all(torch.allclose(plain[k], ckpt[k], atol=1e-6) for k in plain)
    run_script([GRPO, *ARITH, *TINY, *schedule, "--output-dir", "warm", "--log-dir", "warm_runs"], tmp_path)
    assert read_scalars(str(tmp_path / "warm_runs"), "charts/learning_rate") == pytest.approx([5e-5, 1e-4])
    bad = ["--lr-scheduler-type", "cosine_with_min_lr"]  # needs min_lr or min_lr_rate
    assert "pass a transformers scheduler and the options it takes" in run_failing([GRPO, *ARITH, *TINY, *bad], tmp_path)


def test_several_completions_per_held_out_problem_give_pass_and_mean_at_k(tmp_path):
    """--num-generations-eval 4: each held-out problem answered 4 times; eval/mean@4 is eval/reward (the mean over every
    completion), eval/pass@4 (each problem's best) is at least it, and the table holds 4 completions a problem."""
    run_script([GRPO, *ARITH, *TINY, "--num-generations-eval", "4", "--eval-freq", "0"], tmp_path)
    runs = str(tmp_path / "runs")
    mean, best, reward = (read_scalars(runs, f"eval/{tag}") for tag in ("mean@4", "pass@4", "reward"))
    assert len(mean) == 2 and mean == pytest.approx(reward)
    assert all(b >= m for b, m in zip(best, mean)) and any(b > m for b, m in zip(best, mean))


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """--chat-template-kwargs binds its options to every later apply_chat_template (a template reading
    `enable_thinking`, as Qwen3's does), and a value that is not a JSON object is one line before anything loads."""
    from common.chat import bind_template_kwargs, render
    from common.loading import load_tokenizer

    tokenizer = load_tokenizer("builtin:smollm2-135m-instruct")
    tokenizer.chat_template = "{% if enable_thinking %}<think>{% endif %}{{ messages[-1]['content'] }}"
    assert render(tokenizer, "2 + 2")[0] == "2 + 2"
    assert render(bind_template_kwargs(tokenizer, {"enable_thinking": True}), "2 + 2")[0] == "<think>2 + 2"
    error = run_failing([GRPO, *ARITH, *TINY, "--chat-template-kwargs", "[1]"], tmp_path)
    assert "give a JSON object" in error


def test_dynamic_sampling_fills_the_batch_with_groups_that_differ(tmp_path):
    """--dynamic-sampling (DAPO, Algorithm 1): a group whose rewards are all equal is replaced by a newly sampled one
    (conftest.check_dynamic_sampling says what is checked)."""
    check_dynamic_sampling([GRPO, *ARITH, *TINY], tmp_path)


@pytest.mark.parametrize("script", ["grpo", "sft", "dpo", "ppo"])
def test_adam_settings_out_of_range_are_one_line(tmp_path, script):
    """--adam-beta1 / --adam-beta2 / --adam-epsilon (TRL's names, its defaults) reach AdamW in every script that trains
    with it; a beta of 1 or a zero epsilon is a one-line error before anything loads."""
    flags = [*ARITH, *TINY] if script == "grpo" else []
    path = os.path.join(ROOT, f"{script}.py")
    assert "the betas lie in [0, 1)" in run_failing([path, *flags, "--adam-beta2", "1.0"], tmp_path)
    if script != "ppo":  # ppo.py keeps lm-human-preferences' --adam-eps (a positive flag)
        assert "epsilon above 0" in run_failing([path, *flags, "--adam-epsilon", "0"], tmp_path)


def test_min_p_and_repetition_penalty_reach_the_sampler():
    """grpo.py's --min-p and --repetition-penalty are the sampler's, on both of its draws (inverse CDF and HF's own):
    --min-p 1 keeps only the most likely token, so every seed draws the greedy completion; with --top-k 1 and a
    penalty, the inverse-CDF draw is HF's greedy decoding under that penalty (which differs from plain greedy here),
    and HF's own draw is `generate(do_sample=True, repetition_penalty=...)` on the same seed; out of range: one line."""
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    from common.core import UsageError
    from common.loading import load_tokenizer
    from common.sampling import Sampler
    from grpo import Args, check

    tokenizer = load_tokenizer("builtin:tiny-arith", padding_side="left")
    torch.manual_seed(0)  # a random model: near-flat logits, whose greedy completions repeat tokens
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tokenizer))).eval()
    batch = tokenizer(["3 + 4 =", "12 + 5 ="], padding=True, return_tensors="pt")
    inputs, accelerator = (batch["input_ids"], batch["attention_mask"], 8), Accelerator(cpu=True)

    def hf(**options):
        out = model.generate(**batch, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id, **options)
        return out[:, batch["input_ids"].shape[1] :]

    def ours(seed: int, **flags):
        torch.manual_seed(seed)
        completions, mask, _, _ = Sampler(Args(**flags), tokenizer, model, accelerator, 64).generate(*inputs)
        return completions, mask.bool()

    def same(a, b) -> bool:
        (completions, mask), width = a, a[0].shape[1]
        return torch.equal(completions[mask], b[:, :width][mask])

    greedy, penalised = hf(do_sample=False), hf(do_sample=False, repetition_penalty=5.0)
    assert not torch.equal(greedy, penalised)
    for inverse_cdf in (True, False):
        for seed in (0, 1):
            assert same(ours(seed, min_p=1.0, inverse_cdf_sampling=inverse_cdf), greedy)
    assert same(ours(0, top_k=1, repetition_penalty=5.0), penalised)
    torch.manual_seed(3)
    sampled = hf(do_sample=True, top_k=0, repetition_penalty=5.0)
    assert same(ours(3, repetition_penalty=5.0, inverse_cdf_sampling=False), sampled)
    with pytest.raises(UsageError, match="--min-p 1.5: it lies in"):
        check(Args(min_p=1.5))
    with pytest.raises(UsageError, match="--repetition-penalty 0.0: it must be > 0"):
        check(Args(repetition_penalty=0.0))


def test_generation_kwargs_reach_generate_and_bad_ones_are_one_line():
    """--generation-kwargs (TRL's generation_kwargs) reach HF generate on both draws: suppress_tokens keeps the tokens
    of the greedy completions out of a --top-k 1 draw; a key with a flag of its own, one generate does not know, or
    anything but a JSON object is one line."""
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    from common.core import UsageError
    from common.loading import load_tokenizer
    from common.sampling import Sampler
    from grpo import Args, check

    tokenizer = load_tokenizer("builtin:tiny-arith", padding_side="left")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tokenizer))).eval()
    batch = tokenizer(["3 + 4 =", "12 + 5 ="], padding=True, return_tensors="pt")
    inputs, accelerator = (batch["input_ids"], batch["attention_mask"], 8), Accelerator(cpu=True)
    greedy, mask, _, _ = Sampler(Args(top_k=1), tokenizer, model, accelerator, 64).generate(*inputs)
    banned = sorted(set(greedy[mask.bool()].tolist()) - {tokenizer.eos_token_id})
    options = json.dumps({"suppress_tokens": banned})
    for inverse_cdf in (True, False):
        sampler = Sampler(
            Args(top_k=1, generation_kwargs=options, inverse_cdf_sampling=inverse_cdf), tokenizer, model, accelerator, 64
        )
        completions, mask, _, _ = sampler.generate(*inputs)
        assert not set(completions[mask.bool()].tolist()) & set(banned)
    check(Args(generation_kwargs=options))
    for bad, words in [
        ('{"top_p": 0.5}', "top_p is set by its own flag or by the sampler; pass it there (--top-p)"),
        ('{"no_such_option": 1}', "no_such_option is not an option of transformers' GenerationConfig"),
        ("[1]", "give a JSON object"),
        ("{oops", "not JSON"),
    ]:
        with pytest.raises(UsageError, match=re.escape(words)):
            check(Args(generation_kwargs=bad))
