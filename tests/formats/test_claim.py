"""Work claimed from a shared counter (kernels/claim.py): each item exactly once, early
threads taking more, and the decode and prefill kernels' results independent of who took
what."""

import numba
import numpy as np
from numba import njit, prange

from edgellama.kernels.claim import take


@njit
def _take_n(counter, n):
    out = np.empty(n, np.int64)
    for i in range(n):
        out[i] = take(counter)
    return out


@njit
def _spin(seconds_in_cycles):
    s = 0.0
    for i in range(seconds_in_cycles):
        s += np.sqrt(float(i))
    return s


@njit(parallel=True)
def _claim_items(counter, n, done, by, late, sink):
    # items 0..n claimed as the decode kernels claim tiles; thread 0 starts `late` spins
    # after the others (a worker still waking, as the claims are meant for); sink keeps
    # the spins' sums, so no spin is optimised away
    counter[0] = 0
    for _ in prange(n):
        me = numba.get_thread_id()
        if me == 0 and late > 0 and by[n] == 0:
            by[n] = 1
            sink[me] += _spin(late)
        while True:
            i = take(counter)
            if i >= n:
                break
            done[i] += 1
            by[i] = me
            sink[me] += _spin(2000)


def test_take_hands_out_consecutive_items():
    counter = np.zeros(1, np.int64)
    assert _take_n(counter, 5).tolist() == [0, 1, 2, 3, 4]
    assert counter[0] == 5


def test_every_item_is_claimed_once_and_a_late_thread_takes_fewer():
    n = 400
    threads = numba.config.NUMBA_NUM_THREADS
    counter = np.zeros(1, np.int64)
    done, by = np.zeros(n, np.int64), np.zeros(n + 1, np.int64)
    _claim_items(counter, n, done, by, 0, np.zeros(threads))
    assert done.tolist() == [1] * n                      # every item, once
    assert counter[0] >= n
    # thread 0 starting late: a static split would give it its 1/threads of the items
    # whatever its start; claiming leaves it what the others had not taken by then. On a
    # machine busy with other processes a worker may not have run at all by the time
    # thread 0 starts: it then starts later (10x the spins, up to about a second).
    was = numba.get_num_threads()      # an automatic ThreadPolicy before may have lowered it
    numba.set_num_threads(threads)
    try:
        for late in (3_000_000, 30_000_000, 300_000_000):
            done, by = np.zeros(n, np.int64), np.zeros(n + 1, np.int64)
            _claim_items(counter, n, done, by, late, np.zeros(threads))
            assert done.tolist() == [1] * n
            share0 = np.mean(by[:n] == 0)
            if threads == 1 or share0 < 0.5 / threads:
                break
    finally:
        numba.set_num_threads(was)
    assert share0 == 1.0 if threads == 1 else share0 < 0.5 / threads, share0


def _by_threads(run):
    """run()'s outputs, 3 runs at 1 thread and 3 at every thread."""
    outs = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        try:
            outs += [run() for _ in range(3)]
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return outs


def test_claimed_decode_gives_the_same_bits_at_every_thread_count():
    # the record formats' decode kernels claim their tiles: which thread takes a tile
    # changes nothing in it
    from gguf import GGMLQuantizationType as G
    from edgellama import formats
    from edgellama.formats import linear
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1000, 512)).astype(np.float32)
    x = rng.standard_normal(512).astype(np.float32)
    for name in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
        lin = linear(int(getattr(G, name)), [(formats.quantize(w, name), w.shape)])

        def run():
            out = np.empty(1000, np.float32)
            lin.matvec(x, out)
            return out
        outs = _by_threads(run)
        for out in outs[1:]:
            assert np.array_equal(out.view(np.int32), outs[0].view(np.int32)), name


def test_claimed_prefill_gives_the_same_bits_at_every_thread_count():
    # the record formats' prefill products claim their tiles too, values tiles and all
    # (a thread's values tile is its own, whichever tiles it takes); out starts as NaN,
    # so a tile nobody took would show
    from gguf import GGMLQuantizationType as G
    from edgellama import formats
    from edgellama.formats import linear
    from edgellama.formats.records import VALUES_MIN_ROWS
    from edgellama.kernels import amx
    from edgellama.scratch import Scratch
    rng = np.random.default_rng(4)
    w = rng.standard_normal((1000, 512)).astype(np.float32)
    was = amx.enabled()
    amx.use(False)                         # the VNNI / AVX2 products (AMX's has its tests)
    try:
        for T in (VALUES_MIN_ROWS + 7, 3):
            x = rng.standard_normal((T, 512)).astype(np.float32)
            for name in ("Q4_0", "Q8_0", "IQ4_XS", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
                lin = linear(int(getattr(G, name)), [(formats.quantize(w, name), w.shape)])

                def run():
                    out = np.full((T, 1000), np.nan, np.float32)
                    lin.matmul(x, out, Scratch())
                    return out
                outs = _by_threads(run)
                assert np.isfinite(outs[0]).all(), name
                for out in outs[1:]:
                    assert np.array_equal(out.view(np.int32), outs[0].view(np.int32)), (name, T)
    finally:
        amx.use(was)
