"""Health, reflection, GetModelInfo, Tokenize/Detokenize and the Prometheus endpoint."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving_helpers import collect, request, scrape

from server.proto.jpaged.v1 import generation_pb2 as pb


def test_health_serving(server):
    stub = health_pb2_grpc.HealthStub(server.channel)
    for name in ("", "jpaged.v1.Generation"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_services_and_describes_the_proto(server):
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    reqs = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="jpaged.v1.Generation"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(reqs)))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {
        "jpaged.v1.Generation",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    protos = described.file_descriptor_response.file_descriptor_proto
    assert any(b"GenerateRequest" in p for p in protos)


def test_model_info_and_stats(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model == "fake"
    assert info.architecture == "FakeForCausalLM"
    assert (info.vocab_size, info.max_model_len, list(info.eos_token_ids)) == (1000, 64, [2])
    assert info.stats.pages_total == 1024 and info.stats.pages_free == 1024
    collect(server.stub, request(list(range(8)), temperature=0, max_tokens=3))
    collect(server.stub, request(list(range(8)), temperature=0, max_tokens=3))
    st = server.wait_until(lambda s: s.prefix_cache_query_tokens == 16)
    assert st.prefix_cache_hit_tokens == 4  # 8 tokens, pages of 4: one page, last one kept out
    assert st.peak_pages_used == 3  # ceil((8 + 3) / 4)
    assert st.pages_used == 0
    # No speculation: its counts are there, at 0.
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens) == (0, 0, 0)


# tests/numpy_checkpoints.py's default Llama: D 64, 2 layers, 4 query and 2 KV heads of 16,
# F 128, vocab 2048 (the demo tokenizer's), untied LM head.
D, L, HQ, HKV, DH, F, V = 64, 2, 4, 2, 16, 128, 2048


def _weight_bytes(quantized: bool) -> int:
    """float32 params, or int8 projections with one float32 scale per output channel."""
    projections = {  # (input elements, output channels)
        "wq": (D, HQ * DH), "wk": (D, HKV * DH), "wv": (D, HKV * DH), "wo": (HQ * DH, D),
        "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D),
    }  # fmt: skip
    if quantized:
        per_layer = sum(i * o + 4 * o for i, o in projections.values())
    else:
        per_layer = sum(4 * i * o for i, o in projections.values())
    norms = 2 * 4 * D
    return L * (per_layer + norms) + 2 * 4 * V * D + 4 * D  # + embed, lm_head, final norm


@pytest.mark.parametrize(
    ("engine_args", "want"),
    [
        # float32 pages: K and V of every layer, 4 bytes per element.
        ({}, ("float32", L * 2 * HKV * DH * 4, _weight_bytes(False), "")),
        # int8 pages: 1 byte per element and one bfloat16 scale per token and KV head.
        (
            {"kv_cache_dtype": "int8", "quantization": "int8"},
            ("int8", L * 2 * HKV * (DH + 2), _weight_bytes(True), "int8"),
        ),
    ],
    ids=["float32", "int8"],
)
def test_model_info_memory_of_a_real_engine(make_server, tmp_path, engine_args, want):
    """GetModelInfo says the engine's KV dtype, bytes per token, resident weight bytes and
    --quantization (no step runs, so nothing compiles)."""
    from numpy_checkpoints import make_llama_checkpoint

    from jpaged import LLM

    llm = LLM(
        str(make_llama_checkpoint(tmp_path / "llama")), max_num_seqs=2, max_model_len=64,
        num_pages=8, page_size=16, compilation_cache_dir=None, **engine_args,
    )  # fmt: skip
    info = make_server(llm.llm_engine, model_name="tiny").stub.GetModelInfo(
        pb.GetModelInfoRequest()
    )
    got = (info.kv_cache_dtype, info.kv_bytes_per_token, info.weight_bytes, info.quantization)
    assert got == want == (
        (s := llm.stats())["kv_cache_dtype"], s["kv_bytes_per_token"], s["weight_bytes"],
        s["quantization"] or "",
    )  # fmt: skip
    assert (want[1], want[2]) in ((512, 1_344_768), (144, 1_127_680))


def test_model_info_memory_of_a_fake_engine(server):
    """An engine whose stats leave the memory out: the proto's defaults."""
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    got = (info.kv_cache_dtype, info.kv_bytes_per_token, info.weight_bytes, info.quantization)
    assert got == ("", 0, 0, "")


def test_tokenize_detokenize(server):
    ids = list(server.stub.Tokenize(pb.TokenizeRequest(text="t5 t17 t999")).token_ids)
    assert ids == [5, 17, 999]
    text = server.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text
    assert text == " t5 t17 t999"


def test_metrics(make_server):
    s = make_server()
    collect(s.stub, request([1, 2], temperature=0, max_tokens=4))  # length
    collect(s.stub, request([0], temperature=0, max_tokens=9))  # stop at EOS after 3 tokens
    collect(s.stub, request([10], temperature=0, n=2, max_tokens=5))  # length, 10 tokens
    with pytest.raises(grpc.RpcError):
        collect(s.stub, request([1], top_p=7.0))
    s.wait_until(lambda st: st.num_running == 0)
    m = scrape(f"http://127.0.0.1:{s.server.metrics_port}/metrics")
    assert m['jpaged_requests_total{outcome="length"}'] == 2
    assert m['jpaged_requests_total{outcome="stop"}'] == 1
    assert m['jpaged_requests_total{outcome="invalid_argument"}'] == 1
    assert m['jpaged_requests_total{outcome="cancelled"}'] == 0
    assert m["jpaged_prompt_tokens_total"] == 4
    assert m["jpaged_generation_tokens_total"] == 4 + 3 + 10
    assert m["jpaged_time_to_first_token_seconds_count"] == 3
    assert m["jpaged_time_per_output_token_seconds_count"] == 3
    assert m["jpaged_kv_pages_used"] == 0
    assert m["jpaged_kv_pages_free"] == m["jpaged_kv_pages_total"] == 1024
    assert m["jpaged_kv_pages_cached"] == 0
    assert m["jpaged_num_requests_running"] == 0 and m["jpaged_num_requests_waiting"] == 0
    assert m["jpaged_prefix_cache_query_tokens_total"] == 4
    assert m["jpaged_prefix_cache_hit_rate"] == 0
    assert m["jpaged_preemptions_total"] == 0
    assert not [k for k in m if "_created" in k]
    # The HTTP port serves the same registry.
    http = scrape(s.http_url + "/metrics")
    assert http['jpaged_requests_total{outcome="length"}'] == 2
    assert http["jpaged_generation_tokens_total"] == 4 + 3 + 10
