"""One conversation's state, apart from the model's weights.

    model = Transformer(gguf, ctx)            # read-only weights, shared
    seq = model.new_sequence()                # KV cache, token ids, scratch
    logits = model.forward(prompt_ids, seq)   # prompt at positions 0..
    logits = model.forward([tok], seq)        # one more token
    rows = model.decode([seq, other], [tok, tok2])   # several sequences, one weight pass

Token i of a sequence sits at position i; `tokens` lists exactly the tokens whose K/V
the cache holds (a forward pass extends it only once its K/V are written, so an
interrupted pass leaves it consistent).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from .kv_cache import KVCache, SlidingCache
from .scratch import Scratch


class Sequence:
    def __init__(self, cache: KVCache | SlidingCache, scratch: Scratch | None = None):
        self.cache = cache
        self.tokens: list[int] = []
        self.scratch = scratch if scratch is not None else Scratch()

    @property
    def ctx(self) -> int:
        return self.cache.ctx

    @property
    def pos(self) -> int:
        """The next token's position: how many positions the cache holds."""
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens; later positions are overwritten by the next pass."""
        del self.tokens[n:]
        self.cache.length = len(self.tokens)

    def reset(self) -> None:
        self.truncate(0)

    def reuse_prefix(self, ids: Seq[int]) -> int:
        """Truncate to the longest common prefix of the cached tokens and `ids`, less
        one token when that would be all of `ids` (its logits must be computed); none
        where a sliding-window ring no longer holds that prefix's window (llama.cpp then
        reads the prompt again too); returns how many tokens of `ids` are reused. The one
        prefix rule of generate, chat and the server."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        n = max(0, min(n, len(ids) - 1))
        if not self.cache.holds_window(n):
            n = 0
        self.truncate(n)
        return n

    def reuse_shifted(self, ids: Seq[int], inv_freq: np.ndarray) -> int:
        """reuse_prefix for `ids` that leave out a run of the cached tokens after their
        common start (a chat that dropped its oldest turns to fit the context): the cached
        tokens after that run which continue `ids` are kept, moved down by a context shift
        (shift()) instead of being read again, where the cache can shift (can_shift).
        Returns how many tokens of ids are reused."""
        cached, want = np.asarray(self.tokens, np.int64), np.asarray(ids, np.int64)
        keep = _common(cached, want)
        drop, run = 0, 0
        if keep < min(len(cached), len(want)):
            for j in np.flatnonzero(cached[keep + 1:] == want[keep]) + keep + 1:
                if (n := _common(cached[j:], want[keep:])) > run:
                    drop, run = int(j) - keep, n
        if run and self.cache.can_shift:
            self.truncate(keep + drop + run)
            self.shift(keep, drop, inv_freq)
        return self.reuse_prefix(ids)

    def shift(self, keep: int, drop: int, inv_freq: np.ndarray) -> None:
        """Context shift: forget tokens keep..keep+drop-1; the later ones move down to
        follow the first `keep`, their K rotated to the new positions (KVCache.shift).
        Their K/V still carry what they saw of the dropped tokens, as in llama.cpp's
        context shift: close to, not the same as, reading the shorter text afresh."""
        self.cache.shift(keep, drop, inv_freq)
        del self.tokens[keep:keep + drop]

    def fill_random(self, n: int, rng: np.random.Generator) -> None:
        """Synthetic K/V for the first n positions (benchmarks: speed ignores values);
        their token ids are -1, which no prompt matches."""
        self.cache.fill_random(n, rng)
        self.tokens = [-1] * n

    def _extend(self, ids: np.ndarray) -> None:
        # called by the model once the K/V of ids are written at positions pos..
        self.tokens.extend(ids.tolist())
        self.cache.length = len(self.tokens)

    @property
    def nbytes(self) -> int:
        """KV cache and scratch bytes."""
        return self.cache.nbytes + self.scratch.nbytes

    def __repr__(self) -> str:
        return f"Sequence(pos={self.pos}, ctx={self.ctx})"


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
