"""Page allocator: the one owner of the free list, reference counts and the prefix-cache index.

Invariants:
- page 0 is the null page: never handed out, never freed, never cached;
- a page is on the free list exactly when its reference count is 0;
- a free page may still hold a cached hash: it stays reusable by a prefix hit until the
  allocator hands it out again, least recently freed first (the free list is the LRU order);
- every operation costs O(1) per page;
- a page freed with forget=True, or forgotten while free (a sliding window's page that no
  prefix hit will ask for: jpaged/core/kv_cache_manager.py), leaves the prefix cache and is handed
  out before every other free page;
- a prefix hit is exact whatever the hash function: a cached page records its tokens, the
  cache salt and its parent, a physical page with that page's generation (bumped whenever
  the page is handed out anew) whose own entry vouches for every token before it in the
  sequence that cached it: the page before it in its paging group, or, for a window group
  beside a full one, the full group's page at the same position (its chain covers the same
  tokens and all before them). A lookup hits only when all of them match the requester's:
  its page tokens, its salt, and the page it matched for that parent, still in the same
  generation. The hash only finds the candidate; a collision (even a crafted one) costs a
  miss, never a wrong hit.

Sessions (jpaged/core/session_pages.py): a cached page freed with session=key while that
session is active is "kept": a second LRU list of free pages, handed out only when no other
free page is left (least recently freed first there too), until release_session(key) moves
the session's kept pages to the back of the free list (the session went idle).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class CachedPage:
    hash: int
    token_ids: tuple[int, ...]
    salt: str | None = None
    parent: tuple[int, int] | None = None  # (page, its generation); None: the first page


def page_hash(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    """Hash of one full page, chained from its parent page's hash (and the cache salt)."""
    return hash((parent_hash, token_ids, salt))


class PageAllocator:
    def __init__(self, num_pages: int, *, enable_prefix_caching: bool = True) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)
        # Free pages in LRU order (front = next handed out); dict gives O(1) removal.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (p, None) for p in range(1, num_pages)
        )
        self._cached: dict[int, CachedPage] = {}  # page -> its cache entry
        self._by_hash: dict[int, int] = {}  # hash -> page
        # Bumped each time a page is handed out anew (its contents will be rewritten).
        self.generation = np.zeros(num_pages, dtype=np.int64)
        self.num_evictions = 0
        # Free cached pages of active sessions, LRU order (module docstring), and their owners.
        self._kept: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._keeper: dict[int, str] = {}  # kept page -> its session
        self._session_pages: dict[str, dict[int, None]] = {}  # session -> its kept pages
        # Cached pages handed out anew, (page, its entry, its session or None), while a list: set by the host tier
        # (jpaged/core/host_page_store.py), which copies them out before the step that
        # rewrites them and empties it (KVCacheManager.take_edits).
        self.evicted: list[tuple[int, CachedPage, str | None]] | None = None

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def num_free(self) -> int:
        return len(self._free) + len(self._kept)

    def num_used(self) -> int:
        return self.num_usable_pages - self.num_free()

    def num_kept(self) -> int:
        """Free cached pages kept for active sessions (handed out last)."""
        return len(self._kept)

    def num_cached(self) -> int:
        return len(self._cached)

    def free_pages(self) -> list[int]:
        """The free pages in the order they are handed out (sessions' kept pages last)."""
        return list(self._free) + list(self._kept)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free()

    def cached_entry(self, page: int) -> CachedPage | None:
        return self._cached.get(page)

    def cached_pages(self) -> list[tuple[int, CachedPage]]:
        """Every cached page and its entry (the order of caching)."""
        return list(self._cached.items())

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free():
            raise RuntimeError(f"cannot allocate {n} pages: {self.num_free()} free")
        pages = []
        for _ in range(n):
            session = None
            if self._free:
                page, _ = self._free.popitem(last=False)
            else:  # only sessions' kept pages are left: the least recently freed
                page = next(iter(self._kept))
                session = self._unkeep(page)
            if self.evicted is not None and page in self._cached:
                self.evicted.append((page, self._cached[page], session))
            self._uncache(page)
            self.generation[page] += 1
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def share(self, page: int) -> None:
        """One more holder of an allocated page (a fork or a prefix hit on a live page)."""
        if page == NULL_PAGE or self.ref_counts[page] < 1:
            raise RuntimeError(f"share of page {page}, which is not allocated")
        self.ref_counts[page] += 1

    def free(self, pages: list[int], *, forget: bool = False, session: str | None = None) -> None:
        """Drops one reference to each page. Pass pages in eviction order: pages freed first
        are reused first (callers free a sequence's pages tail first, so a prefix outlives
        its suffix in the cache).

        forget: a page left unreferenced also leaves the prefix cache and goes to the front
        of the free list (a page that fell out of a sliding window and that no prefix hit
        will ask for: reusing it first keeps the useful cached pages longer).
        session: an active session whose sequence frees the pages: a cached page left
        unreferenced is kept for it (module docstring; an uncached one is freed as usual)."""
        for page in pages:
            if page == NULL_PAGE or self.ref_counts[page] < 1:
                raise RuntimeError(f"free of page {page}, which is not allocated")
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if session is not None and not forget and page in self._cached:
                    self._kept[page] = None
                    self._keeper[page] = session
                    self._session_pages.setdefault(session, {})[page] = None
                    continue
                self._free[page] = None
                if forget:
                    self._forget_free(page)

    def _unkeep(self, page: int) -> str:
        """Takes a kept page off the kept list -> its session."""
        del self._kept[page]
        session = self._keeper.pop(page)
        pages = self._session_pages[session]
        del pages[page]
        if not pages:
            del self._session_pages[session]
        return session

    def release_session(self, session: str) -> None:
        """A session went idle: its kept pages become ordinary free pages, at the back of
        the free list in their kept order (the most recently freed, as of now)."""
        for page in self._session_pages.pop(session, {}):
            del self._kept[page]
            del self._keeper[page]
            self._free[page] = None

    def forget(self, page: int, generation: int) -> None:
        """Drops a free page from the prefix cache and moves it to the front of the free list,
        if it is still free in that generation (a window page kept cached for a while, no
        longer worth keeping); otherwise (revived by a hit, or handed out anew) nothing."""
        if page != NULL_PAGE and self.ref_counts[page] == 0 and self.generation[page] == generation:
            self._forget_free(page)

    def _forget_free(self, page: int) -> None:
        """A free page out of the prefix cache and first in line to be handed out."""
        if page in self._kept:
            self._unkeep(page)
            self._free[page] = None
        self._uncache(page)
        self._free.move_to_end(page, last=False)

    # -- prefix cache ----------------------------------------------------------------------
    def _parent_ref(self, parent: int | None) -> tuple[int, int] | None:
        return None if parent is None else (parent, int(self.generation[parent]))

    def cache_page(
        self,
        page: int,
        h: int,
        token_ids: tuple[int, ...],
        *,
        parent: int | None = None,
        salt: str | None = None,
    ) -> None:
        """Records that a full, allocated page holds token_ids under hash h and salt, computed
        after exactly the prefix that the page `parent` vouches for (module docstring: the
        sequence's previous page in the group, or its full group's page at the same
        position; None for a first page)."""
        if not self.enable_prefix_caching or page in self._cached or h in self._by_hash:
            return
        self._cached[page] = CachedPage(h, token_ids, salt, self._parent_ref(parent))
        self._by_hash[h] = page

    def lookup(
        self,
        h: int,
        token_ids: tuple[int, ...],
        *,
        parent: int | None = None,
        salt: str | None = None,
    ) -> int | None:
        """The page cached under h if it holds token_ids under salt and was cached with
        exactly the page `parent` in its current generation (the requester's hit that
        vouches for its prefix, as cache_page; None for a first page), else None."""
        if not self.enable_prefix_caching:
            return None
        page = self._by_hash.get(h)
        if page is None:
            return None
        entry = self._cached[page]
        if (
            entry.token_ids != token_ids
            or entry.salt != salt
            or entry.parent != self._parent_ref(parent)
        ):
            return None
        return page

    def take_cached(self, page: int) -> None:
        """Takes a reference to a cached page found by lookup (revives it if it was free)."""
        if self.ref_counts[page] == 0:
            if page in self._kept:
                self._unkeep(page)
            else:
                del self._free[page]
            self.ref_counts[page] = 1
        else:
            self.ref_counts[page] += 1

    def reset_prefix_cache(self) -> None:
        for session in list(self._session_pages):
            self.release_session(session)
        self._cached.clear()
        self._by_hash.clear()
        if self.evicted is not None:
            self.evicted.clear()

    def _uncache(self, page: int) -> None:
        entry = self._cached.pop(page, None)
        if entry is not None:
            del self._by_hash[entry.hash]
            self.num_evictions += 1
