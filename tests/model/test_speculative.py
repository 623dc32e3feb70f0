"""Speculative decoding (edgellama/speculative.py): at temperature 0 exactly the tokens of
plain decoding, with a draft model and with prompt lookup; the KV cache rolled back to
what plain decoding leaves; with sampling, the target's distribution (chi-square); a
draft of another vocabulary refused."""
import numpy as np
import pytest
from scipy import stats as scipy_stats

import edgellama
import tiny_gguf
from edgellama.errors import EdgeError
from edgellama.sampling import Sampler, SamplingParams
from edgellama.speculative import DraftLength, PromptLookup, check_same_vocabulary
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

GREEDY = SamplingParams(temperature=0.0)
# Q8_0: verify's rows come from the multi-token record kernel; F16: a matvec per row
TARGET_TYPES = ["Q8_0", "F16"]


def _tiny(tmp_path, qtype, seed=0, **kw):
    kw = {"dim": 64, "ffn": 96, "vocab": TINY_VOCAB, "ctx": 256, "tokenizer": True,
          "tied": False, **kw}   # an untied output: logits of a few units, near ties common
    return write_tiny_gguf(tmp_path / f"{qtype}-{seed}.gguf", qtype, seed=seed, **kw)


@pytest.fixture(scope="module", params=TARGET_TYPES)
def tiny_pair(request, tmp_path_factory):
    """A tiny target and, as its draft, a Q4_0 copy of the same random weights."""
    d = tmp_path_factory.mktemp("spec")
    target = edgellama.load(_tiny(d, request.param), ctx=256)
    draft = target.load_draft(_tiny(d, "Q4_0"))
    return target, draft


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(0, 256, size=int(rng.integers(2, 12))).tolist()
        out.append(base + base[: int(rng.integers(1, len(base) + 1))] if i % 2 else base)
    return out


def _plain(llm, prompt, n):
    """Plain decoding's tokens, and the smallest gap between the two best logits seen."""
    llm.reset()
    seq, m = llm.seq, llm.model
    logits = m.forward(prompt, seq).copy()
    toks, gap = [], np.inf
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        toks.append(int(np.argmax(logits)))
        logits = m.forward([toks[-1]], seq).copy()
    return toks, gap


def _spec(llm, prompt, n, drafter):
    llm.reset()
    return list(llm.generate(prompt, max_tokens=n, sampling=GREEDY, stop_ids=set(), drafter=drafter))


@pytest.mark.parametrize("which", ["draft", "lookup", "draft fixed 4", "lookup fixed 4"])
def test_greedy_equals_plain_decoding(tiny_pair, which):
    target, draft = tiny_pair
    drafter = {"draft": draft, "lookup": PromptLookup(),
               "draft fixed 4": type(draft)(draft.model, draft_min=4, draft_max=4),
               "lookup fixed 4": PromptLookup(draft_min=4, draft_max=4)}[which]
    gaps, drafted, accepted = [], 0, 0
    for prompt in _prompts(24):
        want, gap = _plain(target, prompt, 24)
        got = _spec(target, prompt, 24, drafter)
        assert got == want, prompt
        assert target.seq.tokens == prompt + got[:len(target.seq.tokens) - len(prompt)]
        gaps.append(gap)
        drafted += target.stats.drafted
        accepted += target.stats.accepted
    # the prompts include near ties, and the check ran on both accepted and rejected tokens
    assert min(gaps) < 0.02
    if "fixed" in which or target.model.one_pass_verify:
        assert 0 < accepted <= drafted
    else:
        # a target that checks a token per pass (F16 here) gains nothing from drafts, and
        # the adaptive drafter may turn itself off before any is accepted (usage.md,
        # Speculative decoding); the fixed-length drafters check accepted tokens there
        assert accepted <= drafted
    if "fixed" in which:
        # how much an adaptive drafter drafts follows measured timings (where the tiny
        # draft costs what a target step does, or a loaded machine makes a check cost
        # more, it stops after a few drafts and probes rarely); the same drafters with a
        # fixed length always have rejections
        assert accepted < drafted


def test_rollback_leaves_the_cache_of_plain_decoding(tiny_pair):
    target, draft = tiny_pair
    prompt = [7, 8, 9, 10, 7, 8, 9]
    want, _ = _plain(target, prompt, 30)
    plain_seq = target.seq
    spec = edgellama.load(target.path, ctx=256)      # a second conversation, same weights
    got = list(spec.generate(prompt, max_tokens=30, sampling=GREEDY, stop_ids=set(),
                             drafter=spec.load_draft(draft.model.gguf.path, 3, 3)))
    assert got == want and spec.stats.drafted > spec.stats.accepted > 0
    n = len(spec.seq.tokens)
    assert spec.seq.tokens == plain_seq.tokens[:n]
    plain_seq.truncate(n)
    nxt = [got[n - len(prompt)] if n - len(prompt) < len(got) else 1]
    a = target.model.forward(nxt, plain_seq).copy()
    b = spec.model.forward(nxt, spec.seq).copy()
    np.testing.assert_array_equal(a, b)


def test_verify_rows_are_one_token_steps(tiny_pair):
    # the premise of exactness: verify's rows have the bits of one-token forward() steps
    target, _ = tiny_pair
    m = target.model
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    s = m.new_sequence()
    m.forward(ids[:4], s)
    rows = m.verify(ids[4:], s).copy()
    s.truncate(4)
    one = np.stack([m.forward([t], s).copy() for t in ids[4:]])
    np.testing.assert_array_equal(rows, one)


def test_lookup_proposes_the_latest_longest_match():
    lookup = PromptLookup(ngram_max=3, ngram_min=1)
    s = Sampler(GREEDY)
    # "1 2 3" occurs at 0 and at 6: the latest earlier copy of the tail (6) wins
    assert lookup.propose([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3, s) == ([7, 8, 1], None)
    # no 3- or 2-gram match: the 1-gram 5
    assert lookup.propose([5, 6, 0, 9, 5], 2, s) == ([6, 0], None)
    assert lookup.propose([1, 2, 3], 4, s) == ([], None)
    assert PromptLookup(ngram_min=2).propose([5, 6, 0, 9, 5], 2, s) == ([], None)


def test_draft_length_turns_drafting_off_when_nothing_is_accepted():
    length = DraftLength(0, 8)
    length.observe_verify(1, 0.010)
    for _ in range(40):
        length.observe_verify(9, 0.020)
        length.observe_draft(8, 0.008)
        length.observe_acceptance(8, 0)
    picks = [length.choose() for _ in range(64)]
    assert picks.count(0) >= 60 and max(picks) == 1       # off, but for a rare probe
    for _ in range(40):
        length.observe_acceptance(8, 8)
    # 7 proposals and the last token fill two groups of the 4-row kernel; 8 need a third
    assert length.choose() == 7
    assert DraftLength(0, 8, one_pass_verify=False).verify_rows == 1


@pytest.mark.parametrize("draft_seconds,interval", [(0.004, DraftLength.PROBE_EVERY),
                                                    (0.012, DraftLength.PROBE_RARE)])
def test_draft_length_probes_rarely_when_even_full_acceptance_would_not_pay(draft_seconds,
                                                                          interval):
    # a step of 10 ms, 9 tokens verified in 20 ms: drafts of 4 ms a token pay if accepted
    # (9 tokens in 52 ms), of 12 ms never (2 tokens in 25 ms, 9 in 116, against 1 in 10)
    length = DraftLength(0, 8)
    length.observe_verify(1, 0.010)
    for _ in range(40):
        length.observe_verify(9, 0.020)
        length.observe_draft(8, 8 * draft_seconds)
        length.observe_acceptance(8, 0)
    assert length.probe_interval == interval
    picks = [length.choose() for _ in range(2 * DraftLength.PROBE_RARE)]
    assert picks.count(1) == 2 * DraftLength.PROBE_RARE // interval


def _first_tokens_chi2(llm, drafter, sampling, prompt, draws, n=3):
    """p-value of the hypothesis that the first n sampled tokens are distributed as the
    target's own sampling distribution (its exact probabilities, from plain forward())."""
    sampler, m = Sampler(sampling), llm.model
    seq = m.new_sequence()
    exact = {}

    def walk(prefix, prob):
        seq.truncate(0)
        logits = m.forward(prompt + prefix, seq)
        dist = sampler.distribution(logits, prompt + prefix)
        for t in np.flatnonzero(dist > 0):
            if len(prefix) + 1 == n:
                exact[tuple(prefix) + (int(t),)] = prob * dist[t]
            else:
                walk(prefix + [int(t)], prob * dist[t])
    walk([], 1.0)
    seen, drafted, accepted = {}, 0, 0
    for i in range(draws):
        llm.reset()
        toks = tuple(llm.generate(prompt, max_tokens=n, stop_ids=set(), drafter=drafter,
                                  sampling=SamplingParams(**{**vars(sampling), "seed": 10_000 + i})))
        seen[toks] = seen.get(toks, 0) + 1
        drafted, accepted = drafted + llm.stats.drafted, accepted + llm.stats.accepted
    assert set(seen) <= set(exact)
    keys = sorted(exact, key=exact.get, reverse=True)
    expected = np.array([exact[k] for k in keys]) * draws
    observed = np.array([seen.get(k, 0) for k in keys], float)
    # pool the cells expected below 5 draws into one
    small = expected < 5
    expected = np.append(expected[~small], expected[small].sum())
    observed = np.append(observed[~small], observed[small].sum())
    if expected[-1] == 0:
        expected, observed = expected[:-1], observed[:-1]
    return scipy_stats.chisquare(observed, expected).pvalue, drafted, accepted


@pytest.mark.parametrize("which", ["other model", "quantized copy", "lookup"])
def test_sampling_keeps_the_target_distribution(tmp_path, which):
    target = edgellama.load(_tiny(tmp_path, "Q8_0", dim=32, ffn=64), ctx=64)
    # other random weights: most proposals rejected, the residual max(0, p - q) draws
    # carry the distribution; a Q4_0 copy of the target's: most accepted
    drafter = {"other model": lambda: target.load_draft(_tiny(tmp_path, "Q8_0", seed=5, dim=32, ffn=64), 2, 2),
               "quantized copy": lambda: target.load_draft(_tiny(tmp_path, "Q4_0", dim=32, ffn=64), 2, 2),
               "lookup": lambda: PromptLookup(draft_min=2, draft_max=2)}[which]()
    sampling = SamplingParams(temperature=2.5, top_k=5, top_p=0.98, min_p=0.0)
    # a prompt of text the model samples, so that lookup finds what it is likely to say
    prompt = [40, 41, 42]
    prompt += list(target.generate(prompt, max_tokens=40, stop_ids=set(),
                                   sampling=SamplingParams(**{**vars(sampling), "seed": 1})))
    pvalue, drafted, accepted = _first_tokens_chi2(target, drafter, sampling, prompt, draws=2000)
    assert drafted > accepted > 0                     # both paths taken
    assert pvalue > 1e-3


def test_a_draft_of_another_vocabulary_is_refused(tmp_path, monkeypatch):
    target = edgellama.load(_tiny(tmp_path, "Q8_0"), ctx=64)
    bigger = _tiny(tmp_path, "Q4_0", seed=1, vocab=TINY_VOCAB + 16)
    with pytest.raises(EdgeError, match="271 tokens|287 tokens"):
        target.load_draft(bigger)
    # the same size, two merges in the other order: ids name other strings
    merges = list(tiny_gguf.TINY_MERGES)
    merges[0], merges[1] = merges[1], merges[0]
    monkeypatch.setattr(tiny_gguf, "TINY_MERGES", merges)
    reordered = _tiny(tmp_path, "Q4_0", seed=2)
    with pytest.raises(EdgeError, match="token 256 is") as e:
        target.load_draft(reordered)
    assert "\n" not in str(e.value)
    from edgellama.gguf import GGUFFile
    check_same_vocabulary(GGUFFile(_tiny(tmp_path, "Q8_0")), GGUFFile(_tiny(tmp_path, "Q4_0", seed=3)))


def test_generate_command_drafts_and_reports_it(tmp_path):
    from click.testing import CliRunner

    import edgellama.cli.generate  # noqa: F401  (registers the command)
    from edgellama.cli.main import main
    target, draft = _tiny(tmp_path, "Q8_0"), _tiny(tmp_path, "Q4_0")
    base = ["generate", str(target), "-p", "hello hello hello", "--raw", "--temp", "0", "-n", "24"]
    plain = CliRunner().invoke(main, base)
    assert plain.exit_code == 0, plain.output
    for extra in (["--lookup"], ["--draft", str(draft), "--draft-max", "4"]):
        r = CliRunner().invoke(main, base + extra)
        assert r.exit_code == 0, r.output
        assert r.stdout == plain.stdout
        assert "drafted " in r.stderr and "accepted " in r.stderr
    both = CliRunner().invoke(main, base + ["--lookup", "--draft", str(draft)])
    assert both.exit_code != 0 and "not both" in both.output
    bad = CliRunner().invoke(main, base + ["--draft", str(_tiny(tmp_path, "Q4_0", seed=1, vocab=TINY_VOCAB + 16))])
    assert bad.exit_code == 1 and "does not share the vocabulary" in bad.output
