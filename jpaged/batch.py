"""Offline batch inference over JSONL: one request per line in, one result per line out.

Input lines: {"prompt": "text" | [token ids], "id": optional, ...SamplingParams fields}.
Output lines, in input order: {"line", "id", "prompt", "outputs": [{"text", "token_ids",
"finish_reason"}]}, or {"line", "error"} for a line that could not be run. A malformed line
is reported on stderr with its line number; every other line still runs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from jpaged.sampling_params import SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def parse_line(text: str) -> tuple[object, SamplingParams, object]:
    """One JSONL line -> (prompt, params, id). Raises ValueError naming the problem."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    if "prompt" not in obj:
        raise ValueError("missing field 'prompt'")
    unknown = set(obj) - _PARAM_FIELDS - {"prompt", "id"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    params = {k: v for k, v in obj.items() if k in _PARAM_FIELDS}
    try:
        sp = SamplingParams(**params)
    except TypeError as e:
        raise ValueError(str(e)) from None
    return obj["prompt"], sp, obj.get("id")


def run_batch(input_path: str, output_path: str, *, model=None, engine_kwargs=None, llm=None) -> int:
    """Runs every line; returns 0 if all lines ran, 1 if some were malformed."""
    from tqdm import tqdm

    from jpaged.engine import LLMEngine

    with open(input_path, encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
    engine = llm.llm_engine if llm is not None else LLMEngine.from_args(model=model, **(engine_kwargs or {}))
    results: dict[int, dict] = {}
    pending: dict[str, tuple[int, object, object]] = {}
    for lineno, text in lines:
        try:
            prompt, params, rid = parse_line(text)
            req_id = f"batch-{lineno}"
            engine.add_request(req_id, prompt, params, stream=False)
        except ValueError as e:
            print(f"{input_path}:{lineno}: {e}", file=sys.stderr)
            results[lineno] = {"line": lineno, "error": str(e)}
            continue
        pending[req_id] = (lineno, rid, prompt)
    t0 = time.perf_counter()
    num_tokens = 0
    with tqdm(total=len(pending), desc="requests", unit="req", file=sys.stderr) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                lineno, rid, prompt = pending[out.request_id]
                num_tokens += sum(len(c.token_ids) for c in out.outputs)
                results[lineno] = {
                    "line": lineno,
                    "id": rid,
                    "prompt": prompt,
                    "outputs": [
                        {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                        for c in out.outputs
                    ],
                }
                bar.update(1)
    elapsed = time.perf_counter() - t0
    with open(output_path, "w", encoding="utf-8") as f:
        for lineno, _ in lines:
            f.write(json.dumps(results[lineno], ensure_ascii=False) + "\n")
    errors = sum(1 for r in results.values() if "error" in r)
    print(
        f"{len(pending)} requests, {num_tokens} output tokens in {elapsed:.2f}s: "
        f"{num_tokens / max(elapsed, 1e-9):.1f} output tokens/s, {errors} malformed line(s)",
        file=sys.stderr,
    )
    return 1 if errors else 0
