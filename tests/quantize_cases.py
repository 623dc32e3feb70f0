"""Inputs of the quantize comparisons (tests/formats/test_conformance.py): what each
format's ggml golden files (tests/data/ggml_golden/<type>_<case>.bin) were made from,
the larger inputs compared with the live ggml when llama-cpp-python is installed, and the
small cases compared with gguf-py's quantizers. Inputs of the K-quants are made with
exact integer arithmetic (u24, normalish), the same on every machine and NumPy version;
the others come from NumPy's PCG64 streams at fixed seeds, which NumPy keeps stable.

`python tests/quantize_cases.py [TYPE ...]` remakes the golden files (all, or those of
the types named) with the installed ggml (needs llama-cpp-python).
"""
from __future__ import annotations

import sys
from collections.abc import Callable

import ggml_oracle
import numpy as np
from format_cases import normalish, u24

from edgellama.formats.iq4 import KVALUES

# --- Q5_0 / Q5_1 -------------------------------------------------------------------------

def q5_cases() -> dict[str, np.ndarray]:
    """Inputs regenerated from fixed seeds; each golden file stays well under 64 KB."""
    rng = np.random.default_rng(5)
    normal = rng.standard_normal((16, 512))
    outliers = rng.standard_normal((8, 256)) * 0.02
    outliers[rng.random(outliers.shape) < 0.02] *= 300           # a few spikes per row
    outliers[:, 77] = -40.0                                      # one column dominating
    zeros = rng.standard_normal((6, 256))
    zeros[0] = 0                                                 # all-zero row
    zeros[1, :32] = 0                                            # all-zero first block
    zeros[2, 32:64] = -0.0                                       # a block of -0.0
    zeros[3, ::2] = 0
    zeros[4] = -0.0
    zeros[5, 128:] = 1e-30
    constant = np.array([np.full(256, v) for v in (0.37, -2.5, 1e-3, 7.0, -1e-20, 65504.0)])
    tiny = np.array([rng.standard_normal(256) * s for s in
                     (1e-3, 1e-5, 1e-7, 1e-9, 1e-13, 1e-30, 1e-39, 1e-44)])
    huge = np.array([rng.standard_normal(256) * s for s in (1e3, 1e5, 3e5, 5e5, 1e6)])   # d overflows
    ties = np.concatenate([
        rng.integers(-16, 16, (4, 256)) * 0.125,                 # exactly on the 5-bit grid
        (rng.integers(-32, 32, (4, 256)) + 0.5) * 2.0 ** -6,     # halfway between points
        np.tile(np.repeat([1.0, -1.0, 0.5, -0.5], 8), (2, 8)),   # equal max |x|, both signs
        np.tile(np.repeat([-1.0, 1.0, -0.5, 0.5], 8), (2, 8)),
        np.tile(np.linspace(-1, 1, 32), (2, 8)),
    ])
    uniform = rng.uniform(-5, 5, (8, 384))
    cases = {"normal": normal, "outliers": outliers, "zeros": zeros, "constant": constant,
             "tiny": tiny, "huge": huge, "ties": ties, "uniform": uniform}
    return {k: np.asarray(v, np.float32) for k, v in cases.items()}


def q5_overflowing_scales(x, fmt):
    """Blocks whose d (or m) rounds to f16 infinity, by NumPy's own f16 rounding."""
    b = x.reshape(-1, 32)
    with np.errstate(over="ignore"):
        if fmt.name == "Q5_0":
            d = np.abs(b).max(1) / np.float32(16)
            return int(np.isinf(d.astype(np.float16)).sum())
        d = (b.max(1) - b.min(1)) / np.float32(31)
        return int((np.isinf(d.astype(np.float16)) | np.isinf(b.min(1).astype(np.float16))).sum())


# --- Q6_K ---------------------------------------------------------------------------------

def q6_k_cases() -> dict[str, np.ndarray]:
    """Inputs regenerated from fixed seeds; each golden file stays well under 64 KB."""
    rng = np.random.default_rng(6)
    normal = rng.standard_normal((16, 1024))
    outliers = rng.standard_normal((8, 512)) * 0.02
    outliers[rng.random(outliers.shape) < 0.01] *= 300           # a few spikes per row
    outliers[:, 77] = -40.0                                      # one column dominating
    zeros = rng.standard_normal((6, 512))
    zeros[0] = 0                                                 # all-zero row
    zeros[1, :256] = 0                                           # all-zero first block
    zeros[2, 16:48] = 0                                          # zero sub-blocks
    zeros[3, ::2] = 0
    zeros[4] = -0.0
    zeros[5, 256:] = 1e-16                                       # below GROUP_MAX_EPS
    constant = np.array([np.full(512, v) for v in (0.37, -2.5, 1e-3, 7.0, -1e-20, 65504.0)])
    tiny = np.array([rng.standard_normal(256) * s for s in
                     (1e-3, 1e-5, 1e-6, 1e-7, 1e-9, 1e-13, 1e-15, 1e-30, 1e-39, 1e-44)])
    huge = np.array([rng.standard_normal(256) * s for s in (1e3, 1e5, 3e7, 6e7, 1e38)])
    ties = np.concatenate([
        rng.integers(-32, 32, (4, 256)) * 0.125,                 # exactly on a 6-bit grid
        (rng.integers(-64, 64, (4, 256)) + 0.5) * 2.0 ** -6,     # halfway between points
        np.tile(np.repeat([1.0, -1.0, 0.5, -0.5], 4), (2, 16)),  # equal max |x|, both signs
        np.tile(np.linspace(-1, 1, 16), (2, 16)),
    ])
    uniform = rng.uniform(-5, 5, (8, 768))
    cases = {"normal": normal, "outliers": outliers, "zeros": zeros, "constant": constant,
             "tiny": tiny, "huge": huge, "ties": ties, "uniform": uniform}
    return {k: np.asarray(v, np.float32) for k, v in cases.items()}


# --- IQ4_NL / IQ4_XS -----------------------------------------------------------------------

def iq4_cases() -> dict[str, np.ndarray]:
    """Inputs regenerated from fixed seeds; each golden file stays well under 64 KB."""
    rng = np.random.default_rng(8)
    kv = KVALUES.astype(np.float64)
    normal = rng.standard_normal((16, 512))
    outliers = rng.standard_normal((8, 512)) * 0.02
    outliers[rng.random(outliers.shape) < 0.01] *= 300           # a few spikes per row
    outliers[:, 77] = -40.0                                      # one column dominating
    zeros = rng.standard_normal((6, 512))
    zeros[0] = 0                                                 # all-zero row
    zeros[1, :256] = 0                                           # all-zero super-block
    zeros[2, 32:96] = -0.0                                       # zero sub-blocks
    zeros[3, ::2] = 0
    zeros[4] = -0.0
    zeros[5, 256:] = 1e-16                                       # below GROUP_MAX_EPS
    constant = np.array([np.full(512, v) for v in (0.37, -2.5, 1e-3, 7.0, -1e-20, 65504.0)])
    tiny = np.array([rng.standard_normal(256) * s for s in
                     (1e-3, 1e-5, 1e-7, 1e-9, 1e-13, 1e-15, 1e-17, 1e-21, 1e-30, 1e-39)])
    huge = np.array([rng.standard_normal(256) * s for s in (1e3, 1e5, 3e5, 1e6)])
    ties = np.concatenate([
        kv[rng.integers(0, 16, (4, 256))] * 2.0 ** -7,           # exactly on the table grid
        (kv[:-1] + kv[1:])[rng.integers(0, 15, (4, 256))] * 2.0 ** -8,   # halfway points
        np.tile(np.repeat([1.0, -1.0, 0.5, -0.5], 8), (2, 8)),   # equal max |x|, both signs
        np.tile(np.linspace(-1, 1, 32), (2, 8)),
        np.tile(kv * kv[::-1] / 127, (2, 16)),
    ])
    uniform = rng.uniform(-5, 5, (8, 768))
    cases = {"normal": normal, "outliers": outliers, "zeros": zeros, "constant": constant,
             "tiny": tiny, "huge": huge, "ties": ties, "uniform": uniform}
    return {k: np.asarray(v, np.float32) for k, v in cases.items()}


# --- Q2_K / Q3_K (sub-blocks of 16) --------------------------------------------------------

def k16_edge_rows() -> np.ndarray:
    """One super-block per row, each a path through the quantizers (16-weight sub-blocks)."""
    n = 256
    z = normalish((16, n), 7).astype(np.float64)
    ramp = np.arange(n) / 255.0
    rows = [np.zeros(n), np.full(n, -0.0), np.full(n, 0.37), np.full(n, -0.37),
            np.abs(z[0]) + 0.5,                          # all positive (Q2_K: min clamps to 0)
            -np.abs(z[1]) - 0.5,                         # all negative
            2 * ramp - 1, 3 + ramp]
    r = z[2] * 0.01
    r[77] = 1e3                                          # one outlier
    rows.append(r)
    r = z[3].copy()
    for j in range(16):                                  # sub-blocks 2^-12 .. 2^18 apart:
        r[16 * j:16 * j + 16] *= 2.0 ** (2 * j - 12)     # small ones get scale code 0
    rows.append(r)
    r = z[4].copy()
    r[64:80] = 0                                         # one all-zero sub-block
    r[160:176] *= 1e-16                                  # one below GROUP_MAX_EPS
    rows.append(r)
    r = z[5].copy()
    r[::2] = 0                                           # half zeros
    rows.append(r)
    rows += [z[6] * s for s in (1e-30, 1e-39, 1e-44)]    # f16-underflowing d, denormals
    rows.append(np.round(z[7] * 4) / 4)                  # values on a grid: rounding ties
    rows.append(np.where(z[8] > 0, 2.0 ** -20, -2.0 ** -20))
    r = z[9].copy()
    r[[3, 40, 90, 200]] = 2.5
    r[[9, 41, 91, 201]] = -2.5                           # ties for the extremes, both signs
    rows.append(r)
    r = z[10].copy()
    r[[5, 20, 100]] = -2.5
    r[[6, 21, 101]] = 2.5                                # the negative one first
    rows.append(r)
    rows.append(z[11] * 3e4)                             # large values, d well inside f16
    rows.append(np.abs(z[12]) + 1e4)                     # large offsets (Q2_K: dmin)
    r = z[13].copy()
    r[:128] = np.abs(r[:128]) + 2                        # positive half, mixed half
    rows.append(r)
    rows.append(np.repeat(z[14, :16], 16))               # repeated values
    rows.append(np.tile([1.0, -4.0, 2.0, 3.0], 64) * 0.125)   # few distinct levels
    return np.array(rows, np.float32)


def k16_random_scaled(rows: int, n: int, seed: int) -> np.ndarray:
    """Sub-blocks of 16 with scales 2^-10 .. 2^10 apart and offsets of either sign."""
    shape = (rows, n // 16, 1)
    x = normalish((rows, n // 16, 16), seed).astype(np.float64)
    scale = 2.0 ** (u24(rows * n // 16, seed + 1) % 21 - 10).reshape(shape)
    shift = (u24(rows * n // 16, seed + 2) * 2.0 ** -24 * 6 - 3).reshape(shape)
    shift *= (u24(rows * n // 16, seed + 3).reshape(shape) % 2)
    return ((x + shift) * scale).reshape(rows, n).astype(np.float32)


def k16_outliers(rows: int, n: int, seed: int) -> np.ndarray:
    """Normal rows with one in ~50 values 20-60x larger (activation-like outliers)."""
    x = normalish((rows, n), seed).astype(np.float64)
    hit = u24(rows * n, seed + 1).reshape(rows, n) % 50 == 0
    x[hit] *= 20 + u24(rows * n, seed + 2).reshape(rows, n)[hit] % 41
    return x.astype(np.float32)


K16_CASES = {"random": lambda: normalish((16, 1024), 1),
         "scaled": lambda: k16_random_scaled(32, 512, 2),
         "outliers": lambda: k16_outliers(16, 512, 3),
         "edge": k16_edge_rows}


def k16_live_input(seed: int) -> np.ndarray:
    return np.concatenate([normalish((64, 2048), seed), k16_random_scaled(128, 2048, seed + 100),
                           k16_outliers(32, 2048, seed + 200), np.tile(k16_edge_rows(), (1, 8))])


# --- Q4_K / Q5_K (sub-blocks of 32, 6-bit scales and mins) ----------------------------------

def uniform(shape, seed: int, lo: float, hi: float) -> np.ndarray:
    u = u24(int(np.prod(shape)), seed) * 2.0 ** -24
    return (lo + (hi - lo) * u).reshape(shape).astype(np.float32)


def k32_edge_rows() -> np.ndarray:
    """One super-block per row, each a path through the quantizer."""
    n = 256
    z = normalish((14, n), 7).astype(np.float64)
    ramp = np.arange(n) / 255.0
    rows = [np.zeros(n), np.full(n, -0.0), np.full(n, 0.37), np.full(n, -0.37),
            np.abs(z[0]) + 0.5,                          # all positive: min clamps to 0
            -np.abs(z[1]) - 0.5,                         # all negative
            2 * ramp - 1, 3 + ramp]
    r = z[2] * 0.01
    r[77] = 1e3                                          # one outlier
    rows.append(r)
    r = z[3].copy()
    for j in range(8):                                   # sub-blocks 2^-12 .. 2^9 apart:
        r[32 * j:32 * j + 32] *= 2.0 ** (3 * j - 12)     # small ones get sc = 0 or m = 0
    rows.append(r)
    r = z[4].copy()
    r[64:96] = 0                                         # one all-zero sub-block
    rows.append(r)
    r = z[5].copy()
    r[::2] = 0                                           # half zeros
    rows.append(r)
    rows += [z[6] * s for s in (1e-30, 1e-39, 1e-44)]    # f16-underflowing d, denormals
    rows.append(np.round(z[7] * 4) / 4)                  # values on a grid
    rows.append(np.where(z[8] > 0, 2.0 ** -20, -2.0 ** -20))
    r = z[9].copy()
    r[[3, 40, 90, 200]] = 2.5
    r[[9, 41, 91, 201]] = -2.5                           # ties for the extremes
    rows.append(r)
    rows.append(z[10] * 3e4)                             # large values
    rows.append(np.abs(z[11]) + 1e4)                     # large mins: dmin near its range
    r = z[12].copy()
    r[:128] = np.abs(r[:128]) + 2                        # positive half, mixed half
    rows.append(r)
    rows.append(np.repeat(z[13, :32], 8))                # repeated values
    return np.array(rows, np.float32)


def k32_random_scaled(rows: int, n: int, seed: int) -> np.ndarray:
    """Sub-blocks with scales 2^-10 .. 2^10 apart and offsets of either sign (many scale
    and min codes, both top bits)."""
    shape = (rows, n // 32, 1)
    x = normalish((rows, n // 32, 32), seed).astype(np.float64)
    scale = 2.0 ** (u24(rows * n // 32, seed + 1) % 21 - 10).reshape(shape)
    shift = uniform(shape, seed + 2, -3, 3) * (u24(rows * n // 32, seed + 3).reshape(shape) % 2)
    return ((x + shift) * scale).reshape(rows, n).astype(np.float32)


K32_CASES = {"random": lambda: normalish((24, 1024), 1),
         "scaled": lambda: k32_random_scaled(32, 512, 2),
         "edge": k32_edge_rows}


def k32_live_input(seed: int) -> np.ndarray:
    return np.concatenate([normalish((64, 2048), seed),
                           k32_random_scaled(256, 2048, seed + 100),
                           uniform((64, 2048), seed + 200, -1, 1) * 1e-3,
                           np.tile(k32_edge_rows(), (1, 8))])


# --- Q4_0, Q4_1, Q8_0, F16, BF16: small cases, also compared with gguf-py -------------------

def small_edge_rows() -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = [np.zeros(64), np.full(64, -0.0), np.full(64, 0.37), np.full(64, -0.37)]
    r = rng.normal(size=64) * 0.01
    r[5] = 1e3                                       # one huge outlier
    rows.append(r)
    rows += [rng.normal(size=64) * s for s in (1e-30, 1e-39, 1e-44)]   # tiny / denormal
    r = rng.normal(size=64)
    r[[3, 50]] = 2.5
    r[[9, 40]] = -2.5                                # ties for the largest magnitude
    rows.append(r)
    r = rng.normal(size=64)
    r[[1, 33]] = -3.0
    r[[2, 34]] = 3.0                                 # ties, negative first
    rows.append(r)
    rows.append(rng.integers(-8, 8, size=64) * 0.125)    # values exactly on the grid
    rows.append((rng.integers(0, 2, size=64) - 0.5) * 2 ** -20)
    rows.append(np.clip(rng.normal(size=64) * 3e4, -65504, 65504))   # f16 near its range
    rows.append(np.linspace(-1, 1, 64))
    return np.array(rows, np.float32)


def small_cases():
    rng = np.random.default_rng(0)
    return {"random": rng.normal(size=(67, 256)).astype(np.float32),
            "uniform": rng.uniform(-5, 5, size=(9, 96)).astype(np.float32),
            "edge": small_edge_rows()}


# --- the registry ---------------------------------------------------------------------------

def _k16() -> dict[str, np.ndarray]:
    return {k: make() for k, make in K16_CASES.items()}


def _k32() -> dict[str, np.ndarray]:
    return {k: make() for k, make in K32_CASES.items()}


# The inputs of each type's golden files, by case name.
GOLDEN: dict[str, Callable[[], dict[str, np.ndarray]]] = {
    "Q5_0": q5_cases, "Q5_1": q5_cases, "Q6_K": q6_k_cases,
    "IQ4_NL": iq4_cases, "IQ4_XS": iq4_cases,
    "Q2_K": _k16, "Q3_K": _k16, "Q4_K": _k32, "Q5_K": _k32,
}


def golden_counts(fmt, case: str, x: np.ndarray) -> tuple[int, int]:
    """(blocks with NaN/inf, overflowing scales) that quantizing a golden case must report."""
    if fmt.name in ("Q5_0", "Q5_1"):
        return 0, q5_overflowing_scales(x, fmt)
    if fmt.name == "Q6_K" and case == "huge":
        return 0, 1     # 1e38 squares to inf in ggml's fit (it writes a zero block): too large
    return 0, 0


def _random_scales(lo: float, hi: float) -> Callable[[], np.ndarray]:
    def make():
        # many independent blocks at scales across the range of d (exp(lo) .. exp(hi))
        rng = np.random.default_rng(11)
        x = rng.standard_normal((64, 256)) * np.exp(rng.uniform(lo, hi, (64, 1)))
        return x.astype(np.float32)
    return make


def _k16_large(scale: float, dmin_row: bool) -> Callable[[], np.ndarray]:
    def make():
        x = normalish((4, 512), 21) * np.float32(scale)
        if dmin_row:
            x[2] = np.abs(x[2]) - np.float32(4e5)       # Q2_K: dmin near its range
        return x
    return make


def _small_case(name: str) -> Callable[[], np.ndarray]:
    return lambda: small_cases()[name]


# Inputs compared with the live ggml (llama-cpp-python) beyond the golden cases.
LIVE: dict[str, dict[str, Callable[[], np.ndarray]]] = {
    "Q5_0": {"random scales": _random_scales(-25, 12)},
    "Q5_1": {"random scales": _random_scales(-25, 12)},
    "Q6_K": {"random scales": _random_scales(-25, 18)},
    # IQ4: past f16 overflow of d and down to where x^2 underflows (ggml's weights)
    "IQ4_NL": {"random scales": _random_scales(-60, 30)},
    "IQ4_XS": {"random scales": _random_scales(-60, 30)},
    # Q2_K: d, dmin up to ~1e4 (f16 max 65504); Q3_K: d up to ~3e4
    "Q2_K": {"seed 11": lambda: k16_live_input(11), "seed 12": lambda: k16_live_input(12),
             "large": _k16_large(1e5, True)},
    "Q3_K": {"seed 11": lambda: k16_live_input(11), "seed 12": lambda: k16_live_input(12),
             "large": _k16_large(1e6, False)},
    **{t: {"seed 11": lambda: k32_live_input(11), "seed 12": lambda: k32_live_input(12),
           "seed 13": lambda: k32_live_input(13),
           "large": lambda: normalish((4, 512), 21) * 3e5}      # d, dmin up to ~2e4
       for t in ("Q4_K", "Q5_K")},
    **{t: {k: _small_case(k) for k in ("random", "uniform", "edge")}
       for t in ("Q4_0", "Q4_1", "Q8_0")},
}


if __name__ == "__main__":
    if not ggml_oracle.available():
        sys.exit("needs llama-cpp-python (ggml's quantizer)")
    for type_name in sys.argv[1:] or GOLDEN:
        for case, x in GOLDEN[type_name]().items():
            ggml_oracle.make_golden(type_name, case, x)
            print("wrote", ggml_oracle.golden_path(type_name, case))
