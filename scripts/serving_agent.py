"""bench_serving.py's multi-turn agent workload (--workload agent): sessions whose histories
outgrow the device pool, against servers it launches with the KV host/disk tier off and on.

--sessions N sessions x --turns K turns, interleaved: turn t of every session is sent at once
(streamed /v1/completions with token-id prompts, `user` = the session's key), turn t + 1 after
all of them ended. A turn's prompt is the session's whole history (its earlier prompts and
replies, as token ids) then --user-tokens new random tokens; --output-tokens are generated
(greedy, EOS ignored), so histories grow to K x (user + output) tokens; --first-tokens makes
the first turn longer (a long first message: ~4,000-token histories in 6-8 turns). The server's device
pool holds --pool-share of the working set (every session's final history; at least one
whole history). Modes, each a fresh server from the same --launch arguments:

- off: no host tier (the baseline);
- host: --kv-offload-bytes twice the working set's KV bytes (everything fits in host memory);
- disk: a host tier the size of the device pool (at least one whole history: an admission
  reads back from disk at most as many pages as the host tier has unheld) and
  --kv-offload-dir, so the rest spills to disk; then the server is stopped and started again on the same directory (a warm
  restart) and every session's last turn is sent again: its history's pages that reached
  the disk are read back instead of computed.

Per turn: TTFT p50/p99 (over the sessions), prompt tokens, prompt tokens computed (prompt less
the hits the requests were admitted with, usage.cached_tokens), prompt tokens cached per tier
(the server's /metrics counters before and after the turn: device = prefix hits less host
hits, host = host hits, pages read back from disk into host memory among them; hits of
re-admitted preempted sequences included), the tokens of the pages read from disk (a page is
read back whenever a lookup misses in host memory, also for an admission that then waits, so
reads can exceed the hits they served), preemptions, the turn's seconds; per mode
generated tokens/s over all turns. The KV bytes per token come from the "off" server's
/metrics (jpaged_kv_bytes_per_token), so "off" is always run first.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import tempfile
import time

import httpx
import numpy as np

PAGE_SIZE = 16
MODES = ("off", "host", "disk")


def add_arguments(p) -> None:
    g = p.add_argument_group("agent workload (--workload agent; needs --launch)")
    g.add_argument("--sessions", type=int, default=4)
    g.add_argument("--user-tokens", type=int, default=200, help="new prompt tokens per turn")
    g.add_argument(
        "--first-tokens", type=int, default=None,
        help="the first turn's new tokens (a long first message or system prompt: histories "
        "reach ~4,000 tokens in fewer turns, so fewer decode steps); default --user-tokens",
    )  # fmt: skip
    g.add_argument("--output-tokens", type=int, default=100, help="generated tokens per turn")
    g.add_argument("--pool-share", type=float, default=0.25, help="device pool / working set")
    g.add_argument(
        "--agent-modes", default=",".join(MODES), help="comma-separated, of off,host,disk"
    )


def plan(args) -> dict:
    """The pool and lengths the modes share."""
    history = first_tokens(args) + (args.turns - 1) * args.user_tokens
    history += args.turns * args.output_tokens
    history_pages = -(-history // PAGE_SIZE)
    working_pages = args.sessions * history_pages
    return {
        "history_tokens": history,
        "working_pages": working_pages,
        "max_model_len": history_pages * PAGE_SIZE,
        # at least one whole history: the last turn must fit
        "num_pages": max(int(working_pages * args.pool_share), history_pages) + 1,
    }


def first_tokens(args) -> int:
    return args.user_tokens if args.first_tokens is None else args.first_tokens


def read_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> value (summed over labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def metrics(args) -> dict[str, float]:
    """The server's /metrics once it is idle (the engine's stats are copied in after steps)."""
    async with httpx.AsyncClient() as client:
        for _ in range(100):
            r = await client.get(f"http://{args.host}:{args.http_port}/metrics", timeout=30)
            m = read_metrics(r.text)
            if not m.get("jpaged_num_requests_running") and not m.get(
                "jpaged_num_requests_waiting"
            ):
                return m
            await asyncio.sleep(0.05)
    return m


def tier_hits(before: dict, after: dict) -> dict[str, int]:
    d = lambda name: int(after.get(name, 0) - before.get(name, 0))
    hit = d("jpaged_prefix_cache_hit_tokens_total")
    host = d("jpaged_kv_host_hit_tokens_total")
    disk = d("jpaged_kv_disk_hit_pages_total") * PAGE_SIZE
    return {
        "device_hit": hit - host,
        "host_hit": host,
        "disk_read": disk,
        "preemptions": d("jpaged_preemptions_total"),
    }


def prompts(args) -> list[list[list[int]]]:
    """[turn][session] -> the turn's new user tokens."""
    rng = random.Random(args.seed)
    vocab = args.max_token_id or 49152
    lengths = [first_tokens(args)] + [args.user_tokens] * (args.turns - 1)
    return [
        [[rng.randrange(3, vocab) for _ in range(n)] for _ in range(args.sessions)] for n in lengths
    ]


async def one_turn(args, client, stream, bodies: list[dict]) -> dict:
    """Sends every session's turn at once; returns the turn's figures and replies."""
    before = await metrics(args)
    replies: list[list[int]] = [[] for _ in bodies]

    async def send(i: int, body: dict) -> dict:
        def read(choice: dict) -> None:
            replies[i].extend(choice.get("token_ids") or ())

        return await stream(client, "/v1/completions", body, args.timeout, read)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(send(i, b) for i, b in enumerate(bodies)))
    seconds = time.perf_counter() - t0
    after = await metrics(args)
    ok = [r for r in results if r["code"] == "OK"]
    ttft = [r["first"] - r["start"] for r in ok if r["first"] is not None]
    pick = lambda q: float(np.percentile(ttft, q)) if ttft else None
    prompt = sum(len(b["prompt"]) for b in bodies)
    cached = sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in ok)
    return {
        "prompt_tokens": prompt,
        "computed": prompt - cached,
        **tier_hits(before, after),
        "ttft_p50": pick(50),
        "ttft_p99": pick(99),
        "seconds": seconds,
        "generated": sum(len(r) for r in replies),
        "errors": [r["code"] for r in results if r["code"] != "OK"],
        "replies": replies,
    }


def body(args, session: int, prompt: list[int]) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": args.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "user": f"agent-session-{session}",
    }


async def run_sessions(args, client, stream, new_tokens, *, replay_last: bool = False) -> dict:
    """The K turns (or, replay_last, only the last turn's prompts of a run already made:
    args.histories), each session's history growing by its prompt and reply."""
    histories = [[] for _ in range(args.sessions)]
    turns, t_run = [], time.perf_counter()
    for t in range(args.turns):
        sent = [histories[s] + new_tokens[t][s] for s in range(args.sessions)]
        if replay_last and t < args.turns - 1:
            histories = [p + args.replies[t][s] for s, p in enumerate(sent)]
            continue
        r = await one_turn(args, client, stream, [body(args, s, p) for s, p in enumerate(sent)])
        if not replay_last:
            args.replies.append(r["replies"])
        histories = [p + reply for p, reply in zip(sent, r.pop("replies"))]
        turns.append({"turn": t + 1, **r})
        print(f"  turn {t + 1}: {json.dumps(turns[-1])}", flush=True)
    seconds = time.perf_counter() - t_run
    generated = sum(t["generated"] for t in turns)
    return {"turns": turns, "seconds": seconds, "tokens_per_s": generated / seconds}


def serve_flags(args, p: dict, mode: str, kv_bytes_per_token: float | None, directory) -> str:
    flags = (
        f" --page-size {PAGE_SIZE} --num-pages {p['num_pages']} --max-model-len "
        f"{p['max_model_len']} --max-num-seqs {args.sessions}"
    )
    if mode == "off":
        return flags
    working_bytes = int(p["working_pages"] * PAGE_SIZE * kv_bytes_per_token)
    pool_bytes = int((p["num_pages"] + 1) * PAGE_SIZE * kv_bytes_per_token)
    if mode == "host":
        return flags + f" --kv-offload-bytes {2 * working_bytes}"
    return flags + (
        f" --kv-offload-bytes {pool_bytes} --kv-offload-dir "
        f"{directory} --kv-offload-dir-bytes {4 * working_bytes}"
    )


def run_agent(args, launch, wait_ready, sse_client, stream) -> list[dict]:
    """Every mode against its own server (module docstring); returns the runs."""
    modes = args.agent_modes.split(",")
    if modes[0] != "off" or not set(modes) <= set(MODES):
        raise SystemExit(f"--agent-modes must start with off and name only {MODES}: {modes}")
    p = plan(args)
    print(
        f"agent: {args.sessions} sessions x {args.turns} turns, histories up to "
        f"{p['history_tokens']} tokens; device pool {p['num_pages'] - 1} pages of {PAGE_SIZE} "
        f"({p['working_pages']} in the working set)",
        flush=True,
    )
    new_tokens = prompts(args)
    base_launch, kv_bytes, runs = args.launch, None, []
    directory = tempfile.mkdtemp(prefix="jpaged-agent-disk-")
    args.replies = []  # [turn][session] -> reply ids of the first run: replays send the same
    for mode in modes:
        phases = [mode] if mode != "disk" else ["disk", "disk, warm restart"]
        for phase in phases:
            args.launch = base_launch + serve_flags(args, p, mode, kv_bytes, directory)
            proc = launch(args)
            try:
                result = asyncio.run(
                    _run_phase(args, wait_ready, sse_client, stream, new_tokens, phase)
                )
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            kv_bytes = kv_bytes or result.pop("kv_bytes_per_token")
            result.pop("kv_bytes_per_token", None)
            runs.append({"mode": phase, **p, **result})
            report(runs[-1])
    args.launch = base_launch
    return runs


async def _run_phase(args, wait_ready, sse_client, stream, new_tokens, phase: str) -> dict:
    await wait_ready(f"http://{args.host}:{args.http_port}/health")
    client = sse_client()
    try:
        result = await run_sessions(
            args, client, stream, new_tokens, replay_last=phase.endswith("restart")
        )
    finally:
        await client.aclose()
    m = await metrics(args)
    return {**result, "kv_bytes_per_token": m.get("jpaged_kv_bytes_per_token")}


def report(run: dict) -> None:
    print(f"\n{run['mode']}: {run['seconds']:.1f} s, {run['tokens_per_s']:.1f} generated tokens/s")
    print("turn  prompt  computed  device  host  disk-read  preempt  ttft-p50  ttft-p99")
    for t in run["turns"]:
        print(
            f"{t['turn']:>4}  {t['prompt_tokens']:>6}  {t['computed']:>8}  {t['device_hit']:>6}"
            f"  {t['host_hit']:>4}  {t['disk_read']:>9}  {t['preemptions']:>7}"
            f"  {t['ttft_p50']:>8.3f}  {t['ttft_p99']:>8.3f}  errors {t['errors'] or '-'}",
            flush=True,
        )
