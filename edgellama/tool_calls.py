"""Tool calls in a model's reply, and the grammar that forces one.

    calls = parse_tool_calls(text, names)   # [ToolCall(name, arguments)] or None
    schema = tool_call_schema(tools, only)  # JSON schema of one call, for constrained decoding

Llama 3.2 1B/3B answer a tool prompt in one of two forms (vLLM issue #9991):
    {"name": "get_weather", "parameters": {"city": "Paris"}}      (JSON; "arguments" too)
    [get_weather(city="Paris"), get_time(zone="CET")]             (pythonic)
optionally after <|python_tag|>, several JSON calls separated by ";" or new lines.
The pythonic form is read with `ast` and every argument with ast.literal_eval: literals
only, nothing is ever evaluated.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

MAX_CALL_CHARS = 1 << 20   # longer replies are not read as calls (ast on megabytes is slow)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's shape: {"id", "type": "function", "function": {name, arguments (JSON text)}}."""
        out = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments,
                                                                       ensure_ascii=False)}}
        return out if index is None else {"index": index, **out}


def _json_call(v: Any) -> ToolCall | None:
    if not isinstance(v, dict) or not isinstance(v.get("name"), str):
        return None
    if v.get("type") not in (None, "function"):
        return None
    args = v.get("parameters", v.get("arguments", {}))
    if isinstance(args, str):   # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or set(v) - {"name", "parameters", "arguments", "type"}:
        return None
    return ToolCall(v["name"], args)


def _json_calls(text: str) -> list[ToolCall] | None:
    try:
        v = json.loads(text)
        items = v if isinstance(v, list) else [v]
    except (ValueError, RecursionError):
        pieces = [p for p in re.split(r";\s*|\n+", text) if p.strip()]
        if len(pieces) < 2:
            return None
        try:
            items = [json.loads(p) for p in pieces]
        except (ValueError, RecursionError):
            return None
    calls = [_json_call(item) for item in items]
    return calls if calls and all(calls) else None


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg for k in node.keywords)):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            json.dumps(args)   # sets, bytes, complex: not JSON, so not arguments
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        calls.append(ToolCall(node.func.id, args))
    return calls


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> list[ToolCall] | None:
    """The tool calls `text` consists of, or None if it is not (only) tool calls. With
    `names`, every call must name one of them (else the text is an ordinary answer)."""
    s = text.strip()
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG):].strip()
    if not s or len(s) > MAX_CALL_CHARS or s[0] not in "{[":
        return None
    calls = _json_calls(s) or (_pythonic_calls(s) if s[0] == "[" else None)
    if calls and names is not None and any(c.name not in names for c in calls):
        return None
    return calls


def may_be_tool_call(text: str) -> bool | None:
    """For streaming: True/False once the reply's start says whether it could be a call,
    None while it is only whitespace. (Streamed text never shows <|python_tag|>, a
    control token.)"""
    s = text.lstrip()
    return s[0] in "{[" if s else None


def tool_call_schema(tools: Sequence[dict], only: str | None = None) -> dict:
    """JSON schema of one call in Llama 3.2's JSON form, {"name": ..., "parameters": {...}},
    to one of `tools` (OpenAI's [{"type": "function", "function": {name, parameters}}]),
    or to the one named `only`."""
    options = []
    for t in tools:
        f = t["function"]
        if only is not None and f["name"] != only:
            continue
        options.append({"type": "object", "properties": {
            "name": {"const": f["name"]},
            "parameters": f.get("parameters") or {"type": "object"}},
            "required": ["name", "parameters"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}
