"""Start-up: seconds to a first offline batch and to a healthy server, cold and warm, with
where they went (load, tracing, XLA compiles, executable-cache loads, warm-up runs) and the
program counts; transformers' load + generate of the same batch beside it.

    python scripts/bench_startup.py                       # SmolLM2, 32 x 128 prompt + 64 new
    python scripts/bench_startup.py --model DIR --skip-serve --skip-transformers

Every phase is its own process, timed from before jax (or torch) is imported:
  offline cold   LLM(model).generate(batch) with an empty compilation cache directory
  offline warm   the same again, the directory now filled by the cold run
  transformers   AutoModelForCausalLM.from_pretrained + padded generate of the same batch
  serve cold     `jpaged serve` with default flags and an empty cache directory: seconds
                 until /health answers 200, then one chat completion (first answer)
  serve warm     the same with the directory the cold start filled
The model file itself is cached beforehand (its download is not start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

OFFLINE = r"""
import time; t0 = time.perf_counter()
import json, sys
from jpaged import LLM, SamplingParams
model, cache, n, plen, olen = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
llm = LLM(model, compilation_cache_dir=cache)
ready = time.perf_counter() - t0
prompts = [[(7 * i + j) % 1000 + 10 for j in range(plen)] for i in range(n)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True),
                    use_tqdm=False)
assert all(len(o.outputs[0].token_ids) == olen for o in outs)
s = llm.stats()
keys = ("num_compiles", "num_traced", "trace_seconds", "xla_compile_seconds",
        "num_xla_cache_hits", "num_loaded", "load_seconds")
print("RESULT " + json.dumps({"total_s": time.perf_counter() - t0, "engine_ready_s": ready,
      "load_s": llm.llm_engine.load_seconds, **{k: s[k] for k in keys}}))
"""

TRANSFORMERS = r"""
import time; t0 = time.perf_counter()
import json, sys
from pathlib import Path
import torch, transformers
model, n, plen, olen = sys.argv[1], *map(int, sys.argv[2:5])
path, kw = Path(model), {}
if path.suffix == ".gguf":
    path, kw = path.parent, {"gguf_file": path.name}
m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
m.eval()
loaded = time.perf_counter() - t0
ids = torch.tensor([[(7 * i + j) % 1000 + 10 for j in range(plen)] for i in range(n)])
with torch.no_grad():
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=olen,
                     min_new_tokens=olen, do_sample=False, pad_token_id=0)
assert out.shape == (n, plen + olen)
print("RESULT " + json.dumps({"total_s": time.perf_counter() - t0, "load_s": loaded}))
"""


def _result(cmd: list[str], env: dict, timeout: float) -> dict:
    res = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=_ROOT
    )
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str | None, cache: str, env: dict, timeout: float) -> dict:
    """Seconds from `jpaged serve` to /health 200 and to its first chat answer, and the
    warm-up line the server logged."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--port",
        "off",
        "--http-port",
        str(port),
        "--metrics-port",
        "off",
        "--compilation-cache-dir",
        cache,
    ]
    if model:
        cmd += ["--model", model]
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the server child writes it until the end
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        healthy = None
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        healthy = time.perf_counter() - t0
                        break
            except OSError:
                pass
            time.sleep(0.1)
        if healthy is None:
            log.seek(0)
            raise RuntimeError(f"server not healthy after {timeout}s:\n{log.read()[-3000:]}")
        with urllib.request.urlopen(base + "/v1/models", timeout=timeout) as r:
            name = json.loads(r.read())["data"][0]["id"]
        body = json.dumps(
            {
                "model": name,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }
        ).encode()
        req = urllib.request.Request(
            base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        first = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=90)
    log.seek(0)
    warm = [ln.strip() for ln in log.read().splitlines() if "warm-up:" in ln]
    return {
        "healthy_s": healthy,
        "first_answer_s": first,
        "answer": answer,
        "warm_up_log": warm[-1] if warm else None,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--timeout", type=float, default=1200)
    args = p.parse_args(argv)
    sys.path.insert(0, str(_ROOT))
    from models.demo import resolve_builtin

    model = resolve_builtin(args.model)  # fetched before any phase is timed
    env = dict(os.environ)
    batch = [str(args.num_prompts), str(args.prompt_len), str(args.output_len)]
    result = {"model": model, "batch": batch}
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "offline")
        for phase in () if args.skip_offline else ("cold", "warm"):
            cmd = [sys.executable, "-c", OFFLINE, model, cache, *batch]
            result[f"offline_{phase}"] = r = _result(cmd, env, args.timeout)
            print(
                f"offline {phase}: {r['total_s']:.1f}s in all (engine ready "
                f"{r['engine_ready_s']:.1f}s, weights {r['load_s']:.1f}s); "
                f"{r['num_compiles']} programs: {r['num_traced']} traced "
                f"({r['trace_seconds']:.1f}s tracing, {r['xla_compile_seconds']:.1f}s XLA, "
                f"{r['num_xla_cache_hits']} XLA cache hits), {r['num_loaded']} loaded "
                f"({r['load_seconds']:.1f}s)",
                flush=True,
            )
        if not args.skip_transformers:
            cmd = [sys.executable, "-c", TRANSFORMERS, model, *batch]
            result["transformers"] = r = _result(cmd, env, args.timeout)
            print(f"transformers: {r['total_s']:.1f}s in all (load {r['load_s']:.1f}s)")
            for phase in () if args.skip_offline else ("cold", "warm"):
                ratio = result[f"offline_{phase}"]["total_s"] / r["total_s"]
                print(f"  jpaged offline {phase} / transformers: {ratio:.2f}x")
        if not args.skip_serve:
            cache = str(Path(tmp) / "serve")
            for phase in ("cold", "warm"):
                result[f"serve_{phase}"] = r = serve(args.model, cache, env, args.timeout)
                print(
                    f"serve {phase}: healthy {r['healthy_s']:.1f}s, first answer "
                    f"{r['first_answer_s']:.1f}s ({r['answer']!r}); {r['warm_up_log']}",
                    flush=True,
                )
    print("RESULT_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
