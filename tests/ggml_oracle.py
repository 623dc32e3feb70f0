"""ggml's own quantizer, as an oracle: `ggml_quantize_chunk` from the libggml-base that
llama-cpp-python builds (the function llama-quantize calls, here without an importance
matrix). Optional: `pip install llama-cpp-python` (see docs/design.md,
"Testing"); tests that need it live-skip without it, and golden files made with it
(tests/data/ggml_golden, see make_golden) keep the comparison in every run.
"""
from __future__ import annotations

import ctypes
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GOLDEN = Path(__file__).parent / "data" / "ggml_golden"


@lru_cache(maxsize=1)
def _lib():
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "lib" / "libggml-base.so"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def available() -> bool:
    return _lib() is not None


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """x (rows, n) f32 -> (rows, row_bytes) u8, exactly as llama-quantize writes it."""
    lib = _lib()
    t = GGMLQuantizationType[type_name]
    bs, ts = GGML_QUANT_SIZES[t]
    x = np.ascontiguousarray(x, np.float32)
    rows, n = x.shape
    out = np.zeros((rows, n // bs * ts), np.uint8)
    lib.ggml_quantize_init(int(t))
    size = lib.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
    assert size == out.nbytes, (size, out.nbytes)
    return out


def golden_path(type_name: str, case: str) -> Path:
    return GOLDEN / f"{type_name.lower()}_{case}.bin"


def make_golden(type_name: str, case: str, x: np.ndarray) -> np.ndarray:
    """ggml's bytes for x, also saved as a golden file (raw bytes, no pickle)."""
    out = quantize(x, type_name)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    golden_path(type_name, case).write_bytes(out.tobytes())
    return out


def load_golden(type_name: str, case: str, shape: tuple[int, int]) -> np.ndarray | None:
    """The saved ggml bytes for a case, (rows, row_bytes) u8, or None if not saved."""
    p = golden_path(type_name, case)
    if not p.exists():
        return None
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return np.frombuffer(p.read_bytes(), np.uint8).reshape(shape[0], shape[1] // bs * ts)
