"""Writes the KV cache's pages to the disk tier at shutdown (--kv-offload-dir), so that an
engine restarted on the same directory finds whole sessions there.

Pages reach the disk tier when they enter the host tier (HostPageStore.write_through); a
page still only in the device's prefix cache when the engine stops would be lost. The flush
copies every cached device page not yet on disk through the host tier (the device -> host
copies of ModelRunner.swap, in batches the host tier has room for) and writes it, under the
directory's size bound as every write. Every paging group's cached pages: a window group's
(Gemma 2/3, gpt-oss) are cached under their own sha256 keys and salts, and a restarted
engine loads them back beside the full group's (tests/jpaged/core/test_host_tier_groups.py).
"""

from __future__ import annotations

import logging

from jpaged.worker import step_plan

logger = logging.getLogger(__name__)


def flush_to_disk(engine) -> int:
    """Writes engine's pending host pages and its device cache's pages to the disk tier (a
    data-parallel engine's: every replica's); the number of pages written (0 without a disk
    tier). The engine must be idle: no step runs in between (called by the server's step
    thread as it stops, or by the offline user)."""
    return sum(_flush(e) for e in getattr(engine, "replicas", [engine]))


def _flush(engine) -> int:
    store = getattr(engine, "host_store", None)
    if store is None or store.disk is None:
        return 0
    written = store.write_through()
    store.disk.wait()  # so that `in store.disk` below is every page written
    todo = [(p, e) for p, e in engine.allocator.cached_pages() if e.hash not in store.disk]
    room = store.num_usable_pages - store.num_used()  # host pages a batch may take
    if todo and room < 1:
        logger.warning("KV disk flush: every host page is in use; %d pages not written", len(todo))
        store.disk.wait()
        return written
    for i in range(0, len(todo), room):
        copies = []
        for page, entry in todo[i : i + room]:
            host_page = store.offload_page(entry.hash, entry.token_ids, entry.salt)
            if host_page is not None:
                copies.append((page, host_page))
        plan = step_plan.build([], page_size=1, eos_token_ids=(), page_updates=[],
                               page_copies=[], swap_out=copies, swap_in=[])  # fmt: skip
        engine.runner.swap(plan)
        engine.runner.flush_host_writes()
        store.end_plan(len(copies), 0)
        written += store.write_through()
    store.disk.wait()
    return written
