"""The step thread on its own: aborts land within one step, a consumer that never reads does
not hold the engine back, an engine error fails only the requests it touched, and stopping
flushes the KV pages to the disk tier (jpaged/core/disk_flush.py) on the step thread."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
from fake_engine import FakeEngine
from serving_helpers import collect, request

from jpaged.sample.sampling_params import SamplingParams
from server.engine_loop import EngineLoop

LONG = SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True)


class RecordingEngine(FakeEngine):
    """Remembers which requests each step advanced (log[k] is step k + 1)."""

    def __init__(self, **kw) -> None:
        super().__init__(max_model_len=100_000, num_pages=100_000, **kw)
        self.log: list[set[str]] = []

    def step(self):
        outputs = super().step()
        self.log.append({o.request_id for o in outputs})
        return outputs


async def wait_engine_idle(engine) -> None:
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine did not become idle")


def test_release_aborts_within_one_step():
    async def scenario():
        engine = RecordingEngine(step_delay_s=0.005)
        loop = EngineLoop(engine)
        loop.start()
        other = loop.submit("other", [3], SamplingParams(temperature=0, max_tokens=40), None)
        h = loop.submit("victim", [1], LONG, None)
        while h.choices[0].num_tokens < 3:
            await h.wait()
        steps_at_release = engine.num_steps
        loop.release(h)
        while not other.finished:
            await other.wait()
        await wait_engine_idle(engine)
        steps_with_victim = [k + 1 for k, ids in enumerate(engine.log) if h.engine_id in ids]
        assert await loop.stop()  # the thread ended
        return steps_at_release, steps_with_victim, other, engine

    at_release, with_victim, other, engine = asyncio.run(scenario())
    # The step running when release() was called may finish; no later step has the victim.
    assert max(with_victim) <= at_release + 1
    assert other.choices[0].num_tokens == 40
    assert engine.stats()["pages_used"] == 0


def test_consumer_that_never_reads_does_not_hold_back_the_engine():
    async def scenario():
        engine = RecordingEngine()
        loop = EngineLoop(engine)
        loop.start()
        h = loop.submit(
            "r", [5], SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True), None
        )
        for _ in range(6000):  # polls without consuming: nobody reads h's tokens meanwhile
            if h.finished:
                break
            await asyncio.sleep(0.005)
        await loop.stop()
        return h, engine

    h, engine = asyncio.run(scenario())
    assert engine.num_steps == 2000 and h.finished
    assert h.choices[0].token_ids == [(5 + k) % 1000 for k in range(2000)]


class FlakyEngine(FakeEngine):
    """Its step raises once, on the first step that has a request with prompt [666]."""

    def step(self):
        if any(r.prompt_ids == [666] for r in self._waiting + self._running):
            self.abort_request(
                [r.request_id for r in self._waiting + self._running if r.prompt_ids == [666]]
            )
            raise RuntimeError("device fell over")
        return super().step()


def test_engine_error_fails_in_flight_requests_and_the_server_goes_on(make_server):
    s = make_server(FlakyEngine())
    with pytest.raises(grpc.RpcError) as err:
        collect(s.stub, request([666], temperature=0, max_tokens=4), timeout=30)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "device fell over" in err.value.details()
    assert collect(s.stub, request([4], temperature=0, max_tokens=3)).token_ids == {0: [4, 5, 6]}
    st = s.wait_until(lambda st: st.num_running == 0)
    assert st.pages_used == 0


class StuckEngine(FakeEngine):
    """Its steps wait for `release` (a step stuck in the engine or on the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def step(self):
        self.entered.set()
        self.release.wait(60)
        return super().step()


def test_stop_gives_up_on_a_stuck_step_and_says_so(caplog):
    async def scenario():
        engine = StuckEngine()
        loop = EngineLoop(engine)
        loop.start()
        loop.submit("r", [1], SamplingParams(temperature=0, max_tokens=3), None)
        assert await asyncio.to_thread(engine.entered.wait, 30)
        stopped = await loop.stop(timeout_s=0.2)  # without the timeout: until the release
        engine.release.set()
        await asyncio.to_thread(loop._thread.join, 30)  # the step ends, then "stop" is taken
        return stopped, loop._thread.is_alive()

    with caplog.at_level(logging.ERROR, logger="jpaged.server"):
        stopped, alive = asyncio.run(scenario())
    assert stopped is False and not alive
    assert [r.getMessage() for r in caplog.records] == ["engine thread did not stop"]


def test_the_heap_is_trimmed_each_time_the_engine_goes_idle():
    """glibc's malloc_trim runs once per busy-to-idle change of the engine, never while it
    has requests, and not while it idles."""
    from server.engine_loop import heap_trimmer

    trim = heap_trimmer()
    assert trim is not None and trim() in (0, 1)  # this Linux's glibc has malloc_trim

    async def scenario():
        engine = RecordingEngine(step_delay_s=0.005)
        loop = EngineLoop(engine)
        trims = []
        loop._trim_heap = lambda: trims.append(engine.has_unfinished_requests())
        loop.start()
        counts = []
        for i, max_tokens in enumerate([1, 6]):  # finished in its first step, then in six
            h = loop.submit(
                f"r{i}", [1], SamplingParams(temperature=0, max_tokens=max_tokens), None
            )
            while not h.finished:
                await h.wait()
            await wait_engine_idle(engine)
            await asyncio.sleep(0.5)  # idle polls (0.2 s each) trim nothing more
            counts.append(len(trims))
        await loop.stop()
        return trims, counts

    trims, counts = asyncio.run(scenario())
    assert counts == [1, 2] and trims == [False, False]


def test_stop_flushes_the_kv_pages_to_the_disk_tier_on_the_step_thread(monkeypatch):
    from server import engine_loop

    flushed = []
    monkeypatch.setattr(
        engine_loop, "flush_to_disk", lambda e: flushed.append((e, threading.current_thread()))
    )

    async def scenario():
        engine = FakeEngine()
        loop = EngineLoop(engine)
        loop.start()
        h = loop.submit("a", [1, 2], SamplingParams(temperature=0, max_tokens=3), None)
        while not h.finished:
            await h.wait()
        assert not flushed  # only as the loop stops
        assert await loop.stop()
        return engine, loop

    engine, loop = asyncio.run(scenario())
    assert flushed == [(engine, loop._thread)]
