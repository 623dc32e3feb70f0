"""The KV cache's types end to end: memory arithmetic, the save/load/shift contract for
every type, sequences of different types in one model, the options that choose them,
and the advice when a context does not fit."""
import json
import re

import numba
import numpy as np
import pytest
from click.testing import CliRunner
from edgellama.cli.main import main
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

import edgellama
import edgellama.benchmark as B
import edgellama.model as M
from edgellama.kernels import attention as A
from edgellama.args import ModelArgs
from edgellama.errors import EdgeError
from edgellama.gguf import GGUFFile
from edgellama.kernels.rows import rope
from edgellama.kv_cache import CACHE_TYPES, KVCache, fit_advice, longest_context
from test_attention import DEFAULT_PAIRS, Args

rng = np.random.default_rng(1)
PAIRS = [(k, v) for k in CACHE_TYPES for v in CACHE_TYPES]


def llama_3b_args():
    s = B.SHAPES["llama-3.2-3b"]
    return ModelArgs(dim=s.dim, n_layers=s.layers, n_heads=s.heads, n_kv_heads=s.kv_heads,
                     ffn_dim=s.ffn, vocab_size=s.vocab, norm_eps=1e-5, rope_theta=s.theta,
                     rope_dim=s.dim // s.heads, train_ctx=s.train_ctx, tied_output=True)


def test_bytes_per_token_and_the_3b_window():
    a = llama_3b_args()
    # 28 layers x 8 kv heads x 128 dims: f16 2 bytes a value, q8_0 34 and q4_0 18 per 32
    assert KVCache.bytes_per_token(a) == 112 * 1024
    assert KVCache.bytes_per_token(a, "q8_0", "q8_0") == 28 * 8 * 2 * 4 * 34
    assert KVCache.bytes_per_token(a, "q4_0", "q4_0") == 28 * 8 * 2 * 4 * 18
    assert KVCache.bytes_per_token(a, "q8_0", "q4_0") == 28 * 8 * 4 * (34 + 18)
    # the whole 131072 window: 14 GiB f16, under 4 GiB q4_0
    assert KVCache.bytes_needed(a, 131072) == 14 * 2 ** 30
    assert KVCache.bytes_needed(a, 131072, "q4_0", "q4_0") < 3.95 * 2 ** 30
    assert longest_context(a, 4 * 2 ** 30, "q4_0", "q4_0") >= 131072


@pytest.mark.parametrize("type_k,type_v", PAIRS)
def test_nbytes_is_the_arithmetic(type_k, type_v):
    a = Args(3, 2, 64)
    c = KVCache(a, 48, type_k, type_v)
    assert c.nbytes == KVCache.bytes_needed(a, 48, type_k, type_v)
    json.dumps(c.layout())


def _filled(type_k, type_v, n, ctx=80, rotate=True):
    a = Args(2, 2, 64, heads=4)
    c = KVCache(a, ctx, type_k, type_v, rotate=rotate)
    k, v = rng.standard_normal((2, 2, n, 2, 64)).astype(np.float32)
    for layer in range(2):
        c.write(layer, 0, k[layer].copy(), v[layer].copy())
    c.length = n
    return c, k, v


def _attend(c, layer, q):
    out = np.empty_like(q)
    c.attend(layer, c.length - len(q), q.copy(), np.float32(0.125), out,
             tuple(np.zeros(s, d) for s, d in A.attention_scratch_shapes(numba.config.NUMBA_NUM_THREADS, 4, 2, 64)))
    return out


# Its attention compiles a kernel per type pair, as test_attention's: the pairs it keeps
# by default save and load every K type and every V type; the others under -m slow.
@pytest.mark.parametrize("type_k,type_v", [p if p in DEFAULT_PAIRS else pytest.param(*p, marks=pytest.mark.slow)
                                           for p in PAIRS])
def test_state_round_trip(type_k, type_v):
    c, _, _ = _filled(type_k, type_v, 37)
    lay, st = c.layout(), c.state(37)
    assert lay["k_type"] == type_k and lay["v_type"] == type_v and set(st) == set(lay["arrays"])
    for name, arr in st.items():
        spec = lay["arrays"][name]
        assert arr.dtype.str == spec["dtype"] and arr.shape[:2] == tuple(spec["shape"][:2])
        assert arr.shape[spec["axis"]] == -(-37 // spec["per_index"])
    d = KVCache(Args(2, 2, 64, heads=4), 80, type_k, type_v)
    d.load_state({n: a.copy() for n, a in st.items()}, 37)
    assert d.length == 37
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    for layer in range(2):
        np.testing.assert_array_equal(_attend(c, layer, q), _attend(d, layer, q))


def _rope_by(k, delta, inv_freq):
    ang = float(delta) * inv_freq
    cos, sin = (np.repeat(f(ang).astype(np.float32)[None], len(k), 0) for f in (np.cos, np.sin))
    k = k.copy()
    rope(k, cos, sin)
    return k


# Moving a key rounds it again: f16 once more by half an ulp; q8_0 and q4_0 by half a step
# (1/254, 1/16 of a block's amax), plus the first rounding carried through RoPE.
SHIFT_TOL = {"f16": 2e-3, "q8_0": 3 * 4 / 254, "q4_0": 3 * 4 / 16}


@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q8_0"),
                                           ("f16", "q4_0")])
def test_shift_moves_v_exactly_and_turns_k_back(type_k, type_v):
    keep, drop, n = 5, 19, 61
    c, k, v = _filled(type_k, type_v, n, rotate=False)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype(np.float64)
    before_v = c.v_values(1, keep + drop, n)
    before_k = c.k_values(1, keep + drop, n)
    kept = c.k_values(1, 0, keep), c.v_values(1, 0, keep)
    c.shift(keep, drop, inv_freq)
    assert c.length == n - drop
    np.testing.assert_array_equal(c.v_values(1, keep, n - drop), before_v)
    want = _rope_by(before_k, -drop, inv_freq)
    got = c.k_values(1, keep, n - drop)
    assert np.abs(got - want).max() < SHIFT_TOL[type_k] * np.abs(want).max()
    np.testing.assert_array_equal(c.k_values(1, 0, keep), kept[0])     # untouched
    np.testing.assert_array_equal(c.v_values(1, 0, keep), kept[1])


def test_shift_of_a_rotated_cache_matches_unrotated():
    keep, drop, n = 3, 20, 50
    inv_freq = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype(np.float64)
    c, k, _ = _filled("q8_0", "q8_0", n, rotate=True)
    c.shift(keep, drop, inv_freq)
    got = c.k_values(0, keep, n - drop)
    A.hadamard(got, c.rot_k)                      # stored rotated: back to RoPE'd keys
    want = _rope_by(k[0, keep + drop:n], -drop, inv_freq)
    assert np.abs(got - want).max() < SHIFT_TOL["q8_0"] * np.abs(want).max()


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    # head dim 32: every cache type
    return write_tiny_gguf(tmp_path_factory.mktemp("kv") / "m.gguf", "Q8_0", dim=128, heads=4,
                           kv_heads=2, ffn=96, vocab=TINY_VOCAB, tokenizer=True)


def _kl(p_logits, q_logits):
    # mean KL(p || q) over the rows, from log-softmaxes
    lp, lq = (x.astype(np.float64) - x.max(-1, keepdims=True) for x in (p_logits, q_logits))
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def test_sequences_of_different_types_in_one_model(tiny32):
    m = M.Transformer(GGUFFile(tiny32), ctx=64, batch=16)
    toks = rng.integers(0, 256, 40)
    ref = m.forward(toks, m.new_sequence(), all_logits=True)
    kls = {}
    for tk, tv in [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")]:
        seq = m.new_sequence(type_k=tk, type_v=tv)
        assert (seq.cache.type_k, seq.cache.type_v) == (tk, tv)
        kls[tk, tv] = _kl(ref, m.forward(toks, seq, all_logits=True))
    # the coarser type is further from f16; all are close
    assert kls["q8_0", "f16"] < 1e-3 and kls["q8_0", "q8_0"] < 1e-3
    assert kls["q8_0", "q8_0"] < kls["q4_0", "q4_0"] < 0.05
    # decoded together, each reads its own cache as it would alone
    a, b = m.new_sequence(type_k="q4_0", type_v="q8_0"), m.new_sequence()
    m.forward(toks[:20], a)
    m.forward(toks[:25], b)
    rows = m.decode([a, b], [7, 9]).copy()
    a2, b2 = m.new_sequence(type_k="q4_0", type_v="q8_0"), m.new_sequence()
    m.forward(toks[:20], a2)
    m.forward(toks[:25], b2)
    np.testing.assert_allclose(rows[0], m.forward([7], a2), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rows[1], m.forward([9], b2), rtol=1e-4, atol=1e-4)


def test_load_sets_the_default_types(tiny32):
    llm = edgellama.load(tiny32, ctx=32, cache_type_k="q4_0", cache_type_v="Q8_0")
    assert (llm.seq.cache.type_k, llm.seq.cache.type_v) == ("q4_0", "q8_0")
    with pytest.raises(EdgeError, match="unknown KV cache type 'q3'"):
        edgellama.load(tiny32, ctx=32, cache_type_k="q3")


def test_quantized_cache_needs_head_dim_of_32(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", vocab=TINY_VOCAB, tokenizer=True)  # hd 16
    with pytest.raises(EdgeError, match="multiple of 32"):
        edgellama.load(path, ctx=32, cache_type_k="q8_0")


def test_a_context_that_does_not_fit_says_what_would(tiny32, monkeypatch):
    a = llama_3b_args()
    msg = fit_advice(a, 131072, "f16", "f16", 8 * 2 ** 30)
    # the closest type pair that fits (q8_0's 7616 MiB), or the longest f16 context
    assert "needs 14336 MiB" in msg and "--cache-type-k q8_0 --cache-type-v q8_0 (7616 MiB)" in msg
    assert "use a smaller --ctx (with f16/f16: 74896 or less)" in msg
    monkeypatch.setattr(M, "available_memory", lambda: 100_000)
    with pytest.raises(EdgeError, match="use a smaller --ctx"):
        M.Transformer(GGUFFile(tiny32), ctx=512)


def test_advice_never_goes_past_the_models_window():
    # 20 GiB hold more than 3B's 131,072-token window at f16: a --ctx past the window that
    # does not fit is told the window, not a longer context the model was never trained for
    a = llama_3b_args()
    msg = fit_advice(a, 99_999_999, "f16", "f16", 20 * 2 ** 30)
    assert f"use a smaller --ctx (at most the model's {a.train_ctx}-token window)" in msg
    assert not re.search(r"\b(1[3-9]\d|[2-9]\d\d)\d{3} or less", msg), msg


def test_bench_refuses_before_allocating(monkeypatch):
    import edgellama.cli.bench as cb
    monkeypatch.setattr(cb, "available_memory", lambda: 8 * 2 ** 30)
    monkeypatch.setattr(B, "shape_file", lambda *a, **k: pytest.fail("generated a file"))
    res = CliRunner().invoke(main, ["bench", "--shape", "llama-3.2-3b", "--ctx", "131072"])
    assert res.exit_code == 1 and "it fits with --cache-type-k" in res.output, res.output


@pytest.mark.parametrize("argv", [
    ["generate", "-p", "hi"], ["chat"], ["serve"], ["perplexity", "-f", __file__],
])
def test_every_command_hands_the_cache_types_to_load(argv, monkeypatch):
    seen = {}

    def fake_load(*args, **kwargs):
        seen.update(kwargs)
        raise EdgeError("stop here")
    monkeypatch.setattr(edgellama, "load", fake_load)
    res = CliRunner().invoke(main, [argv[0], "-m", __file__, "-ctk", "q4_0",
                                    "--cache-type-v", "q8_0", *argv[1:]])
    assert "stop here" in res.output, res.output
    assert seen["cache_type_k"] == "q4_0" and seen["cache_type_v"] == "q8_0"


def test_bench_reports_every_cache_type(tiny32, monkeypatch):
    monkeypatch.setattr(B, "measure_read_bandwidth", lambda: 1.0)
    res = CliRunner().invoke(main, ["bench", "-m", str(tiny32), "--ctx", "64", "-p", "16", "-n", "4",
                                    "-ctk", "q4_0", "-ctv", "q8_0", "--json"])
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)["memory"]
    a = ModelArgs.from_gguf(GGUFFile(tiny32))
    assert m["kv_cache"] == KVCache.bytes_needed(a, 64, "q4_0", "q8_0")
    assert m["predicted_total"] == m["weights"] + m["kv_cache"] + m["scratch"] + m["baseline"]
    by = m["by_cache_type"]
    assert set(by) == {"f16/f16", "q8_0/q8_0", "q8_0/q4_0", "q4_0/q4_0", "q4_0/q8_0"}
    room = m["budget"] - (m["predicted_total"] - m["kv_cache"])
    for c in by.values():
        assert c["longest_ctx"] == min(a.train_ctx, room // c["bytes_per_token"] // 16 * 16)
    res = CliRunner().invoke(main, ["bench", "-m", str(tiny32), "--ctx", "64", "-p", "16", "-n", "4"])
    assert "longest context in budget" in res.output and "q4_0/q4_0" in res.output
