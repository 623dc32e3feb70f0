"""What this machine offers: cores, memory, CPU name; and the engine's thread count."""
from __future__ import annotations

import os
import platform

import numba

from .errors import EdgeError


def _meminfo(key: str) -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """Bytes the kernel says a new allocation can get without swapping (Linux)."""
    return _meminfo("MemAvailable")


def total_memory() -> int | None:
    return _meminfo("MemTotal")


def resident_memory() -> int | None:
    """Bytes of this process resident in memory now (Linux; cheap enough to poll)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_memory() -> int | None:
    """The most bytes this process has had resident (VmHWM, Linux)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_resident_memory() -> None:
    """Start the peak afresh (Linux: "5" to clear_refs); a no-op elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_threads() -> int:
    """Physical cores available to us (decode is bandwidth bound: SMT siblings don't help)."""
    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:
        logical = os.cpu_count() or 1
    try:
        cores = {(phys, core) for phys, core in _core_ids()}
        return max(1, min(logical, len(cores) or logical))
    except OSError:
        return logical


def _core_ids():
    phys = None
    for line in open("/proc/cpuinfo"):
        if line.startswith("physical id"):
            phys = line.split(":")[1].strip()
        elif line.startswith("core id"):
            yield phys, line.split(":")[1].strip()


def set_threads(threads: int | None) -> int:
    """Set Numba's worker count; returns it. None = default_threads()."""
    n = default_threads() if threads is None else threads
    if n < 1:
        raise EdgeError(f"--threads must be at least 1, got {n}")
    if n > numba.config.NUMBA_NUM_THREADS:
        raise EdgeError(f"--threads {n} is more than the {numba.config.NUMBA_NUM_THREADS} "
                        f"threads Numba started with (set NUMBA_NUM_THREADS to raise it)")
    numba.set_num_threads(n)
    return n
