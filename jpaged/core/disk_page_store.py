"""DiskPageStore: the disk tier under the host tier (--kv-offload-dir), one file per page.

A page entering the host tier is written here (HostPageStore.write_through, put_async), one
the host tier evicts unwritten too (its spill, put), and read back into a host page on a
host miss. Files are named by the page's sha256 hash (jpaged/core/host_page_store.py:
chained from the model's identity, so another model's files are never read as this one's) and
hold a header (hash, tokens, salt, each array's dtype and shape), the page's arrays (K and V,
an int8/fp8 pool's scales too) and a sha256 of everything before it:

    MAGIC | u32 header length | header (JSON) | arrays' bytes | sha256 of all before

A file is written whole (a temporary file, then os.replace) and verified when read: its
length, checksum and header must be what the lookup expects, else it is a miss (and removed),
never wrong K/V. The directory's files stay under max_bytes, the least recently used removed
first (the order of their modification times at start, of use since).

Writes through (put_async, the host tier's write-through) run on one writer thread: the
page's arrays are copied at once and the file is written, checksummed and counted there, off
the scheduling thread; until then the page is not in the store (a lookup misses it, which is
safe). wait() blocks until every such write is done (the shutdown flush calls it). The
bookkeeping is under one lock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import os
import struct
import threading
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"JPAGEDKV1\n"
SUFFIX = ".kvpage"


class DiskPageStore:
    def __init__(self, directory: str | os.PathLike, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        # name -> size, least recently used first
        self._files: collections.OrderedDict[str, int] = collections.OrderedDict()
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            st = path.stat()
            found.append((st.st_mtime, path.name, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
        self.num_bytes = sum(self._files.values())
        self.num_written = self.num_read = self.num_bad = 0
        self.bytes_written = self.bytes_read = 0
        self._lock = threading.RLock()
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self._pending: dict[str, concurrent.futures.Future] = {}  # name -> its write
        self._trim()

    @staticmethod
    def _name(h: int) -> str:
        return f"{h:064x}{SUFFIX}"

    @staticmethod
    def _header(h: int, token_ids, salt, arrays) -> bytes:
        spec = [[a.dtype.str, list(a.shape)] for a in arrays]
        fields = {"hash": f"{h:064x}", "tokens": list(map(int, token_ids)), "salt": salt}
        return json.dumps({**fields, "arrays": spec}, sort_keys=True).encode()

    def __contains__(self, h: int) -> bool:
        with self._lock:
            return self._name(h) in self._files

    def put_async(self, h: int, token_ids, salt, arrays: list[np.ndarray]) -> None:
        """put on the writer thread, the arrays copied now (their host page may be handed
        out anew as soon as this returns)."""
        name = self._name(h)
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
                return
            if name in self._pending:
                return
            if self._writer is None:
                self._writer = concurrent.futures.ThreadPoolExecutor(1, "jpaged-kv-disk")
            copies = [np.array(a, copy=True) for a in arrays]
            self._pending[name] = self._writer.submit(self._put_pending, name, h, token_ids,
                                                      salt, copies)  # fmt: skip

    def _put_pending(self, name: str, h: int, token_ids, salt, arrays) -> None:
        try:
            self.put(h, token_ids, salt, arrays)
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def wait(self) -> None:
        """Returns when every write put_async queued is on disk (or failed, logged)."""
        with self._lock:
            futures = list(self._pending.values())
        concurrent.futures.wait(futures)

    def put(self, h: int, token_ids, salt, arrays: list[np.ndarray]) -> None:
        """Writes a page (its arrays: every leaf of one host page) whole."""
        name = self._name(h)
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
                return
            if name in self._pending and not _on_writer():
                return  # the writer thread writes it (same bytes)
        header = self._header(h, token_ids, salt, arrays)
        body = MAGIC + struct.pack("<I", len(header)) + header
        body += b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        data = body + hashlib.sha256(body).digest()
        path = self.directory / name
        tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only disk costs the page, not the step
            logger.warning("KV disk tier: cannot write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            if name in self._files:  # written meanwhile by the other thread: same bytes
                return
            self._files[name] = len(data)
            self.num_bytes += len(data)
            self.num_written += 1
            self.bytes_written += len(data)
            self._trim()

    def get(self, h: int, token_ids, salt, like: list[np.ndarray]) -> list[np.ndarray] | None:
        """The page's arrays (the dtypes and shapes of `like`), or None: no file, or one
        whose length, checksum or header is not this page's (removed)."""
        with self._lock:
            return self._get(h, token_ids, salt, like)

    def _get(self, h: int, token_ids, salt, like: list[np.ndarray]) -> list[np.ndarray] | None:
        name = self._name(h)
        if name not in self._files:
            return None
        header = self._header(h, token_ids, salt, like)
        start = len(MAGIC) + 4 + len(header)
        size = start + sum(a.nbytes for a in like) + 32
        try:
            data = (self.directory / name).read_bytes()
        except OSError:
            data = b""
        ok = (
            len(data) == size
            and data[: len(MAGIC)] == MAGIC
            and data[len(MAGIC) : start] == struct.pack("<I", len(header)) + header
            and hashlib.sha256(data[:-32]).digest() == data[-32:]
        )
        if not ok:
            self.num_bad += 1
            self._remove(name)
            return None
        self._files.move_to_end(name)
        out, offset = [], start
        for a in like:
            out.append(np.frombuffer(data, a.dtype, a.size, offset).reshape(a.shape))
            offset += a.nbytes
        self.num_read += 1
        self.bytes_read += len(data)
        return out

    def _remove(self, name: str) -> None:
        self.num_bytes -= self._files.pop(name, 0)
        (self.directory / name).unlink(missing_ok=True)

    def _trim(self) -> None:
        while self.num_bytes > self.max_bytes and self._files:
            self._remove(next(iter(self._files)))

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        return {
            "disk_files": len(self._files),
            "disk_bytes": self.num_bytes,
            "disk_pages_written": self.num_written,
            "disk_pages_read": self.num_read,
            "disk_bytes_written": self.bytes_written,
            "disk_bytes_read": self.bytes_read,
            "disk_bad_files": self.num_bad,
        }


def _on_writer() -> bool:
    return threading.current_thread().name.startswith("jpaged-kv-disk")
