"""Multi-host serving: one model over every process's devices, joined by jax.distributed.

Process 0 owns the scheduler and talks to clients; every other process follows its step
plans. SPMD needs every process to make the same device calls with the same inputs in the
same order, so before each call process 0 broadcasts a small header (which call, and its
bucket key), then the call's padded numpy inputs. A follower builds empty inputs of the
shapes the key implies, receives into them, and makes the same call; the outputs are
replicated, so process 0 reads the sampled tokens from its own devices.

    header int32[12]: kind (0 stop, 1 prelude, 2 step), num_tokens, num_seqs, num_page_cols,
                      decode_only, num_logprobs, Hp, Ho (Hp = Ho = -1: no penalties),
                      bias_width, prompt_logprobs, spec_k, pooling
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.worker.programs import PRELUDE_COPIES, PRELUDE_UPDATES
from jpaged.worker.step_inputs import StepKey

logger = logging.getLogger(__name__)

_STOP, _PRELUDE, _STEP = 0, 1, 2
_HEADER = 12


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """jax.distributed.initialize; arguments left None come from JAX's environment variables."""
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
    logger.info(
        "process %d of %d: %d local devices, %d in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


class StepBroadcast:
    """Process 0 sends each device call of a ModelRunner; the others receive and replay it.

    mesh: the Mesh spanning every process's devices that the runner's params live on.
    """

    def __init__(self, mesh) -> None:
        self.is_leader = jax.process_index() == 0
        self._replicated = NamedSharding(mesh, P())

    def _exchange(self, tree):
        """Process 0's tree on every process, as global replicated arrays."""
        tree = multihost_utils.broadcast_one_to_all(tree)
        return jax.tree_util.tree_map(self._global, tree)

    def _global(self, x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, self._replicated, lambda index: x[index])

    def _header(self, kind: int, key=None) -> None:
        h = np.full(_HEADER, -1, np.int32)
        h[0] = kind
        if key is not None:
            h[1:6] = (key.num_tokens, key.num_seqs, key.num_page_cols, key.decode_only,
                      key.num_logprobs)  # fmt: skip
            if key.penalty_shape is not None:
                h[6:8] = key.penalty_shape
            h[8:12] = (key.bias_width, key.prompt_logprobs, key.spec_k, key.pooling)
        multihost_utils.broadcast_one_to_all(h)

    def prelude(self, updates: np.ndarray, copies: np.ndarray):
        if self.is_leader:
            self._header(_PRELUDE)
        return self._exchange((updates, copies))

    def step(self, key, inputs):
        if self.is_leader:
            self._header(_STEP, key)
        return self._exchange(inputs)

    def stop(self) -> None:
        self._header(_STOP)

    def follow(self, runner) -> None:
        """Replays process 0's calls on runner (a ModelRunner) until it sends stop
        (processes other than 0 only)."""
        if self.is_leader:
            raise RuntimeError("process 0 leads; it does not follow")
        while True:
            h = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32)))
            kind = int(h[0])
            if kind == _STOP:
                return
            if kind == _PRELUDE:
                runner.run_prelude(
                    np.zeros((PRELUDE_UPDATES, 3), np.int32),
                    np.zeros((PRELUDE_COPIES, 2), np.int32),
                )
                continue
            penalty = None if h[6] < 0 else (int(h[6]), int(h[7]))
            key = StepKey(int(h[1]), int(h[2]), int(h[3]), bool(h[4]), int(h[5]), penalty,
                          int(h[8]), bool(h[9]), spec_k=int(h[10]), pooling=bool(h[11]))  # fmt: skip
            runner.run_step(key, runner.dummy_inputs(key))
