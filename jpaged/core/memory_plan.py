"""MemoryPlan: the KV pool's size, the paging groups and the resolved config, fixed once.

`plan_memory` runs before the engine is built: it resolves the EngineConfig against the model
(max_model_len, buckets), sizes the page pool (num_pages, or a memory budget, or what the
host or device can spare), splits it into paging groups (models/kv_groups.py), fits
max_model_len to the pool when it was not given, turns prefix caching off where keys depend
on the sequence's length (LongRoPE), and sizes the host swap space. The result is one frozen
MemoryPlan; nothing later changes it (the engine, the scheduler and the runner read it).

Invariants: the pool holds one sequence of max_model_len tokens (fit_max_model_len); page 0
is the null page and is counted in num_pages; a grouped pool's page id holds slots_per_page
layers (group_pages).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np

from jpaged.config import DEFAULT_SWAP_SPACE_BYTES, CacheConfig, EngineConfig
from jpaged.core.disk_page_store import DiskPageStore
from jpaged.core.host_page_store import HostPageStore
from jpaged.core.kv_cache_manager import sequence_pages
from models.config import LongRopeScaling, ModelConfig
from models.kv_groups import KVGroups, kv_groups
from models.lora import module_dims
from pallas_kernels import kv_quant

logger = logging.getLogger(__name__)

# The share of the host's available memory (after the weights are loaded) a CPU pool may
# take when no flag sizes it: the host also holds the weights, the compiled programs, the
# Python process and whatever else the machine runs.
HOST_KV_MEMORY_SHARE = 0.25
# The share of available host memory the host KV tier takes by default on an accelerator.
HOST_OFFLOAD_SHARE = 0.25


def available_host_memory() -> int | None:
    """Bytes the OS can give this process without swapping (MemAvailable in /proc/meminfo,
    else free physical pages), None when neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_num_pages(
    cache: CacheConfig,
    config: EngineConfig,
    model_config: ModelConfig,
    itemsize: int,
    *,
    extra_bytes_per_page: int = 0,
    kv_dtype=None,
    reserved_bytes: int = 0,
) -> int:
    """Pool size, logged once with why: num_pages if given, else from the memory budget
    (kv_cache_memory_bytes: the whole pool's bytes); on CPU with neither, what the
    configuration can use, max_num_seqs sequences of max_model_len tokens plus the null page
    (speculative proposals need no page past max_model_len: SpecController.propose caps them),
    capped at HOST_KV_MEMORY_SHARE of the host's available memory; on an accelerator,
    kv_memory_fraction of one device's free memory, where with tensor parallelism a device
    holds 1 / min(T, num_kv_heads) of every page. extra_bytes_per_page: a draft model's K/V
    per page, in the same budget. A pool too small for one max_model_len sequence is then
    refused or fitted by fit_max_model_len. kv_dtype: the pages' dtype (None: itemsize
    bytes per element); an int8/fp8 page counts its rows and scales."""
    per_page = kv_page_bytes(model_config, cache.page_size, itemsize, kv_dtype)
    per_page += extra_bytes_per_page
    if cache.num_pages is not None:
        num_pages, why = cache.num_pages, "--num-pages"
    elif cache.kv_cache_memory_bytes is not None:
        num_pages = max(2, cache.kv_cache_memory_bytes // per_page + 1)
        why = f"--kv-cache-memory-bytes {cache.kv_cache_memory_bytes}"
    else:
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            num_pages, why = _host_pool(config, per_page)
        else:
            # reserved_bytes: what is allocated after the plan (LoRA slots) comes off first
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - reserved_bytes
            shards = min(config.parallel.tensor_parallel_size, model_config.num_kv_heads)
            per_device_page = -(-per_page // shards)
            num_pages = max(2, int(free * cache.kv_memory_fraction) // per_device_page + 1)
            why = f"kv_memory_fraction {cache.kv_memory_fraction} of {free >> 20} MiB free"
    logger.info(
        "KV pool: %d pages of %d tokens (%d tokens, %d MiB): %s",
        num_pages, cache.page_size, (num_pages - 1) * cache.page_size,
        num_pages * per_page >> 20, why,
    )  # fmt: skip
    return num_pages


def lora_slot_bytes(model_config: ModelConfig, config: EngineConfig, itemsize: int) -> int:
    """Device bytes of the LoRA slots (models/lora.py: A [in, N, r] and B [N, r, out] for every
    projection of every layer, in --lora-dtype, auto: the activations' itemsize); 0 with
    LoRA off."""
    lora = config.lora
    if not lora.enable_lora:
        return 0
    itemsize = {"float32": 4, "bfloat16": 2}.get(lora.lora_dtype, itemsize)
    per_rank = sum(i + o for i, o in module_dims(model_config).values())
    return model_config.num_layers * lora.max_loras * lora.max_lora_rank * per_rank * itemsize


def kv_page_bytes(model_config: ModelConfig, page_size: int, itemsize: int, kv_dtype=None) -> int:
    """Bytes of one page of the pool in kv_dtype (None: itemsize bytes per element)."""
    if kv_dtype is None:
        return model_config.kv_bytes_per_page(page_size, itemsize)
    m = model_config
    return kv_quant.bytes_per_page(
        kv_dtype, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, page_size=page_size,
        head_dim=m.head_dim,
    )  # fmt: skip


def _host_pool(config: EngineConfig, per_page: int) -> tuple[int, str]:
    """A CPU pool's default pages and why: every slot at max_model_len, capped by memory."""
    s = config.scheduler
    want = s.max_num_seqs * config.max_pages_per_seq + 1
    why = f"max_num_seqs {s.max_num_seqs} x max_model_len {s.max_model_len} tokens"
    available = available_host_memory()
    if available is None:
        return want, why
    cap = max(2, int(available * HOST_KV_MEMORY_SHARE) // per_page + 1)
    if cap >= want:
        return want, why
    return cap, (
        f"{why} would take {want * per_page >> 20} MiB, capped at {HOST_KV_MEMORY_SHARE:.0%} "
        f"of {available >> 20} MiB available host memory; --num-pages, "
        "--kv-cache-memory-bytes or a lower --max-num-seqs set it"
    )


def fit_max_model_len(
    config: EngineConfig, num_pages: int, *, given: bool,
    group_windows: tuple[int | None, ...] = (None,),
) -> EngineConfig:  # fmt: skip
    """config with a max_model_len one sequence of which fits a pool of num_pages pages.

    A sequence of max_model_len tokens needs ceil(max_model_len / page_size) pages of the
    pool's num_pages - 1 (page 0 is the null page; a draft model's K/V uses the same page ids,
    inside the same memory budget): a pool with fewer could never hold it, whatever is
    preempted. Speculative proposals need no page past it: SpecController.propose caps them so
    that a verifying step writes positions below max_model_len only. group_windows: the
    windows of a model's paging groups when it has several (models/kv_groups.py): it needs
    that many in each full group and at most its window's in each windowed one
    (kv_cache_manager.sequence_pages).

    Raises ValueError (both figures and the fixes) when max_model_len was given and does not
    fit; when it was not given, lowers it to the largest that fits and logs that once.
    """
    ps = config.cache.page_size
    max_len = config.scheduler.max_model_len
    usable = num_pages - 1
    if len(group_windows) == 1:
        fits = usable * ps
        need = -(-max_len // ps)
    else:  # the longest sequence that fits (sequence_pages grows with its length)
        lo, hi = 0, max_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sequence_pages(config, group_windows, mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        fits = lo
        need = sequence_pages(config, group_windows, max_len)
    if max_len <= fits:
        return config
    fixes = "raise --kv-cache-memory-bytes or --num-pages"
    if given or fits < 2:
        lower = f"lower --max-model-len to {fits} or less, or " if fits >= 2 else ""
        raise ValueError(
            f"max_model_len {max_len} needs {need} KV pages of {ps} tokens for one sequence, "
            f"but the pool has {usable} usable pages ({fits} tokens); {lower}{fixes}"
        )
    logger.warning(
        "max_model_len lowered from %d to %d tokens: the KV pool has %d usable pages of %d "
        "tokens and one sequence must fit; %s for longer sequences",
        max_len, fits, usable, ps, fixes,
    )  # fmt: skip
    scheduler = dataclasses.replace(config.scheduler, max_model_len=fits)
    return dataclasses.replace(config, scheduler=scheduler)


def group_pages(num_pages: int, groups: KVGroups, num_layers: int) -> int:
    """The page ids of a pool of num_pages pages of every layer (--num-pages, or what the
    memory budget holds) when a page id holds a paging group's slots_per_page layers
    (models/kv_groups.py): as many bytes, num_layers / slots_per_page times the pages (page 0
    stays the one null page)."""
    if not groups.grouped:
        return num_pages
    return (num_pages - 1) * num_layers // groups.slots_per_page + 1


def resolve_kv_offload_bytes(
    cache: CacheConfig, platform: str, groups: KVGroups, *, replicas: int = 1
) -> int:
    """The host tier's bytes (jpaged/core/host_page_store.py; 0: off): kv_offload_bytes, or
    by default none on CPU (the pool already lives in host memory), none where the swap space
    was sized (num_swap_pages, swap_space_bytes), and else HOST_OFFLOAD_SHARE of the available
    host memory on an accelerator, split over the data-parallel replicas. Off without prefix
    caching, with a sliding window but no full first paging group (its hits are chained:
    jpaged/core/kv_cache_manager.py) and across processes (host copies are not broadcast).
    A draft model's pool shares the page ids but not the host tier: its K/V in a page loaded
    from host is recomputed (jpaged/spec_decode/draft_model.py, sync)."""
    wanted = cache.kv_offload_bytes
    swap_sized = cache.num_swap_pages is not None or cache.swap_space_bytes is not None
    if wanted is None and swap_sized:
        wanted = 0
    if wanted is None:
        if cache.kv_offload_dir is not None and platform == "cpu":
            raise ValueError(
                f"kv_offload_dir ({cache.kv_offload_dir!r}) needs kv_offload_bytes on CPU, "
                "where the host tier is off by default (it stages the disk's pages)"
            )
        avail = available_host_memory() if platform != "cpu" else None
        wanted = int(avail * HOST_OFFLOAD_SHARE) // replicas if avail else 0
    why_not = None
    if not cache.enable_prefix_caching:
        why_not = "prefix caching is off"
    elif groups.windows[0] is not None:
        why_not = "the model's first paging group has a sliding window (chained hits)"
    elif jax.process_count() > 1:
        why_not = "the model spans processes"
    if wanted and why_not is not None:
        if cache.kv_offload_bytes:
            logger.warning("the host KV tier (kv_offload_bytes) is off: %s", why_not)
        return 0
    return wanted


def resolve_num_swap_pages(
    config: EngineConfig, model_config: ModelConfig, itemsize: int, kv_dtype=None
) -> int:
    """Host pages: those of the host tier when kv_offload_bytes (resolved) is set, which swap
    preemption shares (one store); else 0 unless preemption_mode is "swap"; then
    num_swap_pages, or as many pages as swap_space_bytes (default 4 GiB) holds."""
    cache = config.cache
    if cache.kv_offload_bytes:
        page = kv_page_bytes(model_config, cache.page_size, itemsize, kv_dtype)
        # The host array has an unused page 0 too: every page counts against the bytes.
        if cache.kv_offload_bytes < 2 * page:
            raise ValueError(
                f"kv_offload_bytes ({cache.kv_offload_bytes}) holds less than two pages of K/V "
                f"({page} bytes each, one of them the unused host page 0)"
            )
        return cache.kv_offload_bytes // page - 1
    if config.scheduler.preemption_mode != "swap":
        return 0
    if cache.num_swap_pages is not None:
        return cache.num_swap_pages
    budget = cache.swap_space_bytes or DEFAULT_SWAP_SPACE_BYTES
    num = budget // kv_page_bytes(model_config, cache.page_size, itemsize, kv_dtype)
    if num < 1:
        raise ValueError(f"swap_space_bytes ({budget}) is smaller than one page of K/V")
    return num


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The engine's memory, decided once (plan_memory)."""

    config: EngineConfig  # resolved: max_model_len fitted to the pool, buckets set
    kv_dtype: np.dtype  # the pages' storage dtype
    kv_groups: KVGroups  # the paging groups (one, unless windowed pages are freed)
    num_pages: int  # page ids of the device pool, the null page included
    num_swap_pages: int  # host swap pages (0: no swap), the unused page 0 not counted
    lora_bytes: int = 0  # the LoRA slots' device bytes (lora_slot_bytes), off the pool's budget

    @property
    def group_windows(self) -> tuple[int | None, ...] | None:
        """Each paging group's window, for the scheduler (None: one group, every page kept)."""
        return self.kv_groups.windows


def plan_memory(
    config: EngineConfig, model_config: ModelConfig, dtype, platform: str, *, draft_config=None
) -> MemoryPlan:
    """The MemoryPlan of config for a model of model_config with activations in dtype on
    platform ("cpu", "gpu", "tpu"); draft_config: a draft model's ModelConfig (its K/V shares
    the pool's page ids and budget), or None.

    Raises ValueError where max_model_len was given and one sequence of it does not fit."""
    max_len_given = config.scheduler.max_model_len is not None
    config = config.resolve(model_config.max_position_embeddings, platform)
    itemsize = np.dtype(dtype).itemsize
    kv_dtype = kv_quant.storage_dtype(config.cache.kv_cache_dtype, dtype)
    page_size = config.cache.page_size
    # A draft model's pool has the target's page ids and kv dtype (its runner reads the
    # same CacheConfig): each page costs its bytes too.
    extra = 0
    if draft_config is not None:
        extra = kv_page_bytes(draft_config, page_size, itemsize, kv_dtype)
    # Paging groups: a page table per attention kind when windowed pages are freed
    # (docs/memory.md, "Hybrid paging"); not with a draft model, which reads the same
    # page ids with full attention.
    groups = kv_groups(
        model_config.windows,
        free_window_pages=config.cache.free_window_pages and draft_config is None,
        max_model_len=config.scheduler.max_model_len,
    )
    num_layers = model_config.num_layers
    lora_bytes = lora_slot_bytes(model_config, config, itemsize)
    num_pages = group_pages(
        resolve_num_pages(
            config.cache, config, model_config, itemsize, extra_bytes_per_page=extra,
            kv_dtype=kv_dtype, reserved_bytes=lora_bytes,
        ),
        groups,
        num_layers,
    )  # fmt: skip
    if groups.grouped:
        logger.info(
            "paging groups (windows %s): %d pages of %d of the %d layers each",
            groups.windows, num_pages, groups.slots_per_page, num_layers,
        )  # fmt: skip
    config = fit_max_model_len(
        config, num_pages, given=max_len_given,
        group_windows=groups.windows if groups.grouped else (None,),
    )  # fmt: skip
    if isinstance(model_config.rope_scaling, LongRopeScaling) and (
        config.cache.enable_prefix_caching
    ):
        # A LongRoPE key depends on its sequence's length (short or long factors): a page
        # cached by a short prompt is not the page a long one would compute.
        logger.warning("prefix caching is off: the model's LongRoPE keys depend on length")
        cache = dataclasses.replace(config.cache, enable_prefix_caching=False)
        config = dataclasses.replace(config, cache=cache)
    offload = resolve_kv_offload_bytes(
        config.cache, platform, groups,
        replicas=config.parallel.data_parallel_size,
    )  # fmt: skip
    config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, kv_offload_bytes=offload)
    )
    swap_pages = resolve_num_swap_pages(config, model_config, itemsize, kv_dtype)
    return MemoryPlan(
        config=config,
        kv_dtype=kv_dtype,
        kv_groups=groups,
        num_pages=num_pages,
        num_swap_pages=group_pages(swap_pages + 1, groups, num_layers) - 1,
        lora_bytes=lora_bytes,
    )


def host_page_store(
    config: EngineConfig, model_config: ModelConfig, num_host_pages: int, kv_dtype, host_array
) -> HostPageStore | None:
    """The engine's host pages (MemoryPlan.num_swap_pages, None when 0; their bytes are
    host_array, the runner's swap_space): swap space, and the prefix cache's host tier when
    kv_offload_bytes (resolved) is set, over the disk tier when kv_offload_dir is. Its
    identity names the model, its architecture and the pages' dtype and layout: another
    checkpoint never hits, in memory or on disk."""
    if not num_host_pages:
        return None
    m, page_size = model_config, config.cache.page_size
    cache = config.cache
    disk = None
    if cache.kv_offload_dir is not None and cache.kv_offload_bytes:
        disk = DiskPageStore(cache.kv_offload_dir, cache.kv_offload_dir_bytes)
    identity = (
        f"{config.model}|{config.quantization}|{m.architecture}|{np.dtype(kv_dtype).name}|"
        f"{page_size}x{m.num_layers}x{m.num_kv_heads}x{m.head_dim}"
    )
    page_bytes = kv_page_bytes(model_config, page_size, 0, kv_dtype)
    if host_array is not None:  # one page id's bytes (a paging group's layers only)
        page_bytes = sum(leaf[:, :, :, 0].nbytes for leaf in jax.tree.leaves(host_array))
    return HostPageStore(
        num_host_pages,
        page_bytes=page_bytes,
        page_size=page_size,
        identity=identity,
        offload=bool(config.cache.kv_offload_bytes),
        host_array=host_array,
        disk=disk,
    )
