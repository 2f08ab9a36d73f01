"""Per-step device timing for benchmarks, kept out of the engine's hot path.

    timer = StepTimer.attach(engine)   # engine.runner is wrapped; detach() restores it
    ... engine.step() ...
    timer.log                          # [(StepKey, num_rows, num_context_tokens, seconds)]

Device seconds run from when a step could start (dispatched, and the step before it
finished) to when it finished, as the host sees them: a step the host waited for (fetch found
it running) finished at the fetch; one that was already done finished at some time after the
host last saw it running (a lower bound, so the time left to the host is an upper bound on
host time not hidden by the device). Synchronous steps: dispatch to sampled ids on the host.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(eq=False)
class _Timing:
    dispatch_time: float
    busy_time: float  # the last time the host saw the step still running
    done_time: float | None = None


class StepTimer:
    """Wraps a ModelRunner's dispatch and fetch; everything else passes through."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.log: list[tuple] = []
        self._timings: dict[int, _Timing] = {}  # id(InFlightStep) -> its timing
        self._latest = None  # the step dispatched last
        self._last_done = 0.0

    @classmethod
    def attach(cls, engine) -> StepTimer:
        timer = cls(engine.runner)
        engine.runner = timer
        timer._engine = engine
        return timer

    def detach(self) -> None:
        self._engine.runner = self.runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _poll(self) -> None:
        step = self._latest
        if step is None:
            return
        timing = self._timings.get(id(step))
        if timing is not None and timing.done_time is None and not step.out[0].is_ready():
            timing.busy_time = time.perf_counter()

    def dispatch(self, plan, prev_plan=None, token_bitmask=None, **kwargs):
        self._poll()
        t0 = time.perf_counter()
        step = self.runner.dispatch(plan, prev_plan, token_bitmask, **kwargs)
        self._timings[id(step)] = _Timing(t0, t0)
        self._latest = step
        return step

    def execute(self, plan):
        return self.fetch(self.dispatch(plan))

    def fetch(self, step):
        timing = self._timings.pop(id(step))
        running = not step.out[0].is_ready()
        out = self.runner.fetch(step)
        now = time.perf_counter()
        timing.done_time = now if running else timing.busy_time
        start = max(timing.dispatch_time, self._last_done)
        self._last_done = timing.done_time
        context = int(step.plan.context_lens.sum())
        self.log.append((step.key, len(step.plan), context, max(timing.done_time - start, 0.0)))
        if self._latest is step:
            self._latest = None
        self._poll()
        return out
