"""Probes the engine tests wrap around an engine's runner."""

from __future__ import annotations

import numpy as np

from jpaged.core.engine import LLMEngine
from jpaged.worker.step_plan import PLACEHOLDER


def count_overlapped(engine: LLMEngine) -> list[int]:
    """Counts, in the returned list, the steps dispatched while the step before them was
    still on the device (their decode tokens read there)."""
    counter = [0]
    dispatch = engine.runner.dispatch

    def counting(plan, prev_plan=None, token_bitmask=None, **kwargs):
        if prev_plan is not None and np.any(plan.token_ids == PLACEHOLDER):
            counter[0] += 1
        return dispatch(plan, prev_plan, token_bitmask, **kwargs)

    engine.runner.dispatch = counting
    return counter
