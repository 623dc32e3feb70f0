"""`edgellama convert`: tiny random Llama 3.2-shaped checkpoints and real SmolLM2 weights,
read back with gguf-py's GGUFReader; error cases through the real CLI."""
import json
import math
import shutil
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from gguf.constants import GGUFValueType as V
from gguf.quants import dequantize

from edgellama.errors import EdgeError
from hf_fixtures import LLAMA3_SCALING, gguf_to_hf_checkpoint, write_safetensors, write_tiny_llama
from edgellama.quant.convert import convert
from edgellama.quant.hf import open_checkpoint
from edgellama.quant.hf_tokenizer import load_tokenizer, merges_from_ranks, tiktoken_ranks

FORMAT_OF = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "f16": "F16", "bf16": "BF16", "f32": "F32"}
FILE_TYPE = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "f16": 1, "bf16": 32, "f32": 0}


def _fields(path):
    r = GGUFReader(path)
    kv = {k: (f.types[0], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return r, kv


def _hf_weights(hf_dir):
    tensors, shards = open_checkpoint(hf_dir)
    out = {n: t.rows(0, t.shape[0] if len(t.shape) > 1 else 1).reshape(t.shape) for n, t in tensors.items()}
    for s in shards:
        s.close()
    return out


def _tensor(r, name):
    t = next(t for t in r.tensors if t.name == name)
    shape = tuple(reversed([int(s) for s in t.shape]))
    return t, np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def _bound(x, fmt):
    """Largest allowed |dequant - x| per element for format fmt (per 32-block for quants)."""
    if fmt in ("F32", "BF16"):
        return np.zeros_like(x)             # the source is bf16: both hold it exactly
    if fmt == "F16":
        return np.abs(x) * 2.0 ** -11 + 2.0 ** -24
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    spread = b.max(axis=1, keepdims=True) - b.min(axis=1, keepdims=True)
    per = {"Q8_0": amax / 127 * 0.5 * 1.01, "Q4_0": amax / 8 * 1.01, "Q4_1": spread / 15 * 0.5 * 1.01}[fmt]
    per = per + amax * 2.0 ** -10           # the fp16 scale is itself rounded
    return np.broadcast_to(per, b.shape).reshape(x.shape)


def _unpermute(w, heads):
    hd = w.shape[0] // heads
    return w.reshape(heads, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, llama3_tokenizer_dir):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "Llama-3.2-tiny-Instruct",
                            tokenizer_dir=llama3_tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_weights(tiny):
    return _hf_weights(tiny)


@pytest.fixture(scope="module")
def llama3_tokenizer_json(llama3_tokenizer_dir):
    return json.loads((llama3_tokenizer_dir / "tokenizer.json").read_text())


# Reading a converted file back (gguf-py's reader, its 128256 tokens and merges one by
# one) costs most of each case. By default: bf16 (no other test writes it) and q4_0 (a
# Q8_0 embedding under 4-bit layers); under -m slow the others, each written and
# checked elsewhere: q4_1 (test_smollm2_roundtrip: the original file's types), q8_0
# (test_input_dtypes_sharded_untied), f16 (test_embed_type_option), f32
# (test_permutation_is_the_documented_row_order: values exact).
@pytest.mark.parametrize("qtype", [q if q in ("bf16", "q4_0") else pytest.param(q, marks=pytest.mark.slow)
                                   for q in FORMAT_OF])
def test_convert_every_type(tiny, tiny_weights, llama3_tokenizer_json, tmp_path, qtype):
    out = tmp_path / "m.gguf"
    s = convert(tiny, out, qtype=qtype)
    r, kv = _fields(out)
    embed_fmt = "Q8_0" if qtype in ("q4_0", "q4_1") else FORMAT_OF[qtype]
    expected = {
        "general.architecture": (V.STRING, "llama"), "general.type": (V.STRING, "model"),
        "general.name": (V.STRING, "Llama-3.2-tiny-Instruct"),
        "llama.block_count": (V.UINT32, 2), "llama.context_length": (V.UINT32, 131072),
        "llama.embedding_length": (V.UINT32, 64), "llama.feed_forward_length": (V.UINT32, 128),
        "llama.attention.head_count": (V.UINT32, 4), "llama.attention.head_count_kv": (V.UINT32, 2),
        "llama.rope.freq_base": (V.FLOAT32, 500000.0),
        "llama.attention.layer_norm_rms_epsilon": (V.FLOAT32, np.float32(1e-5)),
        "llama.attention.key_length": (V.UINT32, 16), "llama.attention.value_length": (V.UINT32, 16),
        "general.file_type": (V.UINT32, FILE_TYPE[qtype]), "llama.vocab_size": (V.UINT32, 128256),
        "llama.rope.dimension_count": (V.UINT32, 16), "tokenizer.ggml.model": (V.STRING, "gpt2"),
        "tokenizer.ggml.pre": (V.STRING, "llama-bpe"), "tokenizer.ggml.bos_token_id": (V.UINT32, 128000),
        "tokenizer.ggml.eos_token_id": (V.UINT32, 128009),
        "tokenizer.ggml.padding_token_id": (V.UINT32, 128004),
        "tokenizer.ggml.add_bos_token": (V.BOOL, True),
        "tokenizer.chat_template": (V.STRING, json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]),
        "general.quantization_version": (V.UINT32, 2),
        # generation_config.json's recommendation, as llama.cpp writes it
        "general.sampling.temp": (V.FLOAT32, pytest.approx(0.6)),
        "general.sampling.top_p": (V.FLOAT32, pytest.approx(0.9)),
    }
    arrays = {"tokenizer.ggml.tokens": V.ARRAY, "tokenizer.ggml.token_type": V.ARRAY,
              "tokenizer.ggml.merges": V.ARRAY}
    assert set(kv) == set(expected) | set(arrays)
    for k, (vtype, value) in expected.items():
        assert kv[k][0] == vtype, k
        assert kv[k][1] == value, k
    assert not any("rope.scaling" in k for k in kv)
    assert r.fields["tokenizer.ggml.token_type"].types == [V.ARRAY, V.INT32]
    assert r.fields["tokenizer.ggml.tokens"].types == [V.ARRAY, V.STRING]

    # tokenizer: vocab + added tokens (the out-of-range <|image|> dropped), merges in order
    tokens, types = kv["tokenizer.ggml.tokens"][1], kv["tokenizer.ggml.token_type"][1]
    assert len(tokens) == len(types) == 128256
    vocab = llama3_tokenizer_json["model"]["vocab"]
    assert tokens[:128000] == sorted(vocab, key=vocab.get)
    assert tokens[128000] == "<|begin_of_text|>" and tokens[128009] == "<|eot_id|>"
    assert types[:128000] == [1] * 128000 and types[128000:] == [3] * 256
    assert "<|image|>" not in tokens[128000:]
    assert kv["tokenizer.ggml.merges"][1] == llama3_tokenizer_json["model"]["merges"]
    assert any("<|image|>" in w and "dropped" in w for w in s.warnings)

    # tensors: names, shapes, types; no output.weight when tied
    names = [t.name for t in r.tensors]
    assert names[0] == "rope_freqs.weight" and "output.weight" not in names
    assert len(names) == 1 + 2 + 2 * 9 == len(s.tensors)
    for t in r.tensors:
        fmt = t.tensor_type.name
        if len(t.shape) == 1:
            assert fmt == "F32", t.name
        elif t.name == "token_embd.weight":
            assert fmt == embed_fmt and list(t.shape) == [64, 128256]
        else:
            assert fmt == FORMAT_OF[qtype], t.name
    assert s.type_counts[FORMAT_OF[qtype]] >= 14
    # bits per weight count tensor data only, not the 128k-token vocabulary
    assert s.bits_per_weight == pytest.approx(sum(int(t.n_bytes) for t in r.tensors) * 8 / s.n_params)

    # rope_freqs from the llama3 rope-scaling formula
    _, rf = _tensor(r, "rope_freqs.weight")
    sc = LLAMA3_SCALING
    want = []
    for i in range(8):
        wl = 2 * math.pi / 500000.0 ** (-2 * i / 16)
        if wl < sc["original_max_position_embeddings"] / sc["high_freq_factor"]:
            want.append(1.0)
        elif wl > sc["original_max_position_embeddings"] / sc["low_freq_factor"]:
            want.append(sc["factor"])
        else:
            sm = (sc["original_max_position_embeddings"] / wl - 1) / (4 - 1)
            want.append(1 / ((1 - sm) / sc["factor"] + sm))
    np.testing.assert_allclose(rf, want, rtol=1e-6)
    assert rf[0] == 1.0 and rf[-1] == 32.0

    # weights: each within its format's error; Q/K un-permute back to the HF rows
    hf_of = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(2):
        for g, h, heads in (("attn_q", "self_attn.q_proj", 4), ("attn_k", "self_attn.k_proj", 2),
                            ("attn_v", "self_attn.v_proj", 0), ("attn_output", "self_attn.o_proj", 0),
                            ("ffn_gate", "mlp.gate_proj", 0), ("ffn_up", "mlp.up_proj", 0),
                            ("ffn_down", "mlp.down_proj", 0), ("attn_norm", "input_layernorm", 0),
                            ("ffn_norm", "post_attention_layernorm", 0)):
            hf_of[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{h}.weight", heads)
    for name, src in hf_of.items():
        src, heads = src if isinstance(src, tuple) else (src, 0)
        t, got = _tensor(r, name)
        if heads:
            got = _unpermute(got, heads)
        ref = tiny_weights[src]
        assert got.shape == ref.shape, name
        err = np.abs(got - ref)
        assert (err <= _bound(ref, t.tensor_type.name)).all(), (name, float(err.max()))


def test_permutation_is_the_documented_row_order(tiny, tiny_weights, tmp_path):
    # f32 output keeps values exactly: row 2j+c of head h == HF row h*hd + c*hd/2 + j
    convert(tiny, tmp_path / "m.gguf", qtype="f32")
    r, _ = _fields(tmp_path / "m.gguf")
    _, q = _tensor(r, "blk.1.attn_q.weight")
    src = tiny_weights["model.layers.1.self_attn.q_proj.weight"]
    hd = 16
    for h in range(4):
        for j in range(hd // 2):
            for c in range(2):
                np.testing.assert_array_equal(q[h * hd + 2 * j + c], src[h * hd + c * hd // 2 + j])
    _, v = _tensor(r, "blk.1.attn_v.weight")
    np.testing.assert_array_equal(v, tiny_weights["model.layers.1.self_attn.v_proj.weight"])


# bf16 input, untied, in shards: what the other two and test_convert_every_type (bf16
# checkpoints) take by default; under -m slow
@pytest.mark.parametrize("dtype,shards,tied", [("f16", 1, False), ("f32", 3, True),
                                               pytest.param("bf16", 2, False, marks=pytest.mark.slow)])
def test_input_dtypes_sharded_untied(tmp_path, llama3_tokenizer_dir, dtype, shards, tied):
    hf = write_tiny_llama(tmp_path / "hf", tokenizer_dir=llama3_tokenizer_dir, dtype=dtype, shards=shards,
                          tied=tied, instruct=False, rope_scaling=None, hidden=32, heads=2, kv_heads=1,
                          layers=1, ffn=64, seed=3)
    assert (hf / "model.safetensors.index.json").is_file() == (shards > 1)
    s = convert(hf, tmp_path / "m.gguf", qtype="q8_0")
    r, kv = _fields(tmp_path / "m.gguf")
    names = [t.name for t in r.tensors]
    assert ("output.weight" in names) == (not tied)
    assert "rope_freqs.weight" not in names
    assert kv["tokenizer.ggml.eos_token_id"][1] == 128001          # base model
    assert "tokenizer.chat_template" not in kv
    ref = _hf_weights(hf)
    pairs = [("token_embd.weight", "model.embed_tokens.weight"),
             ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight")]
    if not tied:
        pairs.append(("output.weight", "lm_head.weight"))
    for g, h in pairs:
        t, got = _tensor(r, g)
        assert t.tensor_type.name == "Q8_0"
        assert (np.abs(got - ref[h]) <= _bound(ref[h], "Q8_0")).all(), g
    assert s.n_params == sum(int(np.prod(x.shape)) for x in ref.values())


def test_embed_type_option(tiny, tmp_path):
    s = convert(tiny, tmp_path / "m.gguf", qtype="q4_1", embed_type="q4_0")
    fmts = {n: f for n, f, _ in s.tensors}
    assert fmts["token_embd.weight"] == "Q4_0" and fmts["blk.0.attn_q.weight"] == "Q4_1"
    s = convert(tiny, tmp_path / "m2.gguf", qtype="f16")
    assert {n: f for n, f, _ in s.tensors}["token_embd.weight"] == "F16"


def test_tiktoken_only_tokenizer(tmp_path, llama3_tokenizer_dir, llama3_tokenizer_json):
    ranks = tiktoken_ranks(llama3_tokenizer_dir / "tokenizer.model")
    assert merges_from_ranks(ranks) == llama3_tokenizer_json["model"]["merges"]
    hf = write_tiny_llama(tmp_path / "hf", tokenizer_dir=llama3_tokenizer_dir, tokenizer="tiktoken",
                          hidden=32, heads=2, kv_heads=1, layers=1, ffn=64)
    assert not (hf / "tokenizer.json").exists()
    cfg = json.loads((hf / "config.json").read_text())
    from_model = load_tokenizer(hf, 128256, cfg)
    shutil.copy(llama3_tokenizer_dir / "tokenizer.json", hf)
    from_json = load_tokenizer(hf, 128256, cfg)
    assert from_model.tokens == from_json.tokens
    assert from_model.token_types == from_json.token_types
    assert from_model.merges == from_json.merges
    assert from_model.special_ids == from_json.special_ids == {"bos": 128000, "eos": 128009, "pad": 128004}
    assert from_model.pre == from_json.pre == "llama-bpe"
    (hf / "tokenizer.json").unlink()
    s = convert(hf, tmp_path / "tk.gguf", qtype="q8_0")
    assert s.file_size == (tmp_path / "tk.gguf").stat().st_size


# ---- errors through the real CLI: exit 1, one line, no traceback, nothing left behind ----

def _run_cli(args):
    from edgellama.cli.main import main
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def _assert_one_line_error(res, out_dir, *needles):
    assert res.exit_code == 1, (res.exit_code, res.output)
    text = res.stderr.strip()
    assert len(text.splitlines()) == 1, text
    assert "Traceback" not in res.output and text.startswith("error: ")
    for n in needles:
        assert n in text, (n, text)
    assert not [p for p in out_dir.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture()
def small(tmp_path, llama3_tokenizer_dir):
    return write_tiny_llama(tmp_path / "hf", tokenizer_dir=llama3_tokenizer_dir, hidden=32, heads=2,
                            kv_heads=1, layers=1, ffn=64, vocab=128256)


def _edit_config(hf, **changes):
    cfg = json.loads((hf / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (hf / "config.json").write_text(json.dumps(cfg))


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def test_existing_output_not_overwritten(small, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    res = _run_cli([small, "-o", out])
    _assert_one_line_error(res, tmp_path, "already exists", "--force")
    assert out.read_bytes() == b"keep me"
    res = _run_cli([small, "-o", out, "--force", "--quiet"])
    assert res.exit_code == 0 and res.output == ""
    assert out.read_bytes()[:4] == b"GGUF"


def test_cli_summary(small, tmp_path):
    res = _run_cli([small, "-o", tmp_path / "m.gguf", "--type", "q4_0"])
    assert res.exit_code == 0, res.output
    assert "bits/weight" in res.stdout and "Q8_0" in res.stdout and "Q4_0" in res.stdout
    assert "<|image|>" in res.stderr                        # the dropped-token warning


BAD_INPUTS = {
    "missing_key": (lambda hf: _edit_config(hf, hidden_size=None), ["config.json", "hidden_size"]),
    "bad_key": (lambda hf: _edit_config(hf, num_hidden_layers="2"), ["config.json", "num_hidden_layers"]),
    "arch": (lambda hf: _edit_config(hf, architectures=["MistralForCausalLM"]),
             ["unsupported architecture", "LlamaForCausalLM"]),
    "bad_json": (lambda hf: (hf / "config.json").write_text("{nope"), ["config.json", "not valid JSON"]),
    "shape": (lambda hf: _edit_config(hf, intermediate_size=96), ["model.safetensors", "mlp", "shape"]),
    "truncated": (lambda hf: (hf / "model.safetensors").write_bytes(
        (hf / "model.safetensors").read_bytes()[:-100]), ["model.safetensors", "truncated"]),
    "header_len": (lambda hf: (hf / "model.safetensors").write_bytes(
        struct.pack("<Q", 1 << 40) + (hf / "model.safetensors").read_bytes()[8:]),
        ["model.safetensors", "header length"]),
    "dtype": (lambda hf: _rewrite_header(hf / "model.safetensors", lambda h: h["model.norm.weight"].update(
        dtype="I64")), ["model.safetensors", "dtype", "I64"]),
    "shape_bytes": (lambda hf: _rewrite_header(hf / "model.safetensors", lambda h: h["model.norm.weight"].update(
        shape=[33])), ["model.safetensors", "model.norm.weight", "bytes"]),
    "overlap": (lambda hf: _rewrite_header(hf / "model.safetensors", lambda h: h["model.norm.weight"].update(
        data_offsets=[0, 64])), ["model.safetensors", "overlap"]),
    "pickle": (lambda hf: ((hf / "model.safetensors").unlink(), (hf / "pytorch_model.bin").write_bytes(b"\x80\x04")),
               ["pytorch_model.bin", "pickle", "arbitrary code", "safetensors"]),
    "no_tokenizer": (lambda hf: (hf / "tokenizer.json").unlink(), ["missing tokenizer"]),
    "nan": (lambda hf: write_safetensors(hf / "model.safetensors", {
        **_hf_weights(hf), "model.layers.0.mlp.up_proj.weight": np.full((64, 32), np.nan)}, "bf16"),
        ["blk.0.ffn_up.weight", "NaN"]),
    "overflow": (lambda hf: write_safetensors(hf / "model.safetensors", {
        **_hf_weights(hf), "model.layers.0.mlp.up_proj.weight": np.full((64, 32), 1e30)}, "bf16"),
        ["blk.0.ffn_up.weight", "too large"]),
    "extra_tensor": (lambda hf: write_safetensors(hf / "model.safetensors", {
        **_hf_weights(hf), "model.layers.0.self_attn.q_proj.bias": np.zeros(32)}, "bf16"),
        ["q_proj.bias", "unexpected"]),
    "rope": (lambda hf: _edit_config(hf, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
             ["rope_scaling", "yarn"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_error(small, tmp_path, case):
    break_it, needles = BAD_INPUTS[case]
    break_it(small)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = _run_cli([small, "-o", out_dir / "m.gguf", "--type", "q4_0"])
    _assert_one_line_error(res, out_dir, *needles)
    assert not (out_dir / "m.gguf").exists()


def test_interrupt_removes_temp_file(small, tmp_path):
    def stop(name, done, total):
        if name.startswith("blk.0"):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        convert(small, tmp_path / "m.gguf", progress=stop)
    assert list(tmp_path.iterdir()) == [small]


def test_api_errors_are_edge_errors(small, tmp_path):
    with pytest.raises(EdgeError, match="unknown type"):
        convert(small, tmp_path / "m.gguf", qtype="q5_k")
    with pytest.raises(EdgeError, match="not a directory"):
        convert(tmp_path / "nope", tmp_path / "m.gguf")


# ---- real weights: SmolLM2-135M GGUF -> HF checkpoint -> GGUF ----

@pytest.fixture(scope="module")
def smol_hf(smollm2_gguf, tmp_path_factory):
    return gguf_to_hf_checkpoint(smollm2_gguf, tmp_path_factory.mktemp("smol") / "SmolLM2-135M-Instruct")


# q8_0 under -m slow: the same checks as q4_1's on the real weights, and Q8_0's error
# bound is checked by test_input_dtypes_sharded_untied
@pytest.mark.parametrize("qtype", [pytest.param("q8_0", marks=pytest.mark.slow), "q4_1"])
def test_smollm2_roundtrip(smollm2_gguf, smol_hf, tmp_path, qtype):
    out = tmp_path / "m.gguf"
    convert(smol_hf, out, qtype=qtype)
    orig, okv = _fields(smollm2_gguf)
    new, nkv = _fields(out)
    for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
              "llama.block_count", "llama.context_length", "llama.embedding_length",
              "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
              "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size",
              "llama.rope.dimension_count", "general.quantization_version"):
        assert nkv[k] == okv[k], k
    if qtype == "q4_1":
        assert nkv["general.file_type"] == okv["general.file_type"]
    otypes = {t.name: t.tensor_type.name for t in orig.tensors}
    ntypes = {t.name: t.tensor_type.name for t in new.tensors}
    assert set(otypes) == set(ntypes)
    if qtype == "q4_1":
        assert ntypes == otypes                   # the original's mix: Q8_0 embeddings, Q4_1, F32 norms
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.ffn_down.weight",
                 "blk.7.attn_norm.weight"):
        _, a = _tensor(orig, name)
        t, b = _tensor(new, name)
        # the original values went through bf16, then through this file's format
        bf16_err = np.abs(a) * 2.0 ** -8
        assert (np.abs(b - a) <= _bound(a, t.tensor_type.name) + bf16_err + 1e-7).all(), name
