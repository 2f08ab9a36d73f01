"""Structured outputs through the servers (issue 37): the whitespace fields are honoured, the
server-wide default applies to requests that set none, a request's own setting wins, a field
that would change nothing is a 400 naming it, and an output cut short says "length".

One demo-model engine (random weights) started with
structured_outputs_config={"disable_any_whitespace": false} (vLLM's whitespace, so that the
default visibly differs from jpaged's), used offline and served in-process over HTTP and
gRPC. The requests push whitespace: a +100 logit bias on every whitespace-only token, so an
output takes whitespace wherever its grammar allows it.
"""

from __future__ import annotations

import argparse
import json
import re

import grpc
import httpx
import jsonschema
import pytest
from serving_helpers import RunningServer, collect, request, sse_events

from jpaged import LLM, SamplingParams
from jpaged.entrypoints.engine_args import engine_kwargs
from jpaged.structured_output import StructuredOutputsParams
from server.cli import add_serve_parser
from server.proto.jpaged.v1 import generation_pb2 as pb

ENGINE = {"max_num_seqs": 4, "max_model_len": 128, "page_size": 16}
# Strings are enums only: whitespace can fall only between JSON tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["kind", "n", "flags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(
        str(demo_model_dir), **ENGINE, structured_outputs_config={"disable_any_whitespace": False}
    )


@pytest.fixture(scope="module")
def whitespace_bias(llm) -> dict[int, float]:
    """+100 on each of the demo tokenizer's whitespace-only tokens."""
    tokenizer = llm.get_tokenizer()
    ids = [
        i
        for i in range(tokenizer.vocab_size)
        if (s := tokenizer.decode([i])) and set(s) <= set(" \t\n\r")
    ]
    assert len(ids) == 6
    return dict.fromkeys(ids, 100.0)


@pytest.fixture(scope="module")
def served(llm):
    s = RunningServer(llm.llm_engine, model_name="demo")
    yield s
    s.close()


def post(served, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(served.http_url + path, json={"model": "demo", **body}, timeout=600)


def whitespace_runs(text: str) -> set[str]:
    return set(re.findall(r"\s+", text))


def test_the_serve_command_takes_the_switch():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--structured-outputs-config", '{"disable_any_whitespace": true}'])  # fmt: skip
    assert engine_kwargs(args)["structured_outputs_config"] == '{"disable_any_whitespace": true}'


def test_the_engines_default_and_a_requests_own_setting_offline(llm, whitespace_bias):
    def run(**kwargs):
        constraint = StructuredOutputsParams(json=SCHEMA, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=80, logit_bias=whitespace_bias,
                                structured_outputs=constraint)  # fmt: skip
        return llm.generate(["whitespace"], params)[0].outputs[0]

    flexible = run()  # the engine's default: any whitespace, and the model takes it forever
    assert flexible.finish_reason == "length"
    assert flexible.text.startswith("{") and not flexible.text[1:].strip()
    compact = run(disable_any_whitespace=True)
    assert compact.finish_reason == "stop" and not whitespace_runs(compact.text)
    jsonschema.validate(json.loads(compact.text), SCHEMA)
    spaced = run(whitespace_pattern="[ ]?")
    assert spaced.finish_reason == "stop" and whitespace_runs(spaced.text) == {" "}
    jsonschema.validate(json.loads(spaced.text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "runs"),
    [
        ({}, None),  # the server's default (flexible): never closes
        ({"structured_outputs": {"disable_any_whitespace": True}}, set()),
        ({"structured_outputs": {"whitespace_pattern": ""}}, set()),
        ({"structured_outputs": {"whitespace_pattern": "\n?"}}, {"\n"}),
        ({"guided_whitespace_pattern": "[ ]?"}, {" "}),
    ],
)
def test_http_whitespace_fields_are_honoured(served, whitespace_bias, extra, runs):
    body = {"prompt": "whitespace", "max_tokens": 80, "temperature": 0,
            "logit_bias": {str(t): b for t, b in whitespace_bias.items()}, "response_format": FORMAT}  # fmt: skip
    r = post(served, {**body, **extra})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    if runs is None:
        assert choice["finish_reason"] == "length" and not choice["text"][1:].strip()
        return
    assert choice["finish_reason"] == "stop", choice
    assert whitespace_runs(choice["text"]) == runs
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_grpc_whitespace_fields_are_honoured(served, whitespace_bias):
    def run(**fields):
        constraint = pb.StructuredOutputs(json_schema=json.dumps(SCHEMA), **fields)
        got = collect(served.stub, request("whitespace", temperature=0, max_tokens=80,
                                           logit_bias=whitespace_bias,
                                           structured_outputs=constraint))  # fmt: skip
        return got.text[0], got.finish_reason[0]

    text, reason = run()  # unset: the server's default
    assert reason == pb.FINISH_REASON_LENGTH and not text[1:].strip()
    text, reason = run(disable_any_whitespace=True)
    assert reason == pb.FINISH_REASON_STOP and not whitespace_runs(text)
    text, reason = run(whitespace_pattern="[ ]?")
    assert reason == pb.FINISH_REASON_STOP and whitespace_runs(text) == {" "}
    with pytest.raises(grpc.RpcError) as err:
        run(whitespace_pattern="[ ]?x")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "structured_outputs.whitespace_pattern: '[ ]?x' can match 'x'; only space, \\t, \\n "
        "and \\r may appear between JSON tokens"
    )
    with pytest.raises(grpc.RpcError) as err:
        collect(served.stub, request("x", structured_outputs=pb.StructuredOutputs(
            regex="a+", disable_any_whitespace=True)))  # fmt: skip
    assert err.value.details().startswith(
        "structured_outputs.disable_any_whitespace applies to JSON constraints only"
    )


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
            "structured_outputs.disable_additional_properties",
            "unknown field 'structured_outputs.disable_additional_properties'",
        ),
        (
            {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
            "guided_decoding_backend",
            "unknown field 'guided_decoding_backend'",
        ),
        (
            {"response_format": FORMAT, "structured_outputs": {"whitespace_pattern": "[ "}},
            "structured_outputs.whitespace_pattern",
            "structured_outputs.whitespace_pattern: invalid regex '[ ': unclosed character class",
        ),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": "\\s*"},
            "guided_whitespace_pattern",
            "guided_whitespace_pattern: '\\\\s*' can match '\\x0b'; only space",
        ),
        (
            {"guided_regex": "a+", "guided_whitespace_pattern": " ?"},
            "guided_whitespace_pattern",
            "guided_whitespace_pattern applies to JSON constraints only",
        ),
        (
            {"guided_whitespace_pattern": " ?"},
            "guided_whitespace_pattern",
            "guided_whitespace_pattern: set a constraint",
        ),
        (
            {
                "structured_outputs": {"json_object": True, "whitespace_pattern": " "},
                "guided_whitespace_pattern": " ",
            },
            "guided_whitespace_pattern",
            "set whitespace_pattern once",
        ),
        (
            {"response_format": {"type": "text", "json_schema": FORMAT["json_schema"]}},
            "response_format.json_schema",
            "response_format.json_schema is only read with type json_schema, not text",
        ),
        (
            {"response_format": FORMAT, "structured_outputs": {"disable_any_whitespace": 1}},
            "structured_outputs.disable_any_whitespace",
            "structured_outputs.disable_any_whitespace must be a bool, got 1",
        ),
    ],
)
def test_a_field_that_would_change_nothing_is_a_400_naming_it(served, extra, param, message):
    r = post(served, {"prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_an_output_cut_short_says_length_everywhere(served, llm):
    """Every API: finish_reason "length", the raw text as it is, nothing claiming JSON."""
    # 60 array items cannot close in 12 tokens, nor in what the context leaves.
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 60}
    fmt = {"type": "json_schema", "json_schema": {"name": "many", "schema": schema}}
    body = {"prompt": "count", "max_tokens": 12, "temperature": 0, "response_format": fmt}
    want = llm.generate(["count"], SamplingParams(
        temperature=0, max_tokens=12,
        structured_outputs=StructuredOutputsParams(json=schema)))[0].outputs[0]  # fmt: skip
    assert want.finish_reason == "length" and want.text.startswith("[")
    (choice,) = post(served, body).json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (want.text, "length")
    # Chat, streamed and not: the content is the raw text; no parsed value, no refusal.
    chat = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 12,
            "temperature": 0, "response_format": fmt,
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}  # fmt: skip
    r = post(served, chat, "/v1/chat/completions").json()
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": want.text}
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])
    with httpx.stream("POST", served.http_url + "/v1/chat/completions",
                      json={"model": "demo", **chat, "stream": True}, timeout=600) as s:  # fmt: skip
        events = sse_events(s.iter_lines())
    chunks = [c for e in events if e != "[DONE]" for c in e["choices"]]
    assert "".join(c["delta"].get("content", "") for c in chunks) == want.text
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
    # gRPC
    got = collect(served.stub, request("count", temperature=0, max_tokens=12,
                  structured_outputs=pb.StructuredOutputs(json_schema=json.dumps(schema))))  # fmt: skip
    assert got.text[0] == want.text and got.finish_reason[0] == pb.FINISH_REASON_LENGTH
    # Unset max_tokens: the context (max_model_len 128) runs out first.
    r = post(served, {**body, "max_tokens": None}).json()
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "length"
    assert r["usage"]["total_tokens"] == 128
