"""Host-side scheduler: continuous batching over a paged KV cache.

The scheduler owns the waiting and running queues, the rows of the device page table and the
host page tables (each running Sequence's `pages`: nothing else writes them); the
PageAllocator owns pages. Each `schedule()` returns one frozen StepPlan of plain arrays
(jpaged/worker/step_plan.py); `commit()` takes the sampled tokens back.

Async scheduling: `dispatched(plan)` marks a plan's tokens computed as soon as the step is on
the device and gives each sampling row a placeholder (Sequence.num_placeholders) unless the
token certainly ends the sequence (max_tokens, max_model_len), so the next plan is made before
this one's tokens are known; its rows read those tokens on the device. `commit()` then turns
placeholders into tokens. A sequence that stops at commit has its row in the next plan (already
on the device) dropped there; that row writes only slots past the sequence's length into pages
freed at the stop, before any later step can write them (device order).

One rule drives everything (vLLM v1): each step gives every running sequence as many of its
uncomputed tokens as the token budget allows. A decode is one token; a prompt is many
(chunked when it exceeds the budget); a prefix-cache hit starts with num_computed_tokens > 0.

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
(_slide says which). Without a full group (every group windowed) hits are chained: every
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

Liveness: the oldest running sequence is never preempted (victims are the newest) and, since
the pool holds one sequence of max_model_len tokens (`sequence_pages` with groups; the engine
checks it at start; a request
that could never fit is refused by `unservable` before it is queued), it computes at least one
token every step and ends within max_model_len + 1 steps; with nothing running, the waiting
head is admitted in the same step. Admission has no head-of-line blocking: the waiting queue
is scanned in order and a sequence that does not fit this step (pages, rows, token budget) is
passed over, so smaller ones behind it are admitted. No starvation: a waiting sequence counts
the steps in which one behind it was admitted while it was not, over its whole life
(preemption keeps the count, and requeues it first in line); once it has been passed over
MAX_PASSED_STEPS steps, nothing behind it is admitted while it waits. From then on only
sequences ahead of it in line, or running, can run before it: a finite set (new arrivals
queue behind it, and a running sequence newer than it is preempted before it, so it queues
behind it too), each of which ends within max_model_len + 1 steps once it is the oldest.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from jpaged.config import EngineConfig
from jpaged.core.page_allocator import NULL_PAGE, PageAllocator, page_hash
from jpaged.core.sequence import RequestGroup, SeqStatus, Sequence
from jpaged.sample.sampler import seeds_to_key_data
from jpaged.worker import step_plan
from jpaged.worker.step_inputs import Demand
from jpaged.worker.step_plan import StepPlan

# Steps a waiting sequence may be passed over (one behind it admitted while it is not)
# before nothing behind it is admitted while it waits (see the module docstring).
MAX_PASSED_STEPS = 16
# Waiting sequences that do not fit looked at per step before the scan stops (each look
# walks the sequence's prefix-cache pages; the queue may be long).
MAX_BLOCKED_PER_STEP = 32

# A scheduled row while a plan is made: (seq, num_new_tokens, start, sample_row, keep_sample,
# proposals). num_new_tokens is 0 for a fresh fork, which samples from its parent's row
# (sample_row); proposals: speculative tokens verified after the last one, or None.
Row = tuple


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


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: PageAllocator,
        eos_token_ids: tuple[int, ...] = (),
        *,
        swap_allocator: PageAllocator | None = None,
        sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] | None = None,
    ) -> None:
        """swap_allocator: host swap pages, required when preemption_mode is "swap".
        sliding_window: the window W every layer attends within, whose older pages are freed
        (module docstring); None keeps every page. group_windows: instead, one window (or
        None) per paging group of a model mixing attention kinds (models/kv_groups.py), each
        group a page table of its own."""
        if group_windows is not None and sliding_window is not None:
            raise ValueError("give sliding_window or group_windows, not both")
        windows = (sliding_window,) if group_windows is None else tuple(group_windows)
        if not windows:
            raise ValueError("group_windows must name at least one group")
        for w in windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                name = "sliding_window" if group_windows is None else "group_windows"
                raise ValueError(f"{name} must be a positive integer, got {w!r}")
        self.windows = windows
        self.num_groups = len(windows)
        # The window every layer has (one group), else None.
        self.sliding_window = windows[0] if len(windows) == 1 else None
        # A full first group beside others (models/kv_groups.py puts full attention first):
        # the other groups' cached pages are anchored to its pages (module docstring).
        self._anchored = len(windows) > 1 and windows[0] is None
        self.config = config
        self.sched = config.scheduler
        self.page_size = config.cache.page_size
        self.allocator = allocator
        if self.sched.preemption_mode == "swap" and swap_allocator is None:
            raise ValueError('preemption_mode="swap" needs a swap_allocator (host swap pages)')
        self.swap_allocator = swap_allocator if self.sched.preemption_mode == "swap" else None
        self._paged = config.cache.kv_allocation == "paged"
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos_list = list(eos_token_ids)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence, by seq_id
        # Page-table rows; row max_num_seqs is a scratch row that padding writes go to. The
        # device table holds a block of max_num_seqs + 1 rows per group (_device_row).
        self._free_rows = list(range(self.sched.max_num_seqs - 1, -1, -1))  # pop() -> 0 first
        self._group_stride = self.sched.max_num_seqs + 1
        self._reserved_rows: dict[int, list[int]] = {}  # parent seq_id -> rows for its forks
        self._updates: list[tuple[int, int, int]] = []
        self._copies: list[tuple[int, int]] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._next_seq_id = 0
        self._passed: dict[int, int] = {}  # seq_id -> steps it was passed over while waiting
        self.num_preemptions = 0
        self.num_swaps_out = 0  # preemptions that swapped (the others recompute)
        self.num_swaps_in = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        # Set by the engine: whether the running sequences and one more can step together
        # (a compiled program holds them at Linux's mapping cap); None admits all.
        self.admission_check: Callable[[list[Demand]], bool] | None = None

    # -- requests --------------------------------------------------------------------------
    def add(self, group: RequestGroup, seed: int) -> None:
        seq = self._new_seq(group, 0, list(group.prompt_token_ids), seed)
        seq.needs_fork = group.params.n > 1
        group.seqs.append(seq)
        self.waiting.append(seq)

    def abort(self, group: RequestGroup) -> None:
        group.aborted = True
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self._drop_swap(seq)
        seq.status = SeqStatus.FINISHED
        self._seqs.pop(seq.seq_id, None)
        self._passed.pop(seq.seq_id, None)
        seq.num_placeholders = 0
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def unservable(self, num_prompt_tokens: int, n: int) -> str | None:
        """Why a request of num_prompt_tokens and n sequences could never be admitted, even
        with nothing else running, or None. Checked before it is queued: the engine refuses it."""
        s = self.sched
        if num_prompt_tokens >= s.max_model_len:
            return (
                f"prompt has {num_prompt_tokens} tokens; it must be shorter than max_model_len "
                f"({s.max_model_len}) to leave room for one generated token"
            )
        if n > s.max_num_seqs:
            return f"n must be <= max_num_seqs ({s.max_num_seqs}), got {n}"
        if not s.enable_chunked_prefill and num_prompt_tokens > s.max_num_batched_tokens:
            return (
                f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens "
                f"({s.max_num_batched_tokens}) and chunked prefill is off"
            )
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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def sequence(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence seq_id, or None."""
        return self._seqs.get(seq_id)

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self, proposals: dict[int, list[int]] | None = None) -> StepPlan:
        """The next step's plan.

        proposals: speculative tokens by seq_id for decoding sequences (the engine caps them
        at max_tokens and max_model_len); a row verifies them when the token budget and free
        pages allow, else it decodes one token (proposals never cause a preemption).
        """
        budget = self.sched.max_num_batched_tokens
        rows: list[Row] = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_planned_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            self._slide(seq)
            # A parent about to fork samples for its children too: it never speculates.
            extra = None
            if proposals and num_new == 1 and not seq.needs_fork:
                extra = proposals.get(seq.seq_id)
            if extra:
                extra = extra[: budget - 1]
                if extra and self._grow(seq, 1 + len(extra)):
                    rows.append(self._row(seq, 1 + len(extra), len(rows), extra))
                    budget -= 1 + len(extra)
                    continue
            while not self._grow(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                rows.append(self._row(seq, num_new, len(rows)))
                budget -= num_new
        if not preempted:  # a step that preempted admits nothing (it would thrash)
            self._admit_waiting(rows, budget)
        for i in range(len(rows)):
            seq, keep = rows[i][0], rows[i][4]
            if seq.needs_fork and keep:
                rows.extend(self._fork(seq, i))
        # A plan without rows is not dispatched: its page-table edits wait for the next plan.
        # One plan's edits are one scatter on the device, where the order of two writes of
        # one entry is not defined: only the last edit of each entry is kept (a beam forked
        # into a row since the last plan and copying its shared last page in this one).
        edits = rows and list({(r, c): (r, c, p) for r, c, p in self._updates}.values())
        plan = step_plan.build(
            rows,
            page_size=self.page_size,
            eos_token_ids=self._eos_list,
            page_updates=edits or [],
            page_copies=self._copies if rows else [],
            swap_out=self._swap_out,
            swap_in=self._swap_in,
            num_groups=self.num_groups,
        )
        if rows:
            self._updates, self._copies = [], []
        self._swap_out, self._swap_in = [], []
        return plan

    def _row(self, seq: Sequence, num_new: int, row: int, proposals=None) -> Row:
        start = seq.num_computed_tokens
        keep = start + num_new - len(proposals or ()) == seq.num_planned_tokens
        return (seq, num_new, start, row, keep, proposals)

    def _admit_waiting(self, rows: list[Row], budget: int) -> None:
        """Admits waiting sequences in queue order while they fit, passing over those that
        do not, except one passed over MAX_PASSED_STEPS steps already: nothing behind it is
        admitted (see the module docstring)."""
        blocked: list[Sequence] = []  # passed over so far this step, in queue order
        num_passed = 0  # of them, those with an admission behind them
        for seq in list(self.waiting):
            if budget <= 0 or not self._free_rows or not self.allocator.num_free():
                break  # nothing more can be admitted this step
            num_new = self._admit(seq, budget)
            if num_new:
                rows.append(self._row(seq, num_new, len(rows)))
                budget -= num_new
                num_passed = len(blocked)
                continue
            if self._passed.get(seq.seq_id, 0) >= MAX_PASSED_STEPS:
                break  # its turn: nothing behind it goes first
            blocked.append(seq)
            if len(blocked) == MAX_BLOCKED_PER_STEP:
                break
        for seq in blocked[:num_passed]:
            self._passed[seq.seq_id] = self._passed.get(seq.seq_id, 0) + 1

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admits a waiting sequence if slots, pages and budget allow; returns its new tokens
        (0: it stays waiting, nothing changed)."""
        slots_needed = seq.group.params.n if seq.needs_fork else 1
        if len(self.running) + slots_needed > self.sched.max_num_seqs:
            return 0
        if len(self._free_rows) < slots_needed:
            return 0
        if self.admission_check is not None and self.running:
            demands = [self._demand(q) for q in self.running] + [self._demand(seq)]
            if not self.admission_check(demands):
                return 0  # it waits for a batch a compiled program holds
        swapped = bool(seq.swap_pages)
        groups = range(self.num_groups)
        if swapped:  # its computed K/V comes back from host into fresh pages
            hits, computed = [[] for _ in groups], seq.num_computed_tokens
        elif (
            seq.params.prompt_logprobs is not None or seq.group.pooler is not None
        ) and seq.num_output_tokens == 0:
            hits, computed = [[] for _ in groups], 0  # prompt logprobs, embeddings: every token
        else:
            hits = self._prefix_hits(seq)
            computed = len(hits[0]) * self.page_size
        num_new = min(seq.num_tokens - computed, budget)
        if num_new < seq.num_tokens - computed and not self.sched.enable_chunked_prefill:
            return 0
        if self.config.cache.kv_allocation == "reserve":
            total = seq.num_prompt_tokens + (seq.params.max_tokens or self.sched.max_model_len)
            upto = min(max(total, seq.num_tokens), self.sched.max_model_len)
        else:
            upto = computed + num_new
        # Per group: hit pages wholly before the window of the first query are not taken
        # (NULL_PAGE); a swapped sequence's pages before its window were not swapped out
        # (_preempt). The pages every group needs come from the one free list.
        dead = [self._num_dead_pages(computed, g) for g in groups]
        for g in groups:
            hits[g] = [NULL_PAGE] * min(dead[g], len(hits[g])) + hits[g][dead[g] :]
        revived = sum(
            1 for g in groups for p in hits[g][dead[g] :] if self.allocator.ref_counts[p] == 0
        )
        needs = [math.ceil(upto / self.page_size) - max(len(hits[g]), dead[g]) for g in groups]
        if sum(needs) > self.allocator.num_free() - revived:
            return 0
        self.waiting.remove(seq)
        for g in groups:
            for p in hits[g][dead[g] :]:
                self.allocator.take_cached(p)
        seq.table_row = self._free_rows.pop()
        if seq.needs_fork:
            self._reserved_rows[seq.seq_id] = [
                self._free_rows.pop() for _ in range(seq.group.params.n - 1)
            ]
        seq.status = SeqStatus.RUNNING
        seq.num_computed_tokens = computed
        self.running.append(seq)
        seq.tables = [[] for _ in groups]
        swap_pages = list(seq.swap_pages)
        for g in groups:
            self._append_pages(seq, hits[g] + [NULL_PAGE] * (dead[g] - len(hits[g])), g)
            pages = self.allocator.allocate(needs[g])
            self._append_pages(seq, pages, g)
            if swapped:  # group g's swapped pages: those of positions dead[g] .. computed
                num_swapped = math.ceil(computed / self.page_size) - dead[g]
                self._swap_in.extend(zip(swap_pages[:num_swapped], pages))
                del swap_pages[:num_swapped]
        if swapped:
            self._drop_swap(seq)
            self.num_swaps_in += 1
            return num_new
        if seq.num_output_tokens == 0 and seq.index == 0:
            seq.group.num_cached_tokens = computed
        self.prefix_cache_query_tokens += seq.num_tokens
        self.prefix_cache_hit_tokens += computed
        return num_new

    def _demand(self, seq: Sequence) -> Demand:
        """The most seq can ask of one step from now on (its rest of the prompt at once, the
        rows of its forks, its context up to max_tokens) for admission_check."""
        sched = self.sched
        end = seq.num_prompt_tokens + (seq.params.max_tokens or sched.max_model_len)
        return Demand(
            params=seq.params,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_new_tokens=max(seq.num_tokens - seq.num_computed_tokens, 1),
            context_len=min(max(end, seq.num_tokens), sched.max_model_len),
            num_rows=(seq.group.params.n if seq.needs_fork else 1)
            if seq.status is not SeqStatus.RUNNING
            else 1 + len(self._reserved_rows.get(seq.seq_id, ())),
            in_prompt=seq.num_output_tokens == 0,
            pooling=seq.group.pooler is not None,
        )

    def _prefix_hits(self, seq: Sequence) -> list[list[int]]:
        """Per group, the pages of the longest prefix hit of L full pages (at least one token
        is left to compute, so the step has a hidden state to sample from), L positions in
        every group: a hit serves every layer or none. The first group's are its leading
        cached pages, each found after the one before; the other groups' come from
        _anchored_hits or _chained_hits (module docstring), NULL_PAGE where not needed."""
        ps, salt = self.page_size, seq.group.cache_salt
        first: list[int] = []
        seq.page_hashes = []
        parent = None
        for i in range((seq.num_tokens - 1) // ps):
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            h = page_hash(parent, tokens, salt)
            page = self.allocator.lookup(h, tokens, parent=first[-1] if first else None, salt=salt)
            if page is None:
                break
            first.append(page)
            seq.page_hashes.append(h)
            parent = h
        if self._anchored:
            hits = self._anchored_hits(seq, first)
        else:
            hits = self._chained_hits(seq, first)
        del seq.page_hashes[len(hits[0]) :]
        return hits

    def _group_lookup(self, seq: Sequence, group: int, i: int, parent: int | None) -> int | None:
        """Group `group`'s cached page of seq's page i, cached after exactly `parent` (under
        the group's own hash and salt: _group_key)."""
        h, group_salt = _group_key(seq.page_hashes[i], seq.group.cache_salt, group)
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

    def _grow(self, seq: Sequence, num_new: int) -> bool:
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

    def _device_row(self, seq: Sequence, group: int) -> int:
        """seq's row of the device table in a group's block of rows."""
        return group * self._group_stride + seq.table_row

    def _append_pages(self, seq: Sequence, pages: list[int], group: int = 0) -> None:
        table, row = seq.tables[group], self._device_row(seq, group)
        for p in pages:
            self._updates.append((row, len(table), p))
            table.append(p)

    def _fork(self, parent: Sequence, parent_row: int) -> list[Row]:
        """Forks n - 1 children sharing every page of the parent; they sample from its row."""
        parent.needs_fork = False
        rows = []
        group = parent.group
        for index, table_row in enumerate(self._reserved_rows.pop(parent.seq_id), start=1):
            child = self._new_seq(
                group, index, list(parent.token_ids), seed=hash((parent.seed, index)) % 2**63
            )
            child.table_row = table_row
            child.status = SeqStatus.RUNNING
            child.num_computed_tokens = parent.num_tokens  # computed by the parent's step
            child.page_hashes = list(parent.page_hashes)
            self._share_pages(parent, child)
            group.seqs.append(child)
            self.running.append(child)
            rows.append((child, 0, child.num_computed_tokens, parent_row, True, None))
        return rows

    def _share_pages(self, parent: Sequence, child: Sequence) -> None:
        """The child's page-table rows: every page of the parent in every group, shared
        (freed ones stay NULL_PAGE)."""
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

    def _slide(self, seq: Sequence) -> None:
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
        pages held at the end are freed cached by _release). The other generated pages
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

    def _new_seq(self, group: RequestGroup, index: int, token_ids: list[int], seed: int):
        seq = Sequence(
            seq_id=self._next_seq_id,
            group=group,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(group.prompt_token_ids),
            seed=seed,
        )
        seq.sampling_constants = step_plan.sampling_constants(
            group.params, seeds_to_key_data([seed])[0]
        )
        self._seqs[seq.seq_id] = seq
        self._next_seq_id += 1
        return seq

    def _preempt(self, seq: Sequence, *, allow_swap: bool = True, last: bool = False) -> None:
        """Queues a running sequence first in line (last: at the back). Swaps its computed pages out when swap is
        configured, the host has room and it has a token left to compute (a resumed sequence
        must have one, to sample from); otherwise it is recomputed from scratch."""
        self.running.remove(seq)
        self._slide(seq)
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
            # swap_pages: each group's held pages in turn (_admit splits them the same way).
            seq.swap_pages = self.swap_allocator.allocate(num_swapped)
            held = [p for g, t in enumerate(seq.tables) for p in t[dead[g] : num_pages]]
            self._swap_out.extend(zip(held, seq.swap_pages))
            self.num_swaps_out += 1
        else:
            seq.num_computed_tokens = 0
        self._release(seq)
        seq.status = SeqStatus.WAITING
        if last:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _drop_swap(self, seq: Sequence) -> None:
        if seq.swap_pages:
            self.swap_allocator.free(seq.swap_pages)
            seq.swap_pages = []

    def _release(self, seq: Sequence) -> None:
        """Frees a sequence's pages (tail first) and its page-table row(s). The device row keeps
        stale entries until the row's next owner overwrites them; nothing reads past a
        sequence's context length."""
        # Tail first across the groups, so a prefix outlives its suffix in every group.
        longest = max(len(t) for t in seq.tables)
        self.allocator.free([
            t[i] for i in range(longest - 1, -1, -1) for t in seq.tables
            if i < len(t) and t[i] != NULL_PAGE
        ])  # fmt: skip
        seq.tables = [[] for _ in range(self.num_groups)]
        seq.page_hashes = []
        seq.slid_pages = {}  # the last ones stay cached: a hit on the whole sequence needs them
        self._free_rows.append(seq.table_row)
        self._free_rows.extend(self._reserved_rows.pop(seq.seq_id, []))
        seq.table_row = -1

    # -- results ---------------------------------------------------------------------------
    def dispatched(self, plan: StepPlan) -> None:
        """The plan's step is on the device: its tokens count as computed, and each sampling
        row that may continue holds a placeholder for its token (see the module docstring)."""
        max_len = self.sched.max_model_len
        ends = plan.context_lens.tolist()
        for seq_id, end, keep in zip(plan.seq_ids.tolist(), ends, plan.keep_sample.tolist()):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            seq.num_computed_tokens = end
            if not keep:
                continue
            n = seq.num_placeholders + 1  # tokens in flight, this one included
            max_tokens = seq.params.max_tokens
            if (max_tokens is None or seq.num_output_tokens + n < max_tokens) and (
                seq.num_tokens + n < max_len
            ):
                seq.num_placeholders = n

    def commit(self, plan: StepPlan, out) -> list[Sequence]:
        """Applies a step's SamplerOutput (numpy, rows in plan order); returns the sequences
        that got new tokens. Rows of finished sequences are dropped; a sequence preempted
        after the step was dispatched still gets its token."""
        if out.num_accepted is not None:
            return self._commit_verified(plan, out)
        result = []
        tokens = out.tokens.tolist()
        logprobs = out.logprobs.tolist()
        ends = plan.context_lens.tolist()
        keep = plan.keep_sample.tolist()
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = self._seqs.get(seq_id)
            if seq is None:  # finished (or aborted) since the plan was made
                continue
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed_tokens = max(seq.num_computed_tokens, ends[i])
                self._cache_full_pages(seq, ends[i])  # only pages of real tokens
            if not keep[i]:
                continue
            if seq.num_placeholders:
                seq.num_placeholders -= 1
            token = tokens[i]
            seq.token_ids.append(token)
            seq.cumulative_logprob += logprobs[i]
            n = seq.params.logprobs
            if n is not None:
                top = zip(out.top_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist())
                # Tokens a grammar forbids have -inf: not among the most likely.
                seq.logprobs.append({token: logprobs[i], **{t: x for t, x in top if x > -1e30}})
            result.append(seq)
            self._check_stop(seq, token)
        return result

    def _commit_verified(self, plan: StepPlan, out) -> list[Sequence]:
        """A speculative step's tokens: row i emits out.spec_tokens[i, :a + 1] (its a accepted
        proposals, then the target's token), checked for stops one by one. Only the verified
        positions count as computed: the pages past them (rejected proposals' K/V) go back to
        the pool, and prefix caching registers only verified pages.

            positions   start .. start + a - 1 | start + a | .. start + n - 1
            tokens      last, accepted         | new token | rejected (freed)
        """
        result = []
        accepted = out.num_accepted.tolist()
        tokens, logprobs = out.spec_tokens.tolist(), out.spec_logprobs.tolist()
        ends = plan.context_lens.tolist()
        keep = plan.keep_sample.tolist()
        proposed = plan.num_proposed.tolist() if plan.num_proposed is not None else [0] * len(plan)
        ps = self.page_size
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            a = accepted[i]
            if keep[i]:
                seq.num_placeholders = max(seq.num_placeholders - 1, 0)
                n = seq.params.logprobs
                for j in range(a + 1):
                    token = tokens[i][j]
                    seq.token_ids.append(token)
                    seq.cumulative_logprob += logprobs[i][j]
                    if n is not None:
                        top = zip(
                            out.top_ids[i, j, :n].tolist(), out.top_logprobs[i, j, :n].tolist()
                        )
                        entry = {t: x for t, x in top if x > -1e30}
                        seq.logprobs.append({token: logprobs[i][j], **entry})
                    self._check_stop(seq, token)
                    if seq.is_finished:
                        break
                result.append(seq)
            if seq.status is not SeqStatus.RUNNING:
                continue
            verified = ends[i] - proposed[i] + a  # the K/V of these positions is valid
            seq.num_computed_tokens = verified
            needed = -(-verified // ps)
            if proposed[i] and self._paged:
                for table in seq.tables:  # the rejected proposals' pages, in every group
                    if len(table) > needed:
                        self.allocator.free(table[needed:][::-1])
                        del table[needed:]
            self._cache_full_pages(seq, verified)
        return result

    def mark_computed(self, plan: StepPlan) -> list[Sequence]:
        """Commits a step's computed tokens but appends none of its samples: the caller picks
        each sequence's next token itself (beam search). Returns, in row order, the running
        sequence of each row whose sample is its next token, or None."""
        sampled: list[Sequence | None] = []
        for seq_id, end, keep in zip(
            plan.seq_ids.tolist(), plan.context_lens.tolist(), plan.keep_sample.tolist()
        ):
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:
                seq.num_computed_tokens = end
                self._cache_full_pages(seq, end)
            sampled.append(
                seq if keep and seq is not None and seq.status is SeqStatus.RUNNING else None
            )
        return sampled

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's pages and queues it last, to be recomputed after the
        waiting ones (beam search makes room so for beams that must run before it). Never
        swaps: the beam's next tokens are chosen outside the scheduler."""
        self._preempt(seq, allow_swap=False, last=True)

    def fork(self, parent: Sequence) -> Sequence:
        """A new sequence of parent's group with parent's tokens (beam search's fork).

        A running parent's child takes a free page-table row and shares every page of the
        parent (a write into a shared partly filled page copies it first, in _grow); with no
        free row, or a parent that is not running, the child waits and is recomputed (prefix
        hits).
        """
        group = parent.group
        child = self._new_seq(group, len(group.seqs), list(parent.token_ids), parent.seed)
        group.seqs.append(child)
        if parent.status is not SeqStatus.RUNNING or not self._free_rows:
            self.waiting.append(child)
            return child
        child.table_row = self._free_rows.pop()
        child.status = SeqStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        child.page_hashes = list(parent.page_hashes)
        self._share_pages(parent, child)
        self.running.append(child)
        return child

    def _cache_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Registers the full pages among seq's first num_tokens (computed) tokens."""
        if not self.allocator.enable_prefix_caching:
            return
        ps, salt = self.page_size, seq.group.cache_salt
        parent = seq.page_hashes[-1] if seq.page_hashes else None
        for i in range(len(seq.page_hashes), num_tokens // ps):
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            h = page_hash(parent, tokens, salt)
            for g, table in enumerate(seq.tables):
                if g and self._anchored:  # the full group's page vouches for the prefix
                    prev = seq.tables[0][i]
                else:
                    prev = table[i - 1] if i else None
                if table[i] == NULL_PAGE or prev == NULL_PAGE:  # freed: see _slide
                    continue
                group_hash, group_salt = _group_key(h, salt, g)
                self.allocator.cache_page(
                    table[i], group_hash, tokens, parent=prev, salt=group_salt
                )
            seq.page_hashes.append(h)
            parent = h

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, "stop")
                return
            if token in p.stop_token_ids:
                self.finish(seq, "stop", token)
                return
        if (
            p.max_tokens is not None
            and seq.num_output_tokens >= p.max_tokens
            or seq.num_tokens >= self.sched.max_model_len
        ):
            self.finish(seq, "length")
