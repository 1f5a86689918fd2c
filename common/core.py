"""Log-prob, masking, whitening and KL utilities (TRL 0.8 `trl/core.py`, trlX's logit mask), the KL controllers
(Ziegler et al. 2019) and the small checks every script runs on its arguments and rewards. Masks are float or bool
tensors of the shape of the values they mask."""

import ctypes
import json
import math
import os
import time

import torch
import torch.nn.functional as F


def warn_once(message: str, _said: set = set()) -> None:  # noqa: B006 - the set is the memory of what was said
    """Print `warning: <message>` once per run, on the main process only (RANK 0 under every launcher)."""
    if message not in _said and int(os.environ.get("RANK", "0")) == 0:
        _said.add(message)
        print(f"warning: {message}", flush=True)


def error_line(error: BaseException) -> str:
    """An exception in one line: its type and the first line of its message (at most 200 characters)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def plain(tensor):
    """FSDP2's gradient norm is a replicated DTensor: its local tensor is the whole value, and collectives need one."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class UsageError(ValueError):
    """An anticipated mistake in the input (a flag, a file, a dataset column, a reward function): reported as one line
    `error: ...` without a traceback by the handler that `common.cli` installs."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, SLURM, Kubernetes, a launcher stopping its workers) or SIGHUP (the terminal closed), raised in
    the main thread: the run ends as on Ctrl-C (what it kept in one line, a save in progress undone, its folders
    released), with exit status 143 (129)."""


def die_with_parent(signum: int) -> None:
    """Ask the kernel to send this process `signum` when its parent dies (Linux's PR_SET_PDEATHSIG); a parent already
    gone by then (this process adopted by init or a subreaper) sends it at once."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signum, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


# Log-prob written into positions that are padding: an obviously-wrong value makes a masking bug visible
INVALID_LOGPROB = 1.0


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) under softmax(logits): [..., V], [...] -> [...] (one log_softmax in float32, then a gather)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)


class LogitMask:
    """trlX's `logit_mask`: `allowed` maps a token id to the ids allowed right after it (a token not in the map may be
    followed by anything). Forbidden logits become the dtype's lowest finite value: zero probability in sampling and
    log-probs, no NaN in entropies (as -inf would give). Callable as a transformers LogitsProcessor."""

    def __init__(self, allowed: dict[int, list[int]], vocab_size: int):
        for token, nexts in allowed.items():
            if not nexts or not all(0 <= t < vocab_size for t in [int(token), *nexts]):
                raise UsageError(
                    f"logit mask: token {token} -> {nexts}: every token needs at least one allowed next "
                    f"token, and every id must be in [0, {vocab_size})."
                )
        self.allowed = {int(k): torch.tensor(v, dtype=torch.long) for k, v in allowed.items()}

    @classmethod
    def from_file(cls, path: str, vocab_size: int) -> "LogitMask":
        """A JSON file: {"token id": [allowed next ids], ...}, or trlX's dense [vocab][vocab] booleans (True: forbidden)."""
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, list):
            data = {i: [j for j, forbidden in enumerate(row) if not forbidden] for i, row in enumerate(data)}
        return cls(data, vocab_size)

    def apply(self, logits: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """logits [..., V] of the tokens that follow prev_tokens [...], with the forbidden transitions masked."""
        forbidden = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        for token in prev_tokens.unique().tolist():
            if token in self.allowed:
                row = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
                row[self.allowed[token].to(logits.device)] = False
                forbidden[prev_tokens == token] = row
        return logits.masked_fill(forbidden, torch.finfo(logits.dtype).min)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.apply(scores, input_ids[:, -1])


def pad_right(rows: list[list], value) -> torch.Tensor:
    """Lists of different lengths as one right-padded tensor [len(rows), longest]."""
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows])


def epoch_rows(rows: list, batch_size: int, step: int, seed: int, accelerator) -> list:
    """This rank's `batch_size` rows of `step`: the rows reshuffled once per epoch from `seed + epoch` (the same order on
    every rank, and again after a resume), each rank taking its own slice of the epoch's step-th batch."""
    world = accelerator.num_processes
    epoch, i = divmod(step, max(1, len(rows) // (batch_size * world)))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch))
    start = (i * world + accelerator.process_index) * batch_size
    return [rows[j] for j in order[start : start + batch_size].tolist()]


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1 (over `axis`, or over everything); 0 where the mask is
    empty (TRL 1.x clamps the count at 1)."""
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis).clamp(min=1)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation over the non-NaN values (NaN with fewer than two); TRL 1.x's `nanstd`."""
    keep = ~values.isnan()
    count = keep.sum(dim) if dim is not None else keep.sum()
    mean = values.nanmean(dim, keepdim=dim is not None)
    squares = torch.where(keep, (values - mean) ** 2, 0.0)
    return (squares.sum(dim) if dim is not None else squares.sum()).div(count - 1).sqrt()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked positions; Bessel-corrected by n / (n - 1) with n the mask's count."""
    mask_sum = mask.sum()
    if mask_sum == 0:
        raise ValueError("masked_var: the mask is empty (no position is 1), so the variance is undefined.")
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        if mask_sum == 1:
            raise ValueError(
                "masked_var: the mask selects one value; the unbiased variance needs at least two "
                "(use a larger batch, or unbiased=False)."
            )
        variance = variance * mask_sum / (mask_sum - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked positions; the mean is added back if not shift_mean."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy over the last axis from log-probabilities (a log_softmax already computed): -sum(p * log p)."""
    return -logp.exp().mul_(logp).sum(-1)


class RunningMoments:
    """Running mean and (Bessel-corrected) std of a stream of batches: TRL 0.8 `RunningMoments`, parallel Welford. Pass
    each batch gathered over all processes so every rank keeps the same statistics."""

    def __init__(self):
        self.mean, self.var, self.std, self.count = 0.0, 1.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs_count = xs.numel()
        xs_var, xs_mean = torch.var_mean(xs.float(), unbiased=False)
        delta, tot_count = xs_mean.item() - self.mean, self.count + xs_count
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / tot_count
        self.mean += delta * xs_count / tot_count
        self.var = (old_sum + xs_var.item() * xs_count) / tot_count
        self.std = (self.var * tot_count / (tot_count - 1)) ** 0.5
        self.count = tot_count


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs. kind: "kl" (k1: logp - ref),
    "abs" (|logp - ref|), "mse" (0.5 * (logp - ref)^2), "k3" (exp(ref - logp) - 1 - (ref - logp), unbiased and
    non-negative, Schulman 2020), "full" (exact KL over the vocabulary of full log-prob tensors [..., V])."""
    if kind == "kl":
        return logprobs - ref_logprobs
    if kind == "abs":
        return (logprobs - ref_logprobs).abs()
    if kind == "mse":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "k3":
        log_ratio = ref_logprobs - logprobs
        return log_ratio.exp() - 1 - log_ratio
    if kind == "full":
        # F.kl_div(input, target) = target_p * (log target - input): target is the policy here
        return F.kl_div(ref_logprobs, logprobs, log_target=True, reduction="none").sum(-1)
    raise ValueError(f"Unknown KL penalty {kind!r}: choose one of kl, abs, mse, k3, full.")


def check_adam(args) -> None:
    """A one-line error for AdamW settings that cannot work: betas in [0, 1), a positive epsilon."""
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1 and args.adam_epsilon > 0):
        raise UsageError(
            f"--adam-beta1 {args.adam_beta1}, --adam-beta2 {args.adam_beta2}, --adam-epsilon {args.adam_epsilon}: the "
            "betas lie in [0, 1), epsilon above 0."
        )


class EntropyBonus:
    """TRL 1.16's entropy bonus (grpo.py, rloo.py; the Args fields entropy_coef, use_adaptive_entropy, entropy_coef_min,
    entropy_coef_max, entropy_coef_delta, entropy_target): a mini-batch's loss gets -coef x H, H the mean per-token
    entropy over the tokens its loss acts on. With --use-adaptive-entropy (Skywork-OR1), after each optimizer step the
    coefficient rises by delta while that step's entropy over every process was at or below the target, else falls
    (within [min, max]), and the bonus applies only while the last step's entropy was at or below the target (none
    before the first step)."""

    def __init__(self, args, state: dict | None = None):
        self.args, self.coef, self.last, self.window = args, args.entropy_coef, math.inf, None
        self.enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
        if state:  # a resumed run's controller
            self.coef, self.last = state["coef"], state["last"]

    def loss(self, entropy, mask):
        """The term to add to a mini-batch's loss (entropy [B, T] with its gradient, mask [B, T])."""
        adaptive, target = self.args.use_adaptive_entropy, self.args.entropy_target
        applied = self.coef if not adaptive or self.last <= target else 0.0  # the last step's gate, for every mini-batch
        if adaptive:  # the step's entropy, over all its mini-batches
            stats = torch.stack([(entropy * mask).sum(), mask.sum()]).detach()
            self.window = stats if self.window is None else self.window + stats
        return -applied * (entropy * mask).sum() / mask.sum().clamp(min=1.0)

    def step(self, accelerator) -> None:
        """An optimizer step's end: the adaptive coefficient moves by the step's entropy over every process."""
        if self.window is None:
            return
        total = accelerator.reduce(self.window, "sum")
        self.last, a, self.window = (total[0] / total[1].clamp(min=1.0)).item(), self.args, None
        if self.last <= a.entropy_target:
            self.coef = min(self.coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            self.coef = max(self.coef - a.entropy_coef_delta, a.entropy_coef_min)

    def state(self) -> dict:
        return {"coef": self.coef, "last": self.last}

    @staticmethod
    def check(args) -> None:
        """A one-line error for bounds that cannot work."""
        if not (args.entropy_coef_delta >= 0 and args.entropy_coef_min <= args.entropy_coef_max):
            raise UsageError(
                f"--entropy-coef-min {args.entropy_coef_min}, --entropy-coef-max {args.entropy_coef_max}, "
                f"--entropy-coef-delta {args.entropy_coef_delta}: the bounds need min <= max, and the step is not negative."
            )


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (lm-human-preferences `AdaptiveKLController`): after each batch,
    err = clip(KL / target - 1, -0.2, 0.2); kl_coef *= 1 + err * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


def check_scores(scores, n: int, source: str) -> torch.Tensor:
    """A reward must be one finite float per sample: the scores as a [n] tensor, or an error naming `source`."""
    try:
        scores = torch.as_tensor(scores, dtype=torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise UsageError(f"{source} returned {str(scores)[:80]!r}: return one float per sample.") from None
    if scores.numel() != n:
        raise UsageError(f"{source} returned {scores.numel()} scores for {n} samples: return one float each.")
    if not torch.isfinite(scores).all():
        raise UsageError(f"{source} returned a NaN or infinite score: {scores.tolist()}")
    return scores


def adamw(args, model: torch.nn.Module) -> torch.optim.AdamW:
    """The scripts' AdamW over `model`'s trainable weights (`weight_decay_groups`: biases and norms undecayed), with
    --learning-rate, --adam-beta1 / --adam-beta2 / --adam-epsilon (TRL's names and defaults); fused: one kernel over all
    parameters, several times faster than the per-tensor update."""
    betas = (args.adam_beta1, args.adam_beta2)
    groups = weight_decay_groups(model, args.weight_decay)
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=True)


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as transformers' Trainer (and so TRL) makes them: biases and the weights of normalisation
    layers are not decayed; frozen parameters are left out."""
    norms = {id(p) for m in model.modules() if "norm" in type(m).__name__.lower() for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith("bias") or id(param) in norms else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_args(args, positive: str = "", non_negative: str = "", fractions: str = "") -> None:
    """A one-line error for the first numeric flag out of its range: the fields named in `positive` (space-separated)
    must be > 0, in `non_negative` >= 0, in `fractions` strictly between 0 and 1 (None values are skipped: they mean
    "off")."""
    for names, ok, wanted in (
        (positive, lambda v: v > 0, "> 0"),
        (non_negative, lambda v: v >= 0, ">= 0"),
        (fractions, lambda v: 0 < v < 1, "between 0 and 1"),
    ):
        for name in names.split():
            value = getattr(args, name)
            if value is not None and not ok(value):
                raise UsageError(f"--{name.replace('_', '-')} {value}: it must be {wanted}.")


def clock(device: torch.device) -> float:
    """Wall time once the device has finished its queued work, so that phase times add up on a GPU too."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def exact_div(a: int, b: int, a_is: str = "", b_is: str = "") -> int:
    """a // b, or a one-line error naming the flags behind the two sizes (`sizes`) when b does not divide a."""
    if b <= 0 or a % b != 0:
        a_is, b_is = (f"{what} ({n})" if " x " in what else what or str(n) for what, n in ((a_is, a), (b_is, b)))
        raise UsageError(f"{a_is} is not divisible by {b_is}; choose sizes where it is.")
    return a // b


def sizes(args, *names: str, processes: int = 1) -> str:
    """The flags behind a size, with their values, for exact_div's error: "--batch-size 8 x --num-generations 8"."""
    terms = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in names]
    return " x ".join(terms + ([f"{processes} processes"] if processes > 1 else []))


def pooled(accelerator, stats_list: list[dict]) -> dict[str, float]:
    """The one reduction of statistics over the processes, in one collective (two with a _min or _max): each statistic
    a [sum, count] pair per mini-batch (a scalar counts as [value, 1]), weighted by their counts over the processes per
    mini-batch, then the mean over mini-batches (TRL 1.x); a name ending in _min or _max (/min, /max) is a [value, 1]
    pair whose least or largest value over the mini-batches and processes is kept. A dict of scalars: their means over
    the processes."""
    names, device = list(stats_list[0]), accelerator.device
    pair = lambda v: torch.stack([v, torch.ones_like(v)]) if v.ndim == 0 else v  # noqa: E731
    values = torch.stack([torch.stack([pair(s[k].float().to(device)) for k in names]) for s in stats_list])
    totals = accelerator.reduce(values, "sum")  # [mini-batches, stats, 2]
    extremes = any(name.endswith(("_min", "/min", "_max", "/max")) for name in names)
    every = accelerator.gather(values[None]) if extremes else None  # [processes, mini-batches, stats, 2]
    rows = [(totals[..., 0] / totals[..., 1].clamp(min=1.0)).mean(0)]  # [stats]: the weighted means
    if every is not None:
        rows += [every[..., 0].flatten(0, 1).amin(0), every[..., 0].flatten(0, 1).amax(0)]
    values = torch.stack(rows).tolist()  # one device sync for them all
    kind = lambda name: 1 if name.endswith(("_min", "/min")) else 2 if name.endswith(("_max", "/max")) else 0  # noqa: E731
    return {name: values[kind(name)][i] for i, name in enumerate(names)}


def json_object(value: str | None, flag: str, example: str) -> dict:
    """A flag's JSON object (unset: {}); anything else is one line naming the flag and an example of what it takes."""
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise UsageError(f"{flag} {value!r}: not JSON ({error.msg}); give a JSON object, e.g. '{example}'.") from None
    if not isinstance(parsed, dict):
        raise UsageError(f"{flag} {value!r}: give a JSON object, e.g. '{example}'.")
    return parsed
