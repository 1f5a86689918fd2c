"""The real-model sweep's methods, their labels, and how its record renders: the table of every method over its seeds
(benchmarks/RESULTS-real-model.md), the plots beside it, and the comparisons docs/build_assets.py renders on the docs
pages. benchmarks/real_model.py runs the sweep and calls `report`; reading a record needs neither torch nor a model.

    python benchmarks/real_model.py --report-only      # the table and plots again, from the results on disk
"""

import json
import math
import os
import re
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# what docs/ppo.md plots of each PPO run, update by update: the critic's fit beside the training reward and the KL
CRITIC_TAGS = {
    "reward": "env/reward_mean",
    "explained_variance": "ppo/val/var_explained",
    "value_loss": "ppo/loss/value",
    "kl": "objective/kl",
}


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


def critic_report(args, results: dict, seeds: list[str]) -> None:
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


# the eleventh and twelfth methods: colours of their own (matplotlib's ten would give them grpo's and rloo's again)
COLORS = {"grpo_linear": "midnightblue", "rloo_linear": "saddlebrown", "grpo_vllm": "darkorange", "ppo_critic": "crimson"}
FAMILIES = {  # one panel each
    "critic-free RL, ours and TRL's": ("grpo", "rloo", "trl_grpo", "trl_rloo", "grpo_linear", "rloo_linear", "grpo_vllm"),
    "PPO: the verifier, a learned reward": ("ppo", "ppo_critic", "rm_ppo", "rm_ppo_kl", "rm_ppo_small"),
    "offline, from the base model's samples": ("rft", "dpo", "kto"),
}


def learned_reward_report(args, results: dict, seeds: list[str]) -> str:
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


def from_root(command: str) -> str:
    """A recorded command with its paths from the repository root: the record keeps the absolute paths of the clone
    that ran it, and the table reads the same wherever it is drawn."""
    return re.sub(r"(?<!\S)/\S*?/(outputs/)", r"\1", command)


def report(args, results: dict, machine: str, torch_version: str) -> None:
    """The table (markdown, at args.write), the plot of held-out accuracy against sampled completions beside it (mean
    and min-max band over the seeds), and the JSON of every seed's figures and their aggregate. `machine` and
    `torch_version` stand where the results name none (the runs' own are kept)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted(results.get("seeds", {}), key=int)
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
        f"- {LABELS[m]}:\n" + "\n".join(f"  `{from_root(c)}`" for c in results["seeds"][seeds[0]][m].get("commands", []))
        for m in METHODS
        if m in results["seeds"][seeds[0]]
    )

    def drawn(method: str) -> str:  # the replies of the base model a self-sampled method learned from
        r = results["seeds"][seeds[0]].get(method, {}).get("self_samples", {})
        return f"{r['samples']} replies to {r['questions']} questions" if r else "-"

    runs_on = results.get("machine", machine) if len(machines) < 2 else "2 CPU cores (the machines below)"
    where = f"{results.get('date', time.strftime('%Y-%m-%d'))}: {runs_on}, torch "
    where += results.get("torch", torch_version)  # where the runs ran (a report may be drawn elsewhere)
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
