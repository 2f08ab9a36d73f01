"""Tools, tool_choice and the small endpoints over HTTP on the fake engine: each bad input is
a 400 naming its field and the server serves on; /tokenize, /detokenize and /v1/models in
vLLM's shapes; continuous usage stats and json_schema's strict."""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import sse_events

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture
def tool_server(make_server):
    return make_server(tool_call_parser="hermes", enable_auto_tool_choice=True)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=30)


def chat(**body) -> dict:
    return {"messages": ASK, "max_tokens": 3, **body}


NAMED_UNKNOWN = {"type": "function", "function": {"name": "get_time"}}
BAD_SCHEMA = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
TOOL_WITHOUT_ID = [*ASK, {"role": "tool", "content": "21 degrees"}]
BAD_ARGUMENTS = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]  # fmt: skip

BAD = [
    (
        chat(tools=BAD_SCHEMA),
        "tools[0].function.parameters",
        "tools[0].function.parameters: invalid JSON schema: Invalid type: objekt",
    ),
    (
        chat(tools=TOOLS, tool_choice=NAMED_UNKNOWN),
        "tool_choice.function.name",
        "tool_choice.function.name: 'get_time' is not one of the tools ('get_weather')",
    ),
    (
        chat(tool_choice="required"),
        "tool_choice",
        'tool_choice "required" needs tools: the request has none',
    ),
    (
        chat(tool_choice=NAMED_UNKNOWN),
        "tool_choice",
        "tool_choice a named function needs tools: the request has none",
    ),
    (
        chat(messages=TOOL_WITHOUT_ID),
        "messages[1].tool_call_id",
        "messages[1].tool_call_id: a tool message needs the id of the call it answers",
    ),
    (
        chat(messages=BAD_ARGUMENTS),
        "messages[1].tool_calls[0].function.arguments",
        "messages[1].tool_calls[0].function.arguments: not valid JSON",
    ),
    (
        chat(tools=[*TOOLS, *TOOLS]),
        "tools[1].function.name",
        "tools[1].function.name: 'get_weather' is also tools[0]'s name",
    ),
    (
        chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        "tool_choice",
        (
            "tool_choice required or a named function decodes under the tools' schemas: it "
            "cannot be combined with response_format, structured_outputs or guided_*"
        ),
    ),
]


def test_bad_tool_inputs_are_400s_naming_the_field(tool_server):
    for body, param, message in BAD:
        r = post(tool_server, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["message"] == message
        for stream in (False, True):  # the server serves on
            r = post(tool_server, "/v1/chat/completions", chat(tools=TOOLS, stream=stream))
            assert r.status_code == 200, r.text


def test_auto_needs_the_server_flags(server):
    r = post(server, "/v1/chat/completions", chat(tools=TOOLS, tool_choice="auto"))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"
    assert r.json()["error"]["message"].startswith(
        'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
        "--tool-call-parser"
    )
    # tools without tool_choice: "none" on such a server, the text is content
    r = post(server, "/v1/chat/completions", chat(tools=TOOLS))
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": message["content"]}
    assert message["content"].startswith(" t")


def test_named_choice_on_the_fake_engine_is_the_whole_text(tool_server):
    """The fake engine runs no grammar: its text becomes the named call's arguments, which
    shows how text maps to the call (the real model's tests check validity)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = post(tool_server, "/v1/chat/completions", chat(tools=TOOLS, tool_choice=named, seed=1))
    (choice,) = r.json()["choices"]
    text = post(tool_server, "/v1/chat/completions", chat(seed=1)).json()["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["message"]["content"] is None
    assert call["function"] == {"name": "get_weather", "arguments": text["message"]["content"]}
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert choice["finish_reason"] == "length"


def test_tokenize_and_detokenize(server):
    r = post(server, "/tokenize", {"model": "fake", "prompt": "t5 t6 t7"})
    assert r.json() == {"count": 3, "max_model_len": 64, "tokens": [5, 6, 7], "token_strs": None}
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "t9"}],
                                   "return_token_strs": True})  # fmt: skip
    ids = server.engine.chat_prompt([{"role": "user", "content": "t9"}])[1]
    assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                        "token_strs": [f" t{t}" for t in ids]}  # fmt: skip
    assert post(server, "/detokenize", {"tokens": [5, 2, 7]}).json() == {"prompt": " t5</s> t7"}
    for path, body, param in [
        ("/detokenize", {"tokens": [5, 1000]}, "tokens"),
        ("/tokenize", {"prompt": "t1", "messages": ASK}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": ASK, "chat_template_kwargs": {"messages": 1}},
         "chat_template_kwargs"),
    ]:  # fmt: skip
        r = post(server, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    r = post(server, "/tokenize", {"model": "other", "prompt": "t1"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


def test_models_list_max_model_len(server):
    (card,) = httpx.get(server.http_url + "/v1/models", timeout=30).json()["data"]
    assert card["max_model_len"] == 64


def test_continuous_usage_stats_and_strict_json_schema(server):
    body = chat(max_tokens=3, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})  # fmt: skip
    events = sse_events(post(server, "/v1/chat/completions", body).text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]  # in every chunk
    assert counts == sorted(counts) and counts[-1] == 3
    seen = 0  # each chunk counts at least the tokens sent so far
    for event, count in zip(events[:-2], counts, strict=False):
        seen += len((event["choices"][0]["delta"].get("content") or "").split())
        assert count >= seen
    assert seen == 3
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    r = post(server, "/v1/chat/completions", chat(response_format=fmt))
    assert r.status_code == 200  # the fake engine runs no grammar; the field is accepted
    params, _ = list(server.engine.received.values())[-1]
    assert params.structured_outputs.json == WEATHER
