"""Helpers for the server tests: a real grpc.aio server on 127.0.0.1 in a background thread,
`jpaged serve` as a process (ServeProcess), and a client-side view of a Generate stream.

The server runs its own event loop in a thread, so tests are plain synchronous pytest
functions that talk to it with ordinary (sync) grpc stubs.
"""

from __future__ import annotations

import asyncio
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

from server.app import Server, ServerOptions
from server.proto.jpaged.v1 import generation_pb2 as pb
from server.proto.jpaged.v1 import generation_pb2_grpc as pb_grpc


class RunningServer:
    def __init__(self, engine, *, model_name: str = "fake", **options) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        options = {"host": "127.0.0.1", "port": 0, "http_port": 0, "metrics_port": 0, **options}
        opts = ServerOptions(**options)
        self.server = Server(engine, opts, model_name=model_name)
        self._run(self.server.start())
        self.address = f"127.0.0.1:{self.server.port}"
        self.http_url = f"http://127.0.0.1:{self.server.http_port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._closed = False
        self._drain = None

    def _run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> pb.EngineStats:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest()).stats

    def wait_until(self, predicate, timeout: float = 5.0) -> pb.EngineStats:
        """Polls the server's stats until predicate(stats) holds; returns those stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if predicate(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout}s; stats: {s}")
            time.sleep(0.01)

    def drain_soon(self, grace_s: float):
        """Starts the drain SIGTERM starts, without waiting; returns its future."""
        self._drain = asyncio.run_coroutine_threadsafe(self.server.drain(grace_s), self.loop)
        return self._drain

    def close(self, grace_s: float = 0.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.channel.close()
        if self._drain is None:
            self._run(self.server.drain(grace_s))
        else:
            self._drain.result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


ROOT = pathlib.Path(__file__).resolve().parents[2]


class ServeProcess:
    """`python -m server serve --model MODEL_DIR FLAGS...`, ports picked by the OS (metrics
    only on the HTTP port)."""

    def __init__(self, model_dir: pathlib.Path, flags: list[str]) -> None:
        cmd = [sys.executable, "-m", "server", "serve", "--model", str(model_dir), *flags]
        cmd += ["--port", "0", "--http-port", "0", "--metrics-port", "off"]
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="")  # jax probes platforms
        self.proc = subprocess.Popen(
            dies_with_parent(cmd), cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(600):
            self.proc.kill()
            raise AssertionError("server did not start:\n" + "\n".join(self.lines))
        self.url = f"http://127.0.0.1:{self.http_port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            m = re.search(r"msg=serving .* port=(\d+) http_port=(\d+)", line)
            if m:
                self.port, self.http_port = int(m.group(1)), int(m.group(2))
                self._ready.set()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


class Collected:
    """A Generate stream gathered per choice, as a client would assemble it."""

    def __init__(self, messages: list[pb.GenerateResponse]) -> None:
        self.messages = messages
        self.final = messages[-1]
        self.request_id = self.final.request_id
        self.token_ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.logprobs: dict[int, list[pb.TokenLogprob]] = {}
        self.finish_reason: dict[int, int] = {}
        for m in messages:
            for c in m.choices:
                self.token_ids.setdefault(c.index, []).extend(c.token_ids)
                self.text[c.index] = self.text.get(c.index, "") + c.text
                self.logprobs.setdefault(c.index, []).extend(c.logprobs)
        for c in self.final.choices:
            self.finish_reason[c.index] = c.finish_reason
        self.final_choice = {c.index: c for c in self.final.choices}


class ChatCollected:
    """A Chat stream gathered per choice: content, the tool calls as a client assembles them
    from the deltas ({"id", "name", "arguments"}; a call's first delta is checked to carry
    its id and name and no arguments, the next ones neither), the final message's whole
    calls in the same shape, finish reasons, usage."""

    def __init__(self, messages: list[pb.ChatResponse]) -> None:
        self.messages = messages
        self.final = messages[-1]
        self.usage = self.final.usage
        self.content: dict[int, str] = {}
        self.calls: dict[int, list[dict]] = {}
        for m in messages:
            for c in m.choices:
                self.content[c.index] = self.content.get(c.index, "") + c.text
                calls = self.calls.setdefault(c.index, [])
                for d in c.tool_calls:
                    if d.id:
                        assert d.index == len(calls) and d.name and not d.arguments, d
                        calls.append({"id": d.id, "name": d.name, "arguments": ""})
                    else:
                        assert not d.name, d
                        calls[d.index]["arguments"] += d.arguments
        self.finish_reason = {c.index: c.finish_reason for c in self.final.choices}
        self.final_calls = {
            c.index: [
                {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                for t in c.calls
            ]
            for c in self.final.choices
        }


def collect_chat(stub, request: pb.ChatRequest, **kwargs) -> ChatCollected:
    return ChatCollected(list(stub.Chat(request, **kwargs)))


def collect(stub, request: pb.GenerateRequest, **kwargs) -> Collected:
    return Collected(list(stub.Generate(request, **kwargs)))


def request(prompt, **sampling) -> pb.GenerateRequest:
    """A GenerateRequest for a text or token-id prompt; extra keywords are sampling fields
    except request_id and cache_salt."""
    top = {k: sampling.pop(k) for k in ("request_id", "cache_salt") if k in sampling}
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling=pb.SamplingParameters(**sampling), **top)
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParameters(**sampling), **top
    )


def openai_client(server: RunningServer, **kwargs):
    """The official openai client on server's HTTP API (no retries: tests see each answer)."""
    import openai

    kwargs.setdefault("api_key", "unused")
    kwargs.setdefault("timeout", 60)
    return openai.OpenAI(base_url=server.http_url + "/v1", max_retries=0, **kwargs)


def sse_events(lines) -> list:
    """The events of a server-sent event stream: parsed JSON, or "[DONE]"."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        elif line:
            raise AssertionError(f"not an SSE data line: {line!r}")
    return events


def scrape(url: str) -> dict[str, float]:
    """A Prometheus /metrics page as {series: value}."""
    import re
    import urllib.request

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values
