"""The GGUF reader against gguf-py's, and against files crafted to break it."""
import struct

import numpy as np
import pytest
from gguf import GGUFReader

from edgellama.errors import EdgeError
from edgellama.gguf import GGUFFile
from tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q4_0", tied=False)


def test_reads_what_gguf_py_reads(smollm2_gguf):
    ours, theirs = GGUFFile(smollm2_gguf), GGUFReader(str(smollm2_gguf))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
        assert ours.metadata_types[key][0] == field.types[0], key
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert mine.type_id == t.tensor_type
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        assert np.array_equal(ours.tensor_bytes(t.name).reshape(-1), raw)


# -- crafted files -----------------------------------------------------------------
def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _header(n_tensors, n_kv, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv_u32(key, v):
    return _s(key) + struct.pack("<II", 4, v)


def _tensor(name, dims, type_id, offset):
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", type_id, offset)


def _file(tmp_path, body: bytes, data: bytes = b"") -> str:
    pad = (-len(body)) % 32
    p = tmp_path / "crafted.gguf"
    p.write_bytes(body + b"\0" * pad + data)
    return str(p)


CASES = {
    "not a GGUF file": lambda: b"GGML" + b"\0" * 40,
    "version 1 is not supported": lambda: _header(0, 0, version=1) + b"\0" * 16,
    "more than a": lambda: _header(1 << 60, 0) + b"\0" * 16,
    "runs past the end": lambda: _header(0, 1) + struct.pack("<Q", 1 << 40) + b"abc" + b"\0" * 20,
    "array tokens (": lambda: _header(0, 1) + _s("tokens") + struct.pack("<IIQ", 9, 8, 1 << 50) + b"\0" * 8,
    "duplicate metadata key": lambda: _header(0, 2) + _kv_u32("a", 1) + _kv_u32("a", 2),
    "unknown value type": lambda: _header(0, 1) + _s("a") + struct.pack("<II", 99, 0),
    "bool value": lambda: _header(0, 1) + _s("a") + struct.pack("<IB", 7, 2) + b"\0" * 16,
    "nested arrays": lambda: _header(0, 1) + _s("a") + struct.pack("<IIQ", 9, 9, 1) + b"\0" * 16,
    "not valid UTF-8": lambda: _header(0, 1) + struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<II", 4, 0),
    "alignment must be": lambda: _header(0, 1) + _kv_u32("general.alignment", 3),
    "dimensions (must be": lambda: _header(1, 0) + _tensor("t", [32] * 5, 0, 0),
    "dimension of size 0": lambda: _header(1, 0) + _tensor("t", [32, 0], 0, 0),
    "overflows": lambda: _header(1, 0) + _tensor("t", [1 << 32, 1 << 32, 1 << 20], 0, 0),
    "not a multiple of the Q4_0 block": lambda: _header(1, 0) + _tensor("t", [33], 2, 0),
    "unknown tensor type id": lambda: _header(1, 0) + _tensor("t", [32], 77, 0),
    "duplicate tensor name": lambda: _header(2, 0) + _tensor("t", [8], 0, 0) + _tensor("t", [8], 0, 32),
    "is not a multiple of the alignment": lambda: _header(1, 0) + _tensor("t", [8], 0, 4),
    "overlaps the previous": lambda: _header(2, 0) + _tensor("a", [16], 0, 32) + _tensor("b", [8], 0, 0),
}


@pytest.mark.parametrize("expect", list(CASES))
def test_crafted_header_is_refused_with_a_clear_error(tmp_path, expect):
    path = _file(tmp_path, CASES[expect](), data=b"\0" * 96)
    with pytest.raises(EdgeError) as e:
        GGUFFile(path)
    assert expect in str(e.value)
    assert str(e.value).startswith(path) and "\n" not in str(e.value)


def test_tensor_past_end_of_file(tmp_path):
    path = _file(tmp_path, _header(1, 0) + _tensor("t", [64], 0, 0), data=b"\0" * 100)
    with pytest.raises(EdgeError, match="runs past the end of the file"):
        GGUFFile(path)


def test_truncation_at_every_section_boundary(tiny, tmp_path):
    raw = tiny.read_bytes()
    g = GGUFFile(tiny)
    first = min(t.offset for t in g.tensors.values())
    cuts = sorted({4, 8, 16, 24, 25, first - 1, first, first + 1, len(raw) - 1}
                  | {t.offset + t.nbytes - 1 for t in g.tensors.values()})
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(raw[:cut])
        with pytest.raises(EdgeError):
            GGUFFile(p)


def test_directory_and_missing_file(tmp_path):
    with pytest.raises(EdgeError, match="is a directory"):
        GGUFFile(tmp_path)
    with pytest.raises(EdgeError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")
