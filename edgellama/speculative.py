"""Speculative decoding: a drafter proposes the next few tokens, the target model checks
them all in one pass over its weights (Transformer.verify's rows, in the step's
Transformer.decode) and keeps the longest prefix it agrees with, plus one token of its
own. Decode reads every weight once per step, so checking k tokens costs little more
than producing one.

Two drafters: DraftModel (a smaller model with the same vocabulary, its own KV cache)
and PromptLookup (tokens copied from where the latest n-gram of the text last occurred
in the prompt or the reply: llama.cpp's lookup decoding, for summaries, edits and code).

Exactness. At temperature 0 the tokens are those of plain decoding: verify() computes
every row with decode's kernels, exactly as a one-token step does (the record formats'
multi-token kernel gives each row the one-token matvec's bits; the other formats run a
matvec per row), and each check is the sampler's own greedy choice. With sampling,
proposals pass by rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept
d with probability min(1, p(d)/q(d)), else draw from max(0, p - q) normalised, with p
and q the target's and draft's distributions after the same temperature/top-k/top-p/
min-p/penalty processing (Sampler.distribution), so every token is distributed as the
target's. Prompt lookup's proposals are a point mass (q(d) = 1).

Adaptive length (DraftLength) keeps each step's draft length where the measured
acceptance and costs say it pays, and drafts nothing when it would not. plan_step makes
that choice for a whole step, whose proposals may share a pass with other sequences'
tokens (the server's); generation.step, the one decode loop, runs the checks.
"""
from __future__ import annotations

import numpy as np

from .errors import EdgeError
from .gguf import GGUFFile
from .model import Transformer
from .sampling import Sampler
from .kernels.simd import TOKENS
from .sequence import Sequence

DRAFT_MAX = 16        # llama.cpp's --draft-max default
DRAFT_MIN = 0         # 0: a step may draft nothing when drafting does not pay
# The most a step drafts, whatever is asked: the step's check computes a row of logits per
# token (257 rows of a 128K vocabulary: 130 MiB) and choosing the length weighs every
# length up to it; proposals that long are all accepted too rarely to pay.
MAX_DRAFT = 256


def draft_limit(ctx: int) -> int:
    """The most tokens a step can draft in a context of ctx tokens: its check (the
    drafts and the token before them) must fit the context, and MAX_DRAFT."""
    return max(1, min(MAX_DRAFT, ctx - 1))


class Drafter:
    """Proposes tokens that may follow a text; draft_min..draft_max bound how many per
    step (DraftLength picks within them, and keeps its measurements across replies)."""

    name = "drafter"

    def __init__(self, draft_min: int = DRAFT_MIN, draft_max: int = DRAFT_MAX):
        if not 0 <= draft_min <= draft_max or draft_max < 1:
            raise EdgeError(f"draft lengths must satisfy 0 <= --draft-min <= --draft-max and "
                            f"--draft-max >= 1, got {draft_min} and {draft_max}")
        self.draft_min, self.draft_max = draft_min, draft_max
        self.length: DraftLength | None = None

    def bounded(self, ctx: int) -> tuple[int, int]:
        """(draft_min, draft_max) bounded by draft_limit(ctx): what a step may draft."""
        limit = draft_limit(ctx)
        return min(self.draft_min, limit), min(self.draft_max, limit)

    def length_for(self, target: Transformer) -> DraftLength:
        """The draft-length chooser of this drafter checking for `target`, its lengths
        bounded by the target's context."""
        if self.length is None:
            self.length = DraftLength(*self.bounded(target.ctx), target.one_pass_verify)
        return self.length

    def copy(self) -> Drafter:
        """A drafter of the same settings for another sequence (a server slot): its own
        state (a draft model's KV cache) and measurements."""
        raise NotImplementedError

    def start(self, prompt: list[int]) -> None:
        """Read the prompt ahead of the reply (generate counts it as prompt time)."""

    def propose(self, history: list[int], k: int, sampler: Sampler) -> tuple[list[int], np.ndarray | None]:
        """Up to k tokens that may follow `history`, and the distributions (n, V) they
        were drawn from, or None when they were chosen deterministically (a point mass:
        greedy drafting, lookup)."""
        raise NotImplementedError


class PromptLookup(Drafter):
    """Proposals copied from the text so far: the tokens that followed the latest earlier
    occurrence of its last n tokens, n from ngram_max down to ngram_min (the longest
    match wins, the most recent among equals)."""

    name = "lookup"

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, draft_min: int = DRAFT_MIN,
                 draft_max: int = DRAFT_MAX):
        super().__init__(draft_min, draft_max)
        if not 1 <= ngram_min <= ngram_max:
            raise EdgeError(f"lookup n-gram sizes must satisfy 1 <= min <= max, got "
                            f"{ngram_min}..{ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def copy(self):
        return PromptLookup(self.ngram_max, self.ngram_min, self.draft_min, self.draft_max)

    def propose(self, history, k, sampler):
        h = np.asarray(history, dtype=np.int64)
        L = len(h)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            # starts i < L - n of an earlier copy of the last n tokens
            match = h[:L - n] == h[L - n]
            for j in range(1, n):
                match[:L - n - j] &= h[j:L - n] == h[L - n + j]
                match[L - n - j:] = False
            starts = np.flatnonzero(match)
            if len(starts):
                i = int(starts[-1]) + n
                return h[i:i + k].tolist(), None
        return [], None


class DraftModel(Drafter):
    """A smaller model of the same vocabulary drafting token by token, greedily at
    temperature 0, else sampled with the target's sampling settings; it keeps its own
    KV cache, rolled back to the text's common prefix at each proposal."""

    name = "draft model"

    def __init__(self, model: Transformer, draft_min: int = DRAFT_MIN, draft_max: int = DRAFT_MAX):
        super().__init__(draft_min, draft_max)
        self.model = model
        self.seq: Sequence = model.new_sequence()

    def copy(self):
        return DraftModel(self.model, self.draft_min, self.draft_max)

    def start(self, prompt):
        n = self.seq.reuse_prefix(prompt)
        if len(prompt) <= self.seq.ctx:
            self.model.forward(prompt[n:], self.seq)

    def propose(self, history, k, sampler):
        seq = self.seq
        k = min(k, seq.ctx - len(history))
        if k <= 0:
            return [], None
        n = seq.reuse_prefix(history)
        logits = self.model.forward(history[n:], seq)
        greedy = sampler.p.temperature == 0
        tokens, dists, text = [], [], list(history)
        for i in range(k):
            if greedy:
                tok = sampler(logits, text)
            else:
                q = sampler.distribution(logits, text)
                tok = sampler.draw(q)
                dists.append(q)
            tokens.append(tok)
            text.append(tok)
            if i + 1 < k:
                logits = self.model.forward([tok], seq)
        return tokens, (None if greedy else np.stack(dists))


def check_same_vocabulary(target: GGUFFile, draft: GGUFFile) -> None:
    """Refuse a draft whose token ids mean other strings than the target's: same
    tokenizer model, same number of tokens, and the same string at every id."""
    def vocab(g):
        tokens = g.get("tokenizer.ggml.tokens")
        return g.get("tokenizer.ggml.model"), tokens if isinstance(tokens, list) else []

    (tm, tt), (dm, dt) = vocab(target), vocab(draft)
    problem = None
    if not tt or not dt:
        problem = "one of them has no tokenizer"
    elif tm != dm:
        problem = f"its tokenizer is {dm!r}, the target's {tm!r}"
    elif len(tt) != len(dt):
        problem = f"it has {len(dt)} tokens, the target {len(tt)}"
    else:
        diff = next((i for i, (a, b) in enumerate(zip(tt, dt)) if a != b), None)
        if diff is not None:
            problem = f"token {diff} is {dt[diff]!r} in the draft, {tt[diff]!r} in the target"
    if problem:
        raise EdgeError(f"the draft model {draft.path.name} does not share the vocabulary of "
                        f"{target.path.name} ({problem}); use a draft from the same model family")


class PassCost:
    """Measured seconds of the target's decode passes over T tokens (one sequence's
    check, or several sequences' batched step): v(T) = c1 + s·(rows(T) - 1), c1 a
    one-token pass, s each further row, each a moving average of measured passes, T
    counted in whole groups of verify_rows (the record formats' kernel multiplies 4 rows
    at a time: 8 tokens cost what 5 do)."""

    DECAY = 0.9           # weight of the past in the moving averages

    def __init__(self, one_pass_verify: bool = True):
        self.step = None                  # c1: seconds of a one-token pass
        # s / c1 before any measurement: what a record format's verify costs per extra
        # token, about; a matvec per token costs a whole step
        self._prior_slope = 0.1 if one_pass_verify else 1.0
        self.verify_rows = TOKENS if one_pass_verify else 1
        self.slope = None                 # s: seconds per extra row

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens == 1:
            self.step = _ema(self.step, seconds, self.DECAY)
        elif self.step is not None:
            self.slope = _ema(self.slope, max(0.0, seconds - self.step) / (self.rows(tokens) - 1),
                              self.DECAY)

    def rows(self, tokens: int) -> int:
        """The rows a pass over `tokens` costs: padded to whole groups."""
        return -(-tokens // self.verify_rows) * self.verify_rows if tokens > 1 else 1

    def seconds(self, tokens: int) -> float:
        """v(tokens); needs one measured one-token pass (step)."""
        s = self.slope if self.slope is not None else self._prior_slope * self.step
        return self.step + s * (self.rows(tokens) - 1)


def _ema(old, new, decay):
    return new if old is None else decay * old + (1 - decay) * new


class DraftLength:
    """Chooses each step's draft length from measured costs and acceptance.

    A step that verifies k proposals costs v(k+1) + k·d (v: the target's pass over k+1
    tokens, PassCost; d: drafting one token) and yields 1 + a + ... + a^k tokens on
    average, for a per-token acceptance a. The length with the most tokens per second
    wins; with draft_min 0, none (a plain step) unless it beats plain decoding. While
    drafting is off, every probe_interval-th step drafts draft_min or 1 token, to notice
    when proposals start to be accepted. `costs` may be shared (the server's slots
    measure the same passes)."""

    PROBE_EVERY = 16
    PROBE_RARE = 256      # steps between probes when not even accepting all would pay
    DECAY = PassCost.DECAY

    def __init__(self, draft_min: int = DRAFT_MIN, draft_max: int = DRAFT_MAX,
                 one_pass_verify: bool = True, costs: PassCost | None = None):
        self.draft_min, self.draft_max = draft_min, draft_max
        self.costs = costs or PassCost(one_pass_verify)
        self.draft_cost = 0.0             # d: seconds per drafted token
        self.accepted = self.trials = 0.0
        self._off_steps = 0

    @property
    def verify_rows(self) -> int:
        return self.costs.verify_rows

    @property
    def acceptance(self) -> float:
        # the chance a proposal is accepted given the ones before it were (a Beta(1, 1) prior)
        return (self.accepted + 1) / (self.trials + 2)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.costs.observe(tokens, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_cost = _ema(self.draft_cost or None, seconds / tokens, self.DECAY)

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        # a truncated geometric: `accepted` successes, then a failure unless all passed
        self.accepted = self.DECAY * self.accepted + accepted
        self.trials = self.DECAY * self.trials + accepted + (accepted < proposed)

    def gain(self, k: int) -> float:
        """Tokens that k proposals add to a step on average: a + a^2 + ... + a^k."""
        a = self.acceptance
        return sum(a ** i for i in range(1, k + 1))

    def expected_speed(self, k: int) -> float:
        """Tokens per second of steps drafting k tokens, as measured so far."""
        return (1 + self.gain(k)) / (self.costs.seconds(k + 1) + self.draft_cost * k)

    @property
    def probe_interval(self) -> int:
        """Steps between probes while drafting is off: PROBE_RARE when the measured costs
        say that even proposals all accepted would not beat a plain step (a draft about
        as slow as the target), since a probe costs a draft model its catch-up on the
        steps since the last; PROBE_EVERY otherwise."""
        c = self.costs
        if c.step is None or not self.draft_cost:
            return self.PROBE_EVERY
        best = max(((k + 1) / (c.seconds(k + 1) + self.draft_cost * k)
                    for k in range(1, self.draft_max + 1)), default=0.0)
        return self.PROBE_EVERY if best > 1 / c.step else self.PROBE_RARE

    def probe(self, k: int) -> bool:
        """Whether a step that plan_step gave k proposals probes: one proposal compared
        with the token the plain step chooses (what its check would accept at temperature
        0), every probe_interval-th step in a row that drafts nothing."""
        self._off_steps = 0 if k else self._off_steps + 1
        return not k and self._off_steps % self.probe_interval == 0

    def choose(self) -> int:
        """The next step's draft length for one sequence alone (plan_step), 1 on a probe."""
        if self.costs.step is None:       # measure a plain step first
            return self.draft_min
        k = plan_step([self], [self.draft_max], self.costs)[0]
        return 1 if self.probe(k) else k


def plan_step(lengths: list[DraftLength | None], room: list[int], costs: PassCost) -> list[int]:
    """Draft lengths for one batched step of len(lengths) sequences (the server's), None
    where a sequence has no drafter; room[i] caps sequence i's (tokens it may still
    generate, less one).

    Drafts compete with the other sequences' tokens for the same pass: a plain step
    yields N tokens in v(N) seconds. Sequences are taken in turn, each adding the k
    proposals (draft_min..draft_max) that most raise the step's expected tokens per
    second, N + Σ gain(k) over v(N + Σ k) + Σ k·d, and none unless that beats the step
    as it stands: so drafting never lowers the expected throughput, and with several
    sequences decoding (another group of rows must buy more tokens than the step's
    average) it takes a high acceptance. A draft_min above 0 is honoured regardless."""
    n = len(lengths)
    ks = [0] * n
    if costs.step is None:                # measure a plain step first
        return [min(L.draft_min, r) if L else 0 for L, r in zip(lengths, room)]
    tokens, rows, draft_seconds = float(n), n, 0.0

    def speed(L: DraftLength, k: int) -> float:
        return (tokens + L.gain(k)) / (costs.seconds(rows + k) + draft_seconds + L.draft_cost * k)
    for i, (L, r) in enumerate(zip(lengths, room)):
        if L is None or r <= 0:
            continue
        lo, hi = min(max(1, L.draft_min), r), min(L.draft_max, r)
        best = max(range(lo, hi + 1), key=lambda k: speed(L, k))
        if L.draft_min or speed(L, best) > speed(L, 0):
            ks[i] = best
            tokens, rows = tokens + L.gain(best), rows + best
            draft_seconds += L.draft_cost * best
    return ks


def rejection_test(sampler: Sampler, logits: np.ndarray, history: list[int], d: int,
                   q: np.ndarray | None) -> tuple[bool, int | None]:
    """Whether proposal d, drawn from q (V,) (None: a point mass), is accepted where the
    target's logits are `logits`: with probability min(1, p(d)/q(d)); if not, the token
    drawn instead from max(0, p - q), renormalised (p: the sampler's distribution)."""
    p = sampler.distribution(logits, history)
    if sampler.rng.random() < p[d] / (1.0 if q is None else q[d]):
        return True, None
    if q is None:
        residual = p.copy()
        residual[d] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    return False, sampler.draw(residual / residual.sum())
