"""The server never hangs on a request: both protocols against a small pool (issue 36).

The real LLMEngine runs behind the server on the fake runner (tests/jpaged/core/
fake_runner.py: no model compiled), with a pool of exactly one max_model_len sequence (16
pages of 4 tokens, max_model_len 64). Steps are counted at the engine, never timed: where a
test must hold requests in flight, the runner's gate lets the engine run one step per permit.

- random request sizes, over gRPC and HTTP at once: every request ends, with the tokens the
  same request gets alone, and every page is free afterwards;
- a small request sent while a large one waits for pages is served within a bounded number
  of steps (its own tokens plus the step in flight), before the requests ahead of it end;
- a request that can never be served is refused (gRPC INVALID_ARGUMENT, HTTP 400 naming the
  limit) and the next one is served.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import sys
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
from serving_helpers import RunningServer, collect, request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "jpaged" / "core"))
from fake_runner import fake_engine

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams
from server.proto.jpaged.v1 import generation_pb2 as pb

MAX_MODEL_LEN = 64
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=17),  # one 64-token sequence
    scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                              max_num_batched_tokens=64),
)  # fmt: skip


class Recorded:
    """The engine's step (runner dispatches so far) at which each request was added and
    finished, by client request id, recorded on the engine thread."""

    def __init__(self, engine) -> None:
        self.runner = engine.runner
        self.added: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        add, step = engine.add_request, engine.step

        def add_request(request_id, *args, **kwargs):
            add(request_id, *args, **kwargs)
            self.added[request_id.split("#")[0]] = self.runner.num_steps

        def stepped():
            outs = step()
            for out in outs:
                if out.finished:
                    self.finished[out.request_id.split("#")[0]] = self.runner.num_steps
            return outs

        engine.add_request, engine.step = add_request, stepped


@pytest.fixture
def served():
    engine = fake_engine(CONFIG)
    recorded = Recorded(engine)
    s = RunningServer(engine)
    yield s, engine, recorded
    gate, engine.runner.gate = engine.runner.gate, None
    if gate is not None:  # a failed test left the engine waiting for a permit
        gate.release(1000)
    s.close()


def http_completion(s: RunningServer, request_id: str, prompt: list[int], max_tokens: int):
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(s.http_url + "/v1/completions", json=body,
                      headers={"x-request-id": request_id}, timeout=60)  # fmt: skip


def grpc_tokens(s: RunningServer, request_id: str, prompt: list[int], max_tokens: int):
    got = collect(s.stub, request(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                  request_id=request_id), timeout=60)  # fmt: skip
    return got.token_ids[0], got.finish_reason[0]


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    engine = fake_engine(CONFIG)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    engine.add_request("alone", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].outputs[0].token_ids


def test_random_request_sizes_on_both_protocols_all_end(served):
    s, _, recorded = served
    rng = np.random.default_rng(36)
    jobs = []
    for i in range(24):
        length = int(rng.choice([rng.integers(1, 12), rng.integers(40, MAX_MODEL_LEN)]))
        prompt = rng.integers(2, 40, length).tolist()
        max_tokens = int(rng.integers(1, MAX_MODEL_LEN - length + 1))
        jobs.append(("grpc" if i % 2 else "http", f"r{i}", prompt, max_tokens))

    def send(job):
        protocol, rid, prompt, max_tokens = job
        if protocol == "grpc":
            tokens, reason = grpc_tokens(s, rid, prompt, max_tokens)
            return tokens, pb.FinishReason.Name(reason)
        r = http_completion(s, rid, prompt, max_tokens)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        return r.json()["usage"]["completion_tokens"], choice["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, jobs))
    for (protocol, rid, prompt, max_tokens), (tokens, reason) in zip(jobs, results, strict=True):
        assert rid in recorded.finished
        if protocol == "grpc":
            assert reason == "FINISH_REASON_LENGTH" and tokens == alone(prompt, max_tokens)
        else:
            assert reason == "length" and tokens == max_tokens
    st = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0)
    assert st.pages_used == 0 and st.num_preemptions > 0  # the pool was tight


def step_once(engine, timeout: float = 10.0) -> None:
    """Lets the engine run one step and waits for it."""
    before = engine.runner.num_steps
    engine.runner.gate.release()
    deadline = time.monotonic() + timeout
    while engine.runner.num_steps == before:
        assert time.monotonic() < deadline, "the engine did not step"
        time.sleep(0.001)


def wait_submitted(s: RunningServer, num_waiting: int, timeout: float = 10.0) -> None:
    """Waits (without stepping) until the server holds num_waiting requests not yet running:
    a request sent is queued for the engine thread, which takes it before its next step."""
    deadline = time.monotonic() + timeout
    while s.server.engine_loop.num_waiting() < num_waiting:
        assert time.monotonic() < deadline, "the request did not reach the server"
        time.sleep(0.001)


def step_until(engine, predicate, limit: int = 200) -> int:
    """Steps until predicate(); returns the steps it took."""
    steps = 0
    while not predicate():
        assert steps < limit
        step_once(engine)
        steps += 1
    return steps


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_small_request_is_served_while_a_large_one_waits(served, protocol):
    """ "a" (20 + 30 tokens) runs; "big" (50 tokens, 13 of the 16 pages) does not fit beside
    it and waits; "small" (4 + 3 tokens) arrives behind it and ends within its 3 tokens and
    the step in flight when it came, long before "a" ends and "big" can start."""
    s, engine, recorded = served
    engine.runner.gate = threading.Semaphore(0)
    send = grpc_tokens if protocol == "grpc" else http_completion
    results: dict[str, object] = {}

    def start(rid: str, prompt: list[int], max_tokens: int) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.__setitem__(rid, send(s, rid, prompt, max_tokens)),
            daemon=True,
        )
        thread.start()
        return thread

    threads = [start("a", [3] * 20, 30)]
    deadline = time.monotonic() + 10
    while "a" not in recorded.added:  # the engine thread took it and waits for a permit
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for _ in range(8):  # "a" holds 7 pages
        step_once(engine)
    threads.append(start("big", [4] * 50, 10))
    wait_submitted(s, 1)
    assert step_until(engine, lambda: "big" in recorded.added) <= 2
    step_once(engine)
    assert s.server.engine_loop.num_waiting() == 1  # "big" waits for pages
    threads.append(start("small", [6] * 4, 3))
    wait_submitted(s, 2)
    assert step_until(engine, lambda: "small" in recorded.added) <= 2
    step_until(engine, lambda: "small" in recorded.finished)
    assert recorded.finished["small"] - recorded.added["small"] <= 4
    assert "a" not in recorded.finished and "big" not in recorded.finished
    gate, engine.runner.gate = engine.runner.gate, None  # the rest at full speed
    gate.release()
    for thread in threads:
        thread.join(60)
    assert set(results) == {"a", "big", "small"}
    assert recorded.finished["a"] < recorded.finished["big"]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_that_can_never_be_served_is_refused_and_the_next_served(served, protocol):
    s, _, recorded = served
    too_long = [5] * MAX_MODEL_LEN
    if protocol == "grpc":
        with pytest.raises(grpc.RpcError) as err:
            collect(s.stub, request(too_long, max_tokens=2), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            "prompt has 64 tokens; it must be shorter than max_model_len (64) to leave room "
            "for one generated token"
        )
        with pytest.raises(grpc.RpcError) as err:  # a prompt that fits, its output cannot
            collect(s.stub, request([5] * 60, max_tokens=10), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            "max_model_len is 64 tokens, but the request asks for 70 (60 in the prompt, 10 in "
            "max_tokens); shorten the prompt or lower max_tokens"
        )
        tokens, reason = grpc_tokens(s, "next", [5] * 10, 4)
        assert reason == pb.FINISH_REASON_LENGTH and len(tokens) == 4
    else:
        r = http_completion(s, "too-long", too_long, 2)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and "64 tokens" in error["message"]
        r = http_completion(s, "too-many", [5] * 60, 10)
        assert r.status_code == 400 and "maximum context length is 64" in r.text
        r = http_completion(s, "next", [5] * 10, 4)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "next" in recorded.finished
    st = s.wait_until(lambda st: st.num_running == 0 and st.num_waiting == 0)
    assert st.pages_used == 0
