"""The tied LM head's product in the layouts it could take, A/B interleaved (CPU aid).

    taskset -c 0 python scripts/bench_lm_head.py [--rows 1,8,32] [--repeat 15]

SmolLM2's tied head: hidden [M, 576] times the [49,152, 576] embedding, as compute_logits
runs it (x @ E.T), against the table stored transposed ([576, 49,152], the layout an untied
lm_head has), the greedy argmax fused after the product, and row blocks of 8,192. CPU ms of
this process per call (one core unless XLA_FLAGS says otherwise), median [p10 p90], the forms
run in turn; with the FLOP bound at 91 GFLOP/s and the byte bound at 10.6 GB/s
(docs/benchmarks.md, "Where the CPU step's time goes").
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import numpy as np

VOCAB, HIDDEN, BLOCK = 49152, 576, 8192


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, HIDDEN), np.float32) * 0.05
    e, e_t = jnp.asarray(table), jnp.asarray(np.ascontiguousarray(table.T))
    forms = {
        "x @ E.T (today)": (jax.jit(lambda x, w: x @ w.T), e),
        "x @ E_t (stored [D, V])": (jax.jit(lambda x, w: x @ w), e_t),
        "argmax(x @ E.T)": (jax.jit(lambda x, w: jnp.argmax(x @ w.T, -1)), e),
        f"blocks of {BLOCK} rows": (
            jax.jit(
                lambda x, w: jnp.concatenate(
                    [x @ w[i : i + BLOCK].T for i in range(0, VOCAB, BLOCK)], -1
                )
            ),
            e,
        ),
    }
    for m in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))
        for f, w in forms.values():
            f(x, w).block_until_ready()
        times = {name: [] for name in forms}
        for _ in range(args.repeat):
            for name, (f, w) in forms.items():
                t0 = time.process_time()
                f(x, w).block_until_ready()
                times[name].append((time.process_time() - t0) * 1e3)
        for name, t in times.items():
            med, lo, hi = np.percentile(t, [50, 10, 90])
            print(f"M={m} {name}: CPU ms {med:.2f} [{lo:.2f} {hi:.2f}]", flush=True)
        flops, nbytes = 2 * m * VOCAB * HIDDEN / 91e9, VOCAB * HIDDEN * 4 / 10.6e9
        print(f"M={m} bounds: FLOPs {flops * 1e3:.2f} ms, bytes {nbytes * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
