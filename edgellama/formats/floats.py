"""F32, F16 and BF16: one element per "block", used in place from the file.

Rows stay contiguous in the file layout; the matvec kernels widen f16 / bf16 bits to
f32 in registers, and prefill is our own GEMM (kernels/float_gemm.py), which widens a
block of rows at a time inside each thread.
"""
from __future__ import annotations

import numba
import numpy as np
from gguf.constants import LlamaFileType
from numba import prange

from ..kernels import amx
from ..kernels import float_gemm as fg
from ..kernels.fp import bf16_bits, bf16_to_f32, f16_bits, f16_to_f32, float_at
from ..kernels.jit import njit
from ..kernels.simd import DECODE_STREAMS
from ..kernels.target import BF16_PAIRS
from ..scratch import Scratch
from .base import Linear, WeightFormat, release_pages

f32 = np.float32


def quantize_f32(x, out):
    # x (n,) f32 -> out (4n,) u8; returns (non-finite values, 0)
    out.view(np.float32)[:] = x
    return int(np.count_nonzero(~np.isfinite(x))), 0


@njit(parallel=True, cache=True)
def _quantize_f16(x, o16):
    # x (n,) f32 -> o16 (n,) u16 fp16 bits; returns (non-finite values, overflows to inf)
    bad = 0
    over = 0
    for i in prange(x.size):
        v = x[i]
        if not (abs(v) <= f32(3.4028235e38)):
            bad += 1
        h = f16_bits(v)
        if (h & 0x7FFF) == 0x7C00:
            over += 1
        o16[i] = h
    return bad, over


@njit(parallel=True, cache=True)
def _quantize_bf16(xb, o16):
    # xb (n,) f32 bits -> o16 (n,) u16 bf16, nearest even, NaN quiet and inf kept
    # (fp.bf16_bits, ggml_compute_fp32_to_bf16); returns (non-finite values, finite
    # values that round to inf)
    bad = 0
    over = 0
    for i in prange(xb.size):
        n = xb[i]
        h = bf16_bits(n)
        if (n & 0x7FFFFFFF) >= 0x7F800000:
            bad += 1
        elif (h & 0x7FFF) == 0x7F80:
            over += 1
        o16[i] = h
    return bad, over


def dequantize_f32(q, out):
    out[:] = q.view(np.float32)


def quantize_f16(x, out):
    return _quantize_f16(x, out.view(np.uint16))


def quantize_bf16(x, out):
    return _quantize_bf16(x.view(np.uint32), out.view(np.uint16))


@njit(parallel=True, cache=True)
def _widen_f16(h, out):
    # h (n,) u16 f16 bits -> out (n,) f32
    for i in prange(out.size):
        out[i] = f16_to_f32(h[i])


@njit(parallel=True, cache=True)
def _widen_bf16(h, out):
    # h (n,) u16 bf16 bits -> out (n,) f32 (exact: bf16 is the top half of f32)
    for i in prange(out.size):
        out[i] = bf16_to_f32(h[i])


def dequantize_f16(q, out):
    _widen_f16(q.view(np.uint16), out)


def dequantize_bf16(q, out):
    _widen_bf16(q.view(np.uint16), out)


@njit(cache=True, fastmath=True)
def _row_dot(w, x, r, kind):
    # row r of W (as float_at reads it) . x: fg.float_row_dot's steps, then the rest
    s = fg.float_row_dot(w, r, x, kind)
    for k in range(x.size - x.size % fg.ROW_STEP, x.size):
        s += float_at(w, r, k, kind) * x[k]
    return s


@njit(cache=True, fastmath=True, parallel=True)
def matvec_float(w, x, out, kind):
    # W (d, n) f32, or f16 / bf16 bits (u16), @ x (n,) -> out (d,): DECODE_STREAMS rows
    # side by side (4 or 1, by CPU, as the record formats' decode), which read as that
    # many streams and share each load of x ("decode streams",
    # bench/results/design_measurements.json); one row at a time, each its own stream
    # with four accumulators
    d = w.shape[0]
    if DECODE_STREAMS == 1:
        for r in prange(d):
            out[r] = _row_dot(w, x, r, kind)
        return
    for g in prange(-(-d // 4)):
        i = 4 * g
        if i + 4 <= d:
            s0 = s1 = s2 = s3 = f32(0)
            for k in range(x.size):
                xk = x[k]
                s0 += float_at(w, i, k, kind) * xk
                s1 += float_at(w, i + 1, k, kind) * xk
                s2 += float_at(w, i + 2, k, kind) * xk
                s3 += float_at(w, i + 3, k, kind) * xk
            out[i], out[i + 1], out[i + 2], out[i + 3] = s0, s1, s2, s3
        else:
            for r in range(i, d):
                out[r] = _row_dot(w, x, r, kind)


class FloatLinear(Linear):
    """F32 / F16 / BF16 rows, views of the file (concatenated when stacked)."""

    fine = False     # Transformer's activations="fine": BF16 prefill keeps x in f32 (matmul)

    def _load(self, raws):
        dtype = np.float32 if self.type_name == "F32" else np.uint16
        ws = [r.view(dtype) for r in raws]
        self.w = ws[0] if len(ws) == 1 else np.concatenate(ws)
        if len(ws) > 1:
            for r in raws:
                release_pages(r)

    @property
    def _kind(self) -> int:
        return {"F32": 0, "F16": 1, "BF16": 2}[self.type_name]

    def matvec(self, x, out, scratch=None):
        matvec_float(self.w, x, out, self._kind)

    def matmul(self, x, out, scratch=None):
        T, n = x.shape
        threads = numba.config.NUMBA_NUM_THREADS       # get_thread_id() < this
        sc = scratch or Scratch()
        if self.type_name == "BF16" and amx.bf16_enabled() and n % 32 == 0 and not self.fine:
            # AMX-BF16 tiles, x rounded to bf16 as the pair products round it: 16 x 16 x 32
            # multiply-adds an instruction ("BF16 on AMX tiles",
            # bench/results/design_measurements.json)
            xt = sc.get("float_xt", (fg.amx_tokens(T), n // 2, fg.AMX_BF16_TOKENS), np.uint32)
            pads = sc.get("float_pads", (threads, fg.amx_bf16_rows(n), n // 2), np.uint32)
            cbs = sc.get("float_cbs", (threads, 4, 16, 16))
            fg.amx_bf16_gemm(self.w, x, out, xt, pads, cbs)
            return
        wbufs = sc.get("float_w", (threads, fg.ROWS, fg.K_STEP))
        accs = sc.get("float_acc", (threads, fg.ROWS, fg.panels(T) * fg.PANEL))
        counter = sc.get("float_counter", (1,), np.int64)
        parts = fg.token_parts(self.out_features, T, numba.get_num_threads())
        if self.type_name == "BF16" and BF16_PAIRS and n % 2 == 0 and not self.fine:
            # bf16 pair products, x rounded to bf16 as llama.cpp rounds it for these
            # weights: twice the multiplies an instruction of f32's ("bf16 prefill",
            # bench/results/design_measurements.json)
            xp2 = sc.get("float_x2", (fg.panels(T), n // 2, fg.PANEL), np.uint32)
            fg.bf16_gemm(self.w, x, out, xp2, wbufs, accs, counter, parts)
            return
        xp = sc.get("float_x", (fg.panels(T), n, fg.PANEL))
        fg.float_gemm(self.w, self._kind, x, out, xp, wbufs, accs, counter, parts)

    def _rows(self, ids, out):
        if self.type_name == "F32":
            np.take(self.w, ids, axis=0, out=out)
        else:
            self._widen(self.w[ids], out)

    def _widen(self, w16, out):
        # f16 / bf16 bits (r, n) -> out (r, n) f32 (NumPy's vectorised casts)
        if self.type_name == "F16":
            out[:] = w16.view(np.float16)
        else:
            np.left_shift(w16, 16, out=out.view(np.uint32), dtype=np.uint32)


F32 = WeightFormat("F32", "f32", FloatLinear, dequantize_f32, quantize_f32,
                   LlamaFileType.ALL_F32)
F16 = WeightFormat("F16", "f16 (IEEE half)", FloatLinear, dequantize_f16, quantize_f16,
                   LlamaFileType.MOSTLY_F16)
BF16 = WeightFormat("BF16", "bf16 (top half of f32)", FloatLinear, dequantize_bf16,
                    quantize_bf16, LlamaFileType.MOSTLY_BF16)
