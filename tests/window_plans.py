"""Host-only scheduler plans for the sliding-window paging tests (tests/jpaged/core/
test_hybrid_paging.py: every layer windowed; test_paging_groups.py: groups of layers): a
scheduler over a real PageAllocator with no device, requests added and sampled by hand."""

from __future__ import annotations

import numpy as np

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup
from jpaged.sample.sampler import SamplerOutput
from jpaged.sample.sampling_params import SamplingParams

W, PS = 6, 4  # the window and the page size of these plans


def make_scheduler(num_pages, *, max_num_seqs=2, swap_pages=0, caching=True, budget=32,
                   **windows):
    """(scheduler, allocator, swap allocator or None); windows: Scheduler's sliding_window=
    or group_windows=."""
    config = EngineConfig(
        cache=CacheConfig(page_size=PS, num_pages=num_pages, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=128,
            preemption_mode="swap" if swap_pages else "recompute",
        ),
    )
    alloc = PageAllocator(num_pages, enable_prefix_caching=caching)
    swap = PageAllocator(swap_pages + 1, enable_prefix_caching=False) if swap_pages else None
    sched = Scheduler(config, alloc, eos_token_ids=(0,), swap_allocator=swap, **windows)
    return sched, alloc, swap


def add(sched, rid, prompt, max_tokens, n=1):
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0 if n > 1 else 0.0)
    group = RequestGroup(rid, None, list(prompt), params, 0)
    sched.add(group, seed=3)
    return group


def feed(sched, plan, token=5):
    n = len(plan)
    sched.commit(plan, SamplerOutput(np.full(n, token, np.int32), np.zeros(n), None, None))


def dead(start):
    """Pages (a window group's) wholly before the first key a query at `start` reads."""
    return max(start - W + 1, 0) // PS
