"""What this machine offers: cores, memory, CPU name; and the engine's thread count.

Imports no NumPy or Numba: the chat template renderer process uses resident_memory.
"""
from __future__ import annotations

import ctypes
import math
import os
import platform
import sys
import time

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


# Where Linux lists a hybrid Intel CPU's efficiency cores (Alder Lake and later); and
# each logical CPU's core
_ATOM_CPUS = "/sys/devices/cpu_atom/cpus"
_CPUINFO = "/proc/cpuinfo"


def default_threads() -> int:
    """The physical cores we may run on, performance cores only on a hybrid CPU, and no
    more than the CPUs' worth of time our cgroup allows (rounded up: prompts, whose
    products are bound by arithmetic, use a fraction's thread; ThreadPolicy runs a reply's
    passes on the whole CPUs). Decode is bandwidth bound, so SMT siblings add nothing;
    every matrix product ends at a barrier, so a thread on a slower efficiency core
    would hold up the others at each one (llama.cpp's default counts the same way); and
    threads beyond a cgroup's CPU limit run in bursts, then wait out the rest of each
    period (a container's `--cpus`, a Kubernetes CPU limit)."""
    try:
        cpus = set(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
    cpus = (cpus - efficiency_cpus()) or cpus
    core = _cpu_cores()
    n = max(1, len({core.get(c, c) for c in cpus}))
    quota = cpu_quota()
    return n if quota is None else max(1, min(n, math.ceil(round(quota, 6))))


# Which cgroups Linux says the process is in, and where each hierarchy is mounted
_PROC_CGROUP = "/proc/self/cgroup"
_MOUNTINFO = "/proc/self/mountinfo"


def cpu_quota() -> float | None:
    """The CPUs' worth of time this process's cgroups allow it (Linux's CPU bandwidth
    limit: `docker run --cpus`, a Kubernetes CPU limit, systemd's CPUQuota=), the
    smallest along its cgroup's path up to its hierarchy's root, in cgroup v2 or v1;
    None where nothing limits it or Linux does not say."""
    try:
        with open(_PROC_CGROUP) as f:
            groups = f.read().splitlines()
        with open(_MOUNTINFO) as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in groups:
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not path.startswith("/"):
            continue
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        for root, point in _cgroup_mounts(mounts, v2):
            limits += _quotas_along(point, _below(path, root), v2)
    return min(limits) if limits else None


def _cgroup_mounts(mounts: list[str], v2: bool) -> list[tuple[str, str]]:
    """(root within the hierarchy, mount point) of each cgroup2 mount (v2) or v1 mount
    with the cpu controller, from /proc/self/mountinfo's lines."""
    out = []
    for line in mounts:
        # ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER-OPTIONS
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        if (tail[0] == "cgroup2") if v2 else \
                (tail[0] == "cgroup" and "cpu" in tail[-1].split(",")):
            out.append((_unescape(fields[3]), _unescape(fields[4])))
    return out


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _below(path: str, root: str) -> str:
    """The cgroup `path` relative to a mount of its hierarchy at `root`; "/" where the
    mount does not reach it by name (a cgroup namespace shows the process its own group
    as the root)."""
    if root == "/":
        return path
    if path == root or path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")):] or "/"
    return "/"


def _quotas_along(point: str, rel: str, v2: bool) -> list[float]:
    """The CPU limits (quota / period) set on the cgroup at point + rel and each of its
    parents up to the mount point (only the mount point's where rel leads out of it, as
    a path with ".." does from inside a cgroup namespace)."""
    top = os.path.normpath(point)
    inside = top.rstrip("/") + "/"
    here = os.path.normpath(top + "/" + rel.lstrip("/"))
    if not here.startswith(inside):
        here = top
    out = []
    while True:
        q = _quota_of(here, v2)
        if q is not None:
            out.append(q)
        if here == top:
            return out
        here = os.path.dirname(here)


def _quota_of(group: str, v2: bool) -> float | None:
    try:
        if v2:
            with open(os.path.join(group, "cpu.max")) as f:
                quota, period = f.read().split()       # "max 100000" or "150000 100000"
        else:
            with open(os.path.join(group, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()                # -1: no limit
            with open(os.path.join(group, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        q, p = int(quota), int(period)
    except (OSError, ValueError):                       # "max", absent, unreadable
        return None
    return q / p if q > 0 and p > 0 else None


def efficiency_cpus() -> set[int]:
    """The logical CPUs of a hybrid CPU's efficiency cores (empty where there are none,
    or Linux does not say)."""
    try:
        with open(_ATOM_CPUS) as f:
            return _cpu_list(f.read())
    except (OSError, ValueError):
        return set()


def _cpu_list(text: str) -> set[int]:
    # Linux's cpulist format: "0-3,8,10-11"
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _cpu_cores() -> dict[int, tuple[str, str]]:
    """Logical CPU -> (physical id, core id), from /proc/cpuinfo; CPUs it does not place
    (no such file, Arm's cpuinfo) are missing, and count as cores of their own."""
    core: dict[int, tuple[str, str]] = {}
    cpu = phys = None
    try:
        with open(_CPUINFO) as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu, phys = int(value), None
                elif key == "physical id":
                    phys = value
                elif key == "core id" and cpu is not None:
                    core[cpu] = (phys or "0", value)
    except (OSError, ValueError):
        return {}
    return core


def set_threads(threads: int | None) -> int:
    """Set Numba's worker count in the calling thread; returns it. None = default_threads()."""
    import numba   # here, not at the top: see the module docstring
    n = default_threads() if threads is None else threads
    if n < 1:
        raise EdgeError(f"--threads must be at least 1, got {n}")
    if n > numba.config.NUMBA_NUM_THREADS:
        raise EdgeError(f"--threads {n} is more than the {numba.config.NUMBA_NUM_THREADS} "
                        f"threads Numba started with (set NUMBA_NUM_THREADS to raise it)")
    numba.set_num_threads(n)
    return n


def _busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds the given CPUs have spent not idle since boot, by everyone (Linux
    /proc/stat: user, nice, system, irq, softirq, and steal: time a hypervisor gave
    to other machines is as lost to us as time another process used)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in want:
            v = [int(x) for x in rest.split()]
            ticks += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadPolicy:
    """How many threads the engine runs, decided before every forward pass.

    Fixed (`-t N`): always N. Automatic (the default): the cores that other processes
    are not using, measured over the last half second or more from /proc/stat minus our
    own CPU time. Why: every matrix product ends at a barrier, so a thread that shares
    its core with someone else's busy process stalls all the others at every barrier;
    on 2 cores with one busy neighbour, 2 threads ran at a third of 1 thread's speed.
    Automatic under a cgroup's CPU limit of a fraction (1.5 CPUs), a pass of at most
    MEMORY_BOUND_ROWS rows (a reply's tokens) runs on the whole CPUs only (1): it waits on
    memory, so a thread more adds little and its bursts are throttled; a prompt's passes,
    bound by arithmetic, take the fraction's thread too.
    Applies to Numba's threads (per calling thread). NumPy's BLAS, which no product of
    ours runs on (the benchmark's NumPy comparison does), keeps one thread: its workers
    and Numba's spin-wait against each other when the two alternate ("BLAS threads",
    bench/results/design_measurements.json).
    """
    PERIOD = 0.5    # seconds between measurements (/proc/stat counts in 10 ms ticks)
    MEMORY_BOUND_ROWS = 4   # a pass of this many rows or fewer reads weights more than it multiplies

    def __init__(self, threads: int | None = None):
        self.max = set_threads(threads)
        try:
            self._cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:
            self._cpus = []
        self.quota = cpu_quota() if threads is None else None
        # the most threads a memory-bound pass runs: the quota's whole CPUs
        self.memory_bound_max = self.max if self.quota is None else \
            max(1, min(self.max, int(round(self.quota, 6))))
        self.auto = threads is None and self.max > 1 and _busy_seconds(self._cpus) is not None
        self.current = self.max
        self.others: float | None = None   # cores busy with other processes (smoothed)
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        t = os.times()
        return time.monotonic(), _busy_seconds(self._cpus) or 0.0, t.user + t.system

    def _measure(self) -> None:
        if time.monotonic() - self._last[0] < self.PERIOD:
            return                 # not every token: /proc/stat is read twice a second
        now = self._sample()
        dt = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / dt
        self._last = now
        # the first measurement (over the model's loading) decides at once: starting from
        # "idle" would run the first second of a busy machine on too many threads
        self.others = others if self.others is None else 0.5 * self.others + 0.5 * others
        free = len(self._cpus) - self.others
        self.current = max(1, min(self.max, int(free + 0.5)))

    def apply(self, rows: int | None = None) -> int:
        """Set the threads for a pass of `rows` rows (tokens) about to run, in the
        calling thread; returns the count."""
        import numba
        if self.auto:
            self._measure()
        n = self.current
        if rows is not None and rows <= self.MEMORY_BOUND_ROWS:
            n = min(n, self.memory_bound_max)
        numba.set_num_threads(n)
        _blas_threads(1)
        return n


_blas = None        # threadpoolctl's controller of NumPy's BLAS, and the count it was set to
_blas_n = None


def _blas_threads(n: int) -> None:
    global _blas, _blas_n
    if n == _blas_n:     # the process-wide setting, whichever policy made it
        return
    if _blas is None:    # looking for the loaded BLAS libraries is slow: once
        import threadpoolctl   # well kept (scikit-learn's); knows OpenBLAS, MKL and BLIS
        _blas = threadpoolctl.ThreadpoolController()
    _blas.limit(limits=n, user_api="blas")
    _blas_n = n
