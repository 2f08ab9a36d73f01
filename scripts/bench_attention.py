"""Decode attention bandwidth benchmark: our Pallas kernel vs jax's bundled kernel vs XLA.

Measures on whatever accelerator jax sees:
  - device copy bandwidth (a large array read + write, bytes moved / time);
  - our decode kernel's effective KV bandwidth: bytes of K and V read / time;
  - jax.experimental.pallas.ops.gpu.paged_attention on the same inputs (q pre-scaled), on GPU;
  - the XLA gather-then-attend baseline (pallas_kernels.reference).

Cold L2: every shape's pool is made large enough (>= --pool-mib, default 1024 MiB) to hold
several disjoint copies of the batch's pages, and successive timed calls rotate through
page tables that point at different copies, so no call finds its KV in L2.

Our Mosaic GPU decode kernel (pallas_kernels/mosaic_gpu_decode.py, 16-bit dtypes) is
measured too ("ours_mosaic"), next to the Triton one ("ours"); on CPU both run interpreted.

Usage:
  python scripts/bench_attention.py            # full table (an accelerator is expected)
  python scripts/bench_attention.py --quick    # tiny shapes; runs on CPU (kernel interpreted)

Order of value: the copy bandwidth, then the 64 x 2048 shape (the targets are set there),
then the rest; within a shape ours first. Every figure is added to --json-out as soon as it
is measured, and one line `RESULT_JSON {...}` is printed at the end (also when interrupted,
or when --time-budget seconds run out before the last shape starts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when not installed

import pallas_kernels
from pallas_kernels import mosaic_gpu_decode, reference

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


def kv_bytes_read(shape, dtype) -> int:
    """Bytes of K and V a decode call over the shape reads."""
    batch, ctx, _, hkv, head_dim, _ = shape
    return 2 * batch * ctx * hkv * head_dim * jnp.dtype(dtype).itemsize


def make_inputs(shape, *, dtype, pool_bytes, seed=0):
    batch, ctx, hq, hkv, head_dim, ps = shape
    pages_per_seq = ctx // ps
    batch_bytes = kv_bytes_read(shape, dtype)
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
    return q, k, v, lengths, tables


def bench_shape(shape, *, dtype, pool_bytes, iters, interpret, on_row):
    """Times every implementation on one shape; on_row(name, seconds or "failed: ...") is
    called as each is measured."""
    q, k, v, lengths, tables = make_inputs(shape, dtype=dtype, pool_bytes=pool_bytes)
    head_dim = shape[4]
    scale = head_dim**-0.5
    arg_sets = [(q, k, v, lengths, t) for t in tables]
    on_gpu = jax.default_backend() == "gpu"

    def ours(kernel):
        return jax.jit(lambda *a: pallas_kernels.paged_decode_attention(
            *a, sm_scale=scale, interpret=interpret, gpu_kernel=kernel))

    impls = {"ours": ours("triton")}
    if mosaic_gpu_decode.supports(q.shape, k.shape, k.dtype):  # on CPU: in the interpreter
        impls["ours_mosaic"] = ours("mosaic")
    if on_gpu:
        from jax.experimental.pallas.ops.gpu import paged_attention as bundled

        def jax_bundled(q, k, v, lengths, table):
            return bundled.paged_attention(q * scale, k, v, table, lengths)

        impls["jax_bundled"] = jax.jit(jax_bundled)
    impls["xla_ref"] = jax.jit(lambda *a: reference.paged_decode_attention(*a, sm_scale=scale))
    for name, fn in impls.items():
        try:
            on_row(name, timeit(fn, arg_sets, iters))
        except Exception as e:  # noqa: BLE001 - one failing impl must not hide the others
            on_row(name, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json-out", default=None, help="figures so far, rewritten as measured")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: no new shape is started after this")
    args = parser.parse_args()
    t_start = time.perf_counter()

    dev = jax.devices()[0]
    on_cpu = jax.default_backend() == "cpu"
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    iters = args.iters or (3 if args.quick else 50)
    pool_bytes = (8 if args.quick else args.pool_mib) << 20
    result = {"device": f"{dev.platform} {dev.device_kind}", "jax": jax.__version__,
              "dtype": args.dtype, "iters": iters, "copy_bandwidth_gb_s": None, "rows": []}

    def save():
        if args.json_out:
            tmp = Path(args.json_out + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(args.json_out)

    print(f"device: {result['device']}  jax {jax.__version__}  dtype {args.dtype}")
    if on_cpu:
        print("CPU: 'ours' runs the GPU kernel in the Pallas interpreter (a smoke test only)")
    try:
        copy_bw = copy_bandwidth((16 if args.quick else 2048) << 20, iters)
        result["copy_bandwidth_gb_s"] = copy_bw / 1e9
        save()
        print(f"copy bandwidth (read+write): {copy_bw / 1e9:.4g} GB/s")
        print(f"{'batch':>5} {'ctx':>5} {'hq':>3} {'hkv':>3} {'d':>4} {'page':>4}  "
              f"{'impl':<12} {'time_us':>10} {'KV_GB/s':>9} {'%copy':>6}")
        for shape in shapes:
            if args.time_budget and time.perf_counter() - t_start > args.time_budget:
                result["skipped"] = result.get("skipped", []) + [list(shape)]
                print(f"{shape}: skipped, --time-budget {args.time_budget}s spent")
                continue
            head = " ".join(f"{x:>{w}}" for x, w in zip(shape, (5, 5, 3, 3, 4, 4)))
            kv_bytes = kv_bytes_read(shape, args.dtype)

            def on_row(name, t, shape=shape, head=head, kv_bytes=kv_bytes):
                row = {"shape": list(shape), "impl": name}
                if isinstance(t, str):
                    row["error"] = t
                    print(f"{head}  {name:<12} {t}", flush=True)
                else:
                    bw = kv_bytes / t
                    row.update(time_us=t * 1e6, kv_gb_s=bw / 1e9, pct_copy=100 * bw / copy_bw)
                    print(f"{head}  {name:<12} {t * 1e6:>10.1f} {bw / 1e9:>9.4g} "
                          f"{100 * bw / copy_bw:>6.1f}", flush=True)
                result["rows"].append(row)
                save()

            bench_shape(shape, dtype=args.dtype, pool_bytes=pool_bytes, iters=iters,
                        interpret=on_cpu, on_row=on_row)
    except KeyboardInterrupt:  # a timeout: keep what was measured
        result["error"] = "interrupted; the figures present were measured"
        save()
        print("RESULT_JSON " + json.dumps(result), flush=True)
        raise SystemExit(130) from None
    save()
    print("RESULT_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
