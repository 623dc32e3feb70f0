"""Tool calls in a model's reply, read as it streams, and the grammar that forces them.

    calls = parse_tool_calls(text, names)   # [ToolCall(name, arguments)] or None
    reader = ToolCallStream(names)          # streamed: reader.push(piece) -> OpenAI deltas,
    calls = reader.finish()                 # then the calls (or None: the reply is text)
    schema = tool_call_schema(tools, only)  # JSON schema of a call, for constrained decoding

Llama 3.2 1B/3B answer a tool prompt in one of two forms (vLLM issue #9991):
    {"name": "get_weather", "parameters": {"city": "Paris"}}      (JSON; "arguments" too)
    [get_weather(city="Paris"), get_time(zone="CET")]             (pythonic)
optionally after <|python_tag|>; several JSON calls separated by ";" or new lines, or
as a JSON list. Qwen 2.5 / 3 (and Hermes) wrap each JSON call in tags, after a <think>
block in Qwen 3's thinking mode (the reasoning is not part of the calls):
    <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
Every argument of the pythonic form is read by ast.literal_eval: literals only, nothing
is ever evaluated.

One reader, ToolCallStream, serves both the streamed and the whole reply, so a call's
`arguments` text is the same either way: in the JSON form it is the model's own text of
the arguments object (streamed as it is generated), in the pythonic form the JSON of
each argument, streamed as each value completes.
"""
from __future__ import annotations

import ast
import json
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from .schema_copy import copy_schema

MAX_CALL_CHARS = 1 << 20   # longer replies are not read as calls
_MAX_TAG = 16              # characters of a tag's name: <|python_tag|>, <tool_call>...


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    arguments_text: str | None = field(default=None, compare=False)   # JSON of arguments
    id: str = field(default_factory=_new_id, compare=False)

    def __post_init__(self):
        if self.arguments_text is None:
            self.arguments_text = json.dumps(self.arguments, ensure_ascii=False)

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's shape: {"id", "type": "function", "function": {name, arguments (JSON text)}}."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments_text}}
        return out if index is None else {"index": index, **out}


class _NotACall(Exception):
    """The text read so far cannot be (only) tool calls."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_object(text: str) -> dict:
    """`text` as a JSON object (strict JSON: no NaN or Infinity), else _NotACall."""
    try:
        v = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise _NotACall from None
    if not isinstance(v, dict):
        raise _NotACall
    return v


@dataclass
class _Call:
    id: str = field(default_factory=_new_id)
    name: str | None = None
    arguments: list[str] = field(default_factory=list)   # pieces of the arguments' JSON text
    sent: int = 0            # pieces already reported
    announced: bool = False  # its first delta (id, name) has been reported
    parsed: dict | None = None


class ToolCallStream:
    """Reads a reply piece by piece and reports the tool calls in it as OpenAI streams
    them: per call a first delta {index, id, type: "function", function: {name,
    arguments: ""}} once its name is read, then {index, function: {arguments: fragment}}
    as its arguments are. The fragments of a call join to its final `arguments`.

    `names`: every call must name one of them. `parallel`: False reports only the first
    call. A call is announced only once the reply can be nothing but calls up to its
    name; if the reply then stops being one (a malformed continuation, max_tokens),
    finish() returns None and the deltas already sent stay incomplete (as OpenAI's
    streams end at max_tokens). The reader is a generator fed one character at a time."""

    def __init__(self, names: Collection[str] | None = None, parallel: bool = True):
        self.names, self.parallel = names, parallel
        self.calls: list[_Call] = []
        self.failed = False
        self._size = 0
        self._reader = self._read()
        next(self._reader)

    @property
    def announced(self) -> bool:
        """A call's first delta has been reported: the reply is taken for calls."""
        return any(c.announced for c in self.calls)

    @property
    def is_text(self) -> bool:
        """The reply is not calls, and no call was announced: send it as content."""
        return self.failed and not self.announced

    def push(self, text: str) -> list[dict]:
        """Read more of the reply; the tool_calls deltas it completes."""
        self._size += len(text)
        if self._size > MAX_CALL_CHARS:
            self.failed = True
        for c in text:
            if self.failed:
                return []   # nothing more of a call that broke off
            self._send(c)
        return [] if self.failed else self._deltas()

    def finish(self) -> list[ToolCall] | None:
        """The end of the reply: its calls, or None if it is not (only) calls."""
        if not self.failed:
            self._send(None)
        if self.failed:
            return None
        calls = self.calls if self.parallel else self.calls[:1]
        return [ToolCall(c.name, c.parsed, "".join(c.arguments), c.id) for c in calls]

    def _send(self, c: str | None) -> None:
        try:
            self._reader.send(c)
        except _NotACall:
            self.failed = True
        except StopIteration:   # read to its end: more text is not calls
            if c is not None:
                self.failed = True

    def _deltas(self) -> list[dict]:
        out = []
        for i, call in enumerate(self.calls if self.parallel else self.calls[:1]):
            if call.name is None:
                continue
            if not call.announced:
                call.announced = True
                out.append({"index": i, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            if call.sent < len(call.arguments):
                out.append({"index": i, "function": {
                    "arguments": "".join(call.arguments[call.sent:])}})
                call.sent = len(call.arguments)
        return out

    # -- the grammar of a reply that is calls, as generators taking one character a time
    #    (None: the end of the reply); each raises _NotACall where the text departs from it

    def _read(self):
        c = yield from self._space((yield))
        if c == "<":
            tag = yield from self._tag()
            if tag == "think":      # Qwen 3's reasoning, then its calls
                yield from self._skip_past("</think>")
                if (yield from self._space((yield))) != "<":
                    raise _NotACall
                tag = yield from self._tag()
            if tag == "tool_call":
                yield from self._tagged_calls()
                return
            if tag != "|python_tag|":   # streamed text never holds it: a control token
                raise _NotACall
            c = yield from self._space((yield))
        if c == "{":   # one JSON call, or several separated by ";" or new lines
            while True:
                yield from self._json_call()
                c, newline = yield from self._space((yield), True)
                if c == ";":
                    c = yield from self._space((yield))
                elif c is not None and not newline:
                    raise _NotACall
                if c is None:
                    return
                if c != "{":
                    raise _NotACall
        if c != "[":
            raise _NotACall
        c = yield from self._space((yield))
        if c == "{":   # a JSON list of calls
            while True:
                yield from self._json_call()
                c = yield from self._space((yield))
                if c == "]":
                    break
                if c != "," or (c := (yield from self._space((yield)))) != "{":
                    raise _NotACall
        else:          # pythonic: [f(a=1), g(b="x")]
            while True:
                c = yield from self._python_call(c)
                if c == ",":
                    c = yield from self._space((yield))
                elif c != "]":
                    raise _NotACall
                if c == "]":
                    break
        if (yield from self._space((yield))) is not None:
            raise _NotACall

    def _tag(self):
        """The name of a tag whose "<" was read, up to its ">"."""
        name = []
        while (c := (yield)) != ">":
            if c is None or len(name) == _MAX_TAG:
                raise _NotACall
            name.append(c)
        return "".join(name)

    def _skip_past(self, end: str):
        seen = ""
        while not seen.endswith(end):
            c = yield
            if c is None:
                raise _NotACall
            seen = seen[1 - len(end):] + c

    def _tagged_calls(self):
        """Qwen's calls, the first "<tool_call>" read: each a JSON call closed by
        "</tool_call>", the next opened after space."""
        while True:
            if (yield from self._space((yield))) != "{":
                raise _NotACall
            yield from self._json_call()
            if (yield from self._space((yield))) != "<" or (yield from self._tag()) != "/tool_call":
                raise _NotACall
            c = yield from self._space((yield))
            if c is None:
                return
            if c != "<" or (yield from self._tag()) != "tool_call":
                raise _NotACall

    def _space(self, c, report_newline: bool = False):
        newline = False
        while c is not None and c.isspace():
            newline = newline or c == "\n"
            c = yield
        return (c, newline) if report_newline else c

    def _new_call(self) -> _Call:
        call = _Call()
        self.calls.append(call)
        return call

    def _named(self, call: _Call, name: Any) -> None:
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            raise _NotACall
        call.name = name

    def _string(self, quote: str):
        """A string whose opening quote was read: its text with the quotes."""
        out, escaped = [quote], False
        while True:
            c = yield
            if c is None:
                raise _NotACall
            out.append(c)
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                return "".join(out)

    def _value(self, c, ends: str, quotes: str, sink: list[str] | None = None):
        """One value from its first character `c` to the first of `ends` outside brackets
        and strings: (its text, that character). With `sink`, the value's characters go
        there as they are read (a bracketed value or a string: only space may follow)."""
        text, depth, quote, escaped, closed = [], 0, None, False, False
        while True:
            if c is None:
                raise _NotACall
            if quote is None and depth == 0 and c in ends:
                return "".join(text).strip(), c
            if sink is not None:
                if closed and not c.isspace():
                    raise _NotACall
                if not closed:
                    sink.append(c)
            text.append(c)
            if quote is not None:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == quote:
                    quote, closed = None, depth == 0
            elif c in quotes:
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    raise _NotACall
                depth -= 1
                closed = depth == 0
            c = yield

    def _json_call(self):
        """{"name": ..., "parameters": {...}} ("arguments" too, as an object or its JSON
        text; "type": "function" allowed), its "{" read."""
        call, seen = self._new_call(), set()
        c = yield from self._space((yield))
        while True:
            if c != '"':
                raise _NotACall
            try:
                key = json.loads((yield from self._string('"')))
            except ValueError:
                raise _NotACall from None
            if key in seen or key not in ("name", "parameters", "arguments", "type"):
                raise _NotACall
            if key in ("parameters", "arguments"):
                seen |= {"parameters", "arguments"}
            seen.add(key)
            if (yield from self._space((yield))) != ":":
                raise _NotACall
            c = yield from self._space((yield))
            if key in ("parameters", "arguments") and c == "{":
                text, c = yield from self._value(c, ",}", '"', call.arguments)
                call.parsed = _json_object(text)
            else:
                text, c = yield from self._value(c, ",}", '"')
                try:
                    v = json.loads(text, parse_constant=_no_constant)
                except (ValueError, RecursionError):
                    raise _NotACall from None
                if key == "name":
                    self._named(call, v)
                elif key == "type":
                    if v not in (None, "function"):
                        raise _NotACall
                elif not isinstance(v, str):
                    raise _NotACall
                else:   # the arguments as JSON text
                    call.parsed = _json_object(v)
                    call.arguments.append(v)
            if c == "}":
                break
            c = yield from self._space((yield))
        if call.name is None:
            raise _NotACall
        if call.parsed is None:
            call.parsed = {}
            call.arguments.append("{}")

    def _python_call(self, c):
        """name(key=literal, ...) from its first character; returns the one after it."""
        call, name = self._new_call(), []
        if c is None or not c.isidentifier():
            raise _NotACall
        while c is not None and (c.isalnum() or c == "_"):
            name.append(c)
            c = yield
        if (yield from self._space(c)) != "(":
            raise _NotACall
        self._named(call, "".join(name))
        call.parsed = {}
        c = yield from self._space((yield))
        while c != ")":
            key = []
            if c is None or not c.isidentifier():
                raise _NotACall
            while c is not None and (c.isalnum() or c == "_"):
                key.append(c)
                c = yield
            key = "".join(key)
            if key in call.parsed or (yield from self._space(c)) != "=":
                raise _NotACall
            text, c = yield from self._value((yield from self._space((yield))), ",)", "'\"")
            try:
                value = ast.literal_eval(text)
                value_json = json.dumps(value, ensure_ascii=False, allow_nan=False)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                raise _NotACall from None   # not a literal, or not JSON (a set, bytes, inf)
            call.arguments.append(("{" if not call.parsed else ", ")
                                  + json.dumps(key, ensure_ascii=False) + ": " + value_json)
            call.parsed[key] = value
            if c == ",":
                c = yield from self._space((yield))
        call.arguments.append("}" if call.parsed else "{}")
        call.parsed = _json_object("".join(call.arguments))   # tuples as lists, as sent
        return (yield from self._space((yield)))


def parse_tool_calls(text: str, names: Collection[str] | None = None,
                     parallel: bool = True) -> list[ToolCall] | None:
    """The tool calls `text` consists of, or None if it is not (only) tool calls. With
    `names`, every call must name one of them (else the text is an ordinary answer);
    `parallel` False keeps only the first call."""
    reader = ToolCallStream(names, parallel)
    reader.push(text)
    return reader.finish()


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#", "#/$defs/X", ...) pointing into the copy of
    it at `base`: a tool's parameter schema, moved under the call's schema, keeps its own
    $defs (Pydantic writes nested models so). Copied without recursion: a client's schema
    may nest deeper than Python's stack."""
    def visit(copy: dict) -> None:
        ref = copy.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            copy["$ref"] = base + ref[1:]
    return copy_schema(schema, visit)


def tool_call_schema(tools: Sequence[dict], only: str | None = None,
                     several: bool = False) -> dict:
    """JSON schema of a call in Llama 3.2's JSON form, {"name": ..., "parameters": {...}},
    to one of `tools` (OpenAI's [{"type": "function", "function": {name, parameters}}]),
    or to the one named `only`; `several`: one call, or a JSON list of one or more.
    Each tool's parameter schema is written once, under $defs."""
    defs, options = {}, []
    for t in tools:
        f = t["function"]
        if only is not None and f["name"] != only:
            continue
        key = f"tool_{f['name']}"   # function names are [A-Za-z0-9_-]: a JSON pointer as is
        defs[key] = _rebased(f.get("parameters") or {"type": "object"}, f"#/$defs/{key}")
        options.append({"type": "object", "properties": {
            "name": {"const": f["name"]}, "parameters": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "parameters"], "additionalProperties": False})
    defs["call"] = options[0] if len(options) == 1 else {"anyOf": options}
    call = {"$ref": "#/$defs/call"}
    return {"$defs": defs, **({"anyOf": [call, {"type": "array", "items": call, "minItems": 1}]}
                              if several else call)}
