"""Log-prob, masking and KL utilities (with trlX's logit mask), the samplers (inverse-CDF `generate` arguments and
the compiled CUDA rollout loop `FastGenerator`), and the KL controllers.

Semantics follow TRL 0.8 `trl/core.py` and Ziegler et al. 2019 (lm-human-preferences).
All masks are float or bool tensors of the same shape as the values they mask.
"""

import functools
import json
import sys

import torch
import torch.nn.functional as F
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class UsageError(ValueError):
    """An anticipated mistake in the input (a flag, a file, a dataset column, a reward function): reported as one line
    `error: ...` without a traceback by the handler that `common.cli` installs."""


# Log-prob written into positions that are padding: an obviously-wrong value makes a masking bug visible
INVALID_LOGPROB = 1.0


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) under softmax(logits): [..., V], [...] -> [...].

    Memory-lean: one log_softmax, then a gather; no second full-vocabulary copy.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward and backward of `chunked_logprobs`, the logits of one chunk of rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size: int, dtype: torch.dtype):
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        logprobs, lse = [], []
        for h, y in zip(hidden.split(chunk_size), labels.split(chunk_size)):
            logits = F.linear(h.to(dtype), w, b).to(torch.promote_types(dtype, torch.float32))
            lse.append(torch.logsumexp(logits, -1))
            logprobs.append(logits.gather(-1, y[:, None])[:, 0] - lse[-1])
        ctx.save_for_backward(hidden, weight, bias, labels, torch.cat(lse))
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return torch.cat(logprobs)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        w, b = weight.to(ctx.dtype), None if bias is None else bias.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden)
        acc = torch.promote_types(ctx.dtype, torch.float32)  # softmax and gradient sums in float32 at least
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=acc, device=bias.device)
        for i in range(0, len(hidden), ctx.chunk_size):
            rows = slice(i, i + ctx.chunk_size)
            h = hidden[rows].to(ctx.dtype)
            # d log p(y) / d logits = onehot(y) - softmax(logits), scaled by the incoming gradient
            dlogits = (F.linear(h, w, b).to(acc) - lse[rows, None]).exp_().neg_()
            dlogits.scatter_add_(-1, labels[rows, None], torch.ones_like(dlogits[:, :1]))
            dlogits *= grad[rows, None]
            grad_hidden[rows] = dlogits.to(ctx.dtype) @ w
            grad_weight += (dlogits.to(ctx.dtype).T @ h).to(acc)
            if grad_bias is not None:
                grad_bias += dlogits.sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype),
            None if bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None, chunk_size: int = 1024
) -> torch.Tensor:
    """log p(labels) under softmax(hidden @ weight.T + bias): [N, H], [V, H], [N] -> [N], as
    `logprobs_from_logits(F.linear(hidden, weight, bias), labels)`, without the [N, V] logits: the LM head runs on
    chunk_size rows at a time and again in backward, so memory is O(chunk_size * V). Under autocast the projection
    runs in the autocast dtype, the softmax in float32."""
    dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
    return _ChunkedLogprobs.apply(hidden, weight, bias, labels, chunk_size, dtype)


def chunkable_head(model, sharded: bool = False):
    """The LM head that `lm_token_logprobs` can run in chunks, or None: no head, a head that scales or soft-caps its
    logits (Gemma 2, Cohere, Granite), or a weight sharded outside the forward (`sharded`: FSDP / DeepSpeed)."""
    head = model.get_output_embeddings()
    scaled = any(getattr(model.config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    return None if head is None or scaled or sharded else head


def lm_token_logprobs(model, head, input_ids, attention_mask, labels) -> tuple[torch.Tensor, ...]:
    """Causal LM: log p(labels[:, t + 1]) [B, T - 1] (0 where the label is -100), that mask, and the last hidden
    states [B, T, H]. One forward returns the hidden states (`logits_to_keep=1`: the full logits are never built);
    `chunked_logprobs` runs `head` on the labelled positions. `model` may be the wrapped (DDP) module."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1)
    hidden, labels = out.hidden_states[-1], labels[:, 1:]
    mask = labels != -100
    logprobs = chunked_logprobs(hidden[:, :-1][mask], head.weight, labels[mask], head.bias)
    return torch.zeros(labels.shape, device=hidden.device).masked_scatter(mask, logprobs), mask, hidden


class LogitMask:
    """trlX's `logit_mask`: which tokens may follow which. `allowed` maps a token id to the ids allowed right after
    it; a token not in the map may be followed by anything.

    Forbidden logits become the dtype's lowest finite value: zero probability in sampling and in log-probs, and no
    NaN in entropies (as -inf would give). Callable as a transformers LogitsProcessor, `(input_ids, scores)`.
    """

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


def inverse_cdf_draw(scores: torch.Tensor) -> torch.Tensor:
    """One token per row of `scores` [B, V] drawn from softmax(scores) by inverse CDF (one uniform per row against the
    cumulative probabilities): [B, 1]."""
    cdf = scores.float().softmax(-1).cumsum(-1, dtype=torch.float64)
    u = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)  # the first token whose CDF > u


class InverseCDFSampler(LogitsProcessor):
    """The last logits processor of a greedy `generate`: draws the next token with `inverse_cdf_draw` and leaves only
    it, so the greedy pick is a sample."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.full_like(scores, float("-inf")).scatter_(1, inverse_cdf_draw(scores), 0.0)


def warpers(temperature: float, top_k: int, top_p: float) -> list:
    """HF's temperature / top-k / top-p logits warpers, in HF's order, leaving out those that change nothing."""
    return (
        ([TemperatureLogitsWarper(temperature)] if temperature != 1 else [])
        + ([TopKLogitsWarper(top_k)] if top_k > 0 else [])
        + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
    )


def sampling_kwargs(temperature: float, top_k: int, top_p: float, inverse_cdf: bool = True, processors=()) -> dict:
    """`generate` arguments that sample at this temperature / top-k / top-p, after `processors` (e.g. a `LogitMask`). With
    `inverse_cdf`: a greedy `generate` over `processors`, HF's warpers (in HF's order) and `InverseCDFSampler`, the
    distribution of `do_sample=True`, whose torch.multinomial draws an exponential variate per vocabulary entry (on CPU,
    3/4 of a rollout at a 50k vocabulary)."""
    if not inverse_cdf:
        return dict(
            do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, logits_processor=LogitsProcessorList(processors)
        )  # HF runs them before its warpers
    return dict(
        do_sample=False,
        logits_processor=LogitsProcessorList([*processors, *warpers(temperature, top_k, top_p), InverseCDFSampler()]),
    )


def _cast_update(update, dtype, key_states, value_states, *args, **kwargs):
    return update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)


class FastGenerator:
    """Samples responses of a decoder-only model with a static KV cache, each decoding step's forward one compiled CUDA
    graph: the distribution of `generate` with `sampling_kwargs` (HF's warpers, then an inverse-CDF draw, both eager),
    without `generate`'s per-token Python, kernel launches and host syncs.

    Each cache (and its compiled graph, 15-30 s to build on an H100) is kept and reused: a batch runs in the smallest
    cache that holds it, up to 8 times its size (extra rows repeat the first prompt and are dropped; at these batch
    sizes a decoding step costs about the same), else in a new one of the batch's size whose length is rounded up to
    `bucket` tokens (prompts are padded on the left to fill it). Parameters must stay where they are in memory
    (optimizers update them in place; FSDP / ZeRO-3 resharding does not: use `generate` there). With `compile=False`
    the same loop runs eagerly (on CPU, for tests), as it does from then on where compiling fails (no working Triton or C
    compiler): a warning says so, and the rollouts stay correct, only slower."""

    def __init__(
        self, model, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, bucket: int = 64, compile: bool = True
    ):
        self.model, self.temperature, self.bucket = model, temperature, bucket
        self.warpers = LogitsProcessorList(warpers(temperature, top_k, top_p))
        self.caches = {}
        self.forward = torch.compile(self._forward, mode="reduce-overhead", dynamic=False) if compile else self._forward

    def _draw(self, logits: torch.Tensor, with_logprob: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next token [B] and, if asked, its log-prob under logits / temperature [B] as the training forward
        computes it (else None: a full-vocabulary pass that the scripts, which recompute log-probs, do not need)."""
        logits = logits.float()
        token = inverse_cdf_draw(self.warpers(None, logits))
        logprob = torch.log_softmax(logits / self.temperature, -1).gather(-1, token)[:, 0] if with_logprob else None
        return token[:, 0], logprob

    def _forward(self, token, position, mask, cache) -> torch.Tensor:
        """The next logits [B, V] after one token per row [B] at `position` [B]."""
        return self.model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=position[:, None],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        return_logprobs: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Responses [B, T] to left-padded prompts [B, P] (T <= max_new_tokens: it stops early once every row has an
        EOS; tokens after a row's first EOS are `pad_token_id`, as `generate` returns them) and, with
        `return_logprobs`, their log-probs [B, T] (else None)."""
        B, P = input_ids.shape
        # one dtype for keys and values: the autocast dtype, in which attention runs (under autocast Qwen2's rotary
        # embedding yields float32 keys beside bf16 values, and a static cache holds one dtype)
        dtype = (
            torch.get_autocast_dtype(input_ids.device.type)
            if torch.is_autocast_enabled(input_ids.device.type)
            else self.model.dtype
        )
        length = -(-(P + max_new_tokens) // self.bucket) * self.bucket
        fits = [(b * n, b, n) for b, n, d in self.caches if d == dtype and B <= b <= 8 * B and n >= length]
        _, batch, length = min(fits) if fits else (0, B, length)
        cache = self.caches.get((batch, length, dtype))
        if cache is None:
            cache = self.caches[batch, length, dtype] = StaticCache(config=self.model.config, max_cache_len=length)
            for layer in cache.layers:  # cast what each layer stores
                layer.update = functools.partial(_cast_update, layer.update, dtype)
        else:
            cache.reset()
        input_ids = F.pad(
            torch.cat([input_ids, input_ids[:1].expand(batch - B, -1)]), (length - max_new_tokens - P, 0), value=pad_token_id
        )
        prompt_mask = F.pad(
            torch.cat([attention_mask, attention_mask[:1].expand(batch - B, -1)]), (length - max_new_tokens - P, 0), value=0
        )
        # one mask for every step: the positions not yet written are hidden by causality
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, max_new_tokens)], 1)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        token, logprob = self._draw(logits, return_logprobs)
        position = prompt_mask.sum(1)  # the position of the first response token (left padding: real tokens only)
        tokens, logprobs = [token], [logprob]
        for t in range(1, max_new_tokens):
            if eos_token_id is not None and t % 16 == 0 and (torch.stack(tokens, 1)[:B] == eos_token_id).any(1).all():
                break
            try:
                logits = self.forward(token, position + (t - 1), mask, cache)
            except torch._dynamo.exc.BackendCompilerFailed as error:  # raised before the step ran: the cache is intact
                if self.forward == self._forward:
                    raise
                cause = getattr(error, "inner_exception", None) or error  # the backend's own error
                reason = (str(cause).strip().splitlines() or [""])[0]
                print(
                    f"warning: compiling the decoding step failed ({type(cause).__name__}: {reason}); rollouts decode "
                    "eagerly from here on (pass --no-fast-generation to sample with HF generate instead)",
                    file=sys.stderr,
                    flush=True,
                )
                self.forward = self._forward
                logits = self.forward(token, position + (t - 1), mask, cache)
            token, logprob = self._draw(logits, return_logprobs)  # before the next replay overwrites the logits
            tokens.append(token)
            logprobs.append(logprob)
        tokens = torch.stack(tokens, 1)[:B]
        logprobs = torch.stack(logprobs, 1)[:B] if return_logprobs else None
        if eos_token_id is not None:  # after the first EOS: padding
            after_eos = (tokens == eos_token_id).long().cumsum(1) - (tokens == eos_token_id).long() > 0
            tokens = tokens.masked_fill(after_eos, pad_token_id)
        return tokens, logprobs


def pad_right(rows: list[list], value) -> torch.Tensor:
    """Lists of different lengths as one right-padded tensor [len(rows), longest]."""
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows])


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1 (over `axis`, or over everything)."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    return (values * mask).sum() / mask.sum()


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
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: logsumexp(z) - sum(p * z)."""
    logits = logits.float()
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


class RunningMoments:
    """Running mean and (Bessel-corrected) std of a stream of batches: TRL 0.8 `RunningMoments`, parallel Welford.

    Pass each batch gathered over all processes so every rank keeps the same statistics.
    """

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


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp of x between two tensors (torch.clamp takes tensors only in newer versions)."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of the sampled tokens.

    kind: "kl" (k1: logp - ref), "abs" (|logp - ref|), "mse" (0.5 * (logp - ref)^2),
    "k3" (exp(ref - logp) - 1 - (ref - logp), unbiased and non-negative, Schulman 2020),
    "full" (exact KL over the vocabulary; both inputs are then full log-prob tensors [..., V]).
    """
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


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (lm-human-preferences `AdaptiveKLController`).

    After each batch: err = clip(KL / target - 1, -0.2, 0.2); kl_coef *= 1 + err * n_steps / horizon.
    """

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
    scores = torch.as_tensor(scores, dtype=torch.float32).flatten()
    if scores.numel() != n:
        raise UsageError(f"{source} returned {scores.numel()} scores for {n} samples: return one float each.")
    if not torch.isfinite(scores).all():
        raise UsageError(f"{source} returned a NaN or infinite score: {scores.tolist()}")
    return scores


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


def exact_div(a: int, b: int, what: str = "") -> int:
    """a // b, or a clear error naming the two sizes when b does not divide a."""
    if b <= 0 or a % b != 0:
        raise UsageError(f"{what or 'size'}: {a} is not divisible by {b}; choose sizes where it is.")
    return a // b
