"""One request's generation: Job (the request's side of it: its Generation, made when it
takes a slot, and the events it sends the event loop) and StopMatcher. Which jobs run, in
which slot and pass, is the engine's (engine.py); the tokens are generation.step's;
nothing here runs the model.

Stop strings are matched on the decoded text across token boundaries. Text that could
be the start of a stop string is held back until it is known not to be one, so no part
of a stop string is ever sent, streamed or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any

from ..constrain import Constraint
from ..generation import Generation
from ..sampling import Sampler
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
    completes, [] unless asked for."""

    def __init__(self, ids: list[int], max_tokens: int, params: Params,
                 constraint: Constraint | None = None):
        self.ids, self.max_tokens, self.params = ids, max_tokens, params
        self.constraint = constraint
        self._logprobs_sent = 0
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        # generation state, touched by the engine thread only
        self.slot: Slot | None = None
        self.reused = 0                # prompt tokens the slot's cache already held
        self.matcher = StopMatcher(params.stops)
        self.gen: Generation | None = None   # from when it takes a slot (start)
        self.t_admitted = 0.0          # perf_counter when it took its slot, and when its
        self.t_generating: float | None = None   # prompt was read (None: not yet): /metrics

    def start(self, slot: Slot, tokenizer) -> None:
        """Take `slot`: the reply's Generation on its sequence (and drafter), fed the
        prompt's last token in its first step, its text sent as it comes."""
        p = self.params
        self.slot = slot
        self.gen = Generation(
            seq=slot.seq, history=list(self.ids), sampler=Sampler(p.sampling),
            max_tokens=self.max_tokens, stops=tokenizer.stop_ids, constraint=self.constraint,
            top_logprobs=p.top_logprobs, decoder=StreamDecoder(tokenizer),
            matcher=self.matcher, drafter=slot.drafter, length=slot.length,
            draft_max=p.draft_max, next_token=self.ids[-1],
            on_text=lambda text: self.emit("text", text,
                                           self.take_logprobs(self.gen.count, tokenizer)))

    # the reply so far, for usage: its tokens, and proposals checked and kept
    @property
    def history(self) -> list[int]:
        return self.gen.history if self.gen else self.ids

    @property
    def count(self) -> int:
        return self.gen.count if self.gen else 0

    @property
    def drafted(self) -> int:
        return self.gen.drafted if self.gen else 0

    @property
    def accepted(self) -> int:
        return self.gen.accepted if self.gen else 0

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
               for tok, lp, top in self.gen.logprobs[self._logprobs_sent:upto]]
        self._logprobs_sent = max(self._logprobs_sent, upto)
        return out


def _logprob_entry(tokenizer, tok: int, lp: float, top: list[tuple[int, float]]) -> dict:
    def one(i: int, v: float) -> dict:
        b = tokenizer.token_bytes(i)
        # a probability that underflows to 0 gives -inf, which is not JSON: OpenAI's floor
        return {"token": b.decode("utf-8", "replace"), "logprob": max(v, -9999.0),
                "bytes": list(b)}
    return {**one(tok, lp), "top_logprobs": [one(i, v) for i, v in top]}
