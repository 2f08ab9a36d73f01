"""The committed stubs are what scripts/gen_proto.sh makes from the committed proto."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = pathlib.Path("server/proto/jpaged/v1")
GENERATED = ("generation_pb2.py", "generation_pb2_grpc.py")


def test_regenerating_gives_the_committed_stubs(tmp_path):
    (tmp_path / PROTO_DIR).mkdir(parents=True)
    shutil.copy(ROOT / PROTO_DIR / "generation.proto", tmp_path / PROTO_DIR)
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/gen_proto.sh", tmp_path / "scripts")
    subprocess.run(
        ["bash", str(tmp_path / "scripts/gen_proto.sh")],
        check=True,
        env={"PATH": str(pathlib.Path(sys.executable).parent) + ":/usr/bin:/bin"},
    )
    for name in GENERATED:
        fresh = (tmp_path / PROTO_DIR / name).read_text()
        committed = (ROOT / PROTO_DIR / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh"


def test_stubs_import_and_describe_the_service():
    from server.proto.jpaged.v1 import generation_pb2 as pb
    from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "jpaged.v1.Generation"
    assert {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods
    } == {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False),
        "Embed": ("EmbedRequest", "EmbedResponse", False),
        "Chat": ("ChatRequest", "ChatResponse", True),
    }
    assert hasattr(pb_grpc, "GenerationStub")
    # Every SamplingParams field a client sets is in the proto, with presence for the scalar
    # ones (output_kind is the server's: it streams deltas).
    import dataclasses

    from jpaged.sample.sampling_params import SamplingParams
    from jpaged.structured_output import KINDS, StructuredOutputsParams

    fields = pb.SamplingParameters.DESCRIPTOR.fields_by_name
    assert set(fields) == {f.name for f in dataclasses.fields(SamplingParams)} - {"output_kind"}
    for f in fields.values():
        assert f.is_repeated or f.has_presence, f.name
    bias = fields["logit_bias"].message_type
    assert bias.GetOptions().map_entry
    assert [bias.fields_by_name[k].cpp_type for k in ("key", "value")] == [
        bias.fields_by_name["key"].CPPTYPE_INT32,
        bias.fields_by_name["value"].CPPTYPE_FLOAT,
    ]
    # Every constraint kind is one member of the oneof (json as json_schema, JSON text), and
    # every other StructuredOutputsParams field is a field of its own.
    constraint = pb.StructuredOutputs.DESCRIPTOR
    members = [f.name for f in constraint.oneofs_by_name["constraint"].fields]
    assert members == ["json_schema", *KINDS[1:]]
    params = {f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init}
    assert set(constraint.fields_by_name) == params - {"json"} | {"json_schema"}
    # The response carries the prompt's logprobs.
    assert pb.GenerateResponse.DESCRIPTOR.fields_by_name["prompt_logprobs"].message_type == (
        pb.TokenLogprob.DESCRIPTOR
    )
