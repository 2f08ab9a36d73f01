"""Agent client libraries against the server with the built-in model (issue 51).

Five real libraries drive one server (SmolLM2-135M-Instruct, no tool flags: tool_choice
"auto" needs none): the OpenAI Agents SDK (its chat-completions model and its default
Responses model), pydantic-ai, instructor, langchain-openai and litellm. Each runs a tool loop
to its end (a tool call under "required" or named choice first, then the turn that carries
the assistant's tool_calls with null or missing content and the tool's result), "auto", and
structured output in its default mode, streamed where the library streams.

They assert the protocol, not the tiny model's answers: every HTTP exchange is a 2xx (an
httpx hook records them all), each tool call the libraries saw parses against its schema, a
structured output validates, and a loop either ends with an answer or at its turn limit
after the tool-result turn went through. test_tool_calling's engine and server
(tests/server/conftest.py smollm2_server), built once on the worker that runs both modules.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

# Nothing leaves this machine: the Agents SDK exports traces and litellm fetches its model
# price map unless told not to.
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import openai
import pydantic

# Host-side protocol: one Python version proves it (the libraries' own pins differ between
# versions; CI's 3.11 stage installs them from the test extra).
pytestmark = pytest.mark.once

MODEL = "smollm2"
ASK = "What is the weather in Paris? Use the tool."
CALL_TOKENS = 64  # a call is 15 to 30 tokens
ANSWER_TOKENS = 24


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def get_weather(city: str) -> str:
    """The current weather in a city."""
    WEATHER_CALLS.append(city)
    return f"sunny in {city}"


WEATHER_CALLS: list[str] = []


class Exchanges:
    """Every HTTP exchange of a client: (method, path, status, request JSON)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, dict]] = []

    def _record(self, response: httpx.Response) -> None:
        request = response.request
        body = json.loads(request.content) if request.content else {}
        self.seen.append((request.method, request.url.path, response.status_code, body))

    def sync_client(self) -> httpx.Client:
        return httpx.Client(timeout=300, event_hooks={"response": [self._record]})

    def async_client(self) -> httpx.AsyncClient:
        async def record(response: httpx.Response) -> None:
            self._record(response)

        return httpx.AsyncClient(timeout=300, event_hooks={"response": [record]})

    def posts(self, path: str) -> list[dict]:
        return [body for method, p, _, body in self.seen if method == "POST" and p == path]

    def assert_all_ok(self) -> None:
        bad = [(m, p, s) for m, p, s, _ in self.seen if not 200 <= s < 300]
        assert self.seen and not bad, bad


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server[1]


@pytest.fixture
def exchanges() -> Exchanges:
    WEATHER_CALLS.clear()
    return Exchanges()


def _async_openai(server, exchanges: Exchanges) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.http_url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=exchanges.async_client(),
    )


def _tool_result_turns(bodies: list[dict]) -> list[dict]:
    """The requests that carry an assistant's tool calls and a tool's result."""
    return [
        b
        for b in bodies
        if any(m.get("role") == "tool" for m in b.get("messages", ()))
        or any(i.get("type") == "function_call_output" for i in _items(b.get("input")))
    ]


def _items(value) -> list[dict]:
    return [i for i in value if isinstance(i, dict)] if isinstance(value, list) else []


# ---- the OpenAI Agents SDK ----------------------------------------------------------------


def _agents_run(server, exchanges, model_kind: str, *, stream: bool):
    import agents

    client = _async_openai(server, exchanges)
    model_cls = {
        "chat": agents.OpenAIChatCompletionsModel,
        "responses": agents.OpenAIResponsesModel,
    }[model_kind]
    agent = agents.Agent(
        name="weather",
        instructions="Answer in one short sentence.",
        model=model_cls(model=MODEL, openai_client=client),
        tools=[agents.function_tool(get_weather)],
        # "required" for the first turn; the SDK resets it to "auto" after a tool call
        model_settings=agents.ModelSettings(
            tool_choice="required",
            max_tokens=CALL_TOKENS,
            temperature=0.0,
            parallel_tool_calls=False,
        ),
    )

    async def run():
        try:
            if stream:
                result = agents.Runner.run_streamed(agent, ASK, max_turns=3)
                events = [e async for e in result.stream_events()]
                assert events
                return result.final_output
            return (await agents.Runner.run(agent, ASK, max_turns=3)).final_output
        except agents.exceptions.MaxTurnsExceeded:
            return None  # the model kept calling tools: the turns themselves went through
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model_kind", ["chat", "responses"])
def test_openai_agents_tool_loop(server, exchanges, model_kind, stream):
    output = _agents_run(server, exchanges, model_kind, stream=stream)
    exchanges.assert_all_ok()
    path = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}[model_kind]
    bodies = exchanges.posts(path)
    assert len(bodies) >= 2, exchanges.seen
    assert bodies[0]["tool_choice"] == "required"
    assert WEATHER_CALLS, "the first turn's required call reached the tool"
    assert _tool_result_turns(bodies[1:]), "the tool's result went back to the model"
    assert output is None or isinstance(output, str)


# ---- pydantic-ai --------------------------------------------------------------------------


def _pydantic_ai_agent(server, exchanges, **kwargs):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=_async_openai(server, exchanges))
    return Agent(OpenAIChatModel(MODEL, provider=provider), **kwargs)


def test_pydantic_ai_auto_tool_loop(server, exchanges):
    """pydantic-ai sends tool_choice "auto" whenever an agent has tools; a history with a
    call and its result makes the next turn the tool-result turn."""
    from pydantic_ai import UsageLimits
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.messages import (
        ModelRequest,
        ModelResponse,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )

    agent = _pydantic_ai_agent(server, exchanges, tools=[get_weather])
    settings = {"max_tokens": CALL_TOKENS, "temperature": 0.0}
    limits = UsageLimits(request_limit=3)
    try:
        first = agent.run_sync(ASK, model_settings=settings, usage_limits=limits)
        assert isinstance(first.output, str)
    except UsageLimitExceeded:
        pass
    history = [
        ModelRequest(parts=[UserPromptPart(ASK)]),
        ModelResponse(parts=[ToolCallPart("get_weather", {"city": "Paris"}, "call_1")]),
        ModelRequest(parts=[ToolReturnPart("get_weather", "sunny in Paris", "call_1")]),
    ]
    try:
        second = agent.run_sync(
            message_history=history, model_settings=settings, usage_limits=limits
        )
        assert isinstance(second.output, str)
    except UsageLimitExceeded:
        pass
    exchanges.assert_all_ok()
    bodies = exchanges.posts("/v1/chat/completions")
    assert all(b["tool_choice"] == "auto" for b in bodies if b.get("tools"))
    (turn, *_) = _tool_result_turns(bodies)
    assistant = next(m for m in turn["messages"] if m.get("tool_calls"))
    assert assistant.get("content") in (None, "")  # the shape that was a 500


def test_pydantic_ai_structured_output(server, exchanges):
    agent = _pydantic_ai_agent(server, exchanges, output_type=City)
    result = agent.run_sync(
        "Name a city and its country.",
        model_settings={"max_tokens": CALL_TOKENS, "temperature": 0.0},
    )
    assert isinstance(result.output, City)
    exchanges.assert_all_ok()


# ---- instructor ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "partial"])
def test_instructor_structured_output(server, exchanges, stream):
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(
            base_url=server.http_url + "/v1",
            api_key="unused",
            max_retries=0,
            http_client=exchanges.sync_client(),
        )
    )  # its default mode: a named tool call under the model's schema
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a city and its country."}],
        "max_tokens": CALL_TOKENS,
        "temperature": 0.0,
        "max_retries": 0,
    }
    if stream:
        parts = list(client.chat.completions.create_partial(response_model=City, **kwargs))
        city = parts[-1]
        City.model_validate(city.model_dump())
    else:
        city = client.chat.completions.create(response_model=City, **kwargs)
        assert isinstance(city, City)
    exchanges.assert_all_ok()
    (body,) = exchanges.posts("/v1/chat/completions")
    assert body["tool_choice"]["function"]["name"] == ("PartialCity" if stream else "City")


# ---- langchain-openai ---------------------------------------------------------------------


def _chat_openai(server, exchanges, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL,
        base_url=server.http_url + "/v1",
        api_key="unused",
        max_retries=0,
        temperature=0.0,
        http_client=exchanges.sync_client(),
        **kwargs,
    )


def test_langchain_tool_loop(server, exchanges):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm = _chat_openai(server, exchanges, max_tokens=CALL_TOKENS)
    messages = [HumanMessage(ASK)]
    first = llm.bind_tools([weather], tool_choice="required").invoke(messages)
    (call, *_) = first.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    messages += [first, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([weather]).invoke(messages)  # "auto"
    assert isinstance(final.content, str)
    streamed = list(llm.bind_tools([weather]).stream(messages))
    assert streamed
    exchanges.assert_all_ok()
    assert len(_tool_result_turns(exchanges.posts("/v1/chat/completions"))) == 2


def test_langchain_structured_output(server, exchanges):
    llm = _chat_openai(server, exchanges, max_tokens=CALL_TOKENS)
    city = llm.with_structured_output(City).invoke("Name a city and its country.")
    assert isinstance(city, City)
    exchanges.assert_all_ok()


# ---- litellm ------------------------------------------------------------------------------


def _litellm(server, **kwargs):
    import litellm

    litellm.telemetry = False
    return litellm.completion(
        model=f"openai/{MODEL}",
        api_base=server.http_url + "/v1",
        api_key="unused",
        temperature=0.0,
        num_retries=0,
        **kwargs,
    )


LITELLM_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    }
]


def test_litellm_tool_loop_and_structured_output(server):
    messages = [{"role": "user", "content": ASK}]
    first = _litellm(
        server, messages=messages, tools=LITELLM_TOOLS, tool_choice="required",
        max_tokens=CALL_TOKENS,
    )  # fmt: skip
    message = first.choices[0].message
    (call, *_) = message.tool_calls
    assert call.function.name == "get_weather"
    city = json.loads(call.function.arguments)["city"]
    messages += [
        {"role": "assistant", "tool_calls": [call.model_dump()]},  # no content at all
        {"role": "tool", "tool_call_id": call.id, "content": get_weather(city)},
    ]
    final = _litellm(
        server, messages=messages, tools=LITELLM_TOOLS, tool_choice="auto",
        max_tokens=ANSWER_TOKENS,
    )  # fmt: skip
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(
        _litellm(
            server, messages=messages, tools=LITELLM_TOOLS, max_tokens=ANSWER_TOKENS,
            stream=True,
        )
    )  # fmt: skip
    assert chunks
    structured = _litellm(
        server,
        messages=[{"role": "user", "content": "Name a city and its country."}],
        response_format=City,
        max_tokens=CALL_TOKENS,
    )
    City.model_validate_json(structured.choices[0].message.content)
