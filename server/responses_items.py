"""The Responses API's items in the chat pipeline's terms, both ways (server/responses_api.py
owns the requests, the store and the routes).

In: items_to_messages turns input items (messages with text content or content parts,
function_call, function_call_output) into chat messages, remembering for each the item it
came from, so that renamed() can say any error the chat pipeline raises in the Responses
request's words (messages[3].tool_calls[0].function.arguments -> input[4].arguments,
response_format.json_schema.schema -> text.format.schema, max_completion_tokens ->
max_output_tokens). Flat function tools, tool_choice and text.format become the chat
shapes. Every refusal is an APIError(400) whose param is the path of what was wrong.

Out: OutputItems reads a model's text (through a tool plan's ToolCallStream) into output
items: a message item with one output_text part for content, a function_call item per call,
in the order the text has them; each item is done before the next is added. (Text after a
call, which models seldom write, is a later message item when streamed; a non-streamed
answer reads the text once, so its content comes first.) On a server with a reasoning parser
the text is first split by the request's ReasoningStream (server/reasoning_parsers.py): the
reasoning, when not empty, is a reasoning item with one reasoning_text part, first, and only
the content reaches the ToolCallStream (a call written inside the reasoning stays reasoning,
as in a chat). Streamed or not, the text goes through the same feed(), so both give the same
items. Every step returns the stream events that record it, each holding its own copy of
what it shows.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import secrets
from typing import TYPE_CHECKING, Any

from server.openai_protocol import APIError
from server.reasoning_parsers import ReasoningStream, reasoning_tokens
from server.tool_parsers import ToolCallStream

if TYPE_CHECKING:
    from server.engine_loop import ChoiceState


def bad(param: str, what: str, status: int = 400) -> APIError:
    return APIError(status, f"{param}: {what}", param=param)


# ---- input items -> chat messages ---------------------------------------------------------

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _text_of(content: Any, where: str) -> str:
    """A message's content as text (parts joined by newlines, as chat contents are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind)
        if key is None:
            if kind in ("input_image", "input_file", "input_audio"):
                raise bad(f"{at}.type", f"{kind!r} is not supported: this server reads text")
            raise bad(f"{at}.type", f"must be input_text or output_text, got {kind!r}")
        if not isinstance(part.get(key), str):
            raise bad(f"{at}.{key}", "must be a string")
        texts.append(part[key])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    if key not in item:
        raise bad(f"{where}.{key}", "field required")
    if not isinstance(item[key], str):
        raise bad(f"{where}.{key}", f"must be a string, got {json.dumps(item[key])[:40]}")
    return item[key]


@dataclasses.dataclass
class Messages:
    """Chat messages and, for each, the Responses path it came from (errors name it);
    calls[(k, j)]: the path of message k's tool call j."""

    messages: list[dict] = dataclasses.field(default_factory=list)
    paths: list[str] = dataclasses.field(default_factory=list)
    calls: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)

    def add(self, message: dict, path: str) -> None:
        self.messages.append(message)
        self.paths.append(path)

    def extend(self, other: Messages) -> None:
        k0 = len(self.messages)
        self.messages += other.messages
        self.paths += other.paths
        self.calls.update({(k0 + k, j): p for (k, j), p in other.calls.items()})


def items_to_messages(items: list, where: str = "input") -> Messages:
    """Responses items -> chat messages. A function_call joins the assistant message just
    before it (the model wrote them in one turn: rendered as it was, the next turn's prompt
    starts with the cached one), or starts one; a function_call_output is a tool message;
    reasoning items are left out (chat templates drop earlier turns' reasoning)."""
    out = Messages()
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad(at, "must be an object: a message, function_call or function_call_output")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{at}.role", "must be one of user, assistant, system, developer, "
                           f"got {role!r}")  # fmt: skip
            if "content" not in item:
                raise bad(f"{at}.content", "field required")
            role = "system" if role == "developer" else role  # OpenAI's newer name for it
            out.add({"role": role, "content": _text_of(item["content"], f"{at}.content")}, at)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", at),
                "type": "function",
                "function": {"name": _string(item, "name", at),
                             "arguments": _string(item, "arguments", at)},
            }  # fmt: skip
            last = out.messages[-1] if out.messages else None
            if last is None or last["role"] != "assistant":
                # "" and not null: every chat template renders it
                out.add({"role": "assistant", "content": ""}, at)
                last = out.messages[-1]
            calls = last.setdefault("tool_calls", [])
            out.calls[(len(out.messages) - 1, len(calls))] = at
            calls.append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", at)
            if "output" not in item:
                raise bad(f"{at}.output", "field required")
            text = _text_of(item["output"], f"{at}.output")
            out.add({"role": "tool", "tool_call_id": call_id, "content": text}, at)
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise bad(f"{at}.type", "item_reference is not supported: send the item itself "
                       "or continue with previous_response_id")  # fmt: skip
        else:
            raise bad(f"{at}.type", "must be message, function_call or function_call_output, "
                       f"got {kind!r}")  # fmt: skip
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> the chat shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(at, "must be an object: a function tool")
        kind = tool.get("type")
        if kind != "function":
            raise bad(f"{at}.type", f"only function tools are supported here, got {kind!r}")
        function = {"name": _string(tool, "name", at)}
        for key, types, shown in (("description", str, "a string"),
                                  ("parameters", dict, "an object (a JSON schema)"),
                                  ("strict", bool, "true or false")):  # fmt: skip
            value = tool.get(key)
            if value is not None and not isinstance(value, types):
                raise bad(f"{at}.{key}", f"must be {shown}")
            if value is not None:
                function[key] = value
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    if choice is None:
        return None  # plan_tools' default: "auto" with tools (OpenAI's)
    if choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise bad("tool_choice", "must be none, auto, required or "
                   f'{{"type": "function", "name": ...}}, got {json.dumps(choice)[:40]}')  # fmt: skip
    kind = choice.get("type")
    if kind != "function":
        raise bad("tool_choice.type", "must be function (or tool_choice none, auto or "
                   f"required), got {kind!r}")  # fmt: skip
    return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}


def response_format(fmt: dict | None) -> dict | None:
    """text.format -> response_format."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if "schema" not in fmt:
        raise bad("text.format.schema", "field required for type json_schema")
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


# Chat field -> Responses field, in errors the chat pipeline raises.
_RENAMES = [
    (re.compile(r"response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bthe messages\b"), "the input"),
    (re.compile(r"^messages\b(?!\[)"), "input"),
]
_MESSAGE_PATH = re.compile(r"\bmessages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?")


def renamed(error: APIError, sources: Messages | None) -> APIError:
    """error with the chat pipeline's field names as the Responses request's."""

    def path(m: re.Match) -> str:
        if sources is None or int(m.group(1)) >= len(sources.paths):
            return "input"
        k = int(m.group(1))
        if m.group(2) is not None:
            return sources.calls.get((k, int(m.group(2))), sources.paths[k])
        return sources.paths[k]

    def rename(text: str | None) -> str | None:
        if text is None:
            return None
        for pattern, new in _RENAMES:
            text = pattern.sub(new, text)
        return _MESSAGE_PATH.sub(path, text)

    return APIError(error.status, rename(error.message), param=rename(error.param),
                    code=error.code, headers=error.headers)  # fmt: skip


# ---- output items -------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class OutputItems:
    """One response's output items, built from the model's text as it arrives. feed() and
    finish() return the stream events (sequence numbers come later) that record each step;
    every event holds its own copy of what it shows."""

    def __init__(
        self, stream: ToolCallStream | None, reasoning: ReasoningStream | None = None
    ) -> None:
        self._stream = stream  # None: the text is all content
        self._reasoning = reasoning  # None: no reasoning parser, the text is all content
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written: the last one
        self._calls: dict[int, int] = {}  # the stream's call index -> output index

    def reasoning_tokens(self, choice: ChoiceState) -> int:
        """How many of choice's tokens (the response's one choice) were reasoning."""
        return reasoning_tokens(self._reasoning, choice)

    def feed(self, text: str, final: bool) -> list[dict]:
        events = []
        if self._reasoning is not None:
            thought, text = self._reasoning.feed(text, final)
            if thought:
                events += self._text("reasoning", thought)
        if self._stream is None:
            content, calls = text, []
        else:
            content, calls = self._stream.feed(text, final)
        if content:
            events += self._text("message", content)
        for call in calls:
            if "id" in call:  # a new call: its name, no arguments yet
                events += self._close("completed")
                self._calls[call["index"]] = len(self.items)
                events += self._add({"id": new_id("fc"), "type": "function_call",
                                     "status": "in_progress", "arguments": "",
                                     "call_id": call["id"], "name": call["function"]["name"]})  # fmt: skip
                continue
            index = self._calls[call["index"]]
            item, fragment = self.items[index], call["function"]["arguments"]
            item["arguments"] += fragment
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": index, "delta": fragment})  # fmt: skip
        return events

    def finish(self, status: str) -> list[dict]:
        """Closes the last item with status (completed, incomplete); a response with no
        output gets one empty message, as OpenAI's."""
        events = [] if self.items else self._text("message", "")
        return events + self._close(status)

    def _text(self, kind: str, text: str) -> list[dict]:
        """text added to the open item of kind (message or reasoning), opening one first
        (with its one part) when the open item is another."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                        "content": [], "role": "assistant"}  # fmt: skip
                part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}  # fmt: skip
                part = {"type": "reasoning_text", "text": ""}
            events += self._add(item)
            self._open["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(),
                           "part": copy.deepcopy(part)})  # fmt: skip
        if text:
            self._open["content"][0]["text"] += text
            if kind == "message":
                events.append({"type": "response.output_text.delta", **self._where(),
                               "delta": text, "logprobs": []})  # fmt: skip
            else:
                events.append({"type": "response.reasoning_text.delta", **self._where(),
                               "delta": text})  # fmt: skip
        return events

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1,
                "content_index": 0}  # fmt: skip

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]  # fmt: skip

    def _close(self, status: str) -> list[dict]:
        item, index = self._open, len(self.items) - 1
        if item is None:
            return []
        self._open = None
        item["status"] = status
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = ({"type": "response.output_text.done", "logprobs": []}
                    if item["type"] == "message"
                    else {"type": "response.reasoning_text.done"})  # fmt: skip
            events = [
                {**done, **where, "text": part["text"]},
                {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)},
            ]
        else:
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": index, "name": item["name"],
                       "arguments": item["arguments"]}]  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": copy.deepcopy(item)})  # fmt: skip
        return events


def sse_event(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
