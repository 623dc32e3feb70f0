"""Numba compile-once bookkeeping: where compiled kernels are cached, whether that
cache is warm for a model, and compiling what the forward pass needs before the user
waits on a reply."""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numba

from .default_model import cache_dir

_SOURCES = ("kernels.py", "fp.py", "model.py", *(f"formats/{p.name}" for p in
                                                   sorted((Path(__file__).parent / "formats").glob("*.py"))))


# Why kernels compile in memory, when the cache cannot be written (the CLI says so once).
cache_note: str | None = None


def use_user_cache() -> None:
    """Cache compiled kernels in cache_dir()/numba, never beside the installed sources; if
    that cannot be written, compile ours in memory. Must run before any module with
    kernels is imported (the package's __init__ calls it first)."""
    global cache_note
    if os.environ.get("NUMBA_CACHE_DIR"):   # the user's choice; Numba's own rules apply
        return
    path = cache_dir() / "numba"
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        cache_note = (f"cannot write the kernel cache {path} ({e.strerror or e}): kernels "
                      f"compile in memory on every run (EDGELLAMA_CACHE sets the directory)")
        _compile_in_memory()
        return
    # Not the environment: child processes would take it for the user's choice. (Numba
    # resets this when a NUMBA_* variable changes, but reads it only as kernels are defined.)
    numba.config.CACHE_DIR = str(path)


def _compile_in_memory() -> None:
    """No disk cache for our kernels: Numba would otherwise fall back to the package's
    own directory, or fail at import when nothing is writable."""
    from numba.core.dispatcher import Dispatcher
    enable = Dispatcher.enable_caching

    def enable_caching(self):
        if not self.py_func.__module__.startswith("edgellama."):
            enable(self)
    Dispatcher.enable_caching = enable_caching


def _stamp(model) -> Path:
    """A file whose existence says: these kernels, for these weight types, compiled here."""
    h = hashlib.sha256(numba.__version__.encode())
    for name in _SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    h.update(model.type_summary().encode())
    return cache_dir() / "jit" / h.hexdigest()[:24]


def is_warm(model) -> bool:
    """Whether this model's kernels were compiled (and cached) here before."""
    try:
        return _stamp(model).exists()
    except OSError:   # an unreadable cache directory: as good as none
        return False


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
