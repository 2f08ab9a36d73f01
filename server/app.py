"""Builds and runs the server: gRPC (Generation, Health, reflection), the OpenAI-compatible
HTTP API and Prometheus metrics, all over one EngineLoop, with warm-up and SIGTERM drain.

Start-up: the ports open first with health NOT_SERVING (gRPC) and /health 503; the engine
then warms up (engine.warm_up: the step programs short requests use first, from the
persistent compilation cache when it has them) and only then is health SERVING. Requests
sent during warm-up wait for it. Every port listens on --host, 127.0.0.1 by default.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING and new calls are refused at once
(UNAVAILABLE / 503); requests in flight get `grace_s` to finish; whatever is left is then
aborted (its stream ends with an "abort" finish reason), the listeners and the engine thread
stop and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.auth import ApiKeyInterceptor
from server.engine_loop import EngineLoop
from server.lora_api import LoRAAdapters
from server.metrics import Metrics
from server.openai_api import HttpServer, OpenAIServer
from server.options import ServerOptions, add_server_args, port_arg, read_chat_template  # noqa: F401
from server.responses_api import ResponsesAPI
from server.service import SERVICE_NAME, GenerationService, add_to_server

logger = logging.getLogger("jpaged.server")

# Prompt length the warm-up compiles for (engine.warm_up's context_len).
WARM_UP_CONTEXT_LEN = 64


class Server:
    """One running server. `await start()` (listen, then warm up), then `await drain()`."""

    def __init__(self, engine, options: ServerOptions, *, model_name: str) -> None:
        self.options = options
        self.metrics = Metrics()
        self.engine_loop = EngineLoop(engine, max_waiting=options.max_waiting, metrics=self.metrics)
        # The serve command's sampling flags over the model's own defaults.
        defaults = {**getattr(engine, "sampling_defaults", {}), **options.sampling_defaults}
        # LoRA adapters by name, shared by both APIs (server/lora_api.py)
        self.adapters = LoRAAdapters(self.engine_loop, base_name=model_name)
        self.service = GenerationService(
            self.engine_loop,
            model_name=model_name,
            metrics=self.metrics,
            max_n=options.max_n,
            sampling_defaults=defaults,
            chat_template=options.chat_template,
            tool_call_parser=options.tool_call_parser,
            enable_auto_tool_choice=options.enable_auto_tool_choice,
            adapters=self.adapters,
        )
        self.openai = OpenAIServer(
            self.engine_loop,
            model_name=model_name,
            metrics=self.metrics,
            max_n=options.max_n,
            sampling_defaults=defaults,
            api_key=options.api_key,
            chat_template=options.chat_template,
            tool_call_parser=options.tool_call_parser,
            enable_auto_tool_choice=options.enable_auto_tool_choice,
            reasoning_parser=options.reasoning_parser,
            state=lambda: self.state,
            adapters=self.adapters,
        )
        # /v1/responses: the chat pipeline under OpenAI's Responses shapes, its store here
        self.responses = ResponsesAPI(self.openai, store_size=options.responses_store_size)
        self.openai.add_v1_routes(self.responses.add_routes)
        for name, path in options.lora_modules:  # --lora-modules: before the engine thread
            self.adapters.load_now(name, path)
        self.state = "warming_up"  # then "serving", then "draining"
        self.health = health.aio.HealthServicer()
        self.grpc_server: grpc.aio.Server | None = None
        self.http_server: HttpServer | None = None
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.warm_up_seconds: float | None = None

    async def start(self) -> None:
        await self.listen()
        await self.warm_up()

    async def listen(self) -> None:
        """Opens every port; health says NOT_SERVING until warm_up() is done."""
        self.engine_loop.start()
        host = self.options.host
        if self.options.port is not None:
            await self._start_grpc(host, self.options.port)
        if self.options.http_port is not None:
            self.http_server = HttpServer(self.openai.app, host, self.options.http_port)
            await self.http_server.start()
            self.http_port = self.http_server.port
        if self.options.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(self.options.metrics_port, host)
        logger.info("listening", extra={"fields": self._addresses()})

    async def _start_grpc(self, host: str, port: int) -> None:
        interceptors = []
        if self.options.api_key is not None:
            interceptors.append(ApiKeyInterceptor(self.options.api_key, self.metrics))
        # No per-server limit on concurrent streams: backpressure is max_waiting's job.
        self.grpc_server = grpc.aio.server(interceptors=interceptors)
        add_to_server(self.service, self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        self.port = self.grpc_server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not listen on {host}:{port}")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc_server.start()

    async def warm_up(self) -> None:
        """Compiles what short requests need first, then reports SERVING."""
        try:
            self.warm_up_seconds = await self.engine_loop.call(_warm_up)
        except Exception as e:  # noqa: BLE001 - serving without warm-up beats not serving
            logger.warning(
                "warm-up failed; the first requests compile what they need",
                extra={"fields": {"error": f"{type(e).__name__}: {e}"}},
            )
        if self.state == "warming_up":
            self.state = "serving"
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        stats = self.engine_loop.stats
        fields = {
            **self._addresses(),
            "warm_up_s": None if self.warm_up_seconds is None else round(self.warm_up_seconds, 2),
            "num_compiles": stats.get("num_compiles"),
            "compilation_cache": _compilation_cache_dir(),
        }
        logger.info("serving", extra={"fields": fields})

    def _addresses(self) -> dict:
        return {
            "host": self.options.host,
            "port": self.port,
            "http_port": self.http_port,
            "metrics_port": self.metrics_port,
        }

    async def drain(self, grace_s: float | None = None) -> bool:
        """Refuses new calls, gives in-flight requests grace_s, aborts the rest, stops;
        False when the engine thread did not stop (EngineLoop.stop)."""
        grace_s = self.options.grace_s if grace_s is None else grace_s
        start = time.monotonic()
        self.state = "draining"
        logger.info(
            "draining",
            extra={"fields": {"in_flight": self.engine_loop.num_in_flight(), "grace_s": grace_s}},
        )
        await self.health.enter_graceful_shutdown()
        # The ports stay open through the grace period so that every new call gets a clean
        # UNAVAILABLE / 503 (stopping grpc first races: a call caught between accept and
        # handler would see CANCELLED instead).
        self.engine_loop.start_draining()
        try:
            await asyncio.wait_for(self.engine_loop.wait_idle(), grace_s)
        except TimeoutError:
            aborted = self.engine_loop.abort_all()
            logger.info("grace period over", extra={"fields": {"aborted": len(aborted)}})
            # Aborted handlers end their streams now; give them a moment to send the end.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.engine_loop.wait_idle(), 5)
        # Every stream has ended (or been told to) by now; the servers' graces are backstops.
        if self.grpc_server is not None:
            await self.grpc_server.stop(5)
        if self.http_server is not None:
            await self.http_server.stop()
        stopped = await self.engine_loop.stop()
        self.metrics.stop_http()
        logger.info("stopped", extra={"fields": {"drain_s": round(time.monotonic() - start, 3)}})
        return stopped


def _warm_up(engine) -> float | None:
    """Runs on the engine thread: engine.warm_up where the engine has one. On CPU, whose
    step programs all span max_model_len's page columns, it covers every program a request
    of up to max_model_len tokens reaches: with max_model_len at least the step's token
    budget (2048 and 512 by default) that is every program the server can meet (6 for the
    CPU default of 4 slots), so no chat meets a compile mid-answer. On an accelerator, whose
    programs are bucketed by context too (162 at the defaults), those of short requests."""
    warm_up = getattr(engine, "warm_up", None)
    if warm_up is None:
        return None
    if getattr(engine, "platform", None) == "cpu":
        return warm_up(WARM_UP_CONTEXT_LEN, up_to=engine.config.scheduler.max_model_len)
    return warm_up(WARM_UP_CONTEXT_LEN)


def _compilation_cache_dir() -> str:
    jax = sys.modules.get("jax")  # not imported at all by a server of a fake engine
    return (jax.config.jax_compilation_cache_dir if jax is not None else None) or "off"


async def serve(engine, options: ServerOptions, *, model_name: str) -> bool:
    """Runs until SIGTERM or SIGINT, then drains; False when the engine thread did not stop."""
    server = Server(engine, options, model_name=model_name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.listen()
    warm_up = asyncio.create_task(server.warm_up())
    await stop.wait()
    if not warm_up.done():
        await warm_up  # the engine thread finishes compiling before it can stop
    return await server.drain()


def run(engine, options: ServerOptions, *, model_name: str) -> int:
    """Serves until SIGTERM or SIGINT; the exit status: 0, or 1 when the engine thread was
    stuck (a supervisor should know)."""
    return 0 if asyncio.run(serve(engine, options, model_name=model_name)) else 1
