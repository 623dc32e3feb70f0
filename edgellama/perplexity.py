"""Perplexity and KL divergence over a text, computed the way llama.cpp's llama-perplexity does.

The text is tokenized once (with BOS in front when the vocabulary adds one) and cut into
non-overlapping chunks of n_ctx tokens; the last len(tokens) % n_ctx tokens are not used.
Each chunk is evaluated from position 0 with an empty cache, its first token replaced by
BOS when the vocabulary adds one. Only the second half is scored: the logits at
positions first = n_ctx // 2 .. n_ctx - 2 predict tokens first + 1 .. n_ctx - 1, so each
chunk contributes n_ctx - 1 - n_ctx // 2 scores, each conditioned on at least half a
chunk of context.

Against a reference model, both models run on the same chunk and their log-probabilities
are compared at once, so memory holds one chunk's logits per model, never the text's:
KL(reference || model) per scored position, whether both rank the same token first, and
the perplexity ratio with an error from the two models' covariance (llama.cpp's formulas).
Log-softmax and KL are computed in float64 over the whole vocabulary; llama.cpp stores the
reference's log-probabilities as 16-bit values and drops terms with p < e^-16, so its KL
figures can differ in the last digits.
"""
from __future__ import annotations

import codecs
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import EdgeError

_ROWS = 32   # log-softmax rows per float64 block: 32 × 128k-token vocabulary ≈ 32 MB a copy


def tokenize(tokenizer, text: str) -> list[int]:
    """The text's tokens as llama.cpp's tokenizer gives them with special tokens on: BOS
    first when the vocabulary adds one."""
    ids = tokenizer.encode(text)
    return [tokenizer.bos_id] + ids if tokenizer.add_bos else ids


_BLOCK = 1 << 20   # bytes of the text read at a time


def tokens_needed(n_ctx: int, n_chunks: int | None) -> int | None:
    """Tokens of the text that --chunks needs (None: all of them). Two chunks' worth at
    least, which make_chunks asks of any text."""
    return None if n_chunks is None else max(n_chunks, 2) * n_ctx


def open_text(path: str):
    """The text file, opened for read_tokens (a clear EdgeError when it cannot be)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise EdgeError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise EdgeError(f"{path}: is a directory, expected a text file") from None
    except OSError as e:
        raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None
    if os.path.isdir(path):   # some systems open a directory and fail on read
        f.close()
        raise EdgeError(f"{path}: is a directory, expected a text file")
    return f


def read_tokens(tokenizer, path: str, max_tokens: int | None = None,
                available: int | None = None, f=None) -> tuple[np.ndarray, bool]:
    """The tokens of a UTF-8 text file as `tokenize` gives them for its whole text, read
    and tokenized a block at a time: with max_tokens, reading stops once that many are
    known (the rest of the file is never read), so a text far larger than memory costs
    no more than the chunks asked for. Returns (int32 tokens, whether the whole file was
    read). Without max_tokens, a file larger than half the `available` memory (default:
    the system's) is refused before anything is read. `f`: the file from open_text."""
    with f if f is not None else open_text(path) as f:
        if max_tokens is None:
            _check_fits(path, f, available)
        out = np.empty(1 << 16, np.int32)
        n = 0
        if tokenizer.add_bos:
            out[0], n = tokenizer.bos_id, 1
        whole = True
        try:
            for ids in tokenizer.encode_stream(_text_blocks(path, f)):
                if n + len(ids) > len(out):
                    out = np.resize(out, max(2 * len(out), n + len(ids)))
                out[n:n + len(ids)] = ids
                n += len(ids)
                if max_tokens is not None and n >= max_tokens:
                    whole = not f.read(1)
                    break
        except OSError as e:
            raise EdgeError(f"{path}: cannot read: {e.strerror or e}") from None
        return out[:n].copy(), whole


def _check_fits(path: str, f, available: int | None) -> None:
    try:
        size = os.fstat(f.fileno()).st_size
        if available is None:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return
    # typical text is ~4 bytes a token, held as 4-byte ids: about the file's size again
    if size > available // 2:
        raise EdgeError(f"{path} is {size / 2**30:.1f} GiB and {available / 2**30:.1f} GiB of "
                        f"memory is free: scoring the whole text would not fit; pass --chunks N "
                        f"to read and score only the first N chunks")


def _text_blocks(path: str, f) -> Iterator[str]:
    """The file's text a block at a time, decoded as strict UTF-8 across block edges."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    while True:
        block = f.read(_BLOCK)
        held = len(decoder.getstate()[0])
        try:
            text = decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise EdgeError(f"{path}: not UTF-8 text (invalid byte at offset "
                            f"{offset - held + e.start})") from None
        offset += len(block)
        if text:
            yield text
        if not block:
            return


def first_scored(n_ctx: int) -> int:
    """Position of the first logit scored in a chunk (its first half is context only)."""
    return n_ctx // 2


@dataclass(frozen=True)
class Chunks:
    """The chunks of n_ctx tokens that are evaluated."""
    tokens: np.ndarray      # the whole tokenized text
    n_ctx: int
    n_chunks: int
    bos_id: int | None      # replaces each chunk's first token when the vocabulary adds BOS

    def __len__(self) -> int:
        return self.n_chunks

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.n_chunks):
            chunk = self.tokens[i * self.n_ctx:(i + 1) * self.n_ctx].copy()
            if self.bos_id is not None:
                chunk[0] = self.bos_id
            yield chunk

    @property
    def per_chunk(self) -> int:
        """Scored tokens per chunk."""
        return self.n_ctx - 1 - first_scored(self.n_ctx)


def make_chunks(tokens: Sequence[int], n_ctx: int, n_chunks: int | None = None,
                bos_id: int | None = None, what: str = "the text") -> Chunks:
    """Cut `tokens` into chunks; n_chunks None = as many as fit. Raises EdgeError when the
    text is shorter than 2 × n_ctx tokens, as llama-perplexity does."""
    if n_ctx < 4:
        raise EdgeError(f"--ctx must be at least 4 (half of each chunk is context, the rest "
                        f"is scored), got {n_ctx}")
    if n_chunks is not None and n_chunks < 1:
        raise EdgeError(f"--chunks must be at least 1, got {n_chunks}")
    if len(tokens) < 2 * n_ctx:
        raise EdgeError(f"{what} is {len(tokens)} tokens; perplexity with a context of {n_ctx} "
                        f"needs at least {2 * n_ctx} (2 × ctx): use a longer text or a smaller --ctx")
    available = len(tokens) // n_ctx
    n = available if n_chunks is None else min(n_chunks, available)
    return Chunks(np.asarray(tokens, np.int64), n_ctx, n, bos_id)


def chunk_logits(model, chunk: np.ndarray, seq=None) -> np.ndarray:
    """Logits (n_ctx - 1 - first, V) of a chunk's scored positions. The first half is run
    for its KV cache only and the last token is not run at all: its logits would predict a
    token outside the chunk. seq: the sequence to run it in (reset first; default a new
    one)."""
    first = first_scored(len(chunk))
    seq = seq or model.new_sequence()
    seq.reset()
    model.forward(chunk[:first], seq)
    return model.forward(chunk[first:-1], seq, all_logits=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of float32 logits -> float64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def mean_and_error(total: float, total2: float, n: int) -> tuple[float, float]:
    """Mean of n values from their sum and sum of squares, and the standard error of that
    mean as llama.cpp computes it: sqrt((E[x²] - E[x]²) / (n - 1))."""
    if n < 1:
        return 0.0, 0.0
    mean = total / n
    var = total2 / n - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0


@dataclass
class Result:
    """Running totals for one model; the figures are properties, valid after any chunk."""
    n_ctx: int
    chunks: int = 0
    count: int = 0                 # scored tokens
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    # against a reference (all zero without one)
    has_ref: bool = False
    sum_nll_ref: float = 0.0
    sum_nll_ref2: float = 0.0
    sum_nll_nll_ref: float = 0.0
    sum_kl: float = 0.0
    sum_kl2: float = 0.0
    same_top: int = 0
    kl_values: list[np.ndarray] = field(default_factory=list, repr=False)

    @property
    def ppl(self) -> float:
        return math.exp(mean_and_error(self.sum_nll, self.sum_nll2, self.count)[0])

    @property
    def ppl_err(self) -> float:
        """± of the perplexity: the error of mean(-log p), times PPL (d exp(x) = exp(x) dx)."""
        return self.ppl * mean_and_error(self.sum_nll, self.sum_nll2, self.count)[1]

    @property
    def ref_ppl(self) -> float:
        return math.exp(mean_and_error(self.sum_nll_ref, self.sum_nll_ref2, self.count)[0])

    @property
    def ref_ppl_err(self) -> float:
        return self.ref_ppl * mean_and_error(self.sum_nll_ref, self.sum_nll_ref2, self.count)[1]

    def _log_ratio(self) -> tuple[float, float]:
        # ln(PPL/PPL_ref) and its error; the two models' log-likelihoods are correlated,
        # so their covariance comes off the variance (llama.cpp does not use it below 10)
        a, ea = mean_and_error(self.sum_nll, self.sum_nll2, self.count)
        b, eb = mean_and_error(self.sum_nll_ref, self.sum_nll_ref2, self.count)
        n = self.count
        cov = (self.sum_nll_nll_ref / n - a * b) / (n - 1) if n >= 10 else 0.0
        return a - b, math.sqrt(max(ea * ea + eb * eb - 2 * cov, 0.0))

    @property
    def ppl_ratio(self) -> float:
        return math.exp(self._log_ratio()[0])

    @property
    def ppl_ratio_err(self) -> float:
        return self.ppl_ratio * self._log_ratio()[1]

    @property
    def kl_mean(self) -> float:
        return mean_and_error(self.sum_kl, self.sum_kl2, self.count)[0]

    @property
    def kl_err(self) -> float:
        return mean_and_error(self.sum_kl, self.sum_kl2, self.count)[1]

    def kl_percentile(self, q: float) -> float:
        """KL at percentile q (0..100), linear between ranks as llama.cpp interpolates."""
        return float(np.percentile(np.concatenate(self.kl_values), q))

    @property
    def kl_max(self) -> float:
        return float(max(v.max() for v in self.kl_values))

    @property
    def same_top_frac(self) -> float:
        return self.same_top / self.count

    @property
    def same_top_err(self) -> float:
        p, n = self.same_top_frac, self.count
        return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0

    def add(self, logits: np.ndarray, targets: np.ndarray, ref_logits: np.ndarray | None = None):
        """Score one chunk: logits (n, V) of the scored positions, targets (n,) the tokens
        they predict, ref_logits (n, V) the reference's at the same positions."""
        kls = []
        for r in range(0, len(targets), _ROWS):
            rows = slice(r, r + _ROWS)
            lp = log_softmax(logits[rows])
            t = targets[rows]
            nll = -lp[np.arange(len(t)), t]
            self.sum_nll += float(nll.sum())
            self.sum_nll2 += float((nll * nll).sum())
            if ref_logits is None:
                continue
            lp_ref = log_softmax(ref_logits[rows])
            nll_ref = -lp_ref[np.arange(len(t)), t]
            self.sum_nll_ref += float(nll_ref.sum())
            self.sum_nll_ref2 += float((nll_ref * nll_ref).sum())
            self.sum_nll_nll_ref += float((nll * nll_ref).sum())
            kl = (np.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1)   # KL(reference || model)
            self.sum_kl += float(kl.sum())
            self.sum_kl2 += float((kl * kl).sum())
            self.same_top += int((logits[rows].argmax(-1) == ref_logits[rows].argmax(-1)).sum())
            kls.append(kl)
        if ref_logits is not None:
            self.has_ref = True
            self.kl_values.append(np.concatenate(kls))
        self.count += len(targets)
        self.chunks += 1

    def as_dict(self) -> dict:
        d = {"ctx": self.n_ctx, "chunks": self.chunks, "tokens_scored": self.count,
             "ppl": self.ppl, "ppl_err": self.ppl_err}
        if self.has_ref:
            d.update(ref_ppl=self.ref_ppl, ref_ppl_err=self.ref_ppl_err,
                     ppl_ratio=self.ppl_ratio, ppl_ratio_err=self.ppl_ratio_err,
                     kl_mean=self.kl_mean, kl_err=self.kl_err, kl_median=self.kl_percentile(50),
                     kl_p99=self.kl_percentile(99), kl_max=self.kl_max,
                     same_top=self.same_top_frac, same_top_err=self.same_top_err)
        return d


def evaluate(models: Sequence, chunks: Chunks, ref=None,
             progress: Callable[[int, list[Result]], None] | None = None) -> list[Result]:
    """Perplexity of each model (Transformer-like: new_sequence(ctx), forward(tokens, seq,
    all_logits)) over the chunks, and with `ref` each model's divergence from it. One
    pass: per chunk the reference runs once and each model is compared with it straight
    away. progress(chunks done, results) is called after every chunk."""
    results = [Result(chunks.n_ctx) for _ in models]
    first = first_scored(chunks.n_ctx)
    seqs = [m.new_sequence(chunks.n_ctx) for m in models]
    ref_seq = ref.new_sequence(chunks.n_ctx) if ref is not None else None
    for i, chunk in enumerate(chunks):
        # the original tokens: a chunk's first token is context only, never a target
        targets = chunks.tokens[i * chunks.n_ctx + first + 1:(i + 1) * chunks.n_ctx]
        ref_logits = chunk_logits(ref, chunk, ref_seq) if ref is not None else None
        for model, seq, result in zip(models, seqs, results):
            result.add(chunk_logits(model, chunk, seq), targets, ref_logits)
        if progress:
            progress(i + 1, results)
    return results


def same_vocabulary(a, b) -> str | None:
    """Why two tokenizers would not give the same tokens for a text, or None if they do
    (compared: the token strings, BOS and whether it is added)."""
    ta, tb = a.tokens, b.tokens
    if len(ta) != len(tb):
        return f"{len(ta)} tokens vs {len(tb)}"
    diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if diff is not None:
        return f"token {diff} is {ta[diff]!r} vs {tb[diff]!r}"
    if (a.add_bos, a.bos_id if a.add_bos else None) != (b.add_bos, b.bos_id if b.add_bos else None):
        return "they differ in adding a BOS token"
    return None
