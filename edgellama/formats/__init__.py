"""The weight-format registry: every GGML type edgellama reads, writes and runs.

One module per type (or per family sharing a layout) declares a `WeightFormat`: block
layout, reference quantize / dequantize, and the runtime `Linear` with its kernels.
Everything else reads this table: the GGUF reader's and the loader's checks, the
converter's types, `Linear` construction, the benchmarks and the tests. Adding a type
is a module, a line in FORMATS, and its tests.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import EdgeError
from . import floats, iq4, q2_k, q3_k, q4, q4_k, q5, q5_k, q6_k, q8_0
from .base import Linear, WeightFormat

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    floats.F32, floats.F16, floats.BF16,
    q4.Q4_0, q4.Q4_1, q8_0.Q8_0,
    q5.Q5_0, q5.Q5_1, iq4.IQ4_NL, iq4.IQ4_XS,
    q2_k.Q2_K, q3_k.Q3_K, q4_k.Q4_K, q5_k.Q5_K, q6_k.Q6_K,
)}
BY_ID: dict[int, WeightFormat] = {f.type_id: f for f in FORMATS.values()}
SUPPORTED = tuple(FORMATS)          # the weight types the runtime computes with
WRITABLE = tuple(n for n, f in FORMATS.items() if f.quantize is not None)


def type_name(type_id: int) -> str:
    """Name of any GGML type id (ours or not), for messages."""
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type#{type_id}"


def block_shape(type_id: int) -> tuple[int, int] | None:
    """(elements per block, bytes per block) for any known GGML type, else None
    (the reader validates files holding types we cannot run, with gguf-py's table)."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


def row_bytes(type_id: int, n: int) -> int:
    """Bytes of one row of n elements of any known type; n a multiple of the block size."""
    bs, ts = block_shape(type_id)
    assert n % bs == 0, (type_id, n)
    return n // bs * ts


def linear(type_id: int, parts) -> Linear:
    """The runtime W for one tensor or several stacked ones of the same type and row
    length: parts [(data, (out_i, in)), ...], data the tensor's bytes (read-only is fine)."""
    fmt = BY_ID.get(type_id)
    if fmt is None:
        raise ValueError(f"unsupported weight type {type_name(type_id)}")
    shapes = [tuple(int(v) for v in s) for _, s in parts]
    if any(s[1] != shapes[0][1] for s in shapes):
        raise ValueError(f"stacked tensors need one in_features, got {shapes}")
    raws = [np.asarray(d).reshape(-1).view(np.uint8) for d, _ in parts]
    return fmt.linear(fmt, raws, [s[0] for s in shapes], shapes[0][1])


def quantize(x: np.ndarray, fmt: str, name: str = "tensor") -> np.ndarray:
    """x (rows, n) float32 -> (rows, row_bytes) uint8 in format `fmt`.

    Raises EdgeError naming `name` for NaN/inf input or values whose scale (or value,
    for F16/BF16) does not fit the format."""
    f = FORMATS[fmt]
    if f.quantize is None:
        raise EdgeError(f"{name}: edgellama cannot write {fmt} (writable: {', '.join(WRITABLE)})")
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    if n % f.block_size:
        raise EdgeError(f"{name}: row length {n} is not a multiple of {f.block_size} ({fmt})")
    out = np.empty(rows * f.row_bytes(n), np.uint8)
    bad, over = f.quantize(x.reshape(-1), out)
    unit = "values" if f.block_size == 1 else "blocks"
    if bad:
        raise EdgeError(f"{name}: contains NaN or infinite values (in {bad} {unit}); "
                        f"refusing to write a broken file")
    if over:
        what = "values" if f.block_size == 1 else "block scales"
        raise EdgeError(f"{name}: magnitude too large for {fmt} ({over} {what} overflow "
                        f"{'bf16' if fmt == 'BF16' else 'fp16'}, max |x| = {float(np.abs(x).max()):.4g})")
    return out.reshape(rows, f.row_bytes(n))


def dequantize(data: np.ndarray, fmt: str) -> np.ndarray:
    """data (rows, row_bytes) uint8 in format `fmt` -> (rows, n) float32."""
    f = FORMATS[fmt]
    data = np.ascontiguousarray(data).view(np.uint8)
    rows = data.shape[0] if data.ndim > 1 else 1
    flat = data.reshape(-1)
    out = np.empty(flat.size // f.type_size * f.block_size, np.float32)
    f.dequantize(flat, out)
    return out.reshape(rows, -1)
