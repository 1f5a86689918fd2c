import math
import os

import pytest
import torch
from conftest import ROOT, check_model_card, read_scalars, run_failing, run_script
from transformers import AutoModelForCausalLM

from common.core import UsageError
from common.loading import load_pretrained
from gkd import generalized_jsd_loss, reverse_kl_pg_loss

GKD = os.path.join(ROOT, "gkd.py")
SIZES = ["--max-new-tokens", "8", "--batch-size", "8", "--eval-samples", "16", "--eval-size", "16", "--train-size", "200"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    """gkd.py's tiny setting: a random student of builtin:tiny-gpt2's sizes on builtin:tiny-arith's tokenizer, saved in a
    folder, and builtin:tiny-arith, which knows the task, as its teacher."""
    import presets
    from common.loading import load_tokenizer

    folder = str(tmp_path_factory.mktemp("tiny-student"))
    tokenizer = load_tokenizer("builtin:tiny-arith")
    special = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = presets.random_model(
        "builtin:tiny-gpt2", AutoModelForCausalLM, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **special
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return ["--model-name", folder, "--teacher-name", "builtin:tiny-arith", *SIZES, "--log-freq", "100"]


def by_hand(student: list[float], teacher: list[float], beta: float) -> float:
    """The generalized JSD of one token, one probability at a time: beta KL(T || M) + (1 - beta) KL(S || M) with
    M = (1 - beta) S + beta T; beta 0 is KL(T || S), beta 1 KL(S || T)."""
    s = [math.exp(x) / sum(math.exp(y) for y in student) for x in student]
    t = [math.exp(x) / sum(math.exp(y) for y in teacher) for x in teacher]
    if beta == 0:
        return sum(ti * math.log(ti / si) for si, ti in zip(s, t))
    if beta == 1:
        return sum(si * math.log(si / ti) for si, ti in zip(s, t))
    m = [(1 - beta) * si + beta * ti for si, ti in zip(s, t)]
    return beta * sum(ti * math.log(ti / mi) for ti, mi in zip(t, m)) + (1 - beta) * sum(
        si * math.log(si / mi) for si, mi in zip(s, m)
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.9])
def test_generalized_jsd_by_hand_with_masked_prompt_and_padding(beta):
    student = torch.tensor(
        [[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0], [3.0, 0.0, 0.0]], [[0.0, 2.0, 0.0], [9.0, -9.0, 0.0], [0.0, 0.0, 0.0]]]
    )
    teacher = torch.tensor(
        [[[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]], [[1.0, 1.0, 1.0], [-9.0, 9.0, 0.0], [1.0, 2.0, 3.0]]]
    )
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])  # row 1: a prompt position first; row 2: padding after one token
    counted = [(0, 1), (0, 2), (1, 0)]
    expected = sum(by_hand(student[b, t].tolist(), teacher[b, t].tolist(), beta) for b, t in counted) / 3
    assert generalized_jsd_loss(student, teacher, mask, beta).item() == pytest.approx(expected, rel=1e-5)
    # the temperature divides both distributions' logits
    expected_t2 = sum(by_hand((student[b, t] / 2).tolist(), (teacher[b, t] / 2).tolist(), beta) for b, t in counted) / 3
    assert generalized_jsd_loss(student, teacher, mask, beta, temperature=2.0).item() == pytest.approx(expected_t2, rel=1e-5)
    # the masked positions hold extreme logits: changing them changes nothing
    student[1, 1] = torch.tensor([-50.0, 50.0, 0.0])
    assert generalized_jsd_loss(student, teacher, mask, beta).item() == pytest.approx(expected, rel=1e-5)


def test_generalized_jsd_is_zero_for_equal_distributions_and_its_gradient_pulls_towards_the_teacher():
    logits = torch.randn(2, 4, 7)
    assert generalized_jsd_loss(logits, logits, torch.ones(2, 4)).item() == pytest.approx(0.0, abs=1e-6)
    student = torch.zeros(1, 1, 3, requires_grad=True)
    teacher = torch.tensor([[[3.0, 0.0, 0.0]]])
    generalized_jsd_loss(student, teacher, torch.ones(1, 1), beta=0.5).backward()
    assert student.grad[0, 0, 0] < 0 < student.grad[0, 0, 1]  # descent raises the teacher's likely token


def test_reverse_kl_policy_gradient():
    student = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last token is padding
    loss, mean_advantage = reverse_kl_pg_loss(student, teacher, mask)
    advantages = [0.5, -1.0]  # log p_teacher - log p_student
    assert loss.item() == pytest.approx(-(0.5 * -1.0 + -1.0 * -2.0) / 2) and mean_advantage.item() == pytest.approx(-0.25)
    loss.backward()  # the advantage is a constant: d loss / d log p_student = -A / tokens
    assert student.grad[0].tolist() == pytest.approx([-advantages[0] / 2, -advantages[1] / 2, 0.0])


def test_gkd_runs_saves_and_refuses_mismatched_vocabularies(tmp_path, chat_llama, tiny):
    out = run_script([GKD, *tiny, "--total-steps", "4", "--lmbda", "0.5", "--beta", "0.9", "--seq-kd"], tmp_path)
    assert "gkd: 4 steps" in out and "held-out accuracy: student" in out and "held-out KL to the teacher per token" in out
    on_policy = read_scalars(str(tmp_path / "runs"), "train/on_policy")
    assert len(on_policy) == 4 and 0 < sum(on_policy) < 4  # lmbda 0.5: some batches the student's, some the teacher's
    # the KL to the teacher is a divergence on every batch: on the teacher's tokens the log-ratio of the sampled token
    # (the old metric) gave -15.3 on the first of these batches
    kl = read_scalars(str(tmp_path / "runs"), "train/kl_to_teacher")
    assert len(kl) == 4 and min(kl) > 0, kl
    check_model_card(tmp_path / "outputs" / "gkd", "gkd", base=tiny[1])
    thinking = ["--chat-template-kwargs", '{"enable_thinking": false}']  # TRL's chat_template_kwargs, as grpo.py's
    run_script([GKD, *tiny, "--total-steps", "2", "--objective", "reverse_kl_pg", "--output-dir", "pg", *thinking], tmp_path)
    assert "--chat-template-kwargs '[1]': give a JSON object" in run_failing(
        [GKD, *tiny, "--chat-template-kwargs", "[1]"], tmp_path
    )
    assert "different vocabularies" in run_failing(
        [GKD, *tiny, "--teacher-name", chat_llama, "--overwrite"], tmp_path
    )  # GPT-2's whole vocabulary
    assert "needs --lmbda 1" in run_failing(
        [GKD, *tiny, "--objective", "reverse_kl_pg", "--lmbda", "0.5", "--overwrite"], tmp_path
    )


@pytest.mark.slow
def test_gradient_checkpointing_trains_the_same_and_the_teacher_takes_its_options(tmp_path, tiny):
    """--gradient-checkpointing recomputes the student's activations: the same weights as without (to float rounding);
    --teacher-model-init-kwargs reaches the teacher's from_pretrained (TRL's teacher_model_init_kwargs), and anything
    but a JSON object is one line before anything loads."""
    from safetensors.torch import load_file

    from gkd import Args, check, teacher_options

    flags = [GKD, *tiny, "--total-steps", "3", "--lmbda", "0.5"]
    run_script([*flags, "--output-dir", "plain", "--log-dir", "plain_runs"], tmp_path)
    run_script([*flags, "--gradient-checkpointing", "--output-dir", "ckpt", "--log-dir", "ckpt_runs"], tmp_path)
    plain, ckpt = (load_file(tmp_path / d / "model.safetensors") for d in ("plain", "ckpt"))
    assert all(torch.allclose(plain[k], ckpt[k], atol=1e-6) for k in plain)
    start = load_pretrained(tiny[1], AutoModelForCausalLM).state_dict()  # the student as loaded
    assert any(not torch.allclose(plain[k], start[k], atol=1e-4) for k in plain if k in start)  # it trained
    options = teacher_options(Args(teacher_model_init_kwargs='{"dtype": "bfloat16"}'))
    teacher = load_pretrained("builtin:tiny-arith", AutoModelForCausalLM, **options)
    assert options == {"dtype": "bfloat16"} and next(teacher.parameters()).dtype == torch.bfloat16
    assert teacher_options(Args()) == {"dtype": "auto"}
    with pytest.raises(UsageError, match="--teacher-model-init-kwargs '\\[1\\]': give a JSON object"):
        check(Args(teacher_model_init_kwargs="[1]"))


def test_top_k_and_top_p_reach_the_sampler():
    """gkd.py's --top-k, --top-p and --min-p are the sampler's: with --top-k 1 (or --min-p 1) every seed draws the
    greedy completion, and a --top-p outside (0, 1] (a --min-p outside [0, 1]) is one line."""
    from accelerate import Accelerator

    from common.loading import load_pretrained, load_tokenizer
    from common.sampling import Sampler
    from gkd import Args, check

    tokenizer = load_tokenizer("builtin:tiny-arith", padding_side="left")
    model = load_pretrained("builtin:tiny-arith", AutoModelForCausalLM).eval()
    batch = tokenizer(["3 + 4 =", "12 + 5 ="], padding=True, return_tensors="pt")
    sampler, inputs = Sampler(Args(top_k=1), tokenizer, model, Accelerator(cpu=True), 64), (*batch.values(), 6)
    draws = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        draws.append(sampler.generate(*inputs)[:2])
    (completions, mask), (again, _) = draws
    greedy = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    greedy = greedy[:, batch["input_ids"].shape[1] :][:, : completions.shape[1]]
    assert torch.equal(completions, again) and torch.equal(completions[mask.bool()], greedy[mask.bool()])
    torch.manual_seed(2)  # --min-p 1 keeps only the most likely token too
    completions, mask = Sampler(Args(min_p=1.0), tokenizer, model, Accelerator(cpu=True), 64).generate(*inputs)[:2]
    assert torch.equal(completions[mask.bool()], greedy[:, : completions.shape[1]][mask.bool()])
    with pytest.raises(UsageError, match="--top-p 0.0: it lies in"):
        check(Args(top_p=0.0))
    with pytest.raises(UsageError, match="--min-p 2.0: it lies in"):
        check(Args(min_p=2.0))


@pytest.mark.slow
def test_gkd_student_moves_towards_a_fixed_teacher(tmp_path, tiny):
    """On-policy GKD pulls a random tiny student towards builtin:tiny-arith: the per-token KL to the teacher on the
    student's own samples falls by more than half in 45 steps. Forward KL (beta 0): between distributions this far apart
    the JSD sits at its ceiling ln 2 and its gradient vanishes (the README's note)."""
    flags = ["--total-steps", "45", "--beta", "0", "--learning-rate", "3e-3", "--eval-freq", "0"]
    run_script([GKD, *tiny, *flags], tmp_path)
    kl = read_scalars(str(tmp_path / "runs"), "train/kl_to_teacher")
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert last < 0.5 * first, (first, last)
