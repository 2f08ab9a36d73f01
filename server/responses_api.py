"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request runs through the chat-completions pipeline, not a path of its own: its input items
(after the stored conversation of previous_response_id, behind its instructions) become chat
messages, its flat function tools the chat shape, text.format a response_format and
max_output_tokens max_completion_tokens (server/responses_items.py converts both ways).
OpenAIServer then plans it as a chat (tools by plan_tools, server/tool_calls.py; the prompt
rendered before anything reaches the engine thread) and submits, collects and finishes its
one engine request as a chat's, so aborts, drain, metrics and the prefix cache behave the
same. The tool plan's ToolCallStream reads the model's text into output items: a message
item for content, a function_call item per call, in text order. With --reasoning-parser the
reasoning is split off first (as a chat's) into a reasoning item before them, and
usage.output_tokens_details.reasoning_tokens counts its tokens, through the end tag's (exact
to the step that wrote it: server/reasoning_parsers.py reasoning_tokens). Every refusal is a one-line 4xx naming the Responses field (input[2].call_id, text.format.schema, max_output_tokens),
never the chat field the pipeline checked.

Streamed, a response is OpenAI's semantic events, sequence_number counting from 0:
response.created, response.in_progress, per item output_item.added, then content_part.added,
output_text.delta..., output_text.done, content_part.done (a message; a reasoning item the
same with reasoning_text.delta..., reasoning_text.done) or
function_call_arguments.delta..., .done (a call), then output_item.done; last comes exactly
one of response.completed, response.incomplete (cut at max_output_tokens or the context) or
response.failed (an engine error, or the drain aborting it).

The store (ResponseStore) keeps every response that ended, unless the request said
store: false, with the conversation that led to it (without instructions, which OpenAI does
not carry over) and its output as chat messages; previous_response_id continues it. It is an
LRU of --responses-store-size entries (0 keeps nothing) in this process's memory, touched
only on the event loop's thread. A call whose client went away is not kept.

Sessions (jpaged/core/session_pages.py): a chain of previous_response_id is one session of
the engine, keyed by the chain's first response id (kept in the store with each response),
so the chain's cached KV pages are evicted last while it is active; prompt_cache_key, else
user, names the session instead (as on chat and completions) and is then carried down the chain.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import json
import time
from typing import Any, Literal

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server import openai_fields
from server import openai_protocol as proto
from server.openai_api import (
    OpenAIServer,
    _as_api_error,
    _Call,
    _EventStream,
    _outcome,
)
from server.openai_protocol import APIError, ChatCompletionRequest
from server.openai_responses import Assembler
from server.responses_items import (
    Messages,
    OutputItems,
    bad,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    new_id,
    renamed,
    response_format,
    sse_event,
)

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
    # The session key (server/openai_protocol.py's _SamplingRequest); without either, the
    # chain of previous_response_id is one session, named by its first response's id.
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)
    user: str | None = Field(default=None, min_length=1, max_length=256)
    # refused when set: what they ask for cannot be done here
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


def _check_fields(body: ResponsesRequest) -> None:
    if body.background:
        raise bad("background", "background responses are not supported: send it without")
    if body.conversation is not None:
        raise bad(
            "conversation",
            "the Conversations API is not supported: continue with previous_response_id",
        )
    if body.prompt is not None:
        raise bad("prompt", "stored prompt templates are not supported: send the input itself")


@dataclasses.dataclass
class _Conversation:
    chat: ChatCompletionRequest
    history: list[dict]  # the messages without instructions: what the store keeps
    sources: Messages

    def renamed(self, error: APIError) -> APIError:
        return renamed(error, self.sources)


def conversation(
    body: ResponsesRequest, previous: list[dict] | None, session: str | None = None
) -> _Conversation:
    """The chat request a Responses request runs as. previous: the stored conversation of
    previous_response_id; session: the engine's session key (the chat's prompt_cache_key)."""
    sources = Messages()
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
        raise bad(
            "input", f"must be a string or a list of items, got {json.dumps(body.input)[:40]}"
        )
    if len(sources.messages) == num_instructions:
        raise bad("input", "give at least one item")
    tools = chat_tools(body.tools)
    fields: dict[str, Any] = {"messages": sources.messages, "stream": body.stream}
    optional = {
        "tools": tools,
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": response_format(body.text.format if body.text is not None else None),
        "prompt_cache_key": session,
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
    session: str | None = None  # the session key its request ran in


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


# ---- the routes ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """One accepted response: the call, its output, the response object's fixed fields."""

    call: _Call
    output: OutputItems
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
            raise bad("stream", "replaying a stored response as events is not supported")
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
        rid = new_id("resp")
        start = time.monotonic()
        conv = None
        try:
            lora = srv._check_model(body.model)
            _check_fields(body)
            previous, session = None, rid  # a new chain: this response names its session
            if body.previous_response_id is not None:
                entry = self.store.get(body.previous_response_id)
                if entry is None:
                    raise _not_found(body.previous_response_id, "previous_response_id")
                previous, session = entry.messages, entry.session or session
            conv = conversation(body, previous, body.prompt_cache_key or body.user or session)
            chat = conv.chat
            tools, plans = await srv._chat_plans(chat)  # as a chat plans it: one behaviour
        except APIError as e:
            error = renamed(e, conv.sources if conv is not None else None)
            srv._reject(rid, error)
            raise error from None
        try:
            handles = await srv._submit(rid, chat, plans, lora=lora)
        except APIError as e:
            raise conv.renamed(e) from None
        call = _Call(Assembler("chat", rid, srv._model_name, handles), start)
        reasoning = srv._reasoning_of(plans[0])  # known once _submit rendered the prompt
        run = _Run(
            call,
            OutputItems(tools.stream(), reasoning.stream() if reasoning is not None else None),
            self._response(rid, body, plans[0].params),
            conv,
            body.store is not False,
        )
        headers = {"x-request-id": rid}
        if body.stream:
            return _EventStream(self._events(run), lambda: srv._finish(call), headers=headers)
        try:
            gone = await srv._collected(call, request)
            if gone is not None:
                return gone
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
            return b"".join(sse_event({**e, "sequence_number": next(numbers)}) for e in events)

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
            "user": body.user,
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
        thought = run.output.reasoning_tokens(run.call.asm.handles[0].choices[0])
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        response["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            # cache_write_tokens counts OpenAI's explicit cache writes; the prefix cache here
            # is implicit (every prompt's full pages), so none are written on request
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": usage["total_tokens"],
        }
        if run.store:
            output = items_to_messages(run.output.items, "output").messages
            session = run.conversation.chat.session_key()
            messages = run.conversation.history + output
            self.store.put(response["id"], Stored(response, messages, session))
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
