"""What `jpaged serve` is told: ServerOptions and the flags that make them (kept apart from
server.app, which imports gRPC, FastAPI and uvicorn, so that the command line's other
commands do not load them: 30-40 MiB of a `jpaged generate`'s RSS)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib

# server/tool_parsers.py's PARSERS (named here so that the command line imports no more)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# server/reasoning_parsers.py's PARSERS (named here for the same reason)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


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
    # The format tool calls are parsed from (server/tool_parsers.py); None: the one the chat
    # template's own tool syntax names (server/tool_prompts.py).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False  # vLLM's flag, accepted: "auto" needs no flag here
    # The format a reasoning model's output is split by into reasoning and content
    # (server/reasoning_parsers.py); None: all of it is content.
    reasoning_parser: str | None = None
    # /v1/responses: how many ended responses previous_response_id can continue (an LRU)
    responses_store_size: int = 1024
    # SamplingParams fields for requests that leave them unset (the serve command's flags).
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    # LoRA adapters served from the start, (name, PEFT directory) (--lora-modules name=path)
    lora_modules: tuple[tuple[str, str], ...] = ()

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
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if self.responses_store_size < 0:
            raise ValueError(
                f"responses_store_size must be >= 0, got {self.responses_store_size}"
            )

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
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
            responses_store_size=args.responses_store_size,
            sampling_defaults=dict(sampling_defaults or {}),
            lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
        )


def parse_lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """--lora-modules entries name=path -> ((name, path), ...); ValueError naming a bad one."""
    out = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are name=path, got {value!r}")
        out.append((name, path))
    return tuple(out)


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
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the format the model writes tool calls in, read for tool_choice 'auto': hermes "
        "(<tool_call> JSON: Qwen 2.5/3, Hermes), llama3_json (Llama 3.1/3.2 JSON), mistral "
        "([TOOL_CALLS] array) (default: the one the chat template's own tool syntax names, "
        "else hermes)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines and not needed: tool_choice 'auto' always "
        "works here",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reasoning model's <think>...</think> from its answer: message.reasoning "
        "(and reasoning_content) apart from message.content, reasoning deltas when streamed; "
        "tool calls and structured outputs apply after the reasoning. qwen3 (reasoning when "
        "the output or the prompt opens <think>), deepseek_r1 (reasoning until </think>) "
        "(default: none)",
    )
    g.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="/v1/responses: how many ended responses are kept in memory for "
        "previous_response_id and GET /v1/responses/{id}, the least recently used dropped "
        "first (0: none; default: 1024)",
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
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under NAME from the start; needs "
        "--enable-lora (more at run time: POST /v1/load_lora_adapter)",
    )
    g.add_argument("--log-level", default="INFO", help="(default: INFO)")
    g.add_argument(
        "--log-format", choices=("logfmt", "json"), default="logfmt", help="(default: logfmt)"
    )
