"""Parallel work items whose body is compiled once: a thin parallel loop calls a serial
kernel through its machine-code address.

Numba compiles a parallel loop's body into the loop's own code and optimizes that code
again at each level it is linked into: attention, a parallel loop around a large body,
compiled in 13-14 s where the same body alone takes 5 ("work items by address",
bench/results/design_measurements.json). Here the body is a kernel of its own (cached
as any other), and the loop calls it by address, a run-time value, so the loop's code
neither holds nor re-optimizes it and is cached too:

    @njit def item(i, n, a, b): ...                       # one work item, serial
    @njit(parallel=True) def loop(table, a, b):
        fptr = item_address(table, (0, 0), (a, b))     # 0: not yet in the table
        if fptr == 0: return 1
        for i in prange(n): call_item(fptr, (i, n), (a, b))
        return 0
    ITEMS = Items(__name__, "item")
    def run(a, b):                                      # what callers call
        ITEMS.run(loop, (0, 0), (a, b))

The table holds, per set of argument types, the item kernel's address compiled for
exactly those types beside a 64-bit hash of their names; item_address finds the slot of
the types the loop was compiled for (the hash a constant of its code) and gives 0 where
the table holds no address for them: short of two type lists with one 64-bit hash, a
call never gets another types' address.
Then Items.run adds the item kernel for those types (compiled or loaded once a process)
and runs the loop again. A call costs a table read, not a Python look-up of its
arguments' types.
"""
from __future__ import annotations

import hashlib
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic

from .jit import njit

SLOTS = 64         # sets of argument types a table holds (a model calls a kernel with 1-3);
                   # a power of two


def _signature(head: tuple, args: tuple) -> tuple:
    """The item kernel's argument types: head's integers as int64, then args'."""
    return (types.int64,) * len(head) + tuple(args)


def _hash(sig: tuple) -> int:
    """A 64-bit hash of the types' names (stable across processes: the loop's cached code
    holds it), as a signed int64 that is never 0."""
    h = int.from_bytes(hashlib.blake2b(repr([str(t) for t in sig]).encode(), digest_size=8).digest(),
                       "little", signed=True)
    return h or 1


@intrinsic
def _item_hash(typingctx, head, args):
    # _hash of the item kernel's argument types for head and args: a constant of the code
    if not (isinstance(head, types.BaseTuple) and isinstance(args, types.BaseTuple)):
        return None
    h = _hash(_signature(head.types, args.types))

    def codegen(context, builder, sig, llargs):
        return ir.Constant(ir.IntType(64), h)
    return types.int64(head, args), codegen


@njit(cache=True, inline="always")
def item_address(table, head, args):
    """The address in `table` ((2, SLOTS) int64: hashes, addresses) of the item kernel
    compiled for head's integers (as int64) and args' types, or 0 where the table does
    not hold it. Slots are probed from the hash on, as Items.add fills them."""
    h = _item_hash(head, args)
    for k in range(SLOTS):
        j = (h + k) & (SLOTS - 1)
        if table[0, j] == h:
            return table[1, j]
        if table[0, j] == 0:
            return 0
    return 0


@intrinsic
def call_item(typingctx, fptr, head, args):
    """Call the kernel at address fptr (from item_address for the same head and args)
    with head's integers as int64, then args' values, by Numba's calling convention."""
    if not (isinstance(fptr, types.Integer) and isinstance(head, types.BaseTuple)
            and all(isinstance(t, types.Integer) for t in head.types)
            and isinstance(args, types.BaseTuple)):
        return None
    argtys = list(_signature(head.types, args.types))

    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(types.void, argtys)
        callee = builder.inttoptr(llargs[0], fnty.as_pointer())
        values = [context.cast(builder, builder.extract_value(llargs[1], i), t, types.int64)
                  for i, t in enumerate(head.types)]
        values += [builder.extract_value(llargs[2], i) for i in range(len(args.types))]
        context.call_conv.call_function(builder, callee, types.void, argtys, values)
        return context.get_dummy_value()
    return types.void(fptr, head, args), codegen


class Items:
    """The table of one item kernel (`name` of `module`, looked up at each add, so that
    warm-up's stand-ins take its place) by argument types: `table` for the loop kernel,
    add() to compile and enter a set of types."""

    def __init__(self, module: str, name: str):
        self.module, self.name = sys.modules[module], name
        self.table = np.zeros((2, SLOTS), np.int64)     # hashes, addresses

    def kernel(self):
        return getattr(self.module, self.name)

    def run(self, loop, head: tuple[int, ...], args: tuple) -> None:
        """loop(table, *args): a loop kernel that returns 0 having run its items, or
        nonzero, running none, where item_address found no address for its types; then
        the item kernel is added for them and the loop runs again."""
        if loop(self.table, *args) == 0:
            return
        self.add(head, args)
        if isinstance(self.kernel(), Dispatcher) and loop(self.table, *args) != 0:
            raise RuntimeError(f"{self.name}: no address for its argument types after adding them")

    def add(self, head: tuple[int, ...], args: tuple) -> None:
        """Compile (or load from the cache) the item kernel for head's integers and args'
        types and put its address in the table. A recorder standing in for the kernel
        (warm-up's dry run) notes the call instead."""
        body = self.kernel()
        if not isinstance(body, Dispatcher):
            body(*(int(h) for h in head), *args)
            return
        sig = _signature(head, tuple(numba.typeof(a) for a in args))
        body.compile(sig)
        cres = body.overloads[sig]
        h = _hash(sig)
        for k in range(SLOTS):
            j = (h + k) & (SLOTS - 1)
            if self.table[0, j] in (0, h):
                self.table[1, j] = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
                self.table[0, j] = h
                return
        raise RuntimeError(f"{self.name}: more than {SLOTS} sets of argument types")
