"""Every method on one real model and one task, side by side: SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct) on
reasoning-gym's one-digit two-term chain_sum, chat prompts ending with "Give only the final answer.", the answer read as
the reply's last number, 64 held-out problems whose questions never occur in training (136 training questions).

Each method runs through its script's real CLI (the commands are printed and kept in the table), then every trained
model is evaluated the same way on the held-out problems: greedy accuracy; sampled accuracy (temperature 1,
--eval-samples replies per problem); the KL to the initial model (nats per completion, the sum over its tokens of
log pi - log pi_0 on the sampled replies); the completion length; the number of distinct answers per problem.

With --seeds 1 2 3 every method runs once per seed: the seed changes the training order, the sampling, the self-sampled
data of rft / dpo / the reward models and TRL's seed; the problems (training and held-out, --data-seed 1) and the final
evaluation's draws stay fixed. The table gives mean ± standard deviation [min, max] over the seeds, the plot the mean
curve with a min-max band. A method already in the results of a seed is kept, so an interrupted sweep resumes (--rerun
replaces it).

- grpo, rloo: the verifier's reward, 8 prompts x 4 completions per update;
- ppo: ppo.py with the same verifier (--reward-funcs verifier), a value head, the adaptive KL penalty;
- rft: rejection-sampling fine-tuning: sft.py on the base model's own correct replies to the training questions;
- dpo: dpo.py on pairs of the base model's own replies, the verifier's choice (a correct one over a wrong one);
- rm_ppo: reward_modeling.py on pairs of the base model's replies (16 per question, up to 8 pairs per question, one
  epoch), then ppo.py against that learned reward, the verifier watched beside it (--gold-reward-funcs: never trained
  on);
- rm_ppo_kl: a reward model trained as rm_ppo's (the same command on the seed's same samples), then PPO with the KL
  held near 2 nats (--target 2 --horizon 32: the controller may move the coefficient 10% per update, rm_ppo's 1%);
- rm_ppo_small: the same on dpo's pairs (8 replies, up to 4 pairs per question, two epochs): the first try, with a
  third of the pairs (docs/real-model.md, "The learned reward");
- trl_grpo, trl_rloo: TRL's GRPOTrainer and RLOOTrainer (benchmarks/setup.sh installs TRL) on the same model, data,
  reward and settings, for --trl-steps steps, evaluated as ours;
- grpo_linear, rloo_linear: grpo's and rloo's commands with TRL's learning-rate schedule (--lr-scheduler-type linear:
  decayed to 0 by the last step, where the scripts keep it constant), the one setting in which ours and TRL's differ.

    python benchmarks/real_model.py                                  # everything; writes the table and the plot
    python benchmarks/real_model.py --methods grpo rloo --threads 2   # some methods
    python benchmarks/real_model.py --seeds 1 2 3                      # three seeds per method (resumes)
    python benchmarks/real_model.py --report-only                     # the table and plot from the results on disk
    python benchmarks/real_model.py --check                           # the regression guard (about 8 minutes)

--check is the guard to run before changing grpo.py's loss or sampling: grpo.py's row for seed 1, cut to
--check-updates updates; it fails when the held-out accuracy at the end (grpo.py's own evaluation) leaves the band of
the recorded seeds' curves at that point, widened by --check-margin.
"""

import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from real_model_report import CRITIC_ABLATION, CRITIC_TAGS, FEATURES, METHODS, report  # noqa: E402
from records import median, scalars  # noqa: E402

from common.chat import render  # noqa: E402
from common.cli import cli  # noqa: E402
from common.core import logprobs_from_logits  # noqa: E402
from common.fast_paths import sampling_kwargs  # noqa: E402
from common.loading import load_pretrained, load_tokenizer  # noqa: E402
from common.rewards import distinct_answers, load_task, verifier  # noqa: E402
from common.run import machine as cpu_machine  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the evaluation's and TRL's; the scripts pick theirs alike
TASK = ["--dataset-name", "reasoning-gym:chain_sum", "--data-seed", "1"]  # the default task config, seed 1's problems
# the methods that learn from the base model's own replies, and the folder of those replies (in a seed's folder)
SELF_SAMPLED = {"rft": "self_samples", "dpo": "self_samples", "rm_ppo": "rm_samples", "rm_ppo_kl": "rm_samples"}
SELF_SAMPLED["rm_ppo_small"] = SELF_SAMPLED["kto"] = "self_samples"


@dataclass
class Args:
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """which methods to run (of grpo rloo ppo rft dpo rm_ppo rm_ppo_kl rm_ppo_small trl_grpo trl_rloo grpo_linear
    rloo_linear grpo_vllm kto)"""
    folder: str = "outputs/real_model"
    """where the runs, their logs and the self-sampled data go"""
    threads: int = 2
    """torch threads of every run (OMP_NUM_THREADS), ours and TRL's alike"""
    updates: int = 20
    """grpo / rloo updates of 8 prompts x 4 completions (16-30 s each on 2 CPU cores, by the CPU)"""
    prompts: int = 8
    """grpo / rloo prompts per update, 4 completions each (the recipe: 8; an even number fewer makes a quick check)"""
    ppo_updates: int = 20
    """ppo / rm_ppo updates of 16 episodes"""
    self_samples: int = 8
    """replies sampled per training question for rft, dpo and rm_ppo_small's reward model (up to half as many pairs)"""
    rm_samples: int = 16
    """replies sampled per training question for rm_ppo's reward model (up to half as many pairs per question)"""
    trl_steps: int = 20
    """TRL GRPOTrainer / RLOOTrainer steps (of 8 prompts x 4 completions, as ours)"""
    eval_samples: int = 2
    """sampled replies per held-out problem in the final evaluation"""
    eval_problems: int = 64
    """held-out problems evaluated (during and after training); fewer make a quick check"""
    seeds: list[int] = field(default_factory=lambda: [1])
    """training seeds: every method runs once per seed (the problems and the evaluation stay those of seed 1)"""
    rerun: bool = False
    """run the methods again for seeds whose results are already in `folder` (else they are kept: a sweep resumes)"""
    report_only: bool = False
    """draw the table and the plot from the results already in `folder`"""
    check: bool = False
    """the regression guard: grpo.py's row for the first seed, cut to `check_updates` updates; fails outside the band"""
    check_updates: int = 10
    """updates of the --check run (the band is the recorded curves' at that point)"""
    check_margin: float = 0.1
    """how far outside the recorded seeds' min-max the --check accuracy may land (64 problems: one sd is about 0.06)"""
    write: str = "benchmarks/RESULTS-real-model.md"
    """the results file (the plot goes beside it as a PNG)"""


# ---- the runs: each method's command, through the scripts' real CLIs ----

RL = ["--model-name", MODEL, *TASK, "--max-completion-length", "32", "--log-freq", "10"]


def groups(prompts: int) -> list[str]:
    """`prompts` prompts x 4 completions an update, in mini-batches of (at most) 8, one optimizer step an update."""
    mini_batch = min(8, 4 * prompts)
    return ["--batch-size", str(prompts), "--num-generations", "4", "--mini-batch-size", str(mini_batch)] + [
        "--gradient-accumulation-steps", str(4 * prompts // mini_batch)
    ]  # fmt: skip


def commands(args: Args, folder: str, seed: int) -> dict[str, list[list[str]]]:
    """Each method's commands (python script.py ...) for one seed, in the order they run."""

    def out(name: str) -> list[str]:  # this benchmark's own folders: a rerun replaces them
        return ["--output-dir", os.path.join(folder, name), "--log-dir", os.path.join(folder, "runs", name), "--overwrite"]

    every = max(1, args.updates // 4)
    rl = [*RL, "--seed", str(seed), "--eval-samples", str(args.eval_problems)]
    ppo = ["--model-name", MODEL, *TASK, "--seed", str(seed), "--min-new-tokens", "32", "--max-new-tokens", "32"]
    ppo += ["--eval-samples", str(args.eval_problems)]
    ppo += ["--batch-size", "16", "--mini-batch-size", "8", "--total-episodes", str(16 * args.ppo_updates)]
    ppo += ["--eval-freq", str(max(1, args.ppo_updates // 4)), "--learning-rate", "1.41e-5", "--log-freq", "10"]
    data = os.path.join(folder, "self_samples")
    # the PPO of OpenRLHF / verl at grpo's budget: 8 prompts x 4 completions an update, one pass in mini-batches of 8
    # (4 optimizer steps), a critic of its own (the policy's copy: the verifier has no weights), GAE lambda 1 for both,
    # no KL (grpo's beta 0)
    critic = ["--model-name", MODEL, *TASK, "--seed", str(seed), "--min-new-tokens", "32", "--max-new-tokens", "32"]
    critic += ["--eval-samples", str(args.eval_problems), "--reward-funcs", "verifier", "--eval-freq", str(every)]
    critic += ["--batch-size", "32", "--n-samples-per-prompt", "4", "--mini-batch-size", "8", "--ppo-epochs", "1"]
    critic += ["--total-episodes", str(32 * args.updates), "--learning-rate", "1e-5", "--log-freq", "10"]
    critic += ["--value-model-path", "auto", "--critic-learning-rate", "5e-5", "--lam", "1.0", "--critic-lam", "1.0"]
    critic += ["--init-kl-coef", "0"]  # (and --no-adap-kl-ctrl, below: a flag without a value)

    def rm_ppo(pairs: str, epochs: int, suffix: str, kl: tuple = ()) -> list[list[str]]:  # a reward model, then PPO
        rm = os.path.join(folder, "rm" + suffix)
        return [
            ["reward_modeling.py", "--model-name", MODEL, "--dataset-name", os.path.join(folder, pairs, "pairs.jsonl")]
            + ["--learning-rate", "1e-5", "--batch-size", "8", "--num-epochs", str(epochs), "--max-length", "128"]
            + ["--seed", str(seed), *out("rm" + suffix)],
            ["ppo.py", *ppo, "--reward-model", rm, "--gold-reward-funcs", "verifier", *kl] + out("rm_ppo" + suffix),
        ]

    def critic_free(script: str, name: str, *flags: str) -> list[list[str]]:  # grpo / rloo, 8 x 4 an update
        return [
            [script, *rl, *groups(args.prompts), "--total-prompts", str(args.prompts * args.updates)]
            + ["--learning-rate", "1e-5", *flags, "--eval-freq", str(every), *out(name)]
        ]

    linear = ("--lr-scheduler-type", "linear")  # TRL's schedule: the learning rate decayed to 0 by the last update
    return {
        "grpo": critic_free("grpo.py", "grpo"),
        "grpo_linear": critic_free("grpo.py", "grpo_linear", *linear),
        "grpo_vllm": critic_free("grpo.py", "grpo_vllm", "--use-vllm", "--vllm-dtype", "float32"),
        "grpo_vllm_bf16": critic_free("grpo.py", "grpo_vllm_bf16", "--use-vllm", "--vllm-dtype", "bfloat16"),
        **{name: critic_free("grpo.py", name, *flags) for name, flags in FEATURES.items()},
        "rloo": critic_free("rloo.py", "rloo", "--beta", "0"),
        "rloo_linear": critic_free("rloo.py", "rloo_linear", *linear, "--beta", "0"),
        "ppo": [["ppo.py", *ppo, "--reward-funcs", "verifier", *out("ppo")]],
        "ppo_critic": [["ppo.py", *critic, "--no-adap-kl-ctrl", *out("ppo_critic")]],
        **{
            name: [["ppo.py", *ablated(critic, change), "--no-adap-kl-ctrl", *out(name)]]
            for name, change in CRITIC_ABLATION.items()
        },
        "rft": [
            ["sft.py", "--model-name", MODEL, "--dataset-name", os.path.join(data, "rft.jsonl"), "--prompt-column"]
            + ["prompt", "--completion-column", "completion", "--learning-rate", "1e-5", "--num-epochs", "2"]
            + ["--batch-size", "8", "--eval-fraction", "0.05", "--max-seq-length", "128", "--seed", str(seed)]
            + [*out("rft")]
        ],
        "dpo": [
            ["dpo.py", "--model-name", MODEL, "--dataset-name", os.path.join(data, "pairs.jsonl"), "--beta", "0.1"]
            + ["--learning-rate", "5e-6", "--batch-size", "8", "--max-length", "128", "--eval-fraction", "0.05"]
            + ["--seed", str(seed), *out("dpo")]
        ],
        # dpo's pairs unpaired by kto.py: each correct reply desirable, each wrong one undesirable; dpo's settings
        "kto": [
            ["kto.py", "--model-name", MODEL, "--dataset-name", os.path.join(data, "pairs.jsonl"), "--beta", "0.1"]
            + ["--learning-rate", "5e-6", "--batch-size", "8", "--max-length", "128", "--eval-fraction", "0.05"]
            + ["--seed", str(seed), *out("kto")]
        ],
        "rm_ppo": rm_ppo(SELF_SAMPLED["rm_ppo"], 1, ""),
        # rm_ppo's reward model (its command, on the seed's samples), then PPO with the KL held near 2 nats
        "rm_ppo_kl": rm_ppo(SELF_SAMPLED["rm_ppo_kl"], 1, "_kl", ("--target", "2", "--horizon", "32")),
        "rm_ppo_small": rm_ppo(SELF_SAMPLED["rm_ppo_small"], 2, "_small"),
    }


def ablated(flags: list[str], change: tuple[str, str]) -> list[str]:
    """`flags` with one flag's value changed (added if absent); without a separate critic, no critic learning rate."""
    pairs = dict(zip(flags[::2], flags[1::2])) | dict([change])
    if pairs.get("--value-model-path") == "None":
        pairs.pop("--critic-learning-rate")
    return [x for pair in pairs.items() for x in pair]


def run(command: list[str], threads: int) -> float:
    """One script through its CLI, its output in a log beside its run; returns the wall time."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    print("$ python " + shlex.join(command), flush=True)
    start = time.time()
    log = command[command.index("--output-dir") + 1] + ".log"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{command[0]} failed: see {log}")
    return time.time() - start


# ---- the data the offline methods learn from: the base model's own replies, graded ----


@torch.no_grad()
def generate(model, tokenizer, prompts: list, n: int = 1, greedy: bool = False, batch: int = 64, seed: int = 0):
    """n replies to each chat prompt (32 new tokens at most), as text and token ids, sampled at temperature 1 by the
    scripts' own sampler (or greedy)."""
    torch.manual_seed(seed)
    texts, ids, all_prompts = [], [], [p for p in prompts for _ in range(n)]
    sampling = dict(do_sample=False) if greedy else sampling_kwargs(1.0, 0, 1.0)
    for i in range(0, len(all_prompts), batch):
        rendered = [render(tokenizer, p)[0] for p in all_prompts[i : i + batch]]
        inputs = tokenizer(rendered, padding=True, add_special_tokens=False, return_tensors="pt").to(model.device)
        out = model.generate(**inputs, max_new_tokens=32, pad_token_id=tokenizer.pad_token_id, **sampling)
        for row in out[:, inputs["input_ids"].shape[1] :]:
            ended = (row == tokenizer.eos_token_id).nonzero()
            row = row[: ended[0, 0] + 1] if len(ended) else row  # up to and including the first <|im_end|>
            ids.append(row.tolist())
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts, ids


def self_samples(folder: str, name: str, n: int, seed: int) -> dict:
    """In `folder`/`name`: rft.jsonl (the correct replies) and pairs.jsonl (a correct reply over a wrong one, up to n / 2
    pairs per question) from n replies of the base model to every training question, drawn with the seed."""
    data = os.path.join(folder, name)
    if os.path.isfile(os.path.join(data, "stats.json")):
        return json.load(open(os.path.join(data, "stats.json")))
    os.makedirs(data, exist_ok=True)
    tokenizer = load_tokenizer(MODEL, padding_side="left")
    model = load_pretrained(MODEL, AutoModelForCausalLM).to(DEVICE).eval()
    train, _ = task()
    questions = list({json.dumps(r["prompt"]): r for r in train}.values())
    start = time.time()
    texts, _ = generate(model, tokenizer, [q["prompt"] for q in questions], n=n, seed=seed)
    grades = verifier(
        None,
        texts,
        [q["answer"] for q in questions for _ in range(n)],
        rg_entry=[q["rg_entry"] for q in questions for _ in range(n)],
    )
    rft, pairs = [], []
    for i, q in enumerate(questions):
        replies = list(zip(texts[i * n : (i + 1) * n], grades[i * n :]))
        right, wrong = [t for t, g in replies if g == 1], [t for t, g in replies if g < 1]
        rft += [dict(prompt=q["prompt"], completion=[{"role": "assistant", "content": t}]) for t in right]
        chosen = [{"role": "assistant", "content": t} for t in right]
        rejected = [{"role": "assistant", "content": t} for t in wrong]
        pairs += [dict(prompt=q["prompt"], chosen=[c], rejected=[r]) for c, r in list(zip(chosen * n, rejected))[: n // 2]]
    for name, rows in (("rft", rft), ("pairs", pairs)):
        with open(os.path.join(data, f"{name}.jsonl"), "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows))
    stats = dict(
        samples=len(texts),
        correct=sum(g == 1 for g in grades),
        rft=len(rft),
        pairs=len(pairs),
        questions=len(questions),
        seconds=time.time() - start,
    )
    json.dump(stats, open(os.path.join(data, "stats.json"), "w"))
    return stats


def task():
    """The training and held-out rows of the scripts' default task with chat prompts (rewards.load_task)."""
    tokenizer = load_tokenizer(MODEL)
    config = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    args = SimpleNamespace(dataset_name="reasoning-gym:chain_sum", seed=1, task_config=config, train_size=2000, eval_size=64)
    args.__dict__.update(chat_template=True, task_instruction="Give only the final answer.", system_prompt=None)
    return load_task(args, tokenizer, "prompt", 64)[:2]


# ---- the same evaluation for every model ----


@torch.no_grad()
def evaluate(folder_or_name: str, samples: int, problems: int = 64) -> dict:
    """Greedy and sampled held-out accuracy, KL to the initial model, completion length, distinct answers."""
    tokenizer = load_tokenizer(MODEL, padding_side="left")
    model = load_pretrained(folder_or_name, AutoModelForCausalLM).to(DEVICE).eval()
    held_out = task()[1][:problems]
    prompts, answers = [r["prompt"] for r in held_out], [r["answer"] for r in held_out]
    entries = [r["rg_entry"] for r in held_out]
    greedy, _ = generate(model, tokenizer, prompts, greedy=True)
    sampled, ids = generate(model, tokenizer, prompts, n=samples, seed=2)

    def repeat(values: list) -> list:  # each problem's value for each of its replies
        return [x for x in values for _ in range(samples)]

    base = load_pretrained(MODEL, AutoModelForCausalLM).to(DEVICE).eval()
    kls = []  # k1: the sum over each reply of log pi - log pi_0, on pi's own samples, 32 replies per forward pass
    prompt_ids = [tokenizer(render(tokenizer, p)[0], add_special_tokens=False)["input_ids"] for p in repeat(prompts)]
    for i in range(0, len(ids), 32):
        rows = [p + c for p, c in zip(prompt_ids[i : i + 32], ids[i : i + 32])]
        batch = tokenizer.pad({"input_ids": rows}, padding_side="left", return_tensors="pt").to(DEVICE)
        position_ids = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
        labels = batch["input_ids"][:, 1:]
        logps = [logprobs_from_logits(m(**batch, position_ids=position_ids).logits[:, :-1], labels) for m in (model, base)]
        completion = torch.zeros_like(labels, dtype=torch.bool)  # the reply's tokens: the last len(reply) positions
        for row, c in enumerate(ids[i : i + 32]):
            completion[row, labels.shape[1] - len(c) :] = True
        kls += ((logps[0] - logps[1]) * completion).sum(1).tolist()
    per_problem = [distinct_answers(sampled[i * samples : (i + 1) * samples], True)[1] for i in range(len(prompts))]
    return dict(
        greedy=sum(verifier(None, greedy, answers, rg_entry=entries)) / len(prompts),
        sampled=sum(verifier(None, sampled, repeat(answers), rg_entry=repeat(entries))) / len(sampled),
        kl=sum(kls) / len(kls),
        length=sum(len(i) for i in ids) / len(ids),
        distinct=sum(per_problem) / len(per_problem),
    )


# ---- TRL's GRPOTrainer on the same model, data, reward and settings ----


def trl_run(args: Args, folder: str, name: str, seed: int) -> tuple[float, float]:
    """`trl_steps` steps of TRL 1.x's GRPOTrainer or RLOOTrainer (`name`: trl_grpo, trl_rloo) with our runs' settings (8
    prompts x 4 completions, 32 new tokens, lr 1e-5, beta 0, temperature 1, the verifier's reward, the same chat
    prompts; TRL's defaults otherwise, gradient checkpointing off as ours has none, float32 as ours), saved for the
    evaluation. Returns the median step time and the median time of its rollouts (TRL's `_generate`) per step."""
    sys.path.insert(0, os.path.join(HERE, ".trl-current"))
    import trl
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import TrainerCallback

    torch.set_num_threads(args.threads)
    train, _ = task()
    rows = [dict(prompt=r["prompt"], answer=r["answer"], rg_entry=r["rg_entry"]) for r in train]
    times, rollouts = [], []

    def synchronized_time() -> float:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return time.time()

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = synchronized_time()
            rollouts.append(0.0)

        def on_step_end(self, *a, **k):
            times.append(synchronized_time() - self.start)
            print(f"{name} step {len(times)}: {times[-1]:.1f}s (rollout {rollouts[-1]:.1f}s)", flush=True)

    kind = "GRPO" if name == "trl_grpo" else "RLOO"
    config = getattr(trl, f"{kind}Config")(
        output_dir=os.path.join(folder, f"{name}_tmp"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_completion_length=32,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        max_steps=args.trl_steps,
        gradient_checkpointing=False,
        bf16=False,  # TRL's default is bf16 autocast; ours train in float32 (and a CPU without bf16 instructions crawls)
        use_cpu=DEVICE == "cpu",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=seed,
    )
    model = load_pretrained(MODEL, AutoModelForCausalLM)
    trainer = getattr(trl, f"{kind}Trainer")(
        model=model,
        reward_funcs=verifier,
        args=config,
        train_dataset=Dataset(InMemoryTable.from_pylist(rows), fingerprint="real-model-train"),  # no hashing of rows
        processing_class=load_tokenizer(MODEL, padding_side="left"),
        callbacks=[Timer()],
    )
    generate = trainer._generate

    def timed_generate(*a, **k):  # TRL's rollout: generation and decoding, before scoring
        start = synchronized_time()
        out = generate(*a, **k)
        rollouts[-1] += synchronized_time() - start
        return out

    trainer._generate = timed_generate
    trainer.train()
    trainer.model.save_pretrained(os.path.join(folder, name))
    load_tokenizer(MODEL).save_pretrained(os.path.join(folder, name))
    return median(times), median(rollouts)


# (TensorBoard folder, the held-out accuracy tag, completions sampled per update, the step-time tags, the rollout tag)
PPO_PHASES = ["time/rollout", "time/score", "time/forward", "time/optimise"]
CURVES = {
    "grpo": ("grpo", "eval/reward", 32, ["time/step"], "time/generate"),
    "grpo_linear": ("grpo_linear", "eval/reward", 32, ["time/step"], "time/generate"),
    "grpo_vllm": ("grpo_vllm", "eval/reward", 32, ["time/step"], "time/generate"),
    "grpo_vllm_bf16": ("grpo_vllm_bf16", "eval/reward", 32, ["time/step"], "time/generate"),
    "rloo_linear": ("rloo_linear", "eval/reward", 32, ["time/step"], "time/generate"),
    "rloo": ("rloo", "eval/reward", 32, ["time/step"], "time/generate"),
    "ppo": ("ppo", "eval/reward_mean", 16, PPO_PHASES, "time/rollout"),
    "rft": ("rft", None, 0, ["time/step"], None),
    "dpo": ("dpo", None, 0, ["time/step"], None),
    "kto": ("kto", None, 0, ["time/step"], None),
    "rm_ppo": ("rm_ppo", "eval/gold/verifier", 16, PPO_PHASES, "time/rollout"),  # the verifier, watched
    "rm_ppo_kl": ("rm_ppo_kl", "eval/gold/verifier", 16, PPO_PHASES, "time/rollout"),
    "rm_ppo_small": ("rm_ppo_small", "eval/gold/verifier", 16, PPO_PHASES, "time/rollout"),
}
CURVES |= {name: (name, "eval/reward_mean", 32, PPO_PHASES, "time/rollout") for name in ("ppo_critic", *CRITIC_ABLATION)}
CURVES |= {name: (name, "eval/reward", 32, ["time/step"], "time/generate") for name in FEATURES}
# what docs/grpo.md reads of each feature's run, update by update
FEATURE_TAGS = ["entropy", "entropy_coef", "frac_reward_zero_std", "dynamic_sampling/rounds", "dynamic_sampling/filled"]


def step_time(folder: str, method: str) -> tuple[float, int, float]:
    """The median seconds per update (the sum of the phases for PPO), the number of updates of a method's run and the
    median seconds of its rollouts (generation) per update."""
    run, _, _, tags, rollout = CURVES[method]
    series = [[v for _, v in scalars(os.path.join(folder, "runs", run), t)] for t in tags]
    steps = [sum(vs) for vs in zip(*series)] if series and all(series) else []
    rollouts = [v for _, v in scalars(os.path.join(folder, "runs", run), rollout)] if rollout else []
    return median(steps), len(steps), median(rollouts)


def with_curve(r: dict, folder: str, method: str) -> dict:
    """One seed's result with what its run's TensorBoard log says (when the run is on disk): step times, the number of
    updates, the completions sampled and the held-out accuracy curve against completions."""
    drawn = r.get("self_samples", {}).get("samples", 0)  # the replies drawn to build the offline data
    if method in CURVES and os.path.isdir(os.path.join(folder, "runs", CURVES[method][0])):
        run, tag, per_update = CURVES[method][:3]
        r["step_s"], r["updates"], r["rollout_s"] = step_time(folder, method)
        r["completions"] = drawn + per_update * r["updates"]
        curve = scalars(os.path.join(folder, "runs", run), tag) if tag else []
        r["curve"] = [(drawn + per_update * step, value) for step, value in curve]
        gap = scalars(os.path.join(folder, "runs", run), "sampling/sampling_logp_difference/mean")
        if gap:  # the sampler-trainer gap per token, where a run logs it (--use-vllm)
            r["sampler_gap"] = [(drawn + per_update * step, value) for step, value in gap]
    if method.startswith("rm_ppo") and os.path.isdir(os.path.join(folder, "runs", method)):  # the learned reward
        r["learned_reward"] = learned_reward(folder, method, drawn)
    if method in FEATURES and os.path.isdir(os.path.join(folder, "runs", method)):  # what the feature holds, per update
        run = os.path.join(folder, "runs", method)
        r["feature"] = {tag: [value for _, value in scalars(run, tag)] for tag in FEATURE_TAGS}
    if method.startswith("ppo") and os.path.isdir(os.path.join(folder, "runs", method)):  # the critic beside the reward
        run, per_update = os.path.join(folder, "runs", method), CURVES[method][2]
        r["critic"] = {
            name: [(per_update * step, value if math.isfinite(value) else None) for step, value in scalars(run, tag)]
            for name, tag in CRITIC_TAGS.items()
        }
    return r


def learned_reward(folder: str, method: str, drawn: int) -> dict:
    """What a PPO run against the learned reward (`method`) says of its reward model: its accuracy on the pairs it held
    out (of the same questions), and along PPO, on the held-out problems' samples, its mean score (the proxy), the
    verifier's accuracy (the gold) and their correlation; per update, the same on the training samples."""
    rm, ppo = os.path.join(folder, "runs", method.replace("rm_ppo", "rm")), os.path.join(folder, "runs", method)

    def curve(run: str, tag: str) -> list:
        return [(drawn + 16 * step, value) for step, value in scalars(run, tag)]

    accuracy = scalars(rm, "eval/accuracy")
    return dict(
        rm_accuracy=accuracy[-1][1] if accuracy else None,
        proxy=curve(ppo, "eval/reward_mean"),
        proxy_std=curve(ppo, "eval/reward_std"),
        gold=curve(ppo, "eval/gold/verifier"),
        correlation=curve(ppo, "eval/gold/correlation"),
        train_proxy=curve(ppo, "env/reward_mean"),
        train_gold=curve(ppo, "env/gold/verifier"),
        train_correlation=curve(ppo, "env/gold/correlation"),
        kl=curve(ppo, "objective/kl"),
        kl_coef=curve(ppo, "objective/kl_coef"),
    )


def machine() -> str:
    """The GPU the runs used (float32 weights and maths, TRL's too), else the CPU."""
    if DEVICE == "cuda":
        return f"one {torch.cuda.get_device_name()} (float32, no autocast, ours and TRL's), {os.cpu_count()} CPU cores"
    return cpu_machine()


def save(results_file: str, results: dict, seed: int, method: str) -> None:
    """Write one run's result into the results file as it is on disk now (sweeps of other methods may run beside this
    one, in the same folder), atomically."""
    on_disk = json.load(open(results_file)) if os.path.isfile(results_file) else {}
    on_disk |= {k: v for k, v in results.items() if k != "seeds"}
    on_disk.setdefault("seeds", {}).setdefault(str(seed), {})[method] = results["seeds"][str(seed)][method]
    with open(results_file + ".tmp", "w") as f:
        json.dump(on_disk, f, indent=1)
    os.replace(results_file + ".tmp", results_file)


def check(args: Args, folder: str) -> None:
    """grpo.py's row for the first seed, cut to `check_updates` updates; exits 1 when its held-out accuracy at the end
    leaves the recorded seeds' band at that point (the results JSON beside `args.write`), widened by `check_margin`."""
    recorded = json.load(open(os.path.splitext(os.path.join(ROOT, args.write))[0] + ".json"))
    curves = {s: dict(map(tuple, r["grpo"]["curve"])) for s, r in recorded.get("seeds", {}).items() if "grpo" in r}
    x = 32 * args.check_updates
    band = [c[x] for c in curves.values() if x in c]
    if not band:
        sys.exit(f"error: no recorded grpo curve has a point at {x} completions: run the sweep, or pick --check-updates")
    seed = args.seeds[0]
    os.makedirs(folder, exist_ok=True)
    plan = commands(Args(**{**vars(args), "updates": args.check_updates}), folder, seed)["grpo"]
    wall = sum(run(command, args.threads) for command in plan)
    curve = dict(scalars(os.path.join(folder, "runs", "grpo"), "eval/reward"))
    value = curve[args.check_updates]
    low, high = min(band) - args.check_margin, max(band) + args.check_margin
    verdict = "inside" if low <= value <= high else "OUTSIDE"
    print(
        f"check: grpo.py seed {seed}, {args.check_updates} updates ({wall / 60:.1f} min): held-out accuracy {value:.3f}, "
        f"{verdict} the band [{low:.3f}, {high:.3f}] (recorded seeds {', '.join(f'{v:.3f}' for v in band)}, "
        f"margin {args.check_margin})"
    )
    if verdict != "inside":
        sys.exit(1)


if __name__ == "__main__":
    args = cli(Args)
    torch.set_num_threads(args.threads)  # the evaluations and TRL's runs too
    folder = os.path.join(ROOT, args.folder)
    if args.check:
        check(args, os.path.join(folder, "check"))
        sys.exit(0)
    results_file = os.path.join(folder, "results.json")
    results = json.load(open(results_file)) if os.path.isfile(results_file) else {}
    results.setdefault("seeds", {})
    if not args.report_only:
        results |= dict(machine=machine(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        if "base" not in results:
            os.makedirs(folder, exist_ok=True)
            results["base"] = dict(evaluate(MODEL, args.eval_samples, args.eval_problems), completions=0)
        for seed in args.seeds:
            done, seed_folder = results["seeds"].setdefault(str(seed), {}), os.path.join(folder, f"seed_{seed}")
            os.makedirs(os.path.join(seed_folder, "runs"), exist_ok=True)
            plan = commands(args, seed_folder, seed)
            for method in args.methods:
                if method in done and not args.rerun:
                    print(f"seed {seed}, {method}: in {results_file} already (--rerun runs it again)", flush=True)
                    continue
                stats = {}
                if method in SELF_SAMPLED:
                    n = args.rm_samples if SELF_SAMPLED[method] == "rm_samples" else args.self_samples
                    stats = self_samples(seed_folder, SELF_SAMPLED[method], n, seed)
                start = time.time()
                if method.startswith("trl_"):
                    step, rollout = trl_run(args, seed_folder, method, seed)
                    extra = dict(step_s=step, rollout_s=rollout, completions=32 * args.trl_steps)
                    command = f"python benchmarks/real_model.py --methods {method} --trl-steps {args.trl_steps}"
                    extra["commands"] = [f"{command} --seeds {seed}"]
                else:
                    for command in plan[method]:
                        run(command, args.threads)
                    extra = dict(commands=["python " + shlex.join(c) for c in plan[method]], self_samples=stats)
                wall = time.time() - start
                done[method] = evaluate(os.path.join(seed_folder, method), args.eval_samples, args.eval_problems)
                done[method] |= extra | dict(wall_s=wall, threads=args.threads, machine=machine())
                done[method]["origin"] = f"the {time.strftime('%Y-%m-%d')} sweep"
                with_curve(done[method], seed_folder, method)
                save(results_file, results, seed, method)  # after every run: an interrupted sweep resumes
        results = json.load(open(results_file))  # with what sweeps beside this one wrote
    for seed, runs in results["seeds"].items():  # what each run's logs say, where the run is on disk
        for method, r in runs.items():
            with_curve(r, os.path.join(folder, f"seed_{seed}"), method)
    report(args, results, machine(), torch.__version__)
