"""`jpaged serve --speculative-config` on the demo model: the engine's speculative-decoding
counts reach /metrics as vLLM's spec_decode counters (jpaged_ prefixed) and gRPC's
GetModelInfo."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from serving_helpers import ServeProcess, scrape

from server.proto.jpaged.v1 import generation_pb2 as pb
from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "cost_aware": False,  # every step proposes: the counts below do not depend on timing
}
NAMES = [f"jpaged_spec_decode_num_{k}_total" for k in ("drafts", "draft_tokens", "accepted_tokens")]


@pytest.fixture(scope="module")
def served(demo_model_dir):
    flags = ["--max-num-seqs=2", "--max-model-len=128", "--page-size=16"]
    proc = ServeProcess(demo_model_dir, [*flags, "--speculative-config", json.dumps(SPEC)])
    yield proc
    assert proc.stop() == 0


def test_a_repetitive_prompt_moves_the_speculative_decoding_counters(served):
    before = scrape(served.url + "/metrics")
    assert [before[n] for n in NAMES] == [0, 0, 0]
    body = {"prompt": [5, 6, 7, 8] * 8, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
    drafts, draft_tokens, accepted = (scrape(served.url + "/metrics")[n] for n in NAMES)
    # The offline LLM with the same engine settings counts 13 drafts of 30 tokens, 14 of them
    # accepted, for this request (the demo model's greedy output falls into a 2-token loop).
    assert (drafts, draft_tokens, accepted) == (13, 30, 14)
    assert 0 < accepted <= draft_tokens <= SPEC["num_speculative_tokens"] * drafts
    # The same counts in gRPC's GetModelInfo.
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    s = info.stats
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (13, 30, 14)
