"""Fixtures for the sharding tests: a checkpoint with enough heads, and one worker run.

The worker (sharded_worker.py) runs in its own process with 8 simulated CPU devices, because
the device count is fixed when JAX starts and this process already started it with one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numpy_checkpoints import make_llama_checkpoint


def run_worker(*args: str, timeout: float = 600) -> dict:
    res = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sharded_worker.py")), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
        check=False,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory) -> Path:
    """Tiny Llama with 8 query heads and 4 KV heads (so T = 8 replicates each KV head twice).

    Written with numpy (no torch), so the sharding tests also run where torch is absent."""
    root = tmp_path_factory.mktemp("tp_checkpoint")
    return make_llama_checkpoint(root / "llama", heads=8, kv_heads=4)


@pytest.fixture(scope="session")
def tp_results(tp_checkpoint, tmp_path_factory) -> dict:
    """Every (T, D) of sharded_worker.CONFIGS plus an Orbax restore at T = 4, in one process."""
    orbax_dir = tmp_path_factory.mktemp("orbax") / "model"
    return run_worker("tp", str(tp_checkpoint), str(orbax_dir))


@pytest.fixture(scope="session")
def host_write_results() -> dict:
    """sharded_worker.run_host_write: the host tier's per-shard writes at T = 8 and 2 x 2."""
    return run_worker("host_write", timeout=300)


@pytest.fixture(scope="session")
def quant_results(tp_checkpoint, tmp_path_factory) -> dict:
    """sharded_worker.run_quant: quantized weights at T = 1, 2 and D = 2 x T = 2."""
    return run_worker("quant", str(tp_checkpoint), str(tmp_path_factory.mktemp("quant")))


@pytest.fixture(scope="session")
def orbax_quant_results(tp_checkpoint, tmp_path_factory) -> dict:
    """sharded_worker.run_orbax_quant: Orbax loads with int8 / fp8 weights at T = 2 against
    the HF directory's."""
    return run_worker("orbax_quant", str(tp_checkpoint), str(tmp_path_factory.mktemp("oq")))


@pytest.fixture(scope="session")
def lora_results(tp_checkpoint, tmp_path_factory) -> dict:
    """sharded_worker.run_lora: LoRA adapters at T = 1 and 8."""
    return run_worker("lora", str(tp_checkpoint), str(tmp_path_factory.mktemp("lora_tp")))
