"""OpenAI response shapes: one request's choices, from its RequestHandles to JSON.

An Assembler owns the client's view of one request: choice i * n + j is choice j of prompt i
(OpenAI's numbering), each choice's text arrives through ChoiceState.take() exactly once, and
each choice's finish_reason is reported exactly once, on its last delta (a choice cut off by
an abort reports "abort"). Streaming sends the role first (chat), then one chunk per choice
that progressed, then, when asked, a usage chunk with no choices, then `data: [DONE]`; a
non-streamed response is the same deltas taken once at the end. Token texts for logprobs
are decoded by the caller (on the engine thread) and passed in. A completion that echoes its
prompt with logprobs holds the echo back until the engine's prompt logprobs arrived (they
come with the first token), so the echoed tokens carry them as OpenAI's do: the first prompt
token's logprob and top_logprobs are null. A chat with tools (a ToolPlan) reads each choice's
text through its own ToolCallStream: content and tool-call deltas (one chunk each) while
streaming, message.content and message.tool_calls at the end, finish_reason as the plan says.
A chat on a server with a reasoning parser first splits each choice's text by its own
ReasoningStream (server/reasoning_parsers.py): the reasoning goes out as `reasoning` (and the
older `reasoning_content`) deltas and message fields, and only the content reaches the tool
calls' reader.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING

from server.engine_loop import ChoiceState, RequestHandle
from server.reasoning_parsers import reasoning_tokens
from server.tool_parsers import ToolCallStream

if TYPE_CHECKING:
    from server.reasoning_parsers import Reasoning, ReasoningStream
    from server.tool_calls import ToolPlan

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event carrying obj as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclasses.dataclass
class Delta:
    """What one choice gained since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None  # set on the choice's last delta only
    stop_reason: int | str | None
    # echo with logprobs, on the delta that carries the echo: the prompt's token ids and
    # their logprobs ([None, {id: logprob} ...]; all None if the request ended before them)
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclasses.dataclass
class _Cursor:
    handle: RequestHandle
    state: ChoiceState
    index: int
    echo: str | None  # prompt text still to send before the choice's own text
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    done: bool = False


class Assembler:
    """One request's choices across its handles (one handle per prompt)."""

    def __init__(
        self,
        kind: str,  # "chat" or "completion"
        request_id: str,
        model: str,
        handles: list[RequestHandle],
        *,
        echo_texts: list[str | None] | None = None,
        num_logprobs: int | None = None,
        prompt_logprobs: int | None = None,  # chat's (vLLM's), non-streamed
        return_token_ids: bool = False,
        include_usage: bool = False,
        continuous_usage: bool = False,
        tool_plan: ToolPlan | None = None,
        reasoning: Reasoning | None = None,  # chat on a server with --reasoning-parser
    ) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.handles = handles
        self.created = int(time.time())
        self.num_logprobs = num_logprobs
        self.prompt_logprobs = prompt_logprobs if kind == "chat" else None
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        n = len(handles[0].choices)
        echo_texts = echo_texts or [None] * len(handles)
        self._cursors = [
            _Cursor(h, c, i * n + c.index, echo_texts[i])
            for i, h in enumerate(handles)
            for c in h.choices
        ]
        self._object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # chat with tools: each choice's text read into content and tool calls
        self._tool_plan = tool_plan
        self._tools: dict[int, ToolCallStream] = {}
        if tool_plan is not None:
            for cur in self._cursors:
                stream = tool_plan.stream()
                if stream is not None:
                    self._tools[cur.index] = stream
        self._echo_logprobs = kind == "completion" and num_logprobs is not None
        # chat with a reasoning parser: each choice's text split before anything reads it
        self._reasoning: dict[int, ReasoningStream] | None = None
        if reasoning is not None and kind == "chat":
            self._reasoning = {cur.index: reasoning.stream() for cur in self._cursors}

    @property
    def done(self) -> bool:
        return all(c.done for c in self._cursors)

    def take(self) -> list[Delta]:
        """Every choice's news since the last take (finish reasons included, once)."""
        deltas = []
        for cur in self._cursors:
            if cur.done:
                continue
            reason = cur.state.finish_reason
            if reason is None and cur.handle.aborted:
                reason = "abort"
            echo_logprobs = cur.echo is not None and self._echo_logprobs
            if echo_logprobs and cur.handle.prompt_logprobs is None and reason is None:
                continue  # the echo waits for the prompt's logprobs
            text, ids, logprobs = cur.state.take()
            prompt_ids = prompt_logprobs = None
            if echo_logprobs:
                prompt_ids = list(cur.handle.prompt_token_ids or [])
                prompt_logprobs = cur.handle.prompt_logprobs or [None] * len(prompt_ids)
            if cur.echo is not None:
                text, cur.echo = cur.echo + text, None
            if not (text or ids or reason):
                continue
            cur.done = reason is not None
            deltas.append(
                Delta(
                    cur.index,
                    text,
                    ids,
                    logprobs,
                    reason,
                    cur.state.stop_reason,
                    prompt_ids,
                    prompt_logprobs,
                )
            )
        return deltas

    def ids_to_decode(self, deltas: list[Delta]) -> set[int]:
        """Token ids whose text the logprobs of deltas name (none without logprobs)."""
        ids = set()
        if self.prompt_logprobs is not None:
            for h in self.handles:
                for position in h.prompt_logprobs or ():
                    ids.update(position or ())
        if self.num_logprobs is None:
            return ids
        for d in deltas:
            ids.update(d.token_ids, d.prompt_ids or ())
            for position in [*d.logprobs, *(d.prompt_logprobs or ())]:
                ids.update(position or ())
        return ids

    # ---- streaming ----------------------------------------------------------------------

    def role_chunks(self) -> bytes:
        """Chat's first chunk per choice: the assistant role and empty content."""
        return b"".join(
            sse(
                self._chunk(
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
            for c in self._cursors
        )

    def chunks(self, deltas: list[Delta], texts: dict[int, str]) -> bytes:
        """One chunk per delta, as server-sent events."""
        out = []
        for d in deltas:
            if self.kind != "chat":
                parts = [{"text": d.text}]
            elif self._reasoning is not None:
                parts = self._reasoning_deltas(d)
            elif d.index in self._tools:
                parts = self._tool_deltas(d, d.text)
            else:
                parts = [{"delta": {"content": d.text} if d.text else {}}]
            last = {"logprobs": self._logprobs(d, texts), "finish_reason": self._finish(d)}
            if d.finish_reason is not None:
                last["stop_reason"] = d.stop_reason
            if self.return_token_ids:
                last["token_ids"] = d.token_ids
            for i, part in enumerate(parts):
                choice = {"index": d.index, **part}
                choice.update(last if i == len(parts) - 1 else {"logprobs": None,
                                                                "finish_reason": None})  # fmt: skip
                out.append(sse(self._chunk([choice])))
        return b"".join(out)

    def _tool_deltas(self, d: Delta, text: str) -> list[dict]:
        """A choice's content and tool-call deltas from text (its delta's content), one chunk
        each (at least one chunk when the delta carries a finish, logprobs or token ids)."""
        content, calls = self._tools[d.index].feed(text, final=d.finish_reason is not None)
        parts = [{"delta": {"content": content}}] if content else []
        parts += [{"delta": {"tool_calls": [call]}} for call in calls]
        return parts or self._bare(d)

    def _reasoning_deltas(self, d: Delta) -> list[dict]:
        """A reasoning delta, then the content's (or its tool calls'), one chunk each; no
        chunk while the text is held back (a tag may be starting) unless the delta carries a
        finish, logprobs or token ids."""
        reasoning, content = self._reasoning[d.index].feed(
            d.text, final=d.finish_reason is not None
        )
        parts = []
        if reasoning:
            parts.append({"delta": {"reasoning": reasoning, "reasoning_content": reasoning}})
        if d.index in self._tools:
            return parts + [p for p in self._tool_deltas(d, content) if p["delta"] or not parts]
        if content:
            parts.append({"delta": {"content": content}})
        return parts or self._bare(d)

    def _bare(self, d: Delta) -> list[dict]:
        """One empty delta when d carries something else a client needs, else none."""
        carries = d.finish_reason is not None or self.num_logprobs is not None
        return [{"delta": {}}] if carries or self.return_token_ids else []

    def _finish(self, d: Delta) -> str | None:
        stream = self._tools.get(d.index)
        if stream is None or d.finish_reason is None:
            return d.finish_reason
        return self._tool_plan.finish_reason(d.finish_reason, bool(stream.calls))

    def usage_chunk(self) -> bytes:
        chunk = self._chunk([])
        chunk["usage"] = self.usage()
        return sse(chunk)

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {
            "id": self.request_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = self.usage() if self.continuous_usage else None
        return chunk

    # ---- whole responses ----------------------------------------------------------------

    def response(self, deltas: list[Delta], texts: dict[int, str]) -> dict:
        """The non-streamed response: deltas holds each choice's whole output."""
        choices = []
        for d in sorted(deltas, key=lambda d: d.index):
            if self.kind != "chat":
                choice = {"index": d.index, "text": d.text}
            else:
                choice = {"index": d.index, "message": self._message(d)}
            choice.update(
                logprobs=self._logprobs(d, texts),
                finish_reason=self._finish(d),
                stop_reason=d.stop_reason,
            )
            if self.return_token_ids:
                choice["token_ids"] = d.token_ids
            choices.append(choice)
        body = {
            "id": self.request_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.prompt_logprobs is not None:
            handle = self.handles[0]
            body["prompt_logprobs"] = [
                None if p is None else _ranked(p, t, self.prompt_logprobs, texts)
                for t, p in zip(handle.prompt_token_ids or (), handle.prompt_logprobs or ())
            ]
        return body

    def _message(self, d: Delta) -> dict:
        """A chat choice's message from its whole text: the reasoning (with a reasoning
        parser), the content, the tool calls (with a tool plan that reads them)."""
        text, reasoning = d.text, None
        if self._reasoning is not None:
            stream = self._reasoning[d.index]
            stream.feed(d.text, final=True)
            reasoning, text = stream.reasoning, stream.content
        calls = None
        content: str | None = text
        if d.index in self._tools:
            tools = self._tools[d.index]
            tools.feed(text, final=True)
            content, calls = tools.content, tools.calls
        if reasoning is not None and not content:
            content = None  # the output ended with its reasoning (vLLM's)
        message = {"role": "assistant", "content": content}
        if self._reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message

    def usage(self) -> dict:
        prompt = sum(h.num_prompt_tokens for h in self.handles)
        completion = sum(c.num_tokens for h in self.handles for c in h.choices)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(h.num_cached_tokens for h in self.handles)
            },
        }
        if self._reasoning is not None:  # OpenAI's count of the completion's reasoning
            thought = sum(reasoning_tokens(self._reasoning[cur.index], cur.state)
                          for cur in self._cursors)  # fmt: skip
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}
        return usage

    # ---- logprobs -----------------------------------------------------------------------

    def _logprobs(self, d: Delta, texts: dict[int, str]) -> dict | None:
        if self.num_logprobs is None:
            return None
        if self.kind == "chat":
            return {
                "content": [self._chat_entry(t, p, texts) for t, p in zip(d.token_ids, d.logprobs)]
            }
        cur = next(c for c in self._cursors if c.index == d.index)
        # the echoed prompt's tokens first (echo with logprobs), then the choice's own
        token_ids = [*(d.prompt_ids or ()), *d.token_ids]
        positions = [*(d.prompt_logprobs or ()), *d.logprobs]
        tokens, offsets = [], []
        for t in token_ids:
            tokens.append(texts[t])
            offsets.append(cur.text_offset)
            cur.text_offset += len(texts[t])
        return {
            "tokens": tokens,
            "token_logprobs": [
                None if p is None else p.get(t) for t, p in zip(token_ids, positions)
            ],
            # the chosen token and the num_logprobs most likely, as OpenAI's completions do
            "top_logprobs": [
                None if p is None else {texts[k]: v for k, v in _best(p, len(p))} for p in positions
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, position: dict[int, float], texts: dict[int, str]) -> dict:
        def entry(t: int, lp: float) -> dict:
            return {"token": texts[t], "logprob": lp, "bytes": list(texts[t].encode())}

        top = [entry(t, lp) for t, lp in _best(position, self.num_logprobs)]
        return {**entry(token, position.get(token)), "top_logprobs": top}


def _ranked(position: dict[int, float], token: int, k: int, texts: dict[int, str]) -> dict:
    """vLLM's prompt logprobs of one position: {id: {"logprob", "rank", "decoded_token"}}
    for the prompt's token and the k most likely. rank is 1 for the most likely; the prompt's
    token, when it is not among the k, has rank null (the engine does not compute it)."""
    top = [t for t, _ in _best({t: v for t, v in position.items() if t != token}, k)]
    if token in position and len(position) <= k:  # it is among the k most likely
        top = [t for t, _ in _best(position, k)]
    out = {}
    for t in dict.fromkeys([token, *top]):
        if t in position:
            rank = top.index(t) + 1 if t in top else None
            out[str(t)] = {"logprob": position[t], "rank": rank, "decoded_token": texts[t]}
    return out


def _best(position: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely (token, logprob) of one position, most likely first."""
    return sorted(position.items(), key=lambda kv: -kv[1])[:k]
