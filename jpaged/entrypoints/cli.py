"""The offline command line: generate, batch and convert (server/cli.py adds serve and client,
and is the `jpaged` command's entry point, so that this package never imports the server).

Flags are parsed only here, at the edge; everything below takes configs and SamplingParams.
Engine flags come from the config dataclasses (jpaged/entrypoints/engine_args.py); sampling flags are one
table, shared by generate, batch, client and serve, each showing its default. A user's error
(a bad value, a missing file) ends in one line on stderr, `jpaged: error: ...`, and exit
status 2 (1 for files); `--debug` or JPAGED_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import unicodedata
from collections.abc import Callable, Iterable

from jpaged.entrypoints.engine_args import add_engine_flags, engine_kwargs
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.host_memory import limit_malloc_arenas

# The command line's default for --max-tokens (the Python API's SamplingParams keeps vLLM's 16).
CLI_MAX_TOKENS = 256

# Sampling flags: (SamplingParams field, type, help). Defaults come from SamplingParams,
# except --max-tokens (CLI_MAX_TOKENS).
_SAMPLING_FLAGS = (
    ("n", int, "completions per prompt"),
    ("temperature", float, "0 is greedy"),
    ("top_p", float, "nucleus sampling: smallest set with this probability"),
    ("top_k", int, "sample from the k most likely tokens (-1: all)"),
    ("min_p", float, "drop tokens less likely than min_p x the most likely one"),
    ("presence_penalty", float, "penalty for tokens already generated, in [-2, 2]"),
    ("frequency_penalty", float, "penalty per occurrence in the output, in [-2, 2]"),
    ("repetition_penalty", float, "divides the logits of tokens seen (> 1 discourages)"),
    ("seed", int, "per-request seed: the same tokens whatever else runs (default: random)"),
    ("max_tokens", int, "tokens to generate at most"),
    ("min_tokens", int, "tokens to generate before EOS or a stop token may end the output"),
    ("logprobs", int, "log-probabilities of the sampled token and the N most likely"),
)
_SAMPLING_SWITCHES = (
    ("ignore_eos", "keep generating after EOS"),
    ("include_stop_str_in_output", "keep the stop string that ended the output"),
    ("skip_special_tokens", "leave special tokens out of the text"),
)
SAMPLING_FIELDS = (
    [name for name, *_ in _SAMPLING_FLAGS]
    + [name for name, _ in _SAMPLING_SWITCHES]
    + ["stop", "stop_token_ids"]
)
_DEFAULTS = SamplingParams()


def _default(name: str):
    return CLI_MAX_TOKENS if name == "max_tokens" else getattr(_DEFAULTS, name)


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def add_sampling_flags(p: argparse.ArgumentParser, *, defaults_only: bool = False) -> None:
    """The sampling flags. defaults_only: they set defaults for requests (batch lines, a
    server's requests) that leave a field unset; unset flags are left out."""
    g = p.add_argument_group(
        "sampling (defaults for requests that leave them unset)" if defaults_only else "sampling"
    )
    for name, kind, text in _SAMPLING_FLAGS:
        flags = ["-n", "--n"] if name == "n" else ["--" + name.replace("_", "-")]
        default = _default(name)
        shown = "" if "default" in text else f" (default: {default})"
        g.add_argument(*flags, dest=name, type=kind, default=None, help=text + shown)
    for name, text in _SAMPLING_SWITCHES:
        on_off = "on" if _default(name) else "off"
        g.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{text} (default: {on_off})",
        )
    g.add_argument(
        "--stop", action="append", default=None, help="stop string (repeatable; default: none)"
    )
    g.add_argument(
        "--stop-token-ids",
        type=_int_list,
        default=None,
        help="stop token ids, comma-separated (default: none)",
    )


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampling fields given on the command line (unset ones left out)."""
    return {n: getattr(args, n) for n in SAMPLING_FIELDS if getattr(args, n, None) is not None}


def sampling_params_from_args(
    args: argparse.Namespace, model_defaults: dict | None = None, **extra
) -> SamplingParams:
    """SamplingParams from the flags; where a flag is unset, the model's own sampling
    defaults (its generation config), then the CLI's."""
    values = {
        "max_tokens": CLI_MAX_TOKENS,
        **(model_defaults or {}),
        **sampling_overrides(args),
        **extra,
    }
    return SamplingParams(**values)


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument(
        "--prompt-token-ids",
        type=_int_list,
        default=None,
        help="the prompt as token ids, comma-separated, instead of text (e.g. 1,2,3)",
    )


def prompt_from_args(args: argparse.Namespace) -> str | list[int]:
    if args.prompt is None and args.prompt_token_ids is None:
        raise ValueError('give a prompt: text (jpaged generate "Hello") or --prompt-token-ids')
    if args.prompt is not None and args.prompt_token_ids is not None:
        raise ValueError("give one prompt: either text or --prompt-token-ids, not both")
    return args.prompt if args.prompt is not None else args.prompt_token_ids


def printable(text: str) -> str:
    """text with control and other non-printable characters escaped (\\x07, \\u200b ...);
    newlines and tabs kept."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in "\n\t" or ch.isprintable() or unicodedata.category(ch) == "Zs":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def make_engine_from_args(args: argparse.Namespace, *, num_seqs: int | None = None):
    """The engine the flags describe. num_seqs: the sequences the command runs at once (one
    for chat, n for generate); without --max-num-seqs, the engine gets that many slots, so
    a CPU pool sized for its slots (resolve_num_pages) holds what the command uses and no
    more: one 2048-token sequence of SmolLM2 is 94 MB of float32 KV, 32 are 3 GB."""
    from jpaged.core.parallel import make_engine
    from jpaged.entrypoints.engine_args import engine_config_from_args

    kwargs = engine_kwargs(args)
    if num_seqs is not None and "max_num_seqs" not in kwargs:
        kwargs["max_num_seqs"] = num_seqs
    return make_engine(engine_config_from_args(args.model, **kwargs))


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system message to start the conversation")
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (default: the model's own)",
    )


def chat_template_from_args(args: argparse.Namespace) -> str | None:
    if args.chat_template is None:
        return None
    with open(args.chat_template, encoding="utf-8") as f:
        return f.read()


def cmd_generate(args: argparse.Namespace) -> int:
    from jpaged.sample.sampling_params import RequestOutputKind

    prompt = prompt_from_args(args)
    template = chat_template_from_args(args)
    stream = args.stream and args.output == "text"
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    engine = make_engine_from_args(args, num_seqs=max(1, getattr(args, "n", None) or 1))
    params = sampling_params_from_args(args, engine.sampling_defaults, output_kind=kind)
    if args.chat:
        if not isinstance(prompt, str):
            raise ValueError("--chat takes the question as text, not --prompt-token-ids")
        system = [{"role": "system", "content": args.system}] if args.system else []
        messages = [*system, {"role": "user", "content": prompt}]
        _, prompt = engine.chat_prompt(messages, chat_template=template)
    engine.add_request("cli-0", prompt, params)
    texts: dict[int, list[str]] = {}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
            for c in out.outputs:
                texts.setdefault(c.index, []).append(c.text)
                if stream and params.n == 1:
                    sys.stdout.write(printable(c.text))
                    sys.stdout.flush()
                elif stream and c.text:  # several choices: one line per delta
                    print(f"[{c.index}] {printable(c.text)!r}", flush=True)
    choices = {c.index: c for c in final.outputs}
    if args.output == "json":
        record = {
            "prompt": final.prompt,
            "prompt_token_ids": final.prompt_token_ids,
            "outputs": [
                dataclasses.asdict(choices[i]) | {"text": "".join(texts[i])} for i in sorted(texts)
            ],
        }
        print(json.dumps(record, ensure_ascii=False))
    elif stream and params.n == 1:
        sys.stdout.write("\n")
    elif not stream:
        for i in sorted(texts):
            prefix = f"[{i}] " if params.n > 1 else ""
            print(f"{prefix}{printable(''.join(texts[i]))}")
    for c in final.outputs:
        print(
            f"# choice {c.index}: {len(c.token_ids)} tokens, finish_reason={c.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive chat: each line read is a user turn; the answer streams as it comes.
    /reset starts a new conversation; /exit (or end of input) ends."""
    from jpaged.sample.sampling_params import RequestOutputKind

    template = chat_template_from_args(args)
    engine = make_engine_from_args(args, num_seqs=max(1, getattr(args, "n", None) or 1))
    params = sampling_params_from_args(
        args, engine.sampling_defaults, output_kind=RequestOutputKind.DELTA
    )
    engine.chat_prompt([{"role": "user", "content": "hi"}], chat_template=template)  # checks
    # Every program a conversation of this engine can reach, before the first answer (one
    # slot: its token buckets up to max_model_len), so no answer stalls on a compile.
    engine.warm_up(up_to=engine.max_model_len)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    interactive = sys.stdin.isatty()
    print("jpaged chat: /reset starts over, /exit quits", file=sys.stderr)
    for turn in itertools.count():
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                break
        else:
            line = sys.stdin.readline()
            if not line:
                break
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(system)
            print("(conversation reset)", file=sys.stderr, flush=True)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        _, ids = engine.chat_prompt(history, chat_template=template)
        engine.add_request(f"chat-{turn}", ids, params)
        reply, reason = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    reply.append(c.text)
                    sys.stdout.write(printable(c.text))
                    sys.stdout.flush()
                    reason = c.finish_reason or reason
        sys.stdout.write("\n")
        sys.stdout.flush()
        if reason == "length":
            print("# (cut at --max-tokens)", file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from jpaged.entrypoints.batch import run_batch

    return run_batch(
        args.input,
        args.output,
        engine_factory=lambda: make_engine_from_args(args),
        defaults={"max_tokens": CLI_MAX_TOKENS, **sampling_overrides(args)},
    )


def cmd_convert(args: argparse.Namespace) -> int:
    import time

    from models.orbax_checkpoint import convert_hf_to_orbax

    t0 = time.perf_counter()
    out = convert_hf_to_orbax(args.from_hf, args.out, dtype=args.dtype)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--debug",
        action="store_true",
        default=None,
        help="show the traceback of an error (also: JPAGED_DEBUG=1)",
    )


def build_parser(extensions: Iterable[Callable] = ()) -> argparse.ArgumentParser:
    """The parser of the offline commands; each extension(subparsers) adds more commands."""
    parser = argparse.ArgumentParser(prog="jpaged", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt")
    add_prompt_args(gen)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message, rendered with the model's chat template",
    )
    add_chat_flags(gen)
    gen.add_argument(
        "--output",
        choices=("text", "json"),
        default="text",
        help="text (non-printable characters escaped) or one JSON object (default: text)",
    )
    add_common_flags(gen)
    add_engine_flags(gen)
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="an interactive chat in the terminal (streams its answers)",
        description="Each line you type is a user message; the model's answer streams back. "
        "/reset starts a new conversation, /exit or end of input quits.",
    )
    add_chat_flags(chat)
    add_common_flags(chat)
    add_engine_flags(chat)
    add_sampling_flags(chat)
    chat.set_defaults(func=cmd_chat)

    batch = sub.add_parser(
        "batch",
        help="offline batch inference over a JSONL file",
        description='Each input line: {"prompt": "text"} or {"prompt_token_ids": [1, 2, 3]}, '
        'an optional "id", and any SamplingParams field; the flags below are the defaults '
        "for fields a line leaves unset.",
    )
    batch.add_argument("input", help="JSONL input, one request per line")
    batch.add_argument("output", help="JSONL of results, in input order")
    add_common_flags(batch)
    add_engine_flags(batch)
    add_sampling_flags(batch, defaults_only=True)
    batch.set_defaults(func=cmd_batch)

    conv = sub.add_parser("convert", help="write an Orbax checkpoint of a Hugging Face model")
    conv.add_argument("--from-hf", required=True, help="Hugging Face model directory")
    conv.add_argument("--out", required=True, help="new model directory (Orbax params + config)")
    conv.add_argument("--dtype", default=None, help="stored dtype (default: the platform's)")
    add_common_flags(conv)
    conv.set_defaults(func=cmd_convert)
    for extend in extensions:
        extend(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parses argv and runs the command; a user's error is one line on stderr."""
    args = parser.parse_args(argv)
    limit_malloc_arenas()  # before jax starts its threads (jpaged.worker.host_memory)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("JPAGED_DEBUG", "") not in (
        "",
        "0",
    )
    try:
        return args.func(args) or 0
    except (ValueError, OSError, KeyboardInterrupt) as e:
        if debug:
            raise
        if isinstance(e, KeyboardInterrupt):
            print("jpaged: interrupted", file=sys.stderr)
            return 130
        message = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in message:
            message = f"{message}: {e.filename}"
        print(f"jpaged: error: {message}", file=sys.stderr)
        return 1 if isinstance(e, OSError) else 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
