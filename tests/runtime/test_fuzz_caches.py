"""Fuzzing the readers of the caches we keep (issue 30): the tile cache's index
(tile_cache.read_index, then a model loading from what it accepted) and the compiled-
kernel cache's index and data files as Numba reads them with our repair in place. Every
mutation, seeded and deterministic, either reads as a valid entry or is refused as damaged
(a miss that is rebuilt): never another exception, never a failed load."""
from __future__ import annotations

import json
import os
import pickle
import random

import numba
import numpy as np
import pytest
from numba.core import caching

from edgellama.kernels import jit
from edgellama import tile_cache as tc
from edgellama.gguf import GGUFFile
from edgellama.model import Transformer
from tiny_gguf import write_tiny_gguf

JSON_VALUES = [None, True, 0, -1, 2 ** 64, 1.5, float("nan"), "", "u1", "O", [], [1], [-1],
               {}, {"dtype": "u1"}, [[[]]], "x" * 300]


def _mutate_json(index: dict, rng: random.Random) -> dict:
    """The index with one value somewhere in it replaced (or a key dropped or added)."""
    index = json.loads(json.dumps(index))
    node, path, depth = index, [], rng.randint(1, 5)
    while isinstance(node, dict | list) and node and len(path) < depth:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return {"linears": rng.choice(JSON_VALUES)}
    parent, key = path[-1]
    what = rng.random()
    if what < 0.15 and isinstance(parent, dict):
        del parent[key]
    elif what < 0.3 and isinstance(parent, dict):
        parent[rng.choice(["_x", "offset", "view_of", "class", "np"])] = rng.choice(JSON_VALUES)
    else:
        parent[key] = rng.choice(JSON_VALUES)
    return index


def _with_index(data: bytes, blob: bytes) -> bytes:
    off = tc._HEADER.unpack(data[:tc._HEADER.size])[1]
    return tc._HEADER.pack(tc.MAGIC, off, len(blob)) + data[tc._HEADER.size:off] + blob


def test_fuzz_tile_index(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLAMA_CACHE", str(tmp_path))
    monkeypatch.delenv("EDGELLAMA_TILE_CACHE", raising=False)
    monkeypatch.setattr(tc, "MIN_BYTES", 0)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_K", dim=256, ffn=256)
    Transformer(GGUFFile(path), 64).wait_for_tiles()
    (f,) = (tmp_path / "tiles").glob("*.tiles")
    good = f.read_bytes()
    index, _ = tc.read_index(f)
    rng = random.Random(30)
    accepted = 0
    for i in range(400):
        if i % 4 == 0:                                   # bytes anywhere
            data = bytearray(good)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        elif i % 4 == 1:                                 # cut short, or grown
            data = good[:rng.randrange(len(good))] if rng.random() < 0.7 else good + os.urandom(9)
        else:                                            # a well-formed index, wrong inside
            data = _with_index(good, json.dumps(_mutate_json(index, rng)).encode())
        f.write_bytes(data)
        try:
            tc.read_index(f)
        except ValueError:
            continue
        assert tc.cached_tiles() is not None
        accepted += 1
        if accepted <= 25:                               # what it accepts must load
            model = Transformer(GGUFFile(path), 64)
            model.wait_for_tiles()
            model.forward([1, 2], model.new_sequence())
    assert accepted < 400


def test_fuzz_kernel_cache_files(tmp_path):
    jit._repair_damaged_entries(tmp_path)               # our repair, for files under tmp_path
    stamp = ("source stamp", 1)
    key = ("(float32,)", "cpu", ("x86", "feature"))
    version = pickle.dumps(numba.__version__)
    good_index = version + pickle.dumps((stamp, {key: "f.py311.1.nbc"}))
    good_data = pickle.dumps(("a reduced", "overload", {"with": [1, 2.0, b"code"]}))
    rng = random.Random(30)
    cache = caching.IndexDataCacheFile(str(tmp_path), "f.py311", stamp)
    for i in range(600):
        which = "index" if i % 2 else "data"
        blob = bytearray(good_index if which == "index" else good_data)
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 6)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
        else:
            blob = blob[:rng.randrange(len(blob))]
        (tmp_path / "f.py311.nbi").write_bytes(bytes(blob) if which == "index" else good_index)
        (tmp_path / "f.py311.1.nbc").write_bytes(bytes(blob) if which == "data" else good_data)
        overloads = cache._load_index()
        assert isinstance(overloads, dict)
        got = cache.load(key)
        assert got is None or isinstance(got, tuple)


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_kernel_index_never_points_outside(tmp_path, seed):
    """An index naming data files outside its folder is damaged, whatever the names."""
    jit._repair_damaged_entries(tmp_path)
    stamp = ("s", seed)
    names = ["../x.nbc", "/etc/passwd", "a/b.nbc", "f.1.nbc\x00", 3, None, b"f.1.nbc"]
    cache = caching.IndexDataCacheFile(str(tmp_path), "g", stamp)
    for name in names:
        (tmp_path / "g.nbi").write_bytes(pickle.dumps(numba.__version__)
                                         + pickle.dumps((stamp, {"k": name})))
        assert cache._load_index() == {}
        assert cache.load("k") is None
    assert np.isfinite(seed)
