"""Numba's threading layer: the runtime that starts and joins the workers of every parallel
kernel, chosen before the first one runs, and how its idle workers wait.

A decoded token opens about a hundred parallel regions (one per matrix product, one per
layer's attention), tens of microseconds of work apart, so what a region costs to start
and join matters on many cores: least under OpenMP, more under TBB, most under Numba's
own `workqueue` (bench/bench_decode_split.py measures each). The layer is picked in that
order, not left to Numba's default (TBB first where it is installed).
OpenMP's workers go to sleep in the gaps between regions unless told to spin: they spin
here for a bounded while (WAIT below), then sleep, so an idle chat costs no CPU.
"""
from __future__ import annotations

import os

PREFERENCE = ("omp", "tbb", "workqueue")
# GNU OpenMP: spin (busy-wait) between regions, for GOMP_SPINCOUNT polls at most (a few
# milliseconds), before sleeping; read by libgomp once, as it loads
WAIT = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}

INSTALL_HINT = ("install an OpenMP runtime (Debian/Ubuntu: apt install libgomp1; Fedora: "
                "dnf install libgomp; macOS: brew install libomp) or TBB (pip install tbb)")


def configure() -> None:
    """Prefer PREFERENCE's order (unless NUMBA_THREADING_LAYER says otherwise) and start
    the layer with WAIT's settings (where the environment does not set them). The
    settings are put back after, so child processes see the user's environment."""
    import numba
    from numba.np.ufunc import parallel
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        numba.config.THREADING_LAYER_PRIORITY = list(PREFERENCE)
    saved = {k: os.environ.get(k) for k in WAIT}
    os.environ.update({k: v for k, v in WAIT.items() if saved[k] is None})
    try:
        parallel._launch_threads()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def name() -> str:
    """The threading layer in use: omp, tbb or workqueue."""
    import numba
    from numba.np.ufunc import parallel
    parallel._launch_threads()          # a no-op once started
    return numba.threading_layer()


def note() -> str | None:
    """One line for the user when the slow layer is all there is; None otherwise."""
    if name() != "workqueue":
        return None
    return (f"parallel kernels run on Numba's workqueue threading layer, under half as fast "
            f"on many cores as OpenMP's: {INSTALL_HINT}")
