"""One model, many sequences: each Sequence carries its own KV cache, tokens and scratch;
Transformer.decode steps several together in one pass over the weights and gives what
each would get alone."""
import numpy as np
import pytest

import edgellama
from edgellama.formats import FORMATS, linear
from edgellama.formats.base import Linear
from edgellama.gguf import GGUFFile
from edgellama.model import Transformer
from edgellama.scratch import Scratch
from tiny_gguf import write_tiny_gguf

# Q4_K, Q6_K and Q4_0 decode several tokens with one GEMM pass (RecordLinear.matvecs);
# F16 runs a matvec per sequence (Linear.matvecs)
TYPES = ["Q4_K", "Q4_0", "F16"]
PROMPTS = [[5, 9, 17], [3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
           [42, 42]]


@pytest.fixture(scope="module", params=TYPES)
def model(request, tmp_path_factory):
    qtype = request.param
    dim, ffn = (256, 512) if FORMATS[qtype].block_size == 256 else (64, 96)
    path = write_tiny_gguf(tmp_path_factory.mktemp(qtype) / "m.gguf", qtype, dim=dim, ffn=ffn,
                           embed_type="Q6_K" if qtype == "Q4_K" else None)
    return Transformer(GGUFFile(path), ctx=64, batch=8)


def _alone(m, prompt, steps):
    """Greedy tokens and their logits, one sequence decoded by itself."""
    seq = m.new_sequence()
    logits = m.forward(prompt, seq).copy()
    toks, rows = [], [logits]
    for _ in range(steps):
        toks.append(int(np.argmax(logits)))
        logits = m.forward([toks[-1]], seq).copy()
        rows.append(logits)
    return toks, np.stack(rows)


def test_batched_decode_equals_each_alone(model):
    steps = 6
    alone = [_alone(model, p, steps) for p in PROMPTS]
    seqs = [model.new_sequence() for _ in PROMPTS]
    rows = [[model.forward(p, s).copy()] for p, s in zip(PROMPTS, seqs)]
    toks = [[] for _ in PROMPTS]
    for _ in range(steps):
        nxt = [int(np.argmax(r[-1])) for r in rows]
        for t, n in zip(toks, nxt):
            t.append(n)
        out = model.decode(seqs, nxt)
        assert out.shape == (len(seqs), model.args.vocab_size)
        for r, o in zip(rows, out):
            r.append(o.copy())
    for (want_toks, want_rows), got_toks, got_rows, seq, p in zip(alone, toks, rows, seqs, PROMPTS):
        assert got_toks == want_toks
        assert seq.tokens == p + got_toks and seq.pos == len(p) + steps
        # the same int8 sums; only the f32 order of a tile's sums may differ
        np.testing.assert_allclose(np.stack(got_rows), want_rows, rtol=0,
                                   atol=1e-5 * np.abs(want_rows).max())


def test_sequences_do_not_share_state(model):
    # interleaving two sequences' passes changes neither
    a, b = model.new_sequence(), model.new_sequence()
    la = model.forward(PROMPTS[0], a).copy()
    model.forward(PROMPTS[2], b)
    la2 = model.forward([7], a).copy()
    lb = model.forward([7], b).copy()
    _, want_a = _alone(model, PROMPTS[0], 0)
    np.testing.assert_array_equal(la, want_a[0])
    c = model.new_sequence()
    model.forward(PROMPTS[0], c)
    np.testing.assert_array_equal(la2, model.forward([7], c))
    d = model.new_sequence()
    model.forward(PROMPTS[2], d)
    np.testing.assert_array_equal(lb, model.forward([7], d))


def test_a_shared_scratch_gives_the_same_logits(model):
    sc = Scratch()
    a, b = model.new_sequence(scratch=sc), model.new_sequence(scratch=sc)
    model.forward(PROMPTS[0], a)
    model.forward(PROMPTS[1], b)
    got = model.decode([a, b], [1, 2]).copy()
    x, y = model.new_sequence(), model.new_sequence()
    model.forward(PROMPTS[0], x)
    model.forward(PROMPTS[1], y)
    np.testing.assert_array_equal(got, model.decode([x, y], [1, 2]))


def test_linears_hold_no_buffers(model):
    for w in model.linears() + [model.embed]:
        assert not [k for k, v in vars(w).items() if k.startswith("_") and isinstance(v, np.ndarray)]


def test_decode_refuses_what_it_cannot_do(model):
    a = model.new_sequence(ctx=2)
    model.forward([1, 2], a)
    with pytest.raises(edgellama.EdgeError, match="full"):
        model.decode([a], [3])
    b = model.new_sequence()
    with pytest.raises(ValueError, match="twice"):
        model.decode([b, b], [1, 2])
    with pytest.raises(ValueError, match="one token per sequence"):
        model.decode([b], [1, 2])
    with pytest.raises(ValueError, match="one token per sequence"):
        model.decode([b], [1, 2], counts=[3])
    c = model.new_sequence(ctx=2)
    model.forward([1], c)
    with pytest.raises(edgellama.EdgeError, match="full"):   # 2 tokens where 1 fits
        model.decode([b, c], [1, 3, 4], counts=[1, 2])
    with pytest.raises(edgellama.EdgeError, match="out of range"):
        model.decode([b], [model.args.vocab_size])
    assert b.pos == 0


def test_reuse_prefix_truncates_to_the_common_prefix(model):
    s = model.new_sequence()
    model.forward([1, 2, 3, 4], s)
    assert s.reuse_prefix([1, 2, 9]) == 2 and s.tokens == [1, 2] and s.cache.length == 2
    assert s.reuse_prefix([1, 2]) == 1 and s.tokens == [1]          # the last is recomputed
    assert s.reuse_prefix([5]) == 0 and s.pos == 0
    assert s.reuse_prefix([]) == 0


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_0", "Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS", "F16"])
def test_matvecs_is_matvec_per_row(qtype):
    rng = np.random.default_rng(0)
    n, d = 512, 80
    raw = edgellama.formats.quantize(rng.standard_normal((d, n)).astype(np.float32), qtype)
    w: Linear = linear(FORMATS[qtype].type_id, [(raw, (d, n))])
    x = rng.standard_normal((3, n)).astype(np.float32)
    got, want = np.empty((3, d), np.float32), np.empty((3, d), np.float32)
    sc = Scratch()
    w.matvecs(x, got, sc)
    for i in range(3):
        w.matvec(x[i], want[i], sc)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
