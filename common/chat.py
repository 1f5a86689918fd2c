"""Chat-formatted data, TRL 1.x's conversational format: a prompt, an answer or a whole conversation as a list of
messages, [{"role": "user", "content": ...}, ...], rendered with the tokenizer's chat template.

A rendered answer continues its rendered prompt exactly: the tokens of prompt + answer are the prompt's tokens followed
by the answer's, and the answer ends with the template's end-of-turn token (its EOS), which is trained and scored like
any other answer token. Plain-string prompts are rendered too, as one user message, when the tokenizer has a template
(--no-chat-template sends them as raw text, as TRL does with string data).
"""

import functools
from itertools import takewhile

from common.core import UsageError, warn_once


def is_conversation(value) -> bool:
    """A list of chat messages, [{"role": ..., "content": ...}, ...] (TRL's conversational format)."""
    return (
        isinstance(value, list) and bool(value) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value)
    )


def text_of(completion) -> str:
    """A prompt's or completion's text, whether it comes as text or as messages (the last message's content)."""
    return completion[-1]["content"] if is_conversation(completion) else completion


def use_chat(tokenizer, chat_template: bool, example, system_prompt: str | None = None) -> bool:
    """Whether to render `example` (a prompt, or a row's values) with the chat template: messages always, strings when
    `chat_template` and the tokenizer has one. Messages without a template are a one-line error naming the fix; a
    `system_prompt` that raw text would never carry is a warning."""
    values = example if isinstance(example, (list, tuple)) and not is_conversation(example) else [example]
    messages = any(is_conversation(v) for v in values)
    if messages and not tokenizer.chat_template:
        raise UsageError(
            f"the data holds chat messages, but the tokenizer of {tokenizer.name_or_path!r} has no chat template: use an "
            "instruct model, set tokenizer.chat_template and save the tokenizer beside the model, or render the "
            "messages into text first"
        )
    chat = messages or (chat_template and bool(tokenizer.chat_template))
    if system_prompt and not chat:
        warn_once("--system-prompt has no effect: the prompts go to the model as raw text (no chat template to render it)")
    return chat


ROLES = ("system", "user", "assistant", "tool")


def check_roles(conversations) -> None:
    """A warning naming the roles a chat template may not know (it may drop those messages, or fail on them)."""
    unknown = sorted({m["role"] for messages in conversations for m in messages} - set(ROLES))
    if unknown:
        warn_once(
            f"unknown chat roles {unknown} in the data (known: {', '.join(ROLES)}): the template may drop or refuse them"
        )


def as_messages(value, role: str = "user", system_prompt: str | None = None) -> list[dict]:
    """A prompt or answer as messages: a string is one message of `role`; a system prompt goes first unless there is one."""
    messages = value if is_conversation(value) else [{"role": role, "content": value}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def render(tokenizer, prompt, answer=None, system_prompt: str | None = None, tools=None) -> tuple[str, str | None]:
    """The rendered prompt (ending with the generation prompt) and the answer that continues it, up to and including the
    end-of-turn token (EOS appended where the template ends the turn with another token), with the `tools` schemas. As
    TRL, the prompt is the common prefix of the prompt rendered alone and with the answer (templates may drop reasoning)."""
    messages = as_messages(prompt, "user", system_prompt)
    prompt_text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    if answer is None:
        return prompt_text, None
    full = tokenizer.apply_chat_template(messages + as_messages(answer, "assistant"), tools=tools, tokenize=False)
    prompt_text = "".join(a for a, _ in takewhile(lambda pair: pair[0] == pair[1], zip(prompt_text, full)))
    answer_text = full[len(prompt_text) :].rstrip()  # the newline after the end-of-turn token is not generated
    if tokenizer.eos_token and not answer_text.endswith(tokenizer.eos_token):
        answer_text += tokenizer.eos_token
    return prompt_text, answer_text


def bind_template_kwargs(tokenizer, kwargs: dict | None):
    """`tokenizer` whose every later `apply_chat_template` (prompts, tool turns) gets `kwargs`: TRL's
    chat_template_kwargs, e.g. {"enable_thinking": false} for Qwen3's template. Returns the tokenizer."""
    if kwargs:
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **kwargs)
    return tokenizer
