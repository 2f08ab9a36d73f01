"""vLLM's side of scripts/bench_throughput.py (--vllm-python), run in vLLM's own venv.

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 LD_PRELOAD="..." \
    /path/to/vllm-venv/bin/python scripts/bench_vllm_worker.py --model HF_DIR \
        --dtype float32 --workload-file W.json --max-num-seqs 32 [--enable-prefix-caching] \
        [--result-file PARTIAL.json]

bench_throughput.py sets that environment (docs/benchmarks.md, "vLLM's CPU build": how it
was installed and why each variable). The engine is built (`startup_s`: load and compile),
then runs the workload once with other tokens of the same shapes (as jpaged's warm-up), then
the timed run: greedy, EOS ignored, each request's own max_tokens, prompts as token ids.
Prints one JSON line last: output tokens/s, seconds, the generated tokens' digests in request
order (bench_throughput.token_digests: engines that made the same tokens have the same ones)
and vLLM's version. Imports neither jax nor jpaged. vLLM spawns its engine processes, so
everything runs under `if __name__ == "__main__"`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path


def digests(outputs: list[list[int]]) -> list[str]:
    return [hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12] for ids in outputs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload-file", required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()

    import vllm
    from vllm.inputs import TokensPrompt

    wl = json.loads(Path(args.workload_file).read_text())
    prompts, olens = wl["prompts"], wl["output_lens"]
    result = {"vllm": vllm.__version__}

    def save() -> None:
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(result))

    t0 = time.perf_counter()
    longest = max(len(q) + n for q, n in zip(prompts, olens))
    llm = vllm.LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(longest, 256),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=0,
    )
    result["startup_s"] = time.perf_counter() - t0
    save()
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in olens]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]

    def run(ids_lists) -> tuple[list[list[int]], float]:
        t = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=q) for q in ids_lists], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t

    # bench_throughput.shifted: the same shapes with other tokens, so the timed run reuses
    # nothing of the warm-up but its compiled kernels
    shifted = [[(t + 7919) % (vocab - 3) + 3 for t in q] for q in prompts]
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


if __name__ == "__main__":
    main()
