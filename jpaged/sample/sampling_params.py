"""Per-request sampling parameters, vLLM-compatible.

A SamplingParams is validated when constructed: every bad value raises a ValueError
that names the field and the allowed range, so nothing invalid reaches the engine.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Sequence

from jpaged.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


def is_greedy(temperature: float) -> bool:
    """The one rule for "greedy": a temperature below _GREEDY_EPS. The host writes 0.0 as the
    temperature of every greedy row (step_plan.sampling_constants), so the device reads greedy
    rows as temperature <= 0 (sampler.greedy_rows) and speculation keeps a seeded row's
    proposals only when it is not greedy (spec_decode.controller.keeps_proposals)."""
    return temperature < _GREEDY_EPS


_FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.Enum):
    """What the engine emits for a request (vLLM's names)."""

    CUMULATIVE = 0  # every step it progresses: everything so far
    DELTA = 1  # every step it progresses: only what is new (text, token ids, logprobs)
    FINAL_ONLY = 2  # once, when it finishes: everything


def _check_int(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004 - ValueError for every bad field (the API)


def _check_float(name: str, value) -> None:
    """A real, finite number (a NaN would pass every range check: NaN < 0 is False)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")  # noqa: TRY004 - ValueError for every bad field (the API)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if abs(value) > _FLOAT32_MAX:  # the device computes in float32
        raise ValueError(f"{name} must be within +-{_FLOAT32_MAX:.3g}, got {value!r}")


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} with ids >= 0 (JSON's string keys accepted) and biases in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r:.60}")  # noqa: TRY004 - ValueError for every bad field (the API)
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(key, bool) or token < 0 or str(token) != str(key).strip():
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        _check_float(f"logit_bias[{token}]", value)
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out or None


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request. Field names and meanings follow vLLM.

    temperature 0 means greedy. top_k -1 (or 0 is rejected) means no limit.
    seed makes the request's samples reproducible, whatever else is in the batch.
    logprobs=N returns the chosen token's and the N best tokens' log-probabilities.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> bias in [-100, 100], added to the logits before
    # sampling (log-probabilities stay the model's).
    logit_bias: dict[int, float] | None = None
    # vLLM's prompt_logprobs=N: for every prompt token after the first, its log-probability
    # and the N most likely tokens at its position (computed during prefill).
    prompt_logprobs: int | None = None
    # A constraint on the output (jpaged.structured_output.StructuredOutputsParams).
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_int("seed", self.seed, allow_none=True)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        _check_int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, Sequence) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, Sequence) or isinstance(self.stop_token_ids, str):
            raise ValueError(  # noqa: TRY004 - ValueError for every bad field (the API)
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        _check_int("logprobs", self.logprobs, allow_none=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")  # noqa: TRY004 - ValueError for every bad field (the API)
        _check_int("prompt_logprobs", self.prompt_logprobs, allow_none=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}"
                )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")  # noqa: TRY004 - ValueError for every bad field (the API)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_sync(self) -> bool:
        """Whether the step after one sampling this request must wait for its token on the
        host (penalties count it; a grammar's mask depends on it)."""
        return self.uses_penalties or self.structured_outputs is not None

    def clone(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(kw_only=True)
class BeamSearchParams:
    """Beam search over the paged cache (page tables fork and drop, caches are not copied).

    Semantics are those of transformers' generate(num_beams=beam_width, do_sample=False):
    a finished beam scores cum_logprob / num_generated_tokens ** length_penalty (the EOS
    that ended it counted); early_stopping is False (stop when no running beam can beat the
    worst kept one at its current length), True (stop once beam_width beams are finished)
    or "never" (with length_penalty > 0, judge running beams at max_tokens).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_float("length_penalty", self.length_penalty)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")  # noqa: TRY004 - ValueError for every bad field (the API)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
