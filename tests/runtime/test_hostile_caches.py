"""Hostile input, round three (issue 30), the caches we keep: a damaged compiled-kernel or
tile cache repairs itself (the run succeeds, at most one line says so), and with
EDGELLAMA_CACHE naming a folder of the user's, nothing of theirs is ever removed: only
files recognisably ours (Numba's cache files in a digest folder, tile files with our magic,
our temporaries' prefix, the bench's own file names)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edgellama import benchmark
from edgellama.kernels import jit
from edgellama import tile_cache as tc
from test_tile_cache import _logits, load
from tiny_gguf import write_tiny_gguf

ENV = dict(os.environ, NUMBA_NUM_THREADS="2")
ENV.pop("NUMBA_CACHE_DIR", None)

# One small kernel, compiled (or loaded from the cache) in a fresh process.
KERNEL = """
import numpy as np, edgellama.kernels.rows as k
x = np.ones((2, 8), np.float32); out = np.empty_like(x)
k.rmsnorm(x, np.ones(8, np.float32), np.float32(1e-5), out)
print("ok", out[0, 0])
"""


def run_kernel(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True,
                          timeout=600, env={**ENV, "EDGELLAMA_CACHE": str(cache)})


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """An EDGELLAMA_CACHE holding the kernel compiled once (copied by each test)."""
    root = tmp_path_factory.mktemp("kernels")
    res = run_kernel(root)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr
    return root


def _damage(path: Path, how: str) -> None:
    import numba
    if how == "empty":                       # a power cut after the file was created
        path.write_bytes(b"")
    elif how == "random":
        path.write_bytes(np.random.default_rng(len(path.name)).bytes(300))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "wrong-shape":               # unpickles, but is not Numba's index
        stamp, _ = pickle.loads(path.read_bytes()[len(pickle.dumps(numba.__version__)):])
        path.write_bytes(pickle.dumps(numba.__version__) + pickle.dumps((stamp, ["a", "list"])))
    elif how == "outside-names":             # an index naming data files elsewhere
        stamp, overloads = pickle.loads(path.read_bytes()[len(pickle.dumps(numba.__version__)):])
        overloads = {k: "../../../victim.nbc" for k in overloads}
        path.write_bytes(pickle.dumps(numba.__version__) + pickle.dumps((stamp, overloads)))
    elif how == "directory":
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize("kind,how", [
    ("nbi", "empty"), ("nbi", "random"), ("nbi", "truncated"), ("nbi", "wrong-shape"),
    ("nbi", "outside-names"), ("nbi", "directory"),
    ("nbc", "empty"), ("nbc", "random"), ("nbc", "truncated")])
def test_a_damaged_kernel_cache_entry_is_discarded_and_rebuilt(compiled, tmp_path, kind, how):
    cache = tmp_path / "cache"
    shutil.copytree(compiled, cache, symlinks=True)
    (victim := tmp_path / "victim.nbc").write_bytes(b"the user's")
    files = sorted(cache.rglob(f"rows.rmsnorm-*.{kind}"))
    assert files
    _damage(files[0], how)
    res = run_kernel(cache)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(notes) <= 1 and "Traceback" not in res.stderr, res.stderr
    if how != "directory":
        assert len(notes) == 1 and "damaged" in notes[0] and "compiled again" in notes[0], res.stderr
        again = run_kernel(cache)                 # rebuilt: the next run is silent
        assert again.returncode == 0 and again.stderr == "", again.stderr
    assert victim.read_bytes() == b"the user's"


def test_other_kernel_versions_go_but_nothing_else_in_a_users_folder(tmp_path):
    numba_dir = tmp_path / "numba"
    keep = numba_dir / "aaaaaaaaaaaaaaaa"
    keep.mkdir(parents=True)
    stale = numba_dir / "0123456789abcdef" / "edgellama_x"     # Numba's files only: ours
    stale.mkdir(parents=True)
    (stale / "kernels.f-1.py311.nbi").write_bytes(b"i")
    (stale / "kernels.f-1.py311.1.nbc").write_bytes(b"c")
    users = numba_dir / "fedcba9876543210"                     # a digest-like name, but
    users.mkdir()                                              # with a file of the user's
    (users / "notes.txt").write_text("mine")
    (users / "k.nbi").write_bytes(b"i")
    other = numba_dir / "my-project"
    other.mkdir()
    (other / "a.nbi").write_bytes(b"user's numba cache")
    outside = tmp_path / "precious.nbc"
    outside.write_text("mine")
    linked = numba_dir / "1111111111111111"                    # a link to the user's file
    linked.mkdir()
    (linked / "x.nbc").symlink_to(outside)
    (numba_dir / "2222222222222222").symlink_to(tmp_path)       # a link to a folder
    recent = numba_dir / "3333333333333333" / "edgellama_x"      # another version, in use
    recent.mkdir(parents=True)
    (recent / "kernels.f-1.py311.nbi").write_bytes(b"i")
    long_ago = time.time() - jit.UNUSED_SECONDS - 60
    for d in (stale.parent, users, linked):
        os.utime(d, (long_ago, long_ago))
    jit._drop_other_versions(keep)
    assert not (numba_dir / "0123456789abcdef").exists()
    assert (recent / "kernels.f-1.py311.nbi").exists()
    assert (users / "notes.txt").read_text() == "mine" and (users / "k.nbi").exists()
    assert (other / "a.nbi").exists() and (linked / "x.nbc").is_symlink()
    assert outside.read_text() == "mine" and (numba_dir / "2222222222222222").is_symlink()
    assert keep.is_dir()


# -- tile cache ----------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path))
    monkeypatch.delenv("EDGELLAMA_TILE_CACHE", raising=False)
    monkeypatch.setattr(tc, "MIN_BYTES", 0)
    return tmp_path / "tiles"


def _rewrite_index(f: Path, change) -> None:
    data = bytearray(f.read_bytes())
    index, _ = tc.read_index(f)
    blob = change(index)
    if isinstance(blob, dict) and isinstance(blob.get("linears"), dict):   # signed: damage
        blob["sha256"] = tc._digest(blob)        # that the checksum alone would not catch
    blob = blob if isinstance(blob, bytes) else json.dumps(blob).encode()
    off = tc._HEADER.unpack(bytes(data[:tc._HEADER.size]))[1]
    data = data[:off] + blob
    data[:tc._HEADER.size] = tc._HEADER.pack(tc.MAGIC, off, len(blob))
    f.write_bytes(bytes(data))


def _first(index):
    return next(iter(index["linears"].values()))


def _an_array(index):
    return next(a for a in _first(index)["arrays"].values() if "offset" in a)


DAMAGE = {
    "entry-a-list": lambda ix: {**ix, "linears": {k: [] for k in ix["linears"]}},
    "array-a-list": lambda ix: (_first(ix)["arrays"].update(x=[1]), ix)[1],
    "dtype-a-list": lambda ix: (_an_array(ix).update(dtype=["u1"]), ix)[1],
    "deep-nesting": lambda ix: b"[" * 100_000 + b"]" * 100_000,
    "not-json": lambda ix: b"\xff\xfe{",
    "huge-buffer": lambda ix: (_first(ix)["arrays"].update(
        _buf={"dtype": "f4", "shape": [1 << 20, 1 << 19]}), ix)[1],
    "huge-shape": lambda ix: (_an_array(ix).update(shape=[2 ** 70]), ix)[1],
    "float-offset": lambda ix: (_an_array(ix).update(offset=float(_an_array(ix)["offset"])), ix)[1],
    "view-of-a-list": lambda ix: (_first(ix)["arrays"].update(
        v={"dtype": "u1", "shape": [1], "view_of": ["q"]}), ix)[1],
    "type-garbage": lambda ix: (_first(ix).update(type={"np": "garbage", "value": 1}), ix)[1],
    "unsigned-shape": lambda ix: json.dumps(
        (_first(ix).update(in_features=16), ix)[1]).encode(),      # checksum no longer matches
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_tile_index_is_rebuilt_and_list_still_works(cache, tmp_path, damage):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0")
    os.environ["EDGELLAMA_TILE_CACHE"] = "0"
    try:
        ref = _logits(load(path))
    finally:
        del os.environ["EDGELLAMA_TILE_CACHE"]
    load(path)
    (f,) = cache.glob("*.tiles")
    _rewrite_index(f, DAMAGE[damage])
    with pytest.raises(ValueError):
        tc.read_index(f)
    assert tc.cached_tiles() == []                      # left out, not a crash
    model = load(path)
    assert model._tiles.mm is None
    np.testing.assert_array_equal(_logits(model), ref)
    tc.read_index(f)                                    # written anew
    assert load(path)._tiles.mm is not None


def test_tile_cache_removes_only_its_own_files(cache, tmp_path):
    cache.mkdir(parents=True)
    theirs = {".notes.tmp": b"an old temporary name, but the user's", "mine.tiles": b"not ours",
              ".abcdefgh.tmp": b"x", "readme.txt": b"y"}
    for name, data in theirs.items():
        (cache / name).write_bytes(data)
        os.utime(cache / name, (0, 0))                   # old: any eviction would take them
    (cache / f"{tc._TMP_PREFIX}dead.tmp").write_bytes(b"ours, left by a killed load")
    os.utime(cache / f"{tc._TMP_PREFIX}dead.tmp", (0, 0))
    paths = [write_tiny_gguf(tmp_path / f"m{i}.gguf", "Q8_0", seed=i) for i in range(tc.KEEP + 1)]
    for p in paths:
        load(p)
    for name, data in theirs.items():
        assert (cache / name).read_bytes() == data, name
    assert not (cache / f"{tc._TMP_PREFIX}dead.tmp").exists()
    assert len(tc.cached_tiles()) == tc.KEEP


def test_bench_clean_removes_only_the_bench_files(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path))
    d = benchmark.bench_dir()
    d.mkdir()
    ours = [benchmark.shape_path("llama-3.2-1b", "Q4_0"),
            benchmark.shape_path("llama-3.2-3b", "Q8_0").with_suffix(".tmp")]
    for p in ours:
        p.write_bytes(b"GGUF")
    theirs = ["my-random-notes.txt", "llama-3.2-1b-random-q4_0.gguf.bak", "x-random-y.gguf"]
    for n in theirs:
        (d / n).write_text("the user's")
    (tmp_path / "elsewhere.gguf").write_text("the user's")
    (d / "llama-3.2-1b-random-q8_0.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    assert benchmark.bench_files() == sorted(ours)
    assert benchmark.remove_bench_files() == (2, 8)
    assert sorted(p.name for p in d.iterdir()) == sorted(theirs + ["llama-3.2-1b-random-q8_0.gguf"])
    assert (tmp_path / "elsewhere.gguf").read_text() == "the user's"
