"""Allocator, scheduler and page tables under random workloads (hypothesis), host only.

Each example drives a Scheduler + PageAllocator through a random sequence of operations:
admit requests (shared prefixes, n > 1 forks, cache salts), steps (append tokens, chunked
prefill, copy-on-write writes into shared pages, preemption, LRU eviction of cached pages),
aborts (free) and prefix-cache resets. A fake device stands in for the model: it applies each
plan's page-table updates and page copies the way the jitted step does, then writes every
computed token's id into its slot, so a wrong page shows up as a wrong token.

After every operation:
- each page's reference count equals the number of page-table entries holding it;
- the free list is exactly the unreferenced pages (never the null page);
- host page tables (each running sequence's pages) and the device table agree, and every
  page-table row is free, running or reserved, once;
- each plan's flat slots (slot_mapping) and token ids are exactly those of its rows'
  positions through the device table;
- every position a sequence has computed reads back its own token through the device table,
  written after exactly the sequence's own tokens before it (a page hit after another
  prefix with the same page tokens would read back the right tokens, not the right K/V);
- every cached page holds the tokens of its entry, and its hash is the page_hash chain of
  a prefix some sequence really had; it is found again only while its parent page is in the
  generation it was cached after;
- prefix hits stay exact when the hash function collides on purpose (all pages one hash, or
  a hash of the page's tokens alone, blind to the prefix and the cache salt), in every
  paging group too (a window group's pages all under one hash).
- paged policy: a running sequence holds ceil(computed / page_size) pages, so at most
  page_size - 1 allocated slots are unfilled (also checked right after each schedule).
- swap preemption: host swap pages are held exactly by the waiting swapped sequences, which
  keep num_computed_tokens, and every computed position reads back its own token from host;
  a resumed sequence reads its tokens back through fresh device pages.
- sliding window W (every layer windowed): right after each schedule a scheduled sequence's
  pages wholly before its first query's window are exactly its leading NULL_PAGE entries
  (in the device table too) and the rest are held; no page a later query reads is ever
  freed (reads are checked from the window's first key); swapped sequences hold host pages
  for their window only.
- paging groups (a model mixing attention kinds: one page table per group, each with its own
  window or none, all from one free list): every check above holds in every group's table,
  a prefix hit takes as many pages in each group, and a group's cached pages are found only
  under its own hashes.
At the end every request is drained or aborted and nothing may be left allocated.
"""

import collections
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core import kv_cache_manager as scheduler_module
from jpaged.core.kv_cache_manager import sequence_pages
from jpaged.core.page_allocator import NULL_PAGE, PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup, SeqStatus
from jpaged.sample.sampler import SamplerOutput
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.step_plan import PLACEHOLDER, StepPlan

EOS = 0
MAX_MODEL_LEN = 24
# Prompts start with a cut of one of these, so requests share prefixes of every length.
BASES = [
    [],
    [1, 2, 3],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5],
    [7, 7, 7, 7, 7, 7, 7, 7, 7],
]


def contexts(token_ids) -> list[int]:
    """Per position, an id of the tokens up to it (what its K/V depends on)."""
    out, h = [], 0
    for t in token_ids:
        h = hash((h, t))
        out.append(h)
    return out


class FakeDevice:
    """The jitted step's memory effects: page-table updates, CoW copies, K/V writes. A page
    belongs to one paging group, so one token array per page stands for every layer; beside
    it, the context id (contexts) of the tokens each slot was computed after."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        table_shape: tuple[int, int],
        num_swap_pages: int,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.page_size = page_size
        self.windows = windows
        self.stride = table_shape[0]  # rows of one group's block of the device table
        self.kv = np.full((num_pages, page_size), -1, np.int64)  # token id held by each slot
        self.host = np.full((num_swap_pages + 1, page_size), -1, np.int64)  # swap space
        self.ctx = np.zeros((num_pages, page_size), np.int64)  # context id of each slot
        self.host_ctx = np.zeros((num_swap_pages + 1, page_size), np.int64)
        self.page_table = np.zeros((len(windows) * table_shape[0], table_shape[1]), np.int32)

    def token_at(self, slot: int, pos: int, group: int = 0) -> int:
        page = self.page_table[group * self.stride + slot, pos // self.page_size]
        return int(self.kv[page, pos % self.page_size])

    def context_at(self, slot: int, pos: int, group: int = 0) -> int:
        page = self.page_table[group * self.stride + slot, pos // self.page_size]
        return int(self.ctx[page, pos % self.page_size])

    def run(self, plan: StepPlan, sched: Scheduler) -> None:
        for dev, host in plan.swap_out:  # the runner's order: out, in, then the step
            self.host[host], self.host_ctx[host] = self.kv[dev], self.ctx[dev]
        for host, dev in plan.swap_in:
            self.kv[dev], self.ctx[dev] = self.host[host], self.host_ctx[host]
        for row, col, page in plan.page_updates:
            self.page_table[row, col] = page
        if len(plan.page_copies):
            src, dst = plan.page_copies.T
            self.kv[dst] = self.kv[src]  # all copies read before any write, as in jit
            self.ctx[dst] = self.ctx[src]
        assert not np.any(plan.token_ids == PLACEHOLDER)  # synchronous steps only
        assert plan.slot_mapping.shape == (len(self.windows), plan.num_tokens)
        for i in range(len(plan)):
            seq = sched.sequence(int(plan.seq_ids[i]))
            row, start = int(plan.table_rows[i]), int(plan.starts[i])
            assert row == seq.table_row and start <= seq.num_tokens
            assert len(seq.tables) == len(self.windows)
            first, last = plan.query_start[i], plan.query_start[i + 1]
            written = contexts(seq.token_ids[:start] + plan.token_ids[first:last].tolist())
            for g, window in enumerate(self.windows):
                for pos in range(first_key(start, window), start):  # what attention reads
                    assert self.token_at(row, pos, g) == seq.token_ids[pos], (seq.seq_id, g, pos)
                    assert self.context_at(row, pos, g) == written[pos], (seq.seq_id, g, pos)
            assert last - first == plan.num_new_tokens[i]
            for t, pos in zip(range(first, last), range(start, start + last - first)):
                assert plan.positions[t] == pos
                if pos < seq.num_tokens:
                    assert plan.token_ids[t] == seq.token_ids[pos]
                else:  # a speculative proposal after the sequence's last token
                    assert plan.token_ids[t] == plan.proposals[i, pos - seq.num_tokens]
                for g in range(len(self.windows)):
                    page = self.page_table[g * self.stride + row, pos // self.page_size]
                    assert page != NULL_PAGE
                    assert page == seq.tables[g][pos // self.page_size]  # device == host
                    assert plan.slot_mapping[g, t] == page * self.page_size + pos % self.page_size
                    self.kv[page, pos % self.page_size] = plan.token_ids[t]
                    self.ctx[page, pos % self.page_size] = written[pos]


def first_key(pos: int, window: int | None) -> int:
    """The first key a query at pos reads."""
    return 0 if window is None else max(pos - window + 1, 0)


class Harness:
    def __init__(
        self,
        page_size,
        num_pages,
        max_num_seqs,
        budget,
        kv_allocation,
        caching,
        swap_pages=0,
        spec=False,
        window=None,
        windows=None,
    ):
        """window: every layer's (one group); windows: instead, each paging group's."""
        config = EngineConfig(
            cache=CacheConfig(
                page_size=page_size,
                num_pages=num_pages,
                kv_allocation=kv_allocation,
                enable_prefix_caching=caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=MAX_MODEL_LEN,
                preemption_mode="swap" if swap_pages else "recompute",
            ),
        )
        self.ps = page_size
        self.paged = kv_allocation == "paged"
        self.alloc = PageAllocator(num_pages, enable_prefix_caching=caching)
        self.swap = (
            PageAllocator(swap_pages + 1, enable_prefix_caching=False) if swap_pages else None
        )
        self.sched = Scheduler(
            config, self.alloc, eos_token_ids=(EOS,), swap_allocator=self.swap,
            sliding_window=window, group_windows=windows,
        )  # fmt: skip
        self.windows = (window,) if windows is None else windows
        table_shape = (max_num_seqs + 1, config.max_pages_per_seq)
        self.device = FakeDevice(num_pages, page_size, table_shape, swap_pages, self.windows)
        self.groups: list[RequestGroup] = []
        self.num_steps = 0
        self.spec = spec  # speculative decoding: proposals, then a partial acceptance
        self.num_accepted = 0
        # Per sequence id: its full pages' tokens so far, their page_hash chain and each
        # paging group's (hash, page tokens) (check() reads every sequence's after every
        # operation; extended as a sequence grows, recomputed if its tokens changed).
        self._chains: dict[int, tuple[list[int], list, list]] = {}

    # -- operations ------------------------------------------------------------------------
    def admit(self, prompt, n, max_tokens, salt, seed):
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0 if n > 1 else 0.0)
        group = RequestGroup(f"r{len(self.groups)}", None, prompt, params, len(self.groups), salt)
        self.sched.add(group, seed=seed)
        self.groups.append(group)

    def step(self, tokens):
        plan = self.sched.schedule(self.proposals(tokens) if self.spec else None)
        self.check_scheduled(plan)
        self.device.run(plan, self.sched)
        out_tokens = np.asarray([tokens[i % len(tokens)] for i in range(len(plan))])
        n = len(plan)
        out = SamplerOutput(out_tokens.astype(np.int32), np.zeros(n), None, None)
        if self.spec:
            out = self.verified(plan, out_tokens)
        self.sched.commit(plan, out)
        self.num_steps += 1
        return plan

    def proposals(self, tokens):
        """Up to 3 proposals for each decoding sequence, capped as the engine caps them."""
        out = {}
        for s in self.running():
            if s.num_computed_tokens != s.num_tokens - 1:
                continue
            room = min(MAX_MODEL_LEN - s.num_tokens, s.params.max_tokens - s.num_output_tokens) - 1
            k = min(tokens[s.seq_id % len(tokens)] % 4, room)
            if k > 0:
                out[s.seq_id] = [(t + s.seq_id) % 9 + 1 for t in tokens[:k]]
        return out

    def verified(self, plan, bonus):
        """A verification's output: a prefix of each row's proposals (length from the row's
        bonus token), then the bonus token."""
        n = len(plan)
        k = plan.proposals.shape[1] if plan.proposals is not None else 0
        num = plan.num_proposed if plan.num_proposed is not None else np.zeros(n, np.int32)
        accepted = np.minimum(bonus % (num + 1), num).astype(np.int32)
        spec = np.full((n, k + 1), -1, np.int32)
        for i in range(n):
            a = accepted[i]
            spec[i, :a] = plan.proposals[i, :a] if a else []
            spec[i, a] = bonus[i]
        self.num_accepted += int(accepted.sum())
        return SamplerOutput(
            spec[:, 0], np.zeros(n), None, None,
            num_accepted=accepted, spec_tokens=spec, spec_logprobs=np.zeros((n, k + 1)),
        )  # fmt: skip

    def abort(self, i):
        group = self.groups[i % len(self.groups)]
        self.sched.abort(group)

    # -- invariants ------------------------------------------------------------------------
    def running(self):
        return [s for g in self.groups for s in g.seqs if s.status is SeqStatus.RUNNING]

    def page_chain(self, s) -> tuple[list, list]:
        """s's full pages: the page_hash chain of its own tokens (and cache salt), and each
        paging group's (hash, page tokens) of every page (_group_key, as patched)."""
        ps, salt = self.ps, s.group.cache_salt
        full = len(s.token_ids) // ps * ps
        tokens, chain, keys = self._chains.get(s.seq_id, ([], [], []))
        if s.token_ids[: len(tokens)] != tokens:
            tokens, chain, keys = [], [], []
        parent = chain[-1] if chain else None
        for i in range(len(tokens) // ps, full // ps):
            page = tuple(s.token_ids[i * ps : (i + 1) * ps])
            parent = scheduler_module.page_hash(parent, page, salt)
            chain.append(parent)
            for k in range(len(self.windows)):  # each group's own hash
                keys.append((scheduler_module._group_key(parent, salt, k)[0], page))
        self._chains[s.seq_id] = (s.token_ids[:full], chain, keys)
        return chain, keys

    def num_dead(self, start, group=0):
        """Pages of a group wholly before the first key a query at start reads."""
        return first_key(start, self.windows[group]) // self.ps

    def check_scheduled(self, plan: StepPlan):
        for seq_id, start, end in zip(
            plan.seq_ids.tolist(), plan.starts.tolist(), plan.context_lens.tolist()
        ):
            seq = self.sched.sequence(seq_id)
            assert seq.status is SeqStatus.RUNNING
            for g, pages in enumerate(seq.tables):
                assert len(pages) * self.ps >= end  # the step's writes have slots
                if self.paged:
                    assert len(pages) * self.ps - end <= self.ps - 1
                # Freed exactly: the pages no query from start reads (a fresh fork's row,
                # which computes nothing and samples from its parent's, shares its pages).
                k = self.num_dead(start, g) if end > start else pages.count(NULL_PAGE)
                assert pages[:k] == [NULL_PAGE] * k and NULL_PAGE not in pages[k:]
        assert plan.num_tokens <= self.sched.sched.max_num_batched_tokens

    def check(self):
        alloc, sched, ps = self.alloc, self.sched, self.ps
        running = self.running()
        assert sorted(s.seq_id for s in running) == sorted(s.seq_id for s in sched.running)
        # Reference counts == holders; free list == unreferenced pages.
        holders = collections.Counter(
            p for s in running for t in s.tables for p in t if p != NULL_PAGE
        )
        expected = np.zeros(alloc.num_pages, np.int64)
        for p, c in holders.items():
            expected[p] = c
        assert alloc.ref_counts.tolist() == expected.tolist()
        free = alloc.free_pages()
        assert len(free) == len(set(free)) == alloc.num_free()
        assert set(free) == {p for p in range(1, alloc.num_pages) if expected[p] == 0}
        # Page-table rows: free, running or reserved for forks, each exactly once.
        rows = [s.table_row for s in running] + sched._free_rows
        rows += [x for v in sched._reserved_rows.values() for x in v]
        assert sorted(rows) == list(range(sched.sched.max_num_seqs))
        stride = self.device.stride
        for s in running:
            assert 0 < s.num_computed_tokens <= s.num_tokens
            context = contexts(s.token_ids)
            assert len(s.tables) == len(self.windows)
            for g, pages in enumerate(s.tables):
                k = len(pages)
                assert self.device.page_table[g * stride + s.table_row, :k].tolist() == pages
                # Freed pages: a leading run, none that the next query reads.
                num_null = pages.count(NULL_PAGE)
                assert pages[:num_null] == [NULL_PAGE] * num_null
                assert num_null <= self.num_dead(s.num_computed_tokens, g)
                # Every position the next query reads holds its token and context id.
                first = first_key(s.num_computed_tokens, self.windows[g])
                pos = np.arange(first, s.num_computed_tokens)
                held = self.device.page_table[g * stride + s.table_row, pos // ps]
                slots = (held, pos % ps)
                assert self.device.kv[slots].tolist() == s.token_ids[first:s.num_computed_tokens]
                assert self.device.ctx[slots].tolist() == context[first:s.num_computed_tokens]
                if self.paged:
                    assert k == -(-s.num_computed_tokens // ps)  # waste <= page_size - 1
            # Its page hashes are the chain of its own full computed pages.
            assert len(s.page_hashes) <= s.num_computed_tokens // ps
            chain = self.page_chain(s)[0]
            assert s.page_hashes == chain[: len(s.page_hashes)]
            for i, h in enumerate(s.page_hashes):
                for g, pages in enumerate(s.tables):
                    entry = alloc.cached_entry(pages[i])
                    key = scheduler_module._group_key(h, s.group.cache_salt, g)  # as patched
                    assert entry is None or entry.hash == key[0]
        # Cached pages: the page holds the entry's tokens; the hash is a real prefix's chain.
        known = collections.defaultdict(set)  # hash -> page tokens (several if hashes collide)
        for g in self.groups:
            for s in g.seqs:
                for h, page_tokens in self.page_chain(s)[1]:
                    known[h].add(page_tokens)
        for page in range(alloc.num_pages):
            entry = alloc.cached_entry(page)
            if entry is None:
                continue
            assert page != NULL_PAGE
            assert self.device.kv[page].tolist() == list(entry.token_ids)
            assert entry.token_ids in known[entry.hash]
            parent = entry.parent[0] if entry.parent else None
            current = entry.parent is None or alloc.generation[parent] == entry.parent[1]
            found = alloc.lookup(entry.hash, entry.token_ids, parent=parent, salt=entry.salt)
            assert found == (page if current else None)
        assert alloc.num_cached() == len(alloc._by_hash)
        if self.swap is not None:
            self.check_swap()

    def pending_host_pages(self):
        """Host pages dropped but held until the next plan is complete (none here)."""
        return []

    def check_swap(self):
        """Host pages are held by the waiting swapped sequences only, and hold their tokens."""
        ps = self.ps
        seqs = [s for g in self.groups for s in g.seqs]
        swap_holders = collections.Counter(p for s in seqs for p in s.swap_pages)
        swap_holders.update(self.pending_host_pages())
        assert all(s.status is SeqStatus.WAITING for s in seqs if s.swap_pages)
        assert self.swap.ref_counts[1:].tolist() == [
            swap_holders[p] for p in range(1, self.swap.num_pages)
        ]
        for s in seqs:
            if s.status is not SeqStatus.WAITING:
                continue
            if not s.swap_pages:
                assert s.num_computed_tokens == 0  # recomputed
                continue
            num_pages = -(-s.num_computed_tokens // ps)
            context = contexts(s.token_ids)
            held = list(s.swap_pages)  # each group's window in turn
            for g in range(len(self.windows)):
                k = self.num_dead(s.num_computed_tokens, g)
                group_pages, held = held[: num_pages - k], held[num_pages - k :]
                assert len(group_pages) == num_pages - k
                for pos in range(k * ps, s.num_computed_tokens):
                    page = group_pages[pos // ps - k]
                    assert self.device.host[page, pos % ps] == s.token_ids[pos], (s.seq_id, pos)
                    assert self.device.host_ctx[page, pos % ps] == context[pos], (s.seq_id, pos)
            assert not held

    def drain_and_check_no_leaks(self):
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step([5, 6, 7])
            self.check()
        assert not self.sched.has_unfinished(), "requests did not finish: livelock"
        assert all(s.is_finished for g in self.groups for s in g.seqs)
        alloc = self.alloc
        assert alloc.num_used() == 0 and not alloc.ref_counts.any()
        assert sorted(alloc.free_pages()) == list(range(1, alloc.num_pages))
        assert sorted(self.sched._free_rows) == list(range(self.sched.sched.max_num_seqs))
        assert not self.sched._reserved_rows
        assert self.swap is None or self.swap.num_used() == 0


prompts = st.builds(
    lambda base, cut, suffix: base[:cut] + suffix,
    st.sampled_from(BASES),
    st.integers(0, 14),
    st.lists(st.integers(1, 9), max_size=6),
).filter(lambda p: 0 < len(p) < MAX_MODEL_LEN)


# Weights of the operations: admissions and steps dominate, frees and cache resets are rarer.
OPS = ["admit"] * 3 + ["step"] * 5 + ["abort", "reset_prefix_cache"]
# play_ops' strategies, built once: hypothesis validates a strategy object on its first draw
# (a new object each draw cost a third of an example's time); the draws are the same.
NUM_OPS, OP = st.integers(5, 40), st.sampled_from(OPS)
MAX_TOKENS, SALT = st.integers(1, 10), st.sampled_from([None, None, "tenant"])
STEP_TOKENS = st.lists(st.integers(0, 9), min_size=1, max_size=4)


@functools.cache
def integers(lo: int, hi: int):
    """st.integers(lo, hi), one object per bounds."""
    return st.integers(lo, hi)


def run_ops(data, kv_allocation, swap=False, spec=False, window=None, windows=None):
    ps = data.draw(st.sampled_from([1, 2, 4]), label="page_size")
    pages_per_seq = -(-MAX_MODEL_LEN // ps)
    max_num_seqs = data.draw(st.integers(1, 4), label="max_num_seqs")
    budget = data.draw(st.integers(max_num_seqs, 16), label="budget")
    if windows is not None:  # one sequence's most pages at once, over the groups
        config = EngineConfig(
            cache=CacheConfig(page_size=ps, num_pages=2, kv_allocation=kv_allocation),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      max_model_len=MAX_MODEL_LEN),
        )  # fmt: skip
        pages_per_seq = sequence_pages(config, windows, MAX_MODEL_LEN)
    h = Harness(
        page_size=ps,
        # From one sequence's worth of pages (heavy preemption) to room for about two.
        num_pages=data.draw(st.integers(pages_per_seq + 1, 2 * pages_per_seq), label="num_pages"),
        max_num_seqs=max_num_seqs,
        budget=budget,
        kv_allocation=kv_allocation,
        caching=data.draw(st.sampled_from([True, True, False]), label="caching"),
        # From too few host pages for one sequence (recompute fallbacks) to room for several.
        swap_pages=data.draw(st.integers(1, 3 * pages_per_seq), label="swap_pages") if swap else 0,
        spec=spec,
        window=window,
        windows=windows,
    )
    play_ops(h, data, max_num_seqs)
    return h


def play_ops(h, data, max_num_seqs: int, *, seed_by_group: bool = True) -> None:
    """Draws 5-40 operations (admit n <= max_num_seqs forks, step, abort, reset the prefix
    cache) and applies them to the harness h, checking every invariant after each; then
    drains h and checks that no page leaked. seed_by_group: each admission's seed is the
    number of groups admitted before it (else 0)."""
    for _ in range(data.draw(NUM_OPS, label="num_ops")):
        op = data.draw(OP)
        if op == "admit":
            prompt = data.draw(prompts)
            n = data.draw(integers(1, max_num_seqs))
            max_tokens = data.draw(MAX_TOKENS)
            salt = data.draw(SALT)
            h.admit(prompt, n, max_tokens, salt, seed=len(h.groups) if seed_by_group else 0)
        elif op == "step":
            h.step(data.draw(STEP_TOKENS))
        elif op == "abort" and h.groups:
            h.abort(data.draw(integers(0, len(h.groups) - 1)))
        elif op == "reset_prefix_cache":
            h.alloc.reset_prefix_cache()
        h.check()
    h.drain_and_check_no_leaks()


_SETTINGS = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@_SETTINGS
@given(st.data())
def test_paged_allocation_invariants_hold_for_random_operations(data):
    run_ops(data, "paged")


@settings(_SETTINGS, max_examples=200)
@given(st.data())
def test_reserve_allocation_invariants_hold_for_random_operations(data):
    run_ops(data, "reserve")


def max_waste_per_step(kv_allocation, page_size=8, steps=400):
    """A seeded mixed workload (shared prefixes, n = 3 forks, chunked prefill, preemption);
    returns the largest allocated-but-unfilled slot count of any running sequence, measured
    right after each schedule (counting the step's writes as filled) and after each commit."""
    rng = np.random.default_rng(0)
    h = Harness(page_size, 8, 4, 16, kv_allocation, True)
    worst = 0

    def waste(seq, filled):
        return len(seq.pages) * page_size - filled

    for i in range(steps):
        if rng.random() < 0.3:
            prompt = (
                BASES[2][: rng.integers(0, 15)] + rng.integers(1, 9, rng.integers(1, 8)).tolist()
            )
            n = 3 if rng.random() < 0.2 else 1
            h.admit(prompt, n, int(rng.integers(1, 10)), None, seed=i)
        plan = h.sched.schedule()
        for seq_id, end in zip(plan.seq_ids.tolist(), plan.context_lens.tolist()):
            worst = max(worst, waste(h.sched.sequence(seq_id), end))
        h.device.run(plan, h.sched)
        tokens = rng.integers(1, 9, len(plan)).astype(np.int32)
        h.sched.commit(plan, SamplerOutput(tokens, np.zeros(len(plan)), None, None))
        worst = max([worst] + [waste(s, s.num_computed_tokens) for s in h.running()])
        h.check()
    assert h.sched.num_preemptions > 0 and h.sched.prefix_cache_hit_tokens > 0
    h.drain_and_check_no_leaks()
    return worst


def test_waste_is_below_one_page_per_sequence_under_paged_and_not_under_reserve():
    assert max_waste_per_step("paged") == 7  # page_size - 1, reached and never exceeded
    assert max_waste_per_step("reserve") > 7


@settings(_SETTINGS, max_examples=300)
@given(st.data())
def test_swap_preemption_invariants_hold_for_random_operations(data):
    h = run_ops(data, data.draw(st.sampled_from(["paged", "paged", "reserve"])), swap=True)
    assert h.sched.num_swaps_in <= h.sched.num_swaps_out <= h.sched.num_preemptions


def _same_hash(parent, tokens, salt):
    return 0


def _tokens_only_hash(parent, tokens, salt):
    return hash(tokens)


@pytest.mark.parametrize("collide", [_same_hash, _tokens_only_hash])
def test_prefix_hits_stay_exact_when_every_hash_collides(monkeypatch, collide):
    monkeypatch.setattr(scheduler_module, "page_hash", collide)

    @settings(_SETTINGS, max_examples=300)
    @given(st.data())
    def run(data):
        run_ops(data, "paged")  # every computed position reads back its own token

    run()


def _exact_hash(parent, tokens, salt):
    return (parent, tokens, salt)  # equal only for equal prefixes and salts


def _window_tokens_key(h, salt, group):
    """Groups after the first keyed by their page tokens alone, blind to the prefix."""
    return (h, salt) if group == 0 else ((group, h[1]), (salt, group))


@pytest.mark.parametrize(
    ("page_hash", "group_key"),
    [(_tokens_only_hash, None), (_exact_hash, _window_tokens_key)],
    ids=["tokens-only", "window-tokens-only"],
)
def test_grouped_prefix_hits_stay_exact_when_hashes_collide(monkeypatch, page_hash, group_key):
    """Paging groups with every group's hashes blind to the prefix, or only the groups
    after the first (the first exact, so its hits reach pages whose window-group candidates
    were computed after another prefix): every key read was computed after the reader's
    own tokens (FakeDevice's context ids)."""
    monkeypatch.setattr(scheduler_module, "page_hash", page_hash)
    if group_key is not None:
        monkeypatch.setattr(scheduler_module, "_group_key", group_key)

    @settings(_SETTINGS, max_examples=200)
    @given(st.data())
    def run(data):
        window = st.one_of(st.none(), st.integers(1, MAX_MODEL_LEN + 2))
        windows = tuple(data.draw(st.lists(window, min_size=2, max_size=3), label="windows"))
        run_ops(data, "paged", windows=windows)

    run()


def test_a_crafted_collision_never_hits_another_tenants_page(monkeypatch):
    monkeypatch.setattr(scheduler_module, "page_hash", _tokens_only_hash)
    h = Harness(4, 16, 2, 16, "paged", True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    h.admit(prompt, 1, 1, "tenant-a", seed=0)
    h.step([5])
    assert h.alloc.num_cached() == 2
    h.admit(prompt, 1, 1, "tenant-b", seed=1)  # same tokens, same (crafted) hashes
    h.step([5])
    b = h.groups[1].seqs[0]
    assert b.group.num_cached_tokens == 0 and h.sched.prefix_cache_hit_tokens == 0
    h.admit(prompt, 1, 1, "tenant-a", seed=2)  # the same tenant does hit
    h.step([5])
    assert h.groups[2].num_cached_tokens == 8
    h.check()


@settings(_SETTINGS, max_examples=400)
@given(st.data())
def test_speculative_steps_keep_every_invariant(data):
    """Proposals verified in part: only verified positions count as computed, the rejected
    ones' pages go back, and prefix caching never registers a page of unverified tokens (a
    cached page always reads back its entry's tokens)."""
    h = run_ops(data, data.draw(st.sampled_from(["paged", "paged", "reserve"])),
                swap=data.draw(st.booleans()), spec=True)  # fmt: skip
    assert h.sched.num_preemptions >= h.sched.num_swaps_out


def test_speculative_steps_accept_and_reject():
    h = Harness(2, 40, 3, 16, "paged", True, spec=True)
    for i in range(6):
        h.admit([1, 2, 3, 4, 1, 2, 3][: 3 + i % 4], 1, 10, None, seed=i)
    for tokens in ([3, 2, 1], [7, 5, 2], [1, 1, 3], [2, 6, 5]) * 10:
        h.step(tokens)
        h.check()
    h.drain_and_check_no_leaks()
    assert h.num_accepted > 0 and h.num_steps > 0


@settings(_SETTINGS, max_examples=500)
@given(st.data())
def test_sliding_window_paging_keeps_every_invariant(data):
    """Every layer windowed (W from 1 to past max_model_len): pages before the window are
    freed as sequences move on, with forks, prefix hits, preemption (recompute or swap) and
    speculative rollback; every invariant above holds and nothing leaks."""
    window = data.draw(st.integers(1, MAX_MODEL_LEN + 2), label="window")
    run_ops(
        data,
        data.draw(st.sampled_from(["paged", "paged", "reserve"]), label="kv_allocation"),
        swap=data.draw(st.booleans(), label="swap"),
        spec=data.draw(st.booleans(), label="spec"),
        window=window,
    )


@settings(_SETTINGS, max_examples=500)
@given(st.data())
def test_paging_groups_keep_every_invariant(data):
    """Several paging groups (a model mixing attention kinds, models/kv_groups.py): each
    with no window or a window from 1 to past max_model_len, every invariant above in every
    group's table, with forks, prefix hits, preemption (recompute or swap) and speculative
    rollback, from one free list; nothing leaks."""
    window = st.one_of(st.none(), st.integers(1, MAX_MODEL_LEN + 2))
    windows = tuple(data.draw(st.lists(window, min_size=2, max_size=3), label="windows"))
    run_ops(
        data,
        data.draw(st.sampled_from(["paged", "paged", "reserve"]), label="kv_allocation"),
        swap=data.draw(st.booleans(), label="swap"),
        spec=data.draw(st.booleans(), label="spec"),
        windows=windows,
    )


def test_paging_groups_hit_a_prompt_whose_window_pages_slid():
    """A full group and a group of window 4 (pages of 2): a prompt of 7 decodes 8 tokens,
    its window group freeing pages 0-4 (positions 0-9); a second request of the same
    prompt still hits 3 pages (6 tokens): from 6 its window group reads keys 3.., so it
    needs only pages 1 and 2, prompt pages that stayed cached (NULL_PAGE at 0); a third
    hits the same."""
    h = Harness(2, 40, 2, 16, "paged", True, windows=(None, 4))
    prompt = [1, 2, 3, 4, 5, 6, 7]
    h.admit(prompt, 1, 8, None, seed=0)
    for _ in range(8):  # the prompt and its first token, then 7 decode steps
        h.step([5])
        h.check()
    first = h.groups[0].seqs[0]
    assert first.is_finished and first.num_output_tokens == 8
    for i in (1, 2):
        h.admit(prompt, 1, 2, None, seed=i)
        h.step([5])
        seq = h.groups[i].seqs[0]
        assert h.groups[i].num_cached_tokens == 6 and seq.tables[1][0] == NULL_PAGE
        assert NULL_PAGE not in seq.tables[1][1:] + seq.tables[0]
        h.check()
        h.drain_and_check_no_leaks()
    assert h.sched.prefix_cache_hit_tokens == 12
