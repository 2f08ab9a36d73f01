"""Wire checks: unknown fields and doubly-set oneofs are found at any depth."""

from __future__ import annotations

from server import wire
from server.proto.jpaged.v1 import generation_pb2 as pb


def test_valid_messages_pass():
    req = pb.GenerateRequest(
        request_id="a",
        token_ids=pb.TokenIds(ids=[1, 2, 300000]),
        cache_salt="s",
        sampling=pb.SamplingParameters(
            temperature=0.5, seed=2**62, stop=["x", "y"], stop_token_ids=[1, 2], ignore_eos=False
        ),
    )
    data = req.SerializeToString()
    assert wire.find_problem(data, pb.GenerateRequest.DESCRIPTOR) is None
    assert wire.parser(pb.GenerateRequest)(data) == req
    assert wire.find_problem(b"", pb.GenerateRequest.DESCRIPTOR) is None


def test_oneof_set_twice():
    data = (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])).SerializeToString()
        + pb.GenerateRequest(text="hi").SerializeToString()
    )
    problem = wire.parser(pb.GenerateRequest)(data)
    assert isinstance(problem, wire.InvalidRequest)
    assert problem.message == "GenerateRequest: set only one of token_ids and text (prompt)"
    # The same member twice is a legal merge.
    twice = pb.GenerateRequest(text="a").SerializeToString() * 2
    assert wire.find_problem(twice, pb.GenerateRequest.DESCRIPTOR) is None


def test_unknown_fields_at_depth():
    ids = pb.TokenIds(ids=[1]).SerializeToString() + bytes([0x15, 0, 0, 0, 0])  # field 2, fixed32
    data = bytes([0x1A, len(ids)]) + ids
    assert (
        wire.find_problem(data, pb.GenerateRequest.DESCRIPTOR)
        == "GenerateRequest.token_ids: unknown field number 2"
    )


def test_truncated_and_garbage():
    assert isinstance(wire.parser(pb.GenerateRequest)(b"\x12\x05ab"), wire.InvalidRequest)
    assert wire.find_problem(b"\x0b", pb.GenerateRequest.DESCRIPTOR).startswith(
        "malformed GenerateRequest"
    )
