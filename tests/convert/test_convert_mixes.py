"""`convert --type <K-quant mix>`: llama.cpp's per-tensor type plan (quant/mix.py), and
files byte-identical with what llama-quantize makes from our own f32 file.

The oracle is llama-cpp-python's `llama_model_quantize` (the library behind
llama-quantize; optional: `pip install '.[oracle]'`), used two ways:
* byte comparison: our f32 file -> llama_model_quantize(mix) == our direct `convert
  --type mix`, for every mix, on a tiny Llama-3.2-shaped checkpoint (rows multiples of
  256: the pure plan) and on the SmolLM2-derived one (hidden 576: the fallbacks);
* dry runs on sparse f32 files (headers only, no data) of real model shapes, which
  print llama.cpp's choice for every tensor without quantizing anything.
The plan tables for the 1B, 3B and SmolLM2 shapes below were verified with those dry
runs; they are asserted everywhere, with or without llama-cpp-python.
"""
import ctypes
import importlib.util
import math
import re

import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T
from gguf.constants import GGUFValueType as V

import edgellama
from edgellama.cli.main import main
from edgellama.errors import EdgeError
from edgellama.gguf import GGUFFile
from edgellama.gguf_write import GGUFStreamWriter
from edgellama.quant import convert as qconvert
from edgellama.quant.convert import convert
from edgellama.quant.mix import MIXES, file_order, plan
from edgellama.sampling import SamplingParams
from hf_fixtures import gguf_to_hf_checkpoint, write_tiny_llama

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP,
                                     reason="llama-cpp-python not installed (pip install '.[oracle]')")

# name: (n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab, tied)
SHAPES = {
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 128256, True),
    "llama-3.2-3b": (28, 3072, 8192, 24, 8, 128256, True),
    "smollm2-135m": (30, 576, 1536, 9, 3, 49152, True),
    "70b-like": (80, 256, 512, 8, 1, 512, False),      # llama.cpp's "70B": 80 layers, GQA
    "untied": (6, 512, 1024, 8, 8, 512, False),
    "rows-of-40": (4, 40, 96, 2, 1, 64, True),         # not even a multiple of 32: F16
}

# Per shape and mix: "*" the type of most layer matrices, token_embd's type, and per
# kind the layers (runs) whose type differs from "*" ("all": every layer).
_1B_3B_COMMON = {
    "q5_k_s": {"*": "Q5_K", "token_embd": "Q6_K"},
    "q6_k": {"*": "Q6_K", "token_embd": "Q6_K"},
}
EXPECTED = {
    "llama-3.2-1b": {
        "q2_k": {"*": "Q2_K", "token_embd": "Q6_K", "attn_output": {"Q3_K": "all"},
                 "attn_v": {"Q4_K": "all"}, "ffn_down": {"Q3_K": "all"}},       # GQA 4: Q4_K
        "q3_k_m": {"*": "Q3_K", "token_embd": "Q6_K", "attn_output": {"Q4_K": "all"},
                   "attn_v": {"Q5_K": "0-1", "Q4_K": "2-15"}, "ffn_down": {"Q5_K": "0", "Q4_K": "1-15"}},
        "q4_k_s": {"*": "Q4_K", "token_embd": "Q6_K", "attn_v": {"Q5_K": "0-3"}, "ffn_down": {"Q5_K": "0-1"}},
        "q4_k_m": {"*": "Q4_K", "token_embd": "Q6_K", "attn_v": {"Q6_K": "0-1, 4, 7, 10, 13-15"},
                   "ffn_down": {"Q6_K": "0-1, 4, 7, 10, 13-15"}},
        "q5_k_m": {"*": "Q5_K", "token_embd": "Q6_K", "attn_v": {"Q6_K": "0-1, 4, 7, 10, 13-15"},
                   "ffn_down": {"Q6_K": "0-1, 4, 7, 10, 13-15"}},
        **_1B_3B_COMMON,
    },
    "llama-3.2-3b": {
        "q2_k": {"*": "Q2_K", "token_embd": "Q6_K", "attn_output": {"Q3_K": "all"},
                 "attn_v": {"Q3_K": "all"}, "ffn_down": {"Q3_K": "all"}},       # GQA 3: Q3_K
        "q3_k_m": {"*": "Q3_K", "token_embd": "Q6_K", "attn_output": {"Q4_K": "all"},
                   "attn_v": {"Q5_K": "0-1", "Q4_K": "2-27"}, "ffn_down": {"Q5_K": "0", "Q4_K": "1-27"}},
        "q4_k_s": {"*": "Q4_K", "token_embd": "Q6_K", "attn_v": {"Q5_K": "0-3"}, "ffn_down": {"Q5_K": "0-2"}},
        "q4_k_m": {"*": "Q4_K", "token_embd": "Q6_K", "attn_v": {"Q6_K": "0-2, 5, 8, 11, 14, 17, 20, 23-27"},
                   "ffn_down": {"Q6_K": "0-2, 5, 8, 11, 14, 17, 20, 23-27"}},
        "q5_k_m": {"*": "Q5_K", "token_embd": "Q6_K", "attn_v": {"Q6_K": "0-2, 5, 8, 11, 14, 17, 20, 23-27"},
                   "ffn_down": {"Q6_K": "0-2, 5, 8, 11, 14, 17, 20, 23-27"}},
        **_1B_3B_COMMON,
    },
    # rows of 576 fall back (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0);
    # ffn_down's rows are 1536 = 6 x 256 and keep K types; the tied embedding is Q8_0
    "smollm2-135m": {
        "q2_k": {"*": "Q4_0", "token_embd": "Q8_0", "ffn_down": {"Q3_K": "all"}},
        "q3_k_m": {"*": "Q4_0", "token_embd": "Q8_0", "attn_output": {"Q5_0": "all"},
                   "attn_v": {"Q5_1": "0-1", "Q5_0": "2-29"}, "ffn_down": {"Q5_K": "0", "Q4_K": "1-29"}},
        "q4_k_s": {"*": "Q5_0", "token_embd": "Q8_0", "attn_v": {"Q5_1": "0-3"},
                   "ffn_down": {"Q5_K": "0-2", "Q4_K": "3-29"}},
        "q4_k_m": {"*": "Q5_0", "token_embd": "Q8_0", "attn_v": {"Q8_0": "0-2, 5, 8, 11, 14, 17, 20, 23, 26-29"},
                   "ffn_down": {"Q6_K": "0-2, 5, 8, 11, 14, 17, 20, 23, 26-29",
                                "Q4_K": "3-4, 6-7, 9-10, 12-13, 15-16, 18-19, 21-22, 24-25"}},
        "q5_k_s": {"*": "Q5_1", "token_embd": "Q8_0", "ffn_down": {"Q5_K": "all"}},
        "q5_k_m": {"*": "Q5_1", "token_embd": "Q8_0", "attn_v": {"Q8_0": "0-2, 5, 8, 11, 14, 17, 20, 23, 26-29"},
                   "ffn_down": {"Q6_K": "0-2, 5, 8, 11, 14, 17, 20, 23, 26-29",
                                "Q5_K": "3-4, 6-7, 9-10, 12-13, 15-16, 18-19, 21-22, 24-25"}},
        "q6_k": {"*": "Q8_0", "token_embd": "Q8_0", "ffn_down": {"Q6_K": "all"}},
    },
}


def llama_shapes(n_layer, n_embd, n_ff, n_head, n_kv, n_vocab, tied):
    """{GGUF tensor name: NumPy shape} of a llama model (with llama3 rope_freqs)."""
    hd = n_embd // n_head
    s = {"rope_freqs.weight": (hd // 2,), "token_embd.weight": (n_vocab, n_embd), "output_norm.weight": (n_embd,)}
    if not tied:
        s["output.weight"] = (n_vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        s.update({p + "attn_norm.weight": (n_embd,), p + "ffn_norm.weight": (n_embd,),
                  p + "attn_q.weight": (n_head * hd, n_embd), p + "attn_k.weight": (n_kv * hd, n_embd),
                  p + "attn_v.weight": (n_kv * hd, n_embd), p + "attn_output.weight": (n_embd, n_head * hd),
                  p + "ffn_gate.weight": (n_ff, n_embd), p + "ffn_up.weight": (n_ff, n_embd),
                  p + "ffn_down.weight": (n_embd, n_ff)})
    return s


def _plan(shape_name, mix_name):
    n_layer, _, _, n_head, n_kv, _, _ = SHAPES[shape_name]
    return plan(mix_name, llama_shapes(*SHAPES[shape_name]), n_layer, n_head, n_kv)


def _runs(layers):
    runs = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def summarize(choices, n_layer):
    """A plan in EXPECTED's form."""
    mats = [c for c in choices if c.type != "F32"]
    kinds = [c.type for c in mats if c.name.startswith("blk.")]
    common = max(set(kinds), key=kinds.count)
    out, layers = {"*": common}, {}
    for c in mats:
        if not c.name.startswith("blk."):
            out[c.name.removesuffix(".weight")] = c.type
        elif c.type != common:
            _, i, kind, _ = c.name.split(".")
            layers.setdefault(kind, {}).setdefault(c.type, []).append(int(i))
    for kind, by_type in layers.items():
        out[kind] = {t: "all" if len(ls) == n_layer else _runs(ls) for t, ls in by_type.items()}
    return out


# --- the plan, everywhere -------------------------------------------------------------

@pytest.mark.parametrize("mix_name", list(MIXES))
@pytest.mark.parametrize("shape_name", list(EXPECTED))
def test_plan_table(shape_name, mix_name):
    choices = _plan(shape_name, mix_name)
    assert summarize(choices, SHAPES[shape_name][0]) == EXPECTED[shape_name][mix_name]
    # 1-D tensors are never quantized; every matrix is
    for c in choices:
        assert (c.type == "F32") == (c.name.endswith("norm.weight") or c.name == "rope_freqs.weight"), c


def test_plan_fallbacks_are_reported():
    by_name = {c.name: c for c in _plan("smollm2-135m", "q4_k_m")}
    assert by_name["blk.0.attn_q.weight"].wanted == "Q4_K" and by_name["blk.0.attn_q.weight"].type == "Q5_0"
    assert by_name["blk.0.attn_v.weight"].wanted == "Q6_K" and by_name["blk.0.attn_v.weight"].type == "Q8_0"
    assert by_name["blk.0.ffn_down.weight"].wanted is None          # 1536-wide rows fit Q6_K
    assert by_name["token_embd.weight"].wanted is None              # the output rule picks Q8_0 itself
    assert {c.type for c in _plan("llama-3.2-1b", "q4_k_m") if c.wanted} == set()


def test_plan_70b_and_untied_and_odd_rows():
    # llama.cpp's 70B rule: attn_v Q3_K / Q4_K -> Q5_K (the Q6_K layers of Q4_K_M stay)
    v = [c.type for c in _plan("70b-like", "q4_k_m") if c.name.endswith("attn_v.weight")]
    assert v == ["Q6_K" if i < 10 or i >= 70 or (i - 10) % 3 == 2 else "Q5_K" for i in range(80)]
    assert {c.type for c in _plan("70b-like", "q2_k") if c.name.endswith("attn_v.weight")} == {"Q5_K"}
    # untied: output.weight takes the output rule, token_embd the mix's default
    untied = {c.name: c.type for c in _plan("untied", "q4_k_m")}
    assert untied["output.weight"] == "Q6_K" and untied["token_embd.weight"] == "Q4_K"
    # rows of 40: Q8_0 (embedding), the K types' 32-block fallbacks and Q8_0 itself do not
    # fit, F16 does
    odd = {c.name: c.type for c in _plan("rows-of-40", "q4_k_m")}
    assert odd["token_embd.weight"] == "F16" and odd["blk.0.attn_q.weight"] == "F16"
    assert odd["blk.0.ffn_down.weight"] == "Q5_0" and odd["blk.3.ffn_down.weight"] == "Q8_0"   # rows of 96


def test_file_order():
    names = ["token_embd.weight", "blk.10.attn_q.weight", "blk.2.ffn_up.weight", "output.weight",
             "blk.2.attn_v.weight", "output_norm.weight", "rope_freqs.weight", "blk.0.ffn_norm.weight"]
    assert file_order(names) == ["output.weight", "output_norm.weight", "rope_freqs.weight", "token_embd.weight",
                                 "blk.0.ffn_norm.weight", "blk.2.attn_v.weight", "blk.2.ffn_up.weight",
                                 "blk.10.attn_q.weight"]


# --- llama-quantize, the oracle -------------------------------------------------------

def llama_quantize(src, dst, mix_name, embed_type=None, dry_run=False) -> str:
    """Run llama.cpp's quantizer (no importance matrix); returns its log."""
    import llama_cpp

    lines = []

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = int(MIXES[mix_name].ftype)
    p.nthread = 2
    p.dry_run = dry_run
    if embed_type:
        p.token_embedding_type = p.output_tensor_type = int(T[embed_type])
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    finally:
        from llama_cpp._logger import llama_log_callback
        llama_cpp.llama_log_set(llama_log_callback, ctypes.c_void_p(0))
    assert rc == 0, "".join(lines)[-3000:]
    return "".join(lines)


def sparse_f32_gguf(path, shape_name):
    """An f32 llama GGUF of a model shape whose data is a hole: enough for a dry run."""
    n_layer, n_embd, n_ff, n_head, n_kv, n_vocab, tied = SHAPES[shape_name]
    shapes = llama_shapes(*SHAPES[shape_name])
    with open(path, "wb") as f:
        w = GGUFStreamWriter(f)
        w.kv("general.architecture", V.STRING, "llama")
        for key, v in (("block_count", n_layer), ("context_length", 4096), ("embedding_length", n_embd),
                       ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_kv), ("vocab_size", n_vocab),
                       ("rope.dimension_count", n_embd // n_head)):
            w.kv(f"llama.{key}", V.UINT32, v)
        w.kv("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, 1e-5)
        for name, shape in shapes.items():
            w.tensor(name, shape, T.F32)
        w.write_header()
        f.truncate(f.tell() + w.data_size)


_DRY_LINE = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s+\w+, size =[^\n]*?(?:\((\w+)\))?\n")


def check_dry_runs(path, tmp_path, our_plan) -> None:
    """For every mix, llama-quantize's dry run of the F32 file at `path` gives every
    tensor the type our_plan(mix) gives it, in llama-quantize's order."""
    for mix_name in MIXES:
        log = llama_quantize(path, tmp_path / "unused.gguf", mix_name, dry_run=True)
        theirs = [(m.group(1), (m.group(2) or "f32").upper()) for m in _DRY_LINE.finditer(log)]
        assert [(c.name, c.type) for c in our_plan(mix_name)] == theirs, mix_name


@needs_llama_cpp
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_plan_is_llama_quantize_plan(tmp_path, shape_name):
    path = tmp_path / "f32.gguf"
    sparse_f32_gguf(path, shape_name)
    check_dry_runs(path, tmp_path, lambda mix_name: _plan(shape_name, mix_name))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, llama3_tokenizer_dir):
    """Llama-3.2-shaped (GQA 4, llama3 rope, tied), rows multiples of 256: the pure plan."""
    d = tmp_path_factory.mktemp("mixes")
    hf = write_tiny_llama(d / "Llama-3.2-tiny-Instruct", tokenizer_dir=llama3_tokenizer_dir, hidden=256,
                          layers=8, heads=4, kv_heads=1, ffn=512)
    convert(hf, d / "f32.gguf", qtype="f32")
    return hf, d / "f32.gguf"


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_gguf):
    """SmolLM2-135M's real weights (hidden 576: the fallbacks), as an HF checkpoint."""
    d = tmp_path_factory.mktemp("smolmixes")
    hf = gguf_to_hf_checkpoint(smollm2_gguf, d / "SmolLM2-135M-Instruct")
    convert(hf, d / "f32.gguf", qtype="f32")
    return hf, d / "f32.gguf"


def _same_file(ours, theirs):
    a, b = ours.read_bytes(), theirs.read_bytes()
    if a == b:
        return
    ra, rb = GGUFReader(ours), GGUFReader(theirs)
    assert list(ra.fields) == list(rb.fields), "keys or their order differ"
    ta = [(t.name, t.tensor_type.name, int(t.data_offset)) for t in ra.tensors]
    tb = [(t.name, t.tensor_type.name, int(t.data_offset)) for t in rb.tensors]
    assert ta == tb, "tensor names, order, types or offsets differ"
    bad = [t.name for t, u in zip(ra.tensors, rb.tensors) if bytes(t.data) != bytes(u.data)]
    assert not bad, f"tensor bytes differ: {bad[:5]}"
    first = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
    raise AssertionError(f"files differ at byte {first} (sizes {len(a)}, {len(b)})")


@needs_llama_cpp
@pytest.mark.parametrize("mix_name", list(MIXES))
def test_tiny_mix_is_llama_quantize_file(tiny, tmp_path, mix_name):
    hf, f32 = tiny
    convert(hf, tmp_path / "ours.gguf", qtype=mix_name)
    llama_quantize(f32, tmp_path / "theirs.gguf", mix_name)
    _same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")


@needs_llama_cpp
def test_embed_type_is_llama_quantize_embedding_override(tiny, tmp_path):
    # --embed-type = llama-quantize's --token-embedding-type and --output-tensor-type
    hf, f32 = tiny
    convert(hf, tmp_path / "ours.gguf", qtype="q4_k_m", embed_type="q8_0")
    llama_quantize(f32, tmp_path / "theirs.gguf", "q4_k_m", embed_type="Q8_0")
    _same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")
    types = {t.name: t.type_name for t in GGUFFile(tmp_path / "ours.gguf").tensors.values()}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_v.weight"] == "Q6_K"


@needs_llama_cpp
@pytest.mark.parametrize("mix_name", [m if m == "q4_k_m" else pytest.param(m, marks=pytest.mark.slow)
                                      for m in MIXES])
def test_smollm2_mix_is_llama_quantize_file(smol, tmp_path, mix_name):
    hf, f32 = smol
    s = convert(hf, tmp_path / "ours.gguf", qtype=mix_name)
    llama_quantize(f32, tmp_path / "theirs.gguf", mix_name)
    _same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf")
    assert any("180 of 272 tensors fell back" in w for w in s.warnings)


# --- the converter around the plan ----------------------------------------------------

def test_summary_shows_the_plan(tiny, tmp_path):
    hf, _ = tiny
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(main, ["convert", str(hf), "-o", str(out), "--type", "q4_k_m"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    head = next(line for line in lines if line.startswith("wrote"))
    # 8 layers: use_more_bits picks 0 (< 8/8), 7 (>= 7*8/8), and 3, 6 ((i - 8/8) % 3 == 2)
    rows = {line.split()[0]: line for line in lines if line.startswith("  ")}
    assert set(rows) == {"F32", "Q6_K", "Q4_K"}
    assert rows["Q6_K"].split()[1] == "9" and rows["Q6_K"].endswith("token_embd; attn_v, ffn_down (layers 0, 3, 6-7)")
    assert rows["Q4_K"].endswith("attn_k, attn_output, attn_q, ffn_gate, ffn_up; "
                                 "attn_v, ffn_down (layers 1-2, 4-5)")
    assert "6.56 bpw" in rows["Q6_K"] and "4.50 bpw" in rows["Q4_K"]
    tensors = GGUFFile(out).tensors.values()
    bits = sum(t.nbytes for t in tensors) * 8 / sum(math.prod(t.shape) for t in tensors)
    assert "(q4_k_m)" in head and f"{bits:.2f} bits/weight" in head


def test_mix_needing_an_unwritable_type_fails_before_writing(tiny, tmp_path, monkeypatch):
    hf, _ = tiny
    monkeypatch.setattr(qconvert, "WRITABLE", tuple(t for t in qconvert.WRITABLE if t != "Q6_K"))
    with pytest.raises(EdgeError, match="--type q4_k_m needs Q6_K"):
        convert(hf, tmp_path / "m.gguf", qtype="q4_k_m")
    assert list(tmp_path.iterdir()) == []


def test_smollm2_q4_k_m_chats(smol, tmp_path):
    hf, _ = smol
    out = tmp_path / "smol-q4_k_m.gguf"
    convert(hf, out, qtype="q4_k_m")
    llm = edgellama.load(out, ctx=256)
    # A question the F32 model answers with a clear margin: this checkpoint is rebuilt from
    # a Q4_1 file, and on "capital of France" its F32 first token wins by 0.1 logits only
    # (llama.cpp's own Q4_K_M, Q5_0 and Q6_K of it answer in French there, as ours does).
    ids = llm.chat.encode_messages([{"role": "user", "content": "How many days are in a week?"}])
    reply = llm.tokenizer.decode(list(llm.generate(ids, max_tokens=30, sampling=SamplingParams(temperature=0))))
    assert "7 days" in reply
