"""Decode attention bandwidth benchmark: our Pallas kernel vs jax's bundled kernel vs XLA.

Measures on whatever accelerator jax sees:
  - device copy bandwidth (a large array read + write, bytes moved / time);
  - our decode kernel's effective KV bandwidth: bytes of K and V read / time;
  - jax.experimental.pallas.ops.gpu.paged_attention on the same inputs (q pre-scaled), on GPU;
  - the XLA gather-then-attend baseline (pallas_kernels.reference).

Cold L2: every shape's pool is made large enough (>= --pool-mib, default 1024 MiB) to hold
several disjoint copies of the batch's pages, and successive timed calls rotate through
page tables that point at different copies, so no call finds its KV in L2.

Usage:
  python scripts/bench_attention.py            # full table (an accelerator is expected)
  python scripts/bench_attention.py --quick    # tiny shapes; runs on CPU (kernel interpreted)
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import reference

# (batch, context, q heads, kv heads, head_dim, page_size)
FULL_SHAPES = [
    (64, 2048, 32, 8, 128, 16),
    (256, 1024, 32, 8, 128, 16),
    (16, 8192, 32, 8, 128, 16),
    (8, 512, 32, 8, 128, 16),
] + [(64, 2048, 32, 8, 128, ps) for ps in (8, 32, 64, 128)]
QUICK_SHAPES = [(4, 64, 4, 2, 64, 8), (2, 128, 8, 2, 64, 16)]


def timeit(fn, arg_sets, iters):
    """Median seconds per call, rotating through arg_sets (compile and warm-up excluded)."""
    jax.block_until_ready(fn(*arg_sets[0]))
    times = []
    for i in range(iters):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes, iters):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    t = timeit(f, [(x,)], iters)
    return 2 * x.nbytes / t  # read + write


def make_inputs(shape, *, dtype, pool_bytes, seed=0):
    batch, ctx, hq, hkv, head_dim, ps = shape
    pages_per_seq = ctx // ps
    itemsize = jnp.dtype(dtype).itemsize
    batch_bytes = 2 * batch * ctx * hkv * head_dim * itemsize
    copies = max(1, min(16, pool_bytes // max(batch_bytes, 1)))
    num_pages = copies * batch * pages_per_seq + 1
    key = jax.random.PRNGKey(seed)
    kk, kv, kq = jax.random.split(key, 3)
    k = jax.random.normal(kk, (hkv, num_pages, ps, head_dim), dtype)
    v = jax.random.normal(kv, (hkv, num_pages, ps, head_dim), dtype)
    q = jax.random.normal(kq, (batch, hq, head_dim), dtype)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = [
        jnp.asarray(perm[c * batch * pages_per_seq: (c + 1) * batch * pages_per_seq]
                    .reshape(batch, pages_per_seq))
        for c in range(copies)
    ]
    lengths = jnp.full((batch,), ctx, jnp.int32)
    kv_bytes = 2 * batch * ctx * hkv * head_dim * itemsize
    return q, k, v, lengths, tables, kv_bytes


def bench_shape(shape, *, dtype, pool_bytes, iters, interpret):
    q, k, v, lengths, tables, kv_bytes = make_inputs(shape, dtype=dtype, pool_bytes=pool_bytes)
    head_dim = shape[4]
    scale = head_dim**-0.5
    arg_sets = [(q, k, v, lengths, t) for t in tables]
    impls = {
        "ours": jax.jit(lambda *a: pallas_kernels.paged_decode_attention(
            *a, sm_scale=scale, interpret=interpret)),
        "xla_ref": jax.jit(lambda *a: reference.paged_decode_attention(*a, sm_scale=scale)),
    }
    if jax.default_backend() == "gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as bundled

        def jax_bundled(q, k, v, lengths, table):
            return bundled.paged_attention(q * scale, k, v, table, lengths)

        impls["jax_bundled"] = jax.jit(jax_bundled)
    rows = {}
    for name, fn in impls.items():
        try:
            rows[name] = timeit(fn, arg_sets, iters)
        except Exception as e:  # noqa: BLE001 - one failing impl must not hide the others
            rows[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return rows, kv_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    dev = jax.devices()[0]
    on_cpu = jax.default_backend() == "cpu"
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    iters = args.iters or (3 if args.quick else 50)
    pool_bytes = (8 if args.quick else args.pool_mib) << 20
    print(f"device: {dev.platform} {dev.device_kind}  jax {jax.__version__}  dtype {args.dtype}")
    if on_cpu:
        print("CPU: 'ours' runs the GPU kernel in the Pallas interpreter (a smoke test only)")
    copy_bw = copy_bandwidth((16 if args.quick else 2048) << 20, iters)
    print(f"copy bandwidth (read+write): {copy_bw / 1e9:.4g} GB/s")
    print(f"{'batch':>5} {'ctx':>5} {'hq':>3} {'hkv':>3} {'d':>4} {'page':>4}  "
          f"{'impl':<12} {'time_us':>10} {'KV_GB/s':>9} {'%copy':>6}")
    for shape in shapes:
        rows, kv_bytes = bench_shape(shape, dtype=args.dtype, pool_bytes=pool_bytes,
                                     iters=iters, interpret=on_cpu)
        for name, t in rows.items():
            head = " ".join(f"{x:>{w}}" for x, w in zip(shape, (5, 5, 3, 3, 4, 4)))
            if isinstance(t, str):
                print(f"{head}  {name:<12} {t}")
                continue
            bw = kv_bytes / t
            print(f"{head}  {name:<12} {t * 1e6:>10.1f} {bw / 1e9:>9.4g} {100 * bw / copy_bw:>6.1f}")


if __name__ == "__main__":
    main()
