"""Engine stats become Prometheus gauges and counters (counters only ever go up)."""

from prometheus_client import CollectorRegistry

from server.metrics import Metrics


def stats(**over):
    base = {
        "num_running": 2,
        "num_waiting": 1,
        "pages_total": 100,
        "pages_used": 30,
        "pages_free": 70,
        "pages_cached": 5,
        "prefix_cache_query_tokens": 40,
        "prefix_cache_hit_tokens": 10,
        "num_preemptions": 3,
        "num_swaps_out": 2,
        "num_swaps_in": 1,
        "num_compiles": 0,
        "compile_seconds": 0.0,
        "num_recompiles": 0,
    }
    base.update(over)
    return base


def value(registry, name):
    return registry.get_sample_value(name)


def test_stats_to_gauges_and_counters():
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.observe_engine(stats())
    assert value(registry, "jpaged_kv_pages_used") == 30
    assert value(registry, "jpaged_prefix_cache_hit_rate") == 0.25
    assert value(registry, "jpaged_swaps_out_total") == 2
    assert value(registry, "jpaged_swaps_in_total") == 1
    m.observe_engine(stats(num_swaps_out=5, num_swaps_in=4, num_recompiles=1, pages_used=0))
    assert value(registry, "jpaged_kv_pages_used") == 0
    assert value(registry, "jpaged_swaps_out_total") == 5
    assert value(registry, "jpaged_swaps_in_total") == 4
    assert value(registry, "jpaged_recompiles_total") == 1
    # reset_stats() on the engine restarts its counts: the Prometheus counters do not go down
    # and count again from the new base.
    m.observe_engine(stats(num_swaps_out=0, num_swaps_in=0, num_preemptions=0))
    m.observe_engine(stats(num_swaps_out=2, num_swaps_in=0, num_preemptions=1))
    assert value(registry, "jpaged_swaps_out_total") == 7
    assert value(registry, "jpaged_preemptions_total") == 4


def test_speculative_decoding_counters():
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.observe_engine(stats())  # an engine without speculation: the counters exist, at 0
    names = [
        f"jpaged_spec_decode_num_{k}_total" for k in ("drafts", "draft_tokens", "accepted_tokens")
    ]
    assert [value(registry, n) for n in names] == [0, 0, 0]
    spec = {"spec_num_drafts": 4, "spec_num_draft_tokens": 12, "spec_num_accepted_tokens": 7}
    m.observe_engine(stats(**spec, spec_mean_acceptance_length=2.75))
    m.observe_engine(stats(**{**spec, "spec_num_drafts": 6, "spec_num_draft_tokens": 15}))
    assert [value(registry, n) for n in names] == [6, 15, 7]


def test_engine_without_swap_counts_reports_zero():
    registry = CollectorRegistry()
    m = Metrics(registry)
    s = stats()
    for key in ("num_swaps_out", "num_swaps_in", "num_recompiles"):
        del s[key]
    m.observe_engine(s)
    assert value(registry, "jpaged_swaps_out_total") == 0
    assert value(registry, "jpaged_recompiles_total") == 0


def test_compiles_and_their_seconds_are_counted():
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.observe_engine(stats())
    assert value(registry, "jpaged_compiles_total") == 0
    # Warm-up compiled 3 programs in 4.5 s, then a new shape mid-run one more in 1.25 s.
    m.observe_engine(stats(num_compiles=3, compile_seconds=4.5))
    m.observe_engine(stats(num_compiles=4, compile_seconds=5.75))
    assert value(registry, "jpaged_compiles_total") == 4
    assert value(registry, "jpaged_compile_seconds_total") == 5.75
    assert value(registry, "jpaged_recompiles_total") == 0  # no --precompile: none "after" it


def test_no_created_series():
    m = Metrics(CollectorRegistry())
    m.observe_request("stop", prompt_tokens=3, completion_tokens=2, ttft_s=0.1, latency_s=0.2)
    text = m.render().decode()
    assert "jpaged_requests_total" in text and "jpaged_time_to_first_token_seconds_bucket" in text
    assert "_created" not in text
