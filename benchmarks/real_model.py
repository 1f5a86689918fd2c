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

import glob
import json
import math
import os
import shlex
import statistics
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
METHODS = ("grpo", "rloo", "ppo", "rft", "dpo", "rm_ppo", "rm_ppo_kl", "rm_ppo_small", "trl_grpo", "trl_rloo")
METHODS += ("grpo_linear", "rloo_linear")  # grpo and rloo with TRL's learning-rate schedule
METHODS += ("grpo_vllm", "grpo_vllm_bf16")  # grpo sampling through vLLM (--use-vllm), float32 and bfloat16
METHODS += ("kto",)  # kto.py on dpo's pairs, unpaired
# ppo.py as the field runs it: a separate critic, 4 completions a prompt, the KL out of the reward; and its ablation
CRITIC_ABLATION = {  # one part of ppo_critic changed each, one seed each
    "ppo_critic_lam95": ("--lam", "0.95"),  # the policy's GAE lambda below the critic's (VC-PPO's decoupled GAE)
    "ppo_critic_warmup": ("--freezing-actor-steps", "2"),  # two critic-only updates first
    "ppo_critic_one_sample": ("--n-samples-per-prompt", "1"),  # 32 prompts x 1 completion an update
    "ppo_critic_shared": ("--value-model-path", "None"),  # TRL 0.8's value head on the policy's trunk
}
METHODS += ("ppo_critic", *CRITIC_ABLATION)
# grpo's recipe with a research feature on, one seed each: the adaptive entropy bonus holding the entropy at a target
# (Skywork-OR1), and DAPO's dynamic sampling (no group of equal rewards in a batch)
FEATURES = {
    "grpo_entropy": ("--use-adaptive-entropy", "--entropy-target", "1.5", "--entropy-coef-delta", "0.1"),
    "grpo_dynamic": ("--dynamic-sampling", "--max-num-gen-batches", "4"),
}
METHODS += tuple(FEATURES)
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


# ---- report ----

LABELS = {
    "base": "SmolLM2-135M-Instruct, before training",
    "grpo": "GRPO (grpo.py, verifier)",
    "rloo": "RLOO (rloo.py, verifier)",
    "ppo": "PPO (ppo.py, verifier, value head)",
    "rft": "rejection-sampling SFT (sft.py on its own correct replies)",
    "dpo": "DPO (dpo.py on verifier-ranked pairs of its own replies)",
    "kto": "KTO (kto.py on the same pairs, unpaired)",
    "rm_ppo": "reward model (16 replies a question), then PPO against it",
    "rm_ppo_kl": "a reward model trained the same way, then PPO with the KL held near 2",
    "rm_ppo_small": "the first try: reward model on dpo's pairs, then PPO",
    "trl_grpo": "TRL 1.16 GRPOTrainer (same settings)",
    "trl_rloo": "TRL 1.16 RLOOTrainer (same settings)",
    "grpo_linear": "GRPO with TRL's learning-rate decay (grpo.py --lr-scheduler-type linear)",
    "rloo_linear": "RLOO with TRL's learning-rate decay (rloo.py --lr-scheduler-type linear)",
    "grpo_vllm": "GRPO sampling through vLLM (grpo.py --use-vllm --vllm-dtype float32)",
    "grpo_vllm_bf16": "GRPO sampling through vLLM in bfloat16 (grpo.py --use-vllm --vllm-dtype bfloat16)",
    "grpo_entropy": "GRPO with the adaptive entropy bonus, target 1.5 nats (grpo.py --use-adaptive-entropy)",
    "grpo_dynamic": "GRPO with DAPO's dynamic sampling (grpo.py --dynamic-sampling)",
    "ppo_critic": "PPO with a separate critic (ppo.py --value-model-path auto, 4 completions a prompt)",
    "ppo_critic_lam95": "the same, the policy's GAE lambda 0.95 (the critic's 1)",
    "ppo_critic_warmup": "the same, 2 critic-only updates first (--freezing-actor-steps 2)",
    "ppo_critic_one_sample": "the same, 1 completion a prompt (32 prompts an update)",
    "ppo_critic_shared": "the same with TRL 0.8's value head on the policy's trunk",
}
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


def scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    """A TensorBoard scalar's (step, value) pairs from the newest run under `run_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = sorted(glob.glob(os.path.join(run_dir, "*")))
    if not found:
        return []
    accumulator = EventAccumulator(found[-1])
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)] if tag in accumulator.Tags()["scalars"] else []


def median(values: list) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


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


# what docs/ppo.md plots of each PPO run, update by update: the critic's fit beside the training reward and the KL
CRITIC_TAGS = {
    "reward": "env/reward_mean",
    "explained_variance": "ppo/val/var_explained",
    "value_loss": "ppo/loss/value",
    "kl": "objective/kl",
}


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


METRICS = ("greedy", "sampled", "kl", "length", "distinct", "wall_s", "step_s", "rollout_s", "completions")


def aggregate(per_seed: list[dict]) -> dict:
    """Mean, standard deviation (over seeds, n - 1), min and max of each metric; the curves averaged point by point
    (over the points every seed has) with their min and max."""
    out = {}
    for key in METRICS:
        values = [r[key] for r in per_seed if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        if values:
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            out[key] = dict(mean=statistics.fmean(values), sd=sd, min=min(values), max=max(values), n=len(values))
    curves = [dict(r["curve"]) for r in per_seed if r.get("curve")]
    if curves and len(curves) == len(per_seed):
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        out["curve"] = [(x, *(f([c[x] for c in curves]) for f in (statistics.fmean, min, max))) for x in xs]
    return out


def cell(stat: dict | None, digits: int = 2) -> str:
    """mean ± sd [min, max] over the seeds (the value alone for one seed)."""
    if not stat:
        return "-"
    if stat["n"] == 1:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f} [{stat['min']:.{digits}f}, {stat['max']:.{digits}f}]"


COMPARED = (  # (ours, theirs): ours against TRL, then TRL's schedule in ours against TRL and against ours
    ("grpo", "trl_grpo"),
    ("rloo", "trl_rloo"),
    ("grpo_linear", "trl_grpo"),
    ("grpo_linear", "grpo"),
    ("rloo_linear", "trl_rloo"),
    ("rloo_linear", "rloo"),
    ("grpo_vllm", "grpo"),
    ("grpo_vllm_bf16", "grpo_vllm"),
    ("ppo_critic", "grpo"),  # PPO as the field runs it, at grpo's completions
    ("ppo_critic", "ppo"),  # and against TRL 0.8's
)


def critic_report(args: Args, results: dict, seeds: list[str]) -> None:
    """The separate critic beside the reward, update by update (docs/ppo.md): ppo_critic's training reward, its critic's
    explained variance and value loss, and the KL to the start, one line per seed (its ablations dashed), drawn from
    the record beside `args.write` as RESULTS-real-model-critic.png."""
    import matplotlib.pyplot as plt

    runs = [
        (m, s, results["seeds"][s][m]["critic"])
        for m in METHODS
        for s in seeds
        if m.startswith("ppo_critic") and "critic" in results["seeds"][s].get(m, {})
    ]
    if not runs:
        return
    titles = {"reward": "training reward (verifier)", "explained_variance": "critic: explained variance",
              "value_loss": "critic: value loss (x --vf-coef)", "kl": "KL to the start (nats per reply)"}  # fmt: skip
    figure, axes = plt.subplots(1, len(CRITIC_TAGS), figsize=(16, 3.8))
    for axis, name in zip(axes, CRITIC_TAGS):
        for method, seed, curves in runs:
            points = [(x, y) for x, y in curves[name] if y is not None]
            style = "-" if method == "ppo_critic" else "--"
            label = f"{method}, seed {seed}"
            axis.plot(*zip(*points), style, marker=".", label=label, color=f"C{seeds.index(seed)}", alpha=0.8)
        axis.set(xlabel="sampled completions used", title=titles[name])
        if name == "explained_variance":
            axis.set_ylim(-0.5, 1)
    axes[0].legend(fontsize=7)
    figure.suptitle("ppo.py with a separate critic on the real-model task, update by update", fontsize=9)
    figure.tight_layout()
    figure.savefig(os.path.splitext(os.path.join(ROOT, args.write))[0] + "-critic.png", dpi=110)


def comparison(stats: dict, problems: int, samples: int) -> str:
    """Ours against TRL's, and grpo.py and rloo.py with TRL's learning-rate decay against both: the difference of the
    means, and whether it is larger than the spread (the seeds' min-max ranges do not overlap) and, for accuracies,
    than the evaluation's own noise (two binomial standard errors of the difference over `problems` x replies)."""
    lines = []
    for ours, theirs in COMPARED:
        if ours not in stats or theirs not in stats:
            continue
        for key, name in (("greedy", "greedy accuracy"), ("sampled", "sampled accuracy"), ("kl", "KL")):
            a, b = stats[ours][key], stats[theirs][key]
            difference = a["mean"] - b["mean"]
            if min(a["n"], b["n"]) < 2:
                verdict = "one seed: no spread to compare with"
            elif a["min"] <= b["max"] and b["min"] <= a["max"]:
                verdict = "within the spread (the seeds' ranges overlap)"
            else:
                verdict = "larger than the spread (the seeds' ranges do not overlap)"
                if key != "kl":  # each mean accuracy is itself a binomial estimate over the held-out replies
                    n = [problems * (1 if key == "greedy" else samples) * x["n"] for x in (a, b)]
                    noise = 2 * math.sqrt(sum(x["mean"] * (1 - x["mean"]) / m for x, m in zip((a, b), n)))
                    verdict = (
                        f"within the evaluation's noise (two standard errors: {noise:.2f})"
                        if abs(difference) <= noise
                        else f"larger than the spread and the evaluation's noise (two standard errors: {noise:.2f})"
                    )
            lines.append(
                f"- {LABELS[ours].split(' (')[0]} against {LABELS[theirs].split(' (')[0]}, {name}: {a['mean']:.2f} "
                f"against {b['mean']:.2f} "
                f"({a['n']} and {b['n']} seeds), difference {difference:+.2f}: {verdict}"
            )
    return "\n".join(lines)


def machine() -> str:
    """The GPU the runs used (float32 weights and maths, TRL's too), else the CPU."""
    if DEVICE == "cuda":
        return f"one {torch.cuda.get_device_name()} (float32, no autocast, ours and TRL's), {os.cpu_count()} CPU cores"
    return cpu_machine()


# the eleventh and twelfth methods: colours of their own (matplotlib's ten would give them grpo's and rloo's again)
COLORS = {"grpo_linear": "midnightblue", "rloo_linear": "saddlebrown", "grpo_vllm": "darkorange", "ppo_critic": "crimson"}
FAMILIES = {  # one panel each
    "critic-free RL, ours and TRL's": ("grpo", "rloo", "trl_grpo", "trl_rloo", "grpo_linear", "rloo_linear", "grpo_vllm"),
    "PPO: the verifier, a learned reward": ("ppo", "ppo_critic", "rm_ppo", "rm_ppo_kl", "rm_ppo_small"),
    "offline, from the base model's samples": ("rft", "dpo", "kto"),
}


def learned_reward_report(args: Args, results: dict, seeds: list[str]) -> str:
    """The learned reward under PPO, per seed: the reward model's accuracy on its held-out pairs, and along the run,
    on the held-out problems, the proxy (the reward model's mean score, in units of its initial standard deviation
    from its start), the gold (the verifier's accuracy) and their correlation; a plot of the three beside the table."""
    import matplotlib.pyplot as plt

    runs = [
        (m, s, results["seeds"][s][m]) for m in METHODS for s in seeds if "learned_reward" in results["seeds"][s].get(m, {})
    ]
    if not runs:
        return ""
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    lines = []
    for i, (method, seed, r) in enumerate(runs):
        d = r["learned_reward"]
        p0, s0 = d["proxy"][0][1], d["proxy_std"][0][1]
        label = f"{method}, seed {seed}"
        left.plot([x for x, _ in d["proxy"]], [(p - p0) / s0 for _, p in d["proxy"]], "--", color=f"C{i}")
        left.plot(*zip(*d["gold"]), "-", marker=".", color=f"C{i}", label=label)
        right.plot(*zip(*d["correlation"]), "-", marker=".", color=f"C{i}", label=label)
        kl = d["kl"][-1][1] if d["kl"] else math.nan
        lines.append(
            f"| {method} | {seed} | {d['rm_accuracy'] or math.nan:.2f} | {s0:.2f} | "
            f"{(d['proxy'][-1][1] - p0) / s0:+.2f} | {d['gold'][0][1]:.2f} -> {d['gold'][-1][1]:.2f} | "
            f"{d['correlation'][0][1]:.2f} -> {d['correlation'][-1][1]:.2f} | {kl:.2f} | {d['kl_coef'][-1][1]:.3f} |"
        )
    left.set(xlabel="sampled completions used", ylabel="verifier accuracy (solid)\nRM score rise, initial sds (dashed)")
    right.set(xlabel="sampled completions used", ylabel="correlation: RM score, verifier", ylim=(-1, 1))
    left.set_title("the gold (verifier) beside the proxy (reward model), held-out samples", fontsize=9)
    right.set_title("does the reward model still rank the samples as the verifier does?", fontsize=9)
    left.axhline(0, color="grey", linewidth=0.5)
    right.axhline(0, color="grey", linewidth=0.5)
    left.legend(fontsize=7)
    figure.tight_layout()
    plot = os.path.splitext(os.path.join(ROOT, args.write))[0] + "-learned-reward.png"
    figure.savefig(plot, dpi=110)
    return f"""## The learned reward, watched by the verifier

ppo.py against the reward model, with `--gold-reward-funcs verifier`: the verifier scores every sample and is never
trained on. RM accuracy: on the pairs reward_modeling.py held out (questions it also trained on); score sd: of the
reward model's scores on the base model's held-out samples; the proxy's rise in those sds from the first to the last
evaluation; gold: the verifier's accuracy on the same samples (one per problem); correlation: Pearson, score against
verifier, over those samples; the last update's KL and KL coefficient.

| method | seed | RM accuracy | score sd | proxy rise | gold | correlation | KL | KL coefficient |
|-|-|-|-|-|-|-|-|-|
{chr(10).join(lines)}

![proxy and gold along PPO]({os.path.basename(plot)})

"""


def report(args: Args, results: dict, folder: str) -> None:
    """The table (markdown, at args.write), the plot of held-out accuracy against sampled completions beside it (mean
    and min-max band over the seeds), and the JSON of every seed's figures and their aggregate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted(results.get("seeds", {}), key=int)
    for seed in seeds:
        for method, r in results["seeds"][seed].items():
            with_curve(r, os.path.join(folder, f"seed_{seed}"), method)
    stats = {
        method: aggregate([results["seeds"][s][method] for s in seeds if method in results["seeds"][s]])
        for method in METHODS
        if any(method in results["seeds"][s] for s in seeds)
    }
    results["aggregate"] = stats
    base = results["base"]
    figure, axes = plt.subplots(1, len(FAMILIES), figsize=(16, 6.2), sharey=True)
    for axis, (title, family) in zip(axes, FAMILIES.items()):
        for method in family:
            if method not in stats:
                continue
            st, color = stats[method], COLORS.get(method, f"C{METHODS.index(method)}")
            style = "--" if method.endswith("_linear") else "-"  # grpo's and rloo's variants: dashed
            label = f"{LABELS[method]} ({st['sampled']['n']} seeds)"
            if st.get("curve"):
                xs, mean, low, high = zip(*st["curve"])
                axis.plot(xs, mean, marker=".", linestyle=style, color=color, label=label)
                axis.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
            else:  # the final evaluation: mean and min-max
                x, y = st["completions"]["mean"], st["sampled"]
                marker = {"trl_grpo": "x", "trl_rloo": "+"}.get(method, "o")
                error = [[y["mean"] - y["min"]], [y["max"] - y["mean"]]]
                axis.errorbar([x], [y["mean"]], yerr=error, fmt=marker, ms=8, capsize=4, color=color, label=label)
        axis.axhline(base["sampled"], color="grey", linestyle=":", label="before training")
        axis.set(xlabel="sampled completions used", title=title, ylim=(0, 1))
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below: clear of the curves
    axes[0].set_ylabel("held-out accuracy (sampled, temperature 1)")
    figure.suptitle(
        "SmolLM2-135M-Instruct, one-digit chain_sum, 64 held-out problems: mean over seeds, band min-max "
        "(curves: the scripts' own evaluation, one reply per problem; points: the final evaluation)",
        fontsize=9,
    )
    figure.tight_layout()
    plot = os.path.splitext(os.path.join(ROOT, args.write))[0] + ".png"
    figure.savefig(plot, dpi=110)

    learned = learned_reward_report(args, results, seeds)
    critic_report(args, results, seeds)
    rows = [
        f"| {LABELS['base']} | - | 0 | {base['greedy']:.2f} | {base['sampled']:.2f} | 0 | {base['length']:.1f} | "
        f"{base['distinct']:.2f} |"
    ]
    for method, st in stats.items():
        rows.append(
            f"| {LABELS[method]} | {st['sampled']['n']} | {st['completions']['mean']:.0f} | {cell(st['greedy'])} | "
            f"{cell(st['sampled'])} | {cell(st['kl'])} | {cell(st.get('length'), 1)} | {cell(st.get('distinct'))} |"
        )
    header = (
        "| method | seeds | completions sampled | greedy accuracy | sampled accuracy | KL to the start | reply tokens | "
        f"distinct answers (of {args.eval_samples}) |\n|-|-|-|-|-|-|-|-|"
    )

    def timing(r: dict) -> str:  # wall time, median s/update, rollout share of one run
        wall, step, rollout = (r.get(k, math.nan) for k in ("wall_s", "step_s", "rollout_s"))
        return (
            (f"{wall / 60:.1f} min | " if not math.isnan(wall) else "- | ")
            + (f"{step:.{1 if step >= 1 else 2}f} | " if not math.isnan(step) else "- | ")
            + (f"{rollout / step:.0%}" if not (math.isnan(rollout) or math.isnan(step)) else "-")
        )

    # the machine of each run (a sweep resumes, possibly on another machine), named in full on its row
    machines = sorted({r["machine"] for s in seeds for r in results["seeds"][s].values() if "machine" in r})
    per_seed = "\n".join(
        f"| {method} | {seed} | {r['greedy']:.2f} | {r['sampled']:.2f} | {r['kl']:.2f} | {r['length']:.1f} | "
        f"{r['distinct']:.2f} | {timing(r)} | {r.get('threads', '-')} | {r.get('machine', '-')} | "
        f"{r.get('origin', '-')} |"
        for method in stats
        for seed in seeds
        for r in [results["seeds"][seed].get(method)]
        if r
    )
    commands_md = "\n".join(
        f"- {LABELS[m]}:\n"
        + "\n".join(f"  `{c.replace(ROOT + os.sep, '')}`" for c in results["seeds"][seeds[0]][m].get("commands", []))
        for m in METHODS
        if m in results["seeds"][seeds[0]]
    )

    def drawn(method: str) -> str:  # the replies of the base model a self-sampled method learned from
        r = results["seeds"][seeds[0]].get(method, {}).get("self_samples", {})
        return f"{r['samples']} replies to {r['questions']} questions" if r else "-"

    runs_on = results.get("machine", machine()) if len(machines) < 2 else "2 CPU cores (the machines below)"
    where = f"{results.get('date', time.strftime('%Y-%m-%d'))}: {runs_on}, torch "
    where += results.get("torch", torch.__version__)  # where the runs ran (a report may be drawn elsewhere)
    text = f"""# The methods side by side on SmolLM2-135M-Instruct, one task, over seeds

`python benchmarks/real_model.py --seeds {" ".join(seeds)}` (this file and {os.path.basename(plot)}), {where}, each run
`python script.py` with the OMP_NUM_THREADS of its row below.
Held-out accuracy on 64 one-digit two-term chain_sum problems that no training row contains: greedy, and sampled at
temperature 1 ({args.eval_samples} replies per problem); KL to the start in nats per reply (sum over its tokens of
log pi - log pi_0 on the trained model's own samples); reply length in tokens; distinct answers among the
{args.eval_samples} replies of a problem. Each cell: mean ± standard deviation [min, max] over the seeds. The seed
changes the training order, the sampling and the self-sampled data (rft, dpo, rm_ppo_small: {drawn("dpo")}; rm_ppo:
{drawn("rm_ppo")}; drawn from the base model per seed) and the draws of the scripts' own evaluations during
training (the curves); the problems and the final evaluation's draws are the same for every seed.
Completions sampled: every reply the method drew to learn from. Times are per run, below: s/update is the median over
the run, the rollout share the median time of an update's generation over the median update time; they compare only
runs on one machine with the same thread count. Machines: {"; ".join(machines) or "-"}.

{header}
{chr(10).join(rows)}

![accuracy against sampled completions]({os.path.basename(plot)})

## Ours against TRL, and TRL's learning-rate decay in grpo.py and rloo.py

{comparison(stats, args.eval_problems, args.eval_samples) or "(no TRL rows)"}

{learned}## Every seed

| method | seed | greedy | sampled | KL | reply tokens | distinct | wall | s/update | rollout share | threads | machine | run |
|-|-|-|-|-|-|-|-|-|-|-|-|-|
{per_seed}

## Commands (seed {seeds[0]}; the other seeds change only --seed)

{commands_md}
"""
    with open(os.path.join(ROOT, args.write), "w") as f:
        f.write(text)
    with open(os.path.splitext(os.path.join(ROOT, args.write))[0] + ".json", "w") as f:
        json.dump(results, f, indent=1)  # every figure of the table, the curves too (notebooks/real_model.ipynb reads it)
    print(text)


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
    report(args, results, folder)
