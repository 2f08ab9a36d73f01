"""A fake LLMEngine with hand-checkable outputs, for testing the server without a model.

It has the real engine's interface (add_request / abort_request / step / stats ...) and its
contract: one token per running choice per step, outputs by SamplingParams.output_kind
(cumulative snapshots, deltas with the stop-string hold-back, or the final output only),
finished=True exactly once per request, aborted requests never reported, pages freed at once.

Token i (0-based) of choice j of a request is

    (sum(prompt_ids) + offset + i + 7 * j) % vocab_size

where offset is 0 for greedy requests, (31 * seed + 1) % vocab_size for seeded ones and random
otherwise. Token t decodes to " t{t}"; token 2 is EOS and decodes to "" (special). With
logprobs=N each position holds {t: -0.5, t+1: -1.5, ..., t+N-1: -0.5-(N-1)} (ids mod vocab).
Each choice holds ceil(num_tokens / page_size) pages; the prefix cache remembers the full
pages of every admitted prompt (per cache_salt).

Run as a script it serves the fake engine over gRPC and HTTP (the SIGTERM drain test, the
HTTP benchmark of the server's own overhead).
"""

from __future__ import annotations

import math
import random
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sample.sampling_params import RequestOutputKind, SamplingParams

EOS_TOKEN_ID = 2
_WORD = re.compile(r"t(\d+)")


@dataclass(frozen=True)
class FakeModelConfig:
    vocab_size: int
    architecture: str = "FakeForCausalLM"
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,)


class FakeTokenizer:
    """Word "t{N}" <-> token N; any other word encodes to (sum of its bytes) % vocab."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            m = _WORD.fullmatch(word)
            if m and int(m.group(1)) < self.vocab_size:
                ids.append(int(m.group(1)))
            else:
                ids.append(sum(word.encode()) % self.vocab_size)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(token_text(t, skip_special_tokens) for t in ids)


def token_text(token_id: int, skip_special_tokens: bool = True) -> str:
    if token_id == EOS_TOKEN_ID:
        return "" if skip_special_tokens else "</s>"
    return f" t{token_id}"


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    page_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0  # DELTA: what earlier outputs carried
    num_sent_chars: int = 0
    finish_sent: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    offset: int
    choices: list[_Choice]
    num_cached_tokens: int = 0


class FakeEngine:
    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        max_model_len: int = 64,
        page_size: int = 4,
        num_pages: int = 1024,
        max_num_seqs: int = 16,
        step_delay_s: float = 0.0,
    ) -> None:
        self.model_config = FakeModelConfig(vocab_size=vocab_size)
        self.eos_token_ids = self.model_config.eos_token_ids
        self.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
        self.sampling_defaults: dict = {}
        self.tokenizer = FakeTokenizer(vocab_size)
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_num_seqs = max_num_seqs
        self.step_delay_s = step_delay_s
        self._free_pages = list(range(num_pages))
        self._peak_pages_used = 0
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._cached_prefixes: set[tuple] = set()
        self._query_tokens = 0
        self._hit_tokens = 0
        self.num_steps = 0
        # Every accepted request's SamplingParams and cache_salt, for tests to inspect.
        self.received: dict[str, tuple[SamplingParams, str | None]] = {}
        self.sessions: dict[str, str | None] = {}  # every accepted request's session key

    # ---- the LLMEngine interface ------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        session: str | None = None,
    ) -> None:
        if any(r.request_id == request_id for r in self._waiting + self._running):
            raise ValueError(f"request_id {request_id!r} already exists")
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        for t in prompt_ids:
            if not 0 <= t < self.model_config.vocab_size:
                raise ValueError(
                    f"prompt token id {t} is out of range [0, {self.model_config.vocab_size})"
                )
        if params.greedy:
            offset = 0
        elif params.seed is not None:
            offset = (31 * params.seed + 1) % self.model_config.vocab_size
        else:
            offset = random.randrange(self.model_config.vocab_size)
        choices = [_Choice(index=j) for j in range(params.n)]
        for c in choices:
            if params.logprobs is not None:
                c.logprobs, c.cumulative_logprob = [], 0.0
        self._waiting.append(
            _Request(request_id, text, prompt_ids, params, cache_salt, offset, choices)
        )
        self.received[request_id] = (params, cache_salt)
        self.sessions[request_id] = session

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for queue in (self._waiting, self._running):
            for r in [r for r in queue if r.request_id in ids]:
                queue.remove(r)
                self._free(r)

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_steps += 1
        self._admit()
        outputs = []
        for r in list(self._running):
            for c in r.choices:
                if c.finish_reason is None:
                    self._append_token(r, c)
            finished = all(c.finish_reason is not None for c in r.choices)
            out = _output(r, finished)
            if out is not None:
                outputs.append(out)
            if finished:
                self._running.remove(r)
                self._free(r)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def chat_prompt(
        self,
        messages,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra,
    ) -> tuple[str, list[int]]:
        """Renders with the real renderer, as the real engine does: chat_template when given
        (a request's, the server's), else the fake model's ("role: content" pairs)."""
        from models.chat_template import render_chat

        text = render_chat(
            chat_template or self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **extra,
        )
        return text, self.tokenizer.encode(text)

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return (prompt if isinstance(prompt, str) else None), ids

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> dict:
        used = self.num_pages - len(self._free_pages)
        return {
            "pages_total": self.num_pages,
            "pages_used": used,
            "pages_free": len(self._free_pages),
            "pages_cached": 0,
            "peak_pages_used": self._peak_pages_used,
            "prefix_cache_query_tokens": self._query_tokens,
            "prefix_cache_hit_tokens": self._hit_tokens,
            "num_preemptions": 0,
        }

    # ---- internals --------------------------------------------------------------------

    def _pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            r = self._waiting[0]
            need = r.params.n * self._pages_for(len(r.prompt_ids) + 1)
            if need > len(self._free_pages):
                return
            self._waiting.pop(0)
            for c in r.choices:
                self._take_pages(c, self._pages_for(len(r.prompt_ids)))
            r.num_cached_tokens = self._lookup_prefix(r)
            self._query_tokens += len(r.prompt_ids)
            self._hit_tokens += r.num_cached_tokens
            self._running.append(r)

    def _lookup_prefix(self, r: _Request) -> int:
        ps, ids = self.page_size, r.prompt_ids
        hit = 0
        for k in range(1, (len(ids) - 1) // ps + 1):
            if (r.cache_salt, tuple(ids[: k * ps])) not in self._cached_prefixes:
                break
            hit = k * ps
        for k in range(1, len(ids) // ps + 1):
            self._cached_prefixes.add((r.cache_salt, tuple(ids[: k * ps])))
        return hit

    def _take_pages(self, c: _Choice, num: int) -> None:
        if num > len(self._free_pages):
            raise RuntimeError("fake engine is out of pages; give it more")
        for _ in range(num):
            c.page_ids.append(self._free_pages.pop())
        used = self.num_pages - len(self._free_pages)
        self._peak_pages_used = max(self._peak_pages_used, used)

    def _free(self, r: _Request) -> None:
        for c in r.choices:
            self._free_pages.extend(c.page_ids)
            c.page_ids = []

    def _append_token(self, r: _Request, c: _Choice) -> None:
        p, vocab = r.params, self.model_config.vocab_size
        i = len(c.token_ids)
        t = (sum(r.prompt_ids) + r.offset + i + 7 * c.index) % vocab
        c.token_ids.append(t)
        num_tokens = len(r.prompt_ids) + len(c.token_ids)
        if self._pages_for(num_tokens) > len(c.page_ids):
            self._take_pages(c, 1)
        if c.logprobs is not None:
            c.logprobs.append({(t + k) % vocab: -0.5 - k for k in range(max(p.logprobs, 1))})
            c.cumulative_logprob -= 0.5
        prev_len = len(c.text)
        c.text += token_text(t, p.skip_special_tokens)
        may_stop = len(c.token_ids) >= p.min_tokens
        if may_stop and t in p.stop_token_ids:
            c.finish_reason, c.stop_reason = "stop", t
            return
        if may_stop and t == EOS_TOKEN_ID and not p.ignore_eos:
            c.finish_reason = "stop"
            return
        if may_stop:
            # Search only where a new match can be: it must end in the new text.
            for s in p.stop:
                pos = c.text.find(s, max(0, prev_len - len(s) + 1))
                if pos >= 0:
                    end = pos + len(s) if p.include_stop_str_in_output else pos
                    c.text = c.text[:end]
                    c.finish_reason, c.stop_reason = "stop", s
                    return
        if (p.max_tokens is not None and len(c.token_ids) >= p.max_tokens) or (
            num_tokens >= self.max_model_len
        ):
            c.finish_reason = "length"


def _output(r: _Request, finished: bool) -> RequestOutput | None:
    """This step's output of r by its output kind (None: nothing to emit)."""
    kind = r.params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    holdback = max((len(s) for s in r.params.stop), default=1) - 1
    outputs = []
    for c in r.choices:
        text, token_ids, logprobs = c.text, list(c.token_ids), c.logprobs
        if c.finish_reason is None and holdback:
            text = text[: max(len(text) - holdback, 0)]
        if kind is RequestOutputKind.DELTA:
            if c.finish_sent or (len(token_ids) == c.num_sent_tokens and c.finish_reason is None):
                continue
            token_ids = token_ids[c.num_sent_tokens :]
            logprobs = None if logprobs is None else logprobs[c.num_sent_tokens :]
            text, c.num_sent_chars = text[c.num_sent_chars :], len(text)
            c.num_sent_tokens += len(token_ids)
            c.finish_sent = c.finish_reason is not None
        outputs.append(
            CompletionOutput(
                index=c.index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=c.cumulative_logprob,
                logprobs=None if logprobs is None else [dict(d) for d in logprobs],
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    return RequestOutput(
        request_id=r.request_id,
        prompt=r.prompt,
        prompt_token_ids=list(r.prompt_ids),
        outputs=outputs,
        finished=finished,
        num_cached_tokens=r.num_cached_tokens,
    )


def offline_generate(
    prompt: str | list[int], params: SamplingParams, **engine_kwargs
) -> RequestOutput:
    """Runs one request to completion on a fresh fake engine: the offline-API reference."""
    engine = FakeEngine(**engine_kwargs)
    engine.add_request("offline", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def main(argv: list[str]) -> int:
    """Serves a FakeEngine: `python fake_engine.py --step-delay S [serve flags]`."""
    import argparse

    from server import app
    from server.logs import configure_logging

    parser = argparse.ArgumentParser()
    parser.add_argument("--step-delay", type=float, default=0.01)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=1024)
    app.add_server_args(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    engine = FakeEngine(
        step_delay_s=args.step_delay,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_pages=args.num_pages,
    )
    name = args.served_model_name or "fake"
    return app.run(engine, app.ServerOptions.from_args(args), model_name=name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
