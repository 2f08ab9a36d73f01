"""Scheduler: admission, chunked prefill, page growth, forks with copy-on-write, preemption.

Host-only: plans are checked directly, tokens are fed back by hand.
"""

from types import SimpleNamespace

import numpy as np

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup, SeqStatus
from jpaged.sample.sampler import SamplerOutput
from jpaged.sample.sampling_params import SamplingParams


def make(num_pages=9, page_size=4, max_num_seqs=4, budget=16, max_model_len=32, **cache):
    config = EngineConfig(
        cache=CacheConfig(page_size=page_size, num_pages=num_pages, **cache),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
        ),
    )
    alloc = PageAllocator(num_pages, enable_prefix_caching=config.cache.enable_prefix_caching)
    return Scheduler(config, alloc, eos_token_ids=(0,)), alloc


def add(sched, rid, prompt, **params):
    group = RequestGroup(rid, None, list(prompt), SamplingParams(**params), arrival=0)
    sched.add(group, seed=7)
    return group


def rows(sched, plan):
    """The plan's rows with their (still live) sequences, for reading assertions."""
    return [
        SimpleNamespace(
            seq=sched.sequence(int(plan.seq_ids[i])),
            num_new_tokens=int(plan.num_new_tokens[i]),
            start=int(plan.starts[i]),
            sample_row=int(plan.sample_rows[i]),
            keep_sample=bool(plan.keep_sample[i]),
        )
        for i in range(len(plan))
    ]


def feed(sched, plan, token=5):
    n = len(plan)
    tokens = np.broadcast_to(np.asarray(token, np.int32), (n,))
    out = SamplerOutput(tokens, np.zeros(n, np.float32), None, None)
    return sched.commit(plan, out)


def test_prefill_then_decode_takes_pages_on_demand():
    sched, _ = make()
    g = add(sched, "a", range(1, 7), max_tokens=8)  # 6 tokens -> 2 pages of 4
    plan = sched.schedule()
    (row,) = rows(sched, plan)
    assert (row.num_new_tokens, row.start, row.keep_sample) == (6, 0, True)
    assert row.seq.pages == [1, 2]
    assert plan.page_updates.tolist() == [[0, 0, 1], [0, 1, 2]]
    feed(sched, plan)
    assert row.seq.num_computed_tokens == 6 and row.seq.token_ids[-1] == 5
    plan = sched.schedule()  # token 7 goes into page 2 (slot 3): no new page
    assert plan.decode_only and plan.page_updates.tolist() == []
    feed(sched, plan)
    plan = sched.schedule()  # token 8 is position 7: still page 2
    feed(sched, plan)
    plan = sched.schedule()  # position 8 starts page 3
    assert plan.page_updates.tolist() == [[0, 2, 3]]
    assert g.seqs[0].pages == [1, 2, 3]


def test_chunked_prefill_respects_the_token_budget():
    sched, _ = make(budget=8, num_pages=20)
    add(sched, "long", range(1, 20), max_tokens=2)  # 19 tokens
    add(sched, "short", [1, 2], max_tokens=2)
    plan = sched.schedule()
    assert [(r.num_new_tokens, r.keep_sample) for r in rows(sched, plan)] == [(8, False)]
    feed(sched, plan)
    plan = sched.schedule()
    assert [(r.num_new_tokens, r.start) for r in rows(sched, plan)] == [(8, 8)]
    feed(sched, plan)
    plan = sched.schedule()  # 3 left for "long", then "short" joins the same step
    assert [(r.seq.group.request_id, r.num_new_tokens) for r in rows(sched, plan)] == [
        ("long", 3),
        ("short", 2),
    ]
    assert plan.num_tokens == 5 and not plan.decode_only


def test_eos_and_max_tokens_finish_and_free_everything():
    sched, alloc = make()
    add(sched, "a", [1, 2, 3], max_tokens=2)
    add(sched, "b", [1, 2, 3], max_tokens=5)
    feed(sched, sched.schedule(), token=5)
    plan = sched.schedule()
    done = feed(sched, plan, token=[5, 0])  # a reaches max_tokens; EOS for b
    assert {s.group.request_id: s.finish_reason for s in done} == {"a": "length", "b": "stop"}
    assert not sched.has_unfinished()
    assert alloc.num_used() == 0 and sorted(alloc.free_pages()) == list(range(1, 9))


def test_min_tokens_ignores_eos_until_reached():
    sched, _ = make()
    g = add(sched, "a", [1, 2], max_tokens=5, min_tokens=2)
    feed(sched, sched.schedule(), token=0)
    assert g.seqs[0].status is SeqStatus.RUNNING
    feed(sched, sched.schedule(), token=0)
    assert g.seqs[0].finish_reason == "stop"


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    sched, alloc = make(num_pages=12)
    add(sched, "n3", [1, 2, 3, 4, 5, 6], n=3, max_tokens=4, temperature=1.0)
    plan = sched.schedule()
    assert [(r.num_new_tokens, r.sample_row) for r in rows(sched, plan)] == [(6, 0), (0, 0), (0, 0)]
    parent, c1, c2 = (r.seq for r in rows(sched, plan))
    assert parent.pages == c1.pages == c2.pages == [1, 2]
    assert alloc.ref_counts[1] == 3 and alloc.ref_counts[2] == 3
    assert [s.table_row for s in (parent, c1, c2)] == [0, 1, 2]
    feed(sched, plan)
    plan = sched.schedule()  # all three write position 6, in shared page 2
    assert plan.decode_only
    # Parent and first child copy page 2; the last holder keeps it.
    assert plan.page_copies.tolist() == [[2, 3], [2, 4]]
    assert parent.pages == [1, 3] and c1.pages == [1, 4] and c2.pages == [1, 2]
    assert alloc.ref_counts[1] == 3 and alloc.ref_counts[2] == 1
    assert alloc.num_used() == 4


def test_preemption_frees_the_newest_and_recomputes_it():
    sched, alloc = make(num_pages=5, max_model_len=32)  # 4 usable pages
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=10)
    b = add(sched, "b", [1, 2, 3, 5], max_tokens=10)
    feed(sched, sched.schedule())  # a: page 1, b: page 2
    feed(sched, sched.schedule())  # both start a second page
    for _ in range(3):
        feed(sched, sched.schedule())
    # Both now need a third page; 0 free -> b (newest) is preempted for a.
    assert alloc.num_free() == 0
    plan = sched.schedule()
    assert [r.seq.group.request_id for r in rows(sched, plan)] == ["a"]
    assert sched.num_preemptions == 1
    bs = b.seqs[0]
    assert bs.status is SeqStatus.WAITING and bs.num_computed_tokens == 0 and bs.pages == []
    assert a.seqs[0].pages[:2] == [1, 3]


def test_reserve_allocates_prompt_plus_max_tokens_at_admission():
    sched, alloc = make(num_pages=20, kv_allocation="reserve")
    g = add(sched, "a", [1, 2, 3], max_tokens=10)  # 13 tokens -> 4 pages
    sched.schedule()
    assert len(g.seqs[0].pages) == 4 and alloc.num_used() == 4


def test_prefix_hit_skips_cached_pages():
    sched, alloc = make(num_pages=20)
    add(sched, "a", range(1, 11), max_tokens=1)  # 10 tokens: pages [1..4][5..8] full
    feed(sched, sched.schedule())
    assert alloc.num_cached() == 2
    b = add(sched, "b", list(range(1, 9)) + [42], max_tokens=1)
    plan = sched.schedule()
    (row,) = rows(sched, plan)
    assert row.start == 8 and row.num_new_tokens == 1
    assert b.seqs[0].pages[:2] == [1, 2]
    assert b.num_cached_tokens == 8
    assert sched.prefix_cache_hit_tokens == 8


def test_abort_before_the_fork_finishes_an_n_sample_request():
    sched, alloc = make()
    g = add(sched, "n4", range(1, 21), n=4, max_tokens=4, temperature=1.0)
    plan = sched.schedule()  # 16 of 20 prompt tokens: the forks wait for the prompt's end
    assert [r.num_new_tokens for r in rows(sched, plan)] == [16]
    feed(sched, plan)
    assert len(g.seqs) == 1 and not g.finished
    sched.abort(g)
    assert g.finished
    assert not sched.has_unfinished()
    assert alloc.num_used() == 0


def test_a_recomputed_sequence_waits_until_its_whole_context_fits():
    """Four 128-token prompts (32 pages each, chunks of 16 tokens) on 40 usable pages,
    admitted chunk by chunk: the pool fills before the first prompt ends, so the newest are
    recomputed. A recomputed one is re-admitted only when its whole context fits beside the
    running prompts' pages to come, so each is preempted at most once (re-admitted chunk by
    chunk, they were taken back again and again: 16 preemptions and 796 tokens computed
    before the rule, 3 and 605 after)."""
    sched, alloc = make(num_pages=41, budget=16, max_model_len=160)
    groups = [add(sched, str(i), [i + 1] * 128, max_tokens=16) for i in range(4)]
    preempted: dict[str, int] = {}
    computed = 0
    for _ in range(500):
        if not sched.has_unfinished():
            break
        before = {g.request_id: g.seqs[0].status for g in groups}
        plan = sched.schedule()
        computed += plan.num_tokens
        for g in groups:
            if before[g.request_id] is SeqStatus.RUNNING and g.seqs[0].status is SeqStatus.WAITING:
                preempted[g.request_id] = preempted.get(g.request_id, 0) + 1
        feed(sched, plan)
    assert not sched.has_unfinished()
    assert [len(g.seqs[0].output_token_ids) for g in groups] == [16] * 4
    assert 1 <= sched.num_preemptions == sum(preempted.values()) <= 3
    assert max(preempted.values()) == 1
    assert computed < 4 * (128 + 16) + 3 * 128
    assert alloc.num_used() == 0
