"""DDPO: Denoising Diffusion Policy Optimization (Black et al. 2023, "Training Diffusion Models with Reinforcement
Learning"), following kvablack/ddpo-pytorch and TRL 0.7-0.8's DDPOTrainer.

The DDIM sampler with eta > 0 is a stochastic policy: each denoising step draws x_{t-1} ~ N(mu_theta(x_t, t), sigma_t^2),
so the log-likelihood of a whole trajectory is a sum of Gaussian log-densities. Each epoch samples images with the
log-prob of every step, scores the final images with a reward function, normalises rewards into advantages (per
prompt), then runs PPO's clipped surrogate over the denoising steps (DDPO_IS, Section 4.3 of the paper).

Usage:
    python ddpo.py                                  # offline: tiny random SD pipeline, JPEG compressibility reward
    accelerate launch ddpo.py --reward-fn jpeg_incompressibility
    accelerate launch --config_file configs/multi_gpu.yaml ddpo.py --pretrained-model runwayml/stable-diffusion-v1-5 \\
        --resolution 512 --sample-num-steps 50 --sample-batch-size 8 --sample-num-batches-per-epoch 4 \\
        --train-batch-size 4 --train-gradient-accumulation-steps 2 --mixed-precision fp16
"""

import importlib.util
import io
import json
import math
import os
import shutil
import time
from collections import deque
from concurrent import futures
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object, set_seed
from diffusers import DDIMScheduler
from diffusers.utils import convert_state_dict_to_diffusers
from diffusers.utils.torch_utils import randn_tensor
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from common.checkpoints import read_checkpoint
from common.cli import cli
from common.core import UsageError, check_args, check_scores, exact_div, sizes
from common.loading import load_function, load_pipeline, plugin_error
from common.outputs import atomic_directory, check_finite, write_model_card
from common.run import end_run, start_run


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (each rank adds its index; each epoch reseeds from (seed, epoch, rank))"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    track: bool = False
    """if toggled, the run is tracked with Weights and Biases (synced from TensorBoard)"""
    wandb_project_name: str = "rlhf"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    log_dir: str = "runs"
    """TensorBoard logs (and the sample grids as PNG) go to {log_dir}/{run_name}"""

    # Pipeline, prompts, reward
    pretrained_model: str = "builtin:tiny-sd"
    """a Stable Diffusion pipeline: hub id, local folder, or builtin:tiny-sd (random, 32x32, runs on CPU)"""
    trust_remote_code: bool = False
    """run the code a hub model or folder ships with it (transformers' trust_remote_code): only for code you trust"""
    resolution: int | None = None
    """image height and width (None: the UNet's sample_size x the VAE's scale factor)"""
    prompt_fn: str = "animals"
    """where prompts come from: a built-in list (animals, animals_photo) or "module:function" / "file.py:function",
    a function () -> (prompt, metadata dict)"""
    reward_fn: str = "jpeg_compressibility"
    """jpeg_compressibility, jpeg_incompressibility (minus / plus the JPEG size in kB, the paper's tasks), or
    "module:function" / "file.py:function", a function (images [B,3,H,W] in [0,1], prompts, metadata) ->
    rewards [B] or (rewards, info): e.g. an aesthetic scorer you have locally"""
    negative_prompt: str = ""
    """the unconditional prompt of classifier-free guidance"""
    async_reward_computation: bool = False
    """score each sampling batch in a thread pool while the next batch is sampled"""
    max_workers: int = 2
    """threads of the asynchronous reward computation"""

    # Sampling (defaults: small enough for CPU; the paper uses 50 steps at 512x512)
    num_epochs: int = 40
    """epochs of sample-then-train"""
    sample_num_steps: int = 10
    """DDIM denoising steps"""
    sample_eta: float = 1.0
    """DDIM eta: the policy's noise (must be > 0: with eta = 0 the sampler is deterministic and has no log-prob)"""
    sample_guidance_scale: float = 5.0
    """classifier-free guidance scale (1.0: off)"""
    sample_batch_size: int = 8
    """images per sampling batch on each process"""
    sample_num_batches_per_epoch: int = 2
    """sampling batches per epoch on each process"""

    # Training (defaults: TRL's DDPOConfig, except where the tiny random default needs otherwise)
    train_batch_size: int = 4
    """samples per training batch on each process"""
    train_gradient_accumulation_steps: int = 1
    """training batches per optimizer step; each batch also accumulates over its timesteps"""
    train_num_inner_epochs: int = 1
    """passes of PPO over each epoch's samples"""
    train_cfg: bool = True
    """apply classifier-free guidance in the training forward pass too (as when sampling)"""
    train_adv_clip_max: float = 5.0
    """advantages are clipped to [-train_adv_clip_max, train_adv_clip_max]"""
    train_clip_range: float = 1e-2
    """PPO clip range of the probability ratio (TRL and the paper: 1e-4, for Stable Diffusion; on the tiny default
    1e-4 clips most updates after the first step of an epoch and the reward stalls)"""
    train_timestep_fraction: float = 1.0
    """fraction of the denoising steps trained on (a random subset, drawn per sample)"""
    train_max_grad_norm: float = 1.0
    """gradient clipping norm"""
    train_learning_rate: float = 1e-2
    """AdamW learning rate (TRL and the paper: 3e-4 for LoRA on Stable Diffusion, use it there; the random tiny
    default needs 1e-2 to raise the reward within minutes)"""
    train_adam_beta1: float = 0.9
    """AdamW beta1"""
    train_adam_beta2: float = 0.999
    """AdamW beta2"""
    train_adam_weight_decay: float = 1e-4
    """AdamW weight decay"""
    train_adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    train_use_8bit_adam: bool = False
    """bitsandbytes' 8-bit AdamW (needs bitsandbytes and a GPU)"""
    per_prompt_stat_tracking: bool = True
    """normalise rewards per prompt (mean / std of its recent rewards); otherwise over the whole batch"""
    per_prompt_stat_tracking_buffer_size: int = 16
    """rewards kept per prompt"""
    per_prompt_stat_tracking_min_count: int = 16
    """a prompt needs this many rewards before its own statistics are used (the batch's until then)"""
    use_lora: bool = True
    """train LoRA adapters on the UNet's attention projections; otherwise fine-tune the whole UNet"""
    lora_rank: int = 4
    """LoRA rank"""
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None
    """mixed precision (None: accelerate's config); the frozen VAE, text encoder and LoRA base weights are cast to it"""
    allow_tf32: bool = True
    """allow TF32 matmuls on Ampere and newer GPUs"""

    # Logging, checkpoints
    eval_samples: int = 32
    """images (same prompts, same noise) scored before and after training on each process; 0: no evaluation"""
    save_freq: int = 10
    """write a checkpoint every this many epochs (0: only the final weights)"""
    num_checkpoint_limit: int = 3
    """keep only the newest this many checkpoints"""
    resume_from: str | None = None
    """a checkpoint folder ({output_dir}_checkpoints/epoch_N) to continue from"""
    output_dir: str = "outputs/ddpo"
    """final LoRA weights (pytorch_lora_weights.safetensors, `pipeline.load_lora_weights(output_dir)`) or the whole
    pipeline; for a built-in base the base pipeline is saved beside them, so `from_pretrained(output_dir)` works"""
    overwrite: bool = False
    """replace what an earlier run of this codebase saved in --output-dir (and its checkpoints); a folder holding
    anything else is never replaced"""


ANIMALS = (
    "cat dog horse monkey rabbit zebra spider bird sheep deer cow goat lion tiger bear raccoon fox wolf lizard "
    "beetle ant butterfly fish shark whale dolphin squirrel mouse rat snake turtle frog chicken duck goose bee "
    "pig turkey fly llama camel bat gorilla hedgehog kangaroo"
).split()  # ddpo-pytorch's simple_animals
PROMPT_FNS = {
    "animals": lambda: (str(np.random.choice(ANIMALS)), {}),
    "animals_photo": lambda: (f"a photo of a {np.random.choice(ANIMALS)}", {}),
}


def jpeg_incompressibility(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> tuple[np.ndarray, dict]:
    """The JPEG (quality 95) file size of each image in kB (the paper's incompressibility task)."""
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return np.array(sizes), {}


def jpeg_compressibility(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> tuple[np.ndarray, dict]:
    """Minus the JPEG size in kB: smaller files score higher (the paper's compressibility task)."""
    sizes, info = jpeg_incompressibility(images, prompts, metadata)
    return -sizes, info


REWARD_FNS = {"jpeg_compressibility": jpeg_compressibility, "jpeg_incompressibility": jpeg_incompressibility}


def ddim_step_with_logprob(
    scheduler: DDIMScheduler,
    model_output: torch.Tensor,
    timestep: torch.Tensor,
    sample: torch.Tensor,
    eta: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DDIM step x_t -> x_{t-1} (Song et al. 2021, Eq. 12) and log N(x_{t-1}; mu, sigma_t^2) averaged over all
    non-batch dimensions: ddpo-pytorch's `ddim_step_with_logprob`.

    timestep: a scalar or one per sample [B]. prev_sample: when given, it is scored instead of sampled. As in the
    reference, prev_timestep is clamped to 0, so the last step uses alphas_cumprod[0] (equal to DDIMScheduler's
    final_alpha_cumprod when set_alpha_to_one=False, as in Stable Diffusion).
    """
    if scheduler.num_inference_steps is None:
        raise ValueError("Call scheduler.set_timesteps(num_steps) before stepping.")
    config = scheduler.config
    timestep = torch.as_tensor(timestep).reshape(-1).long().cpu()  # [1] or [B]
    step = config.num_train_timesteps // scheduler.num_inference_steps
    prev_timestep = (timestep - step).clamp(0, config.num_train_timesteps - 1)

    def per_sample(x):  # [1] or [B] -> [B, 1, 1, 1], broadcast against the latents
        return x.reshape(-1, *[1] * (sample.ndim - 1)).to(sample.device)

    alpha_prod_t = per_sample(scheduler.alphas_cumprod[timestep])
    alpha_prod_t_prev = per_sample(scheduler.alphas_cumprod[prev_timestep])
    beta_prod_t = 1 - alpha_prod_t
    if config.prediction_type == "epsilon":
        pred_original_sample = (sample - beta_prod_t.sqrt() * model_output) / alpha_prod_t.sqrt()
        pred_epsilon = model_output
    elif config.prediction_type == "sample":
        pred_original_sample = model_output
        pred_epsilon = (sample - alpha_prod_t.sqrt() * pred_original_sample) / beta_prod_t.sqrt()
    elif config.prediction_type == "v_prediction":
        pred_original_sample = alpha_prod_t.sqrt() * sample - beta_prod_t.sqrt() * model_output
        pred_epsilon = alpha_prod_t.sqrt() * model_output + beta_prod_t.sqrt() * sample
    else:
        raise ValueError(f"Unknown prediction_type {config.prediction_type!r}: epsilon, sample or v_prediction.")
    if config.thresholding:
        pred_original_sample = scheduler._threshold_sample(pred_original_sample)
    elif config.clip_sample:
        pred_original_sample = pred_original_sample.clamp(-config.clip_sample_range, config.clip_sample_range)
    # sigma_t(eta) of Eq. 16
    variance = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
    std_dev_t = eta * variance.sqrt()
    direction = (1 - alpha_prod_t_prev - std_dev_t**2).sqrt() * pred_epsilon  # "direction pointing to x_t"
    prev_sample_mean = alpha_prod_t_prev.sqrt() * pred_original_sample + direction
    if prev_sample is None:
        noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * noise
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)
        - torch.log(std_dev_t)
        - math.log(math.sqrt(2 * math.pi))
    )
    return prev_sample.type(sample.dtype), log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def ddpo_loss(advantages: torch.Tensor, clip_range: float, ratio: torch.Tensor) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017, Eq. 7) as a loss: mean(max(-A r, -A clip(r, 1 - e, 1 + e)))."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean()


def shuffle_samples(samples: dict[str, torch.Tensor], num_steps: int) -> dict[str, torch.Tensor]:
    """The epoch's samples in a random order, each sample's denoising steps in a random order of their own
    (ddpo-pytorch): step j of a shuffled sample is its (latent, next latent, log-prob, timestep) at a random t."""
    n, device = len(samples["latents"]), samples["latents"].device
    perm = torch.randperm(n, device=device)
    shuffled = {k: v[perm] for k, v in samples.items()}
    time_perms = torch.stack([torch.randperm(num_steps, device=device) for _ in range(n)])
    rows = torch.arange(n, device=device)[:, None]
    shuffled["next_latents"] = shuffled["latents"][:, 1:][rows, time_perms]
    for key in ("latents", "log_probs", "timesteps"):
        shuffled[key] = (shuffled[key][:, :-1] if key == "latents" else shuffled[key])[rows, time_perms]
    return shuffled


class PerPromptStatTracker:
    """Rewards normalised per prompt by the mean / std of its last `buffer_size` rewards (ddpo-pytorch), falling back
    to the statistics of the whole batch while a prompt has fewer than `min_count` rewards."""

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size, self.min_count, self.stats = buffer_size, min_count, {}

    def update(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        prompts, rewards = np.array(prompts), np.asarray(rewards, dtype=np.float64)
        advantages = np.empty_like(rewards)
        for prompt in np.unique(prompts):
            prompt_rewards = rewards[prompts == prompt]
            self.stats.setdefault(prompt, deque(maxlen=self.buffer_size)).extend(prompt_rewards)
            reference = self.stats[prompt] if len(self.stats[prompt]) >= self.min_count else rewards
            advantages[prompts == prompt] = (prompt_rewards - np.mean(reference)) / (np.std(reference) + 1e-6)
        return advantages

    def state_dict(self) -> dict:
        return {prompt: list(map(float, rewards)) for prompt, rewards in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {prompt: deque(rewards, maxlen=self.buffer_size) for prompt, rewards in state.items()}


def image_samples_hook(images: torch.Tensor, prompts: list[str], rewards: list[float], tile: int = 128) -> Image.Image:
    """A grid of images [B,3,H,W] in [0,1], each captioned with its prompt and reward (nearest-neighbour upscaled)."""
    columns = min(len(images), 4)
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * tile, rows * (tile + 24)), "white")
    draw = ImageDraw.Draw(grid)
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for i, (array, prompt, reward) in enumerate(zip(pixels, prompts, rewards)):
        x, y = (i % columns) * tile, (i // columns) * (tile + 24)
        grid.paste(Image.fromarray(array).resize((tile, tile), Image.NEAREST), (x, y))
        draw.text((x + 2, y + tile + 2), f"{prompt[:18]} {reward:.3f}", fill="black")
    return grid


def check(args: Args) -> None:
    """A one-line error for every flag out of its range, before anything is loaded."""
    check_args(
        args,
        positive=(
            "num_epochs sample_num_steps sample_guidance_scale sample_batch_size sample_num_batches_per_epoch "
            "train_batch_size train_gradient_accumulation_steps train_num_inner_epochs train_adv_clip_max "
            "train_clip_range train_max_grad_norm train_learning_rate max_workers lora_rank num_checkpoint_limit "
            "resolution"
        ),
        non_negative="eval_samples save_freq train_adam_weight_decay",
    )
    if args.sample_eta <= 0:
        raise UsageError("--sample-eta must be > 0: with eta = 0 DDIM is deterministic and a step has no log-prob.")
    if args.train_use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError("--train-use-8bit-adam needs bitsandbytes (pip install bitsandbytes) and a GPU.")
    if not 0 < args.train_timestep_fraction <= 1:
        raise UsageError(f"--train-timestep-fraction must be in (0, 1], got {args.train_timestep_fraction}.")
    exact_div(args.sample_batch_size, args.train_batch_size, sizes(args, "sample_batch_size"), sizes(args, "train_batch_size"))
    exact_div(
        args.sample_batch_size * args.sample_num_batches_per_epoch,
        args.train_batch_size * args.train_gradient_accumulation_steps,
        sizes(args, "sample_batch_size", "sample_num_batches_per_epoch"),
        sizes(args, "train_batch_size", "train_gradient_accumulation_steps"),
    )


class Plugins:
    """The prompt and reward functions of --prompt-fn / --reward-fn, called with their output checked: what they raise
    or return wrongly is one line naming the user's file."""

    def __init__(self, args: Args):
        self.args = args
        self.prompt_fn = load_function(args.prompt_fn, PROMPT_FNS, "--prompt-fn")
        self.reward_fn = load_function(args.reward_fn, REWARD_FNS, "--reward-fn")

    def prompt(self) -> tuple[str, dict]:
        try:
            out = self.prompt_fn()
        except Exception as error:  # noqa: BLE001 - the user's code: report it, whatever it raised
            raise UsageError(f"--prompt-fn {self.args.prompt_fn} raised {plugin_error(error)}") from None
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str) and isinstance(out[1], dict)):
            raise UsageError(f"--prompt-fn {self.args.prompt_fn} returned {str(out)[:80]!r}: return (prompt, metadata dict).")
        return out

    def reward(self, images, prompts, metadata):
        """The scores as a checked [B] tensor (one finite float per image) and the function's info dict."""
        try:
            out = self.reward_fn(images, prompts, metadata)
        except Exception as error:  # noqa: BLE001 - the user's code: report it, whatever it raised
            raise UsageError(f"--reward-fn {self.args.reward_fn} raised {plugin_error(error)}") from None
        rewards, info = out if isinstance(out, tuple) else (out, {})
        return check_scores(rewards, len(images), f"--reward-fn {self.args.reward_fn}"), info


class Diffusion:
    """The pipeline as DDPO's policy: its DDIM sampler (every latent and every step's log-prob kept), the UNet's noise
    prediction with classifier-free guidance, the frozen parts in the inference dtype, LoRA on the UNet (or the whole
    UNet trained)."""

    def __init__(self, args: Args, accelerator: Accelerator):
        self.args, self.accelerator, device = args, accelerator, accelerator.device
        if args.allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
        pipeline = load_pipeline(args.pretrained_model, seed=0)
        pipeline.set_progress_bar_config(disable=True)
        if not isinstance(pipeline.scheduler, DDIMScheduler):
            pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)  # DDPO's policy is the DDIM sampler
        self.pipeline, self.scheduler, self.unet = pipeline, pipeline.scheduler, pipeline.unet
        self.resolution = args.resolution or self.unet.config.sample_size * pipeline.vae_scale_factor
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
        # frozen parts in the inference dtype (only cast when it is not fp32: diffusers warns about any cast)
        for frozen in (pipeline.vae, pipeline.text_encoder) + ((self.unet,) if args.use_lora else ()):
            frozen.requires_grad_(False).to(device)
            if self.dtype != torch.float32:
                frozen.to(self.dtype)
        if args.use_lora:
            targets = ["to_k", "to_q", "to_v", "to_out.0"]
            lora = LoraConfig(
                r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian", target_modules=targets
            )
            self.unet.add_adapter(lora)
            for p in self.unet.parameters():
                if p.requires_grad:
                    p.data = p.data.float()  # trainable LoRA weights stay fp32 under mixed precision
        self.unet.to(device)
        self.negative_embeds = self.embed([args.negative_prompt])  # [1, 77, D]
        trainable = sum(p.numel() for p in self.unet.parameters() if p.requires_grad)
        accelerator.print(
            f"pipeline {args.pretrained_model}: {self.resolution}x{self.resolution}, {trainable:,} trainable of "
            f"{sum(p.numel() for p in self.unet.parameters()):,} UNet parameters "
            f"({'LoRA' if args.use_lora else 'full fine-tuning'})"
        )

    @torch.no_grad()
    def embed(self, prompts: list[str]) -> torch.Tensor:
        """Text-encoder hidden states [B, 77, D] of prompts padded to the tokenizer's max length."""
        tokenizer = self.pipeline.tokenizer
        ids = tokenizer(
            prompts, padding="max_length", truncation=True, return_tensors="pt", max_length=tokenizer.model_max_length
        )
        return self.pipeline.text_encoder(ids.input_ids.to(self.accelerator.device))[0]

    def predict_noise(self, model, latents, timesteps, prompt_embeds, guidance_scale):
        """The UNet's output with classifier-free guidance: uncond + scale * (cond - uncond)."""
        if guidance_scale == 1.0:
            return model(latents, timesteps, encoder_hidden_states=prompt_embeds).sample
        embeds = torch.cat([self.negative_embeds.expand_as(prompt_embeds), prompt_embeds])
        out = model(torch.cat([latents] * 2), torch.cat([timesteps] * 2), encoder_hidden_states=embeds).sample
        uncond, cond = out.chunk(2)
        return uncond + guidance_scale * (cond - uncond)

    @torch.no_grad()
    def sample(self, model, prompts: list[str], generator: torch.Generator | None) -> dict:
        """Denoise from Gaussian latents, keeping every latent and every step's log-prob; decode to images in [0, 1]."""
        args, accelerator, scheduler, device = self.args, self.accelerator, self.scheduler, self.accelerator.device
        prompt_embeds = self.embed(prompts)
        scheduler.set_timesteps(args.sample_num_steps, device=device)
        side = self.resolution // self.pipeline.vae_scale_factor
        shape = (len(prompts), accelerator.unwrap_model(self.unet).config.in_channels, side, side)
        latents = randn_tensor(shape, generator=generator, device=device, dtype=self.dtype) * scheduler.init_noise_sigma
        all_latents, log_probs = [latents], []
        with accelerator.autocast():
            for t in scheduler.timesteps:
                model_input = scheduler.scale_model_input(latents, t)
                noise_pred = self.predict_noise(
                    model, model_input, t.expand(len(prompts)), prompt_embeds, args.sample_guidance_scale
                )
                latents, log_prob = ddim_step_with_logprob(
                    scheduler, noise_pred.float(), t, latents.float(), args.sample_eta, generator=generator
                )
                latents = latents.to(self.dtype)
                all_latents.append(latents)
                log_probs.append(log_prob)
            images = self.pipeline.vae.decode(latents / self.pipeline.vae.config.scaling_factor).sample
        return dict(
            prompt_embeds=prompt_embeds,
            latents=torch.stack(all_latents, 1),  # [B, T+1, C, h, w]
            log_probs=torch.stack(log_probs, 1),  # [B, T]
            timesteps=scheduler.timesteps.repeat(len(prompts), 1),  # [B, T]
            images=(images.float() / 2 + 0.5).clamp(0, 1).cpu(),
        )


@torch.no_grad()
def evaluate(args: Args, accelerator: Accelerator, policy: Diffusion, unet, plugins: Plugins) -> float:
    """Mean reward of `eval_samples` images from fixed prompts and noise: the same before and after training."""
    unet.eval()
    set_seed(10**6 + accelerator.process_index)  # the training loop reseeds every epoch, so nothing is disturbed
    prompts = [plugins.prompt()[0] for _ in range(args.eval_samples)]
    size = args.sample_batch_size
    images = torch.cat([policy.sample(unet, prompts[i : i + size], None)["images"] for i in range(0, len(prompts), size)])
    rewards = plugins.reward(images, prompts, [{}] * len(prompts))[0].to(accelerator.device)
    return accelerator.gather(rewards).mean().item()


def sample_epoch(
    args: Args, policy: Diffusion, unet, plugins: Plugins, executor
) -> tuple[dict, list[str], torch.Tensor, list]:
    """An epoch's samples (prompt embeddings, latents, log-probs, timesteps), their prompts and rewards (computed in a
    thread pool beside the sampling with --async-reward-computation), and the sampled batches (for the image grid)."""
    batches, pending = [], []  # pending: reward futures (or results without a pool)
    for _ in range(args.sample_num_batches_per_epoch):
        prompts, metadata = zip(*(plugins.prompt() for _ in range(args.sample_batch_size)))
        sampled = policy.sample(unet, list(prompts), generator=None)
        sampled.update(prompts=list(prompts))
        batches.append(sampled)
        reward_inputs = (sampled["images"], list(prompts), list(metadata))
        pending.append(executor.submit(plugins.reward, *reward_inputs) if executor else plugins.reward(*reward_inputs))
    rewards = torch.cat([(r.result() if executor else r)[0] for r in pending]).to(policy.accelerator.device)
    samples = {k: torch.cat([b[k] for b in batches]) for k in ("prompt_embeds", "latents", "log_probs", "timesteps")}
    return samples, sum((b["prompts"] for b in batches), []), rewards, batches


def make_optimizer(args: Args, trainable: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over the trainable weights (bitsandbytes' 8-bit AdamW with --train-use-8bit-adam)."""
    optimizer_class = torch.optim.AdamW
    if args.train_use_8bit_adam:
        import bitsandbytes

        optimizer_class = bitsandbytes.optim.AdamW8bit
    return optimizer_class(
        trainable,
        lr=args.train_learning_rate,
        betas=(args.train_adam_beta1, args.train_adam_beta2),
        weight_decay=args.train_adam_weight_decay,
        eps=args.train_adam_epsilon,
    )


def resume(args: Args, accelerator: Accelerator, unet, optimizer, stat_tracker: PerPromptStatTracker) -> dict:
    """The loop's state saved with --resume-from's checkpoint, whose trainable weights, optimizer and stat tracker it
    restores ({} without)."""
    if not args.resume_from:
        return {}
    resumed = read_checkpoint(args.resume_from)
    if resumed["epoch"] >= args.num_epochs:
        raise UsageError(
            f"--resume-from {args.resume_from}: the checkpoint is at epoch {resumed['epoch']}, and this run "
            f"has {args.num_epochs}: raise --num-epochs to train further."
        )
    accelerator.unwrap_model(unet).load_state_dict(
        load_file(os.path.join(args.resume_from, "trainable.safetensors")), strict=False
    )
    optimizer_file = os.path.join(args.resume_from, "optimizer.pt")  # tensors and numbers only: no pickled code runs
    optimizer.load_state_dict(torch.load(optimizer_file, map_location=accelerator.device, weights_only=True))
    stat_tracker.load_state_dict(resumed["stat_tracker"])
    accelerator.print(f"resumed from {args.resume_from} at epoch {resumed['epoch']}")
    return resumed


def log_images(args: Args, accelerator: Accelerator, logger, images, prompts: list[str], rewards, step: int) -> None:
    """A grid of the epoch's first sampled images with their prompts and rewards, to TensorBoard and as a PNG beside
    the run's logs."""
    if not accelerator.is_main_process or logger.writer is None:
        return
    n = min(8, args.sample_batch_size)
    grid = image_samples_hook(images[:n], prompts[:n], rewards[:n].tolist())
    logger.writer.add_image("samples", np.asarray(grid.convert("RGB")), step, dataformats="HWC")
    grid.save(os.path.join(logger.writer.log_dir, f"samples_{step}.png"))


def save_state(args: Args, accelerator: Accelerator, unet, optimizer, trainable_names, state: dict) -> None:
    """A resumable checkpoint: the trainable weights, the optimizer and the loop's `state` (epoch, step, stat tracker,
    the run's first evaluation and per-epoch rewards), atomically; the oldest beyond --num-checkpoint-limit go."""
    folder = f"{args.output_dir}_checkpoints"
    if accelerator.is_main_process:
        params = dict(accelerator.unwrap_model(unet).named_parameters())
        with atomic_directory(os.path.join(folder, f"epoch_{state['epoch']}")) as tmp:
            save_file(
                {n: params[n].detach().cpu().contiguous() for n in trainable_names}, os.path.join(tmp, "trainable.safetensors")
            )
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f)
        checkpoints = sorted((d for d in os.listdir(folder) if d.startswith("epoch_")), key=lambda d: int(d[6:]))
        for old in checkpoints[: -args.num_checkpoint_limit]:
            shutil.rmtree(os.path.join(folder, old))
    accelerator.wait_for_everyone()


def save(args: Args, accelerator: Accelerator, policy: Diffusion, unet, metrics: dict) -> None:
    """LoRA weights in diffusers format (with the built-in base pipeline beside them), or the whole pipeline."""
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(unet, keep_torch_compile=False)
    with atomic_directory(args.output_dir) as tmp:
        if args.use_lora:
            # imported here, after cli() filtered transformers' import-time notices (torchvision's absence)
            from diffusers import StableDiffusionPipeline

            lora_state = convert_state_dict_to_diffusers(get_peft_model_state_dict(unwrapped))
            StableDiffusionPipeline.save_lora_weights(tmp, unet_lora_layers=lora_state)
            if args.pretrained_model.startswith("builtin:"):  # no hub copy of the base: save it beside the LoRA
                load_pipeline(args.pretrained_model, seed=0).save_pretrained(tmp)
        else:
            policy.pipeline.unet = unwrapped
            policy.pipeline.save_pretrained(tmp)
        write_model_card(tmp, args, "ddpo", metrics, library="diffusers")


def main(args: Args) -> None:
    """Setup, then the loop of sampling and PPO epochs, then the final evaluation, save and summary."""
    check(args)
    num_train_timesteps = max(1, int(args.sample_num_steps * args.train_timestep_fraction))
    # one optimizer step per train_gradient_accumulation_steps batches x their timesteps (ddpo-pytorch)
    steps = args.train_gradient_accumulation_steps * num_train_timesteps
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=steps)
    device, samples_per_epoch = accelerator.device, args.sample_batch_size * args.sample_num_batches_per_epoch
    plugins = Plugins(args)
    run_name, logger = start_run(args, accelerator)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):  # LoRA's few MB: no gain
        raise UsageError(
            f"ddpo.py under {accelerator.distributed_type.value} is not supported: the UNet's LoRA save needs whole "
            "weights; use DDP."
        )
    policy = Diffusion(args, accelerator)  # prints the pipeline's size and what is trained
    unet, resolution = policy.unet, policy.resolution
    trainable = [p for p in unet.parameters() if p.requires_grad]
    # the reward function is checked on two grey images before any sampling: a wrong length or NaN fails fast
    plugins.reward(torch.full((2, 3, resolution, resolution), 0.5), [plugins.prompt()[0] for _ in range(2)], [{}, {}])
    unet, optimizer = accelerator.prepare(unet, make_optimizer(args, trainable))
    stat_tracker = PerPromptStatTracker(args.per_prompt_stat_tracking_buffer_size, args.per_prompt_stat_tracking_min_count)
    trainable_names = [n for n, p in accelerator.unwrap_model(unet).named_parameters() if p.requires_grad]
    resumed = resume(args, accelerator, unet, optimizer, stat_tracker)  # {} without --resume-from
    start_epoch, global_step = resumed.get("epoch", 0), resumed.get("global_step", 0)
    executor = futures.ThreadPoolExecutor(max_workers=args.max_workers) if args.async_reward_computation else None
    if "first_eval" in resumed:  # the run's start, kept in its checkpoints
        first_eval = resumed["first_eval"]
    else:
        first_eval = evaluate(args, accelerator, policy, unet, plugins) if args.eval_samples else float("nan")
    epoch_rewards, start_time = resumed.get("epoch_rewards", []), time.time()  # mean sampled reward per epoch
    progress = tqdm(range(start_epoch, args.num_epochs), disable=not accelerator.is_local_main_process, desc="ddpo")
    for epoch in progress:
        set_seed(args.seed + accelerator.process_index + 10_000 * epoch)  # a resumed epoch draws the same numbers
        # 1. sample: images by DDIM, every step's latent and log-prob kept; rewards (in a thread pool, with the flag)
        unet.eval()
        epoch_start = time.time()
        samples, prompts, rewards, batches = sample_epoch(args, policy, unet, plugins, executor)
        sample_time = time.time() - epoch_start

        # 2. advantages: over all processes, per prompt (DDPO's per-prompt stat tracking) or over the batch
        all_rewards = accelerator.gather(rewards).cpu().numpy()
        if args.per_prompt_stat_tracking:
            all_advantages = stat_tracker.update(gather_object(prompts), all_rewards)
        else:
            all_advantages = (all_rewards - all_rewards.mean()) / (all_rewards.std() + 1e-8)
        mine = torch.as_tensor(all_advantages, dtype=torch.float32).reshape(accelerator.num_processes, -1)
        samples["advantages"] = mine[accelerator.process_index].to(device)
        epoch_rewards.append(float(all_rewards.mean()))

        # 3. optimise: PPO over (sample, timestep) pairs, each sample's timesteps shuffled independently (ddpo-pytorch)
        unet.train()
        infos = {"train/loss": [], "train/approx_kl": [], "train/clipfrac": [], "train/grad_norm": []}
        for _ in range(args.train_num_inner_epochs):
            shuffled = shuffle_samples(samples, args.sample_num_steps)
            for start in range(0, samples_per_epoch, args.train_batch_size):
                batch = {k: v[start : start + args.train_batch_size] for k, v in shuffled.items()}
                advantages = batch["advantages"].clamp(-args.train_adv_clip_max, args.train_adv_clip_max)
                for j in range(num_train_timesteps):
                    with accelerator.accumulate(unet), accelerator.autocast():
                        guidance = args.sample_guidance_scale if args.train_cfg else 1.0
                        latents, timesteps = batch["latents"][:, j], batch["timesteps"][:, j]
                        noise_pred = policy.predict_noise(unet, latents, timesteps, batch["prompt_embeds"], guidance)
                        _, log_prob = ddim_step_with_logprob(
                            policy.scheduler, noise_pred.float(), timesteps, latents.float(), args.sample_eta,
                            prev_sample=batch["next_latents"][:, j].float(),
                        )  # fmt: skip
                        ratio = torch.exp(log_prob - batch["log_probs"][:, j])
                        loss = ddpo_loss(advantages, args.train_clip_range, ratio)
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            norm = accelerator.clip_grad_norm_(trainable, args.train_max_grad_norm)
                            infos["train/grad_norm"].append(
                                torch.as_tensor(norm if norm is not None else 0.0).float().to(device)
                            )
                        optimizer.step()
                        optimizer.zero_grad()
                    infos["train/loss"].append(loss.detach())
                    infos["train/approx_kl"].append(0.5 * ((log_prob - batch["log_probs"][:, j]) ** 2).mean().detach())
                    infos["train/clipfrac"].append(((ratio - 1.0).abs() > args.train_clip_range).float().mean().detach())
                    if accelerator.sync_gradients:
                        global_step += 1

        # 4. bookkeeping: metrics, an image grid, checkpoints
        train_metrics = accelerator.reduce(torch.stack([torch.stack(v).mean() for v in infos.values()]), "mean").tolist()
        metrics = dict(zip(infos, train_metrics)) | {
            "reward/mean": all_rewards.mean(),
            "reward/std": all_rewards.std(),
            "time/sample": sample_time,
            "time/epoch": time.time() - epoch_start,
            "train/global_step": global_step,
        }
        check_finite(epoch + 1, {k: metrics[k] for k in ("train/loss", "train/grad_norm")})
        logger.log(metrics, epoch + 1)
        progress.set_postfix(reward=f"{all_rewards.mean():.3f}", kl=f"{metrics['train/approx_kl']:.2e}")
        log_images(args, accelerator, logger, batches[0]["images"], prompts, rewards, epoch + 1)
        if args.save_freq and (epoch + 1) % args.save_freq == 0 and epoch + 1 < args.num_epochs:
            state = dict(epoch=epoch + 1, global_step=global_step, stat_tracker=stat_tracker.state_dict())
            state |= dict(first_eval=first_eval, epoch_rewards=epoch_rewards)
            save_state(args, accelerator, unet, optimizer, trainable_names, state)
    if executor:
        executor.shutdown()

    # 5. the final evaluation, save (LoRA weights in diffusers format, or the whole pipeline) and summary
    last_eval = evaluate(args, accelerator, policy, unet, plugins) if args.eval_samples else float("nan")
    logger.log({"eval/reward": first_eval}, 0)
    logger.log({"eval/reward": last_eval}, args.num_epochs)
    metrics = {"eval/reward": last_eval, "train/reward (last epoch)": (epoch_rewards or [math.nan])[-1]}
    save(args, accelerator, policy, unet, metrics)
    elapsed = time.time() - start_time
    accelerator.print(
        f"ddpo: {args.num_epochs - start_epoch} epochs in {elapsed:.0f}s; sampled reward "
        f"{(epoch_rewards or [math.nan])[0]:.3f} -> {(epoch_rewards or [math.nan])[-1]:.3f} (first -> last epoch); "
        f"eval reward {first_eval:.3f} -> {last_eval:.3f}; "
        f"{'LoRA weights' if args.use_lora else 'pipeline'} saved to {args.output_dir}"
    )
    end_run(accelerator, logger)  # every rank leaves together


if __name__ == "__main__":
    main(cli(Args))
