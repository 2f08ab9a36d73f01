"""Tool calling over HTTP on the real SmolLM2-135M-Instruct, with the official openai client.

A named tool_choice and "required" decode under the tools' schemas, so their arguments
validate (jsonschema), streamed and not, and the streamed fragments concatenate to the
non-streamed arguments for the same seed. The server has no tool flags: tool_choice "auto"
reads the model's text with the hermes parser (SmolLM2's template names no tool syntax, so
the tools reach it as a hermes system message); its output is pinned here with a regex
constraint, so the exact content and calls are known. A two-turn tool loop on SmolLM2's own
template (the assistant turn's content null, then missing) answers without an error. The
tools reach a template that renders them (Qwen 2.5's, sent as the request's chat_template)
and a multi-turn history with a tool call and its result renders as /tokenize and LLM.chat
render it. /tokenizer_info describes SmolLM2's tokenizer.

The gRPC Chat RPC gives the same calls as HTTP for the same seed, and renders the same
history with the tools.

One engine and one server for the module, shared with test_agent_clients
(tests/server/conftest.py smollm2_server).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from serving_helpers import collect_chat, openai_client
from tool_templates import QWEN25_TEMPLATE, SMOLLM2_TEMPLATE

from models.chat_template import render_chat
from server.proto.jpaged.v1 import generation_pb2 as pb

# The real model's accuracy and end-to-end behaviour: CI proves it under Python 3.11; its
# programs and code paths run under 3.12 in the tiny-model tests (pyproject's `once`).
pytestmark = pytest.mark.once

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 10}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
     "description": "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time",
     "description": "The local time in a time zone", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 60  # a call here is 15 to 30 tokens


@pytest.fixture(scope="module")
def llm(smollm2_server):
    return smollm2_server[0]


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server[1]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=300)


def ask(client, **kwargs):
    kwargs = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS,
              "temperature": 1.0, **kwargs}  # fmt: skip
    return client.chat.completions.create(**kwargs)


def streamed_calls(client, **kwargs) -> tuple[list[dict], str, str | None]:
    """(calls as a client assembles them from the deltas, content, finish_reason)."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in ask(client, stream=True, **kwargs):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function"
                assert d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return list(calls.values()), content, finish


def plain(message) -> list[dict]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls
    ]


def test_named_call_validates_and_streams_the_same_arguments(client):
    for seed in (0, 1, 2):
        r = ask(client, tool_choice=NAMED, seed=seed)
        (choice,) = r.choices
        assert choice.finish_reason == "stop"  # a named choice keeps "stop", as vLLM
        assert choice.message.content is None
        (call,) = plain(choice.message)
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)
        calls, content, finish = streamed_calls(client, tool_choice=NAMED, seed=seed)
        assert (content, finish) == ("", "stop")
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call["arguments"])]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_validate_and_stream_the_same_arguments(client, parallel):
    for seed in (0, 3):
        kwargs = {"tool_choice": "required", "seed": seed, "parallel_tool_calls": parallel}
        (choice,) = ask(client, **kwargs).choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = plain(choice.message)
        assert len(calls) >= 1 if parallel else len(calls) == 1
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
        got, content, finish = streamed_calls(client, **kwargs)
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in got] == [
            (c["name"], c["arguments"]) for c in calls
        ]
        assert len({c["id"] for c in calls + got}) == 2 * len(calls)


def test_n_with_tools_gives_each_choice_its_calls(client):
    r = ask(client, tool_choice="required", n=2, seed=5, parallel_tool_calls=False)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        (call,) = plain(choice.message)
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert choice.finish_reason == "tool_calls"


# What the hermes parser reads under tool_choice "auto": SmolLM2's output pinned by a regex.
PINNED = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Lyon)", "unit": "celsius"\}\}\n</tool_call>'
)


def test_auto_reads_hermes_calls_out_of_the_text(client):
    extra = {"structured_outputs": {"regex": PINNED}}
    (choice,) = ask(client, seed=0, extra_body=extra).choices  # tool_choice unset: "auto"
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = plain(choice.message)
    city = json.loads(call["arguments"])["city"]
    assert call["arguments"] == f'{{"city": "{city}", "unit": "celsius"}}'
    assert call["name"] == "get_weather" and city in ("Paris", "Lyon")
    calls, content, finish = streamed_calls(client, seed=0, tool_choice="auto", extra_body=extra)
    assert (content, finish) == ("Let me check.", "tool_calls")  # no markup leaked
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call["arguments"])]


def test_a_two_turn_tool_loop_on_smollm2s_own_template(server, client, llm):
    """What every agent framework sends: a required call, then the turn with its result
    (the assistant message's content null, or missing), with "auto". The protocol holds:
    no error, and any call the model makes names a tool and validates."""
    assert llm.llm_engine.chat_template == SMOLLM2_TEMPLATE
    (first,) = ask(client, tool_choice="required", seed=0, parallel_tool_calls=False).choices
    (call,) = plain(first.message)
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    made = {"id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}  # fmt: skip
    result = {"role": "tool", "tool_call_id": call["id"], "content": '{"answer": 21}'}
    null = {"role": "assistant", "content": None, "tool_calls": [made]}
    missing = {"role": "assistant", "tool_calls": [made]}
    for assistant, stream in ((null, False), (null, True), (missing, False)):
        body = {"model": "smollm2", "messages": [*ASK, assistant, result], "tools": TOOLS,
                "tool_choice": "auto", "max_tokens": 24, "seed": 0, "stream": stream}  # fmt: skip
        r = httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
            continue
        (choice,) = r.json()["choices"]
        for c in choice["message"].get("tool_calls") or ():
            assert c["function"]["name"] in SCHEMAS
            json.loads(c["function"]["arguments"])
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")


def r_json(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenizer_info_describes_smollm2s_tokenizer(server, llm):
    info = r_json(httpx.get(server.http_url + "/tokenizer_info", timeout=60))
    engine = llm.llm_engine
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == (engine.bos_token, engine.eos_token)
    assert (info["add_bos_token"], info["add_eos_token"]) == (False, False)
    assert info["model_max_length"] == 512 and info["chat_template"] == SMOLLM2_TEMPLATE
    decoder = info["added_tokens_decoder"]
    assert decoder["0"]["content"] == "<|endoftext|>" and decoder["0"]["special"] is True
    assert decoder["2"]["content"] == "<|im_end|>"
    assert set(decoder) == {str(t) for t in engine.tokenizer.backend.get_added_tokens_decoder()}


def test_tool_choice_none_leaves_the_text_as_content(client):
    extra = {"structured_outputs": {"regex": PINNED}}
    (choice,) = ask(client, seed=0, tool_choice="none", extra_body=extra).choices
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content.startswith("Let me check.\n<tool_call>\n")


HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather",
                  "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]  # fmt: skip


def test_a_tool_result_turn_renders_with_the_tools(server, client, llm):
    """The history (arguments as JSON text) renders as the template renders the objects;
    /tokenize, the chat call and LLM.chat agree on it."""
    as_objects = [dict(m) for m in HISTORY]
    as_objects[1] = {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}  # fmt: skip
    text = render_chat(QWEN25_TEMPLATE, as_objects, tools=TOOLS, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' in text
    assert "<tool_response>\n" + '{"temperature": 21}' + "\n</tool_response>" in text
    assert json.dumps(TOOLS[1]) in text
    ids = llm.get_tokenizer().encode(text)
    body = {"messages": HISTORY, "tools": TOOLS, "chat_template": QWEN25_TEMPLATE}
    r = httpx.post(server.http_url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    reply = client.chat.completions.create(
        model="smollm2", messages=HISTORY, tools=TOOLS, max_tokens=4, tool_choice="none",
        extra_body={"chat_template": QWEN25_TEMPLATE},
    )  # fmt: skip
    assert reply.usage.prompt_tokens == len(ids)
    (out,) = llm.chat(HISTORY, llm.get_default_sampling_params().clone(max_tokens=1),
                      chat_template=QWEN25_TEMPLATE, tools=TOOLS)  # fmt: skip
    assert out.prompt == text and out.prompt_token_ids == ids


def test_chat_prompt_logprobs_are_the_engines(server, llm):
    """vLLM's prompt_logprobs on chat: each prompt token after the first with its logprob,
    the 2 most likely, their ranks and texts, as the offline engine computes them."""
    ids = llm.llm_engine.chat_prompt(ASK)[1]
    (want,) = llm.generate([ids], llm.get_default_sampling_params().clone(
        max_tokens=1, prompt_logprobs=2))  # fmt: skip
    body = {"messages": ASK, "max_tokens": 1, "prompt_logprobs": 2}
    r = httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=60)
    got = r.json()["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None and want.prompt_logprobs[0] is None
    decode = llm.get_tokenizer().decode
    for t, position, entry in zip(ids[1:], want.prompt_logprobs[1:], got[1:], strict=True):
        best = sorted(position.items(), key=lambda kv: -kv[1])
        top = [k for k, _ in best if k != t][:2] if len(position) > 2 else [k for k, _ in best]
        assert list(entry) == list(dict.fromkeys(map(str, [t, *top])))
        assert sorted(v["rank"] for v in entry.values() if v["rank"] is not None) == [1, 2]
        for k, v in entry.items():
            rank = top.index(int(k)) + 1 if int(k) in top else None
            assert v == {
                "logprob": position[int(k)],
                "rank": rank,
                "decoded_token": decode([int(k)], skip_special_tokens=False),
            }
    stream = httpx.post(server.http_url + "/v1/chat/completions",
                        json={**body, "stream": True}, timeout=60)  # fmt: skip
    assert (stream.status_code, stream.json()["error"]["param"]) == (400, "prompt_logprobs")


# ---- gRPC Chat ----------------------------------------------------------------------------

PB_TOOLS = [
    pb.Tool(function=pb.FunctionDefinition(
        name=t["function"]["name"], description=t["function"]["description"],
        parameters=json.dumps(t["function"]["parameters"])))
    for t in TOOLS
]  # fmt: skip


def grpc_chat(server, messages=None, **fields):
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 1.0, **fields.pop("sampling")}
    messages = messages or [pb.ChatMessage(role="user", content=ASK[0]["content"])]
    request = pb.ChatRequest(messages=messages, tools=PB_TOOLS,
                             sampling=pb.SamplingParameters(**sampling), **fields)  # fmt: skip
    return collect_chat(server.stub, request, timeout=300)


def test_grpc_named_and_required_calls_validate_and_equal_http(server, client):
    cases = [  # (gRPC tool_choice, HTTP's, finish_reason)
        (pb.ToolChoice(function=pb.FunctionName(name="get_weather")), NAMED,
         pb.FINISH_REASON_STOP),
        (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), "required",
         pb.FINISH_REASON_TOOL_CALLS),
    ]  # fmt: skip
    for choice, http_choice, finish in cases:
        for seed in (0, 1):
            got = grpc_chat(server, tool_choice=choice, parallel_tool_calls=False,
                            sampling={"seed": seed})  # fmt: skip
            assert got.content == {0: ""} and got.finish_reason == {0: finish}
            (call,) = got.final_calls[0]
            assert got.calls == got.final_calls and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
            (want,) = ask(client, tool_choice=http_choice, seed=seed,
                          parallel_tool_calls=False).choices  # fmt: skip
            assert plain(want.message)[0]["name"] == call["name"]
            assert plain(want.message)[0]["arguments"] == call["arguments"]


def test_grpc_history_renders_with_the_tools(server, llm):
    """HISTORY (a call and its result) as proto messages renders as the template renders
    it with the tools (the prompt tokens of test_a_tool_result_turn_renders_with_the_tools)."""
    body = {"messages": HISTORY, "tools": TOOLS, "chat_template": QWEN25_TEMPLATE}
    want = httpx.post(server.http_url + "/tokenize", json=body, timeout=60).json()["count"]
    (user, assistant, tool) = HISTORY
    function = assistant["tool_calls"][0]["function"]
    messages = [
        pb.ChatMessage(role="user", content=user["content"]),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
            id="call_1", function=pb.FunctionCall(**function))]),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content=tool["content"]),
    ]  # fmt: skip
    none = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)
    got = grpc_chat(server, messages, tool_choice=none, chat_template=QWEN25_TEMPLATE,
                    sampling={"max_tokens": 1})  # fmt: skip
    assert got.usage.prompt_tokens == want and got.usage.completion_tokens == 1
