"""The jpaged.v1.Generation servicer (grpc.aio), on top of an EngineLoop.

Every request is validated before it reaches the engine thread where that can be done here
(wire-level checks, prompt shape, SamplingParams); the engine validates the rest and its
ValueErrors come back as INVALID_ARGUMENT. A handler that ends for any reason before its
request finished (client cancel, disconnect, deadline, error) aborts the request in its
`finally`, so the engine frees its pages at the next step.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time

import grpc

from jpaged.sample.sampling_params import SamplingParams
from jpaged.structured_output import StructuredOutputsParams
from server import embeddings, grpc_chat, wire
from server.engine_loop import (
    Draining,
    DuplicateRequestId,
    EngineLoop,
    Overloaded,
    RequestHandle,
    new_request_id,
)
from server.metrics import outcome_of, record_rejection, record_request
from server.proto.jpaged.v1 import generation_pb2 as pb

logger = logging.getLogger("jpaged.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
_MAX_REQUEST_ID_LEN = 256
_MAX_SESSION_KEY_LEN = 256  # as the HTTP API's prompt_cache_key and user


class GenerationService:
    def __init__(
        self,
        loop: EngineLoop,
        *,
        model_name: str,
        metrics=None,
        max_n: int = 64,
        sampling_defaults: dict | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        adapters=None,
    ) -> None:
        """adapters: the served LoRA adapters (server/lora_api.py LoRAAdapters), None: none."""
        self._loop = loop
        self._adapters = adapters
        self._chat_template = chat_template
        self._tool_call_parser = tool_call_parser
        self._auto_tools = enable_auto_tool_choice
        self._sampling_defaults = dict(sampling_defaults or {})
        self._metrics = metrics
        self._max_n = max_n
        engine = loop.engine
        self._model_name = model_name
        self._vocab_size = int(engine.model_config.vocab_size)
        self._max_model_len = int(engine.max_model_len)
        self._architecture = str(getattr(engine.model_config, "architecture", ""))
        self._eos_token_ids = [int(t) for t in engine.eos_token_ids]
        # Fixed for the engine's life, so read once (a fake engine's stats may leave them out).
        s = loop.stats
        self._memory = {
            "kv_cache_dtype": str(s.get("kv_cache_dtype", "")),
            "kv_bytes_per_token": int(s.get("kv_bytes_per_token", 0)),
            "weight_bytes": int(s.get("weight_bytes", 0)),
            "quantization": s.get("quantization") or "",
        }

    # ---- Generate -----------------------------------------------------------------------

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        start = time.monotonic()
        client_id = _client_id(request)
        try:
            wire.raise_if_invalid(request)
            prompt, params, salt = self._parse(request)
            session = session_key(request)
        except ValueError as e:
            await self._reject(
                context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", e, client_id
            )
        lora = await self._lora(request, context, client_id)
        fits = None  # max_tokens the client set must fit; a default one stops at the limit
        if request.sampling.HasField("max_tokens"):
            fits = functools.partial(_fits_context, prompt=prompt, params=params)

        def submit() -> RequestHandle:
            return self._loop.submit(
                client_id, prompt, params, salt, prepare=fits, lora_request=lora,
                session=session,
            )  # fmt: skip

        async for message in self._serve(context, client_id, start, submit, _response):
            yield message

    async def Chat(self, request, context: grpc.aio.ServicerContext):
        """A conversation with tools (server/grpc_chat.py), streamed as Generate streams."""
        start = time.monotonic()
        client_id = _client_id(request)
        try:
            wire.raise_if_invalid(request)
            self._check_request_id(request)
            req = grpc_chat.chat_request(request)
            engine = self._loop.engine
            template = req.chat_template or self._chat_template or engine.chat_template
            tools = grpc_chat.plan(req, parser_name=self._tool_call_parser, template=template)
            params = grpc_chat.with_tool_constraint(self._sampling(request.sampling), tools)
            salt = _salt(request)
            session = session_key(request)
            prepare = await grpc_chat.prompt_preparer(
                req, self._chat_template, tools, params,
                max_tokens_set=request.sampling.HasField("max_tokens"), engine=engine,
            )  # fmt: skip
        except ValueError as e:
            await self._reject(
                context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", e, client_id
            )
        lora = await self._lora(request, context, client_id)
        respond = functools.partial(
            _response, response_cls=pb.ChatResponse, read=grpc_chat.ChatReader(tools, params.n)
        )

        def submit() -> RequestHandle:
            return self._loop.submit(
                client_id, None, params, salt, prepare=prepare, lora_request=lora,
                session=session,
            )  # fmt: skip

        async for message in self._serve(context, client_id, start, submit, respond):
            yield message

    async def _lora(self, request, context, client_id: str):
        """The LoRA adapter request.lora_name names (None: unset or the base model's name);
        an unknown name is NOT_FOUND."""
        if not request.HasField("lora_name") or request.lora_name == self._model_name:
            return None
        lora = None if self._adapters is None else self._adapters.find(request.lora_name)
        if lora is None:
            error = LookupError(f"lora_name: no LoRA adapter {request.lora_name!r} is served")
            await self._reject(context, grpc.StatusCode.NOT_FOUND, "not_found", error, client_id)
        return lora

    async def _serve(self, context, client_id: str, start: float, submit, respond):
        """Submits a request and yields respond(handle, final=...) as it progresses."""
        try:
            handle = submit()
        except Overloaded as e:
            await self._reject(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted", e, client_id
            )
        except Draining as e:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "unavailable", e, client_id)
        except DuplicateRequestId as e:
            await self._reject(
                context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", e, client_id
            )

        outcome, first_token_time = "cancelled", None
        try:
            await context.send_initial_metadata((("x-request-id", client_id),))
            while True:
                await handle.wait()
                if handle.error is not None:
                    outcome, code = _error_status(handle.error)
                    await context.abort(code, _error_message(handle.error))
                done = handle.finished or handle.aborted
                message = respond(handle, final=done)
                if first_token_time is None and any(c.num_tokens for c in handle.choices):
                    first_token_time = time.monotonic()
                if done:
                    outcome = "abort" if handle.aborted else outcome_of([handle])
                    yield message
                    return
                if message.choices or message.prompt_logprobs:
                    yield message
        finally:
            self._loop.release(handle)
            record_request(
                self._metrics,
                [handle],
                outcome,
                start,
                first_token_time,
                request_id=handle.client_id,
                protocol="grpc",
            )

    def _parse(self, request) -> tuple[str | list[int], SamplingParams, str | None]:
        self._check_request_id(request)
        which = request.WhichOneof("prompt")
        if which is None:
            raise ValueError("prompt is required: set text or token_ids")
        if which == "text":
            if not request.text:
                raise ValueError("prompt text must not be empty")
            prompt = request.text
        else:
            prompt = list(request.token_ids.ids)
            if not prompt:
                raise ValueError("prompt token_ids must not be empty")
            for i, t in enumerate(prompt):
                if not 0 <= t < self._vocab_size:
                    raise ValueError(
                        f"prompt token_ids[{i}] = {t} is out of range [0, {self._vocab_size})"
                    )
        return prompt, self._sampling(request.sampling), _salt(request)

    @staticmethod
    def _check_request_id(request) -> None:
        if request.HasField("request_id"):
            n = len(request.request_id)
            if not 0 < n <= _MAX_REQUEST_ID_LEN:
                raise ValueError(
                    f"request_id must have 1 to {_MAX_REQUEST_ID_LEN} characters, got {n}"
                )

    def _sampling(self, sampling: pb.SamplingParameters) -> SamplingParams:
        """SamplingParams, with this server's limits: n, token ids in the vocabulary."""
        params = sampling_params_from_proto(sampling, self._sampling_defaults)
        if params.n > self._max_n:
            raise ValueError(f"n must be <= {self._max_n} on this server, got {params.n}")
        for i, t in enumerate(params.stop_token_ids):
            if t >= self._vocab_size:
                raise ValueError(
                    f"stop_token_ids[{i}] = {t} is out of range [0, {self._vocab_size})"
                )
        for t in params.logit_bias or {}:
            if t >= self._vocab_size:
                raise ValueError(f"logit_bias token id {t} is out of range [0, {self._vocab_size})")
        return params

    async def _reject(self, context, code, outcome: str, error: Exception, request_id: str):
        record_rejection(
            self._metrics, outcome, error, request_id=request_id, protocol="grpc", code=code.name
        )
        await context.abort(code, str(error))

    # ---- the small RPCs -----------------------------------------------------------------

    async def Abort(self, request, context):
        try:
            wire.raise_if_invalid(request)
            if not request.request_ids:
                raise ValueError("request_ids must not be empty")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        aborted = self._loop.abort(list(request.request_ids))
        logger.info("abort", extra={"fields": {"request_ids": ",".join(aborted)}})
        return pb.AbortResponse(aborted_request_ids=aborted)

    async def GetModelInfo(self, request, context):
        try:
            wire.raise_if_invalid(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        s = self._loop.stats
        return pb.GetModelInfoResponse(
            model=self._model_name,
            architecture=self._architecture,
            vocab_size=self._vocab_size,
            max_model_len=self._max_model_len,
            eos_token_ids=self._eos_token_ids,
            **self._memory,
            stats=pb.EngineStats(
                **{
                    # the spec_ counts exist only with speculation on
                    f.name: int(s.get(f.name, 0) if f.name.startswith("spec_") else s[f.name])
                    for f in pb.EngineStats.DESCRIPTOR.fields
                }
            ),
        )

    async def Tokenize(self, request, context):
        try:
            wire.raise_if_invalid(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        text = request.text
        ids = await self._loop.call(lambda engine: engine.tokenizer.encode(text))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request, context):
        try:
            wire.raise_if_invalid(request)
            ids = list(request.token_ids)
            for i, t in enumerate(ids):
                if not 0 <= t < self._vocab_size:
                    raise ValueError(
                        f"token_ids[{i}] = {t} is out of range [0, {self._vocab_size})"
                    )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        text = await self._loop.call(lambda engine: engine.tokenizer.decode(ids))
        return pb.DetokenizeResponse(text=text)

    async def Embed(self, request, context):
        """The embeddings of the request's inputs (server/embeddings.py)."""
        client_id = _client_id(request)
        try:
            wire.raise_if_invalid(request)
            items = [
                x.text if x.WhichOneof("input") == "text" else list(x.token_ids.ids)
                for x in request.inputs
            ]
            pooling = embeddings.pooling_for(
                self._loop.engine,
                dimensions=request.dimensions if request.HasField("dimensions") else None,
                normalize=request.normalize if request.HasField("normalize") else None,
            )
        except ValueError as e:
            await self._reject(
                context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", e, client_id
            )
        try:
            vectors, num_tokens = await embeddings.embed(
                self._loop, items, pooling, request_id=client_id
            )
        except (ValueError, DuplicateRequestId) as e:
            await self._reject(
                context, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", e, client_id
            )
        except Overloaded as e:
            await self._reject(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted", e, client_id
            )
        except Draining as e:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "unavailable", e, client_id)
        except embeddings.EngineFailure as e:
            await self._reject(context, grpc.StatusCode.INTERNAL, "internal", e, client_id)
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(values=v) for v in vectors], prompt_tokens=num_tokens
        )


def sampling_params_from_proto(
    msg: pb.SamplingParameters, defaults: dict | None = None
) -> SamplingParams:
    """Set fields become SamplingParams arguments; unset ones take the server's defaults,
    else SamplingParams'.

    Raises the ValueError SamplingParams raises, which names the field.
    """
    kwargs = dict(defaults or {})
    for f in msg.DESCRIPTOR.fields:
        if f.name == "logit_bias":  # a map: {token id: bias}
            if msg.logit_bias:
                kwargs["logit_bias"] = dict(msg.logit_bias)
        elif f.name == "structured_outputs":
            if msg.HasField("structured_outputs"):
                kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
        elif f.is_repeated:
            values = list(getattr(msg, f.name))
            if values:
                kwargs[f.name] = values
        elif msg.HasField(f.name):
            kwargs[f.name] = getattr(msg, f.name)
    return SamplingParams(**kwargs)


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    """The constraint; a ValueError naming the field when none is set or it does not compile
    ("structured_outputs.json_schema: invalid JSON schema: ...")."""
    which = msg.WhichOneof("constraint")
    if which is None:
        raise ValueError(
            "structured_outputs: set one of json_schema, regex, choice, grammar, json_object"
        )
    # Unset whitespace fields stay None: the server's default applies.
    kwargs = {
        name: getattr(msg, name)
        for name in ("disable_any_whitespace", "whitespace_pattern")
        if msg.HasField(name)
    }
    if which == "json_schema":
        kwargs["json"] = msg.json_schema
    elif which == "choice":
        kwargs["choice"] = list(msg.choice.choices)
    else:
        kwargs[which] = getattr(msg, which)
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        if which != "json_schema":
            raise
        # StructuredOutputsParams calls it json; the wire calls it json_schema
        message = re.sub(r"^structured_outputs\.json\b", "structured_outputs.json_schema", str(e))
        raise ValueError(message) from None


def _client_id(request) -> str:
    """The request's id, else a new one (made before anything else, so that a rejection's
    log line names the request too)."""
    given = getattr(request, "request_id", "")
    return given if 0 < len(given) <= _MAX_REQUEST_ID_LEN else new_request_id()


def _salt(request) -> str | None:
    if not request.HasField("cache_salt"):
        return None
    if not request.cache_salt:
        raise ValueError("cache_salt must not be empty when set")
    return request.cache_salt


def session_key(request) -> str | None:
    """The engine's session key of a Generate or Chat request, as HTTP's: prompt_cache_key,
    else user, else None; a set key must have 1 to 256 characters."""
    for field in ("prompt_cache_key", "user"):
        if request.HasField(field):
            n = len(getattr(request, field))
            if not 0 < n <= _MAX_SESSION_KEY_LEN:
                raise ValueError(
                    f"{field} must have 1 to {_MAX_SESSION_KEY_LEN} characters when set, got {n}"
                )
    for field in ("prompt_cache_key", "user"):
        if request.HasField(field):
            return getattr(request, field)
    return None


def _response(
    handle: RequestHandle, *, final: bool, response_cls=pb.GenerateResponse, read=None
) -> pb.GenerateResponse | pb.ChatResponse:
    """The choices' progress since the last message: the engine's deltas as they are, or,
    with read (a grpc_chat.ChatReader, for Chat), each choice's text read into content and
    tool calls, read(delta, text, final, reason) returning the choice's finish reason."""
    msg = response_cls(request_id=handle.client_id, finished=final)
    if handle.prompt_logprobs is not None and not handle.prompt_logprobs_sent:
        handle.prompt_logprobs_sent = True
        ids = handle.prompt_token_ids
        for t, position in zip(ids[1:], handle.prompt_logprobs[1:], strict=True):
            _add_logprob(msg.prompt_logprobs, t, position)
    for c in handle.choices:
        text, token_ids, logprobs = c.take()
        if not (token_ids or text or final):
            continue
        delta = msg.choices.add(index=c.index, token_ids=token_ids)
        reason = (c.finish_reason or ("abort" if handle.aborted else None)) if final else None
        if read is None:
            delta.text = text
        else:
            reason = read(delta, text, final, reason)
        for t, position in zip(token_ids, logprobs):
            _add_logprob(delta.logprobs, t, position)
        if final:
            delta.finish_reason = _FINISH_REASONS.get(reason, pb.FINISH_REASON_UNSPECIFIED)
            if isinstance(c.stop_reason, str):
                delta.stop_string = c.stop_reason
            elif isinstance(c.stop_reason, int):
                delta.stop_token_id = c.stop_reason
            if c.cumulative_logprob is not None:
                delta.cumulative_logprob = c.cumulative_logprob
    if final:
        msg.usage.prompt_tokens = handle.num_prompt_tokens
        msg.usage.completion_tokens = sum(c.num_tokens for c in handle.choices)
        msg.usage.cached_prompt_tokens = handle.num_cached_tokens
    return msg


def _add_logprob(entries, token: int, position: dict[int, float]) -> None:
    """Appends token's TokenLogprob: its logprob and the position's tokens, most likely first."""
    entry = entries.add(token_id=token, logprob=position.get(token, math.nan))
    for top_id, lp in sorted(position.items(), key=lambda kv: -kv[1]):
        entry.top_logprobs.add(token_id=top_id, logprob=lp)


def _fits_context(engine, *, prompt, params) -> tuple[list[int], SamplingParams]:
    """The submit prepare of a Generate (on the step thread): prompt + max_tokens over
    max_model_len is refused (INVALID_ARGUMENT naming the figures), as HTTP refuses it with
    a 400; the offline API instead stops such a request at max_model_len. Returns the
    prompt's token ids, so the engine does not tokenize it again."""
    _, ids = engine.tokenize_prompt(prompt)
    limit = engine.max_model_len
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
        raise ValueError(
            f"max_model_len is {limit} tokens, but the request asks for "
            f"{len(ids) + params.max_tokens} ({len(ids)} in the prompt, {params.max_tokens} "
            "in max_tokens); shorten the prompt or lower max_tokens"
        )
    return ids, params


def _error_status(error: Exception) -> tuple[str, grpc.StatusCode]:
    if isinstance(error, ValueError):
        return "invalid_argument", grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, Draining):
        return "unavailable", grpc.StatusCode.UNAVAILABLE
    return "internal", grpc.StatusCode.INTERNAL


def _error_message(error: Exception) -> str:
    if isinstance(error, (ValueError, Draining)):
        return str(error)
    return f"engine error: {type(error).__name__}: {error}"


def add_to_server(service: GenerationService, server: grpc.aio.Server) -> None:
    """Registers the service, with request parsers that keep wire-level problems for the
    handlers to report as INVALID_ARGUMENT (a parser that raised would give INTERNAL)."""

    def unary(fn, req, resp):
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=wire.parser(req), response_serializer=resp.SerializeToString
        )

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=wire.parser(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": unary(service.Abort, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": unary(
            service.GetModelInfo, pb.GetModelInfoRequest, pb.GetModelInfoResponse
        ),
        "Tokenize": unary(service.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
        "Detokenize": unary(service.Detokenize, pb.DetokenizeRequest, pb.DetokenizeResponse),
        "Embed": unary(service.Embed, pb.EmbedRequest, pb.EmbedResponse),
        "Chat": grpc.unary_stream_rpc_method_handler(
            service.Chat,
            request_deserializer=wire.parser(pb.ChatRequest),
            response_serializer=pb.ChatResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
