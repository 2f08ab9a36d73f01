"""scripts/gpu_session.sh end to end on this CPU host (a dry run of the device session; slow).

The session script is what a rare, short GPU loan runs in one command, so its plumbing is
checked here rather than there: the Python it picks, the repo root on PYTHONPATH (the project
is not installed on the GPU machine), each step's timeout from the time left, RESULT_JSON and
the per-step JSON collected into results.jsonl, the GPU tests refused in one line on CPU,
bench_attention's table and bench_throughput's jpaged phase, the card named in the log and
in every result. CI runs the suite with the
project installed, so this shows only that the script works, not that an uninstalled tree
imports: the documented dry run (docs/attention.md) uses a venv without the project.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_session_dry_run_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PY=sys.executable,
        OUT=str(out),
        BENCH_ROOT=str(tmp_path / "bench"),
        PRESET="cpu-small",
        EXTRA_ARGS="--scale 64 --skip-transformers",
        ATTENTION_ARGS="--quick --iters 2",
        DEADLINE_S="500",
        KILL_GRACE_S="20",
    )
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_session.sh"), "tests", "attention", "W1"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    log = (out / "session.log").read_text()
    for step in ("attention", "W1"):
        assert f"END {step} rc=0" in log, log
    assert f"python: {sys.executable}" in log
    card = next(line.split("card: ", 1)[1] for line in log.splitlines() if "] card: " in line)
    assert card.endswith("(cpu)") and log.rstrip().endswith(f"gpu_session: done on {card}")
    # -m gpu with jax held on the CPU stops at once with one line (tests/conftest.py)
    assert "END tests rc=4" in log, log
    assert (out / "tests.log").read_text().strip() == (
        "Exit: -m gpu selects the GPU tests, but JAX_PLATFORMS=cpu keeps jax off the GPU: "
        "unset it or name cuda/rocm/gpu"
    )

    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(results) == 2
    attention, w1 = results
    assert [(r["step"], r["card"]) for r in results] == [("attention", card), ("W1", card)]
    assert attention["copy_bandwidth_gb_s"] > 0
    ours = [r for r in attention["rows"] if r["impl"] == "ours"]
    assert len(ours) == 2 and all(r["time_us"] > 0 for r in ours)
    assert w1["phases"] == {"jpaged": "done", "startup:cold": "done", "startup:warm": "done"}
    assert w1["jpaged"]["output_tokens"] == w1["jpaged"]["expected_output_tokens"] == 2 * 128
    assert w1["jpaged"]["tokens_per_s"] > 0
    assert json.loads((out / "W1.json").read_text())["jpaged"] == w1["jpaged"]
