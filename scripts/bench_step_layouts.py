"""The engine's step under each layers layout, A/B interleaved in one process (CPU aid).

    taskset -c 1 python scripts/bench_step_layouts.py --cases 32:32:32:1:160,16:4:1:1:160 \
        --layouts stacked,switched [--repeat 12]

A case is T:S:rows:new:context: the step's token and sequence buckets (the CPU engine's own:
a decode step of r rows runs bucket(r) tokens and rows, at least 4 tokens and 4 rows; a
lone decode 1:1), the
rows with `new` tokens each ending at `context` cached tokens (512:4:4:128:128 is a 512-token
prefill of four 128-token prompts), over the full page-table width of a 2,048-token
max_model_len. Layouts (models/llama.py): stacked (lax.scan over stacked weights: every layer's
weights dynamic-sliced out, a copy on XLA:CPU), switched (per-layer weights under the scan,
picked by lax.switch: the CPU default, with a tied embedding's LM head stored transposed),
switched_embed_head (switched, the LM head multiplying the [V, D] embedding), switched_separate
(switched without merging q/k/v and gate/up: fuse_projections) and unrolled. For each case and
layout: the compile time, whether the greedy tokens agree, and the CPU ms per step of this
process (every thread: one core unless XLA_FLAGS says otherwise) and the wall ms, median [p10
p90] of --repeat steps, the layouts
run in turn so that a loaded machine slows them alike. With --interleave the cases run in
turn too, step by step (an A/B of two buckets: 16:4:1:1:160,4:4:1:1:160), after all are
compiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

PAGE, COLS = 16, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="32:32:32:1:160,16:4:1:1:160")
    p.add_argument("--layouts", default="stacked,switched")
    p.add_argument("--repeat", type=int, default=12)
    p.add_argument("--interleave", action="store_true", help="the cases in turn, step by step")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    import profile_step

    from jpaged.worker.step_inputs import StepKey
    from models import llama
    from models.demo import ensure_smollm2
    from models.loader import load_model

    loaded = load_model(str(ensure_smollm2()), dtype=jnp.float32)
    cfg = loaded.config
    make = {"stacked": llama.stack_layers, "switched": llama.switch_layers,
            "switched_embed_head": lambda p: llama.switch_layers(p, tied_head=False),
            "switched_separate": lambda p: llama.switch_layers(p, fuse=False),
            "unrolled": llama.unstack_layers}
    layouts = {name: make[name](loaded.params) for name in args.layouts.split(",")}
    print(f"jax {jax.__version__}; XLA_FLAGS={os.environ['XLA_FLAGS']!r}", flush=True)
    cases = {}  # case -> {layout: StepBench}
    for case in args.cases.split(","):
        if case in cases:
            continue
        t, s, rows, new, context = map(int, case.split(":"))
        key = StepKey(t, s, COLS, False)
        per_row = -(-context // PAGE) + 1
        inputs, table = profile_step._inputs(cfg, key, rows=rows, context=context,
                                             new_per_row=new, page_size=PAGE,
                                             pages_per_seq=per_row)
        table = np.pad(table, ((0, 0), (0, COLS - per_row)))
        benches, tokens = {}, []
        for name, params in layouts.items():
            bench = profile_step.StepBench(params, cfg, key, inputs, table, rows * per_row + 1,
                                           PAGE, args.repeat)
            t0 = time.perf_counter()
            bench.step_fn.lower(bench.params, bench.state, bench.inputs, bench.prev).compile()
            compile_s = time.perf_counter() - t0
            out, _, bench.state = bench.step_fn(bench.params, bench.state, bench.inputs,
                                                bench.prev)
            tokens.append(np.asarray(out.tokens)[:rows])
            benches[name] = bench
            print(f"{case} {name}: compiled in {compile_s:.1f}s", flush=True)
        print(f"  tokens equal: {all((x == tokens[0]).all() for x in tokens)}", flush=True)
        if args.interleave:
            cases[case] = benches
        else:
            _time({case: benches}, args.repeat)
    if cases:
        _time(cases, args.repeat)


def _time(cases: dict, repeat: int) -> None:
    """Each case's layouts in turn, repeat steps each: CPU ms of this process per step."""
    import jax

    times = {(case, name): [] for case, benches in cases.items() for name in benches}
    walls = {k: [] for k in times}
    for _ in range(repeat):
        for case, benches in cases.items():
            for name, bench in benches.items():
                c0, w0 = time.process_time(), time.perf_counter()
                out, _, bench.state = bench.step_fn(bench.params, bench.state, bench.inputs,
                                                    bench.prev)
                jax.block_until_ready(out.tokens)
                times[case, name].append(1e3 * (time.process_time() - c0))
                walls[case, name].append(1e3 * (time.perf_counter() - w0))
    for (case, name), v in times.items():
        w = walls[case, name]
        print(f"  {case} {name:9s} CPU ms median {np.median(v):8.1f} "
              f"[p10 {np.percentile(v, 10):.1f} p90 {np.percentile(v, 90):.1f}]"
              f"  wall ms median {np.median(w):8.1f} "
              f"[p10 {np.percentile(w, 10):.1f} p90 {np.percentile(w, 90):.1f}]", flush=True)

if __name__ == "__main__":
    main()
