"""The layer loop's weight copies on XLA:CPU, alone: SmolLM2's MLP shapes over 30 layers.

    taskset -c 1 python scripts/bench_layer_loop.py --rows 1,32

Each layer is h + silu(h @ W_up[l]) @ W_down[l] (576 x 1536 and back, float32), the weights
stacked [L, ...] as the engine stacks them. Three loop forms compute it: lax.scan over the
stacked weights (the engine's), lax.fori_loop slicing them with dynamic_index_in_dim, and
the layers unrolled (static slices). For each, the optimized HLO's count of dynamic slices
and whether its dots run as YNNPACK fusions, then the CPU ms per call (process time: every
thread of this process; one core unless XLA_FLAGS says otherwise), median and p10 of
--repeat calls, the forms interleaved, beside the step's bounds (weight bytes / --bandwidth,
FLOPs / --peak). Outputs are checked equal across the forms first.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import jax  # after XLA_FLAGS
import jax.numpy as jnp
import numpy as np

L, D, F = 30, 576, 1536


def loops(num_layers: int):
    """name -> jitted f(x [M, D], w_up [L, D, F], w_down [L, F, D]) -> [M, D]."""

    def layer(h, up, down):
        return h + jax.nn.silu(h @ up) @ down

    def scanned(x, w_up, w_down):
        return jax.lax.scan(lambda h, w: (layer(h, *w), None), x, (w_up, w_down))[0]

    def fori(x, w_up, w_down):
        def body(i, h):
            up = jax.lax.dynamic_index_in_dim(w_up, i, keepdims=False)
            down = jax.lax.dynamic_index_in_dim(w_down, i, keepdims=False)
            return layer(h, up, down)

        return jax.lax.fori_loop(0, num_layers, body, x)

    def unrolled(x, w_up, w_down):
        for i in range(num_layers):
            x = layer(x, w_up[i], w_down[i])
        return x

    return {"scan": jax.jit(scanned), "fori_loop": jax.jit(fori), "unrolled": jax.jit(unrolled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32", help="M: rows per call, comma-separated")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--forms", default="scan,fori_loop,unrolled",
                        help="loop forms timed, interleaved in this order (a slow form "
                             "slows the one timed after it: compare forms two at a time)")
    parser.add_argument("--bandwidth", type=float, default=10.6, help="GB/s, for the bound")
    parser.add_argument("--peak", type=float, default=91.0, help="GFLOP/s, for the bound")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    w_up = jnp.asarray(rng.standard_normal((L, D, F), np.float32) * 0.02)
    w_down = jnp.asarray(rng.standard_normal((L, F, D), np.float32) * 0.02)
    print(f"jax {jax.__version__}; XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, D), np.float32))
        fns = {name: loops(L)[name] for name in args.forms.split(",")}
        want = np.asarray(loops(L)["scan"](x, w_up, w_down))
        for name, f in fns.items():
            np.testing.assert_allclose(np.asarray(f(x, w_up, w_down)), want, atol=1e-3)
            hlo = f.lower(x, w_up, w_down).compile().as_text()
            print(f"M={m} {name:10s} dynamic slices {hlo.count('dynamic-slice('):2d}, "
                  f"YNNPACK dot fusions {'yes' if '__ynn_fusion' in hlo else 'no'}")
        times = {name: [] for name in fns}
        for _ in range(args.repeat):
            for name, f in fns.items():
                t = time.process_time()
                f(x, w_up, w_down).block_until_ready()
                times[name].append(time.process_time() - t)
        bytes_bound = L * 2 * D * F * 4 / (args.bandwidth * 1e9) * 1e3
        flop_bound = L * 2 * 2 * m * D * F / (args.peak * 1e9) * 1e3
        print(f"M={m}: bounds {bytes_bound:.1f} ms (weights / bandwidth), "
              f"{flop_bound:.1f} ms (FLOPs / peak)")
        for name, v in times.items():
            ms = np.asarray(v) * 1e3
            print(f"  {name:10s} CPU ms median {np.median(ms):7.2f}  p10 {np.percentile(ms, 10):7.2f}")


if __name__ == "__main__":
    main()
