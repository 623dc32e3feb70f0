"""Numba compile-once bookkeeping: where compiled kernels are cached, and compiling
(or loading from that cache) what the forward pass needs before the user waits on a
reply, telling which kernel of how many is compiling."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numba
import numba.extending
import numpy as np
from numba.core import event as numba_event
from numba.core.dispatcher import Dispatcher
from numba.core.event import Listener

from .. import threading_layer
from ..default_model import cache_dir

# Why kernels compile in memory, when the cache cannot be written (the CLI says so once).
cache_note: str | None = None


def njit(*args, **options):
    """numba.njit with the kernel's float licence its own: fastmath=False unless given.
    Numba compiles a kernel that leaves fastmath unset with the licence of whichever
    caller compiles it first, and the kernel cache keeps that build for every later
    process: a kernel whose twin is exact took fused multiply-adds once attention (a
    fastmath caller) had compiled it first. (A kernel inlined with inline="always" is
    lowered inside its caller, under the caller's licence.)"""
    options.setdefault("fastmath", False)
    return numba.njit(*args, **options)


def overload(func, jit_options=None, **options):
    """numba.extending.overload whose implementations state their float licence as njit
    above does (fastmath=False unless jit_options gives it)."""
    return numba.extending.overload(func, jit_options={"fastmath": False, **(jit_options or {})},
                                    **options)


# Every file holding kernels, the intrinsics they inline (kernels/fp.py, simd.py, amx.py) or
# the target features their instructions follow (kernels/target.py), from the package root.
_KERNEL_SOURCES = ("kernels/*.py", "formats/*.py")


def kernel_cache_dir() -> Path:
    """cache_dir()/numba/<digest of the kernel sources and Numba's version>. Numba keys a
    cached kernel by its own file only: a change to an intrinsic in simd.py would
    otherwise leave records.py's kernels running stale machine code."""
    h = hashlib.sha256(numba.__version__.encode())
    root = Path(__file__).parent.parent
    for pattern in _KERNEL_SOURCES:
        for f in sorted(root.glob(pattern)):
            h.update(f.name.encode() + f.read_bytes())
    return cache_dir() / "numba" / h.hexdigest()[:16]


_DIGEST = re.compile(r"[0-9a-f]{16}")
_KERNEL_FILE = re.compile(r".+\.(nbi|nbc)")      # Numba's index and data files


# Another version's kernels go once no process has used them for this long: two installs
# of different versions (two virtual environments, a checkout beside a release) each mark
# theirs on every run, and dropping them sooner would make each recompile everything
# after every run of the other.
UNUSED_SECONDS = 14 * 24 * 3600


def _drop_other_versions(keep: Path) -> None:
    """Kernels of other source versions not used for UNUSED_SECONDS: remove them (best
    effort: a process of that version recompiles what it misses). Only what is
    recognisably ours goes: a sibling named by a digest holding nothing but Numba's cache
    files, file by file; a folder with anything else in it (EDGELLAMA_CACHE may name a
    folder of the user's) is left as it is."""
    now = time.time()
    for d in sorted(keep.parent.iterdir()):
        if d != keep and _DIGEST.fullmatch(d.name) and not d.is_symlink() and d.is_dir():
            with contextlib.suppress(OSError):
                if now - d.stat().st_mtime > UNUSED_SECONDS:
                    _remove_kernel_folder(d)


def _remove_kernel_folder(d: Path) -> None:
    walk = list(os.walk(d, topdown=False))
    if any(not _KERNEL_FILE.fullmatch(f) or os.path.islink(os.path.join(top, f))
           for top, _, files in walk for f in files) \
            or any(os.path.islink(os.path.join(top, s)) for top, subs, _ in walk for s in subs):
        return
    with contextlib.suppress(OSError):
        for top, subs, files in walk:
            for f in files:
                os.unlink(os.path.join(top, f))
            for s in subs:
                os.rmdir(os.path.join(top, s))
        os.rmdir(d)


def use_user_cache() -> None:
    """Cache compiled kernels in kernel_cache_dir(), never beside the installed sources;
    if that cannot be written, compile ours in memory. Must run before any module with
    kernels is imported (the package's __init__ calls it first)."""
    global cache_note
    if os.environ.get("NUMBA_CACHE_DIR"):   # the user's choice; Numba's own rules apply
        return
    path = kernel_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        os.utime(path)                      # this version's kernels are in use
        _drop_other_versions(path)
    except OSError as e:
        cache_note = (f"cannot write the kernel cache {path} ({e.strerror or e}): kernels "
                      f"compile in memory on every run (EDGELLAMA_CACHE sets the directory)")
        _compile_in_memory()
        return
    # Not the environment: child processes would take it for the user's choice. (Numba
    # resets this when a NUMBA_* variable changes, but reads it only as kernels are defined.)
    numba.config.CACHE_DIR = str(path)
    _repair_damaged_entries(path.parent)


# What the last repair of the kernel cache said (None: none this run).
repair_note: str | None = None
_SAFE_DATA_NAME = re.compile(r"[^/\\]+\.nbc")


def _discard(path: str, why: str) -> None:
    """A damaged file of our kernel cache goes (it is rebuilt as the kernel compiles);
    one line on stderr says so, once a run."""
    global repair_note
    with contextlib.suppress(OSError):
        if not os.path.isdir(path) or os.path.islink(path):
            os.unlink(path)
    if repair_note is None:
        repair_note = (f"the compiled-kernel cache had a damaged entry ({why}: {path}); "
                       f"discarded, the kernels it held are compiled again")
        print(f"note: {repair_note}", file=sys.stderr, flush=True)


def _repair_damaged_entries(root: Path) -> None:
    """Make Numba's cache of files under `root` repair itself. Numba raises whatever
    unpickling raises on a damaged index or data file (empty after a power cut, random
    bytes), and every later run would fail the same way: such a file is discarded
    instead and the kernel compiles as if it were not cached. Writing an entry that
    cannot be written (a full disk) leaves the kernel compiled in memory."""
    from numba.core import caching
    cls = caching.IndexDataCacheFile
    if getattr(cls, "_edgellama_repairs", None) is not None:
        cls._edgellama_repairs.add(str(root))
        return
    roots = cls._edgellama_repairs = {str(root)}
    load_index, load_data, save = cls._load_index, cls._load_data, cls.save

    def ours(path) -> bool:
        path = os.path.abspath(path)
        return any(path.startswith(r + os.sep) for r in roots)

    def _load_index(self):
        if not ours(self._index_path):
            return load_index(self)
        try:
            overloads = load_index(self)
            if isinstance(overloads, dict) and all(
                    isinstance(v, str) and _SAFE_DATA_NAME.fullmatch(v) for v in overloads.values()):
                return overloads
            why = "an index that is not Numba's"
        except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises
            why = f"{type(e).__name__}"
        _discard(self._index_path, f"index unreadable, {why}")
        return {}

    def _load_data(self, name):
        if not ours(self._index_path):
            return load_data(self, name)
        try:
            data = load_data(self, name)
            if isinstance(data, tuple):
                return data
            why = "not Numba's data"
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}"
        _discard(self._data_path(name), f"data unreadable, {why}")
        raise FileNotFoundError(name)        # load() takes that for a miss: it compiles

    def save_(self, key, data):
        if not ours(self._index_path):
            return save(self, key, data)
        with contextlib.suppress(OSError):   # a full disk, a folder in the way: not cached
            save(self, key, data)

    cls._load_index, cls._load_data, cls.save = _load_index, _load_data, save_

    cache_cls = caching.Cache
    load_overload = cache_cls.load_overload

    def load_overload_(self, sig, target_context):
        try:
            return load_overload(self, sig, target_context)
        except Exception:   # noqa: BLE001 - data that unpickled but does not rebuild
            index = self._cache_file._index_path
            if not ours(index):
                raise
            _discard(index, "an entry that does not load")
            return None

    cache_cls.load_overload = load_overload_


def prepare_numba() -> None:
    """Set Numba up for our kernels; runs once numba and this module are imported, before
    any module with kernels defines them (the package's __init__ arranges it)."""
    use_user_cache()
    _import_arraymath_without_scipy()
    threading_layer.configure()


def _import_arraymath_without_scipy() -> None:
    """Import numba.np.arraymath (Numba's first kernel load does) with its import-time
    BLAS probe failing. The probe imports scipy.linalg when SciPy is installed: 0.15-0.2 s
    of every start on this VM. No kernel of ours calls BLAS from Numba, and a kernel that
    does (np.dot) makes Numba import SciPy then, when it is typed."""
    if "numba.np.arraymath" in sys.modules or "scipy.linalg.cython_blas" in sys.modules:
        return
    sys.modules["scipy.linalg.cython_blas"] = None     # its import fails at once
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        del sys.modules["scipy.linalg.cython_blas"]


def _compile_in_memory() -> None:
    """No disk cache for our kernels: Numba would otherwise fall back to the package's
    own directory, or fail at import when nothing is writable."""
    enable = Dispatcher.enable_caching

    def enable_caching(self):
        if not self.py_func.__module__.startswith("edgellama."):
            enable(self)
    Dispatcher.enable_caching = enable_caching


class Compiling(Listener):
    """While installed (`with Compiling(show):`), tells show(n, total, name) each time
    Numba starts compiling one of our kernels: loading one from the cache is silent.
    `count` is how many it compiled and `seconds` how long that took; warm_up sets
    `step` to (n, total) as it goes, and `listed` to the (kernel, argument types) of its
    total, so that one compiled inside another's compile (a kernel that calls it) still
    counts as one of them."""

    def __init__(self, show: Callable[[int, int | None, str], None] | None = None):
        self.show = show
        self.count = 0
        self.seconds = 0.0
        self.step: tuple[int, int] | None = None
        self.listed: set = set()
        self._depth = 0     # our kernels compile the ones they call inside their own compile
        self._t0 = 0.0

    def on_start(self, event):
        disp = event.data["dispatcher"]
        if not disp.py_func.__module__.startswith("edgellama."):
            return          # Numba's own helpers
        if self._depth == 0:
            self.count += 1
            self._t0 = time.perf_counter()
            if self.show:
                n, total = self.step or (self.count, None)
                self.show(n, total, disp.py_func.__name__)
        elif (disp, tuple(event.data["args"])) in self.listed:
            self.count += 1     # its own step will find it compiled
        self._depth += 1

    def on_end(self, event):
        if event.data["dispatcher"].py_func.__module__.startswith("edgellama."):
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - self._t0

    def __enter__(self):
        numba_event.register("numba:compile", self)
        return self

    def __exit__(self, *exc):
        numba_event.unregister("numba:compile", self)


class _Recorder:
    """Stands in for a kernel during the dry run: notes its argument types, runs nothing."""

    def __init__(self, disp: Dispatcher, calls: dict):
        self.disp, self.calls = disp, calls

    def __call__(self, *args):
        sig = tuple(numba.typeof(a) for a in args)
        self.calls.setdefault((self.disp, sig), None)


# Rows of x in the dry run's prefill: enough for every kernel a long prefill runs and a
# short one does not: the parallel elementwise rows (kernels.PARALLEL_ROWS), the parallel
# K/V stores (kv_cache._PARALLEL_STORE) and the AMX products (records.AMX_MIN_ROWS, where
# amx.enabled()); tests/runtime/test_jit_progress.py holds it to them.
DRY_RUN_ROWS = 32


@contextlib.contextmanager
def kernels_replaced(stand_in: Callable[[Dispatcher], object | None]):
    """For the block: every kernel of ours, in each module of the package that holds it
    (by name, or in a module-level dict: the kernels a factory makes per kind, as
    records.MATVEC_BLOCKS), replaced by stand_in(kernel) (None: left as it is); all put
    back after."""
    patched = []     # (holder, key, kernel): a module's attribute or a dict's entry
    try:
        for holder, key, kernel, _ in _kernel_homes():
            new = stand_in(kernel)
            if new is not None:
                patched.append((holder, key, kernel))
                _put(holder, key, new)
        yield
    finally:
        for holder, key, kernel in patched:
            _put(holder, key, kernel)


def _kernel_homes() -> list[tuple[object, object, Dispatcher, tuple[str, str, object]]]:
    """Every kernel of ours where the package's imported modules hold it: (holder, key,
    kernel, address), the holder a module (key its attribute's name) or a module-level
    dict (key the kernel's key there), the address (module name, attribute, dict key or
    None) by which another process finds the same kernel."""
    ours = lambda v: isinstance(v, Dispatcher) and v.py_func.__module__.startswith("edgellama.")
    homes = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "edgellama" or name.startswith("edgellama.")):
            continue
        for attr, value in list(vars(mod).items()):
            if ours(value):
                homes.append((mod, attr, value, (name, attr, None)))
            elif type(value) is dict:
                homes += [(value, k, v, (name, attr, k)) for k, v in value.items() if ours(v)]
    return homes


def _put(holder, key, value) -> None:
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


def kernels_called(model) -> list[tuple[Dispatcher, tuple]]:
    """The kernels, with their argument types, that a long prefill, a short one and a
    decode step call, in order of first use. Found by running the three steps with every
    kernel of ours replaced by a recorder (in the modules that call them), so nothing
    compiles: only the Python around the kernels runs, on whatever the buffers hold.
    Call it before other threads use our kernels."""
    calls: dict = {}
    with kernels_replaced(lambda kernel: _Recorder(kernel, calls)), \
            np.errstate(all="ignore"):    # the buffers hold whatever they held
        _every_path(model)
    return list(calls)


def _every_path(model) -> None:
    """A long prefill, a short one and a decode step, in a sequence of their own."""
    cap = min(model.ctx, 2 * DRY_RUN_ROWS)
    seq = model.new_sequence(cap)
    rows = DRY_RUN_ROWS if cap > DRY_RUN_ROWS + 3 else 2
    model.forward([0] * rows, seq)        # batched (matmul) path, rows in parallel
    if rows > 2:                          # a short prompt's rows one by one (arrays of
        model.forward([0] * 2, seq)       # several rows, laid out as a single row is not)
    model.forward([0], seq)               # decode (matvec) path


# Processes a first start compiles kernels in at most, beside the waiting parent. A
# model's compile is a few long kernels (attention's work item, one a KV cache type) and
# a score of shorter ones: more than a few processes would only cost memory (250 MB each).
COMPILE_PROCESSES = 3


def _cached(disp: Dispatcher, sig: tuple) -> bool:
    """Whether Numba's kernel cache lists disp's compile for these argument types (its
    index is read, the machine code is not loaded). Anything unexpected reads as cached:
    the kernel then compiles in this process, as it would have."""
    try:
        cache = disp._cache
        key = cache._index_key(sig, disp.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - Numba's internals moved: compile here
        return True


def compile_in_processes(todo: list[tuple[Dispatcher, tuple]], show=None,
                         total: int | None = None, cores: int | None = None) -> tuple[int, float]:
    """Compile the kernels of `todo` that the kernel cache lacks in helper processes
    (compile_child.py), into the cache this process then loads them from: Numba compiles
    one kernel at a time a process, and a first start's kernels took half a minute on
    one core. Kernels whose cache index is one file (the closures a factory makes per
    weight type) go to one process, so that two never write that index at once; the
    largest kernels (by bytecode: attention's work item) go first, each process taking
    the next group as it finishes one. show(n, total, name) as groups go out and come
    back: n the kernels handed out so far, name the oldest group still compiling. Returns
    (kernels compiled, seconds). `cores`: how many to use at most (the model's thread
    count: `-t 1` keeps to one); None, those this process may run on. Nothing happens
    where the cache cannot be written, with fewer than 2 groups to compile or 2 cores,
    or where a process cannot start; a group whose process fails is compiled by the
    caller's own pass."""
    if cache_note is not None or not sys.executable:
        return 0, 0.0
    try:
        mine = len(os.sched_getaffinity(0))
    except AttributeError:
        mine = os.cpu_count() or 1
    cores = min(mine, cores or mine)
    where = {kernel: address for _, _, kernel, address in _kernel_homes()}
    groups: dict[tuple, list] = {}
    for disp, sig in todo:
        if disp in where and not _cached(disp, sig):
            code = disp.py_func.__code__
            groups.setdefault((code.co_filename, code.co_firstlineno),
                              []).append((disp, (*where[disp], sig)))
    tasks = sorted(groups.values(), key=lambda g: -len(g[0][0].py_func.__code__.co_code))
    n = min(len(tasks), cores, COMPILE_PROCESSES)
    if n < 2:
        return 0, 0.0
    import base64
    import pickle
    import queue
    import subprocess
    import threading
    t0 = time.perf_counter()
    # (helper, kernels, name) as a group goes out, (helper, 0, None) as it comes back,
    # None as a helper is done
    events: queue.Queue = queue.Queue()

    def serve(proc) -> None:
        # hand this helper the next group until none is left; a helper that dies (no
        # reply) leaves its group to the caller's pass
        try:
            while tasks:
                try:
                    group = tasks.pop(0)
                except IndexError:          # another helper took the last one
                    break
                proc.stdin.write(base64.b64encode(pickle.dumps([a for _, a in group])) + b"\n")
                proc.stdin.flush()
                events.put((proc, len(group), group[0][0].py_func.__name__))
                if not proc.stdout.readline():
                    break
                events.put((proc, 0, None))
        except OSError:
            pass
        finally:
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
            events.put(None)

    # the helpers import this copy of the package, wherever it was imported from
    home = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [home, os.environ.get("PYTHONPATH")])))
    procs = []
    try:
        for _ in range(n):
            try:
                procs.append(subprocess.Popen([sys.executable, "-m", "edgellama.kernels.compile_child"],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, env=env))
            except OSError:
                break
            threading.Thread(target=serve, args=(procs[-1],), daemon=True).start()
        # progress shown from this thread alone: the kernels handed out so far and the
        # oldest group still compiling (the largest went first)
        started, done, running = 0, 0, {}
        while done < len(procs):
            event = events.get()
            if event is None:
                done += 1
                continue
            proc, count, name = event
            running.pop(proc, None)
            if name is not None:
                started += count
                running[proc] = name
            if show and running:
                show(started, total, next(iter(running.values())))
    except BaseException:                   # Ctrl-C: the helpers stop now, not after their group
        for proc in procs:
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.wait()
    return sum(_cached(d, a[-1]) for g in groups.values() for d, a in g), time.perf_counter() - t0


@dataclass
class Warm:
    seconds: float            # compiling or loading the kernels, and one decode step
    compiled: int             # kernels Numba compiled; 0: all came from its cache
    compile_seconds: float    # the part of `seconds` spent compiling


def warm_up(model, show: Callable[[int, int | None, str], None] | None = None) -> Warm:
    """Compile (or load from Numba's cache) every kernel model.forward needs, those the
    cache lacks in helper processes on the other cores first (compile_in_processes),
    then each in turn here, so that show(n, total, name) can tell which; then decode
    one token (starting the threads), in a sequence of its own. The prefill path is not
    run (it reads every weight: seconds for a 3B model) unless the dry run fails: then
    every path runs."""
    t0 = time.perf_counter()
    with Compiling(show) as watch:
        try:
            todo = kernels_called(model)
        except Exception:   # noqa: BLE001 - tests/runtime/test_jit_progress.py fails on this
            # A kernel called in a way a recorder cannot stand in for (keyword arguments,
            # a result the Python goes on to use): compile as every path runs instead,
            # reported without a total.
            todo = None
            _every_path(model)
        watch.listed = set(todo or [])
        elsewhere, elsewhere_s = compile_in_processes(todo or [], show, len(todo or []),
                                                      model.threads.max)
        for i, (disp, sig) in enumerate(todo or []):
            watch.step = (i + 1, len(todo))
            disp.compile(sig)
        watch.step = None    # anything the list missed compiles below, still reported
        model.forward([0], model.new_sequence(min(model.ctx, 16)))
    return Warm(time.perf_counter() - t0, watch.count + elsewhere, watch.seconds + elsewhere_s)
