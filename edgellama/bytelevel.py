"""GPT-2 byte-level mapping: every byte gets a printable unicode character.

Token strings in tokenizer.json and in GGUF `tokenizer.ggml.tokens` are written in
this alphabet (a space is "Ġ", a newline "Ċ"); special tokens are stored raw.
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def token_bytes(token: str) -> bytes | None:
    """Bytes of a byte-level token string, or None if it is not in that alphabet."""
    table = unicode_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None


def bytes_to_token(data: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in data)
