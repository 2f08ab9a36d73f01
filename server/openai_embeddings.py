"""POST /v1/embeddings in OpenAI's shape (the work: server/embeddings.py).

The input is a string, a list of strings, a list of token ids or a list of those; the answer
is {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage"}. encoding_format "base64" sends each embedding as the base64 of its little-endian
float32 bytes (what the openai client asks for by default and decodes). Bad input is a 400
naming the field.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server import embeddings as core
from server import openai_fields
from server.engine_loop import EngineLoop
from server.openai_protocol import APIError


class EmbeddingRequest(BaseModel):
    """OpenAI's fields (user is one it defines and this server does not use: dropped with a
    log line, server/openai_fields.py), then vLLM's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_unused_openai_fields(cls, data: Any) -> Any:
        return openai_fields.drop_unused(data, "embeddings", cls.model_fields)

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    # vLLM's extra: the pooled vector as it is, or L2-normalised (the model's default).
    normalize: bool | None = None


def inputs_of(req: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, one engine prompt each."""
    value = req.input
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]
    return list(value)


async def embeddings(
    loop: EngineLoop, req: EmbeddingRequest, *, request_id: str, model_name: str
) -> dict:
    """The response body for req; raises APIError for bad input and engine failures, and
    EngineLoop.submit's errors for the caller to map."""
    try:
        pooling = core.pooling_for(loop.engine, dimensions=req.dimensions,
                                   normalize=req.normalize)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param="dimensions") from None
    try:
        vectors, num_tokens = await core.embed(loop, inputs_of(req), pooling,
                                               request_id=request_id)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param="input") from None
    except core.EngineFailure as e:
        raise APIError(500, str(e), code="internal_error") from None
    data = []
    for i, vector in enumerate(vectors):
        if req.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
