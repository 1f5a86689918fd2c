import math
import os
import re
import statistics
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    RANDOM_MODEL,
    ROOT,
    check_model_card,
    default_run,
    read_scalars,
    run_failing,
    run_in_process,
    run_script,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.core import LogitMask, RunningMoments, UsageError, logprobs_from_logits
from common.models import AutoModelForCausalLMWithValueHead
from common.rewards import RewardAdapter
from ppo import (
    Rewards,
    aggregate,
    compute_advantages,
    compute_rewards,
    forward,
    gae_targets,
    length_adaptive_lam,
    ppo_loss,
    shape_scores,
)

PPO = os.path.join(ROOT, "ppo.py")
RM = os.path.join(ROOT, "reward_modeling.py")
LOGPROBS = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0, -3.0], [-2.0, -1.0, -4.0]])
MASKS = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 2: last token is padding


def close(tensor, expected, atol=1e-5):
    assert torch.allclose(tensor, torch.tensor(expected), atol=atol), (tensor, expected)


def test_compute_rewards_by_hand():
    rewards, non_score, kls = compute_rewards(torch.tensor([1.0, 2.0]), LOGPROBS, REF_LOGPROBS, MASKS, 0.1)
    close(kls, [[0.5, -1.0, 0.0], [1.0, 0.0, 0.0]])
    close(non_score, [[-0.05, 0.1, 0.0], [-0.1, 0.0, 0.0]])
    # the score lands on the last *unmasked* token
    close(rewards, [[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0]])


@pytest.mark.parametrize(
    "penalty, expected",
    [
        ("abs", [[0.5, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        ("mse", [[0.125, 0.5, 0.0], [0.5, 0.0, 0.0]]),
        ("k3", [[math.exp(-0.5) - 0.5, math.exp(1) - 2, 0.0], [math.exp(-1), 0.0, 0.0]]),
    ],
)
def test_compute_rewards_kl_penalties(penalty, expected):
    rewards, _, kls = compute_rewards(torch.zeros(2), LOGPROBS, REF_LOGPROBS, MASKS, 1.0, penalty)
    close(kls, expected)
    close(rewards, (-torch.tensor(expected)).tolist())


def test_compute_rewards_full_kl_over_vocabulary():
    p = torch.tensor([[[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]])
    q = torch.tensor([[[0.4, 0.4, 0.2], [0.5, 0.25, 0.25]]])
    _, _, kls = compute_rewards(torch.tensor([3.0]), p.log(), q.log(), torch.ones(1, 2), 1.0, "full")
    expected = sum(a * math.log(a / b) for a, b in zip([0.7, 0.2, 0.1], [0.4, 0.4, 0.2]))
    close(kls, [[expected, 0.0]])


def test_shape_scores_penalises_then_scales_then_clips():
    args = SimpleNamespace(missing_eos_penalty=1.0, use_score_scaling=True, use_score_norm=False, score_clip=2.0)
    raw, ended = torch.tensor([1.0, 3.0]), torch.tensor([True, False])
    # the second lost 1 (no EOS): [1, 2], over their std 1 / sqrt(2): [1.41, 2.83], the second clipped to 2
    close(shape_scores(args, raw, ended, RunningMoments(), lambda x: x), [2**0.5, 2.0])
    args.use_score_norm = True  # centred first: [-0.5, 0.5] / 0.71
    close(shape_scores(args, raw, ended, RunningMoments(), lambda x: x), [-(0.5**0.5), 0.5**0.5])
    close(raw, [1.0, 3.0])  # the raw scores are logged as they were


def test_compute_advantages_by_hand_with_padding():
    values = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 5.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]])  # row 2's last position is padding
    out_values, advantages, returns = compute_advantages(values, rewards, MASKS, gamma=1.0, lam=0.5)
    # row 1: deltas (t=2,1,0) = 1-3, 0+3-2, 0+2-1 -> A = [1 + .5*0, 1 + .5*(-2), -2] = [1, 0, -2]
    # row 2 (masked to values [1, 2, 0], rewards [0, 1, 0]): deltas 0, -1, 1 -> A = [0.5, -1, 0]
    raw = [1.0, 0.0, -2.0, 0.5, -1.0]
    close(returns, [[2.0, 2.0, 1.0], [1.5, 1.0, 0.0]])
    close(out_values, [[1.0, 2.0, 3.0], [1.0, 2.0, 0.0]])
    mean, std = statistics.mean(raw), math.sqrt(statistics.variance(raw) + 1e-8)
    expected = [(a - mean) / std for a in raw]
    assert advantages[MASKS.bool()].tolist() == pytest.approx(expected, abs=1e-5)


def test_compute_advantages_whiten_rewards_keeps_mean():
    values, rewards = torch.zeros(2, 3), torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    _, _, returns = compute_advantages(values, rewards, MASKS, gamma=1.0, lam=1.0, whiten_rewards=True)
    # with zero values and gamma = lam = 1, returns are reward-to-go of the whitened-with-mean rewards
    masked = [1.0, 2.0, 3.0, 4.0, 5.0]
    mean, std = statistics.mean(masked), math.sqrt(statistics.variance(masked) + 1e-8)
    w = [(r - mean) / std + mean for r in masked]
    close(returns, [[w[0] + w[1] + w[2], w[1] + w[2], w[2]], [w[3] + w[4], w[4], 0.0]])


def ppo_inputs(logprobs):
    return dict(
        old_logprobs=torch.tensor([[-1.0, -1.0, 5.0]]),
        values=torch.tensor([[0.0, 0.0, 9.0]]),
        logprobs=logprobs,
        vpreds=torch.tensor([[0.5, -0.1, -9.0]]),
        mask=torch.tensor([[1.0, 1.0, 0.0]]),
        advantages=torch.tensor([[1.0, -1.0, 100.0]]),
        returns=torch.tensor([[1.0, 1.0, 50.0]]),
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
    )


def test_ppo_loss_by_hand():
    pg_loss, vf_loss, stats = ppo_loss(**ppo_inputs(torch.tensor([[-0.5, -1.5, 0.0]])))
    # ratios e^0.5, e^-0.5 -> clipped 1.2, 0.8; max(-A*r, -A*clip) = max(-1.649, -1.2), max(0.607, 0.8)
    assert pg_loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["ppo/policy/clipfrac"].item() == pytest.approx(1.0)
    # vpred clipped to [-0.2, 0.2]: 0.5 -> 0.2; losses max((0.5-1)^2, (0.2-1)^2) = 0.64, max(1.21, 1.21)
    assert vf_loss.item() == pytest.approx(0.1 * 0.5 * (0.64 + 1.21) / 2)
    assert stats["ppo/val/clipfrac"].item() == pytest.approx(0.5)
    assert stats["ppo/policy/approxkl"].item() == pytest.approx(0.5 * (0.25 + 0.25) / 2)
    assert stats["ppo/skipped"].item() == 0.0


def test_ppo_loss_ratio_threshold_skips_minibatch():
    pg_loss, vf_loss, stats = ppo_loss(**ppo_inputs(torch.tensor([[2.0, 2.0, 0.0]])))  # ratio e^3 ~ 20 > 10
    assert pg_loss.item() == 0.0 and vf_loss.item() == 0.0 and stats["ppo/skipped"].item() == 1.0
    pg_loss, _, _ = ppo_loss(**ppo_inputs(torch.tensor([[2.0, 2.0, 0.0]])) | dict(ratio_threshold=50.0))
    assert pg_loss.item() != 0.0


def test_ppo_loss_gradient_pushes_logprob_along_advantage():
    logprobs = torch.tensor([[-1.0, -1.0, 0.0]], requires_grad=True)
    pg_loss, _, _ = ppo_loss(**ppo_inputs(logprobs))
    pg_loss.backward()
    assert logprobs.grad[0, 0] < 0 < logprobs.grad[0, 1] and logprobs.grad[0, 2] == 0  # A=+1 up, A=-1 down


def test_left_padding_gives_the_same_logprobs():
    model = AutoModelForCausalLMWithValueHead.from_pretrained("builtin:tiny-gpt2").eval()
    short, long = torch.tensor([[11, 12]]), torch.tensor([[21, 22, 23, 24, 25]])
    responses = torch.tensor([[31, 32, 33], [41, 42, 43]])
    pad = 6817  # the built-in tokenizer's pad token
    queries = torch.cat([torch.cat([torch.full((1, 3), pad), short], 1), long])
    query_mask = (queries != pad).long()
    with torch.no_grad():
        logits, values = forward(model, queries, query_mask, responses, torch.ones_like(responses), 1.0)
        for i, q in enumerate([short, long]):
            alone_logits, alone_values = forward(model, q, torch.ones_like(q), responses[i : i + 1], torch.ones(1, 3), 1.0)
            assert torch.allclose(
                logprobs_from_logits(logits[i : i + 1], responses[i : i + 1]),
                logprobs_from_logits(alone_logits, responses[i : i + 1]),
                atol=1e-5,
            )
        # temperature divides the logits used for logprobs
        hot, _ = forward(model, queries, query_mask, responses, torch.ones_like(responses), 2.0)
        assert torch.allclose(hot, logits / 2.0, atol=1e-6)


def test_logit_mask_on_a_tiny_vocabulary_in_sampling_and_logprobs():
    """trlX's logit mask: token t may only be followed by t + 1 or t + 2 (mod 8). Sampled responses never break it,
    and the log-probs the PPO update uses give every forbidden token probability exactly 0."""
    from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessorList

    torch.manual_seed(0)
    vocab = 8
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=1, n_head=2, eos_token_id=None, bos_token_id=None)
    model = AutoModelForCausalLMWithValueHead(GPT2LMHeadModel(config).eval())
    mask = LogitMask({t: [(t + 1) % vocab, (t + 2) % vocab] for t in range(vocab)}, vocab_size=vocab)
    queries = torch.randint(0, vocab, (64, 3))
    with torch.no_grad():
        out = model.generate(
            input_ids=queries,
            attention_mask=torch.ones_like(queries),
            max_new_tokens=10,
            do_sample=True,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([mask]),
        )
        steps = (out[:, 3:] - out[:, 2:-1]) % vocab  # every transition from the last query token on
        assert set(steps.unique().tolist()) == {1, 2}
        responses = out[:, 3:]
        logits, _ = forward(
            model, queries, torch.ones_like(queries), responses, torch.ones_like(responses), 0.7, logit_mask=mask
        )
    probs = logits.softmax(-1)
    previous = torch.cat([queries[:, -1:], responses[:, :-1]], 1)
    allowed = torch.zeros_like(probs, dtype=torch.bool)
    for step in (1, 2):
        allowed.scatter_(-1, ((previous + step) % vocab).unsqueeze(-1), True)
    assert (probs[~allowed] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(()))
    assert torch.isfinite(logprobs_from_logits(logits, responses)).all()


def test_responses_are_cut_after_eos_and_stop_sequences():
    from common.sampling import cut

    eos, pad = 9, 0
    responses = torch.tensor([[1, 2, 9, 3, 4], [1, 5, 6, 7, 8], [1, 2, 3, 4, 5]])
    out, mask, ended = cut(responses, eos, pad, stop_token_ids=[[5, 6]])
    assert out.tolist() == [[1, 2, 9, 0, 0], [1, 5, 6, 0, 0], [1, 2, 3, 4, 5]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert ended.tolist() == [True, True, False]


@pytest.mark.slow
def test_cli_rejects_bad_sizes_and_long_prompts(tmp_path):
    assert "is not divisible by" in run_failing(
        [PPO, *TINY, "--overwrite", "--batch-size", "10", "--mini-batch-size", "4"], tmp_path
    )
    assert "longer than max_query_length=4" in run_failing([PPO, *TINY, "--overwrite", "--max-query-length", "4"], tmp_path)
    assert "pass that limit too" in run_failing([PPO, *TINY, "--overwrite", "--truncate-queries"], tmp_path)
    # no limit by default: the longest query itself must leave room for the response
    error = run_failing([PPO, *TINY, "--overwrite", "--max-new-tokens", "250"], tmp_path)
    assert "the longest query (" in error and "exceeds the model's context of 256" in error
    # cut to their last 6 tokens, the same queries leave room for 250 new ones
    cut = ["--max-query-length", "6", "--truncate-queries", "--max-new-tokens", "250", "--total-episodes", "8"]
    assert "ppo: 1 updates" in run_script([PPO, *TINY, *cut], tmp_path)


# the random tiny preset scored by VADER: fast runs of the machinery (the default run is tested on its own below)
TINY = [
    "--model-name",
    "builtin:tiny-gpt2",
    "--reward-model",
    "None",
    "--batch-size",
    "8",
    "--mini-batch-size",
    "4",
    "--min-new-tokens",
    "8",
    "--max-new-tokens",
    "8",
    "--eval-samples",
    "8",
    "--ppo-epochs",
    "2",
    "--log-freq",
    "1",
]


@pytest.mark.slow
def test_resume_continues_where_it_stopped(tmp_path):
    """4 updates straight == 2 updates, checkpoint, resume for 2 more (same weights, bit for bit)."""
    straight_out = run_script([PPO, *TINY, "--total-episodes", "32", "--save-freq", "2", "--output-dir", "straight"], tmp_path)
    checkpoint = tmp_path / "straight_checkpoints" / "update_2"
    assert (checkpoint / "trainer_state.json").exists()
    out = run_script(
        [PPO, *TINY, "--total-episodes", "32", "--resume-from", str(checkpoint), "--output-dir", "resumed"], tmp_path
    )
    assert "resumed from" in out and "ppo: 2 updates" in out
    # the summary and the health line compare with the run's start (first evaluation and histories checkpointed)
    summary = re.compile(r"train reward .*?; model saved|health: .*")
    assert summary.findall(out) == summary.findall(straight_out) and len(summary.findall(out)) == 2
    straight, resumed = (
        load_file(tmp_path / "straight" / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model.safetensors"),
    )
    at_checkpoint = load_file(checkpoint / "model.safetensors")
    assert any(not torch.equal(straight[k], at_checkpoint[k]) for k in straight)  # training moved on after update 2
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    assert torch.equal(
        load_file(tmp_path / "straight" / "value_head.safetensors")["summary.weight"],
        load_file(tmp_path / "resumed" / "value_head.safetensors")["summary.weight"],
    )
    assert "raise --total-episodes" in run_failing(
        [PPO, *TINY, "--total-episodes", "16", "--resume-from", str(checkpoint)], tmp_path
    )  # a checkpoint at the run's end leaves nothing to train


def test_peft_policy_uses_no_reference_copy_and_saves_merged(tmp_path):
    out = run_script([PPO, *TINY, "--total-episodes", "16", "--use-peft", "--lora-r", "4"], tmp_path)
    assert "reference: adapter disabled" in out
    trainable, total = [
        int(x.replace(",", ""))
        for x in out.split("policy builtin:tiny-gpt2: ")[1].split(" parameters")[0].split(" trainable of ")
    ]
    assert trainable < total / 10  # only the adapters (and value head) train
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "ppo")  # merged: plain transformers loads it
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert "| use_peft | True |" in check_model_card(tmp_path / "outputs" / "ppo", "ppo")


@pytest.mark.slow
def test_reference_responses_are_logged_without_changing_training(tmp_path):
    out = run_script([PPO, *TINY, "--total-episodes", "16", "--log-ref-responses", "--output-dir", "with_ref"], tmp_path)
    assert "ref response" in out and "ref score" in out  # columns of the printed sample table
    assert len(read_scalars(str(tmp_path / "runs"), "env/ref_reward_mean")) == 2
    run_script([PPO, *TINY, "--total-episodes", "16", "--output-dir", "without"], tmp_path)
    with_ref, without = (load_file(tmp_path / name / "model.safetensors") for name in ("with_ref", "without"))
    assert all(torch.equal(with_ref[k], without[k]) for k in without)  # the reference samples from its own RNG


def test_seq2seq_policy_runs(tmp_path):
    out = run_script([PPO, *TINY, "--total-episodes", "8", "--model-name", "builtin:tiny-t5"], tmp_path)
    assert "ppo: 1 updates" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        [
            "--kl-penalty",
            "full",
            "--whiten-rewards",
            "--use-score-scaling",
            "--use-score-norm",
            "--score-clip",
            "1.0",
            "--missing-eos-penalty",
            "1.0",
            "--stop-sequences",
            ".",
            "--early-stopping",
            "--max-grad-norm",
            "1.0",
            "--num-shared-layers",
            "1",
            "--lr-anneal",
            "--temperature",
            "0.7",
            "--top-k",
            "50",
        ],
        ["--no-inverse-cdf-sampling", "--temperature", "0.7", "--top-p", "0.9", "--generation-batch-size", "4"],
    ],
)
def test_options_run(tmp_path, flags):
    out = run_script([PPO, *TINY, "--total-episodes", "16", *flags], tmp_path)
    assert "ppo: 2 updates" in out and ("1 shared blocks" in out) == ("--num-shared-layers" in flags)


@pytest.mark.slow
def test_reward_model_from_local_folder(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from common.loading import load_pretrained, load_tokenizer

    # a random but complete classifier checkpoint: every weight of the head is in the folder
    load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1).save_pretrained(tmp_path / "rm")
    load_tokenizer("builtin:tiny-gpt2").save_pretrained(tmp_path / "rm")
    out = run_script([PPO, *TINY, "--total-episodes", "8", "--reward-model", str(tmp_path / "rm")], tmp_path)
    assert "ppo: 1 updates" in out
    # a reward model with a shorter context than query + response: an error before training, not mid-run
    load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1, n_positions=24).save_pretrained(
        tmp_path / "rm"
    )
    error = run_failing([PPO, *TINY, "--overwrite", "--total-episodes", "8", "--reward-model", str(tmp_path / "rm")], tmp_path)
    assert "exceed the reward model's context of 24" in error
    # a reward model that scores NaN: the reward is checked on a smoke batch before the first rollout
    broken = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1)
    torch.nn.init.constant_(broken.score.weight, float("nan"))
    broken.save_pretrained(tmp_path / "rm")
    out, error = run_in_process(
        [PPO, *TINY, "--overwrite", "--total-episodes", "8", "--reward-model", str(tmp_path / "rm")], tmp_path
    )
    assert f"--reward-model {tmp_path / 'rm'} returned nan: every reward must be a finite number" in str(error)
    assert "eval samples" not in out  # the smoke samples, before the first evaluation's table


@pytest.mark.slow
def test_two_label_classifier_rewards_with_the_named_logit(tmp_path):
    """TRL's gpt2-sentiment recipe offline: a 2-label (NEGATIVE, POSITIVE) classifier folder; --reward-label POSITIVE
    scores with the POSITIVE logit (the same as its index 1); without a label, or with an unknown one, the run stops
    before training, and so it does for a folder whose classification head would be random."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from common.loading import load_pretrained, load_tokenizer
    from common.models import load_reward_model

    labels = dict(id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})
    classifier = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=2, **labels)
    classifier.config.pad_token_id = load_tokenizer("builtin:tiny-gpt2").pad_token_id
    classifier.save_pretrained(tmp_path / "sentiment")
    load_tokenizer("builtin:tiny-gpt2").save_pretrained(tmp_path / "sentiment")
    folder = str(tmp_path / "sentiment")
    assert load_reward_model(folder, "POSITIVE")[2] == load_reward_model(folder, "1")[2] == 1
    assert load_reward_model(folder, "NEGATIVE")[2] == 0
    run_script([PPO, *TINY, "--total-episodes", "8", "--reward-model", folder, "--reward-label", "POSITIVE"], tmp_path)
    first = read_scalars(str(tmp_path / "runs"), "env/reward_mean")[0]
    # the logged reward is the POSITIVE logit of the classifier on "query response<eos>" texts: recompute one batch
    assert math.isfinite(first)
    assert "pass --reward-label" in run_failing([PPO, *TINY, "--overwrite", "--reward-model", folder], tmp_path)
    assert "has the labels" in run_failing(
        [PPO, *TINY, "--overwrite", "--reward-model", folder, "--reward-label", "HAPPY"], tmp_path
    )
    # a causal LM folder (e.g. outputs/sft) would load with a freshly initialised score head: refused
    load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).save_pretrained(tmp_path / "lm")
    load_tokenizer("builtin:tiny-gpt2").save_pretrained(tmp_path / "lm")
    assert "no trained classification head" in run_failing(
        [PPO, *TINY, "--overwrite", "--reward-model", str(tmp_path / "lm")], tmp_path
    )
    assert "randomly initialised preset" in run_failing(
        [PPO, *TINY, "--overwrite", "--reward-model", "builtin:tiny-gpt2"], tmp_path
    )


def test_gold_rewards_are_watched_beside_the_trained_reward():
    """--gold-reward-funcs: each function's mean over the scored responses and the Pearson correlation of the trained-on
    score with the first one, over the responses it scored (None drops a response from the correlation only)."""
    grades = [1.0, 0.0, None, 1.0, 0.0]

    def gold(completions, **kwargs):
        return grades

    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t)  # one process: gather is the identity
    scoring = SimpleNamespace(gold=[("file.py:gold", gold)], accelerator=accelerator)
    rows = [{"prompt": "q"}] * 5
    scores = torch.tensor([2.0, 1.0, 9.0, 0.5, 1.5])
    metrics = Rewards.watch(scoring, rows, ["a"] * 5, [[1]] * 5, [True] * 5, scores, "eval")
    x, y = [2.0, 1.0, 0.5, 1.5], [1.0, 0.0, 1.0, 0.0]
    assert metrics["eval/gold/gold"] == pytest.approx(0.5)
    assert metrics["eval/gold/correlation"] == pytest.approx(statistics.correlation(x, y), abs=1e-6)
    scoring.gold = []
    assert Rewards.watch(scoring, rows, ["a"] * 5, [[1]] * 5, [True] * 5, scores, "eval") == {}


def test_a_bad_gold_reward_is_a_one_line_error_before_any_model_loads(tmp_path):
    out, error = run_in_process([PPO, *TINY, "--gold-reward-funcs", "nowhere.py:gold"], tmp_path)
    assert isinstance(error, UsageError) and "nowhere.py" in str(error), error
    assert "policy builtin:" not in out  # load_models prints this line once the policy is loaded


def test_no_held_out_query_occurs_in_training(tmp_path):
    """A dataset that repeats its queries: the copies of each held-out query leave the training rows, so evaluation
    never scores a query the policy trained on."""
    import ppo
    from common.loading import load_tokenizer

    path = tmp_path / "queries.jsonl"
    path.write_text("".join(f'{{"prompt": "query number {i % 20}"}}\n' for i in range(60)))  # each query 3 times
    args = ppo.Args(dataset_name=str(path), eval_fraction=0.25, batch_size=4, world_size=1, num_updates=1)
    accelerator = SimpleNamespace(print=lambda *_: None)
    train_rows, eval_rows, _ = ppo.load_queries(args, load_tokenizer(args.model_name, padding_side="left"), accelerator)
    held_out = {r["prompt"] for r in eval_rows}
    assert held_out and not held_out & {r["prompt"] for r in train_rows}
    assert len(eval_rows) == 15 and len(train_rows) == 60 - 3 * len(held_out)  # only the copies left, the rest kept


def test_health_check_warns_on_reward_hacking():
    from ppo import health_check, top_token_share

    assert top_token_share([5, 5, 6, 7, 8, 9]) == pytest.approx(2 / 6) and top_token_share([]) == 0
    line, warning = health_check(
        5.0, 6.0, top_share=0.1, distinct_words=0.9, distinct_2=0.72, start_distinct_2=0.93, start_top_share=0.08
    )
    assert "KL to the reference 5.00 nats" in line and "distinct-2 0.72 (0.93 at the start)" in line and warning is None
    assert "token 10% of response tokens (8% at the start)" in line
    assert "left its reference" in health_check(190.0, 6.0, 0.1, 0.9, 0.9, 0.9, 0.08)[1]
    assert "collapsed" in health_check(4.0, 6.0, 0.45, 0.2, 0.9, 0.9, 0.08)[1]
    assert "repeat each other" in health_check(4.0, 6.0, 0.1, 0.9, 0.64, 0.97, 0.08)[1]  # a third share a few phrases
    # terse answers ("6 + 2 = 8") repeat bigrams: with a watched gold reward that rose it is a note; one that fell warns
    note = health_check(4.2, 6.0, 0.21, 0.92, 0.28, 0.83, 0.1, gold=("verifier", 0.174, 0.461))[1]
    assert note.startswith("note: the responses repeat each other") and "verifier rose (0.174 -> 0.461)" in note
    assert health_check(4.2, 6.0, 0.21, 0.92, 0.28, 0.83, 0.1, gold=("verifier", 0.4, 0.3))[1].startswith("warning:")
    assert "left its reference" in health_check(19.0, 6.0, 0.1, 0.9, 0.28, 0.83, 0.08, gold=("verifier", 0.1, 0.5))[1]
    # a space filling a quarter of the replies (7.6% at the start: the reward-model path's whitespace padding) warns;
    # a share that doubled, or one over 20% from a start already near it, does not
    assert "fill up with one token (26%" in health_check(6.6, 6.0, 0.26, 0.9, 0.9, 0.97, 0.076)[1]
    assert health_check(5.3, 6.0, 0.18, 0.9, 0.95, 0.97, 0.08)[1] is None
    assert health_check(5.3, 6.0, 0.22, 0.9, 0.95, 0.97, 0.1)[1] is None


@pytest.mark.slow
def test_logit_mask_cli_samples_only_allowed_tokens(tmp_path, positive_mask_file):
    """Every token may only be followed by " good", " great", " happy" or " love": from the very first update the
    untrained random policy's VADER reward is high (about 0 without the mask)."""
    run_script([PPO, *TINY, "--total-episodes", "8", "--logit-mask", positive_mask_file], tmp_path)
    assert read_scalars(str(tmp_path / "runs"), "eval/reward_mean")[0] > 0.5
    assert read_scalars(str(tmp_path / "runs"), "env/reward_mean")[0] > 0.5


@pytest.mark.slow
def test_reward_adapter_on_the_policy_base_scores_like_the_merged_reward_model(tmp_path, pairs_file):
    """TRL's multi-adapter RL: reward_modeling.py --use-peft saves a LoRA reward adapter with its score head; loaded as
    a second adapter on the peft policy it gives the merged (and normalised) reward model's scores, with one copy of
    the base weights, and the policy adapter stays the active, trainable one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from common.loading import load_pretrained, load_tokenizer

    run_script(
        [
            RM,
            *RANDOM_MODEL,
            "--dataset-name",
            pairs_file,
            "--use-peft",
            "--lora-r",
            "4",
            "--max-steps",
            "3",
            "--batch-size",
            "4",
            "--learning-rate",
            "1e-2",
            "--normalize-reward",
            "--output-dir",
            "rm",
        ],
        tmp_path,
    )
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    base = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM)
    assert not torch.allclose(merged.transformer.h[0].attn.c_attn.weight, base.transformer.h[0].attn.c_attn.weight)

    policy = AutoModelForCausalLMWithValueHead.from_pretrained("builtin:tiny-gpt2")
    policy.pretrained_model = get_peft_model(policy.pretrained_model, LoraConfig(r=4, task_type="CAUSAL_LM"))
    for name, param in policy.named_parameters():  # a policy adapter that is not the identity
        if "lora_B.default" in name:
            param.data.normal_(std=0.1)
    adapter = RewardAdapter(policy, str(tmp_path / "rm" / "reward_adapter"), "builtin:tiny-gpt2")
    tokenizer = load_tokenizer("builtin:tiny-gpt2", padding_side="right")
    batch = tokenizer(["q1 I love this<|endoftext|>", "q2 awful, I hate it"], padding=True, return_tensors="pt")
    ids = tokenizer(["q1 some words here"], return_tensors="pt")
    with torch.no_grad():
        policy_logits = policy(**ids)[0]
        torch.testing.assert_close(adapter.forward(policy, **batch), merged(**batch).logits)
        torch.testing.assert_close(policy(**ids)[0], policy_logits)  # back on the policy adapter
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert any(".default." in n for n in trainable) and not any(".reward." in n for n in trainable)
    sizes = {p.data_ptr(): p.numel() for p in policy.parameters()}  # distinct storages
    lora = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
    assert any(".reward." in n for n, _ in policy.named_parameters())
    assert sum(sizes.values()) == sum(p.numel() for p in base.parameters()) + lora + 64 + 1  # + the value head
    # the final save merges the policy adapter only
    merged_policy = policy.pretrained_model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged_policy(**ids).logits, policy_logits)

    out = run_script(
        [
            PPO,
            *TINY,
            "--total-episodes",
            "8",
            "--use-peft",
            "--lora-r",
            "4",
            "--reward-adapter",
            str(tmp_path / "rm" / "reward_adapter"),
        ],
        tmp_path,
    )
    assert "ppo: 1 updates" in out
    adapter = str(tmp_path / "rm" / "reward_adapter")
    assert "add --use-peft" in run_failing([PPO, *TINY, "--overwrite", "--reward-adapter", adapter], tmp_path)
    assert "must share the base model" in run_failing(
        [PPO, *TINY, "--overwrite", "--use-peft", "--model-name", "builtin:tiny-t5", "--reward-adapter", adapter], tmp_path
    )


@pytest.mark.slow
def test_save_best_keeps_the_policy_of_the_best_batch(tmp_path):
    """TRL's push_to_hub_if_best: every compare_steps updates the batch reward is compared with the best so far; the best
    checkpoint holds the weights that produced that batch (those of the checkpoint written just before it) and loads
    with plain from_pretrained."""
    run_script([PPO, *TINY, "--total-episodes", "40", "--save-best", "--compare-steps", "2", "--save-freq", "1"], tmp_path)
    rewards = read_scalars(str(tmp_path / "runs"), "env/reward_mean")  # updates 0..4, logged at steps 1..5
    best_update = max(range(0, 5, 2), key=lambda u: rewards[u])
    card = (tmp_path / "outputs" / "ppo_best" / "README.md").read_text()
    assert f"| best/reward_mean | {rewards[best_update]:.4g} |" in card and f"| best/update | {best_update} |" in card
    best = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "ppo_best").state_dict()
    if best_update == 0:  # saved before any update: the initial weights
        source = AutoModelForCausalLMWithValueHead.from_pretrained("builtin:tiny-gpt2").pretrained_model
    else:  # checkpoint update_u holds the weights after u updates, which produced batch u
        source = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "ppo_checkpoints" / f"update_{best_update}")
    assert all(torch.equal(value, source.state_dict()[k]) for k, value in best.items())
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "ppo").state_dict()
    assert not all(torch.equal(value, final[k]) for k, value in best.items())


@pytest.mark.slow
def test_default_run_ends_on_the_readmes_line_and_learns_inside_its_kl_budget(tmp_path):
    """`python ppo.py` as it comes, with the thread count of the README's record (benchmarks/RESULTS-first-run.json,
    the line the README renders): it ends on that line, but for the time. The pretrained builtin:tiny-chat policy
    against builtin:tiny-chat-rm raises the held-out reward by more than half a standard deviation of the initial
    policy's held-out rewards, with the final KL within 2x the controller's target and varied responses (no reward
    hacking). With a flipped policy-gradient sign the policy runs from the reference (KL 110, one token 91% of the
    responses, eval -0.60 -> -1.92, two threads): this test fails it on the reward, the KL and the collapse. At a
    learning rate of 1e-3 the replies collapse into a token or two (";", " is"; one token 35% of the responses, eval
    -0.60 -> -0.28, the health warning printed): this test fails it on the reward and the collapse."""
    import json

    record = json.load(open(os.path.join(ROOT, "benchmarks", "RESULTS-first-run.json")))
    out = default_run("ppo", "ppo: ", tmp_path, run={k: record[k] for k in ("machine", "torch", "threads")} | record["warm"])
    summary = out.split("eval reward ")[1]
    first, last = (float(x) for x in summary.split(" (")[0].split(" -> "))
    initial_std = float(summary.split("initial std ")[1].split(")")[0])
    final_kl = float(summary.split("KL ")[1].split(";")[0])
    assert last - first > 0.5 * initial_std, out[-1500:]
    assert final_kl < 2 * 6.0, out[-1500:]
    top_share = read_scalars(str(tmp_path / "runs"), "eval/top_token_share")[-1]
    distinct = read_scalars(str(tmp_path / "runs"), "eval/distinct_words")[-1]
    assert top_share < 0.3 and distinct > 0.5 and "warning:" not in out, (top_share, distinct, out[-1500:])


def test_length_adaptive_lam_by_hand():
    """VAPO: lambda = 1 - 1 / (alpha * length), clamped to [0, 1]; alpha 0.05 at 10, 40 and 1000 tokens."""
    mask = torch.zeros(3, 1000)
    for row, length in enumerate((10, 40, 1000)):
        mask[row, :length] = 1
    close(length_adaptive_lam(mask, 0.05), [0.0, 1 - 1 / 2.0, 1 - 1 / 50.0])


def test_a_critic_from_a_classifier_starts_from_its_reward_labels_logit(tmp_path):
    """--value-model-path with a sequence classifier of several labels: the critic's value head starts as the logit
    --reward-label names (OpenRLHF starts its critic from the reward model), on the classifier's trunk."""
    from transformers import AutoModelForSequenceClassification

    from common.loading import load_pretrained, load_tokenizer
    from common.models import load_critic

    classifier = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=2, seed=3)
    classifier.config.id2label, classifier.config.label2id = {0: "NEGATIVE", 1: "POSITIVE"}, {"NEGATIVE": 0, "POSITIVE": 1}
    classifier.save_pretrained(tmp_path / "classifier")
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    tokenizer.save_pretrained(tmp_path / "classifier")
    policy = AutoModelForCausalLMWithValueHead.from_pretrained("builtin:tiny-gpt2")
    critic = load_critic(str(tmp_path / "classifier"), policy, None, tokenizer, "float32", "zero", label="POSITIVE")
    assert torch.equal(critic.v_head.summary.weight, classifier.score.weight[1:2])
    assert not torch.equal(classifier.score.weight[0], classifier.score.weight[1])
    trunk = dict(classifier.transformer.named_parameters())
    assert all(torch.equal(p, trunk[name]) for name, p in critic.pretrained_model.named_parameters())
    with pytest.raises(UsageError, match=r"^--value-model-path .*classifier has 2 labels .*pass --reward-label"):
        load_critic(str(tmp_path / "classifier"), policy, None, tokenizer, "float32", "zero")  # which logit: the flag's


def test_decoupled_gae_gives_the_critic_monte_carlo_returns():
    """VC-PPO's decoupled GAE: the critic's targets at lambda 1 are the rewards-to-go (gamma 1), whatever the values; the
    policy's advantages are those of compute_advantages at its own lambda."""
    values = torch.tensor([[0.2, 0.5, 0.7], [0.1, -0.3, 0.0]])
    rewards = torch.tensor([[0.0, -0.1, 1.0], [0.5, 0.25, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    _, advantages, returns = gae_targets(values, rewards, mask, 1.0, 0.95, 1.0)
    close(returns * mask, [[0.9, 0.9, 1.0], [0.75, 0.25, 0.0]])
    assert torch.allclose(advantages, compute_advantages(values, rewards, mask, 1.0, 0.95)[1])
    # one lambda for both: exactly TRL 0.8's compute_advantages
    for got, expected in zip(
        gae_targets(values, rewards, mask, 1.0, 0.95, 0.95), compute_advantages(values, rewards, mask, 1.0, 0.95)
    ):
        assert torch.equal(got, expected)
    # a lambda per response (VAPO's): each row's advantages are those of its own scalar lambda before whitening
    lam = torch.tensor([0.5, 1.0])
    raw = [compute_advantages(values, rewards, mask, 1.0, float(x))[2] - values * mask for x in lam]
    per_row = compute_advantages(values, rewards, mask, 1.0, lam)[2] - values * mask
    assert torch.allclose(per_row, torch.stack([raw[0][0], raw[1][1]]))


def test_seq_mean_token_mean_weighs_each_response_alike():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    close(aggregate(losses, mask), 15.0 / 5)  # token-mean: every token alike
    close(aggregate(losses, mask, "seq-mean-token-mean"), (2.0 + 4.5) / 2)


@pytest.mark.slow
def test_separate_critic_saves_loads_and_resumes(tmp_path):
    """A separate critic (started from the policy): saved in critic/ beside the policy (plain AutoModel loads its trunk),
    restored by --resume-from bit for bit (4 updates straight == 2, checkpoint, 2 more), and the KL-as-loss,
    several-samples and warm-up flags run with it."""
    from transformers import AutoModel

    critic = ["--value-model-path", "policy", "--critic-learning-rate", "1e-3", "--freezing-actor-steps", "1"]
    critic += ["--use-kl-loss", "--kl-penalty", "k3", "--n-samples-per-prompt", "2", "--critic-lam", "1.0"]
    straight_out = run_script(
        [PPO, *TINY, *critic, "--total-episodes", "32", "--save-freq", "2", "--output-dir", "straight"], tmp_path
    )
    assert "critic: a separate value model from policy" in straight_out and "4 queries x 2 completions" in straight_out
    checkpoint = tmp_path / "straight_checkpoints" / "update_2"
    out = run_script(
        [PPO, *TINY, *critic, "--total-episodes", "32", "--resume-from", str(checkpoint), "--output-dir", "resumed"],
        tmp_path,
    )
    assert "resumed from" in out and "ppo: 2 updates" in out
    for folder in ("", "critic"):
        straight = load_file(tmp_path / "straight" / folder / "model.safetensors")
        resumed = load_file(tmp_path / "resumed" / folder / "model.safetensors")
        at_checkpoint = load_file(checkpoint / folder / "model.safetensors")
        assert any(not torch.equal(straight[k], at_checkpoint[k]) for k in straight), folder  # both trained on
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), folder
    heads = [load_file(tmp_path / run / "critic" / "value_head.safetensors") for run in ("straight", "resumed")]
    assert torch.equal(heads[0]["summary.weight"], heads[1]["summary.weight"]) and heads[0]["summary.weight"].abs().sum() > 0
    assert not (tmp_path / "straight" / "value_head.safetensors").exists()  # the policy's own head is dropped
    trunk = AutoModel.from_pretrained(tmp_path / "straight" / "critic")
    assert trunk.config.vocab_size == AutoModelForCausalLM.from_pretrained(tmp_path / "straight").config.vocab_size
    scalars = read_scalars(str(tmp_path / "runs"), "ppo/policy/kl_loss")
    assert scalars and all(math.isfinite(x) for x in scalars)


def test_the_actor_stays_still_while_the_critic_warms_up(tmp_path):
    """--freezing-actor-steps 1 with one update: the saved policy is the initial one exactly, the critic moved."""
    out = run_script(
        [PPO, *TINY, "--value-model-path", "policy", "--freezing-actor-steps", "1", "--total-episodes", "8"], tmp_path
    )
    assert "ppo: 1 updates" in out
    saved = load_file(tmp_path / "outputs" / "ppo" / "model.safetensors")
    from common.loading import load_pretrained

    initial = load_pretrained(RANDOM_MODEL[1], AutoModelForCausalLM).state_dict()
    assert all(torch.equal(saved[k], initial[k]) for k in saved)
    assert load_file(tmp_path / "outputs" / "ppo" / "critic" / "value_head.safetensors")["summary.weight"].abs().sum() > 0


def test_separate_critic_flags_are_checked_before_loading(tmp_path):
    for flags, expected in (
        (["--freezing-actor-steps", "2"], "add --value-model-path"),
        (["--value-model-path", "policy", "--use-peft"], "--value-model-path with --use-peft"),
        (["--batch-size", "8", "--n-samples-per-prompt", "3"], "make the batch size a multiple of it"),
        (["--use-kl-loss", "--kl-penalty", "full"], "--use-kl-loss with --kl-penalty full"),
        (["--critic-lam", "1.5"], "gamma and lam lie in [0, 1] (the critic's lam too)"),
    ):
        assert expected in run_failing([PPO, *TINY, *flags], tmp_path), flags


@pytest.mark.slow
def test_separate_critic_learns_the_values_and_the_policy_learns_from_them(tmp_path):
    """`python ppo.py --value-model-path policy --critic-learning-rate 5e-4`: the default task (builtin:tiny-chat against
    builtin:tiny-chat-rm, 60 updates) with a critic of its own, a copy of the policy with a zero value head: over the
    first update it explains under a tenth of the returns' variance (0.04 on 1 thread with AVX2 kernels: that update's
    mini-batches already train it), over the last 10 more than a tenth (0.20; with its values detached in the loss, no
    gradient reaching it, it stays at exactly 0 and this test fails), and the held-out reward rises by more than half
    the initial policy's standard deviation (-0.60 -> 0.42, initial std 1.59), inside the KL budget (with the
    advantages' sign flipped the reward falls and this test fails)."""
    out = run_script([PPO, "--value-model-path", "policy", "--critic-learning-rate", "5e-4"], tmp_path)
    assert "critic: a separate value model from policy" in out
    summary = out.split("eval reward ")[1]
    first, last = (float(x) for x in summary.split(" (")[0].split(" -> "))
    initial_std = float(summary.split("initial std ")[1].split(")")[0])
    explained = read_scalars(str(tmp_path / "runs"), "ppo/val/var_explained")
    assert abs(explained[0]) < 0.1 and statistics.mean(explained[-10:]) > 0.1, explained
    assert last - first > 0.5 * initial_std and float(summary.split("KL ")[1].split(";")[0]) < 2 * 6.0, out[-1500:]
    assert "warning:" not in out, out[-1500:]


def test_verifiable_rewards_turn_the_repetition_warning_into_a_note():
    """Replies that agree on a checked answer repeat each other by nature: trained on --reward-funcs (a verifier) whose
    held-out mean rose, the repetition is a note; the same run on a reward model ends with the warning. A critic that
    explains nothing of the returns gets its own warning line either way."""
    from ppo import summary

    lines = []
    accelerator = SimpleNamespace(print=lines.append)
    first = {"eval/reward_mean": 0.2, "eval/reward_std": 0.4, "eval/distinct_2": 0.8, "eval/top_token_share": 0.1}
    last = {"eval/reward_mean": 0.7, "eval/distinct_words": 0.9, "eval/distinct_2": 0.3, "eval/top_token_share": 0.15}
    histories = ([0.2, 0.7], [1.0, 2.0], [0.0, 0.01])
    for funcs in (["verifier"], []):
        args = SimpleNamespace(
            batch_size=32, world_size=1, num_updates=2, output_dir="out", save_best=False, target=6.0,
            reward_funcs=funcs, value_model_path="auto",
        )  # fmt: skip
        lines.clear()
        summary(args, accelerator, 0, 0.0, histories, first, last, float("-inf"))
        text = "\n".join(lines)
        assert ("note: the responses repeat each other" in text) == bool(funcs), text
        assert ("warning: the responses repeat each other" in text) == (not funcs), text
        assert "warning: the critic does not learn" in text and "--critic-learning-rate" in text
