import json
import math
import os
import random
import warnings

import pytest
import torch
from conftest import ROOT, check_model_card, check_resume, default_run, read_scalars, require, run_failing, run_script
from transformers import AutoModelForCausalLM

from common.loading import load_pretrained, load_tokenizer
from sft import completion_only_labels, model_inputs, neftune_hook, pack_bfd, pack_sequences, token_loss

SFT = os.path.join(ROOT, "sft.py")


def test_bfd_packing_places_examples_as_trls_pack_dataset():
    """--packing-strategy bfd against TRL 1.16's pack_dataset(strategy="bfd") on examples of many lengths, ties among
    them: the same rows, each the same examples in the same order, positions restarting at each example (TRL's
    seq_lengths); each example's labels kept but its first (nothing is predicted across examples)."""
    datasets, trl = require("datasets"), require("trl")
    rng = random.Random(0)
    examples = []
    for n in [rng.randint(1, 16) for _ in range(60)] + [16, 5, 5, 5, 11, 11]:
        ids = [rng.randint(1, 999) for _ in range(n)]
        examples.append(dict(input_ids=ids, labels=[-100] * (n // 3) + ids[n // 3 :]))
    rows = pack_bfd(examples, 16)
    theirs = trl.pack_dataset(datasets.Dataset.from_list(examples), 16, strategy="bfd")[:]
    assert [r["input_ids"] for r in rows] == theirs["input_ids"] and len(rows) < len(examples)
    starts = [[i for i, p in enumerate(r["position_ids"]) if p == 0] for r in rows]
    assert [[b - a for a, b in zip(s, s[1:] + [len(r["input_ids"])])] for s, r in zip(starts, rows)] == theirs["seq_lengths"]
    for row, labels, s in zip(rows, theirs["labels"], starts):
        assert row["labels"] == [-100 if i in s[1:] else label for i, label in enumerate(labels)]
        assert row["position_ids"] == [i - max(a for a in s if a <= i) for i in range(len(row["input_ids"]))]


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_bfd_rows_attend_within_each_example(architecture):
    """A packed row's forward (position ids, no mask: transformers attends within each example) gives each example the
    log-probs of its own forward, for GPT-2 and Llama (SmolLM2's architecture): packing changes no gradient."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if architecture == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))
    else:
        config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        config.num_key_value_heads = 2
        model = LlamaForCausalLM(config)
    model.eval()
    examples = [dict(input_ids=ids, labels=ids) for ids in ([5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18])]
    rows = pack_bfd(examples, 8)
    assert [len(r["input_ids"]) for r in rows] == [8, 6]  # 5 + 3 (the best fit) and 4 + 2
    for row in rows:
        batch = {k: torch.tensor([v]) for k, v in row.items()}
        packed = model(**model_inputs(batch)).logits[0].log_softmax(-1)
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            alone = model(input_ids=torch.tensor([row["input_ids"][a:b]])).logits[0].log_softmax(-1)
            torch.testing.assert_close(packed[a:b], alone, rtol=1e-5, atol=1e-5)
        mixed = model(input_ids=batch["input_ids"]).logits[0].log_softmax(-1)  # one causal mask over the row
        assert not torch.allclose(mixed[starts[1] :], packed[starts[1] :], atol=1e-3)


def test_packing_gives_full_blocks_with_eos_separators():
    blocks = pack_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_length=4, eos_token_id=0)
    # stream: 1 2 3 0 4 5 0 6 7 8 9 0 -> three full blocks, nothing left over
    assert blocks == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert pack_sequences([[1, 2, 3], [4]], seq_length=4, eos_token_id=0) == [[1, 2, 3, 0]]  # tail "4 0" dropped


def test_completion_only_labels_mask_exactly_the_prompt():
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    template = tokenizer("\nAnswer:", add_special_tokens=False)["input_ids"]
    prompt = tokenizer("What is AI?\nAnswer:")["input_ids"]
    ids = prompt + tokenizer(" A field of science.")["input_ids"]
    labels = completion_only_labels(ids, template)
    assert labels[: len(prompt)] == [-100] * len(prompt)
    assert labels[len(prompt) :] == ids[len(prompt) :] and -100 not in labels[len(prompt) :]
    assert completion_only_labels([1, 2, 3], [7, 8]) is None


def test_neftune_noise_scale_and_train_only():
    embedding = torch.nn.Embedding(10, 8)
    embedding.register_forward_hook(neftune_hook(alpha=5.0))
    ids = torch.arange(6)[None]
    clean = embedding.weight[ids]
    noise = embedding(ids) - clean
    bound = 5.0 / math.sqrt(6 * 8)
    assert noise.abs().max() <= bound + 1e-6 and noise.abs().max() > bound / 2
    embedding.eval()
    assert torch.equal(embedding(ids), clean)


@pytest.mark.slow
def test_default_run_learns_saves_a_loadable_model_and_ends_on_its_pages_line(tmp_path):
    """`python sft.py` as it comes ends on the line docs/sft.md renders (conftest.default_run), its held-out loss falls
    by more than 3 nats from the random tiny GPT-2's, and the model it saves loads with plain transformers."""
    out = default_run("sft", "sft: ", tmp_path)
    first, last = [float(x) for x in out.split("eval loss ")[1].split(" (")[0].split(" -> ")]
    assert last < first - 3.0, out[-500:]  # random init; the dialogue is learnable
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "sft")
    assert model.config.n_layer == 2 and (tmp_path / "outputs" / "sft" / "tokenizer.json").exists()
    check_model_card(tmp_path / "outputs" / "sft", "sft")


@pytest.mark.slow
def test_dft_loss_by_hand_and_by_trls_formula():
    """DFT (TRL 1.16 SFTTrainer.compute_loss: per_token_loss = -log_probs * log_probs.exp().detach(), summed over the
    labelled tokens and divided by their count): each token's NLL weighted by its probability, and the gradient with
    respect to a token's log-prob is -p / N, where the NLL's is -1 / N."""
    logprobs = torch.tensor([[-0.1, -2.0, -0.7], [-1.5, -0.3, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    p = [[math.exp(-0.1), math.exp(-2.0), math.exp(-0.7)], [math.exp(-1.5), math.exp(-0.3), 0.0]]
    by_hand = (0.1 * p[0][0] + 2.0 * p[0][1] + 0.7 * p[0][2] + 1.5 * p[1][0] + 0.3 * p[1][1]) / 5
    trl = (-logprobs * logprobs.exp().detach() * mask).sum() / mask.sum()  # TRL's two lines, on our masked layout
    loss = token_loss(logprobs, mask, "dft")
    assert loss.item() == pytest.approx(by_hand) and loss.item() == pytest.approx(trl.item())
    loss.backward()
    expected = [-p[0][0] / 5, -p[0][1] / 5, -p[0][2] / 5, -p[1][0] / 5, -p[1][1] / 5, 0.0]
    assert logprobs.grad.flatten().tolist() == pytest.approx(expected)
    assert token_loss(logprobs, mask, "nll").item() == pytest.approx((0.1 + 2.0 + 0.7 + 1.5 + 0.3) / 5)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_chunked_loss_is_the_models_own_loss(tmp_path, loss_type):
    """The chunked LM head and the model's full logits train the same run, for either loss; DFT's loss is not NLL's."""
    losses = {}
    for flag in ("--chunked-loss", "--no-chunked-loss"):  # same seed, same dropout draws: the same training run
        run_script(
            [
                SFT,
                flag,
                "--loss-type",
                loss_type,
                "--overwrite",
                "--max-steps",
                "3",
                "--eval-steps",
                "2",
                "--max-seq-length",
                "32",
                "--num-sample-generations",
                "0",
                "--eval-fraction",
                "0.01",
                "--log-dir",
                str(tmp_path / flag),
            ],
            tmp_path,
        )
        losses[flag] = [read_scalars(str(tmp_path / flag), tag) for tag in ("train/loss", "eval/loss")]
    assert len(losses["--chunked-loss"][0]) == 3 and len(losses["--chunked-loss"][1]) == 3
    for chunked, full in zip(losses["--chunked-loss"], losses["--no-chunked-loss"]):
        assert chunked == pytest.approx(full, rel=1e-4)
    if loss_type == "dft":  # each token's NLL weighted by a probability below 1: a smaller loss than the eval NLL
        assert losses["--chunked-loss"][0][0] < losses["--chunked-loss"][1][0] / 2, losses


@pytest.mark.slow
def test_sft_options_run(tmp_path):
    """Packing, LoRA, NEFTune and gradient checkpointing together; the LoRA run prints none of peft's warnings about a
    GPT-2 model or a built-in (a deprecated attribute, the Conv1D layout, a hub config it cannot find)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, also one an earlier test in this process already showed
        run_script(
            [SFT, "--max-steps", "3", "--packing", "--packing-strategy", "wrapped", "--max-seq-length", "32"]
            + ["--use-peft", "--lora-r", "4"]
            + ["--neftune-noise-alpha", "5", "--gradient-checkpointing", "--save-steps", "2"]
            + ["--num-sample-generations", "0"],
            tmp_path,
        )
    assert not [f"{w.filename}: {w.message}" for w in caught if "site-packages" in w.filename]
    assert (tmp_path / "outputs" / "sft_checkpoints" / "step_2" / "adapter_model.safetensors").exists()  # LoRA: the adapter
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "sft")  # LoRA merged
    assert not any("lora" in n for n, _ in model.named_parameters())
    run_script(
        [SFT, "--max-steps", "3", "--prompt-column", "prompt", "--completion-column", "completion", "--overwrite"]
        + ["--packing"],  # bfd: a completion-only loss in packed rows
        tmp_path,
    )


@pytest.mark.slow
def test_a_bf16_checkpoint_trains_in_float32_unless_asked(tmp_path):
    """--model-name of a bf16 checkpoint (most hub models): the run loads and saves float32 weights (TRL's default, where
    transformers 5 alone would keep bf16 and Adam's updates would round away); --dtype bfloat16 keeps bf16."""
    from safetensors.torch import load_file

    load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    load_tokenizer("builtin:tiny-gpt2").save_pretrained(tmp_path / "bf16")
    for flags, dtype in [([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16)]:
        out = tmp_path / f"out_{dtype}"
        run_script(
            [SFT, "--model-name", str(tmp_path / "bf16"), "--max-steps", "2", "--num-sample-generations", "0"]
            + ["--eval-fraction", "0.01", "--output-dir", str(out), *flags],
            tmp_path,
        )
        assert {w.dtype for w in load_file(out / "model.safetensors").values()} == {dtype}


@pytest.mark.slow
def test_regionally_compiled_runs_save_plain_models(tmp_path):
    """accelerate's regional compilation (`--dynamo_backend` with use_regional_compilation) wraps each submodule of the
    prepared model in torch.compile, whose state dicts name every weight `..._orig_mod...`; the checkpoint and the final
    model are saved from the model beneath, so both load with plain from_pretrained, equal to the uncompiled run's
    weights (dynamo's eager backend runs the same kernels)."""
    from safetensors.torch import load_file

    flags = ["--max-steps", "2", "--save-steps", "2", "--num-sample-generations", "0", "--eval-steps", "1000"]
    flags += ["--eval-fraction", "0.01"]
    compiled = dict(ACCELERATE_DYNAMO_BACKEND="eager", ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION="true")
    for name, env in [("plain", {}), ("compiled", compiled)]:
        run_script([SFT, *flags, "--output-dir", str(tmp_path / name)], tmp_path, **env)
    plain, trained = (
        load_file(tmp_path / "plain" / "model.safetensors"),
        load_file(tmp_path / "compiled" / "model.safetensors"),
    )
    assert trained.keys() == plain.keys() and not any("_orig_mod" in k for k in trained)
    assert all(torch.equal(trained[k], plain[k]) for k in plain)
    checkpoint = load_file(tmp_path / "compiled_checkpoints" / "step_2" / "model.safetensors")
    assert all(torch.equal(checkpoint[k], plain[k]) for k in plain)
    AutoModelForCausalLM.from_pretrained(tmp_path / "compiled")


@pytest.mark.slow
def test_resume_continues_where_it_stopped(tmp_path):
    """4 steps straight == 3 steps, checkpoint, resume for 1 more (same weights, bit for bit), across an epoch's
    reshuffle and gradient accumulation; the checkpoint also loads with plain from_pretrained."""
    rows = [dict(text=f"Question {i}? An answer of {i} words.") for i in range(20)]
    (tmp_path / "texts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    common = [
        SFT,
        "--dataset-name",
        str(tmp_path / "texts.jsonl"),
        "--eval-fraction",
        "0.2",
        "--batch-size",
        "4",
        "--gradient-accumulation-steps",
        "2",
        "--max-steps",
        "4",
        "--num-sample-generations",
        "0",
    ]  # 2 steps/epoch
    out, checkpoint = check_resume(common, ["--save-steps", "3"], "step_3", r" steps in .*?(eval [^;]*);", tmp_path)
    assert "sft: 1 steps" in out and AutoModelForCausalLM.from_pretrained(checkpoint).config.n_layer == 2
    assert "raise --max-steps" in run_failing([*common, "--max-steps", "3", "--resume-from", checkpoint], tmp_path)
    assert "not a checkpoint folder" in run_failing([*common, "--resume-from", str(tmp_path / "straight")], tmp_path)


def test_sft_bad_input_is_a_clear_error(tmp_path):
    assert "no column ['body']" in run_failing([SFT, "--text-column", "body"], tmp_path)
    assert "needs a CUDA GPU and bitsandbytes" in run_failing(
        [SFT, "--model-name", "gpt2", "--load-in-8bit", "--use-peft"], tmp_path
    )
    assert "exceeds the model's context of 256" in run_failing([SFT, "--max-seq-length", "1000"], tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    assert "is empty" in run_failing([SFT, "--dataset-name", str(tmp_path / "empty.jsonl")], tmp_path)
    assert not (tmp_path / "runs").exists()  # the logger opens its folder on first use: bad input leaves none behind


def test_long_prompts_are_cut_for_sample_generation(tmp_path):
    """Half the prompts are ~300 tokens (the tiny model's context is 256): they leave no completion in
    max_seq_length and are dropped from training, and the sample generations at the end keep their last tokens."""
    rows = [dict(prompt=("word " * 300 if i % 2 else "") + f"question {i}?", completion=" fine thanks") for i in range(40)]
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = run_script(
        [
            SFT,
            "--dataset-name",
            str(tmp_path / "mixed.jsonl"),
            "--prompt-column",
            "prompt",
            "--completion-column",
            "completion",
            "--max-steps",
            "1",
            "--batch-size",
            "4",
            "--max-seq-length",
            "256",
            "--eval-fraction",
            "0.2",
            "--num-sample-generations",
            "8",
        ],
        tmp_path,
    )
    assert "training examples dropped" in out and "sft: 1 steps" in out


def test_chat_messages_are_rendered_with_the_chat_template(tmp_path):
    """A `messages` column of TRL's conversational format goes through the tokenizer's chat template: with the
    assistant marker as response template, every example keeps a loss only if the rendering put the marker there."""
    model_dir = tmp_path / "chat-model"
    load_pretrained("builtin:tiny-gpt2", AutoModelForCausalLM).save_pretrained(model_dir)
    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    tokenizer.chat_template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(model_dir)
    rows = [
        {"messages": [{"role": "user", "content": f"How are you, {i}?"}, {"role": "assistant", "content": "Fine."}]}
        for i in range(40)
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    flags = [
        "--dataset-name",
        str(tmp_path / "chat.jsonl"),
        "--text-column",
        "messages",
        "--max-steps",
        "2",
        "--batch-size",
        "4",
        "--eval-fraction",
        "0.1",
    ]
    out = run_script([SFT, "--model-name", str(model_dir), *flags, "--response-template", "<|assistant|>"], tmp_path)
    assert "sft: 2 steps" in out and "dropped" not in out and "How are you" in out.split("samples")[-1]  # sample prompts
    assert "has no chat template" in run_failing([SFT, *flags, "--overwrite"], tmp_path)  # the built-in tokenizer has none


@pytest.mark.slow
def test_checkpoints_are_pruned_per_run_and_a_resume_says_what_changed(tmp_path):
    """--save-total-limit keeps the newest checkpoints of this run only: another run's in the same folder stay. A resume
    names the arguments that differ from the checkpoint's, and a checkpoint whose random state cannot be read is an
    error, not a resume that silently draws other numbers."""
    flags = [SFT, "--max-seq-length", "32", "--batch-size", "8", "--save-steps", "1", "--num-sample-generations", "0"]
    run_script([*flags, "--max-steps", "4"], tmp_path)  # run A: step_1 .. step_4
    flags.append("--overwrite")  # the later runs replace run A's model and write beside its checkpoints
    run_script([*flags, "--max-steps", "2", "--save-total-limit", "1", "--seed", "2"], tmp_path)  # run B: step_1, step_2
    folder = tmp_path / "outputs" / "sft_checkpoints"
    runs = {d.name: json.loads((d / "trainer_state.json").read_text())["run"] for d in folder.iterdir()}
    assert sorted(runs) == ["step_2", "step_3", "step_4"]  # B kept its newest; A's step_3 and step_4 stayed
    assert runs["step_2"] != runs["step_3"] == runs["step_4"]
    out = run_script(
        [*flags, "--max-steps", "5", "--resume-from", str(folder / "step_3"), "--learning-rate", "0.002"], tmp_path
    )
    assert (
        "resuming with arguments that differ from the checkpoint's: --learning-rate 0.001 -> 0.002, --max-steps 4 -> 5" in out
    )
    (folder / "step_4" / "accelerate_state" / "random_states_0.pkl").write_bytes(b"not a pickle")
    error = run_failing([*flags, "--max-steps", "5", "--resume-from", str(folder / "step_4")], tmp_path)
    assert "random state" in error and "cannot be read" in error
