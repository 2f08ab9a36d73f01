"""HostPageStore: the host tier of the KV cache, and the host pages of swap preemption.

A fixed pool of host pages (the runner's host page array, ModelRunner.swap_space: page 0
unused, like the device's null page) with two uses, one accounting:
- the prefix cache's second tier: a full page that the device prefix cache evicts (its page
  handed out anew) is copied here instead of dropped, under its page hash; a prefix lookup
  that ends on the device goes on here, and each host hit is loaded into a fresh device page
  before the step that reads it (KVCacheManager names the copies; the runner moves them in
  the plan's swap_out / swap_in, device -> host before host -> device before the step);
- swap preemption's host pages (KVCacheManager.preempt), referenced until swapped back in.

The pages' free list, reference counts and LRU order are a PageAllocator's over host page
ids: a cached host page is evictable while unreferenced, least recently used first, and a
swap-out or an offload takes the least recently used one. The store never holds more
than its num_pages pages (sized from kv_offload_bytes: memory_plan.resolve_num_swap_pages).

Keys: with the tier on, page hashes are sha256 digests chained from a seed of the model's
identity (its path, architecture, KV dtype and layout: `identity`), so a page's hash names
its tokens, every token before it, the cache salt and the model. A host hit needs the
digest, the page's tokens and the salt to match (the tokens and salt are checked, the
prefix rests on the digest chain: exact up to a sha256 collision, vLLM's own promise).
The device allocator keeps its own exactness rule (its entries' parents), whatever the hash.

Disk (jpaged/core/disk_page_store.py, with the runner's host array): write-through. A page
offloaded here is written to the disk tier after the plan's copies ran (write_through, which
the engine calls once the step is dispatched, so the files are written while the device
computes), a cached host page handed out anew before that is written first (_spill), and a
host miss whose page has a file reads it into a free host page (_read_back), cached there
like an offload. At shutdown jpaged/core/disk_flush.py writes the device cache's pages too,
so a restarted engine on the same directory finds a whole session's pages.

Copies in a plan: a host page named by the plan being made (an offload written, a hit or a
swapped page read) keeps a reference until the plan is complete (end_plan, from
KVCacheManager.take_edits), so no other copy of the same plan can target it; the engine
runs a plan's copies (ModelRunner.swap, synchronous) before it makes the next plan.
"""

from __future__ import annotations

import hashlib
import struct

import jax
import numpy as np

from jpaged.core.disk_page_store import DiskPageStore
from jpaged.core.page_allocator import PageAllocator


class HostPageStore:
    STAT_KEYS = (
        "host_pages_total", "host_pages_used", "host_pages_cached", "host_hit_pages",
        "host_hit_tokens",
        "host_offloaded_pages", "host_pages_out", "host_pages_in", "host_bytes_out",
        "host_bytes_in", "host_offload_skipped", "disk_hit_pages", "disk_files", "disk_bytes",
        "disk_pages_written", "disk_pages_read", "disk_bytes_written", "disk_bytes_read",
        "disk_bad_files",
    )  # fmt: skip

    def __init__(
        self,
        num_pages: int,
        *,
        page_bytes: int,
        page_size: int = 1,
        identity: str = "",
        offload: bool = True,
        host_array=None,
        disk: DiskPageStore | None = None,
    ) -> None:
        """num_pages: host pages (page 0 not counted); page_bytes: one page's K and V of
        every layer, scales included; page_size: its tokens; identity: the model's identity
        (module docstring); offload: whether evicted prefix pages are kept (else swap pages
        only). host_array: the runner's host pages (a numpy array, or a pytree of them for
        int8/fp8 pages: [2, H, L, num_pages + 1, page_size(, D)] each), which disk needs;
        disk: the disk tier, where host pages evicted from this one are written."""
        if num_pages < 1:
            raise ValueError(f"a host page store needs at least one page, got {num_pages}")
        self.pages = PageAllocator(num_pages + 1, enable_prefix_caching=offload)
        self.page_bytes = page_bytes
        self.page_size = page_size
        self.offload = offload
        self._seed = hashlib.sha256(identity.encode()).digest()
        # Pages named by the plan being made, each with the active session it is kept for.
        self._named: list[tuple[int, str | None]] = []
        self.disk = disk if offload and host_array is not None else None
        self._leaves = [] if host_array is None else jax.tree.leaves(host_array)
        if self.disk is not None:
            self.pages.evicted = []  # spilled to disk by _spill
        # Host pages offloaded and not yet on disk: page -> (hash, tokens, salt).
        self._unwritten: dict[int, tuple] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_hit_pages = 0  # host hits loaded into device pages
        self.num_offloaded = 0  # evicted device pages copied here
        self.num_pages_out = 0  # device -> host copies (offloads and swap-outs)
        self.num_pages_in = 0  # host -> device copies (loads and swap-ins)
        self.num_offload_skipped = 0  # evicted pages not kept (every host page in use)
        self.num_disk_hits = 0  # pages read back from disk into host pages

    # -- the swap allocator's interface (KVCacheManager.preempt, drop_swap) ------------------
    @property
    def num_usable_pages(self) -> int:
        return self.pages.num_usable_pages

    def num_free(self) -> int:
        return self.pages.num_free()

    def num_used(self) -> int:
        return self.pages.num_used()

    def num_cached(self) -> int:
        return self.pages.num_cached()

    def can_allocate(self, n: int) -> bool:
        return self.pages.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        """n host pages for a swap-out (least recently used cached pages are evicted)."""
        pages = self.pages.allocate(n)
        self._spill()
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops swapped pages: they may be read by this plan's swap-ins, so they are
        released when the plan is complete (end_plan)."""
        self._named.extend((p, None) for p in pages)

    # -- the prefix tier -------------------------------------------------------------------
    def page_hash(self, parent: int | None, token_ids: tuple[int, ...], salt) -> int:
        """The sha256 digest (as an int) of a full page: its parent's digest (the model's
        seed for a first page), its tokens and the cache salt."""
        prefix = self._seed if parent is None else parent.to_bytes(32, "big")
        salt_bytes = b"\x00" if salt is None else b"\x01" + str(salt).encode()
        tokens = np.asarray(token_ids, dtype=np.int64).tobytes()
        body = struct.pack("<q", len(token_ids)) + tokens + salt_bytes
        return int.from_bytes(hashlib.sha256(prefix + body).digest(), "big")

    def lookup(self, h: int, token_ids: tuple[int, ...], salt) -> int | None:
        """The host page holding the page of hash h, token_ids and salt, or None. A page
        found is held until the plan is complete (end_plan), so that a later lookup of the
        same plan reading a page back from disk cannot hand it out anew."""
        if not self.offload:
            return None
        page = self.pages.lookup(h, token_ids, salt=salt)
        if page is not None:
            self.pages.take_cached(page)
            self._named.append((page, None))
        elif self.disk is not None and h in self.disk:
            page = self._read_back(h, token_ids, salt)
        return page

    def holds(self, h: int, token_ids: tuple[int, ...], salt) -> bool:
        """Whether a lookup of the page would find it here or on disk (changes nothing)."""
        if not self.offload:
            return False
        if self.pages.lookup(h, token_ids, salt=salt) is not None:
            return True
        return self.disk is not None and h in self.disk

    def _read_back(self, h: int, token_ids: tuple[int, ...], salt) -> int | None:
        """A page of the disk tier read into a host page (cached there; held until the plan
        is complete), or None: no host page free, or the file is not this page's."""
        if not self.pages.can_allocate(1):
            return None
        arrays = self.disk.get(h, token_ids, salt, [leaf[:, :, :, 0] for leaf in self._leaves])
        if arrays is None:
            return None
        (page,) = self.pages.allocate(1)
        self._spill()
        for leaf, a in zip(self._leaves, arrays, strict=True):
            leaf[:, :, :, page] = a
        self.pages.cache_page(page, h, token_ids, salt=salt)
        self._named.append((page, None))
        self.num_disk_hits += 1
        return page

    def _spill(self) -> None:
        """Writes the cached host pages just handed out anew to the disk tier (their bytes
        are whole: a host page named by the plan being made is never handed out)."""
        if self.disk is None:
            return
        for page, entry, _ in self.pages.evicted:
            self._unwritten.pop(page, None)
            arrays = [leaf[:, :, :, page] for leaf in self._leaves]
            self.disk.put(entry.hash, entry.token_ids, entry.salt, arrays)
        self.pages.evicted.clear()

    def write_through(self) -> int:
        """Queues the pages offloaded since the last call for the disk tier's writer thread
        (their bytes are in the host array once the plan's copies ran: ModelRunner.swap,
        and are copied now); the number queued (a page already on disk only becomes its most
        recently used). DiskPageStore.wait: until they are written."""
        if not self._unwritten:
            return 0
        for page, (h, token_ids, salt) in self._unwritten.items():
            arrays = [leaf[:, :, :, page] for leaf in self._leaves]
            self.disk.put_async(h, token_ids, salt, arrays)  # copied now, written on a thread
        n, self._unwritten = len(self._unwritten), {}
        return n

    def load(self, page: int, session: str | None = None, *, count: bool = True) -> None:
        """A host hit found by lookup is loaded by the plan being made: referenced until the
        plan is complete (and then the most recently used; kept for session, an active one
        or None: jpaged/core/session_pages.py). count: whether it counts as a hit (a paging
        group's page beside the first group's does not: hits count positions)."""
        self.pages.take_cached(page)
        self._named.append((page, session))
        self.num_hit_pages += count

    def offload_page(
        self, h: int, token_ids: tuple[int, ...], salt, session: str | None = None
    ) -> int | None:
        """The host page an evicted device page of hash h is copied into, or None: already
        here (then it becomes the most recently used), or every host page in use. session:
        the active session the page is kept for, or None."""
        page = self.pages.lookup(h, token_ids, salt=salt)
        if page is not None:
            self.pages.take_cached(page)
            self._named.append((page, session))
            return None
        if not self.pages.can_allocate(1):
            self.num_offload_skipped += 1
            return None
        (page,) = self.pages.allocate(1)
        self._spill()
        self.pages.cache_page(page, h, token_ids, salt=salt)
        self._named.append((page, session))
        self.num_offloaded += 1
        if self.disk is not None:
            self._unwritten[page] = (h, token_ids, salt)
        return page

    def end_plan(self, num_out: int, num_in: int) -> None:
        """A plan is complete, with num_out device -> host and num_in host -> device copies:
        the pages it named are released (freed pages in the order named: least recently
        used first)."""
        self.num_pages_out += num_out
        self.num_pages_in += num_in
        for page, session in self._named:
            self.pages.free([page], session=session)
        self._named = []

    def restart(self) -> None:
        """The device state was made anew: no copy is pending and the tier is empty."""
        self.pages.free([page for page, _ in self._named])
        self._named = []
        self._unwritten = {}  # their copies may not have run
        self.pages.reset_prefix_cache()  # the disk tier's files stay: they were whole

    def stats(self) -> dict:
        """The tier's counters (host_stats: zeros without a store)."""
        return {
            "host_pages_total": self.num_usable_pages,
            "host_pages_used": self.num_used(),
            "host_pages_cached": self.num_cached(),
            "host_hit_pages": self.num_hit_pages,
            "host_hit_tokens": self.num_hit_pages * self.page_size,
            "host_offloaded_pages": self.num_offloaded,
            "host_pages_out": self.num_pages_out,
            "host_pages_in": self.num_pages_in,
            "host_bytes_out": self.num_pages_out * self.page_bytes,
            "host_bytes_in": self.num_pages_in * self.page_bytes,
            "host_offload_skipped": self.num_offload_skipped,
            "disk_hit_pages": self.num_disk_hits,
            **(self.disk.stats() if self.disk is not None else {}),
        }


def host_stats(store: HostPageStore | None, copy_seconds: float, num_copy_steps: int) -> dict:
    """The engine's host-tier stats (llm.stats(), /metrics): the store's counters, zeros
    without one, and the seconds the plans' host copies took (ModelRunner.swap) over the
    steps that had any."""
    stats = dict.fromkeys(HostPageStore.STAT_KEYS, 0)
    if store is not None:
        stats.update(store.stats())
    stats["host_copy_seconds"] = copy_seconds
    stats["host_copy_steps"] = num_copy_steps
    return stats
