"""Throughput: jpaged against transformers on the same checkpoint and prompts, in one run.

    python scripts/bench_throughput.py                      # CPU preset: hidden 256, 4 layers
    python scripts/bench_throughput.py --num-requests 64 --prompt-len 128 --output-len 64
    python scripts/bench_throughput.py --preset cpu-tp --tensor-parallel-size 4 \
        --simulate-cpu-devices 8 --skip-transformers       # sharded, on simulated CPU devices

Greedy, fixed output length (EOS ignored). Prints output tokens/s of jpaged, of transformers'
padded generate and of generate_batch (continuous batching) where this transformers has it,
the ratio to transformers' best, the number of compiled programs and the warm-up time.
transformers runs in a subprocess so that torch and jax do not compete for threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

PRESETS = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "cpu-small": (256, 4, 4, 2, 688, 4096),
    "cpu-tp": (256, 4, 8, 4, 1024, 4096),  # divisible by tensor_parallel_size up to 8
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256),
}


def make_checkpoint(path: Path, preset: str, dtype: str) -> None:
    """Random weights in the Hugging Face layout, written with transformers (same file for both)."""
    import torch
    import transformers

    hidden, layers, heads, kv, inter, vocab = PRESETS[preset]
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=preset == "llama-3.2-1b",
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path)


def run_transformers(args) -> None:
    """Subprocess body: times padded generate and generate_batch; prints one JSON line."""
    import torch
    import transformers

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype).to(device)
    model.eval()
    prompts = json.loads(Path(args.prompts).read_text())
    result = {}
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    gen_kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
    with torch.no_grad():
        model.generate(ids[:2, :8], max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kwargs)
        dt = time.perf_counter() - t0
    result["padded_generate"] = (out.shape[0] * (out.shape[1] - ids.shape[1])) / dt
    if hasattr(model, "generate_batch"):
        gen_cfg = transformers.GenerationConfig(
            max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
            eos_token_id=-1,
        )
        try:
            with torch.no_grad():
                model.generate_batch(inputs=[p[:8] for p in prompts[:2]], generation_config=gen_cfg)
                t0 = time.perf_counter()
                outs = model.generate_batch(inputs=prompts, generation_config=gen_cfg)
                dt = time.perf_counter() - t0
            n = sum(len(o.generated_tokens) for o in outs.values())
            result["generate_batch"] = n / dt
        except Exception as e:  # report, do not hide: the table says why it is missing
            result["generate_batch_error"] = f"{type(e).__name__}: {e}"[:200]
    print(json.dumps(result))


def run_jpaged(args, prompts) -> dict:
    from jpaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        precompile=args.precompile,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up: the same shapes with other tokens (so the prefix cache cannot help the timed run).
    t0 = time.perf_counter()
    llm.generate([[(t + 1) % 3 + 3 for t in p] for p in prompts], params)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    return dict(
        tokens_per_s=n / dt,
        seconds=dt,
        output_tokens=n,
        startup_s=startup,
        warmup_s=warmup + llm.llm_engine.warmup_seconds,
        compile_s=llm.llm_engine.runner.compile_seconds,
        num_compiled=stats["num_compiled"],
        num_buckets=stats["num_buckets"],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    p.add_argument("--model", default=None, help="existing HF checkpoint (default: made from --preset)")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--precompile", action="store_true", help="compile every bucket at start-up")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument(
        "--simulate-cpu-devices",
        type=int,
        default=None,
        help="split the CPU into N XLA devices (set before JAX starts; for sharding runs)",
    )
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--transformers-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.transformers_worker:
        run_transformers(args)
        return
    if args.simulate_cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.simulate_cpu_devices}"
        )
    import jax

    if args.dtype is None:
        args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    tmp = Path(tempfile.mkdtemp(prefix="jpaged-bench-"))
    if args.model is None:
        args.model = str(tmp / "model")
        make_checkpoint(Path(args.model), args.preset, args.dtype)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, vocab, (args.num_requests, args.prompt_len)).tolist()
    prompts_file = tmp / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))

    ours = run_jpaged(args, prompts)
    theirs = {}
    if not args.skip_transformers:
        cmd = [
            sys.executable, __file__, "--transformers-worker", "--model", args.model,
            "--prompts", str(prompts_file), "--output-len", str(args.output_len),
            "--dtype", args.dtype,
        ]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
        else:
            theirs = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"hardware: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"workload: {args.num_requests} requests x {args.prompt_len} prompt x {args.output_len} "
          f"new tokens, greedy, preset {args.preset}, {args.dtype}")
    print(f"{'engine':<34}{'output tokens/s':>16}")
    print(f"{'jpaged':<34}{ours['tokens_per_s']:>16.1f}")
    num_devices = args.tensor_parallel_size * args.data_parallel_size
    print(
        f"{'jpaged per device':<34}{ours['tokens_per_s'] / num_devices:>16.1f}"
        f"   (T={args.tensor_parallel_size} x D={args.data_parallel_size} devices)"
    )
    for name in ("padded_generate", "generate_batch"):
        if name in theirs:
            print(f"{'transformers ' + name:<34}{theirs[name]:>16.1f}")
    if "generate_batch_error" in theirs:
        print(f"transformers generate_batch failed: {theirs['generate_batch_error']}")
    best = max((theirs[k] for k in ("padded_generate", "generate_batch") if k in theirs), default=None)
    if best:
        print(f"ratio jpaged / transformers best: {ours['tokens_per_s'] / best:.2f}x")
    print(f"compiled programs: {ours['num_compiled']} (bucket count {ours['num_buckets']}); "
          f"warm-up {ours['warmup_s']:.1f}s; start-up {ours['startup_s']:.1f}s; "
          f"total compile {ours['compile_s']:.1f}s")


if __name__ == "__main__":
    main()
