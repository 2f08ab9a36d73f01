"""Sharding check on a simulated CPU mesh, and the communication the layout implies.

    python scripts/bench_sharding.py                 # 8 simulated CPU devices, T = 2, 4, 8

For each tensor-parallel size it builds an engine on a random Llama (preset cpu-tp of
bench_throughput.py), runs a small batch (prefill and decode steps), and reads the HLO of every
compiled step (layers unrolled, so that each layer's collectives appear in the text): the
step must be one program (one HloModule) holding exactly one all-reduce after each
row-parallel matmul (wo and w_down: 2 per layer), one for the vocab-parallel
embedding, and one all-gather of the logits. Then it prints the bytes each device sends per
step under this layout for Llama-3-8B and Llama-3-70B shapes at T = 8 (bfloat16 activations,
float32 logits, ring collectives), from models.sharding.comm_bytes_per_step.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "scripts")]

# name: (hidden, layers, vocab)
SHAPES = {"Llama-3-8B": (4096, 32, 128256), "Llama-3-70B": (8192, 80, 128256)}
# (label, tokens in the step, sequences in the step)
STEPS = (("decode, 64 seqs", 64, 64), ("decode, 256 seqs", 256, 256), ("prefill 2048 tok", 2048, 8))


def check_programs(model: str, sizes: list[int], num_layers: int) -> bool:
    from jpaged import LLM, SamplingParams

    ok = True
    prompts = [[(13 * i + j) % 4000 + 3 for j in range(24 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = 2 * num_layers + 1
    print(f"{'T':>3} {'step key':<46} {'modules':>8} {'all-reduce':>11} {'all-gather':>11} "
          f"{'tok/s/device':>13}")  # fmt: skip
    for t in sizes:
        llm = LLM(
            model,
            tensor_parallel_size=t,
            max_num_seqs=8,
            max_model_len=128,
            max_num_batched_tokens=64,
            compilation_cache_dir=None,
            scan_layers=False,  # unrolled: each layer's collectives appear in the program text
        )
        llm.generate(prompts, params)  # compiles the shapes
        t0 = time.perf_counter()
        outs = llm.generate([[p[0] + 1, *p[1:]] for p in prompts], params)
        rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0) / t
        programs = llm.llm_engine.runner.programs
        for key in programs.step_keys():
            text = programs.executable(key).as_text()
            modules = len(re.findall(r"^HloModule ", text, re.MULTILINE))
            reduces = len(re.findall(r"\ball-reduce(?:-start)?\(", text))
            gathers = len(re.findall(r"\ball-gather(?:-start)?\(", text))
            good = (modules, reduces, gathers) == (1, want, 1)
            ok &= good
            kind = "decode" if key.decode_only else "ragged"
            name = f"{kind} tokens={key.num_tokens} seqs={key.num_seqs} pages={key.num_page_cols}"
            print(f"{t:>3} {name:<46} {modules:>8} {reduces:>11} {gathers:>11} {rate:>13.1f}"
                  f"{'' if good else '  <- unexpected'}")  # fmt: skip
    print(f"expected per step: 1 module, {want} all-reduces (2 x {num_layers} layers + embedding), "
          "1 all-gather (logits)")  # fmt: skip
    return ok


def comm_table(t: int) -> None:
    from models.sharding import comm_bytes_per_step

    print(f"\nbytes sent per device per step at T = {t} (bf16 activations, f32 logits, ring):")
    print(f"{'model':<12} {'step':<18} {'all-reduces':>11} {'layers MB':>10} {'embed MB':>9} "
          f"{'logits MB':>10} {'total MB':>9}")  # fmt: skip
    for name, (hidden, layers, vocab) in SHAPES.items():
        for label, tokens, seqs in STEPS:
            c = comm_bytes_per_step(
                hidden=hidden,
                num_layers=layers,
                vocab=vocab,
                num_tokens=tokens,
                num_seqs=seqs,
                tensor_parallel_size=t,
            )
            print(f"{name:<12} {label:<18} {c['all_reduces']:>11} {c['layers'] / 1e6:>10.2f} "
                  f"{c['embedding'] / 1e6:>9.3f} {c['logits'] / 1e6:>10.2f} "
                  f"{c['total'] / 1e6:>9.2f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--sizes", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--comm-tp", type=int, default=8, help="T for the communication table")
    args = p.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    import jax
    from bench_throughput import PRESETS, ensure_checkpoint

    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices (simulated)"
    )
    model = ensure_checkpoint(Path(tempfile.mkdtemp(prefix="jpaged-shard-")), "cpu-tp",
                              "float32", seed=0)  # fmt: skip
    ok = check_programs(str(model), args.sizes, num_layers=PRESETS["cpu-tp"]["layers"])
    comm_table(args.comm_tp)
    print("\ncollectives as expected" if ok else "\nUNEXPECTED collectives (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
