"""Peak RSS of the two commands a new user runs first, at their default flags (issue 33.3),
and where an engine's memory goes.

    python scripts/bench_rss_defaults.py                 # the built-in SmolLM2
    python scripts/bench_rss_defaults.py --model demo-random
    python scripts/bench_rss_defaults.py --serve-max-num-seqs 4 8   # servers of fewer slots

1. `jpaged generate --chat "What is the capital of France?" --temperature 0` in its own
   process: its peak RSS (os.wait4's ru_maxrss).
2. `jpaged serve` at its defaults (ports chosen here): once /health answers 200, the idle
   server's RSS and peak RSS (VmRSS, VmHWM of /proc/PID/status).
3. The breakdown, in a fresh process per slot count (1: generate's engine, 4: the server's
   default on CPU, 32: its default elsewhere): RSS after importing jax and jpaged (Python),
   after loading the model (weights), after building the engine (the KV pool: its pages and
   bytes are printed beside), after warm_up (the compiled programs and their first runs),
   after one request.
The KV pool's size comes from the engine's default rule (jpaged/core/memory_plan.py
resolve_num_pages), which the engine logs; its line is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"

STAGES = r"""
import json, logging, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
out = {"start": rss()}
from jpaged.worker.host_memory import limit_malloc_arenas
limit_malloc_arenas()  # as the command line does, before jax starts its threads
import jax, numpy as np
from jpaged.core.engine import LLMEngine
from jpaged.entrypoints.engine_args import engine_config_from_args
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.model_loading import load_for_config
from models import quantization
out["python"] = rss()
config = engine_config_from_args(MODEL, max_num_seqs=SEQS)
loaded = load_for_config(config)
out["weights"] = rss()
out["weight_mib"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(loaded.params)) / 2**20
engine = LLMEngine(config, loaded=loaded)
out["pool"] = rss()
item = np.dtype(quantization.activation_dtype(loaded.params)).itemsize
out["num_pages"] = engine.num_pages
per_page = engine.model_config.kv_bytes_per_page(engine.config.cache.page_size, item)
out["pool_mib"] = engine.num_pages * per_page / 2**20
engine.warm_up()
out["compiled"] = rss()
_, ids = engine.chat_prompt([{"role": "user", "content": QUESTION}])
engine.add_request("q", ids, SamplingParams(temperature=0, max_tokens=16))
while engine.has_unfinished_requests():
    engine.step()
out["request"] = rss()
print("STAGES " + json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def jpaged(*args: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", *args]


def measure_generate(model: list[str]) -> None:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        jpaged("generate", "--chat", QUESTION, "--temperature", "0", *model),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    pool = [line for line in err.splitlines() if "KV pool" in line]
    print(f"generate: exit {os.waitstatus_to_exitcode(status)}, peak RSS "
          f"{usage.ru_maxrss / 1024:.0f} MiB, {time.perf_counter() - t0:.1f} s; "
          f"answer {out.strip()!r}")  # fmt: skip
    print("  " + (pool[-1].split("] ")[-1] if pool else "(no KV pool line in its log)"))


def measure_server(model: list[str], timeout: float, extra: list[str]) -> None:
    http = free_port()
    log = open(os.devnull, "w")  # noqa: SIM115
    proc = subprocess.Popen(
        jpaged("serve", "--port", str(free_port()), "--http-port", str(http),
               "--metrics-port", "off", *model, *extra),
        cwd=ROOT, stdout=log, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    t0 = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"serve not healthy after {timeout:.0f} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        healthy = time.perf_counter() - t0
        time.sleep(2.0)  # idle
        rss, peak = status_mib(proc.pid, "VmRSS"), status_mib(proc.pid, "VmHWM")
        flags = " ".join(extra) or "default flags"
        print(
            f"serve ({flags}): healthy after {healthy:.1f} s; idle RSS {rss:.0f} MiB, "
            f"peak {peak:.0f} MiB"
        )
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    pool = [line for line in err.splitlines() if "KV pool" in line]
    print("  " + (pool[-1].split("] ")[-1] if pool else "(no KV pool line in its log)"))


def measure_stages(model: str | None, seqs: int) -> None:
    code = f"MODEL = {model!r}\nSEQS = {seqs}\nQUESTION = {QUESTION!r}\n" + STAGES
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    [line] = [x for x in res.stdout.splitlines() if x.startswith("STAGES ")]
    s = json.loads(line[len("STAGES ") :])
    print(
        f"breakdown, max_num_seqs {seqs}: Python + jax + jpaged {s['python']:.0f} MiB; "
        f"weights +{s['weights'] - s['python']:.0f} MiB ({s['weight_mib']:.0f} MiB of arrays); "
        f"pool +{s['pool'] - s['weights']:.0f} MiB ({s['num_pages']} pages, "
        f"{s['pool_mib']:.0f} MiB); warm-up (compiled programs) "
        f"+{s['compiled'] - s['pool']:.0f} MiB; one request +{s['request'] - s['compiled']:.0f} "
        f"MiB; total {s['request']:.0f} MiB"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--skip", nargs="*", default=[], choices=["generate", "serve", "stages"])
    p.add_argument(
        "--serve-max-num-seqs",
        type=int,
        nargs="*",
        default=[],
        help="also measure an idle server with each of these --max-num-seqs",
    )
    args = p.parse_args()
    model = ["--model", args.model] if args.model else []
    if "generate" not in args.skip:
        measure_generate(model)
    if "serve" not in args.skip:
        measure_server(model, args.server_timeout, [])
        for n in args.serve_max_num_seqs:
            measure_server(model, args.server_timeout, ["--max-num-seqs", str(n)])
    if "stages" not in args.skip:
        for seqs in (1, 4, 32):
            measure_stages(args.model, seqs)


if __name__ == "__main__":
    main()
