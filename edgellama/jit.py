"""Numba compile-once bookkeeping: know whether the on-disk JIT cache is warm for a
model, and compile what the forward pass needs before the user waits on a reply."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import numba

from .default_model import cache_dir

_SOURCES = ("kernels.py", "fp.py", "model.py", *(f"formats/{p.name}" for p in
                                                   sorted((Path(__file__).parent / "formats").glob("*.py"))))


def _stamp(model) -> Path:
    """A file whose existence says: these kernels, for these weight types, compiled here."""
    h = hashlib.sha256(numba.__version__.encode())
    for name in _SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    h.update(model.type_summary().encode())
    return cache_dir() / "jit" / h.hexdigest()[:24]


def is_warm(model) -> bool:
    """Whether this model's kernels were compiled (and cached) here before."""
    return _stamp(model).exists()


def mark_warm(model) -> None:
    stamp = _stamp(model)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:
        pass   # a read-only cache only costs the announcement


def warm_up(llm, announce: Callable[[], None] | None = None) -> float:
    """Run the prefill and decode paths once (compiling, or loading from Numba's
    cache), then clear the KV cache. Calls announce() first when compiling is likely.
    Returns the seconds spent."""
    if announce and not is_warm(llm.model):
        announce()
    t0 = time.perf_counter()
    bos = llm.tokenizer.bos_id if llm.tokenizer.bos_id is not None else 0
    llm.model.forward([bos, bos], 0)     # batched (matmul) path
    llm.model.forward([bos], 2)          # decode (matvec) path
    llm.reset()
    mark_warm(llm.model)
    return time.perf_counter() - t0
