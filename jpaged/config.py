"""Engine configuration: frozen, validated on construction, hashable.

CacheConfig sizes the page pool; SchedulerConfig bounds each step; ParallelConfig says how
many devices a replica spans (tensor parallel) and how many replicas serve (data parallel);
EngineConfig holds them with the model path and numeric settings. The shape buckets every
step is padded into are derived here, so the number of compiled programs is known before anything runs.
"""

from __future__ import annotations

import dataclasses
import math

KV_ALLOCATIONS = ("paged", "reserve")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = (None, "reference", "pallas", "pallas_interpret")
DEFAULT_SWAP_SPACE_BYTES = 4 * 2**30  # vLLM's default swap space


def _positive(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... up to and including hi (hi itself is always the last bucket)."""
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # budget for K and V pages of all layers
    kv_memory_fraction: float = 0.8  # of free accelerator memory, when neither is given
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"
    # Host memory for preemption_mode="swap": pages of all layers' K and V, given as a page
    # count or a byte budget (default 4 GiB when neither is given). Unused under "recompute".
    num_swap_pages: int | None = None
    swap_space_bytes: int | None = None

    def __post_init__(self) -> None:
        _positive("page_size", self.page_size)
        _positive("num_pages", self.num_pages, allow_none=True)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        _positive("num_swap_pages", self.num_swap_pages, allow_none=True)
        _positive("swap_space_bytes", self.swap_space_bytes, allow_none=True)
        if self.num_swap_pages is not None and self.swap_space_bytes is not None:
            raise ValueError(
                f"give num_swap_pages ({self.num_swap_pages}) or swap_space_bytes "
                f"({self.swap_space_bytes}), not both"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation must be one of {KV_ALLOCATIONS}, got {self.kv_allocation!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = True
    min_token_bucket: int = 16
    min_seq_bucket: int = 4
    min_page_bucket: int = 4

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # devices per replica (weights and KV heads split over them)
    data_parallel_size: int = 1  # replicas, each with its own pool and scheduler

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str | None = None  # None: the built-in demo model
    dtype: str | None = None  # None: bfloat16 on accelerators, float32 on CPU
    seed: int = 0
    attention_backend: str | None = None  # None: the best for the platform
    precompile: bool = False
    # Schedule and pack step N+1 while the device runs step N (its sampled tokens stay on the
    # device and feed N+1); steps with penalties, and multi-host runs, stay synchronous.
    async_scheduling: bool = True
    # JAX's persistent compilation cache: "auto" = $JPAGED_CACHE_DIR/xla or ~/.cache/jpaged/xla,
    # a path, or None to turn it off (see jpaged/compilation_cache.py).
    compilation_cache_dir: str | None = "auto"
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.scheduler.max_model_len / self.cache.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        s = self.scheduler
        return powers_of_two(min(s.min_token_bucket, s.max_num_batched_tokens), s.max_num_batched_tokens)

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        s = self.scheduler
        return powers_of_two(min(s.min_seq_bucket, s.max_num_seqs), s.max_num_seqs)

    @property
    def page_buckets(self) -> tuple[int, ...]:
        m = self.max_pages_per_seq
        return powers_of_two(min(self.scheduler.min_page_bucket, m), m)
