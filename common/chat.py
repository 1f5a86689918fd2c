"""Chat-formatted data, TRL 1.x's conversational format: a prompt, an answer or a whole conversation as a list of
messages, [{"role": "user", "content": ...}, ...], rendered with the tokenizer's chat template.

A rendered answer continues its rendered prompt exactly: the tokens of prompt + answer are the prompt's tokens followed
by the answer's, and the answer ends with the template's end-of-turn token (its EOS), which is trained and scored like
any other answer token. Plain-string prompts are rendered too, as one user message, when the tokenizer has a template
(--no-chat-template sends them as raw text, as TRL does with string data).
"""

import contextlib
import functools
import json
import re
from itertools import takewhile

from common.core import UsageError, error_line, warn_once


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


# ================================ tool calls in chat templates ================================
# ChatML with Hermes-style tool calls (Qwen2.5's form): the tool schemas in the system message, calls as JSON in
# <tool_call> tags, consecutive tool results as <tool_response> blocks of one user turn. For templates without tools.
TOOL_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful AI assistant.' %}{%- set rest = messages %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\nYou can call functions. Their JSON schemas are within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, write its name and arguments as JSON within <tool_call></tool_call> tags:' }}
{{- '\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + arguments + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def supports_tools(tokenizer) -> bool:
    """Whether the chat template renders tool schemas, tool calls and tool results (TRL's `supports_tool_calling`)."""
    schema = {"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {}}}
    call = {"type": "function", "function": {"name": "probe_call", "arguments": {"x": 1}}}
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "probe_call", "content": "probe_result"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
        return False
    return all(s in text for s in ("probe_tool", "probe_call", "probe_result"))


def use_tool_template(tokenizer, path: str | None) -> str:
    """Set the template that renders the episodes: --chat-template-path's Jinja file, the tokenizer's own when it supports
    tools, else TOOL_TEMPLATE for a ChatML tokenizer (EOS <|im_end|>). Returns which, with its call format, for the run's
    log; a template whose calls cannot be read back is a one-line error (`tool_call_format`)."""
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                tokenizer.chat_template = file.read()
        except OSError as error:
            raise UsageError(f"--chat-template-path {path}: {error.strerror}.") from None
        which = path
    elif supports_tools(tokenizer):
        which = "the tokenizer's own"
    elif tokenizer.eos_token == "<|im_end|>":
        tokenizer.chat_template, which = TOOL_TEMPLATE, "ChatML with <tool_call> tags (common.chat.TOOL_TEMPLATE)"
    else:
        raise UsageError(
            f"the chat template of {tokenizer.name_or_path!r} cannot render tool calls: give --chat-template-path a "
            "Jinja template that does (common.chat.TOOL_TEMPLATE is one for ChatML models)"
        )
    if not supports_tools(tokenizer):
        raise UsageError(f"--chat-template-path {path}: the template does not render tools, tool calls and tool results.")
    return f"{which}, {tool_call_format(tokenizer).name} tool calls"


# ================================ the tool-call format of a template family ================================
class ToolCallFormat:
    """How one chat-template family writes tool calls into the model's turn. `parse(text)` returns the turn's text
    without its calls, and its calls: {"name", "arguments"} each, or {"error": why} for one that cannot be run."""

    name = "?"

    def parse(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    @staticmethod
    def call(name, arguments, closed: bool = True) -> dict:
        """A parsed call, or {"error": why} when it is not {"name": <function-name>, "arguments": <object>}."""
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not closed:
            return {"error": "the tool call has no closing </tool_call> tag"}
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return {"error": 'a tool call is {"name": <function-name>, "arguments": <args-json-object>}'}
        return {"name": name, "arguments": arguments}


class HermesFormat(ToolCallFormat):
    """Hermes / Qwen2.5 / TOOL_TEMPLATE: any number of <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks
    anywhere in the turn."""

    name = "hermes"
    TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        calls = []
        for match in self.TAG.finditer(text):
            body = match.group(1).strip()
            try:
                call = json.loads(body)
            except json.JSONDecodeError as error:
                calls.append({"error": f"the tool call is not JSON ({error.msg}): {body[:80]!r}"})
                continue
            call = call if isinstance(call, dict) else {}
            calls.append(self.call(call.get("name"), call.get("arguments", {}), match.group(0).endswith("</tool_call>")))
        return self.TAG.sub("", text).strip(), calls


class JsonFormat(ToolCallFormat):
    """Llama 3.1 / 3.2: a turn that is a call is one JSON object {"name": ..., "parameters": {...}} ("arguments" read
    too), after an optional <|python_tag|>; any other turn is text."""

    name = "llama3_json"

    def parse(self, text: str) -> tuple[str, list[dict]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text.strip(), []
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            if '"name"' not in body:  # text that happens to open with a brace
                return text.strip(), []
            return "", [{"error": f"the tool call is not JSON ({error.msg}): {body[:80]!r}"}]
        if not isinstance(call, dict) or "name" not in call:
            return text.strip(), []
        return "", [self.call(call["name"], call.get("parameters", call.get("arguments", {})))]


FORMATS = (HermesFormat(), JsonFormat())


def tool_call_format(tokenizer) -> ToolCallFormat:
    """The format in which the tokenizer's chat template writes a tool call: a probe call is rendered into an assistant
    turn and each known format parses it back; the first that reads exactly the probe call is the template's. A
    template none can read is a one-line error (the episodes would silently find no call)."""
    probe = {"name": "probe_call", "arguments": {"x": 1}}
    messages = [{"role": "user", "content": "u"}]
    assistant = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": probe}]}
    schema = [{"type": "function", "function": {"name": "probe_call", "description": "d", "parameters": {}}}]
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=schema, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages + [assistant], tools=schema, tokenize=False)
    except Exception as error:  # noqa: BLE001 - whatever the template raises
        raise UsageError(f"the chat template cannot render a tool call ({error_line(error)})") from None
    turn = full[len(prompt) :] if full.startswith(prompt) else full
    turn = turn.split(tokenizer.eos_token)[0] if tokenizer.eos_token else turn
    for form in FORMATS:
        if form.parse(turn)[1] == [probe]:
            return form
    raise UsageError(
        f"the chat template writes tool calls in a form this codebase cannot read ({turn.strip()[:80]!r}); known forms: "
        f"{', '.join(f.name for f in FORMATS)} (common/tools.py: add a ToolCallFormat, or pass --chat-template-path)"
    )
