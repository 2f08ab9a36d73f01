"""Paging groups (docs/memory.md, "Hybrid paging"): a model mixing full and sliding-window
layers keeps one page table per group of layers; the full group keeps every page, a window
group frees the pages before its window, all from one free list.

The layout first (models/kv_groups.py), then host-only plans (Scheduler + PageAllocator,
a full group and a window-6 group, pages of 4, exact page ids), then engines on tiny random
Gemma 2 (window on alternate layers: 2 groups) and Gemma 3 (5 local : 1 global, 8 layers:
one full group and 7 window groups of one layer each): exact per-group page counts at every
step 10x past the window, tokens equal to the engine that keeps every page and to
transformers', freed pages reused, n = 2 forks, beam search, forced recompute and swap
preemption, prefix caching (a window group's pages anchored to the full group's: a hit
needs only the pages of its window, so a prompt that slid out of it is hit again).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import window_plans
from window_plans import PS, W, add, dead, feed

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.kv_cache_manager import sequence_pages
from jpaged.core.page_allocator import NULL_PAGE, PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import SeqStatus
from models.kv_groups import KVGroups, kv_groups

MAX_WINDOW_PAGES = math.ceil(W / PS) + 1  # 3
STRIDE = 3  # rows of one group's block of the device table: max_num_seqs 2 + the scratch row


# -- the layout ---------------------------------------------------------------------------------
def test_gemma2_layers_make_two_groups_of_equal_size():
    g = kv_groups((8, None, 8, None), free_window_pages=True)
    assert g == KVGroups(windows=(None, 8), layer_groups=(1, 0, 1, 0), layer_slots=(0, 0, 1, 1))
    assert (g.num_groups, g.slots_per_page, g.grouped) == (2, 2, True)


def test_gemma3_layers_pad_the_last_window_group():
    """26 layers, full every sixth (5, 11, 17, 23): groups of 4 layers, the 22 windowed ones
    in 6 groups, the last holding layers 24 and 25 (slots 2 and 3 unused)."""
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    g = kv_groups(windows, free_window_pages=True)
    assert g.windows == (None,) + (512,) * 6 and g.slots_per_page == 4
    assert [g.layer_groups[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [g.layer_slots[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert [g.layer_groups[i] for i in (0, 1, 2, 3, 4, 6, 7, 8)] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [(g.layer_groups[i], g.layer_slots[i]) for i in (24, 25)] == [(6, 0), (6, 1)]
    tiny = kv_groups((8,) * 5 + (None,) + (8,) * 2, free_window_pages=True)  # one layer each
    assert tiny.windows == (None,) + (8,) * 7 and tiny.slots_per_page == 1
    assert tiny.layer_groups == (1, 2, 3, 4, 5, 0, 6, 7)


def test_one_kind_or_windows_kept_is_one_group_of_every_layer():
    every = (0, 0, 0), (0, 1, 2)
    assert kv_groups((8, 8, 8), free_window_pages=True) == KVGroups((8,), *every)
    assert kv_groups((8, 8, 8), free_window_pages=False) == KVGroups((None,), *every)
    assert kv_groups((None,) * 3, free_window_pages=True) == KVGroups((None,), *every)
    assert kv_groups((8, None, 8), free_window_pages=False) == KVGroups((None,), *every)
    # A window as long as the longest sequence never frees a page: paged as full attention.
    assert kv_groups((8, None, 8), free_window_pages=True, max_model_len=8) == KVGroups(
        (None,), *every
    )
    assert kv_groups((8, None, 8), free_window_pages=True, max_model_len=9).windows == (None, 8, 8)


def test_bad_groups_are_one_clear_error():
    with pytest.raises(ValueError, match=r"layer_groups \(2\) and layer_slots \(1\)"):
        KVGroups((None,), (0, 0), (0,))
    config = EngineConfig(cache=CacheConfig(page_size=PS, num_pages=4))
    with pytest.raises(ValueError, match="group_windows must be a positive integer, got 0"):
        Scheduler(config, PageAllocator(4), group_windows=(None, 0))
    with pytest.raises(ValueError, match="group_windows must name at least one group"):
        Scheduler(config, PageAllocator(4), group_windows=())
    with pytest.raises(ValueError, match="not both"):
        Scheduler(config, PageAllocator(4), sliding_window=4, group_windows=(None, 4))


def test_a_sequence_counts_every_full_page_and_its_window_pages():
    """max_model_len 128 in pages of 4 with a 32-token budget: 32 in the full group, at most
    ceil((6 - 1 + 32) / 4) + 1 = 11 in the window group; every page with "reserve"."""
    config = EngineConfig(
        cache=CacheConfig(page_size=PS, num_pages=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=128),
    )
    assert sequence_pages(config, (None, W), 128) == 32 + 11
    assert sequence_pages(config, (None, W), 9) == 3 + 3
    reserve = EngineConfig(
        cache=CacheConfig(page_size=PS, num_pages=64, kv_allocation="reserve"),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=128),
    )
    assert sequence_pages(reserve, (None, W), 128) == 64


def test_the_pool_must_hold_one_sequence_counting_its_window_pages():
    """fit_max_model_len with groups: 128 tokens need 32 + 11 pages; a pool of 43 usable pages
    holds it, one of 42 holds 124 tokens (31 + 11): refused when max_model_len was given,
    lowered to 124 when not. Scheduler.unservable counts the same way."""
    from jpaged.core.memory_plan import fit_max_model_len

    config = EngineConfig(
        cache=CacheConfig(page_size=PS, num_pages=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=128),
    )
    assert fit_max_model_len(config, 44, given=True, group_windows=(None, W)) is config
    with pytest.raises(ValueError, match=r"needs 43 KV pages .* 42 usable pages \(124 tokens\)"):
        fit_max_model_len(config, 43, given=True, group_windows=(None, W))
    lowered = fit_max_model_len(config, 43, given=False, group_windows=(None, W))
    assert lowered.scheduler.max_model_len == 124
    sched = Scheduler(config, PageAllocator(43), group_windows=(None, W))
    assert sched.unservable(123, 1) is None  # 124 tokens with its first generated one
    assert sched.unservable(124, 1) == (
        "prompt of 124 tokens needs 43 KV pages of 4 tokens with its first generated token; "
        "the pool has 42"
    )


# -- host-only plans ----------------------------------------------------------------------------
def make_scheduler(num_pages=32, *, swap_pages=0, caching=True, windows=(None, W)):
    return window_plans.make_scheduler(num_pages, swap_pages=swap_pages, caching=caching,
                                       group_windows=windows)


def test_decoding_10x_past_the_window_keeps_every_full_page_and_3_window_pages():
    """Prompt of 5, 60 tokens generated: after each schedule the full group holds a page for
    every 4 positions, the window group NULL_PAGE before the window and at most 3 held pages;
    the pool holds exactly both; the device table's edits (group g's rows at g * 3 + row)
    replay to both tables; and the slots of each group point into its own pages."""
    sched, alloc, _ = make_scheduler()
    seq = add(sched, "a", range(1, 6), max_tokens=60).seqs[0]
    table = {}
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        start, end = int(plan.starts[0]), int(plan.context_lens[0])
        for r, c, p in plan.page_updates.tolist():
            table[r, c] = p
        full, window = seq.tables
        k = dead(start)
        assert full == [p for p in full if p != NULL_PAGE] and len(full) == -(-end // PS)
        assert window[:k] == [NULL_PAGE] * k and NULL_PAGE not in window[k:]
        assert len(window) == len(full) and len(window) - k <= MAX_WINDOW_PAGES
        assert alloc.num_used() == len(full) + len(window) - k
        for g in (0, 1):
            row = [table[g * STRIDE + seq.table_row, c] for c in range(len(full))]
            assert row == seq.tables[g]
            pos = np.arange(start, end)
            pages = np.asarray(seq.tables[g])[pos // PS]
            assert plan.slot_mapping[g].tolist() == (pages * PS + pos % PS).tolist()
        feed(sched, plan)
        steps += 1
    assert steps == 60 and seq.num_tokens == 65
    assert alloc.num_used() == 0 and sorted(alloc.free_pages()) == list(range(1, 32))


def test_the_first_pages_and_the_exact_page_table_edits():
    """The prefill takes pages 1, 2 (full) and 3, 4 (window); position 8 takes 5 (full) and 6
    (window); the step at 9 frees window page 3 (keys 4.. only) and nulls its entry in the
    window group's rows (3 + row), the full group keeps page 1. Page 3 (prompt positions
    0-3) stays cached at the back of the free list, anchored to full page 1."""
    sched, alloc, _ = make_scheduler()
    seq = add(sched, "a", range(1, 6), max_tokens=20).seqs[0]
    plan = sched.schedule()
    assert plan.page_updates.tolist() == [[0, 0, 1], [0, 1, 2], [3, 0, 3], [3, 1, 4]]
    feed(sched, plan)
    for _ in range(3):  # positions 5, 6, 7
        feed(sched, sched.schedule())
    plan = sched.schedule()  # position 8
    assert (plan.page_updates.tolist(), seq.tables) == ([[0, 2, 5], [3, 2, 6]], [[1, 2, 5], [3, 4, 6]])
    assert alloc.cached_entry(1) is not None and alloc.cached_entry(3) is not None
    feed(sched, plan)
    plan = sched.schedule()  # position 9
    assert (plan.page_updates.tolist(), seq.tables) == ([[3, 0, NULL_PAGE]], [[1, 2, 5], [0, 4, 6]])
    assert alloc.free_pages()[-1] == 3 and alloc.cached_entry(3).parent == (1, 1)
    assert alloc.ref_counts[1:7].tolist() == [1, 1, 0, 1, 1, 1]


def test_a_generated_window_page_stays_cached_until_the_next_slide():
    """a (1-token prompt) holds [1, 3, 5] and [2, 4, 6] at position 8; at 9 it frees window
    page 2 (positions 0-3, generated: a hit on a's whole sequence could need it), cached at
    the back of the free list; at 13 it frees page 4 the same way, and page 2 is forgotten
    and handed out first: b (3-token prompt), admitted in that plan, takes it for its full
    group's first page."""
    sched, alloc, _ = make_scheduler(num_pages=16)
    a = add(sched, "a", [1], max_tokens=16).seqs[0]
    for _ in range(9):  # positions 0, 1, .., 8
        feed(sched, sched.schedule())
    assert (a.tables, alloc.free_pages()) == ([[1, 3, 5], [2, 4, 6]], list(range(7, 16)))
    plan = sched.schedule()  # position 9
    assert a.tables == [[1, 3, 5], [0, 4, 6]] and alloc.free_pages()[-1] == 2
    assert alloc.cached_entry(2).parent == (1, 1)
    for _ in range(3):  # positions 9, 10, 11, then 12 (takes 7 and 8)
        feed(sched, plan)
        plan = sched.schedule()
    feed(sched, plan)
    b = add(sched, "b", [7, 8, 9], max_tokens=4).seqs[0]
    plan = sched.schedule()  # position 13 and b's prompt
    assert plan.seq_ids.tolist() == [a.seq_id, b.seq_id]
    assert a.tables == [[1, 3, 5, 7], [0, 0, 6, 8]] and b.tables == [[2], [9]]
    assert alloc.cached_entry(4).parent == (3, 1) and alloc.free_pages()[-1] == 4
    while sched.has_unfinished():
        feed(sched, plan)
        for s in (a, b):
            if s.status is SeqStatus.RUNNING:
                assert sum(p != NULL_PAGE for p in s.tables[1]) <= MAX_WINDOW_PAGES
        plan = sched.schedule()
    assert sched.num_preemptions == 0 and alloc.num_used() == 0


def test_a_fork_shares_both_tables_and_copies_on_write_in_each():
    """n = 2: the child shares [1, 2] and [3, 4]; the first write (position 5) copies the
    shared last page of each group for the parent (2 -> 5, 4 -> 6), after which the child
    owns 2 and 4 alone; at 9 both drop window page 3, free only then; full page 1 stays
    shared."""
    sched, alloc, _ = make_scheduler()
    group = add(sched, "a", range(1, 6), max_tokens=12, n=2)
    feed(sched, sched.schedule())  # prefill + fork
    parent, child = group.seqs
    assert parent.tables == child.tables == [[1, 2], [3, 4]]
    assert alloc.ref_counts[1:5].tolist() == [2, 2, 2, 2]
    plan = sched.schedule()
    assert plan.page_copies.tolist() == [[2, 5], [4, 6]]
    assert (parent.tables, child.tables) == ([[1, 5], [3, 6]], [[1, 2], [3, 4]])
    for _ in range(3):  # positions 6, 7, 8
        feed(sched, plan)
        plan = sched.schedule()
    assert (parent.tables, child.tables) == ([[1, 5, 7], [3, 6, 8]], [[1, 2, 9], [3, 4, 10]])
    feed(sched, plan)
    plan = sched.schedule()  # position 9
    assert (parent.tables, child.tables) == ([[1, 5, 7], [0, 6, 8]], [[1, 2, 9], [0, 4, 10]])
    assert alloc.ref_counts[1] == 2 and alloc.ref_counts[3] == 0
    assert alloc.free_pages()[-1] == 3  # a prompt page: cached
    while sched.has_unfinished():
        feed(sched, plan)
        plan = sched.schedule()
    assert alloc.num_used() == 0


def test_swap_copies_every_full_page_and_the_window_and_restores_them():
    """a and b decode in a pool of 13 usable pages; at position 12 (both hold 3 full and 2
    window pages after freeing one) a takes 2 more and b, needing 2 of the 1 left, is swapped
    out: its 3 full pages and 2 held window pages, in that order; once a is done it comes
    back into fresh pages at the same positions, NULL_PAGE before the window."""
    sched, _, swap = make_scheduler(num_pages=14, swap_pages=16)
    add(sched, "a", range(1, 9), max_tokens=30)
    b = add(sched, "b", range(11, 19), max_tokens=30).seqs[0]
    swapped = None
    for _ in range(80):
        plan = sched.schedule()
        if len(plan.swap_out) and swapped is None:
            swapped = (b.num_computed_tokens, plan.swap_out.tolist(), list(b.swap_pages))
        if len(plan.swap_in):
            computed, out, host = swapped
            assert computed == 12
            n, k = -(-computed // PS), dead(computed)
            assert len(host) == n + n - k and [h for _, h in out] == host
            full, window = b.tables
            assert NULL_PAGE not in full and window[:k] == [NULL_PAGE] * k
            assert NULL_PAGE not in window[k:]
            fresh = full[:n] + window[k:n]
            assert plan.swap_in.tolist() == [[h, p] for h, p in zip(host, fresh)]
            assert b.num_computed_tokens == computed and int(plan.starts[-1]) == computed
            break
        feed(sched, plan)
    else:
        raise AssertionError("b was never swapped out and back in")
    assert sched.num_swaps_out >= 1 and sched.num_swaps_in == 1 and swap.num_used() == 0


def test_prefix_hits_take_every_full_page_and_the_window_pages():
    """b shares a's first 12 tokens (3 full pages, cached in both groups while a ran its
    prefill) and computes from 12: the full group takes all 3 hits, the window group only
    the 2 inside the window of 12 (keys 7..)."""
    sched, alloc, _ = make_scheduler()
    prompt = list(range(1, 13))
    a = add(sched, "a", prompt + [20], max_tokens=1).seqs[0]
    feed(sched, sched.schedule())
    assert a.is_finished and alloc.num_cached() == 6
    full_hits = list(range(1, 4))  # a's full pages, freed and cached
    b = add(sched, "b", prompt + [30], max_tokens=2).seqs[0]
    plan = sched.schedule()
    assert (int(plan.starts[0]), int(plan.num_new_tokens[0])) == (12, 1)
    assert b.tables[0][:3] == full_hits and b.tables[1][0] == NULL_PAGE
    assert b.tables[1][1:3] == [6, 7]  # a's window pages of positions 4-11
    assert sched.prefix_cache_hit_tokens == 12


def run_to_end(sched, seq, pages=None):
    """Steps until seq finishes; pages: a dict (group, position) -> page to fill with every
    page seq held."""
    while not seq.is_finished:
        plan = sched.schedule()
        for g, table in enumerate(seq.tables):
            for i, p in enumerate(table):
                if pages is not None and p != NULL_PAGE:
                    pages[g, i] = p
        feed(sched, plan)


def test_a_prompt_that_slid_out_of_the_window_is_hit_again():
    """a decodes 14 tokens after a 13-token prompt (window pages of positions 0-19 freed by
    its last step: the prompt's 0-2 stay cached, generated 3 is forgotten when 4 slides, 4
    stays cached). Same prompt: a hit of 3 pages (12 tokens), a's full pages, and in the
    window group NULL_PAGE then a's pages of positions 1, 2 (from 12 the window reads keys
    7..). A prompt sharing 9 tokens: 2 pages (8 tokens), window pages 0, 1. a's whole
    sequence and one more token: 6 pages (24 tokens), needing window pages 4 (kept for
    this) and 5. a's first 21 tokens and others: the full group hits 5 pages, but the window
    of 20 needs page 3, forgotten, so the hit is 3 pages (12 tokens, window pages 1, 2)."""
    sched, alloc, _ = make_scheduler()
    prompt = list(range(1, 14))
    a = add(sched, "a", prompt, max_tokens=14).seqs[0]
    pages = {}
    run_to_end(sched, a, pages)
    assert a.num_tokens == 27 and alloc.num_used() == 0
    cases = [
        (prompt, 3, [1, 2]),
        (prompt[:9] + [90, 91, 92, 93], 2, [0, 1]),
        (a.token_ids + [99], 6, [4, 5]),
        (a.token_ids[:21] + [99] * 4, 3, [1, 2]),
    ]
    hit = 0
    for n, (tokens, num_hits, window) in enumerate(cases):
        b = add(sched, f"b{n}", tokens, max_tokens=1).seqs[0]
        plan = sched.schedule()
        held = [NULL_PAGE] * window[0] + [pages[1, i] for i in window]
        assert b.tables[0][:num_hits] == [pages[0, i] for i in range(num_hits)], n
        assert b.tables[1][:num_hits] == held, n
        assert NULL_PAGE not in b.tables[1][num_hits:] and len(b.tables[1]) == len(b.tables[0])
        assert b.group.num_cached_tokens == num_hits * PS, n
        hit += num_hits * PS
        assert sched.prefix_cache_hit_tokens == hit
        feed(sched, plan)
        assert b.is_finished
    assert alloc.num_used() == 0


def _exact_hash(parent, tokens, salt):
    return (parent, tokens, salt)  # equal only for equal prefixes and salts


def _window_tokens_key(h, salt, group):
    """Groups after the first keyed by their page tokens alone, blind to the prefix."""
    return (h, salt) if group == 0 else ((group, h[1]), (salt, group))


def test_a_window_page_cached_after_another_prefix_is_a_miss(monkeypatch):
    """Exact whatever the hash: with the window group's pages keyed by their tokens alone,
    a and c share pages 1 and 2 but not page 0, so c's window pages 1, 2 are not cached
    (a's hold their keys). b, c's prompt again, hits c's 3 full pages, but its window pages
    of positions 4-11 find a's, whose anchors (a's full pages) are not b's hits: misses,
    so the hit drops to 1 page (4 tokens: c's window page 0)."""
    from jpaged.core import kv_cache_manager as scheduler_module

    monkeypatch.setattr(scheduler_module, "page_hash", _exact_hash)
    monkeypatch.setattr(scheduler_module, "_group_key", _window_tokens_key)
    sched, _, _ = make_scheduler()
    rest = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    for first in (1, 2):  # a, then c
        run_to_end(sched, add(sched, str(first), [first] * 4 + rest, max_tokens=1).seqs[0])
    assert sched.prefix_cache_hit_tokens == 0
    b = add(sched, "b", [2] * 4 + rest, max_tokens=1).seqs[0]
    sched.schedule()
    assert b.group.num_cached_tokens == 4 and sched.prefix_cache_hit_tokens == 4


# -- engines on tiny Gemma 2 and Gemma 3 --------------------------------------------------------
VOCAB = 320
WINDOW = 8  # pages of 4: a decoding window group holds at most ceil(8 / 4) + 1 = 3 pages
ENGINE = {"page_size": 4, "max_num_seqs": 2, "max_model_len": 128, "num_pages": 72,
          "max_num_batched_tokens": 64, "min_token_bucket": 64}


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory):
    """tests/models/test_gemma.py's tiny models: Gemma 2 of 4 layers (soft caps), Gemma 3 of
    8 (one scanned pattern of 6 and two layers after it)."""
    import transformers
    from dense_families import save_tiny

    small = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": WINDOW, "max_position_embeddings": 256, "initializer_range": 0.1,
    }  # fmt: skip
    configs = {
        "gemma2": transformers.Gemma2Config(
            **small, num_hidden_layers=4, query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        ),
        "gemma3": transformers.Gemma3TextConfig(
            **small, num_hidden_layers=8, query_pre_attn_scalar=16,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    }  # fmt: skip
    root = tmp_path_factory.mktemp("gemma_groups")
    return {name: save_tiny(root / name, config) for name, config in configs.items()}


def grouped_paged_logits(loaded, chunks, token_ids, *, stacked, page=4):
    """One sequence through forward() in chunks with one shuffled page table per paging
    group (distinct pages) over a pool of slots_per_page layers whose unused pages hold NaN
    (the null page zeros, as padding writes leave it); before each chunk, every window
    group's entries of pages wholly before the chunk's first window are the null page. The
    logits of every position [len(token_ids), V]."""
    import jax
    import jax.numpy as jnp
    from dense_families import padded_chunk

    from models.llama import compute_logits, forward, stack_layers

    run = jax.jit(forward, static_argnums=(1,), static_argnames=("decode_only", "kv_groups"))

    cfg = loaded.config
    groups = kv_groups(cfg.windows, free_window_pages=True)
    params = stack_layers(loaded.params) if stacked else loaded.params
    n = -(-len(token_ids) // page)
    num_pages = groups.num_groups * n + 8
    shape = (cfg.num_kv_heads, groups.slots_per_page * num_pages, page, cfg.head_dim)
    pool = jnp.full(shape, jnp.nan).at[:, :: num_pages].set(0.0)  # each slot's null page
    caches = (pool, pool)
    pages = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    tables = pages[: groups.num_groups * n].reshape(groups.num_groups, 1, n).astype(np.int32)
    out, start = [], 0
    for size in chunks:
        pos = np.arange(start, start + size)
        live = tables.copy()
        for g, w in enumerate(groups.windows):
            if w is not None:
                live[g, 0, : max(start - w + 1, 0) // page] = NULL_PAGE
        # Prefill chunks padded to the longest (one program), as dense_families.paged_logits.
        tokens, positions, slots = padded_chunk(
            token_ids[start : start + size], pos, tables[:, 0, pos // page] * page + pos % page,
            1 if size == 1 else max(chunks),
        )
        hidden, caches = run(
            params, cfg, caches, tokens, positions, slots,
            jnp.asarray([start + size], jnp.int32), jnp.asarray(live),
            jnp.asarray([0, size], jnp.int32), kv_groups=groups, decode_only=size == 1,
        )  # fmt: skip
        out.append(np.asarray(compute_logits(params, cfg, hidden[:size])))
        start += size
    return np.concatenate(out)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_grouped_logits_equal_transformers(gemmas, name):
    """Each layer reads and writes only its group's pages at its slot (a wrong one would
    read NaN), freed window entries included: logits within 1e-4 of transformers' over 37
    tokens, scanned and unrolled, in one chunk and in chunks (13, two decode steps, 22:
    window page 0 is freed at 13 and 14, pages 0 and 1 at 15)."""
    from dense_families import hf_logits

    from models.loader import load_hf_model

    loaded = load_hf_model(gemmas[name])
    ids = np.random.default_rng(1).integers(0, VOCAB, 37).tolist()
    ref = hf_logits(gemmas[name], ids)
    for stacked in (False, True):
        for chunks in ([37], [13, 1, 1, 22]):
            got = grouped_paged_logits(loaded, chunks, ids, stacked=stacked)
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def prompts(lengths, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


NUM_WINDOW_GROUPS = {"gemma2": 1, "gemma3": 7}


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_an_engine_10x_past_the_window_holds_every_full_page_and_3_per_window_group(gemmas, name):
    """80 tokens after a 12-token prompt, stepped synchronously: after each step a sequence
    of L computed tokens holds ceil(L / 4) pages in the full group and ceil(L / 4) - k in
    each window group (k = max(L - 8, 0) // 4 after a decode, 0 after the prefill), never
    more than 3; the pool holds exactly those. With the same memory (--num-pages 72 of every
    layer) the hybrid pool has 71 x layers / slots + 1 page ids. Tokens equal the engine
    that keeps every page and transformers'."""
    from dense_families import hf_greedy

    from jpaged import SamplingParams
    from jpaged.core.engine import LLMEngine
    from jpaged.entrypoints.engine_args import engine_config_from_args

    prompt = prompts([12])[0]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    outs = {}
    for free in (True, False):
        num_window = NUM_WINDOW_GROUPS[name] if free else 0
        engine = LLMEngine(
            engine_config_from_args(
                str(gemmas[name]), async_scheduling=False, free_window_pages=free, **ENGINE
            )
        )
        assert engine.scheduler.windows == (None,) + (WINDOW,) * num_window
        num_pages = 71 * {"gemma2": 2, "gemma3": 8}[name] + 1 if free else 72
        assert engine.num_pages == engine.allocator.num_pages == num_pages
        engine.add_request("a", prompt, params)
        window_counts = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[free] = out.outputs[0].token_ids
            for seq in engine.scheduler.running:
                n = seq.num_computed_tokens
                start = n - 1 if n > len(prompt) else 0
                k = max(start - WINDOW + 1, 0) // 4
                full, *window = seq.tables
                assert full == [p for p in full if p != NULL_PAGE] and len(full) == -(-n // 4)
                for pages in window:
                    assert pages[:k] == [NULL_PAGE] * k and NULL_PAGE not in pages[k:]
                    assert len(pages) == len(full)
                assert engine.allocator.num_used() == len(full) + num_window * (len(full) - k)
                window_counts.append(len(full) - k)
        assert engine.stats()["pages_used"] == 0
        if free:
            assert len(window_counts) == 79 and max(window_counts) == 3
            assert min(window_counts[8:]) == 2
    assert len(outs[True]) == 80
    assert outs[True] == outs[False] == hf_greedy(gemmas[name], [prompt], 80)[0]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_batched_greedy_with_prefix_caching_equals_keeping_every_page(gemmas, name):
    """Prompts longer than the window sharing 8 tokens, submitted together with max_num_seqs
    2 (async scheduling) and prefix caching on: the same tokens as keeping every page, and
    transformers'."""
    from dense_families import engine_greedy, hf_greedy, prompts_with_shared_prefix

    ps = prompts_with_shared_prefix(VOCAB, [9, 14, 21, 30], prefix=8, seed=2)
    ours = engine_greedy(gemmas[name], ps, 24, enable_prefix_caching=True, **ENGINE)
    kept = engine_greedy(
        gemmas[name], ps, 24, enable_prefix_caching=True, free_window_pages=False, **ENGINE
    )
    assert ours == kept == hf_greedy(gemmas[name], ps, 24)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_prompt_decoded_past_its_window_is_hit_again_with_the_same_tokens(gemmas, name):
    """a: a 14-token prompt and 20 greedy tokens, stepped synchronously with prefix caching
    (its window groups free the prompt's pages as it decodes; they stay cached). b, the
    same prompt: a hit of 3 pages (12 tokens) with a's full pages, and in every window
    group NULL_PAGE for positions 0-3 (from 12 the window of 8 reads keys 5..) then a's
    pages of 4-11. c, sharing a's first 10 tokens: 2 pages (8 tokens), a's window pages of
    0-7. b's tokens are a's (a hit nothing), c's transformers'."""
    from dense_families import hf_greedy

    from jpaged import SamplingParams
    from jpaged.core.engine import LLMEngine
    from jpaged.entrypoints.engine_args import engine_config_from_args

    engine = LLMEngine(
        engine_config_from_args(
            str(gemmas[name]), async_scheduling=False, enable_prefix_caching=True, **ENGINE
        )
    )
    sched = engine.scheduler
    num_groups = 1 + NUM_WINDOW_GROUPS[name]
    assert sched.windows == (None,) + (WINDOW,) * NUM_WINDOW_GROUPS[name]
    prompt, other = prompts([14, 4], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cases = [("a", prompt, 0, 0), ("b", prompt, 3, 1), ("c", prompt[:10] + other, 2, 0)]
    pages, tokens, hit = {}, {}, 0  # pages: (group, position) -> a's page
    for request_id, ids, num_hits, num_dead in cases:
        engine.add_request(request_id, ids, params)
        first = True
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[request_id] = out.outputs[0].token_ids
                    assert out.num_cached_tokens == num_hits * 4
            (seq,) = engine.scheduler.running or (None,)
            if seq is None:
                continue
            if request_id == "a":
                pages.update(
                    ((g, i), p) for g, t in enumerate(seq.tables) for i, p in enumerate(t) if p
                )
            elif first:  # the hit, as admitted
                assert seq.tables[0][:num_hits] == [pages[0, i] for i in range(num_hits)]
                for g in range(1, num_groups):
                    held = [pages[g, i] for i in range(num_dead, num_hits)]
                    assert seq.tables[g][:num_hits] == [NULL_PAGE] * num_dead + held, g
            first = False
        hit += num_hits * 4
        assert sched.prefix_cache_hit_tokens == hit
    assert engine.stats()["pages_used"] == 0
    assert tokens["b"] == tokens["a"] == hf_greedy(gemmas[name], [prompt], 20)[0]
    assert tokens["c"] == hf_greedy(gemmas[name], [prompt[:10] + other], 20)[0]


def test_freed_window_pages_let_a_pool_that_keeping_every_page_preempts_run_both(gemmas):
    """Gemma 2 at equal memory (--num-pages 25 of every layer: 24 usable pages keeping every
    page, 48 hybrid): two 12-token prompts decoding 60 tokens each need 18 + 18 pages kept
    whole, so keeping every page preempts; hybrid, each needs 18 full + 3 window pages, and
    the window pages freed are reused, so nothing is preempted. The tokens are the same."""
    from dense_families import engine_greedy_and_stats

    engine = {**ENGINE, "num_pages": 25, "max_model_len": 80}
    ps = prompts([12, 12], seed=5)
    ours, stats = engine_greedy_and_stats(gemmas["gemma2"], ps, 60, **engine)
    kept, kept_stats = engine_greedy_and_stats(
        gemmas["gemma2"], ps, 60, free_window_pages=False, **engine
    )
    assert stats["num_preemptions"] == 0 and kept_stats["num_preemptions"] >= 1
    assert stats["pages_total"] == 48 and kept_stats["pages_total"] == 24
    assert ours == kept


def test_n_2_sampling_forks_as_keeping_every_page(gemmas):
    """n = 2, seeded, on Gemma 2: both completions equal the engine that keeps every page."""
    from jpaged import LLM, SamplingParams

    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    results = {}
    for free in (True, False):
        llm = LLM(str(gemmas["gemma2"]), free_window_pages=free, **ENGINE)
        out = llm.generate(prompts([10]), params)[0]
        results[free] = [c.token_ids for c in out.outputs]
        assert llm.stats()["pages_used"] == 0
    assert results[True] == results[False] and results[True][0] != results[True][1]


def test_beam_search_equals_keeping_every_page(gemmas):
    from jpaged import LLM, BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=32)
    beams = {}
    for free in (True, False):
        llm = LLM(str(gemmas["gemma2"]), free_window_pages=free, **{**ENGINE, "max_num_seqs": 4})
        (out,) = llm.beam_search(prompts([11], seed=4), params)
        beams[free] = [(s.token_ids, s.cum_logprob) for s in out.sequences]
        assert llm.stats()["pages_used"] == 0
    assert [b[0] for b in beams[True]] == [b[0] for b in beams[False]]
    for (_, a), (_, b) in zip(beams[True], beams[False]):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize(("name", "mode"), [("gemma2", "swap"), ("gemma3", "recompute")])
def test_a_forced_preemption_changes_no_token(gemmas, name, mode):
    """The other two of tests/models/test_gemma.py's preemptions (recompute on Gemma 2,
    swap on Gemma 3): prompts of 30, 33 and 26 tokens sharing 8, prefix caching on, on a
    pool that holds one 44-token sequence and not two of them running (Gemma 2: 14 pages of
    every layer, a 48-token budget; Gemma 3: 12 and 32): a sequence is preempted (swapped
    to host and back in every group, or recomputed) and the tokens are still transformers'."""
    from dense_families import preempted_greedy

    pool = {"gemma3": {"num_pages": 12, "max_num_batched_tokens": 32}}.get(name, {})
    ours, theirs = preempted_greedy(gemmas[name], VOCAB, mode, **pool)
    assert ours == theirs


def test_a_grouped_step_copies_no_page_pool(gemmas):
    """The step of a grouped model (Gemma 3: 8 groups, layers scanned by the pattern) still
    updates the pool in place: donated, aliased, never copied (tests/jpaged/worker/
    test_step_hlo.py for one group)."""
    import re

    from jpaged import LLM, SamplingParams

    llm = LLM(str(gemmas["gemma3"]), **{**ENGINE, "compilation_cache_dir": None})
    llm.generate([prompts([14])[0]], SamplingParams(temperature=0, max_tokens=3))
    runner = llm.llm_engine.runner
    assert runner.state.page_table.shape == (8 * 3, ENGINE["max_model_len"] // 4)
    pool = "f32[" + ",".join(map(str, runner.state.k_pages.shape)) + "]"
    for key in runner.programs.step_keys():
        text = runner.programs.executable(key).as_text()
        assert pool in text
        assert re.findall(re.escape(pool) + r"(?:\{[^}]*\})? copy\(", text) == [], key
        aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", text).group(1)
        assert aliases.count("may-alias") == 3, aliases
