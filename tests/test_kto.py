import json
import math
import os
import re

import pytest
import torch
from conftest import (
    DDP_ENV,
    RANDOM_MODEL,
    ROOT,
    check_model_card,
    check_resume,
    ddp_launch,
    read_scalars,
    require,
    run_failing,
    run_script,
)

from common.loading import load_data, load_tokenizer
from kto import balance_warning, kto_loss, mismatched, reference_point, tokenize_example, unpair

KTO = os.path.join(ROOT, "kto.py")


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_by_hand():
    """Eq. 7-8 on two completions: r = log pi - log pi_ref = 1.0 (desirable) and -0.5 (undesirable), z0 = 0.25."""
    policy, reference = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.5])
    labels, beta, z0 = torch.tensor([True, False]), 0.5, torch.tensor(0.25)
    losses, rewards = kto_loss(policy, reference, labels, z0, beta, "kto", 2.0, 3.0)
    assert losses.tolist() == pytest.approx([2.0 * (1 - sig(0.5 * 0.75)), 3.0 * (1 - sig(0.5 * 0.75))])
    assert rewards.tolist() == pytest.approx([0.5, -0.25])
    losses, _ = kto_loss(policy, reference, labels, z0, beta, "apo_zero_unpaired")  # z0 plays no part
    assert losses.tolist() == pytest.approx([1 - sig(0.5), sig(-0.25)])


def test_reference_point_and_mismatched_pairs():
    """z0 is the mean log-ratio of the mismatched pairs, with no gradient; each prompt takes the previous completion."""
    policy = torch.tensor([-1.0, -2.0, -4.0], requires_grad=True)
    z0 = reference_point(policy, torch.tensor([-3.0, -3.0, -3.0]))
    assert z0.item() == pytest.approx(2 / 3) and not z0.requires_grad
    assert reference_point(policy, torch.tensor([-2.0, -2.0, -2.0])).item() == 0  # -1/3, clamped
    assert reference_point(policy, torch.tensor([-3.0] * 3), lambda z: z - 1).item() == 0  # clamped after the mean
    assert mismatched(["y1", "y2", "y3"]) == ["y3", "y1", "y2"]


def test_unpair_follows_trl():
    """TRL's `unpair_preference_dataset`, row for row, on 1,200 pairs (two blocks)."""
    require("trl")
    from trl.data_utils import unpair_preference_dataset

    pairs = load_data("builtin:vader-preferences").select(range(1200))
    ours = unpair(pairs, "prompt", "chosen", "rejected", "completion", "label")
    theirs = unpair_preference_dataset(pairs)
    assert ours.to_list() == theirs.select_columns(["prompt", "completion", "label"]).to_list()


def test_tokenize_example_text_and_chat(chat_llama):
    """Text: the completion gets EOS and starts where prompt and prompt + completion diverge (TRL 1.16). Chat: the
    rendered turn, its end-of-turn token last."""
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    prompt_ids, completion_ids = tokenize_example(tokenizer, "Hello there", " friend", chat=False)
    full = tokenizer("Hello there friend" + tokenizer.eos_token)["input_ids"]
    assert prompt_ids + completion_ids == full and completion_ids[-1] == tokenizer.eos_token_id
    prompt_ids, completion_ids = tokenize_example(tokenizer, "Hello there", "friend", chat=False, text_format="spaced")
    assert prompt_ids + completion_ids == [tokenizer.bos_token_id] + full  # dpo.py's format
    assert tokenizer.decode(completion_ids) == " friend" + tokenizer.eos_token
    from dpo import tokenize_pair

    row = load_data("builtin:vader-preferences")[0]
    prompt_ids, completion_ids = tokenize_example(tokenizer, row["prompt"], row["chosen"], False, text_format="spaced")
    dpo_pair = tokenize_pair(tokenizer, row["prompt"] + " ", row["chosen"], row["rejected"], 128, 64)
    assert prompt_ids + completion_ids == dpo_pair["chosen_input_ids"]
    chat = load_tokenizer(chat_llama)
    prompt_ids, completion_ids = tokenize_example(chat, "Hi", "Hello", chat=True)
    assert chat.decode(completion_ids).endswith(chat.eos_token) and "Hello" in chat.decode(completion_ids)
    assert chat.decode(prompt_ids).endswith("<|im_start|>assistant\n")


def test_balance_warning_follows_eq_8():
    """TRL's range for unequal counts: 30 desirable, 10 undesirable wants lambda_D in [0.33, 0.44] or lambda_U in
    [2.26, 3.0]."""
    from kto import Args

    examples = [dict(label=True)] * 30 + [dict(label=False)] * 10
    warning = balance_warning(Args(), examples)
    assert "[0.33, 0.44]" in warning and "[2.26, 3.0]" in warning
    assert balance_warning(Args(undesirable_weight=2.5), examples) is None
    assert balance_warning(Args(), examples[20:]) is None  # 10 and 10


class _TrlModel(torch.nn.Module):
    """What TRL 1.16's fused LM head returns: given per-token log-probs [B, T - 1], for the main and the KL inputs."""

    is_gradient_checkpointing = False

    def __init__(self, log_probs, kl_log_probs, kl_input_ids):
        super().__init__()
        self.log_probs, self.kl_log_probs, self.kl_input_ids = log_probs, kl_log_probs, kl_input_ids

    def forward(self, input_ids, **kwargs):
        from types import SimpleNamespace

        log_probs = self.kl_log_probs if input_ids is self.kl_input_ids else self.log_probs
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros)


def trl_kto_loss(per_token, kl_per_token, ref_per_token, ref_kl_per_token, mask, kl_mask, labels, **config):
    """TRL 1.16's own `KTOTrainer._compute_loss` on these per-token log-probs [B, T]: its method called with a stand-in
    trainer whose model and reference return them."""
    from collections import defaultdict
    from types import SimpleNamespace

    require("trl")
    from trl.trainer.kto_trainer import KTOTrainer

    identity = lambda x: x  # noqa: E731
    # the first position is the prompt's, as TRL's completion mask has it; the KL inputs are another tensor
    completion_mask = torch.cat([torch.zeros(len(mask), 1), mask], 1).long()
    kl_completion_mask = torch.cat([torch.zeros(len(kl_mask), 1), kl_mask], 1).long()
    ids, kl_ids = torch.ones_like(completion_mask), torch.ones_like(kl_completion_mask)
    model = _TrlModel(per_token * mask, kl_per_token * kl_mask, kl_ids)
    ref_model = _TrlModel(ref_per_token * mask, ref_kl_per_token * kl_mask, kl_ids)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=identity)
    trainer = SimpleNamespace(
        model=model, ref_model=ref_model, accelerator=accelerator, aux_loss_enabled=False, precompute_ref_logps=False,
        calculate_KL=config["loss_type"] == "kto", args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1, **config,
    )  # fmt: skip
    trainer._compute_kl_logps = lambda m, batch: KTOTrainer._compute_kl_logps(trainer, m, batch)
    inputs = {
        "input_ids": ids, "attention_mask": ids, "completion_mask": completion_mask, "KL_input_ids": kl_ids,
        "KL_attention_mask": kl_ids, "KL_completion_mask": kl_completion_mask, "label": labels,
    }  # fmt: skip
    return KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False), trainer._metrics["train"]


def our_kto_loss(per_token, kl_per_token, ref_per_token, ref_kl_per_token, mask, kl_mask, labels, **config):
    """kto.py's loss (Scorer.batch_metrics) on the same per-token log-probs: sums over the completions, z0 clamped."""
    policy, reference = (per_token * mask).sum(-1), (ref_per_token * mask).sum(-1)
    z0 = reference_point((kl_per_token * kl_mask).sum(-1), (ref_kl_per_token * kl_mask).sum(-1))
    z0 = z0 if config["loss_type"] == "kto" else torch.zeros(())
    losses, rewards = kto_loss(
        policy, reference, labels, z0, config["beta"], config["loss_type"], config["desirable_weight"],
        config["undesirable_weight"],
    )  # fmt: skip
    return losses.mean(), rewards, z0


KTO_CASES = [
    dict(loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0),
    dict(loss_type="kto", beta=0.5, desirable_weight=1.33, undesirable_weight=0.7),
    dict(loss_type="kto", beta=0.5, desirable_weight=1.0, undesirable_weight=1.0, kl_shift=-2.0),  # z0 clamped at 0
    dict(loss_type="kto", beta=0.5, desirable_weight=1.0, undesirable_weight=1.0, only_desirable=True),
    dict(loss_type="apo_zero_unpaired", beta=0.5, desirable_weight=1.0, undesirable_weight=1.0),
    dict(loss_type="apo_zero_unpaired", beta=0.2, desirable_weight=0.5, undesirable_weight=2.0),
]


@pytest.mark.parametrize("config", KTO_CASES, ids=lambda c: str(c))
def test_kto_loss_equals_trls_own_code_in_value_and_gradient(config):
    """kto.py's loss against TRL 1.16's `KTOTrainer._compute_loss` on random per-token log-probs of 6 completions of
    different lengths (and their mismatched pairs): the same loss, the same gradient with respect to every token's
    log-prob, the same z0 and the same reward metrics."""
    config = dict(config)
    kl_shift, only_desirable = config.pop("kl_shift", 1.0), config.pop("only_desirable", False)
    generator = torch.Generator().manual_seed(0)
    B, T = 6, 5
    mask = (torch.arange(T)[None] < torch.tensor([2, 5, 3, 4, 1, 5])[:, None]).float()
    kl_mask = (torch.arange(T)[None] < torch.tensor([5, 2, 5, 3, 4, 1])[:, None]).float()
    per_token = (-torch.rand(B, T, generator=generator) * 3).requires_grad_()
    ref_per_token = -torch.rand(B, T, generator=generator) * 3
    ref_kl_per_token = -torch.rand(B, T, generator=generator) * 3
    kl_per_token = ref_kl_per_token + kl_shift * torch.rand(B, T, generator=generator)  # z0 > 0 unless shifted down
    labels = torch.tensor([True] * B) if only_desirable else torch.tensor([True, False, False, True, True, False])
    inputs = (per_token, kl_per_token, ref_per_token, ref_kl_per_token, mask, kl_mask, labels)
    trl, trl_metrics = trl_kto_loss(*inputs, **config)
    (trl_grad,) = torch.autograd.grad(trl, per_token)
    ours, rewards, z0 = our_kto_loss(*inputs, **config)
    (our_grad,) = torch.autograd.grad(ours, per_token)
    assert ours.item() == pytest.approx(trl.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(our_grad, trl_grad, rtol=1e-5, atol=1e-8)
    assert our_grad.abs().sum() > 0  # a loss that moves the policy
    assert z0.item() == pytest.approx(trl_metrics["kl"][0], abs=1e-6)
    assert (rewards[labels].mean().item()) == pytest.approx(trl_metrics["rewards/chosen"][0], rel=1e-5)
    if not only_desirable:
        assert rewards[~labels].mean().item() == pytest.approx(trl_metrics["rewards/rejected"][0], rel=1e-5)
        assert config["loss_type"] != "kto" or kl_shift < 0 or z0.item() > 0.1  # the cases test z0 both ways


@pytest.fixture()
def feedback_file(tmp_path):
    """60 unpaired (prompt, completion, label) rows from the built-in preferences, in a local jsonl file."""
    pairs = load_data("builtin:vader-preferences").select(range(30))
    rows = unpair(pairs, "prompt", "chosen", "rejected", "completion", "label").to_list()
    path = tmp_path / "feedback.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_kto_runs_on_unpaired_data_and_saves_a_plain_model(tmp_path, feedback_file):
    """A local unpaired file through the real CLI: the summary, TRL's metrics in TensorBoard, a model card."""
    out = run_script(
        [KTO, *RANDOM_MODEL, "--dataset-name", feedback_file, "--batch-size", "4", "--max-steps", "3", "--overwrite"],
        tmp_path,
    )
    assert "kto: 3 steps" in out and "eval reward margin 0.000 -> " in out, out[-800:]
    runs = os.path.join(tmp_path, "runs")
    for tag in ("train/loss", "train/kl", "train/rewards/margins", "eval/rewards/chosen", "eval/logps/rejected"):
        assert read_scalars(runs, tag), tag
    card = check_model_card(tmp_path / "outputs" / "kto", "kto")
    assert "eval/rewards/margins" in card
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "kto")  # plain transformers


@pytest.mark.parametrize("sync", [[], ["--sync-ref-model", "--ref-model-sync-steps", "1"]], ids=["frozen", "tr-dpo"])
def test_resume_continues_where_it_stopped(tmp_path, feedback_file, sync):
    """A resumed run ends where the uninterrupted one does; with TR-DPO's moving reference too (it is checkpointed)."""
    common = [KTO, *RANDOM_MODEL, "--dataset-name", feedback_file, "--batch-size", "4", "--max-steps", "4", *sync]
    out, checkpoint = check_resume(common, ["--save-steps", "2"], "step_2", r" steps in .*?(eval [^;]*);", tmp_path)
    assert "kto: 2 steps" in out
    assert "raise --max-steps" in run_failing([*common, "--max-steps", "2", "--resume-from", checkpoint], tmp_path)


def test_precomputed_reference_log_probs_match_on_the_fly(tmp_path, feedback_file):
    """--precompute-ref-log-probs (TRL's KTOConfig field): the KL pairs fixed as TRL forms them (each --batch-size chunk
    of the data's order rotated by one: TRL's add_kl_completion_ids, reproduced below) and every reference log-prob
    computed once. In the data's order (--train-sampling-strategy sequential) a batch is such a chunk, so the run trains
    what the on-the-fly run trains; with --sync-ref-model there is no reference left to move: one line."""
    from safetensors.torch import load_file

    from kto import fixed_kl_pairs

    examples = [{"completion_ids": [i] * (i % 3 + 1)} for i in range(10)]
    fixed_kl_pairs(examples, 4)
    expected = []
    for start in range(0, 10, 4):  # TRL 1.16: dataset.map(add_kl_completion_ids, batched=True, batch_size=4)
        completions = [e["completion_ids"] for e in examples[start : start + 4]]
        expected += [completions[-1]] + completions[:-1]
    assert [e["kl_completion_ids"] for e in examples] == expected
    from accelerate import Accelerator

    from kto import Args, Batches

    batches = Batches(Args(max_length=16), Accelerator(cpu=True), load_tokenizer("builtin:tiny-gpt2"), 1)
    rows = [dict(prompt_ids=[1, 2], completion_ids=[3], kl_completion_ids=[4, 5], label=True, reference_logps=-1.0,
                 KL_reference_logps=-2.0), dict(prompt_ids=[6], completion_ids=[7], kl_completion_ids=[8], label=False,
                 reference_logps=-3.0, KL_reference_logps=-4.0)]  # fmt: skip
    batch = batches.collate(rows, kl=True)  # the fixed pairs and the stored log-probs, not the batch's rotation
    assert batch["KL_input_ids"][0, :4].tolist() == [1, 2, 4, 5] and batch["KL_input_ids"][1, :2].tolist() == [6, 8]
    assert batch["reference_logps"].tolist() == [-1.0, -3.0] and batch["KL_reference_logps"].tolist() == [-2.0, -4.0]

    common = [KTO, *RANDOM_MODEL, "--dataset-name", feedback_file, "--batch-size", "4", "--max-steps", "4"]
    common += ["--train-sampling-strategy", "sequential", "--learning-rate", "1e-3", "--no-generate-during-eval"]
    live = run_script([*common, "--output-dir", "live"], tmp_path)
    pre = run_script([*common, "--output-dir", "pre", "--precompute-ref-log-probs", "--log-dir", "pre_runs"], tmp_path)
    summary = r"kto: 4 steps in \S+ (eval reward margin [^;]*);"  # the freed reference samples no replies
    assert re.search(summary, live).group(1) == re.search(summary, pre).group(1), (live[-300:], pre[-300:])
    weights = [load_file(tmp_path / d / "model.safetensors") for d in ("live", "pre")]
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[0])
    kl = [read_scalars(str(tmp_path / d), "train/kl") for d in ("runs", "pre_runs")]
    assert len(kl[0]) == 4 and kl[0] == pytest.approx(kl[1]), kl
    error = run_failing([*common, "--precompute-ref-log-probs", "--sync-ref-model"], tmp_path)
    assert "--precompute-ref-log-probs frees it" in error, error


def test_tr_dpo_reference_with_alpha_1_becomes_the_policy(tmp_path, feedback_file):
    """kto.py --sync-ref-model (TRL's KTOConfig field): with --ref-model-mixup-alpha 1 every step the reference is the
    policy after the last step, so the final evaluation's implicit rewards, beta * (log pi - log pi_ref), are 0 (a
    frozen reference leaves them moved); with LoRA there is no copy to move: one line."""
    import re

    common = [KTO, *RANDOM_MODEL, "--dataset-name", feedback_file, "--batch-size", "4", "--max-steps", "2"]
    common += ["--learning-rate", "1e-3", "--no-generate-during-eval"]  # (the held-out samples are not compared)
    synced = run_script([*common, "--sync-ref-model", "--ref-model-sync-steps", "1", "--ref-model-mixup-alpha", "1"], tmp_path)
    frozen = run_script([*common, "--output-dir", "frozen", "--log-dir", "frozen_runs"], tmp_path)
    margin = r"eval reward margin ([-\d.]+) -> ([-\d.]+) \(desirable ([-\d.]+), undesirable ([-\d.]+)\)"
    assert set(re.search(margin, synced).groups()[1:]) <= {"0.000", "-0.000"}, synced[-500:]
    assert re.search(margin, frozen).group(3) not in ("0.000", "-0.000"), frozen[-500:]
    error = run_failing([*common, "--sync-ref-model", "--use-peft"], tmp_path)
    assert "--sync-ref-model moves a reference copy during training, and --use-peft has none" in error, error


def test_kto_bad_input(tmp_path, feedback_file):
    """Labels missing, not booleans, or all the same; a batch too small for the KL estimate: one line each."""
    rows = [json.loads(line) for line in open(feedback_file)]

    def failing(name: str, rows: list[dict], *flags: str) -> str:
        path = tmp_path / name
        path.write_text("\n".join(json.dumps(r) for r in rows))
        return run_failing([KTO, *RANDOM_MODEL, "--dataset-name", str(path), *flags], tmp_path)

    assert "no label column 'label'" in failing(
        "unlabelled.jsonl", [{k: r[k] for k in ("prompt", "completion")} for r in rows]
    )
    strings = [r | {"label": "yes" if r["label"] else "no"} for r in rows]
    assert "row 0: 'yes' is not a boolean" in failing("strings.jsonl", strings)
    ints = [r | {"label": int(r["label"])} for r in rows]
    assert "is not a boolean" in failing("ints.jsonl", ints)
    same = [r | {"label": True} for r in rows]
    assert "Every training label is True" in failing("same.jsonl", same)
    assert "--batch-size 1 with --loss-type kto" in run_failing([KTO, *RANDOM_MODEL, "--batch-size", "1"], tmp_path)
    assert "no label column 'score'" in run_failing(
        [KTO, *RANDOM_MODEL, "--dataset-name", feedback_file, "--label-column", "score"], tmp_path
    )
    assert "encoder-decoder" in run_failing([KTO, "--model-name", "builtin:tiny-t5"], tmp_path)


@pytest.mark.slow
def test_kto_learns_the_preferences(tmp_path):
    """The default data (the built-in VADER pairs, unpaired) on the tiny random model: the held-out margin between the
    desirable and the undesirable completions' implicit rewards rises from 0 (measured: 3.12 in 30 steps), the
    undesirable ones falling below the desirable ones, and the held-out replies' KL to the start is logged beside it."""
    quick = ["--max-steps", "30", "--learning-rate", "3e-4", "--eval-steps", "1000", "--eval-fraction", "0.05"]
    out = run_script([KTO, *RANDOM_MODEL, *quick], tmp_path)
    summary = out.split("eval reward margin ")[1]
    first, last = (float(x) for x in summary.split(" (")[0].split(" -> "))
    desirable = float(summary.split("(desirable ")[1].split(",")[0])
    undesirable = float(summary.split("undesirable ")[1].split(")")[0])
    assert first == 0.0 and last > 1.0 and undesirable < desirable - 1.0, out[-600:]
    kl = read_scalars(os.path.join(tmp_path, "runs"), "eval/samples/kl")
    assert kl[0] == 0.0 and kl[-1] > 0, kl  # the policy starts as its reference, then moves


@pytest.mark.slow
def test_kto_options_run(tmp_path, chat_llama):
    """Chat data through a chat template, LoRA (its reference the adapter disabled), APO-zero unpaired (no KL pass), the
    data's own order, accumulation and raw text joined as TRL 1.16 joins it."""
    for flags in (
        ["--model-name", chat_llama, "--dataset-name", "builtin:vader-preferences-chat", "--use-peft", "--lora-r", "4"]
        + ["--gradient-checkpointing"],
        [*RANDOM_MODEL, "--loss-type", "apo_zero_unpaired", "--train-sampling-strategy", "sequential"]
        + ["--gradient-accumulation-steps", "2", "--text-format", "joined", "--no-generate-during-eval"],
    ):
        quick = ["--batch-size", "4", "--max-steps", "2", "--eval-fraction", "0.02"]
        out = run_script([KTO, *quick, *flags, "--overwrite"], tmp_path)
        assert "kto: 2 steps" in out, flags
        assert ("replies: KL" in out) == ("--no-generate-during-eval" not in flags), flags


@pytest.mark.slow
def test_two_process_ddp_trains_what_one_process_trains(tmp_path, feedback_file):
    """2 ranks x 4 examples a step draw the 8 examples one process draws with --batch-size 8 (each rank its slice of
    the step's batch), so with apo_zero_unpaired (no reference point) both train the same weights; one summary."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from common.loading import load_pretrained

    quick = [KTO, *RANDOM_MODEL, "--dataset-name", feedback_file, "--max-steps", "3", "--no-generate-during-eval"]
    apo = ["--loss-type", "apo_zero_unpaired"]
    run_script([*quick, *apo, "--batch-size", "8", "--output-dir", "one"], tmp_path, OMP_NUM_THREADS="1")
    out = run_script([*ddp_launch(), *quick, *apo, "--batch-size", "4", "--output-dir", "two"], tmp_path, **DDP_ENV)
    assert out.count("kto: 3 steps") == 1, out[-800:]
    one, two = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "two"))
    assert all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)
    start = load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).state_dict()
    assert any(not torch.equal(one[k], start[k]) for k in one if k in start)  # it trained
