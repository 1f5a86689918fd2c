"""The two sides of each comparison in benchmarks/bench.py: our script, run through its real CLI in the worker's
process, and the matching TRL trainer, on the same model, data, batch sizes, sequence lengths and optimisation passes;
each returns the seconds of its steps (PPO: of its phases too). Also the benchmark's data (the built-in dialogue and
preference pairs, cut to a sequence length) and its randomly initialised models."""

import contextlib
import gc
import io
import json
import os
import runpy
import sys
import time

from records import scalars as logged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scalars(log_dir: str, tag: str) -> list[float]:
    """Values of a TensorBoard scalar, in step order, from the run under log_dir."""
    return [value for _, value in logged(log_dir, tag)]


def clock() -> float:
    """time.perf_counter once the GPU (if any) has finished its queued work."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def run_ours(script: str, argv: list[str], cwd: str) -> None:
    """Run `python script argv` in this process (as its __main__), with accelerate's process state reset around it;
    each round's run replaces the model the last one saved in its output folder (`--overwrite`)."""
    from accelerate.state import AcceleratorState, GradientState

    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [script, *map(str, argv), "--overwrite"]
    os.chdir(cwd)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        gc.collect()


def step_timer():
    """A transformers TrainerCallback recording the interval between consecutive optimizer-step ends."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.times, self.last = [], clock()

        def on_step_end(self, args, state, control, **kwargs):
            now = clock()
            self.times.append(now - self.last)
            self.last = now

    return StepTimer()


def trl_common(spec: dict, tmp: str) -> dict:
    """TrainingArguments shared by the TRL trainers: no eval, no saving, no reporting, logging every step as ours."""
    import torch

    return dict(
        output_dir=os.path.join(tmp, "trl"),
        max_steps=spec["warmup"] + spec["steps"],
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=1,
        gradient_checkpointing=False,  # TRL 1.x turns it on by default; ours is off unless asked (same work)
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        max_grad_norm=1.0,
        bf16=spec["bf16"],
    )


def random_model(name: str, tokenizer):
    """A randomly initialised policy of the named shape for the built-in tokenizer (generation.py builds the same
    ones): tiny (builtin:tiny-gpt2, 2 layers x 64, its 6,818-token vocabulary), gpt2-124m (GPT2Config's defaults are
    GPT-2 small: 12 layers, 768 wide, 12 heads, GPT-2's vocabulary and a pad token) or qwen2-0.5b (Qwen2-0.5B's
    shape); the built-in tokenizer's ids, GPT-2's cut, are a subset of both vocabularies."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from common.loading import load_pretrained

    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if name == "gpt2-124m":
        return GPT2LMHeadModel(GPT2Config(vocab_size=50258, **special))  # GPT-2 small's output layer, as GPT-2 has it
    if name == "qwen2-0.5b":
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.eos_token_id,
            **special,
        )
        return Qwen2ForCausalLM(config)
    return load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)


def setup(spec: dict, tmp: str) -> dict:
    """The shared model folder and data files (the preference pairs cut to 512: precomputing reference log-probs
    goes over the whole dataset)."""

    from common.loading import load_data, load_tokenizer

    model_dir = os.path.join(tmp, "model")
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    random_model(spec["model"], tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    files = {}
    for name in ("chatterbot-dialogue", "vader-preferences", "chatterbot-prompts"):
        files[name] = os.path.join(tmp, f"{name}.jsonl")
        data = {"vader-preferences": preference_pairs, "chatterbot-dialogue": sft_texts}.get(name)
        (data(spec["seq_length"]) if data else load_data(f"builtin:{name}")).to_json(files[name])
    if spec["algo"] in ONLINE:  # reasoning-gym's one-digit sums as a plain prompt / answer file, for both sides
        import reasoning_gym

        files["arith"] = os.path.join(tmp, "arith.jsonl")
        with open(files["arith"], "w") as f:
            for entry in reasoning_gym.create_dataset("chain_sum", size=512, seed=0, min_terms=2, max_terms=2, max_digits=1):
                f.write(json.dumps(dict(prompt=entry["question"], answer=entry["answer"])) + "\n")
    env = dict(model=model_dir, files=files, tokenizer=tokenizer)
    if spec["algo"] == "ddpo":
        from common.loading import load_pipeline

        env["pipeline"] = os.path.join(tmp, "pipeline")
        load_pipeline("builtin:tiny-sd", seed=0).save_pretrained(env["pipeline"])
    return env


def trainers(L: int) -> dict:
    """Trainer-style comparisons at sequence length L: our script, its data, its flags; TRL's {name}Trainer /
    {name}Config and the same settings."""
    return {
        "sft": (
            "sft.py",
            "chatterbot-dialogue",
            ["--batch-size", 16, "--max-seq-length", L, "--num-sample-generations", 0],
            "SFT",
            dict(
                per_device_train_batch_size=16,
                max_length=L,
                packing=False,
                learning_rate=1e-3,
                lr_scheduler_type="cosine",
                warmup_steps=0.03,
            ),
        ),
        "rm": (
            "reward_modeling.py",
            "vader-preferences",
            ["--batch-size", 16, "--max-length", L],
            "Reward",
            dict(
                per_device_train_batch_size=16, max_length=L, learning_rate=3e-4, lr_scheduler_type="linear", warmup_steps=0.03
            ),
        ),
        "dpo": (
            "dpo.py",
            "vader-preferences",
            ["--batch-size", 8, "--max-length", L, "--max-prompt-length", L // 2, "--max-target-length", L // 2],
            "DPO",
            dict(
                per_device_train_batch_size=8,
                max_length=L,
                beta=0.1,
                learning_rate=1e-4,
                lr_scheduler_type="linear",
                warmup_steps=0.1,
            ),
        ),
    }


TRL_FLAGS = {
    "--precompute-ref-log-probs": dict(precompute_ref_log_probs=True),  # our flag -> TRL's config
    "--gradient-checkpointing": dict(gradient_checkpointing=True),
}


def trainer_ours(spec, env, tmp, tag, flags=()):
    script, data, script_flags, _, _ = trainers(spec["seq_length"])[spec["algo"]]
    log_dir = os.path.join(tmp, "runs", tag)
    run_ours(
        script,
        [
            "--model-name",
            env["model"],
            "--dataset-name",
            env["files"][data],
            *script_flags,
            "--max-steps",
            spec["warmup"] + spec["steps"],
            "--eval-steps",
            10**6,
            "--eval-fraction",
            0.01,
            "--output-dir",
            os.path.join(tmp, "out"),
            "--log-dir",
            log_dir,
            *flags,
        ],
        tmp,
    )
    return dict(step=scalars(log_dir, "time/step"))


def trainer_trl(spec, env, tmp, tag, flags=()):
    import trl
    from datasets import load_dataset

    _, data, _, name, kwargs = trainers(spec["seq_length"])[spec["algo"]]
    timer = step_timer()
    config = getattr(trl, f"{name}Config")(
        **trl_common(spec, tmp) | kwargs | {k: v for f in flags for k, v in TRL_FLAGS[f].items()}
    )
    getattr(trl, f"{name}Trainer")(
        model=env["model"],
        args=config,
        processing_class=env["tokenizer"],
        callbacks=[timer],
        train_dataset=load_dataset("json", data_files=env["files"][data], split="train"),
    ).train()
    return dict(step=timer.times)


def sampler_flag(spec) -> list[str]:
    return ([] if spec["inverse_cdf"] else ["--no-inverse-cdf-sampling"]) + (
        [] if spec["fast_generation"] else ["--no-fast-generation"]
    )


def ppo_ours(spec, env, tmp, tag, flags=()):
    log_dir, batch = os.path.join(tmp, "runs", tag), spec["batch_size"]
    run_ours(
        "ppo.py",
        [
            "--model-name",
            env["model"],
            "--dataset-name",
            env["files"]["chatterbot-prompts"],
            "--batch-size",
            batch,
            "--mini-batch-size",
            batch // 2,
            "--ppo-epochs",
            4,
            "--total-episodes",
            batch * (spec["warmup"] + spec["steps"]),
            "--min-new-tokens",
            16,
            "--max-new-tokens",
            16,
            "--eval-freq",
            0,
            "--eval-samples",
            8,
            "--log-freq",
            10**6,
            "--reward-model",
            "None",  # VADER's reward_fn, as TRL's side scores
            "--output-dir",
            os.path.join(tmp, "out"),
            "--log-dir",
            log_dir,
            *sampler_flag(spec),
            *flags,
        ],
        tmp,
    )
    phases = {k: scalars(log_dir, f"time/{k}") for k in ("rollout", "score", "forward", "optimise")}
    return dict(
        step=[sum(v) for v in zip(*phases.values())],
        generation=phases["rollout"],
        forward_backward=[f + o for f, o in zip(phases["forward"], phases["optimise"])],
    )


def ppo_queries(env, n: int, seed: int) -> list:
    """n tokenised training prompts (their last 48 tokens at most)."""
    import random

    import torch
    from datasets import load_dataset

    prompts = load_dataset("json", data_files=env["files"]["chatterbot-prompts"], split="train")["prompt"]
    rng = random.Random(seed)
    return [torch.tensor(env["tokenizer"](p)["input_ids"][-48:]) for p in rng.sample(prompts, n)]


def ppo_trl(spec, env, tmp, tag, flags=()):
    import torch
    from transformers import AutoTokenizer
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    from ppo import reward_fn

    batch = spec["batch_size"]
    tokenizer = AutoTokenizer.from_pretrained(env["model"])
    tokenizer.pad_token = tokenizer.eos_token
    config = PPOConfig(
        batch_size=batch,
        mini_batch_size=batch // 2,
        ppo_epochs=4,
        learning_rate=3e-4,
        seed=1,
        exp_name="bench",
        accelerator_kwargs=dict(mixed_precision="bf16" if spec["bf16"] else "no"),
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(env["model"])
    shared = int(flags[1]) if flags and flags[0] == "--num-shared-layers" else None
    trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer, num_shared_layers=shared)
    gen_kwargs = dict(
        min_length=-1, top_k=0, top_p=1.0, do_sample=True, pad_token_id=tokenizer.eos_token_id, max_new_tokens=16
    )
    out = dict(step=[], generation=[], forward_backward=[])
    for step in range(spec["warmup"] + spec["steps"]):
        queries = [q.to(trainer.accelerator.device) for q in ppo_queries(env, batch, step)]
        t0 = clock()
        responses = trainer.generate(queries, batch_size=batch, return_prompt=False, **gen_kwargs)
        t1 = clock()
        scores = [torch.tensor(s) for s in reward_fn(tokenizer.batch_decode(queries), tokenizer.batch_decode(responses))]
        stats = trainer.step(queries, responses, scores)
        t2 = clock()
        out["step"].append(t2 - t0)
        out["generation"].append(t1 - t0)
        out["forward_backward"].append(stats["time/ppo/forward_pass"] + stats["time/ppo/optimize_step"])
    return out


# DDPO on the tiny Stable Diffusion: 2 x 8 images per epoch, 10 DDIM steps (eta 1, guidance 5), LoRA rank 4 on the
# UNet attention, PPO over batches of 4 with per-prompt advantages, JPEG compressibility as the reward
DDPO_SETTINGS = dict(
    sample_num_steps=10,
    sample_eta=1.0,
    sample_guidance_scale=5.0,
    sample_batch_size=8,
    sample_num_batches_per_epoch=2,
    train_batch_size=4,
    train_learning_rate=1e-2,
    train_clip_range=1e-2,
    train_cfg=True,
    per_prompt_stat_tracking=True,
    per_prompt_stat_tracking_buffer_size=16,
    per_prompt_stat_tracking_min_count=16,
)


# Critic-free online RL: one optimizer step per generation batch of 128 completions (GRPO: 16 prompts x 8, RLOO:
# 64 x 2), 16 new tokens, micro-batches of 32, exact-match reward, no vLLM; TRL's defaults otherwise (GRPO: dapo loss,
# beta 0; RLOO: beta 0.05, so both sides run a reference model)
ONLINE = {"grpo": dict(prompts=16, num_generations=8, beta=0.0), "rloo": dict(prompts=64, num_generations=2, beta=0.05)}


def online_ours(spec, env, tmp, tag, flags=()):
    log_dir, setting = os.path.join(tmp, "runs", tag), ONLINE[spec["algo"]]
    run_ours(
        f"{spec['algo']}.py",
        [
            "--model-name",
            env["model"],
            "--dataset-name",
            env["files"]["arith"],
            "--total-prompts",
            (spec["warmup"] + spec["steps"]) * setting["prompts"],
            "--batch-size",
            setting["prompts"],
            "--num-generations",
            setting["num_generations"],
            "--beta",
            setting["beta"],
            "--mini-batch-size",
            32,
            "--gradient-accumulation-steps",
            4,
            "--max-completion-length",
            16,
            "--eval-samples",
            16,
            "--log-freq",
            10**6,
            "--output-dir",
            os.path.join(tmp, "out"),
            "--log-dir",
            log_dir,
            *sampler_flag(spec),
            *flags,
        ],
        tmp,
    )
    return dict(step=scalars(log_dir, "time/step"))


def online_trl(spec, env, tmp, tag, flags=()):
    import trl
    from datasets import load_dataset

    def exact_match(prompts, completions, answer, **columns):
        return [float(c.strip().split("\n")[0].strip() == a) for c, a in zip(completions, answer)]

    setting, name = ONLINE[spec["algo"]], spec["algo"].upper()
    timer = step_timer()
    config = getattr(trl, f"{name}Config")(
        **trl_common(spec, tmp),
        per_device_train_batch_size=32,
        gradient_accumulation_steps=4,
        num_generations=setting["num_generations"],
        beta=setting["beta"],
        max_completion_length=16,
        learning_rate=1e-4,
    )
    getattr(trl, f"{name}Trainer")(
        model=env["model"],
        reward_funcs=exact_match,
        args=config,
        callbacks=[timer],
        processing_class=env["tokenizer"],
        train_dataset=load_dataset("json", data_files=env["files"]["arith"], split="train"),
    ).train()
    return dict(step=timer.times)


def ddpo_ours(spec, env, tmp, tag, flags=()):
    log_dir = os.path.join(tmp, "runs", tag)
    settings = [x for k, v in DDPO_SETTINGS.items() if not isinstance(v, bool) for x in ("--" + k.replace("_", "-"), v)]
    run_ours(
        "ddpo.py",
        [
            "--pretrained-model",
            env["pipeline"],
            "--num-epochs",
            spec["warmup"] + spec["steps"],
            *settings,
            "--eval-samples",
            0,
            "--save-freq",
            0,
            "--output-dir",
            os.path.join(tmp, "out"),
            "--log-dir",
            log_dir,
            *flags,
        ],
        tmp,
    )
    return dict(step=scalars(log_dir, "time/epoch"))


def ddpo_trl(spec, env, tmp, tag, flags=()):
    from trl import DDPOConfig, DDPOTrainer, DefaultDDPOStableDiffusionPipeline

    from ddpo import PROMPT_FNS, jpeg_compressibility

    config = DDPOConfig(
        num_epochs=spec["warmup"] + spec["steps"],
        mixed_precision="bf16" if spec["bf16"] else "no",
        log_with=None,
        save_freq=10**6,
        allow_tf32=True,
        seed=1,
        **DDPO_SETTINGS,
        project_kwargs=dict(project_dir=os.path.join(tmp, "trl_ddpo"), automatic_checkpoint_naming=True),
    )
    pipeline = DefaultDDPOStableDiffusionPipeline(env["pipeline"], use_lora=True)
    trainer = DDPOTrainer(config, jpeg_compressibility, PROMPT_FNS["animals"], pipeline)
    times, global_step = [], 0
    for epoch in range(config.num_epochs):
        t0 = clock()
        global_step = trainer.step(epoch, global_step)
        times.append(clock() - t0)
    return dict(step=times)


RUNS = {
    "sft": (trainer_ours, trainer_trl),
    "rm": (trainer_ours, trainer_trl),
    "dpo": (trainer_ours, trainer_trl),
    "ppo": (ppo_ours, ppo_trl),
    "ddpo": (ddpo_ours, ddpo_trl),
    "grpo": (online_ours, online_trl),
    "rloo": (online_ours, online_trl),
}


def dialogue_piece(tok, rng, n: int) -> str:
    """About n tokens of the built-in dialogue lines, joined, from a random place."""
    from common.loading import load_data

    if not hasattr(dialogue_piece, "ids"):
        dialogue_piece.ids = tok("\n".join(load_data("builtin:chatterbot-dialogue")["text"]))["input_ids"]
    start = rng.randrange(len(dialogue_piece.ids) - n)
    return tok.decode(dialogue_piece.ids[start : start + n])


def sft_texts(seq_length: int):
    """The SFT data: the built-in dialogue at 128 tokens, else 512 texts longer than seq_length (cut to it)."""
    import random

    from datasets import Dataset

    from common.loading import load_data, load_tokenizer

    if seq_length <= 128:
        return load_data("builtin:chatterbot-dialogue")
    tok, rng = load_tokenizer("builtin:tiny-gpt2"), random.Random(0)
    return Dataset.from_dict({"text": [dialogue_piece(tok, rng, seq_length + 16) for _ in range(512)]})


def preference_pairs(seq_length: int = 128):
    """The reward-model / DPO data: at 128 tokens the first 512 built-in VADER pairs whose prompt + response stays under
    120 tokens on both sides, so that neither side truncates (ours) or drops (TRL 1.x filters pairs over max_length) a
    pair; longer, 512 pairs of dialogue pieces whose prompt and answers take just under half of seq_length each."""
    import random

    from datasets import Dataset

    from common.loading import load_data, load_tokenizer

    tok = load_tokenizer("builtin:tiny-gpt2")
    if seq_length > 128:
        rng, half = random.Random(1), seq_length // 2 - 16  # re-tokenising a decoded piece can add a token or two
        rows = [
            dict(
                prompt=dialogue_piece(tok, rng, half),
                chosen=" " + dialogue_piece(tok, rng, half),
                rejected=" " + dialogue_piece(tok, rng, half),
            )
            for _ in range(512)
        ]
        return Dataset.from_list(rows)

    def fits(row):
        return all(len(tok(row["prompt"] + " " + row[c])["input_ids"]) < 120 for c in ("chosen", "rejected"))

    return load_data("builtin:vader-preferences").filter(fits).select(range(512))
