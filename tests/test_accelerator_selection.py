"""`-m gpu` / `-m tpu` select their accelerator (tests/conftest.py): a run that selects only
accelerator tests runs on that platform in one process, or stops at once with one line and a
usage-error exit where there is none, instead of passing with every test skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerators import accelerator_of_run

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("markexpr", "expected"),
    [
        ("", None),
        ("not slow and not gpu and not tpu", None),  # pyproject's default
        ("gpu", "gpu"),
        ("tpu", "tpu"),
        ("gpu and not slow", "gpu"),
        ("slow", None),
        ("gpu or not gpu", None),  # unmarked tests run too: the CPU stays
        ("not slow", None),
        ("gpu or slow", "gpu"),
    ],
)
def test_accelerator_of_run(markexpr, expected):
    assert accelerator_of_run(markexpr) == expected


def _pytest(*args: str, platforms: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTEST_ADDOPTS")}
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(
    "gpu" in {d.platform for d in __import__("jax").devices()}, reason="this machine has a GPU"
)
def test_gpu_run_without_a_gpu_stops_with_one_line():
    res = _pytest("-m", "gpu", "tests/pallas_kernels/test_on_gpu.py", platforms=None)
    assert res.returncode == pytest.ExitCode.USAGE_ERROR, res.stdout + res.stderr
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(
        "Exit: -m gpu needs a GPU, and this machine has none that jax can use (JAX_PLATFORMS=cuda"
    ), res.stdout + res.stderr
    assert "passed" not in res.stdout and "skipped" not in res.stdout


def test_gpu_run_with_jax_kept_on_the_cpu_says_so():
    res = _pytest("-m", "gpu", "tests/pallas_kernels/test_on_gpu.py", platforms="cpu")
    assert res.returncode == pytest.ExitCode.USAGE_ERROR
    assert res.stderr.strip() == (
        "Exit: -m gpu selects the GPU tests, but JAX_PLATFORMS=cpu keeps jax off the GPU: "
        "unset it or name cuda/rocm/gpu"
    )


def test_tpu_run_without_a_tpu_stops_with_one_line():
    res = _pytest("-m", "tpu", "tests/test_layering.py", platforms=None)
    assert res.returncode == pytest.ExitCode.USAGE_ERROR
    assert res.stderr.strip().startswith(
        "Exit: -m tpu needs a TPU, and this machine has none that jax can use (JAX_PLATFORMS=tpu"
    )
    assert "\n" not in res.stderr.strip()
