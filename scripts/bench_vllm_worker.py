"""vLLM's side of scripts/bench_throughput.py (--vllm-python), run in vLLM's own venv.

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 LD_PRELOAD="..." \
    /path/to/vllm-venv/bin/python scripts/bench_vllm_worker.py --model HF_DIR \
        --dtype float32 --workload-file W.json --max-num-seqs 32 [--enable-prefix-caching] \
        [--result-file PARTIAL.json] [--lora-dirs DIR ... [--lora-rounds 3]]

bench_throughput.py sets that environment (docs/benchmarks.md, "vLLM's CPU build": how it
was installed and why each variable). The engine is built (`startup_s`: load and compile),
then runs the workload once with other tokens of the same shapes (as jpaged's warm-up), then
the timed run: greedy, EOS ignored, each request's own max_tokens, prompts as token ids.
Prints one JSON line last: output tokens/s, seconds, the generated tokens' digests in request
order (bench_throughput.token_digests: engines that made the same tokens have the same ones)
and vLLM's version. Imports neither jax nor jpaged. vLLM spawns its engine processes, so
everything runs under `if __name__ == "__main__"`.

With --lora-dirs (scripts/bench_lora.py, issue 55): one engine with LoRA on (max_loras and
max_cpu_loras the number of adapters, max_lora_rank 16), the workload on the base model
and on 1, 4 and 16 (<= N) of the PEFT adapters round-robin, each warmed up on other tokens,
then all in turn --lora-rounds times; `lora_rows` {config: {"tok_s", "runs_s"}} (medians),
or `lora_error`: the exception vLLM raised.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path


def digests(outputs: list[list[int]]) -> list[str]:
    return [hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12] for ids in outputs]


def make_llm(vllm, args, longest: int, lora_kwargs: dict):
    return vllm.LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(longest, 256),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=0,
        **lora_kwargs,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload-file", required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--result-file", default=None)
    p.add_argument("--lora-dirs", nargs="*", default=None, help="PEFT adapter directories")
    p.add_argument("--lora-rounds", type=int, default=3)
    args = p.parse_args()

    import vllm
    from vllm.inputs import TokensPrompt

    wl = json.loads(Path(args.workload_file).read_text())
    prompts, olens = wl["prompts"], wl["output_lens"]
    result = {"vllm": vllm.__version__}

    def save() -> None:
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(result))

    lora_kwargs = {}
    if args.lora_dirs:
        n = len(args.lora_dirs)
        lora_kwargs = {"enable_lora": True, "max_loras": n, "max_lora_rank": 16, "max_cpu_loras": n}
    t0 = time.perf_counter()
    longest = max(len(q) + n for q, n in zip(prompts, olens))
    try:
        llm = make_llm(vllm, args, longest, lora_kwargs)
    except Exception as e:  # recorded: whether vLLM's CPU build runs LoRA
        if not lora_kwargs:
            raise
        result["lora_error"] = f"{type(e).__name__}: {e}"
        save()
        print(json.dumps(result))
        return
    result["startup_s"] = time.perf_counter() - t0
    save()
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in olens]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]

    def run(ids_lists, loras=None) -> tuple[list[list[int]], float]:
        t = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=q) for q in ids_lists], params, use_tqdm=False,
            lora_request=loras,
        )
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t

    # bench_throughput.shifted: the same shapes with other tokens, so the timed run reuses
    # nothing of the warm-up but its compiled kernels
    shifted = [[(t + 7919) % (vocab - 3) + 3 for t in q] for q in prompts]
    if args.lora_dirs:
        result.update(run_lora(args, run, prompts, shifted))
        save()
        print(json.dumps(result))
        return
    _, result["warmup_s"] = run(shifted)
    save()
    made, dt = run(prompts)
    n_out = sum(len(m) for m in made)
    result.update(
        tokens_per_s=n_out / dt,
        seconds=dt,
        output_tokens=n_out,
        expected_output_tokens=sum(olens),
        token_digests=digests(made),
    )
    save()
    print(json.dumps(result))


def run_lora(args, run, prompts, shifted) -> dict:
    """The base model and 1, 4, 16 adapters on one LoRA engine (the module docstring)."""
    import statistics

    from vllm.lora.request import LoRARequest

    requests = [LoRARequest(f"bench{i}", i + 1, d) for i, d in enumerate(args.lora_dirs)]
    configs = {"base (LoRA on, no adapter)": None}
    for k in (1, 4, 16):
        if k <= len(requests):
            name = f"{k} adapter{'s' if k > 1 else ''} (rank 16)"
            configs[name] = [requests[i % k] for i in range(len(prompts))]
    try:
        for loras in configs.values():
            run(shifted, loras)
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.lora_rounds):
            for name, loras in configs.items():
                made, seconds = run(prompts, loras)
                times[name].append(seconds)
                n_out = sum(len(m) for m in made)
                print(f"vLLM {name:<28} {n_out / seconds:9.1f} tok/s ({seconds:.2f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - recorded: whether vLLM's CPU build runs LoRA
        return {"lora_error": f"{type(e).__name__}: {e}"}
    rows = {}
    for name, ts in times.items():
        seconds = statistics.median(ts)
        rows[name] = {"tok_s": round(n_out / seconds, 1), "runs_s": [round(t, 2) for t in ts]}
    ref = rows["base (LoRA on, no adapter)"]["tok_s"]
    for row in rows.values():
        row["ratio"] = round(row["tok_s"] / ref, 3)
    return {"lora_rows": rows}


if __name__ == "__main__":
    main()
