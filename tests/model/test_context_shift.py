"""Context shift (KVCache.shift, kernels.kv_shift): dropped positions leave the cache and
the later ones move down, K rotated back by the dropped count (RoPE is a rotation). The
kernel against a NumPy twin, the shifted K against RoPE at the new positions, and a
model's logits after a shift against the NumPy reference."""
import numpy as np
import pytest

import edgellama
from edgellama.kernels import rows as K
from edgellama.args import ModelArgs
from edgellama.chat_session import ChatSession
from edgellama.gguf import GGUFFile
from edgellama.model import KVCache, Transformer
from edgellama.sampling import SamplingParams
from reference import load_reference, reference_forward, rope_adjacent
from tiny_gguf import TINY_VOCAB, llama3_rope_freqs, write_tiny_gguf


def _args(rope_freqs=None, layers=2, kv=2, hd=16):
    return ModelArgs(dim=hd * 4, n_layers=layers, n_heads=4, n_kv_heads=kv, ffn_dim=32,
                     vocab_size=100, norm_eps=1e-5, rope_theta=500000.0, rope_dim=hd,
                     train_ctx=4096, tied_output=True, rope_freqs=rope_freqs)


ARGS = {"plain": _args(), "llama3 scaling": _args(llama3_rope_freqs(16, 500000.0))}


def _by_position(cache: KVCache):
    """K and V as (L, KV, positions, hd) f16."""
    L, KV, nb, hd, blk = cache.k.shape
    return cache.k.transpose(0, 1, 2, 4, 3).reshape(L, KV, nb * blk, hd).copy(), cache.v.copy()


def _filled(args, n, rng, positions=None):
    """A cache of 96 positions holding n: K roped at `positions` (default 0..n-1) as the
    forward pass ropes it, V random; and the raw K (n, KV, hd) f32 before RoPE."""
    cache = KVCache(args, 96)
    raw = (rng.standard_normal((n, args.n_kv_heads, args.head_dim)) * 2).astype(np.float32)
    pos = np.arange(n) if positions is None else positions
    angles = pos.astype(np.float64)[:, None] * args.inv_freq()[None, :]
    for layer in range(args.n_layers):
        k = raw.copy() * (layer + 1)
        K.rope(k, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
        cache.write(layer, 0, k, rng.standard_normal(k.shape).astype(np.float32))
    cache.length = n
    return cache, raw


def _shift_twin(k, v, keep, drop, length, inv_freq):
    """NumPy: positions keep+drop.. move to keep.., each K pair (a, b) of the f16 values
    turned by -drop·θ in float64 and rounded to f16."""
    k, v = k.copy(), v.copy()
    src = k[:, :, keep + drop:length].astype(np.float64)
    angle = drop * inv_freq.astype(np.float64)
    c, s = np.cos(angle), np.sin(angle)
    a, b = src[..., 0::2], src[..., 1::2]
    out = np.empty_like(src)
    out[..., 0::2], out[..., 1::2] = a * c + b * s, b * c - a * s
    k[:, :, keep:length - drop] = out.astype(np.float16)
    v[:, :, keep:length - drop] = v[:, :, keep + drop:length]
    return k, v


@pytest.mark.parametrize("rope", list(ARGS))
@pytest.mark.parametrize("keep,drop,length", [(0, 1, 40), (5, 16, 70), (3, 7, 10), (17, 40, 96),
                                              (0, 95, 96)])
def test_shift_kernel_matches_numpy(rope, keep, drop, length):
    args = ARGS[rope]
    cache, _ = _filled(args, length, np.random.default_rng(keep * 100 + drop))
    want_k, want_v = _shift_twin(*_by_position(cache), keep, drop, length, args.inv_freq())
    cache.shift(keep, drop, args.inv_freq())
    assert cache.length == length - drop
    got_k, got_v = _by_position(cache)
    n = length - drop
    np.testing.assert_array_equal(got_v[:, :, :n], want_v[:, :, :n])
    # the kernel turns the pairs in f32 (cos, sin rounded to f32): its result may round to
    # the f16 neighbour of the float64 one, never further
    g, w = got_k[:, :, :n].astype(np.float64), want_k[:, :, :n].astype(np.float64)
    assert np.all(np.abs(g - w) <= np.spacing(np.abs(want_k[:, :, :n])).astype(np.float64))
    assert np.mean(g == w) > 0.99


@pytest.mark.parametrize("rope", list(ARGS))
def test_shifted_k_is_rope_at_the_new_position(rope):
    """K stored at p, shifted by d, against RoPE of the raw K at p - d, both as f16: the
    stored value's rounding (half an ulp of each of the pair), turned (a rotation keeps
    its length), plus half an ulp of the new value."""
    args, keep, drop, length = ARGS[rope], 6, 50, 90
    cache, raw = _filled(args, length, np.random.default_rng(1))
    before, _ = _by_position(cache)
    cache.shift(keep, drop, args.inv_freq())
    got, _ = _by_position(cache)
    src = np.arange(keep + drop, length)
    for layer in range(args.n_layers):
        exact = rope_adjacent(raw[src] * (layer + 1), src - drop, args.inv_freq())   # f64
        stored = before[layer].transpose(1, 0, 2)[src].astype(np.float64)   # (n, KV, hd)
        ulp = np.spacing(np.abs(stored.astype(np.float16))).astype(np.float64)
        pair = 0.5 * np.hypot(ulp[..., 0::2], ulp[..., 1::2]).repeat(2, axis=-1)
        shifted = got[layer].transpose(1, 0, 2)[keep:length - drop].astype(np.float64)
        bound = pair + 0.5 * np.spacing(np.abs(shifted.astype(np.float16))) + 1e-6 * np.abs(exact)
        assert np.all(np.abs(shifted - exact) <= bound)
        np.testing.assert_array_equal(got[layer][:, :keep], before[layer][:, :keep])


def test_shift_refuses_what_the_cache_does_not_hold():
    args = ARGS["plain"]
    cache, _ = _filled(args, 10, np.random.default_rng(0))
    for keep, drop in ((0, 0), (5, 6), (-1, 2), (10, 1)):
        with pytest.raises(ValueError):
            cache.shift(keep, drop, args.inv_freq())
    assert cache.length == 10


# -- a model's logits after a shift ---------------------------------------------------
A = [3, 17, 90, 4, 250]              # kept (a system prompt)
B = list(range(100, 112))            # dropped (the oldest turn)
C = [7, 8, 9, 200, 201, 5, 60, 61]   # kept, moved down
D = [44, 45, 46, 47, 12, 13]         # read after the shift (the next message)


def _shifted_logits(path):
    m = Transformer(GGUFFile(path), ctx=64, batch=8)
    seq = m.new_sequence()
    m.forward(A + B + C, seq)
    seq.shift(len(A), len(B), m.inv_freq)
    assert seq.tokens == A + C and seq.pos == len(A + C)
    return m, m.forward(D, seq, all_logits=True)


@pytest.mark.parametrize("rope_scaling", [True, False])
def test_logits_after_shift_match_the_reference_of_a_shift(tmp_path, rope_scaling):
    """Two layers: after the shift, C's K/V in layer 1 still carry what C saw of B, so
    the reference is the same operation in NumPy: its cache of A+B+C read in full, B's
    entries removed, C's K turned back by len(B) in float64 and rounded to f16. The
    tolerance is test_model's for Q8_0 (the runtime against the reference)."""
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", rope_scaling=rope_scaling)
    m, got = _shifted_logits(path)
    meta, W = load_reference(path)
    cache = {}
    reference_forward(meta, W, A + B + C, cache=cache)
    inv = m.inv_freq.astype(np.float64)
    c, s = np.cos(len(B) * inv), np.sin(len(B) * inv)
    for i in range(len(cache["k"])):
        k, keep = cache["k"][i].astype(np.float64), slice(0, len(A))
        moved = k[len(A) + len(B):]
        a, b = moved[..., 0::2], moved[..., 1::2]
        turned = np.empty_like(moved)
        turned[..., 0::2], turned[..., 1::2] = a * c + b * s, b * c - a * s
        cache["k"][i] = np.concatenate([k[keep], turned]).astype(np.float16).astype(np.float32)
        cache["v"][i] = np.concatenate([cache["v"][i][keep], cache["v"][i][len(A) + len(B):]])
    want = reference_forward(meta, W, D, cache=cache)
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-2


def shift_against_fresh(m, A, B, C, D, sabotage=lambda seq: None) -> float:
    """How far D's logits after reading A+B+C and shifting B out are from reading A+C
    afresh (max error over the largest logit); `sabotage(seq)` runs before the shift."""
    fresh = m.new_sequence()
    m.forward(A + C, fresh)
    want = m.forward(D, fresh, all_logits=True).copy()
    seq = m.new_sequence()
    m.forward(A + B + C, seq)
    sabotage(seq)
    seq.shift(len(A), len(B), m.inv_freq)
    got = m.forward(D, seq, all_logits=True)
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_one_layer_shift_equals_reading_the_shorter_text(tmp_path):
    """With one layer K/V depend on their token and position only, so a shift must give
    what reading A+C afresh gives, but for the f16 rounding of the turned K: the two
    runs' logits within 1e-3 of their scale (K off by about an ulp, 2^-11 relative,
    through attention scores of magnitude ~1), far below the 2e-2 of a wrong position."""
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", layers=1)
    m, got = _shifted_logits(path)
    fresh = m.forward(A + C + D, m.new_sequence(), all_logits=True)[len(A + C):]
    assert np.abs(got - fresh).max() / np.abs(fresh).max() < 1e-3
    # the same check fails without the rotation: positions matter
    seq = m.new_sequence()
    m.forward(A + B + C, seq)
    _move_without_turning(seq.cache, len(A), len(B), len(A + B + C))
    del seq.tokens[len(A):len(A) + len(B)]
    wrong = m.forward(D, seq, all_logits=True)
    assert np.abs(wrong - fresh).max() / np.abs(fresh).max() > 1e-2


def _move_without_turning(cache, keep, drop, length):
    """A shift without RoPE's turn: K and V moved down, K left as it was."""
    L, KV, nb, hd, blk = cache.k.shape
    k = cache.k.transpose(0, 1, 2, 4, 3).reshape(L, KV, nb * blk, hd).copy()
    k[:, :, keep:length - drop] = k[:, :, keep + drop:length].copy()
    cache.k[...] = k.reshape(L, KV, nb, blk, hd).transpose(0, 1, 2, 4, 3)
    cache.v[:, :, keep:length - drop] = cache.v[:, :, keep + drop:length].copy()
    cache.length = length - drop


# -- chat and generate ----------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """One layer (a shift then equals a fresh read, but for rounding), a ChatML template."""
    return write_tiny_gguf(tmp_path_factory.mktemp("chat") / "m.gguf", "Q8_0", layers=1,
                           vocab=TINY_VOCAB, tokenizer=True)


def _until_a_drop(llm, shift):
    """A session that talks until it drops turns; the tokens read by the turn before the
    drop turn and by the drop turn."""
    session = ChatSession(llm, SamplingParams(temperature=0), max_tokens=6, system="be kind",
                          context_shift=shift)
    reads = []
    for i in range(10, 50):                      # messages of the same length in tokens
        "".join(session.send(f"tell me about the number {i} in a few words"))
        reads.append(llm.stats.prompt_tokens)
        if session.notices:
            return session, reads[-2], reads[-1]
    raise AssertionError("the context never filled")


def test_chat_drops_turns_by_a_shift_not_a_reread(chat_model):
    llm = edgellama.load(chat_model, ctx=160, batch=8)
    session, normal, read = _until_a_drop(llm, shift=True)
    assert "context shift" in session.notices[-1]
    # the drop turn reads what any turn reads: the new message (the kept turns moved)
    assert read == normal
    ids = session._render(session.messages[:-1])   # the drop turn's prompt (before its reply)
    assert llm.cached[:len(ids)] == ids            # the cache holds the shortened conversation
    # without the shift the same turn reads all the kept turns again
    plain = edgellama.load(chat_model, ctx=160, batch=8)
    _, normal, reread = _until_a_drop(plain, shift=False)
    assert reread > normal + 20, (normal, reread)


def test_logits_after_a_chat_shift_match_a_fresh_read(chat_model):
    """The drop turn's prompt read through the shifted cache and read afresh: one layer,
    so equal but for the f16 rounding of the turned K (1e-3 of the logits' scale, as in
    test_one_layer_shift_equals_reading_the_shorter_text)."""
    llm = edgellama.load(chat_model, ctx=160, batch=8)
    session = ChatSession(llm, SamplingParams(temperature=0), max_tokens=6, system="be kind")
    for i in range(40):
        session.messages.append({"role": "user", "content": f"tell me about {i} in a few words"})
        ids, dropped = session._fit()
        if dropped:
            break
        session.messages.pop()
        "".join(session.send(f"tell me about {i} in a few words"))
    assert dropped
    got = llm._prefill(ids, shifted=True).copy()
    assert llm.stats.prompt_tokens < len(ids) // 2          # most of it came from the shift
    fresh = edgellama.load(chat_model, ctx=160, batch=8).logits(ids)
    assert np.abs(got - fresh).max() / np.abs(fresh).max() < 1e-3


def test_generate_shifts_when_the_context_fills(chat_model):
    llm = edgellama.load(chat_model, ctx=32, batch=8)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    out = list(llm.generate(prompt, max_tokens=60, sampling=SamplingParams(temperature=0),
                            stop_ids=set(), shift_keep=len(prompt)))
    assert len(out) == 60 and llm.stats.shifts >= 2 and llm.stats.stop_reason == "length"
    assert llm.cached[:len(prompt)] == prompt and llm.seq.pos <= 32
    assert llm.cached[len(prompt):] == out[len(out) - (len(llm.cached) - len(prompt)):]
    # without shift_keep it stops when full, as before
    out = list(llm.generate(prompt, max_tokens=60, sampling=SamplingParams(temperature=0),
                            stop_ids=set()))
    assert len(out) == 32 - len(prompt) + 1 and llm.stats.stop_reason == "context full"
