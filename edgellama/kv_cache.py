"""The KV cache: K and V of every layer for `ctx` positions, each in a cache type of its own.

    f16   IEEE half, 2 bytes a value (the exact type)
    q8_0  ggml's q8_0: blocks of 32 values along the head dim, int8 and an f16 scale,
          34 bytes a block
    q4_0  ggml's q4_0: blocks of 32, nibbles and an f16 scale, 18 bytes a block

Blocks are ggml's encodings (its dequantization reads them). q8_0 rounds as ggml's
quantize_row_q8_0_ref; q4_0 takes a searched least-squares scale where it leaves less
squared error than quantize_row_q4_0_ref's (attention._q4_block), so no block is further
from its values than ggml's rounding leaves it. The arrangement in memory is attention's
(attention.py's docstring): K in blocks of 16 positions, scales in arrays of their own.
A quantized K or V is stored rotated by an orthonormal Walsh-Hadamard transform over the
head dim (runs of the largest power of 2 dividing it): Q gets the same rotation, so Q.K
is unchanged, and attention's output is rotated back for V. The rotation spreads the few
large channels RoPE'd keys have over the block, so one scale no longer has to span them.

A model with sliding-window layers (Gemma 3) gets a SlidingCache: its global layers'
KVCache over the whole context, and its local layers' KVCache of a ring that holds the
window and one prefill run past it (llama.cpp's iswa cache, mlx-lm's RotatingKVCache):
position p sits at p % capacity, so their memory stays the same past the window.
"""
from __future__ import annotations

import numpy as np

from .kernels import attention as A
from .args import ModelArgs
from .errors import EdgeError
from .formats.base import anon_array
from .kernels.rows import rope, rope_neox

CACHE_TYPES = ("f16", "q8_0", "q4_0")
DEFAULT_CACHE_TYPE = "f16"     # for K and V (docs/usage.md, KV cache types: why)
# bytes per value and per block of 32 values of each type
_BLOCK_BYTES = {"f16": 64, "q8_0": 34, "q4_0": 18}
LAYOUT_VERSION = 1
# Positions a write stores in parallel from: fewer (a decoded token, a few verified ones)
# take less time than starting and joining the workers (bench/bench_decode_split.py)
_PARALLEL_STORE = 16
# Positions a ring holds past its window (rounded up to a chunk): the tokens one write and
# attention run takes (RING_RUN + 1: a prefill chunk of DEFAULT_BATCH in one run)
RING_RUN = 512


def ring_capacity(ctx: int, window: int = 0) -> int:
    """Positions a layer's cache holds: the context in whole blocks of 16, or for a
    window, at most the window and RING_RUN in whole chunks of attention."""
    cap = A.kv_capacity(ctx)
    if window:
        cap = min(cap, -(-window // A._CHUNK) * A._CHUNK + RING_RUN)
    return cap


def check_cache_type(name: str, head_dim: int | None = None) -> str:
    """The cache type `name` names (case-insensitive), or EdgeError."""
    t = str(name).lower()
    if t not in CACHE_TYPES:
        raise EdgeError(f"unknown KV cache type {name!r}: use one of {', '.join(CACHE_TYPES)}")
    if head_dim is not None and t != "f16" and head_dim % A.QBLOCK:
        raise EdgeError(f"a {t} KV cache needs a head dim that is a multiple of {A.QBLOCK}; "
                        f"this model's is {head_dim}: use --cache-type f16")
    return t


def value_bytes(cache_type: str, n: int) -> int:
    """Bytes that n values (a multiple of 32) take in a cache type."""
    return n // 32 * _BLOCK_BYTES[cache_type]


def rotation_size(head_dim: int) -> int:
    """The Hadamard transform's size: the largest power of 2 dividing the head dim."""
    return head_dim & -head_dim


def _n_local(args) -> int:
    # sliding-window layers (a plain hyperparameter object, as tests and benches make, has none)
    return sum(getattr(args, "local_layers", ()))


def _store(serial, parallel, values: np.ndarray, *args) -> None:
    """A store kernel's serial form over all heads for a few positions, its parallel form
    for more (values (T, KV, hd) are what it stores; args its arguments)."""
    T, KV = values.shape[:2]
    if T < _PARALLEL_STORE:
        serial(*args, 0, KV)
    else:
        parallel(*args)


class KVCache:
    """K and V for every layer (or `layers` of them), allocated once for `ctx` positions
    (rounded up to a whole block of 16, attention.kv_capacity) in the given types;
    `length` is how many leading positions hold valid entries; `neox`: shift() turns K
    by rotate-half pairs (the model's RoPE layout), else adjacent ones. With a `window`,
    attention sees the last `window` positions only, and the cache is a ring of
    ring_capacity(ctx, window) positions where that is less than the context: `floor` is
    the first position it still holds. Arrays, by name (layout() lists them):
        k (L, KV, cap/16, hd, 16) f16 bits        | kq (L, KV, cap/16, hd·16) int8 (q8_0) or
                                                  |    (L, KV, cap/16, hd·8) uint8 (q4_0),
                                                  |  ks (L, KV, cap/16, hd/32, 16) f16 bits
        v (L, KV, cap, hd) f16 bits               | vq (L, KV, cap, hd) int8 or (.., hd/2) uint8,
                                                  |  vs (L, KV, cap, hd/32) f16 bits
    """

    def __init__(self, args: ModelArgs, ctx: int, type_k: str = "f16", type_v: str = "f16",
                 rotate: bool = True, neox: bool = False, layers: int | None = None,
                 window: int = 0):
        L, KV, hd = args.n_layers if layers is None else layers, args.n_kv_heads, args.head_dim
        self.type_k, self.type_v = check_cache_type(type_k, hd), check_cache_type(type_v, hd)
        self.cap = cap = ring_capacity(ctx, window)
        self.window, self.ring = window, cap < ctx
        self._floors = [0] * L      # per layer: a run is written layer after layer
        self.ctx, self.length = ctx, 0
        self.n_layers, self.n_kv_heads, self.head_dim = L, KV, hd
        self._rope = rope_neox if neox else rope    # shift()'s: the model's RoPE layout
        nB, nbk = cap // A.KV_BLOCK, hd // A.QBLOCK
        # Quantized types are stored rotated; f16 needs no help
        m = rotation_size(hd) if rotate else 0
        self.rot_k = m if self.type_k != "f16" else 0
        self.rot_v = m if self.type_v != "f16" else 0
        shapes = {}
        if self.type_k == "f16":
            shapes["k"] = ((L, KV, nB, hd, A.KV_BLOCK), np.uint16)
        else:
            q4 = self.type_k == "q4_0"
            shapes["kq"] = ((L, KV, nB, hd * (8 if q4 else 16)), np.uint8 if q4 else np.int8)
            shapes["ks"] = ((L, KV, nB, nbk, A.KV_BLOCK), np.uint16)
        if self.type_v == "f16":
            shapes["v"] = ((L, KV, cap, hd), np.uint16)
        else:
            q4 = self.type_v == "q4_0"
            shapes["vq"] = ((L, KV, cap, hd // 2 if q4 else hd), np.uint8 if q4 else np.int8)
            shapes["vs"] = ((L, KV, cap, nbk), np.uint16)
        # Anonymous 4 KiB pages, mapped on first touch, so residency grows with the
        # positions written. Not np.zeros: NumPy asks for huge pages, and the first
        # token then faults in all of the cache (1B at ctx 8192, this VM: 0.4 s and
        # 256 MiB resident at once).
        self.arrays = {name: anon_array(shape, dt) for name, (shape, dt) in shapes.items()}
        a, none = self.arrays, np.zeros((L, 0), np.uint16)   # f16 has no scales
        self._k, self._ks = a.get("k", a.get("kq")), a.get("ks", none)
        self._v, self._vs = a.get("v", a.get("vq")), a.get("vs", none)
        # per layer, the flat views the kernels take (made once: a decoded token asks
        # for them in every layer)
        self._flat = [tuple(x[i].reshape(-1) for x in (self._k, self._ks, self._v, self._vs))
                      for i in range(L)]

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = n
        if n == 0:                  # an empty sequence starts the ring afresh
            self._floors = [0] * len(self._floors)

    @property
    def floor(self) -> int:
        """The first position every layer's ring still holds."""
        return max(self._floors, default=0)

    def holds_window(self, pos: int) -> bool:
        """Whether a token at `pos` finds every position of its window still held (a
        ring overwrites the oldest; truncating back past them cannot be undone)."""
        return not self.ring or self.floor <= max(0, pos - self.window + 1)

    @property
    def k(self) -> np.ndarray:
        """An f16 K as float16 (L, KV, cap/16, hd, 16) (the f16 cache's old attribute)."""
        return self.arrays["k"].view(np.float16)

    @property
    def v(self) -> np.ndarray:
        """An f16 V as float16 (L, KV, cap, hd)."""
        return self.arrays["v"].view(np.float16)

    # -- the model's use -------------------------------------------------------
    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v (T, KV, hd) f32 at positions pos..pos+T-1 in the cache's types.
        A rotated type's input is rotated in place (or a contiguous copy of it: the
        kernels take C-contiguous arrays only, one compiled form each, whether a test or
        the model's column slices call them)."""
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        if self.ring:
            floor = self._floors[layer]
            if floor > max(0, pos - self.window + 1):
                raise EdgeError(f"the sliding-window cache no longer holds the positions a "
                                f"token at {pos} sees (it holds {floor}.. of a ring of "
                                f"{self.cap}); read the text again from the start")
            self._floors[layer] = max(floor, pos + len(k) - self.cap)
        self._write_k(layer, pos, k)
        if self.rot_v:
            A.hadamard(v, self.rot_v)
        _, _, vf, vs = self._flat[layer]
        if self.type_v == "f16":
            _store(A.store_f16_v_heads, A.store_f16_v, v, vf, self.cap, pos, v)
        else:
            _store(A.store_q_v_heads, A.store_q_v, v, vf, vs, self.cap, pos, v,
                   self.type_v == "q4_0")

    def _write_k(self, layer: int, pos: int, k: np.ndarray) -> None:
        if self.rot_k:
            A.hadamard(k, self.rot_k)
        kf, ks, _, _ = self._flat[layer]
        if self.type_k == "f16":
            _store(A.store_f16_k_heads, A.store_f16_k, k, kf, self.cap, pos, k)
        else:
            _store(A.store_q_k_heads, A.store_q_k, k, kf, ks, self.cap, pos, k,
                   self.type_k == "q4_0")

    def attend(self, layer: int, pos: int, q: np.ndarray, scale, out: np.ndarray,
               scratch: tuple) -> None:
        """out (T, H, hd) = attention of q (T, H, hd, roped; rotated in place if K is)
        at positions pos.. over positions 0..pos+t of `layer` (written first)."""
        q = np.ascontiguousarray(q)          # as write()'s k and v
        if self.rot_k:
            A.hadamard(q, self.rot_k)
        A.attention(q, *self._flat[layer], self.n_kv_heads, self.cap, pos, scale, out, *scratch,
                    self.window)
        if self.rot_v:
            A.hadamard(out, self.rot_v)

    def step(self, layer: int, pos: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale,
             out: np.ndarray, scratch: tuple) -> None:
        """write() then attend() of T tokens at pos.., in runs a ring holds with their
        windows (each token attends only to positions at or before its own, so runs give
        what one pass gives)."""
        T = len(q)
        run = self.cap - self.window + 1 if self.ring else T
        for a in range(0, T, run):
            b = min(T, a + run)
            self.write(layer, pos + a, k[a:b], v[a:b])
            self.attend(layer, pos + a, q[a:b], scale, out[a:b], scratch)

    def fill_random(self, n: int, rng: np.random.Generator) -> None:
        """Synthetic K/V for the first n positions of every layer (benchmarks: speed
        ignores values): layer 0 written in the cache's types, the rest copies of it."""
        KV, hd = self.n_kv_heads, self.head_dim
        self._floors = [0] * self.n_layers      # every position is written anew
        if self.n_layers == 0:
            self.length = n
            return
        # a ring: its last positions only (writing them sets floor)
        lo, step = (max(0, n - self.cap), RING_RUN) if self.ring else (0, 4096)
        for p0 in range(lo, n, step):
            k, v = rng.standard_normal((2, min(step, n - p0), KV, hd), np.float32) * 0.5
            self.write(0, p0, k, v)
        for name, a in self.arrays.items():
            cut = self._cut(name, min(n, self.cap))
            for layer in range(1, self.n_layers):
                a[(layer, slice(None)) + cut] = a[(0, slice(None)) + cut]
        self._floors = [self._floors[0]] * self.n_layers
        self.length = n

    def touch(self) -> None:
        """Make every page of the cache resident (what a filled context uses)."""
        for a in self.arrays.values():
            a[...] = 0

    # -- sizes -------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(args: ModelArgs, type_k: str = "f16", type_v: str = "f16") -> int:
        """Layers × kv heads × (K's bytes + V's bytes of head-dim values): a position
        within the sliding window (past it, the global layers' share only)."""
        n = args.n_layers * args.n_kv_heads
        if args.head_dim % 32:
            return n * args.head_dim * 4       # f16 only
        return n * (value_bytes(type_k, args.head_dim) + value_bytes(type_v, args.head_dim))

    @staticmethod
    def bytes_needed(args: ModelArgs, ctx: int, type_k: str = "f16", type_v: str = "f16") -> int:
        """The cache's bytes at a context of ctx: a layer's bytes per token × ctx for the
        global layers, × their ring's positions (at most ctx) for the local ones; the
        global layers hold up to 15 positions more, to end on a whole block."""
        local = _n_local(args)
        per_layer = KVCache.bytes_per_token(args, type_k, type_v) // args.n_layers
        ring = min(ctx, ring_capacity(ctx, args.sliding_window)) if local else 0
        return per_layer * ((args.n_layers - local) * ctx + local * ring)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    # -- saving, loading and shifting (the contract with saved prompts) --------------
    def _cut(self, name: str, n: int) -> tuple:
        # the index (after layer and head) of positions 0..n-1 in array `name`: K's
        # arrays hold whole blocks of 16 positions, V's single positions
        if name in ("k", "kq", "ks"):
            return (slice(0, -(-n // A.KV_BLOCK)),)
        return (slice(0, n),)

    def layout(self) -> dict:
        """JSON-able description of the state (the key names the saved prompts read): cache
        types, capacity, rotation, and per array its dtype (f16 arrays as "<f2"), full
        shape, its positions axis and the positions one index of that axis holds."""
        return {"version": LAYOUT_VERSION, "k_type": self.type_k, "v_type": self.type_v,
                "capacity": self.cap, "rotation_k": self.rot_k, "rotation_v": self.rot_v,
                "arrays": {name: {"dtype": self._public(a).dtype.str, "shape": list(a.shape),
                                  "axis": 2,
                                  "per_index": A.KV_BLOCK if name[0] == "k" else 1}
                           for name, a in self.arrays.items()}}

    @staticmethod
    def _public(a: np.ndarray) -> np.ndarray:
        # f16 arrays are held as their uint16 bits (the kernels' view); shown as float16
        return a.view(np.float16) if a.dtype == np.uint16 else a

    def state(self, n: int) -> dict[str, np.ndarray]:
        """The arrays (views) that hold positions 0..n-1 of every layer: axis 2 cut to
        ceil(n/16) blocks for K's arrays, n positions for V's."""
        if not 0 <= n <= self.length:
            raise ValueError(f"state of {n} positions, the cache holds {self.length}")
        if self.floor or n > self.cap:
            raise EdgeError(f"a prompt of {n} tokens cannot be saved: the sliding-window "
                            f"layers keep the last {self.cap} positions only")
        return {name: self._public(a[(slice(None), slice(None)) + self._cut(name, n)])
                for name, a in self.arrays.items()}

    def load_state(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """The inverse of state(n): the caller has checked names, dtypes and shapes."""
        if not 0 <= n <= min(self.ctx, self.cap):
            raise ValueError(f"{n} positions do not fit a cache of {min(self.ctx, self.cap)}")
        for name, a in self.arrays.items():
            self._public(a)[(slice(None), slice(None)) + self._cut(name, n)] = arrays[name]
        self.length = n

    def shift(self, keep: int, drop: int, inv_freq: np.ndarray) -> None:
        """Forget positions keep..keep+drop-1 and move keep+drop..length-1 down by drop,
        K rotated back by drop positions of RoPE in the model's layout; length -= drop.
        V moves as stored bytes. A quantized K is read back (un-rotated), turned by RoPE,
        rotated and quantized again: the moved keys are rounded a second time."""
        if not (0 <= keep and 0 < drop and keep + drop <= self.length):
            raise ValueError(f"shift keep={keep} drop={drop} of {self.length} positions")
        if not self.can_shift:
            raise EdgeError(f"no context shift past {self.cap} positions with a sliding-window "
                            f"cache: its ring no longer holds the early ones (llama.cpp refuses "
                            f"it too, but with --swa-full); use a larger --ctx")
        n = self.length - keep - drop
        ang = -float(drop) * np.asarray(inv_freq, np.float64)
        cos = np.cos(ang).astype(np.float32)[None, :]
        sin = np.sin(ang).astype(np.float32)[None, :]
        step = 4096
        for layer in range(self.n_layers):
            for s0 in range(0, n, step):             # ascending: sources lie above targets
                c = min(step, n - s0)
                src, dst = keep + drop + s0, keep + s0
                for name in ("v", "vq", "vs"):
                    if name in self.arrays:
                        a = self.arrays[name][layer]
                        a[:, dst:dst + c] = a[:, src:src + c]
                k = self.k_values(layer, src, src + c)       # (c, KV, hd), as stored
                if self.rot_k:
                    A.hadamard(k, self.rot_k)                # back to RoPE'd K
                self._rope(k, np.repeat(cos, c, 0), np.repeat(sin, c, 0))
                self._write_k(layer, dst, k)
        self.length -= drop

    @property
    def can_shift(self) -> bool:
        """Whether shift() can run: a ring that has overwritten no position yet."""
        return self.floor == 0

    # -- reading back (shift, tests) -------------------------------------------------
    def k_values(self, layer: int, p0: int, p1: int) -> np.ndarray:
        """K of positions p0..p1-1 as f32 (p1 - p0, KV, hd), as stored (rotated if K is)."""
        KV, hd, B = self.n_kv_heads, self.head_dim, A.KV_BLOCK
        b0, b1 = p0 // B, -(-p1 // B)                 # the blocks holding them
        nB, nbk = b1 - b0, hd // A.QBLOCK
        if self.type_k == "f16":
            k = self.arrays["k"][layer, :, b0:b1].view(np.float16).astype(np.float32)
            k = k.transpose(0, 1, 3, 2).reshape(KV, nB * B, hd)
        else:
            kq = self.arrays["kq"][layer, :, b0:b1]
            if self.type_k == "q8_0":
                vals = kq.reshape(KV, nB, nbk, 8, B, 4).transpose(0, 1, 4, 2, 3, 5)
                vals = vals.reshape(KV, nB * B, nbk, A.QBLOCK).astype(np.float32)
            else:
                b = kq.reshape(KV, nB, nbk, 4, B, 4).transpose(0, 1, 4, 2, 3, 5)
                b = b.reshape(KV, nB * B, nbk, 16)
                vals = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.float32) - 8
            d = self.arrays["ks"][layer, :, b0:b1].view(np.float16).astype(np.float32)
            d = d.transpose(0, 1, 3, 2).reshape(KV, nB * B, nbk)
            with np.errstate(invalid="ignore", over="ignore"):   # a block's lanes past
                k = (vals * d[..., None]).reshape(KV, nB * B, hd)     # p1 may hold anything
        return np.ascontiguousarray(k[:, p0 - b0 * B:p1 - b0 * B].transpose(1, 0, 2))

    def v_values(self, layer: int, p0: int, p1: int) -> np.ndarray:
        """V of positions p0..p1-1 as f32 (p1 - p0, KV, hd), as stored (rotated if V is)."""
        KV, hd = self.n_kv_heads, self.head_dim
        nbk, n = hd // A.QBLOCK, p1 - p0
        if self.type_v == "f16":
            v = self.arrays["v"][layer, :, p0:p1].view(np.float16).astype(np.float32)
        else:
            vq = self.arrays["vq"][layer, :, p0:p1]
            if self.type_v == "q8_0":
                vals = vq.astype(np.float32).reshape(KV, n, nbk, A.QBLOCK)
            else:
                b = vq.reshape(KV, n, nbk, 16)
                vals = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.float32) - 8
            d = self.arrays["vs"][layer, :, p0:p1].view(np.float16).astype(np.float32)
            v = (vals * d[..., None]).reshape(KV, n, hd)
        return np.ascontiguousarray(v.transpose(1, 0, 2))


class SlidingCache:
    """The cache of a model with sliding-window layers (args.local_layers): `full`, a
    KVCache of the whole context for the global layers, and `swa`, one of rings for the
    local layers (KVCache's window), as llama.cpp's iswa cache. KVCache's interface, by
    the model's layer numbers; saved-prompt arrays of the local layers are named swa_*."""

    def __init__(self, args: ModelArgs, ctx: int, type_k: str = "f16", type_v: str = "f16",
                 rotate: bool = True, neox: bool = False):
        local = args.local_layers
        self.full = KVCache(args, ctx, type_k, type_v, rotate, neox, layers=local.count(False))
        self.swa = KVCache(args, ctx, type_k, type_v, rotate, neox, layers=local.count(True),
                           window=args.sliding_window)
        where, n = [], {False: 0, True: 0}
        for is_local in local:
            where.append((self.swa if is_local else self.full, n[is_local]))
            n[is_local] += 1
        self._where = where
        self._inv_local = args.inv_freq(local=True)     # shift()'s for the local layers
        f = self.full
        self.ctx, self.n_layers, self.n_kv_heads, self.head_dim = ctx, args.n_layers, f.n_kv_heads, f.head_dim
        self.type_k, self.type_v, self.rot_k, self.rot_v = f.type_k, f.type_v, f.rot_k, f.rot_v

    @property
    def length(self) -> int:
        return self.full.length

    @length.setter
    def length(self, n: int) -> None:
        self.full.length = self.swa.length = n

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return {**self.full.arrays, **{"swa_" + k: a for k, a in self.swa.arrays.items()}}

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.swa.nbytes

    def holds_window(self, pos: int) -> bool:
        return self.swa.holds_window(pos)

    @property
    def can_shift(self) -> bool:
        return self.swa.can_shift

    def write(self, layer, pos, k, v) -> None:
        c, i = self._where[layer]
        c.write(i, pos, k, v)

    def attend(self, layer, pos, q, scale, out, scratch) -> None:
        c, i = self._where[layer]
        c.attend(i, pos, q, scale, out, scratch)

    def step(self, layer, pos, q, k, v, scale, out, scratch) -> None:
        c, i = self._where[layer]
        c.step(i, pos, q, k, v, scale, out, scratch)

    def k_values(self, layer, p0, p1) -> np.ndarray:
        """KVCache.k_values of the layer's slots p0..p1-1 (a ring's: position p at p % cap)."""
        c, i = self._where[layer]
        return c.k_values(i, p0, p1)

    def v_values(self, layer, p0, p1) -> np.ndarray:
        c, i = self._where[layer]
        return c.v_values(i, p0, p1)

    def fill_random(self, n: int, rng: np.random.Generator) -> None:
        self.full.fill_random(n, rng)
        self.swa.fill_random(n, rng)

    def touch(self) -> None:
        self.full.touch()
        self.swa.touch()

    def layout(self) -> dict:
        f, w = self.full.layout(), self.swa.layout()
        return {**f, "window": self.swa.window,
                "arrays": {**f["arrays"], **{"swa_" + k: a for k, a in w["arrays"].items()}}}

    def state(self, n: int) -> dict[str, np.ndarray]:
        w = self.swa.state(n)
        return {**self.full.state(n), **{"swa_" + k: a for k, a in w.items()}}

    def load_state(self, arrays: dict[str, np.ndarray], n: int) -> None:
        self.swa.load_state({k[4:]: a for k, a in arrays.items() if k.startswith("swa_")}, n)
        self.full.load_state(arrays, n)

    def shift(self, keep: int, drop: int, inv_freq: np.ndarray) -> None:
        """KVCache.shift of both, the local layers' K turned by their own frequencies."""
        if not self.swa.can_shift:      # refuse before anything moves
            self.swa.shift(keep, drop, inv_freq)
        self.full.shift(keep, drop, inv_freq)
        self.swa.shift(keep, drop, self._inv_local)


def make_cache(args: ModelArgs, ctx: int, type_k: str = "f16", type_v: str = "f16",
               neox: bool = False) -> KVCache | SlidingCache:
    """The cache a model's sequence needs: a SlidingCache for sliding-window layers."""
    if any(args.local_layers):
        return SlidingCache(args, ctx, type_k, type_v, neox=neox)
    return KVCache(args, ctx, type_k, type_v, neox=neox)


# -- does it fit ----------------------------------------------------------------------------
# K/V type pairs from the most exact to the smallest, for advice
TYPE_PAIRS = (("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0"))


def longest_context(args: ModelArgs, budget: int, type_k: str, type_v: str) -> int:
    """The most positions whose cache fits in `budget` bytes (whole blocks of 16)."""
    budget = max(0, budget)
    per = KVCache.bytes_per_token(args, type_k, type_v)
    n = budget // per
    local = _n_local(args)
    ring = ring_capacity(1 << 40, args.sliding_window) if local else 0
    if local and n > ring:      # past the rings, a position costs the global layers' share
        glob = args.n_layers - local
        n = (budget - per // args.n_layers * local * ring) // (per // args.n_layers * glob) \
            if glob else 1 << 40
    return n // A.KV_BLOCK * A.KV_BLOCK


def fit_advice(args: ModelArgs, ctx: int, type_k: str, type_v: str, avail: int) -> str:
    """One line for a context whose cache does not fit in `avail` bytes: what would."""
    MiB = 2 ** 20
    need = KVCache.bytes_needed(args, ctx, type_k, type_v)
    msg = (f"a context of {ctx} tokens needs {need / MiB:.0f} MiB of KV cache ({type_k} K, "
           f"{type_v} V), but only {avail / MiB:.0f} MiB of memory is available")
    per = KVCache.bytes_per_token(args, type_k, type_v)
    if args.head_dim % A.QBLOCK == 0:
        for tk, tv in TYPE_PAIRS:
            b = KVCache.bytes_needed(args, ctx, tk, tv)
            if KVCache.bytes_per_token(args, tk, tv) < per and b <= avail:
                msg += (f"; it fits with --cache-type-k {tk} --cache-type-v {tv} "
                        f"({b / MiB:.0f} MiB)")
                break
    longest = longest_context(args, avail, type_k, type_v)
    if args.train_ctx and longest > args.train_ctx:     # no advice past the model's window
        return msg + f"; use a smaller --ctx (at most the model's {args.train_ctx}-token window)"
    return msg + (f"; use a smaller --ctx (with {type_k}/{type_v}: {longest} or less)"
                  if longest else "; free some memory")
