"""The host tier of the KV cache (jpaged/core/host_page_store.py, --kv-offload-bytes).

Host-only: the plans of an eviction to host and a load back (exact page ids), the store's
LRU order and bounds, the flags. Then engines on the tiny llama checkpoint (page_size 4,
max_model_len 64, one bucket, as test_memory.py) with a 16-page device pool: multi-turn
sessions whose histories are evicted and come back from host give the tokens of an engine
with a pool large enough to keep everything, with swap preemption using the same store; an
int8 page's values and scales come back from host as they left; every page is freed.
"""

import collections
import json
import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allocator_properties import (
    EOS,
    MAX_MODEL_LEN,
    FakeDevice,
    Harness,
    contexts,
    play_ops,
)
from test_memory import make_engine  # page_size 4, max_model_len 64, one bucket
from test_swap import feed

from jpaged import SamplingParams
from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core import kv_cache_manager
from jpaged.core.host_page_store import HostPageStore
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup
from jpaged.entrypoints.engine_args import engine_config_from_args
from jpaged.worker.programs import SWAP_PAGES


# -- host: the plans ---------------------------------------------------------------------------
def test_an_evicted_prefix_goes_to_host_and_its_next_prompt_loads_it_back():
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=5),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32),
    )
    store = HostPageStore(8, page_bytes=1, identity="m")
    sched = Scheduler(config, PageAllocator(5), eos_token_ids=(0,), host_store=store)

    def admit(rid, prompt):
        group = RequestGroup(rid, None, prompt, SamplingParams(max_tokens=1), 0)
        sched.add(group, seed=1)
        plan = sched.schedule()
        pages = list(group.seqs[0].pages)
        feed(sched, plan)  # one step: the prompt and its one token; freed tail first
        return plan, pages

    plan, a = admit("a", list(range(1, 10)))  # pages 1, 2, 3; 1 and 2 full, cached
    assert (plan.swap_out.tolist(), plan.swap_in.tolist(), a) == ([], [], [1, 2, 3])
    # b takes every page: 4, 3 (never cached), then 2 and 1, whose contents go to host
    # pages 1 and 2 before b's step writes them.
    plan, b = admit("b", list(range(20, 33)))
    assert (plan.swap_out.tolist(), plan.swap_in.tolist()) == ([[2, 1], [1, 2]], [])
    assert b == [4, 3, 2, 1] and store.num_cached() == 2
    # a again: both full pages hit on host and load into fresh pages 1 and 2 (b's cached
    # pages 2 and 3 go to host pages 3 and 4 first); the prefill starts after them.
    plan, a2 = admit("a2", list(range(1, 10)))
    assert plan.swap_out.tolist() == [[2, 3], [3, 4]]
    assert plan.swap_in.tolist() == [[2, 1], [1, 2]]
    assert (plan.starts.tolist(), plan.num_new_tokens.tolist(), a2) == ([8], [1], [1, 2, 3])
    assert sched.prefix_cache_hit_tokens == 8
    stats = store.stats()
    assert (stats["host_hit_pages"], stats["host_offloaded_pages"]) == (2, 4)
    assert (stats["host_pages_out"], stats["host_pages_in"], stats["host_pages_used"]) == (4, 2, 0)
    # The loaded pages are cached on the device again: a third copy hits there.
    plan, _ = admit("a3", list(range(1, 10)))
    assert (plan.swap_in.tolist(), plan.starts.tolist()) == ([], [8])


def test_the_store_evicts_its_least_recently_used_page_and_never_a_referenced_one():
    store = HostPageStore(2, page_bytes=10, identity="m")
    keys = [(store.page_hash(None, (i,), None), (i,)) for i in range(3)]
    assert [store.offload_page(h, t, None) for h, t in keys[:2]] == [1, 2]
    store.end_plan(2, 0)
    assert store.offload_page(*keys[0], None) is None  # already here: now most recent
    store.end_plan(0, 0)
    assert store.offload_page(*keys[2], None) == 2  # page 2 (key 1) was least recent
    store.end_plan(1, 0)
    assert store.lookup(*keys[1], None) is None and store.lookup(*keys[0], None) == 1
    assert store.lookup(keys[0][0], (9,), None) is None  # the tokens are checked
    assert store.lookup(keys[0][0], (0,), "salt") is None  # and the salt
    assert store.num_used() == 1  # a page found is held until its plan is complete
    store.end_plan(0, 0)
    # Swap pages are referenced: with both taken, an evicted page is not kept.
    # (page 1, found last, is the most recently used now)
    assert store.allocate(2) == [2, 1] and store.num_cached() == 0
    assert store.offload_page(*keys[1], None) is None
    assert store.stats()["host_offload_skipped"] == 1
    store.free([1, 2])
    assert store.num_used() == 2  # a plan's swap-ins read them: released at its end
    store.end_plan(0, 2)
    assert store.num_used() == 0 and store.num_usable_pages == 2


def test_page_hashes_name_the_model_the_prefix_and_the_salt():
    a, b = (
        HostPageStore(1, page_bytes=1, identity="m"),
        HostPageStore(1, page_bytes=1, identity="n"),
    )
    h = a.page_hash(None, (1, 2), None)
    assert h == HostPageStore(1, page_bytes=1, identity="m").page_hash(None, (1, 2), None)
    assert h != b.page_hash(None, (1, 2), None)  # another model never hits
    assert h != a.page_hash(None, (1, 2), "salt") != a.page_hash(None, (1, 2), "")
    assert a.page_hash(h, (3,), None) != a.page_hash(a.page_hash(None, (1, 3), None), (3,), None)


def test_offload_flags_are_validated(tiny_checkpoints):
    with pytest.raises(ValueError, match="kv_offload_bytes must be a non-negative integer"):
        CacheConfig(kv_offload_bytes=-1)
    with pytest.raises(ValueError, match="give it without num_swap_pages or swap_space_bytes"):
        CacheConfig(kv_offload_bytes=1 << 20, num_swap_pages=8)
    config = engine_config_from_args(str(tiny_checkpoints["llama"]), kv_offload_bytes=4096)
    assert config.cache.kv_offload_bytes == 4096
    from jpaged.core.memory_plan import plan_memory
    from models.config import ModelConfig

    hf = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    model = ModelConfig.from_hf_config(hf)
    small = engine_config_from_args(
        str(tiny_checkpoints["llama"]), kv_offload_bytes=100, num_pages=17, page_size=4
    )
    with pytest.raises(ValueError, match=r"kv_offload_bytes \(100\) holds less than two pages"):
        plan_memory(small, model, np.float32, "cpu")
    off = engine_config_from_args(str(tiny_checkpoints["llama"]), num_pages=17, page_size=4)
    assert plan_memory(off, model, np.float32, "cpu").num_swap_pages == 0  # off on CPU


def test_the_default_tier_on_an_accelerator_is_a_share_of_host_memory(monkeypatch):
    from jpaged.core import memory_plan
    from models.kv_groups import kv_groups

    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: 64 << 30)
    full = kv_groups((None, None), free_window_pages=True, max_model_len=64)
    windowed = kv_groups((8, 8), free_window_pages=True, max_model_len=64)
    mixed = kv_groups((8, None), free_window_pages=True, max_model_len=64)  # Gemma 2's

    def resolve(cache, groups=full, replicas=1):
        return memory_plan.resolve_kv_offload_bytes(cache, "gpu", groups, replicas=replicas)

    assert resolve(CacheConfig()) == 16 << 30  # a quarter
    assert resolve(CacheConfig(), replicas=2) == 8 << 30  # split over data-parallel replicas
    assert resolve(CacheConfig(swap_space_bytes=1 << 30)) == 0  # the swap space was sized
    assert resolve(CacheConfig(kv_offload_bytes=0)) == 0
    assert resolve(CacheConfig(), groups=windowed) == 0  # one windowed group: off
    assert resolve(CacheConfig(), groups=mixed) == 16 << 30  # a full first group: on
    assert resolve(CacheConfig(enable_prefix_caching=False)) == 0
    assert memory_plan.resolve_kv_offload_bytes(CacheConfig(), "cpu", full) == 0


# -- engines on the tiny checkpoint ------------------------------------------------------------
OFFLOAD_BYTES = 300 * 2048  # 2 KiB pages (float32): 299 host pages


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return {
        "ref": make_engine(path, num_pages=8 * 16 + 1),
        # 16 usable device pages (one max_model_len sequence); the sessions need ~40.
        "tier": make_engine(
            path, num_pages=17, kv_offload_bytes=OFFLOAD_BYTES, preemption_mode="swap"
        ),
        "ref8": make_engine(path, num_pages=8 * 16 + 1, kv_cache_dtype="int8"),
        "tier8": make_engine(path, num_pages=17, kv_offload_bytes=1 << 20, kv_cache_dtype="int8"),
    }


@pytest.fixture(scope="module")
def quantized(engines, tiny_checkpoints):
    """dtype -> (reference engine, engine with the tier) with int8 or fp8 KV pages (the fp8
    pair built on first use)."""
    path = tiny_checkpoints["llama"]
    pairs = {"int8": (engines["ref8"], engines["tier8"])}

    def get(dtype):
        if dtype not in pairs:
            pairs[dtype] = (
                make_engine(path, num_pages=8 * 16 + 1, kv_cache_dtype=dtype),
                make_engine(path, num_pages=17, kv_offload_bytes=1 << 20, kv_cache_dtype=dtype),
            )
        return pairs[dtype]

    return get


QUANTIZED = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn"}  # KV dtype -> its pages' numpy dtype


def bits(a):
    """An array's bytes, to compare bit for bit (fp8's NaN != NaN would not)."""
    return np.ascontiguousarray(a).view(np.uint8)


def sessions(engine, num_sessions=3, num_turns=3, max_tokens=8, keyed=False):
    """Multi-turn sessions, interleaved: each turn of every session is sent at once, its
    prompt the session's history (prompts, replies) and 6 new tokens (keyed: each request
    names its session: jpaged/core/session_pages.py). Returns the replies by
    turn, the tokens the steps computed, every turn's prompt tokens and the stats."""
    engine.reset_stats()
    rng = np.random.default_rng(3)
    vocab = engine.model_config.vocab_size
    history = [rng.integers(3, vocab, 14).tolist() for _ in range(num_sessions)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    computed, replies, num_prompt = [], {}, 0
    schedule = engine.scheduler.schedule

    def counting_schedule(*args):
        plan = schedule(*args)
        computed.append(plan.num_tokens)
        return plan

    engine.scheduler.schedule = counting_schedule
    try:
        for turn in range(num_turns):
            for s in range(num_sessions):
                history[s] = history[s] + rng.integers(3, vocab, 6).tolist()
                session = f"s{s}" if keyed else None
                engine.add_request(f"{turn}.{s}", history[s], params, session=session)
                num_prompt += len(history[s])
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        replies[out.request_id] = out.outputs[0].token_ids
            for s in range(num_sessions):
                history[s] += replies[f"{turn}.{s}"]
    finally:
        del engine.scheduler.schedule
    stats = engine.stats()
    assert (stats["pages_used"], stats["host_pages_used"]) == (0, 0)  # every page freed
    once = num_prompt + num_sessions * num_turns * (max_tokens - 1)
    return replies, sum(computed), once, stats


def test_sessions_evicted_to_host_come_back_with_the_same_tokens(engines):
    ref, tier = engines["ref"], engines["tier"]
    want, _, _, ref_stats = sessions(ref)
    got, computed, once, stats = sessions(tier)
    assert got == want
    assert ref_stats["num_preemptions"] == 0 and stats["num_swaps_out"] > 0
    # Histories came back from host, and the prefill skipped exactly the hit tokens (swapped
    # sequences computed nothing twice: every preemption swapped).
    assert stats["host_hit_pages"] > 0 and stats["host_offloaded_pages"] > 0
    assert stats["prefix_cache_hit_tokens"] >= 4 * stats["host_hit_pages"]
    assert stats["num_swaps_in"] == stats["num_swaps_out"] == stats["num_preemptions"]
    assert computed == once - stats["prefix_cache_hit_tokens"]
    assert stats["host_pages_in"] >= stats["host_hit_pages"]
    assert stats["host_bytes_out"] == stats["host_pages_out"] * 2048
    assert stats["host_copy_steps"] > 0 and stats["host_copy_seconds"] > 0
    # The store fits its bytes (the host array's unused page 0 included).
    assert tier.runner.swap_space.nbytes <= OFFLOAD_BYTES < tier.runner.swap_space.nbytes + 4096


def test_sessions_named_on_their_requests_give_the_same_tokens_and_keep_their_pages(engines):
    ref, tier = engines["ref"], engines["tier"]
    want, _, _, _ = sessions(ref)
    got, _, _, stats = sessions(tier, keyed=True)
    assert got == want and stats["host_hit_pages"] > 0
    # The sessions are active (60 s idle time): their free cached pages are kept, last out.
    kv = tier.scheduler.kv
    assert kv.sessions.num_active() == 3 and tier.allocator.num_kept() > 0
    assert tier.allocator.free_pages()[-tier.allocator.num_kept() :] == list(tier.allocator._kept)
    kv.sessions.idle_seconds = 0.0
    kv.take_edits(False)  # the next plan releases them
    assert kv.sessions.num_active() == 0 and tier.allocator.num_kept() == 0
    assert tier.host_store.pages.num_kept() == 0
    kv.sessions.idle_seconds = 60.0
    with pytest.raises(ValueError, match="session must be a non-empty string"):
        tier.add_request("bad", [5, 6], SamplingParams(max_tokens=1), session="")


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_sessions_through_the_host_tier_give_the_same_tokens(quantized, dtype):
    ref, tier = quantized(dtype)
    want, _, _, _ = sessions(ref)
    got, computed, once, stats = sessions(tier)
    assert got == want
    # Preempted sequences are recomputed (recompute mode), from host hits among others.
    assert stats["host_hit_pages"] > 0 and stats["num_preemptions"] > 0
    assert computed < once


def device_pages(engine, pages):
    """Every leaf of the pool's pages (values, and an int8 pool's scales), numpy."""
    gather, _ = engine.runner._swappers()
    ids = np.zeros(SWAP_PAGES, np.int32)
    ids[: len(pages)] = pages
    got = jax.device_get(gather(engine.runner.state, ids))
    host = jax.tree.leaves(engine.runner.swap_space)
    return [
        g.reshape(*h.shape[:3], SWAP_PAGES, *h.shape[4:])[:, :, :, : len(pages)]
        for h, g in zip(host, jax.tree.leaves(got), strict=True)
    ]


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_quantized_page_evicted_to_host_and_loaded_back_keeps_its_values_and_scales(
    quantized, dtype
):
    _, engine = quantized(dtype)
    store, alloc = engine.host_store, engine.allocator
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(11)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = rng.integers(3, vocab, 13).tolist()  # 3 full pages

    def run(rid, tokens):
        engine.add_request(rid, tokens, params)
        while engine.has_unfinished_requests():
            engine.step()

    def cached(tokens):
        """The device pages caching tokens' full pages, each after the one before."""
        pages, parent, h = [], None, None
        for i in range(3):
            page_tokens = tuple(tokens[4 * i : 4 * i + 4])
            h = store.page_hash(h, page_tokens, None)
            pages.append(alloc.lookup(h, page_tokens, parent=parent))
            parent = pages[-1]
        return pages

    run("a", prompt)
    pages = cached(prompt)
    before = device_pages(engine, pages)
    assert len(before) == 2 and before[0].dtype.name == QUANTIZED[dtype]  # values, scales
    for i in range(4):  # 4 x 15 tokens: every device page is handed out anew
        run(f"x{i}", rng.integers(3, vocab, 60).tolist())
    assert cached(prompt)[0] is None
    engine.runner.flush_host_writes()  # the last plan's swap-outs, deferred
    host = []
    h = None
    for i in range(3):
        page_tokens = tuple(prompt[4 * i : 4 * i + 4])
        h = store.page_hash(h, page_tokens, None)
        host.append(store.lookup(h, page_tokens, None))
    assert None not in host
    for leaf, want in zip(jax.tree.leaves(engine.runner.swap_space), before, strict=True):
        np.testing.assert_array_equal(bits(leaf[:, :, :, host]), bits(want))
    hits = store.num_hit_pages
    run("a again", prompt)
    assert store.num_hit_pages == hits + 3
    for got, want in zip(device_pages(engine, cached(prompt)), before, strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


MAX_EXAMPLES = int(os.environ.get("JPAGED_TIER_EXAMPLES", "100"))


# -- hypothesis: the host-only harness of test_allocator_properties with the tier on --------------
class TierHarness(Harness):
    """Harness (test_allocator_properties) whose scheduler has the host tier: its FakeDevice's
    host pages are the store's, the swap space too when swap is on. check() adds: every page
    the store caches holds its entry's tokens, computed after exactly the prefix its hash
    names."""

    def __init__(self, page_size, num_pages, max_num_seqs, budget, host_pages, swap):
        super().__init__(page_size, num_pages, max_num_seqs, budget, "paged", True)
        config = EngineConfig(
            cache=CacheConfig(page_size=page_size, num_pages=num_pages),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                max_model_len=MAX_MODEL_LEN, preemption_mode="swap" if swap else "recompute",
            ),
        )  # fmt: skip
        self.store = HostPageStore(host_pages, page_bytes=1, identity="tiny")
        self.sched = Scheduler(
            config, self.alloc, eos_token_ids=(EOS,), swap_allocator=self.store if swap else None,
            host_store=self.store,
        )  # fmt: skip
        self.swap = self.store.pages if swap else None
        table_shape = (max_num_seqs + 1, config.max_pages_per_seq)
        self.device = FakeDevice(num_pages, page_size, table_shape, host_pages)

    def pending_host_pages(self):
        """A dropped swapped sequence's host pages (an abort) are released when the next plan
        is complete (HostPageStore.free): held until then."""
        return [page for page, _ in self.store._named]

    def check(self):
        super().check()
        prefixes = {}  # hash -> the tokens up to and including its page
        ps = self.ps
        for g in self.groups:
            for s in g.seqs:
                h = None
                for i in range(len(s.token_ids) // ps):
                    h = self.store.page_hash(
                        h, tuple(s.token_ids[i * ps : (i + 1) * ps]), g.cache_salt
                    )
                    prefixes[h] = s.token_ids[: (i + 1) * ps]
        pages = self.store.pages
        assert pages.num_used() == (0 if self.swap is None else self.swap.num_used())
        for page in range(1, pages.num_pages):
            entry = pages.cached_entry(page)
            if entry is None:
                continue
            prefix = prefixes[entry.hash]
            assert self.device.host[page].tolist() == list(entry.token_ids) == prefix[-ps:]
            assert self.device.host_ctx[page].tolist() == contexts(prefix)[-ps:]


def run_tier_ops(data, swap):
    ps = data.draw(st.sampled_from([1, 2, 4]), label="page_size")
    pages_per_seq = -(-MAX_MODEL_LEN // ps)
    max_num_seqs = data.draw(st.integers(1, 3), label="max_num_seqs")
    h = TierHarness(
        page_size=ps,
        num_pages=data.draw(st.integers(pages_per_seq + 1, 2 * pages_per_seq), label="num_pages"),
        max_num_seqs=max_num_seqs,
        budget=data.draw(st.integers(max_num_seqs, 16), label="budget"),
        # From fewer host pages than one sequence to room for several.
        host_pages=data.draw(st.integers(1, 3 * pages_per_seq), label="host_pages"),
        swap=swap,
    )
    play_ops(h, data, max_num_seqs, seed_by_group=False)  # forks fit the rows
    assert h.store.num_used() == 0
    return h


def test_the_host_tier_keeps_every_invariant_under_admission_eviction_load_and_preemption(
    monkeypatch,
):
    # The base checks recompute page hashes with the module's page_hash: the tier's here.
    hasher = HostPageStore(1, page_bytes=1, identity="tiny")
    monkeypatch.setattr(kv_cache_manager, "page_hash", hasher.page_hash)

    seen = collections.Counter()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        h = run_tier_ops(data, swap=data.draw(st.booleans(), label="swap"))
        seen["host hits"] += h.store.num_hit_pages
        seen["offloads"] += h.store.num_offloaded
        seen["swaps"] += h.sched.num_swaps_in

    run()
    assert min(seen.values()) > 0, seen  # the examples load, offload and swap


@pytest.mark.parametrize("pair", [("ref", "tier"), ("ref8", "tier8")])
def test_a_cached_turn_yields_no_wait_behind_another_sessions_decode(engines, pair):
    # jpaged/core/prompt_first.py: two sessions' second turns arrive together on a pool of
    # 16 pages that holds one; a's turn runs first, b's is nearly all cached (device, host),
    # so a yields once and b's first token comes before a's last, with the tokens of an
    # engine whose pool holds both.
    ref, tier = engines[pair[0]], engines[pair[1]]
    rng = np.random.default_rng(7)
    vocab = tier.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = {s: rng.integers(3, vocab, 26).tolist() for s in "ab"}
    new = {s: rng.integers(3, vocab, 6).tolist() for s in "ab"}

    def run(engine):
        events, outs = [], {}
        for s in "ab":  # turn 1, one session at a time: 38 tokens, 10 pages each
            engine.add_request(f"{s}1", first[s], params)
            while engine.has_unfinished_requests():
                outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
        engine.reset_stats()
        for s in "ab":  # turn 2 of both at once: 44 prompt tokens (11 pages) each
            engine.add_request(f"{s}2", first[s] + outs[f"{s}1"] + new[s], params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if len(o.outputs[0].token_ids) == 1 or o.finished:
                    events.append((o.request_id, "done" if o.finished else "first"))
                outs[o.request_id] = o.outputs[0].token_ids
        return outs, events, engine.stats()

    want, _, ref_stats = run(ref)
    got, events, stats = run(tier)
    assert got == want
    assert ref_stats["num_preemptions"] == 0
    assert events.index(("b2", "first")) < events.index(("a2", "done"))  # b2 did not wait
    # a2 yielded once; b2's history came from the device and the host tier (its last
    # partial page computed). Swap preemption ("tier"): a2 swapped out and back in;
    # recompute ("tier8"): a2's 44 + 1 tokens came back as hits less its partial page.
    assert stats["num_preemptions"] == 1 and stats["host_hit_pages"] > 0
    if tier.scheduler.swap_allocator is not None:
        assert stats["num_swaps_out"] == stats["num_swaps_in"] == 1
        assert stats["prefix_cache_hit_tokens"] >= 40
    else:
        assert stats["num_swaps_out"] == 0 and stats["prefix_cache_hit_tokens"] >= 40 + 44
