"""Gemma 3 (edgellama/models/gemma3.py) on tiny random Gemma-3-shaped files: the post-norms,
GELU gating, the scaled embedding, per-head q/k norms and NEOX RoPE with the local layers'
own base, and the sliding window against the NumPy reference; the local layers' ring
cache (kv_cache.SlidingCache) against a cache of the whole context, its bounded memory,
and what it refuses; the same files' logits against llama.cpp's (where installed)."""
import importlib.util

import numpy as np
import pytest

from edgellama import kv_cache
from edgellama.args import ModelArgs
from edgellama.errors import EdgeError
from edgellama.gguf import GGUFFile
from edgellama.model import Transformer
from reference import load_reference, reference_forward
from test_context_shift import shift_against_fresh
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

TOKENS = np.random.default_rng(7).integers(0, 256, 1000)
LAYERS = 7       # layers 0-4 and 6 local, 5 global


def gemma_file(path, qtype="F32", **kw):
    """A tiny Gemma 3: 4 query heads, 1 KV head (as 270M and 1B), head dim 2·E/H."""
    dim = kw.pop("dim", 64)
    kw = {"heads": 4, "kv_heads": 1, "head_dim": dim // 2, "ffn": 2 * dim, "layers": LAYERS,
          "rope_scaling": False, "theta": 1e6, "ctx": 2048, **kw}
    return write_tiny_gguf(path, qtype, arch="gemma3", dim=dim, **kw)


def _rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # a window of 100: a ring of 256 + 512 positions, so 1,000 tokens go round it
    path = gemma_file(tmp_path_factory.mktemp("g") / "g.gguf", window=100)
    meta, W = load_reference(path)
    return path, meta, W, reference_forward(meta, W, TOKENS)


def test_args_from_the_file(tiny):
    a = ModelArgs.from_gguf(GGUFFile(tiny[0]))
    assert a.family.name == "gemma3" and a.family.neox and a.family.post_norms
    assert a.sliding_window == 100 and a.rope_theta_swa == 10000.0
    assert a.local_layers == (True,) * 5 + (False, True)
    assert a.expected_shapes()["blk.3.post_ffw_norm.weight"] == (a.dim,)


def test_prefill_and_decode_match_the_reference_past_the_ring(tiny):
    # prefill of 1,000 tokens in one chunk (runs of 669 through the ring, kv_cache.step),
    # in chunks of 512, and 300 decoded tokens once the ring has wrapped
    path, _, _, ref = tiny
    m = Transformer(GGUFFile(path), ctx=1024, batch=1024)
    seq = m.new_sequence()
    assert seq.cache.swa.ring and seq.cache.swa.cap == 768
    assert _rel_err(m.forward(TOKENS, seq, all_logits=True), ref) < 1e-4
    m = Transformer(GGUFFile(path), ctx=1024, batch=512)
    seq = m.new_sequence()
    assert _rel_err(m.forward(TOKENS[:700], seq, all_logits=True), ref[:700]) < 1e-4
    rows = np.stack([m.forward(TOKENS[i:i + 1], seq).copy() for i in range(700, 1000)])
    assert _rel_err(rows, ref[700:]) < 1e-4


def test_the_reference_tells_the_blocks_apart(tiny):
    # the checks above can fail: without the window, the post-norms or GELU (SiLU instead)
    # the logits are far from the reference's
    _, meta, W, ref = tiny
    no_window = {k: v for k, v in meta.items() if not k.endswith("sliding_window")}
    assert _rel_err(reference_forward(no_window, W, TOKENS)[200:], ref[200:]) > 100 * 1e-4
    no_post = {k: (np.ones_like(v) if "post_" in k else v) for k, v in W.items()}
    assert _rel_err(reference_forward(meta, no_post, TOKENS[:50]), ref[:50]) > 100 * 1e-4
    silu = reference_forward(meta, W, TOKENS[:50], gelu=lambda g: g / (1 + np.exp(-g)))
    assert _rel_err(silu, ref[:50]) > 100 * 1e-4


@pytest.mark.parametrize("cache", ["f16", "q8_0", "q4_0"])
def test_the_ring_gives_the_whole_cache_bits(tiny, cache, monkeypatch):
    # the local layers' ring and a cache of the whole context hold the same values at
    # other slots: every cache type gives the same logits, prefill and decode
    m = Transformer(GGUFFile(tiny[0]), ctx=1024, batch=256)
    runs = []
    for run in (kv_cache.RING_RUN, 10 ** 6):
        monkeypatch.setattr(kv_cache, "RING_RUN", run)
        seq = m.new_sequence(type_k=cache, type_v=cache)
        assert seq.cache.swa.ring == (run == 512)
        out = m.forward(TOKENS[:900], seq, all_logits=True).copy()
        runs.append((out, np.stack([m.forward(TOKENS[i:i + 1], seq).copy()
                                    for i in range(900, 1000)])))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_batched_decode_and_verify_on_rings(tiny):
    m = Transformer(GGUFFile(tiny[0]), ctx=1024, batch=512)
    prompts = [TOKENS[:800].tolist(), TOKENS[100:130].tolist()]
    seqs = [m.new_sequence() for _ in prompts]
    for p, s in zip(prompts, seqs):
        m.forward(p, s)
    got = m.decode(seqs, [11, 12]).copy()
    for p, row, t in zip(prompts, got, (11, 12)):
        s = m.new_sequence()
        m.forward(p, s)
        np.testing.assert_allclose(row, m.forward([t], s), rtol=0, atol=1e-5 * np.abs(row).max())
    s = seqs[0]
    rows = m.verify(TOKENS[801:806], s).copy()
    s.truncate(801)
    np.testing.assert_array_equal(rows, np.stack([m.forward([t], s).copy() for t in TOKENS[801:806]]))


def test_the_ring_keeps_its_memory_past_the_window(tiny):
    a = ModelArgs.from_gguf(GGUFFile(tiny[0]))
    small, big = kv_cache.SlidingCache(a, 2048), kv_cache.SlidingCache(a, 32768)
    assert small.swa.nbytes == big.swa.nbytes and small.swa.cap == 768
    assert big.full.nbytes == 16 * small.full.nbytes
    for ctx in (96, 768, 2048, 32768):    # whole blocks of 16
        c = kv_cache.SlidingCache(a, ctx)
        assert kv_cache.KVCache.bytes_needed(a, ctx) == c.nbytes
    per_global = kv_cache.KVCache.bytes_per_token(a) // a.n_layers
    budget = kv_cache.KVCache.bytes_needed(a, 5000)
    assert kv_cache.longest_context(a, budget, "f16", "f16") == 5000 // 16 * 16
    assert kv_cache.longest_context(a, budget + per_global * 32, "f16", "f16") == 5024


def test_truncating_behind_the_ring_reads_again(tiny):
    # a ring has overwritten positions 0..231 after 1,000 tokens: resuming at 300 would
    # need 201..299 (the window), so reuse_prefix keeps nothing and a forward is refused;
    # resuming at 990 keeps its window
    m = Transformer(GGUFFile(tiny[0]), ctx=1024, batch=512)
    seq = m.new_sequence()
    m.forward(TOKENS, seq)
    assert seq.cache.swa.floor == 1000 - 768
    assert seq.reuse_prefix(TOKENS[:990].tolist() + [5, 6]) == 990
    assert seq.reuse_prefix(TOKENS[:300].tolist() + [5, 6]) == 0 and seq.pos == 0
    m.forward(TOKENS, seq)
    seq.truncate(300)
    with pytest.raises(EdgeError, match="sliding-window cache no longer holds"):
        m.forward([5], seq)
    assert seq.pos == 300


def test_shift_and_saving_are_refused_once_the_ring_wraps(tiny):
    m = Transformer(GGUFFile(tiny[0]), ctx=1024, batch=512)
    seq = m.new_sequence()
    m.forward(TOKENS[:700], seq)           # nothing overwritten yet: both work
    assert seq.cache.can_shift and set(seq.cache.state(700)) >= {"k", "swa_k", "swa_v"}
    m.forward(TOKENS[700:900], seq)
    assert not seq.cache.can_shift
    with pytest.raises(EdgeError, match="no context shift past 768 positions") as e:
        seq.shift(0, 100, m.inv_freq)
    assert "\n" not in str(e.value) and seq.pos == 900
    with pytest.raises(EdgeError, match="cannot be saved"):
        seq.cache.state(900)


def test_shift_before_the_ring_wraps_turns_each_layer_by_its_own_base(tmp_path):
    # one local layer: K/V depend on token and position only, so the shift gives what
    # reading A+C afresh gives, but for f16 rounding, only if the local K is turned by the
    # local base (10,000), not the global one
    m = Transformer(GGUFFile(gemma_file(tmp_path / "g.gguf", layers=1, window=64)), ctx=1024)
    A, B, C, D = [1, 2, 3], list(range(40, 80)), [90, 91, 92, 93], [7, 8]
    assert shift_against_fresh(m, A, B, C, D) < 1e-3

    def global_base(seq):
        seq.cache._inv_local = m.inv_freq
    assert shift_against_fresh(m, A, B, C, D, global_base) > 1e-2


def test_softcap_and_the_local_rope_base_from_the_file(tmp_path):
    path = gemma_file(tmp_path / "g.gguf", window=8, softcap=3.0, theta_swa=500.0, layers=6)
    a = ModelArgs.from_gguf(GGUFFile(path))
    assert a.final_softcap == 3.0 and a.rope_theta_swa == 500.0
    meta, W = load_reference(path)
    # the reference in float64 (but for the f16 cache): over 12 seeds of this file a
    # float32 forward pass, the NumPy reference's own included, lands 0.6e-5 to 2.9e-4
    # from it (the capped logits sit near 3, so a small error is a large part of them)
    ref = reference_forward(meta, {k: w.astype(np.float64) for k, w in W.items()}, TOKENS[:40])
    m = Transformer(GGUFFile(path), ctx=64)
    got = m.forward(TOKENS[:40], m.new_sequence(), all_logits=True)
    assert np.abs(got).max() <= 3.0 and _rel_err(got, ref) < 5e-4
    # a local base taken from elsewhere (the default 10,000, or the global 1e6) lands
    # far outside that bound
    for wrong in (10000.0, 1e6):
        meta_wrong = {**meta, "gemma3.rope.freq_base_swa": wrong}
        assert _rel_err(reference_forward(meta_wrong, W, TOKENS[:40]), ref) > 1e-2


# -- llama.cpp as the oracle ------------------------------------------------------------------

def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_rows(p, q):
    """KL(p || q) of each row of two logit arrays."""
    lp, lq = _log_softmax(p), _log_softmax(q)
    return (np.exp(lp) * (lp - lq)).sum(-1)


LLAMA_CPP = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                               reason="llama-cpp-python not installed (pip install -e '.[oracle]')")


@LLAMA_CPP
def test_logits_match_llama_cpp(tmp_path):
    # the same file in llama.cpp, F32, a window of 16 over 60 tokens, untied output (wide
    # distributions): within KL 1e-5 at every position, the ones past the window included
    import edgellama
    import llama_cpp
    toks = TOKENS[:60].tolist()
    path = gemma_file(tmp_path / "g.gguf", dim=256, layers=6, window=16, tied=False,
                      vocab=TINY_VOCAB, tokenizer=True)
    L = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True,
                        verbose=False, n_threads=2)
    L.eval(toks)
    theirs = np.array(L.scores[:len(toks)], np.float32)
    llm = edgellama.load(path, ctx=64)
    ours = llm.model.forward(toks, llm.seq, all_logits=True)
    assert _kl_rows(theirs, ours).max() < 1e-5


@pytest.mark.slow
@LLAMA_CPP
def test_the_real_270m_against_llama_cpp(gemma_q4_k_m_gguf):
    # llama.cpp's own Q4_K_M of Gemma 3 270M, teacher-forced over the first 2,000 tokens of
    # an English text (llama.cpp's tokenizer): the first 512 rows (all within the window),
    # the rows past it, and 100 tokens decoded one at a time after a 1,500-token prefill
    # (the local layers' ring has wrapped); the local layers' cache stays at its ring
    import llama_cpp
    from pathlib import Path
    text = (Path(__file__).parents[2] / "bench" / "data" / "alice.txt").read_text()
    N = 2000
    L = llama_cpp.Llama(model_path=str(gemma_q4_k_m_gguf), n_ctx=N, n_batch=512,
                        logits_all=True, verbose=False, n_threads=2)
    toks = L.tokenize(text[:30000].encode(), add_bos=True)[:N]
    assert len(toks) == N
    L.eval(toks)
    theirs = np.array(L.scores[:N], np.float32)
    del L
    m = Transformer(GGUFFile(gemma_q4_k_m_gguf), ctx=N)
    seq = m.new_sequence()
    ours = m.forward(toks[:1500], seq, all_logits=True)
    decoded = np.stack([m.forward(toks[i:i + 1], seq).copy() for i in range(1500, 1600)])
    kl, top = _kl_rows(theirs[:1500], ours), theirs[:1500].argmax(-1) == ours.argmax(-1)
    print(f"first 512: mean KL {kl[:512].mean():.4f}, top-1 {top[:512].mean():.3f}; "
          f"512..1500: {kl[512:].mean():.4f}, {top[512:].mean():.3f}")
    # 0.008: two NumPy runs of this file with llama.cpp's int8 rounding, one with ggml's
    # f16 GELU table, differ by 0.0065 (bench/results/fidelity_gemma3_270m_q4_k_m.json)
    assert kl[:512].mean() < 0.008 and top[:512].mean() > 0.93
    assert kl[512:].mean() < 0.008 and top[512:].mean() > 0.93
    kd = _kl_rows(theirs[1500:1600], decoded)
    print(f"decoded 1500..1600: mean KL {kd.mean():.4f}")
    assert kd.mean() < 0.008
    # 15 local layers of 1,024 positions, 3 global ones of 2,000
    c, per = seq.cache, kv_cache.KVCache.bytes_per_token(m.args) // 18
    assert c.swa.cap == 1024 and c.swa.nbytes == 15 * 1024 * per and c.full.nbytes == 3 * N * per


@pytest.mark.slow
@LLAMA_CPP
def test_the_real_270m_is_closer_to_its_weights_than_llama_cpp(gemma_q4_k_m_gguf):
    # the truth: the NumPy forward pass of the file's weights dequantized, float32 products,
    # over 256 tokens of English (llama.cpp's tokens). Ours with int8 activations must be
    # no farther from it than llama.cpp (whose int8 x for every product makes most of its
    # distance, as it does ours), and with fine activations within float rounding of it
    import llama_cpp
    from pathlib import Path
    text = (Path(__file__).parents[2] / "bench" / "data" / "alice.txt").read_text()
    N = 256
    L = llama_cpp.Llama(model_path=str(gemma_q4_k_m_gguf), n_ctx=N, n_batch=N,
                        logits_all=True, verbose=False, n_threads=2)
    toks = L.tokenize(text[:10000].encode(), add_bos=True)[:N]
    L.eval(toks)
    theirs = np.array(L.scores[:N], np.float32)
    del L
    meta, W = load_reference(gemma_q4_k_m_gguf)
    truth = reference_forward(meta, W, toks)
    del W
    kl = {}
    for mode in ("int8", "fine"):
        m = Transformer(GGUFFile(gemma_q4_k_m_gguf), ctx=N, activations=mode)
        kl[mode] = _kl_rows(truth, m.forward(toks, m.new_sequence(), all_logits=True)).mean()
    kl["llama.cpp"] = _kl_rows(truth, theirs).mean()
    print({k: round(float(v), 5) for k, v in kl.items()})
    assert kl["int8"] < kl["llama.cpp"] and kl["fine"] < 1e-4


def test_bench_shapes_count_the_rings():
    # gemma3-1b at its 32,768: 4 global layers of 1 KV head x 256 x (K + V) f16, 1 KiB a
    # layer and position, + 22 local layers' rings of 1,024; gemma3-4b: 5 global layers of
    # 4 KiB at 131,072 + 29 rings of 1,536 (window 1,024)
    from edgellama import benchmark
    a = benchmark.SHAPES["gemma3-1b"].args()
    assert a.local_layers.count(False) == 4 and a.head_dim == 256
    assert kv_cache.KVCache.bytes_needed(a, 32768) == (4 * 32768 + 22 * 1024) * 1024
    a = benchmark.SHAPES["gemma3-4b"].args()
    assert kv_cache.KVCache.bytes_needed(a, 131072) == (5 * 131072 + 29 * 1536) * 4096


def test_the_4b_bench_shape_is_its_hf_config(monkeypatch, tmp_path):
    # google/gemma-3-4b-it's text_config: 34 layers of 2,560, 8 heads, 4 KV heads of 256,
    # FFN 10,240, window 1,024, rope 1e6 with linear scaling 8 on the global layers (the
    # local ones keep 10,000 unscaled); llama.cpp's GGUF keeps 262,144 embedding rows. The
    # shape file as written reads back to the same hyperparameters
    import dataclasses

    from edgellama import benchmark
    s = benchmark.SHAPES["gemma3-4b"]
    assert (s.layers, s.vocab, s.train_ctx) == (34, 262144, 131072)
    monkeypatch.setattr(benchmark, "bench_dir", lambda: tmp_path)
    monkeypatch.setitem(benchmark.SHAPES, "g", dataclasses.replace(s, layers=6, vocab=512))
    a = ModelArgs.from_gguf(GGUFFile(benchmark.shape_file("g", "q8_0", quiet=True)))
    assert (a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim) == (2560, 8, 4, 256, 10240)
    assert (a.sliding_window, a.rope_theta, a.rope_scale, a.rope_theta_swa) == (1024, 1e6, 8, 1e4)
    assert a.local_layers == benchmark.SHAPES["g"].args().local_layers
    i = np.arange(0, 256, 2)
    assert np.allclose(a.inv_freq(local=False), 1 / (1e6 ** (i / 256) * 8), rtol=1e-6)
    assert np.allclose(a.inv_freq(local=True), 1 / 1e4 ** (i / 256), rtol=1e-6)
