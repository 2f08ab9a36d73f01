"""Start-up: the server warms up behind NOT_SERVING, listens on 127.0.0.1 by default, keeps
jax's start-up noise out of its log, and parses its port flags one way."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time

import grpc
import httpx
import pytest
from fake_engine import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import collect, request

from server import app
from server.logs import configure_logging
from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc


class SlowWarmUpEngine(FakeEngine):
    """warm_up blocks until the test lets it go (a compile that takes a while)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.release = threading.Event()
        self.warm_up_calls: list[int] = []

    def warm_up(self, context_len: int = 64) -> float:
        self.warm_up_calls.append(context_len)
        assert self.release.wait(30)
        return 1.5


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status


def test_not_serving_until_warmed_up(caplog):
    engine = SlowWarmUpEngine()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    options = app.ServerOptions(port=0, http_port=0, metrics_port=None)
    server = app.Server(engine, options, model_name="fake")
    with caplog.at_level(logging.INFO, logger="jpaged.server"):
        started = asyncio.run_coroutine_threadsafe(server.start(), loop)
        deadline = time.monotonic() + 10
        while server.http_port is None or not engine.warm_up_calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        address, url = f"127.0.0.1:{server.port}", f"http://127.0.0.1:{server.http_port}"
        assert health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        r = httpx.get(url + "/health")
        assert (r.status_code, r.json()) == (503, {"status": "warming_up"})
        # A request sent meanwhile waits for the warm-up, then is served.
        early = {}
        t = threading.Thread(
            target=lambda: early.update(r=httpx.post(url + "/v1/completions", json={"prompt": [4]}))
        )
        t.start()
        time.sleep(0.2)
        assert "r" not in early
        engine.release.set()
        started.result(10)
        t.join(10)
    assert early["r"].status_code == 200
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(url + "/health").status_code == 200
    assert engine.warm_up_calls == [app.WARM_UP_CONTEXT_LEN]
    (serving,) = [r for r in caplog.records if r.getMessage() == "serving"]
    assert serving.fields["warm_up_s"] == 1.5
    asyncio.run_coroutine_threadsafe(server.drain(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_a_failed_warm_up_is_logged_and_the_server_serves(make_server, caplog):
    class BrokenWarmUp(FakeEngine):
        def warm_up(self, context_len: int = 64) -> float:
            raise AttributeError("'ModelRunner' object has no attribute 'warm_up_keys'")

    with caplog.at_level(logging.WARNING, logger="jpaged.server"):
        s = make_server(BrokenWarmUp())
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "warm-up failed" in warning.getMessage() and "warm_up_keys" in warning.fields["error"]
    assert health_status(s.address) == health_pb2.HealthCheckResponse.SERVING
    assert collect(s.stub, request([4], temperature=0, max_tokens=2)).token_ids == {0: [4, 5]}


def other_local_address() -> str | None:
    """A non-loopback address of this machine (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.255", 9))  # TEST-NET: only picks the outgoing interface
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_every_port_listens_on_loopback_by_default(make_server):
    parser = argparse.ArgumentParser()
    app.add_server_args(parser)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1" and app.ServerOptions().host == "127.0.0.1"
    assert "default: 127.0.0.1" in parser.format_help()
    s = make_server(host=args.host)  # ports 0: any free port
    ports = [s.server.port, s.server.http_port, s.server.metrics_port]
    assert all(connects("127.0.0.1", p) for p in ports)
    other = other_local_address()
    if other is not None:  # this machine has another interface: nothing listens there
        assert not any(connects(other, p) for p in ports), other
    else:  # only loopback here: the listeners are bound to it, not to every interface
        assert s.server.http_server._socket.getsockname()[0] == "127.0.0.1"
    with grpc.insecure_channel(s.address) as ch:
        got = collect(pb_grpc.GenerationStub(ch), request([4], temperature=0, max_tokens=1))
    assert got.token_ids == {0: [4]}


def test_port_flags():
    parser = argparse.ArgumentParser()
    app.add_server_args(parser)
    args = parser.parse_args(["--port", "0", "--http-port", "off", "--metrics-port", "-1"])
    assert (args.port, args.http_port, args.metrics_port) == (0, None, None)
    options = app.ServerOptions.from_args(args)
    assert (options.port, options.http_port, options.metrics_port) == (0, None, None)
    defaults = parser.parse_args([])
    assert (defaults.port, defaults.http_port, defaults.metrics_port) == (50051, 8000, 9090)
    with pytest.raises(SystemExit):
        parser.parse_args(["--http-port", "70000"])
    with pytest.raises(ValueError, match="both off"):
        app.ServerOptions(port=None, http_port=None)


def test_api_key_from_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    app.add_server_args(parser)
    monkeypatch.setenv("JPAGED_API_KEY", "from-env")
    assert app.ServerOptions.from_args(parser.parse_args([])).api_key == "from-env"
    flag = parser.parse_args(["--api-key", "from-flag"])
    assert app.ServerOptions.from_args(flag).api_key == "from-flag"
    monkeypatch.delenv("JPAGED_API_KEY")
    assert app.ServerOptions.from_args(parser.parse_args([])).api_key is None


def test_chat_template_flag_reads_a_file_or_takes_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert app.read_chat_template(str(path)) == "{{ messages[0].content }}"
    assert app.read_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(FileNotFoundError, match="chat template file not found"):
        app.read_chat_template(str(tmp_path / "missing.jinja"))


def test_jax_start_up_noise_stays_out_of_the_log():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("INFO")
        for name in ("jax._src.xla_bridge", "jax._src.compilation_cache"):
            quiet = logging.getLogger(name)
            assert not quiet.isEnabledFor(logging.INFO)  # "Unable to initialize backend 'tpu'"
            assert quiet.isEnabledFor(logging.WARNING)
        assert logging.getLogger("jpaged.server").isEnabledFor(logging.INFO)
        configure_logging("DEBUG")
        assert not logging.getLogger("jax._src.xla_bridge").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_a_cpu_server_has_four_slots_and_warms_up_every_program_they_reach(
    demo_model_dir, monkeypatch
):
    """On CPU `jpaged serve` without --max-num-seqs runs CPU_SERVER_MAX_NUM_SEQS sequences
    (a pool of 4 x max_model_len), and its warm-up compiles every step program they can
    reach, so no request compiles after health says SERVING; --max-num-seqs wins."""
    from jpaged.sample.sampling_params import SamplingParams
    from jpaged.worker.step_inputs import bucket_keys
    from server import cli as server_cli

    monkeypatch.setenv("JPAGED_CACHE_DIR", str(demo_model_dir.parent))
    parser = server_cli.build_parser((server_cli.add_serve_parser,))
    # max_model_len 512 = the step's token budget, as at the defaults (2048 >= 512): one
    # sequence reaches every token bucket; 32 pages of 16 tokens.
    common = ["serve", "--model", "demo-random", "--max-model-len", "512"]
    engine = server_cli.make_server_engine(parser.parse_args(common))
    assert server_cli.CPU_SERVER_MAX_NUM_SEQS == 4
    assert (engine.platform, engine.config.scheduler.max_num_seqs) == ("cpu", 4)
    assert engine.num_pages == 4 * 32 + 1
    assert app._warm_up(engine) > 0
    programs = engine.runner.programs
    assert set(programs.step_keys()) == set(bucket_keys(engine.config))
    compiled = programs.num_compiles
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(([5] * 400, [7] * 3, [9] * 40, [11] * 200)):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(len(o.outputs[0].token_ids) for o in done.values()) == [8, 8, 8, 8]
    assert programs.num_compiles == compiled  # nothing compiled once serving

    eight = server_cli.make_server_engine(parser.parse_args([*common, "--max-num-seqs", "8"]))
    assert eight.config.scheduler.max_num_seqs == 8 and eight.num_pages == 8 * 32 + 1


def test_the_command_line_loads_the_server_stack_only_to_serve():
    """`jpaged generate` and `jpaged chat` run through server.cli; importing it (and
    building its parser) loads neither gRPC nor FastAPI nor uvicorn: about 30 MiB of RSS."""
    import subprocess
    import sys

    code = (
        "import sys, server.cli\n"
        "server.cli.build_parser((server.cli.add_serve_parser, server.cli.add_client_parser))\n"
        "print(sorted(m for m in ('grpc', 'fastapi', 'uvicorn', 'starlette') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
