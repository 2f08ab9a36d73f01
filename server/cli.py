"""The `jpaged` command: the offline commands of jpaged/entrypoints/cli.py plus `serve` and `client`.

This is the console script's entry point (pyproject: jpaged = "server.cli:main"): the server
layer sits on top of the engine, so the full command line lives here and jpaged/ never imports
the server. Flags are parsed here and nowhere below: the server gets a ServerOptions and an
engine.
"""

from __future__ import annotations

import argparse
import sys

from jpaged.entrypoints.cli import (
    add_common_flags,
    add_prompt_args,
    add_sampling_flags,
    build_parser,
    make_engine_from_args,
    printable,
    prompt_from_args,
    run,
    sampling_overrides,
)
from jpaged.entrypoints.engine_args import add_engine_flags
from models.demo import SMOLLM2_NAME
from server.logs import configure_logging
from server.options import ServerOptions, add_server_args

# Sequences a server on CPU runs at once unless --max-num-seqs says otherwise, as llama.cpp's
# server and Ollama default to 4 parallel slots: a CPU serves a handful of chats, and its KV
# pool (sized for max_num_seqs x max_model_len, resolve_num_pages) then holds 360 MiB of
# SmolLM2's float32 KV instead of 2,880 MiB for 32 slots (docs/serving.md, "Memory").
CPU_SERVER_MAX_NUM_SEQS = 4


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve the gRPC and the OpenAI-compatible HTTP API",
        description="Serve jpaged.v1.Generation (plus Health and reflection) over gRPC and "
        "the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) over "
        "HTTP, from one engine.",
    )
    add_common_flags(p)
    add_engine_flags(p)
    hosts = p.add_argument_group("multi-host: jax.distributed.initialize, process 0 serves")
    hosts.add_argument("--coordinator", default=None, help="ADDR:PORT of process 0's coordinator")
    hosts.add_argument("--num-processes", type=int, default=None)
    hosts.add_argument("--process-id", type=int, default=None)
    add_server_args(p)
    add_sampling_flags(p, defaults_only=True)
    p.set_defaults(func=serve_main)
    return p


def make_server_engine(args: argparse.Namespace):
    """The engine `jpaged serve` runs: the flags' (make_engine_from_args), with
    CPU_SERVER_MAX_NUM_SEQS slots on CPU unless --max-num-seqs is given."""
    import jax

    num_seqs = CPU_SERVER_MAX_NUM_SEQS if jax.default_backend() == "cpu" else None
    return make_engine_from_args(args, num_seqs=num_seqs)


def serve_main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    options = ServerOptions.from_args(args, sampling_defaults=sampling_overrides(args))
    if args.coordinator is not None or args.num_processes is not None:
        from jpaged.worker.multihost import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    engine = make_server_engine(args)
    model_name = args.served_model_name or args.model or SMOLLM2_NAME
    from server.app import run as run_server  # gRPC, FastAPI, uvicorn: only for serve

    if jax.process_count() == 1:
        return run_server(engine, options, model_name=model_name)
    if jax.process_index() != 0:  # one model over all processes; only process 0 serves
        engine.runner.follow()
        return 0
    try:
        return run_server(engine, options, model_name=model_name)
    finally:
        engine.runner.stop_followers()


def add_client_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "client",
        help="send one prompt to a jpaged server",
        description="Send one Generate request and print the completion(s). Sampling flags "
        "left unset are left to the server's defaults.",
    )
    add_prompt_args(p)
    p.add_argument("--host", default="127.0.0.1", help="server address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default: 50051)")
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--request-id", default=None)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--api-key", default=None, help="the server's API key (or JPAGED_API_KEY)")
    add_common_flags(p)
    add_sampling_flags(p, defaults_only=True)
    p.set_defaults(func=client_main)
    return p


def client_main(args: argparse.Namespace) -> int:
    import os

    import grpc

    from server.proto.jpaged.v1 import generation_pb2 as pb
    from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc

    prompt = prompt_from_args(args)
    given = sampling_overrides(args)
    sampling = pb.SamplingParameters(
        stop=given.pop("stop", []), stop_token_ids=given.pop("stop_token_ids", [])
    )
    for name, value in given.items():
        setattr(sampling, name, value)
    if isinstance(prompt, str):
        request = pb.GenerateRequest(text=prompt, sampling=sampling)
    else:
        request = pb.GenerateRequest(token_ids=prompt, sampling=sampling)
    if args.request_id is not None:
        request.request_id = args.request_id
    if args.cache_salt is not None:
        request.cache_salt = args.cache_salt
    api_key = args.api_key or os.environ.get("JPAGED_API_KEY")
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    n = args.n or 1
    texts: dict[int, list[str]] = {}
    final = None
    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                for c in msg.choices:
                    texts.setdefault(c.index, []).append(c.text)
                    if args.stream and n == 1:
                        print(printable(c.text), end="", flush=True)
                    elif args.stream and c.text:  # several choices: one line per delta
                        print(f"[{c.index}] {printable(c.text)!r}", flush=True)
                if msg.finished:
                    final = msg
        except grpc.RpcError as e:
            print(f"jpaged: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.stream:
        print()
    else:
        for index in sorted(texts):
            if len(texts) > 1:
                print(f"--- choice {index}")
            print(printable("".join(texts[index])))
    if final is not None:
        reasons = ", ".join(
            f"{c.index}:{pb.FinishReason.Name(c.finish_reason)}" for c in final.choices
        )
        u = final.usage
        print(
            f"[request {final.request_id}: {reasons}; prompt {u.prompt_tokens}, "
            f"completion {u.completion_tokens}, cached {u.cached_prompt_tokens} tokens]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser((add_serve_parser, add_client_parser)), argv)


if __name__ == "__main__":
    sys.exit(main())
