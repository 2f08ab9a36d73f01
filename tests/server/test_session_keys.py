"""The session key each HTTP request hands the engine (add_request's session=, whose cached
KV pages are evicted last while active: jpaged/core/session_pages.py): completions' and chat's
prompt_cache_key, else user, else none; a Responses chain of previous_response_id is one
session named by its first response id unless prompt_cache_key or user names one; an empty
key is a 400 naming the field. gRPC's Generate and Chat carry the same two fields, read the
same way (an empty or over-long key is INVALID_ARGUMENT naming the field)."""

from __future__ import annotations

import grpc
import httpx
import pytest
from fake_engine import FakeEngine
from serving_helpers import collect, collect_chat

from server.proto.jpaged.v1 import generation_pb2 as pb

USER = [{"role": "user", "content": "t5"}]
KEYS = [  # a request's fields -> its session key
    ({}, None),
    ({"user": "alice"}, "alice"),
    ({"prompt_cache_key": "agent-7"}, "agent-7"),
    ({"prompt_cache_key": "agent-7", "user": "alice"}, "agent-7"),
]


@pytest.fixture
def served(make_server):
    engine = FakeEngine()
    return engine, make_server(engine)


def post(server, path: str, body: dict) -> httpx.Response:
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    return httpx.post(server.http_url + path, json={limit: 2, **body}, timeout=30)


def last_session(engine: FakeEngine) -> str | None:
    return list(engine.sessions.values())[-1]


@pytest.mark.parametrize(("fields", "want"), KEYS)
def test_completions_and_chat_name_the_session(served, fields, want):
    engine, server = served
    assert post(server, "/v1/completions", {"prompt": [1, 2, 3], **fields}).status_code == 200
    assert last_session(engine) == want
    assert post(server, "/v1/chat/completions", {"messages": USER, **fields}).status_code == 200
    assert last_session(engine) == want


@pytest.mark.parametrize("field", ["user", "prompt_cache_key"])
def test_an_empty_session_key_is_a_400_naming_it(served, field):
    engine, server = served
    r = post(server, "/v1/completions", {"prompt": [1, 2], field: ""})
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]
    r = post(server, "/v1/responses", {"input": "hi", field: ""})
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]
    assert not engine.sessions


def test_a_responses_chain_is_one_session(served):
    engine, server = served
    first = post(server, "/v1/responses", {"input": "hi"}).json()
    assert last_session(engine) == first["id"]
    second = post(server, "/v1/responses", {"input": "more", "previous_response_id": first["id"]})
    assert last_session(engine) == first["id"]
    third = {"input": "again", "previous_response_id": second.json()["id"]}
    assert post(server, "/v1/responses", third).status_code == 200
    assert last_session(engine) == first["id"]
    other = post(server, "/v1/responses", {"input": "hi"}).json()  # a new chain
    assert last_session(engine) == other["id"] != first["id"]


def test_a_named_responses_session_carries_down_the_chain(served):
    engine, server = served
    first = post(server, "/v1/responses", {"input": "hi", "prompt_cache_key": "k1"}).json()
    assert last_session(engine) == "k1"
    body = {"input": "more", "previous_response_id": first["id"], "user": "bob"}
    second = post(server, "/v1/responses", body).json()
    assert last_session(engine) == "bob"
    assert second["user"] == "bob"
    post(server, "/v1/responses", {"input": "and", "previous_response_id": second["id"]})
    assert last_session(engine) == "bob"


def generate(server, **fields) -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(max_tokens=2)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling, **fields)


def chat(server, **fields) -> pb.ChatRequest:
    sampling = pb.SamplingParameters(max_tokens=2)
    return pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="t5")], sampling=sampling,
                          **fields)  # fmt: skip


@pytest.mark.parametrize(("fields", "want"), KEYS)
def test_grpc_generate_and_chat_name_the_session(served, fields, want):
    engine, server = served
    assert collect(server.stub, generate(server, **fields)).final.finished
    assert last_session(engine) == want
    assert collect_chat(server.stub, chat(server, **fields)).final.finished
    assert last_session(engine) == want


@pytest.mark.parametrize("field", ["user", "prompt_cache_key"])
@pytest.mark.parametrize("value", ["", "k" * 257])
def test_grpc_bad_session_key_is_invalid_argument_naming_it(served, field, value):
    engine, server = served
    for rpc, make in ((server.stub.Generate, generate), (server.stub.Chat, chat)):
        with pytest.raises(grpc.RpcError) as err:
            list(rpc(make(server, **{field: value})))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
    assert not engine.sessions
    assert collect(server.stub, generate(server, **{field: "k" * 256})).final.finished
    assert last_session(engine) == "k" * 256
