"""Weight-quantized matmul formulations under jit on this machine (issue 29): ms per call.

    python scripts/bench_quant_matmul.py                     # every shape, batch 1 and 32
    python scripts/bench_quant_matmul.py --shapes 2304x6144 --batches 1

For x [B, K] float32 and a weight [K, N] it times, each as one jitted call:
  f32            x @ w, w float32 (the baseline)
  convert        x @ q.astype(float32) * scale  (int8 q, per-output-channel float32 scale)
  dot_mixed      dot_general(x, q, preferred_element_type=float32) * scale (int8 x float32)
  int8_dot       x quantized per row to int8 (dynamic), dot_general(xq, q,
                 preferred_element_type=int32), * row scale * scale
  scratch        q dequantized into a float32 buffer behind an optimization barrier (so XLA
                 does not fuse the convert into the dot), then a float32 dot
  blocked        the same per block of --block columns (the block's buffer stays in cache)
  scan_k         lax.scan over blocks of --block-rows input rows, each converted in the loop body
  group32        per-group (32 along K) scales: q.astype(f32) * group scales, then the dot
                 (GGUF Q4_1 loaded as int8 before the lossless layout: symmetric, float32 scales)
  offset32       q * group scale + group offset, float16 scale and offset (GGUF Q4_1 / Q5_1
                 loaded without loss: q 0..15, d and m as stored), dequantized, then the dot
  offset32_f32   the same with float32 scale and offset (the K-quants' folded ones)
  offset32_sums  x @ (q * scale) + (x's sums per group of 32) @ offset: the offset as a
                 second, 32x smaller dot instead of an add over the whole weight
Prints one line per (shape, batch, formulation) and the max abs error against f32.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {
    "2304x6144": (2304, 6144),
    "smollm2-q": (576, 576),
    "smollm2-kv": (576, 192),
    "smollm2-up": (576, 1536),
    "smollm2-down": (1536, 576),
    "smollm2-head": (576, 49152),
}


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = np.abs(w).max(axis=0) / 127.0
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def formulations(block: int, block_rows: int):
    def f32(x, w):
        return x @ w

    def convert(x, q, s):
        return (x @ q.astype(jnp.float32)) * s

    def dot_mixed(x, q, s):
        out = jax.lax.dot_general(
            x, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return out * s

    def int8_dot(x, q, s):
        sx = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
        sx = jnp.where(sx == 0, 1.0, sx)
        xq = jnp.clip(jnp.round(x / sx), -127, 127).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * sx * s

    def scratch(x, q, s):
        w = jax.lax.optimization_barrier(q.astype(jnp.float32))
        return (x @ w) * s

    def blocked(x, q, s):
        n = q.shape[1]
        outs = []
        for j in range(0, n, block):
            w = jax.lax.optimization_barrier(q[:, j : j + block].astype(jnp.float32))
            outs.append(x @ w)
        return jnp.concatenate(outs, axis=1) * s

    def scan_k(x, q, s):
        # lax.scan over blocks of `block_rows` input rows: each block converted and multiplied
        # in the loop body, so the float32 copy of the weight is one block, in cache.
        k, n = q.shape
        xb = x.reshape(x.shape[0], k // block_rows, block_rows).transpose(1, 0, 2)
        qb = q.reshape(k // block_rows, block_rows, n)

        def body(acc, blk):
            xi, qi = blk
            return acc + xi @ qi.astype(jnp.float32), None

        acc, _ = jax.lax.scan(body, jnp.zeros((x.shape[0], n), jnp.float32), (xb, qb))
        return acc * s

    def group32(x, q, gs):
        k, n = q.shape
        w = (q.reshape(k // 32, 32, n).astype(jnp.float32) * gs[:, None, :]).reshape(k, n)
        return x @ w

    def offset32(x, q, gs, gm):
        k, n = q.shape
        w = q.reshape(k // 32, 32, n).astype(jnp.float32) * gs.astype(jnp.float32)[:, None, :]
        return x @ (w + gm.astype(jnp.float32)[:, None, :]).reshape(k, n)

    def offset32_sums(x, q, gs, gm):
        k, n = q.shape
        w = q.reshape(k // 32, 32, n).astype(jnp.float32) * gs.astype(jnp.float32)[:, None, :]
        sums = x.reshape(x.shape[0], k // 32, 32).sum(axis=2)
        return x @ w.reshape(k, n) + sums @ gm.astype(jnp.float32)

    return {
        "f32": f32,
        "convert": convert,
        "dot_mixed": dot_mixed,
        "int8_dot": int8_dot,
        "scratch": scratch,
        "blocked": blocked,
        "scan_k": scan_k,
        "group32": group32,
        "offset32": offset32,
        "offset32_f32": offset32,
        "offset32_sums": offset32_sums,
    }


def time_call(fn, args, repeats: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.min(times))  # the least disturbed call: the machine is shared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--block", type=int, default=256, help="columns per block for 'blocked'")
    p.add_argument("--block-rows", type=int, default=64, help="input rows per block, 'scan_k'")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--only", default="", help="comma list of formulations (default: all)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    fns = formulations(args.block, args.block_rows)
    chosen = args.only.split(",") if args.only else list(fns)
    print(f"backend {jax.default_backend()}, jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print(f"{'shape':14} {'batch':>5} {'formulation':12} {'ms/call':>9} {'max|err|':>10}")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        w = rng.normal(0, 0.02, (k, n)).astype(np.float32)
        q, s = quantize(w)
        g = np.abs(w.reshape(k // 32, 32, n)).max(axis=1) / 127.0
        gq = np.clip(np.rint(w.reshape(k // 32, 32, n) / g[:, None]), -127, 127)
        gq = gq.reshape(k, n).astype(np.int8)
        # Q4_1's asymmetric blocks: 16 levels from each block's min to its max.
        lo = w.reshape(k // 32, 32, n).min(axis=1)
        d = (w.reshape(k // 32, 32, n).max(axis=1) - lo) / 15
        d16, lo16 = d.astype(np.float16), lo.astype(np.float16)
        oq = np.rint((w.reshape(k // 32, 32, n) - lo16[:, None]) / d16[:, None])
        oq = np.clip(oq, 0, 15).reshape(k, n).astype(np.int8)
        operands = {
            "f32": (jnp.asarray(w),),
            "group32": (jnp.asarray(gq), jnp.asarray(g.astype(np.float32))),
            "offset32": tuple(map(jnp.asarray, (oq, d16, lo16))),
            "offset32_f32": tuple(jnp.asarray(a.astype(np.float32)) for a in (d16, lo16)),
            "offset32_sums": tuple(map(jnp.asarray, (oq, d16, lo16))),
        }
        operands["offset32_f32"] = (jnp.asarray(oq), *operands["offset32_f32"])
        for batch in (int(b) for b in args.batches.split(",")):
            x = jnp.asarray(rng.normal(0, 1, (batch, k)).astype(np.float32))
            ref = np.asarray(x) @ w
            for f in chosen:
                ops = operands.get(f, (jnp.asarray(q), jnp.asarray(s)))
                if f == "scan_k" and k % args.block_rows:
                    continue
                fn = jax.jit(fns[f])
                ms = time_call(fn, (x, *ops), args.repeats)
                err = float(np.max(np.abs(np.asarray(fn(x, *ops)) - ref)))
                print(f"{name:14} {batch:>5} {f:12} {ms:>9.3f} {err:>10.2e}", flush=True)


if __name__ == "__main__":
    main()
