"""Token sampling: repetition penalty, top-k, top-p, min-p, temperature (llama.cpp's order)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .errors import EdgeError

_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7     # 0 = greedy
    top_k: int = 40              # 0 = off
    top_p: float = 0.9           # 1 = off
    min_p: float = 0.05          # 0 = off; drop tokens below min_p × p(best)
    repeat_penalty: float = 1.0  # 1 = off; >1 discourages tokens seen in the last `repeat_last_n`
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        problem = _problem(vars(self))
        if problem:
            raise EdgeError(f"invalid sampling value: {problem}")

    def with_defaults_from(self, meta: Mapping[str, Any],
                           warn: Callable[[str], None] = lambda message: None) -> SamplingParams:
        """Fill from a GGUF's `general.sampling.*` keys (the file's recommendation). A value
        that is not a finite number in range is skipped, and `warn` told why: a bad
        recommendation must not make the model unusable."""
        keys = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
                "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
                "repeat_penalty": "general.sampling.penalty_repeat"}
        found = {}
        for f, k in keys.items():
            if k not in meta:
                continue
            v = meta[k]
            if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_)):
                warn(f"ignoring the file's {k}: it is not a number ({type(v).__name__})")
                continue
            value = type(getattr(self, f))(v) if np.isfinite(v) else float(v)
            problem = _problem({**vars(self), **found, f: value})
            if problem:
                warn(f"ignoring the file's {k} = {v:g}: {problem}")
            else:
                found[f] = value
        return replace(self, **found)


def sampling_problem(fields: Mapping[str, Any]) -> str | None:
    """What is wrong with these SamplingParams field values, if anything: the one range
    check of every sampling value (command line, server, a GGUF's recommendations). Every
    value it accepts samples without error, however extreme."""
    for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
        if not np.isfinite(fields[name]):
            return f"{name} must be a finite number"
    seed = fields["seed"]
    for ok, msg in [
        (fields["temperature"] >= 0, "temperature must be >= 0 (0 means greedy)"),
        (fields["top_k"] >= 0, "top-k must be >= 0 (0 turns it off)"),
        (0 < fields["top_p"] <= 1, "top-p must be in (0, 1]"),
        (0 <= fields["min_p"] <= 1, "min-p must be in [0, 1]"),
        (fields["repeat_penalty"] > 0, "repeat penalty must be > 0 (1 turns it off)"),
        (fields["repeat_last_n"] >= 0, "repeat-last-n must be >= 0"),
        (seed is None or seed >= 0, "seed must be >= 0, or None for a random one"),
    ]:
        if not ok:
            return msg
    return None


_problem = sampling_problem


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        return self.pick(self.adjusted(logits, history))

    def adjusted(self, logits: np.ndarray, history: list[int] | None = None) -> np.ndarray:
        """A float32 copy of `logits` (V,) with NaN/inf made usable and the repetition
        penalty applied: what a grammar mask is applied to, `pick` samples from, and
        log_probs reports."""
        # Every value SamplingParams accepts works, however extreme (a penalty or temperature
        # of 1e-300 or 1e300): the arithmetic is float64, a penalised logit is clipped to
        # float32's range, and no step can make a NaN, so over/underflow is silent.
        with np.errstate(all="ignore"):
            return self._adjusted(logits, history)

    def pick(self, logits: np.ndarray) -> int:
        """One token from adjusted logits: top-k, top-p, min-p, temperature, a draw."""
        if np.isneginf(logits).all():
            raise EdgeError("no token is possible here (every logit is -inf)")
        with np.errstate(all="ignore"):
            return self._pick(logits)

    def _adjusted(self, logits: np.ndarray, history: list[int] | None) -> np.ndarray:
        p = self.p
        logits = logits.astype(np.float32, copy=True)
        if not np.isfinite(logits).all():
            # Corrupt weights give NaN/inf logits: never sample a NaN or -inf, +inf is the top.
            logits = np.nan_to_num(logits, nan=-np.inf, posinf=_F32_MAX, neginf=-np.inf)
            if np.isneginf(logits).all():
                raise EdgeError("the model produced no usable logits (all NaN or -inf): "
                                "its weights are probably corrupt")
        if p.repeat_penalty != 1.0 and history and p.repeat_last_n:
            seen = np.unique(np.asarray(history[-p.repeat_last_n:], dtype=np.int64))
            v = logits[seen].astype(np.float64)
            v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
            # finite stays finite (1e-300 would overflow float32); -inf (unusable) stays
            logits[seen] = np.where(np.isneginf(logits[seen]), -np.inf,
                                    np.clip(v, -_F32_MAX, _F32_MAX))
        return logits

    def distribution(self, logits: np.ndarray, history: list[int] | None = None) -> np.ndarray:
        """The distribution __call__ draws from, over the whole vocabulary (V,) float64:
        a point mass on the best token at temperature 0. Speculative decoding's
        rejection sampling compares the target's and the draft's."""
        adjusted = self.adjusted(logits, history)
        with np.errstate(all="ignore"):
            best, cand, w = self._candidates(adjusted)
        probs = np.zeros(len(logits), np.float64)
        if cand is None:
            probs[best] = 1.0
        else:
            probs[cand] = w / w.sum()
        return probs

    def draw(self, probs: np.ndarray) -> int:
        """A token from a distribution (V,) that sums to 1."""
        return int(self.rng.choice(len(probs), p=probs))

    def _pick(self, logits: np.ndarray) -> int:
        best, cand, w = self._candidates(logits)
        if cand is None:
            return best
        return int(cand[self.rng.choice(len(cand), p=w / w.sum())])

    def _candidates(self, logits: np.ndarray):
        # (argmax, None, None) at temperature 0, else (None, candidate ids, their weights)
        p = self.p
        if p.temperature == 0:
            return int(np.argmax(logits)), None, None
        # Candidates sorted by logit, best first.
        k = p.top_k if 0 < p.top_k < len(logits) else len(logits)
        cand = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
        cand = cand[np.argsort(-logits[cand], kind="stable")]
        # float64 differences from the best: 0 for it, <= 0 or -inf for the rest (in float32
        # the spread of two extreme logits overflows)
        diff = logits[cand].astype(np.float64) - np.float64(logits[cand[0]])
        probs = np.exp(diff)
        probs /= probs.sum()          # >= 1: the best contributes exp(0)
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            cand, probs, diff = cand[:keep], probs[:keep], diff[:keep]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            cand, probs, diff = cand[keep], probs[keep], diff[keep]
        # Temperature last, on the surviving candidates: 0 / t = 0 for the best, and the
        # rest <= 0 or -inf, so the weights are finite with a sum >= 1 for any t > 0.
        return None, cand, np.exp(diff / p.temperature)


def log_probs(logits: np.ndarray) -> np.ndarray:
    """log-softmax (V,) float64 of adjusted logits (-inf stays -inf): what `logprobs`
    reports. Computed from the logits tokens are sampled from (repetition penalty and
    grammar mask applied), before temperature and truncation, as OpenAI's logprobs do
    not change with temperature."""
    x = logits.astype(np.float64)
    top = x.max()
    with np.errstate(divide="ignore", invalid="ignore"):
        return x - top - np.log(np.exp(x - top).sum())
