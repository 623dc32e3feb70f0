"""Files made by llama.cpp's own quantizer run in edgellama: a tiny Llama-3.2-style F32
model (rows multiples of 256, so llama-quantize applies each mix's pure plan, Q6_K
embedding included) is quantized by llama_model_quantize to every mix people download;
each loads, and its prefill and token-by-token decode match the NumPy reference
forward pass on its dequantized weights. Needs llama-cpp-python (the `oracle` extra; installed on the dev and CI
machines); without it these tests skip and test_model.py covers the same types with
our own quantizers."""
import ctypes
from collections import Counter

import numpy as np
import pytest

from edgellama.gguf import GGUFFile
from edgellama.model import Transformer
from reference import load_reference, reference_forward
from tiny_gguf import write_tiny_gguf

llama_cpp = pytest.importorskip("llama_cpp")

MIXES = ["Q4_K_M", "Q4_K_S", "Q4_0", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "Q8_0"]
TOKENS = np.random.default_rng(7).integers(0, 300, 29)


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    return write_tiny_gguf(path, "F32", dim=256, heads=4, kv_heads=2, ffn=512, vocab=300,
                           layers=3, tokenizer=True)


def llama_quantize(src, dst, mix: str):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize {mix} failed"
    return dst


@pytest.mark.parametrize("mix", MIXES)
def test_llamacpp_file_loads_and_matches_reference(f32_model, mix, tmp_path):
    path = llama_quantize(f32_model, tmp_path / f"tiny-{mix}.gguf", mix)
    g = GGUFFile(path)
    types = Counter(t.type_name for t in g.tensors.values() if len(t.shape) == 2)
    m = Transformer(g, ctx=64, batch=8)
    meta, W = load_reference(path)
    ref = reference_forward(meta, W, TOKENS)
    got = m.forward(TOKENS, m.new_sequence(), all_logits=True)                   # prefill: chunks of 8
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-2, (types, err)
    m2 = Transformer(GGUFFile(path), ctx=64, batch=8)
    seq = m2.new_sequence()
    dec = np.stack([m2.forward(TOKENS[i:i + 1], seq).copy() for i in range(len(TOKENS))])
    err = np.abs(dec - ref).max() / np.abs(ref).max()               # decode: the matvec kernels
    assert err < 5e-2, (types, err)


def test_type_we_do_not_run_is_refused_with_advice(f32_model, tmp_path):
    from edgellama.errors import EdgeError
    path = llama_quantize(f32_model, tmp_path / "tiny-IQ3_S.gguf", "IQ3_S")
    with pytest.raises(EdgeError, match=r"type IQ3_S, which edgellama does not run \(it runs .*Q4_K.*\); "
                                        r"download the model as a GGUF in one of those types"):
        Transformer(GGUFFile(path), ctx=64)
