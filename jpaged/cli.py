"""The `jpaged` command line: generate, batch, and (from server/) serve and client.

Flags are parsed only here, at the edge; everything below takes configs and SamplingParams.
"""

from __future__ import annotations

import argparse
import sys

# Engine flags: the keyword arguments of jpaged.llm.engine_config_from_args, shared by
# generate, batch and serve. Only flags given on the command line are passed on, so the
# engine's defaults stay its own (documented there).
ENGINE_FLAGS = (
    # (flag, type, help)
    ("dtype", str, "bfloat16 or float32 (default: bfloat16 on accelerators, float32 on CPU)"),
    ("seed", int, "engine seed for requests without their own (default 0)"),
    ("page-size", int, "tokens per KV page (default 16)"),
    ("num-pages", int, "KV pages in the pool (default: from the memory budget)"),
    ("kv-cache-memory-bytes", int, "KV-cache budget in bytes"),
    ("kv-memory-fraction", float, "share of free accelerator memory for KV pages (default 0.8)"),
    ("kv-allocation", str, "paged (default) or reserve"),
    ("preemption-mode", str, "recompute (default) or swap: preempted K/V to host memory and back"),
    ("swap-space-bytes", int, "host memory for swap preemption (default 4 GiB)"),
    ("num-swap-pages", int, "host pages for swap preemption (instead of --swap-space-bytes)"),
    ("max-num-seqs", int, "sequences per step (default 32)"),
    ("max-model-len", int, "longest prompt + output (default: the model's, at most 2048)"),
    ("max-num-batched-tokens", int, "tokens per step, the chunked-prefill budget"),
    ("attention-backend", str, "reference, pallas or pallas_interpret (default: best)"),
    ("tensor-parallel-size", int, "devices each replica's weights and KV heads split over"),
    ("data-parallel-size", int, "engine replicas, each on its own tensor-parallel devices"),
    (
        "compilation-cache-dir",
        str,
        "JAX persistent compilation cache: auto (default, ~/.cache/jpaged/xla), a directory, or off",
    ),
)
ENGINE_SWITCHES = (
    # (flag, what it turns on or off)
    ("enable-prefix-caching", "prefix caching (default on)"),
    ("enable-chunked-prefill", "chunked prefill (default on)"),
    ("precompile", "compiling every shape bucket at start-up (default off)"),
    ("async-scheduling", "scheduling the next step while the device runs this one (default on)"),
)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    engine = p.add_argument_group("engine")
    for flag, kind, text in ENGINE_FLAGS:
        engine.add_argument(f"--{flag}", type=kind, default=None, help=text)
    for flag, text in ENGINE_SWITCHES:
        engine.add_argument(
            f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=f"turn {text}"
        )
    engine.add_argument(  # short form of --no-enable-prefix-caching
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help=argparse.SUPPRESS,
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine keyword arguments given on the command line (unset ones are left out)."""
    names = [f.replace("-", "_") for f, *_ in ENGINE_FLAGS + ENGINE_SWITCHES]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument(
        "--request-seed", type=int, default=None, help="per-request seed (reproducible sampling)"
    )
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)


def sampling_params_from_args(args: argparse.Namespace):
    from jpaged.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.request_seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from jpaged.engine import LLMEngine

    params = sampling_params_from_args(args)
    engine = LLMEngine.from_args(model=args.model, **engine_kwargs(args))
    engine.add_request("cli-0", args.prompt, params)
    printed = [0] * params.n
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
            if args.stream and params.n == 1:
                text = out.outputs[0].text
                sys.stdout.write(text[printed[0] :])
                sys.stdout.flush()
                printed[0] = len(text)
    if args.stream and params.n == 1:
        sys.stdout.write("\n")
    else:
        for c in final.outputs:
            prefix = f"[{c.index}] " if params.n > 1 else ""
            print(f"{prefix}{c.text}")
    for c in final.outputs:
        print(
            f"# choice {c.index}: {len(c.token_ids)} tokens, finish_reason={c.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from jpaged.batch import run_batch

    return run_batch(args.input, args.output, model=args.model, engine_kwargs=engine_kwargs(args))


def cmd_convert(args: argparse.Namespace) -> int:
    import time

    from models.orbax_checkpoint import convert_hf_to_orbax

    t0 = time.perf_counter()
    out = convert_hf_to_orbax(args.from_hf, args.out, dtype=args.dtype)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jpaged", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    add_engine_flags(gen)
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    batch = sub.add_parser("batch", help="offline batch inference over a JSONL file")
    batch.add_argument("input", help='JSONL: one {"prompt": ..., sampling params...} per line')
    batch.add_argument("output", help="JSONL of results, in input order")
    add_engine_flags(batch)
    batch.set_defaults(func=cmd_batch)

    conv = sub.add_parser("convert", help="write an Orbax checkpoint of a Hugging Face model")
    conv.add_argument("--from-hf", required=True, help="Hugging Face model directory")
    conv.add_argument("--out", required=True, help="new model directory (Orbax params + config)")
    conv.add_argument("--dtype", default=None, help="stored dtype (default: the platform's)")
    conv.set_defaults(func=cmd_convert)

    try:
        from server.cli import add_client_parser, add_serve_parser
    except ImportError:  # the server package is optional for the offline CLI
        pass
    else:
        add_serve_parser(sub)
        add_client_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"jpaged: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
