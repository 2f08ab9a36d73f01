"""Sessions' pages are evicted last while the session is active (jpaged/core/session_pages.py).

Host-only, exact page ids: the allocator's two LRU lists (other free pages first, then the
kept ones, least recently freed first; a released session's pages go to the back), the
Sessions clock, a scheduler whose pool evicts another request's pages instead of an active
session's (and the session's once it went idle), and the host store's same rule.
"""

import collections

import pytest
from test_swap import feed

from jpaged import SamplingParams
from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.host_page_store import HostPageStore
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.parallel import DataParallelEngine
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup
from jpaged.core.session_pages import Sessions


def cached(alloc, pages, tag):
    for i, p in enumerate(pages):
        alloc.cache_page(p, hash((tag, i)), (tag, i))


def test_kept_pages_are_handed_out_after_every_other_free_page_least_recent_first():
    alloc = PageAllocator(8)
    a = alloc.allocate(3)  # 1, 2, 3
    b = alloc.allocate(2)  # 4, 5
    cached(alloc, a[:2], "a")  # page 3 is not cached: freed as usual
    cached(alloc, b, "b")
    alloc.free(a[::-1], session="s")
    alloc.free(b[::-1])
    assert alloc.free_pages() == [6, 7, 3, 5, 4, 2, 1]
    assert (alloc.num_free(), alloc.num_kept()) == (7, 2)
    assert alloc.can_allocate(7) and not alloc.can_allocate(8)
    alloc.evicted = []
    assert alloc.allocate(5) == [6, 7, 3, 5, 4]  # b's cached pages go before s's
    assert [(p, e.token_ids, s) for p, e, s in alloc.evicted] == [
        (5, ("b", 1), None), (4, ("b", 0), None)
    ]  # fmt: skip
    assert alloc.allocate(1) == [2] and alloc.evicted[-1][2] == "s"  # then s's, LRU
    # A hit revives a kept page; freed again by the session, it is kept again (most recent).
    alloc.take_cached(1)
    assert alloc.num_kept() == 0
    alloc.free([1], session="s")
    assert alloc.free_pages() == [1]


def test_a_released_session_s_pages_go_to_the_back_of_the_free_list():
    alloc = PageAllocator(6)
    pages = alloc.allocate(4)
    cached(alloc, pages, "x")
    alloc.free([1, 2], session="s")
    alloc.free([3], session="t")
    alloc.free([4])
    assert alloc.free_pages() == [5, 4, 1, 2, 3]
    alloc.release_session("s")
    assert alloc.free_pages() == [5, 4, 1, 2, 3]  # now ordinary, after 4, before t's 3
    assert alloc.num_kept() == 1
    alloc.release_session("s")  # nothing left: nothing happens
    alloc.forget(3, int(alloc.generation[3]))  # forgetting a kept page: first out, uncached
    assert alloc.free_pages() == [3, 5, 4, 1, 2] and alloc.num_kept() == 0
    alloc.free(alloc.allocate(1), session="t")  # an uncached page is never kept
    assert alloc.num_kept() == 0
    alloc.free(alloc.allocate(2), session="u")  # 5 (uncached), 4 (cached)... handed out anew
    assert alloc.num_kept() == 0 and alloc.num_cached() == 2  # 1 and 2 remain


def test_a_session_is_active_while_running_and_for_its_idle_time_after():
    now = [0.0]
    sessions = Sessions(10.0, clock=lambda: now[0])
    sessions.begin("r1", "s")
    sessions.begin("r2", "s")
    sessions.begin("r3", None)  # no session: nothing tracked
    sessions.end("r1")
    now[0] = 100.0
    assert sessions.is_active("s") and sessions.expire() == []  # r2 still unfinished
    sessions.end("r2")
    sessions.end("r2")  # a second end does nothing
    now[0] = 109.9
    assert sessions.expire() == [] and sessions.is_active("s")
    sessions.begin("r4", "t")
    sessions.end("r4")
    now[0] = 110.0
    assert sessions.expire() == ["s"] and not sessions.is_active("s")
    assert sessions.num_active() == 1 and not sessions.is_active(None)


def make_scheduler(idle=5.0, host_pages=None):
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=7, session_idle_seconds=idle),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32),
    )
    store = None if host_pages is None else HostPageStore(host_pages, page_bytes=1, identity="m")
    sched = Scheduler(config, PageAllocator(7), eos_token_ids=(0,), host_store=store)
    now = [0.0]
    sched.kv.sessions.clock = lambda: now[0]
    return sched, now


def admit(sched, rid, prompt, session=None):
    group = RequestGroup(rid, None, prompt, SamplingParams(max_tokens=1), 0, session=session)
    sched.add(group, seed=1)
    plan = sched.schedule()
    pages = list(group.seqs[0].pages)
    feed(sched, plan)  # one step: the prompt and its one token; freed tail first
    return plan, pages


@pytest.mark.parametrize("session", [None, "s"])
def test_an_active_session_s_pages_are_evicted_after_another_request_s(session):
    sched, now = make_scheduler()
    _, a = admit(sched, "a", list(range(1, 10)), session)  # pages 1, 2 (cached), 3
    _, b = admit(sched, "b", list(range(20, 29)))  # 4, 5 (cached), 6
    assert (a, b) == ([1, 2, 3], [4, 5, 6])
    _, c = admit(sched, "c", list(range(40, 53)))  # 4 pages
    # Without a session the least recently freed (a's) go; with one, b's go instead.
    assert c == ([3, 2, 1, 6] if session is None else [3, 6, 5, 4])
    plan, _ = admit(sched, "a2", list(range(1, 10)), session)
    assert plan.starts.tolist() == ([0] if session is None else [8])  # a's prefix hit
    if session is None:
        return
    # a2's pages (its hit 1, 2 and a fresh one) are kept; the session goes idle at t=0.
    free = sched.allocator.free_pages()
    assert free[-2:] == [2, 1] and sched.allocator.num_kept() == 2
    now[0] = 4.9
    admit(sched, "d", [60, 61])  # a plan before the idle time: still kept
    assert sched.allocator.num_kept() == 2
    now[0] = 5.0
    plan, _ = admit(sched, "e", [62, 63])  # released by this plan: ordinary free pages
    assert sched.allocator.num_kept() == 0 and not sched.kv.sessions.is_active("s")
    assert sched.allocator.free_pages()[-3:] == [2, 1, plan_page(plan)]


def plan_page(plan):
    """The one page a one-page request's plan gave it (freed last, after the released)."""
    ((_, _, page),) = plan.page_updates.tolist()
    return page


def test_the_host_store_keeps_an_active_session_s_pages_longest():
    store = HostPageStore(2, page_bytes=1, identity="m")
    keys = [(store.page_hash(None, (i,), None), (i,)) for i in range(4)]
    assert store.offload_page(*keys[0], None, "s") == 1
    assert store.offload_page(*keys[1], None) == 2
    store.end_plan(2, 0)
    assert store.offload_page(*keys[2], None) == 2  # key 1's page goes, not s's older one
    store.end_plan(1, 0)
    assert store.lookup(*keys[1], None) is None and store.lookup(*keys[0], None) == 1
    store.load(1, "s")  # a hit of the session: kept again when the plan ends
    store.end_plan(0, 1)
    assert store.pages.free_pages() == [2, 1]
    store.pages.release_session("s")
    assert store.pages.free_pages() == [2, 1]
    assert store.offload_page(*keys[3], None) == 2  # released: plain LRU order again
    store.end_plan(1, 0)
    assert store.lookup(*keys[0], None) == 1


def run(sched, rid, prompt, session=None):
    """Runs a one-token request to its end -> each plan's (swap_out, swap_in)."""
    group = RequestGroup(rid, None, prompt, SamplingParams(max_tokens=1), 0, session=session)
    sched.add(group, seed=1)
    plans = []
    while sched.has_unfinished():
        plan = sched.schedule()
        plans.append((plan.swap_out.tolist(), plan.swap_in.tolist()))
        feed(sched, plan)
    return plans


@pytest.mark.parametrize("session", [None, "s"])
def test_through_the_host_tier_an_active_session_s_page_is_evicted_last_there_too(session):
    sched, _ = make_scheduler(host_pages=2)
    run(sched, "a", list(range(1, 6)), session)  # device page 1 cached (a's first page)
    run(sched, "b", list(range(20, 25)))  # device page 3 cached (b's)
    # c's 21 tokens take the whole pool: a's and b's pages go to host pages 1 and 2, in
    # LRU order without a session; with one, b's first and a's last (a's kept for s).
    want = [[1, 1], [3, 2]] if session is None else [[3, 1], [1, 2]]
    assert [out for outs, _ in run(sched, "c", list(range(40, 61))) for out in outs] == want
    assert sched.kv._store.pages.num_kept() == (session is not None)
    # One more eviction to host: the least recently used host page goes without a
    # session (a's), the other request's (b's) with one.
    assert run(sched, "d", list(range(70, 75))) == [([[4, 1]] if session is None else [[3, 1]], [])]
    # a's first page again: lost without a session, loaded from host page 2 with one.
    plans = run(sched, "a2", list(range(1, 6)), session)
    assert plans[0][1] == ([] if session is None else [[2, 4]])


class Replica:
    """A data-parallel replica that counts its requests."""

    def __init__(self):
        self.requests = []

    def num_unfinished_requests(self):
        return len(self.requests)

    def add_request(self, request_id, prompt, params, **kwargs):
        self.requests.append((request_id, kwargs["session"]))


def test_data_parallel_sends_a_session_s_requests_to_its_replica():
    front = object.__new__(DataParallelEngine)  # its routing only, over two fake replicas
    front.replicas = [Replica(), Replica()]
    front._owner, front._session_replica = {}, collections.OrderedDict()
    params = SamplingParams(max_tokens=1)
    for rid, session in [("1", "s"), ("2", None), ("3", "t"), ("4", "s"), ("5", "s"), ("6", "t")]:
        front.add_request(rid, [1], params, session=session)
    # Fewest unfinished first (1 -> 0, 2 -> 1, 3 -> 0), then each session's replica.
    assert [r.requests for r in front.replicas] == [
        [("1", "s"), ("3", "t"), ("4", "s"), ("5", "s"), ("6", "t")], [("2", None)]
    ]  # fmt: skip
