"""The gRPC Chat RPC's request and response, on the HTTP API's chat code.

A ChatRequest becomes the HTTP API's ChatCompletionRequest (chat_request), so both
protocols check messages, render the chat template and plan tools (server/tool_calls.py)
with the same code, and refuse the same way: every refusal here is a ValueError whose
message names the field as HTTP's 400 names it (the proto mirrors OpenAI's nesting:
tools[i].function.parameters, tool_choice.function.name, messages[i].tool_call_id), which
the service reports as INVALID_ARGUMENT. ChatReader reads each choice's text as the HTTP
Assembler does (tool_parsers.ToolCallStream) into content and ToolCallDelta messages.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pydantic

from jpaged.sample.sampling_params import SamplingParams
from server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    check_template_kwargs,
    from_validation_errors,
)
from server.prompt_plans import PromptPlan, chat_renderer
from server.proto.jpaged.v1 import generation_pb2 as pb
from server.tool_calls import ToolPlan, plan_tools

_MODES = {
    pb.TOOL_CHOICE_MODE_NONE: "none",
    pb.TOOL_CHOICE_MODE_AUTO: "auto",
    pb.TOOL_CHOICE_MODE_REQUIRED: "required",
}
_OPTIONS = ("parallel_tool_calls", "add_generation_prompt", "continue_final_message",
            "chat_template")  # fmt: skip


def chat_request(request: pb.ChatRequest) -> ChatCompletionRequest:
    """The request as the HTTP API's model (its sampling stays the proto's: see the service).

    Raises a ValueError naming the field.
    """
    body: dict = {"messages": [_message(m) for m in request.messages]}
    if request.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(request.tools)]
    if request.HasField("tool_choice"):
        which = request.tool_choice.WhichOneof("choice")
        if which == "function":
            name = request.tool_choice.function.name
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif which == "mode" and request.tool_choice.mode in _MODES:
            body["tool_choice"] = _MODES[request.tool_choice.mode]
        elif which == "mode" and request.tool_choice.mode != pb.TOOL_CHOICE_MODE_UNSPECIFIED:
            raise ValueError(f"tool_choice.mode: unknown value {request.tool_choice.mode}")
    for name in _OPTIONS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.HasField("chat_template_kwargs"):
        body["chat_template_kwargs"] = _json(request.chat_template_kwargs, "chat_template_kwargs")
    try:
        req = ChatCompletionRequest.model_validate(body)
        check_template_kwargs(req)
    except pydantic.ValidationError as e:
        raise ValueError(from_validation_errors(list(e.errors())).message) from None
    except APIError as e:
        raise ValueError(e.message) from None
    return req


def plan(req: ChatCompletionRequest, *, parser_name: str | None, template: str | None) -> ToolPlan:
    """tool_calls.plan_tools, its refusals as ValueErrors. template: the one the chat renders
    with (the request's, the server's or the model's)."""
    try:
        return plan_tools(req, parser_name=parser_name, template=template)
    except APIError as e:
        raise ValueError(e.message) from None


def with_tool_constraint(params: SamplingParams, tools: ToolPlan) -> SamplingParams:
    """params decoding under the tools' grammar (tool_choice required or named)."""
    if tools.constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError(
            "tool_choice: required or a named function decodes under the tools' schemas: it "
            "cannot be combined with sampling.structured_outputs"
        )
    return params.clone(structured_outputs=tools.constraint)


async def prompt_preparer(
    req: ChatCompletionRequest,
    server_template: str | None,
    tools: ToolPlan,
    params: SamplingParams,
    *,
    max_tokens_set: bool,
    engine,
) -> Callable[[object], tuple[list[int], SamplingParams]]:
    """EngineLoop.submit's prepare: the chat rendered as /v1/chat/completions renders it
    (here, in a worker thread: a conversation that cannot be rendered is a ValueError before
    it reaches the engine thread) and max_tokens fitted there as Generate fits it (a
    max_tokens the client set must fit with the prompt, a default one stops at
    max_model_len)."""
    render = chat_renderer(req, server_template, tools=tools.tools, prompt=tools.prompt)
    prompt_plan = PromptPlan(
        render,
        params if max_tokens_set else params.clone(max_tokens=None),
        default_max_tokens=None if max_tokens_set else params.max_tokens,
        where="messages",
        max_tokens_field="sampling.max_tokens",
    )
    try:
        await asyncio.to_thread(prompt_plan.render_now, engine)
    except APIError as e:
        raise ValueError(e.message) from None

    def prepare(engine) -> tuple[list[int], SamplingParams]:
        try:
            return prompt_plan.prepare(engine)
        except APIError as e:
            raise ValueError(e.message) from None

    return prepare


class ChatReader:
    """Each choice's text -> its ChatChoiceDelta's content, tool-call deltas and, at the
    end, its whole calls and finish reason (tool_calls for a choice that stopped having made
    calls under auto or required)."""

    def __init__(self, tools: ToolPlan, n: int) -> None:
        self._tools = tools
        self._streams = [tools.stream() for _ in range(n)]

    def __call__(self, delta: pb.ChatChoiceDelta, text: str, final: bool, reason: str | None):
        """Fills delta from text (the choice's new text); returns its finish reason."""
        stream = self._streams[delta.index]
        if stream is None:  # tool_choice none: the text is content
            delta.text = text
            return reason
        content, calls = stream.feed(text, final=final)
        delta.text = content
        for call in calls:
            function = call["function"]
            delta.tool_calls.add(
                index=call["index"],
                id=call.get("id", ""),
                name=function.get("name", ""),
                arguments=function["arguments"],
            )
        if not final:
            return reason
        for call in stream.calls:
            function = call["function"]
            delta.calls.add(
                id=call["id"],
                function=pb.FunctionCall(name=function["name"], arguments=function["arguments"]),
            )
        return self._tools.finish_reason(reason, bool(stream.calls))


def _message(m: pb.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content if m.HasField("content") else None}
    if m.HasField("name"):
        out["name"] = m.name
    if m.HasField("tool_call_id"):
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in m.tool_calls
        ]
    return out


def _tool(i: int, tool: pb.Tool) -> dict:
    f = tool.function
    function: dict = {"name": f.name}
    if f.HasField("description"):
        function["description"] = f.description
    if f.HasField("parameters"):
        function["parameters"] = _json(f.parameters, f"tools[{i}].function.parameters")
    return {"type": "function", "function": function}


def _json(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{field}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: must be a JSON object, got {type(value).__name__}")  # noqa: TRY004
    return value
