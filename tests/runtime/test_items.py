"""Work items called by address (kernels/items.py): a parallel loop calling a serial
kernel through its Items table gives what calling it directly gives, each set of argument
types with its own compile and slot; warm-up's dry run records the item kernel's call."""
import sys

import numba
import numpy as np
from numba import prange

from edgellama.kernels import items as I
from edgellama.kernels import jit
from edgellama.kernels.items import Items, call_item, item_address
from edgellama.kernels.jit import njit


@njit
def _item(i, n, x, scale, out):
    # item i of n: out[i] = scale * sum of x's i-th of n slices
    m = x.size // n
    s = x.dtype.type(0)
    for j in range(i * m, (i + 1) * m):
        s += x[j]
    out[i] = s * scale


@njit(parallel=True)
def _loop(table, n, x, scale, out):
    fptr = item_address(table, (0, 0), (x, scale, out))
    if fptr == 0:
        return 1
    for i in prange(n):
        call_item(fptr, (i, n), (x, scale, out))
    return 0


ITEMS = Items(__name__, "_item")


def _run(n, x, scale, out):
    ITEMS.run(lambda table, *args: _loop(table, n, *args), (0, 0), (x, scale, out))


def test_items_by_address_give_the_direct_results_for_each_type():
    rng = np.random.default_rng(0)
    for dtype, scale in ((np.float32, np.float32(0.5)), (np.float64, 0.25), (np.int64, 3)):
        x = (rng.standard_normal(64 * 37) * 100).astype(dtype)
        out, ref = np.zeros(64, dtype), np.zeros(64, dtype)
        _run(64, x, scale, out)
        for i in range(64):
            _item(i, 64, x, scale, ref)
        np.testing.assert_array_equal(out, ref)
    # one compile of the item kernel a set of types, each in a slot of its own
    assert len(_item.overloads) == 3 and (ITEMS.table[0] != 0).sum() == 3
    assert len(set(ITEMS.table[1][ITEMS.table[0] != 0])) == 3


def test_a_non_contiguous_array_gets_its_own_compile():
    # same dtype, another layout: another type, so another slot (never the C one's)
    x = np.arange(256, dtype=np.float64)
    out = np.zeros(8)
    _run(8, x, 1.0, out)
    used = (ITEMS.table[0] != 0).sum()
    strided = np.arange(512, dtype=np.float64)[::2]
    out2 = np.zeros(8)
    _run(8, strided, 1.0, out2)
    assert (ITEMS.table[0] != 0).sum() == used + 1
    np.testing.assert_array_equal(out, [sum(x[32 * i:32 * (i + 1)]) for i in range(8)])
    np.testing.assert_array_equal(out2, [sum(strided[32 * i:32 * (i + 1)]) for i in range(8)])


def test_a_table_without_the_types_runs_nothing():
    # an empty table (another process's loop code loaded from the cache, before its
    # first add): the loop returns 1 and leaves out alone
    x, out = np.ones(64), np.full(8, -1.0)
    assert _loop(np.zeros((2, I.SLOTS), np.int64), 8, x, 1.0, out) == 1
    assert (out == -1).all()


def test_colliding_slots_probe_on(monkeypatch):
    # every hash in one slot: the second set of types takes the next slot, and each loop
    # still finds its own address
    x32, x64 = np.ones(64, np.float32), np.ones(64)
    sigs = [I._signature((0, 0), tuple(numba.typeof(a) for a in args))
            for args in ((x32, np.float32(1), np.zeros(8, np.float32)), (x64, 1.0, np.zeros(8)))]
    h = [I._hash(s) for s in sigs]
    table = np.zeros((2, I.SLOTS), np.int64)
    j = h[0] & (I.SLOTS - 1)
    table[:, j] = (h[1], 12345)          # another types' entry where the first one's hash lands
    out = np.zeros(8, np.float32)
    assert _loop(table, 8, x32, np.float32(1), out) == 1      # not taken for its own
    items = Items(__name__, "_item")
    items.table = table
    items.add((0, 0), (x32, np.float32(1), out))
    assert table[0, (j + 1) & (I.SLOTS - 1)] == h[0] and table[1, j] == 12345
    assert _loop(table, 8, x32, np.float32(1), out) == 0 and (out == 8).all()


def test_the_dry_run_records_the_item_kernel(monkeypatch):
    # warm-up stands a recorder in for every kernel of the package's modules (as for
    # attention's); here, for this module's: the loop's recorder returns nothing, and
    # run() has the item kernel's recorder note its types
    x, out = np.ones(32, np.float32), np.zeros(4, np.float32)
    calls, kernel = {}, _item
    monkeypatch.setattr(sys.modules[__name__], "_item", jit._Recorder(kernel, calls))
    table = ITEMS.table.copy()
    ITEMS.run(jit._Recorder(_loop, calls), (0, 0), (x, np.float32(1), out))
    assert (ITEMS.table == table).all()
    sigs = {d: s for d, s in calls}
    assert sigs[kernel] == (numba.int64, numba.int64, numba.typeof(x), numba.float32, numba.typeof(out))
    assert _loop in sigs


def test_attention_is_found_by_the_dry_run_as_its_two_kernels():
    from edgellama.kernels import attention as A
    homes = {kernel for _, _, kernel, _ in jit._kernel_homes()}
    assert {A._attention_items, A._attention_item} <= homes
