"""The server on the real engine and the demo model gives what the offline LLM gives.

One LLM is built; its offline generate() runs first, then its engine is served (one thread
drives it at a time, so sharing it is safe and the compiled programs are reused).
Marked slow: building and compiling the demo model on a 2-core CPU took 514 s when measured
(under load from other jobs); the fake-engine tests cover the same protocol on every run.
"""

from __future__ import annotations

import math

import grpc
import pytest
from serving_helpers import RunningServer, collect, request

from jpaged import LLM, SamplingParams
from server.proto.jpaged.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"max_num_seqs": 4, "max_model_len": 128, "page_size": 16}

CASES = [
    ("The weather was", SamplingParams(temperature=0, max_tokens=12)),
    ([1, 300, 301, 302, 303], SamplingParams(temperature=0, max_tokens=10, logprobs=2)),
    ("Once upon a time", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8)),
    (
        "Numbers are",
        SamplingParams(
            temperature=0.9,
            top_k=20,
            top_p=0.9,
            seed=11,
            max_tokens=16,
            stop=["e"],
            presence_penalty=0.5,
        ),
    ),
]


def to_request(prompt, p: SamplingParams) -> pb.GenerateRequest:
    kw = {
        "temperature": p.temperature,
        "max_tokens": p.max_tokens,
        "n": p.n,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "presence_penalty": p.presence_penalty,
        "stop": p.stop,
    }
    if p.seed is not None:
        kw["seed"] = p.seed
    if p.logprobs is not None:
        kw["logprobs"] = p.logprobs
    return request(prompt, **kw)


@pytest.fixture(scope="module")
def served(demo_model_dir):
    llm = LLM(str(demo_model_dir), **ENGINE_ARGS)
    offline = [llm.generate([prompt], params)[0] for prompt, params in CASES]
    s = RunningServer(llm.llm_engine, model_name="demo")
    yield s, offline
    s.close()


def test_server_matches_offline_llm(served):
    s, offline = served
    for (prompt, params), want in zip(CASES, offline):
        got = collect(s.stub, to_request(prompt, params), timeout=300)
        assert got.final.usage.prompt_tokens == len(want.prompt_token_ids)
        for c in want.outputs:
            assert got.token_ids[c.index] == c.token_ids, (prompt, c.index)
            assert got.text[c.index] == c.text
            assert pb.FinishReason.Name(got.finish_reason[c.index]) == (
                "FINISH_REASON_" + c.finish_reason.upper()
            )
            if c.logprobs is not None:
                for lp, position in zip(got.logprobs[c.index], c.logprobs, strict=True):
                    assert math.isclose(lp.logprob, position[lp.token_id], abs_tol=1e-6)
                    assert {t.token_id: t.logprob for t in lp.top_logprobs} == pytest.approx(
                        position, abs=1e-6
                    )
        assert got.final.usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)
    # The stop-string case really stopped on it.
    assert offline[3].outputs[0].finish_reason in ("stop", "length")


def test_real_engine_cancel_frees_pages(served):
    s, _ = served
    idle = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0)
    call = s.stub.Generate(
        request("A long story:", temperature=0, max_tokens=100, ignore_eos=True), timeout=300
    )
    n = 0
    for msg in call:
        n += len(msg.choices[0].token_ids)
        if n >= 3:
            break
    assert s.stats().pages_used > idle.pages_used
    call.cancel()
    st = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0, timeout=10)
    assert st.pages_used == idle.pages_used
    got = collect(s.stub, request("The weather was", temperature=0, max_tokens=12), timeout=300)
    assert got.token_ids[0] == served[1][0].outputs[0].token_ids


def test_real_engine_rejects_too_long_prompt(served):
    s, _ = served
    with pytest.raises(grpc.RpcError) as err:
        collect(s.stub, request([5] * 128, max_tokens=2), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in err.value.details()
    info = s.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_model_len == 128 and info.architecture == "LlamaForCausalLM"
    ids = list(s.stub.Tokenize(pb.TokenizeRequest(text="The weather")).token_ids)
    assert s.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "The weather"
