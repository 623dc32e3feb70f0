"""Sampling values at the edges of what is accepted (a repetition penalty or temperature of
1e-300 or 1e300, the smallest top-p, top-k and seeds far beyond any vocabulary or int64)
sample a token like any other value, silently: no NaN, no overflow, no warning. The range
itself is checked in one place, edgellama.sampling.sampling_problem."""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import warnings
from dataclasses import replace

import numpy as np
import pytest
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

from edgellama.errors import EdgeError
from edgellama.sampling import Sampler, SamplingParams, sampling_problem

EXE = shutil.which("edgellama") or "edgellama"
TINY = 5e-324                      # the smallest positive float64
HUGE = float(np.finfo(np.float64).max)
F32 = float(np.finfo(np.float32).max)

_rng = np.random.default_rng(0)
LOGITS = {
    "normal": _rng.normal(0, 5, 500).astype(np.float32),
    "extreme": np.clip(_rng.normal(0, 1, 500) * 3e38, -F32, F32).astype(np.float32),
    "all_negative": -np.abs(_rng.normal(0, 5, 50)).astype(np.float32) - 1,
    "ties": np.zeros(100, np.float32),
    "with_nan_inf": np.array([np.nan, np.inf, -np.inf, 1, -1, 0] * 10, np.float32),
}
GRID = dict(temperature=[0, TINY, 1e-300, 1e-30, 0.7, 1e30, 1e300, HUGE],
            top_k=[0, 1, 3, 10**30], top_p=[TINY, 1e-300, 0.5, 1.0],
            min_p=[0, TINY, 0.5, 1.0],
            repeat_penalty=[TINY, 1e-300, 1e-30, 1.0, 1e30, 1e300, HUGE],
            seed=[None, 0, 2**64 - 1, 2**64, 10**100])


def test_every_extreme_combination_samples_a_token():
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # an overflow warning is a failure too
        for combo in itertools.product(*GRID.values()):
            params = SamplingParams(**dict(zip(GRID, combo)), repeat_last_n=10**12)
            for name, logits in LOGITS.items():
                history = list(range(len(logits)))[::2]
                sampler = Sampler(params)
                tok = sampler(logits, history)
                assert 0 <= tok < len(logits), (params, name)
                assert name != "with_nan_inf" or np.isfinite(logits[tok]) or logits[tok] > 0


def test_extreme_penalties_mean_what_they_say():
    logits = np.array([5.0, 4.0, 3.0, -1.0], np.float32)
    # a tiny penalty boosts seen tokens without bound (a positive logit divided by 1e-300)
    for p in (TINY, 1e-300):
        s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                   repeat_penalty=p, seed=1))
        assert {s(logits, [2]) for _ in range(50)} == {2}
    # a huge one takes a positive logit to ~0 and a negative one out of reach, silently
    for p in (1e300, HUGE):
        s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                   repeat_penalty=p, seed=1))
        assert 3 not in {s(logits, [3]) for _ in range(300)}
        assert Sampler(replace(s.p, temperature=0))(logits, [0]) == 1


def test_extreme_temperatures():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -3e38], np.float32)
    cold = Sampler(SamplingParams(temperature=TINY, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    assert {cold(logits) for _ in range(100)} == {0}        # greedy in effect
    hot = Sampler(SamplingParams(temperature=HUGE, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    assert {hot(logits) for _ in range(500)} == {0, 1, 2, 3, 4}   # uniform in effect


def test_same_seed_same_tokens_even_when_huge():
    for seed in (2**64, 10**100):
        a = Sampler(SamplingParams(seed=seed))
        b = Sampler(SamplingParams(seed=seed))
        assert [a(LOGITS["normal"]) for _ in range(20)] == [b(LOGITS["normal"]) for _ in range(20)]


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("repeat_penalty", float("inf"), "repeat_penalty must be a finite number"),
    ("repeat_penalty", 0.0, "repeat penalty must be > 0"),
    ("top_p", 0.0, "top-p must be in (0, 1]"),
    ("min_p", 1.5, "min-p must be in [0, 1]"),
    ("seed", -5, "seed must be >= 0"),
])
def test_the_one_range_check(field, value, message):
    fields = {**vars(SamplingParams()), field: value}
    assert sampling_problem(fields).startswith(message)
    with pytest.raises(EdgeError, match=re.escape(message)):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "Q8_0", dim=32,
                           layers=1, heads=2, kv_heads=1, ffn=64, vocab=TINY_VOCAB, tokenizer=True)


@pytest.mark.parametrize("flags", [
    ["--temp", "1e-300", "--repeat-penalty", "1e-300"],
    ["--temp", "5e-324", "--repeat-penalty", "1.7e308", "--top-p", "5e-324"],
    ["--temp", "1e300", "--top-k", str(10**30), "--min-p", "5e-324", "--seed", str(10**40)],
    ["--temp", "1.7e308", "--repeat-penalty", "5e-324", "--top-p", "1", "--min-p", "1"],
])
def test_cli_generate_with_extreme_values(tiny, flags):
    res = subprocess.run([EXE, "generate", "-m", str(tiny),
                          "-p", "a b a b a b", "-n", "8", *flags],
                         capture_output=True, timeout=300)
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 0, err
    assert "Traceback" not in err and "Warning" not in err


@pytest.mark.parametrize("flags, message", [
    (["--temp", "nan"], "temperature must be a finite number"),
    (["--repeat-penalty", "-inf"], "repeat_penalty must be a finite number"),
    (["--repeat-penalty", "0"], "repeat penalty must be > 0"),
])
def test_cli_refuses_values_outside_the_range(tiny, flags, message):
    res = subprocess.run([EXE, "generate", "-m", str(tiny),
                          "-p", "a", "-n", "2", *flags], capture_output=True, timeout=300)
    err = res.stderr.decode(errors="replace")
    # out of range on any model: a usage error (exit 2), one line naming the flag
    lines = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"Error: Invalid value for '{flags[0]}'") and message in lines[0]


def test_server_accepted_extremes_sample():
    """Every extreme of the server's accepted ranges goes through its parser into a
    SamplingParams that samples without error."""
    from edgellama.server.params import _params
    body_values = dict(temperature=[0, TINY, 2], top_p=[TINY, 1], top_k=[0, 10**30],
                       min_p=[0, TINY, 1], repeat_penalty=[TINY, 100],
                       seed=[-2**63, 2**63 - 1, 10**30])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for combo in itertools.product(*body_values.values()):
            body = {"messages": [], **dict(zip(body_values, combo))}
            params = _params(body, SamplingParams(), chat=True).sampling
            for logits in LOGITS.values():
                assert 0 <= Sampler(params)(logits, list(range(0, len(logits), 3))) < len(logits)
