"""Tools, tool_choice and the small endpoints over HTTP on the fake engine: each bad input is
a 400 naming its field and the server serves on; "auto" with no flags, the tools and a tool
history added (in the documented format) to a template that renders none of them, SmolLM2's
own among them; a chat template's errors as 400s naming the message; response_format under
a forced tool call; /tokenize, /detokenize, /tokenizer_info and /v1/models in vLLM's shapes;
continuous usage stats and json_schema's strict and description."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import FakeEngine
from serving_helpers import sse_events
from tool_templates import QWEN25_TEMPLATE, SMOLLM2_TEMPLATE

from models.chat_template import render_chat

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture
def tool_server(make_server):
    # No flags: "auto" works without them. The fake template renders no tools, so they ride
    # in a system message: room for it.
    return make_server(FakeEngine(max_model_len=512))


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
        chat(tools=TOOLS, tool_choice="required", structured_outputs={"json_object": True}),
        "tool_choice",
        (
            "tool_choice required or a named function decodes under the tools' schemas: it "
            "cannot be combined with structured_outputs or guided_*"
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


# The system message the tools ride in when the template renders none (server/tool_prompts.py)
TOOLS_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0])
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def test_auto_needs_no_flags_and_the_tools_reach_the_prompt(tool_server):
    engine = tool_server.engine
    want = engine.chat_prompt([{"role": "system", "content": TOOLS_TEXT}, *ASK])[1]
    r = post(tool_server, "/tokenize", {"messages": ASK, "tools": TOOLS})
    assert r.json()["tokens"] == want
    for choice in ("auto", None):  # unset with tools: auto, OpenAI's default
        body = chat(tools=TOOLS) if choice is None else chat(tools=TOOLS, tool_choice=choice)
        r = post(tool_server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        (out,) = r.json()["choices"]
        # the fake model answers in text: "auto" leaves it content (hermes found no call)
        assert out["message"]["content"].startswith(" t") and "tool_calls" not in out["message"]
        assert out["finish_reason"] in ("stop", "length")  # not tool_calls
        assert r.json()["usage"]["prompt_tokens"] == len(want)
    # A system message of the client's own gets the tools after it.
    system = [{"role": "system", "content": "Be brief."}, *ASK]
    r = post(tool_server, "/tokenize", {"messages": system, "tools": TOOLS})
    merged = [{"role": "system", "content": "Be brief.\n\n" + TOOLS_TEXT}, *ASK]
    assert r.json()["tokens"] == engine.chat_prompt(merged)[1]
    # A template that renders the tools itself gets nothing added.
    r = post(tool_server, "/tokenize", {"messages": ASK, "tools": TOOLS,
                                        "chat_template": QWEN25_TEMPLATE})  # fmt: skip
    own = render_chat(QWEN25_TEMPLATE, ASK, tools=TOOLS, add_generation_prompt=True)
    assert r.json()["tokens"] == engine.tokenizer.encode(own)


# The turn after tool calls as agent frameworks send it: the assistant message that made
# a call has "content": null (the openai client) or no content at all (others).
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "assistant", "content": "It is 21 C."},
    {"role": "user", "content": "And Rome and Oslo?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "call_3", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
    {"role": "tool", "tool_call_id": "call_3", "content": "9 C"},
]  # fmt: skip


def test_a_tool_history_renders_with_smollm2s_template(tool_server):
    """SmolLM2's template concatenates content and renders no tools or calls: null and
    missing content render as "", the calls are written into the assistant turns in the
    hermes syntax, the results come back as user turns, the tools as the system message."""
    body = chat(messages=TOOL_TURNS, tools=TOOLS, chat_template=SMOLLM2_TEMPLATE)
    want = (
        f"<|im_start|>system\n{TOOLS_TEXT}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 21 C.<|im_end|>\n"
        "<|im_start|>user\nAnd Rome and Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Rome"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n25 C\n</tool_response>\n<tool_response>\n"
        "9 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tool_server.engine.tokenizer.encode(want)
    r = post(tool_server, "/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids
    for stream in (False, True):
        for choice in ("auto", "none", "required"):
            r = post(tool_server, "/v1/chat/completions",
                     {**body, "tool_choice": choice, "stream": stream})  # fmt: skip
            assert r.status_code == 200, (choice, r.text)
            if not stream:
                assert r.json()["usage"]["prompt_tokens"] == len(ids)


RAISES = ("{% for m in messages %}{% if m.name %}{{ raise_exception('no names: ' + m.name) }}"
          "{% endif %}{{ m.content }} {% endfor %}")  # fmt: skip
ADDS = "{% for m in messages %}{{ m.content + m.n | default('') }} {% endfor %}"


def test_a_template_error_is_a_400_naming_the_message(tool_server):
    """Whatever the template raises: its words, and the client's message it was reading
    (messages[2] stays messages[2] with the tools' system message put before it)."""
    named = [*ASK, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "again", "name": "bob"}]  # fmt: skip
    numbered = [*ASK, {"role": "assistant", "content": "ok", "n": "1"},
                {"role": "user", "content": "again", "n": 2}]  # fmt: skip
    cases = [
        (RAISES, named, "messages[2]: chat template error: no names: bob"),
        (ADDS, numbered, ('messages[2]: chat template error: TypeError: can only concatenate '
                          'str (not "int") to str (template line 1)')),
    ]  # fmt: skip
    for template, messages, message in cases:
        for tools in (None, TOOLS):
            for path, body in [
                ("/v1/chat/completions", chat(messages=messages, chat_template=template)),
                ("/v1/chat/completions", chat(messages=messages, chat_template=template,
                                              stream=True)),
                ("/tokenize", {"messages": messages, "chat_template": template}),
            ]:  # fmt: skip
                r = post(tool_server, path, {**body, **({"tools": tools} if tools else {})})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert (error["message"], error["param"]) == (message, "messages[2]")
    r = post(tool_server, "/v1/chat/completions", chat(messages=TOOL_TURNS, tools=TOOLS))
    assert r.status_code == 200  # the server serves on


def test_response_format_yields_to_a_forced_tool_call(tool_server):
    """OpenAI's behaviour: required or named tool_choice decodes under the tools' grammar
    that turn, whatever response_format asks (it governs the turn that answers in text)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "array"}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = post(tool_server, "/v1/chat/completions",
             chat(tools=TOOLS, tool_choice=named, response_format=fmt))  # fmt: skip
    assert r.status_code == 200, r.text
    params, _ = list(tool_server.engine.received.values())[-1]
    assert params.structured_outputs.json == WEATHER
    r = post(tool_server, "/v1/chat/completions",
             chat(tools=TOOLS, tool_choice="required", response_format=fmt))  # fmt: skip
    assert r.status_code == 200, r.text
    params, _ = list(tool_server.engine.received.values())[-1]
    assert params.structured_outputs.json["items"]["properties"]["name"] == {"const": "get_weather"}
    # with auto the format governs the turn
    post(tool_server, "/v1/chat/completions", chat(tools=TOOLS, response_format=fmt))
    params, _ = list(tool_server.engine.received.values())[-1]
    assert params.structured_outputs.json == {"type": "array"}


def test_named_choice_on_the_fake_engine_is_the_whole_text(tool_server):
    """The fake engine runs no grammar: its text becomes the named call's arguments, which
    shows how text maps to the call (the real model's tests check validity)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = post(tool_server, "/v1/chat/completions", chat(tools=TOOLS, tool_choice=named, seed=1))
    (choice,) = r.json()["choices"]
    # the same prompt (the tools ride in it whatever tool_choice is) and seed, no grammar
    plain = chat(tools=TOOLS, tool_choice="none", seed=1)
    text = post(tool_server, "/v1/chat/completions", plain).json()["choices"][0]
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
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True,
           "description": "The weather, as pydantic-ai's NativeOutput describes it"}}  # fmt: skip
    r = post(server, "/v1/chat/completions", chat(response_format=fmt))
    assert r.status_code == 200  # the fake engine runs no grammar; the fields are accepted
    params, _ = list(server.engine.received.values())[-1]
    assert params.structured_outputs.json == WEATHER
    # the description is not shown to the model: the prompt is the conversation's alone
    assert r.json()["usage"]["prompt_tokens"] == len(server.engine.chat_prompt(ASK)[1])
