"""The construct behind the tensor-parallel segfault under jax 0.11.2 on CPU, reduced.

A zero-size array constant inside a shard_map body over more than one device crashes XLA's
CPU compiler (jax 0.11.2, not 0.10.2): jax hoists the body's array constants into operands
of the `sdy.manual_computation`, and Shardy's canonicalizer segfaults in
`ManualComputationUnusedInputsPattern` on the zero-size one (gdb: frame 0 in
libjax_common.so, under ShardyXLA::RunImpl, under CpuCompiler::RunHloPasses).

The engine's step made one: `jnp.zeros(n).at[:num_seqs].set(tokens)` with num_seqs == n (the
largest sequence bucket) is a scatter whose index array is empty, `dense<> : tensor<0xi32>`.
Padding (`jnp.pad(tokens, (0, n - num_seqs))`) gives the same array without a scatter and
compiles on both versions. Reproduce the crash by hand:

    python tests/parallel/test_zero_size_constant.py scatter   # jax 0.11.2: SIGSEGV (status 139)
    python tests/parallel/test_zero_size_constant.py pad       # prints [0, 1, ..., 7]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_form(form: str) -> list[int]:
    """Compiles and runs one form ("scatter" or "pad") inside shard_map over 2 simulated CPU
    devices: 8 slots, all 8 written (num_seqs == n, the case that makes the empty index)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    n = num_seqs = 8

    def body(tokens):
        if form == "scatter":
            return jnp.zeros(n, jnp.int32).at[:num_seqs].set(tokens)
        return jnp.pad(tokens, (0, n - num_seqs))

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))
    return np.asarray(step(jnp.arange(num_seqs, dtype=jnp.int32))).tolist()


def _subprocess(form: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, __file__, form], capture_output=True, text=True,
                          timeout=300, check=False)


def test_padding_inside_shard_map_compiles_and_is_exact():
    """The engine's form (jnp.pad) compiles under every supported jax and is exact."""
    res = _subprocess("pad")
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.splitlines()[-1]) == list(range(8))


if __name__ == "__main__":
    print(json.dumps(run_form(sys.argv[1])))
