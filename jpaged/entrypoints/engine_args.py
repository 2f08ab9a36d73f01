"""The engine's settings as flat keyword arguments and as CLI flags, derived from jpaged/config.py.

The config dataclasses are the one declaration: each field's default, type, choices and help
text (`config.setting`) give the LLM's keyword arguments and the engine flags of generate,
batch and serve. A keyword that is not a setting is reported with the closest valid one:

    LLM(max_num_seq=4)  ->  TypeError: unknown engine argument 'max_num_seq'; did you mean
                            'max_num_seqs'?
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any

from jpaged.config import CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, SchedulerConfig

# Flat name -> (section of EngineConfig, or None for its own fields; the field).
_SECTIONS = (
    ("cache", CacheConfig),
    ("scheduler", SchedulerConfig),
    ("parallel", ParallelConfig),
    ("lora", LoRAConfig),
)
_NESTED = {name for name, _ in _SECTIONS}


def _fields() -> dict[str, tuple[str | None, dataclasses.Field]]:
    out: dict[str, tuple[str | None, dataclasses.Field]] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name not in _NESTED:
            out[f.name] = (None, f)
    for section, cls in _SECTIONS:
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f)
    return out


ENGINE_ARGS = _fields()


def engine_config_from_args(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """One flat set of keyword arguments (the LLM's, the CLI's, the server's) -> EngineConfig.

    Raises:
      TypeError: a keyword that is not an engine setting (with the closest valid name).
      ValueError: a setting's value is invalid (from the config's validation).
    """
    sections: dict[str | None, dict[str, Any]] = {None: {"model": model}}
    for name, value in kwargs.items():
        if name not in ENGINE_ARGS:
            close = difflib.get_close_matches(name, list(ENGINE_ARGS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"unknown engine argument {name!r}{hint}")
        section, _ = ENGINE_ARGS[name]
        sections.setdefault(section, {})[name] = value
    nested = {section: cls(**sections.get(section, {})) for section, cls in _SECTIONS}
    return EngineConfig(**sections[None], **nested)


def _flag_type(f: dataclasses.Field):
    base = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float, "str": str, "bool": bool}[base]


def _default_text(f: dataclasses.Field) -> str:
    help_text = f.metadata["help"]
    if "default" in help_text or f.default is None:
        return help_text
    return f"{help_text} (default: {f.default})"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """--model and one flag per engine setting (unset flags keep the config's defaults)."""
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory, a .gguf file or a directory holding one "
        "(default: the demo model)",
    )
    group = parser.add_argument_group("engine")
    for name, (_, f) in ENGINE_ARGS.items():
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        flag = "--" + meta.get("flag", name).replace("_", "-")
        kind = _flag_type(f)
        if kind is bool:
            on_off = meta.get("default_label") or ("on" if f.default else "off")
            group.add_argument(
                flag,
                dest=_dest(name),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"turn {meta['help']} on or off (default: {on_off})",
            )
        else:
            group.add_argument(
                flag,
                dest=_dest(name),
                type=kind,
                default=None,
                choices=meta.get("choices"),
                help=_default_text(f),
            )


def _dest(name: str) -> str:
    """The argparse destination of a setting (its flag's name: --engine-seed -> engine_seed)."""
    return ENGINE_ARGS[name][1].metadata.get("flag", name).replace("-", "_")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings given on the command line (unset ones are left out)."""
    out = {}
    for name, (_, f) in ENGINE_ARGS.items():
        if name == "model" or not f.metadata.get("cli", True):
            continue
        value = getattr(args, _dest(name), None)
        if value is not None:
            out[name] = value
    return out
