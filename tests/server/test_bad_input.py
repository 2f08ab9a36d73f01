"""Every bad input gets its status code and a message naming the field; the server then
serves valid requests, including those that were in flight meanwhile."""

from __future__ import annotations

import grpc
import pytest
from fake_engine import FakeEngine
from serving_helpers import collect, request

from server.proto.jpaged.v1 import generation_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def raw(data: bytes):
    """A request sent as raw bytes (what a buggy or hostile client can put on the wire)."""
    return data


def both_prompts() -> bytes:
    # Concatenated messages merge: this is one GenerateRequest with text AND token_ids.
    return (
        pb.GenerateRequest(text="t1 t2").SerializeToString()
        + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])).SerializeToString()
    )


def unknown_field() -> bytes:
    # Field 99, varint 1: a field this server does not know.
    return pb.GenerateRequest(text="t1").SerializeToString() + bytes([0x98, 0x06, 0x01])


def unknown_sampling_field() -> bytes:
    inner = pb.SamplingParameters(max_tokens=2).SerializeToString() + bytes([0xF8, 0x03, 0x05])
    return pb.GenerateRequest(text="t1").SerializeToString() + bytes([0x22, len(inner)]) + inner


def two_constraints() -> bytes:
    # Concatenated StructuredOutputs merge: regex AND grammar in the one oneof.
    inner = (
        pb.StructuredOutputs(regex="a+").SerializeToString()
        + pb.StructuredOutputs(grammar="start: /b+/").SerializeToString()
    )
    sampling = bytes([0xA2, 0x01, len(inner)]) + inner  # field 20, length-delimited
    return (
        pb.GenerateRequest(text="t1").SerializeToString() + bytes([0x22, len(sampling)]) + sampling
    )


def constrained(**constraint) -> pb.GenerateRequest:
    return request([1], structured_outputs=pb.StructuredOutputs(**constraint))


CASES = [
    # (name, request, code, text the message must contain)
    ("empty request", pb.GenerateRequest(), INVALID, "prompt"),
    ("empty text", pb.GenerateRequest(text=""), INVALID, "prompt text"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID, "prompt token_ids"),
    ("negative token id", request([1, -1]), INVALID, "token_ids[1]"),
    ("token id past vocab", request([1000]), INVALID, "token_ids[0] = 1000"),
    ("prompt too long (ids)", request([1] * 64), INVALID, "max_model_len"),
    ("prompt too long (text)", request("t1 " * 80), INVALID, "max_model_len"),
    ("both text and token ids", raw(both_prompts()), INVALID, "text and token_ids"),
    ("unknown field", raw(unknown_field()), INVALID, "unknown field number 99"),
    (
        "unknown sampling field",
        raw(unknown_sampling_field()),
        INVALID,
        "sampling: unknown field number 63",
    ),
    ("garbage bytes", raw(b"\xff\xff\xff"), INVALID, "malformed GenerateRequest"),
    ("n = 0", request([1], n=0), INVALID, "n must be >= 1"),
    ("n too large", request([1], n=65), INVALID, "n must be <= 64"),
    ("temperature < 0", request([1], temperature=-0.5), INVALID, "temperature"),
    ("top_p = 0", request([1], top_p=0.0), INVALID, "top_p"),
    ("top_p > 1", request([1], top_p=1.5), INVALID, "top_p"),
    ("top_k = 0", request([1], top_k=0), INVALID, "top_k"),
    ("min_p > 1", request([1], min_p=1.5), INVALID, "min_p"),
    ("presence_penalty", request([1], presence_penalty=2.5), INVALID, "presence_penalty"),
    ("frequency_penalty", request([1], frequency_penalty=-3.0), INVALID, "frequency_penalty"),
    ("repetition_penalty", request([1], repetition_penalty=0.0), INVALID, "repetition_penalty"),
    ("seed < 0", request([1], seed=-1), INVALID, "seed"),
    ("max_tokens = 0", request([1], max_tokens=0), INVALID, "max_tokens"),
    ("min_tokens > max_tokens", request([1], max_tokens=2, min_tokens=3), INVALID, "min_tokens"),
    ("logprobs > 20", request([1], logprobs=21), INVALID, "logprobs"),
    ("empty stop string", request([1], stop=["ok", ""]), INVALID, "stop"),
    ("negative stop token", request([1], stop_token_ids=[-4]), INVALID, "stop_token_ids"),
    ("stop token past vocab", request([1], stop_token_ids=[5000]), INVALID, "stop_token_ids[0]"),
    (
        "logit_bias id past vocab",
        request([1], logit_bias={5000: 1.0}),
        INVALID,
        "logit_bias token id 5000 is out of range [0, 1000)",
    ),
    (
        "logit_bias value",
        request([1], logit_bias={3: 150.0}),
        INVALID,
        "logit_bias[3] must be in [-100, 100], got 150.0",
    ),
    (
        "prompt_logprobs > 20",
        request([1], prompt_logprobs=21),
        INVALID,
        "prompt_logprobs must be in [0, 20], got 21",
    ),
    (
        "a bad JSON schema",
        constrained(json_schema='{"type": "objekt"}'),
        INVALID,
        "structured_outputs.json_schema: invalid JSON schema: Invalid type: objekt",
    ),
    (
        "JSON schema text that is not JSON",
        constrained(json_schema='{"type": '),
        INVALID,
        "structured_outputs.json_schema: invalid JSON: ",
    ),
    ("a bad regex", constrained(regex="[a-"), INVALID, "structured_outputs.regex: invalid regex"),
    (
        "a bad grammar",
        constrained(grammar="start: foo"),
        INVALID,
        "structured_outputs.grammar: invalid grammar",
    ),
    (
        "no choices",
        constrained(choice=pb.Choices()),
        INVALID,
        "structured_outputs.choice must be a non-empty list of strings",
    ),
    (
        "json_object false",
        constrained(json_object=False),
        INVALID,
        "structured_outputs: exactly one of json, regex, choice, grammar, json_object must be set",
    ),
    (
        "no constraint",
        constrained(),
        INVALID,
        "structured_outputs: set one of json_schema, regex, choice, grammar, json_object",
    ),
    (
        "two constraints",
        raw(two_constraints()),
        INVALID,
        "sampling.structured_outputs: set only one of regex and grammar (constraint)",
    ),
    ("empty request_id", request([1], request_id=""), INVALID, "request_id"),
    ("empty cache_salt", request([1], cache_salt=""), INVALID, "cache_salt"),
]


def send(stub_channel, req) -> list:
    """Sends req (a message, or raw bytes) to Generate and returns the responses."""
    serializer = (lambda b: b) if isinstance(req, bytes) else pb.GenerateRequest.SerializeToString
    generate = stub_channel.unary_stream(
        "/jpaged.v1.Generation/Generate",
        request_serializer=serializer,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    return list(generate(req, timeout=10))


@pytest.fixture(scope="module")
def shared(request):
    from serving_helpers import RunningServer

    s = RunningServer(FakeEngine(max_model_len=64, step_delay_s=0.02))
    request.addfinalizer(s.close)
    return s


@pytest.mark.parametrize("name,req,code,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_generate_request(shared, name, req, code, needle):
    with pytest.raises(grpc.RpcError) as err:
        send(shared.channel, req)
    assert err.value.code() == code, err.value.details()
    assert needle in err.value.details()
    got = collect(shared.stub, request([4], temperature=0, max_tokens=3))
    assert got.token_ids == {0: [4, 5, 6]}


def test_bad_requests_do_not_disturb_one_in_flight(make_server):
    s = make_server(FakeEngine(max_model_len=64, step_delay_s=0.05))
    call = s.stub.Generate(request([50], temperature=0, max_tokens=40))  # 2 s of steps
    it = iter(call)
    tokens = list(next(it).choices[0].token_ids)
    for _, req, code, _ in CASES:
        with pytest.raises(grpc.RpcError) as err:
            send(s.channel, req)
        assert err.value.code() == code
    assert s.stats().num_running == 1  # still in flight after all of them
    for msg in it:
        for c in msg.choices:
            tokens += c.token_ids
    assert tokens == [50 + i for i in range(40)]
    assert call.code() == grpc.StatusCode.OK
    st = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0)
    assert st.pages_used == 0


def test_duplicate_request_id_in_flight(shared):
    call = shared.stub.Generate(
        request([1], request_id="dup", temperature=0, max_tokens=60, ignore_eos=True)
    )
    next(iter(call))
    with pytest.raises(grpc.RpcError) as err:
        send(shared.channel, request([1], request_id="dup"))
    assert err.value.code() == INVALID
    assert "request_id 'dup' is already in flight" in err.value.details()
    call.cancel()


def test_bad_small_rpcs(shared):
    with pytest.raises(grpc.RpcError) as err:
        shared.stub.Abort(pb.AbortRequest())
    assert err.value.code() == INVALID and "request_ids" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        shared.stub.Detokenize(pb.DetokenizeRequest(token_ids=[3, 1000]))
    assert err.value.code() == INVALID and "token_ids[1] = 1000" in err.value.details()
    tokenize = shared.channel.unary_unary(
        "/jpaged.v1.Generation/Tokenize",
        request_serializer=lambda b: b,
        response_deserializer=pb.TokenizeResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        tokenize(pb.TokenizeRequest(text="t1").SerializeToString() + b"\x10\x01")
    assert err.value.code() == INVALID and "unknown field number 2" in err.value.details()
    assert list(shared.stub.Tokenize(pb.TokenizeRequest(text="t1 t2")).token_ids) == [1, 2]
