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
format next to the checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
RANK = 16


def write_adapters(model: str, root: Path, n: int, rank: int = RANK) -> list[Path]:
    """n random PEFT adapters of rank `rank` on every projection of the checkpoint at model."""
    from safetensors.numpy import save_file

    from models.loader import read_config

    cfg = read_config(model)  # a Hugging Face directory or a GGUF
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, kv = cfg.num_heads, cfg.num_kv_heads
    dims = {"q_proj": (d, h * dh), "k_proj": (d, kv * dh), "v_proj": (d, kv * dh),
            "o_proj": (h * dh, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip
    paths = []
    for i in range(n):
        path = root / f"lora-r{rank}-{i}"
        paths.append(path)
        if (path / "adapter_config.json").exists():
            continue
        rng = np.random.default_rng(1000 + i)
        tensors = {}
        for layer in range(cfg.num_layers):
            for module, place in MODULES.items():
                n_in, n_out = dims[module]
                key = f"base_model.model.model.layers.{layer}.{place}.{module}"
                tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(np.float32)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                  "target_modules": list(MODULES), "base_model_name_or_path": str(model)}  # fmt: skip
        (path / "adapter_config.json").write_text(json.dumps(config))
    return paths


def _timed(llm, prompts, output_lens, loras) -> tuple[float, int]:
    from jpaged import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def run_lora(model: str, prompts, output_lens, n: int, engine_kwargs: dict, vocab: int,
             rounds: int = 3) -> dict:
    """The table's rows {config: {"tok_s", "ratio", "seconds", "compiles"}} (see the module
    docstring): both engines stay up and the configurations run in turn, `rounds` times,
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
    llm = LLM(model, enable_lora=True, max_loras=n, max_lora_rank=RANK, max_cpu_loras=n,
              **engine_kwargs)  # fmt: skip
    requests = [LoRARequest(f"bench{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    t0 = time.perf_counter()
    llm.add_lora(requests[0])
    load_s = time.perf_counter() - t0
    configs = {"base (LoRA off)": (plain, None), "base (LoRA on, no adapter)": (llm, None)}
    for k in (1, 4, 16):
        if k <= n:
            loras = [requests[i % k] for i in range(len(prompts))]
            configs[f"{k} adapter{'s' if k > 1 else ''} (rank {RANK})"] = (llm, loras)
    for engine, loras in configs.values():  # warm-up: the same shapes, other tokens
        _timed(engine, shifted, output_lens, loras)
    times: dict[str, list[float]] = {name: [] for name in configs}
    compiles = {name: 0 for name in configs}
    for _ in range(rounds):
        for name, (engine, loras) in configs.items():
            before = engine.stats()["num_compiles"]
            seconds, tokens = _timed(engine, prompts, output_lens, loras)
            compiles[name] += engine.stats()["num_compiles"] - before  # should stay 0
            times[name].append(seconds)
            print(f"{name:<28} {tokens / seconds:9.1f} tok/s  ({seconds:.2f} s)", flush=True)
    rows = {}
    for name, ts in times.items():
        seconds = float(np.median(ts))
        rows[name] = {"seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
                      "compiles": compiles[name], "runs_s": [round(t, 2) for t in ts]}  # fmt: skip
    ref = rows["base (LoRA off)"]["tok_s"]
    for row in rows.values():
        row["ratio"] = round(row["tok_s"] / ref, 3)
    print(f"adapter read + check (rank {RANK}, host): {load_s:.3f} s; writing {n}: {write_s:.1f} s")
    for name, row in rows.items():
        print(f"  {name:<28} {row['tok_s']:8.1f} tok/s (median of {rounds})  {row['ratio']:.3f}x")
    return {"rows": rows, "adapter_load_s": round(load_s, 3), "max_loras": n, "rank": RANK,
            "rounds": rounds}  # fmt: skip
