"""The engine's RSS over repeated runs of one load, with no server (issue 16, item 12).

    python scripts/bench_rss_offline.py                  # demo model, 50 runs of 500 requests
    python scripts/bench_rss_offline.py --runs 10 --model /path/to/checkpoint

Each run generates --num-requests random token-id prompts (lengths uniform in --prompt-len,
outputs uniform in --output-len, sampled at temperature 1 with per-request seeds, EOS
ignored) through LLM.generate on one engine, the load `scripts/bench_serving.py` sends a
server in docs/serving.md. After each run: gc.collect() and glibc's malloc_trim (as the
server's engine thread trims when it goes idle), then the process's RSS, the programs
compiled so far and the KV pages still used. A step program compiled in a run adds its code
to the RSS; between compiles the RSS of an engine that keeps nothing per request stays flat.
Comparing this with the server's RSS under the same load tells the engine's memory from the
serving layers'.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

from bench_serving import parse_range, rss_mib

from jpaged import LLM, SamplingParams
from server.engine_loop import heap_trimmer


def _span(text: str) -> tuple[int, int]:
    lo, hi = parse_range(text)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo-random")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=_span, default=(8, 256), help="LO:HI tokens")
    p.add_argument("--output-len", type=_span, default=(8, 64), help="LO:HI tokens")
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs)
    vocab = llm.llm_engine.model_config.vocab_size
    trim = heap_trimmer()  # what the server's engine thread calls when it goes idle
    if trim is None:
        raise SystemExit("this C library has no malloc_trim (glibc needed)")
    pid = os.getpid()
    print(f"start: rss {rss_mib(pid):.1f} MiB", flush=True)
    for run in range(args.runs):
        rng = random.Random(run)
        prompts = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
            for _ in range(args.num_requests)
        ]
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=rng.randint(*args.output_len), ignore_eos=True, seed=i
            )
            for i in range(args.num_requests)
        ]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        del outputs, prompts, params
        gc.collect()
        trim()
        stats = llm.llm_engine.stats()
        print(
            f"run {run + 1}: {seconds:.1f} s, rss {rss_mib(pid):.1f} MiB, programs compiled "
            f"{stats['num_compiled']}, pages used {stats['pages_used']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
