"""jpaged.worker.host_memory: glibc's arenas capped and its free memory returned."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jpaged.worker import host_memory


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


needs_glibc = pytest.mark.skipif(host_memory._libc() is None, reason="needs glibc's malloc")


@needs_glibc
def test_release_returns_freed_heap_pages_to_the_system():
    """Freed chunks between live ones stay resident until malloc_trim gives their pages
    back: 160 MiB of 64 KiB arrays (under malloc's mmap threshold), every other one freed."""
    arrays = [np.ones(16384, np.float32) for _ in range(2560)]  # 64 KiB each, touched
    del arrays[::2]
    before = _rss_mib()
    assert host_memory.release_free_memory() is True
    after = _rss_mib()
    assert before - after > 40, (before, after)  # 80 MiB were free; most pages come back
    assert all(float(a[-1]) == 1.0 for a in arrays)  # the live ones untouched


@needs_glibc
def test_arenas_capped_at_one_per_core():
    assert host_memory.default_arenas() == max(2, os.cpu_count() or 2)
    assert host_memory.limit_malloc_arenas() is True
    assert host_memory.limit_malloc_arenas(3) is True
    with pytest.raises(ValueError, match="malloc arenas must be at least 1, got 0"):
        host_memory.limit_malloc_arenas(0)
    host_memory.limit_malloc_arenas()


def test_without_glibc_both_do_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "_libc", lambda: None)
    assert host_memory.limit_malloc_arenas() is False
    assert host_memory.release_free_memory() is False
