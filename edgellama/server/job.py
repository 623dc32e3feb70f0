"""One request's generation: Job (its per-token state and the events it sends the
event loop), sample_token (the one per-token step: penalties, the job's grammar mask, its
sampler, logprobs) and StopMatcher. Which jobs run, in which slot and pass, is the
engine's (engine.py); nothing here runs the model.

Stop strings are matched on the decoded text across token boundaries. Text that could
be the start of a stop string is held back until it is known not to be one, so no part
of a stop string is ever sent, streamed or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ..constrain import Constraint, sample
from ..sampling import Sampler, log_probs
from ..tokenizer import StreamDecoder
from .params import Params

if TYPE_CHECKING:
    from .engine import Slot


class StopMatcher:
    """Finds stop strings in streamed text; holds back any tail that could begin one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.hit: str | None = None   # the stop string reached (the earliest one in the text)

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop string was reached (the text before
        it is what is returned; the rest of the reply is dropped)."""
        p = self.pending + text
        hits = [(i, k) for k, s in enumerate(self.stops) if (i := p.find(s)) >= 0]
        if hits:
            at, k = min(hits)
            self.pending, self.hit = "", self.stops[k]
            return p[:at], True
        keep = 0
        for s in self.stops:   # the longest tail of p that is a prefix of some stop string
            i = p.find(s[0], max(0, len(p) - len(s) + 1))
            while i >= 0 and len(p) - i > keep:
                if s.startswith(p[i:]):
                    keep = len(p) - i
                    break
                i = p.find(s[0], i + 1)
        self.pending = p[len(p) - keep:]
        return p[:len(p) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Job:
    """One request's generation; the engine thread reports to the event loop as events:
    ("text", str, logprobs), ("done", finish_reason, usage), ("error", ApiError),
    ("cancelled",). logprobs: the entries (OpenAI's chat shape) of the tokens the text
    completes, [] unless asked for.

    Its per-token state is here, so one function (sample_token) picks its next token
    whatever else the engine decodes in the same step: the sampler (its own random
    stream), the grammar position, the logprobs recorded."""

    def __init__(self, ids: list[int], max_tokens: int, params: Params,
                 constraint: Constraint | None = None):
        self.ids, self.max_tokens, self.params = ids, max_tokens, params
        self.sampler = Sampler(params.sampling)
        self.constraint = constraint
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._logprobs_sent = 0
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        # generation state, touched by the engine thread only
        self.history = list(ids)       # what the repetition penalty looks back on
        self.slot: Slot | None = None
        self.reused = 0                # prompt tokens the slot's cache already held
        self.count = 0                 # tokens generated
        self.next_token = ids[-1]      # fed to the next decode step: the prompt's last,
                                       # then each sampled one
        self.decoder: StreamDecoder | None = None
        self.matcher = StopMatcher(params.stops)
        self.drafted = self.accepted = 0   # speculative decoding: tokens proposed, kept
        self.draft_started = False     # the slot's drafter has read the prompt
        self.t_admitted = 0.0          # perf_counter when it took its slot, and when its
        self.t_generating: float | None = None   # prompt was read (None: not yet): /metrics

    @property
    def may_draft(self) -> bool:
        """Whether proposals can be checked for this reply: at temperature 0 any reply
        (each check is sample_token's own choice, grammar and logprobs included); with
        sampling not under a grammar (rejection sampling knows no mask); not when the
        request asked for none (speculative.n_max 0)."""
        return (self.constraint is None or self.params.sampling.temperature == 0) \
            and self.params.draft_max != 0

    @property
    def reading(self) -> bool:
        """Still reading its prompt: the cache lacks more than the last prompt token
        (which the first decode step feeds)."""
        return self.slot.seq.pos < len(self.ids) - 1

    def emit(self, *event: Any) -> None:
        with contextlib.suppress(RuntimeError):   # the loop is closed: the server has stopped
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)

    def take_logprobs(self, upto: int, tokenizer) -> list[dict]:
        """The logprob entries of tokens [sent, upto) in OpenAI's chat shape."""
        out = [_logprob_entry(tokenizer, tok, lp, top)
               for tok, lp, top in self.logprobs[self._logprobs_sent:upto]]
        self._logprobs_sent = max(self._logprobs_sent, upto)
        return out


def sample_token(job: Job, logits: np.ndarray, history: list[int]) -> int:
    """The next token of `job` from its next-token logits (V,): the repetition penalty,
    the job's grammar mask (-inf on what the grammar forbids), its sampler; records the
    token's logprobs if asked (from these adjusted logits, before temperature: see
    sampling.log_probs) and advances the grammar past the token."""
    tok, adjusted = sample(job.sampler, logits, history, job.constraint,
                           job.max_tokens - job.count)
    _record_logprobs(job, tok, adjusted)
    return tok


def _record_logprobs(job: Job, tok: int, adjusted: np.ndarray) -> None:
    top = job.params.top_logprobs
    if top is not None:
        lp = log_probs(adjusted)
        best = np.argsort(-lp, kind="stable")[:top] if top else []
        job.logprobs.append((tok, float(lp[tok]), [(int(i), float(lp[i])) for i in best
                                                   if np.isfinite(lp[i])]))


def _logprob_entry(tokenizer, tok: int, lp: float, top: list[tuple[int, float]]) -> dict:
    def one(i: int, v: float) -> dict:
        b = tokenizer.token_bytes(i)
        # a probability that underflows to 0 gives -inf, which is not JSON: OpenAI's floor
        return {"token": b.decode("utf-8", "replace"), "logprob": max(v, -9999.0),
                "bytes": list(b)}
    return {**one(tok, lp), "top_logprobs": [one(i, v) for i, v in top]}
