"""EngineClient: the interface every engine front implements (LLMEngine, DataParallelEngine,
the server tests' FakeEngine), and the only one the LLM, the batch runner and the server use.

Requests go in with add_request (validated at once: a ValueError names the field) and come
out of step() as RequestOutputs of the kind their SamplingParams.output_kind asks for; a
request reported finished is never reported again, an aborted one never.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from jpaged.outputs import RequestOutput
from jpaged.sample.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    model_config: Any  # vocab_size, architecture ...
    tokenizer: Any  # encode / decode, or None for a model without one
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    chat_template: str | None  # the model's, or None
    sampling_defaults: dict  # the model's sampling defaults (SamplingParams fields)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None: ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...

    def num_waiting(self) -> int: ...

    def num_running(self) -> int: ...

    def stats(self) -> dict: ...

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]: ...

    def chat_prompt(
        self,
        messages,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra,
    ) -> tuple[str, list[int]]: ...
