"""The API key (--api-key / JPAGED_API_KEY): one check for both protocols.

With a key set, every call to the API must carry `authorization: Bearer KEY` (an HTTP
header, or gRPC metadata); anything else is refused before a handler runs, with 401 /
UNAUTHENTICATED. Health checks (grpc.health.v1.Health, HTTP /health) and /metrics stay open,
as in vLLM, so probes and Prometheus need no secret. Keys are compared in constant time.
"""

from __future__ import annotations

import secrets

import grpc

from server.metrics import Metrics, record_rejection

# gRPC services a client may call without the key.
OPEN_SERVICES = ("grpc.health.v1.Health",)


def bearer_matches(header: str | None, api_key: str) -> bool:
    """Whether an Authorization value is "Bearer <api_key>"."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(
        token.strip().encode(), api_key.encode()
    )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses gRPC calls without the key with UNAUTHENTICATED (health checks excepted)."""

    def __init__(self, api_key: str, metrics: Metrics | None = None) -> None:
        self._api_key = api_key
        self._metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        service = details.method.lstrip("/").rpartition("/")[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        metadata = dict(details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self._api_key):
            return handler
        return _refusal(handler, details.method, self._metrics)


def _refusal(handler: grpc.RpcMethodHandler, method: str, metrics: Metrics | None):
    """A handler of the same streaming kind as handler that aborts with UNAUTHENTICATED."""
    message = "missing or invalid API key: send metadata 'authorization: Bearer <key>'"

    async def deny(request_or_iterator, context):
        record_rejection(metrics, "unauthenticated", ValueError(message), method=method)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request_or_iterator, context):
        await deny(request_or_iterator, context)
        yield  # an async generator, as grpc expects of a response-streaming handler

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        deny_stream if handler.response_streaming else deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
