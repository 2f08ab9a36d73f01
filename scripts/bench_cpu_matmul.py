"""The CPU matmul kernel on a decoder's product shapes, one or more source trees in one process.

Each tree's pallas_kernels/cpu_matmul.cc is built with cpu_kernel's flags and registered under
its own name; the calls alternate, so that every tree sees the same machine (only trees timed
side by side compare). A call is `--layers` layers' products (q/k/v, o, MLP gate and up, MLP
down: SmolLM2-135M's shapes by default) in one jitted program, each layer with its own packed
weights (as a step's layers: the weights do not stay in the caches between calls), for each
`--rows` count.

    python scripts/bench_cpu_matmul.py --tree before=/path/to/main --tree new=.
    python scripts/bench_cpu_matmul.py --rows 1,8,24,32,240

Prints per row count and tree the median, 25th percentile and minimum ms of a call, the
weights' read rate (their bytes over the median) and the arithmetic rate (2 x rows x the
weights' elements over the median), and the largest difference of its output from the first
tree's.
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


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers of at least 1")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a source tree to time (repeatable; default: this checkout)")
    ap.add_argument("--rows", type=int_list, default=[1, 8, 24, 32],
                    help="row counts, comma-separated (a decode step's rows; a prefill "
                         "chunk's tokens)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--qkv", type=int, default=960, help="q/k/v projections' columns")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()

    trees = kernel_trees.parse(args.tree, ROOT)
    h, f = args.hidden, args.intermediate
    shapes = [(h, args.qkv), (h, h), (h, 2 * f), (f, h)]  # [K, N] of a layer's products
    for k, n in shapes:
        if n % cpu_kernel.PANEL:
            raise SystemExit(f"a product of {n} columns: not a multiple of {cpu_kernel.PANEL}")

    rng = np.random.default_rng(0)
    weights = [[jnp.asarray(cpu_kernel.pack(rng.standard_normal((k, n), np.float32)))
                for k, n in shapes] for _ in range(args.layers)]
    nbytes = sum(k * n for k, n in shapes) * 4 * args.layers
    attrs = {"threads": np.int64(cpu_kernel.threads())}

    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, tree) in enumerate(trees):
            target = f"bench_cpu_matmul_{i}"
            kernel_trees.register(tree, "cpu_matmul.cc", "JpagedCpuMatmul",
                                  Path(tmp) / f"matmul_{i}.so", target)

            def layers(x, weights, target=target):
                # x [m, width]; each product reads the last one's output (a chain, as a
                # step's layers: XLA runs none of them side by side), scaled to stay finite
                m, width, outs = x.shape[0], x.shape[1], []
                for layer in weights:
                    for w in layer:
                        k, n = w.shape[1], w.shape[0] * cpu_kernel.PANEL
                        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))
                        y = call(x[:, :k], w, jnp.int32(m), **attrs) * np.float32(k ** -0.5)
                        x = y[:, :width] if n >= width else jnp.concatenate([y, x[:, n:]], 1)
                        outs.append(y[:, :1])
                return jnp.concatenate(outs, axis=1)

            calls[name] = jax.jit(layers)

    print(f"{args.layers} layers of products {', '.join(f'{k}x{n}' for k, n in shapes)}: "
          f"{nbytes / 1e6:.0f} MB of weights a call; {cpu_kernel.threads()} threads, "
          f"{args.repeat} calls each, alternated")
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, max(k for k, _ in shapes)), np.float32))
        times = kernel_trees.alternate(calls, (x, weights), args.repeat, f"rows {m}: ")
        for name, ms in times.items():
            med = float(np.median(ms))
            print(f"  rows {m:4d} {name:12s} median {med:7.2f} ms  "
                  f"p25 {np.percentile(ms, 25):7.2f}  min {ms.min():7.2f}  "
                  f"{nbytes / med / 1e6:5.1f} GB/s  {2 * m * nbytes / 4 / med / 1e6:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
