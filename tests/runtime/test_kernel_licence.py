"""Every compiled kernel states its own float licence (fastmath). Numba compiles a kernel
that leaves it unset with the licence of whichever caller compiles it first, and the kernel
cache keeps that build for later runs: the same kernel could contract or reassociate in one
run and not another, and its twin test check a build users do not run (kernels/jit.py)."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

from numba.core.dispatcher import Dispatcher

import edgellama

PACKAGE = Path(edgellama.__file__).parent
# numba's own decorators, which leave fastmath to the first caller
_NUMBA_DECORATOR = re.compile(r"\b(?:nb|numba)\.n?jit\b|\bfrom numba import [^\n]*\bn?jit\b"
                              r"|\bfrom numba\.extending import [^\n]*\boverload\b"
                              r"|\b(?:nb|numba)\.extending\.overload\(")


def test_kernels_compile_through_the_decorators_that_state_a_licence():
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if f == PACKAGE / "kernels" / "jit.py":
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if _NUMBA_DECORATOR.search(line):
                found.append(f"{f.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not found, "use kernels.jit's njit / overload:\n" + "\n".join(found)


def test_the_pattern_finds_numba_decorators():
    # the check above must see each spelling it forbids
    for line in ("@nb.njit(cache=True)", "@numba.njit", "from numba import njit, prange",
                 "from numba.extending import intrinsic, overload", "@numba.jit(nopython=True)"):
        assert _NUMBA_DECORATOR.search(line), line
    for line in ("from .jit import njit, overload", "from numba import prange, types",
                 "@njit(cache=True)", "from numba.extending import intrinsic"):
        assert not _NUMBA_DECORATOR.search(line), line


def test_every_kernel_states_fastmath():
    unset = []
    for f in sorted((PACKAGE / "kernels").glob("*.py")) + sorted((PACKAGE / "formats").glob("*.py")):
        module = importlib.import_module(f"edgellama.{f.parent.name}.{f.stem}")
        for name, obj in vars(module).items():
            if isinstance(obj, Dispatcher) and obj.py_func.__module__ == module.__name__ \
                    and "fastmath" not in obj.targetoptions:
                unset.append(f"{module.__name__}.{name}")
    assert not unset, unset
