"""The Responses API (/v1/responses) on the fake engine: the response object and the streamed
events exactly (each parsed by the openai client's own types), tool calls read by the hermes
parser from a scripted text (streamed and not), the conversation each turn renders (the
exact prompt the engine got: previous_response_id, instructions, items sent back), the
store (store: false, LRU eviction at its size, GET, DELETE, 404s), bad inputs as 400s naming
the Responses field, ignored fields, an engine error as response.failed, a client that goes
away aborting its request; with --reasoning-parser, the reasoning as a reasoning item before
the message and calls (streamed and not), a call inside the reasoning left there."""

from __future__ import annotations

import json
import logging
import re

import httpx
import openai
import pytest
from fake_engine import EOS_TOKEN_ID, FakeEngine
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from serving_helpers import openai_client

from server import openai_fields

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME},
]  # fmt: skip
# Two calls after some content, in hermes' format (test_grpc_chat.py's script)
CALLING = [
    "I will look.",
    " <tool_call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}\n</tool_call>',
    "\n<tool_call>\n",
    '{"name": "get_time", "arguments": {"zone": "CET"}}',
    "\n</tool_call>",
]
ANSWER = ["It is", " sunny."]
# Writes every message's role, content, tool calls (id, name, arguments) and the call a tool
# message answers, and the tools' names, so that a prompt shows the whole conversation (and
# the server adds nothing to it: server/tool_prompts.py); its calls are hermes'.
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} <tool_call>{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
)


class Engine(FakeEngine):
    """The fake engine with TEMPLATE, recording every rendered prompt and the tools it was
    given; a request added while `scripts` holds one says it (one piece per token, then
    EOS)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{"max_model_len": 256, **kwargs})
        self.chat_template = TEMPLATE
        self.prompts: list[str] = []
        self.tools: list[list | None] = []
        self.scripts: list[list[str]] = []
        self._said: dict[str, list[str]] = {}

    def chat_prompt(self, messages, **kwargs):
        text, ids = super().chat_prompt(messages, **kwargs)
        self.prompts.append(text)
        self.tools.append(kwargs.get("tools"))
        return text, ids

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        super().add_request(request_id, prompt, params, **kwargs)
        if self.scripts:
            self._said[request_id] = self.scripts.pop(0)

    def _append_token(self, r, c) -> None:
        script = self._said.get(r.request_id)
        if script is None:
            return super()._append_token(r, c)
        i = len(c.token_ids)
        c.token_ids.append(10 + i if i < len(script) else EOS_TOKEN_ID)
        if self._pages_for(len(r.prompt_ids) + len(c.token_ids)) > len(c.page_ids):
            self._take_pages(c, 1)
        if i == len(script):
            c.finish_reason = "stop"
            return
        c.text += script[i]
        if r.params.max_tokens is not None and len(c.token_ids) >= r.params.max_tokens:
            c.finish_reason = "length"
        return None


@pytest.fixture
def server(make_server):
    return make_server(Engine(), tool_call_parser="hermes", enable_auto_tool_choice=True)


def post(server, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=30)


def create(server, **body) -> dict:
    r = post(server, {"temperature": 0, **body})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # strictly OpenAI's shape
    return r.json()


def streamed(server, **body) -> list[dict]:
    """The events of a streamed response, each checked against OpenAI's types and its SSE
    event name."""
    body = {"temperature": 0, **body, "stream": True}
    events, name = [], None
    with httpx.stream("POST", server.http_url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == name
                EVENT.validate_python(event)
                events.append(event)
            else:
                assert not line, line
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def kinds(events: list[dict]) -> list[str]:
    """Event types, a run of deltas as one (how text batches into deltas is timing)."""
    out: list[str] = []
    for e in events:
        t = e["type"].removeprefix("response.")
        if not (t.endswith(".delta") and out and out[-1] == t):
            out.append(t)
    return out


def fixed(response: dict) -> dict:
    """response with its ids and times checked and blanked."""
    assert re.fullmatch(r"resp_[0-9a-f]{48}", response["id"])
    for item in response["output"]:
        assert re.fullmatch(r"(msg|fc|rs)_[0-9a-f]{48}", item["id"])
    assert isinstance(response["created_at"], int)
    out = json.loads(json.dumps(response))
    out["id"] = out["created_at"] = "-"
    out["completed_at"] = "-" if out["completed_at"] is not None else None
    for item in out["output"]:
        item["id"] = "-"
        if item["type"] == "function_call":
            assert re.fullmatch(r"call_[0-9a-f]{24}", item["call_id"])
            item["call_id"] = "-"
    return out


def usage(input_tokens: int, output_tokens: int, cached: int = 0, reasoning: int = 0) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input_tokens + output_tokens,
    }


def message(text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    return {"id": "-", "type": "message", "status": status, "content": [part], "role": "assistant"}


def function_call(name: str, arguments: str) -> dict:
    return {"id": "-", "type": "function_call", "status": "completed", "arguments": arguments,
            "call_id": "-", "name": name}  # fmt: skip


BASE = {
    "object": "response",
    "background": False,
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "model": "fake",
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None},
    "service_tier": "default",
    "store": True,
    "temperature": 0.0,
    "text": {"format": {"type": "text"}, "verbosity": "medium"},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
    "metadata": {},
}


def test_a_text_response_is_openais_object(server):
    server.engine.scripts.append(ANSWER)
    got = create(server, model="fake", input="hi", instructions="Be brief.", top_p=0.5)
    assert server.engine.prompts == ["system: Be brief.\nuser: hi\n"]
    assert fixed(got) == {
        **BASE,
        "id": "-",
        "created_at": "-",
        "completed_at": "-",
        "status": "completed",
        "instructions": "Be brief.",
        "top_p": 0.5,
        "output": [message("It is sunny.")],
        "usage": usage(5, 3),  # 2 pieces and EOS
    }
    # the openai client reads it; its output_text joins the message's text
    r = openai_client(server).responses.create(model="fake", input="t5 t6", max_output_tokens=3,
                                               temperature=0)  # fmt: skip
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert server.engine.prompts[-1] == "user: t5 t6\n"
    ids = server.engine.tokenizer.encode("user: t5 t6")
    assert r.output_text == "".join(f" t{(sum(ids) + i) % 1000}" for i in range(3))
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    assert r.max_output_tokens == 3


def test_the_streamed_events(server):
    server.engine.scripts.append(ANSWER)
    events = streamed(server, input="hi", max_output_tokens=10)
    assert kinds(events) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.done", "content_part.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"] == final["id"]
    assert events[1]["response"] == created
    item_id = final["output"][0]["id"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "It is sunny."
    assert all((e["item_id"], e["output_index"], e["content_index"]) == (item_id, 0, 0)
               for e in deltas)  # fmt: skip
    added = events[2]["item"]
    assert added == {"id": item_id, "type": "message", "status": "in_progress", "content": [],
                     "role": "assistant"}  # fmt: skip
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
    assert events[3]["part"] == part
    done = [e for e in events if e["type"].endswith(".done")]
    assert done[0]["text"] == "It is sunny."
    assert done[1]["part"] == {**part, "text": "It is sunny."}
    assert done[2]["item"] == final["output"][0]
    assert fixed(final) == {**BASE, "id": "-", "created_at": "-", "completed_at": "-",
                            "status": "completed", "max_output_tokens": 10,
                            "output": [message("It is sunny.")], "usage": usage(2, 3)}  # fmt: skip
    # the stored response is what response.completed carried
    assert post_get(server, final["id"]).json() == final
    # the openai client's own stream accumulates the same response
    server.engine.scripts.append(ANSWER)
    with openai_client(server).responses.stream(model="fake", input="hi") as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert final.output_text == "It is sunny." and final.status == "completed"


# deepseek_r1's output starts inside the reasoning; a call written there stays reasoning
THINKING = ["Let me", " think.", "</think>", "\n\n", *ANSWER]
THINKING_CALLS = ["Call it? <tool_call>\n", '{"name": "get_time", "arguments": {}}',
                  "\n</tool_call>", "</think>", "\n\n", *CALLING[1:]]  # fmt: skip


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": "-", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip


@pytest.fixture
def reasoning_server(make_server):
    return make_server(Engine(), reasoning_parser="deepseek_r1", tool_call_parser="hermes",
                       enable_auto_tool_choice=True)  # fmt: skip


def test_reasoning_is_an_item_before_the_message(reasoning_server):
    reasoning_server.engine.scripts.append(THINKING)
    got = create(reasoning_server, input="hi")
    assert fixed(got) == {**BASE, "id": "-", "created_at": "-", "completed_at": "-",
                          "status": "completed",
                          "output": [reasoning_item("Let me think."), message("It is sunny.")],
                          "usage": usage(2, 7, reasoning=3)}  # fmt: skip
    # 6 pieces and EOS; the reasoning "Let me", " think.", "</think>"
    # the stored conversation leaves the reasoning out, as chat templates do
    reasoning_server.engine.scripts.append(ANSWER)
    create(reasoning_server, input="and?", previous_response_id=got["id"])
    assert reasoning_server.engine.prompts[-1] == "user: hi\nassistant: It is sunny.\nuser: and?\n"


def test_reasoning_streamed(reasoning_server):
    reasoning_server.engine.scripts.append(THINKING)
    events = streamed(reasoning_server, input="hi")
    assert kinds(events) == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert fixed(final)["output"] == [reasoning_item("Let me think."), message("It is sunny.")]
    assert final["usage"] == usage(2, 7, reasoning=3)
    item = final["output"][0]
    assert events[2]["item"] == {**item, "content": [], "status": "in_progress"}
    part = {"type": "reasoning_text", "text": ""}
    assert events[3]["part"] == part
    where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert all({k: e[k] for k in where} == where for e in deltas)
    assert "".join(e["delta"] for e in deltas) == "Let me think."
    done = [e for e in events if e.get("output_index") == 0 and e["type"].endswith(".done")]
    seq = [e.pop("sequence_number") for e in done]
    assert seq == sorted(seq)
    assert done == [
        {"type": "response.reasoning_text.done", **where, "text": "Let me think."},
        {"type": "response.content_part.done", **where, "part": {**part, "text": "Let me think."}},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
    ]
    texts = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(texts) == "It is sunny."
    # the openai client's own stream accumulates the same response
    reasoning_server.engine.scripts.append(THINKING)
    with openai_client(reasoning_server).responses.stream(model="fake", input="hi") as stream:
        got = stream.get_final_response()
    assert [i.type for i in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == "Let me think." and got.output_text == "It is sunny."


def test_a_call_inside_the_reasoning_stays_reasoning(reasoning_server):
    thought = 'Call it? <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    calls = [function_call("get_weather", '{"city": "Paris"}'),
             function_call("get_time", '{"zone": "CET"}')]  # fmt: skip
    reasoning_server.engine.scripts.append(THINKING_CALLS)
    got = create(reasoning_server, input="Weather?", tools=TOOLS)
    assert fixed(got)["output"] == [reasoning_item(thought), *calls]
    reasoning_server.engine.scripts.append(THINKING_CALLS)
    events = streamed(reasoning_server, input="Weather?", tools=TOOLS)
    assert fixed(events[-1]["response"])["output"] == [reasoning_item(thought), *calls]
    assert kinds(events)[2:9] == [
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done", "output_item.added",
    ]  # fmt: skip
    assert events[8]["item"]["type"] == "function_call"


def post_get(server, response_id: str) -> httpx.Response:
    return httpx.get(f"{server.http_url}/v1/responses/{response_id}", timeout=30)


def test_a_response_cut_short_streams_response_incomplete(server):
    events = streamed(server, input="t5 t6", max_output_tokens=2)
    assert kinds(events)[-2:] == ["output_item.done", "incomplete"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["completed_at"] is None


def test_tool_calls(server):
    server.engine.scripts.append(CALLING)
    got = create(server, input="Weather and time in Paris?", tools=TOOLS)
    assert fixed(got) == {
        **BASE,
        "id": "-",
        "created_at": "-",
        "completed_at": "-",
        "status": "completed",
        "output": [
            message("I will look."),
            function_call("get_weather", '{"city": "Paris"}'),
            function_call("get_time", '{"zone": "CET"}'),
        ],
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER,
                "strict": True,
            },
            {
                "type": "function",
                "name": "get_time",
                "description": None,
                "parameters": TIME,
                "strict": None,
            },
        ],
        "usage": usage(9, 9),  # 8 pieces and EOS
    }
    assert server.engine.prompts == [
        "tools: get_weather get_time\nuser: Weather and time in Paris?\n"
    ]
    # the template got the tools in the chat shape
    assert server.engine.tools[-1] == [
        {"type": "function", "function": {"name": "get_weather",
         "description": "Weather in a city", "parameters": WEATHER, "strict": True}},
        {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    ]  # fmt: skip
    calls = got["output"][1:]
    assert calls[0]["call_id"] != calls[1]["call_id"]


def test_tool_calls_streamed(server):
    server.engine.scripts.append(CALLING)
    events = streamed(server, input="Weather and time in Paris?", tools=TOOLS)
    call_events = [
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done",
    ]  # fmt: skip
    assert kinds(events) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.done", "content_part.done", "output_item.done",
        *call_events, *call_events, "completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    for index, arguments in ((1, '{"city": "Paris"}'), (2, '{"zone": "CET"}')):
        item = final["output"][index]
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["item"] == {**item, "status": "in_progress", "arguments": ""}
        deltas = [e["delta"] for e in mine if e["type"].endswith("arguments.delta")]
        assert "".join(deltas) == arguments == item["arguments"]
        assert mine[-2] == {"type": "response.function_call_arguments.done",
                            "item_id": item["id"], "output_index": index,
                            "name": item["name"], "arguments": arguments, "sequence_number": mine[-2]["sequence_number"]}  # fmt: skip
        assert mine[-1]["item"] == item
    # the same through the openai client's stream
    server.engine.scripts.append(CALLING)
    with openai_client(server).responses.stream(model="fake", input="Weather?",
                                                tools=TOOLS) as stream:  # fmt: skip
        got = stream.get_final_response()
    assert [(i.name, i.arguments) for i in got.output[1:]] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]  # fmt: skip


def test_named_tool_choice_makes_the_whole_text_the_call(server):
    """The fake engine runs no grammar: its text is the named call's arguments."""
    got = create(server, input="t5", tools=TOOLS, max_output_tokens=2,
                 tool_choice={"type": "function", "name": "get_time"})  # fmt: skip
    assert server.engine.prompts[-1] == "tools: get_weather get_time\nuser: t5\n"
    ids = server.engine.tokenizer.encode(server.engine.prompts[-1])
    text = "".join(f" t{(sum(ids) + i) % 1000}" for i in range(2))
    (call,) = got["output"]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "get_time", text)
    assert call["status"] == "incomplete" and got["status"] == "incomplete"
    assert got["tool_choice"] == {"type": "function", "name": "get_time"}
    got = create(server, input="t5", tools=TOOLS, max_output_tokens=2, tool_choice="none")
    assert got["output"][0]["content"][0]["text"] == text  # "none": the text is content


def test_the_tool_loop_renders_each_turn(server):
    """Turn two by previous_response_id renders as turn two that sends every item back (what
    the Agents SDK does), the calls joined to the content before them."""
    engine = server.engine
    engine.scripts += [CALLING, ANSWER, ANSWER]
    first = create(server, input="Weather?", tools=TOOLS, instructions="Use tools.")
    calls = first["output"][1:]
    results = [
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "21 C"},
        {"type": "function_call_output", "call_id": calls[1]["call_id"],
         "output": [{"type": "input_text", "text": "09:00"}]},
    ]  # fmt: skip
    chained = create(server, input=results, tools=TOOLS, previous_response_id=first["id"],
                     instructions="Use tools.")  # fmt: skip
    sent_back = create(server, input=[{"role": "user", "content": "Weather?"},
                                      *first["output"], *results],
                       tools=TOOLS, instructions="Use tools.")  # fmt: skip
    ids = [c["call_id"] for c in calls]
    assert (
        engine.prompts[1:]
        == [
            (
                "tools: get_weather get_time\n"
                "system: Use tools.\n"
                "user: Weather?\n"
                f'assistant: I will look. <tool_call>{ids[0]} get_weather {{"city": "Paris"}}</tool_call> '
                f'<tool_call>{ids[1]} get_time {{"zone": "CET"}}</tool_call>\n'
                f"tool: 21 C ({ids[0]})\n"
                f"tool: 09:00 ({ids[1]})\n"
            )
        ]
        * 2
    )
    for got in (chained, sent_back):
        assert got["output"][0]["content"][0]["text"] == "It is sunny."
    assert chained["previous_response_id"] == first["id"]
    # the client parses and re-sends its own output items
    client = openai_client(server)
    engine.scripts += [CALLING, ANSWER]
    r1 = client.responses.create(model="fake", input="Weather?", tools=TOOLS)
    items = [{"role": "user", "content": "Weather?"}]
    items += [o.model_dump(exclude_none=True) for o in r1.output]
    items += [{"type": "function_call_output", "call_id": o.call_id, "output": "x"}
              for o in r1.output if o.type == "function_call"]  # fmt: skip
    r2 = client.responses.create(model="fake", input=items, tools=TOOLS)
    assert r2.output_text == "It is sunny."
    assert engine.prompts[-1].startswith("tools: get_weather get_time\nuser: Weather?\n")
    assert engine.prompts[-1].endswith(f"tool: x ({r1.output[2].call_id})\n")


def test_previous_response_id_continues_the_stored_conversation(server):
    engine = server.engine
    one = create(server, input="t5", instructions="Be brief.", max_output_tokens=2)
    two = create(server, input="t7", previous_response_id=one["id"], max_output_tokens=2)
    three = create(server, input=[{"role": "user", "content": [{"type": "input_text",
                   "text": "t9"}]}], previous_response_id=two["id"], max_output_tokens=2)  # fmt: skip
    four = create(server, input="t3", previous_response_id=three["id"], max_output_tokens=1,
                  instructions="Now terse.")  # fmt: skip
    a, b, c = (r["output"][0]["content"][0]["text"] for r in (one, two, three))
    # instructions are not carried over (OpenAI's rule); new ones go first
    assert engine.prompts == [
        "system: Be brief.\nuser: t5\n",
        f"user: t5\nassistant: {a}\nuser: t7\n",
        f"user: t5\nassistant: {a}\nuser: t7\nassistant: {b}\nuser: t9\n",
        (
            f"system: Now terse.\nuser: t5\nassistant: {a}\nuser: t7\nassistant: {b}\nuser: t9\n"
            f"assistant: {c}\nuser: t3\n"
        ),
    ]
    assert [r["previous_response_id"] for r in (one, two, three, four)] == [
        None, one["id"], two["id"], three["id"]]  # fmt: skip
    assert three["usage"]["input_tokens"] == len(engine.tokenizer.encode(engine.prompts[2])) == 12
    # turn three's prompt starts with turn two's (7 tokens): its full page came from the
    # fake engine's prefix cache
    assert three["usage"]["input_tokens_details"]["cached_tokens"] == 4


def test_store_false_keeps_nothing(server):
    got = create(server, input="t5", max_output_tokens=1, store=False)
    assert got["store"] is False
    r = post_get(server, got["id"])
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = post(server, {"input": "t6", "previous_response_id": got["id"]})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": f"Response with id {got['id']!r} not found (this server keeps the last "
        "--responses-store-size responses in memory, none sent with store: false)",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "not_found",
    }


def test_the_store_is_an_lru_of_its_size(make_server):
    s = make_server(Engine(), responses_store_size=2)
    one, two = (create(s, input=f"t{i}", max_output_tokens=1)["id"] for i in (1, 2))
    assert post_get(s, one).status_code == 200  # one is now the most recently used
    three = create(s, input="t3", max_output_tokens=1)["id"]
    assert [post_get(s, i).status_code for i in (one, two, three)] == [200, 404, 200]
    # continuing one uses it too: three goes when four comes
    create(s, input="t4", previous_response_id=one, max_output_tokens=1)
    assert [post_get(s, i).status_code for i in (one, three)] == [200, 404]
    assert len(s.server.responses.store) == 2
    none = make_server(Engine(), responses_store_size=0)
    got = create(none, input="t1", max_output_tokens=1)
    assert post_get(none, got["id"]).status_code == 404


def test_get_and_delete(server):
    got = create(server, input="t5", max_output_tokens=1)
    assert post_get(server, got["id"]).json() == got
    client = openai_client(server)
    assert client.responses.retrieve(got["id"]).id == got["id"]
    url = f"{server.http_url}/v1/responses/{got['id']}"
    r = httpx.delete(url, timeout=30)
    assert r.status_code == 200
    assert r.json() == {"id": got["id"], "object": "response", "deleted": True}
    assert post_get(server, got["id"]).status_code == 404
    r = httpx.delete(url, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    r = httpx.get(url + "?stream=true", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{oops"}
BAD = [
    ({"input": 5}, "input", "input: must be a string or a list of items, got 5"),
    ({"input": []}, "input", "input: give at least one item"),
    ({"input": ["hi"]}, "input[0]",
     "input[0]: must be an object: a message, function_call or function_call_output"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role",
     "input[0].role: must be one of user, assistant, system, developer, got 'robot'"),
    ({"input": [{"role": "user"}]}, "input[0].content", "input[0].content: field required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type",
     "input[0].content[0].type: 'input_image' is not supported: this server reads text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text", "input[0].content[0].text: must be a string"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "input[0].call_id: field required"),
    ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input[0].output",
     "input[0].output: field required"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
     ("input[0].type: item_reference is not supported: send the item itself or continue "
     "with previous_response_id")),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type",
     ("input[0].type: must be message, function_call or function_call_output, got "
     "'web_search_call'")),
    ({"input": [{"role": "user", "content": "hi"}, CALL]}, "input[1].arguments",
     "input[1].arguments: not valid JSON"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type",
     "tools[0].type: only function tools are supported here, got 'web_search'"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]},
     "tools[0].parameters", "tools[0].parameters: invalid JSON schema: Invalid type: objekt"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
     "tools[0].strict", "tools[0].strict: must be true or false"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name",
     "tool_choice.name: 'nope' is not one of the tools ('get_weather', 'get_time')"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice.type",
     ("tool_choice.type: must be function (or tool_choice none, auto or required), got "
     "'file_search'")),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice",
     ('tool_choice: must be none, auto, required or {"type": "function", "name": ...}, got '
     '"sometimes"')),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice",
     'tool_choice "required" needs tools: the request has none'),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type",
     "text.format.type: must be text, json_object or json_schema, got 'xml'"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema", "text.format.schema: field required for type json_schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}},
     "text.format.schema", "text.format.schema: invalid JSON schema: Invalid type: objekt"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens",
     "max_output_tokens must be >= 1, got 0"),
    ({"input": "hi", "max_output_tokens": 1000}, "input",
     ("This model's maximum context length is 256 tokens. However, you requested 1002 tokens "
     "(2 in the input, 1000 in the completion). Please reduce the length of the input or "
     "completion.")),
    ({"input": "hi", "temperature": -1}, "temperature", "temperature must be >= 0, got -1.0"),
    ({"input": "hi", "top_p": 2}, "top_p", "top_p must be in (0, 1], got 2.0"),
    ({"input": "hi", "n": 2}, "n", "unknown field 'n': this server does not support it"),
    ({"input": "hi", "background": True}, "background",
     "background: background responses are not supported: send it without"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation",
     "conversation: the Conversations API is not supported: continue with previous_response_id"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt",
     "prompt: stored prompt templates are not supported: send the input itself"),
    ({"input": "hi", "stream": "maybe"}, "stream", 'stream: must be true or false, got "maybe"'),
]  # fmt: skip


def test_bad_inputs_are_400s_naming_the_field(server):
    for body, param, text in BAD:
        for stream in (False, True):
            r = post(server, {**body, "stream": stream} if "stream" not in body else body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert (error["param"], error["message"]) == (param, text), body
            assert error["type"] == "invalid_request_error"
    r = post(server, {"input": "hi", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(server, {"input": "t5", "max_output_tokens": 1})  # the server serves on
    assert r.status_code == 200
    assert server.engine.num_unfinished_requests() == 0


def test_tools_default_to_auto_on_a_server_without_flags(make_server):
    s = make_server(Engine())
    s.engine.scripts.append(CALLING)
    got = create(s, input="Weather?", tools=TOOLS)
    assert got["tool_choice"] == "auto"
    assert [(o["type"], o.get("name")) for o in got["output"]] == [
        ("message", None), ("function_call", "get_weather"), ("function_call", "get_time")]  # fmt: skip
    s.engine.scripts.append(CALLING)
    got = create(s, input="Weather?", tools=TOOLS, tool_choice="none")
    assert [o["type"] for o in got["output"]] == ["message"]  # "none": all of it is content
    assert got["output"][0]["content"][0]["text"] == "".join(CALLING)


def test_text_format_is_the_engines_constraint(server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "out", "schema": schema, "strict": True}
    got = create(server, input="hi", text={"format": fmt}, max_output_tokens=1)
    params, _ = list(server.engine.received.values())[-1]
    assert params.structured_outputs.json == schema
    assert got["text"] == {"format": fmt, "verbosity": "medium"}
    create(server, input="hi", text={"format": {"type": "json_object"}}, max_output_tokens=1)
    params, _ = list(server.engine.received.values())[-1]
    assert params.structured_outputs.json_object is True


def test_openai_fields_that_do_not_apply_are_accepted_with_one_warning(server, caplog):
    openai_fields._warned.clear()
    ignored = {"include": ["message.output_text.logprobs"], "metadata": {"k": "v"},
               "reasoning": {"effort": "low"}, "service_tier": "flex", "truncation": "auto",
               "safety_identifier": "s", "top_logprobs": 2, "max_tool_calls": 3,
               "stream_options": {}}  # fmt: skip
    # read, not ignored: they name the session (tests/server/test_session_keys.py)
    used = {"user": "u1", "prompt_cache_key": "k"}
    with caplog.at_level(logging.WARNING, logger="jpaged.server"):
        for _ in range(2):
            got = create(server, input="t5", max_output_tokens=1, background=False, **ignored,
                         **used)  # fmt: skip
            assert got["status"] == "incomplete"
    warned = [r.getMessage() for r in caplog.records if "ignoring request field" in r.msg]
    assert sorted(warned) == [
        f"ignoring request field {name!r} (an OpenAI responses field this server does not "
        "use); logged once"
        for name in sorted(ignored)
    ]


class FlakyEngine(Engine):
    """Its step raises once a request whose prompt ends in t666 has two tokens."""

    def step(self):
        doomed = [r for r in self._running if r.prompt_ids[-1] == 666]
        if any(len(r.choices[0].token_ids) >= 2 for r in doomed):
            self.abort_request([r.request_id for r in doomed])
            raise RuntimeError("device fell over")
        return super().step()


def test_an_engine_error_is_response_failed_or_a_500(make_server):
    s = make_server(FlakyEngine(step_delay_s=0.02))
    events = streamed(s, input="t666", max_output_tokens=5)
    # the text before the failure, its item closed as incomplete
    assert kinds(events) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.done", "content_part.done", "output_item.done",
        "failed",
    ]  # fmt: skip
    final = events[-1]
    assert final["response"]["status"] == "failed"
    assert final["response"]["error"] == {
        "code": "server_error",
        "message": "engine error: RuntimeError: device fell over",
    }
    assert final["response"]["output"][0]["status"] == "incomplete"
    r = post(s, {"input": "t666", "max_output_tokens": 5})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "engine error: RuntimeError: device fell over"
    assert post(s, {"input": "t5", "max_output_tokens": 1}).status_code == 200


def test_a_client_that_goes_away_aborts_its_request(make_server):
    s = make_server(Engine(step_delay_s=0.01, max_model_len=4096, num_pages=4096))
    body = {"input": "t5", "max_output_tokens": 3000, "stream": True, "temperature": 0}
    with httpx.stream("POST", s.http_url + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept until the block ends (see test_openai_streams)
        deltas = 0
        for line in lines:
            deltas += line.startswith("event: response.output_text.delta")
            if deltas == 3:
                break
        s.wait_until(lambda st: st.num_running == 1)
    s.wait_until(lambda st: st.num_running == 0 and st.pages_used == 0, timeout=10)
    with pytest.raises(httpx.ReadTimeout):  # and a non-streamed one
        httpx.post(s.http_url + "/v1/responses", json={**body, "stream": False}, timeout=0.5)
    s.wait_until(lambda st: st.num_running == 0 and st.pages_used == 0, timeout=10)
    assert len(s.server.responses.store) == 0  # neither was kept


def test_the_drain_ends_a_stream_with_response_failed(make_server):
    s = make_server(Engine(step_delay_s=0.01, max_model_len=4096, num_pages=4096))
    body = {"input": "t5", "max_output_tokens": 3000, "stream": True, "temperature": 0}
    events, drain = [], None
    with httpx.stream("POST", s.http_url + "/v1/responses", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if events[-1]["type"] == "response.output_text.delta" and drain is None:
                    drain = s.drain_soon(0.0)  # no grace: the request is aborted
    assert drain.result(30) is True
    assert kinds(events)[-4:] == ["output_text.done", "content_part.done", "output_item.done",
                                  "failed"]  # fmt: skip
    final = events[-1]["response"]
    assert final["status"] == "failed" and final["output"][0]["status"] == "incomplete"
    assert final["error"] == {
        "code": "server_error",
        "message": "the request was aborted: the server is shutting down",
    }
    EVENT.validate_python(events[-1])
