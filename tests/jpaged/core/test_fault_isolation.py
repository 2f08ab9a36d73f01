"""Fault isolation: an exception while building, dispatching or committing a step fails that
step's requests alone, and the engine serves on.

A few hundred mixed requests (greedy, seeded and unseeded sampling, n > 1, logprobs, prompt
logprobs, prefix-sharing prompts) run on the fake runner (fake_runner.py) while a fault is
injected at random steps, at one of three points: building the step (the scheduler's plan),
dispatching it, and fetching its tokens (the donated pool is gone). Checked: every request
ends (an output with a finish reason, or named by the EngineStepError of the step that held
it), the failed ones are exactly the requests of the failing steps, greedy requests that
were not failed give the tokens they give alone, and at the end every page is free.
"""

from __future__ import annotations

import random

import pytest
from fake_runner import VOCAB, fake_engine
from test_liveness import check_all_free

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.engine import EngineStepError
from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams

NUM_REQUESTS = 300


def config(*, async_scheduling: bool) -> EngineConfig:
    return EngineConfig(
        seed=0,
        async_scheduling=async_scheduling,
        cache=CacheConfig(page_size=4, num_pages=48, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=40),
    )


def workload(rng: random.Random) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(request_id, prompt, params, arrival step), prompts sharing prefixes."""
    prefix = [rng.randrange(2, VOCAB) for _ in range(12)]
    out = []
    for i in range(NUM_REQUESTS):
        length = rng.randrange(1, 30)
        prompt = (prefix + [rng.randrange(2, VOCAB) for _ in range(30)])[:length]
        if rng.random() < 0.5:
            prompt = [rng.randrange(2, VOCAB) for _ in range(length)]
        sampled = rng.random() < 0.4
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2]) if sampled else 1,
            temperature=1.0 if sampled else 0.0,
            seed=rng.choice([None, 7]) if sampled else None,
            max_tokens=rng.randrange(1, 10),
            ignore_eos=rng.random() < 0.5,
            logprobs=rng.choice([None, None, 2]),
            prompt_logprobs=rng.choice([None, None, None, 1]),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        out.append((f"r{i}", prompt, params, i // 3))
    return out


class Faults:
    """Wraps a callable to raise at random calls (probability p), recording each fault."""

    def __init__(self, fn, rng: random.Random, p: float, log: list) -> None:
        self.fn, self.rng, self.p, self.log = fn, rng, p, log

    def __call__(self, *args, **kwargs):
        if self.rng.random() < self.p:
            self.log.append(self.fn)
            raise RuntimeError("injected fault")
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_faults_fail_their_steps_requests_alone_and_every_request_ends(
    async_scheduling, monkeypatch
):
    rng = random.Random(52 + async_scheduling)
    engine = fake_engine(config(async_scheduling=async_scheduling))
    reqs = workload(rng)
    alone = {}
    clean = fake_engine(config(async_scheduling=False))
    for rid, prompt, params, _ in reqs:
        if params.temperature == 0.0:
            clean.add_request(rid, prompt, params)
            while clean.has_unfinished_requests():
                for out in clean.step():
                    alone[out.request_id] = [c.token_ids for c in out.outputs]
    faults: list = []
    scheduler = engine.scheduler
    monkeypatch.setattr(scheduler, "schedule", Faults(scheduler.schedule, rng, 0.01, faults))
    monkeypatch.setattr(
        engine.runner, "dispatch", Faults(engine.runner.dispatch, rng, 0.01, faults)
    )
    monkeypatch.setattr(engine.runner, "fetch", Faults(engine.runner.fetch, rng, 0.01, faults))
    done, failed, step = {}, set(), 0
    pending = list(reqs)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        step += 1
        assert step < 20 * NUM_REQUESTS, "requests did not end"
        if not engine.has_unfinished_requests():
            continue
        unfinished = {rid for rid, *_ in reqs[: NUM_REQUESTS - len(pending)]} - set(done) - failed
        before = len(faults)
        try:
            outs = engine.step()
        except EngineStepError as e:
            assert len(faults) == before + 1 and "injected fault" in str(e)
            assert e.request_ids and not set(e.request_ids) & (failed | set(done))
            failed |= set(e.request_ids)
            # Only requests with a row in the step's plans (at most two plans: async
            # scheduling), and only unfinished ones, fail; the others are kept.
            assert set(e.request_ids) <= unfinished
            assert len(e.request_ids) <= 2 * engine.config.scheduler.max_num_seqs
            continue
        assert len(faults) == before
        for out in outs:
            assert out.finished and out.request_id not in set(done) | failed
            done[out.request_id] = [c.token_ids for c in out.outputs]
    assert faults, "no fault was injected"
    assert set(done) | failed == {r[0] for r in reqs} and not set(done) & failed
    assert len(failed) <= 2 * engine.config.scheduler.max_num_seqs * len(faults) < NUM_REQUESTS
    for rid, tokens in done.items():
        if rid in alone:
            assert tokens == alone[rid], rid
    check_all_free(engine)
