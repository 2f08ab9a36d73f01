"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), on the same EngineLoop as gRPC.

Routes: GET /v1/models, /v1/models/{id}; POST /v1/embeddings (server/openai_embeddings.py),
/v1/completions, /v1/chat/completions
(streamed as server-sent events when stream=true; tools and tool_choice: server/tool_calls.py);
POST /v1/responses, GET and DELETE /v1/responses/{id} (the Responses API, run as a chat:
server/responses_api.py);
POST /tokenize, /detokenize, GET /tokenizer_info (vLLM's); GET /health (200 serving, 503 while warming up or
draining); GET /metrics (the server's Prometheus registry). With an API key, /v1/*,
/tokenize and /detokenize need `Authorization: Bearer KEY` (server/auth.py).

A call's life: the body is checked (openai_protocol), one engine request per prompt is
submitted with a `prepare` that tokenizes or renders the chat and fits max_tokens on the
engine thread, and the handler waits until the engine accepted or refused every prompt, so a
bad request is a 400 and never a half-started stream. It then streams or collects. Whatever
way a call ends (finished, client gone, error), its `finally` releases the handles: an
unfinished request is aborted and its pages are free after the next engine step. A client
that disconnects is noticed by Starlette while streaming and by a watcher task otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

import pydantic
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import openai_embeddings
from server import openai_protocol as proto
from server.auth import bearer_matches
from server.engine_loop import (
    Draining,
    DuplicateRequestId,
    EngineLoop,
    Overloaded,
    new_request_id,
)
from server.lora_api import LoRAAdapters
from server.metrics import Metrics, outcome_of, record_rejection, record_request
from server.openai_embeddings import EmbeddingRequest
from server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from server.openai_responses import DONE, Assembler, sse
from server.prompt_plans import PromptPlan, chat_renderer, completion_renderer
from server.prompt_scores import PromptScores
from server.reasoning_parsers import Reasoning, ReasoningPromptPlan, get_parser
from server.tokenizer_info import tokenizer_config
from server.tool_calls import ToolPlan, plan_tools
from server.tool_prompts import tool_prompt

logger = logging.getLogger("jpaged.server")

RETRY_AFTER_S = 1  # what a 429 asks the client to wait


class OpenAIServer:
    """The HTTP API's handlers; `app` is the FastAPI application."""

    def __init__(
        self,
        loop: EngineLoop,
        *,
        model_name: str,
        metrics: Metrics | None = None,
        max_n: int = 64,
        sampling_defaults: dict | None = None,
        api_key: str | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
        state: Callable[[], str] = lambda: "serving",
        adapters: LoRAAdapters | None = None,
    ) -> None:
        self._loop = loop
        self._model_name = model_name
        self._metrics = metrics
        self._max_n = max_n
        self._defaults = dict(sampling_defaults or {})
        self._api_key = api_key
        self._chat_template = chat_template
        self._tool_call_parser = tool_call_parser
        self._auto_tools = enable_auto_tool_choice
        self._state = state  # "warming_up", "serving" or "draining"
        self._vocab_size = int(loop.engine.model_config.vocab_size)
        self._max_model_len = int(loop.engine.max_model_len)
        self._created = int(time.time())
        # LoRA adapters by name (server/lora_api.py): the `model` field may name one.
        self.adapters = adapters or LoRAAdapters(loop, base_name=model_name)
        # --reasoning-parser: chats' (and responses') text split into reasoning and content
        self._reasoning = None if reasoning_parser is None else get_parser(reasoning_parser)
        self.app = self._make_app()

    def add_v1_routes(self, add: Callable[[APIRouter], None]) -> None:
        """Routes another module serves under /v1, behind the same API key: the Responses
        API (server/responses_api.py builds on this module's call flow, so server/app.py,
        above both, adds it)."""
        router = APIRouter(prefix="/v1", dependencies=[Depends(self._check_key)])
        add(router)
        self.app.include_router(router)

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="jpaged", docs_url=None, redoc_url=None, openapi_url=None)
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self._check_key)])
        v1.add_api_route("/models", self.list_models, methods=["GET"])
        v1.add_api_route("/models/{model_id:path}", self.get_model, methods=["GET"])
        v1.add_api_route("/completions", self.completions, methods=["POST"])
        v1.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        v1.add_api_route("/embeddings", self.embeddings, methods=["POST"])
        self.adapters.add_routes(v1)
        app.include_router(v1)
        app.add_api_route(
            "/tokenize", self.tokenize, methods=["POST"], dependencies=[Depends(self._check_key)]
        )
        app.add_api_route(
            "/detokenize",
            self.detokenize,
            methods=["POST"],
            dependencies=[Depends(self._check_key)],
        )
        app.add_api_route(
            "/tokenizer_info",
            self.tokenizer_info,
            methods=["GET"],
            dependencies=[Depends(self._check_key)],
        )
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_exception_handler(APIError, _api_error)
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)
        return app

    # ---- small routes -------------------------------------------------------------------

    async def _check_key(self, request: Request) -> None:
        if self._api_key is None:
            return
        if not bearer_matches(request.headers.get("authorization"), self._api_key):
            error = APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
            record_rejection(self._metrics, "unauthenticated", error, path=request.url.path)
            raise error

    def _model_card(self) -> dict:
        return {
            "id": self._model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "jpaged",
            "root": self._model_name,
            "parent": None,
            "max_model_len": self._max_model_len,
        }

    async def list_models(self) -> dict:
        loras = self.adapters.cards(self._max_model_len)
        return {"object": "list", "data": [self._model_card(), *loras]}

    async def get_model(self, model_id: str) -> dict:
        if self._check_model(model_id) is None:
            return self._model_card()
        return next(c for c in self.adapters.cards(self._max_model_len) if c["id"] == model_id)

    async def health(self) -> JSONResponse:
        state = self._state()
        return JSONResponse({"status": state}, status_code=200 if state == "serving" else 503)

    async def metrics(self) -> Response:
        body = self._metrics.render() if self._metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _check_model(self, model: str | None):
        """The LoRARequest of the adapter `model` names, None for the base model; an unknown
        model is an APIError 404 (model_not_found)."""
        return self.adapters.request_for(model)

    async def _validation_error(self, request: Request, exc: RequestValidationError):
        error = proto.from_validation_errors(list(exc.errors()))
        record_rejection(
            self._metrics, "invalid_argument", error, request_id=_request_id(request, "req")
        )
        return await _api_error(request, error)

    # ---- tokenize -----------------------------------------------------------------------

    async def tokenize(self, request: Request) -> dict:
        """vLLM's /tokenize: a prompt's or a conversation's token ids (the chat as
        /v1/chat/completions renders it, tools included); token_strs (return_token_strs)
        are the tokenizer's own token strings."""
        body = await _parsed(request, lambda d: TokenizeChatRequest if "messages" in d
                             else TokenizeRequest)  # fmt: skip
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            proto.check_template_kwargs(body)
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            prompt = tool_prompt(self._template(body), tools, self._tool_call_parser)
            render = chat_renderer(body, self._chat_template, tools=tools, prompt=prompt)
            # rendered as a chat is, in a worker thread (a template's error is a 400 there)
            ids = (await asyncio.to_thread(render, self._loop.engine))[1]
        else:
            prompt, special = body.prompt, body.add_special_tokens

            def run(engine) -> list[int]:
                if engine.tokenizer is None:
                    raise APIError(400, "the model has no tokenizer", param="prompt")
                if special:
                    return list(engine.tokenizer.encode(prompt))
                return list(engine.tokenizer.encode(prompt, add_special_tokens=False))

            try:
                ids = await self._loop.call(run)
            except ValueError as e:
                raise _as_api_error(e) from None

        def strs(engine) -> list[str]:
            backend = getattr(engine.tokenizer, "backend", None)
            if backend is None:
                return [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
            return [backend.id_to_token(t) for t in ids]

        token_strs = await self._loop.call(strs) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self._max_model_len, "tokens": ids,
                "token_strs": token_strs}  # fmt: skip

    async def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's configuration, as its tokenizer_config.json
        names it (server/tokenizer_info.py)."""
        info = tokenizer_config(self._loop.engine, self._chat_template, self._max_model_len)
        if info is None:
            raise APIError(404, "the model has no tokenizer", code="not_found")
        return info

    async def detokenize(self, request: Request) -> dict:
        """vLLM's /detokenize: token ids -> text (special tokens kept)."""
        body = await _parsed(request, lambda d: DetokenizeRequest)
        self._check_model(body.model)
        for i, t in enumerate(body.tokens):
            if not 0 <= t < self._vocab_size:
                raise APIError(
                    400,
                    f"tokens[{i}] = {t} is out of range [0, {self._vocab_size})",
                    param="tokens",
                )
        ids = list(body.tokens)

        def run(engine) -> str:
            if engine.tokenizer is None:
                raise APIError(400, "the model has no tokenizer", param="tokens")
            return engine.tokenizer.decode(ids, skip_special_tokens=False)

        return {"prompt": await self._loop.call(run)}

    # ---- embeddings ---------------------------------------------------------------------

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> JSONResponse:
        """OpenAI's /v1/embeddings (server/openai_embeddings.py)."""
        rid = _request_id(request, "embd")
        if self._check_model(body.model) is not None:
            raise APIError(400, "embeddings of a LoRA adapter are not supported", param="model")
        try:
            result = await openai_embeddings.embeddings(
                self._loop, body, request_id=rid, model_name=self._model_name
            )
        except (Overloaded, Draining, DuplicateRequestId) as e:
            raise _as_api_error(e) from None
        return JSONResponse(result, headers={"x-request-id": rid})

    # ---- completions --------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        rid = _request_id(request, "cmpl")
        try:
            lora = self._check_model(body.model)
            params = self._params(body)
            plans = [
                self._plan(completion_renderer(p, echo=body.echo), params, body, "prompt")
                for p in proto.prompts_of(body)
            ]
        except APIError as e:
            self._reject(rid, e)
            raise
        return await self._run("completion", rid, body, plans, request, lora=lora)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        rid = _request_id(request, "chatcmpl")
        try:
            lora = self._check_model(body.model)
            tools, plans = await self._chat_plans(body)
        except APIError as e:
            self._reject(rid, e)
            raise
        return await self._run("chat", rid, body, plans, request, tool_plan=tools, lora=lora)

    async def _chat_plans(
        self, body: ChatCompletionRequest
    ) -> tuple[ToolPlan, list[PromptPlan]]:
        """A chat's tool plan and its prompt plan, the prompt rendered and tokenized in a
        worker thread: a conversation that cannot be rendered is an APIError(400) here and
        never reaches the engine thread. Raises APIError naming the field."""
        tools = plan_tools(body, parser_name=self._tool_call_parser, template=self._template(body))
        params = self._params(body, tool_constraint=tools.constraint)
        render = chat_renderer(
            body, self._chat_template, tools=tools.tools, prompt=tools.prompt
        )
        plan = self._plan(render, params, body, "messages")
        await asyncio.to_thread(plan.render_now, self._loop.engine)
        return tools, [plan]

    def _template(self, body) -> str | None:
        """The chat template a request renders with: its own, the server's, the model's."""
        return (
            body.chat_template
            or self._chat_template
            or getattr(self._loop.engine, "chat_template", None)
        )

    def _params(self, body, tool_constraint=None):
        return proto.to_sampling_params(
            body,
            defaults=self._defaults,
            max_n=self._max_n,
            vocab_size=self._vocab_size,
            tool_constraint=tool_constraint,
        )

    def _plan(self, render, params, body, where: str) -> PromptPlan:
        kwargs = {
            "default_max_tokens": self._defaults.get("max_tokens"),
            "where": where,
            "max_tokens_field": body.requested_max_tokens()[1],
        }
        if where == "messages" and self._reasoning is not None:  # a chat of a reasoning model
            return ReasoningPromptPlan(render, params, parser=self._reasoning, **kwargs)
        return PromptPlan(render, params, **kwargs)

    @staticmethod
    def _reasoning_of(plan: PromptPlan) -> Reasoning | None:
        """How a rendered chat's output splits into reasoning and content (None: a server
        without --reasoning-parser, or not a chat)."""
        return plan.reasoning if isinstance(plan, ReasoningPromptPlan) else None

    async def _run(
        self, kind: str, rid: str, body, plans: list[PromptPlan], request, tool_plan=None,
        lora=None,
    ):
        start = time.monotonic()
        handles = await self._submit(rid, body, plans, lora=lora)
        echo = [p.prompt_text for p in plans] if getattr(body, "echo", False) else None
        options = body.stream_options or proto.StreamOptions()
        assembler = PromptScores if proto.scores_prompt_only(body) else Assembler
        asm = assembler(
            kind,
            rid,
            self._model_name if lora is None else lora.lora_name,
            handles,
            echo_texts=echo,
            num_logprobs=plans[0].params.logprobs,
            prompt_logprobs=getattr(body, "prompt_logprobs", None),
            return_token_ids=body.return_token_ids,
            include_usage=options.include_usage,
            continuous_usage=options.continuous_usage_stats,
            tool_plan=tool_plan,
            reasoning=self._reasoning_of(plans[0]),
        )
        call = _Call(asm, start)
        headers = {"x-request-id": rid}
        if body.stream:
            return _EventStream(self._stream(call), lambda: self._finish(call), headers=headers)
        try:
            gone = await self._collected(call, request)
            if gone is not None:
                return gone
            deltas = asm.take()
            texts = await self._token_texts(asm.ids_to_decode(deltas))
            return JSONResponse(asm.response(deltas, texts), headers=headers)
        finally:
            self._finish(call)

    async def _submit(self, rid: str, body, plans: list[PromptPlan], *, lora=None):
        """Submits every prompt (on the LoRA adapter lora, None: the base model; in the
        session body.session_key() names) and waits until the engine took or refused each."""
        handles = []
        shared = asyncio.Event()  # one wake-up for all the call's handles
        try:
            for i, plan in enumerate(plans):
                client_id = rid if len(plans) == 1 else f"{rid}-{i}"
                handles.append(
                    self._loop.submit(
                        client_id,
                        None,
                        plan.params,
                        body.cache_salt,
                        prepare=plan.prepare,
                        event=shared,
                        lora_request=lora,
                        session=body.session_key(),
                    )
                )
            while not all(h.accepted or h.error is not None for h in handles):
                await shared.wait()
                shared.clear()
            failed = next((h.error for h in handles if h.error is not None), None)
            if failed is not None:
                raise _as_api_error(failed)
        except (Overloaded, Draining, DuplicateRequestId, APIError) as e:
            for h in handles:
                self._loop.release(h)
            error = _as_api_error(e)
            self._reject(rid, error)
            raise error from None
        except BaseException:  # cancelled while waiting: the client went away
            for h in handles:
                self._loop.release(h)
            raise
        return handles

    async def _stream(self, call: _Call):
        asm = call.asm
        event = asm.handles[0].event
        try:
            if asm.kind == "chat":
                yield asm.role_chunks()
            while True:
                deltas = asm.take()
                if deltas:
                    call.saw_deltas(deltas)
                    texts = await self._token_texts(asm.ids_to_decode(deltas))
                    yield asm.chunks(deltas, texts)
                error = next((h.error for h in asm.handles if h.error is not None), None)
                if error is not None:
                    call.outcome = "internal"
                    yield sse(_as_api_error(error).body())
                    break
                if asm.done:
                    call.outcome = _outcome(asm)
                    if asm.include_usage:
                        yield asm.usage_chunk()
                    break
                await event.wait()
                event.clear()
            yield DONE
        finally:
            self._finish(call)

    async def _collected(self, call: _Call, request: Request) -> Response | None:
        """Waits for a non-streamed call: None once every choice finished, a 499 when the
        client left (nobody reads it), APIError(500) when the engine failed."""
        outcome = await self._collect(call, request)
        if outcome == "cancelled":
            return Response(status_code=499)
        if outcome == "internal":
            error = next(h.error for h in call.asm.handles if h.error is not None)
            raise APIError(500, _engine_error_message(error), code="internal_error")
        return None

    async def _collect(self, call: _Call, request: Request) -> str:
        """Waits until every choice finished; returns the outcome."""
        asm = call.asm
        event = asm.handles[0].event
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(request, gone, event))
        try:
            while True:
                if gone.is_set():
                    return "cancelled"
                if any(h.error is not None for h in asm.handles):
                    call.outcome = "internal"
                    return call.outcome
                if all(h.finished or h.aborted for h in asm.handles):
                    call.outcome = _outcome(asm)
                    call.first_token_time = call.first_token_time or time.monotonic()
                    return call.outcome
                await event.wait()
                event.clear()
                if call.first_token_time is None and _num_tokens(asm):
                    call.first_token_time = time.monotonic()
        finally:
            watcher.cancel()

    async def _token_texts(self, ids: set[int]) -> dict[int, str]:
        if not ids:
            return {}
        ordered = sorted(ids)

        def decode(engine) -> list[str]:
            return [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ordered]

        return dict(zip(ordered, await self._loop.call(decode)))

    def _finish(self, call: _Call) -> None:
        if call.finished:
            return
        call.finished = True
        for h in call.asm.handles:
            self._loop.release(h)
        record_request(
            self._metrics,
            call.asm.handles,
            call.outcome,
            call.start,
            call.first_token_time,
            request_id=call.asm.request_id,
            protocol="http",
        )

    def _reject(self, rid: str, error: APIError) -> None:
        outcome = {429: "resource_exhausted", 503: "unavailable"}.get(error.status)
        if outcome is None:
            outcome = "internal" if error.status >= 500 else "invalid_argument"
        record_rejection(self._metrics, outcome, error, request_id=rid, protocol="http")


class _Call:
    """One accepted call's bookkeeping for its log line and metrics."""

    def __init__(self, asm: Assembler, start: float) -> None:
        self.asm = asm
        self.start = start
        self.first_token_time: float | None = None
        self.outcome = "cancelled"  # until it ends otherwise
        self.finished = False

    def saw_deltas(self, deltas) -> None:
        if self.first_token_time is None and any(d.token_ids for d in deltas):
            self.first_token_time = time.monotonic()


class _EventStream(StreamingResponse):
    """Server-sent events; on_close runs however the response ends, even when the client
    left before the first chunk (the body generator's own `finally` never runs then)."""

    def __init__(self, content, on_close: Callable[[], None], headers: dict) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _outcome(asm: Assembler) -> str:
    if any(h.aborted for h in asm.handles):
        return "abort"
    return outcome_of(asm.handles)


def _num_tokens(asm: Assembler) -> int:
    return sum(c.num_tokens for h in asm.handles for c in h.choices)


async def _parsed(request: Request, model_of):
    """The JSON body as the pydantic model model_of(body) names; a 400 otherwise."""
    try:
        data = await request.json()
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body: must be a JSON object")
    try:
        return model_of(data).model_validate(data)
    except pydantic.ValidationError as e:
        raise proto.from_validation_errors(list(e.errors())) from None


async def _watch_disconnect(request: Request, gone: asyncio.Event, wake: asyncio.Event) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            wake.set()
            return


def _request_id(request: Request, prefix: str) -> str:
    given = request.headers.get("x-request-id")
    if given and len(given) <= 256:
        return given
    return f"{prefix}-{new_request_id()}"


def _as_api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, Overloaded):
        return APIError(
            429, str(error), code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(error, Draining):
        return APIError(503, str(error), code="service_unavailable")
    if isinstance(error, DuplicateRequestId):
        return APIError(400, str(error), param=None)
    if isinstance(error, ValueError):
        return proto.invalid(str(error))
    return APIError(500, _engine_error_message(error), code="internal_error")


def _engine_error_message(error: BaseException) -> str:
    return f"engine error: {type(error).__name__}: {error}"


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return await _api_error(request, APIError(exc.status_code, str(exc.detail), code=code))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error in the HTTP API", exc_info=exc)
    return await _api_error(request, APIError(500, f"internal error: {type(exc).__name__}"))


# ---- uvicorn ----------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn in our event loop, leaving SIGTERM/SIGINT to the server's own drain."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """Serves an ASGI app on host:port (0: any free port) in the running event loop."""

    def __init__(self, app, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=2048)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        await self._task
        self._socket.close()
