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

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import pathlib
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.auth import ApiKeyInterceptor
from server.engine_loop import EngineLoop
from server.metrics import Metrics
from server.openai_api import HttpServer, OpenAIServer
from server.service import SERVICE_NAME, GenerationService, add_to_server

logger = logging.getLogger("jpaged.server")

# Prompt length the warm-up compiles for (engine.warm_up's context_len).
WARM_UP_CONTEXT_LEN = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """Ports: 0 picks a free port, None turns the listener off."""

    host: str = "127.0.0.1"  # loopback: only this machine can connect
    port: int | None = 50051  # gRPC
    http_port: int | None = 8000  # the OpenAI-compatible API
    metrics_port: int | None = 9090  # Prometheus (also /metrics on the HTTP port)
    max_waiting: int | None = 1024  # None: no limit
    grace_s: float = 30.0
    max_n: int = 64
    api_key: str | None = None  # required on every API call when set
    chat_template: str | None = None  # Jinja text; None: the model's own
    # SamplingParams fields for requests that leave them unset (the serve command's flags).
    sampling_defaults: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("port", "http_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535] or off, got {value}")
        if self.port is None and self.http_port is None:
            raise ValueError("port and http_port are both off: nothing would serve requests")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, sampling_defaults: dict | None = None
    ) -> ServerOptions:
        return cls(
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            max_waiting=None if args.max_waiting < 0 else args.max_waiting,
            grace_s=args.drain_grace,
            max_n=args.max_n,
            api_key=args.api_key or os.environ.get("JPAGED_API_KEY") or None,
            chat_template=read_chat_template(args.chat_template),
            sampling_defaults=dict(sampling_defaults or {}),
        )


def port_arg(text: str) -> int | None:
    """A port flag's value: a number (0: any free port), or "off" / -1 for no listener."""
    if text.strip().lower() in ("off", "-1"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or off, got {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535] or off, got {value}")
    return value


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself (text with Jinja tags)."""
    if value is None:
        return None
    path = pathlib.Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(2, "chat template file not found", value)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server (ports: 0 = any free port, off = no listener)")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address every port listens on (default: 127.0.0.1, this machine only; "
        "0.0.0.0 listens on all interfaces: set --api-key then)",
    )
    g.add_argument(
        "--port", type=port_arg, default=50051, help="gRPC port (0: any free port; default: 50051)"
    )
    g.add_argument(
        "--http-port",
        type=port_arg,
        default=8000,
        help="OpenAI-compatible HTTP API port (0: any free port, off: none; default: 8000)",
    )
    g.add_argument(
        "--metrics-port",
        type=port_arg,
        default=9090,
        help="Prometheus /metrics port, also served on the HTTP port (0: any free port, "
        "off or -1: none; default: 9090)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every HTTP /v1 call and gRPC call except "
        "health checks (default: $JPAGED_API_KEY, else none)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the HTTP API (default: --model as given)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="chat template for /v1/chat/completions: a Jinja file or the template text "
        "(default: the model's own)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="waiting requests past which calls get RESOURCE_EXHAUSTED / 429 (-1: no limit; "
        "default: 1024)",
    )
    g.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: 30)",
    )
    g.add_argument(
        "--max-n", type=int, default=64, help="largest n a request may ask for (default: 64)"
    )
    g.add_argument("--log-level", default="INFO", help="(default: INFO)")
    g.add_argument(
        "--log-format", choices=("logfmt", "json"), default="logfmt", help="(default: logfmt)"
    )


class Server:
    """One running server. `await start()` (listen, then warm up), then `await drain()`."""

    def __init__(self, engine, options: ServerOptions, *, model_name: str) -> None:
        self.options = options
        self.metrics = Metrics()
        self.engine_loop = EngineLoop(engine, max_waiting=options.max_waiting, metrics=self.metrics)
        # The serve command's sampling flags over the model's own defaults.
        defaults = {**getattr(engine, "sampling_defaults", {}), **options.sampling_defaults}
        self.service = GenerationService(
            self.engine_loop,
            model_name=model_name,
            metrics=self.metrics,
            max_n=options.max_n,
            sampling_defaults=defaults,
        )
        self.openai = OpenAIServer(
            self.engine_loop,
            model_name=model_name,
            metrics=self.metrics,
            max_n=options.max_n,
            sampling_defaults=defaults,
            api_key=options.api_key,
            chat_template=options.chat_template,
            state=lambda: self.state,
        )
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
