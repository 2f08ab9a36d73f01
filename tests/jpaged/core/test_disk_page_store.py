"""The disk tier under the host tier (jpaged/core/disk_page_store.py, --kv-offload-dir).

Files round-trip a page's arrays; a torn, corrupt or foreign file is a miss (and removed),
never wrong K/V; the directory stays under its bytes. A host store over a numpy host array
spills its evicted pages to disk and reads them back into host pages, bytes equal. An engine
restarted on the same directory hits the pages the first one wrote (a warm restart), and with
write-through and the shutdown flush (jpaged/core/disk_flush.py) every full page of a
session's previous turn.
"""

import numpy as np
import pytest
from test_memory import make_engine  # page_size 4, max_model_len 64, one bucket

from jpaged import SamplingParams
from jpaged.config import CacheConfig
from jpaged.core.disk_flush import flush_to_disk
from jpaged.core.disk_page_store import DiskPageStore
from jpaged.core.host_page_store import HostPageStore
from pallas_kernels import kv_quant


def page(seed, shape=(2, 2, 3, 4, 8)):
    """A page's arrays as an int8 host array holds them: values [2, H, L, page_size, D] and
    scales [2, H, L, page_size] (bfloat16)."""
    rng = np.random.default_rng(seed)
    scales = kv_quant.zeros((1,) + shape, np.dtype(np.int8), xp=np).scales.dtype
    return [
        rng.integers(-128, 127, shape, dtype=np.int8),
        rng.random(shape[:-1], dtype=np.float32).astype(scales),
    ]


def test_a_page_file_round_trips_and_a_damaged_one_is_a_miss(tmp_path):
    disk = DiskPageStore(tmp_path, max_bytes=1 << 20)
    arrays = page(0)
    disk.put(7, (1, 2, 3, 4), None, arrays)
    (path,) = tmp_path.glob("*.kvpage")
    got = disk.get(7, (1, 2, 3, 4), None, arrays)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, arrays))
    # Another page's tokens or salt under the same name: a miss (the file is removed).
    assert disk.get(7, (1, 2, 3, 5), None, arrays) is None
    disk.put(7, (1, 2, 3, 4), None, arrays)
    assert disk.get(7, (1, 2, 3, 4), "salt", arrays) is None
    disk.put(7, (1, 2, 3, 4), None, arrays)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the checksum
    assert disk.get(7, (1, 2, 3, 4), None, arrays) is None and not path.exists()
    disk.put(7, (1, 2, 3, 4), None, arrays)
    path.write_bytes(data[: len(data) // 2])  # torn
    assert disk.get(7, (1, 2, 3, 4), None, arrays) is None and not path.exists()
    disk.put(7, (1, 2, 3, 4), None, arrays)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF  # a value's byte: the checksum no longer matches
    path.write_bytes(bytes(flipped))
    assert disk.get(7, (1, 2, 3, 4), None, arrays) is None
    assert disk.stats()["disk_bad_files"] == 5 and disk.stats()["disk_files"] == 0


def test_an_asynchronous_write_lands_whole_once_and_is_read_back(tmp_path):
    disk = DiskPageStore(tmp_path, 1 << 20)
    arrays = page(5)
    want = [a.copy() for a in arrays]
    disk.put_async(7, (1, 2), None, arrays)
    disk.put_async(7, (1, 2), None, arrays)  # queued once
    for a in arrays:
        a[...] = 0  # the caller's host page handed out anew: the write has its own copy
    disk.wait()
    assert 7 in disk and disk.stats()["disk_pages_written"] == 1
    got = disk.get(7, (1, 2), None, want)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_directory_stays_under_its_bytes_least_recently_used_removed_first(tmp_path):
    arrays = page(0)
    probe = DiskPageStore(tmp_path / "probe", max_bytes=1 << 20)
    probe.put(1, (1,), None, arrays)
    size = probe.num_bytes
    disk = DiskPageStore(tmp_path / "d", max_bytes=3 * size)
    for h in (1, 2, 3):
        disk.put(h, (h,), None, arrays)
    assert disk.get(1, (1,), None, arrays) is not None  # 1 is now the most recent
    disk.put(4, (4,), None, arrays)
    assert (1 in disk, 2 in disk, 3 in disk, 4 in disk) == (True, False, True, True)
    assert disk.num_bytes == 3 * size == sum(p.stat().st_size for p in disk.directory.iterdir())
    again = DiskPageStore(tmp_path / "d", max_bytes=2 * size)  # a restart with less room
    assert len(list(again.directory.iterdir())) == 2 and again.num_bytes <= 2 * size


def spilled_store(tmp_path):
    """A host store of 2 int8 pages over a disk tier, after 3 offloads of page(i) under
    keys[i] (the third evicts the first: spilled; key 1 is the least recent in memory):
    (store, its host array, keys)."""
    shape = (2, 2, 3, 3, 4, 8)  # [2, H, L, host pages + 1, page_size, D]
    host = kv_quant.zeros(shape, np.dtype(np.int8), xp=np)
    store = HostPageStore(
        2, page_bytes=1, page_size=4, identity="m", host_array=host,
        disk=DiskPageStore(tmp_path, max_bytes=1 << 20),
    )  # fmt: skip
    keys = [(store.page_hash(None, (i,) * 4, None), (i,) * 4) for i in range(3)]
    for i, (h, tokens) in enumerate(keys):
        p = store.offload_page(h, tokens, None)
        for leaf, a in zip(jax_leaves(host), page(i)):  # the runner's copy
            leaf[:, :, :, p] = a
        store.end_plan(1, 0)
    return store, host, keys


def test_the_host_store_spills_to_disk_and_reads_back_the_same_bytes(tmp_path):
    store, host, keys = spilled_store(tmp_path)
    written = {0: page(0)}
    assert store.stats()["disk_pages_written"] == 1
    assert store.pages.lookup(*keys[0], salt=None) is None  # not in host memory
    p = store.lookup(*keys[0], None)  # read back from disk, evicting key 1 (spilled)
    assert p is not None and store.num_disk_hits == 1
    for leaf, a in zip(jax_leaves(host), written[0]):
        np.testing.assert_array_equal(leaf[:, :, :, p], a)
    store.load(p)
    store.end_plan(0, 1)
    assert store.stats()["disk_pages_written"] == 2 and store.num_used() == 0


def test_a_read_back_never_takes_a_page_found_earlier_in_the_same_plan(tmp_path):
    store, host, keys = spilled_store(tmp_path)
    found = store.lookup(*keys[1], None)  # a prompt's first page: in memory
    again = store.lookup(*keys[0], None)  # its second: read back from disk
    assert found is not None and again is not None and again != found
    for leaf, a in zip(jax_leaves(host), page(1)):  # still key 1's bytes
        np.testing.assert_array_equal(leaf[:, :, :, found], a)
    store.end_plan(0, 0)
    assert store.num_used() == 0


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_the_disk_tier_needs_the_host_tier():
    with pytest.raises(ValueError, match="kv_offload_dir .* needs the host tier"):
        CacheConfig(kv_offload_dir="/tmp/x", kv_offload_bytes=0)
    with pytest.raises(ValueError, match="kv_offload_dir_bytes must be a positive"):
        CacheConfig(kv_offload_dir_bytes=0)


def run(engine, rid, tokens, params):
    """A request run to its end; its tokens."""
    engine.add_request(rid, tokens, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o.outputs[0].token_ids
    return out


def test_a_restarted_engine_hits_the_pages_its_predecessor_wrote(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    # 8 host pages of 2 KiB (float32): most evicted pages go on to disk.
    kwargs = dict(num_pages=17, kv_offload_bytes=9 * 2048, kv_offload_dir=str(tmp_path))
    vocab_rng = np.random.default_rng(2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = make_engine(path, **kwargs)
    vocab = first.model_config.vocab_size
    prompt = vocab_rng.integers(3, vocab, 21).tolist()  # 5 full pages

    want = run(first, "a", prompt, params)
    for i in range(3):  # fill the pool and the host: a's pages go to disk
        run(first, f"x{i}", vocab_rng.integers(3, vocab, 60).tolist(), params)
    first.host_store.disk.wait()  # the writes through on the writer thread
    assert first.stats()["disk_pages_written"] >= 5
    del first
    second = make_engine(path, **kwargs)
    assert run(second, "a", prompt, params) == want
    stats = second.stats()
    assert stats["disk_hit_pages"] == 5 and stats["host_hit_tokens"] == 20
    assert stats["prefix_cache_hit_tokens"] == 20 and stats["disk_bad_files"] == 0


def test_write_through_and_the_flush_warm_restart_a_whole_session(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    # 32 host pages of 2 KiB (float32): nothing spills from host, so only write-through
    # and the flush put pages on disk.
    kwargs = dict(num_pages=17, kv_offload_bytes=33 * 2048, kv_offload_dir=str(tmp_path))
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = make_engine(path, **kwargs)
    vocab = first.model_config.vocab_size
    turn1 = rng.integers(3, vocab, 21).tolist()
    out1 = run(first, "t1", turn1, params)  # its K/V: 24 tokens, 6 full pages
    assert first.stats()["disk_files"] == 0  # nothing left the device yet
    other = rng.integers(3, vocab, 60).tolist()
    out_other = run(first, "x", other, params)  # evicts t1's pages to host
    first.host_store.disk.wait()  # written through on the writer thread
    stats = first.stats()
    assert stats["host_offloaded_pages"] >= 6 and stats["disk_pages_written"] == stats[
        "host_offloaded_pages"
    ]  # written through as they entered the host tier
    assert stats["disk_files"] == stats["host_offloaded_pages"]
    device = [e.hash for _, e in first.allocator.cached_pages()]
    missing = sum(h not in first.host_store.disk for h in device)
    assert missing > 0  # pages only the device holds
    assert flush_to_disk(first) == missing
    assert all(h in first.host_store.disk for h in device)
    assert flush_to_disk(first) == 0  # nothing left to write
    turn2 = turn1 + out1 + rng.integers(3, vocab, 8).tolist()  # 33 tokens
    want = run(first, "t2", turn2, params)  # the engine serves on after a flush
    del first
    second = make_engine(path, **kwargs)
    assert run(second, "t2", turn2, params) == want
    stats = second.stats()
    assert stats["disk_hit_pages"] == 6 and stats["prefix_cache_hit_tokens"] == 24
    # x's pages were only on the device when the flush wrote them: 14 full prompt pages hit
    assert run(second, "x", other, params) == out_other
    stats = second.stats()
    assert stats["disk_hit_pages"] == 6 + 14 and stats["prefix_cache_hit_tokens"] == 24 + 56
    assert stats["disk_bad_files"] == 0
