"""The KV host tier on a model with paging groups (jpaged/core/kv_cache_manager.py: a full
first group and sliding-window groups anchored to it): a window group offloads its evicted
pages under its own sha256 keys and loads back only the pages of its window at the hit's end
(_group_host_hits). Multi-turn sessions on a pool that holds one sequence give the tokens of
an engine whose pool holds them all, with host hits loaded in both groups; tiny random
Gemma 2 (4 layers alternating window 8 and full: two groups of two layers, pages of 4)."""

from __future__ import annotations

import numpy as np
import pytest
from test_host_page_store import sessions
from test_memory import make_engine  # page_size 4, max_model_len 64, one bucket


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    import transformers
    from dense_families import save_tiny

    config = transformers.Gemma2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=256,
        initializer_range=0.1, num_hidden_layers=4, query_pre_attn_scalar=24,
    )  # fmt: skip
    return save_tiny(tmp_path_factory.mktemp("gemma2_tier") / "gemma2", config)


def test_window_groups_through_the_host_tier_give_the_same_tokens(gemma2):
    ref = make_engine(gemma2, num_pages=8 * 16 * 2 + 1)
    # 36 group pages: 16 full and 3 window pages hold one 64-token sequence, not three.
    tier = make_engine(gemma2, num_pages=19, kv_offload_bytes=1 << 20)
    assert tier.scheduler.kv.host is not None and tier.scheduler.kv.num_groups == 2
    want, _, _, ref_stats = sessions(ref)
    got, computed, once, stats = sessions(tier)
    assert got == want
    assert ref_stats["num_preemptions"] == 0
    # Histories came back from host: each hit position loaded its full-group page, and the
    # window groups their pages of the window at the hit's end (counted apart from hits).
    assert stats["host_hit_pages"] > 0 and stats["host_offloaded_pages"] > 0
    assert stats["host_pages_in"] > stats["host_hit_pages"]
    assert computed < once


def test_the_stop_flush_writes_window_groups_and_a_restart_hits_them(gemma2, tmp_path):
    # jpaged/core/disk_flush.py at a server's stop: every cached device page, the window
    # group's too (their own sha256 keys), reaches the disk tier; an engine restarted on the
    # directory loads both groups' pages of a prefix back and gives the same tokens.
    from test_disk_page_store import run

    from jpaged import SamplingParams
    from jpaged.core.disk_flush import flush_to_disk

    kwargs = dict(num_pages=19, kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path))
    first = make_engine(gemma2, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(4)
    turn1 = rng.integers(3, 320, 30).tolist()
    out1 = run(first, "t1", turn1, params)
    cached = first.allocator.cached_pages()
    window = [e for _, e in cached if isinstance(e.salt, tuple)]  # (salt, group 1)
    assert window and len(window) < len(cached)
    assert flush_to_disk(first) == len(cached)  # nothing had left the device
    assert all(e.hash in first.host_store.disk for _, e in cached)
    turn2 = turn1 + out1 + rng.integers(3, 320, 6).tolist()  # 40 tokens
    want = run(first, "t2", turn2, params)
    del first
    second = make_engine(gemma2, **kwargs)
    assert run(second, "t2", turn2, params) == want
    stats = second.stats()
    # 8 full pages hit (32 tokens; turn 1's 34 tokens less its partial page), the full
    # group's 8 and the window group's pages of the window at 32 read from disk.
    assert stats["prefix_cache_hit_tokens"] == 32 and stats["host_hit_pages"] == 8
    assert stats["disk_hit_pages"] > 8 and stats["disk_bad_files"] == 0
