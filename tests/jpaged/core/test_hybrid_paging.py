"""Sliding-window paging (docs/memory.md, "Hybrid paging"): a model whose every layer sees
only the last W keys frees the pages wholly before the window as a sequence moves on.

Host-only plans first (Scheduler + PageAllocator, exact page ids, window 6, pages of 4):
a decode 10x past the window, freed pages reused, forks, swap and prefix caching. Then
engines on a tiny random Mistral with window 8 (transformers' MistralConfig): tokens equal
an engine that keeps every page and transformers', with exact page counts at every step, n = 2
sampling, beam search and forced preemptions (recompute and swap).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import window_plans
from window_plans import PS, W, add, dead, feed

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.page_allocator import NULL_PAGE, PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import SeqStatus

MAX_WINDOW_PAGES = math.ceil(W / PS) + 1  # 3


def make_scheduler(num_pages=16, **kw):
    return window_plans.make_scheduler(num_pages, sliding_window=W, **kw)


def test_a_bad_window_is_one_clear_error():
    config = EngineConfig(cache=CacheConfig(page_size=PS, num_pages=4))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
            Scheduler(config, PageAllocator(4), sliding_window=bad)


def test_a_sequence_decoding_10x_past_the_window_holds_its_window_pages_at_every_step():
    """Prompt of 5, 60 tokens generated: after each schedule the leading pages before the
    window are NULL_PAGE (also in the device table's edits), the rest are held, at most
    ceil(6 / 4) + 1 = 3; freed pages go to the front of the free list, so the sequence
    cycles through pages 1, 2, 3 only."""
    sched, alloc, _ = make_scheduler()
    group = add(sched, "a", range(1, 6), max_tokens=60)
    seq = group.seqs[0]
    table = {}  # (row, column) -> page, the device table's entries as the plans edit them
    seen = set()
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        start, end = int(plan.starts[0]), int(plan.context_lens[0])
        for r, c, p in plan.page_updates.tolist():
            table[r, c] = p
        k = dead(start)
        held = -(-end // PS) - k
        assert seq.pages == [NULL_PAGE] * k + seq.pages[k:], steps
        assert NULL_PAGE not in seq.pages[k:] and len(seq.pages) == -(-end // PS)
        assert alloc.num_used() == held <= MAX_WINDOW_PAGES
        row = [table[seq.table_row, c] for c in range(len(seq.pages))]
        assert row == seq.pages
        seen.update(seq.pages[k:])
        feed(sched, plan)
        steps += 1
    assert steps == 60 and seq.num_tokens == 65
    assert seen == {1, 2, 3}
    assert alloc.num_used() == 0 and sorted(alloc.free_pages()) == list(range(1, 16))


def test_the_first_freed_page_and_the_exact_page_table_edits():
    """Pages of 4, window 6: the query at 9 reads keys 4.., so page 1 (positions 0-3) is
    freed in the plan of the step at 9 and its entry set to the null page; the page of
    positions 12-15 is then page 1 again (freed pages are reused first)."""
    sched, alloc, _ = make_scheduler()
    seq = add(sched, "a", range(1, 6), max_tokens=20).seqs[0]
    for _ in range(4):  # positions 0-4 (prefill), then 5, 6, 7
        feed(sched, sched.schedule())
    plan = sched.schedule()  # position 8: a third page
    assert (plan.page_updates.tolist(), seq.pages) == ([[0, 2, 3]], [1, 2, 3])
    assert alloc.cached_entry(1) is not None  # the prompt's full page, cached at commit
    feed(sched, plan)
    plan = sched.schedule()  # position 9
    assert (plan.page_updates.tolist(), seq.pages) == ([[0, 0, NULL_PAGE]], [0, 2, 3])
    assert alloc.free_pages()[0] == 1 and alloc.cached_entry(1) is None  # forgotten
    assert alloc.ref_counts[1:4].tolist() == [0, 1, 1]
    for _ in range(3):  # positions 9, 10, 11
        feed(sched, plan)
        plan = sched.schedule()
    assert (plan.page_updates.tolist(), seq.pages) == ([[0, 3, 1]], [0, 2, 3, 1])
    feed(sched, plan)
    plan = sched.schedule()  # position 13: keys 8.. -> page 2 (positions 4-7) freed
    assert (plan.page_updates.tolist(), seq.pages) == ([[0, 1, NULL_PAGE]], [0, 0, 3, 1])


def test_freed_window_pages_are_reused_by_another_sequence():
    """A pool of 6 usable pages: a (prompt 5) holds 1, 2, 3 by position 8 and frees 1 at
    position 9; b arrives then and gets page 1 (not 4) for its 3-token prompt. Each holds
    at most 3 pages to the end: no preemption."""
    sched, alloc, _ = make_scheduler(num_pages=7)
    a = add(sched, "a", range(1, 6), max_tokens=40).seqs[0]
    for _ in range(5):  # positions 0-4, 5, 6, 7, 8
        feed(sched, sched.schedule())
    assert (a.pages, alloc.free_pages()) == ([1, 2, 3], [4, 5, 6])
    b = add(sched, "b", [7, 8, 9], max_tokens=30).seqs[0]
    plan = sched.schedule()  # a at 9 frees page 1 first; b's prompt takes it
    assert plan.seq_ids.tolist() == [a.seq_id, b.seq_id]
    assert (a.pages, b.pages, alloc.free_pages()) == ([0, 2, 3], [1], [4, 5, 6])
    while sched.has_unfinished():
        feed(sched, plan)
        for s in (a, b):
            if s.status is SeqStatus.RUNNING:
                assert sum(p != NULL_PAGE for p in s.pages) <= MAX_WINDOW_PAGES
        plan = sched.schedule()
    assert sched.num_preemptions == 0 and a.num_output_tokens == 40
    assert b.num_output_tokens == 30 and alloc.num_used() == 0


def test_without_the_window_the_same_pool_preempts():
    """The same two requests on the same pool keeping every page: each grows to
    max_model_len (24 tokens, 6 pages), the whole pool."""
    config = EngineConfig(
        cache=CacheConfig(page_size=PS, num_pages=7),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=24),
    )
    sched = Scheduler(config, PageAllocator(7), eos_token_ids=(0,))
    add(sched, "a", range(1, 6), max_tokens=40)
    add(sched, "b", [7, 8, 9], max_tokens=30)
    while sched.has_unfinished():
        feed(sched, sched.schedule())
    assert sched.num_preemptions > 0


def test_a_fork_shares_the_window_and_each_child_frees_its_own_reference():
    """n = 2: the child shares the parent's pages 1, 2 after the prefill (reference 2); the
    first write into shared page 2 copies it for each (parent first: 2 -> 3, then the child
    owns 2 alone); at position 9 each drops its reference to page 1, which is free only
    after both."""
    sched, alloc, _ = make_scheduler()
    group = add(sched, "a", range(1, 6), max_tokens=12, n=2)
    feed(sched, sched.schedule())  # prefill + fork
    parent, child = group.seqs
    assert (parent.pages, child.pages) == ([1, 2], [1, 2])
    assert alloc.ref_counts[1:3].tolist() == [2, 2]
    plan = sched.schedule()  # position 5 in both: copy-on-write of page 2
    assert plan.page_copies.tolist() == [[2, 3]]
    assert (parent.pages, child.pages) == ([1, 3], [1, 2])
    assert alloc.ref_counts[1:4].tolist() == [2, 1, 1]
    for _ in range(3):  # positions 6, 7, 8
        feed(sched, plan)
        plan = sched.schedule()
    assert (parent.pages, child.pages) == ([1, 3, 4], [1, 2, 5])
    feed(sched, plan)
    plan = sched.schedule()  # position 9: both leave page 1
    assert (parent.pages, child.pages) == ([0, 3, 4], [0, 2, 5])
    assert alloc.ref_counts[1] == 0 and alloc.free_pages()[0] == 1
    while sched.has_unfinished():
        feed(sched, plan)
        plan = sched.schedule()
    assert alloc.num_used() == 0


def test_swap_preemption_copies_only_the_window_and_restores_it_into_fresh_pages():
    """a and b decode in a pool of 5 usable pages; b, the newest, is preempted when a needs
    a page: only b's held pages are swapped out, and it comes back into fresh pages for its
    window with NULL_PAGE before it, num_computed_tokens kept."""
    sched, _, swap = make_scheduler(num_pages=6, swap_pages=8)
    add(sched, "a", range(1, 9), max_tokens=30)
    b = add(sched, "b", range(11, 19), max_tokens=30).seqs[0]
    swapped = None
    for _ in range(60):
        plan = sched.schedule()
        if len(plan.swap_out) and swapped is None:
            swapped = (b.num_computed_tokens, plan.swap_out.tolist(), list(b.swap_pages))
        if len(plan.swap_in):
            computed, out, host = swapped
            k = dead(computed)
            assert b.pages[:k] == [NULL_PAGE] * k and NULL_PAGE not in b.pages[k:]
            assert len(host) == -(-computed // PS) - k  # the held pages only
            assert [h for _, h in out] == host
            assert plan.swap_in.tolist() == [[h, p] for h, p in zip(host, b.pages[k:])]
            assert b.num_computed_tokens == computed and int(plan.starts[-1]) == computed
            break
        feed(sched, plan)
    else:
        raise AssertionError("b was never swapped out and back in")
    assert sched.num_swaps_out >= 1 and sched.num_swaps_in == 1
    assert swap.num_used() == 0


def test_prefix_hits_take_only_the_pages_of_the_window():
    """b's 13-token prompt shares a's first 12 tokens (3 full pages, cached while a runs its
    prefill) and computes from 12: the window of 12 starts at key 7, so of the hits only
    pages 2 and 3 are taken; page 1 stays free (and cached) and b's row holds NULL_PAGE."""
    sched, alloc, _ = make_scheduler()
    prompt = list(range(1, 13))
    a = add(sched, "a", prompt + [20], max_tokens=1).seqs[0]
    feed(sched, sched.schedule())  # a's prefill; a finishes (max_tokens=1), pages freed
    assert a.is_finished and alloc.num_cached() == 3
    b = add(sched, "b", prompt + [30], max_tokens=2).seqs[0]
    plan = sched.schedule()
    assert (int(plan.starts[0]), int(plan.num_new_tokens[0])) == (12, 1)
    assert b.pages[0] == NULL_PAGE and alloc.ref_counts[b.pages[1]] == 1
    assert alloc.ref_counts[1:].tolist().count(1) == 3  # 2 hits + 1 new page
    assert sched.prefix_cache_hit_tokens == 12


# -- engines on a tiny windowed Mistral ----------------------------------------------------------
VOCAB = 320
WINDOW = 8  # pages of 4: a decoding sequence holds at most ceil(8 / 4) + 1 = 3 pages
ENGINE = {"page_size": 4, "max_num_seqs": 2, "max_model_len": 128, "num_pages": 72}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    import transformers
    from dense_families import save_tiny

    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        sliding_window=WINDOW,
    )
    return save_tiny(tmp_path_factory.mktemp("mistral_window") / "m", config)


def prompts(lengths, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def test_an_engine_decoding_10x_past_the_window_holds_3_pages_at_every_step(mistral):
    """80 tokens after a 12-token prompt, stepped synchronously: after each step the sequence
    of L computed tokens holds exactly ceil(L / 4) - k pages, k = max(L - 8, 0) // 4 freed
    after a decode (its query at L - 1 reads keys L - 8..) and none after the prefill, never
    more than 3, the pool exactly those; the tokens equal the engine that keeps every page
    and transformers'."""
    from dense_families import hf_greedy

    from jpaged import SamplingParams
    from jpaged.core.engine import LLMEngine
    from jpaged.entrypoints.engine_args import engine_config_from_args

    prompt = prompts([12])[0]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    outs = {}
    for free in (True, False):
        engine = LLMEngine(
            engine_config_from_args(
                str(mistral), async_scheduling=False, free_window_pages=free, **ENGINE
            )
        )
        assert engine.scheduler.sliding_window == (WINDOW if free else None)
        engine.add_request("a", prompt, params)
        counts = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[free] = out.outputs[0].token_ids
            for seq in engine.scheduler.running:
                n = seq.num_computed_tokens
                start = n - 1 if n > len(prompt) else 0  # the step's first query: prefill at 0
                k = max(start - WINDOW + 1, 0) // 4 if free else 0
                assert seq.pages[:k] == [NULL_PAGE] * k and NULL_PAGE not in seq.pages[k:]
                assert engine.allocator.num_used() == -(-n // 4) - k
                counts.append(-(-n // 4) - k)
        assert engine.stats()["pages_used"] == 0
        if free:
            assert len(counts) == 79 and max(counts) == 3 and min(counts[8:]) == 2  # last: done
        else:
            assert counts[-1] == -(-(12 + 79) // 4)  # every page: 23
    assert len(outs[True]) == 80
    assert outs[True] == outs[False] == hf_greedy(mistral, [prompt], 80)[0]


def test_batched_greedy_with_prefix_caching_equals_keeping_every_page(mistral):
    """Prompts longer than the window, sharing 8 tokens, submitted together with
    max_num_seqs 2 (async scheduling): the same tokens as keeping every page, and
    transformers'."""
    from dense_families import engine_greedy, hf_greedy, prompts_with_shared_prefix

    ps = prompts_with_shared_prefix(VOCAB, [9, 14, 21, 30], prefix=8, seed=2)
    ours = engine_greedy(mistral, ps, 24, enable_prefix_caching=True, **ENGINE)
    kept = engine_greedy(
        mistral, ps, 24, enable_prefix_caching=True, free_window_pages=False, **ENGINE
    )
    assert ours == kept == hf_greedy(mistral, ps, 24)


def test_n_2_sampling_forks_and_frees_as_keeping_every_page(mistral):
    """n = 2, seeded: both completions equal the engine that keeps every page, and the
    windowed engine's peak is two windows (2 x 3 pages) plus the prompt's pages."""
    from jpaged import LLM, SamplingParams

    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    results, peaks = {}, {}
    for free in (True, False):
        llm = LLM(str(mistral), free_window_pages=free, **ENGINE)
        out = llm.generate(prompts([10]), params)[0]
        results[free] = [c.token_ids for c in out.outputs]
        peaks[free] = llm.llm_engine.peak_pages_used
        assert llm.stats()["pages_used"] == 0
    assert results[True] == results[False] and results[True][0] != results[True][1]
    assert peaks[False] == 2 * -(-(10 + 39) // 4) - 2  # 13 each, the 2 prompt pages shared
    assert peaks[True] <= 2 * 3 + 1


def test_beam_search_on_a_windowed_model_equals_keeping_every_page(mistral):
    from jpaged import LLM, BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=32)
    beams, peaks = {}, {}
    for free in (True, False):
        llm = LLM(str(mistral), free_window_pages=free, **{**ENGINE, "max_num_seqs": 4})
        (out,) = llm.beam_search(prompts([11], seed=4), params)
        beams[free] = [(s.token_ids, s.cum_logprob) for s in out.sequences]
        peaks[free] = llm.llm_engine.peak_pages_used
        assert llm.stats()["pages_used"] == 0
    assert [b[0] for b in beams[True]] == [b[0] for b in beams[False]]
    for (_, a), (_, b) in zip(beams[True], beams[False]):
        assert a == pytest.approx(b, abs=1e-5)
    assert peaks[True] < peaks[False]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_forced_preemption_changes_no_token(mistral, mode):
    """11 usable pages, a 32-token budget and prompts of 30, 33 and 26 tokens: a chunk of
    the second prompt takes the last free pages while the first needs one (module
    docstring of the scheduler), so it is preempted, recomputed or swapped; the tokens are
    still transformers'."""
    from dense_families import engine_greedy_and_stats, hf_greedy, prompts_with_shared_prefix

    ps = prompts_with_shared_prefix(VOCAB, [30, 33, 26], prefix=8, seed=3)
    ours, stats = engine_greedy_and_stats(
        mistral, ps, 8, preemption_mode=mode, enable_prefix_caching=True, page_size=4,
        num_pages=12, max_num_seqs=2, max_model_len=44, max_num_batched_tokens=32,
    )  # fmt: skip
    assert stats["num_preemptions"] >= 1
    assert ours == hf_greedy(mistral, ps, 8)
