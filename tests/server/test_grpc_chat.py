"""The gRPC Chat RPC on the fake engine: tool_choice auto read by the hermes parser from a
scripted text (exact content and calls, streamed as OpenAI's deltas, the same as the HTTP
API's answer), parallel_tool_calls, none, "auto" without flags, the tools and the tool
history added to a template that renders none of them (as HTTP adds them), and bad inputs,
each an INVALID_ARGUMENT naming the field with the server serving on. (SmolLM2's named and
required calls: test_tool_calling.py.)"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from fake_engine import EOS_TOKEN_ID, FakeEngine
from serving_helpers import collect_chat

from server.proto.jpaged.v1 import generation_pb2 as pb
from server.tool_prompts import tool_prompt

# What every choice of the scripted engine says, one piece per token, then EOS.
SCRIPT = [
    "I will look.",
    " <tool_call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}\n</tool_call>',
    "\n<tool_call>\n",
    '{"name": "get_time", "arguments": {"zone": "CET"}}',
    "\n</tool_call>",
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [
    pb.Tool(function=pb.FunctionDefinition(name="get_weather", description="Weather in a city",
                                           parameters=json.dumps(WEATHER))),
    pb.Tool(function=pb.FunctionDefinition(name="get_time", parameters=json.dumps(TIME))),
]  # fmt: skip
ASK = [pb.ChatMessage(role="user", content="Weather and time in Paris?")]
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]


class ScriptedEngine(FakeEngine):
    """The fake engine, each choice's text being SCRIPT (then EOS, or max_tokens first)."""

    def _append_token(self, r, c) -> None:
        i = len(c.token_ids)
        c.token_ids.append(10 + i if i < len(SCRIPT) else EOS_TOKEN_ID)
        if self._pages_for(len(r.prompt_ids) + len(c.token_ids)) > len(c.page_ids):
            self._take_pages(c, 1)
        if i == len(SCRIPT):
            c.finish_reason = "stop"
            return
        c.text += SCRIPT[i]
        if r.params.max_tokens is not None and len(c.token_ids) >= r.params.max_tokens:
            c.finish_reason = "length"


# The fake template renders no tools, so the tools ride in a system message: room for it.
MAX_MODEL_LEN = 512


@pytest.fixture
def tool_server(make_server):
    # vLLM's flags are accepted (and not needed: test_auto_needs_no_flags)
    return make_server(ScriptedEngine(max_model_len=MAX_MODEL_LEN), tool_call_parser="hermes",
                       enable_auto_tool_choice=True)  # fmt: skip


def chat(messages=ASK, tools=TOOLS, **fields) -> pb.ChatRequest:
    sampling = fields.pop("sampling", {"max_tokens": 20})
    return pb.ChatRequest(
        messages=messages, tools=tools, sampling=pb.SamplingParameters(**sampling), **fields
    )


def mode(m) -> pb.ToolChoice:
    return pb.ToolChoice(mode=m)


def tools_text(tools: list[dict]) -> str:
    """The system text the tools ride in for the fake template (server/tool_prompts.py)."""
    return tool_prompt(FakeEngine().chat_template, tools, None).tools_text


def test_auto_reads_the_calls_out_of_the_text(tool_server):
    for choice in (None, mode(pb.TOOL_CHOICE_MODE_AUTO)):  # unset is auto on this server
        got = collect_chat(tool_server.stub, chat(tool_choice=choice))
        assert got.content == {0: "I will look."}
        assert [(c["name"], c["arguments"]) for c in got.calls[0]] == CALLS
        assert got.final_calls == got.calls  # the final message's whole calls
        ids = [c["id"] for c in got.calls[0]]
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
        assert got.finish_reason == {0: pb.FINISH_REASON_TOOL_CALLS}
        assert got.usage.completion_tokens == len(SCRIPT) + 1
        # no markup ever reached the content, message by message
        assert all("<" not in c.text for m in got.messages for c in m.choices)
    # the HTTP API answers the same request the same way
    body = {"messages": [{"role": "user", "content": ASK[0].content}], "max_tokens": 20,
            "tools": [{"type": "function", "function": {"name": "get_weather",
                       "description": "Weather in a city", "parameters": WEATHER}},
                      {"type": "function", "function": {"name": "get_time",
                       "parameters": TIME}}]}  # fmt: skip
    r = httpx.post(tool_server.http_url + "/v1/chat/completions", json=body, timeout=30)
    (answer,) = r.json()["choices"]
    assert answer["message"]["content"] == got.content[0]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in answer["message"]["tool_calls"]]  # fmt: skip
    assert calls == CALLS and answer["finish_reason"] == "tool_calls"
    assert r.json()["usage"]["prompt_tokens"] == got.usage.prompt_tokens


def test_parallel_tool_calls_false_keeps_the_first_call_and_n_reads_each_choice(tool_server):
    got = collect_chat(
        tool_server.stub,
        chat(parallel_tool_calls=False, sampling={"max_tokens": 20, "n": 2, "seed": 3}),
    )
    for i in (0, 1):
        assert got.content[i] == "I will look."
        assert [(c["name"], c["arguments"]) for c in got.calls[i]] == CALLS[:1]
        assert got.final_calls[i] == got.calls[i]
    assert got.finish_reason == {0: pb.FINISH_REASON_TOOL_CALLS, 1: pb.FINISH_REASON_TOOL_CALLS}
    assert got.calls[0][0]["id"] != got.calls[1][0]["id"]


def test_none_and_a_cut_off_call(tool_server):
    got = collect_chat(tool_server.stub, chat(tool_choice=mode(pb.TOOL_CHOICE_MODE_NONE)))
    assert got.content == {0: "".join(SCRIPT)} and got.calls == {0: []}
    assert got.final_calls == {0: []} and got.finish_reason == {0: pb.FINISH_REASON_STOP}
    # cut off before the second call's closing tag: both calls are read, the finish stays
    # "length"; cut off before its JSON: the open tag is content (the parser's final read)
    got = collect_chat(tool_server.stub, chat(sampling={"max_tokens": 7}))
    assert [(c["name"], c["arguments"]) for c in got.final_calls[0]] == CALLS
    assert got.finish_reason == {0: pb.FINISH_REASON_LENGTH}
    got = collect_chat(tool_server.stub, chat(sampling={"max_tokens": 6}))
    assert [(c["name"], c["arguments"]) for c in got.final_calls[0]] == CALLS[:1]
    assert got.content == {0: "I will look.<tool_call>\n"}
    assert got.finish_reason == {0: pb.FINISH_REASON_LENGTH}


def test_a_history_with_calls_and_results_reaches_the_template(tool_server):
    history = [
        *ASK,
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
            id="call_1", function=pb.FunctionCall(name="get_weather",
                                                  arguments='{"city": "Paris"}'))]),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="21 degrees"),
    ]  # fmt: skip
    got = collect_chat(tool_server.stub, chat(messages=history))
    # The fake template renders no tools, calls or results: they come as HTTP adds them.
    body = {"messages": [{"role": "user", "content": ASK[0].content},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function", "function": {
                                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                       "description": "Weather in a city", "parameters": WEATHER}},
                      {"type": "function", "function": {"name": "get_time",
                       "parameters": TIME}}]}  # fmt: skip
    r = httpx.post(tool_server.http_url + "/tokenize", json=body, timeout=30)
    ids = r.json()["tokens"]
    _, want = tool_server.engine.chat_prompt([
        {"role": "system", "content": tools_text(body["tools"])},
        {"role": "user", "content": ASK[0].content},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Paris"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n21 degrees\n</tool_response>"},
    ])  # fmt: skip
    assert ids == want and got.usage.prompt_tokens == len(want)


NAMED_UNKNOWN = pb.ToolChoice(function=pb.FunctionName(name="get_date"))
BAD = [
    (
        chat(
            tools=[
                pb.Tool(function=pb.FunctionDefinition(name="f", parameters='{"type": "objekt"}'))
            ]
        ),
        "tools[0].function.parameters: invalid JSON schema: Invalid type: objekt",
    ),
    (
        chat(tools=[pb.Tool(function=pb.FunctionDefinition(name="f", parameters="{oops"))]),
        (
            "tools[0].function.parameters: not valid JSON: Expecting property name enclosed in "
            "double quotes: line 1 column 2 (char 1)"
        ),
    ),
    (
        chat(tools=[pb.Tool(function=pb.FunctionDefinition(name="f", parameters="[1]"))]),
        "tools[0].function.parameters: must be a JSON object, got list",
    ),
    (
        chat(tool_choice=NAMED_UNKNOWN),
        (
            "tool_choice.function.name: 'get_date' is not one of the tools "
            "('get_weather', 'get_time')"
        ),
    ),
    (
        chat(tools=[], tool_choice=mode(pb.TOOL_CHOICE_MODE_REQUIRED)),
        'tool_choice "required" needs tools: the request has none',
    ),
    (
        chat(messages=[*ASK, pb.ChatMessage(role="tool", content="21 degrees")]),
        "messages[1].tool_call_id: a tool message needs the id of the call it answers",
    ),
    (
        chat(tools=[TOOLS[0], TOOLS[0]]),
        "tools[1].function.name: 'get_weather' is also tools[0]'s name",
    ),
    (
        chat(
            tool_choice=mode(pb.TOOL_CHOICE_MODE_REQUIRED),
            sampling={"structured_outputs": pb.StructuredOutputs(json_object=True)},
        ),
        (
            "tool_choice: required or a named function decodes under the tools' schemas: it "
            "cannot be combined with sampling.structured_outputs"
        ),
    ),
    (chat(messages=[]), "messages: give at least 1 message, got 0"),
    (
        chat(messages=[pb.ChatMessage(role="robot", content="hi")]),
        "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
    ),
    (
        chat(chat_template_kwargs='{"messages": 1}'),
        "chat_template_kwargs may not set 'messages'",
    ),
    (
        chat(tool_choice=mode(7)),
        "tool_choice.mode: unknown value 7",
    ),
    (  # found on the engine thread, when the history is rendered
        chat(
            messages=[
                *ASK,
                pb.ChatMessage(
                    role="assistant",
                    tool_calls=[
                        pb.ToolCall(
                            id="call_1", function=pb.FunctionCall(name="f", arguments="{oops")
                        )
                    ],
                ),
            ]
        ),
        "messages[1].tool_calls[0].function.arguments: not valid JSON",
    ),
    (
        chat(sampling={"max_tokens": 500}),  # the prompt: 88 tokens with the tools' message
        (
            "This model's maximum context length is 512 tokens. However, you requested 588 "
            "tokens (88 in the messages, 500 in the completion). Please reduce the length of "
            "the messages or completion."
        ),
    ),
]


def test_bad_inputs_are_invalid_argument_naming_the_field(tool_server):
    for request, message in BAD:
        with pytest.raises(grpc.RpcError) as err:
            list(tool_server.stub.Chat(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert err.value.details() == message
        got = collect_chat(tool_server.stub, chat())  # the server serves on
        assert got.finish_reason == {0: pb.FINISH_REASON_TOOL_CALLS}


def test_auto_needs_no_flags(make_server):
    """No --tool-call-parser: the fake template names no tool syntax, so hermes reads the
    calls; unset tool_choice with tools is auto (OpenAI's default)."""
    server = make_server(ScriptedEngine(max_model_len=MAX_MODEL_LEN))
    for choice in (None, mode(pb.TOOL_CHOICE_MODE_AUTO)):
        got = collect_chat(server.stub, chat(tool_choice=choice))
        assert got.content == {0: "I will look."}
        assert [(c["name"], c["arguments"]) for c in got.final_calls[0]] == CALLS
        assert got.finish_reason == {0: pb.FINISH_REASON_TOOL_CALLS}
