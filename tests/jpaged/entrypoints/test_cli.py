"""The command line end to end on the demo model: generate, batch (with a malformed line)."""

import json
import subprocess
import sys

ENGINE = [
    "--model",
    "demo-random",  # the random demo model, in the JPAGED_CACHE_DIR the tests point at
    "--max-num-seqs",
    "4",
    "--max-model-len",
    "128",
    "--max-num-batched-tokens",
    "64",
    "--num-pages",
    "40",
]


def run(args, env):
    return subprocess.run(
        [sys.executable, "-m", "jpaged.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def test_generate_and_batch(demo_model_dir, tmp_path, monkeypatch):
    import os

    env = dict(os.environ, JPAGED_CACHE_DIR=str(demo_model_dir.parent), JAX_PLATFORMS="cpu")
    res = run(
        [
            "generate",
            "Hello there",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            *ENGINE,
        ],
        env,
    )
    assert res.returncode == 0, res.stderr
    assert "5 tokens, finish_reason=length" in res.stderr

    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"prompt": "one", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        + "\n"
        + "{not json\n"
        + json.dumps({"prompt": "two", "max_tokens": 2, "top_p": 7, "id": "bad-top-p"})
        + "\n"
        + json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "id": "x"})
        + "\n"
        + json.dumps({"prompt_token_ids": [8, 9], "max_tokens": 2, "ignore_eos": True})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    res = run(["batch", str(inp), str(out), *ENGINE], env)
    assert res.returncode == 1, res.stderr  # some lines were malformed or invalid
    assert f"{inp}:2: invalid JSON" in res.stderr
    assert f"{inp}:3: top_p must be in (0, 1]" in res.stderr
    assert "1 malformed line(s), 1 invalid line(s)" in res.stderr  # counted apart
    assert "output tokens/s" in res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5]
    assert len(rows[0]["outputs"][0]["token_ids"]) == 3
    assert rows[1]["error"].startswith("invalid JSON") and rows[1]["id"] is None
    assert rows[2]["error"].startswith("top_p") and rows[2]["id"] == "bad-top-p"  # id kept
    assert rows[3]["id"] == "x" and len(rows[3]["outputs"][0]["token_ids"]) == 4
    assert len(rows[4]["outputs"][0]["token_ids"]) == 2  # prompt_token_ids lines run too


class Recorder:
    """A stdout that keeps every write separately."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)

    def flush(self) -> None:
        pass


def test_generate_stream_writes_the_same_text_piece_by_piece(demo_model_dir, monkeypatch):
    from jpaged.entrypoints import cli

    monkeypatch.setenv("JPAGED_CACHE_DIR", str(demo_model_dir.parent))
    args = [
        "generate",
        "Once upon",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
        *ENGINE,
    ]
    streamed, whole = Recorder(), Recorder()
    monkeypatch.setattr("sys.stdout", streamed)
    assert cli.main([*args, "--stream"]) == 0
    monkeypatch.setattr("sys.stdout", whole)
    assert cli.main(args) == 0
    text = "".join(whole.writes)
    assert text.strip()
    assert "".join(streamed.writes) == text
    pieces = [w for w in streamed.writes if w.strip()]
    assert len(pieces) >= 4  # written as tokens arrive, not once at the end


def test_chat_confirms_a_reset_and_answers_each_turn(demo_model_dir, tmp_path):
    import os

    env = dict(os.environ, JPAGED_CACHE_DIR=str(demo_model_dir.parent), JAX_PLATFORMS="cpu")
    template = tmp_path / "template.jinja"  # the demo model has none
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    res = subprocess.run(
        [sys.executable, "-m", "jpaged.entrypoints.cli", "chat", "--max-tokens", "3",
         "--temperature", "0", "--chat-template", str(template), *ENGINE],
        input="hi\n/reset\nagain\n/exit\n", capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("(conversation reset)") == 1


def test_generate_and_chat_size_the_engine_for_their_own_sequences(demo_model_dir, monkeypatch):
    """Without --max-num-seqs a CLI engine has the slots its command runs (n), so a CPU pool
    sized for its slots holds one (or n) max_model_len sequences, not 32."""
    from jpaged.entrypoints.cli import build_parser, make_engine_from_args

    monkeypatch.setenv("JPAGED_CACHE_DIR", str(demo_model_dir.parent))
    parser = build_parser()
    common = ["--model", "demo-random", "--max-model-len", "128"]  # 8 pages of 16 tokens
    for argv, seqs in ((["generate", "hi"], 1), (["generate", "hi", "-n", "3"], 3),
                       (["chat"], 1), (["generate", "hi", "--max-num-seqs", "4"], 4)):
        engine = make_engine_from_args(parser.parse_args(argv + common),
                                       num_seqs=3 if "-n" in argv else 1)
        assert engine.config.scheduler.max_num_seqs == seqs, argv
        assert engine.num_pages == seqs * 8 + 1, argv



def test_chat_compiles_every_program_it_can_reach_before_the_first_answer(
    demo_model_dir, tmp_path, monkeypatch
):
    """One slot: every token bucket up to max_model_len, warmed up before the first turn,
    so the conversation's steps (a short turn, then a long one) compile nothing more."""
    import io

    from jpaged.entrypoints import cli
    from jpaged.worker.step_inputs import bucket_keys

    engines, after_warm_up = [], []
    make = cli.make_engine_from_args

    def recorded(*args, **kwargs):
        engine = make(*args, **kwargs)
        warm_up = engine.warm_up

        def counted(*a, **kw):
            seconds = warm_up(*a, **kw)
            after_warm_up.append(engine.runner.programs.num_compiles)
            return seconds

        engine.warm_up = counted
        engines.append(engine)
        return engine

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = cli.build_parser().parse_args(
        ["chat", "--model", "demo-random", "--max-model-len", "128", "--max-num-batched-tokens",
         "64", "--max-tokens", "4", "--chat-template", str(template)]
    )  # fmt: skip
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setattr(cli, "make_engine_from_args", recorded)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n" + "x " * 40 + "\n/exit\n"))
    assert cli.cmd_chat(args) == 0
    (engine,) = engines
    programs = engine.runner.programs
    assert set(programs.step_keys()) == set(bucket_keys(engine.config))
    assert programs.num_compiles == after_warm_up[0]  # the turns compiled nothing
