"""The one door to sampling: a policy's completions of left-padded prompts, cut after the first EOS or stop sequence,
with their mask, whether each ended and, when asked, each token's log-prob under the weights that sampled it. Three
backends behind it, chosen once at start:

- HF `generate` with the inverse-CDF draw (`sampling_kwargs`), on any device;
- `FastGenerator` on CUDA (a static KV cache, one compiled graph per decoding step), the same distribution;
- vLLM in this process (`--use-vllm`, common/vllm_engine.py), which holds a copy of the weights: `updated` after each
  update puts the trained ones in (or counts how far they lag). The other two sample the policy itself.

The rollout engine (common/rollout.py: grpo.py, rloo.py), ppo.py's rollouts and gkd.py's student samples all go
through `Sampler.generate`; another model's samples (a teacher, the reference) through `Sampler.generate_with`. A
script's loop never asks which backend runs: it reads `keeps_logprobs` (whether the sampler's log-probs come with every
sample, for the sampler-trainer correction) and `lag` (how many updates the sampling weights lag behind).
"""

from types import SimpleNamespace

import torch
from accelerate import Accelerator, DistributedType

from common.core import UsageError
from common.fast_paths import FastGenerator, sampling_kwargs
from common.models import peft_model_of, reference_context
from common.vllm_engine import VLLMClient, VLLMSampler, check_generation_options, check_vllm_args, generation_options


def check_sampling_args(args) -> None:
    """A one-line error for each sampling flag a script has out of its range (--top-p, --min-p, --repetition-penalty),
    a --generation-kwargs its backend cannot take, and with --use-vllm vLLM's own flags; before anything loads."""
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: it lies in (0, 1].")
    min_p, penalty = getattr(args, "min_p", None), getattr(args, "repetition_penalty", 1.0)
    if min_p is not None and not 0 <= min_p <= 1:
        raise UsageError(f"--min-p {min_p}: it lies in [0, 1].")
    if not penalty > 0:
        raise UsageError(f"--repetition-penalty {penalty}: it must be > 0 (1.0: no penalty).")
    if getattr(args, "use_vllm", False):
        check_vllm_args(args)
    check_generation_options(args)


def cut(completions, eos_token_id: int, pad_token_id: int, stop_token_ids=()):
    """Each completion [N, T] cut after its first EOS or stop sequence (token lists): (completions with pad after the
    cut, mask [N, T] float, ended [N]). A pad token sampled mid-completion stays a real token (the mask does not look at
    pad ids), and an EOS that is also the pad token ends the completion and counts."""
    T = completions.shape[1]
    is_eos = completions == eos_token_id
    ended = is_eos.any(1)
    last = torch.where(ended, is_eos.float().argmax(1), T - 1)
    for stop in stop_token_ids:  # a stop sequence ends at index i if completions[i-len+1 : i+1] == stop
        if len(stop) > T:
            continue
        hit = (completions.unfold(1, len(stop), 1) == torch.tensor(stop, device=completions.device)).all(-1)
        last = torch.minimum(last, torch.where(hit.any(1), hit.float().argmax(1) + len(stop) - 1, T - 1))
        ended = ended | hit.any(1)
    mask = torch.arange(T, device=completions.device)[None] <= last[:, None]
    return completions.masked_fill(~mask, pad_token_id), mask.float(), ended


class Sampler:
    """Samples of `policy` (an LM, or a value-head wrapper around one) at the run's temperature / top-k / top-p.

    `max_model_len`: the longest prompt plus the longest completion (vLLM sizes its cache by it). `processors`: logits
    processors applied before the warpers (ppo.py's --logit-mask); the fast path and vLLM take none, and the fast path
    no min-p, repetition penalty or --generation-kwargs either (HF `generate` serves those). `fast`: whether
    the fast path may serve (not for a quantized policy). `stop_token_ids`: token lists that end a completion as EOS
    does. `share`: another sampler whose vLLM engine this one samples through (`fork`). `batch_size`: prompts per
    call of the backend (None: all at once)."""

    def __init__(
        self,
        args,
        tokenizer,
        policy,
        accelerator: Accelerator,
        max_model_len: int,
        processors=(),
        fast=True,
        stop_token_ids=(),
        share=None,
        batch_size=None,
    ):
        self.args, self.tokenizer, self.policy, self.accelerator = args, tokenizer, policy, accelerator
        self.batch_size = batch_size
        top_k, top_p = getattr(args, "top_k", 0), getattr(args, "top_p", 1.0)
        inverse_cdf = getattr(args, "inverse_cdf_sampling", True)
        min_p, penalty = getattr(args, "min_p", None), getattr(args, "repetition_penalty", 1.0)
        self.temperature, self.stop_token_ids = args.temperature, [list(s) for s in stop_token_ids]
        self.sampling = sampling_kwargs(args.temperature, top_k, top_p, inverse_cdf, list(processors), min_p, penalty)
        options = generation_options(args)  # --generation-kwargs: more of generate's options (vLLM takes its own)
        self.sampling |= options
        self.encoder_decoder = policy.config.is_encoder_decoder
        self.sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        language_model = getattr(policy, "pretrained_model", policy)  # a value-head wrapper samples from its LM
        # the weight-sync state, all of it: vLLM's copy, whether it holds the policy's weights yet (a shared one does),
        # how many updates it lags behind them; `copied`: this sampler's policy is a copy of the trainer's (`fork`)
        self.vllm = share.vllm if share is not None else None
        self.loaded, self.lag, self.copied = self.vllm is not None, 0, False
        if getattr(args, "use_vllm", False) and self.vllm is None:
            engine = VLLMClient if args.vllm_mode == "server" else VLLMSampler  # a server of its own, or one in here
            self.vllm = engine(args, tokenizer, language_model, accelerator, max_model_len)
        # vLLM's numerics differ from the trainer's even on-policy: its log-probs come with every sample, for the
        # correction (TRL's vllm_importance_sampling_correction); the others return them when asked
        self.keeps_logprobs = self.vllm is not None
        self.fast = None
        if (
            fast
            and getattr(args, "fast_generation", False)
            and self.vllm is None
            and accelerator.device.type == "cuda"
            and inverse_cdf
            and not processors
            and not min_p
            and penalty == 1
            and not options
            and not self.encoder_decoder
            and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
        ):
            self.fast = FastGenerator(language_model, args.temperature, top_k, top_p)
        self.name = "vLLM, colocated" if self.vllm else "compiled static-cache decoding" if self.fast else "HF generate"
        if isinstance(self.vllm, VLLMClient):
            self.name = f"the vLLM server at {self.vllm.url} ({self.vllm.dtype})"
        elif self.vllm is not None:
            parallel = f", tensor-parallel over {self.vllm.tp} processes" if self.vllm.tp > 1 else ""
            self.name += f" ({self.vllm.dtype}{parallel})"

    def fork(self):
        """A sampler for a background thread (the asynchronous rollout worker): one that samples through this one's vLLM
        copy of the weights, or one over a frozen copy of the policy; `sync` refreshes either from the trainer."""
        if self.vllm is not None:
            return Sampler(self.args, self.tokenizer, self.policy, self.accelerator, 0, share=self, batch_size=self.batch_size)
        import copy

        policy = copy.deepcopy(self.policy).eval().requires_grad_(False)
        forked = Sampler(self.args, self.tokenizer, policy, self.accelerator, 0, batch_size=self.batch_size)
        forked.copied = True
        return forked

    def sync(self, policy) -> None:
        """The sampling weights replaced by `policy`'s (every rank calls it: a sharded weight is gathered): vLLM's copy, or
        a forked sampler's copy of the policy; a sampler of the policy itself has nothing to do."""
        if self.vllm is not None:
            self.vllm.load(getattr(policy, "pretrained_model", policy))
            self.loaded = True
        elif self.copied:
            with torch.no_grad():
                for mine, theirs in zip(self.policy.parameters(), policy.parameters()):
                    mine.copy_(theirs)
        self.lag = 0

    def updated(self, policy, sync: bool = True) -> None:
        """After an optimizer update of `policy`: its weights synced into the sampler's copy, or (`sync` False: a run that
        syncs every few updates) one more update of lag counted. Nothing for a sampler of the policy itself."""
        if sync:
            self.sync(policy)
        elif self.vllm is not None or self.copied:
            self.lag += 1

    def close(self) -> None:
        """The end of sampling: vLLM shut down while the process group exists (the others have nothing to close)."""
        if self.vllm is not None:
            self.vllm.close()

    def pad_left(self, token_lists: list[list[int]]):
        """Prompts (token lists) left-padded into a batch [N, P] and its mask, on the run's device."""
        batch = self.tokenizer.pad({"input_ids": token_lists}, padding_side="left", return_tensors="pt")
        return batch["input_ids"].to(self.accelerator.device), batch["attention_mask"].to(self.accelerator.device)

    def generate(self, prompts, prompt_mask, max_new_tokens: int, logprobs: bool = False):
        """The policy's completions [N, T] of left-padded prompts [N, P], cut after the first EOS or stop sequence (pad
        after it), their mask [N, T], whether each ended [N] and, with `logprobs` (or `keeps_logprobs`), each token's
        log-prob under the sampling weights [N, T] (log_softmax(logits / temperature), read off the decoding steps: no
        extra forward), else None. vLLM or the fast path draw where there is one; `batch_size` prompts at a time."""
        return self._chunks(self._generate, prompts, prompt_mask, max_new_tokens, logprobs)

    def generate_with(self, model, prompts, prompt_mask, max_new_tokens: int):
        """Another model's completions (a teacher, the reference) at the same settings, with HF `generate`: completions,
        mask and ended as `generate` returns them."""
        return self._chunks(self._generate_with, prompts, prompt_mask, max_new_tokens, model)[:3]

    def _chunks(self, sample, prompts, prompt_mask, *options):
        size = self.batch_size or len(prompts)
        outputs = [sample(prompts[i : i + size], prompt_mask[i : i + size], *options) for i in range(0, len(prompts), size)]
        if len(outputs) == 1:
            return outputs[0]
        width = max(o[0].shape[1] for o in outputs)  # generation stops early when every sequence has ended
        pad = lambda x, value: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)  # noqa: E731
        completions = torch.cat([pad(o[0], self.tokenizer.pad_token_id) for o in outputs])
        mask, ended = torch.cat([pad(o[1], 0.0) for o in outputs]), torch.cat([o[2] for o in outputs])
        sampled = torch.cat([pad(o[3], 0.0) for o in outputs]) if outputs[0][3] is not None else None
        return completions, mask, ended, sampled

    @torch.no_grad()
    def _generate(self, prompts, prompt_mask, max_new_tokens: int, logprobs: bool):
        tokenizer, sampled = self.tokenizer, None
        with self.accelerator.autocast():  # mixed precision reaches generate too (prepare wraps forward only)
            if self.vllm is not None:
                if not self.loaded:  # the first rollout or evaluation: the policy as loaded (or resumed)
                    self.sync(self.policy)
                token_lists = [row[m.bool()].tolist() for row, m in zip(prompts, prompt_mask)]
                seed = int(torch.randint(2**30, ()))  # from the run's RNG: a seeded run samples the same completions
                new, new_logprobs = self.vllm.generate(token_lists, max_new_tokens, seed)
                width, device = max(1, *map(len, new)), prompts.device
                completions = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in new], device=device)
                sampled = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in new_logprobs], device=device)
            elif self.fast is not None:
                ends = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                completions, sampled = self.fast(prompts, prompt_mask, max_new_tokens, **ends, return_logprobs=logprobs)
            else:
                completions, sampled = self._hf_generate(self.policy, prompts, prompt_mask, max_new_tokens, logprobs)
        return self._cut(completions, sampled)

    @torch.no_grad()
    def _generate_with(self, prompts, prompt_mask, max_new_tokens: int, model):
        with self.accelerator.autocast():
            completions, _ = self._hf_generate(model, prompts, prompt_mask, max_new_tokens, False)
        return self._cut(completions, None)

    def _hf_generate(self, model, prompts, prompt_mask, max_new_tokens: int, logprobs: bool):
        tokenizer = self.tokenizer
        out = model.generate(
            input_ids=prompts,
            attention_mask=prompt_mask,
            **self.sampling,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            synced_gpus=self.sharded,  # every rank decodes until all are done: each step is a collective
            **({"output_logits": True, "return_dict_in_generate": True} if logprobs else {}),
        )
        sequences = out.sequences if logprobs else out
        # a decoder-only model returns the prompt too; an encoder-decoder its decoder start token
        completions = sequences[:, 1:] if self.encoder_decoder else sequences[:, prompts.shape[1] :]
        if not logprobs:
            return completions, None
        steps = [torch.log_softmax(step.float() / self.temperature, -1) for step in out.logits]  # the raw logits
        return completions, torch.stack([s.gather(-1, t[:, None])[:, 0] for s, t in zip(steps, completions.T)], 1)

    def _cut(self, completions, sampled):
        completions, mask, ended = cut(
            completions, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, self.stop_token_ids
        )
        sampled = sampled.masked_fill(mask == 0, 0.0) if sampled is not None else None
        return completions, mask, ended, sampled


def decode(tokenizer, completions, mask) -> tuple[list[str], list[list[int]]]:
    """What reward functions and sample tables read of completions [N, T]: their text (special tokens skipped), and
    each one's token ids under `mask`."""
    ids = [row[m.bool()].tolist() for row, m in zip(completions, mask)]
    return tokenizer.batch_decode(completions, skip_special_tokens=True), ids


def sampler_gap(old, sampled, mask) -> dict[str, torch.Tensor]:
    """How far the sampler's per-token log-probs lie from the trainer's (TRL 1.16's sampling/sampling_logp_difference):
    |log pi_old - log pi_sampler| over the tokens of `mask` [B, T], as [sum, count] and [max, 1] pairs for `pooled`."""
    delta = (old.detach() - sampled).abs()[mask.bool()]
    count = torch.tensor(float(delta.numel()), device=mask.device)
    largest = delta.max() if delta.numel() else torch.zeros((), device=mask.device)
    return {
        "sampling/sampling_logp_difference/mean": torch.stack([delta.sum(), count]),
        "sampling/sampling_logp_difference/max": torch.stack([largest, torch.ones((), device=mask.device)]),
    }


def per_token_logprobs(
    net, prompts, prompt_mask, completions, completion_mask, temperature: float, entropy: bool | str = False
):
    """log pi(completion token) [N, T], logits / temperature as in sampling, and with `entropy` the policy's entropy
    [N, T] (for the logs; entropy="grad": with its gradient, for an entropy bonus; None otherwise)."""
    input_ids = torch.cat([prompts, completions], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    T = completions.shape[1]
    logits = net(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1, use_cache=False
    ).logits
    logits = logits[:, :-1]
    if temperature != 1.0:  # a full-vocabulary copy, skipped at temperature 1
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)  # once, for both the log-probs and the entropy
    if entropy == "grad":
        return logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        entropies = -logp.exp().mul_(logp).sum(-1) if entropy else None  # H = -sum_v p_v log p_v, one buffer
    return logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1), entropies


@torch.no_grad()
def held_out_samples(
    accelerator: Accelerator,
    model,
    ref_model,
    tokenizer,
    prompts: list[str] | list[list[int]],
    add_special_tokens: bool,
    keep: int,
    keep_end: bool = True,
    sharded: bool = False,
    table: int = 4,
    max_new_tokens: int = 24,
) -> tuple[dict[str, float], dict[str, list[str]]]:
    """The offline scripts' look at their policy (dpo.py, kto.py): its replies to held-out `prompts` (rendered texts, or
    their token ids), each cut to `keep` tokens from the end `keep_end` drops, sampled at temperature 1.

    Returns statistics and a table. Statistics: `kl` (decoder-only), the mean over replies of sum_t log pi - log pi_ref
    over the reply's tokens (an unbiased estimate of KL(pi || pi_ref) per reply); `length` in tokens (EOS included);
    `distinct`, the share of distinct replies. The table: the first `table` prompts' replies of the policy and of its
    reference (the frozen copy, or the policy with its LoRA adapter off; none when it was freed). `model` may be
    wrapped; `sharded`: every rank decodes (FSDP / ZeRO-3)."""
    ids = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"] if isinstance(prompts[0], str) else prompts
    ids = [(i[-keep:] if keep_end else i[:keep]) for i in ids]
    inputs = tokenizer.pad({"input_ids": ids}, padding_side="left", return_tensors="pt").to(accelerator.device)
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]
    policy = accelerator.unwrap_model(model)
    sampler = Sampler(SimpleNamespace(temperature=1.0), tokenizer, policy, accelerator, max_model_len=0)
    completions, mask, _, _ = sampler.generate(prompt_ids, prompt_mask, max_new_tokens)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    stats = {}
    has_reference = ref_model is not None or peft_model_of(policy) is not None
    if has_reference and not sampler.encoder_decoder:
        with accelerator.autocast():  # as the replies were sampled (mixed precision reaches them too)
            logprobs = per_token_logprobs(policy, prompt_ids, prompt_mask, completions, mask, 1.0)[0]
            with reference_context(policy, ref_model):
                ref_logprobs = per_token_logprobs(ref_model or policy, prompt_ids, prompt_mask, completions, mask, 1.0)[0]
        stats["kl"] = ((logprobs - ref_logprobs) * mask).sum(1).mean().item()
    stats["length"] = mask.sum(1).mean().item()
    stats["distinct"] = len(set(texts)) / len(texts)
    replies = {"policy": texts[:table]}
    if has_reference:
        with reference_context(policy, ref_model):
            rows = slice(0, table)
            ref_completions = sampler.generate_with(ref_model or policy, prompt_ids[rows], prompt_mask[rows], max_new_tokens)[
                0
            ]
        replies["reference"] = tokenizer.batch_decode(ref_completions, skip_special_tokens=True)
    return stats, replies
