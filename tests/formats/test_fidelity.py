"""Our answers against full precision, next to an exact model of our activation rounding.

Real weights: SmolLM2's first LAYERS layers as an F32 file (the published Q4_1,
dequantized), then one file per weight type made from it by llama.cpp's own quantizer
(`llama_model_quantize`) where llama-cpp-python is installed, else by our quantizers,
which are bit-exact with ggml's, with llama.cpp's fallbacks for rows that are not whole
super-blocks.

Every matrix product of a real forward pass (prefill and token-by-token decode, each
activation mode) must equal x̂ W^T to float32 rounding, W the file's weights as gguf-py
dequantizes them and x̂ the product's input rounded exactly as our kernels are
documented to round it (test_activation_rounding's ACTIVATIONS, plus the int8 residual
where activations are fine). A path that loses precision beyond that rounding (the old
Q4_1 min term: 6x llama.cpp's KL) fails there, in the product that loses it.

At the model level the rounding is noise: a near-tie decided the other way in one layer
changes every later layer's rounding, so two equally exact runs differ in KL by some 25%
over 40 tokens of 6 layers. Our mean KL(F32 || ours) is compared with the same float64
reference run through the model of our rounding, perturbed by float32 ulps, as a band.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

import edgellama
from edgellama.formats import FORMATS, type_name
from edgellama.formats import quantize as quantize_rows
from edgellama.formats.records import RecordLinear
from edgellama.gguf import GGUFFile
from edgellama.gguf_write import GGUFStreamWriter
from edgellama.perplexity import log_softmax
from reference import reference_forward
from test_activation_rounding import ACTIVATIONS, EPS, rounded_x

LAYERS = 6
TOKENS = 40
DECODED = 8         # tokens decoded one by one where each product is checked
TEXT = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of "
        "having nothing to do: once or twice she had peeped into the book her sister was reading, "
        "but it had no pictures or conversations in it")

# llama.cpp's file types (llama-quantize's names) for each weight type under test
LLAMA_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
                "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}
# what llama.cpp's quantizer writes instead for rows that are not whole super-blocks
FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0",
            "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
RECORD_TYPES = {n for n, f in FORMATS.items() if issubclass(f.linear, RecordLinear)}

try:
    import llama_cpp
except ImportError:
    llama_cpp = None
QUANTIZER = "llama.cpp" if llama_cpp is not None else "edgellama"


def _typed(value, types):
    from gguf.constants import GGUFValueType as V
    return (V.ARRAY, value, V(types[1])) if types[0] == V.ARRAY else (V(types[0]), value)


def write_model(src: GGUFFile, dst, tensors: dict[str, tuple[int, np.ndarray]]) -> None:
    """src's metadata with block_count LAYERS and the given {name: (type id, bytes)}."""
    from gguf.constants import GGUFValueType as V
    with open(dst, "wb") as f:
        w = GGUFStreamWriter(f)
        for key, value in src.metadata.items():
            if key == "llama.block_count":
                w.kv(key, V.UINT32, LAYERS)
            elif key != "general.file_type":
                w.kv(key, *_typed(value, src.metadata_types[key]))
        for name, (tid, data) in tensors.items():
            w.tensor(name, src.tensors[name].shape, tid)
        w.write_header()
        for name, (_, data) in tensors.items():
            w.tensor_data(name, [np.ascontiguousarray(data).view(np.uint8)])


def kept(name: str) -> bool:
    return not name.startswith("blk.") or int(name.split(".")[1]) < LAYERS


@pytest.fixture(scope="module")
def f32_file(smollm2_gguf, tmp_path_factory):
    src = GGUFFile(smollm2_gguf)
    r = GGUFReader(str(smollm2_gguf))
    tensors = {t.name: (0, dequantize(t.data, t.tensor_type).astype(np.float32))
               for t in r.tensors if kept(t.name)}
    dst = tmp_path_factory.mktemp("fidelity") / "smollm2-f32.gguf"
    write_model(src, dst, tensors)
    return dst


def quantized_file(f32_path, fmt: str, tmp_path):
    dst = tmp_path / f"smollm2-{fmt}.gguf"
    if llama_cpp is not None:
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = LLAMA_FTYPES[fmt]
        p.nthread = 2
        assert llama_cpp.llama_model_quantize(str(f32_path).encode(), str(dst).encode(),
                                              ctypes.byref(p)) == 0
        return dst
    src = GGUFFile(f32_path)
    tensors = {}
    for name, t in src.tensors.items():
        x = src.tensor_bytes(name).view(np.float32).reshape(t.shape)
        if x.ndim == 1:
            tensors[name] = (0, x)
            continue
        want = "Q8_0" if name == "token_embd.weight" else fmt
        if x.shape[1] % FORMATS[want].block_size:
            want = FALLBACK[want]
        tensors[name] = (FORMATS[want].type_id, quantize_rows(x, want, name))
    write_model(src, dst, tensors)
    return dst


@functools.lru_cache(maxsize=1)   # a file's tests run one after another: read it once
def read(path):
    """meta, {name: W float64}, {name: type name} of a file, with gguf-py's reader."""
    r = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items()
            if k.startswith("llama.") or k == "general.architecture"}
    W = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
        tuple(int(d) for d in reversed(t.shape))) for t in r.tensors}
    types = {t.name: type_name(int(t.tensor_type)) for t in r.tensors}
    return meta, W, types


def rounding(types: dict[str, str], phase: int, mode: str, rng):
    """A reference product that rounds x as our kernels do in mode (phase 0 decode, 1 prefill),
    after moving x by a few float32 ulps at random (rng)."""
    def product(x, W, name):
        t = types[name]
        xf = np.asarray(x, np.float32)
        xf = xf * (1 + np.float32(3e-7) * rng.standard_normal(xf.shape).astype(np.float32))
        xh = rounded_x(xf, ACTIVATIONS.get(t, (0, 0))[phase])
        if t in RECORD_TYPES and mode == "fine":
            xh = xh + rounded_x(xf - xh.astype(np.float32), 32)
        return xh @ W[name].T
    return product


def mean_kl(ref_lp, logits) -> float:
    lp = log_softmax(np.asarray(logits, np.float64))
    return float((np.exp(ref_lp) * (ref_lp - lp)).sum(-1).mean())


@pytest.fixture(scope="module")
def quantized(f32_file, tmp_path_factory):
    """fmt -> the file of that type, quantized once for every test that reads it."""
    out_dir = tmp_path_factory.mktemp("quantized")

    @functools.cache
    def path(fmt):
        return quantized_file(f32_file, fmt, out_dir)
    return path


@pytest.fixture(scope="module")
def reference(f32_file):
    meta, W, _ = read(f32_file)
    tok = edgellama.load(f32_file, ctx=64).tokenizer
    ids = tok.encode(TEXT)[:TOKENS]
    assert len(ids) == TOKENS
    return ids, log_softmax(reference_forward(meta, W, ids))


def our_logits(path, ids, mode):
    """(decode, prefill) logits of every position."""
    m = edgellama.load(path, ctx=64, activations=mode).model
    prefill = np.array(m.forward(np.array(ids), m.new_sequence(), all_logits=True), np.float64)
    seq = m.new_sequence()
    decode = np.stack([np.array(m.forward(np.array(ids[i:i + 1]), seq), np.float64).reshape(-1)
                       for i in range(len(ids))])
    return decode, prefill


def test_our_f32_run_is_the_reference(f32_file, reference):
    ids, ref_lp = reference
    for logits in our_logits(f32_file, ids, "int8"):
        assert mean_kl(ref_lp, logits) < 1e-7


def tensor_names(model) -> dict[int, list[str]]:
    """{id(Linear): the file tensors whose rows it stacks, in order}."""
    out = {id(model.output): ["output.weight" if "output.weight" in model.gguf.tensors
                              else "token_embd.weight"]}
    for i, layer in enumerate(model.layers):
        for ws, names in ((layer.wqkv, ("attn_q", "attn_k", "attn_v")), ([layer.wo], ("attn_output",)),
                          (layer.w_gate_up, ("ffn_gate", "ffn_up")), ([layer.w_down], ("ffn_down",))):
            names = [f"blk.{i}.{n}.weight" for n in names]
            for w in ws:
                out[id(w)], names = names[:len(w.splits)], names[len(w.splits):]
    return out


def recorded_products(model):
    """Wrap every Linear of model so its products are logged as (linear, phase, x, out):
    phase 0 for matvec (decode), 1 for matmul (prefill)."""
    log, busy = [], []
    for w in set(model.linears()):
        def wrap(method, phase, w=w):
            def call(x, out, scratch=None):
                busy.append(1)
                try:
                    method(x, out, scratch)
                finally:
                    busy.pop()
                if not busy:      # not a product another one made (fine matvec -> matmul)
                    log.append((w, phase, np.atleast_2d(x).copy(), np.atleast_2d(out).copy()))
            return call
        w.matvec, w.matmul = wrap(w.matvec, 0), wrap(w.matmul, 1)
    return log


def cases(default: set[str], modes=("",)):
    """(fmt, mode) for every type and mode; those outside `default` (fmt or fmt-mode)
    marked slow (each runs real forward passes and float64 references)."""
    out = []
    for fmt in sorted(LLAMA_FTYPES):
        for mode in modes:
            key = f"{fmt}-{mode}" if mode else fmt
            marks = () if fmt in default or key in default else (pytest.mark.slow,)
            out.append(pytest.param(fmt, *([mode] if mode else []), marks=marks,
                                    id=f"{key}-{QUANTIZER}"))
    return out


# int8 on every type; the residual (fine) where it is made: the record formats. Each
# file holds several types (llama.cpp's mixes and fallbacks for rows of 576, and Q8_0
# embeddings in all): the default run takes the files that hold, between them, every type
# any of them holds (Q2_K's file: Q4_0 and Q3_K; Q4_K's: Q5_0, Q4_K, Q6_K, Q8_0; Q5_K's:
# Q5_1, Q5_K, Q6_K, Q8_0; IQ4_XS's: IQ4_NL, IQ4_XS), and Q4_K's in fine mode (the
# residual of the Q4_K, Q6_K and Q8_0 records); -m slow adds every other file and mode.
@pytest.mark.parametrize("fmt,mode", cases({"Q4_1-int8", "Q2_K-int8", "Q4_K-int8", "Q5_K-int8",
                                            "IQ4_XS-int8", "Q4_K-fine"}, ("int8", "fine")))
def test_every_product_is_exact_given_the_rounded_x(fmt, mode, quantized, reference):
    ids, _ = reference
    path = quantized(fmt)
    meta, W, types = read(path)
    m = edgellama.load(path, ctx=64, activations=mode).model
    names = tensor_names(m)
    log = recorded_products(m)
    m.forward(np.array(ids), m.new_sequence(), all_logits=True)
    seq = m.new_sequence()
    for i in range(DECODED):
        m.forward(np.array(ids[i:i + 1]), seq)
    seen = set()
    for w, phase, x, got in log:
        ws = np.concatenate([W[n] for n in names[id(w)]])
        t = types[names[id(w)][0]]
        fine = t in RECORD_TYPES and mode == "fine"
        xh = rounded_x(x, ACTIVATIONS.get(t, (0, 0))[phase])
        if fine:
            xh = xh + rounded_x(x - xh.astype(np.float32), 32)
        want = xh @ ws.T
        tol = 64 * EPS * (np.abs(xh) @ np.abs(ws).T) + 1e-30
        err = np.abs(got - want)
        assert np.all(err <= tol), (names[id(w)], t, phase, fine, float(np.max(err / tol)))
        seen.add((names[id(w)][0], phase))
    assert len(seen) == 2 * len(names)        # every matrix, in both phases


@pytest.mark.parametrize("fmt", cases({"Q4_1", "Q8_0"}))
def test_kl_is_within_the_rounding_noise(fmt, quantized, reference):
    ids, ref_lp = reference
    path = quantized(fmt)
    meta, W, types = read(path)
    for phase, logits in enumerate(our_logits(path, ids, "int8")):
        band = [mean_kl(ref_lp, reference_forward(meta, W, ids, rounding(
                    types, phase, "int8", np.random.default_rng(s)))) for s in range(3)]
        # a product that loses precision shows as a multiple of the band, not a fraction
        assert mean_kl(ref_lp, logits) <= 1.5 * max(band), (phase, mean_kl(ref_lp, logits), band)


def test_fine_activations_are_closer_on_a_high_bit_file(quantized, reference):
    """Q8_0: the int8 rounding of x is most of what separates it from full precision."""
    ids, ref_lp = reference
    path = quantized("Q8_0")
    int8, fine = (our_logits(path, ids, mode) for mode in ("int8", "fine"))
    for a, b in zip(int8, fine):
        assert mean_kl(ref_lp, b) < 0.5 * mean_kl(ref_lp, a)


def test_an_unknown_activation_mode_is_refused(f32_file):
    with pytest.raises(edgellama.EdgeError, match="activations must be one of"):
        edgellama.load(f32_file, ctx=64, activations="int4")


def test_the_command_line_knows_the_modes():
    from edgellama.cli.options import ACTIVATIONS as CLI
    from edgellama.model import ACTIVATIONS
    assert CLI == ACTIVATIONS


@pytest.mark.parametrize("argv", [["generate", "-p", "hi", "-n", "1"], ["perplexity", "-f", "text.txt"],
                                  ["chat"], ["serve"]])
def test_every_command_passes_the_mode_to_the_model(argv, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from edgellama.cli.main import main

    class Loaded(Exception):
        pass

    seen = []

    def load(path, ctx=None, threads=None, activations="int8", **kw):
        seen.append(activations)
        raise Loaded

    monkeypatch.setattr(edgellama, "load", load)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("some text")
    (tmp_path / "m.gguf").write_bytes(b"")
    res = CliRunner().invoke(main, [argv[0], "-m", "m.gguf", "--activations", "fine", *argv[1:]])
    assert seen == ["fine"] and "Loaded" in res.output, res.output
    res = CliRunner().invoke(main, [argv[0], "-m", "m.gguf", "--activations", "int4", *argv[1:]])
    assert res.exit_code == 2 and "'int4' is not one of" in res.output
