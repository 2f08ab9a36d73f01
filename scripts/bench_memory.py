"""Memory benchmark (issue 4): paged against reserved KV allocation, prefix caching, page size.

    python scripts/bench_memory.py                      # CPU defaults: demo model, a few minutes
    python scripts/bench_memory.py --model /path/to/Llama-3.2-1B --num-requests 256 \
        --max-prompt 512 --max-tokens 512 --kv-tokens 131072 --max-num-seqs 128 \
        --prefix-requests 64                            # an accelerator

Three tables:
1. One workload (prompt lengths uniform in [min_prompt, max_prompt], output lengths uniform in
   [16, max_tokens]) run under the same KV budget (kv_tokens token slots) with
   kv_allocation="paged" and "reserve". Every request is submitted with max_tokens (a server
   cannot know how long an answer will be) and is stopped at its drawn length by aborting it,
   as an EOS would stop it. Columns: KV utilization (slots holding computed tokens / slots of
   allocated pages, after each step, averaged over steps), the most requests running at once,
   output tokens/s.
2. Shared system prompt: prefix_len common tokens plus short unique suffixes, with prefix
   caching on and off (paged).
3. The paged workload of table 1 again with page sizes 8..128 (same token budget): KV
   utilization, tokens/s and the page-table size (entries per sequence, bytes on device).
4. Preemption: table 1's workload on a small budget, recompute against swap.

`--preset windowed` runs one table instead (issue 28.2, docs/memory.md "Hybrid paging"): a
Gemma-3-shaped model scaled to the CPU (random weights, 12 layers of the 5 local : 1 global
pattern, window 512; built with transformers into a temporary directory unless --model is
given), requests of 4,096-token contexts, at equal KV memory (--kv-tokens token slots of
every layer): hybrid paging (a page table per layer group, the window groups' old pages
freed) against --no-free-window-pages (every page kept). Columns as above; "max run" is the
most sequences admitted at once.

`--preset kv-bytes` prints DeepSeek-V3's KV bytes per token (its real attention dims, no weights):
the latent pool (models/mla.py) against the same model with per-head K/V, per KV dtype.

Tokens/s counts output tokens over the wall time of the run less the time spent compiling
(engine.stats()['compile_seconds']), so cold compiles do not decide the comparison. Requests are greedy
random token ids; the model's weights do not matter to memory use.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))


@dataclasses.dataclass
class Result:
    utilization: float  # mean over steps of filled slots / allocated slots
    max_running: int
    tokens_per_s: float
    output_tokens: int
    seconds: float  # wall time less compile time
    compile_seconds: float
    num_steps: int
    num_preemptions: int
    num_swaps: int
    hit_tokens: int
    peak_pages: int
    pages_total: int  # the pool's pages (--kv-bytes: what the budget holds in the KV dtype)
    pages_per_seq: int
    page_table_bytes: int


def make_engine(
    args,
    *,
    page_size: int,
    kv_allocation: str,
    prefix_caching: bool,
    max_model_len,
    kv_tokens=None,
    preemption_mode="recompute",
    free_window_pages=True,
):
    from jpaged.core.engine import LLMEngine
    from jpaged.entrypoints.engine_args import engine_config_from_args

    config = engine_config_from_args(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=page_size,
        # The same for every run: kv_tokens token slots, or (--kv-bytes, tables 1-3) the
        # pages that many bytes hold in this run's KV dtype, so dtypes compare at equal memory.
        **(
            {"kv_cache_memory_bytes": args.kv_bytes}
            if args.kv_bytes and kv_tokens is None
            else {"num_pages": (kv_tokens or args.kv_tokens) // page_size + 1}
        ),
        kv_allocation=kv_allocation,
        preemption_mode=preemption_mode,
        enable_prefix_caching=prefix_caching,
        free_window_pages=free_window_pages,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    s = config.scheduler
    # Fewer, larger buckets: fewer compiles on a CPU; an accelerator run can lower these.
    s = dataclasses.replace(
        s, min_token_bucket=args.min_token_bucket, min_seq_bucket=args.max_num_seqs
    )
    return LLMEngine(dataclasses.replace(config, scheduler=s))


def kv_slots(engine) -> tuple[int, int]:
    """(slots holding computed tokens, slots of allocated pages); a shared page counts once,
    a freed (null) entry not at all, and every paging group's pages count."""
    ps = engine.config.cache.page_size
    filled: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for pages in seq.tables:
            for i, page in enumerate(pages):
                if page:
                    n = min(ps, max(0, seq.num_computed_tokens - i * ps))
                    filled[page] = max(filled.get(page, 0), n)
    return sum(filled.values()), engine.allocator.num_used() * ps


def run(engine, requests, max_tokens: int) -> Result:
    """requests: (prompt ids, output length). Each is submitted with the engine-wide
    max_tokens and aborted once it has produced its output length."""
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    targets = {}
    for i, (prompt, out_len) in enumerate(requests):
        rid = f"r{i}"
        engine.add_request(rid, prompt, params)
        targets[rid] = out_len
    engine.reset_stats()
    compile0 = engine.stats()["compile_seconds"]
    utilizations, max_running, produced, steps = [], 0, 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        max_running = max(max_running, engine.num_running())
        filled, allocated = kv_slots(engine)
        if allocated:
            utilizations.append(filled / allocated)
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n >= targets[out.request_id] or out.finished:
                produced += min(n, targets[out.request_id])
                engine.abort_request(out.request_id)
    wall = time.perf_counter() - t0
    compile_s = engine.stats()["compile_seconds"] - compile0
    stats = engine.stats()
    cfg = engine.config
    return Result(
        utilization=float(np.mean(utilizations)),
        max_running=max_running,
        tokens_per_s=produced / max(wall - compile_s, 1e-9),
        output_tokens=produced,
        seconds=wall - compile_s,
        compile_seconds=compile_s,
        num_steps=steps,
        num_preemptions=stats["num_preemptions"],
        num_swaps=stats["num_swaps_out"],
        hit_tokens=stats["prefix_cache_hit_tokens"],
        peak_pages=stats["peak_pages_used"],
        pages_total=stats["pages_total"],
        pages_per_seq=cfg.max_pages_per_seq,
        page_table_bytes=4 * (cfg.scheduler.max_num_seqs + 1) * cfg.max_pages_per_seq,
    )


def workload(args, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(
                3, vocab, int(rng.integers(args.min_prompt, args.max_prompt + 1))
            ).tolist(),
            int(rng.integers(16, args.max_tokens + 1)),
        )
        for _ in range(args.num_requests)
    ]


def shared_prefix_workload(args, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, args.prefix_len).tolist()
    return [
        (
            prefix + rng.integers(3, vocab, int(rng.integers(8, 33))).tolist(),
            int(rng.integers(8, args.prefix_max_tokens + 1)),
        )
        for _ in range(args.prefix_requests)
    ]


def bench(
    args,
    requests,
    *,
    page_size,
    kv_allocation="paged",
    prefix_caching=True,
    max_tokens,
    kv_tokens=None,
    preemption_mode="recompute",
    free_window_pages=True,
):
    """A fresh engine; a warm-up run on other tokens of the same shapes, then the timed run."""
    longest = max(len(p) for p, _ in requests) + max_tokens
    engine = make_engine(
        args,
        page_size=page_size,
        kv_allocation=kv_allocation,
        prefix_caching=prefix_caching,
        max_model_len=longest,
        kv_tokens=kv_tokens,
        preemption_mode=preemption_mode,
        free_window_pages=free_window_pages,
    )
    if args.warmup:
        other = [([3 + (t - 2) % (args.vocab - 3) for t in p], n) for p, n in requests]
        run(engine, other, max_tokens)
        engine.allocator.reset_prefix_cache()
    return run(engine, requests, max_tokens)


_HEAD = f"{'':<22}{'KV util':>9}{'max run':>9}{'tok/s':>9}{'out tok':>9}{'steps':>7}"
_HEAD += f"{'preempt':>9}{'compile s':>11}"


def _row(name, r: Result, extra=""):
    print(
        f"{name:<22}{r.utilization:>8.1%}{r.max_running:>9}{r.tokens_per_s:>9.1f}"
        f"{r.output_tokens:>9}{r.num_steps:>7}{r.num_preemptions:>9}"
        f"{r.compile_seconds:>11.1f}{extra}",
        flush=True,
    )


def windowed_model(path: Path, window: int, vocab: int) -> Path:
    """A random Gemma 3 text model scaled to the CPU (12 layers: local, local, local, local,
    local, global, twice), saved as a Hugging Face directory."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=window,
        max_position_embeddings=8192, query_pre_attn_scalar=16, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def windowed_table(args, row, head) -> None:
    """--preset windowed: hybrid paging against keeping every page, at equal KV memory."""
    import tempfile

    if args.model is None:
        args.model = str(windowed_model(Path(tempfile.mkdtemp()) / "gemma3", args.window, 512))
    from models.loader import read_config

    args.vocab = read_config(args.model).vocab_size
    rng = np.random.default_rng(0)
    prompt_len = args.context - args.max_tokens
    requests = [
        (rng.integers(3, args.vocab, prompt_len).tolist(), args.max_tokens)
        for _ in range(args.num_requests)
    ]
    print(
        f"\n5. hybrid paging: {args.num_requests} requests of {prompt_len} + {args.max_tokens} "
        f"tokens, page_size {args.page_size}, KV memory of {args.kv_tokens} token slots of "
        f"every layer ({args.kv_tokens // args.context} whole contexts)"
    )
    print(head + f"{'pages':>8}{'peak':>7}")
    res = {}
    for name, free in (("hybrid", True), ("keep every page", False)):
        res[free] = bench(
            args, requests, page_size=args.page_size, prefix_caching=False,
            max_tokens=args.max_tokens, free_window_pages=free,
        )  # fmt: skip
        row(name, res[free], f"{res[free].pages_total:>8}{res[free].peak_pages:>7}")
    print(
        f"hybrid / keep every page: {res[True].max_running / res[False].max_running:.2f}x the "
        f"sequences at once, {res[True].tokens_per_s / res[False].tokens_per_s:.2f}x tokens/s"
    )


# DeepSeek-V3's config.json attention fields (the rest does not change the pool).
DEEPSEEK_V3_ATTENTION = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
}  # fmt: skip


def kv_bytes_table() -> None:
    """--preset kv-bytes: DeepSeek-V3's KV bytes per token, latent pool against full heads."""
    from jpaged.core.memory_plan import kv_page_bytes
    from models.config import ModelConfig
    from pallas_kernels import kv_quant

    cfg = ModelConfig.from_hf_config(DEEPSEEK_V3_ATTENTION)
    heads = cfg.num_heads * ((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + cfg.v_head_dim)
    print(f"DeepSeek-V3: {cfg.num_layers} layers, latent {cfg.kv_lora_rank} + rope "
          f"{cfg.qk_rope_head_dim} against {cfg.num_heads} heads of K "
          f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim} + V {cfg.v_head_dim}")  # fmt: skip
    print(f"{'KV dtype':<10}{'MLA bytes/token':>17}{'per-head K/V':>15}{'ratio':>8}")
    for name, itemsize in (("bfloat16", 2), ("float32", 4), ("int8", 1)):
        dtype = kv_quant.storage_dtype(name, np.float32) if name == "int8" else None
        mla = kv_page_bytes(cfg, 1, itemsize, dtype)
        # full heads: each K and V row of a head stored, int8 with a 2-byte scale per row
        row_scales = 2 * 2 * cfg.num_heads if name == "int8" else 0
        full = cfg.num_layers * (heads * itemsize + row_scales)
        print(f"{name:<10}{mla:>17,}{full:>15,}{full / mla:>7.1f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: demo model)")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256, help="outputs are 16..max_tokens")
    p.add_argument(
        "--submit-max-tokens",
        type=int,
        default=None,
        help="table 1: the max_tokens requests are submitted with (default --max-tokens), e.g. "
        "a client's default cap well above typical answers",
    )
    p.add_argument("--kv-tokens", type=int, default=4096, help="KV budget in token slots")
    p.add_argument(
        "--kv-bytes", type=int, default=None,
        help="tables 1-3: a KV budget in bytes instead of --kv-tokens (the pages it holds "
        "depend on --kv-cache-dtype: compare dtypes at equal memory)",
    )
    p.add_argument(
        "--quantization", default=None, choices=("int8", "fp8"), help="weights (default: float)"
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto",
        help="KV pages: auto, bfloat16, float32, int8, fp8 (--kv-tokens counts its pages' tokens)",
    )
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--min-token-bucket", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16, help="for tables 1 and 2")
    p.add_argument("--page-sizes", default="8,16,32,64,128", help="table 3; empty: skip")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--prefix-requests", type=int, default=16)
    p.add_argument("--prefix-max-tokens", type=int, default=32)
    p.add_argument("--warmup", action="store_true", help="run each workload once untimed first")
    p.add_argument("--preempt-kv-tokens", type=int, default=1024, help="table 4's KV budget")
    p.add_argument("--skip", default="", help="comma list of tables to skip: 1,2,3,4")
    p.add_argument(
        "--preset", default=None, choices=("windowed", "kv-bytes"),
        help="windowed: only table 5, hybrid paging on a Gemma-3-shaped model (module "
        "docstring); its defaults: 16 requests of 4096-token contexts (64 generated), window "
        "512, --kv-tokens 16384, --max-num-seqs 32, --max-num-batched-tokens 1024, "
        "--page-size 16; kv-bytes: DeepSeek-V3's KV bytes per token (module docstring)",
    )
    p.add_argument("--context", type=int, default=4096, help="--preset windowed: tokens")
    p.add_argument("--window", type=int, default=512, help="--preset windowed: the window")
    args = p.parse_args()
    if args.preset == "kv-bytes":
        kv_bytes_table()
        return
    if args.preset == "windowed":
        given = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
        # A budget of 1,024 tokens: at 512, 8 prefill steps per 4,032-token prompt against 64
        # decode steps keep about 9 sequences running whatever the memory (the budget binds);
        # at 4,096 a whole prompt's chunk needs its pages in every window group before they
        # slide (docs/memory.md, "Hybrid paging").
        for flag, value in (("--num-requests", 16), ("--max-tokens", 64),
                            ("--kv-tokens", 16384), ("--max-num-batched-tokens", 1024)):  # fmt: skip
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)

    import jax

    if args.preset == "windowed":
        if args.dtype is None:
            args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        device = jax.devices()[0]
        print(
            f"hardware: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
        )
        t_start = time.perf_counter()
        windowed_table(args, _row, _HEAD)
        print(f"\ntotal {time.perf_counter() - t_start:.0f}s")
        return
    if args.model is None:
        from models.demo import ensure_demo_model

        args.model = str(ensure_demo_model())
    if args.dtype is None:
        args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    from models.loader import read_config  # a Hugging Face directory or a GGUF file

    vocab = args.vocab = read_config(args.model).vocab_size
    skip = set(args.skip.split(","))
    t_start = time.perf_counter()
    device = jax.devices()[0]
    print(
        f"hardware: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"model: {args.model} ({args.dtype}); KV budget "
        + (f"{args.kv_bytes} bytes" if args.kv_bytes
           else f"{args.kv_tokens} token slots")
        + f"; KV dtype {args.kv_cache_dtype}; "
        f"max_num_seqs {args.max_num_seqs}; max_num_batched_tokens {args.max_num_batched_tokens}"
    )

    requests = workload(args, vocab, seed=0)
    head = _HEAD

    row = _row

    paged = None
    if "1" not in skip:
        submitted = args.submit_max_tokens or args.max_tokens
        print(
            f"\n1. paged vs reserve: {args.num_requests} requests, prompts "
            f"{args.min_prompt}-{args.max_prompt}, outputs 16-{args.max_tokens} "
            f"(submitted with max_tokens {submitted}), page_size {args.page_size}"
        )
        print(head)
        res = {}
        for alloc in ("paged", "reserve"):
            res[alloc] = bench(
                args,
                requests,
                page_size=args.page_size,
                kv_allocation=alloc,
                prefix_caching=False,
                max_tokens=submitted,
            )
            row(alloc, res[alloc], f"  ({res[alloc].pages_total} pages)")
        paged = res["paged"]
        print(
            f"paged / reserve throughput: {paged.tokens_per_s / res['reserve'].tokens_per_s:.2f}x"
        )

    if "2" not in skip:
        shared = shared_prefix_workload(args, vocab, seed=1)
        print(
            f"\n2. shared system prompt: {args.prefix_requests} requests, {args.prefix_len}-token "
            f"prefix + 8-32 unique tokens, outputs 8-{args.prefix_max_tokens}"
        )
        print(head + f"{'hit tokens':>12}")
        res = {}
        for name, on in (("prefix caching on", True), ("prefix caching off", False)):
            res[on] = bench(
                args,
                shared,
                page_size=args.page_size,
                prefix_caching=on,
                max_tokens=args.prefix_max_tokens,
            )
            row(name, res[on], f"{res[on].hit_tokens:>12}")
        print(f"on / off throughput: {res[True].tokens_per_s / res[False].tokens_per_s:.2f}x")

    if "3" not in skip and args.page_sizes:
        print(f"\n3. page size (paged, workload 1, budget {args.kv_tokens} token slots)")
        print(head + f"{'pages/seq':>11}{'table bytes':>13}")
        for ps in (int(x) for x in args.page_sizes.split(",")):
            if ps == args.page_size and paged is not None:
                r = paged
            else:
                r = bench(
                    args, requests, page_size=ps, prefix_caching=False, max_tokens=args.max_tokens
                )
            row(f"page_size {ps}", r, f"{r.pages_per_seq:>11}{r.page_table_bytes:>13}")
    if "4" not in skip:
        kv = args.preempt_kv_tokens
        print(f"\n4. preemption: workload 1, paged, page_size {args.page_size}, budget {kv} slots")
        print(head + f"{'swaps':>8}")
        res = {}
        for mode in ("recompute", "swap"):
            res[mode] = bench(
                args,
                requests,
                page_size=args.page_size,
                max_tokens=args.max_tokens,
                kv_tokens=kv,
                preemption_mode=mode,
            )
            row(mode, res[mode], f"{res[mode].num_swaps:>8}")
        print(
            f"swap / recompute throughput: {res['swap'].tokens_per_s / res['recompute'].tokens_per_s:.2f}x"
        )
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
