"""Load test for the gRPC server over loopback.

Sends --num-requests Generate calls with Poisson arrivals (--rate per second; inf sends as
fast as --concurrency allows), at most --concurrency in flight, with prompt and output
lengths drawn uniformly from the given ranges (ignore_eos, so outputs have exactly the
drawn length). Reports requests/s, output tokens/s, TTFT and TPOT percentiles, errors by
status code, the server's KV pages in use once idle, and the server's RSS after each run.

    # against a server it starts itself (its RSS is read from /proc):
    python scripts/bench_serving.py --launch "--max-num-seqs 64" --num-requests 2000 \
        --concurrency 256 --rate 100 --repeats 3
    # against a running server:
    python scripts/bench_serving.py --port 50051 --server-pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.proto.jpaged.v1 import generation_pb2 as pb
from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def one_request(stub, req, timeout: float) -> dict:
    start = time.perf_counter()
    first = None
    num_tokens = 0
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            n = sum(len(c.token_ids) for c in msg.choices)
            if n and first is None:
                first = time.perf_counter()
            num_tokens += n
        code = "OK"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    end = time.perf_counter()
    return {"code": code, "start": start, "first": first, "end": end, "tokens": num_tokens}


async def run_once(args, stub, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(args.concurrency)
    results = []

    async def worker(req):
        try:
            results.append(await one_request(stub, req, args.timeout))
        finally:
            sem.release()

    tasks = []
    t0 = time.perf_counter()
    for i in range(args.num_requests):
        if args.rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.rate))
        plen, olen = rng.randint(*args.prompt_len), rng.randint(*args.output_len)
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[rng.randrange(3, vocab) for _ in range(plen)]),
            sampling=pb.SamplingParameters(
                max_tokens=olen,
                ignore_eos=True,
                temperature=args.temperature,
                seed=rng.randrange(2**31),
            ),
        )
        await sem.acquire()
        tasks.append(asyncio.create_task(worker(req)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    ok = [r for r in results if r["code"] == "OK"]
    out_tokens = sum(r["tokens"] for r in ok)
    ttft = [r["first"] - r["start"] for r in ok if r["first"] is not None]
    tpot = [
        (r["end"] - r["first"]) / (r["tokens"] - 1)
        for r in ok
        if r["first"] is not None and r["tokens"] > 1
    ]
    return {
        "duration_s": duration,
        "requests": len(results),
        "requests_per_s": len(ok) / duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "errors": dict(collections.Counter(r["code"] for r in results if r["code"] != "OK")),
    }


async def wait_idle(stub, timeout: float = 30) -> pb.EngineStats:
    deadline = time.monotonic() + timeout
    while True:
        stats = (await stub.GetModelInfo(pb.GetModelInfoRequest())).stats
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def bench(args, server_pid: int | None) -> list[dict]:
    async with grpc.aio.insecure_channel(f"{args.host}:{args.port}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=600, wait_for_ready=True)
        vocab = min(info.vocab_size, args.max_token_id or info.vocab_size)
        print(
            f"model {info.model} ({info.architecture}), vocab {info.vocab_size}, "
            f"max_model_len {info.max_model_len}, pages {info.stats.pages_total}; "
            f"server RSS {rss_mib(server_pid)} MiB",
            file=sys.stderr,
        )
        runs = []
        for i in range(args.warmup + args.repeats):
            result = await run_once(args, stub, vocab, args.seed + i)
            stats = await wait_idle(stub)
            result.update(
                warmup=i < args.warmup,
                pages_used_after=stats.pages_used,
                pages_cached_after=stats.pages_cached,
                num_preemptions_total=stats.num_preemptions,
                server_rss_mib_after=rss_mib(server_pid),
            )
            runs.append(result)
            print(json.dumps(result), flush=True)
        return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> subprocess.Popen:
    args.port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--metrics-port",
        "-1",
        "--max-waiting",
        "-1",
        "--log-level",
        "WARNING",
        *shlex.split(args.launch),
    ]
    print("launching:", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--server-pid", type=int, default=None, help="read this process's RSS")
    p.add_argument(
        "--launch",
        default=None,
        metavar="SERVE_ARGS",
        help="start `python -m server serve SERVE_ARGS` on a free port and stop it "
        "with SIGTERM at the end",
    )
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    p.add_argument("--prompt-len", type=parse_range, default=(16, 128), help="LO:HI tokens")
    p.add_argument("--output-len", type=parse_range, default=(8, 64), help="LO:HI tokens")
    p.add_argument("--max-token-id", type=int, default=None, help="draw prompt ids below this")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600, help="per-request deadline, s")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0, help="unreported runs first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write all runs here")
    args = p.parse_args()
    proc = launch(args) if args.launch is not None else None
    pid = proc.pid if proc is not None else args.server_pid
    try:
        runs = asyncio.run(bench(args, pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(120)
            print(f"server exited {code} after SIGTERM", file=sys.stderr)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(runs, indent=2))
    bad = any(r["errors"] or r["pages_used_after"] for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
