"""Generate over the wire gives what the engine gives offline: tokens, text, n, stops,
logprobs, seeds, usage, and every sampling field reaches the engine unchanged."""

from __future__ import annotations

import json
import threading

from fake_engine import FakeEngine, offline_generate
from serving_helpers import Collected, collect, request

from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams
from jpaged.structured_output import StructuredOutputsParams
from server.proto.jpaged.v1 import generation_pb2 as pb

STOP, LENGTH = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH


def test_greedy_tokens_by_hand(server):
    # sum([1, 2, 3]) = 6: tokens 6, 7, 8, 9, 10; text " t6 t7 t8 t9 t10".
    got = collect(server.stub, request([1, 2, 3], temperature=0, max_tokens=5))
    assert got.token_ids == {0: [6, 7, 8, 9, 10]}
    assert got.text == {0: " t6 t7 t8 t9 t10"}
    assert got.finish_reason == {0: LENGTH}
    assert got.final.finished and not any(m.finished for m in got.messages[:-1])
    assert got.final.usage == pb.Usage(prompt_tokens=3, completion_tokens=5)


def test_stream_and_collect_equal_offline(server):
    cases = [
        ("t5 t9 hello world", SamplingParams(temperature=0, max_tokens=12)),
        ([40, 41, 42, 43, 44, 45], SamplingParams(temperature=0, max_tokens=30)),
        ([997, 998], SamplingParams(temperature=0, max_tokens=62)),  # fills max_model_len (64)
        ([0, 2], SamplingParams(temperature=0, max_tokens=9)),  # token 2 = EOS at step 1
    ]
    for prompt, params in cases:
        want = offline_generate(prompt, params)
        req = request(prompt, temperature=0, max_tokens=params.max_tokens)
        # Streaming: handle messages as they arrive.
        streamed_ids, streamed_text = [], ""
        for msg in server.stub.Generate(req):
            for c in msg.choices:
                streamed_ids += c.token_ids
                streamed_text += c.text
            if msg.finished:
                final = msg
        # Unary-style: take the whole response at once.
        got = collect(server.stub, req)
        w = want.outputs[0]
        assert streamed_ids == got.token_ids[0] == w.token_ids
        assert streamed_text == got.text[0] == w.text
        assert final.choices[0].finish_reason == got.finish_reason[0]
        assert (
            pb.FinishReason.Name(got.finish_reason[0]) == "FINISH_REASON_" + w.finish_reason.upper()
        )
        assert got.final.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.final.usage.completion_tokens == len(w.token_ids)
    # The EOS case really stopped on EOS: sum 2 -> token 2 first.
    assert collect(server.stub, request([0, 2], temperature=0)).token_ids == {0: [2]}


def test_n_choices(server):
    got = collect(server.stub, request([10, 20], temperature=0, n=3, max_tokens=4))
    # choice j starts at 30 + 7j
    assert got.token_ids == {0: [30, 31, 32, 33], 1: [37, 38, 39, 40], 2: [44, 45, 46, 47]}
    assert got.text[2] == " t44 t45 t46 t47"
    assert got.finish_reason == {0: LENGTH, 1: LENGTH, 2: LENGTH}
    assert got.final.usage.completion_tokens == 12
    assert [c.index for c in got.final.choices] == [0, 1, 2]


def test_n_choices_finish_separately(server):
    # sum 3: choice 0 is 3, 4, 5, ...; choice 1 is 10, 11, ... and stops at token 11.
    got = collect(server.stub, request([3], temperature=0, n=2, max_tokens=6, stop_token_ids=[11]))
    assert got.token_ids == {0: [3, 4, 5, 6, 7, 8], 1: [10, 11]}
    assert got.finish_reason == {0: LENGTH, 1: STOP}
    assert got.final_choice[1].stop_token_id == 11
    assert got.final_choice[0].WhichOneof("stop_reason") is None
    # EOS (token 2) stops with no stop reason: sum 0 gives 0, 1, 2.
    eos = collect(server.stub, request([0], temperature=0, max_tokens=6))
    assert eos.token_ids == {0: [0, 1, 2]} and eos.finish_reason == {0: STOP}
    assert eos.final_choice[0].WhichOneof("stop_reason") is None


def test_stop_strings(server):
    # tokens 20, 21, 22, ...: text " t20 t21 t22 t23"
    got = collect(server.stub, request([20], temperature=0, max_tokens=10, stop=["t22", "zzz"]))
    assert got.token_ids[0] == [20, 21, 22]
    assert got.text[0] == " t20 t21 "
    assert got.finish_reason[0] == STOP
    assert got.final_choice[0].stop_string == "t22"
    kept = collect(
        server.stub,
        request([20], temperature=0, max_tokens=10, stop=["t22"], include_stop_str_in_output=True),
    )
    assert kept.text[0] == " t20 t21 t22"
    # A stop string is never partly streamed: " t2" of " t22" was held back mid-stream.
    assert all("t2 " not in c.text for m in got.messages for c in m.choices)


def test_min_tokens_delays_stop(server):
    got = collect(
        server.stub,
        request([20], temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=[21, 24]),
    )
    assert got.token_ids[0] == [20, 21, 22, 23, 24]
    assert got.final_choice[0].stop_token_id == 24


def test_ignore_eos(server):
    got = collect(server.stub, request([0, 2], temperature=0, max_tokens=3, ignore_eos=True))
    assert got.token_ids[0] == [2, 3, 4]
    assert got.finish_reason[0] == LENGTH
    special = collect(
        server.stub,
        request([0, 2], temperature=0, max_tokens=3, ignore_eos=True, skip_special_tokens=False),
    )
    assert special.text[0] == "</s> t3 t4"


def test_logprobs(server):
    got = collect(server.stub, request([5], temperature=0, max_tokens=3, logprobs=2))
    lps = got.logprobs[0]
    assert [lp.token_id for lp in lps] == [5, 6, 7]
    for lp in lps:
        assert lp.logprob == -0.5
        assert [(t.token_id, t.logprob) for t in lp.top_logprobs] == [
            (lp.token_id, -0.5),
            (lp.token_id + 1, -1.5),
        ]
    assert got.final_choice[0].cumulative_logprob == -1.5
    plain = collect(server.stub, request([5], temperature=0, max_tokens=3))
    assert plain.logprobs[0] == [] and not plain.final_choice[0].HasField("cumulative_logprob")


def test_seed_round_trips(server):
    seeded = [
        collect(server.stub, request([1], temperature=1.0, seed=s, max_tokens=3))
        for s in (11, 11, 12)
    ]
    # offset (31 * seed + 1) % 1000 -> 342 for 11, 373 for 12; plus sum([1]) = 1
    assert seeded[0].token_ids[0] == seeded[1].token_ids[0] == [343, 344, 345]
    assert seeded[2].token_ids[0] == [374, 375, 376]
    offline = offline_generate([1], SamplingParams(temperature=1.0, seed=11, max_tokens=3))
    assert offline.outputs[0].token_ids == [343, 344, 345]


def test_every_sampling_field_reaches_the_engine(make_server):
    engine = FakeEngine()
    s = make_server(engine)
    fields = {
        "n": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.1,
        "seed": 123,
        "max_tokens": 5,
        "min_tokens": 1,
        "stop": ["a", "bc"],
        "stop_token_ids": [999],
        "ignore_eos": True,
        "logprobs": 3,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    wire = {
        "logit_bias": {5: 2.5, 7: -100.0},
        "prompt_logprobs": 2,
        "structured_outputs": pb.StructuredOutputs(choice=pb.Choices(choices=["a", "bc"])),
    }
    collect(s.stub, request([1, 2], request_id="all-fields", cache_salt="salty", **fields, **wire))
    ((params, salt),) = [v for k, v in engine.received.items() if k.startswith("all-fields#")]
    # The server asks for deltas (it forwards the engine's outputs as they are).
    delta = RequestOutputKind.DELTA
    assert params == SamplingParams(
        **fields,
        logit_bias={5: 2.5, 7: -100.0},
        prompt_logprobs=2,
        structured_outputs=StructuredOutputsParams(choice=["a", "bc"]),
        output_kind=delta,
    )
    assert salt == "salty"
    # Unset fields keep the offline defaults.
    collect(s.stub, request([1, 2], request_id="defaults"))
    ((params, salt),) = [v for k, v in engine.received.items() if k.startswith("defaults#")]
    assert params == SamplingParams(output_kind=delta) and salt is None
    # Each constraint kind, json_schema as JSON text.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    kinds = {
        "json": pb.StructuredOutputs(json_schema=json.dumps(schema), disable_any_whitespace=True),
        "regex": pb.StructuredOutputs(regex="[0-9]+"),
        "grammar": pb.StructuredOutputs(grammar="start: /x+/"),
        "json_object": pb.StructuredOutputs(json_object=True),
    }
    want = {
        "json": StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex="[0-9]+"),
        "grammar": StructuredOutputsParams(grammar="start: /x+/"),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    for kind, constraint in kinds.items():
        collect(s.stub, request([1], request_id=kind, structured_outputs=constraint))
        ((params, _),) = [v for k, v in engine.received.items() if k.startswith(kind + "#")]
        assert params.structured_outputs == want[kind], kind


def test_cached_prompt_tokens_and_salt(server):
    prompt = list(range(100, 110))  # 10 tokens, pages of 4: 8 cacheable
    first = collect(server.stub, request(prompt, temperature=0, max_tokens=2))
    again = collect(server.stub, request(prompt, temperature=0, max_tokens=2))
    salted = collect(server.stub, request(prompt, temperature=0, max_tokens=2, cache_salt="x"))
    assert first.final.usage.cached_prompt_tokens == 0
    assert again.final.usage.cached_prompt_tokens == 8
    assert salted.final.usage.cached_prompt_tokens == 0
    assert again.token_ids == first.token_ids


def test_request_id_round_trips(server):
    call = server.stub.Generate(request([1], request_id="my-id", temperature=0, max_tokens=2))
    msgs = list(call)
    assert dict(call.initial_metadata())["x-request-id"] == "my-id"
    assert {m.request_id for m in msgs} == {"my-id"}
    # Without one the server makes one, the same in every message and in the metadata.
    call = server.stub.Generate(request([1], temperature=0, max_tokens=2))
    msgs = list(call)
    rid = dict(call.initial_metadata())["x-request-id"]
    assert len(rid) == 32 and {m.request_id for m in msgs} == {rid}
    # After a request ends its id may be used again.
    assert (
        collect(server.stub, request([1], request_id="my-id", max_tokens=1)).request_id == "my-id"
    )


def test_many_concurrent_streams_are_each_correct(server):
    results: dict[int, Collected] = {}

    def run(i: int) -> None:
        results[i] = collect(
            server.stub, request([i, i + 1], temperature=0, n=1 + i % 3, max_tokens=5 + i % 7)
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, got in results.items():
        want = offline_generate(
            [i, i + 1], SamplingParams(temperature=0, n=1 + i % 3, max_tokens=5 + i % 7)
        )
        assert got.token_ids == {c.index: c.token_ids for c in want.outputs}
        assert got.text == {c.index: c.text for c in want.outputs}
    assert len(results) == 40
    s = server.wait_until(lambda s: s.num_running == 0 and s.num_waiting == 0)
    assert s.pages_used == 0 and s.pages_free == s.pages_total
