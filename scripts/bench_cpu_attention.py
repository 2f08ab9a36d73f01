"""Decode attention through the CPU kernel, one or more source trees in one process.

Each tree's pallas_kernels/cpu_paged_attention.cc is built with cpu_kernel's flags and
registered under its own name; the calls alternate, so that every tree sees the same machine
(this VM's memory rate moves by half between minutes: only trees timed side by side compare).
A call is `--layers` attention calls in one jitted program, each over its own K/V pools (as a
step's layers: nothing stays in the caches between them).

    python scripts/bench_cpu_attention.py --tree main=/path/to/main --tree new=.
    python scripts/bench_cpu_attention.py --rows 16 --context 906 --order shuffled

Prints per tree the median, 25th percentile and minimum ms of a call, the K/V read rate
(the rows' tokens x KV heads x head_dim x 2 x 4 bytes x layers over the median), and the largest
difference of its output from the first tree's.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernel_trees

from pallas_kernels import cpu_kernel

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a source tree to time (repeatable; default: this checkout)")
    ap.add_argument("--rows", type=int, default=32, help="decode rows (one token each)")
    ap.add_argument("--context", type=int, default=584, help="tokens per row (the most)")
    ap.add_argument("--min-context", type=int, default=None,
                    help="rows' tokens drawn uniformly from [this, --context] (default: all "
                         "--context), as a batch of running sequences")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--order", choices=("in-order", "descending", "shuffled", "hot"),
                    default="in-order",
                    help="pages of a row in order, a run in descending order (as the free "
                         "list hands out a finished sequence's pages, tail first), shuffled "
                         "over the pool, or every row on the same pages (cached: the "
                         "kernel's arithmetic alone)")
    ap.add_argument("--repeat", type=int, default=25)
    args = ap.parse_args()

    trees = kernel_trees.parse(args.tree, ROOT)

    b, ctx, hkv, d = args.rows, args.context, args.kv_heads, args.head_dim
    low = ctx if args.min_context is None else args.min_context
    if not 1 <= low <= ctx:
        raise SystemExit(f"--min-context {low}: expected 1 to --context ({ctx})")
    hq = hkv * args.group
    pages = -(-ctx // PAGE)
    pool = b * pages + 1  # page 0 unused, as the engine's null page
    rng = np.random.default_rng(0)
    lens = rng.integers(low, ctx + 1, b) if low < ctx else np.full(b, ctx)
    if args.order == "hot":
        table = np.tile(np.arange(1, pages + 1), (b, 1))
    elif args.order == "shuffled":
        table = (rng.permutation(pool - 1) + 1).reshape(b, pages)
    elif args.order == "descending":  # each row's pages a run from its last down
        table = np.arange(1, pool).reshape(b, pages)[:, ::-1].copy()
    else:
        table = np.arange(1, pool).reshape(b, pages)
    table = jnp.asarray(table, jnp.int32)
    kv = [tuple(jnp.asarray(rng.standard_normal((hkv, pool, PAGE, d), np.float32))
                for _ in range(2)) for _ in range(args.layers)]
    q = jnp.asarray(rng.standard_normal((b, hq, d), np.float32))
    seq = jnp.arange(b, dtype=jnp.int32)
    starts = jnp.zeros(b, jnp.int32)
    ends = jnp.asarray(lens, jnp.int32)
    sinks = jnp.zeros(hq, jnp.float32)
    attrs = {"sm_scale": np.float32(d ** -0.5), "soft_cap": np.float32(0),
             "has_sinks": False, "threads": np.int64(cpu_kernel.threads())}

    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, tree) in enumerate(trees):
            target = f"bench_cpu_attention_{i}"
            kernel_trees.register(tree, "cpu_paged_attention.cc", "JpagedCpuPagedAttention",
                                  Path(tmp) / f"attention_{i}.so", target)
            call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))

            def layers(q, kv, call=call):
                for k, v in kv:  # each layer's query is the last one's output, as a chain
                    q = call(q, k, v, table, seq, starts, ends, sinks, **attrs)
                return q

            calls[name] = jax.jit(layers)

    times = kernel_trees.alternate(calls, (q, kv), args.repeat)
    gb = int(lens.sum()) * hkv * d * 2 * 4 * args.layers / 1e9
    tokens = f"{ctx}" if low == ctx else f"{low}-{ctx} (mean {lens.mean():.0f})"
    print(f"{args.layers} layers x {b} rows x {tokens} tokens, {hkv} KV heads x {args.group} "
          f"query heads, head_dim {d}, pages {args.order}: {gb * 1e3:.0f} MB of K/V a call; "
          f"{cpu_kernel.threads()} threads, {args.repeat} calls each, alternated")
    for name, ms in times.items():
        print(f"  {name:12s} median {np.median(ms):7.1f} ms  p25 {np.percentile(ms, 25):7.1f}"
              f"  min {ms.min():7.1f}  {gb / np.median(ms) * 1e3:5.1f} GB/s")


if __name__ == "__main__":
    main()
