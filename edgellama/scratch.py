"""Working memory of forward passes, kept apart from the weights.

Linears and the Transformer hold no per-call state; every buffer a pass writes (the
activations, attention's rows, each Linear's quantized x and per-tile sums, prefill's
dequantized rows) comes from a `Scratch`. One Scratch serves one thread of work at a
time: each Sequence has its own unless it is given one to share, and a batched decode
uses one for all its sequences.
"""
from __future__ import annotations

import numpy as np


class Scratch:
    """Named buffers grown on demand (never shrunk), and one set of decode buffers per
    shape of Linear (Linears of one class, type and shape share theirs: they run one
    after another)."""

    def __init__(self):
        self._flat: dict[str, np.ndarray] = {}
        self._linear: dict[tuple, tuple] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A buffer of `shape`, zeros when new, else what the last user of `name` left
        there (the same memory: a caller holds one view per name at a time)."""
        n = 1
        for s in shape:
            n *= s
        b = self._flat.get(name)
        if b is None or b.size < n or b.dtype != dtype:
            b = self._flat[name] = np.zeros(max(n, 1), dtype)
        return b[:n].reshape(shape)

    def linear(self, w) -> tuple:
        """The decode buffers of Linear w (w.decode_buffers() the first time)."""
        key = w.scratch_key
        b = self._linear.get(key)
        if b is None:
            b = self._linear[key] = w.decode_buffers()
        return b

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._flat.values()) + \
            sum(a.nbytes for bs in self._linear.values() for a in bs)
