"""Embeddings: a request's prompt run through the model once and its last hidden states pooled.

An embedding request is an ordinary request of one greedy token whose prompt is computed
on the paged cache like any other (chunked prefill, batched with generating requests, pages
freed when it ends) and never read from the prefix cache: every prompt token's hidden state
is needed. A step with such rows (StepKey.pooling) returns, per row, the sum of its tokens'
final hidden states (after the final norm, as transformers' last_hidden_state), the first
and the last of them; Pooler adds a request's chunks up and, when the last prompt token is
in, makes the embedding:

  last   the last prompt token's hidden state (decoder embedding models: e5-mistral, Qwen3
         embeddings, gte-Qwen2)
  mean   the mean over the prompt's tokens (sentence-transformers' mean pooling)
  cls    the first token's
then, when `dimensions` is set (Matryoshka models), the first `dimensions` values, and with
`normalize` the result divided by its L2 norm.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

POOLING_TYPES = ("last", "mean", "cls")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """How a request's hidden states become its embedding (vLLM's PoolingParams)."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")  # noqa: TRY004 - ValueError for every bad field (the API)
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


def sentence_transformers_pooling(model_dir: str | Path) -> PoolingParams | None:
    """The pooling a sentence-transformers model directory names (modules.json's Pooling
    module and its config; a Normalize module turns normalize on), or None when it names
    none. Raises ValueError for a pooling mode this module does not have."""
    root = Path(model_dir)
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    if "Pooling" not in kinds:
        return None
    config = json.loads((root / kinds["Pooling"] / "config.json").read_text())
    modes = {
        "pooling_mode_lasttoken": "last",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_cls_token": "cls",
    }
    chosen = [kind for key, kind in modes.items() if config.get(key)]
    others = [
        k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in modes
    ]
    if others or len(chosen) != 1:
        raise ValueError(
            f"{root / kinds['Pooling'] / 'config.json'}: pooling {others or chosen or 'none'} "
            f"is not supported; supported: exactly one of {', '.join(modes)}"
        )
    return PoolingParams(pooling_type=chosen[0], normalize="Normalize" in kinds)


class Pooler:
    """One embedding request's running sums over the chunks of its prompt."""

    def __init__(self, params: PoolingParams, num_prompt_tokens: int, hidden_size: int) -> None:
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValueError(
                f"dimensions ({params.dimensions}) must be at most the model's hidden size "
                f"({hidden_size})"
            )
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self._sum = np.zeros(hidden_size, np.float64)
        self._first: np.ndarray | None = None
        self._position = 0  # prompt tokens added so far
        self.embedding: np.ndarray | None = None  # float32[dimensions or hidden], when done

    def add(self, start: int, num_tokens: int, pooled: np.ndarray) -> None:
        """Adds a step's chunk of the prompt: tokens start .. start + num_tokens - 1, pooled
        float32[3, hidden] (their hidden states' sum, the first's, the last's). A chunk from
        position 0 starts over (a preempted request recomputed); one already added is not
        added again."""
        if start == 0:
            self._sum[:] = 0
            self._position = 0
            self._first = pooled[1].copy()
        if start != self._position or self.embedding is not None:
            return
        self._sum += pooled[0]
        self._position += num_tokens
        if self._position < self.num_prompt_tokens:
            return
        kind = self.params.pooling_type
        if kind == "last":
            vector = pooled[2].astype(np.float64)
        elif kind == "mean":
            vector = self._sum / self.num_prompt_tokens
        else:
            vector = self._first.astype(np.float64)
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        if self.params.normalize:
            vector = vector / max(np.linalg.norm(vector), 1e-12)
        self.embedding = vector.astype(np.float32)
