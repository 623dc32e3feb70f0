"""Copying a client's JSON schema without recursion: it may nest deeper than Python's stack
(the server bounds nesting too, but a copy must not depend on that)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

LITERALS = ("enum", "const", "default", "examples")   # values in a schema, not schemas


def copy_schema(schema: Any, visit: Callable[[dict], None]) -> Any:
    """A deep copy of `schema` (dicts and lists; values under LITERALS keys kept as they
    are), calling visit(copy) on each dict's copy as it is made, to change it in place."""
    top = [schema]
    stack = [(top, 0)]   # (container, key): its value is copied in place
    while stack:
        into, key = stack.pop()
        v = into[key]
        if isinstance(v, list):
            into[key] = copy = list(v)
            stack.extend((copy, i) for i in range(len(copy)))
        elif isinstance(v, dict):
            into[key] = copy = dict(v)
            stack.extend((copy, k) for k in v if k not in LITERALS)
            visit(copy)
    return top[0]
