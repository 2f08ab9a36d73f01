"""Tool calls read out of a model's text: the hermes, llama3_json and mistral formats, and
the JSON that "required" and named tool_choice decode under a grammar.

A parser is a pure function of the text so far: parse(text, final) -> Parsed, the content
and the calls in it. With final=False it leaves out whatever a later token could still
change (a suffix that may begin a call's markup, whitespace that may sit before a call, a
call whose name is not complete), so successive parses only ever extend what an earlier one
gave: content grows at its end, a call's arguments grow at their end. ToolCallStream turns
that into OpenAI's deltas; the non-streamed answer is one parse with final=True, so the
streamed fragments of a well-formed call concatenate to the non-streamed arguments.

What counts as a call: a JSON object with a string "name" and an object (or JSON-text
string) "arguments" or "parameters"; its arguments are the model's own text of that object,
so nothing is re-serialised. Text that does not parse as a call stays content, markup and
all. Whitespace next to a call is not content; content is None when only calls came.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from collections.abc import Callable

_DECODER = json.JSONDecoder()
# A call's opening up to its arguments' value: {"name": "f", "arguments": (or "parameters")
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = " \t\r\n"


@dataclasses.dataclass
class ParsedCall:
    start: int  # where the call's text starts: its identity between parses
    name: str | None  # None until the name is complete
    arguments: str  # JSON text (so far, while open)
    done: bool


@dataclasses.dataclass
class Parsed:
    content: str
    calls: list[ParsedCall]


class ToolParser:
    """A format: parse(text, final) -> Parsed (see the module docstring)."""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


# ---- one call -----------------------------------------------------------------------------


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def complete_call(text: str, i: int) -> tuple[ParsedCall | None, int | None]:
    """The JSON value that starts at text[i]: (the call, its end) when it is a call,
    (None, its end) when it is whole JSON but not a call, (None, None) when it is not (yet)
    whole JSON."""
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return None, None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, end
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    head = _HEAD.match(text, i)
    if isinstance(args, dict) and head is not None and text.startswith("{", head.end()):
        _, args_end = _DECODER.raw_decode(text, head.end())
        arguments = text[head.end() : args_end]
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    elif isinstance(args, str):  # the arguments as JSON text, as OpenAI sends them
        try:
            if not isinstance(json.loads(args), dict):
                return None, end
        except ValueError:
            return None, end
        arguments = args
    else:
        return None, end
    return ParsedCall(i, obj["name"], arguments, True), end


def open_call(text: str, i: int) -> ParsedCall:
    """A call still being written from text[i]: its name once complete, and the text of its
    arguments object so far (all of it belongs to the object while the object is open)."""
    head = _HEAD.match(text, i)
    if head is None:
        return ParsedCall(i, None, "", False)
    name = json.loads(head.group(1))
    start = head.end()
    arguments = ""
    if text.startswith("{", start):
        try:
            _, end = _DECODER.raw_decode(text, start)
            arguments = text[start:end]
        except ValueError:
            arguments = text[start:]
    return ParsedCall(i, name, arguments, False)


def call_prefix(text: str, i: int) -> str:
    """Whether the object starting at text[i] opens like a call ({"name": ...): "yes",
    "no", or "maybe" when the text ends before it can tell."""
    rest = text[i + 1 :].lstrip(_WS)
    key = '"name"'
    if len(rest) < len(key):
        return "maybe" if key.startswith(rest) else "no"
    if not rest.startswith(key):
        return "no"
    rest = rest[len(key) :].lstrip(_WS)
    if not rest:
        return "maybe"
    return "yes" if rest[0] == ":" else "no"


# ---- content ------------------------------------------------------------------------------


class _Builder:
    """Content segments and calls in text order; whitespace next to a call is dropped."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: list[ParsedCall] = []
        self._after_call = False

    def text(self, segment: str) -> None:
        if self._after_call:
            segment = segment.lstrip(_WS)
        if segment:
            self.parts.append(segment)
            self._after_call = False

    def call(self, call: ParsedCall) -> None:
        if self.parts:
            self.parts[-1] = self.parts[-1].rstrip(_WS)
        self.calls.append(call)
        self._after_call = True

    def pending(self) -> Parsed:
        """Stops before text that may still become a call (or sit before one)."""
        if self.parts:
            self.parts[-1] = self.parts[-1].rstrip(_WS)
        return self.result()

    def result(self) -> Parsed:
        return Parsed("".join(self.parts), self.calls)


def _held(tail: str, markers: tuple[str, ...]) -> int:
    """How many of tail's last characters may begin one of markers."""
    for n in range(min(len(tail), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(tail[-n:]) for m in markers):
            return n
    return 0


# ---- formats ------------------------------------------------------------------------------


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5 / 3,
    Hermes, SmolLM style), any number, text around them. A block cut off by the end of the
    output counts when its JSON is whole."""

    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        out, pos = _Builder(), 0
        while True:
            k = text.find(self.START, pos)
            if k < 0:
                tail = text[pos:]
                if final:
                    out.text(tail)
                    return out.result()
                out.text(tail[: len(tail) - _held(tail, (self.START,))])
                return out.pending()
            out.text(text[pos:k])
            body = _skip_ws(text, k + len(self.START))
            e = text.find(self.END, body)
            call, end = complete_call(text, body)
            if e < 0 and not final:  # the block is still being written
                if call is None and end is None and (body == len(text) or text[body] == "{"):
                    call = open_call(text, body)
                if call is not None:
                    call.done = False
                    out.call(call)
                return out.pending()
            stop = e if e >= 0 else len(text)
            if call is not None and not text[end:stop].strip(_WS):
                out.call(call)
            else:  # not a call: the block stays content, tags and all
                out.text(text[k : stop + len(self.END) if e >= 0 else stop])
            if e < 0:
                return out.result()
            pos = e + len(self.END)


class _SequenceParser(ToolParser):
    """Calls written as bare JSON objects after a start (a marker, or a call's own opening),
    separated by `sep`, inside [ ] when `array`. What does not parse is content from the
    section's start (its first call) or from the call that fails (a later one)."""

    markers: tuple[str, ...] = ()
    sep = ";"
    array = False

    def parse(self, text: str, final: bool) -> Parsed:
        out, pos = _Builder(), 0
        while True:
            kind, k, i = self._find(text, pos, final)
            if kind is None:
                tail = text[pos:]
                if final:
                    out.text(tail)
                    return out.result()
                held = _held(tail, self.markers) if self.markers else 0
                out.text(tail[: len(tail) - held])
                return out.pending()
            out.text(text[pos:k])
            if kind == "wait":  # text from k may still open a call
                return out.pending()
            pos = self._section(text, k, i, final, out)
            if pos is None:
                return out.pending()

    def _find(self, text: str, pos: int, final: bool) -> tuple[str | None, int, int]:
        """("start", markup start, first call) of the next section from pos, ("wait", k, k)
        when the text from k may still become one, or (None, 0, 0)."""
        best = (None, 0, 0)
        for m in self.markers:
            k = text.find(m, pos)
            if k >= 0 and (best[0] is None or k < best[1]):
                best = ("start", k, _skip_ws(text, k + len(m)))
        bare = self._bare(text, pos, final, best[1] if best[0] else len(text))
        return bare if bare is not None else best

    def _bare(self, text: str, pos: int, final: bool, limit: int):
        """A section that starts without a marker, before limit: ("start", k, i),
        ("wait", k, k) or None."""
        return

    def _section(self, text: str, k: int, i: int, final: bool, out: _Builder) -> int | None:
        """Reads the calls from text[i]; returns where content resumes, or None when the
        text ended inside the section (not final)."""
        if not self.array:
            return self._calls(text, k, i, final, out, closing=None)
        if i == len(text) and not final:
            return None
        if text.startswith("[", i):
            return self._calls(text, k, i + 1, final, out, closing="]")
        if text.startswith("{", i):  # one call without the brackets
            return self._calls(text, k, i, final, out, closing=None)
        if i == k:  # a bare start that is not a call after all
            return self._bad(text, k, out)
        out.text(text[k:i])  # a marker and no call
        return i

    def _calls(self, text, k, i, final, out: _Builder, closing: str | None) -> int | None:
        first = True
        while True:
            i = _skip_ws(text, i)
            if i == len(text):
                if not final:
                    return None
                return self._bad(text, k, out) if first else i
            call, end = complete_call(text, i) if text.startswith("{", i) else (None, i)
            if call is None:
                if end is None and not final:
                    out.call(open_call(text, i))
                    return None
                return self._bad(text, k if first else i, out)
            out.call(call)
            first = False
            j = _skip_ws(text, end)
            if j == len(text):
                if not final:
                    call.done = False
                    return None
                return j
            if text.startswith(self.sep, j):
                i = j + len(self.sep)
            elif closing is not None and text.startswith(closing, j):
                return j + len(closing)
            else:
                return end

    @staticmethod
    def _bad(text: str, i: int, out: _Builder) -> int:
        out.text(text[i:])
        return len(text)


class Llama3JsonParser(_SequenceParser):
    """Llama 3.1 / 3.2 JSON tool calls: `{"name": ..., "parameters": {...}}` (or
    "arguments"), optionally after <|python_tag|>, several separated by ';'."""

    markers = ("<|python_tag|>",)
    sep = ";"

    def _bare(self, text: str, pos: int, final: bool, limit: int):
        k = text.find("{", pos, limit)
        while k >= 0:
            state = call_prefix(text, k)
            if state == "yes":
                return ("start", k, k)
            if state == "maybe" and not final:
                return ("wait", k, k)
            k = text.find("{", k + 1, limit)
        return None


class MistralParser(_SequenceParser):
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; also the array
    alone at the start of the output (the marker is a special token, which leaves the text
    when special tokens are skipped)."""

    markers = ("[TOOL_CALLS]",)
    sep = ","
    array = True

    def _bare(self, text: str, pos: int, final: bool, limit: int):
        if pos != 0:
            return None
        k = _skip_ws(text, 0)
        i = _skip_ws(text, k + 1)
        if k == len(text) or (text[k] == "[" and i == len(text)):
            return None if final else ("wait", k, k)
        if text[k] != "[" or text[i] != "{":
            return None
        state = call_prefix(text, i)
        if state == "yes":
            return ("start", k, k)
        return ("wait", k, k) if state == "maybe" and not final else None


class RequiredParser(_SequenceParser):
    """tool_choice "required": the grammar's `[{"name": ..., "parameters": {...}}, ...]`."""

    sep = ","
    array = True

    def _bare(self, text: str, pos: int, final: bool, limit: int):
        return ("start", 0, _skip_ws(text, 0)) if pos == 0 else None


class NamedParser(ToolParser):
    """A named tool_choice: the whole output is the function's arguments object."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ParsedCall(0, self.name, text, final)])


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


# ---- OpenAI's shapes ----------------------------------------------------------------------


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Mistral's templates take 9 letters and digits."""
    chars = string.ascii_letters + string.digits
    return "".join(secrets.choice(chars) for _ in range(9))


class ToolCallStream:
    """One choice's text -> content and tool calls, by a parser (module docstring).

    feed(delta, final) returns the content to send and the tool-call deltas (OpenAI's
    `delta.tool_calls` items: the first for a call has index, id, type and name with empty
    arguments, the next ones argument fragments). Feeding the whole text once with
    final=True gives the non-streamed answer (content, calls).
    """

    def __init__(
        self,
        parser: ToolParser,
        *,
        max_calls: int | None = None,
        new_id: Callable[[], str] = openai_call_id,
    ) -> None:
        self._parser = parser
        self._max_calls = max_calls
        self._new_id = new_id
        self._text = ""
        self._sent_content = ""
        self._sent: dict[int, list] = {}  # call start -> [index, id, arguments sent]
        self.content: str | None = None
        self.calls: list[dict] = []

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self._text += delta
        parsed = self._parser.parse(self._text, final)
        calls = parsed.calls[: self._max_calls]
        content = parsed.content
        new_content = content[len(self._sent_content) :]
        self._sent_content = content if content.startswith(self._sent_content) else (
            self._sent_content + new_content
        )  # fmt: skip
        deltas = []
        for call in calls:
            if call.name is None:
                break  # later calls wait for this one's name
            sent = self._sent.get(call.start)
            if sent is None:
                sent = self._sent[call.start] = [len(self._sent), self._new_id(), ""]
                deltas.append(
                    {
                        "index": sent[0],
                        "id": sent[1],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            if call.arguments.startswith(sent[2]) and len(call.arguments) > len(sent[2]):
                fragment = call.arguments[len(sent[2]) :]
                sent[2] = call.arguments
                deltas.append({"index": sent[0], "function": {"arguments": fragment}})
        if final:
            self.calls = [
                {
                    "id": self._sent[c.start][1],
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
                if c.start in self._sent
            ]
            self.content = None if self.calls and not content else content
        return new_content, deltas
