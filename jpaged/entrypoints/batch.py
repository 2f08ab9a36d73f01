"""Offline batch inference over JSONL: one request per line in, one result per line out.

Input lines: {"prompt": "text" | [token ids]} or {"prompt_token_ids": [token ids]}, an
optional "id", and any SamplingParams field (defaults: the caller's, e.g. the CLI's sampling
flags). Output lines, in input order: {"line", "id", "prompt", "outputs": [{"text",
"token_ids", "finish_reason"}]}, or {"line", "id", "error"} for a line that could not be run.
A line that is not a JSON object of known fields is "malformed"; one whose values are invalid
(a bad top_p, a prompt too long) is "invalid". Both are reported on stderr with their line
number; every other line still runs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable

from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"output_kind"}
_PROMPT_FIELDS = ("prompt", "prompt_token_ids")


class MalformedLine(ValueError):
    """A line that is not a JSON object of known fields."""


def parse_line(text: str, defaults: dict | None = None) -> tuple[object, SamplingParams, object]:
    """One JSONL line -> (prompt, params, id).

    Raises:
      MalformedLine: not JSON, not an object, no prompt, unknown fields.
      ValueError: a value is invalid (naming the field).
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedLine(f"invalid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise MalformedLine("a line must be a JSON object")
    given = [k for k in _PROMPT_FIELDS if k in obj]
    if len(given) != 1:
        raise MalformedLine("give exactly one of 'prompt' and 'prompt_token_ids'")
    unknown = set(obj) - _PARAM_FIELDS - {*_PROMPT_FIELDS, "id"}
    if unknown:
        raise MalformedLine(f"unknown field(s): {', '.join(sorted(unknown))}")
    prompt = obj[given[0]]
    if given[0] == "prompt_token_ids" and not isinstance(prompt, list):
        raise ValueError("prompt_token_ids must be a list of integers")
    params = {**(defaults or {}), **{k: v for k, v in obj.items() if k in _PARAM_FIELDS}}
    try:
        sp = SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY)
    except TypeError as e:
        raise ValueError(str(e)) from None
    return prompt, sp, obj.get("id")


def _line_id(text: str):
    """The line's own "id" when it can be read, else None."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj.get("id") if isinstance(obj, dict) else None


def run_batch(
    input_path: str,
    output_path: str,
    *,
    engine_factory: Callable[[], object] | None = None,
    engine=None,
    defaults: dict | None = None,
) -> int:
    """Runs every line; returns 0 if all lines ran, 1 if some were malformed or invalid.

    The input is read (and a missing file reported) before the engine is made.
    """
    from tqdm import tqdm

    with open(input_path, encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
    if engine is None:
        engine = engine_factory()
    results: dict[int, dict] = {}
    pending: dict[str, tuple[int, object, object]] = {}
    num_malformed = num_invalid = 0
    for lineno, text in lines:
        try:
            prompt, params, rid = parse_line(text, defaults)
            req_id = f"batch-{lineno}"
            engine.add_request(req_id, prompt, params)
        except ValueError as e:
            print(f"{input_path}:{lineno}: {e}", file=sys.stderr)
            results[lineno] = {"line": lineno, "id": _line_id(text), "error": str(e)}
            if isinstance(e, MalformedLine):
                num_malformed += 1
            else:
                num_invalid += 1
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
    print(
        f"{len(pending)} requests, {num_tokens} output tokens in {elapsed:.2f}s: "
        f"{num_tokens / max(elapsed, 1e-9):.1f} output tokens/s, {num_malformed} malformed "
        f"line(s), {num_invalid} invalid line(s)",
        file=sys.stderr,
    )
    return 1 if num_malformed or num_invalid else 0
