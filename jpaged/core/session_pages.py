"""Sessions: which sessions are active, so that their cached pages are evicted last.

A request may name a session (engine.add_request(session=...): a chat's conversation, an
agent's run, a Responses API chain). The rule (docs/memory.md, "Sessions"): a session is
active while a request of it is unfinished and for `idle_seconds` after its last one
finished; the cached pages its sequences free meanwhile are kept apart from the other free
pages, on the device (PageAllocator's kept list) and in the host tier, and handed out only
when no other free page is left, least recently freed first. When the session's idle time
has passed, KVCacheManager.take_edits releases them (expire): they become ordinary free
pages, the most recently used ones as of then.

Host code, O(1) per request; expire is O(sessions expired): sessions go idle in order and
all wait the same time, so the idle ones are kept in the order they went idle.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable


class Sessions:
    def __init__(self, idle_seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._requests: dict[str, str] = {}  # unfinished request id -> its session
        self._num_unfinished: dict[str, int] = {}  # session -> its unfinished requests
        # Sessions with none unfinished, still active: session -> when it went idle.
        self._idle: collections.OrderedDict[str, float] = collections.OrderedDict()

    def begin(self, request_id: str, session: str | None) -> None:
        """A request of session (None: none) arrived."""
        if session is None:
            return
        self._requests[request_id] = session
        self._num_unfinished[session] = self._num_unfinished.get(session, 0) + 1
        self._idle.pop(session, None)

    def end(self, request_id: str) -> None:
        """A request finished (or was aborted); a second call does nothing."""
        session = self._requests.pop(request_id, None)
        if session is None:
            return
        self._num_unfinished[session] -= 1
        if self._num_unfinished[session] == 0:
            del self._num_unfinished[session]
            self._idle[session] = self.clock()

    def is_active(self, session: str | None) -> bool:
        return session is not None and (session in self._num_unfinished or session in self._idle)

    def num_active(self) -> int:
        return len(self._num_unfinished) + len(self._idle)

    def expire(self) -> list[str]:
        """The sessions whose idle time has passed since the last call (no longer active)."""
        now, expired = self.clock(), []
        while self._idle:
            session, since = next(iter(self._idle.items()))
            if now - since < self.idle_seconds:
                break
            del self._idle[session]
            expired.append(session)
        return expired
