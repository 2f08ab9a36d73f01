"""Load test for the server over loopback, by gRPC or by the OpenAI-compatible HTTP API.

Sends --num-requests requests (gRPC Generate, or streamed POST /v1/completions with
--protocol http) with Poisson arrivals (--rate per second; inf sends as fast as --concurrency
allows), at most --concurrency in flight, with token-id prompts and output lengths drawn
uniformly from the given ranges (ignore_eos, so outputs have exactly the drawn length); both
protocols get the same requests for the same --seed. Reports, as vLLM's benchmark_serving
does, requests/s, output tokens/s, time to first token and inter-token latency (the gaps
between messages that carry tokens) at p50/p90/p99, TPOT, errors by status, the server's KV
pages in use once idle (GetModelInfo over gRPC, which the HTTP runs use too), and the
server's RSS after each run.

Mixed sizes (--long-fraction F): a share F of the requests are long ones (--long-prompt-len,
--long-output-len; near max_model_len against a small pool, they do not fit beside many
others), the rest short. Each run then also reports end-to-end latency and time to first
token of the short and the long requests apart; with --compare-without-long every run is
made twice, with the long requests and without them (the same short requests at the same
arrival times), so the short ones' p50/p99 show what the long ones cost them.

    # against a server it starts itself (its RSS is read from /proc):
    python scripts/bench_serving.py --launch "--max-num-seqs 64" --num-requests 2000 \
        --concurrency 256 --rate 100 --repeats 3 [--protocol http]
    # mixed sizes against a small pool (19 pages of 16 tokens: one 256-token sequence):
    python scripts/bench_serving.py --launch "--model demo-random --max-num-seqs 8 \
        --max-model-len 256 --num-pages 20" --num-requests 400 --rate 10 --prompt-len 8:16 \
        --output-len 8:16 --long-fraction 0.1 --long-prompt-len 200:220 \
        --long-output-len 20:30 --compare-without-long --warmup 1 --repeats 3
    # against a running server (gRPC port for its stats, HTTP port for --protocol http):
    python scripts/bench_serving.py --port 50051 --http-port 8000 --server-pid 1234

Multi-turn agent sessions with the KV host/disk tier off and on (--workload agent, HTTP;
scripts/serving_agent.py says what it runs and reports):

    python scripts/bench_serving.py --workload agent --launch "" --sessions 4 --turns 8

Tool calls (--workload tools, --protocol http): streamed chat requests with two tools
(bounded JSON schemas), in three phases of --num-requests each at --concurrency: "tools"
(tool_choice "required" and a named function in turn, parallel_tool_calls false, max_tokens
drawn from --output-len as a bound: the grammar closes the call first), "plain" (the same
prompts, tools included, with tool_choice "none", ignore_eos and max_tokens = the output
length of the same request in "tools": free decoding at the same prompt and output lengths),
and "mixed" (the tool requests and the plain ones side by side, alternating). Reports the
share of tool calls whose arguments validate against their tool's schema (jsonschema),
output tokens/s of "tools" and "plain", and per-request decode time (TPOT) of each kind.

    python scripts/bench_serving.py --protocol http --workload tools --launch \
        "--model smollm2 --max-num-seqs 64" --num-requests 64 --concurrency 64 --output-len 48

An agent's tool loop (--tool-loop, the same as --workload tool-loop; HTTP): --num-requests
sessions, at most --concurrency at once, each of --turns streamed chat turns on one growing
history, as an agent framework sends them: every turn but the last under tool_choice
"required" (one call; the history then gains the assistant's message with null content and
its tool_calls, and the tool's result), the last under "auto" with no server flag. Reports
turns/s, and per turn index the time to first token, the turn's latency and its prompt
tokens against those the prefix cache held (usage.prompt_tokens_details.cached_tokens): from
the second turn on, the whole first turn's prompt should be cached.

    python scripts/bench_serving.py --tool-loop --launch "--max-num-seqs 4" \
        --num-requests 8 --concurrency 4 --turns 3 --output-len 48
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
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import serving_agent

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


class Timeline:
    """One request's token arrivals: when each message that carried tokens came."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens = 0

    def got(self, num_tokens: int) -> None:
        if num_tokens:
            self.times.append(time.perf_counter())
            self.tokens += num_tokens

    def result(self, code: str) -> dict:
        first = self.times[0] if self.times else None
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return {
            "code": code,
            "start": self.start,
            "first": first,
            "end": time.perf_counter(),
            "tokens": self.tokens,
            "itl": gaps,
        }


async def grpc_request(stub, req: dict, timeout: float, metadata=None) -> dict:
    msg = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=req["prompt"]),
        sampling=pb.SamplingParameters(
            max_tokens=req["max_tokens"],
            ignore_eos=True,
            temperature=req["temperature"],
            seed=req["seed"],
        ),
    )
    timeline = Timeline()
    try:
        async for out in stub.Generate(msg, timeout=timeout, metadata=metadata):
            timeline.got(sum(len(c.token_ids) for c in out.choices))
        code = "OK"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    return timeline.result(code)


class SSEClient:
    """A minimal keep-alive HTTP/1.1 client for streamed POSTs, so that the load generator
    costs about as little CPU per token as grpc's C core does on the gRPC side (httpx spent
    3x the server's CPU time here, and the two share the machine). Yields each event's data."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post_events(self, path: str, body: dict):
        """(status, async iterator of event data strings); raises OSError on a broken link.
        An idle connection the server has closed meanwhile (uvicorn's keep-alive timeout, 5 s:
        between runs) is replaced by a new one."""
        data = json.dumps(body).encode()
        request = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n{self._head}"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        while True:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await self._connect()
            writer.write(request)
            try:
                line = await reader.readline()
            except ConnectionError:
                line = b""
            if line or not reused:
                break
            writer.close()
        if not line:
            raise ConnectionError("the server closed the connection")
        status = int(line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        return status, self._events(reader, writer, headers)

    async def _connect(self):
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def _events(self, reader, writer, headers):
        buffer = b""
        if headers.get("transfer-encoding") == "chunked":
            while size := int((await reader.readline()).strip(), 16):
                buffer += (await reader.readexactly(size + 2))[:-2]  # a chunk, then CRLF
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: "):
                        yield event[6:].decode()
            await reader.readline()
        else:
            await reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection") == "close":
            writer.close()
        else:
            self._idle.append((reader, writer))

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()


async def http_request(client: SSEClient, req: dict, timeout: float) -> dict:
    body = {**req, "ignore_eos": True, "stream": True, "return_token_ids": True}
    return await http_stream(client, "/v1/completions", body, timeout)


async def http_stream(client: SSEClient, path: str, body: dict, timeout: float,
                      on_choice=None) -> dict:  # fmt: skip
    """One streamed call's timeline (each chunk's token ids counted); on_choice(choice) sees
    every choice of every chunk."""
    timeline = Timeline()
    usage: dict = {}

    async def stream() -> str:
        status, events = await client.post_events(path, body)
        code = "OK" if status == 200 else f"HTTP {status}"
        async for data in events:
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                code = "stream error"
                continue
            timeline.got(sum(len(c.get("token_ids") or ()) for c in chunk["choices"]))
            if chunk.get("usage"):
                usage.update(chunk["usage"])
            for c in chunk["choices"] if on_choice is not None else ():
                on_choice(c)
        return code

    try:
        code = await asyncio.wait_for(stream(), timeout)
    except (OSError, ValueError, asyncio.IncompleteReadError, TimeoutError) as e:
        code = type(e).__name__
    return {**timeline.result(code), "usage": usage}


# ---- the tools workload -------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 10}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                      "parameters": schema}}
    for name, schema in TOOL_SCHEMAS.items()
]  # fmt: skip
PLACES = ("Paris", "Lyon", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth")


async def http_chat(client: SSEClient, body: dict, timeout: float) -> dict:
    """A streamed chat call: its timeline and the tool calls its deltas add up to."""
    body = {**body, "stream": True, "return_token_ids": True}
    calls: dict[int, dict] = {}
    content: list[str] = []

    def read(choice: dict) -> None:
        content.append(choice["delta"].get("content") or "")
        for d in choice["delta"].get("tool_calls") or ():
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments") or ""

    result = await http_stream(client, "/v1/chat/completions", body, timeout, read)
    return {**result, "calls": list(calls.values()), "content": "".join(content)}


def valid_call(call: dict, want_name: str | None) -> bool:
    import jsonschema

    if call["name"] not in TOOL_SCHEMAS or want_name not in (None, call["name"]):
        return False
    try:
        jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def tool_requests(args, seed: int) -> list[dict]:
    """The "tools" phase's bodies: required and each named function in turn."""
    rng = random.Random(seed)
    bodies = []
    for i in range(args.num_requests):
        place = rng.choice(PLACES)
        choice = ["required", "get_weather", "get_time"][i % 3]
        ask = f"What is the weather in {place}?" if i % 3 != 2 else f"What time is it in {place}?"
        bodies.append({
            "messages": [{"role": "user", "content": ask}],
            "tools": TOOLS,
            "tool_choice": choice if choice == "required" else
            {"type": "function", "function": {"name": choice}},
            "parallel_tool_calls": False,
            "max_tokens": rng.randint(*args.output_len),
            "temperature": args.temperature,
            "seed": rng.randrange(2**31),
        })  # fmt: skip
    return bodies


def is_plain(body: dict) -> bool:
    return body["tool_choice"] == "none"


def named_function(body: dict) -> str | None:
    choice = body["tool_choice"]
    return choice["function"]["name"] if isinstance(choice, dict) else None


def plain_twin(body: dict, num_tokens: int) -> dict:
    """The same prompt decoded freely to num_tokens tokens."""
    return {**body, "tool_choice": "none", "ignore_eos": True, "max_tokens": max(num_tokens, 1)}


async def run_phase(args, client: SSEClient, bodies: list[dict]) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(args.concurrency)

    async def one(body):
        async with sem:
            return await http_chat(client, body, args.timeout)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(b) for b in bodies))
    return list(results), time.perf_counter() - t0


def phase_summary(results: list[dict], duration: float, bodies: list[dict]) -> dict:
    ok = [r for r in results if r["code"] == "OK"]
    tokens = sum(r["tokens"] for r in ok)
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok
            if r["first"] is not None and r["tokens"] > 1]  # fmt: skip
    out = {
        "requests": len(results),
        "duration_s": duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "tpot_s": percentiles(tpot),
        "errors": dict(collections.Counter(r["code"] for r in results if r["code"] != "OK")),
    }
    tool = [(r, b) for r, b in zip(results, bodies) if not is_plain(b)]
    if tool:
        calls = [(c, b) for r, b in tool if r["code"] == "OK" for c in r["calls"]]
        num_valid = sum(valid_call(c, named_function(b)) for c, b in calls)
        out.update(
            tool_requests=len(tool),
            tool_calls=len(calls),
            tool_calls_valid=num_valid,
            tool_calls_valid_pct=100.0 * num_valid / max(len(calls), 1),
            tool_requests_without_call=sum(1 for r, _ in tool if not r["calls"]),
        )
    return out


async def run_tools(args, client: SSEClient, seed: int) -> dict:
    """The three phases of one run of the tools workload."""
    bodies = tool_requests(args, seed)
    tools, tools_s = await run_phase(args, client, bodies)
    twins = [plain_twin(b, r["tokens"]) for b, r in zip(bodies, tools)]
    plain, plain_s = await run_phase(args, client, twins)
    mixed_bodies = [b if i % 2 == 0 else t for i, (b, t) in enumerate(zip(bodies, twins))]
    mixed, mixed_s = await run_phase(args, client, mixed_bodies)
    by_kind = {}
    for kind in ("tool", "plain"):
        pairs = [(r, b) for r, b in zip(mixed, mixed_bodies) if is_plain(b) == (kind == "plain")]
        by_kind[kind] = phase_summary([r for r, _ in pairs], mixed_s, [b for _, b in pairs])
    summary = {
        "tools": phase_summary(tools, tools_s, bodies),
        "plain": phase_summary(plain, plain_s, twins),
        "mixed": {"duration_s": mixed_s, **by_kind},
    }
    errors = collections.Counter()
    for phase in (summary["tools"], summary["plain"], by_kind["tool"], by_kind["plain"]):
        errors.update(phase["errors"])
    return {**summary, "errors": dict(errors)}


# ---- the tool-loop workload ---------------------------------------------------------------


async def run_tool_loop(args, client: SSEClient, seed: int) -> dict:
    """--num-requests sessions of --turns turns each (module docstring)."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(args.concurrency)

    async def session(i: int) -> list[dict]:
        place = rng.choice(PLACES)
        messages = [
            {"role": "system", "content": "You are a weather assistant. Use the tools."},
            {"role": "user", "content": f"What is the weather in {place}, and the time?"},
        ]
        turns = []
        async with sem:
            for t in range(args.turns):
                last = t == args.turns - 1
                body = {
                    "messages": messages,
                    "tools": TOOLS,
                    "tool_choice": "auto" if last else "required",
                    "parallel_tool_calls": False,
                    "max_tokens": args.output_len[1],
                    "temperature": 0.0,
                    "stream_options": {"include_usage": True},
                }
                r = await http_chat(client, body, args.timeout)
                turns.append({**r, "turn": t})
                if r["code"] != "OK" or last:
                    break
                if not r["calls"]:
                    r["code"] = "no tool call under required"
                    break
                call = r["calls"][0]
                call_id = f"call_{i}_{t}"
                messages = [
                    *messages,
                    {"role": "assistant", "content": None, "tool_calls": [{"id": call_id,
                     "type": "function", "function": call}]},
                    {"role": "tool", "tool_call_id": call_id, "content": f"sunny in {place}"},
                ]  # fmt: skip
        return turns

    t0 = time.perf_counter()
    sessions = await asyncio.gather(*(session(i) for i in range(args.num_requests)))
    duration = time.perf_counter() - t0
    every = [turn for turns in sessions for turn in turns]
    errors = collections.Counter(t["code"] for t in every if t["code"] != "OK")
    per_turn = []
    for t in range(args.turns):
        ok = [x for x in every if x["turn"] == t and x["code"] == "OK"]
        prompt = sum(x["usage"].get("prompt_tokens", 0) for x in ok)
        cached = sum(
            (x["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for x in ok
        )
        per_turn.append({
            "turn": t,
            "turns": len(ok),
            "ttft_s": percentiles([x["first"] - x["start"] for x in ok if x["first"]]),
            "latency_s": percentiles([x["end"] - x["start"] for x in ok]),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
        })  # fmt: skip
    ok_turns = sum(1 for x in every if x["code"] == "OK")
    return {
        "workload": "tool-loop",
        "sessions": args.num_requests,
        "duration_s": duration,
        "turns_ok": ok_turns,
        "turns_per_s": ok_turns / duration,
        "per_turn": per_turn,
        "errors": dict(errors),
    }


def summarize_tool_loop(runs: list[dict]) -> None:
    for r in runs:
        if r["warmup"]:
            continue
        print(
            f"tool loop: {r['sessions']} sessions, {r['turns_ok']} turns in "
            f"{r['duration_s']:.2f}s ({r['turns_per_s']:.2f} turns/s); errors {r['errors']}",
            file=sys.stderr,
        )
        for t in r["per_turn"]:
            share = t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0
            print(
                f"  turn {t['turn'] + 1}: {t['turns']} ok, TTFT p50 {fmt(t['ttft_s']['p50'])} "
                f"p99 {fmt(t['ttft_s']['p99'])}, latency p50 {fmt(t['latency_s']['p50'])}; "
                f"prompt tokens {t['prompt_tokens']}, cached {t['cached_tokens']} "
                f"({share:.0%})",
                file=sys.stderr,
            )


async def run_once(args, send, vocab: int, seed: int, *, with_long: bool = True) -> dict:
    """One run of args.num_requests requests; with_long=False leaves the long ones out (their
    draws and arrival gaps are kept, so the short ones are the same, sent at the same times)."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(args.concurrency)
    results = []

    async def worker(req, kind: str):
        try:
            results.append({**await send(req), "kind": kind})
        finally:
            sem.release()

    tasks = []
    t0 = time.perf_counter()
    for i in range(args.num_requests):
        if args.rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.rate))
        long = rng.random() < args.long_fraction
        prompt_len = args.long_prompt_len if long else args.prompt_len
        output_len = args.long_output_len if long else args.output_len
        plen, olen = rng.randint(*prompt_len), rng.randint(*output_len)
        req = {
            "prompt": [rng.randrange(3, vocab) for _ in range(plen)],
            "max_tokens": olen,
            "temperature": args.temperature,
            "seed": rng.randrange(2**31),
        }
        if long and not with_long:
            continue
        await sem.acquire()
        tasks.append(asyncio.create_task(worker(req, "long" if long else "short")))
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
        "itl_s": percentiles([g for r in ok for g in r["itl"]]),
        "tpot_s": percentiles(tpot),
        "errors": dict(collections.Counter(r["code"] for r in results if r["code"] != "OK")),
        **({"with_long": with_long, **by_kind(ok)} if args.long_fraction else {}),
    }


def by_kind(ok: list[dict]) -> dict:
    """End-to-end latency and time to first token of the short and the long requests."""
    out = {}
    for kind in ("short", "long"):
        rs = [r for r in ok if r["kind"] == kind]
        out[kind] = {
            "requests": len(rs),
            "latency_s": percentiles([r["end"] - r["start"] for r in rs]),
            "ttft_s": percentiles([r["first"] - r["start"] for r in rs if r["first"] is not None]),
        }
    return out


async def wait_idle(stub, metadata=None, timeout: float = 30) -> pb.EngineStats:
    deadline = time.monotonic() + timeout
    while True:
        stats = (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)).stats
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def bench(args, server_pid: int | None) -> list[dict]:
    http = None
    if args.protocol == "http":
        http = SSEClient(args.host, args.http_port, auth_headers(args))
    metadata = tuple(auth_headers(args).items()) or None
    async with grpc.aio.insecure_channel(f"{args.host}:{args.port}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        if http is None:

            async def send(req):
                return await grpc_request(stub, req, args.timeout, metadata)

        else:

            async def send(req):
                return await http_request(http, req, args.timeout)

        info = await stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=600, wait_for_ready=True, metadata=metadata
        )
        vocab = min(info.vocab_size, args.max_token_id or info.vocab_size)
        await wait_serving(ch, metadata)  # it warms up first
        if http is not None:
            await wait_http_ready(f"http://{args.host}:{args.http_port}/health")
        print(
            f"{args.protocol}: model {info.model} ({info.architecture}), vocab {info.vocab_size}, "
            f"max_model_len {info.max_model_len}, pages {info.stats.pages_total}; "
            f"server RSS {rss_mib(server_pid)} MiB",
            file=sys.stderr,
        )
        runs = []
        modes = (True, False) if args.compare_without_long else (True,)
        for i in range(args.warmup + args.repeats):
            for with_long in modes:
                if args.workload == "tools":
                    result = await run_tools(args, http, args.seed + i)
                elif args.workload == "tool-loop":
                    result = await run_tool_loop(args, http, args.seed + i)
                else:
                    result = await run_once(args, send, vocab, args.seed + i, with_long=with_long)
                stats = await wait_idle(stub, metadata)
                result.update(
                    warmup=i < args.warmup,
                    pages_used_after=stats.pages_used,
                    pages_cached_after=stats.pages_cached,
                    num_preemptions_total=stats.num_preemptions,
                    server_rss_mib_after=rss_mib(server_pid),
                    compiles_total=await compiles_total(args),
                )
                runs.append(result)
                print(json.dumps(result), flush=True)
        if args.long_fraction:
            summarize(runs)
        if args.workload == "tools":
            summarize_tools(runs)
        if args.workload == "tool-loop":
            summarize_tool_loop(runs)
    if http is not None:
        await http.aclose()
    return runs


def summarize(runs: list[dict]) -> None:
    """The short requests' latency with and without the long ones, per reported run."""
    for r in runs:
        if r["warmup"]:
            continue
        short = r["short"]
        lat, ttft = short["latency_s"], short["ttft_s"]
        print(
            f"short requests {'with' if r['with_long'] else 'without'} long ones "
            f"({short['requests']} short, {r['long']['requests']} long): latency p50 "
            f"{fmt(lat['p50'])} p99 {fmt(lat['p99'])}, TTFT p50 {fmt(ttft['p50'])} p99 "
            f"{fmt(ttft['p99'])}; errors {r['errors']}",
            file=sys.stderr,
        )


def summarize_tools(runs: list[dict]) -> None:
    for r in runs:
        if r["warmup"]:
            continue
        tools, plain, mixed = r["tools"], r["plain"], r["mixed"]
        print(
            f"tool calls valid {tools['tool_calls_valid']}/{tools['tool_calls']} "
            f"({tools['tool_calls_valid_pct']:.1f}%, mixed "
            f"{mixed['tool']['tool_calls_valid']}/{mixed['tool']['tool_calls']}); "
            f"output tokens/s tools {tools['output_tokens_per_s']:.1f} vs plain "
            f"{plain['output_tokens_per_s']:.1f} ({tools['output_tokens']} and "
            f"{plain['output_tokens']} tokens); TPOT p50 tools {fmt(tools['tpot_s']['p50'])} "
            f"plain {fmt(plain['tpot_s']['p50'])}, mixed tool {fmt(mixed['tool']['tpot_s']['p50'])}"
            f" plain {fmt(mixed['plain']['tpot_s']['p50'])}; errors {r['errors']}",
            file=sys.stderr,
        )


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}s"


def auth_headers(args) -> dict[str, str]:
    key = args.api_key or os.environ.get("JPAGED_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


async def compiles_total(args) -> float | None:
    """jpaged_compiles_total from the HTTP port's /metrics (None without an HTTP API): new
    programs explain steps in RSS."""
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://{args.host}:{args.http_port}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    for line in r.text.splitlines():
        if line.startswith("jpaged_compiles_total "):
            return float(line.split()[1])
    return None


async def wait_serving(channel, metadata, timeout: float = 600) -> None:
    """Waits until gRPC health says SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    serving = health_pb2.HealthCheckResponse.SERVING
    while (await stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata)).status != serving:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is not SERVING after {timeout} s")
        await asyncio.sleep(0.2)


async def wait_http_ready(url: str, timeout: float = 600) -> None:
    """Waits until the HTTP API answers /health with 200 (it warms up first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with httpx.AsyncClient() as client:
                if (await client.get(url)).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout} s")
        await asyncio.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> subprocess.Popen:
    args.port, args.http_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--http-port",
        str(args.http_port),
        "--metrics-port",
        "off",
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
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument(
        "--workload",
        choices=("completions", "tools", "tool-loop", "agent"),
        default="completions",
        help="tools: chat with tool calls beside plain chat; tool-loop: an agent's turns "
        "(module docstring; both over HTTP); agent: multi-turn sessions, the KV host/disk "
        "tier off and on (scripts/serving_agent.py)",
    )
    p.add_argument(
        "--tool-loop",
        dest="workload",
        action="store_const",
        const="tool-loop",
        help="--workload tool-loop (implies --protocol http)",
    )
    p.add_argument("--turns", type=int, default=3, help="turns per tool-loop or agent session")
    p.add_argument("--port", type=int, default=50051, help="the server's gRPC port")
    p.add_argument(
        "--http-port", type=int, default=8000, help="the server's HTTP port (--protocol http)"
    )
    p.add_argument("--api-key", default=None, help="the server's API key (or JPAGED_API_KEY)")
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
    p.add_argument(
        "--long-fraction",
        type=float,
        default=0.0,
        help="share of long requests (mixed sizes; default 0: all drawn from the ranges above)",
    )
    p.add_argument("--long-prompt-len", type=parse_range, default=(400, 440), help="LO:HI")
    p.add_argument("--long-output-len", type=parse_range, default=(40, 60), help="LO:HI")
    p.add_argument(
        "--compare-without-long",
        action="store_true",
        help="also run each repeat without the long requests (the same short ones)",
    )
    p.add_argument("--max-token-id", type=int, default=None, help="draw prompt ids below this")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600, help="per-request deadline, s")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0, help="unreported runs first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write all runs here")
    serving_agent.add_arguments(p)
    args = p.parse_args()
    if args.workload == "agent":
        return run_agent(p, args)
    if args.workload == "tool-loop":
        args.protocol = "http"
    if args.workload == "tools" and args.protocol != "http":
        p.error("--workload tools needs --protocol http")
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


def run_agent(p, args) -> int:
    """--workload agent: launches its own servers (scripts/serving_agent.py)."""
    if args.launch is None:
        p.error("--workload agent needs --launch (it starts a server per mode)")
    runs = serving_agent.run_agent(
        args,
        launch,
        wait_http_ready,
        lambda: SSEClient(args.host, args.http_port, auth_headers(args)),
        http_stream,
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(runs, indent=2))
    return 1 if any(t["errors"] for r in runs for t in r["turns"]) else 0


if __name__ == "__main__":
    sys.exit(main())
