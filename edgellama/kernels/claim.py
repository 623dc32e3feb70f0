"""Work items claimed one at a time from a shared counter, instead of split in advance.

A parallel region whose items are split equally among its threads ends when the last
thread is done; a thread that starts late (a worker still waking, its virtual CPU not
yet scheduled by the host) or runs slower holds up all the others at the join. Here each
thread takes the next item as it gets free, with one atomic add, so early threads take
more and late ones less (llama.cpp's threadpool hands out its matrix chunks the same
way). The items and their sums are the same whichever thread takes them: results do
not change, only who computes them.

    counter[0] = 0                   # before the region (a kernel's serial prologue)
    for _ in prange(n_items):        # starts every thread on a run of these
        while True:                  # the first of a thread's runs claims until none are left;
            i = take(counter)        # the rest find none
            if i >= n_items:
                break
            ...item i...

(A loop over the thread count would read numba.get_num_threads() in the kernel, which
Numba cannot cache.)
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def take(typingctx, counter):
    """counter[0] += 1, atomically; returns the value before (the item to do)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.gep_inbounds(builder, arr.data, 0)
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter), codegen
