import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import ROOT, check_model_card, run_failing, run_script
from diffusers import DDIMScheduler

from ddpo import PerPromptStatTracker, ddim_step_with_logprob, ddpo_loss, jpeg_compressibility, shuffle_samples

DDPO = os.path.join(ROOT, "ddpo.py")
TINY = [
    "--sample-num-steps",
    "3",
    "--sample-batch-size",
    "2",
    "--sample-num-batches-per-epoch",
    "1",
    "--train-batch-size",
    "2",
    "--eval-samples",
    "2",
]


def sd_scheduler(prediction_type: str, num_steps: int = 5) -> DDIMScheduler:
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=prediction_type,
    )
    scheduler.set_timesteps(num_steps)
    return scheduler


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
def test_ddim_step_mean_matches_diffusers_and_log_prob_is_gaussian(prediction_type):
    scheduler = sd_scheduler(prediction_type)
    torch.manual_seed(0)
    sample, model_output = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    for t in scheduler.timesteps:  # includes the last step, where prev_timestep is clamped to 0
        # eta = 0: no noise, so the update is the deterministic DDIM mean of diffusers' own step
        expected = scheduler.step(model_output, t, sample, eta=0.0).prev_sample
        mean, _ = ddim_step_with_logprob(scheduler, model_output, t, sample, eta=0.0)  # prev_sample = mean + 0 * noise
        torch.testing.assert_close(mean, expected, rtol=1e-5, atol=1e-5)
        # eta = 1: the log-prob is that of N(mean, std) averaged over all but the batch dimension
        prev, log_prob = ddim_step_with_logprob(
            scheduler, model_output, t, sample, eta=1.0, generator=torch.Generator().manual_seed(1)
        )
        prev_t = max(t.item() - 1000 // 5, 0)
        a_t, a_prev = scheduler.alphas_cumprod[t], scheduler.alphas_cumprod[prev_t]
        std = ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt()
        mean_eta1 = scheduler.step(model_output, t, sample, eta=1.0, variance_noise=torch.zeros_like(sample)).prev_sample
        expected_log_prob = torch.distributions.Normal(mean_eta1, std).log_prob(prev).mean((1, 2, 3))
        torch.testing.assert_close(log_prob, expected_log_prob, rtol=1e-4, atol=1e-4)
        # scoring a given sample reproduces the log-prob of sampling it, also with a timestep per sample
        _, rescored = ddim_step_with_logprob(scheduler, model_output, t.repeat(3), sample, eta=1.0, prev_sample=prev)
        torch.testing.assert_close(rescored, log_prob)


def test_ddim_step_needs_timesteps():
    scheduler = DDIMScheduler()
    with pytest.raises(ValueError, match="set_timesteps"):
        ddim_step_with_logprob(scheduler, torch.zeros(1, 4, 2, 2), 10, torch.zeros(1, 4, 2, 2), eta=1.0)


def test_ddpo_loss_by_hand():
    advantages, ratio = torch.tensor([1.0, -1.0, 2.0, -0.5]), torch.tensor([1.5, 1.5, 0.5, 0.5])
    # per sample max(-A r, -A clip(r, 0.8, 1.2)): -1.2, 1.5, -1.0, 0.4
    assert ddpo_loss(advantages, 0.2, ratio).item() == pytest.approx((-1.2 + 1.5 - 1.0 + 0.4) / 4)
    assert ddpo_loss(advantages, 0.2, torch.ones(4)).item() == pytest.approx(-advantages.mean().item())


def test_shuffle_keeps_each_step_with_its_sample():
    n, steps = 5, 4  # latent t of sample i holds 100 i + t: every shuffled field must still agree with it
    latents = (100 * torch.arange(n)[:, None] + torch.arange(steps + 1)).float()[..., None]  # [n, T+1, 1]
    samples = dict(latents=latents, log_probs=latents[:, :-1, 0] + 0.5, timesteps=torch.arange(steps).repeat(n, 1))
    samples["advantages"] = torch.arange(n).float()
    torch.manual_seed(0)
    out = shuffle_samples(samples, steps)
    x = out["latents"][..., 0]  # [n, T]: the step's latent
    assert torch.equal(out["next_latents"][..., 0], x + 1)
    assert torch.equal(out["log_probs"], x + 0.5)
    assert torch.equal(out["timesteps"].float(), x % 100)
    assert torch.equal(out["advantages"][:, None].expand(n, steps), x // 100)
    assert sorted(out["advantages"].tolist()) == list(range(n))  # every sample once
    assert all(sorted(row.tolist()) == list(range(steps)) for row in out["timesteps"])  # every step once
    assert not torch.equal(out["timesteps"], samples["timesteps"])  # and the steps really are shuffled


def test_per_prompt_stat_tracker_falls_back_then_normalises_per_prompt():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    prompts, rewards = ["a", "a", "b", "b"], np.array([1.0, 3.0, 10.0, 14.0])
    # fewer than min_count rewards per prompt: the batch's statistics
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    np.testing.assert_allclose(tracker.update(prompts, rewards), expected)
    # "a" now has 4 rewards (1, 3, 5, 7), "b" 3 (10, 14, 20): each its own statistics
    advantages = tracker.update(["a", "a", "b"], np.array([5.0, 7.0, 20.0]))
    np.testing.assert_allclose(advantages[:2], (np.array([5.0, 7.0]) - 4.0) / (np.std([1, 3, 5, 7]) + 1e-6))
    np.testing.assert_allclose(advantages[2], (20.0 - np.mean([10, 14, 20])) / (np.std([10, 14, 20]) + 1e-6))
    # the buffer keeps only the last buffer_size rewards
    tracker.update(["a"], np.array([9.0]))
    assert list(tracker.stats["a"]) == [3.0, 5.0, 7.0, 9.0]
    restored = PerPromptStatTracker(4, 3)
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    np.testing.assert_allclose(restored.update(["b"], np.array([1.0])), tracker.update(["b"], np.array([1.0])))


def test_jpeg_compressibility_prefers_flat_images():
    flat, noise = torch.full((1, 3, 32, 32), 0.5), torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    rewards, _ = jpeg_compressibility(torch.cat([flat, noise]), ["x", "x"], [{}, {}])
    assert rewards[0] > rewards[1] and rewards.shape == (2,)


def test_bad_input_fails_before_sampling(tmp_path):
    assert "not divisible" in run_failing([DDPO, "--sample-batch-size", "3", "--train-batch-size", "2"], tmp_path)
    assert "not divisible" in run_failing(
        [
            DDPO,
            "--sample-batch-size",
            "4",
            "--sample-num-batches-per-epoch",
            "1",
            "--train-batch-size",
            "4",
            "--train-gradient-accumulation-steps",
            "3",
        ],
        tmp_path,
    )
    assert "eta" in run_failing([DDPO, "--sample-eta", "0"], tmp_path)
    (tmp_path / "bad_reward.py").write_text(
        "def one(images, prompts, metadata):\n    return [1.0]\n"
        "def nan(images, prompts, metadata):\n    return [float('nan')] * len(images)\n"
    )
    error = run_failing([DDPO, "--reward-fn", f"{tmp_path}/bad_reward.py:one"], tmp_path)
    assert "returned 1 scores for 2 samples" in error
    assert "NaN" in run_failing([DDPO, "--reward-fn", f"{tmp_path}/bad_reward.py:nan"], tmp_path)
    assert "--reward-fn nope: unknown; choose one of" in run_failing([DDPO, "--reward-fn", "nope"], tmp_path)


def test_smoke_resume_and_saved_lora_loads(tmp_path):
    from diffusers import StableDiffusionPipeline

    straight_out = run_script([DDPO, *TINY, "--num-epochs", "2", "--save-freq", "1", "--output-dir", "straight"], tmp_path)
    out = run_script(
        [
            DDPO,
            *TINY,
            "--num-epochs",
            "2",
            "--resume-from",
            str(tmp_path / "straight_checkpoints" / "epoch_1"),
            "--output-dir",
            "resumed",
            "--async-reward-computation",
        ],
        tmp_path,
    )
    assert "resumed from" in out and "ddpo: 1 epochs" in out
    # the run's first evaluation and first epoch's reward come from the checkpoint
    summary = re.compile(r"sampled reward (\S+) -> (\S+) .*eval reward (\S+) ->")
    assert summary.findall(out) == summary.findall(straight_out) and summary.findall(out)
    assert list((tmp_path / "runs").glob("*/samples_2.png"))  # the captioned sample grid of the last epoch
    # the saved folder is the base pipeline plus the LoRA weights, loadable with plain diffusers
    pipelines = [StableDiffusionPipeline.from_pretrained(str(tmp_path / name)) for name in ("straight", "resumed")]
    for pipeline, name in zip(pipelines, ("straight", "resumed")):
        pipeline.load_lora_weights(str(tmp_path / name))
    lora = [{n: p for n, p in pipeline.unet.named_parameters() if "lora" in n} for pipeline in pipelines]
    assert lora[0] and lora[0].keys() == lora[1].keys()
    assert "library_name: diffusers" in check_model_card(tmp_path / "resumed", "ddpo", base="builtin:tiny-sd")
    for n in lora[0]:  # resuming at epoch 1 reproduces the straight run exactly
        torch.testing.assert_close(lora[0][n], lora[1][n], msg=n)
    assert any(p.abs().sum() > 0 for n, p in lora[0].items() if "lora_B" in n)  # LoRA B starts at 0: it was trained
    checkpoint = str(tmp_path / "straight_checkpoints" / "epoch_1")
    assert "raise --num-epochs" in run_failing([DDPO, *TINY, "--num-epochs", "1", "--resume-from", checkpoint], tmp_path)


def test_full_fine_tuning_saves_a_pipeline(tmp_path):
    from diffusers import StableDiffusionPipeline

    out = run_script(
        [
            DDPO,
            *TINY,
            "--num-epochs",
            "1",
            "--no-use-lora",
            "--no-per-prompt-stat-tracking",
            "--sample-guidance-scale",
            "1.0",
            "--train-timestep-fraction",
            "0.5",
        ],
        tmp_path,
    )
    assert "pipeline saved to outputs/ddpo" in out
    from common.loading import load_pipeline

    trained = StableDiffusionPipeline.from_pretrained(str(tmp_path / "outputs" / "ddpo")).unet.state_dict()
    base = load_pipeline("builtin:tiny-sd").unet.state_dict()
    assert trained.keys() == base.keys() and any(not torch.equal(trained[k], base[k]) for k in base)


@pytest.mark.slow
def test_ddpo_raises_the_compressibility_reward(tmp_path):
    # measured: eval reward (the same 16 prompts and noise before and after) -1.598 -> -1.576 in 5 epochs
    out = run_script([DDPO, "--num-epochs", "5", "--eval-samples", "16", "--save-freq", "0"], tmp_path)
    first, last = map(float, re.search(r"eval reward (-?[\d.]+) -> (-?[\d.]+)", out).groups())
    assert last > first + 0.01, out[-2000:]
