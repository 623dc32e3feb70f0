"""Numba compile-once bookkeeping: know whether the on-disk JIT cache is warm, and
compile everything the forward pass needs before the user is waiting on a reply."""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from numba.core.registry import CPUDispatcher


def _dispatchers():
    from . import kernels, linear
    for mod in (kernels, linear):
        for obj in vars(mod).values():
            if isinstance(obj, CPUDispatcher):
                yield obj


def cache_is_warm() -> bool:
    """True when every kernel has an on-disk cache index (numba internals: best effort)."""
    try:
        return all(os.path.exists(d._cache._cache_file._index_path) for d in _dispatchers())
    except AttributeError:
        return False


def warm_up(llm, announce: Callable[[], None] | None = None) -> float:
    """Run the prefill and decode paths once (compiling or loading kernels), then
    clear the cache. Returns the seconds spent; calls announce() first if cold."""
    if announce and not cache_is_warm():
        announce()
    t0 = time.perf_counter()
    bos = llm.tokenizer.bos_id if llm.tokenizer.bos_id is not None else 0
    llm.model.forward([bos, bos], 0)     # batched (matmul) path
    llm.model.forward([bos], 2)          # decode (matvec) path
    llm.reset()
    return time.perf_counter() - t0
