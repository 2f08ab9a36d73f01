"""Multi-LoRA throughput (issue 55), run by `scripts/bench_throughput.py --lora N`:

    python scripts/bench_throughput.py --lora 16 --preset cpu-small --num-requests 32 \
        --prompt-len 128 --output-len 64 --skip-transformers --skip-startup

One workload (greedy, EOS ignored, all requests submitted at once) run on
  - the base model in an engine without LoRA (the reference),
  - the base model in an engine with LoRA on (max_loras = N slots of rank 16, none used),
  - 1, 4 and 16 distinct rank-16 adapters on all seven projections (those <= N), requests
    assigned round-robin, every adapter resident (max_loras = N),
each after a warm-up run of the same shapes with other tokens, then in turn three times
(medians kept); output tokens/s and the ratio to the reference, in the same process. The adapters are random, written in PEFT's
format next to the checkpoint. --lora-dtype sets the LoRA engine's slots (bfloat16: half
the bytes); a list (auto,bfloat16) adds an engine per further dtype, run on the N adapters.
Each run's CPU time (the process's, all threads) is kept beside its wall time: on a shared
machine it moves less with the other load. With --vllm-python, vLLM's CPU build runs the same adapters afterwards
(run_vllm_lora; its ratios are to its own base with LoRA on, one engine: a second vLLM
start-up costs minutes of CPU compile).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

RANK = 16


def write_adapters(model: str, root: Path, n: int, rank: int = RANK) -> list[Path]:
    """n random PEFT adapters of rank `rank` on every projection of the checkpoint at model."""
    from jpaged.lora.random_adapter import write_random_adapter

    paths = []
    for i in range(n):
        path = root / f"lora-r{rank}-{i}"
        paths.append(path)
        if not (path / "adapter_config.json").exists():
            write_random_adapter(path, model, rank=rank, seed=1000 + i, std=0.02)
    return paths


def _timed(llm, prompts, output_lens, loras) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds: every thread's, steadier than the wall
    clock on a shared machine, output tokens) of one run."""
    from jpaged import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, lora_request=loras)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return seconds, cpu, sum(len(o.outputs[0].token_ids) for o in outs)


def run_lora(model: str, prompts, output_lens, n: int, engine_kwargs: dict, vocab: int,
             rounds: int = 3, lora_dtypes: tuple[str, ...] = ("auto",)) -> dict:
    """The table's rows {config: {"tok_s", "ratio", "seconds", "cpu_s", "cpu_ratio",
    "compiles"}} (see the module docstring): the LoRA engine's slots in lora_dtypes[0]; each
    further dtype another engine, on the N adapters only. The engines stay up and the configurations run in turn, `rounds` times,
    each one's median kept, so a load that comes and goes on a shared machine hits them
    alike."""
    from jpaged import LLM, LoRARequest

    root = (Path(model) if Path(model).is_dir() else Path(model).parent) / "bench-lora-adapters"
    t0 = time.perf_counter()
    paths = write_adapters(model, root, n)
    write_s = time.perf_counter() - t0
    shifted = [[(t + 7919) % (vocab - 3) + 3 for t in p] for p in prompts]
    # the rounds repeat the prompts: no prefix cache, so each computes the same work
    engine_kwargs = {**engine_kwargs, "enable_prefix_caching": False}
    plain = LLM(model, **engine_kwargs)
    llm, *others = [LLM(model, enable_lora=True, max_loras=n, max_lora_rank=RANK,
                        max_cpu_loras=n, **({"lora_dtype": d} if d != "auto" else {}),
                        **engine_kwargs) for d in lora_dtypes]  # auto: also older jpaged
    requests = [LoRARequest(f"bench{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    t0 = time.perf_counter()
    llm.add_lora(requests[0])
    load_s = time.perf_counter() - t0
    configs = {"base (LoRA off)": (plain, None), "base (LoRA on, no adapter)": (llm, None)}
    for k in (1, 4, 16):
        if k <= n:
            loras = [requests[i % k] for i in range(len(prompts))]
            configs[f"{k} adapter{'s' if k > 1 else ''} (rank {RANK})"] = (llm, loras)
    for dtype, engine in zip(lora_dtypes[1:], others, strict=True):
        configs[f"{n} adapters, {dtype} slots"] = (engine, [requests[i % n] for i in
                                                            range(len(prompts))])  # fmt: skip
    for engine, loras in configs.values():  # warm-up: the same shapes, other tokens
        _timed(engine, shifted, output_lens, loras)
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpus: dict[str, list[float]] = {name: [] for name in configs}
    compiles = {name: 0 for name in configs}
    for _ in range(rounds):
        for name, (engine, loras) in configs.items():
            before = engine.stats()["num_compiles"]
            seconds, cpu, tokens = _timed(engine, prompts, output_lens, loras)
            compiles[name] += engine.stats()["num_compiles"] - before  # should stay 0
            times[name].append(seconds)
            cpus[name].append(cpu)
            print(f"{name:<28} {tokens / seconds:9.1f} tok/s  ({seconds:.2f} s, CPU {cpu:.2f} s)",
                  flush=True)  # fmt: skip
    rows = {}
    for name, ts in times.items():
        seconds = float(np.median(ts))
        rows[name] = {"seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
                      "cpu_s": round(float(np.median(cpus[name])), 3),
                      "compiles": compiles[name], "runs_s": [round(t, 2) for t in ts],
                      "runs_cpu_s": [round(t, 2) for t in cpus[name]]}  # fmt: skip
    ref, ref_cpu = rows["base (LoRA off)"]["tok_s"], rows["base (LoRA off)"]["cpu_s"]
    for row in rows.values():
        row["ratio"] = round(row["tok_s"] / ref, 3)
        row["cpu_ratio"] = round(ref_cpu / row["cpu_s"], 3)  # base CPU s / this CPU s
    print(f"adapter read + check (rank {RANK}, host): {load_s:.3f} s; writing {n}: {write_s:.1f} s")
    for name, row in rows.items():
        print(f"  {name:<28} {row['tok_s']:8.1f} tok/s (median of {rounds})  {row['ratio']:.3f}x"
              f"  by CPU time {row['cpu_ratio']:.3f}x")  # fmt: skip
    return {"rows": rows, "adapter_load_s": round(load_s, 3), "max_loras": n, "rank": RANK,
            "rounds": rounds, "lora_dtypes": list(lora_dtypes),
            "adapter_dirs": [str(p) for p in paths]}  # fmt: skip


def run_vllm_lora(command: list[str], adapter_dirs: list[str], result_file: Path) -> dict:
    """vLLM's CPU build on the same PEFT adapters (scripts/bench_vllm_worker.py --lora-dirs:
    the base and 1, 4, 16 adapters on one engine with LoRA on, one round: its LoRA runs take
    minutes each on a 2-core CPU), its result: `lora_rows`
    with their ratios to its own base, or `lora_error`, vLLM's exception."""
    import json
    import subprocess

    proc = subprocess.run([*command, "--lora-dirs", *adapter_dirs, "--lora-rounds", "1"],
                          capture_output=True,
                          text=True, check=False)  # fmt: skip
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    if proc.returncode and "lora_error" not in result:
        result["lora_error"] = f"exit {proc.returncode}: " + proc.stderr.strip()[-400:]
    for name, row in result.get("lora_rows", {}).items():
        print(f"  vLLM {name:<28} {row['tok_s']:8.1f} tok/s  {row['ratio']:.3f}x its base")
    if "lora_error" in result:
        print(f"  vLLM LoRA: {result['lora_error']}")
    return result
