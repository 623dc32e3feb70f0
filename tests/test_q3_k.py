"""Q3_K against ggml and gguf-py (and the helpers test_q2_k.py shares).

- quantize: bit-exact with ggml's quantize_row_q3_K_ref, what llama-quantize writes
  without an importance matrix (ggml_quantize_chunk -> quantize_q3_K -> the _ref function
  when imatrix is NULL): ggml's bytes saved as golden files (tests/data/ggml_golden) are
  compared in every run; with llama-cpp-python installed the live library also checks those
  files and larger inputs. Regenerate the files with `python tests/test_q3_k.py`.
- dequantize: bit-exact with gguf-py, on ggml's bytes and on random bytes.
- runtime Linear: matvec against W @ xq (gguf-py's W, x rounded to int8 per 256 as the
  kernel does: only float rounding differs), matmul / rows / prefill tiles against W
  exactly or to float accuracy, stacked parts, and the int16 sums at their bounds.

Inputs are made with exact integer arithmetic (no RNG stream, no libm), so the golden
files' inputs are the same on every machine and NumPy version.
"""
import sys

import ggml_oracle
import numpy as np
import pytest
from format_cases import EPS, check, live, normalish, u24
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize as gguf_dequantize

from edgellama.formats import base
from edgellama.formats.q3_k import Q3_K

# (out, in): out not a multiple of any tile size (16 to 256 rows), in = 256 k
SHAPES = [(300, 256), (37, 512), (1030, 256), (16, 768)]


# --- inputs (shared with test_q2_k; u24, normalish: format_cases) -------------------------

def edge_rows() -> np.ndarray:
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


def random_scaled(rows: int, n: int, seed: int) -> np.ndarray:
    """Sub-blocks of 16 with scales 2^-10 .. 2^10 apart and offsets of either sign."""
    shape = (rows, n // 16, 1)
    x = normalish((rows, n // 16, 16), seed).astype(np.float64)
    scale = 2.0 ** (u24(rows * n // 16, seed + 1) % 21 - 10).reshape(shape)
    shift = (u24(rows * n // 16, seed + 2) * 2.0 ** -24 * 6 - 3).reshape(shape)
    shift *= (u24(rows * n // 16, seed + 3).reshape(shape) % 2)
    return ((x + shift) * scale).reshape(rows, n).astype(np.float32)


def outliers(rows: int, n: int, seed: int) -> np.ndarray:
    """Normal rows with one in ~50 values 20-60x larger (activation-like outliers)."""
    x = normalish((rows, n), seed).astype(np.float64)
    hit = u24(rows * n, seed + 1).reshape(rows, n) % 50 == 0
    x[hit] *= 20 + u24(rows * n, seed + 2).reshape(rows, n)[hit] % 41
    return x.astype(np.float32)


CASES = {"random": lambda: normalish((16, 1024), 1),
         "scaled": lambda: random_scaled(32, 512, 2),
         "outliers": lambda: outliers(16, 512, 3),
         "edge": edge_rows}


def live_input(seed: int) -> np.ndarray:
    return np.concatenate([normalish((64, 2048), seed), random_scaled(128, 2048, seed + 100),
                           outliers(32, 2048, seed + 200), np.tile(edge_rows(), (1, 8))])


# --- calling a format's reference kernels ------------------------------------------------

def quantize(fmt, x: np.ndarray, counts=(0, 0)) -> np.ndarray:
    out = np.empty(x.size // 256 * fmt.type_size, np.uint8)
    assert fmt.quantize(np.ascontiguousarray(x, np.float32).reshape(-1), out) == counts
    return out.reshape(x.shape[0], -1)


def dequantize(fmt, q: np.ndarray) -> np.ndarray:
    out = np.empty(q.size // fmt.type_size * 256, np.float32)
    fmt.dequantize(np.ascontiguousarray(q).reshape(-1), out)
    return out.reshape(q.shape[0], -1)


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(np.asarray(a, np.float32).view(np.uint32),
                                  np.asarray(b, np.float32).view(np.uint32))


def random_blocks(fmt, nblocks: int, seed: int, halves: list[int]) -> np.ndarray:
    """Random bytes as blocks; the f16 scales at byte offsets `halves` finite (exponent
    < 31), including the largest, the smallest subnormal, zero and -0."""
    q = (u24(nblocks * fmt.type_size, seed) % 256).astype(np.uint8).reshape(nblocks, -1)
    for k, o in enumerate(halves):
        h = (u24(nblocks, seed + 1 + k) % 0x7C00).astype(np.uint16)
        h |= ((u24(nblocks, seed + 9 + k) % 2).astype(np.uint16) << 15)
        h[:4] = [0x7BFF, 0x0001, 0x0000, 0x8000]
        q[:, o:o + 2] = h.view(np.uint8).reshape(-1, 2)
    return q


# --- runtime Linear checks ---------------------------------------------------------------

def xq_twin(x: np.ndarray) -> np.ndarray:
    """x as the decode kernels see it: per 256, rounded to the int8 grid of amax / 127."""
    xb = x.reshape(-1, 256)
    dx = np.abs(xb).max(1, keepdims=True) / np.float32(127)
    inv = np.float32(1) / np.where(dx > 0, dx, np.float32(1))
    xq = np.where(dx > 0, np.rint(xb * inv), 0)
    return (xq * dx.astype(np.float64)).reshape(x.shape)


def check_matvec(got: np.ndarray, w: np.ndarray, wmag: np.ndarray, x: np.ndarray) -> None:
    """got = W @ x from a decode kernel; w (d, n) float64 the true W, wmag >= |w| term by
    term the magnitude of what is summed (|w| for Q3_K; |d sc q| + |dmin m| for Q2_K).

    With xq = xq_twin(x) the kernel's integer sums are exact, so got differs from W @ xq
    by float rounding only: per super-block a few roundings, then nb f32 additions, so
    (nb + 4) eps sum |terms|, with a margin of 4. The distance to W @ x is then the x
    rounding, each x_i moving by at most amax_b / 254."""
    xq = xq_twin(x)
    nb = x.size // 256
    tol = 4 * (nb + 4) * EPS * (wmag @ np.abs(xq)) + 1e-37
    err = np.abs(got - w @ xq)
    assert np.all(err <= tol), np.max(err / tol)
    step = np.repeat(np.abs(x).reshape(-1, 256).max(1), 256) / 254
    assert np.all(np.abs(got - w @ x) <= tol + np.abs(w) @ step * 1.001)


def linear(fmt, datas: list[np.ndarray], n: int):
    for d in datas:
        d.setflags(write=False)                          # file views are read-only
    return fmt.linear(fmt, [d.reshape(-1) for d in datas], [d.shape[0] for d in datas], n)


def weights(shape, seed: int) -> np.ndarray:
    w = normalish(shape, seed)
    w[0] *= 1e-6                                         # tiny scales: f16 subnormal d
    w[1, :256] = np.abs(w[1, :256]) + 3                  # large offsets
    return w


def check_linear(fmt, shape, wmag_of, monkeypatch) -> None:
    """matvec, matmul (T = 1 and 7, several prefill chunks), rows and the prefill tiles of
    fmt's Linear for W (shape), against gguf-py's dequantized W."""
    q = quantize(fmt, weights(shape, 5))
    w = gguf_dequantize(q, G[fmt.name]).astype(np.float64).reshape(shape)
    lin = linear(fmt, [q], shape[1])
    assert (lin.out_features, lin.in_features, lin.nbytes) == (*shape, q.nbytes)
    x = normalish(shape[1], 6) * np.float32(3)
    out = np.full(shape[0], np.nan, np.float32)
    lin.matvec(x, out)
    check_matvec(out, w, wmag_of(q, shape), x)

    monkeypatch.setattr(base, "_CHUNK_FLOATS", shape[1] * 40)   # several chunks, ragged last
    monkeypatch.setattr(base, "_CHUNK_MIN_ROWS", 1)
    for T in (1, 7):
        xs = normalish((T, shape[1]), 7 + T)
        outs = np.full((T, shape[0]), np.nan, np.float32)
        lin.matmul(xs, outs)
        check(outs, w, xs)            # prefill: f32 BLAS on the exact W

    buf = np.empty(shape[1] * lin.nt * lin.R, np.float32)
    assert_same_bits(lin._dequant_rows_t(0, shape[0], buf), w.T)      # gguf's values exactly
    ids = np.array([0, shape[0] - 1, 5 % shape[0], 5 % shape[0], shape[0] // 2], np.int64)
    rows = np.full((ids.size, shape[1]), np.nan, np.float32)
    lin.rows(ids, rows)
    assert_same_bits(rows, w[ids])
    with pytest.raises(IndexError):
        lin.rows(np.array([shape[0]]), rows[:1])


def check_stacked(fmt, wmag_of) -> None:
    # q/k/v-like parts, none a multiple of the tile size: one W, outputs split back
    n = 512
    qs = [quantize(fmt, normalish((s, n), 20 + i)) for i, s in enumerate((150, 37, 37))]
    lin = linear(fmt, qs, n)
    w = np.concatenate([gguf_dequantize(q, G[fmt.name]).reshape(-1, n) for q in qs])
    w = w.astype(np.float64)
    wmag = np.concatenate([wmag_of(q, (q.shape[0], n)) for q in qs])
    assert lin.out_features == 224 and lin.nbytes == sum(q.nbytes for q in qs)
    x = normalish(n, 30)
    out = np.full(224, np.nan, np.float32)
    lin.matvec(x, out)
    check_matvec(out, w, wmag, x)
    assert [o.shape for o in lin.split(out)] == [(150,), (37,), (37,)]
    xs = normalish((3, n), 31)
    outs = np.full((3, 224), np.nan, np.float32)
    lin.matmul(xs, outs)
    check(outs, w, xs)            # prefill: f32 BLAS on the exact W


def resident_bytes(lin) -> int:
    # the tiles: every array the Linear holds except its per-call scratch (names with _)
    return sum(v.nbytes for k, v in vars(lin).items() if isinstance(v, np.ndarray) and k[0] != "_")


def regenerate(fmt) -> None:
    """Write fmt's golden files with the installed ggml (run this file as a script)."""
    for case, make in CASES.items():
        ggml_oracle.make_golden(fmt.name, case, make())
        print("wrote", ggml_oracle.golden_path(fmt.name, case))


# --- Q3_K --------------------------------------------------------------------------------

def q3_mag(q, shape):
    return np.abs(gguf_dequantize(q, G.Q3_K).astype(np.float64).reshape(shape))


@pytest.mark.parametrize("case", CASES)
def test_quantize_matches_ggml_golden(case):
    x = CASES[case]()
    golden = ggml_oracle.load_golden("Q3_K", case, x.shape)
    assert golden is not None, f"missing golden file: run `python {__file__}` with llama-cpp-python"
    np.testing.assert_array_equal(quantize(Q3_K, x), golden)


@live
def test_golden_files_are_ggml_today():
    for case, make in CASES.items():
        x = make()
        np.testing.assert_array_equal(ggml_oracle.quantize(x, "Q3_K"),
                                      ggml_oracle.load_golden("Q3_K", case, x.shape))


@live
@pytest.mark.parametrize("seed", [11, 12])
def test_quantize_matches_ggml_live(seed):
    x = live_input(seed)
    np.testing.assert_array_equal(quantize(Q3_K, x), ggml_oracle.quantize(x, "Q3_K"))


@live
def test_large_but_representable_matches_ggml():
    x = normalish((4, 512), 21) * np.float32(1e6)       # d up to ~3e4 (f16 max 65504)
    np.testing.assert_array_equal(quantize(Q3_K, x), ggml_oracle.quantize(x, "Q3_K"))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_blocks_counted(bad):
    x = normalish((3, 512), 5)
    x[1, 300] = bad
    x[2, 0] = bad
    out = np.empty(x.size // 256 * 110, np.uint8)
    assert Q3_K.quantize(x.reshape(-1), out)[0] == 2


def test_scale_overflow_counted():
    # d overflows f16 (1e9); from ~4e12 ggml's search overflows f32 and may write d = 0
    # (all zeros), which must not pass silently either
    x = normalish((4, 512), 6)
    x[0, :256] *= np.float32(1e9)
    x[2, 256:] *= np.float32(1e20)
    x[3, :256] *= np.float32(1e30)
    assert Q3_K.quantize(x.reshape(-1), np.empty(8 * 110, np.uint8)) == (0, 3)


def test_levels_are_nearest():
    # independent of ggml: with the stored d sc of each sub-block (when nonzero), every
    # level strictly inside -4..3 is the nearest to x / (d sc); one at an end is on its side
    x = np.concatenate([c().reshape(-1) for c in CASES.values()]).astype(np.float64)
    q = quantize(Q3_K, x.reshape(-1, 256)).reshape(-1, 110)
    w = gguf_dequantize(q, G.Q3_K).astype(np.float64).reshape(-1, 16, 16)
    probe = q.copy()
    probe[:, :96] = 0                                    # every level -4: gives -4 d sc
    dl = gguf_dequantize(probe, G.Q3_K).astype(np.float64).reshape(-1, 16, 16)[:, :, :1] / -4
    x = x.reshape(-1, 16, 16)
    lev = np.divide(w, dl, out=np.zeros_like(w), where=dl != 0)
    r = x - w
    tol = 0.5 * np.abs(dl) * (1 + 1e-6) + 4 * EPS * np.abs(x)
    on = np.broadcast_to(dl != 0, lev.shape)
    inner = on & (lev > -4) & (lev < 3)
    assert np.all(np.abs(r)[inner] <= tol[inner])
    pos = np.broadcast_to(dl > 0, lev.shape)
    neg = np.broadcast_to(dl < 0, lev.shape)
    for sel, below in ((pos & (lev == -4), True), (pos & (lev == 3), False),
                       (neg & (lev == -4), False), (neg & (lev == 3), True)):
        assert np.all(r[sel] <= tol[sel]) if below else np.all(r[sel] >= -tol[sel])


def test_dequantize_matches_gguf():
    for x in (CASES["random"](), edge_rows()):
        q = quantize(Q3_K, x)
        assert_same_bits(dequantize(Q3_K, q), gguf_dequantize(q, G.Q3_K))
    q = random_blocks(Q3_K, 300, 40, [108])
    assert_same_bits(dequantize(Q3_K, q), gguf_dequantize(q, G.Q3_K).reshape(300, -1))
    assert not dequantize(Q3_K, np.zeros((2, 110), np.uint8)).any()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear(shape, monkeypatch):
    check_linear(Q3_K, shape, q3_mag, monkeypatch)


def test_stacked():
    check_stacked(Q3_K, q3_mag)


def test_matvec_int16_sums_at_their_bounds():
    # weights at level -4 or 3 with the extreme scales -32 and 31, x = +-127 (xq = x, the
    # x scale 1): row 0 all -4 with scale -32 reaches the int16 sub-block sum -8128 and
    # the int32 sum 16 * 32 * 8128 per super-block; W @ x is then exact
    n, d = 512, 40
    blk = np.zeros((d, n // 256, 110), np.uint8)
    lvl = (u24(d * n, 50).reshape(d, n // 256, 256) % 2).astype(np.uint8) * 7   # 0 or 7
    lvl[0] = 0
    lvl[1] = 7
    for e in range(256):
        blk[:, :, e % 32] |= (lvl[:, :, e] >> 2) << (e // 32)
        blk[:, :, 32 + 32 * (e // 128) + e % 32] |= (lvl[:, :, e] & 3) << (2 * ((e % 128) // 32))
    code = np.where(u24(d * n // 16, 51).reshape(d, n // 256, 16) % 2 == 0, 0, 63)  # -32, 31
    code[0] = 0
    for j in range(16):
        blk[:, :, 96 + j % 8] |= (code[:, :, j] & 15).astype(np.uint8) << (4 * (j // 8))
        blk[:, :, 104 + j % 4] |= (code[:, :, j] >> 4).astype(np.uint8) << (2 * (j // 4))
    blk[:, :, 108:110] = np.array([0x3C00], np.uint16).view(np.uint8)            # d = 1
    q = blk.reshape(d, -1)
    w = gguf_dequantize(q, G.Q3_K).astype(np.float64)
    assert np.all(w[0] == 128) and np.abs(w).max() == 128
    lin = linear(Q3_K, [q], n)
    for x in (np.full(n, 127, np.float32), np.where(w[3] > 0, 127, -127).astype(np.float32)):
        out = np.empty(d, np.float32)
        lin.matvec(x, out)
        np.testing.assert_array_equal(out, w @ x)


def test_resident_memory_about_file_size():
    q = quantize(Q3_K, normalish((1024, 1024), 60))
    lin = linear(Q3_K, [q], 1024)
    assert lin.nt * lin.R == 1024
    assert resident_bytes(lin) == q.nbytes * 114 // 110  # +4 bytes a block: scales as i8


if __name__ == "__main__":
    if not ggml_oracle.available():
        sys.exit("needs llama-cpp-python (ggml's quantizer)")
    regenerate(Q3_K)
