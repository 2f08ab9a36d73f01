"""Swap preemption (preemption_mode="swap"): preempted K/V goes to host pages and comes back.

Host-only checks of the plans (exact page ids), then engines on the tiny llama checkpoint
(page_size 4, max_model_len 64) padded to one bucket each, as in test_memory.py: a pool far
too small for the batch swaps often and changes no token, swapped sequences are never
recomputed, and a full swap space falls back to recompute.
"""

import numpy as np
import pytest
from test_memory import make_engine  # page_size 4, max_model_len 64, one bucket

from jpaged import SamplingParams
from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.engine import LLMEngine
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup, SeqStatus
from jpaged.sample.sampler import SamplerOutput


# -- host: the plans ---------------------------------------------------------------------------
def make_scheduler(num_swap_pages):
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=5),
        scheduler=SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, preemption_mode="swap"
        ),
    )
    swap = PageAllocator(num_swap_pages + 1, enable_prefix_caching=False)
    sched = Scheduler(config, PageAllocator(5), eos_token_ids=(0,), swap_allocator=swap)
    return sched, swap


def feed(sched, plan, token=5):
    n = len(plan)
    out = SamplerOutput(np.full(n, token, np.int32), np.zeros(n, np.float32), None, None)
    sched.commit(plan, out)


def two_requests_until_b_is_preempted(sched):
    """a and b each prefill 6 tokens into 2 pages (a: 1, 2; b: 3, 4), decode 2 tokens; a's
    third decode needs a fifth page: b, the newest, is preempted."""
    groups = []
    for rid in ("a", "b"):
        group = RequestGroup(rid, None, list(range(1, 7)), SamplingParams(max_tokens=8), 0)
        sched.add(group, seed=7)
        groups.append(group)
    for _ in range(3):
        feed(sched, sched.schedule())
    a, b = (g.seqs[0] for g in groups)
    assert (a.pages, b.pages, b.num_computed_tokens) == ([1, 2], [3, 4], 8)
    return a, b


def test_swap_out_copies_the_computed_pages_and_swap_in_restores_them_into_fresh_pages():
    sched, swap = make_scheduler(num_swap_pages=4)
    a, b = two_requests_until_b_is_preempted(sched)
    plan = sched.schedule()
    assert plan.swap_out.tolist() == [[3, 1], [4, 2]] and plan.swap_in.tolist() == []
    assert plan.seq_ids.tolist() == [a.seq_id] and a.pages == [1, 2, 4]  # b's tail page first
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 8
    assert (b.pages, b.swap_pages, swap.num_used()) == ([], [1, 2], 2)
    assert (sched.num_preemptions, sched.num_swaps_out, sched.num_swaps_in) == (1, 1, 0)
    feed(sched, plan)
    plan = sched.schedule()  # b needs 3 pages, 1 is free: it keeps waiting
    assert plan.seq_ids.tolist() == [a.seq_id] and plan.swap_in.tolist() == []
    feed(sched, plan)
    sched.abort(a.group)  # frees 4, 2, 1 (tail first) after 3
    plan = sched.schedule()
    assert plan.swap_in.tolist() == [[1, 3], [2, 4]] and plan.swap_out.tolist() == []
    row = (plan.seq_ids.tolist(), plan.starts.tolist(), plan.num_new_tokens.tolist())
    assert row == ([b.seq_id], [8], [1])  # no recompute
    assert (b.pages, b.swap_pages, swap.num_used(), sched.num_swaps_in) == ([3, 4, 2], [], 0, 1)
    r = b.table_row
    assert plan.page_updates.tolist() == [[r, 0, 3], [r, 1, 4], [r, 2, 2]]


def test_a_full_swap_space_falls_back_to_recompute():
    sched, swap = make_scheduler(num_swap_pages=1)  # b's 2 pages do not fit
    _, b = two_requests_until_b_is_preempted(sched)
    plan = sched.schedule()
    assert plan.swap_out.tolist() == [] and b.num_computed_tokens == 0 and b.swap_pages == []
    assert (sched.num_preemptions, sched.num_swaps_out, swap.num_used()) == (1, 0, 0)


def test_aborting_a_swapped_sequence_frees_its_host_pages():
    sched, swap = make_scheduler(num_swap_pages=4)
    _, b = two_requests_until_b_is_preempted(sched)
    sched.schedule()
    assert swap.num_used() == 2
    sched.abort(b.group)
    assert (swap.num_used(), b.swap_pages, b.status) == (0, [], SeqStatus.FINISHED)


def test_swap_needs_a_swap_allocator_and_a_known_mode():
    config = EngineConfig(scheduler=SchedulerConfig(preemption_mode="swap"))
    with pytest.raises(ValueError, match="swap_allocator"):
        Scheduler(config, PageAllocator(5))
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="disk")
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(num_swap_pages=4, swap_space_bytes=1 << 20)
    with pytest.raises(ValueError, match="swap_space_bytes"):
        CacheConfig(swap_space_bytes=0)


# -- engines on the tiny checkpoint ------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return {
        "large": make_engine(path, num_pages=8 * 16 + 1),
        # 16 usable device pages (one max_model_len sequence); the batch needs ~90.
        "swap": make_engine(path, num_pages=17, preemption_mode="swap", num_swap_pages=256),
        "tight": make_engine(path, num_pages=17, preemption_mode="swap", num_swap_pages=6),
    }


def run(engine: LLMEngine, requests) -> tuple[dict, int, dict]:
    """Runs (request_id, prompt ids, params) to the end from reset stats; returns request_id
    -> token ids of each completion, the number of tokens the steps computed, and stats."""
    engine.reset_stats()
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, computed = {}, []
    schedule = engine.scheduler.schedule

    def counting_schedule(*args):
        plan = schedule(*args)
        computed.append(plan.num_tokens)
        return plan

    engine.scheduler.schedule = counting_schedule
    try:
        while engine.has_unfinished_requests():
            outs = engine.step()
            done.update(
                {o.request_id: [c.token_ids for c in o.outputs] for o in outs if o.finished}
            )
    finally:
        del engine.scheduler.schedule
    stats = engine.stats()
    assert (stats["pages_used"], stats["swap_pages_used"]) == (0, 0)
    assert engine.allocator.num_free() == stats["pages_total"]
    return done, sum(computed), stats


def batch(engine, n_requests=16, max_tokens=32):
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(4)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [
        (f"r{i}", rng.integers(3, vocab, int(rng.integers(4, 16))).tolist(), params)
        for i in range(n_requests)
    ]


def test_a_pool_far_too_small_swaps_often_changes_no_token_and_recomputes_nothing(engines):
    large, swap = engines["large"], engines["swap"]
    requests = batch(swap)
    ref, ref_computed, ref_stats = run(large, requests)
    got, computed, stats = run(swap, requests)
    assert got == ref
    assert all(len(toks[0]) == 32 for toks in got.values())
    assert ref_stats["num_preemptions"] == 0
    assert stats["num_swaps_out"] > len(requests)  # most requests are swapped, some repeatedly
    assert stats["num_swaps_in"] == stats["num_swaps_out"]
    assert stats["num_preemptions"] == stats["num_swaps_out"]  # no recompute fallback
    # Every token is computed once: the prompt and all but the last generated token (random
    # prompts share no page, so the prefix cache serves nothing).
    once = sum(len(p) + 32 - 1 for _, p, _ in requests)
    assert stats["prefix_cache_hit_tokens"] == 0
    assert computed == once == ref_computed + ref_stats["prefix_cache_hit_tokens"]
    assert stats["peak_pages_used"] == stats["pages_total"] == 16


def test_swapping_forks_and_prefix_shared_pages_changes_no_sample(engines):
    large, swap = engines["large"], engines["swap"]
    vocab = swap.model_config.vocab_size
    shared = np.random.default_rng(5).integers(3, vocab, 14).tolist()  # 3 full pages + 2
    requests = [
        (f"s{i}", shared + [3 + i], SamplingParams(n=2, max_tokens=24, seed=i, ignore_eos=True))
        for i in range(5)
    ]
    ref, _, _ = run(large, requests)
    got, computed, stats = run(swap, requests)
    assert got == ref
    assert all(a != b for a, b in got.values())  # the forks sample differently
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_swaps_out"] > 0
    assert stats["num_preemptions"] == stats["num_swaps_out"] == stats["num_swaps_in"]
    # Prompts once (less the hits), then each fork's generated tokens but the last.
    once = sum(len(p) for _, p, _ in requests) + 5 * 2 * (24 - 1)
    assert computed == once - stats["prefix_cache_hit_tokens"]


def test_a_full_swap_space_falls_back_to_recompute_and_changes_no_token(engines):
    large, tight = engines["large"], engines["tight"]
    requests = batch(tight)
    ref, _, _ = run(large, requests)
    got, computed, stats = run(tight, requests)
    assert got == ref
    assert 0 < stats["num_swaps_out"] < stats["num_preemptions"]  # some swapped, some not
    assert stats["num_swaps_in"] == stats["num_swaps_out"]
    # Recomputed sequences compute their tokens again (less what the prefix cache serves).
    once = sum(len(p) + 32 - 1 for _, p, _ in requests)
    assert computed + stats["prefix_cache_hit_tokens"] > once
