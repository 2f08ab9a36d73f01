"""The engine's step loop, in a thread of its own, and the bridge to asyncio.

Invariants:
  - Only the step thread touches the engine (it is not thread-safe). Requests, aborts and
    tokenizer calls reach it through one FIFO command queue, so an abort queued after an
    add is always seen after it.
  - The step thread never waits on the network: each step's results go back to the event
    loop in one loop.call_soon_threadsafe. Requests run with RequestOutputKind.DELTA, so the
    engine's outputs are already deltas (text held back for stop strings and unfinished
    characters, once, by the engine) and are forwarded as they are; the request's handle
    accumulates them until its handler takes them. A slow client only makes its own handle's
    buffer longer (bounded by its max_tokens); it never slows the step loop.
  - Engine request ids are made here and are unique for the server's lifetime, so a late
    result of an aborted request can never reach a newer request that reused its client id.
  - A request's fate is known before the step that follows its add: the step thread posts
    each batch of adds' acceptances and rejections before it steps, so a handler can answer
    "bad request" (or start a stream) without waiting for a device step.
  - Each time the engine goes idle, the step thread hands the C heap's free pages back to the
    OS (glibc's malloc_trim) before it posts the last results: the many threads' malloc
    arenas otherwise keep freed step buffers, and the RSS creeps up by fragmentation.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import dataclasses
import functools
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from jpaged.core.disk_flush import flush_to_disk
from jpaged.core.engine import EngineStepError
from jpaged.outputs import RequestOutput
from jpaged.pooling import PoolingParams
from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jpaged.server")

# Seconds the idle step thread waits for a command before refreshing its stats.
_IDLE_POLL_S = 0.2


def heap_trimmer() -> Callable[[], Any] | None:
    """glibc's malloc_trim(0), which returns the free pages of every malloc arena to the OS;
    None where the C library has no such call (macOS, musl)."""
    try:
        return functools.partial(ctypes.CDLL(None).malloc_trim, 0)
    except (OSError, AttributeError):
        return None


def new_request_id() -> str:
    """A random id of 32 hex digits for a request that came without one: Python's PRNG (an
    id needs no secrecy), not uuid4's os.urandom call per request, which a profile of the
    HTTP server under load once showed at 0.5 ms a call."""
    return f"{random.getrandbits(128):032x}"


class Overloaded(Exception):
    """More requests are waiting than the server allows."""


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


class DuplicateRequestId(Exception):
    """A request with this client id is already in flight."""


@dataclasses.dataclass
class ChoiceState:
    """A choice as the handler sees it: what arrived and was not taken yet, and its totals."""

    index: int
    text: str = ""  # new text not taken yet
    token_ids: list[int] = dataclasses.field(default_factory=list)  # new, not taken yet
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)  # per new token
    num_tokens: int = 0  # every token of the choice so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    num_chars: int = 0  # characters of the choice's whole text so far
    # (characters, tokens) of the whole output after each arrival that added tokens: which
    # token a character offset of the text fell in (tokens_through)
    marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def tokens_through(self, chars: int) -> int:
        """How many tokens had arrived once the output's text reached chars characters
        (exact to the arrival: a step's tokens arrive together)."""
        k = bisect.bisect_left(self.marks, (chars, -1))
        return self.marks[k][1] if k < len(self.marks) else self.num_tokens

    def take(self) -> tuple[str, list[int], list[dict[int, float]]]:
        """(text, token ids, logprobs) that arrived since the last take."""
        out = self.text, self.token_ids, self.logprobs
        self.text, self.token_ids, self.logprobs = "", [], []
        return out


class RequestHandle:
    """One in-flight request on the event-loop side. Only the event loop touches it."""

    def __init__(
        self,
        client_id: str,
        engine_id: str,
        n: int,
        num_prompt_tokens: int,
        event: asyncio.Event | None = None,
    ) -> None:
        self.client_id = client_id
        self.engine_id = engine_id
        self.choices = [ChoiceState(index=j) for j in range(n)]
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.prompt_token_ids: list[int] | None = None
        # prompt_logprobs=N: [None, {id: logprob} per prompt token after the first], once the
        # engine computed them all (it sends them in one output).
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logprobs_sent = False  # gRPC: they go out in one message
        self.embedding: list[float] | None = None  # an embedding request's, when finished
        self.accepted = False  # the engine took the request
        self.finished = False
        self.aborted = False  # by Abort or by the server's drain; the stream ends as "abort"
        self.error: ValueError | Exception | None = None
        self.arrival_time = time.monotonic()
        # Set on every change; several handles of one call may share it (one wake-up).
        self.event = event if event is not None else asyncio.Event()

    def apply(self, out: RequestOutput) -> None:
        """Adds one DELTA RequestOutput of the engine."""
        self.prompt_token_ids = out.prompt_token_ids
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.embedding is not None:
            self.embedding = out.embedding
        for d in out.outputs:
            c = self.choices[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            c.num_tokens += len(d.token_ids)
            c.num_chars += len(d.text)
            if d.token_ids:
                c.marks.append((c.num_chars, c.num_tokens))
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            c.cumulative_logprob = d.cumulative_logprob
        self.finished = out.finished
        self.event.set()

    def accept(self, num_prompt_tokens: int | None) -> None:
        self.accepted = True
        if num_prompt_tokens is not None:
            self.num_prompt_tokens = num_prompt_tokens
        self.event.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.event.set()

    def mark_aborted(self) -> None:
        self.aborted = True
        self.event.set()

    async def wait(self) -> None:
        """Returns once something changed since the last wait."""
        await self.event.wait()
        self.event.clear()


class EngineLoop:
    """Owns the engine's thread. submit/abort/call are for the event loop's thread only."""

    def __init__(self, engine, *, max_waiting: int | None = None, metrics=None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # by engine id
        self._by_client_id: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the two waiting counts below
        self._num_queued_adds = 0
        self._engine_num_waiting = 0
        self._draining = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self.stats: dict[str, int] = dict(engine.stats(), num_running=0, num_waiting=0)
        self._trim_heap = heap_trimmer()  # called on the step thread when the engine goes idle

    # ---- event-loop side ----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float | None = 60.0) -> bool:
        """Aborts whatever is left and joins the step thread. False when the thread did not
        end within timeout_s (a step stuck in the engine or on the device): it is a daemon
        thread, so the process can still exit, and the caller says it did not stop cleanly."""
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            logger.error("engine thread did not stop", extra={"fields": {"timeout_s": timeout_s}})
            return False
        return True

    def num_waiting(self) -> int:
        with self._lock:
            return self._num_queued_adds + self._engine_num_waiting

    def num_in_flight(self) -> int:
        return len(self._handles)

    def submit(
        self,
        client_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        cache_salt: str | None,
        *,
        prepare: Callable[[Any], tuple[str | list[int], SamplingParams]] | None = None,
        event: asyncio.Event | None = None,
        pooling: PoolingParams | None = None,
        lora_request=None,
        session: str | None = None,
    ) -> RequestHandle:
        """Queues a request for the engine. Raises Draining, Overloaded or DuplicateRequestId.

        Validation by the engine happens on its thread; a rejection arrives on the handle as
        a ValueError, an acceptance as handle.accepted.

        prepare: runs on the step thread first, prepare(engine) -> (prompt, params) replacing
          both (a chat rendered and tokenized, max_tokens fitted to the prompt); params.n
          must stay the same. Its ValueError rejects the request as the engine's would.
        event: the handle's change event, to share one among the handles of one call.
        pooling: an embedding request (jpaged/pooling.py); its handle gets the embedding.
        lora_request: the LoRA adapter it runs on (jpaged.LoRARequest), None: the base model.
        session: its session's key (jpaged/core/session_pages.py), None: no session.
        """
        if self._draining:
            raise Draining("the server is shutting down")
        if client_id in self._by_client_id:
            raise DuplicateRequestId(f"request_id {client_id!r} is already in flight")
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting()} requests are waiting (max {self.max_waiting})")
        engine_id = f"{client_id}#{next(self._ids)}"
        num_prompt = len(prompt) if isinstance(prompt, list) else 0
        handle = RequestHandle(client_id, engine_id, params.n, num_prompt, event)
        self._handles[engine_id] = handle
        self._by_client_id[client_id] = handle
        self._idle.clear()
        with self._lock:
            self._num_queued_adds += 1
        params = params.clone(output_kind=RequestOutputKind.DELTA)
        extra = {"pooling": pooling, "lora_request": lora_request, "session": session}
        extra = {k: v for k, v in extra.items() if v is not None}
        self._commands.put(("add", engine_id, prompt, params, cache_salt, prepare, extra))
        return handle

    def release(self, handle: RequestHandle) -> None:
        """The handler is done with handle: aborts it in the engine unless it finished."""
        if not handle.finished and handle.error is None:
            self._commands.put(("abort", [handle.engine_id]))
        self._handles.pop(handle.engine_id, None)
        if self._by_client_id.get(handle.client_id) is handle:
            del self._by_client_id[handle.client_id]
        if not self._handles:
            self._idle.set()

    def abort(self, client_ids: list[str]) -> list[str]:
        """Aborts in-flight requests by client id; returns the ids that were in flight."""
        found = [
            self._by_client_id[c] for c in dict.fromkeys(client_ids) if c in self._by_client_id
        ]
        found = [h for h in found if not h.finished and not h.aborted]
        if found:
            self._commands.put(("abort", [h.engine_id for h in found]))
        for h in found:
            h.mark_aborted()
        return [h.client_id for h in found]

    def abort_all(self) -> list[str]:
        return self.abort(list(self._by_client_id))

    def start_draining(self) -> None:
        self._draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) on the step thread and returns its result (or raises its error)."""
        future = self._loop.create_future()
        self._commands.put(("call", fn, future))
        return await future

    def _deliver(
        self,
        outputs: list[RequestOutput],
        errors: list[tuple[str, Exception]],
        accepted: list[tuple[str, int | None]] = (),
    ) -> None:
        for engine_id, num_prompt_tokens in accepted:
            handle = self._handles.get(engine_id)
            if handle is not None:
                handle.accept(num_prompt_tokens)
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is not None and not handle.aborted:
                handle.apply(out)
        for engine_id, error in errors:
            handle = self._handles.get(engine_id)
            if handle is not None:
                handle.fail(error)

    # ---- step-thread side -------------------------------------------------------------

    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        """The step loop: take commands, one engine step, hand the results to the loop."""
        # Engine ids of the requests in the engine. Only this thread touches it.
        self._active: set[str] = set()
        stopping = False
        while not stopping:
            errors: list[tuple[str, Exception]] = []
            accepted: list[tuple[str, int | None]] = []
            commands = self._take_commands(block=not self.engine.has_unfinished_requests())
            for cmd in commands:
                stopping |= self._apply(cmd, errors, accepted)
            if accepted or errors:  # before the step: handlers learn at once
                self._post(self._deliver, [], errors, accepted)
                errors = []
            stepped = not stopping and self.engine.has_unfinished_requests()
            updates = self._step(errors) if stepped else []
            if stopping and self._active:
                errors += self._abort_active(Draining("the server shut down"))
            if (
                stepped
                and self._trim_heap is not None
                and not self.engine.has_unfinished_requests()
            ):
                # The engine went idle: trimmed before the stats say so, so that whoever waits
                # for an idle server reads the trimmed RSS.
                self._trim_heap()
            self._refresh_stats(sum(cmd[0] == "add" for cmd in commands))
            if updates or errors:
                self._post(self._deliver, updates, errors)
        try:  # the KV pages to the disk tier, for a warm restart (none without one)
            flush_to_disk(self.engine)
        except Exception:
            logger.exception("KV disk flush failed")

    def _take_commands(self, *, block: bool) -> list[tuple]:
        """All queued commands; when block (the engine is idle), waits a while for one."""
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, cmd: tuple, errors: list, accepted: list) -> bool:
        """Carries out one command; returns True for "stop"."""
        kind = cmd[0]
        if kind == "add":
            _, engine_id, prompt, params, salt, prepare, extra = cmd
            try:
                if prepare is not None:
                    prompt, params = prepare(self.engine)
                    params = params.clone(output_kind=RequestOutputKind.DELTA)
                self.engine.add_request(engine_id, prompt, params, cache_salt=salt, **extra)
                self._active.add(engine_id)
                accepted.append((engine_id, None if isinstance(prompt, str) else len(prompt)))
            # ValueError is bad input; anything else is an engine bug that must fail this
            # request, not the step thread.
            except Exception as e:  # noqa: BLE001
                errors.append((engine_id, e))
        elif kind == "abort":
            ids = [i for i in cmd[1] if i in self._active]
            if ids:
                self.engine.abort_request(ids)
                self._active.difference_update(ids)
        elif kind == "call":
            _, fn, future = cmd
            try:
                result, exc = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed back to the caller, which maps it
                result, exc = None, e
            self._post(_settle, future, result, exc)
        return kind == "stop"

    def _step(self, errors: list) -> list[RequestOutput]:
        """One engine step (the caller checked that the engine has requests)."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            # An engine that recovers (EngineStepError) dropped e.request_ids and serves new
            # requests; outputs other replicas made in the same step still go out. After any
            # other error every request in the engine fails.
            recovered = isinstance(e, EngineStepError)
            failed = [
                i for i in (e.request_ids if recovered else self._active) if i in self._active
            ]
            logger.exception("engine step failed; failing %d requests", len(failed))
            if not recovered:
                self.engine.abort_request(failed)
            self._active.difference_update(failed)
            errors += [(i, e) for i in failed]
            outputs = e.outputs if recovered else []
        ours = []
        for out in outputs:
            if out.request_id not in self._active:  # not ours, or aborted meanwhile
                continue
            ours.append(out)
            if out.finished:
                self._active.discard(out.request_id)
        return ours

    def _abort_active(self, error: Exception) -> list[tuple[str, Exception]]:
        ids = list(self._active)
        self.engine.abort_request(ids)
        self._active.clear()
        return [(i, error) for i in ids]

    def _refresh_stats(self, num_adds: int) -> None:
        stats = dict(
            self.engine.stats(),
            num_running=self.engine.num_running(),
            num_waiting=self.engine.num_waiting(),
        )
        with self._lock:
            self._num_queued_adds -= num_adds
            self._engine_num_waiting = stats["num_waiting"]
        self.stats = stats  # replaced whole, so readers on other threads see one snapshot
        if self.metrics is not None:
            self.metrics.observe_engine(stats)


def _settle(future: asyncio.Future, result, exc: Exception | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
