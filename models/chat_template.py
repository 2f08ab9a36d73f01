"""Chat templates: a conversation rendered to prompt text with the model's Jinja template.

Rendering follows transformers' apply_chat_template(..., tokenize=False), so a prompt is the
same string a model was fine-tuned on: a jinja2 ImmutableSandboxedEnvironment (templates come
from checkpoints and are untrusted) with trim_blocks and lstrip_blocks, the loopcontrols
extension and `{% generation %}` blocks, and the helpers templates call: raise_exception,
tojson (json.dumps, not HTML-escaped) and strftime_now. Variables: messages,
add_generation_prompt, bos_token, eos_token, tools and documents (None), plus any extras.

Messages are validated first: a non-empty list of {"role", "content"} with role one of
ROLES and content a string or a list of {"type": "text", "text": ...} parts (joined with
newlines into one string); an assistant's content may be null or missing (a turn that only
calls tools, as OpenAI's types allow) and renders as "", since most templates concatenate it;
an assistant's tool_calls get their function arguments as objects (OpenAI sends JSON text;
templates write them with tojson). Every error is a ValueError. Whatever a template raises
(raise_exception, a Jinja error, a TypeError or KeyError from its expressions) is a
ChatTemplateError carrying the template's own words and, where the template was reading a
message when it failed, that message's index.

BOS: a template that writes bos_token itself (Llama 3's does) must not get a second BOS from
the tokenizer. `prompt_token_ids` encodes the rendered text without special tokens when it
already starts with bos_token, else with the tokenizer's defaults (as transformers and vLLM).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")
# Appended to the final message to find where it ends in the rendered text
# (continue_final_message), then cut off with everything after it.
_CONTINUE_TAG = "JPAGED_CONTINUE_FINAL_MESSAGE "


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked copies of messages, with list contents joined into one string.

    Raises:
      ValueError: not a non-empty list, or a message that is not a dict, lacks role or
        content, has an unknown role or a content of the wrong shape; the message names the
        index and field (messages[2].role ...).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: must be a non-empty list of {'role', 'content'} objects")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            # ValueError for every malformed request, so the API layer catches one type.
            raise ValueError(f"{where}: must be an object with 'role' and 'content'")  # noqa: TRY004
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        if "content" not in message and role != "assistant":
            raise ValueError(f"{where}.content: missing")
        copy = dict(message)
        copy["content"] = _content_text(
            message.get("content"), where, allow_none=role == "assistant"
        )
        if role == "assistant" and message.get("tool_calls") is not None:
            copy["tool_calls"] = _tool_calls(message["tool_calls"], where)
        checked.append(copy)
    return checked


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's tool calls, each function's arguments as an object: OpenAI sends them
    as JSON text and templates write them with tojson (as vLLM, which parses them too)."""
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where}.tool_calls: must be a list of tool calls")  # noqa: TRY004
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{at}.function: must be an object with a name and arguments")  # noqa: TRY004
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ValueError(f"{at}.function.arguments: not valid JSON") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{at}.function.arguments: must be a JSON object")  # noqa: TRY004
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _content_text(content: Any, where: str, *, allow_none: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None and allow_none:
        return ""  # an assistant turn that only calls tools: templates concatenate content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}.content: must be a string or a list of text parts")  # noqa: TRY004
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"{where}.content[{j}]: must be {{'type': 'text', 'text': ...}}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}].text: must be a string")  # noqa: TRY004
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(
    template: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """The prompt text for messages.

    Args:
      template: Jinja source (LoadedModel.chat_template).
      messages: see validate_messages.
      add_generation_prompt: end with the header of an assistant turn (the model answers).
      continue_final_message: leave the final (assistant) message open, without its
        end-of-turn tokens, so the model continues it; exclusive with add_generation_prompt.
      bos_token, eos_token: the texts the template may write (LoadedModel's).
      **extra: more template variables (tools, documents, enable_thinking, ...).

    Raises:
      ValueError: invalid messages or arguments; "chat template error: line N: ..." when
        the template is not valid Jinja.
      ChatTemplateError: the template raised while rendering (a ValueError).
    """
    chat = validate_messages(messages)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not final:
            raise ValueError(f"messages[{len(chat) - 1}].content: empty, nothing to continue")
        chat[-1]["content"] = final + _CONTINUE_TAG
    variables = {"tools": None, "documents": None, **extra}
    compiled = _compile(template)
    seen: list[int | None] = [None]  # the index of the message the template read last
    try:
        text = compiled.render(
            messages=[_Message(m, i, seen) for i, m in enumerate(chat)],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except jinja2.TemplateError as e:  # raise_exception's TemplateError, undefined, sandbox
        raise ChatTemplateError(e.message or type(e).__name__, seen[0]) from None
    # A template is code from a checkpoint: whatever its expressions raise (None + str, a
    # missing key, a bad filter argument) is the conversation's or the template's problem,
    # never the server's.
    except Exception as e:  # noqa: BLE001
        line = _template_line(e.__traceback__)
        where = f" (template line {line})" if line is not None else ""
        raise ChatTemplateError(f"{type(e).__name__}: {e}{where}", seen[0]) from None
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if tag not in text:
            raise ValueError(
                "continue_final_message: the chat template does not write the final message's "
                "content, so it cannot be left open"
            )
        at = text.rindex(tag)
        # A template that keeps the message verbatim keeps the tag's trailing space: cut right
        # before the tag. One that trims the message trimmed the tag's space too (and maybe the
        # message's own trailing whitespace): cut and strip, as transformers does.
        text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
    return text


class ChatTemplateError(ValueError):
    """What a chat template raised, in its own words; message_index names the message the
    template was reading when it failed (None before it read any). str(): "chat template
    error: ...", after "messages[i]: " when the index is known."""

    def __init__(self, detail: str, message_index: int | None = None) -> None:
        self.detail = detail
        self.message_index = message_index
        where = f"messages[{message_index}]: " if message_index is not None else ""
        super().__init__(f"{where}chat template error: {detail}")


class _Message(dict):
    """One message as the template sees it: a plain dict to the template (tojson, `in`,
    iteration), which records in `seen` that the template read a field of message `index`,
    so an error names the message being rendered."""

    __slots__ = ("_index", "_seen")

    def __init__(self, message: dict, index: int, seen: list) -> None:
        super().__init__(message)
        self._index = index
        self._seen = seen

    def __getitem__(self, key):
        self._seen[0] = self._index
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._seen[0] = self._index
        return super().get(key, default)


# Jinja names an object's type in its errors ("'dict object' has no attribute 'x'") by its
# class's module and name: a message stays a 'dict object' there.
_Message.__module__, _Message.__name__, _Message.__qualname__ = "builtins", "dict", "dict"


def _template_line(tb) -> int | None:
    """The template line an exception came from (Jinja rewrites tracebacks so that the
    template's frames carry its own line numbers), or None."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template error: line {e.lineno}: {e.message}") from None


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it for
    training masks): rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
        return call.set_lineno(lineno)

    def _body(self, caller):
        return caller()


def prompt_token_ids(tokenizer: Any, text: str, bos_token: str | None) -> list[int]:
    """Token ids of a rendered prompt, with BOS exactly once.

    A template that starts its text with bos_token already wrote the BOS, so the text is
    encoded with add_special_tokens=False (no second BOS from the post-processor, and no
    EOS either); any other text is encoded with the tokenizer's defaults, which add BOS when
    the model wants one.

    Args:
      tokenizer: a tokenizers.Tokenizer (LoadedModel.tokenizer) or anything with
        encode(text, add_special_tokens=...) returning ids or an Encoding.
      text: render_chat's output.
      bos_token: LoadedModel.bos_token.

    Returns:
      The prompt's token ids.
    """
    has_bos = bool(bos_token) and text.startswith(bos_token)
    encoded = tokenizer.encode(text, add_special_tokens=not has_bos)
    return list(getattr(encoded, "ids", encoded))
