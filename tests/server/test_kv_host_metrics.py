"""The KV cache's host tier in /metrics: counters follow the engine's stats, gauges its pages."""

from prometheus_client import CollectorRegistry
from test_metrics import stats

from jpaged.core.host_page_store import HostPageStore, host_stats
from server.metrics import Metrics


def test_host_tier_stats_become_counters_and_gauges():
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.observe_engine(stats(**host_stats(None, 0.0, 0)))  # no tier: every series at 0
    assert registry.get_sample_value("jpaged_kv_host_hit_tokens_total") == 0
    assert registry.get_sample_value("jpaged_kv_host_pages_total") == 0
    store = HostPageStore(4, page_bytes=100, page_size=16, identity="m")
    h = store.page_hash(None, (1,) * 16, None)
    store.offload_page(h, (1,) * 16, None)
    store.end_plan(1, 0)
    store.load(store.lookup(h, (1,) * 16, None))
    store.end_plan(0, 1)
    m.observe_engine(stats(**host_stats(store, 0.25, 2)))
    want = {
        "jpaged_kv_host_hit_tokens_total": 16,
        "jpaged_kv_host_offloaded_pages_total": 1,
        "jpaged_kv_host_pages_out_total": 1,
        "jpaged_kv_host_bytes_in_total": 100,
        "jpaged_kv_host_copy_seconds_total": 0.25,
        "jpaged_kv_host_pages_total": 4,
        "jpaged_kv_host_pages_cached": 1,
        "jpaged_kv_host_pages_used": 0,
    }
    assert {k: registry.get_sample_value(k) for k in want} == want
