"""What a new user trips over on the command line (issue 16): one-line errors, one set of
sampling flags, token-id prompts, escaped control characters; and the Python API's errors."""

import argparse
import json
import logging
import os
import subprocess
import sys

import pytest

from jpaged import LLM, SamplingParams
from jpaged.entrypoints.cli import CLI_MAX_TOKENS, SAMPLING_FIELDS, build_parser, printable
from server.cli import add_client_parser, add_serve_parser

SMALL = ["--max-num-seqs", "4", "--max-model-len", "64", "--num-pages", "24"]


def jpaged(args, cache_dir, *extra_env):
    env = dict(os.environ, JPAGED_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu")
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def cache_dir(demo_model_dir):
    return demo_model_dir.parent  # holds demo-v1: --model demo-random


def test_missing_and_unreadable_files_are_one_line_errors(cache_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["generate", "hi", "--model", "/no/such/dir"], "/no/such/dir"),
        (["generate", "hi", "--model", str(empty)], str(empty)),
        (["batch", str(tmp_path / "missing.jsonl"), "out.jsonl"], "missing.jsonl"),
        (["serve", "--model", "/no/such/dir", "--port", "0", "--metrics-port", "-1"], "/no/such"),
    ]
    for args, named in cases:
        res = jpaged(args, cache_dir)
        lines = res.stderr.strip().splitlines()
        assert res.returncode != 0, args
        assert len(lines) == 1 and lines[0].startswith("jpaged: error: "), (args, res.stderr)
        assert named in lines[0], (args, lines[0])
    debug = jpaged(["generate", "hi", "--model", "/no/such/dir", "--debug"], cache_dir)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def _sampling_options(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """dest -> (option strings, help) of the sampling flags of a subcommand."""
    return {
        a.dest: (tuple(a.option_strings), a.help)
        for a in parser._actions  # argparse keeps no public list of actions
        if a.dest in SAMPLING_FIELDS
    }


def test_every_command_has_the_same_sampling_flags_with_their_defaults_shown():
    parser = build_parser((add_serve_parser, add_client_parser))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = {name: _sampling_options(sub.choices[name]) for name in sub.choices}
    want = commands["generate"]
    assert set(want) == set(SAMPLING_FIELDS)
    for name in ("chat", "batch", "client", "serve"):
        assert {d: opts for d, (opts, _) in commands[name].items()} == {
            d: opts for d, (opts, _) in want.items()
        }, name
    assert want["n"][0] == ("-n", "--n") and want["seed"][0] == ("--seed",)
    assert want["stop_token_ids"][0] == ("--stop-token-ids",)
    for dest, (_, text) in want.items():
        assert "default" in text, dest
    assert f"(default: {CLI_MAX_TOKENS})" in want["max_tokens"][1]
    engine_seed = next(a for a in sub.choices["generate"]._actions if a.dest == "engine_seed")
    assert engine_seed.option_strings == ["--engine-seed"]


def test_generate_takes_token_ids_and_escapes_control_characters(cache_dir):
    args = ["generate", "--prompt-token-ids", "5,6,7", "--model", "demo-random", *SMALL]
    args += ["--temperature", "0", "--max-tokens", "24", "--ignore-eos"]
    res = jpaged([*args, "--output", "json"], cache_dir)
    assert res.returncode == 0, res.stderr
    record = json.loads(res.stdout)
    assert record["prompt_token_ids"] == [5, 6, 7]
    text = record["outputs"][0]["text"]
    assert len(record["outputs"][0]["token_ids"]) == 24
    plain = jpaged(args, cache_dir)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == printable(text) + "\n"
    assert plain.stdout.rstrip("\n").isprintable() or "\n" in text
    both = jpaged(
        ["generate", "hi", "--prompt-token-ids", "1", "--model", "demo-random"], cache_dir
    )
    assert (
        both.stderr.strip()
        == "jpaged: error: give one prompt: either text or --prompt-token-ids, not both"
    )
    none = jpaged(["generate", "--model", "demo-random"], cache_dir)
    assert none.stderr.strip() == (
        'jpaged: error: give a prompt: text (jpaged generate "Hello") or --prompt-token-ids'
    )


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable("ok\tline\nnext") == "ok\tline\nnext"
    assert printable("bell\x07 esc\x1b[31m") == "bell\\x07 esc\\x1b[31m"
    assert printable("zero\u200bwidth") == "zero\\u200bwidth"
    assert printable("héllo 世界 🙂") == "héllo 世界 🙂"


def test_the_python_api_says_what_was_wrong(demo_llm):
    with pytest.raises(
        TypeError, match=r"^unknown engine argument 'max_num_seq'; did you mean 'max_num_seqs'\?$"
    ):
        LLM("unused", max_num_seq=4)
    with pytest.raises(ValueError, match=r"got dict: \{'temperature': 0\}"):
        demo_llm.generate(["hi"], {"temperature": 0})


def test_a_request_longer_than_max_model_len_warns_and_stops_at_length(demo_llm, caplog):
    # demo_llm: max_model_len 128
    with caplog.at_level(logging.WARNING, logger="jpaged.entrypoints.llm"):
        out = demo_llm.generate(
            [[5] * 100], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        )[0]
    (record,) = [r for r in caplog.records if r.name == "jpaged.entrypoints.llm"]
    assert "prompt 0: 100 prompt tokens + max_tokens 50 exceed max_model_len 128" in record.message
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 28
