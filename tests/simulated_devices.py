"""The environment of a test's subprocess that simulates several CPU devices.

The device count is fixed when JAX starts, so the tests that shard run a worker process;
set_simulated_devices must run in it before JAX is imported.
"""

from __future__ import annotations

import os
import re

# tests/conftest.py's one compute thread, for a worker started outside the test session.
_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def set_simulated_devices(num_devices: int) -> None:
    """JAX on the CPU with num_devices devices, keeping the test session's XLA flags (one
    thread, and under jax 0.10 the older fusion emitters that compile a third faster:
    tests/conftest.py). The device count goes first: XLA stops reading flags at the bare
    word of the one-thread flags."""
    inherited = os.environ.get("XLA_FLAGS", "")
    inherited = re.sub(r"--xla_force_host_platform_device_count=\d+\s*", "", inherited).strip()
    if "xla_cpu_multi_thread_eigen" not in inherited:
        inherited = (inherited + " " + _ONE_THREAD).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices} {inherited}"
