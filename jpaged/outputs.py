"""Results handed to users, vLLM-compatible.

RequestOutput holds one request's prompt and its n completions; the engine returns a fresh
snapshot (cumulative, not a delta) every step a request makes progress.
"""

from __future__ import annotations

import dataclasses

# One position's log-probabilities: token id -> logprob (the chosen token and the top N).
PositionLogprobs = dict[int, float]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # prompt_logprobs=N: None for the first prompt token, then each token's {id: logprob}
    # with the N most likely at its position (complete in the first output that has it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None  # why a choice ended with finish_reason "error"
    # An embedding request's embedding (jpaged/pooling.py), in its finished output.
    embedding: list[float] | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]  # [dimensions or hidden_size]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape: output.outputs.embedding)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
