"""Real llama.cpp blocks: every quantized tensor of a published Q4_K_M GGUF (Gemma 3
270M, made by llama.cpp: Q4_K, Q6_K, Q5_0, Q8_0) dequantizes bit-exactly like gguf-py,
and each runtime Linear agrees with its NumPy twin on it. Downloads ~240 MB once: slow."""
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as ref_dequantize

from edgellama.formats import FORMATS, dequantize, linear
from format_cases import check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma(gemma_q4_k_m_gguf):
    return GGUFReader(str(gemma_q4_k_m_gguf))


def _matrices(reader, type_name):
    return [t for t in reader.tensors if t.tensor_type.name == type_name and len(t.shape) == 2]


def test_file_holds_the_k_quants(gemma):
    kinds = {t.tensor_type.name for t in gemma.tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= kinds


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_dequantize_bit_exact_on_every_tensor(gemma, type_name):
    if type_name not in FORMATS:
        pytest.fail(f"{type_name} is not in the format registry")
    for t in _matrices(gemma, type_name):
        data = np.asarray(t.data).reshape(int(t.shape[1]), -1)
        np.testing.assert_array_equal(dequantize(data, type_name),
                                      ref_dequantize(data, t.tensor_type).reshape(data.shape[0], -1),
                                      err_msg=t.name)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_linear_matches_numpy_twin(gemma, type_name):
    rng = np.random.default_rng(0)
    for t in _matrices(gemma, type_name)[:3]:
        out_f, in_f = int(t.shape[1]), int(t.shape[0])
        data = np.asarray(t.data).reshape(out_f, -1)
        rows = min(out_f, 4096)                      # the 262k-row embedding: a slice is enough
        data = data[:rows]
        ref = ref_dequantize(data, t.tensor_type).reshape(rows, in_f).astype(np.float64)
        lin = linear(FORMATS[type_name].type_id, [(data, (rows, in_f))])
        x = rng.standard_normal(in_f).astype(np.float32)
        out = np.empty(rows, np.float32)
        lin.matvec(x, out)                           # all four are record formats:
        check(out, ref, x, x_quantized=True)         # x rounded to int8 in decode and prefill
        xs = rng.standard_normal((5, in_f)).astype(np.float32)
        outs = np.empty((5, rows), np.float32)
        lin.matmul(xs, outs)
        check(outs, ref, xs, x_quantized=True)
        ids = np.array([0, rows - 1, rows // 2], np.int64)
        got = np.empty((3, in_f), np.float32)
        lin.rows(ids, got)
        np.testing.assert_array_equal(got, ref[ids].astype(np.float32))
