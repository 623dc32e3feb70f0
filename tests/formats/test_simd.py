"""simd's tile intrinsics (blocks_gemm, q4k_gemm, iq4xs_gemm, q6_gemm and its Q3_K and Q2_K kinds),
in each instruction set (all are compiled here; Numba's target must have the instructions
to compile and run them, so the VNNI and AVX2 cases skip elsewhere), against a NumPy twin;
and the instruction set chosen from that target."""
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import literally, njit

from edgellama.kernels.simd import (AVX2, AVX_VNNI, BLOCK_BYTES, BLOCK_HEAD, BLOCK_QUADS, GENERIC, IQ4_VALUES, ISA, KIND_IQ4_NL,
                            KIND_Q4_0, KIND_Q4_1,
                            KIND_Q5_0, KIND_Q5_1, KIND_Q8_0, Q4K_D, Q4K_DMIN, Q4K_M, Q4K_QS, Q4K_RECORD, Q4K_SC, Q5K_QH,
                            Q5K_RECORD, Q6K_D, Q6K_QS, Q6K_RECORD, Q6K_SC, RECORD_ROWS, TOKENS,
                            Q2K_DMIN, Q2K_RECORD, Q2K_SC, Q3K_RECORD,
                            VNNI512, IQ4XS_D, IQ4XS_QS, IQ4XS_RECORD, IQ4XS_SC, ISA_NAMES, ISAS, K_GROUP, Q8X,
                            K_VALUES, VALUES_BLOCK, blocks_gemm, iq4xs_gemm, q4k_gemm, q6_gemm, target_isa,
                            tile)
from edgellama.kernels import simd
from edgellama.kernels.amx import KIND_IQ4_XS
from edgellama.kernels.target import FEATURES as _F


RUNS = {i: row.needs <= _F for i, row in enumerate(ISAS)}     # the rows this target can run


def isa_cases(variants: dict, generic: set):
    """(variant, isa) parameters, ids as separate parametrize would give them. Each
    combination compiles a kernel of its own (the test's njit wrapper, every run): the
    generic instructions of a variant outside `generic` run under -m slow, where the
    generic code they take is that of a variant kept (the caller says which)."""
    return [pytest.param(v, isa, id=f"{name}-{isa}",
                         marks=pytest.mark.slow if isa == GENERIC and v not in generic else ())
            for name, v in variants.items() for isa in RUNS]


def test_isa_is_the_best_the_target_has():
    assert RUNS[ISA] and all(not RUNS[i] for i in RUNS if i > ISA)
    assert target_isa(set()) == GENERIC
    assert target_isa({"sse4.2", "avx", "fma", "f16c"}) == GENERIC
    assert target_isa({"avx", "avx2", "fma"}) == AVX2
    assert target_isa({"avx2", "avx512f", "avx512bw"}) == AVX2       # Skylake-X: no VNNI
    assert target_isa({"avx2", "avx512f", "avx512vnni"}) == AVX2     # VNNI without BW's bytes
    assert target_isa({"avx2", "avx512f", "avx512bw", "avx512vnni"}) == VNNI512
    assert target_isa({"avx", "avx2", "fma", "avxvnni"}) == AVX_VNNI         # Alder Lake


ISA_PROBE = """
import numpy as np
from edgellama.benchmark import random_weights
from edgellama.formats import FORMATS, linear
from edgellama.kernels.simd import ISA, ISA_NAMES
rng = np.random.default_rng(0)
raw = random_weights(rng, 32, 256, "Q4_0", 1.0)
w = linear(FORMATS["Q4_0"].type_id, [(raw, (32, 256))])
x = rng.standard_normal(256).astype(np.float32)
got = np.empty(32, np.float32)
w.matvec(x, got)
ref = np.empty((32, 256), np.float32)
FORMATS["Q4_0"].dequantize(raw.reshape(-1), ref.reshape(-1))
print(ISA_NAMES[ISA], "|", float(np.abs(got - ref @ x).max() / np.abs(ref @ x).max()))
"""


HASWELL = {"NUMBA_CPU_NAME": "haswell",      # an AVX2 CPU: the name alone keeps the host's features
           "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,"
                                 "+fxsr,+invpcid,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,"
                                 "+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt"}


def target_env(**env):
    """This process's environment without its NUMBA_CPU_* settings, and env: a child
    compiling for the target env names."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    e.update(env)
    return e


# an Intel client core since Alder Lake: AVX2 and AVX-VNNI, no AVX-512
ALDER_LAKE = {"NUMBA_CPU_NAME": "alderlake",
              "NUMBA_CPU_FEATURES": HASWELL["NUMBA_CPU_FEATURES"] + ",+avxvnni"}
# an Intel server core since Ice Lake: AVX-512 with VNNI (no AMX)
ICELAKE_SERVER = {"NUMBA_CPU_NAME": "icelake-server",
                  "NUMBA_CPU_FEATURES": HASWELL["NUMBA_CPU_FEATURES"]
                  + ",+avx512f,+avx512bw,+avx512cd,+avx512dq,+avx512vl,+avx512vnni"}


# Each a process compiling afresh; NUMBA_ENABLE_AVX=0 reaches target_isa as the same
# feature set without AVX2 (test_isa_is_the_best_the_target_has), so runs under -m slow,
# as do Haswell's AVX2 and Alder Lake's AVX-VNNI (their instructions run in this process
# too where the CPU has them).
@pytest.mark.parametrize("env,isa", [({"NUMBA_CPU_NAME": "generic"}, GENERIC),
                                     pytest.param({"NUMBA_ENABLE_AVX": "0"}, GENERIC, marks=pytest.mark.slow),
                                     pytest.param(HASWELL, AVX2, marks=pytest.mark.slow),
                                     pytest.param(ALDER_LAKE, AVX_VNNI, marks=pytest.mark.slow)])
def test_kernels_follow_numba_target_not_host(tmp_path, env, isa):
    """NUMBA_CPU_NAME=generic (a cache shared between machines) compiles for no vector
    extension: a kernel with the host's VNNI or AVX2 intrinsics would abort the process
    in LLVM. The kernels pick the target's instructions and still compute the product."""
    if not RUNS[isa]:
        pytest.skip(f"this CPU cannot run {ISA_NAMES[isa]} code")
    e = target_env(**env, EDGELLAMA_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", ISA_PROBE], env=e, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    name, err = r.stdout.strip().split(" | ")
    assert name == ISA_NAMES[isa] and float(err) < 0.02


COMPILE_PROBE = """
import sys
import edgellama
from edgellama.kernels import jit
from edgellama.kernels.simd import ISA, ISA_NAMES
count = 0
for path in sys.argv[1:]:
    llm = edgellama.load(path, ctx=64, cache_type_k="q8_0", cache_type_v="q8_0")
    for kernel, sig in jit.kernels_called(llm.model):   # found without running them
        kernel.compile(sig)
        count += 1
print(ISA_NAMES[ISA], "|", count)
"""


@pytest.mark.slow
@pytest.mark.parametrize("env,isa", [(ALDER_LAKE, AVX_VNNI), (ICELAKE_SERVER, VNNI512)], ids=["alder_lake", "icelake"])
def test_every_kernel_compiles_for_the_vnni_rows_here(tmp_path, env, isa):
    """The AVX-VNNI row is the choice of CPUs none of our test machines is, and the
    AVX-512 VNNI row that of only some (where a CPU has a row's instructions, the twins
    below run it): every kernel a forward pass of each product family calls (and a q8_0
    cache's scores) compiles for that target, nothing run. The files are written here,
    on this CPU's own code."""
    from tiny_gguf import write_tiny_gguf
    paths = [str(write_tiny_gguf(tmp_path / f"{t}.gguf", t, dim=256, ffn=256, vocab=512, tokenizer=True))
             for t in ("Q4_0", "Q8_0", "IQ4_NL", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS")]
    e = target_env(**env, EDGELLAMA_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", COMPILE_PROBE, *paths], env=e, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    name, count = r.stdout.strip().splitlines()[-1].split(" | ")
    assert name == ISA_NAMES[isa] and int(count) > 100


# --- blocks_gemm: records of a per-32-block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) ----

@njit
def _blocks(q, x8, xd, xs8, xsum, acc, nb, group, t0, tokens, kind, isa):
    # literally: one compiled entry per constant combination the intrinsic needs
    blocks_gemm(q, Q8X(x8, xd, xs8, xsum), acc, tile(nb, group, t0, literally(tokens), literally(kind)),
                literally(isa))


def fifth_bit_bytes(fifth):
    """The 4 bytes a row of a Q5 block's fifth bits (32,) 0/1 take in a record: bit
    f = 2 g + h of byte i is element 16 h + 4 g + i's (simd.py's layout)."""
    return np.array([sum(int(fifth[16 * (f & 1) + 4 * (f >> 1) + i]) << f for f in range(8))
                     for i in range(4)], np.uint8)


def block_records(kind, group, d, m, wbytes, fifth=None):
    """A tile of records of `group` blocks from per-row values: d, m (R, nb) f16 (m for
    Q4_1 and Q5_1 only); wbytes (R, nb, 16 or 32) u8 each block's bytes (Q4, Q5: byte j
    holds the low 4 bits of elements j and j + 16; Q8_0: the int8); fifth (R, nb, 32)
    0/1 the Q5 values' fifth bits."""
    R, nb = d.shape
    bb = BLOCK_BYTES[kind]
    rec = np.zeros((R // RECORD_ROWS, nb // group, group * bb), np.uint8)
    for r in range(R):
        s, lane = divmod(r, RECORD_ROWS)
        for b in range(nb):
            g, k = divmod(b, group)
            out = rec[s, g]
            out[32 * k + 2 * lane:32 * k + 2 * lane + 2] = d[r, b:b + 1].view(np.uint8)
            if kind in (KIND_Q4_1, KIND_Q5_1):
                o = 32 * group + 32 * k + 2 * lane
                out[o:o + 2] = m[r, b:b + 1].view(np.uint8)
            qo = BLOCK_HEAD[kind] * group + BLOCK_QUADS[kind] * k + 4 * lane
            for j in range(wbytes.shape[2]):
                out[qo + 64 * (j // 4) + j % 4] = wbytes[r, b, j]
            if fifth is not None:
                out[qo + 256:qo + 260] = fifth_bit_bytes(fifth[r, b])
    return rec.reshape(-1)


def blocks_case(isa, kind, R, group, tokens, case, kernel=None):
    """blocks_gemm's acc for a random tile of R rows of 2 records of `group` blocks, and
    `tokens` rows t0.. of x, and its float64 twin: per block d dx S (Q4_0: S - 8 xs8;
    Q5_0: S - 16 xs8; Q4_1, Q5_1: + m xsum), S the block's exact sum of weights times
    x8 (IQ4_NL's weights IQ4_VALUES[nibble]). case "bounds": every value 15 (Q4), 31
    (Q5) or every int8 weight -128, IQ4_NL's nibbles 0 or 15 (-127 and 113, biased 1 and
    241) against x8 = +-127, the largest sums (AVX2's int16 pairs at their edge);
    "random". kernel: _blocks compiled afresh, to call instead."""
    nb, t0 = 2 * group, tokens                     # the second group of rows of x
    T = 2 * tokens
    nw = 32 if kind == KIND_Q8_0 else 16
    rng = np.random.default_rng(100 * isa + 10 * kind + R + group + tokens)
    w = rng.integers(0, 256, (R, nb, nw), dtype=np.uint8)
    x8 = rng.integers(-127, 128, (T, 32 * nb), dtype=np.int8)
    five = kind in (KIND_Q5_0, KIND_Q5_1)
    fifth = rng.integers(0, 2, (R, nb, 32), dtype=np.uint8) if five else None
    if case == "bounds":
        w[:] = 0x80 if kind == KIND_Q8_0 else 0xFF
        if kind == KIND_IQ4_NL:
            w[:] = rng.choice(np.array([0x00, 0x0F, 0xF0, 0xFF], np.uint8), w.shape)
        x8 = np.where(rng.random(x8.shape) < 0.5, -127, 127).astype(np.int8)
        if five:
            fifth[:] = 1
    d = rng.standard_normal((R, nb)).astype(np.float16)
    m = rng.standard_normal((R, nb)).astype(np.float16)
    xd = rng.random((T, nb)).astype(np.float32)
    xs8 = x8.reshape(T, nb, 32).astype(np.int32).sum(axis=2)
    xsum = rng.standard_normal((T, nb)).astype(np.float32)
    acc = np.full(tokens * R, 7, np.float32)
    (kernel or _blocks)(block_records(kind, group, d, m, w, fifth), x8.reshape(-1), xd.reshape(-1),
                        xs8.reshape(-1), xsum.reshape(-1), acc, nb, group, t0, tokens, kind, isa)
    if kind == KIND_Q8_0:
        vals = w.view(np.int8).astype(np.int64)                              # (R, nb, 32)
    else:
        vals = np.concatenate([w & 15, w >> 4], axis=2).astype(np.int64)
        if kind == KIND_IQ4_NL:
            vals = np.array(IQ4_VALUES, np.int64)[vals]
        if five:
            vals |= fifth.astype(np.int64) << 4
    want = np.zeros((tokens, R))
    for k in range(tokens):
        tok = t0 + k
        S = np.einsum("rbe,be->rb", vals, x8[tok].reshape(nb, 32).astype(np.int64))
        S = S.astype(np.float64)
        if kind in (KIND_Q4_0, KIND_Q5_0):
            S = S - (8 if kind == KIND_Q4_0 else 16) * xs8[tok]
        terms = d.astype(np.float64) * xd[tok] * S
        if kind in (KIND_Q4_1, KIND_Q5_1):
            terms += m.astype(np.float64) * xsum[tok]
        want[k] = terms.sum(axis=1)
    return acc.reshape(tokens, R), want


# generic Q4_0: Q4_1's unsigned nibble dot (Q4_1 adds the min); its -8 offset is the
# same code on every instruction set (AVX2's Q4_0 cases). Q5_0 likewise: Q5_1's dot.
# Q8_0's signed dot stays, and IQ4_NL's generic table lookup.
@pytest.mark.parametrize("kind,isa", isa_cases({"Q4_0": KIND_Q4_0, "Q4_1": KIND_Q4_1, "Q8_0": KIND_Q8_0,
                                                "Q5_0": KIND_Q5_0, "Q5_1": KIND_Q5_1, "IQ4_NL": KIND_IQ4_NL},
                                               {KIND_Q4_1, KIND_Q8_0, KIND_Q5_1, KIND_IQ4_NL}))
@pytest.mark.parametrize("R,group", [(16, 8), (32, 1), (256, 2)])
@pytest.mark.parametrize("tokens", [1, TOKENS])
@pytest.mark.parametrize("case", ["bounds", "random"])
def test_blocks_gemm_matches_twin(isa, kind, R, group, tokens, case):
    if not RUNS[isa]:
        pytest.skip("Numba's target (this CPU, or NUMBA_CPU_*) lacks the instructions")
    got, want = blocks_case(isa, kind, R, group, tokens, case)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_decode_streams_give_the_same_sums(monkeypatch, streams):
    """Decode walks DECODE_STREAMS row vectors side by side (a CPU's choice), then halves
    of that down to one: every count gives the twin's sums, here over 7 vectors (4 + 2 +
    1 at 4, where a vector is a strip of 16 rows). The intrinsic reads the count when a
    caller compiles, so a fresh wrapper."""
    monkeypatch.setattr(simd, "DECODE_STREAMS", streams)
    got, want = blocks_case(ISA, KIND_Q4_0, 7 * RECORD_ROWS, 2, 1, "random",
                            kernel=njit(_blocks.py_func))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("cpu,streams", [("znver5", 1), ("znver4", 1), ("sapphirerapids", 4),
                                         ("haswell", 4)])
def test_decode_streams_follow_numba_target(cpu, streams):
    """The count is the CPU Numba compiles for (NUMBA_CPU_NAME, as its kernel cache is
    keyed), not the host's."""
    e = target_env(NUMBA_CPU_NAME=cpu)
    r = subprocess.run([sys.executable, "-c", "from edgellama.kernels import simd; print(simd.DECODE_STREAMS)"],
                       env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) == streams


# --- q6_gemm: Q6_K records (per 16 rows and super-block: d, int8 scales, nibble and crumb quads)

@njit
def _gemm6(q, x8, xd, xs16, xsum16, acc, nsub, t0, tokens, isa):
    q6_gemm(q, Q8X(x8, xd, xs16, xsum16), acc, tile(nsub, K_GROUP, t0, literally(tokens), 6),
            literally(isa))


def q6_records(d, sc, vals):
    """A tile of Q6_K records from per-row values: d (R, nsb) f16, sc (R, nsub, 2) i8 (the
    scales of elements 0..15 and 16..31 of each block), vals (R, nsub, 32) the 6-bit q."""
    R, nsb = d.shape
    rec = np.zeros((R // RECORD_ROWS, nsb, Q6K_RECORD), np.uint8)
    nib = (vals[:, :, :16] & 15) | ((vals[:, :, 16:] & 15) << 4)                 # (R, nsub, 16)
    hi = vals >> 4
    crumb = hi[:, :, :8] | (hi[:, :, 8:16] << 2) | (hi[:, :, 16:24] << 4) | (hi[:, :, 24:] << 6)
    for r in range(R):
        s, lane = divmod(r, RECORD_ROWS)
        for b in range(nsb):
            out = rec[s, b]
            out[Q6K_D + 2 * lane:Q6K_D + 2 * lane + 2] = d[r, b:b + 1].view(np.uint8)
            for k in range(8):
                u = 8 * b + k
                out[Q6K_SC + 32 * k + lane] = sc[r, u, 0].view(np.uint8)
                out[Q6K_SC + 32 * k + 16 + lane] = sc[r, u, 1].view(np.uint8)
                o = Q6K_QS + 384 * k + 4 * lane
                for j in range(16):
                    out[o + 64 * (j // 4) + j % 4] = nib[r, u, j]
                for j in range(8):
                    out[o + 256 + 64 * (j // 4) + j % 4] = crumb[r, u, j]
    return rec.reshape(-1)


def gemm6_case(isa, R, tokens, case):
    """q6_gemm's acc for a random tile of R rows, 2 super-blocks, and `tokens` rows t0.. of
    x, its float64 twin: per super-block d sum_u dx_u S_u, S_u = sum over block u's
    halves of scale * sum((q - 32) x8), and the sum of the magnitudes of the terms the
    kernel may form in f32 (AVX2's d dx scale sum(q x8) and d 32 scale xsum16, apart:
    q6_gemm). case "exact": d and the x scales 1 or 2 and
    |x8| <= 15, so every f32 step is exact; "max", "zero": every q 63 or 0 against
    x8 = +-127 and scales at the int8 bounds, the largest sums (vpmaddubsw pairs at
    2 * 63 * 127, summed two by two in int16); "random"."""
    nsub, t0 = 16, tokens                           # the second group of rows of x
    T = 2 * tokens
    rng = np.random.default_rng(10 * isa + R + tokens)
    vals = rng.integers(0, 64, (R, nsub, 32))
    sc = rng.integers(-128, 128, (R, nsub, 2)).astype(np.int8)
    x8 = rng.integers(-127, 128, (T, 32 * nsub), dtype=np.int8)
    d = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    xd = rng.random((T, nsub)).astype(np.float32)
    if case == "exact":                        # every sum an integer below 2^24
        x8 = rng.integers(-15, 16, x8.shape, dtype=np.int8)
        d = (2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16)
        xd = (2.0 ** rng.integers(0, 2, xd.shape)).astype(np.float32)
    elif case in ("max", "zero"):
        vals[:] = 63 if case == "max" else 0
        sc = np.where(rng.random(sc.shape) < 0.5, -128, 127).astype(np.int8)
        x8 = np.where(rng.random(x8.shape) < 0.5, -127, 127).astype(np.int8)
        d[:] = 1
        xd[:] = 1
    xs16 = x8.reshape(T, 2 * nsub, 16).astype(np.int32).sum(axis=2)
    xsum16 = (np.repeat(xd, 2, axis=1) * xs16).astype(np.float32)
    acc = np.full(tokens * R, 7, np.float32)
    _gemm6(q6_records(d, sc, vals), x8.reshape(-1), xd.reshape(-1), xs16.reshape(-1), xsum16.reshape(-1), acc,
           nsub, t0, tokens, isa)
    want, mag = np.zeros((tokens, R)), np.zeros((tokens, R))
    for k in range(tokens):
        tok = t0 + k
        xh = x8[tok].reshape(nsub, 2, 16).astype(np.int64)
        S = (sc.astype(np.int64)
             * np.einsum("ruhe,uhe->ruh", vals.reshape(R, nsub, 2, 16) - 32, xh)).sum(axis=2)
        blocks = (xd[tok].astype(np.float64) * S).reshape(R, nsub // 8, 8).sum(axis=2)
        want[k] = (d.astype(np.float64) * blocks).sum(axis=1)
        parts = np.abs(sc * np.einsum("ruhe,uhe->ruh", vals.reshape(R, nsub, 2, 16), xh) * xd[tok].reshape(nsub, 1))
        parts += np.abs(32.0 * sc * xsum16[tok].reshape(nsub, 2))
        mag[k] = (np.abs(d.astype(np.float64)) * parts.sum(axis=2).reshape(R, nsub // 8, 8).sum(axis=2)).sum(axis=1)
    return acc.reshape(tokens, R), want, mag


# --- q6_gemm's kinds 3 and 2: Q3_K's and Q2_K's records (per 16 rows and super-block: d,
# the scale bytes, crumb quads; Q3_K's third bits after them, Q2_K's dmin) ----------------

@njit
def _gemm_low(q, x8, xd, xs16, xsum16, acc, nsub, t0, tokens, kind, isa):
    q6_gemm(q, Q8X(x8, xd, xs16, xsum16), acc, tile(nsub, K_GROUP, t0, literally(tokens), literally(kind)),
            literally(isa))


def low_records(kind, d, dmin, sc, vals):
    """A tile of Q3_K (kind 3) or Q2_K (2) records from per-row values: d, dmin (R, nsb)
    f16 (dmin read for Q2_K), sc (R, nsub, 2) u8 the scale bytes of each block's halves
    (Q3_K's int8 sc - 32, Q2_K's sc | m << 4), vals (R, nsub, 32) the 3- or 2-bit q."""
    R, nsb = d.shape
    size, per_block = (Q3K_RECORD, 192) if kind == 3 else (Q2K_RECORD, 128)
    rec = np.zeros((R // RECORD_ROWS, nsb, size), np.uint8)
    low = vals & 3
    crumb = low[:, :, :8] | (low[:, :, 8:16] << 2) | (low[:, :, 16:24] << 4) | (low[:, :, 24:] << 6)
    third = (vals >> 2).reshape(R, -1, 2, 4, 4)                  # (r, u, h, g, i)
    words = sum(third[:, :, h, g, :] << (2 * g + h) for g in range(4) for h in range(2))   # (r, u, i)
    for r in range(R):
        strip, lane = divmod(r, RECORD_ROWS)
        for b in range(nsb):
            out = rec[strip, b]
            out[Q6K_D + 2 * lane:Q6K_D + 2 * lane + 2] = d[r, b:b + 1].view(np.uint8)
            if kind == 2:
                out[Q2K_DMIN + 2 * lane:Q2K_DMIN + 2 * lane + 2] = dmin[r, b:b + 1].view(np.uint8)
            for k in range(8):
                u = 8 * b + k
                for h in range(2):
                    out[(Q2K_SC if kind == 2 else Q6K_SC) + 32 * k + 16 * h + lane] = sc[r, u, h]
                o = Q6K_QS + per_block * k + 4 * lane
                for j in range(8):
                    out[o + 64 * (j // 4) + j % 4] = crumb[r, u, j]
                if kind == 3:
                    out[o + 128:o + 132] = words[r, u]
    return rec.reshape(-1)


def gemm_low_case(kind, isa, R, tokens, case):
    """q6_gemm's acc for a random tile of R rows of Q3_K (kind 3) or Q2_K (2) records, 2
    super-blocks, and `tokens` rows t0.. of x, and its float64 twin: per super-block d
    sum_u dx_u S_u, S_u = sum over block u's halves of scale * sum((q - off) x8) (Q3_K:
    the int8 scale, off 4; Q2_K: the scale byte's low nibble, off 0), Q2_K less dmin sum
    over its halves of m xsum16 (the byte's high nibble; xsum16 = dx xs16); and the sum
    of the magnitudes of the terms the kernel may form in f32 (gemm6_case's, Q3_K's
    offset 4 as Q6_K's 32). case "exact":
    d, dmin and the x scales 1 or 2 and |x8| <= 15, so every f32 step is exact; "max",
    "zero": every q the largest or 0 against x8 = +-127 and the extreme scales, the
    largest sums (AVX2's int16 pair sums); "random"."""
    nsub, t0 = 16, tokens
    T = 2 * tokens
    rng = np.random.default_rng(100 * kind + 10 * isa + R + tokens)
    top = 7 if kind == 3 else 3
    vals = rng.integers(0, top + 1, (R, nsub, 32))
    sc = (rng.integers(-32, 32, (R, nsub, 2)).astype(np.int8).view(np.uint8) if kind == 3
          else rng.integers(0, 256, (R, nsub, 2)).astype(np.uint8))
    x8 = rng.integers(-127, 128, (T, 32 * nsub), dtype=np.int8)
    d = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    dmin = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    xd = rng.random((T, nsub)).astype(np.float32)
    if case == "exact":                        # every sum an integer below 2^24
        x8 = rng.integers(-15, 16, x8.shape, dtype=np.int8)
        d, dmin = ((2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16) for _ in range(2))
        xd = (2.0 ** rng.integers(0, 2, xd.shape)).astype(np.float32)
    elif case in ("max", "zero"):
        vals[:] = top if case == "max" else 0
        ends = rng.random(sc.shape) < 0.5
        sc = (np.where(ends, -32, 31).astype(np.int8).view(np.uint8) if kind == 3
              else np.where(ends, 0xFF, 0x0F).astype(np.uint8))
        x8 = np.where(rng.random(x8.shape) < 0.5, -127, 127).astype(np.int8)
        d[:] = 1
        dmin[:] = 1
        xd[:] = 1
    xs16 = x8.reshape(T, 2 * nsub, 16).astype(np.int32).sum(axis=2)
    xsum16 = (np.repeat(xd, 2, axis=1) * xs16).astype(np.float32)
    acc = np.full(tokens * R, 7, np.float32)
    _gemm_low(low_records(kind, d, dmin, sc, vals), x8.reshape(-1), xd.reshape(-1), xs16.reshape(-1),
              xsum16.reshape(-1), acc, nsub, t0, tokens, kind, isa)
    if kind == 3:
        scale, m, off = sc.view(np.int8).astype(np.int64), np.zeros(sc.shape, np.int64), 4
    else:
        scale, m, off = (sc & 15).astype(np.int64), (sc >> 4).astype(np.int64), 0
    want, mag = np.zeros((tokens, R)), np.zeros((tokens, R))
    for k in range(tokens):
        tok = t0 + k
        xh = x8[tok].reshape(nsub, 2, 16).astype(np.int64)
        S = (scale * np.einsum("ruhe,uhe->ruh", vals.reshape(R, nsub, 2, 16) - off, xh)).sum(axis=2)
        parts = np.abs(scale * np.einsum("ruhe,uhe->ruh", vals.reshape(R, nsub, 2, 16), xh) * xd[tok].reshape(nsub, 1))
        parts = parts * np.abs(d.astype(np.float64)).repeat(8, axis=1)[:, :, None]
        parts += np.abs((off * scale * d.astype(np.float64).repeat(8, axis=1)[:, :, None]
                         + m * dmin.astype(np.float64).repeat(8, axis=1)[:, :, None]) * xsum16[tok].reshape(nsub, 2))
        mag[k] = parts.sum(axis=(1, 2))
        blocks = (xd[tok].astype(np.float64) * S).reshape(R, nsub // 8, 8).sum(axis=2)
        mins = (m * xsum16[tok].reshape(nsub, 2).astype(np.float64)).sum(axis=2).reshape(R, nsub // 8, 8).sum(axis=2)
        want[k] = (d.astype(np.float64) * blocks - dmin.astype(np.float64) * mins).sum(axis=1)
    return acc.reshape(tokens, R), want, mag


@pytest.mark.parametrize("kind", [6, 3, 2])
@pytest.mark.parametrize("isa", list(RUNS))
@pytest.mark.parametrize("R", [16, 32, 256])
@pytest.mark.parametrize("tokens", [1, TOKENS])
@pytest.mark.parametrize("case", ["exact", "max", "zero", "random"])
def test_q6_gemm_matches_twin(kind, isa, R, tokens, case):
    if not RUNS[isa]:
        pytest.skip("Numba's target (this CPU, or NUMBA_CPU_*) lacks the instructions")
    got, want, mag = gemm6_case(isa, R, tokens, case) if kind == 6 else gemm_low_case(kind, isa, R, tokens, case)
    if case == "exact":
        np.testing.assert_array_equal(got, want)
    elif case == "random":
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    else:   # sums past 2^24 round in f32, and where the offsets come off in f32 (AVX2) the
        # terms they cancel (a few of their ulps: mag); an int16 or int32 overflow would be
        # off by 2^15+, far more
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=2.0 ** -22 * mag.max())
        assert 2.0 ** -22 * mag.max() < 2 ** 12


# --- q4k_gemm: Q4_K and Q5_K records (per 16 rows and super-block: d, dmin, sc, m, nibble
# quads; Q5_K then its fifth bits) ----------------------------------------------------------

@njit
def _gemm4k(q, x8, xd, xsum, acc, nsub, t0, tokens, bits, isa):
    q4k_gemm(q, Q8X(x8, xd, None, xsum), acc, tile(nsub, K_GROUP, t0, literally(tokens), literally(bits)),
             literally(isa))


def k_records(d, dmin, sc, m, vals, bits):
    """A tile of Q4_K (bits 4) or Q5_K (bits 5) records from per-row values: d, dmin
    (R, nsb) f16; sc, m (R, nsub) u8; vals (R, nsub, 32) the levels of each sub-block."""
    R, nsb = d.shape
    size = Q4K_RECORD if bits == 4 else Q5K_RECORD
    rec = np.zeros((R // RECORD_ROWS, nsb, size), np.uint8)
    nib = (vals[:, :, :16] & 15) | ((vals[:, :, 16:] & 15) << 4)                 # (R, nsub, 16)
    for r in range(R):
        s, lane = divmod(r, RECORD_ROWS)
        for b in range(nsb):
            out = rec[s, b]
            out[Q4K_D + 2 * lane:Q4K_D + 2 * lane + 2] = d[r, b:b + 1].view(np.uint8)
            out[Q4K_DMIN + 2 * lane:Q4K_DMIN + 2 * lane + 2] = dmin[r, b:b + 1].view(np.uint8)
            for k in range(8):
                u = 8 * b + k
                out[Q4K_SC + 16 * k + lane] = sc[r, u]
                out[Q4K_M + 16 * k + lane] = m[r, u]
                for j in range(16):
                    out[Q4K_QS + 256 * k + 64 * (j // 4) + 4 * lane + j % 4] = nib[r, u, j]
                if bits == 5:       # bit 2g + h of byte i: the fifth bit of element 16h + 4g + i
                    for e in range(32):
                        h, g, i = e // 16, e % 16 // 4, e % 4
                        out[Q5K_QH + 64 * k + 4 * lane + i] |= (vals[r, u, e] >> 4) << (2 * g + h)
    return rec.reshape(-1)


def gemm4k_case(isa, R, tokens, bits, case):
    """q4k_gemm's acc for a random tile of R rows, 2 super-blocks, and `tokens` rows t0.. of
    x, and its float64 twin: per super-block d sum_u sc_u dx_u S_u - dmin sum_u m_u xsum_u,
    S_u the sum of the sub-block's levels times x8. case "exact": d, dmin and the x
    scales 1 or 2, |x8| <= 7, integer xsum, so every f32 step is exact; "bounds": every
    level at its maximum (15 or 31: AVX2's int16 pair sums at their largest), sc = m = 63,
    x8 = +-127; "random"."""
    nsub, t0 = 16, tokens                           # the second group of rows of x
    T = 2 * tokens
    rng = np.random.default_rng(10 * isa + R + tokens + bits)
    vals = rng.integers(0, 1 << bits, (R, nsub, 32))
    sc, m = rng.integers(0, 64, (2, R, nsub), dtype=np.uint8)
    x8 = rng.integers(-127, 128, (T, 32 * nsub), dtype=np.int8)
    d = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    dmin = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    xd = rng.random((T, nsub)).astype(np.float32)
    xsum = rng.standard_normal((T, nsub)).astype(np.float32)
    if case == "exact":                            # every sum an integer below 2^24
        x8 = rng.integers(-7, 8, x8.shape, dtype=np.int8)
        d = (2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16)
        dmin = (2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16)
        xd = (2.0 ** rng.integers(0, 2, xd.shape)).astype(np.float32)
        xsum = rng.integers(-50, 51, xsum.shape).astype(np.float32)
    elif case == "bounds":
        vals[:] = (1 << bits) - 1
        sc[:] = m[:] = 63
        x8 = np.where(rng.random(x8.shape) < 0.5, -127, 127).astype(np.int8)
    acc = np.full(tokens * R, 7, np.float32)
    _gemm4k(k_records(d, dmin, sc, m, vals, bits), x8.reshape(-1), xd.reshape(-1),
            xsum.reshape(-1), acc, nsub, t0, tokens, bits, isa)
    want = np.zeros((tokens, R))
    for k in range(tokens):
        tok = t0 + k
        S = np.einsum("rue,ue->ru", vals, x8[tok].reshape(nsub, 32).astype(np.int64))
        a1 = (sc * xd[tok] * S).reshape(R, nsub // 8, 8).sum(axis=2)
        a2 = (m * xsum[tok].astype(np.float64)).reshape(R, nsub // 8, 8).sum(axis=2)
        want[k] = (d.astype(np.float64) * a1 - dmin.astype(np.float64) * a2).sum(axis=1)
    return acc.reshape(tokens, R), want


# generic bits 4: the nibble dot that bits 5 takes too, before its fifth bits
@pytest.mark.parametrize("bits,isa", isa_cases({"4": 4, "5": 5}, {5}))
@pytest.mark.parametrize("R", [16, 32, 256])
@pytest.mark.parametrize("tokens", [1, TOKENS])
@pytest.mark.parametrize("case", ["exact", "bounds", "random"])
def test_q4k_gemm_matches_twin(isa, R, tokens, bits, case):
    if not RUNS[isa]:
        pytest.skip("Numba's target (this CPU, or NUMBA_CPU_*) lacks the instructions")
    got, want = gemm4k_case(isa, R, tokens, bits, case)
    if case == "exact":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


# --- values tiles: a tile's K-quant values rebuilt once and stored (write 1), then loaded
# by q4k_gemm and q6_gemm: the same integers, so the same bits as rebuilding them ---------

@njit
def _gemm_k4_values(q, x8, xd, xsum, acc, acc2, nsub, t0, tokens, bits, isa, values):
    # acc: the product storing the values; acc2: the same product loading them
    shape = tile(nsub, K_GROUP, t0, literally(tokens), literally(bits))
    q4k_gemm(q, Q8X(x8, xd, None, xsum), acc, shape, literally(isa), values, 1)
    q4k_gemm(q, Q8X(x8, xd, None, xsum), acc2, shape, literally(isa), values)


@njit
def _gemm_k16_values(q, x8, xd, xs16, xsum16, acc, acc2, nsub, t0, tokens, kind, isa, values):
    shape = tile(nsub, K_GROUP, t0, literally(tokens), literally(kind))
    q6_gemm(q, Q8X(x8, xd, xs16, xsum16), acc, shape, literally(isa), values, 1)
    q6_gemm(q, Q8X(x8, xd, xs16, xsum16), acc2, shape, literally(isa), values)


def values_model(kind, vals):
    """A values tile's bytes, in NumPy, of a tile whose rows have the levels vals (R, nsub,
    32) (before any offset): per strip and block, 8 vectors of 16 rows x 4 bytes, vector
    f = 2 g + h of Q4_K and Q5_K (h 0: elements 4g..4g+3, 1: 16 + 4g..) and f of the
    others (f < 4: elements 4f.., else 16 + 4 (f - 4)..), each row's 4 bytes in turn."""
    R, nsub, _ = vals.shape
    out = np.zeros((R // RECORD_ROWS, nsub, 8, RECORD_ROWS, 4), np.uint8)
    for f in range(8):
        g, h = (f // 2, f % 2) if kind in (4, 5) else (f % 4, f // 4)
        first = 16 * h + 4 * g
        out[:, :, f] = vals[:, :, first:first + 4].reshape(R // RECORD_ROWS, RECORD_ROWS, nsub, 4).transpose(0, 2, 1, 3)
    return out.reshape(-1)


@pytest.mark.parametrize("kind", [5, 6, 3])
@pytest.mark.parametrize("isa", [pytest.param(i, id=str(i)) for i in RUNS])
@pytest.mark.parametrize("R", [16, 64])
def test_values_tiles_give_the_same_bits(kind, isa, R):
    """Per kind of K_VALUES and instruction set: q4k_gemm or q6_gemm storing the values
    (write 1) writes the documented layout (values_model), and storing or loading them
    returns exactly what it returns rebuilding them, on random records and x at the
    formats' extremes."""
    if not RUNS[isa]:
        pytest.skip("Numba's target (this CPU, or NUMBA_CPU_*) lacks the instructions")
    assert kind in K_VALUES
    nsub, tokens = 16, TOKENS
    T = 2 * tokens
    rng = np.random.default_rng(1000 * kind + 10 * isa + R)
    top = {5: 31, 6: 63, 3: 7}[kind]
    vals = rng.integers(0, top + 1, (R, nsub, 32))
    vals[:, 0] = top                                       # a block at each extreme
    vals[:, 1] = 0
    x8 = rng.integers(-127, 128, (T, 32 * nsub), dtype=np.int8)
    x8[:, :32] = 127
    xd = rng.random((T, nsub)).astype(np.float32)
    d, dmin = (rng.standard_normal((R, nsub // 8)).astype(np.float16) for _ in range(2))
    if kind == 5:
        sc, m = rng.integers(0, 64, (2, R, nsub), dtype=np.uint8)
        q = k_records(d, dmin, sc, m, vals, 5)
        xsum = rng.standard_normal((T, nsub)).astype(np.float32)
        args = (q, x8.reshape(-1), xd.reshape(-1), xsum.reshape(-1))
    else:
        xs16 = x8.reshape(T, 2 * nsub, 16).astype(np.int32).sum(axis=2)
        xsum16 = (np.repeat(xd, 2, axis=1) * xs16).astype(np.float32)
        if kind == 6:
            q = q6_records(d, rng.integers(-128, 128, (R, nsub, 2)).astype(np.int8), vals)
        else:
            q = low_records(3, d, dmin, rng.integers(-32, 32, (R, nsub, 2)).astype(np.int8).view(np.uint8), vals)
        args = (q, x8.reshape(-1), xd.reshape(-1), xs16.reshape(-1), xsum16.reshape(-1))
    rebuilt, stored, loaded = (np.full(tokens * R, 7, np.float32) for _ in range(3))
    values = np.full(R * nsub * 32 + 64, 0xEE, np.uint8)      # past the tile: untouched
    if kind == 5:
        _gemm4k(*args, rebuilt, nsub, tokens, tokens, 5, isa)
        _gemm_k4_values(*args, stored, loaded, nsub, tokens, tokens, 5, isa, values)
    else:
        (_gemm6(*args, rebuilt, nsub, tokens, tokens, isa) if kind == 6 else
         _gemm_low(*args, rebuilt, nsub, tokens, tokens, kind, isa))
        _gemm_k16_values(*args, stored, loaded, nsub, tokens, tokens, kind, isa, values)
    assert (values[R * nsub * 32:] == 0xEE).all()
    np.testing.assert_array_equal(values[:R * nsub * 32], values_model(kind, vals))
    assert R * nsub * 32 == R // RECORD_ROWS * nsub * VALUES_BLOCK
    np.testing.assert_array_equal(stored, rebuilt)
    np.testing.assert_array_equal(loaded, rebuilt)
    assert np.isfinite(rebuilt).all() and (rebuilt != 7).all()


# --- iq4xs_gemm: IQ4_XS records (per 16 rows and super-block: d, int8 scales, nibble quads)

@njit
def _gemm_xs(q, x8, xd, xs8, acc, nsub, t0, tokens, isa):
    iq4xs_gemm(q, Q8X(x8, xd, xs8, None), acc, tile(nsub, K_GROUP, t0, literally(tokens), KIND_IQ4_XS),
               literally(isa))


def xs_records(d, sc, nib):
    """A tile of IQ4_XS records from per-row values: d (R, nsb) f16; sc (R, nsub) int8
    (ls - 32); nib (R, nsub, 32) each sub-block's table indices."""
    R, nsb = d.shape
    rec = np.zeros((R // RECORD_ROWS, nsb, IQ4XS_RECORD), np.uint8)
    packed = (nib[:, :, :16] | (nib[:, :, 16:] << 4)).astype(np.uint8)          # (R, nsub, 16)
    for r in range(R):
        s, lane = divmod(r, RECORD_ROWS)
        for b in range(nsb):
            out = rec[s, b]
            out[IQ4XS_D + 2 * lane:IQ4XS_D + 2 * lane + 2] = d[r, b:b + 1].view(np.uint8)
            for k in range(8):
                u = 8 * b + k
                out[IQ4XS_SC + 16 * k + lane] = sc[r, u:u + 1].view(np.uint8)[0]
                for j in range(16):
                    out[IQ4XS_QS + 256 * k + 64 * (j // 4) + 4 * lane + j % 4] = packed[r, u, j]
    return rec.reshape(-1)


def gemm_xs_case(isa, R, tokens, case):
    """iq4xs_gemm's acc for a random tile of R rows, 2 super-blocks, and `tokens` rows t0..
    of x, and its float64 twin: per super-block d sum_u sc_u dx_u S_u, S_u the sum of
    IQ4_VALUES[nibble] times x8. case "exact": d and the x scales 1 or 2, |x8| <= 7, so
    every f32 step is exact; "bounds": nibbles 0 or 15 (-127, 113; biased 1, 241), sc
    -32 or 31, x8 = +-127; "random"."""
    nsub, t0 = 16, tokens                           # the second group of rows of x
    T = 2 * tokens
    rng = np.random.default_rng(10 * isa + R + tokens + 7)
    nib = rng.integers(0, 16, (R, nsub, 32))
    sc = rng.integers(-32, 32, (R, nsub)).astype(np.int8)
    x8 = rng.integers(-127, 128, (T, 32 * nsub), dtype=np.int8)
    d = rng.standard_normal((R, nsub // 8)).astype(np.float16)
    xd = rng.random((T, nsub)).astype(np.float32)
    if case == "exact":                            # every sum an integer below 2^24
        x8 = rng.integers(-7, 8, x8.shape, dtype=np.int8)
        d = (2.0 ** rng.integers(0, 2, d.shape)).astype(np.float16)
        xd = (2.0 ** rng.integers(0, 2, xd.shape)).astype(np.float32)
    elif case == "bounds":
        nib = rng.choice(np.array([0, 15]), nib.shape)
        sc = rng.choice(np.array([-32, 31], np.int8), sc.shape)
        x8 = np.where(rng.random(x8.shape) < 0.5, -127, 127).astype(np.int8)
    xs8 = x8.reshape(T, nsub, 32).astype(np.int32).sum(axis=2)
    acc = np.full(tokens * R, 7, np.float32)
    _gemm_xs(xs_records(d, sc, nib), x8.reshape(-1), xd.reshape(-1), xs8.reshape(-1), acc, nsub, t0,
             tokens, isa)
    vals = np.array(IQ4_VALUES, np.int64)[nib]
    want = np.zeros((tokens, R))
    for k in range(tokens):
        tok = t0 + k
        S = np.einsum("rue,ue->ru", vals, x8[tok].reshape(nsub, 32).astype(np.int64))
        a1 = (sc * xd[tok].astype(np.float64) * S).reshape(R, nsub // 8, 8).sum(axis=2)
        want[k] = (d.astype(np.float64) * a1).sum(axis=1)
    return acc.reshape(tokens, R), want


@pytest.mark.parametrize("isa", [pytest.param(i, id=str(i)) for i in RUNS])
@pytest.mark.parametrize("R", [16, 32, 256])
@pytest.mark.parametrize("tokens", [1, TOKENS])
@pytest.mark.parametrize("case", ["exact", "bounds", "random"])
def test_iq4xs_gemm_matches_twin(isa, R, tokens, case):
    if not RUNS[isa]:
        pytest.skip("Numba's target (this CPU, or NUMBA_CPU_*) lacks the instructions")
    got, want = gemm_xs_case(isa, R, tokens, case)
    if case == "exact":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
