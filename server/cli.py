"""`jpaged serve` and `jpaged client`: argparse subcommands for the main CLI.

    parser = argparse.ArgumentParser(prog="jpaged")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub); add_client_parser(sub)
    args = parser.parse_args(); sys.exit(args.func(args))

Each subparser sets `func`, which takes the parsed args and returns an exit code. Flags are
parsed here and nowhere below: the server gets a ServerOptions and an engine.
"""

from __future__ import annotations

import argparse
import sys

from jpaged.cli import add_engine_flags, engine_kwargs
from server.app import ServerOptions, add_server_args, configure_logging, run


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve the gRPC generation API",
        description="Serve jpaged.v1.Generation (plus Health and reflection) over gRPC.",
    )
    add_engine_flags(p)
    hosts = p.add_argument_group("multi-host: jax.distributed.initialize, process 0 serves")
    hosts.add_argument("--coordinator", default=None, help="ADDR:PORT of process 0's coordinator")
    hosts.add_argument("--num-processes", type=int, default=None)
    hosts.add_argument("--process-id", type=int, default=None)
    add_server_args(p)
    p.set_defaults(func=serve_main)
    return p


def serve_main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    options = ServerOptions.from_args(args)
    if args.coordinator is not None or args.num_processes is not None:
        from jpaged.multihost import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    from jpaged.engine import LLMEngine

    engine = LLMEngine.from_args(model=args.model, **engine_kwargs(args))
    if jax.process_count() == 1:
        return run(engine, options, model_name=args.model or "demo")
    if jax.process_index() != 0:  # one model over all processes; only process 0 serves
        engine.runner.follow()
        return 0
    try:
        return run(engine, options, model_name=args.model or "demo")
    finally:
        engine.runner.stop_followers()


def add_client_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "client",
        help="send one prompt to a jpaged server",
        description="Send one Generate request and print the completion(s).",
    )
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--request-id", default=None)
    p.add_argument("--cache-salt", default=None)
    s = p.add_argument_group("sampling")
    s.add_argument("-n", type=int, default=None)
    for name, kind in (
        ("temperature", float),
        ("top-p", float),
        ("top-k", int),
        ("min-p", float),
        ("presence-penalty", float),
        ("frequency-penalty", float),
        ("repetition-penalty", float),
        ("seed", int),
        ("max-tokens", int),
        ("min-tokens", int),
        ("logprobs", int),
    ):
        s.add_argument(f"--{name}", type=kind, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=[],
        dest="stop_token_ids",
        help="stop token id (repeatable)",
    )
    for name in ("ignore-eos", "include-stop-str-in-output", "skip-special-tokens"):
        s.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(func=client_main)
    return p


def client_main(args: argparse.Namespace) -> int:
    import grpc

    from server.proto.jpaged.v1 import generation_pb2 as pb
    from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc

    sampling = pb.SamplingParameters(stop=args.stop, stop_token_ids=args.stop_token_ids)
    for field in pb.SamplingParameters.DESCRIPTOR.fields:
        if not field.is_repeated and getattr(args, field.name, None) is not None:
            setattr(sampling, field.name, getattr(args, field.name))
    request = pb.GenerateRequest(text=args.prompt, sampling=sampling)
    if args.request_id is not None:
        request.request_id = args.request_id
    if args.cache_salt is not None:
        request.cache_salt = args.cache_salt
    texts: dict[int, list[str]] = {}
    final = None
    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(request, timeout=args.timeout):
                for c in msg.choices:
                    texts.setdefault(c.index, []).append(c.text)
                    if args.stream and (args.n or 1) == 1:
                        print(c.text, end="", flush=True)
                    elif args.stream and c.text:  # several choices: one line per delta
                        print(f"[{c.index}] {c.text!r}", flush=True)
                if msg.finished:
                    final = msg
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.stream:
        print()
    else:
        for index in sorted(texts):
            if len(texts) > 1:
                print(f"--- choice {index}")
            print("".join(texts[index]))
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
