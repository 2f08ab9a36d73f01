"""Prometheus metrics for the server, on their own registry; and the one "request done" record.

Request metrics are recorded by the gRPC and HTTP handlers when a call ends (record_request,
which also writes the request's log line); engine metrics (queues, KV pages, prefix cache,
preemptions, compilations, speculative decoding) are copied from the engine's stats() by the
step thread after every step. prometheus-client metrics are thread-safe, so both sides write
directly. The registry is served on --metrics-port and on the HTTP API's /metrics; prometheus-client's
`*_created` series are off (they doubled the page and say nothing here).
"""

from __future__ import annotations

import logging
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)

logger = logging.getLogger("jpaged.server")

# Outcomes of a request (gRPC Generate, HTTP completion), the label of jpaged_requests_total.
OUTCOMES = (
    "stop",  # finished: EOS, stop token or stop string
    "length",  # finished: max_tokens or context
    "abort",  # Abort RPC or drain
    "cancelled",  # the client cancelled, disconnected or passed its deadline
    "invalid_argument",
    "resource_exhausted",
    "unavailable",  # refused while draining
    "internal",
    "unauthenticated",  # no or a wrong API key
)

# Engine stats copied into counters: stats key -> attribute of Metrics.
_COUNTED = {
    "prefix_cache_query_tokens": "prefix_query_tokens",
    "prefix_cache_hit_tokens": "prefix_hit_tokens",
    "num_preemptions": "preemptions",
    "num_swaps_out": "swaps_out",
    "num_swaps_in": "swaps_in",
    "num_compiles": "compiles",
    "compile_seconds": "compile_seconds",
    "num_recompiles": "recompiles",
}
# Speculative decoding: stats key -> help; exported as vLLM's spec_decode counters,
# jpaged_spec_decode_num_drafts_total and so on.
_SPEC_DECODE = {
    "spec_num_drafts": "Speculative proposals (one per sequence that proposed in a step)",
    "spec_num_draft_tokens": "Tokens proposed for verification",
    "spec_num_accepted_tokens": "Proposed tokens the target model accepted",
}

# The host tier of the KV cache (jpaged/core/host_page_store.py): stats key -> help;
# counters jpaged_kv_host_hit_tokens_total and so on, and gauges of its pages.
_KV_HOST_COUNTED = {
    "host_hit_tokens": "Prompt tokens found in the host tier (also in prefix_cache_hit_tokens)",
    "host_offloaded_pages": "Pages evicted from the device prefix cache and kept in host memory",
    "host_pages_out": "KV pages copied device -> host (offloads and swap-outs)",
    "host_pages_in": "KV pages copied host -> device (host hits and swap-ins)",
    "host_bytes_out": "Bytes of KV pages copied device -> host",
    "host_bytes_in": "Bytes of KV pages copied host -> device",
    "host_copy_seconds": "Seconds the steps' host copies took (before their steps)",
    "disk_hit_pages": "Pages read back from the disk tier (--kv-offload-dir) into host memory",
    "disk_pages_written": "Pages the host tier evicted, written to the disk tier",
    "disk_bytes_written": "Bytes of page files written to the disk tier",
    "disk_bytes_read": "Bytes of page files read from the disk tier",
    "disk_bad_files": "Disk-tier page files found torn or corrupt (treated as misses, removed)",
}
_KV_HOST_GAUGES = {
    "host_pages_total": "Host KV pages (the host tier and swap space)",
    "host_pages_used": "Host KV pages held by swapped sequences",
    "host_pages_cached": "Host KV pages holding prefix-cache content",
    "disk_files": "Page files in the disk tier",
    "disk_bytes": "Bytes of the disk tier's page files",
}

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # process-wide in prometheus-client: no *_created series
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "jpaged_requests",
            "Requests (gRPC Generate, HTTP completions) by outcome",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros, so rates exist from the start
        self.prompt_tokens = Counter(
            "jpaged_prompt_tokens", "Prompt tokens of finished or aborted requests", registry=r
        )
        self.generation_tokens = Counter(
            "jpaged_generation_tokens", "Tokens generated (all choices)", registry=r
        )
        self.ttft = Histogram(
            "jpaged_time_to_first_token_seconds",
            "From receiving a request to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "jpaged_time_per_output_token_seconds",
            "Mean time between tokens after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jpaged_request_latency_seconds",
            "From receiving a request to its end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.num_running = Gauge("jpaged_num_requests_running", "Requests running", registry=r)
        self.num_waiting = Gauge("jpaged_num_requests_waiting", "Requests waiting", registry=r)
        self.pages_total = Gauge("jpaged_kv_pages_total", "KV-cache pages in the pool", registry=r)
        self.pages_used = Gauge("jpaged_kv_pages_used", "KV-cache pages held", registry=r)
        self.pages_free = Gauge("jpaged_kv_pages_free", "KV-cache pages free", registry=r)
        self.pages_cached = Gauge(
            "jpaged_kv_pages_cached", "Free pages still holding prefix-cache content", registry=r
        )
        self.weight_bytes = Gauge(
            "jpaged_weight_bytes", "Resident bytes of the model weights (quantized: with scales)",
            registry=r,
        )
        self.kv_bytes_per_token = Gauge(
            "jpaged_kv_bytes_per_token",
            "Bytes of one token's K and V in every layer (scales included), by KV page dtype",
            ["kv_cache_dtype"], registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "jpaged_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up",
            registry=r,
        )
        self.prefix_query_tokens = Counter(
            "jpaged_prefix_cache_query_tokens", "Prompt tokens looked up", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "jpaged_prefix_cache_hit_tokens", "Prompt tokens found in the cache", registry=r
        )
        self.preemptions = Counter("jpaged_preemptions", "Requests preempted", registry=r)
        self.swaps_out = Counter(
            "jpaged_swaps_out", "Preempted sequences whose KV pages went to host memory", registry=r
        )
        self.swaps_in = Counter(
            "jpaged_swaps_in", "Swapped sequences whose KV pages came back", registry=r
        )
        self.compiles = Counter(
            "jpaged_compiles",
            "Programs compiled (step buckets, prelude, swap copies), warm-up included",
            registry=r,
        )
        self.compile_seconds = Counter(
            "jpaged_compile_seconds", "Seconds spent compiling programs", registry=r
        )
        self.recompiles = Counter(
            "jpaged_recompiles",
            "Step programs compiled after --precompile (0 unless a sequence outgrows "
            "--precompile-max-len)",
            registry=r,
        )
        self.spec_decode = {
            key: Counter("jpaged_spec_decode_" + key.removeprefix("spec_"), doc, registry=r)
            for key, doc in _SPEC_DECODE.items()
        }
        self.kv_host = {
            key: Counter("jpaged_kv_" + key, doc, registry=r)
            for key, doc in _KV_HOST_COUNTED.items()
        }
        self.kv_host_gauges = {
            key: Gauge("jpaged_kv_" + key, doc, registry=r) for key, doc in _KV_HOST_GAUGES.items()
        }
        # engine stats key -> the counter that follows it
        self._counters = (
            {k: getattr(self, a) for k, a in _COUNTED.items()} | self.spec_decode | self.kv_host
        )
        self._last = dict.fromkeys(self._counters, 0)
        self._http: WSGIServer | None = None

    def observe_engine(self, stats: dict) -> None:
        """Copies one engine stats() snapshot (plus num_running / num_waiting) into gauges."""
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.pages_total.set(stats["pages_total"])
        self.pages_used.set(stats["pages_used"])
        self.pages_free.set(stats["pages_free"])
        self.pages_cached.set(stats["pages_cached"])
        if "weight_bytes" in stats:  # an engine's (fake engines in tests may leave it out)
            self.weight_bytes.set(stats["weight_bytes"])
        if "kv_bytes_per_token" in stats:  # an engine's (fake engines may leave it out)
            dtype = stats["kv_cache_dtype"]
            self.kv_bytes_per_token.labels(kv_cache_dtype=dtype).set(stats["kv_bytes_per_token"])
        for key, gauge in self.kv_host_gauges.items():
            gauge.set(stats.get(key, 0))
        query, hit = stats["prefix_cache_query_tokens"], stats["prefix_cache_hit_tokens"]
        self.prefix_hit_rate.set(hit / query if query else 0.0)
        for key, counter in self._counters.items():
            # an engine without swap, compile or speculation counts reports 0
            value = stats.get(key, 0)
            delta = value - self._last[key]
            if delta > 0:
                counter.inc(delta)
            self._last[key] = value

    def observe_request(
        self,
        outcome: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        latency_s: float | None = None,
    ) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if latency_s is not None:
            self.e2e.observe(latency_s)

    def render(self) -> bytes:
        """The registry in Prometheus' text format (what /metrics serves)."""
        return generate_latest(self.registry)

    def start_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves /metrics on host:port (0 picks a free port); returns the port."""
        self._http = make_server(
            host, port, make_wsgi_app(self.registry), _ThreadingWSGIServer, _QuietHandler
        )
        threading.Thread(
            target=self._http.serve_forever, args=(0.05,), name="metrics-http", daemon=True
        ).start()
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes every few seconds would flood the log
        pass


def record_request(
    metrics: Metrics | None,
    handles: list,
    outcome: str,
    start: float,
    first_token_time: float | None,
    *,
    request_id: str,
    protocol: str,
) -> None:
    """Logs one "request done" line and records the request's metrics.

    handles: the RequestHandles of the request (one per prompt; gRPC has one).
    """
    end = time.monotonic()
    prompt = sum(h.num_prompt_tokens for h in handles)
    completion = sum(c.num_tokens for h in handles for c in h.choices)
    max_tokens = max((c.num_tokens for h in handles for c in h.choices), default=0)
    ttft = None if first_token_time is None else first_token_time - start
    tpot = (
        (end - first_token_time) / (max_tokens - 1)
        if first_token_time is not None and max_tokens > 1
        else None
    )
    fields = {
        "request_id": request_id,
        "outcome": outcome,
        "protocol": protocol,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_prompt_tokens": sum(h.num_cached_tokens for h in handles),
        "ttft_ms": None if ttft is None else round(ttft * 1e3, 2),
        "latency_ms": round((end - start) * 1e3, 2),
    }
    errors = [str(h.error) for h in handles if h.error is not None]
    if errors:
        fields["error"] = errors[0]
    logger.info("request done", extra={"fields": fields})
    if metrics is not None:
        metrics.observe_request(
            outcome,
            prompt_tokens=prompt,
            completion_tokens=completion,
            ttft_s=ttft,
            tpot_s=tpot,
            latency_s=end - start,
        )


def record_rejection(metrics: Metrics | None, outcome: str, error: Exception, **fields) -> None:
    """Logs and counts a request refused before it reached the engine (fields: request_id,
    protocol ... for the log line)."""
    fields.update(outcome=outcome, error=str(error))
    logger.info("request rejected", extra={"fields": fields})
    if metrics is not None:
        metrics.observe_request(outcome)


def outcome_of(handles: list) -> str:
    """A finished request's outcome: "length" if any choice hit its limit, else "stop"."""
    reasons = {c.finish_reason for h in handles for c in h.choices}
    return "length" if "length" in reasons else "stop"
