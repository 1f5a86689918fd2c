import json
import math
import os
import re

import pytest
import torch
from conftest import (
    RANDOM_MODEL,
    ROOT,
    check_model_card,
    check_resume,
    default_run,
    read_scalars,
    require,
    run_failing,
    run_script,
)
from safetensors.torch import load_file

from common.loading import load_tokenizer
from dpo import (
    LOSS_TYPES,
    REFERENCE_FREE,
    dpo_loss,
    get_batch_logps,
    log_sum_squared_probs,
    reference_free_loss,
    sequence_logps,
    tokenize_pair,
    tokenize_pair_seq2seq,
    wpo_weights,
)

DPO = os.path.join(ROOT, "dpo.py")


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


PC, PR, RC, RR = torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5])  # h = 1


@pytest.mark.parametrize(
    "loss_type, beta, smoothing, expected",
    [
        ("sigmoid", 0.5, 0.0, -math.log(sig(0.5))),
        ("sigmoid", 0.5, 0.1, -0.9 * math.log(sig(0.5)) - 0.1 * math.log(sig(-0.5))),
        ("hinge", 0.5, 0.0, 0.5),
        ("ipo", 0.25, 0.0, (1.0 - 2.0) ** 2),
    ],
)
def test_dpo_loss_by_hand(loss_type, beta, smoothing, expected):
    losses, chosen_rewards, rejected_rewards = dpo_loss(PC, PR, RC, RR, beta, loss_type, smoothing)
    assert losses.item() == pytest.approx(expected)
    assert chosen_rewards.item() == pytest.approx(beta * 0.5) and rejected_rewards.item() == pytest.approx(-beta * 0.5)


def test_kto_pair_by_hand():
    policy_chosen, policy_rejected = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    ref_chosen, ref_rejected = torch.tensor([-1.5, -2.2]), torch.tensor([-1.5, -1.3])
    losses, _, _ = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, 0.5, "kto_pair")
    # log-ratios: chosen [0.5, 0.2] (KL 0.35), rejected [-0.5, 0.3] (KL mean -0.1 clamped to 0)
    expected = [1 - sig(0.5 * 0.5), 1 - sig(0.5 * 0.2), 1 - sig(0.5 * (0.35 + 0.5)), 1 - sig(0.5 * (0.35 - 0.3))]
    assert losses.tolist() == pytest.approx(expected)


def test_reference_free_and_unknown_loss():
    losses, chosen_rewards, _ = dpo_loss(PC, PR, RC, RR, 0.5, reference_free=True)
    assert losses.item() == pytest.approx(-math.log(sig(0.5 * 1.0)))  # h = -1 - (-2), reference ignored
    assert chosen_rewards.item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="Unknown loss_type"):
        dpo_loss(PC, PR, RC, RR, 0.5, "nope")


def test_trl_116_losses_by_hand():
    """A few of TRL 1.16's losses at r_w = 0.5, r_l = -0.5 (h = 1), worked out from their papers' equations."""
    beta = 0.5

    def loss(loss_type, **kw):
        return dpo_loss(PC, PR, RC, RR, beta, loss_type, **kw)[0].item()

    assert loss("nca_pair") == pytest.approx(-math.log(sig(0.25)) - 0.5 * math.log(sig(-0.25)) - 0.5 * math.log(sig(0.25)))
    assert loss("bco_pair") == pytest.approx(-2 * math.log(sig(0.25)))
    assert loss("sppo_hard") == pytest.approx((0.5 - 1.0) ** 2 + (-0.5 + 1.0) ** 2)
    assert loss("apo_zero") == pytest.approx(1 - sig(0.25) + sig(-0.25))
    assert loss("apo_down") == pytest.approx(sig(0.25) + 1 - sig(0.5))
    assert loss("robust", label_smoothing=0.1) == pytest.approx((-0.9 * math.log(sig(0.5)) + 0.1 * math.log(sig(-0.5))) / 0.8)
    lengths = torch.tensor([2.0]), torch.tensor([4.0])  # h per token: 0.5 / 2 + 0.5 / 4
    assert dpo_loss(PC, PR, RC, RR, beta, "sigmoid_norm", 0, False, *lengths)[0].item() == pytest.approx(
        -math.log(sig(beta * 0.375))
    )
    # forward KL: s = 1 - exp(-r), so h = (1 - e^-0.5) - (1 - e^0.5)
    h = math.exp(0.5) - math.exp(-0.5)
    assert loss("sigmoid", f_divergence_type="forward_kl") == pytest.approx(-math.log(sig(beta * h)))


def test_ld_dpo_weights_the_tokens_past_the_shorter_reply():
    """LD-DPO: a pair of 2 and 4 tokens counts the longer reply's last 2 tokens alpha times; alpha 1 is the plain sum."""
    per_token = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-1.0, -1.0, -3.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert sequence_logps(per_token, mask, 0.5).tolist() == [-3.0, -2.0 + 0.5 * -8.0]
    assert sequence_logps(per_token, mask, 1.0).tolist() == sequence_logps(per_token, mask).tolist() == [-3.0, -10.0]


class _TrlModel(torch.nn.Module):
    """What TRL 1.16's fused LM head returns, for given per-token log-probs."""

    is_gradient_checkpointing = False

    def __init__(self, log_probs, log_sum_sq_probs=None):
        super().__init__()
        self.log_probs, self.log_sum_sq_probs = log_probs, log_sum_sq_probs

    def forward(self, **kwargs):
        from types import SimpleNamespace

        zeros = torch.zeros_like(self.log_probs)
        outputs = dict(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
        return SimpleNamespace(**outputs, log_sum_sq_probs=self.log_sum_sq_probs)


def trl_dpo_loss(per_token, ref_per_token, mask, loss_types, loss_weights, **config):
    """TRL 1.16's own `DPOTrainer._compute_loss` on these per-token log-probs [2B, T] (chosen rows first): its method
    called with a stand-in trainer whose model and reference return them."""
    from collections import defaultdict
    from types import SimpleNamespace

    require("trl")
    from trl.trainer.dpo_trainer import DPOTrainer

    identity = lambda x: x  # noqa: E731
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=identity, gather=identity)
    squared = config.pop("log_sum_sq_probs", None)
    model = _TrlModel(per_token * mask, None if squared is None else squared * mask)
    trainer = SimpleNamespace(
        model=model, ref_model=_TrlModel(ref_per_token * mask), accelerator=accelerator, aux_loss_enabled=False,
        precompute_ref_logps=False, loss_types=loss_types, loss_weights=loss_weights,
        use_weighting=config.pop("use_weighting", False),
        args=SimpleNamespace(discopop_tau=config.pop("discopop_tau", 0.05), gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        **{"ld_alpha": None, "f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": 0.5, "label_smoothing": 0.0}
        | config,
    )  # fmt: skip
    completion_mask = torch.cat([torch.zeros(len(mask), 1), mask], 1).long()  # the first token is the prompt's
    ids = torch.ones_like(completion_mask)
    inputs = {"input_ids": ids, "attention_mask": ids, "completion_mask": completion_mask}
    return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)


def our_dpo_loss(per_token, ref_per_token, mask, loss_types, loss_weights, **config):
    """dpo.py's loss (Scorer.pair_metrics' sum over --loss-type) on the same per-token log-probs."""
    ld_alpha, beta, squared = config.pop("ld_alpha", None), config.pop("beta"), config.pop("log_sum_sq_probs", None)
    pair_weights = 1.0
    if config.pop("use_weighting", False):
        chosen_weights, rejected_weights = wpo_weights(per_token * mask, squared * mask, mask).chunk(2)
        pair_weights = chosen_weights * rejected_weights
    chosen, rejected = sequence_logps(per_token * mask, mask, ld_alpha).chunk(2)
    ref_chosen, ref_rejected = sequence_logps(ref_per_token * mask, mask, ld_alpha).chunk(2)
    lengths = mask.sum(-1).chunk(2)
    chosen_nll = -(per_token * mask).chunk(2)[0].sum() / lengths[0].sum()
    total = 0.0
    for loss_type, weight in zip(loss_types, loss_weights):
        losses = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta, loss_type, config.get("label_smoothing", 0.0), False,
            *lengths, config.get("f_divergence_type", "reverse_kl"), config.get("f_alpha_divergence_coef", 0.5),
            config.get("discopop_tau", 0.05), chosen_nll,
        )[0]  # fmt: skip
        total = total + weight * (losses * pair_weights).mean()
    return total


TRL_CASES = [([t], [1.0], {}) for t in LOSS_TYPES if t not in ("kto_pair", "exo_pair", *REFERENCE_FREE)] + [
    (["exo_pair"], [1.0], {"label_smoothing": 1e-3}),
    (["robust"], [1.0], {"label_smoothing": 0.1}),
    (["aot"], [1.0], {"label_smoothing": 0.1}),
    (["aot_unpaired"], [1.0], {"label_smoothing": 0.1}),
    (["sigmoid"], [1.0], {"f_divergence_type": "forward_kl"}),
    (["ipo"], [1.0], {"f_divergence_type": "js_divergence"}),
    (["hinge"], [1.0], {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}),
    (["sigmoid"], [1.0], {"ld_alpha": 0.5}),
    (["discopop"], [1.0], {"discopop_tau": 0.2}),
    (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], {}),  # MPO's mix
    (["sigmoid"], [1.0], {"use_weighting": True}),  # WPO
    (["ipo", "bco_pair"], [1.0, 0.5], {"use_weighting": True}),  # TRL 1.16 weights in place: its sft and hinge fail
]


@pytest.mark.parametrize("loss_types, loss_weights, config", TRL_CASES, ids=lambda c: str(c))
def test_every_loss_equals_trls_own_code_in_value_and_gradient(loss_types, loss_weights, config):
    """dpo.py's losses against TRL 1.16's `DPOTrainer._compute_loss` on random per-token log-probs of 4 pairs of
    different lengths: the same loss and the same gradient with respect to every token's log-prob."""
    generator = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lengths = torch.tensor([2, 6, 3, 5, 6, 1, 4, 4])  # chosen rows, then rejected
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    per_token = (-torch.rand(2 * B, T, generator=generator) * 3).requires_grad_()
    ref_per_token = -torch.rand(2 * B, T, generator=generator) * 3
    beta = 0.5
    if config.get("use_weighting"):  # log sum_v p_v^2 of each position, at most log p_label (and below 0)
        config = config | {"log_sum_sq_probs": per_token.detach() - torch.rand(2 * B, T, generator=generator)}
    trl = trl_dpo_loss(per_token, ref_per_token, mask, loss_types, loss_weights, beta=beta, **config)
    (trl_grad,) = torch.autograd.grad(trl, per_token)
    ours = our_dpo_loss(per_token, ref_per_token, mask, loss_types, loss_weights, beta=beta, **config)
    (our_grad,) = torch.autograd.grad(ours, per_token)
    assert ours.item() == pytest.approx(trl.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(our_grad, trl_grad, rtol=1e-5, atol=1e-7)
    assert our_grad.abs().sum() > 0  # a loss that moves the policy


def test_wpo_weights_by_hand():
    """log sum_v p_v^2 of a distribution, and WPO's weight: exp of the mean of log p(y_t) - log sum_v p_v^2."""
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]])
    squared = log_sum_squared_probs(probs.log() + 3.0)  # logits: any shift
    assert squared.tolist() == pytest.approx([math.log(0.375), math.log(0.815)])
    per_token, mask = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    weight = wpo_weights(per_token, torch.cat([squared[None], torch.zeros(1, 1)], 1), mask)
    expected = math.exp((math.log(0.5 / 0.375) + math.log(0.9 / 0.815)) / 2)
    assert weight.item() == pytest.approx(expected)


def test_get_batch_logps_against_explicit_loop():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels[0, :2] = -100
    labels[1, 4] = -100
    logp = logits.log_softmax(-1)
    expected_sum = [sum(logp[b, t - 1, labels[b, t]].item() for t in range(1, 5) if labels[b, t] != -100) for b in range(2)]
    counts = [sum(1 for t in range(1, 5) if labels[b, t] != -100) for b in range(2)]
    assert get_batch_logps(logits, labels).tolist() == pytest.approx(expected_sum, abs=1e-5)
    assert get_batch_logps(logits, labels, average_log_prob=True).tolist() == pytest.approx(
        [s / c for s, c in zip(expected_sum, counts)], abs=1e-5
    )


def test_get_batch_logps_encoder_decoder_is_not_shifted():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
    labels[1, 3] = -100
    logp = logits.log_softmax(-1)
    expected = [sum(logp[b, t, labels[b, t]].item() for t in range(4) if labels[b, t] != -100) for b in range(2)]
    assert get_batch_logps(logits, labels, is_encoder_decoder=True).tolist() == pytest.approx(expected, abs=1e-5)


def test_tokenize_pair_seq2seq_prompt_to_encoder_answers_to_labels():
    tokenizer = load_tokenizer("builtin:tiny-gpt2")  # adds no special tokens: EOS is appended to the answers

    def ids(text):
        return tokenizer(text)["input_ids"]

    eos = tokenizer.eos_token_id
    prompt = " ".join(f"w{i}" for i in range(20))
    out = tokenize_pair_seq2seq(tokenizer, prompt, "Yes indeed", "No", max_prompt_length=6, max_target_length=8)
    assert out["prompt_input_ids"] == ids(prompt)[-6:]  # keep_end
    assert out["chosen_labels"] == ids("Yes indeed") + [eos] and out["rejected_labels"] == ids("No") + [eos]
    out = tokenize_pair_seq2seq(tokenizer, prompt, " yes" * 10, "No", 6, 4, truncation_mode="keep_start")
    assert out["prompt_input_ids"] == ids(prompt)[:6] and out["chosen_labels"] == ids(" yes" * 4)  # cut: no EOS


@pytest.mark.slow
def test_encoder_decoder_dpo_learns_and_logs_the_true_seq2seq_logps(tmp_path):
    """The tiny T5 policy: prompt to the encoder, answers as decoder labels. The preferences are learnt, the saved model
    loads with AutoModelForSeq2SeqLM, and its log-probs of the eval answers computed by T5 itself from `labels`
    (which shifts them into the decoder input) equal the script's last logged eval/logps/chosen."""
    from transformers import AutoModelForSeq2SeqLM

    from common.loading import load_data, train_eval_split

    out = run_script(
        [
            DPO,
            *RANDOM_MODEL,
            "--model-name",
            "builtin:tiny-t5",
            "--max-steps",
            "16",
            "--batch-size",
            "4",
            "--learning-rate",
            "3e-4",
            "--eval-steps",
            "1000",
            "--eval-fraction",
            "0.05",
            "--max-prompt-length",
            "32",
            "--max-target-length",
            "24",
        ],
        tmp_path,
    )  # measured: accuracy 0.775, margin 0.0 -> 1.2 in 24 steps
    accuracy = float(out.split("eval reward accuracy ")[1].split(",")[0].split(" -> ")[1])
    first_margin, last_margin = (float(x) for x in out.split("margin ")[1].split(";")[0].split(" -> "))
    assert accuracy > 0.65 and last_margin > first_margin + 0.3, out[-600:]

    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "outputs" / "dpo").eval()
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    _, eval_rows = train_eval_split(load_data("builtin:vader-preferences"), 0.05, seed=1)
    logps = []
    with torch.no_grad():
        for row in eval_rows:
            pair = tokenize_pair_seq2seq(tokenizer, row["prompt"], row["chosen"], row["rejected"], 32, 24)
            labels = torch.tensor([pair["chosen_labels"]])
            logits = model(input_ids=torch.tensor([pair["prompt_input_ids"]]), labels=labels).logits
            logps.append(logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).sum().item())
    logged = read_scalars(str(tmp_path / "runs"), "eval/logps/chosen")[-1]
    assert sum(logps) / len(logps) == pytest.approx(logged, rel=1e-4)


def test_tokenize_pair_survives_a_merge_at_the_boundary():
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    hello, wor, world = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("Hello", " wor", " world"))
    assert len(wor) == 1 and len(world) == 1  # "Hello wor" + "ld" merges into "Hello world"
    out = tokenize_pair(tokenizer, "Hello wor", "ld", "!", max_length=32, max_prompt_length=16)
    bos = eos = tokenizer.eos_token_id
    assert out["chosen_input_ids"] == [bos] + hello + world + [eos]
    assert out["chosen_labels"] == [-100, -100] + world + [eos]  # the merged token belongs to the answer
    assert out["rejected_input_ids"][:3] == [bos] + hello + wor  # "Hello wor!": no merge, boundary unchanged
    assert out["rejected_labels"][:3] == [-100] * 3


def test_tokenize_pair_truncation_modes():
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    prompt = " ".join(f"w{i}" for i in range(20))
    answer = " yes" * 10
    for mode, kept in (("keep_end", "w19"), ("keep_start", "w0")):
        out = tokenize_pair(tokenizer, prompt, answer, " no", max_length=12, max_prompt_length=5, truncation_mode=mode)
        n_prompt = out["chosen_labels"].count(-100)
        assert n_prompt == 5 and len(out["chosen_input_ids"]) == 5 + 7  # answer cut to max_length - max_prompt_length
        assert kept in tokenizer.decode(out["chosen_input_ids"][:n_prompt])


def test_precomputed_reference_log_probs_match_on_the_fly(tmp_path, pairs_file):
    common = [DPO, *RANDOM_MODEL, "--dataset-name", pairs_file, "--batch-size", "4", "--max-steps", "4"]
    common += ["--no-generate-during-eval"]  # (the held-out samples do not enter what is compared)
    out_live = run_script([*common, "--output-dir", "live"], tmp_path)
    out_pre = run_script([*common, "--output-dir", "pre", "--precompute-ref-log-probs"], tmp_path)
    summaries = [out.split("eval reward accuracy ")[1].split("; model")[0] for out in (out_live, out_pre)]
    assert summaries[0] == summaries[1]
    live, pre = load_file(tmp_path / "live" / "model.safetensors"), load_file(tmp_path / "pre" / "model.safetensors")
    assert "| precompute_ref_log_probs | True |" in check_model_card(tmp_path / "pre", "dpo")
    assert all(torch.allclose(live[k], pre[k], atol=1e-6) for k in live)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid --use-weighting"])  # summed, per token, WPO
def test_chunked_logps_equal_the_full_logits(tmp_path, pairs_file, loss_type):
    runs = {}
    for name, flag in (("chunked", "--chunked-logps"), ("full", "--no-chunked-logps")):
        run_script(
            [
                DPO,
                *RANDOM_MODEL,
                flag,
                "--dataset-name",
                pairs_file,
                "--batch-size",
                "4",
                "--max-steps",
                "3",
                "--loss-type",
                *loss_type.split(),
                "--output-dir",
                name,
                "--log-dir",
                str(tmp_path / "runs" / name),
            ],
            tmp_path,
        )
        runs[name] = {
            tag: read_scalars(str(tmp_path / "runs" / name), f"train/{tag}")
            for tag in ("loss", "logps/chosen", "logps/rejected", "logits/chosen", "rewards/margins")
        }
    for tag, values in runs["chunked"].items():
        assert len(values) == 3 and values == pytest.approx(runs["full"][tag], rel=1e-4, abs=1e-5), tag
    chunked, full = (load_file(tmp_path / d / "model.safetensors") for d in ("chunked", "full"))
    assert all(torch.allclose(chunked[k], full[k], atol=1e-5) for k in chunked)


@pytest.mark.slow
def test_dpo_options_run(tmp_path, pairs_file):
    for flags in (
        ["--loss-type", "ipo", "--use-peft", "--lora-r", "4", "--generate-during-eval", "--gradient-checkpointing"],
        ["--loss-type", "kto_pair", "--reference-free", "--gradient-accumulation-steps", "2"],
        ["--label-smoothing", "0.1", "--precompute-ref-log-probs", "--use-peft", "--lora-r", "4"],
    ):
        out = run_script(
            [DPO, *RANDOM_MODEL, "--dataset-name", pairs_file, "--batch-size", "4", "--max-steps", "2", *flags, "--overwrite"],
            tmp_path,
        )
        assert "dpo: 2 steps" in out, flags


@pytest.mark.parametrize("sync", [[], ["--sync-ref-model", "--ref-model-sync-steps", "1"]], ids=["frozen", "tr-dpo"])
def test_resume_continues_where_it_stopped(tmp_path, pairs_file, sync):
    """The same final weights and metrics straight or resumed; with TR-DPO the moving reference is in the checkpoint."""
    common = [DPO, *RANDOM_MODEL, "--dataset-name", pairs_file, "--batch-size", "4", "--max-steps", "4", *sync]
    out, checkpoint = check_resume(common, ["--save-steps", "2"], "step_2", r" steps in .*?(eval [^;]*);", tmp_path)
    assert "dpo: 2 steps" in out
    assert "raise --max-steps" in run_failing([*common, "--max-steps", "2", "--resume-from", checkpoint], tmp_path)


@pytest.mark.parametrize("loss_type, smoothing", [("cpo", 0.0), ("cpo", 0.1), ("simpo", 0.0), ("orpo", 0.0)])
def test_reference_free_losses_equal_trls_experimental_trainers(loss_type, smoothing):
    """cpo and simpo against TRL 1.16's CPOTrainer.cpo_loss (plus cpo_alpha times the chosen NLL: `--loss-type cpo
    sft`), orpo against ORPOTrainer.odds_ratio_loss and its `nll - mean(losses)`, each method driven through a stand-in
    trainer on random per-token log-probs of 4 pairs of uneven lengths: the same loss and the same gradient."""
    from types import SimpleNamespace

    require("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    torch.manual_seed(0)
    per_token = (-torch.rand(8, 6) * 2).requires_grad_()
    lengths = torch.tensor([6, 3, 5, 2, 4, 6, 1, 3])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    sums, means = (per_token * mask).sum(-1), (per_token * mask).sum(-1) / mask.sum(-1)
    nll = -(per_token * mask)[:4].sum() / mask[:4].sum()  # TRL's cross entropy over the chosen replies' tokens
    beta, device = 0.2, torch.device("cpu")
    if loss_type == "orpo":
        trainer = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=device))
        losses, *_ = ORPOTrainer.odds_ratio_loss(trainer, *means.chunk(2))
        theirs = nll - losses.mean()
    else:
        trainer = SimpleNamespace(
            alpha=0.0, beta=beta, loss_type="simpo" if loss_type == "simpo" else "sigmoid", simpo_gamma=0.5,
            label_smoothing=smoothing, accelerator=SimpleNamespace(device=device),
        )  # fmt: skip
        losses, _, _ = CPOTrainer.cpo_loss(trainer, *(means if loss_type == "simpo" else sums).chunk(2))
        theirs = losses.mean() + 1.0 * nll  # cpo_alpha 1, TRL's default
    (their_grad,) = torch.autograd.grad(theirs, per_token, retain_graph=True)
    ours, _, _ = reference_free_loss(*sums.chunk(2), *mask.sum(-1).chunk(2), beta, loss_type, smoothing, 0.5, nll)
    ours = ours.mean() + (0 if loss_type == "orpo" else nll)  # cpo and simpo: with `sft` beside them, as TRL's cpo_alpha
    (our_grad,) = torch.autograd.grad(ours, per_token)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(our_grad, their_grad)


def test_a_reference_free_loss_trains_without_a_reference_model(tmp_path, pairs_file, monkeypatch):
    """--loss-type simpo (and orpo, cpo) build no reference model, and the run trains."""
    import common.models

    made, create = [], common.models.create_reference_model
    monkeypatch.setattr(common.models, "create_reference_model", lambda model: made.append(model) or create(model))
    common = [DPO, *RANDOM_MODEL, "--dataset-name", pairs_file, "--batch-size", "4", "--max-steps", "2"]
    common += ["--no-generate-during-eval"]  # (the held-out samples do not enter what is compared)
    out = run_script([*common, "--loss-type", "simpo", "--learning-rate", "1e-3"], tmp_path)
    assert "dpo: 2 steps" in out and not made
    run_script([*common, "--loss-type", "sigmoid", "--output-dir", "with_ref"], tmp_path)
    assert len(made) == 1  # a reference-based loss builds its reference


def test_sync_reference_equals_trls_callback():
    """TR-DPO's soft update (common.models.sync_reference: dpo.py's, kto.py's, grpo.py's and rloo.py's) against TRL
    1.16's SyncRefModelCallback._sync_target_model, on two random tiny GPT-2s, and by hand on one weight."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from common.models import sync_reference

    trl = require("trl")
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    torch.manual_seed(0)
    policy, reference = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    theirs = GPT2LMHeadModel(config)
    theirs.load_state_dict(reference.state_dict())
    before = reference.transformer.wte.weight[3, 5].item()
    sync_reference(policy, reference, 0.6)
    trl.trainer.callbacks.SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
    for (name, ours), theirs_param in zip(reference.named_parameters(), theirs.parameters()):
        assert torch.equal(ours, theirs_param), name
    expected = 0.6 * policy.transformer.wte.weight[3, 5].item() + 0.4 * before
    assert reference.transformer.wte.weight[3, 5].item() == pytest.approx(expected)


def test_tr_dpo_with_alpha_1_makes_the_reference_the_policy(tmp_path, pairs_file):
    """--ref-model-mixup-alpha 1 every step: after the last step the reference is the policy, so the final evaluation's
    implicit rewards, beta * (log pi - log pi_ref), are 0 (a frozen reference leaves them moved); with LoRA there is
    no copy to move: one line."""
    common = [DPO, *RANDOM_MODEL, "--dataset-name", pairs_file, "--batch-size", "4", "--max-steps", "2"]
    common += ["--no-generate-during-eval"]  # (the held-out samples do not enter what is compared)
    common += ["--learning-rate", "1e-3"]
    synced = run_script([*common, "--sync-ref-model", "--ref-model-sync-steps", "1", "--ref-model-mixup-alpha", "1"], tmp_path)
    frozen = run_script([*common, "--output-dir", "frozen"], tmp_path)
    margin = r"margin ([-\d.]+) -> ([-\d.]+);"
    assert re.search(margin, synced).group(2) == "0.000", synced[-500:]
    assert re.search(margin, frozen).group(2) != "0.000", frozen[-500:]
    error = run_failing([*common, "--sync-ref-model", "--use-peft"], tmp_path)
    assert "--sync-ref-model moves a reference copy during training, and --use-peft has none" in error, error
    error = run_failing([*common, "--sync-ref-model", "--loss-type", "simpo"], tmp_path)
    assert "and --loss-type simpo has none that can move" in error, error


@pytest.mark.slow
def test_default_run_learns_the_preferences_and_ends_on_its_pages_line(tmp_path):
    """`python dpo.py` as it comes ends on the line docs/dpo.md renders (conftest.default_run): against its own frozen
    copy, the policy's implicit reward prefers the held-out chosen replies (accuracy above 0.65) by a margin that grows
    by more than 0.3."""
    out = default_run("dpo", "dpo: ", tmp_path)
    accuracy = float(out.split("eval reward accuracy ")[1].split(",")[0].split(" -> ")[1])
    first_margin, last_margin = (float(x) for x in out.split("margin ")[1].split(";")[0].split(" -> "))
    assert accuracy > 0.65 and last_margin > first_margin + 0.3, out[-600:]
    check_model_card(tmp_path / "outputs" / "dpo", "dpo", base="builtin:tiny-chat")


def test_dpo_bad_input(tmp_path, pairs_file):
    assert "no column ['answer']" in run_failing(
        [DPO, *RANDOM_MODEL, "--dataset-name", pairs_file, "--chosen-column", "answer"], tmp_path
    )
    assert "must be below max_length" in run_failing([DPO, *RANDOM_MODEL, "--max-prompt-length", "128"], tmp_path)
    assert "exceeds the model's context of 256" in run_failing([DPO, *RANDOM_MODEL, "--max-length", "300"], tmp_path)
    same = tmp_path / "same.jsonl"
    same.write_text("\n".join(json.dumps(dict(prompt="q", chosen="x", rejected="x")) for _ in range(10)))
    assert "no preference to learn" in run_failing([DPO, *RANDOM_MODEL, "--dataset-name", str(same)], tmp_path)


def test_long_prompts_are_cut_for_sample_generation(tmp_path):
    """Prompts of ~300 tokens (the tiny model's context is 256): training keeps max_prompt_length of them, and so
    must --generate-during-eval, or the position embeddings run out."""
    rows = [dict(prompt="word " * 300 + f"question {i}?", chosen=" good answer", rejected=" bad answer") for i in range(24)]
    (tmp_path / "long.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = run_script(
        [
            DPO,
            *RANDOM_MODEL,
            "--dataset-name",
            str(tmp_path / "long.jsonl"),
            "--batch-size",
            "4",
            "--max-steps",
            "1",
            "--eval-fraction",
            "0.2",
            "--generate-during-eval",
        ],
        tmp_path,
    )
    assert "dpo: 1 steps" in out and "question" in out  # the sample table shows the prompts' ends
