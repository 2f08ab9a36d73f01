"""Multi-host: two processes on 127.0.0.1, 4 simulated CPU devices each, joined by
jax.distributed (gloo CPU collectives), serve one batch at T = 8 and give the tokens of one
device; and the step broadcast replays every kind of device call on a follower."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from child_process import dies_with_parent

from jpaged.config import EngineConfig, SchedulerConfig
from jpaged.worker import multihost
from jpaged.worker.runner import ModelRunner
from jpaged.worker.step_inputs import StepKey
from models import sharding
from models.config import ModelConfig

WORKER = Path(__file__).with_name("sharded_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_single_device_tokens(tp_checkpoint, tp_results, tmp_path):
    out = tmp_path / "process0.json"
    addr = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            dies_with_parent(
                [
                    sys.executable,
                    str(WORKER),
                    "multihost",
                    str(tp_checkpoint),
                    addr,
                    "2",
                    str(i),
                    str(out),
                ]
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, logs, strict=True):
        assert p.returncode == 0, err[-4000:]
    res = json.loads(out.read_text())
    assert (res["processes"], res["devices"]) == (2, 8)
    assert res["tokens"] == tp_results["1x1"]["tokens"]
    total = res["layout"]["pool_total_bytes"]
    assert res["layout"]["pool_devices"] == 8
    assert res["layout"]["pool_device_bytes"] == [total // 4] * 4  # process 0's 4 devices
    assert json.loads(logs[1][0].strip().splitlines()[-1]) == {"followed": True}


def _runner() -> ModelRunner:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
    )
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    )
    mesh = sharding.make_mesh(cfg, 1)
    broadcast = multihost.StepBroadcast(mesh)
    return ModelRunner(config, cfg, {}, 8, np.float32, mesh=mesh, broadcast=broadcast)


def _record_calls(runner, calls: list) -> None:
    """Replaces the compiled programs with recorders (nothing is compiled)."""

    def step_exe(key, *_example):
        return lambda params, state, inputs, prev_tokens: (
            calls.append((key, inputs)),
            prev_tokens,
            state,
        )

    runner.programs.step = step_exe
    runner.programs.prelude = lambda _state: lambda state, u, c: (
        calls.append(("prelude", u, c)),
        state,
    )[1]


@pytest.mark.parametrize("penalties", [False, True])
def test_step_broadcast_replays_every_call(monkeypatch, penalties):
    wire: list = []
    key = StepKey(16, 4, 4, False, 20, (16, 32) if penalties else None, pooling=penalties)

    # Process 0: each broadcast is recorded as the wire carries it.
    leader, led = _runner(), []
    _record_calls(leader, led)
    monkeypatch.setattr(multihost.jax, "process_index", lambda: 0)
    monkeypatch.setattr(
        multihost.multihost_utils,
        "broadcast_one_to_all",
        lambda tree: (wire.append(jax.tree_util.tree_map(np.array, tree)), tree)[1],
    )
    leader.broadcast.is_leader = True
    updates = np.arange(256 * 3, dtype=np.int32).reshape(256, 3) % 7
    copies = np.arange(64 * 2, dtype=np.int32).reshape(64, 2) % 5
    leader.run_prelude(updates, copies)
    inputs = leader.dummy_inputs(key)
    inputs.token_ids[:] = np.arange(16)
    inputs.sampling.temperature[:] = 0.5
    if penalties:
        inputs.sampling.penalties.prompt_tokens[:] = 3
    leader.run_step(key, inputs)
    leader.stop_followers()
    assert [int(wire[i][0]) for i in (0, 2, 4)] == [1, 2, 0]  # prelude, step, stop headers

    # Process 1: receives exactly what was sent; the dummy it offers must match in shape.
    follower, followed = _runner(), []
    _record_calls(follower, followed)
    follower.broadcast.is_leader = False

    def receive(tree):
        got = wire.pop(0)
        shapes = jax.tree_util.tree_map(lambda x: (np.shape(x), np.asarray(x).dtype), tree)
        assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), got)
        return got

    monkeypatch.setattr(multihost.multihost_utils, "broadcast_one_to_all", receive)
    follower.follow()
    assert wire == []
    assert len(followed) == len(led) == 2
    assert followed[0][0] == "prelude"
    np.testing.assert_array_equal(np.asarray(followed[0][1]), updates)
    np.testing.assert_array_equal(np.asarray(followed[0][2]), copies)
    got_key, got = followed[1]
    assert got_key == key
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(inputs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
