"""Cancel, disconnect, deadline and Abort free a request's pages at once and leave the other
streams alone; a slow client never stalls the step loop; backpressure refuses at once."""

from __future__ import annotations

import threading

import grpc
import pytest
from fake_engine import FakeEngine, offline_generate
from serving_helpers import Collected, collect, request

from jpaged.sample.sampling_params import SamplingParams
from server.proto.jpaged.v1 import generation_pb2 as pb


def slow_engine(**kw) -> FakeEngine:
    return FakeEngine(max_model_len=4096, num_pages=4096, step_delay_s=0.01, **kw)


def run_in_thread(fn, *args):
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the test through out
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, out


def test_cancel_mid_stream_frees_pages_and_spares_others(make_server):
    engine = slow_engine()
    s = make_server(engine)
    idle = s.stats()
    assert idle.pages_used == 0 and idle.pages_free == idle.pages_total == 4096
    others = [
        run_in_thread(collect, s.stub, request([i], temperature=0, max_tokens=60))
        for i in (100, 200)
    ]
    call = s.stub.Generate(
        request([7] * 40, request_id="victim", temperature=0, max_tokens=3000, ignore_eos=True)
    )
    got = []
    for msg in call:
        got += msg.choices[0].token_ids
        if len(got) >= 5:
            break
    busy = s.stats()
    assert busy.pages_used >= 11  # the victim alone: ceil(45 / 4) pages and growing
    call.cancel()
    # Only the two others remain, each holding at most ceil((1 + 60) / 4) = 16 pages.
    s.wait_until(lambda st: st.num_running <= 2 and st.pages_used <= 32, timeout=10)
    assert got == [(280 + i) % 1000 for i in range(5)]  # sum([7] * 40) = 280
    for t, out in others:
        t.join()
        assert "error" not in out, out
    for (t, out), i in zip(others, (100, 200)):
        want = offline_generate([i], SamplingParams(temperature=0, max_tokens=60))
        assert out["value"].token_ids[0] == want.outputs[0].token_ids
        assert out["value"].finish_reason[0] == pb.FINISH_REASON_LENGTH
    after = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0)
    assert after.pages_used == 0 and after.pages_free == idle.pages_free
    assert not engine.has_unfinished_requests()


def test_deadline_aborts_and_frees(make_server):
    s = make_server(slow_engine())
    with pytest.raises(grpc.RpcError) as err:
        collect(s.stub, request([1], temperature=0, max_tokens=3000, ignore_eos=True), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    st = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0, timeout=2)
    assert st.pages_used == 0
    # The server goes on serving.
    assert collect(s.stub, request([1], temperature=0, max_tokens=2)).token_ids == {0: [1, 2]}


def test_disconnect_aborts_and_frees(make_server):
    s = make_server(slow_engine())
    channel = grpc.insecure_channel(s.address)
    stub = type(s.stub)(channel)
    call = stub.Generate(request([1], temperature=0, max_tokens=3000, ignore_eos=True))
    next(iter(call))
    s.wait_until(lambda st: st.num_running == 1)
    channel.close()  # the connection goes away without a cancel from the application
    st = s.wait_until(lambda st: st.num_running == 0 and st.pages_used == 0, timeout=2)
    assert st.num_waiting == 0


def test_abort_rpc_ends_stream_with_abort(make_server):
    s = make_server(slow_engine())
    keep_t, keep = run_in_thread(collect, s.stub, request([3], temperature=0, max_tokens=40))
    call = s.stub.Generate(
        request([9, 9], request_id="job-1", temperature=0, max_tokens=3000, ignore_eos=True)
    )
    it = iter(call)
    first = next(it)
    assert first.choices[0].token_ids == [18]
    reply = s.stub.Abort(pb.AbortRequest(request_ids=["job-1", "no-such-job"]))
    assert list(reply.aborted_request_ids) == ["job-1"]
    rest = Collected([first, *it])
    assert rest.final.finished
    assert rest.finish_reason == {0: pb.FINISH_REASON_ABORT}
    n = len(rest.token_ids[0])
    assert rest.token_ids[0] == [(18 + i) % 1000 for i in range(n)]
    assert rest.final.usage.completion_tokens == n and rest.final.usage.prompt_tokens == 2
    assert call.code() == grpc.StatusCode.OK
    keep_t.join()
    assert keep["value"].token_ids[0] == list(range(3, 43))
    st = s.wait_until(lambda st: st.num_running == 0)
    assert st.pages_used == 0
    # Aborting again finds nothing.
    assert list(s.stub.Abort(pb.AbortRequest(request_ids=["job-1"])).aborted_request_ids) == []


def test_slow_client_does_not_block_the_step_loop(make_server):
    engine = FakeEngine(max_model_len=100_000, num_pages=100_000)
    s = make_server(engine)
    # A client that never reads: 5k one-token messages overflow gRPC's flow-control window.
    stalled = s.stub.Generate(
        request([5], request_id="stalled", temperature=0, max_tokens=5_000, ignore_eos=True)
    )
    s.wait_until(lambda st: st.num_running == 1)
    # Others are served, and the stalled request itself finishes in the engine.
    for i in range(10, 15):
        got = collect(s.stub, request([i], temperature=0, max_tokens=20), timeout=30)
        assert got.token_ids[0] == [i + k for k in range(20)]
    st = s.wait_until(lambda st: st.num_running == 0, timeout=60)
    assert st.pages_used == 0 and engine.num_steps >= 5_000
    # The stalled client reads at last and gets all of it, in order.
    got = Collected(list(stalled))
    assert got.token_ids[0] == [(5 + k) % 1000 for k in range(5_000)]
    assert got.finish_reason[0] == pb.FINISH_REASON_LENGTH


def test_backpressure_resource_exhausted(make_server):
    engine = slow_engine(max_num_seqs=1)
    s = make_server(engine, max_waiting=2)
    running = s.stub.Generate(request([1], temperature=0, max_tokens=3000, ignore_eos=True))
    next(iter(running))
    waiting = [s.stub.Generate(request([20], temperature=0, max_tokens=5)) for _ in range(2)]
    s.wait_until(lambda st: st.num_waiting == 2 and st.num_running == 1)
    with pytest.raises(grpc.RpcError) as err:
        collect(s.stub, request([3], temperature=0, max_tokens=5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max 2" in err.value.details()
    # Refused at the door: the engine never saw it.
    assert len(engine.received) == 3
    # Once the queue drains, requests are accepted again.
    running.cancel()
    for w in waiting:
        assert Collected(list(w)).token_ids[0] == [20, 21, 22, 23, 24]
    assert collect(s.stub, request([3], temperature=0, max_tokens=2)).token_ids[0] == [3, 4]
    st = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0)
    assert st.pages_used == 0
