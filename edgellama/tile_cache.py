"""Repacked weight tiles kept on disk, so that a model's next start maps them instead of
repacking its file again.

Loading repacks every quantized matrix from the file's blocks into row tiles
(formats/base.TiledLinear), most of a start's time, nearly all of it the kernel handing
out new pages, not the repacking ("repack at load", bench/results/design_measurements.json).
The first load of a model writes
its tiles to cache_dir()/tiles/<key>.tiles; later loads map that file copy-on-write: its
pages come from the page cache, are shared by every process running the model, can be
dropped and re-read under memory pressure, and nothing is copied.

The file holds only arrays and a JSON index of them (never pickled objects), the index
with a SHA-256 of its content (a damaged index is rebuilt, never half-read):

    b"EDGETILE" | u64 index offset | u64 index length | arrays (64-byte aligned) | index

The index is a declared format, not a dump of a class's attributes:

    {"version": 2, "source": {path, size, mtime_ns, inode},
     "linears": {"blk.0.attn_q.weight|...": {"type": "Q4_K", "in_features": 2048,
                 "splits": [2048, 512, 512], "tile_rows": 64,
                 "arrays": {"q": {"dtype": "u1", "shape": [nt, n], "offset": 4096}}}},
     "sha256": hex digest of the rest}

Each Linear is named by its tensors, with its GGML type, its shape and its tile arrays
by the names, shapes and dtypes its class declares for that shape (TiledLinear.tile_spec);
it is rebuilt with TiledLinear.from_tiles. An index of another version, or whose arrays
are not exactly the declared ones, is a damaged file: the model repacks and writes a new
one. Bump VERSION when the meaning of the index changes. The key covers the source file's identity (path,
size, mtime, inode), the tile layouts (the digest of the kernel sources, as the kernel
cache) and the thread count (tile heights depend on it). Small models are not cached
(repacking them takes milliseconds), and EDGELLAMA_TILE_CACHE=0 turns the cache off.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import shutil
import queue
import struct
import tempfile
import threading
from pathlib import Path

import numba
import numpy as np

from .default_model import cache_dir
from .formats import BY_ID, FORMATS, linear
from .formats.base import Linear, TiledLinear

MAGIC = b"EDGETILE"
_HEADER = struct.Struct("<8sQQ")
MIN_BYTES = 64 << 20        # models with fewer bytes of tiles are repacked every time
KEEP = 3                    # tile files kept, most recently used first
_MAX_INDEX = 16 << 20
_TMP_PREFIX = ".edgellama-tiles-"   # a file being written; left by a load that was killed
VERSION = 2                 # 1: attributes and arrays of the Linear classes, by their names


def tiles_dir() -> Path:
    return cache_dir() / "tiles"


def enabled() -> bool:
    return os.environ.get("EDGELLAMA_TILE_CACHE", "1").strip().lower() not in ("0", "off", "no", "false")


def _key(path: Path) -> tuple[str, dict]:
    """(file name, source identity) for the GGUF at path."""
    from .kernels.jit import kernel_cache_dir        # the same digest of the kernel sources
    st = path.stat()
    source = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "inode": st.st_ino}
    ident = dict(source, layout=kernel_cache_dir().name, threads=numba.config.NUMBA_NUM_THREADS)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20], source


def read_index(path: Path) -> tuple[dict, int]:
    """The index of a tile file and the file's size; ValueError if it is not one of ours,
    is damaged in any way, or its index points outside it (OSError if it cannot be read)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise ValueError("truncated header")
        magic, off, n = _HEADER.unpack(head)
        if magic != MAGIC or n > _MAX_INDEX or off + n != size:
            raise ValueError("not a tile file")
        f.seek(off)
        raw = f.read(n)
    try:
        return _checked(json.loads(raw), off), size
    except (AttributeError, TypeError, KeyError, IndexError, RecursionError, OverflowError) as e:
        raise ValueError(f"bad index ({type(e).__name__})") from None   # not what we write


def _checked(index, off: int) -> dict:
    """The index, if it is of this VERSION and every entry is one _Writer writes, arrays
    exactly as the Linear's class declares them; ValueError (or another error
    read_index turns into one) if not."""
    if not isinstance(index, dict) or not isinstance(index.get("linears"), dict) \
            or not isinstance(index.get("source"), dict):
        raise ValueError("bad index")
    if type(index.get("version")) is not int or index["version"] != VERSION:
        raise ValueError(f"tile format {index.get('version')!r}, not {VERSION}")   # rebuilt
    if index.get("sha256") != _digest(index):     # damaged in a way that still parses
        raise ValueError("the index does not match its checksum")
    for entry in index["linears"].values():
        spec = _shell(entry).tile_spec()
        if not isinstance(entry.get("arrays"), dict) or set(entry["arrays"]) != set(spec):
            raise ValueError("not the arrays its format declares")
        for name, a in entry["arrays"].items():
            shape, dtype = spec[name]
            if not isinstance(a, dict) or a.get("dtype") != np.dtype(dtype).str[1:] \
                    or a.get("shape") != list(shape):
                raise ValueError("an array not as its format declares it")
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            if not (type(a.get("offset")) is int and _HEADER.size <= a["offset"] <= off - nbytes):
                raise ValueError("array outside the file")
    return index


def _shell(entry) -> TiledLinear:
    """The tile-less Linear an entry describes (its declared arrays: .tile_spec())."""
    if not isinstance(entry, dict) or entry.get("type") not in FORMATS \
            or type(entry.get("in_features")) is not int or not isinstance(entry.get("splits"), list) \
            or not all(type(v) is int and 0 < v < 1 << 31 for v in entry["splits"]) \
            or not 0 < entry["in_features"] < 1 << 31 or type(entry.get("tile_rows")) is not int:
        raise ValueError("bad entry")
    fmt = FORMATS[entry["type"]]
    if not issubclass(fmt.linear, TiledLinear):
        raise ValueError("not a tiled format")
    return fmt.linear.shell(fmt, entry["splits"], entry["in_features"], entry["tile_rows"])


def _digest(index: dict) -> str:
    """Checksum of an index's content: any change to a value (a shape read back wrong
    would make a kernel index outside its arrays) is seen as damage."""
    content = {"version": index.get("version"), "source": index["source"],
               "linears": index["linears"]}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


class _Writer:
    """Writes Linears' tiles to a temporary file, named <key>.tiles once complete. The
    writing runs on a thread of its own, so a first load does not wait for the disk (the
    arrays are final once built, and the file gets only their bytes); the process waits
    for it at exit."""

    def __init__(self, final: Path, source: dict):
        self.final, self.source = final, source
        fd, self.tmp = tempfile.mkstemp(dir=final.parent, prefix=_TMP_PREFIX, suffix=".tmp")
        self.end = _HEADER.size            # where the next array goes
        self.linears: dict = {}
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._write, args=(fd,), name="tile-cache")
        self.thread.start()

    def add(self, name: str, lin: TiledLinear) -> None:
        arrays = {}
        for k, v in lin.tiles().items():
            arrays[k] = {"dtype": v.dtype.str[1:], "shape": list(v.shape),
                         "offset": self._put(np.ascontiguousarray(v).reshape(-1).view(np.uint8))}
        self.linears[name] = {"type": lin.type_name, "in_features": lin.in_features,
                              "splits": list(lin.splits), "tile_rows": lin.R, "arrays": arrays}

    def _put(self, data) -> int:
        off = -(-self.end // 64) * 64
        self.end = off + len(data)
        self.jobs.put((off, data))
        return off

    def finish(self) -> None:
        index = {"version": VERSION, "source": self.source, "linears": self.linears}
        blob = json.dumps(dict(index, sha256=_digest(index))).encode()
        off = self._put(blob)
        self.jobs.put((0, _HEADER.pack(MAGIC, off, len(blob))))
        self.jobs.put("done")

    def abandon(self) -> None:
        self.jobs.put("abandon")

    def _write(self, fd: int) -> None:
        ok = True
        while (job := self.jobs.get()) not in ("done", "abandon"):
            off, data = job
            view = memoryview(data)
            try:
                while ok and len(view):
                    n = os.pwrite(fd, view, off)
                    view, off = view[n:], off + n
            except OSError:
                ok = False    # the disk is full, say: this model starts without tiles
        os.close(fd)
        try:
            if ok and job == "done":
                os.replace(self.tmp, self.final)
                _evict(keep=self.final)
            else:
                os.unlink(self.tmp)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)


class TileCache:
    """One model's tiles: `linear(name, type_id, parts)` returns the Linear from the tile
    file when it holds it, else builds it (and, on a first load, records it); `finish()`
    after the last one puts a recorded file in place, `close()` drops it."""

    def __init__(self, gguf_path: str | Path, tiled_bytes: int):
        self.mm: mmap.mmap | None = None
        self.index: dict = {}
        self.writer: _Writer | None = None
        if not enabled() or tiled_bytes < MIN_BYTES:
            return
        try:
            name, source = _key(Path(gguf_path))
            path = tiles_dir() / f"{name}.tiles"
            if path.exists():
                self._open(path)
            if self.mm is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                if shutil.disk_usage(path.parent).free > 2 * tiled_bytes + (1 << 30):
                    self.writer = _Writer(path, source)
        except OSError:
            self.close()      # no cache: the model repacks, as it would without one

    def _open(self, path: Path) -> None:
        try:
            index, size = read_index(path)
        except (ValueError, KeyError, TypeError, OSError):
            with contextlib.suppress(OSError):
                path.unlink()          # damaged or foreign: rebuilt below
            return
        with open(path, "rb") as f:
            # private and writable: the kernels take writable arrays (read-only ones would
            # compile a second set); nothing writes the tiles, so every page stays shared
            self.mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        self.index = index["linears"]
        os.utime(path)                 # most recently used: kept by _evict

    def linear(self, name: str, type_id: int, parts: list[tuple[np.ndarray, tuple]]) -> Linear:
        entry = self.index.get(name)
        fmt = BY_ID.get(type_id)
        if entry is not None and fmt is not None and entry["type"] == fmt.name \
                and entry["in_features"] == int(parts[0][1][1]) \
                and entry["splits"] == [int(s[0]) for _, s in parts]:
            with contextlib.suppress(ValueError):      # (read_index checked the entry)
                return fmt.linear.from_tiles(fmt, entry["splits"], entry["in_features"],
                                             entry["tile_rows"], {
                    k: np.frombuffer(self.mm, a["dtype"], math.prod(a["shape"]), a["offset"])
                    .reshape(a["shape"]) for k, a in entry["arrays"].items()})
        lin = linear(type_id, parts)
        if self.writer is not None and isinstance(lin, TiledLinear):
            try:
                self.writer.add(name, lin)
            except (OSError, TypeError):
                self.writer.abandon()
                self.writer = None
        return lin

    def finish(self) -> None:
        """The last Linear is built: the file is complete once its writing is."""
        if self.writer is not None:
            self.writer.finish()

    def close(self) -> None:
        """Instead of finish(), when the load failed: the file is dropped."""
        if self.writer is not None:
            self.writer.abandon()

    def wait(self) -> None:
        """Until the tile file is written (or dropped)."""
        if self.writer is not None:
            self.writer.thread.join()


def cached_tiles() -> list[tuple[Path, dict]]:
    """(tile file, its source identity) for every tile file, most recently used first;
    damaged files are left out."""
    found = []
    for p in tiles_dir().glob("*.tiles") if tiles_dir().is_dir() else ():
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
            found.append((p.stat().st_mtime, p, read_index(p)[0]["source"]))
    return [(p, s) for _, p, s in sorted(found, key=lambda e: e[0], reverse=True)]


def _evict(keep: Path) -> None:
    """Keep `keep` and the KEEP - 1 most recently used other tile files whose source is
    unchanged, one per source (tiles of an older edgellama or thread count for the same
    model go); remove the rest, and temporary files left by an interrupted first load."""
    kept = 0
    sources = {p: s["path"] for p, s in cached_tiles()}
    for p, source in cached_tiles():
        try:
            st = os.stat(source["path"])
            current = (st.st_size, st.st_mtime_ns, st.st_ino) == (
                source["size"], source["mtime_ns"], source["inode"])
        except OSError:
            current = False
        if p == keep or (current and kept < KEEP - 1 and source["path"] != sources.get(keep)):
            kept += p != keep
            continue
        with contextlib.suppress(OSError):
            p.unlink()
    for p in tiles_dir().glob(f"{_TMP_PREFIX}*.tmp"):     # ours only, never a user's .tmp
        with contextlib.suppress(OSError):
            if p.stat().st_mtime < os.stat(keep).st_mtime - 3600:   # not another load's
                p.unlink()
