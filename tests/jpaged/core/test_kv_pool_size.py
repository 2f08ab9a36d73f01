"""The default KV pool's size (jpaged/core/memory_plan.py resolve_num_pages): on CPU every slot at
max_model_len plus the null page, capped at HOST_KV_MEMORY_SHARE of the host's available
memory; explicit --num-pages and --kv-cache-memory-bytes win; the choice is logged once;
a capped pool too small for one sequence meets fit_max_model_len. No model is loaded."""

from __future__ import annotations

import logging

import pytest

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core import memory_plan as engine_mod
from jpaged.core.memory_plan import HOST_KV_MEMORY_SHARE, fit_max_model_len, resolve_num_pages
from models.config import ModelConfig

CFG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=4096,
)  # fmt: skip
PER_PAGE = 2 * 2 * 4 * 16 * 8 * 4  # K and V, layers, kv heads, page of 16, head_dim, f32: 8 KiB


def _config(num_seqs: int, max_len: int, **cache) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(page_size=16, **cache),
        scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_model_len=max_len),
    )


def _pages(config: EngineConfig) -> int:
    return resolve_num_pages(config.cache, config, CFG, 4)


@pytest.fixture
def plenty(monkeypatch):
    monkeypatch.setattr(engine_mod, "available_host_memory", lambda: 64 << 30)


@pytest.mark.parametrize(
    "num_seqs,max_len,pages",
    [(1, 2048, 129), (32, 2048, 32 * 128 + 1), (3, 100, 3 * 7 + 1), (4, 16, 5)],
)
def test_a_cpu_pool_holds_every_slot_at_max_model_len(plenty, num_seqs, max_len, pages):
    assert _pages(_config(num_seqs, max_len)) == pages


def test_a_cpu_pool_is_capped_by_a_share_of_available_memory(monkeypatch, caplog):
    available = 100 * PER_PAGE * 4  # a 25% share holds 100 pages
    assert HOST_KV_MEMORY_SHARE == 0.25
    monkeypatch.setattr(engine_mod, "available_host_memory", lambda: available)
    with caplog.at_level(logging.INFO, logger="jpaged.core.memory_plan"):
        assert _pages(_config(32, 2048)) == 101  # 4,097 wanted
    [line] = [r.getMessage() for r in caplog.records if "KV pool" in r.getMessage()]
    assert line == (
        "KV pool: 101 pages of 16 tokens (1600 tokens, 0 MiB): max_num_seqs 32 x max_model_len "
        "2048 tokens would take 32 MiB, capped at 25% of 3 MiB available host memory; "
        "--num-pages, --kv-cache-memory-bytes or a lower --max-num-seqs set it"
    )
    assert _pages(_config(1, 1024)) == 65  # what one slot uses is under the cap
    monkeypatch.setattr(engine_mod, "available_host_memory", lambda: None)
    assert _pages(_config(32, 2048)) == 4097  # unknown memory: no cap


def test_a_capped_pool_too_small_for_one_sequence_is_fitted_or_refused(monkeypatch):
    monkeypatch.setattr(engine_mod, "available_host_memory", lambda: 10 * PER_PAGE * 4)
    config = _config(4, 2048)
    pages = _pages(config)
    assert pages == 11
    fitted = fit_max_model_len(config, pages, given=False)
    assert fitted.scheduler.max_model_len == 160  # 10 usable pages of 16 tokens
    with pytest.raises(ValueError, match="max_model_len 2048 needs 128 KV pages"):
        fit_max_model_len(config, pages, given=True)


def test_explicit_sizes_win_over_the_default_and_its_cap(monkeypatch, caplog):
    monkeypatch.setattr(engine_mod, "available_host_memory", lambda: 4 * PER_PAGE)  # 1 page
    with caplog.at_level(logging.INFO, logger="jpaged.core.memory_plan"):
        assert _pages(_config(32, 2048, num_pages=5000)) == 5000
        assert _pages(_config(32, 2048, kv_cache_memory_bytes=300 * PER_PAGE)) == 301
    lines = [r.getMessage() for r in caplog.records if "KV pool" in r.getMessage()]
    budget = f"--kv-cache-memory-bytes {300 * PER_PAGE}"
    assert lines == [
        "KV pool: 5000 pages of 16 tokens (79984 tokens, 39 MiB): --num-pages",
        f"KV pool: 301 pages of 16 tokens (4800 tokens, 2 MiB): {budget}",
    ]


def test_available_host_memory_reads_the_os():
    available = engine_mod.available_host_memory()
    assert available is not None and available > 1 << 20
