"""The fast paths: each replaces a plain library call with the same result, and is one flag away from it.

- `sampling_kwargs` with `inverse_cdf=True`: the token drawn by inverse CDF after HF's warpers, the distribution of
  `generate(do_sample=True)`, whose torch.multinomial draws an exponential variate per vocabulary entry (on CPU, 74% of a
  rollout at GPT-2's 50k vocabulary). Plain path: --no-inverse-cdf-sampling.
- `FastGenerator`: rollouts on CUDA with a static KV cache and each decoding step one compiled CUDA graph (4.5-7.4x HF
  `generate`'s tokens/s on an H100, benchmarks/RESULTS-H100.md). Plain path: --no-fast-generation.
- `lm_token_logprobs` / `chunked_logprobs`: log-probs of the labelled tokens with the LM head run on 1024 rows at a time,
  forward and backward, so the [batch, length, vocab] logits never exist (the model's own loss, tested; a fraction of
  its memory). Plain path: --no-chunked-loss (sft.py), --no-chunked-logps (dpo.py).
- `keep_freed_memory`: on CPU, glibc keeps freed blocks instead of unmapping them (faster steps at a higher peak RSS:
  `python benchmarks/malloc_policy.py`); not under FSDP or DeepSpeed, which shard to save memory. Plain path: set any
  MALLOC_* environment variable.
"""

import copy
import ctypes
import functools
import inspect
import os
import sys

import torch
import torch.nn.functional as F
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.pytorch_utils import Conv1D


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
            h, g = hidden[rows].to(ctx.dtype), grad[rows, None].to(acc)
            # d log p(y) / d logits = (onehot(y) - softmax(logits)) g: -p g everywhere, plus g at y; four passes over
            # the [chunk, vocab] block (the subtraction casts as it reads, one multiply negates and scales)
            dlogits = torch.sub(F.linear(h, w, b), lse[rows, None], out=torch.empty(0, dtype=acc, device=h.device))
            dlogits.exp_().mul_(-g).scatter_add_(-1, labels[rows, None], g)
            narrow = dlogits.to(ctx.dtype)
            grad_hidden[rows] = narrow @ w
            grad_weight += (narrow.T @ h).to(acc)
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


def lm_token_logprobs(model, head, inputs: dict, labels) -> tuple[torch.Tensor, ...]:
    """Causal LM: log p(labels[:, t + 1]) [B, T - 1] (0 where the label is -100), that mask, and the last hidden
    states [B, T, H]. One forward returns the hidden states (`logits_to_keep=1`: the full logits are never built;
    `use_cache=False`: no KV cache, whose per-layer state would also make a compiled layer recompile for each layer);
    `chunked_logprobs` runs `head` on the labelled positions. `model` may be the wrapped (DDP) module."""
    kw = dict(output_hidden_states=True, logits_to_keep=1, use_cache=False)
    out = model(**(inputs | kw))
    hidden, labels = out.hidden_states[-1], labels[:, 1:]
    mask = labels != -100
    logprobs = chunked_logprobs(hidden[:, :-1][mask], head.weight, labels[mask], head.bias)
    return torch.zeros(labels.shape, device=hidden.device).masked_scatter(mask, logprobs), mask, hidden


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


def warpers(temperature: float, top_k: int, top_p: float, min_p: float | None = None) -> list:
    """HF's temperature / top-k / top-p / min-p logits warpers, in HF's order, leaving out those that change nothing."""
    return (
        ([TemperatureLogitsWarper(temperature)] if temperature != 1 else [])
        + ([TopKLogitsWarper(top_k)] if top_k > 0 else [])
        + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
        + ([MinPLogitsWarper(min_p)] if min_p else [])
    )


def sampling_kwargs(
    temperature: float,
    top_k: int,
    top_p: float,
    inverse_cdf: bool = True,
    processors=(),
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
) -> dict:
    """`generate` arguments that sample at this temperature / top-k / top-p / min-p with this repetition penalty, after
    `processors` (e.g. a `LogitMask`). With `inverse_cdf`: a greedy `generate` over the repetition penalty, `processors`,
    HF's warpers (in HF's order) and `InverseCDFSampler`, the distribution of `do_sample=True`, whose torch.multinomial
    draws an exponential variate per vocabulary entry (on CPU, 3/4 of a rollout at a 50k vocabulary)."""
    if not inverse_cdf:
        options = dict(min_p=min_p, repetition_penalty=repetition_penalty) if min_p or repetition_penalty != 1 else {}
        return (
            dict(
                do_sample=True,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                logits_processor=LogitsProcessorList(processors),
            )
            | options
        )  # HF runs the processors before its warpers
    penalty = [RepetitionPenaltyLogitsProcessor(repetition_penalty)] if repetition_penalty != 1 else []
    chain = [*penalty, *processors, *warpers(temperature, top_k, top_p, min_p), InverseCDFSampler()]
    return dict(do_sample=False, logits_processor=LogitsProcessorList(chain))


def _cast_update(update, dtype, key_states, value_states, *args, **kwargs):
    return update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)


def cache_argument(model) -> str:
    """The name of a causal LM's KV-cache argument and output: `cache` from transformers 5.24 on (`past_key_values`
    still works there with a deprecation warning, and goes in 5.40), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes it through
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class FastGenerator:
    """Samples responses of a decoder-only model with a static KV cache, each decoding step's forward one compiled CUDA
    graph: the distribution of `generate` with `sampling_kwargs` (HF's warpers, then an inverse-CDF draw, both eager),
    without `generate`'s per-token Python, kernel launches and host syncs.

    Under autocast to a narrower dtype than float32 weights (bf16 autocast: the scripts' default on CUDA), it decodes
    with the linear layers' weights held in the autocast dtype, refreshed in place from the model's at the start of
    every call: one cast per rollout instead of one per matrix product per token (each decoding step read the float32
    weights and wrote bf16 copies of them, 3x the bytes of the bf16 weights), and the same logits bit for bit. The
    copies cost the linear weights' size in that dtype; `cast_weights=False` decodes with the model itself.

    Each cache (and its compiled graph, 15-30 s to build on an H100) is kept and reused: a batch runs in the smallest
    cache that holds it, up to 8 times its size (extra rows repeat the first prompt and are dropped; at these batch
    sizes a decoding step costs about the same), else in a new one of the batch's size whose length is rounded up to
    `bucket` tokens (prompts are padded on the left to fill it). Parameters must stay where they are in memory
    (optimizers update them in place; FSDP / ZeRO-3 resharding does not: use `generate` there). With `compile=False`
    the same loop runs eagerly (on CPU, for tests), as it does from then on where compiling fails (no working Triton or C
    compiler): a warning says so, and the rollouts stay correct, only slower."""

    def __init__(
        self,
        model,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        bucket: int = 64,
        compile: bool = True,
        cast_weights: bool = True,
    ):
        self.model, self.temperature, self.bucket, self.cast_weights = model, temperature, bucket, cast_weights
        self.decoder, self.casts = model, []  # what decodes: the model, or a copy with cast linear weights (`_decoder`)
        self.warpers = LogitsProcessorList(warpers(temperature, top_k, top_p))
        self.caches = {}
        self.cache_kw = cache_argument(model)
        self.forward = torch.compile(self._forward, mode="reduce-overhead", dynamic=False) if compile else self._forward

    def _draw(self, logits: torch.Tensor, with_logprob: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next token [B] and, if asked, its log-prob under logits / temperature [B] as the training forward
        computes it (else None: a full-vocabulary pass that the scripts, which recompute log-probs, do not need)."""
        logits = logits.float()
        token = inverse_cdf_draw(self.warpers(None, logits))
        logprob = torch.log_softmax(logits / self.temperature, -1).gather(-1, token)[:, 0] if with_logprob else None
        return token[:, 0], logprob

    def _decoder(self, dtype: torch.dtype):
        """The model to decode with under autocast to `dtype`: the model itself, or (`cast_weights`, float32 weights
        and a narrower dtype) a copy that shares every parameter with it except the weights and biases of its linear
        layers (nn.Linear, GPT-2's Conv1D), held in `dtype`: autocast casts them to `dtype` at every product anyway, so
        the logits are the model's bit for bit. Made on first use, refreshed in place at every call (a compiled graph
        keeps the addresses it recorded)."""
        floating = all(p.dtype == torch.float32 for p in self.model.parameters())
        if not (self.cast_weights and floating and dtype != torch.float32):
            self.decoder, self.casts = self.model, []
        elif self.decoder is self.model or not self.casts or self.casts[0][0].dtype != dtype:
            self.decoder = copy.deepcopy(self.model, {id(p): p for p in self.model.parameters()})  # parameters shared
            self.casts = []
            for copied, module in zip(self.decoder.modules(), self.model.modules()):
                if isinstance(module, (torch.nn.Linear, Conv1D)):
                    for name in ("weight", "bias"):
                        if getattr(module, name, None) is not None:
                            cast = torch.nn.Parameter(getattr(module, name).detach().to(dtype), requires_grad=False)
                            setattr(copied, name, cast)
                            self.casts.append((cast, getattr(module, name)))
        else:
            for cast, source in self.casts:
                cast.copy_(source)
        return self.decoder.train(self.model.training)

    def _forward(self, token, position, mask, cache) -> torch.Tensor:
        """The next logits [B, V] after one token per row [B] at `position` [B]."""
        return self.decoder(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=position[:, None],
            **{self.cache_kw: cache},
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
        decoder = self._decoder(dtype)
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
        logits = decoder(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
            **{self.cache_kw: cache},
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


def keep_freed_memory() -> None:
    """CPU runs with glibc: large blocks come from the heap and freed memory stays in the process, instead of each step's
    vocabulary-sized tensors being mapped afresh and page-faulted in, in the kernel (what it saves, and costs in peak
    memory: benchmarks/RESULTS-malloc-policy.json). Any MALLOC_* variable keeps glibc's own policy."""
    if any(key.startswith("MALLOC_") for key in os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to change
        return
    libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap for large blocks
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: do not return the heap's free top to the OS
