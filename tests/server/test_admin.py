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
