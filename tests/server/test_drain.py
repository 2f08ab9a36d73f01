"""SIGTERM drains a real server process: it stops taking calls, lets in-flight requests
finish within the grace period, aborts the rest, and exits 0."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
from child_process import dies_with_parent
from serving_helpers import Collected, request

from server.proto.jpaged.v1 import generation_pb2 as pb
from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class ServerProcess:
    def __init__(self, grace_s: float) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            dies_with_parent(
                [
                    sys.executable,
                    str(HERE / "fake_engine.py"),
                    "--step-delay",
                    "0.01",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--http-port",
                    "0",
                    "--metrics-port",
                    "-1",
                    "--drain-grace",
                    str(grace_s),
                    "--max-model-len",
                    "200000",
                    "--num-pages",
                    "60000",
                ]
            ),
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._port = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port.wait(120):
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("server did not start:\n" + "\n".join(self.lines))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            m = re.search(r"msg=serving .* port=(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self._port.set()

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def refused_after_sigterm(stub) -> grpc.StatusCode:
    """Sends short requests until one is refused; returns its code."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            list(stub.Generate(request([1], temperature=0, max_tokens=1), timeout=5))
        except grpc.RpcError as e:
            return e.code()
        time.sleep(0.02)
    raise AssertionError("new calls were still accepted 5 s after SIGTERM")


def test_sigterm_drains_then_aborts_the_rest_and_exits_0():
    # One process (start-up is the slow part): a short request that finishes within the
    # grace period and a long one that outlives it.
    s = ServerProcess(grace_s=6)
    try:
        short = s.stub.Generate(
            request([1], request_id="short", temperature=0, max_tokens=10, ignore_eos=True),
            timeout=120,
        )
        long = s.stub.Generate(
            request([1], request_id="long", temperature=0, max_tokens=100_000, ignore_eos=True),
            timeout=120,
        )
        first_short, first_long = next(short), next(long)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert refused_after_sigterm(s.stub) == grpc.StatusCode.UNAVAILABLE
        got_short = Collected([first_short, *short])
        assert got_short.token_ids[0] == [1 + i for i in range(10)]
        assert got_short.finish_reason == {0: pb.FINISH_REASON_LENGTH}
        got_long = Collected([first_long, *long])
        ended_after = time.monotonic() - t0
        assert got_long.finish_reason == {0: pb.FINISH_REASON_ABORT}
        n = len(got_long.token_ids[0])
        assert 1 <= n < 100_000 and got_long.token_ids[0] == [(1 + i) % 1000 for i in range(n)]
        assert got_long.final.usage.completion_tokens == n
        assert ended_after > 5
        assert long.code() == short.code() == grpc.StatusCode.OK
        assert s.proc.wait(60) == 0
    finally:
        s.close()
    log = "\n".join(s.lines)
    assert re.search(r"msg=draining in_flight=[23] grace_s=6.0", log)  # 3: a probe raced in
    assert 'msg="grace period over" aborted=1' in log
    assert re.search(r'msg="request done" request_id=short outcome=length', log)
    assert re.search(r'msg="request done" request_id=long outcome=abort', log)
    assert "msg=stopped" in log
