"""Read-bandwidth ceiling: what a parallel Numba loop can stream from memory.

Decode speed is quoted against this number measured in the same run (the machine is
shared and noisy, so absolute GB/s from another run mean little).
"""
from __future__ import annotations

import time

import numpy as np
from numba import prange

from .jit import njit


@njit(cache=True, fastmath=True, parallel=True)
def _sum_chunks(a, part):
    # a (n,) f32 -> part (k,) sums of k equal chunks (one prange item each)
    # Loop over a slice from 0: an index range starting at c * m keeps LLVM from
    # vectorising (it must allow for negative, wrap-around indices), and reads less.
    k = part.size
    m = a.size // k
    for c in prange(k):
        seg = a[c * m:(c + 1) * m]
        s = np.float32(0)
        for i in range(seg.size):
            s += seg[i]
        part[c] = s


_BUF: dict[int, np.ndarray] = {}


def measure_read_bandwidth(nbytes: int = 2 << 30, repeats: int = 3, keep: bool = False) -> float:
    """Best-of-`repeats` GB/s of a parallel float32 sum over `nbytes` (use >> the LLC).

    keep=True keeps the buffer for later calls (interleaving with kernel timings).
    """
    a = _BUF.get(nbytes)
    if a is None:
        a = np.ones(nbytes // 4, np.float32)
        if keep:
            _BUF[nbytes] = a
    part = np.zeros(64, np.float32)
    _sum_chunks(a[:1024], part)            # compile / load from cache outside the timing
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        _sum_chunks(a, part)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9
