import math
import os

import pytest
import torch
from conftest import (
    DDP_ENV,
    RANDOM_MODEL,
    ROOT,
    check_model_card,
    check_resume,
    ddp_launch,
    default_run,
    read_scalars,
    require,
    run_failing,
    run_script,
)
from transformers import AutoModelForSequenceClassification

from common.loading import load_data, load_pretrained, load_tokenizer, reward_model_text, train_eval_split
from reward_modeling import fold_reward_normalization, reward_loss

RM = os.path.join(ROOT, "reward_modeling.py")


def test_reward_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # -log sigmoid(1) and -log sigmoid(-1)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2
    assert reward_loss(chosen, rejected).item() == pytest.approx(expected)
    with_margin = (math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(1))) / 2  # margins 0.5, 0
    assert reward_loss(chosen, rejected, torch.tensor([0.5, 0.0])).item() == pytest.approx(with_margin)


@pytest.mark.parametrize("margin", [None, [0.5, 0.0, -0.2]])
def test_reward_loss_with_centring_equals_trls_own_compute_loss(margin):
    """TRL 1.16's RewardTrainer.compute_loss, driven with the rewards of 3 pairs (its model a stub that returns them):
    the pairwise loss plus center_rewards_coefficient * mean((r_chosen + r_rejected)^2), with and without margins."""
    from collections import defaultdict
    from types import SimpleNamespace

    trl = require("trl")
    chosen, rejected = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([1.0, 1.5, -3.0])
    rewards = torch.cat([chosen, rejected])[:, None]
    identity = lambda x: x  # noqa: E731 - one process: gathering returns the tensor itself
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=False),
        args=SimpleNamespace(center_rewards_coefficient=0.01),
        accelerator=SimpleNamespace(gather=identity, gather_for_metrics=identity),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
    )
    inputs = {"attention_mask": torch.ones(6, 4)} | ({"margin": torch.tensor(margin)} if margin else {})
    theirs = trl.RewardTrainer.compute_loss(trainer, lambda **kw: SimpleNamespace(logits=rewards), inputs)
    ours = reward_loss(chosen, rejected, torch.tensor(margin) if margin else None, center_coefficient=0.01)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    centring = 0.01 * ((chosen + rejected) ** 2).mean()  # by hand: 0.01 * (9 + 4 + 16) / 3
    assert centring.item() == pytest.approx(0.01 * 29 / 3)
    assert (ours - reward_loss(chosen, rejected, torch.tensor(margin) if margin else None)).item() == pytest.approx(
        centring.item()
    )


def test_scores_equal_under_left_and_right_padding():
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    model = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1)
    texts = ["Hi there<|endoftext|>", "A much longer response, which ends with EOS.<|endoftext|>"]
    scores = {}
    for side in ("left", "right"):
        tokenizer.padding_side = side
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        if side == "left":
            batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            scores[side] = model(**batch).logits[:, 0]
    assert torch.allclose(scores["left"], scores["right"], atol=1e-5)
    # the EOS is scored: x and x<eos> differ (pad is distinct from EOS)
    with torch.no_grad():
        without_eos = model(**tokenizer(["Hi there"], return_tensors="pt")).logits[0, 0]
    assert not torch.allclose(without_eos, scores["right"][0])


def test_fold_reward_normalization_applies_gain_and_bias():
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    model = load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1)
    batch = tokenizer(["one text", "another, longer text"], padding=True, return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).logits[:, 0]
        fold_reward_normalization(model, gain=2.0, bias=-0.5)
        after = model(**batch).logits[:, 0]
    assert torch.allclose(after, 2.0 * before - 0.5, atol=1e-4)


@pytest.mark.slow
def test_default_run_learns_the_preferences_and_ends_on_its_pages_line(tmp_path):
    """`python reward_modeling.py` as it comes ends on the line docs/reward_modeling.md renders
    (conftest.default_run); its held-out pair accuracy rises by more than 0.15 to above 0.7, and the saved classifier,
    loaded with plain transformers, scores kind replies above hostile ones on average (three of each; one pair alone
    is a coin that a 0.87-accurate model may lose: "Hi I love this, it is wonderful and great" scored -3.08 against
    -2.84 for its hostile twin, while the other two pairs split by more than 3)."""
    out = default_run("reward_modeling", "reward model: ", tmp_path)
    first, last = [float(x) for x in out.split("eval accuracy ")[1].split(",")[0].split(" -> ")]
    assert last > 0.7 and last > first + 0.15, out[-500:]
    check_model_card(tmp_path / "outputs" / "reward_model", "reward_modeling", base="builtin:tiny-chat")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "outputs" / "reward_model")
    tokenizer = load_tokenizer(str(tmp_path / "outputs" / "reward_model"))
    kind = ["Hi I love this, it is wonderful and great", "How was your day? I love it, thank you!"]
    kind += ["How was your day? That is great news."]
    hostile = ["Hi I hate this, it is awful and terrible", "How was your day? I hate this, it is awful."]
    hostile += ["How was your day? No. Terrible."]
    with torch.no_grad():
        batch = tokenizer([t + tokenizer.eos_token for t in kind + hostile], padding=True, return_tensors="pt")
        good, bad = model(**batch).logits[:, 0].chunk(2)
    assert good.mean() > bad.mean(), (good, bad)


def test_reward_model_options_and_errors(tmp_path):
    import json

    rows = [dict(prompt=f"q{i}", chosen="great answer", rejected="bad", margin=1.0) for i in range(20)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = run_script(
        [
            RM,
            *RANDOM_MODEL,
            "--dataset-name",
            str(tmp_path / "pairs.jsonl"),
            "--margin-column",
            "margin",
            "--max-steps",
            "3",
            "--batch-size",
            "4",
            "--use-peft",
            "--lora-r",
            "4",
        ],
        tmp_path,
    )
    assert "reward model: 3 steps" in out
    assert len(read_scalars(str(tmp_path / "runs"), "time/step")) == 3  # the step time is logged for benchmarks
    assert "no column ['good']" in run_failing([RM, *RANDOM_MODEL, "--chosen-column", "good", "--overwrite"], tmp_path)
    same = [dict(prompt="q", chosen="x", rejected="x")] * 10
    (tmp_path / "same.jsonl").write_text("\n".join(json.dumps(r) for r in same))
    assert "no preference to learn" in run_failing(
        [RM, *RANDOM_MODEL, "--dataset-name", str(tmp_path / "same.jsonl"), "--overwrite"], tmp_path
    )


@pytest.mark.slow
def test_length_groups_change_only_the_padding(tmp_path, pairs_file):
    """Scoring a batch in length-sorted groups (each padded to its own longest sequence) trains the same model as one
    pass over the whole padded batch (TRL's): same metrics, same weights."""
    models, losses = {}, {}
    for groups in ("1", "3"):
        out_dir = tmp_path / f"groups{groups}"
        run_script(
            [
                RM,
                *RANDOM_MODEL,
                "--dataset-name",
                pairs_file,
                "--batch-size",
                "8",
                "--max-steps",
                "4",
                "--length-groups",
                groups,
                "--output-dir",
                str(out_dir),
                "--log-dir",
                str(tmp_path / f"runs{groups}"),
            ],
            tmp_path,
        )
        models[groups] = AutoModelForSequenceClassification.from_pretrained(out_dir).state_dict()
        losses[groups] = read_scalars(str(tmp_path / f"runs{groups}"), "train/loss")
    assert len(losses["1"]) == 4 and losses["1"] == pytest.approx(losses["3"], abs=1e-5)
    assert not torch.equal(
        models["1"]["score.weight"],
        load_pretrained("builtin:tiny-gpt2", AutoModelForSequenceClassification, num_labels=1).score.weight,
    )  # it trained
    for name, weight in models["1"].items():
        torch.testing.assert_close(models["3"][name], weight, atol=1e-4, rtol=0)  # 4 Adam steps of lr 3e-4
    assert "--length-groups 0" in run_failing([RM, *RANDOM_MODEL, "--length-groups", "0"], tmp_path)


@pytest.mark.slow
def test_reward_model_two_process_ddp_normalises_over_every_rank(tmp_path, pairs_file):
    """2 ranks x 4 pairs per step; --normalize-reward sums the training rewards of both ranks' shards, so the saved
    model scores the whole training split at mean 0 and std 1."""
    out = run_script(
        [
            *ddp_launch(),
            RM,
            *RANDOM_MODEL,
            "--dataset-name",
            pairs_file,
            "--num-epochs",
            "1",
            "--batch-size",
            "4",
            "--normalize-reward",
        ],
        tmp_path,
        **DDP_ENV,
    )
    assert out.count(" steps in ") == 1 and "4 optimizer steps" in out  # main process only; 36 pairs // (2 x 4)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "outputs" / "reward_model").eval()
    tokenizer = load_tokenizer(str(tmp_path / "outputs" / "reward_model"))
    train, _ = train_eval_split(load_data(pairs_file), 0.1, seed=1)
    texts = [reward_model_text(tokenizer, row["prompt"], row[c]) for row in train for c in ("chosen", "rejected")]
    with torch.no_grad():
        tokenizer.truncation_side = "left"  # as training cuts them, to --max-length
        rewards = model(**tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")).logits[:, 0]
    assert len(rewards) == 72 and abs(rewards.mean().item()) < 1e-4 and rewards.std().item() == pytest.approx(1, abs=1e-4)


@pytest.mark.slow
def test_resume_continues_where_it_stopped(tmp_path, pairs_file):
    """4 steps straight == 3 steps, checkpoint, resume for 1 more (same weights, bit for bit), across an epoch's
    reshuffle and gradient accumulation; the checkpoint also loads with plain from_pretrained."""
    common = [
        RM,
        *RANDOM_MODEL,
        "--dataset-name",
        pairs_file,
        "--batch-size",
        "8",
        "--gradient-accumulation-steps",
        "2",
        "--max-steps",
        "4",
    ]  # 36 training pairs: 4 micro-batches an epoch, 2 optimizer steps
    out, checkpoint = check_resume(common, ["--save-steps", "3"], "step_3", r" steps in .*?(eval [^;]*);", tmp_path)
    assert "reward model: 1 steps" in out
    assert AutoModelForSequenceClassification.from_pretrained(checkpoint).num_labels == 1
    assert "raise --max-steps" in run_failing([*common, "--max-steps", "3", "--resume-from", checkpoint], tmp_path)


def test_long_pairs_are_cut_or_dropped_as_trl_drops_them(tmp_path):
    """By default a pair past --max-length keeps its last tokens; --no-truncate-long-pairs drops every pair with either
    side past it (TRL 1.16's RewardTrainer filter: len(chosen_ids) <= max_length and len(rejected_ids) <= max_length),
    and dropping them all is one line."""
    import json

    from accelerate import Accelerator

    from common.core import UsageError
    from reward_modeling import Args, load_pairs

    rows = [dict(prompt="q", chosen="good " * (i % 7 + 1), rejected="bad " * (i % 5 + 1)) for i in range(40)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tokenizer = load_tokenizer("builtin:tiny-gpt2", padding_side="right")
    flags = dict(model_name="builtin:tiny-gpt2", dataset_name=str(tmp_path / "pairs.jsonl"))
    flags |= dict(max_length=6)
    lengths = {}
    for row in rows:
        for side in ("chosen", "rejected"):
            text = reward_model_text(tokenizer, row["prompt"], row[side], True, False)
            lengths[row[side]] = len(tokenizer(text)["input_ids"])
    kept = [r for r in rows if lengths[r["chosen"]] <= 6 and lengths[r["rejected"]] <= 6]
    assert 0 < len(kept) < len(rows)
    cut = sum(load_pairs(Args(**flags, chat_template=False), Accelerator(cpu=True), tokenizer), [])  # train + held out
    dropped = sum(
        load_pairs(Args(**flags, chat_template=False, truncate_long_pairs=False), Accelerator(cpu=True), tokenizer), []
    )
    assert len(cut) == len(rows) and max(len(p["chosen"]) for p in cut) == 6
    assert sorted(len(p["chosen"]) for p in dropped) == sorted(lengths[r["chosen"]] for r in kept)
    with pytest.raises(UsageError, match="no training pair is within --max-length 2"):
        load_pairs(
            Args(**{**flags, "max_length": 2}, chat_template=False, truncate_long_pairs=False),
            Accelerator(cpu=True),
            tokenizer,
        )
