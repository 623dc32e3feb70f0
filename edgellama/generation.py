"""The generation core: one reply's per-token state (Generation) and step(), which
advances several replies by one batched pass over the weights. LLM.generate (one reply,
with or without a drafter) and the server's engine (a reply per busy slot) both run
their replies through step(), so sampling, grammars, stops, speculative decoding and
logprobs are the same code everywhere.

A step feeds each reply's last chosen token (its `next_token`), with the proposals a
drafter adds where speculative.plan_step says they pay, in one Transformer.decode; then
each reply takes its tokens from its rows: the token plain decoding would choose from
each row (at temperature 0 the sampler's greedy choice; with sampling a proposal passes
speculative.rejection_test), as long as the proposals fed after it are the tokens
chosen. The cache is cut back to the tokens kept, so between steps a reply's sequence
holds its history but the last token (less a run a context shift dropped), and a caller
may stop after any step.

A reply ends ("finish_reason") at a stop token (not part of it, "stop"), a stop string
(the text before it, "stop"), its grammar's end (at once: only a stop token can follow,
"stop"), max_tokens ("length"), or a full context (`full`: the server says "length",
generate "context full"; with `shift_keep`, a context shift instead, as llama.cpp's).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .constrain import Constraint, GrammarError, sample
from .model import Transformer
from .sampling import Sampler, log_probs
from .scratch import Scratch
from .sequence import Sequence
from .speculative import DraftLength, Drafter, PassCost, plan_step, rejection_test
from .tokenizer import StreamDecoder


class TextStop(Protocol):
    """Stop strings over the streamed text (the server's StopMatcher)."""

    def push(self, text: str) -> tuple[str, bool]: ...

    def flush(self) -> str: ...


@dataclass(eq=False, kw_only=True)
class Generation:
    """One reply being generated: what it was asked (sampler, stops, grammar, budget),
    where it stands (history, the token to feed next, its count, its finish) and what it
    reports (text, logprobs, proposals kept). It starts either from the prompt's
    next-token `logits` (generate, which read the whole prompt) or with `next_token`
    to feed (the server, which reads all of it but the last token)."""
    seq: Sequence
    history: list[int]                   # the prompt and the reply so far (penalties,
                                         # drafters and custom picks look back on it)
    sampler: Sampler
    max_tokens: int
    stops: Collection[int]               # token ids that end the reply
    constraint: Constraint | None = None
    pick: Callable[[np.ndarray, list[int]], int] | None = None   # replaces sample()
    top_logprobs: int | None = None      # record each token's logprob and the best others
    decoder: StreamDecoder | None = None   # with these two, the reply's text is streamed
    matcher: TextStop | None = None        # to on_text, stop strings held back
    on_text: Callable[[str], None] | None = None
    drafter: Drafter | None = None       # speculative decoding: its proposals, their
    length: DraftLength | None = None    # lengths chosen on its measurements,
    draft_max: int | None = None         # capped per reply (0: none)
    full: str = "length"                 # the finish reason when the context fills
    shift_keep: int | None = None        # or: keep that many first tokens, drop half the
                                         # rest and go on (not while drafting)
    logits: np.ndarray | None = None     # the next token's, when known without a pass
    next_token: int | None = None        # chosen, not yet in the cache
    count: int = 0                       # tokens generated (a stop token is not one)
    finish_reason: str | None = None
    tail: str | None = None              # text held back at the end, flushed (None: a
                                         # stop string ended it, the rest is dropped)
    error: GrammarError | None = None    # its grammar gave up: this reply fails alone
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    drafted: int = 0                     # proposals checked, and of them kept
    accepted: int = 0
    shifts: int = 0
    draft_started: bool = False          # the drafter has read the prompt

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def may_draft(self) -> bool:
        """Whether proposals can be checked for this reply: at temperature 0 any (each
        check is the plain step's own choice, grammar and logprobs included); with
        sampling not under a grammar (rejection sampling knows no mask); never with a
        custom pick, or a reply that asked for none (draft_max 0)."""
        return (self.length is not None and self.pick is None and self.draft_max != 0
                and (self.constraint is None or self.sampler.p.temperature == 0))

    def choose(self, logits: np.ndarray) -> int:
        """The next token from next-token logits (V,): the repetition penalty, the
        grammar's mask, the sampler; records its logprobs if asked (from these adjusted
        logits, before temperature: see sampling.log_probs) and moves the grammar past it."""
        if self.pick is not None:
            return self.pick(logits, self.history)
        tok, adjusted = sample(self.sampler, logits, self.history, self.constraint,
                               self.max_tokens - self.count)
        self._record_logprobs(tok, adjusted)
        return tok

    def _record_logprobs(self, tok: int, adjusted: np.ndarray) -> None:
        top = self.top_logprobs
        if top is not None:
            lp = log_probs(adjusted)
            best = np.argsort(-lp, kind="stable")[:top] if top else []
            self.logprobs.append((tok, float(lp[tok]), [(int(i), float(lp[i])) for i in best
                                                        if np.isfinite(lp[i])]))

    def _take(self, rows: np.ndarray, base: int, drafts: list[int], q: np.ndarray | None,
              probe: int | None, model: Transformer) -> None:
        """The reply's tokens from its rows (`base`: the cache position of the token fed
        first, whose next-token logits are rows[0]); the cache cut back to the last one
        kept."""
        accepted = 0
        self.drafted += len(drafts)      # counted before a token ends the reply (usage)
        for i, row in enumerate(rows):
            d = drafts[i] if i < len(drafts) else None
            if d is not None and self.sampler.p.temperature > 0:
                ok, tok = rejection_test(self.sampler, row, self.history, d,
                                         None if q is None else q[i])
                tok = d if ok else tok
                if self.top_logprobs is not None:
                    self._record_logprobs(tok, self.sampler.adjusted(row, self.history))
            else:
                tok = self.choose(row)
                ok = tok == d
            accepted += ok
            self._advance(tok, base + 1 + i, model)
            if not ok or self.done:   # rejected, or the reply ended
                break
        self.accepted += accepted
        self.seq.truncate(base + 1 + accepted)   # the rows after the last token kept
        if drafts:
            self.length.observe_acceptance(len(drafts), accepted)
        elif probe is not None:
            self.length.observe_acceptance(1, int(tok == probe))

    def _advance(self, tok: int, cached: int, model: Transformer) -> None:
        """Take a chosen token (`cached`: the positions the cache holds before it): its
        text, or the reply's end."""
        if tok in self.stops:
            self._finish("stop")
            return
        self.count += 1
        self.history.append(tok)
        hit = False
        if self.decoder is not None:
            text, hit = self.matcher.push(self.decoder.push(tok))
            if text and self.on_text is not None:
                self.on_text(text)
        if hit:
            self._finish("stop", flush=False)
        elif self.constraint is not None and self.constraint.finished:
            self._finish("stop")   # its end: no step for the stop token, whatever the budget
        elif cached >= self.seq.ctx and not self._shift(model):
            self._finish(self.full)
        elif self.count >= self.max_tokens:
            self._finish("length")
        else:
            self.next_token = tok

    def _shift(self, model: Transformer) -> bool:
        """Make room in a full cache (shift_keep), if it can; whether it did."""
        seq, keep = self.seq, self.shift_keep
        if keep is None or seq.pos - keep < 2 or not seq.cache.can_shift:
            return False
        seq.shift(keep, (seq.pos - keep) // 2, model.inv_freq)
        self.shifts += 1
        return True

    def _finish(self, reason: str, flush: bool = True) -> None:
        self.next_token = None
        if flush and self.decoder is not None:   # a partial character, a held-back tail
            text, hit = self.matcher.push(self.decoder.flush())
            self.tail = text + ("" if hit else self.matcher.flush())
            reason = "stop" if hit else reason
        self.finish_reason = reason


def step(gens: list[Generation], model: Transformer, scratch: Scratch | None = None,
         costs: PassCost | None = None, alone: bool = False) -> None:
    """Advance each unfinished generation by its tokens of one step. Those whose next
    token's logits are known take it from them, without a pass; the others feed their
    next token (and proposals: `costs`, the measured pass costs, enables speculative
    decoding) in one Transformer.decode over `scratch` (default: the first sequence's).
    A generation whose grammar gives up ends with `error`, not the others.

    Drafting beside other sequences (the server) adds as few rows as it can: plan_step
    weighs them all, proposals stop short of the reply's last token (the pass's own row
    gives it), and a drafter left off probes now and then (DraftLength.probe) by
    comparing one proposal with the token its plain step chooses, without a row.
    `alone` (generate, one sequence, as it has always drafted): DraftLength.choose,
    whose probe is a one-token draft, and proposals may run to the last token."""
    fed = []
    for g in gens:
        if g.done:
            continue
        if g.logits is not None:
            logits, g.logits = g.logits, None
            _guard(g, g._take, logits[None], g.seq.pos - 1, [], None, None, model)
        else:
            fed.append(g)
    if not fed:
        return
    plans = _drafts(fed, costs, alone) if costs else [([], None, None)] * len(fed)
    counts = [1 + len(d) for d, _, _ in plans]
    bases = [g.seq.pos for g in fed]
    t0 = time.perf_counter()
    logits = model.decode([g.seq for g in fed],
                          [t for g, (d, _, _) in zip(fed, plans) for t in [g.next_token, *d]],
                          scratch, counts)
    if costs:
        costs.observe(sum(counts), time.perf_counter() - t0)
    start = 0
    for g, (d, q, probe), n, base in zip(fed, plans, counts, bases):
        rows, start = logits[start:start + n], start + n
        _guard(g, g._take, rows, base, d, q, probe, model)


def _guard(g: Generation, fn, *args) -> None:
    try:
        fn(*args)
    except GrammarError as e:
        g.error = e


def _drafts(gens: list[Generation], costs: PassCost, alone: bool
            ) -> list[tuple[list[int], np.ndarray | None, int | None]]:
    """Each generation's proposals for this step, the distributions they were drawn
    from (None: a point mass), and a probe (a proposal to compare with the plain step's
    token, not fed) or None."""
    lengths = [g.length if g.may_draft else None for g in gens]
    room = [min(g.max_tokens - g.count + alone, g.seq.ctx - g.seq.pos) - 1 for g in gens]
    room = [r if g.draft_max is None else min(r, g.draft_max) for g, r in zip(gens, room)]
    if alone:
        ks = [0 if L is None else min(L.choose(), r) for L, r in zip(lengths, room)]
    else:
        ks = plan_step(lengths, room, costs)
    out = []
    for g, L, k in zip(gens, lengths, ks):
        probe = not alone and L is not None and L.probe(k)
        if not (k or probe):
            out.append(([], None, None))
            continue
        if not g.draft_started:   # a draft model reads the prompt: not a draft's cost
            g.drafter.start(g.history)
            g.draft_started = True
        if probe:   # not timed: a draft model catches up on the steps since the last
            d, _ = g.drafter.propose(g.history, 1, g.sampler)
            out.append(([], None, d[0] if d else None))
            continue
        t0 = time.perf_counter()
        d, q = g.drafter.propose(g.history, k, g.sampler)
        L.observe_draft(len(d), time.perf_counter() - t0)
        out.append((d, q, None))
    return out
