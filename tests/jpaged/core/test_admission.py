"""Admission: what can never be served is refused at start or at once, and nothing waits
behind a request that does not fit (issue 36).

- start: a pool smaller than one max_model_len sequence is refused with both figures when
  max_model_len was given, and fitted (logged once) when it was not;
- add_request: a request no preemption could ever make room for is refused with a
  ValueError before anything of it is stored, and the engine serves the next one;
- the scheduler: a small request behind one that does not fit is admitted past it, and the
  one passed over runs once it has been passed MAX_PASSED_STEPS steps (no starvation).

Engines run on the fake runner (fake_runner.py) except the start checks on the demo model.
"""

from __future__ import annotations

import logging

import pytest
from fake_runner import fake_engine

from jpaged import LLM
from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import MAX_PASSED_STEPS, Scheduler
from jpaged.core.sequence import SeqStatus
from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams

FINAL = RequestOutputKind.FINAL_ONLY


def config(*, max_model_len=64, num_pages=17, page_size=4, max_num_seqs=4, **scheduler):
    """16 usable pages of 4 tokens: exactly one sequence of 64 tokens."""
    return EngineConfig(
        cache=CacheConfig(page_size=page_size, num_pages=num_pages),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=64,
            **scheduler,
        ),
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=FINAL)  # fmt: skip


# -- at start ---------------------------------------------------------------------------------
def test_a_pool_smaller_than_one_max_length_sequence_is_refused_at_start(demo_model_dir):
    with pytest.raises(ValueError) as err:
        LLM(str(demo_model_dir), max_model_len=512, num_pages=20, page_size=16)
    message = str(err.value)
    assert message == (
        "max_model_len 512 needs 32 KV pages of 16 tokens for one sequence, but the pool has "
        "19 usable pages (304 tokens); lower --max-model-len to 304 or less, or raise "
        "--kv-cache-memory-bytes or --num-pages"
    )
    assert "\n" not in message


def test_a_pool_of_exactly_one_max_length_sequence_is_accepted():
    engine = fake_engine(config(max_model_len=64, num_pages=17))
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match=r"needs 17 KV pages of 4 tokens .* 16 usable pages"):
        fake_engine(config(max_model_len=65, num_pages=17))


def test_max_model_len_not_given_is_fitted_to_the_pool_and_logged_once(demo_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="jpaged.core.memory_plan"):
        llm = LLM(str(demo_model_dir), num_pages=20, page_size=16, max_num_seqs=2)
    engine = llm.llm_engine
    assert engine.max_model_len == 304 == engine.config.scheduler.max_model_len
    assert engine.config.max_pages_per_seq == 19
    lowered = [r.getMessage() for r in caplog.records if "max_model_len lowered" in r.message]
    assert lowered == [
        (
            "max_model_len lowered from 2048 to 304 tokens: the KV pool has 19 usable pages "
            "of 16 tokens and one sequence must fit; raise --kv-cache-memory-bytes or "
            "--num-pages for longer sequences"
        )
    ]
    # The issue's 400-token prompt: refused at once instead of never ending.
    with pytest.raises(ValueError, match=r"prompt has 400 tokens; .* max_model_len \(304\)"):
        llm.generate([[5] * 400], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()


def test_the_issues_requests_end_on_a_fitted_pool():
    """--num-pages 20 without --max-model-len, on a model of 512 positions: a 200-token
    prompt with max_tokens 200 stops at the fitted max_model_len (304) with "length"."""
    cfg = EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=20),
        scheduler=SchedulerConfig(max_num_seqs=4),
    )
    engine = fake_engine(cfg, max_position_embeddings=512)
    assert engine.max_model_len == 304
    engine.runner.max_steps = 400
    llm = LLM.__new__(LLM)
    llm.llm_engine, llm._ids = engine, iter(range(10**6))
    prompts = [[7] * 200, [8] * 20, [9] * 290]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=200,
                                                ignore_eos=True))  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in outs] == [104, 200, 14]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    assert engine.allocator.num_used() == 0


# -- at admission -----------------------------------------------------------------------------
def test_a_refused_request_touches_nothing_and_the_engine_serves_the_next_one():
    engine = fake_engine(config())
    before = (engine.scheduler._next_seq_id, engine._arrivals)
    with pytest.raises(ValueError, match=r"prompt has 64 tokens; .* max_model_len \(64\)"):
        engine.add_request("big", [5] * 64, greedy(1))
    with pytest.raises(ValueError, match=r"n must be <= max_num_seqs \(4\), got 5"):
        engine.add_request("wide", [5] * 4, SamplingParams(n=5, max_tokens=2))
    assert (engine.scheduler._next_seq_id, engine._arrivals) == before
    assert not engine.has_unfinished_requests() and not engine.scheduler.waiting
    engine.add_request("big", [5] * 63, greedy(8))  # the same id is free again
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    assert out.request_id == "big" and len(out.outputs[0].token_ids) == 1  # 63 + 1 = 64
    assert out.outputs[0].finish_reason == "length"
    assert engine.allocator.num_used() == 0


def scheduler(num_pages: int, *, chunked: bool = True, budget: int = 64) -> Scheduler:
    cfg = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=num_pages),
        scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=budget,
                                  enable_chunked_prefill=chunked),
    )  # fmt: skip
    return Scheduler(cfg, PageAllocator(num_pages), eos_token_ids=(1,))


def test_the_scheduler_names_what_it_could_never_admit():
    """The engine's start check keeps the pool at one max_model_len sequence or more; the
    scheduler still refuses, on its own, what could never fit a smaller one."""
    small = scheduler(num_pages=5)  # 4 pages of 4 tokens for sequences of up to 64
    assert small.unservable(15, 1) is None  # 15 + 1 tokens: 4 pages
    assert small.unservable(16, 1) == (
        "prompt of 16 tokens needs 5 KV pages of 4 tokens with its first generated token; "
        "the pool has 4"
    )
    assert small.unservable(64, 1).startswith("prompt has 64 tokens; it must be shorter")
    assert small.unservable(3, 3) == "n must be <= max_num_seqs (2), got 3"
    unchunked = scheduler(num_pages=17, chunked=False, budget=64)
    assert unchunked.unservable(63, 1) is None


# -- no head-of-line blocking, no starvation -----------------------------------------------
def run_until(engine, done: dict, step: int, predicate, limit: int = 200) -> int:
    while not predicate():
        assert step < limit, "did not happen within the step limit"
        for out in engine.step():
            done[out.request_id] = step
        step += 1
    return step


def test_a_small_request_behind_one_that_does_not_fit_is_served_at_once():
    """ "a" holds pages; "big" (50 tokens, 13 pages) does not fit beside it and waits; "small"
    (4 tokens, 2 pages) arrives behind it and is served in its own few steps, not after "a"
    ends. Then "big" runs."""
    engine = fake_engine(config())
    sched = engine.scheduler
    done: dict[str, int] = {}
    engine.add_request("a", [3] * 20, greedy(30))
    step = run_until(engine, done, 0, lambda: sched.sequence(0).num_tokens >= 28)
    engine.add_request("big", [4] * 50, greedy(10))
    engine.add_request("small", [6] * 4, greedy(3))
    arrival = step
    step = run_until(engine, done, step, lambda: "small" in done)
    # Admitted at its arrival: 3 tokens, one step each, and the step in flight when it came.
    assert step - arrival <= 4
    big = engine._groups["big"].seqs[0]
    assert big.status is SeqStatus.WAITING and "a" not in done
    run_until(engine, done, step, lambda: not engine.has_unfinished_requests())
    assert done["a"] < done["big"]
    assert engine.allocator.num_used() == 0


def test_llm_generate_serves_short_prompts_beside_a_long_one():
    """The offline API: the short prompts behind the long one that does not fit end in their
    own few steps (one step in flight before their outputs come back: async scheduling);
    the long one runs once the first ends."""
    engine = fake_engine(config())
    finished_at: dict[str, int] = {}
    step = engine.step

    def counting():
        outs = step()
        for out in outs:
            finished_at[out.request_id] = engine.runner.num_steps
        return outs

    engine.step = counting
    llm = LLM.__new__(LLM)
    llm.llm_engine, llm._ids = engine, iter(range(10**6))
    # 13 pages for the first; the long one's first chunk (14 tokens, 4 pages) does not fit
    # beside it, the short ones (a page each) do.
    prompts = [[3] * 50, [4] * 50, [5] * 4, [6] * 3]
    params = [greedy(10), greedy(10), greedy(3), greedy(2)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10, 3, 2]
    first, long, short, shorter = (finished_at[o.request_id] for o in outs)
    assert short <= 4 and shorter <= 3  # prefill with the first, then one token a step
    assert first < long


def test_a_request_passed_over_runs_after_max_passed_steps():
    """Short requests arrive, one a step, beside "a": each fits, "big" (13 of the 16 pages)
    never does beside two of them, so without a limit it would wait for ever. It is passed
    over (a request behind it admitted) in MAX_PASSED_STEPS steps; from then on nothing
    behind it is admitted, and it runs once the running ones drain: a short one ends within
    its 8 tokens."""
    engine = fake_engine(config())
    sched = engine.scheduler
    done: dict[str, int] = {}
    engine.add_request("a", [3] * 20, greedy(20))
    engine.add_request("big", [4] * 50, greedy(10))
    big = engine._groups["big"].seqs[0]
    aged_at = admitted_at = None
    step = 0
    while "big" not in done:
        assert step < 200, "big starved"
        engine.add_request(f"s{step}", [6 + step % 5] * 4, greedy(8))
        for out in engine.step():
            done[out.request_id] = step
        passed = sched._passed.get(big.seq_id, 0)
        assert passed <= MAX_PASSED_STEPS
        if aged_at is None and passed == MAX_PASSED_STEPS:
            aged_at = step
        if admitted_at is None and big.status is SeqStatus.RUNNING:
            admitted_at = step
        step += 1
    went_past = [r for r, s in done.items() if r.startswith("s") and s < admitted_at]
    assert len(went_past) >= MAX_PASSED_STEPS  # short ones went past it meanwhile
    assert done["a"] < admitted_at
    # Aged: the short ones running then drain (8 tokens each, one step in flight).
    assert aged_at is not None and admitted_at - aged_at <= 8 + 1, (aged_at, admitted_at)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.allocator.num_used() == 0 and sched._passed == {}
