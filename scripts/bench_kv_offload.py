"""Multi-turn sessions whose histories outgrow the device pool: the KV host tier on and off.

--sessions S sessions x --turns K turns, interleaved (turn t of every session is sent at once;
turn t + 1 after all of them ended, each prompt the session's whole history: its earlier
prompts and replies, then --user-tokens new tokens), --output-tokens generated per turn
(greedy, EOS ignored). The device pool holds about --pool-share of the working set (every
session's final history); with the tier on the host holds all of it. Runs in process on one
LLMEngine per setting (no server), a random Llama of the demo model's shape with 4,096
positions, written once into --checkpoint-dir. Reports per turn: TTFT p50/p99, the tokens the
steps computed (prompts less their hits, recomputation after preemptions, decode steps), the
prompt tokens served from the device and from the host tier (hits of re-admitted preempted
sequences included), preemptions, and each run's generated tokens/s;
then a workload with no reuse (--sessions x --turns fresh prompts of the same lengths), on
and off, for the tier's cost where nothing hits.

    python scripts/bench_kv_offload.py --sessions 4 --turns 8 --json /tmp/kv_offload.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jpaged import SamplingParams
from jpaged.core.engine import LLMEngine
from jpaged.entrypoints.engine_args import engine_config_from_args
from models.demo import DEMO_DIMS, write_llama_checkpoint

VOCAB = 4096
PAGE_SIZE = 16


def checkpoint(root: Path) -> Path:
    path = root / "bench-kv-offload-llama"
    if not (path / "config.json").exists():
        write_llama_checkpoint(
            path, seed=0, vocab=VOCAB, **{**DEMO_DIMS, "max_position_embeddings": 4096}
        )
    return path


def make_engine(args, num_pages: int, offload_bytes: int, max_model_len: int) -> LLMEngine:
    config = engine_config_from_args(
        str(checkpoint(Path(args.checkpoint_dir))),
        page_size=PAGE_SIZE,
        num_pages=num_pages,
        max_num_seqs=args.sessions,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.batch_tokens,
        kv_offload_bytes=offload_bytes,
        precompile=True,  # every shape compiled before the timed turns
    )
    return LLMEngine(config)


def run_turns(engine: LLMEngine, prompts_by_turn, args, reuse: bool) -> dict:
    """Runs the turns; returns per-turn figures and the run's totals."""
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    history = [[] for _ in range(args.sessions)]
    turns, generated, t_run = [], 0, time.perf_counter()
    for turn in range(args.turns):
        engine.reset_stats()
        sent, first, done = {}, {}, {}
        for s in range(args.sessions):
            new = prompts_by_turn[turn][s]
            prompt = history[s] + new if reuse else new
            rid = f"{turn}.{s}"
            engine.add_request(rid, prompt, params)
            sent[rid] = (time.perf_counter(), len(prompt))
        t0 = time.perf_counter()
        computed = count_computed(engine)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = now - sent[out.request_id][0]
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        elapsed = time.perf_counter() - t0
        del engine.scheduler.schedule
        stats = engine.stats()
        for s in range(args.sessions):
            if reuse:
                history[s] = history[s] + prompts_by_turn[turn][s] + done[f"{turn}.{s}"]
        prompt_tokens = sum(n for _, n in sent.values())
        hit = stats["prefix_cache_hit_tokens"]
        host = stats["host_hit_tokens"]
        ttft = sorted(first.values())
        turns.append({
            "turn": turn + 1,
            "prompt_tokens": prompt_tokens,
            # every token the steps computed: prompts less hits, recomputation after a
            # preemption, and the decode steps (output_tokens - 1 per request)
            "computed": sum(computed),
            "preemptions": stats["num_preemptions"],
            "device_hit": hit - host,
            "host_hit": host,
            "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p99": float(np.percentile(ttft, 99)),
            "seconds": elapsed,
            "host_copy_seconds": stats["host_copy_seconds"],
            "host_copy_steps": stats["host_copy_steps"],
        })  # fmt: skip
        generated += sum(len(t) for t in done.values())
    total = time.perf_counter() - t_run
    return {"turns": turns, "seconds": total, "tokens_per_s": generated / total}


def count_computed(engine: LLMEngine) -> list[int]:
    """A list that gains each plan's token count (until engine.scheduler.schedule is
    deleted again)."""
    counts = []
    schedule = engine.scheduler.schedule

    def counting(*a, **kw):
        plan = schedule(*a, **kw)
        counts.append(plan.num_tokens)
        return plan

    engine.scheduler.schedule = counting
    return counts


def workload(args) -> list[list[list[int]]]:
    rng = np.random.default_rng(args.seed)
    return [
        [rng.integers(3, VOCAB, args.user_tokens).tolist() for _ in range(args.sessions)]
        for _ in range(args.turns)
    ]


def report(name: str, r: dict) -> None:
    print(f"\n{name}: {r['seconds']:.1f} s, {r['tokens_per_s']:.1f} generated tokens/s")
    print("turn  prompt  computed  device-hit  host-hit  preempt  ttft-p50  ttft-p99  load-s/step")
    for t in r["turns"]:
        per_step = t["host_copy_seconds"] / max(t["host_copy_steps"], 1)
        print(
            f"{t['turn']:>4}  {t['prompt_tokens']:>6}  {t['computed']:>8}  {t['device_hit']:>10}"
            f"  {t['host_hit']:>8}  {t['preemptions']:>7}  {t['ttft_p50']:>8.3f}  {t['ttft_p99']:>8.3f}  {per_step:>11.4f}"
        )


def add_workload_arguments(p) -> None:
    """The sessions' lengths and pool (shared with trace_agent_ttft.py)."""
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--pool-share", type=float, default=0.25, help="device pool / working set")
    p.add_argument("--batch-tokens", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--checkpoint-dir", default="/tmp/jpaged-bench")
    p.add_argument("--seed", type=int, default=0)


def sizes(args) -> dict:
    """History tokens, working-set pages, max_model_len, the device pool's pages (a quarter
    of the working set by default, at least one whole history: the last turn must fit) and
    the host tier's bytes (twice the working set)."""
    history = args.turns * (args.user_tokens + args.output_tokens)
    working_pages = args.sessions * -(-history // PAGE_SIZE)
    max_model_len = -(-history // PAGE_SIZE) * PAGE_SIZE
    num_pages = max(int(working_pages * args.pool_share), max_model_len // PAGE_SIZE) + 1
    d = DEMO_DIMS  # float32 K and V of every layer
    page_bytes = 2 * d["layers"] * d["kv_heads"] * (d["hidden"] // d["heads"]) * 4 * PAGE_SIZE
    return {"history": history, "working_pages": working_pages, "max_model_len": max_model_len,
            "num_pages": num_pages, "offload": (2 * working_pages + 2) * page_bytes}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(p)
    p.add_argument("--skip-no-reuse", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    z = sizes(args)
    history, working_pages, max_model_len = z["history"], z["working_pages"], z["max_model_len"]
    num_pages, offload = z["num_pages"], z["offload"]
    print(
        f"{args.sessions} sessions x {args.turns} turns, histories up to {history} tokens; "
        f"device pool {num_pages - 1} pages of {PAGE_SIZE} ({working_pages} in the working "
        f"set), host tier {offload >> 20} MiB"
    )
    prompts = workload(args)
    result = {"args": vars(args), "num_pages": num_pages, "offload_bytes": offload}
    runs = [("sessions, tier off", 0, True), ("sessions, tier on", offload, True)]
    if not args.skip_no_reuse:
        runs += [("no reuse, tier off", 0, False), ("no reuse, tier on", offload, False)]
    for name, offload_bytes, reuse in runs:
        engine = make_engine(args, num_pages, offload_bytes, max_model_len)
        result[name] = run_turns(engine, prompts, args, reuse)
        report(name, result[name])
        del engine
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
