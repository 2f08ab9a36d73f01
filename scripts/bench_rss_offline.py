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

    python scripts/bench_rss_offline.py --max-num-seqs 16 --max-model-len 256 \
        --precompile-max-len 256 --runs 8 --num-requests 48 --prompt-len 8:200 --output-len 8:50
    ... the same with --no-warm-up-runs

With --precompile-max-len every step program is compiled before the first run, and each
line also gives the step programs run so far and the memory in use in glibc's thread
arenas (malloc_info: each non-main arena's size less its free chunks), where XLA:CPU's
intra-op threads keep what a program's first run leaves. --no-warm-up-runs skips the runs
precompile makes of each program on request-like rows (ModelRunner._warm_up_runs), the A/B
of docs/serving.md (issue 16.12).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import random
import tempfile
import time
import xml.etree.ElementTree as ET

from bench_serving import parse_range, rss_mib

from jpaged import LLM, SamplingParams
from jpaged.worker.runner import ModelRunner
from server.engine_loop import heap_trimmer


def _span(text: str) -> tuple[int, int]:
    lo, hi = parse_range(text)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def thread_arenas_in_use_mib() -> float:
    """glibc's malloc_info: the bytes in use in every arena but the main one, in MiB."""
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        stream = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        root = ET.parse(f.name).getroot()
    in_use = 0
    for heap in root.findall("heap"):
        if heap.get("nr") == "0":
            continue
        size = sum(int(s.get("size")) for s in heap.findall("system") if s.get("type") == "current")
        free = sum(int(t.get("size")) for t in heap.findall("total")
                   if t.get("type") in ("fast", "rest"))  # fmt: skip
        in_use += size - free
    return in_use / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo-random")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=_span, default=(8, 256), help="LO:HI tokens")
    p.add_argument("--output-len", type=_span, default=(8, 64), help="LO:HI tokens")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--precompile-max-len", type=int, default=None,
                   help="precompile every step program of sequences up to N tokens first")
    p.add_argument("--no-warm-up-runs", action="store_true",
                   help="with --precompile-max-len: compile only, no warm-up runs (A/B)")
    args = p.parse_args()
    if args.no_warm_up_runs:
        ModelRunner._warm_up_runs = lambda self, keys: None
    kwargs = {"max_num_seqs": args.max_num_seqs}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.precompile_max_len is not None:
        kwargs.update(precompile=True, precompile_max_len=args.precompile_max_len)
    llm = LLM(args.model, **kwargs)
    run_keys = set()  # step programs run since start-up
    runner = llm.llm_engine.runner
    run_step = runner.run_step
    runner.run_step = lambda key, inputs: run_keys.add(key) or run_step(key, inputs)
    vocab = llm.llm_engine.model_config.vocab_size
    trim = heap_trimmer()  # what the server's engine thread calls when it goes idle
    if trim is None:
        raise SystemExit("this C library has no malloc_trim (glibc needed)")
    pid = os.getpid()
    print(f"start: rss {rss_mib(pid):.1f} MiB, thread arenas in use "
          f"{thread_arenas_in_use_mib():.1f} MiB", flush=True)
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
            f"{stats['num_compiled']}, pages used {stats['pages_used']}, step programs run "
            f"{len(run_keys)}, thread arenas in use {thread_arenas_in_use_mib():.1f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
