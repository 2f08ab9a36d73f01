"""Embedding calls on the EngineLoop, for HTTP (openai_embeddings.py) and gRPC (Embed).

One call's inputs (texts or token ids) become one engine request each (jpaged/pooling.py:
a prompt run once, its hidden states pooled), submitted together so they batch; `embed`
waits for all of them and returns the vectors in input order with the prompt tokens they
took. An input that is empty, has ids outside the vocabulary or is longer than the context
(max_model_len less the one token every request takes) is a ValueError naming it and the
limit, before anything runs; whatever way the call ends its requests are released (an
unfinished one is aborted).
"""

from __future__ import annotations

import asyncio
import dataclasses

from jpaged.pooling import PoolingParams
from jpaged.sample.sampling_params import SamplingParams
from server.engine_loop import EngineLoop

_ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


class EngineFailure(Exception):
    """The engine failed an embedding request (not the caller's input)."""


def pooling_for(engine, *, dimensions: int | None, normalize: bool | None) -> PoolingParams:
    """The model's default pooling with a call's dimensions and normalize; ValueError when
    dimensions passes the hidden size."""
    hidden = int(engine.model_config.hidden_size)
    if dimensions is not None and dimensions > hidden:
        raise ValueError(f"dimensions: {dimensions} is more than the model's {hidden} dimensions")
    default = engine.default_pooling
    return dataclasses.replace(
        default,
        dimensions=dimensions,
        normalize=default.normalize if normalize is None else normalize,
    )


async def embed(
    loop: EngineLoop, items: list[str | list[int]], pooling: PoolingParams, *, request_id: str
) -> tuple[list[list[float]], int]:
    """(the embedding of each item, the prompt tokens they took). Raises ValueError for bad
    input (its message names `input[i]`), EngineFailure when the engine failed a request, and
    EngineLoop.submit's Overloaded, Draining and DuplicateRequestId."""
    if not items:
        raise ValueError("input: must not be empty")
    limit = int(loop.engine.max_model_len) - 1
    shared = asyncio.Event()  # one wake-up for all the call's handles
    handles = []
    try:
        for i, item in enumerate(items):

            def prepare(engine, item=item, i=i):
                if not item:
                    raise ValueError(f"input[{i}]: must not be empty")
                ids = item
                if isinstance(item, str):
                    if engine.tokenizer is None:
                        raise ValueError(f"input[{i}] is text but the model has no tokenizer")
                    ids = list(engine.tokenizer.encode(item))
                if len(ids) > limit:
                    raise ValueError(
                        f"input[{i}] has {len(ids)} tokens; the limit is {limit} "
                        f"(max_model_len {limit + 1} less one)"
                    )
                try:
                    engine.tokenize_prompt(ids)  # every id in the vocabulary
                except ValueError as e:
                    raise ValueError(f"input[{i}]: {e}") from None
                return ids, _ONE_TOKEN

            client_id = request_id if len(items) == 1 else f"{request_id}-{i}"
            handle = loop.submit(
                client_id, None, _ONE_TOKEN, None, prepare=prepare, event=shared, pooling=pooling
            )
            handles.append(handle)
        while True:
            failed = next((h for h in handles if h.error is not None), None)
            if failed is not None:
                if isinstance(failed.error, ValueError):
                    raise failed.error
                raise EngineFailure(f"the engine failed: {failed.error}")
            if all(h.finished for h in handles):
                break
            await shared.wait()
            shared.clear()
    finally:
        for h in handles:
            loop.release(h)
    return [h.embedding for h in handles], sum(h.num_prompt_tokens for h in handles)
