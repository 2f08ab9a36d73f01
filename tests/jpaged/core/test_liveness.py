"""Liveness: every accepted request ends, on random small configurations and workloads.

Each example builds an LLMEngine on the fake runner (fake_runner.py: a host "model" whose
tokens depend on every token read back through the page table, so a paging bug changes an
output) from a random configuration: page sizes, pools from exactly one max_model_len
sequence (or, with max_model_len not given, smaller: the engine fits max_model_len to it),
max_num_seqs, prefix caching on and off, chunked prefill on and off, recompute and swap
preemption (swap space smaller than the pool), paged and reserve allocation, async
scheduling, n-gram and draft-model speculation. It then runs a random workload: requests
arriving over the first steps, prompts up to max_model_len - 1 tokens, n > 1, greedy,
seeded and unseeded sampling, max_tokens past what max_model_len leaves, stop strings, EOS,
min_tokens, logprobs, prompt logprobs, aborts mid-flight; then, sometimes, a beam search.
Stop strings are drawn only without speculation (see check_liveness).

Checked:
- every request not aborted ends (finish_reason stop or length) within the stated bound:
  sum over requests of n * (max_model_len + 2) steps, plus the last arrival's step. Why it
  holds: the oldest running sequence is never preempted (a pool holds one max_model_len
  sequence, which the engine checks at start) and computes at least one token per step, so
  it ends within max_model_len + 1 steps; then the next oldest does, and with nothing
  running the waiting head is admitted in the same step. The runner stops at the bound
  (StepBoundExceeded), so a livelock fails the example instead of hanging;
- every page is back on the free list, every swap page on the swap free list, every
  page-table row free;
- greedy and seeded requests that finished equal their outputs when run alone (tokens,
  text, finish and stop reasons, log-probabilities, prompt log-probabilities); beam search
  results equal each prompt's alone.

The default profile runs 200 examples (about 15 s on one core; the tree before issue 36's fix
failed it in its first 60: a 39-token prompt on a pool of 6 one-token pages never ended, and a
beam search on such a pool raised "the page pool is too small for one beam");
test_liveness_long, marked slow, runs 2000 (`pytest -m slow tests/jpaged/core/test_liveness.py`).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from fake_runner import CHARS, VOCAB, StepBoundExceeded, fake_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.beam_search import beam_search
from jpaged.core.engine import EngineStepError
from jpaged.sample.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

MODEL_MAX_LEN = 40  # the fake model's context length: max_model_len when none is given
# Prompts are cut from these (shared prefixes for the prefix cache, repeats for n-gram).
BASES = [
    [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7],
    list(range(2, VOCAB)),
    [9, 9, 9, 9, 9, 9, 9, 9, 3, 3, 3, 3, 3, 3, 3, 3, 9, 9, 9, 9, 9, 9, 9, 9],
]


@st.composite
def engine_configs(draw) -> EngineConfig:
    ps = draw(st.sampled_from([1, 2, 4, 8]), label="page_size")
    given_len = draw(st.booleans(), label="max_model_len given")
    max_len = draw(st.integers(6, MODEL_MAX_LEN), label="max_model_len") if given_len else None
    per_seq = math.ceil((max_len or MODEL_MAX_LEN) / ps)
    # Given: from exactly one max_model_len sequence; not given: smaller ones too (fitted).
    least = per_seq + 1 if given_len else math.ceil(6 / ps) + 1
    num_pages = draw(st.integers(least, 3 * per_seq + 1), label="num_pages")
    max_num_seqs = draw(st.integers(1, 4), label="max_num_seqs")
    chunked = draw(st.booleans(), label="chunked prefill")
    length = max_len or MODEL_MAX_LEN
    lo = max_num_seqs if chunked else max(max_num_seqs, length)
    budget = draw(st.integers(lo, lo + 16), label="max_num_batched_tokens")
    swap = draw(st.booleans(), label="swap") and num_pages > 2
    spec = draw(st.sampled_from([None, "ngram", "draft_model"]), label="speculation")
    speculative = None
    if spec is not None:
        k = draw(st.integers(1, 3), label="num_speculative_tokens")
        speculative = {"method": spec, "num_speculative_tokens": k}
        if spec == "ngram":
            speculative |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
        else:
            speculative["model"] = "fake-draft"
        speculative["cost_aware"] = draw(st.booleans(), label="cost_aware")
    return EngineConfig(
        seed=draw(st.integers(0, 3), label="engine seed"),
        async_scheduling=draw(st.booleans(), label="async"),
        speculative_config=speculative,
        cache=CacheConfig(
            page_size=ps,
            num_pages=num_pages,
            enable_prefix_caching=draw(st.booleans(), label="prefix caching"),
            kv_allocation=draw(st.sampled_from(["paged", "paged", "reserve"]), label="alloc"),
            # Smaller than the pool: some preemptions fall back to recompute.
            num_swap_pages=draw(st.integers(1, num_pages - 2), label="swap pages")
            if swap
            else None,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            enable_chunked_prefill=chunked,
            preemption_mode="swap" if swap else "recompute",
        ),
    )


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int
    abort_at: int | None


@st.composite
def requests(draw, max_len: int, max_num_seqs: int, index: int, *, stops: bool) -> Request:
    base = draw(st.sampled_from(BASES))
    length = draw(st.one_of(st.integers(1, max_len - 1), st.just(max_len - 1)), label="prompt")
    start = draw(st.integers(0, len(base) - 1))
    prompt = [(base[(start + i) % len(base)] + i // len(base)) % (VOCAB - 2) + 2
              for i in range(length)]  # fmt: skip
    n = draw(st.sampled_from([1, 1, 1, 2, max_num_seqs]))
    n = min(n, max_num_seqs)
    sampled = n > 1 or draw(st.booleans(), label="sampled")
    max_tokens = draw(st.integers(1, max_len), label="max_tokens")
    params = SamplingParams(
        n=n,
        temperature=1.0 if sampled else 0.0,
        seed=draw(st.sampled_from([None, 3, 11])) if sampled else None,
        max_tokens=max_tokens,
        min_tokens=draw(st.sampled_from([0, 0, 0, 1, 3])) if max_tokens >= 3 else 0,
        ignore_eos=draw(st.booleans(), label="ignore_eos"),
        stop=draw(st.sampled_from([None, None, "a", "7 ", CHARS[5:7]]), label="stop")
        if stops
        else None,
        logprobs=draw(st.sampled_from([None, None, 0, 2]), label="logprobs"),
        prompt_logprobs=draw(st.sampled_from([None, None, None, 1]), label="prompt_logprobs"),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    arrival = draw(st.integers(0, 12), label="arrival")
    aborted = draw(st.integers(0, 9), label="abort") == 0
    abort_at = arrival + draw(st.integers(0, 10)) if aborted else None
    return Request(f"r{index}", prompt, params, arrival, abort_at)


def step_bound(engine, reqs: list[Request]) -> int:
    """The module docstring's bound on the steps a workload takes."""
    per_seq = engine.max_model_len + 2
    return sum(r.params.n * per_seq for r in reqs) + max((r.arrival for r in reqs), default=0) + 2


def run(engine, reqs: list[Request]) -> dict:
    """Runs the workload; returns request_id -> final RequestOutput (aborted ones absent)."""
    bound = step_bound(engine, reqs)
    engine.runner.max_steps = engine.runner.num_steps + bound
    done, step = {}, 0
    while step <= bound:
        for r in reqs:
            if r.arrival == step:
                engine.add_request(r.request_id, list(r.prompt), r.params)
            if r.abort_at == step and r.request_id not in done:
                engine.abort_request(r.request_id)
        if step > max(r.arrival for r in reqs) and not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except EngineStepError as e:
            if isinstance(e.__cause__, StepBoundExceeded):
                pytest.fail(f"requests did not end within {bound} steps (livelock)")
            raise
        for out in outputs:
            assert out.finished
            done[out.request_id] = out
        step += 1
    else:
        pytest.fail(f"requests did not end within {bound} steps (livelock)")
    return done


def check_all_free(engine) -> None:
    alloc, sched = engine.allocator, engine.scheduler
    assert not sched.has_unfinished() and not engine.has_unfinished_requests()
    assert alloc.num_used() == 0 and not alloc.ref_counts.any()
    assert sorted(alloc.free_pages()) == list(range(1, alloc.num_pages))
    swap = sched.swap_allocator
    swap = getattr(swap, "pages", swap)  # the host page store's own allocator (issue 54)
    if swap is not None:
        assert swap.num_used() == 0 and sorted(swap.free_pages()) == list(range(1, swap.num_pages))
    assert sorted(sched._free_rows) == list(range(sched.sched.max_num_seqs))
    assert not sched._reserved_rows


def comparable(out) -> tuple:
    return (
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
         for c in out.outputs],
        out.prompt_logprobs,
    )  # fmt: skip


def check_liveness(data) -> None:
    config = data.draw(engine_configs())
    engine = fake_engine(config, max_position_embeddings=MODEL_MAX_LEN)
    max_len = engine.max_model_len
    if config.scheduler.max_model_len is not None:
        assert max_len == config.scheduler.max_model_len
    usable = engine.num_pages - 1
    page_size = config.cache.page_size
    assert math.ceil(max_len / page_size) <= usable  # one max-length sequence fits
    max_num_seqs = config.scheduler.max_num_seqs
    count = data.draw(st.integers(1, 8), label="requests")
    # Not with speculation: a verifying step's tokens past a stop string stay in token_ids
    # (the stop string is found in the text after the whole step is appended), so a request
    # that stops on one keeps a token or two more when its last step verified proposals.
    stops = config.speculative is None
    reqs = [data.draw(requests(max_len, max_num_seqs, i, stops=stops)) for i in range(count)]
    done = run(engine, reqs)
    for r in reqs:
        if r.abort_at is None:
            out = done[r.request_id]
            assert len(out.outputs) == r.params.n
            assert all(c.finish_reason in ("stop", "length") for c in out.outputs), out
    check_all_free(engine)
    # Greedy and seeded requests that finished, each alone on a fresh engine of the config.
    alone = fake_engine(config, max_position_embeddings=MODEL_MAX_LEN)
    for r in reqs:
        if r.request_id in done and (r.params.greedy or r.params.seed is not None):
            solo = run(alone, [dataclasses.replace(r, arrival=0, abort_at=None)])
            assert comparable(solo[r.request_id]) == comparable(done[r.request_id]), r
    check_all_free(alone)
    if data.draw(st.integers(0, 4), label="beam search") == 0:
        check_beam_search(data, engine, alone, max_len, max_num_seqs)


def check_beam_search(data, engine, alone, max_len: int, max_num_seqs: int) -> None:
    width = data.draw(st.integers(1, min(max_num_seqs, 4)), label="beam_width")
    max_tokens = data.draw(st.integers(1, max(1, max_len // 3)), label="beam max_tokens")
    num = data.draw(st.integers(1, 2), label="beam prompts")
    prompts = [BASES[i % 3][: data.draw(st.integers(1, max_len - max_tokens))]
               for i in range(num)]  # fmt: skip
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, ignore_eos=data.draw(st.booleans())
    )
    # Each search step recomputes at most every beam once per preemption of it.
    bound = num * max_tokens * width * (max_len + 2) * 2 + 8
    results = []
    for eng, batch in ((engine, [prompts]), (alone, [[p] for p in prompts])):
        eng.runner.max_steps = eng.runner.num_steps + bound
        outs = []
        for group in batch:
            try:
                outs += beam_search(eng, group, params, [f"b{i}" for i in range(len(group))])
            except EngineStepError as e:
                if isinstance(e.__cause__, StepBoundExceeded):
                    pytest.fail(f"beam search did not end within {bound} steps (livelock)")
                raise
        results.append([[(s.token_ids, s.finish_reason) for s in o.sequences] for o in outs])
        check_all_free(eng)
    assert results[0] == results[1]


_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@_SETTINGS
@given(st.data())
def test_every_accepted_request_ends_and_frees_its_pages(data):
    check_liveness(data)


@pytest.mark.slow
@settings(_SETTINGS, max_examples=2000)
@given(st.data())
def test_liveness_long(data):
    check_liveness(data)
