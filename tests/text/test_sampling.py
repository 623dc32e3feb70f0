"""The sampler: each filter does what it says, seeds reproduce, bad values are refused."""
from collections import Counter

import numpy as np
import pytest

from edgellama.errors import EdgeError
from edgellama.sampling import Sampler, SamplingParams

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))   # probabilities at T=1


def draws(params, n=4000, logits=LOGITS, history=None):
    s = Sampler(params)
    return Counter(s(logits, history) for _ in range(n))


def test_greedy_is_argmax():
    assert draws(SamplingParams(temperature=0), n=5) == Counter({0: 5})


def test_plain_sampling_follows_the_distribution():
    c = draws(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=1))
    freq = np.array([c[i] for i in range(4)]) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_k_top_p_min_p_cut_the_tail():
    assert set(draws(SamplingParams(temperature=1, top_k=2, top_p=1, min_p=0, seed=2))) == {0, 1}
    # cumulative 0.5, 0.8, 0.95: top-p 0.75 keeps the first two
    assert set(draws(SamplingParams(temperature=1, top_k=0, top_p=0.75, min_p=0, seed=3))) == {0, 1}
    # min-p 0.2 keeps tokens with p >= 0.1 (0.2 × 0.5)
    assert set(draws(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.2, seed=4))) == {0, 1, 2}


def test_low_temperature_sharpens():
    c = draws(SamplingParams(temperature=0.1, top_k=0, top_p=1, min_p=0, seed=5))
    assert c[0] > 3900


def test_repeat_penalty_discourages_recent_tokens():
    logits = np.array([2.0, 1.9, -1.0], np.float32)
    greedy = SamplingParams(temperature=0, repeat_penalty=1.5)
    assert Sampler(greedy)(logits, history=[0]) == 1          # 2.0 / 1.5 < 1.9
    assert Sampler(greedy)(logits, history=[2]) == 0


def test_seed_reproduces():
    p = SamplingParams(temperature=1, seed=42)
    a, b = Sampler(p), Sampler(p)
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]


@pytest.mark.parametrize("kwargs,msg", [
    ({"temperature": -1}, "temperature must be >= 0"), ({"top_p": 0}, "top-p"),
    ({"top_p": 1.5}, "top-p"), ({"min_p": 2}, "min-p"), ({"repeat_penalty": 0}, "repeat penalty"),
    ({"top_k": -3}, "top-k"), ({"temperature": float("nan")}, "finite"),
])
def test_invalid_values_are_refused(kwargs, msg):
    with pytest.raises(EdgeError, match=msg):
        SamplingParams(**kwargs)


def test_defaults_from_the_file():
    meta = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.9, "general.sampling.top_k": 20,
            "general.sampling.penalty_repeat": 1.1}
    p = SamplingParams().with_defaults_from(meta)
    assert (p.temperature, p.top_p, p.top_k, p.repeat_penalty) == \
        (pytest.approx(0.6), pytest.approx(0.9), 20, pytest.approx(1.1))


@pytest.mark.parametrize("key,value,why", [
    ("general.sampling.temp", float("nan"), "temperature must be a finite number"),
    ("general.sampling.temp", float("inf"), "temperature must be a finite number"),
    ("general.sampling.temp", -0.5, "temperature must be >= 0"),
    ("general.sampling.top_p", 2.0, "top-p must be in (0, 1]"),
    ("general.sampling.top_k", -3, "top-k must be >= 0"),
    ("general.sampling.min_p", "0.1", "it is not a number (str)"),
    ("general.sampling.penalty_repeat", True, "it is not a number (bool)"),
])
def test_bad_defaults_in_the_file_are_skipped_with_a_warning(key, value, why):
    meta = {key: value, "general.sampling.top_k": 20} if key != "general.sampling.top_k" else {key: value}
    warnings = []
    p = SamplingParams().with_defaults_from(meta, warnings.append)
    assert len(warnings) == 1 and warnings[0].startswith(f"ignoring the file's {key}") and why in warnings[0]
    assert p.top_k == (40 if key == "general.sampling.top_k" else 20)   # the valid keys still apply
    assert p.temperature == SamplingParams().temperature or key != "general.sampling.temp"


def test_seed():
    assert SamplingParams(seed=0).seed == 0
    with pytest.raises(EdgeError, match="seed must be >= 0, or None for a random one"):
        SamplingParams(seed=-1)
