"""What this machine offers: cores, memory, CPU name; and the engine's thread count.

Imports no NumPy or Numba: the chat template renderer process uses resident_memory.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

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


def resident_memory(pid: int | None = None) -> int | None:
    """Bytes of a process (default: this one) resident in memory now; cheap enough to
    poll. Linux, macOS and Windows; None where unknown (or the process is gone)."""
    try:
        if sys.platform == "darwin":
            return _darwin_resident(os.getpid() if pid is None else pid)
        if sys.platform == "win32":
            return _windows_resident(pid)
        with open(f"/proc/{'self' if pid is None else pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _darwin_resident(pid: int) -> int | None:
    # proc_pidinfo(PROC_PIDTASKINFO): struct proc_taskinfo starts with
    # pti_virtual_size, pti_resident_size (uint64); it is 96 bytes long.
    info = (ctypes.c_uint64 * 12)()
    libproc = ctypes.CDLL("/usr/lib/libproc.dylib")
    got = libproc.proc_pidinfo(pid, 4, ctypes.c_uint64(0), info, ctypes.sizeof(info))
    return int(info[1]) if got == ctypes.sizeof(info) else None


def _windows_resident(pid: int | None) -> int | None:
    from ctypes import wintypes

    class Counters(ctypes.Structure):   # PROCESS_MEMORY_COUNTERS
        _fields_ = [("cb", wintypes.DWORD), ("PageFaultCount", wintypes.DWORD)] + [
            (name, ctypes.c_size_t) for name in (
                "PeakWorkingSetSize", "WorkingSetSize", "QuotaPeakPagedPoolUsage",
                "QuotaPagedPoolUsage", "QuotaPeakNonPagedPoolUsage", "QuotaNonPagedPoolUsage",
                "PagefileUsage", "PeakPagefileUsage")]

    kernel32, psapi = ctypes.windll.kernel32, ctypes.windll.psapi
    kernel32.OpenProcess.restype = wintypes.HANDLE
    kernel32.GetCurrentProcess.restype = wintypes.HANDLE
    # PROCESS_QUERY_LIMITED_INFORMATION | PROCESS_VM_READ
    handle = kernel32.GetCurrentProcess() if pid is None else kernel32.OpenProcess(0x1010, False, pid)
    if not handle:
        return None
    try:
        c = Counters(cb=ctypes.sizeof(Counters))
        ok = psapi.GetProcessMemoryInfo(wintypes.HANDLE(handle), ctypes.byref(c), c.cb)
        return int(c.WorkingSetSize) if ok else None
    finally:
        if pid is not None:
            kernel32.CloseHandle(wintypes.HANDLE(handle))


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
    import numba   # here, not at the top: see the module docstring
    n = default_threads() if threads is None else threads
    if n < 1:
        raise EdgeError(f"--threads must be at least 1, got {n}")
    if n > numba.config.NUMBA_NUM_THREADS:
        raise EdgeError(f"--threads {n} is more than the {numba.config.NUMBA_NUM_THREADS} "
                        f"threads Numba started with (set NUMBA_NUM_THREADS to raise it)")
    numba.set_num_threads(n)
    return n
