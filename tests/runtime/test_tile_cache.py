"""The on-disk tile cache (edgellama/tile_cache.py): a Linear restored from it computes
exactly what the freshly repacked one does, for every format; a model loads from it the
second time; damaged, stale or unwritable caches never break a load."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from edgellama import tile_cache as tc
from edgellama.formats import FORMATS, quantize
from edgellama.formats.base import TiledLinear
from edgellama.gguf import GGUFFile
from edgellama.model import Transformer
from tiny_gguf import write_tiny_gguf

QUANTIZED = [f for f in FORMATS.values() if f.block_size > 1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Tile files in tmp_path/tiles, for models of any size."""
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path))
    monkeypatch.delenv("EDGELLAMA_TILE_CACHE", raising=False)
    monkeypatch.setattr(tc, "MIN_BYTES", 0)
    return tmp_path / "tiles"


def _parts(fmt, rng, rows=(300, 40), n=512):
    return [(quantize(rng.standard_normal((r, n)).astype(np.float32) * 0.1, fmt.name), (r, n))
            for r in rows]


def _outputs(lin, rng):
    n = lin.in_features
    x = rng.standard_normal((5, n)).astype(np.float32)
    mv = np.empty(lin.out_features, np.float32)
    lin.matvec(x[0], mv)
    mm = np.empty((5, lin.out_features), np.float32)
    lin.matmul(x, mm)
    rows = np.empty((3, n), np.float32)
    lin.rows(np.array([0, 7, lin.out_features - 1]), rows)
    return mv, mm, rows


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_restored_linear_is_the_same_linear(fmt, cache, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"model")
    parts = _parts(fmt, np.random.default_rng(0))
    first = tc.TileCache(src, 1)
    built = first.linear("w", fmt.type_id, parts)
    assert isinstance(built, TiledLinear)
    first.finish()
    first.wait()
    again = tc.TileCache(src, 1)
    assert again.mm is not None and again.writer is None
    restored = again.linear("w", fmt.type_id, parts)
    assert type(restored) is type(built)
    for name, v in vars(built).items():          # the tiles come from the file's pages
        if isinstance(v, np.ndarray) and not name.startswith("_") and v.size:
            assert np.shares_memory(np.frombuffer(again.mm, np.uint8), getattr(restored, name))
            np.testing.assert_array_equal(getattr(restored, name), v)
    for a, b in zip(_outputs(built, np.random.default_rng(1)), _outputs(restored, np.random.default_rng(1))):
        np.testing.assert_array_equal(a, b)


def test_a_restored_linear_must_match_the_tensors(cache, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"model")
    fmt = FORMATS["Q4_0"]
    parts = _parts(fmt, np.random.default_rng(0))
    first = tc.TileCache(src, 1)
    first.linear("w", fmt.type_id, parts)
    first.finish()
    first.wait()
    again = tc.TileCache(src, 1)
    other = _parts(fmt, np.random.default_rng(0), rows=(340,))     # same bytes, one tensor
    lin = again.linear("w", fmt.type_id, other)
    assert lin.splits == [340]
    assert not np.shares_memory(np.frombuffer(again.mm, np.uint8), lin.q)


def load(path):
    """A Transformer for the GGUF at path, its tile file (if any) written."""
    model = Transformer(GGUFFile(path), 64)
    model.wait_for_tiles()
    return model


def _logits(model):
    return model.forward([1, 2, 3], model.new_sequence()).copy()


def test_model_loads_from_its_tiles_the_second_time(cache, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_K", dim=256, ffn=256)
    first = load(path)
    files = list(cache.glob("*.tiles"))
    assert len(files) == 1 and not list(cache.glob(".*"))
    second = load(path)
    mapped = np.frombuffer(second._tiles.mm, np.uint8)
    assert all(np.shares_memory(mapped, w.q) for w in second.layers[0].wqkv)
    os.environ["EDGELLAMA_TILE_CACHE"] = "0"
    try:
        plain = load(path)
    finally:
        del os.environ["EDGELLAMA_TILE_CACHE"]
    assert plain._tiles.mm is None
    ref = _logits(plain)
    np.testing.assert_array_equal(_logits(first), ref)
    np.testing.assert_array_equal(_logits(second), ref)


def test_cache_off_writes_nothing(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLAMA_TILE_CACHE", "0")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    load(path)
    assert not cache.exists() or not any(cache.iterdir())


def test_small_models_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    load(path)
    assert not (tmp_path / "tiles").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "bad offset", "bad dtype", "empty",
                                    "no splits", "unknown format", "an undeclared array",
                                    "another shape", "old format", "no version"])
def test_a_damaged_tile_file_is_rebuilt(cache, tmp_path, damage):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0")
    ref = _logits(load(path))
    (f,) = cache.glob("*.tiles")
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "garbage":
        data[:] = os.urandom(len(data))
    elif damage == "empty":
        data = b""
    else:
        index, _ = tc.read_index(f)
        entry = next(iter(index["linears"].values()))
        arr = next(a for a in entry["arrays"].values() if "offset" in a)
        if damage == "bad offset":
            arr["offset"] = len(data)
        elif damage == "bad dtype":
            arr["dtype"] = "O"
        elif damage == "no splits":
            del entry["splits"]
        elif damage == "unknown format":
            entry["type"] = "Q9_9"
        elif damage == "an undeclared array":
            entry["arrays"]["extra"] = {"dtype": "u1", "shape": [4], "offset": arr["offset"]}
        elif damage == "another shape":          # as a file of other tile heights would be
            arr["shape"] = [arr["shape"][0] * 2, arr["shape"][1] // 2]
        elif damage == "old format":             # version 1: a Linear's attributes, by name
            index = {"source": index["source"], "linears": {
                name: {"class": "BlocksLinear", "attrs": {"R": 16, "nt": 4},
                       "arrays": {"q": e["arrays"]["q"], "_x8": {"dtype": "i1", "shape": [64]}}}
                for name, e in index["linears"].items()}}
        else:
            del index["version"]
        if damage in ("another shape", "old format", "no version", "an undeclared array"):
            index["sha256"] = tc._digest(index)  # well signed: refused for what it says
        blob = __import__("json").dumps(index).encode()
        off = tc._HEADER.unpack(bytes(data[:tc._HEADER.size]))[1]
        data = data[:off] + blob
        data[:tc._HEADER.size] = tc._HEADER.pack(tc.MAGIC, off, len(blob))
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        tc.read_index(f)
    model = load(path)
    assert model._tiles.mm is None                       # not used...
    np.testing.assert_array_equal(_logits(model), ref)
    tc.read_index(f)                                     # ...and written anew
    assert load(path)._tiles.mm is not None


def test_a_changed_model_file_gets_new_tiles_and_old_ones_go(cache, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", seed=1)
    load(path)
    (old,) = cache.glob("*.tiles")
    write_tiny_gguf(path, "Q4_0", seed=2)                # rewritten in place
    os.utime(path, ns=(old.stat().st_mtime_ns + 10**9,) * 2)
    model = load(path)
    assert model._tiles.mm is None
    (new,) = cache.glob("*.tiles")
    assert new != old
    os.environ["EDGELLAMA_TILE_CACHE"] = "0"
    try:
        ref = _logits(load(path))
    finally:
        del os.environ["EDGELLAMA_TILE_CACHE"]
    np.testing.assert_array_equal(_logits(load(path)), ref)


def test_only_the_most_recently_used_are_kept(cache, tmp_path):
    paths = [write_tiny_gguf(tmp_path / f"m{i}.gguf", "Q8_0", seed=i) for i in range(tc.KEEP + 2)]
    for i, p in enumerate(paths):
        load(p)
        for j, f in enumerate(sorted(cache.glob("*.tiles"), key=lambda f: f.stat().st_mtime)):
            os.utime(f, (j, j))                         # distinct times, in load order
    kept = {s["path"] for _, s in tc.cached_tiles()}
    assert kept == {str(p.resolve()) for p in paths[-tc.KEEP:]}


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    if os.geteuid() == 0:
        (root / "tiles").write_bytes(b"")               # root ignores permissions: a file
    else:                                               # where the directory should be
        os.chmod(root, 0o500)
    monkeypatch.setenv("EDGELLAMA_CACHE", str(root))
    monkeypatch.setattr(tc, "MIN_BYTES", 0)
    try:
        model = Transformer(GGUFFile(write_tiny_gguf(tmp_path / "m.gguf", "Q4_0")), 64)
    finally:
        os.chmod(root, 0o700)
    assert model._tiles.mm is None and model._tiles.writer is None
    assert np.isfinite(_logits(model)).all()


def test_a_failed_load_leaves_no_file(cache, tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", layers=3)
    real = Transformer._stacked

    def fail_late(self, *names):
        if names[0].startswith("blk.2."):
            raise RuntimeError("interrupted")
        return real(self, *names)
    monkeypatch.setattr(Transformer, "_stacked", fail_late)
    with pytest.raises(RuntimeError):
        Transformer(GGUFFile(path), 64)
    for t in threading.enumerate():                     # the writer drops the file
        if t.name == "tile-cache":
            t.join()
    assert not cache.exists() or not any(cache.iterdir())


def test_list_shows_tiles_and_rm_of_a_model_takes_its_tiles(cache, tmp_path):
    import shutil
    import subprocess
    root = cache.parent
    models = [write_tiny_gguf(root / f"m{i}.gguf", "Q4_0", seed=i) for i in range(2)]
    for p in models:
        load(p)
    env = {**os.environ, "EDGELLAMA_CACHE": str(root), "HF_HOME": str(tmp_path / "hf")}
    cli = [shutil.which("edgellama")]

    def listed():
        out = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, check=True).stdout
        return [ln.split(None, 1)[0] + " " + ln.rsplit("  ", 1)[1] for ln in out.splitlines()[1:]]
    tiles = {s["path"]: p.name for p, s in tc.cached_tiles()}
    t0, t1 = (tiles[str(p.resolve())] for p in models)
    assert sorted(listed()) == sorted(["m0.gguf gguf", "m1.gguf gguf", f"tiles/{t0} start-up tiles of m0.gguf",
                                       f"tiles/{t1} start-up tiles of m1.gguf"])
    subprocess.run([*cli, "rm", "-y", "m0.gguf", f"tiles/{t1}"], env=env, check=True, capture_output=True)
    assert listed() == ["m1.gguf gguf"]


def test_new_tiles_of_a_model_replace_its_older_ones(cache, tmp_path, monkeypatch):
    # another layout digest (an upgrade) or thread count: a new key for the same file
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0")
    load(path)
    (old,) = cache.glob("*.tiles")
    monkeypatch.setattr(tc.numba.config, "NUMBA_NUM_THREADS", tc.numba.config.NUMBA_NUM_THREADS + 1)
    assert load(path)._tiles.mm is None
    (new,) = cache.glob("*.tiles")
    assert new != old
