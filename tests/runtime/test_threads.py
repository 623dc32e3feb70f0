"""ThreadPolicy: a fixed count stays fixed; the automatic count follows other processes'
load, measured from /proc/stat minus our own CPU time (scripted here)."""
import numba
import pytest

from edgellama import machine
from edgellama.machine import ThreadPolicy


def test_fixed_count_is_applied_and_never_changes(monkeypatch):
    # the count last set is process-wide state; a test before this one may have changed
    # BLAS's threads behind it (threadpoolctl limits that end restore the old count)
    monkeypatch.setattr(machine, "_blas_n", None)
    p = ThreadPolicy(1)
    assert not p.auto and p.max == 1
    assert p.apply() == 1 and numba.get_num_threads() == 1
    import threadpoolctl
    blas = threadpoolctl.threadpool_info()
    assert all(lib["num_threads"] == 1 for lib in blas if lib["user_api"] == "blas")


def test_blas_keeps_one_thread_beside_numbas(monkeypatch):
    # NumPy's BLAS and Numba's OpenMP workers on the same cores spin-wait against each
    # other: BLAS runs single-threaded whatever count Numba takes
    monkeypatch.setattr(machine, "_blas_n", None)
    import threadpoolctl
    n = min(2, numba.config.NUMBA_NUM_THREADS)
    with threadpoolctl.threadpool_limits(limits=4, user_api="blas"):
        assert ThreadPolicy(n).apply() == n and numba.get_num_threads() == n
        blas = threadpoolctl.threadpool_info()
        assert all(lib["num_threads"] == 1 for lib in blas if lib["user_api"] == "blas")


class _Clock:
    """Scripted /proc/stat, our CPU time and the wall clock."""

    def __init__(self, monkeypatch, cpus):
        self.t = 100.0
        self.busy = 0.0
        self.ours = 0.0
        monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        monkeypatch.setattr(machine, "default_threads", lambda: cpus)
        self.reads = 0
        monkeypatch.setattr(machine, "_busy_seconds", self._read)
        monkeypatch.setattr(machine.time, "monotonic", lambda: self.t)
        monkeypatch.setattr(machine.os, "times", lambda: type("T", (), {"user": self.ours, "system": 0.0})())

    def _read(self, cpus):
        self.reads += 1
        return self.busy

    def run(self, seconds, ours_cores, others_cores):
        self.t += seconds
        self.ours += seconds * ours_cores
        self.busy += seconds * (ours_cores + others_cores)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_automatic_count_leaves_busy_cores_to_their_owners(monkeypatch):
    clock = _Clock(monkeypatch, cpus=2)
    p = ThreadPolicy()
    assert p.auto and p.apply() == 2                      # nothing measured yet: all cores
    clock.run(1.0, ours_cores=1.0, others_cores=1.0)      # a neighbour takes a whole core:
    assert p.apply() == 1                                 # the first measurement decides
    for _ in range(3):
        clock.run(1.0, ours_cores=1.0, others_cores=1.0)
        assert p.apply() == 1
    assert numba.get_num_threads() == 1
    reads = clock.reads
    clock.run(0.1, ours_cores=1.0, others_cores=0.0)      # too soon to measure again:
    assert p.apply() == 1 and clock.reads == reads         # /proc/stat not even read
    for _ in range(3):                                    # the neighbour is gone
        clock.run(1.0, ours_cores=1.0, others_cores=0.0)
        p.apply()
    assert p.current == 2 and numba.get_num_threads() == 2


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_small_background_load_keeps_every_core(monkeypatch):
    clock = _Clock(monkeypatch, cpus=2)
    p = ThreadPolicy()
    for _ in range(4):
        clock.run(1.0, ours_cores=2.0, others_cores=0.2)   # a terminal, a clock, a daemon
        p.apply()
    assert p.current == 2


def test_explicit_count_is_not_adapted(monkeypatch):
    clock = _Clock(monkeypatch, cpus=2)
    p = ThreadPolicy(2) if numba.config.NUMBA_NUM_THREADS >= 2 else ThreadPolicy(1)
    n = p.max
    for _ in range(3):
        clock.run(1.0, ours_cores=1.0, others_cores=1.0)
        assert p.apply() == n
