"""Every method on one real model and one task, side by side: SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct) on
reasoning-gym's one-digit two-term chain_sum, chat prompts ending with "Give only the final answer.", the answer read as
the reply's last number, 64 held-out problems whose questions never occur in training (136 training questions).

Each method runs through its script's real CLI (the commands are printed and kept in the table), then every trained
model is evaluated the same way on the held-out problems: greedy accuracy; sampled accuracy (temperature 1,
--eval-samples replies per problem); the KL to the initial model (nats per completion, the sum over its tokens of
log pi - log pi_0 on the sampled replies); the completion length; the number of distinct answers per problem.

- grpo, rloo: the verifier's reward, 8 prompts x 4 completions per update;
- ppo: ppo.py with the same verifier (--reward-funcs verifier), a value head, the adaptive KL penalty;
- rft: rejection-sampling fine-tuning: sft.py on the base model's own correct replies to the training questions;
- dpo: dpo.py on pairs of the base model's own replies, the verifier's choice (a correct one over a wrong one);
- rm_ppo: reward_modeling.py on those pairs, then ppo.py against that learned reward;
- trl_grpo, trl_rloo: TRL's GRPOTrainer and RLOOTrainer (benchmarks/setup.sh installs TRL) on the same model, data,
  reward and settings, for --trl-steps steps, evaluated as ours.

    python benchmarks/real_model.py                                  # everything; writes the table and the plot
    python benchmarks/real_model.py --methods grpo rloo --threads 2   # some methods
    python benchmarks/real_model.py --report-only                     # the table and plot from the runs on disk
"""

import glob
import json
import math
import os
import platform
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

from common.chat import render  # noqa: E402
from common.core import logprobs_from_logits  # noqa: E402
from common.loading import load_pretrained, load_tokenizer  # noqa: E402
from common.run import cli  # noqa: E402
from fast_paths import sampling_kwargs  # noqa: E402
from rewards import distinct_answers, load_task, verifier  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the evaluation's and TRL's; the scripts pick theirs alike
TASK = ["--dataset-name", "reasoning-gym:chain_sum", "--seed", "1"]  # the scripts' default task config and split
METHODS = ("grpo", "rloo", "ppo", "rft", "dpo", "rm_ppo", "trl_grpo", "trl_rloo")


@dataclass
class Args:
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """which methods to run (of grpo rloo ppo rft dpo rm_ppo trl_grpo trl_rloo)"""
    folder: str = "outputs/real_model"
    """where the runs, their logs and the self-sampled data go"""
    threads: int = 2
    """torch threads of every run (OMP_NUM_THREADS), ours and TRL's alike"""
    updates: int = 20
    """grpo / rloo updates of 8 prompts x 4 completions (16-30 s each on 2 CPU cores, by the CPU)"""
    ppo_updates: int = 20
    """ppo / rm_ppo updates of 16 episodes"""
    self_samples: int = 8
    """replies sampled per training question for rft, dpo and the reward model"""
    trl_steps: int = 20
    """TRL GRPOTrainer / RLOOTrainer steps (of 8 prompts x 4 completions, as ours)"""
    eval_samples: int = 2
    """sampled replies per held-out problem in the final evaluation"""
    eval_problems: int = 64
    """held-out problems evaluated (during and after training); fewer make a quick check"""
    report_only: bool = False
    """draw the table and the plot from the runs already in `folder`"""
    write: str = "benchmarks/RESULTS-real-model.md"
    """the results file (the plot goes beside it as a PNG)"""


# ---- the runs: each method's command, through the scripts' real CLIs ----

RL = ["--model-name", MODEL, *TASK, "--max-completion-length", "32", "--log-freq", "10"]
GROUPS = ["--batch-size", "8", "--num-generations", "4", "--mini-batch-size", "8", "--gradient-accumulation-steps", "4"]


def commands(args: Args, folder: str) -> dict[str, list[list[str]]]:
    """Each method's commands (python script.py ...), in the order they run."""

    def out(name: str) -> list[str]:  # this benchmark's own folders: a rerun replaces them
        return ["--output-dir", os.path.join(folder, name), "--log-dir", os.path.join(folder, "runs", name), "--overwrite"]

    every = max(1, args.updates // 4)
    rl = [*RL, "--eval-samples", str(args.eval_problems)]
    ppo = ["--model-name", MODEL, *TASK, "--min-new-tokens", "32", "--max-new-tokens", "32"]
    ppo += ["--eval-samples", str(args.eval_problems)]
    ppo += ["--batch-size", "16", "--mini-batch-size", "8", "--total-episodes", str(16 * args.ppo_updates)]
    ppo += ["--eval-freq", str(max(1, args.ppo_updates // 4)), "--learning-rate", "1.41e-5", "--log-freq", "10"]
    data = os.path.join(folder, "self_samples")
    return {
        "grpo": [
            ["grpo.py", *rl, *GROUPS, "--total-prompts", str(8 * args.updates), "--learning-rate", "1e-5"]
            + ["--eval-freq", str(every), *out("grpo")]
        ],
        "rloo": [
            ["rloo.py", *rl, *GROUPS, "--total-prompts", str(8 * args.updates), "--learning-rate", "1e-5"]
            + ["--beta", "0", "--eval-freq", str(every), *out("rloo")]
        ],
        "ppo": [["ppo.py", *ppo, "--reward-funcs", "verifier", *out("ppo")]],
        "rft": [
            ["sft.py", "--model-name", MODEL, "--dataset-name", os.path.join(data, "rft.jsonl"), "--prompt-column"]
            + ["prompt", "--completion-column", "completion", "--learning-rate", "1e-5", "--num-epochs", "2"]
            + ["--batch-size", "8", "--eval-fraction", "0.05", "--max-seq-length", "128", *out("rft")]
        ],
        "dpo": [
            ["dpo.py", "--model-name", MODEL, "--dataset-name", os.path.join(data, "pairs.jsonl"), "--beta", "0.1"]
            + ["--learning-rate", "5e-6", "--batch-size", "8", "--max-length", "128", "--eval-fraction", "0.05"]
            + [*out("dpo")]
        ],
        "rm_ppo": [
            ["reward_modeling.py", "--model-name", MODEL, "--dataset-name", os.path.join(data, "pairs.jsonl")]
            + ["--learning-rate", "1e-5", "--batch-size", "8", "--num-epochs", "2", "--max-length", "128", *out("rm")],
            ["ppo.py", *ppo, "--reward-model", os.path.join(folder, "rm"), *out("rm_ppo")],
        ],
    }


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


def self_samples(args: Args, folder: str) -> dict:
    """rft.jsonl (the correct replies) and pairs.jsonl (a correct reply over a wrong one, up to 4 pairs per question)
    from `self_samples` replies of the base model to every training question."""
    data = os.path.join(folder, "self_samples")
    if os.path.isfile(os.path.join(data, "stats.json")):
        return json.load(open(os.path.join(data, "stats.json")))
    os.makedirs(data, exist_ok=True)
    tokenizer = load_tokenizer(MODEL, padding_side="left")
    model = load_pretrained(MODEL, AutoModelForCausalLM).to(DEVICE).eval()
    train, _ = task()
    questions = list({json.dumps(r["prompt"]): r for r in train}.values())
    start = time.time()
    texts, _ = generate(model, tokenizer, [q["prompt"] for q in questions], n=args.self_samples, seed=1)
    grades = verifier(
        None,
        texts,
        [q["answer"] for q in questions for _ in range(args.self_samples)],
        rg_entry=[q["rg_entry"] for q in questions for _ in range(args.self_samples)],
    )
    rft, pairs = [], []
    for i, q in enumerate(questions):
        replies = list(zip(texts[i * args.self_samples : (i + 1) * args.self_samples], grades[i * args.self_samples :]))
        right, wrong = [t for t, g in replies if g == 1], [t for t, g in replies if g < 1]
        rft += [dict(prompt=q["prompt"], completion=[{"role": "assistant", "content": t}]) for t in right]
        chosen = [{"role": "assistant", "content": t} for t in right]
        rejected = [{"role": "assistant", "content": t} for t in wrong]
        pairs += [dict(prompt=q["prompt"], chosen=[c], rejected=[r]) for c, r in list(zip(chosen * 4, rejected))[:4]]
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


def trl_run(args: Args, folder: str, name: str) -> tuple[float, float]:
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
        seed=1,
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
    "rm_ppo": "reward model on those pairs, then PPO against it",
    "trl_grpo": "TRL 1.16 GRPOTrainer (same settings)",
    "trl_rloo": "TRL 1.16 RLOOTrainer (same settings)",
}
# (TensorBoard folder, the held-out accuracy tag, completions sampled per update, the step-time tags, the rollout tag)
PPO_PHASES = ["time/rollout", "time/score", "time/forward", "time/optimise"]
CURVES = {
    "grpo": ("grpo", "eval/reward", 32, ["time/step"], "time/generate"),
    "rloo": ("rloo", "eval/reward", 32, ["time/step"], "time/generate"),
    "ppo": ("ppo", "eval/reward_mean", 16, PPO_PHASES, "time/rollout"),
    "rft": ("rft", None, 0, ["time/step"], None),
    "dpo": ("dpo", None, 0, ["time/step"], None),
    "rm_ppo": ("rm_ppo", None, 16, PPO_PHASES, "time/rollout"),
}


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


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the architecture."""
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def machine() -> str:
    """The GPU the runs used (float32 weights and maths, TRL's too), else the CPU."""
    if DEVICE == "cuda":
        return f"one {torch.cuda.get_device_name()} (float32, no autocast, ours and TRL's), {os.cpu_count()} CPU cores"
    return f"{cpu_name()}, {os.cpu_count()} cores"


def report(args: Args, results: dict, folder: str) -> None:
    """The table (markdown, at args.write) and the plot of held-out accuracy against sampled completions beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(11, 5))
    base = results["base"]
    rows = []
    for method in ("base", *METHODS):
        if method not in results:
            continue
        r = results[method]
        drawn = r.get("self_samples", {}).get("samples", 0)  # the replies drawn to build the offline data
        if method in CURVES:
            run, tag, per_update = CURVES[method][:3]
            if os.path.isdir(os.path.join(folder, "runs", run)):  # else the numbers kept in the results
                r["step_s"], r["updates"], r["rollout_s"] = step_time(folder, method)
                r["completions"] = drawn + per_update * r["updates"]
                curve = scalars(os.path.join(folder, "runs", run), tag) if tag else []
                r["curve"] = [(drawn + per_update * step, value) for step, value in curve]
            seconds, updates, completions = r["step_s"], r["updates"], r["completions"]
            if r.get("curve"):
                axis.plot(*zip(*r["curve"]), marker=".", color=f"C{METHODS.index(method)}", label=LABELS[method])
            else:
                axis.scatter([completions], [r["sampled"]], color=f"C{METHODS.index(method)}", label=LABELS[method], zorder=3)
        else:
            seconds, updates, completions = r.get("step_s", float("nan")), args.trl_steps, r.get("completions", 0)
            if method.startswith("trl_"):
                marker = "x" if method == "trl_grpo" else "+"
                axis.scatter([completions], [r["sampled"]], marker=marker, s=60, color="k", label=LABELS[method], zorder=3)
        wall = r.get("wall_s")
        rows.append(
            f"| {LABELS[method]} | {completions} | {base['greedy']:.2f} -> {r['greedy']:.2f} | "
            f"{base['sampled']:.2f} -> {r['sampled']:.2f} | {r['kl']:.2f} | {r['length']:.1f} | {r['distinct']:.2f} | "
            + (f"{wall / 60:.1f} min | " if wall else "- | ")
            + (f"{seconds:.{1 if seconds >= 1 else 2}f} ({updates}) | " if not math.isnan(seconds) else "- | ")
            + (f"{r['rollout_s'] / seconds:.0%} |" if not math.isnan(r.get("rollout_s", math.nan)) else "- |")
        )
    axis.axhline(base["sampled"], color="grey", linestyle=":", label="before training (sampled)")
    axis.set(xlabel="sampled completions used", ylabel="held-out accuracy (sampled, temperature 1)", ylim=(0, 1))
    axis.set_title("SmolLM2-135M-Instruct, one-digit chain_sum, 64 held-out problems")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the plot: no point hidden
    figure.tight_layout()
    plot = os.path.splitext(os.path.join(ROOT, args.write))[0] + ".png"
    figure.savefig(plot, dpi=110)
    header = (
        "| method | completions sampled | greedy accuracy | sampled accuracy | KL to the start | reply tokens | "
        f"distinct answers (of {args.eval_samples}) | wall time | s/update (updates) | rollout share |\n|-|-|-|-|-|-|-|-|-|-|"
    )
    commands_md = "\n".join(
        f"- {LABELS[m]}:\n" + "\n".join(f"  `{c.replace(ROOT + os.sep, '')}`" for c in results[m].get("commands", []))
        for m in METHODS
        if m in results
    )
    where = f"{results.get('date', time.strftime('%Y-%m-%d'))}: {results.get('machine', machine())}, torch "
    where += results.get("torch", torch.__version__)  # where the runs ran (a report may be drawn elsewhere)
    text = f"""# The methods side by side on SmolLM2-135M-Instruct, one task

`python benchmarks/real_model.py` (this file and {os.path.basename(plot)}), {where}, each run `python script.py` with
OMP_NUM_THREADS={args.threads}.
Held-out accuracy on 64 one-digit two-term chain_sum problems that no training row contains: greedy, and sampled at
temperature 1 ({args.eval_samples} replies per problem); KL to the start in nats per reply (sum over its tokens of
log pi - log pi_0 on the trained model's own samples); reply length in tokens; distinct answers among the
{args.eval_samples} replies of a problem. Completions sampled: every reply the method drew to learn from (for rft, dpo
and rm_ppo the base model's {results.get("rft", results.get("dpo", {})).get("self_samples", {}).get("samples", "-")}
replies to the training questions, plus PPO's episodes). s/update: the median over the run; rollout share: the median
time of an update's generation over the median update time.

{header}
{chr(10).join(rows)}

![accuracy against sampled completions]({os.path.basename(plot)})

## Commands

{commands_md}
"""
    with open(os.path.join(ROOT, args.write), "w") as f:
        f.write(text)
    with open(os.path.splitext(os.path.join(ROOT, args.write))[0] + ".json", "w") as f:
        json.dump(results, f, indent=1)  # every figure of the table, the curves too (notebooks/real_model.ipynb reads it)
    print(text)


if __name__ == "__main__":
    args = cli(Args)
    folder = os.path.join(ROOT, args.folder)
    os.makedirs(os.path.join(folder, "runs"), exist_ok=True)
    results_file = os.path.join(folder, "results.json")
    results = json.load(open(results_file)) if os.path.isfile(results_file) else {}
    if not args.report_only:
        results |= dict(machine=machine(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        if "base" not in results:
            results["base"] = dict(evaluate(MODEL, args.eval_samples, args.eval_problems), completions=0)
        plan = commands(args, folder)
        for method in args.methods:
            stats = self_samples(args, folder) if method in ("rft", "dpo", "rm_ppo") else {}
            if method.startswith("trl_"):
                start = time.time()
                step, rollout = trl_run(args, folder, method)
                wall = time.time() - start
                results[method] = evaluate(os.path.join(folder, method), args.eval_samples, args.eval_problems)
                results[method] |= dict(step_s=step, rollout_s=rollout, completions=32 * args.trl_steps, wall_s=wall)
                results[method]["commands"] = [
                    f"python benchmarks/real_model.py --methods {method} --trl-steps {args.trl_steps}"
                ]
                json.dump(results, open(results_file, "w"), indent=1)
                continue
            wall = sum(run(command, args.threads) for command in plan[method])
            results[method] = dict(evaluate(os.path.join(folder, method), args.eval_samples, args.eval_problems), wall_s=wall)
            results[method]["commands"] = ["python " + shlex.join(c) for c in plan[method]]
            results[method]["self_samples"] = stats
            json.dump(results, open(results_file, "w"), indent=1)
    report(args, results, folder)
