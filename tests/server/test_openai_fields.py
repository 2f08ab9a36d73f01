"""Request fields on the fake engine: every field OpenAI's API defines is accepted (the ones
this server does not use are dropped with one log line per field name per process), any
other field is a 400 naming it; the field lists cover the installed openai client's request
types. Also the small vLLM endpoints this issue added: /tokenizer_info, and /v1/completions
scoring a prompt (echo with max_tokens 0)."""

from __future__ import annotations

import logging
import typing

import httpx
import pytest
from fake_engine import FakeEngine
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from serving_helpers import sse_events

from server import openai_fields
from server.openai_embeddings import EmbeddingRequest

USER = [{"role": "user", "content": "t5"}]

# What agent frameworks send beside the fields jpaged reads (the openai client's names).
CHAT_EXTRAS = {
    "store": False, "metadata": {"run": "1"}, "service_tier": "auto", "reasoning_effort": "low",
    "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low",
    "modalities": ["text"], "user": "u", "audio": None, "prediction": None,
    "web_search_options": {}, "functions": [], "function_call": "none",
    "prompt_cache_retention": "in-memory",
}  # fmt: skip
COMPLETION_EXTRAS = {"best_of": 1, "suffix": None, "user": "u"}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=30)


@pytest.mark.parametrize(
    ("endpoint", "params"),
    [
        ("chat.completions", chat_create_params.CompletionCreateParamsBase),
        ("completions", completion_create_params.CompletionCreateParamsBase),
        ("embeddings", embedding_create_params.EmbeddingCreateParams),
        ("responses", response_create_params.ResponseCreateParamsBase),
    ],
)
def test_the_lists_cover_the_openai_clients_request_types(endpoint, params):
    defined = set(typing.get_type_hints(params)) - {"extra_headers", "extra_body"}
    if endpoint != "embeddings":
        defined.add("stream")  # in the client's Streaming / NonStreaming subclasses
    assert defined <= openai_fields.FIELDS[endpoint], defined - openai_fields.FIELDS[endpoint]


def test_openai_fields_are_accepted_and_logged_once(server, monkeypatch, caplog):
    monkeypatch.setattr(openai_fields, "_warned", set())
    caplog.set_level(logging.WARNING, logger="jpaged.server")
    for _ in range(2):
        r = post(server, "/v1/chat/completions",
                 {"messages": USER, "max_tokens": 2, **CHAT_EXTRAS})  # fmt: skip
        assert r.status_code == 200, r.text
        r = post(server, "/v1/completions",
                 {"prompt": "t1", "max_tokens": 2, **COMPLETION_EXTRAS})  # fmt: skip
        assert r.status_code == 200, r.text
    ignored = [rec.getMessage() for rec in caplog.records if "ignoring request field" in rec.msg]
    # prompt_cache_key and user name the request's session (tests/server/test_session_keys.py)
    names = sorted({*CHAT_EXTRAS, *COMPLETION_EXTRAS} - {"prompt_cache_key", "user"})
    assert sorted(m.split("'")[1] for m in ignored) == names  # once per name, both endpoints
    assert ignored[0] == (
        "ignoring request field 'store' (an OpenAI chat.completions field this server does "
        "not use); logged once"
    )
    # stream_options.include_obfuscation is OpenAI's too
    body = {"messages": USER, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}  # fmt: skip
    events = sse_events(post(server, "/v1/chat/completions", body).text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2
    # embeddings: the model drops user the same way
    assert EmbeddingRequest.model_validate({"input": "x", "user": "u"}).input == "x"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": USER, "temprature": 0.5}, "temprature"),
        ("/v1/chat/completions", {"messages": USER, "input": "hi"}, "input"),  # responses'
        ("/v1/completions", {"prompt": "t1", "messages": USER}, "messages"),
        ("/v1/completions", {"prompt": "t1", "max_output_tokens": 3}, "max_output_tokens"),
    ],
)
def test_a_field_openai_does_not_define_is_a_400_naming_it(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field
    assert error["message"] == f"unknown field {field!r}: this server does not support it"


def test_tokenizer_info(make_server):
    engine = FakeEngine()
    server = make_server(engine)
    r = httpx.get(server.http_url + "/tokenizer_info", timeout=30)
    assert r.json() == {
        "tokenizer_class": "FakeTokenizer",
        "bos_token": None,
        "eos_token": None,
        "model_max_length": 64,
        "chat_template": engine.chat_template,
    }
    server = make_server(engine, chat_template="{{ messages[0].content }}")
    r = httpx.get(server.http_url + "/tokenizer_info", timeout=30)
    assert r.json()["chat_template"] == "{{ messages[0].content }}"  # the server's own


def test_echo_with_max_tokens_0_scores_the_prompt(server):
    """The prompt comes back, no new token (the one the engine sampled is left out)."""
    body = {"prompt": "t1 t2 t3", "max_tokens": 0, "echo": True, "n": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert [(c["text"], c["finish_reason"]) for c in r.json()["choices"]] == [
        ("t1 t2 t3", "length"),
        ("t1 t2 t3", "length"),
    ]
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
                                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    events = sse_events(post(server, "/v1/completions", {**body, "n": 1, "stream": True,
                             "stream_options": {"include_usage": True}}).text.splitlines())  # fmt: skip
    assert "".join(c["text"] for e in events[:-2] for c in e["choices"]) == "t1 t2 t3"
    assert events[-2]["usage"]["completion_tokens"] == 0
    ids = post(server, "/v1/completions", {**body, "prompt": [7, 8], "return_token_ids": True})
    assert [c["token_ids"] for c in ids.json()["choices"]] == [[], []]
    # without echo, max_tokens 0 asks for nothing: still a 400
    r = post(server, "/v1/completions", {"prompt": "t1", "max_tokens": 0})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "max_tokens")
