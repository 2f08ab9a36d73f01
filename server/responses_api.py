"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request runs through the chat-completions pipeline, not a path of its own: its input items
(after the stored conversation of previous_response_id, behind its instructions) become chat
messages, its flat function tools the chat shape, text.format a response_format and
max_output_tokens max_completion_tokens. OpenAIServer then plans it as a chat (tools by
plan_tools, server/tool_calls.py; the prompt rendered before anything reaches the engine
thread) and submits, collects and finishes its one engine request as a chat's, so aborts,
drain, metrics and the prefix cache behave the same. The tool plan's ToolCallStream
reads the model's text into output items (_Output): a message item (one output_text part)
for content, a function_call item per call, in text order; an item is done before the next
one is added. Every refusal is a one-line 4xx naming the Responses field (input[2].call_id,
text.format.schema, max_output_tokens), never the chat field the pipeline checked.

Streamed, a response is OpenAI's semantic events, sequence_number counting from 0:
response.created, response.in_progress, per item output_item.added, then content_part.added,
output_text.delta..., output_text.done, content_part.done (a message) or
function_call_arguments.delta..., .done (a call), then output_item.done; last comes exactly
one of response.completed, response.incomplete (cut at max_output_tokens or the context) or
response.failed (an engine error, or the drain aborting it).

The store (ResponseStore) keeps every response that ended, unless the request said
store: false, with the conversation that led to it (without instructions, which OpenAI does
not carry over) and its output as chat messages; previous_response_id continues it. It is an
LRU of --responses-store-size entries (0 keeps nothing) in this process's memory, touched
only on the event loop's thread. A call whose client went away is not kept.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import json
import re
import secrets
import time
from typing import Any, Literal

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, model_validator

from server import openai_fields
from server import openai_protocol as proto
from server.openai_api import (
    OpenAIServer,
    _as_api_error,
    _Call,
    _engine_error_message,
    _EventStream,
    _outcome,
)
from server.openai_protocol import APIError, ChatCompletionRequest
from server.openai_responses import Assembler
from server.tool_parsers import ToolCallStream

# ---- the request ------------------------------------------------------------------------


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None  # text, json_object or json_schema
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class ResponsesRequest(BaseModel):
    """OpenAI's POST /v1/responses body. Items, tools and tool_choice are checked by the
    conversion (each problem named by its path). The fields OpenAI defines that are not
    declared here (include, metadata, reasoning, service_tier, truncation, user, ...) are
    dropped with one log line per name (server/openai_fields.py); any other is a 400."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_unused_openai_fields(cls, data: Any) -> Any:
        return openai_fields.drop_unused(data, "responses", cls.model_fields)

    model: str | None = None
    input: Any  # a string or a list of items (conversation() checks which)
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # none, auto, required or {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    # refused when set: what they ask for cannot be done here
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


def _bad(param: str, what: str, status: int = 400) -> APIError:
    return APIError(status, f"{param}: {what}", param=param)


def _check_fields(body: ResponsesRequest) -> None:
    if body.background:
        raise _bad("background", "background responses are not supported: send it without")
    if body.conversation is not None:
        raise _bad(
            "conversation",
            "the Conversations API is not supported: continue with previous_response_id",
        )
    if body.prompt is not None:
        raise _bad("prompt", "stored prompt templates are not supported: send the input itself")


# ---- input items -> chat messages ---------------------------------------------------------

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _text_of(content: Any, where: str) -> str:
    """A message's content as text (parts joined by newlines, as chat contents are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind)
        if key is None:
            if kind in ("input_image", "input_file", "input_audio"):
                raise _bad(f"{at}.type", f"{kind!r} is not supported: this server reads text")
            raise _bad(f"{at}.type", f"must be input_text or output_text, got {kind!r}")
        if not isinstance(part.get(key), str):
            raise _bad(f"{at}.{key}", "must be a string")
        texts.append(part[key])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    if key not in item:
        raise _bad(f"{where}.{key}", "field required")
    if not isinstance(item[key], str):
        raise _bad(f"{where}.{key}", f"must be a string, got {json.dumps(item[key])[:40]}")
    return item[key]


@dataclasses.dataclass
class _Messages:
    """Chat messages and, for each, the Responses path it came from (errors name it);
    calls[(k, j)]: the path of message k's tool call j."""

    messages: list[dict] = dataclasses.field(default_factory=list)
    paths: list[str] = dataclasses.field(default_factory=list)
    calls: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)

    def add(self, message: dict, path: str) -> None:
        self.messages.append(message)
        self.paths.append(path)

    def extend(self, other: _Messages) -> None:
        k0 = len(self.messages)
        self.messages += other.messages
        self.paths += other.paths
        self.calls.update({(k0 + k, j): p for (k, j), p in other.calls.items()})


def items_to_messages(items: list, where: str = "input") -> _Messages:
    """Responses items -> chat messages. A function_call joins the assistant message just
    before it (the model wrote them in one turn: rendered as it was, the next turn's prompt
    starts with the cached one), or starts one; a function_call_output is a tool message;
    reasoning items are left out (chat templates drop earlier turns' reasoning)."""
    out = _Messages()
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, "must be an object: a message, function_call or function_call_output")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{at}.role", "must be one of user, assistant, system, developer, "
                           f"got {role!r}")  # fmt: skip
            if "content" not in item:
                raise _bad(f"{at}.content", "field required")
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
                raise _bad(f"{at}.output", "field required")
            text = _text_of(item["output"], f"{at}.output")
            out.add({"role": "tool", "tool_call_id": call_id, "content": text}, at)
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise _bad(f"{at}.type", "item_reference is not supported: send the item itself "
                       "or continue with previous_response_id")  # fmt: skip
        else:
            raise _bad(f"{at}.type", "must be message, function_call or function_call_output, "
                       f"got {kind!r}")  # fmt: skip
    return out


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> the chat shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(at, "must be an object: a function tool")
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"{at}.type", f"only function tools are supported here, got {kind!r}")
        function = {"name": _string(tool, "name", at)}
        for key, types, shown in (("description", str, "a string"),
                                  ("parameters", dict, "an object (a JSON schema)"),
                                  ("strict", bool, "true or false")):  # fmt: skip
            value = tool.get(key)
            if value is not None and not isinstance(value, types):
                raise _bad(f"{at}.{key}", f"must be {shown}")
            if value is not None:
                function[key] = value
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice):
    if choice is None:
        return None  # plan_tools' default: "auto" with tools (OpenAI's)
    if choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise _bad("tool_choice", "must be none, auto, required or "
                   f'{{"type": "function", "name": ...}}, got {json.dumps(choice)[:40]}')  # fmt: skip
    kind = choice.get("type")
    if kind != "function":
        raise _bad("tool_choice.type", "must be function (or tool_choice none, auto or "
                   f"required), got {kind!r}")  # fmt: skip
    return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _bad("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if "schema" not in fmt:
        raise _bad("text.format.schema", "field required for type json_schema")
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


@dataclasses.dataclass
class _Conversation:
    chat: ChatCompletionRequest
    history: list[dict]  # the messages without instructions: what the store keeps
    sources: _Messages

    def renamed(self, error: APIError) -> APIError:
        return renamed(error, self.sources)


def renamed(error: APIError, sources: _Messages | None) -> APIError:
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


def conversation(body: ResponsesRequest, previous: list[dict] | None) -> _Conversation:
    """The chat request a Responses request runs as. previous: the stored conversation of
    previous_response_id."""
    sources = _Messages()
    if body.instructions is not None:
        sources.add({"role": "system", "content": body.instructions}, "instructions")
    num_instructions = len(sources.messages)
    for message in previous or ():
        sources.add(dict(message), "previous_response_id")
    if isinstance(body.input, str):
        sources.add({"role": "user", "content": body.input}, "input")
    elif isinstance(body.input, list):
        sources.extend(items_to_messages(body.input))
    else:
        raise _bad(
            "input", f"must be a string or a list of items, got {json.dumps(body.input)[:40]}"
        )
    if len(sources.messages) == num_instructions:
        raise _bad("input", "give at least one item")
    tools = _chat_tools(body.tools)
    fields: dict[str, Any] = {"messages": sources.messages, "stream": body.stream}
    optional = {
        "tools": tools,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": _response_format(body.text),
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except pydantic.ValidationError as e:
        raise renamed(proto.from_validation_errors(list(e.errors())), sources) from None
    return _Conversation(chat, sources.messages[num_instructions:], sources)


# ---- the store ----------------------------------------------------------------------------


@dataclasses.dataclass
class Stored:
    response: dict  # the response object as sent
    messages: list[dict]  # its conversation and output as chat messages, no instructions


class ResponseStore:
    """Ended responses by id; past max_size, the least recently used (created, read or
    continued) goes. max_size 0 keeps nothing. Touched only on the event loop's thread."""

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError(f"responses store size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: Stored) -> None:
        if self.max_size == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(
        404,
        f"Response with id {response_id!r} not found (this server keeps the last "
        "--responses-store-size responses in memory, none sent with store: false)",
        param=param,
        code="not_found",
    )


# ---- output items -------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class _Output:
    """One response's output items, built from the model's text as it arrives. feed() and
    finish() return the stream events (sequence numbers come later) that record each step;
    every event holds its own copy of what it shows."""

    def __init__(self, stream: ToolCallStream | None) -> None:
        self._stream = stream  # None: the text is all content
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written: the last one
        self._calls: dict[int, int] = {}  # the stream's call index -> output index

    def feed(self, text: str, final: bool) -> list[dict]:
        if self._stream is None:
            content, calls = text, []
        else:
            content, calls = self._stream.feed(text, final)
        events = self._content(content) if content else []
        for call in calls:
            if "id" in call:  # a new call: its name, no arguments yet
                events += self._close("completed")
                self._calls[call["index"]] = len(self.items)
                events += self._add({"id": _new_id("fc"), "type": "function_call",
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
        events = [] if self.items else self._content("")
        return events + self._close(status)

    def _content(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed")
            events += self._add({"id": _new_id("msg"), "type": "message", "status": "in_progress",
                                 "content": [], "role": "assistant"})  # fmt: skip
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            self._open["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(),
                           "part": copy.deepcopy(part)})  # fmt: skip
        if text:
            self._open["content"][0]["text"] += text
            events.append({"type": "response.output_text.delta", **self._where(), "delta": text,
                           "logprobs": []})  # fmt: skip
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
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events = [
                {"type": "response.output_text.done", **where, "text": part["text"],
                 "logprobs": []},
                {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)},
            ]  # fmt: skip
        else:
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": index, "name": item["name"],
                       "arguments": item["arguments"]}]  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": copy.deepcopy(item)})  # fmt: skip
        return events


def _sse(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


# ---- the routes ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """One accepted response: the call, its output, the response object's fixed fields."""

    call: _Call
    output: _Output
    response: dict
    conversation: _Conversation
    store: bool


class ResponsesAPI:
    """/v1/responses on an OpenAIServer (whose submit / collect / finish run the call)."""

    def __init__(self, server: OpenAIServer, *, store_size: int) -> None:
        self._server = server
        self.store = ResponseStore(store_size)

    def add_routes(self, router: APIRouter) -> None:
        router.add_api_route("/responses", self.create, methods=["POST"])
        router.add_api_route("/responses/{response_id}", self.retrieve, methods=["GET"])
        router.add_api_route("/responses/{response_id}", self.delete, methods=["DELETE"])

    async def retrieve(self, response_id: str, stream: bool = False) -> dict:
        if stream:
            raise _bad("stream", "replaying a stored response as events is not supported")
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, None)
        return entry.response

    async def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise _not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    async def create(self, body: ResponsesRequest, request: Request):
        srv = self._server
        rid = _new_id("resp")
        start = time.monotonic()
        conv = None
        try:
            srv._check_model(body.model)
            _check_fields(body)
            previous = None
            if body.previous_response_id is not None:
                entry = self.store.get(body.previous_response_id)
                if entry is None:
                    raise _not_found(body.previous_response_id, "previous_response_id")
                previous = entry.messages
            conv = conversation(body, previous)
            chat = conv.chat
            tools, plans = await srv._chat_plans(chat)  # as a chat plans it: one behaviour
        except APIError as e:
            error = renamed(e, conv.sources if conv is not None else None)
            srv._reject(rid, error)
            raise error from None
        try:
            handles = await srv._submit(rid, chat, plans)
        except APIError as e:
            raise conv.renamed(e) from None
        call = _Call(Assembler("chat", rid, srv._model_name, handles), start)
        run = _Run(
            call,
            _Output(tools.stream()),
            self._response(rid, body, plans[0].params),
            conv,
            body.store is not False,
        )
        headers = {"x-request-id": rid}
        if body.stream:
            return _EventStream(self._events(run), lambda: srv._finish(call), headers=headers)
        try:
            outcome = await srv._collect(call, request)
            if outcome == "cancelled":
                return Response(status_code=499)  # nobody reads it: the client is gone
            if outcome == "internal":
                error = next(h.error for h in handles if h.error is not None)
                raise APIError(500, _engine_error_message(error), code="internal_error")
            reason = None
            for d in call.asm.take():  # one delta: the whole text
                run.output.feed(d.text, final=True)
                reason = d.finish_reason
            run.output.finish("completed" if reason == "stop" else "incomplete")
            return JSONResponse(self._end(run, reason), headers=headers)
        finally:
            srv._finish(call)

    async def _events(self, run: _Run):
        srv, call = self._server, run.call
        asm = call.asm
        event = asm.handles[0].event
        numbers = itertools.count()

        def send(events: list[dict]) -> bytes:
            return b"".join(_sse({**e, "sequence_number": next(numbers)}) for e in events)

        try:
            yield send([{"type": "response.created", "response": copy.deepcopy(run.response)},
                        {"type": "response.in_progress", "response": run.response}])  # fmt: skip
            reason = None
            while True:
                deltas = asm.take()
                call.saw_deltas(deltas)
                events = []
                for d in deltas:
                    events += run.output.feed(d.text, final=d.finish_reason is not None)
                    reason = d.finish_reason or reason
                error = next((h.error for h in asm.handles if h.error is not None), None)
                if error is not None or asm.done:
                    call.outcome = "internal" if error is not None else _outcome(asm)
                    events += run.output.finish("completed" if reason == "stop" else "incomplete")
                    response = self._end(run, reason, error)
                    kind = {"completed": "response.completed",
                            "incomplete": "response.incomplete"}.get(response["status"],
                                                                     "response.failed")  # fmt: skip
                    yield send([*events, {"type": kind, "response": response}])
                    return
                if events:
                    yield send(events)
                await event.wait()
                event.clear()
        finally:
            srv._finish(call)

    def _response(self, rid: str, body: ResponsesRequest, params) -> dict:
        """The response object as response.created shows it."""
        fmt = body.text.format if body.text is not None and body.text.format else None
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "completed_at": None,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self._server._model_name,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": body.store is not False,
            "temperature": params.temperature,
            "text": {"format": fmt or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [_tool_echo(t) for t in body.tools or ()],
            "top_logprobs": 0,
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": None,
            "metadata": {},
        }

    def _end(self, run: _Run, reason: str | None, error: BaseException | None = None) -> dict:
        """The ended response object (also kept in the store unless store: false)."""
        response = copy.deepcopy(run.response)
        response["output"] = copy.deepcopy(run.output.items)
        if error is not None or reason == "abort":
            message = ("the request was aborted: the server is shutting down" if error is None
                       else _as_api_error(error).message)  # fmt: skip
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": message}
        elif reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
            response["completed_at"] = int(time.time())
        usage = run.call.asm.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        response["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            # cache_write_tokens counts OpenAI's explicit cache writes; the prefix cache here
            # is implicit (every prompt's full pages), so none are written on request
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        if run.store:
            output = items_to_messages(run.output.items, "output").messages
            self.store.put(response["id"], Stored(response, run.conversation.history + output))
        return response


def _tool_echo(tool: dict) -> dict:
    """A function tool as OpenAI's response object shows it."""
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }
