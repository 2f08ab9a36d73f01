"""KVCacheManager: the one owner of every sequence's pages, in every paging group.

The Scheduler decides which sequences run and how many tokens each computes; this module
decides which pages hold them. It asks the PageAllocator (free list, reference counts, prefix
index) for pages, keeps each running sequence's page tables (Sequence.tables, page_hashes,
slid_pages, swap_pages: written here and nowhere else; read by step_plan.build and the draft
model), and records the edits of the device page table, the copy-on-write copies and the swap
copies that the next step must apply (`pending` holds them, `take_edits` hands them to the
plan: no other buffer holds a page edit). The Scheduler calls it with sequences and token
counts (can_allocate / allocate / allocate_slots / free / fork / preempt) and never reads or
writes a page id; rows of the device table (Sequence.table_row) are the Scheduler's.

Device rows: group g's rows of the device table are g * (max_num_seqs + 1) + row; row
max_num_seqs of each block is a scratch row that padding writes go to.

Memory: pages are taken for exactly the tokens computed in the step ("paged"), or for the
whole prompt + max_tokens at admission ("reserve", a contiguous-allocation server's policy,
kept for comparison). When pages run out, the most recently admitted running sequences are
preempted: their pages are freed and they are recomputed later (the prefix cache usually
serving most of it), or, with preemption_mode="swap", their computed K/V is first copied to
host swap pages (a second PageAllocator, without prefix caching) and copied back into fresh
private pages on resumption, num_computed_tokens kept; a full swap space falls back to
recompute. The plan names the copies; the runner moves the data, swap-outs before swap-ins
before the step, so a page freed and reused within one plan is read before it is written.
A write into a page shared with another sequence copies it first (copy-on-write).

Host tier (host_store, jpaged/core/host_page_store.py; one full group only): the allocator
records the cached pages it hands out anew, and take_edits names their copies to host pages
(swap_out) before the plan's swap-ins and step; a prefix lookup goes on in the host store
after the device's last hit (_host_hits), and admission loads those pages into fresh ones
(swap_in) and caches them on the device again. Page hashes are then the store's sha256 chain.

Sessions (jpaged/core/session_pages.py): the cached pages a sequence of an active session
frees (free) are kept for it in the allocator, and the host pages its evicted or loaded
pages take are kept for it in the host store: both evicted after every other free page.
take_edits releases the pages of the sessions whose idle time has passed.

Sliding windows (`sliding_window` W, given when every layer of the model sees only the last
W keys): a step whose first query is at position `start` reads no key before
start - W + 1, and later steps read even less, so each plan frees a running sequence's pages
wholly before that key and points their page-table entries at the null page, which the
kernels never read (they skip key blocks outside the window). A sequence then holds at most
ceil(W / page_size) + 1 pages while decoding. Its `pages` keep their positions: a freed page's
entry is NULL_PAGE (always a leading run). A freed page leaves the prefix cache (forget=True:
a hit needs every page from the first, see below); a page is registered only while it and
its parent are held. Swap preemption copies only the
held pages, and a swapped sequence comes back into fresh pages for its window only:

    position     0 ..  ps*k - 1 | ps*k .. start - W | start - W + 1 .. start + n - 1
    pages        NULL_PAGE       | page k (held)     | held pages
                 (k = max(start - W + 1, 0) // ps: the pages wholly before the first key read)

Paging groups (`group_windows`, a model mixing attention kinds: models/kv_groups.py): each
group of layers has its own page table per sequence (Sequence.tables; group g's rows of the
device table are g * (max_num_seqs + 1) + row) and its own window or none, and the rules
above apply to each table: a full group keeps every page, a windowed group frees the pages
before its window. All groups' pages come from the one allocator: a step, an admission or a
swap needs the sum over the groups, and a prefix hit of L pages takes L positions in every
group, each group's cached under hashes and a salt of its own (_group_key). With a full
first group (every mixed model: models/kv_groups.py puts full attention first) the other
groups' pages are anchored to it: group g's page i is cached with the full group's page i
as its parent, whose own chain vouches for every token before it (the allocator's
exactness holds), so a hit needs in group g only the pages that a query at L * page_size
still sees, positions dead_g(L) .. L - 1, NULL_PAGE before them (vLLM's right-to-left rule:
_anchored_hits), and a window page that slid out stays cached while it can serve one
(slide says which). Without a full group (every group windowed) hits are chained: every
page from the first in each group, each after its group's previous one, so they end where a
group's pages were freed, and freed pages leave the cache.

Why one windowed group (Mistral with sliding_window, CacheConfig.free_window_pages) keeps
the chained rule: the right-to-left rule takes page dead(L) without the pages before it,
so nothing held vouches for its prefix but its hash. A cryptographic chain (hashlib.blake2b
of the parent digest, tokens and salt) would make that exact up to a digest collision, but
the allocator's promise (a collision, even a crafted one, costs a miss) would become one
about blake2b, and its collision tests could not hold for such models; blake2b (16-byte
digest) costs 1.0 us per page of 16 tokens against 0.18 us for hash() (2.4 and 0.35 us at
64; Python 3.11 on the 2-core machine). Such a model's prompt is hit again only while its
first page is cached: still held, or freed before it slid.
"""

from __future__ import annotations

import dataclasses
import math

from jpaged.config import EngineConfig
from jpaged.core.host_page_store import HostPageStore
from jpaged.core.page_allocator import NULL_PAGE, PageAllocator, page_hash
from jpaged.core.sequence import Sequence
from jpaged.core.session_pages import Sessions


def _group_key(h: int, salt, group: int) -> tuple[int, object]:
    """The prefix-cache hash and salt of a page of paging group `group` whose first
    group's hash is h: the first group's own, the others' their own (a page id holds one
    group's layers, and a lookup must find only its group's pages)."""
    if group == 0:
        return h, salt
    return hash((h, group)), (salt, group)


def sequence_pages(config: EngineConfig, windows: tuple[int | None, ...], num_tokens: int) -> int:
    """The most pages a sequence of num_tokens tokens holds at once, summed over the paging
    groups: every page in a full group (and in every group with kv_allocation "reserve"), in a
    group of window W at most the pages of its first query's window and one step's tokens,
    ceil((W - 1 + max_num_batched_tokens) / page_size) + 1 (W - 1 + n positions straddle at
    most that many pages)."""
    ps = config.cache.page_size
    every = -(-num_tokens // ps)
    reserve = config.cache.kv_allocation == "reserve"
    step = config.scheduler.max_num_batched_tokens
    capped = [min(every, -(-(w - 1 + step) // ps) + 1) for w in windows if w is not None]
    return every * (len(windows) - len(capped)) + (every * len(capped) if reserve else sum(capped))


@dataclasses.dataclass(frozen=True)
class Admission:
    """What admitting a waiting sequence takes (KVCacheManager.can_allocate): it starts with
    `num_computed_tokens` (a prefix hit, or its swapped-out K/V), computes `num_new_tokens`
    this step, takes `hits[g]` (cached pages, NULL_PAGE before the window) and `needs[g]`
    fresh pages in each group g."""

    num_computed_tokens: int
    num_new_tokens: int
    hits: tuple[tuple[int, ...], ...]  # per group: cached pages (NULL_PAGE before the window)
    dead: tuple[int, ...]  # per group: leading pages no query of the step reads
    needs: tuple[int, ...]  # per group: fresh pages to allocate
    swapped: bool  # its K/V comes back from host swap pages
    # per group, the host-tier hits after the device hits: host pages to load (_host_hits)
    loads: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class PageEdits:
    """One step's page work, in the order the runner applies it: swap-outs, swap-ins, then
    the copies (copy-on-write) and the device page-table edits."""

    updates: list[tuple[int, int, int]]  # (device row, column, page): int32 triples
    copies: list[tuple[int, int]]  # (source page, destination page)
    swap_out: list[tuple[int, int]]  # (device page, host swap page)
    swap_in: list[tuple[int, int]]  # (host swap page, device page)


class KVCacheManager:
    def __init__(
        self,
        config: EngineConfig,
        allocator: PageAllocator,
        windows: tuple[int | None, ...],
        *,
        swap_allocator: PageAllocator | HostPageStore | None = None,
        host_store: HostPageStore | None = None,
    ) -> None:
        """windows: one sliding window (or None, a full group) per paging group.
        swap_allocator: host swap pages (preemption_mode "swap"), else None. host_store: the
        host tier of the prefix cache (jpaged/core/host_page_store.py), used with one full
        group only; None: evicted pages are dropped."""
        self.config = config
        self.sched = config.scheduler
        self.page_size = config.cache.page_size
        self.allocator = allocator
        self.swap_allocator = swap_allocator
        self.windows = windows
        self.num_groups = len(windows)
        # A full first group beside others (models/kv_groups.py puts full attention first):
        # the other groups' cached pages are anchored to its pages (module docstring).
        self._anchored = len(windows) > 1 and windows[0] is None
        self._paged = config.cache.kv_allocation == "paged"
        self._group_stride = self.sched.max_num_seqs + 1
        # The edits the next plan applies (take_edits): page-table writes and copy-on-write
        # copies wait for a plan with rows; swap copies go with the next plan.
        self._updates: list[tuple[int, int, int]] = []
        self._copies: list[tuple[int, int]] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.num_swaps_out = 0  # preemptions that swapped (the others recompute)
        self.num_swaps_in = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        # The host tier: page hashes become its sha256 digests, and the allocator records
        # the cached pages it hands out anew, copied to the host by take_edits.
        self._store = host_store  # its pages named by a plan are released by take_edits
        self.host = host_store if host_store is not None and host_store.offload else None
        # The tier needs every group's pages anchored to a full first group (or one full group).
        if self.host is not None and (
            (windows != (None,) and not self._anchored) or not allocator.enable_prefix_caching
        ):
            self.host = None
        self._page_hash = page_hash if self.host is None else self.host.page_hash
        self.sessions = Sessions(config.cache.session_idle_seconds)
        if self.host is not None:
            allocator.evicted = []

    # -- queries ---------------------------------------------------------------------------
    def num_free_pages(self) -> int:
        return self.allocator.num_free()

    def unservable(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of num_prompt_tokens could never get its pages with nothing else
        running, or None."""
        # One group counts every page, as before groups: a windowed group of several is
        # counted at its cap (sequence_pages), which the engine's pool check counts too.
        windows = self.windows if self.num_groups > 1 else (None,)
        need = sequence_pages(self.config, windows, num_prompt_tokens + 1)
        if need > self.allocator.num_usable_pages:
            return (
                f"prompt of {num_prompt_tokens} tokens needs {need} KV pages of "
                f"{self.page_size} tokens with its first generated token; the pool has "
                f"{self.allocator.num_usable_pages}"
            )
        return None

    def pending(self) -> PageEdits:
        """The edits made since the last plan took them (read-only view)."""
        return PageEdits(self._updates, self._copies, self._swap_out, self._swap_in)

    def take_edits(self, has_rows: bool) -> PageEdits:
        """The edits the next plan applies. A plan without rows is not dispatched: its
        page-table edits and copies wait for the next plan (its swaps go now). One plan's
        edits are one scatter on the device, where the order of two writes of one entry is
        not defined: only the last edit of each entry is kept (a beam forked into a row since
        the last plan and copying its shared last page in this one)."""
        for session in self.sessions.expire():
            self.allocator.release_session(session)
            if self._store is not None:
                self._store.pages.release_session(session)
        self._offload_evicted()
        if has_rows:
            updates = list({(r, c): (r, c, p) for r, c, p in self._updates}.values())
            edits = PageEdits(updates, self._copies, self._swap_out, self._swap_in)
            self._updates, self._copies = [], []
        else:
            edits = PageEdits([], [], self._swap_out, self._swap_in)
        self._swap_out, self._swap_in = [], []
        if self._store is not None:
            self._store.end_plan(len(edits.swap_out), len(edits.swap_in))
        return edits

    def _offload_evicted(self) -> None:
        """The device cache's pages handed out anew since the last plan are copied to the
        host tier (before this plan's swap-ins and step, which may rewrite them)."""
        if self.host is None:
            return
        for page, entry, session in self.allocator.evicted:
            session = session if self.sessions.is_active(session) else None
            host_page = self.host.offload_page(entry.hash, entry.token_ids, entry.salt, session)
            if host_page is not None:
                self._swap_out.append((page, host_page))
        self.allocator.evicted.clear()

    def restart(self) -> None:
        """Drops every pending edit and the prefix cache (the device state was made anew;
        every sequence's pages were freed), the host tier's too."""
        self._updates, self._copies, self._swap_out, self._swap_in = [], [], [], []
        self.allocator.reset_prefix_cache()
        if self._store is not None:
            self._store.restart()

    # -- admission -------------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, budget: int, reserved: int | None = None
    ) -> Admission | None:
        """What admitting the waiting seq with at most `budget` new tokens takes, or None when
        the pages (or, without chunked prefill, the budget) do not allow it. Changes nothing
        but seq.page_hashes (its prefix hit's).

        reserved (a sequence preempted by recompute, others running: pages_to_come of
        them): the pages of seq's whole context (every token it holds) must be free beside
        them, not only its first chunk's. Re-admitted chunk by chunk into a pool that cannot
        finish it beside the running ones, it is preempted again and its pages taken by
        theirs, over and over (issue 54's 4-session run: 117 preemptions in one turn);
        waiting until it fits computes it once more at most."""
        swapped = bool(seq.swap_pages)
        groups = range(self.num_groups)
        loads: tuple[tuple[int, ...], ...] = ()
        if swapped:  # its computed K/V comes back from host into fresh pages
            hits, computed = [[] for _ in groups], seq.num_computed_tokens
        elif (
            seq.params.prompt_logprobs is not None or seq.group.pooler is not None
        ) and seq.num_output_tokens == 0:
            hits, computed = [[] for _ in groups], 0  # prompt logprobs, embeddings: every token
        else:
            if self.host is not None and self._anchored:
                hits, loads = self._tiered_hits(seq)
            else:
                hits = self._prefix_hits(seq)
                loads = self._host_hits(seq, len(hits[0]))
            computed = (len(hits[0]) + len(loads[0] if loads else ())) * self.page_size
        num_new = min(seq.num_tokens - computed, budget)
        if num_new < seq.num_tokens - computed and not self.sched.enable_chunked_prefill:
            return None
        if self.config.cache.kv_allocation == "reserve":
            total = seq.num_prompt_tokens + (seq.params.max_tokens or self.sched.max_model_len)
            upto = min(max(total, seq.num_tokens), self.sched.max_model_len)
        else:
            upto = computed + num_new
        # Per group: hit pages wholly before the window of the first query are not taken
        # (NULL_PAGE); a swapped sequence's pages before its window were not swapped out
        # (preempt). The pages every group needs come from the one free list.
        dead = [self._num_dead_pages(computed, g) for g in groups]
        for g in groups:
            hits[g] = [NULL_PAGE] * min(dead[g], len(hits[g])) + hits[g][dead[g] :]
        revived = sum(
            1 for g in groups for p in hits[g][dead[g] :] if self.allocator.ref_counts[p] == 0
        )
        needs = [math.ceil(upto / self.page_size) - max(len(hits[g]), dead[g]) for g in groups]
        free = self.allocator.num_free() - revived
        if sum(needs) > free:
            return None
        if reserved is not None and self.config.cache.kv_allocation != "reserve":
            held = sum(1 for g in groups for p in hits[g] if p != NULL_PAGE)
            whole = sequence_pages(self.config, self.windows, seq.num_tokens) - held
            if max(whole, sum(needs)) + reserved > free:
                return None
        return Admission(
            computed,
            num_new,
            tuple(map(tuple, hits)),
            tuple(dead),
            tuple(needs),
            swapped,
            loads,
        )

    def pages_to_come(self, seqs) -> int:
        """The pages the running seqs still take for tokens they hold but have no slot for
        yet (prompts' later chunks; a decode's next page is not counted)."""
        ps, total = self.page_size, 0
        for seq in seqs:
            if all(len(t) * ps >= seq.num_tokens for t in seq.tables):
                continue  # every token it holds has its slot
            held = sum(1 for t in seq.tables for p in t if p != NULL_PAGE)
            total += max(sequence_pages(self.config, self.windows, seq.num_tokens) - held, 0)
        return total

    def allocate(self, seq: Sequence, admission: Admission) -> None:
        """Gives the admitted seq (its table_row set) its pages: the cached hits, then fresh
        ones (into which a swapped sequence's K/V is copied back); sets its computed tokens."""
        groups = range(self.num_groups)
        hits, dead, computed = admission.hits, admission.dead, admission.num_computed_tokens
        for g in groups:
            for p in hits[g][dead[g] :]:
                self.allocator.take_cached(p)
        seq.num_computed_tokens = computed
        seq.tables = [[] for _ in groups]
        swap_pages = list(seq.swap_pages)
        for g in groups:
            self._append_pages(seq, list(hits[g]) + [NULL_PAGE] * (dead[g] - len(hits[g])), g)
            pages = self.allocator.allocate(admission.needs[g])
            self._append_pages(seq, pages, g)
            if admission.loads:
                self._load(seq, admission.loads[g], g, computed // self.page_size)
            if admission.swapped:  # group g's swapped pages: those of positions dead[g] ..
                num_swapped = math.ceil(computed / self.page_size) - dead[g]
                self._swap_in.extend(zip(swap_pages[:num_swapped], pages))
                del swap_pages[:num_swapped]
        if admission.swapped:
            self.drop_swap(seq)
            self.num_swaps_in += 1
            return
        if seq.num_output_tokens == 0 and seq.index == 0:
            seq.group.num_cached_tokens = computed
        self.prefix_cache_query_tokens += seq.num_tokens
        self.prefix_cache_hit_tokens += computed

    # -- running sequences -----------------------------------------------------------------
    def preempt(self, seq: Sequence, *, allow_swap: bool = True) -> bool:
        """Frees a running sequence's pages, first copying its computed pages out to host swap
        pages when swap is configured, allowed, the host has room and it has a token left to
        compute (a resumed sequence must have one, to sample from). Returns whether it
        swapped (its computed tokens are kept; otherwise it is recomputed from scratch)."""
        self.slide(seq)
        num_pages = math.ceil(seq.num_computed_tokens / self.page_size)
        dead = [
            min(self._num_dead_pages(seq.num_computed_tokens, g), num_pages)
            for g in range(self.num_groups)
        ]
        num_swapped = num_pages * self.num_groups - sum(dead)
        swap = (
            allow_swap
            and self.swap_allocator is not None
            and 0 < seq.num_computed_tokens < seq.num_planned_tokens
            and self.swap_allocator.can_allocate(num_swapped)
        )
        if swap:
            # Every held page is copied, shared ones too: it comes back into private pages.
            # swap_pages: each group's held pages in turn (allocate splits them the same way).
            seq.swap_pages = self.swap_allocator.allocate(num_swapped)
            held = [p for g, t in enumerate(seq.tables) for p in t[dead[g] : num_pages]]
            self._swap_out.extend(zip(held, seq.swap_pages))
            self.num_swaps_out += 1
        self.free(seq)
        return swap

    def commit_verified(self, seq: Sequence, verified: int, num_proposed: int) -> None:
        """A speculative step verified seq's first `verified` positions: the pages past them
        (rejected proposals' K/V) go back to the pool, in every group, and the verified full
        pages are cached."""
        needed = -(-verified // self.page_size)
        if num_proposed and self._paged:
            for table in seq.tables:  # the rejected proposals' pages, in every group
                if len(table) > needed:
                    self.allocator.free(table[needed:][::-1])
                    del table[needed:]
        self.cache_full_pages(seq, verified)

    def allocate_slots(self, seq: Sequence, num_new: int) -> bool:
        """Makes seq's pages cover the step's writes in every group; False (nothing changed)
        if pages lack."""
        first = seq.num_computed_tokens // self.page_size
        last = (seq.num_computed_tokens + num_new - 1) // self.page_size
        shared = [
            [i for i in range(first, min(last + 1, len(t))) if self.allocator.ref_counts[t[i]] > 1]
            for t in seq.tables
        ]
        needs = [max(0, last + 1 - len(t)) for t in seq.tables]
        if not self.allocator.can_allocate(sum(needs) + sum(map(len, shared))):
            return False
        for g, table in enumerate(seq.tables):
            for i in shared[g]:
                (new,) = self.allocator.allocate(1)
                self._copies.append((table[i], new))
                self.allocator.free([table[i]])
                table[i] = new
                self._updates.append((self._device_row(seq, g), i, new))
            self._append_pages(seq, self.allocator.allocate(needs[g]), g)
        return True

    def _session(self, seq: Sequence) -> str | None:
        """seq's session while it is active, else None."""
        session = seq.group.session
        return session if self.sessions.is_active(session) else None

    def _device_row(self, seq: Sequence, group: int) -> int:
        """seq's row of the device table in a group's block of rows."""
        return group * self._group_stride + seq.table_row

    def _append_pages(self, seq: Sequence, pages: list[int], group: int = 0) -> None:
        table, row = seq.tables[group], self._device_row(seq, group)
        for p in pages:
            self._updates.append((row, len(table), p))
            table.append(p)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child's page tables (its table_row set): every page of the parent in every
        group, shared (freed ones stay NULL_PAGE; a write into a shared partly filled page
        copies it first, in allocate_slots). The child's page hashes are the parent's."""
        child.page_hashes = list(parent.page_hashes)
        child.tables = [[] for _ in parent.tables]
        for g, table in enumerate(parent.tables):
            for p in table:
                if p != NULL_PAGE:
                    self.allocator.share(p)
            self._append_pages(child, list(table), g)

    def _num_dead_pages(self, start: int, group: int = 0) -> int:
        """Leading pages of a group that no query at position >= start reads: those wholly
        before the key start - W + 1 (0 for a group without a sliding window)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(start - window + 1, 0) // self.page_size

    def slide(self, seq: Sequence) -> None:
        """Frees seq's held pages wholly before the window of its next query (position
        num_computed_tokens) in each windowed group and points their page-table entries at
        the null page. The step in flight, if any, may still read them: it runs on the
        device before any step that writes them for their next owner.

        Which freed pages stay in the prefix cache (free, handed out in LRU order): where
        hits are chained (_chained_hits) none (a hit needs every page from the first), nor
        with a window of 1 (a hit needs no page of it). Where they are anchored, any page of
        position j can serve a hit ending within the window after it, and which will be
        asked for is a guess: vLLM keeps all, but then every window group's pages cycle
        through the whole free list (a decode frees one per group every page_size tokens),
        and the pages it takes from the front evict the other cached pages (1 + the window
        groups times as fast: 6x for Gemma 3). Kept here: the prompt's pages (the same
        prompt again, or one sharing a part of it), and the last generated page freed, until
        the next slide (the page a hit on the whole sequence can need before the window
        held at its end: a recompute after preemption, or the next turn of a chat; the
        pages held at the end are freed cached by free). The other generated pages
        serve only a prompt that has this output up to them and then differs: forgotten,
        and reused first as before."""
        ps = self.page_size
        for g, table in enumerate(seq.tables):
            dead = min(self._num_dead_pages(seq.num_computed_tokens, g), len(table))
            i = dead
            while i > 0 and table[i - 1] != NULL_PAGE:
                i -= 1
            if i == dead:
                continue
            if not self._anchored or self.windows[g] < 2:
                self.allocator.free(table[i:dead], forget=True)
            else:
                # Under async scheduling the prompt's last step may be in flight, its pages
                # not yet registered (commit): register them before they leave the table.
                self.cache_full_pages(seq, min(seq.num_computed_tokens, seq.num_prompt_tokens))
                prompt_end = min(max(seq.num_prompt_tokens // ps, i), dead)
                self.allocator.free(table[i:prompt_end])
                if prompt_end < dead:
                    self.allocator.free(table[prompt_end : dead - 1], forget=True)
                    last = table[dead - 1]
                    self.allocator.free([last])
                    if g in seq.slid_pages:
                        self.allocator.forget(*seq.slid_pages[g])
                    seq.slid_pages[g] = (last, int(self.allocator.generation[last]))
            row = self._device_row(seq, g)
            for j in range(i, dead):
                table[j] = NULL_PAGE
                self._updates.append((row, j, NULL_PAGE))

    def drop_swap(self, seq: Sequence) -> None:
        if seq.swap_pages:
            self.swap_allocator.free(seq.swap_pages)
            seq.swap_pages = []

    def free(self, seq: Sequence) -> None:
        """Frees a sequence's pages (tail first). Its device rows keep stale entries until the
        rows' next owner overwrites them; nothing reads past a sequence's context length."""
        # Tail first across the groups, so a prefix outlives its suffix in every group.
        longest = max(len(t) for t in seq.tables)
        self.allocator.free([
            t[i] for i in range(longest - 1, -1, -1) for t in seq.tables
            if i < len(t) and t[i] != NULL_PAGE
        ], session=self._session(seq))  # fmt: skip
        seq.tables = [[] for _ in range(self.num_groups)]
        seq.page_hashes = []
        seq.slid_pages = {}  # the last ones stay cached: a hit on the whole sequence needs them

    def cache_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Registers the full pages among seq's first num_tokens (computed) tokens."""
        if not self.allocator.enable_prefix_caching:
            return
        ps, salt = self.page_size, seq.group.cache_salt
        parent = seq.page_hashes[-1] if seq.page_hashes else None
        for i in range(len(seq.page_hashes), num_tokens // ps):
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            h = self._page_hash(parent, tokens, salt)
            for g, table in enumerate(seq.tables):
                if g and self._anchored:  # the full group's page vouches for the prefix
                    prev = seq.tables[0][i]
                else:
                    prev = table[i - 1] if i else None
                if table[i] == NULL_PAGE or prev == NULL_PAGE:  # freed: see slide
                    continue
                group_hash, group_salt = self._group_key(h, salt, g)
                self.allocator.cache_page(
                    table[i], group_hash, tokens, parent=prev, salt=group_salt
                )
            seq.page_hashes.append(h)
            parent = h

    def _prefix_hits(self, seq: Sequence) -> list[list[int]]:
        """Per group, the pages of the longest prefix hit of L full pages (at least one token
        is left to compute, so the step has a hidden state to sample from), L positions in
        every group: a hit serves every layer or none. The first group's are its leading
        cached pages, each found after the one before; the other groups' come from
        _anchored_hits or _chained_hits (module docstring), NULL_PAGE where not needed."""
        first = self._device_chain(seq)
        if self._anchored:
            hits = self._anchored_hits(seq, first)
        else:
            hits = self._chained_hits(seq, first)
        del seq.page_hashes[len(hits[0]) :]
        return hits

    def _device_chain(self, seq: Sequence) -> list[int]:
        """The first group's leading cached pages of seq (each found after the one before,
        leaving a token to compute); seq.page_hashes becomes their hashes."""
        ps, salt = self.page_size, seq.group.cache_salt
        first: list[int] = []
        seq.page_hashes = []
        parent = None
        for i in range((seq.num_tokens - 1) // ps):
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            h = self._page_hash(parent, tokens, salt)
            page = self.allocator.lookup(h, tokens, parent=first[-1] if first else None, salt=salt)
            if page is None:
                break
            first.append(page)
            seq.page_hashes.append(h)
            parent = h
        return first

    def _host_hits(self, seq: Sequence, num_device_hits: int) -> tuple[tuple[int, ...], ...]:
        """(the host tier's pages of seq's full pages after its num_device_hits device hits,)
        (each found after the one before, leaving a token to compute), their hashes appended
        to seq.page_hashes; () without the tier."""
        if self.host is None:
            return ()
        ps, salt = self.page_size, seq.group.cache_salt
        parent = seq.page_hashes[-1] if seq.page_hashes else None
        found: list[int] = []
        for i in range(num_device_hits, (seq.num_tokens - 1) // ps):
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            h = self.host.page_hash(parent, tokens, salt)
            page = self.host.lookup(h, tokens, salt)
            if page is None:
                break
            found.append(page)
            seq.page_hashes.append(h)
            parent = h
        return (tuple(found),)

    def _tiered_hits(self, seq: Sequence):
        """(hits, loads) per group with the host tier and a full first group: the largest L
        at which, in every group g > 0, the pages of positions dead_g(L) .. L - 1 are device
        hits (anchored to the first group's, as _anchored_hits) up to some k and host hits
        from k; the first group's device hits, then its host hits, to L. A window group thus
        loads from host only the pages of its window at L."""
        first = self._device_chain(seq)
        host0 = self._host_hits(seq, len(first))[0]
        num_first, ps, salt = len(first), self.page_size, seq.group.cache_salt
        device: dict[tuple[int, int], int | None] = {}
        host: dict[tuple[int, int], int | None] = {}

        def on_device(g: int, i: int) -> int | None:
            if (g, i) not in device:
                device[g, i] = self._group_lookup(seq, g, i, first[i])
            return device[g, i]

        def on_host(g: int, i: int) -> int | None:
            if (g, i) not in host:
                h, group_salt = self._group_key(seq.page_hashes[i], salt, g)
                tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
                host[g, i] = self.host.lookup(h, tokens, group_salt)
            return host[g, i]

        for end in range(num_first + len(host0), -1, -1):
            parts = []
            for g in range(1, self.num_groups):
                low = k = self._num_dead_pages(end * ps, g)
                while k < min(end, num_first) and on_device(g, k) is not None:
                    k += 1
                if any(on_host(g, i) is None for i in range(k, end)):
                    break
                parts.append((low, k))
            else:
                break
        hits = [first[: min(end, num_first)]]
        loads = [tuple(host0[: max(end - num_first, 0)])]
        for g, (low, k) in enumerate(parts, start=1):
            hits.append([NULL_PAGE] * low + [device[g, i] for i in range(low, k)])
            loads.append(tuple(host[g, i] for i in range(k, end)))
        del seq.page_hashes[end:]
        return hits, tuple(loads)

    def _load(self, seq: Sequence, loads: tuple[int, ...], group: int, end: int) -> None:
        """Names the copies of group `group`'s host hits into seq's fresh pages of positions
        end - len(loads) .. end - 1 and caches those pages on the device, anchored as
        cache_full_pages does (the copies precede every step that reads them: swap_in)."""
        table, ps, salt = seq.tables[group], self.page_size, seq.group.cache_salt
        for i, host_page in enumerate(loads, start=end - len(loads)):
            self._swap_in.append((host_page, table[i]))
            self.host.load(host_page, self._session(seq), count=group == 0)
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            h, group_salt = self._group_key(seq.page_hashes[i], salt, group)
            parent = seq.tables[0][i] if group else (table[i - 1] if i else None)
            self.allocator.cache_page(table[i], h, tokens, parent=parent, salt=group_salt)

    def _group_key(self, h: int, salt, group: int) -> tuple[int, object]:
        """_group_key, with the host tier's sha256 digests for the other groups' pages (keys
        a disk file can name, exact up to a sha256 collision)."""
        if group == 0 or self.host is None:
            return _group_key(h, salt, group)
        return self.host.page_hash(h, (), ("group", group)), (salt, group)

    def _group_lookup(self, seq: Sequence, group: int, i: int, parent: int | None) -> int | None:
        """Group `group`'s cached page of seq's page i, cached after exactly `parent` (under
        the group's own hash and salt: _group_key)."""
        h, group_salt = self._group_key(seq.page_hashes[i], seq.group.cache_salt, group)
        tokens = tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size])
        return self.allocator.lookup(h, tokens, parent=parent, salt=group_salt)

    def _chained_hits(self, seq: Sequence, first: list[int]) -> list[list[int]]:
        """Every group needs every page from the first, each after its group's previous one:
        the hit ends where any group's pages were freed."""
        found = [first]
        for g in range(1, self.num_groups):
            group_hits: list[int] = []
            for i in range(len(first)):
                page = self._group_lookup(seq, g, i, group_hits[-1] if group_hits else None)
                if page is None:
                    break
                group_hits.append(page)
            found.append(group_hits)
        num_hits = min(len(x) for x in found)
        return [x[:num_hits] for x in found]

    def _anchored_hits(self, seq: Sequence, first: list[int]) -> list[list[int]]:
        """The largest L <= len(first) such that every group g > 0 has the pages of positions
        dead_g(L) .. L - 1 cached, each anchored to the first group's hit at its position
        (the pages a query at L * page_size can still see; NULL_PAGE before them). Searched
        from the right (vLLM's hybrid rule): a miss at position i in any group rules out
        every L > i (i is inside each such L's window, dead_g being monotone), so L drops to
        i and the groups are checked again; each position is looked up once per group.

            positions   0 .. dead_g(L) - 1 | dead_g(L) .. L - 1 | L ..
            group 0     hits               | hits               | computed
            group g     NULL_PAGE          | hits (anchored)    | computed
        """
        ps = self.page_size
        num_hits = len(first)
        found: list[dict[int, int | None]] = [{} for _ in range(self.num_groups)]
        settled = False
        while not settled:
            settled = True
            for g in range(1, self.num_groups):
                i = num_hits - 1
                while i >= self._num_dead_pages(num_hits * ps, g):
                    if i not in found[g]:
                        found[g][i] = self._group_lookup(seq, g, i, first[i])
                    if found[g][i] is None:
                        num_hits, settled = i, False  # every group's window moves with L
                    i -= 1
        hits = [first[:num_hits]]
        for g in range(1, self.num_groups):
            dead = self._num_dead_pages(num_hits * ps, g)
            hits.append([NULL_PAGE] * dead + [found[g][i] for i in range(dead, num_hits)])
        return hits
