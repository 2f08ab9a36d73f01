"""Builds and runs the gRPC server: Generation, Health, reflection, metrics, SIGTERM drain.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING and new calls are refused with
UNAVAILABLE at once; requests in flight get `grace_s` to finish; whatever is left is then aborted (its
stream ends with FINISH_REASON_ABORT), the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.engine_loop import EngineLoop
from server.metrics import Metrics
from server.service import SERVICE_NAME, GenerationService, add_to_server

logger = logging.getLogger("jpaged.server")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    host: str = "127.0.0.1"  # loopback: the service has no authentication unless api_key
    port: int = 50051  # 0 picks a free port
    metrics_port: int | None = 9090  # None: no metrics endpoint; 0 picks a free port
    max_waiting: int | None = 1024  # None: no limit
    grace_s: float = 30.0
    max_n: int = 64
    # SamplingParams fields for requests that leave them unset (the serve command's flags).
    sampling_defaults: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, sampling_defaults: dict | None = None
    ) -> ServerOptions:
        return cls(
            host=args.host,
            port=args.port,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            max_waiting=None if args.max_waiting < 0 else args.max_waiting,
            grace_s=args.drain_grace,
            max_n=args.max_n,
            sampling_defaults=dict(sampling_defaults or {}),
        )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address every port listens on (default: 127.0.0.1, this machine only; "
        "0.0.0.0 listens on all interfaces)",
    )
    g.add_argument(
        "--port", type=int, default=50051, help="gRPC port (0: any free port; default: 50051)"
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="Prometheus /metrics port (0: any free port, -1: off; default: 9090)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="waiting requests past which calls get RESOURCE_EXHAUSTED (-1: no limit; "
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
    """One running server. `await start()`, then `await drain()` (or serve() does both)."""

    def __init__(self, engine, options: ServerOptions, *, model_name: str) -> None:
        self.options = options
        self.metrics = Metrics()
        self.engine_loop = EngineLoop(engine, max_waiting=options.max_waiting, metrics=self.metrics)
        self.service = GenerationService(
            self.engine_loop,
            model_name=model_name,
            metrics=self.metrics,
            max_n=options.max_n,
            sampling_defaults=options.sampling_defaults,
        )
        self.health = health.aio.HealthServicer()
        self.grpc_server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None

    async def start(self) -> None:
        self.engine_loop.start()
        # No per-server limit on concurrent streams: backpressure is max_waiting's job.
        self.grpc_server = grpc.aio.server()
        add_to_server(self.service, self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        address = f"{self.options.host}:{self.options.port}"
        self.port = self.grpc_server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {address}")
        await self.grpc_server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.options.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(
                self.options.metrics_port, self.options.host
            )
        logger.info(
            "serving",
            extra={
                "fields": {
                    "host": self.options.host,
                    "port": self.port,
                    "metrics_port": self.metrics_port,
                }
            },
        )

    async def drain(self, grace_s: float | None = None) -> None:
        """Refuses new calls, gives in-flight requests grace_s, aborts the rest, stops."""
        grace_s = self.options.grace_s if grace_s is None else grace_s
        start = time.monotonic()
        logger.info(
            "draining",
            extra={"fields": {"in_flight": self.engine_loop.num_in_flight(), "grace_s": grace_s}},
        )
        await self.health.enter_graceful_shutdown()
        # The port stays open through the grace period so that every new call gets a clean
        # UNAVAILABLE from the service (stopping grpc first races: a call caught between
        # accept and handler would see CANCELLED instead).
        self.engine_loop.start_draining()
        try:
            await asyncio.wait_for(self.engine_loop.wait_idle(), grace_s)
        except TimeoutError:
            aborted = self.engine_loop.abort_all()
            logger.info("grace period over", extra={"fields": {"aborted": len(aborted)}})
        # Every stream has ended (or been told to) by now; grpc's grace is only a backstop.
        await self.grpc_server.stop(5)
        await self.engine_loop.stop()
        self.metrics.stop_http()
        logger.info("stopped", extra={"fields": {"drain_s": round(time.monotonic() - start, 3)}})


async def serve(engine, options: ServerOptions, *, model_name: str) -> None:
    """Runs until SIGTERM or SIGINT, then drains."""
    server = Server(engine, options, model_name=model_name)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.drain()


def run(engine, options: ServerOptions, *, model_name: str) -> int:
    asyncio.run(serve(engine, options, model_name=model_name))
    return 0


def configure_logging(level: str = "INFO", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _record_fields(record: logging.LogRecord) -> dict:
    fields = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname,
        "logger": record.name,
        "msg": record.getMessage(),
    }
    fields.update(getattr(record, "fields", {}))
    if record.exc_info:
        fields["exc"] = logging.Formatter().formatException(record.exc_info)
    return fields


class LogfmtFormatter(logging.Formatter):
    """key=value lines; the `fields` dict passed as `extra` becomes keys (e.g. request_id)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, value in _record_fields(record).items():
            text = "" if value is None else str(value)
            if not text or any(ch in text for ch in ' ="\n'):
                text = json.dumps(text)
            parts.append(f"{key}={text}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_record_fields(record), default=str)
