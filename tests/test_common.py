import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from common.checkpoints import load_checkpoint, save_checkpoint
from common.core import (
    AdaptiveKLController,
    FixedKLController,
    LogitMask,
    RunningMoments,
    UsageError,
    check_scores,
    entropy_from_logprobs,
    exact_div,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    sizes,
)
from common.fast_paths import (
    FastGenerator,
    InverseCDFSampler,
    chunkable_head,
    chunked_logprobs,
    lm_token_logprobs,
    sampling_kwargs,
)
from common.loading import (
    check_columns,
    context_length,
    is_conversation,
    load_data,
    load_pretrained,
    load_tokenizer,
    quantization_kwargs,
    resolve,
)
from common.models import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    create_reference_model,
    load_reward_model,
    reference_context,
)
from common.outputs import atomic_directory, write_model_card
from common.run import RunLogger

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # selects 1, 2, 4


@pytest.mark.slow
def test_inverse_cdf_sampling_draws_from_the_warped_policy():
    """The sampler's frequencies over 40,000 draws match softmax(scores) (standard error of each under 0.0025) and it
    never draws a masked token; through `generate`, the first new token of 4,000 copies of one prompt follows the
    policy after HF's temperature, top-k and top-p warpers, in that order, and `processors` run before them."""
    torch.manual_seed(0)
    scores = torch.tensor([[1.0, 0.0, -math.inf, 2.0, -1.0]]).repeat(40_000, 1)
    drawn = InverseCDFSampler()(None, scores.clone()).argmax(-1)
    assert torch.allclose(torch.bincount(drawn, minlength=5) / len(drawn), scores[0].softmax(-1), atol=0.01)
    model = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).eval()
    prompt = torch.tensor([[464, 3290, 318]])
    with torch.no_grad():
        probs = (model(prompt).logits[0, -1] / 0.7).softmax(-1)
        top = probs.topk(20)
        top_probs = top.values / top.values.sum()  # top-p acts on the top-k renormalised
        keep = top_probs.cumsum(0) - top_probs < 0.6  # and keeps the tokens before their mass passes 0.6
        expected = torch.zeros_like(probs).index_put_((top.indices[keep],), top_probs[keep])
        tokens = model.generate(
            prompt.repeat(4000, 1), max_new_tokens=1, pad_token_id=0, **sampling_kwargs(0.7, 20, 0.6, inverse_cdf=True)
        )[:, -1]
    frequencies = torch.bincount(tokens, minlength=len(probs)) / len(tokens)
    assert set(tokens.tolist()) <= set(top.indices[keep].tolist()) and 1 < keep.sum() < 20
    assert torch.allclose(frequencies, expected / expected.sum(), atol=0.03), (frequencies[top.indices], top_probs)
    # processors run before the warpers and the draw, on both samplers: a logit mask that allows only the 30th and
    # 40th most likely tokens after the prompt's last one (both outside the top 20) samples those (after the warpers
    # it would leave nothing of the policy: every remaining logit the same lowest value)
    allowed = probs.argsort(descending=True)[[29, 39]].tolist()
    for inverse_cdf in (True, False):
        kwargs = sampling_kwargs(0.7, 20, 0.6, inverse_cdf, [LogitMask({318: allowed}, len(probs))])
        with torch.no_grad():
            tokens = model.generate(prompt.repeat(200, 1), max_new_tokens=1, pad_token_id=0, **kwargs)[:, -1]
        assert set(tokens.tolist()) <= set(allowed), (inverse_cdf, tokens.unique())


def test_fast_generator_samples_what_generate_samples_with_the_training_log_probs():
    """The compiled rollout path's loop, run eagerly: on left-padded prompts of different lengths, with a temperature,
    top-k and top-p, it draws the same tokens as `generate` with `sampling_kwargs` and a static cache of the same length
    from the same seed, pads after each row's first EOS as `generate` does, and returns each token's log-prob under
    logits / temperature as the teacher-forced forward computes it (as ppo.py / grpo.py score rollouts). With the
    default bucket (a longer cache, the prompts padded further) the log-probs still agree: the padding is invisible to
    the model up to float rounding (which can flip a draw among near-zero-probability tokens, so tokens are compared at
    equal cache lengths), also for a smaller batch run in the cache a larger one built."""
    model = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).eval()
    tokenizer = load_tokenizer("builtin:tiny-gpt2", padding_side="left")
    prompts = tokenizer(
        ["Hello, how are you?", "What is", "Tell me a story about a robot who learns"], padding=True, return_tensors="pt"
    )
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    assert (mask == 0).any(1).sum() == 2  # two rows padded
    pad = tokenizer.pad_token_id
    for temperature, top_k, top_p, eos, bucket in [
        (1.0, 0, 1.0, False, 1),
        (0.7, 20, 0.9, False, 1),
        (1.0, 0, 1.0, True, 1),
        (0.7, 20, 0.9, True, 64),
    ]:
        eos_id = None
        if eos:  # an EOS that the first row draws: a token of its unconstrained sample
            torch.manual_seed(3)
            eos_id = int(FastGenerator(model, bucket=1, compile=False)(ids, mask, 20, None, pad)[0][0, 4])
        torch.manual_seed(3)
        tokens, logprobs = FastGenerator(model, temperature, top_k, top_p, bucket, compile=False)(
            ids, mask, 20, eos_id, pad, return_logprobs=True
        )
        assert len(tokens) == 3 and tokens.shape[1] in ((16, 20) if eos else (20,))  # it stops early once all ended
        if bucket == 1:
            torch.manual_seed(3)
            with torch.no_grad():
                expected = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=20,
                    pad_token_id=pad,
                    eos_token_id=eos_id,
                    cache_implementation="static",
                    **sampling_kwargs(temperature, top_k, top_p),
                )[:, ids.shape[1] :]
            assert torch.equal(tokens[:, : expected.shape[1]], expected), (tokens, expected)
            assert (tokens[:, expected.shape[1] :] == pad).all()
        if eos and bucket == 1:
            assert tokens[0, 4] == eos_id and (tokens[0, 5:] == pad).all()
        full = torch.cat([mask, torch.ones_like(tokens)], 1)
        with torch.no_grad():
            logits = model(
                input_ids=torch.cat([ids, tokens], 1), attention_mask=full, position_ids=(full.cumsum(1) - 1).clamp(min=0)
            ).logits[:, ids.shape[1] - 1 : -1]
        drawn = tokens != pad if eos else torch.ones_like(tokens, dtype=torch.bool)
        assert torch.allclose(logprobs_from_logits(logits / temperature, tokens)[drawn], logprobs[drawn], atol=1e-5)
    # a smaller batch with shorter prompts runs in the cache already built (rows added, then dropped)
    generator = FastGenerator(model, bucket=64, compile=False)
    generator(ids, mask, 20, None, pad)
    tokens, logprobs = generator(ids[1:, -4:], mask[1:, -4:], 20, None, pad, return_logprobs=True)
    assert list(generator.caches) == [(3, 64, torch.float32)] and tokens.shape == logprobs.shape == (2, 20)
    full = torch.cat([mask[1:, -4:], torch.ones_like(tokens)], 1)
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([ids[1:, -4:], tokens], 1), attention_mask=full, position_ids=(full.cumsum(1) - 1).clamp(min=0)
        ).logits[:, 3:-1]
    assert torch.allclose(logprobs_from_logits(logits, tokens), logprobs, atol=1e-5)


def test_fast_generator_decodes_with_cast_linear_weights_bit_for_bit(chat_llama):
    """Under bf16 autocast with float32 weights (accelerate's bf16 mixed precision), the decoding loop holds its linear
    layers' weights in bf16 (nn.Linear in Llama, tied LM head included; Conv1D in GPT-2; LoRA's layers), shares every
    other parameter with the model, and draws the same tokens with the same log-probs as decoding with the model itself.
    After an in-place update of the weights (an optimizer step) the next call decodes with the new weights: a copy that
    was not refreshed would draw the old model's tokens."""
    from accelerate import Accelerator

    tokenizer = load_tokenizer("builtin:tiny-gpt2", padding_side="left")
    prompts = tokenizer(["Hello, how are you?", "What is"], padding=True, return_tensors="pt")
    ids, mask, pad = prompts["input_ids"], prompts["attention_mask"], tokenizer.pad_token_id
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    models = [
        load_pretrained(chat_llama, AutoModelForCausalLM),  # its vocabulary holds GPT-2's and two chat tokens
        load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM),
        get_peft_model(load_pretrained(chat_llama, AutoModelForCausalLM), lora),
    ]
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    for model in models:
        model = accelerator.prepare(model.eval())
        plain, cast = (
            FastGenerator(model, bucket=1, compile=False, cast_weights=False),
            FastGenerator(model, bucket=1, compile=False),
        )
        for update in range(2):
            runs = []
            for generator in (plain, cast):
                torch.manual_seed(update)
                with accelerator.autocast():
                    runs.append(generator(ids, mask, 12, None, pad, return_logprobs=True))
            assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
            with torch.no_grad():  # an optimizer step: every weight moves in place
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=0.5)
        assert plain.decoder is model and cast.decoder is not model
        linear = [m for m in cast.decoder.modules() if type(m).__name__ in ("Linear", "Conv1D")]
        assert linear and all(m.weight.dtype == torch.bfloat16 for m in linear)
        shared = {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in cast.decoder.parameters()}
        assert len(shared) == len(list(model.parameters())) - len(cast.casts) + (model.config.tie_word_embeddings is True)


def test_fast_generator_decodes_eagerly_when_compiling_fails(capsys):
    """Where torch.compile cannot build the decoding step (no working Triton or C compiler), the first rollout does not
    raise: it warns once and decodes the same tokens eagerly. Without the fallback the backend's error would surface."""

    def failing_backend(graph, example_inputs):
        raise RuntimeError("Cannot find a working triton installation")

    model = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).eval()
    tokenizer = load_tokenizer("builtin:tiny-gpt2", padding_side="left")
    prompts = tokenizer(["Hello, how are you?", "What is"], padding=True, return_tensors="pt")
    ids, mask, pad = prompts["input_ids"], prompts["attention_mask"], tokenizer.pad_token_id
    torch.manual_seed(3)
    expected, _ = FastGenerator(model, bucket=1, compile=False)(ids, mask, 6, None, pad)
    generator = FastGenerator(model, bucket=1, compile=False)
    generator.forward = torch.compile(generator._forward, backend=failing_backend, dynamic=False)
    torch.manual_seed(3)
    tokens, _ = generator(ids, mask, 6, None, pad)
    assert torch.equal(tokens, expected) and generator.forward == generator._forward
    assert capsys.readouterr().err.count("warning: compiling the decoding step failed") == 1


def test_bf16_checkpoints_load_in_float32_where_a_training_step_moves_the_weights(tmp_path):
    """Most hub checkpoints are bf16 and transformers 5 keeps a checkpoint's dtype: the scripts load in float32 (TRL's
    default), since one Adam step at a usual learning rate leaves nearly every bf16 weight where it was. dtype="auto"
    keeps bf16, and so do the value-head model and the reward-model loader when asked for bfloat16."""
    load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).to(torch.bfloat16).save_pretrained(tmp_path / "lm")
    rm = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1)
    rm.to(torch.bfloat16).save_pretrained(tmp_path / "rm")
    load_tokenizer("builtin:tiny-gpt2").save_pretrained(tmp_path / "rm")

    def moved_by_one_adam_step(model) -> float:
        weight = model.transformer.h[0].mlp.c_fc.weight
        before = weight.detach().clone()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
        model(input_ids=torch.arange(1, 9)[None], labels=torch.arange(1, 9)[None]).loss.backward()
        optimizer.step()
        return (weight.detach() != before).float().mean().item()

    default, auto = (
        load_pretrained(str(tmp_path / "lm"), AutoModelForCausalLM),
        load_pretrained(str(tmp_path / "lm"), AutoModelForCausalLM, dtype="auto"),
    )
    assert {p.dtype for p in default.parameters()} == {torch.float32} and auto.dtype == torch.bfloat16
    assert moved_by_one_adam_step(default) > 0.99 and moved_by_one_adam_step(auto) < 0.2
    assert AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "lm")).pretrained_model.dtype == torch.float32
    assert load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM, dtype="bfloat16").dtype == torch.bfloat16
    assert load_reward_model(str(tmp_path / "rm"))[0].dtype == torch.float32
    assert load_reward_model(str(tmp_path / "rm"), dtype="bfloat16")[0].dtype == torch.bfloat16


def test_logit_mask_zeroes_forbidden_transitions_only(tmp_path):
    mask = LogitMask({1: [2, 3]}, vocab_size=5)
    torch.manual_seed(0)
    logits, previous = torch.randn(2, 3, 5), torch.tensor([[1, 0, 1], [4, 1, 1]])
    probs, original = mask.apply(logits, previous).softmax(-1), logits.softmax(-1)
    after_1 = previous == 1
    assert (probs[after_1][:, [0, 1, 4]] == 0).all()  # exactly zero, not just small
    allowed = original[after_1][:, [2, 3]]
    torch.testing.assert_close(probs[after_1][:, [2, 3]], allowed / allowed.sum(-1, keepdim=True))  # renormalised
    torch.testing.assert_close(probs[~after_1], original[~after_1])  # unrestricted tokens: untouched
    assert torch.isfinite(entropy_from_logprobs(torch.log_softmax(mask.apply(logits, previous), -1))).all()
    # trlX's dense format (True: forbidden) gives the same mask; a processor for generate masks after input_ids[:, -1]
    dense = [[i == 1 and j not in (2, 3) for j in range(5)] for i in range(5)]
    (tmp_path / "dense.json").write_text(json.dumps(dense))
    from_file = LogitMask.from_file(str(tmp_path / "dense.json"), vocab_size=5)
    assert torch.equal(from_file.apply(logits, previous), mask.apply(logits, previous))
    torch.testing.assert_close(
        mask(torch.tensor([[0, 1], [1, 4]]), logits[:, 0]), mask.apply(logits[:, 0], torch.tensor([1, 4]))
    )
    for bad in ({1: []}, {1: [5]}, {7: [0]}):
        with pytest.raises(ValueError, match="at least one allowed next token"):
            LogitMask(bad, vocab_size=5)


def test_masked_mean_and_var_by_hand():
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7 / 3)
    assert masked_mean(VALUES, MASK, axis=1).tolist() == pytest.approx([1.5, 4.0])
    # squared deviations from 7/3: 16/9, 1/9, 25/9 -> sum 42/9; biased /3, unbiased /2
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(42 / 27)
    assert masked_var(VALUES, MASK).item() == pytest.approx(42 / 18)
    with pytest.raises(ValueError, match="empty"):
        masked_var(VALUES, torch.zeros_like(MASK))


def test_masked_whiten_2x3_by_hand():
    std = math.sqrt(42 / 18 + 1e-8)
    whitened = masked_whiten(VALUES, MASK)
    for (i, j), value in {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 4.0}.items():
        assert whitened[i, j].item() == pytest.approx((value - 7 / 3) / std)
    assert masked_mean(whitened, MASK).item() == pytest.approx(0.0, abs=1e-6)
    unshifted = masked_whiten(VALUES, MASK, shift_mean=False)
    assert unshifted[0, 0].item() == pytest.approx((1.0 - 7 / 3) / std + 7 / 3)


def test_chunked_logprobs_equal_the_full_logits_in_value_and_gradient():
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(37, 8), torch.randn(50, 8), torch.randn(50)
    labels, grad = torch.randint(0, 50, (37,)), torch.randn(37)
    results = []
    for fn in (
        lambda h, w, b: chunked_logprobs(h, w, labels, b, chunk_size=5),  # 8 chunks, the last one short
        lambda h, w, b: logprobs_from_logits(torch.nn.functional.linear(h, w, b), labels),
    ):
        inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        out = fn(*inputs)
        (out * grad).sum().backward()
        results.append([out, *(t.grad for t in inputs)])
    for chunked, full in zip(*results):
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    double = [t.double().requires_grad_() for t in (hidden[:6], weight[:9, :3].contiguous(), bias[:9])]
    assert torch.autograd.gradcheck(lambda h, w, b: chunked_logprobs(h[:, :3], w, labels[:6] % 9, b, chunk_size=4), double)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the projection in bf16 as autocast's linear, softmax in fp32
        out = chunked_logprobs(hidden, weight, labels, bias)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, logprobs_from_logits(torch.nn.functional.linear(hidden, weight, bias), labels))


def test_lm_token_logprobs_match_the_models_logits_and_chunkable_head_refuses_scaled_heads():
    model = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).eval()
    ids = torch.randint(0, 1000, (3, 9))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 6:] = 0
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[1, :4] = -100  # a prompt
    head = chunkable_head(model)
    logprobs, mask, hidden = lm_token_logprobs(model, head, dict(input_ids=ids, attention_mask=attention_mask), labels)
    expected = logprobs_from_logits(model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1], ids[:, 1:])
    assert torch.equal(mask, labels[:, 1:] != -100) and hidden.shape == (3, 9, model.config.n_embd)
    torch.testing.assert_close(logprobs, expected * mask, rtol=1e-5, atol=1e-5)
    assert chunkable_head(model, sharded=True) is None
    model.config.final_logit_softcapping = 30.0
    assert chunkable_head(model) is None


def test_logprobs_and_entropy_against_explicit_formula():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 1]])
    z = math.exp(1) + math.exp(2) + math.exp(3)
    assert logprobs_from_logits(logits, labels)[0].tolist() == pytest.approx([3 - math.log(z), -math.log(3)])
    p = [math.exp(k) / z for k in (1, 2, 3)]
    assert entropy_from_logprobs(torch.log_softmax(logits, -1))[0].tolist() == pytest.approx(
        [-sum(q * math.log(q) for q in p), math.log(3)]
    )


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_estimate(logp, ref, "kl").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "abs").tolist() == pytest.approx([0.5, 1.0])
    assert kl_estimate(logp, ref, "mse").tolist() == pytest.approx([0.125, 0.5])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, math.exp(1) - 1 - 1])
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    full = kl_estimate(p.log()[None], q.log()[None], "full")
    assert full.item() == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p.tolist(), q.tolist())), rel=1e-5)
    with pytest.raises(ValueError, match="Unknown KL penalty"):
        kl_estimate(logp, ref, "nope")


def test_adaptive_kl_controller_follows_formula_over_updates():
    controller, expected = AdaptiveKLController(0.2, target=6.0, horizon=10000), 0.2
    for kl, n_steps in [(9.0, 256), (3.0, 256), (6.6, 100), (6.0, 64)]:
        controller.update(kl, n_steps)
        expected *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * n_steps / 10000
        assert controller.value == pytest.approx(expected)
    assert controller.value != pytest.approx(0.2)
    fixed = FixedKLController(0.1)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.1


def test_running_moments_equal_the_statistics_of_everything_seen():
    torch.manual_seed(0)
    batches = [torch.randn(5) * 3 + 1, torch.randn(8) - 2, torch.randn(3) * 0.5]
    moments = RunningMoments()
    for batch in batches:
        moments.update(batch)
    everything = torch.cat(batches)
    assert moments.mean == pytest.approx(everything.mean().item(), abs=1e-5)
    assert moments.std == pytest.approx(everything.std().item(), abs=1e-5)  # unbiased, like torch.std


def test_check_scores_rejects_bad_rewards():
    assert check_scores([0.5, 1.0], 2, "reward_fn").tolist() == [0.5, 1.0]
    with pytest.raises(ValueError, match="returned 1 scores for 2 samples"):
        check_scores([0.5], 2, "reward_fn")
    with pytest.raises(ValueError, match="NaN"):
        check_scores([0.5, float("nan")], 2, "reward_fn")


def test_exact_div():
    assert exact_div(64, 16) == 4
    with pytest.raises(ValueError, match="^10 is not divisible by 4; "):
        exact_div(10, 4)
    args = SimpleNamespace(batch_size=3, num_generations=4, total_prompts=10)
    with pytest.raises(ValueError, match=r"^--total-prompts 10 is not divisible by --batch-size 3 x 2 processes \(6\); "):
        exact_div(10, 6, sizes(args, "total_prompts"), sizes(args, "batch_size", processes=2))
    with pytest.raises(ValueError, match=r"^--batch-size 3 x --num-generations 4 \(12\) is not divisible by --total-prompts"):
        exact_div(12, 10, sizes(args, "batch_size", "num_generations"), sizes(args, "total_prompts"))


def test_value_head_round_trip(tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        "builtin:tiny-gpt2", value_head_kwargs=dict(init="normal", init_std=0.5)
    ).eval()
    input_ids = torch.tensor([[10, 20, 30, 40]])
    logits, values = model(input_ids=input_ids)
    assert logits.shape == (1, 4, 6818) and values.shape == (1, 4) and values.abs().sum() > 0
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)  # the LM alone loads with plain transformers
    assert torch.allclose(plain(input_ids=input_ids).logits, logits, atol=1e-5)
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path)).eval()
    logits2, values2 = loaded(input_ids=input_ids)
    assert torch.allclose(logits2, logits, atol=1e-5) and torch.allclose(values2, values, atol=1e-6)
    zero_head = AutoModelForCausalLMWithValueHead.from_pretrained("builtin:tiny-gpt2")
    assert zero_head(input_ids=input_ids)[1].abs().sum() == 0  # lm-human-preferences zero init


def test_seq2seq_value_head():
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained("builtin:tiny-t5")
    pad = model.pretrained_model.config.decoder_start_token_id  # the decoder starts at the pad token
    logits, values = model(input_ids=torch.tensor([[5, 6, 7]]), decoder_input_ids=torch.tensor([[pad, 8]]))
    assert logits.shape[:2] == (1, 2) and values.shape == (1, 2)


def test_value_head_with_peft_round_trip(tmp_path):
    base = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False)
    model = AutoModelForCausalLMWithValueHead(get_peft_model(base, lora), init="normal").eval()
    input_ids = torch.tensor([[1, 2, 3]])
    logits, values = model(input_ids=input_ids)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"] == "builtin:tiny-gpt2"
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path)).eval()
    logits2, values2 = loaded(input_ids=input_ids)
    assert torch.allclose(logits2, logits, atol=1e-5) and torch.allclose(values2, values, atol=1e-6)


def test_reference_model_shares_bottom_layers():
    model = AutoModelForCausalLMWithValueHead.from_pretrained("builtin:tiny-gpt2")
    ref = create_reference_model(model, num_shared_layers=1)
    policy_params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    for name in ["pretrained_model.transformer.wte.weight", "pretrained_model.transformer.h.0.attn.c_attn.weight"]:
        assert ref_params[name].data_ptr() == policy_params[name].data_ptr()
        assert not policy_params[name].requires_grad
    for name in ["pretrained_model.transformer.h.1.attn.c_attn.weight", "v_head.summary.weight"]:
        assert ref_params[name].data_ptr() != policy_params[name].data_ptr()
        assert policy_params[name].requires_grad and not ref_params[name].requires_grad
    assert not ref.training
    full_copy = create_reference_model(model)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), full_copy.parameters()))
    with pytest.raises(ValueError, match="fewer blocks"):
        create_reference_model(model, num_shared_layers=2)
    with pytest.raises(ValueError, match="pattern="):
        create_reference_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), num_shared_layers=1)


def test_peft_reference_is_the_disabled_adapter():
    base = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)
    input_ids = torch.tensor([[1, 2, 3]])
    base_logits = base(input_ids=input_ids).logits
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False)
    model = AutoModelForCausalLMWithValueHead(get_peft_model(base, lora)).eval()
    assert create_reference_model(model) is None  # no copy at all
    assert not torch.allclose(model(input_ids=input_ids)[0], base_logits)
    with reference_context(model, None):
        assert torch.allclose(model(input_ids=input_ids)[0], base_logits, atol=1e-6)


def test_builtin_presets_are_seeded_and_offline():
    a = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1)
    b = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id and len(tokenizer) == 6818
    assert tokenizer.decode(tokenizer("Hello world")["input_ids"]) == "Hello world"


@pytest.mark.slow
def test_pretrained_preset_builds_deterministically(tmp_path):
    """The same seed gives the same weights (a short build: the recipe of builtin:tiny-chat, 4 steps)."""
    from safetensors.torch import load_file

    from presets.pretrained import build_tiny_chat

    for name in ("a", "b"):
        build_tiny_chat(str(tmp_path / name), max_steps=4)
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    random_init = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "a").config.n_layer == 4 != random_init.config.n_layer


def test_building_a_builtin_leaves_the_callers_random_state_and_clears_a_killed_build(tmp_path, monkeypatch):
    """A run that builds a pretrained built-in on first use draws the same random numbers as a run that finds it
    cached (torch's, Python's, NumPy's); a half-written folder a killed build left behind is removed."""
    import functools
    import random

    import numpy as np
    from accelerate.utils import set_seed

    import presets
    from presets import pretrained

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(pretrained, "build_tiny_chat", functools.partial(pretrained.build_tiny_chat, max_steps=2))
    leftover = tmp_path / "rlhf-builtin" / ".tmp-tiny-chat-v3-abcd1234"
    leftover.mkdir(parents=True)

    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    runs = []
    for _ in ("cold", "warm"):
        set_seed(5)
        first = draws()
        presets.folder("builtin:tiny-chat")
        runs.append((first, draws()))
    assert runs[0] == runs[1] and not leftover.exists()


def test_a_builtin_is_built_on_one_thread_whatever_the_callers_count(tmp_path, monkeypatch):
    """torch splits a float sum by thread, so a build's weights would depend on the run that triggered it: the build
    runs on one thread (what the test suite's builds use), and the caller gets its own count back."""
    from presets import pretrained

    seen = []

    def build(folder):
        seen.append(torch.get_num_threads())
        open(os.path.join(folder, "config.json"), "w").write("{}")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(pretrained, "build_tiny_chat", build)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pretrained.pretrained_folder("builtin:tiny-chat")
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_damaged_builtin_cache_is_rebuilt_with_a_line_or_named_when_it_cannot_be(tmp_path, monkeypatch, capsys):
    """A cached built-in is checked when it is used: a truncated tokenizer.json, a deleted tokenizer_config.json or cut
    weights are rebuilt, with one line saying so; where the cache cannot be written, one line names the folder."""
    import functools

    from presets import pretrained, tiny

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(pretrained, "build_tiny_chat", functools.partial(pretrained.build_tiny_chat, max_steps=2))
    cache = tmp_path / "rlhf-builtin"
    reference = load_tokenizer("builtin:tiny-gpt2")
    for damage in ("truncate tokenizer.json", "delete tokenizer_config.json"):
        action, name = damage.split()
        if action == "truncate":
            (cache / "tiny-chat-tokenizer-v1" / name).write_text((cache / "tiny-chat-tokenizer-v1" / name).read_text()[:1000])
        else:
            (cache / "tiny-chat-tokenizer-v1" / name).unlink()
        capsys.readouterr()
        tokenizer = load_tokenizer("builtin:tiny-gpt2")
        assert f"the cached tokenizer {cache / 'tiny-chat-tokenizer-v1'} is damaged ({name}" in capsys.readouterr().out
        assert tokenizer.pad_token_id == reference.pad_token_id and len(tokenizer) == len(reference)
    folder = cache / "tiny-chat-v3"
    assert resolve("builtin:tiny-chat") == str(folder)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    capsys.readouterr()
    assert resolve("builtin:tiny-chat") == str(folder) and (folder / "model.safetensors").read_bytes() == weights
    assert "builtin:tiny-chat: the cached folder" in capsys.readouterr().out  # rebuilt (deterministically: same bytes)
    AutoModelForCausalLM.from_pretrained(folder)
    (folder / "config.json").unlink()
    (cache / "tiny-chat-tokenizer-v1" / "tokenizer.json").write_text("{")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pretrained, "file_lock", read_only)
    monkeypatch.setattr(tiny.tempfile, "mkdtemp", read_only)
    with pytest.raises(UsageError, match=r"tiny-chat-v3 is damaged \(config.json is missing\) and cannot be rebuilt"):
        resolve("builtin:tiny-chat")
    with pytest.raises(
        UsageError, match=r"tiny-chat-tokenizer-v1 is damaged \(tokenizer.json has 1 bytes, not \d+\) .*delete that folder"
    ):
        load_tokenizer("builtin:tiny-gpt2")


@pytest.mark.slow
def test_a_cold_cache_run_repeats_a_warm_one(tmp_path, monkeypatch):
    """sft.py on a pretrained built-in, once building it and once finding it cached: the same weights, bit for bit."""
    import functools

    from conftest import ROOT, run_script
    from safetensors.torch import load_file

    from presets import pretrained

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained, "build_tiny_chat", functools.partial(pretrained.build_tiny_chat, max_steps=2))
    command = [os.path.join(ROOT, "sft.py"), "--model-name", "builtin:tiny-chat", "--max-steps", "3", "--max-seq-length", "32"]
    outputs = [run_script([*command, "--output-dir", name], tmp_path) for name in ("cold", "warm")]
    assert "builtin:tiny-chat: built in" in outputs[0] and "built in" not in outputs[1]
    summaries = [re.sub(r" in \d+s", "", out.strip().splitlines()[-1]) for out in outputs]
    assert summaries[0] == summaries[1].replace("warm", "cold"), summaries
    cold, warm = (load_file(tmp_path / name / "model.safetensors") for name in ("cold", "warm"))
    assert all(torch.equal(cold[k], warm[k]) for k in cold)


@pytest.mark.slow
def test_pretrained_preset_speaks_the_dialogue():
    """builtin:tiny-chat (built once and cached, shared by every test that needs it) loads with plain from_pretrained
    and predicts the built-in dialogue far better than a random model (8.8 nats per token over its 6,818 tokens)."""
    from transformers import AutoTokenizer

    from presets.data import chatterbot_pairs
    from presets.pretrained import pretrained_folder

    folder = pretrained_folder("builtin:tiny-chat")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    texts = [f"{p} {r}{tokenizer.eos_token}" for p, r in chatterbot_pairs()[::20]]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        loss = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
    assert loss.item() < 3.5, loss  # measured 2.3 (the built-in dialogue is its training text)
    reward_model = load_pretrained("builtin:tiny-chat-rm", AutoModelForSequenceClassification)
    assert reward_model.config.num_labels == 1 and reward_model.config.name_or_path == "builtin:tiny-chat-rm"


def test_tiny_chats_tokenizer_gives_the_builtin_texts_gpt2s_tokens():
    """builtin:tiny-chat's tokenizer is GPT-2's cut to what the built-in texts use: every turn of the dialogue gets
    GPT-2's tokens, from a seventh of GPT-2's vocabulary with a pad token apart from EOS, and text from elsewhere still
    comes back whole, in smaller pieces."""
    from presets.data import chatterbot_conversations
    from presets.tiny import chat_tokenizer, gpt2_tokenizer

    chat, gpt2 = chat_tokenizer(), gpt2_tokenizer()
    texts = [turn for turns in chatterbot_conversations() for turn in turns]
    assert [chat.tokenize(t) for t in texts] == [gpt2.tokenize(t) for t in texts]
    assert len(chat) < len(gpt2) / 7 and chat.pad_token_id not in (None, chat.eos_token_id)
    other = "Zyxomancy über 12345<|endoftext|>"
    ids = chat(other)["input_ids"]
    assert chat.decode(ids) == other and ids[-1] == chat.eos_token_id and len(ids) > len(gpt2(other)["input_ids"])


@pytest.mark.slow
def test_builtin_prompts_are_ones_tiny_chat_answers():
    """builtin:chatterbot-prompts holds the utterances that open a conversation: builtin:tiny-chat starts a reply to
    them, where it ends most mid-conversation lines at once (out of context they read as closing answers). Measured:
    P(EOS as the first reply token) 0.08 on average over the prompts, 0.48 over the mid-conversation lines."""
    from transformers import AutoTokenizer

    from presets.data import chatterbot_pairs, dataset
    from presets.pretrained import pretrained_folder

    folder = pretrained_folder("builtin:tiny-chat")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    prompts = list(dataset("builtin:chatterbot-prompts")["prompt"])
    middle = sorted({p for p, _ in chatterbot_pairs()} - set(prompts))
    assert len(prompts) == len(set(prompts)) == 749 and len(middle) > 200

    def p_eos(texts: list[str]) -> float:
        tokenizer.padding_side = "left"
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        position_ids = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(**batch, position_ids=position_ids).logits[:, -1]
        return logits.softmax(-1)[:, tokenizer.eos_token_id].mean().item()

    assert p_eos(prompts) < 0.12 and p_eos(middle) > 0.3


def test_tokenizer_without_pad_is_a_clear_error(tmp_path):
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no pad token"):
        load_tokenizer(str(tmp_path))


def test_builtin_and_local_datasets(tmp_path):
    preferences = load_data("builtin:vader-preferences")
    assert len(preferences) > 1000 and preferences.column_names == ["prompt", "chosen", "rejected"]
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    for row in preferences.select(range(20)):
        assert analyzer.polarity_scores(row["chosen"])["compound"] > analyzer.polarity_scores(row["rejected"])["compound"]
    # offline RL data: each utterance twice, first with its real reply, then with one drawn from all replies (seeded)
    dialogue, mixed = load_data("builtin:chatterbot-dialogue"), load_data("builtin:chatterbot-mixed-replies")
    assert len(mixed) == 2 * len(dialogue) and mixed["prompt"][::2] == mixed["prompt"][1::2] == dialogue["prompt"]
    assert mixed["completion"][::2] == dialogue["completion"] and set(mixed["completion"][1::2]) <= set(dialogue["completion"])
    assert (
        mixed["completion"][1::2] != dialogue["completion"]
        and load_data("builtin:chatterbot-mixed-replies")[:50] == mixed[:50]
    )
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}"}) for i in range(3)))
    local = load_data(str(path))
    assert local["question"] == ["q0", "q1", "q2"]
    with pytest.raises(ValueError, match=r"no column \['prompt'\].*'question'"):
        check_columns(local, ["prompt"])
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path.write_text("\n".join(json.dumps({"prompt": "q", "chosen": chat, "score": 1.0}) for _ in range(3)))
    conversations = load_data(str(path))
    assert is_conversation(conversations[0]["chosen"]) and not is_conversation(conversations[0]["prompt"])
    check_columns(conversations, ["prompt", "chosen", "score"], numeric=("score",))  # text, messages, numbers
    with pytest.raises(ValueError, match=r"'chosen' holds chat messages.*apply_chat_template"):
        check_columns(conversations, ["prompt", "chosen"], chat=False)  # a script that reads text only (ilql.py)
    # values of the wrong kind are named with their column and row; so is a corrupt line and a missing file
    path.write_text("\n".join(json.dumps({"prompt": p, "score": r}) for p, r in [("a", 1.0), (None, 2.0), ("c", "x")]))
    with pytest.raises(UsageError, match=r"column 'prompt', row 1: None is not text"):
        check_columns(load_data(str(path)), ["prompt"])
    path.write_text("\n".join(json.dumps({"prompt": p, "score": r}) for p, r in [("a", 1.0), ("b", "high")]))
    with pytest.raises(UsageError, match=r"column 'score', row 1: 'high' is not a number"):
        check_columns(load_data(str(path)), ["prompt", "score"], numeric=("score",))
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n')
    with pytest.raises(UsageError, match=r"data.jsonl, line 2: not valid JSON"):
        load_data(str(path))
    with pytest.raises(UsageError, match=r"nope.jsonl'?: no such file"):
        load_data(str(tmp_path / "nope.jsonl"))


def test_atomic_directory_keeps_previous_on_failure(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(str(target)) as tmp:
        (tmp_path / tmp / "a.txt").write_text("first")
    with pytest.raises(RuntimeError):
        with atomic_directory(str(target)) as tmp:
            (tmp_path / tmp / "a.txt").write_text("half")
            raise RuntimeError("crash mid-save")
    assert (target / "a.txt").read_text() == "first"
    with atomic_directory(str(target)) as tmp:
        (tmp_path / tmp / "a.txt").write_text("second")
        os.chmod(tmp_path / tmp / "a.txt", 0o600)  # as safetensors writes model.safetensors
    assert (target / "a.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (target.stat().st_mode & 0o777) == 0o777 & ~_umask()  # 0755 under the usual umask, as save_pretrained
    assert ((target / "a.txt").stat().st_mode & 0o777) == 0o666 & ~_umask()  # 0644 under the usual umask


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_atomic_directory_recovers_a_save_killed_between_its_renames(tmp_path):
    """A SIGKILL after the old folder was renamed aside and before the new one was renamed into place leaves no
    `ckpt`; the next save (or recover_directory) puts the newest complete copy back first, and cleans up."""
    from common.outputs import MARKER, recover_directory

    target = tmp_path / "ckpt"
    for kind, text in (("old", "previous"), ("new", "complete new")):  # two complete saves, each with its marker
        (tmp_path / f".{kind}-ckpt-abcd1234").mkdir()
        (tmp_path / f".{kind}-ckpt-abcd1234" / "a.txt").write_text(text)
        (tmp_path / f".{kind}-ckpt-abcd1234" / MARKER).write_text("{}")
    (tmp_path / ".tmp-ckpt-efgh5678").mkdir()  # a half-written one: never used
    (tmp_path / ".tmp-ckpt-2-efgh5678").mkdir()  # another folder's leftover: not ours
    recover_directory(str(target))
    assert (target / "a.txt").read_text() == "complete new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-ckpt-2-efgh5678", "ckpt"]
    # killed with only the old copy aside: it comes back
    os.rename(target, tmp_path / ".old-ckpt-zzzz9999")
    with atomic_directory(str(target)) as tmp:
        assert (target / "a.txt").read_text() == "complete new"  # recovered before the new save starts
        (tmp_path / tmp / "a.txt").write_text("third")
    assert (target / "a.txt").read_text() == "third"


def test_model_card_names_base_data_metrics_and_command(tmp_path, monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class Args:
        model_name: str = "gpt2"
        dataset_name: str = "my/data"
        learning_rate: float = 1e-5
        output_dir: str = "outputs/dpo"

    monkeypatch.setattr("sys.argv", ["dpo.py", "--learning-rate", "1e-5"])
    write_model_card(str(tmp_path), Args(), "dpo", {"eval/rewards/accuracies": 0.8125})
    card = (tmp_path / "README.md").read_text()
    for text in (
        "library_name: transformers",
        "# dpo",
        "- base model: `gpt2`",
        "- dataset: `my/data`",
        "| eval/rewards/accuracies | 0.8125 |",
        "python dpo.py --learning-rate 1e-5",
        "| learning_rate | 1e-05 |",
    ):
        assert text in card, (text, card)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_quantised_loading_says_what_is_missing():
    assert quantization_kwargs("gpt2", False, False, use_peft=False) == {}
    with pytest.raises(ValueError, match="not both"):
        quantization_kwargs("gpt2", True, True, use_peft=True)
    with pytest.raises(ValueError, match="add --use-peft"):
        quantization_kwargs("gpt2", True, False, use_peft=False)
    with pytest.raises(ValueError, match="tiny built-in preset"):
        quantization_kwargs("builtin:tiny-gpt2", False, True, use_peft=True)
    with pytest.raises(UsageError, match="--load-in-4bit needs a CUDA GPU and bitsandbytes"):
        quantization_kwargs("gpt2", False, True, use_peft=True)


def test_sample_tables_shorten_long_cells_on_the_console_only(tmp_path, capsys):
    args = SimpleNamespace(track=False, log_dir=str(tmp_path), seed=1)
    RunLogger("run", args).close()
    assert not (tmp_path / "run").exists()  # opened on first use: a run that stops before logging leaves no folder
    logger = RunLogger("run", args)
    logger.samples("samples", {"prompt": ["a" * 150 + "b" * 150], "score": [0.5]}, step=1, max_chars=20)
    logger.close()
    printed = capsys.readouterr().out
    assert "a" * 10 + " … " + "b" * 10 in printed and "a" * 11 not in printed and "0.500" in printed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"tensors": 0})
    events.Reload()
    markdown = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "a" * 150 + "b" * 150 in markdown  # TensorBoard keeps the whole text


def test_context_length_of_absolute_relative_and_no_positions():
    from transformers import BertConfig, GPT2Config, T5Config

    assert context_length(GPT2Config(n_positions=24)) == 24 and context_length(BertConfig()) == 512
    assert context_length(T5Config()) is None and context_length(None) is None  # relative positions; no model
    assert context_length(load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM, n_positions=32).config) == 32


def test_resume_from_a_folder_that_is_no_checkpoint_is_a_clear_error(tmp_path):
    from accelerate import Accelerator

    from common.checkpoints import load_checkpoint

    (tmp_path / "model").mkdir()
    with pytest.raises(UsageError, match="not a checkpoint folder"):
        load_checkpoint(Accelerator(), str(tmp_path / "model"))


def test_cli_checks_resume_from_before_anything_is_loaded(tmp_path, monkeypatch):
    """Every script parses its flags with `cli`, which rejects a --resume-from that is no checkpoint at once."""
    import dataclasses
    import sys

    from common.cli import cli

    @dataclasses.dataclass
    class Args:
        resume_from: str | None = None
        """a checkpoint folder"""

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # cli installs its own
    monkeypatch.setattr(sys, "argv", ["script.py", "--resume-from", str(tmp_path / "no-checkpoint")])
    with pytest.raises(UsageError, match="not a checkpoint folder"):
        cli(Args)
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "trainer_state.json").write_text('{"step": 2}')
    monkeypatch.setattr(sys, "argv", ["script.py", "--resume-from", str(tmp_path / "step_2")])
    assert cli(Args).resume_from == str(tmp_path / "step_2")


def test_cli_filters_deepspeeds_device_guess(tmp_path, monkeypatch):
    """Where deepspeed is installed, accelerate imports it and on a CPU machine it logs "[WARNING] Setting accelerator to
    CPU..." from its own "DeepSpeed" logger, in every run: cli filters that one line (it printed before, checked),
    however late deepspeed makes its logger, and lets every other DeepSpeed message through."""
    import dataclasses
    import logging
    import sys

    from common.cli import cli

    @dataclasses.dataclass
    class Args:
        output_dir: str = str(tmp_path / "out")
        """where the model goes"""

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "argv", ["script.py"])
    cli(Args)

    def passes(message: str) -> bool:
        record = logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213, message, None, None)
        return bool(logging.getLogger("DeepSpeed").filter(record))

    guess = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    assert not passes(guess) and passes("ZeRO stage 3: the optimizer state does not fit")


def test_cli_help_flows_docstrings_wrapped_in_the_source(monkeypatch, capsys):
    """A field docstring wrapped over indented source lines prints as one paragraph in --help (tyro alone starts a
    new line at each of them); a blank line stays a paragraph break."""
    import dataclasses
    import sys

    from common.cli import cli

    @dataclasses.dataclass
    class Args:
        reward_model: str = "rm"
        """a reward model: a hub id, a local folder, or
        builtin:tiny-chat-rm (built on first use)

        a second paragraph"""
        undocumented: int = 0
        batch_size: int = 8

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "argv", ["script.py", "--help"])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli(Args)
    lines = [line.strip(" │") for line in capsys.readouterr().out.splitlines()]
    assert any(line.endswith("a local folder, or builtin:tiny-chat-rm (built on first use)") for line in lines)
    assert any(line.startswith("a second paragraph") for line in lines)
    assert dataclasses.fields(Args)[0].metadata["help"].count("\n") == 2
    assert "help" not in dataclasses.fields(Args)[1].metadata  # no docstring: the next field's default is not one


@pytest.mark.parametrize("kind", ["plain", "lora", "value-head"])
def test_a_checkpoint_stores_the_trained_weights_once_and_restores_them(tmp_path, kind):
    """save_checkpoint keeps the model's weights only in its from_pretrained files (accelerate's state holds the
    optimizer, not a second copy); load_checkpoint puts them back bit for bit, adapters and value head included."""
    from accelerate import Accelerator

    model = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)
    if kind == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    if kind == "value-head":
        model = AutoModelForCausalLMWithValueHead(model)
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.tensor([[1, 2, 3, 4]])
    output = model(input_ids=ids)
    loss = (output[1] if kind == "value-head" else output.logits).float().pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    save_checkpoint(accelerator, str(tmp_path / "step_1"), {"step": 1}, model, load_tokenizer("builtin:tiny-gpt2"))
    assert not list((tmp_path / "step_1" / "accelerate_state").glob("model*.safetensors"))  # stored once
    with torch.no_grad():  # a resumed run starts from the untrained model (with LoRA: the same frozen base)
        for p in model.parameters():
            p.add_(1.0 if p.requires_grad else 0.0)
    assert load_checkpoint(accelerator, str(tmp_path / "step_1"))["step"] == 1
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert optimizer.state_dict()["state"]  # the optimizer's moments came back from accelerate's state


def test_rank_batches_give_every_rank_as_many_batches_and_every_item_once():
    """Under FSDP every forward is a collective: each rank runs the largest share's count of batches (stand-ins at
    weight 0), and the weighted items are the items, each exactly once."""
    from common.run import rank_batches

    for n in range(1, 12):
        for world in (1, 2, 3):
            for size in (1, 2, 4):
                items = list(range(n))
                per_rank = [
                    rank_batches(items, size, SimpleNamespace(process_index=r, num_processes=world)) for r in range(world)
                ]
                assert len({len(b) for b in per_rank}) == 1, (n, world, size)
                assert all(0 < len(chunk) <= size for b in per_rank for chunk, _ in b)
                kept = sorted(x for b in per_rank for chunk, w in b if w == 1.0 for x in chunk)
                assert kept == items and all(w in (0.0, 1.0) for b in per_rank for _, w in b)
    # 9 items, 2 ranks, batches of 4: rank 0 holds 5 (two batches), rank 1 holds 4 and a stand-in
    batches = rank_batches(list(range(9)), 4, SimpleNamespace(process_index=1, num_processes=2))
    assert batches == [([1, 3, 5, 7], 1.0), ([0], 0.0)]


def test_held_out_samples_measure_the_kl_to_the_reference_on_the_policys_own_replies():
    """dpo.py's and kto.py's look at their policy: the replies' KL to the reference is 0 for the reference itself, and
    otherwise the mean over replies of the summed log-ratio of their tokens under both models (recomputed here from
    the policy's and the reference's logits); a LoRA policy's reference is its adapter switched off."""
    import copy

    from accelerate import Accelerator

    from common.loading import load_tokenizer
    from common.sampling import held_out_samples

    accelerator = Accelerator(cpu=True)
    tokenizer = load_tokenizer("builtin:tiny-gpt2", padding_side="left")
    reference = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).eval()
    prompts = [f"prompt number {i} says" for i in range(6)]
    torch.manual_seed(0)
    stats, table = held_out_samples(accelerator, copy.deepcopy(reference), reference, tokenizer, prompts, True, 16)
    assert stats["kl"] == 0 and 1 <= stats["length"] <= 24 and 0 < stats["distinct"] <= 1
    assert len(table["policy"]) == len(table["reference"]) == 4
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        policy.lm_head.weight.add_(0.05 * torch.randn_like(policy.lm_head.weight))  # tied: the embeddings move too
    torch.manual_seed(1)
    stats, _ = held_out_samples(accelerator, policy, reference, tokenizer, prompts, True, 16)
    torch.manual_seed(1)  # the same draws, by hand
    ids = tokenizer(prompts, padding=True, return_tensors="pt")
    out = policy.generate(**ids, **sampling_kwargs(1.0, 0, 1.0), max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    replies = out[:, ids["input_ids"].shape[1] :]
    is_eos = replies == tokenizer.eos_token_id
    last = torch.where(is_eos.any(1), is_eos.float().argmax(1), replies.shape[1] - 1)
    mask = torch.arange(replies.shape[1])[None] <= last[:, None]
    attention = torch.cat([ids["attention_mask"], mask.long()], 1)
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    width = ids["input_ids"].shape[1]
    with torch.no_grad():
        logits = [m(out, attention_mask=attention, position_ids=position_ids).logits for m in (policy, reference)]
        logp = [logprobs_from_logits(x[:, width - 1 : -1], replies) for x in logits]
    expected = ((logp[0] - logp[1]) * mask).sum(1).mean().item()
    assert stats["kl"] == pytest.approx(expected, rel=1e-4) and stats["kl"] > 0.1
    lora = get_peft_model(copy.deepcopy(reference), LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False))
    stats, table = held_out_samples(accelerator, lora, None, tokenizer, prompts, True, 16)
    assert stats["kl"] != 0 and "reference" in table  # the adapter on, then off


def test_a_model_that_ships_its_code_loads_only_with_trust_remote_code(tmp_path, monkeypatch):
    """A folder whose config maps the auto classes to its own modules (transformers' register_for_auto_class): without
    --trust-remote-code every loader refuses it in one line naming the flag; with it (set by common.cli from any
    script's Args) config, model and tokenizer load, the model as the folder's own class; every script has the flag."""
    import ast
    import importlib
    import sys

    import transformers.dynamic_module_utils as dynamic
    from conftest import ROOT

    from common import loading
    from common.cli import cli
    from common.core import UsageError

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # transformers' copy of the code
    source = tmp_path / "source"
    source.mkdir()
    (source / "shipped_config.py").write_text(
        "from transformers import GPT2Config\n\n\nclass ShippedConfig(GPT2Config):\n    model_type = 'shipped-gpt2'\n"
    )
    (source / "shipped_model.py").write_text(
        "from transformers import GPT2LMHeadModel\n\nfrom .shipped_config import ShippedConfig\n\n\n"
        "class ShippedModel(GPT2LMHeadModel):\n    config_class = ShippedConfig\n"
    )
    (source / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # the folder "source" of the test's own two modules
    ShippedConfig = importlib.import_module("source.shipped_config").ShippedConfig
    ShippedModel = importlib.import_module("source.shipped_model").ShippedModel

    ShippedConfig.register_for_auto_class()
    ShippedModel.register_for_auto_class("AutoModelForCausalLM")
    folder = str(tmp_path / "shipped")
    ShippedModel(ShippedConfig(n_layer=1, n_embd=16, n_head=2, n_positions=64)).save_pretrained(folder)
    loading.load_tokenizer("builtin:tiny-gpt2").save_pretrained(folder)
    sys.modules.pop("source.shipped_model"), sys.modules.pop("source.shipped_config")
    monkeypatch.setitem(loading.REMOTE_CODE, "trusted", False)
    for load in (loading.load_config, lambda name: loading.load_pretrained(name, AutoModelForCausalLM)):
        with pytest.raises(UsageError, match="ships its own code, which runs only when asked: pass --trust-remote-code"):
            load(folder)
    from sft import Args

    monkeypatch.setattr(
        sys, "argv", ["sft.py", "--model-name", folder, "--trust-remote-code", "--output-dir", str(tmp_path / "o")]
    )
    assert cli(Args).trust_remote_code and loading.REMOTE_CODE["trusted"]
    model = loading.load_pretrained(folder, AutoModelForCausalLM)
    assert type(model).__name__ == "ShippedModel" and loading.load_config(folder).model_type == "shipped-gpt2"
    assert loading.load_tokenizer(folder).pad_token is not None
    for script in ("ppo", "dpo", "kto", "reward_modeling", "sft", "ddpo", "ilql", "grpo", "rloo", "gkd"):
        tree = ast.parse(open(os.path.join(ROOT, f"{script}.py")).read())
        args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
        assert any(getattr(f, "target", None) and f.target.id == "trust_remote_code" for f in args.body), script
