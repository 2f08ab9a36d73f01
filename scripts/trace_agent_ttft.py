"""Where a multi-turn session's TTFT goes (issue 54): bench_kv_offload.py's sessions, in
process, with every plan logged (its rows: which request, prompt or decode tokens; its host
copies; the time to the next plan), and per request of each turn: the steps and seconds
before its first row (queued: other requests' decode steps and prompt tokens), then its own
prompt steps, their tokens and host -> device / device -> host page copies.

    python scripts/trace_agent_ttft.py --sessions 2 --turns 5 --mode host
    python scripts/trace_agent_ttft.py --sessions 2 --turns 5 --mode off

Same lengths and pool as bench_kv_offload.py (--pool-share of the working set; the host tier
twice the working set).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_kv_offload as bench

from jpaged import SamplingParams


def traced(engine, log: list) -> None:
    """engine.scheduler.schedule appends each plan's rows, copies and time to log."""
    sched = engine.scheduler
    schedule = sched.schedule

    def tracing(*a, **kw):
        plan = schedule(*a, **kw)
        rows = []
        for seq_id, n in zip(plan.seq_ids.tolist(), plan.num_new_tokens.tolist()):
            seq = sched.sequence(seq_id)
            rows.append((seq.group.request_id if seq else "?", n))
        log.append({"t": time.perf_counter(), "rows": rows, "in": len(plan.swap_in),
                    "out": len(plan.swap_out)})  # fmt: skip
        return plan

    sched.schedule = tracing


def report(rid: str, sent: float, first: float, log: list) -> str:
    steps = [e for e in log if e["t"] < first]
    queued = [e for e in steps if all(r != rid for r, _ in e["rows"])]
    own = [e for e in steps if any(r == rid and n > 1 for r, n in e["rows"])]
    decodes = sum(1 for e in queued if any(n == 1 for _, n in e["rows"]))
    prompts = sum(n for e in queued for _, n in e["rows"] if n > 1)
    tokens = sum(n for e in own for r, n in e["rows"] if r == rid)
    return (
        f"  {rid}: TTFT {first - sent:.2f} s; queued {len(queued)} steps "
        f"{sum(e['dt'] for e in queued):.2f} s (others' decode steps {decodes}, prompt tokens "
        f"{prompts}); own prompt {len(own)} steps {sum(e['dt'] for e in own):.2f} s, {tokens} "
        f"tokens, pages in {sum(e['in'] for e in own)} out {sum(e['out'] for e in own)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_workload_arguments(p)
    p.set_defaults(sessions=2, turns=5)
    p.add_argument("--mode", choices=("off", "host"), default="host")
    args = p.parse_args()
    z = bench.sizes(args)
    num_pages, working = z["num_pages"], z["working_pages"]
    offload = 0 if args.mode == "off" else z["offload"]
    engine = bench.make_engine(args, num_pages, offload, z["max_model_len"])
    prompts = bench.workload(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    histories = [[] for _ in range(args.sessions)]
    log: list = []
    traced(engine, log)
    print(f"pool {num_pages - 1} pages, working set {working}, mode {args.mode}")
    for turn in range(args.turns):
        log.clear()
        sent, first, done = {}, {}, {}
        preempted = engine.scheduler.num_preemptions
        for s in range(args.sessions):
            rid = f"{turn + 1}.{s}"
            engine.add_request(rid, histories[s] + prompts[turn][s], params)
            sent[rid] = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        end = time.perf_counter()
        for i, e in enumerate(log):
            e["dt"] = (log[i + 1]["t"] if i + 1 < len(log) else end) - e["t"]
        for s in range(args.sessions):
            histories[s] += prompts[turn][s] + done[f"{turn + 1}.{s}"]
        print(f"turn {turn + 1}: {end - min(sent.values()):.2f} s, preemptions "
              f"{engine.scheduler.num_preemptions - preempted}")  # fmt: skip
        for rid, t_sent in sent.items():
            print(report(rid, t_sent, first[rid], log))


if __name__ == "__main__":
    main()
