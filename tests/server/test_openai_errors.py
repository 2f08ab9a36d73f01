"""HTTP API errors: every bad input gets its status, OpenAI's error shape and a param naming
the field, and the server then serves; 429 at the queue limit, 503 while draining, 401
without the API key (HTTP and gRPC alike)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import openai
import pytest
from fake_engine import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import RunningServer, collect, openai_client, request, scrape

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "t1"}]

CASES = [
    # (name, path, body: dict or raw text, status, param, text the message must contain)
    (
        "negative temperature",
        COMP,
        {"prompt": "t1", "temperature": -0.5},
        400,
        "temperature",
        ">= 0",
    ),
    ("top_p 0", CHAT, {"messages": USER, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("max_tokens 0", COMP, {"prompt": "t1", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    (
        "max_completion_tokens 0",
        CHAT,
        {"messages": USER, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "max_completion_tokens must be >= 1",
    ),
    ("n above the limit", COMP, {"prompt": "t1", "n": 65}, 400, "n", "n must be <= 64"),
    ("n 0", CHAT, {"messages": USER, "n": 0}, 400, "n", ">= 1"),
    (
        "unknown role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "'user'",
    ),
    (
        "empty messages",
        CHAT,
        {"messages": []},
        400,
        "messages",
        "messages: give at least 1 message, got 0",
    ),
    ("no messages", CHAT, {"max_tokens": 3}, 400, "messages", "required"),
    (
        "image content",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0]",
        "'type': 'text'",
    ),
    ("too-long prompt", COMP, {"prompt": [5] * 64}, 400, "prompt", "maximum context length is 64"),
    (
        "prompt plus max_tokens too long",
        CHAT,
        {"messages": USER, "max_tokens": 70},
        400,
        "messages",
        "you requested 72 tokens (2 in the messages, 70 in the completion)",
    ),
    ("malformed JSON", COMP, '{"prompt": "t1",', 400, None, "malformed JSON"),
    ("JSON that is not an object", COMP, "[1, 2]", 400, None, "request body"),
    ("NaN", COMP, '{"prompt": "t1", "temperature": NaN}', 400, "temperature", "finite"),
    (
        "wrong type",
        COMP,
        {"prompt": "t1", "max_tokens": "many"},
        400,
        "max_tokens",
        'max_tokens: must be an integer, got "many"',
    ),
    ("unknown field", COMP, {"prompt": "t1", "beam_width": 3}, 400, "beam_width", "unknown field"),
    (
        "a tool that is not a function",
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]},
        400,
        "tools[0].x",
        "unknown field",
    ),
    (
        "logit_bias id outside the vocabulary",
        COMP,
        {"prompt": "t1", "logit_bias": {"1000": 1}},
        400,
        "logit_bias",
        "token id 1000 is out of range [0, 1000)",
    ),
    (
        "logit_bias value",
        CHAT,
        {"messages": USER, "logit_bias": {"5": 150}},
        400,
        "logit_bias",
        "[-100, 100]",
    ),
    (
        "json_schema without a schema",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format.json_schema.schema",
        "field required",
    ),
    (
        "a bad schema in response_format",
        COMP,
        {
            "prompt": "t1",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            },
        },
        400,
        "response_format.json_schema.schema",
        "response_format.json_schema.schema: invalid JSON schema: Invalid type: objekt",
    ),
    (
        "a bad guided_json",
        CHAT,
        {"messages": USER, "guided_json": '{"type": '},
        400,
        "guided_json",
        "guided_json: invalid JSON: ",
    ),
    (
        "a bad guided_regex",
        COMP,
        {"prompt": "t1", "guided_regex": "[a-"},
        400,
        "guided_regex",
        "guided_regex: invalid regex: ",
    ),
    (
        "a bad guided_grammar",
        COMP,
        {"prompt": "t1", "guided_grammar": "start: foo"},
        400,
        "guided_grammar",
        "guided_grammar: invalid grammar: ",
    ),
    (
        "an empty guided_choice",
        CHAT,
        {"messages": USER, "guided_choice": []},
        400,
        "guided_choice",
        "guided_choice must be a non-empty list of strings",
    ),
    (
        "a bad structured_outputs regex",
        CHAT,
        {"messages": USER, "structured_outputs": {"regex": "[a-"}},
        400,
        "structured_outputs.regex",
        "structured_outputs.regex: invalid regex: ",
    ),
    (
        "two kinds in structured_outputs",
        COMP,
        {"prompt": "t1", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs",
        "exactly one of json, regex, choice, grammar, json_object must be set, got regex and choice",
    ),
    (
        "an unknown structured_outputs field",
        COMP,
        {"prompt": "t1", "structured_outputs": {"regex": "a", "backend": "xgrammar"}},
        400,
        "structured_outputs.backend",
        "unknown field 'structured_outputs.backend'",
    ),
    (
        "structured_outputs with options only",
        CHAT,
        {"messages": USER, "structured_outputs": {"disable_any_whitespace": True}},
        400,
        "structured_outputs",
        "structured_outputs: set a constraint",
    ),
    (
        "response_format and guided_regex",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
        400,
        "guided_regex",
        (
            "set at most one constraint (response_format json_object or json_schema, "
            "structured_outputs, guided_*), got response_format and guided_regex"
        ),
    ),
    (
        "structured_outputs and guided_choice",
        COMP,
        {"prompt": "t1", "structured_outputs": {"json_object": True}, "guided_choice": ["a"]},
        400,
        "guided_choice",
        "got structured_outputs and guided_choice",
    ),
    ("logprobs 21", COMP, {"prompt": "t1", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    (
        "top_logprobs 21",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "top_logprobs must be in [0, 20]",
    ),
    (
        "top_logprobs alone",
        CHAT,
        {"messages": USER, "top_logprobs": 2},
        400,
        "top_logprobs",
        "logprobs=true",
    ),
    (
        "stream_options alone",
        COMP,
        {"prompt": "t1", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream=true",
    ),
    ("empty prompt", COMP, {"prompt": ""}, 400, "prompt", "must not be empty"),
    ("empty prompt list", COMP, {"prompt": []}, 400, "prompt", "must not be empty"),
    ("prompt id past vocab", COMP, {"prompt": [1, 1000]}, 400, "prompt", "token id 1000"),
    (
        "stop token past vocab",
        COMP,
        {"prompt": "t1", "stop_token_ids": [1000]},
        400,
        "stop_token_ids",
        "[0, 1000)",
    ),
    ("empty stop string", COMP, {"prompt": "t1", "stop": ["x", ""]}, 400, "stop", "empty"),
    ("negative seed", CHAT, {"messages": USER, "seed": -1}, 400, "seed", "seed"),
    (
        "min_tokens above what fits",
        COMP,
        {"prompt": [1] * 60, "min_tokens": 10},
        400,
        "min_tokens",
        "<= max_tokens (4)",
    ),
    ("unknown model", COMP, {"model": "gpt-4", "prompt": "t1"}, 404, "model", "does not exist"),
    (
        "chat_template_kwargs over messages",
        CHAT,
        {"messages": USER, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
        "may not set 'messages'",
    ),
]


@pytest.fixture(scope="module")
def shared(request):
    s = RunningServer(FakeEngine(max_model_len=64, step_delay_s=0.002))
    request.addfinalizer(s.close)
    return s


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(
        server.http_url + path, content=content, headers=headers, timeout=30, **kwargs
    )


@pytest.mark.parametrize("name,path,body,status,param,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_request(shared, name, path, body, status, param, needle):
    r = post(shared, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert needle in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"
    if "context length" in needle:
        assert error["code"] == "context_length_exceeded"
    ok = post(shared, COMP, {"prompt": [4], "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " t4 t5 t6"


def test_bad_requests_are_counted_and_logged_with_an_id(shared, caplog):
    before = scrape(shared.http_url + "/metrics")[
        'jpaged_requests_total{outcome="invalid_argument"}'
    ]
    with caplog.at_level("INFO", logger="jpaged.server"):
        post(shared, COMP, {"prompt": "t1", "temperature": -1})
        post(shared, COMP, '{"prompt": ')
    after = scrape(shared.http_url + "/metrics")[
        'jpaged_requests_total{outcome="invalid_argument"}'
    ]
    assert after == before + 2
    rejected = [r for r in caplog.records if r.getMessage() == "request rejected"]
    ids = [r.fields["request_id"] for r in rejected]
    assert len(ids) == 2 and all(len(i) > 8 for i in ids), ids


def test_openai_client_raises_bad_request(shared):
    c = openai_client(shared)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="fake", messages=USER, temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"


def test_queue_limit_is_429_with_retry_after(make_server):
    engine = FakeEngine(max_model_len=4096, num_pages=4096, step_delay_s=0.01, max_num_seqs=1)
    s = make_server(engine, max_waiting=2)
    long = {"prompt": [1], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.http_url + COMP, json=long, timeout=30) as running:
        lines = running.iter_lines()  # kept: a closed iterator closes the stream
        next(lines)  # it holds the only sequence slot
        waiting = [
            threading.Thread(target=post, args=(s, COMP, {"prompt": [20], "max_tokens": 5}))
            for _ in range(2)
        ]
        for t in waiting:
            t.start()
        s.wait_until(lambda st: st.num_waiting == 2)
        r = post(s, COMP, {"prompt": [3], "max_tokens": 5})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "max 2" in error["message"]
        assert len(engine.received) == 3  # refused at the door
    for t in waiting:
        t.join(30)
    assert post(s, COMP, {"prompt": [3], "max_tokens": 2}).status_code == 200


def test_draining_is_503_and_health_follows(make_server):
    s = make_server(FakeEngine(max_model_len=4096, num_pages=4096, step_delay_s=0.01))
    assert httpx.get(s.http_url + "/health").json() == {"status": "serving"}
    long = {"prompt": [1], "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", s.http_url + COMP, json=long, timeout=30) as stream:
        lines = stream.iter_lines()
        next(lines)
        drained = s.drain_soon(1.0)
        deadline = time.monotonic() + 5
        while httpx.get(s.http_url + "/health").status_code != 503:
            assert time.monotonic() < deadline
        assert httpx.get(s.http_url + "/health").json() == {"status": "draining"}
        r = post(s, COMP, {"prompt": [3], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        events = sse_lines(lines)
    # Past the grace period the stream is aborted, and ends properly.
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    drained.result(30)


def sse_lines(lines) -> list:
    from serving_helpers import sse_events

    return sse_events(line for line in lines if line)


def test_api_key_http_and_grpc(make_server):
    s = make_server(api_key="sekrit")
    with pytest.raises(openai.AuthenticationError) as err:
        openai_client(s, api_key="wrong").models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    r = post(s, COMP, {"prompt": [4], "max_tokens": 1})
    assert r.status_code == 401
    c = openai_client(s, api_key="sekrit")
    assert c.completions.create(model="fake", prompt=[4], max_tokens=1, temperature=0).choices
    # Probes and scrapes need no key.
    assert httpx.get(s.http_url + "/health").status_code == 200
    metrics = scrape(s.http_url + "/metrics")
    assert metrics['jpaged_requests_total{outcome="unauthenticated"}'] == 2
    # gRPC: the same key as metadata.
    with pytest.raises(grpc.RpcError) as err:
        collect(s.stub, request([4], max_tokens=1))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        collect(s.stub, request([4], max_tokens=1), metadata=(("authorization", "Bearer nope"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    got = collect(
        s.stub,
        request([4], max_tokens=2, temperature=0),
        metadata=(("authorization", "Bearer sekrit"),),
    )
    assert got.token_ids == {0: [4, 5]}
    health = health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
